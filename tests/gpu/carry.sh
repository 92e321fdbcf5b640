#!/bin/bash
# On a Debian 12 machine after `make setup` (root): fills .carry/ (git-ignored) with what the GPU machine
# lacks and cannot download, for tests/gpu/real_slurm.sh there (~26 MB):
#   slurmdebs/      Debian 12's Slurm 22.05, munge and the libraries Ubuntu 24.04 lacks
#   criu-patched/   our patched CRIU with its libraries, slurmckpt-init (static), setpriv + libcap-ng
#   slurmckpt_spank.so, proctrack_slurmckpt.so, whl/ (zstandard for Python 3.12)
# CRIU=path carries that criu binary instead of the installed one (a build of a newer patch set).
set -eu
CRIU=${CRIU:-/usr/local/sbin/criu}
cd "$(dirname "$0")/../.."
c=.carry; mkdir -p "$c/slurmdebs" "$c/criu-patched" "$c/whl"
(cd "$c/slurmdebs" && apt-get download slurmd slurmctld slurm-client slurm-wlm-basic-plugins libslurm38 munge \
  libmunge2 libdbus-1-3 libhwloc15 liblua5.1-0 libjson-c5 libyaml-0-2 libnuma1 liblz4-1 libsystemd0)
install -m 755 "$CRIU" /usr/local/libexec/slurmckpt/slurmckpt-init /usr/bin/setpriv "$c/criu-patched/"
for lib in $(ldd "$CRIU" /usr/bin/setpriv | awk '$3 ~ /^\// {print $3}' | sort -u); do
  case $lib in */libc.so.6|*/ld-linux*) ;; *) cp -L "$lib" "$c/criu-patched/";; esac
done
install -m 755 /usr/local/lib/slurmckpt/slurmckpt_spank.so /usr/local/lib/slurmckpt/proctrack_slurmckpt.so "$c/"
python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
  --platform manylinux2014_x86_64 --platform manylinux_2_17_x86_64 -d "$c/whl" 'zstandard>=0.20'
du -sh "$c"
