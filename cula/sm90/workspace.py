"""The split passes' workspace (cula.ops.segment_split): the first pass saves each chunk's Tinv and P by TMA, the
later passes load them instead of making them again. Workspace rows per (range, value head): chunk c's Tinv at tile
2 c, its P at tile 2 c + 1, each a (C, C) bf16 tile."""

import cutlass
import cutlass.cute as cute


@cute.jit
def save_tinv_p(atom, tWs, tWg, chunk, stage=0):
    """One warp: a chunk's Tinv and P (smem tiles ``2 stage``, ``2 stage + 1`` of ``tWs``) to its workspace tiles
    ``2 chunk``, ``2 chunk + 1`` by TMA, as one bulk group (the caller waits for it to have read them before they are
    written again)."""
    cute.copy(atom, tWs[None, 2 * stage], tWg[None, 2 * chunk])
    cute.copy(atom, tWs[None, 2 * stage + 1], tWg[None, 2 * chunk + 1])
    cute.arch.cp_async_bulk_commit_group()


@cute.jit
def load_tinv_p(atom, tWg, tWs, chunk, stage, bar, with_p: cutlass.Constexpr):
    """The reverse of :func:`save_tinv_p`: a chunk's saved Tinv (and, ``with_p``, its P) from the workspace into smem
    tiles ``2 stage`` (and ``2 stage + 1``) of ``tWs`` by TMA, completing on ``bar`` (its expected bytes are the
    caller's)."""
    cute.copy(atom, tWg[None, 2 * chunk], tWs[None, 2 * stage], tma_bar_ptr=bar)
    if cutlass.const_expr(with_p):
        cute.copy(atom, tWg[None, 2 * chunk + 1], tWs[None, 2 * stage + 1], tma_bar_ptr=bar)
