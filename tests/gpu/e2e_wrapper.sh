#!/bin/bash
# On the device machine (root): installs what the pipeline needs (patched
# CRIU + slurmckpt-init carried in .carry/criu-patched, an unprivileged user, config), stages the working
# tree world-readable, then runs tests/gpu/e2e_wrapper.py (fakestepd -> real agent + wrapper -> periodic
# capture, SIGTERM final capture, restore with --restart 1; losses and magic value checked).
#   tests/gpu/e2e_wrapper.sh [--cpu] [e2e_wrapper.py options]      (--cpu: rehearsal without a GPU)
# Output: $OUT/e2e.txt (everything printed) and $OUT/e2e-logs.tar.gz (job output/stderr of both runs, agent
# log, rank.json files, summary.json, criu logs). Exit code: e2e_wrapper.py's.
set -u
cd "$(dirname "$0")/../.."
OUT=${OUT:-/tmp/e2e-out}; mkdir -p "$OUT"
main() {
E2E_USER=${E2E_USER:-ckptgpu}
JOB=${E2E_JOB:-4600601}
STAGE=${E2E_STAGE:-/opt/slurmckpt-e2e}
WORK=/var/tmp/slurmckpt-e2e/$JOB
PY=$(command -v python3)
T0=$SECONDS
echo "=== setup $(date -u +%FT%TZ) on $(hostname), kernel $(uname -r), python $PY"

DEVICE_USER=$E2E_USER
. tests/gpu/device_setup.sh
echo "=== setup done in $((SECONDS - T0)) s"

# --- the proof ---
T1=$SECONDS
timeout -k 10 ${E2E_TIMEOUT:-420} "$PY" "$STAGE/tests/gpu/e2e_wrapper.py" --user "$E2E_USER" --job "$JOB" \
  --work "$WORK" "$@"
rc=$?
echo "=== e2e_wrapper.py rc=$rc in $((SECONDS - T1)) s"
# criu logs of every epoch (dump.log, restore.log) next to the rest
for f in /var/lib/slurmckpt/images/*/"$JOB"/epoch-*/*/dump.log; do
  [ -f "$f" ] && cp "$f" "$WORK/$(basename "$(dirname "$(dirname "$f")")").dump.log"
done
for f in /var/lib/slurmckpt/images/*/"$JOB"/epoch-*/*/restore.log; do
  [ -f "$f" ] && cp "$f" "$WORK/$(basename "$(dirname "$(dirname "$f")")").restore.log"
done
du -sh /var/lib/slurmckpt/images/*/"$JOB"/epoch-* 2>/dev/null
tar -C "$(dirname "$WORK")" -czf "$OUT/e2e-logs.tar.gz" "$(basename "$WORK")" 2>/dev/null
echo "=== total $((SECONDS - T0)) s"
return $rc
}
main "$@" 2>&1 | tee -a "$OUT/e2e.txt"
exit "${PIPESTATUS[0]}"
