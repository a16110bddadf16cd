"""The one module that knows Transformer Engine's FusedAdam internals.

It hooks ``FusedAdam.state_dict`` so that the active :func:`export_placement` policy is followed,
and it reads TE's private storage (``name_to_dtype_map``, ``_scales``, ``store_param_remainders``,
and ``Float8Tensor._data``/``_scale_inv``/``_fp8_dtype``) to describe each state to the engine.

What it depends on, in TE 2.20.2 ``transformer_engine/pytorch/optimizers/fused_adam.py``
(https://github.com/NVIDIA/TransformerEngine/blob/v2.20.2/transformer_engine/pytorch/optimizers/fused_adam.py):

- L203-207 ``name_to_dtype_map``: the stored dtype of exp_avg, exp_avg_sq and master_param
  (``torch.uint8`` means FP8).
- L214 ``_scales[param][name]``: the FP32 per-tensor scale of FP16 states.
- L217-219 ``store_param_remainders``: int16 remainders instead of FP32 masters for BF16 params.
- L310-356 ``get_unscaled_state``: the conversion this module reproduces, state by state.
- L482-513 ``state_dict``: ``super().state_dict()``, then each state converted and re-wrapped
  with ``DTensor.from_local(..., shape=param.size(), stride=param.stride())``.

and in ``transformer_engine/pytorch/tensor/storage/float8_tensor_storage.py`` L20-60
(``_FromFloat8Func.forward``): FP8 data is ``_data`` (uint8, rowwise), dequantized as
``_data.view(fp8 dtype).float() * _scale_inv``, which is also TE's own CPU fallback.

Importing this module does not import TE; TE's class is hooked only once TE's optimizer module is
loaded, either when a policy is entered or, if TE is imported later, right after that import.
"""

from __future__ import annotations

import contextlib
import importlib.abc
import importlib.machinery
import importlib.util
import sys
import threading
import warnings
from collections.abc import Callable
from types import ModuleType
from typing import Any

import torch
from torch.distributed.tensor import DTensor

from . import engine
from .policy import Placement, resolve_placement

__all__ = ["install", "is_installed", "uninstall"]

TE_OPTIMIZER_MODULE = "transformer_engine.pytorch.optimizers.fused_adam"
STATE_NAMES = ("exp_avg", "exp_avg_sq", "master_param")

# Instance attributes of FusedAdam that the export reads (see the module docstring).
_REQUIRED_INSTANCE_ATTRS = ("name_to_dtype_map", "_scales", "store_param_remainders")
_REQUIRED_CLASS_ATTRS = ("state_dict", "get_unscaled_state")
_FP8_DTYPES = {"kFloat8E4M3": torch.float8_e4m3fn, "kFloat8E5M2": torch.float8_e5m2}

MARK = "__te_ckpt_placement_original__"
_lock = threading.RLock()
_auto_install = True
_warned_uninstalled = False


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


def _missing(obj: object, names: tuple[str, ...]) -> list[str]:
    return [name for name in names if not hasattr(obj, name)]


def _raise_contract(owner: str, missing: list[str]) -> None:
    raise ContractError(
        f"te_ckpt_placement cannot stream this FusedAdam: {owner} lacks {', '.join(missing)} "
        f"(transformer_engine {te_version()}; the export was written against TE 2.20.2). "
        "Nothing was exported. Use export_placement(None) to run TE's own export, or install a "
        "TE version that has these attributes."
    )


def check_contract(optimizer: object) -> None:
    """Raises :class:`ContractError` naming what is missing, before anything is exported."""
    missing = _missing(optimizer, _REQUIRED_INSTANCE_ATTRS)
    if missing:
        _raise_contract(type(optimizer).__qualname__, missing)


def _fp8_torch_dtype(fp8_dtype: object) -> torch.dtype | None:
    return _FP8_DTYPES.get(getattr(fp8_dtype, "name", str(fp8_dtype)).split(".")[-1])


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
    local = value._local_tensor if isinstance(value, DTensor) else value

    def on_device() -> torch.Tensor:
        return optimizer.get_unscaled_state(param, name)

    if dtype == torch.uint8:
        data = getattr(local, "_data", None)
        fp8 = _fp8_torch_dtype(getattr(local, "_fp8_dtype", None))
        scale_inv = getattr(local, "_scale_inv", None)
        if placement.conversion == "device" or data is None or fp8 is None or scale_inv is None:
            # Column-only FP8 storage or an unknown FP8 format: TE's own conversion, on device.
            return engine.StateSource(kind="device", on_device=on_device)
        return engine.StateSource(kind="fp8", data=data, scale=scale_inv, fp8_dtype=fp8)

    if not isinstance(local, torch.Tensor):
        raise _state_error(index, name, f"expected a tensor, found {type(local).__name__}")
    if dtype == torch.float16:
        if local.dtype != torch.float16:
            raise _state_error(index, name, f"stored as {local.dtype}, expected torch.float16")
        if placement.conversion == "device":
            return engine.StateSource(kind="device", on_device=on_device)
        scale = optimizer._scales[param][name]
        return engine.StateSource(kind="scaled", data=local, scale=scale)
    if dtype == torch.float32:
        remainder = (
            optimizer.store_param_remainders
            and name == "master_param"
            and param.dtype == torch.bfloat16
        )
        expected = torch.int16 if remainder else torch.float32
        if local.dtype != expected:
            raise _state_error(index, name, f"stored as {local.dtype}, expected {expected}")
        return engine.StateSource(kind="copy", data=local)
    if dtype == torch.bfloat16:
        if local.dtype != torch.bfloat16:
            raise _state_error(index, name, f"stored as {local.dtype}, expected torch.bfloat16")
        return engine.StateSource(kind="upcast", data=local)
    raise _state_error(
        index, name, f"unsupported stored dtype {dtype}; TE allows fp8/fp16/bf16/fp32"
    )


def stream_state_dict(optimizer: Any, placement: Placement, owner: type) -> dict[str, Any]:
    """TE's ``state_dict`` (L482-513) with every state placed on the host as it is produced."""
    check_contract(optimizer)
    state_dict = super(owner, optimizer).state_dict()
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
    return engine.export_optimizer_state(state_dict, plan)


def placed_state_dict(optimizer: Any, owner: type, original: Callable[[Any], Any]) -> Any:
    """Runs ``original`` (TE's own export) or the streaming export, as the policy says."""
    placement = resolve_placement(optimizer)
    if placement is None or not placement.streams:
        return original(optimizer)
    return stream_state_dict(optimizer, placement, owner)


def patch_class(cls: type) -> None:
    """Makes ``cls.state_dict`` follow the policy. Idempotent and thread-safe."""
    with _lock:
        current = cls.__dict__.get("state_dict")
        if current is not None and hasattr(current, MARK):
            return
        missing = _missing(cls, _REQUIRED_CLASS_ATTRS)
        if missing:
            _raise_contract(cls.__qualname__, missing)
        original = cls.__dict__.get("state_dict", cls.state_dict)

        def state_dict(self: Any) -> Any:
            return placed_state_dict(self, cls, original)

        state_dict.__doc__ = original.__doc__
        state_dict.__name__ = "state_dict"
        state_dict.__qualname__ = f"{cls.__qualname__}.state_dict"
        setattr(state_dict, MARK, original)
        cls.state_dict = state_dict  # type: ignore[attr-defined]


def unpatch_class(cls: type) -> None:
    """Restores ``cls.state_dict`` to what it was before :func:`patch_class`."""
    with _lock:
        current = cls.__dict__.get("state_dict")
        if current is not None and hasattr(current, MARK):
            cls.state_dict = getattr(current, MARK)  # type: ignore[attr-defined]


def is_patched(cls: type) -> bool:
    return hasattr(cls.__dict__.get("state_dict"), MARK)


def _te_class() -> type:
    try:
        module = importlib.import_module(TE_OPTIMIZER_MODULE)
    except ImportError as exc:
        raise ImportError(
            "te_ckpt_placement.install() needs Transformer Engine for PyTorch "
            "(pip install 'transformer-engine[pytorch]'); "
            f"importing {TE_OPTIMIZER_MODULE} failed: {exc}"
        ) from exc
    return module.FusedAdam  # type: ignore[no-any-return]


def install() -> None:
    """Hooks TE's ``FusedAdam.state_dict`` now, importing TE if needed.

    Entering :func:`export_placement` does this by itself once TE's optimizer module is loaded;
    call it to hook eagerly, or to undo :func:`uninstall`.

    Raises:
        ImportError: Transformer Engine is not installed.
        ContractError: the installed TE's FusedAdam lacks what the export relies on.
    """
    global _auto_install, _warned_uninstalled
    with _lock:
        patch_class(_te_class())
        _auto_install = True
        _warned_uninstalled = False


def uninstall() -> None:
    """Restores TE's own ``FusedAdam.state_dict`` and stops hooking it automatically.

    Inside a policy TE then exports as it always did, until :func:`install` is called.
    """
    global _auto_install
    with _lock:
        _auto_install = False
        _remove_import_watcher()
        module = sys.modules.get(TE_OPTIMIZER_MODULE)
        if module is not None and hasattr(module, "FusedAdam"):
            unpatch_class(module.FusedAdam)


def is_installed() -> bool:
    """True when TE's ``FusedAdam.state_dict`` currently follows the policy."""
    module = sys.modules.get(TE_OPTIMIZER_MODULE)
    return module is not None and is_patched(getattr(module, "FusedAdam", object))


def ensure_installed() -> None:
    """Called on entering a policy: hook TE's class if loaded, else hook it on import."""
    global _warned_uninstalled
    module = sys.modules.get(TE_OPTIMIZER_MODULE)
    fused_adam = getattr(module, "FusedAdam", None) if module is not None else None
    if fused_adam is not None and is_patched(fused_adam):
        return
    with _lock:
        if not _auto_install:
            if not _warned_uninstalled:
                _warned_uninstalled = True
                warnings.warn(
                    "te_ckpt_placement.uninstall() is in effect: TE FusedAdam.state_dict() "
                    "ignores export_placement until te_ckpt_placement.install() is called",
                    RuntimeWarning,
                    stacklevel=3,
                )
            return
        if fused_adam is not None:
            patch_class(fused_adam)
        elif module is None:
            _add_import_watcher()


class _ImportWatcher(importlib.abc.MetaPathFinder):
    """Hooks FusedAdam right after TE's optimizer module is imported inside a policy."""

    def find_spec(
        self, fullname: str, path: Any, target: ModuleType | None = None
    ) -> importlib.machinery.ModuleSpec | None:
        if fullname != TE_OPTIMIZER_MODULE:
            return None
        _remove_import_watcher()
        spec = importlib.util.find_spec(fullname)
        if spec is None or spec.loader is None or not hasattr(spec.loader, "exec_module"):
            return spec
        loader = spec.loader
        exec_module = loader.exec_module

        def exec_and_hook(module: ModuleType) -> None:
            exec_module(module)
            if _auto_install and hasattr(module, "FusedAdam"):
                patch_class(module.FusedAdam)

        loader.exec_module = exec_and_hook  # type: ignore[method-assign]
        return spec


_watcher: _ImportWatcher | None = None


def _add_import_watcher() -> None:
    global _watcher
    with _lock:
        if _watcher is None:
            _watcher = _ImportWatcher()
            sys.meta_path.insert(0, _watcher)


def _remove_import_watcher() -> None:
    global _watcher
    with _lock:
        if _watcher is not None:
            with contextlib.suppress(ValueError):
                sys.meta_path.remove(_watcher)
            _watcher = None
