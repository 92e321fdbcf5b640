#!/bin/bash
# The GPU coverage matrix, one command on the GPU machine (root, repo root, pure cgroup v2, no network, no
# iptables): the same Slurm as tests/gpu/real_slurm.sh (carried Debian 12 Slurm 22.05, proctrack/slurmckpt
# over proctrack/cgroup, task/cgroup, the GPU as GRES), then for each row a real `sbatch --gres=gpu:1
# --checkpoint-interval=10s` job of a program as users run it, captured at an interval, `scontrol requeue`d
# mid-run (twice for torch.distributed), restored, and its lines compared with an uninterrupted run of the
# same program beside it (outside Slurm, as the same user): IDENTICAL, DIFFERS, REFUSED (with the cause the
# job's output names, for what no transparent mechanism brings back), NOT-MID-RUN (the program ended before the
# requeue could come mid-run: the row proves nothing), IDENTICAL-AFTER-1-OF-2-REQUEUES (the same, for the
# second requeue of T) or FAILED.
#   GM_ROWS="G T W ..." picks rows (default: all), in that order (one GPU: Slurm runs them one at a time).
#   G PyTorch training + an NVML monitor beside it     T DDP over gloo, srun -n2 on one GPU, requeued twice
#   W CUDA graph + DataLoader workers, default fork    P the same with workers started by spawn
#   X torch.compile (Inductor's compile workers)       L PyTorch Lightning (mpi4py installed where it is)
#   H Hugging Face generation loop (KV cache)          I inference server, sessions on the GPU, client outside
#   C CuPy                                             J JAX
#   R torchrun --standalone, 2 workers on one GPU, DataLoader fork workers with pin_memory, requeued twice
#   A accelerate launch (Accelerator, DataLoader workers), requeued twice
#   B 16 GiB on the GPU, Slurm's default KillWait=30, requeued twice (the requeue's capture committed, or
#     skipped and said)                                M 16 GiB with --mem=24G: refused at the first capture
#   V CUDA IPC (an actor/learner pair, torch.multiprocessing): refused naming both pids
# Output: $OUT/gpu-matrix.txt (as it goes) and $OUT/gpu-coverage.md (the table), $OUT/gpu-matrix-logs.tar.gz.
#   prepare (Debian 12 dev machine): tests/gpu/carry.sh
set -u
ROWS=${GM_ROWS:-G T W P X L H I C J}
OUT=${OUT:-/tmp/gpu-matrix-out}; mkdir -p "$OUT"
exec > >(tee -a "$OUT/gpu-matrix.txt") 2>&1
T0=$SECONDS; DEADLINE=${GM_DEADLINE:-480}; STEPS=${GM_STEPS:-200}
say() { echo "=== [$((SECONDS - T0))s] $*"; }

say "slurm (tests/gpu/slurm_config.sh), slurmckpt staged"
bash tests/gpu/slurm_config.sh .carry/slurmdebs 2>&1 | tail -2
DEVICE_USER=ckptgpu STAGE=/opt/slurmckpt-stage PY=$(command -v python3); BIN=$(dirname "$PY")
. tests/gpu/device_setup.sh >/dev/null
install -D -m 755 -t /usr/local/lib/slurmckpt .carry/slurmckpt_spank.so .carry/proctrack_slurmckpt.so
mkdir -p /opt/slurmckpt/venv/bin
ep() { printf '#!%s\nimport sys\nsys.path.insert(0, "%s/src")\nfrom %s import main\nsys.exit(main())\n' \
  "$PY" "$STAGE" "$2" > "/opt/slurmckpt/venv/bin/$1"; chmod 755 "/opt/slurmckpt/venv/bin/$1"; }
ep slurmckpt slurmckpt.cli; ep slurmckpt-wrap slurmckpt.task.wrapper
sed "s#@SPANK_PREFIX@##" etc/plugstack.conf.in | grep -v '^#' > /etc/slurm/plugstack.conf
slurmctld; sleep 1; slurmd; sleep 3
echo "iptables: $(command -v iptables-restore || echo none)"; /opt/slurmckpt/venv/bin/slurmckpt doctor 2>&1 | grep -E "network lock|NVIDIA driver"
"$PY" - <<'P' 2>&1 | sed 's/^/  /'
import importlib
for m in ("torch", "lightning", "pytorch_lightning", "mpi4py", "transformers", "cupy", "jax", "pynvml", "triton"):
    try:
        print(m, getattr(importlib.import_module(m), "__version__", "?"))
    except Exception as e:
        print(m, "MISSING", type(e).__name__)
P

H=/home/$DEVICE_USER/gm; rm -rf "$H"; mkdir -p "$H/ref"
cp "$STAGE"/tests/gpu/workload_{train,cupy,jax,graph_loader,compile,lightning,generate,accelerate,ipc_pair}.py "$STAGE"/tests/gpu/nvml_monitor.py \
   "$STAGE"/tests/integration/workloads/{ddp_train,session_worker,session_client}.py "$H/"
chown -R "$DEVICE_USER": "$H"
DET=CUBLAS_WORKSPACE_CONFIG=:4096:8
declare -A NAME=([G]="PyTorch training + NVML monitor" [T]="DDP over gloo, 2 tasks on 1 GPU" \
  [W]="CUDA graph + DataLoader workers (fork)" [P]="CUDA graph + DataLoader workers (spawn)" \
  [X]="torch.compile (Inductor compile workers)" [L]="PyTorch Lightning" [H]="Hugging Face generation, KV cache" \
  [I]="inference server, sessions on the GPU, client outside the job" [C]="CuPy" [J]="JAX" \
  [R]="torchrun, 2 workers on 1 GPU, fork DataLoader workers + pin_memory" [A]="accelerate launch" \
  [B]="16 GiB on the GPU, KillWait=30" [M]="16 GiB on the GPU, --mem too small" \
  [V]="CUDA IPC (torch.multiprocessing actor/learner)")
declare -A CMD=([G]="$PY nvml_monitor.py --seconds 150 & $PY workload_train.py --steps $((STEPS * 3)) --sleep 0.1; wait" \
  [T]="srun -n2 $PY ddp_train.py --device cuda --steps $((STEPS * 3)) --sleep 0.15" \
  [W]="$PY workload_graph_loader.py --steps $((STEPS * 3)) --sleep 0.1" \
  [P]="$PY workload_graph_loader.py --mp spawn --steps $((STEPS * 3)) --sleep 0.1" \
  [X]="$PY workload_compile.py --steps $STEPS --sleep 0.1" [L]="$PY workload_lightning.py --steps $STEPS --sleep 0.1" \
  [H]="$PY workload_generate.py --steps $STEPS --sleep 0.1" \
  [I]="$PY session_worker.py --device cuda --steps 450 --sleep 0.1 --port-file port-I.txt" \
  [C]="$PY workload_cupy.py --steps $((STEPS * 3)) --sleep 0.1" \
  [J]="env XLA_FLAGS=--xla_gpu_deterministic_ops=true $PY workload_jax.py --steps $((STEPS * 4)) --sleep 0.1" \
  [R]="$BIN/torchrun --standalone --nproc_per_node=2 ddp_train.py --device cuda --workers 2 --pin-memory --steps $((STEPS * 3)) --sleep 0.1" \
  [A]="$BIN/accelerate launch --num_processes 1 --num_machines 1 --mixed_precision no --dynamo_backend no workload_accelerate.py --steps $((STEPS * 3)) --sleep 0.1" \
  [B]="$PY workload_train.py --magic-mib 16384 --steps $((STEPS * 3)) --sleep 0.1" \
  [M]="$PY workload_train.py --magic-mib 16384 --steps $STEPS --sleep 0.1" \
  [V]="$PY workload_ipc_pair.py --steps $STEPS --sleep 0.1")
declare -A LINES=([G]='^step [0-9]+ ' [T]='^ddp step' [W]='^step [0-9]+ ' [P]='^step [0-9]+ ' [X]='^step [0-9]+ ' \
  [L]='^step [0-9]+ ' [H]='^step [0-9]+ ' [I]='^worker step' [C]='^step [0-9]+ ' [J]='^step [0-9]+ ' \
  [R]='^ddp step' [A]='^step [0-9]+ ' [B]='^step [0-9]+ ' [M]='^step [0-9]+ ' [V]='^step [0-9]+ ')
# W and P run 3x the steps: their captures (the workers' trees, ~375 MiB) take ~13 s, and at 200 steps the run
# ended before the commit the requeue waits for (both were requeued at their last line on the H100); so do C,
# whose 200 steps took ~20 s, and T, which ended before its second requeue; J runs 4x (at 200 steps it ended
# in 58 s, before a commit after its start-up). J's job sets XLA_FLAGS in its own command, as its reference does: without
# deterministic ops the two differ from step 0 (seen on the H100), and nothing about the restore can be read
# B holds 16 GiB on the GPU: its capture's host copy and page cache need host memory beside the program's own
declare -A MORE=([T]="-n2" [B]="--mem=72G" [M]="--mem=24G")
declare -A REQUEUES=([T]=2 [R]=2 [A]=2 [B]=2)
DDP_ROWS=" T R "        # rows whose reference ends with "ddp done" (rank 0 of torch.distributed), not DONE

say "uninterrupted reference runs (beside, outside Slurm, as the user)"
asjob() { (cd "$H" && runuser -u "$DEVICE_USER" -- env "$DET" "XLA_FLAGS=--xla_gpu_deterministic_ops=true" \
  XLA_PYTHON_CLIENT_PREALLOCATE=false USE_LIBUV=0 SLURM_JOB_ID=9${1}${RANDOM:0:3} SLURM_NTASKS=1 SLURM_PROCID=0 "${@:2}"); }
REFS=()
for r in $ROWS; do
  case $r in
    T) for k in 0 1; do asjob 1 env SLURM_NTASKS=2 SLURM_PROCID=$k SLURM_LOCALID=$k MASTER_PORT=29411 \
         $PY ddp_train.py --device cuda --steps $((STEPS * 3)) --sleep 0 > "$H/ref/T.$k.out" 2>&1 & REFS+=($!); done ;;
    I|M|V) ;;        # I: the client checks it; M and V are refused: compared with nothing
    G) asjob 2 $PY workload_train.py --steps $((STEPS * 3)) > "$H/ref/G.out" 2>&1 & REFS+=($!) ;;
    *) asjob 3 bash -c "${CMD[$r]/--sleep 0.1/--sleep 0}" > "$H/ref/$r.out" 2>&1 & REFS+=($!) ;;
  esac
done

sub() { (cd "$H" && runuser -u "$DEVICE_USER" -- sbatch --parsable --open-mode=append "$@"); }
jstate() { squeue -h -j "$1" -o %T 2>/dev/null; }
waitout() { for _ in $(seq "$3"); do grep -qE "$2" "$H/$1.out" 2>/dev/null && return 0; sleep 1; done; echo "TIMEOUT /$2/ in $1.out"; return 1; }
declare -A ID
for r in $ROWS; do
  ID[$r]=$(sub -J "gm$r" -o "$r.out" --mem=24G --gres=gpu:1 ${MORE[$r]:-} --checkpoint-interval=10s \
           --export="ALL,$DET" --wrap "${CMD[$r]}")
done
echo "jobs: $(for r in $ROWS; do printf '%s=%s ' "$r" "${ID[$r]}"; done)"

cycle() {   # ROW: interval commit (or a refusal), requeue(s), restore(s), the end
  local r=$1 id=${ID[$1]} end=$((T0 + DEADLINE)) n=1
  {
    waitout "$r" 'committed \(interval\)|refused|ABORTED|FAILED' $((end - SECONDS)) || return
    grep -qE 'committed \(interval\)' "$H/$r.out" || { echo "[$((SECONDS - T0))s] $r: $(grep -E 'refused|ABORTED|FAILED' "$H/$r.out" | head -2)"; }
    if [ "$r" = I ]; then    # a client outside the job, from before the first requeue to the end
      for _ in $(seq 30); do [ -s "$H/port-I.txt" ] && break; sleep 1; done
      "$PY" "$H/session_client.py" --host 127.0.0.1 --port "$(cat "$H/port-I.txt")" --count 40 --sleep 0.3 \
        --patience 120 > "$H/ref/I.client" 2>&1 &
      CLIENT=$!; sleep 4
    fi
    while [ $n -le "${REQUEUES[$r]:-1}" ]; do
      grep -qE 'committed \(interval\)' "$H/$r.out" || break
      # mid-run: once the program prints its steps, and at a commit taken since (not one of its start-up); a
      # job that ended meanwhile is not requeued (Slurm would run a finished job again)
      for _ in $(seq $((end - SECONDS))); do [ "$(grep -cE "${LINES[$r]}" "$H/$r.out")" -ge 5 ] && break; sleep 1; done
      c0=$(grep -cE 'committed \(interval\)' "$H/$r.out")
      for _ in $(seq $((end - SECONDS))); do
        [ "$(grep -cE 'committed \(interval\)' "$H/$r.out")" -gt "$c0" ] || [ -z "$(jstate "$id")" ] && break; sleep 1
      done
      [ -n "$(jstate "$id")" ] || { echo "[$((SECONDS - T0))s] $r: no requeue $n: the job ended first"; break; }
      echo "[$((SECONDS - T0))s] $r: requeue $n at $(grep -cE "${LINES[$r]}" "$H/$r.out") lines"
      scontrol requeue "$id"
      # each rank of the job says "(restart N)"; the requeue is answered once one of them has
      for _ in $(seq $((end - SECONDS))); do grep -qE "\(restart $n\)|starting from the beginning" "$H/$r.out" && break; sleep 1; done
      echo "[$((SECONDS - T0))s] $r: $(grep -E 'restored from checkpoint epoch|FAILED|beginning' "$H/$r.out" | tail -1)"
      n=$((n + 1)); sleep 12
    done
    for _ in $(seq $((end - SECONDS))); do [ -z "$(jstate "$id")" ] && break; sleep 1; done
    [ -n "${CLIENT:-}" ] && wait "$CLIENT"
    echo "[$((SECONDS - T0))s] $r: state '$(jstate "$id")'"
  } > "$OUT/cycle-$r.txt" 2>&1
}
CYC=(); for r in $ROWS; do cycle "$r" & CYC+=($!); done
wait "${CYC[@]}" "${REFS[@]}"

{ echo "| row | program | outcome | detail |"; echo "| --- | --- | --- | --- |"; } > "$OUT/gpu-coverage.md"
for r in $ROWS; do
  say "row $r: ${NAME[$r]} (job ${ID[$r]})"; cat "$OUT/cycle-$r.txt"
  at=$(grep -oE 'requeue [0-9]+ at [0-9]+ lines' "$OUT/cycle-$r.txt" | awk '{print $4}' | paste -sd, -)
  ended_first=$(grep -c ': no requeue [0-9]*: the job ended first' "$OUT/cycle-$r.txt"); rm -f "$OUT/cycle-$r.txt"
  grep -vE "${LINES[$r]}|^monitor " "$H/$r.out" | tail -8
  got=$(grep -cE "${LINES[$r]}" "$H/$r.out"); restores=$(grep -oE 'restored from checkpoint epoch [0-9]+ in [0-9.]+s \(restart [0-9]+\)' "$H/$r.out" | grep -oE 'restart [0-9]+' | sort -u | wc -l)
  ref="$H/ref/$r.out"; [ "$r" = T ] && ref="$H/ref/T.0.out"
  aborted=$(grep -c 'ABORTED' "$H/$r.out")
  # a refusal: an abort in a PREPARE stage before any lock, or the lock stage's refusal of what the CUDA
  # checkpoint API cannot capture (not a lock that failed for another reason: that is FAILED)
  before_freeze='ABORTED \([^)]*stage ((size|check|pmi-precheck|space)\)|gpu-lock\): GPU state cannot be checkpointed)'
  if grep -qE "$before_freeze" "$H/$r.out" && [ "$restores" = 0 ]; then    # refused before anything was frozen
    outcome=REFUSED; detail=$(grep -oE "$before_freeze[^;]*" "$H/$r.out" | head -1 | cut -c1-260)
  elif [ "$aborted" -gt 0 ] && [ "$restores" = 0 ]; then          # a capture that failed is no refusal
    outcome=FAILED; detail=$(grep -oE 'ABORTED[^;]*' "$H/$r.out" | head -1 | cut -c1-220)
  elif [ "$r" = I ]; then
    outcome=$(grep -qE '^client PASS' "$H/ref/I.client" && echo IDENTICAL || echo FAILED)
    detail="$restores restore(s); client: $(tail -1 "$H/ref/I.client")"
  elif [[ $DDP_ROWS != *" $r "* ]] && [ -f "$ref" ] && { [ "$(grep -cE "${LINES[$r]}" "$ref")" = 0 ] || ! grep -q '^DONE' "$ref"; }; then
    outcome=FAILED; detail="the uninterrupted run failed: $(grep -E 'Error|error' "$ref" | tail -1 | cut -c1-200)"
  elif grep -qE 'restore of checkpoint epoch [0-9]+ FAILED|newer checkpoints could not be' "$H/$r.out"; then
    outcome=FAILED; detail="a restore failed and an older epoch was taken: $(grep -oE '(FAILED|could not be)[^;]*' "$H/$r.out" | tail -1 | cut -c1-200)"
  elif [ "$restores" -ge 1 ] && [ "$got" -gt 0 ] && cmp -s <(grep -E "${LINES[$r]}" "$H/$r.out") <(grep -E "${LINES[$r]}" "$ref"); then
    outcome=IDENTICAL; detail="$got lines, $restores restore(s), requeued at line(s) ${at:-none}"
    [ "$restores" -lt "${REQUEUES[$r]:-1}" ] && outcome="IDENTICAL-AFTER-$restores-OF-${REQUEUES[$r]}-REQUEUES"
    [ "$r" = G ] && detail="$detail; monitor lines after the last restore: $(awk '/restored from checkpoint/ {n=0} /^monitor / {n++} END {print n}' "$H/$r.out")"
  elif [ "$restores" = 0 ] && [ "$ended_first" -gt 0 ]; then
    outcome=NOT-MID-RUN; detail="the program ended before a commit after its start-up: no requeue came mid-run"
  elif [ "$restores" -ge 1 ] && [ "$got" -gt 0 ]; then
    # a first difference before the first requeue comes from the job's set-up, not from a restore
    first=$(cmp <(grep -E "${LINES[$r]}" "$H/$r.out") <(grep -E "${LINES[$r]}" "$ref") | grep -oE 'line [0-9]+' | awk '{print $2}')
    outcome=DIFFERS; detail="$got lines, $restores restore(s), requeued at line(s) ${at:-none}; first difference at line ${first:-EOF}"
    [ -n "$first" ] && [ "$first" -le "${at%%,*}" ] && detail="$detail (before the first requeue: the job's set-up differs from its reference)"
    echo "first difference:"; diff <(grep -E "${LINES[$r]}" "$H/$r.out") <(grep -E "${LINES[$r]}" "$ref") | head -4
  else
    outcome=FAILED; detail="$restores restore(s), $got vs $(grep -cE "${LINES[$r]}" "$ref") lines; $(grep -E 'FAILED|beginning|Error' "$H/$r.out" | head -1 | cut -c1-200)"
  fi
  [ "$aborted" -gt 0 ] && [ "$restores" -gt 0 ] && detail="$detail; $aborted capture(s) ABORTED: $(grep -oE 'ABORTED[^;]*' "$H/$r.out" | head -1 | cut -c1-160)"
  echo "$r RESULT: $outcome: $detail"
  echo "| $r | ${NAME[$r]} | $outcome | ${detail//|//} |" >> "$OUT/gpu-coverage.md"
done
say "coverage"; cat "$OUT/gpu-coverage.md"
squeue; scancel -u "$DEVICE_USER"
echo "--- slurmd.log errors"; grep -iE "error" /var/log/slurm/slurmd.log | tail -6
tar -czf "$OUT/gpu-matrix-logs.tar.gz" -C / "${H#/}" var/log/slurm var/log/slurmckpt 2>/dev/null
[ "$(stat -c %s "$OUT/gpu-matrix-logs.tar.gz")" -lt 15000000 ] || tar -czf "$OUT/gpu-matrix-logs.tar.gz" -C / var/log/slurmckpt 2>/dev/null
say "done"
