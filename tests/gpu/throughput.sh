#!/bin/bash
# On the device machine (root): throughput of one training loop with periodic
# checkpoints OFF (plain run as the job's user) vs ON (fakestepd -> real agent + wrapper, SLURMCKPT_INTERVAL).
# Set-up as tests/gpu/e2e_wrapper.sh (carried patched CRIU + slurmckpt-init + setpriv, an unprivileged user,
# config, a world-readable staged copy of the tree), then tests/gpu/throughput.py.
#   tests/gpu/throughput.sh [--cpu] [throughput.py options: --seconds S --interval I --magic-mib M ...]
# Output: $OUT/throughput.txt (everything printed), $OUT/throughput-summary.json, $OUT/throughput-logs.tar.gz
# (both runs' output, wrapper stderr, agent log, rank.json, manifest, criu dump logs). The job's images are
# removed at the end (TP_KEEP_IMAGES=1 keeps them). Exit code: throughput.py's.
set -u
cd "$(dirname "$0")/../.."
OUT=${OUT:-/tmp/throughput-out}; mkdir -p "$OUT"
main() {
TP_USER=${TP_USER:-ckptgpu}
JOB=${TP_JOB:-4600701}
STAGE=${TP_STAGE:-/opt/slurmckpt-tput}
WORK=/var/tmp/slurmckpt-tput/$JOB
PY=$(command -v python3)
T0=$SECONDS
echo "=== setup $(date -u +%FT%TZ) on $(hostname), kernel $(uname -r), python $PY"

DEVICE_USER=$TP_USER
. tests/gpu/device_setup.sh
echo "=== setup done in $((SECONDS - T0)) s"

# --- the measurement ---
T1=$SECONDS
timeout -k 10 ${TP_TIMEOUT:-400} "$PY" "$STAGE/tests/gpu/throughput.py" --user "$TP_USER" --job "$JOB" \
  --work "$WORK" "$@"
rc=$?
echo "=== throughput.py rc=$rc in $((SECONDS - T1)) s"
for f in /var/lib/slurmckpt/images/*/"$JOB"/epoch-*/*/dump.log; do
  [ -f "$f" ] && cp "$f" "$WORK/$(basename "$(dirname "$(dirname "$f")")").dump.log"
done
du -sh /var/lib/slurmckpt/images/*/"$JOB"/epoch-* 2>/dev/null
df -h /var/lib/slurmckpt/images | tail -1
cp "$WORK/summary.json" "$OUT/throughput-summary.json" 2>/dev/null
tar -C "$(dirname "$WORK")" -czf "$OUT/throughput-logs.tar.gz" "$(basename "$WORK")" 2>/dev/null
[ "${TP_KEEP_IMAGES:-0}" = 1 ] || rm -rf /var/lib/slurmckpt/images/*/"$JOB"
echo "=== total $((SECONDS - T0)) s"
return $rc
}
main "$@" 2>&1 | tee -a "$OUT/throughput.txt"
exit "${PIPESTATUS[0]}"
