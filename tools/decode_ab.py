"""A/B of the token-by-token kernel's compile-time shape fields on a GPU: ``benchmarks.decode`` once per setting, each
in its own process (compiled kernels are cached per process), the cuLA graph-replayed times side by side.

    python tools/decode_ab.py --out DIR --setting NAME:FIELD=VALUE,... [--setting ...] [benchmarks.decode arguments]

e.g. ``--setting today: --setting "narrow:block_v=32,vec=4" --n 256 --calls "flashinfer bf16"``.
A setting's fields (of :class:`cula.recurrent.kernel.RecurrentConfig`) replace those ``cula.recurrent.plan.config_for``
chooses, on every call whose configuration accepts them (the others keep the plan's, and the table says so);
an empty setting is the plan's own choice. Writes each setting's ``decode.json`` under DIR/<n> and ``ab.md`` in DIR.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path

CHILD = "CULA_DECODE_AB_FIELDS"


def parse_setting(text: str) -> tuple[str, dict]:
    """``NAME:FIELD=VALUE,...`` -> (name, fields); values are ints where they parse as one."""
    name, _, spec = text.partition(":")
    fields = {}
    for item in filter(None, spec.split(",")):
        key, _, value = item.partition("=")
        fields[key.strip()] = int(value) if value.strip().lstrip("-").isdigit() else value.strip()
    return name, fields


def run_child(argv: list[str]) -> int:
    """Runs ``benchmarks.decode`` with the fields in the environment laid over the plan's choices."""
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    from benchmarks import decode
    from cula.recurrent import fwd_sm90
    from cula.recurrent.kernel import RecurrentConfig

    fields = json.loads(os.environ[CHILD])
    planned = fwd_sm90.config_for
    declined = set()

    def config_for(args, gates):
        chosen = planned(args, gates)
        try:
            RecurrentConfig(**{**chosen, **fields})
        except AssertionError:
            declined.add(json.dumps({k: chosen[k] for k in fields}))
            return chosen
        return {**chosen, **fields}

    fwd_sm90.config_for = config_for
    code = decode.main(argv)
    if declined:
        print(f"kept the plan's fields where the setting does not apply: {sorted(declined)}", flush=True)
    return code


def main() -> int:
    if CHILD in os.environ:
        return run_child(sys.argv[1:])
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", required=True)
    parser.add_argument("--setting", action="append", required=True, help="NAME:FIELD=VALUE,...")
    opts, rest = parser.parse_known_args()
    out = Path(opts.out)
    results = []
    for i, text in enumerate(opts.setting):
        name, fields = parse_setting(text)
        folder = out / str(i)
        env = {**os.environ, CHILD: json.dumps(fields)}
        print(f"== {name}: {fields or 'the plan'}", flush=True)
        code = subprocess.call([sys.executable, __file__, "--out", str(folder), *rest], env=env)
        rows = json.loads((folder / "decode.json").read_text())["rows"] if code == 0 else []
        results.append((name, rows))
    keys = []
    for _, rows in results:
        keys += [(r["variant"], r["N"], r["call"]) for r in rows if (r["variant"], r["N"], r["call"]) not in keys]
    names = [name for name, _ in results]
    lines = [
        "cuLA graph-replayed ms per setting (the peer's from the first setting's run)",
        "",
        "| variant | N | call | peer | " + " | ".join(names) + " |",
        "|---" * (4 + len(names)) + "|",
    ]
    for key in keys:
        cells, peer = [], None
        for _, rows in results:
            row = next((r for r in rows if (r["variant"], r["N"], r["call"]) == key), None)
            cells.append("-" if row is None or row["cula_graph_ms"] is None else f"{row['cula_graph_ms']:.3f}")
            if peer is None and row is not None:
                peer = row.get("flashinfer_graph_ms") or row.get("fla_graph_ms")
        lines.append(
            f"| {key[0]} | {key[1]} | {key[2]} | {'-' if peer is None else f'{peer:.3f}'} | " + " | ".join(cells) + " |"
        )
    table = "\n".join(lines) + "\n"
    (out / "ab.md").write_text(table)
    print(table)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
