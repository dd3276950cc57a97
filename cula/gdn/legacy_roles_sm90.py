"""Gated DeltaNet chunked-prefill forward for SM90 in four warpgroup roles (D = 128), CuTe DSL.

The math is :mod:`cula.gdn.chunk_fwd_sm90`'s. There, one chunk is a chain of serial steps on both warpgroups: the
chunk's own intra-chunk matrices (K K^T, Q K^T, their masks, the triangular solve) sit on the critical path between
the state products. Here they are made by their own warpgroup a chunk or more ahead, so the two state warpgroups run
only the state chain (S^T K^T / S^T Q^T, V_new, O, the state update):

- WG0, load (24 registers): warp 0 issues the q | k tiles (3 stages) and the v tiles (2 stages) by TMA; warp 1 scans
  each chunk's gates into the gate slot of its q | k stage; with qk_l2norm, warps 2 and 3 first take the norms of the
  landed q and k rows, which the gate warp folds into the slot's gates and factors (the tiles stay as loaded).
- WG1, aux (104): K K^T and Q K^T (wgmma SS), the masks (A^T fp32 to ``sA``, P bf16 to the Tinv | P stage), Tinv by
  :func:`cula.sm90.solve.solve_diag16_per_warp` / ``solve_merge_to_bf16``.
- WG2, WG3, state (192 each): value rows 0-63 / 64-127 of S^T as wgmma accumulators; V read and O staged with
  ``ldmatrix`` / ``stmatrix`` (transposed), O leaving by TMA (two staging buffers).

Hand-offs are mbarrier rings (full: the data is there; empty: its last reader is done): q | k and its gate slot,
v, Tinv | P. The aux role's chain bounds it: alone it takes ~60 % of the kernel's time, and the state warpgroups'
shared-memory and tensor-core traffic stretches it (PERF.md, "Where the time goes").

The kernel also runs a split sequence's passes (:mod:`cula.ops.segment_split`): the first saves each chunk's Tinv and
P to a workspace, the later ones (``transition``, ``correction``) load them by TMA and run without the aux role.

Shapes as :mod:`cula.gdn.chunk_fwd_sm90` with K = V = 128.
"""

import cutlass
import cutlass.cute as cute
import cutlass.utils.hopper_helpers as sm90_utils
from cutlass.cute.nvgpu import cpasync, warpgroup
from cutlass.cute.nvgpu import warp as warp_ops

from cula import runtime
from cula.gdn import gates_sm90
from cula.ops.gates import L2NORM_EPS  # FLA's l2norm_fwd: x / sqrt(sum(x^2) + eps)
from cula.sm90 import entry, epilogue, mma, sequence, solve, state, tiles, workspace

CHUNK = 64

# barrier ids: 0 is the CTA's
_AUX_BARRIER = 1
_STATE_BARRIER = 2


class GDNChunkFwdRolesSm90:
    """Fused GDN forward (D = 128: whole sequences and split passes) with load, aux and two state warpgroups."""

    def __init__(
        self,
        is_varlen: bool = False,
        has_initial_state: bool = False,
        mode: str = "full",
        intra: str = "none",
        qk_l2norm: bool = False,
    ):
        # (beta's dtype and the state's storage order reach the kernel with its tensors: not constants of this class)
        assert (mode == "full" and intra in ("none", "save")) or (
            mode in ("transition", "correction") and intra == "load"
        )
        self.D = 128
        self.C = CHUNK
        self.is_varlen = is_varlen
        self.has_h0 = has_initial_state
        # a split sequence's passes (cula.ops.segment_split): the first ("full", intra "save") also stores each
        # chunk's Tinv and P to the workspace w; the later ones ("transition": v = 0 from S = I, no output;
        # "correction": v = 0 from the given states, output added to o) load them by TMA and have no aux role
        self.mode = mode
        self.intra_save = intra == "save"
        self.intra_load = intra == "load"
        self.make_o = mode != "transition"
        # the tile that arrives in the v stages: v; in "correction" the first pass's o of the chunk; none in
        # "transition"
        self.v_src = {"full": "v", "correction": "o"}.get(mode)
        self.qk_l2norm = qk_l2norm
        self.a_stride = 68  # padded fp32 row of A^T: 16-byte aligned rows, conflict-free stores from the accumulator
        self.qk_stages = 3  # the aux role reads up to two chunks ahead of the state role
        self.v_stages = 2
        self.tp_stages = 2
        self.o_bufs = 2
        self.threads = 512
        # setmaxnreg per warpgroup (24 + 104 + 2 x 192 = 4 x 128, the launch's share): the state role peaks at ~189
        self.regs_load, self.regs_aux, self.regs_state = 24, 104, 192
        # per-token factors of a gate slot: 2^G and 2^(G_last - G); with qk_l2norm 2^G / ||q||, 2^(G_last - G) / ||k||
        # and 2^G / ||k||, then the norm columns (norm_role, publish_norm_gates)
        self.fac_cols = 3 if qk_l2norm else 2
        self.norm_cols = 4 if qk_l2norm else 0

    # ---------------------------------------------------------------- host side
    @cute.jit
    def __call__(self, q, k, v, g, beta, o, h0, ht, starts, ends, w, scale, stream):
        D, C = self.D, self.C
        bf16 = cutlass.BFloat16
        OM = cute.nvgpu.OperandMajorMode
        RMEM = warpgroup.OperandSource.RMEM
        k_atom = warpgroup.make_smem_layout_atom(warpgroup.SmemLayoutAtomKind.K_SW128, bf16)
        mn_atom = warpgroup.make_smem_layout_atom(warpgroup.SmemLayoutAtomKind.MN_SW128, bf16)

        # token tiles (C, D), D contiguous, 128B swizzle, and the same bytes read MN-major (D, C): for K in the
        # state update, for V and O by ldmatrix / stmatrix .trans
        tile_qk = cute.tile_to_shape(k_atom, (C, D, 2, self.qk_stages), order=(0, 1, 2, 3))
        tile_qk_mn = cute.tile_to_shape(mn_atom, (D, C, 2, self.qk_stages), order=(1, 0, 2, 3))
        tile_v = cute.tile_to_shape(k_atom, (C, D, self.v_stages), order=(0, 1, 2))
        tile_v_mn = cute.tile_to_shape(mn_atom, (D, C, self.v_stages), order=(1, 0, 2))
        tile_o = cute.tile_to_shape(k_atom, (C, D, self.o_bufs), order=(0, 1, 2))
        tile_o_mn = cute.tile_to_shape(mn_atom, (D, C, self.o_bufs), order=(1, 0, 2))
        tile_tp = cute.tile_to_shape(k_atom, (C, C, 2, self.tp_stages), order=(0, 1, 2, 3))

        mma_ss = sm90_utils.make_trivial_tiled_mma(bf16, bf16, OM.K, OM.K, cutlass.Float32, (1, 1, 1), (C, C))
        mma_rs = sm90_utils.make_trivial_tiled_mma(bf16, bf16, OM.K, OM.K, cutlass.Float32, (1, 1, 1), (C, C), RMEM)
        mma_state = sm90_utils.make_trivial_tiled_mma(bf16, bf16, OM.K, OM.MN, cutlass.Float32, (1, 1, 1), (C, D), RMEM)

        one_tile = cute.slice_(tile_v, (None, None, 0))
        op = cpasync.CopyBulkTensorTileG2SOp()
        tma_q, mQ = cpasync.make_tiled_tma_atom(op, tiles.tma_view(q), one_tile, (C, D))
        tma_k, mK = cpasync.make_tiled_tma_atom(op, tiles.tma_view(k), one_tile, (C, D))
        tma_v, mV = cpasync.make_tiled_tma_atom(op, tiles.tma_view(o if self.v_src == "o" else v), one_tile, (C, D))
        tma_o, mOt = cpasync.make_tiled_tma_atom(cpasync.CopyBulkTensorTileS2GOp(), tiles.tma_view(o), one_tile, (C, D))
        # the Tinv / P workspace [ranges, chunks * 2 * C, HV, C] (chunk c's Tinv at rows 2 c C, its P after them);
        # unused without intra save / load (q's atom stands in for it)
        tma_w, mW = tma_q, mQ
        if cutlass.const_expr(self.intra_save or self.intra_load):
            w_op = cpasync.CopyBulkTensorTileS2GOp() if self.intra_save else op
            tma_w, mW = cpasync.make_tiled_tma_atom(
                w_op, tiles.tma_view(w), cute.slice_(tile_tp, (None, None, 0, 0)), (C, C)
            )

        qk_stages, v_stages, tp_stages = self.qk_stages, self.v_stages, self.tp_stages

        @cute.struct
        class Storage:
            qk_full: cute.struct.MemRange[cutlass.Int64, qk_stages]
            qk_empty: cute.struct.MemRange[cutlass.Int64, qk_stages]
            g_full: cute.struct.MemRange[cutlass.Int64, qk_stages]
            v_full: cute.struct.MemRange[cutlass.Int64, v_stages]
            v_empty: cute.struct.MemRange[cutlass.Int64, v_stages]
            tp_full: cute.struct.MemRange[cutlass.Int64, tp_stages]
            tp_empty: cute.struct.MemRange[cutlass.Int64, tp_stages]
            sG: cute.struct.MemRange[cutlass.Float32, qk_stages * C]
            sBeta: cute.struct.MemRange[cutlass.Float32, qk_stages * C]
            sFac: cute.struct.MemRange[cutlass.Float32, qk_stages * (self.fac_cols + self.norm_cols) * C]
            sA: cute.struct.Align[cute.struct.MemRange[cutlass.Float32, C * self.a_stride], 128]
            sO: cute.struct.Align[cute.struct.MemRange[bf16, cute.cosize(tile_o)], 1024]
            sQK: cute.struct.Align[cute.struct.MemRange[bf16, cute.cosize(tile_qk)], 1024]
            sV: cute.struct.Align[cute.struct.MemRange[bf16, cute.cosize(tile_v)], 1024]
            sTP: cute.struct.Align[cute.struct.MemRange[bf16, cute.cosize(tile_tp)], 1024]
            norm_full: cute.struct.MemRange[cutlass.Int64, qk_stages]  # used with qk_l2norm

        self.storage = Storage
        HV = v.shape[2]
        N = starts.shape[0] if self.is_varlen else q.shape[0]
        self.kernel(
            mma_ss,
            mma_rs,
            mma_state,
            tma_q,
            mQ,
            tma_k,
            mK,
            tma_v,
            mV,
            tma_o,
            mOt,
            tma_w,
            mW,
            g,
            beta,
            o,
            h0,
            ht,
            starts,
            ends,
            q.shape[2],
            q.shape[1],
            scale,
            tile_qk,
            tile_qk_mn,
            tile_v,
            tile_v_mn,
            tile_o,
            tile_o_mn,
            tile_tp,
        ).launch(grid=(HV, N, 1), block=(self.threads, 1, 1), smem=Storage.size_in_bytes(), stream=stream)

    # ---------------------------------------------------------------- device side
    @cute.kernel
    def kernel(
        self,
        mma_ss,
        mma_rs,
        mma_state,
        tma_q,
        mQ,
        tma_k,
        mK,
        tma_v,
        mV,
        tma_o,
        mOt,
        tma_w,
        mW,
        mG,
        mBeta,
        mO,
        mH0,
        mHt,
        mStart,
        mEnd,
        H,
        T,
        scale,
        tile_qk,
        tile_qk_mn,
        tile_v,
        tile_v_mn,
        tile_o,
        tile_o_mn,
        tile_tp,
    ):
        C = self.C
        tidx, _, _ = cute.arch.thread_idx()
        hv, n, _ = cute.arch.block_idx()
        warp = cute.arch.make_warp_uniform(cute.arch.warp_idx())
        lane = cute.arch.lane_idx()
        HV = mG.shape[2]
        h = hv // (HV // H)

        b, tok0, seqlen, n_chunks = sequence.sequence_bounds(n, T, mStart, mEnd, self.is_varlen, C)

        smem = cutlass.memory.SmemAllocator()
        st = smem.allocate(self.storage)
        bars = (
            st.qk_full.data_ptr(),
            st.qk_empty.data_ptr(),
            st.g_full.data_ptr(),
            st.v_full.data_ptr(),
            st.v_empty.data_ptr(),
            st.tp_full.data_ptr(),
            st.tp_empty.data_ptr(),
        )
        if cutlass.const_expr(self.qk_l2norm):
            bars = (*bars, st.norm_full.data_ptr())
        # per gate slot (one per q | k stage): G in log2 units, beta, the per-token factors (fac_cols), and with
        # qk_l2norm the norm columns after them
        sFac = st.sFac.get_tensor(cute.make_layout((C, self.qk_stages, self.fac_cols)))
        gates = (
            st.sG.get_tensor(cute.make_layout((C, self.qk_stages))),
            st.sBeta.get_tensor(cute.make_layout((C, self.qk_stages))),
            sFac,
        )
        if cutlass.const_expr(self.qk_l2norm):
            sNorm = cute.make_tensor(
                sFac.iterator + C * self.qk_stages * self.fac_cols,
                cute.make_layout((C, self.qk_stages, self.norm_cols)),
            )
            gates = (*gates, sNorm)
        sA = st.sA.get_tensor(cute.make_layout((C, self.a_stride), stride=(self.a_stride, 1)))
        sQK = st.sQK.get_tensor(tile_qk.outer, swizzle=tile_qk.inner)
        sV = st.sV.get_tensor(tile_v.outer, swizzle=tile_v.inner)
        sO = st.sO.get_tensor(tile_o.outer, swizzle=tile_o.inner)
        sTP = st.sTP.get_tensor(tile_tp.outer, swizzle=tile_tp.inner)
        # MN-major views of the same bytes (D, C, ...)
        sK_mn = cute.make_tensor(cute.recast_ptr(sQK.iterator, tile_qk_mn.inner), tile_qk_mn.outer)[None, None, 1, None]
        sV_mn = cute.make_tensor(cute.recast_ptr(sV.iterator, tile_v_mn.inner), tile_v_mn.outer)
        sO_mn = cute.make_tensor(cute.recast_ptr(sO.iterator, tile_o_mn.inner), tile_o_mn.outer)

        if tidx == 0:
            qk_full, qk_empty, g_full, v_full, v_empty, tp_full, tp_empty = bars[:7]
            for s in cutlass.range_constexpr(self.qk_stages):
                cute.arch.mbarrier_init(qk_full + s, 1)
                # the aux (without intra load) and both state warpgroups' threads
                cute.arch.mbarrier_init(qk_empty + s, 256 if self.intra_load else 384)
                cute.arch.mbarrier_init(g_full + s, 32)  # the gate warp's lanes
                if cutlass.const_expr(self.qk_l2norm):
                    cute.arch.mbarrier_init(bars[7] + s, 64)  # the norm warps' lanes
            for s in cutlass.range_constexpr(self.v_stages):
                cute.arch.mbarrier_init(v_full + s, 1)
                cute.arch.mbarrier_init(v_empty + s, 256)
            for s in cutlass.range_constexpr(self.tp_stages):
                cute.arch.mbarrier_init(tp_full + s, 1 if self.intra_load else 128)  # TMA, or the aux threads
                cute.arch.mbarrier_init(tp_empty + s, 256)
            cute.arch.mbarrier_init_fence()
        if warp == 0:
            cpasync.prefetch_descriptor(tma_q)
            cpasync.prefetch_descriptor(tma_k)
            cpasync.prefetch_descriptor(tma_v)
            cpasync.prefetch_descriptor(tma_o)
        cute.arch.sync_threads()

        # with intra save / load, (C, C) tiles of this (range, head)'s workspace: 2 c for chunk c's Tinv, 2 c + 1 for
        # its P; smem tiles 2 t (Tinv) and 2 t + 1 (P) of Tinv | P stage t (the aux role stores them, or the load
        # warp loads them)
        w_tiles = None
        if cutlass.const_expr(self.intra_save or self.intra_load):
            tWs, tWg = tiles.tma_chunk_tiles(tma_w, mW[None, None, hv, n], 0, cute.group_modes(sTP, 2, 4))
            w_tiles = (tma_w, tWs, tWg)

        wg = warp // 4
        if wg == 0:
            cute.arch.setmaxregister_decrease(self.regs_load)
            if warp == 0:
                self.load_role(tma_q, mQ, tma_k, mK, tma_v, mV, sQK, sV, bars, h, hv, b, tok0, n_chunks, w_tiles)
            elif warp == 1:
                self.gate_role(mG, mBeta, gates, bars, b, hv, tok0, seqlen, n_chunks, lane)
            elif cutlass.const_expr(self.qk_l2norm):
                self.norm_role(sQK, gates, bars, n_chunks, warp - 2, lane)
        elif wg == 1:
            cute.arch.setmaxregister_decrease(self.regs_aux)
            if cutlass.const_expr(not self.intra_load):
                self.aux_role(mma_ss, sQK, sA, sTP, gates, bars, scale, seqlen, n_chunks, tidx - 128, warp - 4, w_tiles)
        else:
            cute.arch.setmaxregister_increase(self.regs_state)
            self.state_role(
                mma_rs, mma_state, tma_o, mOt, mO, mH0, mHt, sQK, sK_mn, sV_mn, sO, sO_mn, sTP, gates, bars,
                scale, n, b, hv, tok0, seqlen, n_chunks, tidx - 256, warp,
            )  # fmt: skip

    @cute.jit
    def load_role(self, tma_q, mQ, tma_k, mK, tma_v, mV, sQK, sV, bars, h, hv, b, tok0, n_chunks, w_tiles):
        """One warp: chunk c's q | k tiles into stage c % 3 once its chunk c - 3 is released, its v (or first-pass o)
        tile into stage c % 2 once chunk c - 2's is; with intra load also its saved Tinv (and P) into Tinv | P stage
        c % 2 (``w_tiles``: the workspace's TMA atom and tiles)."""
        qk_full, qk_empty, _, v_full, v_empty, tp_full, tp_empty = bars[:7]
        tQs, tQg = tiles.tma_chunk_tiles(tma_q, mQ[None, None, h, b], tok0, sQK[None, None, 0, None])
        tKs, tKg = tiles.tma_chunk_tiles(tma_k, mK[None, None, h, b], tok0, sQK[None, None, 1, None])
        tVs, tVg = tiles.tma_chunk_tiles(tma_v, mV[None, None, hv, b], tok0, sV)
        lane = cute.arch.lane_idx()
        C, D = self.C, self.D
        for c in cutlass.range(n_chunks, unroll=1):
            s = c % self.qk_stages
            cute.arch.mbarrier_wait(qk_empty + s, (c // self.qk_stages + 1) % 2)
            if lane == 0:
                cute.arch.mbarrier_arrive_and_expect_tx(qk_full + s, 2 * C * D * 2)
            cute.copy(tma_q, tQg[None, c], tQs[None, s], tma_bar_ptr=qk_full + s)
            cute.copy(tma_k, tKg[None, c], tKs[None, s], tma_bar_ptr=qk_full + s)
            if cutlass.const_expr(self.v_src is not None):
                vs = c % self.v_stages
                cute.arch.mbarrier_wait(v_empty + vs, (c // self.v_stages + 1) % 2)
                if lane == 0:
                    cute.arch.mbarrier_arrive_and_expect_tx(v_full + vs, C * D * 2)
                cute.copy(tma_v, tVg[None, c], tVs[None, vs], tma_bar_ptr=v_full + vs)
            if cutlass.const_expr(self.intra_load):
                tma_w, tWs, tWg = w_tiles
                ts = c % self.tp_stages
                cute.arch.mbarrier_wait(tp_empty + ts, (c // self.tp_stages + 1) % 2)
                if lane == 0:
                    cute.arch.mbarrier_arrive_and_expect_tx(tp_full + ts, (2 if self.make_o else 1) * C * C * 2)
                workspace.load_tinv_p(tma_w, tWg, tWs, c, ts, tp_full + ts, self.make_o)

    @cute.jit
    def gate_role(self, mG, mBeta, gates, bars, b, hv, tok0, seqlen, n_chunks, lane):
        """One warp: chunk c's gates scanned into gate slot c % 3 once chunk c - 3 has released it (the loads are
        issued before that wait)."""
        sG, sBeta, sFac = gates[:3]
        _, qk_empty, g_full, _, _, _, _ = bars[:7]
        gG, gBeta = mG[b, None, hv], mBeta[b, None, hv]
        for c in cutlass.range(n_chunks, unroll=1):
            s = c % self.qk_stages
            raw = gates_sm90.load_gates(gG, gBeta, tok0, seqlen, c, lane, self.C)
            cute.arch.mbarrier_wait(qk_empty + s, (c // self.qk_stages + 1) % 2)
            gates_sm90.publish_gates(sG, sBeta, sFac, s, raw, c, seqlen, lane, self.C)
            if cutlass.const_expr(self.qk_l2norm):
                cute.arch.mbarrier_wait(bars[7] + s, (c // self.qk_stages) % 2)
                self.publish_norm_gates(gates, s, lane)
            cute.arch.mbarrier_arrive(g_full + s)

    @cute.jit
    def norm_role(self, sQK, gates, bars, n_chunks, which, lane):
        """qk_l2norm, warps 2 and 3 of the load warpgroup, a lane per row (rows 32 ``which`` + lane of q and of k):
        once chunk c's q | k stage has landed, each row's sum of squares (fp32, eps under the root as FLA's
        l2norm_fwd) gives 1 / ||q|| and 1 / ||k|| in norm columns 0 and 1 of gate slot c % 3 (the stage's norm
        barrier), which the gate warp folds into the slot (``publish_norm_gates``). The tiles are not rewritten
        (normalising them in place bounded the chunk: 8.2k cycles against 6.3k)."""
        f32 = cutlass.Float32
        sNorm = gates[3]
        qk_full = bars[0]
        norm_full = bars[7]
        row = 32 * which + lane
        for c in cutlass.range(n_chunks, unroll=1):
            s = c % self.qk_stages
            cute.arch.mbarrier_wait(qk_full + s, (c // self.qk_stages) % 2)
            for x in cutlass.range_constexpr(2):
                # four 16-byte pieces per step of a loop: fully unrolled, the swizzled addresses of 16 pieces took
                # more than this warpgroup's 24 registers, and the compiler then spilled the aux role too
                tile = sQK[None, None, x, s]
                n2 = f32(0.0)
                for blk in cutlass.range(self.D // 32, unroll=1):
                    n2 = n2 + tiles.row_sum_squares(tile, row, 4 * blk, 4)
                sNorm[row, s, x] = cute.math.rsqrt(n2 + f32(L2NORM_EPS), fastmath=True)
            cute.arch.mbarrier_arrive(norm_full + s)

    @cute.jit
    def publish_norm_gates(self, gates, s, lane):
        """qk_l2norm, the gate warp, after ``publish_gates`` and the slot's norm barrier: 1 / ||q|| and 1 / ||k|| folded
        into gate slot s for its two tokens per lane. Norm column 0 becomes G - log2 ||q|| (P's rows), 2 beta / ||k||
        (A's rows), 3 G + log2 ||k|| (A's and P's columns; column 1 keeps 1 / ||k||); the state role's factors become
        2^G / ||q|| (O), 2^(G_last - G) / ||k|| (the state update) and 2^G / ||k|| (Y). Rows past the sequence end
        (zeros) get 1 / sqrt(eps): finite, and their beta and last factor are zero."""
        sG, sBeta, sFac, sNorm = gates
        for h in cutlass.range_constexpr(2):
            t = lane + 32 * h
            inv_q, inv_k = sNorm[t, s, 0], sNorm[t, s, 1]
            G, two_g = sG[t, s], sFac[t, s, 0]
            sNorm[t, s, 0] = G + cute.math.log2(inv_q, fastmath=True)
            sNorm[t, s, 2] = sBeta[t, s] * inv_k
            sNorm[t, s, 3] = G - cute.math.log2(inv_k, fastmath=True)
            sFac[t, s, 0] = two_g * inv_q
            sFac[t, s, 1] = sFac[t, s, 1] * inv_k
            sFac[t, s, 2] = two_g * inv_k

    @cute.jit
    def aux_role(self, mma_ss, sQK, sA, sTP, gates, bars, scale, seqlen, n_chunks, atid, awarp, w_tiles):
        """One warpgroup: per chunk, A = strict-lower(beta_i K K^T 2^(G_i - G_j)) (fp32, transposed, to ``sA``),
        P = lower(scale Q K^T 2^(G_i - G_j)) and Tinv = (I + A)^-1 (bf16, to Tinv | P stage c % 2)."""
        f32 = cutlass.Float32
        C = self.C
        qk_full, qk_empty, g_full, _, _, tp_full, tp_empty = bars[:7]
        thr_ss = mma_ss.get_slice(atid)
        cSS = thr_ss.partition_C(cute.make_identity_tensor((C, C)))
        # P leaves the accumulator by stmatrix (row addresses per 8 x 8 matrix, not one swizzled address each)
        st_p = cute.make_tiled_copy_C(
            cute.make_copy_atom(warp_ops.StMatrix8x8x16bOp(transpose=False, num_matrices=4), cutlass.BFloat16), mma_ss
        )
        thr_stp = st_p.get_slice(atid)
        # Tinv's blocks above the diagonal stay zero (ordered for the state role by the first fence.proxy.async)
        for ts in cutlass.range_constexpr(self.tp_stages):
            solve.solve_clear(sTP[None, None, 0, ts], atid, 128)
        for c in cutlass.range(n_chunks, unroll=1):
            s = c % self.qk_stages
            ts = c % self.tp_stages
            L = cutlass.min(seqlen - c * C, C)
            sT = sTP[None, None, 0, ts]
            sP = sTP[None, None, 1, ts]

            tSSa = thr_ss.make_fragment_A(thr_ss.partition_A(sQK[None, None, None, s]))
            tSSb = thr_ss.make_fragment_B(thr_ss.partition_B(sQK[None, None, 1, s]))
            acc_x = thr_ss.make_fragment_C(thr_ss.partition_shape_C((C, C)))
            # (no mbarrier wait between a wgmma's issue and its wait: ptxas then waits for it at the branch)
            cute.arch.mbarrier_wait(qk_full + s, (c // self.qk_stages) % 2)
            cute.arch.mbarrier_wait(g_full + s, (c // self.qk_stages) % 2)
            warpgroup.fence()
            mma.gemm(mma_ss, acc_x, tSSa[None, None, None, 1], tSSb, True)
            warpgroup.commit_group()
            g_r, b_r, g_c = self.slot_gates(gates, cSS, s, False)
            # a row's last unmasked column: the masks then depend on the chunk, and ptxas does not hoist 64
            # per-element predicates out of the loop (they spilled); rows past the end get none of A and all the
            # columns before the end of P (harmless: their outputs are not stored, V_new is zero there)
            lim_a = cute.make_rmem_tensor(cute.make_layout(2), cutlass.Int32)
            for rr in cutlass.range_constexpr(2):
                r, _ = cSS[2 * rr]
                lim_a[rr] = r if r < L else 0
            warpgroup.wait_group(0)
            if cutlass.const_expr(self.intra_save):
                if awarp == 0:
                    # this Tinv | P stage's last save (chunk c - 2) has read it before the barrier below, after which
                    # P and Tinv are written there again
                    cute.arch.cp_async_bulk_wait_group(1, read=True)
            # the previous chunk's merge has read sA
            cute.arch.barrier(barrier_id=_AUX_BARRIER, number_of_threads=128)
            for i in cutlass.range_constexpr(cute.size(acc_x)):
                ra, ja = cSS[i]
                rr, kc = mma.acc_row_slot(i), mma.acc_col_slot(i)
                va = f32(0.0)
                if ja < lim_a[rr]:
                    va = acc_x[i] * b_r[rr] * cute.math.exp2(g_r[rr] - g_c[kc], fastmath=True)
                sA[ja, ra] = va  # transposed: the solver walks A column by column
            warpgroup.fence()
            mma.gemm(mma_ss, acc_x, tSSa[None, None, None, 0], tSSb, True)
            warpgroup.commit_group()
            warpgroup.wait_group(0)
            cute.arch.mbarrier_wait(tp_empty + ts, (c // self.tp_stages + 1) % 2)
            # the gates read again: held across Q K^T they push loop invariants of the solve out to local memory
            g_r, _, g_c = self.slot_gates(gates, cSS, s, True)
            lim_p = cute.make_rmem_tensor(cute.make_layout(2), cutlass.Int32)
            for rr in cutlass.range_constexpr(2):
                r, _ = cSS[2 * rr]
                lim_p[rr] = cutlass.min(r, L - 1)
            p_frag = cute.make_rmem_tensor(acc_x.layout, cutlass.BFloat16)
            for i in cutlass.range_constexpr(cute.size(acc_x)):
                _, jp = cSS[i]
                rr, kc = mma.acc_row_slot(i), mma.acc_col_slot(i)
                vp = f32(0.0)
                if jp <= lim_p[rr]:
                    vp = acc_x[i] * scale * cute.math.exp2(g_r[rr] - g_c[kc], fastmath=True)
                p_frag[i] = vp.to(cutlass.BFloat16)
            cute.copy(st_p, thr_stp.retile(p_frag), thr_stp.partition_D(sP))
            # q | k tiles and the gate slot read
            cute.arch.mbarrier_arrive(qk_empty + s)
            cute.arch.barrier(barrier_id=_AUX_BARRIER, number_of_threads=128)
            solve.solve_diag16_per_warp(sA, atid)
            cute.arch.barrier(barrier_id=_AUX_BARRIER, number_of_threads=128)
            solve.solve_merge_to_bf16(sA, sT, atid, _AUX_BARRIER)
            # P and Tinv are read by the state role's wgmma (async proxy)
            cute.arch.fence_proxy("async.shared", space="cta")
            cute.arch.mbarrier_arrive(tp_full + ts)
            if cutlass.const_expr(self.intra_save):
                if awarp == 0:
                    # every aux thread has fenced its part (the stage's full barrier), then one TMA store group
                    tma_w, tWs, tWg = w_tiles
                    cute.arch.mbarrier_wait(tp_full + ts, (c // self.tp_stages) % 2)
                    workspace.save_tinv_p(tma_w, tWs, tWg, c, ts)
        if cutlass.const_expr(self.intra_save):
            if awarp == 0:
                cute.arch.cp_async_bulk_wait_group(0, read=True)

    @cute.jit
    def slot_gates(self, gates, cSS, s, for_p: cutlass.Constexpr):
        """The aux role's gates of slot ``s`` at its accumulator rows and columns (A's, or P's with ``for_p``):
        :func:`cula.gdn.gates_sm90.row_col_gates`; with qk_l2norm the norms are folded in (``publish_norm_gates``):
        row gates G (A) or G - log2 ||q|| (P), row factors beta / ||k||, column gates G + log2 ||k||."""
        sG, sBeta = gates[0], gates[1]
        if cutlass.const_expr(not self.qk_l2norm):
            return gates_sm90.row_col_gates(sG, sBeta, None, cSS, s, False)
        sNorm = gates[3]
        row_g = sNorm[None, None, 0] if for_p else sG
        return gates_sm90.gates_at(cSS, row_g, sNorm[None, None, 2], sNorm[None, None, 3], s)

    @cute.jit
    def state_role(
        self, mma_rs, mma_state, tma_o, mOt, mO, mH0, mHt, sQK, sK_mn, sV_mn, sO, sO_mn, sTP, gates, bars,
        scale, n, b, hv, tok0, seqlen, n_chunks, stid, warp,
    ):  # fmt: skip
        """Two warpgroups, value rows [64 swg, 64 swg + 64) of S^T each: per chunk S^T K^T and S^T Q^T, then
        V_new^T = Y^T Tinv^T, O^T += V_new^T P^T and the state update once the aux role's Tinv | P stage is full;
        O^T staged by stmatrix and stored by TMA (the last chunk by masked plain stores)."""
        f32 = cutlass.Float32
        bf16 = cutlass.BFloat16
        C, D = self.C, self.D
        sG, sBeta, sFac = gates[:3]
        qk_full, qk_empty, g_full, v_full, v_empty, tp_full, tp_empty = bars[:7]
        # the factor of Y's S^T K^T term: 2^G, or with qk_l2norm 2^G / ||k|| (column 0 is then 2^G / ||q||, for O)
        fac_y = 2 if self.qk_l2norm else 0
        swg = (warp - 8) // 4
        wtid = stid % 128
        row0 = swg * C
        thr_rs = mma_rs.get_slice(wtid)
        thr_st = mma_state.get_slice(wtid)
        cCC = thr_rs.partition_C(cute.make_identity_tensor((C, C)))
        cST = thr_st.partition_C(cute.make_identity_tensor((C, D)))
        acc_cc_shape = thr_rs.partition_shape_C((C, C))
        # V read and O^T written through (value row, token) views of the token-major tiles: ldmatrix / stmatrix
        # .trans give each thread its accumulator elements, a few row addresses per thread instead of one each
        ld_v = cute.make_tiled_copy_C(
            cute.make_copy_atom(warp_ops.LdMatrix8x8x16bOp(transpose=True, num_matrices=4), bf16), mma_rs
        )
        st_o = cute.make_tiled_copy_C(
            cute.make_copy_atom(warp_ops.StMatrix8x8x16bOp(transpose=True, num_matrices=4), bf16), mma_rs
        )
        thr_ld = ld_v.get_slice(wtid)
        thr_sto = st_o.get_slice(wtid)
        tOs, tOg = tiles.tma_chunk_tiles(tma_o, mOt[None, None, hv, b], tok0, sO)

        acc_s = thr_st.make_fragment_C(thr_st.partition_shape_C((C, D)))
        if cutlass.const_expr(self.has_h0):
            state.load_state(acc_s, cST, mH0, n, hv, row0)
        elif cutlass.const_expr(self.mode == "transition"):
            for i in cutlass.range_constexpr(cute.size(acc_s)):
                rh, kh = cST[i]
                acc_s[i] = f32(1.0) if kh == row0 + rh else f32(0.0)
        else:
            acc_s.fill(0.0)

        for c in cutlass.range(n_chunks, unroll=1):
            s = c % self.qk_stages
            vs = c % self.v_stages
            ts = c % self.tp_stages
            ob = c % self.o_bufs
            L = cutlass.min(seqlen - c * C, C)
            tRSb_K = thr_rs.make_fragment_B(thr_rs.partition_B(sQK[None, None, 1, s]))
            tRSb_Q = thr_rs.make_fragment_B(thr_rs.partition_B(sQK[None, None, 0, s]))
            # every mbarrier wait before the wgmmas are issued (a wait's branch between a wgmma's issue and its
            # wait makes ptxas wait for the wgmma there)
            cute.arch.mbarrier_wait(qk_full + s, (c // self.qk_stages) % 2)
            cute.arch.mbarrier_wait(g_full + s, (c // self.qk_stages) % 2)
            if cutlass.const_expr(self.v_src is not None):
                cute.arch.mbarrier_wait(v_full + vs, (c // self.v_stages) % 2)
            decay = cute.math.exp2(sG[L - 1, s], fastmath=True)
            rS = mma.acc_to_operand(acc_s)
            for i in cutlass.range_constexpr(cute.size(acc_s)):
                acc_s[i] = acc_s[i] * decay
            acc_k = thr_rs.make_fragment_C(acc_cc_shape)
            acc_o = thr_rs.make_fragment_C(acc_cc_shape)
            warpgroup.fence()
            mma.gemm(mma_rs, acc_k, rS, tRSb_K, True)
            if cutlass.const_expr(self.make_o):
                mma.gemm(mma_rs, acc_o, rS, tRSb_Q, True)
            warpgroup.commit_group()
            warpgroup.wait_group(0)

            # Y^T[v, j] = beta_j (V[j, v] - 2^G_j (S^T K^T)[v, j])  (beta and V are zero past the sequence end);
            # per-token factors read where used (held in registers they cost 16 each)
            # (v = 0 in the later split passes)
            if cutlass.const_expr(self.v_src == "v"):
                v_frag = cute.make_rmem_tensor(acc_cc_shape, bf16)
                v_rows = cute.local_tile(sV_mn[None, None, vs], (C, C), (swg, 0))
                cute.copy(ld_v, thr_ld.partition_S(v_rows), thr_ld.retile(v_frag))
                for i in cutlass.range_constexpr(cute.size(acc_k)):
                    _, j = cCC[i]
                    acc_k[i] = sBeta[j, s] * (v_frag[i].to(f32) - sFac[j, s, fac_y] * acc_k[i])
            else:
                for i in cutlass.range_constexpr(cute.size(acc_k)):
                    _, j = cCC[i]
                    acc_k[i] = -(sBeta[j, s] * sFac[j, s, fac_y]) * acc_k[i]
            rY = mma.acc_to_operand(acc_k)
            tRSb_T = thr_rs.make_fragment_B(thr_rs.partition_B(sTP[None, None, 0, ts]))
            tRSb_P = thr_rs.make_fragment_B(thr_rs.partition_B(sTP[None, None, 1, ts]))
            acc_vn = thr_rs.make_fragment_C(acc_cc_shape)
            cute.arch.mbarrier_wait(tp_full + ts, (c // self.tp_stages) % 2)
            warpgroup.fence()
            mma.gemm(mma_rs, acc_vn, rY, tRSb_T, True)
            warpgroup.commit_group()
            if cutlass.const_expr(self.make_o):
                for i in cutlass.range_constexpr(cute.size(acc_o)):
                    _, j = cCC[i]
                    acc_o[i] = acc_o[i] * scale * sFac[j, s, 0]
            warpgroup.wait_group(0)

            # O^T += V_new^T P^T;  S^T += (V_new^T 2^(G_last - G_j)) K
            rVn = mma.acc_to_operand(acc_vn)
            for i in cutlass.range_constexpr(cute.size(acc_vn)):
                _, j = cCC[i]
                acc_vn[i] = acc_vn[i] * sFac[j, s, 1]
            rVd = mma.acc_to_operand(acc_vn)
            tSTb_K = thr_st.make_fragment_B(thr_st.partition_B(sK_mn[None, None, s]))
            warpgroup.fence()
            if cutlass.const_expr(self.make_o):
                mma.gemm(mma_rs, acc_o, rVn, tRSb_P, False)
            mma.gemm(mma_state, acc_s, rVd, tSTb_K, False)
            warpgroup.commit_group()
            warpgroup.wait_group(0)
            cute.arch.mbarrier_arrive(tp_empty + ts)
            cute.arch.mbarrier_arrive(qk_empty + s)
            if cutlass.const_expr(self.v_src == "v"):
                cute.arch.mbarrier_arrive(v_empty + vs)

            if cutlass.const_expr(self.make_o):
                # "correction": the first pass's o of the chunk (in the v stage) added, then the stage released
                if cutlass.const_expr(self.v_src == "o"):
                    o_prev = cute.make_rmem_tensor(acc_cc_shape, bf16)
                    prev_rows = cute.local_tile(sV_mn[None, None, vs], (C, C), (swg, 0))
                    cute.copy(ld_v, thr_ld.partition_S(prev_rows), thr_ld.retile(o_prev))
                    for i in cutlass.range_constexpr(cute.size(acc_o)):
                        acc_o[i] = acc_o[i] + o_prev[i].to(f32)
                    cute.arch.mbarrier_arrive(v_empty + vs)
                # O^T to staging buffer c % 2 (its last reader, the store of chunk c - 2, was waited before the
                # previous chunk's barrier); a full chunk leaves by TMA, the last (maybe partial) one by masked stores
                o_frag = cute.make_rmem_tensor(acc_o.layout, bf16)
                o_frag.store(acc_o.load().to(bf16))
                o_rows = cute.local_tile(sO_mn[None, None, ob], (C, C), (swg, 0))
                cute.copy(st_o, thr_sto.retile(o_frag), thr_sto.partition_D(o_rows))
                cute.arch.fence_proxy("async.shared", space="cta")
                if warp == 8:
                    cute.arch.cp_async_bulk_wait_group(0, read=True)
                cute.arch.barrier(barrier_id=_STATE_BARRIER, number_of_threads=256)
                if warp == 8:
                    if c + 1 < n_chunks:
                        cute.copy(tma_o, tOs[None, ob], tOg[None, c])
                        cute.arch.cp_async_bulk_commit_group()

        if cutlass.const_expr(self.make_o):
            if n_chunks > 0:
                last = n_chunks - 1
                epilogue.store_o_rows(
                    sO[None, None, last % self.o_bufs], mO, b, hv, tok0 + last * C, seqlen - last * C, stid, C, D, 256
                )
            if warp == 8:
                cute.arch.cp_async_bulk_wait_group(0)
        state.store_state(acc_s, cST, mHt, n, hv, row0)


def compile_gdn_fwd_roles_sm90(
    arch="sm_90a",
    keep_artifacts=False,
    beta_fp32=True,
    is_varlen=False,
    has_initial_state=False,
    state_v_first=False,
    mode="full",
    intra="none",
    qk_l2norm=False,
):
    kernel = GDNChunkFwdRolesSm90(is_varlen, has_initial_state, mode, intra, qk_l2norm)
    fake = entry.fake_args(128, beta_fp32, state_v_first, per_key_gate=False)
    return runtime.compile_kernel(kernel, fake, arch, keep_artifacts)
