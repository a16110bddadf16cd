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

import sys
from typing import Any

import torch
from torch.distributed.tensor import DTensor

from . import engine, reports
from .policy import Placement

__all__ = [
    "STATE_NAMES",
    "ContractError",
    "check_contract",
    "describe_state",
    "has_contract",
    "is_remainder",
    "local_of",
    "stored_dtype",
    "stream_state_dict",
    "te_version",
]

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
    """The installed Transformer Engine version, or a phrase saying why it is unknown."""
    try:
        from importlib.metadata import PackageNotFoundError, version

        for dist in ("transformer_engine", "transformer-engine"):
            try:
                return version(dist)
            except PackageNotFoundError:
                continue
    except Exception:  # pragma: no cover - metadata is best effort
        pass
    module = sys.modules.get("transformer_engine")
    return str(getattr(module, "__version__", "unknown"))


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


def local_of(tensor: Any) -> Any:
    """The local tensor of a DTensor, or the value itself."""
    return tensor._local_tensor if isinstance(tensor, DTensor) else tensor


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
    local = local_of(value)
    if optimizer.name_to_dtype_map[name] == torch.uint8:
        return getattr(local, "_data", None)
    return local


def _state_error(param_index: object, name: str, problem: str) -> ValueError:
    return ValueError(f"optimizer state {name!r} of parameter {param_index}: {problem}")


def describe_state(
    optimizer: Any, param: torch.Tensor, name: str, value: Any, placement: Placement, index: object
) -> engine.StateSource:
    """How TE's ``get_unscaled_state(param, name)`` would produce this state (TE L327-356)."""
    dtype = optimizer.name_to_dtype_map.get(name)
    if dtype is None:
        raise _state_error(
            index, name, f"TE FusedAdam exports only {', '.join(STATE_NAMES)}; remove other keys"
        )
    local = local_of(value)

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
    expected = stored_dtype(optimizer, param, name)
    if local.dtype != expected:
        raise _state_error(index, name, f"stored as {local.dtype}, expected {expected}")
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
    check_contract(optimizer)
    # The method TE's own state_dict calls as super() (torch's Optimizer.state_dict).
    state_dict = super(owner, optimizer).state_dict()  # type: ignore[arg-type]
    # Every state is described (and so validated) before the first copy: an export that cannot
    # complete fails without having done any work.
    plan: engine.Plan = [
        (
            key,
            param,
            {
                name: describe_state(optimizer, param, name, value, placement, key)
                for name, value in stored.items()
            },
        )
        for key, param, stored in engine.iter_exportable(state_dict, optimizer.param_groups)
    ]
    return engine.export_optimizer_state(state_dict, plan, reuse_buffers=placement.reuse_buffers)
