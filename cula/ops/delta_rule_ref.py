"""Chunked fp32 reference for gated linear attention with and without the delta rule, exact for any log gate in
[-inf, 0] and causal whatever the inputs hold.

One driver serves GDN, KDA, GLA, simple GLA and Lightning. Per value head, with ``q~ = scale * q`` and the state
``S`` of shape ``[K, V]``:

- gate: ``S' = diag(exp(gk_t)) S diag(exp(gv_t))`` (a scalar gate is ``gk_t`` broadcast over K);
- delta rule (``beta`` given): ``u_t = beta_t ⊙ (v_t - S'^T k_t)``, ``S_t = S' + k_t u_t^T``;
- plain (``beta`` None): ``S_t = S' + k_t v_t^T``;
- output: ``o_t = S_t^T q~_t`` (the state after the update).

In a chunk of C tokens every decay is the exponential of a sum of gates over a range of tokens, taken as that sum
(masked cumulative sums), never as a difference of two prefix sums: with ``D_ij = sum_{j < t <= i} g_t``,
``G_i = sum_{t <= i} g_t`` and ``R_j = sum_{t > j} g_t``, the delta-rule updates compose into
``A = tril(diag(beta) (K K^T ⊙ exp(D)), -1)``, ``U = (I + A)^{-1} diag(beta) (V - (K ⊙ exp(G)) S)``,
``O = (Q~ ⊙ exp(G)) S + tril(Q~ K^T ⊙ exp(D)) U``, ``S <- exp(G_C) S + (K ⊙ exp(R))^T U``.
So a -inf gate (a full reset) gives exact zeros, and a gate of -1e30 or spikes of -1e4 lose nothing to cancellation.
A per-key gate makes ``exp(D)`` ``[C, C, K]``. A per-value gate ``gv`` brings its own ``exp(D^v)`` ``[C, C, V]``
(``exp(D + D^v) = exp(D) exp(D^v)``), and it or a per-value ``beta`` gives each value column its own ``A``: a batch
of V triangular solves, never a head per column.

Causality: the products over the tokens of a chunk are masked by selection (``torch.where``), and the two that sum
over them (the solve and ``P U``) run on their inputs with non-finite entries zeroed, the entries at and after a
non-finite one (per value column, where the recurrence is non-finite too) then set to NaN: an output never depends
on a later token, NaN and Inf included.

Everything is batched over sequences and heads, differentiable by autograd and device-agnostic. Variable-length
batches are padded per sequence with ``k = v = beta = g = 0`` steps, which leave the state untouched.
"""

import torch
import torch.nn.functional as F

from cula.ops.gates import to_compute

CHUNK_SIZE = 64


def _split_sequences(x: torch.Tensor, lengths: list[int] | None) -> list[torch.Tensor]:
    """[B, T, ...] -> list of [T_i, ...]: the batch rows, or the ``cu_seqlens`` pieces of row 0."""
    if lengths is None:
        return list(x.unbind(0))
    return list(x[0].split(lengths, 0))


def _pack(x: torch.Tensor | None, lengths: list[int] | None, T_pad: int, reverse: bool) -> torch.Tensor | None:
    """Split into sequences, optionally flip each in time, zero-pad to ``T_pad`` and stack to [N, T_pad, ...]."""
    if x is None:
        return None
    seqs = _split_sequences(x, lengths)
    if reverse:
        seqs = [s.flip(0) for s in seqs]
    return torch.stack([F.pad(s, (0, 0) * (s.dim() - 1) + (0, T_pad - s.shape[0])) for s in seqs])


def _unpack(o: torch.Tensor, lengths: list[int] | None, T: int, reverse: bool) -> torch.Tensor:
    """Inverse of ``_pack`` for the output: [N, T_pad, ...] -> [B, T, ...] (B = 1 for varlen)."""
    seqs = [o[i, :n] for i, n in enumerate(lengths)] if lengths is not None else list(o[:, :T].unbind(0))
    if reverse:
        seqs = [s.flip(0) for s in seqs]
    return torch.cat(seqs).unsqueeze(0) if lengths is not None else torch.stack(seqs)


def _to_chunks(x: torch.Tensor, C: int) -> torch.Tensor:
    """[N, T_pad, H, ...] -> [N, H, NT, C, ...]."""
    return x.unflatten(1, (x.shape[1] // C, C)).movedim(3, 1)


def _range_sums(g: torch.Tensor, strict: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """For log gates ``g`` [..., C, W]: ``D`` [..., C, C, W] with ``D[i, j] = sum_{j < t <= i} g_t`` (0 for j >= i)
    and ``R`` [..., C, W] with ``R[j] = sum_{t > j} g_t``, each a sum over its own range only."""
    inside = torch.where(strict.mT.unsqueeze(-1), g.unsqueeze(-3), 0)  # [.., j, t]: g_t where t > j
    D = inside.cumsum(-2)  # [.., j, i]
    return D.transpose(-2, -3), D[..., -1, :]


def _decays(g: torch.Tensor, causal: torch.Tensor, strict: torch.Tensor):
    """``exp(D)`` [..., C, C, W] (0 above the diagonal), ``exp(G)`` and ``exp(R)`` [..., C, W] and ``exp(G_C)``
    [..., W] for log gates ``g`` [..., C, W]."""
    D, R = _range_sums(g, strict)
    G = g.cumsum(-2)
    return torch.where(causal.unsqueeze(-1), D.exp(), 0), G.exp(), R.exp(), G[..., -1, :].exp()


def _scores(a: torch.Tensor, b: torch.Tensor, decay: torch.Tensor) -> torch.Tensor:
    """``sum_k a_ik b_jk decay_ij(k)`` [..., C, C]; ``decay`` [..., C, C, 1] (scalar gate) or [..., C, C, K]."""
    if decay.shape[-1] == 1:
        return (a @ b.mT) * decay.squeeze(-1)
    return torch.einsum("...ik,...jk,...ijk->...ij", a, b, decay)


def _finite_then_poison(fn, x: torch.Tensor) -> torch.Tensor:
    """``fn(x)`` for a ``fn`` that mixes the rows (tokens, dim -2) of ``x`` causally: run on ``x`` with non-finite
    entries zeroed (a 0 weight times NaN would reach earlier rows), then NaN from each non-finite entry down its
    column, as the recurrence gives."""
    bad = ~torch.isfinite(x)
    out = fn(torch.where(bad, 0, x))
    return torch.where(bad.cumsum(-2) > 0, float("nan"), out)


def _solve(A: torch.Tensor, rhs: torch.Tensor) -> torch.Tensor:
    """``(I + A)^{-1} rhs`` for strictly lower ``A`` [..., C, C] and ``rhs`` [..., C, V], causal in the rows: a
    non-finite row of ``A`` poisons its row and the later ones, as a non-finite entry of ``rhs`` its column."""
    bad_rows = ~torch.isfinite(A).all(-1, keepdim=True)
    A = torch.where(torch.isfinite(A), A, 0)
    rhs = torch.where(bad_rows, float("nan"), rhs)
    # solve_triangular(unitriangular=True) supplies the unit diagonal of I + A
    return _finite_then_poison(lambda x: torch.linalg.solve_triangular(A, x, upper=False, unitriangular=True), rhs)


def _chunk(q, k, v, gk, gv, beta, S, causal, strict):
    """One chunk for every (sequence, head): q, k [..., C, K]; v [..., C, V]; gk [..., C, 1 or K]; gv [..., C, V]
    or None; beta [..., C, 1 or V] or None (no delta rule); S [..., K, V]; ``causal``/``strict`` the [C, C] masks
    j <= i and j < i. Returns o [..., C, V] and the state after the chunk."""
    Ek, eGk, eRk, eGk_last = _decays(gk, causal, strict)
    Ev = eGv = None
    if gv is not None:
        Ev, eGv, eRv, eGv_last = _decays(gv, causal, strict)
    u = v
    if beta is not None:
        rhs = (k * eGk) @ S
        rhs = beta * (v - (rhs if eGv is None else rhs * eGv))
        Pkk = _scores(k, k, Ek)
        if Ev is None and beta.shape[-1] == 1:
            u = _solve(torch.where(strict, Pkk * beta, 0), rhs)
        else:
            # each value column c has its own A: beta_ic Pkk_ij exp(D^v_ijc), solved as a batch over c
            A = Pkk.unsqueeze(-1) * beta.unsqueeze(-2)
            A = torch.where(strict.unsqueeze(-1), A if Ev is None else A * Ev, 0)
            u = _solve(A.movedim(-1, -3), rhs.mT.unsqueeze(-1)).squeeze(-1).mT
    P = torch.where(causal, _scores(q, k, Ek), 0)
    o = (q * eGk) @ S
    if Ev is None:
        o = o + _finite_then_poison(lambda x: P @ x, u)
    else:
        o = o * eGv + _finite_then_poison(lambda x: torch.einsum("...ij,...ijv,...jv->...iv", P, Ev, x), u)
    S = eGk_last.unsqueeze(-1) * S
    if gv is not None:
        S = S * eGv_last.unsqueeze(-2)
        u = u * eRv
    return o, S + (k * eRk).mT @ u


def linear_attn_ref(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor | None = None,
    gv: torch.Tensor | None = None,
    beta: torch.Tensor | None = None,
    scale: float | None = None,
    initial_state: torch.Tensor | None = None,
    output_final_state: bool = False,
    state_v_first: bool = False,
    cu_seqlens: torch.Tensor | None = None,
    reverse: bool = False,
    chunk_size: int = CHUNK_SIZE,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Gated linear attention, optionally with the delta rule, in fp32 (fp64 for fp64 inputs).

    Args:
        q, k: ``[B, T, H, K]``; v: ``[B, T, HV, V]`` with ``HV % H == 0`` (value head ``hv`` reads q/k head
            ``hv // (HV // H)``).
        g: log gate per value head, ``[B, T, HV]`` (scalar) or ``[B, T, HV, K]`` (per key), or None (no decay).
        gv: log gate per value channel ``[B, T, HV, V]`` (right-multiplied), or None.
        beta: ``[B, T, HV]`` or ``[B, T, HV, V]`` for the delta rule; None for plain gated linear attention.
        scale: query scale, default ``K ** -0.5``.
        initial_state: ``[N, HV, K, V]`` (``[N, HV, V, K]`` if ``state_v_first``).
        cu_seqlens: ``[N + 1]`` offsets of the sequences packed in a batch of one.
        reverse: run each sequence from its last token to its first (FLA's fused_recurrent ``reverse``).

    Returns:
        ``o`` ``[B, T, HV, V]`` in the compute dtype and the final state (same layout as ``initial_state``) or None.
    """
    B, T, H, K = q.shape
    HV, V = v.shape[2], v.shape[3]
    if scale is None:
        scale = K**-0.5
    q, k, v = (to_compute(x) for x in (q, k, v))
    dtype = q.dtype
    q = q.repeat_interleave(HV // H, dim=2) * scale
    k = k.repeat_interleave(HV // H, dim=2)
    g = q.new_zeros(B, T, HV, 1) if g is None else to_compute(g)
    if g.dim() == 3:
        g = g.unsqueeze(-1)
    gv, beta = (None if x is None else to_compute(x) for x in (gv, beta))

    lengths = None if cu_seqlens is None else [int(n) for n in cu_seqlens.diff().tolist()]
    N = B if lengths is None else len(lengths)
    T_max = T if lengths is None else max(lengths, default=0)
    T_pad = max(chunk_size, -(-T_max // chunk_size) * chunk_size)
    q, k, v, g, gv, beta = (_pack(x, lengths, T_pad, reverse) for x in (q, k, v, g, gv, beta))

    if initial_state is None:
        S = q.new_zeros(N, HV, K, V)
    else:
        S = initial_state.to(dtype)
        S = S.transpose(-1, -2) if state_v_first else S
    if beta is not None and beta.dim() == 3:
        beta = beta.unsqueeze(-1)

    C = chunk_size
    causal = torch.ones(C, C, dtype=torch.bool, device=q.device).tril()
    strict = causal.tril(-1)
    q, k, v, g, gv, beta = (None if x is None else _to_chunks(x, C) for x in (q, k, v, g, gv, beta))
    outs = []
    for n in range(q.shape[2]):
        o_n, S = _chunk(*(None if x is None else x[:, :, n] for x in (q, k, v, g, gv, beta)), S, causal, strict)
        outs.append(o_n)
    o = torch.stack(outs, 2).flatten(2, 3).movedim(1, 2)
    o = _unpack(o, lengths, T, reverse)
    if not output_final_state:
        return o, None
    return o, (S.transpose(-1, -2) if state_v_first else S).contiguous()


def linear_attn_call(args: dict, q, k, g=None, gv=None, beta=None) -> tuple[torch.Tensor, torch.Tensor | None]:
    """`linear_attn_ref` for an entry point's bound arguments ``args``: scale, states, varlen and ``reverse`` come
    from there, the transformed inputs from the caller. Arguments that change results and that the reference
    cannot honour raise NotImplementedError."""
    if args.get("cp_context") is not None:
        raise NotImplementedError("cula reference: `cp_context` (context parallelism) is not supported")
    if args.get("return_intermediate_states"):
        raise NotImplementedError("cula reference: `return_intermediate_states=True` is not supported")
    return linear_attn_ref(
        q, k, args["v"], g=g, gv=gv, beta=beta, scale=args["scale"], initial_state=args["initial_state"],
        output_final_state=args["output_final_state"], state_v_first=args.get("state_v_first", False),
        cu_seqlens=args["cu_seqlens"], reverse=args.get("reverse", False),
    )  # fmt: skip
