#!/usr/bin/env bash
# shim-matrix.sh [SUITE...] - build the shim (spank/) against other Slurm releases' headers and run its C unit
# tests, each in build/shim-<suite>/ (the tree's own spank/ build, for the installed Slurm, is left alone).
# Default suites: trixie (Debian 13, Slurm 24.11) and sid (the newest Slurm Debian has). Headers come from
# scripts/slurm-headers.sh, cached under /var/cache/slurmckpt/slurm-headers/. Run by `make shim-matrix`, part of
# `make test` (docs/slurm-versions.md).
set -euo pipefail
REPO=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
CACHE=${SLURMCKPT_CACHE:-/var/cache/slurmckpt}
[ $# -gt 0 ] || set -- trixie sid
rc=0
for suite in "$@"; do
  t0=$(date +%s)
  hdr=$CACHE/slurm-headers/$suite/root
  ver=$(bash "$REPO/scripts/slurm-headers.sh" "$suite" "$hdr") || { echo "shim-matrix: $suite: no headers" >&2; rc=1; continue; }
  out=$REPO/build/shim-$suite
  rm -rf "$out"; mkdir -p "$out/tests"
  cp "$REPO"/spank/Makefile "$REPO"/spank/*.[ch] "$REPO"/spank/*.lds "$out/"
  cp "$REPO"/spank/tests/*.[ch] "$REPO"/spank/tests/*.sh "$REPO"/spank/tests/*.yaml "$out/tests/"
  log=$out/make.log
  if make -C "$out" SLURM_INCLUDE="$hdr/usr/include" all test >"$log" 2>&1; then
    echo "shim-matrix: $suite (Slurm $ver): build + unit tests passed ($(( $(date +%s) - t0 )) s)"
  else
    tail -n 30 "$log" >&2
    echo "shim-matrix: $suite (Slurm $ver): FAILED (log: $log)" >&2
    rc=1
  fi
done
exit $rc
