"""Chunked fp32 reference for gated linear attention with and without the delta rule.

One driver serves GDN, KDA, GLA, simple GLA and Lightning. Per value head, with ``q~ = scale * q`` and the state
``S`` of shape ``[K, V]``:

- gate: ``S' = diag(exp(gk_t)) S diag(exp(gv_t))`` (a scalar gate is ``gk_t`` broadcast over K);
- delta rule (``beta`` given): ``u_t = beta_t * (v_t - S'^T k_t)``, ``S_t = S' + k_t u_t^T``;
- plain (``beta`` None): ``S_t = S' + k_t v_t^T``;
- output: ``o_t = S_t^T q~_t`` (the state after the update).

Within a chunk of C tokens with cumulative gate G the delta-rule updates compose into the WY/UT form
``A = tril(diag(beta) (K K^T ⊙ exp(G_i - G_j)), -1)``, ``[U | W] = (I + A)^{-1} diag(beta) [V | K ⊙ exp(G)]``,
``V_new = U - W S``, ``O = (Q~ ⊙ exp(G)) S + tril(Q~ K^T ⊙ exp(G_i - G_j)) V_new``,
``S <- exp(G_C) S + (K ⊙ exp(G_C - G))^T V_new``. The decay ``exp(G_i - G_j)`` is formed per pair (``[C, C, K]``
for a per-key gate) after masking the upper triangle, so it never overflows however strong the decay; only the
state pass loops, over chunks. A per-value gate ``gv`` or a per-value ``beta`` makes every value column an
independent recurrence: the columns are folded into the head dimension and run with V = 1.

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


def _pair_decay(G: torch.Tensor, causal: torch.Tensor) -> torch.Tensor:
    """``exp(G_i - G_j)`` for j <= i, else 0: [..., C, C] for a scalar gate G [..., C, 1], [..., C, C, K] per key."""
    if G.shape[-1] == 1:
        return (G - G.transpose(-1, -2)).masked_fill(~causal, float("-inf")).exp()
    return (G.unsqueeze(-2) - G.unsqueeze(-3)).masked_fill(~causal.unsqueeze(-1), float("-inf")).exp()


def _decayed_scores(a: torch.Tensor, b: torch.Tensor, decay: torch.Tensor) -> torch.Tensor:
    """``sum_k a_ik b_jk decay_ij(k)``: the gated score matrix [..., C, C]."""
    if decay.dim() == a.dim():
        return (a @ b.transpose(-1, -2)) * decay
    return torch.einsum("...ik,...jk,...ijk->...ij", a, b, decay)


def _chunk_scan(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor | None,
    S: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The chunked recurrence on [N, H, NT, C, *] tensors (q already scaled; g [.., C, 1] or [.., C, K]).

    ``beta`` [N, H, NT, C] or None (no delta rule); ``S`` [N, H, K, V]. Returns o [N, H, NT, C, V] and the final S.
    """
    C = q.shape[-2]
    causal = torch.ones(C, C, dtype=torch.bool, device=q.device).tril()
    G = g.cumsum(-2)
    outs = []
    for n in range(q.shape[2]):
        q_n, k_n, v_n, G_n = q[:, :, n], k[:, :, n], v[:, :, n], G[:, :, n]
        decay = _pair_decay(G_n, causal)
        eG = G_n.exp()
        if beta is not None:
            b_n = beta[:, :, n].unsqueeze(-1)
            # strictly lower part; solve_triangular(unitriangular=True) supplies the unit diagonal of I + A
            A = (_decayed_scores(k_n, k_n, decay) * b_n).tril(-1)
            rhs = torch.cat([v_n, k_n * eG], -1) * b_n
            u, w = torch.linalg.solve_triangular(A, rhs, upper=False, unitriangular=True).split(
                [v_n.shape[-1], k_n.shape[-1]], -1
            )
            v_n = u - w @ S
        outs.append((q_n * eG) @ S + _decayed_scores(q_n, k_n, decay) @ v_n)
        G_last = G_n[..., -1:, :]
        S = S * G_last.transpose(-1, -2).exp() + (k_n * (G_last - G_n).exp()).transpose(-1, -2) @ v_n
    return torch.stack(outs, 2), S


def _fold_value_columns(q, k, v, g, beta, S):
    """Turn each value column into its own head (V = 1), for a per-value gate or beta.

    Inputs are [N, T, HV, *] (g with gv already added: [N, T, HV, V or 1, Kg]); S [N, HV, K, V].
    """
    N, T, HV, V = v.shape
    q, k = (x.unsqueeze(3).expand(-1, -1, -1, V, -1).flatten(2, 3) for x in (q, k))
    if beta is not None:
        beta = (beta if beta.dim() == 4 else beta.unsqueeze(-1)).expand(N, T, HV, V).flatten(2, 3)
    S = S.movedim(-1, 2).flatten(1, 2).unsqueeze(-1)
    return q, k, v.flatten(2, 3).unsqueeze(-1), g.expand(N, T, HV, V, -1).flatten(2, 3), beta, S


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
    per_column = gv is not None or (beta is not None and beta.dim() == 4)
    if per_column:
        g = g.unsqueeze(3) + (0 if gv is None else gv.unsqueeze(-1))
        q, k, v, g, beta, S = _fold_value_columns(q, k, v, g, beta, S)

    q, k, v, g, beta = (None if x is None else _to_chunks(x, chunk_size) for x in (q, k, v, g, beta))
    o, S = _chunk_scan(q, k, v, g, beta, S)
    o = o.flatten(2, 3).movedim(1, 2)
    if per_column:
        o = o.reshape(N, T_pad, HV, V)
        S = S.squeeze(-1).unflatten(1, (HV, V)).movedim(2, -1)
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
