/*
 * tree_end.c - a task's checkpointable tree ends with the task
 * (slurm_spank_task_exit: slurmstepd, root, each time it reaps a task).
 *
 * The root agent keeps each task's tree in a freeze cgroup of its own,
 * <root>/<job>.<step>.<rank>.<restart> (src/slurmckpt/node/task_cgroup.py), and
 * kills it when the task's wrapper goes. But Slurm's final SIGKILL ends the
 * agent and its thaw watchdog together with the wrapper, and a process frozen
 * by the cgroup v1 freezer does not die of SIGKILL until thawed: a tree its
 * user held frozen (its coordinator stalled inside an epoch, then scancel)
 * would survive the job, frozen and unkillable; on a pure v1 host it is not
 * even in Slurm's freezer cgroup, so Slurm neither signals nor waits for it.
 * slurmstepd outlives every task it reaps, whatever the ProctrackType, so it
 * ends what is left: each process of the task's freeze cgroups is killed
 * (v2: cgroup.kill; v1: frozen first, so that no pid read can exit and be
 * reused before its kill, then thawed so that the kills land), and the
 * emptied cgroup removed. Every start of the task is matched (22.05's
 * slurmstepd does not know the restart count; Slurm never runs two starts of
 * a job at once). Pure v2 hosts keep the tree in Slurm's own task cgroup,
 * which Slurm signals and waits for; there a frozen process dies of SIGKILL.
 */
#include <dirent.h>
#include <errno.h>
#include <fcntl.h>
#include <signal.h>
#include <stdbool.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <time.h>
#include <unistd.h>

#include "site_config.h"
#include "slurmckpt.h"

#define ROUNDS   50             /* x ROUND_MS: a tree has 1 s to die */
#define ROUND_MS 20

/* Where task_cgroup.default_root() puts the trees, on each kind of host. */
const char *const tree_end_default_roots[] = {
	"/sys/fs/cgroup/unified/slurmckpt",     /* hybrid: v2 beside Slurm's v1 */
	"/sys/fs/cgroup/slurmckpt",             /* pure v2 without a Slurm task cgroup */
	"/sys/fs/cgroup/freezer/slurmckpt",     /* pure v1 */
	NULL,
};

static void pause_ms(long ms)
{
	struct timespec ts = { ms / 1000, (ms % 1000) * 1000000L };

	while (nanosleep(&ts, &ts) < 0 && errno == EINTR)
		;
}

static int put(int dirfd, const char *name, const char *text)
{
	ssize_t n, len = (ssize_t)strlen(text);
	int fd = openat(dirfd, name, O_WRONLY | O_CLOEXEC | O_NOFOLLOW);

	if (fd < 0)
		return (-1);
	n = write(fd, text, (size_t)len);
	close(fd);
	return (n == len ? 0 : -1);
}

static bool reads(int dirfd, const char *name, const char *want)
{
	char buf[32];
	ssize_t n;
	int fd = openat(dirfd, name, O_RDONLY | O_CLOEXEC | O_NOFOLLOW);

	if (fd < 0)
		return (false);
	n = read(fd, buf, sizeof(buf) - 1);
	close(fd);
	if (n <= 0)
		return (false);
	buf[n] = '\0';
	buf[strcspn(buf, "\n")] = '\0';
	return (strcmp(buf, want) == 0);
}

/* SIGKILL to each process of the cgroup (sig 0: count them); -1 if unreadable. */
static int signal_procs(int dirfd, int sig)
{
	int fd = openat(dirfd, "cgroup.procs", O_RDONLY | O_CLOEXEC | O_NOFOLLOW);
	FILE *f;
	int pid, n = 0;

	if (fd < 0 || (f = fdopen(fd, "r")) == NULL) {
		if (fd >= 0)
			close(fd);
		return (-1);
	}
	while (fscanf(f, "%d", &pid) == 1) {
		if (pid > 0 && (sig == 0 || kill(pid, sig) == 0 || errno == ESRCH))
			n++;
	}
	fclose(f);
	return (n);
}

/*
 * Kill everything in one tree cgroup and thaw it; *killed: how many processes
 * it held. 0 once it is empty, -1 when processes are left after ROUNDS.
 */
static int end_cgroup(int dirfd, int *killed)
{
	bool v1 = faccessat(dirfd, "freezer.state", F_OK, 0) == 0;
	int round, left = signal_procs(dirfd, 0);

	*killed = left > 0 ? left : 0;
	for (round = 0; round < ROUNDS && left > 0; round++) {
		if (v1) {
			int wait;

			(void)put(dirfd, "freezer.state", "FROZEN");
			/* A freeze that does not settle (a task in D state) still gets its kills. */
			for (wait = 0; wait < 10 && !reads(dirfd, "freezer.state", "FROZEN"); wait++)
				pause_ms(5);
			(void)signal_procs(dirfd, SIGKILL);
			(void)put(dirfd, "freezer.state", "THAWED");
		} else if (put(dirfd, "cgroup.kill", "1") < 0) {
			/* Before Linux 5.14: a v2-frozen process dies of SIGKILL anyway. */
			(void)signal_procs(dirfd, SIGKILL);
			(void)put(dirfd, "cgroup.freeze", "0");
		}
		pause_ms(ROUND_MS);
		left = signal_procs(dirfd, 0);
	}
	if (!v1)
		(void)put(dirfd, "cgroup.freeze", "0");
	return (left > 0 ? -1 : 0);
}

/*
 * rmdir of a tree cgroup just ended. Its killed processes may still be on
 * their way out, on a busy node longer than end_cgroup() watched them, and the
 * cgroup stays busy until they are gone (seen: one left behind, for the node's
 * gc to find), so EBUSY is tried again for up to ROUNDS x ROUND_MS.
 */
static int remove_ended(int rootfd, const char *name)
{
	int round;

	for (round = 0; unlinkat(rootfd, name, AT_REMOVEDIR) < 0; round++) {
		if (errno != EBUSY || round >= ROUNDS)
			return (-1);
		pause_ms(ROUND_MS);
	}
	return (0);
}

/* <job>.<step>.<rank>.<restart>: the given task's tree, at any start. */
static bool names_task(const char *name, const char *prefix)
{
	size_t n = strlen(prefix);

	return (strncmp(name, prefix, n) == 0 && name[n] != '\0' &&
		strspn(name + n, "0123456789") == strlen(name + n));
}

int tree_end(const char *const roots[], uint32_t job, const char *step, uint32_t rank)
{
	char prefix[64];
	int i, rv = 0;

	snprintf(prefix, sizeof(prefix), "%u.%s.%u.", job, step, rank);
	for (i = 0; roots[i] != NULL; i++) {
		int rootfd = open(roots[i], O_RDONLY | O_DIRECTORY | O_CLOEXEC | O_NOFOLLOW);
		struct dirent *e;
		DIR *d;

		if (rootfd < 0)
			continue;                       /* no such hierarchy on this host */
		if ((d = fdopendir(dup(rootfd))) == NULL) {
			close(rootfd);
			continue;
		}
		while ((e = readdir(d)) != NULL) {
			int fd, killed = 0;

			if (!names_task(e->d_name, prefix))
				continue;
			fd = openat(rootfd, e->d_name, O_RDONLY | O_DIRECTORY | O_CLOEXEC | O_NOFOLLOW);
			if (fd < 0)
				continue;
			if (end_cgroup(fd, &killed) < 0) {
				slurm_error("slurmckpt: task_exit: %s/%s: processes left after SIGKILL",
					    roots[i], e->d_name);
				rv = -1;
			} else if (killed > 0) {
				slurm_info("slurmckpt: task_exit: ended %d process(es) its agent left in %s/%s",
					   killed, roots[i], e->d_name);
			}
			close(fd);
			/* Ended: ours to remove (the agent, if still there, finds it gone). */
			if (remove_ended(rootfd, e->d_name) < 0 && errno != ENOENT)
				slurm_error("slurmckpt: task_exit: rmdir %s/%s: %m", roots[i], e->d_name);
		}
		closedir(d);
		close(rootfd);
	}
	return (rv);
}

/* The roots to search: the admin's freezer_root, if set, then every default. */
int tree_end_task(spank_t sp)
{
	static char configured[4096];
	const char *roots[sizeof(tree_end_default_roots) / sizeof(tree_end_default_roots[0]) + 1];
	struct step_info si;
	size_t i, n = 0;

	if (step_info_get(sp, &si) < 0)
		return (-1);
	if (site_config_get(SLURMCKPT_CONFIG, "freezer_root", configured, sizeof(configured)) > 0 &&
	    configured[0] == '/' && strcmp(configured, "auto") != 0)
		roots[n++] = configured;
	for (i = 0; tree_end_default_roots[i] != NULL; i++)
		roots[n++] = tree_end_default_roots[i];
	roots[n] = NULL;
	return (tree_end(roots, si.job_id, si.step, si.rank));
}
