"""tcgen05 helpers of the SM100 chunk kernels: tiled MMAs, their operand fragments and accumulators, and products over
all k-blocks. Operand tiles in shared memory are the SM90 family's (:func:`cula.sm90.tiles.token_tiles`): the
128-byte-swizzled K- and MN-major atoms are tcgen05's canonical layouts as they are wgmma's."""

from __future__ import annotations

import cutlass
import cutlass.cute as cute
import cutlass.utils.blackwell_helpers as sm100_utils
from cutlass.cute.nvgpu import tcgen05

M = 128  # every product's M: one TMEM lane per row, one thread of a warpgroup per lane


def tiled_mma(a_major: str, b_major: str, n: int):
    """A one-CTA bf16 x bf16 -> fp32 tcgen05 MMA of tile (M x n), both operands from shared memory, each ``"K"``- or
    ``"MN"``-major."""
    OM = tcgen05.OperandMajorMode
    bf16 = cutlass.BFloat16
    return sm100_utils.make_trivial_tiled_mma(
        bf16,
        OM.K if a_major == "K" else OM.MN,
        OM.K if b_major == "K" else OM.MN,
        cutlass.Float32,
        tcgen05.CtaGroup.ONE,
        (M, n),
        tcgen05.OperandSource.SMEM,
    )


def operands(mma, a, b):
    """The MMA's descriptor fragments of the smem tensors ``a`` (M x K) and ``b`` (N x K)."""
    thr = mma.get_slice(0)
    return mma.make_fragment_A(thr.partition_A(a)), mma.make_fragment_B(thr.partition_B(b))


def accumulator(mma, n: int, tmem_base, column: int):
    """The (M x n) fp32 accumulator of ``mma`` at TMEM ``column``."""
    layout = mma.make_fragment_C(mma.partition_shape_C((M, n))).layout
    return cute.make_tensor(tmem_base + column, layout)


@cute.jit
def gemm(mma, acc, a, b, zero_init: cutlass.Constexpr):
    """acc (+)= A B over the k-blocks of the operand fragments (issued by the calling warp, not waited: a commit
    tracks it). The k-blocks after the first run in a loop that is not unrolled: each block's shared-memory
    descriptors are then made from its index where it is issued, instead of all of them held at once in uniform
    registers (a kernel with several products spills them)."""
    mma.set(tcgen05.Field.ACCUMULATE, not zero_init)
    cute.gemm(mma, acc, a[None, None, 0], b[None, None, 0], acc)
    mma.set(tcgen05.Field.ACCUMULATE, True)
    for kb in cutlass.range(1, cute.size(a, mode=[2]), unroll=1):
        cute.gemm(mma, acc, a[None, None, kb], b[None, None, kb], acc)
