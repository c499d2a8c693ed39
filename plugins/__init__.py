"""Built-in plugins. Importing this package registers every one of them (see runner.registry).

Keep this a plain, explicit import list: one module per plugin file.
"""
from plugins import none, allocator, checkpoint  # noqa: F401
