"""GLA chunked forward on SM90 (cula.gla.chunk_fwd_sm90: KDA's kernel without the delta rule, P by halves or
directly) against cuLA's reference backend in fp64, per sequence and over the call: FLA's layer gates (the halves),
steep gates and -inf (the direct path), odd and varlen lengths with 0- and 1-token sequences, D = 64, state_v_first."""

import importlib

import pytest
import torch
import torch.nn.functional as F
from delta_rule_recurrence import assert_matches, needs_sm90

import cula

cutlass = pytest.importorskip("cutlass")
pytestmark = [pytest.mark.gpu, needs_sm90]


def make_inputs(B, T, H, D=128, gates="layer", seed=0):
    gen = torch.Generator(device="cuda").manual_seed(seed)

    def rnd(*shape):
        return torch.randn(*shape, device="cuda", generator=gen)

    q, k, v = rnd(B, T, H, D).bfloat16(), (rnd(B, T, H, D) * D**-0.5).bfloat16(), rnd(B, T, H, D).bfloat16()
    if gates == "layer":  # FLA's GLA layer: logsigmoid / 16
        g = F.logsigmoid(rnd(B, T, H, D) * 4) / 16
    elif gates == "steep":
        g = -20 * torch.rand(B, T, H, D, device="cuda", generator=gen)
    else:  # mild, with a reset (-inf) and spikes in some channels
        g = F.logsigmoid(rnd(B, T, H, D) + 3)
        g[:, T // 3, :, : D // 2] = float("-inf")
        g[:, T // 2, 0] = -1e4
    return q, k, v, g


def reference(q, k, v, g, scale, h0, cu, monkeypatch):
    """cuLA's reference backend in fp64 (h0 [N, H, K, V]): (o, final state [N, H, K, V])."""
    monkeypatch.setenv("CULA_BACKEND", "torch")
    f64 = [None if x is None else x.double() for x in (q, k, v, g, h0)]
    o, ht = cula.gla.chunk_gla(*f64[:4], scale=scale, initial_state=f64[4], output_final_state=True, cu_seqlens=cu)
    monkeypatch.delenv("CULA_BACKEND")
    return o, ht


def run_case(
    monkeypatch, B, T, H, D=128, gates="layer", cu=None, h0=False, state_v_first=False, split=None, arch="sm90"
):
    """One call of the ``arch`` kernel (SM90's or SM100's) on NaN-poisoned outputs, against the fp64 reference."""
    module = importlib.import_module(f"cula.gla.chunk_fwd_{arch}")
    forward, supports = getattr(module, f"chunk_gla_fwd_{arch}"), module.supports
    q, k, v, g = make_inputs(B, T, H, D, gates)
    N = B if cu is None else len(cu) - 1
    cu_t = None if cu is None else torch.tensor(cu, dtype=torch.int32, device=q.device)
    ok, why = supports(q, k, v, g, None, cu_t)
    assert ok, why
    init = torch.randn(N, H, D, D, device=q.device) * 0.1 if h0 else None  # [N, H, K, V]
    init_arg = init.transpose(-1, -2).contiguous() if (h0 and state_v_first) else init
    scale = D**-0.5
    cu_cpu = None if cu is None else torch.tensor(cu)
    # NaN-poisoned outputs: every element the kernel should write must be written
    o_out = torch.full_like(v, float("nan"))
    ht_out = torch.full((N, H, D, D), float("nan"), device=q.device)
    o, ht = forward(
        q, k, v, g, scale, init_arg, True, cu_t, state_v_first, cu_cpu, split=split, out=o_out, final_state_out=ht_out
    )
    assert o is o_out and ht is ht_out
    torch.cuda.synchronize()
    if state_v_first:
        ht = ht.transpose(-1, -2)
    o_ref, ht_ref = reference(q, k, v, g, scale, init, None if cu is None else cu_t.long(), monkeypatch)
    assert_matches(o, ht, o_ref, ht_ref, cu)


@pytest.mark.parametrize("T", [1, 63, 64, 65, 1000])
@pytest.mark.parametrize("gates", ["layer", "steep", "resets"])
def test_fixed_length(monkeypatch, T, gates):
    run_case(monkeypatch, 2, T, 2, gates=gates)


@pytest.mark.parametrize("state_v_first", [False, True])
@pytest.mark.parametrize("gates", ["layer", "resets"])
def test_varlen_initial_state(monkeypatch, state_v_first, gates):
    # sequences of 0, 1, 100, 64, 0, 301 tokens
    cu = [0, 0, 1, 101, 165, 165, 466]
    run_case(monkeypatch, 1, 466, 2, gates=gates, cu=cu, h0=True, state_v_first=state_v_first)


@pytest.mark.parametrize("gates", ["layer", "steep"])
def test_head_dim_64(monkeypatch, gates):
    run_case(monkeypatch, 2, 333, 2, D=64, gates=gates, h0=True)


@pytest.mark.parametrize("gates", ["layer", "resets"])
@pytest.mark.parametrize("state_v_first", [False, True])
def test_split_passes(monkeypatch, gates, state_v_first):
    """Long sequences cut every 16 chunks (forced): the first and correction passes, the middle segments' transitions
    from the gate and the start chain, varlen with a 1-token sequence and initial states."""
    cu = [0, 2100, 2101, 5101]
    run_case(monkeypatch, 1, 5101, 2, gates=gates, cu=cu, h0=True, state_v_first=state_v_first, split=True)


def test_public_entry_point(monkeypatch):
    """chunk_gla served by the kernel, against the reference."""
    q, k, v, g = make_inputs(2, 777, 4)
    o, ht = cula.gla.chunk_gla(q, k, v, g, output_final_state=True)
    assert cula.last_decision(cula.gla.chunk_gla).backend == "cute"
    o_ref, ht_ref = reference(q, k, v, g, 128**-0.5, None, None, monkeypatch)
    assert_matches(o, ht, o_ref, ht_ref)


@pytest.mark.parametrize(
    "case",
    [
        dict(B=2, T=1000, H=2, gates="steep"),
        dict(B=1, T=466, H=2, gates="resets", cu=[0, 0, 1, 101, 165, 165, 466], h0=True, state_v_first=True),
        dict(B=1, T=5101, H=2, gates="layer", cu=[0, 1, 2500, 2500, 5101], h0=True, split=True),
    ],
    ids=["fixed", "varlen_state_v_first", "split"],
)
def test_value_blocks(monkeypatch, case):
    """Each value head walked by two CTAs of 64 value columns (CULA_VALUE_BLOCKS=2; both state warpgroups hold the
    CTA's rows): the split call's passes too."""
    from cula.sm90 import entry

    monkeypatch.setenv(entry.ENV_VALUE_BLOCKS, "2")
    run_case(monkeypatch, **case)
    assert entry.last_plan().value_blocks == 2
