"""GLA chunked forward on SM100 (cula.gla.chunk_fwd_sm100: chunks of 128, the scores by 32-token blocks against
their middle tokens or summed directly in a steep chunk, tcgen05 MMAs, the state in TMEM) against cuLA's reference
backend in fp64, per sequence and over the call, NaN-poisoned outputs. Only a Blackwell GPU runs these; none has yet
(the kernel is served only with CULA_UNTESTED_KERNELS=1)."""

import pytest
from delta_rule_recurrence import check_state_walk, needs_sm100
from test_gla_sm90 import run_case

cutlass = pytest.importorskip("cutlass")
pytestmark = [pytest.mark.gpu, needs_sm100]


@pytest.mark.parametrize("T", [1, 127, 128, 129, 1000])
@pytest.mark.parametrize("gates", ["layer", "steep", "resets"])
def test_fixed_length(monkeypatch, T, gates):
    run_case(monkeypatch, 2, T, 2, gates=gates, arch="sm100")


@pytest.mark.parametrize("state_v_first", [False, True])
@pytest.mark.parametrize("gates", ["layer", "resets"])
def test_varlen_initial_state(monkeypatch, state_v_first, gates):
    # sequences of 0, 1, 100, 128, 0, 301 tokens
    cu = [0, 0, 1, 101, 229, 229, 530]
    run_case(monkeypatch, 1, 530, 2, gates=gates, cu=cu, h0=True, state_v_first=state_v_first, arch="sm100")


@pytest.mark.parametrize("gates", ["layer", "steep"])
def test_head_dim_64(monkeypatch, gates):
    run_case(monkeypatch, 2, 333, 2, D=64, gates=gates, h0=True, arch="sm100")


@pytest.mark.parametrize("state_v_first", [False, True])
def test_split_passes(monkeypatch, state_v_first):
    """Long sequences cut every 16 chunks of 128 (forced): the first and correction passes, the transitions from the
    gate and the start chain, varlen with a 1-token sequence and initial states."""
    cu = [0, 4100, 4101, 9101]
    run_case(monkeypatch, 1, 9101, 2, cu=cu, h0=True, state_v_first=state_v_first, split=True, arch="sm100")


@pytest.mark.parametrize("walk", ["states", "state_grads"])
@pytest.mark.parametrize("D", [64, 128])
def test_state_walks_store_the_plans_checkpoints(walk, D):
    """The backward's walks on the SM100 kernel (chunks of 128): each checkpoint and the final state within bf16
    rounding of the plan's, per sequence, varlen with empty, one-token and odd sequences and a start state."""
    from cula.gla.chunk_fwd_sm100 import GLA_SM100

    check_state_walk(GLA_SM100, walk, D, per_key_gate=True)
