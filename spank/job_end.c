/*
 * job_end.c - a checkpointed job left this node (slurm_spank_job_epilog:
 * slurmd's `slurmstepd spank epilog`, root, on every node of the job each
 * time it ends, is requeued or preempted).
 *
 * Starts `<agent> job-end --job N --uid U [--node NAME --nodes LIST]`
 * detached (its own session, a grandchild nobody waits for) and returns at
 * once. What it decides, whether Slurm says the job is finished and which
 * node acts, is Python's (src/slurmckpt/store/job_end.py): slurmctld shows the job
 * COMPLETING until every node's epilog has returned, so its final word cannot
 * be waited for here. Job id and uid come from Slurm (S_JOB_ID, S_JOB_UID);
 * the node's name and the job's node list from the variables slurmd itself
 * sets in the epilog's environment (a job's own variables reach it only as
 * SPANK_*); the command gets a fixed environment and no inherited fd.
 */
#include <errno.h>
#include <fcntl.h>
#include <grp.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <unistd.h>

#include "slurmckpt.h"

#define NODES_MAX     16384     /* a longer node list is left out: every node then acts */

struct job_end_cmd {
	char job[16], uid[16];
	char conf[PATH_MAX + 16];
	char *argv[12];
	char *envp[3];
};

/* A variable slurmd sets, or NULL when missing, empty or longer than max. */
static const char *slurmd_var(const char *name, size_t max)
{
	const char *value = getenv(name);

	if (value == NULL || value[0] == '\0' || strlen(value) > max)
		return (NULL);
	return (value);
}

static void job_end_cmd_build(struct job_end_cmd *c, uint32_t job, uid_t uid)
{
	const char *conf = getenv("SLURM_CONF");
	const char *node = slurmd_var("SLURMD_NODENAME", 255);
	/* 22.05's epilog has SLURM_NODELIST only; later releases add SLURM_JOB_NODELIST, the same list. */
	const char *nodes = slurmd_var("SLURM_NODELIST", NODES_MAX);
	int n = 0;

	snprintf(c->job, sizeof(c->job), "%u", job);
	snprintf(c->uid, sizeof(c->uid), "%u", (unsigned int)uid);
	c->argv[n++] = slurmckpt_args.agent;
	c->argv[n++] = "job-end";
	c->argv[n++] = "--job";
	c->argv[n++] = c->job;
	c->argv[n++] = "--uid";
	c->argv[n++] = c->uid;
	if (node != NULL && nodes != NULL) {
		c->argv[n++] = "--node";
		c->argv[n++] = (char *)node;
		c->argv[n++] = "--nodes";
		c->argv[n++] = (char *)nodes;
	}
	c->argv[n] = NULL;

	root_exec_env(c->envp, c->conf, sizeof(c->conf), conf);
}

/* The grandchild: never returns. errfd: close-on-exec, gets errno on failure. */
static void job_end_exec(struct job_end_cmd *c, int errfd)
{
	int err, nullfd;

	/* Above the target numbers first, then placed: 0-2 /dev/null, 3 the error pipe. */
	if ((err = fcntl(errfd, F_DUPFD_CLOEXEC, 10)) < 0)
		goto fail;
	errfd = err;
	if ((nullfd = open("/dev/null", O_RDWR | O_CLOEXEC)) < 0 ||
	    dup2(nullfd, 0) < 0 || dup2(nullfd, 1) < 0 || dup2(nullfd, 2) < 0 ||
	    dup3(errfd, 3, O_CLOEXEC) < 0)
		goto fail;
	errfd = 3;
	close_from(4);
	umask(022);
	root_exec(c->argv, c->envp);
fail:
	err = errno;
	if (write(errfd, &err, sizeof(err)) < 0)
		err = 0;
	_exit(127);
}

/* 0 once the command exec'd, -1 (errno set) when it did not. */
static int job_end_spawn(struct job_end_cmd *c)
{
	int errpipe[2], status, err = 0;
	pid_t pid;
	ssize_t n;

	if (pipe2(errpipe, O_CLOEXEC) < 0)
		return (-1);
	if ((pid = fork()) < 0) {
		err = errno;
		goto fail;
	}
	if (pid == 0) {
		/* A session of its own, and a parent that exits: init (or a subreaper) reaps it. */
		close(errpipe[0]);
		if (setsid() < 0 || (pid = fork()) < 0) {
			err = errno;
			if (write(errpipe[1], &err, sizeof(err)) < 0)
				err = 0;
			_exit(127);
		}
		if (pid == 0)
			job_end_exec(c, errpipe[1]);
		_exit(0);
	}
	close(errpipe[1]);
	errpipe[1] = -1;
	while (waitpid(pid, &status, 0) < 0 && errno == EINTR)
		;
	do
		n = read(errpipe[0], &err, sizeof(err));
	while (n < 0 && errno == EINTR);
	if (n == 0)
		err = 0;
	else if (n != (ssize_t)sizeof(err))
		err = EIO;
fail:
	close(errpipe[0]);
	if (errpipe[1] >= 0)
		close(errpipe[1]);
	errno = err;
	return (err ? -1 : 0);
}

int job_end_start(spank_t sp)
{
	struct job_end_cmd cmd;
	uint32_t job;
	uid_t uid;
	spank_err_t rc;

	if ((rc = spank_get_item(sp, S_JOB_ID, &job)) != ESPANK_SUCCESS ||
	    (rc = spank_get_item(sp, S_JOB_UID, &uid)) != ESPANK_SUCCESS) {
		slurm_error("slurmckpt: job_epilog: job id/uid: %s", spank_strerror(rc));
		return (-1);
	}
	job_end_cmd_build(&cmd, job, uid);
	if (job_end_spawn(&cmd) < 0) {
		slurm_error("slurmckpt: job_epilog: job %u: start %s job-end: %s", job,
			    cmd.argv[0], strerror(errno));
		return (-1);
	}
	slurm_debug("slurmckpt: job_epilog: job %u: %s job-end started", job, cmd.argv[0]);
	return (0);
}
