// Attention metadata of the core step (docs/attention.md): the device code of the metadata
// blocks that the step kernels (step.cuh) run after their token blocks when
// KvStepParams::attention != 0. Three designs, one per step kernel:
//   * kv_meta_block (step_multiblock): request-parallel blocks, any batch size;
//   * kv_meta_small (step_small_attention): bsz <= blockDim.x, a request per thread;
//   * kv_meta_wide (step_wide_attention): bsz <= R x blockDim.x, R requests per thread.
// All three write the same outputs and the same error records (bits 1, 2, 16 and their keys).

#define KV_META_U 16    // row entries in flight per lane in the row copies
#define KV_META_R 4     // kv_meta_block's length pass: requests in flight per thread and array (scalar loads)
#define KV_META_RV 2    // kv_meta_block's length pass: int4 loads in flight per thread and array
#define KV_META_PRE 16  // kv_meta_small / kv_meta_wide: row columns per lane loaded before the barrier
#define KV_META_LANES 32  // kv_meta_block: lanes per request in the row copy (a warp per request)

// kv_meta_block's shared memory.
struct __align__(16) KvMetaShared {
    int start[KV_THREADS];         // first kv_indices entry of each staged request (saturated)
    int pages[KV_THREADS];         // its pages
    int token[KV_THREADS];         // its first token (cu_seqlens_q, the error key's token)
    int red[7][KV_WARPS];          // per-warp partial sums / maxima of pass 1, then warp sums of the scan
    int x[3][KV_THREADS];          // a round's (tokens, L, pages), then their exclusive in-warp prefixes
    int carry[3];                  // prefixes (tokens, L, pages) of the requests before the round
    int total;                     // total pages of the cache (pass 1), read by the pad
};

// ---- request-parallel metadata blocks (step_multiblock) ----
//
// With attention outputs asked for, step_multiblock's grid has num_meta more blocks after the
// token blocks. They take no ticket and wait for no block: each reads the lengths itself.
// Metadata block m works for cache g = m / meta_per_cache (cache 0 only for varlen alone) and
// k = m % meta_per_cache, and owns the requests [r0, r1) (rq = ceil(bsz / meta_per_cache) per
// block) and the kv_indices entries [k * E, min((k + 1) * E, N)) of the pad:
//   1. one register pass over all lengths (striped, coalesced, 8 loads in flight per
//      thread and array, no shared-memory pass): the saturating sums of tokens, L_b and
//      pages of the requests before its range [r0, r1) (rq = ceil(bsz / meta_per_cache)
//      requests per block), the total pages and the maxima; one barrier reduces them;
//   2. its own requests, KV_THREADS at a time: one per thread, a block scan (warp
//      shuffles + warp sums, one barrier) gives each its absolute prefixes; the thread
//      writes kv_indptr, kv_last_page_len, cu_seqlens_k and checks bits 1 and 16 (keyed
//      at the request's first token) and stages (first page, pages, first token) in shared memory;
//   3. a warp (KV_META_LANES lanes) copies one request's row prefix,
//      entries [first page, min(first page + pages, N)): consecutive lanes, consecutive
//      columns (coalesced row reads and writes, no search), KV_META_U loads in flight per
//      lane; a column >= W_g gives -1 (bit 1 is the request's), a negative id -1 and bit 2;
//   4. the pad: entries [max(k * E, total), min((k + 1) * E, N)) get -1 (fixed entry
//      ranges: every element of kv_indices written on every call);
//   5. k = 0 writes entry bsz of kv_indptr / cu_seqlens_k (the totals of pass 1), block 0 the maxima.
// Nothing is read past a table row (column < W_g) or written past entry N - 1. No state is kept
// between launches.

// Pass 1 of kv_meta_block, per thread: saturating sums of tokens, L and pages of the
// requests before r0 (bq, bl, bp), of all L and pages (tl, tp), and the maxima (mq, ml).
struct KvMetaAcc {
    int bq, bl, bp, tl, tp, mq, ml;
    // POW2: B = 1 << sh (pages by a shift, not a division; the common block sizes).
    // VL: the block writes varlen outputs (cache 0 with varlen): only then are bl, tl and the
    // maxima read, so only then accumulated (they stay 0 otherwise).
    template <bool POW2, bool VL>
    __device__ __forceinline__ void add(int d, int n, int b, int r0, int B, int sh) {
        const bool bad = (d < 0) | (n < 0);
        const int nn = bad ? 0 : n;
        const int L = bad ? 0 : kv_sat_add_nn(d, n);
        const int P = POW2 ? (int)(((unsigned int)L + (unsigned int)(B - 1)) >> sh) : kv_pages(L, B);
        if (b < r0) {
            bq = kv_sat_add_nn(bq, nn);
            if (VL) bl = kv_sat_add_nn(bl, L);
            bp = kv_sat_add_nn(bp, P);
        }
        tp = kv_sat_add_nn(tp, P);
        if (VL) {
            tl = kv_sat_add_nn(tl, L);
            mq = max(mq, nn);
            ml = max(ml, L);
        }
    }
};

// Saturating sum over the lanes of a warp (butterfly: every lane gets the sum).

// Pass 1 of kv_meta_block: one pass over all bsz lengths in registers (striped,
// coalesced; int4 loads when both length arrays are 16-byte aligned, then the bsz % 4
// tail), accumulated into acc (this thread's part; the caller reduces across threads).
template <bool POW2, bool VL>
__device__ __forceinline__ void kv_meta_length_pass_t(const KvStepParams& p, int bsz, int r0, int B, int sh,
                                                KvMetaAcc& acc) {
    const int tid = threadIdx.x;
    acc.bq = acc.bl = acc.bp = acc.tl = acc.tp = acc.mq = acc.ml = 0;
    int scalar_from = 0;
    if (((reinterpret_cast<u64>(p.seq_lens_decoder) | reinterpret_cast<u64>(p.seq_lens_this_time)) & 15ULL) == 0) {
        const int nv = bsz >> 2;
        const int4* __restrict__ d4 = reinterpret_cast<const int4*>(p.seq_lens_decoder);
        const int4* __restrict__ n4 = reinterpret_cast<const int4*>(p.seq_lens_this_time);
#pragma unroll 1
        for (int v0 = 0; v0 < nv; v0 += KV_META_RV * KV_THREADS) {
            int4 d[KV_META_RV], n[KV_META_RV];
#pragma unroll
            for (int u = 0; u < KV_META_RV; ++u) {
                const int v = v0 + u * KV_THREADS + tid;
                d[u] = make_int4(0, 0, 0, 0);
                n[u] = make_int4(0, 0, 0, 0);
                if (v < nv) {
                    d[u] = __ldg(d4 + v);
                    n[u] = __ldg(n4 + v);
                }
            }
#pragma unroll
            for (int u = 0; u < KV_META_RV; ++u) {  // zeros past nv add nothing
                const int b = 4 * (v0 + u * KV_THREADS + tid);
                acc.add<POW2, VL>(d[u].x, n[u].x, b, r0, B, sh);
                acc.add<POW2, VL>(d[u].y, n[u].y, b + 1, r0, B, sh);
                acc.add<POW2, VL>(d[u].z, n[u].z, b + 2, r0, B, sh);
                acc.add<POW2, VL>(d[u].w, n[u].w, b + 3, r0, B, sh);
            }
        }
        scalar_from = nv << 2;
    }
#pragma unroll 1
    for (int b0 = scalar_from; b0 < bsz; b0 += KV_META_R * KV_THREADS) {
        int d[KV_META_R], n[KV_META_R];
#pragma unroll
        for (int u = 0; u < KV_META_R; ++u) {
            const int b = b0 + u * KV_THREADS + tid;
            d[u] = 0;
            n[u] = 0;
            if (b < bsz) {
                d[u] = __ldg(p.seq_lens_decoder + b);
                n[u] = __ldg(p.seq_lens_this_time + b);
            }
        }
#pragma unroll
        for (int u = 0; u < KV_META_R; ++u) acc.add<POW2, VL>(d[u], n[u], b0 + u * KV_THREADS + tid, r0, B, sh);
    }
}

// Pass 1 with the pages by a shift when B is a power of two (a uniform branch), else a
// division; the varlen sums (bl, tl) and maxima only for a block that writes varlen outputs
// (varlen: cache 0 with KV_ATTN_VARLEN); else they are 0.
__device__ __forceinline__ void kv_meta_length_pass(const KvStepParams& p, int bsz, int r0, int B, bool varlen,
                                              KvMetaAcc& acc) {
    if ((B & (B - 1)) == 0) {
        if (varlen) kv_meta_length_pass_t<true, true>(p, bsz, r0, B, __ffs(B) - 1, acc);
        else kv_meta_length_pass_t<true, false>(p, bsz, r0, B, __ffs(B) - 1, acc);
    } else {
        if (varlen) kv_meta_length_pass_t<false, true>(p, bsz, r0, B, 0, acc);
        else kv_meta_length_pass_t<false, false>(p, bsz, r0, B, 0, acc);
    }
}

// One request-parallel metadata block m (of num_meta), num_chunks token chunks before it.
__device__ __forceinline__ void kv_meta_block(KvMetaShared& sm, const KvStepParams& p, int m, int num_chunks) {
    KvErr err;
    err.mask = 0u;
    err.key = KV_NO_ERROR;
    const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
    const int bsz = p.bsz, N = p.kv_indices_capacity;
    const int g = m / p.meta_per_cache, k = m - g * p.meta_per_cache;
    const bool fi = (p.attention & KV_ATTN_FLASHINFER) != 0;
    const bool varlen = (p.attention & KV_ATTN_VARLEN) != 0 && g == 0;
    const bool rows = (p.attention & (KV_ATTN_FLASHINFER | KV_ATTN_PAGE_TABLE)) != 0 && p.num_caches > 0;
    const int* table;
    i64 stride;
    int width, B;
    kv_meta_cache(p, g, table, stride, width, B);
    const int rq = (bsz + p.meta_per_cache - 1) / p.meta_per_cache;
    const int r0 = (int)min((i64)k * rq, (i64)bsz), r1 = min(r0 + rq, bsz);
    // 1. sums before r0, total pages, maxima (one pass over all lengths, in registers)
    KvMetaAcc acc;
    kv_meta_length_pass(p, bsz, r0, B, varlen, acc);
    int bq = acc.bq, bl = acc.bl, bp = acc.bp, tl = acc.tl, tp = acc.tp, mq = acc.mq, ml = acc.ml;
    bq = kv_warp_sat_sum(bq);
    bl = kv_warp_sat_sum(bl);
    bp = kv_warp_sat_sum(bp);
    tl = kv_warp_sat_sum(tl);
    tp = kv_warp_sat_sum(tp);
    mq = __reduce_max_sync(0xffffffffu, mq);
    ml = __reduce_max_sync(0xffffffffu, ml);
    if (lane == 0) {
        sm.red[0][warp] = bq;
        sm.red[1][warp] = bl;
        sm.red[2][warp] = bp;
        sm.red[3][warp] = tp;
        sm.red[4][warp] = mq;
        sm.red[5][warp] = ml;
        sm.red[6][warp] = tl;
    }
    __syncthreads();
    // block-uniform: prefixes (tokens, L, pages) before the next staged request; total L and pages
    int cq = 0, cl = 0, cp = 0, total_l = 0, total = 0;
    mq = 0;
    ml = 0;
#pragma unroll
    for (int i = 0; i < KV_WARPS; ++i) {
        cq = kv_sat_add(cq, sm.red[0][i]);
        cl = kv_sat_add(cl, sm.red[1][i]);
        cp = kv_sat_add(cp, sm.red[2][i]);
        total = kv_sat_add(total, sm.red[3][i]);
        total_l = kv_sat_add(total_l, sm.red[6][i]);
        mq = max(mq, sm.red[4][i]);
        ml = max(ml, sm.red[5][i]);
    }
    if (tid == 0) {  // read after the barriers below
        sm.total = total;
        sm.carry[0] = cq;
        sm.carry[1] = cl;
        sm.carry[2] = cp;
    }
    const i64 row_off = (i64)g * p.attn_stride;
    // 5. entry bsz, the maxima (before the barriers below: sm.red is reused)
    if (k == 0 && tid == 0) {
        if (fi) p.kv_indptr[row_off + bsz] = total;
        if (varlen) p.cu_seqlens_k[bsz] = total_l;
    }
    if (varlen && m == 0 && tid == 0) {
        p.max_seqlen[0] = mq;
        p.max_seqlen[1] = ml;
    }
    // 2. + 3. this block's requests, KV_THREADS at a time
    const int lanes = KV_META_LANES, group = tid / lanes, sub = tid - group * lanes;
    const int groups = KV_THREADS / lanes;
    int* __restrict__ out = p.kv_indices + (i64)g * N;
#pragma unroll 1
    for (int c0 = r0; c0 < r1; c0 += KV_THREADS) {
        const int cnt = min(KV_THREADS, r1 - c0);
        const int b = c0 + tid;
        int nn = 0, L = 0;
        if (tid < cnt) {
            const int d = __ldg(p.seq_lens_decoder + b), n = __ldg(p.seq_lens_this_time + b);
            const bool bad = (d < 0) | (n < 0);
            nn = bad ? 0 : n;
            L = bad ? 0 : kv_sat_add(d, n);
        }
        const int P = kv_pages(L, B);
        __syncthreads();  // the last round's sm.x, sm.red and staged requests are no longer read
        sm.x[0][tid] = nn;
        sm.x[1][tid] = L;
        sm.x[2][tid] = P;
        // block scan of (tokens, L, pages), one at a time (few live registers): warp
        // shuffles, the warp totals in sm.red, the exclusive in-warp prefix back in sm.x
#pragma unroll 1
        for (int v = 0; v < 3; ++v) {
            const int inc = kv_warp_inclusive(sm.x[v][tid]);
            if (lane == 31) sm.red[v][warp] = inc;
            const int ex = __shfl_up_sync(0xffffffffu, inc, 1);  // exact (a saturated sum minus a part is not)
            sm.x[v][tid] = lane == 0 ? 0 : ex;
        }
        __syncthreads();
        int before, T;
        kv_warp_prefix(sm.red[0], warp, before, T);
        const int xq = kv_sat_add(sm.carry[0], kv_sat_add(before, sm.x[0][tid]));  // absolute exclusive prefixes
        kv_warp_prefix(sm.red[1], warp, before, T);
        const int xl = kv_sat_add(sm.carry[1], kv_sat_add(before, sm.x[1][tid]));
        kv_warp_prefix(sm.red[2], warp, before, T);
        const int xp = kv_sat_add(sm.carry[2], kv_sat_add(before, sm.x[2][tid]));
        if (tid < cnt) {
            if (fi) {
                p.kv_indptr[row_off + b] = xp;
                p.kv_last_page_len[row_off + b] = L > 0 ? (int)((unsigned int)(L - 1) % (unsigned int)B) + 1 : 0;
                if (xp <= N && N < kv_sat_add(xp, P)) err.flag(KV_ERR_KV_INDICES_CAPACITY, xq, b, g);
            }
            if (rows && P > width) err.flag(KV_ERR_BLOCK_INDEX, xq, b, g);
            if (varlen) p.cu_seqlens_k[b] = xl;
            sm.start[tid] = xp;
            sm.pages[tid] = P;
            sm.token[tid] = xq;
        }
        __syncthreads();  // staged; every thread has read sm.carry
        if (tid < 3) {    // the next round's carries (read after its second barrier)
            kv_warp_prefix(sm.red[tid], 0, before, T);
            sm.carry[tid] = kv_sat_add(sm.carry[tid], T);
        }
        if (!fi) continue;
#pragma unroll 1
        for (int i = group; i < cnt; i += groups) {
            const int s0 = sm.start[i];
            const int end = s0 < N ? min(sm.pages[i], N - s0) : 0;  // entries of this row below N
            const int rb = c0 + i;
            const int* __restrict__ row = table + (i64)rb * stride;
#pragma unroll 1
            for (int col0 = sub; col0 < end; col0 += KV_META_U * lanes) {
                int v[KV_META_U];
#pragma unroll
                for (int u = 0; u < KV_META_U; ++u) {
                    const int col = col0 + u * lanes;
                    v[u] = -1;
                    if (col < end && col < width) v[u] = __ldg(row + col);
                }
#pragma unroll
                for (int u = 0; u < KV_META_U; ++u) {
                    const int col = col0 + u * lanes;
                    if (col < end) {
                        if (col < width && v[u] < 0) err.flag(KV_ERR_NEGATIVE_BLOCK, sm.token[i], rb, g);
                        out[s0 + col] = v[u] < 0 ? -1 : v[u];
                    }
                }
            }
        }
    }
    // 4. the pad of this block's fixed entry range
    if (fi) {
        __syncthreads();  // sm.total (when this block had no requests, no barrier since pass 1)
        const int e_lo = (int)min((i64)k * p.meta_entries, (i64)N);
        const int e_hi = (int)min((i64)e_lo + p.meta_entries, (i64)N);
#pragma unroll 1
        for (int e = max(e_lo, sm.total) + tid; e < e_hi; e += KV_THREADS) out[e] = -1;
    }
    kv_store_errors(err, p.error_records, num_chunks + p.max_tiles + m);
}

// ---- metadata blocks of the small-batch step (step_small_attention; docs/attention.md, "Small batches") ----
//
// step_small_attention<G, PosT>, G = 0..4 caches: for bsz <= KV_THREADS requests with attention
// outputs on. The first ceil(C / T) blocks are step_small's token blocks (T threads, T >= bsz,
// T <= KV_THREADS); the M = gridDim.x - ceil(C / T) blocks after them are metadata blocks
// (kv_meta_small), counted from the grid's end (mr = gridDim.x - 1 - blockIdx.x), the planner's
// choice of M: G x K with flashinfer or page_table (block mr is cache g = mr % G, block
// k = mr / G of it; it owns requests [k rq, k rq + rq), rq = T / 32 when K x T / 32 >= bsz, else
// ceil(bsz / K), and kv_indices[g]'s pad range [k ceil(N / K), (k + 1) ceil(N / K))), else 1
// (varlen alone). Because T >= bsz, a metadata block holds every request in registers, one per
// thread, and a warp copies a request's row:
//   1. ONE round trip: thread i loads request i's lengths; each warp also loads its first own
//      request's first KV_META_PRE x 32 row columns (columns < W_g: the addresses and the
//      bound need no length; columns past the row's pages are loaded and dropped);
//   2. three warp-shuffle scans (tokens, L, pages), the warp totals and maxima to shared
//      memory, ONE barrier: thread i then has request i's absolute prefixes;
//   3. the loaded columns are stored (bit 2 for a negative id), thread i writes request i's
//      kv_indptr, kv_last_page_len and cu_seqlens_k when i is the block's (bits 1 and 16,
//      keyed at its first token), the rest of the rows are copied (columns past the loaded
//      ones, further requests of a warp), the block's pad range written with int4 stores;
//      block k = 0 writes entry bsz, block k = 0 of cache 0 the maxima.
// Outputs and error records (bits 1, 2, 16 and their first-bad keys) are kv_meta_block's.
// Error records: every block (token or metadata) merges into records blockIdx.x * T / 32 + warp,
// only from a warp with an error (sticky, kv_merge_record: nothing to clear when switching
// between this kernel, step_multiblock and step_small; the host clears after reading).

struct __align__(16) KvMetaSmallShared {
    int x[2][KV_THREADS];   // in-warp exclusive prefixes of request i: [0] tokens (error keys), [1] pages
    int pages[KV_THREADS];  // pages of request i in this block's cache
    int red[5][KV_WARPS];   // per-warp totals (tokens, L, pages) and maxima (tokens, L); rows 16-byte aligned
};

// The errors of one warp into record i = blockIdx.x * (blockDim.x / 32) + warp (sticky).
__device__ __forceinline__ void kv_store_block_record(const KvStepParams& p, KvErr err) {
    kv_merge_record(p.error_records, (i64)blockIdx.x * (blockDim.x >> 5) + (threadIdx.x >> 5), err);
}

// Entries [lo, hi) of out set to -1 (PAD_PAGE_ID): scalar head to a 16-byte boundary, int4 body, tail.
__device__ __forceinline__ void kv_pad_entries(int* __restrict__ out, int lo, int hi) {
    if (lo >= hi) return;
    const int tid = threadIdx.x, T = blockDim.x;
    const int head = (int)(((16u - ((unsigned int)(u64)(out + lo) & 15u)) & 15u) >> 2);
    const int a = min(lo + head, hi);
    if (lo + tid < a) out[lo + tid] = -1;
    const int nv = (hi - a) >> 2;
    int4* __restrict__ v = reinterpret_cast<int4*>(out + a);
#pragma unroll 1
    for (int i = tid; i < nv; i += T) v[i] = make_int4(-1, -1, -1, -1);
    const int e = a + 4 * nv + tid;
    if (e < hi) out[e] = -1;
}

// Inclusive warp scan of non-negative values, saturating at KV_INT_MAX (one add and one min a step).
__device__ __forceinline__ int kv_warp_inclusive_nn(int x) {
    const int lane = threadIdx.x & 31;
#pragma unroll
    for (int off = 1; off < 32; off <<= 1) {
        const int y = __shfl_up_sync(0xffffffffu, x, off);
        if (lane >= off) x = kv_sat_add_nn(x, y);
    }
    return x;
}

// The KV_WARPS per-warp values of one row of KvMetaSmallShared::red, as two int4 broadcasts (the
// entries of warps that do not exist are read and never used: the sums below mask them).
__device__ __forceinline__ void kv_read_warp_values(const int* r, int (&w)[KV_WARPS]) {
    static_assert(KV_WARPS == 8, "two int4s per row of red");
    const int4 a = *reinterpret_cast<const int4*>(r), b = *reinterpret_cast<const int4*>(r + 4);
    w[0] = a.x; w[1] = a.y; w[2] = a.z; w[3] = a.w;
    w[4] = b.x; w[5] = b.y; w[6] = b.z; w[7] = b.w;
}

// Sum (saturating; MAX: maximum) of w[0..i) for non-negative w, 0 for i = 0: independent
// selects, then a tree.
template <bool MAX = false>
__device__ __forceinline__ int kv_sum_warps_before(const int (&w)[KV_WARPS], int i) {
    int s[KV_WARPS];
#pragma unroll
    for (int j = 0; j < KV_WARPS; ++j) s[j] = j < i ? w[j] : 0;
#pragma unroll
    for (int h = 1; h < KV_WARPS; h <<= 1)
#pragma unroll
        for (int j = 0; j + h < KV_WARPS; j += 2 * h) s[j] = MAX ? max(s[j], s[j + h]) : kv_sat_add_nn(s[j], s[j + h]);
    return s[0];
}

// The first token of request b (in warp wi of the block): the key of its error records. Only
// on the path that flags an error (it reads shared memory again).
__device__ __forceinline__ int kv_first_token_of(const KvMetaSmallShared& sm, int wi, int b) {
    int rt[KV_WARPS];
    kv_read_warp_values(sm.red[0], rt);
    return kv_sat_add_nn(kv_sum_warps_before(rt, wi), sm.x[0][b]);
}

// ceil(L / B) for 0 <= L <= 2^31 - 1: a shift when B = 1 << sh, else B's reciprocal rcp = (2^32 - 1) / B.
__device__ __forceinline__ int kv_ceil_pages(int L, unsigned int uB, bool pow2, int sh, unsigned int rcp) {
    const unsigned int x = (unsigned int)L + (uB - 1u);  // < 2^32
    unsigned int q = pow2 ? x >> sh : __umulhi(x, rcp);
    if (!pow2 && x - q * uB >= uB) ++q;  // rcp underestimates 2^32 / B: at most one short
    return (int)q;
}

// Columns [col_from, end) (step 32, lane's own) of a row into o (entries below width from the row, -1
// past it); true if one of them is a negative block id.
__device__ __forceinline__ bool kv_copy_row_cols(const int* __restrict__ row, int width, int* __restrict__ o,
                                                 int col_from, int end) {
    bool neg = false;
#pragma unroll 1
    for (int col0 = col_from; col0 < end; col0 += KV_META_U * 32) {
        int w[KV_META_U];
#pragma unroll
        for (int u = 0; u < KV_META_U; ++u) {
            const int col = col0 + u * 32;
            w[u] = -1;
            if (col < end && col < width) w[u] = __ldg(row + col);
        }
#pragma unroll
        for (int u = 0; u < KV_META_U; ++u) {
            const int col = col0 + u * 32;
            if (col < end) o[col] = max(w[u], -1);
            neg |= (col < end) & (col < width) & (w[u] < 0);
        }
    }
    return neg;
}

// The rows past the loaded columns: request b0's columns from KV_META_PRE x 32 on, then requests
// b0 + warps, b0 + 2 warps, ... below r1 (kv_indices entries below N only).
__device__ __forceinline__ void kv_copy_rest_rows(const KvMetaSmallShared& sm, const KvStepParams& p, const int* table,
                                              i64 stride, int width, int g, int b0, int r1,
                                              int* __restrict__ out, KvErr& err) {
    const int lane = threadIdx.x & 31, warps = blockDim.x >> 5, N = p.kv_indices_capacity;
    int rp[KV_WARPS];
    kv_read_warp_values(sm.red[2], rp);
#pragma unroll 1
    for (int b = b0; b < r1; b += warps) {
        const int wi = b >> 5;
        const int s0 = kv_sat_add_nn(kv_sum_warps_before(rp, wi), sm.x[1][b]);
        const int col_from = b == b0 ? lane + KV_META_PRE * 32 : lane;
        const int end = s0 < N ? min(sm.pages[b], N - s0) : 0;  // entries of this row below N
        if (kv_copy_row_cols(table + (i64)b * stride, width, out + s0, col_from, end))
            err.flag(KV_ERR_NEGATIVE_BLOCK, kv_first_token_of(sm, wi, b), b, g);
    }
}

// v[u] = row[32 u] for 32 u < cols, else -1 (row: a global address; ld.global.nc, immediate offsets).
__device__ __forceinline__ void kv_row_prefix_loads(u64 row, int cols, int (&v)[KV_META_PRE]) {
#pragma unroll
    for (int u = 0; u < KV_META_PRE; ++u) {
        v[u] = -1;
#ifdef __CUDA_ARCH__
        if (32 * u < cols) asm("ld.global.nc.b32 %0, [%1];" : "=r"(v[u]) : "l"(row + 128u * u));
#endif
    }
}

// Metadata block (g, k) of step_small_attention: T = blockDim.x >= bsz threads (see the section
// comment).
//
// Written for the length of one warp's dependent chain (a metadata block's time is its
// instruction latency, not its memory traffic; docs/perf-notes.md):
//   * the metadata blocks are counted from the grid's end, mr = gridDim.x - 1 - blockIdx.x, and
//     block mr is (g, k) = (mr % G, mr / G) (G is a compile-time constant): no division before
//     the first loads. The lengths are the first loads; the row loads follow at once, for the
//     first request the usual geometry gives the warp (k x warps + warp, see rq below), while
//     the real geometry (three 32-bit divisions) is made during the round trip; when it differs
//     (a planner forcing fewer blocks) the rows are loaded again, still before the barrier;
//   * pages by a shift when B is a power of two, else by B's reciprocal made at entry;
//   * after the one barrier every shared word is read once into registers (before any global
//     store, which the compiler could not tell from a shared one), every prefix is a masked tree
//     over those per-warp totals, and the token sums that key the error records are made only
//     on the path that flags an error.
// Requests: block k owns [k rq, k rq + rq), rq = warps when K x warps >= bsz (the planner's
// geometry: a warp per request), else ceil(bsz / K); its pad range is [k ceil(N / K), ...).
template <int G>
__device__ __forceinline__ void kv_meta_small(const KvStepParams& p) {
    __shared__ KvMetaSmallShared sm;
    const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5, T = blockDim.x;
    const int bsz = p.bsz;
    // 1. request tid's lengths: the first loads (their addresses need nothing)
    int d = 0, n = 0;
    if (tid < bsz) {
        d = __ldg(p.seq_lens_decoder + tid);
        n = __ldg(p.seq_lens_this_time + tid);
    }
    KvErr err;
    err.mask = 0u;
    err.key = KV_NO_ERROR;
    const int N = p.kv_indices_capacity;
    const bool fi = G > 0 && (p.attention & KV_ATTN_FLASHINFER) != 0;  // (the planner refuses flashinfer without caches)
    const bool rows = G > 0 && (p.attention & (KV_ATTN_FLASHINFER | KV_ATTN_PAGE_TABLE)) != 0;
    // 2. this block's cache and request range, counted from the grid's end (no division)
    const int mr = (int)(gridDim.x - 1u - blockIdx.x);
    const int g = G > 1 && rows ? mr % G : 0, k = G > 1 && rows ? mr / G : mr;
    const bool varlen = (p.attention & KV_ATTN_VARLEN) != 0 && g == 0;
    const int* table = nullptr;
    i64 stride = 0;
    int width = 1, B = 1;
    if (G > 0) kv_meta_cache(p, g, table, stride, width, B);
    const int warps = T >> 5;
    // 3. the row of the warp's first request under the usual geometry (rq = warps), loaded now: its
    // first KV_META_PRE x 32 columns below the width (the addresses and the bound need no length;
    // columns past the row's pages are loaded and dropped). One global row address, immediate offsets.
    int b0 = k * warps + warp;
    int v[KV_META_PRE];
    kv_row_prefix_loads(kv_global_addr(table) + 4u * (u64)((i64)b0 * stride + lane), fi && b0 < bsz ? width - lane : 0, v);
    // 4. the real geometry while the loads fly: M = G x K metadata blocks with rows (else 1)
    const unsigned int uT = (unsigned int)T, uC = (unsigned int)p.capacity;  // C <= 2^31 - 2: C + T - 1 < 2^32
    const int M = (int)gridDim.x - (int)((uC + uT - 1u) / uT);
    const int K = rows ? max(M / (G > 0 ? G : 1), 1) : 1;  // blocks per cache
    const unsigned int uK = (unsigned int)K;
    const int rq = K * warps >= bsz ? warps : (int)(((unsigned int)bsz + uK - 1u) / uK);
    const int r0 = min(k * rq, bsz), r1 = min(r0 + rq, bsz);
    // B's division: a shift for a power of two, else floor((2^32 - 1) / B); the pad range's length
    const unsigned int uB = (unsigned int)B;
    const bool pow2 = (uB & (uB - 1u)) == 0u;
    const int sh = __ffs(B) - 1;
    const unsigned int rcp = pow2 ? 0u : 0xffffffffu / uB;
    const unsigned int chunk = kv_pin((int)(((unsigned int)N + uK - 1u) / uK));
    // 5. (lengths arrived) tokens, L and pages; three warp scans, the maxima; one barrier
    const bool bad = (d < 0) | (n < 0);
    const int nn = bad ? 0 : n, L = bad ? 0 : kv_sat_add_nn(d, n);
    int P = 0;
    if (G > 0) P = kv_ceil_pages(L, uB, pow2, sh, rcp);
    const int iq = kv_warp_inclusive_nn(nn), il = kv_warp_inclusive_nn(L), ip = kv_warp_inclusive_nn(P);
    // (every lane shuffles: a full-mask shuffle inside "lane == 0 ? 0 : ..." would wait for lane 0 forever)
    const int eq = __shfl_up_sync(0xffffffffu, iq, 1), el = __shfl_up_sync(0xffffffffu, il, 1),
              ep = __shfl_up_sync(0xffffffffu, ip, 1);
    const int xq = lane == 0 ? 0 : eq, xl = lane == 0 ? 0 : el, xp = lane == 0 ? 0 : ep;
    sm.x[0][tid] = xq;
    sm.x[1][tid] = xp;
    sm.pages[tid] = P;
    {
        const int mq = __reduce_max_sync(0xffffffffu, nn), ml = __reduce_max_sync(0xffffffffu, L);
        if (lane == 31) {
            sm.red[0][warp] = iq;
            sm.red[1][warp] = il;
            sm.red[2][warp] = ip;
            sm.red[3][warp] = mq;
            sm.red[4][warp] = ml;
        }
    }
    // (tested here, not where rq is made: ptxas would otherwise issue the divisions before the row
    // loads above to reach this branch sooner)
    if (rq != warps) {  // (uniform) a geometry the planner does not make by default: the right row
        b0 = r0 + warp;
        kv_row_prefix_loads(kv_global_addr(table) + 4u * (u64)((i64)b0 * stride + lane), fi && b0 < r1 ? width - lane : 0, v);
    }
    __syncthreads();  // the only barrier: nothing in shared memory is written after it
    // 6. every shared word this thread needs, into registers before any global store
    const bool mine = b0 < r1;  // the warp has a request (b0 >= r0 always)
    int rp[KV_WARPS], rl[KV_WARPS];
    kv_read_warp_values(sm.red[2], rp);
    kv_read_warp_values(sm.red[1], rl);
    const int xb = mine ? sm.x[1][b0] : 0, pb = mine ? sm.pages[b0] : 0;
    int* __restrict__ out = p.kv_indices + (i64)g * N;
    const int total = kv_sum_warps_before(rp, warps);  // kv_indptr[g, bsz] (rows' pages; 0 without caches)
    // 7. the loaded columns of the warp's first request (one negative-id flag per row)
    if (fi && mine) {
        const int wi = b0 >> 5;
        const int s0 = kv_sat_add_nn(kv_sum_warps_before(rp, wi), xb);
        const int end = s0 < N ? min(pb, N - s0) : 0, ew = min(end, width);
        int* __restrict__ o = out + s0;
        if (G > 1) {  // (measured faster with two caches, slower with one, as ptxas schedules them)
            int any = 0;  // OR of the stored values: negative iff some stored column is negative
#pragma unroll
            for (int u = 0; u < KV_META_PRE; ++u) {
                const int col = lane + 32 * u;
                if (col < end) {
                    o[col] = max(v[u], -1);
                    any |= v[u];
                }
            }
            if (any < 0) {  // a negative id, or a column past the width (-1, bit 1's): the exact test
                bool neg = false;
#pragma unroll
                for (int u = 0; u < KV_META_PRE; ++u) neg |= (lane + 32 * u < ew) & (v[u] < 0);
                if (neg) err.flag(KV_ERR_NEGATIVE_BLOCK, kv_first_token_of(sm, wi, b0), b0, g);
            }
        } else {
            bool neg = false;
#pragma unroll
            for (int u = 0; u < KV_META_PRE; ++u) {
                const int col = lane + 32 * u;
                if (col < end) o[col] = max(v[u], -1);
                neg |= (col < ew) & (v[u] < 0);
            }
            if (neg) err.flag(KV_ERR_NEGATIVE_BLOCK, kv_first_token_of(sm, wi, b0), b0, g);
        }
    }
    // 8. request tid (when it is this block's): per-request outputs, bits 1 and 16
    const i64 row_off = (i64)g * p.attn_stride;
    if (tid >= r0 && tid < r1) {
        bool cap = false;
        if (fi) {
            const int at = kv_sat_add_nn(kv_sum_warps_before(rp, warp), xp);
            p.kv_indptr[row_off + tid] = at;
            // P = ceil(L / B) (G > 0 with flashinfer), so L - (P - 1) B = (L - 1) % B + 1 for L > 0
            p.kv_last_page_len[row_off + tid] = L > 0 ? L - (P - 1) * B : 0;
            cap = at <= N && N < kv_sat_add_nn(at, P);
        }
        if (varlen) p.cu_seqlens_k[tid] = kv_sat_add_nn(kv_sum_warps_before(rl, warp), xl);
        const bool wide = rows && P > width;
        if (cap | wide) {  // the key: the request's first token
            const int tok = kv_first_token_of(sm, warp, tid);
            if (cap) err.flag(KV_ERR_KV_INDICES_CAPACITY, tok, tid, g);
            if (wide) err.flag(KV_ERR_BLOCK_INDEX, tok, tid, g);
        }
    }
    if (tid == 0 && k == 0) {  // entry bsz (block k = 0 of each cache), the maxima (block k = 0 of cache 0)
        if (fi) p.kv_indptr[row_off + bsz] = total;
        if (varlen) {
            int rm[KV_WARPS];
            p.cu_seqlens_k[bsz] = kv_sum_warps_before(rl, warps);
            kv_read_warp_values(sm.red[3], rm);
            p.max_seqlen[0] = kv_sum_warps_before<true>(rm, warps);
            kv_read_warp_values(sm.red[4], rm);
            p.max_seqlen[1] = kv_sum_warps_before<true>(rm, warps);
        }
    }
    // 9. the rest of the rows: the first request's columns past the loaded ones, then the warp's
    // further requests (none with the planner's geometry unless a row has more than 512 pages)
    if (fi && (b0 + warps < r1 || (mine && pb > KV_META_PRE * 32))) kv_copy_rest_rows(sm, p, table, stride, width, g, b0, r1, out, err);
    // 10. the pad of this block's entry range
    if (fi) {
        const unsigned int e_lo = min((unsigned int)k * chunk, (unsigned int)N), e_hi = min(e_lo + chunk, (unsigned int)N);
        kv_pad_entries(out, max((int)e_lo, total), (int)e_hi);
    }
    kv_store_block_record(p, err);
}


// ---- metadata blocks of the step across blocks (step_wide_attention; docs/attention.md, "Batches of 257 to 4096") ----
//
// step_wide_attention<G, PosT>, R = 4 requests per thread, G = 0..4 caches: for one_block_max_requests <
// bsz <= KV_W_MAX / 4 x 4 requests with attention outputs on. The first ceil(C / T) blocks are
// step_wide<G, PosT, 4>'s token blocks (R x T >= bsz, T <= KV_W_MAX / R); the M blocks after
// them are metadata blocks (kv_meta_wide), counted from the grid's end (mr = gridDim.x - 1 - blockIdx.x;
// block mr is cache g = mr % G, block k = mr / G of it). With flashinfer or page_table, a cache has
// ceil(bsz / W) REQUEST blocks (W = T / 32 warps; block k owns requests [k W, k W + W), a warp per
// request) and, with flashinfer, PAD blocks after them (the planner's count, at least one): M = G x
// (request blocks + pad blocks). Varlen alone: M = 1, one block owning every request. Thread i holds
// requests [R i, R i + R) in registers (int4 loads when the length arrays are 16-byte aligned):
//   1. ONE round trip: a request block loads the lengths of requests below its last one (its rows'
//      offsets need nothing after them), a pad block (and the varlen-only block) every length; each
//      warp of a request block also loads its request's first KV_META_PRE x 32 row columns;
//   2. per thread the saturating sums of (tokens, L, pages) of its requests, three warp scans, the
//      warp totals to shared memory, ONE barrier; every thread then scans the warp totals (a warp
//      scan over at most 32 warps) and walks its requests: an owned request's kv_indptr,
//      kv_last_page_len and cu_seqlens_k, bits 1 and 16 keyed at its first token, and its first
//      token, kv_indptr and pages to shared memory; a second barrier (flashinfer only);
//   3. each warp stores its request's loaded columns (bit 2 for a negative id) and copies the rest
//      of the row; the block owning request bsz - 1 writes entry bsz (kv_indptr, cu_seqlens_k) and
//      the maxima; pad block j writes kv_indices[g] entries [total + j c, total + (j + 1) c) below N,
//      c = ceil((N - total) / pad blocks), with int4 stores.
// Outputs and error records (bits 1, 2, 16 and their keys) are kv_meta_small's; records: every block
// merges into records blockIdx.x * T / 32 + warp, only from a warp with an error (sticky).
struct __align__(16) KvMetaWideShared {
    int red[5][32];   // per-warp inclusive totals (tokens, L, pages) and maxima (tokens, L); T <= 1024
    int xq[32];       // owned request r0 + w: its first token (the key of its error records)
    int xp[32];       // owned request r0 + w: its kv_indptr (first kv_indices entry)
    int pg[32];       // owned request r0 + w: its pages in this block's cache
};

// Thread i's lengths: requests [R i, R i + R) below lim (0 from lim on): R / 4 int4 loads per array when
// both arrays are 16-byte aligned and all R lie below lim, else scalar loads.
template <int R>
__device__ __forceinline__ void kv_meta_wide_lengths(const KvStepParams& p, int lim, int (&d)[R], int (&n)[R]) {
    static_assert(R % 4 == 0, "R must be 4, 8 or 16");
    const int c0 = R * (int)threadIdx.x;  // R x T <= KV_W_MAX
    const u64 lens = (u64)p.seq_lens_decoder | (u64)p.seq_lens_this_time;
    if ((lens & 15ull) == 0 && c0 + R <= lim) {
        const int4* da = reinterpret_cast<const int4*>(p.seq_lens_decoder + c0);
        const int4* na = reinterpret_cast<const int4*>(p.seq_lens_this_time + c0);
#pragma unroll
        for (int k = 0; k < R / 4; ++k) {
            const int4 a = kv_ld(da + k), b = kv_ld(na + k);
            d[4 * k] = a.x, d[4 * k + 1] = a.y, d[4 * k + 2] = a.z, d[4 * k + 3] = a.w;
            n[4 * k] = b.x, n[4 * k + 1] = b.y, n[4 * k + 2] = b.z, n[4 * k + 3] = b.w;
        }
    } else {
#pragma unroll
        for (int u = 0; u < R; ++u) {
            d[u] = n[u] = 0;
            if (c0 + u < lim) {
                d[u] = kv_ld(p.seq_lens_decoder + c0 + u);
                n[u] = kv_ld(p.seq_lens_this_time + c0 + u);
            }
        }
    }
}

// Over the warps' values v[0 .. warps) in shared memory: the (saturating) sum of those before `warp`
// and the total (a warp scan; every lane of every warp calls it).
__device__ __forceinline__ void kv_scan_warp_totals(const int* v, int warps, int warp, int& before, int& total) {
    const int lane = threadIdx.x & 31;
    const int w = kv_warp_inclusive_nn(lane < warps ? v[lane] : 0);
    total = __shfl_sync(0xffffffffu, w, warps - 1);
    const int b = __shfl_sync(0xffffffffu, w, (warp + 31) & 31);
    before = warp == 0 ? 0 : b;
}

// Metadata block of step_wide_attention: T = blockDim.x threads, R x T >= bsz (see the section comment).
template <int G, int R>
__device__ __forceinline__ void kv_meta_wide(const KvStepParams& p) {
    __shared__ KvMetaWideShared sm;
    const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5, T = blockDim.x, warps = T >> 5;
    const int bsz = p.bsz, N = p.kv_indices_capacity;
    const bool fi = G > 0 && (p.attention & KV_ATTN_FLASHINFER) != 0;  // (the planner refuses flashinfer without caches)
    const bool rows = G > 0 && (p.attention & (KV_ATTN_FLASHINFER | KV_ATTN_PAGE_TABLE)) != 0;
    // 1. this block's cache and role, counted from the grid's end (G is a constant: no division)
    const int mr = (int)(gridDim.x - 1u - blockIdx.x);
    const int g = G > 1 && rows ? mr % G : 0, k = G > 1 && rows ? mr / G : mr;
    const bool owner = !rows || k * warps < bsz;  // a request block (the varlen-only block owns all)
    const int r0 = rows ? min(k * warps, bsz) : 0, r1 = rows ? min(r0 + warps, bsz) : bsz;
    const int lim = owner ? r1 : bsz;  // requests whose lengths this block needs
    int d[R], n[R];
    kv_meta_wide_lengths<R>(p, lim, d, n);
    const int* table = nullptr;
    i64 stride = 0;
    int width = 1, B = 1;
    if (G > 0) kv_meta_cache(p, g, table, stride, width, B);
    const int b0 = r0 + warp;  // the warp's request (a request block)
    const bool mine = owner && rows && b0 < r1;
    const unsigned int uB = (unsigned int)B;
    const bool pow2 = (uB & (uB - 1u)) == 0u;
    const int sh = __ffs(B) - 1;
    const unsigned int rcp = pow2 ? 0u : 0xffffffffu / uB;
    // the warp's first row columns below the width (the addresses need no length)
    const int cols = fi && mine ? width : 0;
    int v[KV_META_PRE];
    kv_row_prefix_loads(kv_global_addr(table) + 4u * (u64)((i64)b0 * stride + lane), cols - lane, v);
    KvErr err;
    err.mask = 0u;
    err.key = KV_NO_ERROR;
    const bool varlen = (p.attention & KV_ATTN_VARLEN) != 0 && g == 0;
    // the block that writes entry bsz and the maxima: the one owning request bsz - 1 (block 0 for bsz = 0)
    const bool last = !rows || (bsz == 0 ? k == 0 : owner && r1 == bsz);
    // 2. (lengths arrived) the thread's sums, three warp scans, the maxima (the last block, varlen)
    int sq = 0, sl = 0, sp = 0, mq = 0, ml = 0;
#pragma unroll
    for (int u = 0; u < R; ++u) {
        const bool bad = (d[u] < 0) | (n[u] < 0);
        const int nn = bad ? 0 : n[u], L = bad ? 0 : kv_sat_add_nn(d[u], n[u]);
        sq = kv_sat_add_nn(sq, nn);
        sl = kv_sat_add_nn(sl, L);
        if (G > 0) sp = kv_sat_add_nn(sp, kv_ceil_pages(L, uB, pow2, sh, rcp));
        mq = max(mq, nn);
        ml = max(ml, L);
    }
    const int iq = kv_warp_inclusive_nn(sq), il = kv_warp_inclusive_nn(sl), ip = kv_warp_inclusive_nn(sp);
    const int eq = __shfl_up_sync(0xffffffffu, iq, 1), el = __shfl_up_sync(0xffffffffu, il, 1),
              ep = __shfl_up_sync(0xffffffffu, ip, 1);
    const bool maxima = last && varlen;
    if (maxima) {
        mq = __reduce_max_sync(0xffffffffu, mq);
        ml = __reduce_max_sync(0xffffffffu, ml);
    }
    if (lane == 31) {
        sm.red[0][warp] = iq;
        sm.red[1][warp] = il;
        sm.red[2][warp] = ip;
        sm.red[3][warp] = mq;
        sm.red[4][warp] = ml;
    }
    __syncthreads();
    int bq, tq, bl, tl, bp, tp;
    kv_scan_warp_totals(sm.red[0], warps, warp, bq, tq);
    kv_scan_warp_totals(sm.red[1], warps, warp, bl, tl);
    kv_scan_warp_totals(sm.red[2], warps, warp, bp, tp);  // tp: pages below lim (every page for pad blocks)
    const i64 row_off = (i64)g * p.attn_stride;
    if (last && tid == 0) {  // entry bsz; the maxima (cache 0)
        if (fi) p.kv_indptr[row_off + bsz] = tp;
        if (varlen) {
            p.cu_seqlens_k[bsz] = tl;
            int m0 = 0, m1 = 0;
#pragma unroll 1
            for (int w = 0; w < warps; ++w) {
                m0 = max(m0, sm.red[3][w]);
                m1 = max(m1, sm.red[4][w]);
            }
            p.max_seqlen[0] = m0;
            p.max_seqlen[1] = m1;
        }
    }
    if (owner) {
        // the thread's requests: running prefixes from its first; outputs for the owned ones
        int cq = kv_sat_add_nn(bq, lane == 0 ? 0 : eq), cl = kv_sat_add_nn(bl, lane == 0 ? 0 : el),
            cp = kv_sat_add_nn(bp, lane == 0 ? 0 : ep);
        const int c0 = R * tid;
#pragma unroll
        for (int u = 0; u < R; ++u) {
            const int b = c0 + u;
            const bool bad = (d[u] < 0) | (n[u] < 0);
            const int nn = bad ? 0 : n[u], L = bad ? 0 : kv_sat_add_nn(d[u], n[u]);
            const int P = G > 0 ? kv_ceil_pages(L, uB, pow2, sh, rcp) : 0;
            if (b >= r0 && b < r1) {
                bool cap = false;
                if (fi) {
                    p.kv_indptr[row_off + b] = cp;
                    // P = ceil(L / B), so L - (P - 1) B = (L - 1) % B + 1 for L > 0
                    p.kv_last_page_len[row_off + b] = L > 0 ? L - (P - 1) * B : 0;
                    cap = cp <= N && N < kv_sat_add_nn(cp, P);
                    sm.xq[b - r0] = cq;
                    sm.xp[b - r0] = cp;
                    sm.pg[b - r0] = P;
                }
                if (varlen) p.cu_seqlens_k[b] = cl;
                if (cap) err.flag(KV_ERR_KV_INDICES_CAPACITY, cq, b, g);
                if (rows && P > width) err.flag(KV_ERR_BLOCK_INDEX, cq, b, g);
            }
            cq = kv_sat_add_nn(cq, nn);
            cl = kv_sat_add_nn(cl, L);
            cp = kv_sat_add_nn(cp, P);
        }
        if (fi) {
            __syncthreads();  // (uniform) the owned requests' prefixes
            if (mine) {  // 3. the warp's row: the loaded columns, then the rest
                const int w = b0 - r0, key = sm.xq[w], s0 = sm.xp[w], pb = sm.pg[w];
                const int end = s0 < N ? min(pb, N - s0) : 0, ew = min(end, width);
                int* __restrict__ o = p.kv_indices + (i64)g * N + s0;
                bool neg = false;
#pragma unroll
                for (int u = 0; u < KV_META_PRE; ++u) {
                    const int col = lane + 32 * u;
                    if (col < end) o[col] = max(v[u], -1);
                    neg |= (col < ew) & (v[u] < 0);
                }
                if (end > KV_META_PRE * 32)
                    neg |= kv_copy_row_cols(table + (i64)b0 * stride, width, o, lane + KV_META_PRE * 32, end);
                if (neg) err.flag(KV_ERR_NEGATIVE_BLOCK, key, b0, g);
            }
        }
    } else if (fi) {
        // a pad block: j of J after the cache's request blocks; entries [total + j c, total + (j + 1) c)
        const unsigned int uW = (unsigned int)warps, uT = (unsigned int)T, uC = (unsigned int)p.capacity;
        const int kreq = (int)(((unsigned int)bsz + uW - 1u) / uW);
        const int M = (int)gridDim.x - (int)((uC + uT - 1u) / uT);  // C <= 2^31 - 2: C + T - 1 < 2^32
        const int J = max(M / (G > 0 ? G : 1) - kreq, 1), j = k - kreq;
        if (tp < N) {
            const unsigned int left = (unsigned int)(N - tp), uJ = (unsigned int)J;
            const unsigned int c = (left + uJ - 1u) / uJ;  // < 2^31
            const unsigned int lo = min((unsigned int)j * c, left), hi = min(lo + c, left);
            kv_pad_entries(p.kv_indices + (i64)g * N, tp + (int)lo, tp + (int)hi);
        }
    }
    kv_store_block_record(p, err);
}

