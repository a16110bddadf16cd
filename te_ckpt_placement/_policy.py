"""The checkpoint-scoped export policy: ``export_placement`` and ``current_placement``.

The policy lives in a :mod:`contextvars` variable, so every thread and every asyncio task sees only
the policy it entered itself: the innermost block still open in it. Nothing here imports the rest
of the package or Transformer Engine: entering a policy runs the hooks registered with
:func:`on_enter`, through which :mod:`te_ckpt_placement._te_hooks` hooks TE's class if TE's
optimizer module is (or later gets) imported.
"""

from __future__ import annotations

import asyncio
import contextvars
import enum
import functools
import inspect
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from types import TracebackType
from typing import Any, Literal, NamedTuple, TypeVar

import torch

VALID_CONVERSIONS = ("host", "device")

_VALID_HOST_WORKERS = (
    "None (the default: TE_CKPT_PLACEMENT_HOST_WORKERS if set, else this process's share of "
    "its CPUs), 0 or 1 (no team: convert on the calling thread with torch's intra-op threads) "
    "or an integer >= 2 (convert on a thread of the package's own whose torch runs that many "
    "threads)"
)


def check_host_workers(value: object, *, name: str = "host_workers") -> int | None:
    """``value`` if it is a valid ``host_workers`` setting; ``ValueError`` naming the valid ones."""
    if value is None or (isinstance(value, int) and not isinstance(value, bool) and value >= 0):
        return value  # type: ignore[return-value]
    raise ValueError(f"unsupported {name} {value!r}: valid values are {_VALID_HOST_WORKERS}")


_F = TypeVar("_F", bound=Callable[..., Any])


def _normalize_device(device: object) -> Literal["cpu"] | None:
    if device is None:
        return None
    if isinstance(device, torch.device):
        if device.type == "cpu" and device.index in (None, 0):
            return "cpu"
    elif isinstance(device, str) and device == "cpu":
        return "cpu"
    raise ValueError(
        f"unsupported export device {device!r}: valid values are 'cpu' (stream every optimizer "
        "state to host memory as it is produced) or None (Transformer Engine's own export, on "
        "the GPU). To keep TE's behaviour inside an outer policy, use export_placement(None)."
    )


@dataclass(frozen=True, kw_only=True)
class Placement:
    """Where and how an optimizer export places its states.

    Args:
        device: ``"cpu"`` to stream every state to host memory as it is produced, or ``None`` for
            Transformer Engine's own export (everything converted on the GPU, as TE does today).
        conversion: Where FP16 and FP8 moments are unscaled to FP32 when ``device="cpu"``.
            ``"host"`` (default) copies the raw low-precision bytes and converts on the CPU, with
            no GPU memory at all; ``"device"`` runs TE's own ``get_unscaled_state`` on the GPU,
            one state at a time, which costs at most 4 bytes per element of the largest local
            state. BF16, FP32 and int16 states are always converted on the host, where the
            result is exact by construction.
        reuse_buffers: Keep the host output buffers after an export and write the next export
            into them once nothing references them any more (``del`` the previous state dict).
            Repeated saves then skip the page faults of fresh memory, at the price of holding
            one export's worth of host memory between saves (two while a previous export is
            still referenced). A buffer that anything still references, such as a DCP async
            save in flight, is never reused. ``te_ckpt_placement.release_buffers()`` frees them.
        rollback: What a streaming ``load_state_dict`` does when it fails part-way, after the
            checkpoint was validated (a device error, an allocation failure, a
            KeyboardInterrupt). ``False`` (default) costs nothing: the load raises
            ``te_ckpt_placement.PartialLoadError`` (a KeyboardInterrupt propagates with
            a note) saying how many states were written; the optimizer then holds a mix of old
            and loaded states, and loading the same checkpoint again repairs it. ``True`` puts
            the previous state back exactly, at the price of a host copy of every live state
            the load overwrites (as much host memory as the optimizer states, copied as the
            load goes), which doubles the host memory of a load.
        host_workers: How many threads run the host conversions and first touches of exports
            and loads: a thread of the package's own whose torch runs them on a team of this
            many threads, so they stay fast when torch runs one thread per rank (torchrun's
            ``OMP_NUM_THREADS=1``); the caller's ``torch.get_num_threads()`` is left as it is.
            ``None`` (default): ``TE_CKPT_PLACEMENT_HOST_WORKERS`` if set, else this process's
            share of its CPUs (``len(os.sched_getaffinity(0)) // LOCAL_WORLD_SIZE``, at least
            1). ``0`` or ``1``: no workers, the conversions run on the calling thread with
            torch's own intra-op threads. The results are the same bits either way.

    Example:
        >>> Placement(device="cpu")  # doctest: +NORMALIZE_WHITESPACE
        Placement(device='cpu', conversion='host', reuse_buffers=False, rollback=False,
                  host_workers=None)
    """

    device: Literal["cpu"] | None = "cpu"
    conversion: Literal["host", "device"] = "host"
    reuse_buffers: bool = False
    rollback: bool = False
    host_workers: int | None = None

    def __post_init__(self) -> None:
        object.__setattr__(self, "device", _normalize_device(self.device))
        if not isinstance(self.conversion, str) or self.conversion not in VALID_CONVERSIONS:
            raise ValueError(
                f"unsupported conversion {self.conversion!r}: valid values are 'host' (convert "
                "FP16/FP8 moments on the CPU, no GPU memory) or 'device' (TE's own conversion on "
                "the GPU, one state at a time)"
            )
        if not isinstance(self.reuse_buffers, bool):
            raise ValueError(
                f"unsupported reuse_buffers {self.reuse_buffers!r}: valid values are True (keep "
                "host output buffers across exports) or False (fresh buffers every export)"
            )
        if not isinstance(self.rollback, bool):
            raise ValueError(
                f"unsupported rollback {self.rollback!r}: valid values are True (a failed load "
                "restores the previous state) or False (no host copy; loading the checkpoint "
                "again repairs a failed load)"
            )
        check_host_workers(self.host_workers)

    @property
    def streams(self) -> bool:
        """True when the export leaves TE's default path."""
        return self.device is not None


class _Frame(NamedTuple):
    """One open policy block in a context: who entered it and what it placed."""

    owner: export_placement
    placement: Placement
    # The error of an out-of-order exit that happened inside this block while a generator or
    # coroutine was being closed, where it may never be seen (the garbage collector closes
    # abandoned generators): this block's own exit raises it too.
    fault: RuntimeError | None = None


# The blocks open in this thread or task, in the order they were entered. Each exit removes
# exactly its own block's frame, wherever it is, so a policy lasts exactly as long as its block.
# A tuple, set whole, so that every change is one atomic ContextVar.set.
_STACK: contextvars.ContextVar[tuple[_Frame, ...]] = contextvars.ContextVar(
    "te_ckpt_placement_stack", default=()
)


def current_placement() -> Placement | None:
    """Returns the policy active in this thread or task, or ``None`` when none is active.

    ``export_placement(None)`` is an active policy: inside it this returns
    ``Placement(device=None)``, which forces TE's default export.

    Example:
        >>> with export_placement("cpu"):
        ...     current_placement().device
        'cpu'
        >>> current_placement() is None
        True
    """
    stack = _STACK.get()
    return stack[-1].placement if stack else None


def resolve_placement(default: Placement | None = None) -> Placement | None:
    """The policy an export follows: the active one, else ``default``.

    ``default`` is an optimizer's own policy, such as the ``state_dict_placement`` given to
    :class:`te_ckpt_placement.FusedAdam`.
    """
    active = current_placement()
    return active if active is not None else default


# Called on entering a streaming policy. The TE hooks register here, so that this module imports
# nothing of the package and entering a policy still hooks TE's class once TE is loaded.
_ON_ENTER: list[Callable[[], None]] = []


def on_enter(hook: Callable[[], None]) -> None:
    """Registers ``hook`` to run each time a streaming policy is entered (once per hook)."""
    if hook not in _ON_ENTER:
        _ON_ENTER.append(hook)


def as_placement(value: Placement | str | torch.device | None) -> Placement:
    """Builds a :class:`Placement` from a device spelling or returns a given one unchanged."""
    if isinstance(value, Placement):
        return value
    return Placement(device=value)  # type: ignore[arg-type]


class _Default(enum.Enum):
    """An option left out of ``export_placement(...)``: :class:`Placement`'s default applies."""

    DEFAULT = "default"

    def __repr__(self) -> str:
        return "<Placement's default>"


_DEFAULT = _Default.DEFAULT

# Where to put the policy in a generator: never across a `yield`, since a generator runs in the
# context of the code that iterates it.
_ADVICE = (
    "Inside the generator, put `with export_placement(...)` around each export and end the block "
    "before the next `yield`, or move the export into a function decorated with "
    "`@export_placement(...)` and call that from the generator."
)
_GENERATOR_ADVICE = (
    "A generator's body runs while it is iterated, after the call has returned, and a policy "
    "held across a `yield` is in effect in the code that iterates it, between items. " + _ADVICE
)
_OUT_OF_ORDER = (
    "export_placement exited out of order: a policy block entered after it is still open in "
    "this thread or task (blocks must exit innermost first). A generator or async generator "
    "that yields inside `with export_placement(...)` does this, and its policy is then in effect "
    "in the code that iterates it, between yields. " + _ADVICE + " This block's policy has been "
    "removed; the blocks still open keep theirs."
)


def _propagating(error: BaseException, exc: BaseException | None) -> bool:
    """True when ``error`` is ``exc`` or in its cause/context chain (already on its way out)."""
    todo, seen = [exc], set()
    while todo:
        current = todo.pop()
        if current is None or id(current) in seen:
            continue
        if current is error:
            return True
        seen.add(id(current))
        todo += [current.__cause__, current.__context__]
    return False


def _close(
    stack: tuple[_Frame, ...],
    owner: export_placement,
    exc_type: type[BaseException] | None,
    exc: BaseException | None,
) -> tuple[tuple[_Frame, ...], RuntimeError | None]:
    """The stack without ``owner``'s innermost frame, and the error its exit must raise."""
    for i in range(len(stack) - 1, -1, -1):
        if stack[i].owner is owner:
            break
    else:
        return stack, RuntimeError(
            f"{owner!r} exited without a matching entry in this thread or task: each block must "
            "be exited once, in the thread or task that entered it"
        )
    frame, rest = stack[i], stack[:i] + stack[i + 1 :]
    error = RuntimeError(_OUT_OF_ORDER) if i != len(stack) - 1 else None
    if frame.fault is not None and not _propagating(frame.fault, exc):
        pending = RuntimeError(
            "a policy block inside this one was exited out of order while a generator or "
            "coroutine was being closed, where its error could not be seen (for example by the "
            f"garbage collector): {frame.fault}"
        )
        pending.__cause__ = frame.fault
        if error is None:
            error = pending
        else:
            error.__cause__ = pending
    # Closing a generator or coroutine, maybe from the garbage collector, where a raise is only
    # reported as unraisable: the innermost block still open raises it again on its exit.
    closing = exc_type is not None and issubclass(exc_type, GeneratorExit)
    if error is not None and closing and rest and rest[-1].fault is None:
        rest = (*rest[:-1], rest[-1]._replace(fault=error))
    return rest, error


class export_placement:  # noqa: N801 - used like contextlib's lower-case helpers
    """Places Transformer Engine ``FusedAdam`` exports inside a block, a function or a coroutine.

    Inside the block, ``FusedAdam.state_dict()`` (plain TE and subclasses that do not override
    it) streams: each state is converted, placed on the CPU with its DTensor metadata kept, and
    released on the GPU before the next one is produced. Outside, TE behaves as before.

    Give a device and keyword options, or one :class:`Placement` alone.

    As a decorator it covers the whole call; a call that returns an awaitable (``async def``,
    also behind a plain wrapper, a ``functools.partial`` or an ``async def __call__``) returns a
    coroutine that awaits it under the policy. An asyncio Future or Task is returned as it is (a
    task created in the call keeps the policy it was created under). Generators, async
    generators and calls that return one are refused with ``TypeError`` (the policy would be in
    effect in their caller between yields), and so are classes; ``staticmethod`` and
    ``classmethod`` objects are decorated through.

    Blocks exit innermost first. One exited out of order (a generator holding a policy across a
    ``yield``, closed inside another block) loses its policy at once, the blocks still open keep
    theirs, and its exit raises ``RuntimeError``; if that exit ran as a generator was closed
    (maybe by the garbage collector, which only reports it as unraisable), the enclosing block's
    exit raises it too. A ``KeyboardInterrupt`` in ``__enter__`` or ``__exit__`` leaves no frame
    behind, except one arriving at the very first instruction of ``__exit__``, before any of its
    code runs (as for every context manager written in Python).

    Args:
        device: ``"cpu"`` or ``None`` (TE's default export, also inside an outer CPU policy), or
            a :class:`Placement`.
        conversion: ``"host"`` or ``"device"``; see :class:`Placement`.
        reuse_buffers: ``True`` or ``False``; see :class:`Placement`.
        rollback: ``True`` or ``False``; see :class:`Placement`.
        host_workers: ``None``, ``0`` or a positive integer; see :class:`Placement`.

    Raises:
        ValueError: for any other device or option value, or options next to a ``Placement``.
        TypeError: for ``@export_placement`` without parentheses (write
            ``@export_placement("cpu")``).

    Example:
        >>> with export_placement("cpu"):
        ...     state = optimizer.state_dict()  # doctest: +SKIP
        >>> @export_placement("cpu")
        ... def save(path): ...
    """

    __slots__ = ("placement",)

    def __init__(
        self,
        device: Placement | str | torch.device | None = "cpu",
        *,
        conversion: Literal["host", "device"] | _Default = _DEFAULT,
        reuse_buffers: bool | _Default = _DEFAULT,
        rollback: bool | _Default = _DEFAULT,
        host_workers: int | _Default | None = _DEFAULT,
    ) -> None:
        given = {
            "conversion": conversion,
            "reuse_buffers": reuse_buffers,
            "rollback": rollback,
            "host_workers": host_workers,
        }
        options = {name: value for name, value in given.items() if value is not _DEFAULT}
        if isinstance(device, Placement):
            if options:
                raise ValueError(
                    f"export_placement got a Placement and the options {sorted(options)}: give "
                    "either one Placement, export_placement(Placement(device='cpu', "
                    "conversion='device')), or a device and options, "
                    "export_placement('cpu', conversion='device')"
                )
            self.placement = device
            return
        if callable(device) or isinstance(device, (staticmethod, classmethod)):
            raise TypeError(
                f"export_placement got {device!r} as its device: used as a decorator it needs "
                'its device, with parentheses: @export_placement("cpu"), or '
                "@export_placement(None) for Transformer Engine's own export"
            )
        self.placement = Placement(device=device, **options)  # type: ignore[arg-type]

    def __repr__(self) -> str:
        return f"export_placement({self.placement!r})"

    def __enter__(self) -> Placement:
        placement = self.placement
        if placement.streams:
            for hook in tuple(_ON_ENTER):
                hook()
        stack = _STACK.get()
        # The push is the last step: whatever raised above (a hook) left nothing pushed. If
        # anything interrupts after it, the `with` statement does not call __exit__: undo here.
        try:
            _STACK.set((*stack, _Frame(self, placement)))
            return placement
        except BaseException:
            _STACK.set(stack)
            raise

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        # Whatever interrupts this exit, the `with` statement will not call it again: every
        # handler below still removes this block's frame, once.
        try:
            stack = _STACK.get()
        except BaseException:
            _STACK.set(_close(_STACK.get(), self, exc_type, exc)[0])
            raise
        try:
            remaining, error = _close(stack, self, exc_type, exc)
            _STACK.set(remaining)
        except BaseException:
            if _STACK.get() is stack:  # interrupted before the set above
                _STACK.set(_close(stack, self, exc_type, exc)[0])
            raise
        if error is not None:
            raise error

    def __call__(self, func: _F) -> _F:
        if isinstance(func, (staticmethod, classmethod)):
            return type(func)(self(func.__func__))  # type: ignore[return-value]
        if inspect.isclass(func):
            raise TypeError(
                f"export_placement cannot decorate the class {func.__qualname__}: decorate the "
                "methods (or the function) that export or load optimizer state, or use "
                "`with export_placement(...)` around the calls"
            )
        if not callable(func):
            raise TypeError(f"export_placement decorates functions; got {func!r}")
        if inspect.isgeneratorfunction(func) or inspect.isasyncgenfunction(func):
            raise TypeError(
                f"export_placement cannot decorate {_name(func)}: it is a generator function. "
                + _GENERATOR_ADVICE
            )

        if inspect.iscoroutinefunction(func):

            @functools.wraps(func)
            async def async_wrapper(*args: Any, **kwargs: Any) -> Any:
                with export_placement(self.placement):
                    return await func(*args, **kwargs)

            return async_wrapper  # type: ignore[return-value]

        @functools.wraps(func)
        def wrapper(*args: Any, **kwargs: Any) -> Any:
            placement = self.placement
            with export_placement(placement):
                result = func(*args, **kwargs)
            return _scope_result(func, result, placement)

        return wrapper  # type: ignore[return-value]


def _name(func: object) -> str:
    return getattr(func, "__qualname__", None) or repr(func)


def _scope_result(func: object, result: Any, placement: Placement) -> Any:
    """Keeps the deferred work of a call's result under the policy, or refuses it."""
    if asyncio.isfuture(result):  # a Task runs in the context it copied when it was created
        return result
    if inspect.isawaitable(result):
        scoped: Any = _awaited_under(placement, result)
        if inspect.iscoroutine(result):  # "coroutine ... was never awaited" names the callee
            scoped.__name__, scoped.__qualname__ = result.__name__, result.__qualname__
        return scoped
    if inspect.isgenerator(result):
        with export_placement(placement):
            result.close()  # runs nothing unless the call had started it
        kind = "a generator (now closed)"
    elif inspect.isasyncgen(result):
        kind = "an async generator"
    else:
        return result
    raise TypeError(
        f"export_placement cannot scope {_name(func)}: the call returned {kind}. "
        + _GENERATOR_ADVICE
    )


async def _awaited_under(placement: Placement, awaitable: Awaitable[Any]) -> Any:
    with export_placement(placement):
        return await awaitable
