"""A Megatron-Core ``DistributedOptimizer`` on the CPU, for the Megatron integration's tests.

:func:`build` lays out bf16 model parameters in a grad buffer the way Megatron-Core 0.19.2 does
for TP = PP = 1 (``optimizer/param_layout.py``: each parameter starts on a 64-element boundary,
each bucket ends on a multiple of ``lcm(DP, 128)``), derives this DP rank's ranges as
``DistributedOptimizer._build_model_gbuf_range`` does (``distrib_optimizer.py`` L134-257), and
gives TE's ``FusedAdam`` (the CPU stand-in of ``tests/support/standin.py``) the parameter shards
that ``_build_model_and_main_param_groups`` gives it (L347-504).

The optimizer's class is either :class:`StandInDistributedOptimizer` (megatron-core 0.19.2's own
checkpoint methods, copied in ``tests/support/megatron_verbatim.py``) or, where megatron-core
imports, Megatron's real ``DistributedOptimizer``, built without its ``__init__`` (which needs
CUDA, DDP buffers and process groups) but with the same attributes. The tests run on both
flavours where both exist; ``tests/test_gpu_megatron.py`` also compares the copied source with
the real one.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, field
from types import ModuleType, SimpleNamespace
from typing import Any

import torch

from . import megatron_support
from .megatron_verbatim import VerbatimDistributedOptimizer
from .standin import StandInFusedAdam
from .storage import storage_kwargs

# The Megatron methods that megatron_verbatim.py copies (all from DistributedOptimizer).
VERBATIM_METHODS = (
    "optimizer_state_keys",
    "_get_state_key_dtype",
    "state_dict",
    "load_state_dict",
    "_get_main_param_and_optimizer_states",
    "_set_main_param_and_optimizer_states",
    "get_parameter_state_dp_reshardable",
    "get_parameter_state_dp_zero",
    "sharded_state_dict",
    "sharded_param_state_dp_reshardable",
    "sharded_param_state_fs_model_space",
    "load_parameter_state_from_dp_reshardable",
    "load_parameter_state_from_fs_model_space",
)


class StandInDistributedOptimizer(VerbatimDistributedOptimizer):
    """Megatron's checkpoint methods; :func:`build` sets the attributes they read."""

    def sharded_param_state_dp_zero(self, *args: Any, **kwargs: Any) -> Any:
        raise NotImplementedError("the stand-in has no dist_checkpointing ShardedObject gather")

    def sharded_param_state_fully_reshardable(self, *args: Any, **kwargs: Any) -> Any:
        raise NotImplementedError("the stand-in has no dist_checkpointing ShardedObject gather")


class StandInChainedOptimizer:
    """``ChainedOptimizer`` (optimizer.py L1419-1590): its checkpoint calls go to each member."""

    def __init__(self, chained_optimizers: list[Any]) -> None:
        self.chained_optimizers = chained_optimizers

    def state_dict(self) -> Any:
        if len(self.chained_optimizers) == 1:
            return self.chained_optimizers[0].state_dict()
        return [optimizer.state_dict() for optimizer in self.chained_optimizers]

    def sharded_state_dict(
        self, model_sharded_state_dict: Any, is_loading: bool = False, **kw: Any
    ) -> Any:
        if len(self.chained_optimizers) == 1:
            return self.chained_optimizers[0].sharded_state_dict(
                model_sharded_state_dict, is_loading, **kw
            )
        return {
            i: optimizer.sharded_state_dict(model_sharded_state_dict, is_loading, **kw)
            for i, optimizer in enumerate(self.chained_optimizers)
        }

    def load_state_dict(self, state_dict: Any) -> None:
        if len(self.chained_optimizers) == 1:
            self.chained_optimizers[0].load_state_dict(state_dict)
            return
        for optimizer, state in zip(self.chained_optimizers, state_dict, strict=True):
            optimizer.load_state_dict(state)


class FakeGroup:
    """A data-parallel group for code that only asks for rank and size."""

    def __init__(self, rank: int = 0, size: int = 1) -> None:
        self._rank, self._size = rank, size

    def rank(self) -> int:
        return self._rank

    def size(self) -> int:
        return self._size


@dataclass
class Range:
    """``distrib_optimizer.Range`` (L78-111)."""

    start: int
    end: int

    @property
    def size(self) -> int:
        return self.end - self.start

    def normalize(self, start: int = 0) -> Range:
        return Range(start, start + self.size)

    def __len__(self) -> int:
        return self.end - self.start


@dataclass
class Bucket:
    grad_data: torch.Tensor
    numel_unpadded: int
    offset: int


@dataclass
class Buffer:
    param_dtype: torch.dtype
    grad_dtype: torch.dtype
    buckets: list[Bucket]
    numel_unpadded: int
    param_index_map: dict[torch.Tensor, tuple[int, int, int]]
    data_parallel_group: Any
    params: list[torch.Tensor] = field(default_factory=list)
    num_optimizer_shards: int | None = None


def _pad(n: int, divisor: int) -> int:
    return int(math.ceil(n / divisor) * divisor)


def lay_out(params: list[torch.Tensor], *, bucket_numel: int, dp_size: int, group: Any) -> Buffer:
    """Megatron's grad-buffer layout (param_layout.py L24-42, param_and_grad_buffer.py L960-995).

    Parameters fill a bucket until it holds at least ``bucket_numel`` elements.
    """
    index_map: dict[torch.Tensor, tuple[int, int, int]] = {}
    buckets: list[tuple[int, int, int]] = []  # (offset, unpadded end, padded end)
    start = bucket_start = 0
    for param in params:
        start = _pad(start, 64)
        end = start + param.numel()
        index_map[param] = (start, end, len(buckets))
        start = end
        if end - bucket_start >= bucket_numel:
            padded = _pad(end, math.lcm(dp_size, 128))
            buckets.append((bucket_start, end, padded))
            start = bucket_start = padded
    if bucket_start != start:
        buckets.append((bucket_start, start, _pad(start, math.lcm(dp_size, 128))))
    return Buffer(
        param_dtype=torch.bfloat16,
        grad_dtype=torch.float32,
        buckets=[Bucket(torch.empty(p - o), e - o, o) for o, e, p in buckets],
        numel_unpadded=sum(e - o for o, e, _ in buckets),
        param_index_map=index_map,
        data_parallel_group=group,
        params=list(params),
    )


def gbuf_range_map(buffer: Buffer, range_cls: Callable[[int, int], Any] = Range) -> dict:
    """``_build_gbuf_range_map`` (L134-278) for this rank."""
    rank, world = buffer.data_parallel_group.rank(), buffer.data_parallel_group.size()
    ranges = []
    for bucket in buffer.buckets:
        shard = bucket.grad_data.numel() // world
        world_range = range_cls(rank * shard + bucket.offset, (rank + 1) * shard + bucket.offset)
        param_map = {}
        for param, (p_start, p_end, _) in buffer.param_index_map.items():
            local_start = max(0, p_start - world_range.start)
            local_end = min(world_range.size, p_end - world_range.start)
            if local_end > local_start:
                local = range_cls(local_start, local_end)
                world_param = local.normalize(local_start + world_range.start)
                param_map[param] = {
                    "gbuf_world": world_param,
                    "gbuf_world_in_bucket": range_cls(
                        world_param.start - bucket.offset, world_param.end - bucket.offset
                    ),
                    "gbuf_local": local,
                    "param": local.normalize(max(0, world_range.start - p_start)),
                }
        ranges.append({"param_map": param_map})
    return {(buffer.param_dtype, buffer.grad_dtype): ranges}


@dataclass
class Built:
    optimizer: Any
    params: list[torch.nn.Parameter]
    names: dict[torch.Tensor, str]
    api: ModuleType | SimpleNamespace
    extras: dict[str, Any] = field(default_factory=dict)

    @property
    def inner(self) -> Any:
        return self.optimizer.optimizer

    def model_sharded_state_dict(self) -> dict[str, Any]:
        """What ``model.sharded_state_dict()`` holds for TP = PP = 1: one tensor per parameter."""
        group = self.optimizer.data_parallel_group
        return {
            self.names[p]: self.api.ShardedTensor.from_rank_offsets(
                self.names[p], p, replica_id=(0, 0, group.rank())
            )
            for p in self.params
        }


def megatron_api() -> SimpleNamespace | None:
    """Megatron's own classes and names, or None where megatron-core does not import."""
    try:
        from megatron.core.dist_checkpointing.mapping import (
            LocalNonpersistentObject,
            ShardedObject,
            ShardedTensor,
        )
        from megatron.core.optimizer import distrib_optimizer
    except Exception:  # ImportError, or a broken optional dependency
        return None
    return SimpleNamespace(
        DistributedOptimizer=distrib_optimizer.DistributedOptimizer,
        Range=distrib_optimizer.Range,
        module=distrib_optimizer,
        ShardedTensor=ShardedTensor,
        ShardedObject=ShardedObject,
        LocalNonpersistentObject=LocalNonpersistentObject,
    )


def standin_api() -> SimpleNamespace:
    return SimpleNamespace(
        DistributedOptimizer=StandInDistributedOptimizer,
        Range=Range,
        module=megatron_support,
        ShardedTensor=megatron_support.ShardedTensor,
        ShardedObject=megatron_support.ShardedObject,
        LocalNonpersistentObject=megatron_support.LocalNonpersistentObject,
    )


SIZES = ((96, 40), (300,), (37, 5), (1000,), (64,))


def build(
    api: SimpleNamespace,
    *,
    moments: torch.dtype = torch.bfloat16,
    master: str = "remainder",
    precision_aware: bool = True,
    group: Any = None,
    bucket_numel: int = 1500,
    sizes: tuple[tuple[int, ...], ...] = SIZES,
    seed: int = 0,
    train_steps: int = 2,
) -> Built:
    """A DistributedOptimizer of ``api``'s class over bf16 parameters of ``sizes``, trained.

    ``master`` and ``moments`` set TE's storage (``storage.storage_kwargs``); with
    ``precision_aware=False`` TE keeps FP32 states of Megatron's FP32 main-parameter shards.
    Two parameter groups (weight decay and none), told apart by ``wd_mult`` as Megatron's are.
    """
    group = group if group is not None else FakeGroup()
    gen = torch.Generator().manual_seed(seed)
    params = [
        torch.nn.Parameter((torch.randn(shape, generator=gen) * 0.1).to(torch.bfloat16))
        for shape in sizes
    ]
    names = {p: f"decoder.layers.{i}.weight" for i, p in enumerate(params)}
    buffer = lay_out(params, bucket_numel=bucket_numel, dp_size=group.size(), group=group)
    gbuf_ranges = [gbuf_range_map(buffer, api.Range)]
    param_groups = [
        {"params": params[::2], "wd_mult": 1.0, "weight_decay": 0.01},
        {"params": params[1::2], "wd_mult": 0.0, "weight_decay": 0.0},
    ]
    group_of = {p: g for g, group_ in enumerate(param_groups) for p in group_["params"]}
    index_map: dict[torch.Tensor, tuple[int, int]] = {}
    shards: list[list[torch.Tensor]] = [[] for _ in param_groups]
    for ranges in gbuf_ranges:
        for bucket_ranges in ranges.values():
            for bucket in bucket_ranges:
                for param, range_map in bucket["param_map"].items():
                    g = group_of[param]
                    r = range_map["param"]
                    shard = param.detach().view(-1)[r.start : r.end]
                    if not precision_aware:
                        shard = shard.clone().float()  # Megatron's FP32 main-param shard
                    shards[g].append(shard)
                    index_map[param] = (g, len(shards[g]) - 1)
    inner_groups = [
        {**{k: v for k, v in g.items() if k != "params"}, "params": s}
        for g, s in zip(param_groups, shards, strict=True)
    ]
    if precision_aware:
        inner = StandInFusedAdam(
            inner_groups, lr=1e-2, **storage_kwargs(moments=moments, master=master)
        )
    else:
        inner = StandInFusedAdam(inner_groups, lr=1e-2)
    optimizer = object.__new__(api.DistributedOptimizer)
    optimizer.__dict__.update(
        optimizer=inner,
        config=SimpleNamespace(
            optimizer="adam",
            use_precision_aware_optimizer_no_fp8_or_ds_fp8=precision_aware,
            store_param_remainders=master == "remainder",
            bf16=True,
            fp16=False,
            main_params_dtype=torch.float32,
            exp_avg_dtype=moments if precision_aware else torch.float32,
            exp_avg_sq_dtype=moments if precision_aware else torch.float32,
            timers=None,
        ),
        ddp_config=SimpleNamespace(use_megatron_fsdp=False),
        grad_scaler=None,
        is_stub_optimizer=False,
        buffers=[buffer],
        gbuf_ranges=gbuf_ranges,
        model_param_group_index_map=index_map,
        per_bucket_numel=[
            {(buffer.param_dtype, buffer.grad_dtype): [b.grad_data.numel() for b in buffer.buckets]}
        ],
        per_bucket_numel_unpadded=[
            {(buffer.param_dtype, buffer.grad_dtype): [b.numel_unpadded for b in buffer.buckets]}
        ],
        data_parallel_group=group,
        data_parallel_group_gloo=group,
        data_parallel_group_idx=0,
        distributed_optimizer_instance_id=0,
    )
    built = Built(optimizer=optimizer, params=params, names=names, api=api)
    train(built, steps=train_steps, seed=seed + 1)
    return built


def train(built: Built, *, steps: int, seed: int) -> None:
    """TE steps on random gradients of every shard (Megatron's own step is not needed here)."""
    gen = torch.Generator().manual_seed(seed)
    inner = built.inner
    for _ in range(steps):
        for group in inner.param_groups:
            for p in group["params"]:
                p.grad = (torch.randn(p.shape, generator=gen) * 1e-2).to(p.dtype)
        inner.step()
        for group in inner.param_groups:
            for p in group["params"]:
                p.grad = None
