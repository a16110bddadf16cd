"""``SnapshotStager``: async DCP saves that copy only the raw stored bytes before training resumes.

``dcp.async_save`` stages the state dict so that training can change the originals while the
write runs. For TE FusedAdam states given as lazy placeholders (``PlacedOptimizerState(
save="streaming")``), this stager copies what the optimizer stores: BF16/FP16/FP8/int16/FP32 bytes
and the FP32 scales of FP16 and FP8 states, 2 bytes per element for BF16 moments where the FP32
export has 4. Model weights and any other tensor are copied as they are. Everything goes into
host buffers kept from one save to the next (pinned for copies from a GPU, all copies queued on a
side stream and waited for once). The FP32 conversion then runs in the background write, from the
snapshot, when the writer asks for each state: the checkpoint holds the same FP32 tensors as
TE's export, so every existing loader reads it.

Uses only APIs that torch 2.11 (the GPU machine's version) and 2.13 share.
"""

from __future__ import annotations

import copy
import dataclasses
import time
from contextlib import ExitStack
from typing import Any

import torch
from torch.distributed.checkpoint.staging import AsyncStager
from torch.distributed.checkpoint.stateful import Stateful

from .. import _export as engine
from .. import _host_budget, _pool, _ring
from .. import _reports as reports
from .._te_contract import has_contract
from .._te_initial_states import initialized_for_load
from .._tensors import local
from .._tree import iter_tree, map_tree
from ._lazy_state import LazyState, _Ledger, lazy_of, rewrap
from ._state import PlacedOptimizerState

StateDict = dict[str, Any]


def _nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


class _Snapshot:
    """One stage() call: walks the state dict, queues the copies, rebuilds the containers."""

    def __init__(self, buffers: _pool.HostPool, pin_memory: bool, shared: bool) -> None:
        self.buffers = buffers
        self.pin_memory = pin_memory
        self.shared = shared
        self.round = object()  # what this stage() takes from the pool
        self.rings: dict[torch.device, _ring.Ring] = {}
        self._lent = ExitStack()
        self.ledger = _Ledger()
        self.raw_bytes = 0
        self.other_bytes = 0
        self.converted_bytes = 0
        self.passed_through = 0

    def copy(self, src: torch.Tensor, key: Any) -> torch.Tensor:
        """A host copy of ``src`` (queued, for a CUDA source) in a buffer named ``key``."""
        cuda = src.device.type == "cuda"
        dst = self.buffers.take(
            src.shape,
            src.dtype,
            key=key,
            pinned=cuda and self.pin_memory,
            shared=self.shared,
            round=self.round,
        )
        if not cuda:
            dst.copy_(src)
            return dst
        ring = self.rings.get(src.device)
        if ring is None:
            # The copy stream only: the copies go straight into the pool's buffers.
            ring = self._lent.enter_context(_ring.lend(src.device, slots=0))
            # What the compute stream has queued (the last step) lands before we read.
            ring.after_current()
            self.rings[src.device] = ring
        ring.copy(None, dst, src)
        return dst

    def finish(self) -> None:
        start = time.perf_counter()
        try:
            for ring in self.rings.values():
                ring.synchronize()
        finally:
            self._lent.close()  # the rings go back (their streams synchronized again)
            reports.waited(time.perf_counter() - start)

    def lazy(self, lazy: LazyState, path: tuple[Any, ...]) -> torch.Tensor:
        source = lazy.source
        if source.kind == "device" or source.data is None:
            # Only TE's GPU conversion reads this storage: convert now, one state at a time.
            out = lazy.produce()
            self.converted_bytes += _nbytes(out)
            return out
        data = self.copy(source.data, (*path, "data"))
        scale = source.scale
        if scale is not None:
            scale = self.copy(scale, (*path, "scale"))
        raw = _nbytes(data) + (0 if scale is None else _nbytes(scale))
        self.raw_bytes += raw
        reports.exported("copy", raw, raw)
        # Only host snapshots from here on: nothing that reaches the optimizer or a GPU.
        snapshot = dataclasses.replace(source, data=data, scale=scale, on_device=None)
        return lazy.with_source(snapshot, self.ledger)

    def leaf(self, obj: Any, path: tuple[Any, ...]) -> Any:
        lazy = lazy_of(obj)
        if lazy is not None:
            return rewrap(self.lazy(lazy, path), obj)
        if isinstance(obj, torch.Tensor):
            if engine.is_exported(obj):  # a private host snapshot already
                self.passed_through += 1
                return obj
            host = self.copy(local(obj), path)
            self.other_bytes += _nbytes(host)
            recorder = reports.active()
            if recorder is not None:
                recorder.kept(_nbytes(host))  # copied to the host, held by the snapshot
            return rewrap(host, obj)
        return copy.deepcopy(obj)


def _staged_bytes(obj: Any) -> int | None:
    """Host bytes a snapshot of ``obj`` holds (None: not a leaf the snapshot copies)."""
    lazy = lazy_of(obj)
    if lazy is not None:
        source = lazy.source
        if source.kind == "device" or source.data is None:
            return lazy.numel() * lazy.element_size()
        scale = 0 if source.scale is None else _nbytes(source.scale)
        return _nbytes(source.data) + scale
    if isinstance(obj, torch.Tensor) and not engine.is_exported(obj):
        return _nbytes(local(obj))
    return None


def _new_stager(pin_memory: bool, shared_memory: bool) -> SnapshotStager:
    return SnapshotStager(pin_memory=pin_memory, shared_memory=shared_memory)


class SnapshotStager(AsyncStager):
    """An ``AsyncStager`` that snapshots raw optimizer-state bytes into reused host buffers.

    ``stage`` returns when every copy has landed, so training may change the model and the
    optimizer as soon as ``dcp.async_save`` returns: the staged dict references only the
    snapshot. Lazy optimizer states stay lazy, now reading from the snapshot, and are converted
    to FP32 by the background write; use a writer that drops each tensor once written
    (:class:`~te_ckpt_placement.dcp.StreamingWriter`, which stages with this class by default) to
    keep that conversion to a few states at a time.

    Buffers are kept for the next save and reused once nothing uses them. Wait for a save to
    finish before starting the next (as torch asks of any reused stager): a buffer still in use
    is never overwritten, a second set is allocated instead. Tensors of a streaming export
    (``export_placement("cpu")``) are passed through, as :class:`PassThroughStager` does.

    The buffers are shared memory (by default), and the staged lazy states pickle as their
    snapshot tensors and conversion recipe: with ``AsyncCheckpointerType.PROCESS``, DCP's writer
    process receives shared-memory handles, not copies, and converts to TE's FP32 export as it
    writes. The parent holds the staged dict until that process answers (torch's process
    executor), so a buffer is reused only after its save completed.

    Each :meth:`stage` leaves a :class:`~te_ckpt_placement.TransferReport` (``path="snapshot"``)
    in :attr:`last_report` and in ``last_report()`` of the staging thread; its ``details`` hold
    ``raw_bytes`` (lazy states' stored bytes and scales), ``other_bytes`` (every other tensor),
    ``converted_bytes`` (states converted at staging), ``passed_through`` (tensors of a streaming
    export, not copied) and ``allocated_bytes`` (fresh buffer bytes; 0 when all were reused).

    Args:
        pin_memory: Pin the buffers of copies from a GPU (``cudaHostRegister``), for
            full-bandwidth asynchronous copies. ``False`` stages into pageable memory.
        shared_memory: Stage into shared memory (``/dev/shm``), which a process-based async
            save needs to avoid a copy. ``False`` stages into private memory (thread-based
            async saves only: pickling then copies).

    Raises:
        ValueError: ``pin_memory`` or ``shared_memory`` is not a bool.

    Example:
        >>> state = PlacedOptimizerState(model, optimizer, save="streaming")  # doctest: +SKIP
        >>> writer = StreamingWriter(path)  # stages with a SnapshotStager  # doctest: +SKIP
        >>> response = dcp.async_save({"optim": state}, storage_writer=writer,
        ...                           process_group=pg)  # doctest: +SKIP
        >>> response.result()  # before the next async_save  # doctest: +SKIP
    """

    _synchronize_after_execute = False  # stage() blocks until the snapshot is complete

    def __init__(self, *, pin_memory: bool = True, shared_memory: bool = True) -> None:
        if not isinstance(pin_memory, bool):
            raise ValueError(
                f"unsupported pin_memory {pin_memory!r}: valid values are True (pinned buffers "
                "for GPU copies) or False (pageable memory)"
            )
        if not isinstance(shared_memory, bool):
            raise ValueError(
                f"unsupported shared_memory {shared_memory!r}: valid values are True (shared "
                "memory, for process-based async saves) or False (private memory)"
            )
        self.pin_memory = pin_memory
        self.shared_memory = shared_memory
        self._buffers = _pool.HostPool(keep_busy=False)
        self.last_report: reports.TransferReport | None = None

    def __reduce__(self) -> Any:
        # A StreamingWriter sent to DCP's writer process takes a stager without buffers along.
        return _new_stager, (self.pin_memory, self.shared_memory)

    @property
    def buffer_bytes(self) -> int:
        """Host bytes of the buffers kept for the next snapshot."""
        return self._buffers.nbytes

    def stage(self, state_dict: StateDict) -> StateDict:  # type: ignore[override]
        """A snapshot of ``state_dict`` that nothing in training writes.

        Args:
            state_dict: What ``dcp.async_save`` stages (``Stateful`` values already replaced by
                their ``state_dict()``).

        Returns:
            The same structure, with lazy states reading from host snapshots of their stored
            bytes and every other tensor a host copy (a CPU-local DTensor for a DTensor).
        """
        self._check_budget(state_dict)
        snapshot = _Snapshot(self._buffers, self.pin_memory, self.shared_memory)
        with reports.operation("export", path="snapshot"):
            try:
                staged = map_tree(state_dict, snapshot.leaf, rebuild="always")
            finally:
                # Copies in flight land before any buffer is reused or freed.
                snapshot.finish()
                allocated = self._buffers.allocated_bytes
                self._buffers.end_round(snapshot.round)
                recorder = reports.active()
                if recorder is not None:
                    for key, value in (
                        ("raw_bytes", snapshot.raw_bytes),
                        ("other_bytes", snapshot.other_bytes),
                        ("converted_bytes", snapshot.converted_bytes),
                        ("passed_through", snapshot.passed_through),
                        ("allocated_bytes", allocated),
                    ):
                        recorder.detail(key, value)
        self.last_report = reports.last_report()
        return staged  # type: ignore[no-any-return]

    def prewarm(self, state_dict: StateDict) -> int:
        """Makes (and pins) the buffers that staging ``state_dict`` takes, at setup; returns the
        bytes kept.

        The first :meth:`stage` allocates and pins its buffers, blocking training for far longer
        than its copies take; after this, a stage of the same state dict (the same keys, shapes
        and dtypes: pass what ``dcp.async_save`` will be given, ``Stateful`` values included)
        reuses them and blocks only for the copies. A TE optimizer that has not stepped yet is
        sized from TE's initial states, which are taken back; any other optimizer must have its
        states already (``ValueError`` otherwise, before anything is staged: its export would run
        torch's fake step, which changes training). Only ``PlacedOptimizerState`` values of
        ``state_dict`` itself are treated so: give optimizers inside other ``Stateful`` values
        their states first. Costs the raw stored bytes of the state dict
        in host memory, held until :meth:`close` or ``te_ckpt_placement.release_buffers()``, and
        one device-to-host copy of them now (a stage like any other, with its report).
        """
        with ExitStack() as fresh:
            # An optimizer without states yet (before its first step) is given TE's initial
            # states for the sizes and has them taken back: torch's fake step, which the export
            # of a stateless optimizer runs, would change training (TE's first step would count
            # as its second).
            for key, value in state_dict.items():
                if isinstance(value, PlacedOptimizerState):
                    for _, optimizers in value._pairs:
                        for optimizer in optimizers:
                            if has_contract(optimizer):
                                fresh.enter_context(initialized_for_load(optimizer))
                            elif not optimizer.state:
                                raise ValueError(
                                    f"prewarm sizes an optimizer without states from TE's "
                                    f"initial states, but {key!r} holds an optimizer of type "
                                    f"{type(optimizer).__qualname__}, not a TE FusedAdam: "
                                    "prewarm after its first step, or let the first save "
                                    "make the buffers"
                                )
            resolved = {
                key: value.state_dict() if isinstance(value, Stateful) else value
                for key, value in state_dict.items()
            }
            staged = self.stage(resolved)
            del staged, resolved
        return self.buffer_bytes

    def _check_budget(self, state_dict: StateDict) -> None:
        total = sum(iter_tree(state_dict, _staged_bytes))
        # Idle kept buffers are reused, and already outside MemAvailable.
        _host_budget.check(
            "snapshot",
            max(0, total - self._buffers.nbytes),
            fits=(
                "A synchronous dcp.save of PlacedOptimizerState(save='streaming') through "
                "te_ckpt_placement.dcp.StreamingWriter holds about "
                f"{_host_budget.STREAMING_OVERHEAD_BYTES >> 30} GiB plus a few FP32 states"
            ),
        )

    def synchronize_staging(self) -> None:
        """A no-op: :meth:`stage` returns a complete snapshot."""

    def close(self) -> None:
        """Releases the kept buffers (after the last save)."""
        self._buffers.release()
