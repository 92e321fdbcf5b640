/* check.h - the C unit tests' CHECK: count a failure, say where and why, go on. */
#ifndef SLURMCKPT_TEST_CHECK_H
#define SLURMCKPT_TEST_CHECK_H

#include <stdio.h>

static int failures;

#define CHECK(cond, ...)                                                        \
	do {                                                                    \
		if (!(cond)) {                                                  \
			failures++;                                             \
			fprintf(stderr, "FAIL %s:%d: ", __FILE__, __LINE__);    \
			fprintf(stderr, __VA_ARGS__);                           \
			fputc('\n', stderr);                                    \
		}                                                               \
	} while (0)

#endif
