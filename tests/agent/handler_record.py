"""An event handler that records what it was given: one JSON line per run appended to the
file named by its first argument (the environment's SERF_* and SWIM_* variables, and
stdin); a query is answered with a line naming this node. Used by
tests/agent/test_handlers.py with both a real ``serf agent`` and ours."""

import json
import os
import sys

env = {k: v for k, v in os.environ.items() if k.startswith(("SERF_", "SWIM_"))}
stdin = sys.stdin.read()
record = {"env": env, "stdin": stdin}
with open(sys.argv[1], "a", encoding="utf-8") as out:
    out.write(json.dumps(record, sort_keys=True) + "\n")
if env.get("SERF_EVENT") == "query":  # a query's answer is the handler's output
    print(f"pong from {env['SERF_SELF_NAME']}: {stdin.strip()}")
