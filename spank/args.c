/*
 * args.c - plugstack.conf arguments of the slurmckpt SPANK plugin.
 */
#include <stdio.h>
#include <string.h>

#include "args.h"
#include "duration.h"

#define KEY_WRAPPER  0
#define KEY_AGENT    1
#define KEY_INIT     2
#define KEY_INTERVAL 3
#define KEY_COUNT    4

static const char *const key_names[KEY_COUNT] = {
	"wrapper", "agent", "init", "default_interval",
};

void args_defaults(struct plugin_args *args)
{
	memset(args, 0, sizeof(*args));
	snprintf(args->wrapper, sizeof(args->wrapper), "%s", ARGS_DEFAULT_WRAPPER);
	snprintf(args->agent, sizeof(args->agent), "%s", ARGS_DEFAULT_AGENT);
	snprintf(args->init, sizeof(args->init), "%s", ARGS_DEFAULT_INIT);
	args->default_interval = 0;
}

static int find_key(const char *word, size_t keylen)
{
	int i;

	for (i = 0; i < KEY_COUNT; i++)
		if (strlen(key_names[i]) == keylen &&
		    strncmp(word, key_names[i], keylen) == 0)
			return (i);
	return (-1);
}

static int set_path(char *dst, size_t dstlen, const char *key,
		    const char *value, char *err, size_t errlen)
{
	if (value[0] != '/') {
		snprintf(err, errlen, "%s=: '%s' is not an absolute path",
			 key, value);
		return (-1);
	}
	if (strlen(value) >= dstlen) {
		snprintf(err, errlen, "%s=: path too long", key);
		return (-1);
	}
	memcpy(dst, value, strlen(value) + 1);
	return (0);
}

static int set_key(struct plugin_args *args, int key, const char *value,
		   char *err, size_t errlen)
{
	const char *why;

	switch (key) {
	case KEY_WRAPPER:
		return (set_path(args->wrapper, sizeof(args->wrapper),
				 key_names[key], value, err, errlen));
	case KEY_AGENT:
		return (set_path(args->agent, sizeof(args->agent),
				 key_names[key], value, err, errlen));
	case KEY_INIT:
		return (set_path(args->init, sizeof(args->init),
				 key_names[key], value, err, errlen));
	case KEY_INTERVAL:
		if (duration_parse(value, &args->default_interval, &why) < 0) {
			snprintf(err, errlen, "default_interval=: invalid value '%s': %s",
				 value, why);
			return (-1);
		}
		return (0);
	}
	snprintf(err, errlen, "internal error: key %d", key);
	return (-1);
}

int args_parse(struct plugin_args *args, int ac, char **av, char *err,
	       size_t errlen)
{
	int seen[KEY_COUNT] = { 0 };
	const char *eq;
	int i, key;
	int rv = -1;

	for (i = 0; i < ac; i++) {
		eq = strchr(av[i], '=');
		if (eq == NULL || eq == av[i]) {
			snprintf(err, errlen, "expected key=value, got '%s'", av[i]);
			goto fail;
		}
		key = find_key(av[i], (size_t)(eq - av[i]));
		if (key < 0) {
			snprintf(err, errlen,
				 "unknown key '%.*s' (known: wrapper=, agent=, init=, default_interval=)",
				 (int)(eq - av[i]), av[i]);
			goto fail;
		}
		if (seen[key]++) {
			snprintf(err, errlen, "%s= given more than once",
				 key_names[key]);
			goto fail;
		}
		if (set_key(args, key, eq + 1, err, errlen) < 0)
			goto fail;
	}
	rv = 0;
fail:
	return (rv);
}
