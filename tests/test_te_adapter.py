"""The TE adapter's hooking machinery against a fake ``transformer_engine`` package on disk.

The scenarios run in fresh Python processes, because hooking TE's class, the import watcher and
``install()``/``uninstall()`` change global import state that the pytest process must not keep.
The fake package has TE 2.20.2's module path and ``FusedAdam`` constructor signature over the CPU
stand-in's storage (``tests/support/standin.py``). The processes are started together when the first
test needs one, so that their torch imports overlap.
"""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO

import pytest

REPO_ROOT = Path(__file__).resolve().parents[1]
FAKE_VERSION = "2.20.2+fake.te.adapter.test"
TIMEOUT_S = 300
# How long a slow import of the fake TE lasts, and how long a scenario waits for its threads
# before calling them deadlocked.
SLOW_IMPORT_S = 1.0
DEADLOCK_S = 15

# --- the fake transformer_engine package ----------------------------------------------------

FAKE_TE_INIT = f'''\
"""A fake Transformer Engine: just enough package for te_ckpt_placement's adapter tests."""

__version__ = {FAKE_VERSION!r}
'''

# As in TE, importing transformer_engine.pytorch imports the optimizers and so fused_adam.
FAKE_PYTORCH_INIT = "from . import optimizers  # noqa: F401\n"
FAKE_OPTIMIZERS_INIT = "from .fused_adam import FusedAdam  # noqa: F401\n"

FAKE_FUSED_ADAM = '''\
"""transformer_engine/pytorch/optimizers/fused_adam.py of TE 2.20.2, on the CPU stand-in."""

import torch

from tests.support.standin import StandInFusedAdam


class _StandInStorage(StandInFusedAdam):
    # TE's FusedAdam derives from torch.optim.Optimizer directly: super(FusedAdam, opt)
    # .state_dict() and .load_state_dict(), which the adapter calls, are torch's, not TE's.
    state_dict = torch.optim.Optimizer.state_dict
    load_state_dict = torch.optim.Optimizer.load_state_dict


class FusedAdam(_StandInStorage):
    """TE 2.20.2's constructor signature; TE's export and import defined on the class."""

    def __init__(
        self,
        params,
        lr=1e-3,
        betas=(0.9, 0.999),
        eps=1e-8,
        weight_decay=0.0,
        amsgrad=False,
        *,
        bias_correction=True,
        adam_w_mode=True,
        capturable=False,
        master_weights=False,
        master_weight_dtype=torch.float32,
        exp_avg_dtype=torch.float32,
        exp_avg_sq_dtype=torch.float32,
        use_decoupled_grad=False,
        store_param_remainders=False,
        set_grad_none=None,
    ):
        if amsgrad:
            raise RuntimeError("FusedAdam does not support the AMSGrad variant.")
        super().__init__(
            params,
            lr=lr,
            betas=betas,
            eps=eps,
            weight_decay=weight_decay,
            master_weights=master_weights,
            master_weight_dtype=master_weight_dtype,
            exp_avg_dtype=exp_avg_dtype,
            exp_avg_sq_dtype=exp_avg_sq_dtype,
            store_param_remainders=store_param_remainders,
        )
        # What the constructor received, so tests can check that subclasses pass it through.
        self.te_init_args = dict(
            lr=lr,
            betas=betas,
            eps=eps,
            weight_decay=weight_decay,
            amsgrad=amsgrad,
            bias_correction=bias_correction,
            adam_w_mode=adam_w_mode,
            capturable=capturable,
            master_weights=master_weights,
            master_weight_dtype=master_weight_dtype,
            exp_avg_dtype=exp_avg_dtype,
            exp_avg_sq_dtype=exp_avg_sq_dtype,
            use_decoupled_grad=use_decoupled_grad,
            store_param_remainders=store_param_remainders,
            set_grad_none=set_grad_none,
        )

    # TE L482-548 (the stand-in's copies; their zero-argument super() reaches torch's).
    state_dict = StandInFusedAdam.state_dict
    load_state_dict = StandInFusedAdam.load_state_dict


# For the tests: TE's own functions, which the hooks wrap and uninstall() restores.
ORIGINALS = {name: FusedAdam.__dict__[name] for name in ("state_dict", "load_state_dict")}
'''

# A FusedAdam of a hypothetical TE release that dropped get_unscaled_state.
FAKE_FUSED_ADAM_WITHOUT_CONTRACT = '''\
"""fused_adam.py of a TE release whose FusedAdam has no get_unscaled_state."""

import torch


class FusedAdam(torch.optim.Optimizer):
    def __init__(self, params, lr=1e-3):
        super().__init__(params, {"lr": lr})

    def state_dict(self):
        return super().state_dict()

    def load_state_dict(self, state_dict):
        super().load_state_dict(state_dict)

    def set_scaled_state(self, param, state_name, unscaled_state):
        self.state[param][state_name] = unscaled_state


ORIGINALS = {name: FusedAdam.__dict__[name] for name in ("state_dict", "load_state_dict")}
'''

# The same FusedAdam, in a module that is slow to import (TE's takes seconds): meanwhile another
# thread finds the module in sys.modules, without FusedAdam yet.
FAKE_FUSED_ADAM_SLOW = f"import time\n\ntime.sleep({SLOW_IMPORT_S})\n\n" + FAKE_FUSED_ADAM

FAKES = {
    "fake_te": FAKE_FUSED_ADAM,
    "fake_te_without_contract": FAKE_FUSED_ADAM_WITHOUT_CONTRACT,
    "fake_te_slow": FAKE_FUSED_ADAM_SLOW,
}


def write_fake_te(root: Path, fused_adam_source: str) -> Path:
    package = root / "transformer_engine"
    optimizers = package / "pytorch" / "optimizers"
    optimizers.mkdir(parents=True)
    (package / "__init__.py").write_text(FAKE_TE_INIT)
    (package / "pytorch" / "__init__.py").write_text(FAKE_PYTORCH_INIT)
    (optimizers / "__init__.py").write_text(FAKE_OPTIMIZERS_INIT)
    (optimizers / "fused_adam.py").write_text(fused_adam_source)
    return root


# --- what every scenario process runs first -------------------------------------------------

PRELUDE = f"""
import faulthandler
import importlib
import importlib.abc
import importlib.metadata
import importlib.util
import inspect
import sys
import threading
import time
import traceback
import warnings

import torch

import te_ckpt_placement
from te_ckpt_placement import (
    Placement,
    current_placement,
    export_placement,
    install,
    is_installed,
    te_contract,
    te_hooks,
    uninstall,
)
from tests.support.helpers import (
    aliases_live,
    assert_same_export,
    assert_snapshot_equal,
    exported_tensors,
    live_storages,
    snapshot,
)
from tests.support.standin import train

FAKE_VERSION = {FAKE_VERSION!r}
DEADLOCK_S = {DEADLOCK_S!r}
TE_MODULE = "transformer_engine.pytorch.optimizers.fused_adam"
MARK = te_hooks.MARK
"""

PRELUDE += '''

def te_loaded():
    return any(n.split(".")[0] == "transformer_engine" for n in sys.modules)


def te_distribution_installed():
    """True where a real TE's metadata exists: te_version() then reports it, not the fake's."""
    for dist in ("transformer_engine", "transformer-engine"):
        try:
            importlib.metadata.version(dist)
        except importlib.metadata.PackageNotFoundError:
            continue
        return True
    return False


def params(seed=0):
    gen = torch.Generator().manual_seed(seed)
    shapes = [(7, 5), (13,), (3, 4, 2)]
    return [torch.nn.Parameter(torch.randn(s, generator=gen)) for s in shapes]


def streamed(sd, live):
    """Every state is exported, as a CPU tensor that shares no storage with the live state."""
    tensors = exported_tensors(sd)
    return (
        len(tensors) > 0
        and all(t.device.type == "cpu" and not aliases_live(t, live) for t in tensors)
    )


def te_export(sd, live):
    """TE's own export: its FP32 states (every master_param here) are the live tensors."""
    masters = [states["master_param"] for states in sd["state"].values()]
    return len(masters) > 0 and all(aliases_live(t, live) for t in masters)


def hooked_once(cls, originals):
    """Both methods are hooks, each wrapping TE's own function: one layer, not more."""
    return all(getattr(cls.__dict__.get(n), MARK, None) is f for n, f in originals.items())


def unhooked(cls, originals):
    """Both methods are exactly TE's own functions."""
    return all(cls.__dict__.get(n) is f for n, f in originals.items())


def raises(exc_type, action):
    """The message of the exc_type that action() raises; fails if it raises nothing."""
    try:
        action()
    except exc_type as exc:
        return str(exc)
    raise AssertionError(f"{action} did not raise {exc_type.__name__}")


def watchers():
    return [f for f in sys.meta_path if isinstance(f, te_hooks._ImportWatcher)]


def in_thread(name, action):
    """Runs action() in a daemon thread (a deadlocked one cannot keep the process alive).

    Returns the thread and the list its traceback goes to if action() raises.
    """
    errors = []

    def run():
        try:
            action()
        except BaseException:
            errors.append(f"{name}: {traceback.format_exc()}")

    thread = threading.Thread(target=run, name=name, daemon=True)
    thread.start()
    return thread, errors


def join_or_fail(threads, errors):
    """Fails, showing every thread's stack, unless all finish within DEADLOCK_S without error."""
    deadline = time.monotonic() + DEADLOCK_S
    for thread in threads:
        thread.join(timeout=max(0.0, deadline - time.monotonic()))
    stuck = [thread.name for thread in threads if thread.is_alive()]
    if stuck:
        faulthandler.dump_traceback(all_threads=True)
        raise AssertionError(f"deadlock: {stuck} still running after {DEADLOCK_S} s")
    assert not errors, "\\n".join(errors)


def import_te_slowly():
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

'''

# --- the scenarios, grouped into a few processes -----------------------------------------------
#
# Every process imports torch once (seconds), so related scenarios share one. Each scenario is a
# section: a function that runs after the previous one passed and then prints its marker, so each
# test reports its own section; a section after a failed one reports that it did not run.

# process name -> the fake package on its PYTHONPATH (None: no transformer_engine at all)
PROCESSES: dict[str, str | None] = {
    "no_te": None,
    "hooks": "fake_te",
    "watcher": "fake_te",
    "install_race": "fake_te_slow",
    "policy_race": "fake_te_slow",
    "contract": "fake_te_without_contract",
    "package": "fake_te",
}
SECTIONS: dict[str, list[tuple[str, str]]] = {name: [] for name in PROCESSES}
PASSED = "section passed: "


def section(process: str, test: str, body: str) -> None:
    function = f"def {test}():\n" + textwrap.indent(textwrap.dedent(body), "    ")
    marker = f"print({PASSED + test!r}, flush=True)"
    SECTIONS[process].append((test, f"{function}\n\n{test}()\n{marker}"))


def process_script(process: str) -> str:
    return "\n\n".join([PRELUDE, *(code for _, code in SECTIONS[process])]) + "\n"


def process_of(test: str) -> str:
    return next(p for p, sections in SECTIONS.items() if test in dict(sections))


section(
    "no_te",
    "test_install_without_te_raises_import_error",
    """
    class BlockTE(importlib.abc.MetaPathFinder):
        def find_spec(self, name, path, target=None):
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
    """,
)

section(
    "hooks",
    "test_policy_entry_hooks_imported_te",
    """
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
    """,
)

section(
    "hooks",
    "test_subclasses_follow_policy",
    """
    from transformer_engine.pytorch.optimizers.fused_adam import FusedAdam


    class Inheriting(FusedAdam):
        pass


    class Overriding(FusedAdam):
        def state_dict(self):
            sd = super().state_dict()
            sd["subclass"] = "extra"
            return sd


    overriding_method = Overriding.__dict__["state_dict"]
    for cls in (Inheriting, Overriding):
        opt = cls(params(), master_weights=True, exp_avg_dtype=torch.bfloat16,
                  exp_avg_sq_dtype=torch.bfloat16)
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
    """,
)

section(
    "hooks",
    "test_instance_contract_error_leaves_state_unchanged",
    """
    from transformer_engine.pytorch.optimizers.fused_adam import FusedAdam

    opt = FusedAdam(params(), master_weights=True, exp_avg_dtype=torch.float16,
                    exp_avg_sq_dtype=torch.float16)
    train(opt)
    before = snapshot(opt)
    version = te_contract.te_version()
    if not te_distribution_installed():
        assert version == FAKE_VERSION, version
    del opt.name_to_dtype_map


    def export():
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
    """,
)

section(
    "hooks",
    "test_install_idempotent_uninstall_restores_and_warns",
    """
    from transformer_engine.pytorch.optimizers.fused_adam import ORIGINALS, FusedAdam

    assert not any(hasattr(f, MARK) for f in ORIGINALS.values())
    assert is_installed()  # hooked by the policies of the earlier sections
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

    opt = FusedAdam(params(), master_weights=True, exp_avg_dtype=torch.bfloat16,
                    exp_avg_sq_dtype=torch.bfloat16)
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
    assert found[0].filename == "<string>", found[0].filename  # points at the `with` line

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
    """,
)

section(
    "watcher",
    "test_import_watcher_hooks_te_imported_inside_policy",
    """
    assert not te_loaded()
    with export_placement("cpu"):
        assert not is_installed()
        assert not te_loaded(), "entering a policy imported transformer_engine"
        from transformer_engine.pytorch.optimizers import FusedAdam

        assert is_installed(), "TE imported inside a policy was not hooked"
        assert not any(isinstance(f, te_hooks._ImportWatcher) for f in sys.meta_path)
        opt = FusedAdam(params(), master_weights=True, exp_avg_dtype=torch.bfloat16,
                        exp_avg_sq_dtype=torch.bfloat16)
        train(opt)
        live = live_storages(opt)
        ours = opt.state_dict()
        with export_placement(None):
            reference = opt.state_dict()
    assert te_export(reference, live)
    assert streamed(ours, live)
    assert_same_export(ours, reference)
    """,
)

section(
    "watcher",
    "test_threads_race_hooking_and_exports",
    """
    from transformer_engine.pytorch.optimizers.fused_adam import ORIGINALS, FusedAdam

    sys.setswitchinterval(1e-6)
    ROUNDS, EXPORTS = 30, 2
    MOMENTS = [torch.float32, torch.bfloat16, torch.float16, torch.uint8]

    # Even-numbered exporters stream under "cpu" (every storage mode); odd ones run TE's export
    # under None, with FP32 states only, so that every exported tensor aliases the live state.
    exporters = []
    for k in range(8):
        device = "cpu" if k % 2 == 0 else None
        moments = MOMENTS[k // 2] if device else torch.float32
        opt = FusedAdam(params(seed=k), lr=1e-2, master_weights=True, exp_avg_dtype=moments,
                        exp_avg_sq_dtype=moments)
        train(opt, seed=k)
        with export_placement(None):
            reference = opt.state_dict()
        exporters.append((opt, device, reference, live_storages(opt)))

    barrier = threading.Barrier(17, timeout=120)
    errors = []


    def install_or_enter(k, j):
        if (k + j) % 2:
            install()
        else:
            with export_placement("cpu"):
                pass


    def export(k, j):
        opt, device, reference, live = exporters[k]
        with export_placement(device):
            sd = opt.state_dict()
        assert_same_export(sd, reference, f"exporter {k}")
        if device == "cpu":
            assert streamed(sd, live), f"exporter {k} ({device}): not streamed"
        else:
            assert all(aliases_live(t, live) for t in exported_tensors(sd)), f"exporter {k}"


    def worker(action, k):
        try:
            for _ in range(ROUNDS):
                barrier.wait()
                for j in range(EXPORTS):
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
        for r in range(ROUNDS):
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
    """,
)

section(
    "install_race",
    "test_install_during_watched_import_does_not_deadlock",
    """
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
    """,
)

section(
    "policy_race",
    "test_policy_entered_during_import_waits_and_hooks",
    """
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
    """,
)

section(
    "contract",
    "test_incompatible_te_imported_after_policy_imports_then_policy_raises",
    """
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


    def enter_policy():
        with export_placement("cpu"):
            raise AssertionError("entered a policy over a FusedAdam that breaks the contract")


    # The next policy entry raises, where the user asked for the streaming export.
    message = raises(te_contract.ContractError, enter_policy)
    assert "FusedAdam lacks get_unscaled_state (" in message, message
    assert current_placement() is None
    assert unhooked(FusedAdam, ORIGINALS)
    """,
)

section(
    "contract",
    "test_class_contract_error_names_attribute_and_version",
    """
    from transformer_engine.pytorch.optimizers.fused_adam import ORIGINALS, FusedAdam

    version = te_contract.te_version()
    if not te_distribution_installed():
        assert version == FAKE_VERSION, version


    def enter_policy():
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
    """,
)

section(
    "package",
    "test_package_fused_adam_against_fake_te",
    """
    assert not te_loaded(), "import te_ckpt_placement imported transformer_engine"
    assert "te_ckpt_placement.fused_adam" not in sys.modules
    PackageFusedAdam = te_ckpt_placement.FusedAdam
    assert te_loaded()
    from te_ckpt_placement import FusedAdam as imported
    from transformer_engine.pytorch.optimizers.fused_adam import FusedAdam as TEFusedAdam

    assert imported is PackageFusedAdam
    assert PackageFusedAdam.__mro__[1] is TEFusedAdam
    assert not is_installed(), "importing te_ckpt_placement.FusedAdam hooked TE"

    signature = inspect.signature(PackageFusedAdam.__init__)
    kinds = [p.kind for p in signature.parameters.values()]
    assert inspect.Parameter.VAR_KEYWORD not in kinds, signature
    assert inspect.Parameter.VAR_POSITIONAL not in kinds, signature
    te_names = list(inspect.signature(TEFusedAdam.__init__).parameters)
    assert list(signature.parameters) == [*te_names, "state_dict_placement"], signature

    # Every TE argument reaches TE's constructor unchanged.
    te_args = dict(
        lr=0.25, betas=(0.8, 0.95), eps=1e-6, weight_decay=0.01, amsgrad=False,
        bias_correction=False, adam_w_mode=False, capturable=True, master_weights=True,
        master_weight_dtype=torch.float16, exp_avg_dtype=torch.bfloat16,
        exp_avg_sq_dtype=torch.float16, use_decoupled_grad=True, store_param_remainders=True,
        set_grad_none=True,
    )
    opt = PackageFusedAdam(params(), **te_args, state_dict_placement=torch.device("cpu"))
    assert opt.te_init_args == te_args, opt.te_init_args
    assert opt.state_dict_placement == Placement(device="cpu")

    opt = PackageFusedAdam(params(), exp_avg_dtype=torch.bfloat16,
                           exp_avg_sq_dtype=torch.bfloat16, master_weights=True,
                           state_dict_placement="cpu")
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
    """,
)
# --- running the scenario processes ----------------------------------------------------------


@dataclass
class Launched:
    process: subprocess.Popen[bytes]
    stdout: IO[bytes]
    stderr: IO[bytes]
    output: tuple[int, str, str] | None = None


@dataclass
class Processes:
    """This module's scenario processes, started together and awaited when a test needs one."""

    workdir: Path
    roots: dict[str, Path]
    launched: dict[str, Launched] = field(default_factory=dict)

    def start(self, name: str) -> None:
        fake = PROCESSES[name]
        path = [str(self.roots[fake])] if fake else []
        env = {**os.environ, "PYTHONPATH": os.pathsep.join([*path, str(REPO_ROOT)])}
        env["PYTHONDONTWRITEBYTECODE"] = "1"
        stdout = (self.workdir / f"{name}.out").open("w+b")
        stderr = (self.workdir / f"{name}.err").open("w+b")
        process = subprocess.Popen(
            [sys.executable, "-c", process_script(name)],
            cwd=self.workdir,
            env=env,
            stdout=stdout,
            stderr=stderr,
        )
        self.launched[name] = Launched(process, stdout, stderr)

    def result(self, name: str) -> tuple[int, str, str]:
        run = self.launched[name]
        if run.output is None:
            returncode = run.process.wait(timeout=TIMEOUT_S)
            run.stdout.seek(0)
            run.stderr.seek(0)
            out = run.stdout.read().decode(errors="replace")
            err = run.stderr.read().decode(errors="replace")
            run.output = (returncode, out, err)
        return run.output

    def check(self, test: str) -> None:
        process = process_of(test)
        returncode, out, err = self.result(process)
        if PASSED + test in out.splitlines():
            return
        earlier = [t for t, _ in SECTIONS[process]]
        earlier = earlier[: earlier.index(test)]
        failed = next((t for t in earlier if PASSED + t not in out.splitlines()), None)
        if failed is not None:
            pytest.fail(f"did not run: {failed} failed before it in process {process!r}")
        pytest.fail(f"process {process!r} exited with {returncode}:\n{err}\n{out}")

    def close(self) -> None:
        for run in self.launched.values():
            if run.process.poll() is None:
                run.process.kill()
                run.process.wait()
            run.stdout.close()
            run.stderr.close()


@pytest.fixture(scope="module")
def scenarios(
    request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[Processes]:
    base = tmp_path_factory.mktemp("te_adapter")
    roots = {name: write_fake_te(base / name, source) for name, source in FAKES.items()}
    workdir = base / "work"
    workdir.mkdir()
    selected = {
        process_of(item.name)
        for item in request.session.items
        if getattr(item, "module", None) is sys.modules[__name__]
        and any(item.name in dict(sections) for sections in SECTIONS.values())
    }
    processes = Processes(workdir, roots)
    try:
        for name in PROCESSES:
            if name in selected:
                processes.start(name)
        yield processes
    finally:
        processes.close()


def test_every_section_has_a_test() -> None:
    tests = [test for sections in SECTIONS.values() for test, _ in sections]
    assert len(tests) == len(set(tests))
    assert set(tests) == {name for name in globals() if name.startswith("test_")} - {
        "test_every_section_has_a_test"
    }


def test_install_without_te_raises_import_error(scenarios: Processes) -> None:
    scenarios.check("test_install_without_te_raises_import_error")


def test_policy_entry_hooks_imported_te(scenarios: Processes) -> None:
    scenarios.check("test_policy_entry_hooks_imported_te")


def test_subclasses_follow_policy(scenarios: Processes) -> None:
    scenarios.check("test_subclasses_follow_policy")


def test_instance_contract_error_leaves_state_unchanged(scenarios: Processes) -> None:
    scenarios.check("test_instance_contract_error_leaves_state_unchanged")


def test_install_idempotent_uninstall_restores_and_warns(scenarios: Processes) -> None:
    scenarios.check("test_install_idempotent_uninstall_restores_and_warns")


def test_import_watcher_hooks_te_imported_inside_policy(scenarios: Processes) -> None:
    scenarios.check("test_import_watcher_hooks_te_imported_inside_policy")


def test_threads_race_hooking_and_exports(scenarios: Processes) -> None:
    scenarios.check("test_threads_race_hooking_and_exports")


def test_install_during_watched_import_does_not_deadlock(scenarios: Processes) -> None:
    scenarios.check("test_install_during_watched_import_does_not_deadlock")


def test_policy_entered_during_import_waits_and_hooks(scenarios: Processes) -> None:
    scenarios.check("test_policy_entered_during_import_waits_and_hooks")


def test_incompatible_te_imported_after_policy_imports_then_policy_raises(
    scenarios: Processes,
) -> None:
    scenarios.check("test_incompatible_te_imported_after_policy_imports_then_policy_raises")


def test_class_contract_error_names_attribute_and_version(scenarios: Processes) -> None:
    scenarios.check("test_class_contract_error_names_attribute_and_version")


def test_package_fused_adam_against_fake_te(scenarios: Processes) -> None:
    scenarios.check("test_package_fused_adam_against_fake_te")
