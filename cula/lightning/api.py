"""Lightning Attention and simple GLA entry points, with FLA 0.6.0's signatures
(`fla.ops.lightning_attn`, `fla.ops.simple_gla`). Lightning is simple GLA with a per-head constant decay."""

from __future__ import annotations

from typing import Any

import torch

from cula import runtime, validation
from cula.custom_ops import EntryOps
from cula.dispatch import (
    BackwardKernel,
    CuteKernel,
    Op,
    bind,
    call_args,
    chunk_kernel_entry,
    fla_gated_backward_ok,
    recomputing,
)
from cula.lightning import reference
from cula.recurrent.plan import recurrent_kernel


def _validate_chunk_simple_gla(args: dict[str, Any]) -> None:
    validation.head_first(args, refused_in_any_form=True)
    validation.chunk_size(args, None, "simple GLA")
    _validate_simple_gla(args, token_slots=False)


def _validate_simple_gla(args: dict[str, Any], token_slots: bool = True) -> None:
    validation.head_first(args, refused_in_any_form=False)
    B, T, H, HV, K, V, N = validation.common(args, allow_gva=False, token_slots=token_slots)
    validation.per_head("g", args["g"], B, T, H, optional=True)
    validation.tensor("g_gamma", args["g_gamma"], 1, optional=True)
    validation.shape("g_gamma", args["g_gamma"], (H,), "[H]")


def _validate_chunk_lightning(args: dict[str, Any]) -> None:
    validation.head_first(args, refused_in_any_form=True)
    validation.chunk_size(args, None, "Lightning Attention")
    _validate_lightning(args, token_slots=False)


def _validate_lightning(args: dict[str, Any], token_slots: bool = True) -> None:
    validation.common(args, allow_gva=False, token_slots=token_slots)
    layer_idx, num_layers = args["layer_idx"], args["num_layers"]
    for name, value in (("layer_idx", layer_idx), ("num_layers", num_layers)):
        if isinstance(value, bool) or not isinstance(value, int):
            raise TypeError(f"`{name}` must be an int, got {type(value).__name__}")
    if num_layers < 1 or not 0 <= layer_idx < num_layers:
        raise ValueError(f"need 0 <= `layer_idx` < `num_layers`, got layer_idx={layer_idx}, num_layers={num_layers}")


def chunk_simple_gla(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor | None = None,
    g_gamma: torch.Tensor | None = None,
    scale: float | None = None,
    initial_state: torch.Tensor | None = None,
    output_final_state: bool = False,
    state_v_first: bool = False,
    cu_seqlens: torch.LongTensor | None = None,
    cu_seqlens_cpu: torch.LongTensor | None = None,
    **kwargs,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Chunked simple GLA. q, k: [B, T, H, K]; v: [B, T, H, V]; g: [B, T, H] log gate; g_gamma: [H] constant.
    ``ssm_state_indices`` [N] / ``inplace_final_state`` keywords: a state pool (`cula.ops.state_pool`)."""
    return CHUNK_SIMPLE_GLA.call(
        call_args(
            dict(
                q=q, k=k, v=v, g=g, g_gamma=g_gamma, scale=scale, initial_state=initial_state,
                output_final_state=output_final_state, state_v_first=state_v_first, cu_seqlens=cu_seqlens,
                cu_seqlens_cpu=cu_seqlens_cpu
            ), kwargs
        )
    )  # fmt: skip


def fused_recurrent_simple_gla(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor | None = None,
    g_gamma: torch.Tensor | None = None,
    scale: float | None = None,
    initial_state: torch.Tensor | None = None,
    output_final_state: bool = False,
    reverse: bool = False,
    state_v_first: bool = False,
    cu_seqlens: torch.LongTensor | None = None,
    **kwargs,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Token-by-token simple GLA; shapes as `chunk_simple_gla`. State pools as `cula.kda.fused_recurrent_kda` takes
    them (`cula.ops.state_pool`)."""
    return RECURRENT_SIMPLE_GLA.call(
        call_args(
            dict(
                q=q, k=k, v=v, g=g, g_gamma=g_gamma, scale=scale, initial_state=initial_state,
                output_final_state=output_final_state, reverse=reverse, state_v_first=state_v_first, cu_seqlens=cu_seqlens
            ), kwargs
        )
    )  # fmt: skip


def chunk_lightning_attn(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    layer_idx: int,
    num_layers: int,
    scale: float | None = None,
    initial_state: torch.Tensor | None = None,
    output_final_state: bool = False,
    cu_seqlens: torch.LongTensor | None = None,
    **kwargs,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Chunked Lightning Attention. q, k: [B, T, H, K]; v: [B, T, H, V]; the decay of head h is
    ``-(8 / H) * (1 - layer_idx / num_layers) * h``. ``ssm_state_indices`` [N] / ``inplace_final_state`` keywords: a
    state pool (`cula.ops.state_pool`)."""
    return CHUNK_LIGHTNING.call(
        call_args(
            dict(
                q=q, k=k, v=v, layer_idx=layer_idx, num_layers=num_layers, scale=scale, initial_state=initial_state,
                output_final_state=output_final_state, cu_seqlens=cu_seqlens
            ), kwargs
        )
    )  # fmt: skip


def fused_recurrent_lightning_attn(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    layer_idx: int,
    num_layers: int,
    scale: float | None = None,
    initial_state: torch.Tensor | None = None,
    output_final_state: bool = False,
    reverse: bool = False,
    cu_seqlens: torch.LongTensor | None = None,
    *,
    ssm_state_indices: torch.Tensor | None = None,
    num_accepted_tokens: torch.Tensor | None = None,
    inplace_final_state: bool | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Token-by-token Lightning Attention; shapes as `chunk_lightning_attn`. State pools as
    `cula.kda.fused_recurrent_kda` takes them (`cula.ops.state_pool`): FLA's op has no ``**kwargs``, through which
    the other entry points take them, so they are keyword-only parameters here."""
    return RECURRENT_LIGHTNING.call(
        call_args(
            dict(
                q=q, k=k, v=v, layer_idx=layer_idx, num_layers=num_layers, scale=scale, initial_state=initial_state,
                output_final_state=output_final_state, reverse=reverse, cu_seqlens=cu_seqlens,
                ssm_state_indices=ssm_state_indices, num_accepted_tokens=num_accepted_tokens,
                inplace_final_state=inplace_final_state
            )
        )
    )  # fmt: skip


CHUNK_SIMPLE_GLA = bind(
    Op(
        "lightning.chunk_simple_gla",
        "fla.ops.simple_gla:chunk_simple_gla",
        reference.chunk_simple_gla,
        _validate_chunk_simple_gla,
        fla_supports=fla_gated_backward_ok,
    ),
    chunk_simple_gla,
)
CHUNK_SIMPLE_GLA.library = EntryOps(
    CHUNK_SIMPLE_GLA,
    "simple_gla_chunk",
    "Tensor q, Tensor k, Tensor v, Tensor? g=None, Tensor? g_gamma=None, float? scale=None, "
    "Tensor? initial_state=None, bool output_final_state=False, bool state_v_first=False, Tensor? cu_seqlens=None, "
    "Tensor? cu_seqlens_cpu=None",
)
RECURRENT_SIMPLE_GLA = bind(
    Op(
        "lightning.fused_recurrent_simple_gla",
        "fla.ops.simple_gla:fused_recurrent_simple_gla",
        reference.fused_recurrent_simple_gla,
        _validate_simple_gla,
    ),
    fused_recurrent_simple_gla,
)
RECURRENT_SIMPLE_GLA.library = EntryOps(
    RECURRENT_SIMPLE_GLA,
    "simple_gla_recurrent",
    "Tensor q, Tensor k, Tensor v, Tensor? g=None, Tensor? g_gamma=None, float? scale=None, "
    "Tensor? initial_state=None, bool output_final_state=False, bool reverse=False, bool state_v_first=False, "
    "Tensor? cu_seqlens=None",
)
CHUNK_LIGHTNING = bind(
    Op(
        "lightning.chunk_lightning_attn",
        "fla.ops.lightning_attn:chunk_lightning_attn",
        reference.chunk_lightning_attn,
        _validate_chunk_lightning,
    ),
    chunk_lightning_attn,
)
CHUNK_LIGHTNING.library = EntryOps(
    CHUNK_LIGHTNING,
    "lightning_chunk",
    "Tensor q, Tensor k, Tensor v, int layer_idx, int num_layers, float? scale=None, Tensor? initial_state=None, "
    "bool output_final_state=False, Tensor? cu_seqlens=None",
)
RECURRENT_LIGHTNING = bind(
    Op(
        "lightning.fused_recurrent_lightning_attn",
        "fla.ops.lightning_attn:fused_recurrent_lightning_attn",
        reference.fused_recurrent_lightning_attn,
        _validate_lightning,
    ),
    fused_recurrent_lightning_attn,
)
RECURRENT_LIGHTNING.library = EntryOps(
    RECURRENT_LIGHTNING,
    "lightning_recurrent",
    "Tensor q, Tensor k, Tensor v, int layer_idx, int num_layers, float? scale=None, "
    "Tensor? initial_state=None, bool output_final_state=False, bool reverse=False, Tensor? cu_seqlens=None",
)


def _chunk_gates(args: dict[str, Any]) -> tuple[torch.Tensor | None, torch.Tensor | None]:
    """(g, g_gamma) of a simple GLA or Lightning call; Lightning's g_gamma as FLA builds it from the layer."""
    if "layer_idx" in args:
        q = args["q"]
        return None, _lightning_g_gamma(q.device, q.shape[2], args["layer_idx"], args["num_layers"])
    return args["g"], args["g_gamma"]


# Kept per layer (up to a deep model's layer count): made anew, it would cost each call two launches.
@runtime.device_plan_cache(maxsize=256)
def _lightning_g_gamma(device, num_heads: int, layer_idx: int, num_layers: int) -> torch.Tensor:
    """:func:`cula.lightning.reference.lightning_g_gamma` on ``device``, made on the host (the same fp32 products as
    on a GPU). Shared: callers leave it unchanged."""
    return runtime.host_to_device(reference.lightning_g_gamma(num_heads, layer_idx, num_layers), device)


def _kernel_entry(arch: str):
    """``(supports, run)`` of the chunk kernel in ``cula.lightning.chunk_fwd_<arch>``: its checks take the gates as
    given, its launch :func:`_chunk_gates`."""
    return chunk_kernel_entry(
        f"cula.lightning.chunk_fwd_{arch}",
        f"chunk_simple_gla_fwd_{arch}",
        lambda args: (args.get("g"), args.get("g_gamma")),
        _chunk_gates,
    )


_sm90_supports, _sm90_run = _kernel_entry("sm90")
_sm100_supports, _sm100_run = _kernel_entry("sm100")


def _backward(args: dict[str, Any], grad_o, grad_final_state, walks_of) -> dict[str, torch.Tensor]:
    """Gradients of every floating tensor argument present (:mod:`cula.lightning.chunk_bwd_sm90`), the state walks
    by the chunk kernel ``walks_of``."""
    from cula.lightning.chunk_bwd_sm90 import chunk_simple_gla_bwd_sm90
    from cula.lightning.chunk_fwd_sm90 import token_gate

    g, g_gamma = _chunk_gates(args)
    q, k, v = args["q"], args["k"], args["v"]
    dq, dk, dv, dgate, dh0 = chunk_simple_gla_bwd_sm90(
        q, k, v, token_gate(g, g_gamma, v), grad_o, args["scale"], args["initial_state"], grad_final_state,
        args["cu_seqlens"], args.get("cu_seqlens_cpu"), args.get("state_v_first", False), walks_of,
    )  # fmt: skip
    grads = {"q": dq, "k": dk, "v": dv}
    if args.get("g") is not None:
        grads["g"] = dgate.to(args["g"].dtype)
    if args.get("g_gamma") is not None:
        # a per-head constant added to every token's gate
        grads["g_gamma"] = dgate.sum((0, 1)).to(args["g_gamma"].dtype)
    if args["initial_state"] is not None:
        grads["initial_state"] = dh0
    return grads


def _sm90_backward(args: dict[str, Any], residuals: list, grad_o, grad_final_state) -> dict[str, torch.Tensor]:
    from cula.lightning.chunk_fwd_sm90 import SIMPLE_GLA_SM90

    return _backward(args, grad_o, grad_final_state, SIMPLE_GLA_SM90)


def _sm100_backward(args: dict[str, Any], residuals: list, grad_o, grad_final_state) -> dict[str, torch.Tensor]:
    from cula.lightning.chunk_fwd_sm100 import SIMPLE_GLA_SM100

    return _backward(args, grad_o, grad_final_state, SIMPLE_GLA_SM100)


# its GPU tests passed on an H100 (tests/test_lightning_sm90_backward.py), but with its per-chunk gradient kernel it
# is still slower than FLA's backward (0.78x, PERF.md): it serves the training calls FLA refuses (gated ones on
# Hopper with triton < 3.7.1), which would otherwise go to the reference backend
SM90_BACKWARD = BackwardKernel(recomputing(_sm90_run), lambda args: [], _sm90_backward, beats_fla=False)
# the SM100 kernel's state walks in chunks of 128, then the per-chunk gradients in PyTorch, as on SM90; compiled for
# sm_100a / sm_103a only, like the forward: no Blackwell GPU has run either
SM100_BACKWARD = BackwardKernel(
    recomputing(_sm100_run), lambda args: [], _sm100_backward, hardware_tested=False, beats_fla=False
)

for _op in (CHUNK_SIMPLE_GLA, CHUNK_LIGHTNING):
    _op.register_kernel(CuteKernel("lightning.chunk_fwd_sm90", 9, _sm90_supports, _sm90_run, backward=SM90_BACKWARD))
    _op.register_kernel(
        CuteKernel(
            "lightning.chunk_fwd_sm100", 10, _sm100_supports, _sm100_run, backward=SM100_BACKWARD, hardware_tested=False
        )
    )


def _recurrent_gates(args: dict[str, Any]):
    """A fused-recurrent simple GLA or Lightning call's gates for the token-by-token kernel: the scalar g and the
    per-head g_gamma (Lightning's from its layer), no delta rule."""
    from cula.recurrent.plan import Gates

    g, g_gamma = _chunk_gates(args)
    return Gates(g=g, g_gamma=g_gamma)


for _op in (RECURRENT_SIMPLE_GLA, RECURRENT_LIGHTNING):
    for _major in (9, 10):
        _op.register_kernel(recurrent_kernel("lightning.fused_recurrent", _recurrent_gates, _major))
