/*
 * log_relay.c - the agents' event lines into slurmd's log.
 *
 * slurmstepd's stderr is /dev/null (slurmd's _forkexec_slurmstepd), so an
 * agent's stderr reaches no log. In slurmstepd (user_init) the plugin opens
 * a pipe and a thread that hands every line read from it to slurm_info()
 * or, for lines starting "error ", slurm_error(): slurmstepd writes them to
 * slurmd's log with the step's [JOB.STEP] prefix. Each agent of the step
 * gets the write end as --log-fd (docs/operations.md, "slurmd's log").
 * The relay only copies: control characters become '?', a line is cut at
 * RELAY_LINE bytes.
 */
#include <errno.h>
#include <fcntl.h>
#include <pthread.h>
#include <signal.h>
#include <string.h>
#include <time.h>
#include <unistd.h>

#include "slurmckpt.h"

#define RELAY_LINE 1024

static int relay_read_fd = -1;
static int relay_write_fd = -1;
static pthread_t relay_thread;

void log_relay_emit(char *line)
{
	char *p;

	for (p = line; *p; p++)
		if ((unsigned char)*p < 0x20 || *p == 0x7f)
			*p = '?';
	if (strncmp(line, "error ", 6) == 0)
		slurm_error("slurmckpt: %s", line + 6);
	else if (strncmp(line, "info ", 5) == 0)
		slurm_info("slurmckpt: %s", line + 5);
	else if (line[0] != '\0')
		slurm_info("slurmckpt: %s", line);
}

static void *relay_main(void *arg)
{
	char buf[RELAY_LINE + 1], *start, *nl;
	size_t used = 0, rest;
	ssize_t n;

	(void)arg;
	for (;;) {
		n = read(relay_read_fd, buf + used, RELAY_LINE - used);
		if (n < 0 && errno == EINTR)
			continue;
		if (n <= 0)
			break;
		used += (size_t)n;
		start = buf;
		while ((nl = memchr(start, '\n', (size_t)(buf + used - start)))) {
			*nl = '\0';
			log_relay_emit(start);
			start = nl + 1;
		}
		rest = (size_t)(buf + used - start);
		memmove(buf, start, rest);
		used = rest;
		if (used == RELAY_LINE) {       /* an overlong line: cut */
			buf[used] = '\0';
			log_relay_emit(buf);
			used = 0;
		}
	}
	buf[used] = '\0';
	log_relay_emit(buf);
	close(relay_read_fd);
	relay_read_fd = -1;
	return (NULL);
}

int log_relay_start(void)
{
	int fds[2];
	sigset_t all, old;
	int rc;

	if (relay_write_fd >= 0)
		return (0);
	if (pipe2(fds, O_CLOEXEC) < 0) {
		slurm_error("slurmckpt: log relay: pipe: %s", strerror(errno));
		return (-1);
	}
	relay_read_fd = fds[0];
	relay_write_fd = fds[1];
	/* The thread takes no signal meant for slurmstepd. */
	sigfillset(&all);
	pthread_sigmask(SIG_SETMASK, &all, &old);
	rc = pthread_create(&relay_thread, NULL, relay_main, NULL);
	pthread_sigmask(SIG_SETMASK, &old, NULL);
	if (rc != 0) {
		slurm_error("slurmckpt: log relay: pthread_create: %s", strerror(rc));
		close(fds[0]);
		close(fds[1]);
		relay_read_fd = relay_write_fd = -1;
		return (-1);
	}
	return (0);
}

int log_relay_fd(void)
{
	return (relay_write_fd);
}

void log_relay_stop(int wait_s)
{
	struct timespec until;

	if (relay_write_fd < 0)
		return;
	close(relay_write_fd);
	relay_write_fd = -1;
	/* EOF once every agent has exited too; an agent still running costs its last lines, not the step. */
	clock_gettime(CLOCK_REALTIME, &until);
	until.tv_sec += wait_s;
	if (pthread_timedjoin_np(relay_thread, NULL, &until) != 0)
		pthread_detach(relay_thread);
}
