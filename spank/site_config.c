/*
 * site_config.c - single keys of the admin's slurmckpt.yaml (site_config.h).
 * Only plain top-level scalars: the keys the C plugins read are paths and
 * plugin names, which need no more of YAML.
 */
#include <errno.h>
#include <stdio.h>
#include <string.h>

#include "site_config.h"

int site_config_get(const char *file, const char *key, char *out, size_t len)
{
	size_t keylen = strlen(key);
	char line[4096];
	int found = 0;
	FILE *f;

	if ((f = fopen(file, "re")) == NULL)
		return (errno == ENOENT ? 0 : -1);
	while (fgets(line, sizeof(line), f)) {
		char *v = line + keylen + 1;
		size_t n;

		if (strncmp(line, key, keylen) != 0 || line[keylen] != ':')
			continue;
		v += strspn(v, " \t");
		if (*v == '"' || *v == '\'') {
			char *end = strchr(v + 1, *v);

			n = end ? (size_t)(end - v - 1) : 0;
			v++;
		} else {
			n = strcspn(v, " \t#\r\n");
		}
		if (n == 0)
			continue;
		if (n >= len) {
			fclose(f);
			errno = ENAMETOOLONG;
			return (-1);
		}
		memcpy(out, v, n);
		out[n] = '\0';
		found = 1;
	}
	if (ferror(f)) {
		fclose(f);
		errno = EIO;
		return (-1);
	}
	fclose(f);
	return (found);
}
