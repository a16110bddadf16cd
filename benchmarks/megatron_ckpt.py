"""Megatron-Core on 1 or 2 GPUs: dist_checkpointing saves and loads of a GPT's DistributedOptimizer.

The model and optimizer come from Megatron's own setup, as Megatron-LM's ``--bf16`` training
builds them: ``GPTModel`` (local layer spec) in ``Float16Module`` in Megatron's
``DistributedDataParallel``, and ``get_megatron_optimizer`` with
``OptimizerConfig(use_distributed_optimizer=True, use_precision_aware_optimizer=True,
exp_avg_dtype=bfloat16, exp_avg_sq_dtype=bfloat16, bf16=True, store_param_remainders=...)``,
which builds TE ``FusedAdam`` inside a ``ChainedOptimizer``. For each case of :func:`cases`
(BF16, FP16 and FP8 moments on one GPU; the gathering sharding types on two), in one run:

1. train a few steps, then save with ``dist_checkpointing`` (torch_dist, fully parallel save)
   twice: Megatron's default (``te_default``) and after ``place_optimizer`` (``placement_cpu``);
2. compare the two checkpoints tensor by tensor, bit for bit (the padding of
   ``dp_reshardable`` buckets is ``torch.empty`` in Megatron and is left out);
3. resume a fresh model and optimizer from each checkpoint (the placed one placed), then train
   on; the optimizer states and parameters must be bit-identical after the load and after the
   steps (the placed run takes its steps inside ``export_placement("cpu")``);
4. check the GPU memory of the placed saves and loads against what Megatron itself needs;
5. (``nan_probe``) load BF16 moments holding NaNs both ways: the same bits, NaNs included.

``fully_sharded_model_space`` is rejected by megatron-core 0.19.2 itself ("ShardedTensor.
flattened_range is not supported"): the run checks that the placed save fails the same way.

Each save and load is measured: ``peak_extra_gpu_bytes`` is ``torch.cuda.max_memory_allocated``
above the start, ``peak_extra_host_bytes`` the peak RSS growth (sampled every millisecond),
``seconds`` the wall time; ``n_elements`` the local optimizer elements (each rank's own numbers are
in ``per_rank``). Saves run with the CUDA allocator's history recorded (what was live at the GPU
peak), loads without it (``allocator_history``), since its stack capture at every allocation slows
whichever path allocates more. Each checkpoint is loaded ``--load-repeats`` times (3), the modes
taking turns; ``megatron_load_median`` records their median seconds. Rank 0 writes ``--out``:
the records, every check, the machine and the versions, rewritten after every case
(``"complete": true`` once the run has ended). The exit status is 1 if any check failed.
``tests/test_gpu_megatron.py`` runs it on 1 and 2 GPUs; ``tests/support/megatron_cpu_run.py``
runs it on the CPU.

Usage (repository root, megatron-core 0.19.2 and TE importable):
    python -m torch.distributed.run --standalone --nproc_per_node 2 benchmarks/megatron_ckpt.py \
        --out FILE.json
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import gc
import json
import os
import re
import shutil
import statistics
import sys
import tempfile
import time
import traceback
from collections.abc import Iterator
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import torch

ROOT = Path(__file__).resolve().parents[1]
MI = 1 << 20
# GPU bytes a placed save or load may allocate beyond Megatron's own buffers: the metadata
# collectives of dist_checkpointing (pickled objects on the GPU), nothing that scales with N.
SLACK_BYTES = 8 * MI
# How far the placed dp_reshardable save's GPU peak may move between two models with the same
# tensors and different widths: their metadata pickles differ by a few bytes per tensor (the
# encodings of shapes and offsets), the fully parallel save may hand a few replicated tensors to
# another DP rank (whose plan then grows by a few hundred bytes each, padded to the largest in
# the object collectives), and the allocator rounds blocks to 512 B. The check bounds any term
# proportional to N by PROBE_TOLERANCE_BYTES / (N_full - N_half) bytes per element.
PROBE_TOLERANCE_BYTES = 32 << 10
# "cuda"; "cpu" only under tests/support/megatron_cpu_run.py (gloo, TE's stand-in, no GPU).
DEVICE = "cuda"


@dataclass(frozen=True)
class Size:
    layers: int
    hidden: int
    heads: int
    vocab: int
    seq: int
    batch: int
    train_steps: int
    resume_steps: int
    bucket_size: int


SIZES = {
    # The GPU run: 16.8 M parameters, so 8 B/element (135 MB on 1 GPU, 67 MB per rank on 2) stand
    # well above the slack, and every save, load and comparison is quick.
    "test": Size(4, 512, 8, 4096, 64, 4, 3, 3, 4_000_000),
    # The CPU run of tests/support/megatron_cpu_run.py: 0.66 M parameters, several buckets.
    "smoke": Size(2, 128, 4, 1024, 32, 2, 2, 2, 60_000),
}


def half_width(size: Size) -> Size:
    """The same layers and tensors, half the hidden size and vocabulary: about N/4 elements."""
    return replace(size, hidden=size.hidden // 2, vocab=size.vocab // 2)


@dataclass(frozen=True)
class Case:
    sharding_type: str
    moments: torch.dtype = torch.bfloat16
    remainders: bool = True
    # Several DDP buckets (overlap_grad_reduce with bucket_size), else one per buffer (Megatron's
    # default without --overlap-grad-reduce).
    buckets: bool = True

    @property
    def name(self) -> str:
        moments = {torch.bfloat16: "bf16", torch.float16: "fp16", torch.uint8: "fp8"}
        master = "remainders" if self.remainders else "fp32_master"
        return f"{self.sharding_type}/{moments[self.moments]}/{master}"


def cases(world: int) -> list[Case]:
    """What one run covers: the moment dtypes on one rank, the gathering types on several.

    dp_zero_gather_scatter and fully_reshardable load FP32 masters only: megatron-core 0.19.2
    hands their loaded "param" to set_scaled_state as FP32, which TE refuses for int16
    remainders (distrib_optimizer.py L2310 and L2356, L2405; TE fused_adam.py L378).
    fully_reshardable in one bucket: with several, megatron-core 0.19.2 slices its gathered
    world tensors, which leave out the padding between buckets (L1395-1402), at the padded
    buffer offsets of param_index_map (L1790).
    """
    if world == 1:
        return [
            Case("dp_reshardable"),
            Case("dp_reshardable", torch.float16, remainders=False),
            Case("dp_reshardable", torch.uint8, remainders=False),
            Case("fully_sharded_model_space"),
        ]
    return [
        Case("dp_reshardable"),
        Case("fully_reshardable", remainders=False, buckets=False),
        Case("dp_zero_gather_scatter", remainders=False),
    ]


def _ensure_root_on_path() -> None:
    if str(ROOT) not in sys.path:
        sys.path.insert(0, str(ROOT))


# --- Megatron setup ---------------------------------------------------------------------------


def init_distributed() -> None:
    import torch.distributed as dist
    from megatron.core import parallel_state

    if DEVICE == "cuda":
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
    # A rank that fails alone must not leave the others waiting (10 and 30 minutes by default).
    dist.init_process_group(
        "nccl" if DEVICE == "cuda" else "gloo", timeout=datetime.timedelta(seconds=60)
    )
    parallel_state.initialize_model_parallel(1, 1, distributed_timeout_minutes=1)


def build(size: Size, case: Case, seed: int) -> tuple[Any, Any, Any]:
    """(the model that trains, the GPTModel in it, the ChainedOptimizer), as Megatron-LM's.

    As ``megatron/training/training.py`` ``get_model`` does with ``--bf16``: the GPTModel on
    the GPU, in ``Float16Module`` (which casts it to BF16, the learned position embeddings
    included, and the first stage's float inputs), in ``DistributedDataParallel``.
    """
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer
    from megatron.core.tensor_parallel import (
        model_parallel_cuda_manual_seed,
        set_defaults_if_not_set_tensor_model_parallel_attributes,
    )
    from megatron.core.transformer import TransformerConfig
    from megatron.core.transformer.module import Float16Module

    torch.manual_seed(seed)
    model_parallel_cuda_manual_seed(seed)
    config = TransformerConfig(
        num_layers=size.layers,
        hidden_size=size.hidden,
        num_attention_heads=size.heads,
        bf16=True,
        params_dtype=torch.bfloat16,
        hidden_dropout=0.0,
        attention_dropout=0.0,
    )
    gpt = GPTModel(
        config=config,
        transformer_layer_spec=get_gpt_layer_local_spec(),
        vocab_size=size.vocab,
        max_sequence_length=size.seq,
    ).to(DEVICE)
    for param in gpt.parameters():
        set_defaults_if_not_set_tensor_model_parallel_attributes(param)
    ddp_config = DistributedDataParallelConfig(
        use_distributed_optimizer=True,
        grad_reduce_in_fp32=True,
        overlap_grad_reduce=case.buckets,  # bucket_size applies only with it
        bucket_size=size.bucket_size if case.buckets else None,
    )
    model = DistributedDataParallel(config, ddp_config, Float16Module(config, gpt))
    optimizer = get_megatron_optimizer(
        OptimizerConfig(
            optimizer="adam",
            lr=1e-3,
            weight_decay=0.01,
            clip_grad=1.0,
            bf16=True,
            params_dtype=torch.bfloat16,
            use_distributed_optimizer=True,
            use_precision_aware_optimizer=True,
            exp_avg_dtype=case.moments,
            exp_avg_sq_dtype=case.moments,
            store_param_remainders=case.remainders,
        ),
        [model],
    )
    return model, gpt, optimizer


def distributed_optimizer(optimizer: Any) -> Any:
    (member,) = optimizer.chained_optimizers
    return member


def train(model: Any, optimizer: Any, size: Size, steps: int, seed: int) -> None:
    import torch.distributed as dist

    gen = torch.Generator(device=DEVICE).manual_seed(seed * 1000 + dist.get_rank())
    position_ids = torch.arange(size.seq, device=DEVICE).unsqueeze(0).expand(size.batch, -1)
    causal = torch.ones(size.seq, size.seq, dtype=torch.bool, device=DEVICE).triu(1)[None, None]
    for _ in range(steps):
        shape = (size.batch, size.seq)
        tokens = torch.randint(0, size.vocab, shape, generator=gen, device=DEVICE)
        labels = torch.randint(0, size.vocab, shape, generator=gen, device=DEVICE)
        model.zero_grad_buffer()
        optimizer.zero_grad()
        loss = model(tokens, position_ids, causal, labels=labels)
        loss.float().mean().backward()
        model.finish_grad_sync()
        update_successful, _, _ = optimizer.step()
        assert update_successful, "the optimizer skipped a step"


def metadata(case: Case) -> dict[str, Any]:
    """What Megatron-LM's training passes (checkpointing.py _build_sharded_state_dict_metadata)."""
    out: dict[str, Any] = {
        "distrib_optim_sharding_type": case.sharding_type,
        "singleton_local_shards": False,
        "chained_optim_avoid_prefix": True,
    }
    if case.sharding_type == "fully_reshardable":
        out["distrib_optim_fully_reshardable_mem_efficient"] = False
    return out


def save(gpt: Any, optimizer: Any, case: Case, ckpt_dir: Path) -> None:
    import torch.distributed as dist
    from megatron.core import dist_checkpointing, parallel_state
    from megatron.core.dist_checkpointing.strategies.fully_parallel import (
        FullyParallelSaveStrategyWrapper,
    )
    from megatron.core.dist_checkpointing.strategies.torch import TorchDistSaveShardedStrategy

    if dist.get_rank() == 0:
        ckpt_dir.mkdir(parents=True)
    dist.barrier()
    model_sd = gpt.sharded_state_dict(metadata=metadata(case))
    state = {
        "model": model_sd,
        "optimizer": optimizer.sharded_state_dict(
            model_sd, is_loading=False, metadata=metadata(case)
        ),
    }
    strategy = FullyParallelSaveStrategyWrapper(
        TorchDistSaveShardedStrategy(),
        parallel_state.get_data_parallel_group(with_context_parallel=True),
    )
    dist_checkpointing.save(state, str(ckpt_dir), sharded_strategy=strategy)


def load(
    gpt: Any, optimizer: Any, case: Case, ckpt_dir: Path, phases: dict[str, float] | None = None
) -> None:
    """Megatron-LM's load; ``phases`` (if given) receives the seconds of each step: the
    templates (``sharded_state_dict``, the optimizer's round trip included), the read, the
    model's and the optimizer's ``load_state_dict``."""
    from megatron.core import dist_checkpointing
    from megatron.core.dist_checkpointing.serialization import get_default_load_sharded_strategy

    clock = _Phases(phases)
    model_sd = gpt.sharded_state_dict(metadata=metadata(case))
    state = {
        "model": model_sd,
        "optimizer": optimizer.sharded_state_dict(
            model_sd, is_loading=True, metadata=metadata(case)
        ),
    }
    clock.lap("templates")
    loaded = dist_checkpointing.load(
        state,
        str(ckpt_dir),
        sharded_strategy=get_default_load_sharded_strategy(str(ckpt_dir)),
    )
    clock.lap("read")
    # dist_checkpointing has already read the parameters in place; this is Megatron-LM's call.
    missing, unexpected = gpt.load_state_dict(loaded["model"], strict=False)
    assert not unexpected and all(k.endswith("_extra_state") for k in missing), missing
    clock.lap("model_load_state_dict")
    optimizer.load_state_dict(loaded["optimizer"])
    clock.lap("optimizer_load_state_dict")


class _Phases:
    """Seconds between laps (the device synchronized at each), into ``phases`` when given."""

    def __init__(self, phases: dict[str, float] | None) -> None:
        self.phases = phases
        self.last = self._now()

    def _now(self) -> float:
        if self.phases is not None and DEVICE == "cuda":
            torch.cuda.synchronize()
        return time.perf_counter()

    def lap(self, name: str) -> None:
        if self.phases is not None:
            now = self._now()
            self.phases[name] = now - self.last
            self.last = now


# --- what is compared -------------------------------------------------------------------------


def local_elements(optimizer: Any) -> int:
    inner = distributed_optimizer(optimizer).optimizer
    return sum(p.numel() for group in inner.param_groups for p in group["params"])


def stored_bytes(optimizer: Any) -> int:
    """The raw bytes TE keeps for the local states (what a load must allocate)."""
    return sum(t.numel() * t.element_size() for t in raw_states(optimizer).values())


def raw_states(optimizer: Any) -> dict[str, torch.Tensor]:
    """TE's stored local states (FP8 bytes and scales, FP16 scales too), by name."""
    inner = distributed_optimizer(optimizer).optimizer
    out = {}
    for g, group in enumerate(inner.param_groups):
        for i, p in enumerate(group["params"]):
            for name, value in inner.state[p].items():
                data = getattr(value, "_data", None)
                if data is not None:
                    out[f"{g}.{i}.{name}"] = data
                    out[f"{g}.{i}.{name}.scale_inv"] = value._scale_inv
                else:
                    out[f"{g}.{i}.{name}"] = value
                scale = inner._scales.get(p, {}).get(name)
                if scale is not None and data is None:
                    out[f"{g}.{i}.{name}.scale"] = scale
    return out


def snapshot(gpt: Any, optimizer: Any) -> dict[str, torch.Tensor]:
    """Host copies of every optimizer state, parameter and step, as raw bytes."""
    out = {k: _bytes(v) for k, v in raw_states(optimizer).items()}
    for name, p in gpt.named_parameters():
        out[f"param.{name}"] = _bytes(p)
    inner = distributed_optimizer(optimizer).optimizer
    steps = [group.get("step", 0) for group in inner.param_groups]
    out["steps"] = torch.tensor(steps, dtype=torch.int64)
    return out


def _bytes(t: torch.Tensor) -> torch.Tensor:
    return t.detach().contiguous().reshape(-1).view(torch.uint8).to("cpu", copy=True)


def differences(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> list[str]:
    if list(a) != list(b):
        return [f"keys differ: {sorted(set(a) ^ set(b))[:5]}"]
    return [k for k in a if not torch.equal(a[k], b[k])][:10]


_BUCKET_KEY = re.compile(r"gbuf_idx_(\d+)\.dtype_.*\.bucket_idx_(\d+)\.\w+$")


def param_slots(optimizer: Any) -> dict[tuple[int, int], list[tuple[int, int]]]:
    """This rank's parameter ranges in each dp_reshardable bucket tensor (the rest is padding)."""
    member = distributed_optimizer(optimizer)
    rank = member.data_parallel_group.rank()
    world = member.data_parallel_group.size()
    out: dict[tuple[int, int], list[tuple[int, int]]] = {}
    for g, ranges in enumerate(member.gbuf_ranges):
        for bucket_ranges in ranges.values():
            for b, bucket in enumerate(bucket_ranges):
                local = member.buffers[g].buckets[b].grad_data.numel() // world
                out[(g, b)] = [
                    (rank * local + r["gbuf_local"].start, rank * local + r["gbuf_local"].end)
                    for r in bucket["param_map"].values()
                ]
    return out


def read_checkpoint(ckpt_dir: Path, scratch: Path) -> dict[str, Any]:
    """Every tensor and object of a torch_dist checkpoint, as DCP stored it (one process)."""
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    path = scratch / f"{ckpt_dir.name}.pt"
    dcp_to_torch_save(ckpt_dir, path)
    data = torch.load(path, weights_only=False)
    path.unlink()
    return data  # type: ignore[no-any-return]


def compare_checkpoints(
    a: dict[str, Any], b: dict[str, Any], slots: dict[tuple[int, int], list[tuple[int, int]]]
) -> list[str]:
    """Keys where two checkpoints differ; dp_reshardable bucket tensors only at parameters."""
    if set(a) != set(b):
        return [f"keys differ: {sorted(set(a) ^ set(b))[:5]}"]
    bad = []
    for key in sorted(a):
        x, y = a[key], b[key]
        match = _BUCKET_KEY.search(key) if isinstance(x, torch.Tensor) else None
        if match is not None:
            mask = torch.zeros(x.numel(), dtype=torch.bool)
            for start, end in slots[(int(match[1]), int(match[2]))]:
                mask[start:end] = True
            same = x.dtype == y.dtype and x.shape == y.shape
            same = same and torch.equal(_bytes(x[mask]), _bytes(y[mask]))
        else:
            same = _same(x, y)
        if not same:
            bad.append(key)
    return bad[:10]


def _same(x: Any, y: Any) -> bool:
    if isinstance(x, torch.Tensor):
        return (
            isinstance(y, torch.Tensor)
            and x.dtype == y.dtype
            and x.shape == y.shape
            and torch.equal(_bytes(x), _bytes(y))
        )
    if isinstance(x, dict):
        return isinstance(y, dict) and list(x) == list(y) and all(_same(x[k], y[k]) for k in x)
    if isinstance(x, list | tuple):
        return (
            type(x) is type(y) and len(x) == len(y) and all(map(_same, x, y))  # type: ignore[arg-type]
        )
    return bool(x == y)


# --- what a save may hold on the GPU ---------------------------------------------------------


def gather_buffer_bytes(
    sharding_type: str, world: int, bucket_numel: int, *, mem_efficient: bool = False
) -> int:
    """The most GPU bytes Megatron's own gather of one save holds at once, on any DP rank.

    ``get_parameter_state_dp_zero`` (megatron-core 0.19.2 distrib_optimizer.py L1262-1409)
    copies each bucket's local shards into host tensors (L1340-1355), then, one state key at a
    time, for a shard of ``bucket_numel / world`` FP32 elements (``s`` bytes):

    - ``fully_reshardable`` (``use_gloo_comm=False``, ``return_on_all_ranks=True``, L1729-1740):
      ``world`` receive tensors on the GPU (L1362-1369), the send tensor's GPU copy (L1374), and
      ``torch.distributed.all_gather`` into that list (L1376), for which torch's NCCL backend
      allocates one flat ``world * s`` output and copies it out (``ProcessGroupNCCL::allgather``,
      ``newLikeFlat``): ``(2 * world + 1) * s``. The receive tensors go to the host (L1392) and
      the send copy is dropped (L1387) before the next key;
    - ``dp_zero_gather_scatter`` (``use_gloo_comm=False``, ``gather`` to DP rank 0, L1380): NCCL's
      gather receives into each tensor directly, so rank 0 holds ``(world + 1) * s``;
    - ``fully_reshardable`` with ``distrib_optim_fully_reshardable_mem_efficient``: gloo, host
      tensors only: 0. ``dp_reshardable`` gathers nothing: 0.
    """
    shard = bucket_numel // world * 4
    if sharding_type == "fully_reshardable":
        return 0 if mem_efficient else (2 * world + 1) * shard
    if sharding_type == "dp_zero_gather_scatter":
        return (world + 1) * shard
    if sharding_type == "dp_reshardable":
        return 0
    raise ValueError(
        f"unknown sharding type {sharding_type!r}: valid values are dp_reshardable, "
        "fully_reshardable and dp_zero_gather_scatter"
    )


def peak_live(
    trace: list[dict[str, Any]], *, torch_dir: str, owners: dict[str, str], top: int = 8
) -> dict[str, Any]:
    """What was allocated on the GPU, and still alive, at the peak of a CUDA allocator trace.

    ``trace`` is one device's ``torch.cuda.memory._snapshot()["device_traces"]`` recorded over
    the measured call: ``alloc`` adds a block, ``free_requested`` takes it off (where torch's
    ``memory_allocated`` drops it), so the replay's peak is ``max_memory_allocated`` above the
    start. Each block at the peak is charged to its *site*, the innermost Python frame outside
    ``torch_dir`` (the code that asked torch for it); ``owners`` maps a name to a directory, and
    ``owned_bytes`` sums, for each name, the live bytes whose site lies under it.
    """
    live: dict[int, dict[str, Any]] = {}
    current = peak = 0
    at_peak: list[dict[str, Any]] = []
    for event in trace:
        action = event.get("action")
        if action == "alloc":
            live[event["addr"]] = event
            current += event["size"]
        elif action == "free_requested":
            current -= event["size"]
            live.pop(event["addr"], None)
        else:
            continue
        if current > peak:
            peak, at_peak = current, list(live.values())
    sites: dict[str, list[int]] = {}
    owned = dict.fromkeys(owners, 0)
    largest = []
    for event in at_peak:
        frames = event.get("frames") or []
        site = next((f for f in frames if not f["filename"].startswith(torch_dir)), None)
        where = _frame(site) if site is not None else "(no Python frame outside torch)"
        entry = sites.setdefault(where, [0, 0])
        entry[0] += event["size"]
        entry[1] += 1
        for name, directory in owners.items():
            if site is not None and site["filename"].startswith(directory):
                owned[name] += event["size"]
        largest.append((event["size"], [_frame(f) for f in frames[:6]]))
    largest.sort(key=lambda item: -item[0])
    return {
        "replay_peak_bytes": peak,
        "live_bytes": sum(e["size"] for e in at_peak),
        "owned_bytes": owned,
        "by_site": [
            {"site": where, "bytes": b, "count": c}
            for where, (b, c) in sorted(sites.items(), key=lambda item: -item[1][0])[:top]
        ],
        "largest": [{"bytes": b, "frames": f} for b, f in largest[:top]],
    }


def _frame(frame: dict[str, Any]) -> str:
    return f"{_short(frame['filename'])}:{frame['line']} {frame['name']}"


def _short(filename: str) -> str:
    for marker in ("site-packages/", "dist-packages/"):
        if marker in filename:
            return filename.split(marker, 1)[1]
    root = str(ROOT) + os.sep
    return filename[len(root) :] if filename.startswith(root) else filename


def _package_dir(name: str) -> str | None:
    module = sys.modules.get(name)
    file = getattr(module, "__file__", None)
    return os.path.dirname(os.path.abspath(file)) + os.sep if file else None


@contextlib.contextmanager
def allocator_history(enabled: bool = True) -> Iterator[dict[str, Any]]:
    """Records the CUDA allocator's history over the block; fills the yielded dict with
    :func:`peak_live` of it (or ``{"error": ...}``) after the block. ``enabled=False``: no-op.

    The history is read before it is switched off (switching it off clears it).
    """
    out: dict[str, Any] = {}
    if not enabled:
        yield out
        return
    from torch.cuda import memory

    owners = {
        name: d
        for name in ("te_ckpt_placement", "transformer_engine")
        if (d := _package_dir(name)) is not None
    }
    torch_dir = _package_dir("torch") or ""
    memory._record_memory_history(enabled="all", context="alloc", stacks="python")
    try:
        yield out
        snapshot = memory._snapshot()
    finally:
        memory._record_memory_history(enabled=None)
    try:
        traces = snapshot["device_traces"]  # one list per device, by index
        trace = traces[0] if len(traces) == 1 else traces[torch.cuda.current_device()]
        for event in trace:
            event["frames"] = [
                {**f, "filename": os.path.abspath(f["filename"])} for f in event.get("frames", [])
            ]
        out.update(peak_live(trace, torch_dir=torch_dir, owners=owners))
    except Exception as exc:  # the breakdown explains a figure; it is not one
        out["error"] = f"{type(exc).__name__}: {exc}"


# --- the run ----------------------------------------------------------------------------------


class Run:
    def __init__(self, size_name: str, root: Path, load_repeats: int = 3) -> None:
        import torch.distributed as dist

        self.size = SIZES[size_name]
        self.root = root
        self.load_repeats = load_repeats
        self.world = dist.get_world_size()
        self.rank = dist.get_rank()
        self.records: list[dict[str, Any]] = []
        self.checks: list[dict[str, Any]] = []

    def check(self, case: Case, name: str, ok: bool, detail: Any = None) -> None:
        import torch.distributed as dist

        flags: list[Any] = [None] * self.world
        dist.all_gather_object(flags, (bool(ok), detail))
        entry = {
            "case": case.name,
            "sharding_type": case.sharding_type,
            "check": name,
            "ok": all(f[0] for f in flags),
            "detail": [f[1] for f in flags] if self.world > 1 else flags[0][1],
        }
        self.checks.append(entry)
        if self.rank == 0:
            print(("PASS " if entry["ok"] else "FAIL ") + f"{case.name}: {name} {detail!r}")

    def memory_check(self, case: Case, name: str, ok: bool, detail: Any) -> None:
        """A GPU memory check; on the CPU (no GPU memory to judge) only its code runs."""
        if DEVICE == "cuda":
            self.check(case, name, ok, detail)
        else:
            self.check(case, f"not measured on the CPU: {name}", True, detail)

    def measure(
        self, op: str, case: Case, mode: str, n: int, fn: Any, *, history: bool = True, **extra: Any
    ) -> dict[str, Any]:
        """Runs ``fn`` measured; ``history``: with the CUDA allocator's history recorded (the
        live-at-peak breakdown), which captures a Python stack at every allocation and so
        slows the path that allocates more: loads are timed without it."""
        import torch.distributed as dist

        _ensure_root_on_path()
        from benchmarks._measure import measured

        result: dict[str, Any] = {}
        dist.barrier()
        with allocator_history(DEVICE == "cuda" and history) as breakdown:
            with measured(result, cuda=DEVICE == "cuda"):
                fn()
        if breakdown:
            result["gpu_peak_live"] = breakdown
        per_rank: list[Any] = [None] * self.world
        dist.all_gather_object(per_rank, {**result, "n_elements": n})
        record = {
            "op": op,
            "sharding_type": case.sharding_type,
            "case": case.name,
            "mode": mode,
            "n_elements": sum(r["n_elements"] for r in per_rank),
            "peak_extra_gpu_bytes": max(r["peak_extra_gpu_bytes"] for r in per_rank),
            "peak_extra_host_bytes": max(r["peak_extra_host_bytes"] for r in per_rank),
            "seconds": max(r["seconds"] for r in per_rank),
            "world_size": self.world,
            "allocator_history": DEVICE == "cuda" and history,
            **extra,
            "per_rank": per_rank,
        }
        self.records.append(record)
        if self.rank == 0:
            print(
                f"{op:15s} {case.name:40s} {mode:14s}"
                f" gpu +{record['peak_extra_gpu_bytes'] / MI:9.1f} MiB"
                f"  host +{record['peak_extra_host_bytes'] / MI:9.1f} MiB"
                f"  {record['seconds']:6.2f} s"
            )
            for site in result.get("gpu_peak_live", {}).get("by_site", [])[:4]:
                print(f"    live at the GPU peak: {site['bytes'] / MI:9.3f} MiB  {site['site']}")
            if extra.get("phases"):
                laps = ", ".join(f"{k} {v:.3f} s" for k, v in extra["phases"].items())
                print(f"    phases: {laps}")
        return result

    def run_case(self, case: Case) -> None:
        """Steps 1 to 4 of the module's docstring for one case (see there)."""
        import torch.distributed as dist

        size, base = self.size, self.root / case.name.replace("/", "-")
        model, gpt, optimizer = build(size, case, seed=1)
        train(model, optimizer, size, size.train_steps, seed=1)
        n = local_elements(optimizer)
        dirs = {mode: base / mode for mode in ("te_default", "placement_cpu")}

        if case.sharding_type == "fully_sharded_model_space":
            self._check_refused(case, gpt, optimizer, dirs)
            return

        saved = snapshot(gpt, optimizer)
        member = distributed_optimizer(optimizer)
        results = self._saves(case, gpt, optimizer, dirs, n)
        self._check_save_memory(case, member, results, n)
        self._check_checkpoints_equal(case, optimizer, dirs, base)
        del model, gpt, optimizer, member
        _free()

        after, trained = self._loads(case, dirs, n, results)
        self._check_loads(case, saved, after, trained)
        if self.rank == 0:
            shutil.rmtree(base, ignore_errors=True)
        dist.barrier()

    def _check_refused(self, case: Case, gpt: Any, optimizer: Any, dirs: dict[str, Path]) -> None:
        """Megatron refuses to save the case, and the same way when placed."""
        from te_ckpt_placement.integrations.megatron import place_optimizer

        errors = {}
        for mode in dirs:
            if mode == "placement_cpu":
                place_optimizer(optimizer)
            try:
                save(gpt, optimizer, case, dirs[mode])
                errors[mode] = None
            except Exception as exc:  # Megatron's own refusal, expected in both modes
                errors[mode] = f"{type(exc).__name__}: {exc}"
        self.check(
            case,
            "megatron refuses it, and the same way when placed",
            errors["te_default"] is not None and errors["te_default"] == errors["placement_cpu"],
            errors,
        )

    def _saves(
        self, case: Case, gpt: Any, optimizer: Any, dirs: dict[str, Path], n: int
    ) -> dict[str, Any]:
        """Step 1: the measured saves, Megatron's then the placed one; results by mode."""
        from te_ckpt_placement.integrations.megatron import place_optimizer

        results = {}
        for mode, ckpt in dirs.items():
            if mode == "placement_cpu":
                place_optimizer(optimizer)
            results[mode] = self.measure(
                "megatron_save",
                case,
                mode,
                n,
                lambda ckpt=ckpt, gpt=gpt, optimizer=optimizer: save(gpt, optimizer, case, ckpt),
            )
        return results

    def _check_checkpoints_equal(
        self, case: Case, optimizer: Any, dirs: dict[str, Path], base: Path
    ) -> None:
        """Step 2: the two checkpoints, compared on rank 0 (every rank's slots gathered)."""
        import torch.distributed as dist

        slots: list[Any] = [None] * self.world
        dist.all_gather_object(slots, param_slots(optimizer))
        bad: list[str] = []
        if self.rank == 0:
            merged: dict[tuple[int, int], list[tuple[int, int]]] = {}
            for rank_slots in slots:
                for key, spans in rank_slots.items():
                    merged.setdefault(key, []).extend(spans)
            try:  # rank 0 alone: an error must reach the check, not leave the others waiting
                bad = compare_checkpoints(
                    read_checkpoint(dirs["te_default"], base),
                    read_checkpoint(dirs["placement_cpu"], base),
                    merged,
                )
            except Exception:
                bad = [traceback.format_exc()[-2000:]]
        self.check(case, "checkpoints equal Megatron's, bit for bit", not bad, bad)

    def _loads(
        self, case: Case, dirs: dict[str, Path], n: int, results: dict[str, Any]
    ) -> tuple[dict[str, dict[str, torch.Tensor]], dict[str, dict[str, torch.Tensor]]]:
        """Step 3: a fresh model and optimizer resumed from each checkpoint (measured), then
        trained on; returns their snapshots after the load and after the steps, by mode."""
        from te_ckpt_placement import export_placement
        from te_ckpt_placement.integrations.megatron import place_optimizer

        size = self.size
        after: dict[str, dict[str, torch.Tensor]] = {}
        trained: dict[str, dict[str, torch.Tensor]] = {}
        # The modes take turns, a fresh model and optimizer each time: a load of a test-size
        # model takes tenths of a second, about what it varies by from one load to the next.
        for repeat in range(self.load_repeats):
            last = repeat == self.load_repeats - 1
            for mode, ckpt in dirs.items():
                model, gpt, optimizer = build(size, case, seed=2)
                if mode == "placement_cpu":
                    place_optimizer(optimizer)
                before = _allocated()
                phases: dict[str, float] = {}
                results[f"load_{mode}"] = self.measure(
                    "megatron_load",
                    case,
                    mode,
                    n,
                    lambda ckpt=ckpt, gpt=gpt, optimizer=optimizer, phases=phases: load(
                        gpt, optimizer, case, ckpt, phases
                    ),
                    history=False,
                    phases=phases,  # this rank's, filled by the load
                    repeat=repeat,
                )
                grown = _allocated() - before
                if last:
                    after[mode] = snapshot(gpt, optimizer)
                    if mode == "placement_cpu":
                        self._check_load_memory(case, results, optimizer, grown)
                        with export_placement("cpu"):  # a step under the policy is TE's own
                            train(model, optimizer, size, size.resume_steps, seed=3)
                    else:
                        train(model, optimizer, size, size.resume_steps, seed=3)
                    trained[mode] = snapshot(gpt, optimizer)
                del model, gpt, optimizer
                _free()
        self._load_medians(case)
        return after, trained

    def _load_medians(self, case: Case) -> None:
        """A ``megatron_load_median`` record per mode: the median of its loads' seconds."""
        for mode in ("te_default", "placement_cpu"):
            loads = [
                r
                for r in self.records
                if r["op"] == "megatron_load" and r["case"] == case.name and r["mode"] == mode
            ]
            median = statistics.median_high(r["seconds"] for r in loads)
            self.records.append(
                {
                    "op": "megatron_load_median",
                    "sharding_type": case.sharding_type,
                    "case": case.name,
                    "mode": mode,
                    "seconds": median,
                    "world_size": self.world,
                    "repeats": len(loads),
                    "seconds_each": [r["seconds"] for r in loads],
                }
            )
            if self.rank == 0:
                print(f"megatron_load median {case.name:40s} {mode:14s} {median:6.3f} s")

    def _check_loads(
        self,
        case: Case,
        saved: dict[str, torch.Tensor],
        after: dict[str, dict[str, torch.Tensor]],
        trained: dict[str, dict[str, torch.Tensor]],
    ) -> None:
        """The placed load and resume against Megatron's own (and the saved states)."""
        diff = differences(after["placement_cpu"], after["te_default"])
        self.check(case, "loaded states and params equal Megatron's load", not diff, diff)
        if case.moments == torch.bfloat16:
            # BF16 moments, FP32 masters and int16 remainders survive a save/load exactly.
            diff = differences(after["placement_cpu"], saved)
            self.check(case, "loaded states equal the saved ones", not diff, diff)
        diff = differences(trained["placement_cpu"], trained["te_default"])
        size = self.size
        self.check(case, f"{size.resume_steps} steps after resume equal Megatron's", not diff, diff)

    def _check_save_memory(self, case: Case, member: Any, results: dict[str, Any], n: int) -> None:
        placed = results["placement_cpu"]["peak_extra_gpu_bytes"]
        default = results["te_default"]["peak_extra_gpu_bytes"]
        if case.sharding_type == "dp_reshardable":
            removed = default - placed
            self.memory_check(
                case,
                "save: Megatron's FP32 copies (8 B/element) are gone",
                removed >= 0.9 * 8 * n,
                {"default": default, "placed": placed, "8N": 8 * n},
            )
        # Megatron's own gather buffers (see gather_buffer_bytes: for fully_reshardable, torch's
        # flat NCCL all_gather output included) for the largest bucket, plus the metadata
        # collectives of dist_checkpointing and DCP (SLACK_BYTES).
        world = member.data_parallel_group.size()
        bucket = max(b.grad_data.numel() for buf in member.buffers for b in buf.buckets)
        gather = gather_buffer_bytes(
            case.sharding_type,
            world,
            bucket,
            mem_efficient=metadata(case).get(
                "distrib_optim_fully_reshardable_mem_efficient", False
            ),
        )
        bound = gather + SLACK_BYTES
        self.memory_check(
            case,
            "save: placed peak GPU within bound",
            placed <= bound,
            {"placed": placed, "bound": bound, "gather": gather, "default": default},
        )
        self._check_nothing_of_ours(case, "save", results["placement_cpu"])

    def _check_nothing_of_ours(self, case: Case, op: str, result: dict[str, Any]) -> None:
        """No GPU block alive at the placed peak was asked for by te_ckpt_placement or TE."""
        live = result.get("gpu_peak_live", {})
        owned = live.get("owned_bytes")
        self.memory_check(
            case,
            f"{op}: no GPU bytes at the placed peak are te_ckpt_placement's or TE's",
            owned is not None and not any(owned.values()),
            {"owned_bytes": owned, "by_site": live.get("by_site"), "error": live.get("error")},
        )

    def _check_load_memory(
        self, case: Case, results: dict[str, Any], optimizer: Any, grown: int
    ) -> None:
        placed = results["load_placement_cpu"]["peak_extra_gpu_bytes"]
        default = results["load_te_default"]["peak_extra_gpu_bytes"]
        inner = distributed_optimizer(optimizer).optimizer
        # TE's initial FP32 master of one parameter (initialize_state, TE fused_adam.py L476).
        largest = (
            0
            if case.remainders
            else 4 * max(p.numel() for group in inner.param_groups for p in group["params"])
        )
        bound = grown + largest + SLACK_BYTES
        detail = {
            "placed": placed,
            "default": default,
            "stored_states": stored_bytes(optimizer),
            "grown": grown,
            "bound": bound,
        }
        if case.moments == torch.bfloat16:
            # The states that stay allocated, and no more (FP16/FP8 loads rescale each state
            # on the GPU through TE's set_scaled_state, one FP32 state at a time).
            self.memory_check(
                case, "load: placed peak GPU is the loaded states", placed <= bound, detail
            )
        self.memory_check(
            case, "load: placed peak GPU not above Megatron's", placed <= default, detail
        )

    def size_probe(self) -> None:
        """Placed dp_reshardable saves of two models that differ only in width: their GPU peaks
        (dist_checkpointing's and DCP's metadata collectives, on NCCL: pickled descriptions of
        the same ShardedTensors) must not grow with the number of elements N."""
        from te_ckpt_placement.integrations.megatron import place_optimizer

        case = Case("dp_reshardable", buckets=False)
        found = {}
        for label, size in (("full", self.size), ("half_width", half_width(self.size))):
            model, gpt, optimizer = build(size, case, seed=1)
            train(model, optimizer, size, 1, seed=1)
            place_optimizer(optimizer)
            ckpt = self.root / f"size_probe_{label}"
            result = self.measure(
                "megatron_save_probe",
                case,
                "placement_cpu",
                local_elements(optimizer),
                lambda ckpt=ckpt, gpt=gpt, optimizer=optimizer: save(gpt, optimizer, case, ckpt),
                model_size=label,
                model=size.__dict__,
            )
            record = self.records[-1]
            found[label] = (record["n_elements"], record["peak_extra_gpu_bytes"])
            self._check_nothing_of_ours(case, f"save ({label} probe)", result)
            del model, gpt, optimizer
            _free()
            if self.rank == 0:
                shutil.rmtree(ckpt, ignore_errors=True)
        (n_full, full), (n_half, half) = found["full"], found["half_width"]
        self.memory_check(
            case,
            "save: placed dp_reshardable peak independent of N",
            abs(full - half) <= PROBE_TOLERANCE_BYTES and max(full, half) <= SLACK_BYTES,
            {
                "n_elements": [n_full, n_half],
                "peak_extra_gpu_bytes": [full, half],
                "difference": full - half,
                "tolerance": PROBE_TOLERANCE_BYTES,
                "8 B x difference of N": 8 * (n_full - n_half),
                "bound": SLACK_BYTES,
            },
        )

    def nan_probe(self) -> None:
        """For each BF16 case of the run: moments holding NaNs of several payloads, saved by
        Megatron and loaded both ways. The placed load must leave the bits Megatron's own leaves:
        TE rounds them on the device where Megatron's own template is there (dp_reshardable),
        on the host where it is host memory (dp_zero_gather_scatter, fully_reshardable)."""
        from te_ckpt_placement.integrations.megatron import place_optimizer

        payloads = torch.tensor([0x7F81, 0xFFC1, 0x7FC0, 0xFFFF], dtype=torch.int32).to(torch.int16)
        for case in cases(self.world):
            if case.moments != torch.bfloat16 or case.sharding_type == "fully_sharded_model_space":
                continue
            model, gpt, optimizer = build(self.size, case, seed=1)
            train(model, optimizer, self.size, 1, seed=1)
            inner = distributed_optimizer(optimizer).optimizer
            for states in inner.state.values():
                for name in ("exp_avg", "exp_avg_sq"):
                    states[name].view(-1).view(torch.int16)[:4] = payloads.to(DEVICE)
            ckpt = self.root / f"nan_probe_{case.sharding_type}"
            save(gpt, optimizer, case, ckpt)
            del model, gpt, optimizer, inner
            _free()
            loaded, firsts = {}, {}
            for mode in ("te_default", "placement_cpu"):
                _model, gpt, optimizer = build(self.size, case, seed=2)
                if mode == "placement_cpu":
                    place_optimizer(optimizer)
                load(gpt, optimizer, case, ckpt)
                loaded[mode] = snapshot(gpt, optimizer)
                firsts[mode] = sorted(
                    {
                        hex(int(v) & 0xFFFF)
                        for k, t in loaded[mode].items()
                        if k.endswith(("exp_avg", "exp_avg_sq"))
                        for v in t[:8].view(torch.int16).tolist()[:4]
                    }
                )
                del _model, gpt, optimizer
                _free()
            diff = differences(loaded["placement_cpu"], loaded["te_default"])
            nans = any(int(b, 16) & 0x7FFF > 0x7F80 for b in firsts["te_default"])
            self.check(
                case,
                "NaN moments load as Megatron's own load leaves them",
                nans and not diff,
                {"differences": diff, "first_moment_bits": firsts},
            )
            if self.rank == 0:
                print(f"nan probe {case.name}: {firsts}", flush=True)
                shutil.rmtree(ckpt, ignore_errors=True)
            torch.distributed.barrier()

    def remainder_probe(self) -> None:
        """Megatron's own dp_zero_gather_scatter load with int16 remainders (no placement)."""
        case = Case("dp_zero_gather_scatter", remainders=True)
        model, gpt, optimizer = build(self.size, case, seed=1)
        train(model, optimizer, self.size, 1, seed=1)
        ckpt = self.root / "probe"
        error = None
        try:
            save(gpt, optimizer, case, ckpt)
            del model, gpt, optimizer
            _free()
            _model2, gpt2, optimizer2 = build(self.size, case, seed=2)
            load(gpt2, optimizer2, case, ckpt)
        except Exception as exc:
            error = f"{type(exc).__name__}: {exc}"[:300]
        self.checks.append(
            {
                "case": case.name,
                "check": "info: Megatron's own load with remainders",
                "ok": True,
                "detail": error,
            }
        )
        if self.rank == 0:
            print(f"INFO {case.name}: Megatron's own load -> {error!r}")
            shutil.rmtree(ckpt, ignore_errors=True)


def _free() -> None:
    gc.collect()
    if DEVICE == "cuda":
        torch.cuda.empty_cache()


def _allocated() -> int:
    return torch.cuda.memory_allocated() if DEVICE == "cuda" else 0


def versions() -> dict[str, Any]:
    _ensure_root_on_path()
    from benchmarks._measure import machine
    from te_ckpt_placement.integrations.megatron import megatron_version

    return {
        **(machine() if DEVICE == "cuda" else {"device": "cpu", "torch": torch.__version__}),
        "megatron_core": megatron_version(),
        "world_size": torch.distributed.get_world_size(),
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--size", choices=sorted(SIZES), default="test")
    parser.add_argument("--cases", default="", help="comma-separated sharding types (default all)")
    parser.add_argument("--workdir", type=Path, default=None, help="checkpoints go here")
    parser.add_argument(
        "--load-repeats",
        type=int,
        default=3,
        help="loads of each checkpoint, the modes taking turns (median in megatron_load_median)",
    )
    parser.add_argument("--device", choices=("cuda", "cpu"), default="cuda", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.load_repeats < 1:
        parser.error(f"--load-repeats must be 1 or more, not {args.load_repeats}")
    global DEVICE
    DEVICE = args.device
    if DEVICE == "cuda" and not torch.cuda.is_available():
        print("megatron_ckpt needs CUDA GPUs, megatron-core 0.19.2 and Transformer Engine")
        return 2
    # Deterministic kernels, so that two resumed runs can be compared bit for bit; torch.empty
    # keeps its usual (unfilled) memory, as in training and for the timings.
    os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
    torch.use_deterministic_algorithms(True, warn_only=True)
    torch.utils.deterministic.fill_uninitialized_memory = False  # type: ignore[attr-defined]
    _ensure_root_on_path()
    import torch.distributed as dist

    init_distributed()
    root = Path(tempfile.mkdtemp(prefix="megatron_ckpt_", dir=args.workdir))
    holder = [str(root)]
    dist.broadcast_object_list(holder, src=0)
    run = Run(args.size, Path(holder[0]), args.load_repeats)
    wanted = {s for s in args.cases.split(",") if s}
    machine = versions() if run.rank == 0 else {}

    def write(done: bool) -> None:
        """Rank 0 writes what it has after every case, so a run cut short still reports."""
        if run.rank != 0:
            return
        ok = done and all(c["ok"] for c in run.checks)
        args.out.parent.mkdir(parents=True, exist_ok=True)
        result = {
            "machine": machine,
            "size": args.size,
            "model": SIZES[args.size].__dict__,
            "records": run.records,
            "checks": run.checks,
            "complete": done,
            "ok": ok,
        }
        args.out.write_text(json.dumps(result, indent=1, default=str))
        if done:
            print(f"wrote {args.out} ({'ok' if ok else 'FAILED'})", flush=True)

    def attempt(name: str, fn: Any) -> None:
        start = time.perf_counter()
        try:
            fn()
        except Exception:
            tb = traceback.format_exc()
            print(tb, file=sys.stderr, flush=True)
            run.checks.append({"case": name, "check": "ran", "ok": False, "detail": tb[-2000:]})
        if run.rank == 0:
            print(f"-- {name}: {time.perf_counter() - start:.1f} s", flush=True)
        write(done=False)

    try:
        for case in cases(run.world):
            if not wanted or case.sharding_type in wanted:
                attempt(case.name, lambda case=case: run.run_case(case))
        if not wanted or "dp_reshardable" in wanted:
            attempt("size probe", run.size_probe)
        if not wanted:
            attempt("NaN probe", run.nan_probe)
        if run.world == 1 and not wanted:
            attempt("probe", run.remainder_probe)
        write(done=True)
    finally:
        if run.rank == 0:
            shutil.rmtree(root, ignore_errors=True)
        dist.destroy_process_group()
    return 0 if all(c["ok"] for c in run.checks) else 1


if __name__ == "__main__":
    sys.exit(main())
