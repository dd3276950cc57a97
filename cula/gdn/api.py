"""Gated DeltaNet entry points, with FLA 0.6.0's signatures (`fla.ops.gated_delta_rule`)."""

from __future__ import annotations

import importlib
from typing import Any

import torch

from cula import validation
from cula.custom_ops import EntryOps
from cula.dispatch import (
    BackwardKernel,
    CuteKernel,
    Op,
    bind,
    call_args,
    chunk_kernel_supports,
    fla_gated_backward_ok,
    kernel_vs_fla,
    recomputing,
)
from cula.gdn import reference
from cula.ops import context_parallel
from cula.ops.gates import kernel_gdn_gate
from cula.recurrent.plan import recurrent_kernel


def _validate_chunk(args: dict[str, Any]) -> None:
    context_parallel.validate(args)  # first: it sets the call's cu_seqlens
    validation.head_first(args, refused_in_any_form=True)
    validation.chunk_size(args, (16, 32, 64), "GDN")
    B, T, H, HV, K, V, N = validation.common(args, allow_gva=True)
    validation.per_head("g", args["g"], B, T, HV)
    validation.per_head("beta", args["beta"], B, T, HV)
    validation.head_params(args.get("use_gate_in_kernel", False), args.get("A_log"), args.get("dt_bias"), HV, HV)
    validation.beta_flags(args)


def _validate_recurrent(args: dict[str, Any]) -> None:
    validation.head_first(args, refused_in_any_form=False)
    B, T, H, HV, K, V, N = validation.common(args, allow_gva=True, token_slots=True)
    validation.beta_flags(args)
    validation.per_head("g", args["g"], B, T, HV, optional=True)
    validation.beta_(args["beta"], B, T, HV, V, optional=True)
    validation.tensor("gk", args["gk"], 4, optional=True)
    validation.shape("gk", args["gk"], (B, T, HV, K), "[B, T, HV, K]")
    validation.tensor("gv", args["gv"], 4, optional=True)
    validation.shape("gv", args["gv"], (B, T, HV, V), "[B, T, HV, V]")
    validation.head_params(args["use_gate_in_kernel"], args["A_log"], args["dt_bias"], HV, HV)
    if args["use_gate_in_kernel"] and args["g"] is None:
        raise ValueError("`g` is required when use_gate_in_kernel=True (the raw gate the kernel activates)")


def chunk_gated_delta_rule(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    scale: float | None = None,
    initial_state: torch.Tensor | None = None,
    output_final_state: bool = False,
    use_qk_l2norm_in_kernel: bool = False,
    use_beta_sigmoid_in_kernel: bool = False,
    allow_neg_eigval: bool = False,
    state_v_first: bool = False,
    cu_seqlens: torch.LongTensor | None = None,
    cu_seqlens_cpu: torch.LongTensor | None = None,
    chunk_indices: torch.LongTensor | None = None,
    cp_context: Any | None = None,
    **kwargs,
):
    """Chunked Gated DeltaNet. q, k: [B, T, H, K]; v: [B, T, HV, V]; g, beta: [B, T, HV] (natural-log gate).

    Returns ``(o [B, T, HV, V], final_state [N, HV, K, V] fp32 or None)``; extra keyword arguments as in FLA
    (``use_gate_in_kernel``, ``A_log``, ``dt_bias``, ``chunk_size``), and cuLA's state pools (``ssm_state_indices``
    [N], ``inplace_final_state``: `cula.ops.state_pool`).
    """
    return CHUNK.call(
        call_args(
            dict(
                q=q, k=k, v=v, g=g, beta=beta, scale=scale, initial_state=initial_state,
                output_final_state=output_final_state, use_qk_l2norm_in_kernel=use_qk_l2norm_in_kernel,
                use_beta_sigmoid_in_kernel=use_beta_sigmoid_in_kernel, allow_neg_eigval=allow_neg_eigval,
                state_v_first=state_v_first, cu_seqlens=cu_seqlens, cu_seqlens_cpu=cu_seqlens_cpu,
                chunk_indices=chunk_indices, cp_context=cp_context
            ), kwargs
        )
    )  # fmt: skip


def fused_recurrent_gated_delta_rule(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor | None = None,
    gk: torch.Tensor | None = None,
    gv: torch.Tensor | None = None,
    beta: torch.Tensor | None = None,
    scale: float = None,
    initial_state: torch.Tensor = None,
    output_final_state: bool = False,
    use_qk_l2norm_in_kernel: bool = False,
    use_gate_in_kernel: bool = False,
    A_log: torch.Tensor | None = None,
    dt_bias: torch.Tensor | None = None,
    use_beta_sigmoid_in_kernel: bool = False,
    allow_neg_eigval: bool = False,
    state_v_first: bool = False,
    cu_seqlens: torch.LongTensor | None = None,
    **kwargs,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Token-by-token Gated DeltaNet (decode). Shapes as `chunk_gated_delta_rule`; gk [B, T, HV, K], gv [B, T, HV, V].
    State pools as `fused_recurrent_kda` takes them (cuLA's extension for GDN, `cula.ops.state_pool`)."""
    return RECURRENT.call(
        call_args(
            dict(
                q=q, k=k, v=v, g=g, gk=gk, gv=gv, beta=beta, scale=scale, initial_state=initial_state,
                output_final_state=output_final_state, use_qk_l2norm_in_kernel=use_qk_l2norm_in_kernel,
                use_gate_in_kernel=use_gate_in_kernel, A_log=A_log, dt_bias=dt_bias,
                use_beta_sigmoid_in_kernel=use_beta_sigmoid_in_kernel, allow_neg_eigval=allow_neg_eigval,
                state_v_first=state_v_first, cu_seqlens=cu_seqlens
            ), kwargs
        )
    )  # fmt: skip


CHUNK = bind(
    Op(
        "gdn.chunk_gated_delta_rule",
        "fla.ops.gated_delta_rule:chunk_gated_delta_rule",
        reference.chunk_gated_delta_rule,
        _validate_chunk,
        fla_supports=fla_gated_backward_ok,
    ),
    chunk_gated_delta_rule,
)
CHUNK.library = EntryOps(
    CHUNK,
    "gdn_chunk",
    "Tensor q, Tensor k, Tensor v, Tensor g, Tensor beta, float? scale=None, Tensor? initial_state=None, "
    "bool output_final_state=False, bool use_qk_l2norm_in_kernel=False, bool use_beta_sigmoid_in_kernel=False, "
    "bool allow_neg_eigval=False, bool state_v_first=False, Tensor? cu_seqlens=None, Tensor? cu_seqlens_cpu=None, "
    "bool use_gate_in_kernel=False, Tensor? A_log=None, Tensor? dt_bias=None",
)
RECURRENT = bind(
    Op(
        "gdn.fused_recurrent_gated_delta_rule",
        "fla.ops.gated_delta_rule:fused_recurrent_gated_delta_rule",
        reference.fused_recurrent_gated_delta_rule,
        _validate_recurrent,
    ),
    fused_recurrent_gated_delta_rule,
)
RECURRENT.library = EntryOps(
    RECURRENT,
    "gdn_recurrent",
    "Tensor q, Tensor k, Tensor v, Tensor? g=None, Tensor? gk=None, Tensor? gv=None, Tensor? beta=None, "
    "float? scale=None, Tensor? initial_state=None, bool output_final_state=False, bool use_qk_l2norm_in_kernel=False, "
    "bool use_gate_in_kernel=False, Tensor? A_log=None, Tensor? dt_bias=None, bool use_beta_sigmoid_in_kernel=False, "
    "bool allow_neg_eigval=False, bool state_v_first=False, Tensor? cu_seqlens=None",
)


def _kernel_gate(args: dict[str, Any]) -> torch.Tensor:
    """The gate as the chunk kernels take it: activated, fp32 [B, T, HV]."""
    g = args["g"]
    return kernel_gdn_gate(g, args.get("A_log"), args.get("dt_bias")) if args.get("use_gate_in_kernel") else g.float()


def _kernel_entry(arch: str):
    """``(supports, run)`` of the chunk kernel ``GDN_<ARCH>`` in ``cula.gdn.chunk_fwd_<arch>`` (imported at the first
    call: it imports the CuTe DSL): its checks are given no g or beta (the launch makes both in the kernel's dtypes)."""
    module_name = f"cula.gdn.chunk_fwd_{arch}"

    def run(args: dict[str, Any]):
        from cula.sm90.entry import run_bound

        kernel = getattr(importlib.import_module(module_name), f"GDN_{arch.upper()}")
        return run_bound(kernel, args, _kernel_gate(args))

    return chunk_kernel_supports(module_name, lambda args: (None, None)), run


_sm90_supports, _sm90_run = _kernel_entry("sm90")
_sm100_supports, _sm100_run = _kernel_entry("sm100")


def _sm90_faster_than_fla(args: dict[str, Any]) -> tuple[bool, str]:
    from cula.gdn.chunk_fwd_sm90 import time_model

    return kernel_vs_fla(args, "gdn", time_model(bool(args["use_qk_l2norm_in_kernel"])))


def _sm90_backward(args: dict[str, Any], residuals: list, grad_o, grad_final_state) -> dict[str, torch.Tensor]:
    """Gradients of every floating tensor argument present: the kernel's backward (:mod:`cula.gdn.chunk_bwd_sm90`)
    behind the in-kernel options' PyTorch formulas (:func:`cula.custom_ops.delta_rule_kernel_grads`)."""
    from cula.custom_ops import delta_rule_kernel_grads
    from cula.gdn.chunk_bwd_sm90 import chunk_gdn_bwd_sm90
    from cula.ops import gates

    def gate(x):
        if args.get("use_gate_in_kernel"):
            return gates.gdn_gate(x["g"], x["A_log"], x.get("dt_bias"))
        return gates.to_compute(x["g"])

    return delta_rule_kernel_grads(args, grad_o, grad_final_state, gate, chunk_gdn_bwd_sm90)


# the kernel's state walks, then the per-chunk gradient kernel; its GPU tests passed on an H100
# (tests/test_gdn_sm90_backward.py). FLA 0.6.0 refuses this backward on Hopper with triton < 3.7.1; elsewhere FLA's
# Triton backward is likely the faster (not measured side by side yet), so it keeps FLA's calls
SM90_BACKWARD = BackwardKernel(recomputing(_sm90_run), lambda args: [], _sm90_backward, beats_fla=False)
CHUNK.register_kernel(
    CuteKernel("gdn.chunk_fwd_sm90", 9, _sm90_supports, _sm90_run, _sm90_faster_than_fla, backward=SM90_BACKWARD)
)


# compiled for sm_100a / sm_103a only (no Blackwell GPU has run it); forward only: training calls go to FLA
CHUNK.register_kernel(CuteKernel("gdn.chunk_fwd_sm100", 10, _sm100_supports, _sm100_run, hardware_tested=False))


def _recurrent_gates(args: dict[str, Any]):
    """A fused-recurrent GDN call's gates for the token-by-token kernel: scalar g (activated in the kernel with
    ``use_gate_in_kernel``), per-key gk, per-value gv, the delta rule with beta (ones when None)."""
    from cula.recurrent.plan import Gates

    gate_in_kernel = bool(args.get("use_gate_in_kernel")) and args["g"] is not None
    return Gates(
        g=args["g"], g_kind="gdn" if gate_in_kernel else "log", gk=args["gk"], gv=args["gv"], delta_rule=True,
        beta=args["beta"], beta_sigmoid=bool(args["use_beta_sigmoid_in_kernel"]),
        neg_eigval=bool(args["allow_neg_eigval"]), qk_l2norm=bool(args["use_qk_l2norm_in_kernel"]),
        A_log=args.get("A_log"), dt_bias=args.get("dt_bias"),
    )  # fmt: skip


for _major in (9, 10):
    RECURRENT.register_kernel(recurrent_kernel("gdn.fused_recurrent", _recurrent_gates, _major))
