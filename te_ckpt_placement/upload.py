"""The load direction's layout and conversion rules: host tensors converted into device tensors.

The load's pipeline is :class:`.._ring.Uploader`: the export's pinned ring run in reverse, the
host converting chunk k of the checkpoint into a staging slot while the copy stream moves chunk
k-1 to the device, straight into the destination tensor.

The conversions are torch's own host kernels, chosen so that every byte equals what
``dst.copy_(src.float().bfloat16())`` (Transformer Engine's load of a BF16 state) leaves. torch's
CPU FP32-to-BF16 copy has two kernels that round the same way and differ only in NaNs: the
vectorized one, taken when the innermost dimension is contiguous in both tensors, writes 0xFFFF
(on x86; the scalar one writes 0x7FC0). Which one a conversion of the whole tensor takes depends
on its layout, so a chunk converted with the other kernel gets its NaNs rewritten by the right
one. Nothing here knows Transformer Engine.
"""

from __future__ import annotations

import math
from collections.abc import Iterator

import torch

from . import reports

__all__ = [
    "bf16_copy_is_vectorized",
    "may_overlap",
    "memory_order",
    "row_blocks",
    "te_layout_like",
    "write_device",
]


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


def _vectorized(
    out_strides: tuple[int, ...], shape: tuple[int, ...], in_strides: tuple[int, ...]
) -> bool | None:
    """Whether torch's CPU copy between these layouts takes its vectorized FP32<->BF16 kernel.

    TensorIterator orders dimensions by the output's strides, and the reduced-float copy kernel
    (aten/src/ATen/native/cpu/CopyKernel.cpp, ``reduced_float_type_copy``) runs when the
    innermost one is contiguous in both tensors. None for fewer than two elements.
    """
    dims = [d for d, size in enumerate(shape) if size > 1]
    if not dims:
        return None
    inner = min(dims, key=lambda d: out_strides[d])
    return out_strides[inner] == 1 and in_strides[inner] == 1


def te_layout_like(t: torch.Tensor, dtype: torch.dtype | None = None) -> tuple[int, ...]:
    """The strides ``t.to(dtype)`` gives its result (``preserve_format``), computed on meta."""
    meta = torch.empty_strided(t.shape, t.stride(), dtype=t.dtype, device="meta")
    return tuple(torch.empty_like(meta, dtype=dtype or t.dtype).stride())


def bf16_copy_is_vectorized(src: torch.Tensor) -> bool | None:
    """Whether ``src.float().bfloat16()`` on the host converts with the vectorized kernel.

    None for fewer than two elements, where the kernel is not a matter of strides alone.
    """
    if src.numel() < 2:
        return None
    if src.dtype != torch.float32:
        return True  # .float() makes a dense tensor, converted as one contiguous run
    return _vectorized(te_layout_like(src, torch.bfloat16), tuple(src.shape), tuple(src.stride()))


def _bf16_by_kernel(values: torch.Tensor, vectorized: bool) -> torch.Tensor:
    """``values`` (1-D FP32) converted to BF16 by torch's vectorized or its scalar kernel."""
    if vectorized:
        return values.bfloat16()
    n = values.numel()
    spaced = torch.zeros(2 * max(n, 2), dtype=torch.float32)[::2]  # strided: the scalar kernel
    spaced[:n].copy_(values)
    return spaced.bfloat16()[:n]


def _to_bf16(out: torch.Tensor, block: torch.Tensor, whole_vectorized: bool | None) -> None:
    """Converts ``block`` into ``out`` (contiguous BF16) with the bits of the whole conversion."""
    source = block if block.dtype == torch.float32 else block.float()
    out.copy_(source)
    mine = _vectorized(tuple(out.stride()), tuple(source.shape), tuple(source.stride()))
    if mine is None or whole_vectorized is None or mine != whole_vectorized:
        nan = source.isnan()
        if bool(nan.any()):
            fixed = _bf16_by_kernel(source[nan], bool(whole_vectorized))
            out.view(torch.int16)[nan] = fixed.view(torch.int16)


def write_device(dst: torch.Tensor, src: torch.Tensor) -> None:
    """Writes a device-resident ``src`` into ``dst`` as ``dst.copy_(src.float())`` would.

    For a BF16 ``dst`` the bits are ``src.float().bfloat16()``'s: CUDA's cast is elementwise, so
    an FP32 ``src`` on ``dst``'s device is converted by the copy itself, with no temporary. A
    ``src`` on another device is converted there first, as TE's ``_apply_scale`` does.
    """
    if dst.dtype in (torch.bfloat16, torch.float32):
        elsewhere = src.device != dst.device
        if elsewhere or (dst.dtype == torch.bfloat16 and src.dtype != torch.float32):
            if not elsewhere and src.dtype != torch.float32:
                reports.device_temporary(4 * src.numel())
            src = src.float()
        if elsewhere and dst.dtype == torch.bfloat16:
            src = src.bfloat16()
    with torch.no_grad():
        dst.copy_(src)
