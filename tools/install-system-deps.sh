#!/usr/bin/env bash
# Debian packages the suite uses for real: Open MPI (mpirun) and a one-node Slurm cluster.
# Skips (saying so) where there is no apt-get or no root; the tests that need them then skip too.
set -euo pipefail
pkgs=(openmpi-bin libopenmpi-dev slurmctld slurmd slurm-client munge)
missing=()
for p in "${pkgs[@]}"; do dpkg -s "$p" >/dev/null 2>&1 || missing+=("$p"); done
[ ${#missing[@]} -eq 0 ] && exit 0
if ! command -v apt-get >/dev/null 2>&1 || [ "$(id -u)" -ne 0 ]; then
  echo "install-system-deps: not root or no apt-get; MPI/Slurm tests will skip (missing: ${missing[*]})" >&2
  exit 0
fi
echo "install-system-deps: apt-get install ${missing[*]}" >&2
export DEBIAN_FRONTEND=noninteractive
apt-get update -qq </dev/null
apt-get install -y -qq --no-install-recommends "${missing[@]}" </dev/null >/dev/null
