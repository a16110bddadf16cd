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
``dst.copy_(src.float().bfloat16())`` (Transformer Engine's load of a BF16 state) leaves (the
rule lives in :mod:`._convert`). Nothing here knows Transformer Engine.
"""

from __future__ import annotations

from contextlib import ExitStack
from typing import Any

import torch

from . import engine, reports
from ._convert import bf16_copy_is_vectorized, write_device  # write_device: shim, gone in P6
from ._convert import to_bf16 as _to_bf16
from ._tensors import may_overlap, memory_order, row_blocks, te_layout_like  # shims, gone in P6

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
