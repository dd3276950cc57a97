"""Passes 3 and 4 of the delta rule's backward for a scalar gate (GDN; :func:`cula.ops.chunk_backward.scalar_delta_rows`)
on SM90: one CTA per (chunk, value head) recomputes the chunk's WY form from its tokens and its start checkpoint and
makes dq, dk, dv, dbeta and the gate's gradient.

Per chunk (C = 64 tokens; G the cumulative log2 gate, E = 2^G, F = 2^(G_L - G); Gamma_ij = 2^(G_i - G_j) for
j <= i and Gamma^a for j < i, zero elsewhere by a select; T = (I + A)^-1 with A = diag(beta) (K K^T . Gamma^a); S^T
and dS'^T the checkpoints, stored (V, K); V' the chunk's V_new), in six stages, each closed by a CTA barrier:

    1. wg 0: A, T (the forward's solve)   wg 1: dV' = F (K dS') + P^T dO
    2. wg 0: T^T kept; W = T diag(beta) (E K), U = T diag(beta) V (T's columns scaled in place), V' = U - W S
       wg 2: dW = -dV' S^T
    3. wg 1: dK = F (V' dS'^T) + (dP . Gamma)^T Q
       wg 2: dQ = scale E (dO S^T) + (dP . Gamma) K, dP = scale dO V'^T
    4. wg 0: dT = (dW K^T) diag(beta E) + (dV' V^T) diag(beta)   wg 1: d_bk = T^T dW, kept as beta E d_bk
       wg 2: d_bv = T^T dV', dV = beta d_bv
    5. wg 0: X = dT T^T, dA = -(T^T X) (strict lower), dA_b = beta dA . Gamma^a, both ways round, to shared memory
    6. wg 1: dK += beta E d_bk + dA_b K + dA_b^T K; then warp 0: dbeta and dg (a suffix scan of the row sums)

Every product is a wgmma with both operands in shared memory but the masked scores' (bf16 registers); the beta and
gate factors scale T's columns and the (C x C) products' columns, so they need no tiles of their own. dT lives in
q's tile once stage 3 has read it, X in v's once stage 4 has, dW in the solve's A^T: 214 KB of shared memory at
D = 128.

Shapes: q, k [B, T, H, D], v, do [B, T, HV, D] bf16 (GVA: value head hv reads q / k head hv // (HV / H)); g, beta
[B, T, HV] fp32 (natural-log gate, activated beta); the checkpoints [rows, HV, D, D] bf16 (S^T); ``chunks`` [rows,
2] int32 (each row's first token in the flattened (B T) axis and its valid tokens; 0: no chunk); dq, dk [B, T, HV, D],
dv [B, T, HV, D], dbeta, dg [B, T, HV], all fp32 (dq and dk per value head: the host sums each GVA group).
"""

from __future__ import annotations

from typing import NamedTuple

import cutlass
import cutlass.cute as cute

from cula.sm90 import mma, pipeline, scalar_chunk_bwd, scalar_gates, solve, tiles
from cula.sm90.chunk_fwd import A_STRIDE
from cula.sm90.scalar_chunk_bwd import Params, ScalarGateChunkBwdSm90, Tensors

WARPGROUPS = 3
STAGE_BARRIER = 1  # the CTA's stage hand-offs (named barrier, all threads)
WY_BARRIER = 2  # warpgroup 0's own steps
# sRows columns: per token, the row sums the last stage adds up
Q_DQ, K_DK, K_DK_END, K_DBK, V_DBV, DA_KK, PAIR_ROW, PAIR_COL = range(8)


def fake_args(head_dim: int, per_key_gate: bool) -> tuple:
    """The arguments of :meth:`DeltaChunkBwdSm90.__call__` as fake tensors of symbolic sizes, for a compile on any
    machine; with ``per_key_gate`` those of KDA's kernel (:mod:`cula.sm90.key_delta_chunk_bwd`): g and dg carry a
    key mode, and dq, dk, dbeta and dg a row per slab and batch row instead of per batch row."""
    from cula import runtime

    sym, fake = runtime.sym_int, runtime.fake_tensor
    B, T, H, HV, rows = sym(), sym(), sym(), sym(), sym()
    parts = sym() if per_key_gate else B
    D = head_dim
    bf16, f32 = cutlass.BFloat16, cutlass.Float32

    def gate(rows_):
        return fake(f32, (rows_, T, HV, D)) if per_key_gate else fake(f32, (rows_, T, HV), align=4)

    return (
        fake(bf16, (B, T, H, D)), fake(bf16, (B, T, H, D)), fake(bf16, (B, T, HV, D)), fake(bf16, (B, T, HV, D)),
        gate(B), fake(f32, (B, T, HV), align=4),
        fake(bf16, (rows, HV, D, D)), fake(bf16, (rows, HV, D, D)), fake(cutlass.Int32, (rows, 2), align=4),
        fake(f32, (parts, T, HV, D)), fake(f32, (parts, T, HV, D)), fake(f32, (B, T, HV, D)),
        fake(f32, (parts, T, HV), align=4), gate(parts), f32(1.0), runtime.fake_stream(),
    )  # fmt: skip


class DeltaParams(NamedTuple):
    """What the delta rule's kernel takes beyond the scalar-gate kernel's :class:`Params`: beta and its gradient
    [B, T, HV] fp32, and the (C x C) tiles' layouts."""

    beta: cute.Tensor
    dbeta: cute.Tensor
    tile_cc: object
    tile_cc_mn: object


class Smem(NamedTuple):
    """The CTA's shared tiles: the loaded tokens and checkpoints, the chunk's made tiles (W, dW, V', dV'), T and T^T,
    A^T (fp32, the solve's; then dW in its bytes; then the pair terms of dA), dT and X (in q's and v's bytes), and
    the per-token values."""

    q: cute.Tensor
    k: cute.Tensor
    v: cute.Tensor
    do: cute.Tensor
    s: cute.Tensor
    ds: cute.Tensor
    w: cute.Tensor
    dw: cute.Tensor
    vn: cute.Tensor
    dvn: cute.Tensor
    at: cute.Tensor
    t: cute.Tensor
    tt: cute.Tensor
    x1: cute.Tensor
    x2: cute.Tensor
    g: cute.Tensor
    beta: cute.Tensor
    fac: cute.Tensor
    rows: cute.Tensor
    warps: cute.Tensor


class DeltaChunkBwdSm90(ScalarGateChunkBwdSm90):
    """The kernel (module docstring); the token and score helpers are the scalar-gate kernel's."""

    @classmethod
    def fake_args(cls, head_dim: int) -> tuple:
        """The kernel's arguments as fake tensors, for a compile on any machine (:func:`fake_args`)."""
        return fake_args(head_dim, cls.per_key_gate)

    def __init__(self, head_dim: int, is_varlen: bool, tile_copies: bool = True):
        super().__init__(head_dim, is_varlen, tile_copies)
        self.threads = 128 * WARPGROUPS

    # ---------------------------------------------------------------- host side
    @cute.jit
    def __call__(
        self, q, k, v, do, g, beta, states, state_grads, chunks, dq, dk, dv, dbeta, dg, scale, stream
    ):  # fmt: skip
        C = self.C
        t = Tensors(q, k, v, do, g, states, state_grads, chunks, dq, dk, dv, dg)
        loads, tile_tok, tile_tok_mn, tile_state, tile_state_mn = self.chunk_loads(q, k, v, do, states, state_grads)
        tile_cc, tile_cc_mn = tiles.token_tiles(C, C)
        delta = DeltaParams(beta, dbeta, tile_cc, tile_cc_mn)
        p = Params(loads, t, scale, tile_tok, tile_tok_mn, tile_state, tile_state_mn, delta)
        tile = cute.struct.Align[cute.struct.MemRange[cutlass.BFloat16, cute.cosize(tile_cc)], 1024]
        fields = {
            **self.shared_fields(tile_tok, tile_state, ("sQ", "sK", "sV", "sDO", "sW", "sVN", "sDVN"), 8),
            "sT": tile,
            "sTt": tile,
            # A^T for the solve, then dW (bf16, stages 2-4), then the pair terms of dA (fp32)
            "sAt": cute.struct.Align[cute.struct.MemRange[cutlass.Float32, C * A_STRIDE], 1024],
        }
        self.launch_with(p, fields, chunks.shape[0], v.shape[2], stream)

    # ---------------------------------------------------------------- device side
    @cute.kernel
    def kernel(self, p: Params):
        C, D = self.C, self.D
        t = p.t
        tidx, row, hv, warp, lane, valid, b, t0 = self.coordinates(t)
        h = hv // (t.v.shape[2] // t.q.shape[2])

        st = cutlass.memory.SmemAllocator().allocate(self.storage)

        def cc(field):
            return field.get_tensor(p.own.tile_cc.outer, swizzle=p.own.tile_cc.inner)

        sQ, sK, sV, sDO, sS, sDS = self.loaded_tiles(st, p)
        sW, sVN, sDVN = (self.token_tile(p, field) for field in (st.sW, st.sVN, st.sDVN))
        q_tile, v_tile = sQ[None, None, 0], sV[None, None, 0]
        # dT (then dA_b) takes q's bytes once stage 3 has read q, X (then dA_b^T) v's once stage 4 has read v: a
        # (C x C) tile fits a token tile at D = 64 too
        sX1 = cute.make_tensor(cute.recast_ptr(q_tile.iterator, p.own.tile_cc.inner), p.own.tile_cc.outer)
        sX2 = cute.make_tensor(cute.recast_ptr(v_tile.iterator, p.own.tile_cc.inner), p.own.tile_cc.outer)
        sAt = st.sAt.get_tensor(cute.make_layout((C, A_STRIDE), stride=(A_STRIDE, 1)))
        sDW = cute.make_tensor(
            cute.recast_ptr(sAt.iterator, p.tile_tok.inner, dtype=cutlass.BFloat16), p.tile_tok.outer
        )[None, None, 0]
        sm = Smem(
            q_tile, sK[None, None, 0], v_tile, sDO[None, None, 0], sS[None, None, 0], sDS[None, None, 0],
            sW[None, None, 0], sDW, sVN[None, None, 0], sDVN[None, None, 0], sAt, cc(st.sT),
            cc(st.sTt),
            sX1, sX2, st.sG.get_tensor(cute.make_layout((C, 1))), st.sBeta.get_tensor(cute.make_layout((C, 1))),
            st.sFac.get_tensor(cute.make_layout((C, 1, 2))), st.sRows.get_tensor(cute.make_layout((C, 8))),
            st.sWarps.get_tensor(cute.make_layout(4 * WARPGROUPS)),
        )  # fmt: skip
        loads = pipeline.tma_ring(st.ring, 1, 4 * C * D * 2 + 2 * D * D * 2, 4 * WARPGROUPS)
        pipeline.rings_made()

        if valid > 0:
            if warp == 0:
                self.issue_loads(p, loads, sQ, sK, sV, sDO, sS, sDS, b, t0, h, hv, row)
                raw = scalar_gates.load_gates(t.g[b, None, hv], p.own.beta[b, None, hv], t0, valid, 0, lane, C)
                scalar_gates.publish_gates(sm.g, sm.beta, sm.fac, 0, raw, 0, valid, lane, C)
            if cutlass.const_expr(self.tile_copies):
                if warp // 4 == 1:  # a quarter of the stores per thread (the unrolled clear is code every CTA fetches)
                    solve.solve_clear(sm.t, tidx % 128, 128)
            elif warp == 4:
                solve.solve_clear(sm.t, lane, 32)
            loaded = pipeline.consumer_start(1)
            loads.consumer_wait(loaded)
            if cutlass.const_expr(self.is_varlen):
                # rows past the chunk's end hold the next sequence's tokens: zeroed before any product reads them
                if valid < C:
                    for tile_ in (sQ, sK, sV, sDO):
                        tiles.zero_rows_from(tile_[None, None, 0], valid, tidx, self.threads)
            cute.arch.fence_proxy("async.shared", space="cta")
            cute.arch.sync_threads()  # the gates, T's zeros and the zeroed rows
            wg = warp // 4
            wtid = tidx % 128
            if wg == 0:
                self.wy_role(p, sm, valid, wtid)
            elif wg == 1:
                self.dk_role(p, sm, valid, wtid, b, t0, hv)
            else:
                self.dq_dv_role(p, sm, valid, wtid, b, t0, hv)
            self.state_product(sS, sDS, sm.warps, tidx, warp, lane)
            cute.arch.sync_threads()
            if warp == 0:
                self.beta_and_gate_gradients(p, sm, valid, lane, b, t0, hv)

    # ---------------------------------------------------------------- shared steps
    @cute.jit
    def stage_done(self):
        """The end of a stage: this thread's shared-memory writes made visible to wgmma, then all warpgroups meet."""
        cute.arch.fence_proxy("async.shared", space="cta")
        cute.arch.barrier(barrier_id=STAGE_BARRIER, number_of_threads=self.threads)

    @cute.jit
    def wy_step(self):
        """Warpgroup 0 between two of its own steps within a stage."""
        cute.arch.fence_proxy("async.shared", space="cta")
        cute.arch.barrier(barrier_id=WY_BARRIER, number_of_threads=128)

    @cute.jit
    def cc_product(self, sA, sB_view, wtid):
        """A B for (C x C) operands in shared memory, B read MN-major (``sB_view`` (N, K)): an fp32 (C x C)
        accumulator and its coordinates."""
        return self.product(
            mma.tiled_mma(self.C, self.C, b_major="MN", a_in_registers=False), sA, sB_view, wtid, self.C
        )

    @cute.jit
    def to_tile(self, acc, coords, sX, factor: cutlass.Constexpr, wtid):
        """The accumulator times ``factor`` (a constant) to the bf16 tile ``sX``, element by element (by stmatrix
        with ``tile_copies``)."""
        if cutlass.const_expr(self.tile_copies):
            self.store_tile(acc, sX, factor, wtid)
        else:
            for e in cutlass.range_constexpr(cute.size(acc)):
                r, c = coords[e]
                sX[r, c] = (acc[e] * factor).to(cutlass.BFloat16)

    @cute.jit
    def add_rows(self, acc, cTD, mX, valid, b, t0, h, col0=0):
        """``mX[b, t0 + i, h, col0:] +=`` the (C x N) accumulator's rows before ``valid``. Each of the thread's two
        rows loads all its old values before its stores (loaded between stores to the same tensor, they made one
        dependent global round trip each), from a row clamped into the chunk, so that they issue at once."""
        n_cols = cute.size(acc) // 2
        old = cute.make_rmem_tensor(cute.make_layout(n_cols), cutlass.Float32)
        for rr in cutlass.range_constexpr(2):  # the thread's two rows: one row address and one predicate each
            r, _ = cTD[mma.acc_col_element(0, rr)]
            row = mX[b, t0 + cutlass.min(r, valid - 1), h, None]
            for kc in cutlass.range_constexpr(n_cols):
                _, d = cTD[mma.acc_col_element(kc, rr)]
                old[kc] = row[col0 + d]
            if r < valid:
                for kc in cutlass.range_constexpr(n_cols):
                    e = mma.acc_col_element(kc, rr)
                    _, d = cTD[e]
                    row[col0 + d] = old[kc] + acc[e]

    # ---------------------------------------------------------------- warpgroup 0: the WY form and its gradients
    @cute.jit
    def wy_role(self, p, sm, valid, wtid):
        C = self.C
        f32 = cutlass.Float32
        # stage 1: A (strict lower, fp32, transposed for the solve), then T
        acc_kk, cCC = self.scores(sm.k, sm.k, wtid)
        g_r, b_r, g_c = scalar_gates.gates_at(cCC, sm.g, sm.beta, sm.g, 0)
        for e in cutlass.range_constexpr(cute.size(acc_kk)):
            r, c = cCC[e]
            rr, kc = mma.acc_row_slot(e), mma.acc_col_slot(e)
            a = f32(0.0)
            if c < r and r < valid:
                a = acc_kk[e] * b_r[rr] * cute.math.exp2(g_r[rr] - g_c[kc], fastmath=True)
            sm.at[c, r] = a
        self.wy_step()
        solve.solve_diag16_per_warp(sm.at, wtid)
        self.wy_step()
        solve.solve_merge_to_bf16(sm.at, sm.t, wtid, WY_BARRIER)
        self.stage_done()  # 1
        # stage 2: T^T kept and T's columns scaled by beta in one pass; W = T diag(beta) (2^G K), U = T diag(beta) V,
        # V' = U - W S
        for idx in cutlass.range(wtid, C * C, 128, unroll=4):
            r, c = idx // C, idx % C
            x = sm.t[r, c]
            sm.tt[c, r] = x
            sm.t[r, c] = (x.to(f32) * sm.beta[c, 0]).to(cutlass.BFloat16)
        for idx in cutlass.range(wtid, C * self.D, 128, unroll=4):
            r, d = idx // self.D, idx % self.D
            sm.w[r, d] = (sm.k[r, d].to(f32) * sm.fac[r, 0, 0]).to(cutlass.BFloat16)
        self.wy_step()
        acc_w, cTD = self.inter("MN", sm.t, tiles.mn_plane(sm.w, p.tile_tok_mn), wtid)
        self.wy_step()  # every thread's wgmma has read 2^G K before W overwrites it
        self.to_tile(acc_w, cTD, sm.w, -1.0, wtid)
        self.wy_step()
        acc_u, _ = self.inter("MN", sm.t, tiles.mn_plane(sm.v, p.tile_tok_mn), wtid)
        self.accumulate("K", acc_u, sm.w, sm.s, wtid)
        self.to_tile(acc_u, cTD, sm.vn, 1.0, wtid)
        self.stage_done()  # 2
        self.stage_done()  # 3
        # stage 4: dT = (dW K^T) diag(beta 2^G) + (dV' V^T) diag(beta), to X1 (q's bytes)
        acc_a, cCC = self.scores(sm.dw, sm.k, wtid)
        acc_b, _ = self.scores(sm.dvn, sm.v, wtid)
        if cutlass.const_expr(self.tile_copies):
            dt = cute.make_rmem_tensor(acc_a.layout, cutlass.BFloat16)
            for e in cutlass.range_constexpr(cute.size(acc_a)):
                _, c = cCC[e]
                dt[e] = (sm.beta[c, 0] * (acc_a[e] * sm.fac[c, 0, 0] + acc_b[e])).to(cutlass.BFloat16)
            self.store_fragment(dt, sm.x1, wtid, False)
        else:
            for e in cutlass.range_constexpr(cute.size(acc_a)):
                r, c = cCC[e]
                sm.x1[r, c] = (sm.beta[c, 0] * (acc_a[e] * sm.fac[c, 0, 0] + acc_b[e])).to(cutlass.BFloat16)
        self.stage_done()  # 4
        # stage 5: X = dT T^T (to X2), dA = -(T^T X), the pair terms
        acc_x, cCC = self.cc_product(sm.x1, tiles.mn_plane(sm.tt, p.own.tile_cc_mn), wtid)
        self.to_tile(acc_x, cCC, sm.x2, 1.0, wtid)
        self.wy_step()
        acc_da, cCC = self.cc_product(sm.tt, tiles.mn_plane(sm.x2, p.own.tile_cc_mn), wtid)
        acc_kk, _ = self.scores(sm.k, sm.k, wtid)
        self.wy_step()  # every thread's X read before dA_b overwrites X2
        g_r, b_r, g_c = scalar_gates.gates_at(cCC, sm.g, sm.beta, sm.g, 0)
        da_kk = cute.make_rmem_tensor(cute.make_layout(2), f32)
        pair = cute.make_rmem_tensor(cute.make_layout(2), f32)
        da_kk.fill(0.0)
        pair.fill(0.0)
        if cutlass.const_expr(self.tile_copies):
            dab_frag = cute.make_rmem_tensor(acc_da.layout, cutlass.BFloat16)
        for e in cutlass.range_constexpr(cute.size(acc_da)):
            r, c = cCC[e]
            rr, kc = mma.acc_row_slot(e), mma.acc_col_slot(e)
            da_gated = f32(0.0)
            if c < r:
                da_gated = -acc_da[e] * cute.math.exp2(g_r[rr] - g_c[kc], fastmath=True)
            x = da_gated * acc_kk[e]
            da_kk[rr] = da_kk[rr] + x
            pair[rr] = pair[rr] + b_r[rr] * x
            dab = (b_r[rr] * da_gated).to(cutlass.BFloat16)
            if cutlass.const_expr(self.tile_copies):
                dab_frag[e] = dab
            else:
                sm.x1[r, c] = dab
                sm.x2[c, r] = dab
            sm.at[r, c] = b_r[rr] * x
        if cutlass.const_expr(self.tile_copies):
            self.store_fragment(dab_frag, sm.x1, wtid, False)
            self.store_fragment(dab_frag, scalar_chunk_bwd.transposed(sm.x2), wtid, True)
        self.quad_sums(da_kk, cCC, sm.rows, DA_KK, wtid)
        self.quad_sums(pair, cCC, sm.rows, PAIR_ROW, wtid)
        self.stage_done()  # 5
        # stage 6: the pair terms' column sums
        if wtid < C:
            col = f32(0.0)
            for r in cutlass.range(C, unroll=4):
                col = col + sm.at[r, wtid]
            sm.rows[wtid, PAIR_COL] = col
        self.stage_done()  # 6

    # ---------------------------------------------------------------- warpgroup 1: dV', then dk
    @cute.jit
    def dk_role(self, p, sm, valid, wtid, b, t0, hv):
        f32 = cutlass.Float32
        # stage 1: dV' = F (K dS') + P^T dO
        acc_pt, cCC = self.scores(sm.k, sm.q, wtid)
        r_pt = self.masked_scores(acc_pt, cCC, sm.g, valid, True, p.scale)
        acc, cTD = self.inter("K", sm.k, sm.ds, wtid)
        self.scale_rows(acc, cTD, sm.fac, 1, f32(1.0))
        self.add_intra(acc, r_pt, tiles.mn_plane(sm.do, p.tile_tok_mn), wtid)
        self.to_tile(acc, cTD, sm.dvn, 1.0, wtid)
        self.stage_done()  # 1
        self.stage_done()  # 2
        # stage 3: dK = F (V' dS'^T) + (dP . Gamma)^T Q
        acc_dpt, cCC = self.scores(sm.vn, sm.do, wtid)
        r_dpt = self.masked_scores(acc_dpt, cCC, sm.g, valid, True, p.scale)
        acc_dk, cTD = self.inter("MN", sm.vn, tiles.mn_plane(sm.ds, p.tile_state_mn), wtid)
        self.scale_rows(acc_dk, cTD, sm.fac, 1, f32(1.0))
        self.row_dot(acc_dk, cTD, sm.k, sm.rows, K_DK_END, wtid)
        self.add_intra(acc_dk, r_dpt, tiles.mn_plane(sm.q, p.tile_tok_mn), wtid)
        self.row_dot(acc_dk, cTD, sm.k, sm.rows, K_DK, wtid)
        # dk goes out now and takes its later terms in place (each thread its own elements): no accumulator is held
        # across the stages
        self.store_rows(acc_dk, cTD, p.t.dk, valid, b, t0, hv)
        self.stage_done()  # 3
        # stage 4: d_bk = T^T dW, kept as beta 2^G d_bk in the accumulator stage 6 adds to (one read-modify-write
        # of dk instead of two)
        acc_dbk, cTD = self.inter("MN", sm.tt, tiles.mn_plane(sm.dw, p.tile_tok_mn), wtid)
        self.row_dot(acc_dbk, cTD, sm.k, sm.rows, K_DBK, wtid)
        for e in cutlass.range_constexpr(cute.size(acc_dbk)):
            r, _ = cTD[e]
            acc_dbk[e] = acc_dbk[e] * sm.fac[r, 0, 0] * sm.beta[r, 0]
        self.stage_done()  # 4
        self.stage_done()  # 5
        # stage 6: dK += beta 2^G d_bk + dA_b K + dA_b^T K (the first term held in registers since stage 4)
        self.accumulate("MN", acc_dbk, sm.x1, tiles.mn_plane(sm.k, p.tile_tok_mn), wtid)
        self.accumulate("MN", acc_dbk, sm.x2, tiles.mn_plane(sm.k, p.tile_tok_mn), wtid)
        self.add_rows(acc_dbk, cTD, p.t.dk, valid, b, t0, hv)
        self.stage_done()  # 6

    # ---------------------------------------------------------------- warpgroup 2: dq, then dv
    @cute.jit
    def dq_dv_role(self, p, sm, valid, wtid, b, t0, hv):
        self.stage_done()  # 1
        # stage 2: -dW = dV' S^T, kept as dW
        acc_dw, cTD = self.inter("MN", sm.dvn, tiles.mn_plane(sm.s, p.tile_state_mn), wtid)
        self.to_tile(acc_dw, cTD, sm.dw, -1.0, wtid)
        self.stage_done()  # 2
        # stage 3: dQ = scale 2^G (dO S^T) + (dP . Gamma) K, dP = scale dO V'^T
        acc_dp, cCC = self.scores(sm.do, sm.vn, wtid)
        r_dp = self.masked_scores(acc_dp, cCC, sm.g, valid, False, p.scale)
        acc_dq, cTD = self.inter("MN", sm.do, tiles.mn_plane(sm.s, p.tile_state_mn), wtid)
        self.scale_rows(acc_dq, cTD, sm.fac, 0, p.scale)
        self.add_intra(acc_dq, r_dp, tiles.mn_plane(sm.k, p.tile_tok_mn), wtid)
        self.row_dot(acc_dq, cTD, sm.q, sm.rows, Q_DQ, wtid)
        self.store_rows(acc_dq, cTD, p.t.dq, valid, b, t0, hv)
        self.stage_done()  # 3
        # stage 4: d_bv = T^T dV', dV = beta d_bv
        acc_dbv, cTD = self.inter("MN", sm.tt, tiles.mn_plane(sm.dvn, p.tile_tok_mn), wtid)
        self.row_dot(acc_dbv, cTD, sm.v, sm.rows, V_DBV, wtid)
        for e in cutlass.range_constexpr(cute.size(acc_dbv)):
            r, _ = cTD[e]
            acc_dbv[e] = acc_dbv[e] * sm.beta[r, 0]
        self.store_rows(acc_dbv, cTD, p.t.dv, valid, b, t0, hv)
        self.stage_done()  # 4
        self.stage_done()  # 5
        self.stage_done()  # 6

    # ---------------------------------------------------------------- warp 0: dbeta and dg
    @cute.jit
    def beta_and_gate_gradients(self, p, sm, valid, lane, b, t0, hv):
        """Two tokens per lane. dbeta = sum_m dA Gamma^a kk + 2^G k . d_bk + v . d_bv; dg = the suffix sum of
        q . dq - k . dk + (pair row - pair column) + beta 2^G k . d_bk, plus the chunk's constant
        sum_j k_j . dk_j^end + 2^G_L sum (S * dS')."""
        C = self.C
        f32 = cutlass.Float32
        rows = sm.rows
        local = cute.make_rmem_tensor(cute.make_layout(2), f32)
        end = f32(0.0)
        for half in cutlass.range_constexpr(2):
            i = lane + 32 * half
            k_dbk = rows[i, K_DBK] * sm.fac[i, 0, 0]
            local[half] = rows[i, Q_DQ] - rows[i, K_DK] + rows[i, PAIR_ROW] - rows[i, PAIR_COL] + sm.beta[i, 0] * k_dbk
            end = end + rows[i, K_DK_END]
            if i < valid:
                p.own.dbeta[b, t0 + i, hv] = rows[i, DA_KK] + k_dbk + rows[i, V_DBV]
        states = f32(0.0)
        for w in cutlass.range_constexpr(4 * WARPGROUPS):
            states = states + sm.warps[w]
        after_lo, after_hi = scalar_gates.warp_scan_64(local[0], local[1], lane, True)
        for i in cutlass.range_constexpr(5):
            end = end + cute.arch.shuffle_sync_bfly(end, 1 << i)
        constant = end + cute.math.exp2(sm.g[C - 1, 0], fastmath=True) * states
        if lane < valid:
            p.t.dg[b, t0 + lane, hv] = after_lo + constant
        if lane + 32 < valid:
            p.t.dg[b, t0 + lane + 32, hv] = after_hi + constant
