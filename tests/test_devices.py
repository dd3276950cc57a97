"""Dispatch's time model per GPU (cula/devices.py) on a pretend device: the lookup by name, the default for other
GPUs, the H200's decisions as they were before the table, and where another row changes them."""

import dataclasses
from types import SimpleNamespace

import pytest
import torch

import cula
from cula import devices, dispatch, runtime
from cula.devices import FlaTime, KernelTime
from cula.ops import segment_split
from cula.ops.segment_split import SplitCost

cutlass = pytest.importorskip("cutlass")  # the SM90 kernels' modules, where dispatch picks their time model

H200, H100 = "NVIDIA H200", "NVIDIA H100 80GB HBM3"
SMS = 132

# The H200 fit as dispatch used it before the table (FLA per op; each kernel's chunk time and split costs)
OLD_FLA = {"gdn": (1.65, 0.38, 1.75), "kda": (3.2, 0.38, 2.9)}
_LONE = 3.25 / 3.7
OLD_GDN_SPLIT = SplitCost.from_us(3.7, 2.3, 1.4, 0.5, cached=True, first=3.47, fixed=25, wave=7, lone=_LONE)
OLD_KERNELS = {
    "gdn": (3.7, OLD_GDN_SPLIT),
    "gdn_l2norm": (
        3.9,
        SplitCost.from_us(3.9, 2.5, 1.6, 0.5, cached=True, fixed=25, wave=7, lone=_LONE)._replace(
            first=OLD_GDN_SPLIT.first
        ),
    ),
    "kda": (8.2, SplitCost.from_us(8.2, 4.0, 2.55, 0.5, cached=True, first=9.05)),
}


def old_verdict(op: str, kernel: str, lengths: list[int], HV: int) -> bool:
    """Whether the kernel was expected to beat FLA under the fit above."""
    ns, min_ms, chunk_us = OLD_FLA[op]
    fla = max(ns * sum(lengths) * HV / 1e6, min_ms, chunk_us * -(-max(lengths) // 64) / 1e3)
    latency, split = OLD_KERNELS[kernel]
    return segment_split.chunk_walk_ms(lengths, HV, SMS, latency, True, split) <= fla


@pytest.fixture
def gpu(monkeypatch):
    """``gpu(name)`` pretends the calls' tensors sit on an SM90 GPU of that name with 132 SMs, FLA importable."""

    def pretend(name: str) -> None:
        props = SimpleNamespace(name=name, multi_processor_count=SMS)
        monkeypatch.setattr(torch.cuda, "get_device_properties", lambda device=None: props)
        runtime.forget_devices()  # the name an earlier pretence left read

    monkeypatch.setattr(torch.Tensor, "is_cuda", property(lambda self: True))
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (9, 0))
    monkeypatch.setattr(dispatch, "fla_function", lambda target: None)
    return pretend


def sized(*shape, dtype=torch.bfloat16) -> torch.Tensor:
    """A tensor of this shape without its memory (one element, broadcast): the time model reads shapes only."""
    return torch.zeros((1,) * len(shape), dtype=dtype).expand(*shape)


def call_args(op: str, lengths: list[int], HV: int, D: int = 128, **options) -> dict:
    """A varlen call's arguments (B = 1, four query heads) of these sequence lengths, offsets on the host too."""
    T, H = sum(lengths), 4
    cu = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()])
    g = sized(1, T, HV, D, dtype=torch.float32) if op == "kda" else sized(1, T, HV, dtype=torch.float32)
    args = {"q": sized(1, T, H, D), "k": sized(1, T, H, D), "v": sized(1, T, HV, D), "g": g}
    args.update(beta=sized(1, T, HV, dtype=torch.float32), cu_seqlens=cu, cu_seqlens_cpu=cu)
    return {"use_qk_l2norm_in_kernel": False, **args, **options}


def faster_than_fla(op: str, args: dict) -> tuple[bool, str]:
    """The registered SM90 kernel's own verdict on ``args`` (what dispatch asks before serving a call with it)."""
    fn = {"gdn": cula.gdn.chunk_gated_delta_rule, "kda": cula.kda.chunk_kda}[op]
    (kernel,) = [k for k in fn.cula_op.kernels if k.arch_major == 9]
    return kernel.faster_than_fla(args)


def test_rows_are_found_by_exact_device_name(gpu):
    gpu(H200)
    times = devices.times_for(0)
    assert times.label == "H200" and times.fla == devices.H200.fla
    # GLA, not measured on the H200, from the default
    assert times.kernels == {**devices.H200.kernels, "gla": devices.DEFAULT.kernels["gla"]}
    gpu(H100)
    times = devices.times_for(0)
    assert times.label == "H100 SXM"
    assert times.fla["gdn"] == FlaTime(ns_per_token_head=2.05, min_ms=0.38, chunk_us=1.86)
    assert times.kernels["gdn"] == KernelTime(3.57, devices.H200_GDN_SPLIT)
    assert times.fla["kda"] == FlaTime(ns_per_token_head=4.05, min_ms=0.38, chunk_us=3.18)
    assert times.kernels["kda"] == KernelTime(7.9, devices.H200_KDA_SPLIT)
    assert devices.times_for(0) is times  # completed once per row
    # a row completed by the default where its GPU was not measured: a pretend H100 row without KDA's kernel
    row = dataclasses.replace(devices.H100_SXM, kernels={"gdn": devices.H100_SXM.kernels["gdn"]})
    with pytest.MonkeyPatch.context() as patch:
        patch.setitem(devices.TABLE, H100, row)
        assert devices.times_for(0).kernels["kda"] == devices.DEFAULT.kernels["kda"]
    assert devices.times_for(0).kernels["kda"] == devices.H100_SXM.kernels["kda"]  # the row put back is read again


@pytest.mark.parametrize("name", ["NVIDIA H20", "NVIDIA H100 PCIe", "NVIDIA H200 NVL", "NVIDIA GH200 480GB"])
def test_unknown_gpus_get_the_default(gpu, name):
    gpu(name)
    assert devices.times_for(0) is devices.DEFAULT


def test_default_is_fla_at_its_fastest_and_the_kernel_at_its_slowest():
    """On every shape the default expects FLA no slower and each kernel no faster than any measured GPU does."""
    shapes = [([16384] * 2, 64), ([65536], 8), ([16] * 1000, 32), ([1] * 5000, 4), ([8192, 512, 4096], 32)]
    for row in devices.TABLE.values():
        for op, fla in row.fla.items():
            assert all(devices.DEFAULT.fla[op].ms(L, HV) <= fla.ms(L, HV) for L, HV in shapes), (row.label, op)
        for name, kernel in row.kernels.items():
            default = devices.DEFAULT.kernels[name]
            assert all(default.ms(L, HV, SMS) >= kernel.ms(L, HV, SMS) for L, HV in shapes), (row.label, name)
    # built field by field from the rows, whichever row is fastest or slowest in each
    split = devices.H200_GDN_SPLIT
    table = {
        "a": devices.DeviceTimes("a", {"gdn": FlaTime(2.0, 0.3, 1.9)}, {"gdn": KernelTime(3.0, split)}),
        "b": devices.DeviceTimes("b", {"gdn": FlaTime(1.5, 0.5, 2.5), "kda": FlaTime(3.0, 0.4, 3.0)}),
        "c": devices.DeviceTimes("c", kernels={name: KernelTime(4.0, split) for name in devices.KERNELS}),
    }
    default = devices.default_times(table)
    assert default.fla == {"gdn": FlaTime(1.5, 0.3, 1.9), "kda": FlaTime(3.0, 0.4, 3.0)}
    assert default.kernels == {name: KernelTime(4.0, split) for name in devices.KERNELS}


def test_h200_row_is_the_earlier_fit():
    for op, (ns, min_ms, chunk_us) in OLD_FLA.items():
        assert devices.H200.fla[op] == FlaTime(ns, min_ms, chunk_us)
    for name, (latency, split) in OLD_KERNELS.items():
        assert devices.H200.kernels[name] == KernelTime(latency, split), name


# (op, time model, lengths, value heads, call options): both verdicts, split and unsplit plans, every GDN model
VERDICT_CASES = [
    ("gdn", "gdn", [16384] * 2, 64, {}),
    ("gdn", "gdn", [65536], 8, {}),
    ("gdn", "gdn", [8192] + [512] * 16, 32, {}),
    ("gdn", "gdn", [64] * 200, 32, {}),
    ("gdn", "gdn", [16] * 1000, 32, {}),
    ("gdn", "gdn", [1] * 5000, 4, {}),
    ("gdn", "gdn_l2norm", [8192], 64, {"use_qk_l2norm_in_kernel": True}),
    ("gdn", "gdn_l2norm", [8192], 32, {"use_qk_l2norm_in_kernel": True}),
    ("gdn", "gdn_l2norm", [8192], 32, {"use_qk_l2norm_in_kernel": True, "D": 64}),
    ("kda", "kda", [65536], 8, {}),
    ("kda", "kda", [2048] * 8, 32, {}),
    ("kda", "kda", [16] * 1000, 32, {}),
    ("kda", "kda", [1] * 3000, 4, {}),
]


def test_h200_verdicts_are_unchanged(gpu):
    """On the H200 every verdict is the one the earlier fit gave (both kinds among them)."""
    gpu(H200)
    seen = set()
    for op, kernel, lengths, HV, options in VERDICT_CASES:
        expected = old_verdict(op, kernel, lengths, HV)
        ok, why = faster_than_fla(op, call_args(op, lengths, HV, **options))
        assert ok == expected, (op, kernel, len(lengths), lengths[0], HV, why)
        assert ok or "H200 time model" in why
        seen.add(ok)
    assert seen == {True, False}


def test_the_h100_row_changes_what_it_measured(gpu):
    """FLA's GDN runs 1.25x slower per token-head on the H100 and its KDA 1.27x, the kernels about as fast: a batch
    of a thousand 16-token sequences goes to FLA on the H200 and to the kernel on the H100, for both; three thousand
    one-token sequences stay with FLA on both (its minimum per call), and an unknown GPU keeps the H200's verdicts."""
    gdn = call_args("gdn", [16] * 1000, 32)
    kda = call_args("kda", [16] * 1000, 32)
    tiny = call_args("kda", [1] * 3000, 4)
    gpu(H200)
    assert not faster_than_fla("gdn", gdn)[0] and not faster_than_fla("kda", kda)[0]
    assert not faster_than_fla("kda", tiny)[0]
    gpu(H100)
    assert faster_than_fla("gdn", gdn) == (True, "") and faster_than_fla("kda", kda) == (True, "")
    ok, why = faster_than_fla("kda", tiny)
    assert not ok and "H100 SXM time model" in why
    gpu("NVIDIA H20")
    ok, why = faster_than_fla("gdn", gdn)
    assert not ok and "default time model" in why


def test_the_split_planner_reads_the_devices_split_costs(gpu, monkeypatch):
    """The planner cuts with the call's GPU's split costs, as the time model does: a row whose split passes cost
    ten thousand chunks more per call leaves one long sequence whole."""
    from cula.gdn.chunk_fwd_sm90 import GDN_SM90
    from cula.kda.chunk_fwd_sm90 import KDA_SM90
    from cula.sm90.entry import ChunkCall, plan_call

    def cuts(kernel, op):
        args = call_args(op, [65536], 8)
        return plan_call(kernel, ChunkCall(*(args[n] for n in ("q", "k", "v", "g", "beta")))).cuts

    gpu(H100)
    assert cuts(GDN_SM90, "gdn") and cuts(KDA_SM90, "kda")
    row = devices.TABLE[H100]
    costly = dataclasses.replace(row.kernels["gdn"], split=row.kernels["gdn"].split._replace(fixed=1e4))
    monkeypatch.setitem(devices.TABLE, H100, dataclasses.replace(row, kernels={**row.kernels, "gdn": costly}))
    assert cuts(GDN_SM90, "gdn") is None and cuts(KDA_SM90, "kda")


def test_explain_names_the_time_model(gpu):
    """Through the public entry point (real tensors: five thousand one-token sequences, four heads)."""
    gpu(H200)
    lengths = [1] * 5000
    args = {n: t.contiguous() if isinstance(t, torch.Tensor) else t for n, t in call_args("gdn", lengths, 4).items()}
    decision = cula.explain(cula.gdn.chunk_gated_delta_rule, **args)
    assert decision.backend == "fla", decision
    assert "FLA expected faster" in dict(decision.rejected)["cute"] and "H200 time model" in str(decision)


def test_gla_splits_one_long_sequence_and_leaves_full_waves_whole(gpu):
    """GLA's split costs (H100 row; the default on the H200): one 65536-token sequence over 8 heads is cut, two
    16384-token sequences over 64 heads (128 CTAs, one wave) are walked whole."""
    from cula.gla.chunk_fwd_sm90 import GLA_SM90
    from cula.sm90.entry import ChunkCall, plan_call

    def cuts(lengths, HV):
        args = call_args("kda", lengths, HV)  # per-key gates, as GLA's
        tensors = (args[n] for n in ("q", "k", "v", "g", "beta"))
        call = ChunkCall(*tensors, cu_seqlens=args["cu_seqlens"], cu_seqlens_cpu=args["cu_seqlens_cpu"])
        return plan_call(GLA_SM90, call).cuts

    for name in (H100, H200):
        gpu(name)
        (long,) = cuts([65536], 8)
        assert len(long) >= 8 and all(c % 64 == 0 for c in long), long
        assert cuts([16384] * 2, 64) is None
