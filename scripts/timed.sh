#!/usr/bin/env bash
# timed.sh NAME COMMAND...: runs COMMAND and prints "== NAME: exit N in S s" (make test's parts, CI's log).
name=$1; shift
t0=$SECONDS
"$@"; rc=$?
echo "== $name: exit $rc in $((SECONDS - t0)) s"
exit $rc
