"""The scripts under examples/ run as written on the GPU machine, with real TE and frameworks."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]
EXAMPLES = ROOT / "examples"


def run(args: list[str], cwd: Path) -> str:
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]),
    }
    proc = subprocess.run(args, cwd=cwd, env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
    return proc.stdout


def torchrun(nproc: int) -> list[str]:
    from .support.distributed import free_port

    return [sys.executable, "-m", "torch.distributed.run", "--nnodes=1",
            f"--nproc_per_node={nproc}", f"--master_port={free_port()}"]  # fmt: skip


@pytest.mark.gpu
def test_hf_minimal_on_one_gpu(tmp_path: Path) -> None:
    out = run([sys.executable, str(EXAMPLES / "hf_minimal.py"), str(tmp_path / "out")], tmp_path)
    assert "resumed and trained to step 6" in out, out[-2000:]
    assert (tmp_path / "out" / "checkpoint-4" / "optimizer.pt").is_file()


@pytest.mark.multigpu
def test_hf_minimal_under_ddp(tmp_path: Path) -> None:
    out = run([*torchrun(2), str(EXAMPLES / "hf_minimal.py"), str(tmp_path / "out")], tmp_path)
    assert "resumed and trained to step 6" in out, out[-2000:]


@pytest.mark.gpu
@pytest.mark.parametrize("devices", [1, 2], ids=["single", "ddp"])
def test_lightning_minimal(tmp_path: Path, devices: int) -> None:
    if devices > torch.cuda.device_count():
        pytest.skip(f"needs {devices} GPUs")
    script = EXAMPLES / "lightning_minimal.py"
    out = run([sys.executable, str(script), str(tmp_path / "ckpt"), str(devices)], tmp_path)
    assert "resumed and trained to step 6" in out, out[-2000:]
    assert (tmp_path / "ckpt" / "last.ckpt").is_file()
