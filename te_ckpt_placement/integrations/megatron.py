"""Megatron-Core: ``DistributedOptimizer`` checkpoints that stream through host memory.

With ``--use-distributed-optimizer --use-precision-aware-optimizer --exp-avg-dtype bf16
--exp-avg-sq-dtype bf16``, Megatron-Core keeps TE ``FusedAdam`` moments in 16 bits, but reads
them for a checkpoint through TE's ``get_unscaled_state``, which makes a fresh FP32 GPU copy of
every BF16/FP16/FP8 state. The ``dp_reshardable`` (torch_dist's default) and
``fully_sharded_model_space`` paths keep all of those copies until the write: +8 bytes per local
element on the GPU. :func:`place_optimizer` changes that for one optimizer instance, a
``DistributedOptimizer`` or a ``ChainedOptimizer`` holding some (what ``get_megatron_optimizer``
returns)::

    optimizer = get_megatron_optimizer(config, model)
    place_optimizer(optimizer)  # every checkpoint save and load of it now streams

Its checkpoint methods (:data:`CHECKPOINT_METHODS`) then run inside ``export_placement``, and
inside a streaming policy (references are megatron-core 0.19.2,
``megatron/core/optimizer/distrib_optimizer.py``):

- ``_get_main_param_and_optimizer_states`` (L1090-1117, the one reader of parameter state for
  ``dp_reshardable``, ``fully_sharded_model_space``, ``dp_zero_gather_scatter`` and
  ``fully_reshardable``, at save and for load templates) produces each state for a save on the
  host, one at a time, with exactly the dtype and bits of ``get_unscaled_state`` (L1108): FP32,
  or the int16 remainders of ``store_param_remainders`` masters. Megatron never passes
  ``skip_unscale``;
- ``state_dict`` (L825-885) keeps only the param groups of its inner ``optimizer.state_dict()``
  (L833, L866): they now come from torch's ``Optimizer.state_dict``, which TE's ``state_dict``
  calls before converting the states that Megatron drops, so no state is exported at all;
- ``sharded_state_dict(is_loading=True)`` (L1460-1580) builds the load's template as Megatron's
  own does for FP32 and int16 states (their live tensors, read in place), and from empty host
  tensors of the FP32 dtype for the others, which the load reads into (a key a non-strict load
  lacks is dropped from template and result alike, so an empty value never reaches the
  optimizer). With ``Placement(rollback=True)`` every state gets a host tensor, so that a load
  that fails in the read leaves the live states as they were;
- ``load_state_dict`` (L887-1088) on an optimizer without state starts from TE's initial states
  (``te_load.initialize_states``) instead of Megatron's dummy GPU states (L974-1020), which would
  sit next to the states TE's load allocates; its round trip of TE's ``state_dict`` through TE's
  ``load_state_dict`` (L965, L1046) stays on the device (``te_load.reload_in_place``) and, for
  BF16 and FP16 states, is left out where a loaded state overwrites its result; and
  ``_set_main_param_and_optimizer_states`` (L1193-1225) writes each loaded state as TE's load
  does, host tensors through the pinned pipeline (``te_load.load_states``; inside
  ``load_state_dict`` all together, when it returns; BF16 rounded as on the device for the
  sharding types whose own template is there, ``Deferred.for_load``).

Checkpoints stay byte-compatible with Megatron's own. TE's class is not touched and neither is its
``get_unscaled_state``: TE's ``step()`` calls that itself (and a step can run inside checkpoint
code), so a step never sees a host tensor. Outside the checkpoint methods, and under
``export_placement(None)``, the optimizer behaves exactly as Megatron's.

Importing this module imports neither Megatron nor TE. :func:`place_optimizer` recognizes
Megatron's ``DistributedOptimizer`` by the source of the methods this integration depends on
(:data:`FINGERPRINTS`: megatron-core 0.19.0 and 0.19.2) and refuses any other with
:class:`UnsupportedMegatronError`, before changing anything.
"""

from __future__ import annotations

import contextlib
import contextvars
import hashlib
import inspect
import textwrap
import weakref
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

import torch

from .. import _export as engine
from .. import _reports as reports
from .. import _te_contract as te_contract
from .. import _te_load as te_load
from .. import _wrap
from .._policy import Placement, as_placement, current_placement
from .._versions import installed
from ._megatron_load import Deferred, live_states_of, read_in_place, te_class, template_state
from ._methods import PlacementLike, place_methods, unplace_methods

__all__ = [
    "CHECKPOINT_METHODS",
    "FINGERPRINTS",
    "MEGATRON_VERSIONS",
    "UnsupportedMegatronError",
    "check_megatron",
    "megatron_version",
    "place_optimizer",
    "placed_optimizers",
    "unplace_optimizer",
]

#: The megatron-core releases whose ``DistributedOptimizer`` methods have :data:`FINGERPRINTS`
#: (checked by source; 0.19.2 is the one run on GPUs).
MEGATRON_VERSIONS = ("0.19.0", "0.19.2")

#: SHA-256 of the dedented source of every ``DistributedOptimizer`` method this integration
#: replaces, diverts, or hands host tensors to (megatron-core 0.19.2 line ranges).
FINGERPRINTS: dict[str, str] = {
    # L825-885: its inner optimizer.state_dict() is diverted to torch's.
    "state_dict": "cc2fc62014a96b4ee886a4532b44dc2de6d76f9a7d15221d380e5dbb31b2d241",
    # L887-1088: its fresh-optimizer branch is replaced by TE's initial states.
    "load_state_dict": "11d0966483bdb609d0492ad258be527f0bc725dd3894e6426833d0d1a74c01a3",
    # L1460-1580: which readers run, and the load_state_dict(state_dict()) round trip.
    "sharded_state_dict": "dc94757add8d6ff18b384356c176922551a5a20f8b4556230d0f959122483740",
    # L1090-1117: reproduced with host outputs.
    "_get_main_param_and_optimizer_states": (
        "c7178119fd1fae73afbe283c40de2923eb0022aa0f189275022cfafc10faa6db"
    ),
    # L1193-1225: reproduced with te_load.load_states for its set_scaled_state calls.
    "_set_main_param_and_optimizer_states": (
        "38261637dc92678dafee7575392004c64ff6009c60477cfb997838ca29c3b366"
    ),
    # L1227-1260, L1262-1409, L1828-1976, L1978-2059: consume the host states.
    "get_parameter_state_dp_reshardable": (
        "cf52d4c98fbe8cb59ee15f908c9ed7bbf039251e9d3a556e4514594612071e44"
    ),
    "get_parameter_state_dp_zero": (
        "98951919b7e3bd6fddac796bf068ebff18bc9e197d19298e1fa355622c05b307"
    ),
    "sharded_param_state_dp_reshardable": (
        "923338e2532761683bcd8b8a9493c813bdecd0aee192f74ede75436a84a85ea9"
    ),
    "sharded_param_state_fs_model_space": (
        "914d62096caf713fe040030cb7a6573ea4d19a35f2b3553c155628694bc5323e"
    ),
}

#: The ``DistributedOptimizer`` methods that save or load a checkpoint: a placed optimizer runs
#: each inside ``export_placement``. ``ChainedOptimizer`` delegates every checkpoint call to
#: these methods of its members.
CHECKPOINT_METHODS = (
    "sharded_state_dict",
    "state_dict",
    "load_state_dict",
    "save_parameter_state",
    "load_parameter_state",
    "get_parameter_state_dp_zero",
    "get_parameter_state_dp_reshardable",
)

# The instance methods whose behaviour changes inside a streaming policy.
_BEHAVIOURS = (
    "state_dict",
    "load_state_dict",
    "sharded_state_dict",
    "_get_main_param_and_optimizer_states",
    "_set_main_param_and_optimizer_states",
)
# The other checkpoint methods, each counted as one streamed operation (the behaviours count
# themselves): a save ("export") or a load.
_REPORTED: dict[str, reports.Op] = {
    "save_parameter_state": "export",
    "get_parameter_state_dp_zero": "export",
    "get_parameter_state_dp_reshardable": "export",
    "load_parameter_state": "load",
}
# The owner of this integration's wrappers (te_ckpt_placement._wrap); the policy around the
# checkpoint methods is _methods.place_methods'.
OWNER = "megatron"
_REPLACED = "place_optimizer"
_verified: weakref.WeakSet[type] = weakref.WeakSet()

# Inner TE optimizers (by id) whose state_dict() returns torch's Optimizer.state_dict in this
# context: set only while a placed DistributedOptimizer.state_dict or load_state_dict runs.
_TORCH_STATE_DICT: contextvars.ContextVar[frozenset[int]] = contextvars.ContextVar(
    "te_ckpt_placement_megatron_torch_state_dict", default=frozenset()
)
# Inner TE optimizers (by id) whose load_state_dict of their own live states re-sets them in
# place (te_load.reload_in_place): set only while a placed load_state_dict runs.
_RELOAD: contextvars.ContextVar[frozenset[int]] = contextvars.ContextVar(
    "te_ckpt_placement_megatron_reload", default=frozenset()
)
# The states a placed load_state_dict has read, written together when it returns (one
# pipeline for all of them), by DistributedOptimizer id.
_DEFERRED: contextvars.ContextVar[dict[int, Deferred] | None] = contextvars.ContextVar(
    "te_ckpt_placement_megatron_deferred", default=None
)


# Placed DistributedOptimizers (by id) building a load's template: set only while a placed
# sharded_state_dict(is_loading=True) runs.
_TEMPLATE: contextvars.ContextVar[frozenset[int]] = contextvars.ContextVar(
    "te_ckpt_placement_megatron_template", default=frozenset()
)


class UnsupportedMegatronError(RuntimeError):
    """The optimizer's Megatron code is not the code this integration was written against."""


def megatron_version() -> str:
    """The installed megatron-core version, or a phrase saying why it is unknown."""
    return installed("megatron-core", module="megatron.core.package_info", default="not installed")


def _fingerprint(func: Any) -> str:
    return hashlib.sha256(textwrap.dedent(inspect.getsource(func)).encode()).hexdigest()


def check_megatron(cls: type) -> None:
    """Raises :class:`UnsupportedMegatronError` unless ``cls`` has the methods of
    :data:`FINGERPRINTS`, source for source."""
    if cls in _verified:
        return
    differing = []
    for name, expected in FINGERPRINTS.items():
        func = getattr(cls, name, None)
        if func is None:
            differing.append(f"{name} (missing)")
            continue
        try:
            found = _fingerprint(func)
        except (OSError, TypeError) as exc:
            raise UnsupportedMegatronError(
                f"te_ckpt_placement cannot check {cls.__qualname__}.{name} against megatron-core "
                f"{' and '.join(MEGATRON_VERSIONS)}: its source is not readable ({exc}). Nothing "
                "was placed; install megatron-core with its .py files."
            ) from exc
        if found != expected:
            differing.append(name)
    if differing:
        raise UnsupportedMegatronError(
            "te_ckpt_placement does not know this Megatron-Core (megatron-core "
            f"{megatron_version()}): {cls.__module__}.{cls.__qualname__} differs from "
            f"megatron-core {' and '.join(MEGATRON_VERSIONS)} in {', '.join(differing)}, which "
            "the Megatron integration reads or replaces. Nothing was placed. Use "
            "megatron-core==0.19.2, or save without place_optimizer (Megatron's own "
            "checkpointing, with its FP32 GPU copies)."
        )
    _verified.add(cls)


def _is_distributed_optimizer(obj: object) -> bool:
    return callable(getattr(type(obj), "_get_main_param_and_optimizer_states", None))


def _members(optimizer: object) -> Iterator[object]:
    chained = getattr(optimizer, "chained_optimizers", None)
    if chained is not None:
        for member in chained:
            yield from _members(member)
    elif _is_distributed_optimizer(optimizer):
        yield optimizer


def _is_stub(optimizer: Any) -> bool:
    return bool(getattr(optimizer, "is_stub_optimizer", False)) or optimizer.optimizer is None


def _is_te(inner: Any) -> bool:
    """True for a TE FusedAdam (what Megatron's precision-aware path calls get_unscaled_state on),
    False for HybridDeviceOptimizer and other optimizers, whose states Megatron reads raw."""
    return (
        inner is not None
        and hasattr(inner, "get_unscaled_state")
        and te_contract.has_contract(inner)
    )


def _streaming_te_inner(optimizer: Any) -> Any:
    """The inner TE optimizer when a streaming policy is active, else None."""
    placement = current_placement()
    if placement is None or not placement.streams:
        return None
    inner = optimizer.optimizer
    return inner if _is_te(inner) else None


# --- the behaviour inside a streaming policy --------------------------------------------------


@dataclass(frozen=True)
class _Reported:
    """A checkpoint method that, inside a streaming policy, leaves one ``TransferReport``
    (path ``"megatron"``; the calls it makes count towards it)."""

    op: reports.Op

    def __call__(self, optimizer: Any, original: Callable[..., Any], *args: Any, **kw: Any) -> Any:
        if _streaming_te_inner(optimizer) is None:
            return original(*args, **kw)
        with reports.operation(self.op, path="megatron"):
            return original(*args, **kw)


@contextlib.contextmanager
def _including(var: contextvars.ContextVar[frozenset[int]], obj: object) -> Iterator[None]:
    token = var.set(var.get() | {id(obj)})
    try:
        yield
    finally:
        var.reset(token)


def _state_dict(optimizer: Any, original: Callable[[], Any]) -> Any:
    inner = _streaming_te_inner(optimizer)
    if inner is None:
        return original()
    _divert_inner(optimizer, inner)
    with _including(_TORCH_STATE_DICT, inner), reports.operation("export", path="megatron"):
        return original()


def _load_state_dict(optimizer: Any, original: Callable[[Any], Any], state_dict: Any) -> Any:
    inner = _streaming_te_inner(optimizer)
    if inner is None:
        return original(state_dict)
    _divert_inner(optimizer, inner)
    with reports.operation("load", path="megatron"):
        if not _precision_aware(optimizer) or optimizer.ddp_config.use_megatron_fsdp:
            return original(state_dict)
        if len(inner.state) == 0:
            # The states TE's load writes into, instead of dummies next to them (L974-1020).
            te_load.initialize_states(inner)
        # Megatron hands TE's state_dict() back to TE's load_state_dict (L965, L1046): both
        # stay on the device, state by state (te_load.reload_in_place), instead of a whole
        # export to the host and a load back.
        deferred = Deferred.for_load(inner, state_dict)
        token = _DEFERRED.set({**(_DEFERRED.get() or {}), id(optimizer): deferred})
        try:
            with _including(_TORCH_STATE_DICT, inner), _including(_RELOAD, inner):
                result = original(state_dict)
        except BaseException:
            # Megatron's load failed after TE's: its round trip is done, as it would have been.
            deferred.finish_round_trip()
            raise
        finally:
            _DEFERRED.reset(token)
        # TE's round trip sets the BF16 and FP16 states that the loaded ones do not overwrite;
        # it could not change those they do (te_load.reload_in_place).
        deferred.finish_round_trip(skip_loaded=True)
        if not deferred.states and not deferred.in_place:  # no param_state (a template's)
            return result
        # The loaded states, read last by Megatron (L1070-1088), in one pipeline.
        rollback = _rollback()
        try:
            te_load.load_states(
                inner, deferred.states, rollback=rollback, round_as_device=deferred.round_as_device
            )
        except ValueError as exc:  # checked before any of them was written
            deferred.finish_round_trip()  # as TE's round trip left them
            exc.add_note(
                "te_ckpt_placement: Megatron's load_state_dict had already loaded the param "
                "groups (and grad scaler) and set the 16-bit states again from their own "
                "values; the parameter states it hands over in host memory are unchanged"
                + (
                    f", but {deferred.in_place} FP32 and int16 states hold the checkpoint's "
                    "values: Megatron's read put them in place, as its own load does (use "
                    "Placement(rollback=True) to read them into host memory first)."
                    if deferred.in_place
                    else "."
                )
            )
            raise
        except BaseException:
            # Rolled back, the states are as before the write: TE's round trip then sets them
            # as Megatron's own load would have left them. Without rollback the optimizer holds
            # a mix that must be loaded again (PartialLoadError), round trip or not.
            if rollback:
                deferred.finish_round_trip()
            raise
        return result


def _sharded_state_dict(optimizer: Any, original: Callable[..., Any], *args: Any, **kw: Any) -> Any:
    if _streaming_te_inner(optimizer) is None:
        return original(*args, **kw)
    is_loading = kw.get("is_loading", args[1] if len(args) > 1 else False)
    if not is_loading:
        with reports.operation("export", path="megatron"):
            return original(*args, **kw)
    # A load's template (L1090-1117): see template_state.
    with _including(_TEMPLATE, optimizer), reports.operation("load", path="megatron"):
        return original(*args, **kw)


def _precision_aware(optimizer: Any) -> bool:
    return bool(optimizer.config.use_precision_aware_optimizer_no_fp8_or_ds_fp8)


def _get_main_param_and_optimizer_states(
    optimizer: Any, original: Callable[[Any], Any], model_param: Any
) -> Any:
    inner = _streaming_te_inner(optimizer)
    if inner is None or not _precision_aware(optimizer):
        return original(model_param)
    placement = current_placement()
    assert placement is not None
    # L1097-1110, with each get_unscaled_state (L1108) produced on the host.
    group_index, group_order = optimizer.model_param_group_index_map[model_param]
    param = inner.param_groups[group_index]["params"][group_order]
    stored = inner.state[param]
    where = (group_index, group_order)
    if id(optimizer) in _TEMPLATE.get():
        tensors = {
            name: template_state(inner, param, name, value, placement, where)
            for name, value in stored.items()
            if isinstance(value, torch.Tensor)
        }
        tensors["param"] = tensors.pop("master_param")
        return tensors
    deferred = (_DEFERRED.get() or {}).get(id(optimizer))
    if deferred is not None:  # a read inside load_state_dict sees TE's round trip done
        deferred.finish_round_trip()
    sources = {
        name: te_contract.describe_state(inner, param, name, value, placement, where)
        for name, value in stored.items()
        if isinstance(value, torch.Tensor)
    }
    # Counted towards the checkpoint method's report (its own report if called on its own).
    with reports.operation("export", path="megatron"):
        tensors = {
            name: engine.materialize(source, reuse_buffers=placement.reuse_buffers)
            for name, source in sources.items()
        }
    tensors["param"] = tensors.pop("master_param")
    return tensors


def _set_main_param_and_optimizer_states(
    optimizer: Any, original: Callable[[Any, Any], Any], model_param: Any, tensors: Any
) -> Any:
    inner = _streaming_te_inner(optimizer)
    if inner is None or not _precision_aware(optimizer):
        return original(model_param, tensors)
    # L1199-1214, each set_scaled_state (L1211-1214) written as TE's load writes it, host
    # values through the pinned pipeline (te_load): inside load_state_dict, where Megatron sets
    # the states last, all together when it returns; else now. A value that is the live FP32
    # or int16 state itself (read in place, template_state) is where set_scaled_state would copy it.
    group_index, group_order = optimizer.model_param_group_index_map[model_param]
    param = inner.param_groups[group_index]["params"][group_order]
    states, in_place = [], 0
    for key, value in tensors.items():
        if not isinstance(value, torch.Tensor):
            continue
        name = "master_param" if key == "param" else key
        if read_in_place(inner, param, name, value):
            in_place += 1
        else:
            states.append((param, name, value))
    recorder = reports.active()
    if in_place and recorder is not None:
        recorder.detail("states_read_in_place", in_place)
    deferred = (_DEFERRED.get() or {}).get(id(optimizer))
    if deferred is not None:  # load_states checks them all before it writes any
        deferred.states.extend(states)
        deferred.in_place += in_place
    else:
        te_load.load_states(inner, states, rollback=_rollback())
    return None


def _rollback() -> bool:
    placement = current_placement()
    return placement is not None and placement.rollback


_IMPLS: dict[str, Callable[..., Any]] = {
    "load_state_dict": _load_state_dict,
    "sharded_state_dict": _sharded_state_dict,
    "_get_main_param_and_optimizer_states": _get_main_param_and_optimizer_states,
    "_set_main_param_and_optimizer_states": _set_main_param_and_optimizer_states,
}


def _inner_state_dict(inner: Any, original: Callable[[], Any]) -> Any:
    if id(inner) in _TORCH_STATE_DICT.get():
        # TE's state_dict is this plus a conversion of "state" (TE 2.20.2 fused_adam.py
        # L482-513), which DistributedOptimizer.state_dict drops (L866) and load_state_dict
        # hands back to TE's load_state_dict (L965, L1046; see _inner_load_state_dict).
        return torch.optim.Optimizer.state_dict(inner)
    return original()


def _inner_load_state_dict(inner: Any, original: Callable[[Any], Any], state_dict: Any) -> Any:
    params = live_states_of(inner, state_dict) if id(inner) in _RELOAD.get() else None
    if params is None:
        return original(state_dict)
    deferred = next((d for d in (_DEFERRED.get() or {}).values() if d.inner is inner), None)
    later = None if deferred is None else deferred.round_trip
    return te_load.reload_in_place(inner, state_dict, te_class(inner), params, later=later)


def _divert_inner(optimizer: Any, inner: Any) -> None:
    """Gives ``inner`` (once) a ``state_dict`` that is torch's while ``_TORCH_STATE_DICT`` names
    it, and a ``load_state_dict`` that reloads in place while ``_RELOAD`` names it."""
    diverted = _diverted(optimizer)
    if any(ref() is inner for ref in diverted.inners):
        return
    _wrap.add_wrapper(inner, "state_dict", _inner_state_dict, owner=OWNER)
    _wrap.add_wrapper(inner, "load_state_dict", _inner_load_state_dict, owner=OWNER)
    diverted.inners.append(weakref.ref(inner))


# --- placing ----------------------------------------------------------------------------------


@dataclass
class _Diverted:
    """A placed optimizer's ``state_dict`` behaviour, with the inner optimizers it has given a
    diverting ``state_dict`` (so that unplacing restores exactly those)."""

    inners: list[weakref.ref[Any]] = field(default_factory=list)

    def __call__(self, optimizer: Any, original: Callable[[], Any]) -> Any:
        return _state_dict(optimizer, original)


def _diverted(optimizer: Any) -> _Diverted:
    diverted = _wrap.wrappers(optimizer, owner=OWNER)["state_dict"].around
    assert isinstance(diverted, _Diverted)
    return diverted


def _distributed_optimizers(optimizer: object) -> list[Any]:
    found = list(_members(optimizer))
    if not found:
        raise ValueError(
            "place_optimizer places Megatron-Core DistributedOptimizers "
            "(--use-distributed-optimizer), given directly or inside a ChainedOptimizer "
            "(what get_megatron_optimizer returns); found none in "
            f"{type(optimizer).__qualname__}"
        )
    return found


def place_optimizer(optimizer: Any, placement: PlacementLike = "cpu") -> Any:
    """Runs one Megatron optimizer's checkpoint saves and loads inside ``export_placement``.

    ``optimizer`` is a ``DistributedOptimizer`` or a ``ChainedOptimizer`` (what
    ``get_megatron_optimizer`` returns); every ``DistributedOptimizer`` in it is placed, on that
    instance only. Members of other types, and stub optimizers (ranks without parameters), are
    left as they are. Call it once after building the optimizer, before loading a checkpoint.
    Idempotent; calling it again changes the placement. Returns ``optimizer``.

    Raises:
        ValueError: ``placement`` is not a valid device or ``Placement``, or ``optimizer``
            holds no ``DistributedOptimizer``.
        UnsupportedMegatronError: the ``DistributedOptimizer`` is not megatron-core 0.19's
            (see :data:`FINGERPRINTS`).
        ContractError: its TE ``FusedAdam`` lacks what the streaming export reads.

    Example:
        >>> optimizer = place_optimizer(get_megatron_optimizer(config, model))  # doctest: +SKIP
    """
    resolved = as_placement(placement)
    members = _distributed_optimizers(optimizer)
    # Everything is checked before anything changes.
    for member in members:
        check_megatron(type(member))
        if _is_stub(member):
            continue
        inner = member.optimizer
        if member.config.use_precision_aware_optimizer_no_fp8_or_ds_fp8 and hasattr(
            inner, "get_unscaled_state"
        ):
            te_contract.check_contract(inner)
    for member in members:
        if not _is_stub(member):
            _place(member, resolved)
    return optimizer


def _place(optimizer: Any, placement: Placement) -> None:
    if not _wrap.wrappers(optimizer, owner=OWNER):
        for name in _BEHAVIOURS:
            impl = _Diverted() if name == "state_dict" else _IMPLS[name]
            _wrap.add_wrapper(optimizer, name, impl, owner=OWNER)
        for name, op in _REPORTED.items():
            if hasattr(type(optimizer), name):  # (the legacy torch-format ones may be gone)
                _wrap.add_wrapper(optimizer, name, _Reported(op), owner=OWNER)
    # Outermost: the policy around each checkpoint method (the behaviours above included).
    place_methods(optimizer, CHECKPOINT_METHODS, placement)


def placed_optimizers(optimizer: object) -> tuple[Any, ...]:
    """The ``DistributedOptimizer`` instances in ``optimizer`` that are placed now."""
    return tuple(m for m in _members(optimizer) if _wrap.wrappers(m, owner=OWNER))


def unplace_optimizer(optimizer: object) -> bool:
    """Restores what :func:`place_optimizer` changed; returns False if nothing was placed.

    A method that something else replaced after placing is left alone, with a warning.
    """
    placed = placed_optimizers(optimizer)
    for member in placed:
        unplace_methods(member)
        diverted = _diverted(member)
        _wrap.remove_wrapper(member, owner=OWNER, replaced=_REPLACED, stacklevel=2)
        for ref in diverted.inners:
            inner = ref()
            if inner is not None:
                _wrap.remove_wrapper(inner, owner=OWNER, replaced=_REPLACED, stacklevel=2)
    return bool(placed)
