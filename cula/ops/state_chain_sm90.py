"""The start states of a split sequence's later segments, made on the GPU in one launch (CuTe DSL, SIMT fp32).

A sequence cut into segments 0 .. m-1 (:mod:`cula.ops.segment_split`): the first pass leaves each segment's local
end state L_i (walked from a zero start; segment 0 from the sequence's initial state) and the transition pass each
middle segment's map M_i, so that S_end(i) = M_i S_start(i) + L_i. The later segments start from

    S_start(1) = L_0,    S_start(i + 1) = M_i S_start(i) + L_i.

A chain of m - 1 dependent (K x K) x (K x V) fp32 products: one CTA per (column block of VB state columns, head,
chain) walks it with the block in registers, thread ``k`` owning row ``k``; the previous start is shared through
shared memory and each thread reads its row of M_i straight from global memory (all CTAs of a head read the same
M_i, so L2 serves them). Replaces a PyTorch loop of one batched product per link, whose host time (two ops per
link) made split calls host-bound. Without the delta rule each M_i is diagonal, the decay of segment i's gates per
key (``diagonal``): a link is then S = d_i * S + L_i on each thread's own row, with no shared memory and no barrier.

Shapes: local [S, HV, K, V] fp32; trans [S_t, HV, K, K] fp32, or diagonal [S_t, HV, K]; starts (written) [S_c, HV,
K, V] fp32; K = V = 64 or 128. The plan, int32: ``offsets`` [chains + 1] into ``rows`` [R, 3]; a chain's first row
names the local index of its first segment, every further row one later segment as (local index, trans index or -1
for the chain's last segment, slot in ``starts``). Runs on SM80 and later; compiled for sm_90a, sm_100a and sm_103a.
"""

import cutlass
import cutlass.cute as cute
import torch

from cula import runtime

SUPPORTED_DIMS = (64, 128)
COLS = 8  # state columns per CTA: 16 CTAs per head at V = 128 fill the SMs at 8 heads


class StateChain:
    """One CTA per (column block, head, chain), ``head_dim`` threads (thread k: row k of the column block);
    ``diagonal``: the transitions are per-key decays (module docstring)."""

    def __init__(self, head_dim: int = 128, diagonal: bool = False):
        assert head_dim in SUPPORTED_DIMS
        self.D = head_dim
        self.diagonal = diagonal
        self.VB = COLS
        self.threads = head_dim

    # ---------------------------------------------------------------- host side
    @cute.jit
    def __call__(self, local, trans, starts, offsets, rows, stream):
        HV = local.shape[1]
        chains = offsets.shape[0] - 1
        smem = 0 if self.diagonal else self.D * self.VB * 4
        self.kernel(local, trans, starts, offsets, rows).launch(
            grid=(self.D // self.VB, HV, chains), block=(self.threads, 1, 1), smem=smem, stream=stream
        )

    # ---------------------------------------------------------------- device side
    @cute.kernel
    def kernel(self, mLocal, mTrans, mStarts, mOffsets, mRows):
        D, VB = self.D, self.VB
        f32 = cutlass.Float32
        k, _, _ = cute.arch.thread_idx()
        cb, h, c = cute.arch.block_idx()

        sS = None
        if cutlass.const_expr(not self.diagonal):
            smem = cutlass.memory.SmemAllocator()
            # the current start's column block, every row: each thread's product reads all of it
            sS = smem.allocate_tensor(f32, cute.make_layout((D, VB), stride=(VB, 1)), byte_alignment=16)

        r0 = mOffsets[c]
        r1 = mOffsets[c + 1]
        state = cute.make_rmem_tensor(cute.make_layout(VB), f32)
        cute.autovec_copy(_block_row(mLocal, mRows[r0, 0], h, k, cb, VB), state)
        acc = cute.make_rmem_tensor(cute.make_layout(VB), f32)
        m8 = cute.make_rmem_tensor(cute.make_layout(8), f32)
        s8 = cute.make_rmem_tensor(cute.make_layout(VB), f32)
        for r in cutlass.range(r0 + 1, r1):
            cute.autovec_copy(state, _block_row(mStarts, mRows[r, 2], h, k, cb, VB))
            t = mRows[r, 1]
            if t >= 0:
                if cutlass.const_expr(self.diagonal):
                    cute.autovec_copy(_block_row(mLocal, mRows[r, 0], h, k, cb, VB), acc)
                    decay = mTrans[t, h, k]
                    for e in cutlass.range_constexpr(VB):
                        state[e] = acc[e] + decay * state[e]
                else:
                    cute.arch.sync_threads()  # every thread is done reading the previous start
                    cute.autovec_copy(state, sS[k, None])
                    cute.arch.sync_threads()
                    cute.autovec_copy(_block_row(mLocal, mRows[r, 0], h, k, cb, VB), acc)
                    m_row = mTrans[t, h, k, None]
                    for j0 in cutlass.range(0, D, 8, unroll=2):
                        cute.autovec_copy(cute.local_tile(m_row, (8,), (j0 // 8,)), m8)
                        for jj in cutlass.range_constexpr(8):
                            cute.autovec_copy(sS[j0 + jj, None], s8)
                            for e in cutlass.range_constexpr(VB):
                                acc[e] = acc[e] + m8[jj] * s8[e]
                    for e in cutlass.range_constexpr(VB):
                        state[e] = acc[e]


@cute.jit
def _block_row(mX, i, h, k, cb, VB: cutlass.Constexpr):
    """Row ``k`` of column block ``cb`` of ``mX[i, h]``: VB contiguous fp32."""
    return cute.local_tile(mX[i, h, k, None], (VB,), (cb,))


# -------------------------------------------------------------------- compile + Python entry
def compile_state_chain(arch="sm_90a", keep_artifacts=False, head_dim=128, diagonal=False):
    D = head_dim
    f32, i32 = cutlass.Float32, cutlass.Int32
    hv = runtime.sym_int()
    trans_shape = (runtime.sym_int(), hv, D) if diagonal else (runtime.sym_int(), hv, D, D)
    fake = (
        runtime.fake_tensor(f32, (runtime.sym_int(), hv, D, D)),
        runtime.fake_tensor(f32, trans_shape),
        runtime.fake_tensor(f32, (runtime.sym_int(), hv, D, D)),
        runtime.fake_tensor(i32, (runtime.sym_int(),), align=4),
        runtime.fake_tensor(i32, (runtime.sym_int(), 3), align=4),
        runtime.fake_stream(),
    )
    return runtime.compile_kernel(StateChain(D, diagonal), fake, arch, keep_artifacts)


def chain_starts(local: torch.Tensor, trans: torch.Tensor | None, starts: torch.Tensor, offsets, rows) -> None:
    """Write ``starts`` from ``local`` and ``trans`` along the plan ``offsets`` / ``rows`` (int32 on the device; see
    the module docstring) in one launch. ``trans`` may be None when no chain has a middle segment, and holds per-key
    decays ([S_t, HV, K]) for a diagonal chain."""
    D = local.shape[-1]
    diagonal = trans is not None and trans.dim() == 3
    key = ("StateChain", D, diagonal, runtime.device_arch(local.device))
    fn = runtime.get_or_compile(key, lambda: compile_state_chain(key[-1], False, D, diagonal))
    fn(local, local if trans is None else trans, starts, offsets, rows)


for _diagonal in (False, True):
    runtime.register_kernel(
        "state_chain_diagonal" if _diagonal else "state_chain",
        ["sm_90a", "sm_100a", "sm_103a"],
        lambda arch, d=_diagonal: compile_state_chain(arch, diagonal=d),
        ["fma.rn.f32", "ld.global.v", "st.global.v"],  # vector accesses: v4.b32 on sm_90a, v2.b64 on sm_100a / sm_103a
        clean_sass=True,
    )
