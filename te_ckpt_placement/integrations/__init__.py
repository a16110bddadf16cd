"""Trainer integrations: the export policy around a framework's optimizer-state saves and loads.

One thin module per framework, each imported only when used (``import
te_ckpt_placement.integrations`` imports no framework):

- :mod:`te_ckpt_placement.integrations.hf`: Hugging Face Transformers ``Trainer``
  (``PlacementTrainerMixin``, ``PlacementTrainer``, ``place_trainer``). Extra ``[hf]``.
- :mod:`te_ckpt_placement.integrations.lightning`: Lightning ``Trainer``
  (``PlacementCallback``, ``PlacementStrategyMixin``, ``place_strategy``). Extra ``[lightning]``.
- :mod:`te_ckpt_placement.integrations.automodel`: YAML-configured NeMo Automodel recipes
  (``PlacementRecipeMixin``, ``placement_recipe``); imports ``nemo_automodel`` only when a
  ready-made recipe class is asked for.
- :mod:`te_ckpt_placement.integrations.megatron`: Megatron-Core's ``DistributedOptimizer``
  (``place_optimizer``); imports neither Megatron nor TE. Extra ``[megatron]``.

Each one enters :func:`te_ckpt_placement.export_placement` exactly around the framework method
that exports or loads optimizer state, and nowhere else: training steps never see the policy.
"""
