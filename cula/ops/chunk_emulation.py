"""The SM90 chunk kernels' arithmetic, emulated in PyTorch on any device: the same chunk decomposition, with bf16
roundings where the kernels round (their wgmma operands) and fp32 everywhere else, so that a kernel's numerics can be
checked against the fp64 recurrence on a CPU, and a new scheme tried before it is written as a kernel.

- :func:`scalar_gate_forward`: the scalar-gate kernel (:mod:`cula.sm90.scalar_chunk_fwd`), with the delta rule (GDN)
  or without it (simple GLA, Lightning); with ``chunk=128, gated_operands=True`` the SM100 kernel
  (:mod:`cula.sm100.scalar_chunk_fwd`: the gate factors folded into bf16 copies of q and k).
- :func:`centred_scores`: the intra-chunk scores with a per-key gate by column blocks against their middle tokens:
  KDA's kernel's two halves, or the SM100 GLA scheme's four quarters of a 128-token chunk.
- :func:`block_scores`: the same scores by 16-token blocks whose operands never exceed the raw q and k (no bound on
  the gate).
- :func:`direct_scores`: each score summed directly over the keys (exact for any gate).
- :func:`gla_scores`, :func:`key_gate_forward`: the GLA kernel (:mod:`cula.gla.chunk_fwd_sm90`): KDA's halves where
  no operand's exponent passes ``GLA_SAFE_SPAN``, else each score summed directly; with ``chunk=128, blocks=4,
  gated_operands=True`` the SM100 GLA kernel (:mod:`cula.sm100.key_chunk_fwd`).
- :func:`delta_chunk_gradients`: the delta rule's per-chunk gradient kernel (:mod:`cula.sm90.delta_chunk_bwd`), stage
  by stage (batched chunk-heads, not one sequence).
- :func:`key_chunk_gradients`: GLA's per-chunk gradient kernel (:mod:`cula.sm90.key_chunk_bwd`), its fast and steep
  paths (batched chunk-heads).
- :func:`key_delta_chunk_gradients`: KDA's per-chunk gradient kernel (:mod:`cula.sm90.key_delta_chunk_bwd`): the delta
  kernel's stages with KDA's two reference tokens per chunk (batched chunk-heads).

Shapes: one sequence per call, heads first: q, k [H, T, K]; v [H, T, V]; g [H, T] natural-log gate (per key: [H, T,
K]); beta [H, T]; states [H, K, V]. Gates are in log2 units inside, as in the kernels.
"""

from __future__ import annotations

import math

import torch

from cula.ops.gates import GATE_FLOOR, GLA_SAFE_SPAN

CHUNK = 64
LOG2E = math.log2(math.e)


def bf16(x: torch.Tensor) -> torch.Tensor:
    """An operand as a wgmma reads it: rounded to bf16, computed on in fp32."""
    return x.to(torch.bfloat16).float()


def scalar_gate_forward(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor | None,
    scale: float,
    h0: torch.Tensor | None = None,
    delta_rule: bool = True,
    gate_floor: float | None = GATE_FLOOR,
    chunk: int = CHUNK,
    gated_operands: bool = False,
    split_values: bool = False,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The scalar-gate kernel on one sequence: ``(o [H, T, V] fp32, final state [H, K, V] fp32)``.

    Per chunk: G = cumsum(max(g, floor)) log2(e); A = strict_tril(beta_i (K K^T)_ij 2^(G_i - G_j)) and P =
    tril(scale (Q K^T)_ij 2^(G_i - G_j)) from bf16 q, k; Tinv = (I + A)^-1 in fp32, a bf16 operand; the state a bf16
    operand of its products; Y = beta (V - 2^G (K S)) and V_new = Tinv Y (bf16 operands); O = scale 2^G (Q S) +
    P V_new; S <- 2^G_last S + K^T (V_new 2^(G_last - G)). Without the delta rule V_new = V. ``gate_floor`` None
    leaves the gates as given (-inf then gives NaN: the reason for the floor). ``chunk``: the kernel's chunk size.
    ``gated_operands``: the factors of O and the update ride in bf16 operands instead (the SM100 kernel's scheme),
    O = bf16(scale 2^G Q) S + P V_new and S <- 2^G_last S + bf16(2^(G_last - G) K)^T V_new. ``split_values`` (delta
    rule): Y and V_new enter their products
    as bf16 hi + lo pairs (:func:`split`), as KDA's kernel takes them."""
    H, T, K = q.shape
    V = v.shape[-1]
    q, k, v = bf16(q), bf16(k), bf16(v)
    S = torch.zeros(H, K, V, dtype=torch.float32, device=q.device) if h0 is None else h0.float().clone()
    o = torch.empty(H, T, V, dtype=torch.float32, device=q.device)
    g = g.float() if gate_floor is None else g.float().clamp_min(gate_floor)
    assert delta_rule or not split_values
    for c0 in range(0, T, chunk):
        c1 = min(c0 + chunk, T)
        L = c1 - c0
        qc, kc, vc = q[:, c0:c1], k[:, c0:c1], v[:, c0:c1]
        G = torch.cumsum(g[:, c0:c1], dim=1) * LOG2E  # [H, L]
        diff = G[:, :, None] - G[:, None, :]  # G_i - G_j
        lower = torch.ones(L, L, dtype=torch.bool, device=q.device).tril()
        # masks as selects: the masked entries' factors may overflow and never reach a product
        decay = torch.where(lower, torch.exp2(torch.where(lower, diff, 0.0)), 0.0)
        P = bf16(scale * (qc @ kc.transpose(1, 2)) * decay)
        S_op = bf16(S)
        fac_start = torch.exp2(G)[..., None]  # 2^G_i
        if delta_rule:
            strict = lower & ~torch.eye(L, dtype=torch.bool, device=q.device)
            b = beta[:, c0:c1].float()
            A = torch.where(strict, b[:, :, None] * (kc @ kc.transpose(1, 2)) * decay, 0.0)
            eye = torch.eye(L, dtype=torch.float32, device=q.device)
            Tinv = bf16(torch.linalg.solve_triangular(eye + A, eye.expand(H, L, L), upper=False))
            Y = b[..., None] * (vc - fac_start * (kc @ S_op))
            v_new = Tinv @ (split(Y) if split_values else bf16(Y))
        else:
            v_new = vc
        G_last = G[:, -1:]
        fac_end = torch.exp2(G_last - G)[..., None]  # 2^(G_last - G_j)
        operand = split if split_values else bf16
        if gated_operands:
            v_op = operand(v_new)
            o[:, c0:c1] = bf16(scale * fac_start * qc) @ S_op + P @ v_op
            S = torch.exp2(G_last)[..., None] * S + bf16(kc * fac_end).transpose(1, 2) @ v_op
            continue
        o[:, c0:c1] = scale * fac_start * (qc @ S_op) + P @ operand(v_new)
        S = torch.exp2(G_last)[..., None] * S + kc.transpose(1, 2) @ operand(v_new * fac_end)
    return o, S


def split(x: torch.Tensor) -> torch.Tensor:
    """An fp32 operand as two bf16 operands hi = bf16(x), lo = bf16(x - hi) summed by the product: about 16 mantissa
    bits instead of 8."""
    hi = bf16(x)
    return hi + bf16(x - hi)


def centred_scores(x: torch.Tensor, k: torch.Tensor, G: torch.Tensor, blocks: int = 2) -> torch.Tensor:
    """The intra-chunk scores with a per-key gate (x the chunk's q or k, k its keys, G their per-key cumulative gates in
    log2 units, all [C, K]): sum_k x_ik k_jk 2^(G_ik - G_jk) for j <= i, with the columns in ``blocks`` blocks of C /
    blocks tokens, each against its middle token r: L_i = x_i 2^(G_i - G_r) and R_j = k_j 2^(G_r - G_j) as bf16
    operands (rows before a block are zero against it). KDA's kernel takes two halves of its 64-token chunk (finite
    only while every gate >= -5, ``safe_gate``); the SM100 GLA scheme four quarters of 128 tokens."""
    C = x.shape[0]
    width = C // blocks
    out = torch.zeros(C, C, dtype=torch.float32, device=x.device)
    for blk in range(blocks):
        r = blk * width + width // 2
        cols = slice(blk * width, (blk + 1) * width)
        rows = torch.arange(C, device=x.device) >= blk * width
        left = torch.where(rows[:, None], x.float() * torch.exp2(G - G[r]), 0.0)
        right = k[cols].float() * torch.exp2(G[r] - G[cols])
        out[:, cols] = bf16(left) @ bf16(right).T
    return out.tril()


def direct_scores(x: torch.Tensor, k: torch.Tensor, G: torch.Tensor) -> torch.Tensor:
    """sum_k x_ik k_jk 2^(G_ik - G_jk) for j <= i (else zero; x, k, G [n, K]), each entry summed in fp32 from bf16 x
    and k with its factors <= 1 (exact for any gate): the masked factors are selects, never computed."""
    diff = G[:, None, :] - G[None, :, :]  # [i, j, K]
    lower = torch.ones(x.shape[0], x.shape[0], dtype=torch.bool, device=x.device).tril()[..., None]
    factor = torch.where(lower, torch.exp2(torch.where(lower, diff, 0.0)), 0.0)
    return (bf16(x)[:, None, :] * bf16(k)[None, :, :] * factor).sum(-1)


def block_scores(x: torch.Tensor, k: torch.Tensor, G: torch.Tensor, block: int = 16) -> torch.Tensor:
    """The same scores by ``block``-token blocks: a block of rows I against an earlier block of columns J takes the
    first token r of I as reference, L_i = x_i 2^(G_i - G_r) and R_j = k_j 2^(G_r - G_j), both at most the raw
    values (G does not increase along the chunk), as bf16 operands; a diagonal block is summed in fp32 with its
    exponents G_i - G_j <= 0. No bound on the gate: a factor only underflows where the true product does."""
    C = x.shape[0]
    x, k = x.float(), k.float()
    out = torch.zeros(C, C, dtype=torch.float32, device=x.device)
    for i0 in range(0, C, block):
        rows = slice(i0, i0 + block)
        if i0 > 0:
            left = x[rows] * torch.exp2(G[rows] - G[i0])
            right = k[:i0] * torch.exp2(G[i0] - G[:i0])
            out[rows, :i0] = bf16(left) @ bf16(right).T
        out[rows, rows] = direct_scores(x[rows], k[rows], G[rows])
    return out.tril()


def widest_span(G: torch.Tensor, blocks: int = 2) -> float:
    """The widest exponent (log2 units) of :func:`centred_scores`' operands over the key channels of a chunk's G [C,
    K]: G_start - G_r or G_r - G_end of a block."""
    width = G.shape[0] // blocks
    starts = range(0, G.shape[0], width)
    return max(
        float(torch.maximum(G[b] - G[b + width // 2], G[b + width // 2] - G[b + width - 1]).max()) for b in starts
    )


def gla_scores(x: torch.Tensor, k: torch.Tensor, G: torch.Tensor, blocks: int = 2) -> tuple[torch.Tensor, bool]:
    """The GLA kernel's intra-chunk scores (unscaled; x, k, G [C, K] as :func:`centred_scores`, G flat past the
    sequence end): by ``blocks`` centred blocks where no operand's exponent (:func:`widest_span`) passes GLA_SAFE_SPAN
    in any key channel, else every score summed directly in fp32 from bf16 x and k with factors <= 1. Returns
    ``(scores, whether the chunk was steep)``."""
    if widest_span(G, blocks) <= GLA_SAFE_SPAN:
        return centred_scores(x, k, G, blocks), False
    return direct_scores(x, k, G), True


def end_keys_from_right(k: torch.Tensor, G: torch.Tensor, blocks: int) -> torch.Tensor:
    """The SM100 GLA kernel's update operand K~ in a chunk that is not steep (k, G [C, K] as :func:`centred_scores`):
    made over the scores' right operand R_j = bf16(k_j 2^(G_r - G_j)) as bf16(R_j 2^(G_last - G_r)), r the middle
    token of j's block."""
    width = k.shape[0] // blocks
    ref = G[torch.arange(k.shape[0], device=k.device) // width * width + width // 2]  # G_r of each token's block
    return bf16(bf16(k * torch.exp2(ref - G)) * torch.exp2(G[-1] - ref))


def key_gate_forward(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    scale: float,
    h0: torch.Tensor | None = None,
    chunk: int = CHUNK,
    blocks: int = 2,
    gated_operands: bool = False,
) -> tuple[torch.Tensor, torch.Tensor, int]:
    """The GLA kernel on one sequence (g [H, T, K] natural-log per-key gate): ``(o [H, T, V] fp32, final state
    [H, K, V] fp32, the number of steep chunks)``. Per chunk: G = cumsum(max(g, floor)) log2(e) over the chunk's
    tokens; P = bf16(scale :func:`gla_scores`); O = scale (Q 2^G) S + P V and S <- 2^G_last S + (K 2^(G_last - G))^T
    V with bf16 operands (Q 2^G, K 2^(G_last - G), the state, V, P) and fp32 accumulation.

    ``chunk=128, blocks=4, gated_operands=True``: the SM100 scheme (DESIGN.md, SM100). Q~ = bf16(scale 2^G q) is made
    from the raw q; the key tile already holds R (the scores' right operand, where the chunk is not steep), so K~ =
    bf16(R_j 2^(G_last - G_r)) is R rounded a second time, and bf16(k 2^(G_last - G)) in a steep chunk."""
    H, T, K = q.shape
    V = v.shape[-1]
    S = torch.zeros(H, K, V, dtype=torch.float32, device=q.device) if h0 is None else h0.float().clone()
    o = torch.empty(H, T, V, dtype=torch.float32, device=q.device)
    steep = 0
    for c0 in range(0, T, chunk):
        c1 = min(c0 + chunk, T)
        qc, kc, vc = bf16(q[:, c0:c1]), bf16(k[:, c0:c1]), bf16(v[:, c0:c1])
        G = torch.cumsum(g[:, c0:c1].float().clamp_min(GATE_FLOOR), dim=1) * LOG2E  # [H, L, K]
        pad = chunk - (c1 - c0)  # the kernel's scan adds nothing past the sequence end
        G_full = torch.cat([G, G[:, -1:].expand(H, pad, K)], dim=1) if pad else G
        G_last = G[:, -1:]  # [H, 1, K]
        k_end = torch.empty_like(kc)  # the update's K 2^(G_last - G) operand
        for h in range(H):
            xq = torch.cat([qc[h], qc.new_zeros(pad, K)]) if pad else qc[h]
            xk = torch.cat([kc[h], kc.new_zeros(pad, K)]) if pad else kc[h]
            scores, was_steep = gla_scores(xq, xk, G_full[h], blocks)
            steep += was_steep
            P = bf16(scale * scores)[: c1 - c0, : c1 - c0]
            if gated_operands and not was_steep:
                k_end[h] = end_keys_from_right(xk, G_full[h], blocks)[: c1 - c0]
            else:
                k_end[h] = bf16(kc[h] * torch.exp2(G_last[h] - G[h]))
            if gated_operands:
                o[h, c0:c1] = bf16(scale * qc[h] * torch.exp2(G[h])) @ bf16(S[h]) + P @ vc[h]
            else:
                o[h, c0:c1] = scale * (bf16(qc[h] * torch.exp2(G[h])) @ bf16(S[h])) + P @ vc[h]
        S = torch.exp2(G_last.transpose(1, 2)) * S + k_end.transpose(1, 2) @ vc
    return o, S, steep


def delta_chunk_gradients(q, k, v, beta, g, S, dS_end, do, scale, operand=bf16) -> tuple[torch.Tensor, ...]:
    """The delta rule's per-chunk gradient kernel (:mod:`cula.sm90.delta_chunk_bwd`), stage by stage and with its
    roundings (``operand``: bf16 as the kernel's wgmma operands and stored tiles; exact for the algebra alone), on
    chunk-heads batched as :func:`cula.ops.chunk_backward.scalar_delta_rows` takes them: q, k [N, C, K], v, do [N, C,
    V], beta and g [N, C] (natural log, floored; zero past a sequence's end), S and dS_end [N, K, V]. Returns ``(dq,
    dk, dv, dbeta, dg)``, dg each token's gradient (the suffix sums and the chunk's constant)."""
    r = operand
    C = q.shape[1]
    G = torch.cumsum(g, dim=1)
    E, F = torch.exp(G), torch.exp(G[:, -1:] - G)
    idx = torch.arange(C, device=q.device)
    lower, strict = idx[:, None] >= idx[None, :], idx[:, None] > idx[None, :]
    diff = G[:, :, None] - G[:, None, :]
    gamma = torch.where(lower, torch.exp(torch.where(lower, diff, 0.0)), 0.0)
    gamma_a = torch.where(strict, gamma, 0.0)
    b = beta[..., None]
    S, dS_end, q, k, v, do = (r(x) for x in (S, dS_end, q, k, v, do))
    t = lambda x: x.transpose(1, 2)  # noqa: E731
    # stage 1: A and T (stored bf16); dV' = F (K dS') + P^T dO
    kk = k @ t(k)
    eye = torch.eye(C, dtype=q.dtype, device=q.device)
    T = r(torch.linalg.solve_triangular(eye + b * kk * gamma_a, eye.expand(q.shape[0], C, C), upper=False))
    pt = r(t(scale * (q @ t(k)) * gamma))
    dvn = r(F[..., None] * (k @ dS_end) + pt @ do)
    # stage 2: W = T diag(beta) (E K), U = T diag(beta) V, V' = U - W S; dW = -dV' S^T
    t_beta = r(T * t(b))
    w_neg = r(-(t_beta @ r(E[..., None] * k)))
    vn = r(t_beta @ v + w_neg @ S)
    dw = r(-(dvn @ t(S)))
    # stage 3: dP = scale dO V'^T; dq, and dk's P and end parts
    dp = r(scale * (do @ t(vn)) * gamma)
    dq = scale * E[..., None] * (do @ t(S)) + dp @ k
    dk_end = F[..., None] * (vn @ t(dS_end))
    dk = dk_end + t(dp) @ q
    rows = {"q_dq": (q * dq).sum(-1), "k_dk": (k * dk).sum(-1), "k_dk_end": (k * dk_end).sum(-1)}
    # stage 4: dT, d_bk = T^T dW, d_bv = T^T dV'
    dT = r(t(b) * (t(E[..., None]) * (dw @ t(k)) + dvn @ t(v)))
    d_bk, d_bv = t(T) @ dw, t(T) @ dvn
    k_dbk = (k * d_bk).sum(-1)
    dk = dk + b * E[..., None] * d_bk
    dv = b * d_bv
    # stage 5: X = dT T^T, dA = -(T^T X) on the strict lower triangle; the pair terms
    x_ = r(dT @ t(T))
    da = torch.where(strict, -(t(T) @ x_), 0.0) * gamma_a
    da_kk = da * kk
    pair = b * da_kk
    dab = r(b * da)
    # stage 6: dk's pair terms; dbeta and dg
    dk = dk + dab @ k + t(dab) @ k
    dbeta = da_kk.sum(-1) + E * k_dbk + (v * d_bv).sum(-1)
    local = rows["q_dq"] - rows["k_dk"] + pair.sum(-1) - pair.sum(-2) + beta * E * k_dbk
    constant = rows["k_dk_end"].sum(-1, keepdim=True) + torch.exp(G[:, -1:]) * (S * dS_end).sum((1, 2))[:, None]
    dg = local.flip(1).cumsum(1).flip(1) + constant
    return dq, dk, dv, dbeta, dg


def key_chunk_gradients(q, k, v, do, g, S, dS_end, scale, operand=bf16) -> tuple[torch.Tensor, ...]:
    """GLA's per-chunk gradient kernel (:mod:`cula.sm90.key_chunk_bwd`) with its roundings (``operand``: bf16 as the
    kernel's wgmma operands; exact for the algebra alone), on chunk-heads batched as
    :func:`cula.ops.chunk_backward.chunk_gradients` takes them: q, k [N, C, K], v, do [N, C, V], g [N, C, K] (natural
    log, floored; zero past a sequence's end), S and dS_end [N, K, V]. Returns ``(dq, dk, dv, dg)``.

    With G the cumulative log2 gate and r = C / 2 the reference token: a chunk-head whose operands' exponents
    (G_0 - G_r, G_r - G_last) stay within ``GLA_SAFE_SPAN`` in every key channel takes the fast path, its intra-chunk
    products as matrix products of Q_L = Q 2^(G - G_r) and K_R = K 2^(G_r - G); a steeper one sums them directly in
    fp32 with factors <= 1 (the steep path: dA kept in fp32, P^T rounded once)."""
    r = operand
    N, C, K = q.shape
    ref = C // 2
    G = torch.cumsum(g, dim=1) * LOG2E
    G_r, G_L = G[:, ref : ref + 1], G[:, -1:]
    widest = torch.maximum(G[:, 0] - G_r[:, 0], G_r[:, 0] - G_L[:, 0]).amax(-1)
    steep = (widest > GLA_SAFE_SPAN)[:, None, None]
    q, k, v, do, S, dS_end = (r(x) for x in (q, k, v, do, S, dS_end))
    t = lambda x: x.transpose(1, 2)  # noqa: E731
    lower = torch.ones(C, C, dtype=torch.bool, device=q.device).tril()
    da = torch.where(lower, scale * (do @ t(v)), 0.0)  # dA_ij = scale dP_ij, j <= i
    k_f = r(k * torch.exp2(G_L - G))  # K 2^(G_L - G): the dv's inter operand on both paths
    # fast path: E_q = 2^(G - G_r), E_k = 2^(G_r - G), the fp32 accumulators scaled per key before the intra part
    e_q = torch.exp2(torch.where(steep, 0.0, G - G_r))
    e_k = torch.exp2(torch.where(steep, 0.0, G_r - G))
    q_l, k_r = r(q * e_q), r(k * e_k)
    dq_fast = e_q * (scale * torch.exp2(G_r) * (do @ t(S)) + r(da) @ k_r)
    dk_inter_fast = torch.exp2(G_L - G_r) * (v @ t(dS_end))
    dk_fast = e_k * (dk_inter_fast + t(r(da)) @ q_l)
    pt_fast = r(torch.where(lower.T, scale * (k_r @ t(q_l)), 0.0))
    # steep path: every pair factor 2^(G_i - G_j) <= 1, summed in fp32
    diff = G[:, :, None, :] - G[:, None, :, :]  # [N, i, j, K]
    gamma = torch.where(lower[..., None], torch.exp2(torch.where(lower[..., None], diff, 0.0)), 0.0)
    dq_steep = scale * torch.exp2(G) * (do @ t(S)) + torch.einsum("nij,nijk,njk->nik", da, gamma, k)
    dk_inter_steep = torch.exp2(G_L - G) * (v @ t(dS_end))
    dk_steep = dk_inter_steep + torch.einsum("nij,nijk,nik->njk", da, gamma, q)
    pt_steep = r(t(scale * torch.einsum("nik,njk,nijk->nij", q, k, gamma)))
    dq = torch.where(steep, dq_steep, dq_fast)
    dk = torch.where(steep, dk_steep, dk_fast)
    dk_inter = torch.where(steep, dk_inter_steep, e_k * dk_inter_fast)
    dv = k_f @ dS_end + torch.where(steep, pt_steep, pt_fast) @ do
    local = q * dq - k * dk
    constant = (k * dk_inter).sum(1, keepdim=True) + torch.exp2(G_L) * (S * dS_end).sum(-1)[:, None, :]
    dg = local.flip(1).cumsum(1).flip(1) + constant
    return dq, dk, dv, dg


def key_delta_slab_gradients(q, k, v, beta, g, S, dS_end, do, scale, operand=bf16) -> tuple[torch.Tensor, ...]:
    """KDA's per-chunk gradient kernel (:mod:`cula.sm90.key_delta_chunk_bwd`) for one slab of value columns:
    :func:`delta_chunk_gradients`'s six stages with the per-key gate taken against two reference tokens per chunk, on
    chunk-heads batched as :func:`cula.ops.chunk_backward.key_delta_rows` takes them (g [N, C, K] >= -5, FLA's
    ``safe_gate``; zero past a sequence's end) and v, do [N, C, Vs], S, dS_end [N, K, Vs] the slab's columns. Every
    gradient is linear in the slab's columns, so the slabs' ``(dq, dk, dbeta, dg)`` sum to the chunk's and their dv
    are its columns. Returns ``(dq, dk, dv, dbeta, dg [N, C, K])`` of the slab.

    The references are r = 16 and 48, one per 32-token half; ``R_j = k_j e^(G_r(j) - G_j)`` takes the reference of
    its own token's half, ``L^h_i = x_i e^(G_i - G_rh)`` (zero before half h) that of half h:

        scores_ij  = (L^h R^T)_ij                                     (j in half h: each half one product)
        dX_ik      = sum_h e^(G_ik - G_rh,k) (dM[:, h] R_h)_ik          (i in or after half h)
        dK_jk      = e^(G_rh,k - G_jk) (dM^T L^h)_jk                    (h the half of j)

    for dM = dP (X = Q) and dM = beta dA (X = K) (h the half of j): each half's product has its factor applied to the
    fp32 product alone (a factor of one half would overflow on the other's). ``operand``: the bf16 rounding of the
    kernel's wgmma operands and stored tiles. dg per key is the suffix sum of a local term plus the chunk's constant
    sum_j k_j dk^end_j + e^G_L sum_v S dS'; the local term is q dq^inter - k dk^end + beta E k d_bk and, per pair
    gradient, L^h (dM[:, h] R_h) - R (dM^T L^h): each pair enters it through the same rounded operands from both
    sides, so that the pairs inside a suffix cancel (through q dq - k dk they would not, each side with its own
    roundings)."""
    r = operand
    N, C, K = q.shape
    half = C // 2
    refs = (half // 2, half + half // 2)
    idx = torch.arange(C, device=q.device)
    lower, strict = idx[:, None] >= idx[None, :], idx[:, None] > idx[None, :]
    G = torch.cumsum(g, dim=1)
    G_L = G[:, -1:]
    E, F = torch.exp(G), torch.exp(G_L - G)
    G_ref = [G[:, ref : ref + 1] for ref in refs]
    G_own = torch.where((idx < half)[None, :, None], G_ref[0], G_ref[1])
    b = beta[..., None]
    S, dS_end, q, k, v, do = (r(x) for x in (S, dS_end, q, k, v, do))
    t = lambda x: x.transpose(1, 2)  # noqa: E731
    R = r(k * torch.exp(G_own - G))

    def left(x, h):
        return r(torch.where((idx >= h * half)[None, :, None], x * torch.exp(G - G_ref[h]), 0.0))

    def scores(x):
        out = x.new_zeros(N, C, C)
        for h in range(2):
            cols = slice(h * half, (h + 1) * half)
            out[:, :, cols] = (left(x, h) @ t(R))[:, :, cols]
        return out

    def pair_gradients(dM, x):
        """The rows and columns gradients of the scores dM (x's and k's), and their part of dg's local term,
        sum_h L^h (dM[:, h] R_h) - R (dM^T L^h(j)): each pair (i, j) enters it through the same rounded operands on
        both sides, so that the pairs inside a suffix cancel."""
        rows, columns, local = torch.zeros_like(q), torch.zeros_like(q), torch.zeros_like(q)
        for h in range(2):
            in_half = (idx >= h * half) & (idx < (h + 1) * half)
            L = left(x, h)
            part = dM[:, :, in_half] @ R[:, in_half]
            after = (idx >= h * half)[None, :, None]
            rows = rows + torch.where(after, torch.exp(G - G_ref[h]) * part, 0.0)
            local = local + L * part
            part = t(dM) @ L
            mine = in_half[None, :, None]
            columns = columns + torch.where(mine, torch.exp(G_ref[h] - G) * part, 0.0)
            local = local - torch.where(mine, R * part, 0.0)
        return rows, columns, local

    # stage 1: A and T; P^T; dV' = (F K) dS' + P^T dO
    kk = torch.where(strict, scores(k), 0.0)
    eye = torch.eye(C, dtype=q.dtype, device=q.device)
    T = r(torch.linalg.solve_triangular(eye + b * kk, eye.expand(N, C, C), upper=False))
    pt = r(t(torch.where(lower, scale * scores(q), 0.0)))
    dvn = r(r(F * k) @ dS_end + pt @ do)
    # stage 2: W = T diag(beta) (E K), V' = T diag(beta) V - W S; dW = -dV' S^T
    t_beta = r(T * t(b))
    ek = r(E * k)
    w_neg = r(-(t_beta @ ek))
    vn = r(t_beta @ v + w_neg @ S)
    dw = r(-(dvn @ t(S)))
    # stage 3: dq; dk's end and P parts
    dP = r(torch.where(lower, scale * (do @ t(vn)), 0.0))
    dq_inter = scale * E * (do @ t(S))
    dq_pair, dk_pair, local = pair_gradients(dP, q)
    dq = dq_inter + dq_pair
    dk_end = F * (vn @ t(dS_end))
    dk = dk_end + dk_pair
    local = local + q * dq_inter - k * dk_end
    # stage 4: dT; d_bk = T^T dW (dk += beta E d_bk); d_bv = T^T dV'
    dT = r(t(b) * (dw @ t(ek) + dvn @ t(v)))
    d_bk, d_bv = t(T) @ dw, t(T) @ dvn
    dk = dk + b * E * d_bk
    local = local + k * b * E * d_bk
    # stage 5: X = dT T^T, dA = -(T^T X) on the strict lower triangle
    dA = torch.where(strict, -(t(T) @ r(dT @ t(T))), 0.0)
    dA_b = r(b * dA)
    # stage 6: the pair terms of A
    dk_rows, dk_columns, pair_local = pair_gradients(dA_b, k)
    dk = dk + dk_rows + dk_columns
    local = local + pair_local
    dbeta = (dA * kk).sum(-1) + (ek * d_bk).sum(-1) + (v * d_bv).sum(-1)
    constant = (k * dk_end).sum(1, keepdim=True) + torch.exp(G_L) * (S * dS_end).sum(-1)[:, None, :]
    dg = local.flip(1).cumsum(1).flip(1) + constant
    return dq, dk, b * d_bv, dbeta, dg


def key_delta_chunk_gradients(
    q, k, v, beta, g, S, dS_end, do, scale, operand=bf16, slab=64
) -> tuple[torch.Tensor, ...]:  # fmt: skip
    """KDA's per-chunk gradient kernel over all value columns, ``slab`` at a time (its CTAs per chunk-head: one per
    slab, :func:`key_delta_slab_gradients`), their partial gradients summed as the kernel's host sums them. Shapes
    as :func:`key_delta_slab_gradients` with the whole V; returns ``(dq, dk, dv, dbeta, dg [N, C, K])``."""
    V = v.shape[-1]
    parts = [
        key_delta_slab_gradients(
            q, k, v[..., c : c + slab], beta, g, S[..., c : c + slab], dS_end[..., c : c + slab], do[..., c : c + slab],
            scale, operand,
        )
        for c in range(0, V, slab)
    ]  # fmt: skip
    dq, dk, _, dbeta, dg = (sum(p[n] for p in parts) for n in range(5))
    return dq, dk, torch.cat([p[2] for p in parts], dim=-1), dbeta, dg
