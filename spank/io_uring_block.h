#ifndef SLURMCKPT_IO_URING_BLOCK_H
#define SLURMCKPT_IO_URING_BLOCK_H

/*
 * Install, in the calling thread, a seccomp filter that answers io_uring_setup, io_uring_enter and
 * io_uring_register with EPERM (docs/gpu.md, "io_uring"). Needs CAP_SYS_ADMIN or no_new_privs.
 * Returns 0, or -1 with errno set (ENOSYS: not built for this architecture).
 */
int io_uring_block(void);

#endif
