"""te_ckpt_placement/_te_hooks.py's hooking machinery against a fake ``transformer_engine`` on disk.

The scenarios (``tests/support/te_scenarios.py``) run in fresh Python processes, because hooking
TE's class, the import watcher and ``install()``/``uninstall()`` change global import state that
the pytest process must not keep. The fake package (``tests/support/fake_te/``, copied into a
temporary folder on the processes' ``PYTHONPATH``) has TE 2.20.2's module path and ``FusedAdam``
constructor signature over the CPU stand-in's storage. The processes are started together when
the first test needs one, so that their torch imports overlap; each test checks its scenario.
"""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO

import pytest

from .support import fake_te
from .support.te_scenarios import PASSED, PROCESSES, SCENARIOS

REPO_ROOT = Path(__file__).resolve().parents[1]
TIMEOUT_S = 300


def process_of(test: str) -> str:
    """The scenario process that runs the scenario of ``test`` (``test_`` + its name)."""
    return next(p for p, fns in SCENARIOS.items() if test in {f"test_{f.__name__}" for f in fns})


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
        spec = PROCESSES[name]
        path = [str(self.roots[spec.fake])] if spec.fake else []
        env = {**os.environ, "PYTHONPATH": os.pathsep.join([*path, str(REPO_ROOT)])}
        env["PYTHONDONTWRITEBYTECODE"] = "1"
        env.pop(fake_te.IMPORT_DELAY_ENV, None)
        if spec.import_delay_s:
            env[fake_te.IMPORT_DELAY_ENV] = str(spec.import_delay_s)
        stdout = (self.workdir / f"{name}.out").open("w+b")
        stderr = (self.workdir / f"{name}.err").open("w+b")
        process = subprocess.Popen(
            [sys.executable, "-c", f"from tests.support.te_scenarios import run; run({name!r})"],
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
        name = test.removeprefix("test_")
        if PASSED + name in out.splitlines():
            return
        earlier = [f.__name__ for f in SCENARIOS[process]]
        earlier = earlier[: earlier.index(name)]
        failed = next((n for n in earlier if PASSED + n not in out.splitlines()), None)
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
    base = tmp_path_factory.mktemp("te_hooks")
    fakes = {spec.fake for spec in PROCESSES.values() if spec.fake is not None}
    roots = {fake: fake_te.write(base / fake, fake) for fake in sorted(fakes)}
    workdir = base / "work"
    workdir.mkdir()
    tests = {f"test_{f.__name__}" for fns in SCENARIOS.values() for f in fns}
    selected = {
        process_of(item.name)
        for item in request.session.items
        if getattr(item, "module", None) is sys.modules[__name__] and item.name in tests
    }
    processes = Processes(workdir, roots)
    try:
        for name in PROCESSES:
            if name in selected:
                processes.start(name)
        yield processes
    finally:
        processes.close()


def test_every_scenario_has_a_test() -> None:
    tests = [f"test_{f.__name__}" for fns in SCENARIOS.values() for f in fns]
    assert len(tests) == len(set(tests))
    assert set(tests) == {name for name in globals() if name.startswith("test_")} - {
        "test_every_scenario_has_a_test"
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
