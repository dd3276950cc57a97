"""The split start chain on the GPU (cula.ops.state_chain_sm90) against the PyTorch chain, on plans with several
chains of different lengths, a sequence left whole, and chains without middle segments (no transitions at all);
with full (K x K) transitions, and with diagonal ones (per-key decays: a recurrence without the delta rule)."""

import pytest
import torch
from delta_rule_recurrence import needs_sm90

cutlass = pytest.importorskip("cutlass")

OFFSETS = (0, 100, 700, 1000, 1001, 1300)
CUTS = {"several": ((), (64, 128, 320, 512), (128,), (), (64, 192)), "no middle": ((64,), (), (), (), ())}


@pytest.mark.gpu
@needs_sm90
@pytest.mark.parametrize("cuts", CUTS)
@pytest.mark.parametrize("aligned", [False, True])
@pytest.mark.parametrize("D", [64, 128])
@pytest.mark.parametrize("diagonal", [False, True])
def test_chain_kernel_matches_pytorch(diagonal, D, aligned, cuts):
    from cula.ops.segment_split import _split_plan, chain_starts_torch
    from cula.ops.state_chain_sm90 import chain_starts

    plan = _split_plan("cuda", OFFSETS, CUTS[cuts], aligned)
    HV = 3
    local = torch.randn(plan.segments, HV, D, D, device="cuda")
    trans = None
    if plan.has_middle:
        n = plan.transition[0].numel()
        trans = torch.rand(n, HV, D, device="cuda") if diagonal else torch.randn(n, HV, D, D, device="cuda") / D**0.5
    rows = plan.later
    ref = torch.full((rows, HV, D, D), float("nan"), device="cuda")
    got = ref.clone()
    chain_starts_torch(local, trans, ref, *plan.chain)
    chain_starts(local, trans, got, *plan.chain)
    written = plan.chain[1][:, 2].long()
    written = written[written >= 0]
    assert written.numel() == rows - (len(OFFSETS) - 1 if aligned else 0)  # aligned: no row for a first segment
    assert not got[written].isnan().any()
    torch.testing.assert_close(got[written], ref[written], rtol=1e-4, atol=1e-4)
    unwritten = torch.ones(rows, dtype=torch.bool, device="cuda")
    unwritten[written] = False
    assert got[unwritten].isnan().all()
