"""The streaming load's template entries: one :class:`_Target` per live TE FusedAdam state.

:func:`_build_load` makes the flattened template of one optimizer for
:class:`~te_ckpt_placement.dcp.StreamingLoadPlanner` (``_get_optim_state_dict`` + flatten,
unexported), after :func:`_check_streamable` said the planner can serve it; :func:`_validate`
checks the entries against the checkpoint's metadata before any read, :func:`_write_state`
is the planner's one per-state write, and :func:`load_groups` loads an optimizer's
``param_groups`` once every state is read. The planner, which serves the reads, lives in
:mod:`.load_planner`; this module does not import it.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch
from torch.distributed.checkpoint.metadata import (
    ChunkStorageMetadata,
    Metadata,
    TensorStorageMetadata,
)
from torch.distributed.checkpoint.planner_helpers import (
    _create_chunk_from_dtensor,
    _create_chunk_from_tensor,
)
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    _get_fqns,
    _unflatten_optim_state_dict,
    _verify_options,
)
from torch.distributed.tensor import DTensor

from .. import _te_load as te_load
from .. import _tensors
from .._te_contract import (
    STATE_NAMES,
    Contract,
    ContractError,
    StateFacts,
    check_live,
    check_saved,
)
from . import _load_guard as load_guard

if TYPE_CHECKING:
    from ._load_planner import StreamingLoadPlanner
    from ._state import PlacedOptimizerState


#: What a load that stopped part-way leaves, and what to do (load_guard refuses step()).
_MIXED = (
    "The optimizer mixes checkpoint and previous values, and its step() refuses to run until a "
    "complete load: load the checkpoint again (a complete load writes every state)"
)


class _CannotStreamError(Exception):
    """The planner cannot serve this optimizer: the template path loads it (with a warning)."""


def _write_state(contract: Contract, param: torch.Tensor, name: str, value: torch.Tensor) -> None:
    """Writes one assembled state (FP32, or int16 remainders) into the live one, as TE's load does.

    The only per-state write of the planner (the states of :mod:`.assembly`, whose writes were
    checked with the same ``contract`` before the first read): ``te_load.write_prepared``, which
    writes it exactly as TE's load would.
    """
    te_load.write_prepared(contract, param, name, value)


class _Target:
    """One live optimizer state as a ``dcp.load`` template entry: its chunk, and no data.

    DCP plans the reads of a template entry from ``size()`` and ``__create_chunk_list__()``
    (``create_default_local_load_plan``), as it does for a DTensor; the planner that made the
    entry then serves the reads. Any other use (another planner, ``dcp.save``, a copy) fails.
    """

    def __init__(
        self,
        planner: StreamingLoadPlanner,
        owner: PlacedOptimizerState,
        contract: Contract,
        facts: StateFacts,
        param: torch.Tensor,
        key: str,
        live: Any,
    ) -> None:
        self.planner = planner
        self.owner = owner  # the adapter whose template holds this entry
        self.contract = contract  # the load's contract of the optimizer
        self.optimizer = contract.optimizer
        self.facts = facts
        self.param = param
        self.name = facts.name
        self.key = key  # the optimizer's flattened key, "state.<fqn>.<name>"
        self.remainder = facts.remainder
        # FP16 and FP8: scaled by the absmax of the whole state (``_apply_scale``, TE 2.20.2
        # fused_adam.py L268-308). Every other state is elementwise.
        self.whole = facts.scaled
        self.global_size = torch.Size(param.size())
        local_param = _tensors.local(param)
        self.chunk: ChunkStorageMetadata | None
        if isinstance(param, DTensor):
            # What DTensor.__create_chunk_list__ says for the export of this state (same mesh,
            # placements and global shape); no chunk on a rank outside the parameter's mesh.
            on_mesh = param.device_mesh.get_coordinate() is not None
            self.chunk = _create_chunk_from_dtensor(param) if on_mesh else None
        else:
            self.chunk = _create_chunk_from_tensor(param)
        shape = tuple(self.chunk.sizes) if self.chunk is not None else (0,)
        if self.chunk is not None and shape != tuple(local_param.shape):
            raise _CannotStreamError(
                f"{key}: the local shard {tuple(local_param.shape)} is not DCP's chunk {shape}"
            )
        self.local_shape = shape
        self.numel = math.prod(shape)
        # Elementwise states are written in the live storage itself.
        self.live: torch.Tensor | None = None
        if not self.whole:
            stored = facts.raw(live)
            if check_live(facts, stored) is not None:
                raise ValueError(
                    f"cannot stream the optimizer checkpoint into {key}: the live state is "
                    f"{_describe(stored)}, TE keeps {facts.stored} of shape "
                    f"{tuple(local_param.shape)}. No state was written."
                )
            self.live = stored
        # Set up by the planner: the key in dcp.load's flattened state dict, how items are read.
        self.dcp_key = key
        self.progress = load_guard.Progress(key)  # started, remaining: what the step guard says
        self.buffer: torch.Tensor | None = None  # the host assembly buffer (.assembly)

    @property
    def started(self) -> bool:
        return self.progress.started

    @started.setter
    def started(self, value: bool) -> None:
        self.progress.started = value

    @property
    def remaining(self) -> int | None:
        """Local elements still to arrive (None: not planned)."""
        return self.progress.remaining

    @remaining.setter
    def remaining(self, value: int | None) -> None:
        self.progress.remaining = value

    def size(self) -> torch.Size:
        """The state's global shape, which DCP checks against the checkpoint's."""
        return self.global_size

    def __create_chunk_list__(self) -> list[ChunkStorageMetadata]:
        if not self.planner._planning:
            raise RuntimeError(
                f"{self.dcp_key} is a streaming-load template entry: load it with the "
                "StreamingLoadPlanner that made it (dcp.load(..., planner=planner))"
            )
        return [] if self.chunk is None else [self.chunk]

    def __reduce_ex__(self, protocol: Any) -> Any:
        raise TypeError(
            f"{self.dcp_key} is a streaming-load template entry, which holds no data: it cannot "
            "be saved, pickled or copied. A PlacedOptimizerState returns such entries from the "
            "one state_dict() call after StreamingLoadPlanner(state) was made: make the planner "
            "in the dcp.load call that uses it"
        )

    def __repr__(self) -> str:
        return f"<streaming-load target {self.dcp_key} {tuple(self.global_size)}>"


def _describe(value: Any) -> str:
    if isinstance(value, torch.Tensor):
        return f"{value.dtype} of shape {tuple(value.shape)}"
    return type(value).__name__


@dataclass(eq=False)
class _OptimizerLoad:
    """One optimizer's part of a streaming template."""

    model: torch.nn.Module
    optimizer: Any
    info: Any  # torch's _StateDictInfo: FQN <-> parameter mappings
    targets: list[_Target]
    live_states: dict[int, Any]  # id(param) -> the optimizer's state dict entry at planning
    contract: Contract  # this load's, for every check and write of the optimizer's states
    fresh: bool = False  # the optimizer had no state: this load gave it TE's initial states
    _stopped: load_guard.StoppedLoad | None = None

    def stopped(self) -> load_guard.StoppedLoad:
        """This part's progress alone, for the step guard (one object per part)."""
        if self._stopped is None:
            self._stopped = load_guard.StoppedLoad([t.progress for t in self.targets], self.fresh)
        return self._stopped


def _validate(targets: dict[str, _Target], metadata: Metadata) -> None:
    """Every state against the checkpoint's metadata, before any read."""
    problems = []
    for key, target in targets.items():
        md = metadata.state_dict_metadata.get(key)
        if md is None:
            problems.append(f"{key}: not in the checkpoint")
            continue
        if not isinstance(md, TensorStorageMetadata):
            problems.append(f"{key}: saved as a non-tensor value")
            continue
        if md.size != target.global_size:
            problems.append(
                f"{key}: saved with shape {tuple(md.size)}, the parameter has "
                f"{tuple(target.global_size)}"
            )
        problem = check_saved(target.facts, md.properties.dtype)
        if problem is not None:
            problems.append(f"{key}: {problem}")
    if problems:
        raise ValueError(
            f"cannot load the optimizer checkpoint: {'; '.join(problems[:8])}"
            + (f" (and {len(problems) - 8} more)" if len(problems) > 8 else "")
            + ". No state was written."
        )


def _fqns_by_param(model: torch.nn.Module) -> dict[int, str]:
    """FQN of each parameter, as ``get_optimizer_state_dict`` names them (torch's ``_get_fqns``)."""
    out: dict[int, str] = {}
    for key, param in model.named_parameters():
        fqns = _get_fqns(model, key)
        if len(fqns) != 1:
            raise _CannotStreamError(f"parameter {key!r} has {len(fqns)} FQNs (an FSDP1 flat one)")
        out[id(param)] = next(iter(fqns))
    return out


def _check_streamable(
    model: torch.nn.Module, optimizer: Any, options: StateDictOptions
) -> tuple[Any, Contract]:
    """torch's state-dict info for ``(model, optimizer)`` and the load's contract of
    ``optimizer``; ``_CannotStreamError`` says why not."""
    try:
        contract = Contract.of(optimizer)
    except ContractError as exc:
        raise _CannotStreamError(
            f"{type(optimizer).__qualname__} does not keep TE FusedAdam's storage ({exc})"
        ) from exc
    info = _verify_options(model, (optimizer,), optim_only=True, options=options)
    if info.fsdp_modules:
        raise _CannotStreamError("the model is wrapped with FSDP1 (FullyShardedDataParallel)")
    return info, contract


def _build_load(
    planner: StreamingLoadPlanner,
    owner: PlacedOptimizerState,
    model: torch.nn.Module,
    info: Any,
    contract: Contract,
) -> tuple[dict[str, Any], _OptimizerLoad]:
    """The flattened template of one optimizer (``_get_optim_state_dict`` + flatten, unexported)."""
    optimizer = contract.optimizer
    in_optimizer = {id(p) for group in optimizer.param_groups for p in group["params"]}
    fqn_of = _fqns_by_param(model)

    def fqn(param: torch.Tensor) -> str:
        name = fqn_of.get(id(param))
        if name is None or id(param) not in in_optimizer:
            raise ValueError(
                "cannot stream the optimizer checkpoint: the optimizer holds a parameter that is "
                "not in model.named_parameters() (torch's get_optimizer_state_dict fails on it "
                "too). No state was written."
            )
        return name

    template: dict[str, Any] = {}
    targets: list[_Target] = []
    live_states: dict[int, Any] = {}
    for param, states in optimizer.state.items():  # torch's state_dict order
        name = fqn(param)
        live_states[id(param)] = states
        if not param.requires_grad:
            continue  # torch's load drops these states (_unflatten_optim_state_dict)
        for state_name, value in states.items():
            key = f"state.{name}.{state_name}"
            facts = contract.facts(param, state_name)
            if facts is None:
                raise ValueError(
                    f"cannot stream the optimizer checkpoint into {key}: TE FusedAdam keeps only "
                    f"{', '.join(STATE_NAMES)}. No state was written."
                )
            if isinstance(value, DTensor) != isinstance(param, DTensor):
                raise ValueError(
                    f"cannot stream the optimizer checkpoint into {key}: the state is "
                    f"{'' if isinstance(value, DTensor) else 'not '}a DTensor, the parameter "
                    f"{'is' if isinstance(param, DTensor) else 'is not'}. No state was written."
                )
            target = _Target(planner, owner, contract, facts, param, key, value)
            template[key] = target
            targets.append(target)
    for group in optimizer.param_groups:  # _flatten_optim_state_dict's param_groups entries
        for param in group["params"]:
            name = fqn(param)
            for k, v in group.items():
                if k != "params":
                    template[f"param_groups.{name}.{k}"] = v
    return template, _OptimizerLoad(model, optimizer, info, targets, live_states, contract)


def load_groups(template: dict[str, Any], load: _OptimizerLoad) -> Any:
    """One optimizer's ``param_groups``, its states kept; returns its deferred post-hooks."""
    optimizer = load.optimizer
    osd = _unflatten_optim_state_dict(optimizer, template, load.info)
    # TE's load gives every parameter of the checkpoint's "state" its states (fused_adam.py
    # L540): the live ones, which now hold the checkpoint's values.
    attached = {}
    for fqn in osd["state"]:
        param = load.info.fqn_param_mapping[fqn]
        states = load.live_states.get(id(param))
        attached[param] = states if states is not None else {}
    before = optimizer.state
    try:
        with te_load.post_hooks_deferred(optimizer) as post_hooks:
            # The method TE's load_state_dict calls as super() (L519): the groups, pre-hooks
            # and torch's own checks; no states, so nothing is cast.
            torch.optim.Optimizer.load_state_dict(
                optimizer, {"state": {}, "param_groups": osd["param_groups"]}
            )
    except Exception as exc:
        raise RuntimeError(
            f"StreamingLoadPlanner: every optimizer state was read, then loading the "
            f"param_groups failed ({type(exc).__name__}: {exc}): they are the previous ones. "
            f"{_MIXED}"
        ) from exc
    finally:
        if optimizer.state is not before:  # torch's part replaced the states: put them back
            optimizer.state.update(attached)  # one call: an interrupt cannot split it
    load_guard.lift(optimizer)
    te_load.note_loaded(optimizer)
    return post_hooks
