/*
 * duration.c - parse --checkpoint-interval values into seconds.
 */
#include <stddef.h>
#include <string.h>
#include <strings.h>

#include "duration.h"

static const char ERR_FORMAT[] =
	"expected off, auto, 0, N (minutes), units like 90s, 30m, 1h30m, 2d, or MM:SS / HH:MM:SS";
static const char ERR_ORDER[] =
	"each unit may appear once, in the order d, h, m, s";
static const char ERR_CLOCK[] =
	"minutes and seconds after a ':' must be below 60";
static const char ERR_LARGE[] = "too large (maximum 365d)";
static const char ERR_SMALL[] =
	"below the minimum of 10 seconds (use off to disable)";

/*
 * Read a run of decimal digits at *p (at least one). Values above the
 * maximum are clamped so the caller reports "too large", never overflows.
 */
static int read_number(const char **p, long *out)
{
	long v = 0;
	const char *q = *p;

	if (*q < '0' || *q > '9')
		return (-1);
	for (; *q >= '0' && *q <= '9'; q++) {
		v = v * 10 + (*q - '0');
		if (v > DURATION_MAX_SECONDS)
			v = DURATION_MAX_SECONDS + 1;
	}
	*p = q;
	*out = v;
	return (0);
}

static long clamp_add(long total, long n, long unit)
{
	if (n > DURATION_MAX_SECONDS / unit)
		return (DURATION_MAX_SECONDS + 1);
	total += n * unit;
	return (total > DURATION_MAX_SECONDS ? DURATION_MAX_SECONDS + 1 : total);
}

/* "M:S" or "H:M:S"; s contains at least one ':'. */
static int parse_clock(const char *s, long *total, const char **err)
{
	long fields[3];
	int n = 0;

	for (;;) {
		if (n == 3 || read_number(&s, &fields[n]) < 0) {
			*err = ERR_FORMAT;
			return (-1);
		}
		if (n > 0 && fields[n] >= 60) {
			*err = ERR_CLOCK;
			return (-1);
		}
		n++;
		if (*s == '\0')
			break;
		if (*s++ != ':') {
			*err = ERR_FORMAT;
			return (-1);
		}
	}
	if (n == 2)
		*total = clamp_add(fields[1], fields[0], 60);
	else
		*total = clamp_add(clamp_add(fields[2], fields[1], 60),
				   fields[0], 3600);
	return (0);
}

/* "[Nd][Nh][Nm][Ns]", or a bare N (minutes). */
static int parse_units(const char *s, long *total, const char **err)
{
	static const char units[] = "dhms";
	static const long scale[] = { 86400, 3600, 60, 1 };
	const char *u;
	int next = 0;
	long n;

	*total = 0;
	while (*s != '\0') {
		if (read_number(&s, &n) < 0) {
			*err = ERR_FORMAT;
			return (-1);
		}
		if (*s == '\0' && next == 0) {
			*total = clamp_add(0, n, 60); /* bare number: minutes */
			return (0);
		}
		if (*s == '\0' || (u = strchr(units, *s)) == NULL) {
			*err = ERR_FORMAT;
			return (-1);
		}
		if (u - units < next) {
			*err = ERR_ORDER;
			return (-1);
		}
		next = (int)(u - units) + 1;
		*total = clamp_add(*total, n, scale[u - units]);
		s++;
	}
	return (0);
}

int duration_parse(const char *s, long *seconds, const char **err)
{
	long total = 0;
	int rv = -1;

	if (s == NULL || *s == '\0') {
		*err = "empty value";
		goto fail;
	}
	if (strcasecmp(s, "off") == 0) {
		*seconds = 0;
		return (0);
	}
	if (strcasecmp(s, "auto") == 0) {
		*seconds = DURATION_AUTO;
		return (0);
	}
	if (strchr(s, ':') != NULL) {
		if (parse_clock(s, &total, err) < 0)
			goto fail;
	} else if (parse_units(s, &total, err) < 0) {
		goto fail;
	}
	if (total > DURATION_MAX_SECONDS) {
		*err = ERR_LARGE;
		goto fail;
	}
	if (total != 0 && total < DURATION_MIN_SECONDS) {
		*err = ERR_SMALL;
		goto fail;
	}
	*seconds = total;
	rv = 0;
fail:
	return (rv);
}
