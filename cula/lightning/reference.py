"""PyTorch reference backend for simple GLA and Lightning Attention (``fla.ops.simple_gla``,
``fla.ops.lightning_attn`` semantics), fp32 chunked math.

Each function takes the entry point's bound arguments (a dict, already validated) and returns ``o`` in ``q.dtype``
and the final state in fp32 (fp64 for fp64 inputs) or None. The chunked and the fused-recurrent entry points share
one function: ``reverse`` is read from the arguments where the entry point has it.
"""

import torch

from cula.ops.delta_rule_ref import linear_attn_call
from cula.ops.gates import to_compute


def lightning_g_gamma(num_heads: int, layer_idx: int, num_layers: int, device=None) -> torch.Tensor:
    """Lightning Attention's per-head log decay, exactly as ``fla.ops.lightning_attn`` builds it (fp32 [H])."""
    return -(8 / num_heads * (1 - layer_idx / num_layers)) * torch.arange(num_heads, dtype=torch.float, device=device)


def _simple_gla(args: dict, g, g_gamma) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Scalar log gate ``g`` [B, T, H] plus the constant per-head ``g_gamma`` [H] (either may be None)."""
    if g_gamma is not None:
        gamma = to_compute(g_gamma).expand(*args["v"].shape[:3])
        g = gamma if g is None else to_compute(g) + gamma
    o, ht = linear_attn_call(args, args["q"], args["k"], g=g)
    return o.to(args["q"].dtype), ht


def simple_gla(args: dict) -> tuple[torch.Tensor, torch.Tensor | None]:
    """``chunk_simple_gla`` and ``fused_recurrent_simple_gla``."""
    return _simple_gla(args, args["g"], args["g_gamma"])


def lightning_attn(args: dict) -> tuple[torch.Tensor, torch.Tensor | None]:
    """``chunk_lightning_attn`` and ``fused_recurrent_lightning_attn``."""
    q = args["q"]
    return _simple_gla(args, None, lightning_g_gamma(q.shape[2], args["layer_idx"], args["num_layers"], q.device))
