/*
 * task_wrap_test.c - task_wrap() against a fake SPANK: the launch form the
 * headers it is built with select (docs/contracts.md, "SPANK shim behaviour").
 * Slurm >= 23.02.5: the wrapper is prepended, argv untouched,
 * SLURMCKPT_TASK_ARGV=prepended; older: argv[0] replaced, SLURMCKPT_TASK_ARGV0.
 */
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "../slurmckpt.h"

#include "check.h"

struct plugin_args slurmckpt_args;

/* The fake task: its argv and job environment, as slurmstepd holds them. */
static char *task_argv[8];
static int task_argc;
static char env_names[8][64], env_values[8][256];
static int nenv, prepend_calls;

static int env_find(const char *name)
{
	int i;

	for (i = 0; i < nenv; i++)
		if (strcmp(env_names[i], name) == 0)
			return (i);
	return (-1);
}

static const char *env_get(const char *name)
{
	int i = env_find(name);

	return (i < 0 ? NULL : env_values[i]);
}

spank_err_t spank_setenv(spank_t sp, const char *var, const char *val, int overwrite)
{
	int i = env_find(var);

	(void)sp;
	(void)overwrite;
	if (i < 0)
		i = nenv++;
	snprintf(env_names[i], sizeof(env_names[i]), "%s", var);
	snprintf(env_values[i], sizeof(env_values[i]), "%s", val);
	return (ESPANK_SUCCESS);
}

spank_err_t spank_unsetenv(spank_t sp, const char *var)
{
	int i = env_find(var);

	(void)sp;
	if (i >= 0) {
		nenv--;
		memmove(env_names[i], env_names[nenv], sizeof(env_names[i]));
		memmove(env_values[i], env_values[nenv], sizeof(env_values[i]));
	}
	return (ESPANK_SUCCESS);
}

spank_err_t spank_get_item(spank_t sp, spank_item_t item, ...)
{
	va_list ap;

	(void)sp;
	if (item != S_JOB_ARGV)
		return (ESPANK_BAD_ARG);
	va_start(ap, item);
	*va_arg(ap, int *) = task_argc;
	*va_arg(ap, char ***) = task_argv;
	va_end(ap);
	return (ESPANK_SUCCESS);
}

/* As Slurm's: a copy of the prefix, then the task's own argv. */
spank_err_t spank_prepend_task_argv(spank_t sp, int argc, const char *argv[])
{
	int i;

	(void)sp;
	prepend_calls++;
	if (argv == NULL || task_argc + argc >= (int)(sizeof(task_argv) / sizeof(task_argv[0])))
		return (ESPANK_BAD_ARG);
	memmove(task_argv + argc, task_argv, (task_argc + 1) * sizeof(char *));
	for (i = 0; i < argc; i++)
		task_argv[i] = strdup(argv[i]);
	task_argc += argc;
	return (ESPANK_SUCCESS);
}

const char *spank_strerror(spank_err_t err)
{
	(void)err;
	return ("fake error");
}

void slurm_error(const char *fmt, ...)
{
	va_list ap;

	va_start(ap, fmt);
	vfprintf(stderr, fmt, ap);
	va_end(ap);
	fputc('\n', stderr);
}

int main(void)
{
	snprintf(slurmckpt_args.wrapper, sizeof(slurmckpt_args.wrapper), "/opt/w/slurmckpt-wrap");
	task_argv[0] = "hostname";
	task_argv[1] = "-s";
	task_argv[2] = NULL;
	task_argc = 2;
	/* A stale variable of the other form, e.g. from the user's environment. */
	spank_setenv(NULL, "SLURMCKPT_TASK_ARGV0", "stale", 1);
	spank_setenv(NULL, "SLURMCKPT_TASK_ARGV", "stale", 1);

	CHECK(task_wrap(NULL) == 0, "task_wrap failed");
#if SLURM_VERSION_NUMBER >= SLURM_VERSION_NUM(23, 2, 5)
	printf("Slurm %#x: prepend form\n", SLURM_VERSION_NUMBER);
	CHECK(prepend_calls == 1, "spank_prepend_task_argv called %d times", prepend_calls);
	CHECK(task_argc == 3, "argc %d, want 3", task_argc);
	CHECK(strcmp(task_argv[0], "/opt/w/slurmckpt-wrap") == 0, "argv[0] '%s'", task_argv[0]);
	CHECK(strcmp(task_argv[1], "hostname") == 0 && strcmp(task_argv[2], "-s") == 0 &&
	      task_argv[3] == NULL, "task argv not kept behind the wrapper");
	CHECK(env_get("SLURMCKPT_TASK_ARGV") && strcmp(env_get("SLURMCKPT_TASK_ARGV"), "prepended") == 0,
	      "SLURMCKPT_TASK_ARGV '%s'", env_get("SLURMCKPT_TASK_ARGV") ? env_get("SLURMCKPT_TASK_ARGV") : "(unset)");
	CHECK(env_get("SLURMCKPT_TASK_ARGV0") == NULL, "SLURMCKPT_TASK_ARGV0 left set");
#else
	printf("Slurm %#x: argv[0] form\n", SLURM_VERSION_NUMBER);
	CHECK(prepend_calls == 0, "prepend used on an old Slurm");
	CHECK(task_argc == 2 && strcmp(task_argv[0], "/opt/w/slurmckpt-wrap") == 0 &&
	      strcmp(task_argv[1], "-s") == 0, "argv[0] '%s' argc %d", task_argv[0], task_argc);
	CHECK(env_get("SLURMCKPT_TASK_ARGV0") && strcmp(env_get("SLURMCKPT_TASK_ARGV0"), "hostname") == 0,
	      "SLURMCKPT_TASK_ARGV0 '%s'", env_get("SLURMCKPT_TASK_ARGV0") ? env_get("SLURMCKPT_TASK_ARGV0") : "(unset)");
	CHECK(env_get("SLURMCKPT_TASK_ARGV") == NULL, "SLURMCKPT_TASK_ARGV left set");
#endif
	if (failures) {
		fprintf(stderr, "task_wrap_test: %d failure(s)\n", failures);
		return (1);
	}
	printf("task_wrap_test: ok\n");
	return (0);
}
