/*
 * close_from.c - what every root exec of the plugin does (agent_spawn.c,
 * job_end.c): every fd from a number up closed, so nothing of slurmstepd's
 * reaches the command; a fixed environment; no supplementary groups, default
 * signals, an empty mask and / as the working directory.
 */
#include <grp.h>
#include <signal.h>
#include <stdio.h>
#include <sys/syscall.h>
#include <unistd.h>

#include "slurmckpt.h"

void close_from(int lowfd)
{
	int fd, max;

	if (syscall(SYS_close_range, (unsigned int)lowfd, ~0U, 0) == 0)
		return;
	max = (int)sysconf(_SC_OPEN_MAX);
	for (fd = lowfd; fd < max; fd++)
		close(fd);
}

void root_exec_env(char **envp, char *confbuf, size_t size, const char *conf)
{
	int n = 0;

	envp[n++] = ROOT_EXEC_PATH;
	if (conf != NULL && snprintf(confbuf, size, "SLURM_CONF=%s", conf) < (int)size)
		envp[n++] = confbuf;
	envp[n] = NULL;
}

int root_exec(char *const argv[], char *const envp[])
{
	sigset_t empty;
	int sig;

	/* Root without the job user's supplementary groups. */
	if (setgroups(0, NULL) < 0)
		return (-1);
	for (sig = 1; sig < NSIG; sig++)
		signal(sig, SIG_DFL);
	sigemptyset(&empty);
	sigprocmask(SIG_SETMASK, &empty, NULL);
	if (chdir("/") < 0)
		return (-1);
	execve(argv[0], argv, envp);
	return (-1);
}
