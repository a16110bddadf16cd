"""The streaming export engine: one optimizer state at a time, from device storage to host.

The engine knows torch, not Transformer Engine. The TE adapter describes each stored state as a
:class:`StateSource` (its raw storage and how TE would unscale it); the engine turns that into a
host tensor that owns its storage exactly, and re-wraps it as a CPU-local DTensor when the
parameter is a DTensor. Nothing it produces is kept on the device: the raw bytes are copied to the
host and converted there, so the device memory of the export is zero, except for the opt-in
``"device"`` conversion, which holds one converted FP32 state at a time.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping
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
    "iter_exportable",
    "materialize",
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


def _host_copy(src: torch.Tensor) -> torch.Tensor:
    # empty_like keeps the strides of a dense source, so the device-to-host copy is one memcpy
    # and never needs a contiguous temporary on the device. It also gives the result a storage of
    # exactly its own size, which DCP's writer needs to skip its defensive clone.
    out = torch.empty_like(src, device="cpu")
    out.copy_(src)
    return out


CANONICAL_NAN_BITS = 0x7FFFFFFF


def _canonicalize_nan(out: torch.Tensor) -> None:
    # A CUDA FP32 multiply (mul.f32) returns the canonical NaN 0x7FFFFFFF for any NaN result; an
    # x86 multiply keeps a NaN operand's payload and makes 0xFFC00000 of inf * 0. Only NaNs
    # differ (checked exhaustively on an H200), so rewriting them makes the host result equal
    # TE's GPU result bit for bit.
    nan = out.isnan()
    if bool(nan.any()):
        out.view(torch.int32)[nan] = CANONICAL_NAN_BITS


def materialize(source: StateSource) -> torch.Tensor:
    """Produces the exported host tensor for one state.

    The result owns a storage of exactly ``numel * element_size`` bytes and shares nothing with
    the optimizer's live state, also when that state already lives on the CPU.
    """
    if source.kind == "device":
        assert source.on_device is not None
        converted = source.on_device()
        out = _host_copy(converted)
        del converted  # the device copy is released before the caller produces the next state
        return out

    assert source.data is not None
    raw = _host_copy(source.data)
    if source.kind == "copy":
        return raw
    if source.kind == "upcast":
        out = torch.empty_like(raw, dtype=torch.float32)
        out.copy_(raw)
        return out
    if source.kind in ("scaled", "fp8"):
        assert source.scale is not None
        # The same two steps as TE: widen to FP32 exactly, then one FP32 multiply per element,
        # which rounds identically on any IEEE-754 unit (no fused operation is involved).
        if source.kind == "fp8":
            assert source.fp8_dtype is not None
            raw = raw.view(source.fp8_dtype)
        out = torch.empty_like(raw, dtype=torch.float32)
        out.copy_(raw)
        out.mul_(source.scale.to("cpu", copy=False))
        _canonicalize_nan(out)
        return out
    raise ValueError(f"unknown state kind {source.kind!r}")


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


def export_optimizer_state(state_dict: dict[str, Any], plan: Plan) -> dict[str, Any]:
    """Replaces each planned parameter's states in ``state_dict`` by host tensors, one at a time.

    Args:
        state_dict: What ``torch.optim.Optimizer.state_dict`` returned; its ``"state"`` entries
            still reference the live state dicts and are replaced, never mutated.
        plan: ``(key, param, {state_name: source})`` for every entry to export, built (and so
            validated) before anything is copied.

    Returns:
        ``state_dict`` with every planned state on the host.
    """
    for key, param, sources in plan:
        exported: dict[str, Any] = {}
        for name, source in sources.items():
            host = materialize(source)
            exported[name] = to_cpu_dtensor(host, param) if isinstance(param, DTensor) else host
            del host
        state_dict["state"][key] = exported
    return state_dict
