"""GDN backward on SM90 (opt-in: its GPU tests have not run), the delta rule's plan of :mod:`cula.ops.chunk_backward`:

1. the state at each chunk's start and 2. the gradient of the state at each chunk's end: the GDN kernel's two walks
   (:func:`cula.sm90.walks.state_walk`: "states", and "state_grads" through the transposed chain), each storing a
   bf16 checkpoint per chunk; the second walk's final state is dh0;
3. and 4. each chunk's gradients from its tokens and the two checkpoints, the WY form recomputed: batched PyTorch
   products over the chunk rows (:func:`cula.ops.chunk_backward.rows_backward`) until a kernel makes them.

The in-kernel options (q / k L2 norm, the gate from A_log and dt_bias, beta's sigmoid) are applied before the walks
and differentiated through by autograd after them. Shapes: q, k [B, T, H, K]; v, do [B, T, HV, V] bf16; g, beta
[B, T, HV] fp32 (activated); states [N, HV, K, V] fp32 ([N, HV, V, K] with ``state_v_first``).
"""

from __future__ import annotations


def chunk_gdn_bwd_sm90(q, k, v, g, beta, do, scale, initial_state, dht, cu_seqlens, cu_seqlens_cpu, state_v_first):
    """Gradients of GDN's chunked forward with activated fp32 ``g`` and ``beta`` (q and k as the kernel reads them:
    normalised already where the call asks): ``(dq, dk, dv, dg, dbeta, dh0 or None)``."""
    from cula.gdn.chunk_fwd_sm90 import GDN_SM90
    from cula.sm90 import walks

    g, beta = g.float().contiguous(), beta.float().contiguous()
    return walks.walk_backward(
        GDN_SM90, q, k, v, do, g, beta, scale, initial_state, dht, cu_seqlens, cu_seqlens_cpu, state_v_first
    )
