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

import warnings
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any, TypeVar

import torch

from ..policy import Placement, as_placement, export_placement

__all__ = [
    "Framework",
    "FrameworkMethodError",
    "Method",
    "PlacedMethod",
    "as_methods",
    "PlacementLike",
    "call_placed",
    "check_methods",
    "hook_class_method",
    "methods_owner",
    "place_methods",
    "placed_methods",
    "placement_of",
    "placing",
    "unplace_methods",
]

# Where the record of one object's wrappers lives, in that object's __dict__.
RECORD_ATTR = "_te_ckpt_placement_methods"
# Marks a framework class method replaced by hook_class_method; holds the original.
HOOK_MARK = "__te_ckpt_placement_hooked__"

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
        from importlib.metadata import PackageNotFoundError, version

        for dist in self.distributions:
            try:
                return version(dist)
            except PackageNotFoundError:
                continue
        return "unknown"

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


def _override(owner: type, method: Method) -> Callable[..., Any]:
    name = method.name

    def placed(self: Any, *args: Any, **kwargs: Any) -> Any:
        original = getattr(super(owner, self), name)
        return call_placed(self, method, _mixin_placement(self), original, args, kwargs)

    placed.__name__ = name
    placed.__qualname__ = f"{owner.__qualname__}.{name}"
    placed.__module__ = owner.__module__
    placed.__doc__ = (
        f"``{name}`` ({method.why}) inside ``export_placement(self.optimizer_export_placement)``."
    )
    return placed


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
            setattr(cls, method.name, _override(cls, method))
        cls.__placed_methods__ = specs  # type: ignore[attr-defined]
        return cls

    return decorate


# --- instance level -----------------------------------------------------------------------------


@dataclass
class _Record:
    placement: Placement
    # Who placed the methods (a callback that must remove only what it installed), or None.
    owner: object = None
    wrappers: dict[str, PlacedMethod] = field(default_factory=dict)


def _class_attribute(obj: object, name: str) -> Any:
    """``obj.name`` as the class defines it, ignoring the instance's own attributes."""
    for klass in type(obj).__mro__:
        if name in vars(klass):
            attr = vars(klass)[name]
            get = getattr(type(attr), "__get__", None)
            return get(attr, obj, type(obj)) if get is not None else attr
    raise AttributeError(f"{type(obj).__qualname__} has no attribute {name!r}")


class PlacedMethod:
    """One instance's method running under its placement record: what :func:`place_methods` puts
    in the instance's ``__dict__``.

    It calls the class's method (looked up at call time) or the instance attribute it replaced.
    A plain object rather than a closure, so that pickling the instance (Lightning's
    ``ddp_spawn``, Fabric's spawn launcher) carries the wrappers and the placement along.
    """

    __slots__ = ("method", "obj", "previous", "record")

    def __init__(self, obj: object, method: Method, previous: Any, record: _Record) -> None:
        self.obj = obj
        self.method = method
        self.previous = previous  # the instance attribute replaced, or None
        self.record = record

    @property
    def __name__(self) -> str:
        return self.method.name

    def __repr__(self) -> str:
        return (
            f"<placed {type(self.obj).__qualname__}.{self.method.name} "
            f"under {self.record.placement!r}>"
        )

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        original = self.previous
        if original is None:
            original = _class_attribute(self.obj, self.method.name)
        return call_placed(self.obj, self.method, self.record.placement, original, args, kwargs)


def _record(obj: object) -> _Record | None:
    record = getattr(obj, "__dict__", {}).get(RECORD_ATTR)
    return record if isinstance(record, _Record) else None


def placed_methods(obj: object) -> tuple[str, ...]:
    """The names of ``obj``'s methods that currently run under the policy (empty if none)."""
    record = _record(obj)
    return tuple(record.wrappers) if record is not None else ()


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
    attrs = vars(obj)
    for method in present:
        if method.name in record.wrappers:
            continue
        wrapper = PlacedMethod(obj, method, attrs.get(method.name), record)
        setattr(obj, method.name, wrapper)
        record.wrappers[method.name] = wrapper
    return tuple(record.wrappers)


def unplace_methods(obj: object) -> bool:
    """Restores the methods that :func:`place_methods` wrapped; returns False if none were.

    A wrapper that something else has replaced since is left alone (with a warning): removing it
    would drop the other party's wrapper too.
    """
    record = _record(obj)
    if record is None:
        return False
    attrs = vars(obj)
    for name, wrapper in record.wrappers.items():
        if attrs.get(name) is not wrapper:
            warnings.warn(
                f"te_ckpt_placement: {type(obj).__qualname__}.{name} was replaced after the "
                "placement wrapper was installed; leaving the replacement in place",
                RuntimeWarning,
                stacklevel=3,
            )
            continue
        if wrapper.previous is None:
            delattr(obj, name)
        else:
            setattr(obj, name, wrapper.previous)
    del attrs[RECORD_ATTR]
    return True


# --- a framework class's own method -------------------------------------------------------------


def hook_class_method(
    cls: type, method: Method, placement: Callable[[Any], Placement | None]
) -> bool:
    """Makes ``cls.<method.name>`` run under ``placement(self)`` whenever that is not ``None``.

    For a framework method that no strategy or trainer method encloses. Idempotent; returns
    False when ``cls`` was already hooked. ``cls`` must define the method itself (a
    :class:`FrameworkMethodError` from :func:`check_methods` otherwise).
    """
    original = vars(cls).get(method.name)
    if original is None or not callable(original):
        raise AttributeError(f"{cls.__qualname__} does not define {method.name}")
    if hasattr(original, HOOK_MARK):
        return False

    def hooked(self: Any, *args: Any, **kwargs: Any) -> Any:
        bound = original.__get__(self, type(self))
        return call_placed(self, method, placement(self), bound, args, kwargs)

    hooked.__name__ = method.name
    hooked.__qualname__ = f"{cls.__qualname__}.{method.name}"
    hooked.__doc__ = original.__doc__
    setattr(hooked, HOOK_MARK, original)
    setattr(cls, method.name, hooked)
    return True
