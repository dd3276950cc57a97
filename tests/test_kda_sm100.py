"""KDA chunked forward on SM100 (cula.kda.chunk_fwd_sm100: chunks of 128, each chunk's Tinv and P~ made on the host,
the chain in tcgen05 MMAs, the state in TMEM) against an fp64 per-token recurrence, per sequence and over the call,
NaN-poisoned outputs; gates with no bound. Only a Blackwell GPU runs these; none has yet (the kernel is served only
with CULA_UNTESTED_KERNELS=1)."""

import pytest
import torch
from delta_rule_recurrence import check_fwd, needs_sm100
from test_kda_sm90 import make_inputs

cutlass = pytest.importorskip("cutlass")
pytestmark = [pytest.mark.gpu, needs_sm100]


def run_case(B, T, H, HV, cu=None, h0=False, state_v_first=False, beta_dtype=torch.float32, steep=False, split=None):
    from cula.kda.chunk_fwd_sm100 import chunk_kda_fwd_sm100, supports

    q, k, v, g, beta = make_inputs(B, T, H, HV, beta_dtype=beta_dtype)
    if steep:  # far below FLA's safe_gate bound of -5: a full reset of some key channels, spikes on others
        g[:, T // 3, :, :8] = -torch.inf
        g[:, T // 2 :: 7, :, 8:64] = -40.0
    check_fwd(chunk_kda_fwd_sm100, supports, (q, k, v, g, beta), cu, h0, state_v_first, split)


@pytest.mark.parametrize("T", [1, 127, 128, 129, 1000])
def test_fixed_length(T):
    run_case(2, T, 2, 2)


def test_gva_initial_state_bf16_beta():
    run_case(1, 300, 2, 4, h0=True, beta_dtype=torch.bfloat16)


@pytest.mark.parametrize("state_v_first", [False, True])
def test_varlen(state_v_first):
    # sequences of 0, 1, 1, 70, 0, 128, 129, 1 and 0 tokens
    cu = [0, 0, 1, 2, 72, 72, 200, 329, 330, 330]
    run_case(1, 330, 2, 4, cu=cu, h0=True, state_v_first=state_v_first)


def test_steep_gates():
    run_case(1, 600, 2, 2, h0=True, steep=True)


def test_split_sequence():
    # the 4500-token sequence cut every 16 chunks: its first, transition and correction passes
    run_case(1, 4631, 2, 2, cu=[0, 1, 4501, 4631], h0=True, split=True)
