"""The chunked backward of gated linear attention (cula.ops.chunk_backward), the plan of the SM90 backward kernels,
against the gradients of cuLA's fp64 reference backend (autograd through its recurrence) on a CPU: every gradient
per head within the bf16 tolerances, for scalar and per-key gates, with initial states and a gradient into the final
state."""

import pytest
import torch
import torch.nn.functional as F
from delta_rule_recurrence import offsets_of, sequence_bounds
from launch_emulation import launch as emulated_launch

import cula
from cula import runtime
from cula.ops import chunk_backward, chunk_emulation
from cula.ops.chunk_emulation import bf16

H, K, V = 2, 64, 64
SCALE = K**-0.5


def rel_rmse(x, ref):
    return ((x.double() - ref.double()).pow(2).mean().sqrt() / ref.double().pow(2).mean().sqrt()).item()


def to_call(x):
    """[H, T, ...] as one sequence of the public ops' [1, T, H, ...], fp64."""
    return x.double()[None].transpose(1, 2).contiguous()


def from_call(x):
    return x[0].transpose(0, 1)


def fp64_gradients(q, k, v, g, do, h0, dht):
    """Gradients of the fp64 reference (chunk_gla for per-key gates, chunk_simple_gla for scalar ones) on the
    bf16-rounded inputs the kernels read, for the cotangents ``do`` and ``dht``."""
    leaves = [to_call(bf16(x)).requires_grad_() for x in (q, k, v)]
    gate = to_call(g).requires_grad_()
    state = h0.double()[None].requires_grad_()
    op = cula.gla.chunk_gla if g.dim() == 3 else cula.lightning.chunk_simple_gla
    o, ht = op(*leaves, g=gate, scale=SCALE, initial_state=state, output_final_state=True)
    torch.autograd.backward([o, ht], [to_call(bf16(do)), dht.double()[None]])
    dq, dk, dv = (from_call(x.grad) for x in leaves)
    return {"dq": dq, "dk": dk, "dv": dv, "dg": from_call(gate.grad), "dh0": state.grad[0]}


def make_gates(kind, T, per_key):
    shape = (H, T, K) if per_key else (H, T)
    if kind == "layer":  # FLA's layers: logsigmoid(x) / 16
        return F.logsigmoid(torch.randn(shape)) / 16
    if kind == "steep":
        return -torch.rand(shape) * 3.0
    g = F.logsigmoid(torch.randn(shape) + 2.0)
    g[:, T // 3] = -1e4  # a spike: the state all but reset
    g[:, T // 2] = float("-inf")
    return g


@pytest.mark.parametrize("per_key", [False, True], ids=["scalar", "per_key"])
@pytest.mark.parametrize("T,gates", [(1, "layer"), (63, "steep"), (200, "layer"), (300, "spikes")])
def test_chunked_backward_matches_the_fp64_gradients(per_key, T, gates):
    torch.manual_seed(T)
    q, k, v, do = torch.randn(H, T, K), torch.randn(H, T, K) * K**-0.5, torch.randn(H, T, V), torch.randn(H, T, V)
    g = make_gates(gates, T, per_key)
    h0, dht = torch.randn(H, K, V) * 0.1, torch.randn(H, K, V) * 0.1
    got = chunk_backward.gated_backward(q, k, v, g, do, SCALE, h0, dht)
    ref = fp64_gradients(q, k, v, g, do, h0, dht)
    for name, tol in (("dq", 0.008), ("dk", 0.008), ("dv", 0.008), ("dh0", 0.008), ("dg", 0.02)):
        assert got[name].shape == ref[name].shape, name
        finite = torch.isfinite(ref[name])
        assert finite.all(), name  # -inf gates: the reference's gradient there is finite too
        for h in range(H):
            err = rel_rmse(got[name][h], ref[name][h])
            assert err <= tol, (name, h, err)


def test_the_chunk_constant_of_the_gate_gradient_is_needed():
    """The last chunk's constant carries dht into every gate: a plan without it is far off."""
    torch.manual_seed(0)
    T = 130
    q, k, v, do = torch.randn(H, T, K), torch.randn(H, T, K) * K**-0.5, torch.randn(H, T, V), torch.randn(H, T, V)
    g, h0, dht = make_gates("layer", T, True), torch.randn(H, K, V) * 0.1, torch.randn(H, K, V)
    ref = fp64_gradients(q, k, v, g, do, h0, dht)
    dropped = chunk_backward.gated_backward(q, k, v, g, do, SCALE, h0, None)
    assert rel_rmse(dropped["dg"], ref["dg"]) > 0.1


def delta_fp64_gradients(q, k, v, beta, g, do, h0, dht):
    """Gradients of the fp64 reference (chunk_kda for per-key gates, chunk_gated_delta_rule for scalar ones)."""
    leaves = [to_call(x).requires_grad_() for x in (q, k, v, g, beta)]
    state = h0.double()[None].requires_grad_()
    op = cula.kda.chunk_kda if g.dim() == 3 else cula.gdn.chunk_gated_delta_rule
    o, ht = op(*leaves[:3], leaves[3], leaves[4], scale=SCALE, initial_state=state, output_final_state=True)
    torch.autograd.backward([o, ht], [to_call(do), dht.double()[None]])
    dq, dk, dv, dg, dbeta = (from_call(x.grad) for x in leaves)
    return {"dq": dq, "dk": dk, "dv": dv, "dg": dg, "dbeta": dbeta, "dh0": state.grad[0]}


@pytest.mark.parametrize("per_key", [False, True], ids=["gdn", "kda"])
@pytest.mark.parametrize("T,gates", [(1, "layer"), (63, "steep"), (200, "layer"), (300, "spikes")])
def test_delta_rule_chunked_backward_is_exact(per_key, T, gates):
    """The delta rule's chunk-by-chunk backward (the WY form's gradients, the reverse state walk, the gate's
    gradient chunk by chunk) is the fp64 reference's autograd, to fp64 rounding, for GDN's and KDA's gates."""
    torch.manual_seed(T)
    q = torch.randn(H, T, K, dtype=torch.float64)
    k = F.normalize(torch.randn(H, T, K, dtype=torch.float64), dim=-1)
    v, do = torch.randn(H, T, V, dtype=torch.float64), torch.randn(H, T, V, dtype=torch.float64)
    beta = torch.rand(H, T, dtype=torch.float64)
    g = make_gates(gates, T, per_key).double()
    if gates == "steep":
        g = g / 8  # e^(G_i - G_j) stays representable in the reference's own chunk algebra
    h0, dht = torch.randn(H, K, V, dtype=torch.float64) * 0.1, torch.randn(H, K, V, dtype=torch.float64) * 0.1
    got = chunk_backward.delta_backward(q, k, v, beta, g, do, SCALE, h0, dht)
    ref = delta_fp64_gradients(q, k, v, beta, g, do, h0, dht)
    for name in ("dq", "dk", "dv", "dbeta", "dg", "dh0"):
        assert got[name].shape == ref[name].shape, name
        assert torch.isfinite(ref[name]).all(), name
        err = rel_rmse(got[name], ref[name])
        assert err <= 1e-9, (name, err)


@pytest.mark.parametrize("per_key", [False, True], ids=["gdn", "kda"])
@pytest.mark.parametrize("T,gates", [(1, "layer"), (300, "spikes"), (500, "layer")])
def test_delta_rule_backward_holds_with_bf16_operands(per_key, T, gates):
    """Every product of the delta rule's backward plan with its operands rounded to bf16 (the kernels' wgmma
    operands: tokens, checkpoints, Tinv, W, V_new, dV_new, dW, dT, the scores) and fp32 accumulation stays within the
    bf16 tolerances of the fp64 reference per head: no operand needs a hi + lo pair (KDA's forward does)."""
    torch.manual_seed(T)
    q, k = bf16(torch.randn(H, T, K)), bf16(F.normalize(torch.randn(H, T, K), dim=-1))
    v, do = bf16(torch.randn(H, T, V)), bf16(torch.randn(H, T, V))
    beta, g = torch.rand(H, T), make_gates(gates, T, per_key)
    h0, dht = torch.randn(H, K, V) * 0.1, torch.randn(H, K, V) * 0.1
    ref = delta_fp64_gradients(*(x.double() for x in (q, k, v, beta, g, do, h0, dht)))
    got = chunk_backward.delta_backward(q, k, v, beta, g, do, SCALE, h0, dht, operand=bf16)
    for name, tol in (("dq", 0.008), ("dk", 0.008), ("dv", 0.008), ("dh0", 0.008), ("dg", 0.02), ("dbeta", 0.02)):
        for h in range(H):
            err = rel_rmse(got[name][h], ref[name][h])
            assert err <= tol, (name, h, err)


@pytest.mark.parametrize(
    "variant, chunk",
    [("gdn", 64), ("kda", 64), ("gla", 64), ("simple_gla", 64), ("gla", 128), ("simple_gla", 128)],
)
@pytest.mark.parametrize("batch", [None, 2], ids=["one_batch", "batches_of_one_row"])
def test_rows_backward_gives_the_reference_gradients(variant, chunk, batch):
    """Every variant's per-chunk gradients over chunk rows (cula.ops.chunk_backward.rows_backward: the host side of
    the backwards after the walks), fed the plan's checkpoints in the kernels' numbering (rows no chunk takes left
    NaN), give the fp64 reference's gradients per sequence, on a varlen batch with empty, one-token and odd sequences,
    with GVA where the variant has it; in one batch of rows and in batches of one row (two chunk-heads). Chunks of 64
    (SM90) and, without the delta rule, of 128 (the SM100 kernel's walks)."""
    torch.manual_seed(2)
    delta, per_key = variant in ("gdn", "kda"), variant in ("kda", "gla")
    Hq, HV = (1, 2) if delta else (2, 2)
    lengths = [0, 1, 130, 64, 77]
    offsets = offsets_of(lengths)
    T, N = offsets[-1], len(lengths)
    f64 = torch.float64
    q = torch.randn(1, T, Hq, K, dtype=f64)
    k = F.normalize(torch.randn(1, T, Hq, K, dtype=f64), dim=-1)
    v, do = torch.randn(1, T, HV, V, dtype=f64), torch.randn(1, T, HV, V, dtype=f64)
    g = F.logsigmoid(torch.randn(1, T, HV, *((K,) if per_key else ()), dtype=f64) + 2.0)
    beta = torch.rand(1, T, HV, dtype=f64) if delta else None
    h0, dht = torch.randn(N, HV, K, V, dtype=f64) * 0.1, torch.randn(N, HV, K, V, dtype=f64) * 0.1
    index, _, _ = chunk_backward.chunk_rows(offsets, fixed_length=False, chunk=chunk)
    firsts = chunk_backward.checkpoint_rows(offsets, fixed_length=False, chunk=chunk)
    starts = torch.full((index.shape[0], HV, V, K), float("nan"), dtype=f64)
    ends = torch.full_like(starts, float("nan"))
    for n, (s, e) in enumerate(zip(offsets[:-1], offsets[1:], strict=True)):
        if e == s:
            continue
        heads = lambda x, s=s, e=e: x[0, s:e].transpose(0, 1)  # noqa: E731
        qh, kh = (heads(x).repeat_interleave(HV // Hq, dim=0) for x in (q, k))
        if delta:
            plan = chunk_backward.delta_backward(
                qh, kh, heads(v), heads(beta), heads(g), heads(do), SCALE, h0[n], dht[n]
            )
            walk_starts, walk_ends = plan["starts"], plan["ends"]
        else:
            gk = heads(g) if per_key else heads(g)[..., None].expand(HV, e - s, K)
            walk_starts, _ = chunk_backward.state_walk(kh, heads(v), gk, h0[n], chunk)
            walk_ends, _ = chunk_backward.state_gradient_walk(qh, heads(do), gk, SCALE, dht[n], chunk)
        for c, (s_c, d_c) in enumerate(zip(walk_starts, walk_ends, strict=True)):
            starts[firsts[n] + c], ends[firsts[n] + c] = s_c.transpose(1, 2), d_c.transpose(1, 2)
    dq, dk, dv, dg, dbeta = chunk_backward.rows_backward(q, k, v, do, g, beta, starts, ends, index, SCALE, batch)

    tensors = [q, k, v, g] + ([beta] if delta else [])
    leaves = [x.clone().requires_grad_() for x in tensors]
    cu = torch.tensor(offsets)
    options = {"scale": SCALE, "initial_state": h0, "output_final_state": True, "cu_seqlens": cu}
    if variant == "gdn":
        o, ht = cula.gdn.chunk_gated_delta_rule(*leaves, **options)
    elif variant == "kda":
        o, ht = cula.kda.chunk_kda(*leaves, **options)
    elif variant == "gla":
        o, ht = cula.gla.chunk_gla(*leaves, **options)
    else:
        o, ht = cula.lightning.chunk_simple_gla(*leaves[:3], g=leaves[3], **options)
    torch.autograd.backward([o, ht], [do, dht])
    got = (dq, dk, dv, dg) + ((dbeta,) if delta else ())
    for name, have, leaf in zip(("dq", "dk", "dv", "dg", "dbeta"), got, leaves, strict=False):
        assert have.shape == leaf.shape, name
        for n, (s, e) in enumerate(zip(offsets[:-1], offsets[1:], strict=True)):
            if e > s:
                want = leaf.grad[:, s:e]
                err = ((have[:, s:e].double() - want).norm() / max(want.norm(), 1e-6)).item()
                # the plain variants' rows round their operands to bf16 as the kernels do; the delta rule's are exact
                assert err <= (1e-5 if delta else 5e-3), (name, n, err)


def plan_delta_backward(q, k, v, g, beta, do, scale, initial_state, dht, cu_seqlens, cu_seqlens_cpu, state_v_first):
    """The contract of cula.gdn.chunk_bwd_sm90.chunk_gdn_bwd_sm90 (g [B, T, HV]) and cula.kda.chunk_bwd_sm90.
    chunk_kda_bwd_sm90 (g [B, T, HV, K]) computed by the fp64 plan, sequence by sequence."""
    B, T, H, _ = q.shape
    HV = v.shape[2]
    offsets = [b * T for b in range(B + 1)] if cu_seqlens is None else cu_seqlens.tolist()
    flat = [x.reshape(B * T, *x.shape[2:]).double() for x in (q, k, v, g, beta, do)]
    out = [torch.zeros_like(x) for x in flat[:5]]
    dh0 = []
    for n, (s, e) in enumerate(zip(offsets[:-1], offsets[1:], strict=True)):
        h0 = None if initial_state is None else initial_state[n].double()
        ht = None if dht is None else dht[n].double()
        if e == s:
            dh0.append(torch.zeros(HV, K, V, dtype=torch.float64) if ht is None else ht)
            continue
        heads = [x[s:e].transpose(0, 1) for x in flat]
        qh, kh = (x.repeat_interleave(HV // H, dim=0) for x in heads[:2])
        plan = chunk_backward.delta_backward(qh, kh, heads[2], heads[4], heads[3], heads[5], scale, h0, ht)
        for i, name in enumerate(("dq", "dk", "dv", "dg", "dbeta")):
            x = plan[name].transpose(0, 1)
            if i < 2:
                x = x.view(e - s, H, HV // H, -1).sum(2)
            out[i][s:e] = x
        dh0.append(plan["dh0"])
    shaped = [x.view(B, T, *x.shape[1:]) for x in out]
    return (*shaped, torch.stack(dh0) if initial_state is not None else None)


@pytest.mark.parametrize("options", ["plain", "l2norm", "gate_and_sigmoid"])
@pytest.mark.parametrize("variant", ["gdn", "kda"])
def test_delta_rule_sm90_backward_chains_through_the_in_kernel_options(monkeypatch, variant, options):
    """GDN's and KDA's SM90 backward (cula.gdn / cula.kda .api._sm90_backward) with the kernel part replaced by the
    fp64 plan: the gradients of q, k, g, beta, A_log and dt_bias through the q / k L2 norm, the in-kernel gate (KDA's
    bounded one) and beta's sigmoid are the reference's autograd gradients."""
    import importlib

    api = importlib.import_module(f"cula.{variant}.api")
    chunk_bwd_sm90 = importlib.import_module(f"cula.{variant}.chunk_bwd_sm90")
    monkeypatch.setattr(chunk_bwd_sm90, f"chunk_{variant}_bwd_sm90", plan_delta_backward)
    torch.manual_seed(3)
    B, T, Hq, HV = 2, 70, 1, 2
    gated = options == "gate_and_sigmoid"
    keys = (K,) if variant == "kda" else ()  # KDA's gate per key channel
    args = {
        "q": torch.randn(B, T, Hq, K, dtype=torch.float64),
        "k": torch.randn(B, T, Hq, K, dtype=torch.float64),
        "v": torch.randn(B, T, HV, V, dtype=torch.float64),
        "g": F.logsigmoid(torch.randn(B, T, HV, *keys, dtype=torch.float64) + 2.0).clamp_min(-5.0),
        "beta": torch.rand(B, T, HV, dtype=torch.float64),
        "scale": SCALE, "initial_state": torch.randn(B, HV, K, V, dtype=torch.float64) * 0.1,
        "output_final_state": True, "use_qk_l2norm_in_kernel": options == "l2norm",
        "use_beta_sigmoid_in_kernel": gated, "allow_neg_eigval": False, "state_v_first": False, "cu_seqlens": None,
        "cu_seqlens_cpu": None, "use_gate_in_kernel": gated, "A_log": None, "dt_bias": None,
    }  # fmt: skip
    if variant == "kda":
        args.update(safe_gate=True, lower_bound=-5.0 if gated else None)
    args["k"] = args["k"] * 3.0 if options == "l2norm" else F.normalize(args["k"], dim=-1)
    if gated:
        args["g"] = torch.randn(B, T, HV, *keys, dtype=torch.float64)
        args["A_log"] = torch.rand(HV, dtype=torch.float64)
        args["dt_bias"] = torch.rand(HV * (K if keys else 1), dtype=torch.float64)
        args["beta"] = torch.randn(B, T, HV, dtype=torch.float64)
    grad_o = torch.randn(B, T, HV, V, dtype=torch.float64)
    grad_ht = torch.randn(B, HV, K, V, dtype=torch.float64) * 0.1
    got = api._sm90_backward(args, [], grad_o, grad_ht)

    names = [n for n in ("q", "k", "v", "g", "beta", "A_log", "dt_bias", "initial_state") if args[n] is not None]
    leaves = {n: args[n].clone().requires_grad_() for n in names}
    call = {n: a for n, a in args.items() if n not in ("cu_seqlens_cpu",)}
    entry_point = cula.kda.chunk_kda if variant == "kda" else cula.gdn.chunk_gated_delta_rule
    o, ht = entry_point(**{**call, **leaves})
    torch.autograd.backward([o, ht], [grad_o, grad_ht])
    for n in names:
        assert got[n].shape == leaves[n].shape, n
        err = ((got[n].double() - leaves[n].grad).norm() / leaves[n].grad.norm()).item()
        assert err <= 1e-6, (n, err)


@pytest.mark.parametrize("variant", ["gdn", "kda"])
@pytest.mark.parametrize(
    "lengths, v_first", [([0, 1, 130, 64, 200], False), (None, False), ([77, 0, 140], True)],
    ids=["varlen", "fixed", "varlen_v_first"],
)  # fmt: skip
def test_the_delta_rule_backward_host_paths_give_the_reference_gradients(monkeypatch, variant, lengths, v_first):
    """GDN's and KDA's SM90 backward (cula.gdn / cula.kda .chunk_bwd_sm90: the kernel's two walks through the
    delta rule's chain, then the per-chunk gradients by rows_backward), the walks' launch emulated on the CPU
    (tests/launch_emulation.py, with the kernels' bf16 operands): every gradient against the fp64 reference's
    autograd, per sequence, with GVA, h0 and a gradient into the final state, in either state layout."""
    from cula.sm90 import walks

    if variant == "gdn":
        from cula.gdn.chunk_bwd_sm90 import chunk_gdn_bwd_sm90 as backward

        entry_point = cula.gdn.chunk_gated_delta_rule
        monkeypatch.setenv("CULA_DELTA_GRADIENT_KERNEL", "0")
    else:
        from cula.kda.chunk_bwd_sm90 import chunk_kda_bwd_sm90 as backward

        entry_point = cula.kda.chunk_kda
        monkeypatch.setenv("CULA_KDA_GRADIENT_KERNEL", "0")
    monkeypatch.setattr(walks.entry, "launch", emulated_launch)
    torch.manual_seed(6)
    B, T = (1, sum(lengths)) if lengths else (2, 150)
    N, H, HV, D = (len(lengths) if lengths else B), 1, 2, 32
    q = torch.randn(B, T, H, D).bfloat16()
    k = F.normalize(torch.randn(B, T, H, D), dim=-1).bfloat16()
    v, do = (torch.randn(B, T, HV, D).bfloat16() for _ in range(2))
    if variant == "kda":  # the bounded form, 8 key channels at the bound
        g = -5.0 * torch.sigmoid(torch.randn(B, T, HV, D))
        g[..., :8] = -5.0
    else:
        g = F.logsigmoid(torch.randn(B, T, HV) + 2.0)
    beta = torch.rand(B, T, HV)
    h0, dht = torch.randn(N, HV, D, D) * 0.1, torch.randn(N, HV, D, D) * 0.1
    cu = None if lengths is None else torch.tensor(offsets_of(lengths), dtype=torch.int32)
    scale = D**-0.5
    dq, dk, dv, dg, dbeta, dh0 = backward(q, k, v, g, beta, do, scale, h0, dht, cu, cu, v_first)

    leaves = [x.double().requires_grad_() for x in (q, k, v, g, beta, h0)]
    o, ht = entry_point(
        *leaves[:5], scale=scale, initial_state=leaves[5], output_final_state=True, cu_seqlens=cu,
        state_v_first=v_first,
    )  # fmt: skip
    torch.autograd.backward([o, ht], [do.double(), dht.double()])
    bounds = sequence_bounds(B, T, lengths)
    assert_gradients_per_sequence((dq, dk, dv, dg, dh0), [*leaves[:4], leaves[5]], bounds, N)
    for n, (b, s, e) in enumerate(bounds):
        if e > s:
            assert rel_rmse(dbeta[b, s:e], leaves[4].grad[b, s:e]) <= 0.02, ("dbeta", n)


@pytest.mark.parametrize("fixed_length", [True, False])
@pytest.mark.parametrize("chunk", [64, 128])
def test_chunk_rows_hold_every_token_once_in_order(fixed_length, chunk):
    """The chunk rows of the backward's per-chunk passes: every token exactly once, each row a run of consecutive
    tokens from a chunk's start, at the row the state walks number that chunk with, padding after; for the SM90
    kernels' chunks of 64 and the SM100 kernel's 128."""
    import random

    random.seed(fixed_length)
    for _ in range(50):
        if fixed_length:
            B, T = random.randint(1, 4), random.randint(1, 300)
            offsets = [b * T for b in range(B + 1)]
        else:
            offsets = [0]
            for _ in range(random.randint(1, 8)):
                offsets.append(offsets[-1] + random.choice([0, 1, random.randint(0, 300)]))
            if offsets[-1] == 0:
                continue
        n_tokens = offsets[-1]
        index, rows, _ = chunk_backward.chunk_rows(offsets, fixed_length, chunk=chunk)
        assert index.shape[1] == chunk
        real = index[index < n_tokens]
        assert torch.equal(real.sort().values, torch.arange(n_tokens))
        firsts = chunk_backward.checkpoint_rows(offsets, fixed_length, chunk)
        for first, s, e in zip(firsts, offsets[:-1], offsets[1:], strict=True):
            for c in range(-(-(e - s) // chunk)):
                row = index[first + c]
                valid = min(chunk, e - s - chunk * c)
                assert torch.equal(row[:valid], torch.arange(s + chunk * c, s + chunk * c + valid))
                assert bool((row[valid:] == n_tokens).all())
        assert rows <= index.shape[0]


def emulated_scalar_gradient_kernel(launches: list, chunk: int):
    """A per-chunk gradient kernel of a scalar gate (cula.sm90.scalar_chunk_bwd, cula.sm100.scalar_chunk_bwd) as
    ``runtime.get_or_compile`` returns it, its launch on a CPU: :func:`emulate_chunk_rows` over rows of ``chunk``
    tokens with the kernels' roundings (cula.ops.chunk_backward.scalar_gated_rows: bf16 scores); each launch's
    chunk rows appended to ``launches``."""

    def launch(q, k, v, do, g, S, dS, chunks, dq, dk, dv, dg, scale):
        launches.append(chunks)

        def stages(qc, kc, vc, doc, gc, S_row, dS_row):
            return chunk_backward.scalar_gated_rows(qc, kc, vc, doc, gc, S_row, dS_row, scale)

        emulate_chunk_rows(chunks, (q, k, v, do, g), (dq, dk, dv, dg), S, dS, 1, stages, chunk)

    return launch


@pytest.mark.parametrize("passes", ["pytorch", "kernel"])
@pytest.mark.parametrize("D", [64, 128])
@pytest.mark.parametrize("lengths", [[0, 1, 130, 128, 300], None], ids=["varlen", "fixed"])
def test_the_sm100_backward_host_path_gives_the_reference_gradients(monkeypatch, lengths, D, passes):
    """Simple GLA's backward with the SM100 kernel's walks (cula.lightning.chunk_bwd_sm90 with SIMPLE_GLA_SM100:
    chunk rows and checkpoints of 128 tokens), then the per-chunk gradients by PyTorch rows or by the SM100 per-chunk
    kernel (CULA_CHUNK_GRADIENT_KERNEL), the launches emulated on the CPU: every gradient against the fp64
    reference's autograd, per sequence, at both head dims; the kernel launched on rows of 128 tokens."""
    from cula.lightning.chunk_bwd_sm90 import chunk_simple_gla_bwd_sm90
    from cula.lightning.chunk_fwd_sm100 import SIMPLE_GLA_SM100
    from cula.sm90 import walks

    monkeypatch.setattr(walks.entry, "launch", emulated_launch)
    monkeypatch.setenv("CULA_CHUNK_GRADIENT_KERNEL", "1" if passes == "kernel" else "0")
    monkeypatch.setattr(runtime, "device_arch", lambda device: "sm_100a")
    launches = []
    monkeypatch.setattr(runtime, "get_or_compile", lambda key, build: emulated_scalar_gradient_kernel(launches, 128))
    torch.manual_seed(3)
    B, T = (1, sum(lengths)) if lengths else (2, 200)
    N, H = (len(lengths) if lengths else B), 2
    q, k, v, do = (torch.randn(B, T, H, D).bfloat16() for _ in range(4))
    g = F.logsigmoid(torch.randn(B, T, H) + 3.0)
    h0, dht = torch.randn(N, H, D, D) * 0.1, torch.randn(N, H, D, D) * 0.1
    cu = None if lengths is None else torch.tensor(offsets_of(lengths), dtype=torch.int32)
    scale = D**-0.5
    got = chunk_simple_gla_bwd_sm90(q, k, v, g, do, scale, h0, dht, cu, cu, False, SIMPLE_GLA_SM100)

    leaves = [x.double().requires_grad_() for x in (q, k, v, g, h0)]
    options = {"scale": scale, "initial_state": leaves[4], "output_final_state": True}
    o, ht = cula.lightning.chunk_simple_gla(*leaves[:3], g=leaves[3], cu_seqlens=cu, **options)
    torch.autograd.backward([o, ht], [do.double(), dht.double()])
    bounds = sequence_bounds(B, T, lengths)
    assert_gradients_per_sequence(got, leaves, bounds, N)
    if passes == "kernel":
        (chunks,) = launches
        assert int(chunks[:, 1].max()) == 128 and int(chunks[:, 1].sum()) == B * T


@pytest.mark.parametrize("passes", ["pytorch", "kernel"])
@pytest.mark.parametrize(
    "lengths, states", [([0, 1, 130, 64, 200], True), (None, True), (None, False)], ids=["varlen", "fixed", "no_states"]
)
def test_the_gla_backward_host_path_gives_the_reference_gradients(monkeypatch, lengths, states, passes):
    """GLA's backward (cula.gla.chunk_bwd_sm90: its kernel's state walks, then the per-chunk gradients by
    rows_backward with the per-key gate, or by the per-chunk kernel, CULA_KEY_GRADIENT_KERNEL), the launches
    emulated on the CPU (tests/launch_emulation.py; the kernel's with its bf16 roundings): every gradient against
    the fp64 reference's autograd, per sequence, gates steep in places; with h0 and a gradient into the final
    state, or neither."""
    from cula.gla.chunk_bwd_sm90 import chunk_gla_bwd_sm90
    from cula.sm90 import walks

    monkeypatch.setattr(walks.entry, "launch", emulated_launch)
    monkeypatch.setenv("CULA_KEY_GRADIENT_KERNEL", "1" if passes == "kernel" else "0")
    monkeypatch.setattr(runtime, "device_arch", lambda device: "sm_90a")
    monkeypatch.setattr(runtime, "get_or_compile", lambda key, build: rounding_key_gradient_kernel)
    torch.manual_seed(5)
    B, T = (1, sum(lengths)) if lengths else (2, 150)
    N, H, D = (len(lengths) if lengths else B), 2, 64
    q, k, v, do = (torch.randn(B, T, H, D).bfloat16() for _ in range(4))
    g = F.logsigmoid(torch.randn(B, T, H, D) + 2.0)
    g[:, T // 2, :, :8] = -30.0
    h0, dht = (torch.randn(N, H, D, D) * 0.1, torch.randn(N, H, D, D) * 0.1) if states else (None, None)
    cu = None if lengths is None else torch.tensor(offsets_of(lengths), dtype=torch.int32)
    scale = D**-0.5
    got = chunk_gla_bwd_sm90(q, k, v, g, do, scale, h0, dht, cu, cu, False)
    assert (got[4] is None) == (not states)

    leaves = [x.double().requires_grad_() for x in (q, k, v, g)] + ([h0.double().requires_grad_()] if states else [])
    options = {"scale": scale, "initial_state": leaves[4] if states else None, "cu_seqlens": cu}
    o, ht = cula.gla.chunk_gla(*leaves[:4], output_final_state=states, **options)
    outputs, cotangents = ([o, ht], [do.double(), dht.double()]) if states else ([o], [do.double()])
    torch.autograd.backward(outputs, cotangents)
    bounds = sequence_bounds(B, T, lengths)
    assert_gradients_per_sequence(got, leaves, bounds, N)


@pytest.mark.parametrize("D", [64, 128])
@pytest.mark.parametrize("lengths", [[0, 1, 130, 128, 300], None], ids=["varlen", "fixed"])
def test_the_gla_sm100_backward_host_path_gives_the_reference_gradients(monkeypatch, lengths, D):
    """GLA's backward with the SM100 kernel's walks (cula.gla.chunk_bwd_sm90 with GLA_SM100: chunk rows and
    checkpoints of 128 tokens, the per-chunk gradients by rows_backward), the walks' launch emulated on the CPU:
    every gradient against the fp64 reference's autograd, per sequence, at both head dims, gates steep in places."""
    from cula.gla.chunk_bwd_sm90 import chunk_gla_bwd_sm90
    from cula.gla.chunk_fwd_sm100 import GLA_SM100
    from cula.sm90 import walks

    monkeypatch.setattr(walks.entry, "launch", emulated_launch)
    torch.manual_seed(6)
    B, T = (1, sum(lengths)) if lengths else (2, 200)
    N, H = (len(lengths) if lengths else B), 2
    q, k, v, do = (torch.randn(B, T, H, D).bfloat16() for _ in range(4))
    g = F.logsigmoid(torch.randn(B, T, H, D) + 2.0)
    g[:, T // 2, :, :8] = -30.0
    h0, dht = torch.randn(N, H, D, D) * 0.1, torch.randn(N, H, D, D) * 0.1
    cu = None if lengths is None else torch.tensor(offsets_of(lengths), dtype=torch.int32)
    scale = D**-0.5
    got = chunk_gla_bwd_sm90(q, k, v, g, do, scale, h0, dht, cu, cu, False, GLA_SM100)

    leaves = [x.double().requires_grad_() for x in (q, k, v, g, h0)]
    o, ht = cula.gla.chunk_gla(
        *leaves[:4], scale=scale, initial_state=leaves[4], output_final_state=True, cu_seqlens=cu
    )  # fmt: skip
    torch.autograd.backward([o, ht], [do.double(), dht.double()])
    assert_gradients_per_sequence(got, leaves, sequence_bounds(B, T, lengths), N)


def assert_gradients_per_sequence(got, leaves, bounds, N):
    """``got`` (dq, dk, dv, dg[, dh0]) against the ``leaves``' fp64 autograd gradients, per sequence (``bounds``:
    (batch row, first token, end) each): rel RMSE <= 0.008, dg's <= 0.02."""
    names = ("dq", "dk", "dv", "dg", "dh0")[: len(leaves)]
    for name, have, leaf in zip(names, got[: len(leaves)], leaves, strict=True):
        want = leaf.grad
        if name == "dh0":
            for n in range(N):
                assert rel_rmse(have[n], want[n]) <= 0.008, (name, n)
            continue
        for n, (b, s, e) in enumerate(bounds):
            if e > s:
                assert rel_rmse(have[b, s:e], want[b, s:e]) <= (0.02 if name == "dg" else 0.008), (name, n)


@pytest.mark.parametrize("block", [16, 7])
def test_key_gated_products_by_blocks_equal_the_pair_factors(block):
    """The per-key gate's intra-chunk products by row blocks against a reference token (chunk_backward.
    key_gated_products) equal the products with every pair's factor e^(G_i - G_j) taken whole, in fp64, with gates
    steep enough that e^-G alone would overflow (-200 per token on some keys, -30 on all)."""
    N, L, K = 4, 64, 32
    q, k = torch.randn(N, L, K, dtype=torch.float64), torch.randn(N, L, K, dtype=torch.float64)
    g = F.logsigmoid(torch.randn(N, L, K, dtype=torch.float64) + 2.0)
    g[:, 20, :10] = -200.0
    g[:, 40] = -30.0
    G = g.cumsum(1)
    dP = torch.randn(N, L, L, dtype=torch.float64).tril()
    gamma = chunk_backward._pair_factors(G, strict=False)
    want = (
        torch.einsum("nik,njk,nijk->nij", q, k, gamma),
        torch.einsum("nij,nijk,njk->nik", dP, gamma, k),
        torch.einsum("nij,nijk,nik->njk", dP, gamma, q),
    )
    got = chunk_backward.key_gated_products(q, k, dP, G, 1.0, block)
    for name, have, ref in zip(("P", "dq", "dk"), got, want, strict=True):
        assert torch.isfinite(have).all(), name
        assert ((have - ref).norm() / ref.norm()).item() <= 1e-12, name


@pytest.mark.parametrize("gates", ["layer", "steep"])
def test_key_delta_rows_equal_the_delta_rules_chunk_plan(gates):
    """The per-key delta rule's batched rows (chunk_backward.key_delta_rows, every pair factor's sum by
    key_gated_products) equal delta_chunk_forward / delta_chunk_backward with the [C, C, K] factors whole, in fp64, on
    whole and cut chunks, with KDA's gates (>= -5) or steeper ones (-30 on all keys of a token, -200 on some)."""
    torch.manual_seed(9)
    N, C, D = 6, 64, 16
    valid = [64, 64, 1, 37, 64, 50]
    q, k = torch.randn(N, C, D, dtype=torch.float64), F.normalize(torch.randn(N, C, D, dtype=torch.float64), dim=-1)
    v, do = torch.randn(N, C, D, dtype=torch.float64), torch.randn(N, C, D, dtype=torch.float64)
    beta = torch.rand(N, C, dtype=torch.float64)
    g = F.logsigmoid(torch.randn(N, C, D, dtype=torch.float64) + 2.0).clamp_min(-5.0)
    if gates == "steep":
        g[:, 20] = -30.0
        g[::2, 40, :5] = -200.0
    inside = (torch.arange(C)[None, :] < torch.tensor(valid)[:, None]).double()
    q, k, v, do = (x * inside[..., None] for x in (q, k, v, do))
    beta, g = beta * inside, g * inside[..., None]
    S, dS = torch.randn(N, D, D, dtype=torch.float64) * 0.3, torch.randn(N, D, D, dtype=torch.float64) * 0.3
    got = chunk_backward.key_delta_rows(q, k, v, beta, g, S, dS, do, 0.25)
    f = chunk_backward.delta_chunk_forward(q, k, v, beta, g, S, 0.25)
    want = chunk_backward.delta_chunk_backward(q, k, v, beta, f, S, dS, do, 0.25)
    want_dg = want["dG"].flip(1).cumsum(1).flip(1)
    for name, have, ref in zip(
        ("dq", "dk", "dv", "dbeta", "dg"), got, (*(want[n] for n in ("dq", "dk", "dv", "dbeta")), want_dg), strict=True
    ):
        assert torch.isfinite(have).all(), name
        assert ((have - ref).norm() / ref.norm()).item() <= 1e-10, name


@pytest.mark.parametrize("gates", ["layer", "steepest"])
def test_two_reference_products_equal_the_blocks_under_the_bound(gates):
    """chunk_backward.two_reference_products (two reference tokens per chunk, plain matrix products) on fp32 inputs
    equals key_gated_products (16-token blocks, any gate) in fp64 for gates >= BOUNDED_GATE, -5 on every token and key
    of a chunk-head included, with gradients and inputs large enough that fp32 products would overflow (|dM| 1e4,
    |x| 10: a gradient product's sum reaches e^80 |dM| |x|); and key_delta_rows's gradients are the same with either."""
    torch.manual_seed(10)
    N, C, D = 4, 64, 16
    x, k = 10 * torch.randn(N, C, D, dtype=torch.float64), torch.randn(N, C, D, dtype=torch.float64)
    dM = 1e4 * torch.randn(N, C, C, dtype=torch.float64).tril()
    g = F.logsigmoid(torch.randn(N, C, D, dtype=torch.float64) + 2.0).clamp_min(chunk_backward.BOUNDED_GATE)
    if gates == "steepest":
        g[0] = chunk_backward.BOUNDED_GATE
    G = g.cumsum(1)
    got = chunk_backward.two_reference_products(*(t.float() for t in (x, k, dM, G)), 0.3)
    want = chunk_backward.key_gated_products(x, k, dM, G, 0.3)
    for name, a, b in zip(("P", "dx", "dk"), got, want, strict=True):
        assert a.dtype == torch.float32 and torch.isfinite(a).all(), name
        assert rel_rmse(a, b) <= 1e-6, (name, rel_rmse(a, b))
    rows = key_delta_chunk_inputs(4, 64, 16, gates, [64, 1, 37, 64])
    bounded = chunk_backward.key_delta_rows(*rows, 0.3, products=chunk_backward.two_reference_products)
    for name, a, b in zip(
        ("dq", "dk", "dv", "dbeta", "dg"), bounded, chunk_backward.key_delta_rows(*rows, 0.3), strict=True
    ):
        assert rel_rmse(a, b) <= 1e-10, name


def delta_chunk_inputs(N, C, K, V, gates, valid, dtype=torch.float64):
    """Chunk-heads as scalar_delta_rows takes them, the tokens past each one's ``valid`` zero (a sequence's end)."""
    q, k = torch.randn(N, C, K, dtype=dtype), F.normalize(torch.randn(N, C, K, dtype=dtype), dim=-1)
    v, do = torch.randn(N, C, V, dtype=dtype), torch.randn(N, C, V, dtype=dtype)
    beta = torch.rand(N, C, dtype=dtype)
    g = F.logsigmoid(torch.randn(N, C, dtype=dtype) + 3) if gates == "layer" else -5 * torch.rand(N, C, dtype=dtype)
    inside = (torch.arange(C)[None, :] < torch.tensor(valid)[:, None]).to(dtype)
    q, k, v, do = (x * inside[..., None] for x in (q, k, v, do))
    beta, g = beta * inside, g * inside
    S, dS = torch.randn(N, K, V, dtype=dtype) * 0.5, torch.randn(N, K, V, dtype=dtype) * 0.5
    return q, k, v, beta, g, S, dS, do


def test_the_delta_gradient_kernels_stages_are_the_plans_algebra():
    """The delta rule's per-chunk gradient kernel (cula.sm90.delta_chunk_bwd), emulated stage by stage with exact
    operands (cula.ops.chunk_emulation.delta_chunk_gradients: its factoring of T, dT, the pair terms and the gate's
    row sums), equals the plan's per-chunk gradients (scalar_delta_rows) to rounding, on whole and cut chunks."""
    torch.manual_seed(5)
    x = delta_chunk_inputs(4, 64, 16, 8, "layer", [64, 1, 37, 0])
    want = chunk_backward.scalar_delta_rows(*x, 0.3)
    got = chunk_emulation.delta_chunk_gradients(*x, 0.3, operand=lambda t: t)
    for name, a, b in zip(("dq", "dk", "dv", "dbeta", "dg"), got, want, strict=True):
        assert rel_rmse(a, b) <= 1e-12, name


@pytest.mark.parametrize("gates", ["layer", "steep"])
def test_the_delta_gradient_kernels_roundings_hold_the_bf16_tolerances(gates):
    """With the kernel's bf16 roundings (its wgmma operands and stored tiles: T, T diag(beta), 2^G K, W, V', dV', dW,
    dT, X, dA_b, the masked scores) each chunk-head's gradients stay within the bf16 tolerances of the exact ones."""
    torch.manual_seed(6)
    x = delta_chunk_inputs(8, 64, 128, 128, gates, [64] * 6 + [40, 3])
    want = chunk_backward.scalar_delta_rows(*x, 128**-0.5)
    got = chunk_emulation.delta_chunk_gradients(*(t.float() for t in x), 128**-0.5)
    assert_each_chunk_head_within_bf16_tolerances(got, want)


def assert_each_chunk_head_within_bf16_tolerances(got, want):
    """Each chunk-head's (dq, dk, dv, dbeta, dg) within rel RMSE 0.008 of the exact ones (dbeta and dg 0.02)."""
    tolerances = (0.008, 0.008, 0.008, 0.02, 0.02)
    for name, a, b, tol in zip(("dq", "dk", "dv", "dbeta", "dg"), got, want, tolerances, strict=True):
        for n in range(b.shape[0]):
            assert rel_rmse(a[n], b[n]) <= tol, (name, n, rel_rmse(a[n], b[n]))


def key_delta_chunk_inputs(N, C, K, gates, valid, dtype=torch.float64):
    """delta_chunk_inputs with a per-key gate within KDA's bound (>= -5): a layer's, or -5 on a quarter of the keys of
    every token (the two-reference operands' widest exponent, 16 x 5 log2(e)), or ("bounded") KDA's safe gate
    -5 sigmoid(x) (about -2.5 on average: most of a chunk's pair factors are tiny, so that dg is small beside the
    sums it is the difference of) with a quarter of the keys at -5."""
    q, k, v, beta, _, S, dS, do = delta_chunk_inputs(N, C, K, K, "layer", valid, dtype)
    g = F.logsigmoid(torch.randn(N, C, K, dtype=dtype) + 2.0).clamp_min(-5.0)
    if gates == "bounded":
        g = -5.0 * torch.sigmoid(torch.randn(N, C, K, dtype=dtype))
    if gates in ("steepest", "bounded"):
        g[:, :, : K // 4] = -5.0
    inside = (torch.arange(C)[None, :] < torch.tensor(valid)[:, None]).to(dtype)
    return q, k, v, beta, g * inside[..., None], S, dS, do


@pytest.mark.parametrize("slab", [16, 8])
@pytest.mark.parametrize("gates", ["layer", "steepest"])
def test_the_kda_gradient_plans_stages_are_the_algebra(gates, slab):
    """KDA's per-chunk gradient kernel emulated (cula.ops.chunk_emulation.key_delta_chunk_gradients: the delta
    kernel's stages with every pair-factor sum by two reference tokens per chunk, the value columns in slabs whose
    partial gradients are summed), with exact operands, equals the per-key delta rule's per-chunk gradients
    (key_delta_rows) to rounding, on whole and cut chunks, in one slab or two."""
    torch.manual_seed(7)
    x = key_delta_chunk_inputs(4, 64, 16, gates, [64, 1, 37, 0])
    want = chunk_backward.key_delta_rows(*x, 0.3)
    got = chunk_emulation.key_delta_chunk_gradients(*x, 0.3, operand=lambda t: t, slab=slab)
    for name, a, b in zip(("dq", "dk", "dv", "dbeta", "dg"), got, want, strict=True):
        assert torch.isfinite(a).all(), name
        assert rel_rmse(a, b) <= 1e-10, (name, rel_rmse(a, b))


@pytest.mark.parametrize("gates", ["layer", "steepest", "bounded"])
def test_the_kda_gradient_kernels_roundings_hold_the_bf16_tolerances(gates):
    """With bf16 wgmma operands (the two-reference factors L and R, T, W, V', dV', dW, dT, X, dP, dA_b) and fp32
    accumulation, each chunk-head's gradients stay within the bf16 tolerances of the exact ones on the same bf16
    tokens and checkpoints (the kernel's inputs) at D = 128, KDA's steepest gates included: the plan needs no steep
    path under safe_gate. On KDA's safe gates dg holds only because each pair enters its local term through the same
    rounded operands from both sides (with dq and dk's own operands, 0.07 to 0.12)."""
    torch.manual_seed(8)
    q, k, v, beta, g, S, dS, do = key_delta_chunk_inputs(8, 64, 128, gates, [64] * 6 + [40, 3])
    x = (*(bf16(t).double() for t in (q, k, v)), beta, g, *(bf16(t).double() for t in (S, dS, do)))
    want = chunk_backward.key_delta_rows(*x, 128**-0.5)
    got = chunk_emulation.key_delta_chunk_gradients(*(t.float() for t in x), 128**-0.5)
    assert_each_chunk_head_within_bf16_tolerances(got, want)


def emulate_chunk_rows(chunks, inputs, outputs, S, dS, value_heads_per_head, gradients, chunk=chunk_backward.CHUNK):
    """A per-chunk gradient kernel's launch on a CPU: per chunk row (its first flattened token and valid tokens) and
    value head hv, ``gradients(*chunk inputs [1, C, ...], S^T row, dS'^T row)`` (the kernel's stages, emulated) on
    the row's tokens of ``inputs`` ([B, T, heads, ...]: q and k read at head hv // ``value_heads_per_head``, the rest
    at hv) padded with zeros to ``chunk`` tokens, the gate (the last input) floored as the kernel loads it; its
    results' valid rows to ``outputs`` per value head."""
    C = chunk
    B, T, HV = inputs[2].shape[:3]
    flat = [x.reshape(B * T, *x.shape[2:]).float() for x in inputs]
    outs = [x.view(B * T, *x.shape[2:]) for x in outputs]
    for row, (first, valid) in enumerate(chunks.tolist()):
        tokens = torch.arange(first, first + valid)
        for hv in range(HV):
            padded = []
            for n, x in enumerate(flat):
                chunk = x.new_zeros(C, *x.shape[2:])
                chunk[:valid] = x[tokens, hv // value_heads_per_head if n < 2 else hv]
                padded.append(chunk[None])
            inside = (torch.arange(C) < valid).view(1, C, *([1] * (padded[-1].dim() - 2)))
            padded[-1] = torch.where(inside, padded[-1].clamp_min(chunk_emulation.GATE_FLOOR), 0.0)
            grads = gradients(*padded, *(x[row, hv].float().T[None] for x in (S, dS)))
            for out, grad in zip(outs, grads, strict=True):
                out[tokens, hv] = grad[0, :valid].to(out.dtype)


def delta_host_inputs(lengths, per_key_gate: bool) -> tuple:
    """A delta-rule backward's per-chunk inputs on the CPU for a host test, seeded: a varlen batch of ``lengths`` or
    (None) two rows of 100 tokens, H = 1, HV = 2, D = 16; GDN's gate per head or KDA's bounded one per key; random
    checkpoints. Returns ``(index, chunks, q, k, v, do, g, beta, starts, ends)``."""
    torch.manual_seed(4)
    B, T = (1, sum(lengths)) if lengths else (2, 100)
    H, HV, D = 1, 2, 16
    offsets = offsets_of(lengths) if lengths else [0, T, 2 * T]
    index, rows, chunks = chunk_backward.chunk_rows(offsets, lengths is None)
    q, k = torch.randn(B, T, H, D), F.normalize(torch.randn(B, T, H, D), dim=-1)
    v, do = torch.randn(B, T, HV, D), torch.randn(B, T, HV, D)
    if per_key_gate:
        g = F.logsigmoid(torch.randn(B, T, HV, D) + 2.0).clamp_min(-5.0)
    else:
        g = F.logsigmoid(torch.randn(B, T, HV) + 3.0)
    beta = torch.rand(B, T, HV)
    starts, ends = (torch.randn(max(rows, 1), HV, D, D) * 0.3 for _ in range(2))
    return index, chunks, q, k, v, do, g, beta, starts, ends


def emulated_delta_gradient_kernel(q, k, v, do, g, beta, S, dS, chunks, dq, dk, dv, dbeta, dg, scale):
    """cula.sm90.delta_chunk_bwd's launch on a CPU (:func:`emulate_chunk_rows` with the kernel's stages,
    cula.ops.chunk_emulation.delta_chunk_gradients, exact operands); outputs per value head."""

    def stages(qc, kc, vc, doc, bc, gc, S_row, dS_row):
        return chunk_emulation.delta_chunk_gradients(qc, kc, vc, bc, gc, S_row, dS_row, doc, scale, operand=lambda t: t)

    rep = v.shape[2] // q.shape[2]
    emulate_chunk_rows(chunks, (q, k, v, do, beta, g), (dq, dk, dv, dbeta, dg), S, dS, rep, stages)


@pytest.mark.parametrize("lengths", [[0, 1, 130, 64, 77], None], ids=["varlen", "fixed"])
def test_the_delta_gradient_kernels_host_gives_the_rows_gradients(monkeypatch, lengths):
    """GDN's per-chunk gradients by the kernel's host (cula.gdn.chunk_bwd_sm90.delta_chunk_gradients_sm90: the chunk
    rows' first tokens and lengths, outputs per value head summed over each GVA group, gates below the floor taking no
    gradient), its launch emulated on the CPU, equal the PyTorch passes (rows_backward) on the same checkpoints."""
    from cula.gdn import chunk_bwd_sm90

    monkeypatch.setattr(runtime, "device_arch", lambda device: "sm_90a")
    monkeypatch.setattr(runtime, "get_or_compile", lambda key, build: emulated_delta_gradient_kernel)
    index, chunks, q, k, v, do, g, beta, starts, ends = delta_host_inputs(lengths, per_key_gate=False)
    g[0, 3] = -1e4  # below the floor: no gradient
    got = chunk_bwd_sm90.delta_chunk_gradients_sm90(
        q, k, v, do, g, beta, starts, ends, chunks, 0.25, lengths is not None
    )
    want = chunk_backward.rows_backward(q, k, v, do, g, beta, starts, ends, index, 0.25)
    for name, a, b in zip(("dq", "dk", "dv", "dg", "dbeta"), got, want, strict=True):
        assert rel_rmse(a, b) <= 1e-5, (name, rel_rmse(a, b))
    assert got[3][0, 3].eq(0).all()


def emulated_key_delta_gradient_kernel(q, k, v, do, g, beta, S, dS, chunks, dq, dk, dv, dbeta, dg, scale):
    """cula.sm90.key_delta_chunk_bwd's launch on a CPU: per slab of value columns (``cula.kda.chunk_bwd_sm90.SLAB``
    wide), :func:`emulate_chunk_rows` with the kernel's stages (cula.ops.chunk_emulation.key_delta_slab_gradients,
    exact operands) on the slab's columns of v, dO and the checkpoints; slab s's dq, dk, dbeta and dg to rows
    s B .. of theirs, its dv to its columns."""
    from cula.kda import chunk_bwd_sm90

    def stages(qc, kc, vc, doc, bc, gc, S_row, dS_row):
        return chunk_emulation.key_delta_slab_gradients(
            qc, kc, vc, bc, gc, S_row, dS_row, doc, scale, operand=lambda t: t
        )  # fmt: skip

    B, D = q.shape[0], v.shape[-1]
    width = chunk_bwd_sm90.SLAB
    for s, c in enumerate(range(0, D, width)):
        cols, rows = slice(c, c + width), slice(s * B, (s + 1) * B)
        dv_slab = torch.zeros_like(dv[..., cols])
        inputs = (q, k, v[..., cols], do[..., cols], beta, g)
        outputs = (dq[rows], dk[rows], dv_slab, dbeta[rows], dg[rows])
        emulate_chunk_rows(chunks, inputs, outputs, S[:, :, cols], dS[:, :, cols], v.shape[2] // q.shape[2], stages)
        dv[..., cols] = dv_slab


@pytest.mark.parametrize("slab", [8, 16], ids=["two slabs", "one slab"])
@pytest.mark.parametrize("lengths", [[0, 1, 130, 64, 77], None], ids=["varlen", "fixed"])
def test_the_kda_gradient_kernels_host_gives_the_rows_gradients(monkeypatch, lengths, slab):
    """KDA's per-chunk gradients by the kernel's host (cula.kda.chunk_bwd_sm90.key_delta_chunk_gradients_sm90: the
    chunk rows' first tokens and lengths, a CTA per slab of value columns whose parts of dq, dk, dbeta and dg it
    sums, then dq and dk over each GVA group), its launch emulated on the CPU in two slabs or one, equal the PyTorch
    passes (rows_backward with KDA's bounded gate) on the same checkpoints."""
    from cula.kda import chunk_bwd_sm90

    monkeypatch.setattr(runtime, "device_arch", lambda device: "sm_90a")
    monkeypatch.setattr(runtime, "get_or_compile", lambda key, build: emulated_key_delta_gradient_kernel)
    monkeypatch.setattr(chunk_bwd_sm90, "SLAB", slab)
    index, chunks, q, k, v, do, g, beta, starts, ends = delta_host_inputs(lengths, per_key_gate=True)
    got = chunk_bwd_sm90.key_delta_chunk_gradients_sm90(
        q, k, v, do, g, beta, starts, ends, chunks, 0.25, lengths is not None
    )
    want = chunk_backward.rows_backward(q, k, v, do, g, beta, starts, ends, index, 0.25, bounded_gate=True)
    for name, a, b in zip(("dq", "dk", "dv", "dg", "dbeta"), got, want, strict=True):
        assert rel_rmse(a, b) <= 1e-5, (name, rel_rmse(a, b))


def key_chunk_inputs(N, C, K, gates, valid):
    """Chunk-heads as chunk_gradients takes them (fp64), the tokens past each one's ``valid`` zero; per-key gates of a
    layer (mild), or steep in some chunk-heads' channels (past the kernel's SAFE_SPAN), -200 on a few tokens."""
    q, k, v, do = (torch.randn(N, C, K, dtype=torch.float64) for _ in range(4))
    g = F.logsigmoid(torch.randn(N, C, K, dtype=torch.float64) + 2.0)
    if gates == "steep":
        g[::2, :, :5] = -6.0 + torch.rand(N // 2 + N % 2, C, 5, dtype=torch.float64)
        g[1, 10, 3] = -200.0
    inside = (torch.arange(C)[None, :] < torch.tensor(valid)[:, None]).to(torch.float64)[..., None]
    q, k, v, do, g = (x * inside for x in (q, k, v, do, g))
    S, dS = torch.randn(N, K, K, dtype=torch.float64) * 0.5, torch.randn(N, K, K, dtype=torch.float64) * 0.5
    return q, k, v, do, g, S, dS


def test_the_key_gradient_kernels_paths_are_the_plans_algebra(monkeypatch):
    """GLA's per-chunk gradient kernel (cula.sm90.key_chunk_bwd), emulated with exact operands (cula.ops.
    chunk_emulation.key_chunk_gradients: the fast path's reference-token products and per-key column factors, the
    steep path's direct sums), equals the plan's per-chunk gradients (chunk_gradients, its roundings taken out) to
    rounding, on whole and cut chunks of both paths."""
    torch.manual_seed(7)
    x = key_chunk_inputs(6, 64, 16, "steep", [64, 64, 1, 37, 64, 0])
    G = x[4].cumsum(1) * chunk_emulation.LOG2E
    widest = torch.maximum(G[:, 0] - G[:, 32], G[:, 32] - G[:, -1]).amax(-1)
    assert bool((widest > chunk_emulation.GLA_SAFE_SPAN).any()) and bool(
        (widest <= chunk_emulation.GLA_SAFE_SPAN).any()
    )
    got = chunk_emulation.key_chunk_gradients(*x, 0.3, operand=lambda t: t)
    monkeypatch.setattr(chunk_backward, "bf16", lambda t: t)
    want = chunk_backward.chunk_gradients(*x, 0.3)
    for name, a, b in zip(("dq", "dk", "dv", "dg"), got, want, strict=True):
        assert torch.isfinite(a).all(), name
        for n in range(b.shape[0]):
            if b[n].norm() > 0:
                assert rel_rmse(a[n], b[n]) <= 1e-12, (name, n)


@pytest.mark.parametrize("gates", ["layer", "steep"])
def test_the_key_gradient_kernels_roundings_hold_the_bf16_tolerances(monkeypatch, gates):
    """With the kernel's bf16 roundings (its wgmma operands: q, k, v, dO, the checkpoints, Q_L, K_R, K_F, dA and P^T)
    each chunk-head's gradients stay within the bf16 tolerances of the exact ones."""
    torch.manual_seed(8)
    x = key_chunk_inputs(8, 64, 128, gates, [64] * 6 + [40, 3])
    got = chunk_emulation.key_chunk_gradients(*(t.float() for t in x), 128**-0.5)
    monkeypatch.setattr(chunk_backward, "bf16", lambda t: t)
    want = chunk_backward.chunk_gradients(*x, 128**-0.5)
    for name, a, b, tol in zip(("dq", "dk", "dv", "dg"), got, want, (0.008, 0.008, 0.008, 0.02), strict=True):
        for n in range(b.shape[0]):
            assert rel_rmse(a[n], b[n]) <= tol, (name, n, rel_rmse(a[n], b[n]))


def emulated_key_gradient_kernel(q, k, v, do, g, S, dS, chunks, dq, dk, dv, dg, scale, operand=lambda t: t):
    """cula.sm90.key_chunk_bwd's launch on a CPU (:func:`emulate_chunk_rows` with cula.ops.chunk_emulation.
    key_chunk_gradients, exact operands unless ``operand`` rounds), gates below the floor taking no gradient as the
    kernel's scan gives them."""

    def kernel(qc, kc, vc, doc, gc, S_row, dS_row):
        return chunk_emulation.key_chunk_gradients(qc, kc, vc, doc, gc, S_row, dS_row, scale, operand=operand)

    emulate_chunk_rows(chunks, (q, k, v, do, g), (dq, dk, dv, dg), S, dS, 1, kernel)
    dg.masked_fill_(g < chunk_emulation.GATE_FLOOR, 0.0)


def rounding_key_gradient_kernel(*args):
    """:func:`emulated_key_gradient_kernel` with the kernel's bf16 operands."""
    emulated_key_gradient_kernel(*args, operand=bf16)


@pytest.mark.parametrize("lengths", [[0, 1, 130, 64, 77], None], ids=["varlen", "fixed"])
def test_the_key_gradient_kernels_host_gives_the_rows_gradients(monkeypatch, lengths):
    """GLA's per-chunk gradients by the kernel's host (cula.gla.chunk_bwd_sm90.key_chunk_gradients_sm90: the chunk
    rows' first tokens and lengths, gates below the floor taking no gradient), its launch emulated on the CPU, equal
    the PyTorch passes (rows_backward) on the same checkpoints."""
    from cula.gla import chunk_bwd_sm90

    monkeypatch.setattr(runtime, "device_arch", lambda device: "sm_90a")
    monkeypatch.setattr(runtime, "get_or_compile", lambda key, build: emulated_key_gradient_kernel)
    torch.manual_seed(9)
    B, T = (1, sum(lengths)) if lengths else (2, 100)
    H, D = 2, 16
    offsets = offsets_of(lengths) if lengths else [0, T, 2 * T]
    index, rows, chunks = chunk_backward.chunk_rows(offsets, lengths is None)
    q, k, v, do = (torch.randn(B, T, H, D) for _ in range(4))
    g = F.logsigmoid(torch.randn(B, T, H, D) + 2.0)
    g[0, 3, 1] = -1e4  # below the floor: no gradient
    g[0, 40:60, 0, :3] = -8.0  # a steep chunk
    starts, ends = (torch.randn(max(rows, 1), H, D, D) * 0.3 for _ in range(2))
    got = chunk_bwd_sm90.key_chunk_gradients_sm90(q, k, v, do, g, starts, ends, chunks, 0.25, lengths is not None)
    monkeypatch.setattr(chunk_backward, "bf16", lambda t: t)  # exact operands, as the emulated kernel's
    want = chunk_backward.rows_backward(q, k, v, do, g, None, starts, ends, index, 0.25)
    assert got[4] is None
    for name, a, b in zip(("dq", "dk", "dv", "dg"), got[:4], want[:4], strict=True):
        assert rel_rmse(a, b) <= 1e-5, (name, rel_rmse(a, b))
    assert got[3][0, 3, 1].eq(0).all()


def test_the_forward_walk_runs_beside_the_reverse_one(monkeypatch):
    """``walks.both_walks`` launches the "states" walk on the side stream (``walks.side_by_side``), into outputs made
    before it, and the "state_grads" walk on the caller's stream before the block joins the two."""
    import contextlib

    from cula.lightning.chunk_fwd_sm90 import SIMPLE_GLA_SM90
    from cula.sm90 import walks

    log = []

    @contextlib.contextmanager
    def on_side():
        log.append("on side")
        yield
        log.append("off side")

    @contextlib.contextmanager
    def recording_side_by_side(device):
        yield on_side
        log.append("join")

    def recording_walk(kernel, walk, *args, out=None):
        log.append(f"{walk}{' into out' if out is not None else ''}")
        return walks.walk_outputs(args[0], args[2], None, 2)

    monkeypatch.setattr(walks, "side_by_side", recording_side_by_side)
    monkeypatch.setattr(walks, "state_walk", recording_walk)
    x = torch.zeros(1, 100, 2, 64, dtype=torch.bfloat16)
    gate = torch.zeros(1, 100, 2)
    walks.both_walks(SIMPLE_GLA_SM90, x, x, x, x, gate, gate, 1.0, None, None, None, None, False)
    assert log == ["on side", "states into out", "off side", "state_grads", "join"]


def test_side_by_side_forks_and_joins_the_callers_stream(monkeypatch):
    """On a GPU, ``walks.side_by_side``: the side stream waits for the caller's stream, ``on_side`` runs its launches
    on it, the rest of the block runs on the caller's stream, and the caller's stream waits for the side stream when
    the block ends, an error in the block included. Each thread has its own side stream."""
    import contextlib
    import threading

    from cula.sm90 import walks

    log = []
    made = []

    class FakeStream:
        def __init__(self, name):
            self.name = name

        def wait_stream(self, other):
            log.append(f"{self.name} waits for {other.name}")

    def new_side(device=None):
        made.append(threading.get_ident())
        return FakeStream("side")

    @contextlib.contextmanager
    def on(stream):
        log.append(f"on {stream.name}")
        yield
        log.append(f"off {stream.name}")

    monkeypatch.setattr(walks, "_SIDE", threading.local())
    monkeypatch.setattr(torch.cuda, "current_stream", lambda device=None: FakeStream("caller"))
    monkeypatch.setattr(torch.cuda, "Stream", new_side)
    monkeypatch.setattr(torch.cuda, "stream", on)
    gpu = torch.device("cuda", 0)
    with walks.side_by_side(gpu) as on_side:
        with on_side():
            log.append("forward walk")
        log.append("reverse walk")
    assert log == [
        "side waits for caller", "on side", "forward walk", "off side", "reverse walk", "caller waits for side"
    ]  # fmt: skip
    log.clear()
    with pytest.raises(RuntimeError), walks.side_by_side(gpu):
        raise RuntimeError("a failed launch")
    assert log == ["side waits for caller", "caller waits for side"]

    def another_threads_block():
        with walks.side_by_side(gpu):
            pass

    other = threading.Thread(target=another_threads_block)
    other.start()
    other.join()
    assert len(made) == 2 and made[0] != made[1]  # one side stream for this thread, one for the other
    with walks.side_by_side(torch.device("cpu")) as on_side, on_side():
        log.append("emulated")
    assert log[-1] == "emulated"
