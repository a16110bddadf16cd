"""CPU time of the host conversions (FP8 E4M3 and FP16 to FP32), this engine against another.

Times ``engine.materialize`` of one host-resident state (the CPU stager's ring, then the
conversion into a kept output buffer, so no page faults) at torch's default thread count,
interleaving the engines round by round; prints and optionally writes the medians.

    python benchmarks/host_convert.py --baseline 3750be5 --out results/cpu_host_convert.json
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from types import ModuleType
from typing import Any

import torch

ROOT = Path(__file__).resolve().parents[1]


def load_engine(rev: str | None) -> ModuleType:
    """``te_ckpt_placement/_export.py`` of this tree, or of git revision ``rev``, as a module."""
    if rev is None:
        from te_ckpt_placement import _export as engine

        return engine
    for name in ("_export.py", "engine.py"):  # the module's name before and after the renames
        shown = subprocess.run(
            ["git", "show", f"{rev}:te_ckpt_placement/{name}"],
            cwd=ROOT,
            capture_output=True,
            text=True,
        )
        if shown.returncode == 0:
            break
    shown.check_returncode()
    source = shown.stdout
    path = Path(tempfile.mkdtemp()) / f"engine_{rev}.py"
    path.write_text(source)
    spec = importlib.util.spec_from_file_location(f"engine_{rev}", path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up
    spec.loader.exec_module(module)
    return module


def sources(engine: ModuleType, numel: int) -> dict[str, Any]:
    gen = torch.Generator().manual_seed(0)
    fp8 = torch.randint(0, 256, (numel,), generator=gen, dtype=torch.uint8)
    fp8[fp8 & 0x7F == 0x7F] = 0  # no NaN bytes: the common case
    fp16 = (torch.randn(numel, generator=gen) * 1000).half()
    scale = torch.tensor([3.0517578e-05])
    tiny = torch.tensor([0x04D55555], dtype=torch.int32).view(torch.float32)  # ~2**-118
    e4m3 = torch.float8_e4m3fn
    state = engine.StateSource
    return {
        "fp8": state(kind="fp8", data=fp8, scale=scale, fp8_dtype=e4m3),
        "fp16": state(kind="scaled", data=fp16, scale=scale),
        "fp8_tiny_scale": state(kind="fp8", data=fp8, scale=tiny, fp8_dtype=e4m3),
        "fp16_tiny_scale": state(kind="scaled", data=fp16, scale=tiny.mul(2.0**15)),  # ~2**-103
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--baseline", default=None, help="git revision to compare against")
    parser.add_argument("--numel", type=int, default=64 << 20)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args()
    engines = {"this": load_engine(None)}
    if args.baseline:
        engines[args.baseline] = load_engine(args.baseline)
    cases = {name: sources(engine, args.numel) for name, engine in engines.items()}
    times: dict[str, dict[str, list[float]]] = {e: {c: [] for c in cases[e]} for e in engines}
    for _ in range(args.repeats + 1):  # the first round warms the pools and kept buffers
        for case in cases["this"]:
            for name, engine in engines.items():
                start = time.perf_counter()
                engine.materialize(cases[name][case], reuse_buffers=True)
                times[name][case].append(time.perf_counter() - start)
    medians = {e: {c: statistics.median(t[1:]) for c, t in ts.items()} for e, ts in times.items()}
    result: dict[str, Any] = {
        "numel": args.numel,
        "threads": torch.get_num_threads(),
        "cpu": os.uname().machine,
        "torch": torch.__version__,
        "median_s": medians,
        "all_s": times,
    }
    for case in cases["this"]:
        line = "  ".join(f"{e} {result['median_s'][e][case] * 1e3:7.1f} ms" for e in engines)
        print(f"{case:16s} {line}")
    if args.out is not None:
        args.out.write_text(json.dumps(result, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
