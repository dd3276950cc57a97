"""State pools (`cula.ops.state_pool`): states read from and written back to a pool by index, padding, bf16 pools,
per-token slots for speculative verify, validation and dispatch. CPU: the reference backend serves every call."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from fla.ops.gated_delta_rule.naive import naive_recurrent_gated_delta_rule
from fla.ops.kda.naive import naive_recurrent_kda
from test_api import FakeCuda

import cula
from cula import dispatch, validation

FUSED = {
    "kda": cula.kda.fused_recurrent_kda,
    "gdn": cula.gdn.fused_recurrent_gated_delta_rule,
    "gla": cula.gla.fused_recurrent_gla,
    "simple_gla": cula.lightning.fused_recurrent_simple_gla,
    "lightning": cula.lightning.fused_recurrent_lightning_attn,
}
CHUNK = {
    "kda": cula.kda.chunk_kda,
    "gdn": cula.gdn.chunk_gated_delta_rule,
    "simple_gla": cula.lightning.chunk_simple_gla,
    "lightning": cula.lightning.chunk_lightning_attn,
    "gla": cula.gla.chunk_gla,
}
H, K, V = 2, 16, 8


def heads(variant: str) -> int:
    return 4 if variant in ("kda", "gdn") else H  # GVA for the delta rule


def inputs(variant: str, B: int, T: int, dtype=torch.float32) -> dict:
    """Random inputs [B, T, ...] for one variant (beta and gates in range)."""
    HV = heads(variant)
    x = {
        "q": torch.randn(B, T, H, K, dtype=dtype),
        "k": F.normalize(torch.randn(B, T, H, K, dtype=dtype), dim=-1),
        "v": torch.randn(B, T, HV, V, dtype=dtype),
    }
    if variant == "kda":
        x.update(g=F.logsigmoid(torch.randn(B, T, HV, K, dtype=dtype)), beta=torch.rand(B, T, HV, dtype=dtype))
    elif variant == "gdn":
        x.update(g=F.logsigmoid(torch.randn(B, T, HV, dtype=dtype)), beta=torch.rand(B, T, HV, dtype=dtype))
    elif variant == "gla":
        x.update(gk=F.logsigmoid(torch.randn(B, T, H, K, dtype=dtype)))
    elif variant == "simple_gla":
        x.update(g=F.logsigmoid(torch.randn(B, T, H, dtype=dtype)))
    else:
        x.update(layer_idx=1, num_layers=4)
    return x


def new_pool(variant: str, slots: int, dtype=torch.float32, state_v_first=False) -> torch.Tensor:
    shape = (slots, heads(variant), V, K) if state_v_first else (slots, heads(variant), K, V)
    return torch.randn(*shape).to(dtype)


def rel(x: torch.Tensor, ref: torch.Tensor) -> float:
    return ((x.double() - ref.double()).norm() / ref.double().norm().clamp_min(1e-30)).item()


def sequence(x: dict, n: int, cu: list[int] | None, first: int | None = None) -> dict:
    """Sequence ``n`` of a batch (its first ``first`` tokens), as a batch of one."""
    out = {}
    for name, t in x.items():
        if not isinstance(t, torch.Tensor):
            out[name] = t
        elif cu is None:
            out[name] = t[n : n + 1, :first]
        else:
            out[name] = t[:, cu[n] : cu[n] + (cu[n + 1] - cu[n] if first is None else first)]
    return out


def alone(fn, x: dict, h0: torch.Tensor, **kwargs) -> tuple[torch.Tensor, torch.Tensor]:
    """One sequence through the unpooled op from the state ``h0`` (upcast as the pooled call does)."""
    dtype = torch.promote_types(x["q"].dtype, torch.float32)
    return fn(**x, initial_state=h0[None].to(dtype), output_final_state=True, **kwargs)


VARIANTS = list(FUSED)


# -- decode: [N] indices --------------------------------------------------------------------------------------


@pytest.mark.parametrize("dtype,tol", [(torch.float64, 1e-12), (torch.float32, 1e-5)])
@pytest.mark.parametrize("variant", VARIANTS)
def test_pooled_decode_matches_each_sequence_alone(variant, dtype, tol):
    fn, slots, indices = FUSED[variant], 9, torch.tensor([5, 0, 7, 2])
    x = inputs(variant, len(indices), 1, dtype)
    pool = new_pool(variant, slots, torch.float64 if dtype == torch.float64 else torch.float32)
    before = pool.clone()
    o, state = fn(**x, initial_state=pool, ssm_state_indices=indices)
    assert state is pool
    for n, slot in enumerate(indices.tolist()):
        o_n, h_n = alone(fn, sequence(x, n, None), before[slot])
        assert rel(o[n : n + 1], o_n) <= tol and rel(pool[slot], h_n[0]) <= tol
    for slot in set(range(slots)) - set(indices.tolist()):
        assert torch.equal(pool[slot], before[slot]), f"slot {slot} is not named, yet changed"


@pytest.mark.parametrize("variant", VARIANTS)
def test_padding_is_skipped_and_leaves_the_pool_untouched(variant):
    """A negative index: no read, no write, zero outputs, even with non-finite inputs in that sequence."""
    fn, indices = FUSED[variant], torch.tensor([3, -1, 1, -7])
    x = inputs(variant, len(indices), 1)
    for n in (1, 3):
        x["v"][n] = float("nan")
    pool = new_pool(variant, 5)
    before = pool.clone()
    o, _ = fn(**x, initial_state=pool, ssm_state_indices=indices)
    assert torch.equal(o[1], torch.zeros_like(o[1])) and torch.equal(o[3], torch.zeros_like(o[3]))
    assert torch.isfinite(o).all()
    for slot in (0, 2, 4):
        assert torch.equal(pool[slot], before[slot])
    only_padding = pool.clone()
    o, _ = fn(**inputs(variant, 2, 1), initial_state=only_padding, ssm_state_indices=torch.tensor([-1, -1]))
    assert torch.equal(only_padding, pool) and not o.any()


@pytest.mark.parametrize("variant", ["kda", "gdn", "gla"])
def test_varlen_decode_and_state_v_first(variant):
    """Varlen with an empty sequence (nothing written) and the [slots, HV, V, K] layout."""
    fn, cu, indices = FUSED[variant], [0, 1, 1, 4], torch.tensor([2, 0, 4])
    x = inputs(variant, 1, cu[-1])
    pool = new_pool(variant, 6, state_v_first=True)
    before = pool.clone()
    o, _ = fn(**x, initial_state=pool, ssm_state_indices=indices, cu_seqlens=torch.tensor(cu), state_v_first=True)
    for n, slot in ((0, 2), (2, 4)):
        o_n, h_n = alone(fn, sequence(x, n, cu), before[slot], state_v_first=True)
        assert rel(o[:, cu[n] : cu[n + 1]], o_n) <= 1e-5 and rel(pool[slot], h_n[0]) <= 1e-5
    assert all(torch.equal(pool[s], before[s]) for s in (0, 1, 3, 5))


@pytest.mark.parametrize("variant", ["kda", "gdn", "simple_gla"])
def test_bf16_pool_rounds_fp32_math(variant):
    """A bf16 pool is read exactly, the math is fp32 and the stored states are the fp32 results rounded."""
    fn, indices = FUSED[variant], torch.tensor([1, 3, -1])
    x = inputs(variant, 3, 1)
    pool = new_pool(variant, 4, torch.bfloat16)
    as_fp32 = pool.float()
    o16, _ = fn(**x, initial_state=pool, ssm_state_indices=indices)
    o32, _ = fn(**x, initial_state=as_fp32, ssm_state_indices=indices)
    assert pool.dtype == torch.bfloat16 and torch.equal(o16, o32)
    assert torch.equal(pool, as_fp32.bfloat16())
    assert not torch.equal(as_fp32[1], as_fp32[1].bfloat16().float())  # so the rounding was there to see


def test_inplace_without_indices_updates_initial_state():
    """``inplace_final_state=True`` alone: slot n is sequence n (FLA's ``fused_recurrent_kda_fwd``)."""
    x = inputs("kda", 3, 2)
    h0 = new_pool("kda", 3)
    o_ref, h_ref = FUSED["kda"](**x, initial_state=h0.clone(), output_final_state=True)
    o, state = FUSED["kda"](**x, initial_state=h0, inplace_final_state=True)
    assert state is h0 and torch.equal(o, o_ref) and torch.equal(h0, h_ref)


def test_read_only_pool_returns_final_states():
    """``inplace_final_state=False``: the pool is read, never written; sequences may share a slot; padding gives zero
    states."""
    indices = torch.tensor([2, 2, -1])
    x = inputs("gdn", 3, 2)
    pool = new_pool("gdn", 3)
    before = pool.clone()
    fn = FUSED["gdn"]
    o, final = fn(
        **x, initial_state=pool, ssm_state_indices=indices, inplace_final_state=False, output_final_state=True
    )
    assert torch.equal(pool, before) and final.shape == (3, *pool.shape[1:]) and final.dtype == torch.float32
    for n in (0, 1):
        o_n, h_n = alone(fn, sequence(x, n, None), before[2])
        assert rel(o[n : n + 1], o_n) <= 1e-5 and rel(final[n], h_n[0]) <= 1e-5
    assert not final[2].any() and not o[2].any()
    _, none = fn(**x, initial_state=pool, ssm_state_indices=indices, inplace_final_state=False)
    assert none is None


# -- speculative verify: [N, T_max] indices and num_accepted_tokens -------------------------------------------


@pytest.mark.parametrize("variant", VARIANTS)
def test_verify_keeps_the_state_after_each_token(variant):
    """Slot ``indices[n, t]`` receives the state after token t: the final state of the first t + 1 tokens alone."""
    fn, N, T = FUSED[variant], 3, 4
    table = torch.randperm(16)[: N * T].view(N, T)
    x = inputs(variant, N, T)
    pool = new_pool(variant, 16)
    before = pool.clone()
    o, _ = fn(**x, initial_state=pool, ssm_state_indices=table)
    for n in range(N):
        o_n, _ = alone(fn, sequence(x, n, None), before[table[n, 0]])
        assert rel(o[n : n + 1], o_n) <= 1e-5
        for t in range(T):
            _, h_t = alone(fn, sequence(x, n, None, first=t + 1), before[table[n, 0]])
            assert rel(pool[table[n, t]], h_t[0]) <= 1e-5, (n, t)
    untouched = sorted(set(range(16)) - set(table.flatten().tolist()))
    assert torch.equal(pool[untouched], before[untouched])


@pytest.mark.parametrize("variant", ["kda", "gdn", "lightning"])
def test_num_accepted_tokens_rolls_back(variant):
    """The next call starts from ``indices[n, num_accepted_tokens[n] - 1]``: the state after the last accepted
    token of the previous call, as FLA's kernel reads it."""
    fn, N, T = FUSED[variant], 3, 3
    table = torch.tensor([[0, 1, 2], [3, 4, 5], [6, 7, 8]])
    first, second = inputs(variant, N, T), inputs(variant, N, T)
    pool = new_pool(variant, 9)
    start = pool.clone()
    fn(**first, initial_state=pool, ssm_state_indices=table)
    accepted = torch.tensor([2, 1, 3], dtype=torch.int32)
    o, _ = fn(**second, initial_state=pool, ssm_state_indices=table, num_accepted_tokens=accepted)
    for n, a in enumerate(accepted.tolist()):
        _, h = alone(fn, sequence(first, n, None, first=a), start[table[n, 0]])
        o_n, h_n = alone(fn, sequence(second, n, None), h[0])
        assert rel(o[n : n + 1], o_n) <= 1e-5 and rel(pool[table[n, -1]], h_n[0]) <= 1e-5


def fla_kernel_order(x: dict, pool: torch.Tensor, table: torch.Tensor, accepted: torch.Tensor) -> torch.Tensor:
    """FLA 0.6.0's fused_recurrent_kda kernel transcribed (read ``h0[indices[n, accepted[n] - 1]]``, store the
    state after token t at ``indices[n, t]``), each step FLA's naive recurrence. Returns the outputs."""
    outs = []
    for n in range(table.shape[0]):
        h = pool[table[n, accepted[n] - 1]][None]
        for t in range(x["q"].shape[1]):
            step = {name: x[name][n : n + 1, t : t + 1] for name in ("q", "k", "v", "g", "beta")}
            o, h = naive_recurrent_kda(**step, initial_state=h, output_final_state=True)
            pool[table[n, t]] = h[0]
            outs.append(o)
    return torch.cat(outs, 1).view_as(x["v"])


def test_kda_verify_matches_fla_kernel_semantics():
    N, T = 3, 3
    table = torch.tensor([[4, 0, 8], [1, 6, 2], [7, 3, 5]])
    accepted = torch.tensor([3, 1, 2])
    x = inputs("kda", N, T)
    pool = new_pool("kda", 9)
    oracle = pool.clone()
    o, _ = FUSED["kda"](**x, initial_state=pool, ssm_state_indices=table, num_accepted_tokens=accepted)
    o_ref = fla_kernel_order(x, oracle, table, accepted)
    assert rel(o, o_ref) <= 1e-5 and rel(pool, oracle) <= 1e-5


def test_gdn_decode_matches_fla_naive():
    indices = torch.tensor([2, 0, -1, 5])
    x = inputs("gdn", 4, 1)
    pool = new_pool("gdn", 6)
    before = pool.clone()
    o, _ = FUSED["gdn"](**x, initial_state=pool, ssm_state_indices=indices)
    live = [0, 1, 3]
    q, k = (x[n][live].repeat_interleave(2, dim=2) for n in "qk")
    o_ref, h_ref = naive_recurrent_gated_delta_rule(
        q, k, x["v"][live], x["beta"][live], x["g"][live], None, before[indices[live]], True
    )
    assert rel(o[live], o_ref) <= 1e-5 and rel(pool[indices[live]], h_ref) <= 1e-5
    assert torch.equal(pool[[1, 3, 4]], before[[1, 3, 4]])


def test_per_token_slots_with_varlen_and_padding_entries():
    """Columns past a sequence's length and negative entries of a live sequence are not written; an empty
    sequence writes nothing."""
    fn, cu = FUSED["gdn"], [0, 3, 3, 4]
    table = torch.tensor([[0, -1, 2], [3, 4, 5], [6, 7, 8]])
    x = inputs("gdn", 1, cu[-1])
    pool = new_pool("gdn", 9)
    before = pool.clone()
    fn(**x, initial_state=pool, ssm_state_indices=table, cu_seqlens=torch.tensor(cu))
    for t, slot in ((0, 0), (2, 2)):
        _, h = alone(fn, sequence(x, 0, cu, first=t + 1), before[0])
        assert rel(pool[slot], h[0]) <= 1e-5
    _, h = alone(fn, sequence(x, 2, cu), before[6])
    assert rel(pool[6], h[0]) <= 1e-5
    assert torch.equal(pool[[1, 3, 4, 5, 7, 8]], before[[1, 3, 4, 5, 7, 8]])


def test_bf16_pool_per_token_states_carry_fp32():
    """With a slot per token, each stored state is rounded but the recurrence carries on in fp32."""
    table = torch.arange(6).view(2, 3)
    x = inputs("kda", 2, 3)
    pool = new_pool("kda", 6, torch.bfloat16)
    as_fp32 = pool.float()
    FUSED["kda"](**x, initial_state=pool, ssm_state_indices=table)
    FUSED["kda"](**x, initial_state=as_fp32, ssm_state_indices=table)
    assert torch.equal(pool, as_fp32.bfloat16())


# -- chunk ops: [N] indices -----------------------------------------------------------------------------------


@pytest.mark.parametrize("variant", list(CHUNK))
def test_chunk_ops_read_and_write_the_pool(variant):
    """Prefill through the chunked reference (a sequence of 70 tokens spans two chunks) with the same pool."""
    fn, cu, indices = CHUNK[variant], [0, 70, 75, 80], torch.tensor([4, -1, 1])
    x = inputs(variant, 1, cu[-1])
    if variant == "gla":
        x["g"] = x.pop("gk")  # chunk_gla's per-key gate
    pool = new_pool(variant, 6)
    before = pool.clone()
    o, state = fn(**x, initial_state=pool, ssm_state_indices=indices, cu_seqlens=torch.tensor(cu))
    assert state is pool and not o[:, cu[1] : cu[2]].any()
    for n, slot in ((0, 4), (2, 1)):
        o_n, h_n = alone(fn, sequence(x, n, cu), before[slot])
        assert rel(o[:, cu[n] : cu[n + 1]], o_n) <= 1e-5 and rel(pool[slot], h_n[0]) <= 1e-5
    assert torch.equal(pool[[0, 2, 3, 5]], before[[0, 2, 3, 5]])


# -- validation -----------------------------------------------------------------------------------------------


def kda_call(B=3, T=1, slots=6, **extra) -> dict:
    return {**inputs("kda", B, T), "initial_state": new_pool("kda", slots), **extra}


ROWS = torch.tensor([0, 1, 2])  # [N] indices for three sequences
TABLE = torch.arange(6).view(3, 2)  # [N, T_max] indices
REFUSED = [
    ({"ssm_state_indices": ROWS.float()}, TypeError, "`ssm_state_indices` must have dtype"),
    ({"ssm_state_indices": ROWS.view(3, 1, 1)}, ValueError, r"`ssm_state_indices` must have shape"),
    ({"ssm_state_indices": ROWS[:2]}, ValueError, "N=3 rows"),
    ({"ssm_state_indices": torch.tensor([0, 6, 1])}, ValueError, r"`ssm_state_indices`\[1\] = 6 is outside the pool"),
    ({"ssm_state_indices": torch.tensor([2, 0, 2])}, ValueError, "slot 2 is written twice"),
    ({"ssm_state_indices": torch.tensor([[0, 1], [2, 3], [0, 5]])}, ValueError, "slot 0 is written twice"),
    ({"ssm_state_indices": ROWS, "initial_state": None}, ValueError, "needs `initial_state`"),
    ({"inplace_final_state": True, "initial_state": None}, ValueError, "`inplace_final_state=True` needs `initial"),
    ({"inplace_final_state": True, "initial_state": torch.zeros(2, 4, 16, 8)}, ValueError, "N=3 states"),
    ({"inplace_final_state": "yes"}, TypeError, "`inplace_final_state` must be a bool"),
    ({"ssm_state_indices": ROWS, "initial_state": torch.zeros(6, 4, 8, 16)}, ValueError, r"\[slots, HV, K, V\]"),
    ({"ssm_state_indices": ROWS, "initial_state": torch.zeros(6, 4, 16, 8).half()}, TypeError, "`initial_state` must"),
    ({"num_accepted_tokens": ROWS}, ValueError, "`num_accepted_tokens` needs `ssm_state_indices`"),
    ({"ssm_state_indices": ROWS, "num_accepted_tokens": ROWS + 1}, ValueError, r"needs `ssm_state_indices` of shape"),
    ({"ssm_state_indices": TABLE, "num_accepted_tokens": torch.tensor([1, 3, 1])}, ValueError, r"\[1, T_max=2\]"),
    ({"ssm_state_indices": TABLE, "num_accepted_tokens": ROWS}, ValueError, r"`num_accepted_tokens`\[0\] = 0"),
    ({"ssm_state_indices": TABLE, "num_accepted_tokens": ROWS.float()}, TypeError, "`num_accepted_tokens` must have"),
    ({"ssm_state_indices": ROWS.to("meta")}, ValueError, "all tensors must be on one device"),
    ({"ssm_state_indices": ROWS, "reverse": True}, ValueError, "reverse=True"),
]


@pytest.mark.parametrize("extra,error,match", REFUSED, ids=[m for _, _, m in REFUSED])
def test_pool_arguments_are_refused_by_name(extra, error, match):
    args = kda_call(**{n: a for n, a in extra.items() if n != "reverse"})
    fn = FUSED["kda"]
    if "reverse" in extra:
        fn, args = FUSED["gla"], {**inputs("gla", 3, 1), "initial_state": new_pool("gla", 6), **extra}
    with pytest.raises(error, match=match):
        fn(**args)


def test_trusted_pool_indices_are_not_read(monkeypatch):
    """With CULA_TRUST_POOL_INDICES=1 the indices' values are not read to the host (on a GPU, a device sync), so
    they are not checked; their shape still is."""

    def read(x, how, fresh=False):
        raise AssertionError("the indices were read")

    monkeypatch.setattr(validation, "_read_host", read)
    fn = FUSED["kda"]
    with pytest.raises(AssertionError, match="were read"):
        fn(**kda_call(ssm_state_indices=ROWS))
    monkeypatch.setenv(validation.ENV_TRUST_POOL_INDICES, "1")
    o, pool = fn(**kda_call(ssm_state_indices=ROWS))
    assert o.shape[0] == 3 and torch.isfinite(o).all()
    with pytest.raises(ValueError, match="N=3 rows"):
        fn(**kda_call(ssm_state_indices=ROWS[:2]))


def test_refused_per_token_layouts():
    fn = FUSED["kda"]
    with pytest.raises(ValueError, match=r"T_max >= 3"):  # a column per token
        fn(**kda_call(T=3, ssm_state_indices=torch.arange(6).view(3, 2)))
    # sequence 1 starts from slot 0, which sequence 0 writes after its first token
    table = torch.tensor([[0, 1], [2, 0], [4, 5]])
    with pytest.raises(ValueError, match="slot 0 is read by sequence 1 and written in place by sequence 0"):
        fn(**kda_call(T=1, ssm_state_indices=table, num_accepted_tokens=torch.tensor([1, 2, 1])))
    with pytest.raises(ValueError, match=r"must have shape \[N\] \(chunk ops"):
        CHUNK["kda"](**kda_call(T=2, ssm_state_indices=torch.arange(6).view(3, 2)))
    x = kda_call(ssm_state_indices=torch.tensor([0, 1, 2]))
    x["q"].requires_grad_()
    with pytest.raises(ValueError, match="inputs require grad"):
        fn(**x)


def test_what_is_accepted():
    """Padding may repeat, a read-only pool may be shared, int32 indices, a write to the slot a sequence read."""
    fn = FUSED["kda"]
    fn(**kda_call(ssm_state_indices=torch.tensor([-1, 3, -1], dtype=torch.int32)))
    fn(**kda_call(ssm_state_indices=torch.tensor([1, 1, 1]), inplace_final_state=False))
    fn(
        **kda_call(
            T=2, ssm_state_indices=torch.tensor([[0, 1], [2, 3], [4, 5]]), num_accepted_tokens=torch.tensor([2, 1, 2])
        )
    )
    # a padded sequence's row is not looked at: its entries may repeat a live sequence's slots
    fn(**kda_call(T=2, ssm_state_indices=torch.tensor([[0, 1], [-1, 0], [4, 5]])))


def test_unchecked_values_under_graph_capture(monkeypatch):
    """While a CUDA graph is captured the values cannot be read: the shapes are checked, the values are not."""
    from cula import validation

    twice = kda_call(ssm_state_indices=torch.tensor([0, 0, 1]))
    with pytest.raises(ValueError, match="slot 0 is written twice"):
        cula.explain(FUSED["kda"], **twice)
    monkeypatch.setattr(validation, "_capturing", lambda x: True)
    assert cula.explain(FUSED["kda"], **twice).backend == "torch"
    with pytest.raises(ValueError, match="N=3 rows"):
        cula.explain(FUSED["kda"], **kda_call(ssm_state_indices=torch.tensor([0, 1])))


# -- dispatch -------------------------------------------------------------------------------------------------


def test_kda_decode_with_a_pool_goes_to_fla_where_its_kernel_fits(monkeypatch):
    FakeCuda(monkeypatch, (9, 0))
    fn = FUSED["kda"]
    decision = cula.explain(fn, **kda_call(ssm_state_indices=torch.tensor([4, 0, 2])))
    assert decision.backend == "fla" and "fused_recurrent_kda_fwd" in decision.reason
    table = torch.arange(6).view(3, 2)
    decision = cula.explain(fn, **kda_call(T=2, ssm_state_indices=table, num_accepted_tokens=torch.tensor([1, 2, 1])))
    assert decision.backend == "fla"
    assert cula.explain(fn, **kda_call(inplace_final_state=True, initial_state=new_pool("kda", 3))).backend == "fla"
    declined = {
        "padding": kda_call(ssm_state_indices=torch.tensor([4, -1, 2])),
        "several tokens": kda_call(T=2, ssm_state_indices=torch.tensor([4, 0, 2])),
        "without write-back": kda_call(ssm_state_indices=torch.tensor([4, 0, 2]), inplace_final_state=False),
        # [slots, HV, K, V] stored as [slots, HV, V, K]
        "strided slots": kda_call(ssm_state_indices=torch.tensor([4, 0, 2]), initial_state=torch.randn(6, 4, 8, 16).mT),
    }
    for why, args in declined.items():
        decision = cula.explain(fn, **args)
        assert decision.backend == "torch", why
        assert dict(decision.rejected)["fla"], why
    reason = dict(cula.explain(fn, **declined["padding"]).rejected)["fla"]
    assert "padding" in reason


def test_pools_fla_cannot_take_go_to_the_reference_with_the_reason(monkeypatch):
    FakeCuda(monkeypatch, (9, 0))
    indices = torch.tensor([4, 0, 2])
    decision = cula.explain(
        FUSED["gdn"], **inputs("gdn", 3, 1), initial_state=new_pool("gdn", 6), ssm_state_indices=indices
    )
    assert decision.backend == "torch"
    assert "fused_recurrent_gated_delta_rule takes no ssm_state_indices" in dict(decision.rejected)["fla"]
    decision = cula.explain(CHUNK["kda"], **kda_call(ssm_state_indices=torch.tensor([4, -1, 2])))
    rejected = dict(decision.rejected)
    assert decision.backend == "torch" and rejected["cute"] and "chunk_kda takes no" in rejected["fla"]
    monkeypatch.setenv("CULA_BACKEND", "fla")
    with pytest.raises(cula.BackendUnavailableError, match="takes no ssm_state_indices"):
        FUSED["gdn"](**inputs("gdn", 3, 1), initial_state=new_pool("gdn", 6), ssm_state_indices=indices)


def gla_pool_prefill(pool_dtype: torch.dtype) -> dict:
    """A GLA prefill of two sequences (70 and 10 tokens, D = 64) on a pool of 5 slots of ``pool_dtype``."""
    T, D = 80, 64
    return {
        "q": torch.randn(1, T, H, D).bfloat16(),
        "k": torch.randn(1, T, H, D).bfloat16(),
        "v": torch.randn(1, T, H, D).bfloat16(),
        "g": F.logsigmoid(torch.randn(1, T, H, D)),
        "cu_seqlens": torch.tensor([0, 70, 80]),
        "initial_state": torch.zeros(5, H, D, D, dtype=pool_dtype),
        "ssm_state_indices": torch.tensor([3, 1]),
    }


def test_a_pooled_gla_prefill_reaches_its_kernel(monkeypatch):
    """On an SM90 GLA's pooled chunk kernel serves a pooled prefill; with the kernel forced off the reference does
    (FLA's chunk_gla takes no pool), saying why."""
    FakeCuda(monkeypatch, (9, 0))
    x = gla_pool_prefill(torch.float32)
    assert cula.explain(CHUNK["gla"], **x).backend == "cute"
    monkeypatch.setenv("CULA_BACKEND", "fla")
    with pytest.raises(cula.BackendUnavailableError, match="chunk_gla takes no"):
        cula.explain(CHUNK["gla"], **x)
    with pytest.raises(TypeError, match="bogus"):
        CHUNK["gla"](**x, bogus=1)  # FLA's signature and the pool's two names, nothing else


def test_a_bf16_pooled_prefill_reaches_the_kernels_by_index_only(monkeypatch):
    """The SM90 chunk kernels take a bf16 pool by index; without indices never, and a plain bf16 initial state is
    refused by validation."""
    FakeCuda(monkeypatch, (9, 0))
    x = gla_pool_prefill(torch.bfloat16)
    assert cula.explain(CHUNK["gla"], **x).backend == "cute"
    without_indices = {
        **x,
        "ssm_state_indices": None,
        "inplace_final_state": True,
        "initial_state": x["initial_state"][:2],
    }
    assert "without ssm_state_indices" in dict(cula.explain(CHUNK["gla"], **without_indices).rejected)["cute"]
    plain = {**x, "ssm_state_indices": None, "initial_state": x["initial_state"][:2]}
    with pytest.raises(TypeError, match="initial_state"):  # FLA's chunk ops take fp32 initial states
        cula.explain(CHUNK["gla"], **plain)


def test_what_fla_receives(monkeypatch):
    """A pooled call hands FLA's fused_recurrent_kda_fwd the pool itself and contiguous inputs; a call without a
    pool hands FLA's public op no pool argument (FLA's fused_recurrent_lightning_attn takes no ``**kwargs``)."""
    FakeCuda(monkeypatch, (9, 0))
    received = {}

    def fake(target):
        def run(**kwargs):
            received[target] = kwargs
            return kwargs["v"], kwargs.get("initial_state")

        return run

    monkeypatch.setattr(dispatch, "fla_function", fake)
    pool = new_pool("kda", 6)
    x = kda_call(ssm_state_indices=torch.tensor([4, 0, 2]), initial_state=pool)
    x["q"] = x["q"].transpose(0, 1).contiguous().transpose(0, 1)
    FUSED["kda"](**x)
    sent = received["fla.ops.kda.fused_recurrent:fused_recurrent_kda_fwd"]
    assert sent["initial_state"] is pool and sent["inplace_final_state"] is True and sent["q"].is_contiguous()
    FUSED["lightning"](**inputs("lightning", 2, 3))
    sent = received["fla.ops.lightning_attn:fused_recurrent_lightning_attn"]
    assert not set(sent) & set(cula.validation.POOL_ARGS)


def test_index_values_are_checked_once_per_tensor_and_version(monkeypatch):
    """Every layer of a model hands the same indices: they are read and checked once, again after a change."""
    from cula import validation

    checks = []
    check = validation._check_pool_index_values
    monkeypatch.setattr(validation, "_check_pool_index_values", lambda *a: checks.append(1) or check(*a))
    indices = torch.tensor([0, 1, 2])
    for _ in range(3):
        FUSED["kda"](**kda_call(ssm_state_indices=indices))
    assert len(checks) == 1
    indices[2] = 0  # in place: read and checked again
    with pytest.raises(ValueError, match="slot 0 is written twice"):
        FUSED["kda"](**kda_call(ssm_state_indices=indices))
    assert len(checks) == 2


# -- on a GPU: FLA's kernel where it serves pools, against the reference on the same device ---------------------

needs_gpu = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


def gpu_kda_call(N: int, T: int, slots: int, pool_dtype, HV=8, D=128) -> dict:
    """fp32 KDA inputs as FLA's layer calls the op (gate, q/k L2 norm and beta sigmoid in the op), GVA."""
    dev = "cuda"
    return {
        "q": torch.randn(N, T, 4, D, device=dev),
        "k": torch.randn(N, T, 4, D, device=dev),
        "v": torch.randn(N, T, HV, D, device=dev),
        "g": torch.randn(N, T, HV, D, device=dev),
        "beta": torch.randn(N, T, HV, device=dev),
        "A_log": torch.empty(HV, device=dev).uniform_(0, 1.5).log(),
        "dt_bias": torch.randn(HV * D, device=dev) * 0.5,
        "use_gate_in_kernel": True,
        "use_qk_l2norm_in_kernel": True,
        "use_beta_sigmoid_in_kernel": True,
        "initial_state": (torch.randn(slots, HV, D, D, device=dev) * 0.1).to(pool_dtype),
    }


@pytest.mark.parametrize("pool_dtype,state_tol", [(torch.float32, 1e-3), (torch.bfloat16, 1e-2)])
@pytest.mark.parametrize("layout", ["decode", "verify"])
@pytest.mark.gpu
@needs_gpu
def test_gpu_kda_pool_through_fla_matches_the_reference(monkeypatch, pool_dtype, state_tol, layout):
    monkeypatch.setenv("CULA_BACKEND", "fla")  # cuLA's own kernel serves these calls first (tests/test_recurrent.py)
    N, slots = 16, 80
    T = 1 if layout == "decode" else 4
    args = gpu_kda_call(N, T, slots, pool_dtype)
    if layout == "decode":
        args["ssm_state_indices"] = torch.randperm(slots, device="cuda")[:N].int()
    else:
        args["ssm_state_indices"] = torch.randperm(slots, device="cuda")[: N * T].view(N, T)
        args["num_accepted_tokens"] = torch.randint(1, T + 1, (N,), device="cuda")
    pool = args["initial_state"]
    before = pool.clone()
    o, state = FUSED["kda"](**args)
    assert cula.last_decision(FUSED["kda"]).backend == "fla" and state is pool
    monkeypatch.setenv("CULA_BACKEND", "torch")
    o_ref, pool_ref = FUSED["kda"](**{**args, "initial_state": before.clone()})
    named = args["ssm_state_indices"].flatten().long()
    others = torch.ones(slots, dtype=torch.bool, device="cuda")
    others[named] = False
    assert rel(o, o_ref) <= 1e-3 and rel(pool[named], pool_ref[named]) <= state_tol
    assert torch.equal(pool[others], before[others])


@pytest.mark.gpu
@needs_gpu
@pytest.mark.parametrize("backend", ["cute", "auto"])
def test_gpu_padded_pool(monkeypatch, backend):
    """Padding: cuLA's kernel serves it (zero outputs, nothing read or written); without the kernel the reference
    does (FLA's kernel would read and write outside the pool)."""
    if backend == "auto":
        monkeypatch.setattr(FUSED["kda"].cula_op, "kernels", [])
    args = gpu_kda_call(8, 1, 12, torch.float32)
    args["ssm_state_indices"] = torch.tensor([3, -1, 0, 7, -1, 11, 5, 2], device="cuda")
    pool = args["initial_state"]
    before = pool.clone()
    o, _ = FUSED["kda"](**args)
    decision = cula.last_decision(FUSED["kda"])
    if backend == "cute":
        assert decision.backend == "cute"
    else:
        assert decision.backend == "torch" and "padding" in dict(decision.rejected)["fla"]
    assert not o[[1, 4]].any() and torch.equal(pool[[1, 4, 6, 8, 9, 10]], before[[1, 4, 6, 8, 9, 10]])


CHUNK_GPU = {"gdn": CHUNK["gdn"], "kda": CHUNK["kda"], "simple_gla": CHUNK["simple_gla"], "gla": CHUNK["gla"]}


def gpu_chunk_call(variant: str, lengths: list[int], slots: int, D: int = 128) -> dict:
    """bf16 varlen inputs of a chunk op (GVA for the delta rule) and an fp32 pool of ``slots``."""
    dev, T, Hq = "cuda", sum(lengths), 2
    HV = 4 if variant in ("gdn", "kda") else Hq
    x = {
        "q": torch.randn(1, T, Hq, D, device=dev).bfloat16(),
        "k": F.normalize(torch.randn(1, T, Hq, D, device=dev), dim=-1).bfloat16(),
        "v": torch.randn(1, T, HV, D, device=dev).bfloat16(),
        "cu_seqlens": torch.tensor([0, *lengths], device=dev).cumsum(0),
        "initial_state": torch.randn(slots, HV, D, D, device=dev) * 0.1,
    }
    if variant == "gdn":
        x.update(g=F.logsigmoid(torch.randn(1, T, HV, device=dev) + 3), beta=torch.rand(1, T, HV, device=dev))
    elif variant == "kda":
        x.update(g=-torch.rand(1, T, HV, D, device=dev) * 2, beta=torch.rand(1, T, HV, device=dev))
        x.update(safe_gate=True, lower_bound=-5.0)
    elif variant == "gla":
        x.update(g=F.logsigmoid(torch.randn(1, T, HV, D, device=dev) + 3))
    else:
        x.update(g=F.logsigmoid(torch.randn(1, T, HV, device=dev) + 3))
    return x


def kernel_and_reference(fn, x: dict, monkeypatch) -> tuple:
    """A pooled chunk call ``fn(**x)`` served by a cuLA kernel, then by the reference on a copy of the pool as it was:
    ``(the pool before, o, state, o_ref, state_ref)``."""
    before = x["initial_state"].clone()
    o, state = fn(**x)
    assert cula.last_decision(fn).backend == "cute", cula.last_decision(fn)
    monkeypatch.setenv("CULA_BACKEND", "torch")
    o_ref, state_ref = fn(**{**x, "initial_state": before.clone()})
    return before, o, state, o_ref, state_ref


@pytest.mark.gpu
@needs_gpu
@pytest.mark.parametrize("variant", list(CHUNK_GPU))
@pytest.mark.parametrize("inplace", [True, False])
@pytest.mark.parametrize("pool_dtype", [torch.float32, torch.bfloat16])
def test_gpu_chunk_kernels_read_and_write_the_pool(monkeypatch, variant, inplace, pool_dtype):
    """Prefill on a pool: the chunk kernel reads each sequence's state from its slot and writes it back in place (or
    returns fp32 final states), against the reference on the same inputs; slots not named stay bit for bit. A bf16
    pool is read and written in bf16 (fp32 math)."""
    fn, lengths, slots = CHUNK_GPU[variant], [70, 1, 130, 64], 9
    x = gpu_chunk_call(variant, lengths, slots)
    x["initial_state"] = x["initial_state"].to(pool_dtype)
    x["ssm_state_indices"] = torch.tensor([5, 0, 8, 2], dtype=torch.int32, device="cuda")
    if not inplace:
        x.update(inplace_final_state=False, output_final_state=True)
    before, o, state, o_ref, state_ref = kernel_and_reference(fn, x, monkeypatch)
    assert rel(o, o_ref) <= 5e-3
    starts = [0, *torch.tensor(lengths).cumsum(0).tolist()]
    for n in range(len(lengths)):
        assert rel(o[:, starts[n] : starts[n + 1]], o_ref[:, starts[n] : starts[n + 1]]) <= 5e-3, n
    if inplace:
        assert state is x["initial_state"] and state.dtype == pool_dtype
        assert rel(state[[5, 0, 8, 2]].float(), state_ref[[5, 0, 8, 2]].float()) <= 5e-3
        assert torch.equal(state[[1, 3, 4, 6, 7]], before[[1, 3, 4, 6, 7]])
    else:
        assert state.dtype == torch.float32 and rel(state, state_ref) <= 5e-3
        assert torch.equal(x["initial_state"], before)


@pytest.mark.gpu
@needs_gpu
@pytest.mark.parametrize("variant", list(CHUNK_GPU))
@pytest.mark.parametrize("inplace", [True, False])
def test_gpu_chunk_kernels_skip_padding(monkeypatch, variant, inplace):
    """Prefill on a pool with padding entries: the chunk kernel's read-only pool launch, then the host path zeroes the
    padding's outputs (and final states) and writes the live sequences' states to their slots
    (:func:`cula.sm90.entry.chunk_fwd`); against the reference on the same inputs, slots not named bit for bit."""
    fn, lengths, slots = CHUNK_GPU[variant], [70, 1, 130, 64], 9
    x = gpu_chunk_call(variant, lengths, slots)
    x["ssm_state_indices"] = torch.tensor([5, -1, 8, -1], dtype=torch.int32, device="cuda")
    if not inplace:
        x.update(inplace_final_state=False, output_final_state=True)
    before, o, state, o_ref, state_ref = kernel_and_reference(fn, x, monkeypatch)
    starts = [0, *torch.tensor(lengths).cumsum(0).tolist()]
    for n in (0, 2):
        assert rel(o[:, starts[n] : starts[n + 1]], o_ref[:, starts[n] : starts[n + 1]]) <= 5e-3, n
    assert not o[:, 70:71].any() and not o[:, 201:].any()
    if inplace:
        assert rel(state[[5, 8]], state_ref[[5, 8]]) <= 5e-3
        untouched = [s for s in range(slots) if s not in (5, 8)]
        assert torch.equal(state[untouched], before[untouched])
    else:
        assert rel(state[[0, 2]], state_ref[[0, 2]]) <= 5e-3 and not state[[1, 3]].any()
        assert torch.equal(x["initial_state"], before)
