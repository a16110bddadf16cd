"""The host-buffer pool: host tensors kept and handed out again once nobody holds them.

One allocator (:func:`empty_host`) makes every fresh host buffer the package keeps: pageable
memory advised to use huge pages, or pinned memory for copies from a GPU (large buffers are
anonymous maps registered with ``cudaHostRegister``, the way torch's DCP stager pins its buffers;
torch's pinned allocator would round each one up to a power of two). Shared-memory buffers
(``HostPool.take(shared=True)``, pinned the same way when asked) cross to another process, such
as DCP's async writer, without a copy. One pool class
(:class:`HostPool`) keeps them: the exports' ``reuse_buffers`` outputs (:data:`EXPORTS`) and each
``SnapshotStager``'s buffers. :func:`release_all` frees every pool's buffers and the idle staging
rings; :func:`held_bytes` is the one size query over both.

Uses only APIs that torch 2.11 (the GPU machine's version) and 2.13 share.
"""

from __future__ import annotations

import ctypes
import math
import mmap
import os
import sys
import threading
import warnings
import weakref
from typing import Any, Protocol

import torch

from . import _workers

_HUGE_PAGE = 2 << 20
_MADV_HUGEPAGE = 14
_libc: Any = None
if sys.platform.startswith("linux"):
    try:
        _libc = ctypes.CDLL(None, use_errno=True)
        _libc.madvise.argtypes = (ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int)
    except (OSError, AttributeError):  # pragma: no cover - exotic libc
        _libc = None

#: Ask the kernel for transparent huge pages on fresh host buffers. A first save writes its
#: output into never-touched memory, and with 4 KiB pages the page faults, not PCIe, bound it.
#: Set TE_CKPT_PLACEMENT_HUGEPAGES=0 to keep the system default.
HUGEPAGES = os.environ.get("TE_CKPT_PLACEMENT_HUGEPAGES", "1") != "0"

#: Pinned buffers below this size come from torch's pinned allocator rather than their own map.
SMALL_PINNED_BYTES = 1 << 20
_CUDA_HOST_REGISTER_PORTABLE = 1  # as torch.cuda._pin_memory_utils registers


def _advise_huge_pages(start: int, nbytes: int) -> None:
    if HUGEPAGES and _libc is not None and nbytes >= 2 * _HUGE_PAGE:
        first = (start + _HUGE_PAGE - 1) & ~(_HUGE_PAGE - 1)
        last = (start + nbytes) & ~(_HUGE_PAGE - 1)
        if last > first:
            _libc.madvise(first, last - first, _MADV_HUGEPAGE)  # advice only: failure is fine


def _register(address: int, nbytes: int) -> None:
    """Pins ``nbytes`` of host memory at ``address`` (``cudaHostRegister``)."""
    code = int(torch.cuda.cudart().cudaHostRegister(address, nbytes, _CUDA_HOST_REGISTER_PORTABLE))
    if code != 0:
        raise RuntimeError(
            f"pinning a {nbytes}-byte snapshot buffer failed (cudaHostRegister: cudaError "
            f"{code}). Nothing was staged. Use SnapshotStager(pin_memory=False) to stage "
            "into pageable memory (slower device-to-host copies)."
        )


def _pinned_bytes(nbytes: int) -> tuple[torch.Tensor, int | None]:
    """``nbytes`` of pinned host memory, and the address registered with ``cudaHostRegister``."""
    if nbytes < SMALL_PINNED_BYTES:
        return torch.empty(nbytes, dtype=torch.uint8, pin_memory=True), None
    mapping = mmap.mmap(-1, nbytes)
    out = torch.frombuffer(mapping, dtype=torch.uint8)
    address = out.data_ptr()
    _advise_huge_pages(address, nbytes)
    _register(address, nbytes)
    return out, address


def _shared_bytes(nbytes: int, pinned: bool) -> tuple[torch.Tensor, int | None]:
    """``nbytes`` of shared memory (torch's sharing strategy: what ``torch.multiprocessing``
    sends as a handle, not a copy), pinned with ``cudaHostRegister`` when ``pinned``."""
    storage = torch.UntypedStorage._new_shared(max(nbytes, 1))
    out = torch.empty(0, dtype=torch.uint8).set_(storage, 0, (nbytes,))  # type: ignore[call-overload]
    if not pinned or nbytes == 0:
        return out, None
    address = out.data_ptr()
    _register(address, nbytes)
    return out, address


def _unregister(address: int) -> None:
    code = int(torch.cuda.cudart().cudaHostUnregister(address))
    if code != 0:
        warnings.warn(
            f"cudaHostUnregister failed with cudaError {code}", RuntimeWarning, stacklevel=3
        )


def empty_host(shape: torch.Size, dtype: torch.dtype, *, touch: bool = False) -> torch.Tensor:
    """A contiguous host tensor that owns exactly its bytes, advised to use huge pages.

    With ``touch``, every page is faulted in now (:func:`touch_pages`), on the host workers.
    """
    out = torch.empty(shape, dtype=dtype)
    _advise_huge_pages(out.data_ptr(), out.numel() * out.element_size())
    if touch:
        touch_pages(out)
    return out


def touch_pages(t: torch.Tensor) -> None:
    """Faults in every page of the contiguous host tensor ``t`` (its values are left undefined).

    A first write to fresh memory costs a page fault per page, the bulk of a first export on
    one thread; faulted in here (in parallel on the host workers' team, :mod:`._workers`), the
    export then writes into warm memory.
    """
    nbytes = t.numel() * t.element_size()
    if nbytes == 0:
        return
    raw = torch.empty(0, dtype=torch.uint8).set_(
        t.untyped_storage(), t.storage_offset() * t.element_size(), (nbytes,)
    )  # type: ignore[call-overload]
    _workers.call(_zero_every, raw, mmap.PAGESIZE, elements=t.numel())


#: Bytes written at the start of each page by :func:`touch_pages`: enough elements that torch
#: splits the op over its threads by the page (32 Ki-element grains), few enough to cost nothing.
_TOUCH_BYTES = 64


def _zero_every(raw: torch.Tensor, page: int) -> None:
    pages = raw.numel() // page
    if pages:
        raw[: pages * page].view(pages, page)[:, :_TOUCH_BYTES].zero_()
    else:
        raw[:1].zero_()
    raw[-1:].zero_()  # the last page, where ``raw`` starts inside a page


def storage_idle(storage: Any, control: object, *, shared: bool = False) -> bool:
    """True when nothing outside its pool uses a kept host storage, so it may be written again.

    ``control`` is an object the pool references exactly as it references ``storage`` (once,
    from the same owner): their ``sys.getrefcount`` then differ only by outside references to
    the storage object (``t.untyped_storage()`` held by a caller). The storage's own use count
    covers tensors and views. Shared memory may be mapped by another process: a storage that
    was moved there is never idle; one the pool made ``shared`` is idle once nothing in this
    process uses it (its users in other processes are the owner's to wait for, as torch's DCP
    stagers wait for the previous save before reusing their shared buffers).
    """
    use_count = getattr(torch._C, "_storage_Use_Count", None)
    return (
        use_count is not None
        and use_count(storage._cdata) == 1
        and sys.getrefcount(storage) == sys.getrefcount(control)
        and (shared or not storage.is_shared())
    )


class _Kept:
    """One kept buffer: its storage, its size, whether pinned, and the round that last took it."""

    __slots__ = ("control", "nbytes", "pinned", "registered", "round", "shared", "storage")

    def __init__(
        self, storage: Any, nbytes: int, pinned: bool, round_: object, shared: bool = False
    ) -> None:
        self.storage = storage
        self.nbytes = nbytes
        self.pinned = pinned
        self.shared = shared
        self.registered: int | None = None  # the address registered with cudaHostRegister
        # Referenced exactly as `storage` is (once, from this object): sys.getrefcount of the
        # two, taken the same way, differs only by the references held outside the pool.
        self.control = object()
        self.round = round_

    def release(self) -> None:
        """Unpins; the memory itself goes when the last tensor using it does."""
        if self.registered is not None:
            address, self.registered = self.registered, None
            _unregister(address)
        self.storage = None


class Holder(Protocol):
    """What holds host memory for the size query and ``release_buffers()``: a pool, the rings."""

    def nbytes_of(self, *, pinned: bool | None = None) -> int: ...

    def release(self) -> None: ...


#: Every live holder, for :func:`held_bytes` and :func:`release_all`.
_holders: weakref.WeakSet[Any] = weakref.WeakSet()
_holders_lock = threading.Lock()


def register(holder: Holder) -> None:
    """Counts ``holder`` in :func:`held_bytes` and frees it in :func:`release_all`, while alive."""
    with _holders_lock:
        _holders.add(holder)


class HostPool:
    """Host buffers kept across rounds (exports, snapshots) and handed out again once idle.

    A buffer is reused only when nothing outside this pool can reach its memory: no tensor,
    view, DTensor local tensor or NumPy array (each counts in the storage's use count), no
    ``UntypedStorage`` or ``TypedStorage`` object (``t.untyped_storage()`` and ``t.storage()``
    return the one Python object this pool also holds, so those count in its Python reference
    count), and no other process (a storage moved to shared memory is never reused). So a save
    still in flight, such as a DCP async save that holds the previous export, is never
    overwritten; the next round gets fresh memory instead.

    What is kept is bounded: :meth:`end_round` forgets the idle buffers that the round did not
    take, so the pool holds the last round's buffers plus, with ``keep_busy``, those still in use
    at its end (forgotten by a later round once released). Without ``keep_busy`` a round's end
    lets go of every buffer it did not take.
    """

    def __init__(self, *, keep_busy: bool) -> None:
        self.keep_busy = keep_busy
        self._kept: dict[Any, list[_Kept]] = {}
        self._lock = threading.Lock()
        #: Bytes allocated since the last :meth:`end_round`.
        self.allocated_bytes = 0
        register(self)

    def take(
        self,
        shape: torch.Size,
        dtype: torch.dtype,
        *,
        key: Any = None,
        pinned: bool = False,
        shared: bool = False,
        round: object = None,
    ) -> torch.Tensor:
        """An idle kept buffer of this size, else a fresh one that is kept from now on.

        ``key`` names the buffer (a state dict path; None: by shape and dtype). ``round`` names
        the round taking it (any object); :meth:`end_round` keeps what it took, and a buffer is
        handed out once per round. ``shared``: in shared memory (see :func:`storage_idle`).
        """
        shape = torch.Size(shape)
        nbytes = math.prod(shape) * dtype.itemsize
        name = (tuple(shape), dtype) if key is None else key
        with self._lock:
            for kept in self._kept.get(name, ()):
                if (
                    kept.nbytes == nbytes
                    and kept.pinned == pinned
                    and kept.shared == shared
                    and (round is None or kept.round is not round)
                    and storage_idle(kept.storage, kept.control, shared=shared)
                ):
                    kept.round = round
                    return torch.empty(0, dtype=dtype).set_(kept.storage, 0, shape)  # type: ignore[call-overload]
        if pinned or shared:
            raw, address = _shared_bytes(nbytes, pinned) if shared else _pinned_bytes(nbytes)
            out = torch.empty(0, dtype=dtype).set_(raw.untyped_storage(), 0, shape)  # type: ignore[call-overload]
        else:
            out, address = empty_host(shape, dtype), None
        kept = _Kept(out.untyped_storage(), nbytes, pinned, round, shared)
        kept.registered = address
        with self._lock:
            self._kept.setdefault(name, []).append(kept)
            self.allocated_bytes += nbytes
        return out

    def end_round(self, round: object = None) -> None:
        """Lets go of the buffers ``round`` did not take (and, with ``keep_busy``, are idle)."""
        with self._lock:
            for name, group in list(self._kept.items()):
                keep = []
                for kept in group:
                    # A buffer pickled to another process (torch moves its storage to shared
                    # memory) is never idle again: kept, it would grow the pool every round.
                    moved = not kept.shared and kept.storage.is_shared()
                    busy = self.keep_busy and not moved and not self._idle(kept)
                    if kept.round is round or busy:
                        keep.append(kept)
                    else:
                        kept.release()
                if keep:
                    self._kept[name] = keep
                else:
                    del self._kept[name]
            self.allocated_bytes = 0

    @staticmethod
    def _idle(kept: _Kept) -> bool:
        return storage_idle(kept.storage, kept.control, shared=kept.shared)

    def nbytes_of(self, *, pinned: bool | None = None) -> int:
        """Bytes of the kept buffers (only the pinned ones, or only the pageable ones)."""
        with self._lock:
            return sum(
                k.nbytes
                for group in self._kept.values()
                for k in group
                if pinned is None or k.pinned == pinned
            )

    @property
    def nbytes(self) -> int:
        """Bytes of the buffers kept for the next round."""
        return self.nbytes_of()

    def release(self) -> None:
        """Lets go of every kept buffer (those still in use live on, unpinned, with their users)."""
        with self._lock:
            for group in self._kept.values():
                for kept in group:
                    kept.release()
            self._kept.clear()


#: Output buffers of exports made with ``Placement(reuse_buffers=True)``.
EXPORTS = HostPool(keep_busy=True)


def held_bytes(*, pinned: bool | None = None) -> int:
    """Host bytes held by every pool and every staging ring (only the pinned ones, or only not).

    Staging rings count as pinned, also on the CPU stand-in where their slots are pageable.
    """
    with _holders_lock:
        holders = list(_holders)
    return sum(holder.nbytes_of(pinned=pinned) for holder in holders)


def release_all() -> None:
    """Lets go of every pool's kept buffers and of the idle staging rings (``release_buffers()``).

    Buffers still referenced live on with their users; a lent ring stays with its borrower.
    """
    with _holders_lock:
        holders = list(_holders)
    for holder in holders:
        holder.release()
