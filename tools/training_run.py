"""Train a small model built from FLA's own layers (``fla.layers``: GatedDeltaNet or KimiDeltaAttention) on a fixed
seed, once with cuLA registered with FLA and once on FLA alone (or on cuLA's reference backend), in one process on a
GPU: both loss curves, the step times and a plot.

    python tools/training_run.py --layer gdn|kda [--steps 300] [--against fla|torch] [--out DIR]

The task is copying: each sequence is T / 2 random tokens twice, so the loss on the second half falls only as the
layers learn to recall the first (the first half stays at ln(vocab)). Both runs start from the same weights and see
the same batches; the model runs under bf16 autocast. ``--against fla`` switches cuLA's registration off at run time
(``FLA_CULA=0``): FLA runs its own ops, where its backward runs (FLA refuses GDN's gated backward on Hopper with
triton < 3.7.1: there use ``--against torch``, cuLA's fp32 reference backend, over fewer steps). Writes
``training_<layer>.json`` (per run: the loss per step, the median step time, and how many of the layers' calls each
cuLA backend served, "op: backend", counted by ``cula.backend_counts``) and, with matplotlib, a PNG of the curves. cuLA
declines what its dispatch would hand to FLA (e.g. GDN's training calls where FLA's backward runs): the counts show
whether the kernels served the run at all. FLA's layers import ``transformers`` for logging and typing only: where it
is absent, stubs stand in.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import statistics
import sys
import time
import types
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))


def stub_transformers() -> None:
    """Minimal ``transformers`` modules for ``import fla.layers`` where transformers is not installed. FLA itself is
    imported first: its package init then finds ``fla.models`` unavailable, as it should, and never sees the stubs."""
    try:
        import transformers  # noqa: F401

        return
    except ImportError:
        pass

    import fla  # noqa: F401

    root = types.ModuleType("transformers")
    utils = types.ModuleType("transformers.utils")
    utils.logging = types.SimpleNamespace(get_logger=logging.getLogger)
    activations = types.ModuleType("transformers.activations")
    activations.ACT2FN = {}
    processing = types.ModuleType("transformers.processing_utils")
    processing.Unpack = dict
    for name, module in (
        ("transformers", root), ("transformers.utils", utils), ("transformers.activations", activations),
        ("transformers.processing_utils", processing),
    ):  # fmt: skip
        sys.modules[name] = module


def build_model(layer: str, vocab: int, hidden: int, n_layers: int):
    """Embedding, ``n_layers`` blocks of [RMSNorm, FLA layer, residual; RMSNorm, MLP, residual], RMSNorm, head.
    Heads of 128 (K = V), as cuLA's kernels take them."""
    import torch.nn as nn
    from fla.layers import GatedDeltaNet, KimiDeltaAttention

    heads = hidden // 128

    def mixer(i):
        if layer == "gdn":
            return GatedDeltaNet(hidden_size=hidden, head_dim=128, num_heads=heads, expand_v=1, layer_idx=i)
        return KimiDeltaAttention(
            hidden_size=hidden, head_dim=128, num_heads=heads, expand_v=1, safe_gate=True, lower_bound=-5.0, layer_idx=i
        )

    class Block(nn.Module):
        def __init__(self, i):
            super().__init__()
            self.norm1, self.norm2 = nn.RMSNorm(hidden), nn.RMSNorm(hidden)
            self.mixer = mixer(i)
            self.mlp = nn.Sequential(nn.Linear(hidden, 4 * hidden), nn.GELU(), nn.Linear(4 * hidden, hidden))

        def forward(self, x):
            x = x + self.mixer(self.norm1(x))[0]
            return x + self.mlp(self.norm2(x))

    class Model(nn.Module):
        def __init__(self):
            super().__init__()
            self.embed = nn.Embedding(vocab, hidden)
            self.blocks = nn.ModuleList(Block(i) for i in range(n_layers))
            self.norm = nn.RMSNorm(hidden)
            self.head = nn.Linear(hidden, vocab, bias=False)

        def forward(self, tokens):
            x = self.embed(tokens)
            for block in self.blocks:
                x = block(x)
            return self.head(self.norm(x))

    return Model()


def copy_batches(steps: int, batch: int, T: int, vocab: int, seed: int):
    """``steps`` batches [batch, T] of T / 2 random tokens twice, from one generator seeded with ``seed``."""
    import torch

    gen = torch.Generator().manual_seed(seed)
    for _ in range(steps):
        half = torch.randint(0, vocab, (batch, T // 2), generator=gen)
        yield torch.cat([half, half], dim=1)


def train(opts, backend: str) -> dict:
    """One run: ``backend`` "cula" (registered with FLA), "fla" (registration off) or "torch" (cuLA's reference
    backend through the registration). Returns the loss per step, the step times (ms) and what served cuLA's
    calls (``cula.backend_counts``)."""
    import torch
    import torch.nn.functional as F

    import cula

    cula.register_with_fla()
    os.environ["FLA_CULA"] = "0" if backend == "fla" else "1"
    os.environ.pop("CULA_BACKEND", None)
    if backend == "torch":
        os.environ["CULA_BACKEND"] = "torch"
    torch.manual_seed(opts.seed)
    model = build_model(opts.layer, opts.vocab, opts.hidden, opts.layers).cuda()
    optimizer = torch.optim.AdamW(model.parameters(), lr=opts.lr)
    losses, times = [], []
    with cula.backend_counts() as counts:
        for tokens in copy_batches(opts.steps, opts.batch, opts.seq_len, opts.vocab, opts.seed):
            tokens = tokens.cuda()
            torch.cuda.synchronize()
            start = time.perf_counter()
            with torch.autocast("cuda", dtype=torch.bfloat16):
                logits = model(tokens[:, :-1])
            loss = F.cross_entropy(logits.float().flatten(0, 1), tokens[:, 1:].flatten())
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            optimizer.step()
            torch.cuda.synchronize()
            times.append((time.perf_counter() - start) * 1e3)
            losses.append(loss.item())
            if len(losses) % 50 == 0:
                print(f"{backend} step {len(losses)} loss {losses[-1]:.4f} {times[-1]:.1f} ms", flush=True)
    served = {f"{op}: {server}": n for (op, server), n in sorted(counts.items())}
    print(f"{backend}: served {served or 'by FLA alone (no cuLA call)'}", flush=True)
    return {"loss": losses, "step_ms_median": statistics.median(times[5:] or times), "served": served}


def plot(result: dict, path: Path) -> None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("no matplotlib: plot skipped", flush=True)
        return
    fig, ax = plt.subplots(figsize=(7, 4))
    for backend, run in result["runs"].items():
        ax.plot(run["loss"], label=f"{backend} ({run['step_ms_median']:.1f} ms/step)")
    ax.set_xlabel("step")
    ax.set_ylabel("loss")
    ax.set_title(f"{result['layer']}: copy task, seed {result['seed']}")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layer", choices=("gdn", "kda"), default="gdn")
    parser.add_argument("--against", choices=("fla", "torch"), default="fla")
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--seq-len", type=int, default=1024)
    parser.add_argument("--vocab", type=int, default=256)
    parser.add_argument("--hidden", type=int, default=256)
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--lr", type=float, default=1e-3)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", default="results")
    opts = parser.parse_args()
    stub_transformers()
    result = {"layer": opts.layer, "seed": opts.seed, "options": vars(opts), "runs": {}}
    for backend in ("cula", opts.against):
        result["runs"][backend] = train(opts, backend)
    a, b = (result["runs"][name]["loss"] for name in ("cula", opts.against))
    result["max_loss_difference"] = max(abs(x - y) for x, y in zip(a, b, strict=True))
    out = Path(opts.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / f"training_{opts.layer}.json").write_text(json.dumps(result))
    plot(result, out / f"training_{opts.layer}.png")
    summary = {name: run["step_ms_median"] for name, run in result["runs"].items()}
    print(json.dumps({"max_loss_difference": result["max_loss_difference"], "step_ms": summary}), flush=True)


if __name__ == "__main__":
    main()
