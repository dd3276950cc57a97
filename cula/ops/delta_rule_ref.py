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

Cost follows the tokens. Sequences are grouped by chunk count (a sequence of at most C tokens is one chunk of its
length rounded up to a power of two) and each group gathers its own tokens only, padding its last chunk with
``k = v = beta = g = 0`` steps, which leave the state untouched; a large group runs in parts. The fused-recurrent
entry points walk sequences of at most ``RECURRENT_MAX_LEN`` tokens (decode) token by token, as FLA's naive
recurrence does. Everything is differentiable by autograd and device-agnostic; fp64 inputs compute in fp64.
"""

import torch

from cula import validation
from cula.ops import context_parallel, state_pool

CHUNK_SIZE = 64
# the fused-recurrent entry points walk sequences this short token by token (decode, speculative steps)
RECURRENT_MAX_LEN = 16
# elements a part of a group may give a per-chunk tensor (the [C, C, K] decays, the states); larger groups run in
# several parts, so that memory follows one chunk per sequence of a part, not the whole batch
PART_ELEMENTS = 1 << 25


def _schedule(length: int, chunk_size: int, tokenwise: bool) -> tuple[int, int, bool]:
    """(tokens per step, steps, token by token) for a sequence of ``length`` tokens."""
    if tokenwise:
        return 1, length, True
    C = chunk_size if length > chunk_size else 1 << (length - 1).bit_length()
    return C, -(-length // C), False


def _token_index(starts, lengths, steps: int, reverse: bool, pad: int, device) -> torch.Tensor:
    """[n, steps] flat token indices of each sequence in the order the recurrence reads them (last to first if
    ``reverse``), ``pad`` past its end."""
    s = torch.tensor(starts, device=device).unsqueeze(1)
    n = torch.tensor(lengths, device=device).unsqueeze(1)
    t = torch.arange(steps, device=device)
    return torch.where(t < n, s + n - 1 - t if reverse else s + t, pad)


def _inverse(order: torch.Tensor) -> torch.Tensor:
    inverse = torch.empty_like(order)
    inverse[order] = torch.arange(order.numel(), device=order.device)
    return inverse


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


def _walk_chunks(x: dict, S: torch.Tensor, C: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The chunked recurrence over gathered inputs ``x`` (name -> [n, steps * C, HV, *]) from states ``S``
    [n, HV, K, V]. Returns o [n, steps * C, HV, V] and the final states."""
    causal = torch.ones(C, C, dtype=torch.bool, device=S.device).tril()
    strict = causal.tril(-1)
    chunks = {name: t.unflatten(1, (-1, C)).movedim(3, 1) for name, t in x.items()}  # [n, HV, steps, C, *]
    outs = []
    for i in range(chunks["q"].shape[2]):
        step = {name: t[:, :, i] for name, t in chunks.items()}
        o, S = _chunk(*(step.get(n) for n in ("q", "k", "v", "gk", "gv", "beta")), S, causal, strict)
        outs.append(o)
    return torch.stack(outs, 2).movedim(1, 3).flatten(1, 2), S


def _walk_tokens(x: dict, S: torch.Tensor, every_state: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """The recurrence token by token (FLA's naive loop) over gathered inputs ``x`` (name -> [n, steps, HV, *]) from
    states ``S`` [n, HV, K, V]. Returns o [n, steps, HV, V] and the final states, or with ``every_state`` the state
    after each step [n, steps, HV, K, V]."""
    gv, beta = x.get("gv"), x.get("beta")
    outs, states = [], []
    for t in range(x["q"].shape[1]):
        q, k, v = x["q"][:, t], x["k"][:, t], x["v"][:, t]
        S = S * x["gk"][:, t].exp().unsqueeze(-1)
        if gv is not None:
            S = S * gv[:, t].exp().unsqueeze(-2)
        u = v if beta is None else beta[:, t] * (v - (k.unsqueeze(-2) @ S).squeeze(-2))
        S = S + k.unsqueeze(-1) * u.unsqueeze(-2)
        outs.append((q.unsqueeze(-2) @ S).squeeze(-2))
        states.append(S)
    return torch.stack(outs, 1), torch.stack(states, 1) if every_state else S


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
    cu_seqlens: torch.Tensor | list[int] | None = None,
    reverse: bool = False,
    chunk_size: int = CHUNK_SIZE,
    recurrent: bool = False,
    token_states: bool = False,
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
        cu_seqlens: ``[N + 1]`` offsets (a tensor or a list) of the sequences packed in a batch of one.
        reverse: run each sequence from its last token to its first (FLA's fused_recurrent ``reverse``).
        recurrent: walk sequences of at most ``RECURRENT_MAX_LEN`` tokens token by token (the fused-recurrent ops).
        token_states: walk every sequence token by token and return the state after each token instead of the
            final states (a state pool with a slot per token).

    Returns:
        ``o`` ``[B, T, HV, V]`` in the compute dtype and the final state (same layout as ``initial_state``) or None;
        with ``token_states`` the state after every token, ``[B * T, HV, K, V]`` (same layout).
    """
    B, T, H, K = q.shape
    HV, V = v.shape[2], v.shape[3]
    if scale is None:
        scale = K**-0.5
    dtype = torch.promote_types(q.dtype, torch.float32)
    rep = HV // H
    inputs = {
        "q": q.to(dtype).repeat_interleave(rep, dim=2) * scale,
        "k": k.to(dtype).repeat_interleave(rep, dim=2),
        "v": v,
        "gk": q.new_zeros(B, T, HV, 1) if g is None else (g.unsqueeze(-1) if g.dim() == 3 else g),
        "gv": gv,
        "beta": None if beta is None else (beta.unsqueeze(-1) if beta.dim() == 3 else beta),
    }
    # tokens flattened, one zero token last: the padding of every group's last chunk
    flat = {
        name: torch.cat([x.to(dtype).flatten(0, 1), x.new_zeros(1, *x.shape[2:], dtype=dtype)])
        for name, x in inputs.items()
        if x is not None
    }
    if cu_seqlens is None:
        offsets = [b * T for b in range(B + 1)]
    else:
        offsets = [int(o) for o in (cu_seqlens.tolist() if isinstance(cu_seqlens, torch.Tensor) else cu_seqlens)]
    N = len(offsets) - 1
    if initial_state is None:
        S0 = q.new_zeros(N, HV, K, V, dtype=dtype)
    else:
        S0 = initial_state.to(dtype)
        S0 = S0.transpose(-1, -2) if state_v_first else S0

    groups: dict[tuple[int, int, bool], list[int]] = {}
    empty = []
    for n in range(N):
        length = offsets[n + 1] - offsets[n]
        if length:
            tokenwise = token_states or (recurrent and length <= RECURRENT_MAX_LEN)
            groups.setdefault(_schedule(length, chunk_size, tokenwise), []).append(n)
        else:
            empty.append(n)
    # the widest decay or solve batch per chunk: [C, C, K] per key, [C, C, V] per value column
    per_value = gv is not None or (beta is not None and beta.dim() == 4)
    width = max(flat["gk"].shape[-1], V if per_value else 1)
    # zero-length sequences: no tokens, their initial state as final state
    tokens, outs = [torch.zeros(0, dtype=torch.long, device=q.device)], [flat["v"][:0]]
    sequences, states = [empty], [S0[empty]]
    after_token = [S0.new_zeros(0, HV, K, V)]  # with token_states, in the order of ``tokens``
    for (C, steps, tokenwise), members in groups.items():
        part = max(1, PART_ELEMENTS // (HV * (C * C * width + K * V)))
        for i in range(0, len(members), part):
            ids = members[i : i + part]
            starts = [offsets[n] for n in ids]
            lengths = [offsets[n + 1] - offsets[n] for n in ids]
            idx = _token_index(starts, lengths, C * steps, reverse, B * T, q.device)
            x = {name: t[idx] for name, t in flat.items()}
            real = idx != B * T
            if token_states:
                o, every = _walk_tokens(x, S0[ids], every_state=True)
                after_token.append(every[real])
            else:
                o, S = _walk_tokens(x, S0[ids]) if tokenwise else _walk_chunks(x, S0[ids], C)
                sequences.append(ids)
                states.append(S)
            tokens.append(idx[real])
            outs.append(o[real])
    order = _inverse(torch.cat(tokens))
    o = torch.cat(outs)[order].view(B, T, HV, V)
    if token_states:
        S = torch.cat(after_token)[order]
    elif output_final_state:
        S = torch.cat(states)[_inverse(torch.tensor([n for ids in sequences for n in ids], device=q.device))]
    else:
        return o, None
    return o, (S.transpose(-1, -2) if state_v_first else S).contiguous()


def refuse_unsupported(args: dict) -> None:
    """NotImplementedError for the arguments of an entry point that change results and that the reference cannot
    honour."""
    if args.get("return_intermediate_states"):
        raise NotImplementedError("cula reference: `return_intermediate_states=True` is not supported")


def linear_attn_call(
    args: dict, q, k, g=None, gv=None, beta=None, recurrent: bool = False, reverse: bool = False
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """`linear_attn_ref` for an entry point's bound arguments ``args``: scale, states and varlen offsets (checked as
    they are read: a compiled call's validation leaves them unread) come from there, the transformed inputs from the
    caller; ``recurrent`` for the fused-recurrent entry points. Arguments that change results and that the reference
    cannot honour raise NotImplementedError (:func:`refuse_unsupported`)."""
    refuse_unsupported(args)
    cu_seqlens = args["cu_seqlens"]
    offsets = (
        None if cu_seqlens is None else validation.cu_seqlens_(cu_seqlens, *q.shape[:2], args.get("cu_seqlens_cpu"))
    )

    def run(initial_state, output_final_state, token_states=False):
        return linear_attn_ref(
            q, k, args["v"], g=g, gv=gv, beta=beta, scale=args["scale"], initial_state=initial_state,
            output_final_state=output_final_state, state_v_first=args.get("state_v_first", False),
            cu_seqlens=offsets, reverse=reverse, recurrent=recurrent, token_states=token_states,
        )  # fmt: skip

    if args.get("cp_context") is not None:

        def run_tokens(lo, hi, v, initial_state, offsets):
            part = [None if x is None else x[:, lo:hi] for x in (q, k, g, gv, beta)]
            return linear_attn_ref(
                *part[:2], v, g=part[2], gv=part[3], beta=part[4], scale=args["scale"], initial_state=initial_state,
                output_final_state=True, cu_seqlens=offsets, recurrent=recurrent,
            )  # fmt: skip

        return context_parallel.forward(args, run_tokens)
    if validation.pooled(args):
        return state_pool.serve(args, offsets, lambda h0, token_states: run(h0, True, token_states))
    return run(args["initial_state"], args["output_final_state"])
