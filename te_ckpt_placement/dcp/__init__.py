"""torch.distributed.checkpoint (DCP) helpers for streamed optimizer exports.

- :class:`PassThroughStager`: an ``AsyncStager`` for ``dcp.async_save`` that hands tensors produced
  by a streaming export to the writer as they are, and stages everything else with torch's stager.
- :class:`PlacedOptimizerState`: a ``Stateful`` over (model, optimizers), the way torchtitan and
  NeMo Automodel wrap them, whose ``state_dict``/``load_state_dict`` run under an export policy.
- :class:`StreamingLoadPlanner`: a ``dcp.load`` planner that reads a checkpoint straight into the
  live TE FusedAdam states of ``PlacedOptimizerState`` adapters, with no FP32 template.

Importing this package imports torch.distributed.checkpoint, not Transformer Engine.
"""

from .load_planner import StreamingLoadPlanner, StreamingLoadWarning
from .stager import PassThroughStager
from .state import PlacedOptimizerState

__all__ = [
    "PassThroughStager",
    "PlacedOptimizerState",
    "StreamingLoadPlanner",
    "StreamingLoadWarning",
]
