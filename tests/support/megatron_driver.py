"""Runs ``benchmarks/megatron_ckpt.py`` under torchrun and reads what it wrote.

On GPUs the driver itself runs (``tests/test_gpu_megatron.py``); on the CPU
``tests/support/megatron_cpu_run.py`` runs it around TE's stand-in
(``tests/test_integrations_megatron.py``).
``TE_CKPT_MEGATRON_OUT=DIR`` keeps each run's JSON and log in ``DIR``.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
from pathlib import Path
from typing import Any

REPO_ROOT = Path(__file__).resolve().parents[2]
GPU_SCRIPT = REPO_ROOT / "benchmarks" / "megatron_ckpt.py"
CPU_SCRIPT = REPO_ROOT / "tests" / "support" / "megatron_cpu_run.py"


def run(world: int, tmp_path: Path, *, cpu: bool, size: str, timeout: float) -> dict[str, Any]:
    """The run's JSON; fails with the run's output if it wrote none, or if any check failed."""
    tag = f"megatron_{'cpu' if cpu else 'gpu'}_{world}"
    out = tmp_path / f"{tag}.json"
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        f"--nproc_per_node={world}",
        str(CPU_SCRIPT if cpu else GPU_SCRIPT),
        "--size",
        size,
        "--out",
        str(out),
        "--workdir",
        str(tmp_path),
    ]
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    with subprocess.Popen(
        cmd, cwd=REPO_ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
    ) as proc:
        try:
            stdout, stderr = proc.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            # torchrun stops its ranks (each in a session of its own) on SIGTERM.
            proc.send_signal(signal.SIGTERM)
            stdout, stderr = proc.communicate()
            stderr += f"\ntimed out after {timeout} s"
        code = proc.returncode
    print(stdout[-8000:])
    keep = os.environ.get("TE_CKPT_MEGATRON_OUT")
    if keep:
        Path(keep).mkdir(parents=True, exist_ok=True)
        (Path(keep) / f"{tag}.log").write_text(stdout + "\n--- stderr ---\n" + stderr)
        if out.exists():
            shutil.copy(out, Path(keep) / out.name)
    assert out.exists(), f"no results (exit {code}):\n{stderr[-8000:]}"
    result: dict[str, Any] = json.loads(out.read_text())
    failed = [c for c in result["checks"] if not c["ok"]]
    assert not failed, json.dumps(failed, indent=1, default=str)[:8000]
    assert result["complete"] and code == 0, f"exit {code}:\n{stderr[-8000:]}"
    return result


def assert_cases_ran(result: dict[str, Any], world: int, *, fp8: bool = True) -> None:
    """Every case of ``cases(world)`` ran its checks and was measured."""
    if str(REPO_ROOT) not in sys.path:
        sys.path.insert(0, str(REPO_ROOT))
    import torch

    from benchmarks.megatron_ckpt import Case, cases

    expected = [c for c in cases(world) if fp8 or c.moments != torch.uint8]
    checks = {
        (c["case"], c["check"].removeprefix("not measured on the CPU: ")) for c in result["checks"]
    }
    ops = {(r["case"], r["op"], r["mode"]) for r in result["records"]}
    for case in expected:
        if case.sharding_type == "fully_sharded_model_space":
            assert (case.name, "megatron refuses it, and the same way when placed") in checks
            continue
        for check in (
            "checkpoints equal Megatron's, bit for bit",
            "loaded states and params equal Megatron's load",
            "save: placed peak GPU within bound",
            "save: no GPU bytes at the placed peak are te_ckpt_placement's or TE's",
            "load: placed peak GPU not above Megatron's",
        ):
            assert (case.name, check) in checks, (case.name, check)
        assert any(n.startswith("steps after resume") for c, n in _split(checks) if c == case.name)
        for op in ("megatron_save", "megatron_load"):
            for mode in ("te_default", "placement_cpu"):
                assert (case.name, op, mode) in ops, (case.name, op, mode)
        for mode in ("te_default", "placement_cpu"):  # each load repeated, and the median
            loads = [
                r["seconds"]
                for r in result["records"]
                if (r["case"], r["op"], r["mode"]) == (case.name, "megatron_load", mode)
            ]
            (median,) = [
                r
                for r in result["records"]
                if (r["case"], r["op"], r["mode"]) == (case.name, "megatron_load_median", mode)
            ]
            assert len(loads) == median["repeats"] == 3 and median["seconds_each"] == loads
            assert median["seconds"] == sorted(loads)[1]
    # The NaN probe: every BF16 case but the refused one.
    for case in expected:
        if case.moments == torch.bfloat16 and case.sharding_type != "fully_sharded_model_space":
            assert (case.name, "NaN moments load as Megatron's own load leaves them") in checks
    # The dp_reshardable size probe: two widths, their placed saves measured and compared.
    probe = Case("dp_reshardable", buckets=False).name
    assert (probe, "save: placed dp_reshardable peak independent of N") in checks
    sizes = {r["model_size"] for r in result["records"] if r["op"] == "megatron_save_probe"}
    assert sizes == {"full", "half_width"}, sizes
    assert {r["world_size"] for r in result["records"]} == {world}


def _split(checks: set[tuple[str, str]]) -> list[tuple[str, str]]:
    """(case, check) with the step count cut off the front of "N steps after resume ..."."""
    return [(c, n.split(" ", 1)[1] if n[:1].isdigit() else n) for c, n in checks]
