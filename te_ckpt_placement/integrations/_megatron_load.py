"""Megatron loads: the template the checkpoint is read into, and the states it hands over.

References are megatron-core 0.19.2 ``megatron/core/optimizer/distrib_optimizer.py`` and TE 2.20.2
``transformer_engine/pytorch/optimizers/fused_adam.py``
(https://github.com/NVIDIA/TransformerEngine/blob/v2.20.2/transformer_engine/pytorch/optimizers/fused_adam.py).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch

from .. import _pool, _tensors
from .. import _te_contract as te_contract
from .. import _te_load as te_load
from .._policy import Placement

#: The sharding types whose template Megatron's own load fills is ``get_unscaled_state``'s
#: device tensors (L1090-1117, here :func:`template_state`'s host ones), which TE then rounds on
#: the device. For dp_zero_gather_scatter and fully_reshardable it is host memory of Megatron's
#: own in both loads (L1318-1341, L2310-2312).
DEVICE_TEMPLATES = frozenset({"dp_reshardable", "fully_sharded_model_space"})


@dataclass
class Deferred:
    """What a placed ``load_state_dict`` of ``inner`` leaves for its end: the loaded states to
    write, ``(param, name, value)``, how many the read had already put in place
    (:func:`template_state`), the states TE's round trip has still to set
    (``te_load.reload_in_place``'s ``later``), and whether the values stand in for device ones
    (:meth:`for_load`)."""

    inner: Any
    round_as_device: bool = False
    states: list[tuple[Any, str, Any]] = field(default_factory=list)
    in_place: int = 0
    round_trip: list[tuple[Any, str]] = field(default_factory=list)

    @classmethod
    def for_load(cls, inner: Any, state_dict: Any) -> Deferred:
        """For a ``load_state_dict`` of ``state_dict``: its BF16 states rounded as on the device
        where they are set from :func:`template_state`'s host stand-ins of device tensors
        (:data:`DEVICE_TEMPLATES`, L1070-1088)."""
        kind = state_dict.get("param_state_sharding_type") if isinstance(state_dict, dict) else None
        if kind in DEVICE_TEMPLATES:  # a device whose rounding cannot be given fails now
            te_load.check_round_as_device(p for g in inner.param_groups for p in g["params"])
        return cls(inner, round_as_device=kind in DEVICE_TEMPLATES)

    def finish_round_trip(self, *, skip_loaded: bool = False) -> None:
        """Sets the states TE's round trip has still to set (``skip_loaded``: except those the
        loaded states overwrite, which it could not change)."""
        loaded = {(id(p), name) for p, name, _ in self.states} if skip_loaded else set()
        now = [s for s in self.round_trip if (id(s[0]), s[1]) not in loaded]
        self.round_trip = [s for s in self.round_trip if (id(s[0]), s[1]) in loaded]
        te_load.round_trip(self.inner, now)


def template_state(
    inner: Any, param: Any, name: str, value: Any, placement: Placement, where: object
) -> torch.Tensor:
    """What a load's template holds for one state, the tensor the checkpoint is read into
    (L1090-1117).

    A state whose ``get_unscaled_state`` is the live tensor itself (FP32, int16 remainders:
    L341-347) is read into that tensor, as Megatron's own template is; TE's ``set_scaled_state``
    would then copy it onto itself (L393-395), so it is not written again. With
    ``Placement(rollback=True)`` it gets a host tensor like the others instead, so that a load
    that fails part-way, in the read or after it, leaves every live state as the read found it.
    Every other state (BF16, FP16, FP8) is an empty host tensor of the FP32 dtype
    ``get_unscaled_state`` returns (L327-356), as Megatron's own ``fully_reshardable`` template is
    empty (``empty_data``, L1737). Each owns exactly its bytes: views of one buffer would each
    pickle the whole buffer, as Megatron's ``gather_object`` exchange of loaded tensors does.
    Its pages are left to the read that fills it, as those of the tensors Megatron's own read
    makes (``torch.load``) are: faulting them in first, on the calling thread, on the host
    workers' team or in the background, made test-size loads slower, not faster
    (docs/performance-log.md sections 15 and 16).
    """
    facts = te_contract.state_facts(inner, param, name)
    if facts is None:  # raises the export's error for a state TE does not keep
        te_contract.describe_state(inner, param, name, value, placement, where)
    assert facts is not None
    if facts.te_dtype == torch.float32 and not placement.rollback:
        return inner.get_unscaled_state(param, name)  # the live tensor (L341-347)
    return _pool.empty_host(torch.Size(facts.local_shape), host_dtype(facts))


def host_dtype(facts: te_contract.StateFacts) -> torch.dtype:
    """The dtype of ``get_unscaled_state`` (L327-356): int16 remainders, else FP32."""
    return torch.int16 if facts.remainder else torch.float32


def read_in_place(inner: Any, param: Any, name: str, value: torch.Tensor) -> bool:
    """Whether ``value`` is the live state itself, as :func:`template_state` gives."""
    live = inner.state.get(param, {}).get(name)
    if not isinstance(live, torch.Tensor):
        return False
    return _tensors.identical(value, _tensors.local(live))


def live_states_of(inner: Any, state_dict: Any) -> list[Any] | None:
    """The parameters, in ``state_dict`` order, when its states are exactly ``inner``'s live
    ones (what torch's ``Optimizer.state_dict`` packs); else None."""
    states = state_dict.get("state") if isinstance(state_dict, dict) else None
    if not isinstance(states, dict) or len(states) != len(inner.state):
        return None
    params = [p for group in inner.param_groups for p in group["params"]]
    order = []
    for index, entries in states.items():
        if not isinstance(index, int) or not 0 <= index < len(params):
            return None
        if entries is not inner.state.get(params[index]):
            return None
        order.append(params[index])
    return order


def te_class(inner: Any) -> type:
    """The TE class whose ``super()`` is torch's Optimizer (what TE's load calls first)."""
    for cls in type(inner).__mro__:
        if "load_state_dict" in vars(cls) and torch.optim.Optimizer in cls.__bases__:
            return cls
    return type(inner)
