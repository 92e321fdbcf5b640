/*
 * io_uring_steps STEPS SLEEP_MS KEEP_AT - asks for an io_uring at every step and prints what it got; the
 * ring of step KEEP_AT, if one comes, is kept (as libuv keeps the ring of its loop), the others closed at
 * once. Under slurmckpt's block every answer is EPERM, in a restored process too (the filter comes back
 * with it): a run captured and restored prints the same lines as one never interrupted. With the block
 * off it holds a ring from step KEEP_AT on, which the capture's check stage refuses.
 */
#include <errno.h>
#include <linux/io_uring.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/syscall.h>
#include <time.h>
#include <unistd.h>

static const char *ask(int *fd)
{
	struct io_uring_params params;
	long rc;

	memset(&params, 0, sizeof(params));
	rc = syscall(425, 4, &params);          /* io_uring_setup, 425 on x86_64 and aarch64 */
	*fd = rc >= 0 ? (int)rc : -1;
	if (rc >= 0)
		return ("ring");
	return (errno == EPERM ? "EPERM" : strerror(errno));
}

int main(int argc, char **argv)
{
	int steps = argc > 1 ? atoi(argv[1]) : 60, keep_at = argc > 3 ? atoi(argv[3]) : 0, i, fd;
	long ms = argc > 2 ? atol(argv[2]) : 250;
	struct timespec pause = { ms / 1000, (ms % 1000) * 1000000L };

	for (i = 0; i < steps; i++) {
		const char *got = ask(&fd);

		if (fd >= 0 && i != keep_at)
			close(fd);
		printf("step %d io_uring_setup: %s\n", i, got);
		fflush(stdout);
		nanosleep(&pause, NULL);
	}
	printf("done\n");
	return (0);
}
