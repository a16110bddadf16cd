"""Streaming DCP saves and raw-snapshot async saves against the CPU stand-in of TE FusedAdam.

In process: the lazy states (metadata and values equal to the export for every storage mode and
conversion, refusals, validation), ``StreamingWriter`` (at most threads + lookahead produced
states alive, failures that leave the previous checkpoint and the optimizer alone, the files of
a replaced checkpoint removed), ``SnapshotStager`` (raw bytes only, training after staging does
not reach the files, buffers reused and never overwritten in use) and the ``save="streaming"``
option of ``PlacedOptimizerState``.

One spawn of 2 ranks (gloo, FSDP2) then runs the checks of ``dcp_save_checks.py``, which
``test_gpu_dcp_save.py`` runs with TE on 2 GPUs.
"""

from __future__ import annotations

import copy
import pickle
import uuid
import warnings
from collections.abc import Iterator
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.filesystem import _StorageInfo
from torch.distributed.checkpoint.metadata import Metadata, MetadataIndex
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_optimizer_state_dict

from te_ckpt_placement import Placement, export_placement, last_report
from te_ckpt_placement import _export as engine
from te_ckpt_placement.dcp import (
    LazyState,
    PassThroughStager,
    PlacedOptimizerState,
    SnapshotStager,
    StreamingWriter,
    is_lazy,
    lazy_optimizer_state_dict,
    resolve_loaded,
)
from te_ckpt_placement.dcp import _lazy_state as lazy_state_module
from te_ckpt_placement.dcp import _writer as writer_module
from te_ckpt_placement.dcp._lazy_state import released_after_write

from .support import dcp_save_checks as checks
from .support.backends import CPU
from .support.distributed import init_gloo_mesh, spawn
from .support.faults import nth_call_raises
from .support.helpers import assert_same_export, bits, local, snapshot, tensors

pytestmark = pytest.mark.usefixtures("hooked_standin")

FLAT = StateDictOptions(flatten_optimizer_state_dict=True)
BF16, FP16, FP32, FP8 = torch.bfloat16, torch.float16, torch.float32, torch.uint8
# (moments, master) storage modes of the stand-in for plain (non-DTensor) parameters.
MODES = [
    (FP32, "none"),
    (BF16, "fp32"),
    (BF16, "remainder"),
    (FP16, "fp32"),
    (FP16, "fp16"),
    (FP8, "fp32"),
    (FP8, "remainder"),
]


def plain_case(moments: torch.dtype, master: str, seed: int = 0, layers: int = 2) -> checks.Case:
    dims = tuple(3 + 2 * i for i in range(layers + 1))
    case = checks.Case(CPU, None, moments, master, seed=seed, dims=dims)
    case.train(2, seed=seed + 1)
    return case


def no_dist_save(state_dict: dict[str, Any], writer: Any) -> None:
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", "torch.distributed is disabled", UserWarning)
        dcp.save(state_dict, storage_writer=writer, no_dist=True)


def no_dist_load(state_dict: dict[str, Any], path: Path) -> None:
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", "torch.distributed is disabled", UserWarning)
        dcp.load(state_dict, checkpoint_id=str(path), no_dist=True)


def expected_kind(key: str, moments: torch.dtype, master: str, conversion: str) -> str:
    """What describe_state makes of a state: TE's stored dtype and the conversion."""
    if key.endswith("master_param"):
        stored = {"fp32": FP32, "fp16": FP16, "remainder": torch.int16}[master]
    else:
        stored = moments
    if stored in (FP16, FP8) and conversion == "device":
        return "device"
    kinds = {FP32: "copy", torch.int16: "copy", BF16: "upcast", FP16: "scaled", FP8: "fp8"}
    return kinds[stored]


# --- lazy states --------------------------------------------------------------------------------
@pytest.mark.parametrize("conversion", ["host", "device"])
@pytest.mark.parametrize(("moments", "master"), MODES)
def test_lazy_states_produce_the_export(moments: torch.dtype, master: str, conversion: str) -> None:
    case = plain_case(moments, master)
    placement = Placement(conversion=conversion)  # type: ignore[arg-type]
    with export_placement(None):
        te = checks.host_copy(get_optimizer_state_dict(case.model, case.opt, options=FLAT))
    before = snapshot(case.opt)
    lazy = lazy_optimizer_state_dict(case.model, case.opt, options=FLAT, placement=placement)
    checks.assert_lazy_like(lazy, te, f"{moments} {master}")
    states = {k: v for k, v in lazy.items() if k.startswith("state.")}
    assert checks.produced(lazy)["produced"] == 0
    for key, value in states.items():
        first, second = value.produce(), value.produce()
        assert not is_lazy(first) and type(first) is torch.Tensor
        assert first.untyped_storage().data_ptr() != second.untyped_storage().data_ptr()
        assert first.untyped_storage().nbytes() == first.numel() * first.element_size()
        assert torch.equal(bits(first), bits(te[key])), f"{key} differs from TE's export"
        assert torch.equal(bits(second), bits(te[key])), key
        assert value.source.kind == expected_kind(key, moments, master, conversion), key
    stats = checks.produced(lazy)
    assert stats["produced"] == 2 * len(states)
    assert stats["produced_bytes"] == 2 * sum(v.numel() * v.element_size() for v in te.values()
                                           if isinstance(v, torch.Tensor))  # fmt: skip
    after = snapshot(case.opt)
    for p, names in before.items():
        for name, value in names.items():
            assert torch.equal(after[p][name], value), f"producing changed the live {name}"


def test_lazy_state_dict_options_and_structure() -> None:
    case = plain_case(BF16, "remainder")
    for options in (
        StateDictOptions(),  # nested: {"state": {fqn: {name: ...}}, "param_groups": [...]}
        StateDictOptions(flatten_optimizer_state_dict=True, cpu_offload=True),
    ):
        lazy = lazy_optimizer_state_dict(case.model, case.opt, options=options)
        export = case.export(options)
        states = list(tensors(lazy))
        assert states and all(is_lazy(t) for t in states)
        assert [t.shape for t in states] == [t.shape for t in tensors(export)]
        assert [t.dtype for t in states] == [t.dtype for t in tensors(export)]
    with pytest.raises(ValueError, match="full_state_dict=True"):
        lazy_optimizer_state_dict(
            case.model, case.opt, options=StateDictOptions(full_state_dict=True)
        )
    with pytest.raises(ValueError, match="valid values are 'cpu'"):
        lazy_optimizer_state_dict(case.model, case.opt, placement=None)
    with pytest.raises(ValueError, match="StateDictOptions"):
        lazy_optimizer_state_dict(case.model, case.opt, options={"x": 1})  # type: ignore[arg-type]


def test_lazy_state_dict_refuses_fsdp1(monkeypatch: pytest.MonkeyPatch) -> None:
    from torch.distributed.fsdp import FullyShardedDataParallel

    case = plain_case(BF16, "fp32")
    # Building an FSDP1 model needs a process group; what the check asks torch is faked.
    monkeypatch.setattr(FullyShardedDataParallel, "fsdp_modules", lambda module: [module])
    with pytest.raises(ValueError, match="FSDP1"):
        lazy_optimizer_state_dict(case.model, case.opt)


def test_lazy_state_refuses_what_it_cannot_do() -> None:
    case = plain_case(FP16, "fp32")
    lazy = lazy_optimizer_state_dict(case.model, case.opt, options=FLAT)
    state = next(v for k, v in lazy.items() if k.startswith("state."))
    assert isinstance(state, LazyState) and "LazyState(kind='scaled'" in repr(state)
    assert not state.is_pinned()
    for op in (lambda: torch.add(state, 1), lambda: state.sum(), lambda: state.clone()):
        with pytest.raises(TypeError, match="streaming-save placeholder holds no data"):
            op()
    with pytest.raises(TypeError, match="SnapshotStager"):
        copy.deepcopy(lazy)
    with pytest.raises(TypeError, match=r"cannot be pickled.*SnapshotStager"):
        pickle.dumps(state)
    # torch's stagers copy every tensor: staging a lazy dict through them fails loudly.
    with pytest.raises(TypeError, match="SnapshotStager"):
        PassThroughStager().stage({"optim": lazy})
    # Offloading to the CPU is a no-op for these CPU-device placeholders.
    assert state.to("cpu") is state


def test_lazy_state_dict_of_other_optimizers_is_their_export() -> None:
    torch.manual_seed(0)
    model = torch.nn.Linear(3, 4)
    adam = torch.optim.Adam(model.parameters())
    model(torch.randn(2, 3)).sum().backward()
    adam.step()
    lazy = lazy_optimizer_state_dict(model, adam, options=FLAT)
    assert not any(is_lazy(t) for t in tensors(lazy))
    assert_same_export(lazy, get_optimizer_state_dict(model, adam, options=FLAT))


def test_lazy_state_dict_of_a_fresh_optimizer_runs_dcps_fake_step() -> None:
    case = checks.Case(CPU, None, BF16, "fp32", seed=3)
    assert not case.opt.state
    lazy = lazy_optimizer_state_dict(case.model, case.opt, options=FLAT)
    # As with the export: the fake step created the states and counted one step.
    export_case = checks.Case(CPU, None, BF16, "fp32", seed=3)
    export = export_case.export()
    checks.assert_lazy_like(lazy, export, "fresh")
    assert case.opt.state and all(g["step"] == 1 for g in case.opt.param_groups)


def test_resolve_loaded_keeps_current_values_for_skipped_keys() -> None:
    case = plain_case(BF16, "fp32")
    export = case.export()
    lazy = lazy_optimizer_state_dict(case.model, case.opt, options=FLAT)
    keys = [k for k in lazy if k.startswith("state.")]
    target = lazy[keys[0]]
    target.__create_chunk_list__()  # load planning made it a target ...
    loaded = target.__get_tensor_shard__(None)  # type: ignore[arg-type]
    assert target.__get_tensor_shard__(None) is loaded  # type: ignore[arg-type]
    loaded.fill_(7.0)  # ... and DCP read into it
    resolved = resolve_loaded(lazy)
    assert resolved is not lazy and not any(is_lazy(t) for t in tensors(resolved))
    assert torch.all(resolved[keys[0]] == 7.0)
    for key in keys[1:]:  # not read: the current value, as the export template holds it
        assert torch.equal(bits(resolved[key]), bits(export[key])), key
    plain = {"a": torch.ones(2), "b": [1, (2, 3)]}
    assert resolve_loaded(plain) is plain


def test_ledger_warns_once_outside_a_releasing_writer(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(lazy_state_module, "WARN_ALIVE_ITEMS", 2)
    monkeypatch.setattr(lazy_state_module, "WARN_ALIVE_BYTES", 0)
    case = plain_case(BF16, "remainder", layers=3)
    lazy = lazy_optimizer_state_dict(case.model, case.opt, options=FLAT)
    states = [v for k, v in lazy.items() if k.startswith("state.")]
    with released_after_write():
        with warnings.catch_warnings():
            warnings.simplefilter("error", RuntimeWarning)
            kept = [s.produce() for s in states]
    assert checks.produced(lazy)["peak_alive"] == len(states)
    del kept
    with pytest.warns(RuntimeWarning, match="StreamingWriter") as caught:
        kept = [s.produce() for s in states]
    assert len(caught) == 1  # once per state dict
    del kept
    assert checks.produced(lazy)["produced"] == 2 * len(states)


# --- StreamingWriter ----------------------------------------------------------------------------
@pytest.mark.parametrize(("threads", "lookahead", "single"), [(1, 0, True), (1, 1, True),
                         (2, 1, True), (3, 2, False)])  # fmt: skip
def test_streaming_writer_bounds_what_is_alive(
    tmp_path: Path, threads: int, lookahead: int, single: bool
) -> None:
    case = plain_case(FP8, "remainder", layers=5)
    ref = case.reference()
    lazy = lazy_optimizer_state_dict(case.model, case.opt, options=FLAT)
    n = checks.n_states(lazy)
    writer = StreamingWriter(
        tmp_path, thread_count=threads, lookahead=lookahead, single_file_per_rank=single
    )
    no_dist_save({"model": case.model.state_dict(), "optim": lazy}, writer)
    report = writer.last_report
    assert report is not None and report.path == "streaming_save" and not report.failed
    assert last_report() == report  # the thread that ran the synchronous save
    stats = report.details
    assert stats["produced"] == n
    assert 1 <= stats["peak_alive"] <= threads + lookahead, report
    files = [p for p in tmp_path.iterdir() if p.suffix == ".distcp"]
    items = len(lazy) + len(ref["model"])  # states, param_groups entries, weights
    assert len(files) == (min(threads, items) if single else items)
    checks.assert_loads(case, tmp_path, ref, "no_dist")


def test_streaming_writer_rejects_bad_arguments(tmp_path: Path) -> None:
    from torch.distributed.checkpoint.filesystem import SerializationFormat

    for bad in (0, -1, 1.5):
        with pytest.raises(ValueError, match="thread_count"):
            StreamingWriter(tmp_path, thread_count=bad)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="lookahead"):
        StreamingWriter(tmp_path, lookahead=-1)
    with pytest.raises(ValueError, match="TORCH_SAVE"):
        StreamingWriter(tmp_path, serialization_format=SerializationFormat.SAFETENSORS)
    with pytest.raises(ValueError, match="SnapshotStager"):
        StreamingWriter(tmp_path, stager=PassThroughStager())  # type: ignore[arg-type]


def test_streaming_writer_failure_keeps_previous_checkpoint(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    case = plain_case(BF16, "remainder", layers=4)
    ref_a = case.reference()
    no_dist_save(
        {"model": case.model.state_dict(), "optim": case.lazy()}, StreamingWriter(tmp_path)
    )
    files_a = {p.name for p in tmp_path.iterdir()}
    case.train(1, seed=9)
    before = snapshot(case.opt)
    original = engine.materialize
    failing = nth_call_raises(4, checks.InjectedError("injected write failure"), original)
    monkeypatch.setattr(engine, "materialize", failing)
    with pytest.raises(BaseException, match="injected write failure"):  # CheckpointException
        no_dist_save(
            {"model": case.model.state_dict(), "optim": case.lazy()},
            StreamingWriter(tmp_path, thread_count=3),
        )
    monkeypatch.setattr(engine, "materialize", original)
    assert {p.name for p in tmp_path.iterdir()} == files_a, "files of the failed save remain"
    after = snapshot(case.opt)
    for p, names in before.items():
        for name, value in names.items():
            assert torch.equal(after[p][name], value), f"the failed save changed {name}"
    checks.assert_loads(case, tmp_path, ref_a, "previous checkpoint")
    ref_c = case.reference()
    no_dist_save(
        {"model": case.model.state_dict(), "optim": case.lazy()}, StreamingWriter(tmp_path)
    )
    files_c = {p.name for p in tmp_path.iterdir()}
    assert files_c & files_a == {".metadata"}, f"replaced files kept: {files_c & files_a}"
    checks.assert_loads(case, tmp_path, ref_c, "next checkpoint")


class _RunsOnUnpickle:
    """A pickle whose loading creates ``marker``: what a crafted ``.metadata`` can do."""

    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self) -> Any:
        return (Path.touch, (self.marker,))


def test_streaming_writer_never_unpickles_the_old_metadata(tmp_path: Path) -> None:
    marker = tmp_path.parent / f"{tmp_path.name}_unpickled"
    (tmp_path / ".metadata").write_bytes(pickle.dumps(_RunsOnUnpickle(marker)))
    pickle.loads(pickle.dumps(_RunsOnUnpickle(marker)))
    assert marker.exists(), "the crafted pickle has no side effect to observe"
    marker.unlink()
    case = plain_case(BF16, "remainder")
    ref = case.reference()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        no_dist_save(
            {"model": case.model.state_dict(), "optim": case.lazy()}, StreamingWriter(tmp_path)
        )
    assert not marker.exists(), "saving into the directory ran its old .metadata pickle"
    assert not [w for w in caught if issubclass(w.category, RuntimeWarning)], caught
    checks.assert_loads(case, tmp_path, ref, "after a crafted .metadata")


def _fixed_tag(monkeypatch: pytest.MonkeyPatch, tag: str) -> None:
    """The next saves' data files are named with ``tag`` (StreamingWriter's uuid, fixed)."""
    fixed = uuid.UUID(tag + "0" * 20)
    monkeypatch.setattr(writer_module, "uuid", SimpleNamespace(uuid4=lambda: fixed))


def test_streaming_writer_deletes_only_data_files_of_its_earlier_saves(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    case = plain_case(BF16, "remainder")
    ref = case.reference()
    tag = "0123456789ab"
    mine = {f"__0_{tag}_{n}.distcp" for n in range(2)}  # this save's files (2 threads)
    earlier = {"__0_aaaaaaaaaaaa_0.distcp", "__3_bbbbbbbbbbbb_12.distcp"}  # earlier saves'
    others = {
        "__0_0.distcp",
        "keep.txt",
        "__0_cccccccccccc_0.distcp.tmp",
        "__0_DDDDDDDDDDDD_0.distcp",
    }
    for name in earlier | others:
        (tmp_path / name).write_bytes(b"x")
    (tmp_path / "__1_eeeeeeeeeeee_0.distcp").mkdir()  # the pattern's name, not a file
    # An old .metadata that lists the new .metadata, this save's own files and other files.
    listed = sorted(mine | others | {".metadata"})
    storage = {MetadataIndex(f"k{i}"): _StorageInfo(name, 0, 1) for i, name in enumerate(listed)}
    (tmp_path / ".metadata").write_bytes(pickle.dumps(Metadata({}, storage_data=storage)))
    _fixed_tag(monkeypatch, tag)
    no_dist_save(
        {"model": case.model.state_dict(), "optim": case.lazy()},
        StreamingWriter(tmp_path, thread_count=2),
    )
    names = {p.name for p in tmp_path.iterdir()}
    assert names == mine | others | {".metadata", "__1_eeeeeeeeeeee_0.distcp"}, sorted(names)
    checks.assert_loads(case, tmp_path, ref, "after an old .metadata listing the new files")
    # The next save replaces this one's files and leaves the rest.
    _fixed_tag(monkeypatch, "fedcba987654")
    no_dist_save(
        {"model": case.model.state_dict(), "optim": case.lazy()}, StreamingWriter(tmp_path)
    )
    names = {p.name for p in tmp_path.iterdir()}
    expected = others | {".metadata", "__1_eeeeeeeeeeee_0.distcp", "__0_fedcba987654_0.distcp"}
    assert names == expected, sorted(names)
    checks.assert_loads(case, tmp_path, ref, "next save")


def test_streaming_writer_keeps_files_that_appear_while_it_writes(tmp_path: Path) -> None:
    # A file of the writer's pattern made after the save began (another save's, started
    # later) is not one that this save replaces.
    later = tmp_path / "__1_abcdefabcdef_0.distcp"

    class Interleaved(StreamingWriter):
        def write_data(self, plan: Any, planner: Any) -> Any:
            later.write_bytes(b"x")
            return super().write_data(plan, planner)

    case = plain_case(BF16, "fp32")
    ref = case.reference()
    no_dist_save({"model": case.model.state_dict(), "optim": case.lazy()}, Interleaved(tmp_path))
    assert later.exists(), "a file that appeared during the save was deleted"
    checks.assert_loads(case, tmp_path, ref, "interleaved file")


def test_streaming_writer_without_collectives_replaces_only_its_ranks_files(
    tmp_path: Path,
) -> None:
    # use_collectives=False: every rank finishes its own save (__<rank>.metadata), so it
    # deletes only data files of its own rank.
    own, other = tmp_path / "__0_aaaaaaaaaaaa_0.distcp", tmp_path / "__1_aaaaaaaaaaaa_0.distcp"
    own.write_bytes(b"x")
    other.write_bytes(b"x")
    case = plain_case(BF16, "fp32")
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", "torch.distributed is disabled", UserWarning)
        dcp.save(
            {"model": case.model.state_dict(), "optim": case.lazy()},
            storage_writer=StreamingWriter(tmp_path),
            no_dist=True,
            use_collectives=False,
        )
    assert (tmp_path / "__0.metadata").is_file()
    assert not own.exists(), "the rank's earlier data file was kept"
    assert other.exists(), "another rank's data file was deleted"


# --- SnapshotStager -----------------------------------------------------------------------------
def staged_sources(staged: Any) -> Iterator[LazyState]:
    for t in tensors(staged):
        if is_lazy(t):
            yield local(t)


def test_snapshot_stager_copies_raw_bytes_and_isolates_training(tmp_path: Path) -> None:
    case = plain_case(FP8, "remainder", layers=3)
    ref = case.reference()
    weight = torch.arange(6.0)
    exported = case.export()  # a streaming export's tensors are passed through
    exported_state = next(v for k, v in exported.items() if k.startswith("state."))
    state_dict = {
        "model": case.model.state_dict(),
        "optim": lazy_optimizer_state_dict(case.model, case.opt, options=FLAT),
        "extra": {"w": weight, "export": exported_state, "nested": [1, ("a", 2.5)]},
    }
    frozen = {k: v for k, v in state_dict.items() if k != "optim"}
    frozen = copy.deepcopy(frozen)
    stager = SnapshotStager()
    staged = stager.stage(state_dict)
    stats = checks.snapshot_details(stager)
    assert last_report() == stager.last_report
    assert stats["raw_bytes"] == checks.raw_bytes(case.opt), stats
    assert stats["other_bytes"] == checks.model_bytes(case.model) + weight.numel() * 4, stats
    assert stats["passed_through"] == 1 and stats["converted_bytes"] == 0, stats
    assert stats["allocated_bytes"] == stats["raw_bytes"] + stats["other_bytes"]
    assert staged["extra"]["export"] is exported_state
    assert staged["extra"]["nested"] == [1, ("a", 2.5)]
    assert staged["extra"]["w"].data_ptr() != weight.data_ptr()
    live = {
        getattr(local(v), "_data", local(v)).untyped_storage().data_ptr()
        for states in case.opt.state.values()
        for v in states.values()
    }
    for lazy in staged_sources(staged):
        assert lazy.source.data is not None
        assert lazy.source.data.untyped_storage().data_ptr() not in live, "reads the live state"
        if lazy.source.scale is not None:
            assert lazy.source.scale.device.type == "cpu"
    assert checks.produced(staged["optim"])["produced"] == 0  # still lazy
    # The caller's dict is untouched; training after staging does not reach the snapshot.
    assert_same_export({k: v for k, v in state_dict.items() if k != "optim"}, frozen)
    case.train(1, seed=5)
    weight.add_(1)
    assert not checks.same_bits(case.model_bits(), ref["model"])
    no_dist_save(staged, StreamingWriter(tmp_path))
    checks.assert_loads(case, tmp_path, ref, "snapshot then step")


def test_snapshot_stager_reuses_idle_buffers_only() -> None:
    case = plain_case(BF16, "remainder")
    stager = SnapshotStager()

    def stage() -> tuple[dict[str, Any], set[int]]:
        staged = stager.stage({"optim": case.lazy(), "model": case.model.state_dict()})
        ptrs = {local(t).untyped_storage().data_ptr() for t in tensors(staged)
                if not is_lazy(t)}  # fmt: skip
        ptrs |= {s.source.data.untyped_storage().data_ptr() for s in staged_sources(staged)}  # type: ignore[union-attr]
        return staged, ptrs

    first, ptrs1 = stage()
    stats = checks.snapshot_details(stager)
    total = stats["raw_bytes"] + stats["other_bytes"]
    assert stager.buffer_bytes == total
    kept_values = [bits(t).clone() for t in tensors(first) if not is_lazy(t)]
    case.train(1, seed=3)
    second, ptrs2 = stage()  # the first is still referenced: fresh buffers, nothing overwritten
    assert checks.snapshot_details(stager)["allocated_bytes"] == total
    assert not ptrs1 & ptrs2
    assert all(
        torch.equal(bits(t), v)
        for t, v in zip([t for t in tensors(first) if not is_lazy(t)], kept_values,
                        strict=True)
    )  # fmt: skip
    del first
    assert stager.buffer_bytes == total  # the first round's buffers were released
    del second
    third, ptrs3 = stage()
    assert checks.snapshot_details(stager)["allocated_bytes"] == 0
    assert ptrs3 == ptrs2
    del third
    stager.close()
    assert stager.buffer_bytes == 0


def test_snapshot_stager_converts_device_states_at_staging(tmp_path: Path) -> None:
    case = plain_case(FP16, "fp32")
    ref = case.reference()
    lazy = lazy_optimizer_state_dict(
        case.model, case.opt, options=FLAT, placement=Placement(conversion="device")
    )
    kinds = {k: v.source.kind for k, v in lazy.items() if k.startswith("state.")}
    assert set(kinds.values()) == {"device", "copy"}, kinds
    stager = SnapshotStager(pin_memory=False)
    staged = stager.stage({"model": case.model.state_dict(), "optim": lazy})
    assert checks.snapshot_details(stager)["converted_bytes"] > 0
    for key, kind in kinds.items():
        assert is_lazy(staged["optim"][key]) == (kind != "device"), key
    case.train(1, seed=4)
    no_dist_save(staged, StreamingWriter(tmp_path))
    checks.assert_loads(case, tmp_path, ref, "device conversion at staging")
    with pytest.raises(ValueError, match="pin_memory"):
        SnapshotStager(pin_memory=1)  # type: ignore[arg-type]


# --- PlacedOptimizerState(save=...) -------------------------------------------------------------
def test_placed_optimizer_state_save_option(tmp_path: Path) -> None:
    case = plain_case(BF16, "remainder")
    with pytest.raises(ValueError, match="valid values are 'export'"):
        PlacedOptimizerState(case.model, case.opt, save="lazy")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="placement=None"):
        PlacedOptimizerState(case.model, case.opt, placement=None, save="streaming")
    state = PlacedOptimizerState(case.model, case.opt, save="streaming")
    assert state.save == "streaming"
    lazy = state.state_dict()
    checks.assert_lazy_like(lazy, case.export(), "adapter")
    ref = case.reference()
    no_dist_save({"model": case.model.state_dict(), "optim": state}, StreamingWriter(tmp_path))
    fresh = case.fresh(seed=7)
    target = PlacedOptimizerState(fresh.model, fresh.opt, save="streaming")
    loaded_model = {k: torch.zeros_like(v) for k, v in fresh.model.state_dict().items()}
    no_dist_load({"model": loaded_model, "optim": target}, tmp_path)
    fresh.model.load_state_dict(loaded_model)
    checks.assert_same_optimizer(fresh, case, "adapter round trip")
    assert_same_export(fresh.export(), checks.host_copy(ref["optim"]))
    assert PlacedOptimizerState(case.model, case.opt).save == "export"


# --- 2 ranks ------------------------------------------------------------------------------------
def _worker(rank: int, port: int, root: str) -> None:
    import gc

    mesh = init_gloo_mesh(rank, port, timeout_s=180)
    warnings.filterwarnings("ignore", "Ignoring pin_memory", UserWarning)
    # Async saves run their collectives in a background thread, on groups of their own.
    pgs = (dist.new_group(backend="gloo"), dist.new_group(backend="gloo"))
    base = Path(root)
    try:
        checks.check_streaming_save(CPU, mesh, base, [(BF16, "remainder"), (FP16, "fp32")])
        checks.check_stock_writers(CPU, mesh, base)
        checks.check_snapshot_async(CPU, mesh, pgs, base, [(BF16, "remainder"), (FP16, "fp32")])
        checks.check_process_async(CPU, mesh, pgs[0], base, [(BF16, "remainder"), (FP16, "fp32")])
        checks.check_resharding(CPU, mesh, pgs[0], base)
        checks.check_failed_save(CPU, mesh, base)
        # The GPU test's memory check, on a small model: its code paths, not its bounds.
        checks.check_memory_bounds(CPU, mesh, pgs[0], base, dims=(64, 48, 64))
        gc.collect()
    finally:
        dist.destroy_process_group()


def test_dcp_save_on_two_ranks(tmp_path: Path) -> None:
    spawn(_worker, str(tmp_path))
    for ckpt in ("streaming0_2_1", "snapshot1_2", "processprocess1_1", "reshard_async", "failed",
                 "stock_0"):  # fmt: skip
        assert (tmp_path / ckpt / ".metadata").is_file(), f"{ckpt}: no checkpoint"


def test_snapshot_buffers_are_not_reused_while_their_storage_is_held() -> None:
    # As the exports' pool: a storage object held outside the pool keeps its buffer.
    from te_ckpt_placement._pool import HostPool

    pool = HostPool(keep_busy=False)  # as SnapshotStager's
    first = pool.take(torch.Size([4]), torch.float32, key="k", pinned=False)
    first.fill_(1.0)
    held = first.untyped_storage()
    del first
    pool.end_round()
    second = pool.take(torch.Size([4]), torch.float32, key="k", pinned=False)
    second.fill_(2.0)
    assert torch.empty(0).set_(held, 0, (4,)).tolist() == [1.0] * 4
    del second, held
    pool.end_round()
    ptr = pool.take(torch.Size([4]), torch.float32, key="k", pinned=False).data_ptr()
    pool.end_round()
    assert pool.take(torch.Size([4]), torch.float32, key="k", pinned=False).data_ptr() == ptr
