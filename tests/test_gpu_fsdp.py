"""FSDP2 on 2 GPUs with real TE FusedAdam: CPU-local DTensor exports, bit-exact, zero GPU bytes.

Set ``TE_CKPT_RESULTS=/path/file.json`` to also write the measured figures as benchmark records.
"""

from __future__ import annotations

import functools
import json
import os
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from .support.distributed import free_port

pytestmark = pytest.mark.multigpu

WORLD = 2


def build(moments: torch.dtype, seed: int) -> tuple[torch.nn.Module, Any]:
    from torch.distributed.fsdp import fully_shard
    from transformer_engine.pytorch.optimizers import FusedAdam

    torch.manual_seed(seed)
    # 2047 rows shard unevenly (1024/1023). No shard is empty: TE cannot keep scaled (FP16/FP8)
    # states of an empty shard (aminmax on an empty tensor, fused_adam.py L298).
    model = torch.nn.Sequential(
        torch.nn.Linear(1024, 2047),
        torch.nn.GELU(),
        torch.nn.Linear(2047, 1000),
        torch.nn.GELU(),
        torch.nn.Linear(1000, 2),
    ).to(device="cuda", dtype=torch.bfloat16)
    for layer in model:
        if isinstance(layer, torch.nn.Linear):
            fully_shard(layer)
    fully_shard(model)
    from tests.support.storage import storage_kwargs

    master = "remainder" if moments == torch.bfloat16 else "fp32"
    opt = FusedAdam(model.parameters(), lr=1e-3, **storage_kwargs(moments=moments, master=master))
    for _ in range(3):
        x = torch.randn(64, 1024, device="cuda", dtype=torch.bfloat16)
        model(x).float().pow(2).mean().backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        del x
    torch.cuda.synchronize()
    return model, opt


def worker(rank: int, port: int, results_path: str | None) -> None:
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_optimizer_state_dict
    from torch.distributed.tensor import DTensor

    from te_ckpt_placement import export_placement, install
    from tests.support.helpers import assert_owns_storage, assert_same_export, peak_extra

    torch.cuda.set_device(rank)
    dist.init_process_group(
        "nccl", rank=rank, world_size=WORLD, init_method=f"tcp://127.0.0.1:{port}"
    )
    install()
    records = []
    try:
        cases = ((torch.bfloat16, "bf16"), (torch.float16, "fp16"), (torch.uint8, "fp8"))
        for moments, label in cases:
            model, opt = build(moments, seed=rank)
            params = list(model.parameters())
            local_n = sum(p._local_tensor.numel() for p in params)
            local_m = max(p._local_tensor.numel() for p in params)

            with export_placement("cpu"):
                ours, ours_extra = peak_extra(opt.state_dict)
            assert ours_extra == 0, f"{label}: export allocated {ours_extra} GPU bytes"
            ref = opt.state_dict()  # TE's own export, outside any policy
            assert_same_export(ours, ref)
            for index, states in ours["state"].items():
                param = params[index]
                for name, value in states.items():
                    assert isinstance(value, DTensor), name
                    assert value._local_tensor.device.type == "cpu"
                    assert value.device_mesh == param.device_mesh
                    assert value.device_mesh.device_type == "cuda"
                    assert tuple(value.placements) == tuple(param.placements)
                    assert value.shape == param.shape and value.stride() == param.stride()
                    assert_owns_storage(value)
            del ref, ours

            options = StateDictOptions(cpu_offload=True, flatten_optimizer_state_dict=True)
            export = functools.partial(get_optimizer_state_dict, model, opt, options=options)
            sd, te_extra = peak_extra(export)
            del sd
            with export_placement("cpu"):
                sd, dcp_extra = peak_extra(export)
            assert dcp_extra == 0, f"{label}: DCP export under the policy allocated {dcp_extra}"
            assert all(
                v._local_tensor.device.type == "cpu" for v in sd.values() if isinstance(v, DTensor)
            )
            assert te_extra >= 8 * local_n, (te_extra, local_n)
            del sd
            measured = (("te_default_dcp_cpu_offload", te_extra), ("placement_cpu", dcp_extra))
            for mode, extra in measured:
                records.append(
                    {
                        "op": "export",
                        "mode": mode,
                        "moments": label,
                        "n_elements": local_n,
                        "max_elements": local_m,
                        "peak_extra_gpu_bytes": extra,
                        "gpu_bytes_per_n": extra / local_n,
                        "rank": rank,
                        "world_size": WORLD,
                        "parallelism": "fsdp2",
                    }
                )
            del model, opt, export
            torch.cuda.empty_cache()
        if results_path is not None:
            Path(f"{results_path}.rank{rank}").write_text(json.dumps(records))
    finally:
        dist.destroy_process_group()


def test_fsdp2_export_is_cpu_local_dtensor_bit_exact_zero_gpu(tmp_path: Path) -> None:
    results = os.environ.get("TE_CKPT_RESULTS")
    mp.spawn(worker, args=(free_port(), results), nprocs=WORLD, join=True)
    if results:
        records: list[dict[str, Any]] = []
        for rank in range(WORLD):
            records += json.loads(Path(f"{results}.rank{rank}").read_text())
        from benchmarks._measure import machine

        out = {"machine": machine(), "records": records}
        Path(results).write_text(json.dumps(out, indent=1) + "\n")
