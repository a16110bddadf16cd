"""NeMo Automodel 0.7.0's real ``BaseRecipe`` and ``Checkpointer`` on the bounded paths (CPU, gloo).

Runs in the framework venv (``.ci/run``); the main suite skips it. Each world size spawns a save
phase and a fresh-process resume phase (``support/automodel_run.py``).
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import pytest

from .support.frameworks import require

require("nemo_automodel.components.checkpoint.checkpointing", "automodel")

from .support import automodel_run  # noqa: E402
from .support.helpers import assert_same_export  # noqa: E402


def _same(ours: dict[str, Any], ref: dict[str, Any], where: str) -> None:
    assert ours.keys() == ref.keys(), f"{where}: keys {sorted(ours.keys() ^ ref.keys())}"
    assert_same_export(ours, ref, where)


@pytest.fixture(scope="module", params=[1, 2], ids=["1rank", "2ranks"])
def phases(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Any:
    import torch

    world = request.param
    tmp = tmp_path_factory.mktemp(f"automodel{world}")
    failures = automodel_run.spawn_phase(automodel_run.save_phase, world, tmp)
    results = automodel_run.spawn_phase(automodel_run.resume_phase, world, tmp)
    records = {p.stem: torch.load(p, weights_only=False) for p in Path(tmp).glob("*.pt")}
    return world, tmp, failures, results, records


@pytest.mark.parametrize("saved,placed", automodel_run.RESUMES)
def test_sync_save_resumes_bit_for_bit(phases: Any, saved: str, placed: bool) -> None:
    """The placed recipe's streaming save and Automodel's own save load in either recipe: the
    loaded run equals TE's export at the save point, the step is not advanced by the resume,
    and one more step equals the saver's next step."""
    _, _, failures, results, records = phases
    assert saved not in failures, failures[saved]
    loaded, steps, continued = results[(saved, placed)]
    _same(loaded, records[f"{saved}_at_save"], f"{saved} -> placed={placed}: loaded")
    assert steps == [automodel_run.SAVE_STEP], steps
    _same(continued, records[f"{saved}_after"], f"{saved} -> placed={placed}: next step")


def test_placed_and_plain_checkpoints_hold_the_same_tensors(phases: Any) -> None:
    """The bounded save writes what Automodel's own save writes (TE's export), key for key."""
    import torch.distributed.checkpoint as dcp

    _, tmp, _, _, _ = phases
    step = f"epoch_0_step_{automodel_run.SAVE_STEP}"
    metadata = {
        name: dcp.FileSystemReader(str(tmp / name / step / "optim")).read_metadata()
        for name in ("placed_sync", "plain_sync")
    }
    placed, plain = (metadata[n].state_dict_metadata for n in ("placed_sync", "plain_sync"))
    assert placed.keys() == plain.keys()
    assert any(k.startswith("optim.state.") for k in placed), sorted(placed)
    assert any(k.startswith("sched") for k in placed), sorted(placed)
    # StreamingWriter names its data files __<rank>_<12 hex digits>_<n>.distcp, torch's
    # FileSystemWriter __<rank>_<n>.distcp: the placed recipe's optimizer save streamed.
    streamed = re.compile(r"__\d+_[0-9a-f]{12}_\d+\.distcp")
    files = {n: [p.name for p in (tmp / n / step / "optim").glob("*.distcp")] for n in metadata}
    placed_files, plain_files = files["placed_sync"], files["plain_sync"]
    assert placed_files and all(streamed.fullmatch(f) for f in placed_files), files
    assert plain_files and not any(streamed.fullmatch(f) for f in plain_files), files


def test_fresh_run_starts_at_step_one(phases: Any) -> None:
    _, _, _, results, _ = phases
    had_state, steps, placed_run = results[("fresh", True)]
    plain_had_state, plain_steps, plain_run = results[("fresh", False)]
    assert not had_state and not plain_had_state  # load_checkpoint found nothing to load
    assert steps == plain_steps == [1]
    _same(placed_run, plain_run, "fresh run, placed vs plain recipe")


def test_async_process_save_is_the_snapshot(phases: Any) -> None:
    """``is_async: true``: the raw snapshot on Automodel's process executor, one stager for the
    run (closed with the checkpointer); the checkpoint is TE's export at the save point although
    training went on during the write, and it resumes bit for bit."""
    _, _, failures, results, records = phases
    assert "placed_async" not in failures, failures["placed_async"]
    # The stager was made at setup (load_checkpoint, which found nothing to load), so the first
    # save allocated nothing; the plain recipes keep Automodel's own stagers.
    stager = records["placed_async_stager"]
    assert stager["prewarmed_bytes"], stager
    assert stager["allocated_at_save"] == 0 and stager["buffer_bytes"] == stager["prewarmed_bytes"]
    assert records["placed_sync_stager"]["prewarmed_bytes"] is None  # sync saves keep no buffers
    loaded, steps, continued = results[automodel_run.ASYNC_RESUME]
    _same(loaded, records["placed_async_at_save"], "async save: loaded")
    assert steps == [automodel_run.SAVE_STEP], steps
    _same(continued, records["placed_async_after"], "async save: next step")


def _async_recipe(base: type, tmp_path: Path, optimizer: Any, model: Any) -> Any:
    """A placement recipe of ``base`` with what ``save_checkpoint`` finds and an ``is_async``
    checkpointer (only its config is read before a save)."""
    from types import SimpleNamespace

    from te_ckpt_placement.integrations import automodel

    recipe = automodel.placement_recipe(base)()
    recipe.model = model
    recipe.optimizer = [optimizer]
    config = SimpleNamespace(
        enabled=True, is_async=True, is_peft=False, checkpoint_dir=str(tmp_path)
    )
    recipe.checkpointer = SimpleNamespace(config=config)
    return recipe


def test_setup_does_not_prewarm_a_fresh_optimizer_that_is_not_te(tmp_path: Path) -> None:
    """A fresh torch optimizer has no TE initial states to size the snapshot from, and its export
    would run torch's fake step: the first save makes the buffers instead, and a warning says so
    (the recipe's setup goes on)."""
    import torch
    from nemo_automodel.recipes.base_recipe import BaseRecipe

    from te_ckpt_placement import export_placement
    from te_ckpt_placement.integrations import automodel

    model = torch.nn.Linear(4, 3)
    optimizer = torch.optim.AdamW(model.parameters())
    recipe = _async_recipe(BaseRecipe, tmp_path, optimizer, model)
    with export_placement("cpu"), pytest.warns(RuntimeWarning, match="not a TE FusedAdam"):
        automodel._prewarm_snapshot(recipe)
    assert not optimizer.state and not hasattr(recipe.checkpointer, automodel.STAGER)


def test_setup_does_not_prewarm_for_a_recipe_with_its_own_save(tmp_path: Path) -> None:
    """Recipes that override ``save_checkpoint`` (EAGLE, DFlash) may save another model's
    optimizer: what their first save stages is not known at setup."""
    import torch
    from nemo_automodel.recipes.base_recipe import BaseRecipe

    from te_ckpt_placement import export_placement
    from te_ckpt_placement.integrations import automodel

    class OwnSave(BaseRecipe):  # type: ignore[misc]
        def save_checkpoint(self, *args: Any, **kwargs: Any) -> None:
            raise AssertionError("not called")

    model = torch.nn.Linear(4, 3)
    optimizer = torch.optim.AdamW(model.parameters())
    recipe = _async_recipe(OwnSave, tmp_path, optimizer, model)
    with export_placement("cpu"), pytest.warns(RuntimeWarning, match="OwnSave has a save_check"):
        automodel._prewarm_snapshot(recipe)
    assert not hasattr(recipe.checkpointer, automodel.STAGER)
