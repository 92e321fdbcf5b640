/*
 * proctrack_fake.c - proctrack/fake, the delegate of proctrack_test.c: each
 * op records its name and arguments in fake_last for the test to compare.
 */
#include <stdbool.h>
#include <stdint.h>
#include <stdio.h>
#include <sys/types.h>

struct fake_call { char op[64]; uint64_t id; long arg; int inited; };
struct fake_call fake_last;

static int rec(const char *op, uint64_t id, long arg)
{
	snprintf(fake_last.op, sizeof(fake_last.op), "%s", op);
	fake_last.id = id;
	fake_last.arg = arg;
	return (0);
}

int init(void) { fake_last.inited = 1; return (0); }
int fini(void) { fake_last.inited = 0; return (0); }
int proctrack_p_create(void *step) { return (rec("create", (uintptr_t)step, 0)); }
int proctrack_p_add(void *step, pid_t pid) { return (rec("add", (uintptr_t)step, pid)); }
int proctrack_p_signal(uint64_t id, int sig) { return (rec("signal", id, sig)); }
int proctrack_p_destroy(uint64_t id) { return (rec("destroy", id, 0)); }
uint64_t proctrack_p_find(pid_t pid) { rec("find", 0, pid); return (77); }
bool proctrack_p_has_pid(uint64_t id, pid_t pid) { rec("has_pid", id, pid); return (true); }
int proctrack_p_wait(uint64_t id) { return (rec("wait", id, 0)); }
int proctrack_p_wait_for_any_task(void *step, void **task, bool block)
{
	(void)task;
	return (rec("wait_for_any_task", (uintptr_t)step, block));
}
int proctrack_p_get_pids(uint64_t id, pid_t **pids, int *npids)
{
	(void)pids;
	*npids = 0;
	return (rec("get_pids", id, 0));
}
