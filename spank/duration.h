/*
 * duration.h - parse --checkpoint-interval values into seconds.
 */
#ifndef SLURMCKPT_DURATION_H
#define SLURMCKPT_DURATION_H

#define DURATION_MIN_SECONDS 10L
#define DURATION_MAX_SECONDS (365L * 24 * 3600)
/* auto: the job's coordinator chooses the interval (the agent gets "auto") */
#define DURATION_AUTO (-1L)

/*
 * Accepted forms (docs/contracts.md, "SPANK shim behaviour"):
 *   off | 0          disabled (any value that amounts to zero, e.g. 0m)
 *   auto             DURATION_AUTO (any case)
 *   N                N minutes
 *   [Nd][Nh][Nm][Ns] at least one unit, each at most once, in that order
 *                    (90s, 1h30m, 2m30s, 1d)
 *   M:S | H:M:S      clock form (MM:SS, HH:MM:SS); later fields below 60
 * Returns 0 with *seconds set (0 = disabled, DURATION_AUTO, otherwise between
 * DURATION_MIN_SECONDS and DURATION_MAX_SECONDS), or -1 with *err set to a
 * static description of what is wrong.
 */
int duration_parse(const char *s, long *seconds, const char **err);

#endif
