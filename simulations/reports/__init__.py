"""How finished experiments are written: markdown summaries, CSV tables, PNG plots.

- ``files``: number formatting, CSV written and read back, plots (matplotlib, optional).
- ``scenario``: a scenario's ``Result``.
- ``frontier``, ``scaling``: the sweeps' tables, summaries and plots.
- ``params``: the operator's parameter table (computed from ``swim``'s formulas, and
  measured from a scaling result directory).

Rules: reads finished results (``simulations.experiments``); runs no world.
"""
