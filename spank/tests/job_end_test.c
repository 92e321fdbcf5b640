/*
 * job_end_test.c - job_end_start() against a fake SPANK: the command it starts
 * gets the job id and uid from Slurm's items, the node and node list slurmd
 * set, a fixed environment (nothing else of the epilog's: no SPANK_*, no
 * loader variables), no inherited fd, a session of its own, and is not a child
 * of the epilog; an agent= that cannot be exec'd is reported, not hidden.
 */
#include <errno.h>
#include <fcntl.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <time.h>
#include <unistd.h>

#include "../slurmckpt.h"

#include "check.h"

struct plugin_args slurmckpt_args;
static char last_error[512];

spank_err_t spank_get_item(spank_t sp, spank_item_t item, ...)
{
	va_list ap;

	(void)sp;
	va_start(ap, item);
	if (item == S_JOB_ID)
		*va_arg(ap, uint32_t *) = 4242;
	else if (item == S_JOB_UID)
		*va_arg(ap, uid_t *) = 1001;
	va_end(ap);
	return (item == S_JOB_ID || item == S_JOB_UID ? ESPANK_SUCCESS : ESPANK_BAD_ARG);
}

const char *spank_strerror(spank_err_t err)
{
	(void)err;
	return ("fake error");
}

void slurm_error(const char *fmt, ...)
{
	va_list ap;

	va_start(ap, fmt);
	vsnprintf(last_error, sizeof(last_error), fmt, ap);
	va_end(ap);
}

void slurm_debug(const char *fmt, ...)
{
	(void)fmt;
}

static char dir[] = "/tmp/job_end_test.XXXXXX";

/* The fake agent: what it was given, into <dir>/out (renamed there once complete). */
static void write_agent(void)
{
	char path[256];
	FILE *f;

	snprintf(path, sizeof(path), "%s/agent", dir);
	f = fopen(path, "w");
	fprintf(f, "#!/bin/sh\nexec >%s/out.tmp\n"
		   "echo \"argv: $*\"\n"
		   "echo \"ppid: $PPID\"\n"
		   "echo \"sid: $(cut -d' ' -f6 /proc/$$/stat)\"\n"
		   "echo \"cwd: $(pwd)\"\n"
		   "echo \"fds: $(ls /proc/$$/fd | tr '\\n' ' ')\"\n"
		   "env | sed 's/^/env: /'\n"
		   "mv %s/out.tmp %s/out\n", dir, dir, dir);
	fclose(f);
	chmod(path, 0755);
	snprintf(slurmckpt_args.agent, sizeof(slurmckpt_args.agent), "%s", path);
}

/* <dir>/out once the agent wrote it (5 s at most), "" otherwise. */
static const char *agent_output(void)
{
	static char buf[8192];
	char path[256];
	struct timespec pause = { 0, 20 * 1000000L };
	size_t n = 0;
	FILE *f = NULL;
	int i;

	snprintf(path, sizeof(path), "%s/out", dir);
	for (i = 0; i < 250 && (f = fopen(path, "r")) == NULL; i++)
		nanosleep(&pause, NULL);
	if (f != NULL) {
		n = fread(buf, 1, sizeof(buf) - 1, f);
		fclose(f);
		unlink(path);
	}
	buf[n] = '\0';
	return (buf);
}

static int has_line(const char *text, const char *line)
{
	size_t n = strlen(line);
	const char *p = text;

	while ((p = strstr(p, line)) != NULL) {
		if ((p == text || p[-1] == '\n') && (p[n] == '\n' || p[n] == '\0'))
			return (1);
		p += n;
	}
	return (0);
}

int main(void)
{
	const char *out;
	char want[64];

	if (mkdtemp(dir) == NULL) {
		perror("mkdtemp");
		return (1);
	}
	write_agent();
	/* The epilog's environment: slurmd's variables, and the job's own as SPANK_*. */
	setenv("SLURM_CONF", "/etc/test/slurm.conf", 1);
	setenv("SLURMD_NODENAME", "node2", 1);
	setenv("SLURM_NODELIST", "node[1-3]", 1);
	setenv("SPANK__SLURM_SPANK_OPTION_slurmckpt_checkpoint_interval", "10s", 1);
	setenv("LD_LIBRARY_PATH", "/home/user/lib", 1);
	CHECK(dup2(open("/dev/null", O_RDONLY), 57) == 57, "dup2: %s", strerror(errno));

	CHECK(job_end_start(NULL) == 0, "job_end_start failed: %s", last_error);
	out = agent_output();
	CHECK(has_line(out, "argv: job-end --job 4242 --uid 1001 --node node2 --nodes node[1-3]"), "argv:\n%s", out);
	CHECK(has_line(out, "env: PATH=/usr/sbin:/usr/bin:/sbin:/bin"), "PATH:\n%s", out);
	CHECK(has_line(out, "env: SLURM_CONF=/etc/test/slurm.conf"), "SLURM_CONF:\n%s", out);
	CHECK(strstr(out, "SPANK_") == NULL && strstr(out, "LD_LIBRARY_PATH") == NULL &&
	      strstr(out, "SLURMD_NODENAME") == NULL, "the epilog's environment leaked:\n%s", out);
	CHECK(strstr(out, " 57 ") == NULL, "an epilog fd was inherited:\n%s", out);
	CHECK(has_line(out, "cwd: /"), "cwd:\n%s", out);
	snprintf(want, sizeof(want), "ppid: %d", (int)getpid());
	CHECK(strstr(out, want) == NULL, "the command is the epilog's child:\n%s", out);
	snprintf(want, sizeof(want), "sid: %d", (int)getsid(0));
	CHECK(strstr(out, "sid: ") != NULL && strstr(out, want) == NULL, "the command shares the epilog's session:\n%s", out);

	/* Without the node or its list: the command gets neither (every node then acts). */
	unsetenv("SLURMD_NODENAME");
	CHECK(job_end_start(NULL) == 0, "job_end_start failed: %s", last_error);
	out = agent_output();
	CHECK(has_line(out, "argv: job-end --job 4242 --uid 1001"), "argv without the node:\n%s", out);

	snprintf(slurmckpt_args.agent, sizeof(slurmckpt_args.agent), "%s/missing", dir);
	CHECK(job_end_start(NULL) == -1, "a missing agent was not reported");
	CHECK(strstr(last_error, "No such file or directory") != NULL && strstr(last_error, "job 4242") != NULL,
	      "error '%s'", last_error);

	snprintf(want, sizeof(want), "%s/agent", dir);
	unlink(want);
	rmdir(dir);
	if (failures) {
		fprintf(stderr, "job_end_test: %d failure(s)\n", failures);
		return (1);
	}
	printf("job_end_test: ok\n");
	return (0);
}
