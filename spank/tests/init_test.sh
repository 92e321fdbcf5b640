#!/bin/sh
# init_test.sh INIT PROBE - slurmckpt-init outside a PID namespace: exit codes,
# signal forwarding, every signal at its default in the child, orphans reaped,
# io_uring blocked for the whole tree with --block-io-uring (PROBE: tests/io_uring_probe.c).
set -u
INIT=${1:?usage: init_test.sh path/to/slurmckpt-init path/to/io_uring_probe}
PROBE=${2:?usage: init_test.sh path/to/slurmckpt-init path/to/io_uring_probe}
fail=0
check() { # name want got
	if [ "$2" = "$3" ]; then echo "ok   $1"; else echo "FAIL $1: want $2, got $3"; fail=1; fi
}

"$INIT" -- sh -c 'exit 7'; check "exit code" 7 $?
"$INIT" sh -c 'exit 3'; check "without --" 3 $?
"$INIT" -- /nonexistent/prog 2>/dev/null; check "exec failure" 127 $?
"$INIT" 2>/dev/null; check "usage" 127 $?
"$INIT" -- sh -c 'kill -KILL $$'; check "killed child" 137 $?
"$INIT" -- sh -c 'kill -TERM $$; exit 0'; check "SIGTERM at its default in the child" 143 $?
"$INIT" -- grep -E '^Sig(Blk|Ign)' /proc/self/status >/tmp/init_test.$$ 2>&1
check "child mask empty" "SigBlk:	0000000000000000" "$(grep SigBlk /tmp/init_test.$$)"
check "child ignores nothing" "SigIgn:	0000000000000000" "$(grep SigIgn /tmp/init_test.$$)"
rm -f /tmp/init_test.$$

# The workload's environment comes from --env-fd, not from init's own; --workdir is entered by the child.
printf 'A=one\0PATH=/usr/bin:/bin\0B=two words\0' >/tmp/init_test.env.$$
got=$(env -i X=leak "$INIT" --env-fd 5 -- sh -c 'echo "$A|$B|${X:-none}"' 5</tmp/init_test.env.$$)
check "environment from --env-fd" "one|two words|none" "$got"
rm -f /tmp/init_test.env.$$
check "workdir" "/usr" "$("$INIT" --workdir /usr -- pwd)"
check "bad workdir falls back to /tmp" "/tmp" "$("$INIT" --workdir /nonexistent/x -- pwd 2>/dev/null)"
if [ "$(id -u)" = 0 ]; then   # as the agent starts it: a user with ambient capabilities
	got=$(setpriv --reuid=65534 --regid=65534 --clear-groups --inh-caps=-all,+sys_admin,+dac_override \
		--ambient-caps=-all,+sys_admin,+dac_override "$INIT" -- grep -E '^Cap(Eff|Prm|Amb)' /proc/self/status | tr -d '\t\n')
	check "child holds no capabilities" "CapPrm:0000000000000000CapEff:0000000000000000CapAmb:0000000000000000" "$got"
fi

# io_uring: open without the flag (a kernel that blocks it already leaves nothing to test: a failure);
# with it every io_uring call, through every ABI, answers EPERM in the child and in its children.
case $(uname -m) in x86_64) abis="x32=EPERM i386=EPERM" ;; *) abis="x32=- i386=-" ;; esac
blocked="setup=EPERM enter=EPERM register=EPERM $abis"
case $("$INIT" -- "$PROBE") in
setup=EFAULT\ enter=EBADF*) check "io_uring open without --block-io-uring" x x ;;
*) check "io_uring open without --block-io-uring" "setup=EFAULT enter=EBADF ..." "$("$INIT" -- "$PROBE")" ;;
esac
check "io_uring blocked" "$blocked" "$("$INIT" --block-io-uring -- "$PROBE")"
check "io_uring blocked in a grandchild" "$blocked" "$("$INIT" --block-io-uring -- sh -c "sh -c '$PROBE'")"
if [ "$(id -u)" = 0 ]; then   # as the agent starts it: installed with CAP_SYS_ADMIN, so no no_new_privs
	got=$(setpriv --reuid=65534 --regid=65534 --clear-groups --inh-caps=-all,+sys_admin,+dac_override \
		--ambient-caps=-all,+sys_admin,+dac_override "$INIT" --block-io-uring -- \
		sh -c "$PROBE; grep -E '^(NoNewPrivs|Seccomp):' /proc/self/status" | tr -d '\t' | tr '\n' ' ')
	check "io_uring blocked for the user, setuid programs still work" "$blocked NoNewPrivs:0 Seccomp:2 " "$got"
	got=$(setpriv --reuid=65534 --regid=65534 --clear-groups "$INIT" --block-io-uring -- sh -c 'echo ran' 2>&1)
	case $got in
	*"cannot block io_uring: Permission denied"*ran) check "without CAP_SYS_ADMIN: said, and the job runs" x x ;;
	*) check "without CAP_SYS_ADMIN: said, and the job runs" "cannot block io_uring ... ran" "$got" ;;
	esac
fi

# Forwarding: USR1 to init reaches the child (whose trap exits 42).
"$INIT" -- sh -c 'trap "exit 42" USR1; while :; do sleep 0.1; done' &
pid=$!; sleep 0.5; kill -USR1 $pid; wait $pid; check "USR1 forwarded" 42 $?
# HUP and TERM reach the child, which dies of them (128+N), as it would without init.
"$INIT" -- sh -c 'while :; do sleep 0.1; done' &
pid=$!; sleep 0.5; kill -HUP $pid; wait $pid; check "HUP forwarded" 129 $?
"$INIT" -- sh -c 'while :; do sleep 0.1; done' &
pid=$!; sleep 0.5; kill -TERM $pid; wait $pid; check "TERM forwarded" 143 $?
# Orphans are reaped (init is a subreaper when it is not PID 1).
out=$("$INIT" -- sh -c '(sleep 0.3 &) ; sleep 0.6; ps -o stat= --ppid $PPID' 2>&1)
case "$out" in *Z*) check "orphan reaped" "no zombie" "$out" ;; *) check "orphan reaped" x x ;; esac

# In a real PID namespace when unshare is allowed (root).
if unshare --pid --fork true 2>/dev/null; then
	unshare --pid --fork "$INIT" -- sh -c 'echo $$; exit 5' >/tmp/init_test.$$
	check "PID namespace exit code" 5 $?
	check "child is PID 2" 2 "$(cat /tmp/init_test.$$)"
	unshare --pid --fork "$INIT" -- sh -c 'while :; do sleep 0.1; done' &
	pid=$!; sleep 0.5
	init=$(pgrep -P $pid -f slurmckpt-init); kill -INT "$init"; wait $pid
	check "PID namespace INT forwarded" 130 $?
	rm -f /tmp/init_test.$$
fi
exit $fail
