"""The launch of the token-by-token kernel (:mod:`cula.recurrent.kernel`) for a call that
:mod:`cula.recurrent.plan` has accepted, its compilation, and its compile-checked configurations (sm_90a, sm_100a and
sm_103a: the kernel is SIMT, nothing in it is specific to one of them). Imports the CuTe DSL."""

from __future__ import annotations

from typing import Any

import torch

from cula import runtime
from cula.recurrent.plan import Gates, config_for
from cula.sm90.entry import cached_zeros


def compile_recurrent(arch: str = "sm_90a", keep_artifacts: bool = False, **fields):
    """The kernel for ``fields`` (:class:`RecurrentConfig`), compiled on any machine for ``arch``."""
    import cutlass

    from cula.recurrent.kernel import DTYPES, RecurrentConfig, RecurrentFwd

    cfg = RecurrentConfig(**fields)
    sym = runtime.sym_int
    K, V = cfg.head_k, cfg.head_v
    f32 = cutlass.Float32
    io = DTYPES[cfg.io_dtype]
    B, T, H, HV = sym(), sym(), sym(), sym()
    state_order = (3, 2, 0, 1) if cfg.state_v_first else None

    def per_token(dtype: str, *inner):  # a gate's or beta's tensor, or its dummy: own symbolic batch and length
        dt = DTYPES[dtype]
        return runtime.fake_tensor(dt, (sym(), sym(), sym(), *inner), align=16 if inner else dt.width // 8)

    def index(dtype: str, rank: int):
        dt = DTYPES["int32" if dtype == "none" else dtype]
        return runtime.fake_tensor(dt, tuple(sym() for _ in range(rank)), align=dt.width // 8)

    fake = (
        runtime.fake_tensor(io, (B, T, H, K)),
        runtime.fake_tensor(io, (B, T, H, K)),
        runtime.fake_tensor(io, (B, T, HV, V)),
        runtime.fake_tensor(io, (B, T, HV, V)),
        per_token(cfg.g_dtype),
        runtime.fake_tensor(f32, (sym(),), align=4),
        per_token(cfg.gk_dtype, K),
        per_token(cfg.gv_dtype, V),
        per_token(cfg.beta_dtype),
        runtime.fake_tensor(f32, (sym(),), align=4),
        runtime.fake_tensor(f32, (sym(),), align=4),
        runtime.fake_tensor(DTYPES[cfg.state_dtype], (sym(), sym(), K, V), state_order),
        runtime.fake_tensor(f32, (sym(), sym(), K, V), state_order),
        index(cfg.indices, 2),
        index(cfg.accepted, 1),
        index(cfg.cu_dtype, 1),
        f32(1.0),
        f32(0.0),
        runtime.fake_stream(),
    )
    return runtime.compile_kernel(RecurrentFwd(cfg), fake, arch, keep_artifacts)


def run(args: dict[str, Any], gates: Gates) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Launch the kernel for a validated fused-recurrent call. Returns ``(o, final state, the pool, or None)`` as
    the reference does (:mod:`cula.ops.state_pool`)."""
    q, k, v = args["q"].contiguous(), args["k"].contiguous(), args["v"].contiguous()
    B, T, H, K = q.shape
    HV, V = v.shape[2], v.shape[3]
    dev = q.device
    fields = config_for(args, gates)
    cu = args.get("cu_seqlens")
    N = B if cu is None else cu.numel() - 1
    scale = K**-0.5 if args.get("scale") is None else float(args["scale"])
    v_first = fields["state_v_first"]

    def states_view(x: torch.Tensor) -> torch.Tensor:  # storage to the kernel's (.., K, V) view
        return x.transpose(-1, -2) if v_first else x

    def given(x: torch.Tensor | None, dummy_shape: tuple, dtype=torch.float32) -> torch.Tensor:
        return cached_zeros(dev, dummy_shape, dtype) if x is None else x.contiguous()

    o = torch.empty(B, T, HV, V, dtype=q.dtype, device=dev)
    h0 = args.get("initial_state")
    ht = None
    if fields["final"] == "ht":
        ht = torch.empty((N, HV, V, K) if v_first else (N, HV, K, V), dtype=torch.float32, device=dev)
    indices, accepted = args.get("ssm_state_indices"), args.get("num_accepted_tokens")
    if indices is not None:
        indices = indices.reshape(N, -1)
    state_dummy = cached_zeros(dev, (1, 1, V, K) if v_first else (1, 1, K, V), torch.float32)
    g_dummy = (1, 1, 1)
    launch_args = (
        q, k, v, o,
        given(gates.g, g_dummy),
        given(None if gates.g_gamma is None else gates.g_gamma.float(), (1,)),
        given(gates.gk, (1, 1, 1, K)),
        given(gates.gv, (1, 1, 1, V)),
        given(gates.beta, g_dummy),
        given(None if gates.A_log is None else gates.A_log.float(), (HV,)),
        given(None if gates.dt_bias is None else gates.dt_bias.float(), (HV * K,)),
        states_view(h0 if h0 is not None else state_dummy),
        states_view(ht if ht is not None else state_dummy),
        given(indices, (1, 1), torch.int32),
        given(accepted, (1,), torch.int32),
        given(cu, (2,), torch.int32),
        scale,
        0.0 if gates.lower_bound is None else float(gates.lower_bound),
    )  # fmt: skip
    key = ("RecurrentFwd", runtime.device_arch(dev), tuple(sorted(fields.items())))
    fn = runtime.get_or_compile(key, lambda: compile_recurrent(key[1], **fields))
    fn(*launch_args)
    if fields["final"] == "inplace":
        return o, h0
    return o, ht


# The compile-checked configurations: what each variant's decode and verify calls ask for.
CHECKED_CONFIGS = {
    "[gdn, pool, token slots, accepted]": {
        "g": "log", "beta": "given", "qk_l2norm": True, "is_varlen": True, "has_initial_state": True,
        "indices": "int32", "accepted": "int32", "token_slots": True, "final": "inplace",
    },
    "[gdn, gate in kernel, bf16 pool, V-first]": {
        "g": "gdn", "g_dtype": "bfloat16", "beta": "given", "beta_dtype": "bfloat16", "beta_sigmoid": True,
        "state_v_first": True, "state_dtype": "bfloat16", "has_initial_state": True, "indices": "int64",
        "final": "inplace",
    },
    "[kda, sigmoid gate, D=64]": {
        "head_k": 64, "head_v": 64, "gk": "kda_sigmoid", "gk_dtype": "bfloat16", "beta": "given", "qk_l2norm": True,
        "has_initial_state": True, "final": "ht",
    },
    "[kda, softplus gate, V-first, D=64]": {
        "head_k": 64, "head_v": 64, "gk": "kda_softplus", "beta": "given", "beta_sigmoid": True,
        "neg_eigval": True, "state_v_first": True, "has_initial_state": True, "final": "ht",
    },
    "[gla, gk and gv, varlen int64]": {
        "gk": "log", "gv": True, "is_varlen": True, "cu_dtype": "int64", "has_initial_state": True, "final": "ht",
    },
    "[lightning, fp16]": {"io_dtype": "float16", "gamma": True, "final": "ht"},
    "[kda, bf16 pool]": {
        "gk": "log", "beta": "given", "qk_l2norm": True, "state_dtype": "bfloat16", "has_initial_state": True,
        "indices": "int32", "final": "inplace",
    },
    # the wide block shapes (cula.recurrent.plan.block_shape)
    "[gdn, bf16 pool, V-first, 64 x 8]": {
        "g": "gdn", "beta": "given", "beta_sigmoid": True, "qk_l2norm": True, "state_v_first": True,
        "state_dtype": "bfloat16", "has_initial_state": True, "indices": "int32", "final": "inplace",
        "block_v": 64, "vec": 8,
    },
    "[gdn, fp32 state, 64 x 4]": {
        "g": "log", "beta": "given", "qk_l2norm": True, "has_initial_state": True, "final": "ht", "block_v": 64,
    },
}  # fmt: skip

runtime.register_kernel(
    "recurrent_fwd",
    ["sm_90a", "sm_100a", "sm_103a"],
    lambda arch: compile_recurrent(arch, **CHECKED_CONFIGS["[gdn, pool, token slots, accepted]"]),
    ["ld.global.v4.b32", "st.global.v4.b32", "shfl.sync.bfly"],
    clean_sass=True,
)
for _suffix, _fields in CHECKED_CONFIGS.items():
    if _suffix != "[gdn, pool, token slots, accepted]":
        runtime.register_kernel(
            f"recurrent_fwd{_suffix}",
            ["sm_90a", "sm_100a", "sm_103a"],
            lambda arch, fields=_fields: compile_recurrent(arch, **fields),
            ["shfl.sync.bfly"],
            clean_sass=True,
        )
