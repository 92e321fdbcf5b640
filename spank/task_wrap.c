/*
 * task_wrap.c - put the wrapper in front of the task (slurm_spank_task_init).
 *
 * Runs as the user in the task's process. slurmstepd still runs the
 * TaskProlog, sets TMPDIR and limits, then execs argv: argv[0] becomes the
 * wrapper, argv[1:] stay; the wrapper gets the original argv[0] from
 * SLURMCKPT_TASK_ARGV0 and does the PATH lookup itself.
 */
#include <errno.h>
#include <stdlib.h>
#include <string.h>

#include "slurmckpt.h"

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
	rc = spank_setenv(sp, "SLURMCKPT_TASK_ARGV0", argv[0], 1);
	if (rc != ESPANK_SUCCESS) {
		slurm_error("slurmckpt: task_init: setenv SLURMCKPT_TASK_ARGV0: %s",
			    spank_strerror(rc));
		goto fail;
	}
	/* The old argv[0] belongs to slurmstepd: leave it, the task execs. */
	argv[0] = wrapper;
	wrapper = NULL;
	rv = 0;
fail:
	free(wrapper);
	return (rv);
}

/*
 * A step that is not wrapped (off, extern, interactive) may still inherit
 * SLURMCKPT_* from a wrapped batch step through srun's environment: drop
 * them so nothing mistakes them for its own. No-op for jobs without them.
 */
int task_env_clear(spank_t sp)
{
	static const char *const names[] = {
		"SLURMCKPT_AGENT_FD", "SLURMCKPT_INTERVAL", "SLURMCKPT_TASK_ARGV0",
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
