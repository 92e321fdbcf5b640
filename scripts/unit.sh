#!/usr/bin/env bash
# make unit: the inner loop. pyflakes and mypy (strict) over the source, then the unit tests against src/ -
# no cluster, no root, nothing installed but Python and the package's test extra.
#
# The Python used, first that works:
#   $UNIT_PYTHON                            a Python of your own with `pip install '.[test]'` done
#   /opt/slurmckpt/venv/bin/python          the test cluster's venv (make setup installs the test extra there)
#   build/unit-venv/bin/python              made here from python3 (`python3 -m venv`, then the test extra)
# Each part prints its time; the first that fails ends the run with its status.
set -euo pipefail
cd "$(dirname "$0")/.."

has_tools() { "$1" -c 'import pytest, mypy, pyflakes, prometheus_client, pynvml, yaml, click, xxhash, psutil, zstandard' 2>/dev/null; }

PY=${UNIT_PYTHON:-}
if [ -z "$PY" ]; then
  if [ -x /opt/slurmckpt/venv/bin/python ] && has_tools /opt/slurmckpt/venv/bin/python; then
    PY=/opt/slurmckpt/venv/bin/python
  else
    PY=build/unit-venv/bin/python
    if ! { [ -x "$PY" ] && has_tools "$PY"; }; then
      echo "== make unit: a venv with the test extra in build/unit-venv"
      python3 -m venv build/unit-venv || {
        echo "make unit: python3 -m venv failed; on Debian: apt-get install python3-venv (or set UNIT_PYTHON)" >&2
        exit 2; }
      "$PY" -m pip install -q --disable-pip-version-check '.[test]' || {
        echo "make unit: pip install '.[test]' failed (no network? set UNIT_PYTHON to a Python that has it)" >&2
        exit 2; }
    fi
  fi
fi
has_tools "$PY" || { echo "make unit: $PY lacks the test extra: $PY -m pip install '.[test]'" >&2; exit 2; }

total=$SECONDS
part() {
  local name=$1 t0=$SECONDS; shift
  if "$@"; then echo "== unit: $name passed in $((SECONDS - t0)) s"
  else local rc=$?; echo "== unit: $name FAILED (exit $rc) in $((SECONDS - t0)) s" >&2; exit "$rc"; fi
}
part pyflakes "$PY" -m pyflakes src tests
part mypy "$PY" -m mypy
# The unit tests read the tree's source, not an installed copy, and need no cluster and no root. Those marked
# `system` need root and the node's set-up (criu, the test users, lua5.1, groff): make test runs them.
select=(-m "not system")
part "unit tests" env PYTHONPATH="$PWD/src" "$PY" -m pytest -q -p no:cacheprovider "${select[@]}" tests/unit
echo "== make unit: passed in $((SECONDS - total)) s ($PY)"
