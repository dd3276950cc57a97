"""KDA chunked forward on SM90 (cula.kda.chunk_fwd_sm90) against an fp64 per-token recurrence; its dispatch."""

import dataclasses
from types import SimpleNamespace

import pytest
import torch
import torch.nn.functional as F
from delta_rule_recurrence import (
    check_fwd,
    check_fwd_in_cuda_graph,
    check_fwd_on_busy_stream,
    needs_sm90,
    rel_rmse,
)

import cula

cutlass = pytest.importorskip("cutlass")

LOWER_BOUND = -5.0


def make_inputs(B, T, H, HV, D=128, beta_dtype=torch.float32, stress=False, device="cuda"):
    """Gates lower_bound * sigmoid(randn) (FLA's bounded form); ``stress`` pins a third of them near the bound."""
    q = F.normalize(torch.randn(B, T, H, D, device=device), dim=-1).bfloat16()
    k = F.normalize(torch.randn(B, T, H, D, device=device), dim=-1).bfloat16()
    v = torch.randn(B, T, HV, D, device=device).bfloat16()
    g = LOWER_BOUND * torch.sigmoid(torch.randn(B, T, HV, D, device=device))
    if stress:
        near = torch.rand(B, T, HV, D, device=device) < 0.33
        g = torch.where(near, torch.full_like(g, LOWER_BOUND * 0.999), g)
        g[..., :8] = LOWER_BOUND  # some channels at the bound on every token
    beta = torch.rand(B, T, HV, device=device).sigmoid().to(beta_dtype)
    return q, k, v, g.float().contiguous(), beta


def raw_gate(T, HV, D=128):
    """A raw bf16 gate input [1, T, HV, D] for the kernel to activate (``gate``)."""
    return (torch.randn(1, T, HV, D, device="cuda") * 2).bfloat16()


def run_case(
    B, T, H, HV, cu=None, h0=False, state_v_first=False, beta_dtype=torch.float32, stress=False, split=False, D=128
):
    from cula.kda.chunk_fwd_sm90 import chunk_kda_fwd_sm90, supports

    inputs = make_inputs(B, T, H, HV, D=D, beta_dtype=beta_dtype, stress=stress)
    check_fwd(chunk_kda_fwd_sm90, supports, inputs, cu, h0, state_v_first, split)


@pytest.mark.gpu
@needs_sm90
@pytest.mark.parametrize("T", [63, 64, 65, 130, 1000])
def test_fixed_length(T):
    run_case(2, T, 2, 2)


@pytest.mark.gpu
@needs_sm90
@pytest.mark.parametrize("T", [64, 300])
def test_gates_at_the_bound(T):
    run_case(1, T, 2, 2, stress=True)


@pytest.mark.gpu
@needs_sm90
def test_gva_initial_state_bf16_beta():
    run_case(1, 200, 2, 4, h0=True, beta_dtype=torch.bfloat16)


@pytest.mark.gpu
@needs_sm90
@pytest.mark.parametrize("state_v_first", [False, True])
def test_varlen(state_v_first):
    # zero-length sequences first, between and last (FLA accepts them): their final state is their initial state
    run_case(1, 700, 1, 2, cu=[0, 0, 1, 65, 65, 300, 700, 700], h0=True, state_v_first=state_v_first)


@pytest.mark.gpu
@needs_sm90
@pytest.mark.parametrize("split", [False, True])
def test_value_blocks(monkeypatch, split):
    """Each value head walked by two CTAs of 64 value columns (CULA_VALUE_BLOCKS=2; both state warpgroups hold the
    CTA's rows), GVA, varlen with empty and one-token sequences, initial states; a split call's cached passes keep
    one CTA per head."""
    from cula.sm90 import entry

    monkeypatch.setenv(entry.ENV_VALUE_BLOCKS, "2")
    cu = [0, 0, 1, 65, 65, 300, 700, 700] if not split else [0, 1, 1500, 1500, 2701]
    run_case(1, cu[-1], 1, 2, cu=cu, h0=True, split=split)
    assert entry.last_plan().value_blocks == (1 if split else 2)


@pytest.mark.gpu
@needs_sm90
def test_public_api_with_in_kernel_options(monkeypatch):
    B, T, H, HV, D = 1, 150, 2, 4, 128
    dev = "cuda"
    args = {
        "q": torch.randn(B, T, H, D, device=dev).bfloat16(),
        "k": torch.randn(B, T, H, D, device=dev).bfloat16(),
        "v": torch.randn(B, T, HV, D, device=dev).bfloat16(),
        "g": torch.randn(B, T, HV, D, device=dev).bfloat16(),
        "beta": torch.randn(B, T, HV, device=dev).bfloat16(),
        "initial_state": torch.randn(B, HV, D, D, device=dev) * 0.05,
        "output_final_state": True,
        "safe_gate": True,
        "lower_bound": LOWER_BOUND,
        "use_gate_in_kernel": True,
        "use_qk_l2norm_in_kernel": True,
        "use_beta_sigmoid_in_kernel": True,
        "A_log": torch.empty(HV, device=dev).uniform_(0, 1.5).log(),
        "dt_bias": torch.randn(HV * D, device=dev) * 0.5,
    }
    fn = cula.kda.chunk_kda
    o, ht = fn(**args)
    decision = cula.last_decision(fn)
    assert decision.backend == "cute" and "kda.chunk_fwd_sm90" in decision.reason, decision
    monkeypatch.setenv("CULA_BACKEND", "torch")
    o_ref, ht_ref = fn(**args)
    assert cula.last_decision(fn).backend == "torch"
    assert rel_rmse(o, o_ref.double()) <= 5e-3, rel_rmse(o, o_ref.double())
    assert rel_rmse(ht, ht_ref.double()) <= 5e-3, rel_rmse(ht, ht_ref.double())


@pytest.mark.gpu
@needs_sm90
def test_split_sequences():
    """Long sequences cut every 1024 tokens (cula.ops.segment_split): three kernel passes, starts chained."""
    run_case(2, 2100, 1, 2, split=True, stress=True)


@pytest.mark.gpu
@needs_sm90
@pytest.mark.parametrize("state_v_first", [False, True])
def test_split_varlen_initial_state(state_v_first):
    cu = [0, 0, 1, 1500, 1500, 1501, 3700, 3700]  # with zero-length sequences, in the whole sequences' launch
    run_case(1, 3700, 2, 2, cu=cu, h0=True, state_v_first=state_v_first, split=True)


@pytest.mark.gpu
@needs_sm90
def test_split_on_the_callers_busy_stream():
    """With the gate in the kernel and no A_log / dt_bias: the kernel reads zero tensors cached across calls."""
    from cula.kda.chunk_fwd_sm90 import chunk_kda_fwd_sm90
    from cula.ops.gates import kda_gate

    q, k, v, _, beta = make_inputs(1, 2400, 2, 2)
    raw = raw_gate(2400, 2)
    gate = (None, None, LOWER_BOUND)

    def fwd(*args, **kw):
        return chunk_kda_fwd_sm90(*args, gate=gate, **kw)

    g = kda_gate(raw, *gate).float()
    check_fwd_on_busy_stream(fwd, (q, k, v, raw, beta), [0, 0, 100, 2300, 2300, 2400], g_ref=g)


@pytest.mark.gpu
@needs_sm90
@pytest.mark.parametrize("split", [False, True])
def test_captured_in_a_cuda_graph(split):
    """With the gate in the kernel (FLA's KDA layer)."""
    from cula.kda.chunk_fwd_sm90 import chunk_kda_fwd_sm90
    from cula.ops.gates import kda_gate

    HV, D = 2, 128
    A_log = torch.empty(HV, device="cuda").uniform_(1, 16).log()
    gate = (A_log, torch.randn(HV * D, device="cuda") * 0.5, LOWER_BOUND)

    def fwd(*args, **kw):
        return chunk_kda_fwd_sm90(*args, gate=gate, **kw)

    def raw_inputs():
        q, k, v, _, beta = make_inputs(1, 2400, 2, HV, D=D)
        return q, k, v, raw_gate(2400, HV, D), beta

    inputs, fresh = raw_inputs(), raw_inputs()
    g_ref = kda_gate(fresh[3], *gate).float()
    check_fwd_in_cuda_graph(fwd, inputs, fresh, [0, 0, 100, 2300, 2300, 2400], split, g_ref=g_ref)


@pytest.mark.gpu
@needs_sm90
def test_head_dim_64():
    """K = V = 64: warpgroup 0 holds the whole state; odd length with gates at the bound, GVA, varlen, splits."""
    run_case(2, 333, 2, 4, h0=True, stress=True, D=64)
    run_case(1, 266, 2, 2, cu=[0, 1, 2, 72, 136, 265, 266], h0=True, state_v_first=True, D=64)
    run_case(1, 2100, 1, 2, h0=True, split=True, D=64)


@pytest.mark.gpu
@needs_sm90
@pytest.mark.parametrize("D", [128, 64])
def test_l2norm_in_kernel(D):
    """qk_l2norm: raw q and k normalised inside the kernel; checked against the recurrence on normalised inputs
    (varlen with a 1-token sequence, initial state, forced splits)."""
    from cula.kda.chunk_fwd_sm90 import chunk_kda_fwd_sm90, supports

    q, k, v, g, beta = make_inputs(1, 2300, 2, 4, D=D, stress=True)
    q, k = ((x.float() * 3.0 + 0.5).bfloat16() for x in (q, k))
    normed = tuple(F.normalize(x.float(), dim=-1).bfloat16() for x in (q, k))

    def fwd(q_, k_, *args, **kw):  # the kernel gets the raw q, k; the reference the normalised ones
        return chunk_kda_fwd_sm90(q, k, *args, qk_l2norm=True, **kw)

    check_fwd(fwd, supports, (*normed, v, g, beta), [0, 1, 1200, 2300], h0=True, split=True)
    check_fwd(fwd, supports, (*normed, v, g, beta), [0, 1, 1200, 2300], h0=True, split=False)


@pytest.mark.gpu
@needs_sm90
@pytest.mark.parametrize("D", [128, 64])
def test_gate_in_kernel(D):
    """The raw bf16 gate activated by the kernel (lower_bound * sigmoid(exp(A_log) (g + dt_bias))), checked against
    the recurrence on the gate activated in fp32: varlen with a 1-token sequence, GVA, initial state, split and
    unsplit; with and without A_log and dt_bias."""
    from cula.kda.chunk_fwd_sm90 import chunk_kda_fwd_sm90, supports
    from cula.ops.gates import kda_gate

    HV = 4
    q, k, v, _, beta = make_inputs(1, 2300, 2, HV, D=D)
    raw = raw_gate(2300, HV, D)
    A_log = torch.empty(HV, device="cuda").uniform_(1, 16).log()
    dt_bias = torch.randn(HV * D, device="cuda") * 0.5
    for gate in ((A_log, dt_bias, LOWER_BOUND), (None, None, -2.0)):
        g = kda_gate(raw, *gate).float().contiguous()

        def fwd(q_, k_, v_, g_, *args, gate=gate, **kw):  # the kernel gets the raw gate, the reference g
            return chunk_kda_fwd_sm90(q_, k_, v_, raw, *args, gate=gate, **kw)

        for split in (True, False):
            check_fwd(fwd, supports, (q, k, v, g, beta), [0, 1, 1200, 2300], h0=True, split=split)


def test_raw_bf16_gate_goes_to_the_kernel_unactivated(monkeypatch):
    """use_gate_in_kernel with a bf16 g and a lower bound: the entry point hands the kernel the raw gate and its
    parameters (no pass over g before it)."""
    monkeypatch.setattr(torch.Tensor, "is_cuda", property(lambda self: True))
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (9, 0))
    monkeypatch.setattr(
        torch.cuda,
        "get_device_properties",
        lambda device=None: SimpleNamespace(multi_processor_count=132, name="NVIDIA H200"),
    )
    from cula.sm90 import entry

    seen = {}

    def fake_entry(kernel, call):
        seen.update(kernel=kernel.name, g=call.g, gate=call.gate)
        return torch.zeros_like(call.v), None

    monkeypatch.setattr(entry, "chunk_fwd", fake_entry)
    B, T, H, HV, D = 1, 70, 2, 4, 128
    g = torch.randn(B, T, HV, D).bfloat16()
    A_log, dt_bias = torch.rand(HV), torch.randn(HV * D)
    cula.kda.chunk_kda(
        torch.randn(B, T, H, D).bfloat16(),
        torch.randn(B, T, H, D).bfloat16(),
        torch.randn(B, T, HV, D).bfloat16(),
        g,
        torch.rand(B, T, HV),
        safe_gate=True,
        lower_bound=-3.0,
        use_gate_in_kernel=True,
        A_log=A_log,
        dt_bias=dt_bias,
    )
    assert cula.last_decision(cula.kda.chunk_kda).backend == "cute"
    assert seen["kernel"] == "kda" and seen["g"].dtype == torch.bfloat16 and torch.equal(seen["g"], g)
    assert seen["gate"][0] is A_log and seen["gate"][1] is dt_bias and seen["gate"][2] == -3.0


def test_dispatch_picks_the_sm90_kernel_only_for_bounded_gates(monkeypatch):
    """On a pretend SM90 device (CPU tensors claiming CUDA): what the kernel serves, and the reasons it declines."""
    monkeypatch.setattr(torch.Tensor, "is_cuda", property(lambda self: True))
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (9, 0))
    monkeypatch.setattr(
        torch.cuda,
        "get_device_properties",
        lambda device=None: SimpleNamespace(multi_processor_count=132, name="NVIDIA H200"),
    )
    B, T, H, HV, D = 1, 70, 2, 4, 128
    args = {
        "q": torch.randn(B, T, H, D).bfloat16(),
        "k": torch.randn(B, T, H, D).bfloat16(),
        "v": torch.randn(B, T, HV, D).bfloat16(),
        "g": -torch.rand(B, T, HV, D),
        "beta": torch.rand(B, T, HV),
        "safe_gate": True,
        "lower_bound": LOWER_BOUND,
    }
    fn = cula.kda.chunk_kda
    decision = cula.explain(fn, **args)
    assert (decision.backend, decision.reason) == ("cute", "kda.chunk_fwd_sm90 on sm_90"), decision
    for change, why in [
        ({"safe_gate": False}, "unbounded gate (safe_gate=False)"),
        ({"chunk_size": 32}, "chunk_size=32"),
        ({"q": args["q"].float(), "k": args["k"].float(), "v": args["v"].float()}, "bfloat16"),
        ({"q": args["q"][..., :64], "k": args["k"][..., :64], "g": args["g"][..., :64]}, "head dims K=64"),
        ({"q": args["q"].detach().requires_grad_(True)}, "require grad"),
        ({"return_intermediate_states": True}, "return_intermediate_states"),
    ]:
        decision = cula.explain(fn, **{**args, **change})
        assert decision.backend != "cute" and why in dict(decision.rejected)["cute"], decision
    # one long sequence over 8 value heads: split across CTAs, the kernel is expected to beat FLA (~0.42 against
    # ~0.74 ms; measured at four times the length: 1.69 against 2.97 ms); with a kernel 8 times slower per chunk the
    # same call goes to FLA, and says why
    T, HV = 16384, 8
    long = {**args, "q": torch.zeros(1, T, H, D).bfloat16(), "k": torch.zeros(1, T, H, D).bfloat16()}
    long.update(v=torch.zeros(1, T, HV, D).bfloat16(), g=torch.zeros(1, T, HV, D), beta=torch.zeros(1, T, HV))
    assert cula.explain(fn, **long).backend == "cute"
    from cula import devices

    row = devices.TABLE["NVIDIA H200"]
    slow = dataclasses.replace(row.kernels["kda"], chunk_us=row.kernels["kda"].chunk_us * 8)
    monkeypatch.setitem(devices.TABLE, "NVIDIA H200", dataclasses.replace(row, kernels={**row.kernels, "kda": slow}))
    decision = cula.explain(fn, **long)
    assert decision.backend != "cute" and "FLA expected faster" in dict(decision.rejected)["cute"], decision
