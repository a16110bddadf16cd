"""Host buffers that a snapshot reuses from one save to the next, pinned for GPU copies.

Large buffers are anonymous memory maps (page-aligned, exactly the requested size rounded to
pages) registered with ``cudaHostRegister``, the way torch's DCP stager pins its buffers; torch's
pinned allocator would round each one up to a power of two. Small ones come from torch's pinned
allocator. A buffer is handed out again only when nothing outside the pool uses it, so a save
still being written is never overwritten.

Uses only APIs that torch 2.11 (the GPU machine's version) and 2.13 share.
"""

from __future__ import annotations

import contextlib
import mmap
import threading
import warnings
from dataclasses import dataclass, field
from typing import Any

import torch

from ..engine import storage_idle

__all__ = ["HostBuffers"]

#: Buffers below this size come from torch's (pinned) allocator rather than their own mapping.
SMALL_BYTES = 1 << 20
_HUGE_ADVICE_BYTES = 4 << 20
_CUDA_HOST_REGISTER_PORTABLE = 1  # as torch.cuda._pin_memory_utils registers


@dataclass(eq=False)
class _Buffer:
    storage: Any  # torch.UntypedStorage
    nbytes: int
    pinned: bool
    registered: int | None = None  # the address registered with cudaHostRegister
    # Referenced exactly as `storage` is, for engine.storage_idle's count of outside references.
    control: object = field(default_factory=object)

    def view(self, shape: torch.Size, dtype: torch.dtype) -> torch.Tensor:
        return torch.empty(0, dtype=dtype).set_(self.storage, 0, shape)  # type: ignore[call-overload]

    def release(self) -> None:
        """Unpins; the memory itself goes when the last tensor using it does."""
        if self.registered is not None:
            code = int(torch.cuda.cudart().cudaHostUnregister(self.registered))
            self.registered = None
            if code != 0:
                warnings.warn(
                    f"cudaHostUnregister failed with cudaError {code}", RuntimeWarning, stacklevel=2
                )
        self.storage = None


def _allocate(nbytes: int, pinned: bool) -> _Buffer:
    if nbytes < SMALL_BYTES:
        tensor = torch.empty(nbytes, dtype=torch.uint8, pin_memory=pinned)
        return _Buffer(tensor.untyped_storage(), nbytes, pinned)
    mapping = mmap.mmap(-1, nbytes)
    if nbytes >= _HUGE_ADVICE_BYTES and hasattr(mmap, "MADV_HUGEPAGE"):
        with contextlib.suppress(OSError):  # advice only
            mapping.madvise(mmap.MADV_HUGEPAGE)
    storage = torch.frombuffer(mapping, dtype=torch.uint8).untyped_storage()
    buffer = _Buffer(storage, nbytes, pinned)
    if pinned:
        address = storage.data_ptr()
        code = int(
            torch.cuda.cudart().cudaHostRegister(address, nbytes, _CUDA_HOST_REGISTER_PORTABLE)
        )
        if code != 0:
            raise RuntimeError(
                f"pinning a {nbytes}-byte snapshot buffer failed (cudaHostRegister: cudaError "
                f"{code}). Nothing was staged. Use SnapshotStager(pin_memory=False) to stage "
                "into pageable memory (slower device-to-host copies)."
            )
        buffer.registered = address
    return buffer


class HostBuffers:
    """Named host buffers kept across snapshots.

    Each :meth:`take` names its buffer (the state dict path of what is copied into it). A round
    of takes ends with :meth:`end_round`, which releases every kept buffer that round did not
    take, so the pool holds one snapshot's worth of buffers (two while an older save that still
    uses its buffers is being written).
    """

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._kept: dict[Any, list[_Buffer]] = {}
        self._taken: set[int] = set()
        self.allocated_bytes = 0  # in the current round

    def take(
        self, key: Any, shape: torch.Size, dtype: torch.dtype, *, pinned: bool
    ) -> torch.Tensor:
        """A contiguous host tensor of ``shape`` and ``dtype`` that nothing else uses."""
        numel = 1
        for size in shape:
            numel *= size
        nbytes = numel * dtype.itemsize
        with self._lock:
            candidates = self._kept.setdefault(key, [])
            for buffer in candidates:
                if (
                    id(buffer) not in self._taken
                    and buffer.nbytes == nbytes
                    and buffer.pinned == pinned
                    and storage_idle(buffer.storage, buffer.control)
                ):
                    self._taken.add(id(buffer))
                    return buffer.view(torch.Size(shape), dtype)
        buffer = _allocate(nbytes, pinned)
        with self._lock:
            self._kept.setdefault(key, []).append(buffer)
            self._taken.add(id(buffer))
            self.allocated_bytes += nbytes
        return buffer.view(torch.Size(shape), dtype)

    def end_round(self) -> None:
        """Releases the buffers this round did not take; the next round starts."""
        with self._lock:
            for key in list(self._kept):
                kept = []
                for buffer in self._kept[key]:
                    if id(buffer) in self._taken:
                        kept.append(buffer)
                    else:
                        buffer.release()
                if kept:
                    self._kept[key] = kept
                else:
                    del self._kept[key]
            self._taken.clear()
            self.allocated_bytes = 0

    @property
    def nbytes(self) -> int:
        """Bytes of the buffers kept for the next snapshot."""
        with self._lock:
            return sum(b.nbytes for group in self._kept.values() for b in group)

    def close(self) -> None:
        """Releases every buffer (those a save still uses live on, unpinned, until it ends)."""
        with self._lock:
            for group in self._kept.values():
                for buffer in group:
                    buffer.release()
            self._kept.clear()
            self._taken.clear()
