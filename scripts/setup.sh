#!/usr/bin/env bash
# Sets up everything the demo and the tests need, idempotently:
#   - Debian packages: serf (the interop peer), iproute2 + iptables (network-namespace tests
#     and the benchmark's packet counters), prometheus (promtool, to check our metrics),
#     systemd (systemd-analyze, to verify the unit file), prometheus-alertmanager (the
#     alert that names a dead node, fired for real), chromium (the status page, headless),
#     slurmctld + slurmd + slurm-client + munge (the Slurm drain handler and sbatch template)
#   - a virtual environment in .venv with the project (editable) and its dev tools
#   - torch==2.13.0 (the CPU build that lies on this machine's disk; an unpinned torch
#     would pull a multi-GB CUDA build)
# Set SWIM_SKIP_APT=1 to skip the apt step, SWIM_SKIP_TORCH=1 to skip torch.
set -euo pipefail
cd "$(dirname "$0")/.."

need_apt=()
for pair in serf:serf ip:iproute2 iptables:iptables promtool:prometheus systemd-analyze:systemd \
        useradd:passwd prometheus-alertmanager:prometheus-alertmanager chromium:chromium \
        slurmctld:slurmctld slurmd:slurmd scontrol:slurm-client munged:munge; do
    cmd=${pair%%:*}; pkg=${pair##*:}
    command -v "$cmd" >/dev/null 2>&1 || need_apt+=("$pkg")
done
if [[ ${#need_apt[@]} -gt 0 && -z "${SWIM_SKIP_APT:-}" ]]; then
    if [[ $(id -u) -eq 0 ]] && command -v apt-get >/dev/null 2>&1; then
        echo "setup: installing ${need_apt[*]} with apt-get" >&2
        export DEBIAN_FRONTEND=noninteractive
        apt-get update -qq >/dev/null
        apt-get install -y -qq "${need_apt[@]}" >/dev/null
    else
        echo "setup: missing ${need_apt[*]}; not root or no apt-get, tests that need them will skip" >&2
    fi
fi

PY=${PYTHON:-python3}
if [[ ! -x .venv/bin/python ]]; then
    "$PY" -m venv .venv
fi
.venv/bin/python -m pip install -q --upgrade pip >/dev/null
if [[ -z "${SWIM_SKIP_TORCH:-}" ]]; then
    .venv/bin/python -m pip install -q "torch==2.13.0"
fi
.venv/bin/python -m pip install -q -e ".[dev]"
echo "setup: ok ($(.venv/bin/python --version))" >&2
