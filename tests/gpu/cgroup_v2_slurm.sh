#!/bin/bash
# On the device machine (root, pure cgroup v2, repo root): a real Slurm 22.05 (carried .debs, started by
# .carry/start-slurm.sh, a copy of the shared gpu-slurm tool) with proctrack/cgroup, task/cgroup,
# jobacct_gather/cgroup, cgroup/v2 and the GPU as GRES, plus the slurmckpt SPANK plugin, then checkpointed
# jobs: where the tree sits (/proc/PID/cgroup), scontrol listpids, sstat MaxRSS/CPU, scontrol suspend/resume,
# a --mem limit, scancel and Slurm's cgroup cleanup, before and after a requeue + restore; a GPU job likewise.
#   carry: .carry (slurmdebs/, criu-patched/, slurmckpt_spank.so, start-slurm.sh)
# Output: $OUT/cgroup-v2.txt. sacct needs slurmdbd + a database, which the device has not: sstat's CPU
# columns stand in for TotalCPU.
set -u
OUT=${OUT:-/tmp/cg2-out}; mkdir -p "$OUT"
exec > >(tee -a "$OUT/cgroup-v2.txt") 2>&1
T0=$SECONDS
say() { echo "=== [$((SECONDS - T0))s] $*"; }

say "slurm (start-slurm.sh)"
bash .carry/start-slurm.sh .carry/slurmdebs 2>&1 | tail -15
DEVICE_USER=ckptcg2 STAGE=/opt/slurmckpt-stage PY=$(command -v python3)
. tests/gpu/device_setup.sh
install -D -m 755 .carry/slurmckpt_spank.so /usr/local/lib/slurmckpt/slurmckpt_spank.so
mkdir -p /opt/slurmckpt/venv/bin
ep() { printf '#!%s\nimport sys\nsys.path.insert(0, "%s/src")\nfrom %s import main\nsys.exit(main())\n' \
  "$PY" "$STAGE" "$2" > "/opt/slurmckpt/venv/bin/$1"; chmod 755 "/opt/slurmckpt/venv/bin/$1"; }
ep slurmckpt slurmckpt.cli; ep slurmckpt-wrap slurmckpt.wrapper
echo "required /usr/local/lib/slurmckpt/slurmckpt_spank.so wrapper=/opt/slurmckpt/venv/bin/slurmckpt-wrap" \
  "agent=/opt/slurmckpt/venv/bin/slurmckpt init=/usr/local/libexec/slurmckpt/slurmckpt-init" \
  > /etc/slurm/plugstack.conf
printf 'AuthInfo=cred_expire=10\nSchedulerParameters=bf_interval=5\nJobRequeue=1\nJobAcctGatherFrequency=task=5\nKillWait=10\n' \
  >> /etc/slurm/slurm.conf
scontrol shutdown >/dev/null 2>&1; sleep 3
slurmctld; sleep 2; slurmd; sleep 4
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
       "xattr=$(getfattr --only-values -n trusted.slurmckpt.task "$cg" 2>/dev/null || python3 -c "import os,sys;print(os.getxattr(sys.argv[1],'trusted.slurmckpt.task').decode())" "$cg")"
  for p in $(cat "$cg/cgroup.procs"); do echo "  tree pid $p ($(cat /proc/$p/comm)): $(cat /proc/$p/cgroup)"; done
  for p in $(pgrep -f "slurmckpt-wrap|slurmckpt agent" ); do
    grep -q "job_$j/" /proc/$p/cgroup 2>/dev/null && echo "  helper pid $p ($(tr '\0' ' ' < /proc/$p/cmdline | cut -c1-60)): $(cat /proc/$p/cgroup)"; done
  echo "  scontrol listpids:"; scontrol listpids "$j" | sed 's/^/    /'
  echo "  sstat: $(sstat -n -P -j "$j.batch" -o JobID,MaxRSS,AveCPU,MinCPU,TRESUsageInTot 2>&1)"
  local jc=${cg%/step_batch/*}
  echo "  memory.max job=$(cat "$jc/memory.max") step=$(cat "$jc/step_batch/memory.max" 2>/dev/null)" \
       "memory.peak task=$(cat "$cg/memory.peak" 2>/dev/null) cpuset job=$(cat "$jc/cpuset.cpus.effective")"
}

say "CPU job A (300 MiB memhog, --checkpoint-interval=10s) and job M (--mem=400M, grows after step 100)"
A=$(sub -J cg2A -o A.out --mem=1G --checkpoint-interval=10s --wrap "python3 memhog.py --mb 300 --steps 900 --sleep 0.2")
[ -n "${CG2_QUICK:-}" ] || M=$(sub -J cg2M -o M.out --mem=400M --checkpoint-interval=10s --wrap "python3 memhog.py --mb 100 --steps 600 --sleep 0.2 --grow-after 100")
[ -n "${CG2_QUICK:-}" ] || G=$(sub -J cg2G -o G.out --mem=16G --gres=gpu:1 --checkpoint-interval=20s --export=ALL,CUBLAS_WORKSPACE_CONFIG=:4096:8 \
    --wrap "python3 workload_train.py --steps 400 --sleep 0.1")
echo "jobs: A=$A M=$M G=$G"
waitout A 'committed \(interval\)|failed|refused' 45; [ -n "${CG2_QUICK:-}" ] || waitout M 'committed \(interval\)' 90
view "$A" "before the restore"
if [ -n "${CG2_QUICK:-}" ]; then   # a short look: the first job's output and agent log
  grep -v '^memhog step' "$H/A.out" | tail -20; tail -n 30 /var/log/slurmckpt/agent-"$A".batch.0.log | cut -c1-400; exit 0; fi
say "scontrol suspend $A"
scontrol suspend "$A"; sleep 2; s1=$(steps A); echo "user cgroup events: $(cat "$(taskcg "$A")/../cgroup.events" | tr '\n' ' ')"
sleep 5; s2=$(steps A); echo "suspended: memhog step $s1 -> $s2 in 5 s ($( [ "$s1" = "$s2" ] && echo STOPPED || echo MOVED))"
scontrol resume "$A"; sleep 4; echo "resumed: memhog step $(steps A)"
say "requeue A and M (final capture, requeue, restore)"
scontrol requeue "$A"; scontrol requeue "$M"
waitout A 'restored from checkpoint epoch' 150; waitout M 'restored from checkpoint epoch' 150
sleep 6
view "$A" "after the restore"
pidsA=$(cat "$(taskcg "$A")/cgroup.procs"); jcA=$(dirname "$(dirname "$(dirname "$(taskcg "$A")")")")
say "scontrol suspend/resume $A after the restore"
scontrol suspend "$A"; sleep 2; s1=$(steps A); sleep 5; s2=$(steps A); scontrol resume "$A"
echo "suspended: memhog step $s1 -> $s2 in 5 s ($( [ "$s1" = "$s2" ] && echo STOPPED || echo MOVED))"
sleep 3
say "scancel $A"
scancel "$A"; for _ in $(seq 30); do [ -z "$(jstate "$A")" ] && break; sleep 1; done; sleep 2
alive=""; for p in $pidsA; do [ -e /proc/$p ] && alive="$alive $p"; done
echo "after scancel: state='$(jstate "$A")' tree pids left: '${alive}' job cgroup $jcA $( [ -d "$jcA" ] && echo STILL THERE || echo removed by Slurm)"
say "job M (--mem=400M) after its restore"
mcg=$(taskcg "$M"); echo "M task cgroup $mcg: $(cat "$mcg/cgroup.procs" 2>/dev/null | tr '\n' ' ')"
for _ in $(seq 90); do [ -z "$(jstate "$M")" ] && break; sleep 1; done
echo "M: state now '$(jstate "$M")', last memhog step $(steps M); $(grep -iE 'oom|out of memory|killed' "$H/M.out" | tail -3)"
grep -E "oom|OOM" /var/log/slurm/slurmd.log | tail -3
say "GPU job G"
waitout G 'committed \(interval\)' 120 && { view "$G" "before the restore"; scontrol requeue "$G";
  waitout G 'restored from checkpoint epoch' 200 && { sleep 5; view "$G" "after the restore"; }; }
pidsG=$(cat "$(taskcg "$G")/cgroup.procs" 2>/dev/null); scancel "$G"; sleep 8
alive=""; for p in $pidsG; do [ -e /proc/$p ] && alive="$alive $p"; done; echo "after scancel G: tree pids left: '$alive'"
say "outputs"
for f in A M G; do echo "--- $f.out (grep)"; grep -vE '^(memhog step|step [0-9]+ loss)' "$H/$f.out" | tail -25; done
echo "--- slurmd.log errors"; grep -iE "error|rmdir|unable" /var/log/slurm/slurmd.log | tail -20
echo "--- agent logs"; tail -n 15 /var/log/slurmckpt/*.log 2>/dev/null | cut -c1-220 | tail -60
say "done"
