"""State pools: the recurrent states of an engine's sequences kept in one tensor, read and written back by index.

FLA 0.6.0 gives its KDA decode kernel (``fla/ops/kda/fused_recurrent.py``, ``fused_recurrent_kda_fwd``) three
arguments for this, which cuLA's entry points take by the same names (FLA's public ops drop them into ``**kwargs``
unread; for the other variants they are cuLA's extension, with the same meaning):

- ``initial_state``: the pool, ``[slots, HV, K, V]`` (``[slots, HV, V, K]`` with ``state_v_first``), fp32 or bf16;
  the math is fp32 and the states are stored rounded to the pool's dtype.
- ``ssm_state_indices``: int32/int64, ``[N]`` (the slot of each sequence) or, for the fused-recurrent ops,
  ``[N, T_max]`` (a slot per token). A sequence starts from ``indices[n]``, or ``indices[n, num_accepted_tokens[n]
  - 1]`` (``indices[n, 0]`` without ``num_accepted_tokens``) -- FLA's kernel, lines 128-139.
- ``inplace_final_state`` (default True with indices, as in ``fused_recurrent_kda_fwd``): write back into the pool.
  With ``[N]`` indices the state after a sequence's last token goes to ``indices[n]``; with ``[N, T_max]`` the state
  after token t goes to ``indices[n, t]`` (lines 202-217), so that a speculative verify keeps every step and the next
  call rolls back by naming the accepted count in ``num_accepted_tokens``. The op returns the pool as its state.
  Without indices it writes the final states back into ``initial_state`` ``[N, ...]``. With
  ``inplace_final_state=False`` the pool is only read and ``output_final_state`` returns fp32 final states
  ``[N, ...]``.

Where FLA's kernel has no defined behaviour cuLA chooses:

- A negative index marks padding (an engine's padded batch): the sequence reads and writes nothing, its outputs
  are zeros (FLA's output buffer is ``torch.zeros_like(v)``, line 270, and its kernel leaves a sequence without
  tokens untouched, lines 99-100) and, without in-place writes, its final state is zeros. A negative ``[n, t]`` entry
  of a live sequence skips that token's write. FLA 0.6.0 reads and writes such indices out of the pool.
- ``[N]`` indices with several tokens in a sequence: the final state only. FLA's kernel adds the token to the row
  offset (``i_n * stride + i_t``, line 206), which for ``[N]`` indices stores token t's state in the slot of
  sequence n + t.
- A sequence of no tokens (varlen) writes nothing, as FLA's early return.

Validation (``cula.validation.state_pool``) refuses indices outside the pool and, when writing, a slot written twice
or read by one sequence and written by another.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from cula import validation

# (initial states [N, ...] in the pool's dtype, whether to return the state after every token) -> (o, states)
Recurrence = Callable[[torch.Tensor, bool], tuple[torch.Tensor, torch.Tensor]]


def serve(args: dict, offsets: list[int] | None, run: Recurrence) -> tuple[torch.Tensor, torch.Tensor | None]:
    """A pooled call (validated) on the reference: gather the sequences' initial states from the pool, run the
    recurrence ``run``, zero the padding's outputs, write back. ``offsets`` are the host varlen offsets (None for
    equal lengths). Returns ``(o, pool)`` in place, else ``(o, final states or None)``."""
    pool, indices, accepted = args["initial_state"], args.get("ssm_state_indices"), args.get("num_accepted_tokens")
    B, T = args["q"].shape[:2]
    offsets = offsets if offsets is not None else [b * T for b in range(B + 1)]
    N, device = len(offsets) - 1, pool.device
    table = torch.arange(N, device=device) if indices is None else indices.long()
    table = table.view(N, -1)
    step = torch.zeros(N, dtype=torch.long, device=device) if accepted is None else accepted.long() - 1
    read = table.gather(1, step[:, None]).squeeze(1)
    live = read >= 0
    if pool.shape[0]:
        h0 = torch.where(live.view(N, 1, 1, 1), pool[read.clamp(min=0)], 0)
    else:  # every sequence is padding
        h0 = pool.new_zeros(N, *pool.shape[1:])
    token_slots = args["inplace_final_state"] and indices is not None and indices.dim() == 2
    o, states = run(h0, token_slots)

    lengths = torch.tensor([b - a for a, b in zip(offsets, offsets[1:], strict=False)], device=device)
    sequence = torch.repeat_interleave(torch.arange(N, device=device), lengths)  # of each token, in order
    o = torch.where(live[sequence].view(-1, 1, 1), o.flatten(0, 1), 0).view_as(o)
    if not args["inplace_final_state"]:
        return o, torch.where(live.view(N, 1, 1, 1), states, 0) if args["output_final_state"] else None
    if token_slots:
        position = torch.arange(len(sequence), device=device) - torch.tensor(offsets[:-1], device=device)[sequence]
        slot = table[sequence, position]
        keep = live[sequence] & (slot >= 0)
    else:
        slot, keep = read, live & (lengths > 0)
    pool[slot[keep]] = states[keep].to(pool.dtype)
    return o, pool


def fla_kda_supports(args: dict) -> tuple[bool, str]:
    """Whether FLA 0.6.0's ``fused_recurrent_kda_fwd`` serves a pooled KDA call with the semantics above."""
    pool, indices = args["initial_state"], args.get("ssm_state_indices")
    if not args["inplace_final_state"]:
        return False, "pool read without write-back: FLA 0.6.0's kernel stores a state per token there"
    HV, K, V = pool.shape[1:]
    if indices is None:
        if not pool.is_contiguous():
            return False, "non-contiguous states written in place: FLA's kernel indexes them as contiguous"
        return True, ""
    if pool.stride()[1:] != (K * V, V, 1):
        return False, "state pool with strided slots: FLA's kernel needs each slot's [HV, K, V] contiguous"
    table = validation.host_indices(indices)
    if table is None:
        return False, "CUDA graph capture: the indices cannot be checked for padding, which FLA's kernel reads"
    if (table < 0).any():
        return False, "padding (negative) indices: FLA 0.6.0's kernel reads and writes them outside the pool"
    if indices.dim() == 1:
        cu_seqlens = args["cu_seqlens"]
        longest = args["q"].shape[1]
        if cu_seqlens is not None:
            offsets = validation.host_offsets(cu_seqlens)
            longest = max(b - a for a, b in zip(offsets, offsets[1:], strict=False))
        if longest > 1:
            return (
                False,
                "[N] indices with several tokens a sequence: FLA 0.6.0 stores token t in sequence n + t's slot",
            )
    return True, ""
