/*
 * site_config.h - single keys of the admin's slurmckpt.yaml, read by the C
 * plugins (the Python side parses the whole file; docs/configuration.md).
 */
#ifndef SLURMCKPT_SITE_CONFIG_H
#define SLURMCKPT_SITE_CONFIG_H

#include <stddef.h>

#ifndef SLURMCKPT_CONFIG
#define SLURMCKPT_CONFIG "/etc/slurmckpt/slurmckpt.yaml"
#endif

/*
 * The value of the top-level "key: value" line of file (the last one when
 * repeated), without quotes or a trailing comment, into out. 1: found;
 * 0: no such key or no file; -1: unreadable file or a value longer than len
 * (errno set).
 */
int site_config_get(const char *file, const char *key, char *out, size_t len);

#endif
