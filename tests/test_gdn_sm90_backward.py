"""GDN's backward on SM90 (cula.gdn.chunk_bwd_sm90): its state walks (cula.sm90.walks with the scalar-gate kernel and
the delta rule), each checkpoint of the forward walk ("states") and of the reverse walk through the transposed chain
("state_grads") against the delta rule's chunked plan (cula.ops.chunk_backward.delta_backward) in fp64, per sequence,
on a varlen batch with empty, one-token and odd sequences, GVA and start states; then every gradient of the public
entry point against the fp64 reference's autograd, in-kernel options included."""

import pytest
import torch
import torch.nn.functional as F
from delta_rule_recurrence import (
    check_delta_walk,
    check_gradients,
    gradient_passes_fixture,
    needs_sm90,
    offsets_of,
    training_inputs,
)

import cula

cutlass = pytest.importorskip("cutlass")
pytestmark = [pytest.mark.gpu, needs_sm90]


@pytest.mark.parametrize("walk", ["states", "state_grads"])
@pytest.mark.parametrize("D,H,HV", [(128, 2, 4), (64, 2, 2)])
def test_gdn_walks_store_the_plans_checkpoints(walk, D, H, HV):
    from cula.gdn.chunk_fwd_sm90 import GDN_SM90

    check_delta_walk(GDN_SM90, walk, D, H, HV, per_key_gate=False)


gradient_passes = gradient_passes_fixture("CULA_DELTA_GRADIENT_KERNEL")


@pytest.mark.parametrize("T", [1, 65, 300])
def test_gdn_gradients_fixed_length(gradient_passes, monkeypatch, T):
    check_gradients(cula.gdn.chunk_gated_delta_rule, training_inputs(2, T, 2, 2, 128, False), {}, monkeypatch)


@pytest.mark.parametrize("D", [64, 128])
def test_gdn_gradients_varlen_gva(gradient_passes, monkeypatch, D):
    lengths = [0, 1, 130, 64, 777]
    inputs = training_inputs(1, sum(lengths), 2, 4, D, False, N=len(lengths))
    cu = torch.tensor(offsets_of(lengths), device="cuda")
    check_gradients(cula.gdn.chunk_gated_delta_rule, inputs, {"cu_seqlens": cu}, monkeypatch, lengths)


def test_gdn_gradients_through_in_kernel_options(gradient_passes, monkeypatch):
    extra = {"use_qk_l2norm_in_kernel": True, "use_gate_in_kernel": True, "use_beta_sigmoid_in_kernel": True}
    check_gradients(
        cula.gdn.chunk_gated_delta_rule, training_inputs(2, 200, 2, 4, 128, False, options=True), extra, monkeypatch
    )


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
        delta_chunk_gradients_sm90(q, k, v, do, g, beta, w.starts, w.ends, w.chunks, scale, False) for _ in range(64)
    ]
    for n, run in enumerate(runs[1:], 1):
        for name, first, again in zip(("dq", "dk", "dv", "dg", "dbeta"), runs[0], run, strict=True):
            assert torch.equal(first, again), f"run {n}: {name} differs from the first run's"
