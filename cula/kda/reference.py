"""PyTorch reference backend for Kimi Delta Attention (``fla.ops.kda`` semantics), fp32 chunked math.

Each function takes the entry point's bound arguments (a dict, already validated). ``chunk_kda`` returns ``o`` in
``q.dtype``, ``fused_recurrent_kda`` in ``v.dtype``; the final state is fp32 (fp64 for fp64 inputs) or None. With
``use_gate_in_kernel`` the gate is ``-exp(A_log) * softplus(g + dt_bias)``, or
``lower_bound * sigmoid(exp(A_log) * (g + dt_bias))`` whenever ``lower_bound`` is set (FLA applies the bounded
form on ``lower_bound`` alone; ``safe_gate`` only selects kernels).
"""

import torch

from cula.ops.delta_rule_ref import linear_attn_call
from cula.ops.gates import kda_gate, qk_beta_transforms


def _kda(args: dict, recurrent: bool) -> tuple[torch.Tensor, torch.Tensor | None]:
    """``beta`` is [B, T, HV] or (fused_recurrent) [B, T, HV, V]."""
    q, k, beta = qk_beta_transforms(args)
    g = args["g"]
    if args["use_gate_in_kernel"]:
        g = kda_gate(g, args.get("A_log"), args.get("dt_bias"), args["lower_bound"])
    return linear_attn_call(args, q, k, g=g, beta=beta, recurrent=recurrent)


def chunk_kda(args: dict) -> tuple[torch.Tensor, torch.Tensor | None]:
    o, ht = _kda(args, recurrent=False)
    return o.to(args["q"].dtype), ht


def fused_recurrent_kda(args: dict) -> tuple[torch.Tensor, torch.Tensor | None]:
    o, ht = _kda(args, recurrent=True)
    return o.to(args["v"].dtype), ht
