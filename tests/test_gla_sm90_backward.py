"""GLA backward on SM90 (cula.gla.chunk_bwd_sm90): GLA's kernel's two state walks against the chunked plan
(cula.ops.chunk_backward, per-key gate), and every gradient of chunk_gla served by cuLA's backward (opt-in, the
kernel forced) against the fp64 reference backend's autograd, per sequence and over the call."""

import pytest
import torch
import torch.nn.functional as F
from delta_rule_recurrence import check_gradients, needs_sm90, offsets_of, rel_rmse

import cula
from cula.ops import chunk_backward

cutlass = pytest.importorskip("cutlass")
pytestmark = [pytest.mark.gpu, needs_sm90]


@pytest.mark.parametrize("walk", ["states", "state_grads"])
@pytest.mark.parametrize("D", [64, 128])
def test_state_walks_store_the_plans_checkpoints(walk, D):
    """Each checkpoint (and the walk's final state) of GLA's kernel within bf16 rounding of the plan's, per sequence,
    on a varlen batch with empty, one-token and odd sequences and a start state."""
    from cula.gla.chunk_fwd_sm90 import GLA_SM90
    from cula.sm90.walks import state_walk

    torch.manual_seed(0)
    lengths = [0, 1, 130, 64, 777]
    offsets = offsets_of(lengths)
    T, H, N = offsets[-1], 2, len(lengths)
    x = torch.randn(1, T, H, D, device="cuda").bfloat16()
    y = torch.randn(1, T, H, D, device="cuda").bfloat16()
    gate = F.logsigmoid(torch.randn(1, T, H, D, device="cuda") + 3.0)
    unread_beta = torch.empty(1, T, H, device="cuda")
    start = torch.randn(N, H, D, D, device="cuda") * 0.1
    cu = torch.tensor(offsets, dtype=torch.int32, device="cuda")
    _, rows = chunk_backward.chunk_token_index(offsets, False)
    scale = 0.3
    got, final = state_walk(GLA_SM90, walk, x, x, y, gate, unread_beta, scale, start, cu, rows, False)
    torch.cuda.synchronize()
    firsts = chunk_backward.checkpoint_rows(offsets, False)
    for n, (s, e) in enumerate(zip(offsets[:-1], offsets[1:], strict=True)):
        heads = lambda t, s=s, e=e: t[0, s:e].transpose(0, 1).double()  # noqa: E731
        if walk == "states":
            want, want_final = chunk_backward.state_walk(heads(x), heads(y), heads(gate), start[n].double())
        else:
            want, want_final = chunk_backward.state_gradient_walk(
                heads(x), heads(y), heads(gate), scale, start[n].double()
            )
        for c, ref in enumerate(want):
            err = rel_rmse(got[firsts[n] + c].transpose(-1, -2), ref)
            assert err <= 0.005, (n, c, err)
        assert rel_rmse(final[n], want_final) <= 0.005, n


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
def test_gla_gradients_fixed_length(monkeypatch, T, h0):
    check_gradients(cula.gla.chunk_gla, gla_inputs(2, T, 2, 128, h0), {}, monkeypatch)


@pytest.mark.parametrize("D", [64, 128])
def test_gla_gradients_varlen(monkeypatch, D):
    lengths = [0, 1, 130, 64, 777]
    inputs = gla_inputs(1, sum(lengths), 2, D, True, N=len(lengths))
    cu = torch.tensor(offsets_of(lengths), device="cuda")
    check_gradients(cula.gla.chunk_gla, inputs, {"cu_seqlens": cu}, monkeypatch, lengths)


def test_gla_gradients_state_v_first_and_steep_gates(monkeypatch):
    inputs = gla_inputs(2, 300, 2, 128, True)
    inputs["initial_state"] = inputs["initial_state"].transpose(-1, -2).contiguous()
    inputs["g"][0, 100, :, :16] = -1e4
    inputs["g"][1, 200] = float("-inf")
    check_gradients(cula.gla.chunk_gla, inputs, {"state_v_first": True}, monkeypatch)
