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

import collections
import math
from collections.abc import Callable

import torch

CHUNK = 64
# (mode, starts, ends, initial states or None, out) -> final states [len(starts), HV, K, K or V] fp32
RangeRunner = Callable[[str, torch.Tensor, torch.Tensor, torch.Tensor | None, torch.Tensor], torch.Tensor]


def plan_segments(lengths: list[int], HV: int, num_sms: int, chunk: int = CHUNK) -> list[list[int]] | None:
    """Cut points per sequence (token counts from its start, a multiple of ``chunk``) that spread the chunk walks
    over ``num_sms`` CTAs, one CTA per SM; None when splitting would not beat walking each sequence whole."""
    chunks = [-(-n // chunk) for n in lengths]
    total = sum(chunks)
    if total == 0:
        return None
    budget = max(num_sms // HV, 1)  # CTAs per head that still fit one wave
    spread = math.ceil(total * HV / num_sms)
    seg = max(math.ceil(total / budget), 1)
    while sum(-(-c // seg) for c in chunks) > max(budget, len(chunks)):
        seg += 1
    # three passes over segments of `seg` chunks against one pass over the longest sequence
    if 3 * max(seg, spread) >= max(chunks):
        return None
    return [list(range(seg * chunk, n, seg * chunk)) for n in lengths]


def chunk_walk_ms(lengths: list[int], HV: int, num_sms: int, latency_us: float, splittable: bool) -> float:
    """A fused chunk kernel's time from its chunk walks at ``latency_us`` per chunk and CTA (one CTA per SM): the
    longest chain one CTA walks, or all chunk-CTAs spread over the SMs, whichever is longer; with ``splittable``,
    three passes over segments where :func:`plan_segments` splits."""
    chunks = [-(-n // CHUNK) for n in lengths]
    spread = math.ceil(sum(chunks) * HV / num_sms)
    cuts = plan_segments(lengths, HV, num_sms, CHUNK) if splittable else None
    if cuts is None:
        return latency_us * max(max(chunks, default=0), spread) / 1e3
    seg = max(-(-(c[0] if c else n) // CHUNK) for c, n in zip(cuts, lengths, strict=True))
    return 3 * latency_us * max(seg, spread) / 1e3


def split_forward(
    run: RangeRunner,
    offsets: list[int],
    cuts: list[list[int]],
    initial_state: torch.Tensor | None,
    out: torch.Tensor,
    need_final_state: bool,
) -> torch.Tensor | None:
    """Run one op over sequences ``[offsets[n], offsets[n+1])`` of the flattened token axis, each cut at
    ``offsets[n] + cuts[n]``. ``initial_state`` is [N, HV, K, V] fp32 or None; ``out`` receives o. Returns the
    final states [N, HV, K, V] (or None when not needed)."""
    segs = []  # (sequence, start, end)
    for n, (a, b) in enumerate(zip(offsets[:-1], offsets[1:], strict=True)):
        bounds = [a] + [a + c for c in cuts[n]] + [b]
        segs += [(n, s, e) for s, e in zip(bounds[:-1], bounds[1:], strict=True)]
    all_idx = list(range(len(segs)))
    last = {n: i for i, (n, _, _) in enumerate(segs)}  # each sequence's last segment
    first = {n: i for i, (n, _, _) in reversed(list(enumerate(segs)))}
    trans_idx = [i for i in all_idx if last[segs[i][0]] != i]  # segments whose successor needs a start
    corr_idx = [i for i in all_idx if initial_state is not None or first[segs[i][0]] != i]  # with a start
    full_r, trans_r, corr_r = _device_ranges(segs, (all_idx, trans_idx, corr_idx), out.device)

    local = run("full", *full_r, None, out)
    trans = run("transition", *trans_r, None, out) if trans_idx else None
    trans_of = {i: j for j, i in enumerate(trans_idx)}

    # starts: S_start(first) = h0 (or zero); S_start(next) = M S_start + S_local
    starts: list[torch.Tensor | None] = [None] * len(segs)
    state: dict[int, torch.Tensor | None] = {}
    for i, (n, _, _) in enumerate(segs):
        s = state.get(n, None if initial_state is None else initial_state[n])
        starts[i] = s
        if i in trans_of:
            state[n] = local[i] if s is None else torch.baddbmm(local[i], trans[trans_of[i]], s)
    final = {}
    if corr_idx:
        h0 = torch.stack([starts[i] for i in corr_idx])
        hom = run("correction", *corr_r, h0, out)
        final = {segs[i][0]: hom[j] + local[i] for j, i in enumerate(corr_idx) if last[segs[i][0]] == i}
    if not need_final_state:
        return None
    return torch.stack([final.get(n, local[i]) for n, i in sorted(last.items())])


# Device copies of the passes' token ranges, for the last few splits seen: a model's layers split their batch the
# same way, so the host-to-device copy (which waits for the stream, its source being pageable) is made once per
# split, not once per pass and call.
_RANGES: collections.OrderedDict[tuple, torch.Tensor] = collections.OrderedDict()  # [2, ranges] int32
_RANGES_KEPT = 16


def _device_ranges(segs, passes, dev) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """(starts, ends) int32 on ``dev`` for each list of segment indices in ``passes``."""
    key = (str(dev), tuple(segs), tuple(tuple(idx) for idx in passes))
    flat = _RANGES.get(key)
    if flat is None:
        cols = [i for idx in passes for i in idx]
        flat = torch.tensor([[segs[i][1] for i in cols], [segs[i][2] for i in cols]], dtype=torch.int32).to(dev)
        _RANGES[key] = flat
        while len(_RANGES) > _RANGES_KEPT:
            _RANGES.popitem(last=False)
    else:
        _RANGES.move_to_end(key)
    out, at = [], 0
    for idx in passes:
        out.append((flat[0, at : at + len(idx)], flat[1, at : at + len(idx)]))
        at += len(idx)
    return out
