"""Memory and time of a TE FusedAdam optimizer export: TE's default against export_placement("cpu").

Varies the total local state size N and the largest parameter M independently, and compares

- ``te_default``: TE's ``FusedAdam.state_dict()``, every converted state on the GPU at once;
- ``te_default_dcp_cpu_offload``: DCP ``get_optimizer_state_dict(..., cpu_offload=True)``, the path
  users run today (the offload happens after TE has built the whole dict on the GPU);
- ``placement_cpu``: the same DCP call inside ``export_placement("cpu")``.

Each run records the peak GPU bytes above the live optimizer state
(``torch.cuda.max_memory_allocated``), the peak host RSS above the start of the run (sampled every
millisecond), and the wall time. Every export is checked bit for bit against TE's own conversion
before its numbers are kept.

Usage:
    python benchmarks/export_memory.py                 # default size, prints the table
    python benchmarks/export_memory.py --sweep full    # N and M sweeps, writes benchmarks/results/

Without CUDA and Transformer Engine it says what it needs and exits with status 2.
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import json
import os
import platform
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import torch

G = 1 << 30
MI = 1 << 20
MOMENTS = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp8": torch.uint8, "fp32": torch.float32}
MODES = ("te_default", "te_default_dcp_cpu_offload", "placement_cpu", "placement_cpu_reuse_buffers")


def requirements_missing() -> str | None:
    if not torch.cuda.is_available():
        return "no CUDA GPU is visible to torch " + torch.__version__
    try:
        import transformer_engine.pytorch  # noqa: F401
    except Exception as exc:
        return f"Transformer Engine for PyTorch does not import ({type(exc).__name__}: {exc})"
    return None


def machine() -> dict[str, Any]:
    import transformer_engine

    try:
        driver = subprocess.run(
            ["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"],
            capture_output=True,
            text=True,
            check=True,
        ).stdout.split("\n")[0]
    except (OSError, subprocess.CalledProcessError):
        driver = "unknown"
    return {
        "gpu": torch.cuda.get_device_name(),
        "gpu_count": torch.cuda.device_count(),
        "driver": driver,
        "cuda": torch.version.cuda,
        "torch": torch.__version__,
        "transformer_engine": getattr(transformer_engine, "__version__", "unknown"),
        "python": platform.python_version(),
        "host_cpus": os.cpu_count(),
    }


def rss() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


class HostPeak:
    """Samples the process RSS in a thread; ``peak`` is the largest value seen."""

    def __init__(self, interval: float = 0.001) -> None:
        self.interval = interval
        self.peak = rss()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        while not self._stop.is_set():
            self.peak = max(self.peak, rss())
            time.sleep(self.interval)

    def __enter__(self) -> HostPeak:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()
        self.peak = max(self.peak, rss())


def build(n: int, m: int, moments: torch.dtype, seed: int = 0) -> tuple[Any, Any]:
    """A model of bf16 params (as many of M elements as fit in N) and a stepped TE FusedAdam."""
    from transformer_engine.pytorch.optimizers import FusedAdam

    sizes = [m] * (n // m) + ([n % m] if n % m else [])
    gen = torch.Generator(device="cuda").manual_seed(seed)
    params = [
        torch.nn.Parameter(torch.randn(s, device="cuda", generator=gen).bfloat16()) for s in sizes
    ]
    model = torch.nn.ParameterList(params)
    opt = FusedAdam(
        params,
        lr=1e-3,
        master_weights=True,
        store_param_remainders=True,
        exp_avg_dtype=moments,
        exp_avg_sq_dtype=moments,
    )
    for p in params:  # one real step, so every state holds non-trivial values
        p.grad = torch.randn(p.shape, device="cuda", generator=gen).bfloat16()
        p.grad.mul_(torch.rand(1, device="cuda", generator=gen) * 10)
    opt.step()
    opt.zero_grad(set_to_none=True)
    torch.cuda.synchronize()
    return model, opt


def export_fn(mode: str, model: Any, opt: Any) -> Callable[[], Any]:
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_optimizer_state_dict

    from te_ckpt_placement import export_placement

    def dcp() -> Any:
        return get_optimizer_state_dict(model, opt, options=StateDictOptions(cpu_offload=True))

    if mode == "te_default":
        return opt.state_dict
    if mode == "te_default_dcp_cpu_offload":
        return dcp
    if mode in ("placement_cpu", "placement_cpu_reuse_buffers"):
        policy = export_placement("cpu", reuse_buffers=mode.endswith("reuse_buffers"))

        def placed() -> Any:
            with policy:
                return dcp()

        return placed
    raise ValueError(f"unknown mode {mode!r}; valid: {', '.join(MODES)}")


def verify(sd: dict[str, Any], model: Any, opt: Any) -> list[str]:
    """Checks every exported state bit for bit against TE's own conversion, one state at a time.

    Returns the devices the export's tensors sit on. Runs after the timed region.
    """
    from torch.distributed.tensor import DTensor

    params = list(model.parameters())
    devices = set()
    assert len(sd["state"]) == len(params)
    for key, states in sd["state"].items():
        param = params[int(key)]  # ParameterList FQNs and optimizer indices are both positions
        assert list(states) == list(opt.state[param])
        for name, value in states.items():
            ours = value._local_tensor if isinstance(value, DTensor) else value
            devices.add(ours.device.type)
            ref = opt.get_unscaled_state(param, name)
            assert ours.dtype == ref.dtype and ours.shape == ref.shape, (key, name)
            same = torch.equal(
                ours.to(ref.device).view(-1).view(torch.uint8), ref.view(-1).view(torch.uint8)
            )
            assert same, f"export of state {key}.{name} differs from TE's"
            del ref, ours
    return sorted(devices)


@contextlib.contextmanager
def measured(result: dict[str, Any]) -> Iterator[dict[str, Any]]:
    """Fills ``result`` with the GPU peak, host RSS peak and seconds of the block.

    ``result["_start"]`` is the block's start time, for callers that also time a part of it
    (they set ``result["seconds"]`` themselves; it defaults to the whole block).
    """
    gc.collect()
    torch.cuda.synchronize()
    gpu_base = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    host_base = rss()
    with HostPeak() as host:
        start = time.perf_counter()
        result["_start"] = start
        yield result
        torch.cuda.synchronize()
        result["seconds_total"] = time.perf_counter() - start
    result.setdefault("seconds", result["seconds_total"])
    result["peak_extra_gpu_bytes"] = torch.cuda.max_memory_allocated() - gpu_base
    result["peak_extra_host_bytes"] = host.peak - host_base
    del result["_start"]


def timed(fn: Callable[[], Any]) -> tuple[Any, dict[str, Any]]:
    """Runs ``fn`` once: its result, GPU peak above the start, host RSS peak, seconds."""
    result: dict[str, Any] = {}
    with measured(result):
        out = fn()
    return out, result


def measure(mode: str, model: Any, opt: Any) -> dict[str, Any]:
    sd, result = timed(export_fn(mode, model, opt))
    result["output_devices"] = verify(sd, model, opt)  # correctness before numbers are kept
    del sd
    gc.collect()
    return result


def state_bytes(opt: Any) -> tuple[int, int]:
    """R, the raw bytes of the stored local states, and O, the bytes of the FP32 export."""
    from torch.distributed.tensor import DTensor

    raw = out = 0
    for states in opt.state.values():
        for name, value in states.items():
            local = value._local_tensor if isinstance(value, DTensor) else value
            stored = getattr(local, "_data", local)
            raw += stored.numel() * stored.element_size()
            remainder = stored.dtype == torch.int16 and name == "master_param"
            out += stored.numel() * (2 if remainder else 4)
    return raw, out


def live_fingerprint(opt: Any) -> list[torch.Tensor]:
    """The raw bytes of every live state, on the host (for comparing two loads)."""
    from torch.distributed.tensor import DTensor

    prints = []
    for param, states in opt.state.items():
        for value in states.values():
            local = value._local_tensor if isinstance(value, DTensor) else value
            prints.append(getattr(local, "_data", local).cpu())
        prints.extend(s.cpu() for s in opt._scales.get(param, {}).values())
    return prints


def run_case(
    n: int, m: int, moments: str, modes: tuple[str, ...], ops: tuple[str, ...], bw: dict[str, float]
) -> list[dict[str, Any]]:
    from te_ckpt_placement import export_placement

    model, opt = build(n, m, MOMENTS[moments])
    local = sum(p.numel() for p in model.parameters())
    largest = max(p.numel() for p in model.parameters())
    raw_bytes, out_bytes = state_bytes(opt)
    base = {
        "moments": moments,
        "n_elements": local,
        "max_elements": largest,
        "n_params": len(list(model.parameters())),
        "raw_bytes": raw_bytes,
        "output_bytes": out_bytes,
        "d2h_bytes_per_s": bw["d2h"],
        "host_fresh_bytes_per_s": bw["fresh"],
        "host_warm_bytes_per_s": bw["warm"],
    }
    bound_first = max(raw_bytes / bw["d2h"], out_bytes / bw["fresh"])
    bound_repeat = max(raw_bytes / bw["d2h"], out_bytes / bw["warm"])
    records = []

    def add(op: str, mode: str, result: dict[str, Any], **extra: Any) -> None:
        rec = {"op": op, "mode": mode, **base, **result, **extra}
        rec["gpu_bytes_per_n"] = rec["peak_extra_gpu_bytes"] / local
        rec["gpu_bytes_per_m"] = rec["peak_extra_gpu_bytes"] / largest
        rec["host_bytes_per_n"] = rec["peak_extra_host_bytes"] / local
        if "bound_seconds" in rec:
            rec["seconds_over_bound"] = rec["seconds"] / rec["bound_seconds"]
        records.append(rec)
        print(format_row(rec), flush=True)

    if "export" in ops:
        for mode in modes:
            if mode.startswith("placement_cpu"):
                for repeat in (False, True):
                    bound = bound_repeat if repeat else bound_first
                    add(
                        "export",
                        mode,
                        measure(mode, model, opt),
                        repeat=repeat,
                        bound_seconds=bound,
                    )
            else:
                add(
                    "export",
                    mode,
                    measure(mode, model, opt),
                    repeat=False,
                    bound_seconds=bound_first,
                )

    if "load" in ops:
        with export_placement("cpu"):
            checkpoint = opt.state_dict()
        reference = None
        for mode in ("te_default", "placement_cpu"):
            policy = export_placement(None if mode == "te_default" else "cpu")

            def load(policy: Any = policy) -> None:
                with policy:
                    opt.load_state_dict(checkpoint)

            _, result = timed(load)
            prints = live_fingerprint(opt)
            if reference is None:
                reference = prints
            else:  # the policy's load must leave exactly what TE's load leaves
                assert len(prints) == len(reference)
                assert all(torch.equal(a, b) for a, b in zip(prints, reference, strict=True))
            del prints
            add("load", mode, result, bound_seconds=raw_bytes / bw["h2d"])
    return records


def bandwidths(nbytes: int = 2 * G, repeats: int = 3) -> dict[str, float]:
    """B_d2h and B_h2d (pinned), B_fresh and B_warm (host writes), measured in this process."""
    from te_ckpt_placement.engine import empty_host

    dev = torch.empty(nbytes, dtype=torch.uint8, device="cuda").random_()
    pinned = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)

    def best(fn: Callable[[], None]) -> float:
        times = []
        for _ in range(repeats):
            torch.cuda.synchronize()
            start = time.perf_counter()
            fn()
            torch.cuda.synchronize()
            times.append(time.perf_counter() - start)
        return nbytes / min(times)

    d2h = best(lambda: pinned.copy_(dev, non_blocking=True))
    h2d = best(lambda: dev.copy_(pinned, non_blocking=True))
    src = torch.ones(nbytes // 4)  # warm FP32 source, as the conversion writes FP32

    def fresh() -> None:
        empty_host(src.shape, torch.float32).copy_(src)

    fresh_rate = best(fresh)
    from te_ckpt_placement import engine

    advice, engine.HUGEPAGES = engine.HUGEPAGES, not engine.HUGEPAGES
    try:
        other_rate = best(fresh)  # the same writes with the other page-size choice, for NOTES.md
    finally:
        engine.HUGEPAGES = advice
    warm_out = torch.empty_like(src)
    warm_out.copy_(src)
    warm_rate = best(lambda: warm_out.copy_(src))
    return {
        "d2h": d2h,
        "h2d": h2d,
        "fresh": fresh_rate,
        "fresh_other_page_advice": other_rate,
        "warm": warm_rate,
    }


def warm_host(nbytes: int) -> None:
    """Touches host memory once, so the VM's first-touch cost is not charged to the first mode."""
    chunk = 1 << 30
    blocks = []
    for _ in range(max(1, nbytes // chunk)):
        blocks.append(torch.ones(chunk // 4))
    del blocks


HEADER = (
    f"{'op':<6} {'moments':>7} {'N':>6} {'M':>6} {'mode':<27} {'GPU extra':>10} {'B/N':>6} "
    f"{'host extra':>10} {'seconds':>8} {'T*':>6} {'x T*':>5}"
)


def format_row(r: dict[str, Any]) -> str:
    mode = r["mode"] + (" (repeat)" if r.get("repeat") else "")
    return (
        f"{r['op']:<6} {r['moments']:>7} {r['n_elements'] / G:>5.2f}G "
        f"{r['max_elements'] / MI:>5.0f}M {mode:<27} {r['peak_extra_gpu_bytes'] / G:>8.3f}GB "
        f"{r['gpu_bytes_per_n']:>6.2f} {r['peak_extra_host_bytes'] / G:>8.2f}GB "
        f"{r['seconds']:>8.2f} {r.get('bound_seconds', 0):>6.2f} "
        f"{r.get('seconds_over_bound', 0):>5.2f}"
    )


def cases(sweep: str) -> list[tuple[int, int, str, tuple[str, ...]]]:
    """(N, M, moments, ops) per case."""
    both = ("export", "load")
    if sweep == "default":
        return [(G // 2, 64 * MI, "bf16", both)]
    if sweep == "full":
        n_sweep = [(n, 64 * MI, "bf16", both) for n in (G // 2, G, 2 * G)]
        n_sweep.append((4 * G, 64 * MI, "bf16", ("export",)))
        m_sweep = [(G, m, "bf16", both) for m in (16 * MI, 256 * MI, G)]
        dtypes = [(G, 64 * MI, d, both) for d in ("fp16", "fp8", "fp32")]
        return n_sweep + m_sweep + dtypes
    if sweep == "speed":  # the export-time cases of the speed targets, in one run
        export = ("export",)
        return [
            (G, 64 * MI, "bf16", export),
            (4 * G, 64 * MI, "bf16", export),
            (G, 16 * MI, "bf16", export),
            (G, G, "bf16", export),
            (G, 64 * MI, "fp16", export),
            (G, 64 * MI, "fp8", export),
        ]
    raise ValueError(f"unknown sweep {sweep!r}; valid: default, full, speed")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--sweep", choices=("default", "full", "speed"), default="default")
    parser.add_argument("--modes", default=",".join(MODES), help="comma-separated subset")
    parser.add_argument("--ops", default="export,load", help="export, load or both")
    parser.add_argument("--out", type=Path, default=None, help="JSON path (default: none)")
    args = parser.parse_args(argv)
    missing = requirements_missing()
    if missing:
        print(
            "This benchmark measures real Transformer Engine FusedAdam exports on an NVIDIA GPU.\n"
            f"It cannot run here: {missing}.\n"
            "It needs: a CUDA GPU, torch with CUDA, and Transformer Engine "
            "(pip install 'transformer-engine[pytorch]').\n"
            "The CPU test suite runs anywhere: python -m pytest -q",
            file=sys.stderr,
        )
        return 2
    modes = tuple(m for m in args.modes.split(",") if m)
    for m in modes:
        if m not in MODES:
            parser.error(f"unknown mode {m!r}; valid: {', '.join(MODES)}")
    ops = tuple(o for o in args.ops.split(",") if o)
    plan = [
        (n, m, d, tuple(o for o in case_ops if o in ops)) for n, m, d, case_ops in cases(args.sweep)
    ]
    warm_host(min(64 * G, 12 * max(n for n, _, _, _ in plan)))
    bw = bandwidths()
    print(
        "bandwidths (GB/s): " + ", ".join(f"{k} {v / 1e9:.1f}" for k, v in bw.items()), flush=True
    )
    print(HEADER, flush=True)
    records = []
    from te_ckpt_placement import release_buffers

    for n, m, moments, case_ops in plan:
        records.extend(run_case(n, m, moments, modes, case_ops, bw))
        release_buffers()
        gc.collect()
        torch.cuda.empty_cache()
    result = {"machine": machine(), "bandwidths_bytes_per_s": bw, "records": records}
    if args.out is not None:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(result, indent=1) + "\n")
        print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    sys.exit(main())
