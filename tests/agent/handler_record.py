"""An event handler that records what it was given: one JSON line per run appended to the
file named by its first argument (the environment's SERF_* and SWIM_* variables, and
stdin). Used by tests/agent/test_handlers.py with both a real ``serf agent`` and ours."""

import json
import os
import sys

record = {
    "env": {k: v for k, v in os.environ.items() if k.startswith(("SERF_", "SWIM_"))},
    "stdin": sys.stdin.read(),
}
with open(sys.argv[1], "a", encoding="utf-8") as out:
    out.write(json.dumps(record, sort_keys=True) + "\n")
