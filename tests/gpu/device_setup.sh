# Sourced by tests/gpu/real_slurm.sh on the device machine (root), from the repo
# root: installs the carried patched CRIU, slurmckpt-init and setpriv, checks cgroups, writes the config, creates
# the job's user $DEVICE_USER and a world-readable copy of the tree in $STAGE (sets PYTHONPATH, uid, gid,
# asuser). Needs PY set.
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
# slurmckpt's own TCP holds reach nftables through libnftables (packet_filter.py) where the node has no
# iptables: the carried one, with what it needs, where the machine has none of its own
for l in libnftables.so.1 libnftnl.so.11 libmnl.so.0 libjansson.so.4 libxtables.so.12; do
  ldconfig -p | grep -q "$l" || { [ -f ".carry/criu-patched/$l" ] && cp ".carry/criu-patched/$l" /usr/local/lib/; }
done
ldconfig
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
id "$DEVICE_USER" >/dev/null 2>&1 || useradd -m -U -s /bin/bash "$DEVICE_USER"
id "$DEVICE_USER"
rm -rf "$STAGE"; mkdir -p "$STAGE"
cp -r src tests "$STAGE"/
find "$STAGE" -name __pycache__ -prune -exec rm -rf {} +
chmod -R a+rX "$STAGE"
export PYTHONPATH=$STAGE/src:$STAGE PYTHONDONTWRITEBYTECODE=1 PYTHONUNBUFFERED=1
# zstandard (the image has none) beside our sources, before the import check below (which would otherwise
# fail and chmod the image's whole venv, minutes on a fresh machine): the image's Python stays as it is
"$PY" -c 'import zstandard' 2>/dev/null || "$PY" -m pip install -q --no-index --no-deps --no-compile \
  --target "$STAGE/src" .carry/whl/*.whl
chmod -R a+rX "$STAGE"
uid=$(id -u "$DEVICE_USER"); gid=$(id -g "$DEVICE_USER")
asuser() { /usr/bin/setpriv --reuid="$uid" --regid="$gid" --clear-groups "$@"; }
probe='import slurmckpt.task.wrapper, yaml, xxhash, click, sys; print("user imports OK", sys.executable)'
if ! (cd /tmp && asuser "$PY" -c "$probe"); then
  venv=$(dirname "$(dirname "$PY")")
  echo "user cannot run $PY with our imports: chmod -R a+rX $venv"
  chmod -R a+rX "$venv"; d=$venv
  while [ "$d" != / ]; do chmod a+x "$d"; d=$(dirname "$d"); done
  (cd /tmp && asuser "$PY" -c "$probe")
fi
ls -l /dev/nvidia* 2>/dev/null | head -4
command -v nvidia-smi >/dev/null && nvidia-smi --query-gpu=name,uuid,memory.total,driver_version --format=csv,noheader
