"""A training step through the kernels never makes the host wait for the GPU: no stream synchronisation, no copy
from pageable host memory (which waits for the stream), no ``.item()``, on a long sequence the forward splits across
CTAs and on a varlen batch given with ``cu_seqlens_cpu``. A wait inside the step stalls the host behind the forward's
kernels and then leaves the GPU idle while the host prepares the backward's launches (PERF.md, the backward). The
host-made plans the step copies to the GPU are made afresh in the checked step, not taken from their caches."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

import cula
from cula.ops import chunk_backward, segment_split

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(
        not torch.cuda.is_available() or torch.cuda.get_device_capability()[0] != 9, reason="needs an SM90 GPU"
    ),
]

D = 128
OPS = {
    "simple_gla": cula.lightning.chunk_simple_gla,
    "gdn": cula.gdn.chunk_gated_delta_rule,
    "gla": cula.gla.chunk_gla,
}


def step_inputs(op: str, layout: str) -> tuple[dict, torch.Tensor]:
    """Leaves that require grad and the output's cotangent: B1 T4096 H2 ("long", split by the forward) or four
    sequences of 1, 700, 64 and 300 tokens (``cu_seqlens`` with ``cu_seqlens_cpu``)."""
    torch.manual_seed(0)
    lengths = [4096] if layout == "long" else [1, 700, 64, 300]
    T, H = sum(lengths), 2
    dev = "cuda"
    args = {
        "q": torch.randn(1, T, H, D, device=dev).bfloat16(),
        "k": F.normalize(torch.randn(1, T, H, D, device=dev), dim=-1).bfloat16(),
        "v": torch.randn(1, T, H, D, device=dev).bfloat16(),
    }
    if op == "gdn":
        args["g"] = F.logsigmoid(torch.randn(1, T, H, device=dev) + 3.0)
        args["beta"] = torch.rand(1, T, H, device=dev)
    elif op == "gla":
        args["g"] = F.logsigmoid(torch.randn(1, T, H, D, device=dev) + 3.0)
    else:
        args["g"] = F.logsigmoid(torch.randn(1, T, H, device=dev) + 3.0)
    args = {n: x.requires_grad_() for n, x in args.items()}
    if layout == "varlen":
        offsets = torch.tensor([0, *lengths]).cumsum(0)
        args["cu_seqlens"] = offsets.to(dev, torch.int32)
        args["cu_seqlens_cpu"] = offsets.to(torch.int32)
    return args, torch.randn(1, T, H, D, device=dev).bfloat16()


@pytest.mark.parametrize("layout", ["long", "varlen"])
@pytest.mark.parametrize("op", sorted(OPS))
def test_a_training_step_never_waits_for_the_gpu(op, layout, monkeypatch):
    monkeypatch.setenv("CULA_BACKEND", "cute")
    fn = OPS[op]
    args, do = step_inputs(op, layout)

    def step():
        o, _ = fn(**args)
        o.backward(do)

    step()  # compiles the kernels
    torch.cuda.synchronize()
    # the host-made plans are kept per batch layout: made again here, their copies to the GPU are checked too
    chunk_backward._chunk_rows.cache_clear()
    segment_split._split_plan.cache_clear()
    with cula.backend_counts() as counts:
        torch.cuda.set_sync_debug_mode("error")
        try:
            step()
        finally:
            torch.cuda.set_sync_debug_mode(0)
    torch.cuda.synchronize()
    assert counts and all(backend == "cute" for _, backend in counts), counts
    assert all(torch.isfinite(x.grad).all() for x in args.values() if x.requires_grad)
