"""Shared by the GPU kernel tests: the fp64 per-token delta-rule recurrence (GDN and KDA), the error measure, the
SM90 and SM100 skip markers, and the check of a kernel backward's gradients against the fp64 reference's autograd."""

import pytest
import torch

import cula

needs_sm90 = pytest.mark.skipif(
    not torch.cuda.is_available() or torch.cuda.get_device_capability() != (9, 0), reason="needs an SM90 GPU"
)
needs_sm100 = pytest.mark.skipif(
    not torch.cuda.is_available() or torch.cuda.get_device_capability() not in ((10, 0), (10, 3)),
    reason="needs an SM100 GPU (B200, B300)",
)


def recurrence(q, k, v, g, beta, scale, h0=None, cu_seqlens=None):
    """fp64 per token: S' = diag(exp(g_t)) S; u = beta_t (v_t - S'^T k_t); S = S' + k_t u^T; o_t = S^T (scale q_t).
    g is [B, T, HV] (GDN, one gate per head) or [B, T, HV, K] (KDA, one per key channel)."""
    B, T, H, K = q.shape
    HV, V = v.shape[2], v.shape[3]
    rep = HV // H
    q, k = (x.double().repeat_interleave(rep, dim=2) for x in (q, k))
    v, g, beta = v.double(), g.double(), beta.double()
    if g.dim() == 3:
        g = g[..., None]  # a per-head gate acts on every key channel
    bounds = (
        [(b, 0, T) for b in range(B)]
        if cu_seqlens is None
        else [(0, int(cu_seqlens[i]), int(cu_seqlens[i + 1])) for i in range(len(cu_seqlens) - 1)]
    )
    o = torch.zeros(B, T, HV, V, dtype=torch.float64, device=q.device)
    hts = []
    for n, (b, t0, t1) in enumerate(bounds):
        S = h0[n].double().clone() if h0 is not None else torch.zeros(HV, K, V, dtype=torch.float64, device=q.device)
        for t in range(t0, t1):
            S = S * g[b, t].exp()[:, :, None]
            u = beta[b, t][:, None] * (v[b, t] - torch.einsum("hkv,hk->hv", S, k[b, t]))
            S = S + k[b, t][:, :, None] * u[:, None, :]
            o[b, t] = torch.einsum("hkv,hk->hv", S, scale * q[b, t])
        hts.append(S)
    return o, torch.stack(hts)


def rel_rmse(x, ref):
    return ((x.double() - ref).norm() / ref.norm()).item()


# elementwise, against the largest reference magnitude of the same sequence: loose enough for bf16 chunk algorithms,
# tight enough that one garbled chunk or head fails where its share of the rel RMSE would not
MAX_ABS_FRACTION = 0.05


def _close(x, ref, what):
    """rel RMSE <= 0.005 and max-abs error <= MAX_ABS_FRACTION of the largest |ref|; exact where ref is zero."""
    x = x.double()
    assert bool(torch.isfinite(x).all()), f"{what}: not finite"
    scale = ref.abs().max().item()
    if scale == 0:
        assert x.abs().max().item() == 0, f"{what}: nonzero where the reference is zero"
        return
    err = rel_rmse(x, ref)
    assert err <= 5e-3, (what, err)
    worst = (x - ref).abs().max().item() / scale
    assert worst <= MAX_ABS_FRACTION, (what, "max abs", worst)


def assert_matches(o, ht, o_ref, ht_ref, cu=None):
    """o and the final state within rel RMSE 0.005 of the recurrence's, over the call and for every sequence (batch
    row, or the ``cu`` offsets of row 0), and no element far off (:data:`MAX_ABS_FRACTION`): a global figure hides
    one bad sequence or tail chunk."""
    _close(o, o_ref, "o")
    _close(ht, ht_ref, "final state")
    B, T = o.shape[:2]
    rows = [(b, 0, T) for b in range(B)] if cu is None else [(0, cu[n], cu[n + 1]) for n in range(len(cu) - 1)]
    for n, (b, s, e) in enumerate(rows):
        if e > s:
            _close(o[b, s:e], o_ref[b, s:e], f"o of sequence {n}")
        _close(ht[n], ht_ref[n], f"final state of sequence {n}")


def check_fwd(fwd, supports, inputs, cu=None, h0=False, state_v_first=False, split=None):
    """Run an SM90 forward entry ``fwd(q, k, v, g, beta, scale, initial_state, True, cu_seqlens, state_v_first,
    out=, final_state_out=[, cu_seqlens_cpu=, split=])`` on ``inputs`` (q, k, v, g, beta) with NaN-poisoned outputs,
    after ``supports`` accepted them, and check o and the final state against :func:`recurrence`
    (:func:`assert_matches`). ``cu``: varlen offsets (a list); ``h0``: start from a random state; ``split``: force sequence splitting
    on (True) or off (False), handing the entry the offsets on the host too; None: neither argument."""
    q, k, v, g, beta = inputs
    B, T, HV, D = v.shape
    N = B if cu is None else len(cu) - 1
    dev = v.device
    cu_t = None if cu is None else torch.tensor(cu, dtype=torch.int32, device=dev)
    ok, why = supports(*inputs, cu_seqlens=cu_t)
    assert ok, why
    init = torch.randn(N, HV, D, D, device=dev) * 0.1 if h0 else None
    scale = D**-0.5
    o_ref, ht_ref = recurrence(q, k, v, g, beta, scale, init, cu)
    o = torch.full((B, T, HV, D), float("nan"), dtype=torch.bfloat16, device=dev)
    ht = torch.full((N, HV, D, D), float("nan"), device=dev)
    init_arg = init.transpose(-1, -2).contiguous() if (h0 and state_v_first) else init
    # entries that can split take the host offsets and the split switch; the others are called without them
    extra = {} if split is None else {"split": split, "cu_seqlens_cpu": None if cu is None else torch.tensor(cu)}
    o, ht = fwd(q, k, v, g, beta, scale, init_arg, True, cu_t, state_v_first, out=o, final_state_out=ht, **extra)
    if v.is_cuda:
        torch.cuda.synchronize()
    if state_v_first:
        ht = ht.transpose(-1, -2)
    assert_matches(o, ht, o_ref, ht_ref, cu)


def check_fwd_on_busy_stream(fwd, inputs, cu, g_ref=None):
    """``fwd`` (as :func:`check_fwd` calls it, split forced) inside ``torch.cuda.stream(s)`` while ``s`` is still
    writing its inputs (behind a ~25 ms sleep, NaN before), without ``out`` / ``final_state_out``, its outputs read
    on ``s`` before any synchronize: whatever streams the entry uses must wait for ``s``'s writes, and ``s`` for
    theirs. ``cu``: varlen offsets with a sequence long enough to be cut beside others left whole; ``g_ref``: the
    gate the recurrence takes, where ``fwd`` takes another form of it (raw, activated in the kernel)."""
    q, k, v, g, beta = inputs
    HV, D = v.shape[2], v.shape[3]
    init = torch.randn(len(cu) - 1, HV, D, D, device=v.device) * 0.1
    scale = D**-0.5
    o_ref, ht_ref = recurrence(q, k, v, g if g_ref is None else g_ref, beta, scale, init, cu)
    cu_cpu = torch.tensor(cu)
    # compiled (seconds on the host, which would outlast the sleep below) and planned before the stream's late writes
    fwd(q, k, v, g, beta, scale, init, True, cu_cpu.to(v.device, torch.int32), False, split=True, cu_seqlens_cpu=cu_cpu)
    torch.cuda.synchronize()
    s = torch.cuda.Stream()
    with torch.cuda.stream(s):
        srcs = (q, k, v, g, beta, init)
        late = [torch.full_like(x, float("nan")) for x in srcs]
        torch.cuda._sleep(50_000_000)  # clock cycles
        for dst, src in zip(late, srcs, strict=True):
            dst.copy_(src)
        cu_t = torch.tensor(cu, dtype=torch.int32, device=v.device)
        o, ht = fwd(*late[:5], scale, late[5], True, cu_t, False, split=True, cu_seqlens_cpu=cu_cpu)
        o, ht = o.double(), ht.double()
    torch.cuda.synchronize()
    assert_matches(o, ht, o_ref, ht_ref, cu)


def check_fwd_in_cuda_graph(fwd, inputs, fresh, cu, split, g_ref=None):
    """``fwd`` (as :func:`check_fwd` calls it) captured into a CUDA graph after one eager call (compiled, planned),
    then replayed on ``fresh`` inputs (and a fresh initial state) copied into the captured ones: o and the final
    state against :func:`recurrence` on those. ``g_ref``: the gate the recurrence takes for ``fresh`` where ``fwd``
    takes another form of it."""
    q, k, v, g, beta = fresh
    HV, D = v.shape[2], v.shape[3]
    static = [x.clone() for x in inputs]
    h0 = torch.randn(len(cu) - 1, HV, D, D, device=v.device) * 0.1
    scale = D**-0.5
    cu_cpu = torch.tensor(cu)
    cu_t = cu_cpu.to(v.device, torch.int32)

    def call():
        return fwd(*static, scale, h0, True, cu_t, False, split=split, cu_seqlens_cpu=cu_cpu)

    call()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        o, ht = call()
    h0_new = torch.randn_like(h0)
    for dst, src in zip([*static, h0], [*fresh, h0_new], strict=True):
        dst.copy_(src)
    o.fill_(float("nan"))
    ht.fill_(float("nan"))
    graph.replay()
    torch.cuda.synchronize()
    o_ref, ht_ref = recurrence(q, k, v, g if g_ref is None else g_ref, beta, scale, h0_new, cu)
    assert_matches(o, ht, o_ref, ht_ref, cu)


# bf16 tolerances of each gradient, by argument name
GRADIENT_TOLERANCE = {
    "q": 0.008, "k": 0.008, "v": 0.008, "initial_state": 0.008,
    "g": 0.02, "g_gamma": 0.02, "beta": 0.02, "A_log": 0.02, "dt_bias": 0.02,
}  # fmt: skip


def offsets_of(lengths):
    offsets = [0]
    for n in lengths:
        offsets.append(offsets[-1] + n)
    return offsets


def sequence_bounds(B, T, lengths=None):
    """Each sequence's ``(batch row, first token, end)``: the B rows of T tokens, or a varlen call's ``lengths`` in
    row 0."""
    if lengths is None:
        return [(b, 0, T) for b in range(B)]
    offsets = offsets_of(lengths)
    return [(0, s, e) for s, e in zip(offsets[:-1], offsets[1:], strict=True)]


def gradient_passes_fixture(kernel_env: str, tile_copies: bool = True):
    """A ``gradient_passes`` fixture for a variant whose per-chunk gradient kernel ``kernel_env`` switches ("0": PyTorch
    products, "1": the kernel): each test runs with the PyTorch passes, the kernel, and (``tile_copies``: a kernel that
    has them) the kernel compiled with CULA_GRADIENT_TILE_COPIES=1 ("kernel tile copies"). A test module binds it to
    that name."""

    @pytest.fixture(params=["pytorch", "kernel", "kernel tile copies"][: 3 if tile_copies else 2])
    def gradient_passes(request, monkeypatch):
        monkeypatch.setenv(kernel_env, "0" if request.param == "pytorch" else "1")
        monkeypatch.setenv("CULA_GRADIENT_TILE_COPIES", "1" if request.param == "kernel tile copies" else "0")
        return request.param

    return gradient_passes


def training_inputs(B, T, H, HV, D, per_key_gate, options=False, N=None):
    """A delta-rule training call's inputs on the GPU, seeded by T + HV: bf16 q, k (normalised), v; fp32 beta and
    initial state (N or B rows); the activated gate, GDN's logsigmoid(x + 3) per head, or (``per_key_gate``) KDA's
    bounded -5 sigmoid(x) per key with 8 channels at the bound on every token. ``options``: the in-kernel options'
    raw inputs instead (un-normalised keys, raw gate, bf16 per key as KDA's kernel takes it, raw beta, A_log and
    dt_bias)."""
    gate_shape = (B, T, HV, D) if per_key_gate else (B, T, HV)
    torch.manual_seed(T + HV)
    inputs = {
        "q": torch.randn(B, T, H, D, device="cuda").bfloat16(),
        "k": torch.nn.functional.normalize(torch.randn(B, T, H, D, device="cuda"), dim=-1).bfloat16(),
        "v": torch.randn(B, T, HV, D, device="cuda").bfloat16(),
    }
    if per_key_gate:
        g = -5.0 * torch.sigmoid(torch.randn(*gate_shape, device="cuda"))
        g[..., :8] = -5.0
    else:
        g = torch.nn.functional.logsigmoid(torch.randn(*gate_shape, device="cuda") + 3.0)
    inputs["g"] = g
    inputs["beta"] = torch.rand(B, T, HV, device="cuda")
    inputs["initial_state"] = torch.randn(N or B, HV, D, D, device="cuda") * 0.1
    if options:
        inputs["k"] = (torch.randn(B, T, H, D, device="cuda") * 2).bfloat16()
        g_raw = torch.randn(*gate_shape, device="cuda")
        inputs["g"] = g_raw.bfloat16() if per_key_gate else g_raw
        inputs["beta"] = torch.randn(B, T, HV, device="cuda")
        inputs["A_log"] = torch.rand(HV, device="cuda")
        inputs["dt_bias"] = torch.rand(HV * D if per_key_gate else HV, device="cuda")
    return inputs


def gradients(entry, inputs, extra, grad_o, grad_ht, backend, monkeypatch):
    """The gradients of ``entry(**inputs, **extra)`` for the cotangents (grad_o, grad_ht) with ``backend`` forced
    ("cute": the kernel's backward; "torch": the reference in fp64) and the decision taken."""
    monkeypatch.setenv("CULA_BACKEND", backend)
    monkeypatch.setenv("CULA_UNTESTED_KERNELS", "1")
    leaves = {
        n: (x.double() if backend == "torch" else x).detach().requires_grad_()
        for n, x in inputs.items()
        if x is not None
    }
    o, ht = entry(**leaves, **extra, output_final_state=True)
    cotangents = [grad_o.to(o.dtype), grad_ht.to(ht.dtype)]
    torch.autograd.backward([o, ht], cotangents)
    decision = cula.last_decision(entry)
    monkeypatch.delenv("CULA_BACKEND")
    return {n: x.grad for n, x in leaves.items()}, decision


def check_gradients(entry, inputs, extra, monkeypatch, lengths=None):
    """Every gradient of ``entry`` served by cuLA's kernel backward (``CULA_UNTESTED_KERNELS=1``) against the fp64
    reference's autograd, over the call and per sequence (``lengths``: a varlen call's sequences)."""
    B, T, _, D = inputs["q"].shape
    HV = inputs["v"].shape[2]
    N = B if lengths is None else len(lengths)
    grad_o = torch.randn(B, T, HV, D, device="cuda").bfloat16()
    grad_ht = torch.randn(N, HV, D, D, device="cuda") * 0.1
    got, decision = gradients(entry, inputs, extra, grad_o, grad_ht, "cute", monkeypatch)
    assert decision.backend == "cute", str(decision)
    ref, _ = gradients(entry, inputs, extra, grad_o, grad_ht, "torch", monkeypatch)
    bounds = sequence_bounds(B, T, lengths)
    for name, want in ref.items():
        have = got[name]
        assert have is not None and torch.isfinite(have).all(), name
        tol = GRADIENT_TOLERANCE[name]
        if want.norm() == 0:
            # a gradient that vanishes (one token without h0: its gate decays a zero state) is left as cancellation
            # residue of the gate's chunk sums, far below the other gradients
            assert have.abs().max() <= 1e-5 * max(got[n].abs().max() for n in ("q", "k", "v")), name
            continue
        assert rel_rmse(have, want) <= tol, (name, rel_rmse(have, want))
        if name in ("q", "k", "v", "g", "beta"):
            for n, (b, s, e) in enumerate(bounds):
                if e > s:
                    assert rel_rmse(have[b, s:e], want[b, s:e]) <= tol, (name, n, rel_rmse(have[b, s:e], want[b, s:e]))
        elif name == "initial_state":
            for n in range(N):
                assert rel_rmse(have[n], want[n]) <= tol, (name, n)


def check_state_walk(kernel, walk, D, per_key_gate, lengths=(0, 1, 130, 64, 777)):
    """One state walk of ``kernel`` (:func:`cula.sm90.walks.state_walk`, a kernel without the delta rule, chunks of its
    ``chunk``): each checkpoint and the walk's final state within bf16 rounding of the plan's
    (:mod:`cula.ops.chunk_backward`), per sequence, on a varlen batch with a start state (empty, one-token and odd
    sequences by default), a scalar or ``per_key_gate`` gate."""
    import torch.nn.functional as F

    from cula.ops import chunk_backward
    from cula.sm90.walks import state_walk

    torch.manual_seed(0)
    offsets = offsets_of(list(lengths))
    T, H, N, C = offsets[-1], 2, len(lengths), kernel.chunk
    x = torch.randn(1, T, H, D, device="cuda").bfloat16()
    y = torch.randn(1, T, H, D, device="cuda").bfloat16()
    gate = F.logsigmoid(torch.randn(1, T, H, *((D,) if per_key_gate else ()), device="cuda") + 3.0)
    # the kernels' beta slot: the scalar gate in simple GLA's calls, an unread tensor in GLA's
    beta = torch.empty(1, T, H, device="cuda") if per_key_gate else gate
    start = torch.randn(N, H, D, D, device="cuda") * 0.1
    cu = torch.tensor(offsets, dtype=torch.int32, device="cuda")
    rows = chunk_backward.chunk_rows(offsets, False, chunk=C).rows
    scale = 0.3
    got, final = state_walk(kernel, walk, x, x, y, gate, beta, scale, start, cu, rows, False)
    torch.cuda.synchronize()
    firsts = chunk_backward.checkpoint_rows(offsets, False, C)
    for n, (s, e) in enumerate(zip(offsets[:-1], offsets[1:], strict=True)):
        heads = lambda t, s=s, e=e: t[0, s:e].transpose(0, 1).double()  # noqa: E731
        gk = heads(gate) if per_key_gate else heads(gate)[..., None].expand(H, e - s, D)
        if walk == "states":
            want, want_final = chunk_backward.state_walk(heads(x), heads(y), gk, start[n].double(), C)
        else:
            want, want_final = chunk_backward.state_gradient_walk(heads(x), heads(y), gk, scale, start[n].double(), C)
        for c, ref in enumerate(want):
            err = rel_rmse(got[firsts[n] + c].transpose(-1, -2), ref)
            assert err <= 0.005, (n, c, err)
        assert rel_rmse(final[n], want_final) <= 0.005, n


def check_delta_walk(kernel, walk, D, H, HV, per_key_gate, lengths=(0, 1, 130, 64, 777), fixed_length=False):
    """One state walk of ``kernel`` with the delta rule (:func:`cula.sm90.walks.state_walk`: "states", or
    "state_grads" through the transposed chain): each checkpoint and the walk's final state within bf16 rounding of
    the delta rule's chunked plan (:func:`cula.ops.chunk_backward.delta_backward`) in fp64, per sequence, with start
    states, GVA, a scalar or ``per_key_gate`` gate (KDA's bounded form, -5 sigmoid(x), 8 key channels at -5 on every
    token): a varlen batch of ``lengths`` (empty, one-token and odd sequences by default), or with ``fixed_length``
    one row of each length (all the same)."""
    import torch.nn.functional as F

    from cula.ops import chunk_backward
    from cula.sm90.walks import state_walk

    torch.manual_seed(0)
    offsets = offsets_of(list(lengths))
    N = len(lengths)
    B, T = (N, lengths[0]) if fixed_length else (1, offsets[-1])
    q = torch.randn(B, T, H, D, device="cuda").bfloat16()
    k = F.normalize(torch.randn(B, T, H, D, device="cuda"), dim=-1).bfloat16()
    v = torch.randn(B, T, HV, D, device="cuda").bfloat16()
    do = torch.randn(B, T, HV, D, device="cuda").bfloat16()
    if per_key_gate:
        g = -5.0 * torch.sigmoid(torch.randn(B, T, HV, D, device="cuda"))
        g[..., :8] = -5.0
    else:
        g = F.logsigmoid(torch.randn(B, T, HV, device="cuda") + 3.0)
    beta = torch.rand(B, T, HV, device="cuda")
    h0 = torch.randn(N, HV, D, D, device="cuda") * 0.1
    dht = torch.randn(N, HV, D, D, device="cuda") * 0.1
    cu = None if fixed_length else torch.tensor(offsets, dtype=torch.int32, device="cuda")
    rows = chunk_backward.chunk_rows(offsets, fixed_length).rows
    scale = D**-0.5
    start, values = (h0, v) if walk == "states" else (dht, do)
    got, final = state_walk(kernel, walk, q, k, values, g, beta, scale, start, cu, rows, False)
    torch.cuda.synchronize()
    firsts = chunk_backward.checkpoint_rows(offsets, fixed_length)
    rep = HV // H
    for n, (s, e) in enumerate(zip(offsets[:-1], offsets[1:], strict=True)):
        if e == s:  # no chunk: the walk's final state is where it started
            assert rel_rmse(final[n], start[n].double()) <= 1e-6, n
            continue
        b, s, e = (n, 0, T) if fixed_length else (0, s, e)
        heads = lambda t, b=b, s=s, e=e: t[b, s:e].transpose(0, 1).double()  # noqa: E731
        qn, kn = (heads(x).repeat_interleave(rep, dim=0) for x in (q, k))
        plan = chunk_backward.delta_backward(
            qn, kn, heads(v), heads(beta), heads(g), heads(do), scale, h0[n].double(), dht[n].double()
        )
        want, want_final = (plan["starts"], plan["final"]) if walk == "states" else (plan["ends"], plan["dh0"])
        for c, ref in enumerate(want):
            err = rel_rmse(got[firsts[n] + c].transpose(-1, -2), ref)
            assert err <= 0.005, (n, c, err)
        assert rel_rmse(final[n], want_final) <= 0.005, n
