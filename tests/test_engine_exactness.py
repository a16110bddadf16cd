"""Host conversions are exact whatever the FTZ/DAZ mode of the calling thread and the workers.

The reference is computed from the stored bits with Python integers (exact product, rounded to
FP32 half to even, CUDA's NaN), independently of torch's FP32 arithmetic and of any thread's
mode, and is itself checked against an IEEE FP32 multiply with the mode off.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Iterator

import pytest
import torch

from te_ckpt_placement import _convert, export_placement
from te_ckpt_placement._export import StateSource, materialize

from .support import denormals
from .support.helpers import exported_tensors
from .support.standin import make_optimizer, train
from .support.workers import small_team

pytestmark = pytest.mark.usefixtures("hooked_standin")

CANONICAL_NAN = 0x7FFFFFFF


# --- the reference: exact products rounded to FP32 with integers ------------------------------

Decoded = tuple[bool, int, int] | str  # (negative, p, k) for p * 2**k, or "nan" / "inf"


def decode(bits: int, exponent_bits: int, mantissa_bits: int) -> tuple[bool, int, int] | str:
    """An IEEE-style pattern as ``(negative, p, k)`` with value ``p * 2**k``, or "nan"/"inf"."""
    negative = bool(bits >> (exponent_bits + mantissa_bits))
    exponent = (bits >> mantissa_bits) & ((1 << exponent_bits) - 1)
    mantissa = bits & ((1 << mantissa_bits) - 1)
    bias = (1 << (exponent_bits - 1)) - 1
    if exponent == (1 << exponent_bits) - 1:
        return "nan" if mantissa else ("-inf" if negative else "inf")
    if exponent == 0:
        return negative, mantissa, 1 - bias - mantissa_bits
    return negative, mantissa | (1 << mantissa_bits), exponent - bias - mantissa_bits


def decode_e4m3(byte: int) -> tuple[bool, int, int] | str:
    if byte & 0x7F == 0x7F:
        return "nan"  # E4M3 (fn) has no infinities; exponent 15 is finite except mantissa 7
    negative, exponent, mantissa = bool(byte >> 7), (byte >> 3) & 0xF, byte & 7
    if exponent == 0:
        return negative, mantissa, -9
    return negative, mantissa | 8, exponent - 10


def fp32_bits(negative: bool, p: int, k: int) -> int:
    """``(-1)**negative * p * 2**k`` rounded to FP32 (half to even), as its bit pattern."""
    sign = 0x80000000 if negative else 0
    if p == 0:
        return sign
    e = p.bit_length() - 1 + k
    shift = (-149 - k) if e < -126 else (e - 23 - k)
    if shift <= 0:
        q = p << -shift
    else:
        q, r = divmod(p, 1 << shift)
        half = 1 << (shift - 1)
        if r > half or (r == half and q & 1):
            q += 1
    if e < -126:
        return sign | q  # 2**23 here is the smallest normal's pattern
    if q == 1 << 24:
        q, e = q >> 1, e + 1
    if e > 127:
        return sign | 0x7F800000
    return sign | ((e + 127) << 23) | (q - (1 << 23))


def product_bits(value: tuple[bool, int, int] | str, scale: tuple[bool, int, int] | str) -> int:
    """TE's ``value * scale`` in FP32 as CUDA writes it (one rounding, NaN 0x7FFFFFFF)."""
    if value == "nan" or scale == "nan":
        return CANONICAL_NAN
    if isinstance(value, str) or isinstance(scale, str):  # an infinity
        finite = scale if isinstance(value, str) else value
        if not isinstance(finite, str) and finite[1] == 0:
            return CANONICAL_NAN  # inf * 0
        sign_v = value.startswith("-") if isinstance(value, str) else value[0]
        sign_s = scale.startswith("-") if isinstance(scale, str) else scale[0]
        return (0x80000000 if sign_v != sign_s else 0) | 0x7F800000
    return fp32_bits(value[0] != scale[0], value[1] * scale[1], value[2] + scale[2])


def fp32_pattern(value: float) -> int:
    """The FP32 pattern of a Python float that is an FP32 value (exact, from its FP64 bits)."""
    import struct

    d = struct.unpack("<Q", struct.pack("<d", value))[0]
    if math.isnan(value):
        return 0x7FC00000
    negative = bool(d >> 63)
    exponent, mantissa = (d >> 52) & 0x7FF, d & ((1 << 52) - 1)
    if exponent == 0x7FF:
        return (0x80000000 if negative else 0) | 0x7F800000
    if exponent == 0:
        assert mantissa == 0, "FP64 subnormals are not FP32 values"
        return 0x80000000 if negative else 0
    bits = fp32_bits(negative, mantissa | (1 << 52), exponent - 1075)
    assert decode(bits, 8, 23) != "nan"
    return bits


DECODERS = {
    torch.float8_e4m3fn: (8, decode_e4m3),
    torch.float8_e5m2: (8, lambda b: decode(b, 5, 2)),
    torch.float16: (16, lambda b: decode(b, 5, 10)),
}


@functools.cache
def reference(dtype: torch.dtype, scale: int) -> torch.Tensor:
    """FP32 bits (int32) of every stored pattern of ``dtype`` times the FP32 pattern ``scale``."""
    width, decoder = DECODERS[dtype]
    s = decode(scale, 8, 23)
    return torch.tensor([int32(product_bits(decoder(b), s)) for b in range(1 << width)])


def every_pattern(dtype: torch.dtype) -> torch.Tensor:
    width = DECODERS[dtype][0]
    raw = torch.arange(1 << width, dtype=torch.int32)
    return raw.to(torch.uint8) if width == 8 else raw.to(torch.int16).view(torch.float16)


def int32(bits: int) -> int:
    return bits - (1 << 32) if bits >> 31 else bits


SCALES = denormals.SCALES


def test_the_reference_is_ieee_fp32() -> None:
    """With the mode off, the integer reference equals torch's own FP32 multiply (and TE's)."""
    assert denormals.probe() == (False, False)
    for dtype in DECODERS:
        widened = every_pattern(dtype)
        widened = widened.view(dtype).float() if widened.dtype == torch.uint8 else widened.float()
        for scale in SCALES:
            ieee = widened * denormals.scale_tensor(scale)
            ieee.view(torch.int32)[ieee.isnan()] = CANONICAL_NAN
            assert torch.equal(ieee.view(torch.int32), reference(dtype, scale)), (dtype, hex(scale))


# --- the flush modes ------------------------------------------------------------------------


@pytest.fixture(params=denormals.MODES)
def flush_mode(request: pytest.FixtureRequest) -> Iterator[str]:
    """Flush-denormal on in the calling thread, in the intra-op workers, or in both (the host
    workers' team counts as workers: it is sized first, so that it is flushed too)."""
    if "host_workers" in request.fixturenames:
        request.getfixturevalue("host_workers")
    with denormals.flushing(request.param):
        yield request.param


@pytest.fixture(params=[0, 3], ids=["calling_thread", "host_workers"])
def host_workers(request: pytest.FixtureRequest) -> Iterator[int]:
    """Conversions on the calling thread (no team) or on a team of 3 host workers."""
    with small_team(request.param) as used:
        yield used


def copies(width: int) -> int:
    """Enough copies of every pattern that each conversion pass spreads over every thread
    (torch splits an elementwise op into 32 Ki-element grains), every pattern in every grain."""
    return max(1, (torch.get_num_threads() << 16) >> width)


def bit_mismatch(ours: torch.Tensor, expected: torch.Tensor, what: str) -> str | None:
    ours_bits = ours.view(torch.int32)
    same = ours_bits == expected
    if bool(same.all()):
        return None
    where = (~same).nonzero().flatten()[:4].tolist()
    return (
        f"{what}: {int((~same).sum())} of {same.numel()} differ, e.g. at {where}: ours "
        f"{[hex(int(ours_bits[i]) & 0xFFFFFFFF) for i in where]} expected "
        f"{[hex(int(expected[i]) & 0xFFFFFFFF) for i in where]}"
    )


@pytest.mark.parametrize("dtype", list(DECODERS), ids=str)
def test_every_pattern_times_every_scale_class(
    flush_mode: str, host_workers: int, dtype: torch.dtype
) -> None:
    width = DECODERS[dtype][0]
    stored = every_pattern(dtype).repeat(copies(width))
    failures = []
    for scale in SCALES:
        tensor = denormals.scale_tensor(scale)
        if dtype == torch.float16:
            source = StateSource(kind="scaled", data=stored, scale=tensor)
        else:
            source = StateSource(kind="fp8", data=stored, scale=tensor, fp8_dtype=dtype)
        ours = materialize(source)
        expected = reference(dtype, scale).repeat(copies(width))
        failure = bit_mismatch(ours, expected, f"scale {hex(scale)} ({flush_mode})")
        if failure:
            failures.append(failure)
    assert not failures, "\n".join(failures)


def test_bf16_fp32_int16_states_are_copied_bits(flush_mode: str, host_workers: int) -> None:
    every = torch.arange(-(1 << 15), 1 << 15, dtype=torch.int32).to(torch.int16).repeat(16)
    upcast = materialize(StateSource(kind="upcast", data=every.view(torch.bfloat16)))
    assert torch.equal(upcast.view(torch.int32), every.to(torch.int32).bitwise_left_shift(16))
    # FP32 subnormals (and every other class) as stored, and int16 master remainders.
    fp32_bits = torch.randint(-(1 << 31), (1 << 31) - 1, (1 << 20,), dtype=torch.int32)
    fp32_bits[::3] &= 0x807FFFFF  # a third of them subnormal
    copied = materialize(StateSource(kind="copy", data=fp32_bits.view(torch.float32)))
    assert torch.equal(copied.view(torch.int32), fp32_bits)
    assert torch.equal(materialize(StateSource(kind="copy", data=every)), every)


def test_scale_is_read_from_its_bits(flush_mode: str) -> None:
    for scale in SCALES:
        value = _convert.fp32_value(denormals.scale_tensor(scale))
        if decode(scale, 8, 23) == "nan":
            assert math.isnan(value)
        else:
            assert fp32_pattern(value) == scale, hex(scale)


# --- trained-like states through the whole export ---------------------------------------------


def trained_like_fp8(numel: int, seed: int) -> torch.Tensor:
    """E4M3 bytes of Adam-like magnitudes spread over many decades, quantized as TE does (the
    amax to 448), so that many bytes are subnormal."""
    gen = torch.Generator().manual_seed(seed)
    values = torch.exp(torch.randn(numel, generator=gen, dtype=torch.float64) * 4)
    values *= torch.randn(numel, generator=gen, dtype=torch.float64)
    quantized = (values * (448.0 / float(values.abs().max()))).to(torch.float8_e4m3fn)
    return quantized.view(torch.uint8)


def expected_state(stored: torch.Tensor, dtype: torch.dtype, scale: int) -> torch.Tensor:
    """The reference for a stored state: each element's pattern looked up in the table."""
    table = reference(dtype, scale)
    index = stored.to(torch.int32) if dtype != torch.float16 else stored.view(torch.int16)
    return table[index.to(torch.int64) & ((1 << DECODERS[dtype][0]) - 1)]


# Scales in the tiny range, as FP32 patterns: normal scales whose products can be subnormal
# (below 2**-117 for E4M3, 2**-102 for FP16), subnormal scales, and the boundaries.
TINY_FP8 = [0x05000000, 0x04D55555, 0x01234567, 0x00400001, 0x00000005]
TINY_FP16 = [0x0C800000, 0x0C7FFFFF, 0x08ABCDEF, 0x00123456, 0x00000003]


@pytest.mark.parametrize("moments", [torch.uint8, torch.float16], ids=["fp8", "fp16"])
def test_trained_like_states_with_tiny_scales(
    flush_mode: str, host_workers: int, moments: torch.dtype
) -> None:
    gen = torch.Generator().manual_seed(3)
    params = [torch.nn.Parameter(torch.randn(s, generator=gen)) for s in [(200_000,), (500, 90)]]
    opt = make_optimizer(params, moments=moments, master="fp32")
    train(opt, steps=2)
    states = [(p, name) for p in params for name in ("exp_avg", "exp_avg_sq")]
    if moments == torch.uint8:
        subnormal = total = 0
        for k, (p, name) in enumerate(states):
            data = trained_like_fp8(opt.state[p][name]._data.numel(), seed=k)
            opt.state[p][name]._data.copy_(data.view(opt.state[p][name]._data.shape))
            magnitude = data & 0x7F
            subnormal += int(((magnitude > 0) & (magnitude < 8)).sum())
            total += data.numel()
        assert subnormal > 0.05 * total, f"only {subnormal} of {total} bytes are subnormal"
    for base in TINY_FP8 if moments == torch.uint8 else TINY_FP16:
        expected = []
        for k, (p, name) in enumerate(states):
            pattern = base + k  # a few ulps apart, the same class of scale
            if moments == torch.uint8:
                state = opt.state[p][name]
                state._scale_inv.view(torch.int32).fill_(pattern)
                stored, dtype = state._data.reshape(-1), torch.float8_e4m3fn
            else:
                opt._scales[p][name].view(torch.int32).fill_(pattern)
                stored, dtype = opt.state[p][name].reshape(-1), torch.float16
            expected.append(expected_state(stored, dtype, pattern))
            if name == "exp_avg_sq":
                master = opt.state[p]["master_param"]
                expected.append(master.reshape(-1).view(torch.int32).clone())
        with export_placement("cpu"):
            ours = exported_tensors(opt.state_dict())
        assert len(ours) == len(expected)
        for k, (a, b) in enumerate(zip(ours, expected, strict=True)):
            failure = bit_mismatch(a.reshape(-1), b, f"state {k}, scale {hex(base + k)}")
            assert failure is None, failure


# --- the host workers: the same bits as the calling thread ------------------------------------


def _random_bits(numel: int, dtype: torch.dtype, seed: int) -> torch.Tensor:
    """Every class of pattern (NaNs, infinities, subnormals) of ``dtype``, at random."""
    gen = torch.Generator().manual_seed(seed)
    width = torch.tensor([], dtype=dtype).element_size() * 8
    raw = torch.randint(-(1 << (width - 1)), 1 << (width - 1), (numel,), generator=gen)
    int_dtype = {8: torch.uint8, 16: torch.int16, 32: torch.int32}[width]
    return raw.to(int_dtype) if width != 8 else (raw & 0xFF).to(torch.uint8)


SOURCES = {
    "bf16": lambda data: StateSource(kind="upcast", data=data.view(torch.bfloat16)),
    "fp32": lambda data: StateSource(kind="copy", data=data.view(torch.float32)),
    "int16": lambda data: StateSource(kind="copy", data=data),
    "fp16": lambda data: StateSource(
        kind="scaled", data=data.view(torch.float16), scale=denormals.scale_tensor(0x0C7FFFFF)
    ),
    "fp16_normal_scale": lambda data: StateSource(
        kind="scaled", data=data.view(torch.float16), scale=torch.tensor([3.0e-3])
    ),
    "e4m3": lambda data: StateSource(
        kind="fp8",
        data=data,
        scale=denormals.scale_tensor(0x04D55555),
        fp8_dtype=torch.float8_e4m3fn,
    ),
    "e5m2": lambda data: StateSource(
        kind="fp8", data=data, scale=torch.tensor([0.25]), fp8_dtype=torch.float8_e5m2
    ),
}
_STORED = {
    "bf16": torch.int16,
    "fp32": torch.int32,
    "int16": torch.int16,
    "fp16": torch.int16,
    "fp16_normal_scale": torch.int16,
    "e4m3": torch.uint8,
    "e5m2": torch.uint8,
}


@pytest.mark.parametrize("kind", list(SOURCES))
@pytest.mark.parametrize("numel", [0, 1, 1001, 4097, 70_001])
def test_host_workers_give_the_calling_threads_bits(kind: str, numel: int) -> None:
    """Pool on and off, bit for bit, for sizes that are no multiple of a block or a task."""
    stored = _random_bits(
        numel,
        {torch.int16: torch.bfloat16, torch.int32: torch.float32, torch.uint8: torch.uint8}[
            _STORED[kind]
        ],
        seed=numel,
    )
    stored = stored.view(_STORED[kind])
    with small_team(0):
        off = materialize(SOURCES[kind](stored))
    with small_team(3, elements=500, block=129):
        on = materialize(SOURCES[kind](stored))
    assert on.dtype == off.dtype and on.shape == off.shape
    assert torch.equal(on.view(torch.uint8), off.view(torch.uint8)), kind
