"""The trainer-resume benchmark's harness on the CPU: real Transformers, Lightning and Fabric,
single process and DDP (gloo), the CPU stand-in of TE, plain and placed resumes bit-equal.

The GPU run of the same script is ``tests/test_gpu_trainers.py``; here no GPU numbers exist, so
this checks that every configuration saves, resumes both ways and writes its records.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

pytest.importorskip("transformers")
pytest.importorskip("accelerate")
pytest.importorskip("lightning")

from benchmarks.trainer_resume import CONFIGS

ROOT = Path(__file__).resolve().parents[1]


def test_trainer_resume_harness_on_cpu(tmp_path: Path) -> None:
    out = tmp_path / "trainer_resume.json"
    proc = subprocess.run(
        [
            sys.executable,
            "benchmarks/trainer_resume.py",
            "--device",
            "cpu",
            "--size",
            "tiny",
            "--dir",
            str(tmp_path / "checkpoints"),
            "--out",
            str(out),
        ],
        cwd=ROOT,
        env=dict(os.environ, PYTHONPATH=str(ROOT)),
        capture_output=True,
        text=True,
        timeout=900,
    )
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
    data = json.loads(out.read_text())
    assert data["failures"] == []
    assert data["environment"]["device"] == "cpu"
    resumes = [r for r in data["records"] if r["op"] == "trainer_resume"]
    for world, configs in CONFIGS.items():
        for config in configs:
            framework, variant = config.split("/")
            for rank in range(world):
                modes = {
                    r["mode"]: r
                    for r in resumes
                    if (r["framework"], r["variant"], r["rank"]) == (framework, variant, rank)
                }
                assert set(modes) == {"te_default", "placement_cpu"}, (config, rank)
                placed = modes["placement_cpu"]
                assert placed["states_equal_plain"] is True
                assert placed["world_size"] == world
                assert placed["n_elements"] > 0 and placed["seconds"] > 0
                assert placed["peak_extra_gpu_bytes"] is None  # no GPU here
    saves = [r for r in data["records"] if r["op"] == "trainer_save"]
    assert len(saves) == sum(world * len(configs) for world, configs in CONFIGS.items())
    assert not list((tmp_path / "checkpoints").rglob("*.ckpt"))  # each configuration cleans up


def test_peak_allocations_from_an_allocator_trace() -> None:
    from benchmarks.trainer_resume import peak_allocations

    def frames(name: str) -> list[dict[str, object]]:
        return [{"filename": "/x/torch/cuda/memory.py", "line": 1, "name": "inner"},
                {"filename": f"/repo/pkg/{name}.py", "line": 7, "name": name}]  # fmt: skip

    def alloc(addr: int, size: int, name: str) -> dict[str, object]:
        return {"action": "alloc", "addr": addr, "size": size, "frames": frames(name)}

    def free(addr: int, size: int) -> dict[str, object]:
        return {"action": "free_requested", "addr": addr, "size": size, "frames": []}

    trace = [
        alloc(1, 512, "before"),  # before the window: its free below is listed apart
        alloc(9, 512, "_window_start_marker"),
        free(9, 512),
        alloc(2, 4096, "state"),  # kept
        alloc(3, 8192, "cast"),  # temporary: alive at the peak, freed by the end
        alloc(4, 1024, "state"),  # kept
        free(3, 8192),
        alloc(3, 2048, "late"),  # the same address again, after the peak, freed
        free(3, 2048),
        {**free(1, 512), "frames": frames("release")},
    ]
    found = peak_allocations({"device_traces": [trace]}, 0)
    assert found["temporary_bytes"] == 8192
    assert found["retained_bytes"] == 4096 + 1024
    assert found["temporaries"] == [{"bytes": 8192, "stack": ["repo/pkg/cast.py:7 cast"]}]
    assert [r["bytes"] for r in found["retained"]] == [4096, 1024]
    assert found["freed_from_before_bytes"] == 512
    assert found["freed_from_before"] == [
        {"bytes": 512, "stack": ["repo/pkg/release.py:7 release"]}
    ]
    assert found["window_start_found"] is True
    assert found["trace_entries"] == len(trace)
    # A trace that lost the window's start (its ring buffer overflowed) says so.
    assert peak_allocations({"device_traces": [trace[2:]]}, 0)["window_start_found"] is False


def test_timed_counts_calls_and_restores_what_it_wrapped() -> None:
    import types

    from benchmarks.trainer_resume import Timed

    module = types.SimpleNamespace(work=lambda n: sum(range(n)))

    class Thing:
        def run(self, n: int) -> int:
            return n + 1

    thing = Thing()
    real_work = module.work
    with Timed() as timed:
        timed.wrap(module, "work", "work")
        timed.wrap(thing, "run", lambda n: f"run {n}")
        assert module.work(1000) == sum(range(1000))
        assert module.work(10) == 45
        assert thing.run(3) == 4
    assert module.work is real_work and "run" not in vars(thing)  # restored, nothing left
    result = timed.result()
    assert set(result["seconds"]) == {"work", "run 3"}
    assert all(v >= 0 for v in result["seconds"].values())
    assert result["torch_threads"] == {
        "work": torch.get_num_threads(),
        "run 3": torch.get_num_threads(),
    }
