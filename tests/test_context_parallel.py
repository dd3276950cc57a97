"""Context parallelism (``cp_context``) on the CPU: 2 to 4 processes over gloo, each holding its part of the tokens,
must give the single-process result's slice of the outputs and the final states of its sequences (rel-RMSE <= 1e-5
in fp32). The batches hold sequences that span several ranks, start or end on a part boundary, or lie inside one
part, and random initial states: a missing or wrong exchange (no correction, a start chained in the wrong order,
the initial state dropped) changes the outputs of every rank after the first."""

import os

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn.functional as F

import cula
from cula import gdn, kda
from cula.ops.context_parallel import CPContext

T, H, K, V = 384, 2, 16, 32  # T divisible by 2, 3 and 4
BATCHES = {
    "one sequence": [0, T],
    "varlen": [0, 40, 96, 128, 300, 301, T],  # 96 / 128 / 192 are part boundaries for 4 / 3 / 2 ranks
}


def rel_rmse(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a - b).pow(2).mean().sqrt() / b.pow(2).mean().sqrt().clamp_min(1e-30)).item()


def inputs(op: str, N: int):
    gen = torch.Generator().manual_seed(7)
    q = F.normalize(torch.randn(1, T, H, K, generator=gen), dim=-1)
    k = F.normalize(torch.randn(1, T, H, K, generator=gen), dim=-1)
    v = torch.randn(1, T, H, V, generator=gen)
    g_shape = (1, T, H, K) if op == "kda" else (1, T, H)
    g = F.logsigmoid(torch.randn(*g_shape, generator=gen) + 3)
    beta = torch.rand(1, T, H, generator=gen)
    h0 = torch.randn(N, H, K, V, generator=gen)
    return q, k, v, g, beta, h0


def call(op: str, q, k, v, g, beta, **kwargs):
    fn = kda.chunk_kda if op == "kda" else gdn.chunk_gated_delta_rule
    return fn(q, k, v, g, beta, **kwargs)


def check_rank(rank: int, world: int, group) -> list[str]:
    """Every case on this rank; returns the failures."""
    failures = []
    lo, hi = rank * T // world, (rank + 1) * T // world
    for op in ("gdn", "kda"):
        for batch, offsets in BATCHES.items():
            cu = torch.tensor(offsets)
            q, k, v, g, beta, h0 = inputs(op, len(offsets) - 1)
            ctx = cula.build_cp_context(cu, group)
            local = ctx.cu_seqlens_cpu.tolist()
            # the global sequence of each local one: the one holding its first token
            seq_of = [int(torch.searchsorted(cu, lo + a, right=True)) - 1 for a in local[:-1]]
            part = [x[:, lo:hi] for x in (q, k, v, g, beta)]
            for with_h0 in (False, True):
                for v_first in (False, True):
                    h0_global = h0.transpose(-1, -2).contiguous() if v_first else h0
                    o_ref, ht_ref = call(
                        op, q, k, v, g, beta, initial_state=h0_global if with_h0 else None, output_final_state=True,
                        cu_seqlens=cu, state_v_first=v_first,
                    )  # fmt: skip
                    o, ht = call(
                        op, *part, initial_state=h0_global[seq_of] if with_h0 else None, output_final_state=True,
                        cp_context=ctx, state_v_first=v_first,
                    )  # fmt: skip
                    case = f"rank {rank}/{world} {op} {batch} h0={with_h0} state_v_first={v_first}"
                    errors = {"o": rel_rmse(o, o_ref[:, lo:hi]), "final state": rel_rmse(ht, ht_ref[seq_of])}
                    failures += [f"{case}: {name} rel-RMSE {e:.2e}" for name, e in errors.items() if not e <= 1e-5]
            # without final states, and the check's sensitivity: the part run alone differs where a sequence
            # comes from an earlier rank
            o_ref, _ = call(op, q, k, v, g, beta, initial_state=h0, cu_seqlens=cu)
            o, ht = call(op, *part, initial_state=h0[seq_of], cp_context=ctx)
            if ht is not None or not rel_rmse(o, o_ref[:, lo:hi]) <= 1e-5:
                failures.append(f"rank {rank}/{world} {op} {batch}: output_final_state=False")
            alone, _ = call(op, *part, initial_state=h0[seq_of], cu_seqlens=ctx.cu_seqlens)
            if ctx.pre_num_ranks and not rel_rmse(alone, o_ref[:, lo:hi]) > 1e-3:
                failures.append(f"rank {rank}/{world} {op} {batch}: the part alone matches, the check is blind")
    return failures


def check_errors(rank: int, world: int, group) -> list[str]:
    """Malformed cp_context calls raise before any exchange."""
    q, k, v, g, beta, _ = inputs("gdn", 1)
    ctx = cula.build_cp_context(torch.tensor([0, T]), group)
    n = T // world
    bad = {
        "pre_num_ranks outside the group": (CPContext(group, ctx.cu_seqlens, None, True, rank + 1, False, 0), n),
        "a part shorter than its cu_seqlens": (ctx, n - 1),
    }
    failures = []
    for what, (context, length) in bad.items():
        try:
            gdn.chunk_gated_delta_rule(*(x[:, :length] for x in (q, k, v, g, beta)), cp_context=context)
            failures.append(f"rank {rank}: {what} did not raise")
        except ValueError:
            pass
    return failures


def worker(rank: int, world: int, init_file: str, checks: tuple[str, ...], result_dir: str) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world)
    try:
        failures = []
        for name in checks:
            failures += globals()[name](rank, world, dist.group.WORLD)
    finally:
        dist.destroy_process_group()
    with open(os.path.join(result_dir, f"rank{rank}.txt"), "w") as f:
        f.write("\n".join(failures))


def run_ranks(world: int, tmp_path, checks: tuple[str, ...]) -> None:
    mp.spawn(worker, args=(world, str(tmp_path / "init"), checks, str(tmp_path)), nprocs=world, join=True)
    failures = [line for r in range(world) for line in (tmp_path / f"rank{r}.txt").read_text().splitlines()]
    assert not failures, "\n".join(failures)


@pytest.mark.parametrize("world", [2, 3, 4])
def test_every_rank_matches_one_process(world, tmp_path):
    run_ranks(world, tmp_path, ("check_rank",) + (("check_errors",) if world == 2 else ()))


def test_build_cp_context_matches_fla(tmp_path):
    """cuLA's builder gives FLA's contexts (without a group: the metadata FLA derives from world size and rank)."""
    fla_context = pytest.importorskip("fla.ops.cp.context")
    for offsets in BATCHES.values():
        cu = torch.tensor(offsets)
        for world in (2, 3, 4):
            for rank in range(world):
                ours = _context_for(cu, world, rank)
                theirs = fla_context.get_cp_cu_seqlens(cu, world_size=world, rank=rank)
                for name in ("is_last_rank", "pre_num_ranks", "is_first_rank", "post_num_ranks", "pre_num_conv_tokens"):
                    assert getattr(ours, name) == getattr(theirs, name), (offsets, world, rank, name)
                assert ours.cu_seqlens.tolist() == theirs.cu_seqlens.tolist()


def _context_for(cu, world: int, rank: int):
    """cula.build_cp_context as rank ``rank`` of ``world`` would build it."""
    import unittest.mock

    with (
        unittest.mock.patch.object(dist, "get_world_size", return_value=world),
        unittest.mock.patch.object(dist, "get_rank", return_value=rank),
    ):
        return cula.build_cp_context(cu, group=None)


def test_malformed_contexts():
    q, k, v, g, beta, _ = inputs("kda", 1)
    with pytest.raises(TypeError, match="cp_context"):
        kda.chunk_kda(q, k, v, g, beta, cp_context=object())
    with pytest.raises(ValueError, match="cu_seqlens"):
        kda.chunk_kda(q, k, v, g, beta, cp_context=CPContext())
    with pytest.raises(ValueError, match="batch size"):
        kda.chunk_kda(
            *(x.expand(2, *x.shape[1:]) for x in (q, k, v, g, beta)), cp_context=CPContext(None, torch.tensor([0, T]))
        )
    with pytest.raises(NotImplementedError, match="state pool"):
        kda.chunk_kda(
            q, k, v, g, beta, cp_context=CPContext(None, torch.tensor([0, T])), ssm_state_indices=torch.tensor([0])
        )
    with pytest.raises(NotImplementedError, match="backward"):
        kda.chunk_kda(q, k, v.requires_grad_(), g, beta, cp_context=CPContext(None, torch.tensor([0, T])))


def test_without_group_the_context_is_plain_varlen():
    """A context without a group (FLA: CP disabled) runs the local offsets as whole sequences."""
    q, k, v, g, beta, h0 = inputs("gdn", 3)
    cu = torch.tensor([0, 100, 200, T])
    o, ht = gdn.chunk_gated_delta_rule(q, k, v, g, beta, initial_state=h0, output_final_state=True, cu_seqlens=cu)
    o_cp, ht_cp = gdn.chunk_gated_delta_rule(
        q, k, v, g, beta, initial_state=h0, output_final_state=True, cp_context=CPContext(None, cu)
    )
    torch.testing.assert_close(o_cp, o)
    torch.testing.assert_close(ht_cp, ht)
    decision = cula.explain(gdn.chunk_gated_delta_rule, q, k, v, g, beta, cp_context=CPContext(None, cu))
    assert decision.backend == "torch"
