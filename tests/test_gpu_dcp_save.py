"""Streaming DCP saves and raw-snapshot async saves with real TE FusedAdam under FSDP2 on 2 GPUs.

``test_dcp_save.py`` proves the logic on 2 CPU ranks with the stand-in. Here the same checks
(``dcp_save_checks.py``) run on a CUDA mesh (``cpu:gloo,cuda:nccl``) with TE 2.20.2's FusedAdam,
BF16/FP16/FP8 moments, int16 remainders and FP32 masters, every file compared with TE's own export
at the save point; and a model large enough that the whole FP32 export exceeds the memory bounds
checks them:

- streaming save (``PlacedOptimizerState(save="streaming")`` + ``StreamingWriter``): 0 extra GPU
  bytes; host RSS growth at most 1 GiB + (writer threads + 1) x 4 x M (M: largest local state);
- raw-snapshot async save (``StreamingWriter`` staging with ``SnapshotStager``): 0 extra GPU bytes;
  host RSS growth at most raw bytes + 1 GiB + (writer threads + 1) x 4 x M; training during the
  write does not change the files;
- on one GPU, the process-based async save (``AsyncCheckpointerType.PROCESS``, the way NeMo
  Automodel and torchtitan's pinned-memory mode save) and the thread-based one, staged by one
  ``SnapshotStager`` into pinned shared memory (``cudaHostRegister`` on the shared mapping), the
  writer process converting as it writes: the files hold TE's export at the save point.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

WORLD = 2


def _worker(rank: int, port: int, root: str) -> None:
    import gc

    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    from .support import dcp_save_checks as checks
    from .support.backends import CUDA
    from .support.distributed import init_gpu_rank

    init_gpu_rank(rank, port, timeout_s=600)
    backend = CUDA
    mesh = init_device_mesh("cuda", (WORLD,))
    # Async saves run their collectives in a background thread, on groups of their own.
    pgs = (dist.new_group(backend="gloo"), dist.new_group(backend="gloo"))
    base = Path(root)
    bf16, fp16, fp8 = torch.bfloat16, torch.float16, torch.uint8
    modes = [(bf16, "remainder"), (fp16, "fp32"), (fp8, "fp32"), (bf16, "fp32")]
    try:
        # Every writer configuration for one mode, one for the others (the CPU test has all).
        checks.check_streaming_save(backend, mesh, base, modes[:1])
        checks.check_streaming_save(backend, mesh, base / "more", modes[1:], ((2, True),))
        checks.check_stock_writers(backend, mesh, base)
        checks.check_snapshot_async(backend, mesh, pgs, base, modes[:3], saves=2)
        checks.check_resharding(backend, mesh, pgs[0], base)
        checks.check_failed_save(backend, mesh, base)
        checks.check_memory_bounds(backend, mesh, pgs[0], base, dims=(8192,) * 9)
        gc.collect()
        torch.cuda.synchronize()
    finally:
        dist.destroy_process_group()


@pytest.mark.multigpu
def test_dcp_save_with_te_on_two_gpus(tmp_path: Path) -> None:
    from .support.distributed import spawn

    spawn(_worker, str(tmp_path))
    for ckpt in ("streaming0_2_0", "more/streaming2_2_1", "snapshot2_1", "reshard_async"):
        assert (tmp_path / ckpt / ".metadata").is_file(), f"{ckpt}: no checkpoint"


def _process_worker(rank: int, port: int, root: str) -> None:
    import torch.distributed as dist
    from torch.distributed.checkpoint.state_dict_saver import AsyncCheckpointerType
    from torch.distributed.device_mesh import init_device_mesh

    from .support import dcp_save_checks as checks
    from .support.backends import CUDA
    from .support.distributed import init_gpu_rank

    init_gpu_rank(rank, port, timeout_s=600, world_size=1)
    mesh = init_device_mesh("cuda", (1,))
    pg = dist.new_group(backend="gloo")
    bf16, fp16, fp8 = torch.bfloat16, torch.float16, torch.uint8
    modes = [(bf16, "remainder"), (fp16, "fp32"), (fp8, "fp32"), (bf16, "fp32")]
    try:
        for kind in (AsyncCheckpointerType.PROCESS, AsyncCheckpointerType.THREAD):
            (Path(root) / kind.value).mkdir()
            checks.check_process_async(CUDA, mesh, pg, Path(root) / kind.value, modes, kind=kind)
        torch.cuda.synchronize()
    finally:
        dist.destroy_process_group()


@pytest.mark.gpu
def test_process_async_snapshot_save_with_te_on_one_gpu(tmp_path: Path) -> None:
    from .support.distributed import spawn

    spawn(_process_worker, str(tmp_path), nprocs=1)
    for kind in ("process", "thread"):
        saved = sorted(p.name for p in (tmp_path / kind).glob("process*") if p.is_dir())
        assert len(saved) == 8, f"{kind}: {saved}"  # 4 modes x 2 saves
