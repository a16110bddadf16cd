"""``StreamingLoadPlanner`` with real TE FusedAdam under FSDP2 on 2 GPUs.

1. test_dcp_load's 2-rank checks (``tests/support/dcp_load_checks.py``) on a CUDA mesh
   (``cpu:gloo,cuda:nccl``) with TE, FP8 moments too: every streaming load equals the template
   path and TE's own load, training continues as uninterrupted, resharding 2 -> 1 and 1 -> 2 and
   a checkpoint written from a full state dict load; a streaming load adds 0 GPU bytes where
   every state is BF16, FP32 or int16 (FP16/FP8 states go through TE's ``set_scaled_state``,
   which scales on the GPU).
2. The bounds at a size where they discriminate: 16 bf16 ``Linear(4096, 4096)`` layers (134 M
   local elements per rank, M = 8.4 M), BF16 moments with int16 master remainders. The streaming
   load equals TE's DCP load bit for bit (and the saved state), adds 0 GPU bytes and at most
   1 GiB + 4 M host bytes (RSS peak), where the template path's host template alone is 10 B per
   local element (1.34 GB). With ``TE_CKPT_LOAD_RESULTS=FILE`` the measured bytes go to FILE.
"""

from __future__ import annotations

import gc
import json
import os
import warnings
from pathlib import Path
from typing import Any

import pytest
import torch

pytestmark = pytest.mark.multigpu

WORLD = 2


def _init(rank: int, port: int) -> None:
    from .support.distributed import init_gpu_rank

    init_gpu_rank(rank, port, timeout_s=300)
    warnings.filterwarnings("ignore", "torch.distributed is disabled", UserWarning)


def _checks_worker(rank: int, port: int, root: str) -> None:
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    from .support.backends import CUDA
    from .support.dcp_load_checks import run_streaming_checks

    _init(rank, port)
    try:
        # FP8 states of DTensors too: the CPU stand-in keeps FP8 of plain tensors only.
        run_streaming_checks(
            CUDA,
            init_device_mesh("cuda", (WORLD,)),
            Path(root),
            extra_cases=((torch.uint8, "fp32"), (torch.uint8, "remainder")),
        )
        torch.cuda.synchronize()
    finally:
        dist.destroy_process_group()


def test_streaming_load_checks_with_te_on_two_gpus(tmp_path: Path) -> None:
    from .support.distributed import spawn

    spawn(_checks_worker, str(tmp_path))
    for ckpt in ("reshard/one_to_two", "full_state_dict"):
        assert (tmp_path / ckpt / ".metadata").is_file(), f"{ckpt}: no checkpoint"


LAYERS, HIDDEN = 16, 4096


def _bounds_worker(rank: int, port: int, root: str, results: str | None) -> None:
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_model_state_dict, set_model_state_dict

    from benchmarks.dcp_e2e import build, fingerprint, local, train_step
    from benchmarks.export_memory import HostPeak, rss
    from te_ckpt_placement.dcp import PlacedOptimizerState, StreamingLoadPlanner, load_planner

    _init(rank, port)
    try:
        model, opt = build(LAYERS, HIDDEN, torch.bfloat16, seed=0)  # int16 remainders
        n_local = sum(local(p).numel() for p in model.parameters())
        m_local = max(local(p).numel() for p in model.parameters())
        path = str(Path(root) / "bounds")
        state = {"model": get_model_state_dict(model), "optim": PlacedOptimizerState(model, opt)}
        dcp.save(state, checkpoint_id=path)
        saved = fingerprint(model, opt)
        measured: dict[str, dict[str, Any]] = {}
        for mode in ("te_default", "streaming", "placement_cpu_template"):
            train_step(model, opt, HIDDEN)  # the load has to undo this step
            del state
            gc.collect()
            torch.cuda.synchronize()
            gpu_base = torch.cuda.memory_allocated()
            torch.cuda.reset_peak_memory_stats()
            host_base = rss()
            with HostPeak() as host:
                placement = None if mode == "te_default" else "cpu"
                adapter = PlacedOptimizerState(model, opt, placement=placement)
                state = {"model": get_model_state_dict(model), "optim": adapter}
                if mode == "streaming":
                    planner = StreamingLoadPlanner(adapter)
                    dcp.load(state, checkpoint_id=path, planner=planner)
                else:
                    dcp.load(state, checkpoint_id=path)
                set_model_state_dict(model, state["model"])
                torch.cuda.synchronize()
            measured[mode] = {
                "peak_extra_gpu_bytes": torch.cuda.max_memory_allocated() - gpu_base,
                "peak_extra_host_bytes": host.peak - host_base,
            }
            got = fingerprint(model, opt)
            assert got.keys() == saved.keys(), mode
            for key, value in saved.items():  # BF16 + remainders: every load restores the bits
                same = (
                    torch.equal(got[key], value)
                    if isinstance(value, torch.Tensor)
                    else (got[key] == value)
                )
                assert same, f"rank {rank} {mode}: {key} differs from the saved state"
        ours = measured["streaming"]
        where = f"rank {rank}: {measured} (N={n_local}, M={m_local})"
        assert ours["peak_extra_gpu_bytes"] == 0, where
        assert ours["peak_extra_host_bytes"] <= 2**30 + 4 * m_local, where
        assert planner.peak_assembly_bytes == 0, where  # BF16/int16: straight into the live states
        # The elementwise items went through the pinned upload ring, within its bound.
        stats = planner.stats
        assert stats["ring_items"] > 0 and stats["ring_bytes"] > 0, f"{where} {stats}"
        assert 0 < stats["ring_host_bytes"] <= load_planner.UPLOAD_RING_BYTES, f"{where} {stats}"
        assert planner._rings == {}, where  # closed (synchronized) at the load's end
        ours["load_stats"] = stats
        # The template path holds the host template (10 B/N here): the bound discriminates.
        assert measured["placement_cpu_template"]["peak_extra_host_bytes"] > 2**30 + 4 * m_local
        if results is not None:
            records = [
                {"mode": mode, "rank": rank, "n_elements": n_local, "max_elements": m_local,
                 "layers": LAYERS, "hidden": HIDDEN, **values}
                for mode, values in measured.items()
            ]  # fmt: skip
            Path(f"{results}.rank{rank}").write_text(json.dumps(records))
    finally:
        dist.destroy_process_group()


def test_streaming_load_bounds_on_two_gpus(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from .support.distributed import spawn

    # glibc serves allocations under its (growing) mmap threshold from a heap it keeps after
    # free, so a later mode's RSS would not grow for memory an earlier mode freed. A fixed low
    # threshold maps every buffer DCP or a template allocates on its own: RSS then counts live
    # memory, for each mode alike (the spawned ranks read it at start-up).
    monkeypatch.setenv("MALLOC_MMAP_THRESHOLD_", str(64 << 10))
    results = os.environ.get("TE_CKPT_LOAD_RESULTS")
    spawn(_bounds_worker, str(tmp_path), results)
    if results:
        from benchmarks.export_memory import machine

        records: list[dict[str, Any]] = []
        for rank in range(WORLD):
            records += json.loads(Path(f"{results}.rank{rank}").read_text())
        Path(results).write_text(json.dumps({"machine": machine(), "records": records}, indent=1))
