#!/usr/bin/env bash
# A throwaway Slurm cluster on this machine, on loopback, for Orrery's Slurm tests:
# munged, slurmctld, N slurmd (simulated nodes with fake GPUs through GRES) and slurmrestd (JWT).
#
#   scripts/slurm-dev-cluster.sh up       # install what is missing, start; prints env lines
#   scripts/slurm-dev-cluster.sh down     # stop what this script started
#   scripts/slurm-dev-cluster.sh status
#   scripts/slurm-dev-cluster.sh token    # a fresh JWT for root
#
# Everything lives under $ORRERY_SLURM_DIR; nothing outside it is touched but /etc/hosts (one
# line, only if the host name does not resolve). Runs as root. slurmctld runs Orrery's epilog
# (clusters/adapters/slurm/orrery-epilog, copied to $ORRERY_SLURM_DIR/etc): it rings Orrery when
# a job ends once $ORRERY_SLURM_DIR/etc/orrery-epilog.conf says where. Knobs (environment):
#   ORRERY_SLURM_DIR=/tmp/orrery-slurm ORRERY_SLURM_NODES=4 ORRERY_SLURM_CPUS=8
#   ORRERY_SLURM_MEMORY_MB=64000 ORRERY_SLURM_GPUS=4 ORRERY_SLURM_GPU_TYPE=a100
#   ORRERY_SLURM_CTLD_PORT=6817 ORRERY_SLURM_SLURMD_PORT=17000 ORRERY_SLURM_REST_PORT=6820
#   ORRERY_SLURM_MAX_JOBS=10000 (jobs slurmctld holds, ended ones included, before refusing more)
set -euo pipefail

L=${ORRERY_SLURM_DIR:-/tmp/orrery-slurm}
HERE=$(cd "$(dirname "$0")" && pwd)
NODES=${ORRERY_SLURM_NODES:-4}
CPUS=${ORRERY_SLURM_CPUS:-8}
MEM=${ORRERY_SLURM_MEMORY_MB:-64000}
GPUS=${ORRERY_SLURM_GPUS:-4}
GPU_TYPE=${ORRERY_SLURM_GPU_TYPE:-a100}
CTLD_PORT=${ORRERY_SLURM_CTLD_PORT:-6817}
SLURMD_PORT=${ORRERY_SLURM_SLURMD_PORT:-17000}
REST_PORT=${ORRERY_SLURM_REST_PORT:-6820}
MAX_JOBS=${ORRERY_SLURM_MAX_JOBS:-10000}
export SLURM_CONF=$L/etc/slurm.conf
unset SLURM_JWT  # a set SLURM_JWT silently switches every Slurm client from munge to JWT

log() { echo "slurm-dev-cluster: $*" >&2; }

install() {
  local missing=()
  for tool in slurmctld slurmd slurmrestd munged scontrol sbatch; do
    command -v "$tool" >/dev/null || missing+=("$tool")
  done
  [ -e /usr/lib/x86_64-linux-gnu/slurm-wlm/auth_jwt.so ] || [ -e /usr/lib/aarch64-linux-gnu/slurm-wlm/auth_jwt.so ] \
    || missing+=(jwt-plugin)
  [ ${#missing[@]} -eq 0 ] && return
  log "installing Slurm and munge (missing: ${missing[*]})"
  apt-get update -qq >&2
  DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends \
    slurmctld slurmd slurm-client slurmrestd slurm-wlm-jwt-plugin munge >&2
}

# A daemon of ours is running when its pid file names a live process with the expected name
# (not a zombie: where nothing reaps orphans, a killed daemon lingers as one).
running() {  # pidfile comm
  [ -f "$1" ] || return 1
  local pid; pid=$(cat "$1")
  [ -r "/proc/$pid/comm" ] && [ "$(cat "/proc/$pid/comm")" = "$2" ] &&
    [ "$(cut -d' ' -f3 "/proc/$pid/stat" 2>/dev/null)" != Z ]
}

start() {  # name pidfile comm command...
  local name=$1 pidfile=$2 comm=$3; shift 3
  if running "$pidfile" "$comm"; then return; fi
  setsid "$@" >>"$L/log/$name.out" 2>&1 < /dev/null &
  echo $! > "$pidfile"
}

configure() {
  mkdir -p "$L"/{etc,state,spool,run,log,dev,munge}
  chmod 0755 "$L/munge"  # munged refuses a socket dir others cannot traverse
  for i in $(seq 0 $((GPUS - 1))); do ln -sf /dev/null "$L/dev/gpu$i"; done
  [ -f "$L/munge/munge.key" ] || { mungekey --create --keyfile="$L/munge/munge.key" 2>/dev/null \
    || dd if=/dev/urandom of="$L/munge/munge.key" bs=1024 count=1 status=none; }
  chmod 0400 "$L/munge/munge.key"
  [ -f "$L/etc/jwt_hs256.key" ] || dd if=/dev/urandom of="$L/etc/jwt_hs256.key" bs=32 count=1 status=none
  chmod 0600 "$L/etc/jwt_hs256.key"
  command install -m 0755 "$HERE/../clusters/adapters/slurm/orrery-epilog" "$L/etc/orrery-epilog"
  getent hosts "$(hostname)" >/dev/null || echo "127.0.0.1 $(hostname)" >> /etc/hosts
  local last=$((SLURMD_PORT + NODES))
  cat > "$L/etc/slurm.conf" <<CONF
ClusterName=orrerydev
SlurmctldHost=localhost
SlurmctldPort=$CTLD_PORT
SlurmdPort=$SLURMD_PORT
SlurmUser=root
SlurmdUser=root
AuthType=auth/munge
CredType=cred/munge
AuthInfo=socket=$L/munge/munge.socket.2,cred_expire=10
AuthAltTypes=auth/jwt
AuthAltParameters=jwt_key=$L/etc/jwt_hs256.key
StateSaveLocation=$L/state
SlurmdSpoolDir=$L/spool/slurmd-%n
SlurmctldPidFile=$L/run/slurmctld.pid.slurm
SlurmdPidFile=$L/run/slurmd-%n.pid.slurm
SlurmctldLogFile=$L/log/slurmctld.log
SlurmdLogFile=$L/log/slurmd-%n.log
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
AccountingStorageType=accounting_storage/none
JobAcctGatherType=jobacct_gather/none
JobCompType=jobcomp/filetxt
JobCompLoc=$L/log/jobcomp.log
EpilogSlurmctld=$L/etc/orrery-epilog
MinJobAge=600
MaxJobCount=$MAX_JOBS
MpiDefault=none
MailProg=/bin/true
SwitchType=switch/none
SchedulerType=sched/backfill
SchedulerParameters=default_queue_depth=1000,bf_interval=5,sched_min_interval=100000
SelectType=select/cons_tres
SelectTypeParameters=CR_Core_Memory
DefMemPerCPU=1024
EnforcePartLimits=ALL
KillWait=5
SlurmdTimeout=20
ReturnToService=2
SlurmdParameters=config_overrides
GresTypes=gpu
NodeName=n[1-$NODES] NodeHostname=localhost NodeAddr=127.0.0.1 Port=[$((SLURMD_PORT + 1))-$last] CPUs=$CPUS Boards=1 SocketsPerBoard=1 CoresPerSocket=$CPUS ThreadsPerCore=1 RealMemory=$MEM Gres=gpu:$GPU_TYPE:$GPUS State=UNKNOWN
PartitionName=gpu Nodes=ALL Default=YES MaxTime=INFINITE State=UP
CONF
  echo "NodeName=n[1-$NODES] Name=gpu Type=$GPU_TYPE File=$L/dev/gpu[0-$((GPUS - 1))]" > "$L/etc/gres.conf"
  echo "CgroupPlugin=cgroup/v1" > "$L/etc/cgroup.conf"
}

token() { scontrol token username=root lifespan=86400 | sed -n 's/^SLURM_JWT=//p'; }

up() {
  install
  configure
  start munged "$L/run/munged.pid" munged munged -F --key-file="$L/munge/munge.key" \
    --socket="$L/munge/munge.socket.2" --pid-file="$L/munge/munged.pid.own" --log-file="$L/munge/munged.log" \
    --seed-file="$L/munge/munged.seed" --force
  for _ in $(seq 1 50); do [ -S "$L/munge/munge.socket.2" ] && break; sleep 0.1; done
  start slurmctld "$L/run/slurmctld.pid" slurmctld slurmctld -D -f "$SLURM_CONF"
  for i in $(seq 1 "$NODES"); do
    start "slurmd-n$i" "$L/run/slurmd-n$i.pid" slurmd slurmd -D -N "n$i" -f "$SLURM_CONF"
  done
  local user=slurm; id slurm >/dev/null 2>&1 || user=nobody
  start slurmrestd "$L/run/slurmrestd.pid" slurmrestd env SLURM_JWT=daemon slurmrestd -f "$SLURM_CONF" \
    -u "$user" -g "$(id -gn "$user")" -a rest_auth/jwt -s openapi/v0.0.38,openapi/v0.0.37,openapi/v0.0.36 \
    "127.0.0.1:$REST_PORT"
  # Ready when every node responds (idle, or running jobs a previous run left) and REST answers.
  local jwt=""
  for _ in $(seq 1 $((150 + NODES * 5))); do  # 0.2 s each: 30 s, and 1 s more per node
    if [ -z "$jwt" ]; then jwt=$(token 2>/dev/null || true); fi
    if [ -n "$jwt" ] && [ -z "$(sinfo -h -N -o '%t' 2>/dev/null | grep -vx 'idle\|mix\|alloc')" ] &&
       [ -n "$(sinfo -h -N -o '%t' 2>/dev/null)" ] &&
       curl -sf -o /dev/null -H "X-SLURM-USER-NAME: root" -H "X-SLURM-USER-TOKEN: $jwt" \
         "http://127.0.0.1:$REST_PORT/slurm/v0.0.38/ping"; then
      echo "$jwt" > "$L/etc/jwt"
      chmod 0600 "$L/etc/jwt"
      log "up: $NODES nodes × $GPUS $GPU_TYPE, REST on http://127.0.0.1:$REST_PORT"
      echo "export SLURM_CONF='$SLURM_CONF'"
      echo "export ORRERY_SLURM_URL='http://127.0.0.1:$REST_PORT'"
      echo "export ORRERY_SLURM_TOKEN_FILE='$L/etc/jwt'"
      return 0
    fi
    sleep 0.2
  done
  log "not ready after $((30 + NODES)) s; see $L/log"
  return 1
}

down() {
  # Jobs first: their processes (slurmstepd and children) outlive the daemons otherwise.
  if running "$L/run/slurmctld.pid" slurmctld; then
    scancel --full --signal=KILL --state=RUNNING --partition=gpu 2>/dev/null || true
    scancel --partition=gpu 2>/dev/null || true
    for _ in $(seq 1 50); do [ -z "$(squeue -h -t R,CG 2>/dev/null)" ] && break; sleep 0.2; done
  fi
  for pidfile in "$L"/run/*.pid; do
    [ -f "$pidfile" ] || continue
    local pid; pid=$(cat "$pidfile")
    case "$(cat "/proc/$pid/comm" 2>/dev/null)" in
      munged|slurmctld|slurmd|slurmrestd|env) kill "$pid" 2>/dev/null || true ;;
    esac
    rm -f "$pidfile"
  done
  log "down"
}

status() {
  for pidfile in "$L"/run/*.pid; do
    [ -f "$pidfile" ] || continue
    local name; name=$(basename "$pidfile" .pid)
    if kill -0 "$(cat "$pidfile")" 2>/dev/null; then echo "$name running"; else echo "$name stopped"; fi
  done
  sinfo 2>/dev/null || true
}

case "${1:-}" in
  up) up ;;
  down) down ;;
  status) status ;;
  token) token ;;
  *) echo "usage: $0 up|down|status|token" >&2; exit 2 ;;
esac
