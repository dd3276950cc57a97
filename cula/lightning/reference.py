"""PyTorch reference backend for simple GLA and Lightning Attention (``fla.ops.simple_gla``,
``fla.ops.lightning_attn`` semantics), fp32 chunked math.

Each function takes the entry point's bound arguments (a dict, already validated) and returns ``o`` in ``q.dtype``
and the final state in fp32 (fp64 for fp64 inputs) or None. The fused-recurrent entry points take ``reverse``.
"""

import torch

from cula.ops.delta_rule_ref import linear_attn_call
from cula.ops.gates import to_compute


def lightning_g_gamma(num_heads: int, layer_idx: int, num_layers: int, device=None) -> torch.Tensor:
    """Lightning Attention's per-head log decay, exactly as ``fla.ops.lightning_attn`` builds it (fp32 [H])."""
    return -(8 / num_heads * (1 - layer_idx / num_layers)) * torch.arange(num_heads, dtype=torch.float, device=device)


def _simple_gla(args: dict, g, g_gamma, recurrent: bool) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Scalar log gate ``g`` [B, T, H] plus the constant per-head ``g_gamma`` [H] (either may be None)."""
    if g_gamma is not None:
        gamma = to_compute(g_gamma).expand(*args["v"].shape[:3])
        g = gamma if g is None else to_compute(g) + gamma
    reverse = recurrent and args["reverse"]
    o, ht = linear_attn_call(args, args["q"], args["k"], g=g, recurrent=recurrent, reverse=reverse)
    return o.to(args["q"].dtype), ht


def chunk_simple_gla(args: dict) -> tuple[torch.Tensor, torch.Tensor | None]:
    return _simple_gla(args, args["g"], args["g_gamma"], recurrent=False)


def fused_recurrent_simple_gla(args: dict) -> tuple[torch.Tensor, torch.Tensor | None]:
    return _simple_gla(args, args["g"], args["g_gamma"], recurrent=True)


def _lightning_attn(args: dict, recurrent: bool) -> tuple[torch.Tensor, torch.Tensor | None]:
    q = args["q"]
    gamma = lightning_g_gamma(q.shape[2], args["layer_idx"], args["num_layers"], q.device)
    return _simple_gla(args, None, gamma, recurrent)


def chunk_lightning_attn(args: dict) -> tuple[torch.Tensor, torch.Tensor | None]:
    return _lightning_attn(args, recurrent=False)


def fused_recurrent_lightning_attn(args: dict) -> tuple[torch.Tensor, torch.Tensor | None]:
    return _lightning_attn(args, recurrent=True)
