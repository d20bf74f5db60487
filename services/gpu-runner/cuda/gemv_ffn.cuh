/* gemv_ffn.cuh - a one-token FFN in one launch (included at the end of gemv_quant.cu, whose
 * integer path through shared memory it runs twice): act = SiLU(gate x) * (up x), x the RMSNorm of
 * the residual computed as it is staged, then residual += down act.
 *
 * The two products are dq_sm_pass one after the other in one grid, with a barrier of every block
 * (grid_sync) where a launch was. Before the barrier each warp issues the first items of its down
 * rows into its ring, so the weights keep coming while the last rows of gate/up finish and the
 * blocks wait for each other; a launch of its own could only start its first loads when the
 * blocks before it had left the multiprocessors. The next kernel is let launch after the barrier
 * (its blocks must not take the place of blocks of this grid that have yet to arrive), and the
 * grid is what fits the GPU at once, which the barrier needs.
 *
 * A row's sum is what it is in two launches (one warp, the same items in the same order, the
 * same x), so the result is the same bits; only which warp takes a row differs. The barrier word
 * (backend_dev.ffn_bar) serves every such launch of the backend's one stream in turn. */

/* The formats that go together (gate/up, down): those of Q4_K_M (Q4_K with a Q4_K or Q6_K
 * down), Q8_0 and Q6_K files. */
static inline bool ffn_pair(uint32_t fa, uint32_t fb)
{
	return (fa == DT_Q4_K && (fb == DT_Q4_K || fb == DT_Q6_K)) || (fa == DT_Q8_0 && fb == DT_Q8_0) ||
	       (fa == DT_Q6_K && fb == DT_Q6_K);
}

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

/* Four blocks a multiprocessor, as a down projection takes on its own: with three, 4096 down rows
 * over 3168 warps would leave a third of the warps two rows. */
template <int FA, int FB>
__global__ void __launch_bounds__(QG_THREADS, 4) ffn_kernel(const qgemv_args a, const qgemv_args b, unsigned *bar)
{
	extern __shared__ uint4 dq_smem_buf[];
	uint8_t *smem = (uint8_t *)dq_smem_buf;
	const size_t xbytes = ffn_xbytes<FA, FB>(a.in, b.in);
	dq_sm_pass<FA, GEMV_SWIGLU, DQ_FIRST>(a, smem, xbytes, ffn_ring<FA, FB>::V, NULL);
	dq_sm_pass<FB, GEMV_ADD, DQ_GRID>(b, smem, xbytes, ffn_ring<FA, FB>::V, bar);
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
 * each alone), x of gate/up from src. */
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

template <int FA, int FB> static void ffn_launch_k(struct backend_dev *be, const qgemv_args &a, const qgemv_args &b,
						   cudaStream_t s)
{
	const size_t smem = ffn_smem<FA, FB>(a.in, b.in);
	const void *fn = (const void *)ffn_kernel<FA, FB>;
	const uint32_t cap = (uint32_t)be->sm_count * resident_blocks(be, fn, smem);
	const uint32_t want = a.groups > b.groups ? a.groups : b.groups;
	launch_k(be->pdl, ffn_kernel<FA, FB>, want < cap ? want : cap, QG_THREADS, smem, s, a, b, be->ffn_bar);
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
