"""The scalar-gate chunk forward on SM100 without the delta rule (simple GLA, Lightning): one CTA per (sequence,
value head) walks its sequence in chunks of C = 128 tokens, the fp32 state S^T (V x K) kept in tensor memory (TMEM)
across all of them.

Math per chunk (G the chunk's inclusive cumulative gate in log2 units, s the scale):

    P~ = tril(s (Q K^T)_ij 2^(G_i - G_j))                     (bf16)
    Q~ = s 2^G_i q_i,  K~ = 2^(G_last - G_j) k_j               (bf16, in place of q and k)
    O  = Q~ S + P~ V
    S^T <- 2^G_last S^T + V^T K~

Four tcgen05 MMAs per chunk, every operand in shared memory, every accumulator in TMEM (M = 128 throughout):

| product | M x N x K | A | B | accumulator |
|---|---|---|---|---|
| P = Q K^T | C x C x K | q, K-major | k, K-major | P (columns 0-127) |
| O = Q~ S | C x V x K | Q~, K-major | S^T bf16, K-major | O (128-255) |
| O += P~ V | C x V x C | P~, K-major | v, MN-major | O |
| S^T += V^T K~ | 128 x K x C | v, MN-major | K~, MN-major | S^T (128 + V ..) |

At D = 64 the update's M is still 128: the state accumulator S^T has 128 rows, of which the V = 64 past the value
columns stay zero, because the A operand (v read MN-major) is the v tile followed by a 64-column tile of zeros
(written once, never loaded: in the K-major (C, 128) tile's byte order the first 64 columns of every row come first).
tcgen05 has M = 64 as well, but its accumulator lies on half the TMEM lanes of each warp, so every role's row
access would change; the zero rows cost the update twice the products at D = 64, the smallest of the four.

Warp roles (:class:`cula.sm100.roles.WarpRole`): a TMA warp loads chunk c's q | k | v stage; the MMA warp issues
the products; the gate warp scans the chunk's gates into a gate slot; the scores warpgroup turns P into P~ (masks as
selects), scales the q and k rows in place and, in a varlen call, zeroes the v rows past the sequence end; the state
warpgroup rounds S^T to its bf16 operand and applies the chunk decay in place; the output warpgroup stores O. Each
thread of the last three owns one TMEM lane: row ``tid`` of its accumulator.

Hand-offs (``cutlass.pipeline``, one stage each but the gate's two): ``qkv`` (TMA -> MMA; the scores warpgroup
waits on it uncounted), ``p_acc`` (MMA -> scores), ``scores`` (scores -> MMA, released when the products that read
P~, Q~ and K~ are done), ``state`` (state warpgroup -> MMA, released when S^T's update is done: the state warpgroup
acquires it again before the next chunk and once more for the final state), ``o_acc`` (MMA -> output), ``gate``
(gate warp -> scores and state).

A split sequence (:mod:`cula.ops.segment_split`) runs a first pass over its segments as above and a correction pass
(``mode="correction"``, V_new = 0) over the later ones from their chained starts: q loaded alone, no P~ and no
update (the state only decays), O = Q~ S added to the first pass's output; the transitions are the gate's decay, made
on the host.

The backward's state walks (``ChunkFwdConfig.walk``, :mod:`cula.sm90.walks`): no P, no output; the state warpgroup
stores a bf16 checkpoint of S^T per chunk to ``w`` before the chunk's update, and the scores warpgroup scales only
the key tile: "states" walks (k, v) with K~ = 2^(G_last - G) k, "state_grads" walks the chunks from the last on
(q, dO) with s 2^G q in the key place.

Shapes and launch arguments as the SM90 family's (:mod:`cula.sm90.chunk_fwd`): q, k [B, T, H, D]; v, o [B, T, HV,
D] bf16; g [B, T, HV] fp32 natural-log gate per token (simple GLA's g plus g_gamma); states [N, HV, K, V] fp32 (a
transposed view for ``state_v_first``); varlen int32 ``starts`` / ``ends``; the walks' checkpoints ``w`` [rows, HV,
V, K] bf16 (row :func:`cula.sm90.sequence.checkpoint_row` with C = 128); a state pool's ``slots``. D = 64 or 128.
Configurations: :class:`cula.sm90.chunk_fwd.ChunkFwdConfig` with ``delta_rule=False`` and ``mode`` "full" or
"correction".
"""

from __future__ import annotations

import math
from typing import NamedTuple

import cutlass
import cutlass.cute as cute
from cutlass import pipeline
from cutlass.cute.nvgpu import cpasync
from cutlass.pipeline import Agent, CooperativeGroup

from cula.ops.gates import GATE_FLOOR
from cula.sm90 import entry, sequence, tiles
from cula.sm90.chunk_fwd import ChunkFwdConfig
from cula.sm90.scalar_gates import warp_scan_64
from cula.sm100 import mma, tmem
from cula.sm100.roles import THREADS, WARPGROUP, WarpRole

CHUNK = 128
HEAD_DIMS = (64, 128)
SHARED_BYTES = 232448  # the most shared memory a CTA may take on SM100 (227 KB)
GATE_SLOTS = 2
_LOG2E = math.log2(math.e)


def sm100_chunk_kernel(name: str, compile_fn, split_cost) -> entry.ChunkKernel:
    """An SM100 kernel without the delta rule (this one, or :mod:`cula.sm100.key_chunk_fwd`) on the family's host
    path (:mod:`cula.sm90.entry`): chunks of 128, a split's transitions the gate's decay, made on the host."""
    return entry.ChunkKernel(
        name, compile_fn, split_cost=split_cost, delta_rule=False, chunk=CHUNK, gate_transition=True
    )


class Tma(NamedTuple):
    atom: object
    tensor: object


class Params(NamedTuple):
    """The kernel's parameters: the four tiled MMAs (module docstring), TMA atoms, global tensors, layouts."""

    mma_qk: object
    mma_qs: object
    mma_pv: object
    mma_state: object
    q: Tma
    k: Tma
    v: Tma
    g: cute.Tensor
    o: cute.Tensor
    h0: cute.Tensor
    ht: cute.Tensor
    starts: cute.Tensor
    ends: cute.Tensor
    slots: cute.Tensor
    w: cute.Tensor  # the walks' checkpoints (a dummy in the forward)
    H: cutlass.Int32
    T: cutlass.Int32
    scale: cutlass.Float32
    tile_qkv: object  # (C, D, q|k|v[|zeros], 1 stage) K-major
    tile_qkv_mn: object  # the same bytes as (D, C, q|k|v[|zeros], 1) MN-major
    tile_v_mn: object  # v and the zeros after it (D < 128) as one (128, C) MN-major tile: the update's A operand
    tile_p: object  # (C, C) K-major
    tile_s: object  # (V, K) K-major


class Smem(NamedTuple):
    sQKV: cute.Tensor  # (C, D, q|k|v[|zeros], 1)
    sQKV_mn: cute.Tensor  # (D, C, q|k|v[|zeros], 1)
    sV_rows: cute.Tensor  # (128, C): v^T's rows, zero past D
    sP: cute.Tensor  # P~ (C, C)
    sS: cute.Tensor  # S^T bf16 (V, K)
    sG: cute.Tensor  # G (log2) per token and slot (C, GATE_SLOTS)
    sFac: cute.Tensor  # per token and slot: s 2^G, 2^(G_last - G) (0 past the end)  (C, GATE_SLOTS, 2)


class Rings(NamedTuple):
    qkv: object
    p_acc: object
    scores: object
    state: object
    o_acc: object
    gate: object


class Accumulators(NamedTuple):
    """The TMEM accumulators, (MMA, 1, 1) fp32 tensors of (128 x C), (128 x V) and (128 x K)."""

    p: cute.Tensor
    o: cute.Tensor
    s: cute.Tensor


class Sequence(NamedTuple):
    n: cutlass.Int32  # sequence (row of the grid)
    b: cutlass.Int32
    tok0: cutlass.Int32
    seqlen: cutlass.Int32
    n_chunks: cutlass.Int32
    hv: cutlass.Int32
    h: cutlass.Int32
    h0_row: object
    ht_row: object


def make_ring(kind, producers: int, consumers: int, barriers, stages: int = 1, **extra):
    """A ``cutlass.pipeline`` hand-off of ``kind`` between ``producers`` and ``consumers`` threads, its barriers in
    ``barriers``; made with ``defer_sync`` (the kernel fences and synchronises once for all of them). A side that is
    the MMA warp or TMA counts one arrival (an elected commit or the transaction count), a side of threads one per
    thread."""
    return kind.create(
        num_stages=stages,
        producer_group=CooperativeGroup(Agent.Thread, producers),
        consumer_group=CooperativeGroup(Agent.Thread, consumers),
        barrier_storage=barriers.data_ptr(),
        defer_sync=True,
        **extra,
    )


def stage_plane_tma(x, tile_qkv) -> Tma:
    """The TMA of a ``[B, T, heads, D]`` token tensor ``x`` into one (C, D) plane of the stage ``tile_qkv``."""
    one_plane = cute.slice_(tile_qkv, (None, None, 0, 0))
    tile = (cute.size(one_plane, mode=[0]), cute.size(one_plane, mode=[1]))
    return Tma(*cpasync.make_tiled_tma_atom(cpasync.CopyBulkTensorTileG2SOp(), tiles.tma_view(x), one_plane, tile))


@cute.jit
def scan_chunk_gates(x, G, lane):
    """G = cumsum(x) log2(e) over a chunk of 128 gates held four per lane (``x[m]`` at token lane + 32 m) into ``G``
    (the same places); returns G at the chunk's last token. 64 tokens at a time (lane l holds l and l + 32 of each),
    the second 64 after the first's total."""
    total = cutlass.Float32(0.0)
    for half in cutlass.range_constexpr(CHUNK // 64):
        lo, hi = warp_scan_64(x[2 * half], x[2 * half + 1], lane, False)
        G[2 * half] = (lo + total) * _LOG2E
        G[2 * half + 1] = (hi + total) * _LOG2E
        total = total + cute.arch.shuffle_sync(hi, 31)
    return total * _LOG2E


@cute.jit
def scale_row(tile, row, factor, keep):
    """Row ``row`` of the bf16 smem ``tile`` (rows x D) times ``factor`` in place, or set to zero where ``keep`` is
    False (not multiplied: the row may hold the next sequence's tokens, NaN included)."""
    frag = cute.make_rmem_tensor(cute.make_layout((1, 8)), cutlass.BFloat16)
    for blk in cutlass.range_constexpr(cute.size(tile, mode=[1]) // 8):
        part = cute.local_tile(tile, (1, 8), (row, blk))
        if keep:
            cute.autovec_copy(part, frag)
            frag.store((frag.load().to(cutlass.Float32) * factor).to(cutlass.BFloat16))
        else:
            frag.fill(0.0)
        cute.autovec_copy(frag, part)


class ScalarGateChunkFwdSm100:
    """The kernel (module docstring); ``cfg`` a :class:`cula.sm90.chunk_fwd.ChunkFwdConfig` without the delta rule,
    the forward (a full pass, or a split's correction pass) or one of the backward's state walks."""

    delta_rule = False  # a subclass's recurrence (cula.sm100.delta_chunk_fwd: GDN's)
    modes = ("full", "correction")  # the passes of a split sequence it runs (the delta rule's add "transition")

    def __init__(self, config: ChunkFwdConfig):
        assert config.head_dim in HEAD_DIMS and config.delta_rule == self.delta_rule, config
        assert config.mode in self.modes and config.intra == "none", config
        assert config.value_blocks == 1, config  # one CTA walks a value head's every column
        self.cfg = config
        self.C = CHUNK
        self.D = config.head_dim
        # a correction pass (V_new = 0) makes no P~ and no update: O = Q~ S from its start, the state only decays
        self.makes_scores = config.mode == "full" and config.make_o
        self.updates_state = config.mode == "full"
        # the tiles of the q | k | v stage each chunk loads: q for the output (a walk's key place is k, or q itself),
        # k and v for the update (a correction pass makes none)
        self.loaded_tiles = ((0,) if config.make_o else ()) + ((1, 2) if self.updates_state else ())
        # the q | k | v stage's planes: those TMA fills, then at a narrow head zeros up to the update's M after v
        self.loaded_planes = 3
        self.planes = self.loaded_planes + (mma.M - self.D) // self.D
        # the gate slots hold the factors s 2^G and 2^(G_last - G) beside G (a subclass short of shared memory makes
        # them from G where it reads them)
        self.gate_factors = True
        # P, O and S^T; an allocation is a power of two of at least 32 columns
        self.tmem_columns = 1 << (self.C + 2 * self.D - 1).bit_length()
        # the gate ring's producer (the gate warp) and consumers (the scores and state warpgroups)
        self.gate_threads = (32, 2 * WARPGROUP)
        # the output warpgroup's work: O's rows (a walk makes none)
        self.has_output_role = config.make_o

    # ---------------------------------------------------------------- host side
    @cute.jit
    def __call__(self, q, k, v, g, beta, o, h0, ht, starts, ends, w, slots, scale, stream):
        """The launch (arguments as the SM90 family's; ``beta`` is never read, ``w`` only by the walks)."""
        params, fields = self.host_params(q, k, v, g, beta, o, h0, ht, starts, ends, w, slots, scale)
        self.storage = cute.struct(type("Storage", (), {"__annotations__": fields}))
        # refused at compile time (the compile check), not by the launch on a GPU
        assert self.storage.size_in_bytes() <= SHARED_BYTES, (self.cfg, self.storage.size_in_bytes())
        HV = v.shape[2]
        N = starts.shape[0] if cutlass.const_expr(self.cfg.is_varlen) else q.shape[0]
        # one CTA per SM (its shared memory allows no second): said to ptxas, which otherwise may cap registers at 64
        # to fit two and spill
        self.kernel(params).launch(
            grid=(HV, N, 1),
            block=(THREADS, 1, 1),
            smem=self.storage.size_in_bytes(),
            stream=stream,
            min_blocks_per_mp=1,
        )

    def host_params(self, q, k, v, g, beta, o, h0, ht, starts, ends, w, slots, scale):
        """The kernel's :class:`Params` and its shared-memory fields (name -> struct member)."""
        C, D = self.C, self.D
        tile_qkv, tile_qkv_mn = tiles.token_tiles(C, D, self.planes, 1)
        _, tile_v_mn = tiles.token_tiles(C, mma.M)
        tile_p, _ = tiles.token_tiles(C, C)
        tile_s, _ = tiles.token_tiles(D, D)
        tma_q, tma_k, tma_v = (stage_plane_tma(x, tile_qkv) for x in (q, k, v))
        params = Params(
            mma.tiled_mma("K", "K", C), mma.tiled_mma("K", "K", D), mma.tiled_mma("K", "MN", D), mma.tiled_mma("MN", "MN", D),
            tma_q, tma_k, tma_v, g, o, h0, ht, starts, ends, slots, w, q.shape[2], q.shape[1], scale,
            tile_qkv, tile_qkv_mn, tile_v_mn, tile_p, tile_s,
        )  # fmt: skip
        f32, bf16 = cutlass.Float32, cutlass.BFloat16
        ring = cute.struct.MemRange[cutlass.Int64, 2]
        fields = {
            "ring_qkv": ring,
            "ring_p_acc": ring,
            "ring_scores": ring,
            "ring_state": ring,
            "ring_o_acc": ring,
            "ring_gate": cute.struct.MemRange[cutlass.Int64, 2 * GATE_SLOTS],
            "tmem_address": cutlass.Int32,
            "sG": cute.struct.Align[cute.struct.MemRange[f32, C * GATE_SLOTS], 16],
            "sFac": cute.struct.Align[cute.struct.MemRange[f32, C * GATE_SLOTS * 2], 16],
            "sQKV": cute.struct.Align[cute.struct.MemRange[bf16, cute.cosize(tile_qkv)], 1024],
            "sP": cute.struct.Align[cute.struct.MemRange[bf16, cute.cosize(tile_p)], 1024],
            "sS": cute.struct.Align[cute.struct.MemRange[bf16, cute.cosize(tile_s)], 1024],
        }
        if not self.gate_factors:
            del fields["sFac"]
        return params, fields

    # ---------------------------------------------------------------- device side
    def make_rings(self, st) -> Rings:
        """Every hand-off (module docstring); made with ``defer_sync``, fenced and synchronised by the caller."""
        qkv_bytes = len(self.loaded_tiles) * self.C * self.D * 2
        return Rings(
            qkv=make_ring(pipeline.PipelineTmaUmma, 1, 1, st.ring_qkv, tx_count=qkv_bytes),
            p_acc=make_ring(pipeline.PipelineUmmaAsync, 1, WARPGROUP, st.ring_p_acc),
            scores=make_ring(pipeline.PipelineAsyncUmma, WARPGROUP, 1, st.ring_scores),
            state=make_ring(pipeline.PipelineAsyncUmma, WARPGROUP, 1, st.ring_state),
            o_acc=make_ring(pipeline.PipelineUmmaAsync, 1, WARPGROUP, st.ring_o_acc),
            gate=make_ring(pipeline.PipelineAsync, *self.gate_threads, st.ring_gate, GATE_SLOTS),
        )

    @cute.kernel
    def kernel(self, p):  # Params, or a variant's extension of it
        C = self.C
        cfg = self.cfg
        tidx, _, _ = cute.arch.thread_idx()
        hv, n, _ = cute.arch.block_idx()
        warp = cute.arch.make_warp_uniform(cute.arch.warp_idx())
        HV = p.o.shape[2]
        b, tok0, seqlen, n_chunks = sequence.sequence_bounds(n, p.T, p.starts, p.ends, cfg.is_varlen, C)
        h0_row = ht_row = n
        if cutlass.const_expr(cfg.state_slots != "none"):
            h0_row = p.slots[n]
            if cutlass.const_expr(cfg.state_slots == "read_write"):
                ht_row = h0_row
        seq = Sequence(n, b, tok0, seqlen, n_chunks, hv, hv // (HV // p.H), h0_row, ht_row)

        st = cutlass.utils.SmemAllocator().allocate(self.storage)
        smem = self.make_smem(st, p)
        sQKV = smem.sQKV
        rings = self.make_rings(st)
        if warp == WarpRole.LOAD:
            for tma, _ in self.load_sources(p, seq):
                cpasync.prefetch_descriptor(tma.atom)
        if cutlass.const_expr(self.planes > self.loaded_planes):
            # the zero rows of the update's A operand, for every chunk (TMA never writes them)
            for plane in cutlass.range_constexpr(self.loaded_planes, self.planes):
                tiles.zero_rows_from(sQKV[None, None, plane, 0], 0, tidx, THREADS)
            cute.arch.fence_proxy("async.shared", space="cta")
        cute.arch.mbarrier_init_fence()
        cute.arch.sync_threads()

        tmem_alloc, tmem_base = tmem.allocate(st.tmem_address.ptr, self.tmem_columns, WarpRole.MMA)
        acc = self.accumulators(p, tmem_base)

        wg_tid = tidx % WARPGROUP
        if warp == WarpRole.LOAD:
            self.load_warp(p, smem, rings, seq)
        elif warp == WarpRole.MMA:
            self.mma_warp(p, smem, rings, acc, seq)
        elif warp == WarpRole.GATE:
            self.gate_warp(p, smem, rings, seq)
        elif warp >= WarpRole.OUTPUT:
            if cutlass.const_expr(self.has_output_role):
                self.output_role(p, smem, rings, acc, seq, wg_tid)
        elif warp >= WarpRole.STATE:
            self.state_role(p, smem, rings, acc, seq, wg_tid)
        elif warp >= WarpRole.SCORES:
            self.scores_role(p, smem, rings, acc, seq, wg_tid)

        tmem.free(tmem_alloc, tmem_base, warp, WarpRole.MMA)

    def make_smem(self, st, p: Params) -> Smem:
        """The shared-memory tensors of the storage ``st`` (:meth:`host_params`' fields)."""
        C = self.C
        sQKV = st.sQKV.get_tensor(p.tile_qkv.outer, swizzle=p.tile_qkv.inner)
        return Smem(
            sQKV,
            tiles.mn_view(sQKV, p.tile_qkv_mn),
            tiles.mn_view(sQKV[None, None, 2, 0], p.tile_v_mn),
            st.sP.get_tensor(p.tile_p.outer, swizzle=p.tile_p.inner),
            st.sS.get_tensor(p.tile_s.outer, swizzle=p.tile_s.inner),
            st.sG.get_tensor(cute.make_layout((C, GATE_SLOTS))),
            st.sFac.get_tensor(cute.make_layout((C, GATE_SLOTS, 2))),
        )

    def accumulators(self, p: Params, tmem_base) -> Accumulators:
        """P, O and S^T at TMEM columns 0, C and C + V (128 lanes each: S^T's rows past V are zero)."""
        C, D = self.C, self.D
        return Accumulators(
            mma.accumulator(p.mma_qk, C, tmem_base, 0),
            mma.accumulator(p.mma_qs, D, tmem_base, C),
            mma.accumulator(p.mma_state, D, tmem_base, C + D),
        )

    @cute.jit
    def load_warp(self, p: Params, smem: Smem, rings: Rings, seq: Sequence):
        """Chunk c's q, k and v tiles (a walk's k and v) into the stage once the products of chunk c - 1 are done
        with it."""
        sources = self.load_sources(p, seq)
        parts = [
            tiles.tma_chunk_tiles(tma.atom, tma.tensor[None, None, head, seq.b], seq.tok0, smem.sQKV[None, None, which, None])
            for which, (tma, head) in enumerate(sources)
        ]  # fmt: skip
        qkv = rings.qkv
        pos = pipeline.make_pipeline_state(pipeline.PipelineUserType.Producer, 1)
        for chunk in cutlass.range(seq.n_chunks, unroll=1):
            qkv.producer_acquire(pos)
            bar = qkv.producer_get_barrier(pos)
            pos_c = sequence.chunk_position(chunk, seq.n_chunks, self.cfg.reverse)
            for which in self.loaded_tiles:
                smem_part, gmem_part = parts[which]
                cute.copy(sources[which][0].atom, gmem_part[None, pos_c], smem_part[None, 0], tma_bar_ptr=bar)
            pos.advance()
        # the last release arrives before the kernel exits (no arrive left in flight on a freed barrier)
        qkv.producer_tail(pos)

    def load_sources(self, p: Params, seq: Sequence) -> tuple:
        """The stage's planes as ``(TMA, head)`` in plane order: q and k of the q / k head, v of the value head."""
        return ((p.q, seq.h), (p.k, seq.h), (p.v, seq.hv))

    @cute.jit
    def mma_warp(self, p: Params, smem: Smem, rings: Rings, acc: Accumulators, seq: Sequence):
        """Per chunk: P = Q K^T; once the scores and the state operand are ready, O = Q~ S + P~ V and S^T += V^T K~;
        then the stage, the scores and the state released (commits that arrive when those products are done)."""
        qkv, scores, state, o_acc = rings.qkv, rings.scores, rings.state, rings.o_acc
        consumer = pipeline.make_pipeline_state(pipeline.PipelineUserType.Consumer, 1)
        producer = pipeline.make_pipeline_state(pipeline.PipelineUserType.Producer, 1)
        for _chunk in cutlass.range(seq.n_chunks, unroll=1):
            qkv.consumer_wait(consumer)
            self.hand_over_scores(p, smem, rings, acc, consumer, producer)
            scores.consumer_wait(consumer)
            state.consumer_wait(consumer)
            if cutlass.const_expr(self.cfg.make_o):
                o_acc.producer_acquire(producer)
            tmem.after_handoff()
            if cutlass.const_expr(self.cfg.make_o):
                self.issue_output(p, smem, acc)
                o_acc.producer_commit(producer)
            if cutlass.const_expr(self.updates_state):
                self.issue_update(p, smem, acc)
            state.consumer_release(consumer)
            scores.consumer_release(consumer)
            qkv.consumer_release(consumer)
            consumer.advance()
            producer.advance()

    @cute.jit
    def hand_over_scores(self, p: Params, smem: Smem, rings: Rings, acc: Accumulators, consumer, producer):
        """Where the pass makes P~: the chunk's P issued once the scores warpgroup has read the last, and handed to it
        (``consumer``, ``producer``: the chunk's positions in the rings)."""
        if cutlass.const_expr(self.makes_scores):
            rings.p_acc.producer_acquire(producer)
            self.issue_scores(p, smem, rings, acc, consumer)
            rings.p_acc.producer_commit(producer)

    @cute.jit
    def issue_scores(self, p: Params, smem: Smem, rings: Rings, acc: Accumulators, consumer):
        """The chunk's P = Q K^T, issued (the caller commits; ``consumer``: the chunk's position in the rings)."""
        tmem.after_handoff()
        # the operands' descriptors made where they are used: all of them live at once would not fit this warp's
        # registers
        q_op, k_op = mma.operands(p.mma_qk, smem.sQKV[None, None, 0, 0], smem.sQKV[None, None, 1, 0])
        mma.gemm(p.mma_qk, acc.p, q_op, k_op, True)

    @cute.jit
    def issue_output(self, p: Params, smem: Smem, acc: Accumulators):
        """The chunk's O = Q~ S + P~ V (a correction pass: Q~ S), issued."""
        qs_a, qs_b = mma.operands(p.mma_qs, smem.sQKV[None, None, 0, 0], smem.sS)
        mma.gemm(p.mma_qs, acc.o, qs_a, qs_b, True)
        if cutlass.const_expr(self.makes_scores):
            pv_a, pv_b = mma.operands(p.mma_pv, smem.sP, smem.sQKV_mn[None, None, 2, 0])
            mma.gemm(p.mma_pv, acc.o, pv_a, pv_b, False)

    @cute.jit
    def issue_update(self, p: Params, smem: Smem, acc: Accumulators):
        """The chunk's S^T += V^T K~, issued."""
        vk_a, vk_b = mma.operands(p.mma_state, smem.sV_rows, smem.sQKV_mn[None, None, 1, 0])
        mma.gemm(p.mma_state, acc.s, vk_a, vk_b, False)

    @cute.jit
    def gate_warp(self, p: Params, smem: Smem, rings: Rings, seq: Sequence):
        """Chunk c's gates into slot c % 2: G = cumsum(max(g, floor)) log2(e) over the chunk (lane l holds tokens
        l + 32 m), and the factors s 2^G and 2^(G_last - G); tokens past the sequence end add nothing to G and get a
        zero second factor."""
        C = self.C
        f32 = cutlass.Float32
        lane = cute.arch.lane_idx()
        gG = p.g[seq.b, None, seq.hv]
        gate = rings.gate
        pos = pipeline.make_pipeline_state(pipeline.PipelineUserType.Producer, GATE_SLOTS)
        raw = cute.make_rmem_tensor(cute.make_layout(C // 32), f32)
        G = cute.make_rmem_tensor(cute.make_layout(C // 32), f32)
        for chunk in cutlass.range(seq.n_chunks, unroll=1):
            t0 = sequence.chunk_position(chunk, seq.n_chunks, self.cfg.reverse) * C + lane
            for m in cutlass.range_constexpr(C // 32):
                # clamped into the sequence instead of branching, so the loads stay in flight
                raw[m] = gG[seq.tok0 + cutlass.min(t0 + 32 * m, seq.seqlen - 1)]
            x = cute.make_rmem_tensor(cute.make_layout(C // 32), f32)
            for m in cutlass.range_constexpr(C // 32):
                x[m] = cutlass.max(raw[m], f32(GATE_FLOOR)) if t0 + 32 * m < seq.seqlen else f32(0.0)
            G_last = scan_chunk_gates(x, G, lane)
            gate.producer_acquire(pos)
            slot = pos.index
            for m in cutlass.range_constexpr(C // 32):
                t = lane + 32 * m
                smem.sG[t, slot] = G[m]
                if cutlass.const_expr(self.gate_factors):
                    smem.sFac[t, slot, 0] = p.scale * cute.math.exp2(G[m], fastmath=True)
                    smem.sFac[t, slot, 1] = (
                        cute.math.exp2(G_last - G[m], fastmath=True) if t0 + 32 * m < seq.seqlen else f32(0.0)
                    )
            gate.producer_commit(pos)
            pos.advance()

    @cute.jit
    def scores_role(self, p: Params, smem: Smem, rings: Rings, acc: Accumulators, seq: Sequence, tid):
        """Thread ``tid`` owns token row i: P~_ij = s P_ij 2^(G_i - G_j) where j <= i and j is in the sequence, else
        0 (selects); then q_i and k_i scaled in place, k_i zeroed past the sequence end, as v_i in a varlen call
        (there the rows hold the next sequence's tokens). A walk makes no P~ and scales only the key tile: by
        2^(G_last - G) ("states") or s 2^G ("state_grads"), zero past the end; a correction pass only the q tile."""
        C = self.C
        f32 = cutlass.Float32
        rows = tmem.Rows(acc.p, C, tid)
        i = rows.row()
        frag = tmem.fragment(rows)
        gate, qkv, scores, p_acc = rings.gate, rings.qkv, rings.scores, rings.p_acc
        gate_pos = pipeline.make_pipeline_state(pipeline.PipelineUserType.Consumer, GATE_SLOTS)
        consumer = pipeline.make_pipeline_state(pipeline.PipelineUserType.Consumer, 1)
        producer = pipeline.make_pipeline_state(pipeline.PipelineUserType.Producer, 1)
        # the key tile's factor column: 2^(G_last - G), or in the state-gradient walk s 2^G (its key place holds q)
        key_factor = 0 if self.cfg.reverse else 1
        for chunk in cutlass.range(seq.n_chunks, unroll=1):
            valid = seq.seqlen - sequence.chunk_position(chunk, seq.n_chunks, self.cfg.reverse) * C
            slot = gate_pos.index
            gate.consumer_wait(gate_pos)
            qkv.consumer_wait(consumer)  # uncounted: the MMA warp releases the stage
            scores.producer_acquire(producer)
            in_sequence = i < valid
            if cutlass.const_expr(self.makes_scores):
                p_acc.consumer_wait(consumer)
                tmem.after_handoff()
                self.gated_scores(p, smem, rows, frag, slot, valid)
                tmem.before_handoff()
                p_acc.consumer_release(consumer)
            if cutlass.const_expr(self.cfg.make_o):
                scale_row(smem.sQKV[None, None, 0, 0], i, smem.sFac[i, slot, 0], True)
            if cutlass.const_expr(self.updates_state):
                scale_row(smem.sQKV[None, None, 1, 0], i, smem.sFac[i, slot, key_factor], in_sequence)
                if cutlass.const_expr(self.cfg.is_varlen):
                    if not in_sequence:
                        scale_row(smem.sQKV[None, None, 2, 0], i, f32(0.0), False)
            # generic-proxy writes that the tensor cores read next
            cute.arch.fence_proxy("async.shared", space="cta")
            scores.producer_commit(producer)
            gate.consumer_release(gate_pos)
            gate_pos.advance()
            consumer.advance()
            producer.advance()
        scores.producer_tail(producer)

    @cute.jit
    def gated_scores(self, p: Params, smem: Smem, rows, frag, slot, valid):
        """Row i of P~ (``rows``: this thread's of the P accumulator) into ``smem.sP``: P~_ij = s P_ij 2^(G_i - G_j)
        where j <= i and j < ``valid`` (in the sequence), else 0 (selects); G from gate slot ``slot``."""
        i = rows.row()
        G_i = smem.sG[i, slot]
        for blk in cutlass.range_constexpr(self.C // tmem.COLUMNS_PER_COPY):
            tmem.read(rows, blk, frag)
            for e in cutlass.range_constexpr(tmem.COLUMNS_PER_COPY):
                j = blk * tmem.COLUMNS_PER_COPY + e
                keep = j <= i and j < valid
                decay = cute.math.exp2(G_i - smem.sG[j, slot] if keep else cutlass.Float32(0.0), fastmath=True)
                frag[e] = frag[e] * p.scale * decay if keep else cutlass.Float32(0.0)
            tmem.store_row_bf16(smem.sP, i, blk * tmem.COLUMNS_PER_COPY, frag)

    @cute.jit
    def state_role(self, p: Params, smem: Smem, rings: Rings, acc: Accumulators, seq: Sequence, tid):
        """Thread ``tid`` owns value row v of S^T: the initial state into TMEM; per chunk, once the previous update is
        done, S^T rounded to its bf16 operand and decayed by 2^G_last in place; at the end the final state. At D = 64
        the rows past V (threads 64 ..) stay zero: they are decayed as the others, and neither read nor stored."""
        C, D = self.C, self.D
        cols = tmem.COLUMNS_PER_COPY
        rows = tmem.Rows(acc.s, D, tid)
        v_row = rows.row()
        in_state = self.within_head(v_row)
        # (the global rows taken out here: a branch on in_state that reads p would carry all of p through it)
        h0, ht = p.h0[seq.h0_row, seq.hv, None, None], p.ht[seq.ht_row, seq.hv, None, None]
        for blk in cutlass.range_constexpr(D // cols):
            initial = tmem.fragment(rows)
            initial.fill(0.0)
            if cutlass.const_expr(self.cfg.start == "given"):
                if in_state:
                    for e in cutlass.range_constexpr(cols):
                        initial[e] = h0[blk * cols + e, v_row]
            if cutlass.const_expr(self.cfg.start == "identity"):  # a transition pass (the delta rule's)
                for e in cutlass.range_constexpr(cols):
                    initial[e] = cutlass.Float32(1.0) if blk * cols + e == v_row else cutlass.Float32(0.0)
            tmem.write(rows, blk, initial)
        tmem.stores_done()
        tmem.before_handoff()
        gate, state = rings.gate, rings.state
        gate_pos = pipeline.make_pipeline_state(pipeline.PipelineUserType.Consumer, GATE_SLOTS)
        producer = pipeline.make_pipeline_state(pipeline.PipelineUserType.Producer, 1)
        checkpoint0 = sequence.checkpoint_row(seq.n, seq.tok0, seq.n_chunks, self.cfg.is_varlen, C)
        for chunk in cutlass.range(seq.n_chunks, unroll=1):
            gate.consumer_wait(gate_pos)
            state.producer_acquire(producer)
            tmem.after_handoff()
            decay = self.chunk_decay(smem, gate_pos.index)
            # the forward's bf16 operand of Q~ S (and of the delta rule's K S), or a walk's checkpoint of the state
            # before the chunk's step
            operand = smem.sS
            if cutlass.const_expr(self.cfg.walk != "output"):  # (a transition pass makes no output either)
                operand = p.w[
                    checkpoint0 + sequence.chunk_position(chunk, seq.n_chunks, self.cfg.reverse), seq.hv, None, None
                ]
            for blk in cutlass.range_constexpr(D // cols):
                block = tmem.fragment(rows)
                tmem.read(rows, blk, block)
                if in_state:
                    tmem.store_row_bf16(operand, v_row, blk * cols, block)
                for e in cutlass.range_constexpr(cols):
                    block[e] = block[e] * self.column_decay(decay, smem, gate_pos.index, blk * cols + e)
                tmem.write(rows, blk, block)
            tmem.stores_done()
            tmem.before_handoff()
            cute.arch.fence_proxy("async.shared", space="cta")
            state.producer_commit(producer)
            gate.consumer_release(gate_pos)
            gate_pos.advance()
            producer.advance()
        state.producer_acquire(producer)  # the last update done
        tmem.after_handoff()
        for blk in cutlass.range_constexpr(D // cols):
            final = tmem.fragment(rows)
            tmem.read(rows, blk, final)
            if in_state:
                for e in cutlass.range_constexpr(cols):
                    ht[blk * cols + e, v_row] = final[e]
        tmem.before_handoff()  # the last TMEM reads ordered before the barrier that lets the MMA warp free it

    def chunk_decay(self, smem: Smem, slot):
        """The chunk's decay of the state, 2^G_last (gate slot ``slot``)."""
        return cute.math.exp2(smem.sG[self.C - 1, slot], fastmath=True)

    def column_decay(self, decay, smem: Smem, slot, column: int):
        """The decay of S^T's column ``column`` (a key channel): the chunk's, the same for every key."""
        return decay

    @cute.jit
    def within_head(self, lane):
        """Whether ``lane`` of a role's 128 (a row of the state accumulator, a key channel of the GLA kernel's walk) is
        one of the head's D: at D = 64 the lanes past it are padding (the state's rows past V the update's zeros)."""
        if cutlass.const_expr(self.D == mma.M):
            return True
        return lane < self.D

    @cute.jit
    def output_role(self, p: Params, smem: Smem, rings: Rings, acc: Accumulators, seq: Sequence, tid):
        """Thread ``tid`` owns token row i of O: rounded to bf16 and stored where the token is in the sequence; a
        correction pass adds the first pass's output there (read from ``o`` before the store)."""
        C = self.C
        rows = tmem.Rows(acc.o, self.D, tid)
        i = rows.row()
        frag = tmem.fragment(rows)
        gO = p.o[seq.b, None, seq.hv, None]
        o_acc = rings.o_acc
        consumer = pipeline.make_pipeline_state(pipeline.PipelineUserType.Consumer, 1)
        for chunk in cutlass.range(seq.n_chunks, unroll=1):
            token = seq.tok0 + chunk * C + i
            in_sequence = i < seq.seqlen - chunk * C
            o_acc.consumer_wait(consumer)
            tmem.after_handoff()
            self.store_output(rows, frag, gO, token, in_sequence)
            tmem.before_handoff()
            o_acc.consumer_release(consumer)
            consumer.advance()

    @cute.jit
    def store_output(self, rows, frag, gO, token, in_sequence):
        """This thread's row of O (``rows``: its row of the accumulator) rounded to bf16 into row ``token`` of the
        value head's output ``gO`` (T, V) where ``in_sequence``; a correction pass adds what is there first."""
        cols = tmem.COLUMNS_PER_COPY
        packed = cute.make_rmem_tensor(cute.make_layout((1, 8)), cutlass.BFloat16)
        first_pass = cute.make_rmem_tensor(cute.make_layout((1, 8)), cutlass.BFloat16)
        for blk in cutlass.range_constexpr(self.D // cols):
            tmem.read(rows, blk, frag)
            if in_sequence:
                for part in cutlass.range_constexpr(cols // 8):
                    out = cute.local_tile(gO, (1, 8), (token, blk * (cols // 8) + part))
                    if cutlass.const_expr(self.cfg.mode == "correction"):
                        cute.autovec_copy(out, first_pass)
                        for e in cutlass.range_constexpr(8):
                            frag[8 * part + e] = frag[8 * part + e] + first_pass[0, e].to(cutlass.Float32)
                    for e in cutlass.range_constexpr(8):
                        packed[0, e] = frag[8 * part + e].to(cutlass.BFloat16)
                    cute.autovec_copy(packed, out)
