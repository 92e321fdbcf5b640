/*
 * proctrack_slurmckpt.c - ProctrackType=proctrack/slurmckpt (docs/contracts.md).
 *
 * Delegates every call to the site's real proctrack plugin, named by
 * proctrack_delegate in slurmckpt.yaml (default proctrack/cgroup). One thing
 * changes, and only in a step whose tasks run under the slurmckpt wrapper:
 * a signal other than SIGKILL, SIGSTOP, SIGTSTP and SIGCONT goes to the task
 * processes (the wrappers) alone. Slurm's kill sequence for requeue,
 * preemption, time limit and scancel (SIGCONT, SIGTERM, KillWait, SIGKILL)
 * thus reaches the workload only through the wrapper, which takes the final
 * capture first; signals a user sends on purpose are forwarded by the
 * wrapper. proctrack/cgroup already signals only slurmstepd's children;
 * linuxproc and pgid signal every process of the step, so a program with its
 * own SIGTERM handler (GROMACS, MPI launchers) would act on it inside the
 * capture. SIGKILL, suspend (SIGSTOP/SIGTSTP) and SIGCONT go to the delegate
 * unchanged: Slurm's suspend, resume and final kill stay Slurm's. The trees'
 * own freeze cgroups, which no delegate thaws (a process the v1 freezer holds
 * does not die of SIGKILL), are emptied by the SPANK plugin as slurmstepd
 * reaps each wrapper (tree_end.c), whatever the ProctrackType.
 */
#include <dlfcn.h>
#include <errno.h>
#include <link.h>
#include <signal.h>
#include <stdbool.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <slurm/slurm.h>
#include <slurm/slurm_errno.h>
#include <slurm/spank.h>        /* slurm_error, slurm_info, slurm_debug */

#include "site_config.h"

#ifndef SLURM_PLUGIN_DIR
#define SLURM_PLUGIN_DIR "/usr/lib/x86_64-linux-gnu/slurm-wlm"
#endif
#define DEFAULT_DELEGATE "proctrack/cgroup"
#define SPANK_SO "slurmckpt_spank.so"

const char plugin_name[] = "slurmckpt: delegating process tracking";
const char plugin_type[] = "proctrack/slurmckpt";
const uint32_t plugin_version = SLURM_VERSION_NUMBER;

/* Slurm's parsed slurm.conf (libslurmfull): PluginDir may list several dirs. */
extern slurm_conf_t slurm_conf __attribute__((weak));

/* Slurm 25.05 added proctrack_p_wait_for_any_task to the ops its loader requires. */
#if SLURM_VERSION_NUMBER >= SLURM_VERSION_NUM(25, 5, 0)
#define HAVE_WAIT_FOR_ANY_TASK 1
#endif

/* The delegate's entry points, in the order of Slurm's proctrack ops. */
enum { OP_CREATE, OP_ADD, OP_SIGNAL, OP_DESTROY, OP_FIND, OP_HAS_PID, OP_WAIT,
#ifdef HAVE_WAIT_FOR_ANY_TASK
       OP_WAIT_FOR_ANY_TASK,
#endif
       OP_GET_PIDS, OP_COUNT };
static const char *const op_names[OP_COUNT] = {
	"proctrack_p_create", "proctrack_p_add", "proctrack_p_signal",
	"proctrack_p_destroy", "proctrack_p_find", "proctrack_p_has_pid",
	"proctrack_p_wait",
#ifdef HAVE_WAIT_FOR_ANY_TASK
	"proctrack_p_wait_for_any_task",
#endif
	"proctrack_p_get_pids",
};
static void *delegate;
static void *ops[OP_COUNT];
static char delegate_type[64];

/* The step's task processes (the wrappers), with a pidfd against pid reuse. */
struct task { pid_t pid; int pidfd; };
static struct task *tasks;
static size_t ntasks;

/* proctrack_delegate from the admin's config; DEFAULT_DELEGATE if absent. */
static int read_delegate(char *out, size_t len)
{
	snprintf(out, len, "%s", DEFAULT_DELEGATE);
	if (site_config_get(SLURMCKPT_CONFIG, "proctrack_delegate", out, len) < 0) {
		slurm_error("proctrack/slurmckpt: %s: proctrack_delegate: %m", SLURMCKPT_CONFIG);
		return (-1);
	}
	if (strncmp(out, "proctrack/", 10) != 0 || out[10] == '\0' ||
	    strspn(out + 10, "abcdefghijklmnopqrstuvwxyz0123456789_") != strlen(out + 10) ||
	    strcmp(out, plugin_type) == 0) {
		slurm_error("proctrack/slurmckpt: %s: proctrack_delegate '%s' is not another "
			    "proctrack plugin (e.g. proctrack/cgroup)", SLURMCKPT_CONFIG, out);
		return (-1);
	}
	return (0);
}

/* dlopen proctrack_<name>.so from the first PluginDir entry that has it. */
static void *open_delegate(const char *type)
{
	const char *dirs = (&slurm_conf && slurm_conf.plugindir) ? slurm_conf.plugindir
								 : SLURM_PLUGIN_DIR;
	char path[4096];
	const char *d = dirs;

	while (*d) {
		size_t n = strcspn(d, ":");
		void *h;

		snprintf(path, sizeof(path), "%.*s/proctrack_%s.so", (int)n, d,
			 type + strlen("proctrack/"));
		if (access(path, R_OK) == 0) {
			if ((h = dlopen(path, RTLD_LAZY | RTLD_LOCAL)) == NULL)
				slurm_error("proctrack/slurmckpt: %s: %s", path, dlerror());
			return (h);
		}
		d += n + (d[n] == ':');
	}
	slurm_error("proctrack/slurmckpt: no proctrack_%s.so in PluginDir %s",
		    type + strlen("proctrack/"), dirs);
	return (NULL);
}

extern int init(void)
{
	int (*delegate_init)(void);
	int i;

	if (read_delegate(delegate_type, sizeof(delegate_type)) < 0)
		return (SLURM_ERROR);
	if ((delegate = open_delegate(delegate_type)) == NULL)
		return (SLURM_ERROR);
	for (i = 0; i < OP_COUNT; i++) {
		if ((ops[i] = dlsym(delegate, op_names[i])) == NULL) {
			slurm_error("proctrack/slurmckpt: %s lacks %s", delegate_type, op_names[i]);
			return (SLURM_ERROR);
		}
	}
	delegate_init = (int (*)(void))dlsym(delegate, "init");
	if (delegate_init && delegate_init() != SLURM_SUCCESS) {
		slurm_error("proctrack/slurmckpt: %s failed to initialize", delegate_type);
		return (SLURM_ERROR);
	}
	slurm_debug("proctrack/slurmckpt: delegating to %s", delegate_type);
	return (SLURM_SUCCESS);
}

extern int fini(void)
{
	int (*delegate_fini)(void) = delegate ? (int (*)(void))dlsym(delegate, "fini") : NULL;
	size_t i;

	for (i = 0; i < ntasks; i++)
		if (tasks[i].pidfd >= 0)
			close(tasks[i].pidfd);
	free(tasks);
	tasks = NULL;
	ntasks = 0;
	return (delegate_fini ? delegate_fini() : SLURM_SUCCESS);
}

/* Whether the slurmckpt SPANK plugin, loaded in this slurmstepd, wraps this step. */
static int find_spank(struct dl_phdr_info *info, size_t size, void *data)
{
	const char *base = strrchr(info->dlpi_name, '/');

	(void)size;
	if (base && strcmp(base + 1, SPANK_SO) == 0) {
		*(const char **)data = info->dlpi_name;
		return (1);
	}
	return (0);
}

static bool step_wrapped(void)
{
	static int (*wrapped)(void);
	static bool looked;

	if (!looked) {
		const char *name = NULL;
		void *h;

		looked = true;
		if (dl_iterate_phdr(find_spank, &name) && name &&
		    (h = dlopen(name, RTLD_LAZY | RTLD_NOLOAD)) != NULL)
			wrapped = (int (*)(void))dlsym(h, "slurmckpt_step_wrapped");
	}
	return (wrapped && wrapped());
}

static void signal_tasks(int sig)
{
	size_t i;

	for (i = 0; i < ntasks; i++) {
		if (tasks[i].pidfd >= 0) {
			if (syscall(SYS_pidfd_send_signal, tasks[i].pidfd, sig, NULL, 0) < 0 &&
			    errno != ESRCH)
				slurm_error("proctrack/slurmckpt: signal %d to task %d: %m", sig,
					    (int)tasks[i].pid);
		}
		/* No pidfd (kernel < 5.3): the pid may be reused once reaped; skip it. */
	}
}

extern int proctrack_p_create(void *step)
{
	return (((int (*)(void *))ops[OP_CREATE])(step));
}

extern int proctrack_p_add(void *step, pid_t pid)
{
	struct task *grown = realloc(tasks, (ntasks + 1) * sizeof(*tasks));

	if (grown) {
		tasks = grown;
		tasks[ntasks].pid = pid;
		tasks[ntasks].pidfd = (int)syscall(SYS_pidfd_open, pid, 0);
		ntasks++;
	}
	return (((int (*)(void *, pid_t))ops[OP_ADD])(step, pid));
}

extern int proctrack_p_signal(uint64_t id, int sig)
{
	if (sig != 0 && sig != SIGKILL && sig != SIGSTOP && sig != SIGTSTP && sig != SIGCONT &&
	    ntasks > 0 && step_wrapped()) {
		slurm_debug("proctrack/slurmckpt: signal %d to the wrappers only", sig);
		signal_tasks(sig);
		return (SLURM_SUCCESS);
	}
	return (((int (*)(uint64_t, int))ops[OP_SIGNAL])(id, sig));
}

extern int proctrack_p_destroy(uint64_t id)
{
	return (((int (*)(uint64_t))ops[OP_DESTROY])(id));
}

extern uint64_t proctrack_p_find(pid_t pid)
{
	return (((uint64_t (*)(pid_t))ops[OP_FIND])(pid));
}

extern bool proctrack_p_has_pid(uint64_t id, pid_t pid)
{
	return (((bool (*)(uint64_t, pid_t))ops[OP_HAS_PID])(id, pid));
}

extern int proctrack_p_wait(uint64_t id)
{
	return (((int (*)(uint64_t))ops[OP_WAIT])(id));
}

#ifdef HAVE_WAIT_FOR_ANY_TASK
/* Slurm calls it only for steps that wait for all their children; linuxproc and pgid answer "not supported". */
extern int proctrack_p_wait_for_any_task(void *step, void **ended_task, bool block)
{
	return (((int (*)(void *, void **, bool))ops[OP_WAIT_FOR_ANY_TASK])(step, ended_task, block));
}
#endif

extern int proctrack_p_get_pids(uint64_t id, pid_t **pids, int *npids)
{
	return (((int (*)(uint64_t, pid_t **, int *))ops[OP_GET_PIDS])(id, pids, npids));
}
