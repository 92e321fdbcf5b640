/*
 * unit_tests.c - duration.c and args.c, no Slurm needed.
 */
#include <stdio.h>
#include <string.h>

#include "../args.h"
#include "../duration.h"

#include "check.h"

static void ok(const char *in, long want)
{
	const char *err = NULL;
	long got = -1;
	int rc = duration_parse(in, &got, &err);

	CHECK(rc == 0 && got == want, "duration '%s': rc %d got %ld want %ld (%s)",
	      in, rc, got, want, err ? err : "");
}

static void bad(const char *in, const char *why_part)
{
	const char *err = NULL;
	long got = -1;
	int rc = duration_parse(in, &got, &err);

	CHECK(rc < 0 && err != NULL && strstr(err, why_part) != NULL,
	      "duration '%s': rc %d got %ld err '%s', want error with '%s'",
	      in, rc, got, err ? err : "(null)", why_part);
}

static void test_duration(void)
{
	ok("off", 0);
	ok("OFF", 0);
	ok("0", 0);
	ok("0s", 0);
	ok("00:00", 0);
	ok("1", 60);
	ok("30", 1800);
	ok("10s", 10);
	ok("90s", 90);
	ok("30m", 1800);
	ok("2h", 7200);
	ok("1d", 86400);
	ok("1h30m", 5400);
	ok("2m30s", 150);
	ok("1d2h3m4s", 93784);
	ok("1h0m", 3600);
	ok("0:10", 10);
	ok("05:00", 300);
	ok("90:00", 5400);
	ok("1:30:00", 5400);
	ok("01:00:30", 3630);
	ok("365d", 365L * 86400);
	ok("8760h", 365L * 86400);
	ok("auto", DURATION_AUTO);
	ok("AUTO", DURATION_AUTO);

	bad("", "empty");
	bad("abc", "expected");
	bad("-5", "expected");
	bad("+5", "expected");
	bad(" 5", "expected");
	bad("5 ", "expected");
	bad("1.5h", "expected");
	bad("1h30", "expected");
	bad("30x", "expected");
	bad("m", "expected");
	bad("1H", "expected");
	bad("30m1h", "order");
	bad("1m1m", "order");
	bad("5s", "minimum");
	bad("0:09", "minimum");
	bad("9s", "minimum");
	bad("1:60", "below 60");
	bad("1:00:75", "below 60");
	bad("1:2:3:4", "expected");
	bad(":30", "expected");
	bad("30:", "expected");
	bad("1::30", "expected");
	bad("366d", "too large");
	bad("99999999999999999999999", "too large");
	bad("99999999999999999999d", "too large");
	bad("9999999:00:00", "too large");
	bad("offf", "expected");
	bad("autoo", "expected off, auto");
}

static int parse(struct plugin_args *a, char **av, int ac, char *err)
{
	args_defaults(a);
	return (args_parse(a, ac, av, err, 256));
}

static void test_args(void)
{
	struct plugin_args a;
	char err[256];

	CHECK(parse(&a, NULL, 0, err) == 0, "no args");
	CHECK(strcmp(a.wrapper, ARGS_DEFAULT_WRAPPER) == 0, "default wrapper");
	CHECK(strcmp(a.agent, ARGS_DEFAULT_AGENT) == 0, "default agent");
	CHECK(strcmp(a.init, ARGS_DEFAULT_INIT) == 0, "default init");
	CHECK(a.default_interval == 0, "default interval off");

	{
		char *av[] = { "wrapper=/w", "agent=/a", "init=/i",
			       "default_interval=1h30m" };
		CHECK(parse(&a, av, 4, err) == 0, "all keys: %s", err);
		CHECK(strcmp(a.wrapper, "/w") == 0, "wrapper=");
		CHECK(strcmp(a.agent, "/a") == 0, "agent=");
		CHECK(strcmp(a.init, "/i") == 0, "init=");
		CHECK(a.default_interval == 5400, "default_interval=");
	}
	{
		char *av[] = { "default_interval=auto" };
		CHECK(parse(&a, av, 1, err) == 0 &&
		      a.default_interval == DURATION_AUTO,
		      "default_interval=auto");
	}
	{
		char *av[] = { "default_interval=off" };
		CHECK(parse(&a, av, 1, err) == 0 && a.default_interval == 0,
		      "default_interval=off");
	}
	{
		char *av[] = { "agent=/a", "log=/tmp/x" };
		CHECK(parse(&a, av, 2, err) < 0 && strstr(err, "unknown key 'log'"),
		      "unknown key: %s", err);
	}
	{
		char *av[] = { "wrapper" };
		CHECK(parse(&a, av, 1, err) < 0 && strstr(err, "key=value"),
		      "no '=': %s", err);
	}
	{
		char *av[] = { "=x" };
		CHECK(parse(&a, av, 1, err) < 0 && strstr(err, "key=value"),
		      "empty key: %s", err);
	}
	{
		char *av[] = { "wrappers=/x" };
		CHECK(parse(&a, av, 1, err) < 0 && strstr(err, "unknown key"),
		      "prefix of a key: %s", err);
	}
	{
		char *av[] = { "wrap=/x" };
		CHECK(parse(&a, av, 1, err) < 0 && strstr(err, "unknown key"),
		      "key prefix: %s", err);
	}
	{
		char *av[] = { "agent=relative/path" };
		CHECK(parse(&a, av, 1, err) < 0 && strstr(err, "absolute"),
		      "relative path: %s", err);
	}
	{
		char *av[] = { "init=" };
		CHECK(parse(&a, av, 1, err) < 0 && strstr(err, "absolute"),
		      "empty path: %s", err);
	}
	{
		char *av[] = { "agent=/a", "agent=/b" };
		CHECK(parse(&a, av, 2, err) < 0 && strstr(err, "more than once"),
		      "duplicate: %s", err);
	}
	{
		char *av[] = { "default_interval=5s" };
		CHECK(parse(&a, av, 1, err) < 0 &&
		      strstr(err, "default_interval=: invalid value '5s'") &&
		      strstr(err, "minimum"), "bad default_interval: %s", err);
	}
	{
		static char longpath[PATH_MAX + 16];
		char *av[] = { longpath };

		memset(longpath, 'x', sizeof(longpath) - 1);
		memcpy(longpath, "agent=/", 7);
		CHECK(parse(&a, av, 1, err) < 0 && strstr(err, "too long"),
		      "long path: %s", err);
	}
}

int main(void)
{
	test_duration();
	test_args();
	if (failures) {
		fprintf(stderr, "%d check(s) failed\n", failures);
		return (1);
	}
	printf("unit tests: all passed\n");
	return (0);
}
