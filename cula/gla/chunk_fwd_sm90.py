"""GLA chunked forward for SM90: KDA's kernel (:mod:`cula.kda.chunk_fwd_sm90`) without the delta rule, exact for
any per-key gate.

GLA is linear attention with a per-key log gate g_t in R^K (<= 0, no bound). Per chunk, with G the inclusive
cumulative sum of max(g, -200) over the chunk's tokens (log2 units; the floor changes nothing in fp32: e^-200 is
below its smallest number) and V_new = V:

    O  = scale (Q * 2^G) S + tril(scale sum_k Q_ik K_jk 2^(G_ik - G_jk)) V
    S <- diag(2^G_last) S + (K * 2^(G_last - G))^T V

What KDA's kernel keeps: the prep warpgroup's gate scan, R and B tiles, the chain's per-key decay and the update.
What goes: beta, A, the solve, the hi + lo split of V_new (V is exact in bf16).

The intra-chunk scores P: KDA makes them against two reference tokens, L_i = q_i 2^(G_i - G_r) and R_j = k_j
2^(G_r - G_j) (r = 16 for the columns of the first 32-token half, 48 for the second). Their exponents are at most
the decay between a half's reference and its ends, so the operands are exact up to bf16 rounding while that is at
most 2^108 for every key channel (what FLA's KDA promises with g >= -5, and what GLA's layers give in practice):
then warpgroup h makes half h of P with one wgmma. A chunk with a steeper half (the prep role records each channel's
widest exponent, ``sSpan``) makes P directly instead: every entry j <= i summed over the keys in fp32 with
2^(G_ik - G_jk) <= 1, on all state threads (slower; exact for any gate, -inf included).

Long sequences are split across CTAs by the family's uncached passes (:func:`cula.ops.segment_split.split_forward`):
the later passes make no P (V_new is zero there: a transition pass makes no output, a correction pass adds the first
pass's), so their P tile is cleared once. The gate must be <= 0 (GLA's log gates are): the halves' exponents are
bounded from the ends of each half. Shapes as :mod:`cula.sm90.chunk_fwd`: q, k, v [B, T, H, D] bf16, g [B, T, H, D]
fp32; beta's slot carries an unread [B, T, H] fp32 tensor.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import NamedTuple

import cutlass
import cutlass.cute as cute
import torch
from cutlass.cute.nvgpu import warp as warp_ops

from cula import devices, runtime
from cula.kda import chunk_fwd_sm90 as kda
from cula.ops import segment_split
from cula.ops.gates import GATE_FLOOR
from cula.ops.gates import GLA_SAFE_SPAN as SAFE_SPAN
from cula.sm90 import entry, mma
from cula.sm90.chunk_fwd import ChainInputs, ChunkFwdConfig
from cula.sm90.roles import Barrier, WarpGroupRole

SUPPORTED_DIMS = (64, 128)
EXPONENT_CAP = 124.0  # above SAFE_SPAN, below bf16's largest exponent


class GLAGateSmem(NamedTuple):
    """KDA's gate views (:class:`cula.kda.chunk_fwd_sm90.GateSmem`) and the decay of each half per key channel."""

    sGin3: cute.Tensor
    sGin: cute.Tensor
    sG: cute.Tensor
    sPart: cute.Tensor
    sGl: cute.Tensor
    sDec: cute.Tensor
    sBeta: cute.Tensor
    sNorm: cute.Tensor
    sR: cute.Tensor
    sXG: cute.Tensor
    sKD: cute.Tensor
    sKD3: cute.Tensor
    sSpan: cute.Tensor  # (D, 2): the widest exponent against a reference token (log2 units, >= 0), column chunk % 2


@dataclass(frozen=True)
class ValueChainGates(kda.KeyChainGates):
    """GLA's gate in the state chain: KDA's, with V_new = V entering the update as one bf16 operand (exact; zero past
    the sequence end, where the state warpgroups zero the v tile's rows: ``zeroes_v_tail``)."""

    @cute.jit
    def update(self, acc_vn, cCC):
        rVn = mma.acc_to_operand(acc_vn)
        return rVn, None, rVn


class GLAChunkFwdSm90(kda.KDAChunkFwdSm90):
    """GLA on KDA's kernel (module docstring); ``config.delta_rule`` is False, the split passes uncached. The prep
    role makes no K 2^G (no pass reads it without the delta rule), and R only where the scores are made; elsewhere
    (the later split passes, the backward's state walks) the intra step, making no P, still takes the R and
    q | k | g stages and releases them, so that the rings keep one protocol."""

    split_values = False
    gate_floor = GATE_FLOOR

    def __init__(self, config: ChunkFwdConfig):
        assert not config.delta_rule and config.intra == "none", config
        super().__init__(config, gate_in_kernel=False)
        self.makes_scores = config.mode == "full" and config.walk == "output"
        # R only for the scores (the steep chunks' direct scores read q and k as loaded)
        self.makes_r = self.makes_scores

    # ---------------------------------------------------------------- host side
    def gate_host(self, t, gate_args, tile_qk, tile_v):
        params, fields = super().gate_host(t, gate_args, tile_qk, tile_v)
        fields["sSpan"] = cute.struct.MemRange[cutlass.Float32, 2 * self.D]
        return params, fields

    def gate_smem(self, st, p):
        base = super().gate_smem(st, p)
        return GLAGateSmem(*base, st.sSpan.get_tensor(cute.make_layout((self.D, 2), stride=(1, self.D))))

    # ---------------------------------------------------------------- prep role: no beta, the halves' decays
    @cute.jit
    def load_beta(self, mBeta, seq, pos, tidx):
        return mBeta.element_type(0.0)

    @cute.jit
    def stage_beta(self, sBeta, beta, mBeta, seq, chunk, slot, tidx):
        return beta

    @cute.jit
    def scan_gates(self, gs, slot, L, t, gate):
        """KDA's scan, then each key channel's largest exponent against a half's reference token, the larger of
        G_start - G_r and G_r - G_end over both halves (by the channel's last-part thread: the rows of the other
        part are final for it after the scan's barrier)."""
        # (named: the DSL turns a bare super() in a jit method into super(self.__class__, self))
        kda.KDAChunkFwdSm90.scan_gates(self, gs, slot, L, t, gate)
        ch = t % self.D
        Hf = self.half
        if t // self.D == self.scan_parts - 1:
            widest = cutlass.Float32(0.0)
            for h in cutlass.range_constexpr(2):
                g_ref = gs.sG[h * Hf + Hf // 2, ch]
                widest = cute.arch.fmax(widest, gs.sG[h * Hf, ch] - g_ref)
                widest = cute.arch.fmax(widest, g_ref - gs.sG[h * Hf + Hf - 1, ch])
            gs.sSpan[ch, slot] = widest

    # ---------------------------------------------------------------- state warpgroups
    @cute.jit
    def before_chunks(self, smem, stid):
        """No Tinv. A correction pass multiplies its zero V_new by the P tile it never makes: zeros there, not what
        shared memory held (0 x NaN); ordered before the products by the first intra step's barrier."""
        if cutlass.const_expr(self.cfg.mode == "correction"):
            nt = self.layout.threads_of(WarpGroupRole.STATE)
            sP = smem.sTP[None, None, 1, 0]
            for idx in cutlass.range(stid, self.C * self.C, nt, unroll=1):
                sP[idx // self.C, idx % self.C] = cutlass.BFloat16(0.0)

    @cute.jit
    def intra_step(self, p, smem, gs, rings, states, seq, chunk, stid, swarp):
        """P of the chunk into its shared tile (the first pass only): by halves (warpgroup h: columns of half h) where
        every channel's halves are safe, else directly (all state threads)."""
        nt = self.layout.threads_of(WarpGroupRole.STATE)
        sP = smem.sTP[None, None, 1, 0]
        rings.r.consumer_wait(states.chunk)
        rings.qkg.consumer_wait(states.chunk)
        if cutlass.const_expr(self.makes_scores):
            if self.chunk_is_steep(gs, chunk % 2):
                self.direct_scores(p, smem, gs, sP, stid, nt)
            else:
                if stid // 128 == 0:
                    self.half_scores(p, smem, gs, sP, stid % 128, 0)
                else:
                    self.half_scores(p, smem, gs, sP, stid % 128, 1)
        # q, k, G and R of the chunk are no longer read here: the prep role may load the next chunk's (one lane per
        # warp releases q | k | G: the direct scores' lanes diverge, so the warp converges first)
        cute.arch.sync_warp()
        rings.qkg.consumer_release(states.chunk)
        rings.r.consumer_release(states.chunk)
        cute.arch.fence_proxy("async.shared", space="cta")
        cute.arch.barrier(barrier_id=Barrier.STATE, number_of_threads=nt)

    @cute.jit
    def chunk_is_steep(self, gs, slot):
        """Whether some key channel's operands would need an exponent above SAFE_SPAN (the same answer on every
        lane: each warp reads all channels and votes)."""
        lane = cute.arch.lane_idx()
        steepest = cutlass.Float32(0.0)
        for i in cutlass.range_constexpr(self.D // 32):
            steepest = cute.arch.fmax(steepest, gs.sSpan[32 * i + lane, slot])
        return cute.arch.vote_any_sync(steepest > cutlass.Float32(SAFE_SPAN))

    @cute.jit
    def half_scores(self, p, smem, gs, sP, wtid, half: cutlass.Constexpr):
        """Columns of ``half`` of P: L_i = q_i 2^(G_i - G_r) (zero for rows before the half) against the half of R
        (reference r = its 16th token), one wgmma, masked (j <= i), scaled, stored by stmatrix."""
        C, Hf = self.C, self.half
        f32, bf16 = cutlass.Float32, cutlass.BFloat16
        c = p.common
        # its own tiled MMA: the accumulate flag set while a branch issues it is that branch's value (the parameter's
        # object would carry it into the other branch)
        mma_half = mma.tiled_mma(C, Hf)
        thr_h = mma_half.get_slice(wtid)
        thr_st = c.mma_state.get_slice(wtid)
        tHb_R = thr_h.make_fragment_B(thr_h.partition_B(gs.sR))
        cH = thr_h.partition_C(cute.make_identity_tensor((C, Hf)))
        cST = thr_st.partition_C(cute.make_identity_tensor((C, self.D)))
        left = mma.empty_operand(cute.size(cST))
        left_flat = cute.make_tensor(left.iterator, cute.make_layout(cute.size(cST)))
        pair = cute.make_rmem_tensor(cute.make_layout((1, 2)), f32)
        x2 = cute.make_rmem_tensor(cute.make_layout((1, 2)), bf16)
        g2 = cute.make_rmem_tensor(cute.make_layout((1, 2)), f32)
        ref = cute.make_rmem_tensor(cute.make_layout((1, 2)), f32)
        sQ = smem.sQK[None, None, 0, 0]
        # as KDA's intra step: per 8-column block the thread holds 2 adjacent columns on 2 rows, built in pairs and
        # converted two at a time, every operand register final before the wgmma fence
        for blk in cutlass.range_constexpr(cute.size(cST) // 4):
            _, kb = cST[4 * blk]
            cute.autovec_copy(cute.local_tile(gs.sG, (1, 2), (half * Hf + Hf // 2, kb // 2)), ref)
            for rr in cutlass.range_constexpr(2):
                i = 4 * blk + 2 * rr
                ri, x = kda.operand_pair(sQ, gs.sG, cST[i], x2, g2)
                # rows before the half are zero against it (their entries lie above the diagonal); their exponents,
                # up to two halves' decay, are capped so that the zeroing multiplies a finite number
                keep = f32(1.0) if ri >= half * Hf else f32(0.0)
                for e in cutlass.range_constexpr(2):
                    exponent = cute.arch.fmin(g2[0, e] - ref[0, e], f32(EXPONENT_CAP))
                    pair[0, e] = keep * x[e] * cute.math.exp2(exponent, fastmath=True)
                cute.local_tile(left_flat, (2,), (i // 2,)).store(pair.load().to(bf16))
        acc = thr_h.make_fragment_C(thr_h.partition_shape_C((C, Hf)))
        mma.gemm_waited(mma_half, acc, left, tHb_R[None, None, None, half], True)
        st_p = cute.make_tiled_copy_C(
            cute.make_copy_atom(warp_ops.StMatrix8x8x16bOp(transpose=False, num_matrices=4), bf16), mma_half
        )
        kda.store_score_half(acc, cH, half, c.scale, st_p, st_p.get_slice(wtid), sP)

    @cute.jit
    def direct_scores(self, p, smem, gs, sP, stid, nt):
        """Every entry of P by one thread: scale sum_k q_ik k_jk 2^(G_ik - G_jk) for j <= i (fp32, factors <= 1),
        zero above the diagonal."""
        C, D = self.C, self.D
        f32 = cutlass.Float32
        sQ = smem.sQK[None, None, 0, 0]
        sK = smem.sQK[None, None, 1, 0]
        for idx in cutlass.range(stid, C * C, nt, unroll=1):
            i = idx // C
            j = idx % C
            acc = f32(0.0)
            if j <= i:
                for kk in cutlass.range(D, unroll=8):
                    factor = cute.math.exp2(gs.sG[i, kk] - gs.sG[j, kk], fastmath=True)
                    acc = acc + sQ[i, kk].to(f32) * sK[j, kk].to(f32) * factor
            sP[i, j] = (acc * p.common.scale).to(cutlass.BFloat16)

    @cute.jit
    def chain_inputs(self, p, smem, gs, rings, states, seq, chunk):
        rings.b.consumer_wait(states.chunk)
        gates = ValueChainGates(gs.sBeta, gs.sDec, chunk % 2, p.common.scale)
        return ChainInputs(gs.sXG[None, None, 0], gs.sXG[None, None, 1], gs.sKD, gates)


# -------------------------------------------------------------------- host side
def supports(q, k, v, g, initial_state=None, cu_seqlens=None, dims=SUPPORTED_DIMS, arch_major=9) -> tuple[bool, str]:
    """Whether :func:`chunk_gla_fwd_sm90` can serve these inputs, and why not (``dims`` and ``arch_major``: the head
    dims and GPU architecture of the kernel asked, SM90's by default)."""
    ok, why = entry.supports_qkv(q, k, v, None, initial_state, cu_seqlens, dims, arch_major)
    if not ok:
        return ok, why
    if v.shape[2] != q.shape[2]:
        return False, "GLA has one value head per q/k head"
    if g.dtype not in (torch.float32, torch.bfloat16, torch.float16) or tuple(g.shape) != tuple(q.shape):
        return False, "g must be a float tensor [B, T, H, K]"
    return True, ""


def compile_gla_fwd_sm90(
    arch="sm_90a", *, beta_fp32=True, state_v_first=False, keep_artifacts=False, kernel_class=None, **config
):  # fmt: skip
    """The GLA chunk kernel for ``config`` (:class:`cula.sm90.chunk_fwd.ChunkFwdConfig` fields; no delta rule,
    intra "none"), compiled on any machine for ``arch``. Beta's slot is never read (fp32, as the host fills it).
    ``kernel_class``: another architecture's kernel (SM100's), which takes no KDA gate parameters."""
    cfg = ChunkFwdConfig(**{**config, "delta_rule": False})
    walk = cfg.walk != "output"
    fake = entry.fake_args(
        cfg.head_dim, beta_fp32, state_v_first, per_key_gate=True, checkpoints=walk, config=cfg,
        gate_params=kernel_class is None,
    )  # fmt: skip
    return runtime.compile_kernel((kernel_class or GLAChunkFwdSm90)(cfg), fake, arch, keep_artifacts)


def split_cost(call: entry.ChunkCall) -> segment_split.SplitCost:
    """The split passes' costs on the call's GPU (:func:`cula.devices.times_for`), uncached: the kernel saves no
    intra-chunk matrices (its later passes make none); no transition pass (the gate's decay, made on the host)."""
    cost = devices.times_for(call.q.device).kernels["gla"].split
    return cost._replace(cached=False, transition=0.0)


GLA_SM90 = entry.ChunkKernel(
    "gla",
    compile_gla_fwd_sm90,
    gate_args=kda.gate_args,
    split_cost=split_cost,
    delta_rule=False,
    gate_transition=True,
    # an H100 timed B1 T8192 H64 at 0.666 ms so against 0.607 split in two
    splits_values="when asked",
)


def chunk_gla_fwd_sm90(
    q, k, v, g, scale=None, initial_state=None, output_final_state=False, cu_seqlens=None, state_v_first=False,
    cu_seqlens_cpu=None, split=None, out=None, final_state_out=None, state_slots=None, inplace=False, kernel=GLA_SM90,
):  # fmt: skip
    """GLA chunked forward on SM90: q, k, v [B, T, H, D] bf16, g [B, T, H, D] per-key log gate; the rest as
    :class:`cula.sm90.entry.ChunkCall` (``split``: None lets the planner split long sequences; ``out`` /
    ``final_state_out``: preallocated outputs; ``state_slots`` / ``inplace``: a state pool). Returns ``(o,
    final_state, the pool, or None)``. ``kernel``: another architecture's kernel on the same host path (SM100's)."""
    unread_beta = torch.empty(v.shape[:3], dtype=torch.float32, device=v.device)
    call = entry.ChunkCall(
        q.contiguous(), k.contiguous(), v.contiguous(), g.float().contiguous(), unread_beta, scale, initial_state,
        output_final_state, cu_seqlens, state_v_first, out, final_state_out, cu_seqlens_cpu, split,
        state_slots=state_slots, inplace=inplace,
    )  # fmt: skip
    return entry.chunk_fwd(kernel, call)


entry.register_checked(
    "gla_chunk_fwd_sm90",
    compile_gla_fwd_sm90,
    entry.checked(
        "",
        "[fixed length]",
        "[pool]",
        "[pool, read only]",
        "[bf16 pool]",
        "[D=64]",
        "[correction]",
        "[D=64, correction]",
        *entry.WALK_CONFIGS,
        "[D=64, states walk]",
        *entry.VALUE_BLOCK_CONFIGS,
    ),  # fmt: skip
)
