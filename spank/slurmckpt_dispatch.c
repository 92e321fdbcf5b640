/*
 * slurmckpt_dispatch.c - every SPANK entry point of slurmckpt, routed by
 * context. What runs where (docs/contracts.md, "SPANK shim behaviour"):
 *   all contexts      init: parse plugstack.conf args, register the option
 *   srun/sbatch/salloc the option callback validates --checkpoint-interval
 *   slurmstepd         user_init notes whether the step is wrapped, for
 *                      proctrack/slurmckpt (slurmckpt_step_wrapped), and
 *                      starts the log relay for its agents (log_relay.c);
 *                      exit stops it
 *   slurmstepd, per task of the batch step and of numbered steps, when the
 *   interval is not off:
 *     task_init_privileged (root)  start the agent on a socketpair
 *     task_init (user)             the wrapper goes in front of argv
 *   slurmstepd, per task of a wrapped step:
 *     task_exit (root)             what is left of the task's trees is
 *                                  killed and thawed (tree_end.c)
 *   job script (slurmd's epilog, root), each time a checkpointed job leaves
 *   a node (end, requeue, preemption; init is not called there):
 *     job_epilog                   `slurmckpt job-end` started detached
 *                                  (job_end.c); never fails the epilog
 */
#include <slurm/spank.h>

#include "slurmckpt.h"

SPANK_PLUGIN(slurmckpt, 1)

struct plugin_args slurmckpt_args;

/* Per task: task_init_privileged and task_init run in the same process. */
static int task_agent_started;

/* In slurmstepd: this step's tasks run under the wrapper (user_init). */
static int step_is_wrapped;

/*
 * For proctrack/slurmckpt, loaded in the same slurmstepd: while this is 1,
 * Slurm's SIGTERM goes to the wrappers alone (proctrack_slurmckpt.c).
 */
__attribute__((visibility("default"))) int slurmckpt_step_wrapped(void)
{
	return (step_is_wrapped);
}

int slurm_spank_init(spank_t sp, int ac, char **av)
{
	char err[256];

	args_defaults(&slurmckpt_args);
	if (args_parse(&slurmckpt_args, ac, av, err, sizeof(err)) < 0) {
		slurm_error("slurmckpt: plugstack.conf: %s", err);
		return (-1);
	}
	return (option_register(sp));
}

/* slurmstepd itself, before the tasks fork (options are readable here, not in init_post_opt). */
int slurm_spank_user_init(spank_t sp, int ac, char **av)
{
	long interval = 0;
	int wrappable, explicit = 0;

	(void)ac;
	(void)av;
	if (spank_context() != S_CTX_REMOTE)
		return (0);
	if ((wrappable = step_wrappable(sp)) < 0)
		return (-1);
	/* An invalid value fails the task in task_init_privileged, with the message. */
	if (wrappable && option_interval(sp, &interval, &explicit) == 0 && interval != 0) {
		step_is_wrapped = 1;
		/* Without the relay the agents still run; their lines stay in their own logs. */
		(void)log_relay_start();
	}
	return (0);
}

int slurm_spank_task_init_privileged(spank_t sp, int ac, char **av)
{
	long interval = 0;
	int wrappable, explicit = 0;

	(void)ac;
	(void)av;
	if (spank_context() != S_CTX_REMOTE)
		return (0);
	if ((wrappable = step_wrappable(sp)) < 0)
		return (-1);
	if (wrappable && option_interval(sp, &interval, &explicit) < 0)
		return (-1);
	if (interval == 0)
		return (task_env_clear(sp));
	if (agent_spawn(sp, interval, explicit) < 0)
		return (-1);
	task_agent_started = 1;
	return (0);
}

int slurm_spank_task_init(spank_t sp, int ac, char **av)
{
	(void)ac;
	(void)av;
	if (spank_context() != S_CTX_REMOTE || !task_agent_started)
		return (0);
	return (task_wrap(sp));
}

/* slurmstepd reaped the task (its wrapper): nothing of its trees outlives it, frozen or not. */
int slurm_spank_task_exit(spank_t sp, int ac, char **av)
{
	(void)ac;
	(void)av;
	if (spank_context() != S_CTX_REMOTE || !step_is_wrapped)
		return (0);
	return (tree_end_task(sp));
}

/*
 * Its images go once Slurm says the job is finished: job-end decides. The job's
 * --checkpoint-interval reaches the epilog as its SPANK_ environment; a job
 * without one (or with off, or a bad value) starts nothing. A failing epilog
 * drains the node, so this always returns 0.
 */
int slurm_spank_job_epilog(spank_t sp, int ac, char **av)
{
	long interval = 0;
	int explicit = 0;
	char err[256];

	if (spank_context() != S_CTX_JOB_SCRIPT)
		return (0);
	/* slurm_spank_init does not run in this context: the plugstack.conf args are read here. */
	args_defaults(&slurmckpt_args);
	if (args_parse(&slurmckpt_args, ac, av, err, sizeof(err)) < 0) {
		slurm_error("slurmckpt: plugstack.conf: %s", err);
		return (0);
	}
	if (option_interval(sp, &interval, &explicit) == 0 && interval != 0)
		(void)job_end_start(sp);
	return (0);
}

int slurm_spank_exit(spank_t sp, int ac, char **av)
{
	(void)sp;
	(void)ac;
	(void)av;
	if (spank_context() == S_CTX_REMOTE)
		log_relay_stop(5);
	return (0);
}
