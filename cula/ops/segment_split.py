"""Splitting long sequences across CTAs for the fused chunk kernels (GDN, KDA, GLA, simple GLA).

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

from cula import runtime

CHUNK = 64
# (mode, starts, ends, initial states or None, out) -> final states [len(starts), HV, K, K or V] fp32
RangeRunner = Callable[[str, torch.Tensor, torch.Tensor, torch.Tensor | None, torch.Tensor], torch.Tensor]


class SplitCost(NamedTuple):
    """A kernel's split passes, in units of a chunk of an unsplit sequence: the correction and transition passes'
    cost per chunk (a transition of 0: no transition pass, the gate gives the transitions); a link of the start
    chain (one small product per segment, in series) per value head (the chain launch's time grows with the heads);
    whether the later passes are ``cached`` (the first pass saves each chunk's intra-chunk matrices to a workspace,
    the later passes load them; the kernel's ``intra`` option; they then launch a CTA for every segment, empty where
    they skip it); the first pass's cost per chunk (more than 1 where an unsplit sequence runs a faster kernel than
    the split passes do); what a split call costs once (its extra launches and allocations); each wave of CTAs a
    pass launches beyond its first (their prologues, empty ranges included); and the cost per chunk of a chain
    walked while the other SMs idle (``lone``: less contention; scaled up to 1 as the CTAs walking the longest
    chains fill the SMs)."""

    correction: float = 1.0
    transition: float = 1.0
    link: float = 0.0
    cached: bool = False
    first: float = 1.0
    fixed: float = 0.0
    wave: float = 0.0
    lone: float = 1.0

    @classmethod
    def from_us(
        cls,
        chunk_us: float,
        correction: float,
        transition: float,
        link: float,
        *,
        cached: bool = False,
        first: float | None = None,
        fixed: float = 0.0,
        wave: float = 0.0,
        lone: float = 1.0,
    ) -> SplitCost:
        """The costs from measured microseconds (per chunk, per link and value head, once, per extra wave; ``first``
        defaults to a whole chunk), each divided by ``chunk_us``, an unsplit sequence's chunk; ``lone`` is already a
        fraction."""
        return cls(
            correction / chunk_us,
            transition / chunk_us,
            link / chunk_us,
            cached,
            1.0 if first is None else first / chunk_us,
            fixed / chunk_us,
            wave / chunk_us,
            lone,
        )


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


def _whole_walks(chunks: list[int], HV: int, num_sms: int, cost: SplitCost) -> float:
    """:func:`_walk` of the unsplit sequences, its longest chains at ``cost.lone`` per chunk when few CTAs walk them."""
    walks = _walk(chunks, HV, num_sms)
    longest = max(chunks, default=0)
    if walks > longest:  # several waves: the SMs stay busy
        return walks
    n_long = HV * sum(c == longest for c in chunks)
    lone = cost.lone + (1.0 - cost.lone) * min(n_long, num_sms) / num_sms
    return max(longest * lone, math.ceil(sum(chunks) * HV / num_sms))


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
    launched = [len(first), len(first) if cost.cached else len(later)]
    if middle and cost.transition:  # none launched where the gate gives the transitions
        launched.append(len(first) if cost.cached else len(middle))
    extra_waves = sum(-(-n * HV // num_sms) - 1 for n in launched)
    return (
        cost.fixed
        + cost.wave * extra_waves
        + cost.link * links * HV
        + cost.first * _walk(first, HV, num_sms)
        + cost.correction * _walk(later, HV, num_sms)
        + cost.transition * _walk(middle, HV, num_sms)
    )


@functools.lru_cache(maxsize=256)
def _plan(lengths: tuple[int, ...], HV: int, num_sms: int, chunk: int, cost: SplitCost) -> tuple[float, int | None]:
    """(time in chunk walks, segment length in chunks or None for no split) of the fastest plan."""
    chunks = [-(-n // chunk) for n in lengths]
    longest = max(chunks, default=0)
    whole = _whole_walks(chunks, HV, num_sms, cost)
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
        walks = _whole_walks([-(-n // CHUNK) for n in lengths], HV, num_sms, cost)
    return latency_us * walks / 1e3


# (local, trans or None, starts, offsets, rows): writes ``starts`` along a chain plan (``_SplitPlan``)
ChainRunner = Callable[[torch.Tensor, torch.Tensor | None, torch.Tensor, torch.Tensor, torch.Tensor], None]


def chain_starts_torch(local, trans, starts, offsets, rows) -> None:
    """The start chain in PyTorch (the CPU's; :mod:`cula.ops.state_chain_sm90` is the GPU's): ``offsets`` [chains + 1]
    into ``rows`` [R, 3]; a chain's first row names the local state of its first segment, each further row one later
    segment (local index, transition index or -1 for the chain's last segment, slot in ``starts``); ``trans`` holds
    [K, K] maps, or per-key decays [K] (a diagonal map)."""
    offsets, rows = offsets.tolist(), rows.tolist()
    for c in range(len(offsets) - 1):
        state = local[rows[offsets[c]][0]]
        for i, t, slot in rows[offsets[c] + 1 : offsets[c + 1]]:
            starts[slot] = state
            if t >= 0:
                if trans.dim() == 3:  # per-key decays
                    state = torch.addcmul(local[i], trans[t][..., None], state)
                else:
                    state = torch.baddbmm(local[i], trans[t], state)


def split_forward(
    run: RangeRunner,
    offsets: list[int],
    cuts: list[list[int]],
    initial_state: torch.Tensor | None,
    out: torch.Tensor,
    need_final_state: bool,
    aligned: bool = False,
    chain: ChainRunner = chain_starts_torch,
    gate: torch.Tensor | None = None,
) -> torch.Tensor | None:
    """Run one op over sequences ``[offsets[n], offsets[n+1])`` of the flattened token axis, each cut at
    ``offsets[n] + cuts[n]``. ``initial_state`` is [N, HV, K, V] fp32 or None; ``out`` receives o. Returns the
    final states [N, HV, K, V] (or None when not needed).

    The first pass runs each sequence's first segment from its initial state, so only the middle segments need a
    transition and only the later ones a correction; ``chain`` makes the later segments' starts between them. With
    ``aligned`` every pass gets every segment, in the same order (the ones a pass skips as empty ranges), so a runner
    can hand a pass what the first one left for the same segment index. ``gate``: the activated gate of a recurrence
    without the delta rule ([1, T, HV] or, per key, [1, T, HV, K] fp32 natural-log gates on the flattened token
    axis), whose v = 0 walk only decays the state: the middle segments' transitions are then its decays
    (:func:`_gate_transitions`) and no "transition" pass runs. Host work per call is a fixed handful of ops and one
    per run of equal middle segments (the plan's device tables are made once per split)."""
    assert gate is None or not aligned, "the gate's transitions are indexed as uncached passes index them"
    plan = _split_plan(str(out.device), tuple(offsets), tuple(map(tuple, cuts)), aligned)
    h0 = None
    if initial_state is not None:
        h0 = initial_state.new_zeros(plan.segments, *initial_state.shape[1:])
        h0.index_add_(0, plan.first, initial_state)  # onto zeros: a copy (index_copy_ wants int64)
    local = run("full", *plan.full, h0, out)
    trans = None
    if plan.has_middle:
        trans = run("transition", *plan.transition, None, out) if gate is None else _gate_transitions(gate, plan, local)
    if plan.has_later:
        starts = local.new_empty(plan.later, *local.shape[1:])
        chain(local, trans, starts, *plan.chain)
        hom = run("correction", *plan.correction, starts, out)
    if not need_final_state:
        return None
    final = local.index_select(0, plan.last)
    if plan.has_later:
        final.index_add_(0, plan.split_seqs, hom.index_select(0, plan.split_last))
    return final


class _SplitPlan(NamedTuple):
    """The device side of one split (int32 views of one tensor): each pass's (starts, ends) token ranges, the start
    chain's (offsets, rows), each sequence's first and last segment, the sequences that were cut with the correction
    slot of their last segment; ``later``: how many starts the chain makes (one per segment when aligned)."""

    segments: int
    later: int
    has_middle: bool
    has_later: bool
    full: tuple[torch.Tensor, torch.Tensor]
    transition: tuple[torch.Tensor, torch.Tensor]
    correction: tuple[torch.Tensor, torch.Tensor]
    chain: tuple[torch.Tensor, torch.Tensor]
    first: torch.Tensor
    last: torch.Tensor
    split_seqs: torch.Tensor
    split_last: torch.Tensor
    # the middle segments as runs of equal contiguous ones, (first token, count, tokens each), in their order
    middles: tuple[tuple[int, int, int], ...]


def _gate_transitions(gate: torch.Tensor, plan: _SplitPlan, local: torch.Tensor) -> torch.Tensor:
    """What a "transition" pass returns for the middle segments of a recurrence without the delta rule, as the diagonal
    the start chain takes: its v = 0 walk from S = I only decays the state, so a segment's transition is diag(e^(its
    gates' sum per key)), here its diagonal ``[middle segments, HV, K]`` in the dtype of ``local`` (the first pass's
    states, fp32 from the kernels). ``gate`` ([1, T, HV(, K)]) is summed over each run of equal contiguous middle
    segments (``plan.middles``) by one reduction over a view, reading those tokens once. A segment whose sum underflows
    e^x in fp32 (a -inf gate included) is a reset (decay 0). A NaN gate follows the kernel: GLA's floors it to a reset
    (``fmax``), so its segment's decay is 0 as well; the scalar-gate kernel carries it (its state turns NaN), and so does
    its decay here, unchanged: the segment's local end state is NaN already, and so is every later start, as an unsplit
    walk's state."""
    rest = gate.shape[2:]
    sums = [gate[0, a : a + n * length].view(n, length, *rest).sum(1) for a, n, length in plan.middles]
    sums = sums[0] if len(sums) == 1 else torch.cat(sums)
    if sums.dim() == 3:  # GLA's per-key gate
        sums = sums.nan_to_num(nan=-math.inf)
    decay = sums.exp().to(local.dtype)
    if decay.dim() == 2:  # one gate for every key
        decay = decay[..., None].expand(*decay.shape, local.shape[-2]).contiguous()
    return decay


# Kept for the last few splits seen: a model's layers split their batch the same way, so the plan is made and copied
# to the device once per split, not once per pass and call.
@runtime.device_plan_cache(maxsize=16)
def _split_plan(dev: str, offsets: tuple, cuts: tuple, aligned: bool) -> _SplitPlan:
    segs = segments(list(offsets), [list(c) for c in cuts])
    first = {n: i for i, (n, _, _) in reversed(list(enumerate(segs)))}
    last = {n: i for i, (n, _, _) in enumerate(segs)}
    later_idx = [i for i in range(len(segs)) if first[segs[i][0]] != i]  # their start comes from the chain
    mid_idx = [i for i in later_idx if last[segs[i][0]] != i]  # and their successor needs their transition

    def pairs(idx):
        if not aligned:
            return [segs[i][1:] for i in idx]
        keep = set(idx)
        return [(s, e) if i in keep else (s, s) for i, (_, s, e) in enumerate(segs)]

    def slot(i, idx):
        return i if aligned else idx.index(i)

    middles = []
    for i in mid_idx:
        _, s, e = segs[i]
        if middles and middles[-1][0] + middles[-1][1] * middles[-1][2] == s and middles[-1][2] == e - s:
            middles[-1][1] += 1
        else:
            middles.append([s, 1, e - s])
    offs, rows = [0], []
    split_seqs, split_last = [], []
    for n, i0 in first.items():
        if last[n] == i0:
            continue
        rows.append((i0, -1, -1))
        rows += [(i, slot(i, mid_idx) if i != last[n] else -1, slot(i, later_idx)) for i in range(i0 + 1, last[n] + 1)]
        offs.append(len(rows))
        split_seqs.append(n)
        split_last.append(slot(last[n], later_idx))
    ranges = [pairs(range(len(segs))), pairs(mid_idx), pairs(later_idx)]
    parts = [[s for s, _ in p] for p in ranges] + [[e for _, e in p] for p in ranges]
    N = len(offsets) - 1
    parts += [offs, [x for r in rows for x in r], [first[n] for n in range(N)], [last[n] for n in range(N)]]
    parts += [split_seqs, split_last]
    flat = runtime.host_to_device(torch.tensor([x for p in parts for x in p], dtype=torch.int32), dev)
    views, at = [], 0
    for p in parts:
        views.append(flat[at : at + len(p)])
        at += len(p)
    return _SplitPlan(
        len(segs),
        len(segs) if aligned else len(later_idx),
        bool(mid_idx),
        bool(later_idx),
        (views[0], views[3]),
        (views[1], views[4]),
        (views[2], views[5]),
        (views[6], views[7].view(-1, 3)),
        *views[8:12],
        tuple(map(tuple, middles)),
    )
