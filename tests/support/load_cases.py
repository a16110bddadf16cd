"""Checkpoint variants for the load tests (CPU and GPU): odd layouts and special FP32 values."""

from __future__ import annotations

import copy
from typing import Any

import torch

# FP32 bit patterns whose BF16 rounding or FP16/FP8 scaling is easy to get wrong: NaNs with
# payloads and signs (quiet and signalling), infinities, subnormals, signed zeros, round-to-even
# ties, and the largest finite value (rounds to inf in BF16).
SPECIAL_BITS = [
    0x7FC00000,
    0xFFC00000,
    0x7F800001,
    0xFFFFFFFF,
    0x7FBFFFFF,
    0x7F800000,
    0xFF800000,
    0x00000001,
    0x007FFFFF,
    0x80000001,
    0x00400000,
    0x80000000,
    0x00000000,
    0x3F808000,
    0x3F818000,
    0xBF808000,
    0x7F7FFFFF,
    0x00008000,
]

#: Layouts a checkpoint tensor can arrive in: each holds the same values in other strides.
LAYOUTS = ["contiguous", "transposed", "stepped", "sliced", "permuted"]


def restride(t: torch.Tensor, layout: str) -> torch.Tensor:
    """``t``'s values in another memory layout (same device and dtype)."""
    if layout == "contiguous" or t.dim() == 0:
        return t.contiguous()
    if layout == "transposed" and t.dim() >= 2:
        return t.transpose(0, 1).contiguous().transpose(0, 1)
    if layout == "permuted" and t.dim() >= 2:
        order = list(reversed(range(t.dim())))
        return t.permute(order).contiguous().permute(order)
    if layout == "sliced":  # non-dense, innermost dimension contiguous
        out = torch.empty((*t.shape[:-1], t.shape[-1] + 3), dtype=t.dtype, device=t.device)
        view = out[..., : t.shape[-1]]
    else:  # "stepped" (and 1-D transposed/permuted): innermost stride 2
        out = torch.empty((*t.shape[:-1], 2 * t.shape[-1]), dtype=t.dtype, device=t.device)
        view = out[..., ::2]
    view.copy_(t)
    return view


#: Layouts whose elements share memory, as a hand-built checkpoint can hold: the first row
#: expanded over the first dimension (stride 0), and windows of stride 1 in every dimension.
OVERLAPPING = ["expanded", "windows"]


def overlapping(t: torch.Tensor, layout: str) -> torch.Tensor:
    """A tensor of ``t``'s shape, dtype and device whose elements share memory where the shape
    allows it (not for one element or, with ``"windows"``, one dimension)."""
    if layout == "expanded":
        return t.detach()[:1].expand(t.shape) if t.dim() else t.detach()
    if layout == "windows":
        span = sum(n - 1 for n in t.shape) + 1
        base = t.detach().reshape(-1)[:span].clone()
        return base.as_strided(t.shape, [1] * t.dim())
    raise AssertionError(layout)


def with_overlapping_values(
    checkpoint: dict[str, Any], layout: str, device: str | None = None
) -> dict[str, Any]:
    """A copy of a host checkpoint with every state in an :func:`overlapping` layout (on
    ``device``); at least one of them shares memory."""
    out = dict(checkpoint)
    out["state"] = {
        k: {
            name: overlapping(v if device is None else v.to(device), layout)
            for name, v in s.items()
        }
        for k, s in checkpoint["state"].items()
    }
    assert any(
        any(n > 1 and d == 0 for n, d in zip(v.shape, v.stride(), strict=True))
        or (v.dim() > 1 and v.stride() == (1,) * v.dim())
        for states in out["state"].values()
        for v in states.values()
    ), "no value shares memory"
    return out


def densified(checkpoint: dict[str, Any]) -> dict[str, Any]:
    """A copy of ``checkpoint`` with every state a contiguous copy of its values."""
    out = copy.deepcopy(checkpoint)
    out["state"] = {
        k: {name: v.contiguous().clone() for name, v in states.items()}
        for k, states in checkpoint["state"].items()
    }
    return out


def raw_bits(t: torch.Tensor) -> torch.Tensor:
    """The bytes of any tensor, on the CPU (size-1 dimensions with odd strides count as
    contiguous, so ``.contiguous()`` alone does not always allow a byte view)."""
    t = t._local_tensor if hasattr(t, "_local_tensor") else t
    t = t.detach()
    return torch.empty(t.shape, dtype=t.dtype).copy_(t).reshape(-1).view(torch.uint8)


def with_special_values(t: torch.Tensor, offset: int = 0) -> torch.Tensor:
    """A contiguous FP32 copy of ``t`` with :data:`SPECIAL_BITS` spread over its elements."""
    out = t.detach().clone().contiguous()
    flat = out.view(-1).view(torch.int32)
    n = flat.numel()
    if n == 0:
        return out
    for i, pattern in enumerate(SPECIAL_BITS):
        position = (offset + i * 7919) % n
        flat[position] = pattern - (1 << 32) if pattern >= 1 << 31 else pattern
    return out


def vary_checkpoint(
    checkpoint: dict[str, Any], *, layout: str, special: bool, device: str | None = None
) -> dict[str, Any]:
    """A copy of a host checkpoint with every state tensor in ``layout`` (and special values)."""
    from torch.distributed.tensor import DTensor

    out = dict(checkpoint)
    out["state"] = {}
    for key, states in checkpoint["state"].items():
        if not isinstance(states, dict):
            out["state"][key] = states
            continue
        new = {}
        for i, (name, value) in enumerate(states.items()):
            if not isinstance(value, torch.Tensor) or isinstance(value, DTensor):
                new[name] = value
                continue
            v = value.detach()
            if special and v.dtype == torch.float32:
                v = with_special_values(v, offset=i)
            if device is not None:
                v = v.to(device)
            new[name] = restride(v, layout)
        out["state"][key] = new
    return out
