#!/usr/bin/env bash
# Installs the Debian packages whose real programs the tests run (promtool, prometheus,
# alertmanager, node_exporter, victoria-metrics/vmalert, slurmctld/slurmd/munged, PostgreSQL, faketime)
# when they are missing and we are root.
# Without root it says what is missing; the tests that need a program then skip with that reason.
set -euo pipefail

declare -A need=(
  [promtool]=prometheus
  [prometheus]=prometheus
  [prometheus-alertmanager]=prometheus-alertmanager
  [prometheus-node-exporter]=prometheus-node-exporter
  [victoria-metrics]=victoria-metrics
  [vmalert]=victoria-metrics
  [slurmctld]=slurmctld
  [slurmd]=slurmd
  [scontrol]=slurm-client
  [munged]=munge
  [systemd-analyze]=systemd
  [kubectl]=kubernetes-client
  [buildah]=buildah
  [debootstrap]=debootstrap
  [faketime]=faketime
)
missing=()
for bin in "${!need[@]}"; do
  command -v "$bin" >/dev/null 2>&1 || [ -x "/usr/sbin/$bin" ] || missing+=("${need[$bin]}")
done
# PostgreSQL's server programs live in a versioned directory, not on PATH.
compgen -G '/usr/lib/postgresql/*/bin/initdb' >/dev/null || missing+=(postgresql)
[ ${#missing[@]} -eq 0 ] && exit 0
pkgs=$(printf '%s\n' "${missing[@]}" | sort -u | tr '\n' ' ')
if [ "$(id -u)" -ne 0 ] || ! command -v apt-get >/dev/null 2>&1; then
  echo "note: not root or no apt-get; missing packages: $pkgs (tests needing them will skip)" >&2
  exit 0
fi
echo "installing Debian packages: $pkgs" >&2
# Keep package scripts from starting daemons: the tests start their own, on loopback, by pid.
policy=/usr/sbin/policy-rc.d
had_policy=0; [ -e "$policy" ] && had_policy=1
[ $had_policy -eq 1 ] || { printf '#!/bin/sh\nexit 101\n' > "$policy"; chmod +x "$policy"; }
trap '[ $had_policy -eq 1 ] || rm -f "$policy"' EXIT
export DEBIAN_FRONTEND=noninteractive
apt-get update -qq >/dev/null
# shellcheck disable=SC2086
apt-get install -y -qq --no-install-recommends $pkgs >/dev/null
