"""Transformer Engine FusedAdam's storage contract, and the streaming export built on it.

This module reads TE's private storage (``name_to_dtype_map``, ``_scales``,
``store_param_remainders``, and ``Float8Tensor._data``/``_scale_inv``/``_fp8_dtype``) to describe
each state to the engine, and exports a whole optimizer through it.

What it depends on, in TE 2.20.2 ``transformer_engine/pytorch/optimizers/fused_adam.py``
(https://github.com/NVIDIA/TransformerEngine/blob/v2.20.2/transformer_engine/pytorch/optimizers/fused_adam.py):

- L203-207 ``name_to_dtype_map``: the stored dtype of exp_avg, exp_avg_sq and master_param
  (``torch.uint8`` means FP8).
- L214 ``_scales[param][name]``: the FP32 per-tensor scale of FP16 and FP8 states.
- L217-219 ``store_param_remainders``: int16 remainders instead of FP32 masters for BF16 params.
- L310-356 ``get_unscaled_state``: the conversion this module reproduces, state by state.
- L482-513 ``state_dict``: ``super().state_dict()``, then each state converted and re-wrapped
  with ``DTensor.from_local(..., shape=param.size(), stride=param.stride())``.

and in ``transformer_engine/pytorch/tensor/storage/float8_tensor_storage.py`` L20-60
(``_FromFloat8Func.forward``): FP8 data is ``_data`` (uint8, rowwise), dequantized as
``_data.view(fp8 dtype).float() * _scale_inv``, which is also TE's own CPU fallback.

Importing this module does not import TE.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from . import _export as engine
from . import _reports as reports
from . import _tensors
from ._policy import Placement
from ._versions import installed

STATE_NAMES = ("exp_avg", "exp_avg_sq", "master_param")

# Instance attributes of FusedAdam that the export and the load read (see the module docstring).
REQUIRED_INSTANCE_ATTRS = ("name_to_dtype_map", "_scales", "store_param_remainders")
# Class attributes the hooks replace or call, and those the load and a resume's initial states
# call (te_load: L397-455 ``_initialize_state``, L456-480 ``initialize_state``).
REQUIRED_CLASS_ATTRS = (
    "state_dict",
    "load_state_dict",
    "get_unscaled_state",
    "set_scaled_state",
    "_initialize_state",
    "initialize_state",
)
_FP8_DTYPES = {"kFloat8E4M3": torch.float8_e4m3fn, "kFloat8E5M2": torch.float8_e5m2}


class ContractError(RuntimeError):
    """TE's FusedAdam lacks an attribute the streaming export relies on."""


def te_version() -> str:
    """The installed Transformer Engine version, or "unknown"."""
    return installed("transformer_engine", "transformer-engine", module="transformer_engine")


def missing_attrs(obj: object, names: tuple[str, ...]) -> list[str]:
    return [name for name in names if not hasattr(obj, name)]


def raise_contract(owner: str, missing: list[str]) -> None:
    raise ContractError(
        f"te_ckpt_placement cannot stream this FusedAdam: {owner} lacks {', '.join(missing)} "
        f"(transformer_engine {te_version()}; the export was written against TE 2.20.2). "
        "Nothing was exported. Use export_placement(None) to run TE's own export, or install a "
        "TE version that has these attributes."
    )


def has_contract(optimizer: object) -> bool:
    """True for an optimizer with TE FusedAdam's storage contract (TE's class or a stand-in that
    keeps it): what the streaming export and load read is there."""
    return not missing_attrs(optimizer, REQUIRED_INSTANCE_ATTRS)


def check_contract(optimizer: object) -> None:
    """Raises :class:`ContractError` naming what is missing, before anything is exported."""
    missing = missing_attrs(optimizer, REQUIRED_INSTANCE_ATTRS)
    if missing:
        raise_contract(type(optimizer).__qualname__, missing)


def fp8_torch_dtype(fp8_dtype: object) -> torch.dtype | None:
    """The torch dtype of TE's ``DType.kFloat8*``, or None for a format not known here."""
    return _FP8_DTYPES.get(getattr(fp8_dtype, "name", str(fp8_dtype)).split(".")[-1])


def is_remainder(optimizer: Any, param: torch.Tensor, name: str) -> bool:
    """True where TE keeps the FP32 master as int16 remainders of a BF16 param (L217, L340)."""
    return bool(
        optimizer.store_param_remainders
        and name == "master_param"
        and param.dtype == torch.bfloat16
    )


def stored_dtype(optimizer: Any, param: torch.Tensor, name: str) -> torch.dtype:
    """The dtype of the raw local storage TE keeps for a state (TE L327-356, L421-441).

    ``torch.uint8`` for FP8 (the ``_data`` bytes), ``torch.int16`` for master remainders, and
    ``name_to_dtype_map[name]`` otherwise.
    """
    if is_remainder(optimizer, param, name):
        return torch.int16
    dtype: torch.dtype = optimizer.name_to_dtype_map[name]
    return dtype


def raw_storage(optimizer: Any, param: torch.Tensor, name: str, value: Any) -> Any:
    """The plain tensor holding a state's stored bytes: FP8 ``_data``, else the local tensor."""
    local = _tensors.local(value)
    if optimizer.name_to_dtype_map[name] == torch.uint8:
        return getattr(local, "_data", None)
    return local


@dataclass(frozen=True, slots=True)
class StateFacts:
    """What TE's contract says about one state of one parameter (TE L203-219, L327-356).

    Attributes:
        name: The state's name (one of :data:`STATE_NAMES`).
        te_dtype: ``name_to_dtype_map[name]``; ``torch.uint8`` means FP8.
        stored: The dtype of the raw local storage (:func:`stored_dtype`): int16 for remainders.
        remainder: The FP32 master is kept as int16 remainders of a BF16 param.
        local_shape: The shape of the parameter's local tensor, which the state has.
    """

    name: str
    te_dtype: torch.dtype
    stored: torch.dtype
    remainder: bool
    local_shape: tuple[int, ...]

    @property
    def scaled(self) -> bool:
        """FP16 or FP8: TE scales the state by the absmax of the whole local state (L276-310)."""
        return self.te_dtype in (torch.float16, torch.uint8)

    def raw(self, value: Any) -> Any:
        """:func:`raw_storage` of ``value`` for this state."""
        local = _tensors.local(value)
        return getattr(local, "_data", None) if self.te_dtype == torch.uint8 else local


def state_facts(optimizer: Any, param: torch.Tensor, name: Any) -> StateFacts | None:
    """The facts of state ``name`` of ``param``; None where ``name`` is no state TE keeps."""
    te_dtype = optimizer.name_to_dtype_map.get(name)
    if te_dtype is None:
        return None
    remainder = is_remainder(optimizer, param, name)
    return StateFacts(
        name=name,
        te_dtype=te_dtype,
        stored=torch.int16 if remainder else te_dtype,
        remainder=remainder,
        local_shape=tuple(_tensors.local(param).shape),
    )


class Contract:
    """TE's contract for one optimizer and one operation: checked once, each fact computed once.

    Made by :meth:`of` at the start of an export, a load or a planner's part of a ``dcp.load``
    and dropped at its end: states and ``_scales`` change between operations, so a Contract is
    never kept on the optimizer.
    """

    __slots__ = ("_facts", "_position", "optimizer")

    def __init__(self, optimizer: Any) -> None:
        self.optimizer = optimizer
        self._facts: dict[tuple[int, Any], tuple[torch.Tensor, StateFacts | None]] = {}
        self._position: dict[int, int] | None = None

    @classmethod
    def of(cls, optimizer: Any) -> Contract:
        """The contract of ``optimizer``; raises :class:`ContractError` naming what is missing."""
        check_contract(optimizer)
        return cls(optimizer)

    def facts(self, param: torch.Tensor, name: Any) -> StateFacts | None:
        """:func:`state_facts`, computed once per state of this operation."""
        key = (id(param), name)
        held = self._facts.get(key)
        if held is None:
            # The param is kept with its facts, so its id stays its own while the Contract lives.
            held = self._facts[key] = (param, state_facts(self.optimizer, param, name))
        return held[1]

    def position(self, param: torch.Tensor) -> int | None:
        """The parameter's position in ``param_groups`` order (its index in a state dict)."""
        if self._position is None:
            params = (p for g in self.optimizer.param_groups for p in g["params"])
            self._position = {id(p): i for i, p in enumerate(params)}
        return self._position.get(id(param))

    def describe(
        self, param: torch.Tensor, name: str, value: Any, placement: Placement, index: object
    ) -> engine.StateSource:
        """:func:`describe_state` with this operation's facts."""
        return _describe(
            self.optimizer, param, name, self.facts(param, name), value, placement, index
        )


def check_saved(facts: StateFacts, dtype: torch.dtype) -> str | None:
    """The one rule for a checkpoint value's dtype against the state's storage; None: it loads.

    An int16 master remainder loads only into remainders and every other state only from a
    floating-point value (a cast would load a remainder's integers as a master, or zero one).
    Returns the problem in the load's words, for a value and for a DCP checkpoint's metadata
    alike.
    """
    if facts.remainder and dtype != torch.int16:
        return (
            f"stored as {dtype}, but this optimizer keeps int16 remainders "
            "(store_param_remainders=True); load with the setting the checkpoint was saved with"
        )
    if not facts.remainder and not dtype.is_floating_point:
        hint = (
            " (an int16 master_param comes from store_param_remainders=True)"
            if dtype == torch.int16
            else ""
        )
        return f"stored as {dtype}, but this optimizer keeps floating-point states{hint}"
    return None


def check_live(facts: StateFacts, stored: Any, *, shape: bool = True) -> str | None:
    """The one rule for a live state's raw storage (:meth:`StateFacts.raw`); None: TE's own.

    It must be a tensor of the stored dtype and (with ``shape``) of the local shape.
    """
    if not isinstance(stored, torch.Tensor):
        return f"expected a tensor, found {type(stored).__name__}"
    if stored.dtype != facts.stored:
        return f"stored as {stored.dtype}, expected {facts.stored}"
    if shape and tuple(stored.shape) != facts.local_shape:
        return f"of shape {tuple(stored.shape)}, expected {facts.local_shape}"
    return None


def _state_error(param_index: object, name: str, problem: str) -> ValueError:
    return ValueError(f"optimizer state {name!r} of parameter {param_index}: {problem}")


def describe_state(
    optimizer: Any, param: torch.Tensor, name: str, value: Any, placement: Placement, index: object
) -> engine.StateSource:
    """How TE's ``get_unscaled_state(param, name)`` would produce this state (TE L327-356)."""
    facts = state_facts(optimizer, param, name)
    return _describe(optimizer, param, name, facts, value, placement, index)


def _describe(
    optimizer: Any,
    param: torch.Tensor,
    name: str,
    facts: StateFacts | None,
    value: Any,
    placement: Placement,
    index: object,
) -> engine.StateSource:
    if facts is None:
        raise _state_error(
            index, name, f"TE FusedAdam exports only {', '.join(STATE_NAMES)}; remove other keys"
        )
    dtype = facts.te_dtype
    local = _tensors.local(value)

    def on_device() -> torch.Tensor:
        return optimizer.get_unscaled_state(param, name)

    if dtype == torch.uint8:
        if placement.conversion == "device":
            return engine.StateSource(kind="device", on_device=on_device)
        data = getattr(local, "_data", None)
        fp8_format = getattr(local, "_fp8_dtype", None)
        fp8 = fp8_torch_dtype(fp8_format)
        scale_inv = getattr(local, "_scale_inv", None)
        if data is None or fp8 is None or scale_inv is None:
            # conversion="host" promises no GPU memory: never fall back to TE's GPU conversion.
            found = (
                "no rowwise _data (column-only FP8 storage)"
                if data is None
                else f"FP8 format {getattr(fp8_format, 'name', fp8_format)!r}"
                if fp8 is None
                else "no _scale_inv"
            )
            raise ContractError(
                f"optimizer state {name!r} of parameter {index} is a {type(local).__name__} with "
                f"{found}; the host conversion decodes rowwise {' and '.join(_FP8_DTYPES)} bytes "
                "with a per-tensor _scale_inv only. Nothing was exported. Use "
                "export_placement('cpu', conversion='device') (TE's own conversion on the GPU, one "
                "state at a time: at most 4 bytes per element of the largest state) or "
                "export_placement(None) (TE's own export)."
            )
        return engine.StateSource(kind="fp8", data=data, scale=scale_inv, fp8_dtype=fp8)

    if not isinstance(local, torch.Tensor):
        raise _state_error(index, name, f"expected a tensor, found {type(local).__name__}")
    problem = check_live(facts, local, shape=False)
    if problem is not None:
        raise _state_error(index, name, problem)
    if dtype == torch.float16:
        if placement.conversion == "device":
            return engine.StateSource(kind="device", on_device=on_device)
        return engine.StateSource(kind="scaled", data=local, scale=optimizer._scales[param][name])
    if dtype == torch.float32:
        return engine.StateSource(kind="copy", data=local)
    if dtype == torch.bfloat16:
        return engine.StateSource(kind="upcast", data=local)
    raise _state_error(
        index, name, f"unsupported stored dtype {dtype}; TE allows fp8/fp16/bf16/fp32"
    )


@reports.operation("export")
def stream_state_dict(optimizer: Any, placement: Placement, owner: type) -> dict[str, Any]:
    """TE's ``state_dict`` (L482-513) with every state placed on the host as it is produced."""
    contract = Contract.of(optimizer)
    # The method TE's own state_dict calls as super() (torch's Optimizer.state_dict).
    state_dict = super(owner, optimizer).state_dict()  # type: ignore[arg-type]
    # Every state is described (and so validated) before the first copy: an export that cannot
    # complete fails without having done any work.
    plan: engine.Plan = [
        (
            key,
            param,
            {
                name: contract.describe(param, name, value, placement, key)
                for name, value in stored.items()
            },
        )
        for key, param, stored in engine.iter_exportable(state_dict, optimizer.param_groups)
    ]
    return engine.export_optimizer_state(state_dict, plan, reuse_buffers=placement.reuse_buffers)
