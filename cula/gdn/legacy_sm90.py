"""The earlier GDN SM90 kernels, served by default until the family kernel (:mod:`cula.gdn.chunk_fwd_sm90`) has
passed the GPU tests and the side-by-side timing against them: :func:`compile_gdn_fwd_sm90` compiles the four-role
kernel (:mod:`cula.gdn.legacy_roles_sm90`) for D = 128 (:func:`uses_roles`) and the two-warpgroup kernel below for
D = 64.

One CTA per (sequence, value head) walks the sequence in chunks of C = 64 tokens and keeps the fp32 state on chip
across all chunks. Math per chunk (FLA convention; state S is K x V; G = cumulative log gate inside the chunk):

    A     = tril(diag(beta) (K K^T * exp(G_i - G_j)), -1)          Tinv = (I + A)^-1
    Y     = diag(beta) (V - (K * exp(G)) S)                         V_new = Tinv Y        (= U - W S)
    O     = scale (Q * exp(G)) S + tril(scale Q K^T * exp(G_i - G_j)) V_new
    S    <- exp(G_last) S + (K * exp(G_last - G))^T V_new

The kernel works on S^T (V x K): each of the two math warpgroups holds 64 value rows x K key columns of S^T as
a wgmma fp32 accumulator (64 registers per thread at K = 128), so every product with S uses S^T (converted to
bf16) as the register A operand and the token tiles in shared memory as the B operand. At K = V = 64 warpgroup 0
holds all of S^T and warpgroup 1 repeats its state products without writing them:

    S^T K^T, S^T Q^T   (A = S^T regs, B = K/Q tile, K-major)
    V_new^T = Y^T Tinv^T                 (A = Y^T regs, B = Tinv in smem)
    O^T    += V_new^T P^T                (A = V_new^T regs, B = P in smem)
    S^T    += (V_new^T * decay) K        (A = regs, B = the same K tile read MN-major)

Shapes (torch order): q, k [B, T, H, K] bf16; v [B, T, HV, V] bf16; g [B, T, HV] fp32 (natural-log gate, already
activated); beta [B, T, HV] bf16/fp32; o [B, T, HV, V] bf16; state [N, HV, K, V] fp32 ([N, HV, V, K] when
state_v_first). Varlen: B == 1 and cu_seqlens [N + 1]. GVA: value head hv reads q/k head hv // (HV / H).
K = V = 64 or 128.
"""

import cutlass
import cutlass.cute as cute
import cutlass.utils.hopper_helpers as sm90_utils
from cutlass.cute.nvgpu import cpasync, warpgroup

from cula import runtime
from cula.gdn import gates_sm90, legacy_roles_sm90
from cula.ops.gates import L2NORM_EPS  # FLA's l2norm_fwd: x / sqrt(sum(x^2) + eps)
from cula.sm90 import entry, epilogue, mma, sequence, solve, state, tiles, workspace

CHUNK = 64
MODES = ("full", "transition", "correction")
INTRA = ("none", "save", "load")
SUPPORTED_DIMS = (64, 128)


def uses_roles(head_dim: int, mode: str, intra: str) -> bool:
    """Whether a launch runs the four-role kernel (:mod:`cula.gdn.chunk_fwd_roles_sm90`, faster: its intra-chunk
    matrices are made a chunk ahead of the state chain) instead of :class:`GDNChunkFwdSm90`: D = 128, whole
    sequences and every split pass that saves or loads Tinv and P (with or without qk_l2norm); D = 64 is not written
    for it."""
    split_pass = (mode == "full" and intra in ("none", "save")) or (mode != "full" and intra == "load")
    return head_dim == 128 and split_pass


class GDNChunkFwdSm90:
    """Fused GDN forward: TMA loads of q/k/v chunks through a 2-stage mbarrier ring, wgmma for every product,
    the chunk's triangular inverse solved in-kernel in fp32, the state in registers across chunks.

    Threads: 256 = two warpgroups. WG w owns value rows [64 w, 64 w + 64) of S^T. Per chunk:
      1. WG0: K K^T -> A (fp32, smem, transposed);  WG1: Q K^T -> P (bf16, smem)          [wgmma SS]
      2. each WG issues S^T K^T and S^T Q^T on its rows [wgmma RS, async]; meanwhile Tinv = (I + A)^-1 by
         16-blocks: warps 0-1 invert the diagonal blocks (fp32), then warps 0-3 join them (warp MMA, tf32) -> smem
         bf16; while warps 0-1 solve, warp 2 scans the next chunk's gates (loaded at the chunk's start) into the
         other gate slot
      3. each WG on its 64 value rows: V_new^T, O^T, state update                         [wgmma RS]
      4. O staged through smem; a full chunk's leaves by one TMA store, the last chunk's by plain stores with rows
         past the sequence end masked; warp 0 refills the TMA stage.
    Split passes (``intra``): "save" TMA-stores each chunk's Tinv and P to the workspace after step 2; "load" skips
    steps 1 and 2's solve and takes Tinv and P from the workspace with the chunk's q/k tiles (a pair per stage).
    """

    def __init__(
        self,
        head_dim: int = 128,
        beta_fp32: bool = True,
        is_varlen: bool = False,
        has_initial_state: bool = False,
        state_v_first: bool = False,
        mode: str = "full",
        qk_l2norm: bool = False,
        intra: str = "none",
    ):
        assert head_dim in SUPPORTED_DIMS
        assert mode in MODES and (mode == "full" or is_varlen)
        # a split sequence's later passes need only the state path of each chunk: the "full" pass saves every
        # chunk's Tinv and P to a workspace ("save") and the "transition"/"correction" passes load them ("load")
        # instead of making them again (no q/k norms there: not with qk_l2norm)
        assert intra in INTRA and (intra != "save" or mode == "full") and (intra != "load" or mode != "full")
        assert not (intra == "load" and qk_l2norm)
        self.intra = intra
        self.D = head_dim
        # q and k L2-normalised by the kernel: their per-token 1 / ||x|| ride on the factors it already applies
        # per row and column (||k_t||^2 is the diagonal of K K^T; ||q_t||^2 a row sum over the Q tile)
        self.qk_l2norm = qk_l2norm
        self.C = CHUNK
        # warpgroups holding state rows: at D = 64 WG0 holds all of S^T and WG1 repeats its products without
        # writing them (it still makes P for the chunk)
        self.state_wgs = head_dim // 64
        self.beta_fp32 = beta_fp32
        self.is_varlen = is_varlen
        self.has_h0 = has_initial_state
        self.state_v_first = state_v_first
        # sequence splitting (cula.ops.segment_split): "transition" runs v = 0 from S = I without output,
        # "correction" runs v = 0 from the given states and adds its output to o
        self.mode = mode
        # the tile that arrives with q and k in each stage: v; in "correction", the first pass's o of the chunk
        # (that pass adds its output to it while staging, instead of reading o back from global memory per store)
        self.tile_v_src = {"full": "v", "correction": "o"}.get(mode)
        self.make_o = mode != "transition"
        if mode == "correction":
            self.has_h0 = True
        self.stages = 2
        # Tinv | P buffers: one pair, or one per TMA stage when they arrive with the chunk's q/k tiles
        self.t_stages = self.stages if intra == "load" else 1
        self.threads = 256
        self.a_stride = 68  # padded fp32 row of A^T: 16-byte aligned rows, conflict-free stores from the accumulator

    # ---------------------------------------------------------------- host side
    @cute.jit
    def __call__(self, q, k, v, g, beta, o, h0, ht, starts, ends, w, scale, stream):

        D, C = self.D, self.C
        bf16 = cutlass.BFloat16
        OM = cute.nvgpu.OperandMajorMode
        RMEM = warpgroup.OperandSource.RMEM

        # token tiles (C x D), D contiguous, 128B swizzle; the K tile is also read MN-major (D x C) for S^T += X K:
        # both views address the same bytes (8-token x 64-dim swizzle atoms, token blocks fastest)
        tile_k_major = cute.tile_to_shape(
            warpgroup.make_smem_layout_atom(warpgroup.SmemLayoutAtomKind.K_SW128, bf16),
            (C, D, self.stages),
            order=(0, 1, 2),
        )
        # q and k tiles side by side, (C, D, q|k, stage): the two SS products then differ only by an index
        tile_qk = cute.tile_to_shape(
            warpgroup.make_smem_layout_atom(warpgroup.SmemLayoutAtomKind.K_SW128, bf16),
            (C, D, 2, self.stages),
            order=(0, 1, 2, 3),
        )
        tile_mn_major = cute.tile_to_shape(
            warpgroup.make_smem_layout_atom(warpgroup.SmemLayoutAtomKind.MN_SW128, bf16),
            (D, C, 2, self.stages),
            order=(1, 0, 2, 3),
        )
        # the O staging tile, (C, D, 1): the layout of the q/k/v tiles, so a full chunk's O leaves by one TMA store
        tile_o = cute.tile_to_shape(
            warpgroup.make_smem_layout_atom(warpgroup.SmemLayoutAtomKind.K_SW128, bf16), (C, D, 1), order=(0, 1, 2)
        )
        cc_layout = cute.tile_to_shape(
            warpgroup.make_smem_layout_atom(warpgroup.SmemLayoutAtomKind.K_SW128, bf16), (C, C), order=(0, 1)
        )
        # Tinv and P side by side, (C, C, T|P, t_stage)
        tile_tp = cute.tile_to_shape(
            warpgroup.make_smem_layout_atom(warpgroup.SmemLayoutAtomKind.K_SW128, bf16),
            (C, C, 2, self.t_stages),
            order=(0, 1, 2, 3),
        )

        # (rows, cols) = (M, N) of each product; K extent comes from the operands
        mma_ss = sm90_utils.make_trivial_tiled_mma(bf16, bf16, OM.K, OM.K, cutlass.Float32, (1, 1, 1), (C, C))
        mma_rs = sm90_utils.make_trivial_tiled_mma(bf16, bf16, OM.K, OM.K, cutlass.Float32, (1, 1, 1), (C, C), RMEM)
        mma_state = sm90_utils.make_trivial_tiled_mma(bf16, bf16, OM.K, OM.MN, cutlass.Float32, (1, 1, 1), (C, D), RMEM)

        one_tile = cute.slice_(tile_k_major, (None, None, 0))
        op = cpasync.CopyBulkTensorTileG2SOp()
        tma_q, mQ = cpasync.make_tiled_tma_atom(op, tiles.tma_view(q), one_tile, (C, D))
        tma_k, mK = cpasync.make_tiled_tma_atom(op, tiles.tma_view(k), one_tile, (C, D))
        v_src = o if cutlass.const_expr(self.tile_v_src == "o") else v
        tma_v, mV = cpasync.make_tiled_tma_atom(op, tiles.tma_view(v_src), one_tile, (C, D))
        tma_o, mOt = cpasync.make_tiled_tma_atom(cpasync.CopyBulkTensorTileS2GOp(), tiles.tma_view(o), one_tile, (C, D))
        # the Tinv / P workspace [ranges, chunks * 2 * C, HV, C] (chunk c's Tinv at rows 2 c C, its P after them);
        # unused without intra (q's atom stands in for it)
        tma_w, mW = tma_q, mQ
        if cutlass.const_expr(self.intra != "none"):
            w_op = cpasync.CopyBulkTensorTileS2GOp() if self.intra == "save" else op
            tma_w, mW = cpasync.make_tiled_tma_atom(w_op, tiles.tma_view(w), cc_layout, (C, C))

        stages = self.stages

        @cute.struct
        class Storage:
            full: cute.struct.MemRange[cutlass.Int64, stages]
            sG: cute.struct.MemRange[cutlass.Float32, 2 * C]
            sBeta: cute.struct.MemRange[cutlass.Float32, 2 * C]
            sFac: cute.struct.MemRange[cutlass.Float32, 4 * C]
            sNorm: cute.struct.MemRange[cutlass.Float32, 3 * C]
            sA: cute.struct.Align[cute.struct.MemRange[cutlass.Float32, C * self.a_stride], 128]
            sO: cute.struct.Align[cute.struct.MemRange[bf16, cute.cosize(tile_o)], 1024]
            sQK: cute.struct.Align[cute.struct.MemRange[bf16, cute.cosize(tile_qk)], 1024]
            sV: cute.struct.Align[cute.struct.MemRange[bf16, cute.cosize(tile_k_major)], 1024]
            sTP: cute.struct.Align[cute.struct.MemRange[bf16, cute.cosize(tile_tp)], 1024]

        self.storage = Storage
        self.tma_bytes = (1 + int(self.make_o) + int(self.tile_v_src is not None)) * C * D * 2
        if cutlass.const_expr(self.intra == "load"):
            self.tma_bytes += (1 + int(self.make_o)) * C * C * 2
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
            tma_w,
            mW,
            tma_o,
            mOt,
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
            tile_k_major,
            tile_mn_major,
            tile_tp,
            tile_o,
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
        tma_w,
        mW,
        tma_o,
        mOt,
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
        tile_k_major,
        tile_mn_major,
        tile_tp,
        tile_o,
    ):

        C, D = self.C, self.D
        f32 = cutlass.Float32
        tidx, _, _ = cute.arch.thread_idx()
        hv, n, _ = cute.arch.block_idx()
        warp = cute.arch.make_warp_uniform(cute.arch.warp_idx())
        lane = cute.arch.lane_idx()
        wg = warp // 4  # math warpgroup: value rows [64 wg, 64 wg + 64) of S^T
        wtid = tidx % 128
        HV = mG.shape[2]
        h = hv // (HV // H)

        b, tok0, seqlen, n_chunks = sequence.sequence_bounds(n, T, mStart, mEnd, self.is_varlen, C)

        smem = cutlass.memory.SmemAllocator()
        st = smem.allocate(self.storage)
        full = st.full.data_ptr()
        sG = st.sG.get_tensor(cute.make_layout((C, 2)))  # log2-domain cumulative gate, 2 slots
        sBeta = st.sBeta.get_tensor(cute.make_layout((C, 2)))
        # per token, made once by the warp that publishes the gates: 2^G_t and 2^(G_last - G_t) (0 past the end)
        sFac = st.sFac.get_tensor(cute.make_layout((C, 2, 2)))
        # with qk_l2norm, per token of the current chunk: 1 / ||k_t||, log2 ||k_t||, 1 / ||q_t|| (eps under the root)
        sNorm = st.sNorm.get_tensor(cute.make_layout((C, 3)))
        sA = st.sA.get_tensor(cute.make_layout((C, self.a_stride), stride=(self.a_stride, 1)))
        sO3 = st.sO.get_tensor(tile_o.outer, swizzle=tile_o.inner)
        sO = sO3[None, None, 0]
        sQK = st.sQK.get_tensor(tile_qk.outer, swizzle=tile_qk.inner)
        sQ = sQK[None, None, 0, None]
        sK = sQK[None, None, 1, None]
        sV = st.sV.get_tensor(tile_k_major.outer, swizzle=tile_k_major.inner)
        # the k tiles read MN-major (D, C): same bytes as sK
        sK_mn = cute.make_tensor(cute.recast_ptr(sQK.iterator, tile_mn_major.inner), tile_mn_major.outer)
        sK_mn = sK_mn[None, None, 1, None]
        sTP = st.sTP.get_tensor(tile_tp.outer, swizzle=tile_tp.inner)
        sT = sTP[None, None, 0, 0]  # where the chunk's Tinv and P are made (without intra == "load")
        sP = sTP[None, None, 1, 0]

        # TMA partitions: this head's (T, D) plane, shifted to the sequence start, cut in C-token tiles
        tQs, tQg = tiles.tma_chunk_tiles(tma_q, mQ[None, None, h, b], tok0, sQ)
        tKs, tKg = tiles.tma_chunk_tiles(tma_k, mK[None, None, h, b], tok0, sK)
        tVs, tVg = tiles.tma_chunk_tiles(tma_v, mV[None, None, hv, b], tok0, sV)
        tWs, tWg = tQs, tQg
        if cutlass.const_expr(self.intra != "none"):
            # (C, C) tiles of this (range, head)'s workspace: 2 c for chunk c's Tinv, 2 c + 1 for its P; smem
            # buffers 2 s (Tinv) and 2 s + 1 (P) of t_stage s
            tWs, tWg = tiles.tma_chunk_tiles(tma_w, mW[None, None, hv, n], 0, cute.group_modes(sTP, 2, 4))
        tma = (tma_q, tQg, tQs, tma_k, tKg, tKs, tma_v, tVg, tVs, tma_w, tWg, tWs)
        tOs, tOg = tiles.tma_chunk_tiles(tma_o, mOt[None, None, hv, b], tok0, sO3)

        if warp == 0:
            cpasync.prefetch_descriptor(tma_q)
            cpasync.prefetch_descriptor(tma_k)
            cpasync.prefetch_descriptor(tma_v)
            if cutlass.const_expr(self.intra != "none"):
                cpasync.prefetch_descriptor(tma_w)
            if cutlass.const_expr(self.make_o):
                cpasync.prefetch_descriptor(tma_o)
        if tidx == 0:
            for s in cutlass.range_constexpr(self.stages):
                cute.arch.mbarrier_init(full + s, 1)
            cute.arch.mbarrier_init_fence()
        cute.arch.sync_threads()

        if warp == 0:
            for s in cutlass.range_constexpr(self.stages):
                if s < n_chunks:
                    self.issue_tma(tma, full, cutlass.Int32(s), lane)

        gG, gBeta = mG[b, None, hv], mBeta[b, None, hv]
        if warp == 0:
            if n_chunks > 0:
                g0 = gates_sm90.load_gates(gG, gBeta, tok0, seqlen, cutlass.Int32(0), lane, self.C)
                gates_sm90.publish_gates(sG, sBeta, sFac, 0, g0, cutlass.Int32(0), seqlen, lane, self.C)

        # ---- per-thread MMA partitions (each warpgroup works on its own 64 rows)
        thr_ss = mma_ss.get_slice(wtid)
        thr_rs = mma_rs.get_slice(wtid)
        thr_st = mma_state.get_slice(wtid)
        # SS operands (A = K or Q rows, B = K rows)
        tSSa = thr_ss.make_fragment_A(thr_ss.partition_A(sQK))
        tSSb_K = thr_ss.make_fragment_B(thr_ss.partition_B(sK))
        # RS operands
        tRSb_K = thr_rs.make_fragment_B(thr_rs.partition_B(sK))
        tRSb_Q = thr_rs.make_fragment_B(thr_rs.partition_B(sQ))
        tRSb_T = thr_rs.make_fragment_B(thr_rs.partition_B(sTP[None, None, 0, None]))
        tRSb_P = thr_rs.make_fragment_B(thr_rs.partition_B(sTP[None, None, 1, None]))
        tSTb_K = thr_st.make_fragment_B(thr_st.partition_B(sK_mn))
        # coordinates of accumulator elements
        cCC = thr_rs.partition_C(cute.make_identity_tensor((C, C)))
        cST = thr_st.partition_C(cute.make_identity_tensor((C, D)))
        cSS = thr_ss.partition_C(cute.make_identity_tensor((C, C)))

        acc_cc_shape = thr_rs.partition_shape_C((C, C))
        acc_s = thr_st.make_fragment_C(thr_st.partition_shape_C((C, D)))  # S^T rows of this WG, fp32
        row0 = wg * C if self.state_wgs == 2 else 0
        writes_state = True if self.state_wgs == 2 else wg == 0  # this WG's rows are its own (not a repeat)

        if cutlass.const_expr(self.has_h0):
            state.load_state(acc_s, cST, mH0, n, hv, row0)
        elif cutlass.const_expr(self.mode == "transition"):
            for i in cutlass.range_constexpr(cute.size(acc_s)):
                rh, kh = cST[i]
                acc_s[i] = f32(0.0)
                if kh == row0 + rh:
                    acc_s[i] = f32(1.0)
        else:
            acc_s.fill(0.0)
        if cutlass.const_expr(self.intra != "load"):
            solve.solve_clear(sT, tidx, self.threads)

        cute.arch.sync_threads()

        for c in cutlass.range(n_chunks, unroll=1):
            stage = c % self.stages
            tstage = stage if self.intra == "load" else 0  # Tinv / P buffer pair
            slot = c % 2
            L = cutlass.min(seqlen - c * C, C)
            g_last = sG[L - 1, slot]

            # the next chunk's gates: loaded here by every warp (no branch, so nothing waits for them), published
            # by warp 2 into the other slot later in the chunk
            nxt = gates_sm90.load_gates(gG, gBeta, tok0, seqlen, c + 1, lane, self.C)
            cute.arch.mbarrier_wait(full + stage, (c // self.stages) % 2)

            # ---- 1. WG0: A = strict-lower(beta_i K K^T exp(G_i - G_j)); WG1: P = lower(scale Q K^T exp(G_i - G_j))
            # (loaded with the chunk's tiles instead when intra == "load")
            if cutlass.const_expr(self.intra != "load"):
                acc_x = thr_ss.make_fragment_C(thr_ss.partition_shape_C((C, C)))
                if wg == 0 or cutlass.const_expr(self.make_o):
                    warpgroup.fence()
                    mma.gemm(
                        mma_ss, acc_x, tSSa[None, None, None, 1 - wg, stage], tSSb_K[None, None, None, stage], True
                    )
                    warpgroup.commit_group()
                warpgroup.wait_group(0)
                if cutlass.const_expr(self.qk_l2norm):
                    self.token_norms(acc_x, cSS, sQ[None, None, stage], sNorm, wg, wtid)
                    cute.arch.barrier(barrier_id=1, number_of_threads=self.threads)
                # this thread's accumulator elements lie on 2 rows and 16 columns: their gates are read once
                g_r, b_r, g_c = gates_sm90.row_col_gates(sG, sBeta, sNorm, cSS, slot, self.qk_l2norm)
                if wg == 0:
                    for i in cutlass.range_constexpr(cute.size(acc_x)):
                        ra, ja = cSS[i]
                        rr, kc = mma.acc_row_slot(i), mma.acc_col_slot(i)
                        va = f32(0.0)
                        if ja < ra:
                            if ra < L:
                                va = acc_x[i] * b_r[rr] * cute.math.exp2(g_r[rr] - g_c[kc], fastmath=True)
                        # stored transposed: the solver walks A column by column
                        sA[ja, ra] = va
                elif cutlass.const_expr(self.make_o):
                    # elements i, i + 1 (i even) are columns j, j + 1 of one row: stored as one 4-byte pair
                    pair = cute.make_rmem_tensor(cute.make_layout((1, 2)), cutlass.BFloat16)
                    for i in cutlass.range_constexpr(cute.size(acc_x)):
                        rp, jp = cSS[i]
                        rr, kc = mma.acc_row_slot(i), mma.acc_col_slot(i)
                        vp = f32(0.0)
                        if jp <= rp:
                            vp = acc_x[i] * scale * cute.math.exp2(g_r[rr] - g_c[kc], fastmath=True)
                            if cutlass.const_expr(self.qk_l2norm):
                                vp = vp * sNorm[rp, 2]
                        pair[0, i % 2] = vp.to(cutlass.BFloat16)
                        if cutlass.const_expr(i % 2 == 1):
                            cute.autovec_copy(pair, cute.local_tile(sP, (1, 2), (rp, jp // 2)))
            # sP is read by wgmma (async proxy) after ordinary stores
            cute.arch.fence_proxy("async.shared", space="cta")
            if cutlass.const_expr(self.make_o):
                # the previous chunk's O store has read the staging tile before anyone writes it again (step 4)
                if warp == 0:
                    cute.arch.cp_async_bulk_wait_group(0, read=True)
            cute.arch.barrier(barrier_id=1, number_of_threads=self.threads)

            # ---- 2. S^T K^T and S^T Q^T (they do not need Tinv) are issued before Tinv = (I + A)^-1 is solved by
            # 16-blocks
            rS = mma.acc_to_operand(acc_s)
            acc_k = thr_rs.make_fragment_C(acc_cc_shape)
            acc_o = thr_rs.make_fragment_C(acc_cc_shape)
            warpgroup.fence()
            mma.gemm(mma_rs, acc_k, rS, tRSb_K[None, None, None, stage], True)
            if cutlass.const_expr(self.make_o):
                mma.gemm(mma_rs, acc_o, rS, tRSb_Q[None, None, None, stage], True)
            warpgroup.commit_group()
            if cutlass.const_expr(self.intra != "load"):
                if warp < 2:
                    solve.solve_diag16(sA, sT, tidx)
                elif warp == 2:
                    # the next chunk's gates into the other slot (this chunk reads only its own; the other's last
                    # readers were done at the previous chunk's final barrier)
                    gates_sm90.publish_gates(sG, sBeta, sFac, 1 - slot, nxt, c + 1, seqlen, lane, self.C)
                cute.arch.barrier(barrier_id=1, number_of_threads=self.threads)
                solve.solve_merge(sA, sT, tidx, 1, self.threads)
                cute.arch.fence_proxy("async.shared", space="cta")
                cute.arch.barrier(barrier_id=1, number_of_threads=self.threads)
            if cutlass.const_expr(self.intra == "save"):
                # Tinv and P of this chunk to the workspace; their buffers are next written in the next chunk, after
                # this chunk's final barrier, before which warp 0 waits for the stores to have read them
                if warp == 0:
                    workspace.save_tinv_p(tma_w, tWs, tWg, c)

            # ---- 3. the other state products on this WG's 64 value rows. First, while S^T K^T may still run: the
            # factors of this thread's 16 accumulator columns (mma.acc_col_slot), zero past the sequence end, and
            # the state's chunk decay
            e_g = cute.make_rmem_tensor(cute.make_layout(16), f32)  # exp(G_j)
            e_d = cute.make_rmem_tensor(cute.make_layout(16), f32)  # exp(G_last - G_j)
            b_j = cute.make_rmem_tensor(cute.make_layout(16), f32)  # beta_j
            for kc in cutlass.range_constexpr(16):
                _, jc = cCC[mma.acc_col_element(kc)]
                e_g[kc] = sFac[jc, slot, 0]
                e_d[kc] = sFac[jc, slot, 1]
                b_j[kc] = sBeta[jc, slot]
                if cutlass.const_expr(self.qk_l2norm):
                    e_g[kc] = e_g[kc] * sNorm[jc, 0]
                    e_d[kc] = e_d[kc] * sNorm[jc, 0]
            decay = cute.math.exp2(g_last, fastmath=True)
            for i in cutlass.range_constexpr(cute.size(acc_s)):
                acc_s[i] = acc_s[i] * decay
            warpgroup.wait_group(0)

            # Y^T[v, j] = beta_j (V[j, v] - exp(G_j) (S^T K^T)[v, j]), zero past the sequence end
            for i in cutlass.range_constexpr(cute.size(acc_k)):
                r, j = cCC[i]
                kc = mma.acc_col_slot(i)
                vv = f32(0.0)
                if cutlass.const_expr(self.tile_v_src == "v"):
                    vv = sV[j, row0 + r, stage].to(f32)
                acc_k[i] = b_j[kc] * (vv - e_g[kc] * acc_k[i])
            rY = mma.acc_to_operand(acc_k)
            acc_vn = thr_rs.make_fragment_C(acc_cc_shape)
            warpgroup.fence()
            mma.gemm(mma_rs, acc_vn, rY, tRSb_T[None, None, None, tstage], True)
            warpgroup.commit_group()
            # O^T inter-chunk part scaled while V_new^T is computed
            if cutlass.const_expr(self.make_o):
                for i in cutlass.range_constexpr(cute.size(acc_o)):
                    if cutlass.const_expr(self.qk_l2norm):
                        _, jo = cCC[i]
                        acc_o[i] = acc_o[i] * scale * sFac[jo, slot, 0] * sNorm[jo, 2]
                    else:
                        acc_o[i] = acc_o[i] * scale * e_g[mma.acc_col_slot(i)]
            warpgroup.wait_group(0)

            # O^T += V_new^T P^T;  S^T += (V_new^T exp(G_last - G_j)) K
            rVn = mma.acc_to_operand(acc_vn)
            for i in cutlass.range_constexpr(cute.size(acc_vn)):
                acc_vn[i] = acc_vn[i] * e_d[mma.acc_col_slot(i)]
            rVd = mma.acc_to_operand(acc_vn)
            warpgroup.fence()
            if cutlass.const_expr(self.make_o):
                mma.gemm(mma_rs, acc_o, rVn, tRSb_P[None, None, None, tstage], False)
            mma.gemm(mma_state, acc_s, rVd, tSTb_K[None, None, None, stage], False)
            warpgroup.commit_group()
            warpgroup.wait_group(0)

            # ---- 4. O^T -> smem (token-major); a full chunk leaves by a TMA store after the barrier, the last one (maybe
            # partial: rows past the sequence end belong to the next) by plain stores after the loop
            if cutlass.const_expr(self.make_o):
                if writes_state:
                    for i in cutlass.range_constexpr(cute.size(acc_o)):
                        r, j = cCC[i]
                        if cutlass.const_expr(self.tile_v_src == "o"):
                            acc_o[i] = acc_o[i] + sV[j, row0 + r, stage].to(f32)
                        sO[j, row0 + r] = acc_o[i].to(cutlass.BFloat16)
                # the TMA store (async proxy) reads what these ordinary stores wrote
                cute.arch.fence_proxy("async.shared", space="cta")
            if cutlass.const_expr(self.intra == "load"):
                # (with the solve, the gates are published while warps 0-1 solve the diagonal blocks)
                if warp == 2:
                    gates_sm90.publish_gates(sG, sBeta, sFac, 1 - slot, nxt, c + 1, seqlen, lane, self.C)
            if cutlass.const_expr(self.intra == "save"):
                if warp == 0:
                    cute.arch.cp_async_bulk_wait_group(0, read=True)
            cute.arch.barrier(barrier_id=1, number_of_threads=self.threads)

            if warp == 0:
                if c + self.stages < n_chunks:
                    self.issue_tma(tma, full, c + self.stages, lane)
                if cutlass.const_expr(self.make_o):
                    if c + 1 < n_chunks:
                        cute.copy(tma_o, tOs[None, 0], tOg[None, c])
                        cute.arch.cp_async_bulk_commit_group()

        # the last chunk's O, by plain stores with rows past the sequence end masked
        if cutlass.const_expr(self.make_o):
            if n_chunks > 0:
                epilogue.store_o_rows(
                    sO,
                    mO,
                    b,
                    hv,
                    tok0 + (n_chunks - 1) * C,
                    seqlen - (n_chunks - 1) * C,
                    tidx,
                    C,
                    D,
                    self.threads,
                )
            if warp == 0:
                cute.arch.cp_async_bulk_wait_group(0)

        # ---- final state
        if writes_state:
            state.store_state(acc_s, cST, mHt, n, hv, row0)

    # ---------------------------------------------------------------- helpers
    @cute.jit
    def issue_tma(self, tma, full, chunk, lane):
        """One warp (the copies elect their issuing lane): the q, k, v tiles of ``chunk`` into its stage, completing
        on the stage's barrier."""
        tma_q, tQg, tQs, tma_k, tKg, tKs, tma_v, tVg, tVs, tma_w, tWg, tWs = tma
        s = chunk % self.stages
        if lane == 0:
            cute.arch.mbarrier_arrive_and_expect_tx(full + s, self.tma_bytes)
        if cutlass.const_expr(self.make_o):
            cute.copy(tma_q, tQg[None, chunk], tQs[None, s], tma_bar_ptr=full + s)
        cute.copy(tma_k, tKg[None, chunk], tKs[None, s], tma_bar_ptr=full + s)
        if cutlass.const_expr(self.tile_v_src is not None):
            cute.copy(tma_v, tVg[None, chunk], tVs[None, s], tma_bar_ptr=full + s)
        if cutlass.const_expr(self.intra == "load"):
            workspace.load_tinv_p(tma_w, tWg, tWs, chunk, s, full + s, self.make_o)

    @cute.jit
    def token_norms(self, acc_kk, cSS, sQ, sNorm, wg, wtid):
        """Per-token norms of the chunk for qk_l2norm: WG0 takes ||k_t||^2 from the diagonal of its K K^T
        accumulator; WG1 sums the squares of a Q tile row (two threads per row, 64 columns each)."""
        f32 = cutlass.Float32
        eps = f32(L2NORM_EPS)
        if wg == 0:
            for i in cutlass.range_constexpr(cute.size(acc_kk)):
                r, j = cSS[i]
                if r == j:
                    n2 = acc_kk[i] + eps
                    sNorm[r, 0] = cute.math.rsqrt(n2, fastmath=True)
                    sNorm[r, 1] = f32(0.5) * cute.math.log2(n2, fastmath=True)
        elif cutlass.const_expr(self.make_o):
            row, half = wtid // 2, wtid % 2
            acc = tiles.row_sum_squares(sQ, row, half * (self.D // 16), self.D // 16)
            acc = acc + cute.arch.shuffle_sync_bfly(acc, 1)
            if half == 0:
                sNorm[row, 2] = cute.math.rsqrt(acc + eps, fastmath=True)


# -------------------------------------------------------------------- compile
def compile_gdn_fwd_sm90(
    arch="sm_90a",
    keep_artifacts=False,
    head_dim=128,
    beta_fp32=True,
    is_varlen=False,
    has_initial_state=False,
    state_v_first=False,
    mode="full",
    qk_l2norm=False,
    intra="none",
):
    if uses_roles(head_dim, mode, intra):
        return legacy_roles_sm90.compile_gdn_fwd_roles_sm90(
            arch, keep_artifacts, beta_fp32, is_varlen, has_initial_state, state_v_first, mode, intra, qk_l2norm
        )
    kernel = GDNChunkFwdSm90(head_dim, beta_fp32, is_varlen, has_initial_state, state_v_first, mode, qk_l2norm, intra)
    fake = entry.fake_args(kernel.D, kernel.beta_fp32, kernel.state_v_first, per_key_gate=False)
    return runtime.compile_kernel(kernel, fake, arch, keep_artifacts)


# the earlier kernels' checked variants (the four-role kernel's fixed-length form too: its register allocation differs
# from the varlen one's), while dispatch still serves them by default
entry.register_checked(
    "gdn_chunk_fwd_sm90_earlier",
    lambda arch, **o: compile_gdn_fwd_sm90(arch, **o),
    {
        "": {"is_varlen": True, "has_initial_state": True},
        "[fixed length]": {},
        "[qk_l2norm]": {"is_varlen": True, "has_initial_state": True, "qk_l2norm": True},
        "[D=64]": {"head_dim": 64, "is_varlen": True, "has_initial_state": True},
        "[transition]": {"is_varlen": True, "mode": "transition"},
        "[correction]": {"is_varlen": True, "mode": "correction"},
        "[intra save]": {"is_varlen": True, "has_initial_state": True, "intra": "save"},
        "[intra load, transition]": {"is_varlen": True, "mode": "transition", "intra": "load"},
        "[intra load, correction]": {"is_varlen": True, "mode": "correction", "intra": "load"},
        "[D=64, intra save]": {"head_dim": 64, "is_varlen": True, "has_initial_state": True, "intra": "save"},
        "[D=64, intra load, correction]": {"head_dim": 64, "is_varlen": True, "mode": "correction", "intra": "load"},
        "[qk_l2norm, intra save]": {"is_varlen": True, "intra": "save", "qk_l2norm": True},
        "[qk_l2norm, intra load, correction]": {
            "is_varlen": True,
            "mode": "correction",
            "intra": "load",
            "qk_l2norm": True,
        },
        "[D=64, qk_l2norm, correction]": {"head_dim": 64, "is_varlen": True, "mode": "correction", "qk_l2norm": True},
    },
)
