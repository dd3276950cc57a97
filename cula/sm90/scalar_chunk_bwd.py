"""Passes 3 and 4 of the gated linear backward for a scalar gate (simple GLA, Lightning; :mod:`cula.ops.chunk_backward`)
on SM90: one CTA per (chunk, head) makes the chunk's dq, dk, dv and the gate's gradient from its tokens and the two
state walks' checkpoints.

Per chunk (C = 64 tokens, G the cumulative log2 gate, Gamma_ij = 2^(G_i - G_j) for j <= i < valid, zero elsewhere by a
select; S^T and dS'^T the checkpoints, stored (V, K)):

    dq = scale 2^G (dO S) + scale (dP Gamma) K                 dP   = dO V^T
    dk = 2^(G_L - G) (V dS'^T) + scale (dP Gamma)^T Q           dP^T = V dO^T
    dv = 2^(G_L - G) (K dS') + P^T dO                           P^T  = scale (K Q^T) Gamma^T
    dg_t = sum_{s >= t} (q_s . dq_s - k_s . dk_s) + sum_j k_j . dk_j^inter + 2^G_L sum (S * dS')

Three warpgroups, one output each (dq, dk, dv): each makes its (C x C) scores by a wgmma from shared memory, masks and
gates them into a bf16 register operand, makes its inter-chunk part against a checkpoint, scales its rows and adds
the intra-chunk product. Warp 0 issues the six TMA loads (q, k, v, do tiles (C, D); the checkpoints (D, D)) on one
mbarrier and scans the gates; the warpgroups' row sums meet in shared memory, where warp 0 makes dg.

Shapes: q, k, v, do, dq, dk, dv [B, T, H, D] bf16; g [B, T, H] fp32 (the kernel's floored token gate, natural log);
dg [B, T, H] fp32; the checkpoints [rows, H, D, D] bf16 (S^T); ``chunks`` [rows, 2] int32: each row's first token in
the flattened (B T) axis and its valid tokens (0: no chunk, the CTA exits). D = 64 or 128.
"""

from __future__ import annotations

import os
from typing import NamedTuple

import cutlass
import cutlass.cute as cute
from cutlass.cute.nvgpu import cpasync
from cutlass.cute.nvgpu import warp as warp_ops

from cula.sm90 import mma, pipeline, scalar_gates, tiles

CHUNK = 64
WARPGROUPS = 3  # dq, dk, dv
# "0": the gradient kernels' element-by-element code instead of their smaller code (the default: their bf16 tiles to
# and from accumulator layouts by ldmatrix / stmatrix, KDA's key blocks of q, k and R read this way too, and GLA's
# gate factors by column pairs of 64-bit loads and its gate gradient's row batches as a loop; 1.1-2.3x faster on an
# H100, PERF.md)
ENV_TILE_COPIES = "CULA_GRADIENT_TILE_COPIES"


@cute.jit
def transposed(tile):
    """The (N x M) view of a 2-D (M x N) shared-memory tile (its modes swapped; the swizzle stays in the pointer)."""
    return cute.make_tensor(tile.iterator, cute.select(tile.layout, mode=[1, 0]))


class Tensors(NamedTuple):
    q: cute.Tensor
    k: cute.Tensor
    v: cute.Tensor
    do: cute.Tensor
    g: cute.Tensor
    states: cute.Tensor  # S^T per chunk row
    state_grads: cute.Tensor  # dS'^T per chunk row
    chunks: cute.Tensor
    dq: cute.Tensor
    dk: cute.Tensor
    dv: cute.Tensor
    dg: cute.Tensor


class Loads(NamedTuple):
    """The TMA atoms and views of the six loaded tiles: (T, D, heads, B) for the tokens (:func:`cula.sm90.tiles.tma_view`),
    (V, K, heads, rows) for the checkpoints (:func:`cula.sm90.tiles.state_tma_view`)."""

    q: tuple
    k: tuple
    v: tuple
    do: tuple
    states: tuple
    state_grads: tuple


class Params(NamedTuple):
    loads: Loads
    t: Tensors
    scale: cutlass.Float32
    tile_tok: object
    tile_tok_mn: object
    tile_state: object
    tile_state_mn: object
    own: tuple = ()  # what only a subclass's kernel takes (the delta rule's :class:`DeltaParams`)


def fake_args(head_dim: int, per_key_gate: bool) -> tuple:
    """The arguments of :meth:`ScalarGateChunkBwdSm90.__call__` (and of the per-key kernel's, whose g and dg carry a
    key mode) as fake tensors of symbolic B, T, H and rows, for a compile on any machine."""
    from cula import runtime

    sym, fake = runtime.sym_int, runtime.fake_tensor
    B, T, H, rows = sym(), sym(), sym(), sym()
    D = head_dim
    bf16, f32 = cutlass.BFloat16, cutlass.Float32
    gates = [fake(f32, (B, T, H, D)) if per_key_gate else fake(f32, (B, T, H), align=4) for _ in range(2)]
    tokens = [fake(bf16, (B, T, H, D)) for _ in range(4)]
    grads = [fake(bf16, (B, T, H, D)) for _ in range(3)]
    checkpoints = [fake(bf16, (rows, H, D, D)) for _ in range(2)]
    chunks = fake(cutlass.Int32, (rows, 2), align=4)
    return (*tokens, gates[0], *checkpoints, chunks, *grads, gates[1], f32(1.0), runtime.fake_stream())


def tile_copies() -> bool:
    """Whether the gradient kernels are compiled with tile copies (:data:`ENV_TILE_COPIES`, read per call: part of
    each kernel's cache key)."""
    return os.environ.get(ENV_TILE_COPIES, "1") != "0"


def compile_gradients(
    kernel_class, arch="sm_90a", *, head_dim=128, is_varlen=False, tile_copies=True, keep_artifacts=False
):  # fmt: skip
    """``kernel_class`` (one of the per-chunk gradient kernels) compiled on any machine for ``arch``
    (``tile_copies``: :data:`ENV_TILE_COPIES`); bound to its class, a variant's compile function for the compile
    check."""
    from cula import runtime

    args = kernel_class.fake_args(head_dim)
    return runtime.compile_kernel(kernel_class(head_dim, is_varlen, tile_copies), args, arch, keep_artifacts)


def compiled(name: str, kernel_class, device, head_dim: int, is_varlen: bool):
    """``kernel_class`` compiled for ``device``'s architecture with its tile copies (:func:`tile_copies`) on first
    use, then cached under ``name`` and those."""
    from cula import runtime

    arch = runtime.device_arch(device)
    copies = tile_copies()
    return runtime.get_or_compile(
        (name, head_dim, is_varlen, copies, arch),
        lambda: compile_gradients(kernel_class, arch, head_dim=head_dim, is_varlen=is_varlen, tile_copies=copies),
    )


def gradients(name: str, kernel_class, q, k, v, do, gate, S, dS, chunks, scale, is_varlen) -> tuple:
    """Passes 3 and 4 by ``kernel_class`` (compiled once per head dim, layout and architecture, cached under
    ``name``): ``(dq, dk, dv in q's dtype, the gate's gradient fp32 in the gate's shape)``, as
    :func:`cula.ops.chunk_backward.rows_backward` gives them; ``chunks`` the chunk rows as the kernel reads them
    (:class:`cula.ops.chunk_backward.ChunkRows`' ``kernel_rows``). The gate is [B, T, H] or, per key, [B, T, H, D]."""
    import torch

    fn = compiled(name, kernel_class, q.device, q.shape[3], is_varlen)
    dq, dk, dv = torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)
    dgate = torch.empty(gate.shape, dtype=torch.float32, device=q.device)
    fn(q, k, v, do, gate, S, dS, chunks, dq, dk, dv, dgate, float(scale))
    return dq, dk, dv, dgate


class ScalarGateChunkBwdSm90:
    """The kernel (module docstring)."""

    per_key_gate = False  # g and dg [B, T, H]; the per-key kernels' carry a key mode

    @classmethod
    def fake_args(cls, head_dim: int) -> tuple:
        """The kernel's arguments as fake tensors, for a compile on any machine (:func:`fake_args`)."""
        return fake_args(head_dim, cls.per_key_gate)

    def __init__(self, head_dim: int, is_varlen: bool, tile_copies: bool = True):
        assert head_dim in (64, 128), head_dim
        self.D = head_dim
        self.C = CHUNK
        self.is_varlen = is_varlen
        self.tile_copies = tile_copies  # ENV_TILE_COPIES
        self.threads = 128 * WARPGROUPS

    # ---------------------------------------------------------------- host side
    def chunk_loads(self, q, k, v, do, states, state_grads, value_columns=None):
        """The TMA atoms of a chunk's six loads (:class:`Loads`), with the token tile's and the checkpoint tile's
        layouts: ``(loads, tile_tok, tile_tok_mn, tile_state, tile_state_mn)``. ``value_columns``: v, dO and the
        checkpoints' rows loaded that many at a time (a slab: (C, value_columns) and (value_columns, D) boxes, whose
        token tile layouts are then returned last, ``tile_value, tile_value_mn``)."""
        C, D = self.C, self.D
        Vc = D if value_columns is None else value_columns
        tile_tok, tile_tok_mn = tiles.token_tiles(C, D, 1)
        tile_value, tile_value_mn = tiles.token_tiles(C, Vc, 1)
        tile_state, tile_state_mn = tiles.token_tiles(Vc, D, 1)
        load = cpasync.CopyBulkTensorTileG2SOp()

        def atom(view, tile, shape):
            return cpasync.make_tiled_tma_atom(load, view, cute.slice_(tile, (None, None, 0)), shape)

        tok, ckpt = tiles.tma_view, tiles.state_tma_view
        loads = Loads(
            atom(tok(q), tile_tok, (C, D)), atom(tok(k), tile_tok, (C, D)), atom(tok(v), tile_value, (C, Vc)),
            atom(tok(do), tile_value, (C, Vc)), atom(ckpt(states), tile_state, (Vc, D)),
            atom(ckpt(state_grads), tile_state, (Vc, D)),
        )  # fmt: skip
        tiles_ = (loads, tile_tok, tile_tok_mn, tile_state, tile_state_mn)
        return tiles_ if value_columns is None else (*tiles_, tile_value, tile_value_mn)

    def shared_fields(self, tile_tok, tile_state, token_tiles, row_sums: int) -> dict:
        """The shared storage both gradient kernels hold: the load ring, the bf16 ``token_tiles`` (names) and the two
        checkpoints, the gates, ``row_sums`` fp32 values per token and one per warp."""
        C = self.C
        bf16, f32 = cutlass.BFloat16, cutlass.Float32

        def tile(elems):
            return cute.struct.Align[cute.struct.MemRange[bf16, elems], 1024]

        return {
            "ring": pipeline.ring_storage(1),
            **{name: tile(cute.cosize(tile_tok)) for name in token_tiles},
            "sS": tile(cute.cosize(tile_state)),
            "sDS": tile(cute.cosize(tile_state)),
            "sG": cute.struct.MemRange[f32, C],
            "sBeta": cute.struct.MemRange[f32, C],
            "sFac": cute.struct.MemRange[f32, 2 * C],
            "sRows": cute.struct.MemRange[f32, row_sums * C],
            "sWarps": cute.struct.MemRange[f32, self.threads // 32],
        }

    def launch_with(self, p, fields: dict, rows, heads, stream):
        """The kernel on ``fields`` (its shared storage): one CTA per (chunk row, head)."""
        self.storage = cute.struct(type("Storage", (), {"__annotations__": fields}))
        self.kernel(p).launch(
            grid=(rows, heads, 1), block=(self.threads, 1, 1), smem=self.storage.size_in_bytes(), stream=stream
        )

    @cute.jit
    def __call__(self, q, k, v, do, g, states, state_grads, chunks, dq, dk, dv, dg, scale, stream):
        t = Tensors(q, k, v, do, g, states, state_grads, chunks, dq, dk, dv, dg)
        loads, tile_tok, tile_tok_mn, tile_state, tile_state_mn = self.chunk_loads(q, k, v, do, states, state_grads)
        p = Params(loads, t, scale, tile_tok, tile_tok_mn, tile_state, tile_state_mn)
        # per row: q . dq, k . dk, k . dk^inter; per warp: its part of sum(S * dS')
        fields = self.shared_fields(tile_tok, tile_state, ("sQ", "sK", "sV", "sDO"), 3)
        self.launch_with(p, fields, chunks.shape[0], q.shape[2], stream)

    # ---------------------------------------------------------------- device side
    @staticmethod
    def token_tile(p, field):
        """A bf16 token tile of :meth:`shared_fields` as its swizzled (C, D, 1) tensor."""
        return field.get_tensor(p.tile_tok.outer, swizzle=p.tile_tok.inner)

    def loaded_tiles(self, st, p):
        """What the loads fill (:meth:`issue_loads`): the token tiles q, k, v, dO (C, D, 1) and the checkpoints S, dS
        (D, D, 1), swizzled."""
        tokens = (self.token_tile(p, field) for field in (st.sQ, st.sK, st.sV, st.sDO))
        states = (field.get_tensor(p.tile_state.outer, swizzle=p.tile_state.inner) for field in (st.sS, st.sDS))
        return (*tokens, *states)

    @cute.jit
    def coordinates(self, t):
        """This thread and CTA: ``(tidx, row, head, warp, lane, valid, b, t0)``: the chunk row and head of its block
        index, the row's valid tokens and its first token as (batch row b, token t0)."""
        tidx, _, _ = cute.arch.thread_idx()
        row, head, _ = cute.arch.block_idx()
        warp = cute.arch.make_warp_uniform(cute.arch.warp_idx())
        lane = cute.arch.lane_idx()
        first, valid = t.chunks[row, 0], t.chunks[row, 1]
        T = t.q.shape[1]
        return tidx, row, head, warp, lane, valid, first // T, first % T

    @cute.kernel
    def kernel(self, p: Params):
        C, D = self.C, self.D
        t = p.t
        tidx, row, h, warp, lane, valid, b, t0 = self.coordinates(t)

        st = cutlass.memory.SmemAllocator().allocate(self.storage)
        sQ, sK, sV, sDO, sS, sDS = self.loaded_tiles(st, p)
        sG = st.sG.get_tensor(cute.make_layout((C, 1)))
        sBeta = st.sBeta.get_tensor(cute.make_layout((C, 1)))
        sFac = st.sFac.get_tensor(cute.make_layout((C, 1, 2)))
        sRows = st.sRows.get_tensor(cute.make_layout((C, 3)))
        sWarps = st.sWarps.get_tensor(cute.make_layout(4 * WARPGROUPS))
        loads = pipeline.tma_ring(st.ring, 1, 4 * C * D * 2 + 2 * D * D * 2, 4 * WARPGROUPS)
        pipeline.rings_made()

        if valid > 0:
            if warp == 0:
                self.issue_loads(p, loads, sQ, sK, sV, sDO, sS, sDS, b, t0, h, h, row)
                raw = scalar_gates.load_gates(t.g[b, None, h], None, t0, valid, 0, lane, C)
                scalar_gates.publish_gates(sG, sBeta, sFac, 0, raw, 0, valid, lane, C)
            self.await_tokens(loads, (sQ, sK, sV, sDO), valid, tidx)
            cute.arch.sync_threads()  # the gates and the zeroed rows
            wg = warp // 4
            wtid = tidx % 128
            tiles_ = (sQ[None, None, 0], sK[None, None, 0], sV[None, None, 0], sDO[None, None, 0])
            if wg == 0:
                self.make_dq(p, tiles_, sS, sG, sFac, sRows, valid, wtid, b, t0, h)
            elif wg == 1:
                self.make_dk(p, tiles_, sDS, sG, sFac, sRows, valid, wtid, b, t0, h)
            else:
                self.make_dv(p, tiles_, sDS, sG, sFac, valid, wtid, b, t0, h)
            self.state_product(sS, sDS, sWarps, tidx, warp, lane)
            cute.arch.sync_threads()
            if warp == 0:
                self.gate_gradient(t, sG, sRows, sWarps, valid, lane, b, t0, h)

    @cute.jit
    def await_tokens(self, loads, token_tiles, valid, tidx):
        """Every thread: waits for the chunk's loads; in a varlen call, zeroes the rows of the ``token_tiles`` past
        the chunk's end (the next sequence's tokens) before any product reads them. The caller synchronises."""
        loaded = pipeline.consumer_start(1)
        loads.consumer_wait(loaded)
        if cutlass.const_expr(self.is_varlen):
            if valid < self.C:
                for tile in token_tiles:
                    tiles.zero_rows_from(tile[None, None, 0], valid, tidx, self.threads)
                cute.arch.fence_proxy("async.shared", space="cta")

    @cute.jit
    def issue_loads(self, p, loads, sQ, sK, sV, sDO, sS, sDS, b, t0, h, hv, row, slab=0):
        """Warp 0: q and k of head h, v and dO of value head hv (token t0 of batch row b), and the chunk row's two
        checkpoints, on one mbarrier; with tiles of a slab of value columns (:meth:`chunk_loads`), slab ``slab``'s
        columns of v and dO and rows of the checkpoints."""
        L = p.loads
        fill = pipeline.producer_start(1)
        loads.producer_acquire(fill)
        bar = loads.producer_get_barrier(fill)
        for (tma, view), smem_tile, head, column_tile in zip(
            (L.q, L.k, L.v, L.do), (sQ, sK, sV, sDO), (h, h, hv, hv), (0, 0, slab, slab), strict=True
        ):  # fmt: skip
            tS, tG = tiles.tma_chunk_tiles(tma, view[None, None, head, b], t0, smem_tile, column_tile)
            cute.copy(tma, tG[None, 0], tS[None, 0], tma_bar_ptr=bar)
        for (tma, view), smem_tile in zip((L.states, L.state_grads), (sS, sDS), strict=True):
            tS, tG = tiles.tma_chunk_tiles(tma, view[None, None, hv, row], 0, smem_tile)
            cute.copy(tma, tG[None, slab], tS[None, 0], tma_bar_ptr=bar)

    @cute.jit
    def masked_scores(self, acc, cCC, sG, valid, transposed: cutlass.Constexpr, scale):
        """:meth:`masked` as a bf16 register operand."""
        return mma.acc_to_operand(self.masked(acc, cCC, sG, valid, transposed, scale))

    @cute.jit
    def masked(self, acc, cCC, sG, valid, transposed: cutlass.Constexpr, scale):
        """A (C x C) score accumulator in fp32: entry (i, j) (or (j, i), ``transposed``) times ``scale`` 2^(G_i - G_j)
        (the gate's factor left out with ``sG`` None) where j <= i < valid, else zero by a select."""
        gated = sG is not None
        if cutlass.const_expr(gated):
            g_r, _, g_c = scalar_gates.gates_at(cCC, sG, sG, sG, 0)
        out = cute.make_rmem_tensor(acc.layout, cutlass.Float32)
        for e in cutlass.range_constexpr(cute.size(acc)):
            r, c = cCC[e]
            rr, kc = mma.acc_row_slot(e), mma.acc_col_slot(e)
            x = cutlass.Float32(0.0)
            if cutlass.const_expr(transposed):
                if r <= c and c < valid:
                    x = acc[e] * scale
                    if cutlass.const_expr(gated):
                        x = x * cute.math.exp2(g_c[kc] - g_r[rr], fastmath=True)
            else:
                if c <= r and r < valid:
                    x = acc[e] * scale
                    if cutlass.const_expr(gated):
                        x = x * cute.math.exp2(g_r[rr] - g_c[kc], fastmath=True)
            out[e] = x
        return out

    @cute.jit
    def smem_gemm(self, tiled, acc, sA, sB, wtid, zero_init: cutlass.Constexpr):
        """acc (+)= A B^T by ``tiled``, both operands in shared memory (B given (N, K)), waited."""
        thr = tiled.get_slice(wtid)
        a = thr.make_fragment_A(thr.partition_A(sA))
        bb = thr.make_fragment_B(thr.partition_B(sB))
        mma.gemm_waited(tiled, acc, a, bb, zero_init)

    @cute.jit
    def product(self, tiled, sA, sB, wtid, n: cutlass.Constexpr):
        """A B^T by ``tiled`` (:meth:`smem_gemm`): an fp32 (C x n) accumulator and its coordinates."""
        thr = tiled.get_slice(wtid)
        acc = thr.make_fragment_C(thr.partition_shape_C((self.C, n)))
        self.smem_gemm(tiled, acc, sA, sB, wtid, True)
        return acc, thr.partition_C(cute.make_identity_tensor((self.C, n)))

    @cute.jit
    def scores(self, sA, sB, wtid):
        """A B^T for two (C, D) token tiles: an fp32 (C x C) accumulator and its coordinates. (Each warpgroup's
        branch makes its own tiled MMAs: a value made inside one branch does not reach another.)"""
        return self.product(mma.tiled_mma(self.C, self.C, a_in_registers=False), sA, sB, wtid, self.C)

    @cute.jit
    def inter(self, b_major: cutlass.Constexpr, sA, sB, wtid):
        """A B for a (C, D) token tile and a checkpoint view (``b_major`` "MN": read (K, V); "K": read (V, K)): an
        fp32 (C x D) accumulator and its coordinates."""
        tiled = mma.tiled_mma(self.C, self.D, b_major=b_major, a_in_registers=False)
        return self.product(tiled, sA, sB, wtid, self.D)

    @cute.jit
    def accumulate(self, b_major: cutlass.Constexpr, acc, sA, sB, wtid):
        """acc += A B, both operands in shared memory (B a view as ``product`` takes it)."""
        tiled = mma.tiled_mma(self.C, self.D, b_major=b_major, a_in_registers=False)
        self.smem_gemm(tiled, acc, sA, sB, wtid, False)

    @cute.jit
    def add_intra(self, acc, r_scores, sB_mn, wtid):
        """acc += (scores) B with the scores a bf16 register operand and B a token tile read (D, C)."""
        tiled = mma.tiled_mma(self.C, self.D, b_major="MN")
        thr = tiled.get_slice(wtid)
        bb = thr.make_fragment_B(thr.partition_B(sB_mn))
        mma.gemm_waited(tiled, acc, r_scores, bb, False)

    @cute.jit
    def scale_rows(self, acc, cTD, sFac, col: cutlass.Constexpr, scale):
        for e in cutlass.range_constexpr(cute.size(acc)):
            r, _ = cTD[e]
            acc[e] = acc[e] * sFac[r, 0, col] * scale

    @cute.jit
    def row_dot(self, acc, cTD, sX, sRows, col: cutlass.Constexpr, wtid):
        """sum_d x[i, d] acc[i, d] per row i to ``sRows[i, col]``: each thread's part, then its quad's (a row's
        elements lie on the four lanes of a quad)."""
        part = cute.make_rmem_tensor(cute.make_layout(2), cutlass.Float32)
        part.fill(0.0)
        if cutlass.const_expr(self.tile_copies):
            x = self.tile_fragment(acc, sX, wtid)
            for e in cutlass.range_constexpr(cute.size(acc)):
                part[mma.acc_row_slot(e)] = part[mma.acc_row_slot(e)] + x[e].to(cutlass.Float32) * acc[e]
        else:
            for e in cutlass.range_constexpr(cute.size(acc)):
                r, d = cTD[e]
                part[mma.acc_row_slot(e)] = part[mma.acc_row_slot(e)] + sX[r, d].to(cutlass.Float32) * acc[e]
        self.quad_sums(part, cTD, sRows, col, wtid)

    def accumulator_copy(self, acc, atom):
        """``atom`` (ldmatrix or stmatrix, bf16) tiled over the (C x N) accumulator layout ``acc`` has: each thread
        moves its own elements of a swizzled (C x N) bf16 tile, eight 8 x 8 blocks per instruction instead of one
        element."""
        n = 2 * cute.size(acc)  # a thread holds C N / 128 elements of a (C x N) warpgroup accumulator, C = 64
        return cute.make_tiled_copy_C(cute.make_copy_atom(atom, cutlass.BFloat16), mma.tiled_mma(self.C, n))

    @cute.jit
    def tile_fragment(self, acc, sX, wtid):
        """The bf16 tile ``sX`` (C x N) read by ldmatrix into the layout of this thread's (C x N) accumulator
        ``acc``: element e is sX at acc's element e."""
        load = self.accumulator_copy(acc, warp_ops.LdMatrix8x8x16bOp(transpose=False, num_matrices=4))
        thr = load.get_slice(wtid)
        frag = cute.make_rmem_tensor(acc.layout, cutlass.BFloat16)
        cute.copy(load, thr.partition_S(sX), thr.retile(frag))
        return frag

    @cute.jit
    def store_tile(self, acc, sX, factor: cutlass.Constexpr, wtid):
        """``factor`` (a constant) times the (C x N) accumulator to the bf16 tile ``sX`` by stmatrix."""
        frag = cute.make_rmem_tensor(acc.layout, cutlass.BFloat16)
        frag.store((acc.load() * factor).to(cutlass.BFloat16))
        self.store_fragment(frag, sX, wtid, False)

    @cute.jit
    def store_fragment(self, frag, sX, wtid, transpose: cutlass.Constexpr):
        """A bf16 fragment in a (C x N) accumulator's layout to the (C x N) view ``sX`` by stmatrix; ``transpose``
        for a transposed view of a K-major tile (:func:`transposed`), whose rows lie down its columns."""
        store = self.accumulator_copy(frag, warp_ops.StMatrix8x8x16bOp(transpose=transpose, num_matrices=4))
        thr = store.get_slice(wtid)
        cute.copy(store, thr.retile(frag), thr.partition_D(sX))

    @cute.jit
    def quad_sums(self, part, coords, sRows, col: cutlass.Constexpr, wtid):
        """Each row's sum of an accumulator-shaped tile, from this thread's part of its two rows (``part``, by row slot:
        a row lies on the four lanes of a quad), to ``sRows[row, col]``."""
        for rr in cutlass.range_constexpr(2):
            x = part[rr]
            x = x + cute.arch.shuffle_sync_bfly(x, 1)
            x = x + cute.arch.shuffle_sync_bfly(x, 2)
            r, _ = coords[2 * rr]
            if wtid % 4 == 0:
                sRows[r, col] = x

    @cute.jit
    def store_rows(self, acc, cTD, mX, valid, b, t0, h, col0=0):
        """The (C x N) accumulator's rows before ``valid`` to ``mX[b, t0 + i, h, col0:]`` in mX's dtype."""
        for rr in cutlass.range_constexpr(2):  # the thread's two rows: one predicate and one row address each
            r, _ = cTD[mma.acc_col_element(0, rr)]
            if r < valid:
                row = mX[b, t0 + r, h, None]
                for kc in cutlass.range_constexpr(cute.size(acc) // 2):
                    e = mma.acc_col_element(kc, rr)
                    _, d = cTD[e]
                    row[col0 + d] = acc[e].to(mX.element_type)

    @cute.jit
    def make_dq(self, p, tiles_, sS, sG, sFac, sRows, valid, wtid, b, t0, h):
        sQ, sK, sV, sDO = tiles_
        acc_dp, cCC = self.scores(sDO, sV, wtid)
        r_dp = self.masked_scores(acc_dp, cCC, sG, valid, False, p.scale)
        acc, cTD = self.inter("MN", sDO, tiles.mn_view(sS, p.tile_state_mn)[None, None, 0], wtid)
        self.scale_rows(acc, cTD, sFac, 0, p.scale)
        self.add_intra(acc, r_dp, tiles.mn_view(sK, p.tile_tok_mn)[None, None, 0], wtid)
        self.row_dot(acc, cTD, sQ, sRows, 0, wtid)
        self.store_rows(acc, cTD, p.t.dq, valid, b, t0, h)

    @cute.jit
    def make_dk(self, p, tiles_, sDS, sG, sFac, sRows, valid, wtid, b, t0, h):
        sQ, sK, sV, sDO = tiles_
        acc_dpt, cCC = self.scores(sV, sDO, wtid)
        r_dpt = self.masked_scores(acc_dpt, cCC, sG, valid, True, p.scale)
        acc, cTD = self.inter("MN", sV, tiles.mn_view(sDS, p.tile_state_mn)[None, None, 0], wtid)
        self.scale_rows(acc, cTD, sFac, 1, cutlass.Float32(1.0))
        self.row_dot(acc, cTD, sK, sRows, 2, wtid)
        self.add_intra(acc, r_dpt, tiles.mn_view(sQ, p.tile_tok_mn)[None, None, 0], wtid)
        self.row_dot(acc, cTD, sK, sRows, 1, wtid)
        self.store_rows(acc, cTD, p.t.dk, valid, b, t0, h)

    @cute.jit
    def make_dv(self, p, tiles_, sDS, sG, sFac, valid, wtid, b, t0, h):
        sQ, sK, sV, sDO = tiles_
        acc_pt, cCC = self.scores(sK, sQ, wtid)
        r_pt = self.masked_scores(acc_pt, cCC, sG, valid, True, p.scale)
        acc, cTD = self.inter("K", sK, sDS[None, None, 0], wtid)
        self.scale_rows(acc, cTD, sFac, 1, cutlass.Float32(1.0))
        self.add_intra(acc, r_pt, tiles.mn_view(sDO, p.tile_tok_mn)[None, None, 0], wtid)
        self.store_rows(acc, cTD, p.t.dv, valid, b, t0, h)

    @cute.jit
    def state_product(self, sS, sDS, sWarps, tidx, warp, lane):
        """sum (S * dS') over the two checkpoints (the same layout), each warp's part to ``sWarps[warp]``."""
        D = self.D
        x = cutlass.Float32(0.0)
        for idx in cutlass.range(tidx, D * D, self.threads, unroll=1):
            r, c = idx // D, idx % D
            x = x + sS[r, c, 0].to(cutlass.Float32) * sDS[r, c, 0].to(cutlass.Float32)
        for i in cutlass.range_constexpr(5):
            x = x + cute.arch.shuffle_sync_bfly(x, 1 << i)
        if lane == 0:
            sWarps[warp] = x

    @cute.jit
    def gate_gradient(self, t, sG, sRows, sWarps, valid, lane, b, t0, h):
        """Warp 0, two rows per lane: dg_i = sum_{s >= i} (q . dq - k . dk)_s + sum_j (k . dk^inter)_j
        + 2^G_L sum (S * dS'), stored for the valid rows."""
        C = self.C
        f32 = cutlass.Float32
        local_lo = sRows[lane, 0] - sRows[lane, 1]
        local_hi = sRows[lane + 32, 0] - sRows[lane + 32, 1]
        inter = sRows[lane, 2] + sRows[lane + 32, 2]
        states = f32(0.0)
        for w in cutlass.range_constexpr(4 * WARPGROUPS):
            states = states + sWarps[w]
        after_lo, after_hi = scalar_gates.warp_scan_64(local_lo, local_hi, lane, True)
        for i in cutlass.range_constexpr(5):
            inter = inter + cute.arch.shuffle_sync_bfly(inter, 1 << i)
        constant = inter + cute.math.exp2(sG[C - 1, 0], fastmath=True) * states
        if lane < valid:
            t.dg[b, t0 + lane, h] = after_lo + constant
        if lane + 32 < valid:
            t.dg[b, t0 + lane + 32, h] = after_hi + constant
