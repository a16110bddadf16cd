"""The documentation stays true to the repository: links resolve, generated pages are current."""

from __future__ import annotations

import importlib
import re
import subprocess
import sys
from pathlib import Path

import pytest

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


PUBLIC_MODULES = [
    "te_ckpt_placement",
    "te_ckpt_placement.dcp",
    "te_ckpt_placement.integrations",
    "te_ckpt_placement.integrations.hf",
    "te_ckpt_placement.integrations.lightning",
    "te_ckpt_placement.integrations.pytorch_lightning",
    "te_ckpt_placement.integrations.automodel",
    "te_ckpt_placement.integrations.megatron",
]


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
