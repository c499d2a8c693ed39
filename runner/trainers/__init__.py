"""Built-in trainers. Importing this package registers ``trainer=sdxl``, ``trainer=flux``,
``trainer=qwen_image`` and ``trainer=wan``."""
from runner.trainers import flux, sdxl  # noqa: F401  (imported for their register_trainer calls)
from runner.trainers import qwen_image, wan  # noqa: F401
