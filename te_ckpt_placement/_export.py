"""The streaming export engine: one optimizer state at a time, from device storage to host.

The engine knows torch, not Transformer Engine. The TE adapter describes each stored state as a
:class:`StateSource` (its raw storage and how TE would unscale it); the engine turns that into a
host tensor that owns its storage exactly, and re-wraps it as a CPU-local DTensor when the
parameter is a DTensor. Nothing it produces is kept on the device: the raw bytes are copied to the
host and converted there, so the device memory of the export is zero, except for the opt-in
``"device"`` conversion, which holds one converted FP32 state at a time.
"""

from __future__ import annotations

import weakref
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass
from itertools import chain
from typing import Any, Literal

import torch
from torch.distributed.tensor import DTensor

from . import _convert, _pool, _ring
from . import _reports as reports
from ._tensors import local, memory_order, to_cpu_dtensor

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


def materialize(
    source: StateSource, *, reuse_buffers: bool = False, export: object = None
) -> torch.Tensor:
    """Produces the exported host tensor for one state, counted in the running operation.

    The result owns a storage of exactly ``numel * element_size`` bytes and shares nothing with
    the optimizer's live state, also when that state already lives on the CPU. With
    ``reuse_buffers``, the output comes from :data:`._pool.EXPORTS`, taken on behalf of
    ``export`` (see :meth:`._pool.HostPool.end_round`).
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
        _pool.EXPORTS.take(data.shape, out_dtype, round=export)
        if reuse_buffers
        else _pool.empty_host(data.shape, out_dtype)
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
    _ring.stream_into(data, out, convert)
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
        reuse_buffers: Take output buffers from :data:`._pool.EXPORTS`, reusing idle ones.

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
        _pool.EXPORTS.end_round(export)
    return state_dict
