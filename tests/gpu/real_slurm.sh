#!/bin/bash
# The GPU machine's proof under a real Slurm, one script (root, repo root, pure cgroup v2, no network):
# Slurm 22.05 (carried .debs, tests/gpu/slurm_config.sh) with proctrack/slurmckpt over proctrack/cgroup, task/cgroup,
# jobacct_gather/cgroup, cgroup/v2 and the GPU as GRES, the slurmckpt SPANK plugin in plugstack.conf, then
# real `sbatch --checkpoint-interval` jobs, each captured periodically, `scontrol requeue`d mid-run and
# restored:
#   A  CPU, 300 MiB held: where the tree sits (/proc/PID/cgroup), scontrol listpids, sstat MaxRSS/CPU,
#      scontrol suspend/resume (output lines and the cgroup's CPU time while suspended), scancel and Slurm's
#      cgroup cleanup, before and after the restore;
#   M  --mem=400M, grows past it only after the restore: Slurm's memory limit holds for the restored tree;
#   D  no --gres: opens /dev/nvidia0 every step (workload_devices.py): ConstrainDevices denies it before and
#      after the restore (the same program run outside Slurm may open it);
#   L  --gres=gpu:1 holding 100 GiB on the GPU (workload_hold.py): what the capture says about that size;
#   G  PyTorch training (tests/gpu/workload_train.py)        J  JAX training (workload_jax.py)
#   C  CuPy iteration (workload_cupy.py)                     P  PyTorch CUDA graph + DataLoader worker pool
#                                                               started by spawn (workload_graph_loader.py)
#   each GPU job's step lines are compared with an uninterrupted run of the same program (run beside, as
#   root, outside Slurm): IDENTICAL or the first difference.
#   prepare (Debian 12 dev machine): tests/gpu/carry.sh     run there: bash tests/gpu/real_slurm.sh
# Output: $OUT/real-slurm.txt (written as it goes: a cut-off run still returns what it saw) and
# $OUT/real-slurm-logs.tar.gz (job outputs, agent logs, slurmd log). sacct needs slurmdbd + a database, which
# the machine has not: sstat's CPU columns stand in for TotalCPU.
#   RS_GPU_JOBS="J" runs only those GPU jobs (default "G J C P"), RS_LARGE=0 leaves L out; RS_ALLOW_JAX=1
#   removes the JAX refusal from the staged copy (an experiment: what a JAX job's capture does under Slurm).
#   RS_THROUGHPUT=S:I runs instead the throughput comparison: workload_throughput.py (TP_MAGIC_MIB, default
#   4096 MiB on the GPU beside the model) as a plain job for S seconds, then with --checkpoint-interval=Is for
#   the same steps; tests/gpu/throughput_report.py compares them.
set -u
GPU_JOBS=${RS_GPU_JOBS:-G J C P}
[ -n "${RS_THROUGHPUT:-}" ] && GPU_JOBS="" RS_LARGE=0
OUT=${OUT:-/tmp/real-slurm-out}; mkdir -p "$OUT"
exec > >(tee -a "$OUT/real-slurm.txt") 2>&1
T0=$SECONDS
DEADLINE=${REAL_SLURM_DEADLINE:-500}       # seconds after which the GPU cycles stop waiting
say() { echo "=== [$((SECONDS - T0))s] $*"; }

say "slurm (tests/gpu/slurm_config.sh), slurmckpt staged"
bash tests/gpu/slurm_config.sh .carry/slurmdebs 2>&1 | tail -3
DEVICE_USER=ckptgpu STAGE=/opt/slurmckpt-stage PY=$(command -v python3)
. tests/gpu/device_setup.sh >/dev/null
[ "${RS_ALLOW_JAX:-0}" = 1 ] && sed -i 's/if framework_of(pid) == "jax":/if False:  # RS_ALLOW_JAX/' \
  "$STAGE/src/slurmckpt/cuda/procscan.py" && echo "EXPERIMENT: the JAX refusal is off in $STAGE"
install -D -m 755 -t /usr/local/lib/slurmckpt .carry/slurmckpt_spank.so .carry/proctrack_slurmckpt.so
mkdir -p /opt/slurmckpt/venv/bin
ep() { printf '#!%s\nimport sys\nsys.path.insert(0, "%s/src")\nfrom %s import main\nsys.exit(main())\n' \
  "$PY" "$STAGE" "$2" > "/opt/slurmckpt/venv/bin/$1"; chmod 755 "/opt/slurmckpt/venv/bin/$1"; }
ep slurmckpt slurmckpt.cli; ep slurmckpt-wrap slurmckpt.task.wrapper
sed "s#@SPANK_PREFIX@##" etc/plugstack.conf.in | grep -v '^#' > /etc/slurm/plugstack.conf
slurmctld; sleep 1; slurmd; sleep 3
sinfo -h; grep -v '^#' /etc/slurm/cgroup.conf | tr '\n' ' '; echo
grep -E '^(ProctrackType|TaskPlugin|JobAcctGatherType|KillWait)' /etc/slurm/slurm.conf | tr '\n' ' '; echo
(cd /tmp && asuser "$PY" -c 'import zstandard, pynvml, slurmckpt.task.wrapper; print("zstandard", zstandard.__version__, "pynvml ok")')

H=/home/$DEVICE_USER/rs; rm -rf "$H"; mkdir -p "$H/ref"    # a second run must not append to the first's outputs
cp "$STAGE"/tests/integration/workloads/memhog.py "$STAGE"/tests/gpu/workload_{train,jax,cupy,graph_loader,devices,hold}.py "$H/"
mkdir -p "$H/ctlL"
chown -R "$DEVICE_USER": "$H"
TORCH_ENV=CUBLAS_WORKSPACE_CONFIG=:4096:8
JAX_ENV="XLA_FLAGS=--xla_gpu_deterministic_ops=true --xla_gpu_autotune_level=0"
declare -A PROG=([G]=workload_train.py [J]=workload_jax.py [C]=workload_cupy.py [P]="workload_graph_loader.py --mp spawn"
                 [K]=workload_jax.py [Q]=workload_jax.py [W]=workload_jax.py)
# K, Q and W: JAX variants for the RS_ALLOW_JAX experiment (no CUDA graphs; XLA's platform allocator; 8 CPUs)
declare -A ENVS=([G]=$TORCH_ENV [J]=$JAX_ENV [C]="" [P]=$TORCH_ENV [K]="$JAX_ENV --xla_gpu_enable_command_buffer="
                 [Q]=XLA_PYTHON_CLIENT_ALLOCATOR=platform [W]=$JAX_ENV)
declare -A SBATCH_MORE=([W]=--cpus-per-task=8)   # W: J with 8 CPUs instead of Slurm's default one
GPU_STEPS=${GPU_STEPS:-200}

say "uninterrupted reference runs (beside, outside Slurm, as the user)"
REF_PIDS=()
for j in $GPU_JOBS; do
  (cd "$H" && runuser -u "$DEVICE_USER" -- env ${ENVS[$j]:+"${ENVS[$j]}"} XLA_PYTHON_CLIENT_PREALLOCATE=false \
     "$PY" ${PROG[$j]} --steps "$GPU_STEPS" > "$H/ref/$j.out" 2>&1; echo "rc=$?" >> "$H/ref/$j.out") &
  REF_PIDS+=($!)
done

sub() { (cd "$H" && runuser -u "$DEVICE_USER" -- sbatch --parsable --open-mode=append "$@"); }
taskcg() { ls -d /sys/fs/cgroup/system.slice/*slurmstepd.scope/job_"$1"/step_batch/user/task_0 2>/dev/null | head -1; }
jstate() { squeue -h -j "$1" -o %T 2>/dev/null; }
waitout() { for _ in $(seq "$3"); do grep -qE "$2" "$H/$1.out" 2>/dev/null && return 0; sleep 1; done; echo "TIMEOUT waiting for /$2/ in $1.out"; return 1; }
steps() { grep -oE 'memhog step [0-9]+' "$H/$1.out" | tail -1 | awk '{print $3}'; }

if [ -n "${RS_THROUGHPUT:-}" ]; then
  IFS=: read -r TS TI <<< "$RS_THROUGHPUT"
  cp "$STAGE"/tests/gpu/workload_throughput.py "$H/"; chown "$DEVICE_USER": "$H/workload_throughput.py"
  TP="$PY workload_throughput.py --magic-mib ${TP_MAGIC_MIB:-4096}"
  ended() { for _ in $(seq "$2"); do [ -z "$(jstate "$1")" ] && return 0; sleep 2; done; echo "job $1 still running"; }
  say "throughput OFF: plain sbatch --gres=gpu:1, --seconds $TS"
  J=$(sub -J tpOFF -o OFF.out --mem=48G --gres=gpu:1 --export="ALL,$TORCH_ENV" --wrap "$TP --seconds $TS")
  ended "$J" $(( (TS + 120) / 2 ))
  N=$(grep -cE '^step [0-9]+ ' "$H/OFF.out")
  say "throughput ON: --checkpoint-interval=${TI}s, --steps $N"
  J=$(sub -J tpON -o ON.out --mem=48G --gres=gpu:1 --checkpoint-interval="${TI}s" --export="ALL,$TORCH_ENV" \
      --wrap "$TP --steps $N")
  ended "$J" $(( (2 * TS + 200) / 2 ))
  grep -vE '^step [0-9]+ ' "$H/OFF.out" | head -3
  grep -vE '^step [0-9]+ ' "$H/ON.out" | tail -20
  "$PY" tests/gpu/throughput_report.py "$H/OFF.out" "$H/ON.out" "$TI"
  squeue; scancel -u "$DEVICE_USER"; say "done"
  exit 0
fi

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
usage() { awk '/^usage_usec/ {print $2}' "$1/cpu.stat"; }
lines() { wc -l < "$H/$1.out"; }
suspended() {   # JOB NAME: does the workload stop while Slurm has the job suspended, and run again after?
  # Slurm's suspend sends SIGTSTP, waits, then stops the step (cgroup freeze on v2): measured from 3 s after
  local cg l0 l1 l2 l3 u1 u2 u3; cg=$(taskcg "$1")
  [ -n "$cg" ] || { echo "scontrol suspend: no task cgroup for job $1"; return; }
  l0=$(lines "$2"); sleep 2; l1=$(lines "$2")
  echo "  running: $((l1 - l0)) output lines in 2 s"
  scontrol suspend "$1"; sleep 3
  l1=$(lines "$2"); u1=$(usage "$cg"); sleep 4; l2=$(lines "$2"); u2=$(usage "$cg")
  echo "  suspended: squeue state '$(jstate "$1")', frozen: step $(awk '/frozen/ {print $2}' "${cg%/user/*}/cgroup.events")" \
       "user $(awk '/frozen/ {print $2}' "${cg%/task_0}/cgroup.events") task $(awk '/frozen/ {print $2}' "$cg/cgroup.events")," \
       "task states: $(for p in $(cat "$cg/cgroup.procs"); do awk '{printf "%s ", $3}' /proc/$p/stat; done)"
  scontrol resume "$1"; sleep 3; l3=$(lines "$2"); u3=$(usage "$cg")
  local verdict=STOPPED; { [ "$l1" != "$l2" ] || [ $((u2 - u1)) -gt 50000 ]; } && verdict=MOVED
  local after="RUNS AGAIN"; [ "$l2" = "$l3" ] && after="STILL STOPPED"
  echo "scontrol suspend: $((l2 - l1)) output lines and $(( (u2 - u1) / 1000 )) ms CPU in 4 s suspended ($verdict);" \
       "after resume: $((l3 - l2)) lines, $(( (u3 - u2) / 1000 )) ms CPU in 3 s ($after)"
}
gpu_cycle() {  # NAME JOBID: periodic capture, requeue mid-run, restore, run to the end; own log
  local n=$1 id=$2 end=$((T0 + DEADLINE))
  {
    waitout "$n" 'committed \(interval\)|FAILED|refused|ABORTED' $((end - SECONDS)) || return
    echo "[$((SECONDS - T0))s] $n: $(grep -E 'committed \(interval\)|FAILED|refused|ABORTED' "$H/$n.out" | head -2)"
    view "$id" "($n) before the requeue"
    local old; old=$(cat "$(taskcg "$id")/cgroup.procs" 2>/dev/null)
    echo "[$((SECONDS - T0))s] $n: requeue (held) at $(grep -c '^step ' "$H/$n.out") step lines"
    scontrol requeuehold "$id"
    # the restore must not need the old host pids: they are taken before the job is released
    for _ in $(seq 60); do [ "$(jstate "$id")" = PENDING ] && break; sleep 1; done
    for _ in $(seq 30); do busy=""; for p in $old; do [ -e /proc/$p ] && busy=1; done; [ -z "$busy" ] && break; sleep 1; done
    echo "[$((SECONDS - T0))s] $n: held; the tree's old host pids: $(echo $old)"
    "$PY" tests/gpu/take_pids.py "$OUT/taken-pids" $old
    scontrol release "$id"
    waitout "$n" 'restored from checkpoint epoch|FAILED|fresh|beginning' $((end - SECONDS))
    echo "[$((SECONDS - T0))s] $n: $(grep -E 'restored from checkpoint epoch|FAILED|fresh' "$H/$n.out" | head -3)"
    sleep 2; view "$id" "($n) after the restore"
    for p in $old; do echo "  old pid $p now: $(cat /proc/$p/comm 2>/dev/null || echo free)"; done
    for p in $(cat "$(taskcg "$id")/cgroup.procs" 2>/dev/null); do echo "  restored $p: $(grep NSpid /proc/$p/status)"; done
    waitout "$n" '^DONE' $((end - SECONDS)); echo "[$((SECONDS - T0))s] $n: state '$(jstate "$id")'"
  } > "$OUT/cycle-$n.txt" 2>&1
}

say "submit A (300 MiB memhog), M (--mem=400M, grows from step 350), D (devices), L (100 GiB GPU), G J C P (one GPU each)"
A=$(sub -J rsA -o A.out --mem=1G --checkpoint-interval=10s --wrap "python3 memhog.py --mb 300 --steps 900 --sleep 0.2")
M=$(sub -J rsM -o M.out --mem=400M --checkpoint-interval=10s --wrap "python3 memhog.py --mb 100 --steps 900 --sleep 0.2 --grow-after 350")
D=$(sub -J rsD -o D.out --mem=1G --checkpoint-interval=10s --wrap "$PY workload_devices.py --steps 600 --sleep 0.2")
(cd "$H" && runuser -u "$DEVICE_USER" -- "$PY" workload_devices.py --steps 1 > "$H/ref/D.out" 2>&1)
declare -A ID
for j in $GPU_JOBS; do
  ID[$j]=$(sub -J "rs$j" -o "$j.out" --mem=24G --gres=gpu:1 --checkpoint-interval=10s ${SBATCH_MORE[$j]:-} \
           --export="ALL${ENVS[$j]:+,${ENVS[$j]}}" --wrap "$PY ${PROG[$j]} --steps $GPU_STEPS --sleep 0.1")
done
echo "jobs: A=$A M=$M D=$D $(for j in $GPU_JOBS; do printf '%s=%s ' "$j" "${ID[$j]}"; done)"
[ "${RS_LARGE:-1}" = 1 ] && L=$(sub -J rsL -o L.out --mem=24G --gres=gpu:1 --checkpoint-interval=10s --wrap "$PY workload_hold.py --gib 100 --tick 0.5 --ctl $H/ctlL")
large_check() {   # L runs after the other GPU jobs (one GPU): what its capture says, then cancel it
  waitout L 'refused|FAILED|ABORTED|committed' $((T0 + DEADLINE - SECONDS)) > "$OUT/cycle-L.txt" 2>&1
  { echo "[$((SECONDS - T0))s] L (100 GiB on the GPU, --mem=24G):"; grep -vE '^hb ' "$H/L.out" | tail -6
    scancel "$L"; } >> "$OUT/cycle-L.txt" 2>&1
}
CYCLE_PIDS=()
for j in $GPU_JOBS; do gpu_cycle "$j" "${ID[$j]}" & CYCLE_PIDS+=($!); done
[ "${RS_LARGE:-1}" = 1 ] && { large_check & CYCLE_PIDS+=($!); }

waitout A 'committed \(interval\)|failed|refused|ABORTED' 40
view "$A" "before the restore"
grep -v '^memhog step' "$H/A.out" | tail -3
say "scontrol suspend/resume of A before its restore"; suspended "$A" A
waitout D 'committed \(interval\)|failed|refused|ABORTED' 40
say "requeue A, M and D (final capture, requeue, restore)"
scontrol requeue "$A"; scontrol requeue "$M"; scontrol requeue "$D"
waitout A 'restored from checkpoint epoch' 90; sleep 5
view "$A" "after the restore"
say "scontrol suspend/resume of A after its restore"; suspended "$A" A
waitout D 'restored from checkpoint epoch' 60; sleep 3
say "D (no --gres, ConstrainDevices=yes): /dev/nvidia0 from the job's own tree"
grep -vE '^devices step' "$H/D.out" | tail -4
awk '/restored from checkpoint epoch/ {r=1} /^devices step/ {split($4, a, "="); n[(r ? "after" : "before") " the restore: " a[2]]++}
     END {for (k in n) print "  " k " x" n[k]}' "$H/D.out" | sort
echo "  the same program outside Slurm, as the same user: $(grep '^devices step' "$H/ref/D.out")"
pidsA=$(cat "$(taskcg "$A")/cgroup.procs"); jcA=$(dirname "$(dirname "$(dirname "$(taskcg "$A")")")")
say "scancel $A"
scancel "$A"; for _ in $(seq 15); do [ -z "$(jstate "$A")" ] && break; sleep 1; done; sleep 1
alive=""; for p in $pidsA; do [ -e /proc/$p ] && alive="$alive $p"; done
echo "after scancel: state='$(jstate "$A")' tree pids left: '${alive}' job cgroup $jcA $( [ -d "$jcA" ] && echo STILL THERE || echo removed by Slurm)"
say "M (--mem=400M) after its restore: $(grep -c 'restored from checkpoint' "$H/M.out") restore(s), state '$(jstate "$M")', last step $(steps M)"
for _ in $(seq 20); do [ -z "$(jstate "$M")" ] && break; sleep 1; done
echo "M: state now '$(jstate "$M")', last memhog step $(steps M); $(grep -iE 'oom|out of memory|killed' "$H/M.out" | tail -2)"

scancel "$D"
say "waiting for the GPU jobs' cycles (deadline ${DEADLINE}s)"
wait "${CYCLE_PIDS[@]}" "${REF_PIDS[@]}"     # (a bare wait would also wait for the tee above)
for j in $GPU_JOBS; do
  say "GPU job $j (${PROG[$j]}, job ${ID[$j]})"; cat "$OUT/cycle-$j.txt"; rm -f "$OUT/cycle-$j.txt"
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
[ "${RS_LARGE:-1}" = 1 ] && { say "L: job $L"; cat "$OUT/cycle-L.txt"; rm -f "$OUT/cycle-L.txt"; }
squeue; scancel -u "$DEVICE_USER"
[ -f "$OUT/taken-pids" ] && xargs -r kill < "$OUT/taken-pids"
echo "--- slurmd.log errors"; grep -iE "error|rmdir|unable" /var/log/slurm/slurmd.log | tail -8
tar -czf "$OUT/real-slurm-logs.tar.gz" -C / "${H#/}" var/log/slurm var/log/slurmckpt 2>/dev/null
# what comes back from the machine is capped (16 MiB a file): the agent logs and slurmd's log alone then
[ "$(stat -c %s "$OUT/real-slurm-logs.tar.gz")" -lt 15000000 ] ||
  tar -czf "$OUT/real-slurm-logs.tar.gz" -C / var/log/slurm var/log/slurmckpt 2>/dev/null
say "done"
