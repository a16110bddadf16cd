"""The exact-conversion rules: every host conversion that must equal TE's bits.

Exports: FP16 and FP8 states widened and scaled with TE's single FP32 rounding, in any FTZ/DAZ
mode, and NaNs canonicalized as CUDA's multiply leaves them (:func:`convert_fn`, per chunk, in
blocks). Loads: FP32 rounded to BF16 with the NaN bits of the kernel torch's conversion of the
whole tensor would take (:func:`to_bf16`, :class:`Slot`), or of a device's cast for host values
that stand in for device ones (:func:`device_bf16_nan`), and device-side writes as TE makes them
(:func:`write_device`). Nothing here knows Transformer Engine or moves memory between devices,
but for the few bytes of that probe, once per device.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable, Iterable
from typing import Any, Protocol

import torch

from . import _reports as reports
from . import _workers
from ._tensors import te_layout_like


class Scratch(Protocol):
    """A host work buffer, grown to the largest request (``_ring.HostScratch``, one per ring)."""

    def get(self, numel: int, dtype: torch.dtype) -> torch.Tensor: ...


class Source(Protocol):
    """What :func:`convert_fn` reads of a stored state (``engine.StateSource``)."""

    @property
    def kind(self) -> str: ...
    @property
    def data(self) -> torch.Tensor | None: ...
    @property
    def scale(self) -> torch.Tensor | None: ...
    @property
    def fp8_dtype(self) -> torch.dtype | None: ...


Convert = Callable[[torch.Tensor, torch.Tensor, Scratch], None]


CANONICAL_NAN_BITS = 0x7FFFFFFF


def canonicalize_nan(out: torch.Tensor) -> None:
    # A CUDA FP32 multiply (mul.f32) returns the canonical NaN 0x7FFFFFFF for any NaN result; an
    # x86 multiply keeps a NaN operand's payload and makes 0xFFC00000 of inf * 0. Only NaNs
    # differ (checked exhaustively on an H200), so rewriting them makes the host result equal
    # TE's GPU result bit for bit.
    nan = out.isnan()
    if bool(nan.any()):
        out.view(torch.int32)[nan] = CANONICAL_NAN_BITS


#: Elements per block of the multi-pass conversions (FP16, FP8); None: 256 Ki per intra-op
#: thread, at least 1 Mi. Each thread's share of a block's FP32 output (1 MiB) stays in its cache
#: across the passes, where passes over a whole chunk would each go to memory. Smaller blocks
#: lose to the thread pool's fork/join: 1 Mi-element blocks on 32 threads measured 2x slower
#: than 4 Mi (docs/performance-log.md).
BLOCK_ELEMENTS: int | None = None


def block_elements() -> int:
    if BLOCK_ELEMENTS is not None:
        return BLOCK_ELEMENTS
    return max(1 << 20, torch.get_num_threads() << 18)


def _blocked(convert: Convert) -> Convert:
    """``convert`` run block by block, on the host workers' team when there is one
    (:mod:`._workers`; the block size then follows the team's thread count).

    Every conversion here is elementwise with per-tensor constants, so any split gives the same
    bits.
    """

    def run(raw: torch.Tensor, out: torch.Tensor, work: Scratch) -> None:
        flat_raw, flat_out = raw.reshape(-1), out.view(-1)
        _workers.call(_in_blocks, convert, flat_raw, flat_out, work, elements=flat_raw.numel())

    return run


def _in_blocks(convert: Convert, raw: torch.Tensor, out: torch.Tensor, work: Scratch) -> None:
    step = block_elements()
    for a in range(0, raw.numel(), step):
        convert(raw[a : a + step], out[a : a + step], work)


def host_copy(out: torch.Tensor, src: torch.Tensor) -> None:
    """``out.copy_(src)`` of two host tensors of one shape, on the host workers' team when there
    is one: torch's own copy, its kernel chosen by the layouts as on any thread count."""
    _workers.call(out.copy_, src, elements=out.numel())


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
        canonicalize_nan(out)


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


def dequantize_e4m3(
    raw: torch.Tensor, out: torch.Tensor, scratch: Scratch, *, scale: float
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


def _copy(raw: torch.Tensor, out: torch.Tensor, scratch: Scratch) -> None:
    # Same dtype (a memcpy), or BF16 widened to FP32, which torch does with integer shifts:
    # exact, in any FTZ/DAZ mode, and elementwise, so on the host workers too.
    host_copy(out.view(-1), raw.reshape(-1))


def _widen_and_scale(smallest: float, scale: float, fp8: torch.dtype | None = None) -> Convert:
    """FP16 or FP8 (E5M2) widened to FP32 (exact; FP32 normals) times ``scale``."""

    def convert(raw: torch.Tensor, out: torch.Tensor, scratch: Scratch) -> None:
        out.copy_(raw if fp8 is None else raw.view(fp8))
        _scale(out, scale, smallest=smallest)

    return convert


# The smallest nonzero magnitude of each widened format: FP16 2**-24, E5M2 2**-16.
_SMALLEST = {torch.float16: 2.0**-24, torch.float8_e5m2: 2.0**-16}


def convert_fn(source: Source) -> tuple[torch.dtype, Convert]:
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
            decode = functools.partial(dequantize_e4m3, scale=scale)
            return torch.float32, _blocked(decode)
        if fp8 == torch.float8_e5m2:
            # TE's own CPU formula (float8_tensor_storage.py L36-42): widen, * scale_inv.
            return torch.float32, _blocked(_widen_and_scale(_SMALLEST[fp8], scale, fp8))
        raise ValueError(
            f"unsupported FP8 dtype {fp8}: valid values are torch.float8_e4m3fn and "
            "torch.float8_e5m2"
        )
    raise ValueError(f"unknown state kind {source.kind!r}")


# --- loads: FP32 to BF16 with the bits of TE's load -------------------------------------------
#
# Every byte must equal what ``dst.copy_(src.float().bfloat16())`` (Transformer Engine's load of
# a BF16 state) leaves. torch's CPU FP32-to-BF16 copy has two kernels that round the same way and
# differ only in NaNs: the vectorized one, taken when the innermost dimension is contiguous in
# both tensors, writes 0xFFFF (on x86; the scalar one writes 0x7FC0). Which one a conversion of
# the whole tensor takes depends on its layout, so a block converted with the other kernel gets
# its NaNs rewritten by the right one.


def vectorized(
    out_strides: tuple[int, ...], shape: tuple[int, ...], in_strides: tuple[int, ...]
) -> bool | None:
    """Whether torch's CPU copy between these layouts takes its vectorized FP32<->BF16 kernel.

    TensorIterator orders dimensions by the output's strides, and the reduced-float copy kernel
    (aten/src/ATen/native/cpu/CopyKernel.cpp, ``reduced_float_type_copy``) runs when the
    innermost one is contiguous in both tensors. None for fewer than two elements.
    """
    dims = [d for d, size in enumerate(shape) if size > 1]
    if not dims:
        return None
    inner = min(dims, key=lambda d: out_strides[d])
    return out_strides[inner] == 1 and in_strides[inner] == 1


def bf16_copy_is_vectorized(src: torch.Tensor) -> bool | None:
    """Whether ``src.float().bfloat16()`` on the host converts with the vectorized kernel.

    None for fewer than two elements, where the kernel is not a matter of strides alone.
    """
    if src.numel() < 2:
        return None
    if src.dtype != torch.float32:
        return True  # .float() makes a dense tensor, converted as one contiguous run
    return vectorized(te_layout_like(src, torch.bfloat16), tuple(src.shape), tuple(src.stride()))


def bf16_by_kernel(values: torch.Tensor, vectorized: bool) -> torch.Tensor:
    """``values`` (1-D FP32) converted to BF16 by torch's vectorized or its scalar kernel."""
    if vectorized:
        return values.bfloat16()
    n = values.numel()
    spaced = torch.zeros(2 * max(n, 2), dtype=torch.float32)[::2]  # strided: the scalar kernel
    spaced[:n].copy_(values)
    return spaced.bfloat16()[:n]


def to_bf16(
    out: torch.Tensor,
    block: torch.Tensor,
    whole_vectorized: bool | None,
    *,
    nan_bits: int | None = None,
) -> None:
    """Converts ``block`` into ``out`` (contiguous BF16) with the bits of the whole conversion,
    on the host workers' team when there is one; with ``nan_bits``, with the bits of a device's
    cast instead (:func:`device_bf16_nan`)."""
    _workers.call(_to_bf16, out, block, whole_vectorized, nan_bits, elements=out.numel())


def _to_bf16(
    out: torch.Tensor,
    block: torch.Tensor,
    whole_vectorized: bool | None,
    nan_bits: int | None = None,
) -> None:
    source = block if block.dtype == torch.float32 else block.float()
    out.copy_(source)
    if nan_bits is not None:
        # A sum is NaN where an element is (or +inf meets -inf): one cheap pass before the mask.
        if source.numel() and math.isnan(float(source.sum())):
            nan = source.isnan()
            out.view(torch.int16)[nan] = nan_bits - (1 << 16) if nan_bits >= 1 << 15 else nan_bits
        return
    mine = vectorized(tuple(out.stride()), tuple(source.shape), tuple(source.stride()))
    if mine is None or whole_vectorized is None or mine != whole_vectorized:
        nan = source.isnan()
        if bool(nan.any()):
            fixed = bf16_by_kernel(source[nan], bool(whole_vectorized))
            out.view(torch.int16)[nan] = fixed.view(torch.int16)


#: FP32 NaNs of both signs, quiet and signalling, with and without payloads.
_NAN_PROBE = (0x7FC00000, 0xFFC00000, 0x7F800001, 0x7FA01234, 0xFFFFFFFF, 0xFF812345)


@functools.cache
def _device_bf16_nan(device: torch.device) -> int:
    probe = torch.tensor(_NAN_PROBE, dtype=torch.int64).to(torch.int32).view(torch.float32)
    return one_nan(probe.to(device).bfloat16().view(torch.int16).tolist(), device)


def one_nan(written: Iterable[int], device: torch.device) -> int:
    """The one BF16 pattern ``device``'s cast wrote for every NaN of the probe (``written``)."""
    patterns = {int(b) & 0xFFFF for b in written}
    if len(patterns) != 1 or min(patterns) & 0x7FFF <= 0x7F80:  # not one NaN
        raise RuntimeError(
            f"{device} rounds FP32 NaNs to BF16 as {sorted(hex(b) for b in patterns)}, not as "
            "one NaN pattern, which te_ckpt_placement's host rounding "
            "does not reproduce: load this optimizer without the policy (for Megatron, "
            "unplace_optimizer), or on a device whose cast writes one NaN (CUDA on sm_80 and "
            "later writes 0x7fff)"
        )
    return patterns.pop()


def device_bf16_nan(device: torch.device) -> int | None:
    """The BF16 bits ``device``'s own FP32-to-BF16 cast writes for every NaN; None for the host.

    TE rounds a BF16 state on the device of the FP32 value it is handed (``_apply_scale``'s
    ``.bfloat16()``). A host value that stands in for a device one (Megatron's load template,
    :mod:`.integrations.megatron`) is rounded on the host with these NaN bits: finite values
    round alike, to nearest even (every FP32 pattern checked on an H200, tests/test_gpu_load.py),
    and CUDA's cast writes 0x7FFF for every NaN on sm_80 and later
    (benchmarks/results/h200_bf16_nan_bits.json), where the host's kernels write 0xFFFF or
    0x7FC0. Probed once per device; a device whose cast does not write one NaN pattern raises
    ``RuntimeError``.
    """
    if device.type == "cpu":
        return None
    if device.index is None and device.type == "cuda":
        device = torch.device("cuda", torch.cuda.current_device())
    return _device_bf16_nan(device)


def write_device(dst: torch.Tensor, src: torch.Tensor) -> None:
    """Writes a device-resident ``src`` into ``dst`` as ``dst.copy_(src.float())`` would.

    For a BF16 ``dst`` the bits are ``src.float().bfloat16()``'s: CUDA's cast is elementwise, so
    an FP32 ``src`` on ``dst``'s device is converted by the copy itself, with no temporary. A
    ``src`` on another device is converted there first, as TE's ``_apply_scale`` does.
    """
    if dst.dtype in (torch.bfloat16, torch.float32):
        elsewhere = src.device != dst.device
        if elsewhere or (dst.dtype == torch.bfloat16 and src.dtype != torch.float32):
            if not elsewhere and src.dtype != torch.float32:
                reports.device_temporary(4 * src.numel())
            src = src.float()
        if elsewhere and dst.dtype == torch.bfloat16:
            src = src.bfloat16()
    with torch.no_grad():
        dst.copy_(src)


class Slot(torch.Tensor):
    """A ring slot handed to the reader: its ``copy_`` leaves the bits of a copy to the device.

    torch's host-to-device ``copy_`` of a tensor of another dtype converts on the host first,
    ``src.to(dst.dtype)`` (aten/src/ATen/native/cuda/Copy.cu, ``copy_kernel_cuda``), and the CPU
    FP32-to-BF16 conversion has two kernels that differ in the bits of NaNs (see
    :func:`to_bf16`). ``.to`` keeps a dense source's layout (the vectorized kernel); a copy into
    this contiguous slot takes the kernel of the source's innermost dimension. Where the two
    differ (a dense source not laid out row-major), or for another pair of dtypes, the slot is
    filled from ``src.to(dtype)`` as torch's copy does; otherwise the copy converts straight
    into the slot.
    """

    @classmethod
    def __torch_function__(cls, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        kwargs = kwargs or {}
        if func is torch.Tensor.copy_ and len(args) in (2, 3) and set(kwargs) <= {"non_blocking"}:
            # dst.copy_(src) and dst.copy_(src, non_blocking): into host memory a copy is
            # complete when it returns either way.
            dst, src = args[:2]
            with torch._C.DisableTorchFunctionSubclass():
                if isinstance(src, torch.Tensor) and not converts_alike(dst, src):
                    src = src.to(dst.dtype)
                dst.copy_(src)
            return dst
        return super().__torch_function__(func, types, args, kwargs)


def converts_alike(dst: torch.Tensor, src: torch.Tensor) -> bool:
    """Whether ``dst.copy_(src)`` on the host leaves the bits of ``src.to(dst.dtype)``."""
    if src.dtype == dst.dtype:
        return True  # a plain copy
    if src.dtype != torch.float32 or dst.dtype != torch.bfloat16 or src.numel() < 2:
        return False  # other conversions: through .to, as torch's copy does
    ours = vectorized(tuple(dst.stride()), tuple(src.shape), tuple(src.stride()))
    return ours == bf16_copy_is_vectorized(src)
