"""The host path of the SM90 chunk forwards (cula.sm90.entry: outputs, varlen ranges, sequence splitting, the launch
contract) on the CPU, with each launch served by the fp32 reference working to that contract; checked against the
fp64 recurrence through the same harness as the GPU tests. Also the family kernels' structure, from their PTX."""

import re

import pytest
import torch
import torch.nn.functional as F
from delta_rule_recurrence import check_fwd

from cula import compile_check
from cula.ops.delta_rule_ref import linear_attn_ref
from cula.ops.segment_split import UNCACHED, SplitCost
from cula.sm90 import entry


def reference_launch(kernel, call, config, t, scale):
    """What a launch does: each sequence (a batch row, or a token range of row 0) from h0 (zero; identity for
    "transition"), v = 0 unless "full"; o written ("full"), added to ("correction") or left; final states to ht
    (stored V-first when the call asks); with ``state_slots`` the states' rows are the pool's slots."""
    B, T, HV, V = t.v.shape
    K = t.q.shape[-1]
    rows = [(b, 0, T) for b in range(B)]
    if t.starts is not None:
        rows = [(0, int(s), int(e)) for s, e in zip(t.starts, t.ends, strict=True)]
    svf = call.state_v_first
    h0_rows = ht_rows = list(range(len(rows)))
    if config.state_slots != "none":  # a state pool's rows
        h0_rows = [int(x) for x in t.slots]
        ht_rows = h0_rows if config.state_slots == "read_write" else ht_rows
    for n, (b, s, e) in enumerate(rows):
        Vd = V if config.mode != "transition" else K
        vv = t.v[b : b + 1, s:e] if config.mode == "full" else torch.zeros(1, e - s, HV, Vd, dtype=t.v.dtype)
        if config.mode == "transition":
            start = torch.eye(K).expand(1, HV, K, K)
        elif t.h0 is not None:
            start = (t.h0[h0_rows[n]].transpose(-1, -2) if svf else t.h0[h0_rows[n]])[None]
        else:
            start = None
        o_n, ht_n = linear_attn_ref(
            t.q[b : b + 1, s:e], t.k[b : b + 1, s:e], vv, g=t.g[b : b + 1, s:e],
            beta=t.beta[b : b + 1, s:e] if config.delta_rule else None, scale=scale, initial_state=start,
            output_final_state=True,
        )  # fmt: skip
        if config.mode == "full":
            t.o[b, s:e] = o_n[0].to(t.o.dtype)
        elif config.mode == "correction":
            t.o[b, s:e] = (t.o[b, s:e].float() + o_n[0]).to(t.o.dtype)
        t.ht[ht_rows[n]] = ht_n[0].transpose(-1, -2) if svf else ht_n[0]


def kernel_with(split_cost=UNCACHED, workspaces=None):
    return entry.ChunkKernel("test", None, split_cost=lambda call: split_cost, workspaces=workspaces)


def entry_for(kernel):
    """An SM90-entry-shaped forward (as ``check_fwd`` calls it) around :func:`cula.sm90.entry.chunk_fwd`."""

    def fwd(q, k, v, g, beta, scale, initial_state, output_final_state, cu_seqlens, state_v_first, **kw):
        call = entry.ChunkCall(
            q, k, v, g, beta, scale, initial_state, output_final_state, cu_seqlens, state_v_first, kw.get("out"),
            kw.get("final_state_out"), kw.get("cu_seqlens_cpu"), kw.get("split"),
        )  # fmt: skip
        return entry.chunk_fwd(kernel, call)

    return fwd


def pretend_h200(monkeypatch):
    """The device's properties read as an H200's (132 SMs), for the planner's wave counts."""
    props = type("P", (), {"multi_processor_count": 132, "name": "NVIDIA H200"})
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda d=None: props)


@pytest.fixture
def launches(monkeypatch):
    """Every launch served by :func:`reference_launch`, its (mode, intra, tensors) recorded."""
    seen = []

    def launch(kernel, call, config, t, scale):
        seen.append((config, t))
        reference_launch(kernel, call, config, t, scale)

    monkeypatch.setattr(entry, "launch", launch)
    pretend_h200(monkeypatch)
    return seen


def accept(*args, **kwargs):
    return True, ""


def inputs(B, T, H, HV, per_key, D=32):
    q = F.normalize(torch.randn(B, T, H, D), dim=-1).bfloat16()
    k = F.normalize(torch.randn(B, T, H, D), dim=-1).bfloat16()
    v = torch.randn(B, T, HV, D).bfloat16()
    g = F.logsigmoid(torch.randn(B, T, HV, *((D,) if per_key else ())) + 3.0) * 0.5
    beta = torch.rand(B, T, HV).sigmoid()
    return q, k, v, g.float(), beta


@pytest.mark.parametrize("per_key", [False, True])
def test_one_launch(per_key, launches):
    fwd = entry_for(kernel_with())
    check_fwd(fwd, accept, inputs(2, 100, 1, 2, per_key), h0=True, split=False)
    cu = [0, 0, 1, 80, 80, 150, 150]  # zero-length sequences too: their final state is their initial state (zero)
    check_fwd(fwd, accept, inputs(1, 150, 2, 2, per_key), cu, state_v_first=True, split=False)
    assert [c.mode for c, _ in launches] == ["full", "full"]
    assert [(c.is_varlen, c.has_initial_state) for c, _ in launches] == [(False, True), (True, False)]


@pytest.mark.parametrize("per_key", [False, True])
@pytest.mark.parametrize("state_v_first", [False, True])
def test_split_passes(per_key, state_v_first, launches):
    """Forced cuts every 1024 tokens: full, transition and correction passes with the chained starts."""
    fwd = entry_for(kernel_with())
    check_fwd(fwd, accept, inputs(2, 2100, 1, 2, per_key), h0=True, state_v_first=state_v_first, split=True)
    cu = [0, 0, 1, 1500, 1500, 1501, 2300, 2300]  # zero-length sequences too
    check_fwd(fwd, accept, inputs(1, 2300, 1, 2, per_key), cu, h0=True, state_v_first=state_v_first, split=True)
    assert {c.mode for c, _ in launches} == {"full", "transition", "correction"}


@pytest.mark.parametrize("per_key", [False, True])
@pytest.mark.parametrize("state_v_first", [False, True])
def test_a_gated_split_without_the_delta_rule_takes_its_transitions_from_the_gate(per_key, state_v_first, launches):
    """A kernel without the delta rule (simple GLA's gate per token, GLA's per key) launches no "transition" pass: the
    host makes each middle range's diag(e^(its gates' sum)) (a -inf gate taken at the floor, as the kernels take it),
    and the split call gives what one walk of each sequence gives."""
    from delta_rule_recurrence import rel_rmse

    kernel = entry.ChunkKernel("test", None, delta_rule=False, gate_transition=True)
    torch.manual_seed(3)
    cu = [0, 0, 1, 3100, 3100, 3101, 6200]  # forced cuts every 1024 tokens: the long sequences have middle ranges
    q, k, v, g, _ = inputs(1, 6200, 2, 2, per_key)
    g = g * 1e-3  # slow decay: a middle range's transition reaches its successors
    g[0, 1500] = float("-inf")  # a reset inside the first long sequence's middle range
    h0 = torch.randn(len(cu) - 1, 2, 32, 32) * 0.1
    cu_t = torch.tensor(cu, dtype=torch.int32)
    fwd = entry_for(kernel)
    outs = {}
    for split in (True, False):
        launches.clear()
        init = h0.transpose(-1, -2).contiguous() if state_v_first else h0
        o, ht = fwd(q, k, v, g, g, 32**-0.5, init, True, cu_t, state_v_first, split=split, cu_seqlens_cpu=cu_t)
        outs[split] = (o.float(), ht.transpose(-1, -2) if state_v_first else ht)
        modes = [c.mode for c, _ in launches]
        assert modes == (["full", "correction"] if split else ["full"]), modes
    for n in range(len(cu) - 1):
        s, e = cu[n], cu[n + 1]
        assert rel_rmse(outs[True][1][n], outs[False][1][n]) < 1e-5, n
        if e > s:
            assert rel_rmse(outs[True][0][0, s:e], outs[False][0][0, s:e]) < 5e-3, n


def test_a_nan_gate_in_a_middle_range_turns_the_split_call_nan_where_one_walk_does(launches):
    """A per-token gate of NaN (which the scalar-gate kernel carries into its state, as the launches' stand-in here
    does) inside a middle range of a split sequence: the split call's outputs are those of one walk before it and NaN
    from it on, and its final state is NaN, as one walk's."""
    kernel = entry.ChunkKernel("test", None, delta_rule=False, gate_transition=True)
    torch.manual_seed(5)
    cu = [0, 3100, 3300]  # the first sequence cut every 1024 tokens: [1024, 2048) is a middle range
    q, k, v, g, _ = inputs(1, 3300, 2, 2, False)
    g = g * 1e-3
    g[0, 1500, 1] = float("nan")
    cu_t = torch.tensor(cu, dtype=torch.int32)
    outs = {}
    for split in (True, False):
        o, ht = entry_for(kernel)(q, k, v, g, g, 32**-0.5, None, True, cu_t, False, split=split, cu_seqlens_cpu=cu_t)
        outs[split] = (o.float(), ht)
    for split in (True, False):
        o, ht = outs[split]
        assert torch.isfinite(o[0, :1500]).all() and torch.isnan(o[0, 1500:3100, 1]).all(), split
        assert torch.isfinite(o[0, 1500:, 0]).all() and torch.isfinite(o[0, 3100:]).all(), split
        assert torch.isnan(ht[0, 1]).all() and torch.isfinite(ht[0, 0]).all() and torch.isfinite(ht[1]).all(), split
    from delta_rule_recurrence import rel_rmse

    assert rel_rmse(outs[True][0][0, :1500], outs[False][0][0, :1500]) < 5e-3


def test_a_wrong_correction_pass_fails(monkeypatch):
    def no_correction(kernel, call, config, t, scale):
        if config.mode != "correction":
            reference_launch(kernel, call, config, t, scale)

    monkeypatch.setattr(entry, "launch", no_correction)
    with pytest.raises(AssertionError):
        check_fwd(entry_for(kernel_with()), accept, inputs(1, 2100, 1, 1, False), h0=True, split=True)


@pytest.mark.parametrize("per_key", [False, True])
def test_split_passes_with_saved_intra_chunk_matrices(per_key, launches):
    """With ``cached`` split costs the first pass gets a workspace with rows for each segment's chunks and saves
    ("save"); the later passes get the same workspace ("load"), with every segment at the same range index as in
    the first pass (the ones a pass skips as empty ranges), so each range loads what its own segment saved. Further
    workspaces (KDA's B tiles) are made once per split, sized by the ranges and their chunks, and every pass gets
    the same ones."""
    made = []

    def workspaces(ranges, chunks, HV, D, device):
        made.append((ranges, chunks, HV, D))
        return {"wx": torch.empty(ranges, chunks, HV, D, device=device)}

    fwd = entry_for(kernel_with(SplitCost(0.69, 0.45, cached=True), workspaces))
    check_fwd(fwd, accept, inputs(2, 2100, 1, 2, per_key), h0=True, split=True)
    assert [(c.mode, c.intra) for c, _ in launches] == [
        ("full", "save"),
        ("transition", "load"),
        ("correction", "load"),
    ]
    assert len(made) == 1
    (_, first), *later = launches
    full = list(zip(first.starts.tolist(), first.ends.tolist(), strict=True))
    w, wx = first.w, first.workspaces["wx"]
    assert w.dtype == torch.bfloat16 and w.shape[0] == len(full) and w.shape[2:] == (2, 64)
    assert all(w.shape[1] >= 2 * 64 * -(-(e - s) // 64) for s, e in full)
    assert wx.shape == (w.shape[0], w.shape[1] // (2 * 64), 2, 32)
    for _, t in later:
        assert t.w.data_ptr() == w.data_ptr() and t.workspaces["wx"].data_ptr() == wx.data_ptr()
        ranges = list(zip(t.starts.tolist(), t.ends.tolist(), strict=True))
        assert len(ranges) == len(full) and all(r == f or r[0] == r[1] for r, f in zip(ranges, full, strict=True))
    launches.clear()
    cu = [0, 1, 1500, 1501, 2300]  # two segments at most: no middle segment, so no transition pass
    check_fwd(fwd, accept, inputs(1, 2300, 1, 2, per_key), cu, h0=True, state_v_first=True, split=True)
    assert [(c.mode, c.intra) for c, _ in launches] == [("full", "save"), ("correction", "load")]


def test_a_split_with_nothing_to_cut_or_too_many_segments_runs_whole(launches, monkeypatch):
    """A forced split of sequences no longer than its 1024-token pieces cuts nothing: one unsplit launch (a split
    would size its workspaces for later segments it does not have). Nor is a call split into more segments than a
    launch grid has rows (``MAX_SEQUENCES``)."""
    cached = entry_for(kernel_with(SplitCost(0.69, 0.45, cached=True)))
    check_fwd(cached, accept, inputs(2, 1000, 1, 2, True), h0=True, split=True)
    assert [(c.mode, c.intra, t.w) for c, t in launches] == [("full", "none", None)]
    launches.clear()
    cu = [0, 1, 1500, 1501, 2300]  # cut at 1024: five segments of four sequences
    monkeypatch.setattr(entry, "MAX_SEQUENCES", 4)
    check_fwd(entry_for(kernel_with()), accept, inputs(1, 2300, 1, 2, False), cu, h0=True, split=True)
    assert [c.mode for c, _ in launches] == ["full"]
    launches.clear()
    monkeypatch.setattr(entry, "MAX_SEQUENCES", 5)
    check_fwd(entry_for(kernel_with()), accept, inputs(1, 2300, 1, 2, False), cu, h0=True, split=True)
    assert "correction" in [c.mode for c, _ in launches]  # split


def test_plans_are_kept_per_layout_and_split_costs(launches):
    """A call's plan (its cuts, segments and longest segment's chunks) is made once per layout: the same offsets find
    it again, other offsets or other split costs get their own."""

    def plan(kernel, lengths, split=None):
        q, k, v, g, beta = inputs(1, sum(lengths), 1, 8, False)
        cu = torch.tensor([0, *lengths]).cumsum(0) if len(lengths) > 1 else None
        return entry.plan_call(kernel, entry.ChunkCall(q, k, v, g, beta, cu_seqlens=cu, split=split))

    forced = plan(kernel_with(), [1, 2499, 1596], split=True)
    assert forced == ((0, 1, 2500, 4096), ((), (1024, 2048), (1024,)), 6, 16, 1)
    assert plan(kernel_with(), [1, 2499, 1596], split=True) is forced
    assert plan(kernel_with(), [1, 1999, 2096], split=True) == (
        (0, 1, 2000, 4096),
        ((), (1024,), (1024, 2048)),
        6,
        16,
        1,
    )
    assert plan(kernel_with(), [1, 999, 96], split=True) == ((0, 1, 1000, 1096), None, 0, 0, 1)  # nothing to cut
    planned = plan(kernel_with(UNCACHED), [65536])
    assert planned.cuts and plan(kernel_with(UNCACHED), [65536]) is planned
    assert plan(kernel_with(SplitCost(fixed=1e4)), [65536]).cuts is None  # costlier split passes: planned again


def test_varlen_offsets_only_on_the_device_still_split(launches):
    """Without ``cu_seqlens_cpu`` the entry reads the offsets from ``cu_seqlens`` (once per tensor) and splits."""
    q, k, v, g, beta = inputs(1, 2300, 1, 2, False)
    cu = torch.tensor([0, 1, 1500, 1501, 2300], dtype=torch.int32)
    o, ht = entry_for(kernel_with())(q, k, v, g, beta, 0.2, None, True, cu, False, split=True)
    assert [c.mode for c, _ in launches] == ["full", "correction"]  # two segments at most: no transition
    o_ref, ht_ref = linear_attn_ref(q, k, v, g=g, beta=beta, scale=0.2, output_final_state=True, cu_seqlens=cu)
    torch.testing.assert_close(o.float(), o_ref.float(), rtol=0.02, atol=0.02)
    torch.testing.assert_close(ht, ht_ref.float(), rtol=0.02, atol=0.02)


@pytest.mark.parametrize(
    "options",
    [
        {"is_varlen": True, "has_initial_state": True},
        {"is_varlen": True, "has_initial_state": True, "qk_l2norm": True},
        {"is_varlen": True, "mode": "correction", "intra": "load"},
        {"head_dim": 64, "is_varlen": True, "intra": "save", "qk_l2norm": True},
    ],
)
def test_gdn_family_kernel_structure(options):
    """GDN on the family skeleton: 512 threads in four warpgroups at D = 128 (three at D = 64: one state
    warpgroup), setmaxnreg per role from the register budget (24 / 104 / the rest), the hand-offs through mbarrier rings (try_wait spins, no bar.arrive hand-off), V read
    and O staged by ldmatrix / stmatrix, O stored by TMA."""
    from cula.gdn.chunk_fwd_sm90 import compile_gdn_fwd_sm90

    ptx = compile_gdn_fwd_sm90("sm_90a", keep_artifacts=True, **options).artifacts.PTX
    d64 = options.get("head_dim") == 64
    assert f".reqntid {384 if d64 else 512}" in ptx
    regs = [int(x) for x in re.findall(r"setmaxnreg\.\w+\.sync\.aligned\.u32\s+(\d+);", ptx)]
    assert regs == [24, 104, 256 if d64 else 192]
    assert "mbarrier.try_wait.parity" in ptx and "bar.arrive" not in ptx
    assert not compile_check.fixed_phase_waits(ptx)
    assert "ldmatrix.sync.aligned.m8n8.x4.trans" in ptx and "stmatrix.sync.aligned.m8n8.x4.trans" in ptx
    assert re.search(r"cp\.async\.bulk\.tensor\.\dd\.global\.shared", ptx)
    assert ("rsqrt.approx" in ptx) == options.get("qk_l2norm", False)


@pytest.mark.parametrize(
    "options,tma_stores",
    [
        ({"gate_in_kernel": True, "qk_l2norm": True}, 2),  # O
        ({"is_varlen": True, "intra": "save"}, 2 + 8),  # O, Tinv and P, the three B tiles (two boxes each)
        ({"is_varlen": True, "mode": "correction", "intra": "load"}, 2),
        ({"is_varlen": True, "mode": "transition", "intra": "load", "gate_in_kernel": True}, 0),
        ({"head_dim": 64, "is_varlen": True, "has_initial_state": True}, 1),
    ],
)
def test_kda_family_kernel_structure(options, tma_stores):
    """KDA on the family skeleton: 384 threads, a prep warpgroup (56 registers) beside two state warpgroups (224)
    that make A and P themselves; hand-offs through mbarrier rings only; the next chunk's tiles prefetched into L2;
    the first split pass stores its B tiles by TMA; the later passes load them and make no gates (no exp2)."""
    from cula.kda.chunk_fwd_sm90 import compile_kda_fwd_sm90

    ptx = compile_kda_fwd_sm90("sm_90a", keep_artifacts=True, **options).artifacts.PTX
    assert ".reqntid 384" in ptx
    assert [int(x) for x in re.findall(r"setmaxnreg\.\w+\.sync\.aligned\.u32\s+(\d+);", ptx)] == [56, 224]
    assert "mbarrier.try_wait.parity" in ptx and "bar.arrive" not in ptx
    assert not compile_check.fixed_phase_waits(ptx)
    assert "cp.async.bulk.prefetch.tensor" in ptx
    assert len(re.findall(r"cp\.async\.bulk\.tensor\.\dd\.global\.shared", ptx)) == tma_stores
    if options.get("intra") == "load":
        assert "ex2.approx" not in ptx


def test_one_off_sequence_fails_where_the_call_passes(monkeypatch):
    """The GPU tests' check is per sequence as well: output 5 % off on one 5-token sequence of a 2300-token call
    passes the call's rel RMSE (about 0.002) and fails that sequence's."""
    from delta_rule_recurrence import assert_matches, recurrence, rel_rmse

    def off_by_5_percent(kernel, call, config, t, scale):
        reference_launch(kernel, call, config, t, scale)
        t.o[0, 1000:1005] = (t.o[0, 1000:1005].float() * 1.05).to(t.o.dtype)

    monkeypatch.setattr(entry, "launch", off_by_5_percent)
    q, k, v, g, beta = inputs(1, 2300, 1, 1, False)
    cu = [0, 1000, 1005, 2300]
    o, ht = entry_for(kernel_with())(q, k, v, g, beta, 32**-0.5, None, True, torch.tensor(cu), False, split=False)
    o_ref, ht_ref = recurrence(q, k, v, g, beta, 32**-0.5, None, cu)
    assert rel_rmse(o, o_ref) < 5e-3
    with pytest.raises(AssertionError, match="o of sequence 1"):
        assert_matches(o, ht, o_ref, ht_ref, cu)


def test_the_sanitizer_workload_is_valid_calls():
    """Every call of scripts/sanitize_kernels.py (what gpu_check.sh runs under compute-sanitizer) passes the entry
    points' validation and covers what it names: varlen with 0- and 1-token sequences, GVA, D = 64, state_v_first,
    the backwards too."""
    import importlib.util
    from pathlib import Path

    import cula

    path = Path(__file__).resolve().parent.parent / "scripts" / "sanitize_kernels.py"
    spec = importlib.util.spec_from_file_location("sanitize_kernels", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    seen = set()
    for op, name, fn, call in module.calls("cpu"):
        assert cula.explain(fn, **call).backend == "torch", (op, name)
        lengths = call["cu_seqlens"].diff().tolist() if "cu_seqlens" in call else []
        seen.update({"0-token"} if 0 in lengths else set())
        seen.update({"1-token"} if 1 in lengths or call["q"].shape[1] == 1 else set())
        seen.update({"GVA"} if call["v"].shape[2] > call["q"].shape[2] else set())
        seen.update({"D=64"} if call["q"].shape[-1] == 64 else set())
        seen.update({"state_v_first"} if call.get("state_v_first") else set())
        seen.add(op)
    decode = {"gdn_decode", "kda_decode", "gla_decode", "lightning_decode"}
    chunk = {"gdn", "kda", "simple_gla", "gla"}
    assert seen == {"0-token", "1-token", "GVA", "D=64", "state_v_first", *chunk, *decode, *module.TRAINING}


@pytest.mark.parametrize("split", [False, True])
def test_the_simple_gla_kernel_launches_without_the_delta_rule(monkeypatch, split):
    """Every launch of simple GLA's SM90 entry, unsplit and in each split pass, asks for the kernel without the
    delta rule (its config is the compile cache's key); a split runs no transition pass (the host makes them)."""
    from cula.lightning.chunk_fwd_sm90 import chunk_simple_gla_fwd_sm90

    configs = []
    monkeypatch.setattr(entry, "launch", lambda kernel, call, config, t, scale: configs.append(config))
    pretend_h200(monkeypatch)
    q, k, v, g, _ = inputs(1, 2100, 2, 2, per_key=False)
    chunk_simple_gla_fwd_sm90(q, k, v, g, None, None, None, False, None, False, None, split)
    assert configs and all(not c.delta_rule for c in configs)
    assert {c.mode for c in configs} == ({"full", "correction"} if split else {"full"})


def pooled_call_and_reference(gdn_inputs, pool, slots, cu, inplace, state_v_first=False):
    """A pooled GDN call through :func:`cula.sm90.entry.chunk_fwd` on a copy of ``pool``, checked against the
    reference backend's on another copy: ``(o, state, the pool the kernel path was given)``."""
    import cula

    q, k, v, g, beta = gdn_inputs
    pool_kernel, pool_ref = pool.clone(), pool.clone()
    call = entry.ChunkCall(
        q, k, v, g, beta, None, pool_kernel, not inplace, cu, state_v_first, state_slots=slots, inplace=inplace
    )
    o, state = entry.chunk_fwd(kernel_with(), call)
    o_ref, state_ref = cula.gdn.chunk_gated_delta_rule(
        q, k, v, g, beta, initial_state=pool_ref, output_final_state=not inplace, cu_seqlens=cu,
        state_v_first=state_v_first, ssm_state_indices=slots, inplace_final_state=inplace,
    )  # fmt: skip
    assert (o.float() - o_ref.float()).abs().max() <= 1e-2
    assert torch.allclose(state, state_ref, atol=1e-5)
    return o, state, pool_kernel


@pytest.mark.parametrize("inplace", [True, False])
@pytest.mark.parametrize("state_v_first", [False, True])
def test_a_pooled_call_reads_and_writes_its_slots_in_one_launch(launches, inplace, state_v_first):
    """A state pool through the host path: one unsplit launch whose states are the pool's rows by slot (written back
    in place, or fp32 final states by sequence), as the reference backend serves the same pooled call."""
    cu, slots = torch.tensor([0, 70, 71, 300]), torch.tensor([5, 0, 2])
    pool = torch.randn(6, 2, 32, 32) * 0.1
    _, state, pool_kernel = pooled_call_and_reference(
        inputs(1, 300, 1, 2, per_key=False), pool, slots, cu, inplace, state_v_first
    )
    ((config, t),) = launches
    assert (config.mode, config.state_slots) == ("full", "read_write" if inplace else "read")
    assert t.slots.dtype == torch.int32 and t.h0 is pool_kernel and (t.ht is pool_kernel) == inplace
    if inplace:
        assert state is pool_kernel and torch.equal(pool_kernel[[1, 3, 4]], pool[[1, 3, 4]])
    else:
        assert torch.equal(pool_kernel, pool)


@pytest.mark.parametrize("inplace", [True, False])
@pytest.mark.parametrize("varlen,state_v_first", [(True, False), (False, False), (True, True)])
def test_a_pooled_call_with_padding_runs_the_live_sequences_in_one_launch(launches, inplace, varlen, state_v_first):
    """Padding slots (negative) through the host path: one read-only launch (padding reads slot 0), then the padding's
    outputs zeroed and, in place, the live sequences' final states written to their slots; as the reference backend
    serves the same call: zero outputs and (read only) zero final states for padding, slots not named untouched."""
    B, T = (1, 300) if varlen else (3, 70)
    cu = torch.tensor([0, 70, 71, 300]) if varlen else None
    pool = torch.randn(6, 2, 32, 32) * 0.1
    o, state, pool_kernel = pooled_call_and_reference(
        inputs(B, T, 1, 2, per_key=False), pool, torch.tensor([5, -1, 2]), cu, inplace, state_v_first
    )
    ((config, t),) = launches
    assert config.state_slots == "read" and t.slots.tolist() == [5, 0, 2] and t.h0 is pool_kernel
    padded = slice(70, 71) if varlen else slice(70, 140)
    assert not o.view(B * T, -1)[padded].any()
    if inplace:
        assert state is pool_kernel and torch.equal(pool_kernel[[0, 1, 3, 4]], pool[[0, 1, 3, 4]])
    else:
        assert not state[1].any() and torch.equal(pool_kernel, pool)


@pytest.mark.parametrize("inplace", [True, False])
def test_a_pooled_call_of_padding_alone_launches_nothing(launches, inplace):
    q, k, v, g, beta = inputs(1, 40, 1, 2, per_key=False)
    pool = torch.randn(3, 2, 32, 32)
    before = pool.clone()
    call = entry.ChunkCall(
        q, k, v, g, beta, None, pool, not inplace, torch.tensor([0, 10, 40]), False,
        state_slots=torch.tensor([-1, -1]), inplace=inplace,
    )  # fmt: skip
    o, state = entry.chunk_fwd(kernel_with(), call)
    assert not launches and not o.any() and torch.equal(pool, before)
    assert state is pool if inplace else not state.any() and state.shape == (2, 2, 32, 32)


@pytest.mark.parametrize("indices", [[4, 0, 2], [4, -1, 2]])
def test_the_chunk_kernels_take_pools_with_and_without_padding(monkeypatch, indices):
    import cula
    from cula import dispatch

    monkeypatch.setattr(torch.Tensor, "is_cuda", property(lambda self: True))
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (9, 0))
    monkeypatch.setattr(dispatch, "fla_function", lambda target: None)
    q, k, v, g, beta = inputs(3, 64, 2, 4, per_key=False, D=128)
    for fn, gate in ((cula.gdn.chunk_gated_delta_rule, g), (cula.lightning.chunk_simple_gla, g[:, :, :2].contiguous())):
        extra = {"beta": beta} if fn is cula.gdn.chunk_gated_delta_rule else {}
        vv = v if extra else v[:, :, :2].contiguous()
        pool = torch.zeros(6, vv.shape[2], 128, 128)
        decision = cula.explain(
            fn, q, k, vv, gate, **extra, initial_state=pool, ssm_state_indices=torch.tensor(indices)
        )
        assert decision.backend == "cute", decision
        bf16_pool = cula.explain(
            fn, q, k, vv, gate, **extra, initial_state=pool.bfloat16(), ssm_state_indices=torch.tensor([4, 0, 2])
        )
        assert bf16_pool.backend == "cute", bf16_pool


@pytest.mark.parametrize("split", [False, True])
def test_gla_runs_without_the_delta_rule_whole_or_split(launches, split):
    """GLA's host path without the delta rule (beta's slot unread): one launch, or (forced) the uncached split passes
    (first and correction; the middle segments' transitions from the gate), as the reference backend's chunk_gla on
    the same inputs."""
    import cula
    from cula.gla.chunk_fwd_sm90 import chunk_gla_fwd_sm90

    q, k, v, g, _ = inputs(1, 2300, 2, 2, per_key=True)
    cu = torch.tensor([0, 1, 2100, 2100, 2300])
    h0 = torch.randn(4, 2, 32, 32) * 0.1
    o, ht = chunk_gla_fwd_sm90(q, k, v, g, None, h0, True, cu, split=split)
    modes = ["full", "correction"] if split else ["full"]
    assert [(c.delta_rule, c.mode, c.intra) for c, _ in launches] == [(False, m, "none") for m in modes]
    o_ref, ht_ref = cula.gla.chunk_gla(q, k, v, g, initial_state=h0, output_final_state=True, cu_seqlens=cu)
    assert (o.float() - o_ref.float()).abs().max() <= 1e-2 and torch.allclose(ht, ht_ref, atol=1e-4)


class _Built(Exception):
    """Raised in place of a compilation: what the launch asked to compile."""


@pytest.mark.parametrize("variant", ["gdn", "kda", "gla", "simple_gla", "simple_gla_sm100"])
@pytest.mark.parametrize("beta_fp32", [True, False])
def test_a_launch_compiles_the_variant_for_its_call(variant, beta_fp32, monkeypatch):
    """``entry.launch`` hands the variant's compile function the launch's config (its kernel object is built from it),
    beta's dtype and the state order (the fake arguments it compiles for) and the variant's options."""
    import cutlass

    from cula import runtime
    from cula.gdn.chunk_fwd_sm90 import GDN_SM90
    from cula.gla.chunk_fwd_sm90 import GLA_SM90
    from cula.kda.chunk_fwd_sm90 import KDA_SM90
    from cula.lightning.chunk_fwd_sm90 import SIMPLE_GLA_SM90
    from cula.lightning.chunk_fwd_sm100 import SIMPLE_GLA_SM100
    from cula.sm90.chunk_fwd import ChunkFwdConfig

    kernel = {"gdn": GDN_SM90, "kda": KDA_SM90, "gla": GLA_SM90}.get(variant)
    kernel = kernel or (SIMPLE_GLA_SM100 if variant.endswith("sm100") else SIMPLE_GLA_SM90)
    built = {}

    def compile_kernel(obj, fake, arch, keep_artifacts):
        built.update(obj=obj, fake=fake, arch=arch)
        raise _Built

    monkeypatch.setattr(runtime, "compile_kernel", compile_kernel)
    monkeypatch.setattr(runtime, "get_or_compile", lambda key, build: build())
    monkeypatch.setattr(
        runtime, "device_arch", lambda device=None: "sm_100a" if variant.endswith("sm100") else "sm_90a"
    )
    D = 128
    q = torch.zeros(1, 64, 2, D, dtype=torch.bfloat16)
    per_key = variant in ("kda", "gla")
    g = torch.zeros(1, 64, 2, *((D,) if per_key else ()))
    beta = torch.zeros(1, 64, 2, dtype=torch.float32 if beta_fp32 else torch.bfloat16)
    call = entry.ChunkCall(q, q, q, g, beta, state_v_first=True)
    config = ChunkFwdConfig(D, has_initial_state=True, delta_rule=kernel.delta_rule)
    t = entry.LaunchTensors(q, q, q, g, beta, q, None, torch.zeros(1, 2, D, D))
    with pytest.raises(_Built):
        entry.launch(kernel, call, config, t, 1.0)
    assert built["obj"].cfg == config and built["arch"] in ("sm_90a", "sm_100a")
    fake_beta, fake_h0 = built["fake"][4], built["fake"][6]
    assert fake_beta.element_type == (cutlass.Float32 if beta_fp32 else cutlass.BFloat16)
    assert fake_h0.stride[-1] != 1  # V-first storage: K is the contiguous mode, not V


@pytest.mark.parametrize("variant", ["simple_gla", "gdn"])
@pytest.mark.parametrize("split", [False, True])
@pytest.mark.parametrize("asked", [None, "1", "2"])
def test_value_blocks_as_asked_or_chosen_and_kept_off_the_cached_passes(monkeypatch, variant, split, asked):
    """CULA_VALUE_BLOCKS=2: every D = 128 launch of the kernels that can split a value head over two CTAs does so,
    simple GLA's split passes too (they carry no workspace), GDN's cached split passes not (their Tinv | P workspace
    has one writer per head); "1": none. Unset: where twice the CTAs fit one wave and walk whole (here the unsplit
    call). D = 64: one CTA per head always."""
    from cula.gdn.chunk_fwd_sm90 import GDN_SM90
    from cula.lightning.chunk_fwd_sm90 import SIMPLE_GLA_SM90

    kernel = {"simple_gla": SIMPLE_GLA_SM90, "gdn": GDN_SM90}[variant]
    configs = []
    monkeypatch.setattr(entry, "launch", lambda kernel, call, config, t, scale: configs.append(config))
    pretend_h200(monkeypatch)
    if asked is not None:
        monkeypatch.setenv(entry.ENV_VALUE_BLOCKS, asked)
    expected = {
        "2": 1 if split and variant == "gdn" else 2,
        "1": 1,
        None: 1 if split else 2,
    }[asked]
    for D in (128, 64):
        configs.clear()
        q, k, v, g, beta = inputs(1, 2100, 2, 2, per_key=False, D=D)
        entry.chunk_fwd(kernel, entry.ChunkCall(q, k, v, g, beta, split=split))
        assert configs and ({c.mode for c in configs} != {"full"}) == split
        assert {c.value_blocks for c in configs} == {expected if D == 128 else 1}, configs


@pytest.mark.parametrize(
    "variant, shape, asked, blocks, segments",
    [
        ("simple_gla", (1, 8192, 64), None, 2, 0),  # 128 CTAs walk whole instead of a cut in two
        ("simple_gla", (1, 8192, 64), "1", 1, 2),
        ("simple_gla", (2, 16384, 64), None, 1, 0),  # 256 CTAs would take two waves
        ("simple_gla", (1, 65536, 8), None, 1, 16),  # 16 CTAs would still be cut: today's split
        ("simple_gla", (1, 65536, 8), "2", 2, 8),  # as asked: the planner sees twice the heads
        ("gdn", (1, 8192, 64), None, 2, 0),
        ("gdn", (1, 8192, 64), "1", 1, 2),
        ("gdn", (2, 16384, 64), None, 1, 0),
        ("gdn", (1, 8192, 64), "2", 2, 0),
        ("gdn", (1, 65536, 8), "2", 1, 16),  # still cut: its cached passes take one CTA per head, cut for them
        ("gla", (1, 8192, 64), None, 1, 2),
        ("gla", (1, 8192, 64), "2", 2, 0),
        ("kda", (1, 8192, 64), None, 1, 2),
        ("kda", (1, 8192, 64), "2", 2, 0),
    ],
)
def test_value_blocks_where_twice_the_ctas_fit_one_wave_and_walk_whole(
    monkeypatch, variant, shape, asked, blocks, segments
):
    """The planner's choice on 132 SMs (meta tensors: no data)."""
    from cula.gdn.chunk_fwd_sm90 import GDN_SM90
    from cula.gla.chunk_fwd_sm90 import GLA_SM90
    from cula.kda.chunk_fwd_sm90 import KDA_SM90
    from cula.lightning.chunk_fwd_sm90 import SIMPLE_GLA_SM90

    kernel = {"simple_gla": SIMPLE_GLA_SM90, "gdn": GDN_SM90, "gla": GLA_SM90, "kda": KDA_SM90}[variant]
    pretend_h200(monkeypatch)
    if asked is not None:
        monkeypatch.setenv(entry.ENV_VALUE_BLOCKS, asked)
    q = torch.empty(*shape, 128, device="meta", dtype=torch.bfloat16)
    call = entry.ChunkCall(q, q, q, torch.empty(*shape, device="meta"), torch.empty(*shape, device="meta"))
    plan = entry.plan_call(kernel, call)
    assert (plan.value_blocks, plan.segments) == (blocks, segments), plan


def test_value_blocks_are_refused_where_a_kernel_cannot_take_them():
    """Two value blocks need D = 128, no intra-chunk workspace and the forward's walk, and a kernel whose load warp
    takes the CTA's block (the skeleton alone and SM100's do not)."""
    from cula.sm90.chunk_fwd import ChunkFwdConfig, ChunkFwdSm90
    from cula.sm100.scalar_chunk_fwd import ScalarGateChunkFwdSm100

    for bad in (
        {"head_dim": 64},
        {"is_varlen": True, "intra": "save"},
        {"walk": "states"},
        {"head_dim": 128, "value_blocks": 4},
    ):
        with pytest.raises(AssertionError):
            ChunkFwdConfig(**{"value_blocks": 2, **bad})
    with pytest.raises(AssertionError):
        ChunkFwdSm90(ChunkFwdConfig(value_blocks=2, delta_rule=False))
    with pytest.raises(AssertionError):
        ScalarGateChunkFwdSm100(ChunkFwdConfig(value_blocks=2, delta_rule=False))


def test_the_last_plan_says_how_this_threads_call_ran(launches):
    """entry.last_plan(): the plan of the thread's latest chunk forward, None after forget_last_plan() and in another
    thread; describe() words it for the benchmark's notes."""
    import threading

    q, k, v, g, beta = inputs(1, 2100, 1, 2, False)
    entry.forget_last_plan()
    assert entry.last_plan() is None
    entry.chunk_fwd(kernel_with(), entry.ChunkCall(q, k, v, g, beta, split=True))
    plan = entry.last_plan()
    assert plan is not None and plan.cuts == ((1024, 2048),)
    assert entry.describe(plan) == "1 of 1 sequences cut, 3 segments"
    seen = []
    worker = threading.Thread(target=lambda: seen.append(entry.last_plan()))
    worker.start()
    worker.join()
    assert seen == [None]
    entry.chunk_fwd(kernel_with(), entry.ChunkCall(q, k, v, g, beta, split=False))
    assert entry.describe(entry.last_plan()) == "sequences walked whole"
    assert entry.describe(entry.Plan((0, 64), None, value_blocks=2)) == "sequences walked whole, 2 CTAs per value head"
