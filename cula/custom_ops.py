"""The ``torch.library`` custom ops of the chunk and token-by-token entry points: a ``torch.compile``d model holds a
cuLA call as one graph node (no graph break), and autograd reaches the backward of the backend that served the
forward.

Each entry point has two ops (``Op.library``: ``<variant>_chunk`` or ``<variant>_recurrent``), on tensors and scalar
options only (the entry point's parameters that its backends read, in its order and with its defaults), and a
keyword ``implementation`` naming what serves the call as dispatch chose it: ``"reference"`` (the PyTorch reference backend, any device) or a
:class:`~cula.dispatch.CuteKernel`'s name; or ``"auto"`` (a compiled call): dispatch chooses as the op runs, as it
would for the same call made eagerly, FLA included, so that the graph holds no backend's host code.

- ``cula::<name>_fwd(..., *, str implementation, bool save_residuals) -> (o, final_state, residuals)``:
  o ``[B, T, HV, V]`` in q's dtype; final_state ``[N, HV, K, V]`` (``[N, HV, V, K]`` with ``state_v_first``) in
  fp32 (fp64 for fp64 inputs), or None without ``output_final_state``; residuals: with ``save_residuals`` (a
  training call) what the kernel's backward reads (its :class:`~cula.dispatch.BackwardKernel`), else none. The
  reference saves nothing, nor does ``"auto"``: the backward recomputes what it needs.
- ``cula::<name>_bwd(residuals, grad_o, grad_final_state, ..., *, str implementation) -> Tensor?[]``: one gradient
  per tensor parameter (contiguous), None where the argument is absent or integer. The reference recomputes its
  forward under autograd (:func:`reference_grads`), and so does FLA under ``"auto"``.

The forward's autograd formula calls the backward op, so a compiled backward holds it as one node too. The varlen
offsets are checked on the host as an op runs: a compiled call's validation cannot read them
(:func:`cula.validation.common`). The ops take no state pool (written in place) and no option outside their
parameters: such calls run their backend directly (:meth:`EntryOps.carries`).
"""

from __future__ import annotations

import functools
import operator
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import torch

from cula import validation
from cula.ops.delta_rule_ref import refuse_unsupported

if TYPE_CHECKING:
    from cula.dispatch import Op

REFERENCE = "reference"
CHOSEN_AS_IT_RUNS = "auto"
# FLA's options that the ops may drop, with the values at which dropping them changes nothing: FLA's default chunk
# size, and the chunk indices FLA precomputes for varlen calls (it makes them again)
DROPPABLE = {"chunk_size": lambda value: value == 64, "chunk_indices": lambda value: True}


def _never(value) -> bool:
    return False


class EntryOps:
    """The forward and backward ops of one entry point ``op``: ``cula::<name>_fwd`` and ``cula::<name>_bwd``
    with ``params`` (schema text) as their parameters. Calling it runs the forward op on bound arguments."""

    def __init__(self, op: Op, name: str, params: str):
        self.op = op
        parsed = torch._C.parse_schema(f"cula::{name}({params}) -> ()").arguments
        self.names = [a.name for a in parsed]
        self._named = frozenset(self.names)  # for carries(), asked at every call
        self.defaults = {a.name: a.default_value for a in parsed if a.has_default_value()}
        optional_tensor = torch._C.OptionalType(torch._C.TensorType.get())
        self.tensors = [a.name for a in parsed if a.type.isSubtypeOf(optional_tensor)]  # Tensor and Tensor?

        def define(suffix, fn, schema):
            return torch.library.custom_op(f"cula::{name}_{suffix}", fn, mutates_args=(), schema=schema)

        self.forward = define(
            "fwd",
            self._forward,
            f"({params}, *, str implementation, bool save_residuals) -> (Tensor o, Tensor? final_state, Tensor[] residuals)",
        )
        self.backward = define(
            "bwd",
            self._backward,
            f"(Tensor[] residuals, Tensor grad_o, Tensor? grad_final_state, {params}, *, str implementation) -> Tensor?[]",
        )
        self.forward.register_fake(self._forward_fake)
        self.backward.register_fake(self._backward_fake)
        self.forward.register_autograd(self._autograd_backward, setup_context=self._setup_context)

    def __call__(
        self, args: dict[str, Any], implementation: str, save_residuals: bool
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """``(o, final_state or None)`` of the forward op on an entry point's bound arguments ``args``."""
        if implementation == REFERENCE:
            refuse_unsupported(args)  # arguments the op does not take, which the reference would refuse
        values = [args.get(name, self.defaults.get(name)) for name in self.names]
        o, final_state, _ = self.forward(*values, implementation=implementation, save_residuals=save_residuals)
        return o, final_state

    def train_eagerly(self, args: dict[str, Any], implementation: str) -> tuple[torch.Tensor, torch.Tensor | None]:
        """``(o, final_state or None)`` of a kernel's training call made outside a compiled graph: the ops'
        forward and backward implementations under a plain ``torch.autograd.Function``, without the custom ops'
        dispatch around them (about 0.2 ms of host time per forward, as much again per backward, on a training
        step's critical path). The same implementations, residuals and gradients as the ops'."""
        values = [args.get(name, self.defaults.get(name)) for name in self.names]
        return _EagerTraining.apply(self, implementation, *values)

    def carries(self, args: dict[str, Any]) -> bool:
        """Whether the ops' parameters hold the call: every argument outside them absent (None, or False), or one
        that changes neither the result nor the choice of backend (:data:`DROPPABLE`)."""
        return all(
            name in self._named or value is None or value is False or DROPPABLE.get(name, _never)(value)
            for name, value in args.items()
        )

    def _bind(self, values: tuple) -> dict[str, Any]:
        # an op's implementation receives only the arguments its caller passed: the rest take their defaults
        return {**self.defaults, **dict(zip(self.names, values, strict=False))}

    # -- forward --------------------------------------------------------------------------------------------------
    def _forward(self, *values, implementation: str, save_residuals: bool):
        args = self._bind(values)
        _check_offsets(args)
        if implementation == CHOSEN_AS_IT_RUNS:
            implementation, fla = self._choose(args, save_residuals, record=True)
            if fla is not None:
                o, final_state = fla(args)
                return o, final_state, []
            save_residuals = False
        if implementation == REFERENCE:
            o, final_state = self.op.reference(args)
            return o, final_state, []
        kernel = self.op.kernel(implementation)
        if save_residuals:
            o, final_state, residuals = kernel.backward.forward(args)
            return o, final_state, list(residuals)
        o, final_state = kernel.run(args)
        return o, final_state, []

    def _forward_fake(self, *values, implementation: str, save_residuals: bool):
        args = self._bind(values)
        q, v, cu_seqlens = args["q"], args["v"], args.get("cu_seqlens")
        B, T, H, K = q.shape
        HV, V = v.shape[2], v.shape[3]
        final_state = None
        if args["output_final_state"]:
            N = B if cu_seqlens is None else cu_seqlens.shape[0] - 1
            shape = (N, HV, V, K) if args.get("state_v_first") else (N, HV, K, V)
            final_state = q.new_empty(shape, dtype=torch.promote_types(q.dtype, torch.float32))
        residuals = []
        if save_residuals and implementation not in (REFERENCE, CHOSEN_AS_IT_RUNS):
            residuals = list(self.op.kernel(implementation).backward.residuals_like(args))
        return q.new_empty(B, T, HV, V), final_state, residuals

    # -- backward -------------------------------------------------------------------------------------------------
    def _backward(self, residuals, grad_o, grad_final_state, *values, implementation: str):
        args = self._bind(values)
        if implementation == CHOSEN_AS_IT_RUNS:
            implementation, fla = self._choose(args, training=True, record=False)
            if fla is not None:
                grads = reference_grads(fla, args, self._differentiable(args), grad_o, grad_final_state)
                return [None if grads.get(name) is None else grads[name].contiguous() for name in self.tensors]
            if implementation != REFERENCE:
                backward = self.op.kernel(implementation).backward
                if backward.residuals_like(args):  # the compiled forward kept none: made again
                    residuals = backward.forward(args)[2]
        if implementation == REFERENCE:
            grads = reference_grads(self.op.reference, args, self._differentiable(args), grad_o, grad_final_state)
        else:
            grads = self.op.kernel(implementation).backward.run(args, list(residuals), grad_o, grad_final_state)
        return [None if grads.get(name) is None else grads[name].contiguous() for name in self.tensors]

    def _backward_fake(self, residuals, grad_o, grad_final_state, *values, implementation: str):
        args = self._bind(values)
        differentiable = self._differentiable(args)
        return [args[name].new_empty(args[name].shape) if name in differentiable else None for name in self.tensors]

    def _choose(self, args: dict[str, Any], training: bool, record: bool) -> tuple[str, Any]:
        """What serves a call made with ``"auto"``, as dispatch chooses for the same call made eagerly (a training
        call's floating tensors requiring grad): ``(implementation, None)``, or ``(None, FLA's function on the
        bound arguments)``. ``record``: the decision becomes the thread's last (`cula.last_decision`)."""
        # as an eager call in grad mode (training) or under no_grad: the caller's parameters (A_log, g_gamma, ...)
        # may require grad in an inference call
        if training:
            args = {**args, **{n: args[n].detach().requires_grad_() for n in self._differentiable(args)}}
        with torch.enable_grad() if training else torch.no_grad():
            decision, server = self.op.choose(args)
        if record:
            self.op.record(decision)
        if decision.backend == "fla":
            return None, server
        return (server.name if decision.backend == "cute" else REFERENCE), None

    def _differentiable(self, args: dict[str, Any]) -> list[str]:
        """The tensor arguments that get a gradient: those present with a floating dtype."""
        return [n for n in self.tensors if args.get(n) is not None and args[n].is_floating_point()]

    # -- autograd -------------------------------------------------------------------------------------------------
    def _setup_context(self, ctx, inputs, keyword_only_inputs, output):
        _, _, residuals = output
        ctx.mark_non_differentiable(*residuals)
        self._save(ctx, inputs, residuals, keyword_only_inputs["implementation"])

    def _autograd_backward(self, ctx, grad_o, grad_final_state, grad_residuals):
        grads = self._saved_gradients(ctx, self.backward, grad_o, grad_final_state)
        # the dispatcher drops trailing arguments equal to their defaults: one gradient per argument passed
        return tuple(grads)[: len(ctx.needs_input_grad)]

    def _save(self, ctx, values, residuals, implementation: str) -> None:
        """What a backward needs of a forward on ``values`` (the forward op's parameters in order): the tensor
        arguments and ``residuals`` saved, the other arguments and the implementation kept on ``ctx``."""
        args = self._bind(values)
        ctx.save_for_backward(*(args[n] for n in self.tensors), *residuals)
        ctx.options = {n: value for n, value in args.items() if n not in self.tensors}
        ctx.implementation = implementation

    def _saved_gradients(self, ctx, backward: Callable, grad_o, grad_final_state) -> list:
        """``backward`` (the backward op, or its implementation) on what :meth:`_save` kept: one gradient (or None)
        per parameter of the forward op, in order."""
        saved = ctx.saved_tensors
        args = {**ctx.options, **dict(zip(self.tensors, saved[: len(self.tensors)], strict=True))}
        values = [args[name] for name in self.names]
        grads = backward(
            list(saved[len(self.tensors) :]), grad_o, grad_final_state, *values, implementation=ctx.implementation
        )
        by_name = dict(zip(self.tensors, grads, strict=True))
        return [by_name.get(name) for name in self.names]


class _EagerTraining(torch.autograd.Function):
    """:meth:`EntryOps.train_eagerly`: inputs ``(ops, implementation, *values)`` (``values`` the forward op's
    parameters in order), outputs ``(o, final_state or None)``."""

    @staticmethod
    def forward(ctx, ops: EntryOps, implementation: str, *values):
        o, final_state, residuals = ops._forward(*values, implementation=implementation, save_residuals=True)
        ops._save(ctx, values, residuals, implementation)
        ctx.ops = ops
        return o, final_state

    @staticmethod
    def backward(ctx, grad_o, grad_final_state):
        return None, None, *ctx.ops._saved_gradients(ctx, ctx.ops._backward, grad_o, grad_final_state)


def _check_offsets(args: dict[str, Any]) -> None:
    """The varlen offsets checked (as validation checks them) and their host copy handed on, as the op runs."""
    cu_seqlens = args.get("cu_seqlens")
    if cu_seqlens is None:
        return
    B, T = args["q"].shape[:2]
    offsets = validation.cu_seqlens_(cu_seqlens, B, T, args.get("cu_seqlens_cpu"))
    validation.hand_on_host_offsets(args, offsets, cu_seqlens)


def _eager_dispatch_keys() -> tuple[torch._C.DispatchKeySet, torch._C.DispatchKeySet]:
    """The thread-local (included, excluded) dispatch keys of plain eager code, c10's defaults: autograd on, autocast
    off."""
    keys, key_set = torch._C.DispatchKey, torch._C.DispatchKeySet
    autocast = [key_set(key) for name, key in keys.__members__.items() if name.startswith("Autocast")]
    return key_set(keys.BackendSelect) | key_set(keys.ADInplaceOrView), functools.reduce(operator.or_, autocast)


EAGER_DISPATCH_KEYS = _eager_dispatch_keys()


def reference_grads(reference, args: dict[str, Any], names: list[str], grad_o, grad_final_state) -> dict:
    """Gradients of the arguments ``names`` through ``reference`` (an entry point's reference, on its bound
    arguments ``args``), its forward recomputed under autograd; zeros for an argument the call does not use.

    An op's implementation runs below autograd, and under a TorchDispatchMode (opcheck's, FlopCounterMode) below
    every key above the mode's: the recomputation runs with the keys of plain eager code, as torch's own leaf
    functions do (``torch._higher_order_ops.invoke_leaf_function``)."""
    with torch._C._ForceDispatchKeyGuard(*EAGER_DISPATCH_KEYS), torch.enable_grad():
        inputs = [args[n].detach().requires_grad_() for n in names]
        o, final_state = reference({**args, **dict(zip(names, inputs, strict=True))})
        outputs, cotangents = [o], [grad_o]
        if final_state is not None and grad_final_state is not None:
            outputs.append(final_state)
            cotangents.append(grad_final_state)
        grads = torch.autograd.grad(outputs, inputs, cotangents, allow_unused=True)
    return {n: torch.zeros_like(x) if g is None else g for n, x, g in zip(names, inputs, grads, strict=True)}


def delta_rule_kernel_grads(args: dict[str, Any], grad_o, grad_final_state, gate, kernel_backward) -> dict:
    """Gradients of every floating tensor argument of a delta-rule call (GDN, KDA) whose kernel backward takes the
    in-kernel options' results: q / k L2 norm and beta's sigmoid (:func:`cula.ops.gates.qk_beta_transforms`) and the
    activated gate ``gate(x)`` (``x`` the arguments with leaves requiring grad) are made by their PyTorch formulas under
    autograd, ``kernel_backward(q, k, v, g, beta, do, scale, h0, dht, cu_seqlens, cu_seqlens_cpu, state_v_first) ->
    (dq, dk, dv, dg, dbeta, dh0)`` runs on them, and autograd carries dq, dk, dg and dbeta back through the formulas.
    The dispatch keys as :func:`reference_grads`; the kernel's part runs without autograd."""
    from cula.ops import gates

    floating = ("q", "k", "g", "beta", "A_log", "dt_bias")
    names = [n for n in floating if isinstance(args.get(n), torch.Tensor) and args[n].is_floating_point()]
    with torch._C._ForceDispatchKeyGuard(*EAGER_DISPATCH_KEYS), torch.enable_grad():
        leaves = {n: args[n].detach().requires_grad_() for n in names}
        x = {**args, **leaves}
        q, k, beta = gates.qk_beta_transforms(x)
        g = gate(x)
        beta = gates.to_compute(beta)
    with torch.no_grad():
        dq, dk, dv, dg, dbeta, dh0 = kernel_backward(
            q.detach().to(args["q"].dtype), k.detach().to(args["k"].dtype), args["v"], g.detach(), beta.detach(),
            grad_o, args["scale"], args["initial_state"], grad_final_state, args["cu_seqlens"],
            args.get("cu_seqlens_cpu"), args.get("state_v_first", False),
        )  # fmt: skip
    with torch._C._ForceDispatchKeyGuard(*EAGER_DISPATCH_KEYS):
        outputs = [q, k, g, beta]
        cotangents = [d.to(x.dtype) for d, x in zip((dq, dk, dg, dbeta), outputs, strict=True)]
        through = torch.autograd.grad(outputs, list(leaves.values()), cotangents, allow_unused=True)
    grads = {n: torch.zeros_like(leaves[n]) if d is None else d for n, d in zip(names, through, strict=True)}
    grads["v"] = dv.to(args["v"].dtype)
    if args["initial_state"] is not None:
        grads["initial_state"] = dh0
    return grads
