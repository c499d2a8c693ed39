"""``mode=fit`` and ``train.auto_fit``: the fastest settings that fit the memory budget.

Kept free of imports here: runner/config/__init__.py imports ``runner.fit.config`` for the schema, long
before anything heavy is loaded. The search is ``runner.fit.search``, the candidates
``runner.fit.space``, the estimates ``runner.fit.estimate``, the outputs ``runner.fit.output``.
"""
