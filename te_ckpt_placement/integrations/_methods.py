"""The one way every integration runs framework methods inside ``export_placement`` (no framework
imports).

An integration lists the framework methods that export or load optimizer state as :class:`Method`
specs, and uses them in one of three forms, all of which call :func:`call_placed`:

- :func:`placing`: a class decorator giving a mixin class overrides that call ``super()``
  inside the policy ``self.optimizer_export_placement`` (``PlacementTrainerMixin``,
  ``PlacementStrategyMixin``, ``PlacementRecipeMixin``);
- :func:`place_methods`: wrappers on one instance (``place_trainer``, ``place_strategy``,
  ``PlacementCallback``); they are plain picklable objects, so a placed Lightning strategy
  survives ``ddp_spawn``;
- :func:`hook_class_method`: a framework class's own method, placed per call by a policy the
  instance points to (Fabric's optimizer wrapper, whose ``load_state_dict`` bypasses the
  strategy).

:func:`check_methods` is how the integrations meet a framework version that lacks a method:
a method the integration needs to keep its promise raises :class:`FrameworkMethodError`, any
other gives a ``RuntimeWarning``; both name the method and the installed framework version.
"""

from __future__ import annotations

import functools
import warnings
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from typing import Any, TypeVar

import torch

from .. import _wrap
from .._policy import Placement, as_placement, export_placement
from .._versions import installed

# Where one object's placement record lives, in that object's __dict__ (its wrappers are
# te_ckpt_placement._wrap's, of owner OWNER).
RECORD_ATTR = "_te_ckpt_placement_methods"
OWNER = "te_ckpt_placement.integrations"
# The wrapper place_methods puts on an instance (kept under this name until the rename package).
PlacedMethod = _wrap.Wrapper

PlacementLike = Placement | str | torch.device | None

_C = TypeVar("_C", bound=type)


class FrameworkMethodError(RuntimeError):
    """The installed framework lacks a method an integration must wrap to keep its promise.

    Raised instead of silently leaving that path unplaced (for example when a framework
    release renames the method). The message names the method, what it does for the
    framework, the framework version installed and the versions the integration was
    written against.
    """


@dataclass(frozen=True)
class Framework:
    """A framework an integration wraps: its name, distributions and the tested versions."""

    name: str
    distributions: tuple[str, ...]
    tested: str

    def version(self) -> str:
        """The installed version, or ``"unknown"``."""
        return installed(*self.distributions)

    def describe(self) -> str:
        return f"{self.name} {self.version()}"


@dataclass(frozen=True)
class Method:
    """One framework method that exports or loads optimizer state.

    Args:
        name: the method's name.
        why: what the framework does through it (for messages and docstrings).
        required: whether the integration needs it to keep its promise; a missing required
            method raises :class:`FrameworkMethodError`, a missing optional one warns.
        around: runs inside the policy instead of a plain call of the original, as
            ``around(obj, original, *args, **kwargs)``; a module-level function, so that
            instance wrappers stay picklable.
    """

    name: str
    why: str
    required: bool = True
    around: Callable[..., Any] | None = None


def call_placed(
    obj: object,
    method: Method,
    placement: Placement | None,
    original: Callable[..., Any],
    args: tuple[Any, ...],
    kwargs: dict[str, Any],
) -> Any:
    """Runs ``original`` (or ``method.around``) inside ``export_placement(placement)``.

    ``placement=None`` runs the original with no policy of its own: the caller's, if any, applies.
    """
    if placement is None:
        return original(*args, **kwargs)
    with export_placement(placement):
        if method.around is None:
            return original(*args, **kwargs)
        return method.around(obj, original, *args, **kwargs)


def as_methods(methods: Iterable[Method | str]) -> tuple[Method, ...]:
    """Specs from specs or bare names (a bare name is an optional method)."""
    return tuple(
        m if isinstance(m, Method) else Method(m, "a checkpoint method", required=False)
        for m in methods
    )


def check_methods(
    target: object,
    methods: Sequence[Method],
    framework: Framework | None,
    *,
    what: str,
    has: Callable[[str], bool] | None = None,
) -> tuple[Method, ...]:
    """The specs of ``methods`` that ``target`` (a class or an instance) has.

    ``has(name)`` replaces the lookup ``callable(getattr(target, name))``. ``framework`` names
    the framework and its tested versions in the messages (``None``: no framework named).

    Raises:
        FrameworkMethodError: ``target`` lacks a required method; nothing was changed.

    Warns:
        RuntimeWarning: for each optional method ``target`` lacks (that path stays unplaced).
    """
    owner = target if isinstance(target, type) else type(target)
    installed = f" ({framework.describe()})" if framework is not None else ""
    tested = f"Tested with {framework.name} {framework.tested}." if framework is not None else ""
    if has is None:

        def has(name: str) -> bool:
            return callable(getattr(target, name, None))

    missing = [m for m in methods if not has(m.name)]
    required = [m for m in missing if m.required]
    if required:
        listed = "; ".join(f"{m.name} ({m.why})" for m in required)
        raise FrameworkMethodError(
            f"te_ckpt_placement cannot place {what}: {owner.__module__}.{owner.__qualname__}"
            f"{installed} has no {listed}. {tested} Without this method the integration would "
            "silently leave that path on the GPU. Install a tested version, or wrap the "
            "framework's save and load calls in `with te_ckpt_placement.export_placement('cpu'):` "
            "yourself."
        )
    for m in missing:
        warnings.warn(
            f"te_ckpt_placement: {owner.__qualname__}{installed} has no {m.name} ({m.why}); "
            f"that path is not placed. {tested}".rstrip(),
            RuntimeWarning,
            stacklevel=3,
        )
    return tuple(m for m in methods if m not in missing)


# --- class level: mixins ------------------------------------------------------------------------


def _mixin_placement(obj: Any) -> Placement:
    return as_placement(obj.optimizer_export_placement)


def _mixin_around(method: Method, obj: Any, original: Any, *args: Any, **kwargs: Any) -> Any:
    return call_placed(obj, method, _mixin_placement(obj), original, args, kwargs)


def placing(methods: Iterable[Method]) -> Callable[[_C], _C]:
    """Class decorator: the class gets an override of each method that runs ``super()``'s inside
    ``export_placement(self.optimizer_export_placement)``.

    The decorated class lists the specs in ``__placed_methods__``.
    """
    specs = tuple(methods)

    def decorate(cls: _C) -> _C:
        for method in specs:
            if method.name in vars(cls):
                raise TypeError(f"{cls.__qualname__} already defines {method.name}")
            doc = (
                f"``{method.name}`` ({method.why}) inside "
                "``export_placement(self.optimizer_export_placement)``."
            )
            around = functools.partial(_mixin_around, method)
            _wrap.add_wrapper(cls, method.name, around, owner=OWNER, doc=doc)
        cls.__placed_methods__ = specs  # type: ignore[attr-defined]
        return cls

    return decorate


# --- instance level -----------------------------------------------------------------------------


@dataclass
class _Record:
    placement: Placement
    # Who placed the methods (a callback that must remove only what it installed), or None.
    owner: object = None


def _placed_around(
    method: Method, record: _Record, obj: Any, original: Any, *args: Any, **kwargs: Any
) -> Any:
    # Module-level, in a functools.partial: the wrapper pickles with the instance.
    return call_placed(obj, method, record.placement, original, args, kwargs)


def _record(obj: object) -> _Record | None:
    record = getattr(obj, "__dict__", {}).get(RECORD_ATTR)
    return record if isinstance(record, _Record) else None


def placed_methods(obj: object) -> tuple[str, ...]:
    """The names of ``obj``'s methods that currently run under the policy (empty if none)."""
    return tuple(_wrap.wrappers(obj, owner=OWNER)) if _record(obj) is not None else ()


def methods_owner(obj: object) -> object:
    """The ``owner`` given to the :func:`place_methods` call that placed ``obj``'s methods."""
    record = _record(obj)
    return record.owner if record is not None else None


def placement_of(obj: object) -> Placement | None:
    """The policy ``obj``'s methods run under: its :func:`place_methods` record, else its
    ``optimizer_export_placement`` (a placement mixin), else ``None``."""
    record = _record(obj)
    if record is not None:
        return record.placement
    if hasattr(type(obj), "__placed_methods__") and hasattr(obj, "optimizer_export_placement"):
        return _mixin_placement(obj)
    return None


def place_methods(
    obj: object,
    methods: Iterable[Method | str],
    placement: PlacementLike,
    *,
    framework: Framework | None = None,
    what: str | None = None,
    owner: object = None,
) -> tuple[str, ...]:
    """Runs each method of ``obj`` in ``methods`` inside ``export_placement(placement)``.

    ``methods`` are specs, or bare names (optional methods). Only this instance changes: its
    class and every other instance are untouched. Idempotent: a method already placed is not
    wrapped twice, and calling again updates the placement of all of them. ``owner`` is
    remembered from the first call (see :func:`methods_owner`). ``framework`` and ``what`` name
    the framework and the object in messages. Returns the names now placed.

    Raises:
        ValueError: ``placement`` is not a valid device or ``Placement``.
        FrameworkMethodError: ``obj`` lacks a required method (see :func:`check_methods`).
        Nothing is changed in either case.
    """
    resolved = as_placement(placement)
    present = check_methods(
        obj, as_methods(methods), framework, what=what or type(obj).__qualname__
    )
    record = _record(obj)
    if record is None:
        record = _Record(resolved, owner)
        vars(obj)[RECORD_ATTR] = record
    else:
        record.placement = resolved
    for method in present:
        around = functools.partial(_placed_around, method, record)
        _wrap.add_wrapper(obj, method.name, around, owner=OWNER)  # once per name
    return placed_methods(obj)


def unplace_methods(obj: object) -> bool:
    """Restores the methods that :func:`place_methods` wrapped; returns False if none were.

    A wrapper that something else has replaced since is left alone (with a warning): removing it
    would drop the other party's wrapper too.
    """
    if _record(obj) is None:
        return False
    _wrap.remove_wrapper(obj, owner=OWNER, stacklevel=3)
    del vars(obj)[RECORD_ATTR]
    return True


# --- a framework class's own method -------------------------------------------------------------


def _hooked_around(
    method: Method,
    placement: Callable[[Any], Placement | None],
    obj: Any,
    original: Any,
    *args: Any,
    **kwargs: Any,
) -> Any:
    return call_placed(obj, method, placement(obj), original, args, kwargs)


def hook_class_method(
    cls: type, method: Method, placement: Callable[[Any], Placement | None]
) -> bool:
    """Makes ``cls.<method.name>`` run under ``placement(self)`` whenever that is not ``None``.

    For a framework method that no strategy or trainer method encloses. Idempotent; returns
    False when ``cls`` was already hooked. ``cls`` must define the method itself (a
    :class:`FrameworkMethodError` from :func:`check_methods` otherwise). ``_wrap.remove_wrapper(cls,
    method.name, owner=OWNER)`` undoes it.
    """
    original = vars(cls).get(method.name)
    if original is None or not callable(original):
        raise AttributeError(f"{cls.__qualname__} does not define {method.name}")
    hooked = _wrap.current(cls, method.name)
    if hooked is not None and hooked.owner == OWNER:
        return False
    _wrap.remove_wrapper(cls, method.name, owner=OWNER, replaced=None)  # replaced since: rehook
    around = functools.partial(_hooked_around, method, placement)
    _wrap.add_wrapper(cls, method.name, around, owner=OWNER)
    return True
