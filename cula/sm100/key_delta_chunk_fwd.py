"""The per-key-gate chunk forward on SM100 with the delta rule (KDA): the delta-rule kernel of
:mod:`cula.sm100.delta_chunk_fwd` (chunks of C = 128, tcgen05 MMAs, the fp32 state S^T in TMEM across the whole
sequence) with the per-key gate of :class:`cula.sm100.key_chunk_fwd.KeyGate`, and each chunk's Tinv and scores P~
given.

Math per chunk (G the chunk's inclusive cumulative gate per key channel in log2 units, s the scale):

    P~    = tril(s sum_k Q_ik K_jk 2^(G_ik - G_jk))                  (bf16, given)
    Tinv  = (I + strict_tril(beta_i sum_k K_ik K_jk 2^(G_ik - G_jk)))^-1   (bf16, given)
    Q~    = s 2^G * q,  K^ = 2^G * k,  K~ = 2^(G_last - G) * k          (bf16; Q~ and K~ in place of q and k)
    Y     = beta (V - K^ S)                                             (bf16 hi + lo)
    V_new = Tinv Y                                                      (bf16 hi + lo)
    O     = Q~ S + P~ V_new
    S^T  <- S^T diag(2^G_last) + V_new^T K~

Both intra-chunk matrices carry the per-key factor inside their sum over k, so they are made before the launch with
each chunk's Tinv, once per call (``w`` [B, T, HV, 2 C] bf16: token t's row of its chunk's Tinv, then of its P~;
:func:`cula.kda.chunk_fwd_sm100.chunk_intra`), and loaded by TMA as the stage's planes 3 and 4. The kernel keeps the
chain: six tcgen05 products per chunk, M = 128 throughout:

| product | M x N x K | A | B | accumulator |
|---|---|---|---|---|
| K^ S | C x V x K | K^ (Y lo's tile) | S^T bf16 | X (384-511) |
| O = Q~ S | C x V x K | Q~ | S^T bf16 | O (128-255) |
| V_new = Tinv Y | C x V x (C + C) | Tinv | Y hi, Y lo (MN-major) | X |
| O += P~ V_new | C x V x (C + C) | P~ | V_new hi, lo (MN-major) | O |
| S^T += V_new^T K~ | V x K x (C + C) | V_new hi, lo (MN-major) | K~ (MN-major) | S^T (256-383) |

Shared memory: the stage (q | k | v | Tinv | P~, 160 KB), S^T's bf16 operand and Y's low half (32 KB each), the decay
slots. Y lo's tile first holds K^ (made by the walk once the last chunk's update has read V_new lo there), and Y lo
goes over it once K^ S is done.

Roles as the delta-rule kernel's, but the gate warp idles and the scores warpgroup walks the gate (thread k: key
channel k): per chunk G into its TMEM lane of G^T (columns 0-127, P's place in the scalar kernels) and 2^G_last into
a gate slot for the state warpgroup; once the stage has landed, Q~ over q (where the pass makes O), K^ into Y lo's
tile and K~ over k (zero past the sequence end), handed to the MMA warp through ``scores`` before K^ S. The output
warpgroup makes Y and V_new without factors (the keys carry them). A split sequence's later passes run as the
delta-rule kernel's (v not loaded; the transition pass from S = I without Q~, P~ or an output). The forward only,
D = 128. Shapes and launch arguments as :mod:`cula.sm100.delta_chunk_fwd`'s, but g [B, T, HV, K] fp32 (activated:
the natural-log gate per key channel) and ``w`` the Tinv | P~ rows.
"""

from __future__ import annotations

import math
from typing import NamedTuple

import cutlass
import cutlass.cute as cute
from cutlass import pipeline

from cula.ops.gates import GATE_FLOOR
from cula.sm90 import tiles
from cula.sm90.chunk_fwd import ChunkFwdConfig
from cula.sm100 import mma, tmem
from cula.sm100.delta_chunk_fwd import DeltaChunkFwdSm100, DeltaParams, DeltaRings
from cula.sm100.key_chunk_fwd import KeyGate
from cula.sm100.roles import WARPGROUP
from cula.sm100.scalar_chunk_fwd import CHUNK, GATE_SLOTS, Sequence, Tma, stage_plane_tma

_LOG2E = math.log2(math.e)

# the delta-rule kernel's parameters, and P~'s TMA (the workspace's second half)
KeyDeltaParams = NamedTuple("KeyDeltaParams", [*DeltaParams.__annotations__.items(), ("scores", Tma)])


class KeyDeltaSmem(NamedTuple):
    sQKV: cute.Tensor  # (C, D, q|k|v|Tinv|P~, 1) K-major
    sQKV_mn: cute.Tensor  # (D, C, q|k|v|Tinv|P~, 1) MN-major
    sP: cute.Tensor  # P~ (C, C): the stage's last plane
    sS: cute.Tensor  # S^T bf16 (V, K)
    sY: cute.Tensor  # K^, then Y lo, then V_new lo (C, V)
    sY_mn: cute.Tensor  # (V, C)
    sDec: cute.Tensor  # 2^G_last per key channel and gate slot (D, GATE_SLOTS)


class KeyDeltaAccumulators(NamedTuple):
    """G^T (lane k: key channel k, a column per token), O, S^T and X (K^ S, then V_new)."""

    g: cute.Tensor
    o: cute.Tensor
    s: cute.Tensor
    x: cute.Tensor


def workspace_half(w, half: int):
    """Columns ``C half`` .. ``C (half + 1)`` of the ``[B, T, HV, 2 C]`` workspace, as a ``[B, T, HV, C]`` tensor."""
    return cute.make_tensor(w.iterator + half * CHUNK, cute.make_layout((*w.shape[:3], CHUNK), stride=w.stride))


class KeyDeltaChunkFwdSm100(KeyGate, DeltaChunkFwdSm100):
    """The kernel (module docstring); ``cfg`` a :class:`cula.sm90.chunk_fwd.ChunkFwdConfig` with the delta rule at
    D = 128: the forward, or a split's transition or correction pass."""

    gate_on_keys = True

    def __init__(self, config: ChunkFwdConfig):
        super().__init__(config)
        # P~ is given: the scores warpgroup walks the gate in every pass instead
        self.makes_scores = False
        self.loaded_planes = self.planes = 5
        self.loaded_tiles = self.loaded_tiles + ((4,) if config.make_o else ())
        # the gate ring's producer (the walk) and consumer (the state warpgroup)
        self.gate_threads = (WARPGROUP, WARPGROUP)

    # ---------------------------------------------------------------- host side
    def host_params(self, q, k, v, g, beta, o, h0, ht, starts, ends, w, slots, scale):
        params, fields = super().host_params(
            q, k, v, g, beta, o, h0, ht, starts, ends, workspace_half(w, 0), slots, scale
        )
        tma_scores = stage_plane_tma(workspace_half(w, 1), params.tile_qkv)
        # P~ is the stage's last plane, and the per-key decays take the scalar gate's place (231424 bytes in all)
        for name in ("sP", "sG"):
            del fields[name]
        fields["sDec"] = cute.struct.Align[cute.struct.MemRange[cutlass.Float32, self.D * GATE_SLOTS], 16]
        return KeyDeltaParams(*params, tma_scores), fields

    # ---------------------------------------------------------------- device side
    def make_smem(self, st, p: KeyDeltaParams) -> KeyDeltaSmem:
        sQKV = st.sQKV.get_tensor(p.tile_qkv.outer, swizzle=p.tile_qkv.inner)
        sY = st.sY.get_tensor(p.tile_y.outer, swizzle=p.tile_y.inner)
        return KeyDeltaSmem(
            sQKV,
            tiles.mn_view(sQKV, p.tile_qkv_mn),
            sQKV[None, None, 4, 0],
            st.sS.get_tensor(p.tile_s.outer, swizzle=p.tile_s.inner),
            sY,
            tiles.mn_view(sY, p.tile_y_mn),
            st.sDec.get_tensor(cute.make_layout((self.D, GATE_SLOTS))),
        )

    def accumulators(self, p: KeyDeltaParams, tmem_base) -> KeyDeltaAccumulators:
        return KeyDeltaAccumulators(*super().accumulators(p, tmem_base))

    def load_sources(self, p: KeyDeltaParams, seq: Sequence) -> tuple:
        return (*super().load_sources(p, seq), (p.scores, seq.hv))

    @cute.jit
    def hand_over_scores(self, p, smem: KeyDeltaSmem, rings: DeltaRings, acc, consumer, producer):
        """No P: the MMA warp waits for the walk's tiles (K^ before the projection reads it)."""
        rings.scores.consumer_wait(consumer)

    @cute.jit
    def issue_projection(self, p: KeyDeltaParams, smem: KeyDeltaSmem, acc: KeyDeltaAccumulators):
        """The chunk's K^ S into X, issued."""
        ks_a, ks_b = mma.operands(p.mma_qs, smem.sY, smem.sS)
        mma.gemm(p.mma_qs, acc.x, ks_a, ks_b, True)

    def update_values(self, smem: KeyDeltaSmem) -> tuple:
        """The update's A operand: V_new (no factor: K~ carries it) over v's plane and in Y's tile."""
        return smem.sQKV_mn[None, None, 2, 0], smem.sY_mn

    @cute.jit
    def scores_role(
        self, p: KeyDeltaParams, smem: KeyDeltaSmem, rings: DeltaRings, acc: KeyDeltaAccumulators, seq, tid
    ):
        """Thread ``tid`` walks key channel k = tid. Per chunk: G into its TMEM lane of G^T and 2^G_last into a gate
        slot; once the stage has landed and the last chunk's products are done (the ``scores`` acquire: its update
        read V_new lo from Y lo's tile), column k of Q~ over q (where the pass makes O), of K^ into Y lo's tile and
        of K~ over k (zero past the sequence end)."""
        C = self.C
        g_rows = tmem.Rows(acc.g, C, tid)
        gG = p.g[seq.b, None, seq.hv, None]
        gate, qkv, scores = rings.gate, rings.qkv, rings.scores
        gate_pos = pipeline.make_pipeline_state(pipeline.PipelineUserType.Producer, GATE_SLOTS)
        consumer = pipeline.make_pipeline_state(pipeline.PipelineUserType.Consumer, 1)
        producer = pipeline.make_pipeline_state(pipeline.PipelineUserType.Producer, 1)
        for chunk in cutlass.range(seq.n_chunks, unroll=1):
            valid = seq.seqlen - chunk * C
            G_last = self.scan_lane(gG, g_rows, seq.tok0 + chunk * C, valid, tid)
            gate.producer_acquire(gate_pos)
            smem.sDec[tid, gate_pos.index] = cute.math.exp2(G_last, fastmath=True)
            gate.producer_commit(gate_pos)
            gate_pos.advance()
            qkv.consumer_wait(consumer)  # uncounted: the MMA warp releases the stage
            scores.producer_acquire(producer)
            self.walk_scaled(smem, g_rows, G_last, tid, valid, p.scale, self.cfg.make_o, "end", smem.sY)
            # generic-proxy writes that the tensor cores read next
            cute.arch.fence_proxy("async.shared", space="cta")
            scores.producer_commit(producer)
            consumer.advance()
            producer.advance()
        tmem.before_handoff()  # the walk's last TMEM accesses ordered before the barrier that frees TMEM
        scores.producer_tail(producer)

    @cute.jit
    def scan_lane(self, gG, g_rows, t0, valid, key):
        """Key channel ``key``'s G over the chunk (tokens ``t0`` ..; flat past the sequence end) into this thread's TMEM
        lane of G^T, 16 tokens at a time (a rolled loop: the GLA kernel's unrolled scan, which also marks its blocks'
        reference tokens, spilled here); returns G_last."""
        f32 = cutlass.Float32
        cols = tmem.COLUMNS_PER_COPY
        run = f32(0.0)
        for blk in cutlass.range(self.C // cols, unroll=1):
            raw = cute.make_rmem_tensor(cute.make_layout(cols), f32)
            for e in cutlass.range_constexpr(cols):
                # clamped into the sequence instead of branching, so the loads stay in flight
                raw[e] = gG[t0 + cutlass.min(blk * cols + e, valid - 1), key]
            frag = tmem.fragment(g_rows)
            for e in cutlass.range_constexpr(cols):
                run = run + (cutlass.max(raw[e], f32(GATE_FLOOR)) if blk * cols + e < valid else f32(0.0))
                frag[e] = run * _LOG2E
            tmem.write(g_rows, blk, frag)
        tmem.stores_done()
        return run * _LOG2E
