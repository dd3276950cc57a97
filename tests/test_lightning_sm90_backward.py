"""Simple GLA and Lightning backward on SM90 (cula.lightning.chunk_bwd_sm90): the scalar-gate kernel's two state
walks against the chunked plan (cula.ops.chunk_backward), and every gradient of the public entry points, served by
cuLA's backward, against the fp64 reference backend's autograd, per sequence and over the call."""

import pytest
import torch
import torch.nn.functional as F
from delta_rule_recurrence import (
    check_gradients,
    check_state_walk,
    gradient_passes_fixture,
    needs_sm90,
    offsets_of,
    rel_rmse,
)

import cula

cutlass = pytest.importorskip("cutlass")
pytestmark = [pytest.mark.gpu, needs_sm90]


@pytest.mark.parametrize("walk", ["states", "state_grads"])
@pytest.mark.parametrize("D", [64, 128])
def test_state_walks_store_the_plans_checkpoints(walk, D):
    """Each checkpoint (and the walk's final state) of the kernel within bf16 rounding of the plan's, per sequence,
    on a varlen batch with empty, one-token and odd sequences and a start state."""
    from cula.lightning.chunk_fwd_sm90 import SIMPLE_GLA_SM90

    check_state_walk(SIMPLE_GLA_SM90, walk, D, per_key_gate=False)


gradient_passes = gradient_passes_fixture("CULA_CHUNK_GRADIENT_KERNEL")


def simple_gla_inputs(B, T, H, D, gate, h0, N=None):
    torch.manual_seed(T + D)
    inputs = {
        "q": torch.randn(B, T, H, D, device="cuda").bfloat16(),
        "k": (torch.randn(B, T, H, D, device="cuda") * D**-0.5).bfloat16(),
        "v": torch.randn(B, T, H, D, device="cuda").bfloat16(),
        "g": F.logsigmoid(torch.randn(B, T, H, device="cuda") + 3.0) if gate in ("g", "both") else None,
        "g_gamma": -torch.rand(H, device="cuda") * 0.2 if gate in ("g_gamma", "both") else None,
        "initial_state": torch.randn(N or B, H, D, D, device="cuda") * 0.1 if h0 else None,
    }
    return inputs


@pytest.mark.parametrize("T,gate,h0", [(1, "g", False), (65, "g", True), (1000, "both", True), (300, "g_gamma", False)])
def test_simple_gla_gradients_fixed_length(gradient_passes, monkeypatch, T, gate, h0):
    check_gradients(cula.lightning.chunk_simple_gla, simple_gla_inputs(2, T, 2, 128, gate, h0), {}, monkeypatch)


@pytest.mark.parametrize("D", [64, 128])
def test_simple_gla_gradients_varlen(gradient_passes, monkeypatch, D):
    lengths = [0, 1, 130, 64, 777]
    T = sum(lengths)
    inputs = simple_gla_inputs(1, T, 2, D, "g", True, N=len(lengths))
    cu = torch.tensor(offsets_of(lengths), device="cuda")
    check_gradients(cula.lightning.chunk_simple_gla, inputs, {"cu_seqlens": cu}, monkeypatch, lengths)


def test_simple_gla_gradients_state_v_first(gradient_passes, monkeypatch):
    inputs = simple_gla_inputs(2, 200, 2, 128, "g", True)
    inputs["initial_state"] = inputs["initial_state"].transpose(-1, -2).contiguous()
    check_gradients(cula.lightning.chunk_simple_gla, inputs, {"state_v_first": True}, monkeypatch)


def test_lightning_gradients(gradient_passes, monkeypatch):
    inputs = simple_gla_inputs(2, 500, 4, 128, "none", True)
    del inputs["g"], inputs["g_gamma"]
    extra = {"layer_idx": 1, "num_layers": 4}
    check_gradients(cula.lightning.chunk_lightning_attn, inputs, extra, monkeypatch)


def test_steep_and_reset_gates(gradient_passes, monkeypatch):
    """Gates of -1e4 and -inf (a state reset): finite gradients, as the reference's."""
    inputs = simple_gla_inputs(1, 400, 2, 128, "g", True)
    inputs["g"][0, 100] = -1e4
    inputs["g"][0, 250] = float("-inf")
    check_gradients(cula.lightning.chunk_simple_gla, inputs, {}, monkeypatch)


def test_a_compiled_training_step_holds_the_kernel_ops(monkeypatch):
    """torch.compile(fullgraph=True) of a training step through the kernel's backward: no graph break (the custom
    ops' fake implementations, the backend chosen as the op runs), and the same gradients as eager."""
    monkeypatch.setenv("CULA_BACKEND", "cute")
    torch._dynamo.reset()
    inputs = simple_gla_inputs(1, 200, 2, 128, "g", True)

    def step(q, k, v, g, h0):
        o, ht = cula.lightning.chunk_simple_gla(q, k, v, g=g, initial_state=h0, output_final_state=True)
        return o.float().square().sum() + ht.square().sum()

    names = ("q", "k", "v", "g", "initial_state")
    eager = [inputs[n].detach().clone().requires_grad_() for n in names]
    step(*eager).backward()
    compiled = [inputs[n].detach().clone().requires_grad_() for n in names]
    torch.compile(step, backend="aot_eager", fullgraph=True)(*compiled).backward()
    # chosen as the op ran: the kernel (its host code stays out of the graph)
    assert cula.last_decision(cula.lightning.chunk_simple_gla).reason.startswith("lightning.chunk_fwd_sm90")
    for name, a, b in zip(names, eager, compiled, strict=True):
        assert rel_rmse(b.grad, a.grad.double()) <= 1e-3, name
