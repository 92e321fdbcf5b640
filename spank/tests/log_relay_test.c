/*
 * log_relay_test.c - the log relay (log_relay.c) against fake slurm_info()
 * and slurm_error(): what an agent writes to the relay reaches slurmd's log
 * line by line, at the level it names, with control characters replaced and
 * an overlong line cut; stopping it drains what was written before.
 */
#include <stdarg.h>
#include <stdio.h>
#include <string.h>
#include <unistd.h>

#include "../slurmckpt.h"

#include "check.h"

static char logged[16][1200];
static char levels[16][8];
static int nlogged;

static void keep(const char *level, const char *fmt, va_list ap)
{
	if (nlogged >= 16)
		return;
	snprintf(levels[nlogged], sizeof(levels[nlogged]), "%s", level);
	vsnprintf(logged[nlogged], sizeof(logged[nlogged]), fmt, ap);
	nlogged++;
}

void slurm_info(const char *fmt, ...)
{
	va_list ap;

	va_start(ap, fmt);
	keep("info", fmt, ap);
	va_end(ap);
}

void slurm_error(const char *fmt, ...)
{
	va_list ap;

	va_start(ap, fmt);
	keep("error", fmt, ap);
	va_end(ap);
}

static void put(int fd, const char *text)
{
	CHECK(write(fd, text, strlen(text)) == (ssize_t)strlen(text), "short write");
}

int main(void)
{
	char longline[1500];
	int fd;

	CHECK(log_relay_fd() == -1, "relay open before start");
	CHECK(log_relay_start() == 0, "start failed");
	CHECK(log_relay_start() == 0, "a second start (user_init per step) must be a no-op");
	fd = log_relay_fd();
	CHECK(fd >= 0, "no write end");
	put(fd, "info job=7 rank=batch.0 event=commit epoch=3\n");
	put(fd, "error job=7 event=capture-failed reason=\"a\x1b[2Jb\"\n");
	put(fd, "plain line");
	put(fd, " in two writes\n");
	memset(longline, 'x', sizeof(longline) - 2);
	longline[sizeof(longline) - 2] = '\n';
	longline[sizeof(longline) - 1] = '\0';
	put(fd, longline);
	put(fd, "info last line, no newline");
	log_relay_stop(5);
	CHECK(log_relay_fd() == -1, "write end still open after stop");

	CHECK(nlogged == 6, "logged %d lines, want 6", nlogged);
	CHECK(strcmp(levels[0], "info") == 0 &&
	      strcmp(logged[0], "slurmckpt: job=7 rank=batch.0 event=commit epoch=3") == 0,
	      "line 0: %s %s", levels[0], logged[0]);
	CHECK(strcmp(levels[1], "error") == 0 &&
	      strcmp(logged[1], "slurmckpt: job=7 event=capture-failed reason=\"a?[2Jb\"") == 0,
	      "line 1: %s %s", levels[1], logged[1]);
	CHECK(strcmp(logged[2], "slurmckpt: plain line in two writes") == 0, "line 2: %s", logged[2]);
	CHECK(strlen(logged[3]) == strlen("slurmckpt: ") + 1024, "overlong line not cut: %zu",
	      strlen(logged[3]));
	CHECK(strspn(logged[4] + strlen("slurmckpt: "), "x") == sizeof(longline) - 2 - 1024, "rest of the long line: %s", logged[4]);
	CHECK(strcmp(logged[5], "slurmckpt: last line, no newline") == 0, "line 5: %s", logged[5]);
	if (failures)
		return (1);
	printf("log_relay_test: all checks passed\n");
	return (0);
}
