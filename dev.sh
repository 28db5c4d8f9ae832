#!/usr/bin/env bash
# One entry point for newcomers and CI.
#   ./dev.sh demo    set up, then run the local cluster demo (real agent processes)
#   ./dev.sh simdemo the protocol core alone on a simulated network (virtual clock)
#   ./dev.sh test    set up, then run lint, type checks and the whole test suite
#   ./dev.sh lint    ruff + mypy only
set -euo pipefail
cd "$(dirname "$0")"
cmd=${1:-test}; shift || true
case "$cmd" in
    setup) scripts/setup.sh ;;
    demo)
        scripts/setup.sh
        exec .venv/bin/swimctl demo "$@"
        ;;
    simdemo)
        exec .venv/bin/python -m simulations.demo "$@"
        ;;
    lint)
        .venv/bin/ruff check .
        .venv/bin/ruff format --check .
        .venv/bin/mypy
        ;;
    test)
        scripts/setup.sh
        .venv/bin/ruff check .
        .venv/bin/ruff format --check .
        .venv/bin/mypy
        exec .venv/bin/python -m pytest -q --durations=30 "$@"
        ;;
    bench)
        scripts/setup.sh
        .venv/bin/python -m bench.compare_serf "$@"
        exec .venv/bin/python -m bench.render
        ;;
    *) echo "usage: $0 demo|simdemo|test|lint|bench|setup" >&2; exit 2 ;;
esac
