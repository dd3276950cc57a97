"""The scalar-gate chunk forward on SM100 with the delta rule (GDN): the skeleton of
:mod:`cula.sm100.scalar_chunk_fwd` (chunks of C = 128, tcgen05 MMAs, the fp32 state S^T in TMEM across the whole
sequence, the same load, gate, state and output roles), with each chunk's Tinv = (I + A)^-1 given.

Math per chunk (G the chunk's inclusive cumulative gate in log2 units, s the scale):

    P~    = tril(s (Q K^T)_ij 2^(G_i - G_j))                       (bf16)
    Q~    = s 2^G_i q_i                                             (bf16, in place of q)
    Y     = beta (V - 2^G (K S))                                    (bf16 hi + lo)
    V_new = Tinv Y                                                  (bf16 hi + lo)
    O     = Q~ S + P~ V_new
    S^T  <- 2^G_last S^T + (2^(G_last - G) V_new)^T K               (the factor on V_new in fp32, then hi + lo)

Tinv is made before the launch, a row per token (``w`` [B, T, HV, C] bf16: token t's row of its chunk's inverse,
zero past the sequence end; :func:`cula.gdn.chunk_fwd_sm100.chunk_inverses`), and loaded by TMA as a fourth plane of
the q | k | v stage. Made here, the solve's fp32 A (66 KB at C = 128) would not fit beside the chain: the stage
(128 KB), S^T's bf16 operand, P~ and Y's low half (32 KB each) take 224 of the 227 KB. Y and V_new enter their
products as bf16 hi + lo pairs (``chunk_emulation.split``); single roundings there reach the GPU tests' 0.005 bound
in chunks of 128 (DESIGN.md, SM100). Seven tcgen05 products per chunk, M = 128 throughout:

| product | M x N x K | A | B | accumulator |
|---|---|---|---|---|
| P = Q K^T | C x C x K | q | k | P (columns 0-127) |
| K S | C x V x K | k | S^T bf16 | X (384-511) |
| O = Q~ S | C x V x K | Q~ | S^T bf16 | O (128-255) |
| V_new = Tinv Y | C x V x (C + C) | Tinv | Y hi, Y lo (MN-major) | X |
| O += P~ V_new | C x V x (C + C) | P~ | V_new hi, lo (MN-major) | O |
| S^T += V_new'^T K | V x K x (C + C) | V_new' hi, lo (MN-major) | k (MN-major) | S^T (256-383) |

Shared memory, by what each buffer holds as the chunk goes on (every overwrite waits for the products that read the
buffer before: the commit that hands over the next accumulator):

| buffer | loaded / first written | then |
|---|---|---|
| stage plane 0 | q (TMA) | Q~ |
| stage plane 1 | k (TMA) | rows past the sequence end zeroed (varlen), before the update reads it |
| stage plane 2 | v (TMA) | Y hi, then V_new hi |
| stage plane 3 | Tinv (TMA) | V_new' hi |
| Y lo | Y lo | V_new lo |
| S^T operand | S^T bf16 (state role) | V_new' lo |
| P~ | P~ | |

Roles as the scalar kernel's; the scores warpgroup (thread i owns token row i) also makes Y and splits V_new, in two
more hand-offs to the MMA warp: ``scores`` (P~, Q~ and Y written) and ``values`` (V_new's and V_new''s halves
written), and reads the X accumulator twice (``ks_acc``, ``vn_acc``). Tokens past the sequence end: Y and V_new are
selected to zero there, and the k rows zeroed once K S is done (the update's operand may otherwise hold the next
sequence's tokens, NaN included). A split sequence's later passes (:mod:`cula.ops.segment_split`) run without v
(Y = -beta 2^G K S, v not loaded): the transition pass from S = I (no P~, no output; the scores warpgroup idles),
the correction pass from the chained starts, its O added to the first pass's. The forward only (no state walks),
D = 128.
Shapes and launch arguments as :mod:`cula.sm100.scalar_chunk_fwd`'s, beta [B, T, HV] fp32 or bf16 (activated) read
per token, and ``w`` the inverses.
"""

from __future__ import annotations

from typing import NamedTuple

import cutlass
import cutlass.cute as cute
from cutlass import pipeline

from cula.sm90 import tiles
from cula.sm90.chunk_fwd import ChunkFwdConfig
from cula.sm100 import mma, tmem
from cula.sm100.roles import WARPGROUP
from cula.sm100.scalar_chunk_fwd import (
    GATE_SLOTS,
    Params,
    Rings,
    ScalarGateChunkFwdSm100,
    Sequence,
    Tma,
    make_ring,
    scale_row,
    stage_plane_tma,
)

HEAD_DIMS = (128,)

# the scalar kernel's parameters, and Tinv's TMA, beta, and the layouts of Y's low half (a token tile)
DeltaParams = NamedTuple(
    "DeltaParams",
    [*Params.__annotations__.items(), ("tinv", Tma), ("beta", cute.Tensor), ("tile_y", object), ("tile_y_mn", object)],
)
# the scalar kernel's hand-offs, and the chain's: K S and V_new in X (MMA -> scores warpgroup), V_new's halves
# (scores warpgroup -> MMA)
DeltaRings = NamedTuple(
    "DeltaRings",
    [*Rings.__annotations__.items(), ("ks_acc", object), ("y", object), ("vn_acc", object), ("values", object)],
)


class DeltaSmem(NamedTuple):
    sQKV: cute.Tensor  # (C, D, q|k|v|Tinv, 1) K-major
    sQKV_mn: cute.Tensor  # (D, C, q|k|v|Tinv, 1) MN-major
    sP: cute.Tensor  # P~ (C, C)
    sS: cute.Tensor  # S^T bf16 (V, K), then V_new' lo (a token tile: the same layout at C = D)
    sS_mn: cute.Tensor  # its bytes read MN-major (V, C): the update's A operand
    sY: cute.Tensor  # Y lo, then V_new lo (C, V)
    sY_mn: cute.Tensor  # (V, C)
    sG: cute.Tensor  # G (log2) per token and slot (C, GATE_SLOTS)


class DeltaAccumulators(NamedTuple):
    """The scalar kernel's P, O and S^T, and X (C x V): K S, then V_new."""

    p: cute.Tensor
    o: cute.Tensor
    s: cute.Tensor
    x: cute.Tensor


class DeltaChunkFwdSm100(ScalarGateChunkFwdSm100):
    """The kernel (module docstring); ``cfg`` a :class:`cula.sm90.chunk_fwd.ChunkFwdConfig` with the delta rule at
    D = 128: the forward, or a split's transition or correction pass."""

    delta_rule = True
    modes = ("full", "transition", "correction")
    # where the gate's factors go: GDN's scalar gate on the values (the output warpgroup's Y and V_new'), a per-key
    # gate on the keys (cula.sm100.key_delta_chunk_fwd: tiles the scores warpgroup makes)
    gate_on_keys = False

    def __init__(self, config: ChunkFwdConfig):
        super().__init__(config)
        assert config.head_dim in HEAD_DIMS and config.walk == "output", config
        assert not config.qk_l2norm, config  # the host normalises q and k (cula.gdn.chunk_fwd_sm100)
        # a split's later passes walk the delta rule without v (Y = -beta 2^G K S): the correction pass from the
        # chained starts with its output added to the first pass's, the transition pass from S = I without one
        self.makes_scores = config.make_o
        self.updates_state = True
        self.loaded_planes = self.planes = 4
        self.loaded_tiles = ((0,) if config.make_o else ()) + (1,) + ((2,) if config.mode == "full" else ()) + (3,)
        # the output warpgroup makes Y and V_new in every pass
        self.has_output_role = True
        # P, O, S^T and X take all 512 columns
        self.tmem_columns = self.C + 3 * self.D
        # the factors are made from G where they are read (the gate slots' factors would not fit)
        self.gate_factors = False
        # the gate slots' readers: the state and output warpgroups, and the scores warpgroup where it makes P~
        self.gate_threads = (32, (3 if self.makes_scores else 2) * WARPGROUP)

    # ---------------------------------------------------------------- host side
    def host_params(self, q, k, v, g, beta, o, h0, ht, starts, ends, w, slots, scale):
        params, fields = super().host_params(q, k, v, g, beta, o, h0, ht, starts, ends, w, slots, scale)
        C, D = self.C, self.D
        tile_y, tile_y_mn = tiles.token_tiles(C, D)
        tma_tinv = stage_plane_tma(w, params.tile_qkv)  # a (C, C) plane: C = D
        ring = cute.struct.MemRange[cutlass.Int64, 2]
        # the barriers first, then the 1024-byte aligned tiles, G last: 231424 bytes of the SHARED_BYTES (232448) a CTA
        # may take; in the base's order the alignment gaps after G and before Y left none
        moved = {name: fields.pop(name) for name in ("sG", "sQKV", "sP", "sS")}
        fields.update(ring_ks_acc=ring, ring_y=ring, ring_vn_acc=ring, ring_values=ring)
        fields.update(sQKV=moved["sQKV"], sP=moved["sP"], sS=moved["sS"])
        fields["sY"] = cute.struct.Align[cute.struct.MemRange[cutlass.BFloat16, cute.cosize(tile_y)], 1024]
        fields["sG"] = moved["sG"]
        return DeltaParams(*params, tma_tinv, beta, tile_y, tile_y_mn), fields

    # ---------------------------------------------------------------- device side
    def make_smem(self, st, p: DeltaParams) -> DeltaSmem:
        sQKV = st.sQKV.get_tensor(p.tile_qkv.outer, swizzle=p.tile_qkv.inner)
        sS = st.sS.get_tensor(p.tile_s.outer, swizzle=p.tile_s.inner)
        sY = st.sY.get_tensor(p.tile_y.outer, swizzle=p.tile_y.inner)
        return DeltaSmem(
            sQKV,
            tiles.mn_view(sQKV, p.tile_qkv_mn),
            st.sP.get_tensor(p.tile_p.outer, swizzle=p.tile_p.inner),
            sS,
            tiles.mn_view(sS, p.tile_y_mn),
            sY,
            tiles.mn_view(sY, p.tile_y_mn),
            st.sG.get_tensor(cute.make_layout((self.C, GATE_SLOTS))),
        )

    def make_rings(self, st) -> DeltaRings:
        return DeltaRings(
            *super().make_rings(st),
            ks_acc=make_ring(pipeline.PipelineUmmaAsync, 1, WARPGROUP, st.ring_ks_acc),
            y=make_ring(pipeline.PipelineAsyncUmma, WARPGROUP, 1, st.ring_y),
            vn_acc=make_ring(pipeline.PipelineUmmaAsync, 1, WARPGROUP, st.ring_vn_acc),
            values=make_ring(pipeline.PipelineAsyncUmma, WARPGROUP, 1, st.ring_values),
        )

    def accumulators(self, p: DeltaParams, tmem_base) -> DeltaAccumulators:
        base = super().accumulators(p, tmem_base)
        return DeltaAccumulators(*base, mma.accumulator(p.mma_qs, self.D, tmem_base, self.C + 2 * self.D))

    def load_sources(self, p: DeltaParams, seq: Sequence) -> tuple:
        return (*super().load_sources(p, seq), (p.tinv, seq.hv))

    @cute.jit
    def mma_warp(self, p: DeltaParams, smem: DeltaSmem, rings: DeltaRings, acc: DeltaAccumulators, seq: Sequence):
        """Per chunk: P = Q K^T; once S^T's operand is ready, K S; once the scores and Y are, O = Q~ S and V_new =
        Tinv Y; once V_new's halves are, O += P~ V_new and the update; then the stage, the scores, the state and the
        halves released (commits that arrive when those products are done)."""
        qkv, scores, state, o_acc = rings.qkv, rings.scores, rings.state, rings.o_acc
        ks_acc, y_ring, vn_acc, values = rings.ks_acc, rings.y, rings.vn_acc, rings.values
        consumer = pipeline.make_pipeline_state(pipeline.PipelineUserType.Consumer, 1)
        producer = pipeline.make_pipeline_state(pipeline.PipelineUserType.Producer, 1)
        for _chunk in cutlass.range(seq.n_chunks, unroll=1):
            qkv.consumer_wait(consumer)
            self.hand_over_scores(p, smem, rings, acc, consumer, producer)
            state.consumer_wait(consumer)
            ks_acc.producer_acquire(producer)
            tmem.after_handoff()
            self.issue_projection(p, smem, acc)
            ks_acc.producer_commit(producer)
            if cutlass.const_expr(self.makes_scores):
                scores.consumer_wait(consumer)
            if cutlass.const_expr(self.cfg.make_o):
                o_acc.producer_acquire(producer)
            y_ring.consumer_wait(consumer)
            vn_acc.producer_acquire(producer)
            tmem.after_handoff()
            self.issue_values(p, smem, acc)
            vn_acc.producer_commit(producer)
            values.consumer_wait(consumer)
            tmem.after_handoff()
            if cutlass.const_expr(self.cfg.make_o):
                self.issue_output(p, smem, acc)
                o_acc.producer_commit(producer)
            self.issue_update(p, smem, acc)
            values.consumer_release(consumer)
            y_ring.consumer_release(consumer)
            state.consumer_release(consumer)
            if cutlass.const_expr(self.makes_scores or self.gate_on_keys):
                scores.consumer_release(consumer)
            qkv.consumer_release(consumer)
            consumer.advance()
            producer.advance()

    @cute.jit
    def issue_projection(self, p: DeltaParams, smem: DeltaSmem, acc: DeltaAccumulators):
        """The chunk's K S into X, issued."""
        ks_a, ks_b = mma.operands(p.mma_qs, smem.sQKV[None, None, 1, 0], smem.sS)
        mma.gemm(p.mma_qs, acc.x, ks_a, ks_b, True)

    @cute.jit
    def issue_values(self, p: DeltaParams, smem: DeltaSmem, acc: DeltaAccumulators):
        """The chunk's O = Q~ S (where it makes O), and V_new = Tinv (Y hi + Y lo) into X (K S read), issued."""
        if cutlass.const_expr(self.cfg.make_o):
            qs_a, qs_b = mma.operands(p.mma_qs, smem.sQKV[None, None, 0, 0], smem.sS)
            mma.gemm(p.mma_qs, acc.o, qs_a, qs_b, True)
        hi_a, hi_b = mma.operands(p.mma_pv, smem.sQKV[None, None, 3, 0], smem.sQKV_mn[None, None, 2, 0])
        mma.gemm(p.mma_pv, acc.x, hi_a, hi_b, True)
        lo_a, lo_b = mma.operands(p.mma_pv, smem.sQKV[None, None, 3, 0], smem.sY_mn)
        mma.gemm(p.mma_pv, acc.x, lo_a, lo_b, False)

    @cute.jit
    def issue_output(self, p: DeltaParams, smem: DeltaSmem, acc: DeltaAccumulators):
        """The chunk's O += P~ (V_new hi + V_new lo), issued."""
        hi_a, hi_b = mma.operands(p.mma_pv, smem.sP, smem.sQKV_mn[None, None, 2, 0])
        mma.gemm(p.mma_pv, acc.o, hi_a, hi_b, False)
        lo_a, lo_b = mma.operands(p.mma_pv, smem.sP, smem.sY_mn)
        mma.gemm(p.mma_pv, acc.o, lo_a, lo_b, False)

    @cute.jit
    def issue_update(self, p: DeltaParams, smem: DeltaSmem, acc: DeltaAccumulators):
        """The chunk's S^T += (V_new' hi + V_new' lo)^T K (a gate on the keys: (V_new hi + lo)^T K~), issued."""
        hi, lo = self.update_values(smem)
        hi_a, hi_b = mma.operands(p.mma_state, hi, smem.sQKV_mn[None, None, 1, 0])
        mma.gemm(p.mma_state, acc.s, hi_a, hi_b, False)
        lo_a, lo_b = mma.operands(p.mma_state, lo, smem.sQKV_mn[None, None, 1, 0])
        mma.gemm(p.mma_state, acc.s, lo_a, lo_b, False)

    def update_values(self, smem: DeltaSmem) -> tuple:
        """The update's A operand read MN-major, ``(hi, lo)``: V_new' over Tinv's plane and S^T's operand."""
        return smem.sQKV_mn[None, None, 3, 0], smem.sS_mn

    @cute.jit
    def scores_role(self, p: DeltaParams, smem: DeltaSmem, rings: DeltaRings, acc: DeltaAccumulators, seq, tid):
        """Thread ``tid`` owns token row i: P~ (the scalar kernel's), then Q~_i = s 2^G_i q_i in place (a transition
        pass makes neither)."""
        if cutlass.const_expr(not self.makes_scores):
            return
        p_rows = tmem.Rows(acc.p, self.C, tid)
        i = p_rows.row()
        frag = tmem.fragment(p_rows)
        gate, qkv, scores, p_acc = rings.gate, rings.qkv, rings.scores, rings.p_acc
        gate_pos = pipeline.make_pipeline_state(pipeline.PipelineUserType.Consumer, GATE_SLOTS)
        consumer = pipeline.make_pipeline_state(pipeline.PipelineUserType.Consumer, 1)
        producer = pipeline.make_pipeline_state(pipeline.PipelineUserType.Producer, 1)
        for chunk in cutlass.range(seq.n_chunks, unroll=1):
            slot = gate_pos.index
            gate.consumer_wait(gate_pos)
            qkv.consumer_wait(consumer)  # uncounted: the MMA warp releases the stage
            scores.producer_acquire(producer)
            p_acc.consumer_wait(consumer)
            tmem.after_handoff()
            self.gated_scores(p, smem, p_rows, frag, slot, seq.seqlen - chunk * self.C)
            tmem.before_handoff()
            p_acc.consumer_release(consumer)
            start = p.scale * cute.math.exp2(smem.sG[i, slot], fastmath=True)
            scale_row(smem.sQKV[None, None, 0, 0], i, start, True)
            # generic-proxy writes that the tensor cores read next
            cute.arch.fence_proxy("async.shared", space="cta")
            scores.producer_commit(producer)
            gate.consumer_release(gate_pos)
            gate_pos.advance()
            consumer.advance()
            producer.advance()
        scores.producer_tail(producer)

    @cute.jit
    def output_role(self, p: DeltaParams, smem: DeltaSmem, rings: DeltaRings, acc: DeltaAccumulators, seq, tid):
        """Thread ``tid`` owns token row i. Per chunk, once K S is made: Y_i = beta_i (v_i - 2^G_i (K S)_i), hi over
        v_i and lo into Y's tile (zero past the sequence end, where k_i is zeroed too); once V_new is made: V_new_i
        (zero past the end) hi over v_i and lo over Y's, 2^(G_last - G_i) V_new_i hi over Tinv's row i and lo over
        S^T's operand; once O is made, its row stored. With the gate on the keys (``gate_on_keys``) the keys carry
        its factors: Y_i = beta_i (v_i - (K S)_i), no V_new', and the walk zeroes the key rows."""
        C, D = self.C, self.D
        cols = tmem.COLUMNS_PER_COPY
        f32 = cutlass.Float32
        x_rows = tmem.Rows(acc.x, D, tid)
        o_rows = tmem.Rows(acc.o, D, tid)
        i = x_rows.row()
        frag = tmem.fragment(x_rows)
        packed = cute.make_rmem_tensor(cute.make_layout((1, 8)), cutlass.BFloat16)
        sK, sV, sTinv = (smem.sQKV[None, None, plane, 0] for plane in (1, 2, 3))
        gBeta = p.beta[seq.b, None, seq.hv]
        gO = p.o[seq.b, None, seq.hv, None]
        gate, qkv, y_ring, values = rings.gate, rings.qkv, rings.y, rings.values
        ks_acc, vn_acc, o_acc = rings.ks_acc, rings.vn_acc, rings.o_acc
        gate_pos = pipeline.make_pipeline_state(pipeline.PipelineUserType.Consumer, GATE_SLOTS)
        consumer = pipeline.make_pipeline_state(pipeline.PipelineUserType.Consumer, 1)
        producer = pipeline.make_pipeline_state(pipeline.PipelineUserType.Producer, 1)
        for chunk in cutlass.range(seq.n_chunks, unroll=1):
            in_sequence = i < seq.seqlen - chunk * C
            # clamped into the sequence instead of branching, so the load stays in flight
            beta_i = gBeta[seq.tok0 + cutlass.min(chunk * C + i, seq.seqlen - 1)].to(f32)
            # the factors on the values: 2^G_i on K S, 2^(G_last - G_i) on V_new (on the keys: neither)
            start = to_end = f32(1.0)
            if cutlass.const_expr(not self.gate_on_keys):
                slot = gate_pos.index
                gate.consumer_wait(gate_pos)
                G_i = smem.sG[i, slot]
                start = cute.math.exp2(G_i, fastmath=True)
                to_end = cute.math.exp2(smem.sG[C - 1, slot] - G_i, fastmath=True)
                gate.consumer_release(gate_pos)
            qkv.consumer_wait(consumer)  # uncounted: the v tile landed (the MMA warp releases the stage)
            y_ring.producer_acquire(producer)
            ks_acc.consumer_wait(consumer)
            tmem.after_handoff()
            # (a rolled loop: unrolled, ptxas hoisted the row's swizzled addresses in four tiles and spilled them)
            for blk in cutlass.range(D // cols, unroll=1):
                tmem.read(x_rows, blk, frag)
                for part in cutlass.range_constexpr(cols // 8):
                    if cutlass.const_expr(self.cfg.mode == "full"):
                        cute.autovec_copy(cute.local_tile(sV, (1, 8), (i, blk * (cols // 8) + part)), packed)
                    else:  # the later passes' v = 0
                        packed.fill(0.0)
                    for e in cutlass.range_constexpr(8):
                        c = 8 * part + e
                        y = beta_i * (packed[0, e].to(f32) - start * frag[c])
                        frag[c] = y if in_sequence else f32(0.0)
                tmem.store_row_split(sV, smem.sY, i, blk * cols, frag)
            tmem.before_handoff()
            ks_acc.consumer_release(consumer)
            if cutlass.const_expr(self.cfg.is_varlen and not self.gate_on_keys):  # (the walk zeroes K~'s rows)
                if not in_sequence:
                    scale_row(sK, i, f32(0.0), False)
            # generic-proxy writes that the tensor cores read next
            cute.arch.fence_proxy("async.shared", space="cta")
            y_ring.producer_commit(producer)
            values.producer_acquire(producer)
            vn_acc.consumer_wait(consumer)
            tmem.after_handoff()
            for blk in cutlass.range(D // cols, unroll=1):
                tmem.read(x_rows, blk, frag)
                for c in cutlass.range_constexpr(cols):
                    frag[c] = frag[c] if in_sequence else f32(0.0)
                tmem.store_row_split(sV, smem.sY, i, blk * cols, frag)
                if cutlass.const_expr(not self.gate_on_keys):
                    for c in cutlass.range_constexpr(cols):
                        frag[c] = frag[c] * to_end
                    tmem.store_row_split(sTinv, smem.sS, i, blk * cols, frag)
            tmem.before_handoff()
            vn_acc.consumer_release(consumer)
            cute.arch.fence_proxy("async.shared", space="cta")
            values.producer_commit(producer)
            if cutlass.const_expr(self.cfg.make_o):
                o_acc.consumer_wait(consumer)
                tmem.after_handoff()
                self.store_output(o_rows, frag, gO, seq.tok0 + chunk * C + i, in_sequence)
                tmem.before_handoff()
                o_acc.consumer_release(consumer)
            if cutlass.const_expr(not self.gate_on_keys):
                gate_pos.advance()
            consumer.advance()
            producer.advance()
        # the last releases arrive before the kernel exits (each tail walks its own copy of the position)
        y_ring.producer_tail(producer.clone())
        values.producer_tail(producer)
