"""Simple GLA and Lightning chunked forward on SM100 (cula.lightning.chunk_fwd_sm100: chunks of 128, tcgen05 MMAs,
the state in TMEM) against cuLA's reference backend in fp64, per sequence and over the call, NaN-poisoned outputs.
Only a Blackwell GPU runs these; none has yet (the kernel is served only with CULA_UNTESTED_KERNELS=1)."""

import pytest
import torch
from delta_rule_recurrence import assert_matches, gradient_passes_fixture, needs_sm100
from test_lightning_sm90 import make_inputs, reference, run_case

import cula

cutlass = pytest.importorskip("cutlass")
pytestmark = [pytest.mark.gpu, needs_sm100]


@pytest.mark.parametrize("T", [1, 127, 128, 129, 1000])
def test_fixed_length(monkeypatch, T):
    run_case(monkeypatch, 2, T, 2, arch="sm100")


@pytest.mark.parametrize("gate", ["g_gamma", "both", "none"])
def test_gates(monkeypatch, gate):
    run_case(monkeypatch, 1, 300, 3, gate=gate, h0=True, arch="sm100")


@pytest.mark.parametrize("state_v_first", [False, True])
def test_varlen_initial_state(monkeypatch, state_v_first):
    # sequences of 0, 1, 100, 128, 0, 301 tokens
    cu = [0, 0, 1, 101, 229, 229, 530]
    run_case(monkeypatch, 1, 530, 2, cu=cu, h0=True, state_v_first=state_v_first, arch="sm100")


@pytest.mark.parametrize("T", [1, 129, 1000])
def test_head_dim_64(monkeypatch, T):
    """D = 64: the state update's M stays 128, its operand v followed by a tile of zeros (the state rows past V
    unused); varlen with an initial state as well."""
    run_case(monkeypatch, 2, T, 2, D=64, arch="sm100")
    if T == 1000:
        run_case(monkeypatch, 1, 530, 2, D=64, cu=[0, 0, 1, 101, 229, 229, 530], h0=True, arch="sm100")


def test_gates_far_below_zero(monkeypatch):
    """Log gates of -inf, -1e30 and -300 give the reference's answer, finite everywhere."""
    from cula.lightning.chunk_fwd_sm100 import chunk_simple_gla_fwd_sm100

    T = 400
    q, k, v, g, _ = make_inputs(1, T, 2)
    g[:, 3] = float("-inf")
    g[0, 70, 1] = -1e30
    g[0, 130] = -300.0
    cu = [0, T // 3, T]
    cu_t = torch.tensor(cu, dtype=torch.int32, device=q.device)
    h0 = torch.randn(2, 2, 128, 128, device=q.device) * 0.1
    o, ht = chunk_simple_gla_fwd_sm100(q, k, v, g, None, None, h0, True, cu_t, False, torch.tensor(cu))
    torch.cuda.synchronize()
    o_ref, ht_ref = reference(q, k, v, g, None, 128**-0.5, h0, cu_t.long(), monkeypatch)
    assert_matches(o, ht, o_ref, ht_ref, cu)


def test_a_nan_sequence_leaves_its_neighbours_exact(monkeypatch):
    """A varlen call whose middle sequence is all NaN: the others' outputs and states match the reference."""
    from cula.lightning.chunk_fwd_sm100 import chunk_simple_gla_fwd_sm100

    cu = [0, 100, 300, 450]
    q, k, v, g, _ = make_inputs(1, 450, 2)
    for x in (q, k, v):
        x[:, 100:300] = float("nan")
    cu_t = torch.tensor(cu, dtype=torch.int32, device=q.device)
    o, ht = chunk_simple_gla_fwd_sm100(q, k, v, g, None, None, None, True, cu_t, False, torch.tensor(cu))
    torch.cuda.synchronize()
    for lo, hi, n in ((0, 100, 0), (300, 450, 2)):
        sl = slice(lo, hi)
        o_ref, ht_ref = reference(q[:, sl], k[:, sl], v[:, sl], g[:, sl], None, 128**-0.5, None, None, monkeypatch)
        assert_matches(o[:, sl], ht[n : n + 1], o_ref, ht_ref)


def test_public_entry_points_with_the_opt_in(monkeypatch):
    """chunk_simple_gla and chunk_lightning_attn served by the SM100 kernel with CULA_UNTESTED_KERNELS=1."""
    monkeypatch.setenv("CULA_UNTESTED_KERNELS", "1")
    B, T, H, D = 2, 777, 4, 128
    q, k, v, g, _ = make_inputs(B, T, H, D)
    o, ht = cula.lightning.chunk_simple_gla(q, k, v, g=g, output_final_state=True)
    assert cula.last_decision(cula.lightning.chunk_simple_gla).reason.startswith("lightning.chunk_fwd_sm100")
    o_ref, ht_ref = reference(q, k, v, g, None, D**-0.5, None, None, monkeypatch)
    assert_matches(o, ht, o_ref, ht_ref)
    o, ht = cula.lightning.chunk_lightning_attn(q, k, v, layer_idx=3, num_layers=8, output_final_state=True)
    gamma = cula.lightning.reference.lightning_g_gamma(H, 3, 8, q.device)
    o_ref, ht_ref = reference(q, k, v, None, gamma, D**-0.5, None, None, monkeypatch)
    assert_matches(o, ht, o_ref, ht_ref)


@pytest.mark.parametrize("walk", ["states", "state_grads"])
def test_state_walks_store_the_plans_checkpoints(walk):
    """The SM100 kernel's state walks (chunks of 128): each checkpoint and the final state within bf16 rounding of
    the plan's, per sequence, on a varlen batch with empty, one-token and odd sequences and a start state."""
    from delta_rule_recurrence import check_state_walk

    from cula.lightning.chunk_fwd_sm100 import SIMPLE_GLA_SM100

    check_state_walk(SIMPLE_GLA_SM100, walk, 128, per_key_gate=False, lengths=(0, 1, 130, 128, 777))


gradient_passes = gradient_passes_fixture("CULA_CHUNK_GRADIENT_KERNEL", tile_copies=False)


@pytest.mark.parametrize("lengths", [None, [0, 1, 130, 128, 777]], ids=["fixed", "varlen"])
@pytest.mark.parametrize("D", [64, 128])
def test_simple_gla_gradients(monkeypatch, lengths, D, gradient_passes):
    """Every gradient through the SM100 backward (its walks, then the per-chunk gradient kernel
    cula.sm100.scalar_chunk_bwd or PyTorch rows; opt-in, the kernel forced) against the fp64 reference's autograd, per
    sequence and over the call."""
    from delta_rule_recurrence import check_gradients, offsets_of
    from test_lightning_sm90_backward import simple_gla_inputs

    if lengths is None:
        inputs, extra = simple_gla_inputs(2, 1000, 2, D, "both", True), {}
    else:
        inputs = simple_gla_inputs(1, sum(lengths), 2, D, "g", True, N=len(lengths))
        extra = {"cu_seqlens": torch.tensor(offsets_of(lengths), device="cuda")}
    check_gradients(cula.lightning.chunk_simple_gla, inputs, extra, monkeypatch, lengths)
