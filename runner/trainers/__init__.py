"""Built-in trainers. Importing this package registers ``trainer=sdxl``, ``flux``, ``sd15`` and ``sd35``."""
from runner.trainers import flux, sd15, sd35, sdxl  # noqa: F401  (imported for their register_trainer calls)
