"""A probe optimizer for the trainer-integration tests: it records the policy at every call.

``ProbeAdamW`` is a plain ``torch.optim.AdamW`` whose ``state_dict``, ``load_state_dict`` and
``step`` append a :class:`Call` (the active ``current_placement()``, the number of parameter
states involved, and the names of the functions on the stack) to a shared :class:`CallLog`.
Trainer callbacks and hooks can append their own events with :meth:`CallLog.record`.
"""

from __future__ import annotations

import sys
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

import torch

from te_ckpt_placement import Placement, current_placement

CPU = Placement(device="cpu")


@dataclass(frozen=True)
class Call:
    event: str
    placement: Placement | None
    n_states: int | None
    callers: tuple[str, ...]

    def called_from(self, name: str) -> bool:
        return name in self.callers


def _callers(depth: int) -> tuple[str, ...]:
    frame: Any = sys._getframe(depth)
    names = []
    while frame is not None:
        names.append(frame.f_code.co_name)
        frame = frame.f_back
    return tuple(names)


class CallLog(list[Call]):
    def record(self, event: str, n_states: int | None = None) -> None:
        self.append(Call(event, current_placement(), n_states, _callers(2)))

    def of(self, *events: str) -> list[Call]:
        return [c for c in self if c.event in events]

    def exports(self) -> list[Call]:
        """``state_dict()`` calls on an optimizer that has state: the checkpoint exports."""
        return [c for c in self.of("state_dict") if c.n_states]

    def loads(self) -> list[Call]:
        """``load_state_dict()`` calls with a non-empty state: the checkpoint loads."""
        return [c for c in self.of("load_state_dict") if c.n_states]

    def others(self) -> list[Call]:
        """Every call that is neither a checkpoint export nor a checkpoint load."""
        io = {id(c) for c in (*self.exports(), *self.loads())}
        return [c for c in self if id(c) not in io]


class ProbeAdamW(torch.optim.AdamW):
    """AdamW recording ``current_placement()`` in ``state_dict``, ``load_state_dict``, ``step``."""

    def __init__(self, params: Iterable[Any], log: CallLog, **kwargs: Any) -> None:
        super().__init__(params, **kwargs)
        self.probe_log = log

    def state_dict(self) -> dict[str, Any]:
        self.probe_log.record("state_dict", len(self.state))
        return super().state_dict()

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self.probe_log.record("load_state_dict", len(state_dict["state"]))
        super().load_state_dict(state_dict)

    def step(self, closure: Any = None) -> Any:
        self.probe_log.record("step")
        return super().step(closure)


def adam_steps(optimizer: torch.optim.Optimizer) -> set[int]:
    """The distinct ``step`` counts in an Adam optimizer's state (one value when consistent)."""
    return {int(s["step"]) for s in optimizer.state.values()}
