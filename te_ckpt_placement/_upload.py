"""The load's host-to-device pipeline: host tensors converted into a lent ring's slots and
uploaded into device tensors (:class:`Uploader`).

The streaming load writes each BF16, FP32 and int16 state from host memory through it
(:mod:`._te_load_write`): TE's rounding to BF16 done on the host, on the host workers' team
where there is one (:mod:`._workers`), the copies on the ring's stream (:mod:`._ring`).
"""

from __future__ import annotations

import functools
from contextlib import ExitStack
from typing import Any

import torch

from . import _convert, _workers
from . import _reports as reports
from ._convert import bf16_copy_is_vectorized
from ._convert import host_copy as _host_copy
from ._convert import to_bf16 as _to_bf16
from ._ring import ALIGN, lend, pipeline_slots
from ._tensors import memory_order, row_blocks


class Uploader:
    """Streams host tensors into device tensors of one device through a lent ring.

    Use as a context manager; leaving it waits for every copy (also on an error path) and makes
    the current stream wait for them. Small writes share a staging slot, so many small states
    cost one slot turn, not one each. A slot is refilled only after its previous copy completed,
    the copy stream waits for the current stream before it writes a destination (whose
    allocation or last use is queued there), and :meth:`fence` makes the current stream wait for
    the copies before it reads them. The copy stream allocates nothing, and the ring is
    synchronized before it is returned, so no device tensor is freed while a copy still writes it.

    BF16 destinations get the bits of TE's ``.bfloat16()`` of the host value; with
    ``round_as_device``, of the same value on ``device`` (the host values stand in for device
    ones, :func:`._convert.device_bf16_nan`).
    """

    def __init__(self, device: torch.device, *, round_as_device: bool = False) -> None:
        self.device = device
        self._nan_bits = _convert.device_bf16_nan(device) if round_as_device else None
        self._exit = ExitStack()
        self._ring: Any = None
        self._slot = -1
        self._offset = 0

    def __enter__(self) -> Uploader:
        self._ring = self._exit.enter_context(lend(self.device, slots=pipeline_slots()))
        reports.staging(self.device, self._ring.nbytes)  # the ring (a load uses no scratch)
        self._offset = self._ring.slot_bytes  # the first take starts a fresh slot
        return self

    def __exit__(self, *exc: object) -> None:
        # Synchronizes the copy stream (every copy has landed before anything launched after
        # this), then returns the ring; a stream wait after that would only tie the compute
        # stream to the ring's next borrower.
        self._exit.close()

    @property
    def chunk_bytes(self) -> int:
        return int(self._ring.slot_bytes)

    def fence(self) -> None:
        """Makes the current stream wait for every copy issued so far (before reading them)."""
        self._ring.fence()

    def _take(self, nbytes: int) -> torch.Tensor:
        ring = self._ring
        if self._offset + nbytes > ring.slot_bytes:
            self._slot += 1
            ring.wait(self._slot)  # the slot's previous host-to-device copies have completed
            self._offset = 0
        buf = ring.slot(self._slot)[self._offset : self._offset + nbytes]
        self._offset += -(-nbytes // ALIGN) * ALIGN
        return buf

    def write(self, dst: torch.Tensor, src: torch.Tensor) -> None:
        """Copies the host tensor ``src`` into the dense device tensor ``dst``, chunk by chunk.

        ``dst`` is int16 (``src`` the same), FP32 (``src.float()``'s values) or BF16
        (``src.float().bfloat16()``'s bits, see :mod:`._convert`), converted on the host.
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
        ring = self._ring
        # dst's allocation, fill or last use is queued on the current stream.
        ring.after_current()
        dense = dst.permute(order)
        flat = dense.view(-1)
        shape = tuple(dense.shape)
        source = src.permute(order)
        size = dst.element_size()
        limit = ring.slot_bytes // size
        bf16 = dst.dtype == torch.bfloat16
        whole = bf16_copy_is_vectorized(src) if bf16 else None
        # Host temporaries: a non-FP32 source is widened to FP32 block by block.
        wide = 4 if bf16 and src.dtype != torch.float32 else 0
        temporary = wide * next(row_blocks(shape, limit))[1] if wide else 0  # largest: the first
        if bf16 and whole is None and self._nan_bits is None:
            # One element (0-d included): the whole conversion itself, whichever kernel it takes.
            source = src.float().bfloat16().permute(order)
            bf16, temporary = False, (wide + 2) * n
        recorder = reports.active()
        if recorder is not None:
            recorder.uploaded(n * size, temporary)
        # Each block is converted into its slot on the host workers' team where there is one,
        # the next block handed over before this one's upload is queued.
        fill = (
            functools.partial(_to_bf16, whole_vectorized=whole, nan_bits=self._nan_bits)
            if bf16
            else _host_copy
        )
        with torch.no_grad(), _workers.Tasks(caller_copies=True) as tasks:
            queued: Any = None  # the previous block: (its conversion, slot, start, count, buf)
            for start, count, index in row_blocks(shape, limit):
                buf = self._take(count * size).view(dst.dtype)
                block = source[index]
                filling = tasks.submit(fill, buf.view(block.shape), block, elements=count)
                if queued is not None:
                    self._upload(flat, *queued)
                queued = (filling, self._slot, start, count, buf)
            if queued is not None:
                self._upload(flat, *queued)

    def fits(self, dst: torch.Tensor) -> bool:
        """Whether :meth:`write_many` takes ``dst``: contiguous and of a size it :meth:`takes`."""
        return dst.is_contiguous() and self.takes(dst.numel(), dst.element_size())

    def takes(self, numel: int, element_size: int) -> bool:
        """Whether :meth:`write_many` takes a contiguous tensor of this size: 2 elements or more,
        and at most 1/:data:`BATCHED_SLOT_SHARE` of a slot (larger ones gain nothing from sharing
        one)."""
        return numel >= 2 and numel * element_size * BATCHED_SLOT_SHARE <= self._ring.slot_bytes

    def write_many(self, pairs: list[tuple[torch.Tensor, torch.Tensor]]) -> None:
        """:meth:`write` of each ``(dst, src)``, every ``dst`` one that :meth:`fits`.

        The writes that share a slot are converted in one task, on the host workers' team where
        there is one, the next slot's handed over before this one's copies are issued, and
        their copies are queued together: many small states cost one hand-over and one event
        per slot, not one each. Each is converted as :meth:`write` converts it (the same
        kernels, so the same bits). Returns once the last copy is queued.
        """
        ring = self._ring
        recorder = reports.active()
        ring.after_current()  # every dst's allocation, fill or last use is queued there
        with torch.no_grad(), _workers.Tasks(caller_copies=True) as tasks:
            queued: Any = None  # the previous slot's: (its conversions, slot, copies)
            batch: list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]] = []
            elements = 0

            def hand_over() -> None:
                """Hands this slot's conversions over, then queues the previous slot's copies."""
                nonlocal queued, batch, elements
                converting = tasks.submit(_fill_all, batch, self._nan_bits, elements=elements)
                if queued is not None:
                    self._upload_all(*queued)
                queued = (converting, self._slot, batch)
                batch, elements = [], 0

            for dst, src in pairs:
                if not self.fits(dst):
                    raise ValueError(f"write_many takes what fits in a slot, not {dst.shape}")
                n, size = dst.numel(), dst.element_size()
                bf16 = dst.dtype == torch.bfloat16
                wide = 4 * n if bf16 and src.dtype != torch.float32 else 0
                if recorder is not None:
                    recorder.uploaded(n * size, wide)
                if batch and self._offset + n * size > ring.slot_bytes:  # a new slot starts
                    hand_over()
                buf = self._take(n * size).view(dst.dtype).view(dst.shape)
                batch.append((buf, src, dst))
                elements += n
            if batch:
                hand_over()
            if queued is not None:
                self._upload_all(*queued)

    def _upload_all(
        self,
        converted: Any,
        slot: int,
        batch: list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]],
    ) -> None:
        converted()  # the slot's conversions have ended
        self._ring.copy_many(slot, [(dst, buf) for buf, _, dst in batch])

    def _upload(
        self,
        flat: torch.Tensor,
        filled: Any,
        slot: int,
        start: int,
        count: int,
        buf: torch.Tensor,
    ) -> None:
        filled()  # the block's conversion into its slot has ended
        self._ring.copy(slot, flat[start : start + count], buf)


#: :meth:`Uploader.write_many` takes states of at most 1/this of a slot.
BATCHED_SLOT_SHARE = 4


def _fill_all(
    batch: list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]], nan_bits: int | None
) -> None:
    """Converts each ``src`` into its slot view ``buf`` as :meth:`Uploader.write` does a whole
    state of one block: BF16 with the bits of ``src.float().bfloat16()`` (or of a device's cast,
    ``nan_bits``), else torch's copy."""
    for buf, src, _ in batch:
        if buf.dtype == torch.bfloat16:
            _to_bf16(buf, src, bf16_copy_is_vectorized(src), nan_bits=nan_bits)
        else:
            buf.copy_(src)
