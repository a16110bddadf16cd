"""The checkpoint-scoped export policy: ``export_placement`` and ``current_placement``.

The policy lives in a :mod:`contextvars` variable, so every thread and every asyncio task sees only
the policy it entered itself. Nothing here imports the rest of the package or Transformer Engine:
entering a policy runs the hooks registered with :func:`on_enter`, through which
:mod:`te_ckpt_placement.te_hooks` hooks TE's class if TE's optimizer module is (or later gets)
imported.
"""

from __future__ import annotations

import contextvars
import functools
import inspect
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Literal, TypeVar

import torch

__all__ = ["Placement", "current_placement", "export_placement", "on_enter", "resolve_placement"]

VALID_CONVERSIONS = ("host", "device")

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
            ``te_ckpt_placement.te_load.PartialLoadError`` (a KeyboardInterrupt propagates with
            a note) saying how many states were written; the optimizer then holds a mix of old
            and loaded states, and loading the same checkpoint again repairs it. ``True`` puts
            the previous state back exactly, at the price of a host copy of every live state
            the load overwrites (as much host memory as the optimizer states, copied as the
            load goes), which doubles the host memory of a load.

    Example:
        >>> Placement(device="cpu")
        Placement(device='cpu', conversion='host', reuse_buffers=False, rollback=False)
    """

    device: Literal["cpu"] | None = "cpu"
    conversion: Literal["host", "device"] = "host"
    reuse_buffers: bool = False
    rollback: bool = False

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

    @property
    def streams(self) -> bool:
        """True when the export leaves TE's default path."""
        return self.device is not None


# A stack rather than a single value: __exit__ must pop exactly the frame its own __enter__
# pushed in this context, even when one export_placement object is shared by several threads or
# tasks (the decorator case). Each frame is (owner object id, placement).
_STACK: contextvars.ContextVar[tuple[tuple[int, Placement], ...]] = contextvars.ContextVar(
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
    return stack[-1][1] if stack else None


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


class export_placement:  # noqa: N801 - used like contextlib's lower-case helpers
    """Places Transformer Engine ``FusedAdam`` exports inside a block, a function or a coroutine.

    Inside the block, ``FusedAdam.state_dict()`` (plain TE and subclasses that do not override
    it) streams: each state is converted, placed on the CPU with its DTensor metadata kept, and
    released on the GPU before the next one is produced. Outside, TE behaves as before.

    Args:
        device: ``"cpu"`` or ``None`` (TE's default export, also inside an outer CPU policy).
        conversion: ``"host"`` or ``"device"``; see :class:`Placement`.
        reuse_buffers: ``True`` or ``False``; see :class:`Placement`.
        rollback: ``True`` or ``False``; see :class:`Placement`.

    Raises:
        ValueError: for any other device or option value.

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
        conversion: Literal["host", "device"] = "host",
        reuse_buffers: bool = False,
        rollback: bool = False,
    ) -> None:
        if isinstance(device, Placement):
            self.placement = device
        else:
            self.placement = Placement(
                device=device,  # type: ignore[arg-type]
                conversion=conversion,
                reuse_buffers=reuse_buffers,
                rollback=rollback,
            )

    def __repr__(self) -> str:
        return f"export_placement({self.placement!r})"

    def __enter__(self) -> Placement:
        if self.placement.streams:
            for hook in _ON_ENTER:
                hook()
        _STACK.set((*_STACK.get(), (id(self), self.placement)))
        return self.placement

    def __exit__(self, *exc_info: object) -> None:
        stack = _STACK.get()
        if not stack or stack[-1][0] != id(self):
            raise RuntimeError(
                "export_placement exited out of order: exit the innermost policy first "
                "(each `with` block must close the policy it opened)"
            )
        _STACK.set(stack[:-1])

    def __call__(self, func: _F) -> _F:
        if inspect.iscoroutinefunction(func):

            @functools.wraps(func)
            async def async_wrapper(*args: Any, **kwargs: Any) -> Any:
                with export_placement(self.placement):
                    return await func(*args, **kwargs)

            return async_wrapper  # type: ignore[return-value]

        if inspect.isgeneratorfunction(func) or inspect.isasyncgenfunction(func):
            raise TypeError(
                "export_placement cannot decorate a generator: the policy would leak into the "
                "caller between yields. Use `with export_placement(...)` inside the generator."
            )

        @functools.wraps(func)
        def wrapper(*args: Any, **kwargs: Any) -> Any:
            with export_placement(self.placement):
                return func(*args, **kwargs)

        return wrapper  # type: ignore[return-value]
