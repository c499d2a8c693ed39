"""``mode=fit`` and ``train.auto_fit``: the fastest settings that fit the memory budget.

The search is ``runner.fit.search``, the candidates ``runner.fit.space``, the estimates
``runner.fit.estimate``, the outputs ``runner.fit.command``; the ``fit.*`` schema is runner/config/fit.py.
"""
