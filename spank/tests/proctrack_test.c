/*
 * proctrack_test.c - proctrack_slurmckpt.so as Slurm's plugin loader of the
 * headers' version sees it: plugin_type, plugin_version (exact match, as
 * Slurm requires of non-SPANK plugins), every proctrack_p_* symbol that
 * Slurm's src/interfaces/proctrack.c of that version looks up, and each call
 * reaching the delegate (proctrack/fake, named by proctrack_test.yaml).
 *   usage: proctrack_test PLUGIN.so FAKE_DELEGATE.so
 */
#include <dlfcn.h>
#include <signal.h>
#include <stdarg.h>
#include <stdbool.h>
#include <stdint.h>
#include <stdio.h>
#include <string.h>
#include <sys/types.h>

#include <slurm/slurm_version.h>

#include "check.h"

/* What slurmstepd gives its plugins (exported from this executable with -rdynamic). */
static void say(const char *fmt, va_list ap)
{
	vfprintf(stderr, fmt, ap);
	fputc('\n', stderr);
}
#define LOGFN(name) void name(const char *fmt, ...) { va_list ap; va_start(ap, fmt); say(fmt, ap); va_end(ap); }
LOGFN(slurm_error)
LOGFN(slurm_info)
LOGFN(slurm_debug)
LOGFN(slurm_verbose)

struct fake_call { char op[64]; uint64_t id; long arg; int inited; };

/* Slurm's proctrack ops table (src/interfaces/proctrack.c), by version. */
static const char *const required[] = {
	"proctrack_p_create", "proctrack_p_add", "proctrack_p_signal", "proctrack_p_destroy",
	"proctrack_p_find", "proctrack_p_has_pid", "proctrack_p_wait",
#if SLURM_VERSION_NUMBER >= SLURM_VERSION_NUM(25, 5, 0)
	"proctrack_p_wait_for_any_task",
#endif
	"proctrack_p_get_pids", "init", "fini",
};

int main(int argc, char **argv)
{
	struct fake_call *last;
	void *plugin, *fake;
	const uint32_t *version;
	const char *type;
	size_t i;

	if (argc != 3) {
		fprintf(stderr, "usage: %s PLUGIN.so FAKE_DELEGATE.so\n", argv[0]);
		return (2);
	}
	/* RTLD_NOW: a symbol neither slurmstepd nor libc provides fails here, not in a job. */
	if ((plugin = dlopen(argv[1], RTLD_NOW | RTLD_LOCAL)) == NULL) {
		fprintf(stderr, "FAIL dlopen %s: %s\n", argv[1], dlerror());
		return (1);
	}
	type = dlsym(plugin, "plugin_type");
	version = dlsym(plugin, "plugin_version");
	CHECK(type && strcmp(type, "proctrack/slurmckpt") == 0, "plugin_type '%s'", type ? type : "(none)");
	CHECK(version && *version == SLURM_VERSION_NUMBER, "plugin_version %#x, headers %#x",
	      version ? *version : 0, SLURM_VERSION_NUMBER);
	for (i = 0; i < sizeof(required) / sizeof(required[0]); i++)
		CHECK(dlsym(plugin, required[i]) != NULL, "Slurm %#x looks up %s: not exported",
		      SLURM_VERSION_NUMBER, required[i]);
	if (failures)
		goto out;

	CHECK(((int (*)(void))dlsym(plugin, "init"))() == 0, "init() failed");
	/* The plugin opened the same file: dlopen hands back that copy. */
	if ((fake = dlopen(argv[2], RTLD_NOW | RTLD_NOLOAD)) == NULL ||
	    (last = dlsym(fake, "fake_last")) == NULL) {
		fprintf(stderr, "FAIL the delegate %s was not loaded by init()\n", argv[2]);
		return (1);
	}
	CHECK(last->inited, "delegate's init() not called");
#define CALL(type, name, ...) ((type)dlsym(plugin, "proctrack_p_" name))(__VA_ARGS__)
#define SEEN(name, want_id, want_arg)                                                    \
	CHECK(strcmp(last->op, name) == 0 && last->id == (want_id) && last->arg == (want_arg), \
	      "%s: delegate saw %s(%llu, %ld)", name, last->op, (unsigned long long)last->id, last->arg)
	CALL(int (*)(void *), "create", (void *)0x10);            SEEN("create", 0x10, 0);
	CALL(int (*)(void *, pid_t), "add", (void *)0x10, 4242);  SEEN("add", 0x10, 4242);
	/* The step is not wrapped (no slurmckpt SPANK plugin loaded): SIGTERM is the delegate's. */
	CALL(int (*)(uint64_t, int), "signal", 5, SIGTERM);       SEEN("signal", 5, SIGTERM);
	CALL(int (*)(uint64_t), "destroy", 6);                    SEEN("destroy", 6, 0);
	CHECK(CALL(uint64_t (*)(pid_t), "find", 99) == 77, "find: delegate's answer lost");
	SEEN("find", 0, 99);
	CALL(bool (*)(uint64_t, pid_t), "has_pid", 7, 98);        SEEN("has_pid", 7, 98);
	CALL(int (*)(uint64_t), "wait", 8);                       SEEN("wait", 8, 0);
#if SLURM_VERSION_NUMBER >= SLURM_VERSION_NUM(25, 5, 0)
	CALL(int (*)(void *, void **, bool), "wait_for_any_task", (void *)0x11, NULL, true);
	SEEN("wait_for_any_task", 0x11, 1);
#endif
	{
		int n = -1;

		CALL(int (*)(uint64_t, pid_t **, int *), "get_pids", 9, NULL, &n);
		SEEN("get_pids", 9, 0);
		CHECK(n == 0, "get_pids: npids %d", n);
	}
	CHECK(((int (*)(void))dlsym(plugin, "fini"))() == 0, "fini() failed");
	CHECK(!last->inited, "delegate's fini() not called");
out:
	if (failures) {
		fprintf(stderr, "proctrack_test: %d failure(s)\n", failures);
		return (1);
	}
	printf("proctrack_test: Slurm %#x: ok\n", SLURM_VERSION_NUMBER);
	return (0);
}
