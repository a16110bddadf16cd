"""The staging ring: pinned host slots and a copy stream for one device, lent to one user at a time.

:class:`Ring` is the one class of the package that owns a CUDA copy stream; slots and their size
are parameters. Its users:

- exports (:func:`stream_into`, device to host): chunk k+1 is copied into a slot while the host
  converts chunk k, ``RING - 1`` chunks in flight, a slot refilled only after its copy was waited
  for;
- loads (:class:`._upload.Uploader`, host to device): the host converts into a slot, the copy stream
  uploads it into the live tensor;
- the DCP load planner (:class:`SlotLender`): slots lent to the reader from ``resolve_tensor``
  to ``commit_tensor``, each upload fenced on the current stream;
- the raw snapshot (``lend(device, slots=0)``): the stream only, copies straight into the
  snapshot's own buffers.

On host devices (the CPU stand-in) the same code runs with pageable slots, synchronous copies and
counting events. Rings are pooled by (device, slot bytes, slots) and lent through an
interrupt-safe lease (:class:`_Lease`); ``lend(..., keep=False)`` makes a ring that is let go on
return.
"""

from __future__ import annotations

import math
import threading
import time
import weakref
from typing import Any

import torch

from . import _pool, _workers
from . import _reports as reports
from ._convert import Convert

#: Bytes of raw state moved per chunk, and how many chunks are in flight.
CHUNK_BYTES = 16 << 20
RING = 3

#: Staging offsets of the load are aligned to this many bytes (DMA-friendly, and any element size
#: divides it).
ALIGN = 512


class HostScratch:
    """A ring's host work buffer (:class:`._convert.Scratch`), grown to the largest request and
    reused after that."""

    def __init__(self) -> None:
        self._buffer: torch.Tensor | None = None

    def get(self, numel: int, dtype: torch.dtype) -> torch.Tensor:
        nbytes = numel * dtype.itemsize
        if self._buffer is None or self._buffer.numel() < nbytes:
            self._buffer = None  # the old one is freed before the larger one is made
            self._buffer = torch.empty(nbytes, dtype=torch.uint8)
        return self._buffer[:nbytes].view(dtype)

    @property
    def nbytes(self) -> int:
        return 0 if self._buffer is None else self._buffer.numel()


class HostEvent:
    """A slot's event on a host device: copies there complete at once, so it only counts."""

    def __init__(self) -> None:
        self.recorded = 0  # copies recorded
        self.waited = 0  # how many of them were waited for

    def record(self) -> None:
        self.recorded += 1

    def synchronize(self) -> None:
        self.waited = self.recorded


class Ring:
    """Pinned host slots and a copy stream for one device (pageable slots, no stream on a host).

    ``scratch`` is the conversions' host work buffer (E4M3's 16-bit patterns), allocated on first
    use; ``wait_s`` adds up the time spent in :meth:`wait`.
    """

    def __init__(self, device: torch.device, slot_bytes: int, slots: int) -> None:
        self.device = device
        self.slot_bytes = slot_bytes
        self.slots = slots
        cuda = device.type == "cuda"
        self.stream = torch.cuda.Stream(device) if cuda else None
        self.buffers = [
            torch.empty(slot_bytes, dtype=torch.uint8, pin_memory=cuda) for _ in range(slots)
        ]
        self.events: list[Any] = [torch.cuda.Event() if cuda else HostEvent() for _ in range(slots)]
        self.scratch = HostScratch()
        self.wait_s = 0.0
        # The lease this ring is lent to (a weak reference), or None while it is free.
        self.lessee: weakref.ref[_Lease] | None = None

    def slot(self, i: int) -> torch.Tensor:
        """Slot ``i % slots``, its bytes as uint8."""
        return self.buffers[i % self.slots]

    def copy(self, i: int | None, dst: torch.Tensor, src: torch.Tensor) -> None:
        """``dst.copy_(src)`` on the copy stream (synchronous on a host), recording event ``i``.

        ``i`` None records no event (copies into memory the ring does not own).
        """
        self._copies(i, [(dst, src)])

    def copy_many(self, i: int, pairs: list[tuple[torch.Tensor, torch.Tensor]]) -> None:
        """:meth:`copy` of every ``(dst, src)``, all from slot ``i``, recording its event once."""
        self._copies(i, pairs)

    def _copies(self, i: int | None, pairs: list[tuple[torch.Tensor, torch.Tensor]]) -> None:
        if self.stream is None:
            for dst, src in pairs:
                dst.copy_(src)
            if i is not None:
                self.events[i % self.slots].record()
            return
        with torch.cuda.stream(self.stream):
            for dst, src in pairs:
                dst.copy_(src, non_blocking=True)
            if i is not None:
                self.events[i % self.slots].record(self.stream)

    def wait(self, i: int) -> None:
        """Waits until the copy last recorded on slot ``i`` has completed."""
        start = time.perf_counter()
        self.events[i % self.slots].synchronize()
        waited = time.perf_counter() - start
        self.wait_s += waited
        reports.waited(waited)

    def after_current(self) -> None:
        """Makes the copy stream wait for what the current stream has queued."""
        if self.stream is not None:
            self.stream.wait_stream(torch.cuda.current_stream(self.device))

    def fence(self, i: int | None = None) -> None:
        """Makes the current stream wait for the copy stream (``i``: for slot ``i``'s event)."""
        if self.stream is None:
            return
        current = torch.cuda.current_stream(self.device)
        if i is None:
            current.wait_stream(self.stream)
        else:
            current.wait_event(self.events[i % self.slots])

    def synchronize(self) -> None:
        """Waits for every copy issued on the ring."""
        if self.stream is not None:
            self.stream.synchronize()
        else:
            for event in self.events:
                event.synchronize()

    @property
    def lent(self) -> bool:
        return self.lessee is not None and self.lessee() is not None

    @property
    def nbytes(self) -> int:
        return sum(b.numel() for b in self.buffers)

    def let_go(self) -> None:
        """Frees the slots (after :meth:`synchronize`)."""
        self.buffers = []


class _Rings:
    """Every ring, pooled ones by (device, slot bytes, slots) and unpooled ones while lent."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.pooled: dict[tuple[torch.device, int, int], list[Ring]] = {}
        # Rings lent with keep=False: each lives as long as its borrower holds it.
        self.unpooled: weakref.WeakSet[Ring] = weakref.WeakSet()
        _pool.register(self)

    def all(self) -> list[Ring]:
        with self.lock:
            return [r for rings in self.pooled.values() for r in rings] + list(self.unpooled)

    def nbytes_of(self, *, pinned: bool | None = None) -> int:
        if pinned is False:
            return 0  # ring slots count as pinned (see _pool.held_bytes)
        return sum(r.nbytes for r in self.all())

    def release(self) -> None:
        with self.lock:
            for rings in self.pooled.values():
                for ring in [r for r in rings if not r.lent]:
                    ring.synchronize()  # nothing in flight into memory about to be freed
                    rings.remove(ring)


_rings = _Rings()


class _Lease:
    """One borrower's claim on a ring, made safe against asynchronous exceptions.

    A KeyboardInterrupt can arrive after any call returns. The lease is therefore set up so that
    no such point separates a ring's change of hands from what undoes it: :meth:`take` records
    the ring in the lease before marking it lent, and the borrower's ``finally`` frees it with
    attribute loads, an ``is`` and a store, no call before the store. A lease that dies without
    giving back frees its ring too, since rings hold only a weak reference to it.
    """

    __slots__ = ("__weakref__", "ref", "ring")

    def __init__(self) -> None:
        self.ring: Ring | None = None
        self.ref = weakref.ref(self)  # what a lent ring holds, and the caller compares with

    def take(self, device: torch.device, slot_bytes: int, slots: int, keep: bool = True) -> Ring:
        key = (device, slot_bytes, slots)
        if keep:
            with _rings.lock:
                for ring in _rings.pooled.get(key, ()):
                    if not ring.lent:
                        self.ring = ring
                        ring.lessee = self.ref
                        break
        if self.ring is None:
            new = Ring(device, slot_bytes, slots)
            self.ring = new
            new.lessee = self.ref
            with _rings.lock:
                if keep:
                    _rings.pooled.setdefault(key, []).append(new)
                else:
                    _rings.unpooled.add(new)
        # Copies of an interrupted previous lessee may still be in flight into the ring.
        self.ring.synchronize()
        return self.ring


class lend:  # noqa: N801 - used like a function, as contextlib's helpers are
    """Lends a ring of ``device`` for a ``with`` block, as :class:`_Lease` does.

    ``slot_bytes`` and ``slots`` default to :data:`CHUNK_BYTES` and :data:`RING`. On exit every
    copy issued through the ring has completed, and it is free again (``keep=False``: its slots
    are let go); a block that dies without exiting frees it with its lease.
    """

    __slots__ = ("device", "keep", "lease", "slot_bytes", "slots")

    def __init__(
        self,
        device: torch.device,
        *,
        slot_bytes: int | None = None,
        slots: int | None = None,
        keep: bool = True,
    ) -> None:
        self.device = device
        self.slot_bytes = CHUNK_BYTES if slot_bytes is None else slot_bytes
        self.slots = RING if slots is None else slots
        self.keep = keep
        self.lease = _Lease()

    def __enter__(self) -> Ring:
        return self.lease.take(self.device, self.slot_bytes, self.slots, self.keep)

    def __exit__(self, *exc: object) -> None:
        ring = self.lease.ring
        if ring is not None and ring.lessee is self.lease.ref:
            try:
                ring.synchronize()  # no copy outlives the block that issued it
            finally:
                ring.lessee = None
                if not self.keep:
                    ring.let_go()
                    with _rings.lock:
                        _rings.unpooled.discard(ring)


def in_use() -> int:
    """How many pooled rings are lent out right now (0 between exports)."""
    with _rings.lock:
        return sum(r.lent for rings in _rings.pooled.values() for r in rings)


def release_idle() -> None:
    """Releases the idle pooled rings (the next borrower allocates them again)."""
    _rings.release()


def pipeline_slots() -> int:
    """:data:`RING`, checked: the export and load pipelines fill one slot while another copies."""
    if not isinstance(RING, int) or RING < 2:
        raise ValueError(
            f"te_ckpt_placement._ring.RING = {RING!r}: the staging ring needs at least 2 slots "
            "(one is converted while the next is copied); set it to an integer >= 2"
        )
    return RING


def stream_into(src: torch.Tensor, out: torch.Tensor, convert: Convert) -> None:
    """Moves ``src`` (contiguous) into the host tensor ``out`` chunk by chunk.

    Chunks k+1 and k+2 are copied to pinned memory on a side stream while the host converts
    chunk k into ``out``, on the host workers' team where there is one (:mod:`._workers`),
    with chunk k+1's conversion handed over before chunk k's is waited for; the device never
    allocates anything.
    """
    flat_src, flat_out = src.reshape(-1), out.view(-1)
    n = flat_src.numel()
    slots = pipeline_slots()
    lease, complete = _Lease(), False
    try:
        st = lease.take(src.device, CHUNK_BYTES, slots)
        depth = st.slots
        step = max(1, st.slot_bytes // src.element_size())
        bounds = [(a, min(a + step, n)) for a in range(0, n, step)]
        # Pending work on the compute stream (a step, a conversion) finishes before we read.
        st.after_current()

        def issue(i: int) -> torch.Tensor:
            a, b = bounds[i]
            buf = st.slot(i)[: (b - a) * src.element_size()].view(src.dtype)
            st.copy(i, buf, flat_src[a:b])
            return buf

        staged = [issue(i) for i in range(min(depth - 1, len(bounds)))]
        with _workers.Tasks() as tasks:  # every conversion has ended before the ring goes back
            converted: Any = None  # chunk i-1's conversion
            for i, (a, b) in enumerate(bounds):
                st.wait(i)
                converting = tasks.submit(
                    convert, staged[i], flat_out[a:b], st.scratch, elements=b - a
                )
                staged[i] = None  # type: ignore[call-overload]
                if converted is not None:
                    converted()  # chunk i-1's slot is free again
                converted = converting
                if i + depth - 1 < len(bounds):
                    staged.append(issue(i + depth - 1))  # into chunk i-1's slot
        complete = True  # every copy was waited for
        reports.staging(st.device, st.nbytes + st.scratch.nbytes)
    finally:
        # Give the ring back before anything that can raise (see _Lease).
        ring = lease.ring
        if ring is not None and ring.lessee is lease.ref:
            ring.lessee = None
            if not complete:
                # No copy outlives a failed export; the next borrower synchronizes too, in case
                # this is interrupted.
                ring.synchronize()


class SlotLender:
    """The DCP load planner's ring for one device: slots lent to the reader, then uploaded.

    :meth:`take` lends a slot for one item (after the slot's previous upload completed; None
    when every slot is lent), :meth:`upload` queues its copy into the live region and records the
    slot's event. The copy stream first waits for the current stream (where the live state was
    made and last used), and the current stream then waits for the copy, so anything launched
    after it, also after a failed load, sees the data. The copy stream allocates nothing.
    :meth:`close` synchronizes every copy before the slots are let go (the ring is not kept:
    ``lend(..., keep=False)``).

    Args:
        device: The live states' device.
        slot_bytes: Bytes of each slot (the largest item it takes).
        slots: How many slots: the reader fills one while the previous one uploads.
        view_as: The tensor subclass a slot is handed to the reader as.
    """

    def __init__(
        self,
        device: torch.device,
        *,
        slot_bytes: int,
        slots: int = 2,
        view_as: type[torch.Tensor] = torch.Tensor,
    ) -> None:
        self.device = device
        self._view_as = view_as
        self._lend = lend(device, slot_bytes=slot_bytes, slots=slots, keep=False)
        self._ring: Ring = self._lend.__enter__()
        self.queued = [False] * slots  # an upload from the slot may be in flight
        self.lent = [False] * slots  # handed to the reader, not committed yet
        self._turn = 0

    @property
    def slots(self) -> int:
        return len(self.queued)

    @property
    def nbytes(self) -> int:
        """Host bytes of the slots (0 once closed)."""
        return self._ring.nbytes

    @property
    def wait_s(self) -> float:
        """Seconds spent waiting for uploads (a slot's previous one, and the last ones)."""
        return self._ring.wait_s

    @property
    def events(self) -> list[Any]:
        return self._ring.events

    def take(self) -> int | None:
        """A free slot, once its previous upload completed; None if all are lent."""
        for k in range(self.slots):
            slot = (self._turn + k) % self.slots
            if not self.lent[slot]:
                break
        else:
            return None
        if self.queued[slot]:
            self._ring.wait(slot)
            self.queued[slot] = False
        self._turn = slot + 1
        self.lent[slot] = True
        return slot

    def view(self, slot: int, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
        nbytes = math.prod(shape) * dtype.itemsize
        buffer = self._ring.slot(slot)[:nbytes].view(dtype).view(shape)
        return buffer.as_subclass(self._view_as)

    def upload(self, slot: int, dst: torch.Tensor, src: torch.Tensor) -> None:
        """Queues ``dst.copy_(src)`` (same dtype and shape, both contiguous) from ``slot``."""
        src = src.as_subclass(torch.Tensor)
        self.lent[slot] = False
        ring = self._ring
        ring.after_current()  # dst's allocation or last use is queued there
        with torch.no_grad():
            ring.copy(slot, dst, src)
        ring.fence(slot)
        self.queued[slot] = True

    def close(self) -> None:
        """Waits for every upload, then lets the slots go (also on an error path)."""
        start = time.perf_counter()
        try:
            self._lend.__exit__(None, None, None)  # synchronizes, then lets the slots go
        finally:
            self._ring.wait_s += time.perf_counter() - start
            self.queued = [False] * self.slots
            self.lent = [False] * self.slots
