#!/bin/bash
# Device experiment (root, GPU): tests/gpu/jax_restore_probe.py inside a plain Slurm job (no slurmckpt in
# plugstack.conf), so the probe's program gets what a job's gets from Slurm's task/cgroup (cpuset, memory
# limit, device filter) and nothing else changes. Compared with the same cases outside Slurm it tells whether
# Slurm's cgroups or slurmckpt's own path make a GPU restore fail.
#   bash tests/gpu/probe_in_slurm.sh CASE...     output: $OUT/probe-in-slurm.txt
set -u
OUT=${OUT:-/tmp/probe-in-slurm}; mkdir -p "$OUT"
exec > >(tee -a "$OUT/probe-in-slurm.txt") 2>&1
bash tests/gpu/slurm_config.sh .carry/slurmdebs 2>&1 | tail -2
DEVICE_USER=ckptgpu STAGE=/opt/slurmckpt-stage PY=$(command -v python3)
. tests/gpu/device_setup.sh >/dev/null
: > /etc/slurm/plugstack.conf
install -D -m 755 -t /usr/local/lib/slurmckpt .carry/slurmckpt_spank.so .carry/proctrack_slurmckpt.so
slurmctld; sleep 1; slurmd; sleep 3
sinfo -h; grep -v '^#' /etc/slurm/cgroup.conf | tr '\n' ' '; echo
J=$(sbatch --parsable -o "$OUT/job.out" --gres=gpu:1 --mem=24G -c 4 --chdir="$STAGE" \
      --wrap "SLURMCKPT_CRIU=/usr/local/sbin/criu PYTHONPATH=src PYTHONUNBUFFERED=1 $PY tests/gpu/jax_restore_probe.py /var/tmp/probe-in-slurm $*")
echo "job $J: $*"
for _ in $(seq "${PROBE_DEADLINE:-300}"); do [ -z "$(squeue -h -j "$J" -o %T 2>/dev/null)" ] && break; sleep 1; done
echo "job $J state after the wait: '$(squeue -h -j "$J" -o %T 2>/dev/null)'"
cat "$OUT/job.out"
