"""The output tile's way out: O^T from the state warpgroups' accumulators, staged token-major in shared memory by
``stmatrix`` (transposed), a full chunk leaving by one TMA store, the last (maybe partial) chunk by masked 16-byte
stores."""

from dataclasses import dataclass

import cutlass
import cutlass.cute as cute
from cutlass.cute.nvgpu import warp as warp_ops

from cula.sm90.roles import Barrier


@dataclass(frozen=True)
class OutputStager:
    """One chunk's O^T at a time through ``stages`` staging tiles (``sO`` (C, D, stages) K-major, ``sO_mn`` the
    same bytes (D, C, stages)): each state warpgroup (``wtid`` its thread, rows ``row_block``) writes its rows by
    stmatrix (:meth:`stage`), then :meth:`flush` synchronises the state warpgroups (``threads``) and the ``leader``
    warp stores the chunk by TMA; the last chunk leaves by masked stores (:meth:`finish`). With one staging tile the
    caller frees it (:meth:`free`) before a barrier that precedes the next chunk's :meth:`stage`."""

    tma_o: object
    tOs: object  # the staging tiles, TMA-partitioned
    tOg: object  # the sequence's output chunks, TMA-partitioned
    sO: object
    sO_mn: object
    mma_cc: object
    wtid: object
    row_block: object
    leader: object  # Boolean: this thread's warp issues and waits for the stores
    stages: int
    threads: int

    @cute.jit
    def stage(self, acc_o, chunk):
        """This warpgroup's rows of the chunk's O^T (fp32 accumulator) to staging tile ``chunk % stages``."""
        st = cute.make_tiled_copy_C(
            cute.make_copy_atom(warp_ops.StMatrix8x8x16bOp(transpose=True, num_matrices=4), cutlass.BFloat16),
            self.mma_cc,
        )
        thr = st.get_slice(self.wtid)
        o_frag = cute.make_rmem_tensor(acc_o.layout, cutlass.BFloat16)
        o_frag.store(acc_o.load().to(cutlass.BFloat16))
        C = cute.size(self.sO, mode=[0])
        rows = cute.local_tile(self.sO_mn[None, None, chunk % self.stages], (C, C), (self.row_block, 0))
        cute.copy(st, thr.retile(o_frag), thr.partition_D(rows))
        # the TMA store (async proxy) reads what stmatrix wrote
        cute.arch.fence_proxy("async.shared", space="cta")

    @cute.jit
    def flush(self, chunk, n_chunks):
        """After every state thread staged ``chunk``: a full chunk leaves by TMA (the last one waits for
        :meth:`finish`). With several tiles, the store that last read the tile the next chunk writes has read it
        before the barrier."""
        if cutlass.const_expr(self.stages > 1):
            if self.leader:
                cute.arch.cp_async_bulk_wait_group(self.stages - 2, read=True)
        cute.arch.barrier(barrier_id=Barrier.STATE, number_of_threads=self.threads)
        if self.leader:
            if chunk + 1 < n_chunks:
                cute.copy(self.tma_o, self.tOs[None, chunk % self.stages], self.tOg[None, chunk])
                cute.arch.cp_async_bulk_commit_group()

    @cute.jit
    def free(self):
        """One staging tile: the previous chunk's store has read it (the caller's next barrier tells the others)."""
        if self.leader:
            cute.arch.cp_async_bulk_wait_group(0, read=True)

    @cute.jit
    def finish(self, mO, b, hv, col0, tok0, seqlen, n_chunks, tid):
        """The last chunk (rows past the sequence end masked; the tile's columns from ``col0`` of the head) by the
        state threads (``tid``), then every store waited for."""
        if n_chunks > 0:
            last = n_chunks - 1
            C, D = cute.size(self.sO, mode=[0]), cute.size(self.sO, mode=[1])
            store_o_rows(
                self.sO[None, None, last % self.stages], mO, b, hv, col0, tok0 + last * C, seqlen - last * C, tid, C,
                D, self.threads,
            )  # fmt: skip
        if self.leader:
            cute.arch.cp_async_bulk_wait_group(0)


@cute.jit
def store_o_rows(
    sO, mO, b, hv, col0, tok, rows, tid, C: cutlass.Constexpr, D: cutlass.Constexpr, num_threads: cutlass.Constexpr
):  # fmt: skip
    """A (C x D) bf16 output tile staged token-major in ``sO`` to tokens ``[tok, tok + rows)`` and columns
    ``[col0, col0 + D)`` of ``mO[b, :, hv]``: 16-byte coalesced stores by ``num_threads`` threads, rows past ``rows``
    masked."""
    vec = 8
    per_row = D // vec
    for it in cutlass.range_constexpr(C * per_row // num_threads):
        idx = tid + it * num_threads
        r = idx // per_row
        c0 = (idx % per_row) * vec
        if r < rows:
            src = cute.local_tile(sO, (1, vec), (r, c0 // vec))
            dst = cute.local_tile(mO[b, tok + r, hv, None], (vec,), ((col0 + c0) // vec,))
            frag = cute.make_rmem_tensor(cute.make_layout((1, vec)), cutlass.BFloat16)
            cute.autovec_copy(src, frag)
            cute.autovec_copy(cute.make_tensor(frag.iterator, cute.make_layout(vec)), dst)
