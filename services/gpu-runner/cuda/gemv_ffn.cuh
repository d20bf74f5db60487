/* gemv_ffn.cuh - a one-token FFN in one launch (included at the end of gemv_quant.cu, whose
 * integer path through shared memory it runs twice): act = SiLU(gate x) * (up x), x the RMSNorm of
 * the residual computed as it is staged, then residual += down act.
 *
 * Two passes in one grid. Each is dq_sm_kernel's walk (x staged once, a ring of items per warp
 * a few items ahead through cp.async), but a warp's rows are not fixed by its place in the grid:
 * it claims spans of rows (span_rows each) from a counter in device memory, two spans ahead of
 * the one it loads, so a claim's round trip is never waited for. Between the passes each block
 * adds the rows its warps finished to a count and waits until the count holds every gate/up
 * row (the gate); the next kernel is let launch after it. Down's first items are issued before the
 * gate, so the weights keep coming while the last gate/up rows finish and the blocks wait for
 * each other.
 *
 * Why claims, not a grid barrier: a barrier needs every block resident at once, which a launch
 * that may start beside the kernel before it (programmatic dependent launch) is not promised; a
 * multiprocessor that kernel left configured with less shared memory takes fewer of these blocks,
 * and blocks spinning at a barrier keep it so. With claims a block that starts late finds the
 * rows taken and a block at the gate waits only for rows that running warps have claimed: it
 * cannot wait forever. Claims also even out the work: no warp has a row more than the others but
 * for the last span.
 *
 * Counters. Warp w of every block claims from queue w (spans w, w + FFN_QUEUES, ...), one counter
 * each on its own 128-byte line, so claims spread over L2. A warp makes two claims past its last
 * span and then stops, so a launch adds to queue q exactly its spans plus twice the grid, and the
 * host keeps each counter's value at a launch's start (backend_dev.ffn_base) without reading it.
 * Launches alternate between two sets of counters: the next launch may claim before this one has
 * ended (its first loads go before it waits for the kernel before it), the one after cannot (the
 * kernels between wait for this one to end).
 *
 * A row's sum is what it is in two launches (one warp, the same items in the same order, the
 * same x), so the result is the same bits; only which warp takes a row differs. */

/* The formats that go together (gate/up, down): those of Q4_K_M (Q4_K with a Q4_K or Q6_K
 * down), Q8_0 and Q6_K files. */
static inline bool ffn_pair(uint32_t fa, uint32_t fb)
{
	return (fa == DT_Q4_K && (fb == DT_Q4_K || fb == DT_Q6_K)) || (fa == DT_Q8_0 && fb == DT_Q8_0) ||
	       (fa == DT_Q6_K && fb == DT_Q6_K);
}

/* One pass's claims. */
struct ffn_claims {
	unsigned *ctr;		   /* FFN_QUEUES counters, FFN_LINE words apart */
	unsigned base[FFN_QUEUES]; /* their values at the launch's start */
	uint32_t span_rows;	   /* rows of a span; its items are at least the ring's stages */
	uint32_t spans;		   /* ceil(rows / span_rows) */
};

struct ffn_sync {
	struct ffn_claims pass[2];
	unsigned *done;		/* gate/up rows finished (counter) */
	unsigned done_base;	/* its value at the launch's start */
};

/* A warp's queue: its counter, the counter's value at the start, its spans. */
struct ffn_queue {
	unsigned *ctr;
	unsigned base;
	uint32_t n;
};

static __device__ __forceinline__ ffn_queue ffn_queue_of(const ffn_claims &c, uint32_t q)
{
	ffn_queue r;
	r.ctr = c.ctr + q * FFN_LINE;
	r.base = pick_mat(c.base, q); /* branches, not c.base[q]: see pick_mat */
	r.n = c.spans > q ? (c.spans - q + FFN_QUEUES - 1) / FFN_QUEUES : 0;
	return r;
}

/* A warp's claims: lane 0 holds the next two (c1 the sooner), sl is the span the loader is in
 * (c.spans or more: none). */
struct ffn_seq {
	unsigned c1, c2;
	uint32_t sl;
};

/* The warp's next span (every lane): lane 0's oldest claim, and while it is one of the queue's
 * spans a new claim in its place. */
static __device__ __forceinline__ uint32_t ffn_take(const ffn_queue &qu, uint32_t q, ffn_seq &s, uint32_t lane)
{
	const unsigned j = __shfl_sync(0xFFFFFFFFu, s.c1, 0) - qu.base;
	s.c1 = s.c2;
	if (j >= qu.n)
		return UINT32_MAX;
	if (lane == 0)
		s.c2 = atomicAdd(qu.ctr, 1u);
	return q + FFN_QUEUES * j;
}

/* A place in a warp's walk: row o (of span `span`, whose rows end at `end`), its item k. r has
 * qg_row's fields that dq_sm_issue and qg_finish read (p is 0: one part). */
template <int MODE> struct ffn_cursor {
	struct {
		uint32_t p, o;
		const uint8_t *row, *row2;
	} r;
	uint32_t k, end;
	bool live;

	__device__ __forceinline__ void row_at(const qgemv_args &a)
	{
		r.row = a.w[0] + (size_t)r.o * a.row_bytes;
		r.row2 = GEMV_MODE_OF(MODE) == GEMV_SWIGLU ? a.w[1] + (size_t)r.o * a.row_bytes : r.row;
	}

	__device__ __forceinline__ void span_at(const qgemv_args &a, const ffn_claims &c, uint32_t span)
	{
		live = span < c.spans;
		if (!live)
			return;
		r.p = 0;
		r.o = span * c.span_rows;
		end = min(a.total, r.o + c.span_rows);
		row_at(a);
	}

	/* The next item. At a span's end the loader's cursor (LD) takes the warp's next span; the
	 * other, fewer items behind it than a span holds, follows it into the span it is in. */
	template <bool LD>
	__device__ __forceinline__ void next(const qgemv_args &a, const ffn_claims &c, const ffn_queue &qu, uint32_t q,
					     ffn_seq &s, uint32_t lane)
	{
		if (++k < qg_items<MODE>(a))
			return;
		k = 0;
		if (++r.o < end) {
			row_at(a);
			return;
		}
		if (LD)
			s.sl = ffn_take(qu, q, s, lane);
		span_at(a, c, s.sl);
	}
};

/* Bytes of a warp's ring: the larger of the two passes' rings. */
template <int FA, int FB> struct ffn_ring {
	static constexpr uint32_t A = dq_stages<FA>::V * dq_stage_bytes<FA>::V;
	static constexpr uint32_t B = dq_stages<FB>::V * dq_stage_bytes<FB>::V;
	static constexpr uint32_t V = A > B ? A : B;
};

/* Shared memory: the larger x (dim values of gate/up's, ffn of down's), then the warps' rings. */
template <int FA, int FB> static inline __host__ __device__ size_t ffn_xbytes(uint32_t dim, uint32_t ffn)
{
	const size_t xa = dq_smem_f<FA>(dim), xb = dq_smem_f<FB>(ffn);
	return xa > xb ? xa : xb;
}

template <int FA, int FB> static inline size_t ffn_smem(uint32_t dim, uint32_t ffn)
{
	return ffn_xbytes<FA, FB>(dim, ffn) + (size_t)QG_WARPS * ffn_ring<FA, FB>::V;
}

/* The gate between the passes: the block's rows are added to the count once all its warps are
 * done (their act rows written), then thread 0 waits for every row. */
static __device__ __forceinline__ void ffn_gate(const ffn_sync &sy, uint32_t rows, const unsigned *block_rows)
{
	__syncthreads();
	if (threadIdx.x == 0) {
		__threadfence();
		atomicAdd(sy.done, *block_rows);
		unsigned now;
		do {
			asm volatile("ld.acquire.gpu.global.u32 %0, [%1];" : "=r"(now) : "l"(sy.done) : "memory");
		} while (now - sy.done_base < rows);
		__threadfence();
	}
	__syncthreads();
}

/* One pass (SECOND: down, after the gate; else gate/up, after the kernel before). Gate/up's warps
 * add the rows they finished to *block_rows. */
template <int F, int MODE, bool SECOND>
static __device__ __forceinline__ void ffn_pass(const qgemv_args &a, uint8_t *smem, size_t xbytes, uint32_t rb,
						const ffn_sync &sy, uint32_t gate_rows, unsigned *block_rows)
{
	constexpr uint32_t SB = dq_stage_bytes<F>::V, STAGES = dq_stages<F>::V;
	const ffn_claims &c = sy.pass[SECOND ? 1 : 0];
	uint8_t *xq = smem;
	float *xd = (float *)(xq + a.in), *xs = xd + a.in / 32; /* xs: none for Q6_K (dq_smem_f) */
	const uint32_t wid = threadIdx.x / 32, lane = threadIdx.x % 32;
	uint8_t *ring = smem + xbytes + (size_t)wid * rb;
	float acc[1] = {0.0f}, acc2[1] = {0.0f};
	if (SECOND)
		__syncwarp(); /* every lane is done with gate/up's last stage */
	const ffn_queue qu = ffn_queue_of(c, wid);
	ffn_seq s;
	s.c1 = s.c2 = 0;
	if (lane == 0) {
		s.c1 = atomicAdd(qu.ctr, 1u);
		s.c2 = atomicAdd(qu.ctr, 1u);
	}
	s.sl = ffn_take(qu, wid, s, lane);
	ffn_cursor<MODE> ld;
	ld.k = 0;
	ld.span_at(a, c, s.sl);
	ffn_cursor<MODE> at = ld;
	/* The first items start coming before the wait: weights are what no kernel of the step
	 * writes. */
#pragma unroll
	for (uint32_t i = 0; i < STAGES - 1; i++) {
		dq_sm_issue<F, MODE>(a, ld, ring + i * SB, lane);
		if (ld.live)
			ld.template next<true>(a, c, qu, wid, s, lane);
	}
	if (SECOND) {
		ffn_gate(sy, gate_rows, block_rows);
		grid_launch_next();
	} else {
		grid_wait();
	}
	dq_stage<F, false, SECOND>(a, xq, xd, xs);
	uint32_t rows = 0;
	for (uint32_t i = 0; at.live; i++) {
		cp_async_wait<STAGES - 2>(); /* item i's bytes (this lane's copies) have landed */
		__syncwarp();		     /* ... and every lane's; stage i - 1 is read by all */
		dq_sm_issue<F, MODE>(a, ld, ring + ((i + STAGES - 1) % STAGES) * SB, lane);
		if (ld.live)
			ld.template next<true>(a, c, qu, wid, s, lane);
		const uint32_t k = at.k;
		dq_sm_item<F, MODE>(a, k, lane, ring + (i % STAGES) * SB, xq, xd, xs, acc, acc2);
		if (k + 1 == qg_items<MODE>(a)) {
			qg_finish<1, MODE>(a, at.r.p, at.r.o, lane, acc, acc2);
			rows++;
		}
		at.template next<false>(a, c, qu, wid, s, lane);
	}
	cp_async_wait<0>();
	if (!SECOND && lane == 0 && rows)
		atomicAdd(block_rows, rows);
}

/* Three blocks a multiprocessor (80 registers): with four (64) the claims' state and gate/up's
 * staging of x spill hundreds of bytes. Down's rows then take 1.3 warps' turns each, not one. */
template <int FA, int FB>
__global__ void __launch_bounds__(QG_THREADS, 3) ffn_kernel(const qgemv_args a, const qgemv_args b, const ffn_sync sy)
{
	extern __shared__ uint4 dq_smem_buf[];
	__shared__ unsigned block_rows;
	if (threadIdx.x == 0)
		block_rows = 0; /* before gate/up's staging, whose barrier every warp passes first */
	uint8_t *smem = (uint8_t *)dq_smem_buf;
	const size_t xbytes = ffn_xbytes<FA, FB>(a.in, b.in);
	ffn_pass<FA, GEMV_SWIGLU, false>(a, smem, xbytes, ffn_ring<FA, FB>::V, sy, a.total, &block_rows);
	ffn_pass<FB, GEMV_ADD, true>(b, smem, xbytes, ffn_ring<FA, FB>::V, sy, a.total, &block_rows);
}

template <int FA, int FB> static cudaError_t ffn_allow_k(void)
{
	return cudaFuncSetAttribute(ffn_kernel<FA, FB>, cudaFuncAttributeMaxDynamicSharedMemorySize,
				    (int)DQ_SM_SMEM_MAX);
}

static cudaError_t ffn_allow(void)
{
	cudaError_t e;
	if ((e = ffn_allow_k<DT_Q4_K, DT_Q4_K>()) || (e = ffn_allow_k<DT_Q4_K, DT_Q6_K>()) ||
	    (e = ffn_allow_k<DT_Q8_0, DT_Q8_0>()) || (e = ffn_allow_k<DT_Q6_K, DT_Q6_K>()))
		return e;
	return cudaSuccess;
}

static size_t ffn_smem_of(uint32_t fa, uint32_t fb, uint32_t dim, uint32_t ffn)
{
	if (fa == DT_Q4_K)
		return fb == DT_Q4_K ? ffn_smem<DT_Q4_K, DT_Q4_K>(dim, ffn) : ffn_smem<DT_Q4_K, DT_Q6_K>(dim, ffn);
	return fa == DT_Q8_0 ? ffn_smem<DT_Q8_0, DT_Q8_0>(dim, ffn) : ffn_smem<DT_Q6_K, DT_Q6_K>(dim, ffn);
}

/* Both products on the integer path through shared memory (what launch_dq_k would choose for
 * each alone), x of gate/up from a struct xsrc. */
bool qgemv_ffn_fits(const struct backend_dev *be, const struct mm_part gu[2], const struct mm_part *down,
		    uint32_t dim, uint32_t ffn, const void *act)
{
	const uint32_t fa = gu[0].format, fb = down->format;
	if (!be->ffn_one || !be->dq_sm || gu[1].format != fa || !ffn_pair(fa, fb) || !qgemv_fuses_x(be, dim, gu, 2) ||
	    !qgemv_fits(be, fb, ffn, 1, down, 1) || !qgemv_integer(be, fb, ffn, act))
		return false;
	if (ffn_smem_of(fa, fb, dim, ffn) > DQ_SM_SMEM_MAX || gu[0].row_bytes % 16 || down->row_bytes % 16 ||
	    gu[1].row_bytes != gu[0].row_bytes)
		return false;
	return (uintptr_t)gu[0].w % 16 == 0 && (uintptr_t)gu[1].w % 16 == 0 && (uintptr_t)down->w % 16 == 0;
}

/* Pass p's claims for a launch of `grid` blocks: spans of at least `stages` items and about four
 * per warp, the counters of set `set` and their values now. */
static void ffn_claims_of(struct backend_dev *be, const qgemv_args &a, uint32_t items, uint32_t stages,
			  uint32_t grid, uint32_t set, uint32_t p, ffn_claims &c)
{
	const uint64_t warps = (uint64_t)grid * QG_WARPS;
	uint64_t sr = (stages + items - 1) / items, even = (a.total + 4 * warps - 1) / (4 * warps);
	c.span_rows = (uint32_t)(sr > even ? sr : even);
	c.spans = (a.total + c.span_rows - 1) / c.span_rows;
	c.ctr = be->ffn_ctr + (size_t)set * FFN_SET_WORDS + (size_t)p * FFN_QUEUES * FFN_LINE;
	for (uint32_t q = 0; q < FFN_QUEUES; q++)
		c.base[q] = be->ffn_base[set][p * FFN_QUEUES + q];
}

/* What a launch adds to pass p's counters and to the count of rows. */
static void ffn_claims_done(struct backend_dev *be, const ffn_claims &c, uint32_t grid, uint32_t set, uint32_t p)
{
	for (uint32_t q = 0; q < FFN_QUEUES; q++) {
		const uint32_t n = c.spans > q ? (c.spans - q + FFN_QUEUES - 1) / FFN_QUEUES : 0;
		be->ffn_base[set][p * FFN_QUEUES + q] += n + 2 * grid;
	}
}

template <int FA, int FB> static void ffn_launch_k(struct backend_dev *be, const qgemv_args &a, const qgemv_args &b,
						   cudaStream_t s)
{
	const size_t smem = ffn_smem<FA, FB>(a.in, b.in);
	const void *fn = (const void *)ffn_kernel<FA, FB>;
	uint32_t per = resident_blocks(be, fn, smem);
	const char *ev = getenv("PIPELINE_FFN_BLOCKS_PER_SM"); /* measurement only (temporary) */
	if (ev && atoi(ev) > 0 && (uint32_t)atoi(ev) < per)
		per = (uint32_t)atoi(ev);
	const uint32_t cap = (uint32_t)be->sm_count * per;
	const uint32_t want = a.groups > b.groups ? a.groups : b.groups, grid = want < cap ? want : cap;
	const uint32_t set = be->ffn_set;
	ffn_sync sy;
	memset(&sy, 0, sizeof(sy));
	ffn_claims_of(be, a, 2 * a.steps, dq_stages<FA>::V, grid, set, 0, sy.pass[0]); /* gate's and up's items */
	ffn_claims_of(be, b, b.steps, dq_stages<FB>::V, grid, set, 1, sy.pass[1]);
	sy.done = be->ffn_ctr + (size_t)set * FFN_SET_WORDS + (size_t)2 * FFN_QUEUES * FFN_LINE;
	sy.done_base = be->ffn_base[set][2 * FFN_QUEUES];
	launch_k(be->pdl, ffn_kernel<FA, FB>, grid, QG_THREADS, smem, s, a, b, sy);
	if (cudaPeekAtLastError() != cudaSuccess)
		return; /* not launched: the counters stay as they are (LAUNCHED reports it) */
	ffn_claims_done(be, sy.pass[0], grid, set, 0);
	ffn_claims_done(be, sy.pass[1], grid, set, 1);
	be->ffn_base[set][2 * FFN_QUEUES] += a.total;
	be->ffn_set = set ^ 1;
}

void qgemv_ffn_launch(struct backend_dev *be, uint32_t fa, uint32_t fb, qgemv_args &a, qgemv_args &b,
		      cudaStream_t s)
{
	assert(a.n == 1 && b.n == 1 && a.src.kind == XSRC_NORM && b.src.kind == XSRC_ACT && ffn_pair(fa, fb));
	qgemv_prepare(fa, a);
	qgemv_prepare(fb, b);
	if (fa == DT_Q4_K && fb == DT_Q4_K)
		ffn_launch_k<DT_Q4_K, DT_Q4_K>(be, a, b, s);
	else if (fa == DT_Q4_K)
		ffn_launch_k<DT_Q4_K, DT_Q6_K>(be, a, b, s);
	else if (fa == DT_Q8_0)
		ffn_launch_k<DT_Q8_0, DT_Q8_0>(be, a, b, s);
	else
		ffn_launch_k<DT_Q6_K, DT_Q6_K>(be, a, b, s);
}
