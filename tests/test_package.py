"""The package as a user meets it: its version, and what it says without Transformer Engine."""

from __future__ import annotations

import importlib.util
import json
import re
import subprocess
import sys
from pathlib import Path

import pytest

import te_ckpt_placement

ROOT = Path(__file__).resolve().parents[1]


def test_version_is_the_project_version() -> None:
    # tomllib is 3.11+, and the package supports 3.10.
    match = re.search(r'^version = "([^"]+)"$', (ROOT / "pyproject.toml").read_text(), re.M)
    assert match is not None
    assert te_ckpt_placement.__version__ == match.group(1)


@pytest.mark.skipif(
    importlib.util.find_spec("transformer_engine") is not None, reason="TE is installed here"
)
def test_fused_adam_without_te_says_how_to_install_it() -> None:
    # A fresh process: the lookup must not depend on what this one imported before.
    code = (
        "import te_ckpt_placement\n"
        "try:\n"
        "    te_ckpt_placement.FusedAdam\n"
        "except ImportError as exc:\n"
        "    print(type(exc).__name__, exc)\n"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, check=True
    ).stdout
    assert out.startswith("ImportError "), out
    assert "pip install 'transformer-engine[pytorch]'" in out


# --- what a fresh checkout installs -----------------------------------------------------------

# Imported by GPU-only or Python >= 3.12 tests, which skip without them: the extra that brings each.
OPTIONAL_IMPORTS = {
    "transformer_engine": ("te", "transformer-engine"),
    "megatron": ("megatron", "megatron-core"),
    # The framework tests' own venv (.ci/run): tests/support/frameworks.py.
    "nemo_automodel": ("automodel", "nemo-automodel"),
    "torchtitan": ("torchtitan", "torchtitan"),
}


def _distribution(requirement: str) -> str:
    """The normalized distribution name of a requirement string ("PyYAML>=6" -> "pyyaml")."""
    name = re.split(r"[\s\[<>=!~;]", requirement, maxsplit=1)[0]
    return re.sub(r"[-_.]+", "-", name).lower()


def _extras() -> dict[str, set[str]]:
    """Each extra's distributions; ``""`` for the package's own dependencies."""
    tomllib = pytest.importorskip("tomllib", reason="tomllib is Python 3.11+")
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    extras = {"": project["dependencies"], **project["optional-dependencies"]}
    return {extra: {_distribution(req) for req in reqs} for extra, reqs in extras.items()}


def _third_party_imports(folder: Path) -> dict[str, set[str]]:
    """Top-level module -> the files importing it (``importorskip`` included), stdlib and the
    repository's own packages left out."""
    import ast

    local = {"te_ckpt_placement", "tests", "benchmarks"}
    fake_te = folder / "support" / "fake_te"
    found: dict[str, set[str]] = {}
    for path in sorted(folder.rglob("*.py")):
        if fake_te in path.parents:  # a stand-in transformer_engine package, imported by path
            continue
        for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
            if isinstance(node, ast.Import):
                names = [alias.name for alias in node.names]
            elif isinstance(node, ast.ImportFrom) and not node.level and node.module:
                names = [node.module]
            elif (
                isinstance(node, ast.Call)
                and isinstance(node.func, ast.Attribute)
                and node.func.attr == "importorskip"
                and node.args
                and isinstance(node.args[0], ast.Constant)
            ):
                names = [str(node.args[0].value)]
            else:
                continue
            for name in names:
                top = name.partition(".")[0]
                if top not in sys.stdlib_module_names and top not in local:
                    found.setdefault(top, set()).add(str(path.relative_to(ROOT)))
    return found


def test_the_test_extra_provides_every_module_the_tests_import() -> None:
    from importlib.metadata import packages_distributions

    extras = _extras()
    imported = _third_party_imports(ROOT / "tests")
    assert {"pytest", "hypothesis", "yaml", "transformers"} <= imported.keys(), imported.keys()
    providers = packages_distributions()
    missing = []
    for module, files in sorted(imported.items()):
        if module in OPTIONAL_IMPORTS:
            extra, dist = OPTIONAL_IMPORTS[module]
            assert dist in extras.get(extra, set()), f"the [{extra}] extra should bring {dist}"
            continue
        dists = {_distribution(d) for d in providers.get(module, [])} or {f"? ({module})"}
        if not dists & (extras["test"] | extras[""]):
            missing.append(f"{module} (distribution {', '.join(sorted(dists))}; {min(files)})")
    assert not missing, (
        "tests/ imports modules the `test` extra in pyproject.toml does not bring; add their "
        f"distributions to it: {missing}"
    )


def test_the_sdist_ships_no_tests_without_their_support_code(tmp_path: Path) -> None:
    """The sdist holds the library alone: the tests need the whole checkout."""
    import shutil
    import tarfile
    from importlib.metadata import version

    setuptools_major = int(version("setuptools").split(".")[0])
    if setuptools_major < 77:
        pytest.skip(f"setuptools {setuptools_major} is older than pyproject.toml's build backend")
    for name in ("pyproject.toml", "README.md", "LICENSE", "MANIFEST.in", "setup.cfg"):
        if (ROOT / name).exists():  # what setuptools reads
            shutil.copy(ROOT / name, tmp_path / name)
    for folder in ("te_ckpt_placement", "tests"):
        skip = shutil.ignore_patterns("__pycache__")
        shutil.copytree(ROOT / folder, tmp_path / folder, ignore=skip)
    code = "from setuptools import build_meta; print(build_meta.build_sdist('dist'))"
    out = subprocess.run(
        [sys.executable, "-c", code], cwd=tmp_path, capture_output=True, text=True, check=True
    ).stdout.split()[-1]
    with tarfile.open(tmp_path / "dist" / out) as sdist:
        names = [name.partition("/")[2] for name in sdist.getnames()]
    assert "te_ckpt_placement/__init__.py" in names and "te_ckpt_placement/py.typed" in names
    assert not [name for name in names if name.startswith("tests")], names


def test_the_examples_without_te_say_what_they_need() -> None:
    """Run where TE does not import (blocked here, so also on a GPU machine), each example exits
    with a message naming TE's install command and the GPU, not with a traceback."""
    examples = sorted((ROOT / "examples").glob("*.py"))
    assert len(examples) >= 3
    # One process for all (torch imports once); anything but SystemExit propagates.
    code = (
        "import json, runpy, sys\n"
        "sys.modules['transformer_engine'] = None  # import transformer_engine raises ImportError\n"
        "exits = {}\n"
        "for path in sys.argv[1:]:\n"
        "    sys.argv = [path]\n"
        "    try:\n"
        "        runpy.run_path(path, run_name='__main__')\n"
        "    except SystemExit as exc:\n"
        "        exits[path] = exc.code\n"
        "print(json.dumps(exits))\n"
    )
    proc = subprocess.run(
        [sys.executable, "-c", code, *map(str, examples)],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    exits = json.loads(proc.stdout.splitlines()[-1])
    for example in examples:
        message = exits.get(str(example))
        assert isinstance(message, str), (example.name, message)  # sys.exit(message): status 1
        assert message.startswith(f"examples/{example.name} needs "), message
        assert "CUDA GPU" in message and "pip install 'transformer-engine[pytorch]'" in message
        assert "transformer_engine" in message.rpartition("; here: ")[2]  # what is missing here


# --- the framework tests: their own venv in CI, never skipped there ------------------------------


def _framework_test_modules() -> set[str]:
    """The test modules that import their framework through ``support.frameworks.require``."""
    return {
        str(path.relative_to(ROOT))
        for path in (ROOT / "tests").glob("test_*.py")
        if re.search(r"^require\(", path.read_text(), re.MULTILINE)
    }


def test_ci_runs_every_framework_test_module_where_skipping_fails() -> None:
    from .support.frameworks import REQUIRED

    modules = _framework_test_modules()
    assert "tests/test_integrations_automodel.py" in modules, modules
    ci = (ROOT / ".ci" / "run").read_text().splitlines()
    runs = [line for line in ci if "pytest" in line and f"{REQUIRED}=1" in line]
    assert runs, f".ci/run runs no pytest with {REQUIRED}=1"
    missing = {m for m in modules if not any(m in line for line in runs)}
    assert not missing, f".ci/run does not run {sorted(missing)} with {REQUIRED}=1"
    assert any(".[test-frameworks]" in line for line in ci), ".ci/run installs no framework venv"


def test_a_missing_framework_fails_where_the_framework_tests_are_required(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    from .support import frameworks

    monkeypatch.setitem(sys.modules, "nemo_automodel", None)  # import fails, installed or not
    monkeypatch.setenv(frameworks.REQUIRED, "1")
    with pytest.raises(ImportError, match="TE_CKPT_PLACEMENT_FRAMEWORK_TESTS is set"):
        frameworks.require("nemo_automodel", "automodel")
    monkeypatch.delenv(frameworks.REQUIRED)
    with pytest.raises(pytest.skip.Exception, match="needs nemo_automodel"):
        frameworks.require("nemo_automodel", "automodel")
