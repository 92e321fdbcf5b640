#!/bin/bash
# Runs the GPU proofs on the device machine (root). Usage: tests/gpu/run_device.sh PHASE...
#   facts  - machine, driver, THP, disk, cgroup, criu check       probe - tests/gpu/probe_driver.py
#   train  - tests/gpu/train_restore.py (proof a)                  bench:SIZES[:ORDER[:FLAGS]] - benchmarks/gpu_checkpoint.py
#     FLAGS, comma-separated: nocold (no cold start), dropcache (restores and the cold start read from disk)
#   pidns  - tests/gpu/pidns_probe.py: CUDA process in its own PID namespace + /proc mount, through C/R
#   nvml[:GIB] - tests/gpu/nvml_probe.py: NVML inventory, NVML bytes vs the driver's host copy, rates, JAX notes
#   infer[:PAIRS] - benchmarks/inference_restore.py: inference server, restore-to-serving vs cold start from disk
#   stall[:SIZES[:THP[:PAIRS]]] - benchmarks/gpu_stall.py: the capture's stall and the restore, criu's copy of the
#     host copy against slurmckpt's threads, paired, with their floors (THP comma-separated: madvise,always)
#   jaxwhy[:CASES] - tests/gpu/jax_why_probe.py: why JAX in its own PID namespace loses its GPU state (CASES
#     comma-separated, default all); one VERDICT line per case
#   ipc[:CASES] - tests/gpu/ipc_probe.py: what CUDA IPC (torch.multiprocessing, raw cuIpc*) leaves in /proc and
#     what the checkpoint API answers for it (CASES comma-separated: torch,raw); one VERDICT line per case
# Each phase's output goes to $OUT/<phase>.txt (and stdout); a phase that fails does not stop the next.
set -u
cd "$(dirname "$0")/../.."
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD/src PYTHONDONTWRITEBYTECODE=1
if [ -x /usr/local/sbin/criu ]; then export SLURMCKPT_CRIU=/usr/local/sbin/criu   # device_setup.sh's
else export SLURMCKPT_CRIU=$PWD/.carry/criu/criu; fi
W=${GPU_WORK:-/var/tmp/slurmckpt-gpu}   # where images go (a tmpfs to compare)
criu() { LD_LIBRARY_PATH=$PWD/.carry/criu "$SLURMCKPT_CRIU" "$@"; }
for phase in "$@"; do
  name=${phase%%:*}; rest=${phase#bench:}; [[ $name == bench ]] && name=bench-${rest%%:*} && name=${name//,/_}
  [[ $name == stall && $phase == *:* ]] && name=stall-${phase#stall:} && name=${name//[:,]/_}   # one file each
  log="$OUT/$name.txt"; t0=$SECONDS
  echo "=== $phase" | tee "$log"
  case $name in
    facts)
      { nvidia-smi --query-gpu=name,uuid,memory.total,driver_version --format=csv; uname -r
        cat /sys/kernel/mm/transparent_hugepage/enabled; df -h /var/tmp /tmp | tail -n +1; free -g | head -2
        ls /sys/fs/cgroup/cgroup.controllers && cat /sys/fs/cgroup/cgroup.controllers
        criu --version; criu check; echo "criu check rc=$?"
        python3 -c 'import torch; print("torch", torch.__version__, torch.cuda.get_device_name(0))'
      } 2>&1 | tee -a "$log" ;;
    probe) timeout 240 python3 tests/gpu/probe_driver.py $W/probe 2>&1 | tee -a "$log" ;;
    train) timeout 240 python3 tests/gpu/train_restore.py $W/train --cycles 2 2>&1 | tee -a "$log"
           cp $W/train/result.json "$OUT/train.json" 2>/dev/null ;;
    pidns) timeout 60 python3 tests/gpu/pidns_probe.py $W/pidns pid+proc 2>&1 | tee -a "$log" ;;
    nvml) gib=${phase#nvml}; gib=${gib#:}
          timeout 400 python3 tests/gpu/nvml_probe.py $W/nvml --gib "${gib:-8}" 2>&1 | tee -a "$log" ;;
    infer) pairs=${phase#infer}; pairs=${pairs#:}
           timeout 400 python3 benchmarks/inference_restore.py --pairs "${pairs:-3}" --work $W/infer \
             --out "$OUT/infer.json" 2>&1 | tee -a "$log" ;;
    jaxwhy) cases=${phase#jaxwhy}; cases=${cases#:}
            SLURMCKPT_CRIU_EXTRA="--ext-mount-map auto --enable-external-sharing --enable-external-masters" \
              timeout 280 python3 tests/gpu/jax_why_probe.py $W/jaxwhy ${cases//,/ } 2>&1 | tee -a "$log" ;;
    ipc) cases=${phase#ipc}; cases=${cases#:}
         timeout 400 python3 tests/gpu/ipc_probe.py $W/ipc ${cases//,/ } 2>&1 | tee -a "$log" ;;
    stall*) IFS=: read -r _ sizes thp pairs <<< "$phase"
           timeout 580 python3 benchmarks/gpu_stall.py --sizes "${sizes:-1,8}" --thp "${thp:-madvise,always}" \
             --pairs "${pairs:-2}" --work $W/stall --out "$OUT/$name.json" 2>&1 | tee -a "$log" ;;
    bench-*)
      IFS=: read -r sizes order cold <<< "$rest"; extra=()
      [[ ,${cold:-}, == *,nocold,* ]] && extra+=(--skip-cold)
      [[ ,${cold:-}, == *,dropcache,* ]] && extra+=(--drop-caches)
      timeout 560 python3 benchmarks/gpu_checkpoint.py --sizes "$sizes" --order "${order:-hand,ours,ours,hand}" \
        --work $W/bench --out "$OUT/$name.json" "${extra[@]}" 2>&1 | tee -a "$log" ;;
  esac
  echo "=== $phase done in $((SECONDS - t0)) s" | tee -a "$log"
done
