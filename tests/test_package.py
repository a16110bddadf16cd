"""The package as a user meets it: its version, and what it says without Transformer Engine."""

from __future__ import annotations

import importlib.util
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
