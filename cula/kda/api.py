"""Kimi Delta Attention entry points, with FLA 0.6.0's signatures (`fla.ops.kda`)."""

from __future__ import annotations

import numbers
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
    chunk_fwd_kernel_declines,
    chunk_kernel_supports,
    kernel_vs_fla,
    recomputing,
)
from cula.kda import reference
from cula.ops import context_parallel, state_pool
from cula.ops.gates import kernel_kda_gate
from cula.recurrent.plan import recurrent_kernel


def _validate_chunk(args: dict[str, Any]) -> None:
    context_parallel.validate(args)  # first: it sets the call's cu_seqlens
    validation.chunk_size(args, (32, 64), "KDA")
    B, T, H, HV, K, V, N = _validate_common(args)
    validation.per_head("beta", args["beta"], B, T, HV)


def _validate_recurrent(args: dict[str, Any]) -> None:
    B, T, H, HV, K, V, N = _validate_common(args, token_slots=True)
    validation.beta_(args["beta"], B, T, HV, V)


def _validate_common(args: dict[str, Any], token_slots: bool = False) -> tuple[int, ...]:
    validation.head_first(args, refused_in_any_form=False)
    B, T, H, HV, K, V, N = dims = validation.common(args, allow_gva=True, token_slots=token_slots)
    validation.beta_flags(args)
    validation.tensor("g", args["g"], 4)
    validation.shape("g", args["g"], (B, T, HV, K), "[B, T, HV, K]")
    lower_bound = args.get("lower_bound")
    use_gate = args.get("use_gate_in_kernel", False)
    validation.head_params(use_gate, args.get("A_log"), args.get("dt_bias"), HV, HV * K, lower_bound is None)
    if use_gate and lower_bound is not None:
        if isinstance(lower_bound, bool) or not isinstance(lower_bound, numbers.Real):
            raise TypeError(f"`lower_bound` must be a float or None, got {type(lower_bound).__name__}")
        if not lower_bound <= 0:  # NaN too
            raise ValueError(f"`lower_bound` must be <= 0 (it bounds a log decay from below), got {lower_bound}")
    if args.get("safe_gate", False) and use_gate:
        if lower_bound is None:
            raise ValueError("`lower_bound` must be set when safe_gate=True and use_gate_in_kernel=True")
        if not -5 <= lower_bound < 0:
            raise ValueError(f"`lower_bound` must lie in [-5, 0), got {lower_bound}")
    return dims


def chunk_kda(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    scale: float | None = None,
    initial_state: torch.Tensor | None = None,
    output_final_state: bool = False,
    use_qk_l2norm_in_kernel: bool = False,
    use_gate_in_kernel: bool = False,
    use_beta_sigmoid_in_kernel: bool = False,
    allow_neg_eigval: bool = False,
    safe_gate: bool = False,
    lower_bound: float | None = None,
    disable_recompute: bool = False,
    return_intermediate_states: bool = False,
    state_v_first: bool = False,
    cu_seqlens: torch.LongTensor | None = None,
    cu_seqlens_cpu: torch.LongTensor | None = None,
    cp_context: Any | None = None,
    use_graph: bool = False,
    max_num_seqs: int | None = None,
    **kwargs,
):
    """Chunked KDA. q, k: [B, T, H, K]; v: [B, T, HV, V]; g: [B, T, HV, K] (per-key log gate); beta: [B, T, HV].

    Returns ``(o [B, T, HV, V], final_state [N, HV, K, V] fp32 or None)``; ``A_log``/``dt_bias``/``chunk_size``
    as keyword arguments, as in FLA. ``ssm_state_indices`` [N] / ``inplace_final_state`` keywords: states read from
    and written back to a pool (cuLA's extension, `cula.ops.state_pool`).
    """
    return CHUNK.call(
        call_args(
            dict(
                q=q, k=k, v=v, g=g, beta=beta, scale=scale, initial_state=initial_state,
                output_final_state=output_final_state, use_qk_l2norm_in_kernel=use_qk_l2norm_in_kernel,
                use_gate_in_kernel=use_gate_in_kernel, use_beta_sigmoid_in_kernel=use_beta_sigmoid_in_kernel,
                allow_neg_eigval=allow_neg_eigval, safe_gate=safe_gate, lower_bound=lower_bound,
                disable_recompute=disable_recompute, return_intermediate_states=return_intermediate_states,
                state_v_first=state_v_first, cu_seqlens=cu_seqlens, cu_seqlens_cpu=cu_seqlens_cpu, cp_context=cp_context,
                use_graph=use_graph, max_num_seqs=max_num_seqs
            ), kwargs
        )
    )  # fmt: skip


def fused_recurrent_kda(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    A_log: torch.Tensor | None = None,
    dt_bias: torch.Tensor | None = None,
    scale: float | None = None,
    initial_state: torch.Tensor = None,
    output_final_state: bool = False,
    use_qk_l2norm_in_kernel: bool = False,
    use_gate_in_kernel: bool = False,
    use_beta_sigmoid_in_kernel: bool = False,
    allow_neg_eigval: bool = False,
    lower_bound: float | None = None,
    state_v_first: bool = False,
    cu_seqlens: torch.LongTensor | None = None,
    **kwargs,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Token-by-token KDA (decode). Shapes as `chunk_kda`. State pools, speculative verify included: the keywords
    ``ssm_state_indices``, ``num_accepted_tokens``, ``inplace_final_state`` of FLA's ``fused_recurrent_kda_fwd``
    (`cula.ops.state_pool`)."""
    return RECURRENT.call(
        call_args(
            dict(
                q=q, k=k, v=v, g=g, beta=beta, A_log=A_log, dt_bias=dt_bias, scale=scale, initial_state=initial_state,
                output_final_state=output_final_state, use_qk_l2norm_in_kernel=use_qk_l2norm_in_kernel,
                use_gate_in_kernel=use_gate_in_kernel, use_beta_sigmoid_in_kernel=use_beta_sigmoid_in_kernel,
                allow_neg_eigval=allow_neg_eigval, lower_bound=lower_bound, state_v_first=state_v_first,
                cu_seqlens=cu_seqlens
            ), kwargs
        )
    )  # fmt: skip


CHUNK = bind(Op("kda.chunk_kda", "fla.ops.kda:chunk_kda", reference.chunk_kda, _validate_chunk), chunk_kda)
CHUNK.library = EntryOps(
    CHUNK,
    "kda_chunk",
    "Tensor q, Tensor k, Tensor v, Tensor g, Tensor beta, float? scale=None, Tensor? initial_state=None, "
    "bool output_final_state=False, bool use_qk_l2norm_in_kernel=False, bool use_gate_in_kernel=False, "
    "bool use_beta_sigmoid_in_kernel=False, bool allow_neg_eigval=False, bool safe_gate=False, "
    "float? lower_bound=None, bool disable_recompute=False, bool state_v_first=False, Tensor? cu_seqlens=None, "
    "Tensor? cu_seqlens_cpu=None, Tensor? A_log=None, Tensor? dt_bias=None",
)
RECURRENT = bind(
    Op(
        "kda.fused_recurrent_kda",
        "fla.ops.kda:fused_recurrent_kda",
        reference.fused_recurrent_kda,
        _validate_recurrent,
        fla_supports=lambda args: state_pool.fla_kda_supports(args) if validation.pooled(args) else (True, ""),
        fla_pool_target="fla.ops.kda.fused_recurrent:fused_recurrent_kda_fwd",
    ),
    fused_recurrent_kda,
)
RECURRENT.library = EntryOps(
    RECURRENT,
    "kda_recurrent",
    "Tensor q, Tensor k, Tensor v, Tensor g, Tensor beta, Tensor? A_log=None, Tensor? dt_bias=None, "
    "float? scale=None, Tensor? initial_state=None, bool output_final_state=False, bool use_qk_l2norm_in_kernel=False, "
    "bool use_gate_in_kernel=False, bool use_beta_sigmoid_in_kernel=False, bool allow_neg_eigval=False, "
    "float? lower_bound=None, bool state_v_first=False, Tensor? cu_seqlens=None",
)


def _chunk_kernels_decline(args: dict[str, Any]) -> tuple[bool, str] | None:
    """What neither KDA chunk kernel serves (besides :func:`cula.dispatch.chunk_fwd_kernel_declines`)."""
    if args.get("return_intermediate_states", False):
        return False, "return_intermediate_states: the kernel keeps the per-chunk states on chip"
    if args.get("use_graph", False):
        return False, "use_graph (FLA's static CUDA-graph buffers) is served by FLA only"
    return None


def _sm90_supports(args: dict[str, Any]) -> tuple[bool, str]:
    declined = chunk_fwd_kernel_declines(args)
    if declined:
        return declined
    if not args.get("safe_gate", False):
        return False, "unbounded gate (safe_gate=False): FLA's exact path serves it"
    lower_bound = args.get("lower_bound")
    if lower_bound is not None and lower_bound < -5:
        return False, f"lower_bound={lower_bound}: the kernel's intra-chunk factors need gates >= -5"
    declined = _chunk_kernels_decline(args)
    if declined:
        return declined
    from cula.kda import chunk_fwd_sm90  # imports the CuTe DSL: only on an SM90 device

    # g and beta are checked after the pre-passes of _sm90_run, which give them the kernel's dtypes
    return chunk_fwd_sm90.supports(
        args["q"], args["k"], args["v"], None, None, args["initial_state"], args["cu_seqlens"]
    )


def _sm90_run(args: dict[str, Any]):
    from cula.kda.chunk_fwd_sm90 import KDA_SM90
    from cula.sm90.entry import run_bound

    g = args["g"]
    lower_bound = args.get("lower_bound")
    if args.get("use_gate_in_kernel"):
        if g.dtype == torch.bfloat16 and lower_bound is not None:
            # the kernel activates the raw gate as it loads it: no pass over g before it
            gate = (args.get("A_log"), args.get("dt_bias"), lower_bound)
            return run_bound(KDA_SM90, args, g, gate=gate)
        g = kernel_kda_gate(g, args.get("A_log"), args.get("dt_bias"), lower_bound)
    return run_bound(KDA_SM90, args, g.float())


def _sm90_faster_than_fla(args: dict[str, Any]) -> tuple[bool, str]:
    return kernel_vs_fla(args, "kda", "kda")


def _sm90_backward(args: dict[str, Any], residuals: list, grad_o, grad_final_state) -> dict[str, torch.Tensor]:
    """Gradients of every floating tensor argument present: the kernel's backward (:mod:`cula.kda.chunk_bwd_sm90`)
    behind the in-kernel options' PyTorch formulas (:func:`cula.custom_ops.delta_rule_kernel_grads`)."""
    from cula.custom_ops import delta_rule_kernel_grads
    from cula.kda.chunk_bwd_sm90 import chunk_kda_bwd_sm90
    from cula.ops import gates

    def gate(x):
        if args.get("use_gate_in_kernel"):
            return gates.kda_gate(x["g"], x.get("A_log"), x.get("dt_bias"), args.get("lower_bound"))
        return gates.to_compute(x["g"])

    return delta_rule_kernel_grads(args, grad_o, grad_final_state, gate, chunk_kda_bwd_sm90)


# the kernel's state walks, then the per-chunk gradients in PyTorch; its GPU tests passed on an H100
# (tests/test_kda_sm90_backward.py). Many times slower than FLA's Triton backward until a per-chunk kernel takes
# passes 3 and 4 (PERF.md), so it keeps FLA's calls
SM90_BACKWARD = BackwardKernel(recomputing(_sm90_run), lambda args: [], _sm90_backward, beats_fla=False)
CHUNK.register_kernel(
    CuteKernel("kda.chunk_fwd_sm90", 9, _sm90_supports, _sm90_run, _sm90_faster_than_fla, backward=SM90_BACKWARD)
)


# the SM100 kernel's checks: no bound on the gate (its intra-chunk matrices are made exactly, before the launch); g and
# beta are checked after the pre-passes of _sm100_run
_sm100_kernel_supports = chunk_kernel_supports("cula.kda.chunk_fwd_sm100", lambda args: (None, None))


def _sm100_supports(args: dict[str, Any]) -> tuple[bool, str]:
    return _chunk_kernels_decline(args) or _sm100_kernel_supports(args)


def _sm100_run(args: dict[str, Any]):
    from cula.kda.chunk_fwd_sm100 import KDA_SM100
    from cula.sm90.entry import run_bound

    g = args["g"]
    if args.get("use_gate_in_kernel"):  # activated before the launch: the kernel reads g activated
        g = kernel_kda_gate(g, args.get("A_log"), args.get("dt_bias"), args.get("lower_bound"))
    return run_bound(KDA_SM100, args, g.float())


# compiled for sm_100a / sm_103a only (no Blackwell GPU has run it); forward only: training calls go to FLA
CHUNK.register_kernel(CuteKernel("kda.chunk_fwd_sm100", 10, _sm100_supports, _sm100_run, hardware_tested=False))


def _recurrent_gates(args: dict[str, Any]):
    """A fused-recurrent KDA call's gates for the token-by-token kernel: the per-key g (FLA's gate applied in the
    kernel with ``use_gate_in_kernel``: the bounded form whenever ``lower_bound`` is set), the delta rule with beta."""
    from cula.recurrent.plan import Gates

    kind = "log"
    if args.get("use_gate_in_kernel"):
        kind = "kda_softplus" if args.get("lower_bound") is None else "kda_sigmoid"
    return Gates(
        gk=args["g"], gk_kind=kind, delta_rule=True, beta=args["beta"],
        beta_sigmoid=bool(args["use_beta_sigmoid_in_kernel"]), neg_eigval=bool(args["allow_neg_eigval"]),
        qk_l2norm=bool(args["use_qk_l2norm_in_kernel"]), A_log=args.get("A_log"), dt_bias=args.get("dt_bias"),
        lower_bound=args.get("lower_bound"),
    )  # fmt: skip


for _major in (9, 10):
    RECURRENT.register_kernel(recurrent_kernel("kda.fused_recurrent", _recurrent_gates, _major))
