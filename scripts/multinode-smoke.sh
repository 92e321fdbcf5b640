#!/usr/bin/env bash
# Smoke check of the multi-node test cluster (after `make setup NODES=3`): steps across nodes, fake GPUs, a
# batch job with an srun step over two nodes (and sacct from inside the job), stop-node/start-node, a crashed
# node taking its job down. Run as root. Prints PASS/FAIL per check; exit 1 if any failed.
set -uo pipefail
REPO=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
CL="$REPO/scripts/cluster.sh"
WORK=/var/tmp/slurmckpt-work/ckptuser1
U=(runuser -u ckptuser1 --)
fails=0
pass() { echo "PASS: $*"; }
fail() { echo "FAIL: $*"; fails=$((fails + 1)); }
node_state() { scontrol show node "$1" | sed -nE 's/^ *State=([^ ]+).*/\1/p'; }

n=$(cat /var/lib/slurmckpt-cluster/nodes 2>/dev/null || echo 1)
[ "$n" -ge 2 ] || { echo "cluster has $n node(s): run 'make setup NODES=3' first"; exit 2; }
cd "$WORK" || exit 2

out=$(timeout 60 "${U[@]}" srun -N"$n" -n"$n" -l bash -c 'echo "$SLURMD_NODENAME $(ip -4 -o addr show eth0 | awk "{print \$4}")"' 2>&1)
if [ "$(grep -c 'node[0-9]* 10\.77\.0\.' <<<"$out")" -eq "$n" ]; then pass "srun -N$n: $(echo "$out" | sort | tr '\n' ';')"; else fail "srun -N$n: $out"; fi

out=$(timeout 60 "${U[@]}" srun -N1 -w node2 --gres=gpu:2 bash -c 'echo "$SLURMD_NODENAME gpus=$CUDA_VISIBLE_DEVICES"' 2>&1)
[ "$out" = "node2 gpus=0,1" ] && pass "gres on node2: $out" || fail "gres on node2: $out"

cat >"$WORK/mn-job.sh" <<'EOF'
#!/bin/bash
srun -l bash -c 'echo "step on $SLURMD_NODENAME"' | sort
sacct -n -X -P -j "$SLURM_JOB_ID" -o JobID,State
EOF
jid=$("${U[@]}" sbatch --parsable -N2 -n2 -o "$WORK/mn-job-%j.out" "$WORK/mn-job.sh")
for _ in $(seq 60); do squeue -h -j "$jid" 2>/dev/null | grep -q . || break; sleep 1; done
out=$(cat "$WORK/mn-job-$jid.out" 2>&1)
if [ "$(grep -c 'step on node' <<<"$out")" -eq 2 ] && grep -q "^$jid|" <<<"$out"; then
  pass "batch job $jid over 2 nodes (srun + sacct inside the job): $(tr '\n' ';' <<<"$out")"
else fail "batch job $jid: $out"; fi

"$CL" stop-node node2 >/dev/null 2>&1
out=$(timeout 60 "${U[@]}" srun -N2 -x node2 hostname 2>&1) && pass "job beside a stopped node2" || fail "job beside a stopped node2: $out"
t0=$(date +%s)
"$CL" start-node node2 >/dev/null 2>&1 && pass "start-node node2 ($(( $(date +%s) - t0 )) s): $(node_state node2)" || fail "start-node node2: $(node_state node2)"

jid=$("${U[@]}" sbatch --parsable -w "node$n" -o /dev/null --wrap 'sleep 600')
for _ in $(seq 30); do [ "$(squeue -h -j "$jid" -o %T)" = RUNNING ] && break; sleep 1; done
"$CL" stop-node "node$n" >/dev/null 2>&1
t0=$(date +%s)
for _ in $(seq 90); do case $(node_state "node$n") in *DOWN*) break;; esac; sleep 1; done
st=$(node_state "node$n"); js=$(scontrol show job "$jid" | sed -nE 's/^ *JobState=([^ ]+).*/\1/p')
[[ $st == *DOWN* ]] && pass "crashed node$n DOWN after $(( $(date +%s) - t0 )) s; its job $jid: $js" || fail "node$n state after crash: $st (job $js)"
scancel "$jid" 2>/dev/null
t0=$(date +%s)
"$CL" start-node "node$n" >/dev/null 2>&1 && pass "start-node node$n after crash ($(( $(date +%s) - t0 )) s): $(node_state "node$n")" || fail "start-node node$n: $(node_state "node$n")"

echo "$fails failed"
[ "$fails" -eq 0 ]
