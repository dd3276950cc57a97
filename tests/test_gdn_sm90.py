"""GDN chunked forward on SM90 (cula.gdn.chunk_fwd_sm90) against an fp64 per-token recurrence."""

import pytest
import torch
import torch.nn.functional as F
from delta_rule_recurrence import needs_sm90, recurrence, rel_rmse

cutlass = pytest.importorskip("cutlass")


def make_inputs(B, T, H, HV, D=128, beta_dtype=torch.float32, device="cuda"):
    q = F.normalize(torch.randn(B, T, H, D, device=device), dim=-1).bfloat16()
    k = F.normalize(torch.randn(B, T, H, D, device=device), dim=-1).bfloat16()
    v = torch.randn(B, T, HV, D, device=device).bfloat16()
    g = F.logsigmoid(torch.randn(B, T, HV, device=device) + 3.0) * 0.5
    beta = torch.rand(B, T, HV, device=device).sigmoid().to(beta_dtype)
    return q, k, v, g.float(), beta


def run_case(B, T, H, HV, cu=None, h0=False, state_v_first=False, beta_dtype=torch.float32, split=False):
    from cula.gdn.chunk_fwd_sm90 import chunk_gated_delta_rule_fwd_sm90, supports

    q, k, v, g, beta = make_inputs(B, T, H, HV, beta_dtype=beta_dtype)
    N = B if cu is None else len(cu) - 1
    cu_t = None if cu is None else torch.tensor(cu, dtype=torch.int32, device="cuda")
    init = torch.randn(N, HV, 128, 128, device="cuda") * 0.1 if h0 else None
    ok, why = supports(q, k, v, g, beta, initial_state=init, cu_seqlens=cu_t)
    assert ok, why
    scale = 128**-0.5
    o_ref, ht_ref = recurrence(q, k, v, g, beta, scale, init, cu)
    o = torch.full((B, T, HV, 128), float("nan"), dtype=torch.bfloat16, device="cuda")
    ht = torch.full((N, HV, 128, 128), float("nan"), device="cuda")
    init_arg = init.transpose(-1, -2).contiguous() if (h0 and state_v_first) else init
    cu_cpu = None if cu is None else torch.tensor(cu)
    o, ht = chunk_gated_delta_rule_fwd_sm90(
        q, k, v, g, beta, scale, init_arg, True, cu_t, state_v_first, out=o, final_state_out=ht,
        cu_seqlens_cpu=cu_cpu, split=split,
    )  # fmt: skip
    torch.cuda.synchronize()
    if state_v_first:
        ht = ht.transpose(-1, -2)
    assert rel_rmse(o, o_ref) <= 5e-3, rel_rmse(o, o_ref)
    assert rel_rmse(ht, ht_ref) <= 5e-3, rel_rmse(ht, ht_ref)


@pytest.mark.gpu
@needs_sm90
@pytest.mark.parametrize("T", [63, 64, 65, 130, 1000])
def test_fixed_length(T):
    run_case(2, T, 2, 2)


@pytest.mark.gpu
@needs_sm90
def test_gva_initial_state_bf16_beta():
    run_case(1, 200, 2, 4, h0=True, beta_dtype=torch.bfloat16)


@pytest.mark.gpu
@needs_sm90
@pytest.mark.parametrize("state_v_first", [False, True])
def test_varlen(state_v_first):
    run_case(1, 1 + 1 + 70 + 64 + 129 + 1, 2, 4, cu=[0, 1, 2, 72, 136, 265, 266], h0=True, state_v_first=state_v_first)


@pytest.mark.gpu
@needs_sm90
def test_split_sequences():
    """Long sequences cut every 1024 tokens (cula.ops.segment_split): three kernel passes, starts chained."""
    run_case(2, 2100, 1, 2, split=True)


@pytest.mark.gpu
@needs_sm90
@pytest.mark.parametrize("state_v_first", [False, True])
def test_split_varlen_initial_state(state_v_first):
    run_case(1, 3700, 2, 2, cu=[0, 1, 1500, 1501, 3700], h0=True, state_v_first=state_v_first, split=True)


def test_compiles_for_sm90_on_cpu():
    from cula import compile_check

    for name in ("gdn_chunk_fwd_sm90", "gdn_chunk_fwd_sm90[transition]", "gdn_chunk_fwd_sm90[correction]"):
        report = compile_check.check_kernel(name, "sm_90a")
        assert report.ok, (name, report.error)
        assert report.counts["wgmma.mma_async"] > 0
        assert report.counts["cp.async.bulk.tensor"] > 0
