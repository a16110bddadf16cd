"""The raw snapshot across processes, and the host budget, against the CPU stand-in.

In process: snapshot states pickle as shared-memory handles and their conversion recipe (no
copy, nothing of the optimizer), while streaming placeholders keep refusing; one rank (gloo)
saves with ``AsyncCheckpointerType.PROCESS`` and ``THREAD`` through ``StreamingWriter`` and
torch's ``FileSystemWriter``; the host budget warns once per path with a monkeypatched
``/proc/meminfo``. The 2-rank process save runs in ``test_dcp_save.py``'s spawn.
"""

from __future__ import annotations

import io
import pickle
import warnings
from collections.abc import Iterator
from multiprocessing.reduction import ForkingPickler
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.state_dict_saver import AsyncCheckpointerType

import te_ckpt_placement
from te_ckpt_placement import HostBudgetWarning, _host_budget
from te_ckpt_placement.dcp import (
    LazyState,
    PlacedOptimizerState,
    SnapshotStager,
    StreamingWriter,
    is_lazy,
)

from .support import dcp_save_checks as checks
from .support.backends import CPU
from .support.distributed import free_port
from .support.helpers import bits, local, tensors

pytestmark = pytest.mark.usefixtures("hooked_standin")

BF16, FP16, FP8 = torch.bfloat16, torch.float16, torch.uint8


def plain_case(moments: torch.dtype, master: str, seed: int = 0) -> checks.Case:
    case = checks.Case(CPU, None, moments, master, seed=seed, dims=(3, 5, 4))
    case.train(2, seed=seed + 1)
    return case


def staged_states(staged: Any) -> list[LazyState]:
    return [local(t) for t in tensors(staged) if is_lazy(t)]


def forking_round_trip(obj: Any) -> Any:
    """``obj`` through the pickler ``torch.multiprocessing`` pipes use (DCP's process executor)."""
    buf = io.BytesIO()
    ForkingPickler(buf, pickle.HIGHEST_PROTOCOL).dump(obj)
    return pickle.loads(buf.getvalue())


@pytest.mark.parametrize(
    ("moments", "master"), [(BF16, "remainder"), (FP16, "fp32"), (FP8, "fp32")]
)
def test_snapshot_states_pickle_as_shared_memory_without_the_optimizer(
    moments: torch.dtype, master: str
) -> None:
    case = plain_case(moments, master)
    ref = case.reference()["optim"]
    stager = SnapshotStager()
    staged = stager.stage({"optim": case.lazy()})
    states = staged_states(staged)
    assert states
    live = {
        getattr(local(v), "_data", local(v)).untyped_storage().data_ptr()
        for per_param in case.opt.state.values()
        for v in per_param.values()
    }
    pointers = []
    for state in states:
        source = state.source
        assert source.on_device is None and state._stream is None, "references the optimizer"
        for t in (source.data, source.scale):
            if t is not None:
                assert t.device.type == "cpu" and t.is_shared(), "not staged in shared memory"
                assert t.untyped_storage().data_ptr() not in live
                pointers.append(t.untyped_storage().data_ptr())
    received = forking_round_trip(staged)
    # Pickling moved nothing: the buffers were shared already (a move is a copy).
    assert [
        t.untyped_storage().data_ptr()
        for s in states
        for t in (s.source.data, s.source.scale)
        if t is not None
    ] == pointers
    case.train(1, seed=7)  # training after staging reaches neither side
    for key, state in received["optim"].items():
        if key.startswith("state."):
            assert isinstance(state, LazyState)
            assert torch.equal(bits(state.produce()), bits(ref[key])), key
    # Both sides map the same memory: a write through the sender shows in the receiver.
    first = next(s for s in staged_states(received))
    assert first.source.data is not None and states[0].source.data is not None
    states[0].source.data.view(torch.uint8)[0] ^= 0xFF
    assert torch.equal(first.source.data.view(torch.uint8), states[0].source.data.view(torch.uint8))
    # A plain pickle (by value) works too.
    plain = pickle.loads(pickle.dumps(staged_states(stager.stage({"optim": case.lazy()}))[0]))
    assert isinstance(plain, LazyState) and plain.produce().dtype == plain.dtype


def test_streaming_placeholders_keep_refusing_to_be_pickled() -> None:
    case = plain_case(BF16, "fp32")
    state = next(s for s in tensors(case.lazy()) if is_lazy(s))
    for dump in (pickle.dumps, forking_round_trip):
        with pytest.raises(
            TypeError, match=r"live optimizer state cannot be pickled.*SnapshotStager"
        ):
            dump(state)


def test_a_writer_with_its_stager_pickles_without_buffers(tmp_path: Path) -> None:
    writer = StreamingWriter(tmp_path, stager=SnapshotStager(pin_memory=False))
    case = plain_case(BF16, "fp32")
    writer.stage({"optim": case.lazy()})
    assert writer.stager.buffer_bytes > 0
    copy = pickle.loads(pickle.dumps(writer))
    assert copy.stager.buffer_bytes == 0 and copy.stager.pin_memory is False
    with pytest.raises(ValueError, match="shared_memory"):
        SnapshotStager(shared_memory="yes")  # type: ignore[arg-type]
    private = SnapshotStager(shared_memory=False)
    staged = private.stage({"optim": case.lazy()})
    assert not any(s.source.data.is_shared() for s in staged_states(staged))  # type: ignore[union-attr]


@pytest.fixture
def one_rank() -> Iterator[Any]:
    """A gloo group of one rank in this process, and DCP's writer process ended afterwards."""
    from torch.distributed.checkpoint import _async_process_executor as executor

    dist.init_process_group(
        "gloo", rank=0, world_size=1, init_method=f"tcp://127.0.0.1:{free_port()}"
    )
    try:
        yield dist.new_group(backend="gloo")
    finally:
        process, executor._CHECKPOINT_PROCESS = executor._CHECKPOINT_PROCESS, None
        del process  # its __del__ ends the writer process
        dist.destroy_process_group()


@pytest.mark.parametrize("kind", [AsyncCheckpointerType.PROCESS, AsyncCheckpointerType.THREAD])
def test_async_save_with_the_snapshot_on_one_rank(
    tmp_path: Path, one_rank: Any, kind: AsyncCheckpointerType
) -> None:
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", "Ignoring pin_memory", UserWarning)
        checks.check_process_async(
            CPU, None, one_rank, tmp_path, [(BF16, "remainder"), (FP8, "remainder")], kind=kind
        )


# --- the host budget ----------------------------------------------------------------------------
@pytest.fixture
def meminfo(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Any:
    """Sets MemAvailable (bytes) of a fake /proc/meminfo; every path warns anew."""
    path = tmp_path / "meminfo"
    monkeypatch.setattr(_host_budget, "MEMINFO", str(path))
    monkeypatch.setattr(_host_budget, "_warned", set())

    def set_available(nbytes: int) -> None:
        path.write_text(f"MemTotal:  99999999 kB\nMemAvailable: {nbytes // 1024} kB\n")

    return set_available


def budget_warnings(caught: list[warnings.WarningMessage]) -> list[str]:
    return [str(w.message) for w in caught if issubclass(w.category, HostBudgetWarning)]


def test_host_budget_reads_meminfo_per_local_rank(
    meminfo: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    meminfo(8 << 30)
    assert _host_budget.available_bytes() == 8 << 30
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "4")
    assert _host_budget.available_bytes() == 2 << 30
    monkeypatch.setattr(_host_budget, "MEMINFO", "/nonexistent/meminfo")
    assert _host_budget.available_bytes() is None
    assert not _host_budget.check("export", 1 << 60, fits="x")  # nothing known: no warning
    assert te_ckpt_placement.HostBudgetWarning is HostBudgetWarning


def test_host_budget_warns_once_per_save_path(
    tmp_path: Path, meminfo: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    case = plain_case(BF16, "remainder")
    export = _host_budget.export_bytes(case.opt.state.values())
    assert export == sum(
        local(t).numel() * t.element_size() for t in tensors(case.export()) if t.dim() > 0
    )
    meminfo(1 << 40)  # plenty: silent
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        PlacedOptimizerState(case.model, case.opt).state_dict()
        SnapshotStager().stage({"optim": case.lazy()})
    assert not budget_warnings(caught)

    meminfo(0)  # nothing left for this rank: every path is over
    monkeypatch.setattr(_host_budget, "STREAMING_OVERHEAD_BYTES", 0)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for _ in range(2):
            PlacedOptimizerState(case.model, case.opt).state_dict()
    messages = budget_warnings(caught)
    assert len(messages) == 1, messages  # once
    assert "export save" in messages[0] and "twice" in messages[0], messages[0]
    assert "SnapshotStager" in messages[0] and "StreamingWriter" in messages[0], messages[0]

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for n in range(2):
            staged = SnapshotStager().stage({"optim": case.lazy()})
            with warnings.catch_warnings():
                warnings.filterwarnings("ignore", "torch.distributed is disabled", UserWarning)
                dcp.save(
                    staged, storage_writer=StreamingWriter(tmp_path / f"budget{n}"), no_dist=True
                )
    messages = budget_warnings(caught)
    assert [m.split(" save ")[0] for m in messages] == [
        "te_ckpt_placement: this snapshot",
        "te_ckpt_placement: this streaming_save",
    ], messages
    assert (tmp_path / "budget1" / ".metadata").is_file()  # warned, never refused


def test_prewarm_makes_the_buffers_the_first_stage_reuses() -> None:
    """A stage after ``prewarm`` allocates nothing (issue 20: the first snapshot save blocks
    only for its copies) and holds the same bits as a stage without it."""
    case = plain_case(BF16, "remainder", seed=7)
    cold = SnapshotStager(pin_memory=False)
    expected = _produced(cold.stage({"optim": case.lazy()}))
    assert cold.last_report is not None and cold.last_report.details["allocated_bytes"] > 0
    stager = SnapshotStager(pin_memory=False)
    state = PlacedOptimizerState(case.model, case.opt, save="streaming")
    kept = stager.prewarm({"optim": state})
    assert kept == stager.buffer_bytes > 0
    staged = stager.stage({"optim": state.state_dict()})
    report = stager.last_report
    assert report is not None and report.details["allocated_bytes"] == 0, report
    got = _produced(staged)
    assert got.keys() == expected.keys() and got
    for key, value in got.items():
        assert torch.equal(value, expected[key]), key
    stager.close()
    cold.close()
    assert stager.buffer_bytes == 0


def _produced(staged: Any) -> dict[str, torch.Tensor]:
    """The bits each staged lazy state of ``staged["optim"]`` produces, by key."""
    return {k: bits(local(v).produce()) for k, v in staged["optim"].items() if is_lazy(v)}


def test_prewarm_of_a_fresh_optimizer_leaves_it_fresh_and_fits_its_first_save() -> None:
    """At setup the optimizer has no states: prewarm sizes them from TE's initial states and
    takes them back (no fake step: TE's first step stays its first), and the first save after
    training started reuses what it made."""
    case = checks.Case(CPU, None, BF16, "remainder", seed=11, dims=(3, 5, 4))
    steps = [group.get("step") for group in case.opt.param_groups]
    stager = SnapshotStager(pin_memory=False)
    state = PlacedOptimizerState(case.model, case.opt, save="streaming")
    assert stager.prewarm({"optim": state}) > 0
    assert not case.opt.state and [g.get("step") for g in case.opt.param_groups] == steps
    case.train(1, seed=12)
    stager.stage({"optim": state.state_dict()})
    report = stager.last_report
    assert report is not None and report.details["allocated_bytes"] == 0, report
    stager.close()


def test_prewarm_refuses_a_fresh_optimizer_that_is_not_te_and_takes_a_stepped_one() -> None:
    """A torch optimizer without states has no TE initial states to be sized from, and its
    export would run torch's fake step (a changed training): refused before anything is
    staged. Once it has stepped, it stages like any other."""
    model = torch.nn.Linear(4, 3)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    stager = SnapshotStager(pin_memory=False)
    state = PlacedOptimizerState(model, opt, save="streaming")
    with pytest.raises(
        ValueError, match=r"'optim' holds an optimizer of type AdamW, not a TE FusedAdam"
    ):
        stager.prewarm({"optim": state})
    assert not opt.state and stager.buffer_bytes == 0  # no fake step, nothing kept
    model(torch.ones(2, 4)).sum().backward()
    opt.step()
    assert stager.prewarm({"optim": state}) > 0
    stager.close()


@pytest.mark.parametrize("host_workers, pooled", [(0, False), (None, True)])
def test_the_adapters_host_workers_reach_the_writer(
    monkeypatch: pytest.MonkeyPatch, host_workers: int | None, pooled: bool
) -> None:
    """``Placement(host_workers=0)`` means no workers in the streaming save's producers and in a
    pickled snapshot's conversions too (the writer process), not the default pool."""
    from te_ckpt_placement import Placement, _workers

    from .support.workers import small_team

    monkeypatch.setenv(_workers.ENV, "2")  # the default, whatever torch's thread count
    case = plain_case(FP16, "fp32", seed=21)
    placement = Placement(device="cpu", host_workers=host_workers)
    state = PlacedOptimizerState(case.model, case.opt, save="streaming", placement=placement)
    calls: list[int] = []
    real = _workers._hand_over  # the one way work reaches the team
    monkeypatch.setattr(_workers, "_hand_over", lambda *args: calls.append(1) or real(*args))
    lazies = [local(v) for v in state.state_dict().values() if is_lazy(v)]
    staged = SnapshotStager(pin_memory=False).stage({"optim": state.state_dict()})
    received = [forking_round_trip(s) for s in staged_states(staged)]
    with small_team(2, elements=8, block=8):
        for lazy in (*lazies, *received):
            lazy.produce()
    assert bool(calls) is pooled, calls
