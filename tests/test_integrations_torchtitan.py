"""torchtitan 0.3.0's real ``CheckpointManager`` and ``OptimizersContainer`` on the bounded paths
(CPU, gloo, FSDP2, the CPU stand-in of TE).

Runs in the framework venv (``.ci/run``); the main suite skips it. Each world size spawns a save
phase and a fresh-process resume phase (``support/torchtitan_run.py``).
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import pytest

from .support.frameworks import require

require("torchtitan.components.checkpoint", "torchtitan")

from .support import torchtitan_run  # noqa: E402
from .support.helpers import assert_same_export  # noqa: E402


def _same(ours: dict[str, Any], ref: dict[str, Any], where: str) -> None:
    assert ours.keys() == ref.keys(), f"{where}: keys {sorted(ours.keys() ^ ref.keys())}"
    # The order of the states follows how the optimizer got them (a step or a load): not a
    # property of the checkpoint.
    assert_same_export({k: ours[k] for k in sorted(ref)}, {k: ref[k] for k in sorted(ref)}, where)


@pytest.fixture(scope="module", params=[1, 2], ids=["1rank", "2ranks"])
def phases(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Any:
    import torch

    world = request.param
    tmp = tmp_path_factory.mktemp(f"torchtitan{world}")
    saves = torchtitan_run.spawn_phase(torchtitan_run.save_phase, world, tmp)
    results = torchtitan_run.spawn_phase(torchtitan_run.resume_phase, world, tmp)
    records = {p.stem: torch.load(p, weights_only=False) for p in Path(tmp).glob("*.pt")}
    return tmp, saves, results, records


@pytest.mark.parametrize("saved,placed", torchtitan_run.RESUMES)
def test_resume_is_bit_for_bit_without_a_fake_step(phases: Any, saved: str, placed: bool) -> None:
    """Every save mode, loaded by the placed or torchtitan's own run in a fresh process: TE's
    export at the save point, the step not advanced, one more step equal to the saver's; the
    placed load runs no optimizer step (torchtitan's own runs ``init_optim_state``'s)."""
    _, saves, results, records = phases
    assert not isinstance(saves[saved], str), saves[saved]
    loaded, steps, load_steps, train_step, continued = results[(saved, placed)]
    _same(loaded, records[f"{saved}_at_save"], f"{saved} -> placed={placed}: loaded")
    assert steps == [torchtitan_run.SAVE_STEP], steps
    assert train_step == torchtitan_run.SAVE_STEP
    assert load_steps == (0 if placed else 1), load_steps
    _same(continued, records[f"{saved}_after"], f"{saved} -> placed={placed}: next step")


def test_placed_checkpoint_has_torchtitans_keys_and_streamed(phases: Any) -> None:
    """The placed sync save writes torchtitan's own keys (no ``param_names``), through
    ``StreamingWriter``."""
    import torch.distributed.checkpoint as dcp

    tmp = phases[0]
    step = Path("ckpt") / f"step-{torchtitan_run.SAVE_STEP}"
    names = ("placed_sync", "plain_sync", "placed_async", "placed_pinned")
    keys = {
        n: dcp.FileSystemReader(str(tmp / n / step)).read_metadata().state_dict_metadata.keys()
        for n in names
    }
    assert all(keys[n] == keys["plain_sync"] for n in names), {
        n: sorted(keys[n] ^ keys["plain_sync"]) for n in names
    }
    assert any(k.startswith("optimizer.state.") for k in keys["plain_sync"])
    assert any(k.startswith("optimizer.param_groups.") for k in keys["plain_sync"])
    assert not any(k.endswith(".param_names") for k in keys["plain_sync"])
    # StreamingWriter names its data files __<rank>_<12 hex digits>_<n>.distcp, torch's
    # FileSystemWriter __<rank>_<n>.distcp.
    streamed = re.compile(r"__\d+_[0-9a-f]{12}_\d+\.distcp")
    files = {n: [p.name for p in (tmp / n / step).glob("*.distcp")] for n in names}
    for name in ("placed_sync", "placed_async", "placed_pinned"):
        assert files[name] and all(streamed.fullmatch(f) for f in files[name]), files
    assert files["plain_sync"] and not any(streamed.fullmatch(f) for f in files["plain_sync"])


@pytest.mark.parametrize("name", ["placed_async", "placed_pinned"])
def test_async_saves_stage_the_raw_snapshot(phases: Any, name: str) -> None:
    """``async`` and ``async_with_pinned_mem``: the run's stager is a ``SnapshotStager`` (no
    ``DefaultStager``), whose report counts the raw stored bytes, none converted at staging."""
    saves = phases[1]
    assert not isinstance(saves[name], str), saves[name]
    stager, details = saves[name]
    assert stager == "SnapshotStager"
    assert details["raw_bytes"] > 0 and details["converted_bytes"] == 0, details


def test_fresh_run_starts_at_step_one(phases: Any) -> None:
    results = phases[2]
    found, had_state, steps, placed_run = results[("fresh", True)]
    plain_found, plain_had_state, plain_steps, plain_run = results[("fresh", False)]
    assert not found and not plain_found  # no checkpoint: torchtitan's fresh start
    assert not had_state and not plain_had_state
    assert steps == plain_steps == [1]
    _same(placed_run, plain_run, "fresh run, placed vs plain")
