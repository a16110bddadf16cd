"""Real Megatron-Core 0.19.2 with real TE on 1 and 2 GPUs, and the CPU stand-in checked against it.

- ``test_the_stand_in_is_megatrons_code``: every method ``tests/megatron_verbatim.py`` copies has
  exactly the installed ``DistributedOptimizer``'s source, and the integration recognizes the
  installed class (so the CPU tests ran Megatron's own code).
- ``test_megatron_*``: ``benchmarks/megatron_ckpt.py --size test`` under torchrun (a GPTModel
  from Megatron's own setup, ``get_megatron_optimizer`` with BF16 moments, ``dist_checkpointing``
  torch_dist saves and loads for every sharding type), which checks: the placed checkpoints equal
  Megatron's bit for bit; resuming from them, and N steps after, equal resuming from Megatron's;
  the placed saves' GPU peaks (0 beyond a small slack for dp_reshardable, Megatron's own gather
  buffers for dp_zero_gather_scatter and fully_reshardable) and loads' (the loaded states).

Without megatron-core these skip, unless ``TE_CKPT_REQUIRE_MEGATRON=1`` (the GPU session sets
it), which turns a missing Megatron into a failure. ``TE_CKPT_MEGATRON_OUT=DIR`` keeps each run's
JSON (records and checks) in ``DIR``.
"""

from __future__ import annotations

import inspect
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch

from . import megatron_standin as ms

REPO_ROOT = Path(__file__).resolve().parents[1]


def megatron_or_skip() -> Any:
    api = ms.megatron_api()
    if api is None:
        reason = "megatron-core 0.19.2 does not import (install the [megatron] extra)"
        if os.environ.get("TE_CKPT_REQUIRE_MEGATRON") == "1":
            pytest.fail(reason)
        pytest.skip(reason)
    return api


@pytest.mark.gpu
def test_the_stand_in_is_megatrons_code() -> None:
    from te_ckpt_placement.integrations import megatron

    api = megatron_or_skip()
    real = api.DistributedOptimizer
    megatron.check_megatron(real)
    for name in ms.VERBATIM_METHODS:
        ours = inspect.getattr_static(ms.StandInDistributedOptimizer, name)
        theirs = inspect.getattr_static(real, name)
        if isinstance(ours, property):
            ours, theirs = ours.fget, theirs.fget
        assert inspect.getsource(ours) == inspect.getsource(theirs), name
    assert (
        ms.StandInDistributedOptimizer.checkpoint_fully_reshardable_formats
        == real.checkpoint_fully_reshardable_formats
    )
    assert megatron.megatron_version() == "0.19.2"


def run_megatron(world: int, tmp_path: Path) -> dict[str, Any]:
    megatron_or_skip()
    out = tmp_path / f"megatron_test_{world}gpu.json"
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        f"--nproc_per_node={world}",
        str(REPO_ROOT / "benchmarks" / "megatron_ckpt.py"),
        "--size",
        "test",
        "--out",
        str(out),
        "--workdir",
        str(tmp_path),
    ]
    proc = subprocess.run(cmd, cwd=REPO_ROOT, capture_output=True, text=True, timeout=600)
    print(proc.stdout[-8000:])
    keep = os.environ.get("TE_CKPT_MEGATRON_OUT")
    if keep and out.exists():
        Path(keep).mkdir(parents=True, exist_ok=True)
        shutil.copy(out, Path(keep) / out.name)
    assert out.exists(), f"no results (exit {proc.returncode}):\n{proc.stderr[-8000:]}"
    result: dict[str, Any] = json.loads(out.read_text())
    failed = [c for c in result["checks"] if not c["ok"]]
    assert not failed, json.dumps(failed, indent=1, default=str)[:8000]
    assert proc.returncode == 0, proc.stderr[-8000:]
    return result


def _assert_every_sharding_type_checked(result: dict[str, Any]) -> None:
    names = {(c["sharding_type"], c["check"]) for c in result["checks"] if "sharding_type" in c}
    for sharding_type in ("dp_reshardable", "fully_reshardable", "dp_zero_gather_scatter"):
        for check in (
            "checkpoints equal Megatron's, bit for bit",
            "loaded states and params equal Megatron's load",
            "save: placed peak GPU within bound",
        ):
            assert (sharding_type, check) in names, (sharding_type, check)
    assert (
        "fully_sharded_model_space",
        "megatron refuses it, and the same way when placed",
    ) in names
    ops = {(r["op"], r["sharding_type"], r["mode"]) for r in result["records"]}
    assert len(ops) == 3 * 2 * 2, sorted(ops)


@pytest.mark.gpu
def test_megatron_on_one_gpu(tmp_path: Path) -> None:
    result = run_megatron(1, tmp_path)
    _assert_every_sharding_type_checked(result)


@pytest.mark.multigpu
def test_megatron_on_two_gpus(tmp_path: Path) -> None:
    if torch.cuda.device_count() < 2:
        pytest.skip("needs 2 CUDA GPUs")
    result = run_megatron(2, tmp_path)
    _assert_every_sharding_type_checked(result)
    assert {r["world_size"] for r in result["records"]} == {2}
