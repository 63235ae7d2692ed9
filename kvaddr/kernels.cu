// kvaddr: every CUDA kernel of the library (loaded with cupy.RawModule, see kvaddr/kernel_loader.py).
//
// The file has two sections:
//   LIBRARY KERNELS (first): the fused step, what kvaddr ships.
//     kvaddr_step_i64 / kvaddr_step_i32   the fused step: cu_seqlens_q, num_tokens,
//         batch_id_per_token, position_ids (int64 / int32), seq_lens_kv and the slot
//         mapping of up to KV_MAX_CACHES caches, padding and error records included,
//         in ONE launch. With num_caches = 0 it is kvaddr's positions-only kernel.
//         Its one parameter is a KvStepParams struct, passed by value (mirrored
//         field by field by kvaddr/kernel_loader.py's StepParams, a ctypes.Structure).
//     kvaddr_step1_c{G}_* / kvaddr_step1m_c{G}_*   the small-batch step (v9), without / with the
//         attention metadata blocks (sections "v9" and "v9m" below), the same struct.
//   BASELINE (MEASUREMENT) KERNELS (at the end): what the fused step is measured against.
//     kvaddr_slots_i64 / kvaddr_slots_i32 one cache's slot mapping from given positions
//         and batch ids (the per-layer, one-kernel baseline).
//     kvaddr_where_pad                     the padding "where" of the per-layer op chain.
//     kvaddr_engine_*                      attention metadata the way engines build it
//         (separate launches: pages, cumsum, copy_pages, pad_pages, last_page, max).
//     kvaddr_empty                         an empty kernel (the launch floor).
//     kvaddr_one_block_i64 / _i32          FastDeploy's one-block step (<<<1, bsz>>>, a thread per
//         request, serial prefix; bsz <= 1024): the one-block strategy.
//
// Semantics: docs/spec.md and kvaddr/reference.py (the oracle).
//
// How the fused step scales (no single block, no per-thread prefix over earlier
// requests):
//   * Small batches (bsz <= KV_TILE): grid = one block per KV_TOKENS tokens of the
//     capacity, one token per thread (kv_step_small). Every block loads all lengths
//     itself (int4 loads into shared memory), so no block waits for another. Its one
//     barrier also tests whether the batch is uniform (every request good and running
//     q[0] tokens); a uniform batch is written in closed form with no prefix sum,
//     decode tokens from block-table loads issued before the barrier. Other batches
//     are scanned in shared memory (thread-blocked sequential sums + a warp-shuffle
//     block scan) and each token's request is checked against two guesses or
//     binary-searched.
//   * Large batches (bsz > KV_TILE, kv_step_large): blocks take tickets in the order
//     they start (kv_take_ticket). The first ceil(bsz / KV_TILE) tickets scan one tile
//     of requests each (kv_large_scan) and chain their prefixes with a decoupled
//     look-back (kv_look_back: a tile only ever waits for tiles with lower tickets,
//     which are running), write cu_seqlens_q and seq_lens_kv, and count themselves
//     done. The other tickets each own KV_TOKENS tokens (kv_large_tokens): they wait
//     for the scan (kv_wait_scan; lower tickets only: no deadlock), find their first
//     and last request with a 32-way warp search over cu_seqlens_q and stage those
//     requests in shared memory (kv_chunk_requests), and search per token there. The
//     last block to finish resets the tickets for the next launch and bumps an epoch
//     that invalidates the tile flags (kv_finish_launch), so the kernel is safe to
//     replay in a CUDA graph with no memset.
//   * Attention metadata (docs/attention.md, opt-in: KvStepParams::attention != 0):
//     num_meta more blocks after the token blocks (kv_meta_block) write kv_indptr,
//     kv_indices, kv_last_page_len, cu_seqlens_k and max_seqlen_q/k. They take no
//     ticket and wait for no block. KvStepParams::meta_impl picks how: 1 (default) or 2
//     kv_meta_block2, request-parallel (one register pass over all lengths for the
//     prefixes before the block's own requests, a scan of those, a group of lanes copies
//     each request's row prefix; 2 also prefetches the rows into L2 first), 0 the first
//     version kv_meta_block (each block scans all lengths KV_TILE at a time in shared
//     memory and binary-searches each entry's request), 3 kv_meta_block3 (block2's
//     work in one round: one barrier, the first row loads in flight across it). With attention off num_meta = 0
//     and the token blocks run exactly as before.
//   * Errors: sticky per-warp records (mask, first-bad key). Only a warp that found an
//     error writes: it merges into its own record with atomicOr (mask) and atomicMin (key),
//     so a record holds every error since the host last cleared it; a clean warp writes
//     nothing and no kernel clears. errors()/check() reduce the records on the host (OR,
//     min) and reset them. The mask's bits are the KV_ERR_* below (kvaddr/errors.py's
//     ERR_*, checked by a test).
//
// Addresses are int64 throughout: block ids up to 2^31-1 times any block size.

// ============================================================================
// LIBRARY KERNELS: the fused step
// ============================================================================

#define KV_THREADS 256
#define KV_WARPS (KV_THREADS / 32)
#define KV_TILE 4096
#define KV_TOKENS 256
#define KV_TOKENS_PER_THREAD (KV_TOKENS / KV_THREADS)
#define KV_MAX_CACHES 4
#define KV_INT_MAX 0x7fffffff
#define KV_NO_ERROR 0xffffffffffffffffULL

// State words of the large-batch path (unsigned int [4]).
#define KV_STATE_EPOCH 0
#define KV_STATE_TICKET 1
#define KV_STATE_SCAN_DONE 2
#define KV_STATE_DONE 3

#define KV_FLAG_AGGREGATE 1ULL
#define KV_FLAG_PREFIX 2ULL

// Attention outputs asked for (KvStepParams::attention; docs/attention.md).
#define KV_ATTN_FLASHINFER 1  // qo_indptr (= cu_seqlens_q), kv_indptr, kv_indices, kv_last_page_len
#define KV_ATTN_VARLEN 2      // cu_seqlens_k, seqused_k (= seq_lens_kv), max_seqlen_q, max_seqlen_k
#define KV_ATTN_PAGE_TABLE 4  // page_table (a view of the tables): the kernel checks the rows (bit 1)

// Error bits of a step's error mask (the spec's; kvaddr/errors.py ERR_* mirror them).
#define KV_ERR_BLOCK_INDEX 1      // block index pos / B beyond the table's width
#define KV_ERR_NEGATIVE_BLOCK 2   // negative (unallocated) block id for a real token
#define KV_ERR_CAPACITY 4         // more tokens than the capacity C (the extra ones dropped)
#define KV_ERR_NEGATIVE_LENGTH 8  // negative seq_lens_decoder or seq_lens_this_time
#define KV_ERR_KV_INDICES_CAPACITY 16  // more kv_indices entries than their capacity (attention outputs)
// log2 of an error bit: the low three bits of the error key (a compile-time constant).
#define KV_ERR_LOG2(bit) ((bit) == KV_ERR_BLOCK_INDEX ? 0 : (bit) == KV_ERR_NEGATIVE_BLOCK ? 1 : (bit) == KV_ERR_CAPACITY ? 2 : (bit) == KV_ERR_NEGATIVE_LENGTH ? 3 : 4)

typedef long long i64;
typedef unsigned long long u64;

// A measuring instrument, off in the library: compiled with KV_TRACE defined (benchmarks/
// trace_step1m.py builds its own module so), thread 0 of block b stores clock64 (or, for the
// *_TIME slots, %globaltimer) at KV_STAMP(slot) into kv_trace[b % KV_TRACE_BLOCKS][slot]: where
// one warp's time goes inside a launch (docs/perf-notes.md, "Twelfth session"). Without
// KV_TRACE a stamp is nothing (the library's SASS is the same with or without the stamps).
#define KV_TRACE_BLOCKS 256
#define KV_TRACE_SLOTS 16
#ifdef KV_TRACE
__device__ u64 kv_trace[KV_TRACE_BLOCKS][KV_TRACE_SLOTS];
__device__ __forceinline__ u64 kv_trace_clock() {
    u64 t;
    asm volatile("mov.u64 %0, %%clock64;" : "=l"(t)::"memory");
    return t;
}
__device__ __forceinline__ u64 kv_trace_time() {
    u64 t;
    asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t)::"memory");
    return t;
}
#define KV_STAMP(slot) \
    do { if (threadIdx.x == 0) kv_trace[blockIdx.x % KV_TRACE_BLOCKS][slot] = kv_trace_clock(); } while (0)
#define KV_STAMP_TIME(slot) \
    do { if (threadIdx.x == 0) kv_trace[blockIdx.x % KV_TRACE_BLOCKS][slot] = kv_trace_time(); } while (0)
#define KV_STAMP_VALUE(slot, v) \
    do { if (threadIdx.x == 0) kv_trace[blockIdx.x % KV_TRACE_BLOCKS][slot] = (u64)(v); } while (0)
#define KV_TRACE_WAIT(x) asm volatile("" ::"r"(x))  // the next stamp is taken after x is known
__device__ __forceinline__ unsigned int kv_trace_sm() {
    unsigned int s;
    asm volatile("mov.u32 %0, %%smid;" : "=r"(s));
    return s;
}
#else
#define KV_STAMP(slot) ((void)0)
#define KV_STAMP_TIME(slot) ((void)0)
#define KV_STAMP_VALUE(slot, v) ((void)0)
#define KV_TRACE_WAIT(x) ((void)0)
#endif

static_assert(sizeof(int) == 4 && sizeof(i64) == 8 && sizeof(u64) == 8 && sizeof(void*) == 8,
              "KvStepParams assumes 4-byte int and 8-byte int64 and pointers");

// The fused step's one parameter, passed by value (kernel parameter space, read
// through the constant cache). Mirrored by kvaddr/planner.py's StepParams
// (ctypes.Structure, filled by name); tests/unit/test_kernel_params.py checks that
// sizeof and every field offset agree. Pointers first, then 8-byte, then 4-byte
// scalars: no padding anywhere. "Unused cache" means g >= num_caches.
struct KvStepParams {
    // -- inputs (read only) --
    const int* seq_lens_decoder;             // [bsz], int32: tokens already in each request's KV cache
    const int* seq_lens_this_time;           // [bsz], int32: tokens each request runs this step
    const int* block_tables[KV_MAX_CACHES];  // cache g: [rows >= bsz, max_blocks[g]], int32, rows
                                             // table_stride[g] elements apart; null for an unused cache
    // -- outputs (written every launch) --
    int* cu_seqlens_q;                       // [bsz + 1], int32: exclusive prefix of the tokens
    int* num_tokens;                         // [] (one value), int32: min(total tokens, capacity)
    int* batch_id_per_token;                 // [capacity], int32: request of each token, -1 for padding
    void* position_ids;                      // [capacity], int64 (kvaddr_step_i64) or int32 (kvaddr_step_i32)
    int* seq_lens_kv;                        // [bsz], int32: seq_lens_decoder + seq_lens_this_time
    i64* slot_mapping;                       // [num_caches, capacity], int64: cache slot, -1 padding/bad
    // -- device state (owned by the planner) --
    u64* error_records;                      // [(num_chunks + max_tiles) * KV_WARPS, 2], uint64: per warp
                                             // (error mask, first-bad key), rewritten every launch
    unsigned int* tile_state;                // [4], uint32: KV_STATE_* words of the large-batch path
    u64* tile_status;                        // [max(max_tiles, 1)], uint64: look-back word of each tile
    // -- attention outputs (docs/attention.md; written every launch when asked for, else null) --
    int* kv_indptr;                          // [num_caches, attn_stride], int32: row g = cache g's
                                             // kv_indptr[0..bsz] (flashinfer)
    int* kv_indices;                         // [num_caches, kv_indices_capacity], int32: every entry
                                             // written, -1 (PAD_PAGE_ID) past kv_indptr[g][bsz] (flashinfer)
    int* kv_last_page_len;                   // [num_caches, attn_stride], int32: row g = [0..bsz) (flashinfer)
    int* cu_seqlens_k;                       // [bsz + 1], int32: prefix sum of seq_lens_kv (varlen)
    int* max_seqlen;                         // [2], int32: max_seqlen_q, max_seqlen_k (varlen)
    // -- scalars --
    i64 table_stride[KV_MAX_CACHES];         // row stride of block_tables[g], in elements (int64)
    int max_blocks[KV_MAX_CACHES];           // row length of block_tables[g], int32 (1 for an unused cache)
    int block_size[KV_MAX_CACHES];           // B of cache g, int32 >= 1 (1 for an unused cache)
    int bsz;                                 // requests this step, int32 (<= max_requests)
    int capacity;                            // C: tokens of every per-token output, int32 >= 1
    int num_caches;                          // caches addressed, int32 in [0, KV_MAX_CACHES]
    int max_tiles;                           // int32: ceil(max_requests / KV_TILE) if max_requests >
                                             // KV_TILE else 0 (error records of the large path)
    int attention;                           // int32: KV_ATTN_* bits asked for; 0 = none (no metadata blocks)
    int kv_indices_capacity;                 // int32: N, entries of each kv_indices row (1 if no flashinfer)
    int attn_stride;                         // int32: row stride (elements) of kv_indptr and kv_last_page_len
    int meta_per_cache;                      // int32: metadata blocks per cache (>= 1 when attention != 0)
    int meta_entries;                        // int32: E, kv_indices entries each metadata block writes
    int num_meta;                            // int32: metadata blocks after the token blocks (0 when off)
    int meta_impl;                           // int32: 1 = request-parallel metadata blocks (kv_meta_block2),
                                             // 2 = the same with an L2 prefetch of the rows first,
                                             // 3 = one round (kv_meta_block3; block2 when a block has
                                             // more than KV_THREADS requests), 0 = the first version
                                             // (kv_meta_block: every block rescans); bits 256/512:
                                             // KV_META_NO_PREFIX / KV_META_NO_COPY (timing ablations)
    int meta_lanes;                          // int32: lanes per request of kv_meta_block2's copy (4, 8, 16, 32)
    // -- appended (session 5, kvaddr_step1m_*: the small-batch step with attention outputs) --
    int one_meta_lanes;                      // int32: unused since session 12 (kvaddr_step1m_* copies a row per warp)
    int one_meta_flags;                      // int32: KV_M1_EMPTY (a timing ablation) and/or KV_M1_ROWS_BY_PAGES
                                             // (kvaddr_step1wm*'s row loads; same outputs), else 0
};
static_assert(sizeof(KvStepParams) == 20 * 8 + KV_MAX_CACHES * (8 + 4 + 4) + 14 * 4,
              "KvStepParams has no padding (the ctypes mirror assumes the C layout)");
static_assert(alignof(KvStepParams) == 8, "KvStepParams is 8-byte aligned");
static_assert(KV_MAX_CACHES == 4, "the struct, the ctypes mirror and the planner assume 4 caches");

// Shared index with one pad word per 32: conflict-free thread-blocked access.
#define KV_PAD(k) ((k) + ((k) >> 5))
#define KV_SCAN_WORDS (KV_PAD(KV_TILE) + 1)

// Saturating add of two non-negative ints (associative, exact below 2^31-1).
__device__ __forceinline__ int kv_sat_add(int a, int b) {
    return (a > KV_INT_MAX - b) ? KV_INT_MAX : a + b;
}

// A load and a store of the v9 / wide path (kv_ld, kv_st: plain global accesses). Session 9 also
// measured __ldg / __stwb here (for pointers the compiler knew only as generic): 0.01-0.1 us slower
// than plain LDG / STG on most rows (docs/perf-notes.md, "Ninth session").
template <typename T>
__device__ __forceinline__ T kv_ld(const T* ptr) {
    return *ptr;
}
template <typename T>
__device__ __forceinline__ void kv_st(T* ptr, T v) {
    *ptr = v;
}

// The first-bad-record key (kvaddr/errors.py's error_key): token << 32 | request << 5 |
// cache << 3 | log2(bit); the smallest key of a launch is its first bad record.
__device__ __forceinline__ u64 kv_err_key(u64 token, u64 request, u64 cache, u64 bit_index) {
    return (token << 32) | (request << 5) | (cache << 3) | bit_index;
}

struct KvErr {
    unsigned int mask;
    u64 key;
    __device__ __forceinline__ void add(unsigned int bit, u64 key_) {
        mask |= bit;
        key = key_ < key ? key_ : key;
    }
    // Record error `bit` (a KV_ERR_* constant) at (token, request, cache).
    __device__ __forceinline__ void flag(unsigned int bit, u64 token, u64 request, u64 cache) {
        add(bit, kv_err_key(token, request, cache, KV_ERR_LOG2(bit)));
    }
};

#define KV_ITEMS (KV_TILE / KV_THREADS)   // requests a thread loads per tile

#define KV_VEC (KV_TILE / 4 / KV_THREADS)  // int4 loads a thread issues per tile array

struct __align__(16) KvShared {
    int dec[KV_TILE];                // seq_lens_decoder (raw, or -1 for a bad request once staged)
    int cu[KV_SCAN_WORDS];           // raw seq_lens_this_time (unpadded, small-batch loads), then the
                                     // exclusive prefix (padded index) and the tile total
    int warp_sums[KV_WARPS];         // per-warp totals of the tile scan
    int bcast[4];
};

// Load requests [base, base + count) (count <= KV_TILE) into registers, striped:
// item u of a thread is request u * KV_THREADS + threadIdx.x; every load is issued
// before any is used (one memory round trip).
__device__ __forceinline__ void kv_load_tile(const int* __restrict__ dec, const int* __restrict__ q, int base,
                                             int count, int (&d)[KV_ITEMS], int (&n)[KV_ITEMS]) {
#pragma unroll
    for (int u = 0; u < KV_ITEMS; ++u) {
        const int k = u * KV_THREADS + (int)threadIdx.x;
        d[u] = 0;
        n[u] = 0;
        if (k < count) {
            d[u] = dec[base + k];
            n[u] = q[base + k];
        }
    }
}

// Stage loaded requests for the scan: a bad request (a negative length) gets n = 0
// and d = -1 (in registers and s.dec); s.cu[KV_PAD(k)] = n, s.bcast[3] = n of the
// tile's first request, and seq_lens_kv is written for requests [kv_lo, kv_hi).
__device__ __forceinline__ void kv_stage_tile(KvShared& s, int base, int count, int* __restrict__ kv_out,
                                              int kv_lo, int kv_hi, int (&d)[KV_ITEMS], int (&n)[KV_ITEMS]) {
#pragma unroll
    for (int u = 0; u < KV_ITEMS; ++u) {
        const int k = u * KV_THREADS + (int)threadIdx.x;
        const bool bad = (d[u] < 0) | (n[u] < 0);
        if (k < count) {
            s.cu[KV_PAD(k)] = bad ? 0 : n[u];
            s.dec[k] = bad ? -1 : d[u];
            if (k >= kv_lo && k < kv_hi) kv_out[base + k] = bad ? 0 : kv_sat_add(d[u], n[u]);
        }
        if (bad) {
            d[u] = -1;
            n[u] = 0;
        }
    }
    if (threadIdx.x == 0) s.bcast[3] = n[0];
}

__device__ __forceinline__ bool kv_runs(int d, int n, int n_uniform) { return (d >= 0) & (n == n_uniform); }

// The lengths of all bsz <= KV_TILE requests of a small batch, in registers: request
// 4 * (u * KV_THREADS + threadIdx.x) + i is component i of a[u] (seq_lens_decoder)
// and b[u] (seq_lens_this_time); the bsz % 4 last ones are the tail of threads
// 0..bsz%4-1.
struct KvLengths {
    int4 a[KV_VEC], b[KV_VEC];
    int d_tail, n_tail;
};

// Issue every load of KvLengths and use none (the caller does other work while they
// fly): int4 loads when both arrays are 16-byte aligned, scalar ones otherwise.
__device__ __forceinline__ void kv_issue_lengths(KvLengths& L, const int* __restrict__ dec,
                                                 const int* __restrict__ q, int bsz, int n_uniform) {
    const int tid = threadIdx.x, nv = bsz >> 2;
    if (((reinterpret_cast<unsigned long long>(dec) | reinterpret_cast<unsigned long long>(q)) & 15ULL) == 0ULL) {
        const int4* __restrict__ dv = reinterpret_cast<const int4*>(dec);
        const int4* __restrict__ qv = reinterpret_cast<const int4*>(q);
#pragma unroll
        for (int u = 0; u < KV_VEC; ++u) {
            const int k = u * KV_THREADS + tid;
            if (k < nv) {
                L.a[u] = dv[k];
                L.b[u] = qv[k];
            }
        }
    } else {
#pragma unroll
        for (int u = 0; u < KV_VEC; ++u) {
            const int k = u * KV_THREADS + tid;
            if (k < nv) {
                L.a[u] = make_int4(dec[4 * k], dec[4 * k + 1], dec[4 * k + 2], dec[4 * k + 3]);
                L.b[u] = make_int4(q[4 * k], q[4 * k + 1], q[4 * k + 2], q[4 * k + 3]);
            }
        }
    }
    L.d_tail = 0;
    L.n_tail = n_uniform;
    if (tid < (bsz & 3)) {
        L.d_tail = dec[(nv << 2) + tid];
        L.n_tail = q[(nv << 2) + tid];
    }
}

// Store KvLengths raw into s.dec and s.cu[0..bsz) (unpadded) and return whether every
// request among them is good (no negative length) and runs exactly n_uniform tokens.
__device__ __forceinline__ bool kv_keep_lengths(KvShared& s, const KvLengths& L, int bsz, int n_uniform) {
    const int tid = threadIdx.x, nv = bsz >> 2;
    bool ok = true;
#pragma unroll
    for (int u = 0; u < KV_VEC; ++u) {
        const int k = u * KV_THREADS + tid;
        if (k < nv) {
            ok &= kv_runs(L.a[u].x, L.b[u].x, n_uniform) & kv_runs(L.a[u].y, L.b[u].y, n_uniform) &
                  kv_runs(L.a[u].z, L.b[u].z, n_uniform) & kv_runs(L.a[u].w, L.b[u].w, n_uniform);
            reinterpret_cast<int4*>(s.dec)[k] = L.a[u];
            reinterpret_cast<int4*>(s.cu)[k] = L.b[u];
        }
    }
    ok &= kv_runs(L.d_tail, L.n_tail, n_uniform);
    if (tid < (bsz & 3)) {
        s.dec[(nv << 2) + tid] = L.d_tail;
        s.cu[(nv << 2) + tid] = L.n_tail;
    }
    return ok;
}

// Exclusive saturating scan of s.cu[0..count) in place; s.cu[KV_PAD(count)] = total.
// The caller has staged s.cu (kv_stage_tile) and passed a barrier. Thread i owns
// items [i*ipt, (i+1)*ipt): a sequential sum, a warp-shuffle scan of the per-thread
// sums, every warp scans the warp totals itself, then a sequential write-back: two
// barriers. Returns the tile total.
__device__ __forceinline__ int kv_scan_tile(KvShared& s, int count) {
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    const int ipt = (count + KV_THREADS - 1) / KV_THREADS;
    const int first = threadIdx.x * ipt;
    int sum = 0;
    for (int j = 0; j < ipt; ++j) {
        const int k = first + j;
        if (k < count) sum = kv_sat_add(sum, s.cu[KV_PAD(k)]);
    }
    int x = sum;
#pragma unroll
    for (int off = 1; off < 32; off <<= 1) {
        int y = __shfl_up_sync(0xffffffffu, x, off);
        if (lane >= off) x = kv_sat_add(x, y);
    }
    int ex = __shfl_up_sync(0xffffffffu, x, 1);  // this thread's exclusive prefix in its warp
    if (lane == 0) ex = 0;
    if (lane == 31) s.warp_sums[warp] = x;
    __syncthreads();
    int w = lane < KV_WARPS ? s.warp_sums[lane] : 0;
#pragma unroll
    for (int off = 1; off < KV_WARPS; off <<= 1) {
        int y = __shfl_up_sync(0xffffffffu, w, off);
        if (lane >= off) w = kv_sat_add(w, y);
    }
    const int total = __shfl_sync(0xffffffffu, w, KV_WARPS - 1);
    int before = __shfl_up_sync(0xffffffffu, w, 1);  // exclusive prefix of warp `lane`
    before = __shfl_sync(0xffffffffu, lane == 0 ? 0 : before, warp);
    int run = kv_sat_add(before, ex);
    for (int j = 0; j < ipt; ++j) {
        const int k = first + j;
        if (k < count) {
            const int v = s.cu[KV_PAD(k)];
            s.cu[KV_PAD(k)] = run;
            run = kv_sat_add(run, v);
        }
    }
    if (threadIdx.x == 0) s.cu[KV_PAD(count)] = total;
    __syncthreads();
    return total;
}

// The caches of one step, gathered from kernel parameters (registers; every index
// below is a compile-time constant after unrolling, so nothing lands in local memory).
struct KvCaches {
    const int* table[KV_MAX_CACHES];
    i64 stride[KV_MAX_CACHES];   // row stride of the table, in elements
    int width[KV_MAX_CACHES];    // max_blocks: the table's row length
    int bs[KV_MAX_CACHES];       // block size B
};

// pos / B and pos % B for pos >= 0, B >= 1: 32-bit division when pos fits.
__device__ __forceinline__ void kv_divmod(i64 pos, int B, i64& idx, i64& off) {
    if (pos <= KV_INT_MAX) {
        unsigned int p = (unsigned int)pos, b = (unsigned int)B;
        unsigned int qd = p / b;
        idx = qd;
        off = p - qd * b;
    } else {
        idx = pos / B;
        off = pos - idx * B;
    }
}

// Load token's block ids (one per cache) for position pos of request b; a block
// index beyond the row loads nothing (kv_store_token sees that from pos again).
__device__ __forceinline__ void kv_load_blocks(int b, i64 pos, const KvCaches& c, int num_caches,
                                               int (&blk)[KV_MAX_CACHES]) {
#pragma unroll
    for (int g = 0; g < KV_MAX_CACHES; ++g) {
        blk[g] = -1;
        if (g < num_caches) {
            i64 idx, off;
            kv_divmod(pos, c.bs[g], idx, off);
            if (idx < c.width[g]) blk[g] = c.table[g][(i64)b * c.stride[g] + idx];
        }
    }
}

template <typename PosT>
__device__ __forceinline__ void kv_store_token(int t, int b, i64 pos, const int (&blk)[KV_MAX_CACHES],
                                               const KvCaches& c, int num_caches, int capacity,
                                               int* __restrict__ batch_out, PosT* __restrict__ pos_out,
                                               i64* __restrict__ slot_out, KvErr& err) {
    batch_out[t] = b;
    pos_out[t] = (PosT)pos;
#pragma unroll
    for (int g = 0; g < KV_MAX_CACHES; ++g) {
        if (g < num_caches) {
            i64 idx, off, slot = -1;
            kv_divmod(pos, c.bs[g], idx, off);
            if (idx >= c.width[g]) err.flag(KV_ERR_BLOCK_INDEX, t, b, g);
            else if (blk[g] < 0) err.flag(KV_ERR_NEGATIVE_BLOCK, t, b, g);
            else slot = (i64)blk[g] * c.bs[g] + off;
            slot_out[(i64)g * capacity + t] = slot;
        }
    }
}

template <typename PosT>
__device__ __forceinline__ void kv_write_token(int t, int b, i64 pos, const KvCaches& c, int num_caches,
                                               int capacity, int* __restrict__ batch_out,
                                               PosT* __restrict__ pos_out, i64* __restrict__ slot_out,
                                               KvErr& err) {
    int blk[KV_MAX_CACHES];
    kv_load_blocks(b, pos, c, num_caches, blk);
    kv_store_token<PosT>(t, b, pos, blk, c, num_caches, capacity, batch_out, pos_out, slot_out, err);
}

template <typename PosT>
__device__ __forceinline__ void kv_write_pad(int t, int num_caches, int capacity, int* __restrict__ batch_out,
                                             PosT* __restrict__ pos_out, i64* __restrict__ slot_out) {
    batch_out[t] = -1;
    pos_out[t] = 0;
#pragma unroll
    for (int g = 0; g < KV_MAX_CACHES; ++g)
        if (g < num_caches) slot_out[(i64)g * capacity + t] = -1;
}

// Per-request outputs and errors of request b whose tokens are [start, end).
__device__ __forceinline__ void kv_write_request(int b, int start, int end, int dec_or_bad, int capacity,
                                                 int* __restrict__ cu_out, KvErr& err) {
    kv_st(cu_out + b, start);
    if (dec_or_bad < 0) err.flag(KV_ERR_NEGATIVE_LENGTH, start, b, 0);
    if (start <= capacity && capacity < end) err.flag(KV_ERR_CAPACITY, capacity, b, 0);
}

// Largest b in [lo, hi) with s.cu[b] <= t (s.cu[lo] <= t).
__device__ __forceinline__ int kv_search_shared(const KvShared& s, int lo, int hi, int t) {
    while (hi - lo > 1) {
        int mid = (lo + hi) >> 1;
        if (s.cu[KV_PAD(mid)] <= t) lo = mid; else hi = mid;
    }
    return lo;
}

// Same over cu in global memory written by other blocks of this launch (L2 reads).
__device__ __forceinline__ int kv_search_global(const int* cu, int lo, int hi, int t) {
    while (hi - lo > 1) {
        int mid = (lo + hi) >> 1;
        if (__ldcg(cu + mid) <= t) lo = mid; else hi = mid;
    }
    return lo;
}

// Warp-cooperative 32-way search: largest b in [lo, hi) with cu[b] <= t; every lane
// of the warp calls it and gets the answer. log32(hi - lo) rounds of L2 reads.
__device__ __forceinline__ int kv_warp_search_global(const int* cu, int lo, int hi, int t) {
    const int lane = threadIdx.x & 31;
    while (hi - lo > 1) {
        int step = (hi - lo + 31) >> 5;
        int idx = lo + lane * step;
        bool pred = idx < hi && __ldcg(cu + idx) <= t;
        unsigned int m = __ballot_sync(0xffffffffu, pred);
        int k = 31 - __clz(m);
        lo = lo + k * step;
        hi = min(hi, lo + step);
    }
    return lo;
}

// Sticky error record i (rec[2 i] = mask, rec[2 i + 1] = first-bad key), merged by the whole
// warp (all 32 lanes): a vote first, and only a warp with an error reduces its (mask, key) and
// merges it with atomicOr / atomicMin (the record may hold an unread error of an earlier
// launch). A clean warp writes nothing; the host clears the records after reading them.
__device__ __forceinline__ void kv_merge_record(u64* __restrict__ rec, i64 i, KvErr err) {
    if (__any_sync(0xffffffffu, err.mask != 0u)) {
        const unsigned int mask = __reduce_or_sync(0xffffffffu, err.mask);
#pragma unroll
        for (int off = 16; off > 0; off >>= 1) {
            const u64 k = __shfl_xor_sync(0xffffffffu, err.key, off);
            err.key = k < err.key ? k : err.key;
        }
        if ((threadIdx.x & 31) == 0) {
            atomicOr(rec + 2 * i, (u64)mask);
            atomicMin(rec + 2 * i + 1, err.key);
        }
    }
}

// The errors of this warp of a KV_THREADS block into record slot * KV_WARPS + warp (sticky).
__device__ __forceinline__ void kv_store_errors(KvErr err, u64* __restrict__ rec, int slot) {
    kv_merge_record(rec, (i64)slot * KV_WARPS + (threadIdx.x >> 5), err);
}

// The small-batch step (bsz <= KV_TILE): one token per thread, grid = ceil(C /
// KV_TOKENS) blocks, every block loads all bsz requests' lengths itself, so no block
// ever waits for another.
//   1. One round trip: the thread's own request under the decode guess (token t is
//      request t), q[0], and every request's lengths (int4 loads into shared memory).
//      The guessed block-table loads go out at once, before any barrier.
//   2. One barrier that also ANDs "every request is good and runs q0 >= 0 tokens". Such a
//      uniform batch (plain decode, uniform speculative decoding, equal prefill
//      chunks) has its layout in closed form, request b's tokens start at b * q0, so
//      it is written with no scan: decode tokens straight from the guess, q0 > 1
//      tokens after one more (table) round trip.
//   3. Otherwise: stage the lengths, scan them in shared memory, check the guesses
//      (decode, then "every request runs as many tokens as request 0"), search the
//      rest, write everything.
template <typename PosT>
__device__ __forceinline__ void kv_step_small(KvShared& s, const int* __restrict__ dec, const int* __restrict__ q,
                                              int bsz, int capacity, int num_caches, const KvCaches& c,
                                              int* __restrict__ cu_out, int* __restrict__ num_tokens_out,
                                              int* __restrict__ batch_out, PosT* __restrict__ pos_out,
                                              int* __restrict__ kv_out, i64* __restrict__ slot_out,
                                              u64* __restrict__ rec, int num_chunks) {
    static_assert(KV_TOKENS == KV_THREADS, "the small-batch step runs one token per thread");
    KvErr err;
    err.mask = 0u;
    err.key = KV_NO_ERROR;
    const int tid = threadIdx.x, chunk = blockIdx.x;
    const int t = chunk * KV_TOKENS + tid;  // this thread's token

    // 1. one round trip
    const int q0 = bsz > 0 ? q[0] : 0;
    int dt = -1, nt = 0;
    if (t < bsz) {
        dt = dec[t];
        nt = q[t];
    }
    KvLengths L;
    kv_issue_lengths(L, dec, q, bsz, q0);
    const bool mine = kv_keep_lengths(s, L, bsz, q0);
    // The decode guess's block-table loads, before the barrier.
    int blk[KV_MAX_CACHES];
    int guess = -1, gstart = t;
    if (t < capacity && t < bsz && dt >= 0 && nt > 0) {
        guess = t;
        kv_load_blocks(t, (i64)dt, c, num_caches, blk);
    }
    // 2. one barrier
    const bool uniform = __syncthreads_and(mine) && q0 >= 0 && (i64)bsz * q0 <= (i64)capacity;
    if (uniform) {
        const int total = bsz * q0;  // <= capacity
        if (t < total) {
            int b = t;
            i64 pos = dt;
            if (q0 != 1) {
                b = (int)((unsigned int)t / (unsigned int)q0);
                pos = (i64)s.dec[b] + (t - b * q0);
                kv_load_blocks(b, pos, c, num_caches, blk);
            }
            kv_store_token<PosT>(t, b, pos, blk, c, num_caches, capacity, batch_out, pos_out, slot_out, err);
        } else if (t < capacity) {
            kv_write_pad<PosT>(t, num_caches, capacity, batch_out, pos_out, slot_out);
        }
        for (int r = t; r <= bsz; r += num_chunks * KV_TOKENS) {
            cu_out[r] = r * q0;
            if (r < bsz) kv_out[r] = kv_sat_add(r == t ? dt : s.dec[r], q0);
        }
        if (t == 0) *num_tokens_out = total;
        kv_store_errors(err, rec, chunk);
        return;
    }

    // 3. general batch: stage (raw lengths from shared memory), scan, search
    const int rq = (bsz + 1 + num_chunks - 1) / num_chunks;  // requests whose outputs this block writes
    const int r_lo = chunk * rq, r_hi = min(r_lo + rq, bsz + 1);
    {
        int d[KV_ITEMS], n[KV_ITEMS];
#pragma unroll
        for (int u = 0; u < KV_ITEMS; ++u) {
            const int k = u * KV_THREADS + tid;
            d[u] = k < bsz ? s.dec[k] : 0;
            n[u] = k < bsz ? s.cu[k] : 0;
        }
        __syncthreads();  // every raw value read before staging overwrites s.cu
        kv_stage_tile(s, 0, bsz, kv_out, r_lo, r_hi, d, n);
    }
    __syncthreads();
    // Guess 2 (every request runs as many tokens as request 0): token t is request t / n0.
    const int n0 = s.bcast[3];
    if (n0 > 1) {
        const int b = t / n0;
        guess = -1;
        if (t < capacity && b < bsz && s.dec[b] >= 0) {
            guess = b;
            gstart = b * n0;
            kv_load_blocks(b, (i64)s.dec[b] + (t - b * n0), c, num_caches, blk);
        }
    }
    const int total = kv_scan_tile(s, bsz);
    const int end_tok = min(total, capacity);
    for (int b = r_lo + tid; b < r_hi; b += KV_THREADS) {
        int start = s.cu[KV_PAD(b)];
        if (b < bsz) kv_write_request(b, start, s.cu[KV_PAD(b + 1)], s.dec[b], capacity, cu_out, err);
        else cu_out[b] = start;
    }
    if (chunk == 0 && tid == 0) *num_tokens_out = end_tok;
    if (t < end_tok) {
        int b = guess;
        const bool hit = b >= 0 && s.cu[KV_PAD(b)] == gstart && t < s.cu[KV_PAD(b + 1)];
        if (!hit) b = kv_search_shared(s, 0, bsz, t);
        const i64 pos = (i64)s.dec[b] + (t - s.cu[KV_PAD(b)]);
        if (hit) kv_store_token<PosT>(t, b, pos, blk, c, num_caches, capacity, batch_out, pos_out, slot_out, err);
        else kv_write_token<PosT>(t, b, pos, c, num_caches, capacity, batch_out, pos_out, slot_out, err);
    } else if (t < capacity) {
        kv_write_pad<PosT>(t, num_caches, capacity, batch_out, pos_out, slot_out);
    }
    kv_store_errors(err, rec, chunk);
}

// ---- large batch (bsz > KV_TILE): ticketed tiles with a decoupled look-back ----

// Draw this block's ticket (blocks are numbered in the order they start, so a block
// only ever waits for lower tickets, which are running) and read the launch's epoch.
__device__ __forceinline__ void kv_take_ticket(KvShared& s, unsigned int* __restrict__ state, int& ticket,
                                               u64& epoch) {
    if (threadIdx.x == 0) {
        s.bcast[0] = (int)atomicAdd(&state[KV_STATE_TICKET], 1u);
        s.bcast[1] = (int)(*(volatile unsigned int*)&state[KV_STATE_EPOCH]);
    }
    __syncthreads();
    ticket = s.bcast[0];
    epoch = (u64)(unsigned int)s.bcast[1] & 0x3fffffffULL;
}

// Decoupled look-back of tile `tile` whose own total is agg (thread 0 only): publish
// the aggregate, add up predecessors back to the first published prefix, publish this
// tile's inclusive prefix; returns the tile's exclusive prefix. A status word is
// epoch << 34 | flag << 32 | value; a word of another epoch is stale (not published).
__device__ __forceinline__ int kv_look_back(u64* __restrict__ tile_status, int tile, u64 epoch, int agg) {
    volatile u64* st = tile_status;
    int excl = 0;
    if (tile == 0) {
        st[0] = (epoch << 34) | (KV_FLAG_PREFIX << 32) | (u64)(unsigned int)agg;
    } else {
        st[tile] = (epoch << 34) | (KV_FLAG_AGGREGATE << 32) | (u64)(unsigned int)agg;
        for (int p = tile - 1;;) {
            u64 v = st[p];
            u64 flag = (v >> 32) & 3ULL;
            if ((v >> 34) != epoch || flag == 0) continue;  // predecessor not published yet
            excl = kv_sat_add(excl, (int)(unsigned int)(v & 0xffffffffULL));
            if (flag == KV_FLAG_PREFIX) break;
            --p;
        }
        st[tile] = (epoch << 34) | (KV_FLAG_PREFIX << 32) | (u64)(unsigned int)kv_sat_add(excl, agg);
    }
    return excl;
}

// A scan ticket: tile `tile` of the requests. Load and stage its lengths (writing
// seq_lens_kv), scan them, chain the prefix with the look-back, write cu_seqlens_q and
// the tile's request errors (the last tile also cu_seqlens_q[bsz] and num_tokens),
// then count the tile done (kv_wait_scan waits for all of them).
__device__ __forceinline__ void kv_large_scan(KvShared& s, int tile, int num_tiles, u64 epoch,
                                              const int* __restrict__ dec, const int* __restrict__ q, int bsz,
                                              int capacity, int* __restrict__ cu_out,
                                              int* __restrict__ num_tokens_out, int* __restrict__ kv_out,
                                              unsigned int* __restrict__ state, u64* __restrict__ tile_status,
                                              KvErr& err) {
    const int base = tile * KV_TILE, count = min(KV_TILE, bsz - base);
    int d[KV_ITEMS], n[KV_ITEMS];
    kv_load_tile(dec, q, base, count, d, n);
    kv_stage_tile(s, base, count, kv_out, 0, count, d, n);
    __syncthreads();
    const int agg = kv_scan_tile(s, count);
    if (threadIdx.x == 0) s.bcast[2] = kv_look_back(tile_status, tile, epoch, agg);
    __syncthreads();
    const int excl = s.bcast[2];
    for (int k = threadIdx.x; k < count; k += KV_THREADS)
        kv_write_request(base + k, kv_sat_add(excl, s.cu[KV_PAD(k)]), kv_sat_add(excl, s.cu[KV_PAD(k + 1)]),
                         s.dec[k], capacity, cu_out, err);
    if (tile == num_tiles - 1 && threadIdx.x == 0) {
        int total = kv_sat_add(excl, agg);
        cu_out[bsz] = total;
        *num_tokens_out = min(total, capacity);
    }
    __threadfence();
    __syncthreads();
    if (threadIdx.x == 0) atomicAdd(&state[KV_STATE_SCAN_DONE], 1u);
}

// Wait until every scan ticket is done (they hold lower tickets: no deadlock).
__device__ __forceinline__ void kv_wait_scan(unsigned int* __restrict__ state, int num_tiles) {
    if (threadIdx.x == 0) {
        while (*(volatile unsigned int*)&state[KV_STATE_SCAN_DONE] < (unsigned int)num_tiles) __nanosleep(64);
        __threadfence();
    }
    __syncthreads();
}

// The requests of the tokens [c0, min(c0 + KV_TOKENS, end_tok)) (c0 < end_tok): their
// first request b_lo (warp search over cu_seqlens_q in global memory) and how many
// they span. If span <= KV_TILE, their cu_seqlens_q and seq_lens_decoder are staged in
// s.cu (padded index, relative to b_lo) and s.dec.
__device__ __forceinline__ void kv_chunk_requests(KvShared& s, const int* cu_out,
                                                  const int* __restrict__ dec, int bsz, int c0, int end_tok,
                                                  int& b_lo, int& span) {
    if (threadIdx.x < 32) {
        int lo = kv_warp_search_global(cu_out, 0, bsz, c0);
        int hi = kv_warp_search_global(cu_out, lo, bsz, min(c0 + KV_TOKENS, end_tok) - 1);
        if (threadIdx.x == 0) {
            s.bcast[0] = lo;
            s.bcast[1] = hi - lo + 1;
        }
    }
    __syncthreads();
    b_lo = s.bcast[0];
    span = s.bcast[1];
    if (span <= KV_TILE) {  // this chunk's requests fit: search them in shared memory
        int cu_k[KV_ITEMS], d_k[KV_ITEMS];
#pragma unroll
        for (int u = 0; u < KV_ITEMS; ++u) {
            const int k = u * KV_THREADS + (int)threadIdx.x;
            if (k < span) {
                cu_k[u] = __ldcg(cu_out + b_lo + k);
                d_k[u] = dec[b_lo + k];
            }
        }
#pragma unroll
        for (int u = 0; u < KV_ITEMS; ++u) {
            const int k = u * KV_THREADS + (int)threadIdx.x;
            if (k < span) {
                s.cu[KV_PAD(k)] = cu_k[u];
                s.dec[k] = d_k[u];
            }
        }
        __syncthreads();
    }
}

// A token ticket: chunk `chunk` of the tokens, [chunk * KV_TOKENS, + KV_TOKENS). Waits
// for the scan, finds its requests, writes its tokens (and padding).
template <typename PosT>
__device__ __forceinline__ void kv_large_tokens(KvShared& s, int chunk, int num_tiles, int num_chunks,
                                                const int* __restrict__ dec, int bsz, int capacity, int num_caches,
                                                const KvCaches& c, int* __restrict__ cu_out,
                                                int* __restrict__ batch_out, PosT* __restrict__ pos_out,
                                                i64* __restrict__ slot_out, unsigned int* __restrict__ state,
                                                KvErr& err) {
    kv_wait_scan(state, num_tiles);
    const int total = __ldcg(cu_out + bsz);
    const int end_tok = min(total, capacity);
    const int c0 = chunk * KV_TOKENS;
    int b_lo = 0, span = 0;
    if (c0 < end_tok) kv_chunk_requests(s, cu_out, dec, bsz, c0, end_tok, b_lo, span);
#pragma unroll
    for (int j = 0; j < KV_TOKENS_PER_THREAD; ++j) {
        int t = c0 + j * KV_THREADS + (int)threadIdx.x;
        if (t >= capacity) break;
        if (t < end_tok) {
            int b, start, d;
            if (span <= KV_TILE) {
                int k = kv_search_shared(s, 0, span, t);
                b = b_lo + k;
                start = s.cu[KV_PAD(k)];
                d = s.dec[k];
            } else {
                b = kv_search_global(cu_out, b_lo, b_lo + span, t);
                start = __ldcg(cu_out + b);
                d = dec[b];
            }
            kv_write_token<PosT>(t, b, (i64)d + (t - start), c, num_caches, capacity, batch_out, pos_out,
                                 slot_out, err);
        } else {
            kv_write_pad<PosT>(t, num_caches, capacity, batch_out, pos_out, slot_out);
        }
    }
}

// The last block out (of the `blocks` ticketed ones; metadata blocks take no ticket)
// resets the tickets and moves the epoch on (graph replay safe).
__device__ __forceinline__ void kv_finish_launch(unsigned int* __restrict__ state, u64 epoch, int blocks) {
    if (threadIdx.x == 0) {
        __threadfence();
        if (atomicAdd(&state[KV_STATE_DONE], 1u) == (unsigned int)(blocks - 1)) {
            state[KV_STATE_TICKET] = 0u;
            state[KV_STATE_SCAN_DONE] = 0u;
            state[KV_STATE_DONE] = 0u;
            state[KV_STATE_EPOCH] = (unsigned int)(epoch + 1);
            __threadfence();
        }
    }
}

// The fused step: the small-batch path (kv_step_small) or the large-batch one: grid =
// num_chunks + ceil(bsz / KV_TILE) blocks, tickets below num_tiles scan
// (kv_large_scan), the others write tokens (kv_large_tokens). Error records: small path
// and token chunk k in slot k, scan tile i in slot num_chunks + i, metadata block m in
// slot num_chunks + max_tiles + m. The launch's last num_meta blocks are metadata
// blocks (kv_step_params sends them to kv_meta_block): the token blocks are
// gridDim.x - num_meta (computed that way, a parameter and a special register, so
// nothing more is live in the token path).
template <typename PosT>
__device__ void kv_step(KvShared& s, const int* __restrict__ dec, const int* __restrict__ q, int bsz, int capacity,
                        int num_caches, const KvCaches& c, int* __restrict__ cu_out,
                        int* __restrict__ num_tokens_out, int* __restrict__ batch_out,
                        PosT* __restrict__ pos_out, int* __restrict__ kv_out, i64* __restrict__ slot_out,
                        u64* __restrict__ rec, unsigned int* __restrict__ state,
                        u64* __restrict__ tile_status, int num_meta) {
    // err and num_chunks before the branch (the large path's): declared after it, ptxas
    // (CUDA 13) allocates one more register for sm_90 (80 instead of 79).
    KvErr err;
    err.mask = 0u;
    err.key = KV_NO_ERROR;
    const int num_chunks = (capacity + KV_TOKENS - 1) / KV_TOKENS;
    if (bsz <= KV_TILE) {
        kv_step_small<PosT>(s, dec, q, bsz, capacity, num_caches, c, cu_out, num_tokens_out, batch_out, pos_out,
                            kv_out, slot_out, rec, (int)gridDim.x - num_meta);
        return;
    }
    const int num_tiles = (bsz + KV_TILE - 1) / KV_TILE;
    int ticket;
    u64 epoch;
    kv_take_ticket(s, state, ticket, epoch);
    int rec_slot;
    if (ticket < num_tiles) {
        rec_slot = num_chunks + ticket;
        kv_large_scan(s, ticket, num_tiles, epoch, dec, q, bsz, capacity, cu_out, num_tokens_out, kv_out, state,
                      tile_status, err);
    } else {
        const int chunk = ticket - num_tiles;
        rec_slot = chunk;
        kv_large_tokens<PosT>(s, chunk, num_tiles, num_chunks, dec, bsz, capacity, num_caches, c, cu_out,
                              batch_out, pos_out, slot_out, state, err);
    }
    kv_store_errors(err, rec, rec_slot);
    kv_finish_launch(state, epoch, (int)gridDim.x - num_meta);
}

// ---- attention metadata (docs/attention.md): the metadata blocks of the launch ----
//
// With attention outputs asked for, the grid has num_meta more blocks after the token
// blocks (whose count the kernel derives from bsz and capacity, as the planner does).
// They take no ticket and wait for no block: each reads the lengths itself. Metadata
// block m works for cache g = m / meta_per_cache (cache 0 only for varlen alone) and
// k = m % meta_per_cache:
//   * it scans ALL requests, KV_TILE at a time (thread-blocked items, a warp-shuffle
//     block scan of three saturating sums at once: tokens n_b, L_b = seq_lens_kv and
//     pages ceil(L_b / B_g)), carrying the prefixes from tile to tile;
//   * it writes the per-request outputs of requests [k * rq, (k + 1) * rq) of its cache
//     (rq = ceil((bsz + 1) / meta_per_cache)): kv_indptr, kv_last_page_len, and with
//     g = 0 cu_seqlens_k; it checks those requests' rows (bit 1: the row cannot hold
//     the pages) and the capacity (bit 16: the one request whose pages cross N), keyed
//     at the request's first token;
//   * it copies the kv_indices entries [k * E, min((k + 1) * E, N)) of its cache while
//     the tile holding them is in shared memory (consecutive threads, consecutive
//     entries: coalesced reads of row prefixes and coalesced writes), records bit 2 for
//     a negative block id, and writes -1 from kv_indptr[g][bsz] to the end of its range;
//   * block 0 reduces max_seqlen_q / max_seqlen_k and stores them (plain stores: no
//     atomics, nothing to reset between graph replays);
//   * it stores its warps' error records in slot num_chunks + max_tiles + m.
// Nothing is read past a table row (column < W_g) or written past entry N - 1.

struct __align__(16) KvMetaShared {
    int q[KV_SCAN_WORDS];     // tokens of each request of the tile, then their exclusive prefix
                              // (cu_seqlens_q, absolute; padded index)
    int pg[KV_SCAN_WORDS];    // L_b of each request of the tile, then the exclusive prefix of the
                              // pages (kv_indptr, absolute; padded index); pg[KV_PAD(count)] = end
    int wsum[3][KV_WARPS];    // per-warp totals of the three scans
    int wmax[2][KV_WARPS];    // per-warp maxima (tokens, L)
    int carry[4];             // prefixes (tokens, L, pages) of the tiles before; a tile's first page
};

// kv_meta_block2's shared memory (the request-parallel metadata blocks, below).
#define KV_META_IMPL_MASK 255  // KvStepParams::meta_impl & mask: the implementation (0..3)
#define KV_META_NO_PREFIX 256  // ablation bit of meta_impl (kv_meta_block3 only): no pass 1
#define KV_META_NO_COPY 512  // ablation bit of meta_impl (kv_meta_block3 only): no row copy
#define KV_META_PRE 16 // kv_meta_block3: row columns per lane loaded before the barrier
#define KV_META_U 16  // kv_meta_block2: row entries in flight per lane (the copy)
#define KV_META_R 4  // kv_meta_block2: requests in flight per thread and array (pass 1, scalar loads)
#define KV_META_RV 2  // kv_meta_block2: int4 loads in flight per thread and array (pass 1, aligned lengths)

struct __align__(16) KvMeta2Shared {
    int start[KV_THREADS];         // first kv_indices entry of each staged request (saturated)
    int pages[KV_THREADS];         // its pages
    int token[KV_THREADS];         // its first token (cu_seqlens_q, the error key's token)
    int red[7][KV_WARPS];          // per-warp partial sums / maxima of pass 1, then warp sums of the scan
    int x[3][KV_THREADS];          // a round's (tokens, L, pages), then their exclusive in-warp prefixes
    int carry[3];                  // prefixes (tokens, L, pages) of the requests before the round
    int total;                     // total pages of the cache (pass 1), read by the pad
};

// kv_meta_block3's shared memory (meta_impl 3: one round, below).
struct __align__(16) KvMeta3Shared {
    int x[3][KV_THREADS];   // in-warp exclusive prefixes (tokens, L, pages) of the block's request tid
    int pages[KV_THREADS];  // pages of the block's request tid (the copy loop's rows, no reload)
    int red[10][KV_WARPS];  // per-warp partials of pass 1 (7), then the warps' totals of the block's requests (3)
};

// The token blocks' and the metadata blocks' shared memory (a block is one or the other).
union KvSharedAll {
    KvShared step;
    KvMetaShared meta;
    KvMeta2Shared meta2;  // kv_meta_block2's (meta_impl 1, 2)
    KvMeta3Shared meta3;  // kv_meta_block3's (meta_impl 3)
};

// ceil(L / B) for L >= 0, B >= 1 (no overflow).
__device__ __forceinline__ int kv_pages(int L, int B) {
    const unsigned int l = (unsigned int)L, b = (unsigned int)B;
    const unsigned int qd = l / b;
    return (int)(qd + (l - qd * b != 0u ? 1u : 0u));
}

// Block-wide inclusive scan (saturating) of one value per thread, thread-blocked order;
// the warp totals go to w[warp]. The caller passes a barrier before reading w.
__device__ __forceinline__ int kv_warp_inclusive(int x) {
    const int lane = threadIdx.x & 31;
#pragma unroll
    for (int off = 1; off < 32; off <<= 1) {
        const int y = __shfl_up_sync(0xffffffffu, x, off);
        if (lane >= off) x = kv_sat_add(x, y);
    }
    return x;
}

// Sum (saturating) of w[0..warp) and of w[0..KV_WARPS).
__device__ __forceinline__ void kv_warp_prefix(const int* w, int warp, int& before, int& total) {
    before = 0;
    total = 0;
#pragma unroll
    for (int i = 0; i < KV_WARPS; ++i) {
        const int v = w[i];
        if (i < warp) before = kv_sat_add(before, v);
        total = kv_sat_add(total, v);
    }
}

// Copy kv_indices entries [a, z) of cache g (a < z <= N), every one inside this tile's
// pages: entry e belongs to the tile's request k with pg[k] <= e < pg[k + 1].
__device__ __forceinline__ void kv_meta_copy(const KvMetaShared& sm, int a, int z, int base, int count,
                                             const int* __restrict__ table, i64 stride, int width, int g,
                                             int* __restrict__ out, KvErr& err) {
    constexpr int U = 8;  // entries per thread in flight
    int k = 0;            // the request of this thread's last entry (entries only grow)
    for (int e0 = a + (int)threadIdx.x; e0 < z; e0 += U * KV_THREADS) {
        int row[U], v[U];
#pragma unroll
        for (int u = 0; u < U; ++u) {
            const int e = e0 + u * KV_THREADS;
            row[u] = -1;
            v[u] = -1;
            if (e < z) {
                if (sm.pg[KV_PAD(k + 1)] <= e) {  // not the last entry's request: search the rest
                    int lo = k + 1, hi = count;
                    while (hi - lo > 1) {
                        const int mid = (lo + hi) >> 1;
                        if (sm.pg[KV_PAD(mid)] <= e) lo = mid; else hi = mid;
                    }
                    k = lo;
                }
                row[u] = k;
                const int col = e - sm.pg[KV_PAD(k)];
                if (col < width) v[u] = __ldg(table + (i64)(base + k) * stride + col);
                else row[u] = -2 - k;  // beyond the row: -1, no bit 2 (bit 1 is the request's)
            }
        }
#pragma unroll
        for (int u = 0; u < U; ++u) {
            const int e = e0 + u * KV_THREADS;
            if (row[u] != -1) {
                if (row[u] >= 0 && v[u] < 0) err.flag(KV_ERR_NEGATIVE_BLOCK, sm.q[KV_PAD(row[u])], base + row[u], g);
                out[e] = v[u] < 0 ? -1 : v[u];
            }
        }
    }
}

// Cache g's table, row stride, width and block size (selects: no dynamic index into
// the parameter struct, which would copy it to local memory).
__device__ __forceinline__ void kv_meta_cache(const KvStepParams& p, int g, const int*& table, i64& stride,
                                              int& width, int& B) {
    table = g == 0 ? p.block_tables[0] : g == 1 ? p.block_tables[1] : g == 2 ? p.block_tables[2] : p.block_tables[3];
    stride = g == 0 ? p.table_stride[0] : g == 1 ? p.table_stride[1] : g == 2 ? p.table_stride[2] : p.table_stride[3];
    width = g == 0 ? p.max_blocks[0] : g == 1 ? p.max_blocks[1] : g == 2 ? p.max_blocks[2] : p.max_blocks[3];
    B = g == 0 ? p.block_size[0] : g == 1 ? p.block_size[1] : g == 2 ? p.block_size[2] : p.block_size[3];
}

// One metadata block (m in [0, num_meta)); see the section comment above. The
// prefixes carried from tile to tile live in shared memory (sm.carry), so that
// little is live in registers while a tile's entries are copied.
__device__ __forceinline__ void kv_meta_block(KvMetaShared& sm, const KvStepParams& p, int m, int num_chunks) {
    KvErr err;
    err.mask = 0u;
    err.key = KV_NO_ERROR;
    const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
    const int bsz = p.bsz;
    const int g = m / p.meta_per_cache, k = m - g * p.meta_per_cache;
    const bool fi = (p.attention & KV_ATTN_FLASHINFER) != 0;
    if (tid < 4) sm.carry[tid] = 0;  // prefixes (tokens, L, pages) of the tiles before, and a tile's first page
    __syncthreads();                 // (read after the loop too, when bsz = 0)
    int mq = 0, ml = 0;  // this thread's maxima (tokens, L)
    for (int base = 0; base < bsz; base += KV_TILE) {
        const int count = min(KV_TILE, bsz - base);
        const int ipt = (count + KV_THREADS - 1) / KV_THREADS;  // items per thread (thread-blocked)
        const int first = tid * ipt;                             // this thread's items [first, first + ipt)
        const int* table;
        i64 stride;
        int width, B;
        kv_meta_cache(p, g, table, stride, width, B);
        // load the tile's raw lengths, striped (coalesced; 16 loads in flight per thread: a
        // full tile in two round trips, a small batch in one; unroll 16 costs 110+ registers)
#pragma unroll 8
        for (int u = 0; u < KV_ITEMS; ++u) {
            const int i = u * KV_THREADS + tid;
            if (i < count) {
                sm.q[KV_PAD(i)] = p.seq_lens_this_time[base + i];
                sm.pg[KV_PAD(i)] = p.seq_lens_decoder[base + i];
            }
        }
        __syncthreads();
        // pass 1 (thread-blocked): n and L of each request in place, this thread's sums
        int tq = 0, tl = 0, tp = 0;
#pragma unroll 1
        for (int j = 0; j < KV_ITEMS; ++j) {
            const int i = first + j;
            if (j < ipt && i < count) {
                const int n = sm.q[KV_PAD(i)], d = sm.pg[KV_PAD(i)];
                const bool bad = (d < 0) | (n < 0);
                const int nn = bad ? 0 : n;
                const int L = bad ? 0 : kv_sat_add(d, n);
                sm.q[KV_PAD(i)] = nn;
                sm.pg[KV_PAD(i)] = L;
                tq = kv_sat_add(tq, nn);
                tl = kv_sat_add(tl, L);
                tp = kv_sat_add(tp, kv_pages(L, B));
                mq = max(mq, nn);
                ml = max(ml, L);
            }
        }
        // block scan of (tq, tl, tp): warp shuffles, then the warp totals
        int iq = kv_warp_inclusive(tq), il = kv_warp_inclusive(tl), ip = kv_warp_inclusive(tp);
        if (lane == 31) {
            sm.wsum[0][warp] = iq;
            sm.wsum[1][warp] = il;
            sm.wsum[2][warp] = ip;
        }
        // exclusive within the warp (a saturated sum minus one part is not exact: shuffle)
        iq = __shfl_up_sync(0xffffffffu, iq, 1);
        il = __shfl_up_sync(0xffffffffu, il, 1);
        ip = __shfl_up_sync(0xffffffffu, ip, 1);
        if (lane == 0) iq = il = ip = 0;
        __syncthreads();
        int bq, bl, bp, Tq, Tl, Tp;
        kv_warp_prefix(sm.wsum[0], warp, bq, Tq);
        kv_warp_prefix(sm.wsum[1], warp, bl, Tl);
        kv_warp_prefix(sm.wsum[2], warp, bp, Tp);
        const int cq = sm.carry[0], cl = sm.carry[1], cp = sm.carry[2];
        int rq_ = kv_sat_add(cq, kv_sat_add(bq, iq));  // this thread's exclusive prefixes, absolute
        int rl = kv_sat_add(cl, kv_sat_add(bl, il));
        int rp = kv_sat_add(cp, kv_sat_add(bp, ip));
        // pass 2: per-request outputs and checks; the tile's prefixes into shared memory
        {
            const int N = p.kv_indices_capacity;
            const int rows_per_block = (bsz + 1 + p.meta_per_cache - 1) / p.meta_per_cache;
            const int r_lo = k * rows_per_block, r_hi = min(r_lo + rows_per_block, bsz + 1);
            const bool rows = (p.attention & (KV_ATTN_FLASHINFER | KV_ATTN_PAGE_TABLE)) != 0 && p.num_caches > 0;
            const bool varlen = (p.attention & KV_ATTN_VARLEN) != 0 && g == 0;
            const i64 row_off = (i64)g * p.attn_stride;
#pragma unroll 1
            for (int j = 0; j < KV_ITEMS; ++j) {
                const int i = first + j;
                if (j < ipt && i < count) {
                    const int b = base + i;
                    const int nn = sm.q[KV_PAD(i)], L = sm.pg[KV_PAD(i)];
                    const int P = kv_pages(L, B);
                    const int next = kv_sat_add(rp, P);
                    if (b >= r_lo && b < r_hi) {
                        if (fi) {
                            p.kv_indptr[row_off + b] = rp;
                            p.kv_last_page_len[row_off + b] =
                                L > 0 ? (int)((unsigned int)(L - 1) % (unsigned int)B) + 1 : 0;
                            if (rp <= N && N < next) err.flag(KV_ERR_KV_INDICES_CAPACITY, rq_, b, g);
                        }
                        if (rows && P > width) err.flag(KV_ERR_BLOCK_INDEX, rq_, b, g);
                        if (varlen) p.cu_seqlens_k[b] = rl;
                    }
                    sm.q[KV_PAD(i)] = rq_;
                    sm.pg[KV_PAD(i)] = rp;
                    rq_ = kv_sat_add(rq_, nn);
                    rl = kv_sat_add(rl, L);
                    rp = next;
                }
            }
        }
        __syncthreads();  // every thread has read sm.carry
        if (tid == 0) {
            sm.carry[3] = cp;  // the tile's pages are [cp, cp + Tp)
            sm.carry[0] = kv_sat_add(cq, Tq);
            sm.carry[1] = kv_sat_add(cl, Tl);
            sm.carry[2] = kv_sat_add(cp, Tp);
            sm.pg[KV_PAD(count)] = kv_sat_add(cp, Tp);
        }
        __syncthreads();
        if (fi) {
            const int N = p.kv_indices_capacity;
            const int e_lo = (int)min((i64)k * p.meta_entries, (i64)N);
            const int e_hi = (int)min((i64)e_lo + p.meta_entries, (i64)N);
            const int a = max(e_lo, sm.carry[3]), z = min(e_hi, sm.carry[2]);
            if (a < z) kv_meta_copy(sm, a, z, base, count, table, stride, width, g, p.kv_indices + (i64)g * N, err);
        }
        __syncthreads();  // the next tile overwrites sm
        {
            // Nothing left for this block in later tiles (its entries copied, its requests
            // written, no maxima to reduce): stop scanning (block-uniform).
            const int rows_per_block = (bsz + 1 + p.meta_per_cache - 1) / p.meta_per_cache;
            const int r_hi = min(k * rows_per_block + rows_per_block, bsz + 1);
            const int e_hi = fi ? (int)min(min((i64)k * p.meta_entries, (i64)p.kv_indices_capacity) + p.meta_entries,
                                           (i64)p.kv_indices_capacity)
                                : 0;
            const bool maxima = (p.attention & KV_ATTN_VARLEN) != 0 && m == 0;
            if (!maxima && r_hi <= base + count && sm.carry[2] >= e_hi) break;
        }
    }
    // entry bsz of the per-request outputs, the pad, the maxima, the error records
    {
        const int rows_per_block = (bsz + 1 + p.meta_per_cache - 1) / p.meta_per_cache;
        const int r_lo = k * rows_per_block, r_hi = min(r_lo + rows_per_block, bsz + 1);
        const bool varlen = (p.attention & KV_ATTN_VARLEN) != 0 && g == 0;
        const int cl = sm.carry[1], cp = sm.carry[2];
        if (bsz >= r_lo && bsz < r_hi && tid == 0) {
            if (fi) p.kv_indptr[(i64)g * p.attn_stride + bsz] = cp;
            if (varlen) p.cu_seqlens_k[bsz] = cl;
        }
        if (fi) {
            const int N = p.kv_indices_capacity;
            const int e_lo = (int)min((i64)k * p.meta_entries, (i64)N);
            const int e_hi = (int)min((i64)e_lo + p.meta_entries, (i64)N);
            int* __restrict__ out = p.kv_indices + (i64)g * N;
            for (int e = max(e_lo, cp) + tid; e < e_hi; e += KV_THREADS) out[e] = -1;
        }
        if (varlen && m == 0) {
            mq = __reduce_max_sync(0xffffffffu, mq);
            ml = __reduce_max_sync(0xffffffffu, ml);
            if (lane == 0) {
                sm.wmax[0][warp] = mq;
                sm.wmax[1][warp] = ml;
            }
            __syncthreads();
            if (tid == 0) {
                int a = 0, z = 0;
#pragma unroll
                for (int i = 0; i < KV_WARPS; ++i) {
                    a = max(a, sm.wmax[0][i]);
                    z = max(z, sm.wmax[1][i]);
                }
                p.max_seqlen[0] = a;
                p.max_seqlen[1] = z;
            }
        }
    }
    kv_store_errors(err, p.error_records, num_chunks + p.max_tiles + m);
}

// ---- attention metadata, request-parallel (KvStepParams::meta_impl = 1, the default) ----
//
// Metadata block m works for cache g = m / meta_per_cache and k = m % meta_per_cache, as
// kv_meta_block, but splits the requests, not the entries, among the blocks of a cache:
//   1. one register pass over all lengths (striped, coalesced, 8 loads in flight per
//      thread and array, no shared-memory pass): the saturating sums of tokens, L_b and
//      pages of the requests before its range [r0, r1) (rq = ceil(bsz / meta_per_cache)
//      requests per block), the total pages and the maxima; one barrier reduces them;
//   2. its own requests, KV_THREADS at a time: one per thread, a block scan (warp
//      shuffles + warp sums, one barrier) gives each its absolute prefixes; the thread
//      writes kv_indptr, kv_last_page_len, cu_seqlens_k and checks bits 1 and 16 (keys
//      as kv_meta_block) and stages (first page, pages, first token) in shared memory;
//   3. groups of meta_lanes lanes (4, 8, 16 or 32) copy one request's row prefix each,
//      entries [first page, min(first page + pages, N)): consecutive lanes, consecutive
//      columns (coalesced row reads and writes, no search), KV_META_U loads in flight per
//      lane; a column >= W_g gives -1 (bit 1 is the request's), a negative id -1 and bit 2;
//   4. the pad: entries [max(k * E, total), min((k + 1) * E, N)) get -1 (fixed entry
//      ranges, as kv_meta_block: every element of kv_indices written on every call);
//   5. k = 0 writes entry bsz of kv_indptr / cu_seqlens_k (the totals of pass 1), block 0 the maxima.
// With meta_impl = 2, between 1 and 2 the block prefetches into L2 the first copy round's
// columns of its first KV_THREADS requests' rows (prefetch.global.L2; no result, no fault).
// No block waits for another and no state is kept between launches.

// Pass 1 of kv_meta_block2, per thread: saturating sums of tokens, L and pages of the
// requests before r0 (bq, bl, bp), of all L and pages (tl, tp), and the maxima (mq, ml).
// kv_meta_block2's lanes per request: 4, 8, 16 or 32 (anything else: 32).
__device__ __forceinline__ int kv_meta_lanes(int lanes) {
    return lanes == 4 || lanes == 8 || lanes == 16 ? lanes : 32;
}

// min(a + b, KV_INT_MAX) for a, b in [0, KV_INT_MAX] (= kv_sat_add there; the unsigned sum
// cannot wrap): one add and one min.
__device__ __forceinline__ int kv_sat_add_nn(int a, int b) {
    return (int)min((unsigned int)a + (unsigned int)b, (unsigned int)KV_INT_MAX);
}

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
__device__ __forceinline__ int kv_warp_sat_sum(int x) {
#pragma unroll
    for (int off = 16; off > 0; off >>= 1) x = kv_sat_add(x, __shfl_xor_sync(0xffffffffu, x, off));
    return x;
}

// Pass 1 of kv_meta_block2/3: one pass over all bsz lengths in registers (striped,
// coalesced; int4 loads when both length arrays are 16-byte aligned, then the bsz % 4
// tail), accumulated into acc (this thread's part; the caller reduces across threads).
template <bool POW2, bool VL>
__device__ __forceinline__ void kv_meta_pass1_t(const KvStepParams& p, int bsz, int r0, int B, int sh,
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
__device__ __forceinline__ void kv_meta_pass1(const KvStepParams& p, int bsz, int r0, int B, bool varlen,
                                              KvMetaAcc& acc) {
    if ((B & (B - 1)) == 0) {
        if (varlen) kv_meta_pass1_t<true, true>(p, bsz, r0, B, __ffs(B) - 1, acc);
        else kv_meta_pass1_t<true, false>(p, bsz, r0, B, __ffs(B) - 1, acc);
    } else {
        if (varlen) kv_meta_pass1_t<false, true>(p, bsz, r0, B, 0, acc);
        else kv_meta_pass1_t<false, false>(p, bsz, r0, B, 0, acc);
    }
}

__device__ __forceinline__ void kv_meta_block2(KvMeta2Shared& sm, const KvStepParams& p, int m, int num_chunks) {
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
    kv_meta_pass1(p, bsz, r0, B, varlen, acc);
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
    // 1b. (meta_impl 2) L2 prefetch of the first copy round's row prefixes of the block's
    // first KV_THREADS requests (a warp per request, a 128-byte line per lane): their DRAM
    // latency overlaps the scan below. (Before pass 1 it costs the kernel 7 registers.)
    if (fi && p.meta_impl == 2) {  // (meta_impl unmasked: the ablation bits are kv_meta_block3's)
        const int cnt = min(KV_THREADS, r1 - r0), cols_max = KV_META_U * kv_meta_lanes(p.meta_lanes);
#pragma unroll 1
        for (int i = warp; i < cnt; i += KV_WARPS) {
            const int d = __ldg(p.seq_lens_decoder + r0 + i), n = __ldg(p.seq_lens_this_time + r0 + i);
            const int L = (d < 0) | (n < 0) ? 0 : kv_sat_add(d, n);
            const int cols = min(min(kv_pages(L, B), width), cols_max);
            const int* row = table + (i64)(r0 + i) * stride;
#pragma unroll 1
            for (int col = lane * 32; col < cols; col += 32 * 32) asm volatile("prefetch.global.L2 [%0];" ::"l"(row + col));
        }
    }
    // 2. + 3. this block's requests, KV_THREADS at a time
    const int lanes = kv_meta_lanes(p.meta_lanes), group = tid / lanes, sub = tid - group * lanes;
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

// ---- attention metadata in one round (KvStepParams::meta_impl = 3) ----
//
// kv_meta_block2's outputs, error records and work split (block (g, k) owns requests
// [r0, r1), rq = ceil(bsz / meta_per_cache)), for rq <= KV_THREADS (kv_step_params sends
// larger rq to kv_meta_block2), with a shorter chain of dependent round trips and barriers:
//   a. every thread loads its own request's lengths (request r0 + tid) and every group of
//      meta_lanes lanes the lengths of its first request (r0 + group), in the same round
//      trip as pass 1's first loads (kv_meta_pass1, as kv_meta_block2's);
//   b. right after pass 1 the group issues the loads of that request's first
//      KV_META_PRE * lanes row columns (in-bounds columns < min(pages, W_g): the addresses
//      need no prefix, only the write positions do): they are in flight during the warp
//      reductions, the scans and the barrier (issued before pass 1 instead, they cost the
//      kernel 8-21 registers on sm_90: 88-101 > the token path's 80);
//   c. in-warp shuffle scans of the own requests' (tokens, L, pages) go to shared memory
//      with pass 1's per-warp partials: ONE barrier, after which every thread knows the
//      absolute prefixes of any request of the block (pass 1's sums before r0 + the warp
//      totals before + the in-warp exclusive prefix);
//   d. the stores of the loaded row columns (bit 2), the per-request outputs and bits 1/16,
//      entry bsz / maxima, the rest of the rows (block2's copy loop), the pad.
// Per launch that is: 2 dependent round trips (lengths, then rows) and 1 barrier before
// the first kv_indices store when every block's rows fit in KV_META_PRE * lanes columns and
// bsz <= 2048 (kv_meta_block2: 4 round trips and 4 barriers), and nothing shared-memory
// one value at a time.
// Ablation bits (KvStepParams::meta_impl above KV_META_IMPL_MASK; benchmarks only, the
// outputs are then wrong): KV_META_NO_PREFIX skips pass 1 (prefixes 0, no pad),
// KV_META_NO_COPY skips the row loads and kv_indices stores.

// Sum (saturating) of w[0..upto) (block-uniform reads from shared memory).
__device__ __forceinline__ int kv_meta_sum_before(const int* w, int upto) {
    int s = 0;
#pragma unroll
    for (int i = 0; i < KV_WARPS; ++i)
        if (i < upto) s = kv_sat_add(s, w[i]);
    return s;
}

__device__ __forceinline__ void kv_meta_block3(KvMeta3Shared& sm, const KvStepParams& p, int m, int num_chunks) {
    KvErr err;
    err.mask = 0u;
    err.key = KV_NO_ERROR;
    const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
    const int bsz = p.bsz, N = p.kv_indices_capacity;
    const int g = m / p.meta_per_cache, k = m - g * p.meta_per_cache;
    const bool fi = (p.attention & KV_ATTN_FLASHINFER) != 0;
    const bool varlen = (p.attention & KV_ATTN_VARLEN) != 0 && g == 0;
    const bool rows = (p.attention & (KV_ATTN_FLASHINFER | KV_ATTN_PAGE_TABLE)) != 0 && p.num_caches > 0;
    const bool copy = fi && (p.meta_impl & KV_META_NO_COPY) == 0;
    const int* table;
    i64 stride;
    int width, B;
    kv_meta_cache(p, g, table, stride, width, B);
    const int rq = (bsz + p.meta_per_cache - 1) / p.meta_per_cache;
    const int r0 = (int)min((i64)k * rq, (i64)bsz), own = min(r0 + rq, bsz) - r0;  // own <= KV_THREADS
    const int lanes = kv_meta_lanes(p.meta_lanes), group = tid / lanes, sub = tid - group * lanes;
    const int groups = KV_THREADS / lanes;
    // a. lengths of this thread's request and of the group's first one (in flight during pass 1)
    int d0 = 0, n0 = 0, gd = 0, gn = 0;
    if (tid < own) {
        d0 = __ldg(p.seq_lens_decoder + r0 + tid);
        n0 = __ldg(p.seq_lens_this_time + r0 + tid);
    }
    if (copy && group < own) {
        gd = __ldg(p.seq_lens_decoder + r0 + group);
        gn = __ldg(p.seq_lens_this_time + r0 + group);
    }
    // pass 1: sums before r0, totals, maxima (all lengths; skipped by the ablation bit)
    KvMetaAcc acc;
    if ((p.meta_impl & KV_META_NO_PREFIX) == 0) kv_meta_pass1(p, bsz, r0, B, varlen, acc);
    else acc.bq = acc.bl = acc.bp = acc.tl = acc.tp = acc.mq = acc.ml = 0;
    // b. the group's first request: its first row columns in flight across the barrier
    const int gP = kv_pages((gd < 0) | (gn < 0) ? 0 : kv_sat_add(gd, gn), B);  // 0 without a request
    const int gcols = min(gP, width);
    const int* __restrict__ grow = table + (i64)(r0 + group) * stride;  // dereferenced only for group < own
    int v[KV_META_PRE];
#pragma unroll
    for (int u = 0; u < KV_META_PRE; ++u) {
        const int col = sub + u * lanes;
        v[u] = -1;
        if (col < gcols) v[u] = __ldg(grow + col);
    }
    // c. in-warp scans of the own requests, pass 1's warp partials; one barrier
    const bool bad0 = (d0 < 0) | (n0 < 0);
    const int nn0 = bad0 ? 0 : n0, L0 = bad0 ? 0 : kv_sat_add(d0, n0), P0 = kv_pages(L0, B);
    {
        const int iq = kv_warp_inclusive(nn0), il = kv_warp_inclusive(L0), ip = kv_warp_inclusive(P0);
        const int eq = __shfl_up_sync(0xffffffffu, iq, 1), el = __shfl_up_sync(0xffffffffu, il, 1),
                  ep = __shfl_up_sync(0xffffffffu, ip, 1);  // exact exclusive prefixes
        sm.x[0][tid] = lane == 0 ? 0 : eq;
        sm.x[1][tid] = lane == 0 ? 0 : el;
        sm.x[2][tid] = lane == 0 ? 0 : ep;
        sm.pages[tid] = P0;
        if (lane == 31) {
            sm.red[7][warp] = iq;
            sm.red[8][warp] = il;
            sm.red[9][warp] = ip;
        }
    }
    {
        const int bq = kv_warp_sat_sum(acc.bq), bl = kv_warp_sat_sum(acc.bl), bp = kv_warp_sat_sum(acc.bp);
        const int tl = kv_warp_sat_sum(acc.tl), tp = kv_warp_sat_sum(acc.tp);
        const int mq = __reduce_max_sync(0xffffffffu, acc.mq), ml = __reduce_max_sync(0xffffffffu, acc.ml);
        if (lane == 0) {
            sm.red[0][warp] = bq;
            sm.red[1][warp] = bl;
            sm.red[2][warp] = bp;
            sm.red[3][warp] = tp;
            sm.red[4][warp] = mq;
            sm.red[5][warp] = ml;
            sm.red[6][warp] = tl;
        }
    }
    __syncthreads();  // the only barrier: nothing in shared memory is written after it
    const int cq = kv_meta_sum_before(sm.red[0], KV_WARPS), cp = kv_meta_sum_before(sm.red[2], KV_WARPS);
    const i64 row_off = (i64)g * p.attn_stride;
    int* __restrict__ out = p.kv_indices + (i64)g * N;
    if (copy) {
        // the group's requests i = group, group + groups, ...: the first one's loaded columns
        // (stored here, before the loop: v is dead in it), then (block2's copy loop) the rest
        // of its row and the other requests' rows
        if (group < own) {
            const int wi = group >> 5;
            const int s0 = kv_sat_add(cp, kv_sat_add(kv_meta_sum_before(sm.red[9], wi), sm.x[2][group]));
            const int tok = kv_sat_add(cq, kv_sat_add(kv_meta_sum_before(sm.red[7], wi), sm.x[0][group]));
            const int end = s0 < N ? min(gP, N - s0) : 0;
#pragma unroll
            for (int u = 0; u < KV_META_PRE; ++u) {
                const int col = sub + u * lanes;
                if (col < end) {
                    if (col < width && v[u] < 0) err.flag(KV_ERR_NEGATIVE_BLOCK, tok, r0 + group, g);
                    out[s0 + col] = v[u] < 0 ? -1 : v[u];
                }
            }
        }
    }
    // d. this thread's request: absolute prefixes, per-request outputs, bits 1 and 16
    if (tid < own) {
        const int b = r0 + tid;
        const int xq = kv_sat_add(cq, kv_sat_add(kv_meta_sum_before(sm.red[7], warp), sm.x[0][tid]));
        const int xp = kv_sat_add(cp, kv_sat_add(kv_meta_sum_before(sm.red[9], warp), sm.x[2][tid]));
        if (fi) {
            p.kv_indptr[row_off + b] = xp;
            p.kv_last_page_len[row_off + b] = L0 > 0 ? (int)((unsigned int)(L0 - 1) % (unsigned int)B) + 1 : 0;
            if (xp <= N && N < kv_sat_add(xp, P0)) err.flag(KV_ERR_KV_INDICES_CAPACITY, xq, b, g);
        }
        if (rows && P0 > width) err.flag(KV_ERR_BLOCK_INDEX, xq, b, g);
        if (varlen) {
            const int cl = kv_meta_sum_before(sm.red[1], KV_WARPS);
            p.cu_seqlens_k[b] = kv_sat_add(cl, kv_sat_add(kv_meta_sum_before(sm.red[8], warp), sm.x[1][tid]));
        }
    }
    int total = kv_meta_sum_before(sm.red[3], KV_WARPS);
    if ((p.meta_impl & KV_META_NO_PREFIX) != 0) total = N;  // ablation: no pad
    if (tid == 0) {  // entry bsz (block k = 0), the maxima (block 0)
        if (k == 0 && fi) p.kv_indptr[row_off + bsz] = total;
        if (k == 0 && varlen) p.cu_seqlens_k[bsz] = kv_meta_sum_before(sm.red[6], KV_WARPS);
        if (varlen && m == 0) {
            int mq = 0, ml = 0;
#pragma unroll
            for (int i = 0; i < KV_WARPS; ++i) {
                mq = max(mq, sm.red[4][i]);
                ml = max(ml, sm.red[5][i]);
            }
            p.max_seqlen[0] = mq;
            p.max_seqlen[1] = ml;
        }
    }
    if (copy) {
#pragma unroll 1
        for (int i = group; i < own; i += groups) {
            const int wi = i >> 5;
            const int s0 = kv_sat_add(cp, kv_sat_add(kv_meta_sum_before(sm.red[9], wi), sm.x[2][i]));
            const int tok = kv_sat_add(cq, kv_sat_add(kv_meta_sum_before(sm.red[7], wi), sm.x[0][i]));
            const int rb = r0 + i;
            const int col_from = i == group ? sub + KV_META_PRE * lanes : sub;
            const int end = s0 < N ? min(sm.pages[i], N - s0) : 0;  // entries of this row below N
            const int* __restrict__ row = table + (i64)rb * stride;
#pragma unroll 1
            for (int col0 = col_from; col0 < end; col0 += KV_META_U * lanes) {
                int w[KV_META_U];
#pragma unroll
                for (int u = 0; u < KV_META_U; ++u) {
                    const int col = col0 + u * lanes;
                    w[u] = -1;
                    if (col < end && col < width) w[u] = __ldg(row + col);
                }
#pragma unroll
                for (int u = 0; u < KV_META_U; ++u) {
                    const int col = col0 + u * lanes;
                    if (col < end) {
                        if (col < width && w[u] < 0) err.flag(KV_ERR_NEGATIVE_BLOCK, tok, rb, g);
                        out[s0 + col] = w[u] < 0 ? -1 : w[u];
                    }
                }
            }
        }
    }
    // the pad of this block's fixed entry range
    if (fi) {
        const int e_lo = (int)min((i64)k * p.meta_entries, (i64)N);
        const int e_hi = (int)min((i64)e_lo + p.meta_entries, (i64)N);
#pragma unroll 1
        for (int e = max(e_lo, total) + tid; e < e_hi; e += KV_THREADS) out[e] = -1;
    }
    kv_store_errors(err, p.error_records, num_chunks + p.max_tiles + m);
}

// The fused step from its parameter struct: every field read by name, the caches
// gathered into registers (KvCaches), position_ids typed PosT.
template <typename PosT>
__device__ __forceinline__ void kv_step_params(const KvStepParams& p) {
    __shared__ KvSharedAll sh;
    if (p.num_meta > 0) {  // attention outputs: the blocks after the token blocks write them
        const int num_chunks = (p.capacity + KV_TOKENS - 1) / KV_TOKENS;
        const int token_blocks = p.bsz <= KV_TILE ? num_chunks : num_chunks + (p.bsz + KV_TILE - 1) / KV_TILE;
        if ((int)blockIdx.x >= token_blocks) {
            const int impl = p.meta_impl & KV_META_IMPL_MASK;
            if (impl == 3 && (p.bsz + p.meta_per_cache - 1) / p.meta_per_cache <= KV_THREADS)
                kv_meta_block3(sh.meta3, p, (int)blockIdx.x - token_blocks, num_chunks);
            else if (impl != 0) kv_meta_block2(sh.meta2, p, (int)blockIdx.x - token_blocks, num_chunks);
            else kv_meta_block(sh.meta, p, (int)blockIdx.x - token_blocks, num_chunks);
            return;
        }
    }
    KvShared& s = sh.step;
    KvCaches c;
#pragma unroll
    for (int g = 0; g < KV_MAX_CACHES; ++g) {
        c.table[g] = p.block_tables[g];
        c.stride[g] = p.table_stride[g];
        c.width[g] = p.max_blocks[g];
        c.bs[g] = p.block_size[g];
    }
    kv_step<PosT>(s, p.seq_lens_decoder, p.seq_lens_this_time, p.bsz, p.capacity, p.num_caches, c, p.cu_seqlens_q,
                  p.num_tokens, p.batch_id_per_token, static_cast<PosT*>(p.position_ids), p.seq_lens_kv,
                  p.slot_mapping, p.error_records, p.tile_state, p.tile_status, p.num_meta);
}

// The fused step, position_ids int64 / int32: one parameter, the whole step by name.
extern "C" __global__ void __launch_bounds__(KV_THREADS, 2) kvaddr_step_i64(const KvStepParams params) {
    kv_step_params<i64>(params);
}

extern "C" __global__ void __launch_bounds__(KV_THREADS, 2) kvaddr_step_i32(const KvStepParams params) {
    kv_step_params<int>(params);
}

// ---- v9: the small-batch step (docs/perf-notes.md, "v9") ----
//
// kvaddr_step1_c{G}_i64 / _i32, G = 0..4 caches (a template parameter: no per-cache loop
// or predicate at run time; the planner picks the kernel by name). For bsz <= KV_SB_THREADS
// requests: blocks of T threads (T a multiple of 32, bsz <= T <= KV_SB_THREADS, chosen by
// the planner: T = max(bsz, min(C, 256), 32) rounded up), grid = ceil(C / T), a token per
// thread (token blockIdx.x * T + threadIdx.x). Every block scans all bsz lengths itself
// (one request per thread), so no block tests or waits for another; with C <= T it is ONE
// block. Thread i owns request i:
//   1. One round trip: its lengths; in block 0 the decode guess (token i is request i, at
//      position seq_lens_decoder[i]) issues its block-table loads at once.
//   2. A warp-shuffle scan, one barrier (none for one warp), every warp scans the warp totals: each
//      thread has its request's exclusive and inclusive prefix; block 0 writes cu_seqlens_q,
//      seq_lens_kv and the request errors (bits 4 and 8), and, if the guess holds (prefix ==
//      i and the request runs a token), token i from the loads of 1. Padding tokens
//      [num_tokens, C) are written before the second barrier too.
//   3. A second barrier (a __syncwarp for one warp: the prefixes in shared memory); the
//      tokens the guess did not cover try "token t is request t / n0" (n0: request 0's
//      tokens), else binary-search their request there.
// Error records: warp w of block k merges into record k * T / 32 + w, only when it found an
// error (sticky, kv_merge_record; the planner sizes the records for every kernel it may run).
// With attention metadata: kvaddr_step1m_* below (these token blocks plus metadata blocks).
// CUDA-graph safe: no state outlives the launch.
#define KV_SB_THREADS 1024
#define KV_SB_WARPS 32  // KV_SB_THREADS / 32

struct KvOneShared {
    int cu[KV_SB_THREADS];       // exclusive prefix of request i (i < bsz)
    int dec[KV_SB_THREADS];      // seq_lens_decoder[i] (searched tokens only read good requests)
    int warp_sums[KV_SB_WARPS];  // inclusive total of each warp
};

// Block ids of request b's position pos in caches 0..G-1 (-1 where the index is beyond
// the row: the store sees that from pos again).
template <int G>
__device__ __forceinline__ void kv1_load_blocks(const KvStepParams& p, int b, i64 pos, int (&blk)[G > 0 ? G : 1]) {
#pragma unroll
    for (int g = 0; g < G; ++g) {
        i64 idx, off;
        kv_divmod(pos, p.block_size[g], idx, off);
        blk[g] = idx < p.max_blocks[g] ? p.block_tables[g][(i64)b * p.table_stride[g] + idx] : -1;
    }
}

template <int G, typename PosT>
__device__ __forceinline__ void kv1_store_token(const KvStepParams& p, int t, int b, i64 pos,
                                                const int (&blk)[G > 0 ? G : 1], KvErr& err) {
    p.batch_id_per_token[t] = b;
    static_cast<PosT*>(p.position_ids)[t] = (PosT)pos;
#pragma unroll
    for (int g = 0; g < G; ++g) {
        i64 idx, off, slot = -1;
        kv_divmod(pos, p.block_size[g], idx, off);
        if (idx >= p.max_blocks[g]) err.flag(KV_ERR_BLOCK_INDEX, t, b, g);
        else if (blk[g] < 0) err.flag(KV_ERR_NEGATIVE_BLOCK, t, b, g);
        else slot = (i64)blk[g] * p.block_size[g] + off;
        p.slot_mapping[(i64)g * p.capacity + t] = slot;
    }
}

template <int G, typename PosT>
__device__ __forceinline__ void kv1_store_pad(const KvStepParams& p, int t) {
    kv_st(p.batch_id_per_token + t, -1);
    kv_st(static_cast<PosT*>(p.position_ids) + t, (PosT)0);
#pragma unroll
    for (int g = 0; g < G; ++g) kv_st(p.slot_mapping + (i64)g * p.capacity + t, (i64)-1);
}

// ---- v9 ablation (issue 16; benchmarks/ablate_v9.py): kv_step_one's ABL bits ----
// ABL = 0 is v9 as shipped (every test below folds to a constant: the same code).
// KV_ABL_* bits SKIP a phase (timing only: outputs and error records may be wrong);
// KV_FIX_* bits are candidate fixes (correct: tests/gpu/test_ablate_v9_gpu.py).
#define KV_ABL_NO_ERR_STORE 1      // no error-record merge (not even the warp's vote): timing only
#define KV_ABL_NO_REQ_CHECKS 2     // lengths trusted: no bad-request test, no bits 4 and 8
#define KV_ABL_NO_SCAN 4           // decode assumed (request i = token i): no scan, barrier or search
#define KV_ABL_NO_PAD 8            // no padding stores [num_tokens, C)
#define KV_ABL_NO_REQ_OUT 16       // no cu_seqlens_q, seq_lens_kv, num_tokens stores
#define KV_ABL_PARAM_REGS 32       // every parameter field read into a register at entry (correct: also
                                   // a candidate fix; v9 reads bsz, compares, then the pointers)
#define KV_ABL_NO_TOKEN_CHECKS 64  // no block-index / negative-block checks (no guard on the load)
#define KV_FIX_DECODE_FIRST 128    // fix: one vote "every request is decode (n == 1, d >= 0)" replaces
                                   // the scan; the v9 scan runs only when the vote fails
#define KV_FIX_LEAN 256            // fix: pos / B computed once per token (load and store share it)
#define KV_ABL_UNGUARDED_LOADS 512 // every thread loads its lengths (no wait for bsz before the pointers;
                                   // reads past bsz: only for arrays allocated to T entries, timing only)
// (Bits 1024-8192, the record-clearing and record-store variants of the fifth session, are gone:
// since the sixth session no kernel clears records and a clean warp stores nothing.)
// The v9 default (kvaddr_step1_c*): the fixes measured fastest on the H200 (decode-first, lean,
// params in regs = mask 416; docs/perf-notes.md, "Fifth session").
// kvaddr_step1old_c* keep ABL = 0.
#define KV_V9_DEFAULT (KV_ABL_PARAM_REGS | KV_FIX_DECODE_FIRST | KV_FIX_LEAN)

// Block ids as kv1_load_blocks, also returning pos % B and whether pos / B is within the row
// (KV_FIX_LEAN), with the block-index guard optional (KV_ABL_NO_TOKEN_CHECKS).
// What does not depend on pos is made before pos arrives, so that between pos's arrival and a
// cache's block-id load there are only the quotient (a multiply-high and one correction) and the
// address (session 10: before, about fourteen dependent instructions and a constant-bank read):
//   * (session 9) a reciprocal of B made at entry: m = floor((2^32 - 1) / B) (B >= 1); for
//     p < 2^32, umulhi(p, m) is p / B or one less (p m / 2^32 > p / B - p / 2^32 > p / B - 1),
//     so one correction makes it exact (instead of the compiler's I2F, MUFU.RCP, F2I and two
//     corrections after pos arrives);
//   * (session 10) the bound: pos / B < max_blocks iff p < lim = min(max_blocks * B, 2^32 - 1)
//     (for p <= 2^32 - 2: every position; see kv1_load_blocks_x);
//   * (session 10) the rows where the request is known at entry (the decode guess:
//     kv1_rows_at_entry), passed through an identity shuffle. Without it ptxas re-made them from
//     the parameters after pos's arrival (the table pointer's and stride's constant-bank reads,
//     a 64-bit multiply fused with the index), under the load's predicate: about ten
//     instructions and a constant-bank round trip on the chain of every cache. It can neither
//     re-make nor fuse what a shuffle returned. Such an address has no address space for the
//     compiler, so the load is an explicit ld.global (a generic LD was slower: session 9).
template <int G>
struct Kv1Div {
    unsigned int m[G > 0 ? G : 1];    // floor((2^32 - 1) / B[g])
    unsigned int lim[G > 0 ? G : 1];  // min(max_blocks[g] * B[g], 2^32 - 1)
};
template <int G>
__device__ __forceinline__ void kv1_div_init(const KvStepParams& p, Kv1Div<G>& dv) {
#pragma unroll
    for (int g = 0; g < G; ++g) {
        const unsigned int bq = (unsigned int)p.block_size[g];  // >= 1 (the planner checks)
        dv.m[g] = 0xffffffffu / bq;
        const u64 lim = (u64)(unsigned int)p.max_blocks[g] * bq;
        dv.lim[g] = lim < 0xffffffffull ? (unsigned int)lim : 0xffffffffu;
    }
}
__device__ __forceinline__ u64 kv_global_addr(const int* ptr) {
#ifdef __CUDA_ARCH__
    u64 a;
    asm("cvta.to.global.u64 %0, %1;" : "=l"(a) : "l"(ptr));
    return a;
#else
    return (u64)ptr;
#endif
}
__device__ __forceinline__ int kv_ld_global(u64 addr) {
#ifdef __CUDA_ARCH__
    int v;
    asm volatile("ld.global.b32 %0, [%1];" : "=r"(v) : "l"(addr));  // volatile: never speculated
    return v;
#else
    return *(const int*)addr;
#endif
}
// Request b's row in every cache (global addresses).
template <int G>
__device__ __forceinline__ void kv1_rows(const KvStepParams& p, int b, u64 (&row)[G > 0 ? G : 1]) {
#pragma unroll
    for (int g = 0; g < G; ++g) row[g] = kv_global_addr(p.block_tables[g]) + (u64)((i64)b * p.table_stride[g]) * 4u;
}
// The same, at kernel entry, kept in registers (the identity shuffle above: every lane of the warp
// must be here, i.e. no divergence yet).
template <int G>
__device__ __forceinline__ void kv1_rows_at_entry(const KvStepParams& p, int b, u64 (&row)[G > 0 ? G : 1]) {
    kv1_rows<G>(p, b, row);
#ifdef __CUDA_ARCH__
#pragma unroll
    for (int g = 0; g < G; ++g) row[g] = __shfl_sync(0xffffffffu, row[g], threadIdx.x & 31);
#endif
}
// want: load at all (false: blk = -1). pos: 0 <= pos <= 2^32 - 2 for a token (the owner's
// seq_lens_decoder <= INT_MAX plus fewer than C <= INT_MAX tokens), so one 32-bit unsigned path
// covers every position (session 10; before, a 64-bit branch for pos > INT_MAX, with a 64-bit
// division call per cache in it). A guess's pos may be a negative length (its block ids are
// then never used): p32 wraps, and the load still reads inside the row (p32 < lim).
template <int G, bool CHECKS>
__device__ __forceinline__ void kv1_load_blocks_x(const KvStepParams& p, const Kv1Div<G>& dv,
                                                  const u64 (&row)[G > 0 ? G : 1], i64 pos, bool want,
                                                  int (&blk)[G > 0 ? G : 1], i64 (&off)[G > 0 ? G : 1],
                                                  bool (&inb)[G > 0 ? G : 1]) {
    const unsigned int p32 = (unsigned int)pos;
#pragma unroll
    for (int g = 0; g < G; ++g) {
        const unsigned int bq = (unsigned int)p.block_size[g];
        unsigned int q = __umulhi(p32, dv.m[g]);
        if (p32 - q * bq >= bq) ++q;
        inb[g] = p32 < dv.lim[g];
        off[g] = p32 - q * bq;
        blk[g] = want && (!CHECKS || inb[g]) ? kv_ld_global(row[g] + (u64)q * 4u) : -1;
    }
}

// kv1_store_token with pos % B and the bound test given; without checks every slot is blk * B + off.
template <int G, typename PosT, bool CHECKS>
__device__ __forceinline__ void kv1_store_token_x(const KvStepParams& p, int t, int b, i64 pos,
                                                  const int (&blk)[G > 0 ? G : 1], const i64 (&off)[G > 0 ? G : 1],
                                                  const bool (&inb)[G > 0 ? G : 1], KvErr& err) {
    kv_st(p.batch_id_per_token + t, b);
    kv_st(static_cast<PosT*>(p.position_ids) + t, (PosT)pos);
#pragma unroll
    for (int g = 0; g < G; ++g) {
        i64 slot = -1;
        if (!CHECKS) slot = (i64)blk[g] * p.block_size[g] + off[g];
        else if (!inb[g]) err.flag(KV_ERR_BLOCK_INDEX, t, b, g);
        else if (blk[g] < 0) err.flag(KV_ERR_NEGATIVE_BLOCK, t, b, g);
        else slot = (i64)blk[g] * p.block_size[g] + off[g];
        kv_st(p.slot_mapping + (i64)g * p.capacity + t, slot);
    }
}

// KV_FIX_DECODE_FIRST's vote: true in every thread of the block iff ok in every thread.
__device__ __forceinline__ bool kv1_decode_vote(int T, bool ok) {
    return T == 32 ? __all_sync(0xffffffffu, ok) != 0 : __syncthreads_and(ok) != 0;
}

// ---- v9 across blocks (wide): kv_step_one<G, PosT, ABL, R> with R > 0 ----
// (docs/perf-notes.md, "Sixth session: v9 across blocks") kvaddr_step1w{R}_c{G}_{i64,i32}, R = 4, 8, 16
// requests per thread: blocks of T threads (a multiple of 32, R * T >= bsz, R * T <= KV_W_MAX: the
// planner's choice), grid = ceil(C / T), a token per thread (token t = blockIdx.x * T + threadIdx.x).
// Every thread of EVERY block holds R requests' lengths, so every block knows every length and no
// block waits for another:
//   1. One round trip: the thread's R lengths of each array as R / 4 chunks of 4 requests, chunk k of
//      thread i = requests [4 (k T + i), 4 (k T + i) + 4) (int4 loads where aligned and in range; a
//      warp's load is 512 contiguous bytes; session 9: before, thread i held [i R, i R + R), a warp's
//      loads strided R * 4 bytes apart); the decode guess of token t (token t is request t at
//      position seq_lens_decoder[t]) loads that length and then its block ids at once (decode-out's
//      chain).
//   2. One vote (__syncthreads_and): every request n == 1 and d >= 0, and bsz <= C. A decode batch
//      writes token t, request t's outputs (cu_seqlens_q[t] = t, seq_lens_kv[t]) from the thread of
//      token t (spread over the blocks), cu_seqlens_q[bsz] and num_tokens from token 0's thread, and
//      padding [bsz, C): nothing else.
//   3. Otherwise a scan in the chunk order of 1: the R / 4 chunk rows scanned side by side (warp
//      shuffles, one barrier, every warp scans the warp totals of every row), prefixes in shared
//      memory; block 0 writes the per-request outputs and bits 4 and 8; tokens [num_tokens, C) are
//      padding; a second barrier, then every token t < num_tokens tries "request t / n0" and
//      binary-searches the prefixes.
// The error records are kv_step_one's (a warp w of block k that found an error merges it into record
// k * T / 32 + w: sticky, kv_merge_record); T <= 1024
// keeps them within the records the planner sizes for v9 (StepPlanner: ceil((C + 1024) / 32)).
#define KV_W_MAX 4096  // R * T at most: the prefixes of every request in static shared memory (32 KB)
#define KV_W_ROWS 4     // chunk rows (R / 4) at most: R <= 16

struct KvWideShared {
    int cu[KV_W_MAX];            // exclusive prefix of request b (b < bsz)
    int dec[KV_W_MAX];           // seq_lens_decoder[b] (searched tokens only read good requests)
    int warp_sums[KV_W_ROWS][KV_SB_WARPS];  // [chunk row k][warp]: inclusive total of the warp's chunks
};

template <int G, typename PosT, int ABL, int R>
__device__ __forceinline__ void kv_step_wide(const KvStepParams& p, KvErr& err) {
    __shared__ KvWideShared s;
    const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5, T = blockDim.x;
    const int bsz = p.bsz, capacity = p.capacity;
    const bool first = blockIdx.x == 0;  // the block that writes the per-request outputs (scan path)
    const i64 t64 = (i64)blockIdx.x * T + tid;
    const int t = t64 < capacity ? (int)t64 : capacity;  // this thread's token (capacity: none)

    // 1. one round trip: the thread's R lengths of each array, in R / 4 chunks of 4 requests, chunk k
    //    of thread i holding requests [4 (k T + i), 4 (k T + i) + 4): one int4 load per array and chunk,
    //    a warp's load covering 512 contiguous bytes (coalesced; the vote does not care about the order
    //    and the scan below works in this order); token t's decode guess.
    Kv1Div<G> dv;  // B's reciprocal and the row bound per cache (kv1_div_init: while the loads fly)
    constexpr int K = R / 4;  // chunks per thread (R = 4, 8, 16)
    static_assert(R % 4 == 0 && K <= KV_W_ROWS, "R must be 4, 8 or 16");
    int d[R], n[R];            // d[4 k + j], n[4 k + j]: request 4 (k T + tid) + j (0 past bsz)
    const unsigned long long lens =
        (unsigned long long)p.seq_lens_decoder | (unsigned long long)p.seq_lens_this_time;
    const bool aligned = (lens & 15ull) == 0;  // both length arrays 16-byte aligned
    const bool tok = t < bsz && t < capacity;  // token t exists and request t does
    int dt = -1;
    if (tok) dt = kv_ld(p.seq_lens_decoder + t);  // the guess's load before the chunks' (session 9:
                                                  // its answer no longer queues behind theirs)
    // full: every chunk of this thread lies below bsz and both arrays are aligned (every thread of a
    // batch of R T requests, e.g. decode 4096): its K int4 loads per array are issued unconditionally
    // and its vote takes 1.5 instructions per request (session 10: before, about sixteen instructions
    // per chunk and eight per request, on the chain that ends at the vote's barrier).
    const bool full = aligned && 4 * ((K - 1) * T + tid) + 4 <= bsz;
    if (full) {
        const int4* da = reinterpret_cast<const int4*>(p.seq_lens_decoder) + tid;
        const int4* na = reinterpret_cast<const int4*>(p.seq_lens_this_time) + tid;
#pragma unroll
        for (int k = 0; k < K; ++k) {
            const int4 a = kv_ld(da + k * T), b = kv_ld(na + k * T);
            d[4 * k] = a.x, d[4 * k + 1] = a.y, d[4 * k + 2] = a.z, d[4 * k + 3] = a.w;
            n[4 * k] = b.x, n[4 * k + 1] = b.y, n[4 * k + 2] = b.z, n[4 * k + 3] = b.w;
        }
    } else {
#pragma unroll
        for (int k = 0; k < K; ++k) {
            const int c0 = 4 * (k * T + tid);  // the chunk's first request (< R * T <= KV_W_MAX)
            if (aligned && c0 + 4 <= bsz) {
                const int4 a = kv_ld(reinterpret_cast<const int4*>(p.seq_lens_decoder + c0)),
                           b = kv_ld(reinterpret_cast<const int4*>(p.seq_lens_this_time + c0));
                d[4 * k] = a.x, d[4 * k + 1] = a.y, d[4 * k + 2] = a.z, d[4 * k + 3] = a.w;
                n[4 * k] = b.x, n[4 * k + 1] = b.y, n[4 * k + 2] = b.z, n[4 * k + 3] = b.w;
            } else {
#pragma unroll
                for (int j = 0; j < 4; ++j) {
                    d[4 * k + j] = n[4 * k + j] = 0;
                    if (c0 + j < bsz) {
                        d[4 * k + j] = kv_ld(p.seq_lens_decoder + c0 + j);
                        n[4 * k + j] = kv_ld(p.seq_lens_this_time + c0 + j);
                    }
                }
            }
        }
    }
    kv1_div_init<G>(p, dv);
    u64 grow[G > 0 ? G : 1];  // request t's rows (the guess's; made at entry)
    kv1_rows_at_entry<G>(p, t, grow);
    int blk[G > 0 ? G : 1];
    blk[0] = -1;
    i64 goff[G > 0 ? G : 1];   // pos % B of the guess
    bool ginb[G > 0 ? G : 1];  // pos / B < max_blocks of the guess
    // the guess's block ids (used only by a decode batch, where dt >= 0), predicated on tok (known
    // at entry), so that they wait for dt alone (kv1_load_blocks_x)
    kv1_load_blocks_x<G, true>(p, dv, grow, (i64)dt, tok, blk, goff, ginb);

    // 2. the vote: a decode batch (every request n == 1, d >= 0; bsz <= C) is the guess.
    bool ok = true;
    if (full) {  // every n == 1 iff AND(n) == 1 and OR(n) == 1; every d >= 0 iff OR(d) >= 0
        int n_and = n[0], n_or = n[0], d_or = d[0];
#pragma unroll
        for (int u = 1; u < R; ++u) {
            n_and &= n[u];
            n_or |= n[u];
            d_or |= d[u];
        }
        ok = (n_and == 1) & (n_or == 1) & (d_or >= 0);
    } else {
#pragma unroll
        for (int k = 0; k < K; ++k) {
            const int c0 = 4 * (k * T + tid);
#pragma unroll
            for (int j = 0; j < 4; ++j) ok &= (c0 + j >= bsz) | ((n[4 * k + j] == 1) & (d[4 * k + j] >= 0));
        }
    }
    const bool decode = kv1_decode_vote(T, ok) && bsz <= capacity;
    if (decode) {
        if (t < bsz) {  // t < bsz <= C: token t is request t's only one, at dt >= 0
            kv1_store_token_x<G, PosT, true>(p, t, t, (i64)dt, blk, goff, ginb, err);
            kv_st(p.seq_lens_kv + t, kv_sat_add(dt, 1));
            kv_st(p.cu_seqlens_q + t, t);
        } else if (t < capacity) {
            kv1_store_pad<G, PosT>(p, t);
        }
        if (first && tid == 0) {
            kv_st(p.cu_seqlens_q + bsz, bsz);
            kv_st(p.num_tokens, bsz);
        }
        return;
    }

    // 3. the scan, in the chunk order of 1: the K chunk rows (row k: chunks k T .. k T + T - 1, chunk
    //    k T + i held by thread i) are scanned side by side (warp shuffles, one barrier, every warp
    //    scans the warp totals of every row); a chunk's first token is the rows before it, plus the
    //    warps before it in its row, plus the lanes before it in its warp. Sums saturate (kv_sat_add:
    //    associative for the non-negative lengths, so the order does not change a result).
    int x[K], ex[K], before[K], row_total[K];
#pragma unroll
    for (int k = 0; k < K; ++k) {
        x[k] = 0;
#pragma unroll
        for (int j = 0; j < 4; ++j) {
            const int u = 4 * k + j;
            x[k] = kv_sat_add(x[k], ((d[u] < 0) | (n[u] < 0)) ? 0 : n[u]);
        }
    }
#pragma unroll
    for (int off = 1; off < 32; off <<= 1) {
#pragma unroll
        for (int k = 0; k < K; ++k) {
            const int y = __shfl_up_sync(0xffffffffu, x[k], off);
            if (lane >= off) x[k] = kv_sat_add(x[k], y);
        }
    }
#pragma unroll
    for (int k = 0; k < K; ++k) {
        ex[k] = __shfl_up_sync(0xffffffffu, x[k], 1);
        if (lane == 0) ex[k] = 0;
    }
    if (T == 32) {
#pragma unroll
        for (int k = 0; k < K; ++k) {
            row_total[k] = __shfl_sync(0xffffffffu, x[k], 31);
            before[k] = 0;
        }
    } else {
        if (lane == 31) {
#pragma unroll
            for (int k = 0; k < K; ++k) s.warp_sums[k][warp] = x[k];
        }
        __syncthreads();
#pragma unroll
        for (int k = 0; k < K; ++k) {
            int w = lane < (T >> 5) ? s.warp_sums[k][lane] : 0;
#pragma unroll
            for (int off = 1; off < 32; off <<= 1) {
                const int y = __shfl_up_sync(0xffffffffu, w, off);
                if (lane >= off) w = kv_sat_add(w, y);
            }
            row_total[k] = __shfl_sync(0xffffffffu, w, 31);
            before[k] = __shfl_sync(0xffffffffu, w, (warp + 31) & 31);  // inclusive total of warps < warp
            if (warp == 0) before[k] = 0;
        }
    }
    int total = 0;  // tokens of the rows before row k, then of every row
#pragma unroll
    for (int k = 0; k < K; ++k) {
        int start = kv_sat_add(total, kv_sat_add(before[k], ex[k]));  // the chunk's first token
        total = kv_sat_add(total, row_total[k]);
        const int c0 = 4 * (k * T + tid);
#pragma unroll
        for (int j = 0; j < 4; ++j) {
            const int u = 4 * k + j, b = c0 + j;
            const bool bad = (d[u] < 0) | (n[u] < 0);
            const int end = kv_sat_add(start, bad ? 0 : n[u]);
            if (b < bsz) {
                s.cu[b] = start;
                s.dec[b] = d[u];
                if (first) {
                    kv_st(p.seq_lens_kv + b, bad ? 0 : kv_sat_add(d[u], n[u]));
                    kv_write_request(b, start, end, bad ? -1 : d[u], capacity, p.cu_seqlens_q, err);
                }
            }
            start = end;
        }
    }
    const int end_tok = min(total, capacity);
    if (first && tid == 0) {
        kv_st(p.cu_seqlens_q + bsz, total);
        kv_st(p.num_tokens, end_tok);
    }
    if (t < capacity && t >= end_tok) kv1_store_pad<G, PosT>(p, t);
    if (T == 32) __syncwarp(); else __syncthreads();  // s.cu, s.dec visible to the block
    if (t < end_tok) {
        int lo = 0, hi = bsz;                   // largest b with s.cu[b] <= t (s.cu[0] = 0 <= t)
        const int n0 = bsz > 1 ? s.cu[1] : 0;  // request 0's tokens (a uniform batch: every request's)
        if (n0 > 0) {                           // guess: token t is request t / n0
            const int g = (int)((unsigned int)t / (unsigned int)n0);
            if (g < bsz && s.cu[g] <= t && (g + 1 == bsz || t < s.cu[g + 1])) {
                lo = g;
                hi = g + 1;
            }
        }
        while (hi - lo > 1) {
            const int mid = (lo + hi) >> 1;
            if (s.cu[mid] <= t) lo = mid; else hi = mid;
        }
        const i64 pos = (i64)s.dec[lo] + (t - s.cu[lo]);
        int b2[G > 0 ? G : 1];
        i64 o2[G > 0 ? G : 1];
        bool n2[G > 0 ? G : 1];
        u64 row2[G > 0 ? G : 1];
        kv1_rows<G>(p, lo, row2);
        kv1_load_blocks_x<G, true>(p, dv, row2, pos, true, b2, o2, n2);
        kv1_store_token_x<G, PosT, true>(p, t, lo, pos, b2, o2, n2, err);
    }
}

// kv_step_one's phases 1-3 for R > 0 (kv_step_wide); nothing for R = 0, so that v9's instantiations
// reference no wide code (the same machine code as before the wide path existed).
template <int G, typename PosT, int ABL, int R>
struct KvWidePhases {
    static __device__ __forceinline__ void run(const KvStepParams& p, KvErr& err) {
        kv_step_wide<G, PosT, ABL, R>(p, err);
    }
};
template <int G, typename PosT, int ABL>
struct KvWidePhases<G, PosT, ABL, 0> {
    static __device__ __forceinline__ void run(const KvStepParams&, KvErr&) {}
};

template <int G, typename PosT, int ABL = 0, int R = 0>
__device__ __forceinline__ void kv_step_one(const KvStepParams& p) {
    // Compile-time switches (all false for ABL = 0: v9 as shipped).
    const bool xLEAN = (ABL & KV_FIX_LEAN) != 0, xCHECKS = (ABL & KV_ABL_NO_TOKEN_CHECKS) == 0;
    const bool xTOKEN = xLEAN || !xCHECKS;  // the _x token helpers
    __shared__ KvOneShared s;
    const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5, T = blockDim.x;
    const int bsz = p.bsz, capacity = p.capacity;
    const bool first = blockIdx.x == 0;       // the block that writes the per-request outputs
    const i64 t64 = (i64)blockIdx.x * T + tid;  // this thread's token (capacity: none; no int overflow)
    const int t = t64 < capacity ? (int)t64 : capacity;
    KvErr err;
    err.mask = 0u;
    err.key = KV_NO_ERROR;

    if (R > 0) {  // v9 across blocks (kvaddr_step1w*): its own phases 1-3, then the same records
        KvWidePhases<G, PosT, ABL, R>::run(p, err);
    } else {
    // 1. one round trip: request tid's lengths and the decode guess's block ids.
    int d = 0, n = 0;
    if ((ABL & KV_ABL_UNGUARDED_LOADS) != 0) {
        d = p.seq_lens_decoder[tid];
        n = p.seq_lens_this_time[tid];
        if (tid >= bsz) d = n = 0;
    } else if (tid < bsz) {
        d = kv_ld(p.seq_lens_decoder + tid);
        n = kv_ld(p.seq_lens_this_time + tid);
    }
    Kv1Div<G> dv;  // B's reciprocal and the row bound per cache (kv1_div_init: while the loads fly)
    kv1_div_init<G>(p, dv);
    u64 grow[G > 0 ? G : 1];  // request tid's rows (the guess's; made at entry)
    kv1_rows_at_entry<G>(p, tid, grow);
    const bool bad = (ABL & KV_ABL_NO_REQ_CHECKS) ? false : (d < 0) | (n < 0);
    // the guess: token tid is request tid's first (a good request with n > 0). Its block-id loads
    // (kv1_load_blocks_x) are predicated on gload, known at entry: they wait for d, not for n, and
    // read in bounds whatever d is (the row exists: tid < bsz).
    const bool gload = first & (tid < bsz) & (tid < capacity);
    const bool guess = gload & !bad & (n > 0);
    int blk[G > 0 ? G : 1];
    blk[0] = -1;
    i64 goff[G > 0 ? G : 1];   // pos % B of the guess (the _x helpers)
    bool ginb[G > 0 ? G : 1];  // pos / B < max_blocks of the guess
    if (xTOKEN) {  // the block ids are loaded once d has arrived (gload), whatever n turns out to be
        if (xCHECKS) kv1_load_blocks_x<G, true>(p, dv, grow, (i64)d, gload, blk, goff, ginb);
        else kv1_load_blocks_x<G, false>(p, dv, grow, (i64)d, gload, blk, goff, ginb);
    } else if (guess) {
        kv1_load_blocks<G>(p, tid, (i64)d, blk);
    }

    // 2. the scan: warp shuffles, one barrier, every warp scans the warp totals.
    //    KV_FIX_DECODE_FIRST: one vote first; a decode batch (every request n == 1, d >= 0)
    //    has start = i, end = i + 1, total = bsz and skips the scan and the search.
        const bool decode =
            (ABL & KV_ABL_NO_SCAN)        ? true
                        : (ABL & KV_FIX_DECODE_FIRST) ? kv1_decode_vote(T, (tid >= bsz) | ((n == 1) & (d >= 0)))
                                                      : false;
    int start, end, total;
    if (decode) {
        start = tid;
        end = tid + 1;
        total = bsz;
    } else {
        const int len = bad ? 0 : n;
        int x = len;
#pragma unroll
        for (int off = 1; off < 32; off <<= 1) {
            const int y = __shfl_up_sync(0xffffffffu, x, off);
            if (lane >= off) x = kv_sat_add(x, y);
        }
        int ex = __shfl_up_sync(0xffffffffu, x, 1);
        if (lane == 0) ex = 0;
        if (tid < bsz) s.dec[tid] = d;
        int before = 0;
        if (T == 32) {  // one warp (bsz <= 32 and C <= 32): no barrier, no shared round
            total = __shfl_sync(0xffffffffu, x, 31);
        } else {
            if (lane == 31) s.warp_sums[warp] = x;
            __syncthreads();
            int w = lane < (T >> 5) ? s.warp_sums[lane] : 0;
#pragma unroll
            for (int off = 1; off < 32; off <<= 1) {
                const int y = __shfl_up_sync(0xffffffffu, w, off);
                if (lane >= off) w = kv_sat_add(w, y);
            }
            total = __shfl_sync(0xffffffffu, w, 31);
            before = __shfl_sync(0xffffffffu, w, (warp + 31) & 31);  // inclusive total of warps < warp
            if (warp == 0) before = 0;
        }
        start = kv_sat_add(before, ex);
        end = kv_sat_add(before, x);
    }
    const int end_tok = min(total, capacity);
    if (!decode && tid < bsz) s.cu[tid] = start;
    if (first) {
        if (tid < bsz) {
            if ((ABL & KV_ABL_NO_REQ_OUT) == 0) kv_st(p.seq_lens_kv + tid, bad ? 0 : kv_sat_add(d, n));
            if ((ABL & (KV_ABL_NO_REQ_OUT | KV_ABL_NO_REQ_CHECKS)) == 0) {
                kv_write_request(tid, start, end, bad ? -1 : d, capacity, p.cu_seqlens_q, err);
            } else if ((ABL & KV_ABL_NO_REQ_OUT) == 0) {
                p.cu_seqlens_q[tid] = start;
            } else if ((ABL & KV_ABL_NO_REQ_CHECKS) == 0) {  // the checks of kv_write_request, no store
                if (bad) err.flag(KV_ERR_NEGATIVE_LENGTH, start, tid, 0);
                if (start <= capacity && capacity < end) err.flag(KV_ERR_CAPACITY, capacity, tid, 0);
            }
        }
        if (tid == 0 && (ABL & KV_ABL_NO_REQ_OUT) == 0) {
            kv_st(p.cu_seqlens_q + bsz, total);
            kv_st(p.num_tokens, end_tok);
        }
    }
    const bool hit = guess & (start == tid);  // token tid (block 0) is request tid's first (tid < end_tok)
    if (hit) {
        if (xTOKEN) {
            if (xCHECKS) kv1_store_token_x<G, PosT, true>(p, t, tid, (i64)d, blk, goff, ginb, err);
            else kv1_store_token_x<G, PosT, false>(p, t, tid, (i64)d, blk, goff, ginb, err);
        } else {
            kv1_store_token<G, PosT>(p, t, tid, (i64)d, blk, err);
        }
    } else if ((ABL & KV_ABL_NO_PAD) == 0 && t < capacity && t >= end_tok) {
        kv1_store_pad<G, PosT>(p, t);
    }

    // 3. the tokens the guess did not cover: search their request (none in a decode batch).
    const int miss = !hit & (t < end_tok);
    bool search;
    if (decode) {
        search = false;
    } else if (T == 32) {
        __syncwarp();  // s.cu and s.dec visible to the warp
        search = __any_sync(0xffffffffu, miss);
    } else {
        search = __syncthreads_or(miss);
    }
    if (search && miss) {
        int lo = 0, hi = bsz;  // largest b with s.cu[b] <= t (s.cu[0] = 0 <= t)
        const int n0 = bsz > 1 ? s.cu[1] : 0;  // request 0's tokens (a uniform batch: every request's)
        if (n0 > 0) {  // guess: token t is request t / n0 (uniform speculative decoding, equal chunks)
            const int g = (int)((unsigned int)t / (unsigned int)n0);
            if (g < bsz && s.cu[g] <= t && (g + 1 == bsz || t < s.cu[g + 1])) {
                lo = g;
                hi = g + 1;
            }
        }
        while (hi - lo > 1) {
            const int mid = (lo + hi) >> 1;
            if (s.cu[mid] <= t) lo = mid; else hi = mid;
        }
        const i64 pos = (i64)s.dec[lo] + (t - s.cu[lo]);
        int b2[G > 0 ? G : 1];
        if (xTOKEN) {
            i64 o2[G > 0 ? G : 1];
            bool n2[G > 0 ? G : 1];
            u64 row2[G > 0 ? G : 1];
            kv1_rows<G>(p, lo, row2);
            if (xCHECKS) {
                kv1_load_blocks_x<G, true>(p, dv, row2, pos, true, b2, o2, n2);
                kv1_store_token_x<G, PosT, true>(p, t, lo, pos, b2, o2, n2, err);
            } else {
                kv1_load_blocks_x<G, false>(p, dv, row2, pos, true, b2, o2, n2);
                kv1_store_token_x<G, PosT, false>(p, t, lo, pos, b2, o2, n2, err);
            }
        } else {
            kv1_load_blocks<G>(p, lo, pos, b2);
            kv1_store_token<G, PosT>(p, t, lo, pos, b2, err);
        }
    }
    }

    // Errors: warp w of block k merges into record k * (T / 32) + w, only with an error (sticky).
    if ((ABL & KV_ABL_NO_ERR_STORE) == 0) kv_merge_record(p.error_records, (i64)blockIdx.x * (T >> 5) + warp, err);
}

// KV_ABL_PARAM_REGS: every scalar field the step reads copied into a register at entry (an empty
// asm pins each one there), then the step on the copy. The pointers are copied, not pinned: a
// pinned pointer hides its address space, so every load and store through it was generic (LD / ST,
// not LDG / STG), 0.01-0.06 us slower (session 9, docs/perf-notes.md "Ninth session").
__device__ __forceinline__ int kv_pin(int x) {
    asm volatile("" : "+r"(x));
    return x;
}
__device__ __forceinline__ i64 kv_pin(i64 x) {
    asm volatile("" : "+l"(x));
    return x;
}
template <typename P>
__device__ __forceinline__ P* kv_pin(P* x) {  // a pointer is copied, not pinned (see above)
    return x;
}
template <int G, typename PosT, int ABL, int R = 0>
__device__ __forceinline__ void kv_step_one_ablate(const KvStepParams& p) {
    if ((ABL & KV_ABL_PARAM_REGS) == 0) {
        kv_step_one<G, PosT, ABL, R>(p);
        return;
    }
    KvStepParams r;
    r.seq_lens_decoder = kv_pin(p.seq_lens_decoder);
    r.seq_lens_this_time = kv_pin(p.seq_lens_this_time);
    r.cu_seqlens_q = kv_pin(p.cu_seqlens_q);
    r.num_tokens = kv_pin(p.num_tokens);
    r.batch_id_per_token = kv_pin(p.batch_id_per_token);
    r.position_ids = kv_pin(p.position_ids);
    r.seq_lens_kv = kv_pin(p.seq_lens_kv);
    r.slot_mapping = kv_pin(p.slot_mapping);
    r.error_records = kv_pin(p.error_records);
#pragma unroll
    for (int g = 0; g < G; ++g) {
        r.block_tables[g] = kv_pin(p.block_tables[g]);
        r.table_stride[g] = kv_pin(p.table_stride[g]);
        r.max_blocks[g] = kv_pin(p.max_blocks[g]);
        r.block_size[g] = kv_pin(p.block_size[g]);
    }
    r.bsz = kv_pin(p.bsz);
    r.capacity = kv_pin(p.capacity);  // (max_tiles, num_meta: read by no v9 code since sticky records)
    kv_step_one<G, PosT, ABL & ~KV_ABL_PARAM_REGS, R>(r);
}

// The small-batch step per cache count G and position type: <<<ceil(C / T), T>>>, one parameter.
// kvaddr_step1_c{G}_*: the default (KV_V9_DEFAULT's fixes); kvaddr_step1old_c{G}_*: v9 as first
// shipped (ABL = 0; StepPlanner.use_kernel("v9-old"), for one comparison run).
extern "C" __global__ void __launch_bounds__(KV_SB_THREADS, 1) kvaddr_step1_c0_i64(const KvStepParams params) {
    kv_step_one_ablate<0, i64, KV_V9_DEFAULT>(params);
}

extern "C" __global__ void __launch_bounds__(KV_SB_THREADS, 1) kvaddr_step1_c1_i64(const KvStepParams params) {
    kv_step_one_ablate<1, i64, KV_V9_DEFAULT>(params);
}

extern "C" __global__ void __launch_bounds__(KV_SB_THREADS, 1) kvaddr_step1_c2_i64(const KvStepParams params) {
    kv_step_one_ablate<2, i64, KV_V9_DEFAULT>(params);
}

extern "C" __global__ void __launch_bounds__(KV_SB_THREADS, 1) kvaddr_step1_c3_i64(const KvStepParams params) {
    kv_step_one_ablate<3, i64, KV_V9_DEFAULT>(params);
}

extern "C" __global__ void __launch_bounds__(KV_SB_THREADS, 1) kvaddr_step1_c4_i64(const KvStepParams params) {
    kv_step_one_ablate<4, i64, KV_V9_DEFAULT>(params);
}

extern "C" __global__ void __launch_bounds__(KV_SB_THREADS, 1) kvaddr_step1_c0_i32(const KvStepParams params) {
    kv_step_one_ablate<0, int, KV_V9_DEFAULT>(params);
}

extern "C" __global__ void __launch_bounds__(KV_SB_THREADS, 1) kvaddr_step1_c1_i32(const KvStepParams params) {
    kv_step_one_ablate<1, int, KV_V9_DEFAULT>(params);
}

extern "C" __global__ void __launch_bounds__(KV_SB_THREADS, 1) kvaddr_step1_c2_i32(const KvStepParams params) {
    kv_step_one_ablate<2, int, KV_V9_DEFAULT>(params);
}

extern "C" __global__ void __launch_bounds__(KV_SB_THREADS, 1) kvaddr_step1_c3_i32(const KvStepParams params) {
    kv_step_one_ablate<3, int, KV_V9_DEFAULT>(params);
}

extern "C" __global__ void __launch_bounds__(KV_SB_THREADS, 1) kvaddr_step1_c4_i32(const KvStepParams params) {
    kv_step_one_ablate<4, int, KV_V9_DEFAULT>(params);
}

extern "C" __global__ void __launch_bounds__(KV_SB_THREADS, 1) kvaddr_step1old_c0_i64(const KvStepParams params) {
    kv_step_one<0, i64>(params);
}

extern "C" __global__ void __launch_bounds__(KV_SB_THREADS, 1) kvaddr_step1old_c1_i64(const KvStepParams params) {
    kv_step_one<1, i64>(params);
}

extern "C" __global__ void __launch_bounds__(KV_SB_THREADS, 1) kvaddr_step1old_c2_i64(const KvStepParams params) {
    kv_step_one<2, i64>(params);
}

extern "C" __global__ void __launch_bounds__(KV_SB_THREADS, 1) kvaddr_step1old_c3_i64(const KvStepParams params) {
    kv_step_one<3, i64>(params);
}

extern "C" __global__ void __launch_bounds__(KV_SB_THREADS, 1) kvaddr_step1old_c4_i64(const KvStepParams params) {
    kv_step_one<4, i64>(params);
}

extern "C" __global__ void __launch_bounds__(KV_SB_THREADS, 1) kvaddr_step1old_c0_i32(const KvStepParams params) {
    kv_step_one<0, int>(params);
}

extern "C" __global__ void __launch_bounds__(KV_SB_THREADS, 1) kvaddr_step1old_c1_i32(const KvStepParams params) {
    kv_step_one<1, int>(params);
}

extern "C" __global__ void __launch_bounds__(KV_SB_THREADS, 1) kvaddr_step1old_c2_i32(const KvStepParams params) {
    kv_step_one<2, int>(params);
}

extern "C" __global__ void __launch_bounds__(KV_SB_THREADS, 1) kvaddr_step1old_c3_i32(const KvStepParams params) {
    kv_step_one<3, int>(params);
}

extern "C" __global__ void __launch_bounds__(KV_SB_THREADS, 1) kvaddr_step1old_c4_i32(const KvStepParams params) {
    kv_step_one<4, int>(params);
}

// v9's ablation and candidate-fix kernels (benchmarks/ablate_v9.py, tests/gpu/test_ablate_v9_gpu.py):
// compiled only with KV_ABLATION defined (the benchmark's and the tests' own module), so the
// library's module is unchanged. kvaddr_step1_abl_c{G}_m{MASK}: kv_step_one<G, i64, MASK>
// launched like kvaddr_step1_c{G}_i64 (same KvStepParams, same geometry). No launch-bounds
// variant: v9 uses 30-32 registers (ptxas), far under the 64 that (KV_SB_THREADS, 1) allows.
#ifdef KV_ABLATION
#define KV_ABL_ENTRY(G, MASK)                                                                               \
    extern "C" __global__ void __launch_bounds__(KV_SB_THREADS, 1)                                         \
        kvaddr_step1_abl_c##G##_m##MASK(const KvStepParams params) {                                      \
        kv_step_one_ablate<G, i64, MASK>(params);                                                          \
    }
#define KV_ABL_ENTRIES(G)                                                                                  \
    KV_ABL_ENTRY(G, 0)                                                                                     \
    KV_ABL_ENTRY(G, 1)                                                                                     \
    KV_ABL_ENTRY(G, 2)                                                                                     \
    KV_ABL_ENTRY(G, 4)                                                                                     \
    KV_ABL_ENTRY(G, 8)                                                                                     \
    KV_ABL_ENTRY(G, 16)                                                                                    \
    KV_ABL_ENTRY(G, 32)                                                                                    \
    KV_ABL_ENTRY(G, 64)                                                                                    \
    KV_ABL_ENTRY(G, 79)                                                                                    \
    KV_ABL_ENTRY(G, 95)                                                                                    \
    KV_ABL_ENTRY(G, 127)                                                                                   \
    KV_ABL_ENTRY(G, 128)                                                                                   \
    KV_ABL_ENTRY(G, 256)                                                                                   \
    KV_ABL_ENTRY(G, 384)                                                                                   \
    KV_ABL_ENTRY(G, 416)                                                                                   \
    KV_ABL_ENTRY(G, 512)                                                                                   \
    KV_ABL_ENTRY(G, 591)                                                                                   \
    KV_ABL_ENTRY(G, 417)
KV_ABL_ENTRIES(1)
KV_ABL_ENTRIES(2)

// benchmarks/floor_step.py's decode-out floor (token t is request t, no checks, no error record;
// cu_seqlens_q, seq_lens_kv, num_tokens written) reading its arguments from KvStepParams like
// v9 (the floor kernel takes 13 scalar arguments): what passing the struct costs. Launch
// <<<ceil(C / 256), 256>>> like the floor, or v9's geometry.
template <int G>
__device__ __forceinline__ void kv_abl_floor_out(const KvStepParams& p) {
    const int t = blockIdx.x * blockDim.x + threadIdx.x;
    const int bsz = p.bsz, capacity = p.capacity;
    if (t < bsz) p.cu_seqlens_q[t] = t;
    if (t == 0) {
        p.cu_seqlens_q[bsz] = bsz;
        *p.num_tokens = bsz;
    }
    if (t >= capacity) return;
    if (t < bsz) {
        const int d = p.seq_lens_decoder[t];
        int blk[G];
#pragma unroll
        for (int g = 0; g < G; ++g) {
            const unsigned int idx = (unsigned int)d / (unsigned int)p.block_size[g];
            blk[g] = p.block_tables[g][(i64)t * p.table_stride[g] + idx];
        }
        p.batch_id_per_token[t] = t;
        static_cast<i64*>(p.position_ids)[t] = d;
#pragma unroll
        for (int g = 0; g < G; ++g) {
            const unsigned int idx = (unsigned int)d / (unsigned int)p.block_size[g];
            p.slot_mapping[(i64)g * capacity + t] = (i64)blk[g] * p.block_size[g] + (d - idx * p.block_size[g]);
        }
        p.seq_lens_kv[t] = d + 1;
    } else {
        p.batch_id_per_token[t] = -1;
        static_cast<i64*>(p.position_ids)[t] = 0;
#pragma unroll
        for (int g = 0; g < G; ++g) p.slot_mapping[(i64)g * capacity + t] = -1;
    }
}

extern "C" __global__ void __launch_bounds__(KV_SB_THREADS, 1) kvaddr_abl_floor_out_c1(const KvStepParams params) {
    kv_abl_floor_out<1>(params);
}

extern "C" __global__ void __launch_bounds__(KV_SB_THREADS, 1) kvaddr_abl_floor_out_c2(const KvStepParams params) {
    kv_abl_floor_out<2>(params);
}
#endif  // KV_ABLATION

// ---- v9m: the small-batch step with attention outputs (docs/attention.md, "Small batches") ----
//
// kvaddr_step1m_c{G}_i64 / _i32, G = 0..4 caches: for bsz <= KV_THREADS requests with
// attention outputs on. The first ceil(C / T) blocks are v9's token blocks, exactly
// kvaddr_step1_c{G}_*'s code (kv_step_one with KV_V9_DEFAULT's fixes; T threads, T >= bsz,
// T <= KV_THREADS); the M = gridDim.x - ceil(C / T) blocks after them are metadata blocks
// (kv_meta_one), counted from the grid's end (mr = gridDim.x - 1 - blockIdx.x), the planner's
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
// Outputs and error records (bits 1, 2, 16 and their first-bad keys) are kv_meta_block2's.
// Error records: every block (token or metadata) merges into records blockIdx.x * T / 32 + warp,
// only from a warp with an error (sticky, kv_merge_record: nothing to clear when switching
// between this kernel, kvaddr_step_* and kvaddr_step1_*; the host clears after reading).
// KvStepParams::one_meta_flags: 0, the timing ablation below (the outputs are then wrong) and/or
// KV_M1_ROWS_BY_PAGES (kvaddr_step1wm* only).
// KV_TRACE stamps of kvaddr_step1m_* (benchmarks/trace_step1m.py): slot 0 the block's start
// time, 1 its start clock, 15 its kind (1 metadata, 2 token block); metadata blocks: 2 the row
// loads issued, 3 the lengths arrived, 4 before the barrier, 5 after it, 6 the first row
// stored, 7 the per-request outputs written, 8 entry bsz and the maxima, 9 the rest of the
// rows, 10 the pad; both kinds: 11 the end clock, 12 the end time, 13 the SM.
#define KV_M1_EMPTY 8  // the metadata blocks return at once (the cost of launching them)
// kvaddr_step1wm* only (kvaddr_step1m_* ignores it; outputs unchanged): a warp loads its request's
// first row columns only below the request's pages, from its own lengths loaded first
#define KV_M1_ROWS_BY_PAGES 16

struct __align__(16) KvMetaOneShared {
    int x[2][KV_THREADS];   // in-warp exclusive prefixes of request i: [0] tokens (error keys), [1] pages
    int pages[KV_THREADS];  // pages of request i in this block's cache
    int red[5][KV_WARPS];   // per-warp totals (tokens, L, pages) and maxima (tokens, L); rows 16-byte aligned
};

// The errors of one warp into record i = blockIdx.x * (blockDim.x / 32) + warp (sticky).
__device__ __forceinline__ void kv_one_store_record(const KvStepParams& p, KvErr err) {
    kv_merge_record(p.error_records, (i64)blockIdx.x * (blockDim.x >> 5) + (threadIdx.x >> 5), err);
}

// Entries [lo, hi) of out set to -1 (PAD_PAGE_ID): scalar head to a 16-byte boundary, int4 body, tail.
__device__ __forceinline__ void kv_one_pad(int* __restrict__ out, int lo, int hi) {
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

// The KV_WARPS per-warp values of one row of KvMetaOneShared::red, as two int4 broadcasts (the
// entries of warps that do not exist are read and never used: the sums below mask them).
__device__ __forceinline__ void kv_one_read_warps(const int* r, int (&w)[KV_WARPS]) {
    static_assert(KV_WARPS == 8, "two int4s per row of red");
    const int4 a = *reinterpret_cast<const int4*>(r), b = *reinterpret_cast<const int4*>(r + 4);
    w[0] = a.x; w[1] = a.y; w[2] = a.z; w[3] = a.w;
    w[4] = b.x; w[5] = b.y; w[6] = b.z; w[7] = b.w;
}

// Sum (saturating; MAX: maximum) of w[0..i) for non-negative w, 0 for i = 0: independent
// selects, then a tree.
template <bool MAX = false>
__device__ __forceinline__ int kv_one_sum_lt(const int (&w)[KV_WARPS], int i) {
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
__device__ __forceinline__ int kv_one_token(const KvMetaOneShared& sm, int wi, int b) {
    int rt[KV_WARPS];
    kv_one_read_warps(sm.red[0], rt);
    return kv_sat_add_nn(kv_one_sum_lt(rt, wi), sm.x[0][b]);
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
__device__ __forceinline__ void kv_one_copy_rest(const KvMetaOneShared& sm, const KvStepParams& p, const int* table,
                                              i64 stride, int width, int g, int b0, int r1,
                                              int* __restrict__ out, KvErr& err) {
    const int lane = threadIdx.x & 31, warps = blockDim.x >> 5, N = p.kv_indices_capacity;
    int rp[KV_WARPS];
    kv_one_read_warps(sm.red[2], rp);
#pragma unroll 1
    for (int b = b0; b < r1; b += warps) {
        const int wi = b >> 5;
        const int s0 = kv_sat_add_nn(kv_one_sum_lt(rp, wi), sm.x[1][b]);
        const int col_from = b == b0 ? lane + KV_META_PRE * 32 : lane;
        const int end = s0 < N ? min(sm.pages[b], N - s0) : 0;  // entries of this row below N
        if (kv_copy_row_cols(table + (i64)b * stride, width, out + s0, col_from, end))
            err.flag(KV_ERR_NEGATIVE_BLOCK, kv_one_token(sm, wi, b), b, g);
    }
}

// v[u] = row[32 u] for 32 u < cols, else -1 (row: a global address; ld.global.nc, immediate offsets).
__device__ __forceinline__ void kv_one_row_loads(u64 row, int cols, int (&v)[KV_META_PRE]) {
#pragma unroll
    for (int u = 0; u < KV_META_PRE; ++u) {
        v[u] = -1;
#ifdef __CUDA_ARCH__
        if (32 * u < cols) asm("ld.global.nc.b32 %0, [%1];" : "=r"(v[u]) : "l"(row + 128u * u));
#endif
    }
}

// Metadata block (g, k) of kvaddr_step1m_*: T = blockDim.x >= bsz threads (see the section comment).
//
// Written for the length of one warp's dependent chain (session 12: a metadata block's time is
// its instruction latency, not its memory traffic; docs/perf-notes.md "Twelfth session"):
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
__device__ __forceinline__ void kv_meta_one(const KvStepParams& p) {
    __shared__ KvMetaOneShared sm;
    KV_STAMP_TIME(0);
    KV_STAMP(1);
    const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5, T = blockDim.x;
    const int bsz = p.bsz;
    // 1. request tid's lengths: the first loads (their addresses need nothing)
    int d = 0, n = 0;
    if (tid < bsz) {
        d = __ldg(p.seq_lens_decoder + tid);
        n = __ldg(p.seq_lens_this_time + tid);
    }
    if (p.one_meta_flags & KV_M1_EMPTY) return;  // (ablation) no work, no error
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
    kv_one_row_loads(kv_global_addr(table) + 4u * (u64)((i64)b0 * stride + lane), fi && b0 < bsz ? width - lane : 0, v);
    KV_STAMP(2);
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
    KV_TRACE_WAIT(d);
    KV_TRACE_WAIT(n);
    KV_STAMP(3);
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
        kv_one_row_loads(kv_global_addr(table) + 4u * (u64)((i64)b0 * stride + lane), fi && b0 < r1 ? width - lane : 0, v);
    }
    KV_STAMP(4);
    __syncthreads();  // the only barrier: nothing in shared memory is written after it
    KV_STAMP(5);
    // 6. every shared word this thread needs, into registers before any global store
    const bool mine = b0 < r1;  // the warp has a request (b0 >= r0 always)
    int rp[KV_WARPS], rl[KV_WARPS];
    kv_one_read_warps(sm.red[2], rp);
    kv_one_read_warps(sm.red[1], rl);
    const int xb = mine ? sm.x[1][b0] : 0, pb = mine ? sm.pages[b0] : 0;
    int* __restrict__ out = p.kv_indices + (i64)g * N;
    const int total = kv_one_sum_lt(rp, warps);  // kv_indptr[g, bsz] (rows' pages; 0 without caches)
    // 7. the loaded columns of the warp's first request (one negative-id flag per row)
    if (fi && mine) {
        const int wi = b0 >> 5;
        const int s0 = kv_sat_add_nn(kv_one_sum_lt(rp, wi), xb);
        const int end = s0 < N ? min(pb, N - s0) : 0, ew = min(end, width);
        int* __restrict__ o = out + s0;
        if (G > 1) {  // (session 12: faster with two caches, slower with one, as ptxas schedules them)
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
                if (neg) err.flag(KV_ERR_NEGATIVE_BLOCK, kv_one_token(sm, wi, b0), b0, g);
            }
        } else {
            bool neg = false;
#pragma unroll
            for (int u = 0; u < KV_META_PRE; ++u) {
                const int col = lane + 32 * u;
                if (col < end) o[col] = max(v[u], -1);
                neg |= (col < ew) & (v[u] < 0);
            }
            if (neg) err.flag(KV_ERR_NEGATIVE_BLOCK, kv_one_token(sm, wi, b0), b0, g);
        }
    }
    KV_STAMP(6);
    // 8. request tid (when it is this block's): per-request outputs, bits 1 and 16
    const i64 row_off = (i64)g * p.attn_stride;
    if (tid >= r0 && tid < r1) {
        bool cap = false;
        if (fi) {
            const int at = kv_sat_add_nn(kv_one_sum_lt(rp, warp), xp);
            p.kv_indptr[row_off + tid] = at;
            // P = ceil(L / B) (G > 0 with flashinfer), so L - (P - 1) B = (L - 1) % B + 1 for L > 0
            p.kv_last_page_len[row_off + tid] = L > 0 ? L - (P - 1) * B : 0;
            cap = at <= N && N < kv_sat_add_nn(at, P);
        }
        if (varlen) p.cu_seqlens_k[tid] = kv_sat_add_nn(kv_one_sum_lt(rl, warp), xl);
        const bool wide = rows && P > width;
        if (cap | wide) {  // the key: the request's first token
            const int tok = kv_one_token(sm, warp, tid);
            if (cap) err.flag(KV_ERR_KV_INDICES_CAPACITY, tok, tid, g);
            if (wide) err.flag(KV_ERR_BLOCK_INDEX, tok, tid, g);
        }
    }
    KV_STAMP(7);
    if (tid == 0 && k == 0) {  // entry bsz (block k = 0 of each cache), the maxima (block k = 0 of cache 0)
        if (fi) p.kv_indptr[row_off + bsz] = total;
        if (varlen) {
            int rm[KV_WARPS];
            p.cu_seqlens_k[bsz] = kv_one_sum_lt(rl, warps);
            kv_one_read_warps(sm.red[3], rm);
            p.max_seqlen[0] = kv_one_sum_lt<true>(rm, warps);
            kv_one_read_warps(sm.red[4], rm);
            p.max_seqlen[1] = kv_one_sum_lt<true>(rm, warps);
        }
    }
    KV_STAMP(8);
    // 9. the rest of the rows: the first request's columns past the loaded ones, then the warp's
    // further requests (none with the planner's geometry unless a row has more than 512 pages)
    if (fi && (b0 + warps < r1 || (mine && pb > KV_META_PRE * 32))) kv_one_copy_rest(sm, p, table, stride, width, g, b0, r1, out, err);
    KV_STAMP(9);
    // 10. the pad of this block's entry range
    if (fi) {
        const unsigned int e_lo = min((unsigned int)k * chunk, (unsigned int)N), e_hi = min(e_lo + chunk, (unsigned int)N);
        kv_one_pad(out, max((int)e_lo, total), (int)e_hi);
    }
    KV_STAMP(10);
    kv_one_store_record(p, err);
    KV_STAMP(11);
    KV_STAMP_TIME(12);
    KV_STAMP_VALUE(13, kv_trace_sm());
    KV_STAMP_VALUE(15, 1);
}

// The small-batch step with attention outputs: <<<ceil(C / T) + M, T>>> (T <= KV_THREADS). A
// block is a metadata block iff blockIdx.x * T >= C (no division on the token blocks' path).
template <int G, typename PosT>
__device__ __forceinline__ void kv_step_one_meta(const KvStepParams& p) {
    const unsigned int T = blockDim.x, C = (unsigned int)p.capacity;  // C <= 2^31 - 2: C + T - 1 < 2^32
    if ((u64)blockIdx.x * T >= C) {
        kv_meta_one<G>(p);
        return;
    }
    KV_STAMP_TIME(0);
    KV_STAMP(1);
    kv_step_one_ablate<G, PosT, KV_V9_DEFAULT>(p);  // the token blocks: v9 with its measured fixes
    KV_STAMP(11);
    KV_STAMP_TIME(12);
    KV_STAMP_VALUE(13, kv_trace_sm());
    KV_STAMP_VALUE(15, 2);
}

extern "C" __global__ void __launch_bounds__(KV_THREADS, 1) kvaddr_step1m_c0_i64(const KvStepParams params) {
    kv_step_one_meta<0, i64>(params);
}

extern "C" __global__ void __launch_bounds__(KV_THREADS, 1) kvaddr_step1m_c1_i64(const KvStepParams params) {
    kv_step_one_meta<1, i64>(params);
}

extern "C" __global__ void __launch_bounds__(KV_THREADS, 1) kvaddr_step1m_c2_i64(const KvStepParams params) {
    kv_step_one_meta<2, i64>(params);
}

extern "C" __global__ void __launch_bounds__(KV_THREADS, 1) kvaddr_step1m_c3_i64(const KvStepParams params) {
    kv_step_one_meta<3, i64>(params);
}

extern "C" __global__ void __launch_bounds__(KV_THREADS, 1) kvaddr_step1m_c4_i64(const KvStepParams params) {
    kv_step_one_meta<4, i64>(params);
}

extern "C" __global__ void __launch_bounds__(KV_THREADS, 1) kvaddr_step1m_c0_i32(const KvStepParams params) {
    kv_step_one_meta<0, int>(params);
}

extern "C" __global__ void __launch_bounds__(KV_THREADS, 1) kvaddr_step1m_c1_i32(const KvStepParams params) {
    kv_step_one_meta<1, int>(params);
}

extern "C" __global__ void __launch_bounds__(KV_THREADS, 1) kvaddr_step1m_c2_i32(const KvStepParams params) {
    kv_step_one_meta<2, int>(params);
}

extern "C" __global__ void __launch_bounds__(KV_THREADS, 1) kvaddr_step1m_c3_i32(const KvStepParams params) {
    kv_step_one_meta<3, int>(params);
}

extern "C" __global__ void __launch_bounds__(KV_THREADS, 1) kvaddr_step1m_c4_i32(const KvStepParams params) {
    kv_step_one_meta<4, int>(params);
}

// ---- v9w: the step across blocks (kv_step_one with R > 0 requests per thread; see "v9 across blocks") ----
// kvaddr_step1w{R}_c{G}_{i64,i32}: <<<ceil(C / T), T>>>, T <= KV_W_MAX / R, one parameter; the planner runs
// them for one_block_max_requests < bsz <= wide_max_requests without attention outputs (StepPlanner.kernel_for).
// KV_V9_DEFAULT: parameters in registers (the clearing loop as v9's default).

extern "C" __global__ void __launch_bounds__(KV_W_MAX / 4, 1) kvaddr_step1w4_c0_i64(const KvStepParams params) {
    kv_step_one_ablate<0, i64, KV_V9_DEFAULT, 4>(params);
}

extern "C" __global__ void __launch_bounds__(KV_W_MAX / 4, 1) kvaddr_step1w4_c1_i64(const KvStepParams params) {
    kv_step_one_ablate<1, i64, KV_V9_DEFAULT, 4>(params);
}

extern "C" __global__ void __launch_bounds__(KV_W_MAX / 4, 1) kvaddr_step1w4_c2_i64(const KvStepParams params) {
    kv_step_one_ablate<2, i64, KV_V9_DEFAULT, 4>(params);
}

extern "C" __global__ void __launch_bounds__(KV_W_MAX / 4, 1) kvaddr_step1w4_c3_i64(const KvStepParams params) {
    kv_step_one_ablate<3, i64, KV_V9_DEFAULT, 4>(params);
}

extern "C" __global__ void __launch_bounds__(KV_W_MAX / 4, 1) kvaddr_step1w4_c4_i64(const KvStepParams params) {
    kv_step_one_ablate<4, i64, KV_V9_DEFAULT, 4>(params);
}

extern "C" __global__ void __launch_bounds__(KV_W_MAX / 4, 1) kvaddr_step1w4_c0_i32(const KvStepParams params) {
    kv_step_one_ablate<0, int, KV_V9_DEFAULT, 4>(params);
}

extern "C" __global__ void __launch_bounds__(KV_W_MAX / 4, 1) kvaddr_step1w4_c1_i32(const KvStepParams params) {
    kv_step_one_ablate<1, int, KV_V9_DEFAULT, 4>(params);
}

extern "C" __global__ void __launch_bounds__(KV_W_MAX / 4, 1) kvaddr_step1w4_c2_i32(const KvStepParams params) {
    kv_step_one_ablate<2, int, KV_V9_DEFAULT, 4>(params);
}

extern "C" __global__ void __launch_bounds__(KV_W_MAX / 4, 1) kvaddr_step1w4_c3_i32(const KvStepParams params) {
    kv_step_one_ablate<3, int, KV_V9_DEFAULT, 4>(params);
}

extern "C" __global__ void __launch_bounds__(KV_W_MAX / 4, 1) kvaddr_step1w4_c4_i32(const KvStepParams params) {
    kv_step_one_ablate<4, int, KV_V9_DEFAULT, 4>(params);
}

extern "C" __global__ void __launch_bounds__(KV_W_MAX / 8, 1) kvaddr_step1w8_c0_i64(const KvStepParams params) {
    kv_step_one_ablate<0, i64, KV_V9_DEFAULT, 8>(params);
}

extern "C" __global__ void __launch_bounds__(KV_W_MAX / 8, 1) kvaddr_step1w8_c1_i64(const KvStepParams params) {
    kv_step_one_ablate<1, i64, KV_V9_DEFAULT, 8>(params);
}

extern "C" __global__ void __launch_bounds__(KV_W_MAX / 8, 1) kvaddr_step1w8_c2_i64(const KvStepParams params) {
    kv_step_one_ablate<2, i64, KV_V9_DEFAULT, 8>(params);
}

extern "C" __global__ void __launch_bounds__(KV_W_MAX / 8, 1) kvaddr_step1w8_c3_i64(const KvStepParams params) {
    kv_step_one_ablate<3, i64, KV_V9_DEFAULT, 8>(params);
}

extern "C" __global__ void __launch_bounds__(KV_W_MAX / 8, 1) kvaddr_step1w8_c4_i64(const KvStepParams params) {
    kv_step_one_ablate<4, i64, KV_V9_DEFAULT, 8>(params);
}

extern "C" __global__ void __launch_bounds__(KV_W_MAX / 8, 1) kvaddr_step1w8_c0_i32(const KvStepParams params) {
    kv_step_one_ablate<0, int, KV_V9_DEFAULT, 8>(params);
}

extern "C" __global__ void __launch_bounds__(KV_W_MAX / 8, 1) kvaddr_step1w8_c1_i32(const KvStepParams params) {
    kv_step_one_ablate<1, int, KV_V9_DEFAULT, 8>(params);
}

extern "C" __global__ void __launch_bounds__(KV_W_MAX / 8, 1) kvaddr_step1w8_c2_i32(const KvStepParams params) {
    kv_step_one_ablate<2, int, KV_V9_DEFAULT, 8>(params);
}

extern "C" __global__ void __launch_bounds__(KV_W_MAX / 8, 1) kvaddr_step1w8_c3_i32(const KvStepParams params) {
    kv_step_one_ablate<3, int, KV_V9_DEFAULT, 8>(params);
}

extern "C" __global__ void __launch_bounds__(KV_W_MAX / 8, 1) kvaddr_step1w8_c4_i32(const KvStepParams params) {
    kv_step_one_ablate<4, int, KV_V9_DEFAULT, 8>(params);
}

extern "C" __global__ void __launch_bounds__(KV_W_MAX / 16, 1) kvaddr_step1w16_c0_i64(const KvStepParams params) {
    kv_step_one_ablate<0, i64, KV_V9_DEFAULT, 16>(params);
}

extern "C" __global__ void __launch_bounds__(KV_W_MAX / 16, 1) kvaddr_step1w16_c1_i64(const KvStepParams params) {
    kv_step_one_ablate<1, i64, KV_V9_DEFAULT, 16>(params);
}

extern "C" __global__ void __launch_bounds__(KV_W_MAX / 16, 1) kvaddr_step1w16_c2_i64(const KvStepParams params) {
    kv_step_one_ablate<2, i64, KV_V9_DEFAULT, 16>(params);
}

extern "C" __global__ void __launch_bounds__(KV_W_MAX / 16, 1) kvaddr_step1w16_c3_i64(const KvStepParams params) {
    kv_step_one_ablate<3, i64, KV_V9_DEFAULT, 16>(params);
}

extern "C" __global__ void __launch_bounds__(KV_W_MAX / 16, 1) kvaddr_step1w16_c4_i64(const KvStepParams params) {
    kv_step_one_ablate<4, i64, KV_V9_DEFAULT, 16>(params);
}

extern "C" __global__ void __launch_bounds__(KV_W_MAX / 16, 1) kvaddr_step1w16_c0_i32(const KvStepParams params) {
    kv_step_one_ablate<0, int, KV_V9_DEFAULT, 16>(params);
}

extern "C" __global__ void __launch_bounds__(KV_W_MAX / 16, 1) kvaddr_step1w16_c1_i32(const KvStepParams params) {
    kv_step_one_ablate<1, int, KV_V9_DEFAULT, 16>(params);
}

extern "C" __global__ void __launch_bounds__(KV_W_MAX / 16, 1) kvaddr_step1w16_c2_i32(const KvStepParams params) {
    kv_step_one_ablate<2, int, KV_V9_DEFAULT, 16>(params);
}

extern "C" __global__ void __launch_bounds__(KV_W_MAX / 16, 1) kvaddr_step1w16_c3_i32(const KvStepParams params) {
    kv_step_one_ablate<3, int, KV_V9_DEFAULT, 16>(params);
}

extern "C" __global__ void __launch_bounds__(KV_W_MAX / 16, 1) kvaddr_step1w16_c4_i32(const KvStepParams params) {
    kv_step_one_ablate<4, int, KV_V9_DEFAULT, 16>(params);
}
// ---- v9wm: v9 across blocks with attention outputs (docs/attention.md, "Batches of 257 to 4096") ----
//
// kvaddr_step1wm{R}_c{G}_i64 / _i32, R = 4, 8, 16, G = 0..4 caches: for one_block_max_requests < bsz <=
// KV_W_MAX requests with attention outputs on. The first ceil(C / T) blocks are v9 across blocks' token
// blocks, exactly kvaddr_step1w{R}_c{G}_*'s code (R x T >= bsz, T <= KV_W_MAX / R); the M blocks after
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
// Outputs and error records (bits 1, 2, 16 and their keys) are kv_meta_one's; records: every block
// merges into records blockIdx.x * T / 32 + warp, only from a warp with an error (sticky).
// KV_TRACE stamps (benchmarks/trace_step1wm.py): slot 0 the block's start time, 1 its start clock, 15 its
// kind (1 request block, 3 pad block, 2 token block); metadata blocks: 2 the row loads issued, 3 the
// lengths arrived, 4 before the barrier, 5 after it, 6 the warp totals scanned, 7 (request blocks) the
// per-request outputs written, 8 the second barrier, 9 the loaded columns stored, 10 the rest of the
// row copied (pad blocks: the pad written); every kind: 11 the end clock, 12 the end time, 13 the SM.
struct __align__(16) KvMetaWideShared {
    int red[5][32];   // per-warp inclusive totals (tokens, L, pages) and maxima (tokens, L); T <= 1024
    int xq[32];       // owned request r0 + w: its first token (the key of its error records)
    int xp[32];       // owned request r0 + w: its kv_indptr (first kv_indices entry)
    int pg[32];       // owned request r0 + w: its pages in this block's cache
};

// Thread i's lengths: requests [R i, R i + R) below lim (0 from lim on): R / 4 int4 loads per array when
// both arrays are 16-byte aligned and all R lie below lim, else scalar loads.
template <int R>
__device__ __forceinline__ void kv_wm_lengths(const KvStepParams& p, int lim, int (&d)[R], int (&n)[R]) {
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
__device__ __forceinline__ void kv_wm_scan_warps(const int* v, int warps, int warp, int& before, int& total) {
    const int lane = threadIdx.x & 31;
    const int w = kv_warp_inclusive_nn(lane < warps ? v[lane] : 0);
    total = __shfl_sync(0xffffffffu, w, warps - 1);
    const int b = __shfl_sync(0xffffffffu, w, (warp + 31) & 31);
    before = warp == 0 ? 0 : b;
}

// Metadata block of kvaddr_step1wm{R}_*: T = blockDim.x threads, R x T >= bsz (see the section comment).
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
    KV_STAMP_TIME(0);
    KV_STAMP(1);
    int d[R], n[R];
    kv_wm_lengths<R>(p, lim, d, n);
    if (p.one_meta_flags & KV_M1_EMPTY) return;  // (ablation) no work, no error
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
    // the warp's first row columns: below the width, or (KV_M1_ROWS_BY_PAGES) below the request's pages
    // too, from its own lengths loaded first (half the row bytes at long contexts, one round trip later)
    int cols = fi && mine ? width : 0;
    if ((p.one_meta_flags & KV_M1_ROWS_BY_PAGES) && cols > 0) {
        const int dd = kv_ld(p.seq_lens_decoder + b0), nq = kv_ld(p.seq_lens_this_time + b0);
        const int L = ((dd < 0) | (nq < 0)) ? 0 : kv_sat_add_nn(dd, nq);
        cols = min(cols, kv_ceil_pages(L, uB, pow2, sh, rcp));
    }
    int v[KV_META_PRE];
    kv_one_row_loads(kv_global_addr(table) + 4u * (u64)((i64)b0 * stride + lane), cols - lane, v);
    KV_STAMP(2);
    KV_TRACE_WAIT(d[0]);
    KV_TRACE_WAIT(n[R - 1]);
    KV_STAMP(3);
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
    KV_STAMP(4);
    __syncthreads();
    KV_STAMP(5);
    int bq, tq, bl, tl, bp, tp;
    kv_wm_scan_warps(sm.red[0], warps, warp, bq, tq);
    kv_wm_scan_warps(sm.red[1], warps, warp, bl, tl);
    kv_wm_scan_warps(sm.red[2], warps, warp, bp, tp);  // tp: pages below lim (every page for pad blocks)
    KV_TRACE_WAIT(bp);
    KV_TRACE_WAIT(tp);
    KV_STAMP(6);
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
        KV_STAMP(7);
        if (fi) {
            __syncthreads();  // (uniform) the owned requests' prefixes
            KV_STAMP(8);
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
                KV_STAMP(9);
                if (end > KV_META_PRE * 32)
                    neg |= kv_copy_row_cols(table + (i64)b0 * stride, width, o, lane + KV_META_PRE * 32, end);
                if (neg) err.flag(KV_ERR_NEGATIVE_BLOCK, key, b0, g);
            }
        }
        KV_STAMP(10);
        KV_STAMP_VALUE(15, 1);
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
            kv_one_pad(p.kv_indices + (i64)g * N, tp + (int)lo, tp + (int)hi);
        }
        KV_STAMP(10);
        KV_STAMP_VALUE(15, 3);
    }
    kv_one_store_record(p, err);
    KV_STAMP(11);
    KV_STAMP_TIME(12);
    KV_STAMP_VALUE(13, kv_trace_sm());
}

// The step across blocks with attention outputs: <<<ceil(C / T) + M, T>>> (T <= KV_W_MAX / R). A block is
// a metadata block iff blockIdx.x * T >= C (no division on the token blocks' path).
template <int G, typename PosT, int R>
__device__ __forceinline__ void kv_step_wide_meta(const KvStepParams& p) {
    const unsigned int T = blockDim.x, C = (unsigned int)p.capacity;
    if ((u64)blockIdx.x * T >= C) {
        kv_meta_wide<G, R>(p);
        return;
    }
    KV_STAMP_TIME(0);
    KV_STAMP(1);
    kv_step_one_ablate<G, PosT, KV_V9_DEFAULT, R>(p);  // the token blocks: kvaddr_step1w{R}_c{G}_*'s code
    KV_STAMP(11);
    KV_STAMP_TIME(12);
    KV_STAMP_VALUE(13, kv_trace_sm());
    KV_STAMP_VALUE(15, 2);
}

// kvaddr_step1wm{R}_c{G}_{i64,i32}: <<<ceil(C / T) + M, T>>>, T <= KV_W_MAX / R (StepPlanner._wide_geometry).

extern "C" __global__ void __launch_bounds__(KV_W_MAX / 4, 1) kvaddr_step1wm4_c0_i64(const KvStepParams params) {
    kv_step_wide_meta<0, i64, 4>(params);
}

extern "C" __global__ void __launch_bounds__(KV_W_MAX / 4, 1) kvaddr_step1wm4_c1_i64(const KvStepParams params) {
    kv_step_wide_meta<1, i64, 4>(params);
}

extern "C" __global__ void __launch_bounds__(KV_W_MAX / 4, 1) kvaddr_step1wm4_c2_i64(const KvStepParams params) {
    kv_step_wide_meta<2, i64, 4>(params);
}

extern "C" __global__ void __launch_bounds__(KV_W_MAX / 4, 1) kvaddr_step1wm4_c3_i64(const KvStepParams params) {
    kv_step_wide_meta<3, i64, 4>(params);
}

extern "C" __global__ void __launch_bounds__(KV_W_MAX / 4, 1) kvaddr_step1wm4_c4_i64(const KvStepParams params) {
    kv_step_wide_meta<4, i64, 4>(params);
}

extern "C" __global__ void __launch_bounds__(KV_W_MAX / 4, 1) kvaddr_step1wm4_c0_i32(const KvStepParams params) {
    kv_step_wide_meta<0, int, 4>(params);
}

extern "C" __global__ void __launch_bounds__(KV_W_MAX / 4, 1) kvaddr_step1wm4_c1_i32(const KvStepParams params) {
    kv_step_wide_meta<1, int, 4>(params);
}

extern "C" __global__ void __launch_bounds__(KV_W_MAX / 4, 1) kvaddr_step1wm4_c2_i32(const KvStepParams params) {
    kv_step_wide_meta<2, int, 4>(params);
}

extern "C" __global__ void __launch_bounds__(KV_W_MAX / 4, 1) kvaddr_step1wm4_c3_i32(const KvStepParams params) {
    kv_step_wide_meta<3, int, 4>(params);
}

extern "C" __global__ void __launch_bounds__(KV_W_MAX / 4, 1) kvaddr_step1wm4_c4_i32(const KvStepParams params) {
    kv_step_wide_meta<4, int, 4>(params);
}

extern "C" __global__ void __launch_bounds__(KV_W_MAX / 8, 1) kvaddr_step1wm8_c0_i64(const KvStepParams params) {
    kv_step_wide_meta<0, i64, 8>(params);
}

extern "C" __global__ void __launch_bounds__(KV_W_MAX / 8, 1) kvaddr_step1wm8_c1_i64(const KvStepParams params) {
    kv_step_wide_meta<1, i64, 8>(params);
}

extern "C" __global__ void __launch_bounds__(KV_W_MAX / 8, 1) kvaddr_step1wm8_c2_i64(const KvStepParams params) {
    kv_step_wide_meta<2, i64, 8>(params);
}

extern "C" __global__ void __launch_bounds__(KV_W_MAX / 8, 1) kvaddr_step1wm8_c3_i64(const KvStepParams params) {
    kv_step_wide_meta<3, i64, 8>(params);
}

extern "C" __global__ void __launch_bounds__(KV_W_MAX / 8, 1) kvaddr_step1wm8_c4_i64(const KvStepParams params) {
    kv_step_wide_meta<4, i64, 8>(params);
}

extern "C" __global__ void __launch_bounds__(KV_W_MAX / 8, 1) kvaddr_step1wm8_c0_i32(const KvStepParams params) {
    kv_step_wide_meta<0, int, 8>(params);
}

extern "C" __global__ void __launch_bounds__(KV_W_MAX / 8, 1) kvaddr_step1wm8_c1_i32(const KvStepParams params) {
    kv_step_wide_meta<1, int, 8>(params);
}

extern "C" __global__ void __launch_bounds__(KV_W_MAX / 8, 1) kvaddr_step1wm8_c2_i32(const KvStepParams params) {
    kv_step_wide_meta<2, int, 8>(params);
}

extern "C" __global__ void __launch_bounds__(KV_W_MAX / 8, 1) kvaddr_step1wm8_c3_i32(const KvStepParams params) {
    kv_step_wide_meta<3, int, 8>(params);
}

extern "C" __global__ void __launch_bounds__(KV_W_MAX / 8, 1) kvaddr_step1wm8_c4_i32(const KvStepParams params) {
    kv_step_wide_meta<4, int, 8>(params);
}

extern "C" __global__ void __launch_bounds__(KV_W_MAX / 16, 1) kvaddr_step1wm16_c0_i64(const KvStepParams params) {
    kv_step_wide_meta<0, i64, 16>(params);
}

extern "C" __global__ void __launch_bounds__(KV_W_MAX / 16, 1) kvaddr_step1wm16_c1_i64(const KvStepParams params) {
    kv_step_wide_meta<1, i64, 16>(params);
}

extern "C" __global__ void __launch_bounds__(KV_W_MAX / 16, 1) kvaddr_step1wm16_c2_i64(const KvStepParams params) {
    kv_step_wide_meta<2, i64, 16>(params);
}

extern "C" __global__ void __launch_bounds__(KV_W_MAX / 16, 1) kvaddr_step1wm16_c3_i64(const KvStepParams params) {
    kv_step_wide_meta<3, i64, 16>(params);
}

extern "C" __global__ void __launch_bounds__(KV_W_MAX / 16, 1) kvaddr_step1wm16_c4_i64(const KvStepParams params) {
    kv_step_wide_meta<4, i64, 16>(params);
}

extern "C" __global__ void __launch_bounds__(KV_W_MAX / 16, 1) kvaddr_step1wm16_c0_i32(const KvStepParams params) {
    kv_step_wide_meta<0, int, 16>(params);
}

extern "C" __global__ void __launch_bounds__(KV_W_MAX / 16, 1) kvaddr_step1wm16_c1_i32(const KvStepParams params) {
    kv_step_wide_meta<1, int, 16>(params);
}

extern "C" __global__ void __launch_bounds__(KV_W_MAX / 16, 1) kvaddr_step1wm16_c2_i32(const KvStepParams params) {
    kv_step_wide_meta<2, int, 16>(params);
}

extern "C" __global__ void __launch_bounds__(KV_W_MAX / 16, 1) kvaddr_step1wm16_c3_i32(const KvStepParams params) {
    kv_step_wide_meta<3, int, 16>(params);
}

extern "C" __global__ void __launch_bounds__(KV_W_MAX / 16, 1) kvaddr_step1wm16_c4_i32(const KvStepParams params) {
    kv_step_wide_meta<4, int, 16>(params);
}

// ============================================================================
// BASELINE (MEASUREMENT) KERNELS: what the fused step is measured against. Not
// part of the fused step; launched by kvaddr/strategies/gpu.py and the benchmarks.
// ============================================================================

// One cache's slot mapping from positions and batch ids (the per-layer, one-kernel
// baseline). Padding (batch id < 0) and bad addresses give -1; nothing out of bounds.
template <typename PosT>
__device__ __forceinline__ void kv_slots(const PosT* __restrict__ pos, const int* __restrict__ batch,
                                         const int* __restrict__ table, i64 stride, int width, int B,
                                         int capacity, i64* __restrict__ out) {
    int t = blockIdx.x * KV_THREADS + threadIdx.x;
    if (t >= capacity) return;
    int b = batch[t];
    i64 slot = -1;
    if (b >= 0) {
        i64 p = (i64)pos[t];
        if (p >= 0) {
            i64 idx, off;
            kv_divmod(p, B, idx, off);
            if (idx < width) {
                int blk = table[(i64)b * stride + idx];
                if (blk >= 0) slot = (i64)blk * B + off;
            }
        }
    }
    out[t] = slot;
}

// Parameters, in order (kvaddr/strategies/gpu.py's SlotsArgs names them):
//   pos       [capacity], int64 / int32: position_ids
//   batch     [capacity], int32: batch_id_per_token (-1 padding)
//   table     [rows, width], int32: one cache's block table, rows `stride` elements apart
//   stride    int64: the table's row stride, in elements
//   width     int32: the table's row length (max_blocks)
//   B         int32: block size
//   capacity  int32: C, tokens
//   out       [capacity], int64: that cache's slot mapping
extern "C" __global__ void __launch_bounds__(KV_THREADS)
kvaddr_slots_i64(const i64* __restrict__ pos, const int* __restrict__ batch, const int* __restrict__ table,
                 i64 stride, int width, int B, int capacity, i64* __restrict__ out) {
    kv_slots<i64>(pos, batch, table, stride, width, B, capacity, out);
}

extern "C" __global__ void __launch_bounds__(KV_THREADS)
kvaddr_slots_i32(const int* __restrict__ pos, const int* __restrict__ batch, const int* __restrict__ table,
                 i64 stride, int width, int B, int capacity, i64* __restrict__ out) {
    kv_slots<int>(pos, batch, table, stride, width, B, capacity, out);
}

// The per-layer op chain's last step, the "where" a framework chain needs for padding
// and bad addresses: slot = -1 where batch < 0, idx >= width or blk < 0. Parameters
// (kvaddr/strategies/gpu.py's WhereArgs names them):
//   batch     [capacity], int32: batch_id_per_token
//   idx       [capacity], int64: block index pos // B
//   blk       [capacity], int32: gathered block id
//   width     int32: the table's row length
//   capacity  int32: C
//   slot      [capacity], int64: the slot mapping, fixed in place
extern "C" __global__ void __launch_bounds__(KV_THREADS)
kvaddr_where_pad(const int* __restrict__ batch, const i64* __restrict__ idx, const int* __restrict__ blk,
                 int width, int capacity, i64* __restrict__ slot) {
    int t = blockIdx.x * KV_THREADS + threadIdx.x;
    if (t >= capacity) return;
    if (batch[t] < 0 || idx[t] >= width || blk[t] < 0) slot[t] = -1;
}

// ---- attention metadata built the way engines build it today (separate launches) ----
// What the per-layer / per-layer-kernel / hoisted baselines run once per step when
// asked for attention outputs (kvaddr/strategies/gpu.py's EngineAttention): per cache
// pages, a cumsum for kv_indptr, a per-request copy of row prefixes into kv_indices
// (vLLM's FlashInfer backend copies page indices with one program per request), the
// -1 tail, kv_last_page_len; for varlen a cumsum and two max reductions. No checks
// (bad values are the fused step's business), nothing read past a row or written past N.

// pages[b] = ceil(seq_lens[b] / B) (0 for seq_lens <= 0). Parameters:
//   seq_lens  [n], int32: seq_lens_kv
//   n         int32: bsz
//   B         int32: block size
//   pages     [n], int32: out
extern "C" __global__ void __launch_bounds__(KV_THREADS)
kvaddr_engine_pages(const int* __restrict__ seq_lens, int n, int B, int* __restrict__ pages) {
    const int b = blockIdx.x * KV_THREADS + threadIdx.x;
    if (b < n) pages[b] = seq_lens[b] > 0 ? kv_pages(seq_lens[b], B) : 0;
}

// out[0] = 0, out[i + 1] = x[0] + ... + x[i] (saturating): one block of KV_THREADS
// threads, KV_THREADS items per round (a cumsum launch). Parameters:
//   x         [n], int32: non-negative
//   n         int32
//   out       [n + 1], int32
extern "C" __global__ void __launch_bounds__(KV_THREADS)
kvaddr_engine_cumsum(const int* __restrict__ x, int n, int* __restrict__ out) {
    __shared__ int wsum[KV_WARPS];
    __shared__ int carry;
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    if (threadIdx.x == 0) {
        carry = 0;
        out[0] = 0;
    }
    __syncthreads();
    for (int base = 0; base < n; base += KV_THREADS) {
        const int i = base + (int)threadIdx.x;
        const int v = i < n ? max(x[i], 0) : 0;
        const int inc = kv_warp_inclusive(v);
        if (lane == 31) wsum[warp] = inc;
        __syncthreads();
        int before, total;
        kv_warp_prefix(wsum, warp, before, total);
        const int c = carry;
        if (i < n) out[i + 1] = kv_sat_add(c, kv_sat_add(before, inc));
        __syncthreads();
        if (threadIdx.x == 0) carry = kv_sat_add(c, total);
        __syncthreads();
    }
}

// kv_indices[indptr[b] + j] = table[b, j] for j < indptr[b + 1] - indptr[b] (-1 for j >= width:
// the row is never read past its end), entries below N only: one block per request. Parameters:
//   indptr    [bsz + 1], int32: kv_indptr of this cache
//   table     [rows >= bsz, width], int32, rows `stride` elements apart
//   stride    int64: the table's row stride, in elements
//   width     int32: the table's row length
//   N         int32: kv_indices capacity
//   out       [N], int32: this cache's kv_indices
extern "C" __global__ void __launch_bounds__(KV_THREADS)
kvaddr_engine_copy_pages(const int* __restrict__ indptr, const int* __restrict__ table, i64 stride, int width,
                         int N, int* __restrict__ out) {
    const int b = blockIdx.x;
    const int start = indptr[b];
    const int n = indptr[b + 1] - start;
    for (int j = threadIdx.x; j < n && start + j < N; j += KV_THREADS)
        out[start + j] = j < width ? table[(i64)b * stride + j] : -1;
}

// kv_indices[e] = -1 for e in [indptr[bsz], N). Parameters:
//   indptr    [bsz + 1], int32
//   bsz       int32
//   N         int32
//   out       [N], int32
extern "C" __global__ void __launch_bounds__(KV_THREADS)
kvaddr_engine_pad_pages(const int* __restrict__ indptr, int bsz, int N, int* __restrict__ out) {
    const int e = blockIdx.x * KV_THREADS + threadIdx.x;
    if (e < N && e >= indptr[bsz]) out[e] = -1;
}

// last[b] = (seq_lens[b] - 1) % B + 1, 0 for seq_lens <= 0. Parameters:
//   seq_lens  [n], int32
//   n         int32
//   B         int32
//   last      [n], int32: kv_last_page_len of this cache
extern "C" __global__ void __launch_bounds__(KV_THREADS)
kvaddr_engine_last_page(const int* __restrict__ seq_lens, int n, int B, int* __restrict__ last) {
    const int b = blockIdx.x * KV_THREADS + threadIdx.x;
    if (b < n) {
        const int L = seq_lens[b];
        last[b] = L > 0 ? (int)((unsigned int)(L - 1) % (unsigned int)B) + 1 : 0;
    }
}

// *out = max over i < n of x[i + 1] - x[i] (diff = 1) or of x[i] (diff = 0); 0 for
// n = 0: one block (a max-reduction launch). Parameters:
//   x         [n + diff], int32
//   n         int32
//   diff      int32: 1 or 0
//   out       [], int32
extern "C" __global__ void __launch_bounds__(KV_THREADS)
kvaddr_engine_max(const int* __restrict__ x, int n, int diff, int* __restrict__ out) {
    __shared__ int wmax[KV_WARPS];
    int m = 0;
    for (int i = threadIdx.x; i < n; i += KV_THREADS) m = max(m, diff ? x[i + 1] - x[i] : x[i]);
    m = __reduce_max_sync(0xffffffffu, m);
    if ((threadIdx.x & 31) == 0) wmax[threadIdx.x >> 5] = m;
    __syncthreads();
    if (threadIdx.x == 0) {
        int r = 0;
#pragma unroll
        for (int w = 0; w < KV_WARPS; ++w) r = max(r, wmax[w]);
        *out = r;
    }
}

// An empty kernel: the launch floor.
extern "C" __global__ void kvaddr_empty() {}

// FastDeploy's one-block step (the design it shipped after #7367), written here from
// its description: ONE block of one thread per request (<<<1, bsz>>>, so bsz <= 1024);
// thread b adds up the earlier requests' lengths serially (its cu_seqlens_q start),
// then loops over its own tokens writing batch id, position and every cache's slot.
// What kvaddr's contract adds to FastDeploy's op, so the outputs equal the reference's
// for every input: bad lengths (either negative) run no tokens; tokens past the capacity
// are dropped; bad addresses give slot -1 and nothing is read outside the tables; after
// one barrier the block strides over the padding tokens [num_tokens, capacity). Error
// record: bits 4 and 8 (those of the other baselines' position kernel; bits 1 and 2 are
// not recorded), as (mask, first-bad key), rewritten every launch (graph-replay safe).
// Launched by kvaddr/strategies/gpu.py (OneBlock) and benchmarks/floor_step.py with
// blockDim = max(bsz, 1). Its one parameter is a KvOneBlockParams, passed by value
// (kvaddr/kernel_loader.py's OneBlockParams mirrors it; tests/unit/test_kernel_params.py
// checks the layout with nvcc).
#define KV_ONE_BLOCK_MAX_REQUESTS 1024

struct KvOneBlockParams {
    // -- inputs (read only) --
    const int* seq_lens_decoder;             // [bsz], int32: tokens already in each request's KV cache
    const int* seq_lens_this_time;           // [bsz], int32: tokens each request runs this step
    const int* block_tables[KV_MAX_CACHES];  // cache g: [rows >= bsz, max_blocks[g]], int32, rows
                                             // table_stride[g] elements apart; null for an unused cache
    // -- outputs (written every launch) --
    int* cu_seqlens_q;                       // [bsz + 1], int32: exclusive prefix of the tokens
    int* num_tokens;                         // [] (one value), int32: min(total tokens, capacity)
    int* batch_id_per_token;                 // [capacity], int32: request of each token, -1 for padding
    void* position_ids;                      // [capacity], int64 (kvaddr_one_block_i64) or int32 (_i32)
    int* seq_lens_kv;                        // [bsz], int32: seq_lens_decoder + seq_lens_this_time
    i64* slot_mapping;                       // [num_caches, capacity], int64: cache slot, -1 padding/bad
    u64* error_record;                       // [2], uint64: (error mask, first-bad key), rewritten every launch
    // -- scalars --
    i64 table_stride[KV_MAX_CACHES];         // row stride of block_tables[g], in elements (int64)
    int max_blocks[KV_MAX_CACHES];           // row length of block_tables[g], int32 (1 for an unused cache)
    int block_size[KV_MAX_CACHES];           // B of cache g, int32 >= 1 (1 for an unused cache)
    int bsz;                                 // requests this step, int32 in [0, KV_ONE_BLOCK_MAX_REQUESTS]
    int capacity;                            // C: tokens of every per-token output, int32 >= 1
    int num_caches;                          // caches addressed, int32 in [0, KV_MAX_CACHES]
    int reserved;                            // int32, unused (keeps the struct free of tail padding)
};
static_assert(sizeof(KvOneBlockParams) == 13 * 8 + KV_MAX_CACHES * (8 + 4 + 4) + 4 * 4,
              "KvOneBlockParams has no padding (the ctypes mirror assumes the C layout)");

template <typename PosT>
__device__ __forceinline__ void kv_one_block(const KvOneBlockParams& p) {
    __shared__ unsigned int s_mask;
    __shared__ u64 s_key;
    __shared__ int s_num_tokens;
    const int b = threadIdx.x, bsz = p.bsz, capacity = p.capacity;
    if (b == 0) {
        s_mask = 0u;
        s_key = KV_NO_ERROR;
        p.cu_seqlens_q[0] = 0;
        if (bsz == 0) {
            s_num_tokens = 0;
            *p.num_tokens = 0;
        }
    }
    __syncthreads();
    if (b < bsz) {
        const int* __restrict__ dec = p.seq_lens_decoder;
        const int* __restrict__ q = p.seq_lens_this_time;
        i64 start = 0;  // the serial prefix: every earlier good request's tokens
        for (int j = 0; j < b; ++j) {
            const int dj = dec[j], nj = q[j];
            if ((dj | nj) >= 0) start += nj;
        }
        const int d = dec[b];
        int n = q[b];
        const bool bad = (d | n) < 0;
        if (bad) n = 0;
        const i64 end = start + n;
        p.cu_seqlens_q[b + 1] = (int)(end < KV_INT_MAX ? end : KV_INT_MAX);
        p.seq_lens_kv[b] = bad ? 0 : (d > KV_INT_MAX - n ? KV_INT_MAX : d + n);
        if (b == bsz - 1) {
            const int nt = (int)(end < capacity ? end : capacity);
            s_num_tokens = nt;
            *p.num_tokens = nt;
        }
        unsigned int mask = 0u;
        u64 key = KV_NO_ERROR;
        if (bad) {
            mask = KV_ERR_NEGATIVE_LENGTH;
            key = kv_err_key((u64)(start < KV_INT_MAX ? start : KV_INT_MAX), (u64)b, 0ULL,
                             KV_ERR_LOG2(KV_ERR_NEGATIVE_LENGTH));
        } else if (start <= capacity && capacity < end) {  // this request owns token C, the first dropped
            mask = KV_ERR_CAPACITY;
            key = kv_err_key((u64)capacity, (u64)b, 0ULL, KV_ERR_LOG2(KV_ERR_CAPACITY));
        }
        if (mask) {
            atomicOr(&s_mask, mask);
            atomicMin(&s_key, key);
        }
        PosT* __restrict__ pos_out = static_cast<PosT*>(p.position_ids);
        const int stop = (int)(end < capacity ? end : capacity);
        for (int t = (int)(start < capacity ? start : capacity); t < stop; ++t) {
            const i64 pos = (i64)d + (t - start);
            p.batch_id_per_token[t] = b;
            pos_out[t] = (PosT)pos;
#pragma unroll
            for (int g = 0; g < KV_MAX_CACHES; ++g) {
                if (g < p.num_caches) {
                    const int B = p.block_size[g];
                    i64 idx, off;
                    if (pos <= KV_INT_MAX) {  // 32-bit division when it fits
                        const unsigned int qd = (unsigned int)pos / (unsigned int)B;
                        idx = qd;
                        off = (unsigned int)pos - qd * (unsigned int)B;
                    } else {
                        idx = pos / B;
                        off = pos - idx * B;
                    }
                    i64 slot = -1;
                    if (idx < p.max_blocks[g]) {
                        const int blk = p.block_tables[g][(i64)b * p.table_stride[g] + idx];
                        if (blk >= 0) slot = (i64)blk * B + off;
                    }
                    p.slot_mapping[(i64)g * capacity + t] = slot;
                }
            }
        }
    }
    __syncthreads();
    if (b == 0) {
        p.error_record[0] = s_mask;
        p.error_record[1] = s_key;
    }
    // Padding [num_tokens, capacity): the whole block strides over it.
    PosT* __restrict__ pos_out = static_cast<PosT*>(p.position_ids);
    for (int t = s_num_tokens + b; t < capacity; t += blockDim.x) {
        p.batch_id_per_token[t] = -1;
        pos_out[t] = 0;
#pragma unroll
        for (int g = 0; g < KV_MAX_CACHES; ++g) {
            if (g < p.num_caches) p.slot_mapping[(i64)g * capacity + t] = -1;
        }
    }
}

// The one-block step, position_ids int64 / int32: <<<1, max(bsz, 1)>>>, one parameter.
extern "C" __global__ void __launch_bounds__(KV_ONE_BLOCK_MAX_REQUESTS)
kvaddr_one_block_i64(const KvOneBlockParams params) {
    kv_one_block<i64>(params);
}

extern "C" __global__ void __launch_bounds__(KV_ONE_BLOCK_MAX_REQUESTS)
kvaddr_one_block_i32(const KvOneBlockParams params) {
    kv_one_block<int>(params);
}

// ============================================================================
// END OF BASELINE (MEASUREMENT) KERNELS
// ============================================================================

// =====================================================================================
// ==== vLLM engine step (kvaddr/engines/vllm.py) =======================================
// =====================================================================================
//
// kvaddr_vllm_step_v2 (and kvaddr_vllm_step_v2a, with attention metadata): vLLM Model
// Runner V2's input preparation in ONE launch: positions, seq_lens (zero-padded to
// max_num_reqs), the slot mapping of every KV-cache group (-1 from num_tokens to the end),
// the batch-order gathered block tables (stale and padding rows zeroed, sliding-window
// nulling) and the DCP local lengths. Semantics: docs/vllm.md and
// kvaddr/engines/vllm_reference.py (the oracle). Self-contained: it uses nothing above this
// banner (helpers carry a vllm_ prefix). This part holds the shared helpers; the kernel is
// in the section "vLLM engine step, second version" below (the first version,
// kvaddr_vllm_step, slower on every measured row, was deleted in the sixth session).
//
// Parameters: ONE struct by value (VllmStepParams), mirrored field by field by
// kvaddr/engines/vllm.py (ctypes, filled by name; tests/unit/test_vllm_struct.py
// compares the layouts). Group-indexed fields are only ever indexed with
// compile-time indices (unrolled loops, vllm_pick), so the struct stays in the
// parameter space (no local copy, no stack frame).

#define VLLM_THREADS 256
#define VLLM_WARPS (VLLM_THREADS / 32)
#define VLLM_MAX_GROUPS 4
#define VLLM_INT_MAX 0x7fffffffLL
#define VLLM_NO_ERROR 0xffffffffffffffffULL

// Group flags (VllmStepParams.group_flags[g]).
#define VLLM_GROUP_SLOTS 1    // slot mapping enabled
#define VLLM_GROUP_SHARDED 2  // DCP-sharded (cp_size > 1 and the group's dcp_sharded)

// Error bits (kvaddr/engines/vllm_errors.py).
#define VLLM_ERR_BLOCK_INDEX 1
#define VLLM_ERR_NEGATIVE_BLOCK 2
#define VLLM_ERR_CAPACITY 4
#define VLLM_ERR_QUERY_START_LOC 8
#define VLLM_ERR_PAST_NUM_BLOCKS 16
#define VLLM_ERR_ROW_INDEX 32
#define VLLM_ERR_NUM_BLOCKS 64
#define VLLM_ERR_NEGATIVE_COMPUTED 128
#define VLLM_ERR_SLOT_INT32 256

struct VllmStepParams {
    // -- inputs (8-byte fields first) --
    const void* idx_mapping;           // [num_reqs], int32 (idx_is_64 = 0) or int64 (1): batch b -> row r; -1 = dummy
    const int* query_start_loc;        // [num_reqs + 1], int32: request b's tokens are [qsl[b], qsl[b+1])
    const int* num_computed_tokens;    // [>= max_num_reqs], int32, by row r
    const int* block_table[4];         // group g: [>= max_num_reqs, width[g]], int32, row stride table_stride[g]
    const int* num_blocks[4];          // group g: [>= max_num_reqs], int32 (num_blocks_stride apart if stacked)
    long long table_stride[4];         // group g: elements between rows of block_table[g]
    // -- outputs --
    long long* positions;              // [max_tokens], int64
    int* seq_lens;                     // [max_num_reqs], int32
    void* slot_mappings;               // [num_groups rows, slot_stride apart][max_tokens], int64 or int32 (slot_is_32)
    long long slot_stride;             // elements between two groups' rows of slot_mappings
    int* gathered[4];                  // group g: [max_num_reqs, width[g]], int32, row stride gathered_stride[g]
    long long gathered_stride[4];      // group g: elements between rows of gathered[g]
    int* dcp_local_seq_lens;           // [max_num_reqs], int32
    // -- persistent scratch (owned by the planner) --
    int* row_fill[4];                  // group g: [max_num_reqs], int32: entries of gathered row b that may be non-zero
    unsigned long long* errors;        // [R, 2], uint64: sticky per-warp error records (mask, first-bad key)
    // -- sizes and settings (4-byte fields) --
    int width[4];                      // group g: columns of block_table[g] and gathered[g] (>= 1)
    int block_size[4];                 // group g: B (>= 1)
    int group_flags[4];                // group g: VLLM_GROUP_SLOTS | VLLM_GROUP_SHARDED
    int sliding_window_reach[4];       // group g: R (0: no sliding window)
    int num_groups;                    // G, 1..4
    int num_reqs;                      // entries of idx_mapping (<= max_num_reqs)
    int num_reqs_padded;               // num_reqs <= . <= max_num_reqs
    int max_num_reqs;                  // rows of the state and of every per-request output
    int max_tokens;                    // max_num_batched_tokens, T
    int idx_is_64;                     // idx_mapping is int64
    int slot_is_32;                    // slot_mappings is int32 (a slot > 2^31-1: error bit, -1)
    int cp_size;                       // DCP ranks (1: no DCP)
    int cp_rank;                       // this rank, 0..cp_size-1
    int cp_interleave;                 // I, divides every sharded group's B
    int token_blocks;                  // blocks [0, token_blocks) address tokens
    int request_blocks;                // the next request_blocks blocks write per-request outputs
    int pair_lanes;                    // kvaddr_vllm_step_v2: lanes per (group, row) pair of the gather, 8/16/32
    // -- attention metadata (kvaddr_vllm_step_v2a only; appended: the fields above are unchanged) --
    int* qo_indptr;                    // [max_num_reqs + 1], int32: query_start_loc, padded with qsl[num_reqs]
    int* kv_indptr;                    // [num_groups, max_num_reqs + 1], int32 (row g at g * (max_num_reqs + 1))
    int* kv_indices;                   // [num_groups, kv_indices_capacity], int32 (row g at g * capacity)
    int* kv_last_page_len;             // [num_groups, max_num_reqs], int32
    int* cu_seqlens_k;                 // [num_groups, max_num_reqs + 1], int32
    int* max_seqlen;                   // [1 + num_groups], int32: max_seqlen_q, then max_seqlen_k of each group
    int attention;                     // VLLM_ATTN_* bits asked for (kvaddr_vllm_step_v2a)
    int kv_indices_capacity;           // N, entries of each group's kv_indices (1 when flashinfer is off)
    int meta_blocks;                   // metadata blocks per group: ceil((max_num_reqs + 1) / meta_rows)
    int meta_entries;                  // kv_indices entries each metadata block pads: ceil(N / meta_blocks)
    int meta_lanes;                    // lanes per request of the metadata row copy (4, 8, 16 or 32)
    int meta_rows;                     // batch rows per metadata block: block k owns [k * meta_rows, +meta_rows)
    int meta_impl;                     // 0: vllm_attn_block0 (first version), 1: vllm_attn_block1 (shorter chain)
};

// a[g] for a runtime g, with compile-time indices only.
template <typename T>
__device__ __forceinline__ T vllm_pick(const T (&a)[VLLM_MAX_GROUPS], int g) {
    T v = a[0];
#pragma unroll
    for (int k = 1; k < VLLM_MAX_GROUPS; ++k) v = (g == k) ? a[k] : v;
    return v;
}

__device__ __forceinline__ unsigned long long vllm_key(long long token, int request, int group, int bit_index) {
    return ((unsigned long long)token << 32) | ((unsigned long long)request << 8) |
           ((unsigned long long)group << 5) | (unsigned long long)bit_index;
}

struct VllmErr {
    unsigned int mask;
    unsigned long long key;
    __device__ __forceinline__ void add(unsigned int bit, int bit_index, long long token, int request, int group) {
        mask |= bit;
        const unsigned long long k = vllm_key(token, request, group, bit_index);
        key = k < key ? k : key;
    }
};

__device__ __forceinline__ long long vllm_row_of(const VllmStepParams& p, int b) {
    return p.idx_is_64 ? reinterpret_cast<const long long*>(p.idx_mapping)[b]
                       : (long long)reinterpret_cast<const int*>(p.idx_mapping)[b];
}

// The owner of token t (0 <= t, num_reqs >= 1) when the guess min(t, n-1) does not
// hold it: the largest b in [0, n-1] with qsl[b] <= t (binary search). The reference
// replicates guess and search exactly (owner_search).
__device__ __forceinline__ int vllm_owner_search(const int* __restrict__ qsl, int n, int t) {
    int lo = 0, hi = n - 1;
    while (lo < hi) {
        const int mid = (lo + hi + 1) >> 1;
        if (qsl[mid] <= t) lo = mid;
        else hi = mid - 1;
    }
    return lo;
}

__device__ __forceinline__ void vllm_store_slot(const VllmStepParams& p, int g, int t, long long slot) {
    const long long at = (long long)g * p.slot_stride + t;
    if (p.slot_is_32) reinterpret_cast<int*>(p.slot_mappings)[at] = (int)slot;
    else reinterpret_cast<long long*>(p.slot_mappings)[at] = slot;
}

// Is batch entry b < num_reqs a real request with good inputs? Sets its row and
// num_computed_tokens; with record, adds its per-request errors.
__device__ __forceinline__ bool vllm_request(const VllmStepParams& p, int b, long long& r, int& nct, int& q0,
                                             int& q1, bool record, VllmErr& err) {
    q0 = p.query_start_loc[b];
    q1 = p.query_start_loc[b + 1];
    r = vllm_row_of(p, b);
    nct = 0;
    const long long tok = q0 < 0 ? 0 : q0;
    bool good = true;
    if (r == -1) good = false;
    if (r < -1 || r >= p.max_num_reqs) {
        good = false;
        if (record) err.add(VLLM_ERR_ROW_INDEX, 5, tok, b, 0);
    } else if (r >= 0) {
        nct = p.num_computed_tokens[r];
        if (nct < 0) {
            good = false;
            if (record) err.add(VLLM_ERR_NEGATIVE_COMPUTED, 7, tok, b, 0);
        }
    }
    if (q0 < 0 || q1 < q0) {
        good = false;
        if (record) err.add(VLLM_ERR_QUERY_START_LOC, 3, tok, b, 0);
    }
    if (record && q1 > p.max_tokens) err.add(VLLM_ERR_CAPACITY, 2, p.max_tokens, b, 0);
    return good;
}

__device__ __forceinline__ int vllm_dcp_len(const VllmStepParams& p, int s) {
    if (p.cp_size == 1) return s;
    const long long il = p.cp_interleave, span = il * p.cp_size;
    long long rest = (long long)s % span - (long long)p.cp_rank * il;
    rest = rest < 0 ? 0 : (rest > il ? il : rest);
    return (int)(((long long)s / span) * il + rest);
}

// =====================================================================================
// ==== vLLM's three-launch design, re-implemented (kvaddr/strategies/vllm_three_launch.py)
// =====================================================================================
//
// The baseline kvaddr_vllm_step_v2 is measured against: vLLM Model Runner V2 prepares
// the same outputs in three launches, in this order and with these grids (kvaddr's
// own code, written from the design, not vLLM's):
//   1. kvaddr_vllm3_prepare   grid (num_reqs + 1): a program per request writes its
//      positions, seq_lens and DCP local length; the last program pads seq_lens (and,
//      for kvaddr's contract, positions past num_tokens and the DCP lengths).
//   2. kvaddr_vllm3_gather    grid (rows, G): a program per batch row and group copies
//      the row's first num_blocks entries (with kvaddr's stale-tail and padding-row
//      zeroing, through the same per-row fill counts, so both designs do the same work).
//   3. kvaddr_vllm3_slots     grid (num_reqs + 1, G): a program per request and group
//      reads the positions launch 1 wrote and writes the slots; the last one pads -1.
// A program is a block of VLLM3_THREADS threads. They take the same VllmStepParams;
// no error checks (vLLM makes none), only the guards that keep reads in bounds.

#define VLLM3_THREADS 128

// vllm_request's test (a real request with good inputs) with group g's num_blocks of the
// row loaded together with its num_computed_tokens; no error records.
__device__ __forceinline__ bool vllm3_request(const VllmStepParams& p, int b, int g, long long& r, int& nct, int& q0,
                                              int& q1, int& nb) {
    q0 = p.query_start_loc[b];
    q1 = p.query_start_loc[b + 1];
    r = vllm_row_of(p, b);
    nct = 0;
    nb = 0;
    if (r < 0 || r >= p.max_num_reqs) return false;
    nb = vllm_pick(p.num_blocks, g)[r];
    nct = p.num_computed_tokens[r];
    return nct >= 0 && q0 >= 0 && q1 >= q0;
}

extern "C" __global__ void __launch_bounds__(VLLM3_THREADS) kvaddr_vllm3_prepare(const VllmStepParams p) {
    const int n = p.num_reqs, b = blockIdx.x;
    VllmErr none;
    none.mask = 0;
    none.key = VLLM_NO_ERROR;
    if (b < n) {
        long long r;
        int nct, q0, q1;
        const bool good = vllm_request(p, b, r, nct, q0, q1, false, none);
        const int end = q1 < p.max_tokens ? q1 : p.max_tokens;
        for (int t = (q0 < 0 ? 0 : q0) + (int)threadIdx.x; t < end; t += VLLM3_THREADS)
            p.positions[t] = good ? (long long)nct + (t - q0) : 0;
        if (threadIdx.x == 0) {
            int seq = 0;
            if (good) {
                const long long s = (long long)nct + ((long long)q1 - q0);
                seq = (int)(s > VLLM_INT_MAX ? VLLM_INT_MAX : s);
            }
            p.seq_lens[b] = seq;
            p.dcp_local_seq_lens[b] = vllm_dcp_len(p, seq);
        }
        return;
    }
    for (int k = n + (int)threadIdx.x; k < p.max_num_reqs; k += VLLM3_THREADS) {
        p.seq_lens[k] = 0;
        p.dcp_local_seq_lens[k] = 0;
    }
    const int last = p.query_start_loc[n];
    const int num_tokens = last < 0 ? 0 : (last > p.max_tokens ? p.max_tokens : last);
    for (int t = num_tokens + (int)threadIdx.x; t < p.max_tokens; t += VLLM3_THREADS) p.positions[t] = 0;
}

extern "C" __global__ void __launch_bounds__(VLLM3_THREADS) kvaddr_vllm3_gather(const VllmStepParams p) {
    const int b = blockIdx.x, g = blockIdx.y;
    const int W = vllm_pick(p.width, g);
    int* __restrict__ out = vllm_pick(p.gathered, g) + (long long)b * vllm_pick(p.gathered_stride, g);
    int* __restrict__ fill_at = vllm_pick(p.row_fill, g) + b;
    const int fill = *fill_at;
    int nbc = 0, first = 0;
    const int* __restrict__ src = 0;
    if (b < p.num_reqs) {
        long long r;
        int nct, q0, q1, nb;
        if (vllm3_request(p, b, g, r, nct, q0, q1, nb)) {
            nbc = nb < 0 ? 0 : (nb > W ? W : nb);
            src = vllm_pick(p.block_table, g) + r * vllm_pick(p.table_stride, g);
            const int reach = vllm_pick(p.sliding_window_reach, g);
            if (reach > 0) {
                const long long f = ((long long)nct - reach) / vllm_pick(p.block_size, g);
                first = f < 0 ? 0 : (int)(f > W ? W : f);
            }
        }
    }
    // As vLLM's gather: 1024 entries per iteration (8 loads in flight per thread).
    const int end = nbc > fill ? nbc : fill;
    for (int j0 = 0; j0 < end; j0 += 8 * VLLM3_THREADS) {
        int v[8];
#pragma unroll
        for (int k = 0; k < 8; ++k) {
            const int j = j0 + VLLM3_THREADS * k + (int)threadIdx.x;
            v[k] = (j < nbc && j >= first) ? src[j] : 0;
        }
#pragma unroll
        for (int k = 0; k < 8; ++k) {
            const int j = j0 + VLLM3_THREADS * k + (int)threadIdx.x;
            if (j < end) out[j] = v[k];
        }
    }
    __syncthreads();
    if (threadIdx.x == 0) *fill_at = nbc;
}

extern "C" __global__ void __launch_bounds__(VLLM3_THREADS) kvaddr_vllm3_slots(const VllmStepParams p) {
    const int n = p.num_reqs, b = blockIdx.x, g = blockIdx.y;
    if (b == n) {  // the padding program
        const int last = p.query_start_loc[n];
        const int num_tokens = last < 0 ? 0 : (last > p.max_tokens ? p.max_tokens : last);
        for (int t = num_tokens + (int)threadIdx.x; t < p.max_tokens; t += VLLM3_THREADS)
            vllm_store_slot(p, g, t, -1);
        return;
    }
    long long r;
    int nct, q0, q1, nb;
    const bool good = vllm3_request(p, b, g, r, nct, q0, q1, nb);
    const int flags = vllm_pick(p.group_flags, g);
    const unsigned int B = (unsigned int)vllm_pick(p.block_size, g);
    const int W = vllm_pick(p.width, g);
    const int* __restrict__ row = vllm_pick(p.block_table, g) + (good ? r : 0) * vllm_pick(p.table_stride, g);
    const int end = q1 < p.max_tokens ? q1 : p.max_tokens;
    for (int t = (q0 < 0 ? 0 : q0) + (int)threadIdx.x; t < end; t += VLLM3_THREADS) {
        long long slot = -1;
        if (good && (flags & VLLM_GROUP_SLOTS)) {
            const unsigned int up = (unsigned int)p.positions[t];
            unsigned int idx, off;
            bool local = true;
            if (flags & VLLM_GROUP_SHARDED) {
                const unsigned int cp = (unsigned int)p.cp_size, il = (unsigned int)p.cp_interleave;
                const unsigned int vbs = B * cp;
                idx = up / vbs;
                const unsigned int vo = up - idx * vbs;
                local = ((vo / il) % cp) == (unsigned int)p.cp_rank;
                off = (vo / (il * cp)) * il + vo % il;
            } else {
                idx = up / B;
                off = up - idx * B;
            }
            if (local && (long long)idx < (long long)W && (long long)idx < (long long)nb) {
                const int blk = row[idx];
                if (blk >= 0) {
                    slot = (long long)blk * (long long)B + off;
                    if (p.slot_is_32 && slot > VLLM_INT_MAX) slot = -1;
                }
            }
        }
        vllm_store_slot(p, g, t, slot);
    }
}

// =====================================================================================
// ==== vLLM engine step, second version (kvaddr_vllm_step_v2) =========================
// =====================================================================================
//
// The one-launch vLLM step (VllmStepPlanner). What changed from the first version
// (kvaddr_vllm_step, deleted in the sixth session after it measured slower on every row of
// benchmarks/bench_vllm.py), and why (docs/perf-notes.md, "The vLLM step"):
//   * No grid-wide ticket, no fence, no device row count. The first version ended every
//     block with __syncthreads + __threadfence + a ticket atomic, and its last block
//     published the error record with two more atomics: a chain of dependent L2 round
//     trips after the useful work. Here every warp of the token, request and metadata
//     blocks (a number fixed by the planner's sizes) has an error record (mask, first-bad
//     key) of its own, written only by a warp that found an error (merged with atomicOr /
//     atomicMin: sticky, sixth session); the host reduces the records and clears them
//     (VllmStepPlanner.errors). The gather blocks detect no error (the num_blocks check
//     moved to the request role, which holds the same row).
//   * The gather role covers only the real batch rows [0, num_reqs): its blocks start
//     with the row loads (the first version first loaded the device row count). Every
//     row b >= num_reqs (padding rows and rows an earlier step left with data) belongs
//     to the request role's thread b, which already writes that row's zero seq_lens: it
//     reads the row's fill (row_fill[g][b], entries that may be non-zero) and, when it
//     is not zero, its warp zeroes those entries together and the fill becomes 0. The
//     planner's first call finds every fill at the width (row_fill's initial value), so
//     a caller-owned out= table is zeroed in full once.
//   * Gather lanes per (group, row) pair are a parameter (pair_lanes 8, 16 or 32; the
//     planner picks by batch size), each lane with VLLM2_GATHER_LOADS loads in flight.
//   * A token whose owner is not the guess min(t, n-1) searches query_start_loc staged
//     in shared memory (one coalesced load per block, when num_reqs + 1 <=
//     VLLM2_QSL_SMEM), not in global memory (one dependent round trip per step). A
//     decode batch (every guess right) skips the staging: one __syncthreads_or.
// The owner search (guess, then the largest b with qsl[b] <= t) and every record key
// are the first version's, so the reference (the oracle) is unchanged.

#define VLLM2_GATHER_LOADS 8
#define VLLM2_QSL_SMEM 2048

// The guess of token t (t < max_tokens, num_reqs >= 1): b = min(t, n-1) with its range and
// row, and the token count. Returns whether t < num_tokens lies outside the guess's range
// (the owner must be searched).
__device__ __forceinline__ bool vllm2_token_guess(const VllmStepParams& p, int t, int& b, int& q0, int& q1,
                                                  long long& r, int& num_tokens) {
    const int n = p.num_reqs;
    const int* __restrict__ qsl = p.query_start_loc;
    const int last = qsl[n];
    b = t < n - 1 ? t : n - 1;
    q0 = qsl[b];
    q1 = qsl[b + 1];
    r = vllm_row_of(p, b);
    num_tokens = last < 0 ? 0 : (last > p.max_tokens ? p.max_tokens : last);
    return t < num_tokens && !(q0 <= t && t < q1);
}

// Token t's outputs once its owner b (range [q0, q1), row r) is known: positions[t] and
// every group's slot (the first version's token code after the owner search). DCP: the
// step may have sharded groups (cp_size > 1); without it the sharded path is not compiled,
// so a group's block index costs one division (ptxas if-converted the sharded path's four
// divisions into every group's code; eleventh session, docs/perf-notes.md).
template <bool DCP>
__device__ __forceinline__ void vllm2_token_write(const VllmStepParams& p, int t, int b, int q0, int q1, long long r,
                                                  int num_tokens, VllmErr& err) {
    bool valid = false;
    long long pos = 0;
    int nbs[VLLM_MAX_GROUPS] = {0, 0, 0, 0};
    if (t < num_tokens && q0 >= 0 && q0 <= t && t < q1) {
        if (r >= 0 && r < p.max_num_reqs) {
#pragma unroll
            for (int g = 0; g < VLLM_MAX_GROUPS; ++g)
                if (g < p.num_groups && (p.group_flags[g] & VLLM_GROUP_SLOTS)) nbs[g] = p.num_blocks[g][r];
            const int nct = p.num_computed_tokens[r];
            if (nct >= 0) {
                valid = true;
                pos = (long long)nct + (t - q0);
            }
        }
    }
    p.positions[t] = pos;
#pragma unroll
    for (int g = 0; g < VLLM_MAX_GROUPS; ++g) {
        if (g >= p.num_groups) break;
        long long slot = -1;
        const int flags = p.group_flags[g];
        if (valid && (flags & VLLM_GROUP_SLOTS)) {
            const unsigned int up = (unsigned int)pos;
            const unsigned int B = (unsigned int)p.block_size[g];
            unsigned int idx, off;
            bool local = true;
            if (DCP && (flags & VLLM_GROUP_SHARDED)) {
                const unsigned int cp = (unsigned int)p.cp_size, il = (unsigned int)p.cp_interleave;
                const unsigned int vbs = B * cp;
                idx = up / vbs;
                const unsigned int vo = up - idx * vbs;
                local = ((vo / il) % cp) == (unsigned int)p.cp_rank;
                off = (vo / (il * cp)) * il + vo % il;
            } else {
                idx = up / B;
                off = up - idx * B;
            }
            if (local) {
                const int nb = nbs[g];
                if ((long long)idx >= (long long)p.width[g]) {
                    err.add(VLLM_ERR_BLOCK_INDEX, 0, t, b, g);
                } else if ((long long)idx >= (long long)nb) {
                    err.add(VLLM_ERR_PAST_NUM_BLOCKS, 4, t, b, g);
                } else {
                    const int blk = p.block_table[g][r * p.table_stride[g] + idx];
                    if (blk < 0) {
                        err.add(VLLM_ERR_NEGATIVE_BLOCK, 1, t, b, g);
                    } else {
                        slot = (long long)blk * (long long)B + off;
                        if (p.slot_is_32 && slot > VLLM_INT_MAX) {
                            err.add(VLLM_ERR_SLOT_INT32, 8, t, b, g);
                            slot = -1;
                        }
                    }
                }
            }
        }
        vllm_store_slot(p, g, t, slot);
    }
}

// One batch row b < max_num_reqs of the request role: seq_lens, dcp_local_seq_lens, the
// per-request checks, and (moved here from the gather) every group's num_blocks check,
// with the key the first version's gather gave it.
__device__ __forceinline__ void vllm2_request_row(const VllmStepParams& p, int b, VllmErr& err) {
    int seq = 0;
    if (b < p.num_reqs) {
        const int q0 = p.query_start_loc[b], q1 = p.query_start_loc[b + 1];
        const long long r = vllm_row_of(p, b);
        const long long tok = q0 < 0 ? 0 : q0;
        int nct = 0;
        int nbs[VLLM_MAX_GROUPS] = {0, 0, 0, 0};
        bool good = r >= 0;
        if (r < -1 || r >= p.max_num_reqs) {
            good = false;
            err.add(VLLM_ERR_ROW_INDEX, 5, tok, b, 0);
        } else if (r >= 0) {
            // The row's num_blocks are loaded with its num_computed_tokens.
#pragma unroll
            for (int g = 0; g < VLLM_MAX_GROUPS; ++g)
                if (g < p.num_groups) nbs[g] = p.num_blocks[g][r];
            nct = p.num_computed_tokens[r];
            if (nct < 0) {
                good = false;
                err.add(VLLM_ERR_NEGATIVE_COMPUTED, 7, tok, b, 0);
            }
        }
        if (q0 < 0 || q1 < q0) {
            good = false;
            err.add(VLLM_ERR_QUERY_START_LOC, 3, tok, b, 0);
        }
        if (q1 > p.max_tokens) err.add(VLLM_ERR_CAPACITY, 2, p.max_tokens, b, 0);
        if (good) {
            const long long s = (long long)nct + ((long long)q1 - q0);
            seq = (int)(s > VLLM_INT_MAX ? VLLM_INT_MAX : s);
#pragma unroll
            for (int g = 0; g < VLLM_MAX_GROUPS; ++g)
                if (g < p.num_groups && (nbs[g] < 0 || nbs[g] > p.width[g]))
                    err.add(VLLM_ERR_NUM_BLOCKS, 6, q0, b, g);
        }
    }
    p.seq_lens[b] = seq;
    p.dcp_local_seq_lens[b] = vllm_dcp_len(p, seq);
}

// One (group, real batch row b < num_reqs) pair by `lanes` lanes (sub = this lane's index
// among them); an inactive pair (past the last one) only reaches the warp barrier. No
// error is detected here (vllm2_request_row checks num_blocks).
__device__ __forceinline__ void vllm2_gather_row(const VllmStepParams& p, bool active, int g, int b, int sub,
                                                 int lanes) {
    int nbc = 0, first = 0, fill = 0;
    int* __restrict__ out = 0;
    int* __restrict__ fill_at = 0;
    const int* __restrict__ src = 0;
    if (active) {
        const int W = vllm_pick(p.width, g);
        out = vllm_pick(p.gathered, g) + (long long)b * vllm_pick(p.gathered_stride, g);
        fill_at = vllm_pick(p.row_fill, g) + b;
        fill = *fill_at;
        const int q0 = p.query_start_loc[b], q1 = p.query_start_loc[b + 1];
        const long long r = vllm_row_of(p, b);
        // No branch between the row index and the row's loads: a row outside the state reads
        // row 0 (inside every state array) and keeps nothing. (With the loads under the tests,
        // ptxas sank num_blocks's load below the test of num_computed_tokens: a third dependent
        // load before the row's block ids, a fourth in all.)
        const bool rok = r >= 0 && r < p.max_num_reqs;
        const int rr = rok ? (int)r : 0;
        const int nb = vllm_pick(p.num_blocks, g)[rr];
        const int nct = p.num_computed_tokens[rr];
        src = vllm_pick(p.block_table, g) + (long long)rr * vllm_pick(p.table_stride, g);
        const bool good = rok && nct >= 0 && q0 >= 0 && q1 >= q0;
        nbc = good ? (nb < 0 ? 0 : (nb > W ? W : nb)) : 0;
        const int reach = vllm_pick(p.sliding_window_reach, g);
        if (good && reach > 0) {
            const long long f = ((long long)nct - reach) / vllm_pick(p.block_size, g);
            first = f < 0 ? 0 : (int)(f > W ? W : f);
        }
    }
    // Entries [0, max(nbc, fill)): VLLM2_GATHER_LOADS loads in flight per lane before any store.
    const int end = nbc > fill ? nbc : fill;
    for (int j0 = 0; j0 < end; j0 += VLLM2_GATHER_LOADS * lanes) {
        int v[VLLM2_GATHER_LOADS];
#pragma unroll
        for (int k = 0; k < VLLM2_GATHER_LOADS; ++k) {
            const int j = j0 + lanes * k + sub;
            v[k] = (j < nbc && j >= first) ? src[j] : 0;
        }
#pragma unroll
        for (int k = 0; k < VLLM2_GATHER_LOADS; ++k) {
            const int j = j0 + lanes * k + sub;
            if (j < end) out[j] = v[k];
        }
    }
    __syncwarp();  // every lane has read the row's fill before it is replaced
    if (active && sub == 0) *fill_at = nbc;
}

// ---- kvaddr_vllm_step_v2: the entry (warp-level code; not run by the CPU emulator) ----

// ---- attention metadata of the vLLM step (kvaddr_vllm_step_v2a's last blocks) ----
//
// Per KV-cache group g, FlashInfer's paged-KV arrays (kv_indptr, kv_indices,
// kv_last_page_len) and FlashAttention varlen's cu_seqlens_k / max_seqlen_k over the
// batch's L_bg = seq_lens[b] (dcp_local_seq_lens[b] for a DCP-sharded group), and once
// for the step qo_indptr (query_start_loc padded) and max_seqlen_q. Contract: docs/vllm.md
// ("Attention metadata") and vllm_attention_reference in kvaddr/engines/vllm_reference.py.
// num_groups * meta_blocks blocks; block (g, k) owns batch rows [k * meta_rows, +meta_rows) of
// [0, max_num_reqs] (meta_rows 8 to VLLM_THREADS: fewer rows a block, more blocks copying rows
// at once) and the kv_indices entries [k * meta_entries, +meta_entries) of the pad.
// Like kv_meta_block2 (the core step's), a block waits for no other: it recomputes every
// request's length from the inputs (idx_mapping -> row -> num_computed_tokens + query
// length, as vllm2_request_row does), in
//   1. one register pass over all num_reqs lengths: the sums (pages, L) before its rows,
//      the totals and the maxima;
//   2. a block scan of its own rows' pages and lengths: kv_indptr, cu_seqlens_k,
//      kv_last_page_len, qo_indptr (group 0) and the per-request checks;
//   3. the row copy: meta_lanes lanes per request copy the first pages of its row as the
//      gather writes them (block_table[r, j] for first <= j < clamp(num_blocks, 0, W),
//      else 0; -1 for j >= W and for a negative id), entries < N only;
//   4. the pad: -1 over its entry range past the group's total pages.

#define VLLM_ATTN_FLASHINFER 1
#define VLLM_ATTN_VARLEN 2
#define VLLM_ERR_KV_INDICES_CAPACITY 512
#define VLLM_META_R 4  // requests in flight per thread in pass 1
#define VLLM_META_U 8  // row entries in flight per lane in the copy

struct VllmMetaShared {
    int start[VLLM_THREADS];  // first kv_indices entry of each staged request (saturated)
    int pages[VLLM_THREADS];  // its pages
    int token[VLLM_THREADS];  // its first token (the error key's token)
    int nbc[VLLM_THREADS];    // entries of its gathered row (clamp(num_blocks, 0, W)); 0: no row
    int first[VLLM_THREADS];  // sliding window: its first non-null entry
    int row[VLLM_THREADS];    // its request-state row (< max_num_reqs < 2^24)
    int red[2][VLLM_WARPS];   // per-warp sums of the scan
    int carry[2];             // pass 1: pages and L before the block's rows
    int total[2];             // pass 1: total pages and L
};

__device__ __forceinline__ int vllm_sat_add(int a, int b) {  // a, b in [0, 2^31-1]
    return (int)min((unsigned int)a + (unsigned int)b, 0x7fffffffu);
}

__device__ __forceinline__ int vllm_pages(int L, int B) {  // ceil(L / B), L >= 0, B >= 1
    return L > 0 ? (int)((unsigned int)(L - 1) / (unsigned int)B) + 1 : 0;
}

// The loads of request b < num_reqs (issued together): its range and row.
struct VllmReqLoads {
    int q0, q1;
    long long r;
};

__device__ __forceinline__ void vllm_attn_load(const VllmStepParams& p, int b, VllmReqLoads& x) {
    x.q0 = p.query_start_loc[b];
    x.q1 = p.query_start_loc[b + 1];
    x.r = vllm_row_of(p, b);
}

// Whether the request reads its row (a real request with good inputs so far, as
// vllm2_request_row decides before num_computed_tokens).
__device__ __forceinline__ bool vllm_attn_has_row(const VllmReqLoads& x, int M) {
    return x.r >= 0 && x.r < M && x.q0 >= 0 && x.q1 >= x.q0;
}

// seq_lens[b]'s value from the loads and num_computed_tokens[r] (nct; ignored without a row).
__device__ __forceinline__ int vllm_attn_seq(const VllmReqLoads& x, bool has_row, int nct) {
    if (!has_row || nct < 0) return 0;
    const long long s = (long long)nct + ((long long)x.q1 - x.q0);
    return (int)(s > VLLM_INT_MAX ? VLLM_INT_MAX : s);
}

// The query length max(q1 - q0, 0), saturating (max_seqlen_q covers every request's range).
__device__ __forceinline__ int vllm_attn_qlen(const VllmReqLoads& x) {
    const long long d = (long long)x.q1 - x.q0;
    return (int)(d < 0 ? 0 : (d > VLLM_INT_MAX ? VLLM_INT_MAX : d));
}

__device__ __forceinline__ void vllm_attn_block0(const VllmStepParams& p, int m, VllmErr& err) {
    __shared__ VllmMetaShared sm;
    const int tid = (int)threadIdx.x, lane = tid & 31, warp = tid >> 5;
    const int n = p.num_reqs, M = p.max_num_reqs, N = p.kv_indices_capacity;
    const int g = m / p.meta_blocks, k = m - g * p.meta_blocks;
    const bool fi = (p.attention & VLLM_ATTN_FLASHINFER) != 0;
    const bool varlen = (p.attention & VLLM_ATTN_VARLEN) != 0;
    const int B = vllm_pick(p.block_size, g), W = vllm_pick(p.width, g);
    const bool sharded = (vllm_pick(p.group_flags, g) & VLLM_GROUP_SHARDED) != 0;
    const int rows_k = p.meta_rows;
    const int r0 = k * rows_k;  // this block's rows [r0, r0 + rows_k) of [0, M], thread tid < rows_k: row r0 + tid
    // 1. one pass over all num_reqs lengths: sums before r0, totals, maxima
    int bp = 0, bl = 0, tp = 0, tl = 0, mq = 0, ml = 0;
#pragma unroll 1
    for (int b0 = 0; b0 < n; b0 += VLLM_META_R * VLLM_THREADS) {
        VllmReqLoads x[VLLM_META_R];
        int nct[VLLM_META_R];
#pragma unroll
        for (int u = 0; u < VLLM_META_R; ++u) {
            const int b = b0 + u * VLLM_THREADS + tid;
            x[u].q0 = x[u].q1 = 0;
            x[u].r = -1;
            if (b < n) vllm_attn_load(p, b, x[u]);
        }
#pragma unroll
        for (int u = 0; u < VLLM_META_R; ++u) nct[u] = vllm_attn_has_row(x[u], M) ? p.num_computed_tokens[x[u].r] : 0;
#pragma unroll
        for (int u = 0; u < VLLM_META_R; ++u) {
            const int b = b0 + u * VLLM_THREADS + tid;
            const int s = vllm_attn_seq(x[u], vllm_attn_has_row(x[u], M), nct[u]);
            const int L = sharded ? vllm_dcp_len(p, s) : s;
            const int P = vllm_pages(L, B);
            if (b < r0) {
                bp = vllm_sat_add(bp, P);
                bl = vllm_sat_add(bl, L);
            }
            tp = vllm_sat_add(tp, P);
            tl = vllm_sat_add(tl, L);
            ml = max(ml, L);
            if (b < n) mq = max(mq, vllm_attn_qlen(x[u]));
        }
    }
#pragma unroll
    for (int s = 16; s > 0; s >>= 1) {
        bp = vllm_sat_add(bp, __shfl_xor_sync(0xffffffffu, bp, s));
        bl = vllm_sat_add(bl, __shfl_xor_sync(0xffffffffu, bl, s));
        tp = vllm_sat_add(tp, __shfl_xor_sync(0xffffffffu, tp, s));
        tl = vllm_sat_add(tl, __shfl_xor_sync(0xffffffffu, tl, s));
    }
    mq = __reduce_max_sync(0xffffffffu, mq);
    ml = __reduce_max_sync(0xffffffffu, ml);
    // (sm.start / pages / token / nbc / first hold the warps' partials until the scan)
    if (lane == 0) {
        sm.start[warp] = bp;
        sm.pages[warp] = bl;
        sm.token[warp] = tp;
        sm.nbc[warp] = tl;
        sm.first[warp] = mq;
        sm.row[warp] = ml;
    }
    // 2. this block's rows: their own loads, issued before the barrier
    const int b = r0 + tid;
    const bool mine = tid < rows_k;
    VllmReqLoads x;
    x.q0 = x.q1 = 0;
    x.r = -1;
    if (mine && b < n) vllm_attn_load(p, b, x);
    const bool has_row = mine && b < n && vllm_attn_has_row(x, M);
    int nct = 0, nb = 0;
    if (has_row) {
        nct = p.num_computed_tokens[x.r];
        nb = vllm_pick(p.num_blocks, g)[x.r];
    }
    const int qn = (mine && b >= n && b <= M) ? p.query_start_loc[n] : 0;
    __syncthreads();
    if (tid == 0) {
        int cp = 0, cl = 0, Tp = 0, Tl = 0, Mq = 0, Ml = 0;
#pragma unroll
        for (int i = 0; i < VLLM_WARPS; ++i) {
            cp = vllm_sat_add(cp, sm.start[i]);
            cl = vllm_sat_add(cl, sm.pages[i]);
            Tp = vllm_sat_add(Tp, sm.token[i]);
            Tl = vllm_sat_add(Tl, sm.nbc[i]);
            Mq = max(Mq, sm.first[i]);
            Ml = max(Ml, sm.row[i]);
        }
        sm.carry[0] = cp;
        sm.carry[1] = cl;
        sm.total[0] = Tp;
        sm.total[1] = Tl;
        if (k == 0 && varlen) {
            if (g == 0) p.max_seqlen[0] = Mq;
            p.max_seqlen[1 + g] = Ml;
        }
    }
    const int s = vllm_attn_seq(x, has_row, nct);
    const int L = sharded ? vllm_dcp_len(p, s) : s;
    const int P = vllm_pages(L, B);
    // block scan of (pages, L): in-warp inclusive, exclusive by the previous lane's
    int ip = P, il = L;
#pragma unroll
    for (int off = 1; off < 32; off <<= 1) {
        const int yp = __shfl_up_sync(0xffffffffu, ip, off), yl = __shfl_up_sync(0xffffffffu, il, off);
        if (lane >= off) {
            ip = vllm_sat_add(ip, yp);
            il = vllm_sat_add(il, yl);
        }
    }
    int xp = __shfl_up_sync(0xffffffffu, ip, 1), xl = __shfl_up_sync(0xffffffffu, il, 1);
    if (lane == 0) xp = xl = 0;
    __syncthreads();  // the warps' partials of pass 1 are read
    if (lane == 31) {
        sm.red[0][warp] = ip;
        sm.red[1][warp] = il;
    }
    __syncthreads();
    int wp = sm.carry[0], wl = sm.carry[1];
    for (int i = 0; i < warp; ++i) {
        wp = vllm_sat_add(wp, sm.red[0][i]);
        wl = vllm_sat_add(wl, sm.red[1][i]);
    }
    xp = vllm_sat_add(wp, xp);  // absolute exclusive prefixes
    xl = vllm_sat_add(wl, xl);
    const int total_p = sm.total[0], total_l = sm.total[1];
    const long long goff = (long long)g * (M + 1);
    if (mine && b < n) {
        if (fi) {
            p.kv_indptr[goff + b] = xp;
            p.kv_last_page_len[(long long)g * M + b] = L > 0 ? (int)((unsigned int)(L - 1) % (unsigned int)B) + 1 : 0;
        }
        if (varlen) p.cu_seqlens_k[goff + b] = xl;
        if (g == 0) p.qo_indptr[b] = x.q0;
    } else if (mine && b <= M) {  // padding: empty requests after the batch
        if (fi) {
            p.kv_indptr[goff + b] = total_p;
            if (b < M) p.kv_last_page_len[(long long)g * M + b] = 0;
        }
        if (varlen) p.cu_seqlens_k[goff + b] = total_l;
        if (g == 0) p.qo_indptr[b] = qn;
    }
    // 3. the row copy (flashinfer)
    if (fi) {
        int nbc = 0, first = 0;
        const int tok = x.q0 < 0 ? 0 : x.q0;
        if (P > 0) {  // a real request with good inputs (else L = 0)
            nbc = nb < 0 ? 0 : (nb > W ? W : nb);
            const int reach = vllm_pick(p.sliding_window_reach, g);
            if (reach > 0) {
                const long long f = ((long long)nct - reach) / B;
                first = f < 0 ? 0 : (int)(f > W ? W : f);
            }
            if (P > W) err.add(VLLM_ERR_BLOCK_INDEX, 0, tok, b, g);
            else if (P > nbc) err.add(VLLM_ERR_PAST_NUM_BLOCKS, 4, tok, b, g);
            if (xp <= N && N < vllm_sat_add(xp, P)) err.add(VLLM_ERR_KV_INDICES_CAPACITY, 9, tok, b, g);
        }
        __syncthreads();  // sm.red and sm.carry are read
        sm.start[tid] = xp;
        sm.pages[tid] = P;
        sm.token[tid] = tok;
        sm.nbc[tid] = nbc;
        sm.first[tid] = first;
        sm.row[tid] = (int)(has_row ? x.r : 0);
        __syncthreads();
        const int lanes = p.meta_lanes, grp = tid / lanes, sub = tid - grp * lanes, groups = VLLM_THREADS / lanes;
        const int cnt = min(rows_k, max(n - r0, 0));
        int* __restrict__ out = p.kv_indices + (long long)g * N;
        const int* __restrict__ table = vllm_pick(p.block_table, g);
        const long long stride = vllm_pick(p.table_stride, g);
#pragma unroll 1
        for (int i = grp; i < cnt; i += groups) {
            const int s0 = sm.start[i];
            const int end = s0 < N ? min(sm.pages[i], N - s0) : 0;  // entries of this row below N
            const int c_nb = sm.nbc[i], c_first = sm.first[i];
            const int* __restrict__ row = table + (long long)sm.row[i] * stride;
#pragma unroll 1
            for (int c0 = sub; c0 < end; c0 += VLLM_META_U * lanes) {
                int v[VLLM_META_U];
#pragma unroll
                for (int u = 0; u < VLLM_META_U; ++u) {
                    const int col = c0 + u * lanes;
                    v[u] = col >= W ? -1 : ((col < c_nb && col >= c_first) ? row[col] : 0);
                }
#pragma unroll
                for (int u = 0; u < VLLM_META_U; ++u) {
                    const int col = c0 + u * lanes;
                    if (col < end) {
                        if (col < W && v[u] < 0) err.add(VLLM_ERR_NEGATIVE_BLOCK, 1, sm.token[i], r0 + i, g);
                        out[s0 + col] = v[u] < 0 ? -1 : v[u];
                    }
                }
            }
        }
        // 4. the pad of this block's entry range past the group's used entries
        const int e_lo = (int)min((long long)k * p.meta_entries, (long long)N);
        const int e_hi = (int)min((long long)e_lo + p.meta_entries, (long long)N);
#pragma unroll 1
        for (int e = max(e_lo, total_p) + tid; e < e_hi; e += VLLM_THREADS) out[e] = -1;
    }
}


// ---- meta_impl 1: the same outputs with a shorter dependent chain ----
//
// vllm_attn_block0 (meta_impl 0) runs pass 1, then its rows' loads, then 5 barriers, then
// the row loads (their addresses read back from shared memory): ~6 dependent round trips
// and 5 barriers before the last store. vllm_attn_block1 issues, in one straight-line
// stretch before any barrier:
//   RT1: pass 1's first VLLM_META_R * VLLM_THREADS requests' (qsl, idx), this thread's own
//        row's (qsl, idx) (thread tid < meta_rows: row r0 + tid) and the (qsl, idx) of the
//        request its lane group copies first (group grp = tid / meta_lanes: row r0 + grp;
//        the group's lanes load the same addresses);
//   RT2: the num_computed_tokens of all of them, num_blocks of the own and group rows, and
//        VLLM_META_PRE block-table columns per lane of the group's row (col = sub + u *
//        lanes < W: the addresses need the row only, not the prefix; the values are
//        masked by num_blocks / the sliding window afterwards and kept in registers);
// then the rest of pass 1 (num_reqs > VLLM_META_R * VLLM_THREADS only), the in-warp scan,
// ONE barrier (the per-warp partials, the warps' scan totals and each row's exclusive
// in-warp prefix and copy state are all written before it), and the stores: each thread
// sums the (<= 8) warp partials it needs itself, so no second barrier. Rows past the
// preloaded columns, or past the first round (meta_rows > VLLM_THREADS / meta_lanes),
// are copied as vllm_attn_block0 copies them.
#define VLLM_META_PRE 4  // meta_impl 1: block-table columns per lane loaded before the barrier

struct VllmMeta1Shared {
    int excl[VLLM_THREADS];   // exclusive in-warp prefix of the pages of row thread tid's request
    int pages[VLLM_THREADS];  // its pages
    int token[VLLM_THREADS];  // its first token (the error key's token)
    int nbc[VLLM_THREADS];    // entries of its gathered row (clamp(num_blocks, 0, W)); 0: no row
    int first[VLLM_THREADS];  // sliding window: its first non-null entry
    int row[VLLM_THREADS];    // its request-state row (< max_num_reqs < 2^24)
    int red[2][VLLM_WARPS];   // per-warp inclusive totals of (pages, L) of the row threads
    int part[6][VLLM_WARPS];  // pass 1's per-warp partials: pages, L before r0; total pages, L; max q; max L
};

// One request of pass 1 into the running sums (b >= num_reqs: loads left at their defaults, adds 0).
__device__ __forceinline__ void vllm_attn_acc(const VllmStepParams& p, const VllmReqLoads& x, int nct, int b, int r0,
                                              int B, bool sharded, int& bp, int& bl, int& tp, int& tl, int& mq,
                                              int& ml) {
    const int s = vllm_attn_seq(x, vllm_attn_has_row(x, p.max_num_reqs), nct);
    const int L = sharded ? vllm_dcp_len(p, s) : s;
    const int P = vllm_pages(L, B);
    if (b < r0) {
        bp = vllm_sat_add(bp, P);
        bl = vllm_sat_add(bl, L);
    }
    tp = vllm_sat_add(tp, P);
    tl = vllm_sat_add(tl, L);
    ml = max(ml, L);
    if (b < p.num_reqs) mq = max(mq, vllm_attn_qlen(x));
}

// sat(sum of w[0..upto)), w >= 0 (upto <= VLLM_WARPS; shared memory, broadcast reads).
__device__ __forceinline__ int vllm_attn_sum(const int* w, int upto) {
    int s = 0;
    for (int i = 0; i < upto; ++i) s = vllm_sat_add(s, w[i]);
    return s;
}

__device__ __forceinline__ void vllm_attn_block1(const VllmStepParams& p, int m, VllmErr& err) {
    __shared__ VllmMeta1Shared sm;
    const int tid = (int)threadIdx.x, lane = tid & 31, warp = tid >> 5;
    const int n = p.num_reqs, M = p.max_num_reqs, N = p.kv_indices_capacity;
    const int g = m / p.meta_blocks, k = m - g * p.meta_blocks;
    const bool fi = (p.attention & VLLM_ATTN_FLASHINFER) != 0;
    const bool varlen = (p.attention & VLLM_ATTN_VARLEN) != 0;
    const int B = vllm_pick(p.block_size, g), W = vllm_pick(p.width, g);
    const bool sharded = (vllm_pick(p.group_flags, g) & VLLM_GROUP_SHARDED) != 0;
    const int rows_k = p.meta_rows, r0 = k * rows_k;
    const int lanes = p.meta_lanes, grp = tid / lanes, sub = tid - grp * lanes, groups = VLLM_THREADS / lanes;
    const int* __restrict__ table = vllm_pick(p.block_table, g);
    const long long stride = vllm_pick(p.table_stride, g);
    const int* __restrict__ nbs = vllm_pick(p.num_blocks, g);
    // RT1: pass 1's first chunk, the own row, the group's first request
    VllmReqLoads x0[VLLM_META_R];
#pragma unroll
    for (int u = 0; u < VLLM_META_R; ++u) {
        const int b = u * VLLM_THREADS + tid;
        x0[u].q0 = x0[u].q1 = 0;
        x0[u].r = -1;
        if (b < n) vllm_attn_load(p, b, x0[u]);
    }
    const int b = r0 + tid;
    const bool mine = tid < rows_k;
    VllmReqLoads x;
    x.q0 = x.q1 = 0;
    x.r = -1;
    if (mine && b < n) vllm_attn_load(p, b, x);
    const int qn = (mine && b >= n && b <= M) ? p.query_start_loc[n] : 0;
    const int bg = r0 + grp;
    const bool gmine = fi && grp < rows_k && bg < n;
    VllmReqLoads xg;
    xg.q0 = xg.q1 = 0;
    xg.r = -1;
    if (gmine) vllm_attn_load(p, bg, xg);
    // RT2: num_computed_tokens of all of them, num_blocks, the group row's first columns
    int nct0[VLLM_META_R];
#pragma unroll
    for (int u = 0; u < VLLM_META_R; ++u) nct0[u] = vllm_attn_has_row(x0[u], M) ? p.num_computed_tokens[x0[u].r] : 0;
    const bool has_row = mine && b < n && vllm_attn_has_row(x, M);
    int nct = 0, nb = 0;
    if (has_row) {
        nct = p.num_computed_tokens[x.r];
        nb = nbs[x.r];
    }
    const bool g_row = gmine && vllm_attn_has_row(xg, M);
    int gnct = 0, gnb = 0;
    int v[VLLM_META_PRE];
    {
        const int* __restrict__ grow = table + (g_row ? xg.r : 0) * stride;
#pragma unroll
        for (int u = 0; u < VLLM_META_PRE; ++u) {
            const int col = sub + u * lanes;
            v[u] = (g_row && col < W) ? grow[col] : 0;
        }
    }
    if (g_row) {
        gnct = p.num_computed_tokens[xg.r];
        gnb = nbs[xg.r];
    }
    // pass 1: the first chunk, then the rest
    int bp = 0, bl = 0, tp = 0, tl = 0, mq = 0, ml = 0;
#pragma unroll
    for (int u = 0; u < VLLM_META_R; ++u)
        vllm_attn_acc(p, x0[u], nct0[u], u * VLLM_THREADS + tid, r0, B, sharded, bp, bl, tp, tl, mq, ml);
#pragma unroll 1
    for (int b0 = VLLM_META_R * VLLM_THREADS; b0 < n; b0 += VLLM_META_R * VLLM_THREADS) {
        VllmReqLoads y[VLLM_META_R];
        int c[VLLM_META_R];
#pragma unroll
        for (int u = 0; u < VLLM_META_R; ++u) {
            const int bb = b0 + u * VLLM_THREADS + tid;
            y[u].q0 = y[u].q1 = 0;
            y[u].r = -1;
            if (bb < n) vllm_attn_load(p, bb, y[u]);
        }
#pragma unroll
        for (int u = 0; u < VLLM_META_R; ++u) c[u] = vllm_attn_has_row(y[u], M) ? p.num_computed_tokens[y[u].r] : 0;
#pragma unroll
        for (int u = 0; u < VLLM_META_R; ++u)
            vllm_attn_acc(p, y[u], c[u], b0 + u * VLLM_THREADS + tid, r0, B, sharded, bp, bl, tp, tl, mq, ml);
    }
#pragma unroll
    for (int s = 16; s > 0; s >>= 1) {
        bp = vllm_sat_add(bp, __shfl_xor_sync(0xffffffffu, bp, s));
        bl = vllm_sat_add(bl, __shfl_xor_sync(0xffffffffu, bl, s));
        tp = vllm_sat_add(tp, __shfl_xor_sync(0xffffffffu, tp, s));
        tl = vllm_sat_add(tl, __shfl_xor_sync(0xffffffffu, tl, s));
    }
    mq = __reduce_max_sync(0xffffffffu, mq);
    ml = __reduce_max_sync(0xffffffffu, ml);
    // the own row: length, pages, in-warp scan
    const int s = vllm_attn_seq(x, has_row, nct);
    const int L = sharded ? vllm_dcp_len(p, s) : s;
    const int P = vllm_pages(L, B);
    int ip = P, il = L;
#pragma unroll
    for (int off = 1; off < 32; off <<= 1) {
        const int yp = __shfl_up_sync(0xffffffffu, ip, off), yl = __shfl_up_sync(0xffffffffu, il, off);
        if (lane >= off) {
            ip = vllm_sat_add(ip, yp);
            il = vllm_sat_add(il, yl);
        }
    }
    int xp = __shfl_up_sync(0xffffffffu, ip, 1), xl = __shfl_up_sync(0xffffffffu, il, 1);
    if (lane == 0) xp = xl = 0;
    int nbc = 0, first = 0;
    const int tok = x.q0 < 0 ? 0 : x.q0;
    if (P > 0) {  // a real request with good inputs (else L = 0)
        nbc = nb < 0 ? 0 : (nb > W ? W : nb);
        const int reach = vllm_pick(p.sliding_window_reach, g);
        if (reach > 0) {
            const long long f = ((long long)nct - reach) / B;
            first = f < 0 ? 0 : (int)(f > W ? W : f);
        }
    }
    if (lane == 0) {
        sm.part[0][warp] = bp;
        sm.part[1][warp] = bl;
        sm.part[2][warp] = tp;
        sm.part[3][warp] = tl;
        sm.part[4][warp] = mq;
        sm.part[5][warp] = ml;
    }
    if (lane == 31) {
        sm.red[0][warp] = ip;
        sm.red[1][warp] = il;
    }
    sm.excl[tid] = xp;
    sm.pages[tid] = P;
    sm.token[tid] = tok;
    sm.nbc[tid] = nbc;
    sm.first[tid] = first;
    sm.row[tid] = (int)(has_row ? x.r : 0);
    __syncthreads();  // the only barrier
    const int carry_p = vllm_attn_sum(sm.part[0], VLLM_WARPS), total_p = vllm_attn_sum(sm.part[2], VLLM_WARPS);
    if (tid == 0 && k == 0 && varlen) {
        int Mq = 0, Ml = 0;
#pragma unroll
        for (int i = 0; i < VLLM_WARPS; ++i) {
            Mq = max(Mq, sm.part[4][i]);
            Ml = max(Ml, sm.part[5][i]);
        }
        if (g == 0) p.max_seqlen[0] = Mq;
        p.max_seqlen[1 + g] = Ml;
    }
    xp = vllm_sat_add(vllm_sat_add(carry_p, vllm_attn_sum(sm.red[0], warp)), xp);  // absolute exclusive prefixes
    const long long goff = (long long)g * (M + 1);
    if (mine && b < n) {
        if (fi) {
            p.kv_indptr[goff + b] = xp;
            p.kv_last_page_len[(long long)g * M + b] = L > 0 ? (int)((unsigned int)(L - 1) % (unsigned int)B) + 1 : 0;
            if (P > 0) {
                if (P > W) err.add(VLLM_ERR_BLOCK_INDEX, 0, tok, b, g);
                else if (P > nbc) err.add(VLLM_ERR_PAST_NUM_BLOCKS, 4, tok, b, g);
                if (xp <= N && N < vllm_sat_add(xp, P)) err.add(VLLM_ERR_KV_INDICES_CAPACITY, 9, tok, b, g);
            }
        }
        if (varlen) {
            const int carry_l = vllm_attn_sum(sm.part[1], VLLM_WARPS);
            p.cu_seqlens_k[goff + b] = vllm_sat_add(vllm_sat_add(carry_l, vllm_attn_sum(sm.red[1], warp)), xl);
        }
        if (g == 0) p.qo_indptr[b] = x.q0;
    } else if (mine && b <= M) {  // padding: empty requests after the batch
        if (fi) {
            p.kv_indptr[goff + b] = total_p;
            if (b < M) p.kv_last_page_len[(long long)g * M + b] = 0;
        }
        if (varlen) p.cu_seqlens_k[goff + b] = vllm_attn_sum(sm.part[3], VLLM_WARPS);
        if (g == 0) p.qo_indptr[b] = qn;
    }
    if (!fi) return;
    // the row copy: first the preloaded columns of the group's first request
    int* __restrict__ out = p.kv_indices + (long long)g * N;
    const int cnt = min(rows_k, max(n - r0, 0));
    if (gmine) {
        const int i = grp;
        const int s0 = vllm_sat_add(vllm_sat_add(carry_p, vllm_attn_sum(sm.red[0], i >> 5)), sm.excl[i]);
        // the group's own view of the request (the values the row thread staged, recomputed)
        const int gs = vllm_attn_seq(xg, g_row, gnct);
        const int gL = sharded ? vllm_dcp_len(p, gs) : gs;
        const int gP = vllm_pages(gL, B);
        int gnbc = 0, gfirst = 0;
        if (gP > 0) {
            gnbc = gnb < 0 ? 0 : (gnb > W ? W : gnb);
            const int reach = vllm_pick(p.sliding_window_reach, g);
            if (reach > 0) {
                const long long f = ((long long)gnct - reach) / B;
                gfirst = f < 0 ? 0 : (int)(f > W ? W : f);
            }
        }
        const int end = s0 < N ? min(gP, N - s0) : 0;
        const int gtok = xg.q0 < 0 ? 0 : xg.q0;
#pragma unroll
        for (int u = 0; u < VLLM_META_PRE; ++u) {
            const int col = sub + u * lanes;
            if (col < end) {
                const int w = col >= W ? -1 : ((col < gnbc && col >= gfirst) ? v[u] : 0);
                if (col < W && w < 0) err.add(VLLM_ERR_NEGATIVE_BLOCK, 1, gtok, bg, g);
                out[s0 + col] = w < 0 ? -1 : w;
            }
        }
    }
    // the rest: columns past the preloaded ones, rows past the first round
#pragma unroll 1
    for (int i = grp; i < cnt; i += groups) {
        const int c_from = sub + (i == grp ? VLLM_META_PRE * lanes : 0);
        const int c_pages = sm.pages[i];
        if (c_pages <= c_from) continue;
        const int s0 = vllm_sat_add(vllm_sat_add(carry_p, vllm_attn_sum(sm.red[0], i >> 5)), sm.excl[i]);
        const int end = s0 < N ? min(c_pages, N - s0) : 0;  // entries of this row below N
        const int c_nb = sm.nbc[i], c_first = sm.first[i];
        const int* __restrict__ row = table + (long long)sm.row[i] * stride;
#pragma unroll 1
        for (int c0 = c_from; c0 < end; c0 += VLLM_META_U * lanes) {
            int w[VLLM_META_U];
#pragma unroll
            for (int u = 0; u < VLLM_META_U; ++u) {
                const int col = c0 + u * lanes;
                w[u] = col >= W ? -1 : ((col < c_nb && col >= c_first) ? row[col] : 0);
            }
#pragma unroll
            for (int u = 0; u < VLLM_META_U; ++u) {
                const int col = c0 + u * lanes;
                if (col < end) {
                    if (col < W && w[u] < 0) err.add(VLLM_ERR_NEGATIVE_BLOCK, 1, sm.token[i], r0 + i, g);
                    out[s0 + col] = w[u] < 0 ? -1 : w[u];
                }
            }
        }
    }
    // the pad of this block's entry range past the group's used entries
    const int e_lo = (int)min((long long)k * p.meta_entries, (long long)N);
    const int e_hi = (int)min((long long)e_lo + p.meta_entries, (long long)N);
#pragma unroll 1
    for (int e = max(e_lo, total_p) + tid; e < e_hi; e += VLLM_THREADS) out[e] = -1;
}

// The metadata block m (meta_impl 0: the first version; 1: the shorter chain).
__device__ __forceinline__ void vllm_attn_block(const VllmStepParams& p, int m, VllmErr& err) {
    if (p.meta_impl == 1) vllm_attn_block1(p, m, err);
    else vllm_attn_block0(p, m, err);
}

// The body of kvaddr_vllm_step_v2 (ATTN = false: its code as before the template) and of
// kvaddr_vllm_step_v2a (ATTN = true: the last num_groups * meta_blocks blocks of the grid
// write the attention metadata, vllm_attn_block below).
template <bool ATTN>
__device__ __forceinline__ void vllm2_body(const VllmStepParams& p) {
    __shared__ int sq[VLLM2_QSL_SMEM];  // query_start_loc, staged when a token block searches
    VllmErr err;
    err.mask = 0;
    err.key = VLLM_NO_ERROR;
    int blk = blockIdx.x;
    const int lane = (int)(threadIdx.x & 31);
    if (blk < p.token_blocks) {
        const int t = blk * VLLM_THREADS + (int)threadIdx.x;
        const int n = p.num_reqs;
        int b = 0, q0 = 0, q1 = 0, num_tokens = 0;
        long long r = 0;
        bool need = false;
        if (n > 0 && t < p.max_tokens) need = vllm2_token_guess(p, t, b, q0, q1, r, num_tokens);
        if (n + 1 <= VLLM2_QSL_SMEM) {  // uniform: every thread of the block reaches both barriers
            if (__syncthreads_or(need)) {
                for (int i = (int)threadIdx.x; i <= n; i += VLLM_THREADS) sq[i] = p.query_start_loc[i];
                __syncthreads();
                if (need) {
                    b = vllm_owner_search(sq, n, t);
                    q0 = sq[b];
                    q1 = sq[b + 1];
                    r = vllm_row_of(p, b);
                }
            }
        } else if (need) {
            b = vllm_owner_search(p.query_start_loc, n, t);
            q0 = p.query_start_loc[b];
            q1 = p.query_start_loc[b + 1];
            r = vllm_row_of(p, b);
        }
        if (t < p.max_tokens) {
            // (uniform) only a DCP step has sharded groups
            if (p.cp_size > 1) vllm2_token_write<true>(p, t, b, q0, q1, r, num_tokens, err);
            else vllm2_token_write<false>(p, t, b, q0, q1, r, num_tokens, err);
        }
    } else if (blk < p.token_blocks + p.request_blocks) {
        const int b = (blk - p.token_blocks) * VLLM_THREADS + (int)threadIdx.x;
        // Rows b >= num_reqs: zero what each group's row may still hold (its fill), the
        // warp's lanes together, one such row after another. The fills are loaded first,
        // so they are in flight while the row's seq_lens are computed.
        const bool spare = b >= p.num_reqs && b < p.max_num_reqs;
        int fills[VLLM_MAX_GROUPS] = {0, 0, 0, 0};
#pragma unroll
        for (int g = 0; g < VLLM_MAX_GROUPS; ++g)
            if (g < p.num_groups && spare) fills[g] = p.row_fill[g][b];
        if (b < p.max_num_reqs) vllm2_request_row(p, b, err);
#pragma unroll
        for (int g = 0; g < VLLM_MAX_GROUPS; ++g) {
            if (g >= p.num_groups) break;
            unsigned int todo = __ballot_sync(0xffffffffu, fills[g] > 0);
            while (todo) {
                const int from = __ffs(todo) - 1;
                todo &= todo - 1;
                const int fb = __shfl_sync(0xffffffffu, fills[g], from);
                const int bb = __shfl_sync(0xffffffffu, b, from);
                int* __restrict__ out = p.gathered[g] + (long long)bb * p.gathered_stride[g];
                for (int j = lane; j < fb; j += 32) out[j] = 0;
            }
            if (fills[g] > 0) p.row_fill[g][b] = 0;
        }
    } else if (ATTN && blk >= (int)gridDim.x - p.num_groups * p.meta_blocks) {
        const int m = blk - ((int)gridDim.x - p.num_groups * p.meta_blocks);
        vllm_attn_block(p, m, err);
        blk = p.token_blocks + p.request_blocks + m;  // this block's records follow the request blocks'
    } else {
        // Pairs (group g, real row b < num_reqs), pair_lanes = L lanes each: warp w takes group
        // g = w / chunks and the per_warp = 32 / L rows [c * per_warp, +per_warp) of chunk
        // c = w % chunks, chunks = ceil(num_reqs / per_warp) (the planner's grid has a warp for
        // each, VllmStepPlanner._plan). A warp's pairs share their group; all of it is 32-bit
        // (G * num_reqs < 2^26) and nothing divides at run time (G <= 4: three compares; per_warp
        // 1, 2 or 4: a shift). (Before: 64-bit pair indices divided by num_reqs, a call of the
        // 64-bit division routine before the first load.) The loop runs the same number of times
        // for every lane of a warp, so the barrier in vllm2_gather_row is reached by all of them.
        const int L = p.pair_lanes, per_warp = 32 / L, shift = __ffs(per_warp) - 1;
        const int n = p.num_reqs;
        const int chunks = (n + per_warp - 1) >> shift, total = p.num_groups * chunks;
        const int warps =
            (int)(gridDim.x - p.token_blocks - p.request_blocks - (ATTN ? p.num_groups * p.meta_blocks : 0)) *
            VLLM_WARPS;
        const int slot = lane / L, sub = lane - slot * L;
        for (int w = (blk - p.token_blocks - p.request_blocks) * VLLM_WARPS + (int)(threadIdx.x >> 5); w < total;
             w += warps) {
            const int g = (w >= chunks) + (w >= 2 * chunks) + (w >= 3 * chunks);
            const int b = ((w - g * chunks) << shift) + slot;
            const bool active = b < n;
            vllm2_gather_row(p, active, active ? g : 0, active ? b : 0, sub, L);
        }
        return;  // the gather detects no error and writes no record
    }
    // This warp's record [2 * w] = mask, [2 * w + 1] = first-bad key, sticky: merged only by a
    // warp that found an error (a vote first); a clean warp writes nothing, the host clears.
    if (__any_sync(0xffffffffu, err.mask != 0u)) {
#pragma unroll
        for (int s = 16; s > 0; s >>= 1) {
            err.mask |= __shfl_xor_sync(0xffffffffu, err.mask, s);
            const unsigned long long k = __shfl_xor_sync(0xffffffffu, err.key, s);
            err.key = k < err.key ? k : err.key;
        }
        if (lane == 0) {
            const long long w = (long long)blk * VLLM_WARPS + (threadIdx.x >> 5);
            atomicOr(&p.errors[2 * w], (unsigned long long)err.mask);
            atomicMin(&p.errors[2 * w + 1], err.key);
        }
    }
}

extern "C" __global__ void __launch_bounds__(VLLM_THREADS) kvaddr_vllm_step_v2(const VllmStepParams p) {
    vllm2_body<false>(p);
}

// kvaddr_vllm_step_v2 plus the attention metadata (VllmStepPlanner(attention=...)).
extern "C" __global__ void __launch_bounds__(VLLM_THREADS) kvaddr_vllm_step_v2a(const VllmStepParams p) {
    vllm2_body<true>(p);
}
