"""KDA's backward on SM90 (cula.kda.chunk_bwd_sm90): the KDA kernel's state walks (cula.sm90.walks with the delta
rule and the per-key gate in its B tiles), each checkpoint of the forward walk ("states") and of the reverse walk
through the transposed chain ("state_grads") against the delta rule's chunked plan in fp64, per sequence, on a varlen
batch with empty, one-token and odd sequences, GVA and start states; then every gradient of the public entry point
against the fp64 reference's autograd, in-kernel options included, with passes 3 and 4 by PyTorch products and by
the per-chunk kernel (cula.sm90.key_delta_chunk_bwd, CULA_KDA_GRADIENT_KERNEL=1; as compiled and with
CULA_GRADIENT_TILE_COPIES=1); and that kernel alone against the PyTorch passes on the same checkpoints, per
chunk-head."""

import pytest
import torch
from delta_rule_recurrence import (
    check_delta_walk,
    check_gradients,
    gradient_passes_fixture,
    needs_sm90,
    offsets_of,
    rel_rmse,
    training_inputs,
)

import cula
from cula.ops import chunk_backward

cutlass = pytest.importorskip("cutlass")
pytestmark = [pytest.mark.gpu, needs_sm90]


@pytest.mark.parametrize("walk", ["states", "state_grads"])
@pytest.mark.parametrize("D,H,HV", [(128, 2, 4), (64, 2, 2)])
def test_kda_walks_store_the_plans_checkpoints(walk, D, H, HV):
    from cula.kda.chunk_fwd_sm90 import KDA_SM90

    check_delta_walk(KDA_SM90, walk, D, H, HV, per_key_gate=True)


@pytest.mark.parametrize("walk", ["states", "state_grads"])
def test_kda_walks_fixed_length(walk):
    """The fixed-length walks (their own compiled configurations): B = 2 rows of 200 tokens."""
    from cula.kda.chunk_fwd_sm90 import KDA_SM90

    check_delta_walk(KDA_SM90, walk, 128, 2, 2, per_key_gate=True, lengths=(200, 200), fixed_length=True)


SAFE = {"safe_gate": True, "lower_bound": -5.0}
gradient_passes = gradient_passes_fixture("CULA_KDA_GRADIENT_KERNEL")


@pytest.mark.parametrize("T", [1, 65, 300])
def test_kda_gradients_fixed_length(gradient_passes, monkeypatch, T):
    check_gradients(cula.kda.chunk_kda, training_inputs(2, T, 2, 2, 128, True), SAFE, monkeypatch)


@pytest.mark.parametrize("D", [64, 128])
def test_kda_gradients_varlen_gva(gradient_passes, monkeypatch, D):
    lengths = [0, 1, 130, 64, 777]
    inputs = training_inputs(1, sum(lengths), 2, 4, D, True, N=len(lengths))
    cu = torch.tensor(offsets_of(lengths), device="cuda")
    check_gradients(cula.kda.chunk_kda, inputs, {**SAFE, "cu_seqlens": cu}, monkeypatch, lengths)


def test_kda_gradients_through_in_kernel_options(gradient_passes, monkeypatch):
    extra = {**SAFE, "use_qk_l2norm_in_kernel": True, "use_gate_in_kernel": True, "use_beta_sigmoid_in_kernel": True}
    check_gradients(cula.kda.chunk_kda, training_inputs(2, 200, 2, 4, 128, True, options=True), extra, monkeypatch)


@pytest.mark.parametrize(
    "D,fixed_length,tile_copies",
    [
        (64, False, False),
        (64, True, False),
        (128, False, False),
        (128, True, False),
        (64, False, True),
        (128, False, True),
    ],
)
def test_kda_chunk_gradient_kernel_against_the_rows(D, fixed_length, tile_copies, monkeypatch):
    """Passes 3 and 4 by the kernel against rows_backward (KDA's bounded gate, fp32 products) on the same random
    checkpoints, each chunk row's and head's gradients within the bf16 tolerances: a varlen batch with empty,
    one-token and odd sequences or two fixed-length rows of 100 tokens, GVA, gates at the -5 bound on a quarter of the
    keys. The caching allocator's free memory is NaN-filled first, so that an output element the kernel leaves
    unwritten shows. ``tile_copies``: the kernel's smaller-code variant (CULA_GRADIENT_TILE_COPIES=1)."""
    from cula.kda import chunk_bwd_sm90

    monkeypatch.setenv("CULA_GRADIENT_TILE_COPIES", "1" if tile_copies else "0")
    torch.manual_seed(D)
    lengths = [100, 100] if fixed_length else [0, 1, 130, 64, 77]
    B, T = (2, 100) if fixed_length else (1, sum(lengths))
    H, HV = 2, 4
    offsets = offsets_of(lengths)
    plan = chunk_backward.chunk_rows(offsets, fixed_length, "cuda")
    dev = {"device": "cuda"}
    q = torch.randn(B, T, H, D, **dev).bfloat16()
    k = torch.nn.functional.normalize(torch.randn(B, T, H, D, **dev), dim=-1).bfloat16()
    v, do = torch.randn(B, T, HV, D, **dev).bfloat16(), torch.randn(B, T, HV, D, **dev).bfloat16()
    g = -5.0 * torch.sigmoid(torch.randn(B, T, HV, D, **dev))
    g[..., : D // 4] = -5.0
    beta = torch.rand(B, T, HV, **dev)
    starts, ends = ((torch.randn(plan.rows, HV, D, D, **dev) * 0.3).bfloat16() for _ in range(2))
    torch.full((1 << 28,), float("nan"), **dev)  # freed at once: the outputs below reuse its block
    got = chunk_bwd_sm90.key_delta_chunk_gradients_sm90(
        q, k, v, do, g, beta, starts, ends, plan.kernel_rows, D**-0.5, not fixed_length
    )
    want = chunk_backward.rows_backward(
        q.float(), k.float(), v.float(), do.float(), g, beta, starts.float(), ends.float(), plan.index, D**-0.5,
        bounded_gate=True,
    )  # fmt: skip
    tolerances = {"dq": 0.008, "dk": 0.008, "dv": 0.008, "dg": 0.02, "dbeta": 0.02}
    for (name, tol), a, b in zip(tolerances.items(), got, want, strict=True):
        assert torch.isfinite(a).all(), name
        a, b = a.reshape(B * T, a.shape[2], -1), b.reshape(B * T, b.shape[2], -1)
        for row in plan.index.cpu():
            tokens = row[row < B * T]
            for head in range(b.shape[1]):
                if len(tokens) and b[tokens, head].norm() > 0:
                    err = rel_rmse(a[tokens, head], b[tokens, head])
                    assert err <= tol, (name, tokens[0].item(), head, err)
