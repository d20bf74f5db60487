/* bench-limits: measures, on this machine and now, the limits the benchmark compares against:
 *   - pinned host-to-device bandwidth (cudaMemcpyAsync from cudaMallocHost memory),
 *   - device memory (HBM) bandwidth: a read kernel, and a device-to-device copy counted as read
 *     plus write; the bound is the better of the two (hbm.cu says why the read is what counts),
 *   - disk read bandwidth of a file with O_DIRECT and io_uring (4 MiB reads, 64 in flight),
 *   - the bf16 GEMM rate of cuBLAS at a prefill shape (float32 accumulation),
 *   - with --handoffs, what passing a result from every block of one phase of work to the next
 *     costs: a kernel boundary, plain and with programmatic dependent launch, and a phase of one
 *     persistent grid, by counters or a grid barrier (handoff.h);
 *   - with --h2d-shapes, pinned H2D in the shapes a split FFN's GPU share is copied in: down's
 *     columns [0, r) of every row are a 2D copy (a row's share of `width` bytes every `pitch` bytes),
 *     where the start's calibration of the link copies contiguous chunks (h2d_shapes below).
 * Prints one JSON object on stdout:
 *   {"h2d_bytes_per_s":..., "hbm_bytes_per_s":..., "disk_bytes_per_s":..., "gemm_flops_per_s":..., ...}
 *
 *   bench-limits [--file PATH] [--disk-bytes SIZE] [--hbm-bytes SIZE] [--m 512 --n 14336 --k 4096]
 *                [--handoffs] [--h2d-shapes]
 */
#include <cublas_v2.h>
#include <cuda_runtime_api.h>
#include <errno.h>
#include <stdbool.h>
#include <fcntl.h>
#include <liburing.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

#include "common/config.h"
#include "common/util.h"
#include "handoff.h"
#include "hbm.h"

#define CHECK_CUDA(call)                                                                                  \
	do {                                                                                              \
		cudaError_t e_ = (call);                                                                  \
		if (e_ != cudaSuccess) {                                                                  \
			fprintf(stderr, "bench-limits: %s: %s\n", #call, cudaGetErrorString(e_));          \
			exit(1);                                                                          \
		}                                                                                         \
	} while (0)

/* Pinned H2D of `rows` rows of `width` bytes each, `pitch` bytes apart in host memory (pitch ==
 * width: one contiguous copy), into a packed device buffer: cudaMemcpy2DAsync as the GPU window
 * copies a split FFN's down share (gw_copy_pieces). Bytes a second of the rows' bytes. */
static double h2d_2d(size_t width, size_t pitch, size_t rows, int reps)
{
	void *host, *dev;
	CHECK_CUDA(cudaMallocHost(&host, pitch * rows));
	CHECK_CUDA(cudaMalloc(&dev, width * rows));
	memset(host, 7, pitch * rows);
	cudaStream_t s;
	cudaEvent_t a, b;
	CHECK_CUDA(cudaStreamCreate(&s));
	CHECK_CUDA(cudaEventCreate(&a));
	CHECK_CUDA(cudaEventCreate(&b));
	for (int i = 0; i <= reps; i++) {
		if (i == 1)
			CHECK_CUDA(cudaEventRecord(a, s)); /* the first copy warms up */
		if (pitch == width)
			CHECK_CUDA(cudaMemcpyAsync(dev, host, width * rows, cudaMemcpyHostToDevice, s));
		else
			CHECK_CUDA(cudaMemcpy2DAsync(dev, width, host, pitch, width, rows, cudaMemcpyHostToDevice, s));
	}
	CHECK_CUDA(cudaEventRecord(b, s));
	CHECK_CUDA(cudaEventSynchronize(b));
	float ms;
	CHECK_CUDA(cudaEventElapsedTime(&ms, a, b));
	cudaFree(dev);
	cudaFreeHost(host);
	cudaEventDestroy(a);
	cudaEventDestroy(b);
	cudaStreamDestroy(s);
	return (double)(width * rows) * reps / (ms * 1e-3);
}

/* Pinned H2D of one contiguous buffer of `bytes`. */
static double h2d(size_t bytes, int reps)
{
	return h2d_2d(bytes, bytes, 1, reps);
}

/* The split FFN's copy shapes: down's share of the benchmark's models (rows: the hidden size;
 * pitch: a row of ffn_dim values in the format; width: the GPU's r of them, as their last plans
 * chose), then widths from 512 bytes to 32 KiB at a pitch of three widths, and each share's
 * bytes as one contiguous copy beside it. Prints the JSON array "h2d_2d". */
static void h2d_shapes(void)
{
	static const struct {
		const char *what;
		size_t width, pitch, rows;
	} v[] = {
		{"P3 8B Q8_0 down, r 5408 of 14336", 5408 / 32 * 34, 14336 / 32 * 34, 4096},
		{"P1 8B bf16 down, r 5568 of 14336", 5568 * 2, 14336 * 2, 4096},
		{"8B Q4_K down, r 5120 of 14336", 5120 / 256 * 144, 14336 / 256 * 144, 4096},
		{"P2 70B bf16 down, r 8000 of 28672", 8000 * 2, 28672 * 2, 8192},
		{"512 B rows", 512, 1536, 65536},
		{"1 KiB rows", 1024, 3072, 32768},
		{"2 KiB rows", 2048, 6144, 16384},
		{"4 KiB rows", 4096, 12288, 8192},
		{"8 KiB rows", 8192, 24576, 4096},
		{"16 KiB rows", 16384, 49152, 2048},
		{"32 KiB rows", 32768, 98304, 1024},
	};
	printf(", \"h2d_2d\": [");
	for (size_t i = 0; i < sizeof(v) / sizeof(v[0]); i++) {
		const double two = h2d_2d(v[i].width, v[i].pitch, v[i].rows, 8);
		const double one = h2d_2d(v[i].width * v[i].rows, v[i].width * v[i].rows, 1, 8);
		printf("%s{\"what\": \"%s\", \"width\": %zu, \"pitch\": %zu, \"rows\": %zu, \"bytes_per_s\": %.0f, "
		       "\"contiguous_bytes_per_s\": %.0f}",
		       i ? ", " : "", v[i].what, v[i].width, v[i].pitch, v[i].rows, two, one);
		fflush(stdout);
	}
	printf("]");
}

/* Reads up to `limit` bytes of path with O_DIRECT, `chunk` bytes per read, `depth` in flight,
 * into a buffer of `dest_bytes` (each read to the next place in it, wrapping), with io_uring
 * issuing inline or from its workers (IOSQE_ASYNC, what the loader does). */
static double disk_variant(const char *path, uint64_t limit, unsigned depth, size_t chunk, size_t dest_bytes,
			   bool async, uint64_t *read_out)
{
	int fd = open(path, O_RDONLY | O_DIRECT);
	if (fd < 0) {
		fprintf(stderr, "bench-limits: cannot open %s with O_DIRECT: %s\n", path, strerror(errno));
		exit(1);
	}
	struct stat st;
	fstat(fd, &st);
	uint64_t size = (uint64_t)st.st_size & ~(uint64_t)4095;
	if (size > limit)
		size = limit;
	struct io_uring ring;
	if (io_uring_queue_init(depth, &ring, 0) != 0) {
		fprintf(stderr, "bench-limits: io_uring_queue_init failed\n");
		exit(1);
	}
	char *buf;
	if (dest_bytes < chunk * depth)
		dest_bytes = chunk * depth;
	if (posix_memalign((void **)&buf, 4096, dest_bytes) != 0)
		exit(1);
	memset(buf, 0, dest_bytes); /* pages exist, as in the loader after its first fill */
	size_t slots = dest_bytes / chunk;
	uint64_t next = 0, done = 0, issued = 0;
	unsigned inflight = 0;
	uint64_t t0 = now_ns();
	while (done < size) {
		while (inflight < depth && next < size) {
			struct io_uring_sqe *sqe = io_uring_get_sqe(&ring);
			size_t len = size - next < chunk ? size - next : chunk;
			io_uring_prep_read(sqe, fd, buf + (size_t)(issued % slots) * chunk, (unsigned)len, next);
			if (async)
				io_uring_sqe_set_flags(sqe, IOSQE_ASYNC);
			next += len;
			issued++;
			inflight++;
		}
		io_uring_submit(&ring);
		struct io_uring_cqe *cqe;
		if (io_uring_wait_cqe(&ring, &cqe) != 0)
			exit(1);
		if (cqe->res <= 0) {
			fprintf(stderr, "bench-limits: read failed: %s\n", strerror(-cqe->res));
			exit(1);
		}
		done += (uint64_t)cqe->res;
		inflight--;
		io_uring_cqe_seen(&ring, cqe);
	}
	double secs = (double)(now_ns() - t0) * 1e-9;
	io_uring_queue_exit(&ring);
	free(buf);
	close(fd);
	*read_out = done;
	return (double)done / secs;
}

static double gemm(int m, int n, int k)
{
	/* C (n x m) = W (n x k) X (k x m): the runner's orientation, tokens m, outputs n. */
	void *w, *x, *c;
	CHECK_CUDA(cudaMalloc(&w, (size_t)n * k * 2));
	CHECK_CUDA(cudaMalloc(&x, (size_t)k * m * 2));
	CHECK_CUDA(cudaMalloc(&c, (size_t)n * m * 4));
	/* Non-zero data: zeros can run faster than real data. */
	uint16_t *h = malloc((size_t)n * k * 2);
	for (size_t i = 0; i < (size_t)n * k; i++)
		h[i] = (uint16_t)(0x3c00 + (random_u64() & 0x1ff)); /* bf16 values around 0.01 .. 0.03 */
	CHECK_CUDA(cudaMemcpy(w, h, (size_t)n * k * 2, cudaMemcpyHostToDevice));
	CHECK_CUDA(cudaMemcpy(x, h, (size_t)k * m * 2, cudaMemcpyHostToDevice));
	free(h);
	cublasHandle_t hd;
	if (cublasCreate(&hd) != CUBLAS_STATUS_SUCCESS)
		exit(1);
	float one = 1, zero = 0;
	cudaEvent_t a, b;
	CHECK_CUDA(cudaEventCreate(&a));
	CHECK_CUDA(cudaEventCreate(&b));
	for (int i = 0; i < 3; i++)
		cublasGemmEx(hd, CUBLAS_OP_T, CUBLAS_OP_N, n, m, k, &one, w, CUDA_R_16BF, k, x, CUDA_R_16BF, k, &zero, c,
			     CUDA_R_32F, n, CUBLAS_COMPUTE_32F, CUBLAS_GEMM_DEFAULT);
	const int reps = 20;
	CHECK_CUDA(cudaEventRecord(a, 0));
	for (int i = 0; i < reps; i++)
		if (cublasGemmEx(hd, CUBLAS_OP_T, CUBLAS_OP_N, n, m, k, &one, w, CUDA_R_16BF, k, x, CUDA_R_16BF, k, &zero,
				 c, CUDA_R_32F, n, CUBLAS_COMPUTE_32F, CUBLAS_GEMM_DEFAULT) != CUBLAS_STATUS_SUCCESS) {
			fprintf(stderr, "bench-limits: cublasGemmEx failed\n");
			exit(1);
		}
	CHECK_CUDA(cudaEventRecord(b, 0));
	CHECK_CUDA(cudaEventSynchronize(b));
	float ms;
	CHECK_CUDA(cudaEventElapsedTime(&ms, a, b));
	cublasDestroy(hd);
	cudaFree(w);
	cudaFree(x);
	cudaFree(c);
	return 2.0 * m * n * k * reps / (ms * 1e-3);
}

static double disk(const char *path, uint64_t limit, unsigned depth, uint64_t *read_out)
{
	return disk_variant(path, limit, depth, 4u << 20, 0, false, read_out);
}

int main(int argc, char **argv)
{
	const char *file = NULL;
	uint64_t disk_bytes = 0, hbm_bytes = 0;
	bool matrix = false, handoffs = false, shapes = false;
	long m = 512, n = 14336, k = 4096;
	const struct opt opts[] = {
		{"file", OPT_STRING, &file, NULL, "a large file to read for the disk bandwidth (skipped without)"},
		{"disk-bytes", OPT_SIZE, &disk_bytes, "8GiB", "read at most this much of it"},
		{"hbm-bytes", OPT_SIZE, &hbm_bytes, "2GiB",
		 "HBM: the buffer read (and copied, into a second one); far larger than L2"},
		{"m", OPT_INT, &m, "512", "GEMM: tokens"},
		{"n", OPT_INT, &n, "14336", "GEMM: output features"},
		{"k", OPT_INT, &k, "4096", "GEMM: input features"},
		{"disk-matrix", OPT_BOOL, &matrix, NULL,
		 "also read the file the loader's way: into a large buffer, inline or from io_uring's workers, 4 or 16 MiB"},
		{"handoffs", OPT_BOOL, &handoffs, NULL,
		 "also time a hand-off from every block of one phase to the next: a kernel boundary (plain, programmatic "
		 "dependent launch) and a phase of one persistent grid (counters, grid barrier)"},
		{"h2d-shapes", OPT_BOOL, &shapes, NULL,
		 "also time pinned H2D in the shapes a split FFN's GPU share is copied in: 2D copies of down's columns "
		 "(the P1-P3 shapes and 512 B-32 KiB rows), each beside the same bytes in one contiguous copy"},
		{0},
	};
	int rc = config_parse("bench-limits",
			      "Measures pinned H2D bandwidth, HBM bandwidth, O_DIRECT disk bandwidth and the bf16 GEMM rate.",
			      opts, argc, argv, NULL, NULL);
	if (rc > 0)
		return 0;
	if (rc < 0)
		return 2;
	int ndev = 0;
	if (cudaGetDeviceCount(&ndev) != cudaSuccess || ndev == 0) {
		fprintf(stderr, "bench-limits: no GPU\n");
		return 77;
	}
	double h = h2d(1u << 30, 8);
	double hr = hbm_read((size_t)hbm_bytes, 10), hc = hbm_copy((size_t)hbm_bytes, 10);
	if (hr < 0 || hc < 0)
		return 1;
	double g = gemm((int)m, (int)n, (int)k);
	double d = 0;
	uint64_t dread = 0;
	if (file) {
		/* Cold pages: O_DIRECT bypasses the page cache anyway. */
		d = disk(file, disk_bytes, 64, &dread);
	}
	struct handoff_costs ho = {0};
	if (handoffs && handoff_measure(1000, 5, &ho) != 0)
		return 1;
	printf("{\"h2d_bytes_per_s\": %.0f, \"hbm_bytes_per_s\": %.0f, \"hbm_read_bytes_per_s\": %.0f, "
	       "\"hbm_copy_bytes_per_s\": %.0f, \"hbm_buffer_bytes\": %llu, \"gemm_flops_per_s\": %.0f, "
	       "\"gemm_shape\": [%ld, %ld, %ld], \"disk_bytes_per_s\": %.0f, \"disk_bytes_read\": %llu",
	       h, hr > hc ? hr : hc, hr, hc, (unsigned long long)hbm_bytes, g, m, n, k, d, (unsigned long long)dread);
	if (file && matrix) {
		static const struct {
			const char *name;
			size_t chunk, dest;
			unsigned depth;
			bool async;
		} v[] = {
			{"small_inline_4m", 4u << 20, 0, 64, false},   {"large_inline_4m", 4u << 20, 4ull << 30, 64, false},
			{"large_async_4m", 4u << 20, 4ull << 30, 64, true}, {"large_inline_16m", 16u << 20, 4ull << 30, 32, false},
			{"large_async_16m", 16u << 20, 4ull << 30, 32, true},
		};
		for (size_t i = 0; i < sizeof(v) / sizeof(v[0]); i++) {
			uint64_t got = 0;
			double bps = disk_variant(file, disk_bytes, v[i].depth, v[i].chunk, v[i].dest, v[i].async, &got);
			printf(", \"disk_%s\": %.0f", v[i].name, bps);
		}
	}
	if (handoffs)
		printf(", \"handoff_blocks\": %d, \"handoff_threads\": %d, \"kernel_boundary_us\": %.2f, "
		       "\"kernel_boundary_pdl_us\": %.2f, \"grid_counter_phase_us\": %.2f, \"grid_sync_phase_us\": %.2f",
		       ho.blocks, ho.threads, ho.plain_us, ho.pdl_us, ho.counter_us, ho.grid_sync_us);
	if (shapes)
		h2d_shapes();
	printf("}\n");
	return 0;
}
