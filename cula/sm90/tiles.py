"""Token tiles in shared memory and their TMA copies.

A chunk's token tile is (C, D) bf16 with D contiguous and a 128-byte swizzle (the K-major wgmma operand); the same
bytes read as (D, C) with the MN-major atom serve the products that take a token tile transposed (K in the state
update, V and O through ldmatrix / stmatrix .trans).
"""

import cutlass
import cutlass.cute as cute
from cutlass.cute.nvgpu import cpasync, warpgroup


def token_tiles(C: int, D: int, *stages: int):
    """``(K-major (C, D, *stages), MN-major (D, C, *stages))`` layouts of the same swizzled bytes."""
    bf16 = cutlass.BFloat16
    k_atom = warpgroup.make_smem_layout_atom(warpgroup.SmemLayoutAtomKind.K_SW128, bf16)
    mn_atom = warpgroup.make_smem_layout_atom(warpgroup.SmemLayoutAtomKind.MN_SW128, bf16)
    rest = tuple(range(2, 2 + len(stages)))
    k_major = cute.tile_to_shape(k_atom, (C, D, *stages), order=(0, 1, *rest))
    mn_major = cute.tile_to_shape(mn_atom, (D, C, *stages), order=(1, 0, *rest))
    return k_major, mn_major


def mn_view(tile, mn_layout):
    """The MN-major view (D, C, ...) of the token tile ``tile`` (an smem tensor laid out K-major)."""
    return cute.make_tensor(cute.recast_ptr(tile.iterator, mn_layout.inner), mn_layout.outer)


def mn_plane(tile, mn_layout):
    """The MN-major (N, K) view of the 2-D K-major tile ``tile`` (one stage's plane); ``mn_layout`` its tile's MN
    layout, with or without a stage mode (:func:`token_tiles`)."""
    view = mn_view(tile, mn_layout)
    if cutlass.const_expr(cute.rank(mn_layout.outer) == 3):
        return view[None, None, 0]
    return view


def tma_view(x):
    """``[B, T, heads, D]`` as ``(T, D, heads, B)``: the tiled modes first, for ``make_tiled_tma_atom``."""
    return cute.make_tensor(
        x.iterator,
        cute.make_layout(
            (x.shape[1], x.shape[3], x.shape[2], x.shape[0]),
            stride=(x.stride[1], x.stride[3], x.stride[2], x.stride[0]),
        ),
    )


def state_tma_view(x):
    """The state checkpoints ``[rows, H, V, K]`` as ``(V, K, heads, rows)``: a (D, D) plane per (head, row) in the
    modes :func:`tma_chunk_tiles` cuts, V taking the token's place."""
    return cute.make_tensor(
        x.iterator,
        cute.make_layout(
            (x.shape[2], x.shape[3], x.shape[1], x.shape[0]),
            stride=(x.stride[2], x.stride[3], x.stride[1], x.stride[0]),
        ),
    )


@cute.jit
def tma_chunk_tiles(atom, gX, tok0, sX, column_tile=0):
    """TMA partition of one head's ``(T, D)`` plane ``gX``, shifted to the sequence start ``tok0`` and cut in the
    ``(C, D')`` tiles of the staged smem tensor ``sX`` ``(C, D', stage)`` (the ``column_tile``-th D' columns where the
    tile is narrower than the plane): ``(smem per stage, gmem per chunk)``."""
    tile = (cute.size(sX, mode=[0]), cute.size(sX, mode=[1]))
    gX = cute.local_tile(cute.domain_offset((tok0, 0), gX), tile, (None, column_tile))
    return cpasync.tma_partition(atom, 0, cute.make_layout(1), cute.group_modes(sX, 0, 2), cute.group_modes(gX, 0, 2))


@cute.jit
def row_sum_squares(tile, row, blk0, n_blk: cutlass.Constexpr):
    """Sum of squares (fp32) of the bf16 elements of ``tile`` (a shared-memory (rows x D) tile, swizzle allowed) at
    row ``row``, columns ``[8 blk0, 8 (blk0 + n_blk))``, read 8 at a time (for q / k L2 norms)."""
    frag = cute.make_rmem_tensor(cute.make_layout((1, 8)), cutlass.BFloat16)
    acc = cutlass.Float32(0.0)
    for blk in cutlass.range_constexpr(n_blk):
        cute.autovec_copy(cute.local_tile(tile, (1, 8), (row, blk0 + blk)), frag)
        x = frag.load().to(cutlass.Float32)
        for e in cutlass.range_constexpr(8):
            acc = acc + x[e] * x[e]
    return acc


@cute.jit
def zero_rows_from(tile, first, tid, num_threads: cutlass.Constexpr):
    """Rows ``first`` .. of the bf16 (rows x D) shared-memory ``tile`` (swizzle allowed) set to zero by
    ``num_threads`` threads (``tid`` in [0, num_threads)): the rows of a sequence's last chunk that belong to the
    next sequence. The caller fences and synchronises for the tile's readers."""
    rows, D = cute.size(tile, mode=[0]), cute.size(tile, mode=[1])
    # the whole tile walked, the earlier rows skipped by a predicate: a loop that starts at row ``first`` instead
    # made ptxas spill more in KDA's kernel (PERF.md, "Compiler lessons")
    for idx in cutlass.range(tid, rows * D, num_threads, unroll=1):
        row = idx // D
        if row >= first:
            tile[row, idx % D] = cutlass.BFloat16(0.0)
