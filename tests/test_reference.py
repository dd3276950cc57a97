"""The PyTorch reference backend against FLA 0.6.0's naive recurrences (CPU, fresh random inputs every run).

The entry points are called through cuLA's public API: on a CPU their dispatch serves every call with the
reference backend (tests/test_api.py checks that decision)."""

import pytest
import torch
import torch.nn.functional as F
from fla.ops.gated_delta_rule.gate import naive_gdn_gate
from fla.ops.gated_delta_rule.naive import naive_recurrent_gated_delta_rule
from fla.ops.gla.naive import naive_recurrent_gla
from fla.ops.kda.gate import naive_kda_gate, naive_kda_lowerbound_gate
from fla.ops.kda.naive import naive_recurrent_kda
from fla.ops.simple_gla.naive import naive_recurrent_simple_gla
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

from cula import gdn, gla, kda, lightning

TOL = 1e-5
DELTA = ("kda", "gdn")  # variants with beta


def rel(x: torch.Tensor, ref: torch.Tensor) -> float:
    return ((x.double() - ref.double()).norm() / ref.double().norm().clamp_min(1e-30)).item()


def assert_close(pairs, tol=TOL):
    for name, (x, ref) in pairs.items():
        assert x.shape == ref.shape, name
        assert rel(x, ref) < tol, f"{name}: rel rmse {rel(x, ref):.2e}"


def make_inputs(variant, T, H=2, HV=None, K=16, V=32, B=2, N=None, h0=True, dtype=torch.float32):
    """Random inputs in FLA layout; ``N`` rows of initial state (default B). k is unit-norm for the delta rule."""
    HV = HV or H
    x = {
        "q": torch.randn(B, T, H, K, dtype=dtype),
        "k": torch.randn(B, T, H, K, dtype=dtype),
        "v": torch.randn(B, T, HV, V, dtype=dtype),
        "g": F.logsigmoid(torch.randn(B, T, HV, K) if variant in ("kda", "gla") else torch.randn(B, T, HV)).to(dtype),
    }
    if variant in DELTA:
        x["k"] = F.normalize(x["k"], dim=-1)
        x["beta"] = torch.rand(B, T, HV, dtype=dtype)
    x["h0"] = torch.randn(N or B, HV, K, V) if h0 else None
    return x


def oracle(variant, x):
    """FLA's naive recurrence (fp32) for one batch; returns (o, final state)."""
    h0, G = x["h0"], x["v"].shape[2] // x["q"].shape[2]
    if variant == "kda":
        return naive_recurrent_kda(x["q"], x["k"], x["v"], x["g"], x["beta"], initial_state=h0, output_final_state=True)
    if variant == "gdn":
        q, k = (x[n].repeat_interleave(G, dim=2) for n in "qk")
        return naive_recurrent_gated_delta_rule(q, k, x["v"], x["beta"], x["g"], None, h0, True)
    if variant == "gla":
        return naive_recurrent_gla(x["q"], x["k"], x["v"], x["g"], initial_state=h0, output_final_state=True)
    return naive_recurrent_simple_gla(x["q"], x["k"], x["v"], x["g"], initial_state=h0, output_final_state=True)


def oracle_varlen(variant, x, cu):
    """The oracle run sequence by sequence over a packed batch of one."""
    outs, states = [], []
    for i in range(len(cu) - 1):
        seq = {n: t[:, cu[i] : cu[i + 1]] for n, t in x.items() if n != "h0"}
        seq["h0"] = None if x["h0"] is None else x["h0"][i : i + 1]
        o, s = oracle(variant, seq)
        outs.append(o)
        states.append(s)
    return torch.cat(outs, 1), torch.cat(states)


REFERENCE = {
    ("kda", True): kda.chunk_kda,
    ("kda", False): kda.fused_recurrent_kda,
    ("gdn", True): gdn.chunk_gated_delta_rule,
    ("gdn", False): gdn.fused_recurrent_gated_delta_rule,
    ("gla", True): gla.chunk_gla,
    ("gla", False): gla.fused_recurrent_gla,
    ("simple_gla", True): lightning.chunk_simple_gla,
    ("simple_gla", False): lightning.fused_recurrent_simple_gla,
}


def run_reference(variant, chunk, x, **kwargs):
    """Call the reference entry point with FLA's argument names."""
    args = {"q": x["q"], "k": x["k"], "v": x["v"], "initial_state": x["h0"], "output_final_state": True, **kwargs}
    args["gk" if (variant, chunk) == ("gla", False) else "g"] = x["g"]
    if variant in DELTA:
        args["beta"] = x["beta"]
    return REFERENCE[variant, chunk](**args)


VARIANTS = [(v, c) for v in ("kda", "gdn", "gla", "simple_gla") for c in (True, False)]


@pytest.mark.parametrize("variant,chunk", VARIANTS)
@pytest.mark.parametrize("T", [1, 63, 65, 130])
def test_matches_naive(variant, chunk, T):
    gva = 2 if variant in DELTA else 1
    x = make_inputs(variant, T, H=2, HV=2 * gva, h0=T != 63)
    o, s = run_reference(variant, chunk, x)
    o_ref, s_ref = oracle(variant, x)
    assert_close({"o": (o, o_ref), "state": (s, s_ref)})


@pytest.mark.parametrize("variant,chunk", VARIANTS)
def test_varlen(variant, chunk):
    lengths = [1, 63, 1, 70]
    cu = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32)
    x = make_inputs(variant, sum(lengths), B=1, N=len(lengths), HV=4 if variant in DELTA else 2)
    o, s = run_reference(variant, chunk, x, cu_seqlens=cu)
    o_ref, s_ref = oracle_varlen(variant, x, cu.tolist())
    assert_close({"o": (o, o_ref), "state": (s, s_ref)})


@pytest.mark.parametrize("variant,chunk", VARIANTS)
def test_state_v_first(variant, chunk):
    x = make_inputs(variant, 65)
    o_ref, s_ref = oracle(variant, x)
    x["h0"] = x["h0"].transpose(-1, -2).contiguous()
    o, s = run_reference(variant, chunk, x, state_v_first=True)
    assert_close({"o": (o, o_ref), "state": (s.transpose(-1, -2), s_ref)})


@pytest.mark.parametrize("variant,chunk", VARIANTS)
def test_dtypes_and_no_final_state(variant, chunk):
    """bf16 in: o comes back in bf16, the final state in fp32; no state unless asked for."""
    x = make_inputs(variant, 20, dtype=torch.bfloat16, h0=False)
    o, s = run_reference(variant, chunk, x)
    assert o.dtype == torch.bfloat16 and o.shape == x["v"].shape and s.dtype == torch.float32
    assert run_reference(variant, chunk, x, output_final_state=False)[1] is None


@pytest.mark.parametrize("chunk", [True, False])
def test_explicit_scale(chunk):
    x = make_inputs("kda", 65, HV=4)
    o, s = run_reference("kda", chunk, x, scale=0.3)
    o_ref, s_ref = naive_recurrent_kda(*(x[n] for n in ("q", "k", "v", "g", "beta")), 0.3, x["h0"], True)
    assert_close({"o": (o, o_ref), "state": (s, s_ref)})


def test_high_dim_and_strong_decay():
    """D = 128, and per-key gates at FLA's lower bound (-5 per step: exp(-320) across a chunk) stay finite."""
    x = make_inputs("kda", 130, H=1, K=128, V=128, B=1)
    x["g"] = -5 * torch.rand_like(x["g"])
    o, s = run_reference("kda", True, x)
    o_ref, s_ref = oracle("kda", x)
    assert torch.isfinite(o).all()
    assert_close({"o": (o, o_ref), "state": (s, s_ref)})


def l2(x):
    return x / torch.sqrt(x.square().sum(-1, keepdim=True) + 1e-6)


def raw_in_kernel(variant, gate, neg, T=65, HV=4, K=16):
    """Raw (pre-transform) inputs, the gate parameters and the flags for the in-kernel options."""
    x = make_inputs(variant, T, HV=HV, K=K)
    x.update(k=3 * torch.randn_like(x["k"]), g=torch.randn_like(x["g"]), beta=torch.randn_like(x["beta"]))
    params = {"A_log": None if gate == "lower_bound_no_A" else torch.randn(HV)}
    params["dt_bias"] = torch.randn(HV * K if variant == "kda" else HV)
    flags = {"use_qk_l2norm_in_kernel": True, "use_beta_sigmoid_in_kernel": True, "allow_neg_eigval": neg}
    flags["use_gate_in_kernel"] = True
    if gate != "softplus":
        flags["lower_bound"] = -5.0
    return x, params, flags


def transformed(variant, x, params, flags):
    """What FLA's in-kernel transforms make of ``x``, built from FLA's own naive gate functions."""
    if variant == "gdn":
        g = naive_gdn_gate(x["g"], params["A_log"], params["dt_bias"])
    elif "lower_bound" in flags:
        g = naive_kda_lowerbound_gate(x["g"], params["A_log"], params["dt_bias"], flags["lower_bound"])
    else:
        g = naive_kda_gate(x["g"], params["A_log"], params["dt_bias"])
    beta = torch.sigmoid(x["beta"]) * (2 if flags["allow_neg_eigval"] else 1)
    return dict(x, q=l2(x["q"]), k=l2(x["k"]), beta=beta, g=g)


IN_KERNEL = [
    ("gdn", "softplus", False),
    ("gdn", "softplus", True),
    ("kda", "softplus", True),
    ("kda", "lower_bound", False),
    ("kda", "lower_bound_no_A", True),
]


@pytest.mark.parametrize("chunk", [True, False])
@pytest.mark.parametrize("variant,gate,neg", IN_KERNEL)
def test_in_kernel_options(chunk, variant, gate, neg):
    x, params, flags = raw_in_kernel(variant, gate, neg)
    o, s = run_reference(variant, chunk, x, **params, **flags, safe_gate=chunk and gate != "softplus")
    o_ref, s_ref = oracle(variant, transformed(variant, x, params, flags))
    assert_close({"o": (o, o_ref), "state": (s, s_ref)})


def loop_ref(q, k, v, gk=None, gv=None, beta=None, h0=None, reverse=False):
    """Per-token fp64 recurrence with every gate kind (gk scalar or per key, gv per value, beta per head or value)."""
    q, k, v = (t.double() for t in (q, k, v))
    B, T, H, K = q.shape
    HV, V = v.shape[2:]
    q, k = (t.repeat_interleave(HV // H, dim=2) for t in (q * K**-0.5, k))
    S = torch.zeros(B, HV, K, V, dtype=torch.float64) if h0 is None else h0.double()
    o = torch.zeros_like(v)
    for t in reversed(range(T)) if reverse else range(T):
        if gk is not None:
            S = S * (gk[:, t].double().exp()[..., None] if gk.dim() == 4 else gk[:, t].double().exp()[..., None, None])
        if gv is not None:
            S = S * gv[:, t].double().exp()[..., None, :]
        u = v[:, t]
        if beta is not None:
            b = beta[:, t].double()
            u = (b if b.dim() == 3 else b[..., None]) * (u - torch.einsum("bhk,bhkv->bhv", k[:, t], S))
        S = S + k[:, t, :, :, None] * u[:, :, None, :]
        o[:, t] = torch.einsum("bhk,bhkv->bhv", q[:, t], S)
    return o, S


@pytest.mark.parametrize("reverse", [False, True])
def test_fused_recurrent_gla_gv_reverse(reverse):
    x = make_inputs("gla", 70)
    gv = F.logsigmoid(torch.randn_like(x["v"]))
    o, s = gla.fused_recurrent_gla(
        x["q"], x["k"], x["v"], gk=x["g"], gv=gv, initial_state=x["h0"], output_final_state=True, reverse=reverse
    )
    o_ref, s_ref = loop_ref(x["q"], x["k"], x["v"], gk=x["g"], gv=gv, h0=x["h0"], reverse=reverse)
    assert_close({"o": (o, o_ref), "state": (s, s_ref)})


def test_fused_recurrent_reverse_varlen():
    lengths = [1, 63, 1, 70]
    cu = [0, *torch.tensor(lengths).cumsum(0).tolist()]
    x = make_inputs("simple_gla", sum(lengths), B=1, N=len(lengths))
    g_gamma = -torch.rand(2)
    o, s = lightning.fused_recurrent_simple_gla(
        x["q"], x["k"], x["v"], g=x["g"], g_gamma=g_gamma, initial_state=x["h0"], output_final_state=True,
        reverse=True, cu_seqlens=torch.tensor(cu),
    )  # fmt: skip
    pieces = [
        loop_ref(*(x[n][:, a:b] for n in "qkv"), gk=(x["g"] + g_gamma)[:, a:b], h0=x["h0"][i : i + 1], reverse=True)
        for i, (a, b) in enumerate(zip(cu[:-1], cu[1:], strict=True))
    ]
    assert_close({"o": (o, torch.cat([p[0] for p in pieces], 1)), "state": (s, torch.cat([p[1] for p in pieces]))})


def test_fused_recurrent_delta_all_gates():
    """GDN's fused_recurrent composes g, gk and gv, with a per-value beta; KDA takes a per-value beta too."""
    x = make_inputs("kda", 65, HV=4)
    g, gv = F.logsigmoid(torch.randn(x["beta"].shape)), F.logsigmoid(torch.randn_like(x["v"]))
    beta = torch.rand_like(x["v"])
    common = {"initial_state": x["h0"], "output_final_state": True}
    o, s = gdn.fused_recurrent_gated_delta_rule(x["q"], x["k"], x["v"], g=g, gk=x["g"], gv=gv, beta=beta, **common)
    o_ref, s_ref = loop_ref(x["q"], x["k"], x["v"], gk=x["g"] + g[..., None], gv=gv, beta=beta, h0=x["h0"])
    assert_close({"gdn o": (o, o_ref), "gdn state": (s, s_ref)})
    o, s = kda.fused_recurrent_kda(x["q"], x["k"], x["v"], x["g"], beta, **common)
    o_ref, s_ref = loop_ref(x["q"], x["k"], x["v"], gk=x["g"], beta=beta, h0=x["h0"])
    assert_close({"kda o": (o, o_ref), "kda state": (s, s_ref)})


@pytest.mark.parametrize("chunk", [True, False])
@pytest.mark.parametrize("layer_idx", [0, 5])
def test_lightning(chunk, layer_idx):
    H, L = 4, 8
    x = make_inputs("simple_gla", 65, H=H)
    fn = lightning.chunk_lightning_attn if chunk else lightning.fused_recurrent_lightning_attn
    o, s = fn(x["q"], x["k"], x["v"], layer_idx, L, initial_state=x["h0"], output_final_state=True)
    gamma = torch.tensor([-(8 / H) * (1 - layer_idx / L) * h for h in range(H)])
    o_ref, s_ref = oracle("simple_gla", dict(x, g=gamma.expand_as(x["g"])))
    assert_close({"o": (o, o_ref), "state": (s, s_ref)})


def test_unsupported_arguments():
    x = make_inputs("kda", 8)
    with pytest.raises(NotImplementedError, match="return_intermediate_states"):
        kda.chunk_kda(x["q"], x["k"], x["v"], x["g"], x["beta"], return_intermediate_states=True)


def gradients(fn, leaves, do, dht):
    o, s = fn()
    loss = (o * do).sum() + (s * dht).sum()
    return dict(zip(leaves, torch.autograd.grad(loss, list(leaves.values())), strict=True))


@pytest.mark.parametrize("variant", ["kda", "gdn", "gla", "simple_gla"])
def test_gradients(variant):
    x = make_inputs(variant, 65, HV=4 if variant in DELTA else 2)
    leaves = {n: t.requires_grad_() for n, t in x.items()}
    do, dht = torch.randn_like(x["v"]), torch.randn_like(x["h0"])
    ours = gradients(lambda: run_reference(variant, True, x), leaves, do, dht)
    ref = gradients(lambda: oracle(variant, x), leaves, do, dht)
    assert_close({f"d{n}": (ours[n], ref[n]) for n in leaves}, tol=1e-4)


@pytest.mark.parametrize("variant,gate,neg", [c for c in IN_KERNEL if c[2]])
def test_gradients_in_kernel(variant, gate, neg):
    """Gradients reach the raw q, k, g, beta and A_log / dt_bias through the in-kernel transforms."""
    x, params, flags = raw_in_kernel(variant, gate, neg)
    leaves = {n: t.requires_grad_() for n, t in {**x, **params}.items() if t is not None}
    do, dht = torch.randn_like(x["v"]), torch.randn_like(x["h0"])
    ours = gradients(lambda: run_reference(variant, True, x, **params, **flags), leaves, do, dht)
    ref = gradients(lambda: oracle(variant, transformed(variant, x, params, flags)), leaves, do, dht)
    assert_close({f"d{n}": (ours[n], ref[n]) for n in leaves}, tol=1e-4)


# -- edge inputs ------------------------------------------------------------------------------------------------

GATE_EDGES = {
    "reset": lambda g, at: g.index_fill_(1, at, float("-inf")),  # a -inf gate: the state is wiped
    "huge": lambda g, at: g.index_fill_(1, at, -1e30),
    "spikes": lambda g, at: g.index_copy_(1, at, -torch.empty_like(g[:, at]).uniform_(300, 1e4)),
}


@pytest.mark.parametrize("variant,chunk", VARIANTS)
@pytest.mark.parametrize("edge", list(GATE_EDGES))
@pytest.mark.parametrize("T", [10, 130])
def test_any_gate_in_minus_inf_to_zero(variant, chunk, edge, T):
    """Gates at the edge of [-inf, 0] give FLA's naive answer: no cancellation between chunk-local sums of gates,
    no NaN from -inf - -inf (a per-key gate gets the edge on half of its key channels at one token)."""
    gva = 2 if variant in DELTA else 1
    x = make_inputs(variant, T, HV=2 * gva)
    at = torch.tensor([2, 5, 6, 70, 100, 129])
    GATE_EDGES[edge](x["g"], at[at < T])
    if x["g"].dim() == 4:
        x["g"][:, 3, :, ::2] = x["g"][:, 2, :, ::2]
    o, s = run_reference(variant, chunk, x)
    o_ref, s_ref = oracle(variant, x)
    assert torch.isfinite(o).all() and torch.isfinite(s).all()
    assert_close({"o": (o, o_ref), "state": (s, s_ref)})


@pytest.mark.parametrize("variant", ["kda", "gdn", "gla", "simple_gla"])
def test_gradients_through_a_reset(variant):
    """-inf gates (state resets) in two chunks: the gradients are FLA's naive recurrence's, all finite."""
    x = make_inputs(variant, 130, HV=4 if variant in DELTA else 2)
    x["g"].index_fill_(1, torch.tensor([5, 70, 100]), float("-inf"))
    leaves = {n: t.requires_grad_() for n, t in x.items()}
    do, dht = torch.randn_like(x["v"]), torch.randn_like(x["h0"])
    ours = gradients(lambda: run_reference(variant, True, x), leaves, do, dht)
    ref = gradients(lambda: oracle(variant, x), leaves, do, dht)
    assert all(torch.isfinite(ours[n]).all() for n in leaves)
    assert_close({f"d{n}": (ours[n], ref[n]) for n in leaves}, tol=1e-4)


def poison(x, name, at, value, column=None):
    """``x`` with ``value`` written into input ``name`` at token ``at`` (only value column ``column`` if given)."""
    x = {n: t.clone() if t is not None else None for n, t in x.items()}
    if column is None:
        x[name][:, at] = value
    else:
        x[name][:, at, ..., column] = value
    return x


CAUSAL = [(v, c, name) for v, c in VARIANTS for name in ("q", "k", "v", "g", "beta") if name != "beta" or v in DELTA]


@pytest.mark.parametrize("value", [float("nan"), float("inf")])
@pytest.mark.parametrize("variant,chunk,name", CAUSAL)
def test_later_tokens_never_reach_earlier_outputs(variant, chunk, name, value):
    """A NaN or Inf at token 70 (mid-chunk) changes no output before it: masks are selects, not products."""
    x = make_inputs(variant, 130, HV=4 if variant in DELTA else 2)
    o_clean, _ = run_reference(variant, chunk, x)
    o, _ = run_reference(variant, chunk, poison(x, name, 70, value))
    torch.testing.assert_close(o[:, :70], o_clean[:, :70], rtol=1e-6, atol=1e-6)
    if name == "v":  # the recurrence keeps value columns apart: the other columns stay finite
        o, _ = run_reference(variant, chunk, poison(x, "v", 70, value, column=3))
        torch.testing.assert_close(o[:, :70], o_clean[:, :70], rtol=1e-6, atol=1e-6)
        others = torch.arange(o.shape[-1]) != 3
        assert torch.isfinite(o[..., others]).all() and not torch.isfinite(o[:, 70:, :, 3]).any()


@pytest.mark.parametrize("variant,chunk", VARIANTS)
def test_non_finite_tokens_stay_in_their_sequence(variant, chunk):
    """NaN in v and k of the middle sequence of a varlen batch: the other sequences' outputs and states are those
    of a clean run."""
    lengths = [70, 40, 90]
    cu = torch.tensor([0, 70, 110, 200])
    x = make_inputs(variant, sum(lengths), B=1, N=len(lengths), HV=4 if variant in DELTA else 2)
    o_clean, s_clean = run_reference(variant, chunk, x, cu_seqlens=cu)
    o, s = run_reference(variant, chunk, poison(poison(x, "v", 75, float("nan")), "k", 80, float("inf")), cu_seqlens=cu)
    keep = torch.cat([torch.arange(75), torch.arange(110, 200)])
    torch.testing.assert_close(o[:, keep], o_clean[:, keep], rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(s[[0, 2]], s_clean[[0, 2]], rtol=1e-6, atol=1e-6)


# -- cost ---------------------------------------------------------------------------------------------------------


class Footprint(TorchDispatchMode):
    """The elements written by every op of a call (views excluded) and the largest tensor any op makes: a machine-
    independent measure of its time and memory."""

    def __init__(self):
        super().__init__()
        self.written = self.largest = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if not func.is_view:
            for t in tree_leaves(out):
                if isinstance(t, torch.Tensor):
                    self.written += t.numel()
                    self.largest = max(self.largest, t.numel())
        return out

    def __repr__(self):
        return f"Footprint(written={self.written}, largest={self.largest})"


def footprint(fn, *args, **kwargs) -> Footprint:
    with Footprint() as fp:
        fn(*args, **kwargs)
    return fp


def test_varlen_cost_follows_tokens():
    """One 1024-token sequence beside 255 one-token sequences costs about what the long one costs alone: no
    sequence is padded to the longest."""
    x = make_inputs("kda", 1024 + 255, B=1, H=1, K=16, V=16, h0=False)
    args = [x[n] for n in ("q", "k", "v", "g", "beta")]
    alone = footprint(kda.chunk_kda, *(a[:, :1024] for a in args))
    cu = torch.tensor([0, *range(1024, 1024 + 256)])
    mixed = footprint(kda.chunk_kda, *args, cu_seqlens=cu)
    assert mixed.written < 1.5 * alone.written and mixed.largest <= 2 * alone.largest, (mixed, alone)


@pytest.mark.parametrize("case", ["gla gv", "gdn per-value beta", "kda per-value beta"])
def test_per_value_gate_and_beta_cost(case):
    """A per-value gate or beta costs a small factor over the per-head form (not a head per value column)."""
    x = make_inputs("kda", 130, H=2, K=16, V=32)
    q, k, v, g = x["q"], x["k"], x["v"], x["g"]
    per_value = torch.rand_like(v)
    if case == "gla gv":
        base = footprint(gla.fused_recurrent_gla, q, k, v, gk=g)
        wide = footprint(gla.fused_recurrent_gla, q, k, v, gk=g, gv=F.logsigmoid(torch.randn_like(v)))
    elif case == "gdn per-value beta":
        base = footprint(gdn.fused_recurrent_gated_delta_rule, q, k, v, gk=g, beta=x["beta"])
        wide = footprint(gdn.fused_recurrent_gated_delta_rule, q, k, v, gk=g, beta=per_value)
    else:
        base = footprint(kda.fused_recurrent_kda, q, k, v, g, x["beta"])
        wide = footprint(kda.fused_recurrent_kda, q, k, v, g, per_value)
    assert wide.written < 4 * base.written and wide.largest <= 2 * base.largest, (wide, base)


@pytest.mark.parametrize("variant", ["kda", "gdn", "gla", "simple_gla"])
def test_decode_step_is_recurrent(variant):
    """A one-token fused-recurrent call (decode) works token by token: a few state-sized tensors, no padded chunk."""
    x = make_inputs(variant, 1, B=8, H=2, HV=4 if variant in DELTA else 2, K=64, V=64)
    fp = footprint(run_reference, variant, False, x)
    assert fp.written < 16 * x["h0"].numel() and fp.largest <= x["h0"].numel(), fp


GRADCHECK = [
    ("kda chunk", kda.chunk_kda),
    ("gdn chunk", gdn.chunk_gated_delta_rule),
    ("gdn fused per-value", gdn.fused_recurrent_gated_delta_rule),
    ("gla fused gv", gla.fused_recurrent_gla),
]


@pytest.mark.parametrize("T", [3, 66])
@pytest.mark.parametrize("name,fn", GRADCHECK, ids=[n for n, _ in GRADCHECK])
def test_gradcheck_through_the_public_api(name, fn, T):
    """fp64 inputs are served (by the reference backend), so torch.autograd.gradcheck runs on the entry points."""
    B, H, K, V = 1, 1, 3, 2
    dt = torch.float64
    q, k = torch.randn(B, T, H, K, dtype=dt), F.normalize(torch.randn(B, T, H, K, dtype=dt), dim=-1)
    v, h0 = torch.randn(B, T, H, V, dtype=dt), torch.randn(B, H, K, V, dtype=dt)
    if name == "kda chunk":
        gates = (F.logsigmoid(torch.randn(B, T, H, K, dtype=dt)), torch.rand(B, T, H, dtype=dt))
    elif name == "gdn chunk":
        gates = (F.logsigmoid(torch.randn(B, T, H, dtype=dt)), torch.rand(B, T, H, dtype=dt))
    elif name == "gdn fused per-value":
        gates = (None, None, F.logsigmoid(torch.randn(B, T, H, V, dtype=dt)), torch.rand(B, T, H, V, dtype=dt))
    else:
        gates = (F.logsigmoid(torch.randn(B, T, H, K, dtype=dt)), F.logsigmoid(torch.randn(B, T, H, V, dtype=dt)))
    inputs = [t.requires_grad_() if t is not None else None for t in (q, k, v, *gates)]

    def call(*xs):
        o, ht = fn(*xs, initial_state=h0, output_final_state=True)
        return o, ht

    h0.requires_grad_()
    assert torch.autograd.gradcheck(call, inputs, fast_mode=True)


@pytest.mark.parametrize("chunk", [True, False])
def test_groups_run_in_parts(monkeypatch, chunk):
    """A group too large for one pass runs in parts (here one sequence each) with the same results."""
    from cula.ops import delta_rule_ref

    lengths = [0, 1, 3, 70, 70, 1, 40, 0]
    cu = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()])
    x = make_inputs("kda", sum(lengths), B=1, N=len(lengths), HV=4)
    whole = run_reference("kda", chunk, x, cu_seqlens=cu)
    monkeypatch.setattr(delta_rule_ref, "PART_ELEMENTS", 1)
    torch.testing.assert_close(run_reference("kda", chunk, x, cu_seqlens=cu), whole)
    o_ref, s_ref = oracle_varlen("kda", x, cu.tolist())
    assert_close({"o": (whole[0], o_ref), "state": (whole[1], s_ref)})
