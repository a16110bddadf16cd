"""The streaming-load checks of test_dcp_load.py (2 ranks, ``fully_shard``), run on a backend.

``tests/test_dcp_load.py`` runs them with the CPU stand-in on a gloo mesh and uses the loads
below in process; ``tests/test_gpu_dcp_load.py`` runs them with TE's FusedAdam on a CUDA mesh:
round trips equal to the template path and to TE's own load, continued training equal to an
uninterrupted run, resharding 2 -> 1 and 1 -> 2 (also of weights sharded along their columns),
and a checkpoint written from a full state dict.
:func:`check_failures` runs the failure paths on 2 ranks: a load refused before any write, a
reader that fails on one rank part-way, and a load post-hook that raises.
In every streaming load the optimizer's ``state_dict()`` is made to fail: no template is built.
"""

from __future__ import annotations

import contextlib
import warnings
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_optimizer_state_dict,
    set_model_state_dict,
)
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Shard

from te_ckpt_placement import _reports as reports
from te_ckpt_placement import export_placement
from te_ckpt_placement.dcp import StreamingLoadPlanner, StreamingLoadWarning

from .backends import Backend
from .dcp_runs import Run, assert_same_run
from .distributed import assert_same_full, hyperparams
from .faults import StopAfter
from .helpers import local

WHOLE = (torch.float16, torch.uint8)  # scaled by the absmax of the whole state


def load_run(
    backend: Backend, mesh: DeviceMesh | None, moments: torch.dtype, master: str, seed: int
) -> Run:
    """The load tests' model and optimizer: the second layer in a parameter group of its own."""
    return Run(backend, mesh, moments, master, seed, groups=2)


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
    state: dict[str, Any] = {
        "model": get_model_state_dict(run.model),
        "optim": run.state(placement=placement),
    }
    dcp.load(state, checkpoint_id=str(path), **kwargs)
    set_model_state_dict(run.model, state["model"])


def load_streaming(run: Run, path: str | Path, **kwargs: Any) -> StreamingLoadPlanner:
    """The streaming load, as documented: one planner argument."""
    options = {k: kwargs.pop(k) for k in ("max_assembly_bytes",) if k in kwargs}
    adapter = run.state()
    state: dict[str, Any] = {"model": get_model_state_dict(run.model), "optim": adapter}
    planner = StreamingLoadPlanner(adapter, **options)
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


# --- 2 ranks ------------------------------------------------------------------------------------
def check_round_trip(
    backend: Backend, mesh: DeviceMesh, moments: torch.dtype, master: str, path: Path
) -> None:
    where = f"rank {dist.get_rank()} {moments} {master}"
    run = load_run(backend, mesh, moments, master, seed=1)
    run.train(3, seed=2)
    save(run, path)
    template, te, ours = (load_run(backend, mesh, moments, master, seed=3) for _ in range(3))
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
    if backend.device == "cuda":
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


def check_resharding(backend: Backend, mesh: DeviceMesh, root: Path) -> None:
    """2 -> 1 (a 1-rank group, and no group) and 1 -> 2, then training on."""
    rank = dist.get_rank()
    solo = dist.new_group([0])  # collective: every rank creates it
    for moments in (torch.bfloat16, torch.float16):
        where = f"rank {rank} reshard {moments}"
        two = load_run(backend, mesh, moments, "fp32", seed=30)
        two.train(3, seed=31)
        path21 = root / f"two_to_one_{moments}".replace("torch.", "")
        save(two, path21)
        saved_full = two.full()
        two.train(3, seed=32)
        after_full = two.full()
        if rank == 0:
            solo_mesh = DeviceMesh.from_group(solo, backend.device)
            for label, target_mesh, kwargs in (
                ("1-rank group", solo_mesh, {"process_group": solo}),
                ("no group", None, {"no_dist": True}),
            ):
                ours = load_run(backend, target_mesh, moments, "fp32", seed=33)
                ref = load_run(backend, target_mesh, moments, "fp32", seed=33)
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
        one = load_run(
            backend, DeviceMesh.from_group(solo, backend.device), torch.bfloat16, "remainder", 34
        )
        one.train(3, seed=35)
        save(one, path12, process_group=solo)
        saved_one = one.full()
        one.train(3, seed=36)
        payload = [(saved_one, one.full())]
    dist.broadcast_object_list(payload, src=0)
    saved_one, after_one = payload[0]
    ours = load_run(backend, mesh, torch.bfloat16, "remainder", seed=37)
    load_streaming(ours, path12)
    assert_same_full(ours.full(), saved_one, f"{where}: loaded")
    ours.train(3, seed=36)
    assert_same_full(ours.full(), after_one, f"{where}: continued")


def check_full_state_dict_checkpoint(backend: Backend, mesh: DeviceMesh, path: Path) -> None:
    """A checkpoint written from a full (gathered) state dict loads into sharded states."""
    rank = dist.get_rank()
    where = f"rank {rank} full_state_dict checkpoint"
    run = load_run(backend, mesh, torch.bfloat16, "fp32", seed=40)
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
    ours, ref = (
        load_run(backend, mesh, torch.bfloat16, "fp32", 42),
        load_run(backend, mesh, torch.bfloat16, "fp32", 42),
    )
    load_streaming(ours, path)
    load_template_path(ref, path)
    assert_same_run(ours, ref, f"{where}: vs template path")
    assert_same_run(ours, run, f"{where}: vs saved")


def check_failures(backend: Backend, mesh: DeviceMesh, root: Path) -> None:
    """The failure paths on 2 ranks (the rank's own refusal, one rank's reader, a post-hook)."""
    rank = dist.get_rank()
    where = f"rank {rank} failures"
    # Refused before any write on every rank (no master weights in the checkpoint): a fresh
    # optimizer is as fresh as before, and its first step is a first step.
    saved = load_run(backend, mesh, torch.float32, "none", seed=50)
    saved.train(2, seed=51)
    save(saved, root / "no_master")
    fresh, twin = (load_run(backend, mesh, torch.float32, "fp32", seed=52) for _ in range(2))
    adapter = fresh.state()
    planner = StreamingLoadPlanner(adapter)
    with pytest.raises(CheckpointException, match="No state was written"), no_template(fresh.opt):
        dcp.load({"optim": adapter}, checkpoint_id=str(root / "no_master"), planner=planner)
    assert not fresh.opt.state and not fresh.opt._scales, f"{where}: initial states kept"
    assert hyperparams(fresh.opt) == hyperparams(twin.opt), f"{where}: step counts changed"
    for r in (fresh, twin):
        r.train(2, seed=53)
    assert_same_run(fresh, twin, f"{where}: after a refused load")

    # Rank 1's reader fails after 2 items, rank 0 reads everything; dcp.load raises on both, so
    # neither loads the param_groups: both refuse to step until a complete load.
    run = load_run(backend, mesh, torch.bfloat16, "fp32", seed=54)
    run.train(3, seed=55)
    path = root / "stopped"
    save(run, path)
    ours, ref = (load_run(backend, mesh, torch.bfloat16, "fp32", seed=56) for _ in range(2))
    ours.train(2, seed=57)
    adapter = ours.state()
    planner = StreamingLoadPlanner(adapter)
    reader = StopAfter(path, 2 if rank == 1 else None, quietly=rank == 0)
    with pytest.raises(CheckpointException, match="the disk went away"), no_template(ours.opt):
        dcp.load({"optim": adapter}, storage_reader=reader, planner=planner)
    written = 2 if rank == 1 else 12
    refused = rf"step\(\) refused: .* overwrote {written} of this optimizer's 12 states"
    with pytest.raises(RuntimeError, match=refused):
        ours.train(1, seed=58)
    load_streaming(ours, path)  # a complete load lifts the guard
    load_template_path(ref, path)
    assert_same_run(ours, ref, f"{where}: repaired")
    for r in (ours, ref):
        r.train(2, seed=59)
    assert_same_run(ours, ref, f"{where}: repaired, then trained")

    # A load post-hook that raises: the states stay attached, as the template path loads them.
    ours, ref = (load_run(backend, mesh, torch.bfloat16, "fp32", seed=60) for _ in range(2))
    seen: list[int] = []

    def failing_hook(optimizer: Any) -> None:
        seen.append(len(optimizer.state))
        raise RuntimeError("the hook failed")

    ours.opt.register_load_state_dict_post_hook(failing_hook)
    with pytest.raises(RuntimeError, match="the hook failed"):
        load_streaming(ours, path)
    load_template_path(ref, path)
    assert seen == [4], f"{where}: the hook saw {seen} parameters with states"
    assert_same_run(ours, ref, f"{where}: post-hook failed", params=False)


def assembled_bytes(run: Run) -> int:
    """Host bytes of the assembly buffers of every state of a column-sharded :class:`Run` loaded
    from 2 ranks' pieces: FP16/FP8 states, and the weights' states (their column pieces are
    strided regions of the local state), int16 for master remainders and FP32 otherwise."""
    total = 0
    for p in run.params():
        for name, dtype in run.opt.name_to_dtype_map.items():
            if name in run.opt.state.get(p, {}) and (dtype in WHOLE or p.dim() == 2):
                remainder = run.master == "remainder" and name == "master_param"
                total += local(p).numel() * (2 if remainder else 4)
    return total


def check_column_sharded_resharding(backend: Backend, mesh: DeviceMesh, root: Path) -> None:
    """``Shard(1)`` weights saved by 2 ranks (the streaming save), loaded on 1 (a 1-rank group).

    Every saved piece of a weight's state is a strided region of the local state, so the planner
    assembles those states on the host, in the export's dtype (int16 for master remainders), as
    it does FP16/FP8 states: the load equals the template path's, and restores the saved bits
    where they are elementwise. DCP reads the 2 files one after the other, so every assembled
    state is open at once (over the default budget of one state): the one warning says which
    states those are.
    """
    from te_ckpt_placement.dcp import StreamingWriter

    rank = dist.get_rank()
    solo = dist.new_group([0])  # collective: every rank creates it
    modes = ((torch.bfloat16, "remainder"), (torch.bfloat16, "fp32"), (torch.float16, "fp32"))
    for i, (moments, master) in enumerate(modes):
        where = f"rank {rank} Shard(1) 2->1 {moments} {master}"
        two = Run(backend, mesh, moments, master, seed=50 + i, groups=2, columns=True)
        assert any(p.placements == (Shard(1),) for p in two.params()), where
        two.train(3, seed=51)
        path = root / f"columns_{moments}_{master}".replace("torch.", "")
        state = {"model": get_model_state_dict(two.model), "optim": two.state(save="streaming")}
        dcp.save(state, storage_writer=StreamingWriter(path))
        saved_full = two.full()
        if rank != 0:
            continue
        solo_mesh = DeviceMesh.from_group(solo, backend.device)
        ours, ref = (
            Run(backend, solo_mesh, moments, master, seed=53, groups=2, columns=True)
            for _ in range(2)
        )
        load_template_path(ref, path, process_group=solo)
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always", StreamingLoadWarning)
            planner = load_streaming(ours, path, process_group=solo)
        report = planner.report
        assert report is reports.last_report() and report is not None, where
        assert report.details["peak_assembly_bytes"] == assembled_bytes(ours), where
        assert_same_run(ours, ref, f"{where}: streaming vs template path")
        if moments not in WHOLE:
            assert_same_full(ours.full(), saved_full, f"{where}: loaded")
        assert planner.peak_assembly_bytes == assembled_bytes(ours), where
        # On the device only the FP32 copy TE scales an FP16/FP8 state from, one at a time: an
        # assembled BF16/FP32/int16 state goes from its host buffer through the pinned pipeline.
        assert report is not None and report.gpu_bytes == 4 * whole_state_elements(ours)[0], where
        said = [str(w.message) for w in caught if issubclass(w.category, StreamingLoadWarning)]
        assert len(said) == 1 and "arrive interleaved" in said[0], f"{where}: {said}"
        assert "strided pieces" in said[0] or moments in WHOLE, f"{where}: {said}"
        if moments not in WHOLE:  # no FP16/FP8 state, so no such buffer either
            assert "FP16/FP8" not in said[0], f"{where}: {said}"


CASES: list[tuple[torch.dtype, str]] = [
    (torch.bfloat16, "remainder"),
    (torch.bfloat16, "fp32"),
    (torch.float16, "fp32"),
    (torch.float32, "none"),
]


def run_streaming_checks(
    backend: Backend,
    mesh: DeviceMesh,
    base: Path,
    extra_cases: tuple[tuple[torch.dtype, str], ...] = (),
) -> None:
    """Every 2-rank check on ``backend``; ``extra_cases`` adds round-trip modes."""
    for moments, master in (*CASES, *extra_cases):
        check_round_trip(backend, mesh, moments, master, base / f"round_trip_{moments}_{master}")
    check_resharding(backend, mesh, base / "reshard")
    check_full_state_dict_checkpoint(backend, mesh, base / "full_state_dict")
    check_column_sharded_resharding(backend, mesh, base / "columns")
