"""What is run in the simulated world and what it hands back.

- ``harness``: parameters, building a checked and measured world, driving it, the
  scenario registry.
- ``scenarios``, ``scenarios_faults``: the named scenarios (``python -m simulations.run``).
- ``frontier``: protocol variants × network conditions, their Pareto frontier.
- ``scaling``: the frontier method across cluster sizes.
- ``heartbeat``: the all-to-all heartbeat baseline protocol the others are compared with.
- ``result``: a scenario's ``Result`` and ``Plot`` values.

Rules: imports ``simulations.model`` (and itself), never ``simulations.reports`` or a
command line; no file is written here.
"""
