"""The streaming-save and raw-snapshot checks shared by the CPU and the GPU tests.

``test_dcp_save.py`` runs them on 2 CPU ranks (gloo, FSDP2) with the stand-in of TE's FusedAdam;
``test_gpu_dcp_save.py`` runs the same functions on 2 GPUs (``cpu:gloo,cuda:nccl``) with TE
itself. Every check compares against TE's own export (``export_placement(None)``) taken at the
save point, so "the same as TE" is what passes, not "the same as our other path".
"""

from __future__ import annotations

import itertools
import os
import threading
import time
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import FileSystemWriter
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_optimizer_state_dict,
    set_model_state_dict,
    set_optimizer_state_dict,
)
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor

from te_ckpt_placement import _export as engine
from te_ckpt_placement import export_placement, last_report
from te_ckpt_placement.dcp import (
    PlacedOptimizerState,
    SnapshotStager,
    StreamingWriter,
    is_lazy,
    lazy_optimizer_state_dict,
)
from te_ckpt_placement.dcp import _lazy_state as lazy_state_module

from . import distributed
from .backends import Backend
from .dcp_runs import set_global_grads, wait
from .faults import nth_call_raises
from .helpers import assert_same_export, bits, blank, local, snapshot

FLAT = StateDictOptions(flatten_optimizer_state_dict=True)
GIB = 1 << 30
BF16, FP16, FP32, FP8 = torch.bfloat16, torch.float16, torch.float32, torch.uint8


def param_dtype(master: str) -> torch.dtype:
    return BF16 if master in ("remainder", "fp16") else FP32


def gather(state: DTensor) -> torch.Tensor:
    """The global tensor, on the host (a collective)."""
    return distributed.gather(state).cpu()


class Case:
    """A model (fully_shard'ed on ``mesh``, or plain without one) and its optimizer."""

    def __init__(
        self,
        backend: Backend,
        mesh: DeviceMesh | None,
        moments: torch.dtype,
        master: str,
        seed: int,
        dims: tuple[int, ...] = (3, 5, 4),
    ) -> None:
        from torch.distributed.fsdp import fully_shard

        self.backend, self.mesh, self.moments, self.master, self.dims = (
            backend,
            mesh,
            moments,
            master,
            dims,
        )
        torch.manual_seed(seed)
        # Built where it lives (a large model initializes fast on the GPU); Linear(3, 5) shards
        # unevenly (3 + 2 rows) on 2 ranks.
        layers = [torch.nn.Linear(a, b, device=backend.device) for a, b in itertools.pairwise(dims)]
        model = torch.nn.Sequential(*layers).to(param_dtype(master))
        if mesh is not None:
            fully_shard(model, mesh=mesh)
        self.model = model
        self.opt = backend.make_optimizer(model.parameters(), moments=moments, master=master)

    def fresh(self, seed: int, mesh: Any = "same") -> Case:
        """Another model and optimizer of this layout (other initial values, no state yet)."""
        target = self.mesh if mesh == "same" else mesh
        return Case(self.backend, target, self.moments, self.master, seed, self.dims)

    def params(self) -> list[torch.Tensor]:
        return [p for group in self.opt.param_groups for p in group["params"]]

    def train(self, steps: int, seed: int) -> None:
        """The same global gradients on every rank, sharded like the parameters."""
        gen = torch.Generator().manual_seed(seed)
        for _ in range(steps):
            set_global_grads(self.params(), gen)
            self.opt.step()
        self.opt.zero_grad(set_to_none=True)
        if self.backend.device == "cuda":
            torch.cuda.synchronize()

    def export(self, options: StateDictOptions = FLAT, placement: Any = "cpu") -> dict[str, Any]:
        with export_placement(placement):
            return get_optimizer_state_dict(self.model, self.opt, options=options)

    def lazy(self, options: StateDictOptions = FLAT) -> dict[str, Any]:
        return lazy_optimizer_state_dict(self.model, self.opt, options=options)

    def model_bits(self) -> dict[str, torch.Tensor]:
        return {k: bits(local(v)).clone() for k, v in get_model_state_dict(self.model).items()}

    def reference(self) -> dict[str, Any]:
        """TE's own export and the weights, on the host, at this point of training."""
        te = self.export(placement=None)
        return {"optim": host_copy(te), "model": self.model_bits()}

    def full(self) -> dict[str, Any]:
        """Global weights, exported states and hyperparameters (a collective on a mesh)."""
        out: dict[str, Any] = {}
        for key, value in {**get_model_state_dict(self.model), **self.export()}.items():
            if isinstance(value, DTensor):
                value = gather(value)
            out[key] = bits(value).clone() if isinstance(value, torch.Tensor) else value
        return out


def host_copy(tree: Any) -> Any:
    """A deep copy with every tensor (DTensor locals too) on the host: TE's FP32 export aliases
    the live state, so a reference has to be copied before training goes on."""
    if isinstance(tree, DTensor):
        return engine.to_cpu_dtensor(tree._local_tensor.detach().cpu().clone(), tree)
    if isinstance(tree, torch.Tensor):
        return tree.detach().cpu().clone()
    if isinstance(tree, dict):
        return {k: host_copy(v) for k, v in tree.items()}
    if isinstance(tree, list):
        return [host_copy(v) for v in tree]
    if isinstance(tree, tuple):
        return tuple(host_copy(v) for v in tree)
    return tree


def n_states(export: dict[str, Any]) -> int:
    return sum(1 for key in export if key.startswith("state."))


def raw_bytes(opt: torch.optim.Optimizer) -> int:
    """What the export reads of every local state: its stored bytes, and the FP32 factor of an
    FP16 state (``_scales``) or an FP8 one (``_scale_inv``)."""
    total = 0
    scales = getattr(opt, "_scales", {})
    for param, states in opt.state.items():
        for name, value in states.items():
            stored = local(value)
            data = getattr(stored, "_data", stored)
            total += data.numel() * data.element_size()
            if hasattr(stored, "_scale_inv"):
                total += stored._scale_inv.numel() * 4
            elif data.dtype == torch.float16:
                total += scales[param][name].numel() * 4
    return total


def model_bytes(model: torch.nn.Module) -> int:
    return sum(local(p).numel() * local(p).element_size() for p in model.parameters())


def assert_lazy_like(lazy: dict[str, Any], export: dict[str, Any], where: str) -> None:
    """The lazy dict has the export's keys, values and tensor metadata; states are lazy."""
    assert list(lazy) == list(export), f"{where}: keys differ"
    for key, value in export.items():
        ours = lazy[key]
        if not isinstance(value, torch.Tensor):
            assert ours == value, f"{where}: {key}: {ours!r} != {value!r}"
            continue
        assert is_lazy(ours), f"{where}: {key} is not lazy"
        assert isinstance(ours, DTensor) == isinstance(value, DTensor), f"{where}: {key} type"
        if isinstance(value, DTensor):
            assert ours.device_mesh == value.device_mesh, f"{where}: {key} mesh"
            assert tuple(ours.placements) == tuple(value.placements), f"{where}: {key} placements"
            assert ours.stride() == value.stride(), f"{where}: {key} stride"
        assert ours.shape == value.shape and ours.dtype == value.dtype, f"{where}: {key}"
        assert local(ours).shape == local(value).shape, f"{where}: {key} local shape"


def same_bits(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> bool:
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def model_template(model: torch.nn.Module) -> dict[str, Any]:
    """Host copies of the (sharded) weights as load targets, so a load cannot touch the model."""
    return {k: v.detach().to("cpu").clone() for k, v in get_model_state_dict(model).items()}


def assert_loads(case: Case, path: Path, ref: dict[str, Any], where: str) -> None:
    """The checkpoint loads through DCP into TE's own template and into the policy's, both
    equal to ``ref`` (TE's export at the save point). The templates come from a fresh model and
    optimizer of the same layout (DCP's fake step gives it states), never from ``case``."""
    for placement in ("cpu", None):
        fresh = case.fresh(seed=99)
        target = {"model": model_template(fresh.model), "optim": fresh.export(placement=placement)}
        blank(target)
        dcp.load(target, checkpoint_id=str(path))
        label = f"{where}: template {placement}"
        assert_same_export(target["optim"], ref["optim"], f"{label}: optim")
        got = {k: bits(local(v)) for k, v in target["model"].items()}
        assert got.keys() == ref["model"].keys(), f"{label}: model keys"
        for key, value in ref["model"].items():
            assert torch.equal(got[key], value), f"{label}: model {key}"


def assert_same_optimizer(ours: Case, ref: Case, where: str) -> None:
    """Live states by position (FP8 as bytes and scale_inv), FP16/FP8 scales, param_groups."""
    snap, ref_snap = snapshot(ours.opt), snapshot(ref.opt)
    for i, (p, q) in enumerate(zip(ours.params(), ref.params(), strict=True)):
        assert snap.get(p, {}).keys() == ref_snap.get(q, {}).keys(), f"{where}: param {i} states"
        for name, value in ref_snap.get(q, {}).items():
            assert torch.equal(snap[p][name], value), f"{where}: param {i} {name}"
        scales = getattr(ours.opt, "_scales", {}).get(p, {})
        ref_scales = getattr(ref.opt, "_scales", {}).get(q, {})
        assert scales.keys() == ref_scales.keys(), f"{where}: param {i} scales"
        for name, scale in ref_scales.items():
            assert torch.equal(bits(scales[name]), bits(scale)), f"{where}: {i} {name} scale"
    groups = [{k: v for k, v in g.items() if k != "params"} for g in ours.opt.param_groups]
    ref_groups = [{k: v for k, v in g.items() if k != "params"} for g in ref.opt.param_groups]
    assert groups == ref_groups, f"{where}: param_groups {groups} != {ref_groups}"


def te_load(case: Case, path: Path) -> Case:
    """``case``'s layout restored from ``path`` the way users without the policy do it."""
    te = case.fresh(seed=98)
    with export_placement(None):
        state: dict[str, Any] = {
            "model": get_model_state_dict(te.model),
            "optim": te.export(placement=None),
        }
        dcp.load(state, checkpoint_id=str(path))
        set_model_state_dict(te.model, state["model"])
        set_optimizer_state_dict(te.model, te.opt, state["optim"], options=FLAT)
    return te


class GatedWriter(StreamingWriter):
    """A StreamingWriter whose write waits for ``gate``: the test trains in between, so the
    write certainly runs after training changed the live state."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.gate = threading.Event()

    def write_data(self, plan: Any, planner: Any) -> Any:
        assert self.gate.wait(timeout=300), "the test never opened the gate"
        return super().write_data(plan, planner)


def produced(lazy: dict[str, Any]) -> dict[str, int]:
    """What the placeholders of a lazy dict produced (its ledger, which also warns)."""
    ledger = lazy_state_module.ledger_of(lazy)
    assert ledger is not None, "no lazy states"
    return ledger.counts()


def snapshot_details(stager: SnapshotStager) -> Any:
    """The details of the stager's last report (a snapshot's)."""
    report = stager.last_report
    assert report is not None and report.path == "snapshot" and not report.failed, report
    return report.details


def rank() -> int:
    return dist.get_rank() if dist.is_initialized() else 0


# --- 1. the streaming synchronous save ---------------------------------------------------------
WRITER_CONFIGS = ((1, True), (2, True), (2, False))  # (thread_count, single_file_per_rank)


def check_streaming_save(
    backend: Backend,
    mesh: DeviceMesh,
    root: Path,
    modes: list[tuple[torch.dtype, str]],
    configs: tuple[tuple[int, bool], ...] = WRITER_CONFIGS,
) -> None:
    """Lazy dicts written by StreamingWriter (1 and 2 threads, one file per rank or per item):
    nothing produced before the write, each state produced once, at most threads + 1 alive,
    the live optimizer untouched, and files equal to TE's export under either template."""
    for i, (moments, master) in enumerate(modes):
        where = f"rank {rank()} streaming {moments} {master}"
        case = Case(backend, mesh, moments, master, seed=10 + i)
        case.train(3, seed=20 + i)
        ref = case.reference()
        export = case.export()
        before = snapshot(case.opt)
        for threads, single in configs:
            label = f"{where} threads={threads} single_file={single}"
            lazy = case.lazy()
            assert_lazy_like(lazy, export, label)
            assert produced(lazy)["produced"] == 0, f"{label}: produced before the save"
            path = root / f"streaming{i}_{threads}_{int(single)}"
            writer = StreamingWriter(path, thread_count=threads, single_file_per_rank=single)
            with warnings.catch_warnings():
                warnings.simplefilter("error", RuntimeWarning)  # no "whole export" warning
                dcp.save(
                    {"model": get_model_state_dict(case.model), "optim": lazy},
                    storage_writer=writer,
                )
            report = writer.last_report
            assert report is not None and report.path == "streaming_save", label
            assert last_report() == report, f"{label}: not the calling thread's last report"
            stats = report.details
            assert stats["produced"] == n_states(export), f"{label}: {report}"
            assert 1 <= stats["peak_alive"] <= threads + writer.lookahead, f"{label}: {report}"
            data_files = {p.name for p in path.iterdir() if p.suffix == ".distcp"}
            mine = {name for name in data_files if name.startswith(f"__{rank()}_")}
            if single:
                assert 1 <= len(mine) <= threads, f"{label}: files {sorted(mine)}"
            assert snapshot(case.opt).keys() == before.keys()
            for p, states in before.items():
                for name, value in states.items():
                    assert torch.equal(snapshot(case.opt)[p][name], value), f"{label}: live"
            assert_loads(case, path, ref, label)

        # The Stateful adapter, saved and loaded (as a template too) with save="streaming".
        path = root / f"streaming{i}_adapter"
        dcp.save(
            {
                "model": get_model_state_dict(case.model),
                "optim": PlacedOptimizerState(case.model, case.opt, save="streaming"),
            },
            storage_writer=StreamingWriter(path),
        )
        fresh = case.fresh(seed=30 + i)
        state: dict[str, Any] = {
            "model": get_model_state_dict(fresh.model),
            "optim": PlacedOptimizerState(fresh.model, fresh.opt, save="streaming"),
        }
        dcp.load(state, checkpoint_id=str(path))
        set_model_state_dict(fresh.model, state["model"])
        assert_same_optimizer(fresh, te_load(case, path), f"{where}: adapter load vs TE load")
        if moments in (BF16, FP32):  # exact round trips; FP16/FP8 scales are re-derived by TE
            assert_same_optimizer(fresh, case, f"{where}: adapter load vs saved")


def check_stock_writers(backend: Backend, mesh: DeviceMesh, root: Path) -> None:
    """torch's FileSystemWriter: with one file per rank it keeps every produced state until the
    file is closed (the obstacle, and a warning says so); with one file per item it does not.
    Both write files equal to TE's export."""
    where = f"rank {rank()} stock writer"
    case = Case(backend, mesh, BF16, "remainder", seed=40)
    case.train(2, seed=41)
    ref = case.reference()
    total = n_states(case.export())
    limits = (lazy_state_module.WARN_ALIVE_ITEMS, lazy_state_module.WARN_ALIVE_BYTES)
    lazy_state_module.WARN_ALIVE_ITEMS, lazy_state_module.WARN_ALIVE_BYTES = 2, 0
    try:
        for single in (True, False):
            lazy = case.lazy()
            path = root / f"stock_{int(single)}"
            with warnings.catch_warnings(record=True) as caught:
                warnings.simplefilter("always")
                dcp.save(
                    {"model": get_model_state_dict(case.model), "optim": lazy},
                    storage_writer=FileSystemWriter(path, single_file_per_rank=single),
                )
            warned = [w for w in caught if "StreamingWriter" in str(w.message)]
            stats = produced(lazy)
            if single:
                assert stats["peak_alive"] == total, f"{where}: {stats} (expected all {total})"
                assert len(warned) == 1, f"{where}: {[str(w.message) for w in caught]}"
            else:
                # The previous file's tensor lives on in the writer's locals until the next
                # one is resolved: two per writer thread.
                assert stats["peak_alive"] <= 2, f"{where}: one file per item: {stats}"
                assert not warned, f"{where}: warned {warned[0].message}"
            assert_loads(case, path, ref, f"{where} single_file={single}")
        # StreamingWriter does not warn: it drops what it wrote.
        with warnings.catch_warnings():
            warnings.simplefilter("error", RuntimeWarning)
            dcp.save({"optim": case.lazy()}, storage_writer=StreamingWriter(root / "stock_ours"))
    finally:
        lazy_state_module.WARN_ALIVE_ITEMS, lazy_state_module.WARN_ALIVE_BYTES = limits


# --- 2. the raw-snapshot async save ------------------------------------------------------------
def check_snapshot_async(
    backend: Backend,
    mesh: DeviceMesh,
    async_pgs: tuple[Any, Any],
    root: Path,
    modes: list[tuple[torch.dtype, str]],
    saves: int = 3,
) -> None:
    """Repeated async saves per mode through StreamingWriter's SnapshotStager, training a
    step while each write waits: the files hold TE's export at the save point, only raw bytes
    are staged, and from the second save on every buffer is reused. Then two saves in flight at
    once: the second never overwrites the first's buffers."""
    pg, pg2 = async_pgs
    for i, (moments, master) in enumerate(modes):
        where = f"rank {rank()} snapshot {moments} {master}"
        case = Case(backend, mesh, moments, master, seed=50 + i)
        case.train(2, seed=60 + i)
        stager = SnapshotStager()
        for n in range(saves):
            label = f"{where} save {n}"
            ref = case.reference()
            path = root / f"snapshot{i}_{n}"
            writer = GatedWriter(path, stager=stager)
            response = dcp.async_save(
                {
                    "model": get_model_state_dict(case.model),
                    "optim": PlacedOptimizerState(case.model, case.opt, save="streaming"),
                },
                storage_writer=writer,
                process_group=pg,
            )
            stats = snapshot_details(stager)
            assert stats["raw_bytes"] == raw_bytes(case.opt), f"{label}: {stats}"
            assert stats["other_bytes"] == model_bytes(case.model), f"{label}: {stats}"
            assert stats["converted_bytes"] == 0 and stats["passed_through"] == 0, label
            if n == 0:
                assert stats["allocated_bytes"] == stats["raw_bytes"] + stats["other_bytes"], label
            else:
                assert stats["allocated_bytes"] == 0, f"{label}: buffers not reused: {stats}"
            case.train(1, seed=70 + n)  # while the write waits at the gate
            assert not same_bits(case.model_bits(), ref["model"]), f"{label}: the step did nothing"
            writer.gate.set()
            wait(response)
            assert_loads(case, path, ref, label)
        # Two saves in flight at once (each on its own group): the second allocates its own
        # buffers, and the first still writes what it staged.
        refs, writers, responses = [], [], []
        for n, group in enumerate((pg, pg2)):
            refs.append(case.reference())
            writers.append(GatedWriter(root / f"snapshot{i}_overlap{n}", stager=stager))
            responses.append(
                dcp.async_save(
                    {
                        "model": get_model_state_dict(case.model),
                        "optim": PlacedOptimizerState(case.model, case.opt, save="streaming"),
                    },
                    storage_writer=writers[-1],
                    process_group=group,
                )
            )
            stats = snapshot_details(stager)
            if n == 1:
                assert stats["allocated_bytes"] == stats["raw_bytes"] + stats["other_bytes"], (
                    f"{where}: a buffer in use was reused: {stats}"
                )
            case.train(1, seed=80 + n)
        for writer, response in zip(writers, responses, strict=True):
            writer.gate.set()
            wait(response)
        for n, ref in enumerate(refs):
            assert_loads(case, root / f"snapshot{i}_overlap{n}", ref, f"{where} overlap {n}")
        assert stager.buffer_bytes > 0
        stager.close()
        assert stager.buffer_bytes == 0


# --- 4. resharding and full_state_dict ---------------------------------------------------------
def check_resharding(backend: Backend, mesh: DeviceMesh, async_pg: Any, root: Path) -> None:
    """Streamed and snapshotted checkpoints of 2 ranks load on 1 rank (a 1-rank FSDP2 mesh and a
    plain model without a process group) and on 2 ranks, equal to the saved run's global values
    and to its full_state_dict; a streamed checkpoint of 1 rank loads on 2."""
    r = rank()
    solo = dist.new_group([0])  # collective: every rank creates it, rank 0 uses it
    # FP32 masters: neither gloo nor NCCL all-gathers the int16 remainders full_state_dict needs.
    two = Case(backend, mesh, BF16, "fp32", seed=90)
    two.train(3, seed=91)
    saved_full = two.full()
    full_options = StateDictOptions(full_state_dict=True, cpu_offload=True)
    saved_full_sd = host_copy(two.export(full_options))
    paths = {"sync": root / "reshard_sync", "async": root / "reshard_async"}
    dcp.save(
        {"model": get_model_state_dict(two.model), "optim": two.lazy()},
        storage_writer=StreamingWriter(paths["sync"]),
    )
    writer = StreamingWriter(paths["async"])
    wait(
        dcp.async_save(
            {"model": get_model_state_dict(two.model), "optim": two.lazy()},
            storage_writer=writer,
            process_group=async_pg,
        )
    )
    writer.close()
    for kind, path in paths.items():
        where = f"rank {r} reshard {kind}"
        # 2 -> 2 with the streaming adapter as the template, then full_state_dict.
        again = two.fresh(seed=92)
        state: dict[str, Any] = {
            "model": get_model_state_dict(again.model),
            "optim": PlacedOptimizerState(again.model, again.opt, save="streaming"),
        }
        dcp.load(state, checkpoint_id=str(path))
        set_model_state_dict(again.model, state["model"])
        distributed.assert_same_full(again.full(), saved_full, where)
        assert_same_export(again.export(full_options), saved_full_sd, f"{where}: full_state_dict")
        # 2 -> 1.
        if r == 0:
            solo_mesh = DeviceMesh.from_group(solo, backend.device)
            for label, target_mesh in (("1-rank group", solo_mesh), ("no group", None)):
                one = two.fresh(seed=93, mesh=target_mesh)
                state = {
                    "model": get_model_state_dict(one.model),
                    "optim": PlacedOptimizerState(one.model, one.opt, save="streaming"),
                }
                if target_mesh is None:
                    dcp.load(state, checkpoint_id=str(path), no_dist=True)
                else:
                    dcp.load(state, checkpoint_id=str(path), process_group=solo)
                set_model_state_dict(one.model, state["model"])
                distributed.assert_same_full(one.full(), saved_full, f"{where} 2->1 {label}")
    # 1 -> 2: a streamed checkpoint written by a 1-rank group.
    path = root / "reshard_one_to_two"
    payload: list[Any] = [None]
    if r == 0:
        one = two.fresh(seed=94, mesh=DeviceMesh.from_group(solo, backend.device))
        one.train(3, seed=95)
        dcp.save(
            {"model": get_model_state_dict(one.model), "optim": one.lazy()},
            storage_writer=StreamingWriter(path),
            process_group=solo,
        )
        payload = [one.full()]
    dist.broadcast_object_list(payload, src=0)
    target = two.fresh(seed=96)
    state = {
        "model": get_model_state_dict(target.model),
        "optim": PlacedOptimizerState(target.model, target.opt, save="streaming"),
    }
    dcp.load(state, checkpoint_id=str(path))
    set_model_state_dict(target.model, state["model"])
    distributed.assert_same_full(target.full(), payload[0], f"rank {r} reshard 1->2")


# --- failures ----------------------------------------------------------------------------------
class InjectedError(OSError):
    pass


def check_failed_save(backend: Backend, mesh: DeviceMesh, root: Path) -> None:
    """A streaming save that fails on one rank part-way (the third state it produces) raises on
    every rank, changes nothing in the optimizer, leaves the checkpoint it would have replaced in
    the same directory loadable and no partial file of the failing rank; the next save there
    succeeds and removes the replaced checkpoint's files."""
    r = rank()
    where = f"rank {r} failed save"
    case = Case(backend, mesh, FP16, "fp32", seed=100)
    case.train(2, seed=101)
    path = root / "failed"
    ref_a = case.reference()
    dcp.save(
        {"model": get_model_state_dict(case.model), "optim": case.lazy()},
        storage_writer=StreamingWriter(path),
    )
    files_a = {p.name for p in path.iterdir() if p.suffix == ".distcp"}
    case.train(1, seed=102)
    before = snapshot(case.opt)

    original = engine.materialize
    error = InjectedError("injected write failure")
    failing = nth_call_raises(3, error, original) if r == 1 else original
    engine.materialize = failing  # type: ignore[assignment]
    try:
        failed = False
        try:
            dcp.save(
                {"model": get_model_state_dict(case.model), "optim": case.lazy()},
                storage_writer=StreamingWriter(path, thread_count=2),
            )
        except BaseException as exc:  # DCP's CheckpointException is a BaseException
            failed = True
            assert "injected write failure" in str(exc), f"{where}: {exc!r}"
        assert failed, f"{where}: the save did not fail"
    finally:
        engine.materialize = original  # type: ignore[assignment]
    dist.barrier()
    after = snapshot(case.opt)
    for p, states in before.items():
        for name, value in states.items():
            assert torch.equal(after[p][name], value), f"{where}: live state {name} changed"
    assert_loads(case, path, ref_a, f"{where}: previous checkpoint")
    leftover = {p.name for p in path.iterdir() if p.suffix == ".distcp"} - files_a
    assert not any(name.startswith("__1_") for name in leftover), f"{where}: {sorted(leftover)}"

    ref_c = case.reference()
    dcp.save(
        {"model": get_model_state_dict(case.model), "optim": case.lazy()},
        storage_writer=StreamingWriter(path),
    )
    dist.barrier()
    remaining = {p.name for p in path.iterdir() if p.suffix == ".distcp"}
    assert not remaining & files_a, f"{where}: replaced files kept {sorted(remaining & files_a)}"
    assert_loads(case, path, ref_c, f"{where}: next save")


# --- memory bounds -----------------------------------------------------------------------------
def rss() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def peaks(fn: Callable[[], Any]) -> tuple[Any, int, int]:
    """``fn()``, its CUDA allocation peak (0 without CUDA) and its host RSS peak above the start
    (sampled every millisecond)."""
    cuda = torch.cuda.is_available()
    if cuda:
        torch.cuda.synchronize()
        gpu_base = torch.cuda.memory_allocated()
        torch.cuda.reset_peak_memory_stats()
    host_base = peak = rss()
    stop = threading.Event()

    def sample() -> None:
        nonlocal peak
        while not stop.is_set():
            peak = max(peak, rss())
            time.sleep(0.001)

    sampler = threading.Thread(target=sample, daemon=True)
    sampler.start()
    try:
        out = fn()
        if cuda:
            torch.cuda.synchronize()
    finally:
        stop.set()
        sampler.join()
    peak = max(peak, rss())
    gpu = torch.cuda.max_memory_allocated() - gpu_base if cuda else 0
    return out, gpu, peak - host_base


def remove(path: Path) -> None:
    """Deletes a (large) checkpoint once every rank is done with it."""
    import shutil

    dist.barrier()
    if rank() == 0:
        shutil.rmtree(path, ignore_errors=True)
    dist.barrier()


def check_memory_bounds(
    backend: Backend, mesh: DeviceMesh, async_pg: Any, root: Path, dims: tuple[int, ...]
) -> None:
    """The memory targets, on bf16 Linear layers of ``dims`` (BF16 moments, int16 remainders).

    Streaming save: 0 extra GPU bytes and host RSS growth at most 1 GiB + (threads + 1) x 4 x M
    (M: the largest local state). Raw-snapshot async save, training during the write: host RSS
    growth at most raw bytes + 1 GiB + (threads + 1) x 4 x M, the buffers reused by the second
    save, and 0 GPU bytes for the staging. On 2 GPUs the test uses eight Linear(8192, 8192):
    32 Mi local elements per weight, a 2.5 GiB FP32 export per rank against a 1.375 GiB bound
    (2 threads), so holding the export would fail; smaller ``dims`` only run the code paths.
    """
    from te_ckpt_placement import release_buffers

    case = Case(backend, mesh, BF16, "remainder", seed=7, dims=dims)
    case.train(2, seed=8)
    m = max(local(p).numel() for p in case.model.parameters())
    raw = raw_bytes(case.opt) + model_bytes(case.model)
    export_bytes = sum(
        local(v).numel() * local(v).element_size()
        for k, v in case.export().items()
        if k.startswith("state.")
    )
    where = f"rank {dist.get_rank()} memory"
    for threads in (1, 2):
        bound = GIB + (threads + 1) * 4 * m
        if min(dims) >= 8192:
            assert export_bytes > bound, f"{where}: the model is too small to test the bound"
        ref = case.reference()
        path = root / f"memory_streaming_{threads}"
        release_buffers()
        dist.barrier()

        def save(path: Path = path, threads: int = threads) -> None:
            dcp.save(
                {
                    "model": get_model_state_dict(case.model),
                    "optim": PlacedOptimizerState(case.model, case.opt, save="streaming"),
                },
                storage_writer=StreamingWriter(path, thread_count=threads),
            )

        _, gpu, host = peaks(save)
        assert gpu == 0, f"{where} streaming threads={threads}: {gpu} extra GPU bytes"
        assert host <= bound, f"{where} streaming threads={threads}: host +{host} > {bound}"
        assert_loads(case, path, ref, f"{where} streaming threads={threads}")
        remove(path)

    stager = SnapshotStager()
    cuda = torch.cuda.is_available()
    for n in range(2):  # the first save allocates and pins the buffers, the second reuses them
        bound = raw + GIB + 2 * 4 * m
        ref = case.reference()
        path = root / f"memory_snapshot_{n}"
        writer = StreamingWriter(path, stager=stager)
        dist.barrier()
        staging_gpu: list[int] = []

        def async_save(
            writer: Any = writer, n: int = n, staging_gpu: list[int] = staging_gpu
        ) -> None:
            base = 0
            if cuda:
                torch.cuda.synchronize()
                base = torch.cuda.memory_allocated()
                torch.cuda.reset_peak_memory_stats()
            response = dcp.async_save(
                {
                    "model": get_model_state_dict(case.model),
                    "optim": PlacedOptimizerState(case.model, case.opt, save="streaming"),
                },
                storage_writer=writer,
                process_group=async_pg,
            )
            staging_gpu.append(torch.cuda.max_memory_allocated() - base if cuda else 0)
            case.train(1, seed=20 + n)  # training while the write runs
            wait(response)

        _, _, host = peaks(async_save)  # the GPU peak of the whole includes the training step
        stats = snapshot_details(stager)
        assert stats["raw_bytes"] + stats["other_bytes"] == raw, stats
        assert n == 0 or stats["allocated_bytes"] == 0, f"{where}: buffers not reused: {stats}"
        assert staging_gpu == [0], f"{where} snapshot {n}: staging took {staging_gpu} GPU bytes"
        assert host <= bound, f"{where} snapshot {n}: host +{host} > {bound}"
        assert_loads(case, path, ref, f"{where} snapshot {n}")
        remove(path)
    stager.close()


# --- 7. process-based async saves with the raw snapshot ---------------------------------------
def check_process_async(
    backend: Backend,
    mesh: DeviceMesh | None,
    pg: Any,
    root: Path,
    modes: list[tuple[torch.dtype, str]],
    *,
    saves: int = 2,
    kind: Any = None,
) -> None:
    """``dcp.async_save(..., async_checkpointer_type=kind)`` (default PROCESS) staged by one
    SnapshotStager,
    with StreamingWriter and torch's FileSystemWriter: the writer process reads the snapshot
    only after the test trained a step and dropped everything of the save but the response,
    and the files hold TE's export at the save point; only raw bytes are staged, into shared
    memory, and the second save allocates nothing."""
    from torch.distributed.checkpoint.state_dict_saver import AsyncCheckpointerType

    from .process_save import GatedFileSystemWriter, GatedStreamingWriter

    kind = AsyncCheckpointerType.PROCESS if kind is None else kind
    stager = SnapshotStager()
    for i, (moments, master) in enumerate(modes):
        writer_type = (GatedStreamingWriter, GatedFileSystemWriter)[i % 2]
        where = f"rank {rank()} process {writer_type.__name__} {moments} {master}"
        case = Case(backend, mesh, moments, master, seed=90 + i)
        case.train(2, seed=91 + i)
        for n in range(saves):
            label = f"{where} save {n}"
            ref = case.reference()
            path = root / f"process{kind.value}{i}_{n}"
            gate = root / f"process{kind.value}{i}_{n}.gate"
            response = dcp.async_save(
                {
                    "model": get_model_state_dict(case.model),
                    "optim": PlacedOptimizerState(case.model, case.opt, save="streaming"),
                },
                storage_writer=writer_type(path, gate),
                async_stager=stager,
                async_checkpointer_type=kind,
                process_group=pg,
            )
            report = stager.last_report
            assert report is not None and report.path == "snapshot", label
            details = report.details
            assert details["raw_bytes"] == raw_bytes(case.opt), f"{label}: {report}"
            assert details["other_bytes"] == model_bytes(case.model), f"{label}: {report}"
            if n > 0:  # one stager for the run: its buffers persist across saves
                assert details["allocated_bytes"] == 0, f"{label}: not reused: {report}"
            case.train(1, seed=95 + n)  # training goes on before the writer process reads
            assert not same_bits(case.model_bits(), ref["model"]), f"{label}: no step"
            gate.touch()
            wait(response)
            assert_loads(case, path, ref, label)
    assert stager.buffer_bytes > 0
    stager.close()
    assert stager.buffer_bytes == 0
