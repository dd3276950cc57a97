"""The scalar-gate chunk forward of the SM90 family: one gate value per token (GDN's g, simple GLA's g and
Lightning's per-head g_gamma), on the skeleton of :mod:`cula.sm90.chunk_fwd`. ``ChunkFwdConfig.delta_rule`` chooses
the recurrence at compile time.

Math per chunk (FLA convention; state S is K x V; G the cumulative log gate inside the chunk, in log2 units). With
the delta rule (GDN):

    A     = tril(diag(beta) (K K^T * 2^(G_i - G_j)), -1)          Tinv = (I + A)^-1
    Y     = diag(beta) (V - (K * 2^G) S)                          V_new = Tinv Y
    O     = scale (Q * 2^G) S + tril(scale Q K^T * 2^(G_i - G_j)) V_new
    S    <- 2^G_last S + (K * 2^(G_last - G))^T V_new

Without it (simple GLA, Lightning): no A, no beta, no solve, V_new = V.

The gate is one value per token, so its factors multiply the accumulators' token columns and the state as a
whole: the B tiles are the raw q and k tiles. Roles (512 threads at D = 128, 384 at D = 64):

- PRODUCER (24 registers): warp 0 issues the q | k tiles (3 stages), the v tiles (2) and, in the later split passes,
  the saved Tinv | P (2); warp 1 scans each chunk's gates into a gate slot (G, beta, 2^G, 2^(G_last - G)); with
  qk_l2norm warps 2 and 3 first take the norms of the landed q and k rows, which the gate warp folds into the slot
  (the tiles stay as loaded).
- INTRA (104): K K^T and Q K^T (wgmma SS), the masks (A^T fp32 to ``sA``, P bf16 by stmatrix), Tinv on one
  warpgroup (:func:`cula.sm90.solve.solve_diag16_per_warp`, ``solve_merge_to_bf16``); without the delta rule only
  Q K^T and P; idle in the later split passes that load them, absent from the correction pass without it (V_new = 0
  there: no P and no update).
- STATE (the rest): one warpgroup per 64 value rows of S^T.

Shapes as :mod:`cula.sm90.chunk_fwd`; g [B, T, HV] fp32 (activated natural-log gate). Without the delta rule the
beta slot is never read.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import NamedTuple

import cutlass
import cutlass.cute as cute
from cutlass.cute.nvgpu import warp as warp_ops
from cutlass.cute.nvgpu import warpgroup

from cula import runtime
from cula.ops.gates import L2NORM_EPS  # FLA's l2norm_fwd: x / sqrt(sum(x^2) + eps)
from cula.sm90 import entry, mma, pipeline, scalar_gates, solve, tiles, workspace
from cula.sm90.chunk_fwd import ChainInputs, ChunkFwdConfig, ChunkFwdSm90, ChunkTensors
from cula.sm90.roles import Barrier, RoleLayout, WarpGroupRole
from cula.sm90.state_chain import ChainGates


class GateParams(NamedTuple):
    g: cute.Tensor  # [B, T, HV] fp32


class GateSmem(NamedTuple):
    """Per gate slot (one per q | k stage): G (log2 units), beta, the per-token factors (``FAC_*`` columns) and,
    with qk_l2norm, the norm columns (:meth:`ScalarGateChunkFwdSm90.publish_norm_gates`)."""

    sG: cute.Tensor  # (C, slots)
    sBeta: cute.Tensor  # (C, slots)
    sFac: cute.Tensor  # (C, slots, factor columns)
    sNorm: cute.Tensor  # (C, slots, 4) with qk_l2norm (else sFac again: never read)


class Rings(NamedTuple):
    qk: object  # q | k tiles, TMA: the intra role (unless it idles) and the state warpgroups read them
    gate: object  # the gate slot of each q | k stage, by the gate warp
    norm: object  # 1 / ||q||, 1 / ||k|| per slot, by the norm warps, for the gate warp (qk_l2norm; else None)
    v: object  # v (or a correction pass's first o), TMA
    tp: object  # Tinv | P: by the intra role, or TMA in the later split passes


class StateRings(NamedTuple):
    qk: object
    gate: object


@dataclass(frozen=True)
class ScalarChainGates(ChainGates):
    """The scalar gate in the state chain, from gate slot ``s``: the state decays by 2^G_last as a whole; Y, O and the
    update take per-token factors on their token columns (``fac_y``: 2^G, or 2^G / ||k|| with qk_l2norm; column 0
    2^G (/ ||q||) for O; column 1 2^(G_last - G) (/ ||k||) for the update)."""

    gs: GateSmem
    s: object
    scale: object
    fac_y: int
    # the update's factor column (1: 2^(G_last - G); 0: 2^G, the state-gradient walk) and its scale (that walk's)
    fac_update: int = 1
    update_scale: object = None

    @cute.jit
    def decay(self, acc_s, cST):
        C = cute.size(self.gs.sG, mode=[0])
        decay = cute.math.exp2(self.gs.sG[C - 1, self.s], fastmath=True)  # G is flat past the sequence end
        for i in cutlass.range_constexpr(cute.size(acc_s)):
            acc_s[i] = acc_s[i] * decay

    @cute.jit
    def y(self, acc_k, v_frag, cCC):
        # Y^T[v, j] = beta_j (V[j, v] - 2^G_j (S^T K^T)[v, j]) (beta and V zero past the sequence end); the per-token
        # factors are read where used (held in registers they cost 16 each)
        sBeta, sFac, s = self.gs.sBeta, self.gs.sFac, self.s
        for i in cutlass.range_constexpr(cute.size(acc_k)):
            _, j = cCC[i]
            if cutlass.const_expr(v_frag is None):
                acc_k[i] = -(sBeta[j, s] * sFac[j, s, self.fac_y]) * acc_k[i]
            else:
                acc_k[i] = sBeta[j, s] * (v_frag[i].to(cutlass.Float32) - sFac[j, s, self.fac_y] * acc_k[i])

    @cute.jit
    def o(self, acc_o, cCC):
        for i in cutlass.range_constexpr(cute.size(acc_o)):
            _, j = cCC[i]
            acc_o[i] = acc_o[i] * self.scale * self.gs.sFac[j, self.s, 0]

    @cute.jit
    def update(self, acc_vn, cCC):
        rVn = mma.acc_to_operand(acc_vn)
        for i in cutlass.range_constexpr(cute.size(acc_vn)):
            _, j = cCC[i]
            factor = self.gs.sFac[j, self.s, self.fac_update]
            if cutlass.const_expr(self.update_scale is not None):
                factor = factor * self.update_scale
            acc_vn[i] = acc_vn[i] * factor
        return rVn, None, mma.acc_to_operand(acc_vn)

    @cute.jit
    def to_end(self, acc, cCC):
        for i in cutlass.range_constexpr(cute.size(acc)):
            _, j = cCC[i]
            acc[i] = acc[i] * self.gs.sFac[j, self.s, 1]

    @cute.jit
    def query_operand(self, do_frag, cCC):
        x = cute.make_rmem_tensor(do_frag.layout, cutlass.Float32)
        for i in cutlass.range_constexpr(cute.size(do_frag)):
            _, j = cCC[i]
            x[i] = do_frag[i].to(cutlass.Float32) * self.scale * self.gs.sFac[j, self.s, 0]
        return mma.acc_to_operand(x)

    @cute.jit
    def key_operand(self, acc_y, cCC):
        for i in cutlass.range_constexpr(cute.size(acc_y)):
            _, j = cCC[i]
            acc_y[i] = -(self.gs.sBeta[j, self.s] * self.gs.sFac[j, self.s, 0]) * acc_y[i]
        return mma.acc_to_operand(acc_y)


class ScalarGateChunkFwdSm90(ChunkFwdSm90):
    """The scalar-gate kernel (module docstring)."""

    qk_stages = 3  # the intra role reads up to two chunks ahead of the state warpgroups
    zeroes_v_tail = True  # Y = beta (V - ...) and simple GLA's V_new = V meet zero factors past the sequence end
    tp_stages = 2
    o_stages = 2
    takes_value_blocks = True

    def __init__(self, config):
        # a correction pass without the delta rule: no intra role, only the q tile of each q | k stage loaded
        self.zero_values = not config.delta_rule and config.mode == "correction"
        super().__init__(config)
        # per-token factors of a gate slot: 2^G and 2^(G_last - G); with qk_l2norm 2^G / ||q||, 2^(G_last - G) / ||k||
        # and 2^G / ||k||, then the norm columns
        self.fac_cols = 3 if config.qk_l2norm else 2
        self.norm_cols = 4 if config.qk_l2norm else 0
        self.intra_idle = config.intra == "load" or self.k_only or self.zero_values

    @property
    def k_only(self) -> bool:
        """A state walk without the delta rule: no output and no intra role; only the k tile of each q | k stage is
        loaded."""
        return self.cfg.walk != "output" and not self.cfg.delta_rule

    def role_layout(self) -> RoleLayout:
        R = WarpGroupRole
        intra = () if self.k_only or self.zero_values else (R.INTRA,)
        roles = (R.PRODUCER, *intra) + (R.STATE,) * (self.Dv // 64)
        # the state warpgroups peak at ~189 registers at D = 128
        return RoleLayout.make(roles, {R.PRODUCER: 24, R.INTRA: 104})

    # ---------------------------------------------------------------- host side
    @cute.jit
    def __call__(self, q, k, v, g, beta, o, h0, ht, starts, ends, w, slots, scale, stream):
        self.launch(ChunkTensors(q, k, v, g, beta, o, h0, ht, starts, ends, w, slots), scale, (), stream)

    def gate_host(self, t: ChunkTensors, gate_args: tuple, tile_qk, tile_v):
        C, slots = self.C, self.qk_stages
        f32 = cutlass.Float32
        rings = {"qk": self.qk_stages, "gate": slots, "norm": slots, "v": self.v_stages, "tp": self.tp_stages}
        fields = {f"ring_{name}": pipeline.ring_storage(stages) for name, stages in rings.items()}
        fields.update(
            sG=cute.struct.MemRange[f32, slots * C],
            sBeta=cute.struct.MemRange[f32, slots * C],
            sFac=cute.struct.MemRange[f32, slots * (self.fac_cols + self.norm_cols) * C],
        )
        return GateParams(t.g), fields

    # ---------------------------------------------------------------- device side
    def gate_smem(self, st, p):
        C, slots = self.C, self.qk_stages
        sFac = st.sFac.get_tensor(cute.make_layout((C, slots, self.fac_cols)))
        sNorm = sFac
        if cutlass.const_expr(self.cfg.qk_l2norm):
            sNorm = cute.make_tensor(sFac.iterator + C * slots * self.fac_cols, cute.make_layout((C, slots, 4)))
        return GateSmem(
            st.sG.get_tensor(cute.make_layout((C, slots))),
            st.sBeta.get_tensor(cute.make_layout((C, slots))),
            sFac,
            sNorm,
        )

    def make_rings(self, st, c):
        C, D = self.C, self.D
        cfg = self.cfg
        state_threads = self.layout.threads_of(WarpGroupRole.STATE)
        state_warps = state_threads // 32
        intra_threads = 0 if self.intra_idle else 128
        tiles_per_stage = 1 if self.k_only or self.zero_values else 2
        qk = pipeline.tma_ring(
            st.ring_qk, self.qk_stages, tiles_per_stage * C * D * 2, intra_threads // 32 + state_warps
        )
        gate = pipeline.thread_ring(st.ring_gate, self.qk_stages, 32, intra_threads + state_threads)
        norm = None
        if cutlass.const_expr(cfg.qk_l2norm):
            norm = pipeline.thread_ring(st.ring_norm, self.qk_stages, 64, 32)
        v = pipeline.tma_ring(st.ring_v, self.v_stages, C * self.Dv * 2, state_warps)  # the CTA's value columns
        if cutlass.const_expr(self.intra_idle):
            tp_bytes = (1 + int(cfg.make_o)) * C * C * 2
            tp = pipeline.tma_ring(st.ring_tp, self.tp_stages, tp_bytes, state_warps)
        else:
            tp = pipeline.thread_ring(st.ring_tp, self.tp_stages, 128, state_threads)
        return Rings(qk, gate, norm, v, tp)

    def prefetch_descriptors(self, p):
        super().prefetch_descriptors(p)
        if cutlass.const_expr(self.cfg.intra != "none"):
            cute.nvgpu.cpasync.prefetch_descriptor(p.common.w.atom)

    @cute.jit
    def producer_role(self, p, smem, gsmem, rings, seq, tid, warp):
        if warp == 0:
            self.load_warp(p, smem, rings, seq)
        elif warp == 1:
            self.gate_warp(p, smem, gsmem, rings, seq)
        elif cutlass.const_expr(self.cfg.qk_l2norm):
            self.norm_warps(smem, gsmem, rings, seq, warp - 2)

    @cute.jit
    def load_warp(self, p, smem, rings, seq):
        """Chunk c's q | k tiles once its stage is free, its v (or first-pass o) tile likewise; in the later split
        passes also its saved Tinv (and P)."""
        c = p.common
        cfg = self.cfg
        tQs, tQg = tiles.tma_chunk_tiles(
            c.q.atom, c.q.tensor[None, None, seq.h, seq.b], seq.tok0, smem.sQK[None, None, 0, None]
        )
        tKs, tKg = tiles.tma_chunk_tiles(
            c.k.atom, c.k.tensor[None, None, seq.h, seq.b], seq.tok0, smem.sQK[None, None, 1, None]
        )
        tVs, tVg = tiles.tma_chunk_tiles(c.v.atom, c.v.tensor[None, None, seq.hv, seq.b], seq.tok0, smem.sV, seq.vb)
        tWs, tWg = tiles.tma_chunk_tiles(
            c.w.atom, c.w.tensor[None, None, seq.hv, seq.n], 0, cute.group_modes(smem.sTP, 2, 4)
        )
        qk_p = pipeline.producer_start(self.qk_stages)
        v_p = pipeline.producer_start(self.v_stages)
        tp_p = pipeline.producer_start(self.tp_stages)
        for chunk in cutlass.range(seq.n_chunks, unroll=1):
            pos = self.chunk_position(chunk, seq)
            rings.qk.producer_acquire(qk_p)
            bar = rings.qk.producer_get_barrier(qk_p)
            if cutlass.const_expr(not self.k_only):
                cute.copy(c.q.atom, tQg[None, pos], tQs[None, qk_p.index], tma_bar_ptr=bar)
            if cutlass.const_expr(not self.zero_values):
                cute.copy(c.k.atom, tKg[None, pos], tKs[None, qk_p.index], tma_bar_ptr=bar)
            qk_p.advance()
            if cutlass.const_expr(cfg.v_from is not None):
                rings.v.producer_acquire(v_p)
                cute.copy(c.v.atom, tVg[None, pos], tVs[None, v_p.index], tma_bar_ptr=rings.v.producer_get_barrier(v_p))
                v_p.advance()
            if cutlass.const_expr(cfg.intra == "load"):
                rings.tp.producer_acquire(tp_p)
                bar = rings.tp.producer_get_barrier(tp_p)
                workspace.load_tinv_p(c.w.atom, tWg, tWs, chunk, tp_p.index, bar, cfg.make_o)
                tp_p.advance()

    @cute.jit
    def gate_warp(self, p, smem, gs, rings, seq):
        """Chunk c's gates scanned into gate slot c % 3 once that slot is free (the loads are issued before the wait);
        with qk_l2norm the norms folded in once the norm warps have them. In a varlen call, once the chunk's q | k
        stage has landed, its k rows past the sequence end are zeroed (:meth:`zero_k_tail`) before the slot is
        published: every reader of the stage (the intra and state roles) waits for the slot first."""
        lane = cute.arch.lane_idx()
        mG, mBeta = p.gate.g, p.common.beta
        gG = mG[seq.b, None, seq.hv]
        gBeta = mBeta[seq.b, None, seq.hv] if cutlass.const_expr(self.cfg.delta_rule) else None
        g_p = pipeline.producer_start(self.qk_stages)
        norm_c = pipeline.consumer_start(self.qk_stages)
        qk_seen = pipeline.consumer_start(self.qk_stages)  # waited on, not released (the stage's readers release it)
        for chunk in cutlass.range(seq.n_chunks, unroll=1):
            pos = self.chunk_position(chunk, seq)
            raw = scalar_gates.load_gates(gG, gBeta, seq.tok0, seq.seqlen, pos, lane, self.C)
            rings.gate.producer_acquire(g_p)
            scalar_gates.publish_gates(gs.sG, gs.sBeta, gs.sFac, g_p.index, raw, pos, seq.seqlen, lane, self.C)
            valid = cutlass.min(seq.seqlen - pos * self.C, self.C)
            if cutlass.const_expr(self.cfg.qk_l2norm):
                rings.norm.consumer_wait(norm_c)
                self.publish_norm_gates(gs, g_p.index, lane, valid)
                rings.norm.consumer_release(norm_c)
                norm_c.advance()
            if cutlass.const_expr(self.cfg.is_varlen):
                # after the norm warps' reads of the stage (their norms are in)
                rings.qk.consumer_wait(qk_seen)
                self.zero_k_tail(smem.sQK[None, None, 1, qk_seen.index], valid, lane)
                if cutlass.const_expr(self.cfg.reverse and self.cfg.delta_rule):
                    # the state-gradient walk sums over P's rows and q's (dO^T P, dO^T Q): q's rows past the end too
                    self.zero_k_tail(smem.sQK[None, None, 0, qk_seen.index], valid, lane)
                qk_seen.advance()
            rings.gate.producer_commit(g_p)
            g_p.advance()

    @cute.jit
    def zero_k_tail(self, sK, valid, lane):
        """When the chunk ends its sequence early, rows ``valid`` .. C - 1 of its k tile (in a varlen call the next
        sequence's tokens, NaN included) zeroed by the gate warp's lanes and fenced for the wgmmas that read it and
        the stage's next TMA write: the products that mask those tokens by zero factors (beta, 2^(G_last - G)) then
        stay finite. A fixed-length call needs none: its tiles end at the tensor's bound, where TMA fills zeros."""
        if valid < self.C:
            tiles.zero_rows_from(sK, valid, lane, 32)
            cute.arch.fence_proxy("async.shared", space="cta")

    @cute.jit
    def norm_warps(self, smem, gs, rings, seq, which):
        """qk_l2norm, warps 2 and 3, a lane per row (rows 32 ``which`` + lane of q and of k): once chunk c's q | k
        stage has landed, each row's sum of squares (fp32, eps under the root as FLA's l2norm_fwd) gives 1 / ||q||
        and 1 / ||k|| in norm columns 0 and 1 of slot c % 3 (the tiles are not rewritten: normalising them in place
        bounded the chunk)."""
        f32 = cutlass.Float32
        lane = cute.arch.lane_idx()
        row = 32 * which + lane
        n_p = pipeline.producer_start(self.qk_stages)
        qk_seen = pipeline.consumer_start(self.qk_stages)
        for _chunk in cutlass.range(seq.n_chunks, unroll=1):
            rings.norm.producer_acquire(n_p)
            rings.qk.consumer_wait(qk_seen)
            for x in cutlass.range_constexpr(2):
                # four 16-byte pieces per step of a loop: fully unrolled, the swizzled addresses of 16 pieces took
                # more than this warpgroup's 24 registers
                tile = smem.sQK[None, None, x, qk_seen.index]
                n2 = f32(0.0)
                for blk in cutlass.range(self.D // 32, unroll=1):
                    n2 = n2 + tiles.row_sum_squares(tile, row, 4 * blk, 4)
                gs.sNorm[row, n_p.index, x] = cute.math.rsqrt(n2 + f32(L2NORM_EPS), fastmath=True)
            rings.norm.producer_commit(n_p)
            n_p.advance()
            qk_seen.advance()

    @cute.jit
    def publish_norm_gates(self, gs, s, lane, valid):
        """qk_l2norm, the gate warp: 1 / ||q|| and 1 / ||k|| folded into gate slot s for its two tokens per lane. Norm
        column 0 becomes G - log2 ||q|| (P's rows), 2 beta / ||k|| (A's rows), 3 G + log2 ||k|| (A's and P's
        columns; column 1 keeps the raw 1 / ||k||, read by no one); the state's factors become 2^G / ||q|| (O),
        2^(G_last - G) / ||k|| (the update) and 2^G / ||k|| (Y). The rows past the sequence end (``valid`` .. C - 1:
        zeros, or in a varlen call the next sequence's tokens, whose norms may be NaN) take both norms as 1, by a
        select: their beta and last factor are zero, and their other factors reach only masked entries and rows
        that are not stored."""
        sG, sBeta, sFac, sNorm = gs
        for half in cutlass.range_constexpr(2):
            t = lane + 32 * half
            inv_q, inv_k = cutlass.Float32(1.0), cutlass.Float32(1.0)
            if t < valid:
                inv_q, inv_k = sNorm[t, s, 0], sNorm[t, s, 1]
            G, two_g = sG[t, s], sFac[t, s, 0]
            sNorm[t, s, 0] = G + cute.math.log2(inv_q, fastmath=True)
            sNorm[t, s, 2] = sBeta[t, s] * inv_k
            sNorm[t, s, 3] = G - cute.math.log2(inv_k, fastmath=True)
            sFac[t, s, 0] = two_g * inv_q
            sFac[t, s, 1] = sFac[t, s, 1] * inv_k
            sFac[t, s, 2] = two_g * inv_k

    @cute.jit
    def intra_role(self, p, smem, gs, rings, seq, atid, awarp):
        """Per chunk: A = strict-lower(beta_i K K^T 2^(G_i - G_j)) (fp32, transposed, to ``sA``), P = lower(scale
        Q K^T 2^(G_i - G_j)) and Tinv = (I + A)^-1 (bf16, to Tinv | P stage c % 2); in the first split pass also both
        to the workspace."""
        if cutlass.const_expr(not self.intra_idle):
            self.make_intra(p, smem, gs, rings, seq, atid, awarp)

    @cute.jit
    def make_intra(self, p, smem, gs, rings, seq, atid, awarp):
        f32 = cutlass.Float32
        C = self.C
        c = p.common
        save = self.cfg.intra == "save"
        thr_ss = c.mma_ss.get_slice(atid)
        cSS = thr_ss.partition_C(cute.make_identity_tensor((C, C)))
        # P leaves the accumulator by stmatrix (row addresses per 8 x 8 matrix, not one swizzled address each)
        st_p = cute.make_tiled_copy_C(
            cute.make_copy_atom(warp_ops.StMatrix8x8x16bOp(transpose=False, num_matrices=4), cutlass.BFloat16), c.mma_ss
        )
        thr_stp = st_p.get_slice(atid)
        tWs, tWg = tiles.tma_chunk_tiles(
            c.w.atom, c.w.tensor[None, None, seq.hv, seq.n], 0, cute.group_modes(smem.sTP, 2, 4)
        )
        # Tinv's blocks above the diagonal stay zero (ordered for the state role by the first fence.proxy.async)
        for ts in cutlass.range_constexpr(self.tp_stages):
            solve.solve_clear(smem.sTP[None, None, 0, ts], atid, 128)
        qk_c = pipeline.consumer_start(self.qk_stages)
        gate_c = pipeline.consumer_start(self.qk_stages)
        tp_p = pipeline.producer_start(self.tp_stages)
        tp_seen = pipeline.consumer_start(self.tp_stages)
        for chunk in cutlass.range(seq.n_chunks, unroll=1):
            s = qk_c.index
            ts = tp_p.index
            L = cutlass.min(seq.seqlen - self.chunk_position(chunk, seq) * C, C)
            sT = smem.sTP[None, None, 0, ts]
            sP = smem.sTP[None, None, 1, ts]
            tSSa = thr_ss.make_fragment_A(thr_ss.partition_A(smem.sQK[None, None, None, s]))
            tSSb = thr_ss.make_fragment_B(thr_ss.partition_B(smem.sQK[None, None, 1, s]))
            acc_x = thr_ss.make_fragment_C(thr_ss.partition_shape_C((C, C)))
            # (no mbarrier wait between a wgmma's issue and its wait: ptxas then waits for it at the branch)
            rings.qk.consumer_wait(qk_c)
            rings.gate.consumer_wait(gate_c)
            if cutlass.const_expr(self.cfg.delta_rule):
                warpgroup.fence()
                mma.gemm(c.mma_ss, acc_x, tSSa[None, None, None, 1], tSSb, True)
                warpgroup.commit_group()
                g_r, b_r, g_c = self.slot_gates(gs, cSS, s, False)
                # a row's last unmasked column: the masks then depend on the chunk, and ptxas does not hoist 64
                # per-element predicates out of the loop (they spilled); rows past the end get none of A and all the
                # columns before the end of P (harmless: their outputs are not stored, V_new is zero there)
                lim_a = cute.make_rmem_tensor(cute.make_layout(2), cutlass.Int32)
                for rr in cutlass.range_constexpr(2):
                    r, _ = cSS[2 * rr]
                    lim_a[rr] = r if r < L else 0
                warpgroup.wait_group(0)
            if cutlass.const_expr(save):
                if awarp == 0:
                    # this Tinv | P stage's last save (chunk c - 2) has read it before the barrier below
                    cute.arch.cp_async_bulk_wait_group(1, read=True)
            if cutlass.const_expr(self.cfg.delta_rule or save):
                # the previous chunk's merge has read sA (and the stage's last save has read it)
                cute.arch.barrier(barrier_id=Barrier.INTRA, number_of_threads=128)
            if cutlass.const_expr(self.cfg.delta_rule):
                for i in cutlass.range_constexpr(cute.size(acc_x)):
                    ra, ja = cSS[i]
                    rr, kc = mma.acc_row_slot(i), mma.acc_col_slot(i)
                    va = f32(0.0)
                    if ja < lim_a[rr]:
                        va = acc_x[i] * b_r[rr] * cute.math.exp2(g_r[rr] - g_c[kc], fastmath=True)
                    smem.sA[ja, ra] = va  # transposed: the solver walks A column by column
            mma.gemm_waited(c.mma_ss, acc_x, tSSa[None, None, None, 0], tSSb, True)
            rings.tp.producer_acquire(tp_p)
            # the gates read again: held across Q K^T they push loop invariants of the solve out to local memory
            g_r, _, g_c = self.slot_gates(gs, cSS, s, True)
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
                    vp = acc_x[i] * c.scale * cute.math.exp2(g_r[rr] - g_c[kc], fastmath=True)
                p_frag[i] = vp.to(cutlass.BFloat16)
            cute.copy(st_p, thr_stp.retile(p_frag), thr_stp.partition_D(sP))
            # q | k tiles and the gate slot read
            rings.qk.consumer_release(qk_c)
            rings.gate.consumer_release(gate_c)
            qk_c.advance()
            gate_c.advance()
            if cutlass.const_expr(self.cfg.delta_rule):
                cute.arch.barrier(barrier_id=Barrier.INTRA, number_of_threads=128)
                solve.solve_diag16_per_warp(smem.sA, atid)
                cute.arch.barrier(barrier_id=Barrier.INTRA, number_of_threads=128)
                solve.solve_merge_to_bf16(smem.sA, sT, atid, Barrier.INTRA)
            # P and Tinv are read by the state warpgroups' wgmma (async proxy)
            cute.arch.fence_proxy("async.shared", space="cta")
            rings.tp.producer_commit(tp_p)
            tp_p.advance()
            if cutlass.const_expr(save):
                if awarp == 0:
                    # every intra thread has fenced its part (the stage is full), then one TMA store group
                    rings.tp.consumer_wait(tp_seen)
                    workspace.save_tinv_p(c.w.atom, tWs, tWg, chunk, ts)
            tp_seen.advance()
        if cutlass.const_expr(save):
            if awarp == 0:
                cute.arch.cp_async_bulk_wait_group(0, read=True)

    @cute.jit
    def slot_gates(self, gs, cSS, s, for_p: cutlass.Constexpr):
        """The intra role's gates of slot ``s`` at its accumulator rows and columns (A's, or P's with ``for_p``):
        :func:`cula.sm90.scalar_gates.row_col_gates`; with qk_l2norm the norms are folded in (``publish_norm_gates``):
        row gates G (A) or G - log2 ||q|| (P), row factors beta / ||k||, column gates G + log2 ||k||."""
        if cutlass.const_expr(not self.cfg.qk_l2norm):
            return scalar_gates.row_col_gates(gs.sG, gs.sBeta, None, cSS, s, False)
        row_g = gs.sNorm[None, None, 0] if for_p else gs.sG
        return scalar_gates.gates_at(cSS, row_g, gs.sNorm[None, None, 2], gs.sNorm[None, None, 3], s)

    def state_ring_states(self):
        return StateRings(pipeline.consumer_start(self.qk_stages), pipeline.consumer_start(self.qk_stages))

    @cute.jit
    def chain_inputs(self, p, smem, gs, rings, states, seq, chunk):
        # every wait before the wgmmas are issued (a wait's branch between a wgmma's issue and its wait makes ptxas
        # wait for the wgmma there)
        rings.qk.consumer_wait(states.qk)
        rings.gate.consumer_wait(states.gate)
        s = states.qk.index
        gates = ScalarChainGates(gs, s, p.common.scale, 2 if self.cfg.qk_l2norm else 0)
        if cutlass.const_expr(self.cfg.reverse):
            gates = ScalarChainGates(gs, s, p.common.scale, 0, 0, p.common.scale)
        return ChainInputs(
            smem.sQK[None, None, 1, s], smem.sQK[None, None, 0, s], smem.sK_mn[None, None, s], gates,
            smem.sQ_mn[None, None, s],
        )  # fmt: skip

    @cute.jit
    def chain_release(self, rings, states):
        rings.qk.consumer_release(states.qk)
        rings.gate.consumer_release(states.gate)
        states.qk.advance()
        states.gate.advance()
        return states


# -------------------------------------------------------------------- host side
def compile_fwd(
    arch="sm_90a", *, beta_fp32=True, state_v_first=False, keep_artifacts=False, kernel_class=None, **config
):  # fmt: skip
    """The scalar-gate chunk kernel for ``config`` (:class:`cula.sm90.chunk_fwd.ChunkFwdConfig` fields: GDN's with
    the delta rule, simple GLA's without), compiled on any machine for ``arch``; ``kernel_class``: another
    architecture's kernel of the same launch arguments (SM100's)."""
    cfg = ChunkFwdConfig(**config)
    fake = entry.fake_args(
        cfg.head_dim, beta_fp32, state_v_first, per_key_gate=False, checkpoints=cfg.walk != "output", config=cfg
    )
    return runtime.compile_kernel((kernel_class or ScalarGateChunkFwdSm90)(cfg), fake, arch, keep_artifacts)
