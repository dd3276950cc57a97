"""The Python side of the SM90 chunked forwards (cula.ops.sm90_entry.chunk_fwd: outputs, varlen ranges, sequence
splitting) on the CPU, with the kernel launch replaced by the fp32 reference working to the launch contract; checked
against the fp64 recurrence through the same harness as the GPU tests."""

import re

import pytest
import torch
import torch.nn.functional as F
from delta_rule_recurrence import check_fwd

from cula.ops import sm90_entry
from cula.ops.delta_rule_ref import linear_attn_ref
from cula.ops.segment_split import UNCACHED, SplitCost


def reference_launch(q, k, v, g, beta, o, h0, ht, starts, ends, scale, state_v_first, mode):
    """What a kernel launch does: each sequence (a batch row, or a token range of row 0) from h0 (zero; identity
    for "transition"), v = 0 unless "full"; o written ("full"), added to ("correction") or left; final states to ht."""
    B, T, HV, V = v.shape
    K = q.shape[-1]
    if starts is None:
        rows = [(b, 0, T) for b in range(B)]
    else:
        rows = [(0, int(s), int(e)) for s, e in zip(starts, ends, strict=True)]
    for n, (b, s, e) in enumerate(rows):
        Vd = V if mode != "transition" else K
        vv = v[b : b + 1, s:e] if mode == "full" else torch.zeros(1, e - s, HV, Vd, dtype=v.dtype)
        if mode == "transition":
            start = torch.eye(K).expand(1, HV, K, K)
        elif h0 is not None:
            start = (h0[n].transpose(-1, -2) if state_v_first else h0[n])[None]
        else:
            start = None
        o_n, ht_n = linear_attn_ref(
            q[b : b + 1, s:e], k[b : b + 1, s:e], vv, g=g[b : b + 1, s:e], beta=beta[b : b + 1, s:e], scale=scale,
            initial_state=start, output_final_state=True,
        )  # fmt: skip
        if mode == "full":
            o[b, s:e] = o_n[0].to(o.dtype)
        elif mode == "correction":
            o[b, s:e] = (o[b, s:e].float() + o_n[0]).to(o.dtype)
        ht[n] = ht_n[0].transpose(-1, -2) if state_v_first else ht_n[0]


def entry_for(launch, split_cost=UNCACHED, workspaces=None):
    """An SM90-entry-shaped forward (as ``check_fwd`` calls it) around ``chunk_fwd`` with this launch."""

    def entry(q, k, v, g, beta, scale, initial_state, output_final_state, cu_seqlens, state_v_first, **kw):
        return sm90_entry.chunk_fwd(
            launch, q, k, v, g, beta, scale, initial_state, output_final_state, cu_seqlens, state_v_first,
            kw.get("out"), kw.get("final_state_out"), kw.get("cu_seqlens_cpu"), kw.get("split"), 64,
            split_cost, workspaces,
        )  # fmt: skip

    return entry


entry = entry_for(reference_launch)


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
def test_one_launch(per_key):
    check_fwd(entry, accept, inputs(2, 100, 1, 2, per_key), h0=True, split=False)
    cu = [0, 0, 1, 80, 80, 150, 150]  # zero-length sequences too: their final state is their initial state (zero)
    check_fwd(entry, accept, inputs(1, 150, 2, 2, per_key), cu, state_v_first=True, split=False)


@pytest.mark.parametrize("per_key", [False, True])
@pytest.mark.parametrize("state_v_first", [False, True])
def test_split_passes(per_key, state_v_first):
    """Forced cuts every 1024 tokens: full, transition and correction passes with the chained starts."""
    check_fwd(entry, accept, inputs(2, 2100, 1, 2, per_key), h0=True, state_v_first=state_v_first, split=True)
    cu = [0, 0, 1, 1500, 1500, 1501, 2300, 2300]  # zero-length sequences too
    check_fwd(entry, accept, inputs(1, 2300, 1, 2, per_key), cu, h0=True, state_v_first=state_v_first, split=True)


def test_a_wrong_correction_pass_fails():
    def no_correction(*args):
        if args[-1] != "correction":
            reference_launch(*args)

    with pytest.raises(AssertionError):
        check_fwd(entry_for(no_correction), accept, inputs(1, 2100, 1, 1, False), h0=True, split=True)


@pytest.mark.parametrize(
    "kernel,variant",
    [
        (kernel, v)
        for kernel in ("gdn_chunk_fwd_sm90", "kda_chunk_fwd_sm90")
        for v in {**sm90_entry.CHECKED_VARIANTS, **sm90_entry.INTRA_VARIANTS}
    ]
    + [
        ("gdn_chunk_fwd_sm90", v)
        for v in (
            "[fixed length]",
            "[D=64, intra save]",
            "[D=64, intra load, correction]",
            "[qk_l2norm, intra save]",
            "[qk_l2norm, intra load, correction]",
            "[D=64, qk_l2norm, correction]",
        )
    ]
    + [("kda_chunk_fwd_sm90", "[gate in kernel, qk_l2norm, bf16 beta, fixed length]")],
)
def test_kernel_variants_compile_for_sm90_on_cpu(kernel, variant):
    """Every checked variant of both chunk kernels compiles for sm_90a on the CPU, with wgmma and TMA in its PTX and
    no injected warpgroup.arrive in its machine code; no local memory in GDN's, at most the registered allowance in
    KDA's (a few constants its math role keeps across the chunk loop)."""
    from cula import compile_check, runtime

    report = compile_check.check_kernel(kernel + variant, "sm_90a")
    assert report.ok, report.error
    allowed = (0, 0) if kernel.startswith("gdn") else runtime.registered_kernels()[kernel + variant].sass_allowed
    assert report.local_mem <= allowed[0] and report.injected_arrives == 0
    assert allowed[0] <= 14
    assert report.counts["wgmma.mma_async"] > 0 and report.counts["cp.async.bulk.tensor"] > 0


@pytest.mark.parametrize("per_key", [False, True])
def test_split_passes_with_saved_intra_chunk_matrices(per_key):
    """A kernel that takes ``intra``: the first pass gets a workspace with rows for each segment's chunks and saves
    ("save"); the later passes get the same workspace ("load"), with every segment at the same range index as in
    the first pass (the ones a pass skips as empty ranges), so each range loads what its own segment saved. Further
    workspaces (KDA's B tiles) are made once per split, sized by the ranges and their chunks, and every pass gets
    the same ones."""
    saved = {}
    seen = []
    made = []

    def workspaces(ranges, chunks, HV, D, device):
        made.append((ranges, chunks, HV, D))
        return {"wx": torch.empty(ranges, chunks, HV, D, device=device)}

    def launch(q, k, v, g, beta, o, h0, ht, starts, ends, scale, state_v_first, mode, intra, w, wx):
        ranges = list(zip(starts.tolist(), ends.tolist(), strict=True))
        seen.append((mode, intra))
        assert wx.shape == (w.shape[0], w.shape[1] // (2 * 64), v.shape[2], q.shape[3])
        if intra == "save":
            assert w.dtype == torch.bfloat16 and w.shape[0] == len(ranges) and w.shape[2:] == (v.shape[2], 64)
            assert all(w.shape[1] >= 2 * 64 * -(-(e - s) // 64) for s, e in ranges)
            saved[w.data_ptr()] = (ranges, wx.data_ptr())
        else:
            full, wx_ptr = saved[w.data_ptr()]
            assert wx.data_ptr() == wx_ptr
            assert len(ranges) == len(full)
            assert all(r == f or r[0] == r[1] for r, f in zip(ranges, full, strict=True))
        reference_launch(q, k, v, g, beta, o, h0, ht, starts, ends, scale, state_v_first, mode)

    cached = entry_for(launch, SplitCost(0.69, 0.45, cached=True), workspaces)
    check_fwd(cached, accept, inputs(2, 2100, 1, 2, per_key), h0=True, split=True)
    assert seen == [("full", "save"), ("transition", "load"), ("correction", "load")]
    assert len(made) == 1
    seen.clear()
    cu = [0, 1, 1500, 1501, 2300]  # two segments at most: no middle segment, so no transition pass
    check_fwd(cached, accept, inputs(1, 2300, 1, 2, per_key), cu, h0=True, state_v_first=True, split=True)
    assert seen == [("full", "save"), ("correction", "load")]


def test_a_split_with_nothing_to_cut_or_too_many_segments_runs_whole(monkeypatch):
    """A forced split of sequences no longer than its 1024-token pieces cuts nothing: one unsplit launch (a split
    would size its workspaces for later segments it does not have). Nor is a call split into more segments than a
    launch grid has rows (``MAX_SEQUENCES``)."""
    modes = []

    def launch(*args, **kw):
        assert not kw, "an unsplit launch takes no workspaces"
        modes.append(args[-1])
        reference_launch(*args)

    cached = entry_for(launch, SplitCost(0.69, 0.45, cached=True))
    check_fwd(cached, accept, inputs(2, 1000, 1, 2, True), h0=True, split=True)
    assert modes == ["full"]
    modes.clear()
    cu = [0, 1, 1500, 1501, 2300]  # cut at 1024: five segments of four sequences
    monkeypatch.setattr(sm90_entry, "MAX_SEQUENCES", 4)
    check_fwd(entry_for(launch), accept, inputs(1, 2300, 1, 2, False), cu, h0=True, split=True)
    assert modes == ["full"]
    modes.clear()
    monkeypatch.setattr(sm90_entry, "MAX_SEQUENCES", 5)
    check_fwd(entry_for(launch), accept, inputs(1, 2300, 1, 2, False), cu, h0=True, split=True)
    assert "correction" in modes  # split


def test_varlen_offsets_only_on_the_device_still_split():
    """Without ``cu_seqlens_cpu`` the entry reads the offsets from ``cu_seqlens`` (once per tensor) and splits."""
    modes = []

    def launch(*args):
        modes.append(args[-1])
        reference_launch(*args)

    q, k, v, g, beta = inputs(1, 2300, 1, 2, False)
    cu = torch.tensor([0, 1, 1500, 1501, 2300], dtype=torch.int32)
    o, ht = entry_for(launch)(q, k, v, g, beta, 0.2, None, True, cu, False, split=True)
    assert modes == ["full", "correction"]  # two segments at most: no middle one, so no transition
    o_ref, ht_ref = linear_attn_ref(q, k, v, g=g, beta=beta, scale=0.2, output_final_state=True, cu_seqlens=cu)
    torch.testing.assert_close(o.float(), o_ref.float(), rtol=0.02, atol=0.02)
    torch.testing.assert_close(ht, ht_ref.float(), rtol=0.02, atol=0.02)


@pytest.mark.parametrize("op", ["gdn", "gdn_roles", "kda"])
def test_profile_script_finds_its_anchors_in_the_kernels(op):
    """scripts/profile_chunk.py patches clock stamps after anchor lines of each kernel's chunk loop: every anchor must
    still be there (one stamp each), so the dev tool keeps working as the kernels change."""
    import importlib.util
    from pathlib import Path

    root = Path(__file__).resolve().parent.parent
    spec = importlib.util.spec_from_file_location("profile_chunk", root / "scripts" / "profile_chunk.py")
    profile_chunk = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(profile_chunk)
    ops = profile_chunk.OPS[op]
    src = profile_chunk.patched_source(ops, root)
    assert src.count("_stamp(mHt, _t0, c, ") == len(ops["anchors"])
    assert "if n + hv > 0:" in src  # the stamped CTA keeps its own final state out of the stamps
    for repl in ops.get("replace", {}).values():
        assert repl in src


def test_gdn_d128_unsplit_runs_the_four_role_kernel():
    """GDN at D = 128 compiles to the four-role kernel for whole sequences and every split pass that saves or loads
    Tinv and P (with qk_l2norm too: then two more load warps take the norms of q and k): 512 threads, setmaxnreg per
    role, V read and O staged by ldmatrix / stmatrix; the other variants stay on the two-warpgroup kernel."""
    from cula.gdn.chunk_fwd_sm90 import compile_gdn_fwd_sm90, uses_roles

    assert uses_roles(128, "full", "none")
    assert not uses_roles(64, "full", "none")
    assert uses_roles(128, "full", "save")  # a split's first pass
    assert uses_roles(128, "correction", "load") and uses_roles(128, "transition", "load")
    assert not uses_roles(128, "correction", "none")  # a pass that makes everything again (as at D = 64)
    for qk_l2norm in (False, True):
        ptx = compile_gdn_fwd_sm90("sm_90a", True, 128, False, True, True, True, qk_l2norm=qk_l2norm).artifacts.PTX
        assert ".reqntid 512" in ptx
        assert ptx.count("setmaxnreg") == 3
        assert "ldmatrix.sync.aligned.m8n8.x4.trans" in ptx and "stmatrix.sync.aligned.m8n8.x4.trans" in ptx
        assert ("rsqrt.approx" in ptx) == qk_l2norm
    old = compile_gdn_fwd_sm90("sm_90a", True, 64, False, True, True, True).artifacts.PTX
    assert ".reqntid 256" in old and "setmaxnreg" not in old


def test_kda_runs_a_prep_warpgroup_beside_two_math_warpgroups():
    """The KDA kernel compiles to three warpgroups in every pass (whole sequences, a split's first and later passes,
    D = 64): 384 threads, setmaxnreg down for the prep role and up for the math role, the hand-offs as named-barrier
    arrives (prep: GR_FULL, B_FULL; math: AP_DONE, B_EMPTY; when Tinv and P are loaded only B_FULL / B_EMPTY), and
    L2 prefetches of the next chunk's tiles. The first split pass stores its B tiles by TMA; the later passes load
    them and make no gates at all (no exp2 in them, with the gate and the norms in the kernel too)."""
    from cula.kda.chunk_fwd_sm90 import KDAChunkFwdSm90, compile_kda_fwd_sm90

    kernel = KDAChunkFwdSm90()
    assert kernel.threads == 384 and 2 * kernel.regs_math + kernel.regs_prep <= 3 * 168
    # named barriers: 3 GR_FULL, 5 B_FULL (prep arrives); 4 AP_DONE, 6 B_EMPTY (math arrives)
    for options, arrives in (
        ({"gate_in_kernel": True, "qk_l2norm": True}, {3, 4, 5, 6}),
        ({"is_varlen": True, "intra": "save"}, {3, 4, 5, 6}),
        ({"is_varlen": True, "mode": "correction", "intra": "load"}, {5, 6}),
        ({"is_varlen": True, "mode": "transition", "intra": "load", "gate_in_kernel": True}, {5, 6}),
        ({"head_dim": 64, "is_varlen": True, "has_initial_state": True}, {3, 4, 5, 6}),
    ):
        ptx = compile_kda_fwd_sm90("sm_90a", True, **options).artifacts.PTX
        assert ".reqntid 384" in ptx, options
        assert re.search(rf"setmaxnreg\.dec\.sync\.aligned\.u32\s+{kernel.regs_prep};", ptx), options
        assert re.search(rf"setmaxnreg\.inc\.sync\.aligned\.u32\s+{kernel.regs_math};", ptx), options
        assert {int(i) for i in re.findall(r"\bbar\.arrive (\d+), 384;", ptx)} == arrives, options
        # the next chunk's tiles are prefetched into L2 while this chunk's load is issued
        assert "cp.async.bulk.prefetch.tensor" in ptx, options
        tma_stores = len(re.findall(r"cp\.async\.bulk\.tensor\.\dd\.global\.shared", ptx))
        # Tinv and P (a box each) and the three B tiles (two 64-column boxes each)
        assert tma_stores == (8 if options.get("intra") == "save" else 0), options
        if options.get("intra") == "load":
            assert "ex2.approx" not in ptx, options


@pytest.mark.parametrize("script", ["ab_trees", "split_pass_times"])
def test_gpu_timing_scripts_parse(script, monkeypatch):
    """The GPU-side timing scripts (scripts/ab_trees.py: A/B of source trees, with a worker that must compile;
    scripts/split_pass_times.py: each launch of a split call) keep a working command line."""
    import importlib.util
    from pathlib import Path

    root = Path(__file__).resolve().parent.parent
    spec = importlib.util.spec_from_file_location(script, root / "scripts" / f"{script}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    if script == "ab_trees":
        compile(module.WORKER, "ab_trees_worker", "exec")
    monkeypatch.setattr("sys.argv", [f"{script}.py", "--help"])
    with pytest.raises(SystemExit) as exit_info:
        module.main()
    assert exit_info.value.code == 0
