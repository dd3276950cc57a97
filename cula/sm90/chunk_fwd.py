"""The chunk-forward kernel skeleton of the SM90 family: one CTA per (sequence, value head) walks its sequence in
chunks of C = 64 tokens and keeps the fp32 state on chip across all of them.

A kernel is a row of warpgroups with roles (:mod:`cula.sm90.roles`), producer first:

- PRODUCER: the TMA loads and the gate's per-chunk preparation. The gate decides what that is: GDN's scalar gate
  scans 64 values per chunk on one warp; KDA's per-key gate scans a (C x K) tile and builds gated B tiles.
- INTRA (where the gate's layout has one): the intra-chunk matrices A and P and Tinv = (I + A)^-1, a chunk or more
  ahead of the state warpgroups. Without it the state warpgroups make them themselves first each chunk
  (:meth:`ChunkFwdSm90.intra_step`).
- STATE: each holds 64 value rows of S^T as a wgmma accumulator and runs :class:`cula.sm90.state_chain.StateChain`
  per chunk, then stages O for its TMA store (:class:`cula.sm90.epilogue.OutputStager`).

This class is the skeleton and what every gate shares: the host side (token tiles, the TMA atoms of q, k, v, o and
the split passes' workspace, the shared-memory plan), the kernel's prologue, the role dispatch and the state role's
chunk loop. A gate is a subclass that fills in the hooks: :meth:`role_layout`, :meth:`gate_host` (its tensors,
atoms and shared memory), :meth:`make_rings`, :meth:`producer_role`, :meth:`intra_role` or :meth:`intra_step`,
:meth:`chain_inputs` / :meth:`chain_release` (what the state warpgroups wait for each chunk, and the
:class:`cula.sm90.state_chain.ChainGates` that applies the gate there).

Split passes (:mod:`cula.ops.segment_split`): ``mode`` "transition" runs v = 0 from S = I without output,
"correction" v = 0 from the given states and adds its output to o (the first pass's o arrives in the v stages);
``intra`` "save" stores each chunk's Tinv and P to a workspace, "load" takes them from it instead of making them.

The backward's state walks (``walk``, :mod:`cula.sm90.walks`): no output, a bf16 checkpoint of the state stored per
chunk to the workspace (``Common.w_plain``) before the chunk's step; "state_grads" walks the chunks from the last
(:meth:`ChunkFwdSm90.chunk_position`), with the delta rule through :meth:`cula.sm90.state_chain.StateChain.reverse_delta`.

Shapes (torch order): q, k [B, T, H, D] bf16; v, o [B, T, HV, D] bf16; beta [B, T, HV] bf16 / fp32; states
[N, HV, K, V] fp32 (a transposed view for ``state_v_first`` storage); varlen: B == 1 and int32 token ranges
``starts`` / ``ends`` [N]; the split workspace [ranges, rows, HV, C] bf16; a state pool's rows ``slots`` [N] int32
(``state_slots``; h0 is then the pool [slots, HV, K, V], and ht too when it is updated in place). GVA: value head hv reads q/k head
hv // (HV / H). D = K = V = 64 or 128.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import NamedTuple

import cutlass
import cutlass.cute as cute
from cutlass.cute.nvgpu import cpasync

from cula.sm90 import mma, pipeline, sequence, state, tiles
from cula.sm90.epilogue import OutputStager
from cula.sm90.roles import Barrier, RoleLayout, WarpGroupRole
from cula.sm90.state_chain import StateChain

CHUNK = 64
MODES = ("full", "transition", "correction")
INTRA = ("none", "save", "load")
STATE_SLOTS = ("none", "read", "read_write")
# "output": the forward. The backward's state walks (cula.ops.chunk_backward) make no output and store a bf16
# checkpoint of the state per chunk to the workspace: "states" the state at each chunk's start; "state_grads" walks
# the chunks from the last carrying the gradient of the state, storing it at each chunk's end (h0 is then dht, the
# final state dh0): without the delta rule with (q, do) in place of (k, v) and scale 2^G in place of
# 2^(G_last - G); with it on (q, k, do) through the transposed chain (StateChain.reverse_delta)
WALKS = ("output", "states", "state_grads")
A_STRIDE = 68  # padded fp32 row of A^T: 16-byte aligned rows, conflict-free stores from the accumulator


@dataclass(frozen=True)
class ChunkFwdConfig:
    """A chunk kernel's compile-time constants (beta's dtype and the state's storage order reach it with its
    tensors)."""

    head_dim: int = 128
    is_varlen: bool = False
    has_initial_state: bool = False
    mode: str = "full"
    intra: str = "none"
    qk_l2norm: bool = False
    # the delta rule (beta, the K S product, the solve: GDN, KDA); without it V_new = V (simple GLA, Lightning)
    delta_rule: bool = True
    # a state pool: "read" takes sequence n's initial state from h0 row slots[n] (final states to ht row n),
    # "read_write" also writes its final state to row slots[n] of ht (the pool itself, updated in place)
    state_slots: str = "none"
    # the pool's storage ("bfloat16": an engine's bf16 pool, read and written by slot; the math stays fp32)
    state_dtype: str = "float32"
    walk: str = "output"
    # CTAs per value head, each walking the sequence for D / value_blocks of the value columns (FLA's BV blocks):
    # twice the CTAs for a call with fewer heads than SMs, without a split's extra passes; each CTA makes the same
    # intra-chunk matrices (its q and k tiles are read twice, the second time mostly from L2)
    value_blocks: int = 1

    def __post_init__(self):
        assert self.mode in MODES and (self.mode == "full" or self.is_varlen), self
        assert self.delta_rule or not self.qk_l2norm, self
        assert self.intra in INTRA, self
        assert self.intra != "save" or self.mode == "full", self
        assert self.intra != "load" or self.mode != "full", self
        assert self.state_slots in STATE_SLOTS, self
        assert self.state_slots == "none" or (self.has_initial_state and self.mode == "full"), self
        assert self.state_dtype == "float32" or (self.state_dtype == "bfloat16" and self.state_slots != "none"), self
        assert self.walk in WALKS, self
        assert self.walk == "output" or (
            self.mode == "full" and self.intra == "none" and not self.qk_l2norm and self.state_slots == "none"
        ), self
        assert self.value_blocks == 1 or (
            self.value_blocks == 2 and self.head_dim == 128 and self.intra == "none" and self.walk == "output"
        ), self

    @property
    def start(self) -> str:
        """The state at the sequence start: given (``h0``; a correction pass's chained starts), identity (a
        transition pass) or zero."""
        if self.has_initial_state or self.mode == "correction":
            return "given"
        return "identity" if self.mode == "transition" else "zero"

    @property
    def make_o(self) -> bool:
        return self.mode != "transition" and self.walk == "output"

    @property
    def reverse(self) -> bool:
        """The chunks walked from the last to the first."""
        return self.walk == "state_grads"

    @property
    def v_from(self) -> str | None:
        """What arrives in the v stages: v, the first pass's o (correction), or nothing (transition)."""
        return {"full": "v", "correction": "o"}.get(self.mode)


class ChunkTensors(NamedTuple):
    """A launch's tensors (see the module docstring for shapes); ``h0`` is ``ht`` when there is no initial state."""

    q: cute.Tensor
    k: cute.Tensor
    v: cute.Tensor
    g: cute.Tensor
    beta: cute.Tensor
    o: cute.Tensor
    h0: cute.Tensor
    ht: cute.Tensor
    starts: cute.Tensor
    ends: cute.Tensor
    w: cute.Tensor
    slots: cute.Tensor


class Tma(NamedTuple):
    """A TMA atom and the global tensor it copies, in the (T, D, heads, B) view of :func:`cula.sm90.tiles.tma_view`."""

    atom: object
    tensor: object


class Common(NamedTuple):
    """The kernel parameters every gate shares."""

    mma_ss: object  # (C x C), both operands in shared memory
    mma_cc: object  # (C x C), A in registers
    mma_state: object  # (C x D), A in registers, B MN-major
    q: Tma
    k: Tma
    v: Tma  # v, or in a correction pass the first pass's o
    o: Tma  # the output store
    w: Tma  # the split workspace of Tinv and P (q's atom when unused)
    beta: cute.Tensor
    o_plain: cute.Tensor  # o as [B, T, HV, D], for the last chunk's masked stores
    w_plain: cute.Tensor  # the workspace as given: the state walks' checkpoints [rows, HV, V, K] bf16
    h0: cute.Tensor
    ht: cute.Tensor
    starts: cute.Tensor
    ends: cute.Tensor
    slots: cute.Tensor  # a state pool's row per sequence (int32 [N]), or a dummy
    H: cutlass.Int32
    T: cutlass.Int32
    scale: cutlass.Float32
    tile_qk: object  # (C, D, q|k, qk_stages) K-major
    tile_qk_mn: object
    tile_v: object  # (C, D, v_stages)
    tile_v_mn: object
    tile_o: object  # (C, D, o_stages)
    tile_o_mn: object
    tile_tp: object  # (C, C, Tinv|P, tp_stages)
    tile_tp_mn: object


class Params(NamedTuple):
    common: Common
    gate: tuple  # the gate's own parameters (its NamedTuple)


class Sequence(NamedTuple):
    """A CTA's sequence and heads."""

    b: cutlass.Int32  # batch row
    tok0: cutlass.Int32  # first token in the row
    seqlen: cutlass.Int32
    n_chunks: cutlass.Int32
    n: cutlass.Int32  # sequence (or range) index
    hv: cutlass.Int32  # value head
    h: cutlass.Int32  # q / k head
    h0_row: object  # the initial state's row: n, or its slot in a state pool
    ht_row: object  # the final state's row: n, or its slot in a pool updated in place
    vb: cutlass.Int32  # the CTA's block of value columns (ChunkFwdConfig.value_blocks)


class Smem(NamedTuple):
    """The shared-memory views every gate shares."""

    sA: cute.Tensor  # A^T fp32 (C, A_STRIDE)
    sQK: cute.Tensor  # (C, D, q|k, qk_stages)
    sK_mn: cute.Tensor  # the k tiles read MN-major (D, C, qk_stages)
    sV: cute.Tensor  # (C, D, v_stages)
    sV_mn: cute.Tensor
    sO: cute.Tensor  # (C, D, o_stages)
    sO_mn: cute.Tensor
    sTP: cute.Tensor  # (C, C, Tinv|P, tp_stages)
    sQ_mn: cute.Tensor  # the q tiles read MN-major (D, C, qk_stages)
    sTP_mn: cute.Tensor  # Tinv and P read transposed (C, C, Tinv|P, tp_stages)


class ChainInputs(NamedTuple):
    """What one chunk's state products read besides V, Tinv and P: the B tiles of S^T K~^T and S^T Q~^T (K-major)
    and of the update (MN-major), and the gate's :class:`cula.sm90.state_chain.ChainGates`."""

    sK: cute.Tensor
    sQ: cute.Tensor
    sK_mn: cute.Tensor
    gates: object
    # the state-gradient walk with the delta rule: the B tile of its (scale dO^T) Q product, MN-major
    sQ_mn: cute.Tensor = None


class ChunkFwdSm90:
    """The skeleton (module docstring). Subclasses set ``qk_stages``, ``tp_stages``, ``o_stages`` and
    ``split_values`` and fill in the hooks."""

    qk_stages = 1
    v_stages = 2
    tp_stages = 1
    o_stages = 1
    split_values = False  # Y and V_new as bf16 hi + lo pairs (StateChain)
    # the v tile's rows past the sequence end zeroed in shared memory once it lands (zero_tail_rows): where the chain
    # multiplies them by zero factors, which would keep a NaN of the next sequence's tokens
    zeroes_v_tail = False
    # the intra step runs in the backward's state walks too: where the walks need what it makes (KDA's Tinv, and P
    # walking backwards) or it releases rings the walks' chunks still move through (GLA's R and q | k | g)
    intra_step_in_walks = False
    # a correction pass without the delta rule carries V_new = 0 (v = 0): its state only decays and its output is
    # S^T Q~^T's alone, so it has no intra work and no update (a gate that can run it so sets this)
    zero_values = False
    # the gate's load warp takes each CTA's block of value columns (ChunkFwdConfig.value_blocks)
    takes_value_blocks = False

    def __init__(self, config: ChunkFwdConfig):
        assert config.head_dim in (64, 128), config.head_dim
        assert config.value_blocks == 1 or self.takes_value_blocks, config
        self.cfg = config
        self.C = CHUNK
        self.D = config.head_dim
        self.Dv = config.head_dim // config.value_blocks  # value columns per CTA
        self.layout = self.role_layout()
        self.threads = self.layout.threads
        self.state_wgs = self.layout.count(WarpGroupRole.STATE)
        # the CTA's 64-row blocks of S^T: with as many state warpgroups, warpgroup w holds block w; with more (an
        # intra step split across two warpgroups at D = 64) the others repeat block 0 without writing it
        self.row_blocks = self.Dv // 64
        self.repeats_rows = self.state_wgs > self.row_blocks

    # ---------------------------------------------------------------- hooks
    def role_layout(self) -> RoleLayout:
        raise NotImplementedError

    def gate_host(self, t: ChunkTensors, gate_args: tuple, tile_qk, tile_v):
        """Host side of the gate: ``(its kernel parameters, its shared-memory fields)``."""
        raise NotImplementedError

    def make_rings(self, st, c: Common):
        """Every ring of the kernel (the shared ``v`` and ``tp`` among them), as a NamedTuple."""
        raise NotImplementedError

    def producer_role(self, p: Params, smem: Smem, gsmem, rings, seq: Sequence, tid, warp):
        raise NotImplementedError

    def intra_role(self, p: Params, smem: Smem, gsmem, rings, seq: Sequence, tid, warp):
        raise NotImplementedError

    def intra_step(self, p: Params, smem: Smem, gsmem, rings, states, seq: Sequence, chunk, tid, warp):
        raise NotImplementedError

    def state_ring_states(self):
        """The state warpgroups' positions in the gate's rings (a NamedTuple of ``PipelineState``)."""
        raise NotImplementedError

    def chain_inputs(self, p: Params, smem: Smem, gsmem, rings, states, seq: Sequence, chunk) -> ChainInputs:
        raise NotImplementedError

    def chain_release(self, rings, states):
        """Release the gate's rings for this chunk and move the state warpgroups' positions on; returns them (the
        caller rebinds them, which is what carries them through its chunk loop)."""
        raise NotImplementedError

    def before_chunks(self, smem: Smem, stid):
        """The state warpgroups' step before their chunk loop (nothing by default)."""

    def before_chunk_end(self, p: Params, smem: Smem, gsmem, seq: Sequence, chunk, warp):
        """The state warpgroups' last step of a chunk before its closing barrier (nothing by default)."""

    @cute.jit
    def chunk_position(self, chunk, seq: Sequence):
        """The place in its sequence of a role's ``chunk``-th chunk: the same, or counted from the end in the
        reverse walk."""
        return sequence.chunk_position(chunk, seq.n_chunks, self.cfg.reverse)

    @cute.jit
    def zero_tail_rows(self, sV, valid, stid, nt: cutlass.Constexpr):
        """Rows ``valid`` .. C - 1 of a landed (C, D) tile zeroed by the ``nt`` state threads when the chunk ends its
        sequence early (in a varlen call they hold the next sequence's tokens), fenced for the stage's next TMA write
        and ordered for its readers by a barrier among the state threads (``valid`` is the same on all of them). A
        fixed-length call needs none: its tiles end at the tensor's bound, where TMA fills zeros."""
        if valid < self.C:
            # every state thread's reads of the stage's earlier chunk are done before any of them zeroes it (their
            # release reaches the refilling TMA through one lane per warp, an order racecheck does not follow)
            cute.arch.barrier(barrier_id=Barrier.STATE, number_of_threads=nt)
            tiles.zero_rows_from(sV, valid, stid, nt)
            cute.arch.fence_proxy("async.shared", space="cta")
            cute.arch.barrier(barrier_id=Barrier.STATE, number_of_threads=nt)

    def gate_smem(self, st, p: Params):
        raise NotImplementedError

    def prefetch_descriptors(self, p: Params):
        """Warp 0: the TMA descriptors into cache (the shared ones; a gate adds its own)."""
        c = p.common
        for tma in (c.q, c.k, c.v, c.o):
            cpasync.prefetch_descriptor(tma.atom)

    # ---------------------------------------------------------------- host side
    @cute.jit
    def launch(self, t: ChunkTensors, scale, gate_args, stream):
        """Build the tiles, atoms and shared-memory plan, then launch one CTA per (value block, value head,
        sequence)."""
        C, D, Dv = self.C, self.D, self.Dv
        cfg = self.cfg
        tile_qk, tile_qk_mn = tiles.token_tiles(C, D, 2, self.qk_stages)
        tile_v, tile_v_mn = tiles.token_tiles(C, Dv, self.v_stages)
        tile_o, tile_o_mn = tiles.token_tiles(C, Dv, self.o_stages)
        tile_tp, tile_tp_mn = tiles.token_tiles(C, C, 2, self.tp_stages)

        qk_tile = cute.slice_(tile_qk, (None, None, 0, 0))
        v_tile = cute.slice_(tile_v, (None, None, 0))
        load = cpasync.CopyBulkTensorTileG2SOp()
        tma_q = Tma(*cpasync.make_tiled_tma_atom(load, tiles.tma_view(t.q), qk_tile, (C, D)))
        tma_k = Tma(*cpasync.make_tiled_tma_atom(load, tiles.tma_view(t.k), qk_tile, (C, D)))
        v_src = t.o if cutlass.const_expr(cfg.v_from == "o") else t.v
        tma_v = Tma(*cpasync.make_tiled_tma_atom(load, tiles.tma_view(v_src), v_tile, (C, Dv)))
        store = cpasync.CopyBulkTensorTileS2GOp()
        tma_o = Tma(*cpasync.make_tiled_tma_atom(store, tiles.tma_view(t.o), v_tile, (C, Dv)))
        tma_w = tma_q
        if cutlass.const_expr(cfg.intra != "none"):
            w_op = store if cfg.intra == "save" else load
            w_tile = cute.slice_(tile_tp, (None, None, 0, 0))
            tma_w = Tma(*cpasync.make_tiled_tma_atom(w_op, tiles.tma_view(t.w), w_tile, (C, C)))

        common = Common(
            mma.tiled_mma(C, C, a_in_registers=False),
            mma.tiled_mma(C, C),
            mma.tiled_mma(C, D, b_major="MN"),
            tma_q, tma_k, tma_v, tma_o, tma_w,
            t.beta, t.o, t.w, t.h0, t.ht, t.starts, t.ends, t.slots, t.q.shape[2], t.q.shape[1], scale,
            tile_qk, tile_qk_mn, tile_v, tile_v_mn, tile_o, tile_o_mn, tile_tp, tile_tp_mn,
        )  # fmt: skip
        gate_params, gate_fields = self.gate_host(t, gate_args, tile_qk, tile_v)
        fields = {
            "sA": cute.struct.Align[cute.struct.MemRange[cutlass.Float32, C * A_STRIDE], 128],
            "sO": cute.struct.Align[cute.struct.MemRange[cutlass.BFloat16, cute.cosize(tile_o)], 1024],
            "sQK": cute.struct.Align[cute.struct.MemRange[cutlass.BFloat16, cute.cosize(tile_qk)], 1024],
            "sV": cute.struct.Align[cute.struct.MemRange[cutlass.BFloat16, cute.cosize(tile_v)], 1024],
            "sTP": cute.struct.Align[cute.struct.MemRange[cutlass.BFloat16, cute.cosize(tile_tp)], 1024],
            **gate_fields,
        }
        self.storage = cute.struct(type("Storage", (), {"__annotations__": fields}))
        HV = t.v.shape[2]
        N = t.starts.shape[0] if cutlass.const_expr(cfg.is_varlen) else t.q.shape[0]
        self.kernel(Params(common, gate_params)).launch(
            grid=(HV * cfg.value_blocks, N, 1),
            block=(self.threads, 1, 1),
            smem=self.storage.size_in_bytes(),
            stream=stream,
        )

    # ---------------------------------------------------------------- device side
    @cute.kernel
    def kernel(self, p: Params):
        c = p.common
        tidx, _, _ = cute.arch.thread_idx()
        hv, n, _ = cute.arch.block_idx()
        vb = 0
        if cutlass.const_expr(self.cfg.value_blocks > 1):
            hv, vb = hv // self.cfg.value_blocks, hv % self.cfg.value_blocks
        warp = cute.arch.make_warp_uniform(cute.arch.warp_idx())
        HV = c.beta.shape[2]
        b, tok0, seqlen, n_chunks = sequence.sequence_bounds(n, c.T, c.starts, c.ends, self.cfg.is_varlen, self.C)
        h0_row = ht_row = n
        if cutlass.const_expr(self.cfg.state_slots != "none"):
            h0_row = c.slots[n]
            if cutlass.const_expr(self.cfg.state_slots == "read_write"):
                ht_row = h0_row
        seq = Sequence(b, tok0, seqlen, n_chunks, n, hv, hv // (HV // c.H), h0_row, ht_row, vb)

        st = cutlass.memory.SmemAllocator().allocate(self.storage)
        sQK = st.sQK.get_tensor(c.tile_qk.outer, swizzle=c.tile_qk.inner)
        sV = st.sV.get_tensor(c.tile_v.outer, swizzle=c.tile_v.inner)
        sO = st.sO.get_tensor(c.tile_o.outer, swizzle=c.tile_o.inner)
        sTP = st.sTP.get_tensor(c.tile_tp.outer, swizzle=c.tile_tp.inner)
        smem = Smem(
            st.sA.get_tensor(cute.make_layout((self.C, A_STRIDE), stride=(A_STRIDE, 1))),
            sQK,
            tiles.mn_view(sQK, c.tile_qk_mn)[None, None, 1, None],
            sV,
            tiles.mn_view(sV, c.tile_v_mn),
            sO,
            tiles.mn_view(sO, c.tile_o_mn),
            sTP,
            tiles.mn_view(sQK, c.tile_qk_mn)[None, None, 0, None],
            tiles.mn_view(sTP, c.tile_tp_mn),
        )
        gsmem = self.gate_smem(st, p)
        rings = self.make_rings(st, c)
        if warp == 0:
            self.prefetch_descriptors(p)
        pipeline.rings_made()

        R = WarpGroupRole
        wg = warp // 4
        first_intra = self.layout.count(R.PRODUCER)
        first_state = first_intra + self.layout.count(R.INTRA)
        if wg < first_intra:
            self.layout.enter(R.PRODUCER)
            self.producer_role(p, smem, gsmem, rings, seq, tidx, warp)
        elif wg < first_state:
            if cutlass.const_expr(self.layout.count(R.INTRA) > 0):
                self.layout.enter(R.INTRA)
                self.intra_role(p, smem, gsmem, rings, seq, tidx - 128 * first_intra, warp - 4 * first_intra)
        else:
            self.layout.enter(R.STATE)
            self.state_role(p, smem, gsmem, rings, seq, tidx - 128 * first_state, warp - 4 * first_state)

    @cute.jit
    def state_role(self, p: Params, smem: Smem, gsmem, rings, seq: Sequence, stid, swarp):
        """The state warpgroups (``stid`` in [0, 128 x state warpgroups), ``swarp`` their warp): per chunk the intra
        step where the layout has no intra role, the chain, and the output; the final state at the end."""
        c = p.common
        cfg = self.cfg
        C, D = self.C, self.D
        swg = stid // 128
        row_block = swg
        writes = True
        if cutlass.const_expr(self.repeats_rows):
            row_block = 0
            writes = swg == 0
        chain = StateChain(c.mma_cc, c.mma_state, stid % 128, row_block, C, self.split_values)
        acc_s, cST = chain.new_state(D)
        row0 = seq.vb * self.Dv + 64 * row_block  # the warpgroup's first value column in the head
        state.init_state(acc_s, cST, c.h0, seq.h0_row, seq.hv, row0, cfg.start)
        cCC = chain.token_coordinates()
        state_threads = self.layout.threads_of(WarpGroupRole.STATE)
        tOs, tOg = tiles.tma_chunk_tiles(c.o.atom, c.o.tensor[None, None, seq.hv, seq.b], seq.tok0, smem.sO, seq.vb)
        stager = OutputStager(
            c.o.atom, tOs, tOg, smem.sO, smem.sO_mn, c.mma_cc, stid % 128, row_block, swarp == 0, self.o_stages,
            state_threads,
        )  # fmt: skip
        v_state = pipeline.consumer_start(self.v_stages)
        tp_state = pipeline.consumer_start(self.tp_stages)
        states = self.state_ring_states()
        has_intra_role = self.layout.count(WarpGroupRole.INTRA) > 0
        # Tinv and P come through a ring from the intra role or the workspace; an intra step makes them in place
        tp_ring = has_intra_role or cfg.intra == "load"
        self.before_chunks(smem, stid)
        checkpoint0 = sequence.checkpoint_row(seq.n, seq.tok0, seq.n_chunks, cfg.is_varlen, C)
        for chunk in cutlass.range(seq.n_chunks, unroll=1):
            pos = self.chunk_position(chunk, seq)
            if cutlass.const_expr(cfg.walk != "output"):
                if writes:
                    state.store_checkpoint(acc_s, cST, c.w_plain, checkpoint0 + pos, seq.hv, row0)
            if cutlass.const_expr(cfg.make_o and self.o_stages == 1):
                stager.free()  # ordered for the others by the intra step's barriers, or this one
                if cutlass.const_expr(tp_ring):
                    cute.arch.barrier(barrier_id=Barrier.STATE, number_of_threads=state_threads)
            if cutlass.const_expr(
                not has_intra_role
                and cfg.intra != "load"
                and not self.zero_values
                and (cfg.walk == "output" or self.intra_step_in_walks)
            ):
                self.intra_step(p, smem, gsmem, rings, states, seq, chunk, stid, swarp)
            ins = self.chain_inputs(p, smem, gsmem, rings, states, seq, chunk)
            if cutlass.const_expr(cfg.v_from is not None):
                rings.v.consumer_wait(v_state)
            if cutlass.const_expr(self.zeroes_v_tail and cfg.v_from == "v" and cfg.is_varlen):
                self.zero_tail_rows(smem.sV[None, None, v_state.index], seq.seqlen - pos * C, stid, state_threads)
            acc_k, acc_o = chain.project(acc_s, cST, ins.sK, ins.sQ, ins.gates, cfg.make_o, cfg.delta_rule)
            if cutlass.const_expr(cfg.reverse and cfg.delta_rule):
                if cutlass.const_expr(tp_ring):
                    rings.tp.consumer_wait(tp_state)
                sTP_mn = smem.sTP_mn[None, None, None, tp_state.index]
                chain.reverse_delta(
                    acc_s, acc_k, smem.sV_mn[None, None, v_state.index], sTP_mn[None, None, 1], sTP_mn[None, None, 0],
                    ins.sQ_mn, ins.sK_mn, ins.gates, cCC,
                )  # fmt: skip
            elif cutlass.const_expr(cfg.delta_rule):
                rY, rY_lo = chain.delta(acc_k, smem.sV_mn[None, None, v_state.index], ins.gates, cCC, cfg.v_from == "v")
                if cutlass.const_expr(tp_ring):
                    rings.tp.consumer_wait(tp_state)
                sTP = smem.sTP[None, None, None, tp_state.index]
                acc_vn = chain.values(rY, rY_lo, sTP[None, None, 0], acc_o, ins.gates, cCC, cfg.make_o)
            elif cutlass.const_expr(self.zero_values):
                if cutlass.const_expr(cfg.make_o):
                    ins.gates.o(acc_o, cCC)
            else:
                if cutlass.const_expr(tp_ring):
                    rings.tp.consumer_wait(tp_state)
                sTP = smem.sTP[None, None, None, tp_state.index]
                sV_mn = smem.sV_mn[None, None, v_state.index]
                acc_vn = chain.given_values(sV_mn, acc_o, ins.gates, cCC, cfg.v_from == "v", cfg.make_o)
            if cutlass.const_expr(not (cfg.reverse and cfg.delta_rule) and not self.zero_values):
                chain.update(acc_s, acc_o, acc_vn, sTP[None, None, 1], ins.sK_mn, ins.gates, cCC, cfg.make_o)
            if cutlass.const_expr(tp_ring):
                rings.tp.consumer_release(tp_state)
                tp_state.advance()
            # (rebound here: a loop carries only the names it rebinds or calls methods on, not what it passes on)
            states = self.chain_release(rings, states)
            if cutlass.const_expr(cfg.v_from == "v"):
                rings.v.consumer_release(v_state)
                v_state.advance()
            self.before_chunk_end(p, smem, gsmem, seq, chunk, swarp)
            if cutlass.const_expr(cfg.make_o):
                if cutlass.const_expr(cfg.v_from == "o"):
                    # a correction pass adds the first pass's o of the chunk, which came in the v stage
                    o_prev = chain.read_rows(smem.sV_mn[None, None, v_state.index])
                    for i in cutlass.range_constexpr(cute.size(acc_o)):
                        acc_o[i] = acc_o[i] + o_prev[i].to(cutlass.Float32)
                    rings.v.consumer_release(v_state)
                    v_state.advance()
                if writes:
                    stager.stage(acc_o, chunk)
                stager.flush(chunk, seq.n_chunks)
            elif cutlass.const_expr(
                not has_intra_role
                and not self.zero_values
                and (cfg.walk == "output" or (cfg.reverse and cfg.delta_rule))
            ):
                # the next intra step rewrites what this chunk's products read (P, before its first barrier: the
                # forward's O and the state-gradient walk's dO^T P read it)
                cute.arch.barrier(barrier_id=Barrier.STATE, number_of_threads=state_threads)
        if cutlass.const_expr(cfg.make_o):
            stager.finish(c.o_plain, seq.b, seq.hv, seq.vb * self.Dv, seq.tok0, seq.seqlen, seq.n_chunks, stid)
        if writes:
            state.store_state(acc_s, cST, c.ht, seq.ht_row, seq.hv, row0)
