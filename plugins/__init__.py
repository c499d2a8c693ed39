"""Built-in plugins. Importing this package declares every one of them (see runner.registry).

Declared, not imported: each plugin's schema, description and setting checks come from
``runner.plugins.schemas`` (no torch), and its module (``park.py``, ``stream/`` ...) is imported
when a run builds it. A new built-in plugin adds its schema and a ``BuiltinPlugin`` line there.
"""
from runner.plugins.schemas import BUILTINS
from runner.registry import declare_plugin

for _p in BUILTINS:
    declare_plugin(_p.kind, _p.name, _p.config, _p.target, _p.description, _p.check)
del _p
