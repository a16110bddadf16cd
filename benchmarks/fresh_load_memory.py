"""GPU memory of a ``StreamingLoadPlanner`` load into a fresh TE FusedAdam, at world size 1.

A resume builds its optimizer fresh: it has no state until the load, and the planner first gives
it TE's initial states (``te_load.initialize_states``), then reads the checkpoint into them. For
each moments dtype (FP8 and FP16 by default; FP32 masters and BF16 weights, as
``benchmarks/dcp_e2e.py`` builds them: ``Linear(hidden, hidden)`` layers under FSDP2, here on a
1-rank group), it saves a trained optimizer with DCP, loads it into a fresh one through the
planner and records, per rank (the one):

- ``n_elements`` (N) and ``max_elements`` (M, the largest local state) in elements;
- ``kept_bytes``: GPU bytes the load left allocated (the states, their scales, and the
  transposes TE keeps of FP8 states on Hopper, ``fp8_transpose_bytes``); ``stored_bytes``: the
  states' stored bytes alone (FP8 ``_data`` and ``_scale_inv``, FP16/FP32 tensors, scales);
- ``peak_extra_gpu_bytes``: ``torch.cuda.max_memory_allocated`` above the start, less
  ``kept_bytes``, with its two phases: ``init_peak_extra_gpu_bytes`` (making the initial states,
  until the planner's ``set_up_planner``, above the states made) and
  ``read_peak_extra_gpu_bytes`` (the reads and writes, above ``kept_bytes``);
  ``peak_over_stored_bytes`` is the peak above ``stored_bytes`` instead (TE's FP8 transposes
  then count as extra);
- ``bound_bytes`` = 8 x M + 1 MiB (docs/dcp-load.md) and the phases' bounds:
  ``init_bound_bytes`` = 5 x M + 1 MiB with FP8 states (TE's ``_initialize_state`` of one: its
  uint8 zeros and their FP32 copy to quantize from), 1 MiB otherwise; ``read_bound_bytes`` =
  4 x M + 1 MiB (the one FP32 copy TE scales an FP16/FP8 state from);
- the host's thread settings (``torch_threads``, ``OMP_NUM_THREADS``) and the planner's
  ``peak_assembly_bytes`` and its report's details and wait (``load_stats``).

Every load is compared bit for bit with TE's own DCP load of the same checkpoint (its GPU
template, then its ``load_state_dict``) into another fresh optimizer before its numbers are kept.

Usage (from the repository root, on a machine with a CUDA GPU and Transformer Engine):
    python benchmarks/fresh_load_memory.py --out FILE.json            # N = 134 M, M = 67 M
    python benchmarks/fresh_load_memory.py --out FILE.json --layers 16 --hidden 4096
    python benchmarks/fresh_load_memory.py --cpu-smoke --out FILE.json  # the CPU stand-in of TE,
                                                                         # tiny (no numbers)

Without CUDA and Transformer Engine (and without --cpu-smoke) it says what it needs and exits
with status 2. ``tests/test_gpu_dcp_load.py`` asserts the bounds with :func:`measure`.
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import gc
import json
import os
import socket
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:  # run as a script, sys.path[0] is benchmarks/
    sys.path.insert(0, str(ROOT))

from benchmarks import dcp_e2e  # noqa: E402

MOMENTS = {"fp8": torch.uint8, "fp16": torch.float16, "bf16": torch.bfloat16}
MIB = 1 << 20


def bounds(moments: torch.dtype, m: int) -> dict[str, int]:
    """The bytes docs/dcp-load.md bounds a fresh-optimizer load by, for M = ``m`` elements."""
    fp8 = moments == torch.uint8
    return {
        "bound_bytes": 8 * m + MIB,
        "init_bound_bytes": (5 * m if fp8 else 0) + MIB,
        "read_bound_bytes": 4 * m + MIB,
    }


def _gpu() -> bool:
    return not dcp_e2e.SMOKE


def _allocated() -> tuple[int, int]:
    """(allocated, peak since the last reset) GPU bytes; zeros on the CPU."""
    if not _gpu():
        return 0, 0
    torch.cuda.synchronize()
    return torch.cuda.memory_allocated(), torch.cuda.max_memory_allocated()


def _phased_planner(adapter: Any) -> Any:
    """A ``StreamingLoadPlanner`` that notes the GPU bytes once the initial states exist."""
    from te_ckpt_placement.dcp import StreamingLoadPlanner

    class Phased(StreamingLoadPlanner):
        at_setup: tuple[int, int] = (0, 0)

        def set_up_planner(self, *args: Any, **kwargs: Any) -> None:
            # dcp.load asked the adapter for its template (the initial states) before this.
            self.at_setup = _allocated()
            if _gpu():
                torch.cuda.reset_peak_memory_stats()
            super().set_up_planner(*args, **kwargs)

    return Phased(adapter)


def state_bytes(opt: Any) -> dict[str, int]:
    """The stored bytes of every state and scale, and the FP8 transposes TE keeps besides."""
    stored = transposes = 0
    for param, states in opt.state.items():
        for value in states.values():
            local = dcp_e2e.local(value)
            parts = [getattr(local, a, None) for a in ("_data", "_scale_inv")]
            if parts[0] is None:
                parts = [local]
            stored += sum(t.numel() * t.element_size() for t in parts if t is not None)
            transpose = getattr(local, "_transpose", None)
            if isinstance(transpose, torch.Tensor):
                transposes += transpose.numel() * transpose.element_size()
        stored += sum(s.numel() * s.element_size() for s in opt._scales.get(param, {}).values())
    return {"stored_bytes": stored, "fp8_transpose_bytes": transposes}


def measure(moments_name: str, layers: int, hidden: int, root: Path) -> dict[str, Any]:
    """One fresh-optimizer streaming load (see the module docstring); needs a process group."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_model_state_dict, set_model_state_dict

    from te_ckpt_placement.dcp import PlacedOptimizerState

    moments = MOMENTS[moments_name]
    model, trained = dcp_e2e.build(layers, hidden, moments, seed=0, remainders=False)
    n = sum(dcp_e2e.local(p).numel() for p in model.parameters())
    m = max(dcp_e2e.local(p).numel() for p in model.parameters())
    path = str(root / f"fresh_load_{moments_name}")
    dcp.save(
        {"model": get_model_state_dict(model), "optim": PlacedOptimizerState(model, trained)},
        checkpoint_id=path,
    )
    del trained
    gc.collect()
    if _gpu():
        torch.cuda.empty_cache()

    opt = dcp_e2e.make_optimizer(model, moments, remainders=False)  # fresh: no state
    base, _ = _allocated()
    if _gpu():
        torch.cuda.reset_peak_memory_stats()
    adapter = PlacedOptimizerState(model, opt)
    state = {"model": get_model_state_dict(model), "optim": adapter}
    planner = _phased_planner(adapter)
    dcp.load(state, checkpoint_id=path, planner=planner)
    set_model_state_dict(model, state["model"])
    end, read_peak = _allocated()
    del state
    (setup, init_peak), kept = planner.at_setup, end - base
    record: dict[str, Any] = {
        "moments": moments_name,
        "masters": "fp32",
        "world_size": 1,
        "parallelism": "fsdp2",
        "layers": layers,
        "hidden": hidden,
        "n_elements": n,
        "max_elements": m,
        "kept_bytes": kept,
        **state_bytes(opt),
        "peak_extra_gpu_bytes": max(init_peak, read_peak) - base - kept,
        "init_peak_extra_gpu_bytes": init_peak - setup,
        "read_peak_extra_gpu_bytes": read_peak - end,
        **bounds(moments, m),
        "peak_assembly_bytes": planner.peak_assembly_bytes,
        "load_stats": {**planner.report.details, "wait_s": planner.report.wait_seconds},
        "torch_threads": torch.get_num_threads(),
        "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS"),
    }
    record["peak_over_stored_bytes"] = max(init_peak, read_peak) - base - record["stored_bytes"]
    record["within_bounds"] = (
        record["peak_extra_gpu_bytes"] <= record["bound_bytes"]
        and record["init_peak_extra_gpu_bytes"] <= record["init_bound_bytes"]
        and record["read_peak_extra_gpu_bytes"] <= record["read_bound_bytes"]
    )
    if not _gpu():  # the CPU stand-in: the logic ran, the numbers mean nothing
        for key in list(record):
            if key.endswith("_gpu_bytes") or key in ("kept_bytes", "peak_over_stored_bytes"):
                record[key] = None
        record["within_bounds"] = None

    # TE's own load of the same checkpoint into another fresh optimizer: the same bits.
    ours = dcp_e2e.fingerprint(model, opt)
    del adapter, opt, planner
    gc.collect()
    ref = dcp_e2e.make_optimizer(model, moments, remainders=False)
    te_own = PlacedOptimizerState(model, ref, placement=None)
    state = {"model": get_model_state_dict(model), "optim": te_own}
    dcp.load(state, checkpoint_id=path)
    set_model_state_dict(model, state["model"])
    theirs = dcp_e2e.fingerprint(model, ref)
    assert ours.keys() == theirs.keys(), sorted(ours.keys() ^ theirs.keys())
    for key, value in theirs.items():
        same = (
            torch.equal(ours[key], value) if isinstance(value, torch.Tensor) else ours[key] == value
        )
        assert same, f"fresh {moments_name} load: {key} differs from TE's own load"
    record["equal_to_te_load"] = True
    del state, ref, model
    gc.collect()
    if _gpu():
        torch.cuda.empty_cache()
    return record


def requirements_missing() -> str | None:
    if not torch.cuda.is_available():
        return f"no CUDA GPU is visible to torch {torch.__version__}"
    try:
        import transformer_engine.pytorch  # noqa: F401
    except Exception as exc:
        return f"Transformer Engine for PyTorch does not import ({type(exc).__name__}: {exc})"
    return None


@contextlib.contextmanager
def one_rank_group(smoke: bool) -> Iterator[None]:
    """A 1-rank default process group (gloo on the CPU; gloo and NCCL on a GPU), TE hooked."""
    import torch.distributed as dist

    from te_ckpt_placement import _te_hooks as te_hooks

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = int(s.getsockname()[1])
    dist.init_process_group(
        "gloo" if smoke else "cpu:gloo,cuda:nccl",
        rank=0,
        world_size=1,
        init_method=f"tcp://127.0.0.1:{port}",
        timeout=datetime.timedelta(minutes=30),
    )
    previous = dcp_e2e.SMOKE
    dcp_e2e.SMOKE = smoke
    patched: list[type] = []
    if smoke:
        from tests.support.standin import StandInFusedAdam

        if not te_hooks.is_patched(StandInFusedAdam):  # the stand-in follows the policy, as TE
            te_hooks.patch_class(StandInFusedAdam)
            patched.append(StandInFusedAdam)
    else:
        torch.cuda.set_device(0)
        te_hooks.install()
    try:
        yield
    finally:
        for cls in patched:
            te_hooks.unpatch_class(cls)
        dcp_e2e.SMOKE = previous
        dist.destroy_process_group()


def run(args: argparse.Namespace) -> dict[str, Any]:
    """Every selected moments dtype, with the machine's description."""
    records = []
    with one_rank_group(args.cpu_smoke), tempfile.TemporaryDirectory(dir=args.dir) as root:
        for name in args.moments.split(","):
            records.append(measure(name, args.layers, args.hidden, Path(root)))
            print(json.dumps(records[-1]), flush=True)
    if args.cpu_smoke:
        info = dcp_e2e.smoke_machine()
    else:
        from benchmarks._measure import machine

        info = machine()
    return {"machine": info, "records": records}


def parse(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--out", type=Path, required=True, help="JSON path to write")
    parser.add_argument("--layers", type=int, default=2, help="Linear layers (default 2)")
    parser.add_argument("--hidden", type=int, default=8192, help="their width (default 8192)")
    parser.add_argument(
        "--moments",
        default=None,
        help="comma-separated subset of " + ", ".join(MOMENTS) + " (default fp8,fp16; fp16,bf16 "
        "with --cpu-smoke, whose stand-in keeps FP8 states of plain tensors only)",
    )
    parser.add_argument("--dir", default=None, help="where the checkpoints are written")
    parser.add_argument(
        "--cpu-smoke",
        action="store_true",
        help="the CPU stand-in of TE on a 1-rank gloo group (checks only; no GPU numbers); "
        "implies --hidden 64 unless given",
    )
    args = parser.parse_args(argv)
    if args.moments is None:
        args.moments = "fp16,bf16" if args.cpu_smoke else "fp8,fp16"
    for name in args.moments.split(","):
        if name not in MOMENTS:
            parser.error(f"unknown moments {name!r}; valid: {', '.join(MOMENTS)}")
        if name == "fp8" and args.cpu_smoke:
            parser.error(
                "--moments fp8 with --cpu-smoke: valid values are fp16 and bf16 (the "
                "CPU stand-in keeps FP8 states of plain tensors only, not DTensors)"
            )
    if args.cpu_smoke and "--hidden" not in argv:
        args.hidden = 64
    if args.layers < 1 or args.hidden < 1:
        parser.error("--layers and --hidden: valid values are >= 1")
    return args


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    args = parse(argv)
    missing = None if args.cpu_smoke else requirements_missing()
    if missing:
        print(
            "This benchmark measures the GPU memory of a streaming DCP load into a fresh TE\n"
            f"FusedAdam on one NVIDIA GPU. It cannot run here: {missing}.\n"
            "It needs: a CUDA GPU, torch with CUDA and NCCL, and Transformer Engine. Its logic "
            "runs anywhere with --cpu-smoke.",
            file=sys.stderr,
        )
        return 2
    out = run(args)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(out, indent=1) + "\n")
    print(f"wrote {args.out}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
