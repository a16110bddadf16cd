"""A fake Transformer Engine: just enough package for te_ckpt_placement's adapter tests."""

__version__ = "2.20.2+fake.te.adapter.test"
