"""GDN's backward on SM90 (cula.gdn.chunk_bwd_sm90): its state walks (cula.sm90.walks with the scalar-gate kernel and
the delta rule), each checkpoint of the forward walk ("states") and of the reverse walk through the transposed chain
("state_grads") against the delta rule's chunked plan (cula.ops.chunk_backward.delta_backward) in fp64, per sequence,
on a varlen batch with empty, one-token and odd sequences, GVA and start states; then every gradient of the public
entry point against the fp64 reference's autograd, in-kernel options included."""

import pytest
import torch
import torch.nn.functional as F
from delta_rule_recurrence import check_gradients, needs_sm90, offsets_of, rel_rmse

import cula
from cula.ops import chunk_backward

cutlass = pytest.importorskip("cutlass")
pytestmark = [pytest.mark.gpu, needs_sm90]


@pytest.mark.parametrize("walk", ["states", "state_grads"])
@pytest.mark.parametrize("D,H,HV", [(128, 2, 4), (64, 2, 2)])
def test_gdn_walks_store_the_plans_checkpoints(walk, D, H, HV):
    from cula.gdn.chunk_fwd_sm90 import GDN_SM90
    from cula.sm90.walks import state_walk

    torch.manual_seed(0)
    lengths = [0, 1, 130, 64, 777]
    offsets = offsets_of(lengths)
    T, N = offsets[-1], len(lengths)
    q = torch.randn(1, T, H, D, device="cuda").bfloat16()
    k = F.normalize(torch.randn(1, T, H, D, device="cuda"), dim=-1).bfloat16()
    v = torch.randn(1, T, HV, D, device="cuda").bfloat16()
    do = torch.randn(1, T, HV, D, device="cuda").bfloat16()
    g = F.logsigmoid(torch.randn(1, T, HV, device="cuda") + 3.0)
    beta = torch.rand(1, T, HV, device="cuda")
    h0 = torch.randn(N, HV, D, D, device="cuda") * 0.1
    dht = torch.randn(N, HV, D, D, device="cuda") * 0.1
    cu = torch.tensor(offsets, dtype=torch.int32, device="cuda")
    _, rows = chunk_backward.chunk_token_index(offsets, False)
    scale = D**-0.5
    start, values = (h0, v) if walk == "states" else (dht, do)
    got, final = state_walk(GDN_SM90, walk, q, k, values, g, beta, scale, start, cu, rows, False)
    torch.cuda.synchronize()
    firsts = chunk_backward.checkpoint_rows(offsets, False)
    rep = HV // H
    for n, (s, e) in enumerate(zip(offsets[:-1], offsets[1:], strict=True)):
        if e == s:  # no chunk: the walk's final state is where it started
            assert rel_rmse(final[n], start[n].double()) <= 1e-6, n
            continue
        heads = lambda t, s=s, e=e: t[0, s:e].transpose(0, 1).double()  # noqa: E731
        qn, kn = (heads(x).repeat_interleave(rep, dim=0) for x in (q, k))
        plan = chunk_backward.delta_backward(
            qn, kn, heads(v), heads(beta), heads(g), heads(do), scale, h0[n].double(), dht[n].double()
        )
        want, want_final = (plan["starts"], plan["final"]) if walk == "states" else (plan["ends"], plan["dh0"])
        for c, ref in enumerate(want):
            err = rel_rmse(got[firsts[n] + c].transpose(-1, -2), ref)
            assert err <= 0.005, (n, c, err)
        assert rel_rmse(final[n], want_final) <= 0.005, n


@pytest.fixture(params=["pytorch", "kernel"])
def gradient_passes(request, monkeypatch):
    """Passes 3 and 4 by PyTorch products, or by their kernel (CULA_DELTA_GRADIENT_KERNEL=1)."""
    monkeypatch.setenv("CULA_DELTA_GRADIENT_KERNEL", "1" if request.param == "kernel" else "0")
    return request.param


def gdn_inputs(B, T, H, HV, D=128, options=False, N=None):
    torch.manual_seed(T + HV)
    inputs = {
        "q": torch.randn(B, T, H, D, device="cuda").bfloat16(),
        "k": F.normalize(torch.randn(B, T, H, D, device="cuda"), dim=-1).bfloat16(),
        "v": torch.randn(B, T, HV, D, device="cuda").bfloat16(),
        "g": F.logsigmoid(torch.randn(B, T, HV, device="cuda") + 3.0),
        "beta": torch.rand(B, T, HV, device="cuda"),
        "initial_state": torch.randn(N or B, HV, D, D, device="cuda") * 0.1,
    }
    if options:  # raw gate and beta, un-normalised keys: the kernel's options make them
        inputs["k"] = (torch.randn(B, T, H, D, device="cuda") * 2).bfloat16()
        inputs["g"] = torch.randn(B, T, HV, device="cuda")
        inputs["beta"] = torch.randn(B, T, HV, device="cuda")
        inputs["A_log"] = torch.rand(HV, device="cuda")
        inputs["dt_bias"] = torch.rand(HV, device="cuda")
    return inputs


@pytest.mark.parametrize("T", [1, 65, 300])
def test_gdn_gradients_fixed_length(gradient_passes, monkeypatch, T):
    check_gradients(cula.gdn.chunk_gated_delta_rule, gdn_inputs(2, T, 2, 2), {}, monkeypatch)


@pytest.mark.parametrize("D", [64, 128])
def test_gdn_gradients_varlen_gva(gradient_passes, monkeypatch, D):
    lengths = [0, 1, 130, 64, 777]
    inputs = gdn_inputs(1, sum(lengths), 2, 4, D=D, N=len(lengths))
    cu = torch.tensor(offsets_of(lengths), device="cuda")
    check_gradients(cula.gdn.chunk_gated_delta_rule, inputs, {"cu_seqlens": cu}, monkeypatch, lengths)


def test_gdn_gradients_through_in_kernel_options(gradient_passes, monkeypatch):
    extra = {"use_qk_l2norm_in_kernel": True, "use_gate_in_kernel": True, "use_beta_sigmoid_in_kernel": True}
    check_gradients(cula.gdn.chunk_gated_delta_rule, gdn_inputs(2, 200, 2, 4, options=True), extra, monkeypatch)


@pytest.mark.parametrize("T", [130, 1000])
def test_gdn_chunk_gradients_are_the_same_bits_on_every_run(T):
    """The per-chunk gradient kernel, run 64 times on the same inputs, gives the same bits each time: racecheck
    reports write-after-read hazards inside its last, partial chunk that the code's barriers should exclude (PERF.md,
    the backward's sanitizer runs); a real race would change the outputs now and then."""
    from cula.gdn.chunk_bwd_sm90 import delta_chunk_gradients_sm90
    from cula.gdn.chunk_fwd_sm90 import GDN_SM90
    from cula.sm90 import walks

    torch.manual_seed(0)
    B, H, D = 2, 16, 128
    q = torch.randn(B, T, H, D, device="cuda").bfloat16()
    k = F.normalize(torch.randn(B, T, H, D, device="cuda"), dim=-1).bfloat16()
    v, do = (torch.randn(B, T, H, D, device="cuda").bfloat16() for _ in range(2))
    g = F.logsigmoid(torch.randn(B, T, H, device="cuda") + 3.0)
    beta = torch.rand(B, T, H, device="cuda")
    scale = D**-0.5
    w = walks.both_walks(GDN_SM90, q, k, v, do, g, beta, scale, None, None, None, None, False)
    runs = [
        delta_chunk_gradients_sm90(q, k, v, do, g, beta, w.starts, w.ends, w.index, scale, False) for _ in range(64)
    ]
    for n, run in enumerate(runs[1:], 1):
        for name, first, again in zip(("dq", "dk", "dv", "dg", "dbeta"), runs[0], run, strict=True):
            assert torch.equal(first, again), f"run {n}: {name} differs from the first run's"
