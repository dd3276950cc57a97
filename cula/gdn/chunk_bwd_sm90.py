"""GDN backward on SM90 (opt-in: its GPU tests have not run), the delta rule's plan of :mod:`cula.ops.chunk_backward`:

1. the state at each chunk's start and 2. the gradient of the state at each chunk's end: the GDN kernel's two walks
   (:func:`cula.sm90.walks.state_walk`: "states", and "state_grads" through the transposed chain), each storing a
   bf16 checkpoint per chunk; the second walk's final state is dh0;
3. and 4. each chunk's gradients from its tokens and the two checkpoints, the WY form recomputed: batched PyTorch
   products over the chunk rows (:func:`cula.ops.chunk_backward.scalar_delta_rows`) until a kernel makes them.

The in-kernel options (q / k L2 norm, the gate from A_log and dt_bias, beta's sigmoid) are applied before the walks
and differentiated through by autograd after them. Shapes: q, k [B, T, H, K]; v, do [B, T, HV, V] bf16; g, beta
[B, T, HV] fp32 (activated); states [N, HV, K, V] fp32 ([N, HV, V, K] with ``state_v_first``).
"""

from __future__ import annotations

import torch

from cula import validation
from cula.ops import chunk_backward
from cula.ops.chunk_emulation import GATE_FLOOR


def rows_backward(q, k, v, do, g, beta, starts, ends, index, scale):
    """Passes 3 and 4 over the chunk rows ``index`` ([rows, C] flattened tokens, :func:`chunk_token_index`) with
    the walks' checkpoints ``starts`` / ``ends`` [rows, HV, V, K]: ``(dq, dk [B, T, H, K] summed over each GVA
    group, dv [B, T, HV, V], dg, dbeta [B, T, HV])`` in fp32."""
    B, T, H, K = q.shape
    HV, V = v.shape[2], v.shape[3]
    rep, n_tokens, C = HV // H, B * T, index.shape[1]
    R = index.shape[0]

    def by_row(x):
        """[B, T, heads, ...] -> [R x heads, C, ...] fp32, zero past every sequence's end."""
        flat = x.reshape(n_tokens, *x.shape[2:]).float()
        rows = torch.cat([flat, flat.new_zeros(1, *flat.shape[1:])])[index]
        return rows.movedim(2, 1).reshape(R * rows.shape[2], C, *rows.shape[3:])

    def by_token(x, heads):
        """The inverse of :func:`by_row` for ``heads`` heads."""
        rows = x.reshape(R, heads, C, *x.shape[2:]).movedim(1, 2)
        out = rows.new_zeros(n_tokens, *rows.shape[2:])
        valid = index < n_tokens
        out[index[valid]] = rows[valid]
        return out.view(B, T, *rows.shape[2:])

    qr, kr = (by_row(x.repeat_interleave(rep, dim=2)) for x in (q, k))
    S, dS = (x[:R].float().transpose(-1, -2).reshape(R * HV, K, V) for x in (starts, ends))
    dq, dk, dv, dbeta, dg = chunk_backward.scalar_delta_rows(
        qr, kr, by_row(v), by_row(beta), by_row(g.clamp_min(GATE_FLOOR)), S, dS, by_row(do), scale
    )
    dq, dk = (by_token(x, HV).view(B, T, H, rep, K).sum(3) for x in (dq, dk))
    return dq, dk, by_token(dv, HV), by_token(dg, HV), by_token(dbeta, HV)


def chunk_gdn_bwd_sm90(q, k, v, g, beta, do, scale, initial_state, dht, cu_seqlens, cu_seqlens_cpu, state_v_first):
    """Gradients of GDN's chunked forward with activated fp32 ``g`` and ``beta`` (q and k as the kernel reads them:
    normalised already where the call asks): ``(dq, dk, dv, dg, dbeta, dh0 or None)``."""
    from cula.gdn.chunk_fwd_sm90 import GDN_SM90
    from cula.sm90 import walks

    B, T, H, K = q.shape
    scale = K**-0.5 if scale is None else scale
    fixed = cu_seqlens is None
    offsets = [b * T for b in range(B + 1)] if fixed else validation.host_offsets(cu_seqlens, cu_seqlens_cpu)
    index, rows = chunk_backward.chunk_token_index(offsets, fixed, q.device)
    q, k, v, do = (x.contiguous() for x in (q, k, v, do))
    g, beta = g.float().contiguous(), beta.float().contiguous()
    at = {"cu_seqlens": cu_seqlens, "rows": rows, "state_v_first": state_v_first}
    S, _ = walks.state_walk(GDN_SM90, "states", q, k, v, g, beta, scale, initial_state, **at)
    dS, dh0 = walks.state_walk(GDN_SM90, "state_grads", q, k, do, g, beta, scale, dht, **at)
    grads = rows_backward(q, k, v, do, g, beta, S, dS, index, scale)
    dq, dk, dv, dg, dbeta = grads
    dg = torch.where(g < GATE_FLOOR, 0.0, dg)
    return dq, dk, dv, dg, dbeta, (dh0 if initial_state is not None else None)
