"""The streaming import against the CPU stand-in: equal to TE's load, validated, storage reused."""

from __future__ import annotations

import copy
import itertools
from typing import Any

import pytest
import torch

from te_ckpt_placement import export_placement

from .helpers import assert_same_export, assert_snapshot_equal, bits, local, snapshot
from .standin import StandInFusedAdam, make_optimizer, train

MOMENTS = [torch.float32, torch.bfloat16, torch.float16, torch.uint8]
MASTERS = ["none", "fp32", "fp16", "remainder"]


pytestmark = pytest.mark.usefixtures("hooked_standin")


def build(moments: torch.dtype, master: str, seed: int = 0) -> StandInFusedAdam:
    param_dtype = {"remainder": torch.bfloat16, "fp16": torch.float16}.get(master, torch.float32)
    gen = torch.Generator().manual_seed(seed)
    shapes = [(7, 5), (13,), (1,), (3, 4, 2)]
    params = [torch.nn.Parameter(torch.randn(s, generator=gen).to(param_dtype)) for s in shapes]
    return make_optimizer(
        [{"params": params[:2]}, {"params": params[2:], "lr": 1e-3}], moments=moments, master=master
    )


def trained(moments: torch.dtype, master: str, seed: int, steps: int = 1) -> StandInFusedAdam:
    """A deterministic optimizer with live state; two calls give identical twins."""
    opt = build(moments, master, seed=seed)
    train(opt, steps=steps, seed=seed + 100)
    return opt


def pairs(opt: StandInFusedAdam, other: StandInFusedAdam) -> dict[Any, Any]:
    """Maps other's params to opt's by position, so snapshots of twins compare."""
    mine = [p for g in opt.param_groups for p in g["params"]]
    theirs = [p for g in other.param_groups for p in g["params"]]
    return dict(zip(theirs, mine, strict=True))


def remap(snap: dict[Any, Any], mapping: dict[Any, Any]) -> dict[Any, Any]:
    return {mapping.get(k, k): v for k, v in snap.items()}


def scales(opt: StandInFusedAdam) -> dict[Any, dict[str, torch.Tensor]]:
    return {p: {n: s.clone() for n, s in d.items()} for p, d in opt._scales.items()}


def assert_same_optimizer(ours: StandInFusedAdam, ref: StandInFusedAdam) -> None:
    mapping = pairs(ours, ref)
    assert_snapshot_equal(snapshot(ours), remap(snapshot(ref), mapping))
    ref_scales = remap(scales(ref), mapping)
    for p in snapshot(ours):
        for name in ours.state[p]:
            if name in ref_scales.get(p, {}):
                assert torch.equal(bits(ours._scales[p][name]), bits(ref_scales[p][name])), name
    with export_placement(None):
        assert_same_export(ours.state_dict(), ref.state_dict())


def storages(opt: StandInFusedAdam) -> dict[tuple[int, str], int]:
    out = {}
    for i, p in enumerate(p for g in opt.param_groups for p in g["params"]):
        for name, value in opt.state.get(p, {}).items():
            v = local(value)
            out[(i, name)] = getattr(v, "_data", v).untyped_storage().data_ptr()
    return out


@pytest.mark.parametrize(("moments", "master"), list(itertools.product(MOMENTS, MASTERS)))
def test_load_equals_te_load_and_reuses_storage(moments: torch.dtype, master: str) -> None:
    source = build(moments, master, seed=0)
    train(source, steps=3, seed=1)
    with export_placement("cpu"):
        checkpoint = source.state_dict()
    frozen = copy.deepcopy(checkpoint)

    # Live state exists in both twins, with values other than the checkpoint's.
    target, reference = trained(moments, master, seed=7), trained(moments, master, seed=7)
    before = storages(target)

    with export_placement("cpu"):
        target.load_state_dict(checkpoint)
    with export_placement(None):
        reference.load_state_dict(copy.deepcopy(checkpoint))

    assert_same_optimizer(target, reference)
    assert storages(target) == before, "live state storage was not reused"
    assert_same_export(checkpoint, frozen)  # the caller's checkpoint is untouched


def test_fresh_optimizer_loads_like_te() -> None:
    source = build(torch.float16, "fp32")
    train(source, steps=2)
    with export_placement("cpu"):
        checkpoint = source.state_dict()
    target, reference = build(torch.float16, "fp32", seed=3), build(torch.float16, "fp32", seed=3)
    with export_placement("cpu"):
        target.load_state_dict(checkpoint)
    reference.load_state_dict(copy.deepcopy(checkpoint))
    assert_same_optimizer(target, reference)


def test_continued_training_after_load_is_identical() -> None:
    uninterrupted = build(torch.bfloat16, "remainder")
    train(uninterrupted, steps=2, seed=4)
    with export_placement("cpu"):
        checkpoint = uninterrupted.state_dict()
    resumed = build(torch.bfloat16, "remainder", seed=11)
    for p, q in zip(
        (p for g in resumed.param_groups for p in g["params"]),
        (p for g in uninterrupted.param_groups for p in g["params"]),
        strict=True,
    ):
        with torch.no_grad():
            p.copy_(q)
    with export_placement("cpu"):
        resumed.load_state_dict(checkpoint)
    train(uninterrupted, steps=3, seed=5)
    train(resumed, steps=3, seed=5)
    assert_same_optimizer(resumed, uninterrupted)
    for p, q in pairs(uninterrupted, resumed).items():
        assert torch.equal(bits(p), bits(q))


def test_partial_and_unknown_entries_like_torch() -> None:
    source = build(torch.bfloat16, "fp32")
    train(source)
    with export_placement("cpu"):
        checkpoint = source.state_dict()
    checkpoint["state"][1].pop("master_param")
    checkpoint["state"][2]["exp_avg"] = None
    checkpoint["state"]["extra"] = {"note": 1}
    target, reference = trained(torch.bfloat16, "fp32", 2), trained(torch.bfloat16, "fp32", 2)
    with export_placement("cpu"):
        target.load_state_dict(checkpoint)
    reference.load_state_dict(copy.deepcopy(checkpoint))
    assert_same_optimizer(target, reference)
    assert target.state["extra"] == {"note": 1}
    assert "master_param" not in target.state[target.param_groups[0]["params"][1]]


def corrupt(kind: str, checkpoint: dict[str, Any]) -> str:
    state = checkpoint["state"]
    if kind == "groups":
        checkpoint["param_groups"] = checkpoint["param_groups"][:1]
        return "different number of parameter groups"
    if kind == "group_size":
        checkpoint["param_groups"][1]["params"] = checkpoint["param_groups"][1]["params"][:1]
        return "doesn't match the size"
    if kind == "name":
        state[3]["momentum"] = state[3]["exp_avg"]
        return "'momentum' of parameter 3"
    if kind == "shape":
        state[1]["exp_avg_sq"] = torch.zeros(14)
        return r"'exp_avg_sq' of parameter 1: local shape \(14,\) does not match"
    if kind == "type":
        state[0]["exp_avg"] = [1.0, 2.0]
        return "expected a tensor, found list"
    if kind == "remainder_into_fp32":
        state[2]["master_param"] = torch.zeros(1, dtype=torch.int16)
        return "store_param_remainders=True"
    if kind == "not_a_dict":
        checkpoint.pop("param_groups")
        return "expected a dict with 'state' and 'param_groups'"
    raise AssertionError(kind)


@pytest.mark.parametrize(
    "kind",
    ["groups", "group_size", "name", "shape", "type", "remainder_into_fp32", "not_a_dict"],
)
def test_bad_checkpoint_is_named_and_leaves_optimizer_unchanged(kind: str) -> None:
    source = build(torch.bfloat16, "fp32")
    train(source)
    with export_placement("cpu"):
        checkpoint = source.state_dict()
    # The last state is the one corrupted in most cases, so a load that mutated before
    # validating would have changed the others first.
    pattern = corrupt(kind, checkpoint)
    target = build(torch.bfloat16, "fp32", seed=5)
    train(target, seed=3)
    before, groups = snapshot(target), copy.deepcopy(target.param_groups)
    state_obj = target.state
    with export_placement("cpu"), pytest.raises(ValueError, match=pattern):
        target.load_state_dict(checkpoint)
    assert target.state is state_obj
    assert_snapshot_equal(before, snapshot(target))
    assert [{k: v for k, v in g.items() if k != "params"} for g in target.param_groups] == [
        {k: v for k, v in g.items() if k != "params"} for g in groups
    ]


def test_fp32_master_into_remainder_optimizer_is_refused() -> None:
    source = build(torch.bfloat16, "fp32")
    train(source)
    with export_placement("cpu"):
        checkpoint = source.state_dict()
    target = build(torch.bfloat16, "remainder")
    # Same param shapes, different params dtype: only the master storage differs.
    train(target)
    before = snapshot(target)
    with export_placement("cpu"), pytest.raises(ValueError, match="int16 remainders"):
        target.load_state_dict(checkpoint)
    assert_snapshot_equal(before, snapshot(target))


def test_load_outside_policy_is_te_load() -> None:
    source = build(torch.bfloat16, "fp32")
    train(source)
    with export_placement("cpu"):
        checkpoint = source.state_dict()
    target = build(torch.bfloat16, "fp32", seed=1)
    train(target)
    before = storages(target)
    # Kept alive, so that a new allocation cannot land on a freed address.
    old_states = [dict(states) for states in target.state.values()]
    target.load_state_dict(copy.deepcopy(checkpoint))
    assert old_states
    # TE's own load reallocates every state (L532-548): nothing is reused.
    assert not set(before.values()) & set(storages(target).values())


@pytest.mark.parametrize("policy", ["cpu", None])
@pytest.mark.parametrize(("moments", "master"), list(itertools.product(MOMENTS, MASTERS)))
def test_initialize_states_then_load_equals_torch_fake_step_then_load(
    moments: torch.dtype, master: str, policy: str | None
) -> None:
    from torch.distributed.checkpoint.state_dict import _init_optim_state

    from te_ckpt_placement.te_load import initialize_states

    ours, ref = build(moments, master), build(moments, master)
    assert initialize_states(ours)
    _init_optim_state(ref)  # what get_/set_optimizer_state_dict run on a fresh optimizer
    assert all(p.grad is None for g in ours.param_groups for p in g["params"])
    assert snapshot(ours).keys() == remap(snapshot(ref), pairs(ours, ref)).keys()
    if moments not in (torch.float16, torch.uint8) and master != "fp16":
        # Unscaled storage: the same states; scaled ones differ only in their scales (TE's
        # initialize_state sets 1, a step of zeros sets 0), which every load resets (L452).
        assert_snapshot_equal(snapshot(ours), remap(snapshot(ref), pairs(ours, ref)))
    # Each group counts the step as the fake step does, so a flattened load keeps the key.
    assert [g["step"] for g in ours.param_groups] == [g["step"] for g in ref.param_groups]
    # torch then skips its fake step, and a second call does nothing.
    before = snapshot(ours)
    _init_optim_state(ours)
    assert not initialize_states(ours)
    assert_snapshot_equal(before, snapshot(ours))
    assert all(p.grad is None for g in ours.param_groups for p in g["params"])
    with export_placement("cpu"):
        checkpoint = trained(moments, master, seed=3, steps=2).state_dict()
    with export_placement(policy):
        ours.load_state_dict(copy.deepcopy(checkpoint))
        ref.load_state_dict(copy.deepcopy(checkpoint))
    assert_same_optimizer(ours, ref)


def test_initialize_states_skips_when_grads_exist() -> None:
    from te_ckpt_placement.te_load import initialize_states

    opt = build(torch.bfloat16, "fp32")
    first = opt.param_groups[0]["params"][0]
    first.grad = torch.zeros_like(first)
    assert not initialize_states(opt)
    assert not opt.state
