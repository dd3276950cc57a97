"""Sequence splitting (cula.ops.segment_split) on the CPU: the split passes, run by the fp32 reference over token
ranges, must give the outputs and final states of the unsplit recurrence (GDN scalar gate and KDA per-key gate)."""

import math

import pytest
import torch
import torch.nn.functional as F

from cula.ops.delta_rule_ref import linear_attn_ref
from cula.ops.segment_split import (
    SplitCost,
    _walk,
    chunk_walk_ms,
    plan_segments,
    split_forward,
)


def reference_runner(q, k, v, g, beta, scale):
    """The RangeRunner contract, on the flattened token axis of [1, T, ...] inputs, by the chunked reference."""

    def run(mode, starts, ends, h0, out):
        idx = torch.cat([torch.arange(int(a), int(b)) for a, b in zip(starts, ends, strict=True)])
        cu = torch.tensor([0] + torch.cumsum(ends - starts, 0).tolist())
        vv = v[:, idx] if mode == "full" else torch.zeros_like(v[:, idx])
        if mode == "transition":
            K = q.shape[-1]
            vv = torch.zeros(*v[:, idx].shape[:-1], K, dtype=v.dtype)
            h0 = torch.eye(K).expand(len(starts), v.shape[2], K, K).contiguous()
        o, ht = linear_attn_ref(
            q[:, idx], k[:, idx], vv, g=g[:, idx], beta=None if beta is None else beta[:, idx], scale=scale,
            initial_state=h0, output_final_state=True, cu_seqlens=cu,
        )  # fmt: skip
        if mode == "full":
            out[:, idx] = o
        elif mode == "correction":
            out[:, idx] += o
        return ht

    return run


def make(T, H, HV, K, per_key):
    q = F.normalize(torch.randn(1, T, H, K, dtype=torch.float64), dim=-1)
    k = F.normalize(torch.randn(1, T, H, K, dtype=torch.float64), dim=-1)
    v = torch.randn(1, T, HV, K, dtype=torch.float64)
    g = F.logsigmoid(torch.randn(1, T, HV, *((K,) if per_key else ()), dtype=torch.float64) + 2)
    beta = torch.rand(1, T, HV, dtype=torch.float64)
    return q, k, v, g, beta


@pytest.mark.parametrize("aligned", [False, True])
@pytest.mark.parametrize("per_key", [False, True])
@pytest.mark.parametrize("with_h0", [False, True])
@pytest.mark.parametrize("empty", [False, True])
def test_split_matches_unsplit(per_key, with_h0, aligned, empty):
    lengths = [1, 300, 64, 450]  # cut: 300 at 64/128, 450 at 192; 1 and 64 stay whole
    cuts = [[], [64, 128], [], [192]]
    if empty:  # zero-length sequences first, between and last: their final state is their initial state
        lengths = [0, 1, 300, 0, 64, 450, 0]
        cuts = [[], [], [64, 128], [], [], [192], []]
    offsets = [0] + torch.cumsum(torch.tensor(lengths), 0).tolist()
    H, HV, K = 1, 2, 16
    q, k, v, g, beta = make(offsets[-1], H, HV, K, per_key)
    h0 = torch.randn(len(lengths), HV, K, K, dtype=torch.float64) if with_h0 else None
    cu = torch.tensor(offsets)
    o_ref, ht_ref = linear_attn_ref(q, k, v, g=g, beta=beta, initial_state=h0, output_final_state=True, cu_seqlens=cu)
    out = torch.full_like(o_ref, float("nan"))
    ht = split_forward(reference_runner(q, k, v, g, beta, K**-0.5), offsets, cuts, h0, out, True, aligned)
    torch.testing.assert_close(out, o_ref, rtol=1e-9, atol=1e-9)
    torch.testing.assert_close(ht, ht_ref, rtol=1e-9, atol=1e-9)


@pytest.mark.parametrize("per_key", [False, True])
@pytest.mark.parametrize("with_h0", [False, True])
def test_gate_transitions_match_unsplit(per_key, with_h0):
    """Without the delta rule the middle segments' transitions come from the gate (two of unequal length here): no
    transition pass runs, and the outputs and final states are the unsplit recurrence's, a -inf gate (a reset) inside
    a middle segment included."""
    lengths = [1, 300, 64, 450, 0]
    cuts = [[], [64, 128, 200], [], [192], []]
    offsets = [0] + torch.cumsum(torch.tensor(lengths), 0).tolist()
    H, HV, K = 1, 2, 16
    q, k, v, g, _ = make(offsets[-1], H, HV, K, per_key)
    g[:, 150] = float("-inf")  # a reset inside the second sequence's second middle segment
    h0 = torch.randn(len(lengths), HV, K, K, dtype=torch.float64) if with_h0 else None
    cu = torch.tensor(offsets)
    o_ref, ht_ref = linear_attn_ref(q, k, v, g=g, initial_state=h0, output_final_state=True, cu_seqlens=cu)
    seen = []
    runner = reference_runner(q, k, v, g, None, K**-0.5)

    def run(mode, starts, ends, h0_, out_):
        seen.append((mode, starts.tolist(), ends.tolist()))
        return runner(mode, starts, ends, h0_, out_)

    out = torch.full_like(o_ref, float("nan"))
    ht = split_forward(run, offsets, cuts, h0, out, True, gate=g)
    torch.testing.assert_close(out, o_ref, rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(ht, ht_ref, rtol=1e-6, atol=1e-6)
    # the full and correction passes only, the correction over the later segments
    assert [m for m, *_ in seen] == ["full", "correction"]
    assert seen[-1] == ("correction", [65, 129, 201, 557], [129, 201, 301, 815])


def test_plan_segments():
    # B1 T65536 H8 on 132 SMs: 16 segments of 64 chunks per head (128 CTAs in one wave)
    cuts = plan_segments([65536], 8, 132)
    assert cuts == [list(range(4096, 65536, 4096))]
    # many heads or balanced batches: walking whole sequences is at least as fast
    assert plan_segments([8192], 64, 132) is None
    assert plan_segments([2048] * 8, 32, 132) is None
    # a split's own cost (launches, allocations) counts once: larger than the walk it saves, no split
    assert plan_segments([65536], 8, 132, cost=SplitCost(fixed=1000.0)) is None
    assert plan_segments([65536], 8, 132, cost=SplitCost(fixed=100.0)) is not None
    # cut points are chunk multiples inside each sequence, and the split is expected to win
    lengths = [40000, 100, 9000]
    cuts = plan_segments(lengths, 4, 132)
    assert cuts is not None
    assert chunk_walk_ms(lengths, 4, 132, 1.0, True) < 0.97 * chunk_walk_ms(lengths, 4, 132, 1.0, False)
    for n, c in zip(lengths, cuts, strict=True):
        assert all(x % 64 == 0 and 0 < x < n for x in c) and c == sorted(c)


def test_the_long_sequence_of_a_skewed_batch_is_split_alone():
    """Half of 16k tokens in one sequence, nine short ones, 32 heads: the short ones fill the SMs while the long
    one is walked in pieces."""
    lengths = [8192] + [910] * 8 + [912]
    cost = SplitCost(0.69, 0.45, 0.01, cached=True)  # a link per value head
    cuts = plan_segments(lengths, 32, 132, cost=cost)
    assert cuts is not None and len(cuts[0]) >= 1 and not any(cuts[1:])
    assert chunk_walk_ms(lengths, 32, 132, 1.0, True, cost) < 0.8 * chunk_walk_ms(lengths, 32, 132, 1.0, False)


def test_walk_model_counts_waves():
    # 34 segments x 4 heads = 136 CTAs on 132 SMs: four SMs run two of them
    assert _walk([10] * 34, 4, 132) == 20
    assert _walk([10] * 33, 4, 132) == 10
    # the four extra CTAs are short: they fit behind the short ones
    assert _walk([10] * 32 + [1, 1], 4, 132) == 10
    # far more CTAs than SMs: 61 waves of equal ones; of mixed ones, the chunk-CTAs spread over the SMs
    assert _walk([3] * 1000, 8, 132) == 3 * 61
    assert _walk([5] * 500 + [1] * 2000, 8, 132) == math.ceil(4500 * 8 / 132)


def test_pass_ranges_are_copied_once_per_split():
    """A model's layers split the same way: the three passes' token ranges go to the device once for a split, not
    once per pass and call (each such copy from pageable memory waits for the stream)."""
    cuts = [[64, 128], [192]]
    offsets = [0, 300, 750]
    q, k, v, g, beta = make(offsets[-1], 1, 2, 16, per_key=False)
    seen = []

    def run(mode, starts, ends, h0, out):
        seen.append((mode, starts, starts.tolist(), ends.tolist()))  # kept alive: no address reuse
        return reference_runner(q, k, v, g, beta, 0.25)(mode, starts, ends, h0, out)

    for _ in range(2):
        split_forward(run, offsets, cuts, None, torch.empty_like(v), True)
    first, second = seen[:3], seen[3:]
    assert [s[0] for s in first] == ["full", "transition", "correction"]
    assert first[0][2:] == ([0, 64, 128, 300, 492], [64, 128, 300, 492, 750])
    assert first[1][2:] == ([64], [128])  # the middle segments (the first ones ran from their true start)
    assert first[2][2:] == ([64, 128, 492], [128, 300, 750])  # every segment but each sequence's first
    # one device copy, shared by all passes of both calls
    assert len({s[1].untyped_storage().data_ptr() for s in seen}) == 1
    assert [s[2:] for s in second] == [s[2:] for s in first]


def test_split_cost_from_microseconds():
    """Measured times in microseconds become fractions of the unsplit chunk; the first pass defaults to a whole chunk
    and ``lone`` passes through as a fraction."""
    cost = SplitCost.from_us(4.0, 2.0, 1.0, 0.5, cached=True, fixed=20.0, wave=8.0, lone=0.9)
    assert cost == SplitCost(0.5, 0.25, 0.125, True, 1.0, 5.0, 2.0, 0.9)
    assert SplitCost.from_us(4.0, 2.0, 1.0, 0.5, first=6.0).first == 1.5


def test_the_torch_chain_takes_diagonal_transitions():
    """A diagonal transition (per-key decays, [HV, K]) links the starts as the full map diag(d) does."""
    from cula.ops.segment_split import chain_starts_torch

    HV, K, V = 2, 4, 3
    local = torch.randn(3, HV, K, V, dtype=torch.float64)
    decay = torch.rand(1, HV, K, dtype=torch.float64)
    offsets = torch.tensor([0, 3])
    rows = torch.tensor([[0, -1, -1], [1, 0, 0], [2, -1, 1]])
    got = torch.full((2, HV, K, V), float("nan"), dtype=torch.float64)
    want = got.clone()
    chain_starts_torch(local, decay, got, offsets, rows)
    chain_starts_torch(local, torch.diag_embed(decay), want, offsets, rows)
    torch.testing.assert_close(got, want, rtol=0, atol=1e-15)
    torch.testing.assert_close(got[1], local[1] + decay[0][..., None] * local[0], rtol=0, atol=1e-15)
