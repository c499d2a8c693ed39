"""Built-in plugins. Importing this package registers every one of them (see runner.registry).

Keep this a plain, explicit import list: one module per plugin file.
"""
from runner.plugins import allocator, checkpoint  # noqa: F401
from runner.plugins import park, tiling  # noqa: F401  (offload=park; tiling=vae|attention)
from runner.plugins import bnb_quant, fp8  # noqa: F401  (quantization=nf4|int8; quantization=fp8)
from runner.plugins import stream, offload_activations, offload_optimizer  # noqa: F401  (offload=stream|activations|optimizer)
