/*
 * tree_end_test.c - tree_end() on real cgroups (as root): on each hierarchy
 * this host has (the v1 freezer, cgroup v2), frozen trees of the task from two
 * starts, of another rank, of another job and a directory not named like a
 * tree. First what made a tree outlive its job: a v1-frozen process survives
 * SIGKILL. Then tree_end() kills the task's trees, thaws and removes their
 * cgroups, and leaves the others as they were. Also site_config_get().
 */
#include <errno.h>
#include <fcntl.h>
#include <signal.h>
#include <stdarg.h>
#include <stdbool.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

#include "../site_config.h"
#include "../slurmckpt.h"

#include "check.h"

void slurm_info(const char *fmt, ...)
{
	va_list ap;

	va_start(ap, fmt);
	vfprintf(stderr, fmt, ap);
	va_end(ap);
	fputc('\n', stderr);
}

void slurm_error(const char *fmt, ...)
{
	va_list ap;

	va_start(ap, fmt);
	fputs("error: ", stderr);
	vfprintf(stderr, fmt, ap);
	va_end(ap);
	fputc('\n', stderr);
}

/* tree_end_task() is the plugin's; this test calls tree_end() with its own roots. */
int step_info_get(spank_t sp, struct step_info *si)
{
	(void)sp;
	(void)si;
	return (-1);
}

#define NTREES 5
static const char *const names[NTREES] = {
	"7.batch.0.0", "7.batch.0.1",           /* the task, two starts: ended */
	"7.batch.1.0", "17.batch.0.0", "7.batch.0",   /* another rank, another job, no tree name */
};
static const bool ended[NTREES] = { true, true, false, false, false };

static void sleep_ms(long ms)
{
	struct timespec ts = { ms / 1000, (ms % 1000) * 1000000L };

	nanosleep(&ts, NULL);
}

static int put(const char *dir, const char *file, const char *text)
{
	char path[512];
	int fd, rv;

	snprintf(path, sizeof(path), "%s/%s", dir, file);
	if ((fd = open(path, O_WRONLY)) < 0)
		return (-1);
	rv = write(fd, text, strlen(text)) == (ssize_t)strlen(text) ? 0 : -1;
	close(fd);
	return (rv);
}

static bool frozen(const char *dir, bool v1)
{
	char path[512], buf[256] = "";
	FILE *f;

	snprintf(path, sizeof(path), "%s/%s", dir, v1 ? "freezer.state" : "cgroup.events");
	if ((f = fopen(path, "r")) == NULL)
		return (false);
	buf[fread(buf, 1, sizeof(buf) - 1, f)] = '\0';
	fclose(f);
	return (v1 ? strncmp(buf, "FROZEN", 6) == 0 : strstr(buf, "frozen 1") != NULL);
}

/* The child's state: 0 running, its wait status once it ended, after up to ms. */
static int ended_status(pid_t pid, long ms)
{
	int status;

	for (; ms >= 0; ms -= 10) {
		if (waitpid(pid, &status, WNOHANG) == pid)
			return (status);
		sleep_ms(10);
	}
	return (0);
}

static void one_hierarchy(const char *mount, bool v1)
{
	char root[256], dir[NTREES][320], pidtext[16];
	const char *roots[] = { root, NULL };
	pid_t child[NTREES];
	int i, status;

	snprintf(root, sizeof(root), "%s/slurmckpt-test.%d", mount, (int)getpid());
	CHECK(mkdir(root, 0755) == 0, "mkdir %s: %s", root, strerror(errno));
	for (i = 0; i < NTREES; i++) {
		snprintf(dir[i], sizeof(dir[i]), "%s/%s", root, names[i]);
		CHECK(mkdir(dir[i], 0755) == 0, "mkdir %s: %s", dir[i], strerror(errno));
		if ((child[i] = fork()) == 0) {
			for (;;)
				pause();
		}
		snprintf(pidtext, sizeof(pidtext), "%d", (int)child[i]);
		CHECK(put(dir[i], "cgroup.procs", pidtext) == 0, "join %s: %s", dir[i], strerror(errno));
		CHECK(put(dir[i], v1 ? "freezer.state" : "cgroup.freeze", v1 ? "FROZEN" : "1") == 0,
		      "freeze %s: %s", dir[i], strerror(errno));
	}
	for (i = 0; i < NTREES; i++) {
		int waited;

		for (waited = 0; waited < 200 && !frozen(dir[i], v1); waited++)
			sleep_ms(10);
		CHECK(frozen(dir[i], v1), "%s did not freeze", dir[i]);
	}
	if (v1) {      /* the precondition: the kernel holds a v1-frozen process's SIGKILL until a thaw */
		kill(child[0], SIGKILL);
		CHECK(ended_status(child[0], 300) == 0, "%s: a v1-frozen process died of SIGKILL", mount);
	}

	CHECK(tree_end(roots, 7, "batch", 0) == 0, "%s: tree_end failed", mount);
	for (i = 0; i < NTREES; i++) {
		struct stat st;

		if (ended[i]) {
			status = ended_status(child[i], 2000);
			CHECK(status != 0 && WIFSIGNALED(status) && WTERMSIG(status) == SIGKILL,
			      "%s: %s: the tree was not killed (status %#x)", mount, names[i], status);
			CHECK(stat(dir[i], &st) < 0 && errno == ENOENT, "%s: %s: its cgroup is still there",
			      mount, names[i]);
		} else {
			CHECK(ended_status(child[i], 0) == 0, "%s: %s: another tree was killed", mount, names[i]);
			CHECK(frozen(dir[i], v1), "%s: %s: another tree was thawed", mount, names[i]);
		}
	}
	CHECK(tree_end(roots, 7, "batch", 0) == 0, "%s: a second tree_end (nothing left) failed", mount);

	for (i = 0; i < NTREES; i++) {
		if (ended[i])
			continue;
		kill(child[i], SIGKILL);
		put(dir[i], v1 ? "freezer.state" : "cgroup.freeze", v1 ? "THAWED" : "0");
		waitpid(child[i], NULL, 0);
		rmdir(dir[i]);
	}
	CHECK(rmdir(root) == 0, "rmdir %s: %s", root, strerror(errno));
}

static void site_config(void)
{
	char path[] = "/tmp/tree_end_test.yaml.XXXXXX", out[64];
	int fd = mkstemp(path);
	FILE *f = fd >= 0 ? fdopen(fd, "w") : NULL;

	CHECK(f != NULL, "mkstemp: %s", strerror(errno));
	if (f == NULL)
		return;
	fputs("# freezer_root: /commented\n  freezer_root: /indented\nfreezer_root_x: /other\n"
	      "freezer_root: /first\nfreezer_root: \"/quoted dir\"  # why\nproctrack_delegate: proctrack/x # y\n"
	      "empty:\nlong: /aaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaa\n", f);
	fclose(f);
	CHECK(site_config_get(path, "freezer_root", out, sizeof(out)) == 1 && strcmp(out, "/quoted dir") == 0,
	      "freezer_root: the last top-level value, unquoted: got '%s'", out);
	CHECK(site_config_get(path, "proctrack_delegate", out, sizeof(out)) == 1 &&
	      strcmp(out, "proctrack/x") == 0, "a trailing comment is no part of the value: got '%s'", out);
	CHECK(site_config_get(path, "empty", out, sizeof(out)) == 0, "an empty value is no value");
	CHECK(site_config_get(path, "absent", out, sizeof(out)) == 0, "an absent key");
	CHECK(site_config_get(path, "long", out, sizeof(out)) == -1, "a value longer than the buffer");
	CHECK(site_config_get("/nonexistent/slurmckpt.yaml", "freezer_root", out, sizeof(out)) == 0,
	      "no config file: the defaults");
	unlink(path);
}

int main(void)
{
	const char *const none[] = { "/nonexistent/slurmckpt", NULL };
	struct stat st;
	int hierarchies = 0;

	site_config();
	CHECK(tree_end(none, 7, "batch", 0) == 0, "a root that does not exist is no error");
	CHECK(geteuid() == 0, "needs root: it makes cgroups (make test runs as root)");
	if (geteuid() == 0) {
		if (stat("/sys/fs/cgroup/freezer/freezer.state", &st) == 0 ||
		    stat("/sys/fs/cgroup/freezer/cgroup.procs", &st) == 0) {
			one_hierarchy("/sys/fs/cgroup/freezer", true);
			hierarchies++;
		}
		if (stat("/sys/fs/cgroup/unified/cgroup.controllers", &st) == 0) {
			one_hierarchy("/sys/fs/cgroup/unified", false);
			hierarchies++;
		} else if (stat("/sys/fs/cgroup/cgroup.controllers", &st) == 0) {
			one_hierarchy("/sys/fs/cgroup", false);
			hierarchies++;
		}
		CHECK(hierarchies > 0, "no cgroup freezer hierarchy on this host");
	}
	if (failures) {
		fprintf(stderr, "tree_end_test: %d failure(s)\n", failures);
		return (1);
	}
	printf("tree_end_test: %d hierarchies: ok\n", hierarchies);
	return (0);
}
