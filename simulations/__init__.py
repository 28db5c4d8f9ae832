"""A deterministic discrete-event simulator of real ``swim.Node`` state machines.

Layout, one concern per package (each package's docstring lists its modules):

- ``simulations.model``: the world (event loop, network, faults, invariants, metrics).
- ``simulations.experiments``: scenarios, the frontier and scaling sweeps, the heartbeat
  baseline, built on the model.
- ``simulations.reports``: markdown, CSV and plots of finished experiments.
- The command lines, at the top: ``python -m simulations.run`` (scenarios),
  ``simulations.frontier``, ``simulations.scaling``, ``simulations.params`` and
  ``simulations.demo``.

Import rule (``tests/simulations/test_layout.py``): model ← experiments ← reports ←
command lines; nothing imports a command line, and there is no import circle.
Results and the commands that produced them: ``simulations/RESULTS.md``.
"""
