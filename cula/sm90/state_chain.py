"""The per-chunk state products of the delta-rule family on one state warpgroup: its 64 value rows of S^T.

With G the chunk's cumulative log2 gate, Tinv the chunk's WY/UT inverse and P its masked intra-chunk scores (both
made by the intra role), per chunk:

    S^T K~^T, S^T Q~^T             K~, Q~: K and Q carrying the gate's factor to the chunk start
    Y^T     = (V^T - S^T K~^T) diag(beta)
    V_new^T = Y^T Tinv^T
    O^T     = scale S^T Q~^T + V_new^T P^T
    S^T    <- S^T decay + V_new^T K^                K^: K carrying the factor to the chunk end

Without the delta rule (simple GLA, Lightning) there is no S^T K~^T, no Y and no Tinv: V_new = V.

The state is the register A operand of the first two products (converted to bf16 each chunk), Y^T and V_new^T of
the next ones; the token tiles are the B operands in shared memory (K-major, and read MN-major for the update).
Where a gate's factors live is the gate's business (:class:`ChainGates`): a per-token gate multiplies the
accumulators' token columns (GDN), a per-key gate rides in the B tiles and multiplies the state's key columns (KDA).
"""

from __future__ import annotations

from dataclasses import dataclass

import cutlass
import cutlass.cute as cute
from cutlass.cute.nvgpu import warp as warp_ops
from cutlass.cute.nvgpu import warpgroup

from cula.sm90 import mma


class ChainGates:
    """A gate's part in the chain, made per chunk by the kernel's gate: ``decay`` the state's chunk decay (applied
    while S^T K~^T runs), ``y`` Y from V and S^T K~^T, ``o`` O's inter-chunk part, ``update`` the A operands of the
    state update from V_new. All act on this thread's accumulator elements (coordinates ``cCC`` / ``cST``)."""

    def decay(self, acc_s, cST):
        raise NotImplementedError

    def y(self, acc_k, v_frag, cCC):
        raise NotImplementedError

    def o(self, acc_o, cCC):
        raise NotImplementedError

    def update(self, acc_vn, cCC):
        raise NotImplementedError

    # the state-gradient walk with the delta rule (StateChain.reverse_delta); a factor that rides in a B tile (a
    # per-key gate's) is not applied again here
    def to_end(self, acc, cCC):
        """acc[v, j] times the factor carrying token j to the chunk's end."""
        raise NotImplementedError

    def query_operand(self, do_frag, cCC):
        """scale (Q's factor) dO^T as a bf16 A operand."""
        raise NotImplementedError

    def key_operand(self, acc_y, cCC):
        """-beta (K's factor to the chunk start) Y'^T as a bf16 A operand."""
        raise NotImplementedError


@dataclass(frozen=True)
class StateChain:
    """The chain on one warpgroup (``wtid`` its thread, ``row_block`` its 64 value rows). ``split_values``: Y and
    V_new enter their products as bf16 hi + lo pairs (about 16 mantissa bits instead of 8; KDA's gated operands need
    them to stay within 0.005 of the recurrence)."""

    mma_cc: object  # (C x C), A in registers
    mma_state: object  # (C x D), A in registers, B MN-major
    wtid: object
    row_block: object
    C: int
    split_values: bool

    @cute.jit
    def token_coordinates(self):
        """Element coordinates (value row, token) of this thread's (C x C) accumulators."""
        thr = self.mma_cc.get_slice(self.wtid)
        return thr.partition_C(cute.make_identity_tensor((self.C, self.C)))

    @cute.jit
    def new_state(self, D: cutlass.Constexpr):
        """This warpgroup's S^T rows, an fp32 (C x D) accumulator, and its element coordinates."""
        thr = self.mma_state.get_slice(self.wtid)
        acc_s = thr.make_fragment_C(thr.partition_shape_C((self.C, D)))
        return acc_s, thr.partition_C(cute.make_identity_tensor((self.C, D)))

    @cute.jit
    def project(self, acc_s, cST, sK, sQ, gates, make_o: cutlass.Constexpr, delta_rule: cutlass.Constexpr = True):
        """S^T K~^T (``delta_rule``) and S^T Q~^T (``make_o``) from the state before its chunk decay, which is
        applied meanwhile. Returns the two (C x C) accumulators (each unset where not made)."""
        thr = self.mma_cc.get_slice(self.wtid)
        acc_k = thr.make_fragment_C(thr.partition_shape_C((self.C, self.C)))
        acc_o = thr.make_fragment_C(thr.partition_shape_C((self.C, self.C)))
        b_k = thr.make_fragment_B(thr.partition_B(sK))
        b_q = thr.make_fragment_B(thr.partition_B(sQ))
        rS = mma.acc_to_operand(acc_s)
        warpgroup.fence()
        if cutlass.const_expr(delta_rule):
            mma.gemm(self.mma_cc, acc_k, rS, b_k, True)
        if cutlass.const_expr(make_o):
            mma.gemm(self.mma_cc, acc_o, rS, b_q, True)
        warpgroup.commit_group()
        gates.decay(acc_s, cST)
        warpgroup.wait_group(0)
        return acc_k, acc_o

    @cute.jit
    def read_rows(self, sX_mn):
        """This warpgroup's value rows of a (V, C) token tile view (V or the first pass's O), by ldmatrix .trans:
        a bf16 fragment laid out as a (C x C) accumulator."""
        ld = cute.make_tiled_copy_C(
            cute.make_copy_atom(warp_ops.LdMatrix8x8x16bOp(transpose=True, num_matrices=4), cutlass.BFloat16),
            self.mma_cc,
        )
        thr_ld = ld.get_slice(self.wtid)
        thr = self.mma_cc.get_slice(self.wtid)
        frag = cute.make_rmem_tensor(thr.partition_shape_C((self.C, self.C)), cutlass.BFloat16)
        rows = cute.local_tile(sX_mn, (self.C, self.C), (self.row_block, 0))
        cute.copy(ld, thr_ld.partition_S(rows), thr_ld.retile(frag))
        return frag

    @cute.jit
    def delta(self, acc_k, sV_mn, gates, cCC, v_given: cutlass.Constexpr):
        """Y^T from V (``v_given``; else v = 0, the later split passes) and S^T K~^T, as the bf16 A operand (hi, lo;
        lo None unless ``split_values``) of V_new's product."""
        v_frag = None
        if cutlass.const_expr(v_given):
            v_frag = self.read_rows(sV_mn)
        gates.y(acc_k, v_frag, cCC)
        if cutlass.const_expr(self.split_values):
            return mma.acc_to_operand_split(acc_k)
        return mma.acc_to_operand(acc_k), None

    @cute.jit
    def given_values(self, sV_mn, acc_o, gates, cCC, v_given: cutlass.Constexpr, make_o: cutlass.Constexpr):
        """Without the delta rule: V_new^T = V^T (``v_given``; else zero, the later split passes) as an fp32
        (C x C) accumulator for :meth:`update`; O's inter-chunk part scaled."""
        thr = self.mma_cc.get_slice(self.wtid)
        acc_vn = thr.make_fragment_C(thr.partition_shape_C((self.C, self.C)))
        if cutlass.const_expr(v_given):
            v_frag = self.read_rows(sV_mn)
            for i in cutlass.range_constexpr(cute.size(acc_vn)):
                acc_vn[i] = v_frag[i].to(cutlass.Float32)
        else:
            acc_vn.fill(0.0)
        if cutlass.const_expr(make_o):
            gates.o(acc_o, cCC)
        return acc_vn

    @cute.jit
    def values(self, rY, rY_lo, sTinv, acc_o, gates, cCC, make_o: cutlass.Constexpr):
        """V_new^T = Y^T Tinv^T, issued once the caller has waited for Tinv; O's inter-chunk part scaled meanwhile.
        Returns V_new^T's accumulator."""
        thr = self.mma_cc.get_slice(self.wtid)
        b_t = thr.make_fragment_B(thr.partition_B(sTinv))
        acc_vn = thr.make_fragment_C(thr.partition_shape_C((self.C, self.C)))
        warpgroup.fence()
        mma.gemm(self.mma_cc, acc_vn, rY, b_t, True)
        if cutlass.const_expr(self.split_values):
            mma.gemm(self.mma_cc, acc_vn, rY_lo, b_t, False)
        warpgroup.commit_group()
        if cutlass.const_expr(make_o):
            gates.o(acc_o, cCC)
        warpgroup.wait_group(0)
        return acc_vn

    @cute.jit
    def update(self, acc_s, acc_o, acc_vn, sP, sK_mn, gates, cCC, make_o: cutlass.Constexpr):
        """O^T += V_new^T P^T and S^T += (V_new^T, gated by the gate) K^, issued together and waited."""
        thr = self.mma_cc.get_slice(self.wtid)
        thr_st = self.mma_state.get_slice(self.wtid)
        b_p = thr.make_fragment_B(thr.partition_B(sP))
        b_kd = thr_st.make_fragment_B(thr_st.partition_B(sK_mn))
        rVn, rVn_lo, rVd = gates.update(acc_vn, cCC)
        warpgroup.fence()
        if cutlass.const_expr(make_o):
            mma.gemm(self.mma_cc, acc_o, rVn, b_p, False)
            if cutlass.const_expr(self.split_values):
                mma.gemm(self.mma_cc, acc_o, rVn_lo, b_p, False)
        mma.gemm(self.mma_state, acc_s, rVd, b_kd, False)
        if cutlass.const_expr(self.split_values):
            mma.gemm(self.mma_state, acc_s, rVn_lo, b_kd, False)
        warpgroup.commit_group()
        warpgroup.wait_group(0)

    @cute.jit
    def reverse_delta(self, acc_s, acc_k, sDO_mn, sP_mn, sTinv_mn, sQ_mn, sK_mn, gates, cCC):
        """One chunk of the state-gradient walk with the delta rule, the state dS'^T (the gradient of the chunk's end
        state) already decayed by :meth:`project`, which left dS'^T K^T in ``acc_k``:

            dV_new^T = (dS'^T K^T) 2^(G_L - G) + dO^T P          Y'^T = dV_new^T Tinv
            dS^T     = 2^G_L dS'^T + (scale 2^G dO^T) Q - (beta 2^G Y'^T) K

        P and Tinv read transposed (``sP_mn``, ``sTinv_mn``); the last products' B tiles ``sQ_mn`` and ``sK_mn``
        MN-major (q and k; a per-key gate's scale Q 2^G and K 2^G)."""
        tiled_t = mma.tiled_mma(self.C, self.C, b_major="MN")
        thr = tiled_t.get_slice(self.wtid)
        thr_st = self.mma_state.get_slice(self.wtid)
        do_frag = self.read_rows(sDO_mn)
        gates.to_end(acc_k, cCC)
        b_p = thr.make_fragment_B(thr.partition_B(sP_mn))
        r_do = mma.frag_to_operand(do_frag)
        mma.gemm_waited(tiled_t, acc_k, r_do, b_p, False)
        acc_y = thr.make_fragment_C(thr.partition_shape_C((self.C, self.C)))
        b_t = thr.make_fragment_B(thr.partition_B(sTinv_mn))
        r_dvn = mma.acc_to_operand(acc_k)
        warpgroup.fence()
        mma.gemm(tiled_t, acc_y, r_dvn, b_t, True)
        warpgroup.commit_group()
        r_q = gates.query_operand(do_frag, cCC)
        warpgroup.wait_group(0)
        r_k = gates.key_operand(acc_y, cCC)
        b_q = thr_st.make_fragment_B(thr_st.partition_B(sQ_mn))
        b_k = thr_st.make_fragment_B(thr_st.partition_B(sK_mn))
        warpgroup.fence()
        mma.gemm(self.mma_state, acc_s, r_q, b_q, False)
        mma.gemm(self.mma_state, acc_s, r_k, b_k, False)
        warpgroup.commit_group()
        warpgroup.wait_group(0)
