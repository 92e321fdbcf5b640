/*
 * io_uring_block.c - the seccomp filter under which every checkpointed tree starts: io_uring_setup,
 * io_uring_enter and io_uring_register fail with EPERM, everything else runs (docs/gpu.md, "io_uring").
 *
 * criu cannot dump an io_uring instance, and libraries make one by themselves (libuv >= 1.45 at loop
 * init, under PyTorch's TCPStore, which torchrun's rendezvous creates whatever USE_LIBUV says). Refused
 * by the kernel, they go on without: libuv keeps plain epoll when io_uring_setup fails, liburing's
 * io_uring_queue_init returns -EPERM. EPERM is what the kernel's own kernel.io_uring_disabled=2 and
 * Docker's default seccomp profile answer, so programs meet an answer they already handle. An errno,
 * never a kill: a program that probes for io_uring must live to fall back.
 *
 * The numbers are 425-427 in every table the two architectures run: x86_64, its i386 compat ABI and
 * its x32 ABI (425-427 with __X32_SYSCALL_BIT, under AUDIT_ARCH_X86_64), aarch64 and its arm compat
 * ABI. The filter checks the audit arch first, so no ABI passes with other numbers; a syscall of an
 * arch it does not know (none exists on these kernels) ends the process rather than pass unchecked.
 */
#include <errno.h>
#include <linux/audit.h>
#include <linux/filter.h>
#include <linux/seccomp.h>
#include <stddef.h>
#include <sys/prctl.h>

#include "io_uring_block.h"

#define IO_URING_SETUP    425
#define IO_URING_REGISTER 427   /* io_uring_enter is 426, between the two */
#define X32_SYSCALL_BIT   0x40000000u

#if defined(__x86_64__)
#define ARCH_NATIVE AUDIT_ARCH_X86_64
#define ARCH_COMPAT AUDIT_ARCH_I386
#define NATIVE_NR_MASK (~X32_SYSCALL_BIT)       /* x32 shares the arch: its numbers carry the bit */
#elif defined(__aarch64__)
#define ARCH_NATIVE AUDIT_ARCH_AARCH64
#define ARCH_COMPAT AUDIT_ARCH_ARM
#define NATIVE_NR_MASK (~0u)
#endif

int io_uring_block(void)
{
#ifdef ARCH_NATIVE
	struct sock_filter code[] = {
		/* 0 */ BPF_STMT(BPF_LD | BPF_W | BPF_ABS, offsetof(struct seccomp_data, arch)),
		/* 1 */ BPF_JUMP(BPF_JMP | BPF_JEQ | BPF_K, ARCH_NATIVE, 2, 0),
		/* 2 */ BPF_JUMP(BPF_JMP | BPF_JEQ | BPF_K, ARCH_COMPAT, 4, 0),
		/* 3 */ BPF_STMT(BPF_RET | BPF_K, SECCOMP_RET_KILL_PROCESS),
		/* 4 native */ BPF_STMT(BPF_LD | BPF_W | BPF_ABS, offsetof(struct seccomp_data, nr)),
		/* 5 */ BPF_STMT(BPF_ALU | BPF_AND | BPF_K, NATIVE_NR_MASK),
		/* 6 */ BPF_JUMP(BPF_JMP | BPF_JA, 1, 0, 0),
		/* 7 compat */ BPF_STMT(BPF_LD | BPF_W | BPF_ABS, offsetof(struct seccomp_data, nr)),
		/* 8 */ BPF_JUMP(BPF_JMP | BPF_JGE | BPF_K, IO_URING_SETUP, 0, 2),
		/* 9 */ BPF_JUMP(BPF_JMP | BPF_JGT | BPF_K, IO_URING_REGISTER, 1, 0),
		/* 10 */ BPF_STMT(BPF_RET | BPF_K, SECCOMP_RET_ERRNO | (EPERM & SECCOMP_RET_DATA)),
		/* 11 */ BPF_STMT(BPF_RET | BPF_K, SECCOMP_RET_ALLOW),
	};
	struct sock_fprog prog = { .len = sizeof(code) / sizeof(code[0]), .filter = code };

	return (prctl(PR_SET_SECCOMP, SECCOMP_MODE_FILTER, &prog, 0, 0));
#else
	errno = ENOSYS;
	return (-1);
#endif
}
