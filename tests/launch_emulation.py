"""Chunk kernels' launches in PyTorch, written from the kernels role by role, so that the host paths around them
(cula.sm90.entry, cula.sm90.walks) run on a CPU: each stands in for ``entry.launch``. Per (sequence, value head),
chunks of the kernel's C (from the last in the state-gradient walk), G the chunk's inclusive cumsum of
max(g, floor) in log2 units (nothing added past the sequence end), per token or per token and key:

- the backward's state walks of a kernel without the delta rule (SM90's GLA kernel, the SM100 simple GLA kernel):
  the key tile scaled by 2^(G_last - G), or by scale 2^G walking backwards, zero past the end, as the value tile in a
  varlen call; S^T's bf16 checkpoint stored before each chunk's update S^T <- S^T 2^G_last + V^T K~ (the decay per
  key column);
- the SM100 simple GLA kernel's forward (cula.sm100.scalar_chunk_fwd): P~ = s (Q K^T)_ij 2^(G_i - G_j) where j <= i
  and j is in the sequence, else 0; Q~ = bf16(s 2^G q); O = Q~ S + P~ V, rounded to bf16 where the token is in the
  sequence.
"""

import math

import torch

from cula.ops.chunk_emulation import bf16
from cula.ops.gates import GATE_FLOOR

LOG2E = math.log2(math.e)


def _sequences(config, t):
    """Each launch row's ``(n, batch row, first token, length)``."""
    B, T = t.q.shape[:2]
    N = B if t.starts is None else t.starts.numel()
    for n in range(N):
        b, tok0, seqlen = (0, int(t.starts[n]), int(t.ends[n] - t.starts[n])) if config.is_varlen else (n, 0, T)
        yield n, b, tok0, seqlen


def _chunk_gates(t, b, tokens, inside, hv):
    """G [C, K] (log2, flat past the sequence end) of one chunk: a scalar gate broadcast over the keys."""
    g = t.g[b, tokens, hv].float()
    if g.dim() == 1:
        g = g[:, None].expand(-1, t.q.shape[3])
    return torch.cumsum(torch.where(inside[:, None], g.clamp_min(GATE_FLOOR), 0.0), 0) * LOG2E


def launch(kernel, call, config, t, scale):
    """One launch: writes o (the forward: SM100 simple GLA only), the walks' checkpoints ``t.w`` and the final
    states ``t.ht`` (a state pool's rows with ``config.state_slots``)."""
    C = kernel.chunk
    T, H, D = t.q.shape[1], t.q.shape[2], t.q.shape[3]
    HV = t.v.shape[2]
    ht, h0 = t.ht, t.h0
    if call.state_v_first:
        # the kernels take (K, V)-indexed views of V-first storage
        ht = ht.transpose(-1, -2)
        h0 = None if h0 is None else h0.transpose(-1, -2)
    for n, b, tok0, seqlen in _sequences(config, t):
        n_chunks = -(-seqlen // C)
        first = tok0 // C + n if config.is_varlen else n * n_chunks
        h0_row = int(t.slots[n]) if config.state_slots != "none" else n
        ht_row = h0_row if config.state_slots == "read_write" else n
        for hv in range(HV):
            h = hv // (HV // H)
            ST = h0[h0_row, hv].float().T.clone() if config.has_initial_state else torch.zeros(D, D)
            for chunk in range(n_chunks):
                pos = n_chunks - 1 - chunk if config.reverse else chunk
                place = torch.arange(C)
                inside = place < seqlen - pos * C
                tokens = (tok0 + pos * C + place).clamp(max=T - 1)
                G = _chunk_gates(t, b, tokens, inside, hv)  # [C, K]
                to_end = torch.where(inside[:, None], torch.exp2(G[-1] - G), 0.0)
                q, k = t.q[b, tokens, h].float(), t.k[b, tokens, h].float()
                key_factor = scale * torch.exp2(G) if config.reverse else to_end
                K_op = torch.where(inside[:, None], bf16(k * key_factor), 0.0)
                V_op = torch.where(inside[:, None], t.v[b, tokens, hv].float(), 0.0)
                if config.walk != "output":
                    t.w[first + pos, hv] = ST.to(t.w.dtype)
                else:
                    assert t.g.dim() == 3, "the forward emulated here is the scalar gate's"
                    G1 = G[:, 0]
                    keep = (place[None, :] <= place[:, None]) & inside[None, :]
                    decay = torch.exp2(torch.where(keep, G1[:, None] - G1[None, :], 0.0))
                    P = bf16(torch.where(keep, scale * (q @ k.T) * decay, 0.0))
                    Q_op = bf16(q * (scale * torch.exp2(G1))[:, None])
                    o = Q_op @ bf16(ST.T) + P @ V_op
                    t.o[b, tokens[inside], hv] = o[inside].to(t.o.dtype)
                ST = ST * torch.exp2(G[-1])[None, :] + V_op.T @ K_op
            ht[ht_row, hv] = ST.T
