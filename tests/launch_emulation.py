"""Chunk kernels' launches in PyTorch, written from the kernels role by role, so that the host paths around them
(cula.sm90.entry, cula.sm90.walks) run on a CPU: each stands in for ``entry.launch``. Per (sequence, value head),
chunks of the kernel's C (from the last in the state-gradient walk), G the chunk's inclusive cumsum of
max(g, floor) in log2 units (nothing added past the sequence end), per token or per token and key:

- the backward's state walks of a kernel without the delta rule (SM90's GLA kernel, the SM100 simple GLA kernel):
  the key tile scaled by 2^(G_last - G), or by scale 2^G walking backwards, zero past the end, as the value tile in a
  varlen call; S^T's bf16 checkpoint stored before each chunk's update S^T <- S^T 2^G_last + V^T K~ (the decay per
  key column);
- the walks of a kernel with the delta rule (SM90's GDN and KDA kernels, :class:`cula.sm90.state_chain.StateChain`):
  Tinv = (I + A)^-1 from A = strict_tril(beta_i sum_k k_ik k_jk 2^(G_ik - G_jk)) (bf16 keys, pair factors whole);
  "states" V_new = Tinv beta (V - (K 2^G) S) (V_new exact: the kernel's hi + lo operands) and the update as above;
  "state_grads" from the last chunk, dV_new^T = dS'^T (K 2^(G_last - G))^T + dO^T P with P = bf16(scale tril(Q K^T
  gated)), Y'^T = dV_new^T Tinv and dS^T <- dS'^T 2^G_last + dO^T (scale Q 2^G) - (beta Y'^T) (K 2^G), every product's
  operands rounded to bf16, tokens past the end zero;
- the forward of a kernel without the delta rule (SM90's and SM100's simple GLA kernels, SM100's GLA kernel): P~ = s
  (Q K^T)_ij 2^(G_i - G_j) where j <= i and j is in the sequence, else 0 (per key: the kernel's centred blocks or its
  direct sum, ``chunk_emulation.gla_scores``, and K~ made over R where the chunk is not steep); Q~ = bf16(s 2^G q); O
  = Q~ S + P~ V, rounded to bf16 where the token is in the sequence; a split's correction pass adds Q~ S of the v = 0
  walk to o;
- the forward of SM100's GDN kernel: Tinv the launch's ``w`` rows (made by the host path), Y = beta (V - 2^G K S) and
  V_new = Tinv Y selected to zero past the end, Y and V_new as bf16 hi + lo operands; O = Q~ S + P~ V_new and the
  update with 2^(G_last - G) V_new (hi + lo) against the raw keys; a split's later passes with V = 0, the transition
  pass from S = I without an output, the correction pass's output added to the first pass's;
- the forward of SM100's KDA kernel: the same chain with the per-key gate on the keys (K^ = bf16(2^G k) in K S,
  K~ = bf16(2^(G_last - G) k) in the update, Q~ = bf16(s 2^G q)), Tinv and P~ the launch's ``w`` rows.
"""

import math

import torch

from cula.ops.chunk_emulation import bf16, end_keys_from_right, gla_scores, split
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
    """One launch: writes o (the forward: SM100 simple GLA and GLA only), the walks' checkpoints ``t.w`` and the final
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
            if config.start == "identity":  # a transition pass (the delta rule's)
                ST = torch.eye(D)
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
                    if kernel.delta_rule:
                        beta = torch.where(inside, t.beta[b, tokens, hv].float(), 0.0)
                        ST = _delta_walk_step(config, ST, q, k, V_op, beta, G, inside, scale)
                        continue
                elif kernel.delta_rule:  # the SM100 GDN or KDA forward, or a split's later pass (v = 0)
                    if config.mode != "full":
                        V_op = torch.zeros_like(V_op)
                    step = _key_delta_forward_step if t.g.dim() == 4 else _delta_forward_step
                    o, ST = step(t, b, tokens, hv, inside, q, k, V_op, G, ST, scale)
                    if config.mode == "correction":  # added to the first pass's output
                        o = o + t.o[b, tokens, hv].float()
                    if config.make_o:
                        t.o[b, tokens[inside], hv] = o[inside].to(t.o.dtype)
                    continue
                else:
                    assert config.mode in ("full", "correction"), config.mode
                    per_key = t.g.dim() == 4  # the SM100 GLA kernel
                    G1 = G[:, 0]
                    Q_op = bf16(q * scale * torch.exp2(G)) if per_key else bf16(q * (scale * torch.exp2(G1))[:, None])
                    o = Q_op @ bf16(ST.T)
                    if config.mode == "full":
                        keep = (place[None, :] <= place[:, None]) & inside[None, :]
                        if per_key:  # centred blocks of 32 tokens, or steep and direct
                            scores, steep = gla_scores(q, k, G, blocks=4)
                            scores = scale * scores
                            if not steep:
                                K_op = torch.where(inside[:, None], end_keys_from_right(k, G, blocks=4), 0.0)
                        else:
                            decay = torch.exp2(torch.where(keep, G1[:, None] - G1[None, :], 0.0))
                            scores = scale * (q @ k.T) * decay
                        o = o + bf16(torch.where(keep, scores, 0.0)) @ V_op
                    else:  # the v = 0 walk from the given start, added to the first pass's output
                        V_op = torch.zeros_like(V_op)
                        o = o + t.o[b, tokens, hv].float()
                    t.o[b, tokens[inside], hv] = o[inside].to(t.o.dtype)
                ST = ST * torch.exp2(G[-1])[None, :] + V_op.T @ K_op
            ht[ht_row, hv] = ST.T


def _delta_walk_step(config, ST, q, k, V_op, beta, G, inside, scale):
    """One chunk of a delta-rule walk (module docstring) on S^T (V x K): the next chunk's S^T, or dS^T walking
    backwards (``V_op`` then holds dO)."""
    q, k = (torch.where(inside[:, None], x, 0.0) for x in (q, k))
    C = q.shape[0]
    G_L = G[-1]
    keep = torch.ones(C, C, dtype=torch.bool).tril()
    gamma = torch.exp2(torch.where(keep[..., None], G[:, None, :] - G[None, :, :], -torch.inf))  # [i, j, K]
    A = beta[:, None] * torch.einsum("ik,jk,ijk->ij", bf16(k), bf16(k), gamma).tril(-1)
    eye = torch.eye(C)
    Tinv = torch.linalg.solve_triangular(eye + A, eye, upper=False)
    K_end = bf16(torch.where(inside[:, None], k * torch.exp2(G_L - G), 0.0))
    K_start = bf16(k * torch.exp2(G))
    if not config.reverse:
        Y = beta[:, None] * (V_op - K_start @ bf16(ST).T)
        return ST * torch.exp2(G_L)[None, :] + (Tinv @ Y).T @ K_end
    P = bf16(scale * torch.einsum("ik,jk,ijk->ij", bf16(q), bf16(k), gamma))
    dV_new = bf16(ST) @ K_end.T + bf16(V_op).T @ P
    Y = bf16(dV_new) @ bf16(Tinv)
    Q_start = bf16(scale * q * torch.exp2(G))
    return ST * torch.exp2(G_L)[None, :] + bf16(V_op).T @ Q_start - bf16(beta[None, :] * Y) @ K_start


def _delta_forward_step(t, b, tokens, hv, inside, q, k, V_op, G, ST, scale):
    """One chunk of the SM100 GDN forward (module docstring) on S^T (V x K), G the scalar gate's [C, K] (the same on
    every key): ``(o [C, V], the next S^T)``."""
    C = q.shape[0]
    G = G[:, 0]
    beta = torch.where(inside, t.beta[b, tokens, hv].float(), 0.0)
    tinv = t.w[b, tokens, hv].float()  # the launch's inverses, a row per token
    S_op = bf16(ST.T)
    Y = torch.where(inside[:, None], beta[:, None] * (V_op - torch.exp2(G)[:, None] * (k @ S_op)), 0.0)
    v_new = torch.where(inside[:, None], tinv @ split(Y), 0.0)
    place = torch.arange(C)
    keep = (place[None, :] <= place[:, None]) & inside[None, :]
    decay = torch.exp2(torch.where(keep, G[:, None] - G[None, :], 0.0))
    P = bf16(torch.where(keep, scale * (q @ k.T) * decay, 0.0))
    o = bf16(scale * torch.exp2(G)[:, None] * q) @ S_op + P @ split(v_new)
    to_end = torch.where(inside, torch.exp2(G[-1] - G), 0.0)
    k = torch.where(inside[:, None], k, 0.0)  # zeroed past the end before the update
    return o, ST * torch.exp2(G[-1]) + split(to_end[:, None] * v_new).T @ k


def _key_delta_forward_step(t, b, tokens, hv, inside, q, k, V_op, G, ST, scale):
    """One chunk of the SM100 KDA forward (module docstring) on S^T (V x K), G the per-key gate's [C, K]: ``(o [C, V],
    the next S^T)``."""
    C = q.shape[0]
    beta = torch.where(inside, t.beta[b, tokens, hv].float(), 0.0)
    rows = t.w[b, tokens, hv].float()  # the launch's Tinv | P~, a row per token
    tinv, P = rows[:, :C], rows[:, C:]
    S_op = bf16(ST.T)
    Y = torch.where(inside[:, None], beta[:, None] * (V_op - bf16(k * torch.exp2(G)) @ S_op), 0.0)
    v_new = torch.where(inside[:, None], tinv @ split(Y), 0.0)
    o = bf16(scale * torch.exp2(G) * q) @ S_op + P @ split(v_new)
    K_end = torch.where(inside[:, None], bf16(k * torch.exp2(G[-1] - G)), 0.0)
    return o, ST * torch.exp2(G[-1])[None, :] + split(v_new).T @ K_end
