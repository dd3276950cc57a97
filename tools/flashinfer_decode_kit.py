"""Adds FlashInfer's GDN decode (its SM90 CuTe DSL kernels) to the GPU machine's kit, beside the prefill path that
``../shared/device/prepare.sh`` puts in ``.device/b/fi``: the API module and its kernel files verbatim from the
wheel prepare.sh downloaded, and three small modules of our own in place of FlashInfer's JIT package (its logger,
and a kernel loader that compiles in the process instead of caching to disk).

    bash ../shared/device/prepare.sh && python tools/flashinfer_decode_kit.py

``benchmarks.decode`` then times ``flashinfer.gdn_decode.gated_delta_rule_decode_pretranspose`` beside cuLA's
kernel (``benchmarks.peers.FlashInferGDNDecode``).
"""

from __future__ import annotations

import sys
import zipfile
from pathlib import Path

FILES = [
    "flashinfer/gdn_decode.py",
    "flashinfer/gdn_kernels/gdn_decode_pretranspose.py",
    "flashinfer/gdn_kernels/gdn_decode_nontranspose.py",
    "flashinfer/gdn_kernels/gdn_decode_bf16_state.py",
    "flashinfer/gdn_kernels/gdn_decode_mtp.py",
    "flashinfer/gdn_kernels/cute_dsl_cache_naming.py",
    "flashinfer/gdn_kernels/device_target.py",
    "flashinfer/gdn_kernels/dtype_compat.py",
]

# In place of flashinfer/jit: what the decode modules import from it.
SHIMS = {
    "flashinfer/jit/__init__.py": '"""Shim of FlashInfer\'s JIT package for its CuTe DSL GDN decode (cuLA kit)."""\n',
    "flashinfer/jit/core.py": (
        '"""Shim: the logger the GDN decode modules import."""\n\nimport logging\n\n'
        'logger = logging.getLogger("flashinfer")\n'
    ),
    "flashinfer/jit/cute_dsl_core.py": (
        '"""Shim: the kernels compiled in the process, never cached on disk."""\n\n\n'
        "def build_and_load_cute_dsl_kernel(module_name, kernel_name, compile_fn, extra_key_files=()):\n"
        "    return compile_fn()\n"
    ),
}


def main(root: Path = Path(".device")) -> int:
    wheels = sorted((root / "dl").glob("flashinfer_python-*.whl"))
    fi = root / "b" / "fi"
    if not wheels or not (fi / "flashinfer").is_dir():
        print("run ../shared/device/prepare.sh first (it downloads the wheel and makes .device/b/fi)")
        return 1
    with zipfile.ZipFile(wheels[-1]) as z:
        for name in FILES:
            z.extract(name, fi)
    for name, text in SHIMS.items():
        (fi / name).parent.mkdir(parents=True, exist_ok=True)
        (fi / name).write_text(text)
    print(f"FlashInfer's GDN decode added to {fi}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
