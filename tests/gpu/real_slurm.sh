#!/bin/bash
# The GPU machine's proof under a real Slurm, one script (root, repo root, pure cgroup v2, no network):
# Slurm 22.05 (carried .debs, tests/gpu/slurm_config.sh) with proctrack/slurmckpt over proctrack/cgroup, task/cgroup,
# jobacct_gather/cgroup, cgroup/v2 and the GPU as GRES, the slurmckpt SPANK plugin in plugstack.conf, then
# real `sbatch --checkpoint-interval` jobs, each captured periodically, `scontrol requeue`d mid-run and
# restored:
#   A  CPU, 300 MiB held: where the tree sits (/proc/PID/cgroup), scontrol listpids, sstat MaxRSS/CPU,
#      scontrol suspend/resume, scancel and Slurm's cgroup cleanup, before and after the restore;
#   M  --mem=400M, grows past it only after the restore: Slurm's memory limit holds for the restored tree;
#   G  PyTorch training (tests/gpu/workload_train.py)        J  JAX training (workload_jax.py)
#   C  CuPy iteration (workload_cupy.py)                     P  PyTorch CUDA graph + DataLoader worker pool
#                                                               (workload_graph_loader.py)
#   each GPU job's step lines are compared with an uninterrupted run of the same program (run beside, as
#   root, outside Slurm): IDENTICAL or the first difference.
#   prepare (Debian 12 dev machine): tests/gpu/carry.sh     run there: bash tests/gpu/real_slurm.sh
# Output: $OUT/real-slurm.txt (written as it goes: a cut-off run still returns what it saw) and
# $OUT/real-slurm-logs.tar.gz (job outputs, agent logs, slurmd log). sacct needs slurmdbd + a database, which
# the machine has not: sstat's CPU columns stand in for TotalCPU.
set -u
OUT=${OUT:-/tmp/real-slurm-out}; mkdir -p "$OUT"
exec > >(tee -a "$OUT/real-slurm.txt") 2>&1
T0=$SECONDS
DEADLINE=${REAL_SLURM_DEADLINE:-500}       # seconds after which the GPU cycles stop waiting
say() { echo "=== [$((SECONDS - T0))s] $*"; }

say "slurm (tests/gpu/slurm_config.sh), slurmckpt staged"
bash tests/gpu/slurm_config.sh .carry/slurmdebs 2>&1 | tail -3
DEVICE_USER=ckptgpu STAGE=/opt/slurmckpt-stage PY=$(command -v python3)
. tests/gpu/device_setup.sh >/dev/null
install -D -m 755 -t /usr/local/lib/slurmckpt .carry/slurmckpt_spank.so .carry/proctrack_slurmckpt.so
mkdir -p /opt/slurmckpt/venv/bin
ep() { printf '#!%s\nimport sys\nsys.path.insert(0, "%s/src")\nfrom %s import main\nsys.exit(main())\n' \
  "$PY" "$STAGE" "$2" > "/opt/slurmckpt/venv/bin/$1"; chmod 755 "/opt/slurmckpt/venv/bin/$1"; }
ep slurmckpt slurmckpt.cli; ep slurmckpt-wrap slurmckpt.wrapper
sed "s#@SPANK_PREFIX@##" etc/plugstack.conf.in | grep -v '^#' > /etc/slurm/plugstack.conf
slurmctld; sleep 1; slurmd; sleep 3
sinfo -h; grep -v '^#' /etc/slurm/cgroup.conf | tr '\n' ' '; echo
grep -E '^(ProctrackType|TaskPlugin|JobAcctGatherType|KillWait)' /etc/slurm/slurm.conf | tr '\n' ' '; echo
(cd /tmp && asuser "$PY" -c 'import zstandard, pynvml, slurmckpt.wrapper; print("zstandard", zstandard.__version__, "pynvml ok")')

H=/home/$DEVICE_USER/rs; rm -rf "$H"; mkdir -p "$H/ref"    # a second run must not append to the first's outputs
cp "$STAGE"/tests/integration/workloads/memhog.py "$STAGE"/tests/gpu/workload_{train,jax,cupy,graph_loader}.py "$H/"
chown -R "$DEVICE_USER": "$H"
TORCH_ENV=CUBLAS_WORKSPACE_CONFIG=:4096:8
JAX_ENV="XLA_FLAGS=--xla_gpu_deterministic_ops=true --xla_gpu_autotune_level=0"
declare -A PROG=([G]=workload_train.py [J]=workload_jax.py [C]=workload_cupy.py [P]=workload_graph_loader.py)
declare -A ENVS=([G]=$TORCH_ENV [J]=$JAX_ENV [C]="" [P]=$TORCH_ENV)
GPU_STEPS=${GPU_STEPS:-250}

say "uninterrupted reference runs (beside, outside Slurm, as the user)"
REF_PIDS=()
for j in G J C P; do
  (cd "$H" && runuser -u "$DEVICE_USER" -- env ${ENVS[$j]:+"${ENVS[$j]}"} XLA_PYTHON_CLIENT_PREALLOCATE=false \
     "$PY" "${PROG[$j]}" --steps "$GPU_STEPS" > "$H/ref/$j.out" 2>&1; echo "rc=$?" >> "$H/ref/$j.out") &
  REF_PIDS+=($!)
done

sub() { (cd "$H" && runuser -u "$DEVICE_USER" -- sbatch --parsable --open-mode=append "$@"); }
taskcg() { ls -d /sys/fs/cgroup/system.slice/*slurmstepd.scope/job_"$1"/step_batch/user/task_0 2>/dev/null | head -1; }
jstate() { squeue -h -j "$1" -o %T 2>/dev/null; }
waitout() { for _ in $(seq "$3"); do grep -qE "$2" "$H/$1.out" 2>/dev/null && return 0; sleep 1; done; echo "TIMEOUT waiting for /$2/ in $1.out"; return 1; }
steps() { grep -oE 'memhog step [0-9]+' "$H/$1.out" | tail -1 | awk '{print $3}'; }

view() {   # JOB WHEN: Slurm's view of the checkpointed job
  local j=$1 cg; cg=$(taskcg "$j"); say "job $j $2: Slurm's task cgroup $cg"
  [ -n "$cg" ] || { echo "  no task cgroup"; return; }
  echo "task cgroup procs: $(tr '\n' ' ' < "$cg/cgroup.procs")  cgroup.freeze=$(cat "$cg/cgroup.freeze")"
  for p in $(cat "$cg/cgroup.procs"); do echo "  tree pid $p ($(cat /proc/$p/comm)): $(cat /proc/$p/cgroup)"; done
  echo "  scontrol listpids:"; scontrol listpids "$j" | sed 's/^/    /'
  echo "  sstat: $(sstat -n -P -j "$j.batch" -o JobID,MaxRSS,AveCPU,MinCPU 2>&1)"
  local jc=${cg%/step_batch/*}
  echo "  memory.max job=$(cat "$jc/memory.max") memory.peak task=$(cat "$cg/memory.peak" 2>/dev/null)" \
       "cpuset job=$(cat "$jc/cpuset.cpus.effective") devices: $(ls "$jc" | grep -c bpf || true)"
}
suspended() {   # JOB NAME: do the steps advance while Slurm has the job suspended?
  scontrol suspend "$1"; sleep 1; local s1; s1=$(steps "$2"); sleep 4; local s2; s2=$(steps "$2"); scontrol resume "$1"
  echo "scontrol suspend: memhog step $s1 -> $s2 in 4 s ($( [ "$s1" = "$s2" ] && echo STOPPED || echo MOVED))"
}
gpu_cycle() {  # NAME JOBID: periodic capture, requeue mid-run, restore, run to the end; own log
  local n=$1 id=$2 end=$((T0 + DEADLINE))
  {
    waitout "$n" 'committed \(interval\)|FAILED|refused|ABORTED' $((end - SECONDS)) || return
    echo "[$((SECONDS - T0))s] $n: $(grep -E 'committed \(interval\)|FAILED|refused|ABORTED' "$H/$n.out" | head -2)"
    view "$id" "($n) before the requeue"
    echo "[$((SECONDS - T0))s] $n: requeue at $(grep -c '^step ' "$H/$n.out") step lines"; scontrol requeue "$id"
    waitout "$n" 'restored from checkpoint epoch|FAILED|fresh' $((end - SECONDS))
    echo "[$((SECONDS - T0))s] $n: $(grep -E 'restored from checkpoint epoch|FAILED|fresh' "$H/$n.out" | head -3)"
    sleep 2; view "$id" "($n) after the restore"
    waitout "$n" '^DONE' $((end - SECONDS)); echo "[$((SECONDS - T0))s] $n: state '$(jstate "$id")'"
  } > "$OUT/cycle-$n.txt" 2>&1
}

say "submit A (300 MiB memhog), M (--mem=400M, grows from step 350), G J C P (one GPU each, in turn)"
A=$(sub -J rsA -o A.out --mem=1G --checkpoint-interval=10s --wrap "python3 memhog.py --mb 300 --steps 900 --sleep 0.2")
M=$(sub -J rsM -o M.out --mem=400M --checkpoint-interval=10s --wrap "python3 memhog.py --mb 100 --steps 900 --sleep 0.2 --grow-after 350")
declare -A ID
for j in G J C P; do
  ID[$j]=$(sub -J "rs$j" -o "$j.out" --mem=24G --gres=gpu:1 --checkpoint-interval=10s \
           --export="ALL${ENVS[$j]:+,${ENVS[$j]}}" --wrap "$PY ${PROG[$j]} --steps $GPU_STEPS --sleep 0.1")
done
echo "jobs: A=$A M=$M G=${ID[G]} J=${ID[J]} C=${ID[C]} P=${ID[P]}"
CYCLE_PIDS=()
for j in G J C P; do gpu_cycle "$j" "${ID[$j]}" & CYCLE_PIDS+=($!); done

waitout A 'committed \(interval\)|failed|refused|ABORTED' 40
view "$A" "before the restore"
grep -v '^memhog step' "$H/A.out" | tail -3
say "requeue A and M (final capture, requeue, restore)"
scontrol requeue "$A"; scontrol requeue "$M"
waitout A 'restored from checkpoint epoch' 90; sleep 3
view "$A" "after the restore"
suspended "$A" A
pidsA=$(cat "$(taskcg "$A")/cgroup.procs"); jcA=$(dirname "$(dirname "$(dirname "$(taskcg "$A")")")")
say "scancel $A"
scancel "$A"; for _ in $(seq 15); do [ -z "$(jstate "$A")" ] && break; sleep 1; done; sleep 1
alive=""; for p in $pidsA; do [ -e /proc/$p ] && alive="$alive $p"; done
echo "after scancel: state='$(jstate "$A")' tree pids left: '${alive}' job cgroup $jcA $( [ -d "$jcA" ] && echo STILL THERE || echo removed by Slurm)"
say "M (--mem=400M) after its restore: $(grep -c 'restored from checkpoint' "$H/M.out") restore(s), state '$(jstate "$M")', last step $(steps M)"
for _ in $(seq 20); do [ -z "$(jstate "$M")" ] && break; sleep 1; done
echo "M: state now '$(jstate "$M")', last memhog step $(steps M); $(grep -iE 'oom|out of memory|killed' "$H/M.out" | tail -2)"

say "waiting for the GPU jobs' cycles (deadline ${DEADLINE}s)"
wait "${CYCLE_PIDS[@]}" "${REF_PIDS[@]}"     # (a bare wait would also wait for the tee above)
for j in G J C P; do
  say "GPU job $j (${PROG[$j]}, job ${ID[$j]})"; cat "$OUT/cycle-$j.txt"
  grep -vE '^step [0-9]+ ' "$H/$j.out" | tail -8
  if cmp -s <(grep -E '^step [0-9]+ ' "$H/$j.out") <(grep -E '^step [0-9]+ ' "$H/ref/$j.out"); then
    echo "$j RESULT: IDENTICAL to the uninterrupted run ($(grep -cE '^step [0-9]+ ' "$H/$j.out") step lines)" \
         "$(grep -c 'restored from checkpoint epoch' "$H/$j.out") restore(s), $(grep -E '^MAGIC' "$H/$j.out")"
  else
    echo "$j RESULT: DIFFERS: job $(grep -cE '^step [0-9]+ ' "$H/$j.out") vs reference $(grep -cE '^step [0-9]+ ' "$H/ref/$j.out") step lines; first difference:"
    diff <(grep -E '^step [0-9]+ ' "$H/$j.out") <(grep -E '^step [0-9]+ ' "$H/ref/$j.out") | head -4
    tail -3 "$H/ref/$j.out"
  fi
done
squeue; scancel -u "$DEVICE_USER"
echo "--- slurmd.log errors"; grep -iE "error|rmdir|unable" /var/log/slurm/slurmd.log | tail -8
tar -czf "$OUT/real-slurm-logs.tar.gz" -C / "${H#/}" var/log/slurm var/log/slurmckpt 2>/dev/null
say "done"
