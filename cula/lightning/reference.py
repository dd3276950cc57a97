"""PyTorch reference backend for simple GLA and Lightning Attention with FLA 0.6.0's signatures; fp32 math.

``fla.ops.simple_gla`` / ``fla.ops.lightning_attn``: ``o`` comes back in ``q.dtype``, the final state in fp32
(fp64 for fp64 inputs). Lightning is simple GLA with ``g_gamma`` from ``layer_idx`` / ``num_layers``. Inputs are
assumed valid (the public API validates them).
"""

import torch

from cula.ops.gla_ref import lightning_g_gamma, simple_gla_ref


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
    o, ht = simple_gla_ref(
        q, k, v, g=g, g_gamma=g_gamma, scale=scale, initial_state=initial_state,
        output_final_state=output_final_state, state_v_first=state_v_first, cu_seqlens=cu_seqlens,
    )  # fmt: skip
    return o.to(q.dtype), ht


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
    state_v_first = state_v_first or kwargs.get("transpose_state_layout", False)
    o, ht = simple_gla_ref(
        q, k, v, g=g, g_gamma=g_gamma, scale=scale, initial_state=initial_state,
        output_final_state=output_final_state, reverse=reverse, state_v_first=state_v_first, cu_seqlens=cu_seqlens,
    )  # fmt: skip
    return o.to(q.dtype), ht


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
    g_gamma = lightning_g_gamma(q.shape[2], layer_idx, num_layers, device=q.device)
    return chunk_simple_gla(
        q, k, v, g_gamma=g_gamma, scale=scale, initial_state=initial_state,
        output_final_state=output_final_state, cu_seqlens=cu_seqlens,
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
) -> tuple[torch.Tensor, torch.Tensor]:
    g_gamma = lightning_g_gamma(q.shape[2], layer_idx, num_layers, device=q.device)
    return fused_recurrent_simple_gla(
        q, k, v, g_gamma=g_gamma, scale=scale, initial_state=initial_state,
        output_final_state=output_final_state, reverse=reverse, cu_seqlens=cu_seqlens,
    )  # fmt: skip
