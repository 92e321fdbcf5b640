/*
 * agent_spawn.c - start the task's root agent (slurm_spank_task_init_privileged).
 *
 * Runs as root in the task's process forked by slurmstepd, before it drops
 * privileges. The agent stays a child of the task across the exec of the
 * wrapper and talks to it only over the inherited socket
 * (docs/contracts.md, "SPANK shim behaviour").
 */
#include <errno.h>
#include <fcntl.h>
#include <grp.h>
#include <limits.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <sys/wait.h>
#include <unistd.h>

#include "duration.h"
#include "slurmckpt.h"

#define AGENT_FD     3          /* the agent's socket end, after the exec */
#define AGENT_ERR_FD 4          /* close-on-exec pipe reporting exec errors */
#define AGENT_LOG_FD 5          /* the log relay's write end (log_relay.c) */

struct agent_cmd {
	char fd[16], job[16], rank[16], uid[16], gid[16], restarts[16];
	char interval[24], logfd[16];
	char conf[PATH_MAX + 16];
	char *argv[25];
	char *envp[3];
};

static void agent_cmd_build(struct agent_cmd *c, struct step_info *si,
			    long interval, int explicit, int with_log)
{
	const char *conf = getenv("SLURM_CONF");
	int n = 0;

	snprintf(c->fd, sizeof(c->fd), "%d", AGENT_FD);
	snprintf(c->job, sizeof(c->job), "%u", si->job_id);
	snprintf(c->rank, sizeof(c->rank), "%u", si->rank);
	snprintf(c->uid, sizeof(c->uid), "%u", (unsigned int)si->uid);
	snprintf(c->gid, sizeof(c->gid), "%u", (unsigned int)si->gid);
	snprintf(c->restarts, sizeof(c->restarts), "%u", si->restart_count);

	c->argv[n++] = slurmckpt_args.agent;
	c->argv[n++] = "agent";
	c->argv[n++] = "--fd";
	c->argv[n++] = c->fd;
	c->argv[n++] = "--job";
	c->argv[n++] = c->job;
	c->argv[n++] = "--step";
	c->argv[n++] = si->step;
	c->argv[n++] = "--rank";
	c->argv[n++] = c->rank;
	c->argv[n++] = "--uid";
	c->argv[n++] = c->uid;
	c->argv[n++] = "--gid";
	c->argv[n++] = c->gid;
	c->argv[n++] = "--restart-count";
	c->argv[n++] = c->restarts;
	c->argv[n++] = "--init";
	c->argv[n++] = slurmckpt_args.init;
	/* auto as a word: the agent's argv in ps says what the job asked for */
	if (interval == DURATION_AUTO)
		snprintf(c->interval, sizeof(c->interval), "auto");
	else
		snprintf(c->interval, sizeof(c->interval), "%ld", interval);
	c->argv[n++] = "--interval";
	c->argv[n++] = c->interval;
	c->argv[n++] = "--interval-from";
	c->argv[n++] = explicit ? "option" : "default";
	if (with_log) {
		snprintf(c->logfd, sizeof(c->logfd), "%d", AGENT_LOG_FD);
		c->argv[n++] = "--log-fd";
		c->argv[n++] = c->logfd;
	}
	c->argv[n] = NULL;

	root_exec_env(c->envp, c->conf, sizeof(c->conf), conf);
}

/* In the forked child: never returns. logfd: the relay's write end, or -1. */
static void agent_exec(struct agent_cmd *c, int sock, int nullfd, int errfd,
		       int logfd)
{
	int err, fd;

	/* Move everything above the target numbers first, then place it. */
	sock = fcntl(sock, F_DUPFD, 10);
	nullfd = fcntl(nullfd, F_DUPFD, 10);
	if (sock < 0 || nullfd < 0)
		goto fail;
	if ((fd = fcntl(errfd, F_DUPFD_CLOEXEC, 10)) < 0)
		goto fail;
	errfd = fd;
	if (logfd >= 0 && (logfd = fcntl(logfd, F_DUPFD, 10)) < 0)
		goto fail;
	if (dup2(nullfd, 0) < 0 || dup2(nullfd, 1) < 0 || dup2(nullfd, 2) < 0 ||
	    dup2(sock, AGENT_FD) < 0 || dup3(errfd, AGENT_ERR_FD, O_CLOEXEC) < 0)
		goto fail;
	errfd = AGENT_ERR_FD;
	if (logfd >= 0 && dup2(logfd, AGENT_LOG_FD) < 0)
		goto fail;
	close_from(AGENT_LOG_FD + 1);
	root_exec(c->argv, c->envp);
fail:
	err = errno;
	if (write(errfd, &err, sizeof(err)) < 0)
		err = 0;
	_exit(127);
}

/* 0 when the agent exec'd, -1 (errno set) when it did not. */
static int agent_wait_exec(pid_t pid, int errfd)
{
	ssize_t n;
	int err = 0;

	do
		n = read(errfd, &err, sizeof(err));
	while (n < 0 && errno == EINTR);
	if (n == 0)
		return (0);
	if (n != (ssize_t)sizeof(err))
		err = EIO;
	while (waitpid(pid, NULL, 0) < 0 && errno == EINTR)
		;
	errno = err;
	return (-1);
}

static int set_env(spank_t sp, const char *name, const char *value)
{
	spank_err_t rc;

	rc = spank_setenv(sp, name, value, 1);
	if (rc != ESPANK_SUCCESS) {
		slurm_error("slurmckpt: task_init_privileged: setenv %s: %s",
			    name, spank_strerror(rc));
		return (-1);
	}
	return (0);
}

static int set_env_long(spank_t sp, const char *name, long value)
{
	char buf[32];

	snprintf(buf, sizeof(buf), "%ld", value);
	return (set_env(sp, name, buf));
}

int agent_spawn(spank_t sp, long interval, int explicit)
{
	struct agent_cmd cmd;
	struct step_info si;
	int sv[2] = { -1, -1 };
	int errpipe[2] = { -1, -1 };
	int nullfd = -1;
	pid_t pid;
	int rv = -1;

	if (step_info_get(sp, &si) < 0)
		goto fail;
	agent_cmd_build(&cmd, &si, interval, explicit, log_relay_fd() >= 0);

	if (socketpair(AF_UNIX, SOCK_STREAM, 0, sv) < 0) {
		slurm_error("slurmckpt: task_init_privileged: socketpair: %s",
			    strerror(errno));
		goto fail;
	}
	if (fcntl(sv[1], F_SETFD, FD_CLOEXEC) < 0 ||
	    pipe2(errpipe, O_CLOEXEC) < 0 ||
	    (nullfd = open("/dev/null", O_RDWR | O_CLOEXEC)) < 0) {
		slurm_error("slurmckpt: task_init_privileged: agent setup: %s",
			    strerror(errno));
		goto fail;
	}

	pid = fork();
	if (pid < 0) {
		slurm_error("slurmckpt: task_init_privileged: fork: %s",
			    strerror(errno));
		goto fail;
	}
	if (pid == 0)
		agent_exec(&cmd, sv[1], nullfd, errpipe[1], log_relay_fd());

	close(errpipe[1]);
	errpipe[1] = -1;
	if (agent_wait_exec(pid, errpipe[0]) < 0) {
		slurm_error("slurmckpt: task_init_privileged: exec agent %s: %s",
			    cmd.argv[0], strerror(errno));
		goto fail;
	}
	/* sv[0] stays open, without close-on-exec, for the wrapper. */
	if (set_env_long(sp, "SLURMCKPT_AGENT_FD", sv[0]) < 0 ||
	    set_env(sp, "SLURMCKPT_INTERVAL", cmd.interval) < 0)
		goto fail;
	slurm_debug("slurmckpt: job %u step %s rank %u: agent pid %d, fd %d",
		    si.job_id, si.step, si.rank, (int)pid, sv[0]);
	sv[0] = -1;
	rv = 0;
fail:
	if (sv[0] >= 0)
		close(sv[0]);
	if (sv[1] >= 0)
		close(sv[1]);
	if (errpipe[0] >= 0)
		close(errpipe[0]);
	if (errpipe[1] >= 0)
		close(errpipe[1]);
	if (nullfd >= 0)
		close(nullfd);
	return (rv);
}
