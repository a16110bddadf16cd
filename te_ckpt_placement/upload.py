"""The load direction's pipeline: host tensors converted chunk by chunk into live device tensors.

The export streams device storage to the host through a pinned ring (:mod:`.engine`); a load runs
the same ring in reverse. The host converts chunk k of the checkpoint into a pinned staging
buffer while the copy stream moves chunk k-1 to the device, straight into the destination
tensor. A staging buffer is refilled only after the event of its previous host-to-device copy
completed, the copy stream waits for the compute stream before it writes a destination (whose
allocation or last use is queued there), and the compute stream waits for the copy stream before
it reads what was written. The copy stream allocates nothing, and the borrowed stager is
synchronized before it is returned, so no device tensor is freed while a copy still writes it.

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
from contextlib import ExitStack
from typing import Any

import torch

from . import engine, reports

__all__ = [
    "Uploader",
    "bf16_copy_is_vectorized",
    "may_overlap",
    "memory_order",
    "row_blocks",
    "te_layout_like",
    "write_device",
]

#: Staging offsets are aligned to this many bytes (DMA-friendly, and any element size divides it).
ALIGN = 512


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


class Uploader:
    """Streams host tensors into device tensors of one device through a borrowed pinned ring.

    Use as a context manager; leaving it waits for every copy (also on an error path) and makes
    the current stream wait for them. Small writes share a staging buffer, so many small states
    cost one buffer turn, not one each.
    """

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self._exit = ExitStack()
        self._stager: Any = None
        self._slot = -1
        self._offset = 0

    def __enter__(self) -> Uploader:
        self._stager = self._exit.enter_context(engine.lent_stager(self.device))
        reports.staging(self.device, self._stager.nbytes)  # the ring (a load uses no scratch)
        self._offset = self._stager.chunk_bytes  # the first take starts a fresh slot
        return self

    def __exit__(self, *exc: object) -> None:
        # Synchronizes the copy stream (every copy has landed before anything launched after
        # this), then returns the stager; a stream wait after that would only tie the compute
        # stream to the stager's next borrower.
        self._exit.close()

    @property
    def chunk_bytes(self) -> int:
        return int(self._stager.chunk_bytes)

    def fence(self) -> None:
        """Makes the current stream wait for every copy issued so far (before reading them)."""
        if self._stager.stream is not None:
            torch.cuda.current_stream(self.device).wait_stream(self._stager.stream)

    def _take(self, nbytes: int) -> torch.Tensor:
        st = self._stager
        if self._offset + nbytes > st.chunk_bytes:
            self._slot += 1
            st.wait(self._slot)  # the slot's previous host-to-device copies have completed
            self._offset = 0
        buf = st.buffers[self._slot % engine.RING][self._offset : self._offset + nbytes]
        self._offset += -(-nbytes // ALIGN) * ALIGN
        return buf

    def write(self, dst: torch.Tensor, src: torch.Tensor) -> None:
        """Copies the host tensor ``src`` into the dense device tensor ``dst``, chunk by chunk.

        ``dst`` is int16 (``src`` the same), FP32 (``src.float()``'s values) or BF16
        (``src.float().bfloat16()``'s bits, see the module docstring), converted on the host.
        ``src`` may have any strides. Returns once the last chunk is queued.
        """
        order = memory_order(dst)
        if order is None:
            raise ValueError(
                f"cannot stream into a tensor that is not dense (strides {dst.stride()})"
            )
        n = dst.numel()
        if n == 0:
            return
        st = self._stager
        if st.stream is not None:
            # dst's allocation, fill or last use is queued on the current stream.
            st.stream.wait_stream(torch.cuda.current_stream(self.device))
        dense = dst.permute(order)
        flat = dense.view(-1)
        shape = tuple(dense.shape)
        source = src.permute(order)
        size = dst.element_size()
        limit = st.chunk_bytes // size
        bf16 = dst.dtype == torch.bfloat16
        whole = bf16_copy_is_vectorized(src) if bf16 else None
        # Host temporaries: a non-FP32 source is widened to FP32 block by block.
        wide = 4 if bf16 and src.dtype != torch.float32 else 0
        temporary = wide * next(row_blocks(shape, limit))[1] if wide else 0  # largest: the first
        if bf16 and whole is None:
            # One element (0-d included): the whole conversion itself, whichever kernel it takes.
            source = src.float().bfloat16().permute(order)
            bf16, temporary = False, (wide + 2) * n
        recorder = reports.active()
        if recorder is not None:
            recorder.uploaded(n * size, temporary)
        with torch.no_grad():
            for start, count, index in row_blocks(shape, limit):
                buf = self._take(count * size).view(dst.dtype)
                block = source[index]
                out = buf.view(block.shape)
                if bf16:
                    _to_bf16(out, block, whole)
                else:
                    out.copy_(block)
                st.copy_async(self._slot, flat[start : start + count], buf)
