"""``StreamingLoadPlanner`` with real TE FusedAdam under FSDP2 on 2 GPUs, and into a fresh one on 1.

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
3. Into a fresh optimizer (the planner makes TE's initial states first) on 1 GPU, FSDP2 over a
   1-rank group, FP8 and FP16 moments with FP32 masters, 4 bf16 ``Linear(4096, 4096)`` layers
   (67 M local elements, M = 16.8 M), through ``benchmarks/fresh_load_memory.py``'s
   ``measure``: equal to TE's own load bit for bit, and at most 8 x M + 1 MiB GPU bytes above
   what the load leaves allocated (the states, scales and TE's FP8 transposes); of that, making
   the initial states at most 5 x M + 1 MiB with FP8 states (TE's initialization of one) and
   1 MiB otherwise, the reads and writes at most 4 x M + 1 MiB. With
   ``TE_CKPT_FRESH_LOAD_RESULTS=FILE`` the records go to FILE.
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


@pytest.mark.multigpu
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

    from benchmarks._measure import HostPeak, rss
    from benchmarks.dcp_e2e import build, fingerprint, local, train_step
    from te_ckpt_placement.dcp import PlacedOptimizerState, StreamingLoadPlanner
    from te_ckpt_placement.dcp import _load_planner as load_planner

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
        stats = planner.report.details
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


@pytest.mark.multigpu
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
        from benchmarks._measure import machine

        records: list[dict[str, Any]] = []
        for rank in range(WORLD):
            records += json.loads(Path(f"{results}.rank{rank}").read_text())
        Path(results).write_text(json.dumps({"machine": machine(), "records": records}, indent=1))


FRESH_LAYERS, FRESH_HIDDEN = 4, 4096


@pytest.mark.gpu
def test_fresh_optimizer_streaming_load_bounds_on_one_gpu(tmp_path: Path) -> None:
    from benchmarks import fresh_load_memory as bench

    with bench.one_rank_group(smoke=False):
        records = [bench.measure(m, FRESH_LAYERS, FRESH_HIDDEN, tmp_path) for m in ("fp8", "fp16")]
    results = os.environ.get("TE_CKPT_FRESH_LOAD_RESULTS")
    if results:
        from benchmarks._measure import machine

        Path(results).write_text(json.dumps({"machine": machine(), "records": records}, indent=1))
    for record in records:
        m, where = record["max_elements"], json.dumps(record)
        assert m == FRESH_HIDDEN**2 and record["equal_to_te_load"] is True, where
        # Above everything the load leaves allocated: the documented bound, fresh or not.
        assert record["peak_extra_gpu_bytes"] <= 8 * m + 2**20, where
        # Making the initial states: TE's _initialize_state of an FP8 state holds its uint8
        # zeros and their FP32 copy (5 B per element); FP32 masters are copied from the params
        # in place (TE's initialize_state would first hold 6 B per element of a BF16 one).
        init = 5 * m if record["moments"] == "fp8" else 0
        assert record["init_peak_extra_gpu_bytes"] <= init + 2**20, where
        # Then one FP32 copy of one FP16/FP8 state at a time, which TE scales.
        assert record["read_peak_extra_gpu_bytes"] <= 4 * m + 2**20, where
        assert record["peak_assembly_bytes"] == 4 * m, where
