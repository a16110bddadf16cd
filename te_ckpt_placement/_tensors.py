"""Tensor helpers of torch alone: a DTensor's local tensor, CPU DTensors, layouts and blocks."""

from __future__ import annotations

import itertools
import math
import operator
from collections.abc import Iterator
from typing import Any

import torch
from torch.distributed.tensor import DTensor
from torch.distributed.tensor._dtensor_spec import DTensorSpec, TensorMeta


def local(tensor: Any) -> Any:
    """A DTensor's local tensor; anything else as it is."""
    return tensor._local_tensor if isinstance(tensor, DTensor) else tensor


def identical(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Whether ``a`` and ``b`` are the same elements of the same memory (a copy of one onto the
    other changes nothing)."""
    return (
        a.dtype == b.dtype
        and a.device == b.device
        and a.shape == b.shape
        and a.stride() == b.stride()
        and a.data_ptr() == b.data_ptr()
    )


def to_cpu_dtensor(local: torch.Tensor, like: DTensor) -> DTensor:
    """Wraps a host tensor as a DTensor with ``like``'s mesh, placements, global shape and stride.

    ``DTensor.from_local`` would move a CPU tensor back to a CUDA mesh's device, so this builds
    the spec the way ``from_local`` does and calls the constructor FSDP2's CPU offload uses.
    """
    spec = DTensorSpec(
        like.device_mesh,
        tuple(like.placements),
        tensor_meta=TensorMeta(like.size(), like.stride(), local.dtype),
    )
    return DTensor(local, spec, requires_grad=False)  # type: ignore[call-arg]


def memory_order(t: torch.Tensor) -> tuple[int, ...] | None:
    """The dimension order in which ``t`` is laid out densely, outermost first; None if it is not.

    ``t.permute(order)`` is then contiguous, so its flat index is the memory order.
    """
    order = tuple(sorted(range(t.dim()), key=lambda d: (t.stride(d), t.size(d)), reverse=True))
    return order if t.permute(order).is_contiguous() else None


def may_overlap(t: torch.Tensor) -> bool:
    """Whether two elements of ``t`` may share memory (an expanded tensor's do): False only when
    the strides prove that none does (each stride, smallest first, passes every element the
    smaller ones reach), so writing into ``t`` or into a tensor with its strides is safe."""
    reach = 0  # the largest offset the smaller strides reach
    for stride, size in sorted((abs(s), n) for s, n in zip(t.stride(), t.shape, strict=True)):
        if size <= 1:
            continue
        if stride <= reach:
            return True
        reach += (size - 1) * stride
    return False


def row_blocks(
    shape: tuple[int, ...], limit: int
) -> Iterator[tuple[int, int, tuple[int | slice, ...]]]:
    """Splits a row-major ``shape`` into blocks of at most ``limit`` elements.

    Yields ``(start, count, index)``: ``t[index]`` covers the flat elements ``start`` to
    ``start + count`` of a tensor ``t`` of that shape, in order. Splits are balanced: no sliver
    of a few elements is left at the end.
    """
    if math.prod(shape) == 0:
        return
    if not shape:
        yield 0, 1, ()
        return
    inner = math.prod(shape[1:])
    if inner <= limit:
        rows = shape[0]
        pieces = -(-rows // (limit // inner))
        step = -(-rows // pieces)
        for r in range(0, rows, step):
            end = min(r + step, rows)
            yield r * inner, (end - r) * inner, (slice(r, end),)
        return
    for r in range(shape[0]):
        for start, count, index in row_blocks(shape[1:], limit):
            yield r * inner + start, count, (r, *index)


def te_layout_like(t: torch.Tensor, dtype: torch.dtype | None = None) -> tuple[int, ...]:
    """The strides ``t.to(dtype)`` gives its result (``preserve_format``): row-major ones stay
    as they are; others are computed on meta (size-1 dimensions' strides follow torch's rules)."""
    sizes = (max(int(n), 1) for n in t.shape[:0:-1])
    row_major = tuple(itertools.accumulate(sizes, operator.mul, initial=1))
    if tuple(t.stride()) == row_major[::-1]:
        return row_major[::-1]
    meta = torch.empty_strided(t.shape, t.stride(), dtype=t.dtype, device="meta")
    return tuple(torch.empty_like(meta, dtype=dtype or t.dtype).stride())
