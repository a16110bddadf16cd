"""Trainer integrations without any framework: lazy imports, method wrapping, Automodel recipes.

The framework-specific tests are ``test_integrations_hf.py`` and
``test_integrations_lightning.py``; these run everywhere.
"""

from __future__ import annotations

import subprocess
import sys
import types
from pathlib import Path
from typing import Any

import pytest

from te_ckpt_placement import Placement, current_placement
from te_ckpt_placement.integrations import automodel
from te_ckpt_placement.integrations._methods import (
    methods_owner,
    place_methods,
    placed_methods,
    unplace_methods,
)

from .integration_probe import CPU

REPO_ROOT = Path(__file__).resolve().parents[1]
FRAMEWORKS = (
    "transformers",
    "accelerate",
    "lightning",
    "pytorch_lightning",
    "lightning_fabric",
    "nemo_automodel",
    "transformer_engine",
)


def test_importing_integrations_imports_no_framework() -> None:
    code = (
        "import sys\n"
        "import te_ckpt_placement\n"
        "import te_ckpt_placement.integrations\n"
        "import te_ckpt_placement.integrations._methods\n"
        "import te_ckpt_placement.integrations._lightning\n"
        "import te_ckpt_placement.integrations.automodel\n"
        "from te_ckpt_placement import export_placement\n"
        "with export_placement('cpu'):\n"
        "    pass\n"
        f"print(sorted(m for m in sys.modules if m.split('.')[0] in {FRAMEWORKS!r}))\n"
    )
    out = subprocess.run(
        [sys.executable, "-c", code],
        cwd=REPO_ROOT,
        capture_output=True,
        text=True,
        timeout=300,
        check=True,
    )
    assert out.stdout.strip() == "[]", out.stdout + out.stderr


# --- method wrapping ---------------------------------------------------------------------------


class Saver:
    def save(self, x: int) -> tuple[int, Placement | None]:
        return x, current_placement()

    def load(self) -> Placement | None:
        return current_placement()

    def fail(self) -> None:
        assert current_placement() == CPU
        raise KeyError("boom")

    def train_step(self) -> Placement | None:
        return current_placement()


def test_place_methods_scopes_exactly_and_restores() -> None:
    saver, bystander = Saver(), Saver()

    def previous_load() -> str:
        return "theirs"

    saver.load = previous_load  # type: ignore[method-assign]
    names = place_methods(saver, ("save", "load", "fail", "absent"), "cpu", owner="me")
    assert names == ("save", "load", "fail")
    assert methods_owner(saver) == "me"
    assert saver.save(3) == (3, CPU)
    assert saver.load() == "theirs"  # the previous instance attribute, now wrapped
    assert saver.train_step() is None
    with pytest.raises(KeyError):
        saver.fail()
    assert current_placement() is None  # the policy closed although the method raised
    assert bystander.save(1) == (1, None)
    assert saver.save.__name__ == "save"

    wrappers = dict(vars(saver))
    other = Placement(device="cpu", conversion="device")
    assert place_methods(saver, ("save",), other, owner="someone else") == names
    assert {k: vars(saver)[k] for k in names} == {k: wrappers[k] for k in names}
    assert methods_owner(saver) == "me"
    assert saver.save(4) == (4, other)

    assert unplace_methods(saver)
    assert placed_methods(saver) == () and methods_owner(saver) is None
    assert saver.load is previous_load
    assert "save" not in vars(saver) and "fail" not in vars(saver)
    assert saver.save(5) == (5, None)
    assert not unplace_methods(saver)


def test_unplace_leaves_a_later_replacement() -> None:
    saver = Saver()
    place_methods(saver, ("save",), "cpu")

    def later(x: int) -> str:
        return "later"

    saver.save = later  # type: ignore[method-assign]
    with pytest.warns(RuntimeWarning, match="replaced after the placement wrapper"):
        assert unplace_methods(saver)
    assert saver.save is later
    assert placed_methods(saver) == ()


def test_place_methods_rejects_bad_placement() -> None:
    saver = Saver()
    with pytest.raises(ValueError, match="unsupported export device"):
        place_methods(saver, ("save",), "cuda:7")
    assert placed_methods(saver) == () and "save" not in vars(saver)


# --- Automodel recipes -------------------------------------------------------------------------


class FakeBaseRecipe:
    """Automodel's BaseRecipe surface: save_checkpoint and load_checkpoint, called by the loop."""

    def __init__(self) -> None:
        self.seen: dict[str, Any] = {}

    def save_checkpoint(self, epoch: int, step: int, train_loss: float, **kwargs: Any) -> str:
        self.seen["save"] = current_placement()
        return f"saved {epoch} {step}"

    def load_checkpoint(self, restore_from: str | None = None) -> None:
        self.seen["load"] = current_placement()

    def run_train_validation_loop(self) -> None:
        self.seen["train"] = current_placement()
        self.load_checkpoint()
        self.save_checkpoint(0, 1, 0.5)


def test_recipe_mixin_and_factory() -> None:
    class Recipe(automodel.PlacementRecipeMixin, FakeBaseRecipe):
        pass

    recipe = Recipe()
    recipe.run_train_validation_loop()
    assert recipe.seen == {"train": None, "load": CPU, "save": CPU}
    assert recipe.save_checkpoint(2, 3, train_loss=0.1) == "saved 2 3"
    assert current_placement() is None

    other = Placement(device="cpu", conversion="device")
    built = automodel.placement_recipe(FakeBaseRecipe, other)
    assert built.__name__ == "PlacementFakeBaseRecipe"
    assert issubclass(built, automodel.PlacementRecipeMixin) and issubclass(built, FakeBaseRecipe)
    instance = built()
    instance.run_train_validation_loop()
    assert instance.seen == {"train": None, "load": other, "save": other}
    with pytest.raises(ValueError, match="unsupported export device"):
        automodel.placement_recipe(FakeBaseRecipe, "cuda")


def test_ready_made_recipe_is_built_lazily(monkeypatch: pytest.MonkeyPatch) -> None:
    module_name, base_name = automodel.READY_MADE["PlacementFinetuneRecipe"].rsplit(".", 1)
    fake = types.ModuleType(module_name)
    setattr(fake, base_name, type(base_name, (FakeBaseRecipe,), {}))
    monkeypatch.setitem(sys.modules, module_name, fake)
    monkeypatch.delitem(vars(automodel), "PlacementFinetuneRecipe", raising=False)

    # As Automodel's CLI resolves `recipe: te_ckpt_placement.integrations.automodel.<Name>`.
    import importlib

    target = "te_ckpt_placement.integrations.automodel.PlacementFinetuneRecipe"
    path, name = target.rsplit(".", 1)
    cls = getattr(importlib.import_module(path), name)
    try:
        assert cls.__name__ == name and cls.__module__ == path
        assert cls.__mro__[1:3] == (automodel.PlacementRecipeMixin, getattr(fake, base_name))
        assert automodel.PlacementFinetuneRecipe is cls  # built once
        recipe = cls()
        recipe.run_train_validation_loop()
        assert recipe.seen == {"train": None, "load": CPU, "save": CPU}
    finally:
        vars(automodel).pop("PlacementFinetuneRecipe", None)


def test_ready_made_recipe_without_automodel(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "nemo_automodel", None)  # import fails, installed or not
    monkeypatch.delitem(vars(automodel), "PlacementVLMFinetuneRecipe", raising=False)
    with pytest.raises(ImportError, match="needs NeMo Automodel"):
        _ = automodel.PlacementVLMFinetuneRecipe
    assert "PlacementVLMFinetuneRecipe" not in vars(automodel)
    with pytest.raises(AttributeError, match="no attribute 'Nope'"):
        _ = automodel.Nope
