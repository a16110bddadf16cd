"""Instance-level method wrapping shared by the integrations (no framework imports).

``place_methods(obj, names, placement)`` replaces the bound methods ``names`` of one object (a
trainer, a strategy) with wrappers that run the original inside ``export_placement``; the class
and every other instance are untouched. ``unplace_methods(obj)`` restores exactly what was there
before: the class's method (by removing the instance attribute) or an instance attribute that
someone else had set.
"""

from __future__ import annotations

import functools
import warnings
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any

import torch

from ..policy import Placement, as_placement, export_placement

__all__ = ["methods_owner", "place_methods", "placed_methods", "unplace_methods"]

# Where the record of one object's wrappers lives, in that object's __dict__.
RECORD_ATTR = "_te_ckpt_placement_methods"
_MISSING = object()

PlacementLike = Placement | str | torch.device | None


@dataclass
class _Record:
    placement: Placement
    # Who placed the methods (a callback that must remove only what it installed), or None.
    owner: object = None
    # name -> what the instance __dict__ held before (or _MISSING), and the wrapper put there.
    previous: dict[str, Any] = field(default_factory=dict)
    wrappers: dict[str, Callable[..., Any]] = field(default_factory=dict)


def _record(obj: object) -> _Record | None:
    record = vars(obj).get(RECORD_ATTR)
    return record if isinstance(record, _Record) else None


def placed_methods(obj: object) -> tuple[str, ...]:
    """The names of ``obj``'s methods that currently run under the policy (empty if none)."""
    record = _record(obj)
    return tuple(record.wrappers) if record is not None else ()


def methods_owner(obj: object) -> object:
    """The ``owner`` given to the :func:`place_methods` call that placed ``obj``'s methods."""
    record = _record(obj)
    return record.owner if record is not None else None


def place_methods(
    obj: object, names: Iterable[str], placement: PlacementLike, *, owner: object = None
) -> tuple[str, ...]:
    """Runs each method of ``obj`` named in ``names`` inside ``export_placement(placement)``.

    Names that ``obj`` lacks (a framework version without that method) are skipped. Idempotent:
    a method already placed is not wrapped twice, and calling again updates the placement of all
    of them. ``owner`` is remembered from the first call (see :func:`methods_owner`). Returns
    the names now placed.

    Raises:
        ValueError: ``placement`` is not a valid device or ``Placement``.
    """
    resolved = as_placement(placement)
    record = _record(obj)
    if record is None:
        record = _Record(resolved, owner)
        vars(obj)[RECORD_ATTR] = record
    else:
        record.placement = resolved
    for name in names:
        if name in record.wrappers or not callable(getattr(obj, name, None)):
            continue
        record.previous[name] = vars(obj).get(name, _MISSING)
        wrapper = _wrap(getattr(obj, name), record)
        setattr(obj, name, wrapper)
        record.wrappers[name] = wrapper
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
        previous = record.previous[name]
        if previous is _MISSING:
            delattr(obj, name)
        else:
            setattr(obj, name, previous)
    del attrs[RECORD_ATTR]
    return True


def _wrap(method: Callable[..., Any], record: _Record) -> Callable[..., Any]:
    @functools.wraps(method)
    def placed(*args: Any, **kwargs: Any) -> Any:
        with export_placement(record.placement):
            return method(*args, **kwargs)

    return placed
