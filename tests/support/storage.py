"""TE FusedAdam's storage modes, named the one way every test names them.

A storage mode is the moments' dtype (``exp_avg``; ``exp_avg_sq`` the same unless given) and the
master weights' name: ``"none"``, ``"fp32"``, ``"fp16"`` or ``"remainder"`` (FP32 masters kept as
int16 remainders of BF16 params). :func:`storage_kwargs` maps it to the constructor arguments of
TE's ``FusedAdam``, which the CPU stand-in takes too, so the CPU and the GPU tests build their
optimizers from the same mapping.
"""

from __future__ import annotations

from typing import Any

import torch

BF16, FP16, FP32, FP8 = torch.bfloat16, torch.float16, torch.float32, torch.uint8

#: The masters' names: no masters, FP32, FP16, or FP32 as int16 remainders of BF16 params.
MASTERS = ("none", "fp32", "fp16", "remainder")


def storage_kwargs(
    *, moments: torch.dtype, master: str, exp_avg_sq: torch.dtype | None = None
) -> dict[str, Any]:
    """TE FusedAdam's constructor arguments for a storage mode (the stand-in takes the same)."""
    if master not in MASTERS:
        raise ValueError(f"unknown master {master!r}: valid values are {MASTERS}")
    return {
        "master_weights": master != "none",
        "master_weight_dtype": FP16 if master == "fp16" else FP32,
        "exp_avg_dtype": moments,
        "exp_avg_sq_dtype": moments if exp_avg_sq is None else exp_avg_sq,
        "store_param_remainders": master == "remainder",
    }
