"""Trainer resumes on GPUs with real TE FusedAdam: no GPU temporaries beyond the optimizer's states.

Runs ``benchmarks/trainer_resume.py`` once (world size 1, and 2 when two GPUs are visible):
Transformers (one GPU, DDP, accelerate FSDP2 sharded and full state dict), Lightning and Fabric
(one GPU, DDP), each resumed from the same checkpoint without (``te_default``) and with
(``placement_cpu``) the integration. For every configuration and rank the placed resume must
leave ``peak_extra_gpu_bytes == 0`` and resume exactly the plain resume's optimizer states; where
the framework's own resume puts the checkpoint or templates on the GPU, the plain resume must show
them (so the measurement can see them).

The records go to ``$TE_CKPT_TRAINER_RESULTS``, else ``$OUT/trainer_resume.json`` when ``OUT`` is
set, else a temporary directory.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch

from benchmarks.trainer_resume import CONFIGS

ROOT = Path(__file__).resolve().parents[1]


def results_path(tmp: Path) -> Path:
    explicit = os.environ.get("TE_CKPT_TRAINER_RESULTS")
    if explicit:
        return Path(explicit)
    if os.environ.get("OUT"):
        return Path(os.environ["OUT"]) / "trainer_resume.json"
    return tmp / "trainer_resume.json"


@pytest.fixture(scope="module")
def results(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    out = results_path(tmp_path_factory.mktemp("trainer_resume"))
    worlds = "1,2" if torch.cuda.device_count() >= 2 else "1"
    proc = subprocess.run(
        [
            sys.executable,
            "benchmarks/trainer_resume.py",
            "--out",
            str(out),
            "--world-sizes",
            worlds,
        ],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=560,  # under the GPU machine's 10-minute limit per command; expected ~3 min
    )
    print(proc.stdout[-20000:])
    print(proc.stderr[-20000:], file=sys.stderr)
    assert out.is_file(), f"no results (exit {proc.returncode}): {proc.stderr[-3000:]}"
    data: dict[str, Any] = json.loads(out.read_text())
    data["returncode"] = proc.returncode
    return data


def records(data: dict[str, Any], config: str, mode: str) -> list[dict[str, Any]]:
    framework, variant = config.split("/")
    return [
        r
        for r in data["records"]
        if r["op"] == "trainer_resume"
        and r["framework"] == framework
        and r["variant"] == variant
        and r["mode"] == mode
    ]


# Where the framework's own resume puts more than the optimizer's states on the GPU (so the
# measurement can be seen to see it): Transformers under DDP reads optimizer.pt onto the device;
# accelerate's FSDP2 resume runs torch's fake step and loads through GPU templates. Transformers on
# one device, Lightning and Fabric read the checkpoint to the host themselves (0 on 2 H200s).
PLAIN_ALLOCATES = {"transformers/ddp", "transformers/fsdp2_sharded", "transformers/fsdp2_full"}


def check(data: dict[str, Any], config: str, world_size: int) -> None:
    placed = records(data, config, "placement_cpu")
    plain = records(data, config, "te_default")
    assert sorted(r["rank"] for r in placed) == list(range(world_size)), data["failures"]
    assert sorted(r["rank"] for r in plain) == list(range(world_size)), data["failures"]
    for record in placed:
        assert record["world_size"] == world_size
        assert record["states_equal_plain"] is True, record
        assert record["peak_extra_gpu_bytes"] == 0, record
        assert record["peak_extra_gpu_bytes_other_devices"] == 0, record
        assert record["live_state_bytes"] > 0, record
    if config in PLAIN_ALLOCATES:
        for record in plain:
            assert record["peak_extra_gpu_bytes"] > 0, record


@pytest.mark.gpu
@pytest.mark.parametrize("config", CONFIGS[1])
def test_single_gpu_resume_adds_nothing_beyond_optimizer_states(
    results: dict[str, Any], config: str
) -> None:
    check(results, config, 1)


@pytest.mark.multigpu
@pytest.mark.parametrize("config", CONFIGS[2])
def test_two_gpu_resume_adds_nothing_beyond_optimizer_states(
    results: dict[str, Any], config: str
) -> None:
    check(results, config, 2)


@pytest.mark.gpu
def test_benchmark_reports_no_failure(results: dict[str, Any]) -> None:
    assert results["failures"] == [], results["failures"]
    assert results["returncode"] == 0
    versions = results["environment"]["versions"]
    assert versions["transformer_engine"] is not None
