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
4. check the GPU memory of the placed saves and loads against what Megatron itself needs.

``fully_sharded_model_space`` is rejected by megatron-core 0.19.2 itself ("ShardedTensor.
flattened_range is not supported"): the run checks that the placed save fails the same way.

Each save and load is measured: ``peak_extra_gpu_bytes`` is ``torch.cuda.max_memory_allocated``
above the start, ``peak_extra_host_bytes`` the peak RSS growth (sampled every millisecond),
``seconds`` the wall time; ``n_elements`` the local optimizer elements (each rank's own numbers
are in ``per_rank``). Rank 0 writes ``--out``: the records, every check, the machine and the
versions, rewritten after every case (``"complete": true`` once the run has ended). The exit
status is 1 if any check failed. ``tests/test_gpu_megatron.py`` runs it on 1 and 2 GPUs;
``tests/support/megatron_cpu_run.py`` runs it on the CPU.

Usage (repository root, megatron-core 0.19.2 and TE importable):
    python -m torch.distributed.run --standalone --nproc_per_node 2 benchmarks/megatron_ckpt.py \
        --out FILE.json
"""

from __future__ import annotations

import argparse
import datetime
import gc
import json
import os
import re
import shutil
import sys
import tempfile
import time
import traceback
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

ROOT = Path(__file__).resolve().parents[1]
MI = 1 << 20
# GPU bytes a placed save or load may allocate beyond Megatron's own buffers: the metadata
# collectives of dist_checkpointing (pickled objects on the GPU), nothing that scales with N.
SLACK_BYTES = 8 * MI
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


def load(gpt: Any, optimizer: Any, case: Case, ckpt_dir: Path) -> None:
    from megatron.core import dist_checkpointing
    from megatron.core.dist_checkpointing.serialization import get_default_load_sharded_strategy

    model_sd = gpt.sharded_state_dict(metadata=metadata(case))
    state = {
        "model": model_sd,
        "optimizer": optimizer.sharded_state_dict(
            model_sd, is_loading=True, metadata=metadata(case)
        ),
    }
    loaded = dist_checkpointing.load(
        state,
        str(ckpt_dir),
        sharded_strategy=get_default_load_sharded_strategy(str(ckpt_dir)),
    )
    # dist_checkpointing has already read the parameters in place; this is Megatron-LM's call.
    missing, unexpected = gpt.load_state_dict(loaded["model"], strict=False)
    assert not unexpected and all(k.endswith("_extra_state") for k in missing), missing
    optimizer.load_state_dict(loaded["optimizer"])


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


# --- the run ----------------------------------------------------------------------------------


class Run:
    def __init__(self, size_name: str, root: Path) -> None:
        import torch.distributed as dist

        self.size = SIZES[size_name]
        self.root = root
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

    def measure(self, op: str, case: Case, mode: str, n: int, fn: Any) -> dict[str, Any]:
        import torch.distributed as dist

        _ensure_root_on_path()
        from benchmarks.export_memory import measured

        result: dict[str, Any] = {}
        dist.barrier()
        with measured(result, cuda=DEVICE == "cuda"):
            fn()
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
        return result

    def run_case(self, case: Case) -> None:
        import torch.distributed as dist

        from te_ckpt_placement import export_placement
        from te_ckpt_placement.integrations.megatron import place_optimizer

        size, base = self.size, self.root / case.name.replace("/", "-")
        model, gpt, optimizer = build(size, case, seed=1)
        train(model, optimizer, size, size.train_steps, seed=1)
        n = local_elements(optimizer)
        dirs = {mode: base / mode for mode in ("te_default", "placement_cpu")}

        if case.sharding_type == "fully_sharded_model_space":
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
                errors["te_default"] is not None
                and errors["te_default"] == errors["placement_cpu"],
                errors,
            )
            return

        saved = snapshot(gpt, optimizer)
        member = distributed_optimizer(optimizer)
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
        self._check_save_memory(case, member, results, n)

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
        del model, gpt, optimizer, member
        _free()

        after: dict[str, dict[str, torch.Tensor]] = {}
        trained: dict[str, dict[str, torch.Tensor]] = {}
        for mode, ckpt in dirs.items():
            model, gpt, optimizer = build(size, case, seed=2)
            if mode == "placement_cpu":
                place_optimizer(optimizer)
            before = _allocated()
            results[f"load_{mode}"] = self.measure(
                "megatron_load",
                case,
                mode,
                n,
                lambda ckpt=ckpt, gpt=gpt, optimizer=optimizer: load(gpt, optimizer, case, ckpt),
            )
            grown = _allocated() - before
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

        diff = differences(after["placement_cpu"], after["te_default"])
        self.check(case, "loaded states and params equal Megatron's load", not diff, diff)
        if case.moments == torch.bfloat16:
            # BF16 moments, FP32 masters and int16 remainders survive a save/load exactly.
            diff = differences(after["placement_cpu"], saved)
            self.check(case, "loaded states equal the saved ones", not diff, diff)
        diff = differences(trained["placement_cpu"], trained["te_default"])
        self.check(case, f"{size.resume_steps} steps after resume equal Megatron's", not diff, diff)
        if self.rank == 0:
            shutil.rmtree(base, ignore_errors=True)
        dist.barrier()

    def _check_save_memory(self, case: Case, member: Any, results: dict[str, Any], n: int) -> None:
        placed = results["placement_cpu"]["peak_extra_gpu_bytes"]
        default = results["te_default"]["peak_extra_gpu_bytes"]
        if case.sharding_type == "dp_reshardable":
            bound = SLACK_BYTES
            removed = default - placed
            self.memory_check(
                case,
                "save: Megatron's FP32 copies (8 B/element) are gone",
                removed >= 0.9 * 8 * n,
                {"default": default, "placed": placed, "8N": 8 * n},
            )
        else:
            # Megatron's own gather buffers (L1360-1376): per bucket, the send tensor on the GPU
            # and DP receive tensors, FP32.
            world = member.data_parallel_group.size()
            bucket = max(b.grad_data.numel() for buf in member.buffers for b in buf.buckets)
            bound = (world + 1) * (bucket // world) * 4 + SLACK_BYTES
        self.memory_check(
            case,
            "save: placed peak GPU within bound",
            placed <= bound,
            {"placed": placed, "bound": bound, "default": default},
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
    from benchmarks.export_memory import machine
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
    parser.add_argument("--device", choices=("cuda", "cpu"), default="cuda", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
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
    run = Run(args.size, Path(holder[0]))
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
