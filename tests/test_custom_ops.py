"""The entry points' torch.library custom ops (cula.custom_ops) on the CPU: opcheck, fake shapes, gradients
through the ops, torch.compile(fullgraph=True) without graph breaks, and dispatch of training calls to kernels with
and without a backward."""

from __future__ import annotations

import dataclasses
import inspect
import logging

import pytest
import torch
import torch.nn.functional as F
from functorch.compile import make_boxed_func
from test_api import FakeCuda, gdn_args
from torch._dynamo.backends.common import aot_autograd
from torch._subclasses.fake_tensor import FakeTensorMode

import cula
from cula import custom_ops, dispatch
from cula.dispatch import BackwardKernel, CuteKernel

ENTRY_POINTS = {
    "gdn": cula.gdn.chunk_gated_delta_rule,
    "kda": cula.kda.chunk_kda,
    "gla": cula.gla.chunk_gla,
    "simple_gla": cula.lightning.chunk_simple_gla,
    "lightning": cula.lightning.chunk_lightning_attn,
}
FORWARD_OPS = {
    "gdn": torch.ops.cula.gdn_chunk_fwd,
    "kda": torch.ops.cula.kda_chunk_fwd,
    "gla": torch.ops.cula.gla_chunk_fwd,
    "simple_gla": torch.ops.cula.simple_gla_chunk_fwd,
    "lightning": torch.ops.cula.lightning_chunk_fwd,
}
BACKWARD_OPS = {name: getattr(torch.ops.cula, f"{name}_chunk_bwd") for name in FORWARD_OPS}


def inputs(variant, T=9, H=1, HV=None, K=4, V=3, dtype=torch.float64, lengths=None, initial_state=False, **options):
    """The tensors and options of a call of ``variant`` (an entry point's keyword arguments): q, k [1 or B, T, H, K],
    v [.., HV, V] and the variant's gates; ``lengths`` packs sequences of these lengths (varlen, B = 1)."""
    HV = HV or H
    B = 2 if lengths is None else 1
    if lengths is not None:
        T = sum(lengths)
    q = torch.randn(B, T, H, K, dtype=dtype)
    k = F.normalize(torch.randn(B, T, H, K, dtype=dtype), dim=-1)
    args = {"q": q, "k": k, "v": torch.randn(B, T, HV, V, dtype=dtype)}
    if variant in ("gdn", "kda"):
        args["g"] = F.logsigmoid(torch.randn(B, T, HV, *((K,) if variant == "kda" else ()), dtype=dtype))
        args["beta"] = torch.rand(B, T, HV, dtype=dtype)
    elif variant == "gla":
        args["g"] = F.logsigmoid(torch.randn(B, T, H, K, dtype=dtype))
    elif variant == "simple_gla":
        args["g"] = F.logsigmoid(torch.randn(B, T, H, dtype=dtype))
        args["g_gamma"] = -torch.rand(H, dtype=dtype)
    else:
        args.update(layer_idx=1, num_layers=4)
    N = B
    if lengths is not None:
        args["cu_seqlens"] = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()])
        N = len(lengths)
    if initial_state:
        shape = (N, HV, V, K) if options.get("state_v_first") else (N, HV, K, V)
        args["initial_state"] = torch.randn(shape, dtype=dtype)
    args.update(options)
    return args


RECURRENT_ENTRY_POINTS = {
    "gdn": cula.gdn.fused_recurrent_gated_delta_rule,
    "kda": cula.kda.fused_recurrent_kda,
    "gla": cula.gla.fused_recurrent_gla,
    "simple_gla": cula.lightning.fused_recurrent_simple_gla,
    "lightning": cula.lightning.fused_recurrent_lightning_attn,
}


def recurrent_inputs(variant, **options):
    """:func:`inputs` as the token-by-token entry point of ``variant`` takes them (GLA's per-key gate is ``gk``)."""
    args = inputs(variant, **options)
    if variant == "gla":
        args["gk"] = args.pop("g")
    return args


def requiring_grad(args: dict) -> dict:
    return {
        n: x.requires_grad_() if isinstance(x, torch.Tensor) and x.is_floating_point() else x for n, x in args.items()
    }


# variant, call options: fixed length and varlen, initial state, state_v_first, GVA, in-kernel transforms
CASES = [
    ("gdn", {}),
    ("gdn", {"lengths": [4, 0, 7], "initial_state": True, "output_final_state": True}),
    ("gdn", {"initial_state": True, "state_v_first": True, "output_final_state": True}),
    ("gdn", {"H": 1, "HV": 2, "output_final_state": True}),
    (
        "gdn",
        {
            "use_gate_in_kernel": True,
            "A_log": torch.rand(1, dtype=torch.float64),
            "dt_bias": torch.rand(1, dtype=torch.float64),
            "use_qk_l2norm_in_kernel": True,
            "use_beta_sigmoid_in_kernel": True,
            "allow_neg_eigval": True,
        },
    ),  # fmt: skip
    ("kda", {"lengths": [5, 4], "initial_state": True, "state_v_first": True, "output_final_state": True}),
    ("kda", {"H": 1, "HV": 2, "initial_state": True, "output_final_state": True}),
    (
        "kda",
        {
            "use_gate_in_kernel": True,
            "lower_bound": -5.0,
            "A_log": torch.rand(1, dtype=torch.float64),
            "dt_bias": torch.rand(4, dtype=torch.float64),
            "output_final_state": True,
        },
    ),  # fmt: skip
    ("gla", {"initial_state": True, "output_final_state": True}),
    ("gla", {"lengths": [6, 3], "initial_state": True, "state_v_first": True, "output_final_state": True}),
    ("simple_gla", {"initial_state": True, "output_final_state": True}),
    ("simple_gla", {"lengths": [2, 7], "state_v_first": True, "output_final_state": True}),
    ("lightning", {"initial_state": True, "output_final_state": True}),
    ("lightning", {"lengths": [3, 6], "initial_state": True, "output_final_state": True}),
]
CASE_IDS = [f"{variant}-{'-'.join(options) or 'plain'}" for variant, options in CASES]
# varlen or in-kernel transforms: one case or two per variant
GRADCHECK = [
    (case, id_) for case, id_ in zip(CASES, CASE_IDS, strict=True) if {"lengths", "use_gate_in_kernel"} & set(case[1])
]


def op_call(variant, args):
    """(positional tensors q, k, v; keyword arguments) of the forward op for an entry point's arguments."""
    rest = {n: x for n, x in args.items() if n not in ("q", "k", "v")}
    return (args["q"], args["k"], args["v"]), rest


@pytest.mark.parametrize("variant,options", CASES, ids=CASE_IDS)
def test_opcheck(variant, options):
    """Schema, autograd registration, fake implementation against the real one, AOT dispatch with dynamic shapes (its
    backward included) of both ops, the forward's inputs requiring grad (the backward's never do)."""
    args = inputs(variant, **options)
    tensors, rest = op_call(variant, args)
    o, final_state, _ = FORWARD_OPS[variant](*tensors, **rest, implementation="reference", save_residuals=False)
    grad_final_state = None if final_state is None else torch.randn_like(final_state)
    backward = ([], torch.randn_like(o), grad_final_state, *tensors)
    torch.library.opcheck(BACKWARD_OPS[variant].default, backward, {**rest, "implementation": "reference"})
    tensors, rest = op_call(variant, requiring_grad(args))
    kwargs = {**rest, "implementation": "reference", "save_residuals": True}
    torch.library.opcheck(FORWARD_OPS[variant].default, tensors, kwargs)


@pytest.mark.parametrize("variant,options", [c for c, _ in GRADCHECK], ids=[i for _, i in GRADCHECK])
def test_gradcheck_through_the_ops(variant, options):
    args = inputs(variant, **options)
    names = [n for n, x in args.items() if isinstance(x, torch.Tensor) and x.is_floating_point()]
    op = FORWARD_OPS[variant]

    def call(*tensors):
        o, final_state, _ = op(**{**args, **dict(zip(names, tensors, strict=True))}, implementation="reference",
                               save_residuals=True)  # fmt: skip
        return o if final_state is None else (o, final_state)

    assert torch.autograd.gradcheck(call, [args[n].requires_grad_() for n in names], fast_mode=True)


@pytest.mark.parametrize(
    "variant,options,N,state",
    [
        ("gdn", {"output_final_state": True}, 2, "KV"),
        ("gdn", {"lengths": [4, 5, 0], "output_final_state": True, "state_v_first": True}, 3, "VK"),
        ("kda", {"H": 1, "HV": 2, "output_final_state": True, "state_v_first": True}, 2, "VK"),
        ("gla", {"lengths": [9], "output_final_state": True}, 1, "KV"),
        ("simple_gla", {}, 2, None),
        ("lightning", {"output_final_state": True}, 2, "KV"),
    ],
)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float64])
def test_fake_shapes(variant, options, N, state, dtype):
    """Under FakeTensorMode the ops give o [B, T, HV, V] in q's dtype, the final state [N, HV, K, V] (V-first:
    [N, HV, V, K]) in fp32 (fp64 for fp64 inputs) or None, and one gradient per floating tensor argument, as the
    real ops do."""
    args = inputs(variant, K=4, V=3, dtype=dtype, **options)
    real = FORWARD_OPS[variant](**args, implementation="reference", save_residuals=False)
    with FakeTensorMode() as mode:
        fake_args = {n: mode.from_tensor(x) if isinstance(x, torch.Tensor) else x for n, x in args.items()}
        o, final_state, residuals = FORWARD_OPS[variant](**fake_args, implementation="reference", save_residuals=True)
        grads = BACKWARD_OPS[variant](
            [], o, final_state, **fake_args, implementation="reference"
        )  # fmt: skip
    B, T, H, K = args["q"].shape
    HV, V = args["v"].shape[2:]
    assert (o.shape, o.dtype, residuals) == ((B, T, HV, V), dtype, [])
    assert (real[0].shape, real[0].dtype) == (o.shape, o.dtype)
    if state is None:
        assert final_state is None and real[1] is None
    else:
        expected = (N, HV, K, V) if state == "KV" else (N, HV, V, K)
        state_dtype = torch.float64 if dtype == torch.float64 else torch.float32
        assert (final_state.shape, final_state.dtype) == (expected, state_dtype)
        assert (real[1].shape, real[1].dtype, real[1].stride()) == (expected, state_dtype, final_state.stride())
    names = custom_ops_of(variant).tensors
    for name, grad in zip(names, grads, strict=True):
        x = args.get(name)
        if x is None or not x.is_floating_point():
            assert grad is None, name
        else:
            assert (grad.shape, grad.dtype) == (x.shape, x.dtype), name


def test_reference_backward_runs_under_a_dispatch_mode():
    """The ops' implementations run below every key above a TorchDispatchMode's (FlopCounterMode here): the
    reference's backward recomputes its forward under autograd all the same."""
    from torch.utils.flop_counter import FlopCounterMode

    args = requiring_grad(inputs("gdn", lengths=[3, 6], initial_state=True, output_final_state=True))
    with FlopCounterMode(display=False):
        o, final_state, _ = FORWARD_OPS["gdn"](**args, implementation="reference", save_residuals=True)
        (o.sum() + final_state.sum()).backward()
    expected = requiring_grad({n: x.detach().clone() if isinstance(x, torch.Tensor) else x for n, x in args.items()})
    o, final_state = cula.gdn.chunk_gated_delta_rule(**expected)
    (o.sum() + final_state.sum()).backward()
    for n in ("q", "k", "v", "g", "beta", "initial_state"):
        torch.testing.assert_close(args[n].grad, expected[n].grad, msg=n)


def custom_ops_of(variant) -> custom_ops.EntryOps:
    return dispatch.op_of(ENTRY_POINTS[variant]).library


# -- torch.compile ----------------------------------------------------------------------------------------------


@pytest.fixture
def fresh_compiler():
    """Dynamo's caches emptied: the tests compile functions of one code object, which it recompiles only so often."""
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()


def recording_backend():
    """An AOTAutograd backend (eager kernels, as ``aot_eager``) recording the ops of its forward and backward
    graphs."""
    seen = {"forward": [], "backward": []}

    def compiler(kind):
        def compile_graph(gm, example_inputs):
            seen[kind] += [n.target for n in gm.graph.nodes if n.op == "call_function"]
            return make_boxed_func(gm.forward)

        return compile_graph

    return aot_autograd(fw_compiler=compiler("forward"), bw_compiler=compiler("backward")), seen


@pytest.mark.parametrize("training", [False, True], ids=["inference", "training"])
@pytest.mark.parametrize("varlen", [False, True], ids=["fixed", "varlen"])
@pytest.mark.parametrize("variant", list(ENTRY_POINTS))
@pytest.mark.parametrize("kind", ["chunk", "recurrent"])
def test_compiled_entry_point_matches_eager(kind, variant, varlen, training, fresh_compiler):
    """torch.compile(fullgraph=True) raises on a graph break; the graph holds the entry point (chunk or token by
    token) as its forward op (and its backward op), and gives the eager results and gradients (eager: the reference
    under plain autograd)."""
    options = {"lengths": [7, 13]} if varlen else {"T": 20}
    make = inputs if kind == "chunk" else recurrent_inputs
    args = make(variant, H=2, K=16, V=8, dtype=torch.float32, initial_state=True, **options)
    tensors = [n for n, x in args.items() if isinstance(x, torch.Tensor) and x.is_floating_point()]
    fn = (ENTRY_POINTS if kind == "chunk" else RECURRENT_ENTRY_POINTS)[variant]

    def loss(**kwargs):
        o, final_state = fn(**kwargs, output_final_state=True)
        return (o * o).sum() + final_state.sum()

    backend, seen = recording_backend()
    compiled_args = {n: x.clone().requires_grad_(training) if n in tensors else x for n, x in args.items()}
    eager_args = {n: x.clone().requires_grad_(training) if n in tensors else x for n, x in args.items()}
    compiled = torch.compile(loss, backend=backend, fullgraph=True)(**compiled_args)
    eager = loss(**eager_args)
    torch.testing.assert_close(compiled, eager)
    assert getattr(torch.ops.cula, f"{variant}_{kind}_fwd").default in seen["forward"]
    assert cula.last_decision(fn).backend == "torch"
    if training:
        compiled.backward()
        eager.backward()
        assert getattr(torch.ops.cula, f"{variant}_{kind}_bwd").default in seen["backward"]
        for n in tensors:
            torch.testing.assert_close(compiled_args[n].grad, eager_args[n].grad, msg=n)


def test_compiled_call_checks_the_offsets_as_it_runs(fresh_compiler):
    """Validation cannot read cu_seqlens while compiling: the op checks it when the compiled call runs."""
    fn = torch.compile(lambda **kw: cula.gdn.chunk_gated_delta_rule(**kw)[0], backend="aot_eager", fullgraph=True)
    args = inputs("gdn", lengths=[5, 4], dtype=torch.float32)
    fn(**args)
    with pytest.raises(ValueError, match="must start at 0 and end at T=9"):
        fn(**{**args, "cu_seqlens": torch.tensor([0, 5, 10])})


def test_ops_check_the_offsets_whatever_serves_them(gdn_kernels):
    """A kernel's host path reads the offsets unchecked: the op checks them before any implementation runs."""
    unchecked = CuteKernel("unchecked", 9, lambda a: (True, ""), lambda a: (torch.zeros_like(a["v"]), None))
    gdn_kernels.register_kernel(unchecked)
    args = inputs("gdn", lengths=[5, 4], dtype=torch.float32)
    FORWARD_OPS["gdn"](**args, implementation="unchecked", save_residuals=False)
    args["cu_seqlens"] = torch.tensor([0, 10, 9])
    with pytest.raises(ValueError, match="must be non-decreasing"):
        FORWARD_OPS["gdn"](**args, implementation="unchecked", save_residuals=False)


def test_compiled_call_logs_its_decision_as_it_runs(monkeypatch, caplog, fresh_compiler):
    """CULA_LOG_DISPATCH=1 logs each compiled call's decision as the call runs, as eager calls do, without breaking
    the graph."""
    monkeypatch.setenv(dispatch.ENV_LOG, "1")
    fn = torch.compile(lambda **kw: cula.gla.chunk_gla(**kw)[0], backend="aot_eager", fullgraph=True)
    args = inputs("gla", dtype=torch.float32)
    with caplog.at_level(logging.WARNING, logger="cula.dispatch"):
        fn(**args)
        fn(**args)
    served = "gla.chunk_gla: served by 'torch' (PyTorch reference backend)"
    assert [r.getMessage().splitlines()[0] for r in caplog.records if r.name == "cula.dispatch"] == [served] * 2


def test_compiled_calls_are_counted_as_they_run(fresh_compiler):
    """`cula.backend_counts` counts each compiled call as it runs (the decision is taken then, not as the graph is
    made)."""
    fn = torch.compile(lambda **kw: cula.gla.chunk_gla(**kw)[0], backend="aot_eager", fullgraph=True)
    args = inputs("gla", dtype=torch.float32)
    with cula.backend_counts() as counts:
        fn(**args)
        fn(**args)
        fn(**args)
    assert counts == {("gla.chunk_gla", "torch"): 3}


def test_kernel_time_model_reads_no_offsets_while_compiling(monkeypatch):
    """While compiling, the kernel-versus-FLA estimate takes the call's sequences as of equal length."""
    FakeCuda(monkeypatch, (9, 0))
    monkeypatch.setattr(torch.compiler, "is_compiling", lambda: True)
    import types

    seen = []

    class KernelSpy:
        def ms(self, lengths, HV, sms):
            seen.append(lengths)
            return 0.0

    times = types.SimpleNamespace(label="test", kernels={"gdn": KernelSpy()}, fla={"gdn": dispatch.FlaTime(1.0, 0.1)})
    monkeypatch.setattr(dispatch, "times_for", lambda device: times)
    args = {"q": torch.empty(1, 4096, 2, 64), "v": torch.empty(1, 4096, 4, 64)}
    args["cu_seqlens"] = torch.empty(5, dtype=torch.int64, device="meta")  # reading it would raise
    assert dispatch.kernel_vs_fla(args, "gdn", "gdn") == (True, "")
    assert seen == [[1024] * 4]


# -- training calls and kernels with a backward -------------------------------------------------------------------


def trainable_kernel(name, calls):
    """A kernel whose forward and backward are the reference's, saving the gate's cumulative sum as a residual and
    recording its calls in ``calls``."""
    reference = dispatch.op_of(cula.gdn.chunk_gated_delta_rule).reference

    def forward(args):
        calls.append("forward")
        o, final_state = reference(args)
        return o, final_state, [args["g"].float().cumsum(1)]

    def residuals_like(args):
        return [args["g"].new_empty(args["g"].shape, dtype=torch.float32)]

    def backward(args, residuals, grad_o, grad_final_state):
        calls.append("backward")
        torch.testing.assert_close(residuals[0], args["g"].float().cumsum(1))
        names = [n for n in ("q", "k", "v", "g", "beta", "initial_state") if args.get(n) is not None]
        return custom_ops.reference_grads(reference, args, names, grad_o, grad_final_state)

    def inference(args):
        calls.append("inference")
        return reference(args)

    accept = lambda args: (True, "")  # noqa: E731
    return CuteKernel(name, 9, accept, inference, backward=BackwardKernel(forward, residuals_like, backward))


@pytest.fixture
def gdn_kernels(monkeypatch):
    """The GDN entry point's kernel table, emptied for the test."""
    op = dispatch.op_of(cula.gdn.chunk_gated_delta_rule)
    monkeypatch.setattr(op, "kernels", [])
    return op


def test_opcheck_with_a_kernel_saving_residuals(gdn_kernels):
    calls = []
    gdn_kernels.register_kernel(trainable_kernel("saving", calls))
    args = requiring_grad(inputs("gdn", lengths=[3, 6], initial_state=True, output_final_state=True))
    tensors, rest = op_call("gdn", args)
    torch.library.opcheck(
        FORWARD_OPS["gdn"].default, tensors, {**rest, "implementation": "saving", "save_residuals": True}
    )
    assert "forward" in calls and "backward" in calls


def test_training_call_goes_to_a_kernel_only_with_a_backward(monkeypatch, gdn_kernels):
    FakeCuda(monkeypatch, (9, 0))
    monkeypatch.setattr(dispatch, "fla_function", lambda target: None)
    fn = cula.gdn.chunk_gated_delta_rule
    calls = []
    gdn_kernels.register_kernel(CuteKernel("forward_only", 9, lambda a: (True, ""), lambda a: "forward only"))
    args = gdn_args(initial_state=torch.randn(1, 4, 16, 8), output_final_state=True)
    assert cula.explain(fn, **args).backend == "cute"
    args["q"].requires_grad_(True)
    decision = cula.explain(fn, **args)
    assert decision.backend == "fla"
    assert "forward_only: inputs require grad and the kernel has no backward" in dict(decision.rejected)["cute"]
    monkeypatch.setenv(dispatch.ENV_BACKEND, "cute")
    with pytest.raises(cula.BackendUnavailableError, match="has no backward"):
        fn(**args)
    monkeypatch.delenv(dispatch.ENV_BACKEND)

    gdn_kernels.register_kernel(trainable_kernel("trainable", calls))
    decision = cula.explain(fn, **args)
    assert (decision.backend, decision.reason) == ("cute", "trainable on sm_90")
    # a training call runs through the ops: the kernel's saving forward, then its backward
    args = requiring_grad(args)
    o, final_state = fn(**args)
    (o.square().sum() + final_state.sum()).backward()
    assert calls == ["forward", "backward"]
    monkeypatch.setenv(dispatch.ENV_BACKEND, "torch")
    expected = requiring_grad({n: x.detach().clone() if isinstance(x, torch.Tensor) else x for n, x in args.items()})
    o_ref, final_ref = fn(**expected)
    (o_ref.square().sum() + final_ref.sum()).backward()
    assert cula.last_decision(fn).backend == "torch"
    for n in ("q", "k", "v", "g", "beta", "initial_state"):
        torch.testing.assert_close(args[n].grad, expected[n].grad, msg=n)


def test_an_eager_training_call_runs_the_ops_implementations_without_their_dispatch(monkeypatch, gdn_kernels):
    """Outside a compiled graph a kernel's training call runs the ops' forward and backward implementations under a
    plain autograd function, not the custom ops themselves (their dispatch costs about 0.2 ms of host time per
    call): the same gradients as through the ops, residuals included."""
    calls = []
    FakeCuda(monkeypatch, (9, 0))
    monkeypatch.setattr(dispatch, "fla_function", lambda target: None)
    gdn_kernels.register_kernel(trainable_kernel("trainable", calls))
    fn = cula.gdn.chunk_gated_delta_rule
    args = gdn_args(initial_state=torch.randn(1, 4, 16, 8), output_final_state=True)

    def gradients(run):
        leaves = requiring_grad({n: x.detach().clone() if isinstance(x, torch.Tensor) else x for n, x in args.items()})
        o, final_state = run(leaves)
        (o.square().sum() + final_state.sum()).backward()
        return {n: leaves[n].grad for n in ("q", "k", "v", "g", "beta", "initial_state")}

    through_ops = gradients(lambda a: gdn_kernels.library(a, "trainable", True))
    assert calls == ["forward", "backward"]

    def refused(*args, **kwargs):
        raise AssertionError("an eager training call went through the custom ops")

    monkeypatch.setattr(gdn_kernels.library, "forward", refused)
    monkeypatch.setattr(gdn_kernels.library, "backward", refused)
    eager = gradients(lambda a: fn(**a))
    assert cula.last_decision(fn).backend == "cute"
    assert calls == ["forward", "backward"] * 2
    for n, grad in through_ops.items():
        torch.testing.assert_close(eager[n], grad, rtol=0, atol=0, msg=n)


def test_strided_inputs_reach_the_kernel_contiguous(monkeypatch, gdn_kernels):
    """FLA's layers hand over q, k, v as strided views of one projection; the kernel is served them contiguous,
    for inference and training, and the gradients reach the strided leaves as on the reference."""
    FakeCuda(monkeypatch, (9, 0))
    monkeypatch.setattr(dispatch, "fla_function", lambda target: None)
    calls, seen = [], []
    kernel = trainable_kernel("trainable", calls)
    strict = lambda run: lambda a: seen.append(all(a[n].is_contiguous() for n in ("q", "k", "v", "g"))) or run(a)  # noqa: E731
    kernel.run = strict(kernel.run)
    kernel.backward = dataclasses.replace(kernel.backward, forward=strict(kernel.backward.forward))
    gdn_kernels.register_kernel(kernel)
    fn = cula.gdn.chunk_gated_delta_rule

    def strided_args():
        torch.manual_seed(3)
        fused = torch.randn(1, 20, 2, 16 * 2 + 8 * 2, dtype=torch.float64)  # one projection, split per head
        g = F.logsigmoid(torch.randn(1, 4, 20, dtype=torch.float64)).transpose(1, 2)
        args = {
            "q": fused[..., :16], "k": F.normalize(fused[..., 16:32], dim=-1),
            "v": fused[..., 32:].reshape(1, 20, 2, 2, 8).transpose(2, 3).reshape(1, 20, 4, 8), "g": g,
            "beta": torch.rand(1, 20, 4, dtype=torch.float64), "output_final_state": True,
        }  # fmt: skip
        return args, fused.requires_grad_(True)

    args, _ = strided_args()
    assert not args["q"].is_contiguous() and not args["g"].is_contiguous()
    o, final_state = fn(**args)
    assert cula.last_decision(fn).backend == "cute" and seen == [True]

    losses = {}
    for backend in ("cute", "torch"):
        monkeypatch.setenv(dispatch.ENV_BACKEND, backend)
        args, leaf = strided_args()
        args["q"], args["k"] = leaf[..., :16], F.normalize(leaf[..., 16:32], dim=-1)
        o, final_state = fn(**args)
        (o.square().sum() + final_state.sum()).backward()
        losses[backend] = (o.detach(), leaf.grad)
    assert calls[-2:] == ["forward", "backward"] and seen[-1] is True
    torch.testing.assert_close(losses["cute"][0], losses["torch"][0])
    torch.testing.assert_close(losses["cute"][1], losses["torch"][1])


def training_call_with(monkeypatch, gdn_kernels, name, **backward_fields):
    """On a faked SM90 device with FLA importable: a trainable kernel ``name`` whose backward has
    ``backward_fields``, and GDN arguments of a training call (q requires grad)."""
    FakeCuda(monkeypatch, (9, 0))
    monkeypatch.setattr(dispatch, "fla_function", lambda target: None)
    kernel = trainable_kernel(name, [])
    kernel.backward = dataclasses.replace(kernel.backward, **backward_fields)
    gdn_kernels.register_kernel(kernel)
    args = gdn_args(initial_state=torch.randn(1, 4, 16, 8), output_final_state=True)
    args["q"].requires_grad_(True)
    return args


def test_an_untested_backward_serves_training_calls_only_when_asked(monkeypatch, gdn_kernels):
    """A kernel whose backward has not run on a GPU keeps serving inference calls; training calls go on to the next
    backend, with the reason, unless CULA_UNTESTED_KERNELS=1."""
    fn = cula.gdn.chunk_gated_delta_rule
    args = training_call_with(monkeypatch, gdn_kernels, "opt_in", hardware_tested=False)
    with torch.no_grad():
        assert cula.explain(fn, **args).backend == "cute"
    decision = cula.explain(fn, **args)
    assert decision.backend == "fla"
    assert "opt_in: inputs require grad, and its backward has not run on a GPU" in dict(decision.rejected)["cute"]
    monkeypatch.setenv(dispatch.ENV_UNTESTED, "1")
    assert cula.explain(fn, **args).backend == "cute"


def test_a_backward_slower_than_flas_serves_the_training_calls_fla_refuses(monkeypatch, gdn_kernels):
    """A tested backward that FLA's beats: training calls go to FLA where FLA serves them, to the kernel where FLA
    refuses them (not to the reference backend), and CULA_BACKEND=cute forces it."""
    fn = cula.gdn.chunk_gated_delta_rule
    args = training_call_with(monkeypatch, gdn_kernels, "slower", beats_fla=False)
    decision = cula.explain(fn, **args)
    assert decision.backend == "fla"
    assert "FLA's backward is faster" in dict(decision.rejected)["cute"]
    op = dispatch.op_of(fn)
    monkeypatch.setattr(op, "fla_supports", lambda a: (False, "FLA refuses this backward here"))
    assert cula.explain(fn, **args).backend == "cute"
    monkeypatch.setattr(op, "fla_supports", None)
    monkeypatch.setenv(dispatch.ENV_BACKEND, "cute")
    assert cula.explain(fn, **args).backend == "cute"


def test_inference_call_runs_the_kernel_directly(monkeypatch, gdn_kernels):
    """Without autograd or a compiler to serve, a kernel with a backward runs as a forward-only one: no residuals."""
    FakeCuda(monkeypatch, (9, 0))
    calls = []
    gdn_kernels.register_kernel(trainable_kernel("trainable", calls))
    cula.gdn.chunk_gated_delta_rule(**gdn_args())
    assert calls == ["inference"]


def test_a_backward_needs_the_custom_ops():
    op = dispatch.Op("test.op", "fla.ops.gla:chunk_gla", lambda a: None, lambda a: None)
    with pytest.raises(ValueError, match="no custom ops"):
        op.register_kernel(trainable_kernel("trainable", []))


def untraceable(fn):
    """``fn`` behind a graph break: torch.compile(fullgraph=True) raises if it traces the call."""

    def wrapped(*args, **kwargs):
        torch._dynamo.graph_break()
        return fn(*args, **kwargs)

    return wrapped


def compiled_and_eager_gradients(fn, args):
    """(compiled, eager) gradients of one training step through ``fn`` with the floating tensors of ``args``."""
    tensors = [n for n, x in args.items() if isinstance(x, torch.Tensor) and x.is_floating_point()]

    def step(**kwargs):
        o, final_state = fn(**kwargs)
        return (o * o).sum() + final_state.square().sum()

    grads = []
    for run in (torch.compile(step, backend="aot_eager", fullgraph=True), step):
        leaves = {n: x.detach().clone().requires_grad_() if n in tensors else x for n, x in args.items()}
        run(**leaves).backward()
        grads.append({n: leaves[n].grad for n in tensors})
    return grads


@pytest.mark.parametrize("varlen", [False, True], ids=["fixed", "varlen"])
def test_a_compiled_training_step_chooses_its_kernel_as_it_runs(monkeypatch, gdn_kernels, fresh_compiler, varlen):
    """A compiled call (fullgraph) on a faked SM90 device, GVA, fixed-length or varlen with an empty sequence and the
    offsets on the host too: the graph holds the op, not the kernel's host code (here behind graph breaks), and the
    kernel is chosen as the call runs; its backward makes again the residuals the compiled forward did not keep.
    Gradients as eager."""
    FakeCuda(monkeypatch, (9, 0))
    monkeypatch.setattr(dispatch, "fla_function", lambda target: None)
    calls = []
    kernel = trainable_kernel("host_code", calls)
    kernel.supports, kernel.run = untraceable(kernel.supports), untraceable(kernel.run)
    gdn_kernels.register_kernel(kernel)
    offsets = [0, 5, 5, 20] if varlen else None
    extra = {"cu_seqlens": torch.tensor(offsets), "cu_seqlens_cpu": torch.tensor(offsets)} if varlen else {}
    N = 3 if varlen else 1
    args = gdn_args(initial_state=torch.randn(N, 4, 16, 8), output_final_state=True, **extra)
    compiled, eager = compiled_and_eager_gradients(cula.gdn.chunk_gated_delta_rule, args)
    assert calls == ["inference", "forward", "backward", "forward", "backward"]
    assert cula.last_decision(cula.gdn.chunk_gated_delta_rule).reason == "host_code on sm_90"
    for name, grad in eager.items():
        torch.testing.assert_close(compiled[name], grad, msg=name)


def test_a_compiled_training_step_reaches_fla_as_it_runs(monkeypatch, gdn_kernels, fresh_compiler):
    """Where FLA serves the call, a compiled call runs FLA's function inside the op (its host code untraced), and
    the backward recomputes FLA's forward under autograd. Gradients as eager."""
    FakeCuda(monkeypatch, (9, 0))
    reference = dispatch.op_of(cula.gdn.chunk_gated_delta_rule).reference
    calls = []

    def fla(**kwargs):
        calls.append(torch.is_grad_enabled())
        return reference(kwargs)

    monkeypatch.setattr(dispatch, "fla_function", lambda target: untraceable(fla))
    args = gdn_args(initial_state=torch.randn(1, 4, 16, 8), output_final_state=True)
    compiled, eager = compiled_and_eager_gradients(cula.gdn.chunk_gated_delta_rule, args)
    # compiled: the forward without a graph, then again under autograd for the backward; eager: one forward
    assert calls == [False, True, True]
    assert cula.last_decision(cula.gdn.chunk_gated_delta_rule).backend == "fla"
    for name, grad in eager.items():
        torch.testing.assert_close(compiled[name], grad, msg=name)


@pytest.mark.parametrize("variant", list(RECURRENT_ENTRY_POINTS))
def test_opcheck_recurrent(variant):
    """The token-by-token entry points' ops: schema, fake implementation against the real one, autograd."""
    op = torch.ops.cula.__getattr__(f"{variant}_recurrent_fwd")
    args = requiring_grad(recurrent_inputs(variant, lengths=[3, 1, 4], initial_state=True, output_final_state=True))
    tensors, rest = op_call(variant, args)
    torch.library.opcheck(op.default, tensors, {**rest, "implementation": "reference", "save_residuals": True})


def test_a_compiled_decode_step_chooses_its_kernel_as_it_runs(monkeypatch, fresh_compiler):
    """On a faked SM90 device a compiled token-by-token call runs its kernel, chosen as the call runs: the kernel's
    host code (here behind a graph break) stays out of the graph."""
    FakeCuda(monkeypatch, (9, 0))
    monkeypatch.setattr(dispatch, "fla_function", lambda target: None)
    fn = cula.gdn.fused_recurrent_gated_delta_rule
    op = dispatch.op_of(fn)
    calls = []

    def run(args):
        calls.append("kernel")
        return op.reference(args)

    monkeypatch.setattr(op, "kernels", [])
    op.register_kernel(CuteKernel("decode", 9, untraceable(lambda a: (True, "")), untraceable(run)))
    args = recurrent_inputs("gdn", lengths=[1, 1, 1], initial_state=True, output_final_state=True)
    compiled = torch.compile(lambda **kw: fn(**kw), backend="aot_eager", fullgraph=True)(**args)
    torch.testing.assert_close(compiled, fn(**args))
    assert calls == ["kernel", "kernel"]
    assert cula.last_decision(fn).reason == "decode on sm_90"


def test_a_training_call_reaches_a_kernel_only_through_its_ops(monkeypatch, gdn_kernels):
    """A kernel's gradients reach autograd only through the custom ops: a training call with an option the ops do
    not take goes to the next backend, with the reason; FLA's default chunk size and its chunk indices, which change
    nothing, stay with the kernel."""
    calls = []
    FakeCuda(monkeypatch, (9, 0))
    monkeypatch.setattr(dispatch, "fla_function", lambda target: None)
    gdn_kernels.register_kernel(trainable_kernel("trainable", calls))
    fn = cula.gdn.chunk_gated_delta_rule
    args = requiring_grad(gdn_args())
    decision = cula.explain(fn, **args, an_fla_option=1)
    assert decision.backend == "fla"
    assert "an argument the kernel's custom ops do not take" in dict(decision.rejected)["cute"]
    o, _ = fn(**args, chunk_size=64, chunk_indices=torch.zeros(1, 2, dtype=torch.long))
    assert calls == ["forward"] and o.requires_grad


def test_a_compiled_inference_call_is_chosen_as_inference(monkeypatch, gdn_kernels, fresh_compiler):
    """Under no_grad a compiled call is chosen as the eager one is, whatever its tensors' requires_grad (a model's
    parameters): the forward-only kernel serves it."""
    FakeCuda(monkeypatch, (9, 0))
    monkeypatch.setattr(dispatch, "fla_function", lambda target: None)
    reference = gdn_kernels.reference
    gdn_kernels.register_kernel(CuteKernel("forward_only", 9, lambda a: (True, ""), untraceable(reference)))
    fn = cula.gdn.chunk_gated_delta_rule
    args = gdn_args()
    args["g"].requires_grad_()
    with torch.no_grad():
        torch.compile(lambda **kw: fn(**kw), backend="aot_eager", fullgraph=True)(**args)
    assert cula.last_decision(fn).reason == "forward_only on sm_90"


def test_kdas_gate_options_ride_on_its_ops():
    """KDA's kernel reads ``safe_gate`` as it decides: the op carries it (and ``disable_recompute``), so a compiled
    KDA call is held by the op and decided as it runs."""
    args = dispatch.call_args(inputs("kda", lower_bound=-5.0, safe_gate=True, disable_recompute=True))
    assert dispatch.op_of(cula.kda.chunk_kda).library.carries(args)


@pytest.mark.parametrize("kind", ["chunk", "recurrent"])
@pytest.mark.parametrize("variant", list(ENTRY_POINTS))
def test_fla_takes_every_parameter_of_the_ops(kind, variant):
    """A compiled call that FLA serves runs FLA's function inside the op, on the op's parameters: each is one of the
    function's own (FLA 0.6.0, a dependency), or it takes them through ``**kwargs``."""
    fn = (ENTRY_POINTS if kind == "chunk" else RECURRENT_ENTRY_POINTS)[variant]
    op = dispatch.op_of(fn)
    parameters = inspect.signature(dispatch.fla_function(op.fla_target)).parameters
    if not any(p.kind is inspect.Parameter.VAR_KEYWORD for p in parameters.values()):
        assert set(op.library.names) <= set(parameters), op.fla_target
