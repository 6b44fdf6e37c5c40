#!/usr/bin/env bash
# slurm-stop.sh - stop the private cluster that tools/slurm-local.sh started in $SLURM_LOCAL_DIR.
#
# Cancels the cluster's jobs first, then signals only the pids recorded in $SLURM_LOCAL_DIR/run
# (checked against /proc/<pid>/exe, so a reused pid is never hit). Safe to run twice.
#   slurm-stop.sh           stop; keep the folder (config, logs)
#   slurm-stop.sh --purge   ...and delete the folder (only if it carries the .slurm-local marker)
set -uo pipefail
export PATH="$PATH:/usr/sbin:/sbin"
BASE=${SLURM_LOCAL_DIR:-/tmp/miles-slurm}
CONF=$BASE/etc/slurm.conf
PURGE=0
[ "${1:-}" = --purge ] && PURGE=1
log() { printf '[slurm-stop %s] %s\n' "$(date +%H:%M:%S)" "$*" >&2; }

pid_of() {  # pid_of NAME: a live pid from our pid files running NAME's binary
  local f pid st want
  want=$(readlink -f "$(command -v "$1" 2>/dev/null)" 2>/dev/null) || return 1
  for f in "$BASE/run/$1.pid" "$BASE/run/$1.daemon.pid" "$BASE/munge/$1.pid"; do
    [ -s "$f" ] || continue
    pid=$(head -n1 "$f" | tr -dc 0-9); [ -n "$pid" ] || continue
    st=$(awk '{print $3}' "/proc/$pid/stat" 2>/dev/null) || continue
    case "$st" in Z|X) continue ;; esac
    [ "$(readlink -f "/proc/$pid/exe" 2>/dev/null)" = "$want" ] || continue
    echo "$pid"; return 0
  done
  return 1
}
stop_one() {  # stop_one NAME GRACE_SECONDS
  local pid i st
  pid=$(pid_of "$1") || { rm -f "$BASE/run/$1.pid" "$BASE/run/$1.daemon.pid"; return 0; }
  log "$1: SIGTERM $pid"
  kill -TERM "$pid" 2>/dev/null
  for ((i = 0; i < $2 * 10; i++)); do
    st=$(awk '{print $3}' "/proc/$pid/stat" 2>/dev/null) || break
    { [ "$st" = Z ] || [ "$st" = X ]; } && break
    sleep 0.1
  done
  if pid_of "$1" >/dev/null; then log "$1: SIGKILL $pid"; kill -KILL "$pid" 2>/dev/null; sleep 0.3; fi
  rm -f "$BASE/run/$1.pid" "$BASE/run/$1.daemon.pid"
}

if [ -d "$BASE/run" ]; then
  if pid_of slurmctld >/dev/null && [ -s "$CONF" ]; then
    export SLURM_CONF=$CONF
    jobs=$(timeout 10 squeue -h -o '%i' 2>/dev/null | tr '\n' ' ')
    if [ -n "${jobs// /}" ]; then
      log "cancelling jobs: $jobs"
      # shellcheck disable=SC2086
      timeout 10 scancel $jobs 2>/dev/null
      for ((i = 0; i < 150; i++)); do [ -z "$(timeout 5 squeue -h -o '%i' 2>/dev/null)" ] && break; sleep 0.1; done
    fi
  fi
  stop_one slurmd 15
  stop_one slurmctld 15
  stop_one munged 10
  rm -f "$BASE/munge/munge.socket.2" "$BASE/munge/munge.socket.2.lock"
  log "stopped ($BASE kept)"
fi
if [ "$PURGE" = 1 ] && [ -f "$BASE/.slurm-local" ] && [ "$BASE" != / ]; then
  rm -rf -- "$BASE" && log "purged $BASE"
fi
exit 0
