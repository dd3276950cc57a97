"""GDN chunked forward on SM90 (cula.gdn.chunk_fwd_sm90) against an fp64 per-token recurrence."""

import pytest
import torch
import torch.nn.functional as F
from delta_rule_recurrence import check_fwd, check_fwd_in_cuda_graph, check_fwd_on_busy_stream, needs_sm90

cutlass = pytest.importorskip("cutlass")


def make_inputs(B, T, H, HV, D=128, beta_dtype=torch.float32, device="cuda"):
    q = F.normalize(torch.randn(B, T, H, D, device=device), dim=-1).bfloat16()
    k = F.normalize(torch.randn(B, T, H, D, device=device), dim=-1).bfloat16()
    v = torch.randn(B, T, HV, D, device=device).bfloat16()
    g = F.logsigmoid(torch.randn(B, T, HV, device=device) + 3.0) * 0.5
    beta = torch.rand(B, T, HV, device=device).sigmoid().to(beta_dtype)
    return q, k, v, g.float(), beta


def run_case(B, T, H, HV, cu=None, h0=False, state_v_first=False, beta_dtype=torch.float32, split=False, D=128):
    from cula.gdn.chunk_fwd_sm90 import chunk_gated_delta_rule_fwd_sm90, supports

    inputs = make_inputs(B, T, H, HV, D=D, beta_dtype=beta_dtype)
    check_fwd(chunk_gated_delta_rule_fwd_sm90, supports, inputs, cu, h0, state_v_first, split)


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
    # zero-length sequences first, between and last (FLA accepts them): their final state is their initial state
    cu = [0, 0, 1, 2, 72, 72, 136, 265, 266, 266]
    run_case(1, 1 + 1 + 70 + 64 + 129 + 1, 2, 4, cu=cu, h0=True, state_v_first=state_v_first)


@pytest.mark.gpu
@needs_sm90
@pytest.mark.parametrize("split", [False, True])
def test_value_blocks(monkeypatch, split):
    """Each value head walked by two CTAs of 64 value columns (CULA_VALUE_BLOCKS=2), GVA, varlen with empty and
    one-token sequences, initial states; a split call's cached passes keep one CTA per head."""
    from cula.sm90 import entry

    monkeypatch.setenv(entry.ENV_VALUE_BLOCKS, "2")
    cu = [0, 0, 1, 2, 72, 72, 136, 265, 266, 266] if not split else [0, 1, 1500, 1500, 2701]
    run_case(1, cu[-1], 2, 4, cu=cu, h0=True, split=split)
    assert entry.last_plan().value_blocks == (1 if split else 2)


@pytest.mark.gpu
@needs_sm90
def test_split_sequences():
    """Long sequences cut every 1024 tokens (cula.ops.segment_split): three kernel passes, starts chained."""
    run_case(2, 2100, 1, 2, split=True)


@pytest.mark.gpu
@needs_sm90
@pytest.mark.parametrize("state_v_first", [False, True])
def test_split_varlen_initial_state(state_v_first):
    cu = [0, 0, 1, 1500, 1500, 1501, 3700, 3700]  # with zero-length sequences, in the whole sequences' launch
    run_case(1, 3700, 2, 2, cu=cu, h0=True, state_v_first=state_v_first, split=True)


@pytest.mark.gpu
@needs_sm90
def test_split_on_the_callers_busy_stream():
    from cula.gdn.chunk_fwd_sm90 import chunk_gated_delta_rule_fwd_sm90

    cu = [0, 0, 100, 2300, 2300, 2400]
    check_fwd_on_busy_stream(chunk_gated_delta_rule_fwd_sm90, make_inputs(1, 2400, 2, 2), cu)


@pytest.mark.gpu
@needs_sm90
@pytest.mark.parametrize("split", [False, True])
def test_captured_in_a_cuda_graph(split):
    from cula.gdn.chunk_fwd_sm90 import chunk_gated_delta_rule_fwd_sm90

    cu = [0, 0, 100, 2300, 2300, 2400]
    inputs, fresh = make_inputs(1, 2400, 2, 2), make_inputs(1, 2400, 2, 2)
    check_fwd_in_cuda_graph(chunk_gated_delta_rule_fwd_sm90, inputs, fresh, cu, split)


@pytest.mark.gpu
@needs_sm90
def test_head_dim_64():
    """K = V = 64: warpgroup 0 holds the whole state; odd length, GVA, varlen with 1-token sequences, splits."""
    run_case(2, 333, 2, 4, h0=True, D=64)
    run_case(1, 266, 2, 2, cu=[0, 1, 2, 72, 136, 265, 266], h0=True, state_v_first=True, D=64)
    run_case(1, 2100, 1, 2, h0=True, split=True, D=64)


@pytest.mark.gpu
@needs_sm90
@pytest.mark.parametrize("D", [128, 64])
def test_l2norm_in_kernel(D):
    """qk_l2norm: raw q and k (norms 0.25-4 per token) normalised inside the kernel, in fp32; checked against the
    recurrence on the exactly normalised inputs (varlen with a 1-token sequence, initial state, splits on and off;
    fixed length).
    Not shifted inputs: with near-parallel keys and weak decay every bf16 chunk algorithm drifts (measured on the
    H200: 0.0088 here, 0.0102 FLA), whatever normalises q and k."""
    from cula.gdn.chunk_fwd_sm90 import chunk_gated_delta_rule_fwd_sm90, supports

    q, k, v, g, beta = make_inputs(1, 2300, 2, 4, D=D)
    q, k = ((x.float() * torch.empty(*x.shape[:-1], 1, device=x.device).uniform_(0.25, 4)).bfloat16() for x in (q, k))
    exact = tuple(F.normalize(x.float(), dim=-1) for x in (q, k))

    def fwd(q_, k_, *args, **kw):  # the kernel gets the raw q, k; the reference the normalised ones
        return chunk_gated_delta_rule_fwd_sm90(q, k, *args, qk_l2norm=True, **kw)

    def supports_raw(q_, k_, *args, **kw):
        return supports(q, k, *args, **kw)

    for split in (True, False):
        check_fwd(fwd, supports_raw, (*exact, v, g, beta), [0, 1, 1200, 2300], h0=True, split=split)
    check_fwd(fwd, supports_raw, (*exact, v, g, beta), h0=True, split=False)  # one fixed-length sequence


@pytest.mark.gpu
@needs_sm90
@pytest.mark.parametrize("split", [False, True])
def test_gates_far_below_zero(split):
    """Log gates of -inf (a full state reset), -1e30 and -300 give the recurrence's answer, finite everywhere
    (the kernel takes gates below -200 at -200: exp of either is zero in fp32)."""
    from cula.gdn.chunk_fwd_sm90 import chunk_gated_delta_rule_fwd_sm90, supports

    T = 2100 if split else 400
    q, k, v, g, beta = make_inputs(2, T, 2, 2)
    g[:, 3] = float("-inf")
    g[0, 70, 1] = -1e30
    g[1, 130] = -300.0
    g[:, T - 5, 0] = float("-inf")
    if split:
        g[:, 1500] = float("-inf")
    check_fwd(chunk_gated_delta_rule_fwd_sm90, supports, (q, k, v, g, beta), h0=True, split=split)
