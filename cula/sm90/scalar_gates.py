"""Device helpers of the scalar-gate kernel (:mod:`cula.sm90.scalar_chunk_fwd`): a chunk's gates loaded and
published to a gate slot (G in log2 units, beta, 2^G and 2^(G_last - G) per token), and the gates at a thread's rows
and columns of a (C x C) wgmma accumulator."""

import math

import cutlass
import cutlass.cute as cute

from cula.ops.gates import GATE_FLOOR
from cula.sm90 import mma

_LOG2E = math.log2(math.e)


@cute.jit
def gates_at(cCC, row_g, row_b, col_g, slot):
    """Per-token values at this thread's 2 accumulator rows and 16 columns of a (C x C) tile (mma.acc_row_slot /
    acc_col_slot): ``row_g`` and ``row_b`` at its rows, ``col_g`` at its columns (each (C, slots), read in ``slot``)."""
    f32 = cutlass.Float32
    g_r = cute.make_rmem_tensor(cute.make_layout(2), f32)
    b_r = cute.make_rmem_tensor(cute.make_layout(2), f32)
    g_c = cute.make_rmem_tensor(cute.make_layout(16), f32)
    for rr in cutlass.range_constexpr(2):
        r, _ = cCC[2 * rr]  # the first element on row slot rr
        g_r[rr] = row_g[r, slot]
        b_r[rr] = row_b[r, slot]
    for kc in cutlass.range_constexpr(16):
        _, j = cCC[mma.acc_col_element(kc)]
        g_c[kc] = col_g[j, slot]
    return g_r, b_r, g_c


@cute.jit
def row_col_gates(sG, sBeta, sNorm, cCC, slot, qk_l2norm: cutlass.Constexpr):
    """:func:`gates_at` of G and beta per row, G per column. With qk_l2norm the row's 1 / ||k|| joins beta and the
    column's log2 ||k|| joins G (2^(G_r - G_c - log2 ||k_c||))."""
    g_r, b_r, g_c = gates_at(cCC, sG, sBeta, sG, slot)
    if cutlass.const_expr(qk_l2norm):
        for rr in cutlass.range_constexpr(2):
            r, _ = cCC[2 * rr]
            b_r[rr] = b_r[rr] * sNorm[r, 0]
        for kc in cutlass.range_constexpr(16):
            _, j = cCC[mma.acc_col_element(kc)]
            g_c[kc] = g_c[kc] + sNorm[j, 1]
    return g_r, b_r, g_c


@cute.jit
def load_gates(gG, gBeta, tok0, seqlen, chunk, lane, C: cutlass.Constexpr):
    """Raw gates of one chunk, two tokens per lane, from one head's gates ``gG`` / ``gBeta`` (``mG[b, None, hv]``:
    sliced once, outside the chunk loop, they cost the gate warp fewer registers). The token index is clamped into
    the sequence instead of branching, so the loads stay in flight until :meth:`publish_gates` uses them (needs
    seqlen >= 1). Without beta (``gBeta`` None: no delta rule) beta is 1."""
    t = chunk * C + lane
    t_lo = tok0 + cutlass.min(t, seqlen - 1)
    t_hi = tok0 + cutlass.min(t + 32, seqlen - 1)
    if cutlass.const_expr(gBeta is None):
        return gG[t_lo], gG[t_hi], cutlass.Float32(1.0), cutlass.Float32(1.0)
    return gG[t_lo], gG[t_hi], gBeta[t_lo], gBeta[t_hi]


@cute.jit
def publish_gates(sG, sBeta, sFac, slot, gates, chunk, seqlen, lane, C: cutlass.Constexpr):
    """Inclusive prefix sum of g over the chunk (warp scan), stored in log2 units, with beta and the per-token
    factors 2^G_t and 2^(G_last - G_t); tokens past the sequence end get g = 0, beta = 0 and a zero second
    factor (G is flat past the end, so G_last is the chunk's total). Gates below :data:`GATE_FLOOR` (-inf too)
    are taken at the floor."""
    f32 = cutlass.Float32
    g_lo, g_hi, b_lo, b_hi = gates
    t = chunk * C + lane
    zero = f32(0.0)
    g_lo = cutlass.max(g_lo, f32(GATE_FLOOR)) if t < seqlen else zero
    g_hi = cutlass.max(g_hi, f32(GATE_FLOOR)) if t + 32 < seqlen else zero
    b_lo = b_lo.to(f32) if t < seqlen else zero
    b_hi = b_hi.to(f32) if t + 32 < seqlen else zero
    g_lo, g_hi = warp_scan_64(g_lo, g_hi, lane, False)
    sG[lane, slot] = g_lo * _LOG2E
    sG[lane + 32, slot] = g_hi * _LOG2E
    sBeta[lane, slot] = b_lo
    sBeta[lane + 32, slot] = b_hi
    G_lo, G_hi = g_lo * _LOG2E, g_hi * _LOG2E
    G_last = cute.arch.shuffle_sync(G_hi, 31)
    sFac[lane, slot, 0] = cute.math.exp2(G_lo, fastmath=True)
    sFac[lane + 32, slot, 0] = cute.math.exp2(G_hi, fastmath=True)
    sFac[lane, slot, 1] = cute.math.exp2(G_last - G_lo, fastmath=True) if t < seqlen else zero
    sFac[lane + 32, slot, 1] = cute.math.exp2(G_last - G_hi, fastmath=True) if t + 32 < seqlen else zero


@cute.jit
def warp_scan_64(lo, hi, lane, suffix: cutlass.Constexpr):
    """Inclusive sums over 64 values held two per lane (``lo`` at place lane, ``hi`` at lane + 32): prefix sums
    (places 0 .. i), or with ``suffix`` the sums from place i to the last, each summed from its own end (no
    difference of two large totals)."""
    for i in cutlass.range_constexpr(5):
        if cutlass.const_expr(suffix):
            nxt_lo = cute.arch.shuffle_sync_down(lo, 1 << i)
            nxt_hi = cute.arch.shuffle_sync_down(hi, 1 << i)
            if lane + (1 << i) < 32:
                lo = lo + nxt_lo
                hi = hi + nxt_hi
        else:
            up_lo = cute.arch.shuffle_sync_up(lo, 1 << i)
            up_hi = cute.arch.shuffle_sync_up(hi, 1 << i)
            if lane >= (1 << i):
                lo = lo + up_lo
                hi = hi + up_hi
    if cutlass.const_expr(suffix):
        lo = lo + cute.arch.shuffle_sync(hi, 0)
    else:
        hi = hi + cute.arch.shuffle_sync(lo, 31)
    return lo, hi
