"""Tensor memory (TMEM) as the SM100 chunk kernels use it: a warpgroup's row access to an (M x N) fp32
accumulator, and the fences that order tcgen05 operations across the hand-offs between roles.

A warp reaches only TMEM lanes 32 (warp % 4) .. + 31, so a role of one warpgroup owns all M = 128 lanes: thread
``tid`` the accumulator's row ``tid``. It moves its row 16 columns at a time (tcgen05.ld / st 32x32b.x16: a lane's 16
consecutive columns in 16 consecutive registers). With 32 at a time ptxas spilled: each copy takes 32 registers in
one aligned run, and the state warpgroup holds a loaded and a decayed block at once.
"""

from __future__ import annotations

import cutlass
import cutlass.cute as cute
from cutlass import pipeline
from cutlass.cute.nvgpu import tcgen05
from cutlass.experimental import primitives

from cula.sm100 import mma
from cula.sm100.roles import THREADS, Barrier

COLUMNS_PER_COPY = 16
_REPETITION = tcgen05.Repetition.x16


class Rows:
    """Thread ``tid``'s row of the (M x N) fp32 TMEM accumulator ``acc``, in blocks of ``COLUMNS_PER_COPY``
    columns."""

    def __init__(self, acc, n: int, tid):
        f32 = cutlass.Float32
        tiler = ((cute.size(acc, mode=[0, 0]), COLUMNS_PER_COPY),)
        blocks = cute.zipped_divide(acc, tiler)
        self.load = tcgen05.make_tmem_copy(cute.make_copy_atom(tcgen05.Ld32x32bOp(_REPETITION), f32), blocks[None, 0])
        self.store = tcgen05.make_tmem_copy(cute.make_copy_atom(tcgen05.St32x32bOp(_REPETITION), f32), blocks[None, 0])
        thr_load = self.load.get_slice(tid)
        self.src = thr_load.partition_S(blocks)  # (copy, copies, N / COLUMNS_PER_COPY)
        self.dst = self.store.get_slice(tid).partition_D(blocks)
        # element coordinates; a fresh tiled MMA for them, as the kernel's own are mutated (their accumulate flag) in
        # the MMA warp's branch, which the other roles' branches cannot see
        coords = mma.tiled_mma("K", "K", n).get_slice(0).partition_C(cute.make_identity_tensor((mma.M, n)))
        self.coords = thr_load.partition_D(cute.zipped_divide(coords, tiler))

    def row(self):
        """This thread's row of the accumulator."""
        r, _ = self.coords[0]
        return r


# (functions, not methods: a DSL loop would have to carry an object whose method it calls)
def fragment(rows: Rows):
    """Registers for one block of columns (shaped as the copy's register side: the TMEM side's partition has
    TMEM's own shape). Made where it is used: one live across a chunk loop is kept in local memory."""
    return cute.make_rmem_tensor(rows.coords[None, None, 0].shape, cutlass.Float32)


def read(rows: Rows, block: int, frag):
    """Block ``block`` of the thread's row (columns ``COLUMNS_PER_COPY block`` ..) into ``frag``, waited."""
    cute.copy(rows.load, rows.src[None, None, block], frag)
    cute.arch.fence_view_async_tmem_load()


def write(rows: Rows, block: int, frag):
    """``frag`` into block ``block`` of the thread's row (issued; :func:`stores_done` waits)."""
    cute.copy(rows.store, frag, rows.dst[None, None, block])


def stores_done():
    """Wait for this thread's TMEM stores."""
    cute.arch.fence_view_async_tmem_store()


def before_handoff():
    """This thread's completed tcgen05 operations (TMEM reads and writes) ordered before its next arrive on a hand-off
    barrier."""
    primitives.tcgen05_fence(primitives.Tcgen05Fence.BEFORE_THREAD_SYNC)


def after_handoff():
    """The tcgen05 operations after a wait on a hand-off barrier ordered after what the other side did before it."""
    primitives.tcgen05_fence(primitives.Tcgen05Fence.AFTER_THREAD_SYNC)


@cute.jit
def store_row_bf16(tile, row, col0, frag):
    """The fp32 values of ``frag`` (columns ``col0`` ..) rounded to bf16 into row ``row`` of the swizzled smem
    ``tile``, 16 bytes at a time."""
    packed = cute.make_rmem_tensor(cute.make_layout((1, 8)), cutlass.BFloat16)
    for blk in cutlass.range_constexpr(COLUMNS_PER_COPY // 8):
        for e in cutlass.range_constexpr(8):
            packed[0, e] = frag[8 * blk + e].to(cutlass.BFloat16)
        cute.autovec_copy(packed, cute.local_tile(tile, (1, 8), (row, col0 // 8 + blk)))


@cute.jit
def store_row_split(hi_tile, lo_tile, row, col0, frag):
    """The fp32 values of ``frag`` (columns ``col0`` ..) as bf16 hi + lo pairs (hi = bf16(x), lo = bf16(x - hi): about
    16 mantissa bits between them, summed by the products that read both) into row ``row`` of the swizzled smem
    tiles ``hi_tile`` and ``lo_tile``, 16 bytes at a time."""
    hi = cute.make_rmem_tensor(cute.make_layout((1, 8)), cutlass.BFloat16)
    lo = cute.make_rmem_tensor(cute.make_layout((1, 8)), cutlass.BFloat16)
    for blk in cutlass.range_constexpr(COLUMNS_PER_COPY // 8):
        for e in cutlass.range_constexpr(8):
            x = frag[8 * blk + e]
            hi[0, e] = x.to(cutlass.BFloat16)
            lo[0, e] = (x - hi[0, e].to(cutlass.Float32)).to(cutlass.BFloat16)
        cute.autovec_copy(hi, cute.local_tile(hi_tile, (1, 8), (row, col0 // 8 + blk)))
        cute.autovec_copy(lo, cute.local_tile(lo_tile, (1, 8), (row, col0 // 8 + blk)))


def allocate(address, columns: int, allocator_warp: int):
    """``columns`` TMEM columns allocated by warp ``allocator_warp``, their address published through the shared
    ``address`` to every thread of the CTA (all of them wait for it): ``(the allocator, the base address)``."""
    allocator = cutlass.memory.TmemAllocator(
        address,
        barrier_for_retrieve=pipeline.NamedBarrier(barrier_id=Barrier.TMEM_ALLOC, num_threads=THREADS),
        allocator_warp_id=allocator_warp,
    )
    allocator.allocate(columns)
    allocator.wait_for_alloc()
    return allocator, allocator.retrieve_ptr(cutlass.Float32)


@cute.jit
def free(allocator, base, warp, allocator_warp: cutlass.Constexpr):
    """Every thread's TMEM accesses done (a CTA barrier), then the columns given back by the allocator warp."""
    cute.arch.barrier(barrier_id=Barrier.TMEM_FREE, number_of_threads=THREADS)
    if warp == allocator_warp:
        after_handoff()
        allocator.relinquish_alloc_permit()
        allocator.free(base)
