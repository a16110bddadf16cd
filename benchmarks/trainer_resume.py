"""Trainer resume with TE FusedAdam: GPU memory beyond the optimizer's live states, with and without
the integrations.

For each trainer and parallelism it trains a small Llama (``LlamaForCausalLM`` built from a
``LlamaConfig`` in code, BF16 params) with TE ``FusedAdam`` (BF16 moments, FP32 masters) for two
steps, saves through the integration, then resumes from that checkpoint twice:

- ``te_default``: the framework as it is (``Trainer``, a Lightning ``Trainer`` without the
  callback, ``fabric.load`` on an unplaced strategy);
- ``placement_cpu``: with the integration (``PlacementTrainer``, ``PlacementCallback``,
  ``place_strategy(fabric.strategy)``).

Configurations: world size 1 (``transformers/single``, ``lightning/single``, ``fabric/single``,
one process on the first GPU) and world size 2 (``transformers/ddp``,
``transformers/fsdp2_sharded``, ``transformers/fsdp2_full`` (accelerate FSDP2 with that
``state_dict_type``), ``lightning/ddp``, ``fabric/ddp``, two processes sharing one NCCL group).

Measured per rank, ``op="trainer_resume"``: the resume's optimizer load, that is
``Trainer._load_optimizer_and_scheduler`` (Transformers), the strategy's ``load_checkpoint`` and
the connector's ``restore_training_state`` (Lightning: the checkpoint read, and the restore of
optimizers and loops, with whatever the read left on the GPU counted during the restore), and the
strategy's ``load_checkpoint`` (Fabric, inside ``fabric.load``, before its closing barrier).

- ``peak_extra_gpu_bytes``: the GPU memory beyond what the optimizer's own live states take after
  the load: (peak during the load) - (allocated before) - ``live_state_bytes``;
- ``live_state_bytes``: what the load left allocated (the optimizer states it created);
- ``peak_extra_gpu_bytes_other_devices``: the peak of this process's allocations on the other
  GPUs (a checkpoint read that keeps saved devices puts rank 1's copy on GPU 0);
- ``peak_extra_host_bytes``: peak process RSS above the start (sampled every millisecond; file
  pages of a memory-mapped checkpoint count);
- ``seconds``: wall time of the measured part;
- ``torch_threads``: torch's intra-op thread count as the window began;
- ``breakdown`` (Transformers): seconds inside each ``torch.load`` (by file), the optimizer's
  ``load_state_dict``, ``get_``/``set_optimizer_state_dict`` and ``dcp.load``, with torch's
  thread count at each call (the placed resume caps it at the rank's share of the CPUs);
- ``states_equal_plain`` (``placement_cpu`` only): every resumed optimizer state, scale and
  hyperparameter (its ``repr``: types count) equals the ``te_default`` resume's, bit for bit.

On the GPU a window first waits until the allocated bytes stop changing (``settle_seconds``: a
NCCL barrier's block is freed by the watchdog thread after the barrier returned), then records
the CUDA allocator's history (Python stacks of allocations and frees, in both modes); a
``placement_cpu`` record whose window allocated beyond what it kept carries
``peak_allocations`` (Lightning's checkpoint read: ``read_peak_allocations``): the allocations
alive at the peak, temporaries and retained, largest first, with their stacks, and the blocks
allocated before the window that it freed (``freed_from_before``). The save that makes the
checkpoint is measured the same way (``op="trainer_save"``, ``placement_cpu`` only). The summary
gives each configuration's placed/plain time ratio; ``placed_slower_than_plain`` lists those above
1 on GPUs (reported, not failures).

Usage (from the repository root):
    python benchmarks/trainer_resume.py --out FILE.json                  # GPUs, TE required
    python benchmarks/trainer_resume.py --device cpu --size tiny --out F  # the CPU stand-in

``--device cpu`` runs the same frameworks on the CPU (gloo) with the CPU stand-in of TE from
tests/support/standin.py, and records no GPU numbers: it checks the harness and the bit equality
(accelerate's FSDP2 included: the script lets accelerate use its FSDP plugin on CPU processes,
which it otherwise ignores there). On CUDA, world size 2 needs 2 GPUs (``--world-sizes 1`` runs
the single-device ones only). Exits 2 when the device's requirements are missing, 1 when a worker
failed or a check did not hold.
"""

from __future__ import annotations

import argparse
import datetime
import gc
import json
import os
import platform
import shutil
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

ROOT = Path(__file__).resolve().parents[1]
CONFIGS = {
    1: ("transformers/single", "lightning/single", "fabric/single"),
    2: (
        "transformers/ddp",
        "transformers/fsdp2_sharded",
        "transformers/fsdp2_full",
        "lightning/ddp",
        "fabric/ddp",
    ),
}
# Llama shapes: "default" has 168M params (336 MB in BF16; 1.35 GB of TE states; a 2 GB FP32
# optimizer checkpoint); "tiny" is for the CPU check.
SIZES = {
    "default": {"hidden": 1024, "intermediate": 2816, "layers": 8, "heads": 16, "vocab": 32000},
    "tiny": {"hidden": 64, "intermediate": 128, "layers": 2, "heads": 4, "vocab": 256},
}
SEQ = {"default": 128, "tiny": 16}
MODES = ("te_default", "placement_cpu")
STEPS = 2  # trained before the save; the resume then runs one more


def _ensure_root_on_path() -> None:
    if str(ROOT) not in sys.path:
        sys.path.insert(0, str(ROOT))


# --- measurement ---------------------------------------------------------------------------------


def _current() -> int:
    return torch.cuda.current_device()


def _settle_allocations(quiet: float = 0.3, limit: float = 2.0) -> float:
    """Waits until this device's allocated bytes stop changing for ``quiet`` seconds (at most
    ``limit``); returns the seconds waited.

    A NCCL collective's tensors are freed by the process group's watchdog thread some time after
    the collective completed: a barrier just before a window (accelerate's
    ``wait_for_everyone()`` ends ``load_fsdp_model``, right before the optimizer's resume)
    would free its 512-byte block inside the window, and the window would count it as a peak
    above what it leaves allocated.
    """
    start = last_change = time.perf_counter()
    last = torch.cuda.memory_allocated()
    while True:
        now = time.perf_counter()
        if now - last_change >= quiet or now - start >= limit:
            return now - start
        time.sleep(0.02)
        current = torch.cuda.memory_allocated()
        if current != last:
            last, last_change = current, time.perf_counter()


def _window_start_marker() -> None:
    # An allocation whose stack names this function marks the start of a window in the trace.
    marker = torch.empty(1, device="cuda")
    del marker


class Window:
    """GPU (allocator), host (RSS) and time of one block; see the module docstring.

    With ``diagnose``, a window that allocated more than it should (beyond what it left
    allocated, or anything at all when ``expect_live`` is False) records what was alive at its
    allocation peak, with stacks, in ``result["peak_allocations"]``.
    """

    def __init__(self, cuda: bool, *, diagnose: bool = False, expect_live: bool = True) -> None:
        self.cuda = cuda
        self.diagnose = diagnose
        self.expect_live = expect_live
        self.result: dict[str, Any] = {}

    def __enter__(self) -> Window:
        gc.collect()
        if self.cuda:
            torch.cuda.synchronize()
            self.result["settle_seconds"] = _settle_allocations()
            torch.cuda.memory._record_memory_history(None)
            # context="all": frees carry their stacks too (a block allocated before the window
            # and freed in it lowers what the window leaves allocated; see peak_allocations).
            torch.cuda.memory._record_memory_history(
                "all", context="all", stacks="python", max_entries=500_000
            )
            _window_start_marker()
            self.base = torch.cuda.memory_allocated()
            torch.cuda.reset_peak_memory_stats()
            # A checkpoint read keeps the device a tensor was saved from: rank 1 may allocate
            # on GPU 0. Those bytes count too (peak_extra_gpu_bytes_other_devices).
            self.others = [d for d in range(torch.cuda.device_count()) if d != _current()]
            self.other_base = {d: torch.cuda.memory_allocated(d) for d in self.others}
            for d in self.others:
                torch.cuda.reset_peak_memory_stats(d)
        self.result["torch_threads"] = torch.get_num_threads()
        from benchmarks._measure import HostPeak, rss  # the package root is on the path

        self.host_base = rss()
        self._host = HostPeak().__enter__()
        self.start = time.perf_counter()
        return self

    def __exit__(self, *exc: object) -> None:
        if self.cuda:
            torch.cuda.synchronize()
        self.result["seconds"] = time.perf_counter() - self.start
        self._host.__exit__()
        self.result["peak_extra_host_bytes"] = self._host.peak - self.host_base
        if not self.cuda:
            self.result["live_state_bytes"] = None
            self.result["peak_extra_gpu_bytes"] = None
            self.result["peak_extra_gpu_bytes_other_devices"] = None
            return
        self.peak = torch.cuda.max_memory_allocated()
        self.after = torch.cuda.memory_allocated()
        self.result["live_state_bytes"] = self.after - self.base
        self.result["peak_extra_gpu_bytes"] = self.peak - self.after
        self.result["peak_extra_gpu_bytes_other_devices"] = sum(
            torch.cuda.max_memory_allocated(d) - self.other_base[d] for d in self.others
        )
        unexpected = self.peak - (self.after if self.expect_live else self.base)
        if self.diagnose and unexpected > 0:
            self.result["peak_allocations"] = peak_allocations(
                torch.cuda.memory._snapshot(), torch.cuda.current_device()
            )
        torch.cuda.memory._record_memory_history(None)


def _short_stack(frames: list[dict[str, Any]], depth: int = 8) -> list[str]:
    out = []
    for frame in frames:
        name = frame.get("filename", "")
        if "torch/cuda/memory" in name or not name:
            continue
        parts = Path(name).parts[-3:]
        out.append(f"{'/'.join(parts)}:{frame.get('line')} {frame.get('name')}")
        if len(out) == depth:
            break
    return out


def peak_allocations(snapshot: Any, device: int, limit: int = 12) -> dict[str, Any]:
    """What was alive at the window's allocation peak: the temporaries (freed by the end) and
    the retained allocations, largest first, with their stacks; and the blocks allocated before
    the window that it freed (with the stacks of their frees)."""
    trace = snapshot["device_traces"][device]
    start = marker = None
    for i, event in enumerate(trace):
        names = {f.get("name") for f in event.get("frames", [])}
        if event.get("action") == "alloc" and "_window_start_marker" in names:
            start, marker = i + 1, event["addr"]
    live: dict[int, tuple[int, dict[str, Any]]] = {}
    total = best = 0
    at_peak: dict[int, dict[str, Any]] = {}
    # Blocks allocated before the window and freed in it: the allocator's peak counts them, what
    # the window leaves allocated does not, so they show as peak_extra_gpu_bytes without any
    # allocation of the window being alive.
    freed_from_before: list[dict[str, Any]] = []
    for i, event in enumerate(trace[start or 0 :], start or 0):
        action = event.get("action")
        if action == "alloc":
            live[event["addr"]] = (i, event)
            total += event["size"]
            if total > best:
                best = total
                at_peak = {j: e for j, e in live.values()}
        elif action == "free_requested":
            if event["addr"] in live:
                total -= live.pop(event["addr"])[1]["size"]
            elif event["addr"] == marker:
                marker = None  # the marker's own free
            else:
                freed_from_before.append(event)
    remaining = {j for j, _ in live.values()}

    def listed(events: list[dict[str, Any]]) -> list[dict[str, Any]]:
        events = sorted(events, key=lambda e: -e["size"])[:limit]
        return [{"bytes": e["size"], "stack": _short_stack(e.get("frames", []))} for e in events]

    temporaries = [e for j, e in at_peak.items() if j not in remaining]
    retained = [e for j, e in at_peak.items() if j in remaining]
    return {
        "temporary_bytes": sum(e["size"] for e in temporaries),
        "retained_bytes": sum(e["size"] for e in retained),
        "temporaries": listed(temporaries),
        "retained": listed(retained)[: limit // 2],
        "freed_from_before_bytes": sum(e["size"] for e in freed_from_before),
        "freed_from_before": listed(freed_from_before),
        # False: the trace lost the window's start (max_entries), and all of it was read.
        "window_start_found": start is not None,
        "trace_entries": len(trace),
    }


class Timed:
    """Seconds spent in some functions during a ``with`` block, by name (nested calls counted
    in each), and torch's intra-op thread count at each call; the functions are patched
    attributes of modules or instances, restored on exit."""

    def __init__(self) -> None:
        self.seconds: dict[str, float] = {}
        self.threads: dict[str, int] = {}
        self._undo: list[tuple[Any, str, Any, bool]] = []

    def wrap(self, owner: Any, attr: str, name: Callable[..., str] | str) -> None:
        original = getattr(owner, attr)
        own = attr in getattr(owner, "__dict__", {})

        def timed(*args: Any, **kwargs: Any) -> Any:
            key = name(*args, **kwargs) if callable(name) else name
            self.threads[key] = torch.get_num_threads()
            start = time.perf_counter()
            try:
                return original(*args, **kwargs)
            finally:
                self.seconds[key] = self.seconds.get(key, 0.0) + time.perf_counter() - start

        setattr(owner, attr, timed)
        self._undo.append((owner, attr, original, own))

    def __enter__(self) -> Timed:
        return self

    def __exit__(self, *exc: object) -> None:
        for owner, attr, original, own in reversed(self._undo):
            if own:
                setattr(owner, attr, original)
            else:
                delattr(owner, attr)
        self._undo.clear()

    def result(self) -> dict[str, Any]:
        return {
            "seconds": {k: round(v, 6) for k, v in sorted(self.seconds.items())},
            "torch_threads": dict(sorted(self.threads.items())),
        }


def _loaded_file(f: Any, *args: Any, **kwargs: Any) -> str:
    # DCP's reads load from file objects: counted together.
    return f"torch.load {Path(f).name}" if isinstance(f, (str, os.PathLike)) else "torch.load (io)"


def timed_optimizer_load(optimizer: Any) -> Timed:
    """A :class:`Timed` for a Transformers resume: every ``torch.load`` (by file name), the
    optimizer's ``load_state_dict``, and torch's and DCP's FSDP2 calls."""
    import torch.distributed.checkpoint as dcp
    import torch.distributed.checkpoint.state_dict as dsd

    timed = Timed()
    timed.wrap(torch, "load", _loaded_file)
    timed.wrap(optimizer, "load_state_dict", "optimizer.load_state_dict")
    timed.wrap(dsd, "get_optimizer_state_dict", "get_optimizer_state_dict")
    timed.wrap(dsd, "set_optimizer_state_dict", "set_optimizer_state_dict")
    timed.wrap(dcp, "load", "dcp.load")
    return timed


# --- models, optimizers, state fingerprints ------------------------------------------------------


class Env:
    """One worker process: device, ranks, sizes, the optimizer class and where files go."""

    def __init__(self, args: argparse.Namespace) -> None:
        self.device = args.device
        self.cuda = args.device == "cuda"
        self.world = int(os.environ.get("WORLD_SIZE", "1"))
        self.rank = int(os.environ.get("RANK", "0"))
        self.local_rank = int(os.environ.get("LOCAL_RANK", "0"))
        self.size = args.size
        self.dir = Path(args.dir)
        self.records: list[dict[str, Any]] = []
        self.failures: list[str] = []
        self.partial = Path(args.partial)
        if self.cuda:
            from transformer_engine.pytorch.optimizers import FusedAdam

            from te_ckpt_placement import install

            install()
            self.optimizer_cls: Any = FusedAdam
        else:
            from te_ckpt_placement import _te_hooks as te_hooks
            from tests.support.standin import StandInFusedAdam

            te_hooks.patch_class(StandInFusedAdam)

            class StandIn(StandInFusedAdam):
                """Runs the closure as TE's step does (Lightning passes one)."""

                def step(self, closure: Any = None) -> Any:
                    loss = closure() if closure is not None else None
                    super().step()
                    return loss

            self.optimizer_cls = StandIn
        self.optimizer_kwargs = {
            "lr": 1e-4,
            "master_weights": True,
            "master_weight_dtype": torch.float32,
            "exp_avg_dtype": torch.bfloat16,
            "exp_avg_sq_dtype": torch.bfloat16,
            "store_param_remainders": False,
        }

    @property
    def torch_device(self) -> torch.device:
        return (
            torch.device("cuda", torch.cuda.current_device()) if self.cuda else torch.device("cpu")
        )

    def barrier(self) -> None:
        import torch.distributed as dist

        if dist.is_initialized():
            dist.barrier()

    def free(self) -> None:
        gc.collect()
        if self.cuda:
            torch.cuda.synchronize()
            torch.cuda.empty_cache()

    def fresh_dir(self, name: str) -> Path:
        path = self.dir / name
        self.barrier()
        if self.rank == 0:
            shutil.rmtree(path, ignore_errors=True)
            path.mkdir(parents=True)
        self.barrier()
        return path

    def remove(self, path: Path) -> None:
        self.barrier()
        if self.rank == 0:
            shutil.rmtree(path, ignore_errors=True)
        self.barrier()

    def keep(self, record: dict[str, Any]) -> None:
        self.records.append(record)
        self.partial.write_text(json.dumps({"records": self.records, "failures": self.failures}))
        gpu = record["peak_extra_gpu_bytes"]
        gpu_text = "      -" if gpu is None else f"{gpu / 2**20:9.2f} MiB"
        print(
            f"[rank {self.rank}] {record['op']:<15} {record['framework']:<12} "
            f"{record['variant']:<14} {record['mode']:<14} GPU extra {gpu_text}  "
            f"host {record['peak_extra_host_bytes'] / 2**20:9.1f} MiB  "
            f"{record['seconds']:7.2f} s",
            flush=True,
        )

    def fail(self, message: str) -> None:
        self.failures.append(message)
        self.partial.write_text(json.dumps({"records": self.records, "failures": self.failures}))
        print(f"[rank {self.rank}] FAILED: {message}", flush=True)


def build_model(env: Env, seed: int) -> Any:
    from transformers import LlamaConfig, LlamaForCausalLM

    shape = SIZES[env.size]
    config = LlamaConfig(
        vocab_size=shape["vocab"],
        hidden_size=shape["hidden"],
        intermediate_size=shape["intermediate"],
        num_hidden_layers=shape["layers"],
        num_attention_heads=shape["heads"],
        num_key_value_heads=shape["heads"],
        max_position_embeddings=SEQ[env.size],
        tie_word_embeddings=False,
    )
    torch.manual_seed(seed)
    with torch.device(env.torch_device):
        model = LlamaForCausalLM(config)
    return model.to(torch.bfloat16)


def tokens(env: Env, n: int = 32) -> torch.Tensor:
    gen = torch.Generator().manual_seed(1234)
    return torch.randint(0, SIZES[env.size]["vocab"], (n, SEQ[env.size]), generator=gen)


def local_elements(params: Any) -> int:
    from torch.distributed.tensor import DTensor

    return sum((p._local_tensor if isinstance(p, DTensor) else p).numel() for p in params)


def _unwrap(optimizer: Any) -> Any:
    while isinstance(getattr(optimizer, "optimizer", None), torch.optim.Optimizer):
        optimizer = optimizer.optimizer
    return optimizer


def _host_bits(t: Any) -> torch.Tensor:
    from torch.distributed.tensor import DTensor

    if isinstance(t, DTensor):
        t = t._local_tensor
    t = getattr(t, "_data", t)  # FP8 storage
    return t.detach().contiguous().cpu().reshape(-1).view(torch.uint8).clone()


def fingerprint(optimizer: Any) -> dict[str, Any]:
    """Host bytes of every stored state and scale, and every hyperparameter, by position."""
    opt = _unwrap(optimizer)
    params = [p for group in opt.param_groups for p in group["params"]]
    out: dict[str, Any] = {}
    for i, p in enumerate(params):
        for name, value in sorted(opt.state.get(p, {}).items()):
            out[f"state.{i}.{name}"] = _host_bits(value) if hasattr(value, "shape") else value
        for name, scale in sorted(getattr(opt, "_scales", {}).get(p, {}).items()):
            out[f"scale.{i}.{name}"] = _host_bits(scale)
    for g, group in enumerate(opt.param_groups):
        for key, value in group.items():
            if key != "params":
                # repr: the type counts too (a tuple is not a list, 1 is not 1.0).
                out[f"group.{g}.{key}"] = (
                    f"tensor({value.tolist()!r}, {value.dtype})"
                    if torch.is_tensor(value)
                    else repr(value)
                )
    return out


def differing(ours: dict[str, Any], ref: dict[str, Any]) -> list[str]:
    """The keys that differ; a hyperparameter's key comes with both values (ours, then ref's)."""
    if ours.keys() != ref.keys():
        return sorted(set(ours) ^ set(ref))
    bad = []
    for key, value in ref.items():
        other = ours[key]
        if torch.is_tensor(value):
            if not torch.equal(other, value):
                bad.append(key)
        elif other != value:
            bad.append(f"{key}: {other} != {value}")
    return bad


class Run:
    """One configuration's records and the plain resume's fingerprint to compare against."""

    def __init__(self, env: Env, framework: str, variant: str, n_elements: int) -> None:
        self.env = env
        self.framework = framework
        self.variant = variant
        self.n_elements = n_elements
        self.reference: dict[str, Any] | None = None

    def record(self, op: str, mode: str, result: dict[str, Any], **extra: Any) -> None:
        self.env.keep(
            {
                "op": op,
                "framework": self.framework,
                "variant": self.variant,
                "mode": mode,
                "world_size": self.env.world,
                "rank": self.env.rank,
                "n_elements": self.n_elements,
                **result,
                **extra,
            }
        )

    def resumed(self, mode: str, result: dict[str, Any], fp: Any) -> None:
        extra: dict[str, Any] = {}
        if mode == "te_default":
            self.reference = fp
        else:
            assert self.reference is not None, "te_default runs first"
            bad = differing(fp, self.reference)
            extra["states_equal_plain"] = not bad
            if bad:
                self.env.fail(
                    f"{self.framework}/{self.variant}: {len(bad)} resumed states differ from "
                    f"te_default's, e.g. {bad[:3]}"
                )
        self.record("trainer_resume", mode, result, **extra)


# --- Transformers ---------------------------------------------------------------------------------


def _accelerate_fsdp_on_cpu() -> None:
    """Lets accelerate run its FSDP2 plugin on CPU processes (gloo), for ``--device cpu``.

    accelerate turns an FSDP plugin into ``DistributedType.FSDP`` only on accelerators; on CPU
    processes it ignores the plugin and trains with DDP. FSDP2 itself (``fully_shard`` on a CPU
    mesh) runs on gloo, so after accelerate's own setup this marks a multi-CPU state that was
    given a plugin as FSDP, the rest of accelerate's FSDP2 code path unchanged.
    """
    from accelerate.state import AcceleratorState, PartialState
    from accelerate.utils import DistributedType

    init = AcceleratorState.__init__
    if getattr(init, "_fsdp_on_cpu", False):
        return

    def patched(self: Any, *args: Any, fsdp_plugin: Any = None, **kwargs: Any) -> None:
        init(self, *args, fsdp_plugin=fsdp_plugin, **kwargs)
        if fsdp_plugin is not None and self.distributed_type == DistributedType.MULTI_CPU:
            self.distributed_type = DistributedType.FSDP
            self.fsdp_plugin = fsdp_plugin
            # As accelerate does for the types it sets (later AcceleratorState() calls copy it).
            PartialState._shared_state["distributed_type"] = self.distributed_type

    patched._fsdp_on_cpu = True  # type: ignore[attr-defined]
    AcceleratorState.__init__ = patched  # type: ignore[method-assign]


def _reset_accelerate(fsdp: bool) -> None:
    # Each Trainer below builds its own Accelerator (DDP, then FSDP2 with another plugin) in this
    # process; accelerate keeps one shared state per process, so it is reset in between (the
    # distributed state, i.e. the process group, stays). An FSDP plugin also leaves
    # ACCELERATE_USE_FSDP=true in the environment.
    from accelerate.state import AcceleratorState, GradientState

    AcceleratorState._reset_state(reset_partial_state=False)
    GradientState._reset_state()
    if not fsdp:
        os.environ.pop("ACCELERATE_USE_FSDP", None)


def _training_arguments(env: Env, variant: str, out: Path, max_steps: int, *, save: bool) -> Any:
    """The ``TrainingArguments`` of a Transformers run (accelerate FSDP2 for ``fsdp2_*``)."""
    from transformers import TrainingArguments

    extra: dict[str, Any] = {}
    if variant.startswith("fsdp2"):
        extra["fsdp"] = True
        extra["fsdp_config"] = {
            "version": 2,
            "state_dict_type": "FULL_STATE_DICT"
            if variant == "fsdp2_full"
            else "SHARDED_STATE_DICT",
            "transformer_layer_cls_to_wrap": ["LlamaDecoderLayer"],
        }
    return TrainingArguments(
        output_dir=str(out),
        max_steps=max_steps,
        per_device_train_batch_size=2,
        save_strategy="steps" if save else "no",
        save_steps=max_steps,
        report_to="none",
        use_cpu=not env.cuda,
        disable_tqdm=True,
        logging_strategy="no",
        dataloader_num_workers=0,
        seed=0,
        **extra,
    )


def run_transformers(env: Env, variant: str) -> None:
    from transformers import Trainer

    from te_ckpt_placement.integrations.hf import PlacementTrainer

    if variant.startswith("fsdp2") and not env.cuda:
        _accelerate_fsdp_on_cpu()
    data = [{"input_ids": t, "labels": t} for t in tokens(env)]
    optimizer = (env.optimizer_cls, env.optimizer_kwargs)
    out = env.fresh_dir(f"transformers_{variant}")
    holder: dict[str, Any] = {}

    class SaveMeasured(PlacementTrainer):
        def _save_checkpoint(self, *args: Any, **kwargs: Any) -> Any:
            with Window(env.cuda, diagnose=True) as window:
                result = super()._save_checkpoint(*args, **kwargs)
            holder["save"] = window.result
            holder["n"] = local_elements(self.model.parameters())
            return result

    class ResumeMeasured:
        def _load_optimizer_and_scheduler(self, checkpoint: Any) -> Any:
            diagnose = isinstance(self, PlacementTrainer)
            with timed_optimizer_load(self.optimizer) as timed:  # type: ignore[attr-defined]
                with Window(env.cuda, diagnose=diagnose) as window:
                    result = super()._load_optimizer_and_scheduler(checkpoint)  # type: ignore[misc]
            window.result["breakdown"] = timed.result()
            holder["window"] = window
            holder["fp"] = fingerprint(self.optimizer)  # type: ignore[attr-defined]
            return result

    class PlainResume(ResumeMeasured, Trainer):
        pass

    class PlacedResume(ResumeMeasured, PlacementTrainer):
        pass

    _reset_accelerate(variant.startswith("fsdp2"))
    trainer = SaveMeasured(
        model=build_model(env, seed=0),
        args=_training_arguments(env, variant, out, STEPS, save=True),
        train_dataset=data,
        optimizer_cls_and_kwargs=optimizer,
    )
    trainer.train()
    del trainer
    env.free()
    env.barrier()  # the checkpoint is complete on every rank
    run = Run(env, "transformers", variant, holder["n"])
    run.record("trainer_save", "placement_cpu", holder["save"])
    checkpoint = out / f"checkpoint-{STEPS}"
    for mode in MODES:
        _reset_accelerate(variant.startswith("fsdp2"))
        cls = PlainResume if mode == "te_default" else PlacedResume
        trainer = cls(
            model=build_model(env, seed=1),
            args=_training_arguments(env, variant, out / mode, STEPS + 1, save=False),
            train_dataset=data,
            optimizer_cls_and_kwargs=optimizer,
        )
        trainer.train(resume_from_checkpoint=str(checkpoint))
        window = holder.pop("window")
        run.resumed(mode, window.result, holder.pop("fp"))
        del trainer, window
        env.free()
    env.remove(out)


# --- Lightning ------------------------------------------------------------------------------------


def _lightning_module(env: Env, seed: int) -> Any:
    import lightning.pytorch as pl
    from torch.utils.data import DataLoader, TensorDataset

    class LlamaModule(pl.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.model = build_model(env, seed)

        def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
            (ids,) = batch
            return self.model(input_ids=ids, labels=ids).loss

        def configure_optimizers(self) -> Any:
            return env.optimizer_cls(self.parameters(), **env.optimizer_kwargs)

        def train_dataloader(self) -> DataLoader:
            return DataLoader(TensorDataset(tokens(env)), batch_size=2)

    return LlamaModule()


def _lightning_trainer(env: Env, max_steps: int, callbacks: list[Any], root: Path) -> Any:
    import lightning.pytorch as pl
    from lightning.pytorch.callbacks import ModelCheckpoint

    return pl.Trainer(
        accelerator="gpu" if env.cuda else "cpu",
        devices=env.world,
        strategy="ddp" if env.world > 1 else "auto",
        precision="32-true",
        max_steps=max_steps,
        logger=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        enable_checkpointing=any(isinstance(c, ModelCheckpoint) for c in callbacks),
        default_root_dir=root,
        callbacks=callbacks,
    )


def _measure_lightning_resume(
    env: Env, resuming: Any, *, placed: bool
) -> tuple[dict[str, Window], list[Any]]:
    """Wraps the resume's checkpoint read and restore of ``resuming`` in windows: they land in
    the returned dict (``"read"``, ``"restore"``), the restored optimizer's fingerprint in the
    list, once ``resuming.fit`` has run."""
    connector = resuming._checkpoint_connector
    resume_start, restore = connector.resume_start, connector.restore_training_state
    windows: dict[str, Window] = {}
    fps: list[Any] = []

    def measured_start(*args: Any, **kwargs: Any) -> Any:
        # The read should leave nothing on the GPU: expect_live=False.
        with Window(env.cuda, diagnose=placed, expect_live=False) as window:
            result = resume_start(*args, **kwargs)
        windows["read"] = window
        return result

    def measured_restore() -> Any:
        with Window(env.cuda, diagnose=placed) as window:
            result = restore()
        windows["restore"] = window
        fps.append(fingerprint(resuming.strategy.optimizers[0]))
        return result

    connector.resume_start = measured_start
    connector.restore_training_state = measured_restore
    return windows, fps


def _lightning_resume_result(env: Env, read: Window, restore: Window) -> dict[str, Any]:
    """One resume's numbers from its read and restore windows: seconds added, peaks combined
    (on the GPU, what the read left allocated counts during the restore)."""
    result = dict(restore.result)
    result["seconds"] += read.result["seconds"]
    result["peak_extra_host_bytes"] = max(
        read.result["peak_extra_host_bytes"], restore.result["peak_extra_host_bytes"]
    )
    if env.cuda:
        held = read.after - read.base  # what the read left on the GPU until resume_end
        during_read = read.peak - read.base
        during_restore = held + restore.result["peak_extra_gpu_bytes"]
        result["peak_extra_gpu_bytes"] = max(during_read, during_restore)
        result["checkpoint_held_gpu_bytes"] = held
        result["peak_extra_gpu_bytes_other_devices"] = max(
            read.result["peak_extra_gpu_bytes_other_devices"],
            restore.result["peak_extra_gpu_bytes_other_devices"],
        )
        if "peak_allocations" in read.result:
            result["read_peak_allocations"] = read.result["peak_allocations"]
    return result


def run_lightning(env: Env, variant: str) -> None:
    from lightning.pytorch.callbacks import ModelCheckpoint

    from te_ckpt_placement.integrations.lightning import PlacementCallback

    out = env.fresh_dir(f"lightning_{variant}")
    saving = _lightning_trainer(
        env,
        STEPS,
        [
            PlacementCallback(),
            ModelCheckpoint(dirpath=out, filename="{step}", every_n_train_steps=STEPS),
        ],
        out,
    )
    saves: list[dict[str, Any]] = []
    save_checkpoint = saving.save_checkpoint

    def measured_save(*args: Any, **kwargs: Any) -> Any:
        with Window(env.cuda, diagnose=True) as window:
            result = save_checkpoint(*args, **kwargs)
        saves.append(window.result)
        return result

    saving.save_checkpoint = measured_save
    module = _lightning_module(env, seed=0)
    saving.fit(module)
    run = Run(env, "lightning", variant, local_elements(module.parameters()))
    run.record("trainer_save", "placement_cpu", saves[0])
    del saving, module
    env.free()
    env.barrier()
    checkpoint = out / f"step={STEPS}.ckpt"
    for mode in MODES:
        placed = mode == "placement_cpu"
        callbacks = [PlacementCallback()] if placed else []
        resuming = _lightning_trainer(env, STEPS + 1, callbacks, out / mode)
        windows, fps = _measure_lightning_resume(env, resuming, placed=placed)
        resuming.fit(_lightning_module(env, seed=1), ckpt_path=str(checkpoint))
        result = _lightning_resume_result(env, windows["read"], windows["restore"])
        run.resumed(mode, result, fps[0])
        del resuming, windows
        env.free()
    env.remove(out)


# --- Fabric ---------------------------------------------------------------------------------------


def run_fabric(env: Env, variant: str) -> None:
    from lightning.fabric import Fabric

    from te_ckpt_placement.integrations.lightning import place_strategy

    def fabric() -> Any:
        f = Fabric(
            accelerator="cuda" if env.cuda else "cpu",
            devices=env.world,
            strategy="ddp" if env.world > 1 else "auto",
            precision="32-true",
        )
        f.launch()
        return f

    def setup(f: Any, seed: int) -> tuple[Any, Any]:
        model = build_model(env, seed)
        return f.setup(model, env.optimizer_cls(model.parameters(), **env.optimizer_kwargs))

    out = env.fresh_dir(f"fabric_{variant}")
    checkpoint = out / "checkpoint.ckpt"
    saving = fabric()
    model, optimizer = setup(saving, seed=0)
    batches = tokens(env)[env.rank :: env.world]
    for step in range(STEPS):
        ids = batches[2 * step : 2 * step + 2].to(env.torch_device)
        saving.backward(model(input_ids=ids, labels=ids).loss)
        optimizer.step()
        optimizer.zero_grad()
    place_strategy(saving.strategy)
    with Window(env.cuda, diagnose=True) as window:
        saving.save(checkpoint, {"model": model, "optimizer": optimizer, "step": STEPS})
    run = Run(env, "fabric", variant, local_elements(model.parameters()))
    run.record("trainer_save", "placement_cpu", window.result)
    del saving, model, optimizer, window
    env.free()
    env.barrier()
    for mode in MODES:
        resuming = fabric()
        model, optimizer = setup(resuming, seed=1)
        if mode == "placement_cpu":
            place_strategy(resuming.strategy)
        strategy = resuming.strategy
        load_checkpoint = strategy.load_checkpoint  # the placed one, in placement_cpu
        windows: list[Window] = []

        def measured_load(
            *args: Any,
            _load: Any = load_checkpoint,
            _windows: Any = windows,
            _placed: bool = mode == "placement_cpu",
            **kwargs: Any,
        ) -> Any:
            with Window(env.cuda, diagnose=_placed) as window:
                result = _load(*args, **kwargs)
            _windows.append(window)
            return result

        strategy.load_checkpoint = measured_load
        resuming.load(checkpoint, {"model": model, "optimizer": optimizer})
        run.resumed(mode, windows[0].result, fingerprint(optimizer))
        del resuming, model, optimizer, strategy, windows, load_checkpoint
        env.free()
    env.remove(out)


RUNNERS: dict[str, Callable[[Env, str], None]] = {
    "transformers": run_transformers,
    "lightning": run_lightning,
    "fabric": run_fabric,
}


# --- processes ----------------------------------------------------------------------------------


def _physical_cores() -> int | None:
    """Distinct (package, core) pairs in /proc/cpuinfo; None where it does not say."""
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return None
    cores = set()
    for block in text.split("\n\n"):
        fields = dict(
            (k.strip(), v.strip())
            for k, _, v in (line.partition(":") for line in block.split("\n"))
        )
        if "core id" in fields:
            cores.add((fields.get("physical id"), fields["core id"]))
    return len(cores) or None


def environment(device: str) -> dict[str, Any]:
    """Hardware and versions, for the results file."""
    from importlib.metadata import PackageNotFoundError, version

    _ensure_root_on_path()
    from benchmarks._measure import driver_version

    versions = {}
    for dist in ("torch", "transformers", "accelerate", "lightning", "transformer_engine"):
        try:
            versions[dist] = version(dist)
        except PackageNotFoundError:
            versions[dist] = None
    info: dict[str, Any] = {
        "device": device,
        "python": platform.python_version(),
        "host_cpus": os.cpu_count(),
        "cpus_available": len(os.sched_getaffinity(0))
        if hasattr(os, "sched_getaffinity")
        else None,
        "physical_cores": _physical_cores(),
        "torch_threads": torch.get_num_threads(),  # what a worker starts with
        "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS"),
        "versions": versions,
    }
    if device == "cuda":
        info["gpu"] = torch.cuda.get_device_name(0)
        info["gpu_count"] = torch.cuda.device_count()
        info["cuda"] = torch.version.cuda
        info["driver"] = driver_version()
    return info


def worker(args: argparse.Namespace) -> int:
    _ensure_root_on_path()
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("TRANSFORMERS_NO_ADVISORY_WARNINGS", "1")
    import warnings

    warnings.filterwarnings("ignore", category=UserWarning)
    warnings.filterwarnings("ignore", category=FutureWarning)
    warnings.filterwarnings("ignore", category=DeprecationWarning)
    if args.device == "cuda":
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
    world = int(os.environ.get("WORLD_SIZE", "1"))
    if world > 1:
        import torch.distributed as dist

        dist.init_process_group(
            "nccl" if args.device == "cuda" else "gloo", timeout=datetime.timedelta(minutes=20)
        )
    env = Env(args)
    try:
        for config in args.configs.split(","):
            framework, variant = config.split("/")
            try:
                RUNNERS[framework](env, variant)
            except Exception as exc:  # one configuration's failure must not hide the others'
                import traceback

                traceback.print_exc()
                env.fail(f"{config}: {type(exc).__name__}: {exc}")
                if world > 1:
                    raise  # the other rank may be waiting in a collective
            env.free()
    finally:
        if args.device == "cuda":
            torch.cuda.memory._record_memory_history(None)
        if world > 1:
            import torch.distributed as dist

            if dist.is_initialized():
                dist.destroy_process_group()
    return 1 if env.failures else 0


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def launch(args: argparse.Namespace, world: int, configs: list[str], scratch: Path) -> list[Path]:
    """Runs ``configs`` in ``world`` worker processes (torchrun-like environment)."""
    port = _free_port()
    procs, partials = [], []
    for rank in range(world):
        env = dict(
            os.environ, PYTHONPATH=os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])
        )
        if world > 1:
            env.update(
                RANK=str(rank),
                LOCAL_RANK=str(rank),
                WORLD_SIZE=str(world),
                LOCAL_WORLD_SIZE=str(world),
                MASTER_ADDR="127.0.0.1",
                MASTER_PORT=str(port),
            )
        else:
            for key in ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE"):
                env.pop(key, None)
            if args.device == "cuda":
                # One visible GPU: a Trainer that sees several would wrap the model in DataParallel.
                visible = os.environ.get("CUDA_VISIBLE_DEVICES")
                env["CUDA_VISIBLE_DEVICES"] = visible.split(",")[0] if visible else "0"
        partial = scratch / f"ws{world}.rank{rank}.json"
        partials.append(partial)
        command = [
            sys.executable,
            str(Path(__file__).resolve()),
            "--worker",
            "--device",
            args.device,
            "--size",
            args.size,
            "--dir",
            str(Path(args.dir) / f"ws{world}"),
            "--partial",
            str(partial),
            "--configs",
            ",".join(configs),
        ]
        procs.append(subprocess.Popen(command, env=env))
    codes = [p.wait() for p in procs]
    if any(codes):
        print(f"world size {world}: worker exit codes {codes}", file=sys.stderr, flush=True)
    return partials


def summarize(records: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Per configuration and rank: the placed resume's time over the plain one's."""
    out = []
    by_key: dict[tuple[Any, ...], dict[str, Any]] = {}
    for r in records:
        if r["op"] == "trainer_resume":
            by_key.setdefault((r["framework"], r["variant"], r["rank"]), {})[r["mode"]] = r
    for (framework, variant, rank), modes in sorted(by_key.items()):
        if set(modes) == set(MODES):
            plain, placed = modes["te_default"], modes["placement_cpu"]
            out.append(
                {
                    "framework": framework,
                    "variant": variant,
                    "rank": rank,
                    "seconds_placed_over_plain": placed["seconds"] / plain["seconds"],
                    "peak_extra_gpu_bytes": {
                        "te_default": plain["peak_extra_gpu_bytes"],
                        "placement_cpu": placed["peak_extra_gpu_bytes"],
                    },
                    # torch's threads as each resume began (the placed load may cap them).
                    "torch_threads": {m: modes[m].get("torch_threads") for m in MODES},
                    "breakdown": {
                        m: modes[m]["breakdown"] for m in MODES if "breakdown" in modes[m]
                    },
                }
            )
    return out


def requirements_missing(device: str, worlds: list[int]) -> str | None:
    if device == "cpu":
        return None
    if not torch.cuda.is_available():
        return f"no CUDA GPU is visible to torch {torch.__version__}"
    if max(worlds) > torch.cuda.device_count():
        return (
            f"world size {max(worlds)} needs that many GPUs, torch sees {torch.cuda.device_count()}"
        )
    try:
        import transformer_engine.pytorch  # noqa: F401
    except Exception as exc:
        return f"Transformer Engine for PyTorch does not import ({type(exc).__name__}: {exc})"
    return None


def parse(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=(__doc__ or "").split("\n")[0])
    parser.add_argument("--out", type=Path, default=None, help="results JSON path")
    parser.add_argument("--device", choices=("cuda", "cpu"), default="cuda")
    parser.add_argument("--size", choices=tuple(SIZES), default="default")
    parser.add_argument(
        "--world-sizes", default="1,2", help="comma-separated subset of 1,2 (default: both)"
    )
    parser.add_argument(
        "--configs",
        default="",
        help="comma-separated configurations (default: all for the device), e.g. "
        "transformers/ddp,fabric/single",
    )
    parser.add_argument(
        "--dir",
        default=os.path.join(tempfile.gettempdir(), "trainer_resume"),
        help="where checkpoints are written (each is deleted after its configuration)",
    )
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--partial", default="", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    known = {c for configs in CONFIGS.values() for c in configs}
    for config in filter(None, args.configs.split(",")):
        if config not in known:
            parser.error(f"unknown configuration {config!r}; valid: {', '.join(sorted(known))}")
    for world in args.world_sizes.split(","):
        if world not in ("1", "2"):
            parser.error(f"unknown world size {world!r}; valid: 1, 2")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse(sys.argv[1:] if argv is None else argv)
    if args.worker:
        return worker(args)
    worlds = sorted(int(w) for w in args.world_sizes.split(","))
    missing = requirements_missing(args.device, worlds)
    if missing:
        print(
            "This benchmark resumes Transformers, Lightning and Fabric trainers with real "
            f"Transformer Engine FusedAdam on GPUs. It cannot run here: {missing}.\n"
            "It needs CUDA GPUs (2 for world size 2), torch with NCCL, Transformer Engine, "
            "transformers, accelerate and lightning. Without them: --device cpu --size tiny.",
            file=sys.stderr,
        )
        return 2
    chosen = [c for c in args.configs.split(",") if c]
    started = time.perf_counter()
    records: list[dict[str, Any]] = []
    failures: list[str] = []
    with tempfile.TemporaryDirectory() as scratch:
        for world in worlds:
            configs = [c for c in CONFIGS[world] if not chosen or c in chosen]
            if not configs:
                continue
            for partial in launch(args, world, configs, Path(scratch)):
                if not partial.exists():
                    failures.append(f"world size {world}: {partial.name} wrote nothing")
                    continue
                data = json.loads(partial.read_text())
                records += data["records"]
                failures += data["failures"]
            expected = {(c, r) for c in configs for r in range(world)}
            seen = {
                (f"{r['framework']}/{r['variant']}", r["rank"])
                for r in records
                if r["op"] == "trainer_resume" and r["mode"] == "placement_cpu"
            }
            failures += [
                f"{c} rank {r}: no placed resume record" for c, r in sorted(expected - seen)
            ]
    result = {
        "environment": environment(args.device),
        "size": args.size,
        "seconds_total": time.perf_counter() - started,
        "records": records,
        "summary": summarize(records),
        "failures": failures,
    }
    # The placed resume must not be slower than the plain one (reported, not a failure: one
    # run's timing; on GPUs only, the CPU check's resumes take milliseconds).
    result["placed_slower_than_plain"] = [
        f"{line['framework']}/{line['variant']} rank {line['rank']}: "
        f"{line['seconds_placed_over_plain']:.2f}x"
        for line in result["summary"]
        if line["seconds_placed_over_plain"] > 1 and args.device == "cuda"
    ]
    if args.out is not None:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(result, indent=1) + "\n")
        print(f"wrote {args.out}", flush=True)
    for line in result["summary"]:
        print(
            f"{line['framework']:<12} {line['variant']:<14} rank {line['rank']}: placed/plain time "
            f"{line['seconds_placed_over_plain']:.2f}, GPU extra {line['peak_extra_gpu_bytes']}, "
            f"threads {line['torch_threads']}",
            flush=True,
        )
        for mode, parts in line["breakdown"].items():
            print(f"    {mode:<14} {parts['seconds']} threads {parts['torch_threads']}", flush=True)
    for slower in result["placed_slower_than_plain"]:
        print(f"SLOWER placed than plain: {slower}", flush=True)
    for failure in failures:
        print(f"FAILED: {failure}", file=sys.stderr, flush=True)
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
