"""The output tile's way out: O^T from the state warpgroups' accumulators, staged token-major in shared memory by
``stmatrix`` (transposed), a full chunk leaving by one TMA store, the last (maybe partial) chunk by masked 16-byte
stores."""

import cutlass
import cutlass.cute as cute


@cute.jit
def store_o_rows(
    sO, mO, b, hv, tok, rows, tid, C: cutlass.Constexpr, D: cutlass.Constexpr, num_threads: cutlass.Constexpr
):  # fmt: skip
    """A (C x D) bf16 output tile staged token-major in ``sO`` to tokens ``[tok, tok + rows)`` of ``mO[b, :, hv]``:
    16-byte coalesced stores by ``num_threads`` threads, rows past ``rows`` masked."""
    vec = 8
    per_row = D // vec
    for it in cutlass.range_constexpr(C * per_row // num_threads):
        idx = tid + it * num_threads
        r = idx // per_row
        c0 = (idx % per_row) * vec
        if r < rows:
            src = cute.local_tile(sO, (1, vec), (r, c0 // vec))
            dst = cute.local_tile(mO[b, tok + r, hv, None], (vec,), (c0 // vec,))
            frag = cute.make_rmem_tensor(cute.make_layout((1, vec)), cutlass.BFloat16)
            cute.autovec_copy(src, frag)
            cute.autovec_copy(cute.make_tensor(frag.iterator, cute.make_layout(vec)), dst)
