"""The SM100 simple GLA kernel's launch (cula.sm100.scalar_chunk_fwd) in PyTorch, written from the kernel role by
role, so that the host path around it (cula.sm90.entry, cula.sm90.walks) runs on a CPU: it stands in for
``entry.launch``. Per (sequence, value head), chunks of 128 (from the last in the state-gradient walk):

- gate warp: G = cumsum(max(g, floor)) log2(e), nothing added past the sequence end; factors s 2^G and 2^(G_last - G)
  (zero past the end);
- scores: P~ = s (Q K^T)_ij 2^(G_i - G_j) where j <= i and j is in the sequence, else 0; Q~ = bf16(s 2^G q); K~ =
  bf16(2^(G_last - G) k) (a walk: only the key tile, scaled by 2^(G_last - G), or s 2^G walking backwards), zero past
  the end, as v in a varlen call;
- state: S^T's bf16 copy (the operand of Q~ S, or a walk's checkpoint), then S^T <- 2^G_last S^T + V^T K~;
- output: O = Q~ S + P~ V rounded to bf16 where the token is in the sequence.
"""

import math

import torch

from cula.ops.chunk_emulation import GATE_FLOOR, bf16

LOG2E = math.log2(math.e)


def sm100_launch(kernel, call, config, t, scale):
    """One launch of the SM100 kernel on ``t`` (:class:`cula.sm90.entry.LaunchTensors`): writes o (the forward),
    the walks' checkpoints ``t.w``, and the final states ``t.ht`` (a state pool's rows with ``config.state_slots``)."""
    C = kernel.chunk
    B, T, H, D = t.q.shape
    HV = t.v.shape[2]
    N = B if t.starts is None else t.starts.numel()
    ht, h0 = t.ht, t.h0
    if call.state_v_first:
        # the kernel takes (K, V)-indexed views of V-first storage
        ht = ht.transpose(-1, -2)
        h0 = None if h0 is None else h0.transpose(-1, -2)
    for n in range(N):
        b, tok0, seqlen = (0, int(t.starts[n]), int(t.ends[n] - t.starts[n])) if config.is_varlen else (n, 0, T)
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
                gate = torch.where(inside, t.g[b, tokens, hv].float().clamp_min(GATE_FLOOR), 0.0)
                G = torch.cumsum(gate, 0) * LOG2E
                to_end = torch.where(inside, torch.exp2(G[-1] - G), 0.0)
                q = t.q[b, tokens, h].float()
                k = t.k[b, tokens, h].float()
                key_factor = scale * torch.exp2(G) if config.reverse else to_end
                K_op = torch.where(inside[:, None], bf16(k * key_factor[:, None]), 0.0)
                V_op = torch.where(inside[:, None], t.v[b, tokens, hv].float(), 0.0)
                S_op = bf16(ST.T)  # S (K x V), as the bf16 tile S^T holds it
                if config.walk != "output":
                    t.w[first + pos, hv] = ST.to(t.w.dtype)
                else:
                    keep = (place[None, :] <= place[:, None]) & inside[None, :]
                    decay = torch.exp2(torch.where(keep, G[:, None] - G[None, :], 0.0))
                    P = bf16(torch.where(keep, scale * (q @ k.T) * decay, 0.0))
                    Q_op = bf16(q * (scale * torch.exp2(G))[:, None])
                    o = Q_op @ S_op + P @ V_op
                    rows = tokens[inside]
                    t.o[b, rows, hv] = o[inside].to(t.o.dtype)
                ST = ST * torch.exp2(G[-1]) + V_op.T @ K_op
            ht[ht_row, hv] = ST.T
