"""The streaming load's checks: a checkpoint against TE FusedAdam's storage, before any write.

Everything a load refuses is refused here, with the ``ValueError`` that names it, before the
optimizer changes; :mod:`te_ckpt_placement._te_load_write` then writes the :class:`Job` s these
checks return. The dtype rules are :mod:`te_ckpt_placement._te_contract`'s (``check_saved``).
"""

from __future__ import annotations

from collections.abc import Hashable, Iterable
from dataclasses import dataclass
from typing import Any

import torch
from torch.distributed.tensor import DTensor

from . import _export as engine
from . import _tensors
from ._te_contract import STATE_NAMES, Contract, StateFacts, check_saved, state_facts


def _load_error(index: object, name: str | None, problem: str) -> ValueError:
    what = f"state {name!r} of parameter {index}" if name else f"parameter {index}"
    return ValueError(
        f"cannot load the optimizer checkpoint: {what}: {problem}. Nothing was loaded; the "
        "optimizer is unchanged."
    )


def _structure_error(problem: str) -> ValueError:
    return ValueError(
        f"cannot load the optimizer checkpoint: {problem}, as FusedAdam.state_dict() returns. "
        "Nothing was loaded; the optimizer is unchanged."
    )


def _check_structure(optimizer: Any, state_dict: Any) -> None:
    """The shape of the checkpoint dict, before anything reads into it."""
    if not isinstance(state_dict, dict) or not {"state", "param_groups"} <= set(state_dict):
        raise _structure_error("expected a dict with 'state' and 'param_groups'")
    if not isinstance(state_dict["state"], dict):
        found = type(state_dict["state"]).__name__
        raise _structure_error(f"'state' is a {found}; expected a dict of per-parameter dicts")
    saved_groups = state_dict["param_groups"]
    if not isinstance(saved_groups, (list, tuple)):
        found = type(saved_groups).__name__
        raise _structure_error(f"'param_groups' is a {found}; expected a list of dicts")
    for i, group in enumerate(saved_groups):
        if not isinstance(group, dict):
            raise _structure_error(
                f"param_groups[{i}] is a {type(group).__name__}; expected a dict with 'params'"
            )
        if "params" not in group:
            raise _structure_error(f"param_groups[{i}] has no 'params'; expected a list of ids")
        ids = group["params"]
        if not isinstance(ids, (list, tuple)) or not all(isinstance(k, Hashable) for k in ids):
            raise _structure_error(
                f"param_groups[{i}]['params'] is {type(ids).__name__} {ids!r:.60}; expected a "
                "list of parameter ids"
            )
    groups = optimizer.param_groups
    if len(groups) != len(saved_groups):
        raise ValueError(
            f"loaded state dict has a different number of parameter groups ({len(saved_groups)}, "
            f"the optimizer has {len(groups)}). Nothing was loaded."
        )
    for i, (g, s) in enumerate(zip(groups, saved_groups, strict=True)):
        if len(g["params"]) != len(s["params"]):
            raise ValueError(
                f"loaded state dict contains a parameter group ({i}) that doesn't match the size "
                f"of optimizer's group ({len(s['params'])} != {len(g['params'])}). "
                "Nothing was loaded."
            )


def check_value(optimizer: Any, param: torch.Tensor, index: object, name: str, value: Any) -> None:
    """One checkpoint value against the optimizer's storage of that state, as the streaming load
    checks it: raises the load's ``ValueError`` (naming ``index`` and ``name``) where it would
    refuse ``value``, before anything is written. Loaders that build the values to load from a
    checkpoint of their own (a full-state file sliced per rank) check the checkpoint's value
    with it before any copy: the copy would cast away its dtype."""
    check(state_facts(optimizer, param, name), param, index, name, value)


def check(
    facts: StateFacts | None, param: torch.Tensor, index: object, name: str, value: Any
) -> None:
    """:func:`check_value` with the state's facts (None: ``name`` is no state TE keeps)."""
    if facts is None:
        raise _load_error(index, name, f"TE FusedAdam keeps only {', '.join(STATE_NAMES)}")
    if not isinstance(value, torch.Tensor):
        raise _load_error(index, name, f"expected a tensor, found {type(value).__name__}")
    if (
        isinstance(value, DTensor)
        and isinstance(param, DTensor)
        and tuple(value.placements) != tuple(param.placements)
    ):
        raise _load_error(
            index,
            name,
            f"sharded as {tuple(value.placements)}, the parameter as "
            f"{tuple(param.placements)}; load it through DCP, which reshards",
        )
    local = _tensors.local(value)
    if local.is_nested:
        raise _load_error(index, name, "is a nested tensor; expected a dense tensor")
    if local.layout != torch.strided:
        raise _load_error(
            index, name, f"has layout {local.layout}; expected a dense tensor (.to_dense())"
        )
    if local.is_meta:
        raise _load_error(
            index,
            name,
            "is on the meta device and holds no values; load the checkpoint's data "
            "(e.g. torch.load(..., map_location='cpu'))",
        )
    if local.is_quantized:
        raise _load_error(index, name, "is a quantized tensor; dequantize it first")
    if local.is_complex():
        raise _load_error(index, name, f"has complex dtype {local.dtype}; TE keeps real states")
    expected = facts.local_shape
    if tuple(local.shape) != expected:
        raise _load_error(
            index,
            name,
            f"local shape {tuple(local.shape)} does not match the parameter's {expected}",
        )
    problem = check_saved(facts, local.dtype)
    if problem is not None:
        raise _load_error(index, name, problem)
    if facts.scaled and local.numel() == 0:
        # TE's _apply_scale takes the aminmax of the state (L298), which fails on no elements.
        raise _load_error(index, name, "TE cannot scale an empty FP16/FP8 state")


def plan_load(
    optimizer: Any, state_dict: Any
) -> list[tuple[Any, torch.Tensor, dict[str, torch.Tensor]]]:
    """Validates a checkpoint against the optimizer without touching either.

    Checks what torch's and TE's ``load_state_dict`` would check, and what they would fail on
    part-way or silently get wrong: the dict's structure, group layout, state names, local
    shapes, tensor kinds (meta, sparse, nested, quantized, complex), and int16 remainders against
    FP32 masters. Every problem is a ``ValueError`` naming it.

    Returns:
        ``[(index, param, {name: value})]``: every state to load, in checkpoint order.
    """
    return plan(Contract(optimizer), state_dict)


def plan(contract: Contract, state_dict: Any) -> list[tuple[Any, torch.Tensor, dict[str, Any]]]:
    """:func:`plan_load` with the operation's contract."""
    optimizer = contract.optimizer
    _check_structure(optimizer, state_dict)
    id_map = engine.indexed_params(state_dict["param_groups"], optimizer.param_groups)
    planned = []
    for index, states in state_dict["state"].items():
        if index not in id_map:
            continue  # kept as is, like torch; TE ignores it
        param = id_map[index]
        if not isinstance(states, dict):
            raise _load_error(index, None, f"expected a dict of states, found {type(states)}")
        entries: dict[str, torch.Tensor] = {}
        for name, value in states.items():
            if value is None:
                continue
            check(contract.facts(param, name), param, index, name, value)
            entries[name] = value
        planned.append((index, param, entries))
    return planned


@dataclass
class Job:
    """One state to write: where it came from (for messages), the checkpoint value, and what
    TE's contract says about the state."""

    index: object
    param: torch.Tensor
    name: str
    value: torch.Tensor
    facts: StateFacts

    @property
    def local(self) -> Any:
        return _tensors.local(self.value)


def job(contract: Contract, index: object, param: torch.Tensor, name: str, value: Any) -> Job:
    """The write of a checked state (:func:`check` accepted its name)."""
    facts = contract.facts(param, name)
    assert facts is not None, name
    return Job(index, param, name, value, facts)


def checked_jobs(contract: Contract, states: Iterable[tuple[torch.Tensor, str, Any]]) -> list[Job]:
    """The writes of ``(param, name, value)`` states, each validated as ``load_states`` says."""
    jobs: list[Job] = []
    seen: set[tuple[int, str]] = set()
    for param, name, value in states:
        index = contract.position(param)
        if index is None:
            raise ValueError(
                f"cannot load state {name!r}: the tensor given as its parameter (shape "
                f"{tuple(getattr(param, 'shape', ()))}) is not a parameter of this optimizer. "
                "Nothing was loaded."
            )
        if (id(param), name) in seen:
            raise _load_error(index, name, "given twice")
        seen.add((id(param), name))
        check(contract.facts(param, name), param, index, name, value)
        jobs.append(job(contract, index, param, name, value))
    return jobs
