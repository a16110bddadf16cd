"""te_ckpt_placement.dcp against the CPU stand-in: staging without copies, the Stateful adapter,
and DCP save/load/async_save/resharding under the policy on 2 CPU ranks (gloo, FSDP2).

The in-process tests cover :class:`PassThroughStager` and :class:`PlacedOptimizerState` on their
own. One spawn of 2 ranks (process start-up dominates the runtime) then runs every distributed
check of ``tests/support/dcp_checks.py`` on ``fully_shard`` models with the CPU backend (BF16,
FP16 and int16 states; ``test_gpu_dcp.py`` runs them with real TE, FP8 states of DTensors too):
sync round trips (``cpu_offload`` True and False), ``dcp.async_save`` with every stager,
resharding 2 -> 1 and 1 -> 2, ``full_state_dict=True``, DCP's fake step, one device (the CPU)
for every export, and the Stateful adapter.
"""

from __future__ import annotations

import collections
import copy
import warnings
from collections.abc import Callable
from concurrent.futures import Future
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.staging import (
    AsyncStager,
    BlockingAsyncStager,
    DefaultStager,
    StagingOptions,
)
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_optimizer_state_dict
from torch.distributed.device_mesh import DeviceMesh

from te_ckpt_placement import export_placement
from te_ckpt_placement._export import is_exported
from te_ckpt_placement.dcp import PassThroughStager, PlacedOptimizerState
from te_ckpt_placement.dcp._handshake import merge_part

from .support.backends import CPU
from .support.dcp_checks import ASYNC_SAVE_DEFAULTS, run_all_checks
from .support.dcp_runs import FLAT, assert_all_on_cpu, assert_exports, resolve
from .support.distributed import (
    GPU_BACKEND,
    by_position,
    hyperparams,
    init_gloo_mesh,
    init_group,
    spawn,
)
from .support.helpers import assert_same_export, assert_snapshot_equal, tensors
from .support.standin import StandInFusedAdam, make_optimizer, train

pytestmark = pytest.mark.usefixtures("hooked_standin")


# --- PassThroughStager, in process --------------------------------------------------------------
class RecordingStager(DefaultStager):
    """A DefaultStager that remembers every tensor it was asked to stage."""

    def __init__(self, options: StagingOptions) -> None:
        super().__init__(options)
        self.seen: list[torch.Tensor] = []
        self.closed = False

    def stage(self, state_dict: Any, **kwargs: Any) -> Any:
        self.seen.extend(tensors(state_dict))
        return super().stage(state_dict, **kwargs)

    def close(self) -> None:
        self.closed = True
        super().close()


def exported_optimizer(seed: int = 0) -> tuple[StandInFusedAdam, dict[str, Any]]:
    gen = torch.Generator().manual_seed(seed)
    params = [torch.nn.Parameter(torch.randn(s, generator=gen)) for s in ((5, 3), (4,))]
    opt = make_optimizer(params, moments=torch.bfloat16, master="fp32")
    train(opt, steps=2, seed=seed)
    with export_placement("cpu"):
        return opt, opt.state_dict()


STAGERS: dict[str, Callable[[], PassThroughStager]] = {
    "default": PassThroughStager,
    "options_sync": lambda: PassThroughStager(StagingOptions(False, False, False, False)),
    # Shared memory and a staging thread work on a CPU-only machine; pinning is accepted and
    # ignored there (torch warns). Non-blocking copies need an accelerator: see the test below.
    "options_async_shared": lambda: PassThroughStager(StagingOptions(True, True, True, False)),
    "inner_blocking": lambda: PassThroughStager(inner=BlockingAsyncStager()),
    "inner_recording_async": lambda: PassThroughStager(
        inner=RecordingStager(StagingOptions(False, False, True, False))
    ),
}


def ids(container: Any) -> list[int]:
    values = container.values() if isinstance(container, dict) else container
    return [id(v) for v in values]


@pytest.mark.parametrize("kind", list(STAGERS))
def test_pass_through_stager_passes_exports_and_copies_the_rest(kind: str) -> None:
    _, export = exported_optimizer()
    states = export["state"]
    weight = torch.randn(6)  # a plain CPU tensor, like a model weight
    view = states[0]["exp_avg"][1:]  # a view of an export is not an export
    assert is_exported(states[0]["exp_avg"]) and not is_exported(view)
    assert not is_exported(weight)
    state_dict = {
        "optim": export,
        "model": {"w": weight},
        "nested": [states[1]["exp_avg_sq"], (view, 3, "s"), {"n": None}],
        "step": 7,
    }
    before = ids(state_dict), ids(state_dict["nested"])
    frozen = copy.deepcopy(state_dict)
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", "Ignoring pin_memory", UserWarning)
        stager = STAGERS[kind]()
        staged = stager.stage(state_dict)
    async_inner = kind.endswith("async") or kind == "options_async_shared"
    assert isinstance(staged, Future) == async_inner, f"{kind}: {type(staged)}"
    if stager.should_synchronize_after_execute:
        stager.synchronize_staging()
    staged = resolve(staged)

    # Same structure and values ...
    assert_same_export(staged, frozen, kind)
    assert isinstance(staged["nested"][1], tuple)
    # ... exports passed through as the same objects ...
    for index, names in states.items():
        for name, value in names.items():
            assert staged["optim"]["state"][index][name] is value, f"{kind}: {index}.{name} copied"
    assert staged["nested"][0] is states[1]["exp_avg_sq"]
    # ... everything else copied.
    assert staged["model"]["w"].data_ptr() != weight.data_ptr(), f"{kind}: weight not staged"
    assert staged["nested"][1][0].data_ptr() != view.data_ptr(), f"{kind}: view not staged"
    # The caller's containers are untouched (the stager works on copies of them).
    assert ids(state_dict) == before[0] and ids(state_dict["nested"]) == before[1]
    assert_same_export(state_dict, frozen, f"{kind}: caller's dict changed")
    inner = stager.inner
    if isinstance(inner, RecordingStager):
        exported = {id(t) for t in tensors(export)}
        assert inner.seen and not exported & {id(t) for t in inner.seen}, "inner saw an export"
        assert any(t is weight for t in inner.seen)
    stager.close()
    if isinstance(inner, RecordingStager):
        assert inner.closed


def test_pass_through_stager_without_exports_is_the_inner_stager() -> None:
    inner = RecordingStager(ASYNC_SAVE_DEFAULTS)
    state_dict = {"w": torch.randn(3), "x": [torch.randn(2)]}
    staged = PassThroughStager(inner=inner).stage(state_dict)
    assert [id(t) for t in inner.seen] == [id(t) for t in tensors(state_dict)]
    assert_same_export(staged, state_dict)
    assert staged["w"].data_ptr() != state_dict["w"].data_ptr()


class DroppingStager(DefaultStager):
    """An inner stager that loses one key of the state dict."""

    def stage(self, state_dict: Any, **kwargs: Any) -> Any:
        staged = super().stage(state_dict, **kwargs)
        del staged["optim"]["state"][1]
        return staged


def test_pass_through_stager_refuses_an_inner_stager_that_changes_the_structure() -> None:
    _, export = exported_optimizer()
    stager = PassThroughStager(inner=DroppingStager(ASYNC_SAVE_DEFAULTS))
    with pytest.raises(
        RuntimeError, match=r"changed the state dict's structure at 'optim\.state\.1'"
    ):
        stager.stage({"optim": export})


def test_pass_through_stager_copies_containers_on_export_paths_as_they_are() -> None:
    """A dict subclass on the path to an export is copied with what it holds besides its items
    (a defaultdict's factory), and the caller's is left as it was."""
    _, export = exported_optimizer()
    states = collections.defaultdict(dict, export["state"])
    state_dict = {"optim": {**export, "state": states}, "meta": {"epoch": 3}}
    staged = resolve(PassThroughStager().stage(state_dict))
    assert isinstance(staged["optim"]["state"], collections.defaultdict)
    assert staged["optim"]["state"].default_factory is dict
    assert staged["optim"]["state"] is not states and states[0] is export["state"][0]
    assert staged["optim"]["state"][0]["exp_avg"] is export["state"][0]["exp_avg"]
    assert all(value is not None for value in states[0].values())
    assert staged["meta"] == {"epoch": 3}


class FailingStager(DefaultStager):
    def _stage(self, state_dict: Any, **kwargs: Any) -> Any:
        raise OSError("staging failed")


def test_pass_through_stager_propagates_inner_failures() -> None:
    _, export = exported_optimizer()
    sync = PassThroughStager(inner=FailingStager(ASYNC_SAVE_DEFAULTS))
    with pytest.raises(OSError, match="staging failed"):
        sync.stage({"optim": export, "w": torch.ones(2)})
    threaded = PassThroughStager(inner=FailingStager(StagingOptions(False, False, True, False)))
    future = threaded.stage({"optim": export, "w": torch.ones(2)})
    assert isinstance(future, Future)
    with pytest.raises(OSError, match="staging failed"):
        future.result(timeout=30)
    with pytest.raises(OSError, match="staging failed"):
        threaded.synchronize_staging()  # the waited-on staging failed: say so
    threaded.close()


def test_pass_through_stager_rejects_bad_arguments() -> None:
    with pytest.raises(ValueError, match=r"valid values are None \(.*\) or a .*StagingOptions"):
        PassThroughStager({"use_pinned_memory": False})  # type: ignore[arg-type]
    with pytest.raises(ValueError, match=r"valid values are None \(.*\) or an AsyncStager"):
        PassThroughStager(inner=object())  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="not both"):
        PassThroughStager(StagingOptions(), inner=BlockingAsyncStager())
    # Non-blocking copies need an accelerator; on a CPU-only machine torch's stager refuses them,
    # which is why no test here covers use_non_blocking_copy=True.
    if not torch.accelerator.is_available():
        with pytest.raises(AssertionError, match="accelerator"):
            PassThroughStager(StagingOptions(False, False, False, True))
    assert isinstance(PassThroughStager(), AsyncStager)


# --- PlacedOptimizerState, in process -----------------------------------------------------------
def model_parts(seed: int) -> tuple[list[torch.nn.Module], list[StandInFusedAdam]]:
    torch.manual_seed(seed)
    parts: list[torch.nn.Module] = [
        torch.nn.Linear(3, 4),
        torch.nn.Sequential(torch.nn.Linear(4, 2)),
    ]
    return parts, [make_optimizer(p.parameters(), moments=torch.bfloat16) for p in parts]


def test_placed_optimizer_state_rejects_bad_arguments() -> None:
    parts, opts = model_parts(0)
    with pytest.raises(ValueError, match=r"valid values are a torch\.nn\.Module"):
        PlacedOptimizerState(opts[0], opts[0])  # type: ignore[arg-type]
    with pytest.raises(ValueError, match=r"valid values are a torch\.nn\.Module"):
        PlacedOptimizerState([], opts)
    with pytest.raises(ValueError, match=r"valid values are a torch\.optim\.Optimizer"):
        PlacedOptimizerState(parts[0], parts[0])  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="one optimizer per model part"):
        PlacedOptimizerState(parts, opts[:1])
    with pytest.raises(ValueError, match="valid values are 'cpu'"):
        PlacedOptimizerState(parts[0], opts[0], placement="cuda")
    with pytest.raises(ValueError, match="valid values are 'cpu'"):
        PlacedOptimizerState(parts[0], opts[0], placement=3)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="flatten_optimizer_state_dict=True"):
        PlacedOptimizerState(parts[0], opts[0], options=StateDictOptions())
    with pytest.raises(ValueError, match="full_state_dict=True"):
        PlacedOptimizerState(
            parts[0],
            opts[0],
            options=StateDictOptions(full_state_dict=True, flatten_optimizer_state_dict=True),
        )
    with pytest.raises(ValueError, match="StateDictOptions"):
        PlacedOptimizerState(parts[0], opts[0], options={"cpu_offload": True})  # type: ignore[arg-type]
    with pytest.raises(TypeError):
        PlacedOptimizerState(parts[0], opts[0], "cpu")  # type: ignore[misc]
    state = PlacedOptimizerState(parts[0], opts[0], placement=None)
    assert state.placement.device is None


def test_placed_optimizer_state_model_parts_round_trip(tmp_path: Path) -> None:
    parts, opts = model_parts(0)
    for i, opt in enumerate(opts):
        train(opt, steps=2, seed=i)
    state = PlacedOptimizerState(parts, opts)
    export = state.state_dict()
    assert_exports(export, "model parts")
    assert_all_on_cpu(export, "model parts")
    with export_placement(None):
        ref = {k: v for p, o in zip(parts, opts, strict=True) for k, v in
               get_optimizer_state_dict(p, o, options=FLAT).items()}  # fmt: skip
    assert_same_export(export, ref, "model parts")
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", "torch.distributed is disabled", UserWarning)
        dcp.save({"optim": state}, checkpoint_id=str(tmp_path))
        parts2, opts2 = model_parts(1)
        state2 = PlacedOptimizerState(parts2, opts2)
        dcp.load({"optim": state2}, checkpoint_id=str(tmp_path))
    for opt, opt2 in zip(opts, opts2, strict=True):
        assert_snapshot_equal(by_position(opt), by_position(opt2))
        assert hyperparams(opt2) == hyperparams(opt)
    # Parts whose parameter names overlap would overwrite each other's states: refused.
    clash = PlacedOptimizerState([parts[0], parts2[0]], [opts[0], opts2[0]])
    with pytest.raises(ValueError, match="same keys"):
        clash.state_dict()


def test_merge_part_refuses_overlapping_keys_and_leaves_the_merge_as_it_was() -> None:
    merged: dict[str, Any] = {}
    merge_part(merged, {"state.a.exp_avg": 1, "param_groups.a.lr": 0.1})
    merge_part(merged, {"state.b.exp_avg": 2})
    assert merged == {"state.a.exp_avg": 1, "param_groups.a.lr": 0.1, "state.b.exp_avg": 2}
    with pytest.raises(ValueError, match=r"same keys \['state.b.exp_avg'\]"):
        merge_part(merged, {"state.b.exp_avg": 3, "state.c.exp_avg": 4})
    assert merged == {"state.a.exp_avg": 1, "param_groups.a.lr": 0.1, "state.b.exp_avg": 2}


def _group_worker(rank: int, port: int) -> None:
    init_group(rank, port, backend="cpu:gloo", timeout_s=60)  # GPU_BACKEND's CPU half
    try:
        assert (dist.get_rank(), dist.get_world_size()) == (rank, 2)
        total = torch.tensor([rank + 1.0])
        dist.all_reduce(total)
        assert total.item() == 3.0, total
    finally:
        dist.destroy_process_group()


def test_init_group_joins_both_ranks_with_a_device_backend_string() -> None:
    # The GPU tests' group (init_gpu_rank): gloo for CPU tensors, NCCL for CUDA tensors.
    from torch.distributed.distributed_c10d import BackendConfig

    assert BackendConfig(GPU_BACKEND).get_device_backend_map() == {"cpu": "gloo", "cuda": "nccl"}
    spawn(_group_worker)


# --- the 2-rank checks --------------------------------------------------------------------------
def _init(rank: int, port: int) -> tuple[DeviceMesh, Any]:
    mesh = init_gloo_mesh(rank, port)
    warnings.filterwarnings("ignore", "Ignoring pin_memory", UserWarning)
    # Async saves run their collectives in a background thread: a group of their own keeps
    # them from interleaving with the main thread's (torchtitan does the same).
    return mesh, dist.new_group(backend="gloo")


def _worker(rank: int, port: int, root: str) -> None:
    mesh, async_pg = _init(rank, port)
    base = Path(root)
    try:
        run_all_checks(CPU, mesh, async_pg, base)
    finally:
        dist.destroy_process_group()


def test_dcp_on_two_ranks(tmp_path: Path) -> None:
    spawn(_worker, str(tmp_path))
    for ckpt in ("sync_bf16", "async/pass_through", "stateful/async", "reshard/one_to_two"):
        assert (tmp_path / ckpt / ".metadata").is_file(), f"{ckpt}: no checkpoint"
