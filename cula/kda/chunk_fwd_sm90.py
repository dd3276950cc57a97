"""Kimi Delta Attention chunked-prefill forward for SM90: the family skeleton (:mod:`cula.sm90.chunk_fwd`) with
KDA's per-key gate, and KDA's place in the SM90 host path.

KDA is GDN with a per-key gate g_t in R^K (natural log, <= 0). Per chunk, with G the inclusive cumulative sum of g over
the chunk's tokens (C x K, per key channel, in log2 units):

    A     = strict_tril(diag(beta) sum_k K_ik K_jk 2^(G_ik - G_jk))         Tinv = (I + A)^-1
    Y     = diag(beta) (V - (K * 2^G) S)                                   V_new = Tinv Y
    O     = scale (Q * 2^G) S + tril(scale sum_k Q_ik K_jk 2^(G_ik - G_jk)) V_new
    S    <- diag(2^G_last) S + (K * 2^(G_last - G))^T V_new

The gate's factors ride in bf16 B tiles built in shared memory each chunk: K 2^G and Q 2^G (K-major) for the state's
projections, K 2^(G_last - G) (read MN-major) for the update; the chunk decay multiplies the state's key columns.

Intra-chunk factors (A and P): 2^(G_ik - G_jk) has a per-channel factor inside the sum over k, so A and P are
products of scaled operands, L_i . R_j with L_ik = x_ik 2^(G_ik - G_rk), R_jk = k_jk 2^(G_rk - G_jk) for a reference
token r. One reference cannot serve all 64 tokens (factors reach 2^(+-64 * 5 / ln 2)); the columns j are split into
two 32-token halves with references r = 16 and r = 48. Within a half |j - r| <= 16, so with every g_t >= lower_bound
>= -5 (FLA's safe_gate promise) R stays in [2^-116, 2^116]; the left factor is at most 2^116 too (rows of the half's
own block; rows before the block are masked to zero). Rows after the block (i >= 32 against r = 16) have left factors
<= 1 that may underflow to zero: only when their true products with R are below e^(-87 + 75) ~ 5e-6, far under bf16
resolution. Everything else is exact up to bf16 rounding of the operands.

Roles (384 threads): PRODUCER (56 registers; the prep warpgroup) loads the q | k | g and v tiles and, per chunk,
stages beta, scans the gates (G, G_last, 2^G_last), takes the token norms (qk_l2norm), builds R, then the B tiles;
in the later split passes it only feeds the saved B tiles, 2^G_last, Tinv and P. STATE (224 each, two warpgroups):
no intra warpgroup, so each chunk they first build the left operands and make A (warpgroup 0) and P (warpgroup 1)
against R, solve Tinv together (:meth:`KDAChunkFwdSm90.intra_step`), then run the chain. At D = 64 warpgroup 1
repeats warpgroup 0's state rows without writing them (it still makes P).

The backward's state walks (``ChunkFwdConfig.walk``, :mod:`cula.kda.chunk_bwd_sm90`): "states" is the chain without
O and P; "state_grads" (on q, k, dO, from the last chunk) runs the transposed chain of
:meth:`cula.sm90.state_chain.StateChain.reverse_delta`, its factors in the B tiles (K 2^(G_last - G) read K-major for
dS'^T (K 2^(G_last - G))^T; scale Q 2^G and K 2^G read MN-major for the update), beta on Y'^T's columns.

``gate_in_kernel``: g arrives raw (bf16) and the prep role applies FLA's bounded KDA gate to it,
lower_bound * sigmoid(exp(A_log) (g + dt_bias)), in the scan; the raw tile lands in R's buffer (R is made after the
scan has read it), the fp32 gate tile then only holds G.

Shapes as :mod:`cula.sm90.chunk_fwd`; g [B, T, HV, K] fp32 (activated, >= -5), or bf16 raw with
``gate_in_kernel``; A_log [HV], dt_bias [HV * K] fp32; the split passes' B-tile workspaces wb [ranges, chunks * 3 C,
HV, K] bf16 and wd [ranges, chunks, HV, K] fp32.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import NamedTuple

import cutlass
import cutlass.cute as cute
import torch
from cutlass.cute.nvgpu import cpasync, warpgroup
from cutlass.cute.nvgpu import warp as warp_ops

from cula import devices, runtime
from cula.ops import segment_split
from cula.ops.gates import L2NORM_EPS  # FLA's l2norm_fwd: x / sqrt(sum(x^2) + eps)
from cula.sm90 import entry, mma, pipeline, solve, tiles, workspace
from cula.sm90.chunk_fwd import CHUNK, ChainInputs, ChunkFwdConfig, ChunkFwdSm90, ChunkTensors, Tma
from cula.sm90.roles import Barrier, RoleLayout, WarpGroupRole
from cula.sm90.state_chain import ChainGates

SUPPORTED_DIMS = (64, 128)
# The kernel's time model (its time per chunk, its split passes' costs) is in cula/devices.py, per GPU.
# the lowest gate the intra-chunk factorisation tolerates (module docstring)
LOWER_BOUND_MIN = -5.0
_LOG2E = math.log2(math.e)


class GateParams(NamedTuple):
    g: Tma  # the gate tile's TMA (fp32 activated, or bf16 raw into R's buffer)
    a_log: cute.Tensor
    dt_bias: cute.Tensor
    lower_bound: cutlass.Float32
    wb: Tma  # the B-tile workspace, rows (q's atom when unused)
    wkd: Tma  # the same workspace's K 2^(G_last - G) tiles through its (D, rows) view
    wd: cute.Tensor  # 2^G_last per (range, chunk, value head, key channel)
    mma_half: object  # (C x C/2), A in registers: the left operands against one half of R
    tile_g: object  # the gate tile (C, D, 1) fp32, rows padded (g_stride)
    tile_g_in: object  # where the gate tile lands: itself, or (raw, bf16) R's buffer
    tile_r: object  # R in two 32-token halves (C/2, D, 2)
    tile_xg: object  # K 2^G | Q 2^G (C, D, 2)
    tile_xg_mn: object  # the same read MN-major (D, C, 2): the state-gradient walk's B tiles
    tile_kd: object  # K 2^(G_last - G) (D, C, 1), MN-major
    tile_kd_k: object  # the same read K-major (C, D, 1): the state-gradient walk's dS'^T (K 2^(G_last - G))^T


class GateSmem(NamedTuple):
    sGin3: cute.Tensor  # where the gate tile lands (C, D, 1)
    sGin: cute.Tensor  # the same (C, D)
    sG: cute.Tensor  # G (C, D) fp32, log2 units
    sPart: cute.Tensor  # the scan's part totals (part, channel)
    sGl: cute.Tensor  # G_last per key channel
    sDec: cute.Tensor  # 2^G_last per key channel, column chunk % 2
    sBeta: cute.Tensor  # beta per token, column chunk % 2
    sNorm: cute.Tensor  # qk_l2norm: 1 / ||k_t||, 1 / ||q_t||
    sR: cute.Tensor  # (C/2, D, 2)
    sXG: cute.Tensor  # (C, D, 2): K 2^G, Q 2^G
    sKD: cute.Tensor  # (D, C): K 2^(G_last - G)
    sKD3: cute.Tensor  # (D, C, 1), for the workspace's TMA


class Rings(NamedTuple):
    qkg: object  # q | k | g tiles, TMA (one stage): released by the prep role (B tiles made) and the state
    # warpgroups (A and P made)
    v: object  # v (or a correction pass's first o), TMA
    r: object  # R, by the prep role, for the intra step
    b: object  # the B tiles (or, in the later split passes, beta and 2^G_last alone), by the prep role
    b_load: object  # the later split passes: the saved B tiles, TMA (else the b ring again: never used)
    tp: object  # the later split passes: the saved Tinv | P, TMA (else the b ring again: never used)


class StateRings(NamedTuple):
    """The state warpgroups' position in the one-stage rings qkg, r, b and b_load: they all move once per chunk,
    at its end (:meth:`KDAChunkFwdSm90.chain_release`)."""

    chunk: object


@dataclass(frozen=True)
class KeyChainGates(ChainGates):
    """KDA's gate in the state chain: the B tiles carry the factors, so Y and O take none but beta and scale; the
    state's key columns decay by 2^G_last (``sDec`` column ``slot``); V_new enters the update unscaled, as a bf16 hi +
    lo pair."""

    sBeta: cute.Tensor
    sDec: cute.Tensor
    slot: object
    scale: object

    @cute.jit
    def decay(self, acc_s, cST):
        for i in cutlass.range_constexpr(cute.size(acc_s)):
            _, kd = cST[i]
            acc_s[i] = acc_s[i] * self.sDec[kd, self.slot]

    @cute.jit
    def y(self, acc_k, v_frag, cCC):
        # Y^T[v, j] = beta_j (V[j, v] - (S^T (K 2^G)^T)[v, j]), zero past the sequence end
        for i in cutlass.range_constexpr(cute.size(acc_k)):
            _, j = cCC[i]
            vv = cutlass.Float32(0.0)
            if cutlass.const_expr(v_frag is not None):
                vv = v_frag[i].to(cutlass.Float32)
            acc_k[i] = self.sBeta[j, self.slot] * (vv - acc_k[i])

    @cute.jit
    def o(self, acc_o, cCC):
        for i in cutlass.range_constexpr(cute.size(acc_o)):
            acc_o[i] = acc_o[i] * self.scale

    @cute.jit
    def update(self, acc_vn, cCC):
        rVn, rVn_lo = mma.acc_to_operand_split(acc_vn)
        return rVn, rVn_lo, rVn

    # the state-gradient walk: the factors 2^(G_last - G), scale 2^G and 2^G ride in its B tiles
    @cute.jit
    def to_end(self, acc, cCC):
        pass

    @cute.jit
    def query_operand(self, do_frag, cCC):
        return mma.frag_to_operand(do_frag)

    @cute.jit
    def key_operand(self, acc_y, cCC):
        for i in cutlass.range_constexpr(cute.size(acc_y)):
            _, j = cCC[i]
            acc_y[i] = -self.sBeta[j, self.slot] * acc_y[i]
        return mma.acc_to_operand(acc_y)


class KDAChunkFwdSm90(ChunkFwdSm90):
    """KDA on the family skeleton (module docstring)."""

    qk_stages = 1  # q | k | g refilled as soon as its last reader is done
    tp_stages = 1
    o_stages = 1
    # Y and V_new enter their products as bf16 hi + lo pairs: the state and O then keep ~16 bits of them (a single
    # bf16 rounding there costs about 2e-3 relative error in the state)
    split_values = True
    zeroes_v_tail = True  # Y = beta (V - ...) with beta = 0 past the sequence end: V must be finite there
    # two value blocks: both state warpgroups hold the CTA's 64 value rows (as at D = 64; the second writes none)
    takes_value_blocks = True
    # a floor on the natural-log gate (None: the gate as given, >= -5 by FLA's safe_gate)
    gate_floor = None

    # the backward's state walks (ChunkFwdConfig.walk) make A and Tinv, and the state-gradient walk P, as the forward
    # does (the skeleton's closing barrier keeps the next chunk's P behind the reverse walk's reads)
    intra_step_in_walks = True

    def __init__(self, config, gate_in_kernel: bool = False):
        self.gate_in_kernel = gate_in_kernel
        super().__init__(config)
        self.half = self.C // 2  # intra-chunk column halves, reference tokens half // 2 and half + half // 2
        # row stride of the fp32 gate tile G: a TMA box (D) where fp32 g lands in it; else padded by 8 floats, so
        # that the intra step's reads of G at its accumulator positions (8-byte pairs, 4 rows per half-warp) hit
        # distinct banks (the scan and the tile builders read whole rows, conflict-free either way)
        self.g_stride = self.D + 8 if gate_in_kernel else self.D
        self.prep_threads = 128
        # the gate scan: prep thread t takes key channel t % D over part t // D of the chunk's tokens
        self.scan_parts = self.prep_threads // self.D
        self.feeds = config.intra == "load"  # the later split passes: the prep role feeds saved tiles
        # the state-gradient walk with the delta rule (on q, k, dO): q's rows past the sequence end zeroed, P made,
        # and the B tiles K 2^(G_last - G) (for dS'^T K^T against it), K 2^G and scale Q 2^G (for the walk's update)
        self.reverse_delta = config.reverse and config.delta_rule
        # P: for the output, or dO^T P in the state-gradient walk (the states walk reads none)
        self.makes_p = config.walk != "states"
        # Q 2^G: for the output's S^T Q~^T, or the state-gradient walk's update (no pass without output reads it else)
        self.makes_q_tile = config.make_o or self.reverse_delta
        # K 2^G: for the delta rule's S^T K~^T, or the state-gradient walk's update with it
        self.makes_k_tile = config.delta_rule
        # R: for the intra step's A and P (a subclass whose intra step makes neither in some pass clears it there)
        self.makes_r = True

    def role_layout(self) -> RoleLayout:
        R = WarpGroupRole
        # 2 x 224 + 56 <= 3 x 168, the launch's share (232 / 40 measured slower)
        return RoleLayout.make((R.PRODUCER, R.STATE, R.STATE), {R.PRODUCER: 56})

    # ---------------------------------------------------------------- host side
    @cute.jit
    def __call__(
        self, q, k, v, g, beta, o, h0, ht, starts, ends, w, slots, scale, a_log, dt_bias, lower_bound, wb, wd, stream
    ):
        self.launch(
            ChunkTensors(q, k, v, g, beta, o, h0, ht, starts, ends, w, slots), scale,
            (a_log, dt_bias, lower_bound, wb, wd),
            stream,
        )  # fmt: skip

    def gate_host(self, t: ChunkTensors, gate_args: tuple, tile_qk, tile_v):
        a_log, dt_bias, lower_bound, wb, wd = gate_args
        C, D, Hf = self.C, self.D, self.half
        bf16, f32 = cutlass.BFloat16, cutlass.Float32
        cfg = self.cfg
        # the gate tile (C, D, 1) fp32 row-major, not swizzled: the scan's token rows are compile-time, so its
        # addresses are immediates (see g_stride)
        tile_g = cute.make_layout((C, D, 1), stride=(self.g_stride, 1, C * self.g_stride))
        tile_r, _ = tiles.token_tiles(Hf, D, 2)
        tile_xg, tile_xg_mn = tiles.token_tiles(C, D, 2)
        tile_kd_k, tile_kd = tiles.token_tiles(C, D, 1)
        tile_g_in = tile_g
        if cutlass.const_expr(self.gate_in_kernel):
            tile_g_in = cute.make_layout((C, D, 1), stride=(D, 1, C * D))
        load = cpasync.CopyBulkTensorTileG2SOp()
        tma_g = Tma(
            *cpasync.make_tiled_tma_atom(load, tiles.tma_view(t.g), cute.slice_(tile_g_in, (None, None, 0)), (C, D))
        )
        # the B tiles' workspace [ranges, chunks * 3 * C, HV, D] (chunk c's K 2^G at rows 3 c C, Q 2^G and then
        # K 2^(G_last - G) after it, each token's channels contiguous: the latter is written and read through the
        # (D, rows) view, MN-major as its smem tile); the first pass saves them, the later passes load them
        tma_b = tma_bd = Tma(
            *cpasync.make_tiled_tma_atom(load, tiles.tma_view(t.q), cute.slice_(tile_xg, (None, None, 0)), (C, D))
        )
        if cutlass.const_expr(cfg.intra != "none"):
            op = cpasync.CopyBulkTensorTileS2GOp() if cfg.intra == "save" else load
            tma_b = Tma(
                *cpasync.make_tiled_tma_atom(op, tiles.tma_view(wb), cute.slice_(tile_xg, (None, None, 0)), (C, D))
            )
            wb_rows = tiles.tma_view(wb)
            wb_mn = cute.make_tensor(wb_rows.iterator, cute.select(wb_rows.layout, mode=[1, 0, 2, 3]))
            tma_bd = Tma(*cpasync.make_tiled_tma_atom(op, wb_mn, cute.slice_(tile_kd, (None, None, 0)), (D, C)))
        params = GateParams(
            tma_g, a_log, dt_bias, lower_bound, tma_b, tma_bd, wd, mma.tiled_mma(C, Hf),
            tile_g, tile_g_in, tile_r, tile_xg, tile_xg_mn, tile_kd, tile_kd_k,
        )  # fmt: skip
        # a state walk reads no q (GLA's: its key place holds k, or q itself), but the delta rule's state-gradient walk
        self.loads_q = cfg.walk == "output" or self.reverse_delta
        self.qkg_bytes = (1 + int(self.loads_q)) * C * D * 2 + C * D * (2 if self.gate_in_kernel else 4)
        self.b_bytes = (2 + int(cfg.make_o)) * C * D * 2
        rings = {"qkg": 1, "v": self.v_stages, "r": 1, "b": 1, "b_load": 1, "tp": 1}
        fields = {f"ring_{name}": pipeline.ring_storage(stages) for name, stages in rings.items()}
        fields.update(
            sBeta=cute.struct.MemRange[f32, 2 * C],
            sGl=cute.struct.MemRange[f32, D],
            sDec=cute.struct.MemRange[f32, 2 * D],
            sNorm=cute.struct.MemRange[f32, 2 * C],
            sPart=cute.struct.MemRange[f32, self.prep_threads],
            sGt=cute.struct.Align[cute.struct.MemRange[f32, cute.cosize(tile_g)], 1024],
            sR=cute.struct.Align[cute.struct.MemRange[bf16, cute.cosize(tile_r)], 1024],
            sXG=cute.struct.Align[cute.struct.MemRange[bf16, cute.cosize(tile_xg)], 1024],
            sKD=cute.struct.Align[cute.struct.MemRange[bf16, cute.cosize(tile_kd)], 1024],
        )
        return params, fields

    # ---------------------------------------------------------------- device side
    def gate_smem(self, st, p):
        C, D = self.C, self.D
        gp = p.gate
        sGt3 = st.sGt.get_tensor(gp.tile_g)
        sGin3 = sGt3
        if cutlass.const_expr(self.gate_in_kernel):
            sGin3 = st.sR.get_tensor(gp.tile_g_in)
        sKD3 = st.sKD.get_tensor(gp.tile_kd.outer, swizzle=gp.tile_kd.inner)
        return GateSmem(
            sGin3,
            sGin3[None, None, 0],
            sGt3[None, None, 0],
            st.sPart.get_tensor(cute.make_layout((self.scan_parts, D), stride=(D, 1))),
            st.sGl.get_tensor(cute.make_layout(D)),
            st.sDec.get_tensor(cute.make_layout((D, 2), stride=(1, D))),
            st.sBeta.get_tensor(cute.make_layout((C, 2), stride=(1, C))),
            st.sNorm.get_tensor(cute.make_layout((C, 2))),
            st.sR.get_tensor(gp.tile_r.outer, swizzle=gp.tile_r.inner),
            st.sXG.get_tensor(gp.tile_xg.outer, swizzle=gp.tile_xg.inner),
            sKD3[None, None, 0],
            sKD3,
        )

    def make_rings(self, st, c):
        C = self.C
        cfg = self.cfg
        math_threads = self.layout.threads_of(WarpGroupRole.STATE)
        math_warps = math_threads // 32
        prep = self.prep_threads
        # q | k | g: read by the prep role (scan, R, B tiles) unless it feeds, and by the intra step
        qkg = pipeline.tma_ring(st.ring_qkg, 1, self.qkg_bytes, prep // 32 + math_warps)
        v = pipeline.tma_ring(st.ring_v, self.v_stages, C * self.Dv * 2, math_warps)  # the CTA's value columns
        r = pipeline.thread_ring(st.ring_r, 1, prep, math_threads)
        b = pipeline.thread_ring(st.ring_b, 1, prep, math_threads)
        b_load = tp = b
        if cutlass.const_expr(self.feeds):
            b_load = pipeline.tma_ring(st.ring_b_load, 1, self.b_bytes, math_warps)
            tp = pipeline.tma_ring(st.ring_tp, 1, (1 + int(cfg.make_o)) * C * C * 2, math_warps)
        return Rings(qkg, v, r, b, b_load, tp)

    def prefetch_descriptors(self, p):
        super().prefetch_descriptors(p)
        cpasync.prefetch_descriptor(p.gate.g.atom)
        if cutlass.const_expr(self.cfg.intra != "none"):
            for tma in (p.common.w, p.gate.wb, p.gate.wkd):
                cpasync.prefetch_descriptor(tma.atom)

    # ---------------------------------------------------------------- prep role (producer)
    @cute.jit
    def producer_role(self, p, smem, gs, rings, seq, t, pwarp):
        if cutlass.const_expr(self.feeds):
            self.feed_role(p, smem, gs, rings, seq, t, pwarp)
        else:
            self.prep_role(p, smem, gs, rings, seq, t, pwarp)

    @cute.jit
    def b_tiles(self, p, gs, seq):
        """``(tBs, tBg, tKDs, tKDg)``: the B tiles and their workspace tiles (3 c for chunk c's K 2^G, 3 c + 1 for
        Q 2^G (rows), 3 c + 2 for K 2^(G_last - G) through the (D, rows) view) of this (range, head)."""
        D, C = self.D, self.C
        gp = p.gate
        tBs, tBg = tiles.tma_chunk_tiles(gp.wb.atom, gp.wb.tensor[None, None, seq.hv, seq.n], 0, gs.sXG)
        gKD = cute.local_tile(gp.wkd.tensor[None, None, seq.hv, seq.n], (D, C), (0, None))
        tKDs, tKDg = cpasync.tma_partition(
            gp.wkd.atom, 0, cute.make_layout(1), cute.group_modes(gs.sKD3, 0, 2), cute.group_modes(gKD, 0, 2)
        )
        return tBs, tBg, tKDs, tKDg

    @cute.jit
    def prep_role(self, p, smem, gs, rings, seq, t, pwarp):
        """Per chunk, once its q | k | g tiles have landed: beta (column c % 2 of ``sBeta``), the gate scan (G, G_last,
        2^G_last in column c % 2 of ``sDec``), with qk_l2norm the token norms, then R (ring ``r``), then, once the
        state warpgroups' products of the previous chunk are done, the B tiles (ring ``b``). Once the tiles are
        released by the intra step too, warp 0 loads the next chunk's (and its v two chunks ahead of their use).
        With intra "save" it also stores each chunk's B tiles (TMA) and 2^G_last to the workspaces."""
        C, D = self.C, self.D
        f32 = cutlass.Float32
        c = p.common
        gp = p.gate
        cfg = self.cfg
        save = cfg.intra == "save"
        sQ3 = smem.sQK[None, None, 0, None]
        sK3 = smem.sQK[None, None, 1, None]
        loads = self.load_partitions(p, smem, gs, seq)
        qkg_p = pipeline.producer_start(1)
        v_p = pipeline.producer_start(self.v_stages)
        qkg_c = pipeline.consumer_start(1)
        r_p = pipeline.producer_start(1)
        b_p = pipeline.producer_start(1)
        # (ring positions advance on every thread, outside the branches: a branch cannot carry an object's update)
        if pwarp == 0:
            if seq.n_chunks > 0:
                self.issue_qkg(p, rings, qkg_p, loads, self.chunk_position(cutlass.Int32(0), seq), seq.n_chunks)
                self.issue_v(c, rings, v_p, loads, self.chunk_position(cutlass.Int32(0), seq))
        qkg_p.advance()
        v_p.advance()
        # beta of a chunk is loaded one chunk ahead (stage_beta), so that the global load is in flight while the
        # prep role waits for the tiles
        beta_next = c.beta.element_type(0.0)
        if seq.n_chunks > 0:
            beta_next = self.load_beta(c.beta, seq, self.chunk_position(cutlass.Int32(0), seq), t)
        # with gate_in_kernel, this thread's key channel's gate is lower_bound * sigmoid(a (g + dt_bias)), as
        # 2^G units: lb log2(e) / (1 + 2^(-a log2(e) (g + dt_bias)))
        gate = (f32(0.0), f32(0.0), f32(0.0))
        if cutlass.const_expr(self.gate_in_kernel):
            a = cute.math.exp2(gp.a_log[seq.hv] * _LOG2E, fastmath=True)
            gate = (-a * _LOG2E, gp.dt_bias[seq.hv * D + t % D], gp.lower_bound * _LOG2E)
        b_tiles = self.b_tiles(p, gs, seq) if cutlass.const_expr(save) else None
        for chunk in cutlass.range(seq.n_chunks, unroll=1):
            pos = self.chunk_position(chunk, seq)
            L = cutlass.min(seq.seqlen - pos * C, C)
            slot = chunk % 2
            rings.qkg.consumer_wait(qkg_c)
            # ring r's stage is free once every state thread has made the previous chunk's A and P: each one's
            # release orders its own reads of q | k | G before the tail zeroing and the scan below rewrite them (the
            # qkg ring's release, one lane per warp and then a TMA, did not show that order to racecheck)
            rings.r.producer_acquire(r_p)
            if cutlass.const_expr(cfg.is_varlen):
                self.zero_token_tails(sK3[None, None, 0], sQ3[None, None, 0], L, t)
            beta_next = self.stage_beta(gs.sBeta, beta_next, c.beta, seq, chunk, slot, t)
            self.scan_gates(gs, slot, L, t, gate)
            if cutlass.const_expr(cfg.qk_l2norm):
                self.token_norm(smem.sQK, gs.sNorm, t)
            if cutlass.const_expr(save):
                if pwarp == 0:
                    # the previous chunk's B tiles have been read by their store before any prep thread writes them
                    cute.arch.cp_async_bulk_wait_group(0, read=True)
            cute.arch.barrier(barrier_id=Barrier.PRODUCER, number_of_threads=self.prep_threads)
            if cutlass.const_expr(save):
                if t < D:
                    gp.wd[seq.n, chunk, seq.hv, t] = gs.sDec[t, slot]
            # R_j = k_j 2^(G_r - G_j), r the reference token of j's half; |j - r| <= 16 keeps it in range
            if cutlass.const_expr(self.makes_r):
                self.build_r_tile(gs, sK3, t)
            cute.arch.fence_proxy("async.shared", space="cta")
            rings.r.producer_commit(r_p)
            r_p.advance()
            rings.b.producer_acquire(b_p)
            self.build_b_tiles(gs, sK3, sQ3, L, t, c.scale)
            cute.arch.fence_proxy("async.shared", space="cta")
            # every prep thread's reads of the chunk (G_last above all) are done before any of them scans the next:
            # one lane per warp releases the tiles below, which orders its own reads only (racecheck found the
            # next scan's G_last stores racing this chunk's loads)
            cute.arch.barrier(barrier_id=Barrier.PRODUCER, number_of_threads=self.prep_threads)
            if cutlass.const_expr(save):
                if pwarp == 0:
                    self.save_b_tiles(p, b_tiles, chunk)
            rings.b.producer_commit(b_p)
            b_p.advance()
            # this role's reads of q | k | g are done; the state warpgroups' once they made A and P
            rings.qkg.consumer_release(qkg_c)
            qkg_c.advance()
            if pwarp == 0:
                if chunk + 1 < seq.n_chunks:
                    self.issue_qkg(p, rings, qkg_p, loads, self.chunk_position(chunk + 1, seq), seq.n_chunks)
                    self.issue_v(c, rings, v_p, loads, self.chunk_position(chunk + 1, seq))
            qkg_p.advance()
            v_p.advance()
        if cutlass.const_expr(save):
            if pwarp == 0:
                cute.arch.cp_async_bulk_wait_group(0, read=True)

    @cute.jit
    def feed_role(self, p, smem, gs, rings, seq, t, pwarp):
        """The later split passes: per chunk, beta into column c % 2 of ``sBeta`` and the first pass's 2^G_last into
        column c % 2 of ``sDec`` (both loaded a chunk ahead; ring ``b``), and by warp 0 the first pass's B tiles
        (ring ``b_load``, the next chunk's prefetched into L2), Tinv and P (ring ``tp``), and v a chunk ahead of its use
        (two stages), so that its load is not queued behind the wait for the one-stage rings. No gate scan, no tile
        building."""
        D = self.D
        f32 = cutlass.Float32
        c = p.common
        lane = cute.arch.lane_idx()
        loads = self.load_partitions(p, smem, gs, seq)
        b_tiles = self.b_tiles(p, gs, seq)
        tWs, tWg = tiles.tma_chunk_tiles(
            c.w.atom, c.w.tensor[None, None, seq.hv, seq.n], 0, cute.group_modes(smem.sTP, 2, 4)
        )
        b_p = pipeline.producer_start(1)
        bl_p = pipeline.producer_start(1)
        tp_p = pipeline.producer_start(1)
        v_p = pipeline.producer_start(self.v_stages)
        beta_next = c.beta.element_type(0.0)
        dec_next = f32(0.0)
        if pwarp == 0:
            if seq.n_chunks > 0:
                self.issue_v(c, rings, v_p, loads, cutlass.Int32(0))
        v_p.advance()
        if seq.n_chunks > 0:
            beta_next = self.load_beta(c.beta, seq, cutlass.Int32(0), t)
            if t < D:
                dec_next = p.gate.wd[seq.n, 0, seq.hv, t]
        for chunk in cutlass.range(seq.n_chunks, unroll=1):
            slot = chunk % 2
            if pwarp == 0:
                self.issue_b(p, rings, bl_p, b_tiles, chunk, seq.n_chunks)
                rings.tp.producer_acquire(tp_p)
                workspace.load_tinv_p(
                    c.w.atom, tWg, tWs, chunk, 0, rings.tp.producer_get_barrier(tp_p), self.cfg.make_o
                )
                if lane == 0 and chunk + 1 < seq.n_chunks:
                    for i in cutlass.range_constexpr(1 + int(self.cfg.make_o)):
                        cute.prefetch(c.w.atom, tWg[None, 2 * chunk + 2 + i])
                if chunk + 1 < seq.n_chunks:
                    self.issue_v(c, rings, v_p, loads, chunk + 1)
            bl_p.advance()
            tp_p.advance()
            v_p.advance()
            rings.b.producer_acquire(b_p)
            beta_next = self.stage_beta(gs.sBeta, beta_next, c.beta, seq, chunk, slot, t)
            if t < D:
                gs.sDec[t, slot] = dec_next
                dec_next = p.gate.wd[seq.n, cutlass.min(chunk + 1, seq.n_chunks - 1), seq.hv, t]
            rings.b.producer_commit(b_p)
            b_p.advance()

    @cute.jit
    def load_partitions(self, p, smem, gs, seq):
        """The TMA partitions of this head's q, k, g and v planes, shifted to the sequence start, cut in C-token
        tiles: ``(tQs, tQg, tKs, tKg, tGs, tGg, tVs, tVg)``."""
        c, gp = p.common, p.gate
        tQs, tQg = tiles.tma_chunk_tiles(
            c.q.atom, c.q.tensor[None, None, seq.h, seq.b], seq.tok0, smem.sQK[None, None, 0, None]
        )
        tKs, tKg = tiles.tma_chunk_tiles(
            c.k.atom, c.k.tensor[None, None, seq.h, seq.b], seq.tok0, smem.sQK[None, None, 1, None]
        )
        tGs, tGg = tiles.tma_chunk_tiles(gp.g.atom, gp.g.tensor[None, None, seq.hv, seq.b], seq.tok0, gs.sGin3)
        tVs, tVg = tiles.tma_chunk_tiles(c.v.atom, c.v.tensor[None, None, seq.hv, seq.b], seq.tok0, smem.sV, seq.vb)
        return tQs, tQg, tKs, tKg, tGs, tGg, tVs, tVg

    @cute.jit
    def issue_qkg(self, p, rings, state, loads, chunk, n_chunks):
        """One warp (the copies elect their issuing lane): the q, k and g tiles of chunk position ``chunk`` once the
        stage is free (``state``; the caller advances it); and the next one's into L2 (the previous position's in
        the reverse walk), so that its load (issued only once this chunk's tiles are consumed) waits for L2, not for
        HBM."""
        tQs, tQg, tKs, tKg, tGs, tGg, _, _ = loads
        rings.qkg.producer_acquire(state)
        bar = rings.qkg.producer_get_barrier(state)
        atoms = (p.common.q.atom, p.common.k.atom, p.gate.g.atom)
        if cutlass.const_expr(self.loads_q):
            cute.copy(atoms[0], tQg[None, chunk], tQs[None, 0], tma_bar_ptr=bar)
        cute.copy(atoms[1], tKg[None, chunk], tKs[None, 0], tma_bar_ptr=bar)
        cute.copy(atoms[2], tGg[None, chunk], tGs[None, 0], tma_bar_ptr=bar)
        step = -1 if cutlass.const_expr(self.cfg.reverse) else 1
        if chunk + step < n_chunks and chunk + step >= 0 and cute.arch.lane_idx() == 0:
            for which, (atom, tXg) in enumerate(zip(atoms, (tQg, tKg, tGg), strict=True)):
                if cutlass.const_expr(which > 0 or self.loads_q):
                    cute.prefetch(atom, tXg[None, chunk + step])

    @cute.jit
    def issue_v(self, c, rings, state, loads, chunk):
        """One warp: the v tile of ``chunk`` once its stage is free."""
        if cutlass.const_expr(self.cfg.v_from is not None):
            tVs, tVg = loads[6], loads[7]
            rings.v.producer_acquire(state)
            cute.copy(
                c.v.atom, tVg[None, chunk], tVs[None, state.index], tma_bar_ptr=rings.v.producer_get_barrier(state)
            )

    @cute.jit
    def issue_b(self, p, rings, state, b_tiles, chunk, n_chunks):
        """One warp: the first pass's B tiles of ``chunk`` (Q 2^G only when the pass makes o) once the stage is free;
        the next chunk's into L2."""
        tBs, tBg, tKDs, tKDg = b_tiles
        gp = p.gate
        rings.b_load.producer_acquire(state)
        bar = rings.b_load.producer_get_barrier(state)
        cute.copy(gp.wb.atom, tBg[None, 3 * chunk], tBs[None, 0], tma_bar_ptr=bar)
        if cutlass.const_expr(self.cfg.make_o):
            cute.copy(gp.wb.atom, tBg[None, 3 * chunk + 1], tBs[None, 1], tma_bar_ptr=bar)
        cute.copy(gp.wkd.atom, tKDg[None, 3 * chunk + 2], tKDs[None, 0], tma_bar_ptr=bar)
        if chunk + 1 < n_chunks and cute.arch.lane_idx() == 0:
            cute.prefetch(gp.wb.atom, tBg[None, 3 * chunk + 3])
            if cutlass.const_expr(self.cfg.make_o):
                cute.prefetch(gp.wb.atom, tBg[None, 3 * chunk + 4])
            cute.prefetch(gp.wkd.atom, tKDg[None, 3 * chunk + 5])

    @cute.jit
    def save_b_tiles(self, p, b_tiles, chunk):
        """One warp: the chunk's B tiles to their workspace tiles by TMA, as one bulk group (waited for, read, before
        the next chunk's are built)."""
        tBs, tBg, tKDs, tKDg = b_tiles
        cute.copy(p.gate.wb.atom, tBs[None, 0], tBg[None, 3 * chunk])
        cute.copy(p.gate.wb.atom, tBs[None, 1], tBg[None, 3 * chunk + 1])
        cute.copy(p.gate.wkd.atom, tKDs[None, 0], tKDg[None, 3 * chunk + 2])
        cute.arch.cp_async_bulk_commit_group()

    @cute.jit
    def stage_beta(self, sBeta, beta, mBeta, seq, chunk, slot, tidx):
        """Threads 0 .. C - 1: ``beta`` (the ``chunk``-th chunk's in walk order, loaded a chunk ahead) into column
        ``slot`` of ``sBeta`` as fp32, zero past the sequence end; returns the next chunk's, its load issued now."""
        if tidx < self.C:
            inside = self.chunk_position(chunk, seq) * self.C + tidx < seq.seqlen
            sBeta[tidx, slot] = beta.to(cutlass.Float32) if inside else cutlass.Float32(0.0)
        return self.load_beta(mBeta, seq, self.chunk_position(chunk + 1, seq), tidx)

    @cute.jit
    def load_beta(self, mBeta, seq, pos, tidx):
        """beta of token ``tidx % C`` of chunk position ``pos`` as stored: converted (and zeroed past the sequence
        end) where it is used, so that the load stays in flight until then. The token index is clamped into the
        sequence instead of branching (needs seqlen >= 1; the reverse walk's position after its last chunk is -1)."""
        t = cutlass.min(pos * self.C + tidx % self.C, seq.seqlen - 1)
        if cutlass.const_expr(self.cfg.reverse):
            t = cutlass.max(t, 0)
        return mBeta[seq.b, seq.tok0 + t, seq.hv]

    @cute.jit
    def zero_token_tails(self, sK, sQ, L, t):
        """When the chunk ends its sequence early, the k tile's rows ``L`` .. C - 1 (in a varlen call the next
        sequence's tokens, NaN included) zeroed by the prep threads before anything reads them: every product that
        masks those tokens by a zero factor (beta in A and Y, the B tiles) then stays finite. The state-gradient walk
        with the delta rule zeroes q's too: it sums over P's rows and Q 2^G's (dO^T P, dO^T Q~), whose dO rows are
        zero there. Ordered for the prep role by a barrier, for the state warpgroups by ring ``r``, for the stage's
        next TMA write by the fence before ring ``b``'s commit (``L`` is the same on every prep thread). A
        fixed-length call needs none: its tiles end at the tensor's bound, where TMA fills zeros."""
        if L < self.C:
            tiles.zero_rows_from(sK, L, t, self.prep_threads)
            if cutlass.const_expr(self.reverse_delta):
                tiles.zero_rows_from(sQ, L, t, self.prep_threads)
            cute.arch.barrier(barrier_id=Barrier.PRODUCER, number_of_threads=self.prep_threads)

    @cute.jit
    def scan_gates(self, gs, slot, L, t, gate):
        """G = inclusive cumsum of the chunk's gates over its tokens, in log2 units, into ``sG`` (C, D) fp32; G_last
        into ``sGl`` and 2^G_last into column ``slot`` of ``sDec`` per key channel. Thread t scans channel t % D over
        token part t // D (the tokens' gates from ``sGin``, activated first with gate_in_kernel: ``gate`` is
        (-a log2(e), dt_bias of the channel, lower_bound log2(e))), then adds the totals of the parts before its own.
        Tokens at or past ``L`` add 0. ``sGin`` may be ``sG`` itself (each thread reads its own cells before it writes
        them)."""
        f32 = cutlass.Float32
        sG = gs.sG
        ch = t % self.D
        part = t // self.D
        run = f32(0.0)
        # the part is warp-uniform: one unrolled copy per part, so that every token row is a compile-time constant
        # and each address a register plus an immediate (a runtime row costs integer instructions per element)
        for pp in cutlass.range_constexpr(self.scan_parts):
            if part == pp:
                run = self.scan_part(gs.sGin, sG, pp * (self.C // self.scan_parts), L, ch, gate)
        if cutlass.const_expr(self.scan_parts > 1):
            gs.sPart[part, ch] = run
            cute.arch.barrier(barrier_id=Barrier.PRODUCER, number_of_threads=self.prep_threads)
            off = f32(0.0)
            for pp in cutlass.range_constexpr(self.scan_parts - 1):
                if pp < part:
                    off = off + gs.sPart[pp, ch]
            for pp in cutlass.range_constexpr(1, self.scan_parts):
                if part == pp:
                    n = self.C // self.scan_parts
                    for tt in cutlass.range_constexpr(n):
                        sG[pp * n + tt, ch] = sG[pp * n + tt, ch] + off
            run = run + off
        if part == self.scan_parts - 1:
            gs.sGl[ch] = run
            gs.sDec[ch, slot] = cute.math.exp2(run, fastmath=True)

    @cute.jit
    def scan_part(self, sGin, sG, t0: cutlass.Constexpr, L, ch, gate):
        """Channel ``ch``'s running sum over tokens [t0, t0 + C / parts), written to ``sG``; returns the part's total.
        8 tokens are loaded (and activated) before their sums are written."""
        f32 = cutlass.Float32
        gv = cute.make_rmem_tensor(cute.make_layout(8), f32)
        run = f32(0.0)
        for tb in cutlass.range_constexpr(self.C // self.scan_parts // 8):
            for tt in cutlass.range_constexpr(8):
                gv[tt] = sGin[t0 + 8 * tb + tt, ch].to(f32)
            for tt in cutlass.range_constexpr(8):
                x = gv[tt] * _LOG2E
                if cutlass.const_expr(self.gate_floor is not None):
                    x = cute.arch.fmax(x, f32(self.gate_floor * _LOG2E))
                if cutlass.const_expr(self.gate_in_kernel):
                    neg_a, dt, lb = gate
                    e = cute.math.exp2(neg_a * (gv[tt] + dt), fastmath=True)
                    x = lb * cute.arch.rcp_approx(f32(1.0) + e)
                if t0 + 8 * tb + tt < L:
                    run = run + x
                sG[t0 + 8 * tb + tt, ch] = run
        return run

    @cute.jit
    def token_norm(self, sQK, sNorm, t):
        """qk_l2norm: 1 / sqrt(||x||^2 + eps) of token ``t % C``'s k (``t < C``) or q, into ``sNorm`` (column 0 k,
        1 q)."""
        which = t // self.C
        tile = sQK[None, None, 1 - which, 0]
        acc = tiles.row_sum_squares(tile, t % self.C, 0, self.D // 8)
        sNorm[t % self.C, which] = cute.math.rsqrt(acc + cutlass.Float32(L2NORM_EPS), fastmath=True)

    @cute.jit
    def build_r_tile(self, gs, sK3, t):
        """R_j = k_j 2^(G_r - G_j) for the chunk's tokens j, r = 16 or 48 the reference token of j's 32-token half,
        into that half of ``sR``: thread t owns key channels 2p, 2p + 1 (p = t % (D / 2)) for its group of 8-token
        blocks (t // (D / 2)), 4 tokens at a time, the token's low 3 bits compile-time (as in
        :meth:`build_b_tiles`)."""
        f32 = cutlass.Float32
        bf16 = cutlass.BFloat16
        C, D, Hf = self.C, self.D, self.half
        sG, sR, sNorm = gs.sG, gs.sR, gs.sNorm
        pairs = D // 2
        groups = self.prep_threads // pairs
        per_group = C // 8 // groups
        p = t % pairs
        grp = t // pairs
        gr = cute.make_rmem_tensor(cute.make_layout((1, 2)), f32)
        r2 = cute.make_rmem_tensor(cute.make_layout((1, 2)), f32)
        for bi in cutlass.range(per_group, unroll=1):
            jb = grp * per_group + bi
            hf = (jb * 8) // Hf
            sRh = sR[None, None, hf]
            cute.autovec_copy(cute.local_tile(sG, (1, 2), (Hf * hf + Hf // 2, p)), gr)
            for sub in cutlass.range_constexpr(2):
                # the loads of 4 tokens before their stores (a later load never passes an earlier store to shared
                # memory)
                g2, k2, nk = self.load_tokens(sG, sK3[None, None, 0], sNorm, 0, jb * 8 + 4 * sub, p)
                for jj in cutlass.range_constexpr(4):
                    j = jb * 8 + 4 * sub + jj
                    kx = k2[jj].load().to(f32)
                    if cutlass.const_expr(self.cfg.qk_l2norm):
                        kx = kx * nk[jj]
                    for e in cutlass.range_constexpr(2):
                        r2[0, e] = kx[e] * cute.math.exp2(gr[0, e] - g2[jj][0, e], fastmath=True)
                    cute.local_tile(sRh, (1, 2), (j - Hf * hf, p)).store(r2.load().to(bf16))

    def load_tokens(self, sG, sX, sNorm, which, j0, p):
        """The gates (unless ``sG`` is None) and x values (channel pair p) of tokens j0 .. j0 + 3 and, with qk_l2norm,
        their 1 / ||x|| (``which``: 0 k, 1 q), as lists of 4 register pairs (scalars). A plain helper, unrolled where
        it is traced."""
        g2, x2, nx = [], [], []
        for jj in range(4):
            j = j0 + jj
            if sG is not None:
                g2.append(cute.make_rmem_tensor(cute.make_layout((1, 2)), cutlass.Float32))
                cute.autovec_copy(cute.local_tile(sG, (1, 2), (j, p)), g2[jj])
            x2.append(cute.make_rmem_tensor(cute.make_layout((1, 2)), cutlass.BFloat16))
            cute.autovec_copy(cute.local_tile(sX, (1, 2), (j, p)), x2[jj])
            if self.cfg.qk_l2norm:
                nx.append(sNorm[j, which])
        return g2, x2, nx

    @cute.jit
    def build_b_tiles(self, gs, sK3, sQ3, L, t, scale):
        """The B tiles of the chunk's state products (``t`` in [0, 128)): K 2^G and Q 2^G (K-major; Q 2^G only in a
        pass that makes o, and scaled in the state-gradient walk with the delta rule) and K 2^(G_last - G) (MN-major,
        0 past the sequence end; in the state-gradient walk without the delta rule, whose key place holds q, scale
        Q 2^G instead: the update's operand there). Thread t owns key channels 2p,
        2p + 1 (p = t % (D / 2), read and written as pairs) for one group of 8-token blocks (t // (D / 2)), 4 tokens
        at a time; within a block the token's low 3 bits are compile-time, so the 128B-swizzled addresses cost an
        XOR each."""
        f32 = cutlass.Float32
        bf16 = cutlass.BFloat16
        C, D = self.C, self.D
        sG, sNorm = gs.sG, gs.sNorm
        sKG, sQG, sKD = gs.sXG[None, None, 0], gs.sXG[None, None, 1], gs.sKD
        pairs = D // 2
        groups = self.prep_threads // pairs
        per_group = C // 8 // groups  # 8-token blocks per group
        p = t % pairs
        grp = t // pairs
        gl = cute.make_rmem_tensor(cute.make_layout((1, 2)), f32)
        cute.autovec_copy(cute.local_tile(gs.sGl, (2,), (p,)), cute.make_tensor(gl.iterator, cute.make_layout(2)))
        kg2 = cute.make_rmem_tensor(cute.make_layout((1, 2)), f32)
        qg2 = cute.make_rmem_tensor(cute.make_layout((1, 2)), f32)
        kd2 = cute.make_rmem_tensor(cute.make_layout((2, 1)), f32)
        for bi in cutlass.range(per_group, unroll=1):
            jb = grp * per_group + bi
            for sub in cutlass.range_constexpr(2):
                # the loads before the stores, as in build_r_tile
                j0 = jb * 8 + 4 * sub
                g2, k2, nk = self.load_tokens(sG, sK3[None, None, 0], sNorm, 0, j0, p)
                if cutlass.const_expr(self.makes_q_tile):
                    _, q2, nq = self.load_tokens(None, sQ3[None, None, 0], sNorm, 1, j0, p)
                for jj in cutlass.range_constexpr(4):
                    j = j0 + jj
                    kx = k2[jj].load().to(f32)
                    if cutlass.const_expr(self.cfg.qk_l2norm):
                        kx = kx * nk[jj]
                    eg = [cute.math.exp2(g2[jj][0, e], fastmath=True) for e in range(2)]
                    for e in cutlass.range_constexpr(2):
                        kg2[0, e] = kx[e] * eg[e]
                        kd = f32(0.0)
                        if j < L:
                            if cutlass.const_expr(self.cfg.reverse and not self.cfg.delta_rule):
                                kd = kx[e] * eg[e] * scale
                            else:
                                kd = kx[e] * cute.math.exp2(gl[0, e] - g2[jj][0, e], fastmath=True)
                        kd2[e, 0] = kd
                    if cutlass.const_expr(self.makes_k_tile):
                        cute.local_tile(sKG, (1, 2), (j, p)).store(kg2.load().to(bf16))
                    cute.local_tile(sKD, (2, 1), (p, j)).store(kd2.load().to(bf16))
                    if cutlass.const_expr(self.makes_q_tile):
                        qx = q2[jj].load().to(f32)
                        if cutlass.const_expr(self.cfg.qk_l2norm):
                            qx = qx * nq[jj]
                        if cutlass.const_expr(self.reverse_delta):
                            qx = qx * scale
                        for e in cutlass.range_constexpr(2):
                            qg2[0, e] = qx[e] * eg[e]
                        cute.local_tile(sQG, (1, 2), (j, p)).store(qg2.load().to(bf16))

    # ---------------------------------------------------------------- state warpgroups
    def state_ring_states(self):
        return StateRings(pipeline.consumer_start(1))

    @cute.jit
    def before_chunks(self, smem, stid):
        # Tinv's blocks above the diagonal stay zero (ordered by the first chunk's barriers)
        if cutlass.const_expr(not self.feeds):
            solve.solve_clear(smem.sTP[None, None, 0, 0], stid, self.layout.threads_of(WarpGroupRole.STATE))

    @cute.jit
    def intra_step(self, p, smem, gs, rings, states, seq, chunk, stid, swarp):
        """Warpgroup 0 makes A = strict-lower(beta_i sum_k K_ik K_jk 2^(G_ik - G_jk)), warpgroup 1 P = lower(scale Q
        ...), from left operands x_i 2^(G_i - G_r) built in registers against R's halves (rows before the second
        half's block are zero: their factor against r = 48 would overflow and their entries are above the
        diagonal); then Tinv = (I + A)^-1 by 16-blocks: warps 0-1 invert the diagonal blocks, warps 0-3 join them.
        In the first split pass Tinv and P also go to the workspace."""
        C, Hf = self.C, self.half
        f32 = cutlass.Float32
        bf16 = cutlass.BFloat16
        c, gp = p.common, p.gate
        wg = stid // 128
        wtid = stid % 128
        slot = chunk % 2
        nt = self.layout.threads_of(WarpGroupRole.STATE)
        sT = smem.sTP[None, None, 0, 0]
        sP = smem.sTP[None, None, 1, 0]
        thr_h = gp.mma_half.get_slice(wtid)
        thr_st = c.mma_state.get_slice(wtid)
        tHb_R = thr_h.make_fragment_B(thr_h.partition_B(gs.sR))
        cH = thr_h.partition_C(cute.make_identity_tensor((C, Hf)))
        cST = thr_st.partition_C(cute.make_identity_tensor((C, self.D)))
        # the prep role has scanned the gates and made R (its ring), and the tiles have landed (their own ring: the
        # TMA writes are then ordered for these threads as well)
        rings.r.consumer_wait(states.chunk)
        rings.qkg.consumer_wait(states.chunk)
        # built in pairs and converted two at a time (bf16x2), so every operand register is final before the wgmma
        # fence (a register packed after it makes ptxas fence each k-block: C7519)
        l0 = mma.empty_operand(cute.size(cST))
        l1 = mma.empty_operand(cute.size(cST))
        l0_flat = cute.make_tensor(l0.iterator, cute.make_layout(cute.size(cST)))
        l1_flat = cute.make_tensor(l1.iterator, cute.make_layout(cute.size(cST)))
        p0 = cute.make_rmem_tensor(cute.make_layout((1, 2)), f32)
        p1 = cute.make_rmem_tensor(cute.make_layout((1, 2)), f32)
        x2 = cute.make_rmem_tensor(cute.make_layout((1, 2)), bf16)
        g2 = cute.make_rmem_tensor(cute.make_layout((1, 2)), f32)
        r0 = cute.make_rmem_tensor(cute.make_layout((1, 2)), f32)
        r1 = cute.make_rmem_tensor(cute.make_layout((1, 2)), f32)
        sX = smem.sQK[None, None, 1 - wg, 0]  # warpgroup 0's rows are k, warpgroup 1's q
        # per 8-column block i // 4 the thread holds 2 adjacent columns on 2 rows: the references' gates are loaded
        # once for both rows, and x and G as pairs
        for blk in cutlass.range_constexpr(cute.size(cST) // 4):
            _, kb = cST[4 * blk]
            cute.autovec_copy(cute.local_tile(gs.sG, (1, 2), (Hf // 2, kb // 2)), r0)
            cute.autovec_copy(cute.local_tile(gs.sG, (1, 2), (Hf + Hf // 2, kb // 2)), r1)
            for rr in cutlass.range_constexpr(2):
                i = 4 * blk + 2 * rr
                ri, x = operand_pair(sX, gs.sG, cST[i], x2, g2)
                if cutlass.const_expr(self.cfg.qk_l2norm):
                    x = x * gs.sNorm[ri, wg]
                for e in cutlass.range_constexpr(2):
                    p0[0, e] = x[e] * cute.math.exp2(g2[0, e] - r0[0, e], fastmath=True)
                    x1 = f32(0.0)
                    if ri >= Hf:
                        x1 = x[e] * cute.math.exp2(g2[0, e] - r1[0, e], fastmath=True)
                    p1[0, e] = x1
                cute.local_tile(l0_flat, (2,), (i // 2,)).store(p0.load().to(bf16))
                cute.local_tile(l1_flat, (2,), (i // 2,)).store(p1.load().to(bf16))
        acc0 = thr_h.make_fragment_C(thr_h.partition_shape_C((C, Hf)))
        acc1 = thr_h.make_fragment_C(thr_h.partition_shape_C((C, Hf)))
        warpgroup.fence()
        mma.gemm(gp.mma_half, acc0, l0, tHb_R[None, None, None, 0], True)
        mma.gemm(gp.mma_half, acc1, l1, tHb_R[None, None, None, 1], True)
        warpgroup.commit_group()
        warpgroup.wait_group(0)
        # q, k, G and R of the chunk are no longer read here: the prep role may load the next chunk's
        rings.qkg.consumer_release(states.chunk)
        rings.r.consumer_release(states.chunk)
        if wg == 0:
            for i in cutlass.range_constexpr(cute.size(acc0)):
                ra, ja = cH[i]
                bi = gs.sBeta[ra, slot]  # 0 past the sequence end (k is zero there: zero_token_tails)
                va = f32(0.0)
                if ja < ra:
                    va = acc0[i] * bi
                # stored transposed: the solver walks A column by column
                smem.sA[ja, ra] = va
                vb = f32(0.0)
                if ja + Hf < ra:
                    vb = acc1[i] * bi
                smem.sA[ja + Hf, ra] = vb
        elif cutlass.const_expr(self.makes_p):
            # P leaves the accumulators by stmatrix, a half at a time (row addresses per 8 x 8 matrix, not one
            # swizzled address per element)
            st_p = cute.make_tiled_copy_C(
                cute.make_copy_atom(warp_ops.StMatrix8x8x16bOp(transpose=False, num_matrices=4), bf16), gp.mma_half
            )
            thr_stp = st_p.get_slice(wtid)
            for half, acc in enumerate((acc0, acc1)):
                store_score_half(acc, cH, half, c.scale, st_p, thr_stp, sP)
        cute.arch.fence_proxy("async.shared", space="cta")
        cute.arch.barrier(barrier_id=Barrier.STATE, number_of_threads=nt)
        if swarp < 2:
            solve.solve_diag16(smem.sA, sT, stid)
        cute.arch.barrier(barrier_id=Barrier.STATE, number_of_threads=nt)
        solve.solve_merge(smem.sA, sT, stid, Barrier.STATE, nt)
        cute.arch.fence_proxy("async.shared", space="cta")
        cute.arch.barrier(barrier_id=Barrier.STATE, number_of_threads=nt)
        if cutlass.const_expr(self.cfg.intra == "save"):
            # this chunk's Tinv and P to the workspace; warp 0 waits for the stores to have read them before the
            # chunk's closing barrier (before_chunk_end), after which the next chunk writes them again
            if swarp == 0:
                tWs, tWg = tiles.tma_chunk_tiles(
                    c.w.atom, c.w.tensor[None, None, seq.hv, seq.n], 0, cute.group_modes(smem.sTP, 2, 4)
                )
                workspace.save_tinv_p(c.w.atom, tWs, tWg, chunk)

    @cute.jit
    def chain_inputs(self, p, smem, gs, rings, states, seq, chunk):
        # the B tiles are made (or loaded)
        rings.b.consumer_wait(states.chunk)
        if cutlass.const_expr(self.feeds):
            rings.b_load.consumer_wait(states.chunk)
        gates = KeyChainGates(gs.sBeta, gs.sDec, chunk % 2, p.common.scale)
        if cutlass.const_expr(self.reverse_delta):
            # dS'^T (K 2^(G_last - G))^T, then the update against scale Q 2^G and K 2^G read MN-major
            sKD_k = tiles.mn_view(gs.sKD3, p.gate.tile_kd_k)[None, None, 0]
            sXG_mn = tiles.mn_view(gs.sXG, p.gate.tile_xg_mn)
            return ChainInputs(sKD_k, gs.sXG[None, None, 1], sXG_mn[None, None, 0], gates, sXG_mn[None, None, 1])
        return ChainInputs(gs.sXG[None, None, 0], gs.sXG[None, None, 1], gs.sKD, gates)

    @cute.jit
    def chain_release(self, rings, states):
        # the B tiles are free for the next chunk's
        rings.b.consumer_release(states.chunk)
        if cutlass.const_expr(self.feeds):
            rings.b_load.consumer_release(states.chunk)
        states.chunk.advance()
        return states

    @cute.jit
    def before_chunk_end(self, p, smem, gs, seq, chunk, swarp):
        if cutlass.const_expr(self.cfg.intra == "save"):
            if swarp == 0:
                cute.arch.cp_async_bulk_wait_group(0, read=True)


@cute.jit
def operand_pair(sX, sG, coord, x2, g2):
    """The two adjacent columns at ``coord`` (row, even column) of a bf16 token tile ``sX``: ``(row, the pair as
    fp32)``, with their cumulative gates loaded into ``g2`` (``x2``: the bf16 staging registers)."""
    ri, ki = coord
    cute.autovec_copy(cute.local_tile(sX, (1, 2), (ri, ki // 2)), x2)
    cute.autovec_copy(cute.local_tile(sG, (1, 2), (ri, ki // 2)), g2)
    return ri, x2.load().to(cutlass.Float32)


@cute.jit
def store_score_half(acc, cH, half: cutlass.Constexpr, scale, st_p, thr_stp, sP):
    """Half ``half`` of the intra-chunk scores P (C x C bf16 ``sP``): the (C x C/2) accumulator ``acc`` (coordinates
    ``cH``) scaled where its column lies on or below the diagonal, else zero (a select: a masked entry's value never
    reaches P), stored by the stmatrix copy ``st_p`` (this thread's slice ``thr_stp``)."""
    C = cute.size(sP, mode=[0])
    Hf = C // 2
    p_frag = cute.make_rmem_tensor(acc.layout, cutlass.BFloat16)
    for i in cutlass.range_constexpr(cute.size(acc)):
        rp, jp = cH[i]
        vp = cutlass.Float32(0.0)
        if jp + half * Hf <= rp:
            vp = acc[i] * scale
        p_frag[i] = vp.to(cutlass.BFloat16)
    cute.copy(st_p, thr_stp.retile(p_frag), thr_stp.partition_D(cute.local_tile(sP, (C, Hf), (0, half))))


# -------------------------------------------------------------------- host side: KDA's place in the SM90 path
def supports(q, k, v, g=None, beta=None, initial_state=None, cu_seqlens=None, **_) -> tuple[bool, str]:
    """Whether :func:`chunk_kda_fwd_sm90` can serve these inputs, and why not. The gate bound (g >= -5) is the
    caller's promise (FLA's ``safe_gate``) and is not checked here. g: fp32 (activated), or bf16 (raw, activated by
    the kernel: the entry's ``gate``)."""
    ok, why = entry.supports_qkv(q, k, v, beta, initial_state, cu_seqlens, SUPPORTED_DIMS)
    if not ok:
        return ok, why
    if g is not None and (
        g.dtype not in (torch.float32, torch.bfloat16) or tuple(g.shape) != (*v.shape[:3], q.shape[-1])
    ):
        return False, "g must be float32 or bfloat16 [B, T, HV, K]"
    return True, ""


def split_cost(call: entry.ChunkCall) -> segment_split.SplitCost:
    """The split passes' costs on the call's GPU (:func:`cula.devices.times_for`)."""
    return devices.times_for(call.q.device).kernels["kda"].split


def compile_kda_fwd_sm90(
    arch="sm_90a",
    *,
    beta_fp32=True,
    state_v_first=False,
    gate_in_kernel=False,
    keep_artifacts=False,
    **config,
):
    """The KDA chunk kernel for ``config`` (:class:`cula.sm90.chunk_fwd.ChunkFwdConfig` fields), compiled on any
    machine for ``arch``."""
    cfg = ChunkFwdConfig(**config)
    fake = entry.fake_args(
        cfg.head_dim, beta_fp32, state_v_first, per_key_gate=True, raw_gate=gate_in_kernel,
        checkpoints=cfg.walk != "output", config=cfg,
    )  # fmt: skip
    return runtime.compile_kernel(KDAChunkFwdSm90(cfg, gate_in_kernel), fake, arch, keep_artifacts)


def split_workspaces(ranges: int, chunks: int, HV: int, D: int, device) -> dict:
    """The B-tile workspaces of a split call (besides Tinv and P's): for each range, chunk and value head the first
    pass's K 2^G, Q 2^G and K 2^(G_last - G) (bf16, 3 C rows of D) and 2^G_last (fp32, D)."""
    return {
        "wb": torch.empty(ranges, chunks * 3 * CHUNK, HV, D, dtype=torch.bfloat16, device=device),
        "wd": torch.empty(ranges, chunks, HV, D, dtype=torch.float32, device=device),
    }


def gate_args(call: entry.ChunkCall, t: entry.LaunchTensors) -> tuple:
    """KDA's kernel arguments after ``scale``: A_log, dt_bias, lower_bound (zeros and the bound's floor when the gate
    arrives activated: exp(0) = 1, + 0) and the B-tile workspaces (zeros outside a split)."""
    dev, HV, D = t.q.device, t.v.shape[2], t.q.shape[3]
    a_log, dt_bias, lower_bound = call.gate if call.gate is not None else (None, None, LOWER_BOUND_MIN)

    def param(x, n):
        return entry.cached_zeros(dev, (n,), torch.float32) if x is None else x.float().contiguous()

    spaces = t.workspaces or {
        "wb": entry.cached_zeros(dev, (1, 3 * CHUNK, HV, D), torch.bfloat16),
        "wd": entry.cached_zeros(dev, (1, 1, HV, D), torch.float32),
    }
    return param(a_log, HV), param(dt_bias, HV * D), float(lower_bound), spaces["wb"], spaces["wd"]


KDA_SM90 = entry.ChunkKernel(
    "kda",
    compile_kda_fwd_sm90,
    gate_args=gate_args,
    split_cost=split_cost,
    workspaces=split_workspaces,
    options=lambda call: {"gate_in_kernel": call.gate is not None},
    # an H100 timed B1 T8192 H64 at 0.996 ms so against 0.876 split in two
    splits_values="when asked",
)


def chunk_kda_fwd_sm90(*args, **kwargs):
    """KDA chunked forward on SM90: :class:`cula.sm90.entry.ChunkCall`'s fields (q, k, v, g, beta, scale, ... in
    FLA's order), positionally or by name. ``g`` must satisfy g >= -5 (FLA's ``safe_gate``). ``gate``: ``(A_log,
    dt_bias, lower_bound)`` (FLA's ``use_gate_in_kernel`` with a lower bound in [-5, 0); A_log [HV] and dt_bias
    [HV * K] may be None): g is then the raw bf16 gate input and the kernel applies lower_bound * sigmoid(exp(A_log)
    (g + dt_bias)). Returns ``(o, final_state or None)``."""
    call = entry.ChunkCall(*args, **kwargs)
    want = torch.float32 if call.gate is None else torch.bfloat16
    if call.g.dtype != want:
        raise TypeError(
            f"g must be {want} {'(activated)' if call.gate is None else '(raw, with gate)'}, got {call.g.dtype}"
        )
    return entry.chunk_fwd(KDA_SM90, call)


entry.register_checked(
    "kda_chunk_fwd_sm90",
    compile_kda_fwd_sm90,
    {
        **entry.checked(
            *entry.DELTA_CONFIGS,
            *entry.WALK_CONFIGS,
            "[D=64, states walk]",
            "[D=64, state-gradient walk]",
            *entry.VALUE_BLOCK_CONFIGS,
        ),
        "[gate in kernel]": {"is_varlen": True, "has_initial_state": True, "gate_in_kernel": True},
        "[gate in kernel, D=64, qk_l2norm]": {"head_dim": 64, "gate_in_kernel": True, "qk_l2norm": True},
        "[gate in kernel, intra load, correction]": {
            "is_varlen": True,
            "mode": "correction",
            "intra": "load",
            "gate_in_kernel": True,
        },
        # what FLA's KDA layer calls (the benchmark's setting)
        "[gate in kernel, qk_l2norm, bf16 beta, fixed length]": {
            "beta_fp32": False,
            "qk_l2norm": True,
            "gate_in_kernel": True,
        },
    },
    # measured: the state warpgroups (224 registers) reload loop invariants (shared-memory addresses of the A and
    # Tinv stores) from local memory each chunk; at D = 64 ptxas drops setmaxnreg and every role has 168
    sass_allowed={
        "": (30, 0),
        "[D=64, intra load, correction]": (24, 29),
        "[D=64, intra save]": (120, 0),
        "[D=64]": (120, 0),
        "[correction]": (28, 0),
        "[fixed length]": (6, 0),
        "[value blocks]": (14, 0),
        "[value blocks, fixed length]": (6, 0),
        "[value blocks, correction]": (28, 0),
        "[pool]": (30, 0),
        "[bf16 pool]": (30, 0),
        "[gate in kernel, D=64, qk_l2norm]": (66, 0),
        "[gate in kernel, intra load, correction]": (8, 0),
        "[gate in kernel, qk_l2norm, bf16 beta, fixed length]": (8, 0),
        "[gate in kernel]": (30, 0),
        "[intra load, correction]": (8, 0),
        "[intra save]": (32, 0),
        "[qk_l2norm, intra load, correction]": (8, 0),
        "[qk_l2norm, intra save]": (16, 0),
        "[qk_l2norm]": (30, 0),
        "[transition]": (28, 0),
        # the backward's walks: measured, which values spill not yet read
        "[states walk]": (33, 0),
        "[state-gradient walk]": (32, 0),
        "[state-gradient walk, fixed length]": (90, 0),
    },
)
