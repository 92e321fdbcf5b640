#!/usr/bin/env bash
# slurmckpt demo: a real job on the local cluster is checkpointed, requeued and restored mid-run.
# Run by `make demo` after `make setup`, and in docker-slurm's controller with DEMO_OTHER_NODE=1: the node the
# job ran on is drained before the requeue, so that it is restored on another node (and resumed after).
# Everything shown is read live from Slurm and the job's output.
set -euo pipefail
OTHER_NODE=${DEMO_OTHER_NODE:-0}
USER_NAME=ckptuser1
WD=/var/tmp/slurmckpt-work/$USER_NAME/demo
HERE=$(cd "$(dirname "$0")/.." && pwd)
rm -rf "$WD"; mkdir -p "$WD"
cp "$HERE/tests/integration/workloads/zdtm.py" "$WD/"
cat > "$WD/demo.sh" <<'JOB'
#!/bin/bash
echo "preamble: job $SLURM_JOB_ID started on $(hostname) (restart count ${SLURM_RESTART_COUNT:-0})"
python3 zdtm.py --steps 120 --sleep 0.25 --tag demo --data progress.txt
echo "finished"
JOB
chmod 755 "$WD/demo.sh"; chown -R "$USER_NAME" "$WD"
banner() { printf '\n\033[1m== %s\033[0m\n' "$*"; }
count() { grep -c '^demo step' "$WD/slurm-$JOB.out" 2>/dev/null || echo 0; }
last_step() { grep '^demo step' "$WD/slurm-$JOB.out" 2>/dev/null | tail -n1 | awk '{print $3}'; }

banner "sbatch --checkpoint-interval=10s demo.sh   (as $USER_NAME)"
JOB=$(cd "$WD" && runuser -u "$USER_NAME" -- sbatch --parsable --checkpoint-interval=10s demo.sh)
echo "job $JOB submitted"
until grep -q "committed (interval)" "$WD/slurm-$JOB.out" 2>/dev/null; do sleep 1; done
grep "^slurmckpt" "$WD/slurm-$JOB.out" | tail -n1
sleep 3
BEFORE=$(last_step)
FIRST_NODE=$(squeue -h -j "$JOB" -o %N)
if [ "$OTHER_NODE" = 1 ]; then
  banner "job $JOB runs on $FIRST_NODE: scontrol update nodename=$FIRST_NODE state=drain, so that it restarts elsewhere"
  scontrol update nodename="$FIRST_NODE" state=drain reason="slurmckpt demo: move job $JOB"
fi
banner "progress before requeue: step $BEFORE of 120 -> scontrol requeue $JOB"
scontrol requeue "$JOB"
T0=$(date +%s.%N)
sleep 2; grep -E "^slurmckpt|CANCELLED" "$WD/slurm-$JOB.out" | tail -n3 || true
banner "waiting for Slurm to start the job again (requeue delay is Slurm's: cred_expire + backfill)"
while [ "$(squeue -h -j "$JOB" -o %T)" != RUNNING ]; do printf '.'; sleep 1; done; echo
until grep -q "restored from checkpoint" "$WD/slurm-$JOB.out"; do sleep 0.5; done
grep "restored from checkpoint" "$WD/slurm-$JOB.out" | tail -n1
echo "running on $(squeue -h -j "$JOB" -o %N) now (it ran on $FIRST_NODE before the requeue)"
if [ "$OTHER_NODE" = 1 ]; then scontrol update nodename="$FIRST_NODE" state=resume; fi
sleep 2
echo "progress after restore: step $(last_step) (it resumed after step $BEFORE, not from 0)"
banner "slurmckpt inspect $JOB"
/opt/slurmckpt/venv/bin/slurmckpt inspect "$JOB" || true
while squeue -h -j "$JOB" | grep -q .; do sleep 1; done
banner "job output (slurm-$JOB.out), 5 lines around the restore and the end"
grep -n -E "restored|^demo step $BEFORE |PASS|finished|preamble" "$WD/slurm-$JOB.out"
LINES=$(count)
banner "result"
echo "steps printed: $LINES (120 expected, each exactly once)"
echo "preamble ran: $(grep -c '^preamble' "$WD/slurm-$JOB.out") time(s) in the output"
sacct -j "$JOB" -o JobID,State,ExitCode -n 2>/dev/null | head -n 3 || true
[ "$LINES" = 120 ] && grep -q "demo PASS steps=120 echoed=120" "$WD/slurm-$JOB.out" && echo "DEMO OK: restored mid-run, output complete and exact"
