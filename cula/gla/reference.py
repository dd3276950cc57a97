"""PyTorch reference backend for GLA (``fla.ops.gla`` semantics), fp32 chunked math.

Each function takes the entry point's bound arguments (a dict, already validated). ``chunk_gla`` returns ``o`` in
``v.dtype``, ``fused_recurrent_gla`` in ``q.dtype``; the final state is fp32 (fp64 for fp64 inputs) or None.
"""

import torch

from cula.ops.delta_rule_ref import linear_attn_call


def chunk_gla(args: dict) -> tuple[torch.Tensor, torch.Tensor | None]:
    o, ht = linear_attn_call(args, args["q"], args["k"], g=args["g"])
    return o.to(args["v"].dtype), ht


def fused_recurrent_gla(args: dict) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Per-key ``gk`` [B, T, H, K] and per-value ``gv`` [B, T, H, V] log gates, both optional."""
    o, ht = linear_attn_call(
        args, args["q"], args["k"], g=args["gk"], gv=args["gv"], recurrent=True, reverse=args["reverse"]
    )
    return o.to(args["q"].dtype), ht
