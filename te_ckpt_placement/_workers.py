"""The host workers: a team of the package's own threads for host conversions and first touch.

torchrun sets ``OMP_NUM_THREADS=1`` on every rank of a multi-GPU job, so host conversions that
rely on torch's intra-op threads run on one core there. The team's size does not depend on
torch's thread count: by default it is this process's share of the CPUs it may run on
(``os.sched_getaffinity(0)`` divided by ``LOCAL_WORLD_SIZE``, at least 1);
``TE_CKPT_PLACEMENT_HOST_WORKERS`` overrides that default and ``Placement(host_workers=...)``
overrides both. 0 or 1 means no team: the conversions run on the calling thread with torch's
intra-op threads, exactly as without this module.

A conversion (:func:`call`) runs as one task on the package's leader thread, a daemon thread
whose torch runs each op on an OpenMP team of that many threads: ``omp_set_num_threads`` sets
the calling thread's team size only, so no other thread's count changes, the caller's
``torch.get_num_threads()`` included. torch's kernels split each op over the team, one Python
call per op: threads of our own each calling torch on a slice were bound by the GIL on the
multi-op FP16 and FP8 conversions (docs/performance-log.md section 12). The team belongs to the
leader, never to the calling thread, because libgomp's team does not survive ``fork``: a forked
child hangs in its first parallel op on the thread that forked, when that thread had a team.

The leader starts on first use and is dropped in a forked child (which starts its own). Each
task runs in an empty :mod:`contextvars` context (no policy) under the caller's inference and
grad modes. :class:`Tasks` hands tasks over in order, so that the next waits on the leader
while one runs (the hand-over between two threads costs tens of microseconds, which a pipeline
of chunks would otherwise pay for each); :func:`call` hands over one and waits for it. A failure
is re-raised in the caller as it was raised, and an interrupt cancels the tasks not yet started
and waits for the running one, so nothing writes into a buffer after the caller returned.
"""

from __future__ import annotations

import contextlib
import contextvars
import ctypes
import functools
import os
import queue
import threading
from collections.abc import Callable, Iterator
from concurrent.futures import CancelledError, Future
from typing import Any, TypeVar

import torch

from ._policy import check_host_workers, current_placement

#: Overrides the default team size (this process's share of its CPUs); 0 or 1: no team.
ENV = "TE_CKPT_PLACEMENT_HOST_WORKERS"

#: The fewest elements a conversion hands to the team: below this the hand-over costs more than
#: the work (about 30 us against 0.1 ms for 256 Ki elements on one thread).
MIN_ELEMENTS = 1 << 18

_T = TypeVar("_T")


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
    """The team size without a setting: ``TE_CKPT_PLACEMENT_HOST_WORKERS``, else this process's
    share of its CPUs (at least 1; 1 where the team's size cannot be set)."""
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
    """This process's share of its CPUs (1 where the team's size cannot be set)."""
    share = max(1, available_cpus() // local_world_size())
    return share if _team_problem() is None else 1


# The size set for the running operation by the TE hooks (an optimizer's own policy, followed
# when no policy block is active).
_REQUESTED: contextvars.ContextVar[int | None] = contextvars.ContextVar(
    "te_ckpt_placement_host_workers", default=None
)
_local = threading.local()  # .worker: True on the leader thread


def count(*, caller_copies: bool = False) -> int:
    """How many threads the calling thread's host conversions use now (1: no team).

    The operation's setting, else the active policy's, else :data:`ENV`'s, else this process's
    share of its CPUs, unless that equals torch's intra-op thread count
    (``torch.get_num_threads()``; then 1: torch's own threads convert, with no hand-over).
    ``caller_copies``: the calling thread has work of its own while the team converts (a load
    issues each block's copy to the device, and converts the blocks too small to hand over), so
    the share's team is one smaller, leaving it a CPU; a team one smaller loaded 1.2-1.4x faster
    on a 16-CPU host (docs/performance-log.md section 13). A setting is used as given.
    On the leader it is 1: a task never queues tasks of its own.
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
            # As many threads as torch's own: the calling thread's torch converts the same way.
            # Fewer torch threads (torchrun's one) or more (ranks oversubscribing the host's
            # CPUs) take the team, which keeps this rank to its share.
            return 1
        if caller_copies and workers > 2:
            workers -= 1
    if workers > 1:
        problem = _team_problem()
        if problem is not None:
            raise RuntimeError(
                f"host_workers={workers} needs a thread of the package's own whose torch runs "
                f"on {workers} threads, which cannot be set here: {problem}. Use "
                f"host_workers=0 (convert on the calling thread with torch's own threads), "
                f"e.g. {ENV}=0."
            )
    return max(1, workers)


@contextlib.contextmanager
def sized(workers: int | None) -> Iterator[int]:
    """Runs the block's host conversions on ``workers`` threads (None: as :func:`count` says).

    The size is resolved, and so checked, on entry: a bad setting fails before any work.
    """
    token = _REQUESTED.set(check_host_workers(workers) if workers is not None else None)
    try:
        yield count()
    finally:
        _REQUESTED.reset(token)


# --- the team's size, set on the leader alone -------------------------------------------------


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


def _team_problem() -> str | None:
    gomp = _gomp()
    if isinstance(gomp, str):
        return gomp
    return _fork_problem() if _forked else None


_forked = False  # set in a forked child (os.register_at_fork below)


@functools.cache
def _fork_problem() -> str | None:
    """Why this forked process cannot run torch on a new thread, or None: torch's first op on a
    new thread after a fork may fail ("Invalid thread pool", at::set_num_threads finding the
    parent's pthreadpool gone)."""
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


def _first_op() -> None:
    """Runs this thread's torch initialization now (a thread's first ``at::parallel_for`` sets
    its OpenMP count from torch's process-wide one, which would undo :func:`_team`'s); softmax
    over a row always reaches it."""
    torch.softmax(torch.zeros(1, 2), -1)


def _team(size: int) -> None:
    """Makes torch run this thread's ops on ``size`` threads, leaving other threads' counts
    (``omp_set_num_threads`` sets the calling thread's count only)."""
    gomp = _gomp()
    assert not isinstance(gomp, str), gomp
    gomp.omp_set_num_threads(size)
    if gomp.omp_get_max_threads() != size:  # pragma: no cover - a runtime that ignores it
        raise RuntimeError(f"the host workers' thread could not set its OpenMP count to {size}")


#: Elements of the op that makes the team's threads exist (above torch's 32 Ki-element grain,
#: so that the op runs in a parallel region).
_WARM_ELEMENTS = 1 << 16


def _warm(size: int) -> None:
    torch.empty(_WARM_ELEMENTS * size, dtype=torch.uint8).fill_(0)


# --- the leader -------------------------------------------------------------------------------

Task = tuple[Future[Any], Callable[[], Any], int]


def _loop(tasks: queue.SimpleQueue[Task | None], ready: Future[None]) -> None:
    _local.worker = True
    try:
        _first_op()
    except BaseException as exc:
        ready.set_exception(exc)
        return
    ready.set_result(None)
    while True:
        item = tasks.get()
        if item is None:
            return
        future, fn, size = item
        del item
        if not future.set_running_or_notify_cancel():  # cancelled by an interrupted caller
            continue
        # The task is dropped before its future completes: the caller may then reuse whatever
        # it referenced (a kept buffer is reused only when nothing else references it).
        try:
            _team(size)
            result = contextvars.Context().run(fn)  # no policy, whatever the caller's
        except BaseException as exc:
            del fn
            future.set_exception(exc)
        else:
            del fn
            future.set_result(result)
            del result
        del future


class _Leader:
    """The daemon thread that runs the tasks, one at a time, each on its OpenMP team."""

    def __init__(self) -> None:
        self.tasks: queue.SimpleQueue[Task | None] = queue.SimpleQueue()
        ready: Future[None] = Future()
        self.thread = threading.Thread(
            target=_loop, args=(self.tasks, ready), name="te_ckpt_placement-host", daemon=True
        )
        self.thread.start()
        try:
            ready.result()  # raises where the thread could not start torch
        except BaseException:
            self.tasks.put(None)  # not kept (an interrupted wait, say): it ends once started
            raise
        self.size = 0  # the largest team it ran

    def submit(self, future: Future[Any], fn: Callable[[], Any], size: int) -> None:
        self.size = max(self.size, size)
        self.tasks.put((future, fn, size))


_leader: _Leader | None = None
_leader_lock = threading.Lock()


def _forget_after_fork() -> None:
    # The child has none of the parent's threads: it starts its own leader on first use, where
    # torch can run ops on new threads there (_fork_problem).
    global _leader, _leader_lock, _forked
    _leader, _leader_lock, _forked = None, threading.Lock(), True
    _fork_problem.cache_clear()


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_forget_after_fork)


def _get_leader() -> _Leader:
    global _leader
    with _leader_lock:
        if _leader is None:
            _leader = _Leader()  # not kept where it failed to start: the next call tries again
        return _leader


def start(workers: int) -> None:
    """Starts the leader and its team of ``workers`` threads now, not on first use."""
    if workers > 1:
        _run(_warm, (workers,), workers)


def threads() -> int:
    """How many threads the largest team this process ran had (0: no leader)."""
    leader = _leader
    return 0 if leader is None else leader.size


class Tasks:
    """Tasks run in the order they are given (``caller_copies``: see :func:`count`), each waited
    for through the getter :meth:`submit` returns; the next can be handed over while one runs on
    the team, so the team never waits for the caller between two, and one run on the calling
    thread starts only once those before it have ended. Leaving the block waits for every task,
    after cancelling those not started where it is left by an exception or an interrupt: no task
    outlives the block, nor writes a buffer after it. A failure is re-raised as the task raised
    it (from its getter, or on leaving, the first one not seen yet).
    """

    def __init__(self, *, caller_copies: bool = False) -> None:
        self._futures: list[Future[Any]] = []
        self._caller_copies = caller_copies  # see count()

    def __enter__(self) -> Tasks:
        return self

    def __exit__(self, kind: object, exc: object, tb: object) -> None:
        futures, self._futures = self._futures, []
        try:
            if kind is not None:
                for future in futures:
                    future.cancel()
        finally:  # waited for also when an interrupt arrives while cancelling
            _wait_all(futures)
        if kind is None:
            for future in futures:
                future.result()

    def submit(self, fn: Callable[..., _T], *args: Any, elements: int) -> Callable[[], _T]:
        """``fn(*args)``, on the team where :func:`count` is above 1 and ``elements`` (the
        work's size) is at least :data:`MIN_ELEMENTS`, else now, on the calling thread; returns
        what gives its result."""
        size = count(caller_copies=self._caller_copies) if elements >= MIN_ELEMENTS else 1
        if size < 2:
            # After the tasks handed over before it, as if it had been one of them: they may
            # share a buffer with it (the ring's scratch).
            for future in self._futures:
                future.result()
            result = fn(*args)
            return lambda: result
        return self.on_team(fn, args, size)

    def on_team(self, fn: Callable[..., Any], args: tuple[Any, ...], size: int) -> Any:
        # Listed before it is queued: leaving the block finds it, whatever interrupts here.
        future: Future[Any] = Future()
        self._futures.append(future)
        _hand_over(future, fn, args, size)
        return future.result


def _hand_over(
    future: Future[Any], fn: Callable[..., Any], args: tuple[Any, ...], size: int
) -> None:
    """Queues ``fn(*args)`` on the leader, for a team of ``size``: the one way work reaches it."""
    leader = _get_leader()
    # The caller's autograd modes go with the task (an export under torch.inference_mode()
    # writes into inference tensors, which only inference mode may update in place).
    inference, grad = torch.is_inference_mode_enabled(), torch.is_grad_enabled()
    leader.submit(future, functools.partial(_in_modes, fn, args, inference, grad), size)


def call(fn: Callable[..., _T], *args: Any, elements: int) -> _T:
    """``fn(*args)`` as :meth:`Tasks.submit` runs it, waited for here."""
    with Tasks() as tasks:
        return tasks.submit(fn, *args, elements=elements)()


def _run(fn: Callable[..., Any], args: tuple[Any, ...], size: int) -> Any:
    """``fn(*args)`` on a team of ``size``, whatever the settings, waited for here."""
    with Tasks() as tasks:
        return tasks.on_team(fn, args, size)()


def _in_modes(fn: Callable[..., Any], args: tuple[Any, ...], inference: bool, grad: bool) -> Any:
    with torch.inference_mode(inference), torch.set_grad_enabled(grad):
        return fn(*args)


def _wait_all(futures: list[Future[Any]]) -> None:
    """Waits until every future has finished or is cancelled, also through a second interrupt.

    A cancelled future counts as ended at once, queued or not (``concurrent.futures.wait``
    would wait for the leader to dequeue it, and one cancelled before it was queued never is).
    """
    interrupted: BaseException | None = None
    for future in futures:
        while True:
            try:
                if not future.cancelled():
                    future.exception()  # waits until it has finished
                break
            except CancelledError:
                break
            except BaseException as exc:  # keep waiting: the task may still write a buffer
                interrupted = exc
    if interrupted is not None:
        raise interrupted
