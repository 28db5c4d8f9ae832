"""The simulated world: real ``swim.Node`` state machines on a virtual clock.

- ``world``: the event loop, the topology and the commands a scenario gives (crash,
  restart, join, leave, slow down); the trace hash.
- ``network``: latency distributions, loss, bursts, duplication, reordering, partitions.
- ``world_types``: value types (slow-member specs, traffic counters, listener protocols).
- ``invariants``: SWIM's invariants checked after every input.
- ``metrics``: what is measured while a world runs (detections, false positives,
  dissemination, load).

Rules: imports only the standard library, ``swim`` and ``phi`` (and itself); nothing here
knows a scenario or writes a file.
"""
