"""Soak: many consecutive streaming export/import cycles with real TE FusedAdam; memory stays flat.

Records, for the first and the last cycle, GPU allocated and reserved bytes, host RSS and the
pinned staging pool, as ``op: "soak"`` records in the results format.

Usage:
    python benchmarks/soak.py --cycles 200 --out benchmarks/results/h200_soak.json
"""

from __future__ import annotations

import argparse
import gc
import json
import sys
import time
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks._measure import MI, build, machine, requirements_missing, rss


def snapshot() -> dict[str, int]:
    from te_ckpt_placement import pinned_pool_bytes

    gc.collect()
    torch.cuda.synchronize()
    return {
        "gpu_allocated_bytes": torch.cuda.memory_allocated(),
        "gpu_reserved_bytes": torch.cuda.memory_reserved(),
        "host_rss_bytes": rss(),
        "pinned_pool_bytes": pinned_pool_bytes(),
    }


def soak(cycles: int, n: int, m: int, moments: torch.dtype, reuse: bool) -> dict[str, Any]:
    from te_ckpt_placement import export_placement

    _, opt = build(n, m, moments)
    policy = export_placement("cpu", reuse_buffers=reuse)
    first: dict[str, int] = {}
    start = time.perf_counter()
    for cycle in range(cycles):
        with policy:
            state = opt.state_dict()
            opt.load_state_dict(state)
        del state
        if cycle == 0:
            first = snapshot()
    last = snapshot()
    seconds = time.perf_counter() - start
    label = {torch.bfloat16: "bf16", torch.float16: "fp16", torch.uint8: "fp8"}[moments]
    record = {
        "op": "soak",
        "mode": "placement_cpu_reuse_buffers" if reuse else "placement_cpu",
        "moments": label,
        "cycles": cycles,
        "n_elements": n,
        "max_elements": m,
        "seconds": seconds,
        "first": first,
        "last": last,
        **{f"first_{k}": v for k, v in first.items()},
        **{f"last_{k}": v for k, v in last.items()},
    }
    growth = {k: last[k] - first[k] for k in first}
    record["growth"] = growth
    print(f"{record['mode']} {label}: {cycles} cycles in {seconds:.1f} s, growth {growth}")
    print(f"  first cycle {first}\n  last cycle  {last}", flush=True)
    return record


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--cycles", type=int, default=200)
    parser.add_argument("--n", type=int, default=64 * MI)
    parser.add_argument("--m", type=int, default=16 * MI)
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args()
    missing = requirements_missing()
    if missing:
        print(f"The soak needs a CUDA GPU and Transformer Engine: {missing}.", file=sys.stderr)
        return 2
    records = []
    for moments, reuse in ((torch.bfloat16, False), (torch.uint8, True)):
        records.append(soak(args.cycles, args.n, args.m, moments, reuse=reuse))
        if args.out is not None:  # written after each soak, so a cut-off run keeps what it did
            args.out.write_text(
                json.dumps({"machine": machine(), "records": records}, indent=1) + "\n"
            )
    # Flat means: no GPU growth at all, a pool that does not grow, and host RSS within one
    # output's worth of allocator noise (glibc may keep freed small blocks).
    failures = []
    for r in records:
        g = r["growth"]
        if g["gpu_allocated_bytes"] or g["gpu_reserved_bytes"] or g["pinned_pool_bytes"]:
            failures.append(f"{r['mode']}: device or pinned memory grew: {g}")
        if g["host_rss_bytes"] > 64 * MI:
            failures.append(f"{r['mode']}: host RSS grew by {g['host_rss_bytes']} bytes")
    for f in failures:
        print("NOT FLAT:", f)
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
