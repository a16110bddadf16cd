"""Threads and asyncio tasks, each with its own policy, exporting different optimizers at once."""

from __future__ import annotations

import asyncio
import threading
from typing import Any

import pytest
import torch

from te_ckpt_placement import _ring, current_placement, export_placement

from .support.helpers import aliases_live, assert_same_export, exported_tensors, live_storages
from .support.standin import StandInFusedAdam, make_optimizer, train

POLICIES: list[dict[str, Any]] = [
    {"device": "cpu"},
    {"device": None},
    {"device": "cpu", "conversion": "device"},
    {"device": "cpu", "reuse_buffers": True},
]
MOMENTS = [torch.float32, torch.bfloat16, torch.float16, torch.uint8]


pytestmark = pytest.mark.usefixtures("hooked_standin")


def case(i: int) -> tuple[StandInFusedAdam, dict[str, Any], dict[str, Any]]:
    gen = torch.Generator().manual_seed(i)
    shapes = [(int(torch.randint(1, 40, (1,), generator=gen)), 3) for _ in range(3)]
    params = [torch.nn.Parameter(torch.randn(s, generator=gen)) for s in shapes]
    opt = make_optimizer(params, moments=MOMENTS[i % len(MOMENTS)])
    train(opt, seed=i)
    with export_placement(None):
        reference = opt.state_dict()
    return opt, POLICIES[i % len(POLICIES)], reference


def check(opt: StandInFusedAdam, policy: dict[str, Any], ref: dict[str, Any], sd: Any) -> None:
    assert_same_export(sd, ref)
    live = live_storages(opt)
    aliased = any(aliases_live(t, live) for t in exported_tensors(sd))
    # TE's own export returns FP32 live states themselves (every case keeps FP32 masters); a
    # streaming export never does.
    assert aliased == (policy["device"] is None)


def test_eight_threads_interleaving_exports() -> None:
    cases = [case(i) for i in range(8)]
    barrier = threading.Barrier(8)
    errors: list[BaseException] = []

    def worker(i: int) -> None:
        opt, policy, ref = cases[i]
        try:
            barrier.wait()
            for _ in range(10):
                with export_placement(**policy):
                    assert current_placement().device == policy["device"]
                    sd = opt.state_dict()
                check(opt, policy, ref, sd)
                del sd
        except BaseException as exc:
            errors.append(exc)

    threads = [threading.Thread(target=worker, args=(i,)) for i in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors, errors[0]
    assert _ring.in_use() == 0


def test_hundred_asyncio_tasks_with_their_own_policies() -> None:
    cases = [case(i) for i in range(100)]

    async def task(i: int) -> None:
        opt, policy, ref = cases[i]
        with export_placement(**policy):
            await asyncio.sleep(0.001 * (i % 4))
            # to_thread copies the task's context: the export in the worker sees this policy.
            sd = await asyncio.to_thread(opt.state_dict)
            assert current_placement().device == policy["device"]
        check(opt, policy, ref, sd)

    async def main() -> None:
        await asyncio.gather(*(task(i) for i in range(100)))

    asyncio.run(main())
    assert _ring.in_use() == 0
