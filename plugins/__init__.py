"""Built-in plugins. Importing this package registers every one of them (see runner.registry).

Keep this a plain, explicit import list: one module per plugin file.
"""
from plugins import none, allocator, checkpoint  # noqa: F401
from plugins import park, tiling  # noqa: F401  (offload=park; tiling=vae|attention)
from plugins import bnb_quant, fp8  # noqa: F401  (quantization=nf4|int8; quantization=fp8)
from plugins import stream, offload_activations, offload_optimizer  # noqa: F401  (offload=stream|activations|optimizer)
