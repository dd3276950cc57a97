"""Where a CTA's sequence lies: fixed-length batch rows or varlen token ranges."""

import cutlass
import cutlass.cute as cute


@cute.jit
def sequence_bounds(n, T, mStart, mEnd, is_varlen: cutlass.Constexpr, C: cutlass.Constexpr):
    """CTA row ``n``'s sequence: ``(batch row, first token, length, chunks of C)``. Varlen packs all sequences in
    batch row 0 between ``mStart[n]`` and ``mEnd[n]``; otherwise sequence n is batch row n, ``T`` tokens."""
    b = n
    tok0 = cutlass.Int32(0)
    seqlen = T
    if cutlass.const_expr(is_varlen):
        b = cutlass.Int32(0)
        tok0 = cutlass.Int32(mStart[n])
        seqlen = cutlass.Int32(mEnd[n]) - tok0
    return b, tok0, seqlen, (seqlen + C - 1) // C


@cute.jit
def chunk_position(chunk, n_chunks, reverse: cutlass.Constexpr):
    """The place in its sequence of a role's ``chunk``-th chunk: the same, or counted from the end when the chunks
    are walked from the last (``reverse``: the backward's state-gradient walk)."""
    pos = chunk
    if cutlass.const_expr(reverse):
        pos = n_chunks - 1 - chunk
    return pos


@cute.jit
def checkpoint_row(n, tok0, n_chunks, is_varlen: cutlass.Constexpr, C: cutlass.Constexpr):
    """The workspace row of the first chunk of sequence ``n`` in the backward's state walks (one row per chunk):
    ``n n_chunks`` for fixed-length rows; ``tok0 // C + n`` for varlen ones, distinct for every chunk of every
    sequence within ``T // C + N`` rows (:func:`cula.ops.chunk_backward.checkpoint_rows`)."""
    if cutlass.const_expr(is_varlen):
        return tok0 // C + n
    return n * n_chunks
