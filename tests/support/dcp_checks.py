"""The DCP checks of test_dcp.py (2 ranks, ``fully_shard``), run on a backend.

``tests/test_dcp.py`` runs them with the CPU stand-in on a gloo mesh, ``tests/test_gpu_dcp.py``
with TE's FusedAdam on a CUDA mesh; every check is against an uninterrupted or never-checkpointed
reference:

1. sync round trip into a fresh model and optimizer, equal to TE's own load of the same
   checkpoint and, where TE's load is exact (all but FP16/FP8 states, whose scales TE
   re-derives), to the saved optimizer; then 3 more steps equal to the uninterrupted run;
2. ``dcp.async_save`` with the default stager, ``DefaultStager`` options and
   ``PassThroughStager`` (which is shown to pass export tensors through and copy the rest);
3. resharding 2 ranks -> 1 rank (a 1-rank group, and no group at all) and 1 -> 2, with training
   continued against the uninterrupted run on the other world size;
4. ``full_state_dict=True`` without and with the policy;
5. DCP's fake step on a fresh optimizer (TE's step counter is overwritten by the checkpoint's);
6. every export under the policy sits on one device, the CPU;
7. the Stateful adapter through ``dcp.save``/``dcp.load`` and ``dcp.async_save``.
"""

from __future__ import annotations

import copy
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.staging import AsyncStager, DefaultStager, StagingOptions
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_optimizer_state_dict,
    set_model_state_dict,
    set_optimizer_state_dict,
)
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor

from te_ckpt_placement import export_placement
from te_ckpt_placement._export import is_exported
from te_ckpt_placement.dcp import PassThroughStager, PlacedOptimizerState

from .backends import Backend
from .dcp_runs import (
    Run,
    assert_all_on_cpu,
    assert_exports,
    assert_same_run,
    resolve,
    wait,
)
from .distributed import assert_same_full, gather
from .helpers import assert_bit_equal, assert_same_export, bits, blank, local

# dcp.async_save's own stager when none is given (state_dict_saver.py): all four options off.
ASYNC_SAVE_DEFAULTS = StagingOptions(False, False, False, False)


# 1, 5, 6: sync round trip into a fresh optimizer, then continued training.
def check_sync_round_trip(
    backend: Backend,
    mesh: DeviceMesh,
    moments: torch.dtype,
    master: str,
    cpu_offload: bool,
    path: Path,
) -> Run:
    where = f"rank {dist.get_rank()} sync {moments} {master} cpu_offload={cpu_offload}"
    options = StateDictOptions(flatten_optimizer_state_dict=True, cpu_offload=cpu_offload)
    run = Run(backend, mesh, moments, master, seed=1)
    run.train(3, seed=2)
    saved = run.export(options)
    assert_all_on_cpu(saved, where)
    # cpu_offload returns CPU tensors as they are: still the export's own tensors.
    assert_exports(saved, where)
    assert_same_export(saved, run.export(options, placement=None), f"{where}: vs TE")
    dcp.save({"model": get_model_state_dict(run.model), "optim": saved}, checkpoint_id=str(path))

    fresh = Run(backend, mesh, moments, master, seed=3)
    assert not fresh.opt.state
    state = fresh.template(where)
    # 5: building the template ran DCP's fake step, which TE counts as a step.
    assert fresh.opt.state and all(g["step"] == 1 for g in fresh.opt.param_groups), where
    dcp.load(state, checkpoint_id=str(path))
    fresh.restore(state)
    # The checkpoint's param_groups replaced the fake step's count: 3, not 1 or 4.
    assert all(g["step"] == 3 for g in fresh.opt.param_groups), f"{where}: step"

    # The same checkpoint through TE's own template and load, with no policy anywhere.
    te = Run(backend, mesh, moments, master, seed=3)
    with export_placement(None):
        te_state: dict[str, Any] = {
            "model": get_model_state_dict(te.model),
            "optim": get_optimizer_state_dict(te.model, te.opt, options=options),
        }
        dcp.load(te_state, checkpoint_id=str(path))
        set_model_state_dict(te.model, te_state["model"])
        set_optimizer_state_dict(te.model, te.opt, te_state["optim"], options=options)
    assert_same_run(fresh, te, f"{where}: policy load vs TE load")
    # BF16/FP32/int16 states come back with the bits they were saved with. FP16/FP8 ones do not,
    # with TE's own load either: it re-derives every scale from the loaded values. For those the
    # reference is TE's load (checked above), for the rest the optimizer that was saved.
    exact = moments in (torch.bfloat16, torch.float32)
    reference = run if exact else te
    if exact:
        assert_same_run(fresh, run, f"{where}: loaded vs saved")
        assert_same_export(fresh.export(options), saved, f"{where}: re-export")

    # 5: a fresh optimizer loaded without a template: the fake step runs inside the load.
    direct = Run(backend, mesh, moments, master, seed=4)
    set_model_state_dict(direct.model, state["model"])
    with export_placement("cpu"):
        set_optimizer_state_dict(direct.model, direct.opt, saved, options=options)
    assert_same_run(direct, reference, f"{where}: direct load")

    # 1: three more steps, resumed and uninterrupted (or TE-resumed), agree bit for bit.
    for resumed in {id(r): r for r in (run, fresh, reference)}.values():
        resumed.train(3, seed=5)
    assert_same_run(fresh, reference, f"{where}: after 3 more steps")
    return run


# 2: async saves with every stager, and what PassThroughStager does and does not copy.
class RecordingPassThrough(PassThroughStager):
    """Keeps what it was given and what it returned, for the identity checks."""

    given: dict[str, Any]
    staged: Any

    def stage(self, state_dict: dict[str, Any], **kwargs: Any) -> Any:
        self.given = state_dict
        self.staged = super().stage(state_dict, **kwargs)
        return self.staged


def check_async(mesh: DeviceMesh, async_pg: Any, run: Run, root: Path) -> None:
    where = f"rank {dist.get_rank()} async"
    reader = Run(run.backend, mesh, torch.bfloat16, "fp32", seed=9)
    state = reader.template(where)
    stagers: dict[str, Callable[[], AsyncStager | None]] = {
        "dcp_default": lambda: None,
        "default_stager_sync": lambda: DefaultStager(ASYNC_SAVE_DEFAULTS),
        "default_stager_thread": lambda: DefaultStager(StagingOptions(False, False, True, False)),
        # Pinning is ignored without CUDA (torch warns); shared memory works on the CPU.
        "default_stager_pinned_shared": lambda: DefaultStager(
            StagingOptions(True, True, False, False)
        ),
        "pass_through": RecordingPassThrough,
        "pass_through_thread": lambda: RecordingPassThrough(
            StagingOptions(False, True, True, False)
        ),
    }
    extra = torch.arange(6, dtype=torch.float32)  # a plain CPU tensor in the same state dict
    for name, make in stagers.items():
        run.train(1, seed=20)  # each checkpoint holds different values
        saved = {
            "model": get_model_state_dict(run.model),
            "optim": run.export(),
            "extra": {"t": extra},
        }
        assert_all_on_cpu(saved["optim"], f"{where} {name}")
        frozen = copy.deepcopy(saved)
        stager = make()
        response = dcp.async_save(
            saved, checkpoint_id=str(root / name), process_group=async_pg, async_stager=stager
        )
        wait(response)
        if isinstance(stager, RecordingPassThrough):
            staged = resolve(stager.staged)
            assert stager.given["optim"] is saved["optim"]
            n_passed = 0
            for key, value in saved["optim"].items():
                if key.startswith("state."):
                    assert is_exported(value), f"{where} {name}: {key} not an export"
                    assert staged["optim"][key] is value, f"{where} {name}: {key} was copied"
                    assert local(staged["optim"][key]).data_ptr() == local(value).data_ptr()
                    n_passed += 1
            assert n_passed == 3 * len(list(run.model.parameters())), n_passed
            for key, value in saved["model"].items():
                assert not is_exported(value)
                copy_ = staged["model"][key]
                assert copy_ is not value, f"{where} {name}: weight {key} passed through"
                assert local(copy_).data_ptr() != local(value).data_ptr(), key
                assert_bit_equal(copy_, value, f"{where} {name}: staged {key}")
            assert staged["extra"]["t"].data_ptr() != extra.data_ptr(), "extra not copied"
        if stager is not None:
            stager.close()
        blank(state)
        dcp.load(state, checkpoint_id=str(root / name))
        assert_same_export(state["optim"], frozen["optim"], f"{where} {name}: optim")
        assert_same_export(state["model"], frozen["model"], f"{where} {name}: model")

    # Staging is what makes training during the write safe: stage, step, then write. The
    # exports passed through still hold the staged values (nothing else writes them), and the
    # weights were copied before the step changed them.
    stager = PassThroughStager()
    saved = {"model": get_model_state_dict(run.model), "optim": run.export()}
    frozen = copy.deepcopy(saved)
    staged = stager.stage(saved)
    run.train(1, seed=21)
    assert not torch.equal(
        bits(local(next(run.model.parameters()))), bits(local(frozen["model"]["0.weight"]))
    ), f"{where}: the step changed nothing"
    dcp.save(staged, checkpoint_id=str(root / "staged_then_step"))
    blank(state)
    dcp.load(state, checkpoint_id=str(root / "staged_then_step"))
    assert_same_export(state, frozen, f"{where}: stage, step, write")


# 3: resharding 2 -> 1 and 1 -> 2, then training against the other world size's run.
def check_resharding(backend: Backend, mesh: DeviceMesh, root: Path) -> None:
    rank = dist.get_rank()
    where = f"rank {rank} reshard"
    moments, master = torch.bfloat16, "fp32"  # elementwise updates: any sharding, same bits
    # Every rank creates the 1-rank group (new_group is collective); only rank 0 uses it.
    solo = dist.new_group([0])

    # 2 -> 1: saved by 2 ranks, loaded by one rank of a 1-rank group and by a process with no
    # group; each continues 3 steps against the 2-rank run continued the same way.
    two = Run(backend, mesh, moments, master, seed=30)
    two.train(3, seed=31)
    path21 = str(root / "two_to_one")
    dcp.save(
        {"model": get_model_state_dict(two.model), "optim": two.export()}, checkpoint_id=path21
    )
    saved_full = two.full()
    two.train(3, seed=32)
    after_full = two.full()
    if rank == 0:
        solo_mesh = DeviceMesh.from_group(solo, backend.device)
        for label, target_mesh, group in (
            ("1-rank group", solo_mesh, solo),
            ("no group", None, None),
        ):
            one = Run(backend, target_mesh, moments, master, seed=33)
            state = one.template(f"{where} {label}")
            if group is None:
                dcp.load(state, checkpoint_id=path21, no_dist=True)
            else:
                dcp.load(state, checkpoint_id=path21, process_group=group)
            one.restore(state)
            assert_same_full(one.full(), saved_full, f"{where} 2->1 {label}: loaded")
            one.train(3, seed=32)
            assert_same_full(one.full(), after_full, f"{where} 2->1 {label}: continued")

    # 1 -> 2: saved by a 1-rank group, loaded by 2 ranks.
    path12 = str(root / "one_to_two")
    payload: list[Any] = [None]
    if rank == 0:
        solo_mesh = DeviceMesh.from_group(solo, backend.device)
        one = Run(backend, solo_mesh, moments, master, seed=34)
        one.train(3, seed=35)
        saved = {"model": get_model_state_dict(one.model), "optim": one.export()}
        assert_all_on_cpu(saved["optim"], f"{where} 1-rank save")
        dcp.save(saved, checkpoint_id=path12, process_group=solo)
        saved_one = one.full()
        one.train(3, seed=36)
        payload = [(saved_one, one.full())]
    dist.broadcast_object_list(payload, src=0)
    saved_one, after_one = payload[0]
    two = Run(backend, mesh, moments, master, seed=37)
    state = two.template(f"{where} 1->2")
    dcp.load(state, checkpoint_id=path12)
    two.restore(state)
    assert_same_full(two.full(), saved_one, f"{where} 1->2: loaded")
    two.train(3, seed=36)
    assert_same_full(two.full(), after_one, f"{where} 1->2: continued")


# 4: full_state_dict=True, without and with the policy.
def check_full_state_dict(mesh: DeviceMesh, run: Run) -> None:
    where = f"rank {dist.get_rank()} full_state_dict"
    sharded = run.export()
    gathered = {k: gather(v) for k, v in sharded.items() if isinstance(v, DTensor)}
    for cpu_offload in (False, True):
        options = StateDictOptions(
            full_state_dict=True, cpu_offload=cpu_offload, flatten_optimizer_state_dict=True
        )
        label = f"{where} cpu_offload={cpu_offload}"
        no_policy = get_optimizer_state_dict(run.model, run.opt, options=options)
        te_default = run.export(options, placement=None)
        ours = run.export(options)
        assert_same_export(no_policy, te_default, f"{label}: no policy vs TE default")
        assert_same_export(ours, no_policy, f"{label}: policy vs no policy")
        if cpu_offload and dist.get_rank() != 0:
            assert ours == {}, f"{label}: only rank 0 keeps a full state dict"
            continue
        if cpu_offload or run.backend.device == "cpu":
            # Without cpu_offload, DCP gathers on the mesh's device and keeps the result there.
            assert_all_on_cpu(ours, label)
        for key, global_state in gathered.items():
            assert not isinstance(ours[key], DTensor), f"{label}: {key} not gathered"
            assert torch.equal(bits(ours[key]), bits(global_state)), f"{label}: {key}"

    # The full-state load path exports the target once more (one device, or "Device mismatch")
    # and distributes the full tensors into it. Not flattened: torch 2.13's full-state load of a
    # flattened dict fails with or without the policy (KeyError 'param_groups.0.params.0').
    options = StateDictOptions(full_state_dict=True)
    full = run.export(options)
    loaded = {}
    for placement in ("cpu", None):
        fresh = Run(run.backend, mesh, torch.bfloat16, "fp32", seed=40)
        set_model_state_dict(fresh.model, get_model_state_dict(run.model))
        with export_placement(placement):
            set_optimizer_state_dict(fresh.model, fresh.opt, full, options=options)
        loaded[placement] = fresh
    assert_same_run(loaded["cpu"], loaded[None], f"{where}: full load, policy vs TE default")
    assert_same_run(loaded["cpu"], run, f"{where}: full load", tuples_as_lists=True)


# 7: the Stateful adapter, sync and async.
def check_stateful(mesh: DeviceMesh, async_pg: Any, run: Run, root: Path) -> None:
    where = f"rank {dist.get_rank()} Stateful"
    adapter = PlacedOptimizerState(run.model, run.opt)
    export = adapter.state_dict()
    assert_exports(export, where)
    assert_all_on_cpu(export, where)
    assert_same_export(export, run.export(placement=None), f"{where}: vs TE")
    dcp.save({"optim": adapter}, checkpoint_id=str(root / "sync"))
    run.train(1, seed=50)  # the async checkpoint holds other values than the sync one
    expected = run.export()
    stager = PassThroughStager()
    response = dcp.async_save(
        {"optim": adapter},
        checkpoint_id=str(root / "async"),
        process_group=async_pg,
        async_stager=stager,
    )
    wait(response)
    stager.close()
    for label, ckpt, values in (("sync", "sync", export), ("async", "async", expected)):
        fresh = Run(run.backend, mesh, torch.bfloat16, "fp32", seed=51)
        target = PlacedOptimizerState(fresh.model, fresh.opt)
        dcp.load({"optim": target}, checkpoint_id=str(root / ckpt))
        assert_same_export(fresh.export(), values, f"{where} {label}")
        assert all(
            g["step"] == values["param_groups.0.weight.step"] for g in fresh.opt.param_groups
        )
    assert_same_run(fresh, run, f"{where}: async load", params=False)  # optimizer only


SyncCase = tuple[torch.dtype, str, bool, str]  # moments, master, cpu_offload, checkpoint name
SYNC_CASES: list[SyncCase] = [
    (torch.bfloat16, "remainder", False, "sync_remainder"),
    (torch.float16, "fp32", False, "sync_fp16"),
]


def run_all_checks(
    backend: Backend,
    mesh: DeviceMesh,
    async_pg: Any,
    base: Path,
    extra_sync: tuple[SyncCase, ...] = (),
) -> None:
    """Checks 1-7 on ``backend``; ``extra_sync`` adds sync round-trip cases."""
    for moments, master, cpu_offload, name in (*SYNC_CASES, *extra_sync):
        check_sync_round_trip(backend, mesh, moments, master, cpu_offload, base / name)
    run = check_sync_round_trip(backend, mesh, torch.bfloat16, "fp32", True, base / "sync_bf16")
    check_async(mesh, async_pg, run, base / "async")
    check_full_state_dict(mesh, run)
    check_stateful(mesh, async_pg, run, base / "stateful")
    check_resharding(backend, mesh, base / "reshard")
