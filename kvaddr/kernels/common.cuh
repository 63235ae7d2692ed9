// Types, constants and device helpers shared by every kernel family: the step's parameter
// struct (KvStepParams), error records and their keys, saturating sums, warp scans, page
// counts, block-index division, and the register-pinning and global-address helpers.

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

static_assert(sizeof(int) == 4 && sizeof(i64) == 8 && sizeof(u64) == 8 && sizeof(void*) == 8,
              "KvStepParams assumes 4-byte int and 8-byte int64 and pointers");

// The fused step's one parameter, passed by value (kernel parameter space, read
// through the constant cache). Mirrored by kvaddr/kernel_loader.py's StepParams
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
    void* position_ids;                      // [capacity], int64 (PosT = long long) or int32 (PosT = int)
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
    // -- DSA outputs (dsa_step.cuh, docs/dsa.md; written every launch when dsa != 0, else null) --
    i64* dsa_value_offsets;                  // [capacity], int64: byte offset of the token's indexer-key
                                             // values in the indexer cache, -1 for padding / bad
    i64* dsa_scale_offsets;                  // [capacity], int64: byte offset of its scale, -1 padding / bad
    int* dsa_ks;                             // [capacity], int32: prefill token's first key (cu_seq_lens of
                                             // its prefill); 0 for decode tokens and padding
    int* dsa_ke;                             // [capacity], int32: ks + position + 1 (prefill tokens), else 0
    int* dsa_ctx;                            // [capacity], int32: position + 1 (context length), 0 padding
    int* dsa_cu_seq_lens;                    // [max_requests + 1], int32: [0, cumsum(seq_lens)] over the
                                             // prefills in batch order, the total repeated past them
    int dsa;                                 // int32: 1 = write the DSA outputs (grid row blockIdx.y = 1)
    int dsa_cache;                           // int32: the indexer cache's index g (its table and B)
    int dsa_decode_len;                      // int32: n; a request with 1 <= q <= n tokens is a decode
    int dsa_value_bytes;                     // int32: V, value bytes per token (128)
    int dsa_scale_bytes;                     // int32: S, scale bytes per token (4)
    int dsa_cu_len;                          // int32: entries of dsa_cu_seq_lens (max_requests + 1)
};
static_assert(sizeof(KvStepParams) == 26 * 8 + KV_MAX_CACHES * (8 + 4 + 4) + 16 * 4,
              "KvStepParams has no padding (the ctypes mirror assumes the C layout)");
static_assert(alignof(KvStepParams) == 8, "KvStepParams is 8-byte aligned");
static_assert(KV_MAX_CACHES == 4, "the struct, the ctypes mirror and the planner assume 4 caches");


// Saturating add of two non-negative ints (associative, exact below 2^31-1).
__device__ __forceinline__ int kv_sat_add(int a, int b) {
    return (a > KV_INT_MAX - b) ? KV_INT_MAX : a + b;
}

// A plain load and store (LDG / STG once the compiler knows the pointer is global). The small and
// wide steps use them for their parameter-struct pointers: __ldg / __stwb measured slower there.
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

// A thread's errors: the OR of its error bits and the smallest (first-bad) key among them. The
// vLLM step uses the same record with its own key layout (VllmErr, vllm.cuh).
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

// min(a + b, KV_INT_MAX) for a, b in [0, KV_INT_MAX] (= kv_sat_add there; the unsigned sum
// cannot wrap): one add and one min.
__device__ __forceinline__ int kv_sat_add_nn(int a, int b) {
    return (int)min((unsigned int)a + (unsigned int)b, (unsigned int)KV_INT_MAX);
}

// ceil(L / B) for L >= 0, B >= 1 (no overflow).
__device__ __forceinline__ int kv_pages(int L, int B) {
    const unsigned int l = (unsigned int)L, b = (unsigned int)B;
    const unsigned int qd = l / b;
    return (int)(qd + (l - qd * b != 0u ? 1u : 0u));
}

// Inclusive warp scan (saturating) of one value per lane.
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

// Saturating sum over the lanes of a warp (butterfly: every lane gets the sum).
__device__ __forceinline__ int kv_warp_sat_sum(int x) {
#pragma unroll
    for (int off = 16; off > 0; off >>= 1) x = kv_sat_add(x, __shfl_xor_sync(0xffffffffu, x, off));
    return x;
}


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


// The generic pointer ptr as a global address (cvta.to.global), and a 32-bit load from such an
// address (ld.global, volatile so that it is issued where written, never speculated). An address
// that came through a shuffle has no address space for the compiler: the explicit ld.global keeps
// the load an LDG (a generic LD measured slower).
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

// A scalar pinned in a register (an empty asm the compiler cannot see through): read once, here,
// and never re-read from the parameter space or recomputed later. Pointers are copied, not
// pinned: a pinned pointer hides its address space, and every access through it would be a
// generic LD / ST instead of LDG / STG (measured slower).
__device__ __forceinline__ int kv_pin(int x) {
    asm volatile("" : "+r"(x));
    return x;
}
__device__ __forceinline__ i64 kv_pin(i64 x) {
    asm volatile("" : "+l"(x));
    return x;
}
template <typename P>
__device__ __forceinline__ P* kv_pin(P* x) {
    return x;
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
