"""The per-key-gate chunk forward on SM100 without the delta rule (GLA): the scalar-gate kernel's skeleton
(:mod:`cula.sm100.scalar_chunk_fwd`: chunks of C = 128, tcgen05 MMAs, the state in TMEM, the same load, state and
output roles), with a gate G in R^K per token.

Math per chunk (G the chunk's inclusive cumulative gate per key channel in log2 units, s the scale):

    P~ = tril(s sum_k Q_ik K_jk 2^(G_ik - G_jk))                            (bf16)
    Q~ = s 2^G_i * q_i,  K~ = 2^(G_last - G_j) * k_j                         (bf16, in place of q and k)
    O  = Q~ S + P~ V
    S^T <- S^T diag(2^G_last) + V^T K~

The scores P: the chunk's columns in four blocks of 32 tokens, block J against its middle token r = 32 J + 16 (the
SM90 kernel's halves, narrower): L^J_i = q_i 2^(G_i - G_r) for the rows i >= 32 J, R_j = k_j 2^(G_r - G_j) for its
columns, and P[:, block J] = L^J R_J^T, one 128 x 32 x K MMA each. Rows before a block are masked by the scores'
selects, so L^J's rows there are never written. Two left-operand buffers take the blocks in turn (L^0, L^1; then L^2,
L^3 once P's first two blocks are done); R is made in place in the k tile, and K~ = R_j 2^(G_last - G_r) over it (a
second rounding by a factor <= 1) once P is done. The operands' exponents are at most the decay between a block's
reference and its ends: while that is within GLA_SAFE_SPAN for every key channel they are exact up to bf16 rounding.
A steeper chunk makes P directly instead: every entry summed over the keys in fp32 with 2^(G_ik - G_jk) <= 1 from G
in fp32 (64 KB, in the buffers' place), written into P's TMEM columns (exact for any gate; slow).
``chunk_emulation.key_gate_forward(..., chunk=128, blocks=4, gated_operands=True)`` runs this scheme on a CPU.

Roles: as the scalar kernel's, but the gate warp idles and the scores warpgroup walks the gate: thread k owns key
channel k for the column walks (the gate's running sum, stored per token in its TMEM lane of a fourth accumulator,
G^T; L^J, R, Q~ and K~ column k) and token row i for P~ (P from TMEM, masked by selects, scaled). It passes the
chunk's per-key decay 2^G_last to the state warpgroup through the gate ring (two slots), and each two left-operand
blocks to the MMA warp through the ``blocks`` ring (released when their products are done).

TMEM: P (columns 0-127), O (C ..), S^T (C + D ..), G^T (C + 2 D .., 128 columns; lane k = key channel k).
Shared memory: the q | k | v stage, the two left-operand buffers (P~ over them once P is done; G in fp32 in a steep
chunk), S^T's bf16 operand, the decay slots.

A split sequence runs the scalar kernel's correction pass: no P and no update, Q~ from the walk. The backward's
state walks (``ChunkFwdConfig.walk``) run as the scalar kernel's: no P and no output, the walk scaling only the key
tile, by 2^(G_last - G) ("states") or s 2^G in the key place that holds q ("state_grads", from the last chunk). Shapes as :mod:`cula.sm100.scalar_chunk_fwd`, but g [B, T, H,
D] fp32: the natural-log gate per key channel, one value head per q / k head. D = 64 or 128.
"""

from __future__ import annotations

import math
from typing import NamedTuple

import cutlass
import cutlass.cute as cute
from cutlass import pipeline

from cula.ops.gates import GATE_FLOOR, GLA_SAFE_SPAN
from cula.sm90 import sequence, tiles
from cula.sm90.chunk_fwd import ChunkFwdConfig
from cula.sm100 import mma, tmem
from cula.sm100.roles import WARP, WARPGROUP, Barrier
from cula.sm100.scalar_chunk_fwd import (
    GATE_SLOTS,
    Params,
    Rings,
    ScalarGateChunkFwdSm100,
    Sequence,
    make_ring,
    scale_row,
)

BLOCKS = 4  # the scores' column blocks, each against its middle token
_LOG2E = math.log2(math.e)

# the scalar kernel's parameters, and the scores' block MMA (M x 32 x K) and the left-operand buffers' layout
KeyParams = NamedTuple("KeyParams", [*Params.__annotations__.items(), ("mma_block", object), ("tile_l", object)])
# the scalar kernel's hand-offs, and the walk's left operands of P's first two and last two column blocks
KeyRings = NamedTuple("KeyRings", [*Rings.__annotations__.items(), ("blocks_01", object), ("blocks_23", object)])


class KeySmem(NamedTuple):
    sQKV: cute.Tensor  # (C, D, q|k|v[|zeros], 1)
    sQKV_mn: cute.Tensor  # (D, C, q|k|v[|zeros], 1)
    sV_rows: cute.Tensor  # (128, C): v^T's rows, zero past D
    sL: cute.Tensor  # the two left-operand buffers (C, D, 2) K-major
    sP: cute.Tensor  # P~ (C, C) K-major, over the buffers
    sGrid: cute.Tensor  # a steep chunk's G (C, D) fp32, over the buffers
    sS: cute.Tensor  # S^T bf16 (V, K)
    sDec: cute.Tensor  # 2^G_last per key channel and gate slot (D, GATE_SLOTS)
    sSpan: cute.Tensor  # each warp's widest operand exponent (4,)


class KeyAccumulators(NamedTuple):
    """The TMEM accumulators: the scalar kernel's P, O and S^T; P's four column blocks (M x 32); G^T (M x C)."""

    p: cute.Tensor
    o: cute.Tensor
    s: cute.Tensor
    p_blocks: tuple
    g: cute.Tensor


class KeyGate:
    """A per-key gate on an SM100 chunk kernel's skeleton: the gate warp idles; the scores warpgroup walks the gate
    (thread k: key channel k), its running sum per token in its TMEM lane of G^T, scales the chunk's tiles by it
    (:meth:`walk_scaled`) and passes the chunk's decay 2^G_last per key channel to the state warpgroup through the
    gate ring (``smem.sDec``), which decays S^T's key columns by it. Mixed in ahead of the skeleton's class
    (:class:`KeyGateChunkFwdSm100`, and KDA's :class:`cula.sm100.key_delta_chunk_fwd.KeyDeltaChunkFwdSm100`)."""

    @cute.jit
    def gate_warp(self, p, smem, rings, seq: Sequence):
        """No work: the scores warpgroup walks the per-key gate."""
        pass

    def chunk_decay(self, smem, slot):
        return None

    def column_decay(self, decay, smem, slot, column: int):
        """2^G_last of key channel ``column``, from the walk."""
        return smem.sDec[column, slot]

    @cute.jit
    def walk_scaled(
        self,
        smem,
        g_rows,
        G_last,
        key,
        valid,
        scale,
        scale_q: cutlass.Constexpr,
        key_factor: cutlass.Constexpr,
        start_keys=None,
    ):
        """Column ``key`` of Q~ = s 2^G q over the q tile (``scale_q``), and of the raw key tile times 2^(G_last - G)
        (``key_factor`` "end": a steep chunk's K~, the states walk's) or s 2^G ("start": the state-gradient walk,
        whose key place holds q), zero past the sequence end ("none": left as it is). A correction pass takes Q~
        alone, a walk the key tile alone. With ``start_keys`` (a (C, D) bf16 tile) also K 2^G there, from the raw keys
        (the delta rule's projection of the state, :mod:`cula.sm100.key_delta_chunk_fwd`)."""
        C = self.C
        f32, bf16 = cutlass.Float32, cutlass.BFloat16
        cols = tmem.COLUMNS_PER_COPY
        sQ, sK = smem.sQKV[None, None, 0, 0], smem.sQKV[None, None, 1, 0]
        for blk in cutlass.range(C // cols, unroll=1):
            G = tmem.fragment(g_rows)
            tmem.read(g_rows, blk, G)
            for e in cutlass.range_constexpr(cols):
                t = blk * cols + e
                if cutlass.const_expr(scale_q):
                    sQ[t, key] = (sQ[t, key].to(f32) * scale * cute.math.exp2(G[e], fastmath=True)).to(bf16)
                if cutlass.const_expr(start_keys is not None):
                    start_keys[t, key] = (sK[t, key].to(f32) * cute.math.exp2(G[e], fastmath=True)).to(bf16)
                if cutlass.const_expr(key_factor != "none"):
                    if cutlass.const_expr(key_factor == "end"):
                        factor = cute.math.exp2(G_last - G[e], fastmath=True)
                    else:
                        factor = scale * cute.math.exp2(G[e], fastmath=True)
                    sK[t, key] = (sK[t, key].to(f32) * factor).to(bf16) if t < valid else bf16(0.0)


class KeyGateChunkFwdSm100(KeyGate, ScalarGateChunkFwdSm100):
    """The kernel (module docstring); ``cfg`` a :class:`cula.sm90.chunk_fwd.ChunkFwdConfig` without the delta rule,
    the forward (a full pass, or a split's correction pass) or one of the backward's state walks."""

    def __init__(self, config: ChunkFwdConfig):
        super().__init__(config)
        self.block = self.C // BLOCKS
        # P, O, S^T and G^T (lane k: key channel k, a column per token)
        self.g_column = self.C + 2 * self.D
        self.tmem_columns = 1 << (self.g_column + self.C - 1).bit_length()
        # the gate ring's producer and consumer: the scores warpgroup (the walk) and the state warpgroup
        self.gate_threads = (WARPGROUP, WARPGROUP)
        # the backward's state walks scale the key tile: K~ ("states"), or s 2^G q in the key place ("state_grads")
        self.walk_key_factor = "none" if not self.updates_state else ("start" if config.reverse else "end")

    # ---------------------------------------------------------------- host side
    def host_params(self, q, k, v, g, beta, o, h0, ht, starts, ends, w, slots, scale):
        params, fields = super().host_params(q, k, v, g, beta, o, h0, ht, starts, ends, w, slots, scale)
        C, D = self.C, self.D
        tile_l, _ = tiles.token_tiles(C, D, 2)
        f32, bf16 = cutlass.Float32, cutlass.BFloat16
        for name in ("sG", "sFac", "sP"):  # the scalar gate's slots; P~ goes over the left-operand buffers
            del fields[name]
        fields.update(
            ring_blocks_01=cute.struct.MemRange[cutlass.Int64, 2],
            ring_blocks_23=cute.struct.MemRange[cutlass.Int64, 2],
            sDec=cute.struct.Align[cute.struct.MemRange[f32, D * GATE_SLOTS], 16],
            sSpan=cute.struct.Align[cute.struct.MemRange[f32, WARPGROUP // WARP], 16],
            # C x D x 2 bf16: the two buffers, P~ (C x C, C <= 2 D) or G (C x D fp32)
            sL=cute.struct.Align[cute.struct.MemRange[bf16, cute.cosize(tile_l)], 1024],
        )
        return KeyParams(*params, mma.tiled_mma("K", "K", self.block), tile_l), fields

    # ---------------------------------------------------------------- device side
    def make_smem(self, st, p: KeyParams) -> KeySmem:
        C, D = self.C, self.D
        sQKV = st.sQKV.get_tensor(p.tile_qkv.outer, swizzle=p.tile_qkv.inner)
        sL = st.sL.get_tensor(p.tile_l.outer, swizzle=p.tile_l.inner)
        sP = cute.make_tensor(cute.recast_ptr(sL.iterator, p.tile_p.inner), p.tile_p.outer)
        grid_ptr = cute.recast_ptr(st.sL.data_ptr(), dtype=cutlass.Float32)
        return KeySmem(
            sQKV,
            tiles.mn_view(sQKV, p.tile_qkv_mn),
            tiles.mn_view(sQKV[None, None, 2, 0], p.tile_v_mn),
            sL,
            sP,
            cute.make_tensor(grid_ptr, cute.make_layout((C, D), stride=(D, 1))),
            st.sS.get_tensor(p.tile_s.outer, swizzle=p.tile_s.inner),
            st.sDec.get_tensor(cute.make_layout((D, GATE_SLOTS))),
            st.sSpan.get_tensor(cute.make_layout(WARPGROUP // WARP)),
        )

    def make_rings(self, st) -> KeyRings:
        blocks_01 = make_ring(pipeline.PipelineAsyncUmma, WARPGROUP, 1, st.ring_blocks_01)
        blocks_23 = make_ring(pipeline.PipelineAsyncUmma, WARPGROUP, 1, st.ring_blocks_23)
        return KeyRings(*super().make_rings(st), blocks_01, blocks_23)

    def accumulators(self, p: KeyParams, tmem_base) -> KeyAccumulators:
        base = super().accumulators(p, tmem_base)
        blocks = tuple(mma.accumulator(p.mma_block, self.block, tmem_base, J * self.block) for J in range(BLOCKS))
        return KeyAccumulators(*base, blocks, mma.accumulator(p.mma_qk, self.C, tmem_base, self.g_column))

    @cute.jit
    def issue_scores(self, p: KeyParams, smem: KeySmem, rings: KeyRings, acc: KeyAccumulators, consumer):
        """P's column blocks two at a time as the walk makes their operands, each pair's buffers released when its
        products are done (in a steep chunk they read stale buffers, and the direct scores overwrite P)."""
        sK = smem.sQKV[None, None, 1, 0]
        for pair, blocks in ((0, rings.blocks_01), (1, rings.blocks_23)):
            blocks.consumer_wait(consumer)
            tmem.after_handoff()
            for J in (2 * pair, 2 * pair + 1):
                right = cute.local_tile(sK, (self.block, self.D), (J, 0))
                l_op, r_op = mma.operands(p.mma_block, smem.sL[None, None, J % 2], right)
                mma.gemm(p.mma_block, acc.p_blocks[J], l_op, r_op, True)
            blocks.consumer_release(consumer)

    @cute.jit
    def scores_role(self, p: KeyParams, smem: KeySmem, rings: KeyRings, acc: KeyAccumulators, seq: Sequence, tid):
        """The gate walk and the scores (module docstring). Per chunk: G per key channel into TMEM and its decay into
        a gate slot; in a full pass L^0, L^1 and R, then (their products done) L^2, L^3 and Q~, then (P done) K~ and
        P~, or in a steep chunk P made directly, then Q~ and K~; in a correction pass Q~ alone, in a state walk the
        key tile alone."""
        C, D = self.C, self.D
        g_rows = tmem.Rows(acc.g, C, tid)
        key = tid  # the column walks' key channel (threads past D have none)
        has_key = self.within_head(key)
        gG = p.g[seq.b, None, seq.h, None]
        scale = p.scale
        gate, qkv, scores, p_acc = rings.gate, rings.qkv, rings.scores, rings.p_acc
        blocks_01, blocks_23 = rings.blocks_01, rings.blocks_23
        gate_pos = pipeline.make_pipeline_state(pipeline.PipelineUserType.Producer, GATE_SLOTS)
        consumer = pipeline.make_pipeline_state(pipeline.PipelineUserType.Consumer, 1)
        producer = pipeline.make_pipeline_state(pipeline.PipelineUserType.Producer, 1)
        # the first blocks' buffers are acquired a chunk ahead: that acquire is also the wait for their products
        # before the last blocks' operands go over them
        ahead = pipeline.make_pipeline_state(pipeline.PipelineUserType.Producer, 1)
        if cutlass.const_expr(self.makes_scores):
            blocks_01.producer_acquire(ahead)
        for chunk in cutlass.range(seq.n_chunks, unroll=1):
            pos = sequence.chunk_position(chunk, seq.n_chunks, self.cfg.reverse)
            valid = seq.seqlen - pos * C
            refs = self.scan_gates(gG, g_rows, seq.tok0 + pos * C, valid, cutlass.min(key, D - 1))
            gate.producer_acquire(gate_pos)
            if has_key:
                smem.sDec[key, gate_pos.index] = cute.math.exp2(refs[BLOCKS], fastmath=True)
            gate.producer_commit(gate_pos)
            gate_pos.advance()
            qkv.consumer_wait(consumer)  # uncounted: the MMA warp releases the stage
            scores.producer_acquire(producer)  # the previous chunk's P~ (over the buffers), Q~ and K~ read
            if cutlass.const_expr(self.makes_scores):
                steep = self.is_steep(smem, refs, tid)
                if not steep:
                    if has_key:
                        self.walk_left_blocks(smem, g_rows, refs, key, 0, scale, False)
                cute.arch.fence_proxy("async.shared", space="cta")
                blocks_01.producer_commit(ahead)
                ahead.advance()
                blocks_01.producer_acquire(ahead)  # L^0 and L^1 read
                blocks_23.producer_acquire(producer)
                if not steep:
                    if has_key:
                        self.walk_left_blocks(smem, g_rows, refs, key, 1, scale, True)
                cute.arch.fence_proxy("async.shared", space="cta")
                blocks_23.producer_commit(producer)
                p_acc.consumer_wait(consumer)  # every block's product done: the buffers and R free
                tmem.after_handoff()
                if steep:
                    self.direct_scores(smem, g_rows, acc, key, has_key, tid)
                    if has_key:
                        self.walk_scaled(smem, g_rows, refs[BLOCKS], key, valid, scale, True, "end")
                else:
                    if has_key:
                        self.walk_end_keys(smem, refs, key, valid)
                self.write_scores(smem, acc, tid, valid, scale)
                tmem.before_handoff()
                p_acc.consumer_release(consumer)
            else:
                if has_key:
                    self.walk_scaled(
                        smem, g_rows, refs[BLOCKS], key, valid, scale, self.cfg.make_o, self.walk_key_factor
                    )
                if cutlass.const_expr(self.updates_state):
                    self.zero_tail_values(smem, tid, valid)
            cute.arch.fence_proxy("async.shared", space="cta")
            scores.producer_commit(producer)
            consumer.advance()
            producer.advance()
        tmem.before_handoff()  # the walk's last TMEM accesses ordered before the barrier that frees TMEM
        if cutlass.const_expr(self.makes_scores):
            blocks_23.producer_tail(producer.clone())  # (a tail advances the position it is given)
        scores.producer_tail(producer)

    @cute.jit
    def scan_gates(self, gG, g_rows, t0, valid, key):
        """Key channel ``key``'s G over the chunk (tokens ``t0`` ..; past the sequence end G stays flat) into this
        thread's TMEM lane of G^T. Returns G at the blocks' middle tokens and G_last, ``(G_16, G_48, G_80, G_112,
        G_last)``, and the widest operand exponent as a sixth entry."""
        C = self.C
        f32 = cutlass.Float32
        cols = tmem.COLUMNS_PER_COPY
        raw = cute.make_rmem_tensor(cute.make_layout(cols), f32)
        marks = cute.make_rmem_tensor(cute.make_layout(BLOCKS * 3), f32)  # per block: G at its start, middle, end
        run = f32(0.0)
        for blk in cutlass.range_constexpr(C // cols):
            for e in cutlass.range_constexpr(cols):
                raw[e] = f32(0.0)
                if blk * cols + e < valid:
                    raw[e] = gG[t0 + blk * cols + e, key]
            frag = tmem.fragment(g_rows)
            for e in cutlass.range_constexpr(cols):
                t = blk * cols + e
                run = run + (cutlass.max(raw[e], f32(GATE_FLOOR)) if t < valid else f32(0.0))
                frag[e] = run * _LOG2E
                if cutlass.const_expr(t % self.block in (0, self.block // 2, self.block - 1)):
                    which = {0: 0, self.block // 2: 1, self.block - 1: 2}[t % self.block]
                    marks[3 * (t // self.block) + which] = frag[e]
            tmem.write(g_rows, blk, frag)
        tmem.stores_done()
        widest = f32(0.0)
        for J in cutlass.range_constexpr(BLOCKS):
            widest = cutlass.max(widest, marks[3 * J] - marks[3 * J + 1], marks[3 * J + 1] - marks[3 * J + 2])
        return (marks[1], marks[4], marks[7], marks[10], marks[3 * BLOCKS - 1], widest)

    @cute.jit
    def is_steep(self, smem: KeySmem, refs, tid):
        """Whether any key channel's widest operand exponent passes GLA_SAFE_SPAN (every thread of the warpgroup)."""
        widest = refs[BLOCKS + 1] if tid < self.D else cutlass.Float32(0.0)
        for shift in cutlass.range_constexpr(5):
            widest = cutlass.max(widest, cute.arch.shuffle_sync_bfly(widest, offset=1 << shift))
        if cute.arch.lane_idx() == 0:
            smem.sSpan[tid // WARP] = widest
        cute.arch.barrier(barrier_id=Barrier.WALK, number_of_threads=WARPGROUP)
        widest = smem.sSpan[0]
        for w in cutlass.range_constexpr(1, WARPGROUP // WARP):
            widest = cutlass.max(widest, smem.sSpan[w])
        steep = widest > GLA_SAFE_SPAN
        # every warp's read done before the next chunk's writes
        cute.arch.barrier(barrier_id=Barrier.WALK, number_of_threads=WARPGROUP)
        return steep

    @cute.jit
    def walk_left_blocks(self, smem: KeySmem, g_rows, refs, key, pair: cutlass.Constexpr, scale, scale_q):
        """Column ``key`` of L^J = q 2^(G - G_r) for blocks J = 2 pair and 2 pair + 1 (rows from the block's first on),
        into buffer J % 2; with ``pair`` 0 also R_j = k_j 2^(G_r - G_j) in place over the k tile, and with
        ``scale_q`` Q~ = s 2^G q over the q tile once the row's L^J are made."""
        C = self.C
        f32, bf16 = cutlass.Float32, cutlass.BFloat16
        cols = tmem.COLUMNS_PER_COPY
        sQ, sK = smem.sQKV[None, None, 0, 0], smem.sQKV[None, None, 1, 0]
        first = 2 * pair * self.block  # rows before it belong to no block of this pair
        for blk in cutlass.range_constexpr(0 if scale_q else first // cols, C // cols):
            G = tmem.fragment(g_rows)
            tmem.read(g_rows, blk, G)
            for e in cutlass.range_constexpr(cols):
                t = blk * cols + e
                x = sQ[t, key].to(f32)
                for J in cutlass.range_constexpr(2 * pair, 2 * pair + 2):
                    if cutlass.const_expr(t >= J * self.block):
                        smem.sL[t, key, J % 2] = (x * cute.math.exp2(G[e] - refs[J], fastmath=True)).to(bf16)
                if cutlass.const_expr(pair == 0):
                    J = t // self.block
                    sK[t, key] = (sK[t, key].to(f32) * cute.math.exp2(refs[J] - G[e], fastmath=True)).to(bf16)
                if cutlass.const_expr(scale_q):
                    sQ[t, key] = (x * scale * cute.math.exp2(G[e], fastmath=True)).to(bf16)

    @cute.jit
    def walk_end_keys(self, smem: KeySmem, refs, key, valid):
        """Column ``key`` of K~_j = R_j 2^(G_last - G_r) over R (zero past the sequence end)."""
        f32, bf16 = cutlass.Float32, cutlass.BFloat16
        sK = smem.sQKV[None, None, 1, 0]
        for J in cutlass.range_constexpr(BLOCKS):
            factor = cute.math.exp2(refs[BLOCKS] - refs[J], fastmath=True)
            for e in cutlass.range_constexpr(self.block):
                t = J * self.block + e
                sK[t, key] = (sK[t, key].to(f32) * factor).to(bf16) if t < valid else bf16(0.0)

    @cute.jit
    def direct_scores(self, smem: KeySmem, g_rows, acc: KeyAccumulators, key, has_key, tid):
        """A steep chunk's P into its TMEM columns: G written out as a (C, D) fp32 grid over the buffers (column
        ``key`` by each thread that owns one), then thread ``tid`` sums row i = tid of P directly, P_ij = sum_k q_ik k_jk
        2^(G_ik - G_jk) with the exponent capped at 0 (the entries past the diagonal, where it is positive, are
        masked by the scores' selects). The keys are walked from ``i`` on, so that a warp's threads read distinct
        banks of their rows."""
        C, D = self.C, self.D
        f32 = cutlass.Float32
        cols = tmem.COLUMNS_PER_COPY
        sQ, sK, grid = smem.sQKV[None, None, 0, 0], smem.sQKV[None, None, 1, 0], smem.sGrid
        if has_key:
            for blk in cutlass.range(C // cols, unroll=1):
                G = tmem.fragment(g_rows)
                tmem.read(g_rows, blk, G)
                for e in cutlass.range_constexpr(cols):
                    grid[blk * cols + e, key] = G[e]
        cute.arch.barrier(barrier_id=Barrier.WALK, number_of_threads=WARPGROUP)
        p_rows = tmem.Rows(acc.p, C, tid)
        i = p_rows.row()
        for jb in cutlass.range(C // cols, unroll=1):
            frag = tmem.fragment(p_rows)
            frag.fill(0.0)
            for kk in cutlass.range(D, unroll=4):
                c = (kk + i) % D
                x = sQ[i, c].to(f32)
                G_i = grid[i, c]
                for e in cutlass.range_constexpr(cols):
                    j = jb * cols + e
                    factor = cute.math.exp2(cutlass.min(G_i - grid[j, c], f32(0.0)), fastmath=True)
                    frag[e] = frag[e] + x * sK[j, c].to(f32) * factor
            tmem.write(p_rows, jb, frag)
        tmem.stores_done()
        # the grid read by every thread before the walk and the scores write over q, k and the buffers
        cute.arch.barrier(barrier_id=Barrier.WALK, number_of_threads=WARPGROUP)

    @cute.jit
    def write_scores(self, smem: KeySmem, acc: KeyAccumulators, tid, valid, scale):
        """Thread ``tid`` owns token row i: P~_ij = s P_ij where j <= i and j is in the sequence, else 0 (selects),
        over the buffers; in a varlen call v_i zeroed past the sequence end (the rows hold the next sequence's)."""
        C = self.C
        f32 = cutlass.Float32
        p_rows = tmem.Rows(acc.p, C, tid)
        i = p_rows.row()
        frag = tmem.fragment(p_rows)
        for blk in cutlass.range_constexpr(C // tmem.COLUMNS_PER_COPY):
            tmem.read(p_rows, blk, frag)
            for e in cutlass.range_constexpr(tmem.COLUMNS_PER_COPY):
                j = blk * tmem.COLUMNS_PER_COPY + e
                frag[e] = frag[e] * scale if j <= i and j < valid else f32(0.0)
            tmem.store_row_bf16(smem.sP, i, blk * tmem.COLUMNS_PER_COPY, frag)
        self.zero_tail_values(smem, i, valid)

    @cute.jit
    def zero_tail_values(self, smem: KeySmem, i, valid):
        """In a varlen call, v_i zeroed past the sequence end (the rows hold the next sequence's tokens) by thread i."""
        if cutlass.const_expr(self.cfg.is_varlen):
            if i >= valid:
                scale_row(smem.sQKV[None, None, 2, 0], i, cutlass.Float32(0.0), False)
