"""wgmma helpers of the SM90 chunk kernels: products over all k-blocks, and fp32 accumulators turned into the bf16
register A operand of the next product.

A (64 x N) fp32 wgmma accumulator gives each thread (2 columns x 2 rows) per 8-column block: flat element ``i`` lies
on row slot :func:`acc_row_slot` and column slot :func:`acc_col_slot` of the thread's 2 rows and N / 4 columns
(plain Python, for unrolled loops).
"""

import cutlass
import cutlass.cute as cute
import cutlass.utils.hopper_helpers as sm90_utils
from cutlass.cute.nvgpu import warpgroup


def tiled_mma(m: int, n: int, b_major: str = "K", a_in_registers: bool = True):
    """A one-warpgroup bf16 x bf16 -> fp32 wgmma of tile (m x n): A from registers (the state, Y, V_new, the left
    operands) or shared memory, B from shared memory K-major or ``b_major="MN"`` (a token tile read transposed)."""
    OM = cute.nvgpu.OperandMajorMode
    source = (warpgroup.OperandSource.RMEM,) if a_in_registers else ()
    bf16 = cutlass.BFloat16
    b = OM.K if b_major == "K" else OM.MN
    return sm90_utils.make_trivial_tiled_mma(bf16, bf16, OM.K, b, cutlass.Float32, (1, 1, 1), (m, n), *source)


@cute.jit
def gemm(tiled_mma, acc, a_frag, b_frag, zero_init: cutlass.Constexpr, k_blocks: cutlass.Constexpr = None):
    """acc (+)= A B over all k-blocks of the operands, or over the k-blocks ``k_blocks`` (a tuple: a product over
    part of the contraction index) (wgmma, issued not waited)."""
    blocks = tuple(range(cute.size(a_frag, mode=[2]))) if k_blocks is None else k_blocks
    for n in cutlass.range_constexpr(len(blocks)):
        tiled_mma.set(warpgroup.Field.ACCUMULATE, not (zero_init and n == 0))
        cute.gemm(tiled_mma, acc, a_frag[None, None, blocks[n]], b_frag[None, None, blocks[n]], acc)


@cute.jit
def gemm_waited(tiled_mma, acc, a_frag, b_frag, zero_init: cutlass.Constexpr, k_blocks: cutlass.Constexpr = None):
    """:func:`gemm` as one wgmma group of its own: registers fenced before it, waited for after it."""
    warpgroup.fence()
    gemm(tiled_mma, acc, a_frag, b_frag, zero_init, k_blocks)
    warpgroup.commit_group()
    warpgroup.wait_group(0)


@cute.jit
def acc_to_operand(acc):
    """bf16 copy of a (64 x N) fp32 wgmma accumulator laid out as the register A operand of a (64 x N) x (N x .)
    wgmma: per 8-column block each thread holds (2 cols, 2 rows); an A k-block of 16 is two such blocks, so the
    register order is unchanged and only the layout's grouping differs."""
    frag = empty_operand(cute.size(acc))
    flat = cute.make_tensor(frag.iterator, cute.make_layout(cute.size(acc)))
    acc_flat = cute.make_tensor(acc.iterator, cute.make_layout(cute.size(acc)))
    flat.store(acc_flat.load().to(cutlass.BFloat16))
    return frag


@cute.jit
def acc_to_operand_split(acc):
    """:func:`acc_to_operand` as two bf16 operands, hi = bf16(acc) and lo = bf16(acc - hi): a product taken with
    both (two wgmmas into one accumulator) sees the accumulator to about 16 mantissa bits instead of 8."""
    hi = acc_to_operand(acc)
    lo = empty_operand(cute.size(acc))
    hi_flat = cute.make_tensor(hi.iterator, cute.make_layout(cute.size(acc)))
    lo_flat = cute.make_tensor(lo.iterator, cute.make_layout(cute.size(acc)))
    acc_flat = cute.make_tensor(acc.iterator, cute.make_layout(cute.size(acc)))
    lo_flat.store((acc_flat.load() - hi_flat.load().to(cutlass.Float32)).to(cutlass.BFloat16))
    return hi, lo


@cute.jit
def frag_to_operand(frag):
    """A bf16 fragment laid out as a (64 x N) accumulator (a token tile's rows read by ldmatrix) as the register A
    operand of a (64 x N) x (N x .) wgmma: the register order is the same (:func:`acc_to_operand`)."""
    op = empty_operand(cute.size(frag))
    flat = cute.make_tensor(op.iterator, cute.make_layout(cute.size(frag)))
    flat.store(cute.make_tensor(frag.iterator, cute.make_layout(cute.size(frag))).load())
    return op


@cute.jit
def empty_operand(n: cutlass.Constexpr):
    """An uninitialised bf16 register A operand of a (64 x N) x (N x .) wgmma holding ``n`` = N / 2 elements per
    thread, in the layout :func:`acc_to_operand` returns: its flat element ``i`` sits at the (row, column) of flat
    element ``i`` of a (64 x N) fp32 accumulator, so a caller fills it from the accumulator's identity partition."""
    n8 = n // 4
    return cute.make_rmem_tensor(cute.make_layout(((2, 2, 2), 1, n8 // 2), stride=((1, 2, 4), 0, 8)), cutlass.BFloat16)


def acc_row_slot(i: int) -> int:
    """Which of its 2 rows a thread's flat element ``i`` of a (64 x N) wgmma accumulator lies on: elements come
    as (2 columns x 2 rows) per 8-column block."""
    return (i // 2) % 2


def acc_col_slot(i: int) -> int:
    """Which of its N / 4 columns (16 for N = 64) flat element ``i`` lies on."""
    return (i % 2) + 2 * (i // 4)


def acc_col_element(kc: int, rr: int = 0) -> int:
    """The flat element on column slot ``kc`` and row slot ``rr`` (the first row's by default): the inverse of
    :func:`acc_col_slot` and :func:`acc_row_slot`."""
    return (kc % 2) + 4 * (kc // 2) + 2 * rr
