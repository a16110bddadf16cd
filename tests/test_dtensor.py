"""The streaming export of DTensor states on 2 CPU ranks (gloo), against the CPU stand-in.

One test spawns 2 ranks once (process start-up dominates the runtime) and runs every check in
them: exports of every CPU-supported storage mode (FP8 states of DTensor params are not kept by
the stand-in) checked against TE's own export, and a torch.distributed.checkpoint save/load round
trip into a fresh optimizer, with a ``fully_shard`` model and with a model of hand-distributed
(uneven Shard(0), uneven Shard(1), Replicate) parameters.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Placement, Replicate, Shard, distribute_tensor

from te_ckpt_placement import export_placement

from .support.distributed import (
    WORLD,
    by_position,
    fully_sharded,
    gather,
    hyperparams,
    init_gloo_mesh,
    ordered_params,
    param_dtype,
    spawn,
    train_global,
)
from .support.helpers import (
    aliases_live,
    assert_bit_equal,
    assert_owns_storage,
    assert_same_export,
    assert_snapshot_equal,
    bits,
    live_storages,
    local,
    snapshot,
)
from .support.standin import make_optimizer, train

MOMENTS = (torch.float32, torch.bfloat16, torch.float16)
MASTERS = ("none", "fp32", "remainder")
STATE_NAMES = {
    "none": ["exp_avg", "exp_avg_sq"],
    "fp32": ["exp_avg", "exp_avg_sq", "master_param"],
    "remainder": ["exp_avg", "exp_avg_sq", "master_param"],
}


# --- parameters ---------------------------------------------------------------------------------
def _dtensor_params(
    mesh: DeviceMesh, dtype: torch.dtype, seed: int, *, empty_shard: bool
) -> list[torch.nn.Parameter]:
    gen = torch.Generator().manual_seed(seed)  # the same full tensors on every rank
    specs: list[tuple[tuple[int, ...], Placement]] = [
        ((6, 4), Shard(0)),  # even: 3 rows per rank
        ((5, 3), Shard(0)),  # uneven: 3 rows on rank 0, 2 on rank 1
        ((4,), Replicate()),
        ((4, 5), Shard(1)),  # uneven along dim 1: local strides differ from the global ones
    ]
    if empty_shard:
        # 1 row on 2 ranks: rank 1 holds a 0-element shard. TE cannot keep scaled (FP16)
        # states of empty tensors (aminmax, fused_adam.py L298), so only unscaled modes get it.
        specs.append(((1, 3), Shard(0)))
    return [
        torch.nn.Parameter(
            distribute_tensor(torch.randn(shape, generator=gen).to(dtype), mesh, [placement])
        )
        for shape, placement in specs
    ]


class _HandDistributed(torch.nn.Module):
    """A module whose parameters are distribute_tensor'd nn.Parameters (no FSDP)."""

    def __init__(self, mesh: DeviceMesh, dtype: torch.dtype, seed: int) -> None:
        super().__init__()
        w, b, r, c = _dtensor_params(mesh, dtype, seed, empty_shard=False)
        self.w, self.b, self.r, self.c = w, b, r, c


# --- comparisons --------------------------------------------------------------------------------
def _same_snapshot(a: dict[Any, Any], b: dict[Any, Any]) -> bool:
    try:
        assert_snapshot_equal(a, b)
    except AssertionError:
        return False
    return True


def _check_state_dtensor(state: Any, param: DTensor, dtype: torch.dtype, where: str) -> None:
    assert isinstance(state, DTensor), f"{where}: {type(state).__name__} is not a DTensor"
    assert state._local_tensor.device.type == "cpu", f"{where}: local on {state.device}"
    assert state.device_mesh == param.device_mesh, f"{where}: mesh differs"
    assert tuple(state.placements) == tuple(param.placements), f"{where}: placements differ"
    assert state.size() == param.size(), f"{where}: global shape {state.size()}"
    assert state.stride() == param.stride(), f"{where}: global stride {state.stride()}"
    assert state.dtype == dtype, f"{where}: DTensor dtype {state.dtype}"
    assert state._local_tensor.dtype == dtype, f"{where}: local dtype {state._local_tensor.dtype}"
    assert state._local_tensor.shape == param._local_tensor.shape, f"{where}: local shape"


# --- exports of every storage mode --------------------------------------------------------------
def _check_export_mode(mesh: DeviceMesh, moments: torch.dtype, master: str, seed: int) -> None:
    mode = f"rank {dist.get_rank()} moments={moments} master={master}"
    params = _dtensor_params(mesh, param_dtype(master), seed, empty_shard=moments != torch.float16)
    if dist.get_rank() == 1 and moments != torch.float16:
        assert params[-1]._local_tensor.numel() == 0, "the empty shard is not empty"
    opt = make_optimizer(
        [{"params": params[:2]}, {"params": params[2:], "lr": 1e-3}], moments=moments, master=master
    )
    train(opt, steps=3, seed=seed)
    before = snapshot(opt)
    live = live_storages(opt)

    with export_placement(None):
        ref = opt.state_dict()
    with export_placement("cpu"):
        ours = opt.state_dict()
    with export_placement("cpu", conversion="device"):
        ours_device = opt.state_dict()

    assert_same_export(ours, ref, mode)
    assert_same_export(ours_device, ref, f"{mode} conversion=device")
    assert_snapshot_equal(before, snapshot(opt))
    assert sorted(ours["state"]) == list(range(len(params))), f"{mode}: state keys"

    for index, param in enumerate(params):
        states = ours["state"][index]
        assert list(states) == STATE_NAMES[master], f"{mode}: states {list(states)}"
        for name, state in states.items():
            where = f"{mode} param {index} {name}"
            remainder = master == "remainder" and name == "master_param"
            _check_state_dtensor(state, param, torch.int16 if remainder else torch.float32, where)
            _check_state_dtensor(ours_device["state"][index][name], param, state.dtype, where)
            assert_owns_storage(state)
            assert not aliases_live(state, live), f"{where}: ours aliases the live state"
            assert not aliases_live(ours_device["state"][index][name], live), where
            # TE's own export returns the stored FP32/int16 tensors themselves: the check
            # above is not vacuous for those states.
            stored_as_is = moments == torch.float32 or name == "master_param"
            expect_alias = stored_as_is and state._local_tensor.numel() > 0
            assert aliases_live(ref["state"][index][name], live) == expect_alias, where
            # The DTensor metadata is usable: gathering the global tensor (a collective)
            # gives TE's global tensor, uneven and replicated shards included.
            full, full_ref = gather(state), gather(ref["state"][index][name])
            assert full.shape == param.size(), f"{where}: gathered shape {full.shape}"
            assert torch.equal(bits(full), bits(full_ref)), f"{where}: gathered values differ"

    # Ours are private copies: a later step leaves them as they were.
    frozen = {
        (i, n): bits(local(t)).clone() for i, s in ours["state"].items() for n, t in s.items()
    }
    train(opt, steps=1, seed=100 + seed)
    changed = [
        key
        for key, value in frozen.items()
        if not torch.equal(bits(local(ours["state"][key[0]][key[1]])), value)
    ]
    assert not changed, f"{mode}: a later step changed exported states {changed}"
    # ... while the live state did change (compared unscaled: FP16 storage may keep its bits
    # and change only its scale).
    live_after = bits(opt.get_unscaled_state(params[0], "exp_avg"))
    assert not torch.equal(frozen[0, "exp_avg"], live_after), f"{mode}: the step changed nothing"


# --- torch.distributed.checkpoint round trip ----------------------------------------------------
ROUND_TRIPS = [
    ("fully_shard", torch.bfloat16, "fp32"),
    ("fully_shard", torch.float32, "remainder"),
    ("fully_shard", torch.float16, "none"),
    ("hand", torch.float32, "fp32"),
    ("hand", torch.bfloat16, "remainder"),
    ("hand", torch.float16, "fp32"),
]


def _build(kind: str, mesh: DeviceMesh, master: str, seed: int) -> torch.nn.Module:
    if kind == "fully_shard":
        return fully_sharded(mesh, param_dtype(master), seed)
    return _HandDistributed(mesh, param_dtype(master), seed)


def _check_round_trip(
    mesh: DeviceMesh, kind: str, moments: torch.dtype, master: str, path: Path
) -> None:
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import (
        StateDictOptions,
        get_model_state_dict,
        get_optimizer_state_dict,
        set_model_state_dict,
        set_optimizer_state_dict,
    )

    mode = f"rank {dist.get_rank()} {kind} moments={moments} master={master}"
    options = StateDictOptions(flatten_optimizer_state_dict=True)

    model = _build(kind, mesh, master, seed=1)
    params = list(model.parameters())
    assert params and all(isinstance(p, DTensor) for p in params), f"{mode}: params"
    opt = make_optimizer(model.parameters(), moments=moments, master=master)
    train_global(opt, steps=3, seed=2)
    for name, p in model.named_parameters():
        if isinstance(p.placements[0], Replicate):
            copies = [torch.empty_like(p._local_tensor) for _ in range(WORLD)]
            dist.all_gather(copies, p._local_tensor.contiguous())
            assert torch.equal(bits(copies[0]), bits(copies[1])), f"{mode}: {name} diverged"
    before = snapshot(opt)
    live = live_storages(opt)

    with export_placement(None):
        ref = get_optimizer_state_dict(model, opt, options=options)
    with export_placement("cpu"):
        saved = get_optimizer_state_dict(model, opt, options=options)
    assert_same_export(saved, ref, mode)
    assert_snapshot_equal(before, snapshot(opt))
    fqn_params = dict(model.named_parameters())
    state_keys = [k for k in saved if k.startswith("state.")]
    assert len(state_keys) == len(params) * len(STATE_NAMES[master]), f"{mode}: {state_keys}"
    for key in state_keys:
        fqn, name = key[len("state.") :].rsplit(".", 1)
        param = fqn_params[fqn]
        remainder = master == "remainder" and name == "master_param"
        _check_state_dtensor(
            saved[key], param, torch.int16 if remainder else torch.float32, f"{mode} {key}"
        )
        assert_owns_storage(saved[key])
        assert not aliases_live(saved[key], live), f"{mode} {key}: aliases the live state"
    dcp.save({"model": get_model_state_dict(model), "optim": saved}, checkpoint_id=str(path))

    # A fresh model (other initial values) and a fresh optimizer, restored from the checkpoint.
    model2 = _build(kind, mesh, master, seed=3)
    opt2 = make_optimizer(model2.parameters(), moments=moments, master=master)
    with export_placement("cpu"):
        template = get_optimizer_state_dict(model2, opt2, options=options)
    assert sorted(template) == sorted(saved), f"{mode}: template keys differ"
    for key in state_keys:
        assert template[key]._local_tensor.device.type == "cpu", f"{mode} {key}: template"
    # Not yet restored: the fresh live state differs, so the comparisons below can fail.
    assert not _same_snapshot(by_position(opt2), by_position(opt)), f"{mode}: already equal"
    assert any(
        not torch.equal(bits(p._local_tensor), bits(p2._local_tensor))
        for p, p2 in zip(model.parameters(), model2.parameters(), strict=True)
    ), f"{mode}: the fresh model already has the trained values"
    state = {"model": get_model_state_dict(model2), "optim": template}
    dcp.load(state, checkpoint_id=str(path))
    set_model_state_dict(model2, state["model"])
    set_optimizer_state_dict(model2, opt2, optim_state_dict=state["optim"], options=options)

    for (name, p), p2 in zip(model.named_parameters(), model2.parameters(), strict=True):
        assert_bit_equal(p2, p, f"{mode} param {name}")
    assert_snapshot_equal(by_position(opt), by_position(opt2))
    for i, (p, p2) in enumerate(zip(ordered_params(opt), ordered_params(opt2), strict=True)):
        scales, scales2 = opt._scales.get(p, {}), opt2._scales.get(p2, {})
        assert scales.keys() == scales2.keys(), f"{mode} param {i}: scaled states differ"
        for name in scales:
            assert torch.equal(bits(scales[name]), bits(scales2[name])), f"{mode} {i} {name}"
    assert hyperparams(opt2) == hyperparams(opt), f"{mode}: param_groups differ"
    # The restored optimizer exports what the original exported.
    with export_placement("cpu"):
        assert_same_export(
            get_optimizer_state_dict(model2, opt2, options=options), saved, f"{mode} reload"
        )


# --- the test: one spawn of 2 ranks ------------------------------------------------------------
def _worker(rank: int, port: int, root: str) -> None:
    mesh = init_gloo_mesh(rank, port)
    try:
        for seed, (moments, master) in enumerate((m, s) for m in MOMENTS for s in MASTERS):
            _check_export_mode(mesh, moments, master, seed)
        for case, (kind, moments, master) in enumerate(ROUND_TRIPS):
            _check_round_trip(mesh, kind, moments, master, Path(root) / f"case{case}")
    finally:
        dist.destroy_process_group()


def test_dtensor_exports_and_dcp_round_trip_on_two_ranks(tmp_path: Path) -> None:
    spawn(_worker, str(tmp_path))
    # Every round trip wrote a checkpoint where the parent asked for it.
    for case in range(len(ROUND_TRIPS)):
        assert (tmp_path / f"case{case}" / ".metadata").is_file(), f"case{case}: no checkpoint"
