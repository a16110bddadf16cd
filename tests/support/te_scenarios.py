"""The hook scenarios of tests/test_te_hooks.py, each run in a fresh Python process.

Hooking TE's class, the import watcher and ``install()``/``uninstall()`` change global import
state that the pytest process must not keep, so each process runs::

    python -c "from tests.support.te_scenarios import run; run('hooks')"

with a fake ``transformer_engine`` (:mod:`tests.support.fake_te`) on ``PYTHONPATH`` as
:data:`PROCESSES` says. Every process imports torch once (seconds), so related scenarios share
one: :func:`run` runs a process's scenarios in order and prints ``PASSED`` + the scenario's name
after each one that passed; a scenario after a failed one does not run.
"""

from __future__ import annotations

import faulthandler
import importlib
import importlib.abc
import importlib.machinery
import importlib.metadata
import importlib.util
import inspect
import linecache
import sys
import threading
import time
import traceback
import warnings
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch

import te_ckpt_placement
from te_ckpt_placement import (
    Placement,
    _wrap,
    current_placement,
    export_placement,
    install,
    is_installed,
    uninstall,
)
from te_ckpt_placement import _te_contract as te_contract
from te_ckpt_placement import _te_hooks as te_hooks

from .fake_te import VERSION as FAKE_VERSION
from .helpers import (
    aliases_live,
    assert_same_export,
    assert_snapshot_equal,
    exported_tensors,
    live_storages,
    snapshot,
)
from .standin import train

# How long a slow import of the fake TE lasts, and how long a scenario waits for its threads
# before calling them deadlocked.
SLOW_IMPORT_S = 1.0
DEADLOCK_S = 15
TE_MODULE = "transformer_engine.pytorch.optimizers.fused_adam"
PASSED = "scenario passed: "


@dataclass(frozen=True)
class Process:
    """What a scenario process gets: a fake TE (None: no transformer_engine at all)."""

    fake: str | None
    import_delay_s: float = 0.0


PROCESSES: dict[str, Process] = {
    "no_te": Process(None),
    "hooks": Process("fake_te"),
    "watcher": Process("fake_te"),
    "install_race": Process("fake_te", import_delay_s=SLOW_IMPORT_S),
    "policy_race": Process("fake_te", import_delay_s=SLOW_IMPORT_S),
    "contract": Process("fake_te_without_contract"),
    "package": Process("fake_te"),
}
SCENARIOS: dict[str, list[Callable[[], None]]] = {name: [] for name in PROCESSES}


def scenario(process: str) -> Callable[[Callable[[], None]], Callable[[], None]]:
    """Adds the decorated function to ``process``'s scenarios, after those defined before it."""

    def register(fn: Callable[[], None]) -> Callable[[], None]:
        SCENARIOS[process].append(fn)
        return fn

    return register


def run(process: str) -> None:
    """Runs ``process``'s scenarios in order; prints a marker after each one that passed."""
    if process not in SCENARIOS:
        raise ValueError(f"unknown process {process!r}: valid values are {sorted(SCENARIOS)}")
    for fn in SCENARIOS[process]:
        fn()
        print(PASSED + fn.__name__, flush=True)


# --- what the scenarios share -------------------------------------------------------------------
def te_loaded() -> bool:
    return any(n.split(".")[0] == "transformer_engine" for n in sys.modules)


def te_distribution_installed() -> bool:
    """True where a real TE's metadata exists: te_version() then reports it, not the fake's."""
    for dist in ("transformer_engine", "transformer-engine"):
        try:
            importlib.metadata.version(dist)
        except importlib.metadata.PackageNotFoundError:
            continue
        return True
    return False


def params(seed: int = 0) -> list[torch.nn.Parameter]:
    gen = torch.Generator().manual_seed(seed)
    shapes = [(7, 5), (13,), (3, 4, 2)]
    return [torch.nn.Parameter(torch.randn(s, generator=gen)) for s in shapes]


def streamed(sd: dict[str, Any], live: set[int]) -> bool:
    """Every state is exported, as a CPU tensor that shares no storage with the live state."""
    tensors = exported_tensors(sd)
    return len(tensors) > 0 and all(
        t.device.type == "cpu" and not aliases_live(t, live) for t in tensors
    )


def te_export(sd: dict[str, Any], live: set[int]) -> bool:
    """TE's own export: its FP32 states (every master_param here) are the live tensors."""
    masters = [states["master_param"] for states in sd["state"].values()]
    return len(masters) > 0 and all(aliases_live(t, live) for t in masters)


def hooked_once(cls: type, originals: dict[str, Any]) -> bool:
    """Both methods are hooks, each wrapping TE's own function: one layer, not more."""
    return all(_wrap.original(cls, n) is f for n, f in originals.items())


def is_hook(f: Any) -> bool:
    """``f`` is a function that te_ckpt_placement._wrap installed (it calls a Wrapper)."""
    return any(isinstance(c.cell_contents, _wrap.Wrapper) for c in f.__closure__ or ())


def unhooked(cls: type, originals: dict[str, Any]) -> bool:
    """Both methods are exactly TE's own functions."""
    return all(cls.__dict__.get(n) is f for n, f in originals.items())


def raises(exc_type: type[BaseException], action: Callable[[], object]) -> str:
    """The message of the exc_type that action() raises; fails if it raises nothing."""
    try:
        action()
    except exc_type as exc:
        return str(exc)
    raise AssertionError(f"{action} did not raise {exc_type.__name__}")


def watchers() -> list[object]:
    return [f for f in sys.meta_path if isinstance(f, te_hooks._ImportWatcher)]


def in_thread(name: str, action: Callable[[], object]) -> tuple[threading.Thread, list[str]]:
    """Runs action() in a daemon thread (a deadlocked one cannot keep the process alive).

    Returns the thread and the list its traceback goes to if action() raises.
    """
    errors: list[str] = []

    def target() -> None:
        try:
            action()
        except BaseException:
            errors.append(f"{name}: {traceback.format_exc()}")

    thread = threading.Thread(target=target, name=name, daemon=True)
    thread.start()
    return thread, errors


def join_or_fail(threads: Sequence[threading.Thread], errors: list[str]) -> None:
    """Fails, showing every thread's stack, unless all finish within DEADLOCK_S without error."""
    deadline = time.monotonic() + DEADLOCK_S
    for thread in threads:
        thread.join(timeout=max(0.0, deadline - time.monotonic()))
    stuck = [thread.name for thread in threads if thread.is_alive()]
    if stuck:
        faulthandler.dump_traceback(all_threads=True)
        raise AssertionError(f"deadlock: {stuck} still running after {DEADLOCK_S} s")
    assert not errors, "\n".join(errors)


def import_te_slowly() -> tuple[threading.Thread, list[str]]:
    """Starts importing the slow fake TE in a thread; returns once it is half-imported.

    That is: TE's optimizer module is in sys.modules, holding its import lock, and its FusedAdam is
    not defined yet, for most of SLOW_IMPORT_S more.
    """
    thread, errors = in_thread("importer", lambda: importlib.import_module(TE_MODULE))
    deadline = time.monotonic() + DEADLOCK_S
    while TE_MODULE not in sys.modules:
        assert thread.is_alive() and time.monotonic() < deadline, errors or "import not started"
        time.sleep(0.001)
    time.sleep(0.3)
    module = sys.modules[TE_MODULE]
    assert not hasattr(module, "FusedAdam"), "the slow import finished before the race began"
    return thread, errors


# --- no transformer_engine ----------------------------------------------------------------------
@scenario("no_te")
def install_without_te_raises_import_error() -> None:
    class BlockTE(importlib.abc.MetaPathFinder):
        def find_spec(
            self, name: str, path: Sequence[str] | None, target: Any = None
        ) -> importlib.machinery.ModuleSpec | None:
            if name == "transformer_engine" or name.startswith("transformer_engine."):
                raise ModuleNotFoundError(f"No module named {name!r}", name=name)
            return None

    if importlib.util.find_spec("transformer_engine") is not None:
        sys.meta_path.insert(0, BlockTE())  # a real TE on this machine: make it unimportable

    assert not is_installed()
    message = raises(ImportError, install)
    assert "pip install 'transformer-engine[pytorch]'" in message, message
    assert TE_MODULE in message, message
    assert not is_installed()
    assert not te_loaded()

    # Without TE a policy can still be entered: it only arms the import watcher...
    with export_placement("cpu"):
        assert current_placement() == Placement(device="cpu")
        assert any(isinstance(f, te_hooks._ImportWatcher) for f in sys.meta_path)
    assert not is_installed()
    # ...which uninstall() disarms.
    uninstall()
    assert not any(isinstance(f, te_hooks._ImportWatcher) for f in sys.meta_path)


# --- hooks: TE imported before any policy -------------------------------------------------------
@scenario("hooks")
def policy_entry_hooks_imported_te() -> None:
    assert not te_loaded(), "import te_ckpt_placement imported transformer_engine"
    import transformer_engine.pytorch
    from transformer_engine.pytorch.optimizers.fused_adam import ORIGINALS, FusedAdam

    assert transformer_engine.__version__ == FAKE_VERSION  # the fake, not a real TE
    assert unhooked(FusedAdam, ORIGINALS)
    assert not is_installed(), "importing TE hooked it before any policy was entered"

    opt = FusedAdam(
        params(),
        lr=1e-2,
        master_weights=True,
        exp_avg_dtype=torch.float32,
        exp_avg_sq_dtype=torch.float32,
    )
    train(opt)
    live = live_storages(opt)
    before = snapshot(opt)
    plain = opt.state_dict()
    assert all(aliases_live(t, live) for t in exported_tensors(plain))  # TE aliases FP32
    with export_placement(None):
        reference = opt.state_dict()
    assert not is_installed(), "export_placement(None) hooked TE"

    with export_placement("cpu"):
        assert is_installed()
        ours = opt.state_dict()
    assert hooked_once(FusedAdam, ORIGINALS)
    assert len(exported_tensors(ours)) == 9
    assert streamed(ours, live)
    assert_same_export(ours, reference)
    assert_snapshot_equal(before, snapshot(opt))

    # Hooked, outside any policy: TE's original export, aliasing the live FP32 state.
    outside = opt.state_dict()
    assert is_installed()
    pairs = zip(exported_tensors(outside), exported_tensors(plain), strict=True)
    assert all(a.data_ptr() == b.data_ptr() for a, b in pairs)

    # The hooked load streams too: it writes into the live tensors, where TE's load replaces them.
    states = {p: dict(s) for p, s in opt.state.items()}
    with export_placement("cpu"):
        opt.load_state_dict(ours)
    assert all(opt.state[p][n] is t for p, s in states.items() for n, t in s.items())
    assert_snapshot_equal(before, snapshot(opt))
    with export_placement(None):
        opt.load_state_dict(ours)
    assert all(opt.state[p][n] is not t for p, s in states.items() for n, t in s.items())
    assert_snapshot_equal(before, snapshot(opt))


@scenario("hooks")
def subclasses_follow_policy() -> None:
    from transformer_engine.pytorch.optimizers.fused_adam import FusedAdam

    class Inheriting(FusedAdam):
        pass

    class Overriding(FusedAdam):
        def state_dict(self) -> dict[str, Any]:
            sd: dict[str, Any] = super().state_dict()
            sd["subclass"] = "extra"
            return sd

    overriding_method = Overriding.__dict__["state_dict"]
    for cls in (Inheriting, Overriding):
        opt = cls(
            params(),
            master_weights=True,
            exp_avg_dtype=torch.bfloat16,
            exp_avg_sq_dtype=torch.bfloat16,
        )
        train(opt)
        live = live_storages(opt)
        before = snapshot(opt)
        with export_placement(None):
            reference = opt.state_dict()
        assert te_export(reference, live), cls.__name__
        assert te_export(opt.state_dict(), live), cls.__name__
        with export_placement("cpu"):
            ours = opt.state_dict()
        assert streamed(ours, live), f"{cls.__name__} did not stream"
        assert_same_export(ours, reference, cls.__name__)
        assert_snapshot_equal(before, snapshot(opt))
    assert ours["subclass"] == "extra"
    # Only TE's class is hooked; subclasses are left as they were defined.
    assert "state_dict" not in Inheriting.__dict__
    assert Overriding.__dict__["state_dict"] is overriding_method


@scenario("hooks")
def instance_contract_error_leaves_state_unchanged() -> None:
    from transformer_engine.pytorch.optimizers.fused_adam import FusedAdam

    opt = FusedAdam(
        params(), master_weights=True, exp_avg_dtype=torch.float16, exp_avg_sq_dtype=torch.float16
    )
    train(opt)
    before = snapshot(opt)
    version = te_contract.te_version()
    if not te_distribution_installed():
        assert version == FAKE_VERSION, version
    del opt.name_to_dtype_map

    def export() -> None:
        with export_placement("cpu"):
            opt.state_dict()

    message = raises(te_contract.ContractError, export)
    assert f"FusedAdam lacks name_to_dtype_map (transformer_engine {version};" in message, message
    assert "export_placement(None)" in message
    assert_snapshot_equal(before, snapshot(opt))
    del opt.store_param_remainders
    message = raises(te_contract.ContractError, export)
    assert "lacks name_to_dtype_map, store_param_remainders (" in message, message
    assert_snapshot_equal(before, snapshot(opt))


@scenario("hooks")
def install_idempotent_uninstall_restores_and_warns() -> None:
    from transformer_engine.pytorch.optimizers.fused_adam import ORIGINALS, FusedAdam

    assert not any(is_hook(f) for f in ORIGINALS.values())
    assert is_installed()  # hooked by the policies of the earlier scenarios
    install()
    assert hooked_once(FusedAdam, ORIGINALS)
    uninstall()
    assert unhooked(FusedAdam, ORIGINALS)
    install()
    hooks = {name: FusedAdam.__dict__[name] for name in ORIGINALS}
    install()
    with export_placement("cpu"):
        pass
    assert {name: FusedAdam.__dict__[name] for name in ORIGINALS} == hooks, "hooked again"
    assert hooked_once(FusedAdam, ORIGINALS)
    assert is_installed()

    opt = FusedAdam(
        params(), master_weights=True, exp_avg_dtype=torch.bfloat16, exp_avg_sq_dtype=torch.bfloat16
    )
    train(opt)
    live = live_storages(opt)
    with export_placement("cpu"):
        assert streamed(opt.state_dict(), live)

    uninstall()
    assert unhooked(FusedAdam, ORIGINALS)
    assert not is_installed()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for _ in range(3):
            with export_placement("cpu"):
                assert current_placement() == Placement(device="cpu")
                assert te_export(opt.state_dict(), live)
            with export_placement(None):
                pass
    assert unhooked(FusedAdam, ORIGINALS), "a policy re-hooked after uninstall()"
    assert not is_installed()
    found = [w for w in caught if issubclass(w.category, RuntimeWarning)]
    assert len(found) == 1, [str(w.message) for w in caught]
    assert "install()" in str(found[0].message)
    # The warning points at the `with` line, here.
    assert found[0].filename == __file__, found[0].filename
    line = linecache.getline(found[0].filename, found[0].lineno)
    assert 'with export_placement("cpu"):' in line, (found[0].lineno, line)

    install()
    assert is_installed()
    assert hooked_once(FusedAdam, ORIGINALS)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        with export_placement("cpu"):
            assert streamed(opt.state_dict(), live)

    # install() re-arms the warning for a later uninstall().
    uninstall()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for _ in range(2):
            with export_placement("cpu"):
                pass
    assert len([w for w in caught if issubclass(w.category, RuntimeWarning)]) == 1


# --- the import watcher: TE imported inside a policy --------------------------------------------
@scenario("watcher")
def import_watcher_hooks_te_imported_inside_policy() -> None:
    assert not te_loaded()
    with export_placement("cpu"):
        assert not is_installed()
        assert not te_loaded(), "entering a policy imported transformer_engine"
        from transformer_engine.pytorch.optimizers import FusedAdam

        assert is_installed(), "TE imported inside a policy was not hooked"
        assert not any(isinstance(f, te_hooks._ImportWatcher) for f in sys.meta_path)
        opt = FusedAdam(
            params(),
            master_weights=True,
            exp_avg_dtype=torch.bfloat16,
            exp_avg_sq_dtype=torch.bfloat16,
        )
        train(opt)
        live = live_storages(opt)
        ours = opt.state_dict()
        with export_placement(None):
            reference = opt.state_dict()
    assert te_export(reference, live)
    assert streamed(ours, live)
    assert_same_export(ours, reference)


@scenario("watcher")
def threads_race_hooking_and_exports() -> None:
    from transformer_engine.pytorch.optimizers.fused_adam import ORIGINALS, FusedAdam

    sys.setswitchinterval(1e-6)
    rounds, exports = 30, 2
    moments_by_pair = [torch.float32, torch.bfloat16, torch.float16, torch.uint8]

    # Even-numbered exporters stream under "cpu" (every storage mode); odd ones run TE's export
    # under None, with FP32 states only, so that every exported tensor aliases the live state.
    exporters: list[tuple[Any, str | None, dict[str, Any], set[int]]] = []
    for k in range(8):
        device = "cpu" if k % 2 == 0 else None
        moments = moments_by_pair[k // 2] if device else torch.float32
        opt = FusedAdam(
            params(seed=k),
            lr=1e-2,
            master_weights=True,
            exp_avg_dtype=moments,
            exp_avg_sq_dtype=moments,
        )
        train(opt, seed=k)
        with export_placement(None):
            reference = opt.state_dict()
        exporters.append((opt, device, reference, live_storages(opt)))

    barrier = threading.Barrier(17, timeout=120)
    errors: list[str] = []

    def install_or_enter(k: int, j: int) -> None:
        if (k + j) % 2:
            install()
        else:
            with export_placement("cpu"):
                pass

    def export(k: int, j: int) -> None:
        opt, device, reference, live = exporters[k]
        with export_placement(device):
            sd = opt.state_dict()
        assert_same_export(sd, reference, f"exporter {k}")
        if device == "cpu":
            assert streamed(sd, live), f"exporter {k} ({device}): not streamed"
        else:
            assert all(aliases_live(t, live) for t in exported_tensors(sd)), f"exporter {k}"

    def worker(action: Callable[[int, int], None], k: int) -> None:
        try:
            for _ in range(rounds):
                barrier.wait()
                for j in range(exports):
                    action(k, j)
                barrier.wait()
        except BaseException:
            errors.append(traceback.format_exc())
            barrier.abort()

    threads = [threading.Thread(target=worker, args=(install_or_enter, k)) for k in range(8)]
    threads += [threading.Thread(target=worker, args=(export, k)) for k in range(8)]
    for t in threads:
        t.start()
    try:
        for r in range(rounds):
            te_hooks.unpatch_class(FusedAdam)  # unhooked again: the next round races to hook
            assert unhooked(FusedAdam, ORIGINALS) and not is_installed()
            barrier.wait()
            barrier.wait()
            if not hooked_once(FusedAdam, ORIGINALS):
                errors.insert(0, f"round {r}: not hooked exactly once")
                barrier.abort()  # releases the workers at once
                break
    except threading.BrokenBarrierError:
        pass  # a worker failed and said why
    except BaseException:
        barrier.abort()
        raise
    for t in threads:
        t.join()
    assert not errors, errors[0]


# --- races with a slow import of TE -------------------------------------------------------------
@scenario("install_race")
def install_during_watched_import_does_not_deadlock() -> None:
    # Regression: install() imported TE while holding te_hooks._lock, and the import watcher's
    # hook, which runs inside TE's module import lock, takes _lock: each thread waited for the
    # other, for ever.
    assert not te_loaded()
    with export_placement("cpu"):
        pass
    assert watchers(), "a policy entered before TE's import did not arm the watcher"

    importer, import_errors = import_te_slowly()  # thread A: the watched import
    installer, install_errors = in_thread("install", install)  # thread B
    join_or_fail([importer, installer], import_errors + install_errors)

    from transformer_engine.pytorch.optimizers.fused_adam import ORIGINALS, FusedAdam

    assert is_installed()
    assert hooked_once(FusedAdam, ORIGINALS)
    assert not watchers()
    opt = FusedAdam(params(), master_weights=True)
    train(opt)
    live = live_storages(opt)
    with export_placement("cpu"):
        assert streamed(opt.state_dict(), live)


@scenario("policy_race")
def policy_entered_during_import_waits_and_hooks() -> None:
    # Regression: a policy entered while another thread was importing TE's optimizer module (in
    # sys.modules, FusedAdam not defined yet) neither hooked the class nor armed the watcher, so
    # the export inside that very policy silently ran TE's own, aliasing the live FP32 state.
    assert not te_loaded()
    assert not watchers()
    importer, errors = import_te_slowly()  # no policy yet: nothing hooks this import itself
    # The main thread waits for that import below; a deadlock there ends the process, with stacks.
    faulthandler.dump_traceback_later(DEADLOCK_S, exit=True)
    with export_placement("cpu"):
        assert is_installed(), "a policy entered during TE's import left FusedAdam unhooked"
        from transformer_engine.pytorch.optimizers.fused_adam import ORIGINALS, FusedAdam

        opt = FusedAdam(params(), master_weights=True)  # FP32 states: TE's export aliases them
        train(opt)
        live = live_storages(opt)
        ours = opt.state_dict()
    faulthandler.cancel_dump_traceback_later()
    join_or_fail([importer], errors)

    assert streamed(ours, live), "the export inside the policy ran TE's own, aliasing live state"
    assert hooked_once(FusedAdam, ORIGINALS)
    assert not watchers()
    with export_placement(None):
        reference = opt.state_dict()
    assert te_export(reference, live)
    assert_same_export(ours, reference)


# --- a TE whose FusedAdam breaks the storage contract -------------------------------------------
@scenario("contract")
def incompatible_te_imported_after_policy_imports_then_policy_raises() -> None:
    # Regression: with the import watcher armed, importing a TE whose FusedAdam breaks the
    # contract raised the ContractError out of TE's own import, outside any policy.
    assert not te_loaded()
    with export_placement("cpu"):
        pass
    assert watchers(), "a policy entered before TE's import did not arm the watcher"

    import transformer_engine.pytorch.optimizers.fused_adam  # noqa: F401  (must not raise)
    from transformer_engine.pytorch.optimizers.fused_adam import ORIGINALS, FusedAdam

    assert unhooked(FusedAdam, ORIGINALS)
    assert not is_installed()
    assert not watchers()
    opt = FusedAdam(params())
    assert list(opt.state_dict()) == ["state", "param_groups"]  # outside a policy: TE's own

    def enter_policy() -> None:
        with export_placement("cpu"):
            raise AssertionError("entered a policy over a FusedAdam that breaks the contract")

    # The next policy entry raises, where the user asked for the streaming export.
    message = raises(te_contract.ContractError, enter_policy)
    assert "FusedAdam lacks get_unscaled_state (" in message, message
    assert current_placement() is None
    assert unhooked(FusedAdam, ORIGINALS)


@scenario("contract")
def class_contract_error_names_attribute_and_version() -> None:
    from transformer_engine.pytorch.optimizers.fused_adam import ORIGINALS, FusedAdam

    version = te_contract.te_version()
    if not te_distribution_installed():
        assert version == FAKE_VERSION, version

    def enter_policy() -> None:
        with export_placement("cpu"):
            raise AssertionError("entered a policy over a FusedAdam that breaks the contract")

    for action in (install, enter_policy):
        message = raises(te_contract.ContractError, action)
        assert f"FusedAdam lacks get_unscaled_state (transformer_engine {version};" in message, (
            message
        )
        assert unhooked(FusedAdam, ORIGINALS)
        assert not is_installed()
        assert current_placement() is None


# --- te_ckpt_placement.FusedAdam over the fake --------------------------------------------------
@scenario("package")
def package_fused_adam_against_fake_te() -> None:
    assert not te_loaded(), "import te_ckpt_placement imported transformer_engine"
    assert "te_ckpt_placement._fused_adam" not in sys.modules
    PackageFusedAdam = te_ckpt_placement.FusedAdam  # noqa: N806  (a class)
    assert te_loaded()
    from transformer_engine.pytorch.optimizers.fused_adam import FusedAdam as TEFusedAdam

    from te_ckpt_placement import FusedAdam as ImportedFusedAdam

    assert ImportedFusedAdam is PackageFusedAdam
    assert PackageFusedAdam.__mro__[1] is TEFusedAdam
    assert not is_installed(), "importing te_ckpt_placement.FusedAdam hooked TE"

    signature = inspect.signature(PackageFusedAdam.__init__)
    kinds = [p.kind for p in signature.parameters.values()]
    assert inspect.Parameter.VAR_KEYWORD not in kinds, signature
    assert inspect.Parameter.VAR_POSITIONAL not in kinds, signature
    te_names = list(inspect.signature(TEFusedAdam.__init__).parameters)
    assert list(signature.parameters) == [*te_names, "state_dict_placement"], signature

    # Every TE argument reaches TE's constructor unchanged.
    te_args: dict[str, Any] = dict(
        lr=0.25, betas=(0.8, 0.95), eps=1e-6, weight_decay=0.01, amsgrad=False,
        bias_correction=False, adam_w_mode=False, capturable=True, master_weights=True,
        master_weight_dtype=torch.float16, exp_avg_dtype=torch.bfloat16,
        exp_avg_sq_dtype=torch.float16, use_decoupled_grad=True, store_param_remainders=True,
        set_grad_none=True,
    )  # fmt: skip
    opt = PackageFusedAdam(params(), **te_args, state_dict_placement=torch.device("cpu"))
    assert opt.te_init_args == te_args, opt.te_init_args
    assert opt.state_dict_placement == Placement(device="cpu")

    opt = PackageFusedAdam(
        params(),
        exp_avg_dtype=torch.bfloat16,
        exp_avg_sq_dtype=torch.bfloat16,
        master_weights=True,
        state_dict_placement="cpu",
    )
    assert opt.state_dict_placement == Placement(device="cpu")
    train(opt)
    live = live_storages(opt)
    before = snapshot(opt)
    with export_placement(None):
        reference = opt.state_dict()
    assert te_export(reference, live), "export_placement(None) did not win over the default"
    ours = opt.state_dict()
    assert streamed(ours, live), "state_dict_placement='cpu' did not stream"
    assert_same_export(ours, reference)
    with export_placement("cpu", conversion="device"):
        assert streamed(opt.state_dict(), live)
    assert_snapshot_equal(before, snapshot(opt))

    default = PackageFusedAdam(params(), master_weights=True)
    assert default.state_dict_placement is None
    train(default)
    default_live = live_storages(default)
    assert te_export(default.state_dict(), default_live)
    with export_placement("cpu"):
        assert streamed(default.state_dict(), default_live)

    # load_state_dict follows the same policy: the default streams, writing into the live
    # tensors; under export_placement(None) TE's own load replaces them.
    states = {p: dict(s) for p, s in opt.state.items()}
    opt.load_state_dict(ours)
    assert all(opt.state[p][n] is t for p, s in states.items() for n, t in s.items())
    assert_snapshot_equal(before, snapshot(opt))
    with export_placement(None):
        opt.load_state_dict(ours)
    assert all(opt.state[p][n] is not t for p, s in states.items() for n, t in s.items())
    assert_snapshot_equal(before, snapshot(opt))
    live = live_storages(opt)

    # Also with TE's own class hooked.
    install()
    assert streamed(opt.state_dict(), live)
    with export_placement(None):
        assert te_export(opt.state_dict(), live)
    assert te_export(default.state_dict(), default_live)

    message = raises(ValueError, lambda: PackageFusedAdam(params(), state_dict_placement="cuda:7"))
    assert "'cuda:7'" in message and "'cpu'" in message and "None" in message, message
