"""The chunked backward of gated linear attention (GLA, simple GLA, Lightning): the plan the SM90 backward follows,
in PyTorch on any device, bf16 where the kernels round (their wgmma operands: token tiles, state checkpoints, scores)
and fp32 elsewhere, so that it can be checked against the fp64 recurrence's autograd on a CPU.

Per sequence and value head, chunks of C tokens (64; the SM100 kernel's walks 128), G the cumulative natural-log
gate inside a chunk (per key; a scalar gate is the same value on every key), G_L its last row, S_c the state at
chunk c's start and dS'_c the gradient of the state at its end (that is, of S_{c+1}):

1. states, walking forward:   S_{c+1}  = diag(e^G_L) S_c + (K * e^(G_L - G))^T V          (S_0 = h0)
2. state gradients, backward: dS'_{c-1} = diag(e^G_L) dS'_c + scale (Q * e^G)^T dO         (dS'_last = dht)
   and dh0 = the last value of that walk (the gradient of S_0).
3. each chunk on its own, with Gamma_ijk = e^(G_ik - G_jk) for j <= i (zero above the diagonal, by a select):
       P  = scale sum_k Q_ik K_jk Gamma_ijk                        (the forward's scores)
       dP = dO V^T, lower triangle
       dQ = scale e^G * (dO S_c^T) + scale sum_j dP_ij Gamma_ij * K_j
       dK = e^(G_L - G) * (V dS'_c^T) + scale sum_i dP_ij Gamma_ij * Q_i
       dV = (K * e^(G_L - G)) dS'_c + P^T dO
4. the gate: every product carries e^(G_s - G_j) over the tokens between a key j and a query s, so g_t's gradient
   sums the products of the pairs j < t <= s. Chunk by chunk (t in chunk c):
       dg_t = sum_{s >= t in c} (q_s * dq_s - k_s * dk_s) + sum_{j in c} k_j * dk_j^inter + e^G_L * sum_v (S_c * dS'_c)
   per key, dk^inter the part of dk through dS'_c: the pairs inside the chunk cancel in the first sum, those that
   leave it are counted once by the chunk's constant (the last two terms, the gradient of S_{c+1} with respect to
   its decay). Summed over the whole sequence from its end instead (with S_T * dht as the constant), the pairs
   spanning chunks cancel between products rounded through different checkpoints and leave errors of several
   percent. A scalar gate sums dg over the keys, a per-head constant (g_gamma, Lightning) over the tokens too. Gates
   below the floor (-200) take no gradient: their factors are zero in fp32.

Passes 1 and 2 are the forward kernel's state walk (forward, or backward over the chunks with (q, do) in place of
(k, v) and the factor e^G in place of e^(G_L - G)); passes 3 and 4 are parallel over chunks.

Shapes: one sequence per call, heads first: q, k [H, T, K]; v, do [H, T, V]; g [H, T] (scalar) or [H, T, K]
(per key) natural-log; h0, dht [H, K, V].
"""

from __future__ import annotations

from typing import NamedTuple

import torch

from cula import runtime
from cula.ops.chunk_emulation import CHUNK, bf16
from cula.ops.gates import GATE_FLOOR


def _chunk_gates(g: torch.Tensor, c0: int, c1: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``(G [H, L, K], G_L [H, 1, K])``: the chunk's cumulative gate and its last row."""
    G = torch.cumsum(g[:, c0:c1], dim=1)
    return G, G[:, -1:]


def _causal(L: int, strict: bool, device) -> torch.Tensor:
    """The (L x L) mask [i, j] of j < i (``strict``) or j <= i."""
    return torch.ones(L, L, dtype=torch.bool, device=device).tril(-1 if strict else 0)


def _pair_factors(G: torch.Tensor, strict: bool) -> torch.Tensor:
    """Gamma_ij = e^(G_i - G_j) on the causal mask (:func:`_causal`), else zero by a select, for a chunk's cumulative
    gate G: [N, i, j] for a scalar gate [N, C], [N, i, j, K] for a per-key one [N, C, K]. Never e^-G alone (which
    overflows on steep gates)."""
    mask = _causal(G.shape[1], strict, G.device)
    if G.dim() == 3:
        mask = mask[..., None]
    diff = G[:, :, None] - G[:, None, :]
    return torch.where(mask, torch.exp(torch.where(mask, diff, 0.0)), 0.0)


def _exact(x: torch.Tensor) -> torch.Tensor:
    return x


def state_walk(k, v, g, h0=None, chunk: int = CHUNK) -> tuple[list[torch.Tensor], torch.Tensor]:
    """Pass 1: ``(the state at each chunk's start, the final state)`` (``g`` [H, T, K] floored; chunks of
    ``chunk`` tokens: 128 for the SM100 kernel's walks)."""
    H, T, K = k.shape
    S = k.new_zeros(H, K, v.shape[-1], dtype=torch.float32) if h0 is None else h0.float().clone()
    starts = []
    for c0 in range(0, T, chunk):
        starts.append(S)
        G, G_L = _chunk_gates(g, c0, min(c0 + chunk, T))
        gated_k = bf16(k[:, c0 : c0 + chunk] * torch.exp(G_L - G))
        S = torch.exp(G_L).transpose(1, 2) * S + gated_k.transpose(1, 2) @ bf16(v[:, c0 : c0 + chunk])
    return starts, S


def state_gradient_walk(q, do, g, scale, dht=None, chunk: int = CHUNK) -> tuple[list[torch.Tensor], torch.Tensor]:
    """Pass 2: ``(the gradient of the state at each chunk's end, dh0)``, in chunks of ``chunk`` as :func:`state_walk`."""
    H, T, K = q.shape
    dS = q.new_zeros(H, K, do.shape[-1], dtype=torch.float32) if dht is None else dht.float().clone()
    n_chunks = -(-T // chunk)
    ends = [None] * n_chunks
    for c in reversed(range(n_chunks)):
        c0 = c * chunk
        ends[c] = dS
        G, G_L = _chunk_gates(g, c0, min(c0 + chunk, T))
        gated_q = bf16(scale * q[:, c0 : c0 + chunk] * torch.exp(G))
        dS = torch.exp(G_L).transpose(1, 2) * dS + gated_q.transpose(1, 2) @ bf16(do[:, c0 : c0 + chunk])
    return ends, dS


def key_gated_products(q, k, dP, G, scale, block: int = 16) -> tuple[torch.Tensor, ...]:
    """The per-key gate's intra-chunk products, Gamma_ijk = e^(G_ik - G_jk) for j <= i: ``(P, dq, dk)`` with
    P_ij = scale sum_k q_ik k_jk Gamma_ijk, dq_ik = scale sum_j dP_ij Gamma_ijk k_jk, dk_jk = scale sum_i dP_ij
    Gamma_ijk q_ik (q, k [N, L, K] fp32, dP [N, L, L] lower, or None for P alone, G [N, L, K]). By ``block``-token
    row blocks: a block I against the earlier tokens takes its first token r as reference, Gamma = e^(G_i - G_r)
    e^(G_r - G_j) with both factors at most 1 (G does not increase along the chunk), so those parts are matrix
    products; the diagonal blocks take their pair factors whole. Exact for any gate: a factor only underflows where
    the true product does."""
    L = q.shape[1]
    P = q.new_zeros(q.shape[0], L, L)
    dq, dk = torch.zeros_like(q), torch.zeros_like(k)
    for i0 in range(0, L, block):
        rows = slice(i0, min(i0 + block, L))
        gamma = _pair_factors(G[:, rows], strict=False)  # [N, b, b, K]
        q_r, k_r = q[:, rows], k[:, rows]
        P[:, rows, rows] = scale * torch.einsum("nik,njk,nijk->nij", q_r, k_r, gamma)
        if dP is not None:
            dP_rr = dP[:, rows, rows]
            dq[:, rows] += scale * torch.einsum("nij,nijk,njk->nik", dP_rr, gamma, k_r)
            dk[:, rows] += scale * torch.einsum("nij,nijk,nik->njk", dP_rr, gamma, q_r)
        if i0 == 0:
            continue
        ref = G[:, i0 : i0 + 1]
        q_e = q_r * torch.exp(G[:, rows] - ref)  # the rows' factors to the reference
        f = torch.exp(ref - G[:, :i0])  # the reference's to each earlier token
        k_f = k[:, :i0] * f
        P[:, rows, :i0] = scale * q_e @ k_f.transpose(1, 2)
        if dP is not None:
            dP_rc = dP[:, rows, :i0]
            dq[:, rows] += scale * torch.exp(G[:, rows] - ref) * (dP_rc @ k_f)
            dk[:, :i0] += scale * f * (dP_rc.transpose(1, 2) @ q_e)
    return P, dq, dk


# the lowest natural-log gate two_reference_products takes: FLA's KDA safe_gate bound, under which no operand's factor
# passes e^(16 x 5) < 2^116
BOUNDED_GATE = -5.0


def two_reference_products(x, k, dM, G, scale, operand=_exact, dtype=torch.float64) -> tuple[torch.Tensor, ...]:
    """:func:`key_gated_products`'s ``(P, dx, dk)`` (x in q's place) for a gate bounded below by
    :data:`BOUNDED_GATE` (``dM`` None: P alone), by plain matrix products: the columns j split into two halves with
    reference tokens r at their middles (16 and 48 in a chunk of 64), L_i = x_i e^(G_i - G_r) (rows before the half
    zero) and R_j = k_j e^(G_r - G_j) (the half's columns), their factors at most e^80 for the tokens within 16 of r,
    below 1 after. Per half: P = L R^T on the mask j <= i (a select: a masked product may overflow), dx =
    e^(G - G_r) (dM R) on the rows in or after the half, dk = e^(G_r - G) (dM^T L) on the half's columns. A gradient
    product's sum reaches e^80 |dM| |x| before its factor brings it back, past fp32's range (e^88.7) once |dM| |x| is
    in the hundreds: the products run in ``dtype`` (fp64 by default; the per-chunk kernel's plan takes fp32, its
    accumulators') and return in x's. ``operand``: what L, R and dM go through before their products
    (:func:`~cula.ops.chunk_emulation.bf16` for a kernel's wgmma operands)."""
    r = operand
    out_dtype = x.dtype
    x, k, G = (t.to(dtype) for t in (x, k, G))
    L = x.shape[1]
    half = L // 2
    idx = torch.arange(L, device=x.device)
    P, dx, dk = x.new_zeros(x.shape[0], L, L), torch.zeros_like(x), torch.zeros_like(k)
    dM = None if dM is None else r(dM.to(dtype))
    for h in range(2):
        ref = h * half + half // 2
        rows, cols = (idx >= h * half)[:, None], ((idx >= h * half) & (idx < (h + 1) * half))[:, None]
        to_ref, from_ref = torch.exp(G - G[:, ref : ref + 1]), torch.exp(G[:, ref : ref + 1] - G)
        left = r(torch.where(rows, x * to_ref, 0.0))
        right = r(torch.where(cols, k * from_ref, 0.0))
        P = P + left @ right.transpose(1, 2)
        if dM is not None:
            dx = dx + torch.where(rows, to_ref * (dM @ right), 0.0)
            dk = dk + torch.where(cols, from_ref * (dM.transpose(1, 2) @ left), 0.0)
    P = torch.where(_causal(L, False, x.device), scale * P, 0.0)
    return P.to(out_dtype), (scale * dx).to(out_dtype), (scale * dk).to(out_dtype)


def chunk_gradients(q, k, v, do, g, S, dS_end, scale) -> tuple[torch.Tensor, ...]:
    """Passes 3 and 4 on one chunk (q, k [H, L, K], v, do [H, L, V], g [H, L, K] floored; S its start state, dS_end
    the gradient at its end): ``(dq, dk, dv, dg)``; the intra-chunk products by :func:`key_gated_products`."""
    L = q.shape[1]
    G, G_L = _chunk_gates(g, 0, L)
    q, k, v, do = bf16(q), bf16(k), bf16(v), bf16(do)
    dP = torch.where(_causal(L, False, q.device), do @ v.transpose(1, 2), 0.0)
    P, dq_intra, dk_intra = key_gated_products(q, k, dP, G, scale)
    P = bf16(P)
    dq = scale * torch.exp(G) * (do @ bf16(S).transpose(1, 2)) + dq_intra
    dS_op = bf16(dS_end)
    dk_inter = torch.exp(G_L - G) * (v @ dS_op.transpose(1, 2))
    dk = dk_inter + dk_intra
    dv = bf16(k * torch.exp(G_L - G)) @ dS_op + P.transpose(1, 2) @ do
    local = q * dq - k * dk
    constant = (k * dk_inter).sum(1, keepdim=True) + torch.exp(G_L) * (bf16(S) * dS_op).sum(-1)[:, None, :]
    dg = local.flip(1).cumsum(1).flip(1) + constant
    return dq, dk, dv, dg


def gated_backward(q, k, v, g, do, scale, h0=None, dht=None) -> dict[str, torch.Tensor]:
    """The four passes on one sequence: ``{"dq", "dk", "dv", "dg" (g's shape), "dh0"}`` in fp32."""
    H, T, K = q.shape
    per_key = g.dim() == 3
    g_raw = (g if per_key else g[..., None].expand(H, T, K)).float()
    gk = g_raw.clamp_min(GATE_FLOOR)
    starts, _ = state_walk(k, v, gk, h0)
    ends, dh0 = state_gradient_walk(q, do, gk, scale, dht)
    names = ("dq", "dk", "dv", "dg")
    grads = {name: [] for name in names}
    for c, c0 in enumerate(range(0, T, CHUNK)):
        part = slice(c0, c0 + CHUNK)
        chunk = chunk_gradients(q[:, part], k[:, part], v[:, part], do[:, part], gk[:, part], starts[c], ends[c], scale)
        for name, x in zip(names, chunk, strict=True):
            grads[name].append(x)
    out = {name: torch.cat(parts, dim=1) for name, parts in grads.items()}
    dg = torch.where(g_raw < GATE_FLOOR, 0.0, out["dg"])
    out["dg"] = dg if per_key else dg.sum(-1)
    out["dh0"] = dh0
    return out


def checkpoint_rows(offsets: list[int], fixed_length: bool, chunk: int = CHUNK) -> list[int]:
    """The first checkpoint row of each sequence (``offsets`` its token offsets in the flattened batch), as the
    state walks number them (:func:`cula.sm90.sequence.checkpoint_row`) with chunks of C = ``chunk``:
    ``n ceil(T / C)`` for fixed-length batch rows, ``offsets[n] // C + n`` for varlen sequences (distinct rows,
    within ``T // C + N``)."""
    if fixed_length:
        per_row = -(-(offsets[1] - offsets[0]) // chunk)
        return [n * per_row for n in range(len(offsets) - 1)]
    return [o // chunk + n for n, o in enumerate(offsets[:-1])]


class ChunkRows(NamedTuple):
    """A batch layout's chunk rows (:func:`chunk_rows`): ``index`` [rows, C] int64, the flattened token of each place
    of each checkpoint row (or the number of tokens: past a sequence's end, and in rows no chunk takes); ``rows``;
    and ``kernel_rows`` [rows, 2] int32, the per-chunk gradient kernels' view of them (:func:`kernel_chunk_rows`)."""

    index: torch.Tensor
    rows: int
    kernel_rows: torch.Tensor


def chunk_rows(offsets: list[int], fixed_length: bool, device=None, chunk: int = CHUNK) -> ChunkRows:
    """The chunk rows (:class:`ChunkRows`) of the checkpoint rows as the state walks number them, with C = ``chunk``.
    Made on the host without a loop over chunks (the host cost of a call with thousands of them), then copied to
    ``device``; kept for the last few batches' offsets (a model's layers, and every step of a fixed-length training
    run, ask for the same): callers only read them."""
    return _chunk_rows(None if device is None else str(device), tuple(offsets), fixed_length, chunk)


@runtime.device_plan_cache(maxsize=16)
def _chunk_rows(device, offsets: tuple[int, ...], fixed_length: bool, chunk: int) -> ChunkRows:
    n_tokens = offsets[-1]
    bounds = torch.tensor(offsets, dtype=torch.long)
    lengths = bounds[1:] - bounds[:-1]
    chunks = (lengths + chunk - 1) // chunk
    firsts = torch.tensor(checkpoint_rows(offsets, fixed_length, chunk), dtype=torch.long)
    rows = int((firsts[-1] + chunks[-1]).item()) if len(firsts) else 0
    index = torch.full((max(rows, 1), chunk), n_tokens, dtype=torch.long)
    sequence = torch.repeat_interleave(torch.arange(len(chunks)), chunks)  # each chunk's sequence
    place = torch.arange(len(sequence)) - torch.repeat_interleave(torch.cumsum(chunks, 0) - chunks, chunks)
    tokens = bounds[sequence, None] + place[:, None] * chunk + torch.arange(chunk)  # [chunks, C]
    index[firsts[sequence] + place] = torch.where(tokens < bounds[sequence + 1, None], tokens, n_tokens)
    kernel_rows = kernel_chunk_rows(index, n_tokens)
    return ChunkRows(runtime.host_to_device(index, device), rows, runtime.host_to_device(kernel_rows, device))


def kernel_chunk_rows(index: torch.Tensor, n_tokens: int) -> torch.Tensor:
    """The per-chunk gradient kernels' view of the chunk rows ``index`` (:class:`ChunkRows`): each row's first
    token in the flattened (B T) axis and its number of tokens (0: no chunk), ``[rows, 2]`` int32."""
    valid = (index < n_tokens).sum(1)
    first = torch.where(valid > 0, index[:, 0], 0)
    return torch.stack([first, valid], 1).to(torch.int32).contiguous()


def scalar_gated_rows(q, k, v, do, g, S, dS_end, scale) -> tuple[torch.Tensor, ...]:
    """Passes 3 and 4 for a scalar gate without the delta rule (simple GLA, Lightning), batched, with the roundings
    of their kernels (:mod:`cula.sm90.scalar_chunk_bwd`, :mod:`cula.sm100.scalar_chunk_bwd`: P and scale dP Gamma as
    bf16 operands, the inter parts' factors on their fp32 products): q, k, v, do
    [N, C, D] (zero past a sequence's end), g [N, C] floored (zero past the end), S and dS_end [N, K, V], N = chunks x
    heads. Returns ``(dq, dk, dv [N, C, D], dg [N, C])`` in fp32 (the gradient of each token's gate)."""
    C = q.shape[1]
    G = g.float().cumsum(1)
    G_L = G[:, -1:]
    lower = _causal(C, False, q.device)
    gamma = _pair_factors(G, strict=False)
    q, k, v, do, S, dS = (x.float() for x in (q, k, v, do, S, dS_end))
    P = bf16(scale * (q @ k.transpose(1, 2)) * gamma)
    dP_gamma = bf16(scale * torch.where(lower, do @ v.transpose(1, 2), 0.0) * gamma)  # scale dP Gamma
    to_end = torch.exp(G_L - G)[..., None]
    dq = scale * torch.exp(G)[..., None] * (do @ S.transpose(1, 2)) + dP_gamma @ k
    dk_inter = to_end * (v @ dS.transpose(1, 2))
    dk = dk_inter + dP_gamma.transpose(1, 2) @ q
    dv = to_end * (k @ dS) + P.transpose(1, 2) @ do
    local = (q * dq - k * dk).sum(-1)
    constant = (k * dk_inter).sum((1, 2)) + torch.exp(G_L[:, 0]) * (S * dS).sum((1, 2))
    dg = local.flip(1).cumsum(1).flip(1) + constant[:, None]
    return dq, dk, dv, dg


def delta_chunk_forward(q, k, v, beta, g, S, scale, operand=_exact) -> dict[str, torch.Tensor]:
    """The delta rule's chunk (GDN, KDA; g [H, L, K] per key, floored) from its start state S [H, K, V]: the WY
    form's pieces the backward reads, with the output and the end state. Pair factors are selects of
    e^(G_i - G_j), never e^-G alone (which overflows on steep gates). ``operand``: what every product's operands go
    through (:func:`~cula.ops.chunk_emulation.bf16` for the kernels' wgmma operands; exact by default)."""
    r = operand
    G = torch.cumsum(g, dim=1)
    E, G_L = torch.exp(G), G[:, -1:]
    to_end = torch.exp(G_L - G)
    gamma_a, gamma_p = _pair_factors(G, strict=True), _pair_factors(G, strict=False)
    A = beta[..., None] * torch.einsum("hik,hjk,hijk->hij", r(k), r(k), gamma_a)
    eye = torch.eye(q.shape[1], dtype=q.dtype, device=q.device)
    Tinv = torch.linalg.solve_triangular(eye + A, eye.expand_as(A), upper=False)
    W = r(Tinv) @ r(beta[..., None] * k * E)
    U = r(Tinv) @ r(beta[..., None] * v)
    v_new = U - r(W) @ r(S)
    P = scale * torch.einsum("hik,hjk,hijk->hij", r(q), r(k), gamma_p)
    o = scale * r(q * E) @ r(S) + r(P) @ r(v_new)
    S_end = torch.exp(G_L).transpose(1, 2) * S + r(k * to_end).transpose(1, 2) @ r(v_new)
    return dict(G=G, E=E, to_end=to_end, gamma_a=gamma_a, gamma_p=gamma_p, A=A, Tinv=Tinv, W=W, v_new=v_new, P=P, o=o,
                S_end=S_end)  # fmt: skip


def delta_chunk_backward(q, k, v, beta, f, S, dS_end, do, scale, operand=_exact) -> dict[str, torch.Tensor]:
    """The delta rule's chunk backward from its forward pieces ``f`` (:func:`delta_chunk_forward`), its start
    state S, the gradient dS_end of its end state and dO: ``dq, dk, dv, dbeta, dG`` (the gradient of the chunk's
    cumulative gate, per key) and ``dS`` (of its start state: the reverse walk's step).

        dV_new = P^T dO + (K e^(G_L - G)) dS_end
        dS     = e^G_L dS_end + scale (Q e^G)^T dO - W^T dV_new
        dW = -dV_new S^T, dU = dV_new; W = T diag(beta) (K e^G), U = T diag(beta) V with T = (I + A)^-1:
        dT = dW (beta K e^G)^T + dU (beta V)^T, dA = -T^T dT T^T on A's strict lower triangle.

    Every pair factor e^(G_i - G_j) passes its gradient to G_i and minus it to G_j; the end factors e^(G_L - G_j)
    and the state's decay e^G_L pass theirs to the last row (G_L). ``operand`` as :func:`delta_chunk_forward`."""
    r = operand
    G, E, to_end, Tinv, W, v_new = f["G"], f["E"], f["to_end"], f["Tinv"], f["W"], f["v_new"]
    gamma_a, gamma_p = f["gamma_a"], f["gamma_p"]
    strict = _causal(q.shape[1], True, q.device)
    G_L = G[:, -1:]
    dv_new = r(f["P"]).transpose(1, 2) @ r(do) + r(k * to_end) @ r(dS_end)
    dS = (
        torch.exp(G_L).transpose(1, 2) * dS_end
        + scale * r(q * E).transpose(1, 2) @ r(do)
        - r(W).transpose(1, 2) @ r(dv_new)
    )
    # O = scale (Q e^G) S + P V_new
    dq_gated = scale * r(do) @ r(S).transpose(1, 2)
    dP = scale * (r(do) @ r(v_new).transpose(1, 2))
    pair_p = torch.einsum("hij,hik,hjk,hijk->hijk", dP, q, k, gamma_p)
    dq = dq_gated * E + torch.einsum("hij,hijk,hjk->hik", r(dP), gamma_p, r(k))
    dk = torch.einsum("hij,hijk,hik->hjk", r(dP), gamma_p, r(q))
    dG = dq_gated * q * E + pair_p.sum(2) - pair_p.sum(1)
    # S_end = e^G_L S + (K e^(G_L - G))^T V_new
    through_end = r(v_new) @ r(dS_end).transpose(1, 2)
    end_term = k * to_end * through_end
    dk = dk + to_end * through_end
    dG = dG - end_term
    dG_last = end_term.sum(1) + torch.exp(G_L[:, 0]) * (r(S) * r(dS_end)).sum(-1)
    # V_new = U - W S
    dW, dU = -r(dv_new) @ r(S).transpose(1, 2), dv_new
    bk, bv = beta[..., None] * k * E, beta[..., None] * v
    dT = r(dW) @ r(bk).transpose(1, 2) + r(dU) @ r(bv).transpose(1, 2)
    d_bk, d_bv = r(Tinv).transpose(1, 2) @ r(dW), r(Tinv).transpose(1, 2) @ r(dU)
    dA = torch.where(strict, -(r(Tinv).transpose(1, 2) @ r(r(dT) @ r(Tinv).transpose(1, 2))), 0.0)
    # A_ij = beta_i sum_k k_ik k_jk e^(G_ik - G_jk), j < i
    kk = torch.einsum("hik,hjk,hijk->hij", r(k), r(k), gamma_a)
    dbeta = (dA * kk).sum(-1) + (d_bk * k * E).sum(-1) + (d_bv * v).sum(-1)
    dA_b = beta[..., None] * dA
    pair_a = torch.einsum("hij,hik,hjk,hijk->hijk", dA_b, k, k, gamma_a)
    dk = (
        dk
        + torch.einsum("hij,hijk,hjk->hik", r(dA_b), gamma_a, r(k))
        + torch.einsum("hij,hijk,hik->hjk", r(dA_b), gamma_a, r(k))
    )
    dG = dG + pair_a.sum(2) - pair_a.sum(1)
    dk = dk + beta[..., None] * d_bk * E
    dG = dG + beta[..., None] * d_bk * k * E
    dv = beta[..., None] * d_bv
    dG[:, -1] = dG[:, -1] + dG_last
    return dict(dq=dq, dk=dk, dv=dv, dbeta=dbeta, dG=dG, dS=dS)


def delta_backward(q, k, v, beta, g, do, scale, h0=None, dht=None, operand=_exact) -> dict[str, torch.Tensor]:
    """The delta rule's backward on one sequence (shapes as :func:`gated_backward`, beta [H, T]; g [H, T] for GDN or
    [H, T, K] for KDA, natural log): the forward walk keeps each chunk's start state, the reverse walk carries dS
    and makes each chunk's gradients from its recomputed WY pieces. ``{"dq", "dk", "dv", "dbeta", "dg", "dh0"}``,
    and the walks' ``"starts"`` (each chunk's start state), ``"ends"`` (the gradient at each chunk's end) and
    ``"final"`` (the final state); ``operand`` as :func:`delta_chunk_forward`."""
    H, T, K = q.shape
    per_key = g.dim() == 3
    g_raw = g if per_key else g[..., None].expand(H, T, K)
    gk = g_raw.clamp_min(GATE_FLOOR)
    S = q.new_zeros(H, K, v.shape[-1]) if h0 is None else h0.clone()
    bounds = [(c0, min(c0 + CHUNK, T)) for c0 in range(0, T, CHUNK)]
    starts = []
    for c0, c1 in bounds:
        starts.append(S)
        x = (q[:, c0:c1], k[:, c0:c1], v[:, c0:c1], beta[:, c0:c1], gk[:, c0:c1])
        S = delta_chunk_forward(*x, S, scale, operand)["S_end"]
    dS = torch.zeros_like(S) if dht is None else dht.clone()
    parts = {name: [None] * len(bounds) for name in ("dq", "dk", "dv", "dbeta", "dg")}
    ends = [None] * len(bounds)
    for c in reversed(range(len(bounds))):
        c0, c1 = bounds[c]
        x = (q[:, c0:c1], k[:, c0:c1], v[:, c0:c1], beta[:, c0:c1])
        f = delta_chunk_forward(*x, gk[:, c0:c1], starts[c], scale, operand)
        ends[c] = dS
        grads = delta_chunk_backward(*x, f, starts[c], dS, do[:, c0:c1], scale, operand)
        dS = grads["dS"]
        for name in ("dq", "dk", "dv", "dbeta"):
            parts[name][c] = grads[name]
        parts["dg"][c] = grads["dG"].flip(1).cumsum(1).flip(1)
    out = {name: torch.cat(chunks, dim=1) for name, chunks in parts.items()}
    dg = torch.where(g_raw < GATE_FLOOR, 0.0, out["dg"])
    out["dg"] = dg if per_key else dg.sum(-1)
    out["dh0"] = dS
    out["starts"], out["ends"], out["final"] = starts, ends, S  # the walks' states (as the kernels checkpoint them)
    return out


def scalar_delta_rows(q, k, v, beta, g, S, dS_end, do, scale, operand=_exact) -> tuple[torch.Tensor, ...]:
    """The delta rule's per-chunk gradients for a scalar gate (GDN), batched: :func:`delta_chunk_forward` and
    :func:`delta_chunk_backward` with the pair factors e^(G_i - G_j) shared by every key, so that each score is one
    (C x C) matrix. q, k [N, C, K], v, do [N, C, V], beta and g [N, C] (floored; zero past a sequence's end), S and
    dS_end [N, K, V] (each chunk's start state and the gradient of its end state), N = chunks x heads. Returns
    ``(dq, dk, dv, dbeta, dg)``, dg the gradient of each token's gate (the chunk's reversed cumulative sum)."""
    r = operand
    C = q.shape[1]
    G = torch.cumsum(g, dim=1)
    G_L = G[:, -1:]
    E, to_end = torch.exp(G)[..., None], torch.exp(G_L - G)[..., None]
    gamma_a, gamma_p = _pair_factors(G, strict=True), _pair_factors(G, strict=False)
    b = beta[..., None]
    kk = r(k) @ r(k).transpose(1, 2)
    qk = r(q) @ r(k).transpose(1, 2)
    eye = torch.eye(C, dtype=q.dtype, device=q.device)
    A = b * kk * gamma_a
    Tinv = torch.linalg.solve_triangular(eye + A, eye.expand_as(A), upper=False)
    W = r(Tinv) @ r(b * k * E)
    v_new = r(Tinv) @ r(b * v) - r(W) @ r(S)
    P = scale * qk * gamma_p
    dv_new = r(P).transpose(1, 2) @ r(do) + r(k * to_end) @ r(dS_end)
    dq_gated = scale * r(do) @ r(S).transpose(1, 2)
    dP = scale * (r(do) @ r(v_new).transpose(1, 2))
    pair_p = dP * qk * gamma_p
    dq = dq_gated * E + r(dP * gamma_p) @ r(k)
    dk = r(dP * gamma_p).transpose(1, 2) @ r(q)
    dG = (dq_gated * q * E).sum(-1) + pair_p.sum(2) - pair_p.sum(1)
    through_end = r(v_new) @ r(dS_end).transpose(1, 2)
    end_term = (k * to_end * through_end).sum(-1)
    dk = dk + to_end * through_end
    dG = dG - end_term
    dG_last = end_term.sum(1) + torch.exp(G_L[:, 0]) * (r(S) * r(dS_end)).sum((1, 2))
    dW = -r(dv_new) @ r(S).transpose(1, 2)
    dT = r(dW) @ r(b * k * E).transpose(1, 2) + r(dv_new) @ r(b * v).transpose(1, 2)
    d_bk, d_bv = r(Tinv).transpose(1, 2) @ r(dW), r(Tinv).transpose(1, 2) @ r(dv_new)
    dA = torch.where(_causal(C, True, q.device), -(r(Tinv).transpose(1, 2) @ r(r(dT) @ r(Tinv).transpose(1, 2))), 0.0)
    dbeta = (dA * kk * gamma_a).sum(-1) + (d_bk * k * E).sum(-1) + (d_bv * v).sum(-1)
    dA_b = b * dA * gamma_a
    pair_a = dA_b * kk
    dk = dk + r(dA_b) @ r(k) + r(dA_b).transpose(1, 2) @ r(k) + b * d_bk * E
    dG = dG + pair_a.sum(2) - pair_a.sum(1) + (b * d_bk * k * E).sum(-1)
    dG[:, -1] = dG[:, -1] + dG_last
    dv = b * d_bv
    return dq, dk, dv, dbeta, dG.flip(1).cumsum(1).flip(1)


def key_delta_rows(
    q, k, v, beta, g, S, dS_end, do, scale, products=key_gated_products
) -> tuple[torch.Tensor, ...]:  # fmt: skip
    """The delta rule's per-chunk gradients for a per-key gate (KDA), batched: :func:`delta_chunk_forward` and
    :func:`delta_chunk_backward` with every sum over a pair factor e^(G_ik - G_jk) taken by ``products``
    (:func:`key_gated_products`: matrix products against a reference token per 16-token block, the diagonal blocks
    whole, any gate; :func:`two_reference_products`: plain matrix products, gates >= :data:`BOUNDED_GATE`), never the
    [N, C, C, K] factors at once; a pair term's gradient to G is the row-side product times its row minus the
    column-side product times its column. q, k [N, C, K], v, do [N, C, V], beta [N, C], g [N, C, K] (floored; zero
    past a sequence's end), S and dS_end [N, K, V]. Returns ``(dq, dk, dv, dbeta, dg)`` as :func:`scalar_delta_rows`,
    dg [N, C, K]."""
    C = q.shape[1]
    G = torch.cumsum(g, dim=1)
    G_L = G[:, -1:]
    E, to_end = torch.exp(G), torch.exp(G_L - G)
    b = beta[..., None]
    strict = _causal(C, True, q.device)
    kk = torch.where(strict, products(k, k, None, G, 1.0)[0], 0.0)  # sum_k k_ik k_jk Gamma_ijk, j < i
    eye = torch.eye(C, dtype=q.dtype, device=q.device)
    Tinv = torch.linalg.solve_triangular(eye + b * kk, eye.expand_as(kk), upper=False)
    W = Tinv @ (b * k * E)
    v_new = Tinv @ (b * v) - W @ S
    dP = torch.where(_causal(C, False, q.device), do @ v_new.transpose(1, 2), 0.0)
    P, dq_pair, dk_pair = products(q, k, dP, G, scale)
    dv_new = P.transpose(1, 2) @ do + (k * to_end) @ dS_end
    dq_gated = scale * do @ S.transpose(1, 2)
    dq = dq_gated * E + dq_pair
    dG = dq_gated * q * E + q * dq_pair - k * dk_pair
    through_end = v_new @ dS_end.transpose(1, 2)
    dk = dk_pair + to_end * through_end
    dG = dG - k * to_end * through_end
    dG_last = (k * to_end * through_end).sum(1) + torch.exp(G_L[:, 0]) * (S * dS_end).sum(-1)
    dW = -dv_new @ S.transpose(1, 2)
    dT = dW @ (b * k * E).transpose(1, 2) + dv_new @ (b * v).transpose(1, 2)
    d_bk, d_bv = Tinv.transpose(1, 2) @ dW, Tinv.transpose(1, 2) @ dv_new
    dA = torch.where(strict, -(Tinv.transpose(1, 2) @ (dT @ Tinv.transpose(1, 2))), 0.0)
    dbeta = (dA * kk).sum(-1) + (d_bk * k * E).sum(-1) + (d_bv * v).sum(-1)
    _, dk_rows, dk_cols = products(k, k, b * dA, G, 1.0)
    dk = dk + dk_rows + dk_cols + b * d_bk * E
    dG = dG + k * dk_rows - k * dk_cols + b * d_bk * k * E
    dG[:, -1] = dG[:, -1] + dG_last
    return dq, dk, b * d_bv, dbeta, dG.flip(1).cumsum(1).flip(1)


# chunk-heads of C = 64 per batch of rows_backward: its (C x C) fp32 matrices take 16 KiB each (a batch: ~20 of them,
# 2.6 GiB), a per-key gate's diagonal-block pair factors (16 x 16 x K, key_gated_products) 128 KiB each at K = 128;
# a chunk of C = 128 counts as four, its matrices being four times larger, so that a batch takes as many bytes
CHUNK_HEAD_BATCH = {"scalar": 8192, "per_key": 2048}


def rows_backward(
    q, k, v, do, g, beta, starts, ends, index, scale, batch=None, bounded_gate=False
) -> tuple[torch.Tensor, ...]:  # fmt: skip
    """Passes 3 and 4 of every variant over the chunk rows ``index`` ([rows, C] flattened tokens,
    :class:`ChunkRows`) with the state walks' checkpoints ``starts`` / ``ends`` [rows, HV, V, K] (any dtype):
    q, k [B, T, H, K]; v, do [B, T, HV, V]; g [B, T, HV] (scalar) or [B, T, HV, K] (per key), natural log; beta
    [B, T, HV] with the delta rule, else None. Returns ``(dq, dk [B, T, H, K] summed over each GVA group,
    dv [B, T, HV, V], dg (g's shape), dbeta [B, T, HV] or None)`` in fp32; gates below the floor get no gradient.
    Rows are gathered, computed and scattered back ``batch`` chunk-heads of 64 tokens (or as many bytes of longer
    ones) at a time (:data:`CHUNK_HEAD_BATCH`), so that memory stays bounded at any length and chunk size.
    ``bounded_gate``: the caller's promise that a per-key gate with the delta rule is >= :data:`BOUNDED_GATE` (KDA's
    safe_gate), for :func:`two_reference_products` (2x faster on a CPU than the blocks every gate can take)."""
    B, T, H, K = q.shape
    HV, V = v.shape[2], v.shape[3]
    rep, n_tokens, C = HV // H, B * T, index.shape[1]
    per_key = g.dim() == 4
    batch = batch or CHUNK_HEAD_BATCH["per_key" if per_key else "scalar"]
    rows_per_batch = max(1, batch * CHUNK * CHUNK // (C * C) // HV)
    floored = g.clamp_min(GATE_FLOOR)
    flat = {
        "q": q, "k": k, "v": v, "do": do, "g": floored, "beta": beta,
    }  # fmt: skip
    flat = {n: None if x is None else x.reshape(n_tokens, *x.shape[2:]) for n, x in flat.items()}
    out = {
        "dq": q.new_zeros(n_tokens, H, K, dtype=torch.float32),
        "dk": q.new_zeros(n_tokens, H, K, dtype=torch.float32),
        "dv": q.new_zeros(n_tokens, HV, V, dtype=torch.float32),
        "dg": q.new_zeros(n_tokens, *g.shape[2:], dtype=torch.float32),
        "dbeta": None if beta is None else q.new_zeros(n_tokens, HV, dtype=torch.float32),
    }
    for r0 in range(0, index.shape[0], rows_per_batch):
        rows = index[r0 : r0 + rows_per_batch]
        R = rows.shape[0]
        valid = rows < n_tokens

        def by_row(x, rows=rows, R=R):
            """[tokens, heads, ...] -> [R x heads, C, ...] fp32, zero past every sequence's end."""
            gathered = torch.cat([x.float(), x.new_zeros(1, *x.shape[1:], dtype=torch.float32)])[rows]
            return gathered.movedim(2, 1).reshape(R * gathered.shape[2], C, *gathered.shape[3:])

        def scatter(name, x, heads, R=R, rows=rows, valid=valid):
            """[R x heads, C, ...] back to the tokens of ``out[name]`` (GVA groups summed for q and k)."""
            x = x.reshape(R, heads, C, *x.shape[2:]).movedim(1, 2)
            if name in ("dq", "dk"):
                x = x.reshape(R, C, H, rep, K).sum(3)
            out[name][rows[valid]] = x[valid]

        x = {
            "q": by_row(flat["q"].repeat_interleave(rep, dim=1)), "k": by_row(flat["k"].repeat_interleave(rep, dim=1)),
            "v": by_row(flat["v"]), "do": by_row(flat["do"]), "g": by_row(flat["g"]),
            "beta": None if beta is None else by_row(flat["beta"]),
            "S": starts[r0 : r0 + R].float().transpose(-1, -2).reshape(R * HV, K, V),
            "dS": ends[r0 : r0 + R].float().transpose(-1, -2).reshape(R * HV, K, V),
        }  # fmt: skip
        grads = _row_gradients(x, per_key, scale, bounded_gate)
        for name, grad in zip(("dq", "dk", "dv", "dbeta", "dg"), grads, strict=True):
            if grad is not None:
                scatter(name, grad, HV)
    dg = torch.where(g < GATE_FLOOR, 0.0, out["dg"].view(g.shape))
    dbeta = None if beta is None else out["dbeta"].view(B, T, HV)
    return out["dq"].view(B, T, H, K), out["dk"].view(B, T, H, K), out["dv"].view(B, T, HV, V), dg, dbeta


def _row_gradients(x: dict, per_key: bool, scale, bounded_gate: bool) -> tuple:
    """One batch of :func:`rows_backward` (``x`` its chunk-heads, heads first): ``(dq, dk, dv, dbeta or None, dg)``
    by the delta rule's passes (:func:`scalar_delta_rows`; per key :func:`key_delta_rows`) or the gated ones
    (:func:`scalar_gated_rows`; per key :func:`chunk_gradients`)."""
    delta = x["beta"] is not None
    chunk = (x["q"], x["k"], x["v"], x["beta"], x["g"], x["S"], x["dS"], x["do"], scale)
    if delta and per_key:
        return key_delta_rows(*chunk, products=two_reference_products if bounded_gate else key_gated_products)
    if delta:
        return scalar_delta_rows(*chunk)
    if per_key:
        dq, dk, dv, dg = chunk_gradients(x["q"], x["k"], x["v"], x["do"], x["g"], x["S"], x["dS"], scale)
    else:
        dq, dk, dv, dg = scalar_gated_rows(x["q"], x["k"], x["v"], x["do"], x["g"], x["S"], x["dS"], scale)
    return dq, dk, dv, None, dg
