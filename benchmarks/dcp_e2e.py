"""End to end DCP save, async save and load of TE FusedAdam under FSDP2 on 2 GPUs.

For each operation it compares the path users run today with the policy:

- ``dcp_save``: ``get_optimizer_state_dict`` + ``dcp.save`` of ``{"model", "optim"}``.
  ``te_default`` uses ``StateDictOptions(cpu_offload=True)`` (TE builds every FP32 copy on the GPU,
  then DCP offloads); ``placement_cpu`` runs the same inside ``export_placement("cpu")``.
- ``dcp_async_save``: the same dict through ``dcp.async_save`` on a ``cpu:gloo,cuda:nccl`` group.
  ``te_default`` and ``placement_cpu`` use DCP's default stager (it copies every tensor again,
  CPU ones included); ``placement_cpu_passthrough_stager`` passes the export's tensors through
  ``te_ckpt_placement.dcp.PassThroughStager`` and stages only the model weights.
- ``full_state_dict``: ``get_optimizer_state_dict`` with ``full_state_dict=True`` and
  ``cpu_offload=True`` (every state all-gathered to rank 0's host), without and with the policy;
  the two results must be equal bit for bit. ``largest_state_bytes`` is one global FP32 state,
  the unit the policy's GPU peak is bounded by.
- ``dcp_load``: the usual template (``get_optimizer_state_dict``), ``dcp.load``, then
  ``set_model_state_dict`` + ``set_optimizer_state_dict``; ``te_default`` without a policy (TE's
  load casts every state onto the GPU at once), ``placement_cpu`` inside the policy.
  ``placement_cpu_streaming`` has no template: ``dcp.load`` of a ``PlacedOptimizerState`` with
  ``planner=StreamingLoadPlanner(state)`` reads every item straight into the live states
  (:func:`streaming_load`).

Two opt-in paths of te_ckpt_placement.dcp (docs/dcp.md) get modes of their own:

- ``dcp_save`` ``placement_cpu_streaming``: ``PlacedOptimizerState(save="streaming")`` written by
  ``StreamingWriter(thread_count=--writer-threads)``: each state is produced (D2H of its raw
  bytes, host conversion) when the writer asks for it and dropped once written. Records
  ``writer_threads``, ``host_bound_bytes`` = 1 GiB + (writer_threads + 1) x 4 x ``max_elements``.
- ``dcp_async_save`` ``placement_cpu_snapshot``: the same through ``dcp.async_save``, staged by
  ``StreamingWriter``'s ``SnapshotStager`` (raw stored bytes and weights into reused pinned
  buffers; the FP32 conversion runs in the background write). ``--snapshot-saves`` saves in a
  row (``save_index`` 0 is the first, which allocates and pins the buffers), each followed by a
  training step while the write runs, each checkpoint compared with the export at its save point.
  Records ``blocked_seconds`` (from building the state dict until ``async_save`` returns),
  ``raw_bytes`` (R_optimizer + R_model), ``d2h_bytes_per_s`` (B_d2h: the best of 5 concurrent
  device-to-host copies of 1 GiB into pinned memory on both ranks, measured in the same run),
  ``bound_seconds`` = raw_bytes / d2h_bytes_per_s, ``host_extra_bytes`` (the RSS peak above the
  start of the first snapshot save) and ``host_bound_bytes`` = raw_bytes + 1 GiB +
  (writer_threads + 1) x 4 x ``max_elements``.

The new modes' checkpoints are also read into templates of TE's own (GPU) export.
Every checkpoint is read back and compared bit for bit with an export first checked against
TE's own ``get_unscaled_state``, and every load must leave the optimizer exactly as it was when
the checkpoint was written; numbers are kept only after that. ``seconds`` is the time the training
loop is blocked (for ``dcp_async_save``: until ``async_save`` returns, i.e. export plus staging);
``seconds_total`` includes the background write. ``peak_extra_gpu_bytes`` is
``torch.cuda.max_memory_allocated`` above the start, ``peak_extra_host_bytes`` the peak RSS growth
(sampled every millisecond) until the write has finished.

Usage (from the repository root, on a machine with 2 GPUs and Transformer Engine):
    torchrun --nproc_per_node=2 benchmarks/dcp_e2e.py --out FILE.json
    python benchmarks/dcp_e2e.py --out FILE.json        # spawns the 2 ranks itself
    python benchmarks/dcp_e2e.py --cpu-smoke            # anywhere: the CPU stand-in of TE on
                                                        # 2 gloo ranks, a tiny model (no numbers)

Without 2 CUDA GPUs and Transformer Engine (and without --cpu-smoke) it says what it needs and
exits with status 2.
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import gc
import json
import os
import shutil
import socket
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch

ROOT = Path(__file__).resolve().parents[1]
WORLD = 2
MOMENTS = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp8": torch.uint8, "fp32": torch.float32}
OPS = ("dcp_save", "dcp_async_save", "dcp_load", "full_state_dict")
MODES = {
    "dcp_save": ("te_default", "placement_cpu", "placement_cpu_streaming"),
    "full_state_dict": ("te_default", "placement_cpu"),
    # placement_cpu_snapshot trains during its writes: it runs last.
    "dcp_async_save": (
        "te_default",
        "placement_cpu",
        "placement_cpu_passthrough_stager",
        "placement_cpu_snapshot",
    ),
    # placement_cpu_streaming before placement_cpu: its host peak is measured from a heap that
    # has not just held the template path's host template.
    "dcp_load": ("te_default", "placement_cpu_streaming", "placement_cpu"),
}
# (layers, hidden): bf16 Linear(hidden, hidden) layers without bias, fully_shard'ed per layer.
SIZES = {
    "small": (4, 4096),
    "medium": (8, 8192),
    "default": (16, 8192),
    "large": (32, 8192),
    "smoke": (3, 64),
}
GIB = 1 << 30

#: --cpu-smoke: the CPU stand-in of TE FusedAdam on 2 gloo ranks (set in each rank).
SMOKE = False


def device() -> str:
    return "cpu" if SMOKE else "cuda"


def synchronize() -> None:
    if not SMOKE:
        torch.cuda.synchronize()


def _ensure_root_on_path() -> None:
    # Run as a script (python or torchrun), sys.path[0] is benchmarks/, not the repository root.
    if str(ROOT) not in sys.path:
        sys.path.insert(0, str(ROOT))


def _measured(result: dict[str, Any]) -> Any:
    _ensure_root_on_path()
    from benchmarks._measure import measured

    return _measured_on_cpu(result) if SMOKE else measured(result)


@contextlib.contextmanager
def _measured_on_cpu(result: dict[str, Any]) -> Iterator[dict[str, Any]]:
    """``_measure.measured`` without a GPU: the GPU peak is 0 by construction."""
    from benchmarks._measure import HostPeak, rss

    gc.collect()
    host_base = rss()
    with HostPeak() as host:
        start = time.perf_counter()
        result["_start"] = start
        yield result
        result["seconds_total"] = time.perf_counter() - start
    result.setdefault("seconds", result["seconds_total"])
    result["peak_extra_gpu_bytes"] = 0
    result["peak_extra_host_bytes"] = host.peak - host_base
    del result["_start"]


def requirements_missing() -> str | None:
    """Why this benchmark cannot run here, or None."""
    if not torch.cuda.is_available():
        return f"no CUDA GPU is visible to torch {torch.__version__}"
    if torch.cuda.device_count() < WORLD:
        return f"it needs {WORLD} CUDA GPUs, torch sees {torch.cuda.device_count()}"
    try:
        import transformer_engine.pytorch  # noqa: F401
    except Exception as exc:
        return f"Transformer Engine for PyTorch does not import ({type(exc).__name__}: {exc})"
    return None


# --- model, optimizer and comparisons -----------------------------------------------------------
def build(
    layers: int, hidden: int, moments: torch.dtype, seed: int, *, remainders: bool = True
) -> tuple[Any, Any]:
    """A fully_shard'ed stack of bf16 Linear layers and a TE FusedAdam that has stepped twice.

    FP32 masters are kept as int16 remainders for BF16 moments, unless ``remainders=False``.
    """
    from torch.distributed.fsdp import fully_shard

    torch.manual_seed(seed)  # the same full weights on every rank; fully_shard keeps its shard
    model = torch.nn.Sequential(
        *[torch.nn.Linear(hidden, hidden, bias=False) for _ in range(layers)]
    ).to(device=device(), dtype=torch.bfloat16)
    for layer in model:
        fully_shard(layer)
    fully_shard(model)
    opt = make_optimizer(model, moments, remainders=remainders)
    for _ in range(2):
        train_step(model, opt, hidden)
    return model, opt


def make_optimizer(model: Any, moments: torch.dtype, *, remainders: bool = True) -> Any:
    """:func:`build`'s TE FusedAdam of ``model`` (the stand-in under --cpu-smoke), with no state."""
    if SMOKE:
        from tests.support.standin import StandInFusedAdam as FusedAdam
    else:
        from transformer_engine.pytorch.optimizers import FusedAdam

    return FusedAdam(
        model.parameters(),
        lr=1e-4,
        master_weights=True,
        store_param_remainders=remainders and moments == torch.bfloat16,
        exp_avg_dtype=moments,
        exp_avg_sq_dtype=moments,
    )


def train_step(model: Any, opt: Any, hidden: int) -> None:
    x = torch.randn(8, hidden, device=device(), dtype=torch.bfloat16)
    model(x).float().pow(2).mean().backward()
    opt.step()
    opt.zero_grad(set_to_none=True)
    synchronize()


def local(t: Any) -> torch.Tensor:
    from torch.distributed.tensor import DTensor

    return t._local_tensor if isinstance(t, DTensor) else t


def host_bits(t: Any) -> torch.Tensor:
    return local(t).detach().contiguous().cpu().reshape(-1).view(torch.uint8)


def tensors(tree: Any) -> Iterator[torch.Tensor]:
    if isinstance(tree, torch.Tensor):
        yield tree
    elif isinstance(tree, dict):
        for value in tree.values():
            yield from tensors(value)


def verify_against_te(export: dict[str, Any], model: Any, opt: Any) -> None:
    """The flattened export equals TE's ``get_unscaled_state`` state by state, all on the CPU."""
    by_fqn = dict(model.named_parameters())
    count = 0
    devices = set()
    for key, value in export.items():
        if not key.startswith("state."):
            continue
        fqn, name = key[len("state.") :].rsplit(".", 1)
        ref = opt.get_unscaled_state(by_fqn[fqn], name)
        ours = local(value)
        devices.add(ours.device.type)
        assert ours.dtype == ref.dtype and ours.shape == ref.shape, key
        assert torch.equal(
            ours.to(ref.device).reshape(-1).view(torch.uint8), ref.reshape(-1).view(torch.uint8)
        ), f"export of {key} differs from TE's get_unscaled_state"
        count += 1
        del ref
    assert count == len(by_fqn) * len(opt.state[next(iter(by_fqn.values()))]), count
    assert devices == {"cpu"}, f"export on {devices}: all states of an export on one device"


def assert_same_bits(ours: dict[str, Any], ref: dict[str, Any], where: str) -> None:
    assert ours.keys() == ref.keys(), f"{where}: keys differ"
    for key, value in ref.items():
        if isinstance(value, torch.Tensor):
            assert torch.equal(host_bits(ours[key]), value), f"{where}: {key} differs"
        else:
            assert ours[key] == value, f"{where}: {key}: {ours[key]!r} != {value!r}"


def fingerprint(model: Any, opt: Any) -> dict[str, Any]:
    """Host bytes of every param, stored optimizer state, scale and param_group entry."""
    out: dict[str, Any] = {}
    for name, p in model.named_parameters():
        out[f"param.{name}"] = host_bits(p).clone()
    names = {p: n for n, p in model.named_parameters()}
    for p, states in opt.state.items():
        for state, value in states.items():
            stored = local(value)
            stored = getattr(stored, "_data", stored)
            out[f"state.{names[p]}.{state}"] = host_bits(stored).clone()
        for state, scale in opt._scales.get(p, {}).items():
            out[f"scale.{names[p]}.{state}"] = host_bits(scale).clone()
    for i, group in enumerate(opt.param_groups):
        for k, v in group.items():
            if k != "params":
                out[f"group.{i}.{k}"] = float(v) if isinstance(v, torch.Tensor) else v
    return out


@torch.no_grad()
def blank(tree: Any) -> None:
    """Overwrites a load template, so that a load that skips a tensor cannot pass verification."""
    for t in tensors(tree):
        loc = local(t)
        loc.fill_(float("nan") if loc.is_floating_point() else -7)


# --- measurement --------------------------------------------------------------------------------
def counting_pass_through() -> Any:
    """A PassThroughStager that counts the exported tensors it handed on without a copy."""
    from te_ckpt_placement._export import is_exported
    from te_ckpt_placement.dcp import PassThroughStager

    class Counting(PassThroughStager):
        passed = 0
        exported = 0

        def stage(self, state_dict: dict[str, Any], **kwargs: Any) -> Any:
            staged = super().stage(state_dict, **kwargs)
            result = staged.result() if hasattr(staged, "result") else staged
            for key, value in state_dict["optim"].items():
                if is_exported(value):
                    self.exported += 1
                    self.passed += result["optim"][key] is value
            return staged

    return Counting()


def streaming_load(model: Any, opt: Any, path: str) -> dict[str, Any]:
    """The ``placement_cpu_streaming`` load of the model and optimizer at ``path``.

    Returns what the planner reports (assembly buffers, fallbacks) and the versions it ran on.
    """
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_model_state_dict, set_model_state_dict

    from te_ckpt_placement._te_contract import te_version
    from te_ckpt_placement.dcp import PlacedOptimizerState, StreamingLoadPlanner

    adapter = PlacedOptimizerState(model, opt)
    state = {"model": get_model_state_dict(model), "optim": adapter}
    planner = StreamingLoadPlanner(adapter)
    dcp.load(state, checkpoint_id=path, planner=planner)
    set_model_state_dict(model, state["model"])
    return {
        "peak_assembly_bytes": planner.peak_assembly_bytes,
        "fallbacks": planner.fallbacks,
        # The planner's report: resolve/commit/upload-wait seconds, ring items and bytes.
        "load_stats": {**planner.report.details, "wait_s": planner.report.wait_seconds},
        "torch_threads": torch.get_num_threads(),
        "versions": {"torch": torch.__version__, "transformer_engine": te_version()},
    }


def wait(response: Any) -> None:
    # torch 2.13 returns AsyncSaveResponse when staging is asynchronous, else a Future (2.11 too).
    if hasattr(response, "upload_completion"):
        response.staging_completion.result()
        response.upload_completion.result()
    else:
        response.result()


def optimizer_raw_bytes(opt: Any) -> int:
    """R_optimizer: the stored bytes of every local state, and the FP32 factor each FP16 state
    (``_scales``) or FP8 state (``_scale_inv``) is converted with: what the snapshot copies."""
    raw = 0
    for param, states in opt.state.items():
        for name, value in states.items():
            stored = local(value)
            data = getattr(stored, "_data", stored)
            raw += data.numel() * data.element_size()
            if hasattr(stored, "_scale_inv"):
                raw += stored._scale_inv.numel() * stored._scale_inv.element_size()
            elif data.dtype == torch.float16:
                scale = opt._scales[param][name]
                raw += scale.numel() * scale.element_size()
    return raw


def model_raw_bytes(model: Any) -> int:
    """R_model: the local bytes of every weight."""
    return sum(local(p).numel() * local(p).element_size() for p in model.parameters())


def d2h_bytes_per_s(nbytes: int = GIB, trials: int = 5) -> float:
    """B_d2h: the best of ``trials`` device-to-host copies of ``nbytes`` into pinned memory,
    every rank copying at the same time (as an async save's staging does)."""
    import torch.distributed as dist

    if SMOKE:  # host memory bandwidth, for the record
        src = torch.empty(nbytes // 16, dtype=torch.uint8)
        dst = torch.empty_like(src)
    else:
        src = torch.empty(nbytes, dtype=torch.uint8, device="cuda")
        dst = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
    best = 0.0
    for _ in range(trials):
        synchronize()
        dist.barrier()
        start = time.perf_counter()
        dst.copy_(src, non_blocking=not SMOKE)
        synchronize()
        best = max(best, src.numel() / (time.perf_counter() - start))
    del src, dst
    return best


class RankBench:
    """One rank's model, TE FusedAdam, reference and records, with one method per op.

    ``reference`` is what a checkpoint taken now must hold (optimizer export and weights, host
    bits) and ``before`` the fingerprint of the live state it was taken from; both follow the
    state when the snapshot saves train on.
    """

    def __init__(self, args: argparse.Namespace) -> None:
        import torch.distributed as dist
        from torch.distributed.checkpoint.state_dict import StateDictOptions

        from te_ckpt_placement import install

        self.args = args
        self.rank = dist.get_rank()
        if SMOKE:
            from te_ckpt_placement import _te_hooks as te_hooks
            from tests.support.standin import StandInFusedAdam

            te_hooks.patch_class(StandInFusedAdam)  # the stand-in follows the policy, as TE does
        else:
            install()
        self.layers, self.hidden = SIZES[args.size]
        self.moments = MOMENTS[args.moments]
        self.model, self.opt = build(self.layers, self.hidden, self.moments, seed=0)
        self.n_local = sum(local(p).numel() for p in self.model.parameters())
        self.m_local = max(local(p).numel() for p in self.model.parameters())
        self.async_pg = dist.new_group(backend="gloo")  # the background write's collectives, apart
        self.placed = StateDictOptions(flatten_optimizer_state_dict=True)
        self.today = StateDictOptions(flatten_optimizer_state_dict=True, cpu_offload=True)
        self.root = Path(args.dir)
        self.threads = args.writer_threads
        self.reference, self.before = self.take_reference()
        self.base = {
            "moments": args.moments,
            "masters": "remainder" if self.moments == torch.bfloat16 else "fp32",
            "n_elements": self.n_local,
            "max_elements": self.m_local,
            "rank": self.rank,
            "world_size": WORLD,
            "parallelism": "fsdp2",
            "layers": self.layers,
            "hidden": self.hidden,
        }
        self.records: list[dict[str, Any]] = []
        #: The fingerprint each dcp_load mode left (FP16/FP8 loads compare with te_default's).
        self.loaded: dict[str, dict[str, Any]] = {}

    # --- helpers --------------------------------------------------------------------------------
    def modes(self, op: str) -> list[str]:
        return [m for m in MODES[op] if not self.args.modes or m in self.args.modes.split(",")]

    def checkpoint_dir(self, name: str) -> str:
        import torch.distributed as dist

        path = self.root / name
        if self.rank == 0:
            shutil.rmtree(path, ignore_errors=True)
        dist.barrier()
        return str(path)

    def cleanup(self, path: str) -> None:
        import torch.distributed as dist

        from te_ckpt_placement import release_buffers

        dist.barrier()
        if self.rank == 0:
            shutil.rmtree(path, ignore_errors=True)
        release_buffers()
        gc.collect()
        if not SMOKE:
            torch.cuda.empty_cache()
        dist.barrier()

    def warm_up(self) -> None:
        """DCP's writer threads and file system set-up are not charged to the first mode."""
        import torch.distributed.checkpoint as dcp

        warm = self.checkpoint_dir("warmup")
        dcp.save({"x": torch.ones(4)}, checkpoint_id=warm)
        self.cleanup(warm)

    def take_reference(self) -> tuple[dict[str, Any], dict[str, Any]]:
        """The policy's export, checked against TE's own conversion, the weights, and the
        fingerprint of the live state: what a checkpoint taken now must hold."""
        from torch.distributed.checkpoint.state_dict import (
            get_model_state_dict,
            get_optimizer_state_dict,
        )

        from te_ckpt_placement import export_placement

        model, opt = self.model, self.opt
        with export_placement("cpu"):
            reference_export = get_optimizer_state_dict(model, opt, options=self.placed)
        verify_against_te(reference_export, model, opt)
        reference = {f"optim.{k}": host_bits(v).clone() if isinstance(v, torch.Tensor) else v
                     for k, v in reference_export.items()}  # fmt: skip
        reference.update(
            {f"model.{k}": host_bits(v).clone() for k, v in get_model_state_dict(model).items()}
        )
        return reference, fingerprint(model, opt)

    def read_back(self, path: str, where: str) -> None:
        """The checkpoint at ``path`` holds the reference bits (read into a host template)."""
        import torch.distributed.checkpoint as dcp
        from torch.distributed.checkpoint.state_dict import (
            get_model_state_dict,
            get_optimizer_state_dict,
        )

        from te_ckpt_placement import export_placement

        with export_placement("cpu"):
            template = get_optimizer_state_dict(self.model, self.opt, options=self.placed)
        # Host copies of the sharded weights (CPU-local DTensors on the CUDA mesh) as targets.
        model_template = {k: v.to("cpu") for k, v in get_model_state_dict(self.model).items()}
        state = {"model": model_template, "optim": template}
        blank(state)
        dcp.load(state, checkpoint_id=path)
        flat = {f"optim.{k}": v for k, v in state["optim"].items()}
        flat.update({f"model.{k}": v for k, v in state["model"].items()})
        assert_same_bits(flat, self.reference, where)
        del state, flat, template, model_template

    def read_back_te(self, path: str, where: str) -> None:
        """The checkpoint loads into templates shaped like TE's own export (on the GPU), as a
        user without te_ckpt_placement loads it, and holds the reference bits."""
        import torch.distributed.checkpoint as dcp
        from torch.distributed.checkpoint.state_dict import (
            get_model_state_dict,
            get_optimizer_state_dict,
        )

        # No policy: TE's own export.
        te_export = get_optimizer_state_dict(self.model, self.opt, options=self.placed)
        # Empty look-alikes: TE's FP32 and int16 exports alias the live states.
        template = {k: torch.empty_like(v) if isinstance(v, torch.Tensor) else v
                    for k, v in te_export.items()}  # fmt: skip
        del te_export
        model_template = {
            k: torch.empty_like(v) for k, v in get_model_state_dict(self.model).items()
        }
        state = {"model": model_template, "optim": template}
        blank(state)
        dcp.load(state, checkpoint_id=path)
        flat = {f"optim.{k}": v for k, v in state["optim"].items()}
        flat.update({f"model.{k}": v for k, v in state["model"].items()})
        assert_same_bits(flat, self.reference, f"{where} (TE template)")
        del state, flat, template, model_template
        gc.collect()
        if not SMOKE:
            torch.cuda.empty_cache()

    def keep(self, op: str, mode: str, result: dict[str, Any], **extra: Any) -> None:
        """Records one measurement (and writes this rank's records so far, with --out)."""
        rec = {"op": op, "mode": mode, **self.base, **result, **extra}
        rec["gpu_bytes_per_n"] = rec["peak_extra_gpu_bytes"] / self.n_local
        rec["host_bytes_per_n"] = rec["peak_extra_host_bytes"] / self.n_local
        self.records.append(rec)
        out = self.args.out
        if out is not None:  # per rank, after each measurement: a cut-off run keeps them
            Path(f"{out}.rank{self.rank}").write_text(json.dumps(self.records, indent=1) + "\n")
        if self.rank == 0:
            print(
                f"{op:<15} {mode:<33} GPU {rec['peak_extra_gpu_bytes'] / 2**30:7.2f} GiB "
                f"({rec['gpu_bytes_per_n']:5.2f} B/N)  "
                f"host {rec['peak_extra_host_bytes'] / 2**30:7.2f} GiB  "
                f"{rec['seconds']:7.2f} s  (total {rec['seconds_total']:.2f} s)",
                flush=True,
            )

    # --- dcp_save -------------------------------------------------------------------------------
    def dcp_save(self) -> None:
        import torch.distributed.checkpoint as dcp
        from torch.distributed.checkpoint.state_dict import (
            get_model_state_dict,
            get_optimizer_state_dict,
        )

        from te_ckpt_placement import export_placement

        model, opt = self.model, self.opt
        for mode in self.modes("dcp_save"):
            path = self.checkpoint_dir(f"save_{mode}")
            result: dict[str, Any] = {}
            if mode == "placement_cpu_streaming":
                self.streaming_save(mode, path, result)
                continue
            with _measured(result):
                policy = (
                    export_placement("cpu") if mode == "placement_cpu" else contextlib.nullcontext()
                )
                with policy:
                    optim = get_optimizer_state_dict(
                        model, opt, options=self.placed if mode == "placement_cpu" else self.today
                    )
                dcp.save({"model": get_model_state_dict(model), "optim": optim}, checkpoint_id=path)
                del optim
            self.read_back(path, f"dcp_save {mode}")  # before the numbers are kept
            self.keep("dcp_save", mode, result, cpu_offload=mode == "te_default", writer_threads=1)
            self.cleanup(path)

    def streaming_save(self, mode: str, path: str, result: dict[str, Any]) -> None:
        """``dcp_save`` ``placement_cpu_streaming``: lazy states through a StreamingWriter."""
        import torch.distributed.checkpoint as dcp
        from torch.distributed.checkpoint.state_dict import get_model_state_dict

        from te_ckpt_placement.dcp import PlacedOptimizerState, StreamingWriter

        model, opt, threads = self.model, self.opt, self.threads
        # The state dict holds lazy states; each is produced when the writer asks.
        with _measured(result):
            dcp.save(
                {
                    "model": get_model_state_dict(model),
                    "optim": PlacedOptimizerState(model, opt, save="streaming"),
                },
                storage_writer=StreamingWriter(path, thread_count=threads),
            )
        self.read_back(path, f"dcp_save {mode}")
        self.read_back_te(path, f"dcp_save {mode}")
        bound = GIB + (threads + 1) * 4 * self.m_local
        if self.rank == 0:
            print(f"  streaming save: host bound {bound / 2**30:.2f} GiB", flush=True)
        self.keep("dcp_save", mode, result, cpu_offload=False, writer_threads=threads,
                  host_bound_bytes=bound,
                  within_host_bound=result["peak_extra_host_bytes"] <= bound)  # fmt: skip
        self.cleanup(path)

    # --- dcp_async_save -------------------------------------------------------------------------
    def dcp_async_save(self) -> None:
        import torch.distributed.checkpoint as dcp
        from torch.distributed.checkpoint.state_dict import (
            get_model_state_dict,
            get_optimizer_state_dict,
        )

        from te_ckpt_placement import export_placement

        model, opt = self.model, self.opt
        for mode in self.modes("dcp_async_save"):
            if mode == "placement_cpu_snapshot":
                self.reference, self.before = self.snapshot_saves()
                continue
            path = self.checkpoint_dir(f"async_{mode}")
            stager = counting_pass_through() if mode.endswith("passthrough_stager") else None
            result: dict[str, Any] = {}
            with _measured(result):
                policy = (
                    export_placement("cpu") if mode != "te_default" else contextlib.nullcontext()
                )
                with policy:
                    optim = get_optimizer_state_dict(
                        model, opt, options=self.today if mode == "te_default" else self.placed
                    )
                response = dcp.async_save(
                    {"model": get_model_state_dict(model), "optim": optim},
                    checkpoint_id=path,
                    process_group=self.async_pg,
                    async_stager=stager,
                )
                del optim
                if hasattr(response, "staging_completion"):
                    response.staging_completion.result()
                result["seconds"] = time.perf_counter() - result["_start"]
                wait(response)
            extra: dict[str, Any] = {"cpu_offload": mode == "te_default"}
            if stager is not None:
                stager.close()
                assert stager.exported > 0 and stager.passed == stager.exported, (
                    f"PassThroughStager copied {stager.exported - stager.passed} exports"
                )
                extra["exports_passed_through"] = stager.passed
            self.read_back(path, f"dcp_async_save {mode}")
            self.keep("dcp_async_save", mode, result, **extra)
            self.cleanup(path)

    def snapshot_saves(self) -> tuple[dict[str, Any], dict[str, Any]]:
        """``--snapshot-saves`` raw-snapshot async saves in a row, a training step during each
        write; returns the reference and fingerprint of the state after the last step."""
        import torch.distributed.checkpoint as dcp
        from torch.distributed.checkpoint.state_dict import get_model_state_dict

        from benchmarks._measure import rss
        from te_ckpt_placement.dcp import PlacedOptimizerState, SnapshotStager, StreamingWriter

        model, opt, threads = self.model, self.opt, self.args.writer_threads
        mode = "placement_cpu_snapshot"
        bandwidth = d2h_bytes_per_s()
        stager = SnapshotStager()
        first_start = 0
        for index in range(self.args.snapshot_saves):
            self.reference, _ = self.take_reference()  # what this checkpoint must hold
            raw = optimizer_raw_bytes(opt) + model_raw_bytes(model)
            path = self.checkpoint_dir(f"async_{mode}_{index}")
            result: dict[str, Any] = {}
            gc.collect()
            start = rss()  # from the second save on, the kept buffers are part of it
            first_start = first_start or start
            with _measured(result):
                response = dcp.async_save(
                    {
                        "model": get_model_state_dict(model),
                        "optim": PlacedOptimizerState(model, opt, save="streaming"),
                    },
                    storage_writer=StreamingWriter(path, thread_count=threads, stager=stager),
                    process_group=self.async_pg,
                )
                if hasattr(response, "staging_completion"):
                    response.staging_completion.result()
                result["seconds"] = time.perf_counter() - result["_start"]
                step_start = time.perf_counter()
                train_step(model, opt, self.hidden)  # training goes on while the write runs
                step_seconds = time.perf_counter() - step_start
                wait(response)
            report = stager.last_report
            assert report is not None
            stats = report.details
            assert stats["raw_bytes"] + stats["other_bytes"] == raw, (report, raw)
            self.read_back(path, f"dcp_async_save {mode} {index}")  # the state at the save point
            self.read_back_te(path, f"dcp_async_save {mode} {index}")
            host_extra = start - first_start + result["peak_extra_host_bytes"]
            bound = raw + GIB + (threads + 1) * 4 * self.m_local
            self.keep("dcp_async_save", mode, result, cpu_offload=False, writer_threads=threads,
                      save_index=index, first_save=index == 0, blocked_seconds=result["seconds"],
                      raw_bytes=raw, optimizer_raw_bytes=optimizer_raw_bytes(opt),
                      model_raw_bytes=model_raw_bytes(model), d2h_bytes_per_s=bandwidth,
                      bound_seconds=raw / bandwidth,
                      blocked_over_bound=result["seconds"] / (raw / bandwidth),
                      staging_seconds=stats.seconds, allocated_buffer_bytes=stats.allocated_bytes,
                      kept_buffer_bytes=stager.buffer_bytes,
                      train_step_seconds=step_seconds, host_extra_bytes=host_extra,
                      host_bound_bytes=bound, within_host_bound=host_extra <= bound)  # fmt: skip
            if self.rank == 0:
                print(
                    f"  snapshot save {index}: blocked {result['seconds']:.3f} s, bound "
                    f"{raw / bandwidth:.3f} s ({raw / 2**30:.2f} GiB at "
                    f"{bandwidth / 1e9:.1f} GB/s): x{result['seconds'] / (raw / bandwidth):.2f}; "
                    f"host extra {host_extra / 2**30:.2f} GiB (bound {bound / 2**30:.2f} GiB)",
                    flush=True,
                )
            self.cleanup(path)
        stager.close()
        # The state trained on: later ops compare against it.
        return self.take_reference()

    # --- dcp_load -------------------------------------------------------------------------------
    def timed_load(self, mode: str, path: str) -> tuple[dict[str, Any], dict[str, Any]]:
        """One measured ``dcp.load`` of the model and optimizer at ``path`` in ``mode``."""
        import torch.distributed.checkpoint as dcp
        from torch.distributed.checkpoint.state_dict import (
            get_model_state_dict,
            get_optimizer_state_dict,
            set_model_state_dict,
            set_optimizer_state_dict,
        )

        from te_ckpt_placement import export_placement

        model, opt, placed = self.model, self.opt, self.placed
        train_step(model, opt, self.hidden)  # the load has to undo this step
        assert fingerprint(model, opt).keys() == self.before.keys()
        result: dict[str, Any] = {}
        extra: dict[str, Any] = {}
        with _measured(result):
            if mode == "placement_cpu_streaming":
                extra = streaming_load(model, opt, path)
            else:
                policy = (
                    export_placement("cpu") if mode == "placement_cpu" else contextlib.nullcontext()
                )
                with policy:
                    t0 = time.perf_counter()
                    state = {
                        "model": get_model_state_dict(model),
                        "optim": get_optimizer_state_dict(model, opt, options=placed),
                    }
                    t1 = time.perf_counter()
                    dcp.load(state, checkpoint_id=path)
                    t2 = time.perf_counter()
                    set_model_state_dict(model, state["model"])
                    set_optimizer_state_dict(model, opt, state["optim"], options=placed)
                    t3 = time.perf_counter()
                del state
                extra = {
                    "split_s": {"template": t1 - t0, "dcp_load": t2 - t1, "set": t3 - t2},
                    "torch_threads": torch.get_num_threads(),
                }
        return result, extra

    def dcp_load(self) -> None:
        import torch.distributed.checkpoint as dcp
        from torch.distributed.checkpoint.state_dict import (
            get_model_state_dict,
            get_optimizer_state_dict,
        )

        from te_ckpt_placement import export_placement

        args, model, opt, loaded = self.args, self.model, self.opt, self.loaded
        path = self.checkpoint_dir("load_source")
        with export_placement("cpu"):
            optim = get_optimizer_state_dict(model, opt, options=self.placed)
        dcp.save({"model": get_model_state_dict(model), "optim": optim}, checkpoint_id=path)
        del optim
        self.read_back(path, "dcp_load source")
        load_modes = self.modes("dcp_load")
        if args.moments not in ("bf16", "fp32") and "te_default" not in load_modes:
            load_modes.insert(0, "te_default")  # the reference of FP16/FP8 loads
        for round_ in range(args.load_rounds):
            # te_default first in round 0: the reference of FP16/FP8 loads. Later rounds
            # alternate the order, so neither mode always reads the checkpoint first.
            order = load_modes if round_ % 2 == 0 else load_modes[::-1]
            for mode in order:
                result, extra = self.timed_load(mode, path)
                loaded[mode] = fingerprint(model, opt)
                # BF16/FP32 states load back exactly as saved. FP16/FP8 ones are rescaled by
                # TE's own load, so for them the policy's load must equal TE's load instead.
                expected = self.before if args.moments in ("bf16", "fp32") else loaded["te_default"]
                for key, value in expected.items():
                    got = loaded[mode][key]
                    same = (
                        torch.equal(got, value) if isinstance(value, torch.Tensor) else got == value
                    )
                    assert same, f"dcp_load {mode}: {key} differs from the expected state"
                self.keep("dcp_load", mode, result, round=round_, **extra)
        self.cleanup(path)

    # --- full_state_dict ------------------------------------------------------------------------
    def full_state_dict(self) -> None:
        from torch.distributed.checkpoint.state_dict import (
            StateDictOptions,
            get_optimizer_state_dict,
        )

        from te_ckpt_placement import export_placement

        # DCP all-gathers each state onto rank 0's host. Under the policy each CPU-local shard
        # goes back to the GPU for its all-gather, one state at a time.
        full = StateDictOptions(
            full_state_dict=True, cpu_offload=True, flatten_optimizer_state_dict=True
        )
        # NCCL cannot all-gather int16, so DCP's full gather of int16 master remainders fails
        # with or without the policy ("Input tensor data type is not supported for NCCL process
        # group: Short", seen on 2xH200 with TE's own export first). FP32 masters here.
        del self.model, self.opt
        gc.collect()
        if not SMOKE:
            torch.cuda.empty_cache()
        model, opt = build(self.layers, self.hidden, self.moments, seed=0, remainders=False)
        self.model, self.opt = model, opt
        self.base = {**self.base, "masters": "fp32"}
        largest = max(p.numel() for p in model.parameters()) * 4  # one global FP32 state
        te_full: dict[str, Any] = {}
        for mode in MODES["full_state_dict"]:
            result: dict[str, Any] = {}
            with _measured(result):
                policy = (
                    export_placement("cpu") if mode == "placement_cpu" else contextlib.nullcontext()
                )
                with policy:
                    gathered = get_optimizer_state_dict(model, opt, options=full)
            if self.rank != 0:
                assert gathered == {}, f"full_state_dict {mode}: rank {self.rank} kept a state dict"
            elif mode == "te_default":
                te_full = gathered
            else:  # rank 0: the policy's gathered dict is TE's, bit for bit
                assert gathered.keys() == te_full.keys(), "full_state_dict: keys differ"
                for key, value in te_full.items():
                    if isinstance(value, torch.Tensor):
                        assert local(gathered[key]).device.type == "cpu", key
                        assert torch.equal(host_bits(gathered[key]), host_bits(value)), key
                    else:
                        assert gathered[key] == value, key
            del gathered
            self.keep(
                "full_state_dict", mode, result, cpu_offload=True, largest_state_bytes=largest
            )
            gc.collect()
        del te_full


def run_rank(args: argparse.Namespace) -> list[dict[str, Any]]:
    """Builds this rank's model and optimizer and runs the selected ops, in OPS' order."""
    bench = RankBench(args)
    bench.warm_up()
    ops = [op for op in args.ops.split(",") if op]
    if "dcp_save" in ops:
        bench.dcp_save()
    if "dcp_async_save" in ops:
        bench.dcp_async_save()
    if "dcp_load" in ops:
        bench.dcp_load()
    if "full_state_dict" in ops:
        bench.full_state_dict()
    return bench.records


def smoke_machine() -> dict[str, Any]:
    import platform

    return {
        "gpu": None,
        "torch": torch.__version__,
        "transformer_engine": "none: the CPU stand-in (tests/support/standin.py)",
        "python": platform.python_version(),
        "host_cpus": os.cpu_count(),
        "cpu_smoke": True,
    }


def _worker() -> None:
    import torch.distributed as dist

    global SMOKE
    args = parse(sys.argv[1:])
    SMOKE = args.cpu_smoke
    if SMOKE:
        dist.init_process_group("gloo", timeout=datetime.timedelta(minutes=30))
    else:
        local_rank = int(os.environ.get("LOCAL_RANK", os.environ["RANK"]))
        torch.cuda.set_device(local_rank)
        # async_save needs a CPU backend next to NCCL.
        dist.init_process_group("cpu:gloo,cuda:nccl", timeout=datetime.timedelta(minutes=30))
    try:
        assert dist.get_world_size() == WORLD, f"run with {WORLD} ranks"
        records = run_rank(args)
        gathered: list[Any] = [None] * WORLD
        dist.gather_object(records, gathered if dist.get_rank() == 0 else None, dst=0)
        if dist.get_rank() == 0:
            from benchmarks._measure import machine

            info = smoke_machine() if SMOKE else machine()
            out = {"machine": info, "records": [r for rank in gathered for r in rank]}
            if args.out is not None:
                args.out.parent.mkdir(parents=True, exist_ok=True)
                args.out.write_text(json.dumps(out, indent=1) + "\n")
                print(f"wrote {args.out}", flush=True)
    finally:
        dist.destroy_process_group()


def _spawned(rank: int, port: int, argv: list[str]) -> None:
    os.environ.update(
        RANK=str(rank),
        LOCAL_RANK=str(rank),
        WORLD_SIZE=str(WORLD),
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(port),
    )
    sys.argv = [sys.argv[0], *argv]
    _ensure_root_on_path()
    _worker()


def parse(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--out", type=Path, default=None, help="JSON path (default: none)")
    parser.add_argument("--size", choices=tuple(SIZES), default="default")
    parser.add_argument("--moments", choices=tuple(MOMENTS), default="bf16")
    parser.add_argument(
        "--ops", default=",".join(OPS), help="comma-separated subset of " + ", ".join(OPS)
    )
    parser.add_argument(
        "--dir",
        default=os.path.join(tempfile.gettempdir(), "dcp_e2e"),
        help="where checkpoints are written (each is deleted after it is checked)",
    )
    all_modes = sorted({m for ms in MODES.values() for m in ms})
    parser.add_argument(
        "--modes", default="", help="comma-separated subset of " + ", ".join(all_modes)
    )
    parser.add_argument(
        "--writer-threads",
        type=int,
        default=1,
        help="StreamingWriter threads of the streaming and snapshot modes (default 1, as "
        "torch's FileSystemWriter of the other modes)",
    )
    parser.add_argument(
        "--snapshot-saves",
        type=int,
        default=3,
        help="raw-snapshot async saves in a row (the first allocates the buffers; default 3)",
    )
    parser.add_argument(
        "--load-rounds",
        type=int,
        default=1,
        help="rounds of dcp_load's modes (default 1); odd rounds run the modes in reverse order",
    )
    parser.add_argument(
        "--cpu-smoke",
        action="store_true",
        help="run every op on 2 gloo CPU ranks with the CPU stand-in of TE (checks only; the "
        "numbers mean nothing); implies --size smoke unless --size is given",
    )
    args = parser.parse_args(argv)
    for op in args.ops.split(","):
        if op and op not in OPS:
            parser.error(f"unknown op {op!r}; valid: {', '.join(OPS)}")
    for mode in args.modes.split(","):
        if mode and mode not in all_modes:
            parser.error(f"unknown mode {mode!r}; valid: {', '.join(all_modes)}")
    if args.writer_threads < 1:
        parser.error(f"--writer-threads {args.writer_threads}: valid values are >= 1")
    if args.snapshot_saves < 1:
        parser.error(f"--snapshot-saves {args.snapshot_saves}: valid values are >= 1")
    if args.load_rounds < 1:
        parser.error(f"--load-rounds {args.load_rounds}: valid values are >= 1")
    if args.cpu_smoke and "--size" not in argv:
        args.size = "smoke"
    return args


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    args = parse(argv)  # --help and bad options answer before anything else
    missing = None if args.cpu_smoke else requirements_missing()
    if missing:
        print(
            "This benchmark measures DCP save, async_save and load of real Transformer Engine\n"
            f"FusedAdam state under FSDP2 on {WORLD} NVIDIA GPUs. It cannot run here: {missing}.\n"
            f"It needs: {WORLD} CUDA GPUs, torch with CUDA and NCCL, and Transformer Engine "
            "(pip install 'transformer-engine[pytorch]').\n"
            "Its logic runs anywhere with --cpu-smoke; the CPU test suite too: "
            "python -m pytest -q tests/test_dcp.py tests/test_dcp_save.py",
            file=sys.stderr,
        )
        return 2
    _ensure_root_on_path()
    if "RANK" in os.environ and "WORLD_SIZE" in os.environ:  # under torchrun
        _worker()
        return 0
    import torch.multiprocessing as mp

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = int(s.getsockname()[1])
    mp.spawn(_spawned, args=(port, argv), nprocs=WORLD, join=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
