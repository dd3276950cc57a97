"""The token-by-token kernel (cula/recurrent): dispatch, the configuration a call compiles to, compilation of those
configurations on the CPU, and on a GPU the kernel against the reference backend on the same inputs (state pools,
padding, verify, bf16 pools, in-kernel gates, both state layouts)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

import cula
from cula import dispatch

GDN = cula.gdn.fused_recurrent_gated_delta_rule
KDA = cula.kda.fused_recurrent_kda
GLA = cula.gla.fused_recurrent_gla
SIMPLE_GLA = cula.lightning.fused_recurrent_simple_gla
LIGHTNING = cula.lightning.fused_recurrent_lightning_attn
VARIANTS = ("gdn", "kda", "gla", "simple_gla", "lightning")
ENTRY = {"gdn": GDN, "kda": KDA, "gla": GLA, "simple_gla": SIMPLE_GLA, "lightning": LIGHTNING}
DELTA = ("gdn", "kda")


def make_args(variant, B=2, T=3, H=2, HV=None, K=128, V=128, lengths=None, device="cpu", seed=0, dtype=torch.bfloat16):
    """Seeded inputs of ``variant``'s fused-recurrent entry point (GVA for the delta-rule variants), no state."""
    gen = torch.Generator().manual_seed(seed)
    HV = HV or (2 * H if variant in DELTA else H)
    if variant not in DELTA:
        HV = H
    if lengths is not None:
        B, T = 1, sum(lengths)

    def rnd(*shape):
        return torch.randn(*shape, generator=gen)

    args = {
        "q": rnd(B, T, H, K).to(dtype),
        "k": F.normalize(rnd(B, T, H, K), dim=-1).to(dtype),
        "v": rnd(B, T, HV, V).to(dtype),
    }
    if variant == "gdn":
        args.update(g=F.logsigmoid(rnd(B, T, HV) + 2), beta=torch.rand(B, T, HV, generator=gen).to(dtype))
    elif variant == "kda":
        args.update(g=F.logsigmoid(rnd(B, T, HV, K) + 3), beta=torch.rand(B, T, HV, generator=gen))
    elif variant == "gla":
        args.update(gk=F.logsigmoid(rnd(B, T, HV, K) + 3), gv=F.logsigmoid(rnd(B, T, HV, V) + 3))
    elif variant == "simple_gla":
        args.update(g=F.logsigmoid(rnd(B, T, HV) + 2), g_gamma=-torch.rand(HV, generator=gen))
    else:
        args.update(layer_idx=1, num_layers=4)
    if lengths is not None:
        args["cu_seqlens"] = torch.tensor([0, *lengths]).cumsum(0)
    return {n: (t.to(device) if isinstance(t, torch.Tensor) else t) for n, t in args.items()}


def n_seqs(args):
    cu = args.get("cu_seqlens")
    return args["q"].shape[0] if cu is None else cu.numel() - 1


def state_shape(args, slots=None, v_first=False):
    HV, K, V = args["v"].shape[2], args["q"].shape[3], args["v"].shape[3]
    return (slots or n_seqs(args), HV, *((V, K) if v_first else (K, V)))


# -- dispatch and configuration (CPU) --------------------------------------------------------------------------


class FakeSm90:
    def __init__(self, monkeypatch, cc=(9, 0)):
        monkeypatch.setattr(torch.Tensor, "is_cuda", property(lambda self: True))
        monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: cc)
        monkeypatch.setattr(dispatch, "fla_function", lambda target: None)


@pytest.mark.parametrize("variant", VARIANTS)
@pytest.mark.parametrize("cc", [(9, 0), (10, 0)])
def test_each_fused_recurrent_entry_point_picks_the_kernel(monkeypatch, variant, cc):
    """SM90 serves it; on SM100, where it only compiled, FLA does unless CULA_UNTESTED_KERNELS=1 asks for it."""
    FakeSm90(monkeypatch, cc)
    prefix = "lightning" if variant == "simple_gla" else variant
    name = f"{prefix}.fused_recurrent_sm{cc[0]}0"
    if cc[0] == 10:
        decision = cula.explain(ENTRY[variant], **make_args(variant))
        assert decision.backend == "fla"
        assert (
            dict(decision.rejected)["cute"] == f"{name}: compiled for sm_100, never run on one "
            "(CULA_UNTESTED_KERNELS=1 serves it)"
        )
        monkeypatch.setenv("CULA_UNTESTED_KERNELS", "1")
    decision = cula.explain(ENTRY[variant], **make_args(variant))
    assert decision.backend == "cute"
    assert decision.reason.startswith(f"{name} on sm_{cc[0]}0")


@pytest.mark.parametrize(
    "variant,change,why",
    [
        ("gla", {"reverse": True}, "reverse=True"),
        ("gdn", {"K": 32}, "head dims K=32"),
        ("kda", {"V": 256}, "V=256"),
        ("gdn", {"dtype": torch.float64}, "q, k, v dtypes"),
        ("kda", {"beta_per_value": True}, "beta per value channel"),
        ("gla", {"lengths": [1] * 65536}, "65536 sequences"),
    ],
)
def test_what_the_kernel_declines_and_why(monkeypatch, variant, change, why):
    FakeSm90(monkeypatch)
    change = dict(change)
    extra = {"reverse": change.pop("reverse")} if "reverse" in change else {}
    per_value = change.pop("beta_per_value", False)
    args = make_args(variant, **change)
    if per_value:
        args["beta"] = torch.rand(*args["v"].shape)
    decision = cula.explain(ENTRY[variant], **args, **extra)
    assert decision.backend != "cute"
    assert why in dict(decision.rejected)["cute"]


def bound_args(variant, **extra):
    import inspect

    fn = ENTRY[variant]
    sig = inspect.signature(fn)
    bound = sig.bind(**{k: v for k, v in extra.items() if k in sig.parameters})
    bound.apply_defaults()
    named = dict(bound.arguments)
    named.pop("kwargs", None)
    args = cula.dispatch.call_args(named, {k: v for k, v in extra.items() if k not in sig.parameters})
    fn.cula_op.validate(args)
    return args


def config(variant, **extra):
    from cula.recurrent.plan import config_for

    gates_of = {
        "gdn": cula.gdn.api._recurrent_gates,
        "kda": cula.kda.api._recurrent_gates,
        "gla": cula.gla.api._recurrent_gates,
        "simple_gla": cula.lightning.api._recurrent_gates,
        "lightning": cula.lightning.api._recurrent_gates,
    }[variant]
    args = bound_args(variant, **extra)
    return config_for(args, gates_of(args))


def test_a_verify_call_on_a_pool_writes_each_token_to_its_slot():
    args = make_args("gdn", B=2, T=3)
    pool = torch.zeros(5, *state_shape(args)[1:])
    idx = torch.tensor([[0, 1, 2], [3, -1, 4]], dtype=torch.int32)
    cfg = config("gdn", **args, initial_state=pool, ssm_state_indices=idx, num_accepted_tokens=torch.tensor([1, 2]))
    assert (cfg["token_slots"], cfg["final"], cfg["indices"], cfg["accepted"]) == (True, "inplace", "int32", "int64")
    assert (cfg["g"], cfg["beta"], cfg["gk"], cfg["has_initial_state"]) == ("log", "given", "none", True)


def test_a_pool_read_only_returns_fp32_final_states():
    args = make_args("kda", B=2, T=1)
    pool = torch.zeros(5, *state_shape(args)[1:], dtype=torch.bfloat16)
    cfg = config(
        "kda", **args, initial_state=pool, ssm_state_indices=torch.tensor([4, 1]), inplace_final_state=False,
        output_final_state=True,
    )  # fmt: skip
    assert (cfg["final"], cfg["token_slots"], cfg["state_dtype"], cfg["indices"]) == ("ht", False, "bfloat16", "int64")


@pytest.mark.parametrize(
    "variant,extra,expect",
    [
        ("gdn", {"use_gate_in_kernel": True, "A_log": torch.zeros(4), "dt_bias": torch.zeros(4)}, {"g": "gdn"}),
        ("gdn", {"beta": None}, {"beta": "one"}),
        ("gdn", {"use_beta_sigmoid_in_kernel": True, "allow_neg_eigval": True}, {"neg_eigval": True}),
        ("kda", {"use_gate_in_kernel": True, "A_log": torch.zeros(4)}, {"gk": "kda_softplus"}),
        ("kda", {"use_gate_in_kernel": True, "lower_bound": -5.0}, {"gk": "kda_sigmoid"}),
        ("kda", {"use_qk_l2norm_in_kernel": True, "state_v_first": True}, {"qk_l2norm": True, "state_v_first": True}),
        ("gla", {}, {"gk": "log", "gv": True, "beta": "none"}),
        ("simple_gla", {}, {"g": "log", "gamma": True, "beta": "none"}),
        ("lightning", {}, {"g": "none", "gamma": True}),
    ],
)
def test_the_gates_each_call_compiles_to(variant, extra, expect):
    cfg = config(variant, **{**make_args(variant), **extra})
    assert {k: cfg[k] for k in expect} == expect


@pytest.mark.parametrize(
    "B,v_first,pool_dtype,expect",
    [
        (256, True, torch.bfloat16, (64, 8)),  # 256 x 2 heads x 2 blocks >= 132 SMs; a 16-bit V-first pool
        (256, False, torch.bfloat16, (64, 4)),
        (256, True, torch.float32, (64, 4)),
        (32, True, torch.bfloat16, (32, 8)),  # 32 x 2 x 2 = 128 CTAs of 64 columns: fewer than the SMs
        (32, False, torch.float32, (32, 4)),
    ],
)
def test_the_block_shape_each_call_compiles_to(B, v_first, pool_dtype, expect):
    args = make_args("gdn", B=B, T=1, H=1)
    pool = torch.zeros(B, *state_shape(args, v_first=v_first)[1:], dtype=pool_dtype)
    cfg = config("gdn", **args, initial_state=pool, ssm_state_indices=torch.arange(B), state_v_first=v_first)
    assert (cfg["block_v"], cfg["vec"]) == expect


def test_the_block_shapes_the_kernel_refuses():
    from cula.recurrent.kernel import RecurrentConfig

    for fields in ({"block_v": 48}, {"vec": 2}, {"head_v": 64, "block_v": 128}):
        with pytest.raises(AssertionError):
            RecurrentConfig(**fields)


def test_without_the_delta_rule_beta_options_cannot_be_set():
    from cula.recurrent.kernel import RecurrentConfig

    with pytest.raises(AssertionError):
        RecurrentConfig(beta="none", qk_l2norm=True)
    with pytest.raises(AssertionError):
        RecurrentConfig(token_slots=True, final="ht")


@pytest.mark.parametrize(
    "variant,extra",
    [
        ("gdn", {"use_gate_in_kernel": True, "A_log": torch.zeros(4), "use_qk_l2norm_in_kernel": True}),
        ("kda", {"use_gate_in_kernel": True, "lower_bound": -5.0, "state_v_first": True}),
        ("gla", {"lengths": [1, 0, 2]}),
        ("simple_gla", {"K": 64, "V": 64}),
        ("lightning", {"dtype": torch.float16}),
    ],
)
def test_the_configurations_calls_ask_for_compile(variant, extra):
    """What the launch would compile for these calls compiles for sm_90a on the CPU (the kernel's arguments match
    its fake signature)."""
    pytest.importorskip("cutlass")
    from cula.recurrent.fwd_sm90 import compile_recurrent

    shape = {k: extra.pop(k) for k in ("lengths", "K", "V", "dtype") if k in extra}
    args = make_args(variant, **shape)
    fields = config(variant, **args, **extra, output_final_state=True)
    assert compile_recurrent("sm_90a", **fields) is not None


# -- on a GPU: the kernel against the reference backend --------------------------------------------------------

gpu = pytest.mark.gpu
needs_gpu = pytest.mark.skipif(
    not torch.cuda.is_available() or torch.cuda.get_device_capability()[0] not in (9, 10), reason="needs SM90/SM100"
)


def rel_rmse(a, b):
    a, b = a.double(), b.double()
    return ((a - b).pow(2).mean().sqrt() / b.pow(2).mean().sqrt().clamp_min(1e-30)).item()


def run_both(monkeypatch, fn, args):
    """The call on the kernel and on the reference, each on its own copy of the initial state / pool."""
    out = {}
    for backend in ("cute", "torch"):
        monkeypatch.setenv("CULA_BACKEND", backend)
        call = dict(args)
        if call.get("initial_state") is not None:
            call["initial_state"] = call["initial_state"].clone()
        o, state = fn(**call)
        torch.cuda.synchronize()
        out[backend] = (o, state, call.get("initial_state"))
        if backend == "cute":
            assert fn.cula_op.last.backend == "cute", fn.cula_op.last
    return out["cute"], out["torch"]


def check(kernel, ref, lengths, tol_o=1e-3, tol_state=1e-3, padded=()):
    """Outputs and final states against the reference, over the call and per sequence (sequence n: the next
    ``lengths[n]`` tokens of the flattened output; those in ``padded`` are not compared on their own)."""
    o, state, _ = kernel
    o_ref, state_ref, _ = ref
    assert torch.isfinite(o).all()
    assert rel_rmse(o, o_ref) <= tol_o, rel_rmse(o, o_ref)
    flat, flat_ref = o.flatten(0, 1), o_ref.flatten(0, 1)
    start = 0
    for n, L in enumerate(lengths):  # per sequence: a global figure hides one bad sequence
        if L and n not in padded:
            err = rel_rmse(flat[start : start + L], flat_ref[start : start + L])
            assert err <= tol_o, (n, err)
        start += L
    if state_ref is not None:
        assert rel_rmse(state, state_ref) <= tol_state, rel_rmse(state, state_ref)


@gpu
@needs_gpu
@pytest.mark.parametrize("variant", VARIANTS)
@pytest.mark.parametrize("K,V", [(64, 64), (128, 128), (128, 64), (64, 128)])
@pytest.mark.parametrize("v_first", [False, True])
def test_gpu_fixed_length_with_initial_state(monkeypatch, variant, K, V, v_first):
    if variant == "lightning" and v_first:
        pytest.skip("FLA's fused_recurrent_lightning_attn has no state_v_first")
    args = make_args(variant, B=3, T=5, K=K, V=V, device="cuda")
    args["initial_state"] = torch.randn(state_shape(args, v_first=v_first), device="cuda") * 0.1
    args["output_final_state"] = True
    if v_first:
        args["state_v_first"] = True
    kernel, ref = run_both(monkeypatch, ENTRY[variant], args)
    check(kernel, ref, [5] * 3)


@gpu
@needs_gpu
@pytest.mark.parametrize("variant", VARIANTS)
def test_gpu_varlen_with_empty_and_single_token_sequences(monkeypatch, variant):
    lengths = [1, 0, 4, 1, 0, 2]
    args = make_args(variant, lengths=lengths, device="cuda", seed=1)
    args["initial_state"] = torch.randn(state_shape(args), device="cuda") * 0.1
    args["output_final_state"] = True
    kernel, ref = run_both(monkeypatch, ENTRY[variant], args)
    check(kernel, ref, lengths)


@gpu
@needs_gpu
@pytest.mark.parametrize("variant", VARIANTS)
def test_gpu_a_compiled_decode_step_runs_the_kernel(monkeypatch, variant):
    """torch.compile(fullgraph=True) of a varlen decode step: the graph holds the entry point's op, which runs the
    kernel as the call runs (its host code untraced), with the eager kernel's results."""
    lengths = [1, 0, 2, 1]
    args = make_args(variant, lengths=lengths, device="cuda", seed=2)
    args["initial_state"] = torch.randn(state_shape(args), device="cuda") * 0.1
    args["output_final_state"] = True
    monkeypatch.setenv("CULA_BACKEND", "cute")
    fn = ENTRY[variant]
    torch._dynamo.reset()
    o, state = torch.compile(lambda **kw: fn(**kw), backend="aot_eager", fullgraph=True)(**args)
    assert fn.cula_op.last.backend == "cute", fn.cula_op.last
    eager = fn(**args)
    check((o, state, None), (*eager, None), lengths, tol_o=1e-6, tol_state=1e-6)


@gpu
@needs_gpu
@pytest.mark.parametrize("variant", ["gdn", "kda", "lightning"])
@pytest.mark.parametrize("pool_dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("index_dtype", [torch.int32, torch.int64])
def test_gpu_decode_on_a_pool_with_padding(monkeypatch, variant, pool_dtype, index_dtype):
    """One token per sequence, states read from and written back to their slots; a padded entry (-1) reads and
    writes nothing and gets zero outputs; slots not named stay bit for bit."""
    args = make_args(variant, B=4, T=1, device="cuda", seed=2)
    slots = 9
    pool = (torch.randn(state_shape(args, slots), device="cuda") * 0.1).to(pool_dtype)
    idx = torch.tensor([7, -1, 0, 4], dtype=index_dtype, device="cuda")
    args.update(initial_state=pool, ssm_state_indices=idx)
    kernel, ref = run_both(monkeypatch, ENTRY[variant], args)
    tol = 1e-3 if pool_dtype == torch.float32 else 8e-3
    check(kernel, ref, [1, 1, 1, 1], tol_state=tol, padded=(1,))
    pool_k, pool_r = kernel[2], ref[2]
    untouched = [s for s in range(slots) if s not in (7, 0, 4)]
    assert torch.equal(pool_k[untouched], pool[untouched])
    assert (kernel[0][1] == 0).all()
    assert rel_rmse(pool_k[[7, 0, 4]].float(), pool_r[[7, 0, 4]].float()) <= tol


@gpu
@needs_gpu
@pytest.mark.parametrize("variant", ["gdn", "kda", "gla"])
@pytest.mark.parametrize("v_first", [False, True])
@pytest.mark.parametrize("pool_dtype", [torch.float32, torch.bfloat16])
def test_gpu_wide_blocks_on_many_sequences(monkeypatch, variant, v_first, pool_dtype):
    """Enough sequences for 64 value columns per CTA (and 8 state elements per thread on a bf16 V-first pool,
    :func:`cula.recurrent.plan.block_shape`): two tokens per sequence on a pool, one entry padding."""
    from cula.recurrent.plan import WIDE_BLOCK_V, block_shape

    B, T = 160, 2
    args = make_args(variant, B=B, T=T, H=2, device="cuda", seed=5)
    assert block_shape(args["q"], args["v"], B, v_first, pool_dtype)[0] == WIDE_BLOCK_V
    slots = B + 8
    pool = (torch.randn(state_shape(args, slots, v_first=v_first), device="cuda") * 0.1).to(pool_dtype)
    idx = torch.randperm(slots, generator=torch.Generator().manual_seed(5))[:B].to(torch.int32).cuda()
    idx[7] = -1
    args.update(initial_state=pool, ssm_state_indices=idx)
    if v_first:
        args["state_v_first"] = True
    kernel, ref = run_both(monkeypatch, ENTRY[variant], args)
    tol = 1e-3 if pool_dtype == torch.float32 else 8e-3
    check(kernel, ref, [T] * B, padded=(7,))
    named = idx[idx >= 0].long()
    assert rel_rmse(kernel[2][named].float(), ref[2][named].float()) <= tol
    assert (kernel[0][7] == 0).all()


@gpu
@needs_gpu
@pytest.mark.parametrize("variant", ["gdn", "kda", "simple_gla"])
@pytest.mark.parametrize("pool_dtype", [torch.float32, torch.bfloat16])
def test_gpu_verify_keeps_each_tokens_state_and_rolls_back(monkeypatch, variant, pool_dtype):
    """Speculative verify: [N, T] slots, the state after each token in its slot (a -1 entry skipped), the start
    read from the slot of the last accepted token."""
    args = make_args(variant, B=3, T=4, device="cuda", seed=3)
    slots = 16
    pool = (torch.randn(state_shape(args, slots), device="cuda") * 0.1).to(pool_dtype)
    idx = torch.tensor([[0, 1, 2, 3], [4, 5, -1, 6], [8, 9, 10, 11]], dtype=torch.int32, device="cuda")
    accepted = torch.tensor([2, 1, 4], dtype=torch.int32, device="cuda")
    args.update(initial_state=pool, ssm_state_indices=idx, num_accepted_tokens=accepted)
    kernel, ref = run_both(monkeypatch, ENTRY[variant], args)
    tol = 1e-3 if pool_dtype == torch.float32 else 8e-3
    check(kernel, ref, [4] * 3)
    written = [0, 1, 2, 3, 4, 5, 6, 8, 9, 10, 11]
    assert rel_rmse(kernel[2][written].float(), ref[2][written].float()) <= tol
    assert torch.equal(kernel[2][[7, 12, 13, 14, 15]], pool[[7, 12, 13, 14, 15]])


@gpu
@needs_gpu
@pytest.mark.parametrize(
    "variant,extra",
    [
        ("gdn", {"use_qk_l2norm_in_kernel": True, "use_beta_sigmoid_in_kernel": True, "allow_neg_eigval": True}),
        ("gdn", {"use_gate_in_kernel": True, "raw_gate": True}),
        ("gdn", {"beta": None, "gk": True, "gv": True}),
        ("kda", {"use_gate_in_kernel": True, "lower_bound": -5.0, "raw_gate": True, "use_qk_l2norm_in_kernel": True}),
        ("kda", {"use_gate_in_kernel": True, "raw_gate": True, "use_beta_sigmoid_in_kernel": True}),
    ],
)
def test_gpu_in_kernel_transforms(monkeypatch, variant, extra):
    extra = dict(extra)
    args = make_args(variant, B=2, T=6, device="cuda", seed=4)
    HV, K = args["v"].shape[2], args["q"].shape[3]
    if extra.pop("raw_gate", False):
        args["g"] = torch.randn_like(args["g"]).to(torch.bfloat16)
        args["A_log"] = torch.randn(HV, device="cuda") * 0.5
        args["dt_bias"] = torch.randn(HV * K if variant == "kda" else HV, device="cuda") * 0.5
    if extra.pop("gk", False):
        args["gk"] = F.logsigmoid(torch.randn(*args["v"].shape[:3], K, device="cuda") + 3)
    if extra.pop("gv", False):
        args["gv"] = F.logsigmoid(torch.randn(*args["v"].shape, device="cuda") + 3)
    if extra.get("use_qk_l2norm_in_kernel"):
        args["k"] = torch.randn_like(args["k"])
    if extra.get("use_beta_sigmoid_in_kernel") and args.get("beta") is not None:
        args["beta"] = torch.randn_like(args["beta"].float())
    args.update(extra, output_final_state=True)
    kernel, ref = run_both(monkeypatch, ENTRY[variant], args)
    check(kernel, ref, [6] * 2)
