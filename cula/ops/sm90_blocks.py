"""Device building blocks shared by the SM90 (Hopper) chunk kernels of the delta-rule family (GDN, KDA).

All are ``@cute.jit`` functions inlined into the calling kernel:

- :func:`tma_view` / :func:`tma_chunk_tiles`: TMA views of a ``[B, T, heads, D]`` tensor cut in ``C``-token tiles.
- :func:`gemm`: ``acc (+)= A B`` over all k-blocks with wgmma (issued, not waited).
- :func:`acc_to_operand`: a (64 x N) fp32 wgmma accumulator as the bf16 register A operand of the next wgmma.
- :func:`acc_to_operand_split`: the same as a bf16 pair hi + lo that carries the accumulator to ~16 bits.
- :func:`empty_operand`: an uninitialised bf16 register A operand, in the register order of a (64 x N) accumulator.
- :func:`solve_unit_lower`: one column of ``(I + A)^-1`` for a strictly lower ``A`` (the chunk's WY/UT inverse).
"""

import cutlass
import cutlass.cute as cute
from cutlass.cute.nvgpu import cpasync, warpgroup


def tma_view(x):
    """``[B, T, heads, D]`` as ``(T, D, heads, B)``: the tiled modes first, for ``make_tiled_tma_atom``."""
    return cute.make_tensor(
        x.iterator,
        cute.make_layout(
            (x.shape[1], x.shape[3], x.shape[2], x.shape[0]),
            stride=(x.stride[1], x.stride[3], x.stride[2], x.stride[0]),
        ),
    )


@cute.jit
def tma_chunk_tiles(atom, gX, tok0, sX):
    """TMA partition of one head's ``(T, D)`` plane ``gX``, shifted to the sequence start ``tok0`` and cut in the
    ``(C, D)`` tiles of the staged smem tensor ``sX`` ``(C, D, stage)``: ``(smem per stage, gmem per chunk)``."""
    tile = (cute.size(sX, mode=[0]), cute.size(sX, mode=[1]))
    gX = cute.local_tile(cute.domain_offset((tok0, 0), gX), tile, (None, 0))
    return cpasync.tma_partition(atom, 0, cute.make_layout(1), cute.group_modes(sX, 0, 2), cute.group_modes(gX, 0, 2))


@cute.jit
def gemm(tiled_mma, acc, a_frag, b_frag, zero_init: cutlass.Constexpr):
    """acc (+)= A B over all k-blocks of the operands (wgmma, issued not waited)."""
    for kb in cutlass.range_constexpr(cute.size(a_frag, mode=[2])):
        tiled_mma.set(warpgroup.Field.ACCUMULATE, not (zero_init and kb == 0))
        cute.gemm(tiled_mma, acc, a_frag[None, None, kb], b_frag[None, None, kb], acc)


@cute.jit
def acc_to_operand(acc):
    """bf16 copy of a (64 x N) fp32 wgmma accumulator laid out as the register A operand of a (64 x N) x (N x .)
    wgmma: per 8-column block each thread holds (2 cols, 2 rows); an A k-block of 16 is two such blocks, so the
    register order is unchanged and only the layout's grouping differs."""
    n8 = cute.size(acc) // 4
    a_layout = cute.make_layout(((2, 2, 2), 1, n8 // 2), stride=((1, 2, 4), 0, 8))
    frag = cute.make_rmem_tensor(a_layout, cutlass.BFloat16)
    flat = cute.make_tensor(frag.iterator, cute.make_layout(cute.size(acc)))
    acc_flat = cute.make_tensor(acc.iterator, cute.make_layout(cute.size(acc)))
    flat.store(acc_flat.load().to(cutlass.BFloat16))
    return frag


@cute.jit
def acc_to_operand_split(acc):
    """:func:`acc_to_operand` as two bf16 operands, hi = bf16(acc) and lo = bf16(acc - hi): a product taken with
    both (two wgmmas into one accumulator) sees the accumulator to about 16 mantissa bits instead of 8."""
    hi = acc_to_operand(acc)
    n8 = cute.size(acc) // 4
    lo = cute.make_rmem_tensor(cute.make_layout(((2, 2, 2), 1, n8 // 2), stride=((1, 2, 4), 0, 8)), cutlass.BFloat16)
    hi_flat = cute.make_tensor(hi.iterator, cute.make_layout(cute.size(acc)))
    lo_flat = cute.make_tensor(lo.iterator, cute.make_layout(cute.size(acc)))
    acc_flat = cute.make_tensor(acc.iterator, cute.make_layout(cute.size(acc)))
    lo_flat.store((acc_flat.load() - hi_flat.load().to(cutlass.Float32)).to(cutlass.BFloat16))
    return hi, lo


@cute.jit
def empty_operand(n: cutlass.Constexpr):
    """An uninitialised bf16 register A operand of a (64 x N) x (N x .) wgmma holding ``n`` = N / 2 elements per
    thread, in the layout :func:`acc_to_operand` returns: its flat element ``i`` sits at the (row, column) of flat
    element ``i`` of a (64 x N) fp32 accumulator, so a caller fills it from the accumulator's identity partition."""
    n8 = n // 4
    return cute.make_rmem_tensor(cute.make_layout(((2, 2, 2), 1, n8 // 2), stride=((1, 2, 4), 0, 8)), cutlass.BFloat16)


@cute.jit
def solve_unit_lower(sAt, sT, col):
    """Column ``col`` of ``(I + A)^-1`` for a strictly lower (C x C) ``A`` given transposed in ``sAt`` (fp32, rows
    16-byte aligned), written to ``sT`` in bf16. Right-looking forward substitution in fp32: once x_j is final,
    every later row takes its update at once, so the only serial dependence per step is one FMA; A's column j is
    read as broadcast 16-byte vectors. One thread per column."""
    f32 = cutlass.Float32
    C = cute.size(sAt, mode=[0])
    acc = cute.make_rmem_tensor(cute.make_layout(C), f32)
    acc.fill(0.0)
    a4 = cute.make_rmem_tensor(cute.make_layout((1, 4)), f32)
    for j in cutlass.range_constexpr(C):
        xj = -acc[j]
        if j == col:
            xj = f32(1.0) - acc[j]
        acc[j] = xj
        for blk in cutlass.range_constexpr((j + 1) // 4, C // 4):
            cute.autovec_copy(cute.local_tile(sAt, (1, 4), (j, blk)), a4)
            for e in cutlass.range_constexpr(4):
                if 4 * blk + e > j:
                    acc[4 * blk + e] = acc[4 * blk + e] + a4[0, e] * xj
    for i in cutlass.range_constexpr(C):
        sT[i, col] = acc[i].to(cutlass.BFloat16)
