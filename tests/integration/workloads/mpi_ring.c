/* MPI ring exchange that keeps its state in memory (zdtm-style workload for tests/integration/test_mpi.py).
 *
 * Every step each rank mixes the value it received from its left neighbour into its own checksum and
 * passes a new value to its right neighbour; rank 0 prints "step N sum S" every step and, at the end, the
 * reduction of all ranks' checksums as "final S". The result depends on every message of every step in
 * order, so a lost, repeated or reordered message, or a restart from step 0, changes it (or the printed
 * step sequence).
 *
 * With GHOST_MIB > 0, rank 0 also keeps part of its state in a shared mapping of a file it unlinked at
 * once (as MPI libraries do with their shared-memory segments): CRIU must copy it into the images as a
 * ghost file; "ghost S" at the end is the checksum of what the mapping holds.
 *
 * Usage: mpi_ring STEPS SLEEP_MS [GHOST_MIB]
 */
#include <fcntl.h>
#include <inttypes.h>
#include <mpi.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <sys/mman.h>
#include <time.h>
#include <unistd.h>

static uint64_t mix(uint64_t h, uint64_t v)
{
	h ^= v + 0x9e3779b97f4a7c15ULL + (h << 6) + (h >> 2);
	return h * 0xff51afd7ed558ccdULL;
}

int main(int argc, char **argv)
{
	int rank, size;
	long steps = argc > 1 ? atol(argv[1]) : 100;
	long sleep_ms = argc > 2 ? atol(argv[2]) : 100;
	struct timespec pause = { sleep_ms / 1000, (sleep_ms % 1000) * 1000000L };

	MPI_Init(&argc, &argv);
	MPI_Comm_rank(MPI_COMM_WORLD, &rank);
	MPI_Comm_size(MPI_COMM_WORLD, &size);
	long ghost_words = (argc > 3 ? atol(argv[3]) : 0) << 17;	/* MiB -> 8-byte words */
	uint64_t *ghost = NULL;
	if (rank == 0 && ghost_words) {
		char path[64];
		snprintf(path, sizeof(path), "/dev/shm/mpi_ring.%d", (int)getpid());
		int fd = open(path, O_RDWR | O_CREAT | O_EXCL, 0600);
		if (fd < 0 || ftruncate(fd, ghost_words * 8) || unlink(path)) {
			perror("ghost file");
			MPI_Abort(MPI_COMM_WORLD, 2);
		}
		ghost = mmap(NULL, ghost_words * 8, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
		if (ghost == MAP_FAILED) {
			perror("mmap");
			MPI_Abort(MPI_COMM_WORLD, 2);
		}
		close(fd);		/* held by the mapping only */
	}
	uint64_t sum = mix(0, (uint64_t)rank + 1), out = sum, in = 0;
	int right = (rank + 1) % size, left = (rank + size - 1) % size;

	if (rank == 0)
		printf("start ranks %d steps %ld\n", size, steps);
	for (long step = 1; step <= steps; step++) {
		MPI_Sendrecv(&out, 1, MPI_UINT64_T, right, 0, &in, 1, MPI_UINT64_T, left, 0, MPI_COMM_WORLD,
			     MPI_STATUS_IGNORE);
		sum = mix(sum, in ^ (uint64_t)step);
		out = mix(in, sum);
		if (ghost)
			ghost[(step * 4099) % ghost_words] ^= sum;
		if (rank == 0) {
			printf("step %ld sum %016" PRIx64 "\n", step, sum);
			fflush(stdout);
		}
		nanosleep(&pause, NULL);
	}
	uint64_t total = 0;
	MPI_Reduce(&sum, &total, 1, MPI_UINT64_T, MPI_BXOR, 0, MPI_COMM_WORLD);
	if (rank == 0) {
		printf("final %016" PRIx64 "\n", total);
		if (ghost) {
			uint64_t g = 0;
			for (long i = 0; i < ghost_words; i++)
				g = ghost[i] ? mix(g, ghost[i] ^ (uint64_t)i) : g;
			printf("ghost %016" PRIx64 "\n", g);
		}
		fflush(stdout);
	}
	/* MPICH before 4.2 over UCX's TCP transport can hang in MPI_Finalize without any checkpoint: a rank
	 * that handles its peer's disconnect flush before it starts its own is left waiting for an answer
	 * while the peer sits in the PMI barrier (pmodels/mpich#6596; 6 of 30 plain srun runs here with
	 * UCX_TLS=tcp,self, 0 of 40 with this pause). A pause after the last message lets every rank start its
	 * own disconnect before it handles a peer's, so the tests see slurmckpt's faults, not that one. */
	struct timespec quiet = {0, 300 * 1000000L};
	nanosleep(&quiet, NULL);
	MPI_Finalize();
	return 0;
}
