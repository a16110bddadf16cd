"""The load handshake between ``PlacedOptimizerState`` and ``StreamingLoadPlanner``.

A leaf both sides import, so that neither imports the other's side of it: the adapter
(:mod:`.state`) owns its fields and offers methods, the planner (:mod:`.load_planner`) calls
them as a :class:`LoadSession`, and ``load_state_dict`` finishes a :class:`StreamingTemplate`
without knowing the planner.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, Protocol


class StreamingLoadWarning(UserWarning):
    """A streaming load fell back to the template path, or went over its assembly budget."""


class LoadSession(Protocol):
    """What an adapter asks of the streaming load it is armed for (a ``StreamingLoadPlanner``)."""

    def template_for(self, state: Any) -> dict[str, Any] | None:
        """The streaming template of ``state``, or None (warned) for the template path."""

    @property
    def progress(self) -> str:
        """How far the load got, for the adapter's warning about a load that stopped."""

    def abandon(self) -> None:
        """Ends a load that stopped part-way: its queued uploads land, its pinned slots go back."""


class StreamingTemplate(dict):  # type: ignore[type-arg]
    """What ``PlacedOptimizerState.state_dict()`` returns for a streaming load."""

    def finish(self) -> None:
        """Loads the ``param_groups`` once every state has streamed in (``load_state_dict``)."""
        raise NotImplementedError

    def __reduce_ex__(self, protocol: Any) -> Any:
        raise TypeError(
            "a streaming-load template cannot be saved, pickled or copied: a PlacedOptimizerState "
            "returns one from the state_dict() call after StreamingLoadPlanner(state) was made; "
            "make the planner in the dcp.load call that uses it"
        )


def merge_part(merged: dict[str, Any], part: Mapping[str, Any]) -> None:
    """Adds one model part's flattened optimizer state dict to ``merged``.

    Raises:
        ValueError: the part exports a key ``merged`` already has (the parts' FQNs overlap);
            ``merged`` is left as it was.
    """
    overlap = merged.keys() & part.keys()
    if overlap:
        raise ValueError(
            f"model parts export the same keys {sorted(overlap)[:3]}: give each part distinct "
            "parameter names"
        )
    merged.update(part)
