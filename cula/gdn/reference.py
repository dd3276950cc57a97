"""PyTorch reference backend for Gated DeltaNet with FLA 0.6.0's signatures (``fla.ops.gated_delta_rule``).

Chunked fp32 math (``cula.ops.delta_rule_ref``). ``chunk_gated_delta_rule`` returns ``o`` in ``q.dtype``,
``fused_recurrent_gated_delta_rule`` in ``v.dtype``; the final state is fp32 (fp64 for fp64 inputs). Inputs are
assumed valid (the public API validates them).
"""

import torch

from cula.ops.delta_rule_ref import linear_attn_ref
from cula.ops.gates import gdn_gate, qk_beta_transforms, to_compute


def _gated_delta_rule(q, k, v, g, gk, gv, beta, A_log, dt_bias, flags, **state_args):
    """fp32 GDN core; ``flags`` = (use_qk_l2norm, use_gate_in_kernel, use_beta_sigmoid, allow_neg_eigval)."""
    use_qk_l2norm_in_kernel, use_gate_in_kernel, use_beta_sigmoid_in_kernel, allow_neg_eigval = flags
    if beta is None:
        beta = v.new_ones(v.shape[:3])
    q, k, beta = qk_beta_transforms(q, k, beta, use_qk_l2norm_in_kernel, use_beta_sigmoid_in_kernel, allow_neg_eigval)
    if g is not None and use_gate_in_kernel:
        g = gdn_gate(g, A_log, dt_bias)
    if gk is not None:
        gk = to_compute(gk) if g is None else to_compute(gk) + to_compute(g).unsqueeze(-1)
    return linear_attn_ref(q, k, v, g=g if gk is None else gk, gv=gv, beta=beta, **state_args)


def chunk_gated_delta_rule(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    scale: float | None = None,
    initial_state: torch.Tensor | None = None,
    output_final_state: bool = False,
    use_qk_l2norm_in_kernel: bool = False,
    use_beta_sigmoid_in_kernel: bool = False,
    allow_neg_eigval: bool = False,
    state_v_first: bool = False,
    cu_seqlens: torch.LongTensor | None = None,
    cu_seqlens_cpu: torch.LongTensor | None = None,
    chunk_indices: torch.LongTensor | None = None,
    cp_context=None,
    **kwargs,
):
    """``kwargs`` may carry ``use_gate_in_kernel``, ``A_log``, ``dt_bias`` (as in FLA) and ``chunk_size`` (ignored)."""
    if cp_context is not None:
        raise NotImplementedError("cula reference: `cp_context` (context parallelism) is not supported")
    flags = (
        use_qk_l2norm_in_kernel,
        kwargs.get("use_gate_in_kernel", False),
        use_beta_sigmoid_in_kernel,
        allow_neg_eigval,
    )
    o, ht = _gated_delta_rule(
        q, k, v, g, None, None, beta, kwargs.get("A_log"), kwargs.get("dt_bias"), flags, scale=scale,
        initial_state=initial_state, output_final_state=output_final_state,
        state_v_first=state_v_first or kwargs.get("transpose_state_layout", False), cu_seqlens=cu_seqlens,
    )  # fmt: skip
    return o.to(q.dtype), ht


def fused_recurrent_gated_delta_rule(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor | None = None,
    gk: torch.Tensor | None = None,
    gv: torch.Tensor | None = None,
    beta: torch.Tensor | None = None,
    scale: float = None,
    initial_state: torch.Tensor = None,
    output_final_state: bool = False,
    use_qk_l2norm_in_kernel: bool = False,
    use_gate_in_kernel: bool = False,
    A_log: torch.Tensor | None = None,
    dt_bias: torch.Tensor | None = None,
    use_beta_sigmoid_in_kernel: bool = False,
    allow_neg_eigval: bool = False,
    state_v_first: bool = False,
    cu_seqlens: torch.LongTensor | None = None,
    **kwargs,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Scalar ``g`` [B, T, HV], per-key ``gk`` [B, T, HV, K] and per-value ``gv`` [B, T, HV, V] gates compose;
    ``beta`` is [B, T, HV] or [B, T, HV, V] (None means ones)."""
    flags = (use_qk_l2norm_in_kernel, use_gate_in_kernel, use_beta_sigmoid_in_kernel, allow_neg_eigval)
    o, ht = _gated_delta_rule(
        q, k, v, g, gk, gv, beta, A_log, dt_bias, flags, scale=scale, initial_state=initial_state,
        output_final_state=output_final_state,
        state_v_first=state_v_first or kwargs.get("transpose_state_layout", False), cu_seqlens=cu_seqlens,
    )  # fmt: skip
    return o.to(v.dtype), ht
