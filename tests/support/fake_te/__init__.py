"""A fake ``transformer_engine`` package, copied into a folder on ``PYTHONPATH`` by the hook tests.

``transformer_engine/`` here has TE 2.20.2's module path and ``FusedAdam`` constructor signature
over the CPU stand-in's storage (``tests/support/standin.py``); ``fused_adam_without_contract.py``
is the ``fused_adam.py`` of a hypothetical TE release whose ``FusedAdam`` lacks
``get_unscaled_state``. With ``FAKE_TE_IMPORT_DELAY_S`` set, importing ``fused_adam`` takes that
long (TE's takes seconds), so a race with a half-imported module can be staged.
"""

from __future__ import annotations

import shutil
from pathlib import Path

HERE = Path(__file__).resolve().parent
#: The version of the fake, as ``transformer_engine.__version__`` reports it.
VERSION = "2.20.2+fake.te.adapter.test"
#: The fakes: name -> the ``fused_adam.py`` it puts in the package.
FUSED_ADAM = {
    "fake_te": HERE / "transformer_engine" / "pytorch" / "optimizers" / "fused_adam.py",
    "fake_te_without_contract": HERE / "fused_adam_without_contract.py",
}
IMPORT_DELAY_ENV = "FAKE_TE_IMPORT_DELAY_S"


def write(root: Path, fake: str) -> Path:
    """Copies the fake ``transformer_engine`` package named ``fake`` into ``root``; returns it."""
    if fake not in FUSED_ADAM:
        raise ValueError(f"unknown fake {fake!r}: valid values are {sorted(FUSED_ADAM)}")
    shutil.copytree(
        HERE / "transformer_engine",
        root / "transformer_engine",
        ignore=shutil.ignore_patterns("__pycache__"),
    )
    optimizers = root / "transformer_engine" / "pytorch" / "optimizers"
    shutil.copyfile(FUSED_ADAM[fake], optimizers / "fused_adam.py")
    return root
