#!/bin/sh
# Slurm Epilog: is this node's swim agent still well after the job? (A job that starved,
# OOM-killed or stopped it shows up here, on the node and job that did it.)
#
#   slurm.conf:  Epilog=/etc/slurm/swim-epilog.sh
#
# Same check as prolog.sh (swim-slurm-check): one line to syslog and stderr, and to
# SWIM_SLURM_LOG if set. A failed check is only reported (exit 0) unless
# SWIM_SLURM_STRICT=1, where it exits 1 and Slurm drains the node ("Epilog error").
# Settings come from /etc/default/swim-slurm if it exists (see prolog.sh).
set -a
[ -r "${SWIM_SLURM_DEFAULTS:-/etc/default/swim-slurm}" ] && . "${SWIM_SLURM_DEFAULTS:-/etc/default/swim-slurm}"
set +a
exec "${SWIM_SLURM_CHECK:-/opt/swim/bin/swim-slurm-check}" --phase epilog
