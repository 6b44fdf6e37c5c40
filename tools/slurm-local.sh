#!/usr/bin/env bash
# slurm-local.sh - a private one-node Slurm cluster (munged + slurmctld + slurmd) without systemd,
# for the tests that run `sbatch --wait` / `srun` for real. Stop it with tools/slurm-stop.sh.
#
#   eval "$(tools/slurm-local.sh)"      # its only stdout line is `export SLURM_CONF=...`
#
# Everything lives under $SLURM_LOCAL_DIR (default /tmp/miles-slurm): etc/slurm.conf, munge/, state/,
# spool/, log/, run/*.pid. Daemons run in the foreground (-D/-F) in their own session; their pids go
# to run/<name>.pid, which is all slurm-stop.sh ever signals. Idempotent: a running cluster in the
# same folder is reused. Needs root (slurmd must setuid to job owners) and Debian's packages
# slurmctld slurmd slurm-client munge (tools/install-system-deps.sh). No cgroups, no CPU pinning.
#
# Knobs: SLURM_LOCAL_DIR, SLURM_LOCAL_NODE [hostname -s], SLURM_LOCAL_ADDR [127.0.0.1],
#        SLURM_LOCAL_CPUS [max(nproc, 8); oversubscribes], SLURM_LOCAL_MEM_MB [90% of MemAvailable],
#        SLURM_LOCAL_CTLD_PORT [6817], SLURM_LOCAL_SLURMD_PORT [6818], SLURM_LOCAL_MPI_DEFAULT [none],
#        SLURM_LOCAL_TIMEOUT [60 s to wait for an idle node].
set -euo pipefail
export PATH="$PATH:/usr/sbin:/sbin"

BASE=${SLURM_LOCAL_DIR:-/tmp/miles-slurm}
CONF=$BASE/etc/slurm.conf
log() { printf '[slurm-local %s] %s\n' "$(date +%H:%M:%S)" "$*" >&2; }
die() { log "ERROR: $*"; exit 1; }

[ "$(id -u)" -eq 0 ] || die "must run as root (slurmd setuids to job owners)"
case "$BASE" in /*) ;; *) die "SLURM_LOCAL_DIR must be an absolute path" ;; esac
missing=""
for b in munged munge unmunge slurmctld slurmd sinfo scontrol sbatch srun setsid; do
  command -v "$b" >/dev/null 2>&1 || missing="$missing $b"
done
[ -z "$missing" ] || die "missing:$missing (apt-get install -y --no-install-recommends slurmctld slurmd slurm-client munge)"

NODE=${SLURM_LOCAL_NODE:-$(hostname -s 2>/dev/null || uname -n | cut -d. -f1)}
ADDR=${SLURM_LOCAL_ADDR:-127.0.0.1}
NPROC=$(nproc)
CPUS=${SLURM_LOCAL_CPUS:-$(( NPROC > 8 ? NPROC : 8 ))}
MEM_MB=${SLURM_LOCAL_MEM_MB:-$(( $(awk '/^MemAvailable:/{print int($2/1024)}' /proc/meminfo) * 9 / 10 ))}
CTLD_PORT=${SLURM_LOCAL_CTLD_PORT:-6817}
SLURMD_PORT=${SLURM_LOCAL_SLURMD_PORT:-6818}
TIMEOUT=${SLURM_LOCAL_TIMEOUT:-60}
SOCK=$BASE/munge/munge.socket.2
KEY=$BASE/munge/munge.key
if id -u munge >/dev/null 2>&1; then MUNGE_USER=munge; else MUNGE_USER=root; fi

mkdir -p "$BASE"/{etc,state,spool/slurmd,log,run,munge}
touch "$BASE/.slurm-local"          # slurm-stop.sh --purge deletes only marked folders
chmod 755 "$BASE" "$BASE/munge"     # munged wants an o+x, not group/other-writable socket dir

exe_of() { readlink -f "$(command -v "$1")"; }
# alive NAME: our pid file (or the daemon's own, same folder) names a live process of NAME's binary
alive() {
  local f pid st
  for f in "$BASE/run/$1.pid" "$BASE/run/$1.daemon.pid" "$BASE/munge/$1.pid"; do
    [ -s "$f" ] || continue
    pid=$(head -n1 "$f" | tr -dc 0-9); [ -n "$pid" ] || continue
    st=$(awk '{print $3}' "/proc/$pid/stat" 2>/dev/null) || continue
    case "$st" in Z|X) continue ;; esac
    [ "$(readlink -f "/proc/$pid/exe" 2>/dev/null)" = "$(exe_of "$1")" ] || continue
    [ "$f" = "$BASE/run/$1.pid" ] || echo "$pid" >"$BASE/run/$1.pid"
    return 0
  done
  return 1
}
launch() {  # launch NAME CMD...: own session, no stdio of ours; $! is the daemon itself (exec chain)
  local name=$1; shift
  ( cd / && exec setsid "$@" ) </dev/null >>"$BASE/log/$name.out" 2>&1 &
  echo $! >"$BASE/run/$name.pid"
  log "started $name pid $!"
}
wait_for() {  # wait_for SECONDS CMD...
  local end=$(( $(date +%s) + $1 )); shift
  until "$@" >/dev/null 2>&1; do [ "$(date +%s)" -lt "$end" ] || return 1; sleep 0.2; done
}
port_busy() { (exec 3<>"/dev/tcp/127.0.0.1/$1") 2>/dev/null; }
show_logs() { for f in "$BASE"/log/*; do [ -f "$f" ] && { echo "==> $f" >&2; tail -n 15 "$f" >&2; }; done; }

# ---------------------------------------------------------------- munge
munge_ok() { munge -n --socket="$SOCK" | unmunge --socket="$SOCK" >/dev/null; }
if ! alive munged; then
  [ -s "$KEY" ] || dd if=/dev/urandom of="$KEY" bs=1024 count=1 status=none
  chown -R "$MUNGE_USER:" "$BASE/munge"; chmod 600 "$KEY"
  rm -f "$SOCK" "$SOCK.lock"
  args=(munged -F --key-file="$KEY" --socket="$SOCK" --pid-file="$BASE/munge/munged.pid"
        --log-file="$BASE/munge/munged.log" --seed-file="$BASE/munge/munged.seed")
  if [ "$MUNGE_USER" = root ]; then launch munged "${args[@]}"
  else launch munged setpriv --reuid="$MUNGE_USER" --regid="$MUNGE_USER" --init-groups "${args[@]}"; fi
fi
wait_for 15 munge_ok || { show_logs; die "munged did not come up on $SOCK"; }

# ---------------------------------------------------------------- config + daemons
CTLD_UP=0; SLURMD_UP=0
alive slurmctld && CTLD_UP=1
alive slurmd && SLURMD_UP=1
if [ "$CTLD_UP" = 0 ] && [ "$SLURMD_UP" = 0 ]; then
  cat >"$CONF" <<EOF
# written by tools/slurm-local.sh: a private one-node cluster for tests
ClusterName=miles
SlurmctldHost=$NODE($ADDR)
SlurmctldPort=$CTLD_PORT
SlurmdPort=$SLURMD_PORT
SlurmUser=root
SlurmdUser=root
AuthType=auth/munge
CredType=cred/munge
AuthInfo=socket=$SOCK
StateSaveLocation=$BASE/state
SlurmdSpoolDir=$BASE/spool/slurmd
SlurmctldPidFile=$BASE/run/slurmctld.daemon.pid
SlurmdPidFile=$BASE/run/slurmd.daemon.pid
SlurmctldLogFile=$BASE/log/slurmctld.log
SlurmdLogFile=$BASE/log/slurmd.log
MailProg=/bin/true
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
JobAcctGatherType=jobacct_gather/none
AccountingStorageType=accounting_storage/none
JobCompType=jobcomp/none
SwitchType=switch/none
MpiDefault=${SLURM_LOCAL_MPI_DEFAULT:-none}
SelectType=select/cons_tres
SelectTypeParameters=CR_CPU
SchedulerType=sched/backfill
SchedulerParameters=batch_sched_delay=0
SlurmdParameters=config_overrides
ReturnToService=2
MinJobAge=5
KillWait=5
InactiveLimit=0
SlurmdTimeout=300
NodeName=$NODE NodeHostname=$NODE NodeAddr=$ADDR CPUs=$CPUS RealMemory=$MEM_MB State=UNKNOWN
PartitionName=debug Nodes=$NODE Default=YES MaxTime=INFINITE OverSubscribe=YES State=UP
EOF
  log "wrote $CONF (node $NODE, $CPUS CPUs on $NPROC cores, ports $CTLD_PORT/$SLURMD_PORT)"
fi
export SLURM_CONF=$CONF
if [ "$CTLD_UP" = 0 ]; then
  port_busy "$CTLD_PORT" && die "port $CTLD_PORT is in use; set SLURM_LOCAL_CTLD_PORT"
  launch slurmctld slurmctld -D -c -f "$CONF"
fi
wait_for 30 scontrol ping || { show_logs; die "slurmctld does not answer 'scontrol ping'"; }
if [ "$SLURMD_UP" = 0 ]; then
  port_busy "$SLURMD_PORT" && die "port $SLURMD_PORT is in use; set SLURM_LOCAL_SLURMD_PORT"
  launch slurmd slurmd -D -f "$CONF" -N "$NODE"
fi

# ---------------------------------------------------------------- wait for an idle node
end=$(( $(date +%s) + TIMEOUT )); resumed=0
while :; do
  state=$(sinfo -h -N -n "$NODE" -o '%T' 2>/dev/null | head -n1)
  case "$state" in
    idle|mixed|allocated|completing) break ;;
    *drain*|down*) [ "$resumed" = 0 ] && { scontrol update NodeName="$NODE" State=RESUME >/dev/null 2>&1 || true; resumed=1; } ;;
  esac
  for d in munged slurmctld slurmd; do alive "$d" || { show_logs; die "$d exited during start-up"; }; done
  [ "$(date +%s)" -lt "$end" ] || { show_logs; die "node $NODE not usable after ${TIMEOUT}s (state '$state')"; }
  sleep 0.2
done
echo "export SLURM_CONF=$CONF" >"$BASE/env.sh"
log "cluster ready: node $NODE is $state (stop: SLURM_LOCAL_DIR=$BASE tools/slurm-stop.sh)"
echo "export SLURM_CONF=$CONF"
