"""GLA backward on SM90, the plan of :mod:`cula.ops.chunk_backward` with a per-key gate:

1. the state at each chunk's start, and 2. the gradient of the state at each chunk's end: GLA's chunk kernel
   (:class:`cula.gla.chunk_fwd_sm90.GLAChunkFwdSm90`) walking the chunks without output (:func:`cula.sm90.walks.
   state_walk`: "states" on (k, v) with K 2^(G_last - G) in the update, "state_grads" from the last chunk on (q, dO)
   with scale Q 2^G), each storing a bf16 checkpoint per chunk; the second walk's final state is dh0;
3. and 4. dq, dk, dv and the gate's gradient per chunk, from the checkpoints: batched PyTorch products over the chunk
   rows (:func:`cula.ops.chunk_backward.rows_backward`, the per-key products by 16-token blocks).

Shapes: q, k, v, do [B, T, H, D] bf16; g [B, T, H, D] per-key natural-log gate; states [N, H, K, V] fp32 ([N, H, V,
K] with ``state_v_first``). One value head per q / k head.
"""

from __future__ import annotations

import torch

from cula.gla.chunk_fwd_sm90 import GLA_SM90
from cula.sm90 import walks


def chunk_gla_bwd_sm90(q, k, v, g, do, scale, initial_state, dht, cu_seqlens, cu_seqlens_cpu, state_v_first):
    """Gradients of GLA's chunked forward: ``(dq, dk, dv, dg fp32 [B, T, H, D], dh0 or None)``; ``dht`` the
    gradient into the final state, or None."""
    gate = g.float().contiguous()
    # beta's slot: an unread [B, T, H] tensor, as the forward passes
    unread_beta = torch.empty(v.shape[:3], dtype=torch.float32, device=v.device)
    dq, dk, dv, dg, _, dh0 = walks.walk_backward(
        GLA_SM90, q, k, v, do, gate, unread_beta, scale, initial_state, dht, cu_seqlens, cu_seqlens_cpu, state_v_first
    )
    return dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype), dg, dh0
