"""The chunked backward of gated linear attention (cula.ops.chunk_backward), the plan of the SM90 backward kernels,
against the gradients of cuLA's fp64 reference backend (autograd through its recurrence) on a CPU: every gradient
per head within the bf16 tolerances, for scalar and per-key gates, with initial states and a gradient into the final
state."""

import pytest
import torch
import torch.nn.functional as F

import cula
from cula.ops import chunk_backward
from cula.ops.chunk_emulation import bf16

H, K, V = 2, 64, 64
SCALE = K**-0.5


def rel_rmse(x, ref):
    return ((x.double() - ref.double()).pow(2).mean().sqrt() / ref.double().pow(2).mean().sqrt()).item()


def to_call(x):
    """[H, T, ...] as one sequence of the public ops' [1, T, H, ...], fp64."""
    return x.double()[None].transpose(1, 2).contiguous()


def from_call(x):
    return x[0].transpose(0, 1)


def fp64_gradients(q, k, v, g, do, h0, dht):
    """Gradients of the fp64 reference (chunk_gla for per-key gates, chunk_simple_gla for scalar ones) on the
    bf16-rounded inputs the kernels read, for the cotangents ``do`` and ``dht``."""
    leaves = [to_call(bf16(x)).requires_grad_() for x in (q, k, v)]
    gate = to_call(g).requires_grad_()
    state = h0.double()[None].requires_grad_()
    op = cula.gla.chunk_gla if g.dim() == 3 else cula.lightning.chunk_simple_gla
    o, ht = op(*leaves, g=gate, scale=SCALE, initial_state=state, output_final_state=True)
    torch.autograd.backward([o, ht], [to_call(bf16(do)), dht.double()[None]])
    dq, dk, dv = (from_call(x.grad) for x in leaves)
    return {"dq": dq, "dk": dk, "dv": dv, "dg": from_call(gate.grad), "dh0": state.grad[0]}


def make_gates(kind, T, per_key):
    shape = (H, T, K) if per_key else (H, T)
    if kind == "layer":  # FLA's layers: logsigmoid(x) / 16
        return F.logsigmoid(torch.randn(shape)) / 16
    if kind == "steep":
        return -torch.rand(shape) * 3.0
    g = F.logsigmoid(torch.randn(shape) + 2.0)
    g[:, T // 3] = -1e4  # a spike: the state all but reset
    g[:, T // 2] = float("-inf")
    return g


@pytest.mark.parametrize("per_key", [False, True], ids=["scalar", "per_key"])
@pytest.mark.parametrize("T,gates", [(1, "layer"), (63, "steep"), (200, "layer"), (300, "spikes")])
def test_chunked_backward_matches_the_fp64_gradients(per_key, T, gates):
    torch.manual_seed(T)
    q, k, v, do = torch.randn(H, T, K), torch.randn(H, T, K) * K**-0.5, torch.randn(H, T, V), torch.randn(H, T, V)
    g = make_gates(gates, T, per_key)
    h0, dht = torch.randn(H, K, V) * 0.1, torch.randn(H, K, V) * 0.1
    got = chunk_backward.gated_backward(q, k, v, g, do, SCALE, h0, dht)
    ref = fp64_gradients(q, k, v, g, do, h0, dht)
    for name, tol in (("dq", 0.008), ("dk", 0.008), ("dv", 0.008), ("dh0", 0.008), ("dg", 0.02)):
        assert got[name].shape == ref[name].shape, name
        finite = torch.isfinite(ref[name])
        assert finite.all(), name  # -inf gates: the reference's gradient there is finite too
        for h in range(H):
            err = rel_rmse(got[name][h], ref[name][h])
            assert err <= tol, (name, h, err)


def test_the_chunk_constant_of_the_gate_gradient_is_needed():
    """The last chunk's constant carries dht into every gate: a plan without it is far off."""
    torch.manual_seed(0)
    T = 130
    q, k, v, do = torch.randn(H, T, K), torch.randn(H, T, K) * K**-0.5, torch.randn(H, T, V), torch.randn(H, T, V)
    g, h0, dht = make_gates("layer", T, True), torch.randn(H, K, V) * 0.1, torch.randn(H, K, V)
    ref = fp64_gradients(q, k, v, g, do, h0, dht)
    dropped = chunk_backward.gated_backward(q, k, v, g, do, SCALE, h0, None)
    assert rel_rmse(dropped["dg"], ref["dg"]) > 0.1
