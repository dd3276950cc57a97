"""KDA backward on SM90, the delta rule's plan of :mod:`cula.ops.chunk_backward` with a per-key gate:

1. the state at each chunk's start and 2. the gradient of the state at each chunk's end: KDA's chunk kernel
   (:class:`cula.kda.chunk_fwd_sm90.KDAChunkFwdSm90`) walking the chunks without output
   (:func:`cula.sm90.walks.state_walk`: "states" on (k, v), "state_grads" from the last chunk on (q, k, dO) through
   the transposed chain, the per-key factors in its B tiles), each storing a bf16 checkpoint per chunk; the second
   walk's final state is dh0;
3. and 4. each chunk's gradients from its tokens and the two checkpoints, the WY form recomputed: batched PyTorch
   products over the chunk rows (:func:`cula.ops.chunk_backward.rows_backward` with the gate bounded as the forward
   kernel needs it: every pair-factor sum by two reference tokens per chunk; a per-chunk kernel, planned in
   :func:`cula.ops.chunk_emulation.key_delta_chunk_gradients`, is still to come).

Shapes: q, k [B, T, H, K]; v, do [B, T, HV, V] bf16; g [B, T, HV, K] fp32 (activated, >= -5: the forward kernel's
bound); beta [B, T, HV] fp32; states [N, HV, K, V] fp32 ([N, HV, V, K] with ``state_v_first``).
"""

from __future__ import annotations

from cula.kda.chunk_fwd_sm90 import KDA_SM90
from cula.ops import chunk_backward
from cula.sm90 import walks


def chunk_kda_bwd_sm90(q, k, v, g, beta, do, scale, initial_state, dht, cu_seqlens, cu_seqlens_cpu, state_v_first):
    """Gradients of KDA's chunked forward with activated fp32 ``g`` and ``beta`` (q and k as the kernel reads them:
    normalised already where the call asks): ``(dq, dk, dv, dg [B, T, HV, K], dbeta, dh0 or None)`` in fp32."""
    g, beta = g.float().contiguous(), beta.float().contiguous()

    def rows(q, k, v, do, w, scale):
        return chunk_backward.rows_backward(
            q, k, v, do, g, beta, w.starts, w.ends, w.index, scale, bounded_gate=True
        )  # fmt: skip

    return walks.walk_backward(
        KDA_SM90, q, k, v, do, g, beta, scale, initial_state, dht, cu_seqlens, cu_seqlens_cpu, state_v_first, rows
    )
