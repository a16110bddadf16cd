"""Hooking TE's ``FusedAdam.state_dict``/``load_state_dict`` so that they follow the policy.

The hooks replace the two methods on TE's class (``transformer_engine.pytorch.optimizers
.fused_adam.FusedAdam``, TE 2.20.2 L482 and L515,
https://github.com/NVIDIA/TransformerEngine/blob/v2.20.2/transformer_engine/pytorch/optimizers/fused_adam.py)
with functions that run TE's own method, the streaming export of
:mod:`te_ckpt_placement._te_contract` or the streaming load of :mod:`te_ckpt_placement._te_load`,
as the policy in effect says. Importing this module does not import TE: TE's class is hooked once
TE's optimizer module is loaded, either when a policy is entered (this module registers that with
the policy) or, if TE is imported later, right after that import.
"""

from __future__ import annotations

import contextlib
import functools
import importlib.abc
import importlib.machinery
import importlib.util
import sys
import threading
import warnings
from collections.abc import Callable
from types import ModuleType
from typing import Any

from . import _policy as policy
from . import _workers, _wrap
from ._policy import Placement
from ._te_contract import (
    REQUIRED_CLASS_ATTRS,
    ContractError,
    missing_attrs,
    raise_contract,
    stream_state_dict,
)
from ._te_load import note_loaded, stream_load_state_dict

TE_OPTIMIZER_MODULE = "transformer_engine.pytorch.optimizers.fused_adam"

# The owner of TE's hooks among the wrappers of te_ckpt_placement._wrap; _wrap.original(cls, name)
# is TE's own method under a hook.
OWNER = "te_hooks"
_lock = threading.RLock()
_auto_install = True
_warned_uninstalled = False


def placed_state_dict(
    optimizer: Any,
    owner: type,
    original: Callable[[Any], Any],
    *,
    default: Placement | None = None,
) -> Any:
    """Runs ``original`` (TE's own export) or the streaming export, as the policy says.

    ``default`` is the optimizer's own policy, followed when no policy is active.
    """
    placement = policy.resolve_placement(default)
    if placement is None or not placement.streams:
        return original(optimizer)
    with _workers.sized(placement.host_workers):  # also an optimizer's own policy's setting
        return stream_state_dict(optimizer, placement, owner)


def placed_load_state_dict(
    optimizer: Any,
    state_dict: Any,
    owner: type,
    original: Callable[[Any, Any], Any],
    *,
    default: Placement | None = None,
) -> Any:
    """Runs ``original`` (TE's own load) or the streaming load, as the policy says."""
    placement = policy.resolve_placement(default)
    if placement is None or not placement.streams:
        result = original(optimizer, state_dict)
        note_loaded(optimizer)
        return result
    with _workers.sized(placement.host_workers):
        return stream_load_state_dict(optimizer, state_dict, owner, rollback=placement.rollback)


def _hooked_state_dict(cls: type, optimizer: Any, original: Callable[[], Any]) -> Any:
    return placed_state_dict(optimizer, cls, lambda _: original())


def _hooked_load_state_dict(
    cls: type, optimizer: Any, original: Callable[[Any], Any], state_dict: Any
) -> Any:
    return placed_load_state_dict(optimizer, state_dict, cls, lambda _, sd: original(sd))


def patch_class(cls: type) -> None:
    """Makes ``cls.state_dict`` and ``cls.load_state_dict`` follow the policy.

    Idempotent and thread-safe.
    """
    with _lock:
        if is_patched(cls):
            return
        missing = missing_attrs(cls, REQUIRED_CLASS_ATTRS)
        if missing:
            raise_contract(cls.__qualname__, missing)
        # load_state_dict first: a reader that sees the hooked state_dict sees both hooked.
        for name, hook in (
            ("load_state_dict", _hooked_load_state_dict),
            ("state_dict", _hooked_state_dict),
        ):
            doc = getattr(getattr(cls, name, None), "__doc__", None)
            _wrap.remove_wrapper(cls, name, owner=OWNER, replaced=None)  # replaced since: rehook
            _wrap.add_wrapper(cls, name, functools.partial(hook, cls), owner=OWNER, doc=doc)


def unpatch_class(cls: type) -> None:
    """Restores what :func:`patch_class` replaced."""
    with _lock:
        for name in ("state_dict", "load_state_dict"):
            _wrap.remove_wrapper(cls, name, owner=OWNER, replaced=None)


def is_patched(cls: type) -> bool:
    wrapper = _wrap.current(cls, "state_dict")
    return wrapper is not None and wrapper.owner == OWNER


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


policy.on_enter(ensure_installed)
