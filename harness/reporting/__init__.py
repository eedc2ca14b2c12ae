"""Reading results folders back: the pieces behind ``python -m harness.report`` and
``python -m harness.gate``.

- :mod:`harness.reporting.runs`: find run folders, load them, name them by their config;
- :mod:`harness.reporting.table`: the comparison table with ratios to a baseline backend;
- :mod:`harness.reporting.plots`: the PNG figures;
- :mod:`harness.reporting.baseline`: the gate's baseline file, taken from runs.
"""
