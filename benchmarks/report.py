"""Turns committed benchmark JSON into markdown tables and plots, and writes docs/performance.md.

Usage:
    python benchmarks/report.py benchmarks/results/h200x2_export_speed.json \
        --plot benchmarks/results/h200x2_export_speed.png
    python benchmarks/report.py --docs      # regenerates docs/performance.md from SECTIONS
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
    if "machine" not in data and "environment" in data:  # benchmarks/trainer_resume.py
        env = data["environment"]
        data["machine"] = {**env, **{k: v for k, v in env.get("versions", {}).items()}}
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


def _fmt(value: Any, key: str) -> str:
    if isinstance(value, bool) or value is None:
        return "" if value is None else str(value)
    if key.endswith("_bytes") and isinstance(value, (int, float)):
        if abs(value) < MI:
            return f"{value:.0f} B"  # small figures exactly: 512 B is not "0.00 MiB"
        return f"{value / G:.2f} GiB" if abs(value) >= G else f"{value / MI:.2f} MiB"
    if key in ("n_elements", "max_elements") and isinstance(value, (int, float)):
        return f"{value / G:.2f} G" if value >= G // 10 else f"{value / MI:.2f} M"
    if isinstance(value, float):
        return f"{value:.2f}"
    return str(value)


def generic_table(data: dict[str, Any], columns: tuple[str, ...], op: str | None = None) -> str:
    """One row per record (of ``op`` only, if given), the fields as columns (absent: blank)."""
    lines = [
        "| " + " | ".join(columns) + " |",
        "|" + "|".join("---" for _ in columns) + "|",
    ]
    for r in data["records"]:
        if op is not None and r.get("op") != op:
            continue
        lines.append("| " + " | ".join(_fmt(r.get(c), c) for c in columns) + " |")
    return "\n".join(lines)


def soak_table(data: dict[str, Any]) -> str:
    lines = [
        "| moments | mode | cycles | N | seconds | GPU allocated growth | GPU reserved growth "
        "| pinned pool growth | host RSS growth |",
        "|---|---|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for r in data["records"]:
        g = r["growth"]
        lines.append(
            f"| {r['moments']} | {r['mode']} | {r['cycles']} | {r['n_elements'] / MI:.0f} M "
            f"| {r['seconds']:.1f} | {g['gpu_allocated_bytes']} B | {g['gpu_reserved_bytes']} B "
            f"| {g['pinned_pool_bytes']} B | {g['host_rss_bytes'] / MI:+.1f} MiB |"
        )
    return "\n".join(lines)


def machine_line(data: dict[str, Any]) -> str:
    m = data["machine"]
    return (
        f"Measured on {m.get('gpu_count', 1)}x {m['gpu']} (driver {m['driver']}), torch "
        f"{m['torch']}, Transformer Engine {m['transformer_engine']}, "
        f"{m.get('host_cpus', '?')} host cores."
    )


RESULTS = Path(__file__).resolve().parent / "results"
DOCS = Path(__file__).resolve().parents[1] / "docs" / "performance.md"

# (title, results file, renderer, text under the title). Only results of the shipped engine.
SECTIONS: list[tuple[str, str, str, str]] = [
    (
        "Exports against the hardware bound",
        "h200x2_export_speed.json",
        "export",
        "`benchmarks/export_memory.py --sweep speed` on the 2x H200 host, BF16/FP16/FP8 moments "
        "with int16 master remainders. T* = max(R / B_d2h, O / B_host) with the bandwidths "
        "measured in the same run (fresh host memory for a first save, warm for a repeat). "
        "Every export was checked bit for bit against TE's own conversion before its numbers "
        "were kept.",
    ),
    (
        "DCP end to end",
        "h200x2_dcp_e2e.json",
        "dcp",
        "`benchmarks/dcp_e2e.py`: FSDP2, real TE FusedAdam, `cpu:gloo,cuda:nccl`, checkpoints on "
        "local disk. Every checkpoint is read back and compared bit for bit with an export first "
        "checked against TE's `get_unscaled_state`; every load must leave the optimizer exactly "
        "as saved. 'blocked s' is the time the training loop waits.",
    ),
    (
        "FSDP2 export memory per rank",
        "h200x2_fsdp2_export.json",
        "generic:op,mode,moments,rank,n_elements,peak_extra_gpu_bytes,gpu_bytes_per_n",
        "`tests/test_gpu_fsdp.py` on 2 GPUs: the export's extra GPU bytes per local element.",
    ),
    (
        "Loads from a host checkpoint",
        "h200x2_load.json",
        "generic:moments,master,n_elements,max_elements,mode,peak_extra_gpu_bytes,"
        "peak_extra_host_bytes,seconds,bound_seconds,seconds_over_bound,te_seconds,speedup_vs_te",
        "`benchmarks/export_memory.py --sweep load`: `load_state_dict` of a host checkpoint "
        "(FP32 states, int16 remainders) into a trained TE FusedAdam, under the policy "
        "(`placement_cpu`, best of two runs) and TE's own (`te_default`, one run). T*_load = "
        "max(R / B_h2d, I / B_host_read), with R the bytes written to the GPU, I the checkpoint"
        " bytes read, and both bandwidths measured in the same run (`h2d`, `host_read` in the "
        "JSON). The host peak is the kernel's RSS high-water mark, reset before the load. Every"
        " load was compared bit for bit with TE's own load of the same checkpoint.",
    ),
    (
        "Loads from a host checkpoint: an earlier run on a slower host",
        "h200x2_load_f1e687a.json",
        "generic:moments,master,n_elements,max_elements,mode,peak_extra_gpu_bytes,"
        "peak_extra_host_bytes,seconds,bound_seconds,seconds_over_bound,te_seconds,speedup_vs_te",
        "The same sweep with the same load pipeline at commit f1e687a, on another 2x H200 "
        "machine of the same kind whose host converted FP32 to BF16 at 68.8 GB/s (97.1 GB/s in "
        "the run above). BF16 with int16 remainders took 2.19 and 2.06 x T*_load at 0.5 and 1 G "
        "there (target 2 x).",
    ),
    (
        "Loads: host threads and staging chunk",
        "h200_load_ab.json",
        "generic:run,n_elements,chunk_mib,torch_threads,loads,best_over_bound,"
        "median_over_bound,bound_seconds,te_seconds",
        "`benchmarks/load_ab.py` on one H200 (16-core host): the load above (BF16 moments, int16 "
        "remainders) with each staging chunk and torch thread count, in interleaved rounds, "
        "every load checked against TE's. The host conversion is CPU-bound: time falls with "
        "threads, and 16 MiB chunks beat 64 MiB. One thread per rank is what torchrun's default "
        "`OMP_NUM_THREADS=1` gives.",
    ),
    (
        "Loads: staging chunk, ring and phases on the 2x H200 hosts",
        "h200x2_load_ab.json",
        "generic:run,op,n_elements,chunk_mib,torch_threads,ring,phase,loads,best_over_bound,"
        "median_over_bound,median_seconds,median_host_wait_seconds,bound_seconds,te_seconds",
        "`benchmarks/load_ab.py` on three 2x H200 hosts (32 cores), one per run, the same load "
        "(BF16 moments, int16 remainders), every load checked against TE's. Run 0: staging "
        "chunks of 1-16 MiB at 16 and 32 threads; smaller chunks are slower, by 70-120 us per "
        "extra chunk. Runs 1 and 2 (`--phases`): the host conversion alone (`convert_only`), "
        "the copies alone (`copy_only`), both at once (`both`), each copy waited for before the "
        "next conversion (`serial`, run 2) and the load (`pipeline`). Run 2 also varies the "
        "ring's depth (3 is the default). The hosts converted FP32 to BF16 at 84, 41 and 95 "
        "GB/s: the load is bound by the host's conversion, which the copies slow when they run "
        "at the same time, and the host waited 2-5 ms per load for the copies.",
    ),
    (
        "DCP streaming load: memory",
        "h200x2_dcp_load_bounds.json",
        "generic:mode,rank,n_elements,max_elements,peak_extra_gpu_bytes,peak_extra_host_bytes",
        "`tests/test_gpu_dcp_load.py::test_streaming_load_bounds_on_two_gpus`: FSDP2 on 2 GPUs, "
        "16 BF16 Linear(4096, 4096), int16 remainders; `dcp.load` of the optimizer with TE's "
        "template (`te_default`), `StreamingLoadPlanner` (`streaming`) and the policy's host "
        "template (`placement_cpu_template`). Each load restored the saved bits. Host memory is "
        "RSS with glibc's mmap threshold fixed at 64 KiB, so freed buffers leave RSS.",
    ),
    (
        "DCP streaming load: speed",
        "h200x2_dcp_load_speed.json",
        "generic:op,round,mode,rank,n_elements,max_elements,peak_extra_gpu_bytes,"
        "peak_extra_host_bytes,seconds",
        "`benchmarks/dcp_e2e.py --size medium --ops dcp_load --load-rounds 4` (FSDP2 on 2 GPUs, 8 "
        "BF16 Linear(8192, 8192), int16 remainders): `dcp.load` of the optimizer with TE's "
        "template (`te_default`) and with `StreamingLoadPlanner` (`placement_cpu_streaming`) "
        "from the same checkpoint, four rounds with the modes' order alternating. The records "
        "carry where the time went (`split_s`, `load_stats`).",
    ),
    (
        "DCP save and load paths",
        "h200x2_dcp_paths.json",
        "generic:op,mode,rank,save_index,n_elements,max_elements,peak_extra_gpu_bytes,"
        "peak_extra_host_bytes,seconds,seconds_total,blocked_over_bound,within_host_bound",
        "`benchmarks/dcp_e2e.py --size medium` (FSDP2 on 2 GPUs, 8 BF16 Linear(8192, 8192), "
        "int16 remainders): the streaming save (`placement_cpu_streaming`, `StreamingWriter`, "
        "one writer thread), the raw-snapshot async save (`placement_cpu_snapshot`, three saves"
        " in a row; `blocked_over_bound` is the time `dcp.async_save` blocked over (R_optimizer"
        " + R_model) / B_d2h, with B_d2h measured in the run). The snapshot rows' GPU peak "
        "includes the training step taken while each write runs. Every row here was checked bit"
        " for bit before it was kept; the run's loads are superseded by the section above.",
    ),
    (
        "Megatron-Core checkpoints",
        "h200x2_megatron_2gpu.json",
        "generic:op,sharding_type,case,mode,world_size,rank,n_elements,peak_extra_gpu_bytes,"
        "peak_extra_host_bytes,seconds",
        "`benchmarks/megatron_ckpt.py --size test` on 2 GPUs (megatron-core 0.19.2, a 16.8 M "
        "parameter GPTModel); [megatron.md](megatron.md) has the 1-GPU figures and what failed.",
    ),
    (
        "Trainer resumes",
        "h200x2_trainer_resume.json",
        "generic:trainer_resume:framework,variant,world_size,rank,mode,n_elements,"
        "peak_extra_gpu_bytes,live_state_bytes,peak_extra_host_bytes,seconds,states_equal_plain",
        "`benchmarks/trainer_resume.py`: a Llama of 168 M parameters (TE FusedAdam, BF16 moments, "
        "FP32 masters) saved with the integration, then resumed without (`te_default`) and with "
        "(`placement_cpu`) it. `peak_extra_gpu_bytes` is the GPU peak during the resume minus the "
        "memory before it minus the live states the load added. torch's default threads (32); "
        "each rank's resume caps them at its share of the cores.",
    ),
    (
        "Trainer resumes under torchrun's default OMP_NUM_THREADS=1",
        "h200x2_trainer_resume_omp1.json",
        "generic:trainer_resume:framework,variant,world_size,rank,mode,n_elements,"
        "peak_extra_gpu_bytes,live_state_bytes,peak_extra_host_bytes,seconds,states_equal_plain",
        "`OMP_NUM_THREADS=1 benchmarks/trainer_resume.py --world-sizes 2`: the same resumes with "
        "one host thread per rank, as torchrun starts ranks unless told otherwise. Placed "
        "resumes took 0.19-0.87 x the plain time. Before the initial states were made on the "
        "device (`h200x2_trainer_resume_omp1_2a4bca9.json`), the HF FSDP2 sharded resume took "
        "1.01-1.02 x.",
    ),
    (
        "Exports and loads under torchrun's default OMP_NUM_THREADS=1",
        "h200_host_workers.json",
        "generic:op,moments,master,intra_op_threads,host_workers,mode,repeat,"
        "peak_extra_gpu_bytes,peak_extra_host_bytes,seconds,bound_seconds",
        "`OMP_NUM_THREADS=1 benchmarks/export_memory.py --sweep threads --intra-op-threads 1,16` "
        "on one H200 (16 host cores), N = 1 G: every storage mode at torch's one intra-op thread "
        "(torchrun's default; the host workers' team of 16 converts) and at 16 (the team stands "
        "aside and torch's own threads convert), TE's own paths at both settings in the same "
        "run. `placement_cpu` first saves write fresh memory; `reuse_buffers` repeats write the "
        "kept buffers. A load row is the best of two runs.",
    ),
    (
        "A framework's own process-based async save, at one intra-op thread",
        "h200_framework_save_364360e.json",
        "generic:framework,async_mode,mode,save_index,peak_extra_gpu_bytes,peak_extra_host_bytes,"
        "blocked_seconds,bound_seconds,prewarm_bytes,equals_te_export,error",
        "`OMP_NUM_THREADS=1 torchrun --nproc_per_node=1 benchmarks/framework_save.py` on one "
        "H200, N = 0.47 G (BF16 moments, int16 remainders, 3.5 GiB raw). `snapshot_prewarmed`: "
        "the stager made by `SnapshotStager.prewarm` at setup, so its first save blocks only for "
        "its copies. The run was cut by its time limit after that row; the rows it did not "
        "reach (thread and sync saves) are in `h200_framework_save.json` (5a853e3). The "
        "torchtitan rows' `KeyError` is torch 2.11's `DefaultStager` kept across saves, with "
        "or without the policy.",
    ),
    (
        "Soak",
        "h200x2_soak.json",
        "soak",
        "`benchmarks/soak.py`: consecutive export + load cycles; growth from the first to the "
        "last cycle.",
    ),
]


def render(kind: str, data: dict[str, Any]) -> str:
    if kind == "export":
        return table(data)
    if kind == "dcp":
        return dcp_table(data)
    if kind == "soak":
        return soak_table(data)
    if kind.startswith("generic:"):  # generic:col,col,... or generic:OP:col,col,...
        spec = kind.split(":")[1:]
        op = spec[0] if len(spec) == 2 else None
        return generic_table(data, tuple(spec[-1].split(",")), op)
    raise ValueError(f"unknown section kind {kind!r}: valid are export, dcp, soak, generic:...")


def docs() -> str:
    out = [
        "# Performance",
        "",
        "<!-- generated by: python benchmarks/report.py --docs (do not edit by hand) -->",
        "Tables generated from the committed results under `benchmarks/results/`. How each "
        "speed change came about is in [performance-log.md](performance-log.md).",
    ]
    for title, name, kind, text in SECTIONS:
        data = load(RESULTS / name)
        out += ["", f"## {title}", "", text, ""]
        if kind in ("soak",) or kind.startswith("generic:"):
            out += [machine_line(data), ""]  # the other renderers state the machine themselves
        out.append(render(kind, data))
        png = RESULTS / name.replace(".json", ".png")
        if png.exists():
            out += ["", f"![{title}](../benchmarks/results/{png.name})"]
    return "\n".join(out) + "\n"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("results", type=Path, nargs="?")
    parser.add_argument("--plot", type=Path, default=None)
    parser.add_argument("--docs", action="store_true", help=f"write {DOCS.name} from SECTIONS")
    args = parser.parse_args()
    if args.docs:
        DOCS.write_text(docs())
        return
    if args.results is None:
        parser.error("give a results file, or --docs")
    data = load(args.results)
    dcp = any(r.get("parallelism") == "fsdp2" and r["op"] != "export" for r in data["records"])
    print(dcp_table(data) if dcp else table(data))
    if args.plot is not None:
        plot(data, args.plot)


if __name__ == "__main__":
    main()
