"""Passes 3 and 4 of GLA's backward (a per-key gate; :func:`cula.ops.chunk_backward.chunk_gradients`) on SM90: one
CTA per (chunk, head) makes the chunk's dq, dk, dv and dg from its tokens and the two state walks' checkpoints.

Per chunk (C = 64 tokens; G [C, K] the cumulative log2 gate per key, r = C / 2 the reference token, G_L the last row;
S^T and dS'^T the checkpoints, stored (V, K); dA = scale (dO V^T) on j <= i < valid, zero elsewhere):

- the fast path, where every key channel's G_0 - G_r and G_r - G_L stay within ``SAFE_SPAN`` (the operands' widest
  exponents), with the bf16 tiles Q_L = Q 2^(G - G_r), K_R = K 2^(G_r - G) and K_F = K 2^(G_L - G):

      dq = 2^(G - G_r) * (scale 2^G_r * (dO S) + dA K_R)
      dk = 2^(G_r - G) * (2^(G_L - G_r) * (V dS'^T) + dA^T Q_L)
      dv = K_F dS' + P^T dO,        P^T = scale (K_R Q_L^T) on j <= i

  (the per-key factors scale the fp32 accumulators' columns, so that each product is one wgmma);
- the steep path (a chunk with a wider exponent in some channel): the same inter parts with their exact factors 2^G
  and 2^(G_L - G), and the intra parts summed per element in fp32 with factors 2^(G_i - G_j) <= 1 (dA read from
  shared memory in fp32, P^T rounded once): exact for any gate, and slower;
- the gate, per key: dg_t = sum_{s >= t} (q * dq - k * dk)_s + sum_j (k * dk^inter)_j + 2^G_L sum_v (S * dS').

Three warpgroups, one output each (dq, dk, dv); warp 0 issues the six TMA loads (q, k, v, do tiles (C, D); the
checkpoints (D, D)) on one mbarrier while the first D threads scan the gates from global memory, one key channel each.
Once all three outputs are made, q * dq and k * dk go to shared memory over the tiles no product reads any more (S and
dS', V and dO), and every thread takes a part of dg's suffix sums: a segment of the rows of one key channel (its
segment's sum, then the later segments' through shared memory). sum_v (S * dS') per key is made by warpgroups 1 and 2
in parts while the first D threads scan the gates. (Made by the dv warpgroup alone after its product and scanned by
D threads walking all C rows, these two epilogues left most threads waiting: the kernel took 1.44 ms against 1.31 at
B1 T8192 H64 on an H100.)

Shapes: q, k, v, do, dq, dk, dv [B, T, H, D] bf16; g, dg [B, T, H, D] fp32 (g the natural-log gate; gates below
the floor take no gradient); the checkpoints [rows, H, D, D] bf16 (S^T); ``chunks`` [rows, 2] int32 as
:class:`cula.sm90.scalar_chunk_bwd.ScalarGateChunkBwdSm90` reads them. D = 64 or 128.
"""

from __future__ import annotations

import enum
import math
from typing import NamedTuple

import cutlass
import cutlass.cute as cute

from cula.ops.gates import GATE_FLOOR
from cula.ops.gates import GLA_SAFE_SPAN as SAFE_SPAN
from cula.sm90 import mma, pipeline, tiles
from cula.sm90.scalar_chunk_bwd import Params, ScalarGateChunkBwdSm90, Tensors

WARPGROUPS = 3  # dq, dk, dv
PART_THREADS = 256  # warpgroups 1 and 2, which make the column state's parts during the gate scan
_LOG2E = math.log2(math.e)
ROW = "row"  # an exponent's term: the accumulator element's own row (KeyGateChunkBwdSm90.exponent)


class Barrier(enum.IntEnum):
    GRADS_MADE = 1  # all warpgroups: dq, dk, dv made, the tiles under q * dq and k * dk free
    DA_READY = 2  # the steep path: dA in shared memory, from the dq warpgroup to the dk one


class Smem(NamedTuple):
    q: cute.Tensor
    k: cute.Tensor
    v: cute.Tensor
    do: cute.Tensor
    s: cute.Tensor  # S^T (V, K)
    ds: cute.Tensor  # dS'^T (V, K)
    q_l: cute.Tensor
    k_r: cute.Tensor
    k_f: cute.Tensor
    da: cute.Tensor  # the steep path: dA (C x C) fp32 in Q_L's and K_R's bytes, :func:`swizzled`
    gates: cute.Tensor  # G (C x D) fp32 log2, :func:`swizzled`
    x_q: cute.Tensor  # q * dq (C x D) fp32 in S's and dS''s bytes
    x_k: cute.Tensor  # k * dk (C x D) fp32 in V's and dO's bytes
    col_warps: cute.Tensor  # (4, D): sum_j (k * dk^inter)_j per warp of the dk warpgroup
    col_state: cute.Tensor  # (D,): 2^G_L sum_v (S * dS')
    steep: cute.Tensor  # (1,) int32
    parts: cute.Tensor  # (threads,) fp32, the epilogues' partial sums per key


@cute.jit
def swizzled(r, c, width: cutlass.Constexpr):
    """The flat index of (r, c) in a row-major fp32 (rows x ``width``) tile whose columns are XOR-permuted per row:
    a column walked by consecutive threads along a row and an accumulator's (8 rows x 4 column pairs) per warp both
    meet at most two ways per bank."""
    return r * width + (c ^ ((r & 7) << 2))


@cute.jit
def gate_pair(gates, r, c, width: cutlass.Constexpr):
    """(r, c) and (r, c + 1) of a flat :func:`swizzled` fp32 tile (``c`` even: the swizzle keeps the two adjacent),
    by one 64-bit shared load: a (1, 2) fp32 fragment."""
    rows = cute.make_tensor(gates.iterator, cute.make_layout((cute.size(gates) // width, width), stride=(width, 1)))
    pair = cute.make_rmem_tensor(cute.make_layout((1, 2)), cutlass.Float32)
    cute.autovec_copy(cute.local_tile(rows, (1, 2), (r, (c // 2) ^ ((r & 7) << 1))), pair)
    return pair


def _difference(plus, minus, x):
    """G_plus - G_minus at column ``x`` of two (1, 2) gate fragments (None: no term)."""
    if minus is None:
        return plus[0, x]
    if plus is None:
        return -minus[0, x]
    return plus[0, x] - minus[0, x]


class KeyGateChunkBwdSm90(ScalarGateChunkBwdSm90):
    """The kernel (module docstring); the token and score helpers are the scalar-gate kernel's."""

    per_key_gate = True

    def __init__(self, head_dim: int, is_varlen: bool, tile_copies: bool = True):
        super().__init__(head_dim, is_varlen, tile_copies)
        self.threads = 128 * WARPGROUPS

    # ---------------------------------------------------------------- host side
    @cute.jit
    def __call__(self, q, k, v, do, g, states, state_grads, chunks, dq, dk, dv, dg, scale, stream):
        C, D = self.C, self.D
        f32 = cutlass.Float32
        t = Tensors(q, k, v, do, g, states, state_grads, chunks, dq, dk, dv, dg)
        loads, tile_tok, tile_tok_mn, tile_state, tile_state_mn = self.chunk_loads(q, k, v, do, states, state_grads)
        p = Params(loads, t, scale, tile_tok, tile_tok_mn, tile_state, tile_state_mn)
        tok = cute.struct.Align[cute.struct.MemRange[cutlass.BFloat16, cute.cosize(tile_tok)], 1024]
        fields = {
            **self.shared_fields(tile_tok, tile_state, ("sQ", "sK", "sV", "sDO"), 1),
            # Q_L and K_R back to back: the steep path's dA (C x C fp32) takes their bytes at D = 64 as well
            "sQL": tok,
            "sKR": tok,
            "sKF": tok,
            "sGates": cute.struct.Align[cute.struct.MemRange[f32, C * D], 16],
            "sColWarps": cute.struct.MemRange[f32, 4 * D],
            "sColState": cute.struct.MemRange[f32, D],
            "sSteep": cute.struct.MemRange[cutlass.Int32, 4],
            "sParts": cute.struct.MemRange[f32, self.threads],
        }
        self.launch_with(p, fields, chunks.shape[0], q.shape[2], stream)

    # ---------------------------------------------------------------- device side
    @cute.kernel
    def kernel(self, p: Params):
        C, D = self.C, self.D
        t = p.t
        tidx, row, h, warp, _, valid, b, t0 = self.coordinates(t)
        f32 = cutlass.Float32

        st = cutlass.memory.SmemAllocator().allocate(self.storage)

        def fp32_over(field, elems):
            return cute.make_tensor(cute.recast_ptr(field.data_ptr(), dtype=f32), cute.make_layout(elems))

        sQ, sK, sV, sDO, sS, sDS = self.loaded_tiles(st, p)
        sQL, sKR, sKF = (self.token_tile(p, field) for field in (st.sQL, st.sKR, st.sKF))
        parts = st.sParts.get_tensor(cute.make_layout(self.threads))
        sm = Smem(
            sQ[None, None, 0], sK[None, None, 0], sV[None, None, 0], sDO[None, None, 0], sS[None, None, 0],
            sDS[None, None, 0], sQL[None, None, 0], sKR[None, None, 0], sKF[None, None, 0],
            fp32_over(st.sQL, C * C), st.sGates.get_tensor(cute.make_layout(C * D)), fp32_over(st.sS, C * D),
            fp32_over(st.sV, C * D), st.sColWarps.get_tensor(cute.make_layout((4, D), stride=(D, 1))),
            st.sColState.get_tensor(cute.make_layout(D)), st.sSteep.get_tensor(cute.make_layout(4)), parts,
        )  # fmt: skip
        loads = pipeline.tma_ring(st.ring, 1, 4 * C * D * 2 + 2 * D * D * 2, 4 * WARPGROUPS)
        if tidx == 0:
            sm.steep[0] = cutlass.Int32(0)
        pipeline.rings_made()

        if valid > 0:
            if warp == 0:
                self.issue_loads(p, loads, sQ, sK, sV, sDO, sS, sDS, b, t0, h, h, row)
            if tidx < D:
                self.scan_gates(t, sm, valid, tidx, b, t0, h)
            self.await_tokens(loads, (sQ, sK, sV, sDO), valid, tidx)
            if tidx >= self.threads - PART_THREADS:  # idle while warpgroup 0 scans
                self.column_state_parts(sm, tidx - (self.threads - PART_THREADS))
            cute.arch.sync_threads()  # the gates, the steep flag and the zeroed rows
            steep = sm.steep[0]
            self.gated_tiles(sm, steep, tidx)
            cute.arch.fence_proxy("async.shared", space="cta")
            cute.arch.sync_threads()
            wg = warp // 4
            wtid = tidx % 128
            if wg == 0:
                self.make_dq(p, sm, steep, valid, wtid, b, t0, h)
            elif wg == 1:
                self.make_dk(p, sm, steep, valid, wtid, warp % 4, b, t0, h)
            else:
                self.make_dv(p, sm, steep, valid, wtid, b, t0, h)
            cute.arch.sync_threads()  # q * dq and k * dk in shared memory
            self.gate_gradient(t, sm, valid, tidx, b, t0, h)

    @cute.jit
    def scan_gates(self, t, sm, valid, key, b, t0, h):
        """One key channel per thread: G, the inclusive sum of max(g, floor) log2(e) over the chunk (0 past its end), to
        shared memory; the steep flag raised where the channel's G_0 - G_r or G_r - G_L passes SAFE_SPAN. The token
        index is clamped into the chunk, so that every load is issued before the sum needs it."""
        C, D = self.C, self.D
        f32 = cutlass.Float32
        raw = cute.make_rmem_tensor(cute.make_layout(C), f32)
        self.load_raw_gates(t, raw, 0, valid, b, t0, h, key)
        run = f32(0.0)
        g_first, g_ref = f32(0.0), f32(0.0)
        for r in cutlass.range_constexpr(C):
            x = cutlass.max(raw[r], f32(GATE_FLOOR)) * f32(_LOG2E)
            if r >= valid:
                x = f32(0.0)
            run = run + x
            sm.gates[swizzled(r, key, D)] = run
            if cutlass.const_expr(r == 0):
                g_first = run
            if cutlass.const_expr(r == C // 2):
                g_ref = run
        if cutlass.max(g_first - g_ref, g_ref - run) > f32(SAFE_SPAN):
            sm.steep[0] = cutlass.Int32(1)

    @cute.jit
    def gated_tiles(self, sm, steep, tidx):
        """K_F (and on the fast path Q_L and K_R) from q, k and G: each thread one key channel, every
        (threads / D)-th token."""
        C, D = self.C, self.D
        f32, bf16 = cutlass.Float32, cutlass.BFloat16
        key = tidx % D
        g_ref = sm.gates[swizzled(C // 2, key, D)]
        g_last = sm.gates[swizzled(C - 1, key, D)]
        for r in cutlass.range(tidx // D, C, self.threads // D, unroll=1):
            g_r = sm.gates[swizzled(r, key, D)]
            k_val = sm.k[r, key].to(f32)
            sm.k_f[r, key] = (k_val * cute.math.exp2(g_last - g_r, fastmath=True)).to(bf16)
            if steep == 0:
                q_val = sm.q[r, key].to(f32)
                sm.q_l[r, key] = (q_val * cute.math.exp2(g_r - g_ref, fastmath=True)).to(bf16)
                sm.k_r[r, key] = (k_val * cute.math.exp2(g_ref - g_r, fastmath=True)).to(bf16)

    @cute.jit
    def gate_at(self, sm, r, c):
        """G (log2) of token ``r``, key ``c``."""
        return sm.gates[swizzled(r, c, self.D)]

    @cute.jit
    def exponent(self, sm, term, r, d):
        """G of ``term`` at key ``d``: ``ROW`` for the element's row ``r``, a token index, or None for zero."""
        if cutlass.const_expr(term is None):
            return cutlass.Float32(0.0)
        return self.gate_at(sm, r if cutlass.const_expr(term == ROW) else term, d)

    @cute.jit
    def scale_elements(self, acc, cTD, sm, plus, minus, factor):
        """acc[i, d] *= factor 2^(G_plus - G_minus) at key d (each term as :meth:`exponent` takes it)."""
        if cutlass.const_expr(self.tile_copies):
            self.scale_column_pairs(acc, cTD, sm, plus, minus, factor)
        else:
            for e in cutlass.range_constexpr(cute.size(acc)):
                i, d = cTD[e]
                x = self.exponent(sm, plus, i, d) - self.exponent(sm, minus, i, d)
                acc[e] = acc[e] * factor * cute.math.exp2(x, fastmath=True)

    def fixed_pair(self, sm, term, d):
        """G of a token's ``term`` (as :meth:`exponent` takes it) at keys ``d`` and ``d + 1`` (``d`` even): a (1, 2)
        fragment; None for no term or ``ROW``."""
        if term is None or term == ROW:
            return None
        return gate_pair(sm.gates, term, d, self.D)

    def row_pair(self, sm, term, i, d, fixed):
        """G of ``term`` at keys ``d`` and ``d + 1`` of row ``i``: the row's pair for ``ROW``, else ``fixed``."""
        return gate_pair(sm.gates, i, d, self.D) if term == ROW else fixed

    @cute.jit
    def scale_column_pairs(self, acc, cTD, sm, plus, minus, factor):
        """:meth:`scale_elements` a column pair at a time: G by 64-bit loads, a token's term loaded once for the
        thread's two rows, and, where neither term is the row's, one factor per column for both rows."""
        per_row = ROW in (plus, minus)
        column = cute.make_rmem_tensor(cute.make_layout(2), cutlass.Float32)
        for blk in cutlass.range_constexpr(cute.size(acc) // 4):  # an 8-column block: (2 columns x 2 rows)
            _, d = cTD[4 * blk]
            fixed_plus, fixed_minus = self.fixed_pair(sm, plus, d), self.fixed_pair(sm, minus, d)
            if cutlass.const_expr(not per_row):
                for x in cutlass.range_constexpr(2):
                    column[x] = factor * cute.math.exp2(_difference(fixed_plus, fixed_minus, x), fastmath=True)
            for rr in cutlass.range_constexpr(2):
                i, _ = cTD[4 * blk + 2 * rr]
                if cutlass.const_expr(per_row):
                    row_plus = self.row_pair(sm, plus, i, d, fixed_plus)
                    row_minus = self.row_pair(sm, minus, i, d, fixed_minus)
                    for x in cutlass.range_constexpr(2):
                        column[x] = factor * cute.math.exp2(_difference(row_plus, row_minus, x), fastmath=True)
                for x in cutlass.range_constexpr(2):
                    e = 4 * blk + 2 * rr + x
                    acc[e] = acc[e] * column[x]

    @cute.jit
    def steep_intra(self, acc, cTD, sm, valid, queries: cutlass.Constexpr):
        """The steep path's intra-chunk part, summed per element from dA in shared memory with factors
        2^(G_i - G_j) <= 1: dq's (``queries``: acc[i] += sum_{j <= i} dA_ij 2^(G_i - G_j) k_j) or dk's
        (acc[j] += sum_{i >= j} dA_ij 2^(G_i - G_j) q_i)."""
        C = self.C
        for rr in cutlass.range_constexpr(2):
            own, _ = cTD[2 * rr]
            lo, hi = own, valid
            if cutlass.const_expr(queries):
                lo, hi = cutlass.Int32(0), cutlass.min(own + 1, valid)
            for other in cutlass.range(lo, hi, unroll=1):
                i, j = (own, other) if cutlass.const_expr(queries) else (other, own)
                da = sm.da[swizzled(i, j, C)]
                for kc in cutlass.range_constexpr(self.D // 4):
                    e = mma.acc_col_element(kc, rr)
                    _, d = cTD[e]
                    pair = cute.math.exp2(self.gate_at(sm, i, d) - self.gate_at(sm, j, d), fastmath=True)
                    x = sm.k[j, d] if cutlass.const_expr(queries) else sm.q[i, d]
                    acc[e] = acc[e] + da * pair * x.to(cutlass.Float32)

    @cute.jit
    def make_dq(self, p, sm, steep, valid, wtid, b, t0, h):
        """Warpgroup 0: dq, then q * dq to shared memory once every output is made."""
        C = self.C
        acc_dp, cCC = self.scores(sm.do, sm.v, wtid)
        acc, cTD = self.inter("MN", sm.do, tiles.mn_plane(sm.s, p.tile_state_mn), wtid)
        if steep != 0:
            da = self.masked(acc_dp, cCC, None, valid, False, p.scale)
            for e in cutlass.range_constexpr(cute.size(da)):
                i, j = cCC[e]
                sm.da[swizzled(i, j, C)] = da[e]
            cute.arch.barrier(barrier_id=Barrier.DA_READY, number_of_threads=256)
            self.scale_elements(acc, cTD, sm, ROW, None, p.scale)  # scale 2^G (dO S)
            self.steep_intra(acc, cTD, sm, valid, True)
        else:
            r_da = self.masked_scores(acc_dp, cCC, None, valid, False, p.scale)
            self.scale_elements(acc, cTD, sm, C // 2, None, p.scale)  # scale 2^G_r (dO S)
            self.add_intra(acc, r_da, tiles.mn_plane(sm.k_r, p.tile_tok_mn), wtid)
            self.scale_elements(acc, cTD, sm, ROW, C // 2, cutlass.Float32(1.0))
        self.store_rows(acc, cTD, p.t.dq, valid, b, t0, h)
        self.times_tile(acc, cTD, sm.q, wtid)
        cute.arch.barrier(barrier_id=Barrier.GRADS_MADE, number_of_threads=self.threads)
        self.store_fp32(sm.x_q, acc, cTD)

    @cute.jit
    def make_dk(self, p, sm, steep, valid, wtid, warp_in_group, b, t0, h):
        """Warpgroup 1: dk and sum_j (k * dk^inter)_j per key, then k * dk to shared memory once every output is
        made."""
        C = self.C
        one = cutlass.Float32(1.0)
        acc, cTD = self.inter("MN", sm.v, tiles.mn_plane(sm.ds, p.tile_state_mn), wtid)
        if steep != 0:
            self.scale_elements(acc, cTD, sm, C - 1, ROW, one)  # dk^inter = 2^(G_L - G) (V dS'^T)
            self.inter_column_sums(acc, cTD, sm, None, warp_in_group, wtid)
            cute.arch.barrier(barrier_id=Barrier.DA_READY, number_of_threads=256)
            self.steep_intra(acc, cTD, sm, valid, False)
        else:
            acc_dpt, cCC = self.scores(sm.v, sm.do, wtid)
            r_dat = self.masked_scores(acc_dpt, cCC, None, valid, True, p.scale)
            self.scale_elements(acc, cTD, sm, C - 1, C // 2, one)  # 2^(G_L - G_r) (V dS'^T)
            self.inter_column_sums(acc, cTD, sm, C // 2, warp_in_group, wtid)
            self.add_intra(acc, r_dat, tiles.mn_plane(sm.q_l, p.tile_tok_mn), wtid)
            self.scale_elements(acc, cTD, sm, C // 2, ROW, one)
        self.store_rows(acc, cTD, p.t.dk, valid, b, t0, h)
        self.times_tile(acc, cTD, sm.k, wtid)
        cute.arch.barrier(barrier_id=Barrier.GRADS_MADE, number_of_threads=self.threads)
        self.store_fp32(sm.x_k, acc, cTD)

    @cute.jit
    def make_dv(self, p, sm, steep, valid, wtid, b, t0, h):
        """Warpgroup 2: dv; then 2^G_L sum_v (S * dS') per key before S and dS' give their bytes to q * dq."""
        C, D = self.C, self.D
        # on the steep path the product's value (of the bytes dA took) is replaced: it gives P^T's coordinates
        acc_pt, cCC = self.scores(sm.k_r, sm.q_l, wtid)
        if steep != 0:
            for e in cutlass.range_constexpr(cute.size(acc_pt)):
                j, i = cCC[e]
                x = cutlass.Float32(0.0)
                if j <= i and i < valid:
                    for d in cutlass.range(D, unroll=1):
                        pair = cute.math.exp2(self.gate_at(sm, i, d) - self.gate_at(sm, j, d), fastmath=True)
                        x = x + sm.q[i, d].to(cutlass.Float32) * sm.k[j, d].to(cutlass.Float32) * pair
                acc_pt[e] = x
        r_pt = self.masked_scores(acc_pt, cCC, None, valid, True, p.scale)
        acc, cTD = self.inter("K", sm.k_f, sm.ds, wtid)
        self.add_intra(acc, r_pt, tiles.mn_plane(sm.do, p.tile_tok_mn), wtid)
        self.store_rows(acc, cTD, p.t.dv, valid, b, t0, h)
        if wtid < D:
            x = cutlass.Float32(0.0)
            for part in cutlass.range_constexpr(PART_THREADS // D):
                x = x + sm.parts[part * D + wtid]
            sm.col_state[wtid] = x * cute.math.exp2(self.gate_at(sm, C - 1, wtid), fastmath=True)
        cute.arch.barrier(barrier_id=Barrier.GRADS_MADE, number_of_threads=self.threads)

    @cute.jit
    def inter_column_sums(self, acc, cTD, sm, ref, warp_in_group, wtid):
        """sum_j k_j * dk^inter_j per key over this warp's 16 rows to ``sm.col_warps[warp_in_group]``, with dk^inter =
        acc (``ref`` None) or 2^(G_ref - G_j) acc: each thread's two rows, then the eight lanes that share its
        columns (lanes 4 apart)."""
        for kc in cutlass.range_constexpr(self.D // 4):
            x = cutlass.Float32(0.0)
            for rr in cutlass.range_constexpr(2):
                e = mma.acc_col_element(kc, rr)
                j, d = cTD[e]
                y = sm.k[j, d].to(cutlass.Float32) * acc[e]
                if cutlass.const_expr(ref is not None):
                    y = y * cute.math.exp2(self.gate_at(sm, ref, d) - self.gate_at(sm, j, d), fastmath=True)
                x = x + y
            for step in cutlass.range_constexpr(3):
                x = x + cute.arch.shuffle_sync_bfly(x, 4 << step)
            _, d = cTD[mma.acc_col_element(kc)]
            if wtid % 32 < 4:
                sm.col_warps[warp_in_group, d] = x

    @cute.jit
    def times_tile(self, acc, cTD, sX, wtid):
        """acc *= x per element, x the bf16 token tile ``sX`` (before the barrier: fewer values live across it)."""
        if cutlass.const_expr(self.tile_copies):
            x = self.tile_fragment(acc, sX, wtid)
            for e in cutlass.range_constexpr(cute.size(acc)):
                acc[e] = acc[e] * x[e].to(cutlass.Float32)
        else:
            for e in cutlass.range_constexpr(cute.size(acc)):
                i, d = cTD[e]
                acc[e] = acc[e] * sX[i, d].to(cutlass.Float32)

    @cute.jit
    def store_fp32(self, dst, acc, cTD):
        """The accumulator to the fp32 tile ``dst`` (:func:`swizzled`)."""
        for e in cutlass.range_constexpr(cute.size(acc)):
            i, d = cTD[e]
            dst[swizzled(i, d, self.D)] = acc[e]

    @cute.jit
    def column_state_parts(self, sm, i):
        """Thread ``i`` of the :data:`PART_THREADS`: sum_v (S * dS') of key channel i % D over part
        i // D of the value rows (PART_THREADS / D parts) to ``sm.parts``; ordered for the dv warpgroup by the
        barrier after the scan."""
        D = self.D
        rows = D // (PART_THREADS // D)
        key, part = i % D, i // D
        x = cutlass.Float32(0.0)
        for j in cutlass.range(rows, unroll=8):
            v = part * rows + j
            x = x + sm.s[v, key].to(cutlass.Float32) * sm.ds[v, key].to(cutlass.Float32)
        sm.parts[part * D + key] = x

    @cute.jit
    def gate_gradient(self, t, sm, valid, tidx, b, t0, h):
        """dg_t = sum_{s >= t} (q * dq - k * dk)_s + the chunk's constant, stored for the valid tokens (zero where the
        raw gate is below the floor), by every thread: thread tidx on key channel tidx % D and segment tidx // D of
        the rows (threads / D segments of ceil(C D / threads) rows): its raw gates loaded first, its segment's sum to
        ``sm.parts``, then, past a barrier, its rows walked from the sum of the later segments."""
        C, D = self.C, self.D
        f32 = cutlass.Float32
        segments = self.threads // D
        span = -(-C // segments)
        key, seg = tidx % D, tidx // D
        first = seg * span
        raw = cute.make_rmem_tensor(cute.make_layout(span), f32)
        self.load_raw_gates(t, raw, first, valid, b, t0, h, key)
        own = f32(0.0)
        for i in cutlass.range_constexpr(span):
            r = first + i
            if r < C:
                own = own + self.gate_gradient_term(sm, r, key)
        sm.parts[tidx] = own
        constant = self.gate_gradient_constant(sm, key)
        cute.arch.sync_threads()  # every segment's sum
        run = f32(0.0)
        for later in cutlass.range_constexpr(1, segments):
            if seg + later < segments:
                run = run + sm.parts[(seg + later) * D + key]
        for rev in cutlass.range_constexpr(span):
            i = span - 1 - rev
            r = first + i
            if r < C:
                run = run + self.gate_gradient_term(sm, r, key)
                if r < valid:
                    self.store_gate_gradient(t, run + constant, raw[i], b, t0, r, h, key)

    @cute.jit
    def load_raw_gates(self, t, raw, r0, valid, b, t0, h, key):
        """The raw gates of rows r0, r0 + 1, .. (as many as ``raw`` holds) on key channel ``key`` into ``raw``, each
        row clamped into the chunk's valid tokens, so that every load is issued at once."""
        for i in cutlass.range_constexpr(cute.size(raw)):
            raw[i] = t.g[b, t0 + cutlass.min(r0 + i, valid - 1), h, key]

    @cute.jit
    def gate_gradient_constant(self, sm, key):
        """dg's per-key constant: 2^G_L sum_v (S * dS') + sum_j (k * dk^inter)_j over the dk warpgroup's warps."""
        constant = sm.col_state[key]
        for w in cutlass.range_constexpr(4):
            constant = constant + sm.col_warps[w, key]
        return constant

    @cute.jit
    def gate_gradient_term(self, sm, r, key):
        """Row r's term of dg's suffix sum on key channel ``key``: (q * dq - k * dk)[r, key]."""
        return sm.x_q[swizzled(r, key, self.D)] - sm.x_k[swizzled(r, key, self.D)]

    @cute.jit
    def store_gate_gradient(self, t, x, raw, b, t0, r, h, key):
        """dg[b, t0 + r, h, key] = ``x``, or 0 where the raw gate ``raw`` is below the floor (no gradient there)."""
        if raw < cutlass.Float32(GATE_FLOOR):
            x = cutlass.Float32(0.0)
        t.dg[b, t0 + r, h, key] = x
