"""The benchmark on a CPU machine (the README's main job) and the arguments it hands FLA on a GPU."""

from __future__ import annotations

import inspect
import json
import random
import sys

import pytest

import cula
from benchmarks import devices, shapes
from benchmarks import run as bench
from cula.dispatch import fla_function

OPS = ["gdn", "kda", "gla", "simple_gla"]


def test_cpu_run_writes_a_table_json_and_plot(tmp_path):
    """The README's main job on a CPU: the reference backend checked against FLA's naive recurrence on the smoke
    grid, nothing timed, and the JSON, the markdown table and the plot written."""
    pytest.importorskip("matplotlib")
    assert bench.main(["--out", str(tmp_path)]) == 0
    result = json.loads((tmp_path / "benchmark.json").read_text())
    assert [row["op"] for row in result["rows"]] == [op for op in OPS for _ in range(2)]
    assert [row["shape"] for row in result["rows"][:2]] == ["B=1 T=256 H=2", "varlen smoke N=3 T=256 H=2"]
    for row in result["rows"]:
        assert row["cula_backend"] == "torch" and row["rel_rmse"] < 1e-4, row
        assert row["cula_ms"] is None and row["speedup"] is None and row["quantiles_ms"] == {}  # nothing timed
    table = (tmp_path / "BENCHMARK.md").read_text()
    assert bench.CPU_NOTE in table and "speedup" not in table and table.count("| torch |") == 2 * len(OPS)
    assert (tmp_path / "BENCHMARK.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert result["env"]["plot"] == f"written to {tmp_path / 'BENCHMARK.png'}"


def test_run_without_matplotlib_skips_the_plot_and_says_so(tmp_path, monkeypatch, capsys):
    for name in ("matplotlib", "matplotlib.figure"):  # None there: importing it raises ImportError
        monkeypatch.setitem(sys.modules, name, None)
    json_file = tmp_path / "elsewhere" / "run.json"
    assert bench.main(["--op", "simple_gla", "--shapes", "1x32x1", "--head-dim", "16", "--out", str(tmp_path),
                       "--json", str(json_file)]) == 0  # fmt: skip
    result = json.loads(json_file.read_text())
    assert (
        "matplotlib is not installed" in result["env"]["plot"]
        and "matplotlib is not installed" in capsys.readouterr().err
    )
    assert not list(tmp_path.glob("*.png")) and (tmp_path / "BENCHMARK.md").exists()


def test_help_lists_the_options_and_the_shapes(capsys):
    with pytest.raises(SystemExit) as exit_:
        bench.main(["--help"])
    assert exit_.value.code == 0
    text = capsys.readouterr().out
    for option in ("--op", "--shapes", "--modes", "--dtype", "--head-dim", "--seed", "--json", "--out", "--list",
                   "--no-fla", "--no-peers", "BxTxH", "L1+L2+...xH", "p20"):  # fmt: skip
        assert option in text, option
    for name in shapes.GRIDS:
        assert f"\n  {name} " in text, name


def test_list_prints_ops_and_named_shapes_and_exits(capsys):
    assert bench.main(["--list", "--head-dim", "64"]) == 0
    text = capsys.readouterr().out
    for op in OPS:
        assert f"\n  {op} " in text, op
    assert "fla.ops.gated_delta_rule:chunk_gated_delta_rule" in text and "D = 64" in text
    assert "varlen random N=20 T=32768 H=32: lengths [" in text and "B=2 T=16384 H=64 l2norm in op" in text


def test_custom_shapes_and_several_ops():
    got = shapes.cases(["gdn", "kda"], ["2x16384x64", "core", "5+0+60x3", "4096+4096x8"], 64)
    assert [c.name for c in got[:5]] == [
        "B=2 T=16384 H=64",  # core's own second shape is not run twice
        "B=1 T=8192 H=64",
        "B=8 T=2048 H=32",
        "varlen 5+0+60 N=3 T=65 H=3",
        "varlen 4096+4096 N=2 T=8192 H=8",
    ]
    assert [c.op for c in got] == ["gdn"] * 5 + ["kda"] * 5 and {c.D for c in got} == {64}
    assert got[3].lengths == [5, 0, 60] and got[3].B == 1 and got[0].lengths is None
    for bad in ("2x16384", "4096x8", "0+0x2", "0x64x2", "core,varlen", "1x2x3x4", "huge"):
        with pytest.raises(ValueError):
            shapes.check_shape(bad)


@pytest.mark.parametrize("argv", [["--op", "gdn", "gla"], ["--op", "gdn,gla"]])
def test_several_ops_space_or_comma_separated(tmp_path, argv):
    assert bench.main([*argv, "--shapes", "1x32x1", "3+29x1", "--head-dim", "16", "--out", str(tmp_path)]) == 0
    rows = json.loads((tmp_path / "benchmark.json").read_text())["rows"]
    assert [(r["op"], r["shape"]) for r in rows] == [
        (op, shape) for op in ("gdn", "gla") for shape in ("B=1 T=32 H=1", "varlen 3+29 N=2 T=32 H=1")
    ]


@pytest.mark.parametrize(
    "argv, message",
    [
        (["--op", "gdn", "mamba"], "--op: unknown ['mamba']"),
        (["--shapes", "2x16384"], "--shapes: '2x16384' is neither a grid"),
        (["--modes", "bwd"], "--modes: unknown ['bwd']"),
        (["--op", "kda", "--shapes", "layer"], "the layer grid holds GDN rows only"),
    ],
)
def test_bad_arguments_are_refused_by_name(argv, message, capsys):
    with pytest.raises(SystemExit) as exit_:
        bench.main(argv)
    assert exit_.value.code == 2 and message in capsys.readouterr().err


def test_seeded_inputs_do_not_depend_on_what_ran_before(tmp_path):
    case = bench.Case("kda", 1, 40, 2, 16, [7, 33], "t")
    first = bench.make_inputs(case, "cpu", bench.torch.float32, requires_grad=False)
    bench.torch.randn(1000), random.random()  # other draws in between
    again = bench.make_inputs(case, "cpu", bench.torch.float32, requires_grad=False)
    other = bench.make_inputs(case, "cpu", bench.torch.float32, requires_grad=False, seed=1)
    for name, x in first.items():
        if isinstance(x, bench.torch.Tensor):
            assert bench.torch.equal(x, again[name]), name
    assert not bench.torch.equal(first["q"], other["q"])
    # a row's result is the same whichever rows ran before it in the run
    small = ["--op", "gdn", "--head-dim", "16"]
    assert bench.main([*small, "--shapes", "2x24x2", "9+3x2", "--out", str(tmp_path / "a")]) == 0
    assert bench.main([*small, "--shapes", "9+3x2", "--out", str(tmp_path / "b")]) == 0
    rows = [json.loads((tmp_path / run / "benchmark.json").read_text())["rows"][-1] for run in "ab"]
    assert rows[0]["shape"] == rows[1]["shape"] and rows[0]["errors"] == rows[1]["errors"]


def test_peak_rates_come_from_the_device_table():
    h200, h100 = devices.peaks_for("NVIDIA H200"), devices.peaks_for("NVIDIA H100 80GB HBM3")
    assert (h200.tflops, h200.gbps, h200.measured) == (687.0, 4300.0, True)
    assert (h100.name, h100.tflops, h100.gbps, h100.measured) == ("H100 SXM", 798.0, 3000.0, True)
    other = devices.peaks_for("NVIDIA B200")
    assert other is devices.DEFAULT and not other.measured and "default, not measured" in other.describe()
    for near in ("NVIDIA H100 PCIe", "NVIDIA H100 NVL", "NVIDIA GH200 480GB", "NVIDIA H200 NVL"):  # other parts
        assert devices.peaks_for(near) is devices.DEFAULT, near


def test_gpu_table_gives_the_quantiles_and_the_peaks_it_used():
    row = bench.Row("gdn", "B=2 T=16384 H=64", "fwd", "cute", cula_ms=0.9, fla_ms=3.4, speedup=3.4 / 0.9)
    row.quantiles_ms = {"cula": [0.89, 0.9, 0.93], "fla": [3.3, 3.4, 3.5]}
    h100 = devices.peaks_for("NVIDIA H100 80GB HBM3")
    table = bench.markdown({"gpu": "NVIDIA H100 80GB HBM3"}, [row], {}, h100)
    assert table.startswith("# cuLA vs FLA on the H100 SXM") and "FLOPs / 798 TFLOP/s, bytes / 3000 GB/s" in table
    assert "| 0.900 [0.890, 0.930] | 3.400 [3.300, 3.500] | 3.78 |" in table
    unknown = bench.markdown({"gpu": "NVIDIA B200"}, [row], {}, devices.peaks_for("NVIDIA B200"))
    assert unknown.startswith("# cuLA vs FLA (floor at default peak rates, not measured here)\n")
    assert "| speedup |" in unknown and "default, not measured on this GPU" in unknown


def test_gpu_run_wiring(tmp_path, monkeypatch):
    """The GPU branch of the run, its timing stubbed (no GPU here): the options reach each row's call, the device
    table gives the peaks, and the JSON, the table with its speedup column and the plot are written."""
    pytest.importorskip("matplotlib")
    calls = []

    def fake_row(case, mode, peaks, dtype, seed, with_fla, peer):
        calls.append((case.op, case.name, case.D, mode, peaks.name, dtype, seed, with_fla, peer))
        row = bench.Row(case.op, case.name, mode, "cute", cula_ms=1.0, fla_ms=2.0, speedup=2.0, floor_fraction=0.5)
        row.quantiles_ms = {"cula": [0.9, 1.0, 1.1], "fla": [1.8, 2.0, 2.2]}
        return row

    monkeypatch.setattr(bench.torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(bench.torch.cuda, "get_device_name", lambda device=None: "NVIDIA H100 80GB HBM3")
    monkeypatch.setattr(bench, "environment", lambda: {"gpu": "NVIDIA H100 80GB HBM3 (stub)"})
    monkeypatch.setattr(bench, "run_gpu_case", fake_row)
    monkeypatch.setattr(bench, "host_overhead_us", lambda op, dtype, D, seed: {"cula": 10.0, "fla": 20.0})
    monkeypatch.setattr(bench.FlashInferGDN, "load", classmethod(lambda cls: None))
    argv = ["--op", "gdn", "kda", "--shapes", "layer", "2x64x4", "--modes", "fwd", "fwdbwd", "--dtype", "fp16",
            "--head-dim", "64", "--seed", "7", "--out", str(tmp_path)]  # fmt: skip
    assert bench.main(argv) == 0
    f16 = bench.torch.float16
    assert calls == [
        ("gdn", "B=2 T=16384 H=64 l2norm in op", 64, "fwd", "H100 SXM", f16, 7, True, None),
        ("gdn", "B=2 T=16384 H=64 l2norm in op", 64, "fwdbwd", "H100 SXM", f16, 7, True, None),
        ("gdn", "B=1 T=8192 H=64 l2norm in op", 64, "fwd", "H100 SXM", f16, 7, True, None),
        ("gdn", "B=1 T=8192 H=64 l2norm in op", 64, "fwdbwd", "H100 SXM", f16, 7, True, None),
        ("gdn", "B=2 T=64 H=4", 64, "fwd", "H100 SXM", f16, 7, True, None),
        ("gdn", "B=2 T=64 H=4", 64, "fwdbwd", "H100 SXM", f16, 7, True, None),
        ("kda", "B=2 T=64 H=4", 64, "fwd", "H100 SXM", f16, 7, True, None),
        ("kda", "B=2 T=64 H=4", 64, "fwdbwd", "H100 SXM", f16, 7, True, None),
    ]
    result = json.loads((tmp_path / "benchmark.json").read_text())
    assert result["env"]["peak rates"].startswith("798 TFLOP/s") and result["env"]["dtype"] == "fp16"
    assert result["host_us"] == {"gdn": {"cula": 10.0, "fla": 20.0}, "kda": {"cula": 10.0, "fla": 20.0}}
    assert result["rows"][0]["quantiles_ms"]["cula"] == [0.9, 1.0, 1.1]
    table = (tmp_path / "BENCHMARK.md").read_text()
    assert (
        table.startswith("# cuLA vs FLA on the H100 SXM")
        and "| 1.000 [0.900, 1.100] | 2.000 [1.800, 2.200] | 2.00 |" in table
    )
    assert (tmp_path / "BENCHMARK.png").stat().st_size > 0


@pytest.mark.parametrize("op", OPS)
@pytest.mark.parametrize("lengths", [None, [3, 100, 1]])
def test_gpu_grid_arguments_fit_fla_and_cula(op, lengths):
    case = bench.Case(op, 1, sum(lengths) if lengths else 64, 2, 32, lengths, "t")
    args = bench.make_inputs(case, "cpu", bench.torch.bfloat16, requires_grad=False)
    cula_fn, target = bench.entry_points(op)
    inspect.signature(fla_function(target)).bind(**args)
    assert cula.explain(cula_fn, **args).backend == "torch"  # binds and validates as a real call would


def test_layer_grid_has_the_op_normalise_raw_q_and_k():
    cases = shapes.cases(["gdn", "kda"], ["layer"], 128)
    assert [c.name for c in cases] == ["B=2 T=16384 H=64 l2norm in op", "B=1 T=8192 H=64 l2norm in op"]
    small = bench.Case("gdn", 1, 64, 2, 32, layer=True)
    args = bench.make_inputs(small, "cpu", bench.torch.bfloat16, requires_grad=False)
    assert args["use_qk_l2norm_in_kernel"] and args["k"].norm(dim=-1).max() > 2  # raw, not unit rows
    inspect.signature(fla_function(bench.entry_points("gdn")[1])).bind(**args)
    assert cula.explain(bench.entry_points("gdn")[0], **args).backend == "torch"


@pytest.mark.parametrize("op, layer", [*((op, False) for op in OPS), ("gdn", True)])
def test_cpu_check_runs_a_varlen_call_one_sequence_at_a_time(op, layer):
    """The CPU row's error against FLA's naive recurrence is small for cuLA's reference backend on a varlen call
    (GDN's layer form with its in-op L2 norm included), on inputs where the packed tokens run as one sequence
    would differ."""
    # H=8: simple_gla's fixed decays are slow enough on some heads for the first sequence to reach the second
    case = bench.Case(op, 1, 48, 8, 16, [24, 24], "t", layer=layer)
    assert bench.run_cpu_case(case).rel_rmse < 1e-4
    args = bench.make_inputs(case, "cpu", bench.torch.float32, requires_grad=False)
    o, _ = bench.entry_points(op)[0](**args)
    packed, _ = bench.naive_fn(op)(args)  # both sequences as one
    assert bench.rel_rmse(o, packed) > 0.01


def test_grid_and_floor():
    cases = shapes.cases(["gdn"], ["core", "varlen", "long"], 128)
    names = [c.name for c in cases]
    assert names[:3] == ["B=1 T=8192 H=64", "B=2 T=16384 H=64", "B=8 T=2048 H=32"] and names[-1] == "B=1 T=65536 H=8"
    varlen = [c for c in cases if c.lengths is not None]
    assert len(varlen) == 6 and {len(c.lengths) for c in varlen} == {10, 20}
    assert all(sum(c.lengths) == c.T and min(c.lengths) >= 1 for c in varlen)
    # the varlen grid's lengths are the grid's own: the same for every op, whatever else runs
    assert [c.lengths for c in shapes.cases(["kda", "gdn"], ["varlen"], 64)[6:]] == [c.lengths for c in varlen]
    flops, bytes_ = bench.floor(cases[1])
    # B2 T16384 H64 GDN is about 0.5 ms by either term on the H200
    assert 0.45 < flops / 687e12 * 1e3 < 0.6 and 0.45 < bytes_ / 4.3e12 * 1e3 < 0.6
    assert bench.floor(cases[1], itemsize=4)[1] > 1.9 * bytes_ / 2  # fp32 inputs: about twice the bytes


# The committed side-by-side runs, each with the GPU it ran on (its name in cula/devices.py), its ops and its grids.
MEASURED_RUNS = [
    ("h200_fwd.json", "NVIDIA H200", "gdn", ["core", "varlen", "long", "layer"]),
    ("h200_fwd.json", "NVIDIA H200", "kda", ["core", "varlen", "long"]),
    ("h100_gdn_fwd_flashinfer.json", "NVIDIA H100 80GB HBM3", "gdn", ["core", "varlen", "long"]),
    ("h100_fwd.json", "NVIDIA H100 80GB HBM3", "kda", ["core", "varlen", "long"]),
    ("h100_fwd.json", "NVIDIA H100 80GB HBM3", "gdn", ["layer"]),
]


@pytest.mark.parametrize(("results", "device", "op", "grids"), MEASURED_RUNS)
def test_dispatch_model_matches_the_measurements(results, device, op, grids, monkeypatch):
    """A GPU's dispatch time model (its row of cula/devices.py, used to prefer FLA where the kernel is slower)
    against the committed side-by-side run on that GPU: the kernel's within 30 % of every measured kernel time, split
    rows included, FLA's within 20 % of every FLA time, and picking the faster side."""
    from pathlib import Path
    from types import SimpleNamespace

    from cula import devices
    from cula.dispatch import expected_ms

    measured = json.loads((Path(bench.__file__).parent / "results" / results).read_text())
    assert measured["env"]["gpu"] == f"{device} (sm_90, 132 SMs)"
    props = SimpleNamespace(name=device, multi_processor_count=132)
    monkeypatch.setattr(bench.torch.cuda, "get_device_properties", lambda d=None: props)
    times = devices.times_for(0)
    assert times is not devices.DEFAULT and times.label == devices.TABLE[device].label
    cases = {c.name: c for c in shapes.cases([op], grids, 128)}
    rows = [r for r in measured["rows"] if r["op"] == op and r["mode"] == "fwd" and r["shape"] in cases]
    assert sorted(r["shape"] for r in rows) == sorted(cases)  # other grids' rows (other ops) may be there
    # the benchmark passes varlen offsets on the device only, read once per cu_seqlens tensor by both sides
    assert "varlen offsets" in measured["env"]
    for row in rows:
        case = cases[row["shape"]]
        # the kernel's own time: the row's when dispatch picked it, else the forced-kernel timing
        kernel_ms = row["cula_ms"] if row["cula_backend"] == "cute" else row["kernel_ms"]
        assert kernel_ms is not None, row
        kernel = times.kernels["gdn_l2norm" if case.layer else op]
        lengths = case.lengths or [case.T] * case.B
        ours, fla = expected_ms(lengths, case.H, 132, kernel, times.fla[op])
        assert abs(ours / kernel_ms - 1) < 0.3, (row["shape"], ours, kernel_ms)
        assert abs(fla / row["fla_ms"] - 1) < 0.2, (row["shape"], fla, row["fla_ms"])
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


def _flashinfer_decode_stand_in(q, k, v, state, A_log, a, dt_bias, b, use_qk_l2norm, initial_state,
                                initial_state_indices):  # fmt: skip
    """FlashInfer's GDN decode contract written out in fp64 (its documentation: g = -exp(A_log) softplus(a +
    dt_bias), beta = sigmoid(b), q and k L2-normalised, scale K^-0.5, the pool [slots, HV, V, K] updated in place
    at the indexed slots); returns (o [N, 1, HV, V], the pool)."""
    F = bench.torch.nn.functional
    assert state is None and use_qk_l2norm and q.shape[1] == 1
    K = q.shape[-1]
    qn, kn = F.normalize(q[:, 0].double(), dim=-1), F.normalize(k[:, 0].double(), dim=-1)
    g = -A_log.double().exp() * F.softplus(a[:, 0].double() + dt_bias.double())  # [N, HV]
    beta = b[:, 0].double().sigmoid()
    S = initial_state[initial_state_indices.long()].double() * g.exp()[..., None, None]  # [N, HV, V, K]
    u = beta[..., None] * (v[:, 0].double() - (S @ kn[..., None])[..., 0])
    S = S + u[..., None] * kn[..., None, :]
    o = (S @ (qn * K**-0.5)[..., None])[..., 0]
    initial_state[initial_state_indices.long()] = S.to(initial_state.dtype)
    return o[:, None].to(q.dtype), initial_state


def test_flashinfer_decode_adapter_is_culas_gated_call():
    """The decode column's two calls compute the same step: FlashInfer's contract (a stand-in in fp64) and the
    keyword arguments the adapter gives cuLA's fused_recurrent_gated_delta_rule (its reference on the CPU), from the
    same pool, in outputs and in the pool's slots; untouched slots stay as they were."""
    from benchmarks.peers import FlashInferGDNDecode

    torch = bench.torch
    gen = torch.Generator().manual_seed(0)
    N, H, D, slots_total = 3, 2, 128, 5
    gate = {n: torch.randn(N, 1, H, D, generator=gen).bfloat16() for n in ("q", "k", "v")}
    gate.update(a=torch.randn(N, 1, H, generator=gen).bfloat16(), b=torch.randn(N, 1, H, generator=gen).bfloat16())
    gate.update(A_log=torch.rand(H, generator=gen), dt_bias=torch.randn(H, generator=gen))
    pool = torch.randn(slots_total, H, D, D, generator=gen) * 0.1
    pool[..., 0, 1] = 1.0  # not symmetric: a layout mix-up shows
    slots = torch.tensor([4, 0, 2], dtype=torch.int32)
    peer = FlashInferGDNDecode(_flashinfer_decode_stand_in)
    assert peer.declines(gate["q"], pool) == ""
    pool_fi, pool_cula = pool.clone(), pool.clone()
    o_fi = peer.call(gate, pool_fi, slots)
    o_cula, returned = cula.gdn.fused_recurrent_gated_delta_rule(**peer.cula_arguments(gate, pool_cula, slots))
    assert returned is pool_cula
    assert bench.rel_rmse(o_cula.float(), o_fi.float()) < 1e-3
    assert bench.rel_rmse(pool_cula[slots.long()], pool_fi[slots.long()]) < 1e-4
    assert torch.equal(pool_cula[[1, 3]], pool[[1, 3]]) and not torch.equal(pool_cula[4], pool[4])
    assert "K = V = 128" in peer.declines(gate["q"][..., :64], pool.bfloat16()[..., :64, :64])


def test_decode_table_names_each_rows_peer():
    """The decode table's peer columns read FLA's times on FLA's rows and FlashInfer's on FlashInfer's."""
    from benchmarks import decode

    base = {"variant": "gdn", "N": 256, "H": 32, "D": 128, "cula_eager_ms": 0.5, "cula_graph_ms": 0.4}
    rows = [
        {**base, "call": "plain", "fla_eager_ms": 0.6, "fla_graph_ms": 0.44, "cula_state_TBps": 2.7},
        {
            **base,
            "call": "flashinfer fp32",
            "flashinfer_eager_ms": 0.5,
            "flashinfer_graph_ms": 0.6,
            "o_rel_rmse_vs_flashinfer": 1e-5,
            "cula_state_TBps": 2.7,
        },  # fmt: skip
        {**base, "call": "flashinfer bf16", "cula_state_TBps": 2.0, "note": "FlashInfer's decode not importable"},
    ]
    lines = decode.markdown({"gpu": "H100"}, rows).splitlines()[-3:]
    assert "| 0.440 | 1.10 |" in lines[0] and "| 0.600 | 1.50 | 2.70 | 0.00001 |" in lines[1]
    assert lines[2].endswith("| - | - | - | 2.00 | - | FlashInfer's decode not importable |")


def test_error_axis_is_log_across_decades_and_linear_from_zero_otherwise():
    from benchmarks.plot import log_axis_range

    assert log_axis_range([1e-5, 3e-3]) is None and log_axis_range([]) is None
    assert log_axis_range([3.63e-3, 3.65e-3]) == (0.0, 1.15 * 3.65e-3)
