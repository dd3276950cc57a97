"""PyTorch reference backend for GLA with FLA 0.6.0's signatures (``fla.ops.gla``); fp32 math.

Inputs are assumed valid (the public API validates them). Output dtypes follow FLA: ``chunk_gla`` returns ``o`` in
``v.dtype``, ``fused_recurrent_gla`` in ``q.dtype``; the final state is fp32 (fp64 for fp64 inputs).
"""

import torch

from cula.ops.gla_ref import gla_ref


def chunk_gla(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    scale: int | None = None,
    initial_state: torch.Tensor = None,
    output_final_state: bool = False,
    state_v_first: bool = False,
    cu_seqlens: torch.LongTensor | None = None,
    cu_seqlens_cpu: torch.LongTensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    o, ht = gla_ref(
        q, k, v, gk=g, scale=scale, initial_state=initial_state, output_final_state=output_final_state,
        state_v_first=state_v_first, cu_seqlens=cu_seqlens,
    )  # fmt: skip
    return o.to(v.dtype), ht


def fused_recurrent_gla(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    gk: torch.Tensor | None = None,
    gv: torch.Tensor | None = None,
    scale: int | None = None,
    initial_state: torch.Tensor | None = None,
    output_final_state: bool = False,
    reverse: bool = False,
    state_v_first: bool = False,
    cu_seqlens: torch.LongTensor | None = None,
    **kwargs,
) -> tuple[torch.Tensor, torch.Tensor]:
    state_v_first = state_v_first or kwargs.get("transpose_state_layout", False)
    o, ht = gla_ref(
        q, k, v, gk=gk, gv=gv, scale=scale, initial_state=initial_state, output_final_state=output_final_state,
        reverse=reverse, state_v_first=state_v_first, cu_seqlens=cu_seqlens,
    )  # fmt: skip
    return o.to(q.dtype), ht
