"""The token-by-token forward of every variant (decode, speculative verify, FLA's ``fused_recurrent_*`` ops) as one
SIMT kernel whose gates, delta rule and state handling are compile-time choices (:class:`RecurrentConfig`).

Per token t of a sequence, with the state S (K x V, fp32 in registers), the key factor a_t (per-key gate ``gk``,
activated in the kernel from FLA's raw KDA gate when asked), the value factor c_t (per-value gate ``gv``) and the
scalar factor e_t (per-token ``g``, GDN's gate activated in the kernel when asked, times the per-head ``g_gamma``):

    S_d = diag(exp(a_t)) S diag(exp(c_t)) exp(e_t)
    u   = beta_t (v_t - S_d^T k_t)            (delta rule; else u = v_t)
    S   = S_d + k_t u^T
    o_t = scale S^T q_t = scale (S_d^T q_t + u (k_t . q_t))

so that both reductions over K (S_d^T k and S_d^T q) read the decayed state once, and k . q comes with the token's
staging (q and k L2-normalised there when asked).

A CTA holds one (sequence, value head, block of ``block_v`` value columns) with 128 threads; each thread holds
``rows`` x ``vec`` state elements (``vec`` = 4 or 8), the ``vec`` contiguous in memory so that they move as one
vector, with L = block_v / vec (K-first) or K / vec (V-first) lanes per row:

- K-first storage (``[.., K, V]``): thread t holds value columns vec (t % L) .. + vec - 1 of key rows
  t // L + (128 / L) i. The sums over K add its rows, then the lanes of its column (shuffles), then the four warps
  (shared memory).
- V-first storage (``[.., V, K]``): thread t holds key columns vec (t % L) .. + vec - 1 of value rows
  t // L + (128 / L) i. The sums over K add its vec elements, then the L lanes of its row (shuffles).

States: read from ``h0[slot]`` (an initial-state tensor, slot = sequence, or a pool: slot = ``indices[n, 0]``, or
``indices[n, accepted[n] - 1]``; a negative slot is padding: its outputs are zeros and nothing is written), written
to ``ht[n]`` (fp32) or back to the pool in place: after the last token to the read slot, or after each token t to
``indices[n, t]`` where that is not negative (``token_slots``, for a verify's rollback).

Shapes: q, k [B, T, H, K]; v, o [B, T, HV, V]; g, beta [B, T, HV]; gk [B, T, HV, K]; gv [B, T, HV, V]; g_gamma and
A_log [HV]; dt_bias [HV] (GDN) or [HV * K] (KDA); h0 [slots, HV, K, V] and ht [N, HV, K, V] as (K, V) views of their
storage; indices [N, S] and accepted [N] int32 / int64; cu_seqlens [N + 1] (varlen: B == 1). GVA: value head hv
reads q/k head hv // (HV / H). Unused tensors are small dummies that the kernel does not read.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import NamedTuple

import cutlass
import cutlass.cute as cute

from cula.ops.gates import L2NORM_EPS

THREADS = 128
WARPS = THREADS // 32
BLOCK_V_CHOICES = (32, 64, 128)  # value columns (K-first) or value rows (V-first) per CTA
VEC_CHOICES = (4, 8)  # contiguous state elements per thread and row, moved as one vector
SUPPORTED_DIMS = (64, 128)
SOFTPLUS_THRESHOLD = 20.0  # torch's softplus: x itself above it

DTYPES = {
    "bfloat16": cutlass.BFloat16,
    "float16": cutlass.Float16,
    "float32": cutlass.Float32,
    "int32": cutlass.Int32,
    "int64": cutlass.Int64,
}
G_KINDS = ("none", "log", "gdn")  # per-token scalar gate: absent, a log gate, GDN's -exp(A_log) softplus(g + dt_bias)
GK_KINDS = ("none", "log", "kda_softplus", "kda_sigmoid")  # per-key gate; KDA's two in-kernel forms
BETA_KINDS = ("none", "one", "given")  # no delta rule; the delta rule with beta = 1 (GDN without beta); given
FINALS = ("none", "ht", "inplace")


@dataclass(frozen=True)
class RecurrentConfig:
    """The kernel's compile-time choices; dtypes by torch name."""

    head_k: int = 128
    head_v: int = 128
    state_v_first: bool = False
    io_dtype: str = "bfloat16"  # q, k, v and o
    state_dtype: str = "float32"  # h0 (the pool)
    g: str = "none"
    g_dtype: str = "float32"
    gamma: bool = False
    gk: str = "none"
    gk_dtype: str = "float32"
    gv: bool = False
    gv_dtype: str = "float32"
    beta: str = "none"
    beta_dtype: str = "float32"
    beta_sigmoid: bool = False
    neg_eigval: bool = False  # beta doubled after its sigmoid (FLA's allow_neg_eigval)
    qk_l2norm: bool = False
    is_varlen: bool = False
    cu_dtype: str = "int32"
    has_initial_state: bool = False
    indices: str = "none"  # the pool's slot table's dtype, or none (slot = sequence)
    accepted: str = "none"  # num_accepted_tokens' dtype, or none
    token_slots: bool = False
    final: str = "none"
    block_v: int = 32
    vec: int = 4

    def __post_init__(self):
        assert self.head_k in SUPPORTED_DIMS and self.head_v in SUPPORTED_DIMS, self
        assert self.g in G_KINDS and self.gk in GK_KINDS and self.beta in BETA_KINDS and self.final in FINALS, self
        assert self.beta != "none" or not (self.beta_sigmoid or self.qk_l2norm), self
        assert self.indices == "none" or self.has_initial_state, self
        assert not self.token_slots or (self.final == "inplace" and self.indices != "none"), self
        assert self.accepted == "none" or self.indices != "none", self
        assert self.block_v in BLOCK_V_CHOICES and self.block_v <= self.head_v, self
        assert self.vec in VEC_CHOICES, self

    @property
    def delta_rule(self) -> bool:
        return self.beta != "none"


class Tensors(NamedTuple):
    """The launch's tensors (shapes in the module docstring); those a configuration does not use are small dummies."""

    q: cute.Tensor
    k: cute.Tensor
    v: cute.Tensor
    o: cute.Tensor
    g: cute.Tensor
    gamma: cute.Tensor
    gk: cute.Tensor
    gv: cute.Tensor
    beta: cute.Tensor
    a_log: cute.Tensor
    dt_bias: cute.Tensor
    h0: cute.Tensor
    ht: cute.Tensor
    indices: cute.Tensor
    accepted: cute.Tensor
    cu_seqlens: cute.Tensor


class Staging(NamedTuple):
    """The CTA's shared buffers, double-buffered by token parity (the last mode): the token's q, k (raw) and key
    factors exp(a_t) (K, 2); per warp the sums of q^2, k^2 and q k (WARPS, 3, 2); K-first, per warp, the partial
    S_d^T k | S_d^T q of the block's columns (WARPS, 2, block_v, 2)."""

    q: cute.Tensor
    k: cute.Tensor
    key_factors: cute.Tensor
    sums: cute.Tensor
    partials: cute.Tensor


class Token(NamedTuple):
    """One token's values for a step: where it is (batch row, token, parity), q's and k's norm factors and k . q
    after them, the scalar decay, beta, and this thread's values and raw value gates (:meth:`RecurrentFwd.token_values`)."""

    b: object
    tok: object
    par: object
    rq: object
    rk: object
    kq: object
    decay: object
    beta: object
    values: cute.Tensor
    value_gates: cute.Tensor


class HeadGates(NamedTuple):
    """The value head's constants of the scalar gate: exp(A_log) and dt_bias of GDN's activation, and g_gamma."""

    rate: object
    bias: object
    gamma: object


class RecurrentFwd:
    """One CTA per (value block, value head, sequence), :data:`THREADS` threads (module docstring)."""

    def __init__(self, config: RecurrentConfig):
        self.cfg = config
        self.K, self.V = config.head_k, config.head_v
        self.block_v = config.block_v
        self.vec = config.vec
        if config.state_v_first:
            self.lanes_per_row = self.K // self.vec  # the lanes that share one value row
        else:
            self.lanes_per_row = self.block_v // self.vec  # the lanes of one key row's value block
        self.row_step = THREADS // self.lanes_per_row
        # the xor distances between the lanes of a value row (V-first), of a value column (K-first)
        self.row_shuffles = tuple(1 << j for j in reversed(range(self.lanes_per_row.bit_length() - 1)))
        self.column_shuffles = tuple(d for d in (1, 2, 4, 8, 16) if d >= self.lanes_per_row)
        rows_total = self.block_v if config.state_v_first else self.K
        self.rows = rows_total // self.row_step  # state rows per thread

    # ---------------------------------------------------------------- host side
    @cute.jit
    def __call__(
        self, q, k, v, o, g, gamma, gk, gv, beta, a_log, dt_bias, h0, ht, indices, accepted, cu_seqlens,
        scale: cutlass.Float32, lower_bound: cutlass.Float32, stream,
    ):  # fmt: skip
        HV = v.shape[2]
        N = cu_seqlens.shape[0] - 1 if cutlass.const_expr(self.cfg.is_varlen) else q.shape[0]
        tensors = Tensors(q, k, v, o, g, gamma, gk, gv, beta, a_log, dt_bias, h0, ht, indices, accepted, cu_seqlens)
        self.kernel(tensors, scale, lower_bound).launch(
            grid=(self.V // self.block_v, HV, N), block=(THREADS, 1, 1), stream=stream
        )

    # ---------------------------------------------------------------- device side
    @cute.kernel
    def kernel(self, t: Tensors, scale: cutlass.Float32, lower_bound: cutlass.Float32):
        cfg = self.cfg
        K = self.K
        f32 = cutlass.Float32
        tidx, _, _ = cute.arch.thread_idx()
        vblk, hv, n = cute.arch.block_idx()
        warp = tidx // 32
        lane = tidx % 32
        HV = t.v.shape[2]
        h = hv // (HV // t.q.shape[2])

        # the sequence: batch row, first token, length
        b = n
        tok0 = cutlass.Int32(0)
        seqlen = cutlass.Int32(t.q.shape[1])
        if cutlass.const_expr(cfg.is_varlen):
            b = cutlass.Int32(0)
            tok0 = cutlass.Int32(t.cu_seqlens[n])
            seqlen = cutlass.Int32(t.cu_seqlens[n + 1]) - tok0
        # the state's slot: the sequence, or the pool's table entry (negative: padding)
        slot = cutlass.Int64(n)
        if cutlass.const_expr(cfg.indices != "none"):
            col = cutlass.Int32(0)
            if cutlass.const_expr(cfg.accepted != "none"):
                col = cutlass.Int32(t.accepted[n]) - 1
            slot = cutlass.Int64(t.indices[n, col])
        live = slot >= 0

        smem = cutlass.memory.SmemAllocator()
        staged = Staging(
            smem.allocate_tensor(f32, cute.make_layout((K, 2)), byte_alignment=16),
            smem.allocate_tensor(f32, cute.make_layout((K, 2)), byte_alignment=16),
            smem.allocate_tensor(f32, cute.make_layout((K, 2)), byte_alignment=16),
            smem.allocate_tensor(f32, cute.make_layout((WARPS, 3, 2)), byte_alignment=16),
            smem.allocate_tensor(f32, cute.make_layout((WARPS, 2, self.block_v, 2)), byte_alignment=16),
        )

        state = cute.make_rmem_tensor(cute.make_layout((self.rows, self.vec), stride=(self.vec, 1)), f32)
        state.fill(0.0)
        if cutlass.const_expr(cfg.has_initial_state):
            if live:
                self.load_rows(state, t.h0, slot, hv, vblk, tidx)
        head = self.head_gates(t, hv)

        for i_tok in cutlass.range(seqlen, unroll=1):
            token = self.prepare_token(t, lower_bound, staged, head, b, tok0 + i_tok, h, hv, vblk, tidx, i_tok % 2)
            if cutlass.const_expr(cfg.state_v_first):
                factors = self.v_first_factors(token, staged, tidx)
                self.step_v_first(state, factors, token, t.o, hv, vblk, tidx, scale, slot)
            else:
                self.step_k_first(state, token, staged, t.o, hv, vblk, tidx, warp, lane, scale, slot)
            if cutlass.const_expr(cfg.token_slots):
                to = cutlass.Int64(t.indices[n, i_tok])
                if live:
                    if to >= 0:
                        self.store_rows(state, t.h0, to, hv, vblk, tidx)

        if cutlass.const_expr(cfg.final == "ht"):
            self.store_rows(state, t.ht, cutlass.Int64(n), hv, vblk, tidx)
        elif cutlass.const_expr(cfg.final == "inplace" and not cfg.token_slots):
            if live:
                if seqlen > 0:
                    self.store_rows(state, t.h0, slot, hv, vblk, tidx)

    @cute.jit
    def head_gates(self, t: Tensors, hv) -> HeadGates:
        """The value head's constants of the scalar gate, read once."""
        f32 = cutlass.Float32
        gate_rate = f32(0.0)
        gate_bias = f32(0.0)
        gamma = f32(0.0)
        if cutlass.const_expr(self.cfg.g == "gdn"):
            gate_rate = cute.math.exp(t.a_log[hv])
            gate_bias = t.dt_bias[hv]
        if cutlass.const_expr(self.cfg.gamma):
            gamma = t.gamma[hv]
        return HeadGates(gate_rate, gate_bias, gamma)

    @cute.jit
    def prepare_token(self, t: Tensors, lower_bound, staged: Staging, head, b, tok, h, hv, vblk, tidx, par):
        """Token ``tok``'s :class:`Token`: its own loads, then q and k staged into column ``par`` (a CTA barrier),
        their norms and k . q, the scalar decay and beta."""
        f32 = cutlass.Float32
        cfg = self.cfg
        # the token's own loads go out first: their round trip overlaps q and k's and the barrier after them
        g_raw = f32(0.0)
        if cutlass.const_expr(cfg.g != "none"):
            g_raw = t.g[b, tok, hv].to(f32)
        beta_raw = f32(1.0)
        if cutlass.const_expr(cfg.beta == "given"):
            beta_raw = t.beta[b, tok, hv].to(f32)
        values, value_gates = self.token_values(t, b, tok, hv, vblk, tidx)
        self.stage_token(t, lower_bound, staged, b, tok, h, hv, par, tidx)
        cute.arch.barrier()
        sq, sk, sqk = f32(0.0), f32(0.0), f32(0.0)
        for w in cutlass.range_constexpr(self.K // 32):
            sq = sq + staged.sums[w, 0, par]
            sk = sk + staged.sums[w, 1, par]
            sqk = sqk + staged.sums[w, 2, par]
        rq, rk = f32(1.0), f32(1.0)
        if cutlass.const_expr(cfg.qk_l2norm):
            rq = cute.math.rsqrt(sq + f32(L2NORM_EPS))
            rk = cute.math.rsqrt(sk + f32(L2NORM_EPS))
        kq = sqk * rq * rk
        decay = self.scalar_factor(g_raw, head.rate, head.bias, head.gamma)
        return Token(b, tok, par, rq, rk, kq, decay, self.token_beta(beta_raw), values, value_gates)

    # ---------------------------------------------------------------- the state's elements
    @cute.jit
    def state_vector(self, mS, slot, hv, vblk, tidx, i: cutlass.Constexpr):
        """Thread ``tidx``'s row ``i`` of the CTA's block of ``mS[slot, hv]`` (a (K, V) view): ``vec`` contiguous
        elements."""
        r = tidx // self.lanes_per_row + self.row_step * i
        c = tidx % self.lanes_per_row
        if cutlass.const_expr(self.cfg.state_v_first):
            return cute.local_tile(mS[slot, hv, None, vblk * self.block_v + r], (self.vec,), (c,))
        return cute.local_tile(mS[slot, hv, r, None], (self.vec,), (vblk * (self.block_v // self.vec) + c,))

    @cute.jit
    def load_rows(self, state, mS, slot, hv, vblk, tidx):
        """The thread's rows of ``mS[slot, hv]``'s block into ``state`` (fp32)."""
        for i in cutlass.range_constexpr(self.rows):
            vec = cute.make_rmem_tensor(cute.make_layout(self.vec), mS.element_type)
            cute.autovec_copy(self.state_vector(mS, slot, hv, vblk, tidx, i), vec)
            for e in cutlass.range_constexpr(self.vec):
                state[i, e] = vec[e].to(cutlass.Float32)

    @cute.jit
    def store_rows(self, state, mS, slot, hv, vblk, tidx):
        """``state`` into the thread's rows of ``mS[slot, hv]``'s block."""
        for i in cutlass.range_constexpr(self.rows):
            vec = cute.make_rmem_tensor(cute.make_layout(self.vec), mS.element_type)
            for e in cutlass.range_constexpr(self.vec):
                vec[e] = state[i, e].to(mS.element_type)
            cute.autovec_copy(vec, self.state_vector(mS, slot, hv, vblk, tidx, i))

    # ---------------------------------------------------------------- a token's inputs
    @cute.jit
    def stage_token(self, t: Tensors, lower_bound, staged: Staging, b, tok, h, hv, par, tidx):
        """Threads 0 .. K - 1: key channel ``tidx``'s q, k and key factor into column ``par`` of the shared
        vectors; each warp's sums of q^2, k^2 and q k into ``staged.sums``."""
        f32 = cutlass.Float32
        if tidx < self.K:
            qx = t.q[b, tok, h, tidx].to(f32)
            kx = t.k[b, tok, h, tidx].to(f32)
            staged.q[tidx, par] = qx
            staged.k[tidx, par] = kx
            if cutlass.const_expr(self.cfg.gk != "none"):
                a = self.key_gate(t.gk[b, tok, hv, tidx].to(f32), t, lower_bound, hv, tidx)
                staged.key_factors[tidx, par] = cute.math.exp(a)
            sums = (qx * qx, kx * kx, qx * kx)
            for j in cutlass.range_constexpr(3):
                x = sums[j]
                for off in (16, 8, 4, 2, 1):
                    x = x + cute.arch.shuffle_sync_bfly(x, offset=off)
                if tidx % 32 == 0:
                    staged.sums[tidx // 32, j, par] = x

    @cute.jit
    def key_gate(self, x, t: Tensors, lower_bound, hv, ch):
        """The per-key log gate from ``gk``'s value ``x`` at key channel ``ch``."""
        kind = self.cfg.gk
        a = x
        if cutlass.const_expr(kind != "log"):
            y = x + t.dt_bias[hv * self.K + ch]
            rate = cute.math.exp(t.a_log[hv])
            if cutlass.const_expr(kind == "kda_softplus"):
                a = -rate * _softplus(y)
            else:
                a = lower_bound * _sigmoid(rate * y)
        return a

    @cute.jit
    def scalar_factor(self, g_raw, gate_rate, gate_bias, gamma):
        """exp of the token's scalar log gate: ``g`` (GDN's activation, rate exp(A_log) and bias dt_bias, applied
        when asked) plus ``g_gamma``."""
        f32 = cutlass.Float32
        e = f32(0.0)
        if cutlass.const_expr(self.cfg.g != "none"):
            x = g_raw
            if cutlass.const_expr(self.cfg.g == "gdn"):
                x = -gate_rate * _softplus(x + gate_bias)
            e = e + x
        if cutlass.const_expr(self.cfg.gamma):
            e = e + gamma
        return cute.math.exp(e)

    @cute.jit
    def token_beta(self, beta_raw):
        """The token's beta from its loaded value (1 where there is none), activated when asked."""
        beta = beta_raw
        if cutlass.const_expr(self.cfg.beta_sigmoid):
            beta = _sigmoid(beta)
            if cutlass.const_expr(self.cfg.neg_eigval):
                beta = beta * cutlass.Float32(2.0)
        return beta

    @cute.jit
    def token_values(self, t: Tensors, b, tok, hv, vblk, tidx):
        """The token's values this thread uses and their raw value gates (zeros without ``gv``), fp32: its value
        rows (V-first) or its ``vec`` value columns (K-first)."""
        f32 = cutlass.Float32
        cfg = self.cfg
        if cutlass.const_expr(cfg.state_v_first):
            count = self.rows
            first = vblk * self.block_v + tidx // self.lanes_per_row
            step = self.row_step
        else:
            count = self.vec
            first = vblk * self.block_v + self.vec * (tidx % self.lanes_per_row)
            step = 1
        values = cute.make_rmem_tensor(cute.make_layout(count), f32)
        value_gates = cute.make_rmem_tensor(cute.make_layout(count), f32)
        value_gates.fill(0.0)
        if cutlass.const_expr(cfg.state_v_first):
            for i in cutlass.range_constexpr(count):
                values[i] = t.v[b, tok, hv, first + step * i].to(f32)
        else:  # one vector load
            v_vec = cute.make_rmem_tensor(cute.make_layout(self.vec), t.v.element_type)
            cute.autovec_copy(cute.local_tile(t.v[b, tok, hv, None], (self.vec,), (first // self.vec,)), v_vec)
            for i in cutlass.range_constexpr(count):
                values[i] = v_vec[i].to(f32)
        if cutlass.const_expr(cfg.gv):
            for i in cutlass.range_constexpr(count):
                value_gates[i] = t.gv[b, tok, hv, first + step * i].to(f32)
        return values, value_gates

    # ---------------------------------------------------------------- one token's step
    @cute.jit
    def step_k_first(self, state, token: Token, staged: Staging, mO, hv, vblk, tidx, warp, lane, scale, slot):
        """K-first: thread rows are key rows, its ``vec`` elements value columns (module docstring); the token's
        ``values`` and ``value_gates`` are those columns'."""
        f32 = cutlass.Float32
        cfg = self.cfg
        b, tok, par, rq, rk, kq, decay, beta, values, value_gates = token
        sQ, sK, sKf, sRed = staged.q, staged.k, staged.key_factors, staged.partials
        c = tidx % self.lanes_per_row
        col0 = vblk * self.block_v + self.vec * c
        colf = cute.make_rmem_tensor(cute.make_layout(self.vec), f32)
        for e in cutlass.range_constexpr(self.vec):
            colf[e] = decay
            if cutlass.const_expr(cfg.gv):
                colf[e] = decay * cute.math.exp(value_gates[e])
        sk_part = cute.make_rmem_tensor(cute.make_layout(self.vec), f32)
        sq_part = cute.make_rmem_tensor(cute.make_layout(self.vec), f32)
        sk_part.fill(0.0)
        sq_part.fill(0.0)
        for i in cutlass.range_constexpr(self.rows):
            r = tidx // self.lanes_per_row + self.row_step * i
            kr = sK[r, par] * rk
            qr = sQ[r, par] * rq
            for e in cutlass.range_constexpr(self.vec):
                f = colf[e]
                if cutlass.const_expr(cfg.gk != "none"):
                    f = f * sKf[r, par]
                s = state[i, e] * f
                state[i, e] = s
                sk_part[e] = sk_part[e] + s * kr
                sq_part[e] = sq_part[e] + s * qr
        # over the lanes of a column, then the warps through shared memory
        for e in cutlass.range_constexpr(self.vec):
            for off in self.column_shuffles:
                sk_part[e] = sk_part[e] + cute.arch.shuffle_sync_bfly(sk_part[e], offset=off)
                sq_part[e] = sq_part[e] + cute.arch.shuffle_sync_bfly(sq_part[e], offset=off)
        if lane < self.lanes_per_row:
            for e in cutlass.range_constexpr(self.vec):
                sRed[warp, 0, self.vec * c + e, par] = sk_part[e]
                sRed[warp, 1, self.vec * c + e, par] = sq_part[e]
        cute.arch.barrier()
        u = cute.make_rmem_tensor(cute.make_layout(self.vec), f32)
        out = cute.make_rmem_tensor(cute.make_layout(self.vec), mO.element_type)
        for e in cutlass.range_constexpr(self.vec):
            s_k = f32(0.0)
            s_q = f32(0.0)
            for w in cutlass.range_constexpr(WARPS):
                s_k = s_k + sRed[w, 0, self.vec * c + e, par]
                s_q = s_q + sRed[w, 1, self.vec * c + e, par]
            ue = values[e]
            if cutlass.const_expr(cfg.delta_rule):
                ue = beta * (ue - s_k)
            u[e] = ue
            oe = scale * (s_q + ue * kq)
            if slot < 0:
                oe = f32(0.0)
            out[e] = oe.to(mO.element_type)
        if tidx < self.lanes_per_row:
            cute.autovec_copy(out, cute.local_tile(mO[b, tok, hv, None], (self.vec,), (col0 // self.vec,)))
        for i in cutlass.range_constexpr(self.rows):
            r = tidx // self.lanes_per_row + self.row_step * i
            kr = sK[r, par] * rk
            for e in cutlass.range_constexpr(self.vec):
                state[i, e] = state[i, e] + kr * u[e]

    @cute.jit
    def v_first_factors(self, token: Token, staged: Staging, tidx):
        """V-first: the thread's ``vec`` key columns' normalised k, q and key decay factors ``(kk, qq, kf)``."""
        f32 = cutlass.Float32
        sQ, sK, sKf = staged.q, staged.k, staged.key_factors
        c = tidx % self.lanes_per_row
        kf = cute.make_rmem_tensor(cute.make_layout(self.vec), f32)
        kk = cute.make_rmem_tensor(cute.make_layout(self.vec), f32)
        qq = cute.make_rmem_tensor(cute.make_layout(self.vec), f32)
        for e in cutlass.range_constexpr(self.vec):
            ch = self.vec * c + e
            kk[e] = sK[ch, token.par] * token.rk
            qq[e] = sQ[ch, token.par] * token.rq
            kf[e] = token.decay
            if cutlass.const_expr(self.cfg.gk != "none"):
                kf[e] = token.decay * sKf[ch, token.par]
        return kk, qq, kf

    @cute.jit
    def step_v_first(self, state, factors, token: Token, mO, hv, vblk, tidx, scale, slot):
        """V-first: thread rows are value rows, its ``vec`` elements key columns (module docstring); ``factors`` from
        :meth:`v_first_factors`; the token's ``values`` and ``value_gates`` are the thread's rows'."""
        f32 = cutlass.Float32
        cfg = self.cfg
        b, tok, par, rq, rk, kq, decay, beta, values, value_gates = token
        kk, qq, kf = factors
        c = tidx % self.lanes_per_row
        row0 = vblk * self.block_v + tidx // self.lanes_per_row
        for i in cutlass.range_constexpr(self.rows):
            vr = row0 + self.row_step * i
            f = f32(1.0)
            if cutlass.const_expr(cfg.gv):
                f = cute.math.exp(value_gates[i])
            s_k = f32(0.0)
            s_q = f32(0.0)
            for e in cutlass.range_constexpr(self.vec):
                s = state[i, e] * kf[e] * f
                state[i, e] = s
                s_k = s_k + s * kk[e]
                s_q = s_q + s * qq[e]
            for off in self.row_shuffles:
                s_k = s_k + cute.arch.shuffle_sync_bfly(s_k, offset=off)
                s_q = s_q + cute.arch.shuffle_sync_bfly(s_q, offset=off)
            ue = values[i]
            if cutlass.const_expr(cfg.delta_rule):
                ue = beta * (ue - s_k)
            oe = scale * (s_q + ue * kq)
            if slot < 0:
                oe = f32(0.0)
            if c == 0:
                mO[b, tok, hv, vr] = oe.to(mO.element_type)
            for e in cutlass.range_constexpr(self.vec):
                state[i, e] = state[i, e] + kk[e] * ue


@cute.jit
def _softplus(x):
    """torch's softplus: log(1 + e^x), x itself above the threshold."""
    y = x
    if x <= cutlass.Float32(SOFTPLUS_THRESHOLD):
        y = cute.math.log1p(cute.math.exp(x))
    return y


@cute.jit
def _sigmoid(x):
    return cutlass.Float32(1.0) / (cutlass.Float32(1.0) + cute.math.exp(-x))
