"""KDA's backward on SM90 (cula.kda.chunk_bwd_sm90): the KDA kernel's state walks (cula.sm90.walks with the delta
rule and the per-key gate in its B tiles), each checkpoint of the forward walk ("states") and of the reverse walk
through the transposed chain ("state_grads") against the delta rule's chunked plan in fp64, per sequence, on a varlen
batch with empty, one-token and odd sequences, GVA and start states; then every gradient of the public entry point
against the fp64 reference's autograd, in-kernel options included."""

import pytest
import torch
from delta_rule_recurrence import check_delta_walk, check_gradients, needs_sm90, offsets_of, training_inputs

import cula

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


@pytest.mark.parametrize("T", [1, 65, 300])
def test_kda_gradients_fixed_length(monkeypatch, T):
    check_gradients(cula.kda.chunk_kda, training_inputs(2, T, 2, 2, 128, True), SAFE, monkeypatch)


@pytest.mark.parametrize("D", [64, 128])
def test_kda_gradients_varlen_gva(monkeypatch, D):
    lengths = [0, 1, 130, 64, 777]
    inputs = training_inputs(1, sum(lengths), 2, 4, D, True, N=len(lengths))
    cu = torch.tensor(offsets_of(lengths), device="cuda")
    check_gradients(cula.kda.chunk_kda, inputs, {**SAFE, "cu_seqlens": cu}, monkeypatch, lengths)


def test_kda_gradients_through_in_kernel_options(monkeypatch):
    extra = {**SAFE, "use_qk_l2norm_in_kernel": True, "use_gate_in_kernel": True, "use_beta_sigmoid_in_kernel": True}
    check_gradients(cula.kda.chunk_kda, training_inputs(2, 200, 2, 4, 128, True, options=True), extra, monkeypatch)
