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
A split costs a first pass over every segment, a correction pass over the later segments and a transition pass over
the middle ones; with the intra-chunk matrices cached by the first pass the later passes cost a fraction of it
(``SplitCost``), and ``plan_segments`` splits where the passes together are expected to beat walking whole.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable
from typing import NamedTuple

import torch

CHUNK = 64
# (mode, starts, ends, initial states or None, out) -> final states [len(starts), HV, K, K or V] fp32
RangeRunner = Callable[[str, torch.Tensor, torch.Tensor, torch.Tensor | None, torch.Tensor], torch.Tensor]


class SplitCost(NamedTuple):
    """A kernel's split passes: the correction and transition passes' cost per chunk as a fraction of a chunk of the
    first pass, a link of the start chain (one small product per segment, in series) in the same unit, and whether
    the later passes are ``cached`` (the first pass saves each chunk's intra-chunk matrices to a workspace, the
    later passes load them; the kernel's ``intra`` option)."""

    correction: float = 1.0
    transition: float = 1.0
    link: float = 0.0
    cached: bool = False


UNCACHED = SplitCost()  # every later pass makes each chunk again, at a first pass's cost


def _walk(segs: list[int], HV: int, num_sms: int) -> float:
    """One pass's time in chunk walks, one CTA per SM: its longest segment; when its CTAs overflow one wave, also
    all of its chunk-CTAs spread over the SMs, and the waves: among the w x SMs + 1 longest CTAs some SM runs w + 1."""
    if not segs:
        return 0.0
    ranked = sorted(segs, reverse=True)
    ctas = len(segs) * HV
    waves = max((w + 1) * ranked[w * num_sms // HV] for w in range(-(-ctas // num_sms)))
    return float(max(waves, math.ceil(sum(segs) * HV / num_sms)))


def _split_walks(chunks: list[int], seg: int, HV: int, num_sms: int, cost: SplitCost) -> float:
    """The split passes' time in chunk walks when every sequence is cut every ``seg`` chunks."""
    first, later, middle = [], [], []
    links = 0
    for c in chunks:
        pieces = [min(seg, c - a) for a in range(0, c, seg)] or [0]
        first += pieces
        later += pieces[1:]
        middle += pieces[1:-1]
        links += len(pieces) - 1
    return (
        cost.link * links
        + _walk(first, HV, num_sms)
        + cost.correction * _walk(later, HV, num_sms)
        + cost.transition * _walk(middle, HV, num_sms)
    )


@functools.lru_cache(maxsize=256)
def _plan(lengths: tuple[int, ...], HV: int, num_sms: int, chunk: int, cost: SplitCost) -> tuple[float, int | None]:
    """(time in chunk walks, segment length in chunks or None for no split) of the fastest plan."""
    chunks = [-(-n // chunk) for n in lengths]
    longest = max(chunks, default=0)
    whole = _walk(chunks, HV, num_sms)
    best = (whole, None)
    if whole <= math.ceil(sum(chunks) * HV / num_sms) / 0.97:
        return best  # bound by the work spread over the SMs: the first pass alone would take as long
    # the longest sequence in k equal pieces (up to four waves of them), the others cut as often as that needs
    for k in range(2, min(longest, 4 * max(num_sms // HV, 1), 256) + 1):
        seg = -(-longest // k)
        t = _split_walks(chunks, seg, HV, num_sms, cost)
        # more pieces must win by more than their extra launches are worth (a few percent)
        if t < 0.97 * best[0]:
            best = (t, seg)
    return best


def plan_segments(
    lengths: list[int], HV: int, num_sms: int, chunk: int = CHUNK, cost: SplitCost = UNCACHED
) -> list[list[int]] | None:
    """Cut points per sequence (token counts from its start, multiples of ``chunk``) for the fastest split under
    :func:`chunk_walk_ms`'s model (each pass as :func:`_walk` times it, the later ones at their ``cost``), or None
    when walking each sequence whole is expected to be as fast."""
    _, seg = _plan(tuple(lengths), HV, num_sms, chunk, cost)
    if seg is None:
        return None
    return [list(range(seg * chunk, n, seg * chunk)) for n in lengths]


def segments(offsets: list[int], cuts: list[list[int]]) -> list[tuple[int, int, int]]:
    """(sequence, start, end) of every segment, sequence by sequence."""
    out = []
    for n, (a, b) in enumerate(zip(offsets[:-1], offsets[1:], strict=True)):
        bounds = [a] + [a + c for c in cuts[n]] + [b]
        out += [(n, s, e) for s, e in zip(bounds[:-1], bounds[1:], strict=True)]
    return out


def chunk_walk_ms(
    lengths: list[int], HV: int, num_sms: int, latency_us: float, splittable: bool, cost: SplitCost = UNCACHED
) -> float:
    """A fused chunk kernel's time from its chunk walks at ``latency_us`` per chunk and CTA (one CTA per SM): the
    longest chain one CTA walks, or all chunk-CTAs spread over the SMs when they overflow a wave; with
    ``splittable``, the split passes (their per-chunk ``cost``) where :func:`plan_segments` splits."""
    if splittable:
        walks, _ = _plan(tuple(lengths), HV, num_sms, CHUNK, cost)
    else:
        walks = _walk([-(-n // CHUNK) for n in lengths], HV, num_sms)
    return latency_us * walks / 1e3


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
