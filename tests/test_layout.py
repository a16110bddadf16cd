"""The test suite's layout holds: shared code in tests/support/, GPU tests named for it.

- No test module imports from another test module: what two of them share lives in
  ``tests/support/`` (a test module's imports run its module-level code, and its tests move
  with it).
- Every name that the tests, benchmarks and examples import from ``tests`` exists, imports inside
  functions included: the GPU tests' imports run only on the GPU machine.
- A test module with ``gpu``/``multigpu`` tests is named ``test_gpu_*.py``, and each of those has
  some; tests/README.md lists every one of them under the GPU kit.
- ``multigpu`` says how many GPUs a test needs (``multigpu(4)``; 2 bare), and ``conftest.py``
  skips it with that number where fewer are there.
"""

from __future__ import annotations

import ast
import importlib
import importlib.util
import re
from pathlib import Path

import pytest

from . import conftest
from .support.imports import (
    PUBLIC_MODULES,
    import_cycles,
    import_graph,
    imports,
)

ROOT = Path(__file__).resolve().parents[1]
TESTS = ROOT / "tests"
# The fake TE's relative imports resolve in the copy that the hook tests make, not here.
FAKE_TE = TESTS / "support" / "fake_te" / "transformer_engine"
SOURCES = sorted(
    path
    for path in [*TESTS.rglob("*.py"), *(ROOT / "benchmarks").glob("*.py")]
    if FAKE_TE not in path.parents
) + sorted((ROOT / "examples").glob("*.py"))
TEST_MODULES = sorted(TESTS.rglob("test_*.py"))
GPU_MARKERS = {"gpu", "multigpu"}


def is_test_module(module: str) -> bool:
    parts = module.split(".")
    return parts[0] == "tests" and parts[-1].startswith("test_")


def test_the_checks_find_what_they_look_for() -> None:
    assert len(TEST_MODULES) > 20 and (TESTS / "test_layout.py") in TEST_MODULES
    found = imports(TESTS / "test_dcp.py")
    assert any(module == "tests.support.dcp_checks" for _, module, _ in found), found
    assert is_test_module("tests.test_dcp") and not is_test_module("tests.support.dcp_checks")
    assert gpu_markers(TESTS / "test_gpu_fsdp.py") == {"multigpu"}
    assert gpu_markers(TESTS / "test_gpu_examples.py") == GPU_MARKERS
    assert not (TESTS / "support" / "test_layout.py").exists()


def test_no_test_module_imports_another() -> None:
    offending = [
        f"{path.relative_to(ROOT)}:{line}: {module}" + (f" import {names}" if names else "")
        for path in SOURCES
        for line, module, names in imports(path)
        if is_test_module(module) or any(is_test_module(f"{module}.{n}") for n in names)
    ]
    assert not offending, "move what test modules share into tests/support/:\n" + "\n".join(
        offending
    )


def test_no_test_modules_in_support() -> None:
    # pytest would collect them, and test modules import from support, not the other way round.
    assert not sorted((TESTS / "support").rglob("test_*.py"))


def test_everything_imported_from_tests_exists() -> None:
    missing = []
    for path in SOURCES:
        for line, module, names in imports(path):
            if module.split(".")[0] != "tests":
                continue
            where = f"{path.relative_to(ROOT)}:{line}"
            try:
                mod = importlib.import_module(module)
            except ImportError as exc:
                missing.append(f"{where}: {module} ({exc})")
                continue
            for name in names:
                if hasattr(mod, name):
                    continue
                is_package = hasattr(mod, "__path__")
                if not is_package or importlib.util.find_spec(f"{module}.{name}") is None:
                    missing.append(f"{where}: {module}.{name}")
    assert not missing, "\n".join(missing)


def gpu_markers(path: Path) -> set[str]:
    """The ``gpu``/``multigpu`` markers that ``path`` uses (``pytest.mark.<name>``)."""
    used = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if (
            isinstance(node, ast.Attribute)
            and node.attr in GPU_MARKERS
            and isinstance(node.value, ast.Attribute)
            and node.value.attr == "mark"
        ):
            used.add(node.attr)
    return used


@pytest.mark.parametrize("path", TEST_MODULES, ids=lambda p: p.name)
def test_gpu_tests_are_named_for_it(path: Path) -> None:
    named = path.name.startswith("test_gpu_")
    marked = bool(gpu_markers(path))
    assert named == marked, (
        f"{path.name}: GPU tests (markers {sorted(GPU_MARKERS)}) live in test_gpu_*.py files, "
        "and only there"
    )


def test_readme_lists_the_gpu_tests() -> None:
    readme = (TESTS / "README.md").read_text()
    gpu_section = readme.split("## GPU tests", 1)[1].split("\n## ", 1)[0]
    listed = set(re.findall(r"`(test_\w+\.py)`", gpu_section))
    expected = {p.name for p in TEST_MODULES if p.name.startswith("test_gpu_")}
    assert listed == expected, f"tests/README.md's GPU list differs: {sorted(listed ^ expected)}"
    named = set(re.findall(r"`([\w/]+\.(?:py|md|sh))`", readme))
    places = (TESTS, TESTS / "support", ROOT)  # the README names files relative to these
    stale = sorted(name for name in named if not any((p / name).exists() for p in places))
    assert not stale, f"tests/README.md names files that do not exist: {stale}"


class _Item:
    """What ``conftest.skip_reason`` asks of a test item: its markers."""

    def __init__(self, *marks: pytest.MarkDecorator) -> None:
        self.marks = {m.mark.name: m.mark for m in marks}

    def get_closest_marker(self, name: str) -> pytest.Mark | None:
        return self.marks.get(name)


def test_multigpu_marker_says_how_many_gpus(monkeypatch: pytest.MonkeyPatch) -> None:
    # Through a name: test_gpu_tests_are_named_for_it counts each pytest.mark.<GPU marker>.
    marks = pytest.mark
    multigpu, gpu = marks.multigpu, marks.gpu
    assert conftest.required_gpus(multigpu.mark) == 2
    assert conftest.required_gpus(multigpu(4).mark) == 4
    for bad in (multigpu(1), multigpu("4"), multigpu(True), multigpu(4, 8), multigpu(n=4)):
        with pytest.raises(pytest.UsageError, match=r"valid values are @pytest\.mark\.multigpu"):
            conftest.required_gpus(bad.mark)
    monkeypatch.setattr(conftest, "gpu_skip_reason", lambda: None)  # CUDA and TE are there
    skip = conftest.skip_reason
    assert skip(_Item(multigpu(4)), 2) == "needs 4 CUDA GPUs"
    assert skip(_Item(multigpu(4)), 4) is None
    assert skip(_Item(multigpu), 1) == "needs 2 CUDA GPUs"
    assert skip(_Item(multigpu), 2) is None
    assert skip(_Item(gpu), 1) is None
    assert skip(_Item(), 0) is None
    # Without CUDA or TE, the reason says that first, whatever the count.
    monkeypatch.setattr(conftest, "gpu_skip_reason", lambda: "needs a CUDA GPU")
    assert skip(_Item(multigpu(4)), 0) == "needs a CUDA GPU"
    assert skip(_Item(gpu), 0) == "needs a CUDA GPU"
    with pytest.raises(pytest.UsageError):  # a bad marker fails on a CPU-only machine too
        skip(_Item(multigpu(0)), 0)


def test_one_class_constructs_a_cuda_stream() -> None:
    """Issue 22: one staging ring (``_ring.Ring``) owns every copy stream of the package."""

    def streams(node: ast.AST) -> int:
        return sum(
            isinstance(n, ast.Call) and ast.unparse(n.func) == "torch.cuda.Stream"
            for n in ast.walk(node)
        )

    calls, owners = 0, set()
    for path in sorted((ROOT / "te_ckpt_placement").rglob("*.py")):
        tree = ast.parse(path.read_text(), filename=str(path))
        calls += streams(tree)
        owners |= {
            f"{path.name}:{n.name}"
            for n in ast.walk(tree)
            if isinstance(n, ast.ClassDef) and streams(n)
        }
    assert owners == {"_ring.py:Ring"} and calls == 1, (owners, calls)


PACKAGE = ROOT / "te_ckpt_placement"
#: Import circles that other packages of issue 22 are still breaking, each as its sorted modules
#: (empty: none known).
KNOWN_CYCLES: set[tuple[str, ...]] = set()


def test_the_import_cycle_check_finds_cycles(tmp_path: Path) -> None:
    pkg = tmp_path / "te_ckpt_placement"
    (pkg / "sub").mkdir(parents=True)
    files = {
        "__init__.py": "def f():\n    from .sub import c\n",
        "a.py": "from . import b\nfrom .sub import c\n",
        "b.py": "def f():\n    import te_ckpt_placement.a\n",  # inside a function: counts
        "sub/__init__.py": "",
        "sub/c.py": "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from ..a import x\n",
        "sub/d.py": "from .. import sub\nfrom ..sub import d\n",  # a package; itself
    }
    for name, text in files.items():
        (pkg / name).write_text(text)
    graph = import_graph(tmp_path)
    assert graph["te_ckpt_placement.a"] == {"te_ckpt_placement.b", "te_ckpt_placement.sub.c"}
    assert graph["te_ckpt_placement.sub.c"] == set()  # TYPE_CHECKING only
    assert import_cycles(graph) == {
        ("te_ckpt_placement.a", "te_ckpt_placement.b"),
        ("te_ckpt_placement.sub.d",),
    }
    found = import_graph(ROOT)["te_ckpt_placement.dcp._load_planner"]
    assert {"te_ckpt_placement._ring", "te_ckpt_placement.dcp._load_guard"} <= found, found


def test_no_import_cycle_among_the_package_modules() -> None:
    """Issue 22: no import circle among the package's modules, imports inside functions too."""
    cycles = import_cycles(import_graph(ROOT))
    assert cycles <= KNOWN_CYCLES, f"import circles: {sorted(cycles - KNOWN_CYCLES)}"
    assert not KNOWN_CYCLES - cycles, f"broken, drop from KNOWN_CYCLES: {KNOWN_CYCLES - cycles}"


#: ``pytorch_lightning`` repeats ``lightning``'s names for the standalone package (each module
#: imports its own framework), so they count once for "one import path" and twice in the total.
MIRRORS = {
    "te_ckpt_placement.integrations.pytorch_lightning": "te_ckpt_placement.integrations.lightning"
}
MAX_PUBLIC_NAMES = 70
MAX_LINES = 600


def all_lists(root: Path) -> dict[str, list[str]]:
    """Each module of the package under ``root`` that has an ``__all__`` -> its names."""
    found: dict[str, list[str]] = {}
    for path in sorted((root / "te_ckpt_placement").rglob("*.py")):
        for node in ast.parse(path.read_text(), filename=str(path)).body:
            targets = node.targets if isinstance(node, ast.Assign) else []
            if any(isinstance(t, ast.Name) and t.id == "__all__" for t in targets):
                parts = list(path.relative_to(root).with_suffix("").parts)
                name = ".".join(parts[:-1] if parts[-1] == "__init__" else parts)
                found[name] = list(ast.literal_eval(node.value))
    return found


def test_only_the_public_modules_have_an_all() -> None:
    lists = all_lists(ROOT)
    extra, missing = (
        sorted(set(lists) - set(PUBLIC_MODULES)),
        sorted(set(PUBLIC_MODULES) - set(lists)),
    )
    assert not extra and not missing, f"__all__ in the public modules only: {extra=}, {missing=}"


def test_every_public_name_is_documented_and_has_one_import_path() -> None:
    """Issue 22: each public ``__all__`` name is in docs/api.md and exported by one module only."""
    lists = all_lists(ROOT)
    api = (ROOT / "docs" / "api.md").read_text()
    undocumented = [
        f"{mod}.{name}" for mod, names in lists.items() for name in names if f"`{name}" not in api
    ]
    assert not undocumented, f"document these in docs/api.md or drop them: {undocumented}"
    paths: dict[str, list[str]] = {}
    for mod, names in lists.items():
        if mod in MIRRORS:
            assert sorted(names) == sorted(lists[MIRRORS[mod]]), (mod, MIRRORS[mod])
            continue
        for name in names:
            paths.setdefault(name, []).append(mod)
    several = {name: mods for name, mods in paths.items() if len(mods) > 1}
    assert not several, f"one import path per public name: {several}"
    total = sum(len(names) for names in lists.values())
    assert total <= MAX_PUBLIC_NAMES, (
        f"{total} public names in __all__ lists (at most {MAX_PUBLIC_NAMES})"
    )


def test_the_surface_checks_find_what_they_look_for(tmp_path: Path) -> None:
    pkg = tmp_path / "te_ckpt_placement"
    (pkg / "sub").mkdir(parents=True)
    (pkg / "__init__.py").write_text('__all__ = ["a", "b"]\n')
    (pkg / "_private.py").write_text("__all__ = ['c']\nx = 1\n")
    (pkg / "sub" / "__init__.py").write_text("x: int = 1\n")
    assert all_lists(tmp_path) == {
        "te_ckpt_placement": ["a", "b"],
        "te_ckpt_placement._private": ["c"],
    }
    assert "te_ckpt_placement.integrations.lightning" in all_lists(ROOT)


def test_no_package_file_is_over_600_lines() -> None:
    long = {
        str(path.relative_to(ROOT)): n
        for path in sorted(PACKAGE.rglob("*.py"))
        if (n := len(path.read_text().splitlines())) > MAX_LINES
    }
    assert not long, f"split these package files (at most {MAX_LINES} lines): {long}"
