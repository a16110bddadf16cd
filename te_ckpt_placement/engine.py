"""The streaming export engine: one optimizer state at a time, from device storage to host.

The engine knows torch, not Transformer Engine. The TE adapter describes each stored state as a
:class:`StateSource` (its raw storage and how TE would unscale it); the engine turns that into a
host tensor that owns its storage exactly, and re-wraps it as a CPU-local DTensor when the
parameter is a DTensor. Nothing it produces is kept on the device: the raw bytes are copied to the
host and converted there, so the device memory of the export is zero, except for the opt-in
``"device"`` conversion, which holds one converted FP32 state at a time.
"""

from __future__ import annotations

import functools
import math
import weakref
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass
from itertools import chain
from typing import Any, Literal

import torch
from torch.distributed.tensor import DTensor
from torch.distributed.tensor._dtensor_spec import DTensorSpec, TensorMeta

from . import _pool, _ring, reports

__all__ = [
    "Plan",
    "StateSource",
    "export_optimizer_state",
    "is_exported",
    "iter_exportable",
    "fp32_value",
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


CANONICAL_NAN_BITS = 0x7FFFFFFF


def _canonicalize_nan(out: torch.Tensor) -> None:
    # A CUDA FP32 multiply (mul.f32) returns the canonical NaN 0x7FFFFFFF for any NaN result; an
    # x86 multiply keeps a NaN operand's payload and makes 0xFFC00000 of inf * 0. Only NaNs
    # differ (checked exhaustively on an H200), so rewriting them makes the host result equal
    # TE's GPU result bit for bit.
    nan = out.isnan()
    if bool(nan.any()):
        out.view(torch.int32)[nan] = CANONICAL_NAN_BITS


# The host buffers live in ._pool and the device-to-host ring in ._ring; the conversions below
# take the ring's scratch buffer.
_Scratch = _ring.Scratch
Convert = _ring.Convert


#: Elements per block of the multi-pass conversions (FP16, FP8); None: 256 Ki per intra-op
#: thread, at least 1 Mi. Each thread's share of a block's FP32 output (1 MiB) stays in its cache
#: across the passes, where passes over a whole chunk would each go to memory. Smaller blocks
#: lose to the thread pool's fork/join: 1 Mi-element blocks on 32 threads measured 2x slower
#: than 4 Mi (docs/performance-log.md).
BLOCK_ELEMENTS: int | None = None


def _block_elements() -> int:
    if BLOCK_ELEMENTS is not None:
        return BLOCK_ELEMENTS
    return max(1 << 20, torch.get_num_threads() << 18)


def _blocked(convert: Convert) -> Convert:
    def run(raw: torch.Tensor, out: torch.Tensor, scratch: _Scratch) -> None:
        flat_raw, flat_out = raw.reshape(-1), out.view(-1)
        step = _block_elements()
        for a in range(0, flat_raw.numel(), step):
            convert(flat_raw[a : a + step], flat_out[a : a + step], scratch)

    return run


# --- exact FP32 scaling, whatever the thread's FTZ/DAZ mode -------------------------------------
#
# A thread with flush-to-zero (FTZ) writes 0 for an FP32 result below 2**-126, and one with
# denormals-are-zero (DAZ) reads a subnormal operand as 0 (torch.set_flush_denormal sets both;
# so can a native library built with -ffast-math). TE's GPU conversion keeps subnormals. No
# result below depends on an FP32 instruction reading or writing a subnormal: stored values are
# widened to FP32 normals (FP16 and FP8 values all are), scales are read from their bits, and
# where a product can be subnormal it is formed in FP64 (exact and normal) and its subnormal
# bits are made with integer arithmetic. BF16, FP32 and int16 states are copied as bits. The
# result does not depend on the mode of any thread.

_FP32_MIN_NORMAL = 2.0**-126
_FP32_MAX = float(torch.finfo(torch.float32).max)


def fp32_value(scale: torch.Tensor) -> float:
    """The exact value of a one-element FP32 tensor, read from its bits.

    ``float(tensor)`` widens FP32 to FP64 with an instruction that reads a subnormal as 0 under
    DAZ; this builds the value with integer arithmetic instead.
    """
    if scale.dtype != torch.float32 or scale.numel() != 1:
        raise ValueError(
            f"a scale must be a one-element torch.float32 tensor, got {scale.dtype} with "
            f"{scale.numel()} elements"
        )
    bits = int(scale.detach().reshape(1).view(torch.int32).item()) & 0xFFFFFFFF
    exponent, mantissa = (bits >> 23) & 0xFF, bits & 0x7FFFFF
    if exponent == 0xFF:
        magnitude = math.nan if mantissa else math.inf
    elif exponent == 0:
        magnitude = math.ldexp(mantissa, -149)
    else:
        magnitude = math.ldexp(mantissa | 0x800000, exponent - 150)
    return -magnitude if bits >> 31 else magnitude


def _mul_exact(out: torch.Tensor, factor: float) -> None:
    """``out *= factor`` with one rounding to FP32, subnormal results included, in any mode.

    ``out`` holds FP32 normals, zeros, infinities and NaNs, never subnormals, and ``factor`` is an
    FP32 value. Their product in FP64 is exact (24 + 24 significant bits) and an FP64 normal,
    so no FTZ/DAZ mode touches it, and rounding it to FP32 gives the right bits wherever the
    result is normal. Where it is below ``2**-126``, ``|p| * 2**149`` rounded half to even is the
    subnormal's magnitude pattern, which the rounding to FP32 also gives unless FTZ made it 0.
    Capped at ``2**23`` (the smallest normal's pattern; ``fmin`` also turns a NaN into the cap),
    that pattern is never above a normal result's, so the larger of the two magnitudes is right
    everywhere (a NaN's or an infinity's is above both), with no mask and no gather.
    """
    wide = out.double().mul_(factor)
    out.copy_(wide)
    bits = out.view(torch.int32)
    sign = bits.bitwise_and(-(1 << 31))
    subnormal = wide.abs_().mul_(2.0**149).round_()
    torch.fmin(subnormal, subnormal.new_full((), 2.0**23), out=subnormal)
    torch.maximum(bits.bitwise_and_(0x7FFFFFFF), subnormal.to(torch.int32), out=bits)
    bits.bitwise_or_(sign)


def _scale(out: torch.Tensor, factor: float, *, smallest: float) -> None:
    """TE's ``out * scale`` in FP32 (one rounding), exact whatever the FTZ/DAZ mode.

    ``smallest`` is the smallest nonzero magnitude in ``out``. Unless a product can fall below
    ``2**-126`` (a tiny scale), every operand and result is an FP32 normal and the plain
    vectorized multiply is exact in any mode; otherwise the product goes through FP64.
    """
    if 0.0 < abs(factor) * smallest < _FP32_MIN_NORMAL:
        _mul_exact(out, factor)
    else:
        # The float is an FP32 value: torch multiplies the FP32 tensor by it in FP32.
        out.mul_(factor)
    # A NaN makes the sum NaN; a cheap read pass replaces an isnan mask for the rare block that
    # can hold one (an infinite sum only says "look closer").
    if not math.isfinite(float(out.sum())):
        _canonicalize_nan(out)


# The 7 magnitude bits of an E4M3 byte, moved to bits 13..7 of an FP16 pattern, put E4M3's
# exponent and mantissa in FP16's low exponent bits and high mantissa bits: the FP16 value is
# the E4M3 value times 2**-8 exactly, E4M3 subnormals included (FP16 subnormals then). Widening
# FP16 to FP32 yields FP32 normals, and torch's widening (vector and scalar) does not read FP16
# subnormals as 0 under DAZ: tests/test_engine_exactness.py checks it with the mode on in every
# thread.
_E4M3_AS_FP16 = 2.0**-8
_E4M3_SMALLEST = 2.0**-9
# Bytes 0x7F and 0xFF (E4M3's NaNs) come out as +-1.875 (+-480 * 2**-8), which no finite E4M3
# value gives (the largest is 448).
_E4M3_NAN_AS = 480.0 * _E4M3_AS_FP16
_FP16_SIGN_AND_MAGNITUDE = 0xBF80 - (1 << 16)  # bit 15 and bits 13..7, as a signed int16


def _dequantize_e4m3(
    raw: torch.Tensor, out: torch.Tensor, scratch: _Scratch, *, scale: float
) -> None:
    """``float(e4m3 byte) * scale`` with the bits of TE's formula (widen, multiply, CUDA NaN).

    torch's FP8 widening is a scalar loop and an ``isnan`` mask another slow pass (about 4 ns
    per element together on one core); these are vectorized 16-bit integer passes, one FP16
    widening and FP32 passes. The exhaustive tests check every byte against TE's formula.
    """
    half = scratch.get(raw.numel(), torch.int16)
    half.copy_(raw.view(torch.int8))  # sign-extended: the sign fills bits 15..7
    half.bitwise_left_shift_(7)  # magnitude to bits 13..7, the sign in bits 15 and 14
    half.bitwise_and_(_FP16_SIGN_AND_MAGNITUDE)  # the sign at bit 15 only
    out.copy_(half.view(torch.float16))  # exact: E4M3 value * 2**-8, an FP32 normal
    low, high = torch.aminmax(out)
    if float(high) == _E4M3_NAN_AS or float(low) == -_E4M3_NAN_AS:
        out[out.abs() == _E4M3_NAN_AS] = math.nan
    # One multiply by scale * 2**8 (exact in FP64, and an FP32 value unless it overflows FP32)
    # rounds the exact product once, as TE's multiply does.
    factor, smallest = scale / _E4M3_AS_FP16, _E4M3_SMALLEST * _E4M3_AS_FP16
    if math.isfinite(scale) and abs(factor) > _FP32_MAX:
        out.mul_(1.0 / _E4M3_AS_FP16)  # exact: a power of two, normal results
        factor, smallest = scale, _E4M3_SMALLEST
    _scale(out, factor, smallest=smallest)


def _copy(raw: torch.Tensor, out: torch.Tensor, scratch: _Scratch) -> None:
    # Same dtype (a memcpy), or BF16 widened to FP32, which torch does with integer shifts:
    # exact, in any FTZ/DAZ mode.
    out.copy_(raw)


def _widen_and_scale(smallest: float, scale: float, fp8: torch.dtype | None = None) -> Convert:
    """FP16 or FP8 (E5M2) widened to FP32 (exact; FP32 normals) times ``scale``."""

    def convert(raw: torch.Tensor, out: torch.Tensor, scratch: _Scratch) -> None:
        out.copy_(raw if fp8 is None else raw.view(fp8))
        _scale(out, scale, smallest=smallest)

    return convert


# The smallest nonzero magnitude of each widened format: FP16 2**-24, E5M2 2**-16.
_SMALLEST = {torch.float16: 2.0**-24, torch.float8_e5m2: 2.0**-16}


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
        scale = fp32_value(source.scale)
        return torch.float32, _blocked(_widen_and_scale(_SMALLEST[torch.float16], scale))
    if source.kind == "fp8":
        assert source.scale is not None and source.fp8_dtype is not None
        scale, fp8 = fp32_value(source.scale), source.fp8_dtype
        if fp8 == torch.float8_e4m3fn:
            return torch.float32, _blocked(functools.partial(_dequantize_e4m3, scale=scale))
        if fp8 == torch.float8_e5m2:
            # TE's own CPU formula (float8_tensor_storage.py L36-42): widen, * scale_inv.
            return torch.float32, _blocked(_widen_and_scale(_SMALLEST[fp8], scale, fp8))
        raise ValueError(
            f"unsupported FP8 dtype {fp8}: valid values are torch.float8_e4m3fn and "
            "torch.float8_e5m2"
        )
    raise ValueError(f"unknown state kind {source.kind!r}")


def materialize(
    source: StateSource, *, reuse_buffers: bool = False, export: object = None
) -> torch.Tensor:
    """Produces the exported host tensor for one state.

    The result owns a storage of exactly ``numel * element_size`` bytes and shares nothing with
    the optimizer's live state, also when that state already lives on the CPU. With
    ``reuse_buffers``, the output comes from :data:`._pool.EXPORTS`, taken on behalf of
    ``export`` (see :meth:`._pool.HostPool.end_round`).
    """
    if source.kind == "device":
        assert source.on_device is not None
        converted = source.on_device()
        try:
            return materialize(
                StateSource(kind="copy", data=converted), reuse_buffers=reuse_buffers, export=export
            )
        finally:
            del converted  # released before the caller produces the next state

    data = source.data
    assert data is not None
    out_dtype, convert = _convert_fn(source)
    out = (
        _pool.EXPORTS.take(data.shape, out_dtype, round=export)
        if reuse_buffers
        else _pool.empty_host(data.shape, out_dtype)
    )
    if not data.is_contiguous():
        # Strided storage: one plain copy first. On a device that costs one contiguous device
        # temporary of the state's own size (torch's cross-device copy); TE never makes these.
        data = data.to("cpu", copy=True).contiguous()
    _ring.stream_into(data, out, convert)
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
        reuse_buffers: Take output buffers from :data:`._pool.EXPORTS`, reusing idle ones.

    Returns:
        ``state_dict`` with every planned state on the host.
    """
    # This export's identity: the buffers it takes are the ones the cache keeps.
    export = object()
    recorder = reports.active()
    for key, param, sources in plan:
        exported: dict[str, Any] = {}
        for name, source in sources.items():
            host = materialize(source, reuse_buffers=reuse_buffers, export=export)
            if recorder is not None:
                recorder.exported(source.kind, source.data, host)
            _register_export(host)
            exported[name] = to_cpu_dtensor(host, param) if isinstance(param, DTensor) else host
            del host
        state_dict["state"][key] = exported
    if reuse_buffers:
        _pool.EXPORTS.end_round(export)
    return state_dict
