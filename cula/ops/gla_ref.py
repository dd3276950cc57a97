"""Chunked fp32 reference for GLA, simple GLA and Lightning (gated linear attention without the delta rule).

``S_t = diag(exp(gk_t)) S_{t-1} diag(exp(gv_t)) + k_t v_t^T``, ``o_t = S_t^T (scale * q_t)``; a scalar gate ``g``
and a constant per-head decay ``g_gamma`` add up to one scalar log-gate. The math lives in
``cula.ops.delta_rule_ref.linear_attn_ref`` (called with no ``beta``).
"""

import torch

from cula.ops.delta_rule_ref import linear_attn_ref
from cula.ops.gates import to_compute


def lightning_g_gamma(num_heads: int, layer_idx: int, num_layers: int, device=None) -> torch.Tensor:
    """Lightning Attention's per-head log decay, exactly as ``fla.ops.lightning_attn`` builds it (fp32 [H])."""
    return -(8 / num_heads * (1 - layer_idx / num_layers)) * torch.arange(num_heads, dtype=torch.float, device=device)


def gla_ref(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    gk: torch.Tensor | None = None,
    gv: torch.Tensor | None = None,
    scale: float | None = None,
    initial_state: torch.Tensor | None = None,
    output_final_state: bool = False,
    reverse: bool = False,
    state_v_first: bool = False,
    cu_seqlens: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """GLA with a per-key gate ``gk`` [B, T, H, K] and/or a per-value gate ``gv`` [B, T, H, V]; o in compute dtype."""
    return linear_attn_ref(
        q, k, v, g=gk, gv=gv, scale=scale, initial_state=initial_state, output_final_state=output_final_state,
        state_v_first=state_v_first, cu_seqlens=cu_seqlens, reverse=reverse,
    )  # fmt: skip


def simple_gla_ref(
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
    cu_seqlens: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Simple GLA: scalar log gate ``g`` [B, T, H] plus the constant per-head ``g_gamma`` [H]; o in compute dtype."""
    if g_gamma is not None:
        gamma = to_compute(g_gamma).expand(*v.shape[:3])
        g = gamma if g is None else to_compute(g) + gamma
    return linear_attn_ref(
        q, k, v, g=g, scale=scale, initial_state=initial_state, output_final_state=output_final_state,
        state_v_first=state_v_first, cu_seqlens=cu_seqlens, reverse=reverse,
    )  # fmt: skip
