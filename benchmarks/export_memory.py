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
import gc
import json
import os
import platform
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

G = 1 << 30
MI = 1 << 20
MOMENTS = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp8": torch.uint8, "fp32": torch.float32}
MODES = ("te_default", "te_default_dcp_cpu_offload", "placement_cpu")


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
    if mode == "placement_cpu":

        def placed() -> Any:
            with export_placement("cpu"):
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


def measure(mode: str, model: Any, opt: Any) -> dict[str, Any]:
    fn = export_fn(mode, model, opt)
    gc.collect()
    torch.cuda.synchronize()
    gpu_base = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    host_base = rss()
    with HostPeak() as host:
        start = time.perf_counter()
        sd = fn()
        torch.cuda.synchronize()
        seconds = time.perf_counter() - start
    gpu_peak = torch.cuda.max_memory_allocated() - gpu_base
    devices = verify(sd, model, opt)  # correctness before any number is kept
    del sd
    gc.collect()
    return {
        "peak_extra_gpu_bytes": gpu_peak,
        "peak_extra_host_bytes": host.peak - host_base,
        "seconds": seconds,
        "output_devices": devices,
    }


def run_case(n: int, m: int, moments: str, modes: tuple[str, ...]) -> list[dict[str, Any]]:
    model, opt = build(n, m, MOMENTS[moments])
    local = sum(p.numel() for p in model.parameters())
    largest = max(p.numel() for p in model.parameters())
    records = []
    for mode in modes:
        result = measure(mode, model, opt)
        records.append(
            {
                "op": "export",
                "mode": mode,
                "moments": moments,
                "n_elements": local,
                "max_elements": largest,
                "n_params": len(list(model.parameters())),
                **result,
                "gpu_bytes_per_n": result["peak_extra_gpu_bytes"] / local,
                "gpu_bytes_per_m": result["peak_extra_gpu_bytes"] / largest,
                "host_bytes_per_n": result["peak_extra_host_bytes"] / local,
            }
        )
        print(format_row(records[-1]), flush=True)
    del model, opt
    gc.collect()
    torch.cuda.empty_cache()
    return records


def warm_host(nbytes: int) -> None:
    """Touches host memory once, so the VM's first-touch cost is not charged to the first mode."""
    chunk = 1 << 30
    blocks = []
    for _ in range(max(1, nbytes // chunk)):
        blocks.append(torch.ones(chunk // 4))
    del blocks


HEADER = (
    f"{'moments':>7} {'N':>6} {'M':>6} {'mode':<27} {'GPU extra':>10} {'B/N':>6} "
    f"{'host extra':>10} {'seconds':>8}"
)


def format_row(r: dict[str, Any]) -> str:
    return (
        f"{r['moments']:>7} {r['n_elements'] / G:>5.2f}G {r['max_elements'] / MI:>5.0f}M "
        f"{r['mode']:<27} {r['peak_extra_gpu_bytes'] / G:>8.3f}GB {r['gpu_bytes_per_n']:>6.2f} "
        f"{r['peak_extra_host_bytes'] / G:>8.2f}GB {r['seconds']:>8.2f}"
    )


def cases(sweep: str) -> list[tuple[int, int, str]]:
    if sweep == "default":
        return [(G // 2, 64 * MI, "bf16")]
    if sweep == "full":
        n_sweep = [(n, 64 * MI, "bf16") for n in (G // 2, G, 2 * G, 4 * G)]
        m_sweep = [(G, m, "bf16") for m in (16 * MI, 256 * MI, G)]
        dtypes = [(G, 64 * MI, d) for d in ("fp16", "fp8", "fp32")]
        return n_sweep + m_sweep + dtypes
    raise ValueError(f"unknown sweep {sweep!r}; valid: default, full")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--sweep", choices=("default", "full"), default="default")
    parser.add_argument("--modes", default=",".join(MODES), help="comma-separated subset")
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
    plan = cases(args.sweep)
    warm_host(min(64 * G, 10 * max(n for n, _, _ in plan)))
    print(HEADER, flush=True)
    records = []
    for n, m, moments in plan:
        records.extend(run_case(n, m, moments, modes))
    result = {"machine": machine(), "records": records}
    if args.out is not None:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(result, indent=1) + "\n")
        print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    sys.exit(main())
