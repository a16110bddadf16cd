"""Kept output buffers and the staging pool: never reused while reachable, bounded, and safe
against an asynchronous KeyboardInterrupt at any point of an export."""

from __future__ import annotations

import sys
import warnings
from collections.abc import Callable, Iterator
from typing import Any

import pytest
import torch
import torch.distributed as dist

from te_ckpt_placement import _export as engine
from te_ckpt_placement import _pool, _ring, export_placement, pinned_pool_bytes, release_buffers

from .support.helpers import assert_same_export, exported_tensors
from .support.standin import StandInFusedAdam, make_optimizer, train

pytestmark = pytest.mark.usefixtures("hooked_standin")


def optimizer(moments: torch.dtype = torch.float32) -> StandInFusedAdam:
    gen = torch.Generator().manual_seed(0)
    params = [torch.nn.Parameter(torch.randn(s, generator=gen)) for s in [(64, 33), (1000,)]]
    opt = make_optimizer(params, moments=moments)
    train(opt)
    return opt


def export(opt: StandInFusedAdam, *, reuse_buffers: bool = True) -> dict[str, Any]:
    with export_placement("cpu", reuse_buffers=reuse_buffers):
        return opt.state_dict()


def reference(opt: StandInFusedAdam) -> dict[str, Any]:
    with export_placement(None):
        return opt.state_dict()


def ptrs(state_dict: dict[str, Any]) -> set[int]:
    return {t.untyped_storage().data_ptr() for t in exported_tensors(state_dict) if t.numel()}


def nbytes(state_dict: dict[str, Any]) -> int:
    return sum(t.untyped_storage().nbytes() for t in exported_tensors(state_dict))


@pytest.fixture
def clean() -> Iterator[None]:
    release_buffers()
    yield
    release_buffers()


@pytest.fixture
def one_rank_mesh() -> Iterator[Any]:
    from torch.distributed.device_mesh import DeviceMesh

    if dist.is_initialized():
        pytest.skip("a process group is already initialized in this process")
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        yield DeviceMesh("cpu", [0])
    finally:
        dist.destroy_process_group()


# --- issue 15.2: every kind of reference keeps a buffer from reuse ----------------------------


def _pass_through_staged(t: torch.Tensor) -> Any:
    from te_ckpt_placement.dcp import PassThroughStager

    stager = PassThroughStager()
    try:
        return stager.stage({"state": {0: {"exp_avg": t}}})
    finally:
        stager.close()


def _typed_storage(t: torch.Tensor) -> Any:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # TypedStorage is deprecated, and still used
        return t.storage()


# Each holder returns something that reaches the tensor's memory, and nothing else of it.
HOLDERS: dict[str, Callable[[torch.Tensor], Any]] = {
    "tensor": lambda t: t,
    "view": lambda t: t.view(-1)[1:],
    "untyped_storage": lambda t: t.untyped_storage(),
    "storage": _typed_storage,
    "numpy": lambda t: t.numpy(),
    "memoryview": lambda t: memoryview(t.numpy()),
    "dlpack": lambda t: torch.utils.dlpack.to_dlpack(t),
    "tensor_on_its_storage": lambda t: torch.empty(0, dtype=t.dtype).set_(
        t.untyped_storage(), 0, t.shape
    ),
    "storage_in_a_dict": lambda t: {"storages": [t.untyped_storage()]},
    "pass_through_staged": _pass_through_staged,
}


def storage_of(held: Any) -> torch.UntypedStorage:
    """The memory a holder reaches, as a storage to read it through."""
    from torch.distributed.tensor import DTensor

    if isinstance(held, DTensor):
        return storage_of(held._local_tensor)
    if isinstance(held, torch.Tensor):
        return held.untyped_storage()
    if isinstance(held, torch.UntypedStorage):
        return held
    if isinstance(held, torch.TypedStorage):
        return held._untyped_storage
    if isinstance(held, memoryview):
        return torch.frombuffer(held, dtype=torch.uint8).untyped_storage()
    if isinstance(held, dict):
        return storage_of(next(iter(held.values())))
    if isinstance(held, list):
        return storage_of(held[0])
    if type(held).__name__ == "PyCapsule":
        return torch.from_dlpack(held).untyped_storage()
    return torch.from_numpy(held).untyped_storage()  # a NumPy array


def _check_held_buffer_not_reused(holder: Callable[[torch.Tensor], Any]) -> None:
    opt = optimizer()
    first = export(opt)
    t = max(exported_tensors(first), key=lambda x: x.numel())
    ptr, frozen = t.untyped_storage().data_ptr(), t.clone()
    held = holder(t)
    del first, t
    train(opt, steps=1, seed=7)  # the next export writes different values
    second = export(opt)
    assert ptr not in ptrs(second), "a buffer still reachable was handed out again"
    assert_same_export(second, reference(opt))
    storage = storage_of(held)
    assert storage.data_ptr() == ptr
    now = torch.empty(0, dtype=frozen.dtype).set_(storage, 0, frozen.shape)  # type: ignore[call-overload]
    assert torch.equal(now, frozen), "the held export changed"
    # Released, the buffer is reused: the check tells references apart, it does not refuse all.
    del held, storage, now, second
    third = export(opt)
    assert ptr in ptrs(third), "a released buffer was not reused"


@pytest.mark.parametrize("kind", list(HOLDERS))
def test_a_buffer_reachable_in_any_way_is_never_reused(clean: None, kind: str) -> None:
    _check_held_buffer_not_reused(HOLDERS[kind])


def test_a_buffer_held_by_a_dtensor_is_never_reused(clean: None, one_rank_mesh: Any) -> None:
    from torch.distributed.tensor import DTensor, Replicate

    def as_dtensor(t: torch.Tensor) -> DTensor:
        like = DTensor.from_local(torch.empty(t.shape), one_rank_mesh, [Replicate()])
        return engine.to_cpu_dtensor(t, like)

    _check_held_buffer_not_reused(as_dtensor)


def test_a_buffer_moved_to_shared_memory_is_never_reused(clean: None) -> None:
    # Another process may map it (a DataLoader worker, a process-based async save): this one
    # cannot see that process's references, so the buffer is never written again.
    opt = optimizer()
    first = export(opt)
    t = max(exported_tensors(first), key=lambda x: x.numel())
    t.share_memory_()
    ptr = t.untyped_storage().data_ptr()
    del first, t
    second = export(opt)
    assert ptr not in ptrs(second)
    del second
    assert ptr not in ptrs(export(opt))


def test_buffers_pickled_to_another_process_do_not_pile_up(clean: None) -> None:
    # A process-based async save pickles the export (torch moves its storages to shared
    # memory): such a buffer is never reused, and the pool must not keep it round after round.
    import io
    import pickle
    from multiprocessing.reduction import ForkingPickler

    pool = _pool.HostPool(keep_busy=True)
    held = []
    for _ in range(4):
        round_ = object()
        out = pool.take(torch.Size([1024]), torch.float32, round=round_)
        ForkingPickler(io.BytesIO(), pickle.HIGHEST_PROTOCOL).dump(out)  # what DCP's pipe does
        assert out.untyped_storage().is_shared()
        pool.end_round(round_)
        held.append(pool.nbytes)
    assert held == [4096] * 4, held  # this round's buffer only


# --- issue 15.8: the cache keeps what the last export needed ----------------------------------


def test_cache_is_trimmed_to_what_the_last_export_needed(clean: None) -> None:
    opt = optimizer(torch.bfloat16)
    held = [export(opt) for _ in range(6)]  # six exports referenced at once
    one = nbytes(held[0])
    assert len(set().union(*map(ptrs, held))) == 6 * len(ptrs(held[0]))
    assert _pool.EXPORTS.nbytes == 6 * one
    first = ptrs(held[0])
    held.clear()
    seventh = export(opt)
    assert ptrs(seventh) == first, "the first idle buffers were not reused"
    assert _pool.EXPORTS.nbytes == one, "idle buffers of earlier exports are still kept"
    assert_same_export(seventh, reference(opt))


def test_an_export_in_flight_keeps_two_sets_and_no_more(clean: None) -> None:
    # The DCP async pattern: the previous export is still being written while the next runs.
    opt = optimizer(torch.bfloat16)
    previous = export(opt)
    sets = [ptrs(previous)]
    for step in range(4):
        train(opt, steps=1, seed=step)
        current = export(opt)
        sets.append(ptrs(current))
        assert not sets[-1] & sets[-2], "the export in flight was overwritten"
        assert _pool.EXPORTS.nbytes == 2 * nbytes(current)
        assert_same_export(current, reference(opt))
        previous = current  # the one before is released only now
        del current
    assert sets[2] == sets[0] and sets[3] == sets[1], "released buffers were not reused"
    del previous


def test_busy_buffers_stay_kept_and_are_reused_once_released(clean: None) -> None:
    opt = optimizer(torch.bfloat16)
    old = export(opt)
    old_ptrs = ptrs(old)
    for _ in range(3):
        export(opt)  # each result dropped at once: one set cycles, `old` stays busy
    assert _pool.EXPORTS.nbytes == 2 * nbytes(old)
    del old
    again = [export(opt), export(opt)]  # both sets in use again, none fresh
    assert ptrs(again[0]) | ptrs(again[1]) >= old_ptrs
    assert _pool.EXPORTS.nbytes == 2 * nbytes(again[0])


# --- issue 15.3: an asynchronous KeyboardInterrupt at any point of an export -------------------


EXPORT_FILES = {engine.__file__, _ring.__file__, _pool.__file__}


class Interrupter:
    """A profile hook raising KeyboardInterrupt at the k-th point of the export's code (the
    engine, its ring and its pool) where CPython can deliver an asynchronous exception: a Python
    function's entry (or a generator's resumption) and the return of a call into C."""

    def __init__(self, k: int) -> None:
        self.k, self.seen, self.fired = k, 0, ""

    def __call__(self, frame: Any, event: str, arg: Any) -> None:
        if event not in ("call", "c_return") or frame.f_code.co_filename not in EXPORT_FILES:
            return
        if frame.f_code.co_name == "<lambda>":
            return  # a weakref callback: Python prints and drops what it raises
        if self.seen == self.k:
            sys.setprofile(None)
            what = getattr(arg, "__qualname__", "")
            self.fired = f"{event} {frame.f_code.co_name}:{frame.f_lineno} {what}"
            raise KeyboardInterrupt(self.fired)
        self.seen += 1


def interrupted_exports(opt: StandInFusedAdam, *, cold: bool) -> Iterator[tuple[str, bool]]:
    """Runs the export once per injection point until one runs out of points; yields where
    each interrupt was raised and whether it reached the caller."""
    for k in range(100_000):
        if cold:
            release_buffers()
        hook = Interrupter(k)
        sys.setprofile(hook)
        raised = False
        try:
            export(opt, reuse_buffers=k % 2 == 0)
        except KeyboardInterrupt:
            raised = True
        finally:
            sys.setprofile(None)
        if not hook.fired:
            return
        yield hook.fired, raised
    raise AssertionError("the export never ran out of injection points")


@pytest.mark.parametrize("cold", [False, True], ids=["warm-pool", "cold-pool"])
def test_keyboard_interrupt_anywhere_loses_no_stager(clean: None, cold: bool) -> None:
    opt = optimizer(torch.uint8)
    ref = reference(opt)
    export(opt)
    ring = pinned_pool_bytes()
    assert ring > 0
    points = []
    for where, raised in interrupted_exports(opt, cold=cold):
        if raised:
            points.append(where)
        assert _ring.in_use() == 0, f"a stager is still lent after an interrupt at {where}"
        assert pinned_pool_bytes() <= ring, f"a second ring after an interrupt at {where}"
    # The interrupts reached the caller (this Python lets a profile hook raise), many of them
    # in the pool's own code.
    assert len(points) > 50, points
    assert sum("take" in p or "_stager" in p for p in points) >= 5, points
    # The pool is whole: the next export reuses the one ring and release frees it.
    assert_same_export(export(opt), ref)
    assert _ring.in_use() == 0 and pinned_pool_bytes() == ring
    release_buffers()
    assert pinned_pool_bytes() == 0


# --- issue 22: one ring and one pool, one size query, one release ----------------------------


def test_a_pooled_ring_is_lent_once_and_reused(clean: None) -> None:
    cpu = torch.device("cpu")
    with _ring.lend(cpu, slot_bytes=64, slots=2) as ring:
        assert _ring.in_use() == 1 and ring.nbytes == 128
        with _ring.lend(cpu, slot_bytes=64, slots=2) as other:
            assert other is not ring, "a lent ring was lent twice"
        assert pinned_pool_bytes() == 256
    with _ring.lend(cpu, slot_bytes=64, slots=2) as again:
        assert again in (ring, other), "an idle ring was not reused"
    assert _ring.in_use() == 0 and pinned_pool_bytes() == 256
    release_buffers()
    assert pinned_pool_bytes() == 0


def test_an_unkept_ring_counts_while_lent_and_goes_on_return(clean: None) -> None:
    """The planner's ring (``keep=False``): in the size query while its load runs, then freed."""
    lender = _ring.SlotLender(torch.device("cpu"), slot_bytes=64, slots=2)
    assert pinned_pool_bytes() == 128 and lender.nbytes == 128
    slot = lender.take()
    assert slot is not None
    lender.upload(slot, torch.empty(16), lender.view(slot, (16,), torch.float32))
    lender.close()
    assert lender.nbytes == 0 and pinned_pool_bytes() == 0
    assert _ring.in_use() == 0


def test_release_buffers_frees_the_snapshot_pools_too(clean: None) -> None:
    """One pool class: ``release_buffers()`` lets go of a ``SnapshotStager``'s kept buffers."""
    from te_ckpt_placement.dcp import SnapshotStager

    stager = SnapshotStager(pin_memory=False)
    stager.stage({"w": torch.ones(1000)})
    assert stager.buffer_bytes == 4000
    assert _pool.held_bytes() >= 4000 and _pool.held_bytes(pinned=True) == 0
    release_buffers()
    assert stager.buffer_bytes == 0 and _pool.held_bytes() == 0
