"""Passes 3 and 4 of the gated linear backward for a scalar gate (simple GLA, Lightning; :mod:`cula.ops.chunk_backward`)
on SM100: one CTA per (chunk row, head) makes the chunk's dq, dk, dv and the gate's gradient from its tokens and the
SM100 state walks' checkpoints (chunks of C = 128 tokens), every product a tcgen05 MMA into tensor memory.

Per chunk (G the cumulative log2 gate, Gamma_ij = 2^(G_i - G_j) for j <= i < valid, zero elsewhere by a select; S^T and
dS'^T the checkpoints, stored (V, K)):

    dP~ = scale (dO V^T) Gamma,  P~ = scale (Q K^T) Gamma                   (bf16)
    dq  = scale 2^G (dO S) + dP~ K
    dk  = 2^(G_L - G) (V dS'^T) + dP~^T Q
    dv  = 2^(G_L - G) (K dS') + P~^T dO
    dg_t = sum_{s >= t} (q_s . dq_s - k_s . dk_s) + sum_j k_j . dk_j^inter + 2^G_L sum (S * dS')

Every product has M = C = 128 (a row per token), so D = 64 and 128 take the same shapes:

| product | M x N x K | A | B | TMEM columns |
|---|---|---|---|---|
| dP = dO V^T | C x C x V | dO | v | 0-127 |
| P = Q K^T | C x C x K | q | k | 128-255 |
| dq = dO S | C x K x V | dO | S^T (MN-major) | 256 .. |
| dk = V dS'^T | C x K x V | v | dS'^T (MN-major) | 256 + D .. |
| dv = K dS' | C x V x K | k | dS'^T | 0 .., once dP is read |
| dq += dP~ K | C x K x C | dP~ | k (MN-major) | dq's |
| dk += dP~^T Q | C x K x C | dP~ (MN-major) | q (MN-major) | dk's |
| dv += P~^T dO | C x V x C | P~ (MN-major) | dO (MN-major) | dv's |

The inter-chunk parts are scaled row by row in TMEM (scale 2^G_i for dq, 2^(G_L - G_j) for dk and dv) before the
intra-chunk products accumulate over them.

Roles (:class:`cula.sm100.roles.GradientRole`): warp 0 the TMA loads (q, k, v, dO and the two checkpoints, one
barrier); warp 1 every MMA (and the TMEM allocation); warp 2 the gates (G, scale 2^G, 2^(G_L - G)), and dg once the
row sums are in; three warpgroups whose thread i owns row i of the accumulators: SCORES (dP~, the rows past a varlen
chunk's end of q, k and dO zeroed, then P~, then dv), QUERIES (sum (S * dS') as soon as the checkpoints land, then dq)
and KEYS (dk). At D = 128 dP~ goes over S and P~ over dS' (the six tiles and the two score tiles would take 256 KB): S
is free once dq's inter product is done and the state sum has read it, dS' once dv's inter product is done.

Hand-offs, each used once (one chunk per CTA): ``loads`` (TMA -> MMA; the QUERIES warpgroup waits on it uncounted),
``first`` (dP, P and the inter parts of dq and dk made), ``scores`` (dP~ written, dP read), ``dq_scaled`` and
``dk_scaled`` (the inter parts scaled), ``dv_inter``, ``transposed`` (P~ written, dv's inter part scaled), ``dq``,
``dk``, ``dv`` (the finished accumulators); named barriers for the gates, the state sum's reads and the row sums.

Shapes and launch arguments as :class:`cula.sm90.scalar_chunk_bwd.ScalarGateChunkBwdSm90`'s, chunk rows of 128 tokens
(the SM100 walks' checkpoint rows). D = 64 or 128.
"""

from __future__ import annotations

from typing import NamedTuple

import cutlass
import cutlass.cute as cute
from cutlass import pipeline
from cutlass.cute.nvgpu import cpasync

from cula.ops.gates import GATE_FLOOR
from cula.sm90 import tiles
from cula.sm90.scalar_chunk_bwd import Loads, ScalarGateChunkBwdSm90, Tensors
from cula.sm90.scalar_gates import warp_scan_64
from cula.sm100 import mma, tmem
from cula.sm100.roles import THREADS, WARP, WARPGROUP, Barrier, GradientRole
from cula.sm100.scalar_chunk_fwd import CHUNK, SHARED_BYTES, make_ring, scale_row, scan_chunk_gates

_GATE_THREADS = WARP + 3 * WARPGROUP  # the gate warp, and the three warpgroups that read its gates


class Params(NamedTuple):
    loads: Loads
    t: Tensors
    scale: cutlass.Float32
    mma_scores: object  # (C x C), both operands K-major: dP, P
    mma_inter: object  # (C x D), B MN-major: dq's and dk's inter parts, dq's intra part
    mma_values: object  # (C x D), both K-major: dv's inter part
    mma_transposed: object  # (C x D), both MN-major: dk's and dv's intra parts
    tile_tok: object  # (C, D, 1) K-major
    tile_tok_mn: object
    tile_state: object  # (D, D, 1) K-major
    tile_state_mn: object
    tile_scores: object  # (C, C) K-major
    tile_scores_mn: object


class Smem(NamedTuple):
    sQ: cute.Tensor  # (C, D) each
    sK: cute.Tensor
    sV: cute.Tensor
    sDO: cute.Tensor
    sS: cute.Tensor  # S^T (V, K)
    sDS: cute.Tensor  # dS'^T (V, K)
    sDP: cute.Tensor  # dP~ (C, C): over S at D = 128
    sPT: cute.Tensor  # P~ (C, C): over dS' at D = 128
    sG: cute.Tensor  # G (log2) per token (C,)
    sFac: cute.Tensor  # per token: scale 2^G, 2^(G_L - G) (0 past the end)  (C, 2)
    sRows: cute.Tensor  # per token: q . dq, k . dk, k . dk^inter (0 past the end)  (C, 3)
    sWarps: cute.Tensor  # each QUERIES warp's part of sum (S * dS')  (4,)


class Rings(NamedTuple):
    loads: object
    first: object
    scores: object
    dq_scaled: object
    dk_scaled: object
    dv_inter: object
    transposed: object
    dq: object
    dk: object
    dv: object


class Accumulators(NamedTuple):
    dp: cute.Tensor  # (C x C) at TMEM column 0
    p: cute.Tensor  # (C x C) at C
    dq: cute.Tensor  # (C x D) at 2 C
    dk: cute.Tensor  # (C x D) at 2 C + D
    dv: cute.Tensor  # (C x D) at 0, over dP


class Chunk(NamedTuple):
    valid: cutlass.Int32  # the chunk's tokens (1 .. C)
    b: cutlass.Int32
    t0: cutlass.Int32
    h: cutlass.Int32


class ScalarGateChunkBwdSm100(ScalarGateChunkBwdSm90):
    """The kernel (module docstring). ``tile_copies`` is taken for the SM90 kernels' signature and not read."""

    def __init__(self, head_dim: int, is_varlen: bool, tile_copies: bool = True):
        super().__init__(head_dim, is_varlen, tile_copies)
        self.C = CHUNK
        self.threads = THREADS
        # dP, P, dq and dk (dv over dP); an allocation is a power of two of at least 32 columns
        self.tmem_columns = 1 << (2 * self.C + 2 * self.D - 1).bit_length()
        # at D = 128 the score tiles go over the checkpoints, at D = 64 they are tiles of their own
        self.scores_over_states = self.D * self.D == self.C * self.C

    # ---------------------------------------------------------------- host side
    @cute.jit
    def __call__(self, q, k, v, do, g, states, state_grads, chunks, dq, dk, dv, dg, scale, stream):
        C, D = self.C, self.D
        t = Tensors(q, k, v, do, g, states, state_grads, chunks, dq, dk, dv, dg)
        loads, tile_tok, tile_tok_mn, tile_state, tile_state_mn = self.chunk_loads(q, k, v, do, states, state_grads)
        tile_scores, tile_scores_mn = tiles.token_tiles(C, C)
        p = Params(
            loads, t, scale, mma.tiled_mma("K", "K", C), mma.tiled_mma("K", "MN", D), mma.tiled_mma("K", "K", D),
            mma.tiled_mma("MN", "MN", D), tile_tok, tile_tok_mn, tile_state, tile_state_mn, tile_scores,
            tile_scores_mn,
        )  # fmt: skip
        f32, bf16 = cutlass.Float32, cutlass.BFloat16
        ring = cute.struct.MemRange[cutlass.Int64, 2]

        def tile(elems):
            return cute.struct.Align[cute.struct.MemRange[bf16, elems], 1024]

        fields = {
            **{f"ring_{name}": ring for name in Rings._fields},
            "tmem_address": cutlass.Int32,
            "sG": cute.struct.Align[cute.struct.MemRange[f32, C], 16],
            "sFac": cute.struct.Align[cute.struct.MemRange[f32, 2 * C], 16],
            "sRows": cute.struct.Align[cute.struct.MemRange[f32, 3 * C], 16],
            "sWarps": cute.struct.Align[cute.struct.MemRange[f32, WARPGROUP // WARP], 16],
            **{name: tile(cute.cosize(tile_tok)) for name in ("sQ", "sK", "sV", "sDO")},
            "sS": tile(cute.cosize(tile_state)),
            "sDS": tile(cute.cosize(tile_state)),
        }
        if cutlass.const_expr(not self.scores_over_states):
            fields.update(sDP=tile(cute.cosize(tile_scores)), sPT=tile(cute.cosize(tile_scores)))
        self.storage = cute.struct(type("Storage", (), {"__annotations__": fields}))
        # refused at compile time (the compile check), not by the launch on a GPU
        assert self.storage.size_in_bytes() <= SHARED_BYTES, (self.D, self.storage.size_in_bytes())
        # one CTA per SM (its shared memory allows no second): said to ptxas, which otherwise may cap registers at 64
        self.kernel(p).launch(
            grid=(chunks.shape[0], q.shape[2], 1),
            block=(THREADS, 1, 1),
            smem=self.storage.size_in_bytes(),
            stream=stream,
            min_blocks_per_mp=1,
        )

    # ---------------------------------------------------------------- device side
    def make_smem(self, st, p: Params) -> Smem:
        C = self.C
        sQ, sK, sV, sDO, sS, sDS = self.loaded_tiles(st, p)
        scores = (st.sS, st.sDS) if self.scores_over_states else (st.sDP, st.sPT)
        sDP, sPT = (field.get_tensor(p.tile_scores.outer, swizzle=p.tile_scores.inner) for field in scores)
        return Smem(
            *(x[None, None, 0] for x in (sQ, sK, sV, sDO, sS, sDS)),
            sDP,
            sPT,
            st.sG.get_tensor(cute.make_layout(C)),
            st.sFac.get_tensor(cute.make_layout((C, 2))),
            st.sRows.get_tensor(cute.make_layout((C, 3))),
            st.sWarps.get_tensor(cute.make_layout(WARPGROUP // WARP)),
        )

    def make_rings(self, st) -> Rings:
        """Every hand-off (module docstring), each used once; made with ``defer_sync``."""
        load_bytes = (4 * self.C * self.D + 2 * self.D * self.D) * 2
        to_mma, from_mma = (pipeline.PipelineAsyncUmma, WARPGROUP, 1), (pipeline.PipelineUmmaAsync, 1, WARPGROUP)
        return Rings(
            loads=make_ring(pipeline.PipelineTmaUmma, 1, 1, st.ring_loads, tx_count=load_bytes),
            first=make_ring(pipeline.PipelineUmmaAsync, 1, 3 * WARPGROUP, st.ring_first),
            scores=make_ring(*to_mma, st.ring_scores),
            dq_scaled=make_ring(*to_mma, st.ring_dq_scaled),
            dk_scaled=make_ring(*to_mma, st.ring_dk_scaled),
            dv_inter=make_ring(*from_mma, st.ring_dv_inter),
            transposed=make_ring(*to_mma, st.ring_transposed),
            dq=make_ring(*from_mma, st.ring_dq),
            dk=make_ring(*from_mma, st.ring_dk),
            dv=make_ring(*from_mma, st.ring_dv),
        )

    def accumulators(self, p: Params, tmem_base) -> Accumulators:
        C, D = self.C, self.D
        return Accumulators(
            mma.accumulator(p.mma_scores, C, tmem_base, 0),
            mma.accumulator(p.mma_scores, C, tmem_base, C),
            mma.accumulator(p.mma_inter, D, tmem_base, 2 * C),
            mma.accumulator(p.mma_inter, D, tmem_base, 2 * C + D),
            mma.accumulator(p.mma_values, D, tmem_base, 0),
        )

    @cute.kernel
    def kernel(self, p: Params):
        tidx, row, h, warp, lane, valid, b, t0 = self.coordinates(p.t)
        chunk = Chunk(valid, b, t0, h)
        if valid > 0:  # (a chunk row past its sequence's chunks: the whole CTA exits)
            st = cutlass.utils.SmemAllocator().allocate(self.storage)
            smem = self.make_smem(st, p)
            rings = self.make_rings(st)
            if warp == GradientRole.LOAD:
                for tma, _ in p.loads:
                    cpasync.prefetch_descriptor(tma)
            cute.arch.mbarrier_init_fence()
            cute.arch.sync_threads()

            tmem_alloc, tmem_base = tmem.allocate(st.tmem_address.ptr, self.tmem_columns, GradientRole.MMA)
            acc = self.accumulators(p, tmem_base)

            wg_tid = tidx % WARPGROUP
            if warp == GradientRole.LOAD:
                self.issue_loads(p, rings.loads, *self.loaded_tiles(st, p), b, t0, h, h, row)
            elif warp == GradientRole.MMA:
                self.mma_warp(p, smem, rings, acc)
            elif warp == GradientRole.GATE:
                self.gate_warp(p, smem, chunk, lane)
            elif warp >= GradientRole.KEYS:
                self.keys_role(p, smem, rings, acc, chunk, wg_tid)
            elif warp >= GradientRole.QUERIES:
                self.queries_role(p, smem, rings, acc, chunk, wg_tid, warp, lane)
            elif warp >= GradientRole.SCORES:
                self.scores_role(p, smem, rings, acc, chunk, wg_tid)

            tmem.free(tmem_alloc, tmem_base, warp, GradientRole.MMA)

    @cute.jit
    def mma_warp(self, p: Params, smem: Smem, rings: Rings, acc: Accumulators):
        """dP, P and the inter parts of dq and dk once the tiles land; dv's inter part once dP is read; the intra
        parts as their scores and scaled accumulators are ready. Nothing is released: each hand-off is used once."""
        consumer = pipeline.make_pipeline_state(pipeline.PipelineUserType.Consumer, 1)
        producer = pipeline.make_pipeline_state(pipeline.PipelineUserType.Producer, 1)
        sS_mn, sDS_mn = (tiles.mn_plane(x, p.tile_state_mn) for x in (smem.sS, smem.sDS))
        rings.loads.consumer_wait(consumer)
        rings.first.producer_acquire(producer)
        self.issue(p.mma_scores, acc.dp, smem.sDO, smem.sV, True)
        self.issue(p.mma_scores, acc.p, smem.sQ, smem.sK, True)
        self.issue(p.mma_inter, acc.dq, smem.sDO, sS_mn, True)
        self.issue(p.mma_inter, acc.dk, smem.sV, sDS_mn, True)
        rings.first.producer_commit(producer)
        sQ_mn, sK_mn, sDO_mn = (self.mn(x, p) for x in (smem.sQ, smem.sK, smem.sDO))
        sDP_mn, sPT_mn = (self.scores_mn(x, p) for x in (smem.sDP, smem.sPT))
        for ready, done, product in (
            (rings.scores, rings.dv_inter, (p.mma_values, acc.dv, smem.sK, smem.sDS, True)),
            (rings.dq_scaled, rings.dq, (p.mma_inter, acc.dq, smem.sDP, sK_mn, False)),
            (rings.dk_scaled, rings.dk, (p.mma_transposed, acc.dk, sDP_mn, sQ_mn, False)),
            (rings.transposed, rings.dv, (p.mma_transposed, acc.dv, sPT_mn, sDO_mn, False)),
        ):
            ready.consumer_wait(consumer)
            done.producer_acquire(producer)
            tmem.after_handoff()
            self.issue(*product)
            done.producer_commit(producer)

    @cute.jit
    def issue(self, tiled, acc, a, b, zero_init: cutlass.Constexpr):
        """acc (+)= A B^T (``b`` given (N, K)), issued."""
        a_op, b_op = mma.operands(tiled, a, b)
        mma.gemm(tiled, acc, a_op, b_op, zero_init)

    def mn(self, tile, p: Params):
        """The MN-major (D, C) view of a (C, D) token tile."""
        return tiles.mn_plane(tile, p.tile_tok_mn)

    def scores_mn(self, tile, p: Params):
        """The transposed (C, C) view of a score tile, read MN-major."""
        return tiles.mn_plane(tile, p.tile_scores_mn)

    @cute.jit
    def gate_warp(self, p: Params, smem: Smem, chunk: Chunk, lane):
        """The chunk's G = cumsum(max(g, floor)) log2(e) (lane l holds tokens l + 32 m), scale 2^G and 2^(G_L - G)
        (zero past the end) for the three warpgroups; once their row sums are in, dg."""
        C = self.C
        f32 = cutlass.Float32
        gG = p.t.g[chunk.b, None, chunk.h]
        x = cute.make_rmem_tensor(cute.make_layout(C // WARP), f32)
        for m in cutlass.range_constexpr(C // WARP):
            t = lane + WARP * m
            x[m] = f32(0.0)
            if t < chunk.valid:
                x[m] = cutlass.max(gG[chunk.t0 + t], f32(GATE_FLOOR))
        G = cute.make_rmem_tensor(cute.make_layout(C // WARP), f32)
        G_last = scan_chunk_gates(x, G, lane)
        for m in cutlass.range_constexpr(C // WARP):
            t = lane + WARP * m
            smem.sG[t] = G[m]
            smem.sFac[t, 0] = p.scale * cute.math.exp2(G[m], fastmath=True)
            smem.sFac[t, 1] = cute.math.exp2(G_last - G[m], fastmath=True) if t < chunk.valid else f32(0.0)
        cute.arch.barrier_arrive(barrier_id=Barrier.GATES, number_of_threads=_GATE_THREADS)
        cute.arch.barrier(barrier_id=Barrier.ROWS, number_of_threads=WARP + 2 * WARPGROUP)
        self.gate_gradient(p, smem, chunk, G_last, lane)

    @cute.jit
    def gate_gradient(self, p: Params, smem: Smem, chunk: Chunk, G_last, lane):
        """dg_t = sum_{s >= t} (q . dq - k . dk)_s + sum_j (k . dk^inter)_j + 2^G_L sum (S * dS'), four tokens per
        lane (l + 32 m), stored for the chunk's tokens."""
        C = self.C
        f32 = cutlass.Float32
        local = cute.make_rmem_tensor(cute.make_layout(C // WARP), f32)
        inter = f32(0.0)
        for m in cutlass.range_constexpr(C // WARP):
            t = lane + WARP * m
            local[m] = smem.sRows[t, 0] - smem.sRows[t, 1]
            inter = inter + smem.sRows[t, 2]
        for shift in cutlass.range_constexpr(5):
            inter = inter + cute.arch.shuffle_sync_bfly(inter, offset=1 << shift)
        states = f32(0.0)
        for w in cutlass.range_constexpr(WARPGROUP // WARP):
            states = states + smem.sWarps[w]
        constant = inter + cute.math.exp2(G_last, fastmath=True) * states
        # suffix sums: the second 64 tokens first, then the first 64 after the second's total
        late_lo, late_hi = warp_scan_64(local[2], local[3], lane, True)
        early_lo, early_hi = warp_scan_64(local[0], local[1], lane, True)
        later = cute.arch.shuffle_sync(late_lo, 0)
        sums = (early_lo + later, early_hi + later, late_lo, late_hi)
        gDg = p.t.dg[chunk.b, None, chunk.h]
        for m in cutlass.range_constexpr(C // WARP):
            t = lane + WARP * m
            if t < chunk.valid:
                gDg[chunk.t0 + t] = sums[m] + constant

    @cute.jit
    def scores_role(self, p: Params, smem: Smem, rings: Rings, acc: Accumulators, chunk: Chunk, tid):
        """Thread ``tid`` owns token row i: dP~ row i (over S at D = 128, once the state sum has read it); in a varlen
        call q, k and dO rows zeroed past the chunk's end (the next sequence's tokens, NaN included: the intra
        products multiply them by zero scores); once dv's inter part is made, its row scaled by 2^(G_L - G_i) and P~
        row i (over dS'); once dv is done, its row stored."""
        C = self.C
        f32 = cutlass.Float32
        consumer = pipeline.make_pipeline_state(pipeline.PipelineUserType.Consumer, 1)
        producer = pipeline.make_pipeline_state(pipeline.PipelineUserType.Producer, 1)
        # uncounted: the TMA writes of the tiles it zeroes ordered before it (not only through the MMA warp's wait)
        rings.loads.consumer_wait(consumer)
        cute.arch.barrier(barrier_id=Barrier.GATES, number_of_threads=_GATE_THREADS)
        rings.first.consumer_wait(consumer)
        tmem.after_handoff()
        cute.arch.barrier(barrier_id=Barrier.STATES_READ, number_of_threads=2 * WARPGROUP)
        dp_rows = tmem.Rows(acc.dp, C, tid)
        i = dp_rows.row()
        in_sequence = i < chunk.valid
        rings.scores.producer_acquire(producer)
        self.masked_scores(p, smem, dp_rows, smem.sDP, chunk.valid)
        if cutlass.const_expr(self.is_varlen):
            if not in_sequence:
                for tile in (smem.sQ, smem.sK, smem.sDO):
                    scale_row(tile, i, f32(0.0), False)
        tmem.before_handoff()
        # generic-proxy writes that the tensor cores read next
        cute.arch.fence_proxy("async.shared", space="cta")
        rings.scores.producer_commit(producer)
        rings.dv_inter.consumer_wait(consumer)
        tmem.after_handoff()
        dv_rows = tmem.Rows(acc.dv, self.D, tid)
        self.scale_row_sum(dv_rows, smem.sFac[i, 1], None, in_sequence)
        rings.transposed.producer_acquire(producer)
        self.masked_scores(p, smem, tmem.Rows(acc.p, C, tid), smem.sPT, chunk.valid)
        tmem.before_handoff()
        cute.arch.fence_proxy("async.shared", space="cta")
        rings.transposed.producer_commit(producer)
        rings.dv.consumer_wait(consumer)
        tmem.after_handoff()
        self.finish_row(dv_rows, None, p.t.dv[chunk.b, None, chunk.h, None], chunk.t0 + i, in_sequence)
        tmem.before_handoff()

    @cute.jit
    def masked_scores(self, p: Params, smem: Smem, rows, tile, valid):
        """Row i of a (C x C) score accumulator (``rows``: this thread's) into the bf16 ``tile``: scale x_ij 2^(G_i -
        G_j) where j <= i < ``valid``, else 0 (selects)."""
        i = rows.row()
        G_i = smem.sG[i]
        for blk in cutlass.range_constexpr(self.C // tmem.COLUMNS_PER_COPY):
            frag = tmem.fragment(rows)
            tmem.read(rows, blk, frag)
            for e in cutlass.range_constexpr(tmem.COLUMNS_PER_COPY):
                j = blk * tmem.COLUMNS_PER_COPY + e
                keep = j <= i and i < valid
                decay = cute.math.exp2(G_i - smem.sG[j] if keep else cutlass.Float32(0.0), fastmath=True)
                frag[e] = frag[e] * p.scale * decay if keep else cutlass.Float32(0.0)
            tmem.store_row_bf16(tile, i, blk * tmem.COLUMNS_PER_COPY, frag)

    @cute.jit
    def queries_role(self, p: Params, smem: Smem, rings: Rings, acc: Accumulators, chunk: Chunk, tid, warp, lane):
        """Once the checkpoints land, sum (S * dS') (thread v: row v of both); then dq (:meth:`make_output`: its inter
        part scaled by scale 2^G_i, q_i . dq_i)."""
        consumer = pipeline.make_pipeline_state(pipeline.PipelineUserType.Consumer, 1)
        rings.loads.consumer_wait(consumer)  # uncounted: the MMA warp's wait is the one the ring counts
        self.state_sum(smem, tid, warp, lane)
        cute.arch.barrier_arrive(barrier_id=Barrier.STATES_READ, number_of_threads=2 * WARPGROUP)
        cute.arch.barrier(barrier_id=Barrier.GATES, number_of_threads=_GATE_THREADS)
        gX = p.t.dq[chunk.b, None, chunk.h, None]
        self.make_output(smem, rings, rings.dq_scaled, rings.dq, acc.dq, 0, None, smem.sQ, gX, 0, chunk, tid)

    @cute.jit
    def keys_role(self, p: Params, smem: Smem, rings: Rings, acc: Accumulators, chunk: Chunk, tid):
        """dk (:meth:`make_output`: its inter part scaled by 2^(G_L - G_j), k_j . dk_j^inter and k_j . dk_j)."""
        consumer = pipeline.make_pipeline_state(pipeline.PipelineUserType.Consumer, 1)
        rings.loads.consumer_wait(consumer)  # uncounted: the k tile's TMA writes ordered before its row reads
        cute.arch.barrier(barrier_id=Barrier.GATES, number_of_threads=_GATE_THREADS)
        gX = p.t.dk[chunk.b, None, chunk.h, None]
        self.make_output(smem, rings, rings.dk_scaled, rings.dk, acc.dk, 1, 2, smem.sK, gX, 1, chunk, tid)

    @cute.jit
    def make_output(
        self,
        smem: Smem,
        rings: Rings,
        scaled,
        done,
        acc,
        factor: cutlass.Constexpr,
        inter_sum: cutlass.Constexpr,
        tile,
        gX,
        row_sum: cutlass.Constexpr,
        chunk: Chunk,
        tid,
    ):
        """Thread ``tid`` owns row i of dq or dk (``acc``): once its inter part is made, the row scaled in place by
        ``smem.sFac[i, factor]`` (and, with ``inter_sum``, its dot with ``tile``'s row i into ``smem.sRows[i,
        inter_sum]``), handed to the MMA warp (``scaled``); once the intra part is added (``done``), the row's dot
        with the tile's into ``smem.sRows[i, row_sum]`` and the row stored to ``gX`` (T, D); then the row sums'
        barrier."""
        consumer = pipeline.make_pipeline_state(pipeline.PipelineUserType.Consumer, 1)
        producer = pipeline.make_pipeline_state(pipeline.PipelineUserType.Producer, 1)
        rows = tmem.Rows(acc, self.D, tid)
        i = rows.row()
        in_sequence = i < chunk.valid
        rings.first.consumer_wait(consumer)
        tmem.after_handoff()
        scaled.producer_acquire(producer)
        inter = self.scale_row_sum(rows, smem.sFac[i, factor], tile if inter_sum is not None else None, in_sequence)
        if cutlass.const_expr(inter_sum is not None):
            smem.sRows[i, inter_sum] = inter
        tmem.before_handoff()
        scaled.producer_commit(producer)
        done.consumer_wait(consumer)
        tmem.after_handoff()
        smem.sRows[i, row_sum] = self.finish_row(rows, tile, gX, chunk.t0 + i, in_sequence)
        tmem.before_handoff()
        cute.arch.barrier_arrive(barrier_id=Barrier.ROWS, number_of_threads=WARP + 2 * WARPGROUP)

    @cute.jit
    def state_sum(self, smem: Smem, tid, warp, lane):
        """sum (S * dS') over the two checkpoints, thread v summing row v (none past D), each warp's part into
        ``smem.sWarps``."""
        D = self.D
        f32 = cutlass.Float32
        s_frag = cute.make_rmem_tensor(cute.make_layout((1, 8)), cutlass.BFloat16)
        ds_frag = cute.make_rmem_tensor(cute.make_layout((1, 8)), cutlass.BFloat16)
        x = f32(0.0)
        if tid < D:
            for blk in cutlass.range_constexpr(D // 8):
                cute.autovec_copy(cute.local_tile(smem.sS, (1, 8), (tid, blk)), s_frag)
                cute.autovec_copy(cute.local_tile(smem.sDS, (1, 8), (tid, blk)), ds_frag)
                for e in cutlass.range_constexpr(8):
                    x = x + s_frag[0, e].to(f32) * ds_frag[0, e].to(f32)
        for shift in cutlass.range_constexpr(5):
            x = x + cute.arch.shuffle_sync_bfly(x, offset=1 << shift)
        if lane == 0:
            smem.sWarps[warp % (WARPGROUP // WARP)] = x

    @cute.jit
    def scale_row_sum(self, rows, factor, tile, in_sequence):
        """This thread's row of a (C x D) accumulator times ``factor`` in place; with a token ``tile`` (C, D) also
        returns the row's dot product with the tile's row (0 past the chunk's end, where the tile is not read)."""
        total = cutlass.Float32(0.0)
        for blk in cutlass.range_constexpr(self.D // tmem.COLUMNS_PER_COPY):
            frag = tmem.fragment(rows)
            tmem.read(rows, blk, frag)
            for e in cutlass.range_constexpr(tmem.COLUMNS_PER_COPY):
                frag[e] = frag[e] * factor
            if cutlass.const_expr(tile is not None):
                total = total + self.row_dot(tile, rows.row(), blk, frag, in_sequence)
            tmem.write(rows, blk, frag)
        tmem.stores_done()
        return total

    @cute.jit
    def finish_row(self, rows, tile, gX, token, in_sequence):
        """This thread's row of a finished (C x D) accumulator rounded to bf16 into row ``token`` of ``gX`` (T, D)
        where the token is in the chunk; with a token ``tile`` returns the row's dot product with the tile's row (0
        past the end)."""
        cols = tmem.COLUMNS_PER_COPY
        total = cutlass.Float32(0.0)
        packed = cute.make_rmem_tensor(cute.make_layout((1, 8)), cutlass.BFloat16)
        for blk in cutlass.range_constexpr(self.D // cols):
            frag = tmem.fragment(rows)
            tmem.read(rows, blk, frag)
            if cutlass.const_expr(tile is not None):
                total = total + self.row_dot(tile, rows.row(), blk, frag, in_sequence)
            if in_sequence:
                for part in cutlass.range_constexpr(cols // 8):
                    for e in cutlass.range_constexpr(8):
                        packed[0, e] = frag[8 * part + e].to(cutlass.BFloat16)
                    cute.autovec_copy(packed, cute.local_tile(gX, (1, 8), (token, blk * (cols // 8) + part)))
        return total

    @cute.jit
    def row_dot(self, tile, i, blk, frag, in_sequence):
        """The dot product of block ``blk`` (16 columns) of the token tile's row i with ``frag``; 0 past the chunk's
        end (the row not read: a varlen chunk's rows there are being zeroed)."""
        x = cute.make_rmem_tensor(cute.make_layout((1, 8)), cutlass.BFloat16)
        total = cutlass.Float32(0.0)
        if in_sequence:
            for part in cutlass.range_constexpr(tmem.COLUMNS_PER_COPY // 8):
                cute.autovec_copy(cute.local_tile(tile, (1, 8), (i, blk * (tmem.COLUMNS_PER_COPY // 8) + part)), x)
                for e in cutlass.range_constexpr(8):
                    total = total + x[0, e].to(cutlass.Float32) * frag[8 * part + e]
        return total
