"""Trainer integrations: the export policy around a framework's optimizer-state saves and loads.

One thin module per framework, each imported only when used (``import
te_ckpt_placement.integrations`` imports no framework):

- :mod:`te_ckpt_placement.integrations.hf`: Hugging Face Transformers ``Trainer``
  (``PlacementTrainerMixin``, ``PlacementTrainer``, ``place_trainer``). Extra ``[hf]``.
- :mod:`te_ckpt_placement.integrations.lightning`: Lightning ``Trainer`` and ``Fabric``
  (``PlacementCallback``, ``PlacementStrategyMixin``, ``place_strategy``). Extra ``[lightning]``.
- :mod:`te_ckpt_placement.integrations.automodel`: YAML-configured NeMo Automodel recipes
  (``PlacementRecipeMixin``, ``placement_recipe``, ``python -m`` entry point); imports
  ``nemo_automodel`` only when a ready-made recipe class is asked for.
- :mod:`te_ckpt_placement.integrations.megatron`: Megatron-Core's ``DistributedOptimizer``
  (``place_optimizer``); imports neither Megatron nor TE. Extra ``[megatron]``.

Each one enters :func:`te_ckpt_placement.export_placement` exactly around the framework methods
that export or load optimizer state, and nowhere else: training steps never see the policy.
Resumes also keep the checkpoint off the GPU (host reads, no fake optimizer step), so a placed
resume leaves nothing on the GPU but the optimizer's own states. A framework version lacking a
method an integration must wrap raises :class:`FrameworkMethodError`; a missing optional one
warns.
"""

from ._methods import FrameworkMethodError

__all__ = ["FrameworkMethodError"]
