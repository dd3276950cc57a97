"""Passes 3 and 4 of the delta rule's backward for a per-key gate (KDA; :func:`cula.ops.chunk_backward.key_delta_rows`)
on SM90: one CTA per (chunk, value head, slab of 64 value columns) recomputes the chunk's WY form from its tokens
and the slab's columns of its start checkpoint, and makes the slab's part of dq, dk, dbeta and dg and its columns of
dv. Every gradient is linear in the value columns, so the slabs' parts sum to the chunk's (the host sums them, as it
sums each GVA group); a CTA of the whole D = 128 would need ~275 KB of shared memory, a slab's takes ~213 KB.

Per chunk (C = 64 tokens; G [C, K] the cumulative log2 gate per key, E = 2^G, F = 2^(G_L - G); two reference tokens
r_h = 16, 48, one per 32-token half h; S^T and dS'^T the slab's rows of the checkpoints (Vs, K)):

- the pair-factor sums sum_k x_ik y_jk 2^(G_ik - G_jk) go by bf16 operands against the references: R_j = k_j
  2^(G_r(j) - G_j) takes the reference of its own token's half, L^h_i = x_i 2^(G_i - G_rh) (zero before half h) the
  reference of half h. A score is (L^h R^T)_ij for j in half h (L^h built in registers); a gradient of the scores dM
  is one product per half, the half's factor applied to that product alone, selected where it applies:

      rows:     dX_i = sum_h 2^(G_i - G_rh) (dM[:, h] R_h)_i       (i in or after half h; contraction over half h)
      columns:  dK_j = 2^(G_rh - G_j) (dM^T L^h)_j                  (h the half of j; L^h built in ``left`` by blocks)

- the delta kernel's six stages (:mod:`cula.sm90.delta_chunk_bwd`), each closed by a CTA barrier:

    1. wg 0: A = beta (K K^T)_gated (strict lower), T   wg 2: P^T   wg 1: dV' = (F K) dS' + P^T dO
    2. wg 0: T^T; W = T diag(beta) (E K), V' = T diag(beta) V - W S   wg 2: dW = -dV' S^T
    3. wg 2: dq = scale E (dO S^T) + rows(dP)   wg 1: dk = F (V' dS'^T)   wg 0: E K again, dk += columns(dP^T)
    4. wg 0: dT = diag(beta) columns of (dW (E K)^T + dV' V^T)   wg 1: d_bk = T^T dW, dk += beta E d_bk
       wg 2: d_bv = T^T dV', dv = beta d_bv
    5. wg 0: X = dT T^T, dA = -(T^T X) (strict lower), dA_b = beta dA both ways round
    6. wg 1 and 2 (a block of 64 keys each): dk += rows(dA_b) + columns(dA_b^T)

- dbeta = sum_j dA (K K^T)_gated + sum_k E k d_bk + sum_v v d_bv per token; dg per key the suffix sum over the chunk of
  a local term plus sum_j k_j dk^end_j + 2^G_L sum_v S dS'. The local term is q dq^inter - k dk^end + beta E k d_bk
  plus, for each pair gradient, L^h (dM[:, h] R_h) from the rows side and -R (dM^T L^h) from the columns side: a pair
  (i, j) enters it through the same rounded L^h_i and R_j from both sides, so that the pairs inside a suffix cancel
  (through q dq - k dk, each side's own roundings, dg is off by 7-12 % on KDA's safe gates). Its parts are added into
  dg in global memory, in an order the barriers fix, and scanned at the end.

:func:`cula.ops.chunk_emulation.key_delta_slab_gradients` is this arithmetic in PyTorch, roundings included. Under
KDA's ``safe_gate`` (g >= -5) no operand passes 2^116, so there is no steep path.

Shapes: q, k [B, T, H, D], v, do [B, T, HV, D] bf16 (GVA: value head hv reads q / k head hv // (HV / H)); g [B, T,
HV, D] fp32 (activated, natural log); beta [B, T, HV] fp32; the checkpoints [rows, HV, D, D] bf16 (S^T); ``chunks``
[rows, 2] int32 (:class:`cula.sm90.scalar_chunk_bwd.ScalarGateChunkBwdSm90`); dv [B, T, HV, D] fp32; the slabs'
parts dq, dk, dg [slabs B, T, HV, D] and dbeta [slabs B, T, HV] fp32 (slab s of batch row b at row s B + b).
D = 64 or 128.
"""

from __future__ import annotations

import enum
import math
from typing import NamedTuple

import cutlass
import cutlass.cute as cute

from cula.sm90 import mma, pipeline, solve, tiles
from cula.sm90.chunk_fwd import A_STRIDE
from cula.sm90.delta_chunk_bwd import DeltaChunkBwdSm90
from cula.sm90.key_chunk_bwd import gate_pair, swizzled
from cula.sm90.scalar_chunk_bwd import Params, Tensors

WARPGROUPS = 3
SLAB = 64  # value columns per CTA
KEY_BLOCK = 64  # key columns per gradient accumulator of the score gradients (two live at once)
GATE_BATCH = 32  # raw gates loaded at once by gate_gradient: 64 spill at D = 128
# sRows columns: per token, the row sums dbeta adds up
DA_KK, K_DBK, V_DBV = range(3)
_LOG2E = math.log2(math.e)


class Barrier(enum.IntEnum):
    STAGE = 1  # all warpgroups: the end of a stage
    WY = 2  # warpgroup 0's own steps
    P_READY = 3  # warpgroups 1 and 2: P^T in shared memory
    DK_END = 4  # warpgroups 0 and 1: dk^end stored and taken from dg's local term, for warpgroup 0 to add to both
    LOCAL_Q = 5  # warpgroups 1 and 2: dg's local term from dq's side stored, for warpgroup 1 to add to
    OWN_1 = 6  # warpgroup 1's own steps (its L^h blocks)
    OWN_2 = 7  # warpgroup 2's own steps


class KeyDeltaParams(NamedTuple):
    """What this kernel takes beyond :class:`Params`: beta and its gradient, and the (C x C) and slab tiles'
    layouts (token tiles (C, Vs); checkpoint slabs are ``tile_state``, (Vs, K))."""

    beta: cute.Tensor
    dbeta: cute.Tensor
    tile_cc: object
    tile_cc_mn: object
    tile_slab: object
    tile_slab_mn: object


class Smem(NamedTuple):
    """The CTA's shared tiles. (C, K): q, k; w (P^T in stage 1, E K and -W in stage 2, E K from stage 3); r (R);
    left (F K in stage 1, then blocks of the L^h of q and of k). (C, Vs): v, do, vn (V'), dvn (dV'). (Vs, K): s,
    ds. (C, C): t, tt; x1 (dT, then dA_b) in do's bytes, x2 (X, then dA_b^T) in v's. at: A^T (fp32) for the solve,
    then dW (C, K) bf16, then in stage 5 the scores of A again (fp32). gates: G (C x K fp32 log2,
    :func:`swizzled`)."""

    q: cute.Tensor
    k: cute.Tensor
    v: cute.Tensor
    do: cute.Tensor
    s: cute.Tensor
    ds: cute.Tensor
    vn: cute.Tensor
    dvn: cute.Tensor
    w: cute.Tensor
    pt: cute.Tensor
    r: cute.Tensor
    left: cute.Tensor
    at: cute.Tensor
    dw: cute.Tensor
    t: cute.Tensor
    tt: cute.Tensor
    x1: cute.Tensor
    x2: cute.Tensor
    gates: cute.Tensor
    beta: cute.Tensor
    rows: cute.Tensor
    col_warps: cute.Tensor  # (4, K): sum_j (k * dk^end)_j per warp of warpgroup 1
    col_state: cute.Tensor  # (K,): 2^G_L sum_v (S * dS') over the slab


def _key_block(view, kb):
    """Keys ``KEY_BLOCK kb ..`` of an (K, n) MN-major view: its (KEY_BLOCK, n) part (a whole swizzle atom wide)."""
    return cute.local_tile(view, (KEY_BLOCK, cute.size(view, mode=[1])), (kb, 0))


class KeyDeltaChunkBwdSm90(DeltaChunkBwdSm90):
    """The kernel (module docstring); the token, score and solve helpers are the delta kernel's."""

    per_key_gate = True

    def __init__(self, head_dim: int, is_varlen: bool, tile_copies: bool = True):
        super().__init__(head_dim, is_varlen, tile_copies)
        self.slabs = head_dim // SLAB
        self.key_blocks = head_dim // KEY_BLOCK

    # ---------------------------------------------------------------- host side
    @cute.jit
    def __call__(
        self, q, k, v, do, g, beta, states, state_grads, chunks, dq, dk, dv, dbeta, dg, scale, stream
    ):  # fmt: skip
        C, K = self.C, self.D
        bf16, f32 = cutlass.BFloat16, cutlass.Float32
        t = Tensors(q, k, v, do, g, states, state_grads, chunks, dq, dk, dv, dg)
        loads, tile_tok, tile_tok_mn, tile_state, tile_state_mn, tile_slab, tile_slab_mn = self.chunk_loads(
            q, k, v, do, states, state_grads, SLAB
        )
        tile_cc, tile_cc_mn = tiles.token_tiles(C, C)
        own = KeyDeltaParams(beta, dbeta, tile_cc, tile_cc_mn, tile_slab, tile_slab_mn)
        p = Params(loads, t, scale, tile_tok, tile_tok_mn, tile_state, tile_state_mn, own)

        def tile(layout):
            return cute.struct.Align[cute.struct.MemRange[bf16, cute.cosize(layout)], 1024]

        fields = {
            "ring": pipeline.ring_storage(1),
            **{name: tile(tile_tok) for name in ("sQ", "sK", "sW", "sR", "sL")},
            **{name: tile(tile_slab) for name in ("sV", "sDO", "sVN", "sDVN")},
            "sS": tile(tile_state),
            "sDS": tile(tile_state),
            "sT": tile(tile_cc),
            "sTt": tile(tile_cc),
            "sAt": cute.struct.Align[cute.struct.MemRange[f32, C * A_STRIDE], 1024],
            "sGates": cute.struct.Align[cute.struct.MemRange[f32, C * K], 16],
            "sBeta": cute.struct.MemRange[f32, C],
            "sRows": cute.struct.MemRange[f32, 3 * C],
            "sColWarps": cute.struct.MemRange[f32, 4 * K],
            "sColState": cute.struct.MemRange[f32, K],
        }
        self.storage = cute.struct(type("Storage", (), {"__annotations__": fields}))
        self.kernel(p).launch(
            grid=(chunks.shape[0], v.shape[2], self.slabs),
            block=(self.threads, 1, 1),
            smem=self.storage.size_in_bytes(),
            stream=stream,
        )

    # ---------------------------------------------------------------- device side
    @cute.kernel
    def kernel(self, p: Params):
        C, K = self.C, self.D
        t, own = p.t, p.own
        bf16 = cutlass.BFloat16
        tidx, row, hv, warp, lane, valid, b, t0 = self.coordinates(t)
        _, _, slab = cute.arch.block_idx()
        h = hv // (t.v.shape[2] // t.q.shape[2])
        part = slab * t.q.shape[0] + b  # the slab's batch row of dq, dk, dbeta and dg

        st = cutlass.memory.SmemAllocator().allocate(self.storage)

        def staged(field, layout):
            return field.get_tensor(layout.outer, swizzle=layout.inner)

        def cc_over(plane):
            return cute.make_tensor(cute.recast_ptr(plane.iterator, own.tile_cc.inner), own.tile_cc.outer)

        sQ, sK, sW, sR, sL = (staged(f, p.tile_tok) for f in (st.sQ, st.sK, st.sW, st.sR, st.sL))
        sV, sDO, sVN, sDVN = (staged(f, own.tile_slab) for f in (st.sV, st.sDO, st.sVN, st.sDVN))
        sS, sDS = staged(st.sS, p.tile_state), staged(st.sDS, p.tile_state)
        sAt = st.sAt.get_tensor(cute.make_layout((C, A_STRIDE), stride=(A_STRIDE, 1)))
        sDW = cute.make_tensor(cute.recast_ptr(sAt.iterator, p.tile_tok.inner, dtype=bf16), p.tile_tok.outer)
        w_plane, do_plane, v_plane = sW[None, None, 0], sDO[None, None, 0], sV[None, None, 0]
        sm = Smem(
            sQ[None, None, 0], sK[None, None, 0], v_plane, do_plane, sS[None, None, 0], sDS[None, None, 0],
            sVN[None, None, 0], sDVN[None, None, 0], w_plane, cc_over(w_plane), sR[None, None, 0], sL[None, None, 0],
            sAt, sDW[None, None, 0], staged(st.sT, own.tile_cc), staged(st.sTt, own.tile_cc), cc_over(do_plane),
            cc_over(v_plane), st.sGates.get_tensor(cute.make_layout(C * K)), st.sBeta.get_tensor(cute.make_layout(C)),
            st.sRows.get_tensor(cute.make_layout((C, 3))),
            st.sColWarps.get_tensor(cute.make_layout((4, K), stride=(K, 1))), st.sColState.get_tensor(cute.make_layout(K)),
        )  # fmt: skip
        tx_bytes = (2 * C * K + 2 * C * SLAB + 2 * SLAB * K) * 2
        loads = pipeline.tma_ring(st.ring, 1, tx_bytes, 4 * WARPGROUPS)
        pipeline.rings_made()

        if valid > 0:
            if warp == 0:
                self.issue_loads(p, loads, sQ, sK, sV, sDO, sS, sDS, b, t0, h, hv, row, slab)
                for half in cutlass.range_constexpr(2):
                    i = lane + 32 * half
                    sm.beta[i] = own.beta[b, t0 + cutlass.min(i, valid - 1), hv] if i < valid else cutlass.Float32(0.0)
            if tidx < K:
                self.scan_gates(t, sm, valid, tidx, b, t0, hv)
            if warp == 4:
                solve.solve_clear(sm.t, lane, 32)
            self.await_tokens(loads, (sQ, sK, sV, sDO), valid, tidx)
            cute.arch.sync_threads()  # the gates, beta, T's zeros and the zeroed rows
            self.gated_keys(sm, tidx)
            cute.arch.fence_proxy("async.shared", space="cta")
            cute.arch.sync_threads()
            wg = warp // 4
            wtid = tidx % 128
            if wg == 0:
                self.wy_role(p, sm, valid, wtid, part, t0, hv)
            elif wg == 1:
                self.dk_role(p, sm, valid, wtid, warp % 4, part, t0, hv)
            else:
                self.dq_dv_role(p, sm, valid, wtid, b, part, t0, hv, slab)
            # stage 6: warpgroup 1 + kb on key block kb, through one copy of the code
            if wg > 0:
                kb = wg - 1
                if kb < self.key_blocks:
                    self.pair_terms(p, sm, kb, valid, wtid, part, t0, hv, Barrier.OWN_1 + kb)
            self.stage_done()  # 6
            cute.arch.sync_threads()  # dq, dk, dg's local term and the row sums written
            if warp == 0:
                for half in cutlass.range_constexpr(2):
                    i = lane + 32 * half
                    if i < valid:
                        own.dbeta[part, t0 + i, hv] = sm.rows[i, DA_KK] + sm.rows[i, K_DBK] + sm.rows[i, V_DBV]
            if tidx < K:
                self.gate_gradient(t, sm, valid, tidx, part, t0, hv)

    @cute.jit
    def scan_gates(self, t, sm, valid, key, b, t0, hv):
        """One key channel per thread: G, the inclusive sum of g log2(e) over the chunk (0 past its end; KDA's gate is
        >= -5, above the floor), to shared memory. The token index is clamped into the chunk, so that every load is
        issued before the sum needs it."""
        C, K = self.C, self.D
        f32 = cutlass.Float32
        raw = cute.make_rmem_tensor(cute.make_layout(C), f32)
        for r in cutlass.range_constexpr(C):
            raw[r] = t.g[b, t0 + cutlass.min(r, valid - 1), hv, key]
        run = f32(0.0)
        for r in cutlass.range_constexpr(C):
            x = raw[r] * f32(_LOG2E)
            if r >= valid:
                x = f32(0.0)
            run = run + x
            sm.gates[swizzled(r, key, K)] = run

    @cute.jit
    def gate(self, sm, r, key):
        """G (log2) of token ``r`` at ``key``."""
        return sm.gates[swizzled(r, key, self.D)]

    def block_fragment(self, like, sX, kb, wtid):
        """With ``tile_copies``, key block ``kb`` of the bf16 token tile ``sX`` by ldmatrix in the layout of the
        (C x KEY_BLOCK) accumulator ``like`` (element e at like's element e); else None (:meth:`tile_value` reads
        element by element)."""
        if not self.tile_copies:
            return None
        return self.tile_fragment(like, cute.local_tile(sX, (self.C, KEY_BLOCK), (0, kb)), wtid)

    @staticmethod
    def tile_value(frag, sX, e, i, key):
        """Element e (at (i, key) of ``sX``) in fp32: from :meth:`block_fragment`'s ``frag``, or read from ``sX``."""
        x = sX[i, key] if frag is None else frag[e]
        return x.to(cutlass.Float32)

    @cute.jit
    def column_gates(self, sm, r, cTD, kb):
        """G (log2) of token ``r`` at this thread's accumulator columns of key block ``kb`` (a (C x KEY_BLOCK)
        accumulator's coordinates ``cTD``), by column slot (:func:`mma.acc_col_slot`): loaded once for all its rows."""
        gates = cute.make_rmem_tensor(cute.make_layout(KEY_BLOCK // 4), cutlass.Float32)
        for kc2 in cutlass.range_constexpr(KEY_BLOCK // 8):
            _, d = cTD[mma.acc_col_element(2 * kc2)]
            pair = gate_pair(sm.gates, r, kb * KEY_BLOCK + d, self.D)
            gates[2 * kc2] = pair[0, 0]
            gates[2 * kc2 + 1] = pair[0, 1]
        return gates

    @cute.jit
    def own_reference(self, r):
        """The reference token of token ``r``'s half."""
        half = self.C // 2
        return (r // half) * half + half // 2

    @cute.jit
    def gated_keys(self, sm, tidx):
        """Every thread: R = k 2^(G_r - G) (own references) and F K = k 2^(G_L - G) into ``sm.left``."""
        C, K = self.C, self.D
        for idx in cutlass.range(tidx, C * K, self.threads, unroll=2):
            r, d = idx // K, idx % K
            g_r = self.gate(sm, r, d)
            x = sm.k[r, d].to(cutlass.Float32)
            sm.r[r, d] = (x * cute.math.exp2(self.gate(sm, self.own_reference(r), d) - g_r, fastmath=True)).to(
                cutlass.BFloat16
            )
            sm.left[r, d] = (x * cute.math.exp2(self.gate(sm, C - 1, d) - g_r, fastmath=True)).to(cutlass.BFloat16)

    @cute.jit
    def gated_k(self, sm, wtid):
        """One warpgroup: E K = k 2^G into ``sm.w``."""
        C, K = self.C, self.D
        for idx in cutlass.range(wtid, C * K, 128, unroll=2):
            r, d = idx // K, idx % K
            factor = cute.math.exp2(self.gate(sm, r, d), fastmath=True)
            sm.w[r, d] = (sm.k[r, d].to(cutlass.Float32) * factor).to(cutlass.BFloat16)

    # ---------------------------------------------------------------- products
    @cute.jit
    def gemm_to(self, n: cutlass.Constexpr, b_major: cutlass.Constexpr, sA, sB, wtid):
        """A B (both in shared memory, B a view as :meth:`product` takes it): an fp32 (C x n) accumulator and its
        coordinates."""
        return self.product(mma.tiled_mma(self.C, n, b_major=b_major, a_in_registers=False), sA, sB, wtid, n)

    @cute.jit
    def key_scores(self, sm, sX, h, wtid):
        """Column half h of the unmasked scores sum_k x_ik k_jk 2^(G_ik - G_jk): the product of the register operand
        L^h = x 2^(G - G_rh) (zero on the rows before half h) and R's rows of the half, a block of KEY_BLOCK keys at a
        time (one block's operand in registers at once). Returns an fp32 (C x C/2) accumulator and its coordinates
        (i, j - h C/2)."""
        C = self.C
        half = C // 2
        ref = h * half + half // 2
        f32, bf16 = cutlass.Float32, cutlass.BFloat16
        tiled = mma.tiled_mma(C, half)
        thr = tiled.get_slice(wtid)
        thr_ck = mma.tiled_mma(C, KEY_BLOCK).get_slice(wtid)
        cCK = thr_ck.partition_C(cute.make_identity_tensor((C, KEY_BLOCK)))
        part_ck = thr_ck.make_fragment_C(thr_ck.partition_shape_C((C, KEY_BLOCK)))  # the layout of the operand
        pair = cute.make_rmem_tensor(cute.make_layout((1, 2)), f32)
        part = thr.make_fragment_C(thr.partition_shape_C((C, half)))
        part.fill(0.0)
        for kb in cutlass.range(self.key_blocks, unroll=1):
            # built in pairs and converted two at a time (bf16x2): every operand register is final before the wgmma
            # fence (a register packed after it makes ptxas fence each k-block)
            left = mma.empty_operand(cute.size(cCK))
            left_flat = cute.make_tensor(left.iterator, cute.make_layout(cute.size(cCK)))
            ref_gates = self.column_gates(sm, ref, cCK, kb)
            x_frag = self.block_fragment(part_ck, sX, kb, wtid)
            for e2 in cutlass.range_constexpr(cute.size(cCK) // 2):
                i, d = cCK[2 * e2]
                pair.fill(0.0)
                if i >= h * half:
                    gates = gate_pair(sm.gates, i, kb * KEY_BLOCK + d, self.D)
                    for e in cutlass.range_constexpr(2):
                        factor = cute.math.exp2(gates[0, e] - ref_gates[mma.acc_col_slot(2 * e2 + e)], fastmath=True)
                        x = self.tile_value(x_frag, sX, 2 * e2 + e, i, kb * KEY_BLOCK + d + e)
                        pair[0, e] = x * factor
                cute.local_tile(left_flat, (2,), (e2,)).store(pair.load().to(bf16))
            b_frag = thr.make_fragment_B(thr.partition_B(cute.local_tile(sm.r, (half, KEY_BLOCK), (h, kb))))
            mma.gemm_waited(tiled, part, left, b_frag, False)
        return part, thr.partition_C(cute.make_identity_tensor((C, half)))

    @cute.jit
    def pair_product(self, p, a, a_in_smem: cutlass.Constexpr, b_tile, kb, wtid):
        """The pair gradients' (C x KEY_BLOCK) product of a score gradient ``a`` (a bf16 register operand, or with
        ``a_in_smem`` a (C x C) tile) and key block ``kb`` of the (C, K) tile ``b_tile`` read MN-major: ``(tiled MMA,
        its thread slice, A fragment, B fragment)``."""
        tiled = mma.tiled_mma(self.C, KEY_BLOCK, b_major="MN", a_in_registers=not a_in_smem)
        thr = tiled.get_slice(wtid)
        b_frag = thr.make_fragment_B(thr.partition_B(_key_block(tiles.mn_plane(b_tile, p.tile_tok_mn), kb)))
        a_frag = a
        if cutlass.const_expr(a_in_smem):
            a_frag = thr.make_fragment_A(thr.partition_A(a))
        return tiled, thr, a_frag, b_frag

    @cute.jit
    def row_pairs(self, p, acc, local, cTD, kb, sm, a, a_in_smem: cutlass.Constexpr, sX, wtid):
        """The rows gradient of a score gradient dM on key block ``kb`` (C x KEY_BLOCK), one product per half h of its
        contraction index: acc += 2^(G_i - G_rh) (dM[:, h] R_h)_i and dg's local += L^h_i (dM[:, h] R_h)_i for i in or
        after half h, with L^h = bf16(x 2^(G - G_rh)) as the scores take it (``sX`` the tile of x). ``a``: dM as a
        bf16 register operand, or (``a_in_smem``) a tile in shared memory."""
        C = self.C
        half = C // 2
        f32 = cutlass.Float32
        tiled, thr, a_frag, b_frag = self.pair_product(p, a, a_in_smem, sm.r, kb, wtid)
        for h in cutlass.range_constexpr(2):
            ref_gates = self.column_gates(sm, h * half + half // 2, cTD, kb)
            part = thr.make_fragment_C(thr.partition_shape_C((C, KEY_BLOCK)))
            mma.gemm_waited(tiled, part, a_frag, b_frag, True, (2 * h, 2 * h + 1))
            x_frag = self.block_fragment(acc, sX, kb, wtid)  # per half: held across both, it spills
            for e2 in cutlass.range_constexpr(cute.size(acc) // 2):
                i, d = cTD[2 * e2]
                if i >= h * half:
                    gates = gate_pair(sm.gates, i, kb * KEY_BLOCK + d, self.D)
                    for x in cutlass.range_constexpr(2):
                        e = 2 * e2 + x
                        factor = cute.math.exp2(gates[0, x] - ref_gates[mma.acc_col_slot(e)], fastmath=True)
                        left = self.tile_value(x_frag, sX, e, i, kb * KEY_BLOCK + d + x) * factor
                        left = left.to(cutlass.BFloat16).to(f32)
                        acc[e] = acc[e] + part[e] * factor
                        local[e] = local[e] + part[e] * left

    @cute.jit
    def column_pairs(self, p, acc, local, cTD, kb, sm, a, a_in_smem: cutlass.Constexpr, sX, barrier, wtid):
        """The columns gradient of a score gradient dM (``a``: dM^T, rows j) on key block ``kb``, one product per
        half h of its rows: L^h = bf16(x 2^(G - G_rh)) (zero before half h) is built in ``sm.left``'s columns of the
        block by this warpgroup (``barrier`` its own named barrier), then acc += 2^(G_rh - G_j) (dM^T L^h)_j and dg's
        local -= R_j (dM^T L^h)_j for j in half h. A pair (i, j) so enters dg's local term through the same rounded
        L^h_i and R_j as through :meth:`row_pairs`, and the pairs inside a suffix cancel."""
        C = self.C
        half = C // 2
        f32 = cutlass.Float32
        tiled, thr, a_frag, b_frag = self.pair_product(p, a, a_in_smem, sm.left, kb, wtid)
        key = kb * KEY_BLOCK + wtid % KEY_BLOCK  # this thread's key of the L^h build
        for h in cutlass.range(2, unroll=1):
            ref = h * half + half // 2
            ref_gate = self.gate(sm, ref, key)
            for i in cutlass.range(wtid // KEY_BLOCK, C, 128 // KEY_BLOCK, unroll=2):
                x = f32(0.0)
                if i >= h * half:
                    x = sX[i, key].to(f32) * cute.math.exp2(self.gate(sm, i, key) - ref_gate, fastmath=True)
                sm.left[i, key] = x.to(cutlass.BFloat16)
            cute.arch.fence_proxy("async.shared", space="cta")
            cute.arch.barrier(barrier_id=barrier, number_of_threads=128)
            ref_gates = self.column_gates(sm, ref, cTD, kb)
            r_frag = self.block_fragment(acc, sm.r, kb, wtid)
            part = thr.make_fragment_C(thr.partition_shape_C((C, KEY_BLOCK)))
            mma.gemm_waited(tiled, part, a_frag, b_frag, True)
            for e2 in cutlass.range_constexpr(cute.size(acc) // 2):
                j, d = cTD[2 * e2]
                if j >= h * half and j < (h + 1) * half:
                    gates = gate_pair(sm.gates, j, kb * KEY_BLOCK + d, self.D)
                    for x in cutlass.range_constexpr(2):
                        e = 2 * e2 + x
                        factor = cute.math.exp2(ref_gates[mma.acc_col_slot(e)] - gates[0, x], fastmath=True)
                        acc[e] = acc[e] + part[e] * factor
                        local[e] = local[e] - part[e] * self.tile_value(r_frag, sm.r, e, j, kb * KEY_BLOCK + d + x)
            cute.arch.barrier(barrier_id=barrier, number_of_threads=128)  # every read of L^h before the next's build

    # ---------------------------------------------------------------- warpgroup 0: the WY form and its gradients
    @cute.jit
    def wy_role(self, p, sm, valid, wtid, part, t0, hv):
        C, K = self.C, self.D
        f32 = cutlass.Float32
        own = p.own
        # stage 1: A (strict lower, fp32, transposed for the solve), then T
        for h in cutlass.range(2, unroll=1):
            kk, cH = self.key_scores(sm, sm.k, h, wtid)
            for e in cutlass.range_constexpr(cute.size(kk)):
                r, c = cH[e]
                c = c + h * (C // 2)
                a = f32(0.0)
                if c < r and r < valid:
                    a = kk[e] * sm.beta[r]
                sm.at[c, r] = a
        self.wy_step()
        solve.solve_diag16_per_warp(sm.at, wtid)
        self.wy_step()
        solve.solve_merge_to_bf16(sm.at, sm.t, wtid, Barrier.WY)
        self.stage_done()  # 1
        # stage 2: T^T kept and T's columns scaled by beta; W = T diag(beta) (E K), V' = T diag(beta) V - W S
        for idx in cutlass.range(wtid, C * C, 128, unroll=4):
            r, c = idx // C, idx % C
            x = sm.t[r, c]
            sm.tt[c, r] = x
            sm.t[r, c] = (x.to(f32) * sm.beta[c]).to(cutlass.BFloat16)
        self.gated_k(sm, wtid)
        self.wy_step()
        acc_w, cTK = self.gemm_to(K, "MN", sm.t, tiles.mn_plane(sm.w, p.tile_tok_mn), wtid)
        self.wy_step()  # every thread's wgmma has read E K before -W overwrites it
        self.to_tile(acc_w, cTK, sm.w, -1.0, wtid)
        self.wy_step()
        acc_u, cTV = self.gemm_to(SLAB, "MN", sm.t, tiles.mn_plane(sm.v, own.tile_slab_mn), wtid)
        self.smem_gemm(mma.tiled_mma(C, SLAB, a_in_registers=False), acc_u, sm.w, sm.s, wtid, False)
        self.to_tile(acc_u, cTV, sm.vn, 1.0, wtid)
        self.stage_done()  # 2
        # stage 3: E K again (over -W) for stage 4; the columns gradient of dP (x = q) into dk and dg's local term once
        # warpgroup 1 has stored dk^end (one warpgroup holding both spills)
        self.gated_k(sm, wtid)
        acc_dpt, cCC = self.scores(sm.vn, sm.do, wtid)
        r_dpt = self.masked_scores(acc_dpt, cCC, None, valid, True, p.scale)
        thr = mma.tiled_mma(C, KEY_BLOCK).get_slice(wtid)
        cTD = thr.partition_C(cute.make_identity_tensor((C, KEY_BLOCK)))
        for kb in cutlass.range(self.key_blocks, unroll=1):
            acc = thr.make_fragment_C(thr.partition_shape_C((C, KEY_BLOCK)))
            local = thr.make_fragment_C(thr.partition_shape_C((C, KEY_BLOCK)))
            acc.fill(0.0)
            local.fill(0.0)
            self.column_pairs(p, acc, local, cTD, kb, sm, r_dpt, False, sm.q, Barrier.WY, wtid)
            if kb == 0:
                cute.arch.barrier(barrier_id=Barrier.DK_END, number_of_threads=256)
            self.add_rows(acc, cTD, p.t.dk, valid, part, t0, hv, kb * KEY_BLOCK)
            self.add_rows(local, cTD, p.t.dg, valid, part, t0, hv, kb * KEY_BLOCK)
        self.stage_done()  # 3
        # stage 4: dT = (dW (E K)^T + dV' V^T) diag(beta), to X1 (dO's bytes)
        acc_a, cCC = self.scores(sm.dw, sm.w, wtid)
        acc_b, _ = self.scores(sm.dvn, sm.v, wtid)
        for e in cutlass.range_constexpr(cute.size(acc_a)):
            r, c = cCC[e]
            sm.x1[r, c] = (sm.beta[c] * (acc_a[e] + acc_b[e])).to(cutlass.BFloat16)
        self.stage_done()  # 4
        # stage 5: the scores of A again (for dbeta), kept in A^T's bytes (dW's until stage 4); X = dT T^T (to X2),
        # dA = -(T^T X); dA_b both ways round
        for h in cutlass.range(2, unroll=1):
            kk, cH = self.key_scores(sm, sm.k, h, wtid)
            for e in cutlass.range_constexpr(cute.size(kk)):
                r, c = cH[e]
                sm.at[r, c + h * (C // 2)] = kk[e]
        acc_x, cCC = self.cc_product(sm.x1, tiles.mn_plane(sm.tt, own.tile_cc_mn), wtid)
        self.to_tile(acc_x, cCC, sm.x2, 1.0, wtid)
        self.wy_step()
        acc_da, _ = self.cc_product(sm.tt, tiles.mn_plane(sm.x2, own.tile_cc_mn), wtid)
        self.wy_step()  # every thread's X read before dA_b^T overwrites X2, and dT before dA_b overwrites X1
        da_kk = cute.make_rmem_tensor(cute.make_layout(2), f32)
        da_kk.fill(0.0)
        for e in cutlass.range_constexpr(cute.size(acc_da)):
            r, c = cCC[e]
            rr = mma.acc_row_slot(e)
            da = f32(0.0)
            if c < r:  # the scores above the diagonal may be inf (their factors grow): a select, not a product
                da = -acc_da[e]
                da_kk[rr] = da_kk[rr] + da * sm.at[r, c]
            dab = (sm.beta[r] * da).to(cutlass.BFloat16)
            sm.x1[r, c] = dab
            sm.x2[c, r] = dab
        self.quad_sums(da_kk, cCC, sm.rows, DA_KK, wtid)
        self.stage_done()  # 5

    # ---------------------------------------------------------------- warpgroup 1: dV', then dk
    @cute.jit
    def dk_role(self, p, sm, valid, wtid, warp_in_group, part, t0, hv):
        C, K = self.C, self.D
        f32 = cutlass.Float32
        own = p.own
        # stage 1: dV' = (F K) dS' + P^T dO
        acc, cTV = self.gemm_to(SLAB, "K", sm.left, sm.ds, wtid)
        cute.arch.barrier(barrier_id=Barrier.P_READY, number_of_threads=256)
        self.smem_gemm(
            mma.tiled_mma(C, SLAB, b_major="MN", a_in_registers=False), acc, sm.pt,
            tiles.mn_plane(sm.do, own.tile_slab_mn), wtid, False,
        )  # fmt: skip
        self.to_tile(acc, cTV, sm.dvn, 1.0, wtid)
        self.stage_done()  # 1
        # stage 2: the slab's 2^G_L sum_v S dS' per key
        if wtid < K:
            x = f32(0.0)
            for v in cutlass.range(SLAB, unroll=8):
                x = x + sm.s[v, wtid].to(f32) * sm.ds[v, wtid].to(f32)
            sm.col_state[wtid] = x * cute.math.exp2(self.gate(sm, C - 1, wtid), fastmath=True)
        self.stage_done()  # 2
        # stage 3: dk = dk^end = F (V' dS'^T), a key block at a time, and the constant's sum_j k_j dk^end_j; once
        # warpgroup 2 has stored dg's local term from dq's side, -k dk^end added to it (warpgroup 0 adds the P parts)
        ends = []
        for kb in cutlass.range_constexpr(self.key_blocks):
            acc, cTD = self.gemm_to(
                KEY_BLOCK, "MN", sm.vn, _key_block(tiles.mn_plane(sm.ds, p.tile_state_mn), kb), wtid
            )  # fmt: skip
            last_gates = self.column_gates(sm, C - 1, cTD, kb)
            for e2 in cutlass.range_constexpr(cute.size(acc) // 2):
                j, d = cTD[2 * e2]
                gates = gate_pair(sm.gates, j, kb * KEY_BLOCK + d, self.D)
                for x in cutlass.range_constexpr(2):
                    e = 2 * e2 + x
                    acc[e] = acc[e] * cute.math.exp2(last_gates[mma.acc_col_slot(e)] - gates[0, x], fastmath=True)
            self.end_column_sums(acc, cTD, kb, sm, warp_in_group, wtid)
            self.store_rows(acc, cTD, p.t.dk, valid, part, t0, hv, kb * KEY_BLOCK)
            ends.append((acc, cTD))
        cute.arch.barrier(barrier_id=Barrier.LOCAL_Q, number_of_threads=256)
        for kb in cutlass.range_constexpr(self.key_blocks):
            acc, cTD = ends[kb]
            for e in cutlass.range_constexpr(cute.size(acc)):
                j, d = cTD[e]
                acc[e] = -acc[e] * sm.k[j, kb * KEY_BLOCK + d].to(f32)
            self.add_rows(acc, cTD, p.t.dg, valid, part, t0, hv, kb * KEY_BLOCK)
        cute.arch.barrier(barrier_id=Barrier.DK_END, number_of_threads=256)
        self.stage_done()  # 3
        # stage 4: d_bk = T^T dW; dbeta's sum_k E k d_bk; dk += beta E d_bk; dg's local += k beta E d_bk
        acc_dbk, cTK = self.gemm_to(K, "MN", sm.tt, tiles.mn_plane(sm.dw, p.tile_tok_mn), wtid)
        self.row_dot(acc_dbk, cTK, sm.w, sm.rows, K_DBK, wtid)
        for e2 in cutlass.range_constexpr(cute.size(acc_dbk) // 2):
            r, d = cTK[2 * e2]
            gates = gate_pair(sm.gates, r, d, self.D)
            for x in cutlass.range_constexpr(2):
                e = 2 * e2 + x
                acc_dbk[e] = acc_dbk[e] * sm.beta[r] * cute.math.exp2(gates[0, x], fastmath=True)
        self.add_rows(acc_dbk, cTK, p.t.dk, valid, part, t0, hv)
        for e in cutlass.range_constexpr(cute.size(acc_dbk)):
            r, d = cTK[e]
            acc_dbk[e] = acc_dbk[e] * sm.k[r, d].to(f32)
        self.add_rows(acc_dbk, cTK, p.t.dg, valid, part, t0, hv)
        self.stage_done()  # 4
        self.stage_done()  # 5

    # ---------------------------------------------------------------- warpgroup 2: P^T, dq, then dv
    @cute.jit
    def dq_dv_role(self, p, sm, valid, wtid, b, part, t0, hv, slab):
        C, K = self.C, self.D
        own = p.own
        # stage 1: P^T = scale (Q K^T)_gated on j <= i < valid, for warpgroup 1's dV'
        for h in cutlass.range(2, unroll=1):
            scores, cH = self.key_scores(sm, sm.q, h, wtid)
            for e in cutlass.range_constexpr(cute.size(scores)):
                i, j = cH[e]
                j = j + h * (C // 2)
                x = cutlass.Float32(0.0)
                if j <= i and i < valid:
                    x = scores[e] * p.scale
                sm.pt[j, i] = x.to(cutlass.BFloat16)
        cute.arch.fence_proxy("async.shared", space="cta")
        cute.arch.barrier(barrier_id=Barrier.P_READY, number_of_threads=256)
        self.stage_done()  # 1
        # stage 2: -dW = dV' S^T, kept as dW
        acc_dw, cTK = self.gemm_to(K, "MN", sm.dvn, tiles.mn_plane(sm.s, p.tile_state_mn), wtid)
        self.to_tile(acc_dw, cTK, sm.dw, -1.0, wtid)
        self.stage_done()  # 2
        # stage 3: dq = scale E (dO S^T) + rows(dP), dP = scale dO V'^T, a key block at a time
        acc_dp, cCC = self.scores(sm.do, sm.vn, wtid)
        r_dp = self.masked_scores(acc_dp, cCC, None, valid, False, p.scale)
        for kb in cutlass.range(self.key_blocks, unroll=1):
            acc, cTD = self.gemm_to(
                KEY_BLOCK, "MN", sm.do, _key_block(tiles.mn_plane(sm.s, p.tile_state_mn), kb), wtid
            )  # fmt: skip
            local = cute.make_rmem_tensor(acc.layout, cutlass.Float32)
            q_frag = self.block_fragment(acc, sm.q, kb, wtid)
            for e2 in cutlass.range_constexpr(cute.size(acc) // 2):
                i, d = cTD[2 * e2]
                gates = gate_pair(sm.gates, i, kb * KEY_BLOCK + d, self.D)
                for x in cutlass.range_constexpr(2):
                    e = 2 * e2 + x
                    acc[e] = acc[e] * p.scale * cute.math.exp2(gates[0, x], fastmath=True)
                    local[e] = acc[e] * self.tile_value(q_frag, sm.q, e, i, kb * KEY_BLOCK + d + x)
            self.row_pairs(p, acc, local, cTD, kb, sm, r_dp, False, sm.q, wtid)
            self.store_rows(acc, cTD, p.t.dq, valid, part, t0, hv, kb * KEY_BLOCK)
            self.store_rows(local, cTD, p.t.dg, valid, part, t0, hv, kb * KEY_BLOCK)
        cute.arch.barrier(barrier_id=Barrier.LOCAL_Q, number_of_threads=256)
        self.stage_done()  # 3
        # stage 4: d_bv = T^T dV', dv = beta d_bv (the slab's columns)
        acc_dbv, cTV = self.gemm_to(SLAB, "MN", sm.tt, tiles.mn_plane(sm.dvn, own.tile_slab_mn), wtid)
        self.row_dot(acc_dbv, cTV, sm.v, sm.rows, V_DBV, wtid)
        for e in cutlass.range_constexpr(cute.size(acc_dbv)):
            r, _ = cTV[e]
            acc_dbv[e] = acc_dbv[e] * sm.beta[r]
        self.store_rows(acc_dbv, cTV, p.t.dv, valid, b, t0, hv, slab * SLAB)
        self.stage_done()  # 4
        self.stage_done()  # 5

    # ---------------------------------------------------------------- stage 6, and the sums
    @cute.jit
    def pair_terms(self, p, sm, kb, valid, wtid, part, t0, hv, barrier):
        """Stage 6 on key block ``kb``: the pair terms of A, rows(dA_b) + columns(dA_b^T) (x = k), into dk and dg's
        local term (``barrier``: this warpgroup's own, for its L^h blocks)."""
        thr = mma.tiled_mma(self.C, KEY_BLOCK).get_slice(wtid)
        acc = thr.make_fragment_C(thr.partition_shape_C((self.C, KEY_BLOCK)))
        local = thr.make_fragment_C(thr.partition_shape_C((self.C, KEY_BLOCK)))
        cTD = thr.partition_C(cute.make_identity_tensor((self.C, KEY_BLOCK)))
        acc.fill(0.0)
        local.fill(0.0)
        self.row_pairs(p, acc, local, cTD, kb, sm, sm.x1, True, sm.k, wtid)
        self.column_pairs(p, acc, local, cTD, kb, sm, sm.x2, True, sm.k, barrier, wtid)
        self.add_rows(acc, cTD, p.t.dk, valid, part, t0, hv, kb * KEY_BLOCK)
        self.add_rows(local, cTD, p.t.dg, valid, part, t0, hv, kb * KEY_BLOCK)

    @cute.jit
    def end_column_sums(self, acc, cTD, kb, sm, warp_in_group, wtid):
        """sum_j k_j * dk^end_j per key of block ``kb`` over this warp's 16 rows to ``sm.col_warps[warp_in_group]``:
        each thread's two rows, then the eight lanes that share its columns (lanes 4 apart)."""
        for kc in cutlass.range_constexpr(KEY_BLOCK // 4):
            x = cutlass.Float32(0.0)
            for rr in cutlass.range_constexpr(2):
                e = mma.acc_col_element(kc, rr)
                j, d = cTD[e]
                x = x + sm.k[j, kb * KEY_BLOCK + d].to(cutlass.Float32) * acc[e]
            for step in cutlass.range_constexpr(3):
                x = x + cute.arch.shuffle_sync_bfly(x, 4 << step)
            _, d = cTD[mma.acc_col_element(kc)]
            if wtid % 32 < 4:
                sm.col_warps[warp_in_group, kb * KEY_BLOCK + d] = x

    @cute.jit
    def gate_gradient(self, t, sm, valid, key, part, t0, hv):
        """One key channel per thread: dg_t = sum_{s >= t} local_s + the chunk's constant, the slab's local term read
        back from dg (a batch of rows loaded before its stores overwrite them; rows clamped into the chunk, so that
        every load of a batch is issued at once)."""
        C = self.C
        f32 = cutlass.Float32
        constant = sm.col_state[key]
        for w in cutlass.range_constexpr(4):
            constant = constant + sm.col_warps[w, key]
        batch = GATE_BATCH
        local = cute.make_rmem_tensor(cute.make_layout(batch), f32)
        run = f32(0.0)
        for rb in cutlass.range(C // batch, unroll=1):
            r0 = C - batch * (rb + 1)
            for i in cutlass.range_constexpr(batch):
                local[i] = t.dg[part, t0 + cutlass.min(r0 + i, valid - 1), hv, key]
            for rev in cutlass.range_constexpr(batch):
                i = batch - 1 - rev
                r = r0 + i
                if r < valid:
                    run = run + local[i]
                    t.dg[part, t0 + r, hv, key] = run + constant
