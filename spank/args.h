/*
 * args.h - plugstack.conf arguments of the slurmckpt SPANK plugin.
 */
#ifndef SLURMCKPT_ARGS_H
#define SLURMCKPT_ARGS_H

#include <limits.h>
#include <stddef.h>

/* Defaults of make install; the Debian package builds with its own (scripts/build-deb.sh). */
#ifndef ARGS_DEFAULT_WRAPPER
#define ARGS_DEFAULT_WRAPPER "/opt/slurmckpt/venv/bin/slurmckpt-wrap"
#endif
#ifndef ARGS_DEFAULT_AGENT
#define ARGS_DEFAULT_AGENT   "/opt/slurmckpt/venv/bin/slurmckpt"
#endif
#ifndef ARGS_DEFAULT_INIT
#define ARGS_DEFAULT_INIT    "/usr/local/libexec/slurmckpt/slurmckpt-init"
#endif

struct plugin_args {
	char wrapper[PATH_MAX];   /* wrapper=: exec'd as the task's argv[0] */
	char agent[PATH_MAX];     /* agent=: root agent started per task */
	char init[PATH_MAX];      /* init=: PID-namespace init, given to the agent */
	long default_interval;    /* default_interval=: seconds, 0 = off */
};

void args_defaults(struct plugin_args *args);

/*
 * Parse plugstack.conf "key=value" words into args (call args_defaults()
 * first). Unknown, repeated or malformed keys are errors: returns -1 with a
 * message in err, 0 on success.
 */
int args_parse(struct plugin_args *args, int ac, char **av, char *err,
	       size_t errlen);

#endif
