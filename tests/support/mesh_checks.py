"""The 2-D device mesh checks of test_dcp_mesh.py (4 ranks, 2 x 2 meshes), run on a backend.

``tests/test_dcp_mesh.py`` runs them with the CPU stand-in on gloo, ``tests/test_gpu_dcp_mesh.py``
with TE's FusedAdam on 4 GPUs. The shape of the reported run, FSDP2 with expert parallelism, in two
layouts of a 2 x 2 mesh:

- ``hsdp``: ``fully_shard`` on a (dp_replicate, dp_shard) mesh: every parameter
  (Replicate(), Shard(0));
- ``moe``: a DeepSeek-style MoE block on a (dp_shard, ep) mesh, distributed by hand as FSDP2 with
  expert parallelism places it: the router and the shared expert are dense, sharded over dp_shard
  and replicated over ep (Shard(0), Replicate()); the norm is sharded over all 4 ranks
  (Shard(0), Shard(0)); the routed experts are sharded over ep along the expert dimension and
  replicated over dp_shard (Replicate(), Shard(0)), or sharded there along their hidden dimension
  (Shard(1), Shard(0)).

Shards are uneven (3 experts on 2 ep ranks, 5 rows on 2 dp_shard ranks). With ``empty=True`` one
more parameter leaves some ranks an empty local shard; FP16/FP8 modes go without it, since TE
cannot scale an empty state (the absmax, fused_adam.py L298).

1. Exports under the policy equal TE's export (mesh, placements, global shape and stride kept;
   every state on the CPU), and lazy exports have the same metadata.
2. A streaming save, a plain save (the export under the policy) and TE's save each load through
   the template path and through ``StreamingLoadPlanner``, equal to TE's load of the same
   checkpoint and, where loads are exact (all but FP16/FP8), to the saved optimizer; three more
   steps then equal the uninterrupted run.
3. Resharding 4 -> 2 -> 1 -> 2 -> 4 (a 2-D mesh on ranks 0 and 1; one process with no group),
   each stage saved another way and loaded through the planner and the template path, equal to
   the saved run's global values; training continued on 1 rank and on 4 equals the
   uninterrupted run.
"""

from __future__ import annotations

import itertools
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.state_dict import get_model_state_dict
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.tensor import DTensor, Placement, Replicate, Shard, distribute_tensor

from te_ckpt_placement import export_placement
from te_ckpt_placement.dcp import StreamingWriter, lazy_optimizer_state_dict

from .backends import Backend
from .dcp_load_checks import (
    WHOLE,
    load_streaming,
    load_template_path,
    whole_state_elements,
)
from .dcp_runs import FLAT, Run, assert_all_on_cpu, assert_exports, assert_same_run
from .dcp_save_checks import assert_lazy_like
from .distributed import assert_same_full, param_dtype
from .helpers import assert_same_export, local

WORLD = 4
SHAPE = (2, 2)
DIM_NAMES = {"hsdp": ("dp_replicate", "dp_shard"), "moe": ("dp_shard", "ep")}
LAYOUTS = tuple(DIM_NAMES)
#: The ranks of the 2 x 2 mesh whose local shard of the ``empty=True`` parameter is empty.
EMPTY_RANKS = {"hsdp": {1, 3}, "moe": {3}}

R, S0, S1 = Replicate(), Shard(0), Shard(1)
#: The MoE block's parameters: global shape and placements over (dp_shard, ep).
MOE_PARAMS: dict[str, tuple[tuple[int, ...], tuple[Placement, ...]]] = {
    "norm.weight": ((4,), (S0, S0)),  # every rank: 1 element each
    "router.weight": ((3, 4), (S0, R)),  # 3 experts x dim 4: 2 + 1 rows over dp_shard
    "shared.w_in": ((5, 4), (S0, R)),  # 3 + 2 rows
    "shared.w_out": ((4, 5), (S0, R)),
    "experts.w_in": ((3, 5, 4), (S1, S0)),  # 2 + 1 experts over ep, 3 + 2 hidden over dp_shard
    "experts.w_out": ((3, 4, 5), (R, S0)),
}
#: With ``empty=True``: the router's per-expert bias, 3 elements on 4 ranks (rank 3 holds none).
MOE_EMPTY = {"router.bias": ((3,), (S0, S0))}


def rank() -> int:
    return dist.get_rank() if dist.is_initialized() else 0


#: The 2-rank mesh (ranks 0 and 1) of the resharding checks: HSDP as 2 replicas of whole
#: tensors; the MoE block with its experts on 2 ep ranks (dp_shard 1).
TWO = {"hsdp": (2, 1), "moe": (1, 2)}


class Meshes:
    """A layout's 2 x 2 mesh of the 4 ranks, and its :data:`TWO` mesh on ranks 0 and 1 that the
    resharding checks load into (None on ranks 2 and 3). Collective: every rank makes it."""

    def __init__(self, device: str, layout: str) -> None:
        names = DIM_NAMES[layout]
        self.layout = layout
        self.four = init_device_mesh(device, SHAPE, mesh_dim_names=names)
        self.pair = dist.new_group([0, 1])
        singles = [dist.new_group([r]) for r in range(WORLD)]  # new_group is collective
        self.two: DeviceMesh | None = None
        if rank() < 2:
            single = singles[rank()]
            paired = TWO[layout][0] == 2
            self.two = DeviceMesh.from_group(
                [self.pair, single] if paired else [single, self.pair],
                device,
                mesh=torch.tensor([0, 1]).reshape(TWO[layout]),
                mesh_dim_names=names,
            )


def _moe(
    device: str, mesh: DeviceMesh | None, dtype: torch.dtype, seed: int, empty: bool
) -> torch.nn.Module:
    """The MoE block: its parameters distributed on ``mesh`` (plain tensors without one)."""
    gen = torch.Generator().manual_seed(seed)  # the same global values on every rank
    model = torch.nn.Module()
    for fqn, (shape, placements) in {**MOE_PARAMS, **(MOE_EMPTY if empty else {})}.items():
        value = torch.randn(shape, generator=gen).to(dtype)
        if mesh is None:
            value = value.to(device)
        else:
            value = distribute_tensor(value, mesh, placements, src_data_rank=None)
        module_name, name = fqn.split(".")
        if not hasattr(model, module_name):
            model.add_module(module_name, torch.nn.Module())
        getattr(model, module_name).register_parameter(name, torch.nn.Parameter(value))
    return model


def _hsdp(
    device: str, mesh: DeviceMesh | None, dtype: torch.dtype, seed: int, empty: bool
) -> torch.nn.Module:
    """``Linear(3, 5), Linear(5, 4)`` (and ``Linear(4, 1)``, empty on one dp_shard rank), with
    ``fully_shard`` on the (dp_replicate, dp_shard) mesh."""
    from torch.distributed.fsdp import fully_shard

    torch.manual_seed(seed)
    dims = (3, 5, 4, 1) if empty else (3, 5, 4)
    layers = [torch.nn.Linear(a, b) for a, b in itertools.pairwise(dims)]
    model = torch.nn.Sequential(*layers).to(dtype)
    if mesh is None:
        return model.to(device)
    fully_shard(model, mesh=mesh)  # on the mesh's device
    return model


class MeshRun(Run):
    """A :class:`~.dcp_runs.Run` of a 2-D layout: the model on ``mesh`` (plain without one), the
    routed experts (for ``hsdp``: every layer but the first) in a parameter group of their own,
    lr 3e-3."""

    def __init__(
        self,
        backend: Backend,
        mesh: DeviceMesh | None,
        layout: str,
        moments: torch.dtype,
        master: str,
        seed: int,
        *,
        empty: bool,
    ) -> None:
        if layout not in DIM_NAMES:
            raise ValueError(f"layout={layout!r}: valid values are {LAYOUTS}")
        self.backend, self.moments, self.master = backend, moments, master
        self.layout, self.empty = layout, empty
        build = _moe if layout == "moe" else _hsdp
        self.model = build(backend.device, mesh, param_dtype(master), seed, empty)
        second = "experts." if layout == "moe" else ("1.", "2.")
        named = list(self.model.named_parameters())
        groups = [
            {"params": [p for n, p in named if not n.startswith(second)]},
            {"params": [p for n, p in named if n.startswith(second)], "lr": 3e-3},
        ]
        self.opt = backend.make_optimizer(groups, moments=moments, master=master)


def assert_layout(run: MeshRun, where: str) -> None:
    """The run has the placements, uneven shards and empty shards it is meant to have."""
    params = [p for p in run.params() if isinstance(p, DTensor)]
    assert len(params) == len(run.params()), f"{where}: not every parameter is a DTensor"
    placements = {tuple(p.placements) for p in params}
    expected = (
        {placements for _, placements in MOE_PARAMS.values()} if run.layout == "moe" else {(R, S0)}
    )
    assert placements == expected, f"{where}: placements {placements}"
    assert all(p.device_mesh.ndim == 2 for p in params), f"{where}: not a 2-D mesh"
    empties = [p for p in params if local(p).numel() == 0]
    assert bool(empties) == (run.empty and rank() in EMPTY_RANKS[run.layout]), (
        f"{where}: {len(empties)} empty local shards"
    )
    uneven = [
        p
        for p in params
        for i, placement in enumerate(p.placements)
        if isinstance(placement, Shard) and p.shape[placement.dim] % p.device_mesh.size(i)
    ]
    assert uneven, f"{where}: no parameter shards unevenly"


# --- 1. exports ---------------------------------------------------------------------------------
def check_exports(run: MeshRun, where: str) -> None:
    """The policy's export equals TE's, and every state keeps its parameter's DTensor metadata."""
    ours = run.export()
    assert_exports(ours, where)
    assert_all_on_cpu(ours, where)
    assert_same_export(ours, run.export(placement=None), f"{where}: vs TE")
    params = dict(run.model.named_parameters())
    n = 0
    for key, state in ours.items():
        if not key.startswith("state."):
            continue
        fqn = key[len("state.") :].rsplit(".", 1)[0]
        param = params[fqn]
        label = f"{where} {key}"
        assert isinstance(state, DTensor) and isinstance(param, DTensor), f"{label}: not a DTensor"
        assert state.device_mesh == param.device_mesh, f"{label}: mesh"
        assert tuple(state.placements) == tuple(param.placements), f"{label}: placements"
        assert state.size() == param.size() and state.stride() == param.stride(), label
        assert local(state).shape == local(param).shape, f"{label}: local shape"
        n += 1
    assert n == len(params) * (2 if run.master == "none" else 3), f"{where}: {n} states"
    assert_lazy_like(lazy_optimizer_state_dict(run.model, run.opt, options=FLAT), ours, where)


# --- 2. three saves, two loads each -------------------------------------------------------------
def save_streaming(run: Run, path: Path, **kwargs: Any) -> None:
    """``PlacedOptimizerState(save="streaming")`` through ``StreamingWriter``."""
    state = {"model": get_model_state_dict(run.model), "optim": run.state(save="streaming")}
    dcp.save(state, storage_writer=StreamingWriter(path), **kwargs)


def save_plain(run: Run, path: Path, **kwargs: Any) -> None:
    """``PlacedOptimizerState``: the export under the policy."""
    state = {"model": get_model_state_dict(run.model), "optim": run.state()}
    dcp.save(state, checkpoint_id=str(path), **kwargs)


def save_te(run: Run, path: Path, **kwargs: Any) -> None:
    """TE's own export, no policy anywhere."""
    with export_placement(None):
        state = {"model": get_model_state_dict(run.model), "optim": run.export(placement=None)}
        dcp.save(state, checkpoint_id=str(path), **kwargs)


SAVES = {"streaming": save_streaming, "plain": save_plain, "te": save_te}


def check_saves_and_loads(
    backend: Backend,
    mesh: DeviceMesh,
    layout: str,
    moments: torch.dtype,
    master: str,
    root: Path,
) -> None:
    """One trained run saved three ways, each checkpoint loaded three ways (template path,
    planner, TE's load), then training on; FP16/FP8 modes without empty shards."""
    # TE scales FP16/FP8 states by their absmax: an empty state has none, and every load
    # re-derives the scales, so the loads equal TE's load but not the saved optimizer.
    empty = exact = moments not in WHOLE
    where = f"rank {rank()} {layout} {moments} {master}"

    def fresh(seed: int) -> MeshRun:
        return MeshRun(backend, mesh, layout, moments, master, seed, empty=empty)

    run = fresh(seed=1)
    assert_layout(run, where)
    run.train(3, seed=2)
    check_exports(run, where)
    loaded: list[MeshRun] = []
    te_loaded: list[MeshRun] = []
    for kind, save in SAVES.items():
        label = f"{where} {kind} save"
        path = root / kind
        save(run, path)
        template, ours, te = fresh(3), fresh(3), fresh(3)
        load_template_path(template, path)
        planner = load_streaming(ours, path)
        load_template_path(te, path, placement=None)
        assert planner.fallbacks == [], f"{label}: {planner.fallbacks}"
        assert planner.peak_assembly_bytes == 4 * whole_state_elements(ours)[0], label
        assert_same_run(template, te, f"{label}: template path vs TE's load")
        assert_same_run(ours, te, f"{label}: streaming vs TE's load")
        if exact:
            assert_same_run(ours, run, f"{label}: streaming vs saved")
        loaded += [template, ours]
        te_loaded.append(te)
    reference = run if exact else te_loaded[0]
    for r in (*loaded, reference):
        r.train(3, seed=5)
    for r in loaded:
        assert_same_run(r, reference, f"{where}: after 3 more steps")


# --- 3. resharding 4 -> 2 -> 1 -> 2 -> 4 --------------------------------------------------------
def _load_both(runs: tuple[MeshRun, MeshRun], path: Path, **kwargs: Any) -> Any:
    """The first run loads ``path`` through the planner, the second through the template path
    (collectives on both; no check yet, so a failure on one rank cannot leave another waiting).
    Returns the planner."""
    ours, template = runs
    planner = load_streaming(ours, path, **kwargs)
    load_template_path(template, path, **kwargs)
    return planner


def _assert_loaded(runs: tuple[MeshRun, MeshRun], planner: Any, where: str) -> None:
    assert planner.fallbacks == [], f"{where}: {planner.fallbacks}"
    assert_same_run(runs[0], runs[1], f"{where}: streaming vs template path")


def check_resharding(backend: Backend, meshes: Meshes, root: Path) -> None:
    """BF16 moments and FP32 masters (elementwise updates: every sharding gives the same bits),
    every stage saved another way: 4 ranks streaming, 2 plain, 1 TE's, 2 streaming."""
    r = rank()
    layout = meshes.layout
    where = f"rank {r} {layout} reshard"

    def fresh(mesh: DeviceMesh | None, seed: int) -> MeshRun:
        return MeshRun(backend, mesh, layout, torch.bfloat16, "fp32", seed, empty=True)

    four = fresh(meshes.four, seed=30)
    four.train(3, seed=31)
    path4 = root / "four"
    save_streaming(four, path4)
    saved = four.full()
    four.train(3, seed=32)
    after = four.full()  # the uninterrupted run
    pair = {"process_group": meshes.pair}

    if meshes.two is not None:  # 4 -> 2
        two = fresh(meshes.two, 33), fresh(meshes.two, 33)
        planner = _load_both(two, path4, **pair)
        _assert_loaded(two, planner, f"{where} 4->2")
        # The experts' Shard(1) pieces of 4 ranks land in strided regions of rank 0's local
        # (2, 5, 4) states on the (1, 2) mesh, which the planner assembles on the host; rank 1's
        # one expert (1, 5, 4) and row pieces take contiguous regions, written in place.
        strided = layout == "moe" and r == 0
        assert (planner.peak_assembly_bytes > 0) == strided, f"{where} 4->2: {planner.report}"
        assert_same_full(two[0].full(), saved, f"{where} 4->2")
        save_plain(two[0], root / "two", **pair)
    if r == 0:  # 2 -> 1: one process, no group
        one = fresh(None, 34), fresh(None, 34)
        _assert_loaded(one, _load_both(one, root / "two", no_dist=True), f"{where} 2->1")
        assert_same_full(one[0].full(), saved, f"{where} 2->1")
        save_te(one[0], root / "one", no_dist=True)
        one[0].train(3, seed=32)
        assert_same_full(one[0].full(), after, f"{where} 2->1: continued")
    if meshes.two is not None:  # 1 -> 2
        dist.barrier(group=meshes.pair)  # rank 0 wrote the 1-rank checkpoint
        two = fresh(meshes.two, 35), fresh(meshes.two, 35)
        _assert_loaded(two, _load_both(two, root / "one", **pair), f"{where} 1->2")
        assert_same_full(two[0].full(), saved, f"{where} 1->2")
        save_streaming(two[0], root / "two_again", **pair)
    dist.barrier()
    four_again = fresh(meshes.four, 36), fresh(meshes.four, 36)  # 2 -> 4
    _assert_loaded(four_again, _load_both(four_again, root / "two_again"), f"{where} 2->4")
    assert_same_full(four_again[0].full(), saved, f"{where} 2->4")
    four_again[0].train(3, seed=32)
    assert_same_run(four_again[0], four, f"{where} 2->4: continued vs uninterrupted")


def check_strided_remainders(backend: Backend, meshes: Meshes, root: Path) -> None:
    """4 -> 2 of the MoE block with int16 master remainders through the planner: the experts'
    Shard(1) pieces land in strided regions of the (1, 2) mesh's local states, which the
    planner assembles in int16 buffers.
    """
    assert meshes.layout == "moe", "only the MoE block shards along a later dimension"
    where = f"rank {rank()} moe strided remainders"

    def fresh(mesh: DeviceMesh | None, seed: int) -> MeshRun:
        return MeshRun(backend, mesh, "moe", torch.bfloat16, "remainder", seed, empty=True)

    four = fresh(meshes.four, seed=40)
    four.train(3, seed=41)
    path = root / "four"
    save_streaming(four, path)
    saved = four.full()
    if meshes.two is not None:
        two = fresh(meshes.two, 42), fresh(meshes.two, 42)
        planner = _load_both(two, path, process_group=meshes.pair)
        _assert_loaded(two, planner, where)
        assert_same_full(two[0].full(), saved, where)
    dist.barrier()


CASES: list[tuple[torch.dtype, str]] = [
    (torch.bfloat16, "remainder"),
    (torch.float16, "fp32"),
    (torch.float32, "none"),
]


def run_mesh_checks(
    backend: Backend,
    root: Path,
    extra_cases: tuple[tuple[torch.dtype, str], ...] = (),
) -> None:
    """Every 2-D check on ``backend``, both layouts; ``extra_cases`` adds storage modes."""
    for layout in LAYOUTS:
        meshes = Meshes(backend.device, layout)
        for moments, master in (*CASES, *extra_cases):
            path = root / layout / f"{moments}_{master}".replace("torch.", "")
            check_saves_and_loads(backend, meshes.four, layout, moments, master, path)
        check_resharding(backend, meshes, root / layout / "reshard")
        if layout == "moe":
            check_strided_remainders(backend, meshes, root / layout / "strided_remainders")
