# As in TE, importing transformer_engine.pytorch imports the optimizers and so fused_adam.
from . import optimizers  # noqa: F401
