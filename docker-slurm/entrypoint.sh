#!/usr/bin/env bash
# Entry point of the docker-slurm image (run under tini): one role per container. A test cluster only
# (docs/docker-slurm.md): never a deployment.
#
#   slurmdbd     MariaDB (data in a volume) + slurmdbd
#   slurmctld    registers the cluster with slurmdbd, then slurmctld
#   slurmd       `criu check` (the node's kernel and privileges), then slurmd
#   anything else is exec'd as given (e.g. bash)
#
# Every role first starts munged with the cluster's key, made once by whichever container starts first in the
# volume all of them mount at /etc/munge (no key is baked into the image). Daemons run in the foreground and
# log to the container's output (`docker compose logs`).
set -euo pipefail
export PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin

say() { printf '[docker-slurm %s] %s\n' "$(hostname)" "$*" >&2; }
die() { say "ERROR: $*"; exit 1; }

# wait_until SECONDS WHAT CMD...: run CMD every second until it succeeds.
wait_until() {
  local t=$1 what=$2 i; shift 2
  for ((i = 0; i < t; i++)); do "$@" >/dev/null 2>&1 && return 0; sleep 1; done
  die "$what did not happen within ${t}s (last try: $*)"
}

start_munge() {
  install -d -o munge -g munge -m 0700 /etc/munge
  install -d -o munge -g munge -m 0755 /run/munge
  (
    flock 9
    if [ ! -s /etc/munge/munge.key ]; then
      say "creating the cluster's munge key"
      mungekey --create --keyfile=/etc/munge/munge.key
      chown munge:munge /etc/munge/munge.key; chmod 0400 /etc/munge/munge.key
    fi
  ) 9>/etc/munge/.keylock
  runuser -u munge -- munged
  wait_until 10 "munged to answer" munge -n
}

role_slurmdbd() {
  install -d -o mysql -g mysql -m 0755 /run/mysqld
  if [ ! -d /var/lib/mysql/mysql ]; then
    say "initialising MariaDB in /var/lib/mysql"
    mariadb-install-db --user=mysql --datadir=/var/lib/mysql --skip-test-db >/dev/null
  fi
  # the values slurmdbd checks for at start (it logs an error below them)
  mariadbd --user=mysql --datadir=/var/lib/mysql --skip-networking \
    --innodb-buffer-pool-size=256M --innodb-lock-wait-timeout=900 &
  wait_until 60 "MariaDB to answer" mariadb -e 'SELECT 1'
  # slurmdbd runs as the slurm user, which logs in over the socket as itself (no password anywhere)
  mariadb -e "CREATE USER IF NOT EXISTS 'slurm'@'localhost' IDENTIFIED VIA unix_socket;
              GRANT ALL ON slurm_acct_db.* TO 'slurm'@'localhost';" || die "creating MariaDB's user slurm failed"
  install -d -o slurm -g slurm -m 0755 /run/slurmdbd
  exec slurmdbd -D
}

role_slurmctld() {
  # slurmctld sends its records to a cluster slurmdbd knows; registering it first avoids a restart.
  wait_until 120 "slurmdbd to answer (sacctmgr list cluster)" sacctmgr -n -P list cluster
  if ! sacctmgr -n -P list cluster format=Cluster | grep -qx docker; then
    sacctmgr -i add cluster docker >/dev/null || die "sacctmgr -i add cluster docker failed"
  fi
  install -d -o slurm -g slurm -m 0755 /var/spool/slurmctld /run/slurmctld
  exec slurmctld -D -i
}

role_slurmd() {
  if ! criu check >/tmp/criu-check.log 2>&1; then
    cat /tmp/criu-check.log >&2
    die "'criu check' fails in this container: it needs privileged: true (docs/docker-slurm.md)"
  fi
  install -d -m 0755 /var/spool/slurmd
  exec slurmd -D
}

case ${1:-} in
  slurmdbd | slurmctld | slurmd)
    start_munge
    say "starting $1"
    "role_$1"
    ;;
  "") die "no role given (slurmdbd, slurmctld or slurmd)" ;;
  *) exec "$@" ;;
esac
