/*
 * close_from.c - every fd from a number up closed, before a root exec
 * (agent_spawn.c, job_end.c): nothing of slurmstepd's reaches the command.
 */
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
