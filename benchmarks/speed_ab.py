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
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks._measure import (
    MI,
    MOMENTS,
    build,
    export_fn,
    machine,
    measure,
    requirements_missing,
    state_bytes,
    timed,
    verify,
)
from benchmarks.export_memory import bandwidths  # (not moved yet)
from te_ckpt_placement._ring import CHUNK_BYTES

CHUNK_MIB = CHUNK_BYTES // MI


def block_label(variant: dict[str, Any]) -> str:
    from te_ckpt_placement import _convert

    block = variant["block_elements"]
    if block is None:
        return f"auto({_convert.block_elements() >> 20}M)"
    return f"{block >> 20}M"


def _legacy_e4m3(raw: torch.Tensor, out: torch.Tensor, scratch: Any, *, scale: float) -> None:
    """The previous FP8 path: torch's FP8 widening, a multiply and an isnan mask."""
    from te_ckpt_placement._convert import canonicalize_nan

    out.copy_(raw.view(torch.float8_e4m3fn))
    out.mul_(scale)
    canonicalize_nan(out)


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
    from te_ckpt_placement import _convert, _ring, release_buffers

    release_buffers()  # the next export allocates a pool of the new chunk size
    _ring.CHUNK_BYTES = variant["chunk_mib"] * MI
    _convert.BLOCK_ELEMENTS = variant["block_elements"]  # None: the engine's own choice
    _convert.dequantize_e4m3 = bits_decode if variant["fp8_decode"] == "bits" else _legacy_e4m3


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
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
    return parser.parse_args(argv)


@dataclass(frozen=True)
class Case:
    """One model size and storage mode, with its byte counts and time bounds."""

    moments: str
    n_mi: int  # N and M, in Mi elements
    m_mi: int
    raw_bytes: int
    output_bytes: int
    bounds: dict[bool, float]  # T* of a first save (False) and of a repeated save (True)

    @property
    def label(self) -> str:
        return f"{self.moments} N={self.n_mi}M M={self.m_mi}M"


def record(
    case: Case,
    bw: dict[str, float],
    mode: str,
    round_: int,
    result: dict[str, Any],
    *,
    repeat: bool,
    variant: dict[str, Any] | None = None,
) -> dict[str, Any]:
    """One export's record: the case, the variant, the measured ``result`` and its bound."""
    rec = {
        "op": "export",
        "mode": mode,
        "moments": case.moments,
        "n_elements": case.n_mi * MI,
        "max_elements": case.m_mi * MI,
        "raw_bytes": case.raw_bytes,
        "output_bytes": case.output_bytes,
        "round": round_,
        **(variant or {}),
        **result,
        "repeat": repeat,
        "bound_seconds": case.bounds[repeat],
        "d2h_bytes_per_s": bw["d2h"],
        "host_fresh_bytes_per_s": bw["fresh"],
        "host_warm_bytes_per_s": bw["warm"],
    }
    rec["seconds_over_bound"] = rec["seconds"] / rec["bound_seconds"]
    return rec


def time_variant(model: Any, opt: Any, *, check: bool) -> tuple[dict[str, Any], dict[str, Any]]:
    """A first save and a repeated save under the variant applied now; with ``check`` the first
    export is verified bit for bit (after the timed region, before any number is kept)."""
    first, result = timed(export_fn("placement_cpu", model, opt))
    if check:
        verify(first, model, opt)
    del first
    gc.collect()
    reuse = export_fn("placement_cpu_reuse_buffers", model, opt)
    reuse()  # fills the kept buffers (a first save of its own)
    gc.collect()
    _, repeat = timed(reuse)
    gc.collect()
    return result, repeat


@dataclass
class ABRun:
    """One run's settings and records; ``save`` writes them to ``out`` (a run cut short keeps
    what it measured)."""

    bw: dict[str, float]
    rounds: int
    te_baseline: bool
    chunks: list[int]
    blocks: list[int | None]
    bits_decode: Callable[..., None]  # the engine's own FP8 decode, restored by each variant
    out: Path | None
    records: list[dict[str, Any]] = field(default_factory=list)

    def save(self) -> None:
        if self.out is not None:
            doc = {"machine": machine(), "bandwidths": self.bw, "records": self.records}
            self.out.write_text(json.dumps(doc, indent=1) + "\n")

    def run_case(self, spec: str) -> None:
        """Every variant of one ``N:M:moments`` case over the rounds, saved after each."""
        from te_ckpt_placement import release_buffers

        bw = self.bw
        n_mi, m_mi, moments = spec.split(":")
        model, opt = build(int(n_mi) * MI, int(m_mi) * MI, MOMENTS[moments])
        raw_bytes, out_bytes = state_bytes(opt)
        bounds = {
            False: max(raw_bytes / bw["d2h"], out_bytes / bw["fresh"]),
            True: max(raw_bytes / bw["d2h"], out_bytes / bw["warm"]),
        }
        case = Case(moments, int(n_mi), int(m_mi), raw_bytes, out_bytes, bounds)
        if self.te_baseline:
            mode = "te_default_dcp_cpu_offload"
            rec = record(case, bw, mode, 0, measure(mode, model, opt), repeat=False)  # verified
            self.records.append(rec)
            print(f"{case.label} TE + DCP cpu_offload {rec['seconds']:.3f} s")
            gc.collect()
        checked: set[int] = set()
        for round_ in range(self.rounds):
            for i, variant in enumerate(variants(moments, self.chunks, self.blocks)):
                apply(variant, self.bits_decode)
                first, repeat = time_variant(model, opt, check=i not in checked)
                checked.add(i)
                for is_repeat, res in ((False, first), (True, repeat)):
                    mode = "placement_cpu_reuse_buffers" if is_repeat else "placement_cpu"
                    rec = record(case, bw, mode, round_, res, repeat=is_repeat, variant=variant)
                    self.records.append(rec)
                    print(
                        f"{case.label} chunk={variant['chunk_mib']:>3}MiB "
                        f"{variant['fp8_decode']:<6} block={block_label(variant)} "
                        f"{'repeat' if is_repeat else 'first '} r{round_} "
                        f"{rec['seconds']:.3f} s  {rec['seconds_over_bound']:.2f} x T*",
                        flush=True,
                    )
                release_buffers()
                self.save()
        del model, opt
        gc.collect()
        torch.cuda.empty_cache()


def print_summary(records: list[dict[str, Any]]) -> None:
    """The median seconds over rounds per case, variant and first/repeat."""
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


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    missing = requirements_missing()
    if missing:
        print(f"This A/B needs a CUDA GPU and Transformer Engine: {missing}.", file=sys.stderr)
        return 2
    from te_ckpt_placement import _convert

    bw = bandwidths()
    print({k: f"{v / 1e9:.1f} GB/s" for k, v in bw.items()}, flush=True)
    run = ABRun(
        bw,
        rounds=args.rounds,
        te_baseline=args.te_baseline,
        chunks=[int(c) for c in args.chunks.split(",")],
        blocks=[None, *(int(b) << 20 for b in args.blocks.split(",") if b)],
        bits_decode=_convert.dequantize_e4m3,
        out=args.out,
    )
    for spec in args.cases.split(","):
        run.run_case(spec)
    apply(variants("bf16", [CHUNK_MIB], [])[0], run.bits_decode)
    print_summary(run.records)
    run.save()
    return 0


if __name__ == "__main__":
    sys.exit(main())
