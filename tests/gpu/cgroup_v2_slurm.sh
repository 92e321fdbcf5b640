#!/bin/bash
# On the device machine (root, pure cgroup v2, repo root): a real Slurm 22.05 (carried .debs, started by
# .carry/start-slurm.sh: the shared gpu-slurm tool, or a copy that only writes the config) with proctrack/cgroup, task/cgroup,
# jobacct_gather/cgroup, cgroup/v2 and the GPU as GRES, plus the slurmckpt SPANK plugin, then three
# checkpointed jobs side by side, all requeued at once (device time is short):
#   A  CPU, 300 MiB held: where the tree sits (/proc/PID/cgroup), scontrol listpids, sstat MaxRSS/CPU,
#      scontrol suspend/resume, scancel and Slurm's cgroup cleanup, before and after the restore;
#   M  --mem=400M, grows past it only after the restore: Slurm's memory limit holds for the restored tree;
#   G  --gres=gpu:1 PyTorch training: periodic capture, requeue, restore, losses continue.
#   carry: .carry (slurmdebs/, criu-patched/, slurmckpt_spank.so, start-slurm.sh)
# Output: $OUT/cgroup-v2.txt (written as it goes: a cut-off run still returns what it saw). sacct needs
# slurmdbd + a database, which the device has not: sstat's CPU columns stand in for TotalCPU.
set -u
OUT=${OUT:-/tmp/cg2-out}; mkdir -p "$OUT"
exec > >(tee -a "$OUT/cgroup-v2.txt") 2>&1
T0=$SECONDS
say() { echo "=== [$((SECONDS - T0))s] $*"; }

say "slurm (start-slurm.sh)"
bash .carry/start-slurm.sh .carry/slurmdebs 2>&1 | tail -6
DEVICE_USER=ckptcg2 STAGE=/opt/slurmckpt-stage PY=$(command -v python3)
. tests/gpu/device_setup.sh >/dev/null
install -D -m 755 .carry/slurmckpt_spank.so /usr/local/lib/slurmckpt/slurmckpt_spank.so
mkdir -p /opt/slurmckpt/venv/bin
ep() { printf '#!%s\nimport sys\nsys.path.insert(0, "%s/src")\nfrom %s import main\nsys.exit(main())\n' \
  "$PY" "$STAGE" "$2" > "/opt/slurmckpt/venv/bin/$1"; chmod 755 "/opt/slurmckpt/venv/bin/$1"; }
ep slurmckpt slurmckpt.cli; ep slurmckpt-wrap slurmckpt.wrapper
echo "required /usr/local/lib/slurmckpt/slurmckpt_spank.so wrapper=/opt/slurmckpt/venv/bin/slurmckpt-wrap" \
  "agent=/opt/slurmckpt/venv/bin/slurmckpt init=/usr/local/libexec/slurmckpt/slurmckpt-init" \
  > /etc/slurm/plugstack.conf
grep -q cred_expire /etc/slurm/slurm.conf || \
  printf 'AuthInfo=cred_expire=10\nSchedulerParameters=bf_interval=5\nJobRequeue=1\nJobAcctGatherFrequency=task=5\nKillWait=10\n' \
  >> /etc/slurm/slurm.conf
pgrep -x slurmctld >/dev/null && { scontrol shutdown >/dev/null 2>&1; sleep 2; }   # the shared tool's start
slurmctld; sleep 1; slurmd; sleep 2
sinfo -h; grep -v '^#' /etc/slurm/cgroup.conf | tr '\n' ' '; echo
grep -E '^(ProctrackType|TaskPlugin|JobAcctGatherType)' /etc/slurm/slurm.conf | tr '\n' ' '; echo

H=/home/$DEVICE_USER/cg2; mkdir -p "$H"; cp "$STAGE/tests/integration/workloads/memhog.py" "$STAGE/tests/gpu/workload_train.py" "$H/"
chown -R "$DEVICE_USER": "$H"
sub() { (cd "$H" && runuser -u "$DEVICE_USER" -- sbatch --parsable --open-mode=append "$@"); }
taskcg() { ls -d /sys/fs/cgroup/system.slice/*slurmstepd.scope/job_"$1"/step_batch/user/task_0 2>/dev/null | head -1; }
jstate() { squeue -h -j "$1" -o %T 2>/dev/null; }
waitout() { for _ in $(seq "$3"); do grep -qE "$2" "$H/$1.out" 2>/dev/null && return 0; sleep 1; done; echo "TIMEOUT waiting for /$2/ in $1.out"; return 1; }
steps() { grep -oE 'memhog step [0-9]+' "$H/$1.out" | tail -1 | awk '{print $3}'; }

view() {   # JOB WHEN: Slurm's view of the checkpointed job
  local j=$1 cg; cg=$(taskcg "$j"); say "job $j $2: Slurm's task cgroup $cg"
  echo "task cgroup procs: $(tr '\n' ' ' < "$cg/cgroup.procs")  cgroup.freeze=$(cat "$cg/cgroup.freeze")" \
       "label=$(python3 -c "import os,sys;print(os.getxattr(sys.argv[1],'trusted.slurmckpt.task').decode())" "$cg" 2>&1)"
  for p in $(cat "$cg/cgroup.procs"); do echo "  tree pid $p ($(cat /proc/$p/comm)): $(cat /proc/$p/cgroup)"; done
  for p in $(pgrep -f "slurmckpt-wrap|slurmckpt agent" ); do
    grep -q "job_$j/" /proc/$p/cgroup 2>/dev/null && echo "  helper pid $p ($(tr '\0' ' ' < /proc/$p/cmdline | cut -c1-60)): $(cat /proc/$p/cgroup)"; done
  echo "  scontrol listpids:"; scontrol listpids "$j" | sed 's/^/    /'
  echo "  sstat: $(sstat -n -P -j "$j.batch" -o JobID,MaxRSS,AveCPU,MinCPU 2>&1)"
  local jc=${cg%/step_batch/*}
  echo "  memory.max job=$(cat "$jc/memory.max") memory.peak task=$(cat "$cg/memory.peak" 2>/dev/null)" \
       "cpuset job=$(cat "$jc/cpuset.cpus.effective")"
}
suspended() {   # JOB: steps advance while suspended?
  scontrol suspend "$1"; sleep 1; local s1; s1=$(steps "$1"); sleep 4; local s2; s2=$(steps "$1"); scontrol resume "$1"
  echo "scontrol suspend: memhog step $s1 -> $s2 in 4 s ($( [ "$s1" = "$s2" ] && echo STOPPED || echo MOVED))"
}

say "submit A (300 MiB memhog), M (--mem=400M, grows from step 350) and G (GPU training)"
A=$(sub -J cg2A -o A.out --mem=1G --checkpoint-interval=10s --wrap "python3 memhog.py --mb 300 --steps 900 --sleep 0.2")
M=$(sub -J cg2M -o M.out --mem=400M --checkpoint-interval=10s --wrap "python3 memhog.py --mb 100 --steps 900 --sleep 0.2 --grow-after 350")
G=$(sub -J cg2G -o G.out --mem=16G --gres=gpu:1 --checkpoint-interval=15s --export=ALL,CUBLAS_WORKSPACE_CONFIG=:4096:8 \
    --wrap "python3 workload_train.py --steps 900 --sleep 0.1")
echo "jobs: A=$A M=$M G=$G"
waitout A 'committed \(interval\)|failed|refused|ABORTED' 40
view "$A" "before the restore"
sed -n 's/^\[[^]]*\]/&/p' "$H/A.out" | grep -v '^memhog step' | tail -3
waitout G 'committed \(interval\)|failed|refused|ABORTED' 60
grep -v '^step [0-9]* loss' "$H/G.out" | tail -4
[ -n "$(taskcg "$G")" ] && view "$G" "before the restore"

say "requeue A, M and G (final capture, requeue, restore)"
scontrol requeue "$A"; scontrol requeue "$M"; scontrol requeue "$G"
waitout A 'restored from checkpoint epoch' 90; sleep 3
view "$A" "after the restore"
suspended A
pidsA=$(cat "$(taskcg "$A")/cgroup.procs"); jcA=$(dirname "$(dirname "$(dirname "$(taskcg "$A")")")")
say "scancel $A"
scancel "$A"; for _ in $(seq 15); do [ -z "$(jstate "$A")" ] && break; sleep 1; done; sleep 1
alive=""; for p in $pidsA; do [ -e /proc/$p ] && alive="$alive $p"; done
echo "after scancel: state='$(jstate "$A")' tree pids left: '${alive}' job cgroup $jcA $( [ -d "$jcA" ] && echo STILL THERE || echo removed by Slurm)"
waitout G 'restored from checkpoint epoch|FAILED' 60; sleep 4
[ -n "$(taskcg "$G")" ] && view "$G" "after the restore"
say "M (--mem=400M) after its restore: $(grep -c 'restored from checkpoint' "$H/M.out") restore(s), state '$(jstate "$M")', last step $(steps M)"
for _ in $(seq 20); do [ -z "$(jstate "$M")" ] && break; sleep 1; done
echo "M: state now '$(jstate "$M")', last memhog step $(steps M); $(grep -iE 'oom|out of memory|killed' "$H/M.out" | tail -2)"
grep -iE "oom" /var/log/slurm/slurmd.log | tail -2
scancel "$G"
say "outputs"
for f in A M G; do echo "--- $f.out"; grep -vE '^(memhog step|step [0-9]+ loss)' "$H/$f.out" | tail -12
  grep -E '^step [0-9]+ loss' "$H/$f.out" | awk 'NR==1||/./{l=$0} END{print "last: " l}'; done
echo "--- slurmd.log errors"; grep -iE "error|rmdir|unable" /var/log/slurm/slurmd.log | tail -8
say "done"
