"""Faults part-way through an export or a load leave nothing broken (CPU stand-in)."""

from __future__ import annotations

import copy
from typing import Any

import pytest
import torch

from te_ckpt_placement import current_placement, engine, export_placement, te_load

from .helpers import assert_same_export, assert_snapshot_equal, snapshot
from .standin import StandInFusedAdam, make_optimizer, train

pytestmark = pytest.mark.usefixtures("hooked_standin")


def build(moments: torch.dtype = torch.bfloat16, master: str = "fp32", seed: int = 0) -> Any:
    param_dtype = torch.bfloat16 if master == "remainder" else torch.float32
    gen = torch.Generator().manual_seed(seed)
    shapes = [(7, 5), (13,), (2,), (3, 4, 2)]
    params = [torch.nn.Parameter(torch.randn(s, generator=gen).to(param_dtype)) for s in shapes]
    opt = make_optimizer(
        [{"params": params[:2]}, {"params": params[2:]}], moments=moments, master=master
    )
    train(opt, steps=2, seed=seed)
    return opt


def nth_call_raises(k: int, exc: BaseException, fn: Any) -> Any:
    calls = 0

    def wrapper(*args: Any, **kwargs: Any) -> Any:
        nonlocal calls
        calls += 1
        if calls == k:
            raise exc
        return fn(*args, **kwargs)

    return wrapper


FAULTS = {
    "host_copy": (engine._Stager, "copy_async", RuntimeError("injected copy failure")),
    "host_alloc": (engine, "empty_host", MemoryError("injected allocation failure")),
    "interrupt": (engine._Stager, "copy_async", KeyboardInterrupt()),
}


@pytest.mark.parametrize("fault", list(FAULTS))
@pytest.mark.parametrize("k", [1, 3, 7])
@pytest.mark.parametrize("moments", [torch.bfloat16, torch.float16, torch.uint8])
def test_export_fault_at_kth_state(
    monkeypatch: pytest.MonkeyPatch, fault: str, k: int, moments: torch.dtype
) -> None:
    opt = build(moments)
    with export_placement(None):
        reference = opt.state_dict()
    before = snapshot(opt)
    with export_placement("cpu"):
        opt.state_dict()  # warm the staging pool
    pool = engine.pinned_pool_bytes()
    owner, attr, exc = FAULTS[fault]
    monkeypatch.setattr(owner, attr, nth_call_raises(k, exc, getattr(owner, attr)))
    with pytest.raises(type(exc)), export_placement("cpu"):
        opt.state_dict()
    monkeypatch.undo()
    assert current_placement() is None, "the policy was not restored"
    assert_snapshot_equal(before, snapshot(opt))
    assert engine.staging_in_use() == 0, "a stager was not returned to the pool"
    assert engine.pinned_pool_bytes() == pool, "the pool grew or leaked"
    with export_placement("cpu"):
        assert_same_export(opt.state_dict(), reference)


def optimizer_view(opt: Any) -> tuple[Any, ...]:
    """Live states, groups and scales, keyed by parameter position (twins compare)."""
    params = [p for g in opt.param_groups for p in g["params"]]
    by_param = snapshot(opt)
    states = {i: by_param[p] for i, p in enumerate(params) if p in by_param}
    groups = [{k: v for k, v in g.items() if k != "params"} for g in opt.param_groups]
    scales = {
        i: {n: s.clone() for n, s in opt._scales.get(p, {}).items()} for i, p in enumerate(params)
    }
    return states, groups, scales


def assert_view_equal(a: tuple[Any, ...], b: tuple[Any, ...]) -> None:
    assert_snapshot_equal(a[0], b[0])
    assert a[1] == b[1], "param_groups changed"
    assert a[2].keys() == b[2].keys()
    for i in a[2]:
        assert a[2][i].keys() == b[2][i].keys()
        for n in a[2][i]:
            assert torch.equal(a[2][i][n], b[2][i][n]), f"scale {i}.{n} changed"


@pytest.mark.parametrize("exc", [RuntimeError("CUDA error: injected"), KeyboardInterrupt()])
@pytest.mark.parametrize("k", [1, 4, 8])
@pytest.mark.parametrize(
    ("moments", "master"),
    [(torch.bfloat16, "remainder"), (torch.float16, "fp16"), (torch.uint8, "fp32")],
)
def test_load_fault_rolls_back_exactly(
    monkeypatch: pytest.MonkeyPatch, exc: BaseException, k: int, moments: torch.dtype, master: str
) -> None:
    source = build(moments, master, seed=1)
    with export_placement("cpu"):
        checkpoint = source.state_dict()
    target = build(moments, master, seed=2)
    before, state_obj = optimizer_view(target), target.state
    monkeypatch.setattr(
        StandInFusedAdam,
        "set_scaled_state",
        nth_call_raises(k, exc, StandInFusedAdam.set_scaled_state),
    )
    with pytest.raises(type(exc)), export_placement("cpu"):
        target.load_state_dict(checkpoint)
    monkeypatch.undo()
    assert target.state is state_obj
    assert_view_equal(before, optimizer_view(target))
    # ... and the optimizer still works: a retried load gives exactly TE's result.
    reference = build(moments, master, seed=2)
    reference.load_state_dict(copy.deepcopy(checkpoint))
    with export_placement("cpu"):
        target.load_state_dict(checkpoint)
    assert_view_equal(optimizer_view(reference), optimizer_view(target))


def test_load_without_rollback_keeps_no_host_copy(monkeypatch: pytest.MonkeyPatch) -> None:
    source, target = build(seed=1), build(seed=2)
    with export_placement("cpu"):
        checkpoint = source.state_dict()
    kept: list[Any] = []
    real_keep = te_load._Rollback.keep
    monkeypatch.setattr(
        te_load._Rollback, "keep", lambda self, t: kept.append(t) or real_keep(self, t)
    )
    with export_placement("cpu", rollback=False):
        target.load_state_dict(checkpoint)
    assert kept == []
    with export_placement("cpu"):
        target.load_state_dict(checkpoint)
    assert kept, "rollback=True made no copies"
