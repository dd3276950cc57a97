"""GLA backward on SM90 (cula.gla.chunk_bwd_sm90): GLA's kernel's two state walks against the chunked plan
(cula.ops.chunk_backward, per-key gate), and every gradient of chunk_gla served by cuLA's backward (opt-in, the
kernel forced; passes 3 and 4 by PyTorch products or by their kernel) against the fp64 reference backend's autograd,
per sequence and over the call."""

import pytest
import torch
import torch.nn.functional as F
from delta_rule_recurrence import check_gradients, check_state_walk, gradient_passes_fixture, needs_sm90, offsets_of

import cula

cutlass = pytest.importorskip("cutlass")
pytestmark = [pytest.mark.gpu, needs_sm90]


@pytest.mark.parametrize("walk", ["states", "state_grads"])
@pytest.mark.parametrize("D", [64, 128])
def test_state_walks_store_the_plans_checkpoints(walk, D):
    """Each checkpoint (and the walk's final state) of GLA's kernel within bf16 rounding of the plan's, per sequence,
    on a varlen batch with empty, one-token and odd sequences and a start state."""
    from cula.gla.chunk_fwd_sm90 import GLA_SM90

    check_state_walk(GLA_SM90, walk, D, per_key_gate=True)


gradient_passes = gradient_passes_fixture("CULA_KEY_GRADIENT_KERNEL")


def gla_inputs(B, T, H, D, h0, N=None):
    torch.manual_seed(T + D)
    return {
        "q": torch.randn(B, T, H, D, device="cuda").bfloat16(),
        "k": (torch.randn(B, T, H, D, device="cuda") * D**-0.5).bfloat16(),
        "v": torch.randn(B, T, H, D, device="cuda").bfloat16(),
        "g": F.logsigmoid(torch.randn(B, T, H, D, device="cuda") + 3.0),
        "initial_state": torch.randn(N or B, H, D, D, device="cuda") * 0.1 if h0 else None,
    }


@pytest.mark.parametrize("T,h0", [(1, False), (65, True), (1000, True)])
def test_gla_gradients_fixed_length(gradient_passes, monkeypatch, T, h0):
    check_gradients(cula.gla.chunk_gla, gla_inputs(2, T, 2, 128, h0), {}, monkeypatch)


@pytest.mark.parametrize("D", [64, 128])
def test_gla_gradients_varlen(gradient_passes, monkeypatch, D):
    lengths = [0, 1, 130, 64, 777]
    inputs = gla_inputs(1, sum(lengths), 2, D, True, N=len(lengths))
    cu = torch.tensor(offsets_of(lengths), device="cuda")
    check_gradients(cula.gla.chunk_gla, inputs, {"cu_seqlens": cu}, monkeypatch, lengths)


def test_gla_gradients_state_v_first_and_steep_gates(gradient_passes, monkeypatch):
    inputs = gla_inputs(2, 300, 2, 128, True)
    inputs["initial_state"] = inputs["initial_state"].transpose(-1, -2).contiguous()
    inputs["g"][0, 100, :, :16] = -1e4
    inputs["g"][1, 200] = float("-inf")
    check_gradients(cula.gla.chunk_gla, inputs, {"state_v_first": True}, monkeypatch)


def test_gla_gradients_steep_in_every_chunk(gradient_passes, monkeypatch):
    """Gates of -3 to -4 per token on every key: every chunk past the gradient kernel's SAFE_SPAN (its steep path)."""
    inputs = gla_inputs(1, 200, 2, 128, True)
    inputs["g"] = -3.0 - torch.rand_like(inputs["g"])
    check_gradients(cula.gla.chunk_gla, inputs, {}, monkeypatch)
