/*
 * slurmckpt-init - PID 1 of the workload's PID namespace.
 *
 *   slurmckpt-init [--chdir HOME] [--workdir DIR] [--env-fd N] [--block-io-uring] -- PROG ARGS...
 *
 * Forwards HUP INT QUIT USR1 USR2 ALRM TERM CONT WINCH to the root child,
 * reaps every child, and exits with the root child's code (128+N when it
 * was killed by signal N). The root child starts with every signal at its
 * default and an empty mask, as under a plain Slurm task: Slurm's SIGTERM
 * reaches only the wrapper (proctrack/slurmckpt), and a program that uses
 * SIGTERM itself (multiprocessing's Pool.terminate, subprocess.terminate)
 * must see it work. Session, uids and fds are the agent's business, not init's
 * (docs/contracts.md, "slurmckpt-init"). Works as well when it is not
 * PID 1: it then becomes a child subreaper so orphans are reaped the same.
 *
 * The agent starts init as the job's user, in a PID namespace holding CAP_SYS_ADMIN and
 * CAP_DAC_OVERRIDE (ambient) and nothing else: CRIU's parasite mounts a transient proc at
 * "proc.crtools" in this init's cwd (HOME), a root-owned directory the user cannot write, so the user
 * cannot race that mount (docs/security.md). Init is linked statically and starts with a fixed
 * environment: nothing of the user's reaches the dynamic loader while capabilities are held. The
 * workload's environment comes through --env-fd (NUL-separated, read by the child), and the child
 * drops every capability before it enters the workload's directory (--workdir: as the user) and execs.
 *
 * --block-io-uring: the child first installs the seccomp filter of io_uring_block.c, which every process
 * of the tree inherits and criu dumps and restores with each task. It does so while it still holds
 * CAP_SYS_ADMIN, as container runtimes do, so the tree needs no no_new_privs: setuid and file-capability
 * programs (fusermount, newuidmap, apptainer's starter) work in the job as without slurmckpt.
 */
#include <errno.h>
#include <linux/capability.h>
#include <stdlib.h>
#include <signal.h>
#include <stdio.h>
#include <string.h>
#include <sys/prctl.h>
#include <sys/syscall.h>
#include <sys/wait.h>
#include <unistd.h>

#include "io_uring_block.h"

static const int forwarded[] = {
	SIGHUP, SIGINT, SIGQUIT, SIGUSR1, SIGUSR2, SIGALRM, SIGTERM, SIGCONT,
	SIGWINCH,
};
#define NFORWARDED ((int)(sizeof(forwarded) / sizeof(forwarded[0])))

static volatile pid_t root_child;

static void forward(int sig)
{
	int saved = errno;

	if (root_child > 0)
		kill(root_child, sig);
	errno = saved;
}

/*
 * glibc refuses to touch the signals it reserves (32, 33): an inherited
 * SIG_IGN there is reset with the raw system call. A zeroed kernel
 * sigaction is SIG_DFL, no flags, empty mask, whatever the arch's layout.
 */
static void reset_signal(int sig, void (*handler)(int))
{
	unsigned long ksa[8] = { 0 };

	if (signal(sig, handler) != SIG_ERR || errno != EINVAL ||
	    sig == SIGKILL || sig == SIGSTOP || handler != SIG_DFL)
		return;
	syscall(SYS_rt_sigaction, sig, ksa, NULL, (size_t)(NSIG / 8));
}

/* Every capability set empty: what the workload (and its chdir) does, it does as the bare user. */
static int drop_capabilities(void)
{
	struct __user_cap_header_struct hdr = { _LINUX_CAPABILITY_VERSION_3, 0 };
	struct __user_cap_data_struct data[_LINUX_CAPABILITY_U32S_3];

	memset(data, 0, sizeof(data));
	if (prctl(PR_CAP_AMBIENT, PR_CAP_AMBIENT_CLEAR_ALL, 0, 0, 0) != 0 && errno != EINVAL)
		return (-1);
	return ((int)syscall(SYS_capset, &hdr, data));
}

/* The workload's environment: NUL-separated NAME=VALUE strings, read whole from fd. */
static char **read_env(int fd)
{
	size_t len = 0, cap = 65536, n = 0, i;
	char *buf = malloc(cap), **envp;
	ssize_t got;

	if (buf == NULL)
		return (NULL);
	for (;;) {
		if (len + 1 >= cap && (buf = realloc(buf, cap *= 2)) == NULL)
			return (NULL);
		got = pread(fd, buf + len, cap - len - 1, (off_t)len);
		if (got < 0 && errno == EINTR)
			continue;
		if (got < 0)
			return (NULL);
		if (got == 0)
			break;
		len += (size_t)got;
	}
	close(fd);
	buf[len] = '\0';
	for (i = 0; i < len; i++)
		n += buf[i] == '\0';
	if ((envp = calloc(n + 2, sizeof(*envp))) == NULL)
		return (NULL);
	for (i = 0, n = 0; i < len; i += strlen(buf + i) + 1)
		if (strchr(buf + i, '=') != NULL)
			envp[n++] = buf + i;
	envp[n] = NULL;
	return (envp);
}

extern char **environ;

static void child_exec(char **argv, const char *workdir, int env_fd, int block_io_uring)
{
	sigset_t empty;
	int sig;

	for (sig = 1; sig < NSIG; sig++)
		reset_signal(sig, SIG_DFL);
	sigemptyset(&empty);
	sigprocmask(SIG_SETMASK, &empty, NULL);
	/* Before the capabilities go: with CAP_SYS_ADMIN the filter needs no no_new_privs. Without it the job
	 * still runs; a ring it makes gets its captures refused, naming the process. */
	if (block_io_uring && io_uring_block() != 0)
		fprintf(stderr, "slurmckpt-init: cannot block io_uring: %s; a process of this task that makes an "
			"io_uring will have its captures refused\n", strerror(errno));
	if (drop_capabilities() != 0) {
		fprintf(stderr, "slurmckpt-init: cannot drop capabilities: %s\n", strerror(errno));
		_exit(126);
	}
	if (workdir != NULL && chdir(workdir) != 0) {
		fprintf(stderr, "slurmckpt: cannot chdir to %s: %s; running in /tmp\n", workdir,
			strerror(errno));
		if (chdir("/tmp") != 0)
			_exit(126);
	}
	if (env_fd >= 0) {
		char **envp = read_env(env_fd);

		if (envp == NULL) {
			fprintf(stderr, "slurmckpt-init: cannot read the environment: %s\n", strerror(errno));
			_exit(126);
		}
		environ = envp;      /* execvp searches the workload's PATH, not init's */
	}
	execvp(argv[0], argv);
	fprintf(stderr, "slurmckpt-init: exec %s: %s\n", argv[0], strerror(errno));
	_exit(errno == ENOENT ? 127 : 126);
}

static int exit_code(int status)
{
	if (WIFEXITED(status))
		return (WEXITSTATUS(status));
	if (WIFSIGNALED(status))
		return (128 + WTERMSIG(status));
	return (255);
}

int main(int argc, char **argv)
{
	struct sigaction sa;
	sigset_t set;
	pid_t pid;
	int status, i;
	const char *home = NULL, *workdir = NULL;
	int env_fd = -1, block_io_uring = 0;

	/* --chdir DIR: where init itself lives once the workload is forked. CRIU's parasite mounts a
	 * transient proc at "proc.crtools" in the namespace init's cwd: it must be private to this task.
	 * --workdir DIR: the workload's cwd, entered by the child without capabilities. --env-fd N: the
	 * workload's environment. --block-io-uring: the workload runs under io_uring_block's filter. */
	while (argc > 2 && argv[1][0] == '-' && argv[1][1] == '-' && argv[1][2] != '\0') {
		if (strcmp(argv[1], "--block-io-uring") == 0) {
			block_io_uring = 1;
			argv++;
			argc--;
			continue;
		}
		if (strcmp(argv[1], "--chdir") == 0)
			home = argv[2];
		else if (strcmp(argv[1], "--workdir") == 0)
			workdir = argv[2];
		else if (strcmp(argv[1], "--env-fd") == 0)
			env_fd = atoi(argv[2]);
		else
			break;
		argv += 2;
		argc -= 2;
	}
	if (argc > 1 && strcmp(argv[1], "--") == 0) {
		argv++;
		argc--;
	}
	if (argc < 2 || argv[1][0] == '-') {
		fprintf(stderr, "usage: slurmckpt-init [--chdir DIR] [--workdir DIR] [--env-fd N] [--block-io-uring] "
			"-- PROG [ARGS...]\n");
		return (127);
	}
	if (getpid() != 1)
		prctl(PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0);

	/* Signals that arrive before the child's pid is known wait blocked. */
	sigemptyset(&set);
	for (i = 0; i < NFORWARDED; i++)
		sigaddset(&set, forwarded[i]);
	sigprocmask(SIG_BLOCK, &set, NULL);
	signal(SIGCHLD, SIG_DFL);       /* SIG_IGN would make waitpid() fail */
	memset(&sa, 0, sizeof(sa));
	sa.sa_handler = forward;
	sa.sa_flags = SA_RESTART;
	sigfillset(&sa.sa_mask);
	for (i = 0; i < NFORWARDED; i++)
		sigaction(forwarded[i], &sa, NULL);

	pid = fork();
	if (pid < 0) {
		fprintf(stderr, "slurmckpt-init: fork: %s\n", strerror(errno));
		return (127);
	}
	if (pid == 0)
		child_exec(argv + 1, workdir, env_fd, block_io_uring);
	if (env_fd >= 0)
		close(env_fd);
	root_child = pid;
	if (home && chdir(home) != 0)
		fprintf(stderr, "slurmckpt-init: chdir %s: %s\n", home, strerror(errno));
	sigprocmask(SIG_UNBLOCK, &set, NULL);

	for (;;) {
		pid = waitpid(-1, &status, 0);
		if (pid == root_child)
			return (exit_code(status));
		if (pid < 0 && errno != EINTR) {
			fprintf(stderr, "slurmckpt-init: waitpid: %s\n",
				strerror(errno));
			return (127);
		}
	}
}
