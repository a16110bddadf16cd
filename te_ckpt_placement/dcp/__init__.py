"""torch.distributed.checkpoint (DCP) helpers for streamed optimizer exports.

- :class:`PassThroughStager`: an ``AsyncStager`` for ``dcp.async_save`` that hands tensors produced
  by a streaming export to the writer as they are, and stages everything else with torch's stager.
- :class:`PlacedOptimizerState`: a ``Stateful`` over (model, optimizers), the way torchtitan and
  NeMo Automodel wrap them, whose ``state_dict``/``load_state_dict`` run under an export policy;
  with ``save="streaming"`` its state dict holds lazy states that DCP's writer produces one at a
  time (:func:`lazy_optimizer_state_dict`, :class:`LazyState`).
- :class:`StreamingWriter`: a ``FileSystemWriter`` that drops each tensor once written, so a
  streaming save holds a few states at a time; for ``dcp.async_save`` it stages with
- :class:`SnapshotStager`, which copies only the raw stored bytes before training resumes.
- :class:`StreamingLoadPlanner`: a ``dcp.load`` planner that reads a checkpoint straight into the
  live TE FusedAdam states of ``PlacedOptimizerState`` adapters, with no FP32 template.

See docs/dcp.md for which to use when. Importing this package imports
torch.distributed.checkpoint, not Transformer Engine.
"""

from ._lazy_state import (
    LazyState,
    is_lazy,
    lazy_optimizer_state_dict,
    resolve_loaded,
)
from ._load_planner import StreamingLoadPlanner, StreamingLoadWarning
from ._pass_through import PassThroughStager
from ._snapshot import SnapshotStager
from ._state import PlacedOptimizerState
from ._writer import StreamingWriter

__all__ = [
    "LazyState",
    "PassThroughStager",
    "PlacedOptimizerState",
    "SnapshotStager",
    "StreamingLoadPlanner",
    "StreamingLoadWarning",
    "StreamingWriter",
    "is_lazy",
    "lazy_optimizer_state_dict",
    "resolve_loaded",
]
