"""Flush-denormal mode (x86 FTZ and DAZ) in the calling thread and in torch's intra-op workers.

``torch.set_flush_denormal`` sets the MXCSR bits of the calling thread only, and torch's
intra-op threads keep their own. torch's intra-op pool is OpenMP: :func:`set_modes` runs a
callback once on every thread of that pool through the OpenMP runtime torch itself loaded
(``GOMP_parallel``, from the library in the process's memory map), and each thread sets its own
mode with ``torch.set_flush_denormal`` and probes it. No compiler is needed, so this runs on any
Linux x86 machine where torch uses libgomp (torch's CPU and CUDA wheels).

The package's host workers convert on a team of their own (a thread of the package whose torch
runs on that many OpenMP threads, ``te_ckpt_placement._workers``): where conversions go there
(``_workers.count() > 1`` when :func:`flushing` is entered), the mode is set on every thread of
that team too, all of them workers.

``GOMP_parallel(fn, data, num_threads, flags)`` has been libgomp's entry point for
``#pragma omp parallel`` since GCC 4.9. Its team is the pool that torch's ``at::parallel_for``
reuses from the same calling thread, so the threads reached are the ones torch converts on;
:func:`flushed_fraction` checks that with a parallel torch op.
"""

from __future__ import annotations

import ctypes
import functools
import os
import struct
import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager

import torch

from te_ckpt_placement import _workers

#: A product of two FP32 normals that is an FP32 subnormal (2**-140): 0 under FTZ.
_FTZ_A, _FTZ_B = 2.0**-100, 2.0**-40
#: An FP32 subnormal (16 * 2**-149) times 2**30, a normal: 0 under DAZ.
_DAZ_BITS, _DAZ_FACTOR = 16, 2.0**30

_Callback = ctypes.CFUNCTYPE(None, ctypes.c_void_p)


def probe() -> tuple[bool, bool]:
    """``(ftz, daz)`` of the calling thread, observed on one-element torch multiplies."""
    ftz = (torch.tensor([_FTZ_A]) * _FTZ_B).view(torch.int32).item() == 0
    daz_in = torch.tensor([_DAZ_BITS], dtype=torch.int32).view(torch.float32)
    daz = (daz_in * _DAZ_FACTOR).view(torch.int32).item() == 0
    return ftz, daz


@functools.cache
def _gomp() -> ctypes.CDLL | str:
    """torch's OpenMP runtime, or the reason it cannot be used."""
    if "OpenMP" not in torch.__config__.parallel_info():
        return "torch's intra-op thread pool is not OpenMP here"
    torch_dir = os.path.dirname(torch.__file__)
    try:
        with open("/proc/self/maps") as maps:
            paths = {line.split()[-1] for line in maps if "libgomp" in line}
    except OSError as exc:
        return f"cannot read /proc/self/maps ({exc})"
    if not paths:
        return "no libgomp is loaded in this process"
    # torch's own copy first (torch/lib or torch.libs), where a system libgomp is loaded too.
    path = sorted(paths, key=lambda p: (not p.startswith(torch_dir), "torch" not in p, p))[0]
    lib = ctypes.CDLL(path)
    if not hasattr(lib, "GOMP_parallel"):
        return f"{path} has no GOMP_parallel"
    lib.GOMP_parallel.argtypes = (_Callback, ctypes.c_void_p, ctypes.c_uint, ctypes.c_uint)
    lib.GOMP_parallel.restype = None
    lib.omp_get_thread_num.restype = ctypes.c_int
    return lib


def unavailable() -> str | None:
    """Why the mode cannot be set in every worker here, or None."""
    if not torch.set_flush_denormal(False):
        return "torch.set_flush_denormal is not supported on this CPU (x86 with SSE3 needed)"
    gomp = _gomp()
    return gomp if isinstance(gomp, str) else None


def _on_every_thread(fn: Callable[[int], None]) -> None:
    """Runs ``fn(omp_thread_number)`` once on each thread of torch's intra-op pool."""
    gomp = _gomp()
    assert not isinstance(gomp, str), gomp
    errors: list[BaseException] = []

    def body(_data: int | None) -> None:
        try:
            fn(gomp.omp_get_thread_num())
        except BaseException as exc:  # an exception must not unwind through C
            errors.append(exc)

    callback = _Callback(body)
    gomp.GOMP_parallel(callback, None, torch.get_num_threads(), 0)
    if errors:
        raise errors[0]


def set_modes(*, calling: bool, workers: bool) -> dict[int, tuple[bool, bool]]:
    """Sets flush-denormal in the calling thread (thread 0) and in every worker.

    Returns each thread's ``(ftz, daz)`` as probed on that thread after the change, keyed by
    its OpenMP thread number, after checking that the calling thread is thread 0.
    """
    caller = threading.get_ident()
    seen: dict[int, tuple[bool, bool]] = {}
    lock = threading.Lock()

    def apply(tid: int) -> None:
        assert (tid == 0) == (threading.get_ident() == caller), "thread 0 is not the caller"
        torch.set_flush_denormal(calling if tid == 0 else workers)
        with lock:
            seen[tid] = probe()

    _on_every_thread(apply)
    return seen


def _set_team(on: bool, size: int) -> None:
    """On the host workers' leader: the mode on every thread of its team of ``size``, checked."""
    seen = set_modes(calling=on, workers=on)
    assert sorted(seen) == list(range(size)), seen
    assert all(state == (on, on) for state in seen.values()), seen
    assert flushed_fraction() == (1.0 if on else 0.0)


def flushed_fraction() -> float:
    """The share of a parallel torch multiply's subnormal results that came out as 0."""
    n = max(1, torch.get_num_threads()) << 17  # many of torch's 32 Ki-element grains per thread
    product = torch.full((n,), _FTZ_A) * _FTZ_B
    return float((product.view(torch.int32) == 0).double().mean())


MODES = ("calling", "workers", "all")


@contextmanager
def flushing(mode: str) -> Iterator[None]:
    """Flush-denormal on in the calling thread only, in the intra-op workers only, or in both,
    checked on every thread; everything off again on exit. Skips where it cannot be set."""
    import pytest

    if mode not in MODES:
        raise ValueError(f"unknown mode {mode!r}: valid values are {MODES}")
    reason = unavailable() if mode != "calling" else None
    if mode == "calling" and not torch.set_flush_denormal(False):
        reason = "torch.set_flush_denormal is not supported on this CPU (x86 with SSE3 needed)"
    if reason is not None:
        pytest.skip(reason)
    threads = torch.get_num_threads()
    torch.set_num_threads(max(2, threads))  # at least one worker besides the calling thread
    team = _workers.count()
    try:
        if mode != "calling" and team > 1:
            _workers._run(_set_team, (True, team), team)
        if mode == "calling":
            torch.set_flush_denormal(True)
            assert probe() == (True, True)
        else:
            calling = mode == "all"
            seen = set_modes(calling=calling, workers=True)
            assert sorted(seen) == list(range(torch.get_num_threads())), seen
            for tid, state in seen.items():
                on = calling if tid == 0 else True
                assert state == (on, on), f"thread {tid}: (ftz, daz) = {state}"
            # A parallel torch op splits evenly over the threads: thread 0's share is not
            # flushed unless the calling thread is.
            workers = 1.0 - 1.0 / torch.get_num_threads()
            assert flushed_fraction() == (1.0 if calling else workers)
        yield
    finally:
        if mode != "calling":
            set_modes(calling=False, workers=False)
            if team > 1:
                _workers._run(_set_team, (False, team), team)
        torch.set_flush_denormal(False)
        torch.set_num_threads(threads)
        assert probe() == (False, False)


def _pattern(value: float) -> int:
    return int(struct.unpack("<I", struct.pack("<f", value))[0])


# FP32 scale patterns that reach every class of result: normal, subnormal, zero, overflow;
# scales around each boundary below which a product can be subnormal (2**-117 for E4M3,
# 2**-110 for E5M2, 2**-102 for FP16) and the E4M3 decode's fold overflow (above 2**119);
# subnormal scales (read as 0 under DAZ); signed zeros, infinity, NaN. (Computed at import,
# where no mode is set; struct rounds FP64 to FP32 in the calling thread.)
SCALES = [_pattern(v) for v in (1.0, 2.0**-15, 7.1e-3, 1.3e-30, 448.0 / 3, 3.0e35, 2.0**120, -2.5)]
SCALES += [0x05000000, 0x05000000 - 1, _pattern(1.5 * 2.0**-120), 0x08800000, 0x08800000 - 1]
SCALES += [0x0C800000, 0x0C800000 - 1, _pattern(1.7 * 2.0**-111), 0x00800000, 0x80800000]
SCALES += [0x007FFFFF, _pattern(2.0**-140), 0x00000001, 0x00000003, 0x00012345, 0x80000010]
SCALES += [0x00000000, 0x80000000, 0x7F800000, 0x7FC00000, 0x7F7FFFFF]


def scale_tensor(pattern: int, device: torch.device | str = "cpu") -> torch.Tensor:
    """A one-element FP32 tensor with this bit pattern (built from the bits, so no thread's
    mode can flush it on the way)."""
    signed = pattern - (1 << 32) if pattern >> 31 else pattern
    return torch.tensor([signed], dtype=torch.int32, device=device).view(torch.float32)
