"""The simulated world: real ``swim.Node`` state machines on a virtual clock.

- ``world``: the world a scenario drives: topology, commands (crash, restart, join,
  leave, slow down), the event loop, routing of packets; ``world_streams``: its streams
  (dial, serve, reply, timeouts).
- ``calendar``: the event queue; ``trace``: the trace hash; ``streams``: what the two
  ends of a stream read; ``faults``: slow members.
- ``network``: latency distributions, loss, bursts, duplication, reordering, partitions.
- ``world_types``: the event kinds, traffic counters and the listener protocols.
- ``gc_tuning``: garbage-collector settings the command lines use for long runs.
- ``invariants``: SWIM's invariants checked after every input.
- ``metrics``: what is measured while a world runs (detections, false positives,
  dissemination, load); ``views``: what the members see (agreement, one member's state).

Rules: imports only the standard library, ``swim`` and ``phi`` (and itself); nothing here
knows a scenario or writes a file.
"""
