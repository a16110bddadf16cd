"""Process groups, sharded models and global comparisons for the multi-rank tests.

``spawn`` starts 2 ranks (``nprocs=4`` for the 2-D mesh tests); ``init_gloo_mesh`` gives a CPU
rank its gloo mesh with the stand-in hooked, ``init_gpu_rank`` a GPU rank its
``cpu:gloo,cuda:nccl`` group with TE hooked; both join the group through ``init_group``. The
other helpers work on any mesh.
"""

from __future__ import annotations

import datetime
import math
import socket
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.tensor import DTensor, distribute_tensor

from te_ckpt_placement import _te_hooks as te_hooks

from .helpers import snapshot
from .standin import StandInFusedAdam

WORLD = 2


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _exit_after(rank: int, worker: Callable[..., None], *args: Any) -> None:
    """``worker(rank, *args)``, then the rank's process ends without Python's finalization.

    A gloo thread may still be releasing the last collective's work when a rank returns, and
    that takes the GIL (the work holds tensors with Python objects); during finalization a
    thread that takes the GIL is unwound through a noexcept destructor and the rank aborts
    ("terminate called without an active exception", seen in CI and in core dumps here, also
    before the host workers' team existed). What a rank reports is written before it returns; a
    rank that raises is reported by ``mp.spawn`` as before.
    """
    import os
    import sys

    worker(rank, *args)
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def spawn(worker: Callable[..., None], *args: Any, nprocs: int = WORLD) -> None:
    """Runs ``worker(rank, port, *args)`` on ``nprocs`` ranks; a failing rank's exception is
    re-raised."""
    import torch.multiprocessing as mp

    mp.spawn(_exit_after, args=(worker, free_port(), *args), nprocs=nprocs, join=True)


# The GPU tests' default group: NCCL for CUDA tensors, and gloo for CPU tensors, which
# dcp.async_save's collectives and the host-side object collectives need.
GPU_BACKEND = "cpu:gloo,cuda:nccl"


def spawn_collecting(phase: Callable[..., None], world: int, *args: Any) -> dict[Any, Any]:
    """Runs ``phase(rank, port, world, *args, results)`` on ``world`` fresh ranks; returns what
    the ranks put in ``results`` (a managed dict)."""
    import torch.multiprocessing as mp

    with mp.Manager() as manager:
        shared = manager.dict()
        mp.spawn(
            _exit_after, args=(phase, free_port(), world, *args, shared), nprocs=world, join=True
        )
        return dict(shared)


def init_group(
    rank: int, port: int, *, backend: str, timeout_s: float, world_size: int = WORLD
) -> None:
    """Joins this rank to the default process group of ``world_size`` ranks, rendezvous on
    ``port`` of this host."""
    dist.init_process_group(
        backend,
        rank=rank,
        world_size=world_size,
        init_method=f"tcp://127.0.0.1:{port}",
        timeout=datetime.timedelta(seconds=timeout_s),
    )


def init_gloo_mesh(rank: int, port: int, timeout_s: float = 120) -> DeviceMesh:
    """This rank's 2-rank gloo group and CPU mesh, with the stand-in hooked like TE's class."""
    init_group(rank, port, backend="gloo", timeout_s=timeout_s)
    te_hooks.patch_class(StandInFusedAdam)
    return init_device_mesh("cpu", (WORLD,))


def init_gpu_rank(rank: int, port: int, *, timeout_s: float = 300, world_size: int = WORLD) -> None:
    """A GPU test's rank: GPU ``rank`` current, the :data:`GPU_BACKEND` group of ``world_size``
    ranks, and TE's FusedAdam hooked (``install``, which imports TE)."""
    torch.cuda.set_device(rank)
    init_group(rank, port, backend=GPU_BACKEND, timeout_s=timeout_s, world_size=world_size)
    te_hooks.install()


# --- models and training ------------------------------------------------------------------------
def param_dtype(master: str) -> torch.dtype:
    """BF16 params where TE keeps int16 master remainders (it needs them), FP32 otherwise."""
    return torch.bfloat16 if master == "remainder" else torch.float32


def fully_sharded(mesh: DeviceMesh, dtype: torch.dtype, seed: int) -> torch.nn.Module:
    from torch.distributed.fsdp import fully_shard

    torch.manual_seed(seed)
    # Linear(3, 5): weight (5, 3) and bias (5,) shard unevenly (3 + 2 rows) on 2 ranks.
    model = torch.nn.Sequential(torch.nn.Linear(3, 5), torch.nn.Linear(5, 4)).to(dtype)
    fully_shard(model, mesh=mesh)
    return model


def column_sharded(
    mesh: DeviceMesh | None, dtype: torch.dtype, seed: int, device: str = "cpu"
) -> torch.nn.Module:
    """``Linear(4, 6), Linear(6, 4)`` with each weight ``fully_shard``'ed along its columns.

    On 2 ranks the weights (6, 4) and (4, 6) hold 2 and 3 columns each (``Shard(1)``: FSDP2
    shards a later dimension only evenly), the biases their rows (``Shard(0)``). Without a mesh
    the same model, plain, on ``device``.
    """
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor import Shard

    torch.manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(4, 6), torch.nn.Linear(6, 4)).to(dtype)
    if mesh is None:
        return model.to(device)
    fully_shard(model, mesh=mesh, shard_placement_fn=lambda p: Shard(1 if p.dim() == 2 else 0))
    return model


def ordered_params(opt: torch.optim.Optimizer) -> list[torch.Tensor]:
    return [p for group in opt.param_groups for p in group["params"]]


def train_global(opt: torch.optim.Optimizer, steps: int, seed: int) -> None:
    """Like ``standin.train``, but each gradient is drawn as a global tensor and then sharded.

    ``standin.train`` draws each rank's local gradient from one generator stream, so once an
    uneven shard has advanced the streams differently, a Replicate() parameter gets different
    gradients (and so different values and states) on each rank. DCP saves a replicated tensor
    from one rank only, so the round trip needs parameters that really are replicated.
    """
    gen = torch.Generator().manual_seed(seed)
    for _ in range(steps):
        for p in ordered_params(opt):
            assert isinstance(p, DTensor), "global gradients are for DTensor parameters"
            g = torch.randn(p.shape, generator=gen) * math.exp(
                float(torch.randn(1, generator=gen)) * 3
            )
            p.grad = distribute_tensor(
                g.to(p.dtype), p.device_mesh, p.placements, src_data_rank=None
            )
        opt.step()


# --- comparisons --------------------------------------------------------------------------------
def by_position(opt: torch.optim.Optimizer) -> dict[int, dict[str, torch.Tensor]]:
    """The live states keyed by parameter position, so twin optimizers compare."""
    snap = snapshot(opt)
    return {i: snap[p] for i, p in enumerate(ordered_params(opt)) if p in snap}


def hyperparams(opt: torch.optim.Optimizer) -> list[dict[str, Any]]:
    return [{k: v for k, v in g.items() if k != "params"} for g in opt.param_groups]


def gather(state: DTensor) -> torch.Tensor:
    """The global tensor (a collective); gloo and NCCL cannot all-gather int16, so remainders
    travel widened."""
    if state.dtype != torch.int16:
        return state.full_tensor()
    widened = DTensor.from_local(
        state._local_tensor.to(torch.int32),
        state.device_mesh,
        state.placements,
        shape=state.size(),
        stride=state.stride(),
    )
    return widened.full_tensor().to(torch.int16)


def assert_same_full(ours: dict[str, Any], ref: dict[str, Any], where: str) -> None:
    """Two gathered (global) state dicts of bits and plain values are the same."""
    assert ours.keys() == ref.keys(), f"{where}: keys {sorted(ours.keys() ^ ref.keys())}"
    for key, value in ref.items():
        if isinstance(value, torch.Tensor):
            assert torch.equal(ours[key], value), f"{where}: {key} differs"
        else:
            assert ours[key] == value, f"{where}: {key}: {ours[key]!r} != {value!r}"
