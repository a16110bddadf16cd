"""Fault injection and optimizer views, shared by the CPU fault tests and the GPU reliability tests.

:data:`FAULTS` names where an export can fail part-way (a host copy, a host allocation, an
interrupt); :func:`nth_call_raises` makes the k-th call of a function raise; :class:`StopAfter`
is a DCP reader that stops part-way.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
from torch.distributed.checkpoint import FileSystemReader
from torch.distributed.checkpoint.planner import LoadPlan, LoadPlanner

from te_ckpt_placement import _pool, _ring

from .helpers import assert_snapshot_equal, snapshot


def nth_call_raises(k: int, exc: BaseException, fn: Any) -> Any:
    calls = 0

    def wrapper(*args: Any, **kwargs: Any) -> Any:
        nonlocal calls
        calls += 1
        if calls == k:
            raise exc
        return fn(*args, **kwargs)

    return wrapper


class StopAfter(FileSystemReader):
    """Reads the first ``count`` optimizer-state items of the plan (all of them for None), then
    raises ``exc`` (an ``OSError`` by default), or returns if ``quietly``."""

    def __init__(
        self,
        path: str | Path,
        count: int | None,
        *,
        exc: BaseException | None = None,
        quietly: bool = False,
    ) -> None:
        super().__init__(str(path))
        self.count, self.quietly = count, quietly
        self.exc = OSError("the disk went away") if exc is None else exc

    def read_data(self, plan: LoadPlan, planner: LoadPlanner) -> Any:
        items = [i for i in plan.items if "optim.state." in i.dest_index.fqn][: self.count]
        done = super().read_data(LoadPlan(items), planner)
        if self.quietly:
            return done
        raise self.exc


FAULTS = {
    "host_copy": (_ring.Ring, "copy", RuntimeError("injected copy failure")),
    "host_alloc": (_pool, "empty_host", MemoryError("injected allocation failure")),
    "interrupt": (_ring.Ring, "copy", KeyboardInterrupt()),
}


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
