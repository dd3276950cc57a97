"""Device building blocks shared by the SM90 (Hopper) chunk kernels of the delta-rule family (GDN, KDA).

All are ``@cute.jit`` functions inlined into the calling kernel:

- :func:`tma_view` / :func:`tma_chunk_tiles`: TMA views of a ``[B, T, heads, D]`` tensor cut in ``C``-token tiles.
- :func:`gemm`: ``acc (+)= A B`` over all k-blocks with wgmma (issued, not waited).
- :func:`acc_to_operand`: a (64 x N) fp32 wgmma accumulator as the bf16 register A operand of the next wgmma.
- :func:`acc_to_operand_split`: the same as a bf16 pair hi + lo that carries the accumulator to ~16 bits.
- :func:`empty_operand`: an uninitialised bf16 register A operand, in the register order of a (64 x N) accumulator.
- :func:`solve_unit_lower`: one column of ``(I + A)^-1`` for a strictly lower ``A`` (the chunk's WY/UT inverse).
- :func:`solve_diag16` then :func:`solve_merge`: the same inverse by 16-blocks, on 64 then 256 threads (15 serial
  steps per column instead of 63; measured on the H200 in the GDN kernel: ~2 us less per chunk).
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


@cute.jit
def solve_diag16(sAt, sT, tid):
    """Level 0 of the blocked ``(I + A)^-1`` (64 x 64, A strictly lower, given transposed in ``sAt``: fp32,
    ``sAt[j, i] = A[i, j]``, rows 16-byte aligned). ``tid`` in [0, 64) inverts column ``tid % 16`` of diagonal
    16-block ``tid // 16`` by right-looking forward substitution (15 steps instead of 63 for the whole matrix) and
    writes it to ``sT`` (bf16) and, fp32 and row-major, over that diagonal block of ``sAt``. Only the block's own
    16 threads (half a warp) read that block, so a warp barrier orders the overwrite. :func:`solve_merge` follows
    after a CTA barrier."""
    f32 = cutlass.Float32
    n = 16
    o = (tid // n) * n
    col = tid % n
    acc = cute.make_rmem_tensor(cute.make_layout(n), f32)
    acc.fill(0.0)
    a4 = cute.make_rmem_tensor(cute.make_layout((1, 4)), f32)
    for j in cutlass.range_constexpr(n):
        xj = -acc[j]
        if j == col:
            xj = f32(1.0) - acc[j]
        acc[j] = xj
        for blk in cutlass.range_constexpr((j + 1) // 4, n // 4):
            cute.autovec_copy(cute.local_tile(sAt, (1, 4), (o + j, o // 4 + blk)), a4)
            for e in cutlass.range_constexpr(4):
                if 4 * blk + e > j:
                    acc[4 * blk + e] = acc[4 * blk + e] + a4[0, e] * xj
    cute.arch.sync_warp()
    for i in cutlass.range_constexpr(n):
        sAt[o + i, o + col] = acc[i]
        sT[o + i, o + col] = acc[i].to(cutlass.BFloat16)


@cute.jit
def solve_merge(sAt, sT, tid, barrier_id: cutlass.Constexpr, num_threads: cutlass.Constexpr):
    """Levels 1 and 2 of the blocked inverse, on 256 threads after :func:`solve_diag16` and a CTA barrier: each
    level joins two diagonal inverses T_lo, T_hi with ``T_21 = -T_hi (A_21 T_lo)`` (16 -> 32, both 32-blocks at
    once; then 32 -> 64), as fp32 products on CUDA cores, 4 columns per thread. Results go to ``sT`` (bf16),
    whose blocks above the diagonal 16-blocks must hold zeros (written once by the caller). ``sAt`` is worked in
    place: T's blocks are kept row-major where A^T's zero half was; products stage in its rows 32-63, columns
    0-31. The blocks of A^T above the diagonal that are not yet overwritten are skipped, not read as zeros."""
    assert num_threads == 256
    f32 = cutlass.Float32
    bf16 = cutlass.BFloat16
    t4 = cute.make_rmem_tensor(cute.make_layout((1, 4)), f32)
    acc = cute.make_rmem_tensor(cute.make_layout(4), f32)
    # ---- level 1 (threads 0-127): pair p joins diagonal blocks 2p, 2p + 1 at offset a
    p = tid // 64
    a = p * 32
    i1 = (tid // 4) % 16
    c1 = tid % 4
    if tid < 128:
        acc.fill(0.0)
        for k in cutlass.range_constexpr(16):
            aik = sAt[a + k, a + 16 + i1]  # A[a + 16 + i, a + k]
            cute.autovec_copy(cute.local_tile(sAt, (1, 4), (a + k, a // 4 + c1)), t4)
            for e in cutlass.range_constexpr(4):
                acc[e] = acc[e] + aik * t4[0, e]
        for e in cutlass.range_constexpr(4):
            sAt[32 + 16 * p + i1, 4 * c1 + e] = acc[e]
    cute.arch.barrier(barrier_id=barrier_id, number_of_threads=num_threads)
    if tid < 128:
        acc.fill(0.0)
        for k in cutlass.range_constexpr(16):
            tik = sAt[a + 16 + i1, a + 16 + k]
            cute.autovec_copy(cute.local_tile(sAt, (1, 4), (32 + 16 * p + k, c1)), t4)
            for e in cutlass.range_constexpr(4):
                acc[e] = acc[e] - tik * t4[0, e]
        for e in cutlass.range_constexpr(4):
            sAt[a + 16 + i1, a + 4 * c1 + e] = acc[e]
            sT[a + 16 + i1, a + 4 * c1 + e] = acc[e].to(bf16)
    cute.arch.barrier(barrier_id=barrier_id, number_of_threads=num_threads)
    # ---- level 2 (all threads): rows 32 + i2 of columns 4 c2 .. 4 c2 + 3
    i2 = tid // 8
    c2 = tid % 8
    acc.fill(0.0)
    for k in cutlass.range_constexpr(32):
        aik = sAt[k, 32 + i2]  # A[32 + i, k]
        if cutlass.const_expr(k < 16):
            if c2 >= 4:  # T_lo[k, j] = 0 for k < 16 <= j: there sAt still holds A^T
                aik = f32(0.0)
        cute.autovec_copy(cute.local_tile(sAt, (1, 4), (k, c2)), t4)
        for e in cutlass.range_constexpr(4):
            acc[e] = acc[e] + aik * t4[0, e]
    for e in cutlass.range_constexpr(4):
        sAt[32 + i2, 4 * c2 + e] = acc[e]
    cute.arch.barrier(barrier_id=barrier_id, number_of_threads=num_threads)
    acc.fill(0.0)
    for k in cutlass.range_constexpr(32):
        tik = sAt[32 + i2, 32 + k]
        if cutlass.const_expr(k >= 16):
            if i2 < 16:  # T_hi[i, k] = 0 for i < 16 <= k (A^T there)
                tik = f32(0.0)
        cute.autovec_copy(cute.local_tile(sAt, (1, 4), (32 + k, c2)), t4)
        for e in cutlass.range_constexpr(4):
            acc[e] = acc[e] - tik * t4[0, e]
    for e in cutlass.range_constexpr(4):
        sT[32 + i2, 4 * c2 + e] = acc[e].to(bf16)
