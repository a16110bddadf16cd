"""A/B of the export engine's tuning knobs on one host, in one run: chunk size and FP8 decode.

Each variant's first export is checked bit for bit against TE's own conversion before any time is
kept. For every variant it times a first save (``placement_cpu``: fresh output memory) and a
repeated save (``placement_cpu_reuse_buffers``, after one export that fills the kept buffers),
over ``--rounds`` rounds with the variants interleaved, so drift on the host shows up as spread
rather than as a difference between variants. Records carry the bounds of the speed issue
(``bound_seconds``, ``repeat``, bandwidths) and the variant (``chunk_mib``, ``fp8_decode``,
``block_elements``).

Usage:
    python benchmarks/speed_ab.py --out benchmarks/results/h200_speed_ab.json
"""

from __future__ import annotations

import argparse
import gc
import json
import statistics
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.export_memory import (
    MI,
    MOMENTS,
    bandwidths,
    build,
    export_fn,
    machine,
    measure,
    requirements_missing,
    state_bytes,
    timed,
    verify,
)
from te_ckpt_placement.engine import CHUNK_BYTES

CHUNK_MIB = CHUNK_BYTES // MI


def block_label(variant: dict[str, Any]) -> str:
    from te_ckpt_placement import engine

    block = variant["block_elements"]
    if block is None:
        return f"auto({engine._block_elements() >> 20}M)"
    return f"{block >> 20}M"


def _legacy_e4m3(raw: torch.Tensor, out: torch.Tensor, scratch: Any, *, scale: float) -> None:
    """The previous FP8 path: torch's FP8 widening, a multiply and an isnan mask."""
    from te_ckpt_placement.engine import _canonicalize_nan

    out.copy_(raw.view(torch.float8_e4m3fn))
    out.mul_(scale)
    _canonicalize_nan(out)


def variants(moments: str, chunks: list[int], blocks: list[int | None]) -> list[dict[str, Any]]:
    """Every chunk size; for FP16 and FP8 (multi-pass, blocked) also the block sizes at the
    default chunk size, and for FP8 the previous decode."""
    default = {"chunk_mib": CHUNK_MIB, "fp8_decode": "bits", "block_elements": None}
    out = [{**default, "chunk_mib": c} for c in chunks]
    if moments in ("fp16", "fp8"):
        out += [{**default, "block_elements": b} for b in blocks if b is not None]
    if moments == "fp8":
        out.append({**default, "fp8_decode": "legacy"})
    return out


def apply(variant: dict[str, Any], bits_decode: Callable[..., None]) -> None:
    from te_ckpt_placement import engine, release_buffers

    release_buffers()  # the next export allocates a pool of the new chunk size
    engine.CHUNK_BYTES = variant["chunk_mib"] * MI
    engine.BLOCK_ELEMENTS = variant["block_elements"]  # None: the engine's own choice
    engine._dequantize_e4m3 = bits_decode if variant["fp8_decode"] == "bits" else _legacy_e4m3


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--out", type=Path, default=None)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--chunks", default="16,32,64,128", help="chunk sizes in MiB")
    parser.add_argument(
        "--te-baseline",
        action="store_true",
        help="also time TE's export + DCP cpu_offload once per case (round 0)",
    )
    parser.add_argument(
        "--blocks",
        default="4,8,16",
        help="FP16/FP8 blocks, Mi elements",
    )
    parser.add_argument(
        "--cases", default="1024:64:bf16,1024:16:bf16,1024:64:fp16,1024:64:fp8", help="N:M:moments"
    )
    args = parser.parse_args()
    missing = requirements_missing()
    if missing:
        print(f"This A/B needs a CUDA GPU and Transformer Engine: {missing}.", file=sys.stderr)
        return 2
    from te_ckpt_placement import engine, release_buffers

    bits_decode = engine._dequantize_e4m3
    chunks = [int(c) for c in args.chunks.split(",")]
    blocks: list[int | None] = [None, *(int(b) << 20 for b in args.blocks.split(",") if b)]
    bw = bandwidths()
    print({k: f"{v / 1e9:.1f} GB/s" for k, v in bw.items()}, flush=True)
    records: list[dict[str, Any]] = []

    def save() -> None:
        if args.out is not None:
            doc = {"machine": machine(), "bandwidths": bw, "records": records}
            args.out.write_text(json.dumps(doc, indent=1) + "\n")

    for case in args.cases.split(","):
        n_mi, m_mi, moments = case.split(":")
        model, opt = build(int(n_mi) * MI, int(m_mi) * MI, MOMENTS[moments])
        raw_bytes, out_bytes = state_bytes(opt)
        bounds = {
            False: max(raw_bytes / bw["d2h"], out_bytes / bw["fresh"]),
            True: max(raw_bytes / bw["d2h"], out_bytes / bw["warm"]),
        }
        checked: set[int] = set()
        if args.te_baseline:
            result = measure("te_default_dcp_cpu_offload", model, opt)  # verified inside
            rec = {
                "op": "export",
                "mode": "te_default_dcp_cpu_offload",
                "moments": moments,
                "n_elements": int(n_mi) * MI,
                "max_elements": int(m_mi) * MI,
                "raw_bytes": raw_bytes,
                "output_bytes": out_bytes,
                "round": 0,
                **result,
                "repeat": False,
                "bound_seconds": bounds[False],
                "d2h_bytes_per_s": bw["d2h"],
                "host_fresh_bytes_per_s": bw["fresh"],
                "host_warm_bytes_per_s": bw["warm"],
            }
            rec["seconds_over_bound"] = rec["seconds"] / rec["bound_seconds"]
            records.append(rec)
            print(f"{moments} N={n_mi}M M={m_mi}M TE + DCP cpu_offload {rec['seconds']:.3f} s")
            gc.collect()
        for round_ in range(args.rounds):
            for i, variant in enumerate(variants(moments, chunks, blocks)):
                apply(variant, bits_decode)
                first, result = timed(export_fn("placement_cpu", model, opt))
                if i not in checked:  # correctness before any number is kept
                    verify(first, model, opt)
                    checked.add(i)
                del first
                gc.collect()
                reuse = export_fn("placement_cpu_reuse_buffers", model, opt)
                reuse()  # fills the kept buffers (a first save of its own)
                gc.collect()
                _, repeat = timed(reuse)
                gc.collect()
                for is_repeat, res in ((False, result), (True, repeat)):
                    rec = {
                        "op": "export",
                        "mode": "placement_cpu_reuse_buffers" if is_repeat else "placement_cpu",
                        "moments": moments,
                        "n_elements": int(n_mi) * MI,
                        "max_elements": int(m_mi) * MI,
                        "raw_bytes": raw_bytes,
                        "output_bytes": out_bytes,
                        "round": round_,
                        **variant,
                        **res,
                        "repeat": is_repeat,
                        "bound_seconds": bounds[is_repeat],
                        "d2h_bytes_per_s": bw["d2h"],
                        "host_fresh_bytes_per_s": bw["fresh"],
                        "host_warm_bytes_per_s": bw["warm"],
                    }
                    rec["seconds_over_bound"] = rec["seconds"] / rec["bound_seconds"]
                    records.append(rec)
                    print(
                        f"{moments} N={n_mi}M M={m_mi}M chunk={variant['chunk_mib']:>3}MiB "
                        f"{variant['fp8_decode']:<6} block={block_label(variant)} "
                        f"{'repeat' if is_repeat else 'first '} r{round_} "
                        f"{rec['seconds']:.3f} s  {rec['seconds_over_bound']:.2f} x T*",
                        flush=True,
                    )
                release_buffers()
                save()
        del model, opt
        gc.collect()
        torch.cuda.empty_cache()
    apply(variants("bf16", [CHUNK_MIB], [])[0], bits_decode)

    # The summary: median seconds over rounds per case, variant and first/repeat.
    groups: dict[tuple[Any, ...], list[float]] = {}
    for r in records:
        if r["mode"].startswith("te_"):
            continue
        key = (r["moments"], r["n_elements"] // MI, r["max_elements"] // MI, r["chunk_mib"],
               r["fp8_decode"], block_label(r), r["repeat"])  # fmt: skip
        groups.setdefault(key, []).append(r["seconds_over_bound"])
    print("moments N M chunk decode block repeat: median x T* (all rounds)")
    for key, ratios in groups.items():
        spread = ", ".join(f"{x:.2f}" for x in ratios)
        print(*key, f"{statistics.median(ratios):.2f}  ({spread})")
    save()
    return 0


if __name__ == "__main__":
    sys.exit(main())
