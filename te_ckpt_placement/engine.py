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
import functools
import math
import os
import sys
import threading
import weakref
from collections.abc import Callable, Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass
from itertools import chain
from typing import Any, Literal

import torch
from torch.distributed.tensor import DTensor
from torch.distributed.tensor._dtensor_spec import DTensorSpec, TensorMeta

__all__ = [
    "Plan",
    "StateSource",
    "export_optimizer_state",
    "is_exported",
    "iter_exportable",
    "clear_pinned_pool",
    "empty_host",
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


CANONICAL_NAN_BITS = 0x7FFFFFFF


def _canonicalize_nan(out: torch.Tensor) -> None:
    # A CUDA FP32 multiply (mul.f32) returns the canonical NaN 0x7FFFFFFF for any NaN result; an
    # x86 multiply keeps a NaN operand's payload and makes 0xFFC00000 of inf * 0. Only NaNs
    # differ (checked exhaustively on an H200), so rewriting them makes the host result equal
    # TE's GPU result bit for bit.
    nan = out.isnan()
    if bool(nan.any()):
        out.view(torch.int32)[nan] = CANONICAL_NAN_BITS


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


class _Stager:
    """Pinned ring buffers and a copy stream for one CUDA device, reused across exports.

    For host-resident sources (the CPU stand-in) the same ring runs with plain buffers and
    synchronous copies, so one code path serves both.
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
    def nbytes(self) -> int:
        return sum(b.numel() for b in self.buffers)


_pool: dict[tuple[torch.device, int], list[_Stager]] = {}
_pool_all: list[_Stager] = []
_pool_lock = threading.Lock()


@contextmanager
def _stager(device: torch.device) -> Iterator[_Stager]:
    """Lends a stager; concurrent exports get their own, and every one is reused later."""
    key = (device, CHUNK_BYTES)
    with _pool_lock:
        free = _pool.setdefault(key, [])
        stager = free.pop() if free else None
    if stager is None:
        stager = _Stager(device, CHUNK_BYTES)
        with _pool_lock:
            _pool_all.append(stager)
    try:
        yield stager
    finally:
        # Copies still in flight write into the pinned buffers: finish them before the next
        # borrower (or an error path) can reuse or free anything they touch.
        stager.synchronize()
        with _pool_lock:
            _pool[key].append(stager)


def staging_in_use() -> int:
    """How many stagers are lent out right now (0 between exports)."""
    with _pool_lock:
        return len(_pool_all) - sum(len(free) for free in _pool.values())


def pinned_pool_bytes() -> int:
    """Pinned host bytes held by the staging pool (constant once warm, whatever the export)."""
    with _pool_lock:
        return sum(s.nbytes for s in _pool_all)


def clear_pinned_pool() -> None:
    """Releases the idle staging buffers (the next export allocates them again)."""
    with _pool_lock:
        for free in _pool.values():
            for stager in free:
                _pool_all.remove(stager)
            free.clear()


Convert = Callable[[torch.Tensor, torch.Tensor], None]


def _stream_into(src: torch.Tensor, out: torch.Tensor, convert: Convert) -> None:
    """Moves ``src`` (contiguous) into the host tensor ``out`` chunk by chunk.

    Chunk k+1 is copied to pinned memory on a side stream while the host converts chunk k into
    ``out``; the device never allocates anything.
    """
    flat_src, flat_out = src.reshape(-1), out.view(-1)
    n = flat_src.numel()
    with _stager(src.device) as st:
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
            convert(staged[i], flat_out[a:b])
            staged[i] = None  # type: ignore[call-overload]


#: Elements per block of the multi-pass conversions (FP16, FP8); None: 256 Ki per intra-op
#: thread, at least 1 Mi. Each thread's share of a block's FP32 output (1 MiB) stays in its cache
#: across the passes, where passes over a whole chunk would each go to memory. Smaller blocks
#: lose to the thread pool's fork/join: 1 Mi-element blocks on 32 threads measured 2x slower
#: than 4 Mi (benchmarks/NOTES.md).
BLOCK_ELEMENTS: int | None = None


def _block_elements() -> int:
    if BLOCK_ELEMENTS is not None:
        return BLOCK_ELEMENTS
    return max(1 << 20, torch.get_num_threads() << 18)


def _blocked(convert: Convert) -> Convert:
    def run(raw: torch.Tensor, out: torch.Tensor) -> None:
        flat_raw, flat_out = raw.reshape(-1), out.view(-1)
        step = _block_elements()
        for a in range(0, flat_raw.numel(), step):
            convert(flat_raw[a : a + step], flat_out[a : a + step])

    return run


# E4M3 magnitude bits moved into an FP32 exponent and mantissa read as 2**(e - 127) * (1 + m/8)
# (or m * 2**-149 for e = 0); this factor rebiases them to E4M3's 2**(e - 7) exactly.
_E4M3_REBIAS = 2.0**120
# Bytes 0x7F and 0xFF (E4M3's NaNs) come out of the bit move as +-480, which no finite E4M3
# value is (the largest is 448).
_E4M3_NAN_AS = 480.0
_SIGN_AND_MAGNITUDE = 0x87F00000 - (1 << 32)  # as a signed int32


def _dequantize_e4m3(raw: torch.Tensor, out: torch.Tensor, *, scale: torch.Tensor) -> None:
    """``float(e4m3 byte) * scale`` with the bits of TE's formula (widen, multiply, CUDA NaN).

    torch's FP8 widening is a scalar loop and an ``isnan`` mask another slow pass (about 4 ns
    per element together on one core); these are vectorized integer and FP32 passes. The
    exhaustive GPU test checks every byte against TE's kernels.
    """
    bits = out.view(torch.int32)
    bits.copy_(raw.view(torch.int8))  # sign-extended: the sign fills bits 31..7
    bits.bitwise_left_shift_(20)  # magnitude (e4 m3) to bits 26..20
    bits.bitwise_and_(_SIGN_AND_MAGNITUDE)  # the sign at bit 31 only
    out.mul_(_E4M3_REBIAS)  # exact: a power of two, and every result is a normal FP32
    low, high = torch.aminmax(out)
    if float(high) == _E4M3_NAN_AS or float(low) == -_E4M3_NAN_AS:
        out[out.abs() == _E4M3_NAN_AS] = math.nan
    out.mul_(scale)  # TE's single FP32 rounding
    if not math.isfinite(float(out.sum())):
        _canonicalize_nan(out)


def _copy(raw: torch.Tensor, out: torch.Tensor) -> None:
    out.copy_(raw)  # same dtype, or BF16 widened to FP32, which is exact


def _convert_fn(source: StateSource) -> tuple[torch.dtype, Convert]:
    """The output dtype and the per-chunk host arithmetic of one state kind."""
    if source.kind in ("copy", "upcast"):
        assert source.data is not None
        dtype = source.data.dtype if source.kind == "copy" else torch.float32
        return dtype, _copy
    if source.kind == "scaled":
        assert source.scale is not None
        # A Python float holds the FP32 scale exactly, and torch multiplies an FP32 tensor by it
        # in FP32: the same single rounding as TE's multiply by the one-element scale tensor,
        # on the vectorized path (a mixed-dtype multiply is about eight times slower).
        factor = float(source.scale.reshape(-1)[0])

        def scaled(raw: torch.Tensor, out: torch.Tensor) -> None:
            out.copy_(raw)  # FP16 to FP32 is exact
            out.mul_(factor)
            # A NaN makes the sum NaN; a cheap read pass replaces an isnan mask for the rare
            # chunk that can hold one (an infinite sum only says "look closer").
            if not math.isfinite(float(out.sum())):
                _canonicalize_nan(out)

        return torch.float32, _blocked(scaled)
    if source.kind == "fp8":
        assert source.scale is not None and source.fp8_dtype is not None
        scale, fp8 = source.scale.to("cpu"), source.fp8_dtype
        if fp8 == torch.float8_e4m3fn:
            return torch.float32, _blocked(functools.partial(_dequantize_e4m3, scale=scale))

        # TE's own CPU formula (float8_tensor_storage.py L36-42): widen, multiply by scale_inv.
        def dequantize(raw: torch.Tensor, out: torch.Tensor) -> None:
            out.copy_(raw.view(fp8))
            out.mul_(scale)
            _canonicalize_nan(out)

        return torch.float32, _blocked(dequantize)
    raise ValueError(f"unknown state kind {source.kind!r}")


class BufferCache:
    """Host output buffers kept across exports and handed out again once nobody holds them.

    A buffer is reused only when its storage has no user left (no tensor, view, or DTensor
    local tensor outside this cache), so a save still in flight, such as a DCP async save that
    holds the previous export, is never overwritten; the next export gets fresh memory instead.
    """

    def __init__(self) -> None:
        self._storages: dict[tuple[tuple[int, ...], torch.dtype], list[Any]] = {}
        self._lock = threading.Lock()

    @staticmethod
    def _idle(storage: Any) -> bool:
        use_count = getattr(torch._C, "_storage_Use_Count", None)
        return use_count is not None and use_count(storage._cdata) == 1

    def take(self, shape: torch.Size, dtype: torch.dtype) -> torch.Tensor:
        key = (tuple(shape), dtype)
        with self._lock:
            for storage in self._storages.get(key, []):
                if self._idle(storage):
                    return torch.empty(0, dtype=dtype).set_(storage, 0, shape)  # type: ignore[call-overload]
            out = empty_host(shape, dtype)
            self._storages.setdefault(key, []).append(out.untyped_storage())
            return out

    @property
    def nbytes(self) -> int:
        with self._lock:
            return sum(s.nbytes() for group in self._storages.values() for s in group)

    def clear(self) -> None:
        """Forgets every kept buffer; those still in use live on with their users."""
        with self._lock:
            self._storages.clear()


#: Output buffers of exports made with ``Placement(reuse_buffers=True)``.
buffers = BufferCache()


def materialize(source: StateSource, *, reuse_buffers: bool = False) -> torch.Tensor:
    """Produces the exported host tensor for one state.

    The result owns a storage of exactly ``numel * element_size`` bytes and shares nothing with
    the optimizer's live state, also when that state already lives on the CPU.
    """
    if source.kind == "device":
        assert source.on_device is not None
        converted = source.on_device()
        try:
            return materialize(
                StateSource(kind="copy", data=converted), reuse_buffers=reuse_buffers
            )
        finally:
            del converted  # released before the caller produces the next state

    data = source.data
    assert data is not None
    out_dtype, convert = _convert_fn(source)
    out = (
        buffers.take(data.shape, out_dtype) if reuse_buffers else empty_host(data.shape, out_dtype)
    )
    if data.is_contiguous():
        _stream_into(data, out, convert)
    else:
        # Strided storage: one plain copy first. On a device that costs one contiguous device
        # temporary of the state's own size (torch's cross-device copy); TE never makes these.
        raw = data.to("cpu", copy=True).contiguous()
        convert(raw, out)
    return out


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
    if isinstance(tensor, DTensor):
        tensor = tensor._local_tensor
    ref = _exported.get(id(tensor))
    return ref is not None and ref() is tensor


def to_cpu_dtensor(local: torch.Tensor, like: DTensor) -> DTensor:
    """Wraps a host tensor as a DTensor with ``like``'s mesh, placements, global shape and stride.

    ``DTensor.from_local`` would move a CPU tensor back to a CUDA mesh's device, so this builds
    the spec the way ``from_local`` does and calls the constructor FSDP2's CPU offload uses.
    """
    spec = DTensorSpec(
        like.device_mesh,
        tuple(like.placements),
        tensor_meta=TensorMeta(like.size(), like.stride(), local.dtype),
    )
    return DTensor(local, spec, requires_grad=False)  # type: ignore[call-arg]


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
    for key, param, sources in plan:
        exported: dict[str, Any] = {}
        for name, source in sources.items():
            host = materialize(source, reuse_buffers=reuse_buffers)
            _register_export(host)
            exported[name] = to_cpu_dtensor(host, param) if isinstance(param, DTensor) else host
            del host
        state_dict["state"][key] = exported
    return state_dict
