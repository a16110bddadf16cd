"""One way to wrap a method of a class or of one instance, and to undo it.

Every integration and TE's hooks wrap methods through this one pair, the way accelerate wraps
every module with ``add_hook_to_module``/``remove_hook_from_module``. :func:`add_wrapper` puts a
wrapper in ``target.__dict__[name]`` that calls ``around(obj, original, *args, **kwargs)``, and
remembers in ``target``'s own ``__dict__`` what it replaced; :func:`remove_wrapper` puts that back,
or warns and leaves an attribute that something else has replaced since (removing it would drop
the other party's wrapper too). Wrappers of different owners stack on one name. Imports nothing
of the package.
"""

from __future__ import annotations

import contextlib
import threading
import warnings
from collections.abc import Callable, Iterator
from typing import Any

# Where a target's wrappers are recorded, in its own __dict__: {(owner, name): Wrapper}.
RECORD = "__te_ckpt_placement_wrappers__"
_ANY = object()
_lock = threading.RLock()


def _class_attribute(obj: object, name: str) -> Any:
    """``obj.name`` as the class defines it, ignoring the instance's own attributes."""
    for klass in type(obj).__mro__:
        if name in vars(klass):
            attr = vars(klass)[name]
            get = getattr(type(attr), "__get__", None)
            return get(attr, obj, type(obj)) if get is not None else attr
    raise AttributeError(f"{type(obj).__qualname__} has no attribute {name!r}")


class Wrapper:
    """One wrapped attribute: ``around`` runs in place of ``target.<name>``.

    On an instance, this object itself is what ``target.__dict__[name]`` holds: a plain object
    rather than a closure, so that pickling the instance (Lightning's ``ddp_spawn``, Fabric's spawn
    launcher) carries the wrapper along when ``around`` is a module-level function. On a class it
    holds a function (``installed``) that binds ``self``.
    """

    __slots__ = ("around", "installed", "name", "owner", "previous", "target")

    def __init__(
        self, target: Any, name: str, around: Callable[..., Any], owner: Any, doc: str | None
    ) -> None:
        self.target = target
        self.name = name
        self.around = around
        self.owner = owner
        # What target.__dict__[name] held (None: nothing; the class's or the MRO's method runs).
        self.previous = vars(target).get(name)
        self.installed: Any = self if not isinstance(target, type) else self._function(doc)

    @property
    def __name__(self) -> str:
        return self.name

    def __repr__(self) -> str:
        owner = getattr(self.target, "__qualname__", None) or type(self.target).__qualname__
        return f"<wrapped {owner}.{self.name} by {self.owner!r}>"

    def original(self, obj: Any) -> Callable[..., Any]:
        """What the wrapper replaced, bound to ``obj``, looked up at call time."""
        previous = self.previous
        if isinstance(self.target, type):
            if previous is None:
                return getattr(super(self.target, obj), self.name)  # type: ignore[no-any-return]
            get = getattr(type(previous), "__get__", None)
            return get(previous, obj, type(obj)) if get is not None else previous  # type: ignore[no-any-return]
        if previous is not None:
            return previous  # type: ignore[no-any-return]
        return _class_attribute(obj, self.name)  # type: ignore[no-any-return]

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        obj = self.target
        return self.around(obj, self.original(obj), *args, **kwargs)

    def _function(self, doc: str | None) -> Callable[..., Any]:
        wrapper = self

        def wrapped(self: Any, *args: Any, **kwargs: Any) -> Any:
            return wrapper.around(self, wrapper.original(self), *args, **kwargs)

        cls = self.target
        wrapped.__name__ = self.name
        wrapped.__qualname__ = f"{cls.__qualname__}.{self.name}"
        wrapped.__module__ = cls.__module__
        wrapped.__doc__ = doc if doc is not None else getattr(self.previous, "__doc__", None)
        return wrapped


def _set(target: Any, name: str, value: Any) -> None:
    # An instance's record goes straight into its __dict__ (no __setattr__ of its class runs).
    if isinstance(target, type):
        setattr(target, name, value)
    else:
        vars(target)[name] = value


def _delete(target: Any, name: str) -> None:
    if isinstance(target, type):
        delattr(target, name)
    else:
        del vars(target)[name]


def _record(target: Any) -> dict[tuple[Any, str], Wrapper]:
    record = getattr(target, "__dict__", {}).get(RECORD)
    return record if isinstance(record, dict) else {}


def add_wrapper(
    target: Any,
    name: str,
    around: Callable[..., Any],
    *,
    owner: Any = None,
    doc: str | None = None,
) -> Wrapper:
    """Makes ``target.<name>(*args, **kwargs)`` run ``around(obj, original, *args, **kwargs)``.

    ``target`` is a class (every instance, ``obj`` the instance) or one instance (only it, ``obj``
    the instance). ``original`` is the attribute replaced, bound to ``obj``, or, where ``target``
    had none of its own, the method its class (an instance) or the classes after it in the MRO (a
    class, as ``super()``) have at call time. Idempotent per ``(owner, name)``: a second call
    returns the first wrapper. ``doc`` is a class wrapper's docstring (default: the original's).
    Thread-safe.
    """
    with _lock:
        record = _record(target)
        key = (owner, name)
        if key in record:
            return record[key]
        wrapper = Wrapper(target, name, around, owner, doc)
        if RECORD not in vars(target):
            record = {}
            _set(target, RECORD, record)
        record[key] = wrapper
        setattr(target, name, wrapper.installed)
        return wrapper


def remove_wrapper(
    target: Any,
    name: str | None = None,
    *,
    owner: Any = None,
    replaced: str | None = "the placement wrapper was installed",
    stacklevel: int = 2,
) -> bool:
    """Restores what :func:`add_wrapper` replaced: ``owner``'s wrapper of ``name``, or all of
    ``owner``'s wrappers on ``target`` (``name=None``), the latest first. Returns False if there
    was none.

    A wrapper that something else has replaced since is left in place with a ``RuntimeWarning``
    ("... was replaced after ``replaced``; ..."; ``replaced=None``: silently) and forgotten.
    ``stacklevel`` is the warning's, counted from the caller.
    """
    with _lock:
        record = _record(target)
        keys = [k for k in record if k[0] == owner and (name is None or k[1] == name)]
        for key in reversed(keys):
            wrapper = record.pop(key)
            attrs = vars(target)
            if attrs.get(wrapper.name) is not wrapper.installed:
                if replaced is not None:
                    what = target.__qualname__ if isinstance(target, type) else None
                    warnings.warn(
                        f"te_ckpt_placement: {what or type(target).__qualname__}.{wrapper.name} "
                        f"was replaced after {replaced}; leaving the replacement in place",
                        RuntimeWarning,
                        stacklevel=stacklevel + 1,
                    )
                continue
            if wrapper.previous is None:
                delattr(target, wrapper.name)
            else:
                setattr(target, wrapper.name, wrapper.previous)
        if not record and RECORD in vars(target):
            _delete(target, RECORD)
        return bool(keys)


def wrappers(target: Any, owner: Any = _ANY) -> dict[str, Wrapper]:
    """``target``'s wrappers by name, in the order they were added (of ``owner`` only, if given)."""
    return {k[1]: w for k, w in _record(target).items() if owner is _ANY or k[0] == owner}


def current(target: Any, name: str) -> Wrapper | None:
    """The wrapper that ``target.__dict__[name]`` is now, or None (not one of ours)."""
    attr = getattr(target, "__dict__", {}).get(name)
    if attr is None:
        return None
    return next((w for w in _record(target).values() if w.installed is attr), None)


def original(target: Any, name: str) -> Any:
    """What the wrapper now at ``target.__dict__[name]`` replaced (None: not wrapped, or it
    replaced nothing of ``target``'s own)."""
    wrapper = current(target, name)
    return wrapper.previous if wrapper is not None else None


@contextlib.contextmanager
def wrapping(
    target: Any, name: str, around: Callable[..., Any], *, owner: Any = None
) -> Iterator[Wrapper]:
    """:func:`add_wrapper` for the duration of a block, then :func:`remove_wrapper`."""
    wrapper = add_wrapper(target, name, around, owner=owner)
    try:
        yield wrapper
    finally:
        remove_wrapper(target, name, owner=owner, stacklevel=4)
