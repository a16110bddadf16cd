"""Stand-ins for the Megatron-Core names that the copied DistributedOptimizer methods use.

``tests/support/megatron_verbatim.py`` holds megatron-core 0.19.2's own ``DistributedOptimizer``
checkpoint methods, byte for byte; they look these names up in their module at run time. Each one
here keeps the part of Megatron's behaviour those methods rely on (megatron-core 0.19.2 paths):

- ``dist_checkpointing/mapping.py``: ``ShardedTensor`` (L51-340: the dataclass fields, in order,
  and the checks of ``validate_metadata_integrity``, L96-135, which reject any
  ``flattened_range``), ``ShardedObject`` (L359),
  ``LocalNonpersistentObject`` (L342), ``ShardedTensorFactory`` (L437, only for ``isinstance``);
- ``dist_checkpointing/utils.py`` L86 ``extract_sharded_tensors_and_factories`` and
  ``dist_checkpointing/dict_utils.py`` L166 ``nested_values``;
- ``optimizer/optimizer.py`` L139 ``param_group_identifier_keys``;
- ``optimizer/distrib_optimizer.py`` L19-33: the TE flags as they are where TE is installed.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

import torch

HAVE_APEX_OR_TE = True
USING_TE_OPTIMIZER = True
USING_APEX_OPTIMIZER = False

KEEP_VARS_HINT = " Make sure state dict contains original torch.nn.Parameters."

param_group_identifier_keys = (
    "end_wd",
    "max_lr",
    "min_lr",
    "optimizer",
    "start_wd",
    "wd_mult",
    "lr_mult",
    "is_expert_parallel",
    "is_decoupled_lr",
)

ShardedStateDict = dict

logger = logging.getLogger("tests.support.megatron_verbatim")


def log_single_rank(logger_: logging.Logger, level: int, msg: str) -> None:
    logger_.log(level, msg)


class CheckpointingException(Exception):  # noqa: N818 - Megatron's name
    """``dist_checkpointing/core.py``'s exception."""


class HybridDeviceOptimizer(torch.optim.Optimizer):
    """Never instantiated here: the copied methods only test ``isinstance`` against it."""


@dataclass
class ShardedTensor:
    key: str
    data: torch.Tensor | None = field(repr=False)
    dtype: torch.dtype
    local_shape: tuple[int, ...]
    global_shape: tuple[int, ...]
    global_offset: tuple[int, ...]
    axis_fragmentations: tuple[int, ...] | None
    replica_id: Any = 0
    prepend_axis_num: int = 0
    allow_shape_mismatch: bool = False
    flattened_range: slice | None = None

    def __post_init__(self) -> None:
        self.validate_metadata_integrity()

    def validate_metadata_integrity(self) -> None:
        if self.data is not None:
            if self.data.dtype != self.dtype:
                raise CheckpointingException(
                    f"Data dtype should match `dtype` attribute for {self}"
                )
            if self.flattened_range is None and self.data.shape != self.local_shape:
                raise CheckpointingException(f"Data shape should match `local_shape` for {self}")
        if len(self.global_shape) != len(self.global_offset):
            raise CheckpointingException(f"Global offset dimensions differ for {self}")
        if len(self.local_shape) + self.prepend_axis_num != len(self.global_shape):
            raise CheckpointingException(f"Local shape dimensions differ for {self}")
        if self.flattened_range is not None:
            raise CheckpointingException("ShardedTensor.flattened_range is not supported.")

    @classmethod
    def from_rank_offsets(cls, key: str, data: torch.Tensor, replica_id: Any = 0) -> ShardedTensor:
        """A whole (unsharded) tensor, as Megatron's model state dict has for TP = PP = 1."""
        shape = tuple(data.shape)
        return cls(key, data, data.dtype, shape, shape, (0,) * len(shape), None, replica_id)


@dataclass
class ShardedObject:
    key: str
    data: object
    global_shape: tuple[int, ...]
    global_offset: tuple[int, ...]
    replica_id: Any = 0


class LocalNonpersistentObject:
    def __init__(self, obj: Any) -> None:
        self.obj = obj

    def unwrap(self) -> Any:
        return self.obj


class ShardedTensorFactory:
    """Never instantiated here."""


def _extract(x: Any, predicate: Callable[[Any], bool]) -> tuple[Any, Any]:
    if isinstance(x, dict):
        matching, other = {}, {}
        for k, v in x.items():
            if isinstance(v, (dict, list)):
                m, o = _extract(v, predicate)
                if m:
                    matching[k] = m
                if o:
                    other[k] = o
            elif predicate(v):
                matching[k] = v
            else:
                other[k] = v
        return matching, other
    matching_list, other_list = [], []
    for v in x:
        (matching_list if predicate(v) else other_list).append(v)
    return matching_list, other_list


def extract_sharded_tensors_and_factories(sharded_state_dict: Any) -> tuple[Any, Any]:
    return _extract(
        sharded_state_dict, lambda v: isinstance(v, (ShardedTensor, ShardedTensorFactory))
    )


def nested_values(x: Any) -> Iterator[Any]:
    for v in x.values() if isinstance(x, dict) else x:
        if isinstance(v, (dict, list)):
            yield from nested_values(v)
        else:
            yield v
