"""A step guard on an optimizer that a streaming load stopped part-way.

A ``dcp.load`` that stops after :class:`~te_ckpt_placement.dcp.StreamingLoadPlanner` began
writing into the live states (an I/O error, a truncated file, an interrupt) leaves some states
holding the checkpoint's values and the others, with the ``param_groups``, what they held
before. Putting them back would need a copy of every state the load overwrites, which the
streaming load exists to avoid; and DCP gives a planner no hook around its reader, so a reader's
error may never pass through the planner. Instead, from the planner's first write into an
optimizer until a load of that optimizer completes, a step pre-hook refuses ``step()`` with an
error that says how many states were overwritten and what to do.

A complete load lifts it: the finish of a streaming load, or any ``load_state_dict`` of the
optimizer that runs its load post-hooks (the template path's ``set_optimizer_state_dict``, a
policy's streaming load, ``optimizer.load_state_dict``).
"""

from __future__ import annotations

import weakref
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any


@dataclass(eq=False)
class Progress:
    """How far a load got with one state: what the guard reports, shared with the planner."""

    key: str  # the optimizer's flattened key, "state.<fqn>.<name>"
    started: bool = False
    remaining: int | None = None  # local elements still to arrive (None: not planned)


@dataclass(eq=False)
class StoppedLoad:
    """What the guard keeps of one optimizer's part of a load: progress, no tensor, no planner.

    So a stopped load's assembly buffers, pinned rings and checkpoint values go with the planner,
    while the optimizer's step() still says how far the load got.
    """

    states: list[Progress] = field(default_factory=list)
    fresh: bool = False  # the optimizer had no state: the load gave it TE's initial states


class _Guard:
    """One optimizer's step pre-hook, and the load post-hook that lifts it.

    The hooks live in the optimizer's own hook dicts, which hold the guard: nothing outside the
    optimizer keeps it alive, and it keeps nothing of the load but its progress.
    """

    def __init__(self, optimizer: Any) -> None:
        self.loads: list[StoppedLoad] = []  # this optimizer's stopped loads (newest last)
        self.step_hook: Any = None
        # Stays registered: it removes only the step hook (removing itself would change the
        # dict torch iterates over). First, so that the other hooks run on a lifted optimizer.
        optimizer.register_load_state_dict_post_hook(self.lift, prepend=True)

    def lift(self, optimizer: Any = None) -> None:
        self.loads = []
        if self.step_hook is not None:
            self.step_hook.remove()
            self.step_hook = None

    def refuse(self, optimizer: Any, args: Any, kwargs: Any) -> None:
        raise RuntimeError(self.message())

    def message(self) -> str:
        if not self.loads:  # armed by a load that holds none of this optimizer's states
            return "step() refused: a streaming load of this optimizer stopped part-way"
        latest = self.loads[-1]
        overwritten = {t.key for load in self.loads for t in load.states if t.started}
        complete = sum(1 for t in latest.states if t.remaining == 0)
        others = "TE's initial states" if latest.fresh else "their previous values"
        return (
            "step() refused: a streaming load of an optimizer checkpoint (StreamingLoadPlanner) "
            f"stopped part-way after it overwrote {len(overwritten)} of this optimizer's "
            f"{len(latest.states)} states with the checkpoint's values ({complete} of them "
            f"completely); the other states hold {others} and the param_groups (learning rate, "
            "step count) the previous ones, so this step would train on a mix. Load a complete "
            "checkpoint again (dcp.load with a StreamingLoadPlanner, or any load_state_dict of "
            "this optimizer): it writes every state and lifts this guard"
        )


_guards: weakref.WeakKeyDictionary[Any, weakref.ref[_Guard]] = weakref.WeakKeyDictionary()


def arm(optimizer: Any, loads: Sequence[StoppedLoad]) -> None:
    """Refuses ``optimizer.step()`` until a load completes.

    ``loads``: the progress of the planner's parts for this optimizer, read when a step is
    refused.
    """
    ref = _guards.get(optimizer)
    guard = ref() if ref is not None else None
    if guard is None:
        guard = _Guard(optimizer)
        _guards[optimizer] = weakref.ref(guard)
    guard.loads += [load for load in loads if load not in guard.loads]
    if guard.step_hook is None:
        guard.step_hook = optimizer.register_step_pre_hook(guard.refuse)


def lift(optimizer: Any) -> None:
    """Lets ``optimizer.step()`` run again (a load of every state completed)."""
    ref = _guards.get(optimizer)
    guard = ref() if ref is not None else None
    if guard is not None:
        guard.lift()
