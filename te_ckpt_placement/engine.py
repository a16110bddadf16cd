"""The streaming export engine: one optimizer state at a time, from device storage to host.

The engine knows torch, not Transformer Engine. The TE adapter describes each stored state as a
:class:`StateSource` (its raw storage and how TE would unscale it); the engine turns that into a
host tensor that owns its storage exactly, and re-wraps it as a CPU-local DTensor when the
parameter is a DTensor. Nothing it produces is kept on the device: the raw bytes are copied to the
host and converted there, so the device memory of the export is zero, except for the opt-in
``"device"`` conversion, which holds one converted FP32 state at a time.
"""

from __future__ import annotations

import ctypes
import os
import sys
import threading
import weakref
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass
from itertools import chain
from typing import Any, Literal

import torch
from torch.distributed.tensor import DTensor

from . import _convert, reports
from ._convert import fp32_value  # shim, removed in P6
from ._tensors import local, memory_order, to_cpu_dtensor

__all__ = [
    "Plan",
    "lent_stager",
    "StateSource",
    "export_optimizer_state",
    "is_exported",
    "iter_exportable",
    "clear_pinned_pool",
    "empty_host",
    "fp32_value",
    "materialize",
    "pinned_pool_bytes",
    "to_cpu_dtensor",
]

Kind = Literal["copy", "upcast", "scaled", "fp8", "device"]


@dataclass(frozen=True, kw_only=True)
class StateSource:
    """One stored optimizer state and the arithmetic that turns it into its exported value.

    Attributes:
        kind: ``"copy"`` (FP32 and int16 states, exported as stored), ``"upcast"`` (BF16 to FP32,
            exact), ``"scaled"`` (FP16 times a per-tensor FP32 scale), ``"fp8"`` (FP8 bytes
            times ``scale_inv``) or ``"device"`` (run ``on_device`` and copy its result).
        data: The raw local storage (a plain tensor, never a DTensor or a quantized wrapper).
        scale: The FP32 factor of ``"scaled"`` and ``"fp8"``, a one-element tensor.
        fp8_dtype: The torch dtype the FP8 bytes are read as.
        on_device: For ``"device"``: produces the exported value on the device.
    """

    kind: Kind
    data: torch.Tensor | None = None
    scale: torch.Tensor | None = None
    fp8_dtype: torch.dtype | None = None
    on_device: Callable[[], torch.Tensor] | None = None


# --- host output buffers ----------------------------------------------------------------------

_HUGE_PAGE = 2 << 20
_MADV_HUGEPAGE = 14
_libc: Any = None
if sys.platform.startswith("linux"):
    try:
        _libc = ctypes.CDLL(None, use_errno=True)
        _libc.madvise.argtypes = (ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int)
    except (OSError, AttributeError):  # pragma: no cover - exotic libc
        _libc = None

#: Ask the kernel for transparent huge pages on fresh output buffers. A first save writes its
#: output into never-touched memory, and with 4 KiB pages the page faults, not PCIe, bound it.
#: Set TE_CKPT_PLACEMENT_HUGEPAGES=0 to keep the system default.
HUGEPAGES = os.environ.get("TE_CKPT_PLACEMENT_HUGEPAGES", "1") != "0"


def empty_host(shape: torch.Size, dtype: torch.dtype) -> torch.Tensor:
    """A contiguous host tensor that owns exactly its bytes, advised to use huge pages."""
    out = torch.empty(shape, dtype=dtype)
    nbytes = out.numel() * out.element_size()
    if HUGEPAGES and _libc is not None and nbytes >= 2 * _HUGE_PAGE:
        start = out.data_ptr()
        first = (start + _HUGE_PAGE - 1) & ~(_HUGE_PAGE - 1)
        last = (start + nbytes) & ~(_HUGE_PAGE - 1)
        if last > first:
            _libc.madvise(first, last - first, _MADV_HUGEPAGE)  # advice only: failure is fine
    return out


# --- the device-to-host pipeline --------------------------------------------------------------

#: Bytes of raw state moved per chunk, and how many chunks are in flight.
CHUNK_BYTES = 16 << 20
RING = 3


class _Scratch:
    """A host work buffer of a stager, grown to the largest request and reused after that."""

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


class _Stager:
    """Pinned ring buffers and a copy stream for one CUDA device, reused across exports.

    For host-resident sources (the CPU stand-in) the same ring runs with plain buffers and
    synchronous copies, so one code path serves both. ``scratch`` is the conversions' host work
    buffer (E4M3's 16-bit patterns), allocated on first use.
    """

    def __init__(self, device: torch.device, chunk_bytes: int) -> None:
        self.device = device
        self.chunk_bytes = chunk_bytes
        cuda = device.type == "cuda"
        self.stream = torch.cuda.Stream(device) if cuda else None
        self.buffers = [
            torch.empty(chunk_bytes, dtype=torch.uint8, pin_memory=cuda) for _ in range(RING)
        ]
        self.events = [torch.cuda.Event() if cuda else None for _ in range(RING)]
        self.scratch = _Scratch()
        # The lease this stager is lent to (a weak reference), or None while it is free.
        self.lessee: weakref.ref[_Lease] | None = None

    def copy_async(self, i: int, dst: torch.Tensor, src: torch.Tensor) -> None:
        if self.stream is None:
            dst.copy_(src)
            return
        with torch.cuda.stream(self.stream):
            dst.copy_(src, non_blocking=True)
            self.events[i % RING].record(self.stream)  # type: ignore[union-attr]

    def wait(self, i: int) -> None:
        if self.stream is not None:
            self.events[i % RING].synchronize()  # type: ignore[union-attr]

    def synchronize(self) -> None:
        if self.stream is not None:
            self.stream.synchronize()

    @property
    def lent(self) -> bool:
        return self.lessee is not None and self.lessee() is not None

    @property
    def nbytes(self) -> int:
        return sum(b.numel() for b in self.buffers)


#: Every stager, free or lent, by (device, chunk bytes).
_pool: dict[tuple[torch.device, int], list[_Stager]] = {}
_pool_lock = threading.Lock()


class _Lease:
    """One export's claim on a stager, made safe against asynchronous exceptions.

    A KeyboardInterrupt can arrive after any call returns. The lease is therefore set up so that
    no such point separates a stager's change of hands from what undoes it: :meth:`take` records
    the stager in the lease before marking it lent, and the borrower's ``finally`` frees it with
    attribute loads, an ``is`` and a store, no call before the store. A lease that dies without
    giving back frees its stager too, since stagers hold only a weak reference to it.
    """

    __slots__ = ("__weakref__", "ref", "stager")

    def __init__(self) -> None:
        self.stager: _Stager | None = None
        self.ref = weakref.ref(self)  # what a lent stager holds, and the caller compares with

    def take(self, device: torch.device) -> _Stager:
        key = (device, CHUNK_BYTES)
        with _pool_lock:
            for stager in _pool.get(key, ()):
                if not stager.lent:
                    self.stager = stager
                    stager.lessee = self.ref
                    break
        if self.stager is None:
            new = _Stager(device, CHUNK_BYTES)
            self.stager = new
            new.lessee = self.ref
            with _pool_lock:
                _pool.setdefault(key, []).append(new)
        # Copies of an interrupted previous lessee may still be in flight into the ring.
        self.stager.synchronize()
        return self.stager


class lent_stager:  # noqa: N801 - used like a function, as contextlib's helpers are
    """Lends a stager for a ``with`` block (the load pipeline's borrow), as :class:`_Lease` does.

    On exit every copy issued through it has completed, and the stager is free again; a block
    that dies without exiting frees it with its lease.
    """

    __slots__ = ("device", "lease")

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.lease = _Lease()

    def __enter__(self) -> _Stager:
        return self.lease.take(self.device)

    def __exit__(self, *exc: object) -> None:
        stager = self.lease.stager
        if stager is not None and stager.lessee is self.lease.ref:
            try:
                stager.synchronize()  # no copy outlives the block that issued it
            finally:
                stager.lessee = None


def staging_in_use() -> int:
    """How many stagers are lent out right now (0 between exports)."""
    with _pool_lock:
        return sum(s.lent for stagers in _pool.values() for s in stagers)


def pinned_pool_bytes() -> int:
    """Pinned host bytes held by the staging pool (constant once warm, whatever the export)."""
    with _pool_lock:
        return sum(s.nbytes for stagers in _pool.values() for s in stagers)


def clear_pinned_pool() -> None:
    """Releases the idle staging buffers (the next export allocates them again)."""
    with _pool_lock:
        for stagers in _pool.values():
            for stager in [s for s in stagers if not s.lent]:
                stager.synchronize()  # nothing in flight into memory about to be freed
                stagers.remove(stager)


Convert = Callable[[torch.Tensor, torch.Tensor, _Scratch], None]


def _stream_into(src: torch.Tensor, out: torch.Tensor, convert: Convert) -> None:
    """Moves ``src`` (contiguous) into the host tensor ``out`` chunk by chunk.

    Chunk k+1 is copied to pinned memory on a side stream while the host converts chunk k into
    ``out``; the device never allocates anything.
    """
    flat_src, flat_out = src.reshape(-1), out.view(-1)
    n = flat_src.numel()
    lease, complete = _Lease(), False
    try:
        st = lease.take(src.device)
        step = max(1, st.chunk_bytes // src.element_size())
        bounds = [(a, min(a + step, n)) for a in range(0, n, step)]
        if st.stream is not None:
            # Pending work on the compute stream (a step, a conversion) finishes before we read.
            st.stream.wait_stream(torch.cuda.current_stream(src.device))

        def issue(i: int) -> torch.Tensor:
            a, b = bounds[i]
            buf = st.buffers[i % RING][: (b - a) * src.element_size()].view(src.dtype)
            st.copy_async(i, buf, flat_src[a:b])
            return buf

        staged = [issue(i) for i in range(min(RING - 1, len(bounds)))]
        for i, (a, b) in enumerate(bounds):
            st.wait(i)
            if i + RING - 1 < len(bounds):
                # Its buffer is chunk i-1's, converted in the previous iteration.
                staged.append(issue(i + RING - 1))
            convert(staged[i], flat_out[a:b], st.scratch)
            staged[i] = None  # type: ignore[call-overload]
        complete = True  # every copy was waited for
        reports.staging(st.device, RING * st.chunk_bytes + st.scratch.nbytes)
    finally:
        # Give the stager back before anything that can raise (see _Lease).
        stager = lease.stager
        if stager is not None and stager.lessee is lease.ref:
            stager.lessee = None
            if not complete:
                # No copy outlives a failed export; the next borrower synchronizes too, in case
                # this is interrupted.
                stager.synchronize()


def storage_idle(storage: Any, control: object) -> bool:
    """True when nothing outside its pool uses a kept host storage, so it may be written again.

    ``control`` is an object the pool references exactly as it references ``storage`` (once,
    from the same owner): their ``sys.getrefcount`` then differ only by outside references to
    the storage object (``t.untyped_storage()`` held by a caller). The storage's own use count
    covers tensors and views; shared memory may be mapped by another process.
    """
    use_count = getattr(torch._C, "_storage_Use_Count", None)
    return (
        use_count is not None
        and use_count(storage._cdata) == 1
        and sys.getrefcount(storage) == sys.getrefcount(control)
        and not storage.is_shared()
    )


class _Kept:
    """One kept output buffer: its storage, and the export that last took it."""

    __slots__ = ("control", "export", "storage")

    def __init__(self, storage: torch.UntypedStorage, export: object) -> None:
        self.storage = storage
        # Referenced exactly as `storage` is (once, from this object): sys.getrefcount of the
        # two, taken the same way, differs only by the references held outside the cache.
        self.control = object()
        self.export = export


class BufferCache:
    """Host output buffers kept across exports and handed out again once nobody holds them.

    A buffer is reused only when nothing outside this cache can reach its memory: no tensor,
    view, DTensor local tensor or NumPy array (each counts in the storage's use count), no
    ``UntypedStorage`` or ``TypedStorage`` object (``t.untyped_storage()`` and ``t.storage()``
    return the one Python object this cache also holds, so those count in its Python reference
    count), and no other process (a storage moved to shared memory is never reused). So a save
    still in flight, such as a DCP async save that holds the previous export, is never
    overwritten; the next export gets fresh memory instead.

    What is kept is bounded: at the end of each export, :meth:`trim` forgets the idle buffers
    that this export did not take, so the cache holds the last export's buffers plus those that
    were still referenced at its end (dropped by the next export once released), not the peak
    of every export held at once.
    """

    def __init__(self) -> None:
        self._kept: dict[tuple[tuple[int, ...], torch.dtype], list[_Kept]] = {}
        self._lock = threading.Lock()

    @staticmethod
    def _idle(kept: _Kept) -> bool:
        return storage_idle(kept.storage, kept.control)

    def take(self, shape: torch.Size, dtype: torch.dtype, *, export: object = None) -> torch.Tensor:
        """An idle kept buffer of this shape and dtype, else a fresh one that is kept from now on.

        ``export`` names the export taking it (any object); :meth:`trim` keeps what it took.
        """
        key = (tuple(shape), dtype)
        with self._lock:
            for kept in self._kept.get(key, []):
                if self._idle(kept):
                    kept.export = export
                    return torch.empty(0, dtype=dtype).set_(kept.storage, 0, shape)  # type: ignore[call-overload]
            out = empty_host(shape, dtype)
            self._kept.setdefault(key, []).append(_Kept(out.untyped_storage(), export))
            return out

    def trim(self, export: object) -> None:
        """Forgets the idle buffers that ``export`` did not take (called at the end of each)."""
        with self._lock:
            for key, group in list(self._kept.items()):
                group[:] = [k for k in group if k.export is export or not self._idle(k)]
                if not group:
                    del self._kept[key]

    @property
    def nbytes(self) -> int:
        with self._lock:
            return sum(k.storage.nbytes() for group in self._kept.values() for k in group)

    def clear(self) -> None:
        """Forgets every kept buffer; those still in use live on with their users."""
        with self._lock:
            self._kept.clear()


#: Output buffers of exports made with ``Placement(reuse_buffers=True)``.
buffers = BufferCache()


def materialize(
    source: StateSource, *, reuse_buffers: bool = False, export: object = None
) -> torch.Tensor:
    """Produces the exported host tensor for one state, counted in the running operation.

    The result owns a storage of exactly ``numel * element_size`` bytes and shares nothing with
    the optimizer's live state, also when that state already lives on the CPU. With
    ``reuse_buffers``, the output comes from :data:`buffers`, taken on behalf of ``export``
    (see :meth:`BufferCache.trim`).
    """
    if source.kind == "device":
        assert source.on_device is not None
        converted = source.on_device()
        try:
            out, _, _ = _produce(
                StateSource(kind="copy", data=converted), reuse_buffers=reuse_buffers, export=export
            )
        finally:
            del converted  # released before the caller produces the next state
        # TE's FP32 result, made on the device and copied out.
        nbytes = out.numel() * out.element_size()
        reports.exported(source.kind, nbytes, nbytes, device=nbytes)
        return out
    assert source.data is not None
    raw = source.data.numel() * source.data.element_size()
    out, host_temp, device_temp = _produce(source, reuse_buffers=reuse_buffers, export=export)
    out_bytes = out.numel() * out.element_size()
    reports.exported(source.kind, raw, out_bytes, host=host_temp, device=device_temp)
    return out


def _produce(
    source: StateSource, *, reuse_buffers: bool, export: object
) -> tuple[torch.Tensor, int, int]:
    """:func:`materialize` of a stored state, with the host and device temporaries it made."""
    data = source.data
    assert data is not None
    out_dtype, convert = _convert.convert_fn(source)
    out = (
        buffers.take(data.shape, out_dtype, export=export)
        if reuse_buffers
        else empty_host(data.shape, out_dtype)
    )
    host_temp = device_temp = 0
    if not data.is_contiguous():
        # Strided storage: one plain copy first. On a device that costs one contiguous device
        # temporary of the state's own size (torch's cross-device copy); TE never makes these.
        # A dense layout is kept by the first copy, so the second makes another; a layout with
        # gaps is made contiguous by the first, through a contiguous temporary on the device.
        raw = data.numel() * data.element_size()
        dense = memory_order(data) is not None
        host_temp = raw * (2 if dense else 1)
        if not dense and data.device.type != "cpu":
            device_temp = raw
        data = data.to("cpu", copy=True).contiguous()
    _stream_into(data, out, convert)
    return out, host_temp, device_temp


# Every tensor an export produced, while it lives: a private host snapshot that nothing else
# writes, which DCP's async staging may pass through instead of copying again.
# Keyed by id (tensors compare elementwise, so no WeakSet), each entry dropping itself when its
# tensor dies.
_exported: dict[int, weakref.ref[torch.Tensor]] = {}


def _register_export(tensor: torch.Tensor) -> None:
    key = id(tensor)
    _exported[key] = weakref.ref(tensor, lambda _ref: _exported.pop(key, None))


def is_exported(tensor: object) -> bool:
    """True for a tensor (or DTensor) produced by a streaming export and not a view of one."""
    tensor = local(tensor)
    ref = _exported.get(id(tensor))
    return ref is not None and ref() is tensor


def indexed_params(
    saved_groups: list[dict[str, Any]], groups: list[dict[str, Any]]
) -> dict[int, torch.Tensor]:
    # The same pairing as torch's and TE's state_dict: saved indices in group order.
    return dict(
        zip(
            chain.from_iterable(g["params"] for g in saved_groups),
            chain.from_iterable(g["params"] for g in groups),
            strict=True,
        )
    )


def iter_exportable(
    state_dict: Mapping[str, Any], param_groups: list[dict[str, Any]]
) -> Iterator[tuple[Any, torch.Tensor, Mapping[str, Any]]]:
    """Yields ``(key, param, stored_states)`` for each state entry that belongs to a parameter."""
    id_map = indexed_params(state_dict["param_groups"], param_groups)
    for key, value in list(state_dict["state"].items()):
        if key in id_map:
            yield key, id_map[key], value


Plan = list[tuple[Any, torch.Tensor, dict[str, StateSource]]]


def export_optimizer_state(
    state_dict: dict[str, Any], plan: Plan, *, reuse_buffers: bool = False
) -> dict[str, Any]:
    """Replaces each planned parameter's states in ``state_dict`` by host tensors, one at a time.

    Args:
        state_dict: What ``torch.optim.Optimizer.state_dict`` returned; its ``"state"`` entries
            still reference the live state dicts and are replaced, never mutated.
        plan: ``(key, param, {state_name: source})`` for every entry to export, built (and so
            validated) before anything is copied.
        reuse_buffers: Take output buffers from :data:`buffers`, reusing idle ones.

    Returns:
        ``state_dict`` with every planned state on the host.
    """
    # This export's identity: the buffers it takes are the ones the cache keeps.
    export = object()
    for key, param, sources in plan:
        exported: dict[str, Any] = {}
        for name, source in sources.items():
            host = materialize(source, reuse_buffers=reuse_buffers, export=export)
            _register_export(host)
            exported[name] = to_cpu_dtensor(host, param) if isinstance(param, DTensor) else host
            del host
        state_dict["state"][key] = exported
    if reuse_buffers:
        buffers.trim(export)
    return state_dict
