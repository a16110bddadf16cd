"""``StreamingLoadPlanner`` against the CPU stand-in: ``dcp.load`` with no FP32 template.

In-process tests (plain tensors, no process group) cover every storage mode the stand-in keeps
(FP32, BF16, FP16 and FP8 moments; no, FP32 and int16-remainder masters), the checks made before
any write (a fresh optimizer stays fresh), failures part-way (the step guard), load post-hooks
that raise, the warned fallback and misuse. One spawn of 2 gloo ranks then runs the checks of
``tests/support/dcp_load_checks.py`` on ``fully_shard`` models, which tests/test_gpu_dcp_load.py
runs again with real TE on 2 GPUs: round trips equal to the template path and to TE's own load,
continued training equal to an uninterrupted run, resharding 2 -> 1 and 1 -> 2, and a checkpoint
written from a full state dict; and ``check_failures``, the failure paths on 2 ranks.

In every streaming load the optimizer's ``state_dict()`` is made to fail: no template is built.
"""

from __future__ import annotations

import gc
import json
import re
import warnings
import weakref
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import FileSystemReader
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.planner import LoadPlan, LoadPlanner
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_optimizer_state_dict,
    set_model_state_dict,
)

from te_ckpt_placement import _reports as reports
from te_ckpt_placement import _ring, _te_load_check, export_placement
from te_ckpt_placement.dcp import (
    PlacedOptimizerState,
    StreamingLoadPlanner,
    StreamingLoadWarning,
    _load_targets,
)
from te_ckpt_placement.dcp import _load_planner as load_planner

from .support.backends import CPU
from .support.dcp_load_checks import (
    WHOLE,
    check_failures,
    load_run,
    load_streaming,
    load_template_path,
    no_template,
    run_streaming_checks,
    save,
    whole_state_elements,
)
from .support.dcp_runs import Run, assert_same_run
from .support.distributed import by_position, hyperparams, init_gloo_mesh, param_dtype, spawn
from .support.faults import StopAfter
from .support.helpers import assert_snapshot_equal, bits, snapshot
from .support.standin import make_optimizer
from .support.storage import MASTERS

pytestmark = pytest.mark.usefixtures("hooked_standin")
MOMENTS = (torch.float32, torch.bfloat16, torch.float16, torch.uint8)


def plain_run(moments: torch.dtype, master: str, seed: int) -> Run:
    """A plain (no mesh) model with its stand-in optimizer of two parameter groups."""
    return load_run(CPU, None, moments, master, seed)


# --- in process: every storage mode -------------------------------------------------------------
@pytest.fixture
def quiet() -> Iterator[None]:
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", "torch.distributed is disabled", UserWarning)
        yield


def trained(moments: torch.dtype, master: str, seed: int = 1) -> Run:
    run = plain_run(moments, master, seed=seed)
    run.train(3, seed=seed + 1)
    return run


def assert_planner_report(
    planner: StreamingLoadPlanner, *, last: bool = True
) -> reports.TransferReport:
    """The report of a completed planner load: every state, and every byte it moved (``last``:
    it is the thread's last report, no load ran after it)."""
    report = planner.report
    assert report is not None and (report is reports.last_report() or not last)
    assert (report.op, report.path, report.failed, report.error) == ("load", "planner", False, None)
    targets = [t for load in planner._loads for t in load.targets]
    assert report.states == len(targets) > 0
    # Each state's bytes once: as stored for those read in place, 4 B per element for the FP32
    # copies of FP16/FP8 states that TE scales on the device (as load_state_dict's report).
    assert report.host_to_device_bytes == sum(
        t.numel * (4 if t.whole else t.facts.stored.itemsize) for t in targets
    )
    assert set(report.details) == {
        "resolve_s",
        "commit_s",
        "ring_items",
        "ring_bytes",
        "direct_items",
        "ring_host_bytes",
        "peak_assembly_bytes",
    }
    assert report.details["peak_assembly_bytes"] == planner.peak_assembly_bytes
    assert report.peak_host_bytes >= planner.peak_assembly_bytes
    assert report.details["resolve_s"] > 0 and report.details["commit_s"] > 0
    assert report.device_to_host_bytes == 0 and report.host_bytes_written == 0
    return report


@pytest.mark.usefixtures("quiet")
@pytest.mark.parametrize("master", MASTERS)
@pytest.mark.parametrize("moments", MOMENTS, ids=str)
def test_streaming_load_equals_template_path_and_te_load(
    tmp_path: Path, moments: torch.dtype, master: str
) -> None:
    run = trained(moments, master)
    save(run, tmp_path)
    template, te, ours = (plain_run(moments, master, seed=7) for _ in range(3))
    load_template_path(template, tmp_path)
    load_template_path(te, tmp_path, placement=None)
    planner = load_streaming(ours, tmp_path)
    assert_same_run(template, te, "template path vs TE's load")  # the reference agrees
    assert_same_run(ours, template, "streaming vs template path")
    exact = moments not in WHOLE
    if exact:  # FP16/FP8 scales are re-derived by every load, TE's too
        assert_same_run(ours, run, "streaming vs saved")
    assert all(g["step"] == 3 for g in ours.opt.param_groups)
    assert planner.fallbacks == []
    # Host buffers: one FP32 local state at a time for FP16/FP8, none for elementwise states.
    largest, _ = whole_state_elements(ours)
    assert planner.peak_assembly_bytes == 4 * largest
    assert planner.peak_assembly_bytes <= 4 * ours.largest_state()
    assert_planner_report(planner)
    # Training goes on as it would have without the checkpoint (or after TE's load).
    reference = run if exact else te
    for r in {id(r): r for r in (ours, reference)}.values():
        r.train(3, seed=9)
    assert_same_run(ours, reference, "after 3 more steps")


@pytest.mark.usefixtures("quiet")
def test_streaming_load_into_a_trained_optimizer_and_model_parts(tmp_path: Path) -> None:
    """Loading over live states (not a fresh optimizer), and model parts with one optimizer each."""
    runs = [trained(torch.bfloat16, "fp32", seed=1), trained(torch.float16, "remainder", seed=2)]
    for i, run in enumerate(runs):  # distinct parameter names per part
        run.model = torch.nn.ModuleDict({f"part{i}": run.model})  # type: ignore[assignment]
    adapter = PlacedOptimizerState([r.model for r in runs], [r.opt for r in runs])
    dcp.save({"optim": adapter}, checkpoint_id=str(tmp_path))
    loaded = [trained(torch.bfloat16, "fp32", seed=5), trained(torch.float16, "remainder", seed=6)]
    templated = [plain_run(torch.bfloat16, "fp32", 8), plain_run(torch.float16, "remainder", 8)]
    for group in (loaded, templated):
        for i, run in enumerate(group):
            run.model = torch.nn.ModuleDict({f"part{i}": run.model})  # type: ignore[assignment]
    target = PlacedOptimizerState([r.model for r in loaded], [r.opt for r in loaded])
    with no_template(*(r.opt for r in loaded)):
        planner = StreamingLoadPlanner(target)
        dcp.load({"optim": target}, checkpoint_id=str(tmp_path), planner=planner)
    ref = PlacedOptimizerState([r.model for r in templated], [r.opt for r in templated])
    dcp.load({"optim": ref}, checkpoint_id=str(tmp_path))
    for ours, other in zip(loaded, templated, strict=True):
        assert_same_run(ours, other, "model parts", params=False)
    assert_same_run(loaded[0], runs[0], "model part 0 vs saved", params=False)


@pytest.mark.usefixtures("quiet")
def test_over_budget_assembly_warns_and_completes(tmp_path: Path) -> None:
    run = trained(torch.float16, "fp32")
    save(run, tmp_path)
    ours, ref = plain_run(torch.float16, "fp32", 7), plain_run(torch.float16, "fp32", 7)
    with pytest.warns(StreamingLoadWarning, match="over max_assembly_bytes=0"):
        planner = load_streaming(ours, tmp_path, max_assembly_bytes=0)
    load_template_path(ref, tmp_path)
    assert_same_run(ours, ref, "over budget")
    assert planner.peak_assembly_bytes == 4 * whole_state_elements(ours)[0]


@pytest.mark.usefixtures("quiet")
@pytest.mark.parametrize("moments", WHOLE, ids=str)
def test_a_fresh_optimizer_load_holds_one_copy_of_one_state_at_a_time(
    tmp_path: Path, moments: torch.dtype
) -> None:
    """Into a fresh optimizer (the planner makes its initial states): one host buffer of one
    FP16/FP8 state at a time, and on the device only the FP32 copy that TE scales it from."""
    run = trained(moments, "fp32")
    save(run, tmp_path)
    ours, ref = plain_run(moments, "fp32", seed=7), plain_run(moments, "fp32", seed=7)
    assert not ours.opt.state
    planner = load_streaming(ours, tmp_path)
    report = assert_planner_report(planner)
    load_template_path(ref, tmp_path)
    assert_same_run(ours, ref, "fresh optimizer: streaming vs template path")
    largest, _ = whole_state_elements(ours)
    assert planner.peak_assembly_bytes == 4 * largest
    assert report.gpu_bytes == 4 * largest, report
    assert report.states == 3 * len(ours.params())  # the moments and the FP32 masters


def double_rounding_values(shape: torch.Size, gen: torch.Generator) -> torch.Tensor:
    """FP64 values whose BF16 rounding depends on going through FP32 first (TE's way).

    Each is just above (in magnitude) the midpoint between a BF16 value with an even mantissa and
    the next one: rounded to BF16 it would round up; through FP32 it first becomes the midpoint,
    a tie, which rounds to the even one.
    """
    base = torch.randn(shape, generator=gen).bfloat16().view(torch.int16).to(torch.int32)
    base = (base & ~1) << 16  # even BF16 mantissa, as FP32 bits
    midpoint = (base | 0x8000).view(torch.float32).double()
    return midpoint * (1 + 2.0**-40)


@pytest.mark.usefixtures("quiet")
def test_a_checkpoint_in_another_float_dtype_rounds_as_te_does(tmp_path: Path) -> None:
    """FP64 items for BF16 states: the reader's copy rounds as TE's .float().bfloat16()."""
    run = trained(torch.bfloat16, "fp32")
    with export_placement("cpu"):
        flat = get_optimizer_state_dict(
            run.model, run.opt, options=StateDictOptions(flatten_optimizer_state_dict=True)
        )
    gen = torch.Generator().manual_seed(0)
    for key, value in flat.items():
        if key.endswith(".exp_avg"):
            flat[key] = double_rounding_values(value.shape, gen)
            through_fp32 = flat[key].float()
            ties = (through_fp32.view(torch.int32) & 0xFFFF) == 0x8000
            assert bool(ties.all()), "through FP32 every value is a BF16 tie"
            assert bool((through_fp32.double() != flat[key]).all()), "FP64: just off the tie"
    dcp.save({"optim": flat}, checkpoint_id=str(tmp_path))
    ours, template, te = (plain_run(torch.bfloat16, "fp32", seed=7) for _ in range(3))
    state = {"optim": ours.state()}
    planner = StreamingLoadPlanner(state["optim"])
    with no_template(ours.opt):
        dcp.load(state, checkpoint_id=str(tmp_path), planner=planner)
    dcp.load({"optim": template.state()}, checkpoint_id=str(tmp_path))
    dcp.load({"optim": te.state(placement=None)}, checkpoint_id=str(tmp_path))
    assert_same_run(template, te, "FP64 checkpoint: template path vs TE's load", params=False)
    assert_same_run(ours, template, "FP64 checkpoint: streaming vs template path", params=False)
    assert planner.peak_assembly_bytes == 0  # straight into the live BF16 states


def stored_expanded(value: torch.Tensor) -> torch.Tensor:
    """``value``'s first row repeated, viewed with stride 0 over a storage as large as its
    bytes, which DCP's writer saves as it is (it copies only views of larger storages)."""
    inner = value[0].numel()
    base = torch.empty(value.numel(), dtype=value.dtype)
    base[:inner] = value[0].reshape(-1)
    return base.as_strided(value.shape, (0, *value[0].contiguous().stride()))


@pytest.mark.usefixtures("quiet")
def test_a_checkpoint_of_expanded_tensors_loads_as_the_template_path(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The reader copies each saved tensor into the planner's dense buffer, so an expanded one
    (which TE scales in place and fails on, for an FP16 state on its own device) loads as its
    dense copy loads."""
    from torch.distributed.checkpoint import filesystem

    run = trained(torch.float16, "fp16")
    with export_placement("cpu"):
        flat = get_optimizer_state_dict(
            run.model, run.opt, options=StateDictOptions(flatten_optimizer_state_dict=True)
        )
    for key, value in flat.items():
        if isinstance(value, torch.Tensor) and value.dim() and value.shape[0] > 1:
            flat[key] = stored_expanded(value)
    dcp.save({"optim": flat}, checkpoint_id=str(tmp_path))
    read_overlapping = []
    narrow = filesystem.narrow_tensor_by_index

    def recording(tensor: torch.Tensor, *args: Any) -> torch.Tensor:
        read_overlapping.append(0 in tensor.stride() and tensor.numel() > 1)
        return narrow(tensor, *args)

    monkeypatch.setattr(filesystem, "narrow_tensor_by_index", recording)
    ours, template = (plain_run(torch.float16, "fp16", seed=7) for _ in range(2))
    state = {"optim": ours.state()}
    with no_template(ours.opt):
        dcp.load(state, checkpoint_id=str(tmp_path), planner=StreamingLoadPlanner(state["optim"]))
    assert any(read_overlapping), "the files hold no expanded tensor"
    dcp.load({"optim": template.state()}, checkpoint_id=str(tmp_path))
    assert_same_run(ours, template, "expanded items: streaming vs template path", params=False)


@pytest.mark.usefixtures("quiet")
def test_the_benchmark_streaming_load_runs(tmp_path: Path) -> None:
    """benchmarks/dcp_e2e.py's placement_cpu_streaming load, on the stand-in."""
    from benchmarks.dcp_e2e import streaming_load

    run = trained(torch.bfloat16, "remainder")
    save(run, tmp_path)
    ours, ref = (
        trained(torch.bfloat16, "remainder", seed=5),
        plain_run(torch.bfloat16, "remainder", 7),
    )
    load_template_path(ref, tmp_path)
    with no_template(ours.opt):
        report = streaming_load(ours.model, ours.opt, str(tmp_path))
    assert_same_run(ours, ref, "benchmark load vs template path")
    assert_same_run(ours, run, "benchmark load vs saved")
    assert report["peak_assembly_bytes"] == 0 and report["fallbacks"] == []
    assert report["versions"]["torch"] == torch.__version__


def test_the_fresh_load_memory_benchmark_runs(tmp_path: Path) -> None:
    """benchmarks/fresh_load_memory.py on the stand-in: one record, checked against TE's load."""
    from benchmarks import fresh_load_memory as bench

    out = tmp_path / "fresh.json"
    argv = ["--cpu-smoke", "--moments", "fp16", "--hidden", "16", "--out", str(out)]
    assert bench.main([*argv, "--dir", str(tmp_path)]) == 0
    written = json.loads(out.read_text())
    (record,) = written["records"]
    assert written["machine"]["cpu_smoke"] is True
    assert record["equal_to_te_load"] is True and record["peak_extra_gpu_bytes"] is None
    assert (record["n_elements"], record["max_elements"]) == (2 * 16 * 16, 16 * 16)
    assert record["bound_bytes"] == 8 * 16 * 16 + 2**20
    assert record["peak_assembly_bytes"] == 4 * 16 * 16  # one FP16 state at a time
    assert not dist.is_initialized()  # its 1-rank group is gone


# --- checks before any write --------------------------------------------------------------------
class TamperedReader(FileSystemReader):
    """A checkpoint whose metadata lost the second saved chunk... of one state, by halving it."""

    def __init__(self, path: str | Path, key: str) -> None:
        super().__init__(str(path))
        self.key = key

    def read_metadata(self, *args: Any, **kwargs: Any) -> Any:
        metadata = super().read_metadata(*args, **kwargs)
        md = metadata.state_dict_metadata[self.key]
        chunk = md.chunks[0]
        half = torch.Size([chunk.sizes[0] // 2, *chunk.sizes[1:]])
        md.chunks[0] = type(chunk)(offsets=chunk.offsets, sizes=half)
        return metadata


def bad_checkpoints(tmp_path: Path) -> dict[str, tuple[Callable[[], Any], str]]:
    """name -> (a function returning dcp.load keywords, the error the planner must raise)."""

    def saved(moments: torch.dtype, master: str, name: str, **model: Any) -> Path:
        run = trained(moments, master, seed=11)
        if model:
            run = plain_run(moments, master, seed=11)
            run.model = torch.nn.Sequential(  # type: ignore[assignment]
                torch.nn.Linear(3, 6), torch.nn.Linear(6, 4)
            ).to(param_dtype(master))
            params = list(run.model.parameters())
            run.opt = make_optimizer(
                [{"params": params[:2]}, {"params": params[2:], "lr": 3e-3}],
                moments=moments,
                master=master,
            )
            run.train(1, seed=3)
        save(run, tmp_path / name)
        return tmp_path / name

    return {
        "shape": (
            lambda: {"checkpoint_id": str(saved(torch.bfloat16, "remainder", "shape", wide=True))},
            r"saved with shape \(6, 3\), the parameter has \(5, 3\)",
        ),
        "fp32_master_into_remainders": (
            lambda: {"checkpoint_id": str(saved(torch.bfloat16, "fp32", "master"))},
            "stored as torch.float32, but this optimizer keeps int16 remainders "
            r"\(store_param_remainders=True\); load with the setting the checkpoint was saved with",
        ),
        "missing_master": (
            lambda: {"checkpoint_id": str(saved(torch.bfloat16, "none", "no_master"))},
            r"state\.0\.weight\.master_param: not in the checkpoint",
        ),
        "uncovered": (
            lambda: {
                "storage_reader": TamperedReader(
                    saved(torch.bfloat16, "remainder", "uncovered"), "optim.state.0.weight.exp_avg"
                )
            },
            "the checkpoint's pieces cover 6 of the 15 local elements",
        ),
    }


@pytest.mark.usefixtures("quiet")
@pytest.mark.parametrize(
    "case", ["shape", "fp32_master_into_remainders", "missing_master", "uncovered"]
)
def test_bad_checkpoints_are_rejected_before_any_write(tmp_path: Path, case: str) -> None:
    source, message = bad_checkpoints(tmp_path)[case]
    where = source()
    run = trained(torch.bfloat16, "remainder", seed=21)  # a trained optimizer: values to keep
    before, before_groups = by_position(run.opt), hyperparams(run.opt)
    weights = [bits(p).clone() for p in run.params()]
    state = {"optim": run.state()}
    planner = StreamingLoadPlanner(state["optim"])
    with pytest.raises(CheckpointException, match=message) as info:
        with no_template(run.opt):
            dcp.load(state, planner=planner, **where)
    assert "No state was written" in str(info.value)
    assert_snapshot_equal(by_position(run.opt), before)
    assert hyperparams(run.opt) == before_groups
    assert all(torch.equal(bits(p), w) for p, w in zip(run.params(), weights, strict=True))
    assert "0 of" in planner.progress and "0 partly written" in planner.progress
    report = planner.report  # a refused load leaves a failed report, with nothing written
    assert report is not None and report is reports.last_report()
    assert (report.path, report.failed, report.error, report.states) == (
        "planner",
        True,
        "ValueError",
        0,
    )
    assert report.host_to_device_bytes == 0


@pytest.mark.usefixtures("quiet")
def test_a_write_that_would_be_refused_stops_the_load_before_any_state_is_written(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """An assembled state (FP16 here) is written when its last item has arrived; whether TE's
    load takes it is checked before the first read, not after other states were written."""
    run = trained(torch.float16, "remainder")
    save(run, tmp_path)
    ours = trained(torch.float16, "remainder", seed=21)
    before, before_groups = by_position(ours.opt), hyperparams(ours.opt)
    last = ours.params()[-1]
    check = _te_load_check.check  # the load's check of one value (te_load.check_value's)

    def refuse(facts: Any, param: Any, index: Any, name: str, value: Any) -> None:
        if param is last and name == "exp_avg_sq":
            raise ValueError("injected: TE's load refuses this value")
        check(facts, param, index, name, value)

    monkeypatch.setattr(_te_load_check, "check", refuse)
    state = {"optim": ours.state()}
    planner = StreamingLoadPlanner(state["optim"])
    with pytest.raises(CheckpointException, match="injected") as info, no_template(ours.opt):
        dcp.load(state, checkpoint_id=str(tmp_path), planner=planner)
    assert "No state was written" in str(info.value)
    assert_snapshot_equal(by_position(ours.opt), before)
    assert hyperparams(ours.opt) == before_groups
    assert "0 of" in planner.progress and "0 partly written" in planner.progress
    assert planner.peak_assembly_bytes == 0  # refused before any buffer was made


# --- failures after writing began ---------------------------------------------------------------
@pytest.mark.usefixtures("quiet")
def test_failure_part_way_says_what_state_the_optimizer_is_in(tmp_path: Path) -> None:
    run = trained(torch.float16, "fp32")
    save(run, tmp_path)
    ours = trained(torch.float16, "fp32", seed=30)
    state = {"optim": ours.state()}
    planner = StreamingLoadPlanner(state["optim"])
    with pytest.raises(CheckpointException, match="the disk went away"), no_template(ours.opt):
        dcp.load(state, storage_reader=StopAfter(tmp_path, 5), planner=planner)
    assert planner.progress == "5 of 12 optimizer states loaded, 0 partly written, 7 not started"
    # The adapter remembers, and says so when asked for its state dict.
    with pytest.warns(StreamingLoadWarning, match="stopped part-way .*5 of 12"):
        state["optim"].state_dict()

    # A load that returns without having read everything is caught when the adapter finishes.
    planner = StreamingLoadPlanner(state["optim"])
    with pytest.raises(RuntimeError, match=r"dcp\.load returned before 4 optimizer states"):
        dcp.load(state, storage_reader=StopAfter(tmp_path, 8, quietly=True), planner=planner)

    # A failure in the planner's own write names the state and the optimizer's condition.
    calls = []

    def failing_write(*args: Any) -> None:
        calls.append(args)
        if len(calls) == 3:
            raise MemoryError("no host memory")
        original(*args)

    original = _load_targets._write_state
    _load_targets._write_state = failing_write  # type: ignore[assignment]
    try:
        expected = (
            r"failed part-way, at optim\.state\.0\.bias\.exp_avg \(MemoryError: no host "
            r"memory\)\. 3 of 12 optimizer states loaded, 1 partly written, 8 not started"
        )
        planner = StreamingLoadPlanner(state["optim"])
        with pytest.raises(CheckpointException, match=expected):
            dcp.load(state, checkpoint_id=str(tmp_path), planner=planner)
    finally:
        _load_targets._write_state = original  # type: ignore[assignment]

    # Loading again repairs it: a complete load writes every state.
    planner = load_streaming(ours, tmp_path)
    ref = plain_run(torch.float16, "fp32", 7)
    load_template_path(ref, tmp_path)
    assert_same_run(ours, ref, "repaired")
    assert state["optim"].unfinished_load is not None  # that adapter was not the one reloaded
    with warnings.catch_warnings():
        warnings.simplefilter("error", StreamingLoadWarning)
        ours.state().state_dict()  # a fresh adapter of the repaired optimizer: no warning


def interrupting_write(monkeypatch: pytest.MonkeyPatch) -> None:
    """The planner's third FP16/FP8 write is interrupted (Ctrl-C inside a planner call)."""
    calls = []
    original = _load_targets._write_state

    def write(*args: Any) -> None:
        calls.append(args)
        if len(calls) == 3:
            raise KeyboardInterrupt
        original(*args)

    monkeypatch.setattr(_load_targets, "_write_state", write)


@pytest.mark.usefixtures("quiet")
def test_a_stopped_load_keeps_nothing_of_its_planner_alive(tmp_path: Path) -> None:
    """The step guard keeps the stopped load's progress alone: the planner, with its assembly
    buffers and upload rings, goes when the caller drops it, and step() still says how far the
    load got."""
    run = trained(torch.float16, "fp32")
    save(run, tmp_path)
    ours = trained(torch.float16, "fp32", seed=30)
    state = {"optim": ours.state()}
    planner = StreamingLoadPlanner(state["optim"])
    gone = weakref.ref(planner)
    with pytest.raises(CheckpointException), no_template(ours.opt):
        dcp.load(state, planner=planner, storage_reader=StopAfter(tmp_path, 5))
    del state, planner
    gc.collect()
    assert gone() is None, "the optimizer's step guard keeps the stopped planner alive"
    refused = r"step\(\) refused: .* overwrote \d+ of this optimizer's 12 states"
    with pytest.raises(RuntimeError, match=refused):
        ours.train(1, seed=9)


@pytest.mark.usefixtures("quiet")
@pytest.mark.parametrize(
    "fault", ["reader error", "reader interrupt", "interrupted write"], ids=str.split
)
def test_a_load_stopped_part_way_refuses_to_step_until_a_complete_load(
    tmp_path: Path, fault: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    run = trained(torch.float16, "fp32")
    save(run, tmp_path)
    ours = trained(torch.float16, "fp32", seed=30)
    state = {"optim": ours.state()}
    planner = StreamingLoadPlanner(state["optim"])
    reader: dict[str, Any] = {"storage_reader": StopAfter(tmp_path, 5)}
    if fault == "reader interrupt":
        reader = {"storage_reader": StopAfter(tmp_path, 5, exc=KeyboardInterrupt())}
    elif fault == "interrupted write":
        interrupting_write(monkeypatch)
        reader = {"checkpoint_id": str(tmp_path)}
    # DCP's reader step turns any failure, an interrupt too, into a CheckpointException.
    with pytest.raises(CheckpointException) as info, no_template(ours.opt):
        dcp.load(state, planner=planner, **reader)
    if fault == "interrupted write":  # inside the planner: the interrupt, with what it left
        assert "KeyboardInterrupt" in str(info.value)
        assert re.search(r"te_ckpt_placement: loading .* failed part-way", str(info.value))
        assert planner._failed is not None and planner._rings == {}
    monkeypatch.undo()
    found = re.match(r"(\d+) of 12 optimizer states loaded, (\d+) partly", planner.progress)
    assert found, planner.progress
    loaded, partly = map(int, found.groups())
    assert loaded + partly > 0
    before, groups = by_position(ours.opt), hyperparams(ours.opt)
    weights = [bits(p).clone() for p in ours.params()]
    refused = (
        rf"step\(\) refused: .* overwrote {loaded + partly} of this optimizer's 12 states .*"
        rf"\({loaded} of them completely\).* Load a complete checkpoint again"
    )
    for _ in range(2):  # it stays refused
        with pytest.raises(RuntimeError, match=refused):
            ours.train(1, seed=9)
    assert_snapshot_equal(by_position(ours.opt), before)
    assert hyperparams(ours.opt) == groups
    assert all(torch.equal(bits(p), w) for p, w in zip(ours.params(), weights, strict=True))

    # A complete load lifts the guard, streaming or through the template path.
    if fault == "reader error":
        load_template_path(ours, tmp_path)
    else:
        load_streaming(ours, tmp_path)
    ref = plain_run(torch.float16, "fp32", 7)
    load_template_path(ref, tmp_path)
    for r in (ours, ref):
        r.train(2, seed=9)
    assert_same_run(ours, ref, f"{fault}: repaired, then trained")


@pytest.mark.usefixtures("quiet")
@pytest.mark.parametrize("exc", [RuntimeError("the hook failed"), KeyboardInterrupt()], ids=repr)
def test_a_load_post_hook_that_raises_leaves_every_state_attached(
    tmp_path: Path, exc: BaseException
) -> None:
    """torch's post-hooks run after the states are back in place: a failing one (or an interrupt
    there) leaves the optimizer loaded, not without states."""
    run = trained(torch.bfloat16, "fp32")
    save(run, tmp_path)
    ours, ref = trained(torch.bfloat16, "fp32", seed=30), plain_run(torch.bfloat16, "fp32", 7)
    load_template_path(ref, tmp_path)
    seen: list[int] = []

    def failing_hook(optimizer: Any) -> None:
        seen.append(len(optimizer.state))
        raise exc

    ours.opt.register_load_state_dict_post_hook(failing_hook)
    with pytest.raises(type(exc)):
        load_streaming(ours, tmp_path)
    assert seen == [4], f"the post-hook saw {seen} parameters with states"
    assert_same_run(ours, ref, "post-hook failed", params=False)
    assert_same_run(ours, run, "post-hook failed vs saved", params=False)
    ours.train(1, seed=9)  # a complete load: step() is not refused


@pytest.mark.usefixtures("quiet")
@pytest.mark.parametrize(
    "case",
    ["shape", "fp32_master_into_remainders", "missing_master", "uncovered", "foreign_param"],
)
def test_a_refused_load_leaves_a_fresh_optimizer_fresh(tmp_path: Path, case: str) -> None:
    """ "No state was written" is true of a fresh optimizer too: the initial states the planner
    gave it are taken back, with the step counts, and its first step is a first step."""
    ours, twin = (plain_run(torch.bfloat16, "remainder", seed=21) for _ in range(2))
    if case == "foreign_param":  # refused while the template is built (in state_dict())
        for r in (ours, twin):
            params = [*r.model.parameters(), torch.nn.Parameter(torch.ones(3).bfloat16())]
            r.opt = make_optimizer(params, moments=torch.bfloat16, master="remainder")
        where: dict[str, Any] = {"checkpoint_id": str(tmp_path)}
        expected: type[BaseException] = ValueError
    else:
        source, _ = bad_checkpoints(tmp_path)[case]
        where, expected = source(), CheckpointException
    state = {"optim": ours.state()}
    planner = StreamingLoadPlanner(state["optim"])
    with pytest.raises(expected, match="No state was written"), no_template(ours.opt):
        dcp.load(state, planner=planner, **where)
    assert not ours.opt.state and not ours.opt._scales, "initial states were kept"
    assert hyperparams(ours.opt) == hyperparams(twin.opt), "the step counts changed"
    for r in (ours, twin):
        r.train(2, seed=3)
    assert_same_run(ours, twin, f"{case}: after a refused load")


# --- fallback and misuse ------------------------------------------------------------------------
@pytest.mark.usefixtures("quiet")
def test_an_optimizer_without_te_storage_falls_back_with_a_warning(tmp_path: Path) -> None:
    def adam(seed: int) -> tuple[torch.nn.Module, torch.optim.Optimizer]:
        torch.manual_seed(seed)
        model = torch.nn.Linear(3, 4)
        return model, torch.optim.Adam(model.parameters(), lr=1e-2)

    model, opt = adam(0)
    model(torch.randn(2, 3)).sum().backward()
    opt.step()
    dcp.save({"optim": PlacedOptimizerState(model, opt)}, checkpoint_id=str(tmp_path))
    model2, opt2 = adam(1)
    state = {"optim": PlacedOptimizerState(model2, opt2)}
    planner = StreamingLoadPlanner(state["optim"])
    with pytest.warns(StreamingLoadWarning, match="does not keep TE FusedAdam's storage"):
        dcp.load(state, checkpoint_id=str(tmp_path), planner=planner)
    assert planner.fallbacks and "Adam" in planner.fallbacks[0]
    assert_snapshot_equal(
        {i: v for i, v in enumerate(snapshot(opt2).values())},
        {i: v for i, v in enumerate(snapshot(opt).values())},
    )


@pytest.mark.usefixtures("quiet")
def test_misuse_is_refused(tmp_path: Path) -> None:
    run = trained(torch.bfloat16, "fp32")
    save(run, tmp_path)
    with pytest.raises(ValueError, match="valid values are one or more"):
        StreamingLoadPlanner()
    with pytest.raises(ValueError, match="valid values are one or more"):
        StreamingLoadPlanner(run.opt)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="given twice"):
        adapter = run.state()
        StreamingLoadPlanner(adapter, adapter)
    for bad in (-1, 1.5, True):
        with pytest.raises(ValueError, match="max_assembly_bytes"):
            StreamingLoadPlanner(run.state(), max_assembly_bytes=bad)  # type: ignore[arg-type]

    # The adapter is not in the loaded dict: refused before any read, and it is disarmed.
    ours = plain_run(torch.bfloat16, "fp32", 7)
    adapter = ours.state()
    with pytest.raises(CheckpointException, match=r"is not in the state dict given to dcp\.load"):
        dcp.load(
            {"model": get_model_state_dict(ours.model)},
            checkpoint_id=str(tmp_path),
            planner=StreamingLoadPlanner(adapter),
        )
    exported = adapter.state_dict()
    assert all(isinstance(v, torch.Tensor) for k, v in exported.items() if "state." in k)

    # The armed adapter's template handed to dcp.save or copied: refused, loudly.
    adapter = ours.state()
    StreamingLoadPlanner(adapter)
    with pytest.raises(CheckpointException, match="streaming-load template"):
        dcp.save({"optim": adapter}, checkpoint_id=str(tmp_path / "bad"))
    StreamingLoadPlanner(adapter)
    template = adapter.state_dict()
    import copy

    with pytest.raises(TypeError, match="cannot be saved, pickled or copied"):
        copy.deepcopy(template)
    # ... or loaded with another planner: nothing is read into it.
    with pytest.raises(CheckpointException, match=r"optim\.state\."):
        dcp.load({"optim": template}, checkpoint_id=str(tmp_path))


# --- 2 ranks ------------------------------------------------------------------------------------
def _worker(rank: int, port: int, root: str) -> None:
    mesh = init_gloo_mesh(rank, port)
    warnings.filterwarnings("ignore", "torch.distributed is disabled", UserWarning)
    try:
        run_streaming_checks(CPU, mesh, Path(root))
        check_failures(CPU, mesh, Path(root) / "failures")
    finally:
        dist.destroy_process_group()


def test_streaming_load_on_two_ranks(tmp_path: Path) -> None:
    spawn(_worker, str(tmp_path))
    for ckpt in ("reshard/one_to_two", "full_state_dict"):
        assert (tmp_path / ckpt / ".metadata").is_file(), f"{ckpt}: no checkpoint"


# --- the upload ring (its CPU seam: slots of plain memory, copies that complete at once) --------
def nan_payloads(shape: tuple[int, ...]) -> torch.Tensor:
    """FP32 values with NaNs of several signs and payloads (quiet and signalling) among them."""
    values = torch.randn(shape, generator=torch.Generator().manual_seed(3))
    patterns = torch.tensor([0x7FC00000, 0xFFC00001, 0x7F800001, 0xFF812345], dtype=torch.int64)
    flat = values.view(-1).view(torch.int32)
    flat[::3] = patterns.repeat(flat[::3].numel() // 4 + 1)[: flat[::3].numel()].to(torch.int32)
    return values


def sources() -> dict[str, torch.Tensor]:
    """Item sources as DCP's reader hands them: saved tensors of several layouts, narrowed."""
    rows = nan_payloads((6, 40))
    cols = nan_payloads((40, 6)).t()  # dense, not row-major
    cube = nan_payloads((4, 5, 6)).permute(2, 0, 1)
    return {
        "contiguous": rows,
        "transposed": cols,
        "transposed rows": cols[1:4],
        "transposed columns": cols[:, 5:30],
        "narrowed columns": rows[:, 3:37],
        "narrowed rows": rows[2:5],
        "strided vector": rows[:, 7],
        "permuted cube": cube,
        "one element": rows[1:2, 3:4],
        "half": nan_payloads((6, 40)).half().t(),
        "bf16 into fp32": nan_payloads((6, 40)).bfloat16().t(),
    }


def cpu_ring(slot_bytes: int) -> _ring.SlotLender:
    """The planner's ring for a host device, as ``StreamingLoadPlanner`` makes it."""
    return _ring.SlotLender(
        torch.device("cpu"),
        slot_bytes=slot_bytes,
        slots=load_planner.UPLOAD_SLOTS,
        view_as=load_planner._Slot,
    )


@pytest.mark.parametrize("name", list(sources()))
def test_a_slot_holds_the_bits_of_torchs_copy_to_the_device(name: str) -> None:
    src = sources()[name]
    dtype = torch.float32 if name == "bf16 into fp32" else torch.bfloat16
    # torch's host-to-device copy (aten/src/ATen/native/cuda/Copy.cu): src.to(dst.dtype) on the
    # host, made contiguous, then a plain copy of those bytes.
    expected = src.to(dtype).contiguous()
    ring = cpu_ring(4096)
    slot = ring.take()
    assert slot is not None
    target = ring.view(slot, tuple(src.shape), dtype).detach()  # as FileSystemReader does
    target.copy_(src)
    live = torch.empty(src.shape, dtype=dtype)
    ring.upload(slot, live, target)
    assert torch.equal(bits(live), bits(expected))
    ring.close()


@pytest.mark.parametrize("how", ["keyword", "positional"])
def test_a_slot_keeps_the_bits_when_the_reader_copies_non_blocking(how: str) -> None:
    src = sources()["transposed"]
    expected = src.to(torch.bfloat16).contiguous()
    ring = cpu_ring(4096)
    slot = ring.take()
    assert slot is not None
    target = ring.view(slot, tuple(src.shape), torch.bfloat16).detach()
    if how == "keyword":
        target.copy_(src, non_blocking=True)
    else:
        target.copy_(src, True)
    assert torch.equal(bits(target.as_subclass(torch.Tensor)), bits(expected))
    ring.close()


def test_a_plain_copy_into_a_contiguous_buffer_would_differ_in_nan_bits() -> None:
    """Why slots convert through _Slot: the CPU kernels differ for a dense transposed source."""
    src = sources()["transposed"]
    plain = torch.empty(src.shape, dtype=torch.bfloat16).copy_(src)
    assert not torch.equal(bits(plain), bits(src.to(torch.bfloat16).contiguous()))


def test_a_slot_is_reused_only_after_its_upload_completed() -> None:
    ring = cpu_ring(64)
    assert ring.nbytes == load_planner.UPLOAD_SLOTS * 64
    taken = []
    for _ in range(5):
        slot = ring.take()
        assert slot is not None
        event = ring.events[slot]
        # Every upload previously recorded on this slot was waited for before it was lent again.
        assert event.waited == event.recorded
        taken.append(slot)
        ring.upload(slot, torch.empty(16), ring.view(slot, (16,), torch.float32))
        assert ring.events[slot].recorded > ring.events[slot].waited  # queued, not waited yet
    assert taken == [i % load_planner.UPLOAD_SLOTS for i in range(5)]
    # Slots handed out and not committed are never lent twice; with all lent, none is.
    lent = [ring.take() for _ in range(load_planner.UPLOAD_SLOTS)]
    assert sorted(lent) == list(range(load_planner.UPLOAD_SLOTS))  # type: ignore[type-var]
    assert ring.take() is None
    ring.close()
    assert ring.nbytes == 0 and not any(ring.queued) and not any(ring.lent)


@pytest.fixture
def ring_on_cpu(monkeypatch: pytest.MonkeyPatch) -> list[Any]:
    """Routes CPU live states through the upload ring; returns the rings made, to inspect."""
    monkeypatch.setattr(load_planner, "RING_DEVICE_TYPES", ("cuda", "cpu"))
    made: list[Any] = []
    original = _ring.SlotLender.__init__

    def init(self: Any, *args: Any, **kwargs: Any) -> None:
        original(self, *args, **kwargs)
        made.append(self)

    monkeypatch.setattr(_ring.SlotLender, "__init__", init)
    return made


@pytest.mark.usefixtures("quiet")
@pytest.mark.parametrize("master", MASTERS)
def test_the_ring_path_loads_what_the_template_path_loads(
    tmp_path: Path, master: str, ring_on_cpu: list[Any], monkeypatch: pytest.MonkeyPatch
) -> None:
    run = trained(torch.bfloat16, master)
    save(run, tmp_path)
    ours, ref = plain_run(torch.bfloat16, master, seed=7), plain_run(torch.bfloat16, master, 7)
    # Slots smaller than the largest items: those are copied straight into the live state.
    item_bytes = sorted(
        {2 * v.numel() for v in run.opt.state[run.opt.param_groups[0]["params"][0]].values()}
    )
    cap = load_planner.UPLOAD_SLOTS * max(16, min(item_bytes))
    monkeypatch.setattr(load_planner, "UPLOAD_RING_BYTES", cap)
    planner = load_streaming(ours, tmp_path)
    load_template_path(ref, tmp_path)
    assert_same_run(ours, ref, "ring path vs template path")
    assert_same_run(ours, run, "ring path vs saved")
    details = assert_planner_report(planner, last=False).details
    assert details["ring_items"] > 0 and details["direct_items"] > 0
    assert 0 < details["ring_host_bytes"] <= cap
    assert 0 < details["ring_bytes"] < planner.report.host_to_device_bytes  # type: ignore[union-attr]
    assert [ring.nbytes for ring in ring_on_cpu] == [0]  # closed at the load's end
    assert planner._rings == {} and planner._pending == {}


@pytest.mark.usefixtures("quiet")
def test_a_failed_upload_waits_for_the_others_and_lets_the_ring_go(
    tmp_path: Path, ring_on_cpu: list[Any], monkeypatch: pytest.MonkeyPatch
) -> None:
    run = trained(torch.bfloat16, "fp32")
    save(run, tmp_path)
    ours = trained(torch.bfloat16, "fp32", seed=30)
    calls = []
    original = _ring.SlotLender.upload

    def failing(self: Any, slot: int, dst: torch.Tensor, src: torch.Tensor) -> None:
        calls.append(slot)
        if len(calls) == 4:
            raise RuntimeError("CUDA error: an illegal memory access")
        original(self, slot, dst, src)

    monkeypatch.setattr(_ring.SlotLender, "upload", failing)
    state = {"optim": ours.state()}
    planner = StreamingLoadPlanner(state["optim"])
    with pytest.raises(CheckpointException, match="illegal memory access"), no_template(ours.opt):
        dcp.load(state, checkpoint_id=str(tmp_path), planner=planner)
    (ring,) = ring_on_cpu
    assert ring.nbytes == 0 and not any(ring.queued) and not any(ring.lent)
    assert planner._rings == {} and planner._pending == {}
    assert "3 of" in planner.progress
    report = planner.report  # the failure's report: the work done before it
    assert report is not None and report is reports.last_report()
    assert (report.path, report.failed, report.error) == ("planner", True, "RuntimeError")
    assert report.states == 3 and report.details["ring_items"] >= 4
    assert 0 < report.details["ring_host_bytes"] <= report.peak_host_bytes


@pytest.mark.usefixtures("quiet")
def test_a_reader_failure_between_resolve_and_commit_frees_the_ring_at_the_next_load(
    tmp_path: Path, ring_on_cpu: list[Any]
) -> None:
    """The reader fails with a slot lent (no planner call sees it): the adapter keeps the failed
    planner for its warning, and the next planner made for the adapter lets that ring go."""
    run = trained(torch.bfloat16, "fp32")
    save(run, tmp_path)
    ours = trained(torch.bfloat16, "fp32", seed=30)
    slots = []

    class ShortRead(FileSystemReader):
        def read_data(self, plan: LoadPlan, planner: LoadPlanner) -> Any:
            resolve = planner.resolve_tensor

            def resolve_then_fail(item: Any) -> torch.Tensor:
                target = resolve(item)
                slots.append(target)
                if len(slots) == 3:
                    raise OSError("short read")
                return target

            planner.resolve_tensor = resolve_then_fail  # type: ignore[method-assign]
            return super().read_data(plan, planner)

    state = {"optim": ours.state()}
    failed = StreamingLoadPlanner(state["optim"])
    with pytest.raises(CheckpointException, match="short read"), no_template(ours.opt):
        dcp.load(state, storage_reader=ShortRead(str(tmp_path)), planner=failed)
    assert isinstance(slots[-1], load_planner._Slot)  # the reader held a slot when it failed
    assert state["optim"].unfinished_load is failed  # for the adapter's warning
    (stale,) = ring_on_cpu
    planner = StreamingLoadPlanner(state["optim"])
    assert stale.nbytes == 0 and failed._rings == {} and failed._pending == {}
    again = {"model": get_model_state_dict(ours.model), "optim": state["optim"]}
    with no_template(ours.opt):
        dcp.load(again, checkpoint_id=str(tmp_path), planner=planner)
    set_model_state_dict(ours.model, again["model"])
    assert_same_run(ours, run, "the load after the failed one vs saved")
    assert [ring.nbytes for ring in ring_on_cpu] == [0, 0]


@pytest.mark.usefixtures("quiet")
def test_after_a_failure_no_item_is_uploaded_or_counted(
    tmp_path: Path, ring_on_cpu: list[Any], monkeypatch: pytest.MonkeyPatch
) -> None:
    """A reader with several items in flight (threads) after one failed: the failure let the
    rings go, so a later commit must not count its item as written, nor a resolve make a ring."""
    run = trained(torch.bfloat16, "fp32")
    save(run, tmp_path)
    ours = trained(torch.bfloat16, "fp32", seed=31)
    seen: dict[str, Any] = {}

    def failing(*args: Any) -> None:
        raise OSError("device lost")

    class TwoAtOnce(FileSystemReader):
        def read_data(self, plan: LoadPlan, planner: LoadPlanner) -> Any:
            assert isinstance(planner, StreamingLoadPlanner)
            ours_items = [i for i in plan.items if i.dest_index.fqn in planner._targets]
            first, second = ours_items[:2]
            a = planner.resolve_tensor(first).detach()
            b = planner.resolve_tensor(second).detach()
            seen["slots"] = [type(a), type(b)]
            monkeypatch.setattr(_ring.SlotLender, "upload", failing)
            with pytest.raises(RuntimeError, match="device lost"):
                planner.commit_tensor(second, b)
            target = planner._targets[first.dest_index.fqn]
            remaining = target.remaining
            with pytest.raises(RuntimeError, match="already failed"):
                planner.commit_tensor(first, a)
            seen["counted"] = target.remaining != remaining
            with pytest.raises(RuntimeError, match="already failed"):
                planner.resolve_tensor(ours_items[2])
            seen["rings"] = dict(planner._rings)
            raise OSError("stopped after the failure")

    state = {"optim": ours.state()}
    planner = StreamingLoadPlanner(state["optim"])
    with (
        pytest.raises(CheckpointException, match="stopped after the failure"),
        no_template(ours.opt),
    ):
        dcp.load(state, storage_reader=TwoAtOnce(str(tmp_path)), planner=planner)
    assert seen == {"slots": [load_planner._Slot] * 2, "counted": False, "rings": {}}
    assert [ring.nbytes for ring in ring_on_cpu] == [0]
    assert "0 of" in planner.progress
