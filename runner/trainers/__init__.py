"""Built-in trainers. Importing this package registers ``trainer=sdxl`` and ``trainer=flux``."""
from runner.trainers import flux, sdxl  # noqa: F401  (imported for their register_trainer calls)
