"""PyTorch reference backend for Kimi Delta Attention with FLA 0.6.0's signatures (``fla.ops.kda``).

Chunked fp32 math (``cula.ops.delta_rule_ref``). ``chunk_kda`` returns ``o`` in ``q.dtype``,
``fused_recurrent_kda`` in ``v.dtype``; the final state is fp32 (fp64 for fp64 inputs). With
``use_gate_in_kernel`` the gate is ``-exp(A_log) * softplus(g + dt_bias)``, or
``lower_bound * sigmoid(exp(A_log) * (g + dt_bias))`` whenever ``lower_bound`` is set (FLA applies the bounded
form on ``lower_bound`` alone; ``safe_gate`` only selects kernels). Inputs are assumed valid.
"""

import torch

from cula.ops.delta_rule_ref import linear_attn_ref
from cula.ops.gates import kda_gate, qk_beta_transforms


def chunk_kda(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    scale: float | None = None,
    initial_state: torch.Tensor | None = None,
    output_final_state: bool = False,
    use_qk_l2norm_in_kernel: bool = False,
    use_gate_in_kernel: bool = False,
    use_beta_sigmoid_in_kernel: bool = False,
    allow_neg_eigval: bool = False,
    safe_gate: bool = False,
    lower_bound: float | None = None,
    disable_recompute: bool = False,
    return_intermediate_states: bool = False,
    state_v_first: bool = False,
    cu_seqlens: torch.LongTensor | None = None,
    cu_seqlens_cpu: torch.LongTensor | None = None,
    cp_context=None,
    use_graph: bool = False,
    max_num_seqs: int | None = None,
    **kwargs,
):
    """``kwargs`` may carry ``A_log``, ``dt_bias`` (as in FLA) and ``chunk_size`` (ignored)."""
    if cp_context is not None:
        raise NotImplementedError("cula reference: `cp_context` (context parallelism) is not supported")
    if return_intermediate_states:
        raise NotImplementedError("cula reference: `return_intermediate_states=True` is not supported")
    o, ht = fused_recurrent_kda(
        q, k, v, g, beta, A_log=kwargs.get("A_log"), dt_bias=kwargs.get("dt_bias"), scale=scale,
        initial_state=initial_state, output_final_state=output_final_state,
        use_qk_l2norm_in_kernel=use_qk_l2norm_in_kernel, use_gate_in_kernel=use_gate_in_kernel,
        use_beta_sigmoid_in_kernel=use_beta_sigmoid_in_kernel, allow_neg_eigval=allow_neg_eigval,
        lower_bound=lower_bound, state_v_first=state_v_first or kwargs.get("transpose_state_layout", False),
        cu_seqlens=cu_seqlens,
    )  # fmt: skip
    return o.to(q.dtype), ht


def fused_recurrent_kda(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    A_log: torch.Tensor | None = None,
    dt_bias: torch.Tensor | None = None,
    scale: float | None = None,
    initial_state: torch.Tensor = None,
    output_final_state: bool = False,
    use_qk_l2norm_in_kernel: bool = False,
    use_gate_in_kernel: bool = False,
    use_beta_sigmoid_in_kernel: bool = False,
    allow_neg_eigval: bool = False,
    lower_bound: float | None = None,
    state_v_first: bool = False,
    cu_seqlens: torch.LongTensor | None = None,
    **kwargs,
) -> tuple[torch.Tensor, torch.Tensor]:
    """``beta`` is [B, T, HV] or [B, T, HV, V]."""
    q, k, beta = qk_beta_transforms(q, k, beta, use_qk_l2norm_in_kernel, use_beta_sigmoid_in_kernel, allow_neg_eigval)
    if use_gate_in_kernel:
        g = kda_gate(g, A_log, dt_bias, lower_bound)
    o, ht = linear_attn_ref(
        q, k, v, g=g, beta=beta, scale=scale, initial_state=initial_state, output_final_state=output_final_state,
        state_v_first=state_v_first or kwargs.get("transpose_state_layout", False), cu_seqlens=cu_seqlens,
    )  # fmt: skip
    return o.to(v.dtype), ht
