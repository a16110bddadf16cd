"""The report of each streamed export and load: its counts, its log line, threads and failures.

The CPU tests run the stand-in; every expected number is computed here from the states' shapes,
dtypes and storages (or, for TE's own cost, measured on TE's own path), never taken from a run of
the code under test. The GPU tests compare the GPU numbers with the CUDA allocator's.
"""

from __future__ import annotations

import copy
import logging
import subprocess
import sys
import threading
import weakref
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

import te_ckpt_placement
from te_ckpt_placement import _export as engine
from te_ckpt_placement import _reports as reports
from te_ckpt_placement import _ring, _te_cost, _te_load_write, export_placement, last_report
from te_ckpt_placement import _te_load as te_load

from .support.helpers import aliases_live, exported_tensors, live_storages
from .support.imports import import_graph
from .support.standin import StandInFusedAdam, make_optimizer, train

ROOT = Path(__file__).resolve().parents[1]
FP16, FP8 = torch.float16, torch.uint8
CASES = [
    (torch.float32, "fp32"),
    (torch.bfloat16, "remainder"),
    (torch.bfloat16, "fp32"),
    (FP16, "fp32"),
    (FP16, "fp16"),
    (FP8, "remainder"),
]
IDS = [f"{str(m).split('.')[-1]}-{master}" for m, master in CASES]


@pytest.fixture(autouse=True)
def fresh_staging(hooked_standin: None) -> Iterator[None]:
    """A fresh stager for each test: its scratch is then what this test's exports made it."""
    _ring.release_idle()
    yield
    _ring.release_idle()


def build(moments: torch.dtype, master: str, seed: int = 0) -> StandInFusedAdam:
    param_dtype = torch.float32 if master == "fp16" else torch.bfloat16
    gen = torch.Generator().manual_seed(seed)
    shapes = [(37, 5), (200,), (3,), (4, 6, 2)]
    params = [torch.nn.Parameter(torch.randn(s, generator=gen).to(param_dtype)) for s in shapes]
    opt = make_optimizer(params, moments=moments, master=master)
    train(opt, steps=2, seed=seed)
    return opt


def nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


def stored(value: Any) -> torch.Tensor:
    """The raw storage of a live state (FP8: its bytes)."""
    return getattr(value, "_data", value)


def live_states(opt: StandInFusedAdam) -> list[tuple[torch.Tensor, str, Any]]:
    return [(p, name, v) for p, states in opt.state.items() for name, v in states.items()]


def staging(scratch_elements: int = 0) -> int:
    """The ring of one stager, and an E4M3 scratch of int16 patterns."""
    return _ring.RING * _ring.CHUNK_BYTES + 2 * scratch_elements


def largest(opt: StandInFusedAdam, dtypes: tuple[torch.dtype, ...]) -> int:
    """Elements of the largest state kept in one of ``dtypes`` (TE's storage dtype)."""
    sizes = [
        stored(v).numel() for _, n, v in live_states(opt) if opt.name_to_dtype_map[n] in dtypes
    ]
    return max(sizes, default=0)


# --- exports --------------------------------------------------------------------------------------


@pytest.mark.parametrize(("moments", "master"), CASES, ids=IDS)
def test_export_report_counts_what_moved(moments: torch.dtype, master: str) -> None:
    opt = build(moments, master)
    with export_placement(None):
        te_export = opt.state_dict()
    # TE's own GPU bytes: the tensors its export made (it returns FP32 and int16 states as they
    # are, which cost nothing).
    live = live_storages(opt)
    te_made = sum(nbytes(t) for t in exported_tensors(te_export) if not aliases_live(t, live))
    del te_export
    with export_placement("cpu"):
        ours = opt.state_dict()
    report = last_report()
    assert report is not None and report.op == "export"
    assert not report.failed and report.error is None
    states = live_states(opt)
    written = sum(nbytes(t) for t in exported_tensors(ours))
    assert report.states == len(states)
    assert report.device_to_host_bytes == sum(nbytes(stored(v)) for *_, v in states)
    assert report.host_to_device_bytes == 0
    assert report.host_bytes_written == written
    assert report.te_gpu_bytes == te_made
    assert report.gpu_bytes == 0
    assert report.gpu_bytes_avoided == te_made
    # The outputs, all kept, and the stager (its scratch: one int16 per element of the largest
    # E4M3 state, the states being smaller than a conversion block).
    assert report.peak_host_bytes == written + staging(largest(opt, (FP8,)))
    assert report.seconds > 0


@pytest.mark.parametrize("moments", [FP16, FP8])
def test_device_conversion_reports_one_fp32_state_on_the_device(moments: torch.dtype) -> None:
    opt = build(moments, "remainder")
    with export_placement("cpu"):
        opt.state_dict()
    host = last_report()
    with export_placement("cpu", conversion="device"):
        opt.state_dict()
    report = last_report()
    assert host is not None and report is not None and report is not host
    # TE's get_unscaled_state runs on the device, one state at a time: its FP32 result moves.
    assert report.gpu_bytes == 4 * largest(opt, (moments,))
    scaled = sum(stored(v).numel() for _, n, v in live_states(opt) if n != "master_param")
    remainders = sum(nbytes(stored(v)) for _, n, v in live_states(opt) if n == "master_param")
    assert report.device_to_host_bytes == 4 * scaled + remainders
    assert report.te_gpu_bytes == host.te_gpu_bytes
    assert report.host_bytes_written == host.host_bytes_written


def test_strided_state_counts_its_host_copies() -> None:
    # A transposed parameter: TE's empty_like keeps its layout, so every state is dense but not
    # contiguous, and the export copies it to the host (keeping the layout) and then makes it
    # contiguous: two host copies of the state at once.
    param = torch.nn.Parameter(torch.randn(6, 40).t().contiguous().t().bfloat16())
    opt = make_optimizer([param], moments=torch.bfloat16, master="remainder")
    train(opt)
    states = [v for *_, v in live_states(opt)]
    assert all(not v.is_contiguous() for v in states)
    assert all(v.to("cpu", copy=True).stride() == v.stride() for v in states)
    with export_placement("cpu"):
        sd = opt.state_dict()
    report = last_report()
    assert report is not None
    written = sum(nbytes(t) for t in exported_tensors(sd))
    # The peak is at the last state: every output exists, and two copies of its raw bytes.
    assert report.peak_host_bytes == written + 2 * nbytes(states[-1]) + staging()
    assert report.gpu_bytes == 0  # a host-resident state has no device copy


# --- loads --------------------------------------------------------------------------------------


class ToCopyPeak(TorchDispatchMode):
    """The most bytes of tensors made by ``aten._to_copy`` (casts, ``.float()``,
    ``.bfloat16()``, moves) alive at once: the temporaries of TE's load. One-element tensors
    (scale arithmetic) are left out, as the reports leave them out."""

    def __init__(self) -> None:
        super().__init__()
        self.alive = self.peak = 0

    def _free(self, n: int) -> None:
        self.alive -= n

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        out = func(*args, **(kwargs or {}))
        if func is torch.ops.aten._to_copy.default and out.numel() > 1:
            n = nbytes(out)
            self.alive += n
            self.peak = max(self.peak, self.alive)
            weakref.finalize(out, self._free, n)
        return out


def te_load_temporaries(opt: StandInFusedAdam, checkpoint: dict[str, Any]) -> int:
    """TE's own load of ``checkpoint`` into ``opt`` (the stand-in runs TE's code), measured."""
    checkpoint = copy.deepcopy(checkpoint)  # TE scales FP16 values in place
    with export_placement(None), ToCopyPeak() as peak:
        opt.load_state_dict(checkpoint)
    return peak.peak


def h2d_bytes(opt: StandInFusedAdam) -> int:
    """Each state as stored; an FP16 or FP8 state as the FP32 copy TE scales on the device."""
    total = 0
    for _, name, value in live_states(opt):
        scaled = opt.name_to_dtype_map[name] in (FP16, FP8)
        total += stored(value).numel() * 4 if scaled else nbytes(stored(value))
    return total


def rollback_bytes(opt: StandInFusedAdam) -> int:
    """What a rollback keeps of each overwritten state: its storage, FP8 scale_inv and quantizer
    scale, and its per-tensor scale."""
    total = 0
    for param, name, value in live_states(opt):
        total += nbytes(stored(value))
        if hasattr(value, "_data"):
            total += nbytes(value._scale_inv) + nbytes(value._quantizer.scale)
        if name in opt._scales.get(param, {}):
            total += nbytes(opt._scales[param][name])
    return total


@pytest.mark.parametrize("rollback", [False, True])
@pytest.mark.parametrize(("moments", "master"), CASES, ids=IDS)
def test_load_report_counts_what_moved(moments: torch.dtype, master: str, rollback: bool) -> None:
    opt = build(moments, master)
    with export_placement("cpu"):
        checkpoint = opt.state_dict()
    _ring.release_idle()  # the load's stager then has no scratch from the export
    kept = rollback_bytes(opt) if rollback else 0
    te_cost = te_load_temporaries(build(moments, master), checkpoint)  # into a twin
    with export_placement("cpu", rollback=rollback):
        opt.load_state_dict(checkpoint)
    report = last_report()
    assert report is not None and report.op == "load" and not report.failed
    assert report.states == len(live_states(opt))
    assert report.host_to_device_bytes == h2d_bytes(opt)
    assert report.device_to_host_bytes == kept
    assert report.host_bytes_written == kept
    assert report.peak_host_bytes == staging() + kept
    # FP32 copies of FP16/FP8 states handed to TE's scaling: the largest one's alone, or small
    # ones sharing a temporary that takes no more allocator blocks (512 bytes) than it.
    most = 4 * largest(opt, (FP16, FP8))
    assert most <= report.gpu_bytes <= -(-most // 512) * 512
    assert report.te_gpu_bytes == te_cost


def test_load_widening_a_bf16_checkpoint_counts_its_host_block(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    opt = build(torch.bfloat16, "fp32")
    with export_placement("cpu"):
        checkpoint = opt.state_dict()
    # BF16 checkpoint values of BF16 states: each block is widened to FP32 on the host first.
    for states in checkpoint["state"].values():
        for name in ("exp_avg", "exp_avg_sq"):
            states[name] = states[name].bfloat16()
    monkeypatch.setattr(_ring, "CHUNK_BYTES", 256)  # blocks of 128 BF16 elements
    _ring.release_idle()
    with export_placement("cpu"):
        opt.load_state_dict(checkpoint)
    report = last_report()
    assert report is not None
    # The largest moment (200 elements) goes in blocks of 100: one FP32 block of 100 at a time.
    assert report.peak_host_bytes == _ring.RING * 256 + 4 * 100


def test_load_of_a_strided_fp16_value_counts_its_device_copy() -> None:
    opt = build(FP16, "fp32")
    with export_placement("cpu"):
        checkpoint = opt.state_dict()
    # Every other element of a buffer: not dense, so TE's scaling gets a copy with the value's
    # own strides (TE would scale the caller's tensor in place), gaps included.
    value = checkpoint["state"][1]["exp_avg"]
    spaced = torch.zeros(2 * value.numel())[::2]
    spaced.copy_(value)
    checkpoint["state"][1]["exp_avg"] = spaced
    with export_placement("cpu"):
        opt.load_state_dict(checkpoint)
    report = last_report()
    assert report is not None
    extent = (value.numel() - 1) * spaced.stride(0) + 1
    assert report.gpu_bytes == 4 * extent > 4 * largest(opt, (FP16,))


def test_load_states_counts_one_state_at_a_time() -> None:
    opt = build(FP16, "fp32")
    with export_placement("cpu"):
        checkpoint = opt.state_dict()
    params = [p for g in opt.param_groups for p in g["params"]]
    triples = [
        (params[i], n, v) for i, states in checkpoint["state"].items() for n, v in states.items()
    ]
    te_load.load_states(opt, triples)
    report = last_report()
    assert report is not None and report.op == "load" and report.states == len(triples)
    # No bulk cast: TE's set_scaled_state of an FP32 host value allocates nothing on the
    # stand-in's device (the CPU, where the value already is).
    assert report.te_gpu_bytes == 0
    most = 4 * largest(opt, (FP16,))  # alone, or in a shared temporary of no more blocks
    assert most <= report.gpu_bytes <= -(-most // 512) * 512


def test_load_state_alone_reports_nothing_and_counts_inside_an_operation() -> None:
    opt = build(torch.bfloat16, "fp32")
    with export_placement("cpu"):
        checkpoint = opt.state_dict()
    before = last_report()
    param = opt.param_groups[0]["params"][1]
    value = checkpoint["state"][1]["exp_avg"]
    te_load.load_state(opt, param, "exp_avg", value)
    assert last_report() is before
    with reports.operation("load"):
        te_load.load_state(opt, param, "exp_avg", value)
        te_load.load_state(opt, param, "exp_avg_sq", checkpoint["state"][1]["exp_avg_sq"])
    report = last_report()
    assert report is not None and report is not before
    assert report.states == 2 and report.host_to_device_bytes == 2 * 2 * value.numel()


def test_te_load_cost_on_a_gpu_follows_te_code() -> None:
    # Parameters on a device (meta stands in for the GPU), the checkpoint on the host: torch
    # casts every value to the parameter's dtype on its device, all at once; then TE writes each
    # state: BF16 rounded on the host (nothing on the device), FP16/FP8 moved there in FP32.
    bf16 = torch.empty(10, dtype=torch.bfloat16, device="meta")
    fp32 = torch.empty(30, device="meta")
    host = torch.zeros
    plan = [
        (bf16, [(host(10), FP16, False), (host(10), torch.bfloat16, False)]),
        (fp32, [(host(30), FP8, False), (host(30), torch.float32, False)]),
    ]
    casts = [2 * 10 + 2 * 10, 4 * 30 + 4 * 30]
    peak = max(sum(casts), casts[1] + 4 * 10, 0 + 4 * 30)
    assert _te_cost.te_load_device_bytes(plan, bulk_cast=True) == peak == 280
    # A large first FP16 state (one state, no other) makes the per-state copy the peak.
    one = [(bf16, [(host(10), FP16, False)]), (fp32, [])]
    assert _te_cost.te_load_device_bytes(one, bulk_cast=True) == 4 * 10
    # Values already on the device in the parameter's dtype are not cast; an FP16 state's value
    # there is scaled in place.
    there = [(fp32, [(torch.zeros(30, device="meta"), FP16, False)])]
    assert _te_cost.te_load_device_bytes(there, bulk_cast=True) == 0
    # A remainder is cast like any state (the parameter is floating point) and then copied.
    rem = [(bf16, [(host(10, dtype=torch.int16), torch.float32, True)])]
    assert _te_cost.te_load_device_bytes(rem, bulk_cast=True) == 2 * 10
    assert _te_cost.te_load_device_bytes(plan, bulk_cast=False) == 4 * 30


# --- logging --------------------------------------------------------------------------------------


def test_one_info_line_per_operation(caplog: pytest.LogCaptureFixture) -> None:
    opt = build(torch.bfloat16, "remainder")
    caplog.set_level(logging.INFO, logger="te_ckpt_placement")
    with export_placement("cpu"):
        checkpoint = opt.state_dict()
    export = last_report()
    with export_placement("cpu"):
        opt.load_state_dict(checkpoint)
    load = last_report()
    records = [r for r in caplog.records if r.name == "te_ckpt_placement"]
    assert [r.levelno for r in records] == [logging.INFO, logging.INFO]
    assert [r.report for r in records] == [export, load]  # type: ignore[attr-defined]
    assert [r.getMessage() for r in records] == [str(export), str(load)]
    assert "export: 12 states" in records[0].getMessage()


def test_silent_by_default() -> None:
    code = (
        "import logging, torch\n"
        "from te_ckpt_placement import export_placement, last_report\n"
        "from te_ckpt_placement import _te_hooks as te_hooks\n"
        "from tests.support.standin import StandInFusedAdam, make_optimizer, train\n"
        "te_hooks.patch_class(StandInFusedAdam)\n"
        "opt = make_optimizer([torch.nn.Parameter(torch.randn(8))], moments=torch.bfloat16)\n"
        "train(opt)\n"
        "with export_placement('cpu'):\n"
        "    opt.load_state_dict(opt.state_dict())\n"
        "assert last_report().op == 'load'\n"
        "assert logging.getLogger().handlers == []\n"  # the root logger is left alone
        "package = logging.getLogger('te_ckpt_placement')\n"
        "assert package.level == logging.NOTSET\n"
        "assert [type(h) for h in package.handlers] == [logging.NullHandler]\n"
    )
    done = subprocess.run(
        [sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, check=False
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout == "" and done.stderr == ""


def test_package_logger_has_a_null_handler() -> None:
    logger = logging.getLogger("te_ckpt_placement")
    assert logger is reports.logger
    assert any(isinstance(h, logging.NullHandler) for h in logger.handlers)
    assert te_ckpt_placement.last_report is last_report


def package_imports(module: str) -> set[str]:
    """The package modules ``module`` imports anywhere in its source (functions included)."""
    found = import_graph()[f"te_ckpt_placement.{module}"]
    return {name.removeprefix("te_ckpt_placement.") for name in found}


def test_reports_and_the_leaf_helpers_import_nothing_of_the_package() -> None:
    # The engine reports its own temporaries, so reports needs no layout rule of the load's
    # pipeline: no engine -> reports -> upload -> engine circle, not even through a lazy import.
    assert package_imports("_reports") == set()
    assert package_imports("_tensors") == set()
    assert package_imports("_te_cost") == {"_tensors"}
    assert package_imports("_convert") == {"_tensors", "_reports", "_workers"}
    assert package_imports("_workers") == {"_policy"}  # the host pool: sized, never a circle


# --- threads --------------------------------------------------------------------------------------


def test_concurrent_exports_keep_their_own_counts(monkeypatch: pytest.MonkeyPatch) -> None:
    opts = [build(m, "remainder", seed=i) for i, m in enumerate([torch.bfloat16, FP16, FP8])]
    # Each optimizer of its own size, so that mixed counts would show.
    for i, opt in enumerate(opts):
        extra = torch.nn.Parameter(torch.randn(50 * (i + 1)).bfloat16())
        opt.add_param_group({"params": [extra]})
        train(opt, seed=10 + i)
    barrier = threading.Barrier(len(opts))
    materialize = engine.materialize
    calls = threading.local()

    def interleaved(*args: Any, **kwargs: Any) -> torch.Tensor:
        # Every thread is part-way through its export before any goes on.
        if not getattr(calls, "waited", False):
            calls.waited = True
            barrier.wait(timeout=30)
        return materialize(*args, **kwargs)

    monkeypatch.setattr(engine, "materialize", interleaved)
    results: dict[int, Any] = {}
    errors: list[BaseException] = []

    def run(i: int) -> None:
        try:
            assert last_report() is None  # a new thread has no report yet
            with export_placement("cpu"):
                sd = opts[i].state_dict()
            results[i] = (last_report(), sd)
        except BaseException as exc:
            errors.append(exc)

    main_before = last_report()
    threads = [threading.Thread(target=run, args=(i,)) for i in range(len(opts))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors, errors
    assert last_report() is main_before  # other threads' reports are theirs
    for i, opt in enumerate(opts):
        report, sd = results[i]
        states = live_states(opt)
        assert report.states == len(states)
        assert report.device_to_host_bytes == sum(nbytes(stored(v)) for *_, v in states)
        assert report.host_bytes_written == sum(nbytes(t) for t in exported_tensors(sd))


def test_attached_threads_count_towards_one_report() -> None:
    # A writer's producer threads and a planner's readers count into the operation of the
    # thread that runs it; the one lock keeps every count.
    threads, per_thread = 4, 500
    with reports.operation("export", path="streaming_save"):
        recorder = reports.active()
        assert recorder is not None

        def work() -> None:
            with reports.attach(recorder):
                for _ in range(per_thread):
                    reports.kept(3)
                    reports.state_written()
                    recorder.waited(0.001)
                    recorder.detail("produced", 1)
                    recorder.detail("peak_alive", 2, peak=True)
            assert reports.active() is None  # attach leaves the thread as it found it

        workers = [threading.Thread(target=work) for _ in range(threads)]
        for t in workers:
            t.start()
        for t in workers:
            t.join()
    report = last_report()
    assert report is not None and report.path == "streaming_save" and not report.failed
    assert report.states == threads * per_thread
    assert report.device_to_host_bytes == report.host_bytes_written == 3 * threads * per_thread
    assert report.wait_seconds == pytest.approx(0.001 * threads * per_thread)
    assert dict(report.details) == {"produced": threads * per_thread, "peak_alive": 2}
    with pytest.raises(TypeError):
        report.details["produced"] = 0  # type: ignore[index]


def _ring_wait() -> float:
    return sum(ring.wait_s for ring in _ring._rings.all())


def test_a_state_dict_report_has_the_default_path_and_the_rings_wait() -> None:
    opt = build(torch.bfloat16, "fp32")
    before = _ring_wait()
    with export_placement("cpu"):
        opt.state_dict()
    report = last_report()
    assert report is not None and report.op == "export"
    assert (report.path, dict(report.details)) == ("state_dict", {})
    # The time the export's ring waited for its copies, as the ring itself counted it.
    assert report.wait_seconds == pytest.approx(_ring_wait() - before, abs=1e-9)
    assert report.wait_seconds > 0


def test_a_load_states_report_says_its_path() -> None:
    opt = build(torch.bfloat16, "fp32")
    with export_placement("cpu"):
        exported = opt.state_dict()
    params = [p for group in opt.param_groups for p in group["params"]]
    states = [
        (params[i], name, value)
        for i, entry in exported["state"].items()
        for name, value in entry.items()
        if name != "step"
    ]
    te_load.load_states(opt, states)
    report = last_report()
    assert report is not None and (report.op, report.path) == ("load", "load_states")
    assert report.states == len(states)


# --- failures -------------------------------------------------------------------------------------


def test_failed_export_leaves_a_failed_report(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    opt = build(torch.bfloat16, "fp32")
    with export_placement("cpu"):
        opt.state_dict()
    good = last_report()
    materialize = engine.materialize
    calls = 0

    def third_fails(*args: Any, **kwargs: Any) -> torch.Tensor:
        nonlocal calls
        calls += 1
        if calls == 3:
            raise MemoryError("injected")
        return materialize(*args, **kwargs)

    monkeypatch.setattr(engine, "materialize", third_fails)
    caplog.set_level(logging.INFO, logger="te_ckpt_placement")
    with pytest.raises(MemoryError), export_placement("cpu"):
        opt.state_dict()
    report = last_report()
    assert report is not None and report is not good
    assert report.op == "export" and report.failed and report.error == "MemoryError"
    assert report.states == 2  # the work done before the failure
    assert [r.report for r in caplog.records] == [report]  # type: ignore[attr-defined]
    assert "FAILED (MemoryError)" in caplog.records[0].getMessage()


def test_load_failing_validation_leaves_a_failed_report() -> None:
    opt = build(torch.bfloat16, "fp32")
    with export_placement("cpu"):
        checkpoint = opt.state_dict()
    checkpoint["state"][0]["exp_avg"] = torch.zeros(3)  # the wrong shape
    with pytest.raises(ValueError, match="local shape"), export_placement("cpu"):
        opt.load_state_dict(checkpoint)
    report = last_report()
    assert report is not None and report.op == "load"
    assert report.failed and report.error == "ValueError"
    assert report.states == 0 and report.host_to_device_bytes == 0


def test_load_failing_part_way_reports_what_was_written(monkeypatch: pytest.MonkeyPatch) -> None:
    opt = build(torch.bfloat16, "fp32")
    with export_placement("cpu"):
        checkpoint = opt.state_dict()
    # Slots too small to share: each state is written before the next one starts.
    monkeypatch.setattr(_ring, "CHUNK_BYTES", 1024)
    write = _te_load_write._write_one
    calls = 0

    def fourth_fails(*args: Any, **kwargs: Any) -> Any:
        nonlocal calls
        calls += 1
        if calls == 4:
            raise RuntimeError("injected")
        return write(*args, **kwargs)

    monkeypatch.setattr(_te_load_write, "_write_one", fourth_fails)
    with pytest.raises(te_load.PartialLoadError), export_placement("cpu"):
        opt.load_state_dict(checkpoint)
    report = last_report()
    assert report is not None and report.failed and report.error == "PartialLoadError"
    assert report.states == 3
    # Three states of parameter 0 (37 x 5): two BF16 moments and an FP32 master.
    assert report.host_to_device_bytes == 185 * (2 + 2 + 4)
