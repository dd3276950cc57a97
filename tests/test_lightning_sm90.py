"""Simple GLA and Lightning chunked forward on SM90 (cula.lightning.chunk_fwd_sm90: the scalar-gate kernel without
the delta rule) against cuLA's reference backend in fp64, per sequence and over the call."""

import pytest
import torch
import torch.nn.functional as F
from delta_rule_recurrence import assert_matches, needs_sm90

import cula

cutlass = pytest.importorskip("cutlass")
pytestmark = [pytest.mark.gpu, needs_sm90]


def make_inputs(B, T, H, D=128, gate="g", device="cuda"):
    q = torch.randn(B, T, H, D, device=device).bfloat16()
    k = (torch.randn(B, T, H, D, device=device) * D**-0.5).bfloat16()
    v = torch.randn(B, T, H, D, device=device).bfloat16()
    g = F.logsigmoid(torch.randn(B, T, H, device=device) + 3.0) if gate in ("g", "both") else None
    g_gamma = -torch.rand(H, device=device) * 0.5 if gate in ("g_gamma", "both") else None
    return q, k, v, g, g_gamma


def reference(q, k, v, g, g_gamma, scale, h0, cu, monkeypatch):
    """cuLA's reference backend on the same inputs in fp64 (h0 [N, H, K, V]): (o, final state [N, H, K, V])."""
    monkeypatch.setenv("CULA_BACKEND", "torch")
    f64 = [None if x is None else x.double() for x in (q, k, v, g, g_gamma, h0)]
    o, ht = cula.lightning.chunk_simple_gla(
        *f64[:5], scale=scale, initial_state=f64[5], output_final_state=True, cu_seqlens=cu, state_v_first=False
    )
    monkeypatch.delenv("CULA_BACKEND")
    return o, ht


def kernel_of(arch: str):
    """``(forward, supports)`` of the SM90 or SM100 kernel; the SM100 one takes no ``split``."""
    if arch == "sm100":
        from cula.lightning.chunk_fwd_sm100 import chunk_simple_gla_fwd_sm100, supports

        def forward(*args, out=None, final_state_out=None):
            *args, _split = args  # the SM100 kernel walks every sequence whole
            return chunk_simple_gla_fwd_sm100(*args, out=out, final_state_out=final_state_out)

        return forward, supports
    from cula.lightning.chunk_fwd_sm90 import chunk_simple_gla_fwd_sm90, supports

    return chunk_simple_gla_fwd_sm90, supports


def run_case(monkeypatch, B, T, H, D=128, gate="g", cu=None, h0=False, state_v_first=False, split=False, arch="sm90"):
    forward, supports = kernel_of(arch)
    q, k, v, g, g_gamma = make_inputs(B, T, H, D, gate)
    N = B if cu is None else len(cu) - 1
    cu_t = None if cu is None else torch.tensor(cu, dtype=torch.int32, device=q.device)
    ok, why = supports(q, k, v, g, g_gamma, None, cu_t)
    assert ok, why
    init = torch.randn(N, H, D, D, device=q.device) * 0.1 if h0 else None  # [N, H, K, V]
    init_arg = init.transpose(-1, -2).contiguous() if (h0 and state_v_first) else init
    scale = D**-0.5
    o = torch.full((B, T, H, D), float("nan"), dtype=torch.bfloat16, device=q.device)
    ht = torch.full((N, H, D, D), float("nan"), device=q.device)
    cu_cpu = None if cu is None else torch.tensor(cu)
    o, ht = forward(
        q, k, v, g, g_gamma, scale, init_arg, True, cu_t, state_v_first, cu_cpu, split, out=o, final_state_out=ht
    )
    torch.cuda.synchronize()
    if state_v_first:
        ht = ht.transpose(-1, -2)
    cu_ref = None if cu is None else cu_t.long()
    o_ref, ht_ref = reference(q, k, v, g, g_gamma, scale, init, cu_ref, monkeypatch)
    assert_matches(o, ht, o_ref, ht_ref, cu)


@pytest.mark.parametrize("T", [1, 63, 64, 65, 1000])
def test_fixed_length(monkeypatch, T):
    run_case(monkeypatch, 2, T, 2)


@pytest.mark.parametrize("gate", ["g_gamma", "both", "none"])
def test_gates(monkeypatch, gate):
    run_case(monkeypatch, 1, 300, 3, gate=gate, h0=True)


@pytest.mark.parametrize("state_v_first", [False, True])
def test_varlen_initial_state(monkeypatch, state_v_first):
    # sequences of 0, 1, 100, 64, 0, 301 tokens
    run_case(monkeypatch, 1, 466, 2, cu=[0, 0, 1, 101, 165, 165, 466], h0=True, state_v_first=state_v_first)


def test_head_dim_64(monkeypatch):
    run_case(monkeypatch, 2, 333, 2, D=64, h0=True)


@pytest.mark.parametrize("h0", [False, True])
def test_split_sequences(monkeypatch, h0):
    # a cut every 16 chunks: the correction pass, the middle segment's transition from the gate and the start chain
    run_case(monkeypatch, 1, 3000, 2, cu=[0, 2500, 3000], h0=h0, split=True)


def test_public_entry_points(monkeypatch):
    """chunk_simple_gla and chunk_lightning_attn served by the kernel, against the reference."""
    B, T, H, D = 2, 777, 4, 128
    q, k, v, g, _ = make_inputs(B, T, H, D)
    o, ht = cula.lightning.chunk_simple_gla(q, k, v, g=g, output_final_state=True)
    assert cula.last_decision(cula.lightning.chunk_simple_gla).backend == "cute"
    o_ref, ht_ref = reference(q, k, v, g, None, D**-0.5, None, None, monkeypatch)
    assert_matches(o, ht, o_ref, ht_ref)
    o, ht = cula.lightning.chunk_lightning_attn(q, k, v, layer_idx=3, num_layers=8, output_final_state=True)
    assert cula.last_decision(cula.lightning.chunk_lightning_attn).backend == "cute"
    gamma = cula.lightning.reference.lightning_g_gamma(H, 3, 8, q.device)
    o_ref, ht_ref = reference(q, k, v, None, gamma, D**-0.5, None, None, monkeypatch)
    assert_matches(o, ht, o_ref, ht_ref)


@pytest.mark.parametrize("split", [False, True])
def test_gates_far_below_zero(monkeypatch, split):
    """Log gates of -inf (a full state reset), -1e30 and -300 give the reference's answer, finite everywhere."""
    from cula.lightning.chunk_fwd_sm90 import chunk_simple_gla_fwd_sm90

    T = 2100 if split else 400
    q, k, v, g, _ = make_inputs(1, T, 2)
    g[:, 3] = float("-inf")
    g[0, 70, 1] = -1e30
    g[0, 130] = -300.0
    if split:
        g[:, 1500] = float("-inf")
    cu = [0, T // 3, T]
    cu_t = torch.tensor(cu, dtype=torch.int32, device=q.device)
    h0 = torch.randn(2, 2, 128, 128, device=q.device) * 0.1
    o, ht = chunk_simple_gla_fwd_sm90(q, k, v, g, None, None, h0, True, cu_t, False, torch.tensor(cu), split)
    torch.cuda.synchronize()
    o_ref, ht_ref = reference(q, k, v, g, None, 128**-0.5, h0, cu_t.long(), monkeypatch)
    assert_matches(o, ht, o_ref, ht_ref, cu)


@pytest.mark.parametrize(
    "case",
    [
        dict(B=2, T=1000, H=3),
        dict(B=1, T=466, H=2, cu=[0, 0, 1, 101, 165, 165, 466], h0=True, state_v_first=True),
        dict(B=1, T=3000, H=2, cu=[0, 2500, 3000], h0=True, split=True),
        dict(B=1, T=300, H=3, gate="g_gamma", h0=True),
    ],
    ids=["fixed", "varlen_state_v_first", "split", "g_gamma"],
)
def test_value_blocks(monkeypatch, case):
    """Each value head walked by two CTAs of 64 value columns (CULA_VALUE_BLOCKS=2): the split call's correction
    pass too."""
    from cula.sm90 import entry

    monkeypatch.setenv(entry.ENV_VALUE_BLOCKS, "2")
    run_case(monkeypatch, **case)
    assert entry.last_plan().value_blocks == 2
