"""What each streamed export and load did: bytes moved, seconds, memory, and TE's own cost.

Every streamed ``FusedAdam.state_dict()`` (an ``"export"``) and ``load_state_dict()`` or
``te_load.load_states`` (a ``"load"``) leaves one :class:`TransferReport`, readable in the thread
that ran it through :func:`last_report`, and logs it as one INFO line under the package's logger
``logging.getLogger("te_ckpt_placement")`` (silent unless the application enables it; the
record's ``report`` attribute is the object itself). A failed operation leaves a report too,
marked ``failed``, with the counts of the work done before the failure.

The counts are kept by the code that does the work, once per state (or per write), never per
chunk, and nothing is synchronized to take them. The DCP load planner's ``dcp.load`` leaves one
(path ``"planner"``), and so do each checkpoint method of a placed Megatron optimizer (path
``"megatron"``), each ``SnapshotStager`` stage (``"snapshot"``) and each ``StreamingWriter`` write
(``"streaming_save"``). Not reported: ``te_load.load_state`` on its own (a per-state write, which
counts towards an operation only when one is running).
"""

from __future__ import annotations

import contextvars
import logging
import threading
import time
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Literal

import torch

#: The package's logger. It has a NullHandler and no level of its own: it says nothing unless the
#: application configures logging (``logging.getLogger("te_ckpt_placement").setLevel("INFO")``
#: and a handler, or ``logging.basicConfig(level=logging.INFO)``).
logger = logging.getLogger("te_ckpt_placement")

Op = Literal["export", "load"]
#: The code path that streamed: TE's methods (``state_dict``/``load_state_dict``), ``load_states``,
#: a DCP streaming save, a snapshot, the DCP load planner, or the Megatron integration.
Path = Literal["state_dict", "load_states", "streaming_save", "snapshot", "planner", "megatron"]


def _size(nbytes: int) -> str:
    for unit, scale in (("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if abs(nbytes) >= scale:
            return f"{nbytes / scale:.2f} {unit}"
    return f"{nbytes} B"


class Details(dict[str, float]):
    """A report's path-specific counts: a read-only dict (JSON, pickle and ``asdict`` as one)."""

    def _read_only(self, *args: object, **kwargs: object) -> None:
        raise TypeError("a report's details are read-only: copy them with dict(details)")

    __setitem__ = __delitem__ = __ior__ = _read_only  # type: ignore[assignment]
    clear = pop = popitem = setdefault = update = _read_only  # type: ignore[assignment]

    def __reduce__(self) -> tuple[type[Details], tuple[dict[str, float]]]:
        return type(self), (dict(self),)


@dataclass(frozen=True, kw_only=True)
class TransferReport:
    """What one streamed export or load did. Sizes are in bytes, times in seconds.

    "The device" is the parameters' device: the GPU, or the CPU for an optimizer whose states
    live in host memory (the tests' stand-in), where ``gpu_bytes`` and ``te_gpu_bytes`` count
    CPU memory and the transfers are host-to-host copies.

    Attributes:
        op: ``"export"`` (``state_dict``) or ``"load"`` (``load_state_dict``, ``load_states``).
        failed: True when the operation raised; the counts then cover the work done before.
        error: The exception's type name when ``failed``, else None.
        states: States exported, or states written by a load.
        device_to_host_bytes: Raw stored bytes copied from the device to host memory: an
            export's stored states (FP8 bytes, BF16 and FP16 halves, int16 remainders; the FP32
            result of ``conversion="device"``), a load's rollback copies of the live states it
            overwrites (``rollback=True``; else 0).
        host_to_device_bytes: Bytes a load copied from host memory to the device: each state as
            stored (2 B per element for BF16 and int16, 4 for FP32), and the FP32 copy of each
            FP16/FP8 state that TE scales on the device (4 B per element). 0 for an export.
        host_bytes_written: Bytes of the host tensors the operation made and filled: an export's
            output tensors (the FP32 states, int16 remainders), a load's rollback copies.
        peak_host_bytes: The most host memory the operation held at once in tensors it
            allocated or borrowed (not an RSS sample): output tensors (also those reused with
            ``reuse_buffers``), the staging lent to it (per device, the ring of pinned buffers,
            ``_ring.RING`` x ``_ring.CHUNK_BYTES``; for an export also the ring's host
            scratch, which exists once an E4M3 state was exported and is as large as the
            largest conversion block it served, 2 B per element), rollback copies, a strided
            state's contiguous host copy, and the FP32 block a load widens a non-FP32
            checkpoint value into before rounding it to BF16. Not
            counted: torch's temporaries inside the host conversions (bounded by one conversion
            block: NaN masks, the FP64 products of tiny scales), Python objects, the caller's
            checkpoint, and what the allocator or the kernel adds (page rounding, huge pages).
        gpu_bytes: The most device memory the operation allocated at once: the FP32 copy of
            an FP16/FP8 state a load hands to TE's scaling (small states' copies share one
            temporary, no larger than the largest state's copy), or that
            ``conversion="device"`` makes for an export (4 B per element); a strided state's
            contiguous device copy; a device-resident checkpoint value widened to FP32 before
            rounding. 0 for exports with host conversion and for BF16/FP32/int16 loads from host
            memory. Not counted: what TE's own methods allocate when called (``_initialize_state``
            for a state the optimizer lacks, its FP8 quantizer, one-element scale temporaries).
        te_gpu_bytes: The device memory TE's own path would have allocated at its peak for the
            same work, computed from the states' shapes, dtypes and devices (TE 2.20.2
            fused_adam.py). Export: TE's ``get_unscaled_state`` makes an FP32 copy of each
            BF16/FP16/FP8 state (4 B per element; FP32 and int16 states are returned as they
            are), and ``state_dict`` keeps them all. Load: see ``_te_cost.te_load_device_bytes``.
        seconds: Wall time from the call to its return. Work the operation left queued on the
            current CUDA stream (a load's FP16/FP8 scaling) may still be running.
        path: The code path that streamed (see :data:`Path`).
        wait_seconds: Time spent waiting for a staging ring's copies.
        details: Path-specific counts (read-only), empty for ``state_dict`` and ``load_states``;
            for ``megatron``, ``states_read_in_place``: the FP32 and int16 states a load's read
            put into the live tensors (not counted in ``states``).
    """

    op: Op
    failed: bool
    error: str | None
    states: int
    device_to_host_bytes: int
    host_to_device_bytes: int
    host_bytes_written: int
    peak_host_bytes: int
    gpu_bytes: int
    te_gpu_bytes: int
    seconds: float
    path: Path = "state_dict"
    wait_seconds: float = 0.0
    details: Mapping[str, float] = field(default_factory=Details)

    @property
    def gpu_bytes_avoided(self) -> int:
        """``te_gpu_bytes - gpu_bytes``: the device memory TE's path would have needed more."""
        return self.te_gpu_bytes - self.gpu_bytes

    def __str__(self) -> str:
        status = f" FAILED ({self.error})" if self.failed else ""
        moved = (
            f"device-to-host {_size(self.device_to_host_bytes)}, "
            f"host-to-device {_size(self.host_to_device_bytes)}, "
            f"host written {_size(self.host_bytes_written)}"
        )
        return (
            f"te_ckpt_placement {self.op}{status}: {self.states} states in {self.seconds:.3f} s; "
            f"{moved}; peak host {_size(self.peak_host_bytes)}; GPU {_size(self.gpu_bytes)} "
            f"(TE's own path: {_size(self.te_gpu_bytes)})"
        )


class _Recorder:
    """The running counts of one operation: its own thread's, and those of threads it attached
    (:func:`attach`), under one lock."""

    __slots__ = (
        "d2h",
        "details",
        "gpu",
        "h2d",
        "held",
        "lock",
        "op",
        "path",
        "peak_host",
        "stagers",
        "start",
        "states",
        "te_gpu",
        "wait_s",
        "written",
    )

    def __init__(self, op: Op, path: Path = "state_dict") -> None:
        self.op = op
        self.path = path
        self.lock = threading.RLock()
        self.start = time.perf_counter()
        self.states = 0
        self.d2h = 0
        self.h2d = 0
        self.written = 0
        self.held = 0  # host bytes kept until the operation ends: outputs, rollback copies
        self.stagers: dict[torch.device, int] = {}  # host bytes of the staging lent, per device
        self.peak_host = 0
        self.gpu = 0
        self.te_gpu = 0
        self.wait_s = 0.0
        self.details: dict[str, float] = {}

    def host_peak(self, temporary: int = 0) -> None:
        """Notes the host memory held now, with ``temporary`` bytes alive besides."""
        with self.lock:
            now = self.held + sum(self.stagers.values()) + temporary
            if now > self.peak_host:
                self.peak_host = now

    def device_temporary(self, nbytes: int) -> None:
        with self.lock:
            if nbytes > self.gpu:
                self.gpu = nbytes

    def staging(self, device: torch.device, nbytes: int) -> None:
        with self.lock:
            if nbytes > self.stagers.get(device, 0):
                self.stagers[device] = nbytes
                self.host_peak()

    def exported(
        self, kind: str, raw_bytes: int, out_bytes: int, host_temp: int, device_temp: int
    ) -> None:
        """One exported state: its raw stored bytes, its host result and the temporaries made."""
        with self.lock:
            self.device_temporary(device_temp)
            self.states += 1
            self.d2h += raw_bytes
            self.written += out_bytes
            self.held += out_bytes
            self.host_peak(host_temp)
            if kind != "copy":
                self.te_gpu += out_bytes

    def uploaded(self, nbytes: int, temporary: int) -> None:
        with self.lock:
            self.h2d += nbytes
            self.host_peak(temporary)

    def kept(self, nbytes: int) -> None:
        """A rollback copy of a live state, held until the load ends."""
        with self.lock:
            self.d2h += nbytes
            self.written += nbytes
            self.held += nbytes
            self.host_peak()

    def state_written(self) -> None:
        with self.lock:
            self.states += 1

    def te_cost(self, nbytes: int) -> None:
        with self.lock:
            if nbytes > self.te_gpu:
                self.te_gpu = nbytes

    def waited(self, seconds: float) -> None:
        """Time spent waiting for a ring's copies."""
        with self.lock:
            self.wait_s += seconds

    def holding(self, nbytes: int) -> None:
        """``nbytes`` more host memory held from now on (negative: freed), such as a buffer that
        lives for part of the operation."""
        with self.lock:
            self.held += nbytes
            self.host_peak()

    def detail(self, key: str, value: float, *, peak: bool = False) -> None:
        """Adds ``value`` to the path-specific count ``key`` (with ``peak``: keeps the larger)."""
        with self.lock:
            old = self.details.get(key, 0)
            self.details[key] = max(old, value) if peak else old + value

    def report(self, exc: BaseException | None) -> TransferReport:
        with self.lock:
            return TransferReport(
                op=self.op,
                failed=exc is not None,
                error=None if exc is None else type(exc).__name__,
                states=self.states,
                device_to_host_bytes=self.d2h,
                host_to_device_bytes=self.h2d,
                host_bytes_written=self.written,
                peak_host_bytes=self.peak_host,
                gpu_bytes=self.gpu,
                te_gpu_bytes=self.te_gpu,
                seconds=time.perf_counter() - self.start,
                path=self.path,
                wait_seconds=self.wait_s,
                details=Details(self.details),
            )


_active: contextvars.ContextVar[_Recorder | None] = contextvars.ContextVar(
    "te_ckpt_placement_report", default=None
)


class _Last(threading.local):
    report: TransferReport | None = None


_last = _Last()


def active() -> _Recorder | None:
    """The operation running in this thread or task, or None (then nothing is counted)."""
    return _active.get()


def last_report() -> TransferReport | None:
    """The report of the last streamed export or load that ran in the calling thread.

    None until one has run in this thread. Threads never see each other's reports; asyncio tasks
    of one thread share its last report.
    """
    return _last.report


@contextmanager
def operation(op: Op, *, path: Path = "state_dict") -> Iterator[None]:
    """Counts one export or load; usable as a decorator. Within a running operation of the same
    thread or task it counts towards that one instead (one report, one log line)."""
    if _active.get() is not None:
        yield
        return
    recorder = _Recorder(op, path)
    token = _active.set(recorder)
    try:
        yield
    except BaseException as exc:
        _active.reset(token)
        _finish(recorder, exc)
        raise
    _active.reset(token)
    _finish(recorder, None)


def _finish(recorder: _Recorder, exc: BaseException | None) -> TransferReport:
    report = recorder.report(exc)
    _last.report = report
    logger.info("%s", report, extra={"report": report})
    return report


def start(op: Op, *, path: Path) -> _Recorder:
    """The counts of an operation that spans several calls, not one block (the DCP load
    planner's ``dcp.load``): count into it directly or through :func:`attach`, and end it with
    :func:`finish`."""
    return _Recorder(op, path)


def finish(recorder: _Recorder, exc: BaseException | None = None) -> TransferReport:
    """Ends an operation made by :func:`start`: its report becomes the calling thread's
    :func:`last_report`, is logged, and is returned (``exc``: it failed with that)."""
    return _finish(recorder, exc)


@contextmanager
def attach(recorder: _Recorder | None) -> Iterator[None]:
    """Counts the work of the calling thread (a writer's producer, a reader) towards
    ``recorder``, an operation that another thread runs (from its :func:`active`); None: nothing
    is counted. The operation's report is made by its own thread, when it ends."""
    token = _active.set(recorder)
    try:
        yield
    finally:
        _active.reset(token)


def waited(seconds: float) -> None:
    """The running operation waited ``seconds`` for a staging ring's copies."""
    recorder = _active.get()
    if recorder is not None:
        recorder.waited(seconds)


def staging(device: torch.device, nbytes: int) -> None:
    """The staging lent to the running operation on ``device`` holds ``nbytes`` of host memory."""
    recorder = _active.get()
    if recorder is not None:
        recorder.staging(device, nbytes)


def exported(kind: str, raw_bytes: int, out_bytes: int, *, host: int = 0, device: int = 0) -> None:
    """The running export produced one state of ``kind``: ``raw_bytes`` read from its storage,
    ``out_bytes`` written to the host, with ``host`` and ``device`` bytes of temporaries alive."""
    recorder = _active.get()
    if recorder is not None:
        recorder.exported(kind, raw_bytes, out_bytes, host, device)


def device_temporary(nbytes: int) -> None:
    """The running operation holds ``nbytes`` of device temporaries at once."""
    recorder = _active.get()
    if recorder is not None:
        recorder.device_temporary(nbytes)


def kept(nbytes: int) -> None:
    """The running load copied ``nbytes`` of a live state to the host, to roll back with."""
    recorder = _active.get()
    if recorder is not None:
        recorder.kept(nbytes)


def state_written() -> None:
    """The running load wrote one more state."""
    recorder = _active.get()
    if recorder is not None:
        recorder.state_written()


def te_cost(nbytes: int) -> None:
    """TE's own path would have allocated ``nbytes`` of device memory at its peak (a load's
    parts are written one after another, so the largest counts)."""
    recorder = _active.get()
    if recorder is not None:
        recorder.te_cost(nbytes)
