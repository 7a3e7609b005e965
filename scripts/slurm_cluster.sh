#!/usr/bin/env bash
# A one-node SLURM cluster on this machine, for the SLURM launcher tests (tests/test_slurm.py)
# and for trying `fedbench -m hydra/launcher=slurm ...` without a real cluster.
#
#   scripts/slurm_cluster.sh [start]   install (Debian: slurm-wlm, munge, slurmdbd, mariadb) if
#                                      missing, write the configs, start the daemons, wait
#                                      until the node is idle; prints one line. Idempotent.
#   scripts/slurm_cluster.sh stop      cancel the jobs, stop the daemons this script started
#   scripts/slurm_cluster.sh status    one line: up (node state) or down; exit 0 when up
#
# No systemd: the daemons are started directly and keep running in the background (their
# pid files are in /run/slurm). Root only (it installs packages and writes /etc/slurm).
#
# Accounting: submitit (Hydra's SLURM launcher) learns a job's state from `sacct`; without
# accounting a job that ends without a result (killed, scancel'ed, out of memory) leaves the
# submitting `fedbench -m` waiting forever. So the cluster runs slurmdbd on a private MariaDB
# (own data directory, 127.0.0.1:$DB_PORT) unless SLURM_CLUSTER_ACCOUNTING=0.
#
# Environment: SLURM_CLUSTER_ACCOUNTING (1), SLURM_CLUSTER_TIMEOUT (seconds to wait for the
# node, 60), SLURM_CLUSTER_DB_PORT (3307).
set -euo pipefail

ACCOUNTING="${SLURM_CLUSTER_ACCOUNTING:-1}"
TIMEOUT="${SLURM_CLUSTER_TIMEOUT:-60}"
DB_PORT="${SLURM_CLUSTER_DB_PORT:-3307}"

CLUSTER=fedbench
PARTITION=debug
ETC=/etc/slurm
CONF="$ETC/slurm.conf"
DBD_CONF="$ETC/slurmdbd.conf"
RUN=/run/slurm
LOG=/var/log/slurm
CTLD_SPOOL=/var/spool/slurmctld
SLURMD_SPOOL=/var/spool/slurmd
DB_DIR=/var/lib/slurm-mariadb
DB_RUN=/run/slurm-mariadb
DB_SOCK="$DB_RUN/mysqld.sock"
DB_PASS_FILE="$ETC/.slurmdbd-db-password"
MUNGE_KEY=/etc/munge/munge.key
MUNGE_PID=/run/munge/munged.pid
MUNGE_LOG=/var/log/munge/munged.log
PACKAGES=(slurm-wlm munge)
[[ "$ACCOUNTING" == 1 ]] && PACKAGES+=(slurmdbd mariadb-server)

NODE="$(hostname -s)"
STARTED=$SECONDS

say() { echo "slurm_cluster: $*"; }

# fail WHAT [LOGFILE...]: what failed and the tail of each log, then exit 1.
fail() {
  local what="$1"
  shift
  echo "slurm_cluster: FAILED: $what" >&2
  sleep 0.5 # a daemon that just exited may still be writing its log
  local f
  for f in "$@"; do
    if [[ -s "$f" ]]; then
      echo "----- last lines of $f -----" >&2
      # (without the PMIx library every daemon logs 3 harmless mpi/pmix errors at start)
      grep -v -e "mpi/pmix" -e "mpi_pmix" -e "MPI: Cannot create context" "$f" | tail -n 25 >&2
    else
      echo "----- $f: missing or empty -----" >&2
    fi
  done
  exit 1
}

need_root() {
  [[ "$(id -u)" == 0 ]] || { echo "slurm_cluster: run as root (it installs packages and writes $ETC)" >&2; exit 1; }
}

# alive PIDFILE: the pid file names a running process.
alive() {
  local pid
  [[ -s "$1" ]] || return 1
  pid="$(cat "$1" 2>/dev/null)" || return 1
  [[ "$pid" =~ ^[0-9]+$ ]] && kill -0 "$pid" 2>/dev/null
}

# died PIDFILE: the daemon wrote its pid file and is gone, or has not written it within
# 15 s of starting (a daemon writes it after forking, a moment after its command returned).
died() {
  if [[ -s "$1" ]]; then
    if alive "$1"; then return 1; fi
    return 0
  else
    ((SECONDS - STARTED > 15))
  fi
}

# stop_pids PIDFILE...: TERM the processes in the pid files together, wait up to 20 s for
# them to exit, then KILL what is left.
stop_pids() {
  local file pid pids=() left
  for file in "$@"; do
    if alive "$file"; then
      pid="$(cat "$file")"
      kill -TERM "$pid" 2>/dev/null || true
      pids+=("$pid")
    fi
  done
  for _ in $(seq 1 200); do
    left=0
    for pid in "${pids[@]}"; do
      kill -0 "$pid" 2>/dev/null && left=1
    done
    ((left)) || break
    sleep 0.1
  done
  for pid in "${pids[@]}"; do
    if kill -0 "$pid" 2>/dev/null; then
      say "pid $pid ($(cat "/proc/$pid/comm" 2>/dev/null)) ignored SIGTERM for 20 s: SIGKILL"
      kill -KILL "$pid" 2>/dev/null || true
    fi
  done
  rm -f "$@"
}

install_packages() {
  local missing=() p
  for p in "${PACKAGES[@]}"; do
    dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed" || missing+=("$p")
  done
  [[ ${#missing[@]} -eq 0 ]] && return 0
  say "installing ${missing[*]}"
  local log=/tmp/slurm_cluster-apt.log
  {
    apt-get update -qq &&
      DEBIAN_FRONTEND=noninteractive apt-get install -y -q --no-install-recommends "${missing[@]}"
  } >"$log" 2>&1 || fail "apt-get install ${missing[*]}" "$log"
}

# The node's line: the topology slurmd detects (when it agrees with nproc), RealMemory 95% of
# the machine's so that slurmd never finds less than configured.
node_line() {
  local detected cpus mem_mb real
  cpus="$(nproc)"
  detected="$(slurmd -C 2>/dev/null | head -n 1)" || detected=""
  mem_mb="$(awk '/^MemTotal:/ {print int($2 / 1024)}' /proc/meminfo)"
  real=$((mem_mb * 95 / 100))
  if [[ "$detected" =~ CPUs=([0-9]+)\ (Boards=.*ThreadsPerCore=[0-9]+) ]] &&
    [[ "${BASH_REMATCH[1]}" == "$cpus" ]]; then
    echo "NodeName=$NODE NodeAddr=127.0.0.1 CPUs=$cpus ${BASH_REMATCH[2]} RealMemory=$real State=UNKNOWN"
  else
    echo "NodeName=$NODE NodeAddr=127.0.0.1 CPUs=$cpus RealMemory=$real State=UNKNOWN"
  fi
}

slurm_conf() {
  cat <<EOF
# Written by fedbench's scripts/slurm_cluster.sh: a one-node cluster on $NODE.
ClusterName=$CLUSTER
SlurmctldHost=$NODE(127.0.0.1)
SlurmUser=slurm
SlurmctldPort=6817
SlurmdPort=6818
AuthType=auth/munge
CredType=cred/munge
MpiDefault=none
StateSaveLocation=$CTLD_SPOOL
SlurmdSpoolDir=$SLURMD_SPOOL
SlurmctldPidFile=$RUN/slurmctld.pid
SlurmdPidFile=$RUN/slurmd.pid
SlurmctldLogFile=$LOG/slurmctld.log
SlurmdLogFile=$LOG/slurmd.log
SlurmctldDebug=info
SlurmdDebug=info
# no cgroups: processes are tracked by their parent ids, tasks are not bound
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
JobAcctGatherType=jobacct_gather/none
# cores are the consumable resource: two 1-CPU jobs run at once on a 2-core node
SelectType=select/cons_tres
SelectTypeParameters=CR_Core
SchedulerType=sched/backfill
ReturnToService=2
SlurmdTimeout=60
InactiveLimit=0
KillWait=30
MinJobAge=300
$(if [[ "$ACCOUNTING" == 1 ]]; then
    echo "AccountingStorageType=accounting_storage/slurmdbd"
    echo "AccountingStorageHost=127.0.0.1"
  else
    echo "AccountingStorageType=accounting_storage/none"
  fi)
JobCompType=jobcomp/none
MailProg=/bin/true
$(node_line)
PartitionName=$PARTITION Nodes=$NODE Default=YES MaxTime=INFINITE State=UP
EOF
}

slurmdbd_conf() {
  cat <<EOF
# Written by fedbench's scripts/slurm_cluster.sh
AuthType=auth/munge
DbdHost=$NODE
DbdAddr=127.0.0.1
DbdPort=6819
SlurmUser=slurm
PidFile=$RUN/slurmdbd.pid
LogFile=$LOG/slurmdbd.log
DebugLevel=info
StorageType=accounting_storage/mysql
StorageHost=127.0.0.1
StoragePort=$DB_PORT
StorageUser=slurm
StoragePass=$1
StorageLoc=slurm_acct_db
EOF
}

# write_if_changed FILE MODE OWNER < content: 0 when FILE changed.
write_if_changed() {
  local file="$1" mode="$2" owner="$3" tmp
  tmp="$(mktemp)"
  cat >"$tmp"
  if [[ -f "$file" ]] && cmp -s "$tmp" "$file"; then
    rm -f "$tmp"
    return 1
  fi
  install -m "$mode" -o "${owner%:*}" -g "${owner#*:}" "$tmp" "$file"
  rm -f "$tmp"
  return 0
}

prepare_dirs() {
  install -d -m 755 -o slurm -g slurm "$RUN" "$LOG" "$CTLD_SPOOL"
  install -d -m 755 -o root -g root "$SLURMD_SPOOL" "$ETC"
  install -d -m 700 -o munge -g munge /etc/munge
  install -d -m 755 -o munge -g munge /run/munge /var/log/munge /var/lib/munge
}

munge_key() {
  if [[ ! -s "$MUNGE_KEY" ]]; then
    say "creating $MUNGE_KEY"
    if command -v mungekey >/dev/null; then
      mungekey --create --keyfile="$MUNGE_KEY" --force
    else
      dd if=/dev/urandom of="$MUNGE_KEY" bs=1 count=1024 status=none
    fi
  fi
  chown munge:munge "$MUNGE_KEY"
  chmod 400 "$MUNGE_KEY"
}

start_munge() {
  if ! alive "$MUNGE_PID"; then
    runuser -u munge -- /usr/sbin/munged --pid-file="$MUNGE_PID" --log-file="$MUNGE_LOG" \
      >/tmp/slurm_cluster-munged.out 2>&1 ||
      fail "munged did not start" /tmp/slurm_cluster-munged.out "$MUNGE_LOG"
  fi
  munge -n </dev/null | unmunge >/dev/null 2>&1 || fail "munge -n | unmunge (munged does not answer)" "$MUNGE_LOG"
}

db_password() {
  if [[ ! -s "$DB_PASS_FILE" ]]; then
    (umask 077 && head -c 18 /dev/urandom | base64 | tr -d '/+=' >"$DB_PASS_FILE")
  fi
  cat "$DB_PASS_FILE"
}

start_mariadb() {
  local errlog="$LOG/mariadb.log"
  # its own tmpdir: /tmp is not always writable by the mysql user (0755 here)
  install -d -m 750 -o mysql -g mysql "$DB_DIR" "$DB_DIR-tmp"
  install -d -m 755 -o mysql -g mysql "$DB_RUN"
  if [[ ! -d "$DB_DIR/mysql" ]]; then
    say "initialising MariaDB in $DB_DIR"
    rm -rf "${DB_DIR:?}"/* # a failed earlier attempt
    mariadb-install-db --no-defaults --user=mysql --datadir="$DB_DIR" --tmpdir="$DB_DIR-tmp" --skip-test-db \
      --auth-root-authentication-method=socket >"$LOG/mariadb-install.log" 2>&1 ||
      fail "mariadb-install-db" "$LOG/mariadb-install.log"
  fi
  touch "$errlog" && chown mysql:mysql "$errlog"
  if ! alive "$DB_RUN/mariadb.pid"; then
    setsid /usr/sbin/mariadbd --no-defaults --user=mysql --datadir="$DB_DIR" \
      --tmpdir="$DB_DIR-tmp" --socket="$DB_SOCK" --pid-file="$DB_RUN/mariadb.pid" \
      --bind-address=127.0.0.1 --port="$DB_PORT" --log-error="$errlog" \
      --innodb-buffer-pool-size=256M --innodb-lock-wait-timeout=900 </dev/null >/dev/null 2>&1 &
    local pid=$!
    for _ in $(seq 1 300); do
      mariadb-admin --socket="$DB_SOCK" ping >/dev/null 2>&1 && break
      kill -0 "$pid" 2>/dev/null || break
      sleep 0.1
    done
  fi
  mariadb-admin --socket="$DB_SOCK" ping >/dev/null 2>&1 || fail "MariaDB does not answer on $DB_SOCK" "$errlog"
  local pass
  pass="$(db_password)"
  mariadb --socket="$DB_SOCK" -e "
    CREATE USER IF NOT EXISTS 'slurm'@'127.0.0.1' IDENTIFIED BY '$pass';
    ALTER USER 'slurm'@'127.0.0.1' IDENTIFIED BY '$pass';
    GRANT ALL ON slurm_acct_db.* TO 'slurm'@'127.0.0.1';" 2>"$LOG/mariadb-grant.log" ||
    fail "creating the slurm database user" "$LOG/mariadb-grant.log"
}

start_slurmdbd() {
  if ! alive "$RUN/slurmdbd.pid"; then
    slurmdbd >"$LOG/slurmdbd.out" 2>&1 || fail "slurmdbd did not start" "$LOG/slurmdbd.out" "$LOG/slurmdbd.log"
  fi
  # the first start creates the database's tables: seconds
  STARTED=$SECONDS
  while ((SECONDS - STARTED < TIMEOUT)); do
    sacctmgr -n -P list cluster format=cluster >/dev/null 2>&1 && break
    died "$RUN/slurmdbd.pid" && fail "slurmdbd exited" "$LOG/slurmdbd.out" "$LOG/slurmdbd.log"
    sleep 0.2
  done
  sacctmgr -n -P list cluster format=cluster >"$LOG/sacctmgr.out" 2>&1 ||
    fail "sacctmgr cannot reach slurmdbd" "$LOG/sacctmgr.out" "$LOG/slurmdbd.log"
  if ! grep -qx "$CLUSTER" "$LOG/sacctmgr.out"; then
    sacctmgr -i add cluster "$CLUSTER" >"$LOG/sacctmgr.out" 2>&1 ||
      fail "sacctmgr add cluster $CLUSTER" "$LOG/sacctmgr.out" "$LOG/slurmdbd.log"
  fi
}

start_slurm() {
  if ! alive "$RUN/slurmctld.pid"; then
    slurmctld >"$LOG/slurmctld.out" 2>&1 || fail "slurmctld did not start" "$LOG/slurmctld.out" "$LOG/slurmctld.log"
  fi
  if ! alive "$RUN/slurmd.pid"; then
    slurmd >"$LOG/slurmd.out" 2>&1 || fail "slurmd did not start" "$LOG/slurmd.out" "$LOG/slurmd.log"
  fi
}

node_state() { sinfo -h -n "$NODE" -o %t 2>/dev/null | head -n 1; }

wait_idle() {
  local state="" resumed=0
  STARTED=$SECONDS
  while ((SECONDS - STARTED < TIMEOUT)); do
    state="$(node_state)"
    case "$state" in
      idle | mix | alloc)
        # (the controller may still show a slurmd that just died as idle)
        alive "$RUN/slurmctld.pid" && alive "$RUN/slurmd.pid" && return 0
        ;;
      down | drain | drng | down\* | drain\*)
        # state saved by an earlier run of the cluster: bring the node back once
        if ((resumed == 0)); then
          scontrol update NodeName="$NODE" State=RESUME >/dev/null 2>&1 || true
          resumed=1
        fi
        ;;
    esac
    died "$RUN/slurmctld.pid" && fail "slurmctld exited" "$LOG/slurmctld.out" "$LOG/slurmctld.log"
    died "$RUN/slurmd.pid" && fail "slurmd exited" "$LOG/slurmd.out" "$LOG/slurmd.log"
    sleep 0.2
  done
  fail "node $NODE not idle after ${TIMEOUT}s (sinfo state: '${state:-none}'; $(scontrol show node "$NODE" 2>&1 | grep -o 'Reason=.*' || true))" \
    "$LOG/slurmctld.log" "$LOG/slurmd.log"
}

stop_all() {
  if alive "$RUN/slurmctld.pid"; then
    # jobs first, so that no slurmstepd is left behind
    local jobs
    jobs="$(squeue -h -o %A 2>/dev/null | sort -u | tr '\n' ' ')" || jobs=""
    if [[ -n "${jobs// /}" ]]; then
      # shellcheck disable=SC2086
      scancel $jobs 2>/dev/null || true
      for _ in $(seq 1 100); do
        [[ -z "$(squeue -h -o %A 2>/dev/null)" ]] && break
        sleep 0.2
      done
    fi
  fi
  stop_pids "$RUN/slurmd.pid" "$RUN/slurmctld.pid"
  stop_pids "$RUN/slurmdbd.pid" "$DB_RUN/mariadb.pid"
  stop_pids "$MUNGE_PID"
}

start() {
  local t0=$SECONDS changed=0 pass=""
  need_root
  install_packages
  prepare_dirs
  munge_key
  if [[ "$ACCOUNTING" == 1 ]]; then
    pass="$(db_password)"
    slurmdbd_conf "$pass" | write_if_changed "$DBD_CONF" 600 slurm:slurm && changed=1
  fi
  slurm_conf | write_if_changed "$CONF" 644 root:root && changed=1
  if ((changed)) && { alive "$RUN/slurmctld.pid" || alive "$RUN/slurmd.pid" || alive "$RUN/slurmdbd.pid"; }; then
    say "configuration changed: restarting the daemons"
    stop_all
  fi
  start_munge
  if [[ "$ACCOUNTING" == 1 ]]; then
    start_mariadb
    start_slurmdbd
  fi
  start_slurm
  wait_idle
  say "up: node $NODE $(node_state) in partition $PARTITION ($(sinfo -h -n "$NODE" -o '%c CPUs, %m MB')), accounting $([[ "$ACCOUNTING" == 1 ]] && echo on || echo off), $((SECONDS - t0)) s"
}

case "${1:-start}" in
  start) start ;;
  stop)
    need_root
    stop_all
    say "stopped"
    ;;
  status)
    if alive "$RUN/slurmctld.pid" && state="$(node_state)" && [[ -n "$state" ]]; then
      say "up: node $NODE $state"
    else
      say "down"
      exit 1
    fi
    ;;
  *)
    echo "usage: $0 [start|stop|status]" >&2
    exit 2
    ;;
esac
