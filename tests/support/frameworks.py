"""The real trainer frameworks (NeMo Automodel, torchtitan) for the tests that drive them.

They live in a venv of their own (``.ci/run`` makes it: nemo-automodel pins another transformers
than the ``test`` extra), so the main suite skips their modules. ``.ci/run`` sets
:data:`REQUIRED` in the framework venv, where a missing framework fails instead of skipping:
CI cannot pass without having run them.
"""

from __future__ import annotations

import importlib
import os
from types import ModuleType

import pytest

#: Set (to 1) where the framework tests must run: a missing framework is then an error.
REQUIRED = "TE_CKPT_PLACEMENT_FRAMEWORK_TESTS"


def require(module: str, extra: str) -> ModuleType:
    """``module`` imported; skips the calling test module without it, unless :data:`REQUIRED`."""
    try:
        return importlib.import_module(module)
    except ImportError as exc:
        if os.environ.get(REQUIRED):
            raise ImportError(
                f"{REQUIRED} is set but {module} does not import ({exc}); install "
                f"'.[{extra}]' (.ci/run makes the framework venv)"
            ) from exc
        pytest.skip(
            f"needs {module} (pip install -e '.[test-frameworks]' in a venv of its own)",
            allow_module_level=True,
        )
