#!/bin/sh
# slurm.conf: HealthCheckProgram=/etc/slurm/vigil-healthcheck.sh (docs/slurm.md "vigil check").
# slurmd runs it as root, with an empty environment but SLURMD_NODENAME, every
# HealthCheckInterval, and kills it after 60 s: --timeout 40 leaves time for the drain.
# Exit codes (0 healthy, 1 unhealthy, 2 cannot judge) go to slurmd's log; the drain on a failure,
# and the undrain of vigil check's own drain on a pass, are --drain's.
# slurmd starts the program every interval whether or not the last run ended: flock -n makes a
# run that finds the previous one still going exit 0 at once (no verdict, nothing changed), so
# checks never pile up on a busy node.
PATH=/usr/bin:/usr/sbin:/bin:/sbin
export PATH
exec flock -n /run/vigil-check.lock /opt/vigil/bin/vigil check --drain --quick --timeout 40 \
    --node "${SLURMD_NODENAME:-$(hostname -s)}" \
    --config /etc/vigil/agent.yml --baselines /etc/vigil/probe-baselines.yml \
    --json /var/lib/vigil/check.json
