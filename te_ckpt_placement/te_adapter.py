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
_REQUIRED_CLASS_ATTRS = ("state_dict", "load_state_dict", "get_unscaled_state", "set_scaled_state")
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


def _is_remainder(optimizer: Any, param: torch.Tensor, name: str) -> bool:
    """True where TE keeps the FP32 master as int16 remainders of a BF16 param (L217, L340)."""
    return bool(
        optimizer.store_param_remainders
        and name == "master_param"
        and param.dtype == torch.bfloat16
    )


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
        remainder = _is_remainder(optimizer, param, name)
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


def _load_error(index: object, name: str | None, problem: str) -> ValueError:
    what = f"state {name!r} of parameter {index}" if name else f"parameter {index}"
    return ValueError(
        f"cannot load the optimizer checkpoint: {what}: {problem}. Nothing was loaded; the "
        "optimizer is unchanged."
    )


def _param_local(param: torch.Tensor) -> torch.Tensor:
    return param._local_tensor if isinstance(param, DTensor) else param


def plan_load(
    optimizer: Any, state_dict: Any
) -> list[tuple[Any, torch.Tensor, dict[str, torch.Tensor]]]:
    """Validates a checkpoint against the optimizer without touching either.

    Checks what torch's and TE's ``load_state_dict`` would check, and what they would silently get
    wrong: group layout, state names, local shapes, and int16 remainders against FP32 masters.

    Returns:
        ``[(index, param, {name: value})]``: every state to load, in checkpoint order.
    """
    if not isinstance(state_dict, dict) or not {"state", "param_groups"} <= set(state_dict):
        raise ValueError(
            "cannot load the optimizer checkpoint: expected a dict with 'state' and "
            "'param_groups', as FusedAdam.state_dict() returns. Nothing was loaded."
        )
    groups, saved_groups = optimizer.param_groups, state_dict["param_groups"]
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
    id_map = engine.indexed_params(saved_groups, groups)
    plan = []
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
            if name not in optimizer.name_to_dtype_map:
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
            local = value._local_tensor if isinstance(value, DTensor) else value
            expected = tuple(_param_local(param).shape)
            if tuple(local.shape) != expected:
                raise _load_error(
                    index,
                    name,
                    f"local shape {tuple(local.shape)} does not match the parameter's {expected}",
                )
            remainder = _is_remainder(optimizer, param, name)
            if remainder and local.dtype != torch.int16:
                raise _load_error(
                    index,
                    name,
                    f"stored as {local.dtype}, but this optimizer keeps int16 remainders "
                    "(store_param_remainders=True); load with the setting the checkpoint was "
                    "saved with",
                )
            if not remainder and not local.is_floating_point():
                raise _load_error(
                    index,
                    name,
                    f"stored as {local.dtype}, but this optimizer keeps floating-point states"
                    + (
                        " (an int16 master_param comes from store_param_remainders=True)"
                        if local.dtype == torch.int16
                        else ""
                    ),
                )
            entries[name] = value
        plan.append((index, param, entries))
    return plan


def _reusable(optimizer: Any, param: torch.Tensor, name: str, live: Any) -> Any:
    """The live state tensor to write into, or None when TE must allocate a new one."""
    if live is None or isinstance(live, DTensor) != isinstance(param, DTensor):
        return None
    local = live._local_tensor if isinstance(live, DTensor) else live
    dtype = optimizer.name_to_dtype_map[name]
    remainder = _is_remainder(optimizer, param, name)
    stored = getattr(local, "_data", None) if dtype == torch.uint8 else local
    expected = torch.uint8 if dtype == torch.uint8 else (torch.int16 if remainder else dtype)
    if stored is None or stored.dtype != expected:
        return None
    if tuple(stored.shape) != tuple(_param_local(param).shape):
        return None
    if dtype != torch.float32 and name not in optimizer._scales.get(param, {}):
        return None
    return live


class _Rollback:
    """What a failed load must put back: the replaced containers and overwritten tensor bytes.

    The containers (``state``, ``param_groups``, ``_scales`` entries) are kept by reference; a
    tensor written in place is copied to host memory just before its write. So the rollback costs
    host memory equal to the live states the load overwrites (R bytes, never GPU memory) and one
    device-to-host copy of each, made as the load goes.
    """

    def __init__(self, optimizer: Any) -> None:
        self.state = optimizer.state
        self.param_groups = optimizer.param_groups
        self.scales = {p: dict(d) for p, d in optimizer._scales.items()}
        self.saved: list[tuple[torch.Tensor, torch.Tensor]] = []

    def keep(self, tensor: torch.Tensor | None) -> None:
        if tensor is not None:
            self.saved.append((tensor, tensor.to("cpu", copy=True)))

    def keep_state(self, optimizer: Any, param: torch.Tensor, name: str, live: Any) -> None:
        local = live._local_tensor if isinstance(live, DTensor) else live
        if hasattr(local, "_data"):  # FP8: bytes, scale_inv, and the quantizer TE rewrites
            for attr in ("_data", "_scale_inv", "_transpose"):
                self.keep(getattr(local, attr, None))
            quantizer = getattr(local, "_quantizer", None)
            for attr in ("scale", "amax"):
                self.keep(getattr(quantizer, attr, None))
        else:
            self.keep(local)
        self.keep(optimizer._scales.get(param, {}).get(name))

    def restore(self, optimizer: Any) -> None:
        for tensor, host in reversed(self.saved):
            tensor.copy_(host)
        optimizer.state = self.state
        optimizer.param_groups = self.param_groups
        optimizer._scales.clear()
        optimizer._scales.update(self.scales)


def stream_load_state_dict(
    optimizer: Any, state_dict: Any, owner: type, *, rollback: bool = True
) -> None:
    """TE's ``load_state_dict`` (L515-548) without torch's bulk cast of every state to the GPU.

    Every state goes from the checkpoint into the live state one at a time, through TE's own
    ``set_scaled_state``, so the result is TE's bit for bit. Live tensors are written in place
    where shape and dtype match. The checkpoint is never modified. A checkpoint that does not fit
    fails validation before anything changes; a failure part-way (an allocation, a device error,
    a KeyboardInterrupt) puts the previous state back when ``rollback`` is set (see _Rollback).
    """
    check_contract(optimizer)
    plan = plan_load(optimizer, state_dict)
    # Capture the live states before torch replaces optimizer.state.
    live = {param: dict(optimizer.state.get(param, {})) for _, param, _ in plan}
    planned = {index for index, _, _ in plan}
    # torch handles param_groups, hooks and unknown keys; each param's entry is an empty dict, so
    # it casts nothing but keeps the entry order TE's load would produce.
    stripped = dict(state_dict)
    stripped["state"] = {k: ({} if k in planned else v) for k, v in state_dict["state"].items()}
    undo = _Rollback(optimizer) if rollback else None
    try:
        super(owner, optimizer).load_state_dict(stripped)  # type: ignore[arg-type]
        for _, param, entries in plan:
            state: dict[str, Any] = {}
            optimizer.state[param] = state
            for name, value in entries.items():
                reuse = _reusable(optimizer, param, name, live[param].get(name))
                if reuse is not None:
                    if undo is not None:
                        undo.keep_state(optimizer, param, name, reuse)
                    state[name] = reuse
                    if optimizer.name_to_dtype_map[name] != torch.float32:
                        # TE's load starts every scale from a fresh torch.ones (L452).
                        optimizer._scales[param][name].fill_(1.0)
                _load_one(optimizer, param, name, value)
    except BaseException:
        if undo is None:
            raise
        try:
            undo.restore(optimizer)
        except BaseException as again:
            raise RuntimeError(
                "loading the optimizer checkpoint failed part-way and restoring the previous "
                "state failed too: the optimizer is inconsistent; rebuild it before training"
            ) from again
        raise


def _load_one(optimizer: Any, param: torch.Tensor, name: str, value: torch.Tensor) -> None:
    local = value._local_tensor if isinstance(value, DTensor) else value
    if _is_remainder(optimizer, param, name):
        optimizer.set_scaled_state(param, name, local)
        return
    unscaled = local.float()
    if unscaled is local and unscaled.device == _param_local(param).device:
        # TE scales FP16/FP8 inputs in place (L307); never in the caller's tensor.
        unscaled = unscaled.clone()
    optimizer.set_scaled_state(param, name, unscaled)


def placed_state_dict(optimizer: Any, owner: type, original: Callable[[Any], Any]) -> Any:
    """Runs ``original`` (TE's own export) or the streaming export, as the policy says."""
    placement = resolve_placement(optimizer)
    if placement is None or not placement.streams:
        return original(optimizer)
    return stream_state_dict(optimizer, placement, owner)


def placed_load_state_dict(
    optimizer: Any, state_dict: Any, owner: type, original: Callable[[Any, Any], Any]
) -> Any:
    """Runs ``original`` (TE's own load) or the streaming load, as the policy says."""
    placement = resolve_placement(optimizer)
    if placement is None or not placement.streams:
        return original(optimizer, state_dict)
    return stream_load_state_dict(optimizer, state_dict, owner, rollback=placement.rollback)


def patch_class(cls: type) -> None:
    """Makes ``cls.state_dict`` and ``cls.load_state_dict`` follow the policy.

    Idempotent and thread-safe.
    """
    with _lock:
        if is_patched(cls):
            return
        missing = _missing(cls, _REQUIRED_CLASS_ATTRS)
        if missing:
            _raise_contract(cls.__qualname__, missing)
        original_save = cls.__dict__.get("state_dict", getattr(cls, "state_dict", None))
        original_load = cls.__dict__.get("load_state_dict", getattr(cls, "load_state_dict", None))

        def state_dict(self: Any) -> Any:
            return placed_state_dict(self, cls, original_save)

        def load_state_dict(self: Any, state_dict: Any) -> Any:
            return placed_load_state_dict(self, state_dict, cls, original_load)

        for hook, original in ((state_dict, original_save), (load_state_dict, original_load)):
            hook.__doc__ = original.__doc__
            hook.__qualname__ = f"{cls.__qualname__}.{hook.__name__}"
            setattr(hook, MARK, original)
        # load_state_dict first: a reader that sees the hooked state_dict sees both hooked.
        cls.load_state_dict = load_state_dict  # type: ignore[attr-defined]
        cls.state_dict = state_dict  # type: ignore[attr-defined]


def unpatch_class(cls: type) -> None:
    """Restores what :func:`patch_class` replaced."""
    with _lock:
        for name in ("state_dict", "load_state_dict"):
            current = cls.__dict__.get(name)
            if current is not None and hasattr(current, MARK):
                setattr(cls, name, getattr(current, MARK))


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
    # Imported outside the lock: the import may run the import watcher, which takes the lock.
    fused_adam = _te_class()
    with _lock:
        patch_class(fused_adam)
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
    if module is not None and fused_adam is None:
        # Another thread is importing TE's optimizer module right now: wait for it (outside the
        # lock, which that import's watcher may need), then hook the finished class.
        with contextlib.suppress(ImportError):
            module = importlib.import_module(TE_OPTIMIZER_MODULE)
        fused_adam = getattr(module, "FusedAdam", None)
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
        elif sys.modules.get(TE_OPTIMIZER_MODULE) is None:
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
                # An incompatible TE must not break `import transformer_engine`: the next policy
                # entry hooks again and raises the ContractError where the user asked for it.
                with contextlib.suppress(ContractError):
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
