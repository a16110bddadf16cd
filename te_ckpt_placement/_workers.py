"""The host worker pool: the package's own threads for host conversions and first touch.

torchrun sets ``OMP_NUM_THREADS=1`` on every rank of a multi-GPU job, so host conversions that
rely on torch's intra-op threads run on one core there. This pool's size does not depend on
torch's thread count: by default it is this process's share of the CPUs it may run on
(``os.sched_getaffinity(0)`` divided by ``LOCAL_WORLD_SIZE``, at least 1);
``TE_CKPT_PLACEMENT_HOST_WORKERS`` overrides that default and ``Placement(host_workers=...)``
overrides both. 0 or 1 means no pool: the conversions run on the calling thread with torch's
intra-op threads, exactly as without this module.

Workers are daemon threads, started on first use and dropped in a forked child (which starts
its own on first use). Each runs torch with one intra-op thread: ``torch.set_num_threads`` is
process-wide (it sets the count every thread reads), so a worker instead sets only its own
OpenMP thread count, after torch's once-per-thread initialization has run, which would
otherwise reset it (at::internal::lazy_init_num_threads in ATen/Parallel.h). The caller's
``torch.get_num_threads()`` never changes. Each task runs in an empty :mod:`contextvars`
context, so no worker sees a policy. :func:`run` waits for every task it queued: a failure is
re-raised in the caller as it was raised, and an interrupt cancels the tasks not yet started
and waits for the running ones, so no worker writes into a buffer after the caller returned.
"""

from __future__ import annotations

import contextlib
import contextvars
import ctypes
import functools
import os
import queue
import threading
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import Future
from concurrent.futures import wait as _wait
from typing import Any

import torch

from ._policy import check_host_workers, current_placement

#: Overrides the default pool size (this process's share of its CPUs); 0 or 1: no pool.
ENV = "TE_CKPT_PLACEMENT_HOST_WORKERS"

#: The fewest elements a task converts: below this the queue's overhead outweighs the work.
MIN_TASK_ELEMENTS = 1 << 18


def available_cpus() -> int:
    """The CPUs this process may run on (its affinity mask, where the platform has one)."""
    if hasattr(os, "sched_getaffinity"):
        return len(os.sched_getaffinity(0))
    return os.cpu_count() or 1


def local_world_size() -> int:
    """How many ranks run on this host: ``LOCAL_WORLD_SIZE`` as torchrun and accelerate set it,
    1 where it is not set.

    Raises:
        ValueError: ``LOCAL_WORLD_SIZE`` is set but is not a positive integer.
    """
    value = os.environ.get("LOCAL_WORLD_SIZE", "").strip()
    if not value:
        return 1
    try:
        size = int(value)
    except ValueError:
        size = 0
    if size < 1:
        raise ValueError(
            f"LOCAL_WORLD_SIZE={value!r} is not a positive integer (the number of ranks on this "
            "host, as torchrun sets it); set it so, or unset it for one rank per host."
        )
    return size


def default_workers() -> int:
    """The pool size without a setting: ``TE_CKPT_PLACEMENT_HOST_WORKERS``, else this process's
    share of its CPUs (at least 1; 1 where a worker cannot be kept to one torch thread)."""
    configured = _configured()
    return _share() if configured is None else configured


def _configured() -> int | None:
    """``TE_CKPT_PLACEMENT_HOST_WORKERS``, checked; None where it is not set."""
    value = os.environ.get(ENV, "").strip()
    if not value:
        return None
    try:
        number: object = int(value)
    except ValueError:
        number = value
    return check_host_workers(number, name=f"{ENV}={value!r}: host_workers") or 0


def _share() -> int:
    """This process's share of its CPUs (1 where a worker cannot be kept to one torch thread)."""
    share = max(1, available_cpus() // local_world_size())
    return share if _isolation_problem() is None else 1


# The size set for the running operation by the TE hooks (an optimizer's own policy, followed
# when no policy block is active).
_REQUESTED: contextvars.ContextVar[int | None] = contextvars.ContextVar(
    "te_ckpt_placement_host_workers", default=None
)
_local = threading.local()  # .worker: True on the pool's own threads


def count() -> int:
    """How many workers the calling thread's host conversions use now (1: none).

    The operation's setting, else the active policy's, else :data:`ENV`'s, else this process's
    share of its CPUs, unless that equals torch's intra-op thread count
    (``torch.get_num_threads()``; then 1: torch's own threads convert). Inside a worker
    it is 1: a task never queues tasks of its own.
    """
    if getattr(_local, "worker", False):
        return 1
    workers = _REQUESTED.get()
    if workers is None:
        placement = current_placement()
        workers = None if placement is None else placement.host_workers
    if workers is None:
        workers = _configured()
    if workers is None:
        workers = _share()
        if workers == torch.get_num_threads():
            # As many threads as torch's own: the calling thread's torch converts as fast
            # without the queue (on one H200 its 16 threads loaded faster than 16 workers).
            # Fewer torch threads (torchrun's one) or more (ranks oversubscribing the host's
            # CPUs) take the pool, which keeps this rank to its share.
            return 1
    if workers > 1:
        problem = _isolation_problem()
        if problem is not None:
            raise RuntimeError(
                f"host_workers={workers} needs each worker to run torch on one thread, which "
                f"cannot be set here: {problem}. Use host_workers=0 (convert on the calling "
                f"thread with torch's own threads), e.g. {ENV}=0."
            )
    return max(1, workers)


@contextlib.contextmanager
def sized(workers: int | None) -> Iterator[int]:
    """Runs the block's host conversions on ``workers`` workers (None: as :func:`count` says).

    The size is resolved, and so checked, on entry: a bad setting fails before any work.
    """
    token = _REQUESTED.set(check_host_workers(workers) if workers is not None else None)
    try:
        yield count()
    finally:
        _REQUESTED.reset(token)


# --- one intra-op thread per worker ---------------------------------------------------------


@functools.cache
def _gomp() -> Any:
    """torch's OpenMP runtime (ctypes), or the reason it cannot be used (a str)."""
    if "OpenMP" not in torch.__config__.parallel_info():
        return "torch's intra-op thread pool is not OpenMP"
    torch_dir = os.path.dirname(torch.__file__)
    try:
        with open("/proc/self/maps") as maps:
            paths = {line.split()[-1] for line in maps if "libgomp" in line or "libomp" in line}
    except OSError as exc:
        return f"cannot read /proc/self/maps ({exc})"
    if not paths:
        return "no OpenMP runtime is loaded in this process"
    # torch's own copy first (torch/lib or torch.libs), where a system one is loaded too.
    path = sorted(paths, key=lambda p: (not p.startswith(torch_dir), "torch" not in p, p))[0]
    try:
        lib = ctypes.CDLL(path)
        lib.omp_set_num_threads.argtypes = (ctypes.c_int,)
        lib.omp_get_max_threads.restype = ctypes.c_int
    except (OSError, AttributeError) as exc:
        return f"{path} has no omp_set_num_threads ({exc})"
    return lib


def _isolation_problem() -> str | None:
    gomp = _gomp()
    if isinstance(gomp, str):
        return gomp
    return _fork_problem() if _forked else None


_forked = False  # set in a forked child (os.register_at_fork below)


@functools.cache
def _fork_problem() -> str | None:
    """Why this forked process cannot start worker threads, or None: torch's OpenMP pool may be
    unusable from new threads after a fork (ParallelOpenMP.cpp's "Invalid thread pool")."""
    errors: list[str] = []

    def probe() -> None:
        try:
            torch.softmax(torch.zeros(1, 2), -1)  # a new thread's first parallel op
        except RuntimeError as exc:
            errors.append(str(exc).splitlines()[0])

    thread = threading.Thread(target=probe, name="te_ckpt_placement-fork-probe", daemon=True)
    thread.start()
    thread.join()
    if not errors:
        return None
    return f"in this forked process torch cannot run ops on new threads ({errors[0]})"


def _one_thread() -> None:
    """Makes torch run this thread's ops on this thread alone, leaving other threads' counts.

    A thread's first ``at::parallel_for`` sets its OpenMP count from torch's process-wide one;
    softmax over a row always reaches it, so that happens here, before this thread's own count
    is set to 1 (``omp_set_num_threads`` sets the calling thread's count only).
    """
    gomp = _gomp()
    assert not isinstance(gomp, str), gomp
    torch.softmax(torch.zeros(1, 2), -1)
    gomp.omp_set_num_threads(1)
    if gomp.omp_get_max_threads() != 1:  # pragma: no cover - an OpenMP runtime that ignores it
        raise RuntimeError("a host worker could not set its OpenMP thread count to 1")


# --- the pool ---------------------------------------------------------------------------------

Task = tuple[Future[Any], Callable[[], Any]]


def _loop(tasks: queue.SimpleQueue[Task | None], ready: Future[None]) -> None:
    _local.worker = True
    try:
        _one_thread()
    except BaseException as exc:
        ready.set_exception(exc)
        return
    ready.set_result(None)
    while True:
        item = tasks.get()
        if item is None:
            return
        future, fn = item
        del item
        if not future.set_running_or_notify_cancel():  # cancelled by an interrupted caller
            continue
        # The task is dropped before its future completes: the caller may then reuse whatever
        # it referenced (a kept buffer is reused only when nothing else references it).
        try:
            result = contextvars.Context().run(fn)  # no policy, whatever the caller's
        except BaseException as exc:
            del fn
            future.set_exception(exc)
        else:
            del fn
            future.set_result(result)
            del result
        del future


class _Pool:
    """Daemon threads taking tasks from one queue; grown to the largest size asked for."""

    def __init__(self) -> None:
        self.tasks: queue.SimpleQueue[Task | None] = queue.SimpleQueue()
        self.threads: list[threading.Thread] = []

    def grow(self, workers: int) -> None:
        started = []
        while len(self.threads) < workers:
            ready: Future[None] = Future()
            thread = threading.Thread(
                target=_loop,
                args=(self.tasks, ready),
                name=f"te_ckpt_placement-host-{len(self.threads)}",
                daemon=True,
            )
            thread.start()
            self.threads.append(thread)
            started.append((thread, ready))
        failed = [(thread, ready) for thread, ready in started if ready.exception() is not None]
        if failed:
            # A worker that cannot run on one thread has ended: it is not counted, so a later
            # call starts a new one instead of queueing tasks nothing takes.
            dead = {thread for thread, _ in failed}
            self.threads = [t for t in self.threads if t not in dead]
            failed[0][1].result()

    def submit(self, fn: Callable[[], Any]) -> Future[Any]:
        future: Future[Any] = Future()
        self.tasks.put((future, fn))
        return future


_pool: _Pool | None = None
_pool_lock = threading.Lock()


def _forget_after_fork() -> None:
    # The child has none of the parent's threads: it starts its own pool on first use, where
    # torch can run ops on new threads there (_fork_problem).
    global _pool, _pool_lock, _forked
    _pool, _pool_lock, _forked = None, threading.Lock(), True
    _fork_problem.cache_clear()


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_forget_after_fork)


def start(workers: int) -> None:
    """Starts the pool's threads now (at least ``workers`` of them), not on first use."""
    global _pool
    with _pool_lock:
        if _pool is None:
            _pool = _Pool()
        _pool.grow(workers)


def threads() -> int:
    """How many worker threads this process runs now."""
    pool = _pool
    return 0 if pool is None else len(pool.threads)


def run(tasks: Sequence[Callable[[], Any]], *, workers: int | None = None) -> list[Any]:
    """Runs ``tasks`` on the pool and returns their results, in order, once all have finished.

    The pool has at least ``workers`` threads (default: one per task) when they start.

    A task's exception is re-raised here (the first in task order), after the tasks not yet
    started were cancelled and the running ones finished; so is an interrupt of the caller.
    """
    start(len(tasks) if workers is None else workers)
    pool = _pool
    assert pool is not None
    # The caller's autograd modes go with each task (an export under torch.inference_mode()
    # writes into inference tensors, which only inference mode may update in place).
    inference, grad = torch.is_inference_mode_enabled(), torch.is_grad_enabled()
    futures: list[Future[Any]] = []
    try:
        for task in tasks:
            futures.append(pool.submit(functools.partial(_in_modes, task, inference, grad)))
        return [future.result() for future in futures]
    except BaseException:
        for future in futures:
            future.cancel()
        _wait_all(futures)
        raise


def _in_modes(task: Callable[[], Any], inference: bool, grad: bool) -> Any:
    with torch.inference_mode(inference), torch.set_grad_enabled(grad):
        return task()


def _wait_all(futures: list[Future[Any]]) -> None:
    """Waits until every future is done or cancelled, also through a second interrupt."""
    interrupted: BaseException | None = None
    while True:
        try:
            _wait(futures)
            break
        except BaseException as exc:  # keep waiting: a worker may still write a buffer
            interrupted = exc
    if interrupted is not None:
        raise interrupted


def ranges(n: int, parts: int, *, align: int = 1024) -> list[tuple[int, int]]:
    """``parts`` near-equal ranges covering ``range(n)`` in order, inner bounds on ``align``."""
    step = -(-n // parts)
    step = -(-step // align) * align
    return [(a, min(a + step, n)) for a in range(0, n, step)]


def parts_for(n: int, workers: int) -> int:
    """How many tasks ``n`` elements are split into on ``workers`` workers (1: not split)."""
    return max(1, min(workers, n // MIN_TASK_ELEMENTS))
