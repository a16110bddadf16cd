"""``StreamingLoadPlanner`` against the CPU stand-in: ``dcp.load`` with no FP32 template.

In-process tests (plain tensors, no process group) cover every storage mode the stand-in keeps
(FP32, BF16, FP16 and FP8 moments; no, FP32 and int16-remainder masters), the checks made before
any write, failures part-way, the warned fallback and misuse. One spawn of 2 gloo ranks then runs
:func:`run_streaming_checks` on ``fully_shard`` models, which tests/test_gpu_dcp_load.py runs again
with real TE on 2 GPUs: round trips equal to the template path and to TE's own load, continued
training equal to an uninterrupted run, resharding 2 -> 1 and 1 -> 2, and a checkpoint written
from a full state dict.

In every streaming load the optimizer's ``state_dict()`` is made to fail: no template is built.
"""

from __future__ import annotations

import contextlib
import datetime
import math
import socket
import warnings
from collections.abc import Callable, Iterator
from dataclasses import dataclass
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
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.tensor import DTensor, distribute_tensor

from te_ckpt_placement import export_placement, te_hooks
from te_ckpt_placement.dcp import (
    PlacedOptimizerState,
    StreamingLoadPlanner,
    StreamingLoadWarning,
    load_planner,
)

from .support.helpers import assert_bit_equal, assert_snapshot_equal, bits, local, snapshot
from .support.standin import StandInFusedAdam, make_optimizer

pytestmark = pytest.mark.usefixtures("hooked_standin")

WORLD = 2
MOMENTS = (torch.float32, torch.bfloat16, torch.float16, torch.uint8)
MASTERS = ("none", "fp32", "fp16", "remainder")
WHOLE = (torch.float16, torch.uint8)  # scaled by the absmax of the whole state


@dataclass(frozen=True)
class Backend:
    """Where the checks run: the CPU stand-in here, real TE on CUDA in test_gpu_dcp_load."""

    device: str
    make_optimizer: Callable[..., torch.optim.Optimizer]


BACKEND = Backend("cpu", make_optimizer)


# --- models, training, comparisons --------------------------------------------------------------
def param_dtype(master: str) -> torch.dtype:
    return torch.bfloat16 if master == "remainder" else torch.float32


class Run:
    """A model (``fully_shard`` on ``mesh``, or plain) with its optimizer of two groups."""

    def __init__(
        self, mesh: DeviceMesh | None, moments: torch.dtype, master: str, seed: int
    ) -> None:
        torch.manual_seed(seed)  # the same full weights on every rank
        model = torch.nn.Sequential(torch.nn.Linear(3, 5), torch.nn.Linear(5, 4))
        model = model.to(param_dtype(master))
        if mesh is None:
            self.model = model.to(BACKEND.device)
        else:  # Linear(3, 5) shards unevenly: 3 + 2 rows
            from torch.distributed.fsdp import fully_shard

            fully_shard(model, mesh=mesh)
            self.model = model
        params = list(self.model.parameters())
        groups = [{"params": params[:2]}, {"params": params[2:], "lr": 3e-3}]
        self.opt = BACKEND.make_optimizer(groups, moments=moments, master=master)
        self.moments, self.master = moments, master

    def params(self) -> list[torch.Tensor]:
        return [p for group in self.opt.param_groups for p in group["params"]]

    def train(self, steps: int, seed: int) -> None:
        """Global gradients drawn in parameter order, so every world size sees the same ones."""
        gen = torch.Generator().manual_seed(seed)
        for _ in range(steps):
            for p in self.params():
                g = torch.randn(p.shape, generator=gen) * math.exp(
                    float(torch.randn(1, generator=gen)) * 3
                )
                if isinstance(p, DTensor):
                    p.grad = distribute_tensor(
                        g.to(p.dtype), p.device_mesh, p.placements, src_data_rank=None
                    )
                else:
                    p.grad = g.to(device=p.device, dtype=p.dtype)
            self.opt.step()
            self.opt.zero_grad(set_to_none=True)

    def state(self, **kwargs: Any) -> PlacedOptimizerState:
        return PlacedOptimizerState(self.model, self.opt, **kwargs)

    def largest_state(self) -> int:
        """M: the largest local state, in elements."""
        return max(local(p).numel() for p in self.params())

    def full(self) -> dict[str, Any]:
        """Global weights, exported states and hyperparameters (a collective under a mesh)."""
        with export_placement("cpu"):
            export = get_optimizer_state_dict(
                self.model, self.opt, options=StateDictOptions(flatten_optimizer_state_dict=True)
            )
        out: dict[str, Any] = {}
        for key, value in {**get_model_state_dict(self.model), **export}.items():
            if isinstance(value, DTensor):
                value = gather(value)
            out[key] = bits(value).clone() if isinstance(value, torch.Tensor) else value
        return out


def gather(t: DTensor) -> torch.Tensor:
    """The global tensor; gloo cannot all-gather int16, so remainders travel widened."""
    if t.dtype != torch.int16:
        return t.full_tensor()
    wide = DTensor.from_local(
        local(t).to(torch.int32), t.device_mesh, t.placements, shape=t.size(), stride=t.stride()
    )
    return wide.full_tensor().to(torch.int16)


def by_position(run: Run) -> dict[int, dict[str, torch.Tensor]]:
    snap = snapshot(run.opt)
    return {i: snap[p] for i, p in enumerate(run.params()) if p in snap}


def groups(run: Run) -> list[dict[str, Any]]:
    return [{k: v for k, v in g.items() if k != "params"} for g in run.opt.param_groups]


def assert_same_run(ours: Run, ref: Run, where: str, *, params: bool = True) -> None:
    """Weights, live states by position, FP16/FP8 scales and param_groups (step included)."""
    if params:
        for i, (p, q) in enumerate(zip(ref.params(), ours.params(), strict=True)):
            assert_bit_equal(q, p, f"{where}: param {i}")
    assert_snapshot_equal(by_position(ours), by_position(ref))
    for i, (p, q) in enumerate(zip(ref.params(), ours.params(), strict=True)):
        scales, scales2 = ref.opt._scales.get(p, {}), ours.opt._scales.get(q, {})
        assert scales.keys() == scales2.keys(), f"{where}: param {i}: scaled states differ"
        for name in scales:
            assert torch.equal(bits(scales[name]), bits(scales2[name])), f"{where}: {i} {name}"
    assert groups(ours) == groups(ref), f"{where}: param_groups {groups(ours)} != {groups(ref)}"


def assert_same_full(ours: dict[str, Any], ref: dict[str, Any], where: str) -> None:
    assert ours.keys() == ref.keys(), f"{where}: keys {sorted(ours.keys() ^ ref.keys())}"
    for key, value in ref.items():
        if isinstance(value, torch.Tensor):
            assert torch.equal(ours[key], value), f"{where}: {key} differs"
        else:
            assert ours[key] == value, f"{where}: {key}: {ours[key]!r} != {value!r}"


@contextlib.contextmanager
def no_template(*optimizers: torch.optim.Optimizer) -> Iterator[None]:
    """The optimizers' ``state_dict()`` fails: a load inside builds no template."""

    def refuse() -> Any:
        raise AssertionError("the streaming load asked the optimizer for a state dict")

    for opt in optimizers:
        opt.state_dict = refuse  # type: ignore[method-assign]
    try:
        yield
    finally:
        for opt in optimizers:
            del opt.state_dict


# --- the three loads of one checkpoint ----------------------------------------------------------
def save(run: Run, path: str | Path, **kwargs: Any) -> None:
    dcp.save(
        {"model": get_model_state_dict(run.model), "optim": run.state()},
        checkpoint_id=str(path),
        **kwargs,
    )


def load_template_path(run: Run, path: str | Path, placement: Any = "cpu", **kwargs: Any) -> None:
    """Today's load: the adapter's template under ``placement`` (None: TE's own), then its load."""
    state = {"model": get_model_state_dict(run.model), "optim": run.state(placement=placement)}
    dcp.load(state, checkpoint_id=str(path), **kwargs)
    set_model_state_dict(run.model, state["model"])


def load_streaming(run: Run, path: str | Path, **kwargs: Any) -> StreamingLoadPlanner:
    """The streaming load, as documented: one planner argument."""
    options = {k: kwargs.pop(k) for k in ("max_assembly_bytes",) if k in kwargs}
    state = {"model": get_model_state_dict(run.model), "optim": run.state()}
    planner = StreamingLoadPlanner(state["optim"], **options)
    with no_template(run.opt):
        dcp.load(state, checkpoint_id=str(path), planner=planner, **kwargs)
    set_model_state_dict(run.model, state["model"])
    return planner


def whole_state_elements(run: Run) -> tuple[int, int]:
    """(largest, total) local elements of the FP16/FP8 states."""
    sizes = [
        local(p).numel()
        for p in run.params()
        for name, dtype in run.opt.name_to_dtype_map.items()
        if dtype in WHOLE and name in run.opt.state.get(p, {})
    ]
    return max(sizes, default=0), sum(sizes)


# --- in process: every storage mode -------------------------------------------------------------
@pytest.fixture
def quiet() -> Iterator[None]:
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", "torch.distributed is disabled", UserWarning)
        yield


def trained(moments: torch.dtype, master: str, seed: int = 1) -> Run:
    run = Run(None, moments, master, seed=seed)
    run.train(3, seed=seed + 1)
    return run


@pytest.mark.usefixtures("quiet")
@pytest.mark.parametrize("master", MASTERS)
@pytest.mark.parametrize("moments", MOMENTS, ids=str)
def test_streaming_load_equals_template_path_and_te_load(
    tmp_path: Path, moments: torch.dtype, master: str
) -> None:
    run = trained(moments, master)
    save(run, tmp_path)
    template, te, ours = (Run(None, moments, master, seed=7) for _ in range(3))
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
    templated = [Run(None, torch.bfloat16, "fp32", 8), Run(None, torch.float16, "remainder", 8)]
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
    ours, ref = Run(None, torch.float16, "fp32", 7), Run(None, torch.float16, "fp32", 7)
    with pytest.warns(StreamingLoadWarning, match="over max_assembly_bytes=0"):
        planner = load_streaming(ours, tmp_path, max_assembly_bytes=0)
    load_template_path(ref, tmp_path)
    assert_same_run(ours, ref, "over budget")
    assert planner.peak_assembly_bytes == 4 * whole_state_elements(ours)[0]


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
    ours, template, te = (Run(None, torch.bfloat16, "fp32", seed=7) for _ in range(3))
    state = {"optim": ours.state()}
    planner = StreamingLoadPlanner(state["optim"])
    with no_template(ours.opt):
        dcp.load(state, checkpoint_id=str(tmp_path), planner=planner)
    dcp.load({"optim": template.state()}, checkpoint_id=str(tmp_path))
    dcp.load({"optim": te.state(placement=None)}, checkpoint_id=str(tmp_path))
    assert_same_run(template, te, "FP64 checkpoint: template path vs TE's load", params=False)
    assert_same_run(ours, template, "FP64 checkpoint: streaming vs template path", params=False)
    assert planner.peak_assembly_bytes == 0  # straight into the live BF16 states


@pytest.mark.usefixtures("quiet")
def test_the_benchmark_streaming_load_runs(tmp_path: Path) -> None:
    """benchmarks/dcp_e2e.py's placement_cpu_streaming load, on the stand-in."""
    from benchmarks.dcp_e2e import streaming_load

    run = trained(torch.bfloat16, "remainder")
    save(run, tmp_path)
    ours, ref = (
        trained(torch.bfloat16, "remainder", seed=5),
        Run(None, torch.bfloat16, "remainder", 7),
    )
    load_template_path(ref, tmp_path)
    with no_template(ours.opt):
        report = streaming_load(ours.model, ours.opt, str(tmp_path))
    assert_same_run(ours, ref, "benchmark load vs template path")
    assert_same_run(ours, run, "benchmark load vs saved")
    assert report["peak_assembly_bytes"] == 0 and report["fallbacks"] == []
    assert report["versions"]["torch"] == torch.__version__


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
            run = Run(None, moments, master, seed=11)
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
            "saved as torch.float32, but this optimizer keeps int16 master remainders",
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
    before, before_groups = by_position(run), groups(run)
    weights = [bits(p).clone() for p in run.params()]
    state = {"optim": run.state()}
    planner = StreamingLoadPlanner(state["optim"])
    with pytest.raises(CheckpointException, match=message) as info:
        with no_template(run.opt):
            dcp.load(state, planner=planner, **where)
    assert "No state was written" in str(info.value)
    assert_snapshot_equal(by_position(run), before)
    assert groups(run) == before_groups
    assert all(torch.equal(bits(p), w) for p, w in zip(run.params(), weights, strict=True))
    assert "0 of" in planner.progress and "0 partly written" in planner.progress


# --- failures after writing began ---------------------------------------------------------------
class StopAfter(FileSystemReader):
    """Reads the first ``count`` tensor items of the plan, then fails (or returns, ``quietly``)."""

    def __init__(self, path: str | Path, count: int, *, quietly: bool = False) -> None:
        super().__init__(str(path))
        self.count, self.quietly = count, quietly

    def read_data(self, plan: LoadPlan, planner: LoadPlanner) -> Any:
        items = [i for i in plan.items if "optim.state." in i.dest_index.fqn][: self.count]
        done = super().read_data(LoadPlan(items), planner)
        if self.quietly:
            return done
        raise OSError("the disk went away")


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

    original = load_planner._write_state
    load_planner._write_state = failing_write  # type: ignore[assignment]
    try:
        expected = (
            r"failed part-way, at optim\.state\.0\.bias\.exp_avg \(MemoryError: no host "
            r"memory\)\. 3 of 12 optimizer states loaded, 1 partly written, 8 not started"
        )
        planner = StreamingLoadPlanner(state["optim"])
        with pytest.raises(CheckpointException, match=expected):
            dcp.load(state, checkpoint_id=str(tmp_path), planner=planner)
    finally:
        load_planner._write_state = original  # type: ignore[assignment]

    # Loading again repairs it: a complete load writes every state.
    planner = load_streaming(ours, tmp_path)
    ref = Run(None, torch.float16, "fp32", 7)
    load_template_path(ref, tmp_path)
    assert_same_run(ours, ref, "repaired")
    assert state["optim"]._unfinished_load is not None  # that adapter was not the one reloaded
    with warnings.catch_warnings():
        warnings.simplefilter("error", StreamingLoadWarning)
        ours.state().state_dict()  # a fresh adapter of the repaired optimizer: no warning


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
    ours = Run(None, torch.bfloat16, "fp32", 7)
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
def check_round_trip(mesh: DeviceMesh, moments: torch.dtype, master: str, path: Path) -> None:
    where = f"rank {dist.get_rank()} {moments} {master}"
    run = Run(mesh, moments, master, seed=1)
    run.train(3, seed=2)
    save(run, path)
    template, te, ours = (Run(mesh, moments, master, seed=3) for _ in range(3))
    load_template_path(template, path)
    load_template_path(te, path, placement=None)
    planner = load_streaming(ours, path)
    assert_same_run(ours, template, f"{where}: streaming vs template path")
    assert_same_run(ours, te, f"{where}: streaming vs TE's load")
    exact = moments not in WHOLE
    if exact:
        assert_same_run(ours, run, f"{where}: streaming vs saved")
    largest, _ = whole_state_elements(ours)
    assert planner.peak_assembly_bytes == 4 * largest, where
    if BACKEND.device == "cuda":
        # Into the live states of an optimizer that has them (the first load gave them to the
        # fresh one), as when resuming in a running job: GPU bytes beyond the states.
        torch.cuda.synchronize()
        base = torch.cuda.memory_allocated()
        torch.cuda.reset_peak_memory_stats()
        load_streaming(ours, path)
        torch.cuda.synchronize()
        extra = torch.cuda.max_memory_allocated() - base
        if moments in WHOLE:
            # FP16/FP8: TE's set_scaled_state moves the host FP32 state to the GPU to scale it.
            assert extra <= 8 * ours.largest_state() + 2**20, f"{where}: {extra} GPU bytes"
        else:
            assert extra == 0, f"{where}: {extra} extra GPU bytes"
        assert_same_run(ours, te, f"{where}: second streaming load vs TE's load")
    reference = run if exact else te
    for r in {id(r): r for r in (ours, reference)}.values():
        r.train(3, seed=5)
    assert_same_run(ours, reference, f"{where}: after 3 more steps")


def check_resharding(mesh: DeviceMesh, root: Path) -> None:
    """2 -> 1 (a 1-rank group, and no group) and 1 -> 2, then training on."""
    rank = dist.get_rank()
    solo = dist.new_group([0])  # collective: every rank creates it
    for moments in (torch.bfloat16, torch.float16):
        where = f"rank {rank} reshard {moments}"
        two = Run(mesh, moments, "fp32", seed=30)
        two.train(3, seed=31)
        path21 = root / f"two_to_one_{moments}".replace("torch.", "")
        save(two, path21)
        saved_full = two.full()
        two.train(3, seed=32)
        after_full = two.full()
        if rank == 0:
            solo_mesh = DeviceMesh.from_group(solo, BACKEND.device)
            for label, target_mesh, kwargs in (
                ("1-rank group", solo_mesh, {"process_group": solo}),
                ("no group", None, {"no_dist": True}),
            ):
                ours = Run(target_mesh, moments, "fp32", seed=33)
                ref = Run(target_mesh, moments, "fp32", seed=33)
                load_template_path(ref, path21, **kwargs)
                if moments in WHOLE:
                    # The 2 saved halves of every state sit in 2 files, read one after the
                    # other: every FP16 state is open at once, over the default budget.
                    with pytest.warns(StreamingLoadWarning, match="arrive interleaved"):
                        planner = load_streaming(ours, path21, **kwargs)
                    _, total = whole_state_elements(ours)
                    assert planner.peak_assembly_bytes == 4 * total, f"{where} {label}"
                else:
                    planner = load_streaming(ours, path21, **kwargs)
                    assert planner.peak_assembly_bytes == 0
                assert_same_run(ours, ref, f"{where} 2->1 {label}: vs template path")
                if moments not in WHOLE:
                    assert_same_full(ours.full(), saved_full, f"{where} 2->1 {label}: loaded")
                    ours.train(3, seed=32)
                    assert_same_full(ours.full(), after_full, f"{where} 2->1 {label}: continued")

    where = f"rank {rank} reshard 1->2"
    path12 = root / "one_to_two"
    payload: list[Any] = [None]
    if rank == 0:
        one = Run(DeviceMesh.from_group(solo, BACKEND.device), torch.bfloat16, "remainder", 34)
        one.train(3, seed=35)
        save(one, path12, process_group=solo)
        saved_one = one.full()
        one.train(3, seed=36)
        payload = [(saved_one, one.full())]
    dist.broadcast_object_list(payload, src=0)
    saved_one, after_one = payload[0]
    ours = Run(mesh, torch.bfloat16, "remainder", seed=37)
    load_streaming(ours, path12)
    assert_same_full(ours.full(), saved_one, f"{where}: loaded")
    ours.train(3, seed=36)
    assert_same_full(ours.full(), after_one, f"{where}: continued")


def check_full_state_dict_checkpoint(mesh: DeviceMesh, path: Path) -> None:
    """A checkpoint written from a full (gathered) state dict loads into sharded states."""
    rank = dist.get_rank()
    where = f"rank {rank} full_state_dict checkpoint"
    run = Run(mesh, torch.bfloat16, "fp32", seed=40)
    run.train(3, seed=41)
    options = StateDictOptions(
        full_state_dict=True, cpu_offload=True, flatten_optimizer_state_dict=True
    )
    with export_placement("cpu"):
        full = get_optimizer_state_dict(run.model, run.opt, options=options)
    model_full = get_model_state_dict(run.model, options=options)
    if rank == 0:
        assert full and not any(isinstance(v, DTensor) for v in full.values())
        dcp.save({"model": model_full, "optim": full}, checkpoint_id=str(path), no_dist=True)
    dist.barrier()
    ours, ref = Run(mesh, torch.bfloat16, "fp32", 42), Run(mesh, torch.bfloat16, "fp32", 42)
    load_streaming(ours, path)
    load_template_path(ref, path)
    assert_same_run(ours, ref, f"{where}: vs template path")
    assert_same_run(ours, run, f"{where}: vs saved")


CASES: list[tuple[torch.dtype, str]] = [
    (torch.bfloat16, "remainder"),
    (torch.bfloat16, "fp32"),
    (torch.float16, "fp32"),
    (torch.float32, "none"),
]


def run_streaming_checks(
    mesh: DeviceMesh, base: Path, extra_cases: tuple[tuple[torch.dtype, str], ...] = ()
) -> None:
    """Every 2-rank check on the current BACKEND; ``extra_cases`` adds round-trip modes."""
    for moments, master in (*CASES, *extra_cases):
        check_round_trip(mesh, moments, master, base / f"round_trip_{moments}_{master}")
    check_resharding(mesh, base / "reshard")
    check_full_state_dict_checkpoint(mesh, base / "full_state_dict")


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _worker(rank: int, port: int, root: str) -> None:
    dist.init_process_group(
        "gloo",
        rank=rank,
        world_size=WORLD,
        init_method=f"tcp://127.0.0.1:{port}",
        timeout=datetime.timedelta(seconds=120),
    )
    te_hooks.patch_class(StandInFusedAdam)
    warnings.filterwarnings("ignore", "torch.distributed is disabled", UserWarning)
    try:
        run_streaming_checks(init_device_mesh("cpu", (WORLD,)), Path(root))
    finally:
        dist.destroy_process_group()


def test_streaming_load_on_two_ranks(tmp_path: Path) -> None:
    import torch.multiprocessing as mp

    mp.spawn(_worker, args=(free_port(), str(tmp_path)), nprocs=WORLD, join=True)
    for ckpt in ("reshard/one_to_two", "full_state_dict"):
        assert (tmp_path / ckpt / ".metadata").is_file(), f"{ckpt}: no checkpoint"
