"""What each streamed export and load did: bytes moved, seconds, memory, and TE's own cost.

Every streamed ``FusedAdam.state_dict()`` (an ``"export"``) and ``load_state_dict()`` or
``te_load.load_states`` (a ``"load"``) leaves one :class:`TransferReport`, readable in the thread
that ran it through :func:`last_report`, and logs it as one INFO line under the package's logger
``logging.getLogger("te_ckpt_placement")`` (silent unless the application enables it; the
record's ``report`` attribute is the object itself). A failed operation leaves a report too,
marked ``failed``, with the counts of the work done before the failure.

The counts are kept by the code that does the work, once per state (or per write), never per
chunk, and nothing is synchronized to take them. Not reported: ``te_load.load_state`` on its own
(the DCP load planner's per-state write, which counts towards an operation only when one is
running), the DCP streaming save (``LazyState``) and the Megatron integration's per-state exports.
"""

from __future__ import annotations

import contextvars
import logging
import threading
import time
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Literal

import torch
from torch.distributed.tensor import DTensor

__all__ = ["TransferReport", "last_report", "logger"]

#: The package's logger. It has a NullHandler and no level of its own: it says nothing unless the
#: application configures logging (``logging.getLogger("te_ckpt_placement").setLevel("INFO")``
#: and a handler, or ``logging.basicConfig(level=logging.INFO)``).
logger = logging.getLogger("te_ckpt_placement")

Op = Literal["export", "load"]


def _size(nbytes: int) -> str:
    for unit, scale in (("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if abs(nbytes) >= scale:
            return f"{nbytes / scale:.2f} {unit}"
    return f"{nbytes} B"


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
        gpu_bytes: The most device memory the operation allocated at once (one state at a
            time): the FP32 copy of each FP16/FP8 state a load hands to TE's scaling, or that
            ``conversion="device"`` makes for an export (4 B per element); a strided state's
            contiguous device copy; a device-resident checkpoint value widened to FP32 before
            rounding. 0 for exports with host conversion and for BF16/FP32/int16 loads from host
            memory. Not counted: what TE's own methods allocate when called (``_initialize_state``
            for a state the optimizer lacks, its FP8 quantizer, one-element scale temporaries).
        te_gpu_bytes: The device memory TE's own path would have allocated at its peak for the
            same work, computed from the states' shapes, dtypes and devices (TE 2.20.2
            fused_adam.py). Export: TE's ``get_unscaled_state`` makes an FP32 copy of each
            BF16/FP16/FP8 state (4 B per element; FP32 and int16 states are returned as they
            are), and ``state_dict`` keeps them all. Load: see :func:`te_load_device_bytes`.
        seconds: Wall time from the call to its return. Work the operation left queued on the
            current CUDA stream (a load's FP16/FP8 scaling) may still be running.
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
    """The running counts of one operation, touched only by the thread that runs it."""

    __slots__ = (
        "d2h",
        "gpu",
        "h2d",
        "held",
        "op",
        "peak_host",
        "stagers",
        "start",
        "states",
        "te_gpu",
        "written",
    )

    def __init__(self, op: Op) -> None:
        self.op = op
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

    def host_peak(self, temporary: int = 0) -> None:
        """Notes the host memory held now, with ``temporary`` bytes alive besides."""
        now = self.held + sum(self.stagers.values()) + temporary
        if now > self.peak_host:
            self.peak_host = now

    def device_temporary(self, nbytes: int) -> None:
        if nbytes > self.gpu:
            self.gpu = nbytes

    def staging(self, device: torch.device, nbytes: int) -> None:
        if nbytes > self.stagers.get(device, 0):
            self.stagers[device] = nbytes
            self.host_peak()

    def exported(self, kind: str, data: torch.Tensor | None, out: torch.Tensor) -> None:
        """One exported state: its raw storage (None for ``"device"``) and its host result."""
        out_bytes = out.numel() * out.element_size()
        temporary = 0
        if data is None:  # TE's FP32 result, made on the device and copied out
            raw = out_bytes
            self.device_temporary(out_bytes)
        else:
            raw = data.numel() * data.element_size()
            if not data.is_contiguous():
                # engine.materialize: data.to("cpu", copy=True).contiguous(). A dense layout is
                # kept by the first copy, so the second makes another; a layout with gaps is
                # made contiguous by the first, through a contiguous temporary on the device.
                # The load pipeline's rule for a layout without gaps (imported here: the upload
                # module reports through this one).
                from .upload import memory_order

                dense = memory_order(data) is not None
                temporary = raw * (2 if dense else 1)
                if not dense and data.device.type != "cpu":
                    self.device_temporary(raw)
        self.states += 1
        self.d2h += raw
        self.written += out_bytes
        self.held += out_bytes
        self.host_peak(temporary)
        if kind != "copy":
            self.te_gpu += out_bytes

    def uploaded(self, nbytes: int, temporary: int) -> None:
        self.h2d += nbytes
        self.host_peak(temporary)

    def kept(self, nbytes: int) -> None:
        """A rollback copy of a live state, held until the load ends."""
        self.d2h += nbytes
        self.written += nbytes
        self.held += nbytes
        self.host_peak()

    def report(self, exc: BaseException | None) -> TransferReport:
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
def operation(op: Op) -> Iterator[None]:
    """Counts one export or load; usable as a decorator. Within a running operation of the same
    thread or task it counts towards that one instead (one report, one log line)."""
    if _active.get() is not None:
        yield
        return
    recorder = _Recorder(op)
    token = _active.set(recorder)
    try:
        yield
    except BaseException as exc:
        _active.reset(token)
        _finish(recorder, exc)
        raise
    _active.reset(token)
    _finish(recorder, None)


def _finish(recorder: _Recorder, exc: BaseException | None) -> None:
    report = recorder.report(exc)
    _last.report = report
    logger.info("%s", report, extra={"report": report})


def staging(device: torch.device, nbytes: int) -> None:
    """The staging lent to the running operation on ``device`` holds ``nbytes`` of host memory."""
    recorder = _active.get()
    if recorder is not None:
        recorder.staging(device, nbytes)


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
        recorder.states += 1


def te_cost(nbytes: int) -> None:
    """TE's own path would have allocated ``nbytes`` of device memory at its peak (a load's
    parts are written one after another, so the largest counts)."""
    recorder = _active.get()
    if recorder is not None and nbytes > recorder.te_gpu:
        recorder.te_gpu = nbytes


def _local(t: torch.Tensor) -> torch.Tensor:
    return t._local_tensor if isinstance(t, DTensor) else t


def te_state_device_bytes(
    value: torch.Tensor, device: torch.device, stored: torch.dtype, remainder: bool
) -> int:
    """Device bytes TE allocates at once to write one checkpoint value into a state.

    TE 2.20.2 fused_adam.py: ``load_state_dict`` passes ``value.float()`` (L548; the int16
    remainder as it is, L546), a new FP32 tensor where the value was not FP32, on the value's
    device. ``set_scaled_state`` (L358-395) copies an FP32 state in place; ``_apply_scale``
    (L268-308) rounds a BF16 state on the value's device (L280, ``.bfloat16()``, 2 B per
    element) and moves an FP16/FP8 state's FP32 value to the state's device (L296, 4 B per
    element) unless it is there, then scales it in place. Only allocations on ``device`` (the
    parameter's) count; ``_initialize_state``'s are left out, as in :class:`TransferReport`.

    Args:
        value: The checkpoint's local tensor.
        device: The parameter's (local) device.
        stored: TE's ``name_to_dtype_map`` entry of the state (``torch.uint8`` for FP8).
        remainder: Whether the state is an int16 master remainder.
    """
    n = value.numel()
    here = value.device == device
    made = 4 * n if here and not remainder and value.dtype != torch.float32 else 0
    if remainder or stored == torch.float32:
        return made
    if stored == torch.bfloat16:
        return made + (2 * n if here else 0)
    return made + (0 if here else 4 * n)


LoadPlan = Sequence[tuple[torch.Tensor, Sequence[tuple[torch.Tensor, torch.dtype, bool]]]]


def te_load_device_bytes(plan: LoadPlan, *, bulk_cast: bool) -> int:
    """The peak device memory of TE's ``load_state_dict`` temporaries for a checkpoint.

    ``plan`` is ``[(param, [(value, stored dtype, remainder)])]`` in checkpoint order. TE 2.20.2
    fused_adam.py L515-548 first runs torch's ``Optimizer.load_state_dict``, which casts every
    state value to the parameter's dtype and device (``value.to(dtype=param.dtype,
    device=param.device)``; a new tensor of ``numel x param.element_size()`` bytes unless the
    value has both already) and keeps all the casts until it returns. TE then walks the
    parameters in checkpoint order: ``self.state[param] = {}`` (L536) frees that parameter's
    casts, and each state is written through :func:`te_state_device_bytes`, one at a time. With
    ``C_k`` the casts of parameter ``k`` and ``T_k`` its largest per-state temporaries, the peak
    is ``max(sum(C), max_k(sum(C_j for j > k) + T_k))``; without ``bulk_cast`` (states written
    one by one, as ``set_scaled_state`` writes them) it is ``max_k(T_k)``.
    """
    casts: list[int] = []
    temps: list[int] = []
    for param, states in plan:
        local_param = _local(param)
        cast = temp = 0
        for value, stored, remainder in states:
            local = _local(value)
            if param.is_floating_point():
                same = local.dtype == param.dtype and local.device == local_param.device
                size = param.element_size()
            else:
                same, size = local.device == local_param.device, local.element_size()
            cast += 0 if same else local.numel() * size
            temp = max(temp, te_state_device_bytes(local, local_param.device, stored, remainder))
        casts.append(cast)
        temps.append(temp)
    if not bulk_cast:
        return max(temps, default=0)
    peak, later = sum(casts), sum(casts)
    for cast, temp in zip(casts, temps, strict=True):
        later -= cast
        peak = max(peak, later + temp)
    return peak
