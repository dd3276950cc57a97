"""tools/training_run.py on the CPU: what it can check without a GPU (the run itself needs one)."""

from __future__ import annotations

import sys
from pathlib import Path

import torch
import torch.nn.functional as F

import cula

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tools"))
import training_run  # noqa: E402


def test_dispatch_counts_name_the_backend_of_every_call(monkeypatch, caplog):
    """The counts say which backend served each call, silently (nothing reaches the log's other handlers)."""
    monkeypatch.delenv("CULA_BACKEND", raising=False)
    args = {
        "q": torch.randn(1, 9, 2, 16),
        "k": F.normalize(torch.randn(1, 9, 2, 16), dim=-1),
        "v": torch.randn(1, 9, 2, 16),
        "g": F.logsigmoid(torch.randn(1, 9, 2)),
        "beta": torch.rand(1, 9, 2),
    }
    handler = training_run.count_dispatch()
    try:
        cula.gdn.chunk_gated_delta_rule(**args)
        cula.gdn.chunk_gated_delta_rule(**args)
        cula.lightning.chunk_simple_gla(args["q"], args["k"], args["v"], g=args["g"])
    finally:
        training_run.stop_counting(handler)
    assert dict(handler.counts) == {"gdn.chunk_gated_delta_rule: torch": 2, "lightning.chunk_simple_gla: torch": 1}
    assert "served by" not in caplog.text
    cula.gdn.chunk_gated_delta_rule(**args)  # counting stopped
    assert sum(handler.counts.values()) == 3
