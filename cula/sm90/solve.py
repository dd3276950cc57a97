"""The chunk's triangular inverse ``Tinv = (I + A)^-1`` for a strictly lower (64 x 64) ``A`` (the WY/UT inverse of
the delta rule), by 16-blocks: the diagonal blocks by right-looking forward substitution (15 serial steps per column
instead of 63), then two merge levels as warp MMAs in tf32 on warps 0-3.

- On two warpgroups (256 threads): :func:`solve_clear` once, then per chunk :func:`solve_diag16` (warps 0-1) and,
  after a barrier, :func:`solve_merge`.
- On one warpgroup (128 threads): :func:`solve_diag16_per_warp`, a barrier, then :func:`solve_merge_to_bf16`.
"""

import cutlass
import cutlass.cute as cute
from cutlass.cute.nvgpu import warp as warp_mma


@cute.jit
def solve_clear(sT, tid, num_threads: cutlass.Constexpr):
    """Zero the whole (C x C) ``sT`` once per kernel: the blocked solve never writes the blocks above its diagonal
    16-blocks, and wgmma reads them as Tinv's zeros."""
    C = cute.size(sT, mode=[0])
    for it in cutlass.range_constexpr(C * C // num_threads):
        idx = tid + it * num_threads
        sT[idx // C, idx % C] = cutlass.BFloat16(0.0)


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
def solve_diag16_per_warp(sAt, tid):
    """:func:`solve_diag16` for a whole warpgroup, fp32 results only: ``tid`` in [0, 128), warp w inverts diagonal
    16-block w, lanes l and l + 16 both work column l % 16 and lanes below 16 store it. No thread idles, so the
    caller needs no branch around it (ptxas predicates a warp-uniform one instruction by instruction)."""
    f32 = cutlass.Float32
    n = 16
    o = (tid // 32) * n
    col = tid % n
    # r = e_col - (the updates so far): x_j = r[j] once step j is reached. e_col is made from A's zero diagonal:
    # ptxas cannot hoist a shared load out of the chunk loop (the constant e_col it hoisted and spilled)
    zero = sAt[o + col, o + col]
    r = cute.make_rmem_tensor(cute.make_layout(n), f32)
    for i in cutlass.range_constexpr(n):
        r[i] = zero + f32(1.0) if i == col else zero
    a4 = cute.make_rmem_tensor(cute.make_layout((1, 4)), f32)
    for j in cutlass.range_constexpr(n - 1):
        xj = r[j]
        for blk in cutlass.range_constexpr((j + 1) // 4, n // 4):
            cute.autovec_copy(cute.local_tile(sAt, (1, 4), (o + j, o // 4 + blk)), a4)
            for e in cutlass.range_constexpr(4):
                if 4 * blk + e > j:
                    r[4 * blk + e] = r[4 * blk + e] - a4[0, e] * xj
    cute.arch.sync_warp()
    if tid % 32 < n:
        for i in cutlass.range_constexpr(n):
            sAt[o + i, o + col] = r[i]


@cute.jit
def _tf32_operand(view, coords, like, mask: cutlass.Constexpr, flag):
    """A tf32 register operand (laid out as the fragment ``like``) read from ``view``, the fp32 shared-memory operand
    partitioned for this thread; ``coords`` partitions the identity tensor the same way, (row, k) per element.
    ``mask`` zeroes elements: "upper" where row < 16 <= k, "low_k" where k < 16 if ``flag`` (else none)."""
    frag = cute.make_rmem_tensor(like.layout, cutlass.TFloat32)
    for e in cutlass.range_constexpr(cute.size(frag)):
        x = view[e]
        if cutlass.const_expr(mask == "upper"):
            r, k = coords[e]
            if r < 16 and k >= 16:
                x = cutlass.Float32(0.0)
        if cutlass.const_expr(mask == "low_k"):
            _, k = coords[e]
            if flag and k < 16:
                x = cutlass.Float32(0.0)
        frag[e] = x.to(cutlass.TFloat32)
    return frag


@cute.jit
def _mma_tf32(
    tiled_mma, lane, vA, vB, shape_mnk: cutlass.Constexpr, mask_a: cutlass.Constexpr, mask_b: cutlass.Constexpr, flag
):
    """One warp: ``vA`` (M x K) times ``vB`` (given as N x K), fp32 shared-memory views, on the tensor cores in tf32
    (fp32 range, 10-bit mantissa operands, fp32 sums); masks as :func:`_tf32_operand`. Returns the accumulator and
    its element coordinates."""
    M, N, K = shape_mnk
    thr = tiled_mma.get_slice(lane)
    tA = thr.partition_A(vA)
    tB = thr.partition_B(vB)
    cA = thr.partition_A(cute.make_identity_tensor((M, K)))
    cB = thr.partition_B(cute.make_identity_tensor((N, K)))
    fa = _tf32_operand(tA, cA, tiled_mma.make_fragment_A(tA), mask_a, flag)
    fb = _tf32_operand(tB, cB, tiled_mma.make_fragment_B(tB), mask_b, flag)
    acc = cute.make_rmem_tensor(thr.partition_shape_C((M, N)), cutlass.Float32)
    acc.fill(0.0)
    cute.gemm(tiled_mma, acc, fa, fb, acc)
    return acc, thr.partition_C(cute.make_identity_tensor((M, N)))


@cute.jit
def _smem_view(sX, ld: cutlass.Constexpr, row, col, shape: cutlass.Constexpr, row_major: cutlass.Constexpr):
    """``shape`` elements of the row-major ``sX`` (row stride ``ld``) from (row, col): element (x, y) is
    ``sX[row + x, col + y]`` if ``row_major``, else ``sX[row + y, col + x]`` (a transposed read)."""
    stride = (ld, 1) if row_major else (1, ld)
    return cute.make_tensor(sX.iterator + row * ld + col, cute.make_layout(shape, stride=stride))


@cute.jit
def _join_columns(sAt, sT, tiled_mma, lane, a, s: cutlass.Constexpr, stage_row, nt, keep: cutlass.Constexpr):
    """One warp's share of a merge level of :func:`solve_merge`: columns [8 nt, 8 nt + 8) of
    ``T_21 = -T_hi (A_21 T_lo)`` for the diagonal (s x s) inverses T_lo at (a, a) and T_hi at (a + s, a + s) (row-major
    in ``sAt``, A_21 read from A^T), the middle product staged at ``sAt[stage_row + k, 8 nt + n]``. T_21 goes to ``sT``
    (bf16; not when None) and, with ``keep``, into ``sAt`` row-major. At s = 32 the 16-blocks above the diagonal of
    T_lo and T_hi still hold A^T and are masked."""
    ld = cute.size(sAt, mode=[1])  # row stride of sAt
    masked = s == 32
    # M = A_21 T_lo: A_21[i, k] = A[a + s + i, a + k] = sAt[a + k, a + s + i]; T_lo[k, n] = sAt[a + k, a + 8 nt + n]
    acc, cc = _mma_tf32(
        tiled_mma,
        lane,
        _smem_view(sAt, ld, a, a + s, (s, s), False),
        _smem_view(sAt, ld, a, a + 8 * nt, (8, s), False),
        (s, 8, s),
        None,
        "low_k" if masked else None,
        nt >= 2,
    )
    for e in cutlass.range_constexpr(cute.size(acc)):
        i, n = cc[e]
        sAt[stage_row + i, 8 * nt + n] = acc[e]
    cute.arch.sync_warp()
    # T_21 = -T_hi M: T_hi[i, k] = sAt[a + s + i, a + s + k]
    acc, cc = _mma_tf32(
        tiled_mma,
        lane,
        _smem_view(sAt, ld, a + s, a + s, (s, s), True),
        _smem_view(sAt, ld, stage_row, 8 * nt, (8, s), False),
        (s, 8, s),
        "upper" if masked else None,
        None,
        False,
    )
    for e in cutlass.range_constexpr(cute.size(acc)):
        i, n = cc[e]
        if cutlass.const_expr(keep):
            sAt[a + s + i, a + 8 * nt + n] = -acc[e]
        if cutlass.const_expr(sT is not None):
            sT[a + s + i, a + 8 * nt + n] = (-acc[e]).to(cutlass.BFloat16)


@cute.jit
def solve_merge(sAt, sT, tid, barrier_id: cutlass.Constexpr, num_threads: cutlass.Constexpr):
    """Levels 1 and 2 of the blocked inverse, after :func:`solve_diag16` and a barrier of ``num_threads`` (128 or
    256) threads, on warps 0-3 and the tensor cores (warp MMA, tf32 operands, fp32 sums). Each level joins two
    diagonal inverses T_lo, T_hi with ``T_21 = -T_hi (A_21 T_lo)``, a warp per 8 columns of T_21 making both
    products for them (16 -> 32 for both 32-blocks at once, then 32 -> 64), so only warp barriers order a level's
    two products. Results go to ``sT`` (bf16), whose blocks above the diagonal 16-blocks must hold zeros (written
    once by the caller). ``sAt`` is worked in place: level 1's T_21 is kept row-major where A^T's zero half was,
    and products stage in its rows 32-63, columns 0-31. The blocks of A^T above the diagonal that are not yet
    overwritten are masked, not read as zeros."""
    assert num_threads in (128, 256)
    warp = tid // 32
    lane = tid % 32
    tiled = cute.make_tiled_mma(warp_mma.MmaTF32Op((16, 8, 8)), (1, 1, 1))
    # level 1 (warps 0-3): pair p joins diagonal 16-blocks 2p, 2p + 1, staging in rows 32 + 16 p
    if warp < 4:
        _join_columns(sAt, sT, tiled, lane, 32 * (warp // 2), 16, 32 + 16 * (warp // 2), warp % 2, True)
    cute.arch.barrier(barrier_id=barrier_id, number_of_threads=num_threads)
    # level 2 (warps 0-3): the two 32-blocks
    if warp < 4:
        _join_columns(sAt, sT, tiled, lane, 0, 32, 32, warp, False)


@cute.jit
def solve_merge_to_bf16(sAt, sT, tid, barrier_id: cutlass.Constexpr):
    """:func:`solve_merge` on one warpgroup (``tid`` in [0, 128)) after :func:`solve_diag16_per_warp`, writing Tinv to
    ``sT`` (bf16, any swizzle) with no fp32 pass after it: level 1 keeps its T_21 in ``sAt`` (fp32) only; then the
    two diagonal 32-blocks, final, are converted (zeros above their diagonal 16-blocks) while level 2 writes its
    T_21 straight to ``sT``. The 32-block above the diagonal of ``sT`` is never written: it must hold zeros
    (:func:`solve_clear` once). A caller's ``fence.proxy.async`` then orders each thread's own writes: no barrier."""
    warp = tid // 32
    lane = tid % 32
    tiled = cute.make_tiled_mma(warp_mma.MmaTF32Op((16, 8, 8)), (1, 1, 1))
    _join_columns(sAt, None, tiled, lane, 32 * (warp // 2), 16, 32 + 16 * (warp // 2), warp % 2, True)
    cute.arch.barrier(barrier_id=barrier_id, number_of_threads=128)
    # the diagonal 32-blocks: row tid // 2, 16 columns from 32 (row // 32) + 16 (tid % 2), as 2 x 8 bf16
    r = tid // 2
    q0 = 4 * (r // 32) + 2 * (tid % 2)  # first 4-float (and 8-bf16 / 2) group of the row's 16 columns
    f4 = cute.make_rmem_tensor(cute.make_layout((1, 4)), cutlass.Float32)
    out = cute.make_rmem_tensor(cute.make_layout((1, 8)), cutlass.BFloat16)
    for h8 in cutlass.range_constexpr(2):
        for h4 in cutlass.range_constexpr(2):
            cute.autovec_copy(cute.local_tile(sAt, (1, 4), (r, 2 * (q0 + h8) + h4)), f4)
            for e in cutlass.range_constexpr(4):
                x = f4[0, e]
                if (tid % 2) * 16 > r % 32:  # the upper 16-block of a diagonal 32-block
                    x = cutlass.Float32(0.0)
                out[0, 4 * h4 + e] = x.to(cutlass.BFloat16)
        cute.autovec_copy(out, cute.local_tile(sT, (1, 8), (r, q0 + h8)))
    _join_columns(sAt, sT, tiled, lane, 0, 32, 32, warp, False)
