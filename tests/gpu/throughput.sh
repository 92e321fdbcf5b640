#!/bin/bash
# Issue 4 item 6b, last part, on the device machine (root): throughput of one training loop with periodic
# checkpoints OFF (plain run as the job's user) vs ON (fakestepd -> real agent + wrapper, SLURMCKPT_INTERVAL).
# Set-up as tests/gpu/e2e_wrapper.sh (carried patched CRIU + slurmckpt-init + setpriv, an unprivileged user,
# config, a world-readable staged copy of the tree), then tests/gpu/throughput.py.
#   tests/gpu/throughput.sh [--cpu] [throughput.py options: --seconds S --interval I --magic-mib M ...]
# Output: $OUT/throughput.txt (everything printed), $OUT/throughput-summary.json, $OUT/throughput-logs.tar.gz
# (both runs' output, wrapper stderr, agent log, rank.json, manifest, criu dump logs). The job's images are
# removed at the end (TP_KEEP_IMAGES=1 keeps them). Exit code: throughput.py's.
set -u
cd "$(dirname "$0")/../.."
OUT=${OUT:-/tmp/throughput-out}; mkdir -p "$OUT"
main() {
TP_USER=${TP_USER:-ckptgpu}
JOB=${TP_JOB:-4600701}
STAGE=${TP_STAGE:-/opt/slurmckpt-tput}
WORK=/var/tmp/slurmckpt-tput/$JOB
PY=$(command -v python3)
T0=$SECONDS
echo "=== setup $(date -u +%FT%TZ) on $(hostname), kernel $(uname -r), python $PY"

# --- CRIU (our patched build) and the namespace init, unless already installed ---
if [ ! -x /usr/local/sbin/criu ] && [ -x .carry/criu-patched/criu ]; then
  mkdir -p /usr/local/lib/slurmckpt-criu
  cp .carry/criu-patched/* /usr/local/lib/slurmckpt-criu/
  printf '#!/bin/sh\nLD_LIBRARY_PATH=/usr/local/lib/slurmckpt-criu exec /usr/local/lib/slurmckpt-criu/criu "$@"\n' \
    > /usr/local/sbin/criu
  chmod 755 /usr/local/sbin/criu
  echo "installed carried criu as /usr/local/sbin/criu (wrapper script)"
fi
if [ ! -x /usr/local/libexec/slurmckpt/slurmckpt-init ] && [ -x .carry/criu-patched/slurmckpt-init ]; then
  install -D -m 755 .carry/criu-patched/slurmckpt-init /usr/local/libexec/slurmckpt/slurmckpt-init
  echo "installed carried slurmckpt-init"
fi
if [ ! -x /usr/bin/setpriv ] && [ -x .carry/criu-patched/setpriv ]; then
  install -m 755 .carry/criu-patched/setpriv /usr/bin/setpriv
  ldconfig -p | grep -q libcap-ng.so.0 || { cp .carry/criu-patched/libcap-ng.so.0 /usr/local/lib/; ldconfig; }
  echo "installed carried setpriv"
fi
/usr/local/sbin/criu --version | head -1
/usr/bin/setpriv --version
ls -l /usr/local/libexec/slurmckpt/slurmckpt-init

# --- cgroups, host name, config, directories ---
if [ -d /sys/fs/cgroup/freezer ]; then echo "cgroup: v1 freezer at /sys/fs/cgroup/freezer"
elif [ -f /sys/fs/cgroup/cgroup.controllers ]; then echo "cgroup: v2 at /sys/fs/cgroup ($(cat /sys/fs/cgroup/cgroup.controllers))"
else echo "cgroup: NO freezer found"; mount | grep cgroup; fi
getent hosts "$(hostname)" >/dev/null || { echo "127.0.1.1 $(hostname)" >> /etc/hosts; echo "added $(hostname) to /etc/hosts"; }
mkdir -p /etc/slurmckpt /var/lib/slurmckpt/images /var/log/slurmckpt
chmod 700 /var/lib/slurmckpt/images /var/log/slurmckpt
[ -f /etc/slurmckpt/slurmckpt.yaml ] || printf 'criu_path: /usr/local/sbin/criu\n' > /etc/slurmckpt/slurmckpt.yaml
echo "config: $(tr '\n' ' ' < /etc/slurmckpt/slurmckpt.yaml | head -c 300)"

# --- the job's user and a world-readable copy of the tree (the repo may sit under a 0700 home) ---
id "$TP_USER" >/dev/null 2>&1 || useradd -m -U -s /bin/bash "$TP_USER"
id "$TP_USER"
rm -rf "$STAGE"; mkdir -p "$STAGE"
cp -r src tests "$STAGE"/
find "$STAGE" -name __pycache__ -prune -exec rm -rf {} +
chmod -R a+rX "$STAGE"
export PYTHONPATH=$STAGE/src:$STAGE PYTHONDONTWRITEBYTECODE=1 PYTHONUNBUFFERED=1
uid=$(id -u "$TP_USER"); gid=$(id -g "$TP_USER")
asuser() { /usr/bin/setpriv --reuid="$uid" --regid="$gid" --clear-groups "$@"; }
probe='import slurmckpt.wrapper, yaml, xxhash, click, sys; print("user imports OK", sys.executable)'
if ! (cd /tmp && asuser "$PY" -c "$probe"); then
  venv=$(dirname "$(dirname "$PY")")
  echo "user cannot run $PY with our imports: chmod -R a+rX $venv"
  chmod -R a+rX "$venv"; d=$venv
  while [ "$d" != / ]; do chmod a+x "$d"; d=$(dirname "$d"); done
  (cd /tmp && asuser "$PY" -c "$probe")
fi
ls -l /dev/nvidia* 2>/dev/null | head -4
command -v nvidia-smi >/dev/null && nvidia-smi --query-gpu=name,uuid,memory.total,driver_version --format=csv,noheader
echo "=== setup done in $((SECONDS - T0)) s"

# --- the measurement ---
T1=$SECONDS
timeout -k 10 ${TP_TIMEOUT:-400} "$PY" "$STAGE/tests/gpu/throughput.py" --user "$TP_USER" --job "$JOB" \
  --work "$WORK" "$@"
rc=$?
echo "=== throughput.py rc=$rc in $((SECONDS - T1)) s"
for f in /var/lib/slurmckpt/images/*/"$JOB"/epoch-*/*/dump.log; do
  [ -f "$f" ] && cp "$f" "$WORK/$(basename "$(dirname "$(dirname "$f")")").dump.log"
done
du -sh /var/lib/slurmckpt/images/*/"$JOB"/epoch-* 2>/dev/null
df -h /var/lib/slurmckpt/images | tail -1
cp "$WORK/summary.json" "$OUT/throughput-summary.json" 2>/dev/null
tar -C "$(dirname "$WORK")" -czf "$OUT/throughput-logs.tar.gz" "$(basename "$WORK")" 2>/dev/null
[ "${TP_KEEP_IMAGES:-0}" = 1 ] || rm -rf /var/lib/slurmckpt/images/*/"$JOB"
echo "=== total $((SECONDS - T0)) s"
return $rc
}
main "$@" 2>&1 | tee -a "$OUT/throughput.txt"
exit "${PIPESTATUS[0]}"
