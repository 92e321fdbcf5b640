/*
 * option.c - the --checkpoint-interval option.
 *
 * Registered in every context from slurm_spank_init (sbatch/salloc only see
 * options registered that way). The callback validates: in srun, sbatch and
 * salloc a bad value fails the command. Slurm calls the callback more than
 * once (environment, #SBATCH lines, command line): the last value wins.
 */
#include <stdio.h>

#include "duration.h"
#include "slurmckpt.h"

#define INVALID_FMT "slurmckpt: invalid --checkpoint-interval value '%s': %s"

static struct {
	int invalid;            /* last value the callback saw was bad */
	char value[128];        /* that value, for the remote error message */
	const char *why;
} cb_state;

static int interval_cb(int val, const char *optarg, int remote)
{
	long seconds;
	const char *why;

	(void)val;
	(void)remote;
	if (optarg == NULL)
		optarg = "";
	if (duration_parse(optarg, &seconds, &why) < 0) {
		cb_state.invalid = 1;
		cb_state.why = why;
		snprintf(cb_state.value, sizeof(cb_state.value), "%s", optarg);
		slurm_error(INVALID_FMT, optarg, why);
		return (-1);
	}
	cb_state.invalid = 0;
	return (0);
}

static struct spank_option interval_option = {
	.name = "checkpoint-interval",
	.arginfo = "duration",
	.usage = "[slurmckpt] Checkpoint the job's processes transparently every "
		 "<duration> and when it is preempted or reaches its time limit; "
		 "requeued jobs resume from the last checkpoint. <duration>: N "
		 "(minutes), 90s, 30m, 1h30m, MM:SS, HH:MM:SS; minimum 10s; "
		 "auto: chosen from the measured cost of a capture and the "
		 "partition's interruption rate; off or 0 disables.",
	.has_arg = 1,
	.val = 0,
	.cb = interval_cb,
};

int option_register(spank_t sp)
{
	spank_err_t rc;

	rc = spank_option_register(sp, &interval_option);
	if (rc != ESPANK_SUCCESS) {
		slurm_error("slurmckpt: init: spank_option_register: %s",
			    spank_strerror(rc));
		return (-1);
	}
	return (0);
}

int option_interval(spank_t sp, long *seconds, int *explicit)
{
	char *value = NULL;
	const char *why;
	spank_err_t rc;

	/*
	 * In slurmstepd a value that failed the callback is only logged by
	 * Slurm and the option looks unset: the user asked for checkpoints,
	 * so refuse to run the task instead of silently running without.
	 */
	if (cb_state.invalid) {
		slurm_error(INVALID_FMT, cb_state.value, cb_state.why);
		return (-1);
	}
	rc = spank_option_getopt(sp, &interval_option, &value);
	*explicit = (rc == ESPANK_SUCCESS && value != NULL);
	if (!*explicit) {
		*seconds = slurmckpt_args.default_interval;
		return (0);
	}
	if (duration_parse(value, seconds, &why) < 0) {
		slurm_error(INVALID_FMT, value, why);
		return (-1);
	}
	return (0);
}
