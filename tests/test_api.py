"""Public API: signature parity with FLA 0.6.0, validation errors, dispatch decisions, FLA registry."""

from __future__ import annotations

import collections
import importlib
import inspect
import threading

import pytest
import torch
import torch.nn.functional as F

import cula
from cula import dispatch
from cula.dispatch import CuteKernel
from cula.validation import POOL_ARGS

# (cuLA function, FLA "module:function")
ENTRY_POINTS = [
    (cula.kda.chunk_kda, "fla.ops.kda:chunk_kda"),
    (cula.kda.fused_recurrent_kda, "fla.ops.kda:fused_recurrent_kda"),
    (cula.gdn.chunk_gated_delta_rule, "fla.ops.gated_delta_rule:chunk_gated_delta_rule"),
    (cula.gdn.fused_recurrent_gated_delta_rule, "fla.ops.gated_delta_rule:fused_recurrent_gated_delta_rule"),
    (cula.gdn.chunk_gdn, "fla.ops.gated_delta_rule:chunk_gdn"),
    (cula.gdn.fused_recurrent_gdn, "fla.ops.gated_delta_rule:fused_recurrent_gdn"),
    (cula.gla.chunk_gla, "fla.ops.gla:chunk_gla"),
    (cula.gla.fused_recurrent_gla, "fla.ops.gla:fused_recurrent_gla"),
    (cula.lightning.chunk_lightning_attn, "fla.ops.lightning_attn:chunk_lightning_attn"),
    (cula.lightning.fused_recurrent_lightning_attn, "fla.ops.lightning_attn:fused_recurrent_lightning_attn"),
    (cula.lightning.chunk_simple_gla, "fla.ops.simple_gla:chunk_simple_gla"),
    (cula.lightning.fused_recurrent_simple_gla, "fla.ops.simple_gla:fused_recurrent_simple_gla"),
]


def fla_fn(target: str):
    module, name = target.split(":")
    return getattr(importlib.import_module(module), name)


def params(fn) -> list[tuple[str, object, object]]:
    return [(p.name, p.kind, p.default) for p in inspect.signature(fn).parameters.values()]


@pytest.mark.parametrize("ours,target", ENTRY_POINTS, ids=[t for _, t in ENTRY_POINTS])
def test_signature_matches_fla(ours, target):
    """FLA's parameters exactly; where FLA takes no ``**kwargs`` (fused_recurrent_lightning_attn), cuLA's state-pool
    extension follows as keyword-only parameters defaulting to None."""
    extension = [(p.name, p.kind, p.default) for p in inspect.signature(ours).parameters.values()
                 if p.kind is inspect.Parameter.KEYWORD_ONLY and p.name in POOL_ARGS]  # fmt: skip
    if extension:
        assert [name for name, _, _ in extension] == list(POOL_ARGS)
        assert all(default is None for _, _, default in extension)
    assert [p for p in params(ours) if p not in extension] == params(fla_fn(target))


@pytest.mark.parametrize("ours,target", ENTRY_POINTS, ids=[t for _, t in ENTRY_POINTS])
def test_every_parameter_reaches_the_op(ours, target, monkeypatch):
    """Each entry point names its parameters one by one to its op (not ``locals()``, which torch.compile cannot
    trace before torch 2.13): every parameter, and a keyword that ``**kwargs`` takes, arrives by name."""
    op = dispatch.op_of(ours)
    seen = {}
    monkeypatch.setattr(op, "call", lambda args: seen.update(args))
    parameters = inspect.signature(ours).parameters.values()
    values = {p.name: object() for p in parameters if p.kind is not inspect.Parameter.VAR_KEYWORD}
    if any(p.kind is inspect.Parameter.VAR_KEYWORD for p in parameters):
        values["chunk_size"] = object()
    ours(**values)
    assert seen.keys() == values.keys()
    assert all(seen[name] is value for name, value in values.items())


# -- inputs -----------------------------------------------------------------------------------------------------


def gdn_args(B=1, T=20, H=2, HV=4, K=16, V=8, **extra):
    args = {
        "q": torch.randn(B, T, H, K),
        "k": F.normalize(torch.randn(B, T, H, K), dim=-1),
        "v": torch.randn(B, T, HV, V),
        "g": F.logsigmoid(torch.randn(B, T, HV)),
        "beta": torch.rand(B, T, HV),
    }
    args.update(extra)
    return args


def kda_args(B=1, T=20, H=2, HV=4, K=16, V=8, **extra):
    args = gdn_args(B, T, H, HV, K, V)
    args["g"] = F.logsigmoid(torch.randn(B, T, HV, K))
    args.update(extra)
    return args


CHUNK_GDN = cula.gdn.chunk_gated_delta_rule
CHUNK_KDA = cula.kda.chunk_kda


# -- validation ---------------------------------------------------------------------------------------------


def expect_error(error, match, fn, args):
    with pytest.raises(error, match=match):
        fn(**args)


@pytest.mark.parametrize(
    "mutate,error,match",
    [
        (lambda a: a.update(q=a["q"][0]), ValueError, "`q` must have 4 dimensions"),
        (lambda a: a.update(k=a["k"][:, :, :1]), ValueError, "`k` must have shape"),
        (lambda a: a.update(v=torch.randn(1, 20, 3, 8)), ValueError, "multiple of the H=2"),
        (lambda a: a.update(v=torch.randn(1, 19, 4, 8)), ValueError, "`v` must have shape"),
        (lambda a: a.update(q=a["q"].long()), TypeError, "`q` must have dtype"),
        (lambda a: a.update(q=a["q"].bfloat16()), TypeError, "share one dtype"),
        (lambda a: a.update(q=a["q"].tolist()), TypeError, "`q` must be a torch.Tensor"),
        (lambda a: a.update(g=a["g"][..., :3]), ValueError, "`g` must have shape"),
        (lambda a: a.update(beta=a["beta"][:, :5]), ValueError, "`beta` must have shape"),
        (lambda a: a.update(initial_state=torch.zeros(1, 4, 16, 8).double()), TypeError, "`initial_state` must have"),
        (lambda a: a.update(initial_state=torch.zeros(1, 4, 8, 16)), ValueError, "`initial_state` must have shape"),
        (lambda a: a.update(initial_state=torch.zeros(2, 4, 16, 8)), ValueError, "N=1"),
        (lambda a: a.update(scale="0.5"), TypeError, "`scale` must be a float"),
        (lambda a: a.update(use_gate_in_kernel=True), ValueError, "`A_log` is required"),
        (lambda a: a.update(cu_seqlens=torch.tensor([0, 5, 20.0])), TypeError, "`cu_seqlens` must have dtype"),
        (lambda a: a.update(cu_seqlens=torch.tensor([0, 12, 5, 20])), ValueError, "non-decreasing"),
        (lambda a: a.update(cu_seqlens=torch.tensor([0, 5, 19])), ValueError, "end at T=20"),
    ],
)
def test_gdn_validation(mutate, error, match):
    args = gdn_args()
    mutate(args)
    expect_error(error, match, CHUNK_GDN, args)


def test_varlen_needs_batch_one_and_one_state_per_sequence():
    args = gdn_args(B=2, cu_seqlens=torch.tensor([0, 5, 20]))
    expect_error(ValueError, "batch size of q to be 1", CHUNK_GDN, args)
    args = gdn_args(cu_seqlens=torch.tensor([0, 5, 20], dtype=torch.int32), initial_state=torch.zeros(1, 4, 16, 8))
    expect_error(ValueError, r"N=2 \(len\(cu_seqlens\) - 1\)", CHUNK_GDN, args)


def test_host_copy_of_cu_seqlens_is_checked_too():
    cu = torch.tensor([0, 5, 20])
    o, _ = CHUNK_GDN(**gdn_args(cu_seqlens=cu, cu_seqlens_cpu=cu.clone()))
    assert o.shape == (1, 20, 4, 8)
    args = gdn_args(cu_seqlens=cu, cu_seqlens_cpu=torch.tensor([0, 21, 20]))
    expect_error(ValueError, "non-decreasing", CHUNK_GDN, args)
    expect_error(
        ValueError, "`cu_seqlens_cpu` must have the shape", CHUNK_GDN, gdn_args(cu_seqlens=cu, cu_seqlens_cpu=cu[:2])
    )


def test_validation_hands_on_the_host_offsets_it_read():
    """The host copy validation hands on is made once per offsets and dtype (every layer gets the same one), never
    as an inference tensor (a later training call may save it for its backward)."""

    def host_copy(offsets, dtype=torch.int32):
        args = cula.dispatch.call_args(gdn_args(cu_seqlens=torch.tensor(offsets, dtype=dtype)))
        args.update(cu_seqlens_cpu=None, initial_state=None, state_v_first=False, scale=None)
        CHUNK_GDN.cula_op.validate(args)
        return args["cu_seqlens_cpu"]

    with torch.inference_mode():
        first = host_copy([0, 5, 20])
    assert first.tolist() == [0, 5, 20] and first.dtype == torch.int32 and not first.is_inference()
    assert host_copy([0, 5, 20]) is first
    assert host_copy([0, 6, 20]).tolist() == [0, 6, 20]
    assert host_copy([0, 5, 20], torch.int64).dtype == torch.int64


def test_offsets_are_read_once_per_tensor_and_version():
    """A model hands one cu_seqlens to every layer: validation reads it (a device sync on a GPU) once, and again
    only for another tensor or after an in-place change; bad offsets are refused on every call."""

    class CountingReads(torch.Tensor):
        reads = 0

        def tolist(self):
            type(self).reads += 1
            return super().tolist()

    def validate(cu):
        args = cula.dispatch.call_args(gdn_args(cu_seqlens=cu))
        args.update(cu_seqlens_cpu=None, initial_state=None, state_v_first=False, scale=None)
        CHUNK_GDN.cula_op.validate(args)
        return args["cu_seqlens_cpu"].tolist()

    cu = torch.tensor([0, 5, 20]).as_subclass(CountingReads)
    assert validate(cu) == validate(cu) == [0, 5, 20] and CountingReads.reads == 1
    cu[1] = 25  # in place: read again, and refused every time
    for _ in range(2):
        with pytest.raises(ValueError, match="non-decreasing"):
            validate(cu)
    assert CountingReads.reads == 2
    assert validate(torch.tensor([0, 7, 20]).as_subclass(CountingReads)) == [0, 7, 20] and CountingReads.reads == 3
    with torch.inference_mode():  # no version counter there: every call reads, and sees in-place changes
        inf = torch.tensor([0, 5, 20])
        assert validate(inf) == [0, 5, 20]
        inf[1] = 25
        with pytest.raises(ValueError, match="non-decreasing"):
            validate(inf)


def test_deprecated_transpose_state_layout_means_state_v_first():
    args = gdn_args(initial_state=torch.randn(1, 4, 8, 16), output_final_state=True)
    with pytest.warns(DeprecationWarning, match="state_v_first"):
        o, state = CHUNK_GDN(**args, transpose_state_layout=True)
    o_vf, state_vf = CHUNK_GDN(**args, state_v_first=True)
    torch.testing.assert_close((o, state), (o_vf, state_vf))
    expect_error(ValueError, "not both", CHUNK_GDN, {**args, "state_v_first": True, "transpose_state_layout": True})


def test_state_v_first_layout_is_checked():
    args = gdn_args(state_v_first=True, initial_state=torch.zeros(1, 4, 16, 8))
    expect_error(ValueError, r"\[N, HV, V, K\]", CHUNK_GDN, args)


@pytest.mark.parametrize(
    "extra,error,match",
    [
        ({"g": torch.randn(1, 20, 4)}, ValueError, "`g` must have 4 dimensions"),
        ({"allow_neg_eigval": True}, ValueError, "use_beta_sigmoid_in_kernel"),
        ({"use_gate_in_kernel": True, "safe_gate": True, "A_log": torch.zeros(4)}, ValueError, "`lower_bound`"),
        ({"use_gate_in_kernel": True, "safe_gate": True, "lower_bound": -7.0}, ValueError, r"\[-5, 0\)"),
        ({"use_gate_in_kernel": True, "A_log": torch.zeros(4), "dt_bias": torch.zeros(4)}, ValueError, "`dt_bias`"),
        ({"chunk_size": 16}, ValueError, "`chunk_size`"),
    ],
)
def test_kda_validation(extra, error, match):
    expect_error(error, match, CHUNK_KDA, kda_args(**extra))


def test_recurrent_ops_take_per_value_beta():
    args = gdn_args()
    args["beta"] = torch.rand(1, 20, 4, 8)
    o, _ = cula.gdn.fused_recurrent_gated_delta_rule(**args)
    assert o.shape == args["v"].shape and torch.isfinite(o).all()
    args["beta"] = torch.rand(1, 20, 4, 3)
    expect_error(ValueError, r"`beta` must have shape \[B, T, HV\]", cula.gdn.fused_recurrent_gated_delta_rule, args)
    expect_error(ValueError, "`beta` must have shape", cula.kda.fused_recurrent_kda, kda_args(beta=args["beta"]))


def test_other_ops_validate():
    q = torch.randn(1, 8, 2, 4)
    expect_error(ValueError, "same number of heads", cula.gla.chunk_gla, {"q": q, "k": q, "v": q[:, :, :1], "g": q})
    expect_error(
        ValueError,
        "`g_gamma` must have shape",
        cula.lightning.chunk_simple_gla,
        {"q": q, "k": q, "v": q, "g_gamma": torch.zeros(3)},
    )
    lightning = cula.lightning.chunk_lightning_attn
    expect_error(ValueError, "layer_idx", lightning, {"q": q, "k": q, "v": q, "layer_idx": 4, "num_layers": 4})
    expect_error(
        TypeError, "`num_layers` must be an int", lightning, {"q": q, "k": q, "v": q, "layer_idx": 0, "num_layers": 2.0}
    )


# -- dispatch -----------------------------------------------------------------------------------------------


def test_cpu_calls_go_to_the_reference_backend_with_reasons():
    args = gdn_args()
    decision = cula.explain(CHUNK_GDN, **args)
    assert decision.backend == "torch"
    rejected = dict(decision.rejected)
    assert "CUDA" in rejected["cute"] and "CUDA" in rejected["fla"]
    o, state = CHUNK_GDN(**args, output_final_state=True)
    assert cula.last_decision(CHUNK_GDN).backend == "torch"
    assert o.shape == args["v"].shape and state.dtype == torch.float32


@pytest.mark.parametrize("forced", ["cute", "fla"])
def test_forcing_a_backend_that_cannot_serve_raises(monkeypatch, forced):
    monkeypatch.setenv("CULA_BACKEND", forced)
    with pytest.raises(cula.BackendUnavailableError, match=f"cannot run on '{forced}'"):
        CHUNK_GDN(**gdn_args())


def test_forcing_torch_and_bad_values(monkeypatch):
    monkeypatch.setenv("CULA_BACKEND", "torch")
    assert cula.explain(CHUNK_KDA, **kda_args()).backend == "torch"
    monkeypatch.setenv("CULA_BACKEND", "triton")
    with pytest.raises(ValueError, match="CULA_BACKEND"):
        CHUNK_KDA(**kda_args())


class FakeCuda:
    """Pretends the call's tensors sit on a GPU of compute capability ``cc`` named ``name`` with ``sms`` SMs
    (dispatch reads only these)."""

    def __init__(self, monkeypatch, cc, sms=132, name="NVIDIA H200"):
        monkeypatch.setattr(torch.Tensor, "is_cuda", property(lambda self: True))
        monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: cc)
        props = type("Props", (), {"multi_processor_count": sms, "name": name})
        monkeypatch.setattr(torch.cuda, "get_device_properties", lambda device=None: props)
        cula.runtime.forget_devices()  # what an earlier pretence left read


def test_kernel_tables_pick_by_arch_and_support(monkeypatch):
    op = CHUNK_GDN.cula_op
    saved = list(op.kernels)
    monkeypatch.setattr(op, "kernels", [])
    op.register_kernel(CuteKernel("sm90_kernel", 9, lambda a: (a["q"].shape[-1] == 16, "needs K=16"), lambda a: "sm90"))
    op.register_kernel(CuteKernel("sm100_kernel", 10, lambda a: (True, ""), lambda a: "sm100"))
    FakeCuda(monkeypatch, (9, 0))
    monkeypatch.setattr(dispatch, "fla_function", lambda target: None)
    decision = cula.explain(CHUNK_GDN, **gdn_args())
    assert (decision.backend, decision.reason) == ("cute", "sm90_kernel on sm_90")
    assert CHUNK_GDN(**gdn_args()) == "sm90"
    decision = cula.explain(CHUNK_GDN, **gdn_args(K=32))
    assert decision.backend == "fla" and "needs K=16" in dict(decision.rejected)["cute"]
    FakeCuda(monkeypatch, (10, 0))
    assert CHUNK_GDN(**gdn_args(K=32)) == "sm100"
    FakeCuda(monkeypatch, (8, 0))
    assert "no CuTe DSL kernel for sm_80" in dict(cula.explain(CHUNK_GDN, **gdn_args()).rejected)["cute"]
    assert op.kernels != saved


def test_explain_rejects_non_entry_points():
    with pytest.raises(TypeError, match="not a cuLA entry point"):
        cula.explain(torch.add)


# -- FLA's registry -----------------------------------------------------------------------------------------


def test_fla_registry_calls_cula_on_cpu():
    fla_gdn = fla_fn("fla.ops.gated_delta_rule:chunk_gated_delta_rule")
    fla_kda = fla_fn("fla.ops.kda:chunk_kda")
    cula.register_with_fla()
    for fla_op, ours, args in ((fla_gdn, CHUNK_GDN, gdn_args()), (fla_kda, CHUNK_KDA, kda_args())):
        ours.cula_op.last = None
        o, _ = fla_op(**args)
        assert cula.last_decision(ours).backend == "torch"
        torch.testing.assert_close(o, ours(**args)[0])


def test_gdn_sm90_kernel_is_chosen_for_what_it_supports(monkeypatch):
    FakeCuda(monkeypatch, (9, 0))
    args = gdn_args(T=70, K=128, V=128, HV=4)
    args = {n: t.bfloat16() if n in ("q", "k", "v") else t for n, t in args.items()}
    decision = cula.explain(CHUNK_GDN, **args)
    assert (decision.backend, decision.reason) == ("cute", "gdn.chunk_fwd_sm90 on sm_90")
    for change, why in [
        ({"q": args["q"].float(), "k": args["k"].float(), "v": args["v"].float()}, "bfloat16"),
        ({"chunk_size": 32}, "chunk_size=32"),
        ({"q": args["q"][..., :64], "k": args["k"][..., :64]}, "head dims K=64"),
        ({"q": args["q"].detach().requires_grad_(True)}, "require grad"),
        # one grid row per sequence: at most 65535 of them
        ({"cu_seqlens": torch.tensor([0] * 65536 + [70])}, "65536 sequences"),
    ]:
        decision = cula.explain(CHUNK_GDN, **{**args, **change})
        assert decision.backend != "cute" and why in dict(decision.rejected)["cute"], decision
    with torch.no_grad():
        grad_free = cula.explain(CHUNK_GDN, **{**args, "q": args["q"].detach().requires_grad_(True)})
    assert grad_free.backend == "cute"


def test_simple_gla_sm90_kernel_is_chosen_for_what_it_supports(monkeypatch):
    """chunk_simple_gla and chunk_lightning_attn go to the SM90 kernel where it supports the call, and explain names
    what it does not support."""
    FakeCuda(monkeypatch, (9, 0))
    B, T, H, D = 1, 70, 2, 128
    qkv = {n: torch.randn(B, T, H, D).bfloat16() for n in ("q", "k", "v")}
    for fn, extra in ((SIMPLE_GLA, {"g": torch.zeros(B, T, H)}), (LIGHTNING, {"layer_idx": 1, "num_layers": 4})):
        decision = cula.explain(fn, **qkv, **extra)
        assert (decision.backend, decision.reason) == ("cute", "lightning.chunk_fwd_sm90 on sm_90")
        narrow = {n: t[..., :32] for n, t in qkv.items()}
        assert "head dims K=32" in dict(cula.explain(fn, **narrow, **extra).rejected)["cute"]
        trained = {**qkv, "q": qkv["q"].detach().requires_grad_(True)}
        assert "require grad" in dict(cula.explain(fn, **trained, **extra).rejected)["cute"]
        fp32 = {n: t.float() for n, t in qkv.items()}
        assert "bfloat16" in dict(cula.explain(fn, **fp32, **extra).rejected)["cute"]


def test_lightning_decay_is_made_once_per_layer():
    """The kernels' Lightning g_gamma is kept per (device, heads, layer, layers), each FLA's values for its layer."""
    from cula.lightning.api import _lightning_g_gamma
    from cula.lightning.reference import lightning_g_gamma

    cpu = torch.device("cpu")
    first = _lightning_g_gamma(cpu, 4, 1, 4)
    assert _lightning_g_gamma(cpu, 4, 1, 4) is first
    for heads, layer, layers in ((4, 0, 4), (4, 1, 4), (4, 3, 4), (8, 1, 4), (4, 1, 3)):
        assert torch.equal(_lightning_g_gamma(cpu, heads, layer, layers), lightning_g_gamma(heads, layer, layers))


def test_training_skips_fla_where_its_gated_backward_raises(monkeypatch):
    import fla.utils

    FakeCuda(monkeypatch, (9, 0))
    monkeypatch.setattr(fla.utils, "IS_NVIDIA_HOPPER", True)
    monkeypatch.setattr(fla.utils, "TRITON_ABOVE_3_4_0", True)
    monkeypatch.setattr(fla.utils, "TRITON_ABOVE_3_7_1", False)
    args = gdn_args()
    assert cula.explain(CHUNK_GDN, **args).backend == "fla"  # forward only: FLA serves it
    args["q"].requires_grad_(True)
    decision = cula.explain(CHUNK_GDN, **args)
    assert decision.backend == "torch" and "triton < 3.7.1" in dict(decision.rejected)["fla"]
    monkeypatch.setattr(fla.utils, "TRITON_ABOVE_3_7_1", True)
    assert cula.explain(CHUNK_GDN, **args).backend == "fla"


def test_gdn_goes_to_fla_where_the_kernel_is_expected_slower(monkeypatch):
    FakeCuda(monkeypatch, (9, 0))
    # B1 T8192 H32 D64 with q/k normalised in the kernel: 32 CTAs each walking 128 chunks, or split with the later
    # passes loading the first's Tinv and P: the kernel is expected faster than FLA
    T, H = 8192, 32
    args = {n: torch.empty(1, T, H, 64, dtype=torch.bfloat16) for n in ("q", "k", "v")}
    args.update(g=torch.zeros(1, T, H), beta=torch.ones(1, T, H), use_qk_l2norm_in_kernel=True)
    assert cula.explain(CHUNK_GDN, **args).backend == "cute"
    # an FLA ten times faster per token-head than measured: now the estimate sends the call to FLA, and says why
    import dataclasses

    from cula import dispatch

    measured = dispatch.times_for

    def fast_fla(device):
        times = measured(device)
        fla = dataclasses.replace(times.fla["gdn"], ns_per_token_head=times.fla["gdn"].ns_per_token_head / 10, min_ms=0)
        return dataclasses.replace(times, fla={**times.fla, "gdn": fla})

    monkeypatch.setattr(dispatch, "times_for", fast_fla)
    decision = cula.explain(CHUNK_GDN, **args)
    assert decision.backend == "fla" and "FLA expected faster" in dict(decision.rejected)["cute"]
    monkeypatch.setenv("CULA_BACKEND", "cute")
    assert cula.explain(CHUNK_GDN, **args).backend == "cute"


# -- what FLA refuses, refused by name -------------------------------------------------------------------------

FUSED_GDN = cula.gdn.fused_recurrent_gated_delta_rule
FUSED_KDA = cula.kda.fused_recurrent_kda
SIMPLE_GLA = cula.lightning.chunk_simple_gla
LIGHTNING = cula.lightning.chunk_lightning_attn


def plain_args(B=1, T=20, H=2, K=16, V=8, **extra):
    return {"q": torch.randn(B, T, H, K), "k": torch.randn(B, T, H, K), "v": torch.randn(B, T, H, V), **extra}


def heads(H=2, K=16, V=8):
    """GDN inputs with zero-size dims (H heads, K and V head dims)."""
    return {
        "q": torch.randn(1, 20, H, K),
        "k": torch.randn(1, 20, H, K),
        "v": torch.randn(1, 20, H, V),
        "g": torch.zeros(1, 20, H),
        "beta": torch.ones(1, 20, H),
    }


REFUSED = [
    # FLA raises on `head_first` in these three, whatever its value
    (CHUNK_GDN, gdn_args(head_first=True), ValueError, "`head_first`"),
    (CHUNK_GDN, gdn_args(head_first=False), ValueError, "`head_first`"),
    (SIMPLE_GLA, plain_args(head_first=False), ValueError, "`head_first`"),
    (LIGHTNING, plain_args(layer_idx=0, num_layers=2, head_first=True), ValueError, "`head_first`"),
    # elsewhere FLA ignores it: [B, H, T, K] inputs would be read as [B, T, H, K]
    (CHUNK_KDA, kda_args(head_first=True), ValueError, "`head_first`"),
    (FUSED_KDA, kda_args(head_first=True), ValueError, "`head_first`"),
    (FUSED_GDN, gdn_args(head_first=True), ValueError, "`head_first`"),
    (CHUNK_GDN, gdn_args(allow_neg_eigval=True), ValueError, "`allow_neg_eigval=True` needs use_beta_sigmoid"),
    (FUSED_GDN, gdn_args(allow_neg_eigval=True), ValueError, "`allow_neg_eigval=True` needs use_beta_sigmoid"),
    (FUSED_KDA, kda_args(allow_neg_eigval=True), ValueError, "`allow_neg_eigval=True` needs use_beta_sigmoid"),
    (CHUNK_GDN, gdn_args(chunk_size=17), ValueError, "`chunk_size` must be 16, 32 or 64"),
    (CHUNK_GDN, gdn_args(chunk_size=128), ValueError, "`chunk_size` must be 16, 32 or 64"),
    (SIMPLE_GLA, plain_args(chunk_size=24), ValueError, "`chunk_size` must be a power of 2"),
    (LIGHTNING, plain_args(layer_idx=0, num_layers=2, chunk_size=0), ValueError, "`chunk_size` must be a power"),
    (SIMPLE_GLA, plain_args(chunk_size=32.0), TypeError, "`chunk_size` must be an int"),
    (FUSED_GDN, gdn_args(g=None, use_gate_in_kernel=True, A_log=torch.zeros(4)), ValueError, "`g` is required"),
    (CHUNK_GDN, heads(H=0), ValueError, "H >= 1"),
    (CHUNK_GDN, heads(K=0), ValueError, "K >= 1"),
    (CHUNK_GDN, heads(V=0), ValueError, "V >= 1"),
    (CHUNK_GDN, gdn_args(scale=float("nan")), ValueError, "`scale` must be finite"),
    (CHUNK_GDN, gdn_args(scale=float("inf")), ValueError, "`scale` must be finite"),
    (CHUNK_KDA, kda_args(use_gate_in_kernel=True, lower_bound=0.5), ValueError, "`lower_bound` must be <= 0"),
    (FUSED_KDA, kda_args(use_gate_in_kernel=True, lower_bound=float("nan")), ValueError, "`lower_bound`"),
    (CHUNK_KDA, kda_args(use_gate_in_kernel=True, lower_bound="-5"), TypeError, "`lower_bound` must be a float"),
    (CHUNK_GDN, gdn_args(output_final_state="yes"), TypeError, "`output_final_state` must be a bool"),
    (FUSED_KDA, kda_args(output_final_state=2), TypeError, "`output_final_state` must be a bool"),
    (cula.gla.fused_recurrent_gla, plain_args(reverse="no"), TypeError, "`reverse` must be a bool"),
]


@pytest.mark.parametrize("fn,args,error,match", REFUSED, ids=[f"{f.__name__}-{m}" for f, _, _, m in REFUSED])
def test_what_fla_refuses_is_refused_by_name(fn, args, error, match):
    expect_error(error, match, fn, args)


ACCEPTED = [
    (CHUNK_GDN, gdn_args(chunk_size=16)),
    (CHUNK_GDN, gdn_args(chunk_size=32, output_final_state=None)),  # FLA's layers pass use_cache, which may be None
    (CHUNK_KDA, kda_args(head_first=False)),
    (FUSED_GDN, gdn_args(head_first=False, output_final_state=1)),
    (CHUNK_KDA, kda_args(use_gate_in_kernel=True, lower_bound=-1.0, A_log=torch.zeros(4))),
    (SIMPLE_GLA, plain_args(chunk_size=16)),
    (LIGHTNING, plain_args(layer_idx=0, num_layers=2, chunk_size=64)),
    (FUSED_GDN, gdn_args(use_beta_sigmoid_in_kernel=True, allow_neg_eigval=True)),
]


@pytest.mark.parametrize("fn,args", ACCEPTED, ids=[f.__name__ for f, _ in ACCEPTED])
def test_what_fla_accepts_is_accepted(fn, args):
    o, _ = fn(**args)
    assert o.shape == args["v"].shape and torch.isfinite(o).all()


def test_both_offset_tensors_are_checked_against_each_other():
    """With cu_seqlens and cu_seqlens_cpu, the call validates both and refuses them if they differ (a kernel indexes
    with the device tensor and plans with the host one)."""
    cu = torch.tensor([0, 5, 20])
    expect_error(ValueError, "`cu_seqlens_cpu`.*differs from `cu_seqlens`", CHUNK_GDN,
                 gdn_args(cu_seqlens=cu, cu_seqlens_cpu=torch.tensor([0, 6, 20])))  # fmt: skip
    expect_error(ValueError, "`cu_seqlens` must be non-decreasing", CHUNK_GDN,
                 gdn_args(cu_seqlens=torch.tensor([0, 25, 20]), cu_seqlens_cpu=cu))  # fmt: skip
    expect_error(ValueError, "`cu_seqlens_cpu` must be non-decreasing", CHUNK_GDN,
                 gdn_args(cu_seqlens=cu, cu_seqlens_cpu=torch.tensor([0, 25, 20])))  # fmt: skip
    # a write the version counter does not see (the caller's own kernel; here through .data), then the new host copy
    cu.data[1] = 7
    o, _ = CHUNK_GDN(**gdn_args(cu_seqlens=cu, cu_seqlens_cpu=torch.tensor([0, 7, 20])))
    assert o.shape == (1, 20, 4, 8)


def test_float64_goes_to_the_reference_backend(monkeypatch):
    """fp64 inputs are accepted and served by the reference backend, never by FLA's Triton kernels."""
    FakeCuda(monkeypatch, (9, 0))
    args = {n: t.double() for n, t in gdn_args().items()}
    decision = cula.explain(CHUNK_GDN, **args, initial_state=torch.zeros(1, 4, 16, 8, dtype=torch.float64))
    assert decision.backend == "torch" and "float64" in dict(decision.rejected)["fla"]
    expect_error(TypeError, "`initial_state` must have dtype", CHUNK_GDN,
                 gdn_args(initial_state=torch.zeros(1, 4, 16, 8, dtype=torch.float64)))  # fmt: skip


# -- threads ----------------------------------------------------------------------------------------------------


def test_last_decision_is_per_thread():
    CHUNK_GDN(**gdn_args())
    mine = cula.last_decision(CHUNK_GDN)
    seen = []

    def other():
        seen.append(cula.last_decision(CHUNK_GDN))
        CHUNK_GDN(**gdn_args())
        seen.append(cula.last_decision(CHUNK_GDN))

    worker = threading.Thread(target=other)
    worker.start()
    worker.join()
    assert seen[0] is None and seen[1] is not None and seen[1] is not mine
    assert cula.last_decision(CHUNK_GDN) is mine


def test_backend_counts_count_every_threads_calls_while_open():
    """Calls in this thread and another are counted by (op, backend); a block nested in another counts only its own
    calls; nothing is counted after the block."""
    simple_gla = cula.lightning.chunk_simple_gla
    with cula.backend_counts() as outer:
        CHUNK_GDN(**gdn_args())
        worker = threading.Thread(target=lambda: CHUNK_GDN(**gdn_args()))
        worker.start()
        worker.join()
        with cula.backend_counts() as inner:
            args = gdn_args(HV=2)  # simple GLA: one value head per q / k head
            simple_gla(args["q"], args["k"], args["v"], g=args["g"])
    CHUNK_GDN(**gdn_args())
    assert outer == {("gdn.chunk_gated_delta_rule", "torch"): 2, ("lightning.chunk_simple_gla", "torch"): 1}
    assert inner == {("lightning.chunk_simple_gla", "torch"): 1}
    assert not cula.dispatch._COUNTS


def test_offsets_cache_under_threads(monkeypatch):
    """Another thread that evicts an entry between this thread's lookup and its use of it must wait for the lock."""
    from cula import validation

    evict = threading.Event()

    class Interleaved(collections.OrderedDict):
        def get(self, key, default=None):
            found = super().get(key, default)
            if found is not None and not evict.is_set():
                evict.set()  # once: fill the cache with other tensors from another thread, meanwhile
                others = [torch.tensor([0, n, 20]) for n in range(validation._HOST_COPIES_KEPT + 1)]
                worker = threading.Thread(target=lambda: [validation.host_offsets(t) for t in others])
                worker.start()
                worker.join(timeout=0.5)  # with the lock held, the worker waits until this lookup is done
            return found

    monkeypatch.setattr(validation, "_HOST_COPIES", Interleaved())
    cu = torch.tensor([0, 5, 20])
    assert validation.host_offsets(cu) == validation.host_offsets(cu) == [0, 5, 20]


@pytest.mark.parametrize("opt_in", [False, True])
@pytest.mark.parametrize("cc", [(9, 0), (10, 0), (10, 3), (12, 0)])
def test_dispatch_by_compute_capability(monkeypatch, cc, opt_in):
    """Each op with an SM90 kernel, on a faked GPU of each capability: the SM90 table serves 9.0. On 10.0 and 10.3
    simple GLA, Lightning, GLA, GDN and KDA have SM100 kernels that have never run on hardware: each serves the call
    only with CULA_UNTESTED_KERNELS=1, and otherwise the call goes to FLA with that reason. Every op on 12.0 goes to
    FLA and explain names the architecture."""
    FakeCuda(monkeypatch, cc)
    monkeypatch.setenv(dispatch.ENV_UNTESTED, "1" if opt_in else "0")
    monkeypatch.setattr(dispatch, "fla_function", lambda target: None)
    B, T, H, D = 1, 70, 2, 128
    qkv = {n: torch.randn(B, T, H, D).bfloat16() for n in ("q", "k", "v")}
    calls = {
        CHUNK_GDN: {**qkv, "g": torch.zeros(B, T, H), "beta": torch.ones(B, T, H)},
        CHUNK_KDA: {**qkv, "g": torch.zeros(B, T, H, D), "beta": torch.ones(B, T, H), "safe_gate": True},
        cula.lightning.chunk_simple_gla: {**qkv, "g": torch.zeros(B, T, H)},
        cula.lightning.chunk_lightning_attn: {**qkv, "layer_idx": 0, "num_layers": 2},
        cula.gla.chunk_gla: {**qkv, "g": -torch.rand(B, T, H, D)},
    }
    sm100 = {
        cula.lightning.chunk_simple_gla: "lightning.chunk_fwd_sm100",
        cula.lightning.chunk_lightning_attn: "lightning.chunk_fwd_sm100",
        cula.gla.chunk_gla: "gla.chunk_fwd_sm100",
        CHUNK_GDN: "gdn.chunk_fwd_sm100",
        CHUNK_KDA: "kda.chunk_fwd_sm100",
    }
    arch = f"sm_{cc[0]}{cc[1]}"
    for fn, args in calls.items():
        decision = cula.explain(fn, **args)
        if cc == (9, 0):
            assert decision.backend == "cute" and decision.reason.endswith("on sm_90"), decision
        elif cc[0] == 10 and fn in sm100 and opt_in:
            assert (decision.backend, decision.reason) == ("cute", f"{sm100[fn]} on {arch}"), decision
        elif cc[0] == 10 and fn in sm100:
            assert decision.backend == "fla", decision
            reason = dict(decision.rejected)["cute"]
            assert reason == f"{sm100[fn]}: compiled for {arch}, never run on one ({dispatch.ENV_UNTESTED}=1 serves it)"
        else:
            assert decision.backend == "fla", decision
            assert dict(decision.rejected)["cute"] == f"no CuTe DSL kernel for {arch}"


@pytest.mark.parametrize(
    "fn, kernel, per_key",
    [
        (cula.lightning.chunk_simple_gla, "lightning.chunk_fwd_sm100", False),
        (cula.gla.chunk_gla, "gla.chunk_fwd_sm100", True),
    ],
)
def test_the_sm100_chunk_kernels_say_what_they_decline(monkeypatch, fn, kernel, per_key):
    """On a faked B200 with the opt-in: D = 64 and 128 inference calls are served by the SM100 kernel (simple GLA's,
    GLA's); head dims other than those, a fp16 call and a training call FLA can serve (FLA's backward is the faster)
    go to FLA, each with the kernel's reason; a training call is served by the kernel when FLA is not there (its state
    walks in chunks of 128, then PyTorch rows)."""
    FakeCuda(monkeypatch, (10, 0), sms=148, name="NVIDIA B200")
    monkeypatch.setattr(dispatch, "fla_function", lambda target: None)
    monkeypatch.setenv(dispatch.ENV_UNTESTED, "1")

    def call(D=128, dtype=torch.bfloat16, grad=False):
        q = torch.randn(1, 70, 2, D, dtype=dtype, requires_grad=grad)
        k, v = (torch.randn(1, 70, 2, D, dtype=dtype) for _ in range(2))
        return {"q": q, "k": k, "v": v, "g": -torch.rand(1, 70, 2, *((D,) if per_key else ()))}

    for D in (64, 128):
        assert cula.explain(fn, **call(D=D)).reason == f"{kernel} on sm_100"
    cases = {
        "head dims K=32, V=32 not supported (supported: K = V = 64 or 128)": call(D=32),
        "inputs require grad, and FLA's backward is faster than the kernel's": call(grad=True),
        "q, k, v must be bfloat16": call(dtype=torch.float16),
    }
    for reason, args in cases.items():
        decision = cula.explain(fn, **args)
        assert decision.backend == "fla" and reason in dict(decision.rejected)["cute"], decision
    monkeypatch.setattr(dispatch, "fla_function", lambda target: (_ for _ in ()).throw(ImportError("no fla")))
    assert cula.explain(fn, **call(grad=True)).reason == f"{kernel} on sm_100"


@pytest.mark.parametrize("variant", ["gdn", "kda"])
def test_the_sm100_delta_kernels_say_what_they_decline(monkeypatch, variant):
    """On a faked B200 with the opt-in: a D = 128 inference call (q / k norm and the in-kernel gate included; for KDA
    an unbounded gate too, which its SM90 kernel leaves to FLA) is served by the SM100 GDN or KDA kernel; D = 64, a
    fp16 call and a training call (the kernel has no backward) go to FLA, each with the kernel's reason."""
    FakeCuda(monkeypatch, (10, 0), sms=148, name="NVIDIA B200")
    monkeypatch.setattr(dispatch, "fla_function", lambda target: None)
    monkeypatch.setenv(dispatch.ENV_UNTESTED, "1")
    fn, per_key = (CHUNK_KDA, True) if variant == "kda" else (CHUNK_GDN, False)

    def call(D=128, dtype=torch.bfloat16, grad=False, **options):
        q = torch.randn(1, 70, 2, D, dtype=dtype, requires_grad=grad)
        k, v = (torch.randn(1, 70, 2, D, dtype=dtype) for _ in range(2))
        g = -torch.rand(1, 70, 2, *((D,) if per_key else ()))
        return {"q": q, "k": k, "v": v, "g": g, "beta": torch.rand(1, 70, 2), **options}

    in_kernel = {"use_qk_l2norm_in_kernel": True, "use_gate_in_kernel": True, "A_log": torch.zeros(2)}
    served = [call(), call(**in_kernel)]
    if per_key:
        served.append(call(g=-torch.rand(1, 70, 2, 128) * 30, safe_gate=False))
    for args in served:
        assert cula.explain(fn, **args).reason == f"{variant}.chunk_fwd_sm100 on sm_100"
    cases = {
        "head dims K=64, V=64 not supported (supported: K = V = 128)": call(D=64),
        "q, k, v must be bfloat16": call(dtype=torch.float16),
        "forward only": call(grad=True),
    }
    for reason, args in cases.items():
        decision = cula.explain(fn, **args)
        assert decision.backend == "fla" and reason in dict(decision.rejected)["cute"], decision


def test_the_kda_backward_yields_to_fla(monkeypatch):
    """A KDA training call on a faked H200: its kernel's backward (the kernel's walks, PyTorch per-chunk gradients)
    yields to FLA's faster backward, and serves the call when FLA is not there; without safe_gate the kernel serves
    neither."""
    FakeCuda(monkeypatch, (9, 0))
    monkeypatch.setattr(dispatch, "fla_function", lambda target: None)
    args = {n: torch.randn(1, 70, 2, 64).bfloat16() for n in ("q", "k", "v")}
    args["q"].requires_grad_()
    args["g"] = -torch.rand(1, 70, 2, 64)
    args["beta"] = torch.rand(1, 70, 2)
    fn = cula.kda.chunk_kda
    monkeypatch.setenv(dispatch.ENV_UNTESTED, "0")
    decision = cula.explain(fn, **args, safe_gate=True)
    assert decision.backend == "fla" and "FLA's backward is faster" in dict(decision.rejected)["cute"]
    monkeypatch.setattr(dispatch, "fla_function", lambda target: (_ for _ in ()).throw(ImportError("no fla")))
    assert cula.explain(fn, **args, safe_gate=True).reason == "kda.chunk_fwd_sm90 on sm_90"
    assert "unbounded gate" in dict(cula.explain(fn, **args).rejected)["cute"]


def test_a_gla_training_call_takes_the_kernels_backward_beside_fla(monkeypatch):
    """A GLA call on a faked H200 goes to the kernel, training or not, FLA there or not: its backward beat FLA's side
    by side."""
    FakeCuda(monkeypatch, (9, 0))
    monkeypatch.setattr(dispatch, "fla_function", lambda target: None)
    args = {n: torch.randn(1, 70, 2, 64).bfloat16() for n in ("q", "k", "v")}
    args["q"].requires_grad_()
    args["g"] = -torch.rand(1, 70, 2, 64)
    fn = cula.gla.chunk_gla
    monkeypatch.setenv(dispatch.ENV_UNTESTED, "0")
    assert cula.explain(fn, **args).reason == "gla.chunk_fwd_sm90 on sm_90"
    assert cula.explain(fn, **{**args, "q": args["q"].detach()}).reason == "gla.chunk_fwd_sm90 on sm_90"
    monkeypatch.setattr(dispatch, "fla_function", lambda target: (_ for _ in ()).throw(ImportError("no fla")))
    assert cula.explain(fn, **args).reason == "gla.chunk_fwd_sm90 on sm_90"
