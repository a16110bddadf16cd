"""The measuring helpers the benchmarks share: machine facts, host and GPU peaks, builds of TE
optimizers, export modes, bit-for-bit checks, state and checkpoint sizes.

Moved out of ``export_memory.py``, which keeps its main job and imports these; the other
benchmarks import them from here rather than import ``export_memory`` as a library.
"""

from __future__ import annotations

import contextlib
import dataclasses
import gc
import os
import platform
import subprocess
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any

import torch

G = 1 << 30
MI = 1 << 20
MOMENTS = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp8": torch.uint8, "fp32": torch.float32}
MODES = ("te_default", "te_default_dcp_cpu_offload", "placement_cpu", "placement_cpu_reuse_buffers")
MASTERS = ("remainder", "fp32")  # FP32 masters kept as int16 remainders of BF16 params, or FP32


def requirements_missing() -> str | None:
    if not torch.cuda.is_available():
        return "no CUDA GPU is visible to torch " + torch.__version__
    try:
        import transformer_engine.pytorch  # noqa: F401
    except Exception as exc:
        return f"Transformer Engine for PyTorch does not import ({type(exc).__name__}: {exc})"
    return None


def driver_version() -> str:
    """The NVIDIA driver's version as ``nvidia-smi`` reports it, or ``"unknown"``."""
    try:
        return subprocess.run(
            ["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"],
            capture_output=True,
            text=True,
            check=True,
        ).stdout.split("\n")[0]
    except (OSError, subprocess.CalledProcessError):
        return "unknown"


def machine() -> dict[str, Any]:
    import transformer_engine

    driver = driver_version()
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


class HostHighWater:
    """The exact peak RSS of a block above its start: the kernel's VmHWM, reset on entry.

    Falls back to :class:`HostPeak` sampling where /proc/self/clear_refs cannot be written.
    """

    def __init__(self) -> None:
        self.peak = 0
        self._sampler: HostPeak | None = None

    @staticmethod
    def _reset() -> bool:
        try:
            with open("/proc/self/clear_refs", "w") as f:
                f.write("5")
            return True
        except OSError:
            return False

    @staticmethod
    def _high_water() -> int:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("VmHWM:"):
                    return int(line.split()[1]) * 1024
        raise OSError("no VmHWM")

    def __enter__(self) -> HostHighWater:
        if not self._reset():
            self._sampler = HostPeak().__enter__()
        return self

    def __exit__(self, *exc: object) -> None:
        if self._sampler is not None:
            self._sampler.__exit__(*exc)
            self.peak = self._sampler.peak
        else:
            self.peak = self._high_water()


def build(
    n: int,
    m: int,
    moments: torch.dtype,
    seed: int = 0,
    *,
    master: str = "remainder",
    device: str = "cuda",
) -> tuple[Any, Any]:
    """A model of bf16 params (as many of M elements as fit in N) and a stepped TE FusedAdam.

    ``master``: FP32 masters as int16 remainders (``"remainder"``) or as FP32 (``"fp32"``).
    ``device="cpu"`` builds TE's CPU stand-in (tests/support/standin.py) instead, for a smoke run.
    """
    if master not in MASTERS:
        raise ValueError(f"unknown master {master!r}; valid: {', '.join(MASTERS)}")
    sizes = [m] * (n // m) + ([n % m] if n % m else [])
    gen = torch.Generator(device=device).manual_seed(seed)
    params = [
        torch.nn.Parameter(torch.randn(s, device=device, generator=gen).bfloat16()) for s in sizes
    ]
    model = torch.nn.ParameterList(params)
    if device == "cpu":
        from tests.support.standin import make_optimizer, train

        opt = make_optimizer(params, moments=moments, master=master, lr=1e-3)
        train(opt, steps=1, seed=seed)
        opt.zero_grad(set_to_none=True)
        return model, opt
    from transformer_engine.pytorch.optimizers import FusedAdam

    opt = FusedAdam(
        params,
        lr=1e-3,
        master_weights=True,
        store_param_remainders=master == "remainder",
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
def measured(
    result: dict[str, Any], *, host: str = "sampled", cuda: bool = True
) -> Iterator[dict[str, Any]]:
    """Fills ``result`` with the GPU peak, host RSS peak and seconds of the block.

    ``result["_start"]`` is the block's start time, for callers that also time a part of it
    (they set ``result["seconds"]`` themselves; it defaults to the whole block). ``host``:
    ``"sampled"`` (RSS every millisecond) or ``"high_water"`` (VmHWM, see the module docstring).
    ``cuda=False``: no GPU (the CPU smoke run), the GPU peak is recorded as 0.
    """
    gc.collect()
    if cuda:
        torch.cuda.synchronize()
        gpu_base = torch.cuda.memory_allocated()
        torch.cuda.reset_peak_memory_stats()
    host_base = rss()
    with HostHighWater() if host == "high_water" else HostPeak() as peak:
        start = time.perf_counter()
        result["_start"] = start
        yield result
        if cuda:
            torch.cuda.synchronize()
        result["seconds_total"] = time.perf_counter() - start
    result.setdefault("seconds", result["seconds_total"])
    result["peak_extra_gpu_bytes"] = torch.cuda.max_memory_allocated() - gpu_base if cuda else 0
    result["peak_extra_host_bytes"] = peak.peak - host_base
    result["host_peak_method"] = (
        "sampled" if host == "sampled" or getattr(peak, "_sampler", None) else "high_water"
    )
    del result["_start"]


def timed(
    fn: Callable[[], Any], *, host: str = "sampled", cuda: bool = True
) -> tuple[Any, dict[str, Any]]:
    """Runs ``fn`` once: its result, GPU peak above the start, host RSS peak, seconds."""
    result: dict[str, Any] = {}
    with measured(result, host=host, cuda=cuda):
        out = fn()
    return out, result


def placed_report(op: str, before: Any) -> dict[str, Any]:
    """The report of the placed export or load that just ran in this thread (``before`` is the
    last report before it), printed."""
    from te_ckpt_placement import last_report

    report = last_report()
    if report is None or report is before or report.op != op or report.failed:
        raise RuntimeError(f"the {op} that just ran left no report of its own (found {report})")
    print(f"  {report}", flush=True)
    return dataclasses.asdict(report)


def report_checks(rec: dict[str, Any], records: list[dict[str, Any]]) -> dict[str, bool]:
    """A placed run's report against what this run measured or counted by itself."""
    r = rec["report"]
    cuda = rec["device"] == "cuda"
    checks = {}
    if rec["op"] == "export":
        checks["device_to_host_bytes == raw_bytes"] = r["device_to_host_bytes"] == rec["raw_bytes"]
        checks["host_bytes_written == output_bytes"] = (
            r["host_bytes_written"] == rec["output_bytes"]
        )
        checks["gpu_bytes == 0"] = r["gpu_bytes"] == 0
        te = [x for x in records if x["op"] == "export" and x["mode"] == "te_default"]
        if te:
            measured = te[-1]["peak_extra_gpu_bytes"]
            checks["te_gpu_bytes == TE's measured GPU peak"] = r["te_gpu_bytes"] == measured
        return checks
    checks["host_to_device_bytes == upload_bytes"] = (
        r["host_to_device_bytes"] == rec["upload_bytes"]
    )
    if cuda:
        te = rec["te_peak_extra_gpu_bytes"]
        checks["te_gpu_bytes == TE's measured GPU peak"] = r["te_gpu_bytes"] == te
        # Our FP32 copy (in 512-byte blocks) plus TE's one-element scaling temporaries.
        bound = -(-r["gpu_bytes"] // 512) * 512 + 16 * 512
        checks["gpu_bytes <= measured GPU peak <= its bound"] = (
            r["gpu_bytes"] <= rec["peak_extra_gpu_bytes"] <= bound
        )
    return checks


def measure(mode: str, model: Any, opt: Any) -> dict[str, Any]:
    from te_ckpt_placement import last_report

    before = last_report()
    sd, result = timed(export_fn(mode, model, opt))
    if mode.startswith("placement_cpu"):
        result["report"] = placed_report("export", before)
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


def upload_bytes(opt: Any) -> int:
    """The bytes a streaming load copies to the device: each state as stored, FP16 and FP8
    states as the FP32 copy TE scales on the device."""
    from torch.distributed.tensor import DTensor

    total = 0
    for states in opt.state.values():
        for name, value in states.items():
            local = value._local_tensor if isinstance(value, DTensor) else value
            stored = getattr(local, "_data", local)
            scaled = opt.name_to_dtype_map[name] in (torch.float16, torch.uint8)
            total += stored.numel() * (4 if scaled else stored.element_size())
    return total


def live_snapshot(opt: Any) -> list[torch.Tensor]:
    """Copies of the raw bytes of every live state and scale, on their device, in order."""
    from torch.distributed.tensor import DTensor

    prints = []
    for param, states in opt.state.items():
        for value in states.values():
            local = value._local_tensor if isinstance(value, DTensor) else value
            prints.append(getattr(local, "_data", local).detach().clone())
        prints.extend(s.detach().clone() for s in opt._scales.get(param, {}).values())
    return prints


def same_bits(a: list[torch.Tensor], b: list[torch.Tensor]) -> bool:
    def raw(t: torch.Tensor) -> torch.Tensor:
        return t.contiguous().reshape(-1).view(torch.uint8)

    return len(a) == len(b) and all(torch.equal(raw(x), raw(y)) for x, y in zip(a, b, strict=True))


def checkpoint_bytes(checkpoint: dict[str, Any]) -> int:
    """I: the bytes of the checkpoint's tensors, which a load reads once."""
    from torch.distributed.tensor import DTensor

    total = 0
    for states in checkpoint["state"].values():
        for value in states.values():
            local = value._local_tensor if isinstance(value, DTensor) else value
            total += local.numel() * local.element_size()
    return total


def load_bound(written: int, read: int, bw: dict[str, float]) -> float:
    """T*_load = max(R / B_h2d, I / B_host_read): ``written`` bytes to the GPU, ``read`` bytes of
    the checkpoint on the host, with both bandwidths measured in the same run."""
    return max(written / bw["h2d"], read / bw["host_read"])
