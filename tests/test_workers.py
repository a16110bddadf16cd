"""The host workers' team: sizing, settings, thread isolation, failures, interrupts and fork."""

from __future__ import annotations

import itertools
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any

import pytest
import torch

from te_ckpt_placement import (
    Placement,
    _convert,
    _ring,
    _upload,
    _workers,
    current_placement,
    export_placement,
)
from te_ckpt_placement._export import StateSource, materialize

from .support import denormals
from .support.helpers import assert_bit_equal
from .support.workers import small_team


@pytest.fixture
def no_env(monkeypatch: pytest.MonkeyPatch) -> pytest.MonkeyPatch:
    monkeypatch.delenv(_workers.ENV, raising=False)
    monkeypatch.delenv("LOCAL_WORLD_SIZE", raising=False)
    return monkeypatch


@pytest.fixture
def cpus(no_env: pytest.MonkeyPatch) -> Iterator[Callable[[int], None]]:
    """Sets how many CPUs this process may run on (where a team can be made); torch's intra-op
    thread count is restored afterwards."""
    threads = torch.get_num_threads()

    def set_cpus(n: int) -> None:
        no_env.setattr(_workers, "available_cpus", lambda: n)
        no_env.setattr(_workers, "_team_problem", lambda: None)

    yield set_cpus
    torch.set_num_threads(threads)


@pytest.mark.parametrize(
    ("cpus", "local", "expected"),
    [(16, "", 16), (16, "2", 8), (16, "3", 5), (3, "4", 1), (1, "", 1)],
)
def test_default_size_is_the_ranks_share_of_the_affinity_mask(
    no_env: pytest.MonkeyPatch, cpus: int, local: str, expected: int
) -> None:
    no_env.setattr(os, "sched_getaffinity", lambda pid: set(range(100, 100 + cpus)))
    no_env.setenv("LOCAL_WORLD_SIZE", local)
    before = torch.get_num_threads()
    torch.set_num_threads(1)  # torchrun's OMP_NUM_THREADS=1: not what sizes the pool
    try:
        assert _workers.default_workers() == expected
        assert _workers.count() == expected
    finally:
        torch.set_num_threads(before)


@pytest.mark.parametrize("bad", ["0", "two", "-1"])
def test_a_bad_local_world_size_is_refused(no_env: pytest.MonkeyPatch, bad: str) -> None:
    no_env.setenv("LOCAL_WORLD_SIZE", bad)
    with pytest.raises(ValueError, match=rf"LOCAL_WORLD_SIZE='{bad}' is not a positive integer"):
        _workers.count()


def test_env_var_overrides_the_default_and_the_policy_overrides_both(
    no_env: pytest.MonkeyPatch,
) -> None:
    no_env.setenv(_workers.ENV, "3")
    assert _workers.count() == 3
    with export_placement("cpu"):
        assert _workers.count() == 3  # host_workers=None: the environment's
    with export_placement("cpu", host_workers=0):
        assert _workers.count() == 1
    with export_placement(Placement(host_workers=5)):
        assert _workers.count() == 5
    no_env.setenv(_workers.ENV, "1")
    assert _workers.count() == 1
    no_env.setenv(_workers.ENV, "0")
    assert _workers.count() == 1


@pytest.mark.parametrize("bad", ["x", "-2", "1.5"])
def test_a_bad_env_var_names_the_valid_values(no_env: pytest.MonkeyPatch, bad: str) -> None:
    no_env.setenv(_workers.ENV, bad)
    with pytest.raises(ValueError, match=r"TE_CKPT_PLACEMENT_HOST_WORKERS=.*valid values are None"):
        _workers.count()
    with pytest.raises(ValueError, match="valid values are None"):  # before any work
        with _workers.sized(None):
            pass


@pytest.mark.parametrize("bad", [-1, True, 1.5, "2"])
def test_placement_refuses_a_bad_host_workers(bad: Any) -> None:
    pattern = r"unsupported host_workers .*: valid values are None .* 0 or 1 .* >= 2"
    with pytest.raises(ValueError, match=pattern):
        Placement(host_workers=bad)
    with pytest.raises(ValueError, match=pattern):
        export_placement("cpu", host_workers=bad)
    assert Placement(host_workers=4).host_workers == 4


def test_the_team_runs_torch_on_its_size_and_leaves_every_other_threads_count() -> None:
    gomp = _workers._gomp()
    if isinstance(gomp, str):
        pytest.skip(gomp)
    before = torch.get_num_threads()
    try:
        torch.set_num_threads(2)
        assert _workers._run(torch.get_num_threads, (), 3) == 3
        # The OpenMP team the leader's ops run on has that many threads.
        members: list[int] = []
        _workers._run(denormals._on_every_thread, (members.append,), 3)
        assert sorted(members) == [0, 1, 2]
        assert torch.get_num_threads() == 2  # the caller's count, process-wide, unchanged
        assert gomp.omp_get_max_threads() == 2  # and the caller's own OpenMP count
        other: list[int] = []
        thread = threading.Thread(target=lambda: other.append(torch.get_num_threads()))
        thread.start()
        thread.join()
        assert other == [2]  # a new thread takes torch's process-wide count, not the team's
        # Through a conversion on the team too.
        with small_team(3):
            materialize(StateSource(kind="upcast", data=torch.ones(10_000, dtype=torch.bfloat16)))
        assert torch.get_num_threads() == 2 and gomp.omp_get_max_threads() == 2
    finally:
        torch.set_num_threads(before)


def test_the_team_sees_no_policy() -> None:
    with export_placement("cpu", reuse_buffers=True):
        assert current_placement() is not None
        assert _workers._run(current_placement, (), 2) is None
        assert _workers._run(_workers.count, (), 2) == 1  # a task never queues tasks


def test_small_work_and_no_team_run_on_the_calling_thread() -> None:
    def where() -> int:
        return threading.get_ident()

    with small_team(2, elements=100):
        assert _workers.call(where, elements=100) != threading.get_ident()
        assert _workers.call(where, elements=99) == threading.get_ident()
    with small_team(0, elements=100):
        assert _workers.call(where, elements=10**9) == threading.get_ident()


def test_a_failing_task_raises_in_the_caller_as_it_was_raised() -> None:
    error = ValueError("boom on the team")

    def fails() -> None:
        raise error

    with pytest.raises(ValueError, match="boom on the team") as caught:
        _workers._run(fails, (), 2)
    assert caught.value is error
    assert _workers._run(lambda: 7, (), 2) == 7  # the leader goes on


def test_a_failing_block_raises_its_own_error_from_a_conversion() -> None:
    calls = []

    def convert(raw: torch.Tensor, out: torch.Tensor, scratch: Any) -> None:
        calls.append(raw.numel())
        if len(calls) == 3:
            raise RuntimeError("injected block failure")
        out.copy_(raw)

    with small_team(2), pytest.raises(RuntimeError, match="injected block failure"):
        _convert._blocked(convert)(torch.ones(5000), torch.empty(5000), None)  # type: ignore[arg-type]
    assert len(calls) == 3


def test_callers_on_several_threads_each_get_their_own_result() -> None:
    results: dict[int, int] = {}

    def caller(k: int) -> None:
        results[k] = _workers._run(lambda: (time.sleep(0.01), k * k)[1], (), 2)

    callers = [threading.Thread(target=caller, args=(k,)) for k in range(6)]
    for thread in callers:
        thread.start()
    for thread in callers:
        thread.join(10)
    assert results == {k: k * k for k in range(6)}


@pytest.fixture
def released_on_wait(monkeypatch: pytest.MonkeyPatch) -> threading.Event:
    """Set once ``Tasks`` waits for its tasks on leaving: a running task that waits for it ends
    only after the caller was interrupted or failed and cancelled the others (a fixed delay
    would race that on a loaded machine)."""
    release = threading.Event()
    wait_all = _workers._wait_all

    def release_then_wait(futures: Any) -> None:
        release.set()
        wait_all(futures)

    monkeypatch.setattr(_workers, "_wait_all", release_then_wait)
    return release


def _interrupt_main_once(started: threading.Semaphore) -> None:
    def interrupt() -> None:
        started.acquire()
        signal.pthread_kill(threading.main_thread().ident or 0, signal.SIGINT)  # a Ctrl-C

    threading.Thread(target=interrupt, daemon=True).start()


def test_an_interrupt_cancels_a_task_that_has_not_started(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(_workers, "_leader", None)  # a leader of this test's own
    release, busy, queued = threading.Event(), threading.Event(), threading.Semaphore(0)
    ran: list[str] = []

    def occupy() -> None:  # another caller's task, running while ours waits in the queue
        busy.set()
        # Until the interrupt has come (5 s was once too short: ours then ran after this ended,
        # in a run that took 7 s longer than usual, before the interrupt could cancel it).
        release.wait(120)

    other = threading.Thread(target=lambda: _workers._run(occupy, (), 2))
    other.start()
    assert busy.wait(5)
    submit = _workers._Leader.submit

    def submitted(self: Any, *args: Any) -> None:
        submit(self, *args)
        queued.release()

    monkeypatch.setattr(_workers._Leader, "submit", submitted)
    _interrupt_main_once(queued)
    with pytest.raises(KeyboardInterrupt):
        _workers._run(lambda: ran.append("ours"), (), 2)
    release.set()
    other.join(5)
    assert _workers._run(lambda: "next", (), 2) == "next"  # ours was skipped, not run
    assert ran == []


def test_an_interrupt_waits_for_a_running_task(released_on_wait: threading.Event) -> None:
    release, started = released_on_wait, threading.Semaphore(0)
    finished: list[int] = []

    def task() -> None:
        started.release()
        release.wait(5)
        finished.append(1)

    _interrupt_main_once(started)
    with pytest.raises(KeyboardInterrupt):
        _workers._run(task, (), 2)
    assert finished == [1]  # nothing writes after the caller returned


def test_tasks_run_in_order_and_leaving_the_block_waits_for_all() -> None:
    ran: list[int] = []

    def task(k: int) -> int:
        time.sleep(0.01)
        ran.append(k)
        return k

    with small_team(2, elements=1), _workers.Tasks() as tasks:
        getters = [tasks.submit(task, k, elements=1) for k in range(5)]
        assert getters[1]() == 1
    assert ran == [0, 1, 2, 3, 4]  # none left running, none skipped, in order
    assert [get() for get in getters] == [0, 1, 2, 3, 4]


def test_leaving_tasks_by_an_error_cancels_the_ones_not_started(
    released_on_wait: threading.Event,
) -> None:
    release, started = released_on_wait, threading.Event()
    ran: list[str] = []

    def first() -> None:
        started.set()
        release.wait(5)
        ran.append("first")

    with pytest.raises(RuntimeError, match="the caller's own error"):
        with small_team(2, elements=1), _workers.Tasks() as tasks:
            tasks.submit(first, elements=1)
            tasks.submit(lambda: ran.append("second"), elements=1)
            assert started.wait(5)
            raise RuntimeError("the caller's own error")
    assert ran == ["first"]  # waited for; the second never started
    assert _workers._run(lambda: "next", (), 2) == "next"
    assert ran == ["first"]


def test_a_task_run_on_the_calling_thread_waits_for_those_handed_over_before_it() -> None:
    """Tasks run in their order whichever thread runs them: they may share a buffer."""
    ran: list[str] = []

    def slow() -> None:
        time.sleep(0.05)
        ran.append("team")

    with small_team(2, elements=100), _workers.Tasks() as tasks:
        tasks.submit(slow, elements=100)  # on the team
        tasks.submit(lambda: ran.append("here"), elements=99)  # small: on the calling thread
        assert ran == ["team", "here"]


def test_an_e4m3_export_whose_last_chunk_is_small_keeps_its_bits(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Full chunks convert on the team and a short last chunk on the calling thread; the E4M3
    decode of both goes through the ring's one scratch buffer."""
    from te_ckpt_placement import _ring

    monkeypatch.setattr(_ring, "CHUNK_BYTES", 1 << 16)
    data = torch.randint(0, 256, (3 * (1 << 16) + 500,), dtype=torch.uint8)
    data[data == 0x7F] = 0  # no NaN bytes: the reference is a plain widening
    data[data == 0xFF] = 0
    source = StateSource(
        kind="fp8", data=data, scale=torch.tensor([0.5]), fp8_dtype=torch.float8_e4m3fn
    )
    expected = data.view(torch.float8_e4m3fn).float() * 0.5
    with small_team(0):
        assert_bit_equal(materialize(source), expected)
    for _ in range(3):
        with small_team(2, elements=1000):
            assert_bit_equal(materialize(source), expected)


def test_an_interrupt_while_cancelling_still_waits_for_the_running_task(
    monkeypatch: pytest.MonkeyPatch, released_on_wait: threading.Event
) -> None:
    from concurrent.futures import Future

    release, started = released_on_wait, threading.Event()
    finished: list[int] = []

    def task() -> None:
        started.set()
        release.wait(5)
        finished.append(1)

    cancel = Future.cancel
    interrupts = [KeyboardInterrupt("a second Ctrl-C")]

    def interrupted_cancel(self: Any) -> bool:
        if interrupts:
            raise interrupts.pop()
        return cancel(self)

    monkeypatch.setattr(Future, "cancel", interrupted_cancel)
    with pytest.raises(KeyboardInterrupt, match="a second Ctrl-C"):
        with _workers.Tasks() as tasks:
            tasks.on_team(task, (), 2)
            assert started.wait(5)
            raise RuntimeError("the caller's own error")
    assert finished == [1]  # ended before the block was left


def test_a_ring_of_fewer_than_two_slots_is_refused(monkeypatch: pytest.MonkeyPatch) -> None:
    from te_ckpt_placement import _ring

    monkeypatch.setattr(_ring, "RING", 1)
    with pytest.raises(ValueError, match=r"RING = 1: .* at least 2 slots .* integer >= 2"):
        materialize(StateSource(kind="copy", data=torch.ones(10)))
    with pytest.raises(ValueError, match=r"RING = 1: .* at least 2 slots"):
        with _upload.Uploader(torch.device("cpu")):
            pass


def test_an_export_hands_the_next_chunk_over_before_waiting_for_this_one(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The streaming export keeps the team busy: chunk k+1's conversion is queued while chunk
    k's runs, not after the caller has seen it end."""
    from te_ckpt_placement import _ring

    events: list[tuple[str, int]] = []
    hand_over = _workers._hand_over

    def recorded(future: Any, fn: Any, args: Any, size: int) -> None:
        events.append(("handed", int(args[1].data_ptr())))
        hand_over(future, fn, args, size)

    def convert(raw: torch.Tensor, out: torch.Tensor, scratch: Any) -> None:
        time.sleep(0.02)
        out.copy_(raw)
        events.append(("ended", int(out.data_ptr())))

    monkeypatch.setattr(_workers, "_hand_over", recorded)
    monkeypatch.setattr(_ring, "CHUNK_BYTES", 4000)
    src, out = torch.arange(4000.0), torch.empty(4000)
    with small_team(2, elements=1):
        _ring.stream_into(src, out, convert)
    assert torch.equal(out, src)
    chunks = [ptr for kind, ptr in events if kind == "handed"]
    assert len(chunks) == 4
    for this, following in itertools.pairwise(chunks):
        assert events.index(("handed", following)) < events.index(("ended", this)), events


def test_a_forked_child_starts_its_own_team_or_says_why_not(tmp_path: Any) -> None:
    """A forked child has none of the parent's threads. It starts its own leader, unless torch
    cannot run ops on new threads there ("Invalid thread pool"); then a setting of more than 1
    is refused naming host_workers=0, and the default converts on the calling thread."""
    _workers.start(2)
    assert _workers.threads() >= 2
    log = tmp_path / "child.txt"
    expected = torch.arange(9000.0)
    pid = os.fork()
    if pid == 0:  # the child: none of the parent's threads
        code = 1
        try:
            assert _workers.threads() == 0, f"the child inherited a team of {_workers.threads()}"
            try:
                with small_team(2):
                    out = materialize(StateSource(kind="copy", data=expected))
                assert _workers.threads() == 2 and torch.equal(out, expected)
            except RuntimeError as exc:
                assert "forked process" in str(exc) and "host_workers=0" in str(exc), exc
                _workers.MIN_ELEMENTS = 1000  # so the default would take 9000 elements
                out = materialize(StateSource(kind="copy", data=expected))
                assert _workers.threads() == 0 and torch.equal(out, expected)
            code = 0
        except BaseException:
            import traceback

            log.write_text(traceback.format_exc())
        finally:
            os._exit(code)
    _, status = os.waitpid(pid, 0)
    why = log.read_text() if log.exists() else ""
    assert os.WIFEXITED(status) and os.WEXITSTATUS(status) == 0, (status, why)


_FORK_AFTER_A_CONVERSION = """
import os, sys, torch
from te_ckpt_placement import _workers
from te_ckpt_placement._export import StateSource, materialize
torch.set_num_threads(1)  # torchrun's OMP_NUM_THREADS=1: the calling thread never has a team
with _workers.sized(2):
    _workers.MIN_ELEMENTS = 1000
    materialize(StateSource(kind="upcast", data=torch.ones(50_000, dtype=torch.bfloat16)))
assert _workers.threads() == 2, _workers.threads()
pid = os.fork()
if pid == 0:
    torch.set_num_threads(2)  # the child's first parallel op, on the thread that forked
    os._exit(0 if float((torch.ones(1 << 20) * 2).sum()) == 2 * (1 << 20) else 3)
_, status = os.waitpid(pid, 0)
sys.exit(os.waitstatus_to_exitcode(status))
"""


def test_a_fork_after_a_conversion_leaves_the_child_a_working_torch() -> None:
    """The team is the leader's, never the calling thread's: a child forked by a thread whose
    own torch ran an OpenMP team hangs in its first parallel op (libgomp), so a conversion on
    the team must leave the forking thread without one. In a fresh process, as torchrun starts
    a rank (one torch thread)."""
    gomp = _workers._gomp()
    if isinstance(gomp, str):
        pytest.skip(gomp)
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    env = {**os.environ, "PYTHONPATH": root + os.pathsep + os.environ.get("PYTHONPATH", "")}
    try:
        done = subprocess.run(
            [sys.executable, "-c", _FORK_AFTER_A_CONVERSION],
            env=env,
            capture_output=True,
            text=True,
            timeout=120,
        )
    except subprocess.TimeoutExpired:
        pytest.fail("the forked child hung in its first parallel op")
    assert done.returncode == 0, done.stderr


def test_zero_workers_keeps_the_calling_thread_path(monkeypatch: pytest.MonkeyPatch) -> None:
    def refuse(*args: Any) -> Any:
        raise AssertionError("the team was used")

    source = StateSource(kind="scaled", data=torch.randn(9000).half(), scale=torch.tensor([0.5]))
    with small_team(2):
        on = materialize(source)
    monkeypatch.setattr(_workers, "_hand_over", refuse)
    for off in (0, 1):
        with small_team(off):
            assert_bit_equal(materialize(source), on)


@pytest.mark.parametrize(
    "kind, dtype", [("upcast", torch.bfloat16), ("copy", torch.float32), ("copy", torch.int16)]
)
def test_an_export_under_inference_mode_runs_on_the_team(kind: str, dtype: torch.dtype) -> None:
    """Lightning validates (and saves from ``on_validation_end``) under ``torch.inference_mode``:
    the team writes the export's inference tensors under the caller's mode."""
    data = (torch.arange(5000) % 251).to(dtype)
    expected = materialize(StateSource(kind=kind, data=data))
    with small_team(2), torch.inference_mode(), export_placement("cpu"):
        out = materialize(StateSource(kind=kind, data=data))
        assert out.is_inference()
    assert_bit_equal(out, expected)


def test_a_leader_that_fails_to_start_is_not_kept(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(_workers, "_leader", None)
    first_op = _workers._first_op

    def refuse() -> None:
        raise RuntimeError("injected start failure")

    monkeypatch.setattr(_workers, "_first_op", refuse)
    with pytest.raises(RuntimeError, match="injected start failure"):
        _workers._run(lambda: 1, (), 2)
    assert _workers.threads() == 0 and _workers._leader is None
    monkeypatch.setattr(_workers, "_first_op", first_op)
    assert _workers._run(lambda: 1, (), 2) == 1  # the next call starts a new one


def test_the_default_team_stands_aside_for_as_many_torch_threads(
    no_env: pytest.MonkeyPatch, cpus: Callable[[int], None]
) -> None:
    """Without a setting, the team converts where torch has fewer threads than the rank's share
    (torchrun's one per rank) or more (ranks oversubscribing the host); with exactly as many,
    the calling thread's torch converts. A setting (the policy's, or the environment variable)
    is followed as given."""
    cpus(4)
    torch.set_num_threads(1)
    assert _workers.count() == 4
    torch.set_num_threads(4)
    assert _workers.count() == 1
    torch.set_num_threads(8)
    assert _workers.count() == 4
    torch.set_num_threads(4)
    with export_placement("cpu", host_workers=4):
        assert _workers.count() == 4
    no_env.setenv(_workers.ENV, "4")
    assert _workers.count() == 4


@pytest.mark.parametrize(("share", "expected"), [(16, 15), (3, 2), (2, 2), (1, 1)])
def test_a_loads_default_team_leaves_the_calling_thread_a_cpu(
    no_env: pytest.MonkeyPatch, cpus: Callable[[int], None], share: int, expected: int
) -> None:
    """A load's calling thread issues the copies while the team converts: without a setting its
    team is the share less one (from 3 CPUs on); a setting is followed as given."""
    cpus(share)
    torch.set_num_threads(1)
    assert _workers.count() == share
    assert _workers.count(caller_copies=True) == expected
    with export_placement("cpu", host_workers=share):
        assert _workers.count(caller_copies=True) == share
    no_env.setenv(_workers.ENV, str(share))
    assert _workers.count(caller_copies=True) == share


def test_a_load_hands_its_blocks_to_the_smaller_team(
    no_env: pytest.MonkeyPatch, cpus: Callable[[int], None]
) -> None:
    """The streaming load's Uploader asks for the caller-copies team; an export does not."""
    sizes: list[int] = []
    real = _workers._hand_over

    def spy(future: Any, fn: Any, args: Any, size: int) -> None:
        sizes.append(size)
        real(future, fn, args, size)

    cpus(3)
    no_env.setattr(_workers, "_hand_over", spy)
    torch.set_num_threads(1)
    n = 2 * _workers.MIN_ELEMENTS
    dst = torch.empty(n, dtype=torch.bfloat16)
    src = torch.randn(n)
    with _upload.Uploader(torch.device("cpu")) as up:
        up.write(dst, src)
    assert sizes and set(sizes) == {2}
    assert_bit_equal(dst, src.bfloat16())
    sizes.clear()
    out = torch.empty(n)
    half = src.bfloat16()
    _ring.stream_into(half, out, _convert.convert_fn(StateSource(kind="upcast", data=half))[1])
    assert sizes and set(sizes) == {3}
    assert_bit_equal(out, half.float())
