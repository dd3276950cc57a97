"""Per-call backend selection.

Every public entry point is an `Op` with three kinds of backend, tried in this order:

1. ``cute``  -- CuTe DSL kernels, registered per GPU architecture (SM90, SM100 tables) by kernel modules;
2. ``fla``   -- FLA's Triton op (CUDA tensors, ``fla`` importable);
3. ``torch`` -- cuLA's PyTorch reference backend (any device, forward and backward through autograd).

The first backend whose ``supports`` accepts the call serves it. ``CULA_BACKEND=cute|fla|torch`` forces one
backend and raises `BackendUnavailableError` with the reason when it cannot serve the call.

``explain(fn, *args, **kwargs)`` says which backend would serve a call and why the others were passed over;
``last_decision(fn)`` says which one served the calling thread's most recent call; ``with backend_counts() as
counts:`` counts what served every call made in the block. ``CULA_LOG_DISPATCH=1`` logs every decision.

A training call (a tensor argument requires grad) goes to a kernel only when the kernel has a backward
(`BackwardKernel`) and the call's arguments fit its ``torch.library`` ops (:mod:`cula.custom_ops`), through which
the entry points run their chosen backend when autograd or ``torch.compile`` needs them. A compiled call holds its
forward op with the backend left to be chosen as the op runs, as the same call made eagerly would choose it (FLA
included): no backend's host code is traced, and the environment is read, and the decision logged, at each call. The
compiled calls the ops cannot carry (state pools, context parallelism, FLA options outside their parameters:
:meth:`cula.custom_ops.EntryOps.carries`) are decided once, as the graph is made, and traced into their backend.
"""

from __future__ import annotations

import collections
import contextlib
import contextvars
import importlib
import inspect
import logging
import os
import threading
import warnings
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch

from cula import runtime, validation
from cula.custom_ops import CHOSEN_AS_IT_RUNS, REFERENCE
from cula.devices import FlaTime, KernelTime, times_for

logger = logging.getLogger("cula.dispatch")

BACKENDS = ("cute", "fla", "torch")
ENV_BACKEND = "CULA_BACKEND"
ENV_LOG = "CULA_LOG_DISPATCH"
# Kernels compiled for an architecture but never run on its hardware (SM100 here) serve calls only when this is 1.
ENV_UNTESTED = "CULA_UNTESTED_KERNELS"


def untested_asked() -> bool:
    """Whether the caller asked for what is compiled but has not yet run on a GPU (``CULA_UNTESTED_KERNELS=1``)."""
    return os.environ.get(ENV_UNTESTED, "0") == "1"


Verdict = tuple[bool, str]
SupportsFn = Callable[[dict[str, Any]], Verdict]


class BackendUnavailableError(RuntimeError):
    """Raised when ``CULA_BACKEND`` forces a backend that cannot serve the call."""


@dataclass(frozen=True)
class Decision:
    """Which backend serves a call, and why each backend before it was passed over."""

    op: str
    backend: str
    reason: str
    rejected: tuple[tuple[str, str], ...] = ()

    def __str__(self) -> str:
        lines = [f"{self.op}: served by '{self.backend}' ({self.reason})"]
        lines += [f"  skipped '{name}': {why}" for name, why in self.rejected]
        return "\n".join(lines)


@dataclass(frozen=True)
class BackwardKernel:
    """The training half of a chunk kernel, run through its entry point's custom ops (:mod:`cula.custom_ops`).

    - ``forward(args) -> (o, final_state or None, residuals)``: the kernel's forward, also returning what
      ``run`` reads (per-chunk state checkpoints, gate cumsums, ...), as a list of tensors;
    - ``residuals_like(args)``: empty tensors of the shapes, dtypes and devices ``forward`` returns as residuals
      (the forward op's fake implementation: ``args`` hold fake tensors there);
    - ``run(args, residuals, grad_o, grad_final_state or None) -> {name: gradient}``: a gradient for every tensor
      argument present with a floating dtype.
    """

    forward: Callable[[dict[str, Any]], tuple]
    residuals_like: Callable[[dict[str, Any]], list[torch.Tensor]]
    run: Callable[..., dict[str, torch.Tensor]]
    # False until its GPU tests have passed: it serves training calls only with CULA_UNTESTED_KERNELS=1
    hardware_tested: bool = True
    # False while FLA's backward is the faster: the training calls FLA can serve go to FLA (those FLA refuses, as
    # its gated backwards on Hopper with triton < 3.7.1, come here rather than to the reference backend)
    beats_fla: bool = True


def recomputing(run: Callable[[dict[str, Any]], tuple]) -> Callable[[dict[str, Any]], tuple]:
    """:attr:`BackwardKernel.forward` for a backward that keeps no residuals: it recomputes what it needs from the
    inputs the custom op saves anyway. ``run`` is the kernel's forward, ``(o, final_state or None)``."""

    def forward(args: dict[str, Any]) -> tuple:
        o, final_state = run(args)
        return o, final_state, []

    return forward


@dataclass
class CuteKernel:
    """A CuTe DSL kernel registered for one compute-capability major (9 = SM90, 10 = SM100).

    ``faster_than_fla`` (optional) estimates whether the kernel beats FLA on a call it supports; when it says no
    and FLA can serve the call, dispatch hands the call to FLA (unless ``CULA_BACKEND=cute`` forces the kernel).
    ``backward`` (optional): without one the kernel is forward only, and training calls go to the next backend.
    ``hardware_tested``: False for a kernel only compiled for its architecture, never run there (no such GPU
    reachable): it serves calls only with ``CULA_UNTESTED_KERNELS=1``.
    """

    name: str
    arch_major: int
    supports: SupportsFn
    run: Callable[[dict[str, Any]], Any]
    faster_than_fla: SupportsFn | None = None
    backward: BackwardKernel | None = None
    hardware_tested: bool = True


@dataclass
class Op:
    """One public entry point and its backends; ``call`` receives the caller's arguments bound by name."""

    name: str
    fla_target: str  # "module:function" of FLA's op
    reference: Callable[[dict[str, Any]], Any]  # takes the bound arguments
    validate: Callable[[dict[str, Any]], None]
    fla_supports: SupportsFn | None = None
    # FLA's function that serves calls with a state pool (FLA's public ops leave the pool arguments unread), if any
    fla_pool_target: str | None = None
    kernels: list[CuteKernel] = field(default_factory=list)
    library: Any = None  # the entry point's custom ops (cula.custom_ops.EntryOps), through which its backends run
    _local: threading.local = field(default_factory=threading.local, repr=False, compare=False)

    @property
    def last(self) -> Decision | None:
        """The decision taken for this thread's most recent call (threads serve their own calls)."""
        return getattr(self._local, "last", None)

    @last.setter
    def last(self, decision: Decision | None) -> None:
        self._local.last = decision

    def register_kernel(self, kernel: CuteKernel) -> None:
        if kernel.backward is not None and self.library is None:
            raise ValueError(
                f"{kernel.name} has a backward, but {self.name} has no custom ops for autograd to reach it"
            )
        self.kernels = [k for k in self.kernels if k.name != kernel.name] + [kernel]

    def kernel(self, name: str) -> CuteKernel:
        """The registered kernel called ``name``."""
        for kernel in self.kernels:
            if kernel.name == name:
                return kernel
        raise KeyError(f"{self.name} has no kernel {name!r}")

    # -- backends ---------------------------------------------------------------------------------------------
    def _cute(self, args: dict[str, Any], forced: bool = False) -> tuple[Verdict, CuteKernel | None]:
        q = args["q"]
        if not q.is_cuda:
            return (False, f"tensors are on {q.device.type}, CuTe DSL kernels need CUDA"), None
        major, minor = runtime.device_capability(q.device)
        training = requires_grad(args)
        reasons = []
        for kernel in self.kernels:
            if kernel.arch_major != major:
                continue
            declined = (
                _backward_declines(kernel, args, self._held_by_ops(args), lambda: not forced and self._fla(args)[0][0])
                if training
                else None
            )
            if declined:
                reasons.append(f"{kernel.name}: {declined}")
                continue
            if not kernel.hardware_tested and not untested_asked():
                reasons.append(
                    f"{kernel.name}: compiled for sm_{major}{minor}, never run on one ({ENV_UNTESTED}=1 serves it)"
                )
                continue
            ok, why = kernel.supports(args)
            if ok and not forced and kernel.faster_than_fla is not None and self._fla(args)[0][0]:
                ok, why = kernel.faster_than_fla(args)
            if ok:
                return (True, f"{kernel.name} on sm_{major}{minor}"), kernel
            reasons.append(f"{kernel.name}: {why}")
        if not reasons:
            return (False, f"no CuTe DSL kernel for sm_{major}{minor}"), None
        return (False, "; ".join(reasons)), None

    def _fla(self, args: dict[str, Any]) -> tuple[Verdict, Callable | None]:
        if not args["q"].is_cuda:
            return (False, "FLA's Triton kernels need CUDA tensors"), None
        fp64 = [n for n, t in args.items() if isinstance(t, torch.Tensor) and t.dtype == torch.float64]
        if fp64:
            return (False, f"float64 {', '.join(fp64)}: FLA's Triton kernels compute in fp32 / bf16"), None
        if args.get("cp_context") is not None and (args.get("initial_state") is not None or args["output_final_state"]):
            return (False, "FLA 0.6.0 takes no initial_state / output_final_state with cp_context"), None
        pooled = validation.pooled(args)
        target = self.fla_pool_target if pooled else self.fla_target
        if target is None:
            public = self.fla_target.split(":")[1]
            return (False, f"state pool: FLA 0.6.0's {public} takes no ssm_state_indices / inplace_final_state"), None
        try:
            fn = fla_function(target)
        except ImportError as error:
            return (False, f"fla is not importable ({error})"), None
        if self.fla_supports is not None:
            ok, why = self.fla_supports(args)
            if not ok:
                return (False, why), None
        if pooled:
            # FLA's pool-taking functions sit below its input guard: they index every tensor as contiguous
            return (True, f"FLA Triton {target}"), lambda a: _call_fla(fn, _contiguous_but_pool(a))
        return (True, f"FLA Triton {target}"), lambda a: _call_fla(fn, _without_pool_args(a))

    def _torch(self, args: dict[str, Any]) -> tuple[Verdict, None]:
        return (True, "PyTorch reference backend"), None

    def _runner(self, args: dict[str, Any], implementation: str, direct: Callable) -> Callable:
        """How a chosen cuLA backend runs outside a compiled graph (a compiled call runs the ops with ``"auto"``,
        :meth:`call`): a kernel's training call through the ops' implementations under a plain autograd function
        (:meth:`cula.custom_ops.EntryOps.train_eagerly`: the ops' forward and backward without their dispatch);
        directly otherwise, which keeps the reference's own autograd (no recomputation, double backward)."""
        if implementation == REFERENCE or not requires_grad(args) or not self._held_by_ops(args):
            return direct
        return lambda a: self.library.train_eagerly(a, implementation)

    def decide(self, args: dict[str, Any]) -> tuple[Decision, Callable]:
        """The decision on a call, and how to run it."""
        decision, server = self.choose(args)
        if decision.backend == "cute":
            run = self._runner(args, server.name, server.run)
            # the kernels index their tensors as contiguous (FLA's layers hand over strided q, k, v)
            return decision, lambda a: run(_contiguous_but_pool(a))
        if decision.backend == "torch":
            return decision, self._runner(args, REFERENCE, self.reference)
        return decision, server

    def choose(self, args: dict[str, Any]) -> tuple[Decision, CuteKernel | Callable | None]:
        """The decision on a call, with what serves it: the kernel (cute), FLA's function on the call's arguments
        (fla), or None (torch, the reference)."""
        forced = os.environ.get(ENV_BACKEND, "").strip().lower()
        if forced and forced not in BACKENDS:
            raise ValueError(f"{ENV_BACKEND}={forced!r}: expected one of {', '.join(BACKENDS)}")
        rejected = []
        for name in BACKENDS:
            if forced and name != forced:
                continue
            (ok, why), server = self._cute(args, bool(forced)) if name == "cute" else getattr(self, f"_{name}")(args)
            if ok:
                return Decision(self.name, name, why, tuple(rejected)), server
            rejected.append((name, why))
        assert forced, "the torch backend serves every call"
        raise BackendUnavailableError(f"{ENV_BACKEND}={forced}: {self.name} cannot run on '{forced}': {rejected[0][1]}")

    def call(self, args: dict[str, Any]) -> Any:
        self.validate(args)
        if torch.compiler.is_compiling() and self._held_by_ops(args):
            # chosen as the op runs, not as the graph is made: the backends' host code (kernel modules, FLA's
            # wrappers) need not be traceable
            return self.library(args, CHOSEN_AS_IT_RUNS, requires_grad(args))
        decision, run = self.decide(args)
        self.record(decision)
        return run(args)

    def _held_by_ops(self, args: dict[str, Any]) -> bool:
        """Whether the entry point's custom ops can carry the call: a state pool (written in place), ``cp_context``
        or an option outside the ops' parameters (``return_intermediate_states``, ...) runs its backend directly."""
        return self.library is not None and self.library.carries(args)

    def record(self, decision: Decision) -> None:
        """``decision`` as this thread's last, counted by every open :func:`backend_counts`, logged with
        ``CULA_LOG_DISPATCH=1``."""
        self.last = decision
        if _COUNTS:
            with _COUNTS_LOCK:
                for counts in _COUNTS:
                    counts[(decision.op, decision.backend)] += 1
        if os.environ.get(ENV_LOG, "0") not in ("", "0"):
            _log_decision(str(decision))


_COUNTS: list[collections.Counter] = []  # the open backend_counts blocks' counters
_COUNTS_LOCK = threading.Lock()


@contextlib.contextmanager
def backend_counts():
    """Counts what served each call of a cuLA entry point made while the block runs, in any thread (autograd's
    included): yields a ``collections.Counter`` keyed ``(op, backend)``, e.g. ``{("gdn.chunk_gated_delta_rule",
    "cute"): 120}``, filled as the calls are made. A training loop run inside one says whether the kernels served it.
    """
    counts = collections.Counter()
    with _COUNTS_LOCK:
        _COUNTS.append(counts)
    try:
        yield counts
    finally:
        with _COUNTS_LOCK:
            # by identity: two counters with the same counts compare equal
            del _COUNTS[next(i for i, c in enumerate(_COUNTS) if c is counts)]


@torch.compiler.assume_constant_result
def _log_decision(text: str) -> bool:
    """Logs a decision; while compiling, once as the graph is made (a graph cannot log, and its calls repeat that
    decision)."""
    logger.warning("%s", text)
    return True


_OPS: dict[Callable, Op] = {}


def bind(op: Op, public: Callable) -> Op:
    """Attach ``op`` to its public function so `explain` and `last_decision` can find it."""
    _OPS[public] = op
    public.cula_op = op
    return op


def op_of(fn: Callable) -> Op:
    op = getattr(fn, "cula_op", None) or _OPS.get(fn)
    if op is None:
        raise TypeError(f"{getattr(fn, '__qualname__', fn)!r} is not a cuLA entry point")
    return op


def explain(fn: Callable, *args, **kwargs) -> Decision:
    """Which backend would serve ``fn(*args, **kwargs)``, and why; runs nothing.

    Example: ``print(cula.explain(cula.gdn.chunk_gated_delta_rule, q, k, v, g, beta))``.
    """
    op = op_of(fn)
    bound = inspect.signature(fn).bind(*args, **kwargs)
    bound.apply_defaults()
    named = dict(bound.arguments)
    args = call_args(named, named.pop("kwargs", None))
    op.validate(args)
    return op.decide(args)[0]


def last_decision(fn: Callable) -> Decision | None:
    """The decision taken for the most recent call of ``fn`` in this thread (None before the first)."""
    return op_of(fn).last


# Set while cuLA calls FLA, so that cuLA's registration in FLA's backend registry declines the call
# instead of bouncing it back into cuLA.
inside_fla_call = contextvars.ContextVar("cula_inside_fla_call", default=False)


def _call_fla(fn: Callable, args: dict[str, Any]) -> Any:
    token = inside_fla_call.set(True)
    try:
        return fn(**args)
    finally:
        inside_fla_call.reset(token)


def _without_pool_args(args: dict[str, Any]) -> dict[str, Any]:
    """A call without a pool, as FLA's public op takes it (``fused_recurrent_lightning_attn`` has no ``**kwargs``)."""
    return {n: a for n, a in args.items() if n not in validation.POOL_ARGS}


def _contiguous_but_pool(args: dict[str, Any]) -> dict[str, Any]:
    """Every tensor contiguous but the initial state, which may be a pool written in place (its slot stride is
    taken); a copy only where a tensor is strided, which autograd sees through."""
    return {n: a.contiguous() if isinstance(a, torch.Tensor) and n != "initial_state" else a for n, a in args.items()}


def fla_function(target: str) -> Callable:
    """FLA's function ``module:name``."""
    module, name = target.split(":")
    return getattr(importlib.import_module(module), name)


def _backward_declines(
    kernel: CuteKernel, args: dict[str, Any], held: bool, fla_takes_it: Callable[[], bool]
) -> str | None:
    """Why ``kernel`` does not serve a training call (some tensor argument requires grad), or None; ``held``: whether
    the entry point's custom ops carry the call (:meth:`Op._held_by_ops`); ``fla_takes_it()``: whether FLA would serve
    the call instead (asked only of a backward FLA's beats)."""
    if kernel.backward is None:
        return "inputs require grad and the kernel has no backward (forward only)"
    if not kernel.backward.hardware_tested and not untested_asked():
        return f"inputs require grad, and its backward has not run on a GPU ({ENV_UNTESTED}=1 serves it)"
    if validation.pooled(args):
        return "inputs require grad with a state pool: the pool is written in place, outside autograd"
    if not held:
        # a kernel's gradients reach autograd only through the ops
        return "inputs require grad with an argument the kernel's custom ops do not take (an FLA option)"
    if not kernel.backward.beats_fla and fla_takes_it():
        return "inputs require grad, and FLA's backward is faster than the kernel's (CULA_BACKEND=cute forces it)"
    return None


def requires_grad(args: dict[str, Any]) -> bool:
    """Whether the call builds an autograd graph (some tensor argument requires grad, grad mode on)."""
    return torch.is_grad_enabled() and any(isinstance(t, torch.Tensor) and t.requires_grad for t in args.values())


def fla_gated_backward_ok(args: dict[str, Any]) -> Verdict:
    """FLA 0.6.0 raises in the backward of its gated chunk ops (``chunk_bwd_dqkwg`` with ``g``) on Hopper under
    triton >= 3.4.0, < 3.7.1, unless tilelang serves that kernel: such training calls must not go to FLA."""
    if args.get("g") is None or not requires_grad(args):
        return True, ""
    from importlib.util import find_spec

    from fla.utils import IS_NVIDIA_HOPPER, TRITON_ABOVE_3_4_0, TRITON_ABOVE_3_7_1

    if IS_NVIDIA_HOPPER and TRITON_ABOVE_3_4_0 and not TRITON_ABOVE_3_7_1 and find_spec("tilelang") is None:
        return False, "FLA 0.6.0 refuses this gated backward on Hopper with triton < 3.7.1 (and no tilelang)"
    return True, ""


def call_args(named: dict[str, Any], extra: dict[str, Any] | None = None) -> dict[str, Any]:
    """An entry point's arguments by name: its named parameters, its ``**kwargs`` (``extra``) merged in, and FLA's
    deprecated ``transpose_state_layout`` turned into ``state_v_first`` as FLA does. Entry points spell their
    parameters out rather than pass ``locals()``, which torch.compile cannot trace before torch 2.13."""
    args = {**named, **(extra or {})}
    if "transpose_state_layout" in args and "state_v_first" in args:
        if args["state_v_first"]:
            raise ValueError("pass `state_v_first` or the deprecated `transpose_state_layout`, not both")
        warnings.warn("`transpose_state_layout` is deprecated: use `state_v_first`", DeprecationWarning, stacklevel=3)
        args["state_v_first"] = bool(args.pop("transpose_state_layout"))
    return args


def chunk_kernel_supports(module_name: str, supports_gates: Callable[[dict[str, Any]], tuple]) -> SupportsFn:
    """``supports`` of the chunk kernel in ``module_name`` (imported at the first call: it imports the CuTe DSL): what
    :func:`chunk_fwd_kernel_declines`, then the module's ``supports(q, k, v, *gates, initial_state, cu_seqlens)``,
    the variant's gate arguments from ``supports_gates(args)``."""

    def supports(args: dict[str, Any]) -> Verdict:
        declined = chunk_fwd_kernel_declines(args)
        if declined:
            return declined
        module = importlib.import_module(module_name)
        gates = supports_gates(args)
        return module.supports(args["q"], args["k"], args["v"], *gates, args["initial_state"], args["cu_seqlens"])

    return supports


def chunk_kernel_entry(
    module_name: str,
    forward_name: str,
    supports_gates: Callable[[dict[str, Any]], tuple],
    run_gates: Callable[[dict[str, Any]], tuple],
) -> tuple[SupportsFn, Callable[[dict[str, Any]], Any]]:
    """``(supports, run)`` of the chunk kernel in ``module_name`` (imported at the first call: it imports the CuTe
    DSL): :func:`chunk_kernel_supports`, and ``forward_name(q, k, v, *gates, scale, initial_state,
    output_final_state, cu_seqlens, state_v_first, cu_seqlens_cpu, **pool)`` with the variant's gate arguments from
    ``run_gates(args)``."""

    def run(args: dict[str, Any]):
        from cula.sm90.entry import pool_fields

        return getattr(importlib.import_module(module_name), forward_name)(
            args["q"], args["k"], args["v"], *run_gates(args), args["scale"], args["initial_state"],
            args["output_final_state"], args["cu_seqlens"], args.get("state_v_first", False),
            args.get("cu_seqlens_cpu"), **pool_fields(args),
        )  # fmt: skip

    return chunk_kernel_supports(module_name, supports_gates), run


def chunk_fwd_kernel_declines(args: dict[str, Any]) -> Verdict | None:
    """What every chunk kernel declines: the state pools of :func:`pool_declines`, context parallelism, chunk sizes
    but 64."""
    declined = pool_declines(args)
    if declined:
        return declined
    if args.get("cp_context") is not None:
        return False, "context parallelism (cp_context): FLA serves it on CUDA, the reference backend elsewhere"
    if args.get("chunk_size", 64) != 64:
        return (
            False,
            f"chunk_size={args['chunk_size']}: cuLA's kernels take only FLA's default, 64 (they chunk as they need)",
        )
    return None


def pool_declines(args: dict[str, Any]) -> Verdict | None:
    """What a chunk kernel declines of a state pool: index values it cannot see (while a CUDA graph is captured:
    the host path looks for padding in them, :func:`cula.sm90.entry.chunk_fwd`), a pool that is not contiguous (its
    rows are read and written in place), not fp32 or bf16, or bf16 without indices (the kernels take bf16 pools by
    slot)."""
    if not validation.pooled(args):
        return None
    indices, pool = args.get("ssm_state_indices"), args["initial_state"]
    if pool.dtype not in (torch.float32, torch.bfloat16) or not pool.is_contiguous():
        return False, "state pool: the chunk kernels read and write contiguous fp32 or bf16 pools"
    if pool.dtype == torch.bfloat16 and indices is None:
        return False, "bf16 state pool without ssm_state_indices: the chunk kernels take bf16 pools by index"
    if indices is not None and validation.host_indices(indices) is None:
        return False, "state pool: its index values cannot be read while a CUDA graph is captured"
    return None


def expected_ms(lengths: list[int], HV: int, num_sms: int, kernel: KernelTime, fla: FlaTime) -> tuple[float, float]:
    """(kernel, FLA) expected forward times in ms for sequences of these lengths over ``HV`` value heads on
    ``num_sms`` SMs. A varlen call with its offsets only on the device reads them once per cu_seqlens tensor
    (``validation.host_offsets``), whichever backend serves it, so neither side counts that read."""
    return kernel.ms(lengths, HV, num_sms), fla.ms(lengths, HV)


def kernel_vs_fla(args: dict[str, Any], op: str, kernel: str) -> Verdict:
    """Whether the chunk kernel with time model ``kernel`` (a :data:`cula.devices.KERNELS` name) is expected to beat
    FLA's ``op`` (``"gdn"``, ``"kda"``) on these arguments, on the call's GPU (:func:`cula.devices.times_for`,
    :func:`expected_ms`)."""
    q, v, cu_seqlens = args["q"], args["v"], args["cu_seqlens"]
    if cu_seqlens is None:
        lengths = [q.shape[1]] * q.shape[0]
    elif torch.compiler.is_compiling():
        # a graph cannot hold offsets read from the device: as many sequences, of equal length
        N = cu_seqlens.shape[0] - 1
        lengths = [q.shape[1] // N] * N
    else:
        offsets = validation.host_offsets(cu_seqlens, args.get("cu_seqlens_cpu"))
        lengths = [b - a for a, b in zip(offsets, offsets[1:], strict=False)]
    times = times_for(q.device)
    sms = runtime.sm_count(q.device)
    ours, fla_ms = expected_ms(lengths, v.shape[2], sms, times.kernels[kernel], times.fla[op])
    if ours <= fla_ms:
        return True, ""
    return False, (
        f"FLA expected faster: the kernel walks up to {-(-max(lengths) // 64)} chunks in series here "
        f"(kernel est. {ours:.2f} ms, FLA est. {fla_ms:.2f} ms, {times.label} time model); "
        "CULA_BACKEND=cute forces the kernel"
    )
