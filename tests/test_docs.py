"""The documentation stays true to the repository: links resolve, generated pages are current."""

from __future__ import annotations

import importlib
import re
import subprocess
import sys
from pathlib import Path

import pytest

from .support.imports import PUBLIC_MODULES

ROOT = Path(__file__).resolve().parents[1]
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
LINK = re.compile(r"\]\(([^)#\s]+)(?:#[^)\s]*)?\)")


def test_readme_is_a_five_minute_read() -> None:
    assert len((ROOT / "README.md").read_text().splitlines()) <= 250


@pytest.mark.parametrize("page", PAGES, ids=lambda p: p.name)
def test_relative_links_resolve(page: Path) -> None:
    missing = [
        target
        for target in LINK.findall(page.read_text())
        if "://" not in target and not (page.parent / target).exists()
    ]
    assert not missing, f"{page.name} links to missing files: {missing}"


def test_performance_page_is_generated_from_committed_results(tmp_path: Path) -> None:
    page = ROOT / "docs" / "performance.md"
    script = (
        "import sys, runpy; sys.argv = ['report.py', '--docs']; "
        f"import pathlib; mod = runpy.run_path({str(ROOT / 'benchmarks' / 'report.py')!r}); "
        f"pathlib.Path({str(tmp_path / 'page.md')!r}).write_text(mod['docs']())"
    )
    subprocess.run([sys.executable, "-c", script], check=True, cwd=ROOT)
    assert (tmp_path / "page.md").read_text() == page.read_text(), (
        "docs/performance.md is stale: run python benchmarks/report.py --docs"
    )


@pytest.mark.parametrize("module", PUBLIC_MODULES)
def test_every_public_name_is_in_the_api_reference(module: str) -> None:
    try:
        mod = importlib.import_module(module)
    except ImportError as exc:  # a framework the module wraps is not installed
        pytest.skip(f"{module}: {exc}")
    api = (ROOT / "docs" / "api.md").read_text()
    names = [
        *getattr(mod, "__all__", ()),
        *(["FusedAdam"] if module == "te_ckpt_placement" else []),
    ]
    missing = [name for name in names if f"`{name}" not in api]
    assert not missing, f"docs/api.md does not document {module}: {missing}"


def test_install_lines_install_from_the_checkout() -> None:
    """The package is on no index: every page installs it from the checkout (``pip install -e``)."""
    from_index = re.compile(r"pip install\s+[\"']?te[_-]ckpt[_-]placement\b")
    wrong = [
        f"{page.name}: {line.strip()}"
        for page in PAGES
        for line in page.read_text().splitlines()
        if from_index.search(line)
    ]
    assert not wrong, f"install from the checkout instead (pip install -e '.[EXTRA]'): {wrong}"


def test_the_readme_names_the_test_extra_before_the_test_command() -> None:
    readme = (ROOT / "README.md").read_text()
    assert "pip install torch==2.13.0" in readme and "pip install -e '.[test]'" in readme
    assert readme.index("pip install -e '.[test]'") < readme.index("`python -m pytest -q`")


def test_dcp_run_sizes_agree_with_the_committed_results() -> None:
    """A page giving the local size of the ``dcp_e2e.py --size medium`` run gives the JSON's."""
    import json

    results = ROOT / "benchmarks" / "results"
    sizes = {
        record["n_elements"]
        for name in ("h200x2_dcp_paths.json", "h200x2_dcp_load_speed.json")
        for record in json.loads((results / name).read_text())["records"]
    }
    assert len(sizes) == 1, sizes
    expected = f"{sizes.pop() / (1 << 30):.2f} G"
    cites = ("--size medium", "h200x2_dcp_paths.json", "h200x2_dcp_load_speed.json")
    found = []
    for page in PAGES:
        for paragraph in re.split(r"\n\n|\n(?=- )", page.read_text()):  # paragraphs, list items
            if any(cite in paragraph for cite in cites):
                text = " ".join(paragraph.split())
                found += [(page.name, size) for size in re.findall(r"(\d+\.\d+ G) local", text)]
    assert found, "no page gives the size of the DCP run"
    assert all(size == expected for _, size in found), (expected, found)


def test_contributing_lists_every_package_module() -> None:
    """docs/contributing.md's layout names each module of the package under its folder."""
    page = (ROOT / "docs" / "contributing.md").read_text()
    layout = page.split("## Layout", 1)[1].split("\nAround it:", 1)[0]
    listed: dict[str, set[str]] = {}
    folder = ""
    for line in layout.splitlines():
        if line.startswith("- "):  # a top-level item: the package's folder, or one of its own
            match = re.match(r"- `te_ckpt_placement/(\w+)/`", line)
            folder = match.group(1) if match else ""
        modules = re.findall(r"`(?:te_ckpt_placement/)?(\w+\.py)`", line)
        listed.setdefault(folder, set()).update(modules)
    package = ROOT / "te_ckpt_placement"
    actual: dict[str, set[str]] = {}
    for path in package.rglob("*.py"):
        sub = path.parent.relative_to(package).as_posix()
        actual.setdefault("" if sub == "." else sub, set()).add(path.name)
    assert {k: v for k, v in listed.items() if v} == actual, (
        "update docs/contributing.md's layout: one line per module of te_ckpt_placement/"
    )
