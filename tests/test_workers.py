"""The host worker pool: sizing, settings, thread isolation, failures, interrupts and fork."""

from __future__ import annotations

import os
import signal
import threading
import time
from typing import Any

import pytest
import torch

from te_ckpt_placement import Placement, _convert, _workers, current_placement, export_placement
from te_ckpt_placement._export import StateSource, materialize

from .support.helpers import assert_bit_equal
from .support.workers import small_pool


@pytest.fixture
def no_env(monkeypatch: pytest.MonkeyPatch) -> pytest.MonkeyPatch:
    monkeypatch.delenv(_workers.ENV, raising=False)
    monkeypatch.delenv("LOCAL_WORLD_SIZE", raising=False)
    return monkeypatch


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


def test_workers_run_one_torch_thread_and_leave_the_callers_count() -> None:
    gomp = _workers._gomp()
    if isinstance(gomp, str):
        pytest.skip(gomp)
    before = torch.get_num_threads()
    try:
        torch.set_num_threads(2)
        seen = _workers.run([gomp.omp_get_max_threads for _ in range(3)])
        assert seen == [1, 1, 1]
        assert torch.get_num_threads() == 2  # the caller's count, process-wide, unchanged
        assert gomp.omp_get_max_threads() == 2  # and the caller's own OpenMP count
        # Through a conversion on the pool too.
        with small_pool(3):
            materialize(StateSource(kind="upcast", data=torch.ones(10_000, dtype=torch.bfloat16)))
        assert torch.get_num_threads() == 2 and gomp.omp_get_max_threads() == 2
    finally:
        torch.set_num_threads(before)


def test_workers_see_no_policy() -> None:
    with export_placement("cpu", reuse_buffers=True):
        assert current_placement() is not None
        assert _workers.run([current_placement, current_placement]) == [None, None]
        assert _workers.run([_workers.count]) == [1]  # a task never queues tasks


def test_a_failing_task_raises_in_the_caller_after_the_others_finish() -> None:
    done: list[int] = []
    error = ValueError("boom in a worker")

    def fails() -> None:
        raise error

    def slow(k: int) -> None:
        time.sleep(0.05)
        done.append(k)

    with pytest.raises(ValueError, match="boom in a worker") as caught:
        _workers.run([lambda: slow(0), fails, lambda: slow(2)])
    assert caught.value is error
    assert sorted(done) == [0, 2]  # nothing still runs once the caller has the error


def test_a_failing_block_raises_its_own_error_from_a_conversion() -> None:
    calls = []

    def convert(raw: torch.Tensor, out: torch.Tensor, scratch: Any) -> None:
        calls.append(raw.numel())
        if len(calls) == 3:
            raise RuntimeError("injected block failure")
        out.copy_(raw)

    with small_pool(2), pytest.raises(RuntimeError, match="injected block failure"):
        _convert._blocked(convert)(torch.ones(5000), torch.empty(5000), None)  # type: ignore[arg-type]


def test_an_interrupt_cancels_pending_tasks_and_waits_for_running_ones(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(_workers, "_pool", None)  # a pool of exactly 2 threads
    _workers.start(2)
    release, started = threading.Event(), threading.Semaphore(0)
    ran: list[int] = []
    finished: list[int] = []

    def task(k: int) -> None:
        ran.append(k)
        started.release()
        release.wait(5)
        finished.append(k)

    def interrupt() -> None:
        started.acquire()
        started.acquire()  # both workers are busy; 4 tasks wait in the queue
        signal.pthread_kill(threading.main_thread().ident or 0, signal.SIGINT)  # a Ctrl-C

    wait_all = _workers._wait_all

    def release_then_wait(futures: Any) -> None:
        # The running tasks finish only once the caller has cancelled the pending ones (a fixed
        # delay here raced the interrupt's delivery on a loaded machine).
        release.set()
        wait_all(futures)

    monkeypatch.setattr(_workers, "_wait_all", release_then_wait)
    threading.Thread(target=interrupt, daemon=True).start()
    with pytest.raises(KeyboardInterrupt):
        _workers.run([lambda k=k: task(k) for k in range(6)], workers=2)
    assert sorted(finished) == sorted(ran) and len(ran) == 2  # none writes after the return
    time.sleep(0.1)
    assert len(ran) == 2  # the pending ones never start
    release.set()


def test_a_forked_child_starts_its_own_pool_or_says_why_not(tmp_path: Any) -> None:
    """A forked child has none of the parent's workers. It starts its own, unless torch cannot
    run ops on new threads there (its OpenMP pool after a fork: "Invalid thread pool"); then a
    setting of more than 1 is refused naming host_workers=0, and the default converts on the
    calling thread."""
    _workers.start(2)
    assert _workers.threads() >= 2
    log = tmp_path / "child.txt"
    expected = torch.arange(9000.0)
    pid = os.fork()
    if pid == 0:  # the child: none of the parent's threads
        code = 1
        try:
            assert _workers.threads() == 0, f"the child inherited {_workers.threads()} workers"
            try:
                with small_pool(2):
                    out = materialize(StateSource(kind="copy", data=expected))
                assert _workers.threads() == 2 and torch.equal(out, expected)
            except RuntimeError as exc:
                assert "forked process" in str(exc) and "host_workers=0" in str(exc), exc
                _workers.MIN_TASK_ELEMENTS = 1000  # so the default would split 9000 elements
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


def test_zero_workers_keeps_the_calling_thread_path(monkeypatch: pytest.MonkeyPatch) -> None:
    def refuse(tasks: Any) -> Any:
        raise AssertionError("the pool was used")

    source = StateSource(kind="scaled", data=torch.randn(9000).half(), scale=torch.tensor([0.5]))
    with small_pool(2):
        on = materialize(source)
    monkeypatch.setattr(_workers, "run", refuse)
    for off in (0, 1):
        with small_pool(off):
            assert_bit_equal(materialize(source), on)


@pytest.mark.parametrize(
    "kind, dtype", [("upcast", torch.bfloat16), ("copy", torch.float32), ("copy", torch.int16)]
)
def test_an_export_under_inference_mode_runs_on_the_workers(kind: str, dtype: torch.dtype) -> None:
    """Lightning validates (and saves from ``on_validation_end``) under ``torch.inference_mode``:
    the workers write the export's inference tensors under the caller's mode."""
    data = (torch.arange(5000) % 251).to(dtype)
    expected = materialize(StateSource(kind=kind, data=data))
    with small_pool(2), torch.inference_mode(), export_placement("cpu"):
        out = materialize(StateSource(kind=kind, data=data))
        assert out.is_inference()
    assert_bit_equal(out, expected)


def test_a_worker_that_fails_to_start_is_not_counted(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(_workers, "_pool", None)
    one_thread = _workers._one_thread

    def refuse() -> None:
        raise RuntimeError("injected start failure")

    monkeypatch.setattr(_workers, "_one_thread", refuse)
    with pytest.raises(RuntimeError, match="injected start failure"):
        _workers.run([lambda: 1, lambda: 2])
    assert _workers.threads() == 0
    monkeypatch.setattr(_workers, "_one_thread", one_thread)
    results: list[Any] = []  # the same pool starts new workers (a dead one would take nothing)
    runner = threading.Thread(target=lambda: results.append(_workers.run([lambda: 1, lambda: 2])))
    runner.start()
    runner.join(10)
    assert results == [[1, 2]], "the tasks never ran"


def test_the_default_pool_stands_aside_for_as_many_torch_threads(
    no_env: pytest.MonkeyPatch,
) -> None:
    """Without a setting, the pool converts where torch has fewer threads than the rank's share
    (torchrun's one per rank) or more (ranks oversubscribing the host); with exactly as many,
    the calling thread's torch converts. A setting (the policy's, or the environment variable)
    is followed as given."""
    threads = torch.get_num_threads()
    no_env.setattr(_workers, "available_cpus", lambda: 4)
    no_env.setattr(_workers, "_isolation_problem", lambda: None)
    try:
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
    finally:
        torch.set_num_threads(threads)
