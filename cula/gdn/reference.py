"""PyTorch reference backend for Gated DeltaNet (``fla.ops.gated_delta_rule`` semantics), fp32 chunked math.

Each function takes the entry point's bound arguments (a dict, already validated) and returns what FLA returns:
``chunk_gated_delta_rule`` gives ``o`` in ``q.dtype``, ``fused_recurrent_gated_delta_rule`` in ``v.dtype``; the
final state is fp32 (fp64 for fp64 inputs) or None.
"""

import torch

from cula.ops.delta_rule_ref import linear_attn_call
from cula.ops.gates import gdn_gate, qk_beta_transforms, to_compute


def _gated_delta_rule(args: dict, gk=None, gv=None, recurrent=False) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Scalar ``g`` [B, T, HV], per-key ``gk`` [B, T, HV, K] and per-value ``gv`` [B, T, HV, V] gates compose;
    ``beta`` is [B, T, HV] or [B, T, HV, V] (None means ones)."""
    v, g, beta = args["v"], args["g"], args["beta"]
    if beta is None:
        beta = v.new_ones(v.shape[:3])
    q, k, beta = qk_beta_transforms(args, beta)
    if g is not None and args.get("use_gate_in_kernel", False):
        g = gdn_gate(g, args.get("A_log"), args.get("dt_bias"))
    if gk is not None:
        g = to_compute(gk) if g is None else to_compute(gk) + to_compute(g).unsqueeze(-1)
    return linear_attn_call(args, q, k, g=g, gv=gv, beta=beta, recurrent=recurrent)


def chunk_gated_delta_rule(args: dict) -> tuple[torch.Tensor, torch.Tensor | None]:
    o, ht = _gated_delta_rule(args)
    return o.to(args["q"].dtype), ht


def fused_recurrent_gated_delta_rule(args: dict) -> tuple[torch.Tensor, torch.Tensor | None]:
    o, ht = _gated_delta_rule(args, args["gk"], args["gv"], recurrent=True)
    return o.to(args["v"].dtype), ht
