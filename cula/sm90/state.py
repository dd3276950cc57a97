"""The fp32 state held as S^T in a warpgroup's wgmma accumulator: value rows ``[row0, row0 + 64)`` of S^T (V x K)
over all K key columns. Initial states are read and final states written straight between the accumulator and
global memory (``[N, HV, K, V]``, or its transposed view for ``state_v_first`` storage), fp32 or a bf16 pool's."""

import cutlass
import cutlass.cute as cute

from cula.sm90 import mma


@cute.jit
def init_state(acc_s, cST, mH0, n, hv, row0, start: cutlass.Constexpr):
    """``acc_s`` at the sequence start: ``start`` "zero", "identity" (S = I: a split's transition pass) or "given"
    (``mH0[n, hv]``)."""
    if cutlass.const_expr(start == "given"):
        load_state(acc_s, cST, mH0, n, hv, row0)
    elif cutlass.const_expr(start == "identity"):
        for i in cutlass.range_constexpr(cute.size(acc_s)):
            rh, kh = cST[i]
            acc_s[i] = cutlass.Float32(1.0) if kh == row0 + rh else cutlass.Float32(0.0)
    else:
        acc_s.fill(0.0)


@cute.jit
def load_state(acc_s, cST, mH0, n, hv, row0):
    """``acc_s``: this warpgroup's value rows ``[row0, row0 + 64)`` of S^T (fp32 wgmma accumulator with element
    coordinates ``cST``), read from ``mH0[n, hv]`` indexed (K, V)."""
    for i in cutlass.range_constexpr(cute.size(acc_s)):
        rh, kh = cST[i]
        acc_s[i] = mH0[n, hv, kh, row0 + rh].to(cutlass.Float32)


@cute.jit
def store_state(acc_s, cST, mHt, n, hv, row0):
    """The inverse of :func:`load_state`: ``acc_s`` to ``mHt[n, hv]``."""
    for i in cutlass.range_constexpr(cute.size(acc_s)):
        rf, kf = cST[i]
        mHt[n, hv, kf, row0 + rf] = acc_s[i].to(mHt.element_type)


@cute.jit
def store_checkpoint(acc_s, cST, mW, row, hv, row0):
    """``acc_s`` rounded to bf16 into ``mW[row, hv]`` indexed (V, K): the backward's per-chunk checkpoints, stored as
    the accumulator holds S^T. Each of the thread's two rows through one row address, its adjacent column pairs as
    one 4-byte store each (per element, the addresses and 2-byte stores were a sixth of a state walk's
    instructions)."""
    pair = cute.make_rmem_tensor(cute.make_layout(2), cutlass.BFloat16)
    for rr in cutlass.range_constexpr(2):
        rf, _ = cST[mma.acc_col_element(0, rr)]
        dst = mW[row, hv, row0 + rf, None]
        for kp in cutlass.range_constexpr(cute.size(acc_s) // 4):
            e = mma.acc_col_element(2 * kp, rr)
            _, kf = cST[e]
            pair[0] = acc_s[e].to(cutlass.BFloat16)
            pair[1] = acc_s[e + 1].to(cutlass.BFloat16)
            cute.autovec_copy(pair, cute.local_tile(dst, (2,), (kf // 2,)))
