"""Where the shared DCP checks run: the CPU stand-in (CI), or TE's FusedAdam on CUDA (GPU kit).

The check functions of :mod:`.dcp_checks`, :mod:`.dcp_load_checks` and :mod:`.dcp_save_checks`
take a :class:`Backend` argument; the CPU tests pass :data:`CPU` and the GPU tests :data:`CUDA`.
Both build their optimizers from :func:`.storage.storage_kwargs`.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from .standin import make_optimizer
from .storage import BF16, storage_kwargs


@dataclass(frozen=True)
class Backend:
    """A device and how to build a FusedAdam in a storage mode on it."""

    device: str
    make_optimizer: Callable[..., torch.optim.Optimizer]


def te_optimizer(
    params: Any, *, moments: torch.dtype = BF16, master: str = "fp32", lr: float = 1e-2
) -> torch.optim.Optimizer:
    """TE's FusedAdam in a storage mode, with the stand-in's ``make_optimizer`` defaults."""
    from transformer_engine.pytorch.optimizers import FusedAdam

    return FusedAdam(params, lr=lr, **storage_kwargs(moments=moments, master=master))


CPU = Backend("cpu", make_optimizer)
CUDA = Backend("cuda", te_optimizer)
