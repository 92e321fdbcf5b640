/*
 * io_uring_probe - what the kernel answers this process for io_uring, through every ABI it can reach:
 *
 *   setup=    io_uring_setup(1, NULL)           EFAULT where io_uring is open (NULL params), EPERM blocked
 *   enter=    io_uring_enter(-1, ...)           EBADF open, EPERM blocked
 *   register= io_uring_register(-1, ...)        EBADF open, EPERM blocked
 *   x32=      (x86_64) setup with the x32 bit   ENOSYS without CONFIG_X86_X32_ABI, EFAULT with, EPERM blocked
 *   i386=     (x86_64) setup through int $0x80  EFAULT open, EPERM blocked; in a child, which may die of it
 *
 * One line: "setup=E enter=E register=E x32=E i386=E" ("-" where the ABI is not this architecture's).
 */
#include <errno.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/syscall.h>
#include <sys/wait.h>
#include <unistd.h>

static const char *answer(long rc, int err)
{
	char buf[32];
	static const struct { int err; const char *name; } names[] = {
		{ EPERM, "EPERM" }, { EFAULT, "EFAULT" }, { EBADF, "EBADF" }, { ENOSYS, "ENOSYS" },
		{ EINVAL, "EINVAL" }, { EOPNOTSUPP, "EOPNOTSUPP" }, { ENOMEM, "ENOMEM" },
	};
	size_t i;

	if (rc >= 0) {
		close((int)rc);
		return ("ring");
	}
	for (i = 0; i < sizeof(names) / sizeof(names[0]); i++)
		if (names[i].err == err)
			return (names[i].name);
	snprintf(buf, sizeof(buf), "errno%d", err);
	return (strdup(buf));
}

static const char *native(long nr, long a, long b)
{
	long rc = syscall(nr, a, b, 0L, 0L, 0L, 0L);

	return (answer(rc, errno));
}

#if defined(__x86_64__)
/* The i386 ABI from a 64-bit process: in a child, since a kernel without it may end the caller. */
static const char *i386_setup(void)
{
	int status, fd[2];
	char buf[32] = "";
	pid_t pid;

	if (pipe(fd) != 0)
		return ("pipe");
	if ((pid = fork()) == 0) {
		long rc = 425;
		const char *a;

		__asm__ volatile("int $0x80" : "+a"(rc) : "b"(1L), "c"(0L) : "memory", "r8", "r9", "r10", "r11");
		rc = (int)rc;
		a = answer(rc < 0 ? -1 : rc, rc < 0 ? (int)-rc : 0);
		(void)!write(fd[1], a, strlen(a));
		_exit(0);
	}
	close(fd[1]);
	(void)!read(fd[0], buf, sizeof(buf) - 1);
	close(fd[0]);
	if (pid < 0 || waitpid(pid, &status, 0) != pid)
		return ("fork");
	if (WIFSIGNALED(status)) {
		snprintf(buf, sizeof(buf), "signal%d", WTERMSIG(status));
	}
	return (strdup(buf));
}
#endif

int main(void)
{
	const char *x32 = "-", *i386 = "-";
	const char *setup = native(425, 1, 0), *enter = native(426, -1, 0), *reg = native(427, -1, 0);

#if defined(__x86_64__)
	x32 = native(425 | 0x40000000L, 1, 0);
	i386 = i386_setup();
#endif
	printf("setup=%s enter=%s register=%s x32=%s i386=%s\n", setup, enter, reg, x32, i386);
	return (0);
}
