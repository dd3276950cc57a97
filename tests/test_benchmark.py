"""The benchmark on a CPU machine (the README's main job) and the arguments it hands FLA on a GPU."""

from __future__ import annotations

import inspect
import json

import pytest

import cula
from benchmarks import run as bench
from cula.dispatch import fla_function

OPS = ["gdn", "kda", "gla", "simple_gla"]


def test_cpu_run_writes_a_table_and_json(tmp_path):
    assert bench.main(["--ops", ",".join(OPS), "--out", str(tmp_path)]) == 0
    result = json.loads((tmp_path / "benchmark.json").read_text())
    assert [row["op"] for row in result["rows"]] == OPS
    for row in result["rows"]:
        assert row["cula_backend"] == "torch" and row["cula_ms"] > 0 and row["fla_ms"] > 0
        assert row["rel_rmse"] < 1e-4, row
    table = (tmp_path / "BENCHMARK.md").read_text()
    assert "none (CPU only" in table and table.count("| torch |") == len(OPS)


@pytest.mark.parametrize("op", OPS)
@pytest.mark.parametrize("lengths", [None, [3, 100, 1]])
def test_gpu_grid_arguments_fit_fla_and_cula(op, lengths):
    case = bench.Case(op, 1, sum(lengths) if lengths else 64, 2, 32, lengths, "t")
    args = bench.make_inputs(case, "cpu", bench.torch.bfloat16, requires_grad=False)
    cula_fn, target = bench.entry_points(op)
    inspect.signature(fla_function(target)).bind(**args)
    assert cula.explain(cula_fn, **args).backend == "torch"  # binds and validates as a real call would


def test_layer_grid_has_the_op_normalise_raw_q_and_k():
    cases = bench.gpu_grid(["gdn", "kda"], ["layer"])
    assert [c.name for c in cases] == ["B=2 T=16384 H=64 l2norm in op", "B=1 T=8192 H=64 l2norm in op"]
    small = bench.Case("gdn", 1, 64, 2, 32, layer=True)
    args = bench.make_inputs(small, "cpu", bench.torch.bfloat16, requires_grad=False)
    assert args["use_qk_l2norm_in_kernel"] and args["k"].norm(dim=-1).max() > 2  # raw, not unit rows
    inspect.signature(fla_function(bench.entry_points("gdn")[1])).bind(**args)
    assert cula.explain(bench.entry_points("gdn")[0], **args).backend == "torch"


def test_grid_and_floor():
    cases = bench.gpu_grid(["gdn"], ["core", "varlen", "long"])
    names = [c.name for c in cases]
    assert names[:3] == ["B=1 T=8192 H=64", "B=2 T=16384 H=64", "B=8 T=2048 H=32"] and names[-1] == "B=1 T=65536 H=8"
    varlen = [c for c in cases if c.lengths is not None]
    assert len(varlen) == 6 and {len(c.lengths) for c in varlen} == {10, 20}
    assert all(sum(c.lengths) == c.T and min(c.lengths) >= 1 for c in varlen)
    flops, bytes_ = bench.floor(cases[1])
    # DESIGN-NOTES: B2 T16384 H64 GDN is about 0.5 ms by either term on the H200
    assert 0.45 < flops / 687e12 * 1e3 < 0.6 and 0.45 < bytes_ / 4.3e12 * 1e3 < 0.6


@pytest.mark.parametrize("op", ["gdn", "kda"])
def test_dispatch_model_matches_the_h200_measurements(op):
    """An SM90 kernel's time model (used by dispatch to prefer FLA where the kernel is slower) against the committed
    side-by-side H200 run of its op: within 30 % of every measured kernel time, split rows included, and picking the
    faster side."""
    import importlib
    from pathlib import Path

    from cula.dispatch import expected_ms

    fla_time = importlib.import_module(f"cula.{op}.api").FLA_TIME
    kernel_module = importlib.import_module(f"cula.{op}.chunk_fwd_sm90")
    estimated_ms = kernel_module.estimated_ms
    measured = json.loads((Path(bench.__file__).parent / "results" / "h200_fwd.json").read_text())
    cases = {c.name: c for c in bench.gpu_grid([op], ["core", "varlen", "long"])}
    rows = [r for r in measured["rows"] if r["op"] == op and r["mode"] == "fwd" and r["shape"] in cases]
    assert sorted(r["shape"] for r in rows) == sorted(cases)  # other grids' rows (layer, other ops) may be there
    for row in rows:
        case = cases[row["shape"]]
        # the kernel's own time: the row's when dispatch picked it, else the forced-kernel timing
        kernel_ms = row["cula_ms"] if row["cula_backend"] == "cute" else row["kernel_ms"]
        assert kernel_ms is not None, row
        # the benchmark passes varlen offsets on the device only, read once per cu_seqlens tensor by both sides
        assert "varlen offsets" in measured["env"]
        lengths = case.lengths or [case.T] * case.B
        ours, fla = expected_ms(lengths, case.H, 132, estimated_ms, fla_time)
        assert abs(ours / kernel_ms - 1) < 0.3, (row["shape"], ours, kernel_ms)
        if abs(kernel_ms / row["fla_ms"] - 1) > 0.05:  # on a near-tie either side is right
            assert (ours <= fla) == (kernel_ms <= row["fla_ms"]), (row["shape"], ours, fla)


@pytest.mark.parametrize("op", OPS)
@pytest.mark.parametrize("lengths", [None, [5, 70, 1]])
def test_reference_on_the_first_heads_is_the_whole_calls_slice(op, lengths):
    B, H, D = (1, 3, 32) if lengths else (2, 3, 32)
    case = bench.Case(op, B, sum(lengths) if lengths else 70, H, D, lengths, "t")
    args = bench.make_inputs(case, "cpu", bench.torch.bfloat16, requires_grad=False)
    args["initial_state"] = bench.torch.randn(len(lengths) if lengths else B, H, D, D) * 0.1
    cula_fn, _ = bench.entry_points(op)
    with bench.forced_backend("torch"):
        o, s = cula_fn(**bench.head_slice(args, H))  # every head, fp32
    reference = bench.reference_outputs(op, args, heads=2)
    assert reference[0].shape == (*o.shape[:2], 2, D) and reference[1].shape == (s.shape[0], 2, D, D)
    assert max(bench.ref_rmse(o, s, reference, 2)) < 1e-5
    # the measure sees a head out of place, in the output and in the state
    assert min(bench.ref_rmse(o[:, :, 1:], s[:, 1:], reference, 2)) > 0.1


def _flashinfer_stand_in(q, k, v, g, beta, scale, initial_state, output_final_state, cu_seqlens, use_cp):
    """FlashInfer's GDN prefill contract (packed ``[total_T, H, D]``, linear decay, activated beta, states
    ``[N, HV, V, K]``) served by cuLA's reference, for checking the adapter's conversions on a CPU."""
    assert q.dim() == 3 and g.dtype == beta.dtype == bench.torch.float32 and output_final_state
    assert use_cp in ("auto", False) and bool((g > 0).all() and (g <= 1).all())  # linear-space decay
    h0 = None if initial_state is None else initial_state.transpose(-1, -2)
    o, s = cula.gdn.chunk_gated_delta_rule(
        q[None], k[None], v[None], g.log()[None], beta[None], scale=scale, initial_state=h0,
        output_final_state=True, cu_seqlens=cu_seqlens,
    )  # fmt: skip
    return o[0], s.transpose(-1, -2)


@pytest.mark.parametrize("lengths", [None, [5, 70, 1]])
def test_flashinfer_adapter_round_trip(lengths):
    """The FlashInfer column's conversions (packing, log to linear gate, the transposed states) give FLA's answer
    back on the same inputs: through a stand-in with FlashInfer's contract, cuLA's reference on the CPU."""
    from benchmarks.peers import FLASHINFER_ROUTES, FlashInferGDN

    B, H, D = (1, 2, 128) if lengths else (2, 2, 128)
    case = bench.Case("gdn", B, sum(lengths) if lengths else 70, H, D, lengths, "t")
    args = bench.make_inputs(case, "cpu", bench.torch.float32, requires_grad=False)
    n = len(lengths) if lengths else B
    args["initial_state"] = bench.torch.randn(n, H, D, D) * 0.1
    args["initial_state"][..., 0, 1] = 1.0  # not symmetric: a missed transpose shows
    expected = cula.gdn.chunk_gated_delta_rule(**args)
    peer = FlashInferGDN(_flashinfer_stand_in)
    assert peer.declines(args) == ""
    converted = peer.convert(args)
    for route in FLASHINFER_ROUTES:
        o, s = peer.back(args, *peer.call(converted, route))
        assert o.shape == expected[0].shape and s.shape == expected[1].shape
        assert bench.rel_rmse(o, expected[0]) < 1e-5 and bench.rel_rmse(s, expected[1]) < 1e-5
    assert "D = 128" in FlashInferGDN.declines({**args, "q": args["q"][..., :64]})
    assert "L2 norm" in peer.declines({**args, "use_qk_l2norm_in_kernel": True})
