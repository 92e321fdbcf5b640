#!/bin/bash
# On the GPU machine (root, Ubuntu 24.04, pure cgroup v2, no systemd, no network): installs the carried
# Debian 12 Slurm 22.05 + munge (DEBS, default .carry/slurmdebs; tests/gpu/carry.sh fetches them), starts
# munged and writes a one-node cluster with the real GPUs as GRES, the cgroup plugins sites use
# (proctrack/slurmckpt delegating to proctrack/cgroup, task/cgroup, jobacct_gather/cgroup, cgroup/v2, ConstrainDevices) and the settings of
# the test cluster (requeue, short credential lifetime, fast backfill). The caller starts slurmctld/slurmd.
set -u
debs=${1:-.carry/slurmdebs}
for f in "$debs"/*.deb; do
  case $f in   # carry a library only where the machine has none (never replace the machine's own)
    *lib*-[0-9]*_*|*libhwloc*|*liblua*|*libjson-c*|*libyaml*|*libnuma*|*liblz4*|*libsystemd*)
      so=$(dpkg -c "$f" | grep -o "lib[^/ ]*\.so\.[0-9]*" | head -1)
      [ -n "$so" ] && ldconfig -p | grep -q "$so" && continue; echo "carrying $so";;
  esac
  # not `dpkg -x`: its tar replaces a merged-/usr machine's /lib symlink with a directory (Debian 12's
  # packages still ship ./lib/systemd), and the linker's libc.so script then finds no /lib/.../libc.so.6
  dpkg-deb --fsys-tarfile "$f" | tar -C / --keep-directory-symlink -x
done
for b in slurmd slurmstepd slurmctld; do ln -sf "/usr/sbin/$b-wlm" "/usr/sbin/$b"; done   # Debian's alternatives
ldconfig
id slurm >/dev/null 2>&1 || useradd -r -M slurm; id munge >/dev/null 2>&1 || useradd -r -M munge
mkdir -p /etc/munge /var/lib/munge /var/log/munge /run/munge /var/spool/slurmd /var/spool/slurmctld /var/log/slurm /etc/slurm
[ -f /etc/munge/munge.key ] || dd if=/dev/urandom of=/etc/munge/munge.key bs=1k count=1 2>/dev/null
chown -R munge: /etc/munge /var/lib/munge /var/log/munge /run/munge; chmod 400 /etc/munge/munge.key
pgrep -x munged >/dev/null || runuser -u munge -- /usr/sbin/munged
H=$(hostname); grep -q "$H" /etc/hosts || echo "127.0.1.1 $H" >> /etc/hosts
ngpu=$(ls /dev/nvidia[0-9]* 2>/dev/null | wc -l)
cat > /etc/slurm/slurm.conf <<C
ClusterName=gpu
SlurmctldHost=$H
SlurmUser=root
StateSaveLocation=/var/spool/slurmctld
SlurmdSpoolDir=/var/spool/slurmd
ProctrackType=proctrack/slurmckpt
PluginDir=/usr/lib/x86_64-linux-gnu/slurm-wlm:/usr/local/lib/slurmckpt
TaskPlugin=task/cgroup,task/affinity
JobAcctGatherType=jobacct_gather/cgroup
SelectType=select/cons_tres
GresTypes=gpu
SlurmctldLogFile=/var/log/slurm/slurmctld.log
SlurmdLogFile=/var/log/slurm/slurmd.log
NodeName=$H CPUs=$(nproc) RealMemory=$(( $(awk '/MemTotal/{print $2}' /proc/meminfo) / 1024 - 4096 )) Gres=gpu:$ngpu State=UNKNOWN
PartitionName=debug Nodes=$H Default=YES MaxTime=INFINITE State=UP
AuthInfo=cred_expire=10
SchedulerParameters=bf_interval=5
JobRequeue=1
JobAcctGatherFrequency=task=5
KillWait=30
PlugStackConfig=/etc/slurm/plugstack.conf
C
printf 'CgroupPlugin=cgroup/v2\nIgnoreSystemd=yes\nConstrainCores=yes\nConstrainRAMSpace=yes\nConstrainDevices=yes\n' > /etc/slurm/cgroup.conf
: > /etc/slurm/gres.conf; for d in /dev/nvidia[0-9]*; do echo "Name=gpu File=$d" >> /etc/slurm/gres.conf; done
# cgroup v2 without systemd: Slurm wants the controllers enabled and system.slice present
echo "+cpuset +cpu +memory +pids" > /sys/fs/cgroup/cgroup.subtree_control
mkdir -p /sys/fs/cgroup/system.slice
echo "+cpuset +cpu +memory +pids" > /sys/fs/cgroup/system.slice/cgroup.subtree_control
echo 'slurm config written (daemons started by the caller)'
