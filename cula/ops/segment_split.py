"""Splitting long sequences across CTAs for the fused delta-rule chunk kernels (GDN, KDA).

A fused kernel runs one CTA per (sequence, value head) and walks its chunks in series, so a few long sequences
with few heads leave most SMs idle (B1 T65536 H8 runs 8 CTAs). The recurrence is affine in the state: over a
segment, ``S_end = M S_start + S_local`` with ``S_local`` the segment's final state from a zero start and ``M``
(K x K) its transition, which is the final state of the same recurrence run with ``v = 0`` from ``S = I``. The
outputs are affine as well: ``o = o_local + o_hom``, ``o_hom`` being the output of the ``v = 0`` recurrence started
from ``S_start``. A kernel that runs these three modes over a list of token ranges therefore splits a sequence:

- ``"full"``: every segment from a zero state; writes ``o_local``, returns ``S_local``;
- ``"transition"``: ``v = 0`` from ``S = I``, no output; returns ``M`` (segments whose successor needs a start);
- ``"correction"``: ``v = 0`` from the given starts; adds ``o_hom`` to ``o``; returns the final states.

Between the passes the starts chain through one K x K by K x V product per segment (``split_forward``).
Costs three walks of a segment instead of one walk of the sequence, so it pays only when the longest sequence
is well over three times the chunks each SM gets when all of them are spread (``plan_segments``).
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable

import torch

CHUNK = 64
# (mode, starts, ends, initial states or None, out) -> final states [len(starts), HV, K, K or V] fp32
RangeRunner = Callable[[str, torch.Tensor, torch.Tensor, torch.Tensor | None, torch.Tensor], torch.Tensor]


def plan_segments(
    lengths: list[int], HV: int, num_sms: int, chunk: int = CHUNK, later_pass_cost: float = 1.0
) -> list[list[int]] | None:
    """Cut points per sequence (token counts from its start, a multiple of ``chunk``) that spread the chunk walks
    over ``num_sms`` CTAs, one CTA per SM; None when splitting would not beat walking each sequence whole.
    ``later_pass_cost``: a transition or correction pass's cost per chunk, as a fraction of the first pass's."""
    chunks = [-(-n // chunk) for n in lengths]
    total = sum(chunks)
    if total == 0:
        return None
    budget = max(num_sms // HV, 1)  # CTAs per head that still fit one wave
    spread = math.ceil(total * HV / num_sms)
    seg = max(math.ceil(total / budget), 1)
    while sum(-(-c // seg) for c in chunks) > max(budget, len(chunks)):
        seg += 1
    cuts = [list(range(seg * chunk, n, seg * chunk)) for n in lengths]
    # the passes over segments of `seg` chunks against one pass over the longest sequence
    if pass_factor(cuts, later_pass_cost) * max(seg, spread) >= max(max(chunks), spread):
        return None
    return cuts


def pass_factor(cuts: list[list[int]], later_pass_cost: float) -> float:
    """The split passes' cost in first passes: the first pass over every segment, a correction pass when some
    sequence has a second segment, a transition pass when one has a middle segment (:func:`split_forward`)."""
    most = max((len(c) + 1 for c in cuts), default=1)
    return 1.0 + later_pass_cost * ((most >= 2) + (most >= 3))


def segments(offsets: list[int], cuts: list[list[int]]) -> list[tuple[int, int, int]]:
    """(sequence, start, end) of every segment, sequence by sequence."""
    out = []
    for n, (a, b) in enumerate(zip(offsets[:-1], offsets[1:], strict=True)):
        bounds = [a] + [a + c for c in cuts[n]] + [b]
        out += [(n, s, e) for s, e in zip(bounds[:-1], bounds[1:], strict=True)]
    return out


def chunk_walk_ms(
    lengths: list[int], HV: int, num_sms: int, latency_us: float, splittable: bool, later_pass_cost: float = 1.0
) -> float:
    """A fused chunk kernel's time from its chunk walks at ``latency_us`` per chunk and CTA (one CTA per SM): the
    longest chain one CTA walks, or all chunk-CTAs spread over the SMs, whichever is longer; with ``splittable``,
    the split passes (:func:`pass_factor`) over segments where :func:`plan_segments` splits."""
    chunks = [-(-n // CHUNK) for n in lengths]
    spread = math.ceil(sum(chunks) * HV / num_sms)
    cuts = plan_segments(lengths, HV, num_sms, CHUNK, later_pass_cost) if splittable else None
    if cuts is None:
        return latency_us * max(max(chunks, default=0), spread) / 1e3
    seg = max(-(-(c[0] if c else n) // CHUNK) for c, n in zip(cuts, lengths, strict=True))
    return pass_factor(cuts, later_pass_cost) * latency_us * max(seg, spread) / 1e3


def split_forward(
    run: RangeRunner,
    offsets: list[int],
    cuts: list[list[int]],
    initial_state: torch.Tensor | None,
    out: torch.Tensor,
    need_final_state: bool,
    aligned: bool = False,
) -> torch.Tensor | None:
    """Run one op over sequences ``[offsets[n], offsets[n+1])`` of the flattened token axis, each cut at
    ``offsets[n] + cuts[n]``. ``initial_state`` is [N, HV, K, V] fp32 or None; ``out`` receives o. Returns the
    final states [N, HV, K, V] (or None when not needed).

    The first pass runs each sequence's first segment from its initial state, so only the middle segments need a
    transition and only the later ones a correction. With ``aligned`` every pass gets every segment, in the same
    order (the ones a pass skips as empty ranges), so a runner can hand a pass what the first one left for the same
    segment index."""
    segs = segments(offsets, cuts)
    all_idx = list(range(len(segs)))
    first = {n: i for i, (n, _, _) in reversed(list(enumerate(segs)))}
    last = {n: i for i, (n, _, _) in enumerate(segs)}
    later_idx = [i for i in all_idx if first[segs[i][0]] != i]  # their start comes from the chain
    mid_idx = [i for i in later_idx if last[segs[i][0]] != i]  # and their successor needs their transition

    def pairs(idx):
        if not aligned:
            return [segs[i][1:] for i in idx]
        keep = set(idx)
        return [(s, e) if i in keep else (s, s) for i, (_, s, e) in enumerate(segs)]

    full_r, trans_r, corr_r = _device_ranges((pairs(all_idx), pairs(mid_idx), pairs(later_idx)), out.device)
    slot = (lambda i, idx: i) if aligned else (lambda i, idx: idx.index(i))

    h0 = None
    if initial_state is not None:
        zero = torch.zeros_like(initial_state[0])
        h0 = torch.stack([initial_state[n] if first[n] == i else zero for i, (n, _, _) in enumerate(segs)])
    local = run("full", *full_r, h0, out)
    trans = run("transition", *trans_r, None, out) if mid_idx else None

    # starts of the later segments: S_start(next) = S_end = M S_start + S_local (S_local alone for a first segment)
    starts: dict[int, torch.Tensor] = {}
    for n, i0 in first.items():
        state = local[i0]
        for i in range(i0 + 1, last[n] + 1):
            starts[i] = state
            if i != last[n]:
                state = torch.baddbmm(local[i], trans[slot(i, mid_idx)], state)
    final = {n: local[i] for n, i in last.items() if first[n] == i}
    if later_idx:
        if aligned:
            zero = torch.zeros_like(local[0])
            h0c = torch.stack([starts.get(i, zero) for i in all_idx])
        else:
            h0c = torch.stack([starts[i] for i in later_idx])
        hom = run("correction", *corr_r, h0c, out)
        final.update({n: hom[slot(i, later_idx)] + local[i] for n, i in last.items() if first[n] != i})
    if not need_final_state:
        return None
    return torch.stack([final[n] for n in sorted(last)])


def _device_ranges(passes, dev) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """(starts, ends) int32 on ``dev`` for each pass's list of (start, end) token ranges."""
    flat = _device_ranges_flat(str(dev), tuple(tuple(p) for p in passes))
    out, at = [], 0
    for p in passes:
        out.append((flat[0, at : at + len(p)], flat[1, at : at + len(p)]))
        at += len(p)
    return out


# Kept for the last few splits seen: a model's layers split their batch the same way, so the host-to-device copy
# (which waits for the stream, its source being pageable) is made once per split, not once per pass and call.
@functools.lru_cache(maxsize=16)
def _device_ranges_flat(dev: str, passes: tuple) -> torch.Tensor:
    """[2, ranges] int32 on ``dev``: every pass's (start, end) token ranges, in order."""
    cols = [r for p in passes for r in p]
    return torch.tensor([[s for s, _ in cols], [e for _, e in cols]], dtype=torch.int32).to(dev)
