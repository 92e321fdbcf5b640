/*
 * slurmckpt.h - what the modules of the slurmckpt SPANK plugin share.
 * The plugin holds no policy: it validates the option, starts the root
 * agent and puts the wrapper in front of the task (docs/contracts.md).
 */
#ifndef SLURMCKPT_H
#define SLURMCKPT_H

#include <stdint.h>
#include <sys/types.h>

#include <slurm/spank.h>

#include "args.h"

/* plugstack.conf arguments, parsed in slurm_spank_init (every context). */
extern struct plugin_args slurmckpt_args;

/* option.c: --checkpoint-interval */
int option_register(spank_t sp);
/*
 * Interval in seconds for this step (0 = off); -1 (logged) when invalid.
 * *explicit: 1 when the job gave --checkpoint-interval, 0 when it is the
 * plugstack default_interval= (the agent applies the site policy's default).
 */
int option_interval(spank_t sp, long *seconds, int *explicit);

/* step.c: which step and task this is */
struct step_info {
	uint32_t job_id;
	uint32_t rank;          /* global task id */
	uint32_t restart_count;
	uid_t uid;
	gid_t gid;
	char step[16];          /* "batch" or the step number */
};
/* 1 for the batch step and numbered steps, 0 for the rest, -1 on error. */
int step_wrappable(spank_t sp);
int step_info_get(spank_t sp, struct step_info *si);

/* agent_spawn.c: fork+exec the root agent (task_init_privileged). */
int agent_spawn(spank_t sp, long interval, int explicit);

/* close_from.c: close every fd from lowfd up (before a root exec). */
void close_from(int lowfd);

/* close_from.c: a root command's environment into envp (room for 3): PATH,
 * and SLURM_CONF written into confbuf when conf is not NULL. */
#define ROOT_EXEC_PATH "PATH=/usr/sbin:/usr/bin:/sbin:/bin"
void root_exec_env(char **envp, char *confbuf, size_t size, const char *conf);

/* close_from.c: in the child, once its fds are placed: no supplementary groups,
 * default signals, an empty mask, cwd /, then execve; returns -1 (errno set). */
int root_exec(char *const argv[], char *const envp[]);

/*
 * job_end.c: start `<agent> job-end` detached, for the job of this epilog
 * (job_epilog, root); returns at once. 0, or -1 when it did not start (logged).
 */
int job_end_start(spank_t sp);

/*
 * log_relay.c: in slurmstepd, a pipe whose lines go to slurmd's log
 * (slurm_info/slurm_error); the agents write their event lines to it.
 */
int log_relay_start(void);
int log_relay_fd(void);         /* the write end, -1 when not started */
void log_relay_stop(int wait_s);
void log_relay_emit(char *line);   /* one line, as the relay logs it */

/*
 * tree_end.c: what is left of a task's trees when slurmstepd reaps the task
 * is killed, thawed and its freeze cgroups removed (task_exit). roots: NULL-
 * terminated directories holding <job>.<step>.<rank>.<restart> cgroups.
 * 0, or -1 when a tree had processes left after SIGKILL (logged).
 */
extern const char *const tree_end_default_roots[];
int tree_end(const char *const roots[], uint32_t job, const char *step, uint32_t rank);
/* The task's own: the admin's freezer_root and every default root. */
int tree_end_task(spank_t sp);

/* task_wrap.c: the wrapper goes in front of the task's argv (task_init). */
int task_wrap(spank_t sp);
/* Drop SLURMCKPT_* inherited from an enclosing wrapped step. */
int task_env_clear(spank_t sp);

#endif
