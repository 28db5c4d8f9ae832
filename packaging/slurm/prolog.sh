#!/bin/sh
# Slurm Prolog: is this node's swim agent usable for the job about to start?
#
#   slurm.conf:  Prolog=/etc/slurm/swim-prolog.sh
#                PrologFlags=Alloc        # run it on every node at allocation, not at first srun
#
# It asks the agent (swim-slurm-check: the control socket answers, the agent sees itself
# alive and has joined the cluster) and writes one line to syslog and stderr, and to
# SWIM_SLURM_LOG if set. Slurm keeps no output of a prolog, so read syslog (or the log file).
# By default a failed check is only reported (exit 0). With SWIM_SLURM_STRICT=1 it exits 1:
# Slurm then drains the node ("Prolog error") and requeues the job, which is what you want
# once every node runs an agent. Settings come from /etc/default/swim-slurm if it exists:
#   SWIM_CONTROL=/run/swim/agent.sock   SWIM_SLURM_STRICT=1   SWIM_SLURM_LOG=/var/log/swim-slurm.log
set -a
[ -r "${SWIM_SLURM_DEFAULTS:-/etc/default/swim-slurm}" ] && . "${SWIM_SLURM_DEFAULTS:-/etc/default/swim-slurm}"
set +a
exec "${SWIM_SLURM_CHECK:-/opt/swim/bin/swim-slurm-check}" --phase prolog
