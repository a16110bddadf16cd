"""Turns committed benchmark JSON into the README's markdown table and its plot.

Usage:
    python benchmarks/report.py benchmarks/results/h200_export.json \
        --plot benchmarks/results/h200_export.png
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

G = 1 << 30
MI = 1 << 20
LABELS = {
    "te_default": "TE default",
    "te_default_dcp_cpu_offload": "TE default + DCP cpu_offload",
    "placement_cpu": 'export_placement("cpu") + DCP',
    "placement_cpu_reuse_buffers": 'export_placement("cpu", reuse_buffers=True) + DCP',
}


def load(path: Path) -> dict[str, Any]:
    data = json.loads(path.read_text())
    if not {"machine", "records"} <= set(data):
        raise ValueError(f"{path}: expected a results file with 'machine' and 'records'")
    return data


LOAD_LABELS = {
    "te_default": "TE load_state_dict",
    "placement_cpu": 'load_state_dict in export_placement("cpu")',
}


def _mode(r: dict[str, Any]) -> str:
    labels = LOAD_LABELS if r["op"] == "load" else LABELS
    return labels.get(r["mode"], r["mode"]) + (" (repeat save)" if r.get("repeat") else "")


def table(data: dict[str, Any]) -> str:
    m = data["machine"]
    bw = data.get("bandwidths_bytes_per_s", {})
    lines = [
        f"Measured on {m['gpu']} (driver {m['driver']}), torch {m['torch']}, "
        f"Transformer Engine {m['transformer_engine']}, {m.get('host_cpus', '?')} host cores; "
        "local state per rank, BF16 params, FP32 master weights kept as int16 remainders.",
    ]
    if bw:
        lines.append(
            "Bandwidths measured in the same run: "
            + ", ".join(f"{k} {v / 1e9:.1f} GB/s" for k, v in bw.items())
            + "."
        )
    lines += [
        "",
        "| op | moments | N | M | mode | extra GPU | GPU B/N | extra host | seconds | T* | / T* |",
        "|---|---|---:|---:|---|---:|---:|---:|---:|---:|---:|",
    ]
    for r in data["records"]:
        bound = r.get("bound_seconds")
        # TE's default export leaves everything on the GPU: no host bound applies to it.
        te_gpu_only = r["mode"] == "te_default" and r["op"] == "export"
        ratio = "" if bound is None or te_gpu_only else f"{r['seconds'] / bound:.2f}"
        lines.append(
            f"| {r['op']} | {r['moments']} | {r['n_elements'] / G:.2f} G "
            f"| {r['max_elements'] / MI:.0f} M | {_mode(r)} "
            f"| {r['peak_extra_gpu_bytes'] / G:.2f} GiB "
            f"| {r['peak_extra_gpu_bytes'] / r['n_elements']:.2f} "
            f"| {r.get('peak_extra_host_bytes', 0) / G:.2f} GiB | {r.get('seconds', 0):.2f} "
            f"| {'' if bound is None or te_gpu_only else f'{bound:.2f}'} | {ratio} |"
        )
    return "\n".join(lines)


DCP_OPS = ("dcp_save", "dcp_async_save", "dcp_load", "full_state_dict")
DCP_LABELS = {
    "te_default": "TE default",
    "placement_cpu": 'export_placement("cpu")',
    "placement_cpu_passthrough_stager": 'export_placement("cpu") + PassThroughStager',
}


def dcp_table(data: dict[str, Any]) -> str:
    """The DCP end-to-end records (``benchmarks/dcp_e2e.py``): one row per op, mode and rank."""
    m = data["machine"]
    first = data["records"][0]
    lines = [
        f"Measured on {m.get('gpu_count', '?')}x {m['gpu']} (driver {m['driver']}), torch "
        f"{m['torch']}, Transformer Engine {m['transformer_engine']}, {m.get('host_cpus', '?')} "
        f"host cores; FSDP2 over {first['world_size']} ranks, {first['layers']} BF16 "
        f"Linear({first['hidden']}, {first['hidden']}) layers, "
        f"N = {first['n_elements'] / G:.2f} G local elements per rank, {first['moments'].upper()} "
        "moments.",
        "",
        "| op | masters | mode | rank | extra GPU | GPU B/N | extra host | host B/N "
        "| blocked s | total s |",
        "|---|---|---|---:|---:|---:|---:|---:|---:|---:|",
    ]
    ops, modes = list(DCP_OPS), list(DCP_LABELS)

    def order(r: dict[str, Any]) -> tuple[int, int, int]:
        op = ops.index(r["op"]) if r["op"] in ops else len(ops)
        mode = modes.index(r["mode"]) if r["mode"] in modes else len(modes)
        return op, mode, r["rank"]

    for r in sorted(data["records"], key=order):
        label = DCP_LABELS.get(r["mode"], r["mode"])
        if r.get("cpu_offload") and r["mode"] == "te_default":
            label += " (cpu_offload=True)"
        lines.append(
            f"| {r['op']} | {r.get('masters', '')} | {label} "
            f"| {r['rank']} | {r['peak_extra_gpu_bytes'] / G:.2f} GiB "
            f"| {r['peak_extra_gpu_bytes'] / r['n_elements']:.2f} "
            f"| {r['peak_extra_host_bytes'] / G:.2f} GiB "
            f"| {r['peak_extra_host_bytes'] / r['n_elements']:.2f} "
            f"| {r['seconds']:.2f} | {r['seconds_total']:.2f} |"
        )
    return "\n".join(lines)


def plot(data: dict[str, Any], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    records = [
        r
        for r in data["records"]
        if r.get("op") == "export" and r["moments"] == "bf16" and not r.get("repeat")
    ]
    fixed_m = [r for r in records if r["max_elements"] == 64 * MI]
    fixed_n = [r for r in records if r["n_elements"] == G]
    fig, axes = plt.subplots(2, 2, figsize=(11, 7.5))
    panels = [
        (axes[0][0], fixed_m, "n_elements", "peak_extra_gpu_bytes", "N (G elements), M = 64 M"),
        (axes[0][1], fixed_n, "max_elements", "peak_extra_gpu_bytes", "M (M elements), N = 1 G"),
        (axes[1][0], fixed_m, "n_elements", "seconds", "N (G elements), M = 64 M"),
        (axes[1][1], fixed_n, "max_elements", "seconds", "M (M elements), N = 1 G"),
    ]
    for ax, rows, x_key, y_key, xlabel in panels:
        for mode, label in LABELS.items():
            pts = sorted((r[x_key], r[y_key]) for r in rows if r["mode"] == mode)
            if not pts:
                continue
            scale_x = G if x_key == "n_elements" else MI
            scale_y = G if y_key.endswith("bytes") else 1
            ax.plot(
                [x / scale_x for x, _ in pts],
                [y / scale_y for _, y in pts],
                marker="o",
                label=label,
            )
        ax.set_xlabel(xlabel)
        ax.set_ylabel("peak extra GPU (GiB)" if y_key.endswith("bytes") else "export time (s)")
        if x_key == "max_elements":
            ax.set_xscale("log", base=2)
        ax.grid(alpha=0.3)
    axes[0][0].legend(fontsize=8)
    m = data["machine"]
    fig.suptitle(f"TE FusedAdam export, BF16 moments: {m['gpu']}, TE {m['transformer_engine']}")
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("results", type=Path)
    parser.add_argument("--plot", type=Path, default=None)
    args = parser.parse_args()
    data = load(args.results)
    dcp = any(r.get("parallelism") == "fsdp2" and r["op"] != "export" for r in data["records"])
    print(dcp_table(data) if dcp else table(data))
    if args.plot is not None:
        plot(data, args.plot)


if __name__ == "__main__":
    main()
