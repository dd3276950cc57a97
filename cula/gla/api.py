"""Gated Linear Attention entry points, with FLA 0.6.0's signatures (`fla.ops.gla`)."""

from __future__ import annotations

from typing import Any

import torch

from cula import validation
from cula.custom_ops import EntryOps
from cula.dispatch import BackwardKernel, CuteKernel, Op, bind, call_args, chunk_kernel_entry, recomputing
from cula.gla import reference
from cula.recurrent.plan import recurrent_kernel


def _validate(args: dict[str, Any], token_slots: bool = False) -> None:
    validation.head_first(args, refused_in_any_form=False)
    B, T, H, HV, K, V, N = validation.common(args, allow_gva=False, token_slots=token_slots)
    for name, dim in (("g", K), ("gk", K), ("gv", V)):
        if name in args:
            validation.tensor(name, args[name], 4, optional=name != "g")
            validation.shape(name, args[name], (B, T, H, dim), f"[B, T, H, {'K' if dim == K else 'V'}]")


def _validate_recurrent(args: dict[str, Any]) -> None:
    _validate(args, token_slots=True)


def chunk_gla(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    scale: int | None = None,
    initial_state: torch.Tensor = None,
    output_final_state: bool = False,
    state_v_first: bool = False,
    cu_seqlens: torch.LongTensor | None = None,
    cu_seqlens_cpu: torch.LongTensor | None = None,
    *,
    ssm_state_indices: torch.Tensor | None = None,
    num_accepted_tokens: torch.Tensor | None = None,
    inplace_final_state: bool | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Chunked GLA. q, k, g: [B, T, H, K] (g a per-key log gate); v: [B, T, H, V].

    Returns ``(o [B, T, H, V], final_state [N, H, K, V] fp32 or None)``. Beyond FLA's signature, a state pool as
    ``cula.kda.chunk_kda`` takes one (``initial_state`` the pool; ``ssm_state_indices`` [N], ``inplace_final_state``;
    `cula.ops.state_pool`), so that prefill and decode (`fused_recurrent_gla`) share it.
    """
    return CHUNK.call(
        call_args(
            dict(
                q=q, k=k, v=v, g=g, scale=scale, initial_state=initial_state, output_final_state=output_final_state,
                state_v_first=state_v_first, cu_seqlens=cu_seqlens, cu_seqlens_cpu=cu_seqlens_cpu,
                ssm_state_indices=ssm_state_indices, num_accepted_tokens=num_accepted_tokens,
                inplace_final_state=inplace_final_state
            )
        )
    )  # fmt: skip


def fused_recurrent_gla(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    gk: torch.Tensor | None = None,
    gv: torch.Tensor | None = None,
    scale: int | None = None,
    initial_state: torch.Tensor | None = None,
    output_final_state: bool = False,
    reverse: bool = False,
    state_v_first: bool = False,
    cu_seqlens: torch.LongTensor | None = None,
    **kwargs,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Token-by-token GLA. gk: [B, T, H, K], gv: [B, T, H, V] (both optional log gates). State pools as
    `cula.kda.fused_recurrent_kda` takes them (`cula.ops.state_pool`)."""
    return RECURRENT.call(
        call_args(
            dict(
                q=q, k=k, v=v, gk=gk, gv=gv, scale=scale, initial_state=initial_state,
                output_final_state=output_final_state, reverse=reverse, state_v_first=state_v_first, cu_seqlens=cu_seqlens
            ), kwargs
        )
    )  # fmt: skip


CHUNK = bind(Op("gla.chunk_gla", "fla.ops.gla:chunk_gla", reference.chunk_gla, _validate), chunk_gla)
CHUNK.library = EntryOps(
    CHUNK,
    "gla_chunk",
    "Tensor q, Tensor k, Tensor v, Tensor g, float? scale=None, Tensor? initial_state=None, "
    "bool output_final_state=False, bool state_v_first=False, Tensor? cu_seqlens=None, Tensor? cu_seqlens_cpu=None",
)
RECURRENT = bind(
    Op(
        "gla.fused_recurrent_gla", "fla.ops.gla:fused_recurrent_gla", reference.fused_recurrent_gla, _validate_recurrent
    ),
    fused_recurrent_gla,
)
RECURRENT.library = EntryOps(
    RECURRENT,
    "gla_recurrent",
    "Tensor q, Tensor k, Tensor v, Tensor? gk=None, Tensor? gv=None, float? scale=None, "
    "Tensor? initial_state=None, bool output_final_state=False, bool reverse=False, bool state_v_first=False, "
    "Tensor? cu_seqlens=None",
)


def _recurrent_gates(args: dict[str, Any]):
    """A fused-recurrent GLA call's gates for the token-by-token kernel: per-key gk and per-value gv, no delta rule."""
    from cula.recurrent.plan import Gates

    return Gates(gk=args["gk"], gv=args["gv"])


for _major in (9, 10):
    RECURRENT.register_kernel(recurrent_kernel("gla.fused_recurrent", _recurrent_gates, _major))


def _gate(args: dict[str, Any]) -> tuple:
    """A GLA call's gate arguments for its chunk kernel: the per-key g as given."""
    return (args["g"],)


def _kernel_entry(arch: str):
    """``(supports, run)`` of the chunk kernel in ``cula.gla.chunk_fwd_<arch>``."""
    return chunk_kernel_entry(f"cula.gla.chunk_fwd_{arch}", f"chunk_gla_fwd_{arch}", _gate, _gate)


_sm90_supports, _sm90_run = _kernel_entry("sm90")
_sm100_supports, _sm100_run = _kernel_entry("sm100")


def _backward(args: dict[str, Any], grad_o, grad_final_state, walks_of) -> dict[str, torch.Tensor]:
    """Gradients of every floating tensor argument present (:mod:`cula.gla.chunk_bwd_sm90`), the state walks by the
    chunk kernel ``walks_of``."""
    from cula.gla.chunk_bwd_sm90 import chunk_gla_bwd_sm90

    dq, dk, dv, dg, dh0 = chunk_gla_bwd_sm90(
        args["q"], args["k"], args["v"], args["g"], grad_o, args["scale"], args["initial_state"], grad_final_state,
        args["cu_seqlens"], args.get("cu_seqlens_cpu"), args.get("state_v_first", False), walks_of,
    )  # fmt: skip
    grads = {"q": dq, "k": dk, "v": dv, "g": dg.to(args["g"].dtype)}
    if args["initial_state"] is not None:
        grads["initial_state"] = dh0
    return grads


def _sm90_backward(args: dict[str, Any], residuals: list, grad_o, grad_final_state) -> dict[str, torch.Tensor]:
    from cula.gla.chunk_fwd_sm90 import GLA_SM90

    return _backward(args, grad_o, grad_final_state, GLA_SM90)


def _sm100_backward(args: dict[str, Any], residuals: list, grad_o, grad_final_state) -> dict[str, torch.Tensor]:
    from cula.gla.chunk_fwd_sm100 import GLA_SM100

    return _backward(args, grad_o, grad_final_state, GLA_SM100)


# the kernel's state walks, then the per-chunk gradient kernel; its GPU tests passed on an H100
# (tests/test_gla_sm90_backward.py), and its forward + backward beat FLA's side by side (3.30 against 6.94 ms at
# B1 T8192 H64 on an H100, PERF.md): it serves GLA's training calls
SM90_BACKWARD = BackwardKernel(recomputing(_sm90_run), lambda args: [], _sm90_backward)
CHUNK.register_kernel(CuteKernel("gla.chunk_fwd_sm90", 9, _sm90_supports, _sm90_run, backward=SM90_BACKWARD))
# the SM100 kernel's state walks in chunks of 128, then the per-chunk gradients in PyTorch; compiled for sm_100a /
# sm_103a only, like the forward: no Blackwell GPU has run either
SM100_BACKWARD = BackwardKernel(
    recomputing(_sm100_run), lambda args: [], _sm100_backward, hardware_tested=False, beats_fla=False
)
CHUNK.register_kernel(
    CuteKernel("gla.chunk_fwd_sm100", 10, _sm100_supports, _sm100_run, backward=SM100_BACKWARD, hardware_tested=False)
)
