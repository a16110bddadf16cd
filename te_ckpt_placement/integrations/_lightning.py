"""The Lightning integration's logic, shared by ``lightning`` and ``pytorch_lightning`` builds.

No framework imports at import time: :mod:`te_ckpt_placement.integrations.lightning` and
:mod:`te_ckpt_placement.integrations.pytorch_lightning` combine these classes with their
package's ``Callback``. Placing a Fabric strategy imports that strategy's own package's
``wrappers`` module (see :func:`place_strategy`).
"""

from __future__ import annotations

import contextlib
import functools
import importlib
import inspect
import os
from typing import Any, ClassVar

from .. import _wrap
from .._policy import Placement, as_placement
from . import _resume
from ._methods import (
    Framework,
    FrameworkMethodError,
    Method,
    PlacementLike,
    check_methods,
    hook_class_method,
    methods_owner,
    place_methods,
    placed_methods,
    placement_of,
    placing,
    unplace_methods,
)

# The framework as error messages name it, with the version this integration was tested with.
LIGHTNING = Framework(
    "Lightning", ("lightning", "pytorch-lightning", "lightning-fabric"), tested="2.6.6"
)

# Strategies whose load_checkpoint restores the optimizer through torch's
# get_optimizer_state_dict/set_optimizer_state_dict, which run a fake step on a fresh optimizer.
_STATE_DICT_API_STRATEGIES = {"FSDPStrategy", "ModelParallelStrategy"}


def _uses_state_dict_api(strategy: Any) -> bool:
    return any(klass.__name__ in _STATE_DICT_API_STRATEGIES for klass in type(strategy).__mro__)


def _stock_torch_io(strategy: Any) -> Any:
    """The strategy's ``TorchCheckpointIO`` (under any wrapping IO, such as
    ``AsyncCheckpointIO``) when its ``load_checkpoint`` is Lightning's own, else None (a
    custom ``CheckpointIO`` decides its own map_location)."""
    io = getattr(strategy, "checkpoint_io", None)
    for _ in range(8):
        if "load_checkpoint" in getattr(io, "__dict__", {}):
            return None  # someone's own instance-level load: left alone
        load = getattr(type(io), "load_checkpoint", None)
        name = getattr(load, "__qualname__", "")
        if name == "TorchCheckpointIO.load_checkpoint":
            return io
        if name == "_WrappingCheckpointIO.load_checkpoint":
            io = getattr(io, "checkpoint_io", None)
            continue
        return None
    return None


def _host_load(
    mmap: bool,
    io: Any,
    stock: Any,
    path: Any,
    map_location: Any = None,
    weights_only: bool | None = None,
) -> Any:
    if map_location is not None:  # a caller's explicit choice
        return stock(path, map_location=map_location, weights_only=weights_only)
    if isinstance(path, (str, os.PathLike)) and os.path.isfile(path):
        return _resume.host_load(path, mmap=mmap, weights_only=weights_only)
    return stock(path, map_location="cpu", weights_only=weights_only)


def _reading_to_host(io: Any, *, mmap: bool) -> contextlib.AbstractContextManager[Any]:
    """While open, ``io.load_checkpoint`` reads into host memory (``map_location="cpu"``).

    Lightning's ``TorchCheckpointIO`` keeps every tensor on the device it was saved from, so a
    checkpoint written from GPU tensors comes back onto the GPU and stays there until the
    Trainer's ``resume_end``. A local file is memory-mapped when ``mmap`` is set.
    """
    return _wrap.wrapping(io, "load_checkpoint", functools.partial(_host_load, mmap))


def _fabric_state(original: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
    try:
        bound = inspect.signature(original).bind(*args, **kwargs)
    except TypeError:
        return None
    return bound.arguments.get("state")


def _load_checkpoint(strategy: Any, original: Any, *args: Any, **kwargs: Any) -> Any:
    """A strategy's ``load_checkpoint`` without GPU temporaries, inside a streaming policy:
    the file is read into host memory, and on FSDP/ModelParallel strategies fresh TE
    optimizers get their states directly (no fake step)."""
    if not _resume.streaming():
        return original(*args, **kwargs)
    optimizers: list[Any] = []
    if _uses_state_dict_api(strategy):
        optimizers = _resume.optimizers_in(getattr(strategy, "optimizers", None) or [])
        optimizers += _resume.optimizers_in(_fabric_state(original, args, kwargs))
    with _resume.initialized(optimizers):  # taken back if nothing is loaded into them
        io = _stock_torch_io(strategy)
        if io is None:
            return original(*args, **kwargs)
        device = getattr(strategy, "root_device", None)
        with _reading_to_host(io, mmap=getattr(device, "type", "cpu") != "cpu"):
            return original(*args, **kwargs)


_OPTIMIZER_STATE = Method(
    "optimizer_state",
    "every Trainer checkpoint's optimizer export, in dump_checkpoint before any hook",
)
_GET_OPTIMIZER_STATE = Method(
    "get_optimizer_state", "fabric.save and the Fabric optimizer's state_dict()"
)
_SAVE_CHECKPOINT = Method(
    "save_checkpoint", "writes the checkpoint; DeepSpeed exports its optimizer here"
)
_LOAD_OPTIMIZER_STATE_DICT = Method(
    "load_optimizer_state_dict", "resume: optimizer.load_state_dict of each optimizer"
)
_LOAD_CHECKPOINT = Method(
    "load_checkpoint",
    "resume, fabric.load: reads the checkpoint (FSDP/ModelParallel load the optimizer here)",
    around=_load_checkpoint,
)
_FABRIC_OPTIMIZER_LOAD = Method(
    "load_state_dict", "the Fabric optimizer's load_state_dict(), which bypasses the strategy"
)

# The methods of a Lightning Trainer strategy (lightning.pytorch.strategies.Strategy):
# - optimizer_state: `_CheckpointConnector.dump_checkpoint` calls it for every optimizer BEFORE
#   any `on_save_checkpoint` hook or CheckpointIO sees the checkpoint.
# - save_checkpoint: DeepSpeed's engine exports its optimizer there; for the other strategies it
#   only writes the already exported dict.
# - load_optimizer_state_dict: resume (`restore_optimizers`), `optimizer.load_state_dict`.
# - load_checkpoint: reads the checkpoint; FSDP, ModelParallel (FSDP2/TP) and DeepSpeed load the
#   optimizer state inside it.
TRAINER_METHODS = (_OPTIMIZER_STATE, _SAVE_CHECKPOINT, _LOAD_OPTIMIZER_STATE_DICT, _LOAD_CHECKPOINT)
# The methods of a Fabric strategy (lightning.fabric.strategies.Strategy): `get_optimizer_state`
# (fabric.save, `_FabricOptimizer.state_dict()`), `save_checkpoint`, `load_checkpoint`
# (fabric.load and load_raw call `optimizer.load_state_dict` inside it).
FABRIC_METHODS = (_GET_OPTIMIZER_STATE, _SAVE_CHECKPOINT, _LOAD_CHECKPOINT)
_ALL_METHODS = (
    _OPTIMIZER_STATE,
    _GET_OPTIMIZER_STATE,
    _SAVE_CHECKPOINT,
    _LOAD_OPTIMIZER_STATE_DICT,
    _LOAD_CHECKPOINT,
)
# Every strategy method placed, Trainer's and Fabric's (the names).
STRATEGY_METHODS = tuple(m.name for m in _ALL_METHODS)


def _kind(cls: type) -> str | None:
    """``"trainer"`` or ``"fabric"`` for a class derived from a Lightning strategy, else None."""
    for klass in cls.__mro__:
        module = klass.__module__
        if module.startswith(("lightning.fabric.strategies", "lightning_fabric.strategies")):
            return "fabric"
        if module.startswith(("lightning.pytorch.strategies", "pytorch_lightning.strategies")):
            return "trainer"
    return None


def _fabric_package(cls: type) -> str:
    for klass in cls.__mro__:
        if klass.__module__.startswith("lightning_fabric."):
            return "lightning_fabric"
    return "lightning.fabric"


def strategy_placement(strategy: Any) -> Placement | None:
    """The policy a strategy's optimizer exports and loads run under: set by
    :func:`place_strategy` or ``PlacementCallback``, or a :class:`PlacementStrategyMixin`
    strategy's ``optimizer_export_placement``; ``None`` for an unplaced strategy."""
    return placement_of(strategy)


def _fabric_optimizer_placement(optimizer: Any) -> Placement | None:
    return placement_of(getattr(optimizer, "_strategy", None))


def _place_fabric_optimizers(strategy_cls: type) -> None:
    """Hooks Fabric's optimizer wrapper: ``optimizer.load_state_dict()`` of a Fabric-set-up
    optimizer runs under its strategy's placement (it calls the raw optimizer directly)."""
    package = _fabric_package(strategy_cls)
    wrappers = importlib.import_module(f"{package}.wrappers")
    cls = getattr(wrappers, "_FabricOptimizer", None)
    what = "the Fabric optimizer's load_state_dict"
    if cls is None:
        raise FrameworkMethodError(
            f"te_ckpt_placement cannot place {what}: {package}.wrappers "
            f"({LIGHTNING.describe()}) has no _FabricOptimizer, which the integration was "
            f"written against ({LIGHTNING.name} {LIGHTNING.tested})."
        )
    check_methods(cls, (_FABRIC_OPTIMIZER_LOAD,), LIGHTNING, what=what)
    hook_class_method(cls, _FABRIC_OPTIMIZER_LOAD, _fabric_optimizer_placement)


def _methods_for(strategy: Any) -> tuple[Method, ...]:
    kind = _kind(type(strategy))
    if kind is None:
        raise TypeError(
            f"place_strategy expects a Lightning Trainer strategy (trainer.strategy) or a Fabric "
            f"strategy (fabric.strategy), got {type(strategy).__qualname__}"
        )
    return TRAINER_METHODS if kind == "trainer" else FABRIC_METHODS


def place_strategy(strategy: Any, placement: PlacementLike = "cpu") -> Any:
    """Runs one strategy's optimizer exports and loads inside ``export_placement``.

    Wraps, on that instance only, the methods a Lightning Trainer strategy
    (``trainer.strategy``: :data:`TRAINER_METHODS`) or a Fabric strategy (``fabric.strategy``:
    :data:`FABRIC_METHODS`) exports and loads optimizer state through. Inside a streaming
    policy, ``load_checkpoint`` reads the file into host memory (Lightning otherwise puts every
    tensor back on the device it was saved from) and, on FSDP/ModelParallel strategies, builds
    fresh TE optimizers' states directly. For a Fabric strategy, the ``load_state_dict()`` of
    optimizers that Fabric set up with it runs under the placement too. Idempotent; calling it
    again changes the placement. The wrappers pickle with the strategy (``ddp_spawn``).
    Returns ``strategy``.

    Raises:
        ValueError: ``placement`` is not a valid device or ``Placement``.
        TypeError: ``strategy`` is not a Lightning Trainer or Fabric strategy.
        FrameworkMethodError: the installed Lightning lacks a method the integration wraps.
        Nothing is changed in any of these cases.
    """
    methods = _methods_for(strategy)
    as_placement(placement)  # validated before anything changes
    if methods is FABRIC_METHODS:
        _place_fabric_optimizers(type(strategy))
    place_methods(
        strategy,
        methods,
        placement,
        framework=LIGHTNING,
        what=f"{type(strategy).__qualname__}",
    )
    return strategy


def unplace_strategy(strategy: Any) -> bool:
    """Restores what :func:`place_strategy` wrapped; returns False if it had wrapped nothing."""
    return unplace_methods(strategy)


class PlacementCallbackLogic:
    """Places ``trainer.strategy`` in ``setup`` and restores it in ``teardown``.

    ``setup`` runs before the Trainer restores a checkpoint (``ckpt_path=``) and ``teardown``
    after the last save of the stage, so resume and every save of ``fit``/``validate``/``test``
    run under the policy, and nothing else does: the policy is entered only inside the wrapped
    strategy methods, never during training steps. Resume reads the checkpoint into host
    memory (see :func:`place_strategy`).

    A strategy that something else already placed (another ``PlacementCallback``,
    ``place_strategy``) is left alone, and ``teardown`` removes only what this callback installed.
    When ``fit`` raises, Lightning calls ``on_exception`` (where ``OnExceptionCheckpoint`` saves)
    but not ``teardown``: the wrappers then stay on that strategy, still scoped to its optimizer
    exports, until the next ``teardown`` of this callback or ``unplace_strategy``.

    Raises:
        ValueError: ``placement`` is not a valid device or ``Placement`` (at construction).
        FrameworkMethodError: in ``setup``, when the installed Lightning's strategy lacks a
            method the integration wraps.
    """

    def __init__(self, placement: PlacementLike = "cpu") -> None:
        super().__init__()
        self.placement = as_placement(placement)

    def setup(self, trainer: Any, pl_module: Any, stage: str) -> None:
        strategy = trainer.strategy
        owner = methods_owner(strategy)
        if owner is self or (owner is None and not placed_methods(strategy)):
            place_methods(
                strategy,
                TRAINER_METHODS,
                self.placement,
                framework=LIGHTNING,
                what=f"{type(strategy).__qualname__}",
                owner=self,
            )

    def teardown(self, trainer: Any, pl_module: Any, stage: str) -> None:
        if methods_owner(trainer.strategy) is self:
            unplace_methods(trainer.strategy)


_CALLBACK_DOC = """\
    Optimizer exports and loads of the Trainer's strategy run inside ``export_placement``.

    A ``{base}`` for a ``{trainer}``. Installed in ``setup``, removed in ``teardown`` (see
    :class:`~te_ckpt_placement.integrations._lightning.PlacementCallbackLogic` for the exact
    rules: idempotent, per strategy, restores exactly the original methods). The wrapped methods
    are :data:`TRAINER_METHODS`; resume reads the checkpoint file into host memory. The callback
    pickles with the Trainer (``ddp_spawn``).

    Args:
        placement: ``"cpu"`` (default) or a ``Placement``.

    Raises:
        ValueError: ``placement`` is not a valid device or ``Placement`` (at construction).
        FrameworkMethodError: in ``setup``, when the installed Lightning's strategy lacks a
            method the integration wraps; nothing is changed.

    Example:
        >>> trainer = Trainer(callbacks=[PlacementCallback()])  # doctest: +SKIP
    """


def callback_class(base: type, module: str) -> type:
    """``PlacementCallback`` on ``base`` (the ``Callback`` of ``lightning`` or
    ``pytorch_lightning``), as the class ``module.PlacementCallback`` (it pickles by that path)."""
    package = base.__module__.split(".")[0]
    doc = _CALLBACK_DOC.format(base=f"{package}.Callback", trainer=f"{package}.Trainer")
    cls = type("PlacementCallback", (PlacementCallbackLogic, base), {"__doc__": doc})
    cls.__module__ = module
    return cls


@placing(_ALL_METHODS)
class PlacementStrategyMixin:
    """For custom strategies: ``class MyStrategy(PlacementStrategyMixin, FSDPStrategy)``.

    Runs the strategy's optimizer exports and loads (:data:`STRATEGY_METHODS`, those its base
    has) inside ``export_placement(optimizer_export_placement)``, for the strategy's whole life
    (also ``trainer.save_checkpoint`` calls after ``fit`` returns), with the resume behaviour of
    :func:`place_strategy`. Works for Lightning Trainer strategies and Fabric strategies; on a
    Fabric strategy the Fabric optimizers' ``load_state_dict()`` is placed too.

    Attributes:
        optimizer_export_placement: ``"cpu"`` by default, or a ``Placement``; ``None`` runs
            Lightning's own saves and loads.

    Raises:
        FrameworkMethodError: when the class is created, if its Lightning strategy base lacks
            a method the integration wraps.
    """

    optimizer_export_placement: PlacementLike = "cpu"
    __placed_methods__: ClassVar[tuple[Method, ...]]

    def __init_subclass__(cls, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        kind = _kind(cls)
        if kind is None:
            return  # still a mixin: no Lightning strategy among its bases yet
        methods = TRAINER_METHODS if kind == "trainer" else FABRIC_METHODS
        base = cls.__mro__[cls.__mro__.index(PlacementStrategyMixin) + 1 :]
        check_methods(
            cls,
            methods,
            LIGHTNING,
            what=f"strategy {cls.__qualname__}",
            has=lambda name: callable(next((vars(k)[name] for k in base if name in vars(k)), None)),
        )
        if kind == "fabric":
            _place_fabric_optimizers(cls)
