/*
 * task_wrap.c - put the wrapper in front of the task (slurm_spank_task_init).
 *
 * Runs as the user in the task's process. slurmstepd still runs the
 * TaskProlog, sets TMPDIR and limits, then execs argv. Two launch forms
 * (docs/contracts.md, "SPANK shim behaviour"):
 *   Slurm >= 23.02.5: spank_prepend_task_argv puts the wrapper in front of
 *     the untouched argv; SLURMCKPT_TASK_ARGV=prepended tells the wrapper.
 *   older Slurm: argv[0] becomes the wrapper, argv[1:] stay; the wrapper
 *     gets the original argv[0] from SLURMCKPT_TASK_ARGV0.
 * Either way the wrapper does the PATH lookup of the task's argv[0] itself.
 */
#include <errno.h>
#include <stdlib.h>
#include <string.h>

#include "slurmckpt.h"

/* spank.h declares it from 23.02.5 on (docs/slurm-versions.md). */
#if SLURM_VERSION_NUMBER >= SLURM_VERSION_NUM(23, 2, 5)
#define HAVE_PREPEND_TASK_ARGV 1
#endif

static int set_form(spank_t sp, const char *set, const char *value, const char *unset)
{
	spank_err_t rc;

	/* Only the one this shim sets may reach the wrapper: a stale other one would pick the wrong form. */
	if ((rc = spank_unsetenv(sp, unset)) != ESPANK_SUCCESS) {
		slurm_error("slurmckpt: task_init: unsetenv %s: %s", unset, spank_strerror(rc));
		return (-1);
	}
	if ((rc = spank_setenv(sp, set, value, 1)) != ESPANK_SUCCESS) {
		slurm_error("slurmckpt: task_init: setenv %s: %s", set, spank_strerror(rc));
		return (-1);
	}
	return (0);
}

#ifdef HAVE_PREPEND_TASK_ARGV
int task_wrap(spank_t sp)
{
	const char *prefix[] = { slurmckpt_args.wrapper, NULL };
	spank_err_t rc;

	if (set_form(sp, "SLURMCKPT_TASK_ARGV", "prepended", "SLURMCKPT_TASK_ARGV0") < 0)
		return (-1);
	/* Slurm copies the prefix and keeps the task's own argv behind it. */
	rc = spank_prepend_task_argv(sp, 1, prefix);
	if (rc != ESPANK_SUCCESS) {
		slurm_error("slurmckpt: task_init: spank_prepend_task_argv: %s",
			    spank_strerror(rc));
		return (-1);
	}
	return (0);
}
#else
int task_wrap(spank_t sp)
{
	char **argv = NULL;
	char *wrapper = NULL;
	spank_err_t rc;
	int argc = 0;
	int rv = -1;

	rc = spank_get_item(sp, S_JOB_ARGV, &argc, &argv);
	if (rc != ESPANK_SUCCESS) {
		slurm_error("slurmckpt: task_init: S_JOB_ARGV: %s",
			    spank_strerror(rc));
		goto fail;
	}
	if (argc < 1 || argv == NULL || argv[0] == NULL) {
		slurm_error("slurmckpt: task_init: task has no argv[0]");
		goto fail;
	}
	if ((wrapper = strdup(slurmckpt_args.wrapper)) == NULL) {
		slurm_error("slurmckpt: task_init: strdup: %s", strerror(errno));
		goto fail;
	}
	if (set_form(sp, "SLURMCKPT_TASK_ARGV0", argv[0], "SLURMCKPT_TASK_ARGV") < 0)
		goto fail;
	/* The old argv[0] belongs to slurmstepd: leave it, the task execs. */
	argv[0] = wrapper;
	wrapper = NULL;
	rv = 0;
fail:
	free(wrapper);
	return (rv);
}
#endif

/*
 * A step that is not wrapped (off, extern, interactive) may still inherit
 * SLURMCKPT_* from a wrapped batch step through srun's environment: drop
 * them so nothing mistakes them for its own. No-op for jobs without them.
 */
int task_env_clear(spank_t sp)
{
	static const char *const names[] = {
		"SLURMCKPT_AGENT_FD", "SLURMCKPT_INTERVAL", "SLURMCKPT_TASK_ARGV0",
		"SLURMCKPT_TASK_ARGV",
	};
	spank_err_t rc;
	size_t i;

	for (i = 0; i < sizeof(names) / sizeof(names[0]); i++) {
		rc = spank_unsetenv(sp, names[i]);
		if (rc != ESPANK_SUCCESS) {
			slurm_error("slurmckpt: task_init_privileged: unsetenv %s: %s",
				    names[i], spank_strerror(rc));
			return (-1);
		}
	}
	return (0);
}
