#!/usr/bin/env bash
# The test suites of `make test`, after set-up, the linter and the shim's C tests: the unit tests, then the host
# cluster's integration suite (Slurm 22.05, 3 nodes) in the foreground while, beside it, the Slurm 24.11 subset
# (scripts/slurm-suite.sh in a Debian 13 root: its own namespaces, daemons and ports) and then the
# docker-slurm test (its own containers and network) run, and next to those the Slurm 26.05 subset (a Debian
# sid root, the same way). All of them mostly wait on Slurm (requeue delays, checkpoint intervals), so on CI's
# 2 cores they share the machine at little cost and the whole run stays inside CI's time limit. Each
# background suite's whole log is printed at the end; the exit status is non-zero if any suite failed.
#   env: PYTHON (the venv's), PYTEST_ARGS, TESTS_2411 and TESTS_2605 (what runs on 24.11 and on 26.05),
#        HOST_IGNORE (--ignore=FILE and --deselect=ID options: what the roots' clusters run instead of the
#        host's), SLURMCKPT_SKIP_BESIDE=1 (only the unit and host suites, for a developer's quick run)
set -uo pipefail
REPO=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
cd "$REPO"
PYTHON=${PYTHON:-/opt/slurmckpt/venv/bin/python}
LOGS=$REPO/build/suites
mkdir -p "$LOGS"
rm -f "$LOGS"/*.log "$LOGS"/*.rc

# .ci/run ran them first (make unit, before set-up) and says so with SLURMCKPT_UNIT_DONE: then only those that
# need root and the node's set-up (marked system: criu, the test users, lua5.1, groff) are left
t0=$SECONDS
if [ -z "${SLURMCKPT_UNIT_DONE:-}" ]; then unit=(tests/unit); else unit=(-m system tests/unit); fi
"$PYTHON" -m pytest -q ${PYTEST_ARGS:-} "${unit[@]}" || { echo "unit tests failed" >&2; exit 1; }
echo "== unit tests (${unit[*]}) passed in $((SECONDS - t0)) s"

# A run that was killed leaves its jobs in slurmctld's saved state, and a restarted cluster requeues or runs
# them again: they would hold nodes the tests wait for.
for u in ckptuser1 ckptuser2; do scancel --user="$u" 2>/dev/null; done
for _ in $(seq 60); do [ -z "$(squeue -h -o %i)" ] && break; sleep 1; done
[ -z "$(squeue -h -o %i)" ] || { squeue >&2; echo "jobs of an earlier run are still queued" >&2; exit 1; }

root_suite() {   # root_suite SUITE LOG TESTS: one Debian root's suite into build/suites/LOG.{log,rc}
  local t0=$SECONDS suite=$1 log=$2 tests
  eval "tests=($3)"     # pytest node ids, some quoted (they hold [ ])
  bash scripts/slurm-suite.sh "$suite" -- --durations=10 "${tests[@]}" >"$LOGS/$log.log" 2>&1
  echo "$? $((SECONDS - t0))" >"$LOGS/$log.rc"
}

beside() {   # the suites that run next to the host cluster's, each into its own log
  # shellcheck source=scripts/debian-root.sh
  ( . scripts/debian-root.sh && root_tools ) || echo "debian-root: no debootstrap: the roots' suites will say so" >&2
  root_suite sid slurm-26.05 "${TESTS_2605:-tests/integration}" &
  local sid=$!
  root_suite trixie slurm-24.11 "${TESTS_2411:-tests/integration}"
  local t0=$SECONDS
  "$PYTHON" -m pytest -v tests/docker >"$LOGS/docker-slurm.log" 2>&1
  echo "$? $((SECONDS - t0))" >"$LOGS/docker-slurm.rc"
  wait "$sid"
}

pid=""
if [ "${SLURMCKPT_SKIP_BESIDE:-0}" != 1 ]; then
  beside &
  pid=$!
  echo "== Slurm 24.11 and 26.05 suites and docker-slurm test running beside the host suite (logs: $LOGS)"
fi
t0=$SECONDS
# HOST_IGNORE: --ignore=FILE and --deselect=ID options (what the roots' clusters run instead), some quoted
eval "host_ignore=(${HOST_IGNORE:-})"
# shellcheck disable=SC2086  # PYTEST_ARGS: options as the developer typed them
"$PYTHON" -m pytest -v --durations=25 ${PYTEST_ARGS:-} "${host_ignore[@]}" tests/integration
rc=$?
echo "== host cluster's integration suite (Slurm $(sinfo -V | awk '{print $2}')): exit $rc in $((SECONDS - t0)) s"

if [ -n "$pid" ]; then
  wait "$pid"
  # The coverage matrix holds the rows of every cluster (each root's run wrote its own copy of the file)
  if [ -f build/coverage.md ]; then
    for root in trixie sid; do
      root_rows=${SLURMCKPT_CACHE:-/var/cache/slurmckpt}/roots/$root/root/repo/build/coverage.md
      [ ! -f "$root_rows" ] || grep '^| [^-]' "$root_rows" | tail -n +2 >>build/coverage.md
    done
    [ "${SLURMCKPT_COVERAGE_DOC:-0}" != 1 ] || cp build/coverage.md docs/coverage.md
    echo "== coverage matrix (every cluster): build/coverage.md"; cat build/coverage.md
  fi
  for suite in slurm-24.11 slurm-26.05 docker-slurm; do
    read -r src secs <"$LOGS/$suite.rc" 2>/dev/null || { src=1; secs=?; }
    echo "================================ $suite (exit $src in $secs s) ================================"
    cat "$LOGS/$suite.log"
    [ "$src" = 0 ] || rc=1
  done
fi
exit "$rc"
