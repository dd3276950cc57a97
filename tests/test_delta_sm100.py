"""GDN and KDA chunked forwards on SM100 (cula.gdn.chunk_fwd_sm100, cula.kda.chunk_fwd_sm100: chunks of 128, each
chunk's Tinv (and KDA's P~) made on the host, the chain in tcgen05 MMAs, the state in TMEM) against an fp64
per-token recurrence, per sequence and over the call, NaN-poisoned outputs; KDA's gates with no bound. Only a
Blackwell GPU runs these; none has yet (the kernels are served only with CULA_UNTESTED_KERNELS=1)."""

import pytest
import torch
from delta_rule_recurrence import check_fwd, needs_sm100

cutlass = pytest.importorskip("cutlass")
pytestmark = [pytest.mark.gpu, needs_sm100]


def run_case(
    variant, B, T, H, HV, cu=None, h0=False, state_v_first=False, beta_dtype=torch.float32, steep=False, split=None
):
    if variant == "kda":
        from test_kda_sm90 import make_inputs

        from cula.kda.chunk_fwd_sm100 import chunk_kda_fwd_sm100 as forward
        from cula.kda.chunk_fwd_sm100 import supports
    else:
        from test_gdn_sm90 import make_inputs

        from cula.gdn.chunk_fwd_sm100 import chunk_gated_delta_rule_fwd_sm100 as forward
        from cula.gdn.chunk_fwd_sm100 import supports
    q, k, v, g, beta = make_inputs(B, T, H, HV, beta_dtype=beta_dtype)
    if steep:  # far below FLA's safe_gate bound of -5: a full reset of some key channels, spikes on others
        g[:, T // 3, :, :8] = -torch.inf
        g[:, T // 2 :: 7, :, 8:64] = -40.0
    check_fwd(forward, supports, (q, k, v, g, beta), cu, h0, state_v_first, split)


variants = pytest.mark.parametrize("variant", ["gdn", "kda"])


@variants
@pytest.mark.parametrize("T", [1, 127, 128, 129, 1000])
def test_fixed_length(variant, T):
    run_case(variant, 2, T, 2, 2)


@variants
def test_gva_initial_state_bf16_beta(variant):
    run_case(variant, 1, 300, 2, 4, h0=True, beta_dtype=torch.bfloat16)


@variants
@pytest.mark.parametrize("state_v_first", [False, True])
def test_varlen(variant, state_v_first):
    # sequences of 0, 1, 1, 70, 0, 128, 129, 1 and 0 tokens
    cu = [0, 0, 1, 2, 72, 72, 200, 329, 330, 330]
    run_case(variant, 1, 330, 2, 4, cu=cu, h0=True, state_v_first=state_v_first)


@variants
def test_split_sequence(variant):
    # the 4500-token sequence cut every 16 chunks: its first, transition and correction passes
    run_case(variant, 1, 4631, 2, 2, cu=[0, 1, 4501, 4631], h0=True, split=True)


def test_kda_steep_gates():
    run_case("kda", 1, 600, 2, 2, h0=True, steep=True)
