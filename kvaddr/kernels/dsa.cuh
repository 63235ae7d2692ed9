// DeepSeek-V3.2 sparse attention: the indexer's top-k positions -> cache slots (docs/dsa.md;
// the oracle is kvaddr/dsa_reference.py's topk_to_slots). Host side: kvaddr/dsa.py.
//
// Rows: row = layer * T + token of the [L, T, K] top-k. A block of KV_THREADS threads runs
// KV_THREADS / R rows side by side, R = 1 << row_shift threads per row (a multiple of 32, so a
// warp never spans two rows). A row is read in chunks of R * VEC * 2 entries: each thread loads
// VEC entries (one int4 when VEC = 4) at two places half a chunk apart (both loads in flight
// before any table lookup), so loads and plain stores are coalesced and vectorized. A row's first
// chunk is loaded before the block's first barrier.
//
// Table: both forms look the token's table row up in global memory through the read-only path
// (L1 / L2 resident); the plain form has no barrier before its stores: a row's loads, lookups and
// stores are one dependent chain per thread.
//
// Short path (no DCP): every entry's lookup first, its block (a shift; a division when B is not a
// power of two) clamped into the table row so that no lookup needs a predicate; then one unsigned
// compare with min(context, width * B), one of the block id with the largest id all of whose slots
// fit int32, and a 32-bit multiply-add. A thread that met a bad entry or a larger id converts its
// entries once more, exactly, one after another, re-reading them (dsa_classify / dsa_finish: bad
// input, or ids near 2^31 / B, only).
//
// Per entry (context first, then the owner rank, the width, the block id):
//   v < 0 or a padding token (req_id < 0)             -> -1, no error
//   v >= ctx[token]                                   -> -1, KV_DSA_ERR_PAST_CONTEXT
//   DCP: v on another rank                            -> -1, no error
//   block index (of the local position) >= width, or
//   req_id >= the table's rows (a row of width 0)     -> -1, KV_ERR_BLOCK_INDEX
//   block id < 0                                      -> -1, KV_ERR_NEGATIVE_BLOCK
//   id * B + offset > INT32_MAX                       -> -1, KV_DSA_ERR_SLOT_RANGE
//   else id * B + offset.
// Compacting: each row's valid slots first, in order, then -1s. A thread's valid count of its two
// places is packed into one int (low / high 16 bits) and scanned over the row's threads: a warp
// scan, then the warps' sums through shared memory behind one barrier per chunk (double
// buffered). A row of one chunk (K <= 2048 read as int4, K <= 512 entry by entry) is compacted
// into shared memory and, after one more barrier, stored the way plain stores (-1s included); a
// longer row is stored entry by entry. Plain: slots stored where read; the row's count reduced once at the end.
//
// Errors: one sticky (mask, first-bad key) record per layer, key = token << 32 | column << 3 |
// log2(bit), merged by atomics only by a warp that found one (kv_merge_record).
//
// The entry is split into phases between its barriers (dsa_* helpers below) so that the CPU
// emulator of the tests can run one phase for every thread, then the next; the warp-level scan
// and reduction have a plain shared-memory twin there (#ifndef __CUDA_ARCH__).

#define KV_DSA_ERR_PAST_CONTEXT 4  // a position at or past the token's context length
#define KV_DSA_ERR_SLOT_RANGE 8    // block id * B + offset does not fit int32
#define KV_DSA_UNROLL 2            // places per thread per chunk (half a chunk apart)
// The plain form looks the table up in 48 registers: five 256-thread blocks per SM. Blocks per SM
// the plain form is compiled for: sm_80's code spills at 48 registers, so there 64 registers and
// four blocks.
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ < 900
#define KV_DSA_PLAIN_BLOCKS 4
#else
#define KV_DSA_PLAIN_BLOCKS 5
#endif

// The conversion's one parameter, passed by value; mirrored by kvaddr/dsa.py's DsaTopkParams
// (ctypes; tests/unit/test_dsa_kernel.py checks the layout). Pointers, then 8-byte, then 4-byte.
struct KvDsaTopkParams {
    const int* topk;         // [L, T, K] int32, contiguous: request-local positions (< 0: unused)
    const int* req_id;       // [T] int32: each token's row of block_table (< 0: padding token)
    const int* block_table;  // [rows, width] int32, rows table_stride elements apart (rank-local with DCP)
    const int* ctx;          // [T] int32: each token's context length
    int* slots;              // [L, T, K] int32 (written): cache slots, -1 unused / bad / other rank
    int* counts;             // [L, T] int32 (written): each row's slots >= 0
    u64* errors;             // [L, 2] uint64: per layer (error mask, first-bad key), sticky
    i64 table_stride;        // int64: row stride of block_table, in elements
    int num_layers;          // L, int32 >= 1
    int num_tokens;          // T, int32 >= 1
    int k;                   // K, int32 >= 0: entries per row
    int rows;                // int32: block_table's rows
    int width;               // int32: block_table's row length
    int block_size;          // B, int32 >= 1
    int cp_size;             // int32 >= 1 (1: no decode context parallelism)
    int cp_rank;             // int32 in [0, cp_size)
    int cp_interleave;       // I, int32 >= 1
    int row_shift;           // int32 in [5, log2(KV_THREADS)]: log2 of the threads per row
    int block_shift;         // int32: log2(B) when B is a power of two, else -1
    int reserved;            // int32, unused (no tail padding)
};
static_assert(sizeof(KvDsaTopkParams) == 8 * 8 + 12 * 4, "KvDsaTopkParams has no padding");

// Shared memory of a block: the warps' packed counts (two buffers: chunk parity), and for the
// emulator (no warp shuffles there) every thread's count.
#define KV_DSA_TABLE 2048  // int32 entries per block: a one-chunk row's compacted slots (compacting form)
struct alignas(16) DsaShared {
    int wsum[2][KV_WARPS];
    int tab[KV_DSA_TABLE];  // the block's rows' compacted slots (KV_DSA_TABLE / rows per block each)
#ifndef __CUDA_ARCH__
    int cnt[KV_THREADS];
#endif
};
static_assert(sizeof(int) * 2 * KV_WARPS % 16 == 0, "DsaShared::tab is 16-byte aligned (int4 reads)");

// A thread's state across the phases (registers on the GPU; the emulator keeps one per thread).
template <int VEC>
struct DsaLane {
    const int* table;  // the token's table row (null: a row outside the table)
    i64 row;           // layer * T + token
    int token, layer, ctx, gt;  // gt: thread within the row's threads
    int width;         // the table row's usable width: p.width, 0 for a row outside the table
    bool active, padding;
    int vals[KV_DSA_UNROLL * VEC];  // the current chunk's entries (chunk 0 loaded in dsa_begin)
    int packed;        // valid entries at the two places (low, high 16 bits)
    int before;        // packed valid entries of the row's earlier threads in this chunk (inclusive scan - own)
    int carry;         // valid entries of the row's earlier chunks (compacting) / this thread's total (plain)
    int res[KV_DSA_UNROLL * VEC];
    KvErr err;
};

// An entry's class before its table lookup: DSA_LOOKUP (blk, off set), DSA_NOTHING (-1, no error:
// unused, padding, another rank's) or the error bit it sets. Context first, then the owner rank,
// then the width (a row outside the table has width 0).
#define DSA_LOOKUP 0
#define DSA_NOTHING (-1)
__device__ __forceinline__ int dsa_classify(const KvDsaTopkParams& p, bool has_table, int ctx, int v, unsigned int& blk,
                                            unsigned int& off) {
    blk = 0u;
    off = 0u;
    if (v < 0) return DSA_NOTHING;
    if (v >= ctx) return KV_DSA_ERR_PAST_CONTEXT;
    unsigned int q = (unsigned int)v;
    if (p.cp_size > 1) {
        const unsigned int I = (unsigned int)p.cp_interleave, cp = (unsigned int)p.cp_size;
        const unsigned int run = q / I;
        if (run % cp != (unsigned int)p.cp_rank) return DSA_NOTHING;
        q = (run / cp) * I + (q - run * I);
    }
    if (p.block_shift >= 0) {  // B a power of two
        blk = q >> p.block_shift;
        off = q & (unsigned int)(p.block_size - 1);
    } else {
        const unsigned int B = (unsigned int)p.block_size;
        blk = q / B;
        off = q - blk * B;
    }
    if (!has_table || blk >= (unsigned int)p.width) return KV_ERR_BLOCK_INDEX;
    return DSA_LOOKUP;
}

// An entry's slot from its class and (for DSA_LOOKUP) the table's block id, recording its error
// under key token << 32 | column << 3 | log2(bit).
__device__ __forceinline__ int dsa_finish(const KvDsaTopkParams& p, int code, int id, unsigned int off, int token,
                                          int column, KvErr& err) {
    if (code == DSA_LOOKUP) {
        if (id < 0) {
            code = KV_ERR_NEGATIVE_BLOCK;
        } else {
            const i64 slot = (i64)id * p.block_size + off;
            if (slot <= KV_INT_MAX) return (int)slot;
            code = KV_DSA_ERR_SLOT_RANGE;
        }
    }
    if (code > 0) {
        const u64 log2 = code == KV_ERR_BLOCK_INDEX ? 0ull : code == KV_ERR_NEGATIVE_BLOCK ? 1ull
                         : code == KV_DSA_ERR_PAST_CONTEXT ? 2ull : 3ull;
        err.add((unsigned int)code, ((u64)token << 32) | ((u64)column << 3) | log2);
    }
    return -1;
}

// Phase 0: the thread's row, token, context and table row.
// A read-only global load (the table: nothing of this launch writes it).
__device__ __forceinline__ int dsa_ro(const int* ptr) {
#ifdef __CUDA_ARCH__
    return __ldg(ptr);
#else
    return *ptr;
#endif
}

// Inclusive scan of one value per lane over lanes [0, n) of the warp (n a power of two <= 32;
// lanes past n add their own neighbours and are not read). GPU only: the emulator's phases run
// one thread at a time.
#ifdef __CUDA_ARCH__
template <int N>
__device__ __forceinline__ int dsa_warp_scan(int x) {
    const int lane = (int)threadIdx.x & 31;
#pragma unroll
    for (int off = 1; off < N; off <<= 1) {
        const int y = __shfl_up_sync(0xffffffffu, x, off);
        if (lane >= off) x += y;
    }
    return x;
}
#endif

template <int VEC>
__device__ __forceinline__ void dsa_load(const KvDsaTopkParams& p, DsaLane<VEC>& ln, int c);

// The thread's row (layer * T + token), layer and token; false past the launch's rows.
__device__ __forceinline__ bool dsa_row(const KvDsaTopkParams& p, i64& row, int& layer, int& token) {
    row = (i64)blockIdx.x * (KV_THREADS >> p.row_shift) + ((int)threadIdx.x >> p.row_shift);
    const i64 rows = (i64)p.num_layers * p.num_tokens;
    const bool active = row < rows;
    if (p.num_layers == 1) {
        layer = 0;
        token = active ? (int)row : 0;
    } else if (rows <= KV_INT_MAX) {  // 32-bit division
        const unsigned int r = active ? (unsigned int)row : 0u, t = (unsigned int)p.num_tokens;
        layer = (int)(r / t);
        token = (int)(r - (unsigned int)layer * t);
    } else {
        layer = active ? (int)(row / p.num_tokens) : 0;
        token = active ? (int)(row - (i64)layer * p.num_tokens) : 0;
    }
    return active;
}

template <int VEC>
__device__ __forceinline__ void dsa_begin(const KvDsaTopkParams& p, DsaLane<VEC>& ln) {
    ln.gt = (int)threadIdx.x & ((1 << p.row_shift) - 1);
    ln.active = dsa_row(p, ln.row, ln.layer, ln.token);
    // req_id and ctx loaded together (neither waits for the other)
    const int req = ln.active ? p.req_id[ln.token] : -1;
    const int ctx = ln.active ? p.ctx[ln.token] : 0;
    ln.padding = req < 0;
    ln.ctx = ctx;
    ln.table = (!ln.padding && req < p.rows) ? p.block_table + (i64)req * p.table_stride : nullptr;
    ln.width = ln.table != nullptr ? p.width : 0;
    ln.carry = 0;
    ln.err.mask = 0u;
    ln.err.key = KV_NO_ERROR;
    dsa_load<VEC>(p, ln, 0);
}

// The chunks of a row: ceil(K / (R * VEC * KV_DSA_UNROLL)), the same for every row of the launch.
__device__ __forceinline__ int dsa_chunks(const KvDsaTopkParams& p, int vec) {
    const int per = (vec << p.row_shift) * KV_DSA_UNROLL;
    return (int)(((unsigned int)p.k + (unsigned int)per - 1u) / (unsigned int)per);
}

// The thread's entries of chunk c into ln.vals (-1 past the row or for an inactive thread): every
// load issued before any is used.
template <int VEC>
__device__ __forceinline__ void dsa_load(const KvDsaTopkParams& p, DsaLane<VEC>& ln, int c) {
    const int half = VEC << p.row_shift;
    const int base = c * half * KV_DSA_UNROLL + ln.gt * VEC;
    const i64 row_off = ln.row * (i64)p.k;
#pragma unroll
    for (int u = 0; u < KV_DSA_UNROLL; ++u) {
        const int col = base + u * half;
        if (VEC == 4) {
            int4 x = make_int4(-1, -1, -1, -1);
            if (ln.active && col < p.k) x = *reinterpret_cast<const int4*>(p.topk + row_off + col);
            ln.vals[u * 4 + 0] = x.x;
            ln.vals[u * 4 + 1] = x.y;
            ln.vals[u * 4 + 2] = x.z;
            ln.vals[u * 4 + 3] = x.w;
        } else {
#pragma unroll
            for (int v = 0; v < VEC; ++v)
                ln.vals[u * VEC + v] = (ln.active && col + v < p.k) ? p.topk[row_off + col + v] : -1;
        }
    }
}



// Phase 1 of chunk c (before its barrier): convert the thread's entries (chunk 0's were loaded by
// dsa_begin; a later chunk's are loaded here); plain: store them. Compacting: count them, scan the
// counts over the warp (GPU) and publish the warp's sum.
// Without DCP the conversion is the short path (see the top of this file).
template <bool COMPACT, int VEC>
__device__ __forceinline__ void dsa_chunk_load(const KvDsaTopkParams& p, DsaShared& sm, DsaLane<VEC>& ln, int c) {
    const int R = 1 << p.row_shift;
    const int half = R * VEC;
    const int base = c * half * KV_DSA_UNROLL + ln.gt * VEC;
    const i64 row_off = ln.row * (i64)p.k;
    constexpr int N = KV_DSA_UNROLL * VEC;
    if (c > 0) dsa_load<VEC>(p, ln, c);
    const bool has_table = ln.table != nullptr;
    if (p.cp_size == 1) {
        const unsigned int B = (unsigned int)p.block_size, lim = ln.padding ? 0u : (unsigned int)max(ln.ctx, 0);
        const bool pow2 = p.block_shift >= 0;
        // The largest block id all of whose slots fit int32: a larger id (or a negative one, as
        // unsigned) takes the exact path below, so a slot here is one 32-bit multiply-add.
        const unsigned int max_id = pow2 ? (unsigned int)KV_INT_MAX >> p.block_shift
                                         : ((unsigned int)KV_INT_MAX - B + 1u) / B;
        // The lookups first, with as little before them as possible (they are on the row's one
        // dependent chain): each entry's block clamped into the table row, so that every lookup is
        // in bounds and none needs a predicate (an entry not converted reads the row's last id and
        // drops it); the checks after them. The row's kind is uniform over its warps.
        const unsigned int width = (unsigned int)ln.width;
        unsigned int blk[N];
        int id[N];
#pragma unroll
        for (int i = 0; i < N; ++i) {
            const unsigned int q = (unsigned int)ln.vals[i];
            blk[i] = pow2 ? q >> p.block_shift : q / B;
        }
        if (width > 0u) {
#pragma unroll
            for (int i = 0; i < N; ++i) id[i] = dsa_ro(ln.table + min(blk[i], width - 1u));
        } else {
#pragma unroll
            for (int i = 0; i < N; ++i) id[i] = -1;
        }
        // An entry converts when it lies before both the context and the row's width * B (one
        // compare: q < B * width <=> q / B < width) and its id is at most max_id; one that does
        // not, of a token that is not padding and not negative, sends the thread to the exact path.
        const unsigned long long span = (unsigned long long)width * B;
        const unsigned int lim_ok = min(lim, span > 0xffffffffull ? 0xffffffffu : (unsigned int)span);
        const unsigned int lim_bad = ln.padding ? 0u : 0x80000000u;  // q < lim_bad: v >= 0, not padding
        bool bad = false;
#pragma unroll
        for (int i = 0; i < N; ++i) {
            const unsigned int q = (unsigned int)ln.vals[i];
            const bool ok = q < lim_ok && (unsigned int)id[i] <= max_id;
            bad |= q < lim_bad && !ok;
            const unsigned int off = pow2 ? q & (B - 1u) : q - blk[i] * B;
            ln.res[i] = ok ? (int)((unsigned int)id[i] * B + off) : -1;
        }
        if (bad) {  // bad input or an id near the int32 limit: every entry again, exactly, one after
                    // another (short code), each re-read from global memory (no register kept for it)
#pragma unroll 1
            for (int i = 0; i < N; ++i) {
                const int col = base + (i / VEC) * half + i % VEC;
                const int v = (ln.active && !ln.padding && col < p.k) ? p.topk[row_off + col] : -1;
                unsigned int b2, o2;
                const int code = dsa_classify(p, has_table, ln.ctx, v, b2, o2);
                const int r = dsa_finish(p, code, code == DSA_LOOKUP ? dsa_ro(ln.table + b2) : 0, o2, ln.token, col,
                                         ln.err);
#pragma unroll
                for (int j = 0; j < N; ++j) ln.res[j] = i == j ? r : ln.res[j];  // registers, not local memory
            }
        }
    } else {
        // DCP: context first, then the owner rank, the width, the block id (dsa_classify); one entry
        // after another, not unrolled (short code, few registers: the path above sets them).
#pragma unroll
        for (int j = 0; j < N; ++j) ln.res[j] = -1;
#pragma unroll 1
        for (int i = 0; i < N; ++i) {
            int v = ln.vals[0];
#pragma unroll
            for (int j = 1; j < N; ++j) v = i == j ? ln.vals[j] : v;  // registers, not local memory
            unsigned int blk, off;
            const int code = dsa_classify(p, has_table, ln.ctx, ln.padding ? -1 : v, blk, off);
            const int id = code == DSA_LOOKUP ? ln.table[blk] : 0;
            const int r = dsa_finish(p, code, id, off, ln.token, base + (i / VEC) * half + i % VEC, ln.err);
#pragma unroll
            for (int j = 0; j < N; ++j) ln.res[j] = i == j ? r : ln.res[j];
        }
    }
    int n0 = 0, n1 = 0;
#pragma unroll
    for (int u = 0; u < KV_DSA_UNROLL; ++u)
#pragma unroll
        for (int v = 0; v < VEC; ++v) {
            if (u == 0) n0 += ln.res[u * VEC + v] >= 0;
            else n1 += ln.res[u * VEC + v] >= 0;
        }
    ln.packed = n0 | (n1 << 16);
    if (!COMPACT) {
        ln.carry += n0 + n1;
        if (ln.active) {
#pragma unroll
            for (int u = 0; u < KV_DSA_UNROLL; ++u) {
                const int col = base + u * half;
                if (VEC == 4) {
                    if (col < p.k)
                        *reinterpret_cast<int4*>(p.slots + row_off + col) =
                            make_int4(ln.res[u * 4], ln.res[u * 4 + 1], ln.res[u * 4 + 2], ln.res[u * 4 + 3]);
                } else {
#pragma unroll
                    for (int v = 0; v < VEC; ++v)
                        if (col + v < p.k) p.slots[row_off + col + v] = ln.res[u * VEC + v];
                }
            }
        }
        return;
    }
#ifdef __CUDA_ARCH__
    const int incl = dsa_warp_scan<32>(ln.packed);
    ln.before = incl - ln.packed;
    if ((threadIdx.x & 31) == 31) sm.wsum[c & 1][threadIdx.x >> 5] = incl;
#else
    sm.cnt[threadIdx.x] = ln.packed;
#endif
}

// Phase 2 of chunk c (after its barrier), compacting only: the thread's place among the row's
// valid entries, its stores there (into shared memory when the row is one chunk), and the row's
// running count.
template <int VEC>
__device__ __forceinline__ void dsa_chunk_store(const KvDsaTopkParams& p, DsaShared& sm, DsaLane<VEC>& ln, int c) {
    const int R = 1 << p.row_shift;
    int before = 0, total = 0;
#ifdef __CUDA_ARCH__
    const int warp = (int)threadIdx.x >> 5, first = ((int)threadIdx.x & ~(R - 1)) >> 5;
    for (int w = first; w < first + (R >> 5); ++w) {
        const int s = sm.wsum[c & 1][w];
        if (w < warp) before += s;
        total += s;
    }
    before += ln.before;
#else
    const int first = (int)threadIdx.x & ~(R - 1);
    for (int i = first; i < first + R; ++i) {
        if (i < (int)threadIdx.x) before += sm.cnt[i];
        total += sm.cnt[i];
    }
    (void)c;
#endif
    int at0 = ln.carry + (before & 0xffff);
    int at1 = ln.carry + (total & 0xffff) + (before >> 16);
    if (dsa_chunks(p, VEC) == 1) {
        // One chunk: the row's valid slots into its share of sm.tab (every lookup of the block is
        // done: this runs after the chunk's barrier); dsa_compact_tail stores the row from there.
        int* out = sm.tab + ((int)threadIdx.x >> p.row_shift) * (R * VEC * KV_DSA_UNROLL);
#pragma unroll
        for (int i = 0; i < KV_DSA_UNROLL * VEC; ++i) {
            const int s = ln.res[i];
            if (s >= 0) out[i < VEC ? at0++ : at1++] = s;
        }
    } else if (ln.active) {
        const i64 row_off = ln.row * (i64)p.k;
#pragma unroll
        for (int v = 0; v < VEC; ++v) {
            const int s = ln.res[v];
            if (s >= 0) p.slots[row_off + at0++] = s;
        }
#pragma unroll
        for (int v = 0; v < VEC; ++v) {
            const int s = ln.res[VEC + v];
            if (s >= 0) p.slots[row_off + at1++] = s;
        }
    }
    ln.carry += (total & 0xffff) + (total >> 16);
}

// Compacting, after the last chunk: -1 after the row's valid slots, and its count. One chunk (after
// a barrier): the row from its share of sm.tab, -1 from the count on, stored where plain stores.
template <int VEC>
__device__ __forceinline__ void dsa_compact_tail(const KvDsaTopkParams& p, const DsaShared& sm, DsaLane<VEC>& ln) {
    if (!ln.active) return;
    const int R = 1 << p.row_shift;
    const i64 row_off = ln.row * (i64)p.k;
    if (ln.gt == 0) p.counts[ln.row] = ln.carry;
    if (dsa_chunks(p, VEC) == 1) {
        const int half = R * VEC;
        const int* in = sm.tab + ((int)threadIdx.x >> p.row_shift) * (half * KV_DSA_UNROLL);
#pragma unroll
        for (int u = 0; u < KV_DSA_UNROLL; ++u) {
            const int col = u * half + ln.gt * VEC;
            if (VEC == 4) {
                if (col < p.k) {
                    int4 x = *reinterpret_cast<const int4*>(in + col);
                    x.x = col < ln.carry ? x.x : -1;
                    x.y = col + 1 < ln.carry ? x.y : -1;
                    x.z = col + 2 < ln.carry ? x.z : -1;
                    x.w = col + 3 < ln.carry ? x.w : -1;
                    *reinterpret_cast<int4*>(p.slots + row_off + col) = x;
                }
            } else {
#pragma unroll
                for (int v = 0; v < VEC; ++v)
                    if (col + v < p.k) p.slots[row_off + col + v] = col + v < ln.carry ? in[col + v] : -1;
            }
        }
        return;
    }
    for (int i = ln.carry + ln.gt; i < p.k; i += R) p.slots[row_off + i] = -1;
}

// Plain, phase A (before the last barrier): the thread's count summed over the warp (GPU).
template <int VEC>
__device__ __forceinline__ void dsa_count_partial(DsaShared& sm, DsaLane<VEC>& ln) {
#ifdef __CUDA_ARCH__
    const int s = (int)__reduce_add_sync(0xffffffffu, (unsigned int)ln.carry);
    if ((threadIdx.x & 31) == 0) sm.wsum[0][threadIdx.x >> 5] = s;
#else
    sm.cnt[threadIdx.x] = ln.carry;
#endif
}

// Plain, phase B (after it): the row's first thread writes the row's count.
template <int VEC>
__device__ __forceinline__ void dsa_count_write(const KvDsaTopkParams& p, DsaShared& sm, DsaLane<VEC>& ln) {
    if (!ln.active || ln.gt != 0) return;
    const int R = 1 << p.row_shift;
    int total = 0;
#ifdef __CUDA_ARCH__
    const int first = (int)threadIdx.x >> 5;
    for (int w = first; w < first + (R >> 5); ++w) total += sm.wsum[0][w];
#else
    for (int i = (int)threadIdx.x; i < (int)threadIdx.x + R; ++i) total += sm.cnt[i];
#endif
    p.counts[ln.row] = total;
}


// The conversion: grid ceil(L * T / (KV_THREADS >> row_shift)) x 1, KV_THREADS threads.
// COMPACT: valid slots first. VEC: 4 when K % 4 == 0 and topk / slots are 16-byte aligned, else 1.
template <bool COMPACT, int VEC>
__global__ void __launch_bounds__(KV_THREADS, COMPACT ? 4 : KV_DSA_PLAIN_BLOCKS) dsa_topk_slots(const KvDsaTopkParams p) {
    __shared__ DsaShared sm;
    DsaLane<VEC> ln;
    dsa_begin<VEC>(p, ln);
    const int chunks = dsa_chunks(p, VEC);
    for (int c = 0; c < chunks; ++c) {
        dsa_chunk_load<COMPACT, VEC>(p, sm, ln, c);
        if (COMPACT) {
            __syncthreads();
            dsa_chunk_store<VEC>(p, sm, ln, c);
        }
    }
    if (COMPACT) {
        if (chunks == 1) __syncthreads();  // the compacted rows in sm.tab
        dsa_compact_tail<VEC>(p, sm, ln);
    } else {
        dsa_count_partial<VEC>(sm, ln);
        __syncthreads();
        dsa_count_write<VEC>(p, sm, ln);
    }
    // A warp never spans two rows, so its threads share one layer's record.
    kv_merge_record(p.errors, ln.layer, ln.err);
}

// One entry exactly: dsa_classify, its lookup, dsa_finish (its error recorded in err).
__device__ __forceinline__ int dsa_exact(const KvDsaTopkParams& p, const int* table, int ctx, int v, int token,
                                         int column, KvErr& err) {
    unsigned int blk, off;
    const int code = dsa_classify(p, table != nullptr, ctx, v, blk, off);
    return dsa_finish(p, code, code == DSA_LOOKUP ? dsa_ro(table + blk) : 0, off, token, column, err);
}

// ==== The power-of-two forms without DCP (DeepSeek-V3.2's B = 64), rows read as int4
//
// Both forms take a row of one chunk (K <= 8 entries per thread of the row: K <= 2048).
//
// Plain: one straight path per thread and no division: the row's loads, then every lookup (its
// block clamped into the table row, a token without a table row reading req_id[0]: no predicate),
// the checks after them as bit masks (not predicates), the stores. An entry the short path does
// not convert (bad input, ids near 2^31 / B) sends the thread through its entries again exactly
// (dsa_pow2_exact), which derives what it needs from p again, re-reads the entries and stores to
// global memory, so that it keeps none of the short path's registers. So the form fits 32
// registers with all eight lookups in flight before the first is used: eight blocks per SM, and
// T = 1024 rows in one wave on an H200 (132 SMs). Phase 1 loads and publishes the warps' counts of
// the entries before the context, which are the row's count unless an entry takes the exact path;
// after the block's barrier the row's first warp writes that count before its lookups (the count's
// barrier and store no longer follow the lookups), and every thread looks up, checks and stores. A
// block with an exact-path entry (a vote at a second barrier) converts its entries again exactly and
// writes the counts again after a third.
//
// Compacting: the same loads, lookups and bit masks (dsa_pow2_short); the exact path is plain's
// (into the row's slots), its results read back from there into registers (the compacted row
// overwrites them after two barriers). A thread's valid counts at its two places (its first int4, and its
// second half a chunk later) are packed into one int (low / high 16 bits) and scanned over the warp
// (five shuffles); the warp's sum goes to shared memory behind the block's first barrier. Then each
// thread sums its row's earlier warps' sums and the row's total (independent reads, one per warp),
// writes its valid slots at their places in the row's share of a shared table (the first places'
// slots before the second places'), and after a second barrier reads its two int4 back at its plain
// columns, -1 from the row's count on, and stores them where plain stores: every store a full int4,
// coalesced, and no entry-by-entry pass over the row. Three phases: dsa_pow2c_convert,
// dsa_pow2c_place, dsa_pow2c_store.
//
// Both forms in 32 registers (no spills on sm_80 and sm_90): eight blocks per SM. The compacting
// form's later phases derive the row again instead of keeping it across the barriers.
#define KV_DSA_POW2_BLOCKS 8

// Shared memory of a block: the warps' valid counts (the emulator: every thread's); compacting,
// also the rows' compacted slots.
template <bool COMPACT>
struct alignas(16) DsaPow2Shared {
    int wsum[KV_WARPS];
#ifndef __CUDA_ARCH__
    int cnt[KV_THREADS];
#endif
};
template <>
struct alignas(16) DsaPow2Shared<true> {
    int wsum[KV_WARPS];     // each warp's packed valid count (low: first places, high: second)
    int tab[KV_DSA_TABLE];  // the block's rows' compacted slots (KV_DSA_TABLE / rows per block each)
#ifndef __CUDA_ARCH__
    int cnt[KV_THREADS];
#endif
};
static_assert(sizeof(int) * KV_WARPS % 16 == 0, "DsaPow2Shared<true>::tab is 16-byte aligned (int4 reads)");

// The thread's row (layer * T + token) and whether it is one of the launch's, without a division:
// the later phases derive them again instead of keeping registers across the barriers.
__device__ __forceinline__ int dsa_pow2_row(const KvDsaTopkParams& p, bool& active) {
    const int row = (int)blockIdx.x * (KV_THREADS >> p.row_shift) + ((int)threadIdx.x >> p.row_shift);
    active = (unsigned int)row < (unsigned int)p.num_layers * (unsigned int)p.num_tokens;
    return row;
}

// dsa_row for a launch of at most INT32_MAX rows (the host's condition for this form): 32-bit.
__device__ __forceinline__ bool dsa_row32(const KvDsaTopkParams& p, int& row, int& layer, int& token) {
    row = (int)blockIdx.x * (KV_THREADS >> p.row_shift) + ((int)threadIdx.x >> p.row_shift);
    const bool active = (unsigned int)row < (unsigned int)p.num_layers * (unsigned int)p.num_tokens;
    const unsigned int r = active ? (unsigned int)row : 0u, t = (unsigned int)p.num_tokens;
    layer = p.num_layers == 1 ? 0 : (int)(r / t);
    token = (int)(r - (unsigned int)layer * t);
    return active;
}

// A thread's two int4 of its row of rows ([L, T, K]: topk, or slots), -1 past the row or for an
// inactive thread.
__device__ __forceinline__ void dsa_pow2_load(const KvDsaTopkParams& p, bool active, i64 row_off, int col, int half,
                                              int (&vals)[8], const int* rows) {
#pragma unroll
    for (int u = 0; u < 2; ++u) {
        int4 x = make_int4(-1, -1, -1, -1);
        if (active && col + u * half < p.k) x = *reinterpret_cast<const int4*>(rows + row_off + col + u * half);
        vals[u * 4 + 0] = x.x;
        vals[u * 4 + 1] = x.y;
        vals[u * 4 + 2] = x.z;
        vals[u * 4 + 3] = x.w;
    }
}

// The token's side of the short path: where its lookups read and the bounds its entries are checked
// against (its table row, context and padding only decide these; the exact path reads them again).
struct DsaPow2Token {
    const int* look;       // where the lookups read: the table row, else req_id (in bounds: T >= 1)
    unsigned int last;     // the last block index looked up (width - 1, 0 without a table row)
    unsigned int lim_ok;   // q < lim_ok: before the context and the row's width * B
    unsigned int lim_bad;  // q < lim_bad: v >= 0 and not padding (an entry to be converted)
};

__device__ __forceinline__ DsaPow2Token dsa_pow2_token(const KvDsaTopkParams& p, bool active, int token) {
    DsaPow2Token tk;
    const int req = active ? p.req_id[token] : -1;
    const int ctx = active ? p.ctx[token] : 0;
    const bool padding = req < 0;
    const int* table = (!padding && req < p.rows) ? p.block_table + (i64)req * p.table_stride : nullptr;
    const unsigned int width = table != nullptr ? (unsigned int)p.width : 0u;
    // Every lookup unpredicated: a token without a table row looks req_id[0] up (in bounds: T >= 1)
    // and converts nothing (lim_ok is 0 for it).
    tk.look = width > 0u ? table : p.req_id;
    tk.last = width > 0u ? width - 1u : 0u;
    const unsigned int lim = padding ? 0u : (unsigned int)max(ctx, 0);
    const unsigned long long span = (unsigned long long)width << p.block_shift;
    tk.lim_ok = min(lim, span > 0xffffffffull ? 0xffffffffu : (unsigned int)span);
    tk.lim_bad = padding ? 0u : 0x80000000u;
    return tk;
}

// The short path's lookups of a thread's eight entries (every one issued before any is used).
__device__ __forceinline__ void dsa_pow2_lookup(const KvDsaTopkParams& p, const DsaPow2Token& tk,
                                                const int (&vals)[8], int (&id)[8]) {
#pragma unroll
    for (int i = 0; i < 8; ++i) id[i] = dsa_ro(tk.look + min((unsigned int)vals[i] >> p.block_shift, tk.last));
}

// The short path's bounds as bit masks (not predicates), before the lookups: bit i of in, entry i
// lies before the token's context and the row's width (it converts unless its block id is bad); of
// must, entry i is to be converted (v >= 0, not padding).
__device__ __forceinline__ void dsa_pow2_bounds(const DsaPow2Token& tk, const int (&vals)[8], unsigned int& in,
                                                unsigned int& must) {
    in = 0u;
    must = 0u;
#pragma unroll
    for (int i = 0; i < 8; ++i) {
        const unsigned int q = (unsigned int)vals[i];
        in |= (unsigned int)(q < tk.lim_ok) << i;
        must |= (unsigned int)(q < tk.lim_bad) << i;
    }
}

// The short path's slots after the lookups: bit i of conv, entry i converts (in, its id at most
// max_id).
__device__ __forceinline__ void dsa_pow2_check(const KvDsaTopkParams& p, const int (&vals)[8], const int (&id)[8],
                                               unsigned int in, int (&res)[8], unsigned int& conv) {
    const int shift = p.block_shift;
    const unsigned int mask = (1u << shift) - 1u, max_id = (unsigned int)KV_INT_MAX >> shift;
    conv = in;
#pragma unroll
    for (int i = 0; i < 8; ++i) {
        conv &= ~((unsigned int)((unsigned int)id[i] > max_id) << i);
        res[i] = (conv >> i) & 1u ? (int)(((unsigned int)id[i] << shift) | ((unsigned int)vals[i] & mask)) : -1;
    }
}

// The short path of a thread's eight entries (the compacting form's): every lookup first, then the
// checks as bit masks. Bit i of conv: entry i converts (before the context and the width, its id at
// most max_id); of must: entry i is to be converted (v >= 0, not padding). Bit masks, not
// predicates. It repeats dsa_pow2_bounds and dsa_pow2_check rather than call them: composed of
// them, its sm_90 code is scheduled differently from the form that was measured.
__device__ __forceinline__ void dsa_pow2_short(const KvDsaTopkParams& p, const DsaPow2Token& tk,
                                               const int (&vals)[8], int (&res)[8], unsigned int& conv,
                                               unsigned int& must) {
    const int shift = p.block_shift;
    const unsigned int mask = (1u << shift) - 1u, max_id = (unsigned int)KV_INT_MAX >> shift;
    int id[8];
#pragma unroll
    for (int i = 0; i < 8; ++i) id[i] = dsa_ro(tk.look + min((unsigned int)vals[i] >> shift, tk.last));
    conv = 0u;
    must = 0u;
#pragma unroll
    for (int i = 0; i < 8; ++i) {
        const unsigned int q = (unsigned int)vals[i];
        conv |= (unsigned int)(q < tk.lim_ok) << i;
        must |= (unsigned int)(q < tk.lim_bad) << i;
    }
#pragma unroll
    for (int i = 0; i < 8; ++i) {
        conv &= ~((unsigned int)((unsigned int)id[i] > max_id) << i);
        res[i] = (conv >> i) & 1u ? (int)(((unsigned int)id[i] << shift) | ((unsigned int)vals[i] & mask)) : -1;
    }
}

// Plain, the exact path: a thread's entries exactly (dsa_exact), each re-read from and stored to
// global memory (bad input or an id near 2^31 / B). It derives what it needs from p again, so that
// the short path keeps no register for it. Returns the thread's valid count.
__device__ __forceinline__ int dsa_pow2_exact(const KvDsaTopkParams& p, KvErr& err) {
    const int half = 4 << p.row_shift;
    const int gt = (int)threadIdx.x & ((1 << p.row_shift) - 1);
    int row, layer, token;
    dsa_row32(p, row, layer, token);
    const i64 row_off = (i64)row * p.k;
    const int req = p.req_id[token], ctx = p.ctx[token];
    const int* table = (req >= 0 && req < p.rows) ? p.block_table + (i64)req * p.table_stride : nullptr;
    int n = 0;
#pragma unroll 1
    for (int i = 0; i < 8; ++i) {
        const int at = (i / 4) * half + gt * 4 + i % 4;
        if (at >= p.k) continue;
        const int r = dsa_exact(p, table, ctx, req < 0 ? -1 : p.topk[row_off + at], token, at, err);
        n += r >= 0;
        p.slots[row_off + at] = r;
    }
    return n;
}

// Plain: a thread's state across the block's barriers (registers on the GPU; the emulator keeps
// one per thread).
struct DsaPow2Plain {
    int vals[8];      // its entries, -1 past the row or for an inactive thread
    DsaPow2Token tk;  // its token's side of the short path
};

// The thread's valid count summed over its warp and published for the row's count (the emulator:
// the thread's own).
__device__ __forceinline__ void dsa_pow2_publish(DsaPow2Shared<false>& sm, int count) {
#ifdef __CUDA_ARCH__
    const int s = (int)__reduce_add_sync(0xffffffffu, (unsigned int)count);
    if ((threadIdx.x & 31) == 0) sm.wsum[threadIdx.x >> 5] = s;
#else
    sm.cnt[threadIdx.x] = count;
#endif
}

// Plain, phase 1 (before the first barrier): the thread's loads, and its count as if every entry
// before the context converts (true unless an entry takes the exact path) published.
__device__ __forceinline__ void dsa_pow2_begin(const KvDsaTopkParams& p, DsaPow2Shared<false>& sm,
                                               DsaPow2Plain& st) {
    const int half = 4 << p.row_shift;
    const int col = ((int)threadIdx.x & ((1 << p.row_shift) - 1)) * 4;
    int row, layer, token;
    const bool active = dsa_row32(p, row, layer, token);
    dsa_pow2_load(p, active, (i64)row * p.k, col, half, st.vals, p.topk);
    st.tk = dsa_pow2_token(p, active, token);
    unsigned int in, must;
    dsa_pow2_bounds(st.tk, st.vals, in, must);
    dsa_pow2_publish(sm, __popc(in));
}

// Plain, writing the row's count: its first warp sums its warps' published counts (a lane each)
// and its first thread writes the sum.
__device__ __forceinline__ void dsa_pow2_count(const KvDsaTopkParams& p, const DsaPow2Shared<false>& sm) {
    const int R = 1 << p.row_shift;
    const int lane = (int)threadIdx.x & (R - 1);  // thread within the row's threads
    bool active;
    const int row = dsa_pow2_row(p, active);
    if (lane < 32 && active) {
#ifdef __CUDA_ARCH__
        const int s = lane < (R >> 5) ? sm.wsum[((int)threadIdx.x >> 5) + lane] : 0;
        const int total = (int)__reduce_add_sync(0xffffffffu, (unsigned int)s);
#else
        int total = 0;
        for (int i = (int)threadIdx.x; i < (int)threadIdx.x + R; ++i) total += sm.cnt[i];
#endif
        if (lane == 0) p.counts[row] = total;
    }
}

// Plain, phase 2 (after the first barrier): the row's count written (phase 1's: by the row's first
// warp, before its lookups), the thread's entries looked up, checked and stored. Returns whether an
// entry takes the exact path (bad input, an id near 2^31 / B): its block then goes through phases 3
// and 4, which write the count again.
__device__ __forceinline__ bool dsa_pow2_finish(const KvDsaTopkParams& p, const DsaPow2Shared<false>& sm,
                                                DsaPow2Plain& st) {
    static_assert(KV_DSA_UNROLL == 2, "two int4 a thread a chunk");
    dsa_pow2_count(p, sm);
    const int half = 4 << p.row_shift;
    const int col = ((int)threadIdx.x & ((1 << p.row_shift) - 1)) * 4;
    bool active;
    const int row = dsa_pow2_row(p, active);
    const i64 row_off = (i64)row * p.k;
    int id[8], res[8];
    dsa_pow2_lookup(p, st.tk, st.vals, id);
    unsigned int in, must, conv;
    dsa_pow2_bounds(st.tk, st.vals, in, must);
    dsa_pow2_check(p, st.vals, id, in, res, conv);
    if (active) {
#pragma unroll
        for (int u = 0; u < 2; ++u)
            if (col + u * half < p.k)
                *reinterpret_cast<int4*>(p.slots + row_off + col + u * half) =
                    make_int4(res[u * 4], res[u * 4 + 1], res[u * 4 + 2], res[u * 4 + 3]);
    }
    return active && (must & ~conv) != 0u;
}

// Plain, phase 3 (after the second barrier, only in a block with an exact-path entry): every
// thread's entries again exactly (dsa_pow2_exact: a good entry's slot is the same), its error record
// returned (its layer in layer), and its true count published for phase 4's count.
__device__ __forceinline__ KvErr dsa_pow2_recount(const KvDsaTopkParams& p, DsaPow2Shared<false>& sm, int& layer) {
    KvErr err;
    err.mask = 0u;
    err.key = KV_NO_ERROR;
    int row, token;
    const bool active = dsa_row32(p, row, layer, token);
    dsa_pow2_publish(sm, active ? dsa_pow2_exact(p, err) : 0);
    return err;
}

// Compacting: a thread's state across its three phases (registers on the GPU; the emulator keeps
// one per thread).
struct DsaPow2Lane {
    unsigned int conv;  // bit i: res[i] is a slot (>= 0)
    int res[8];         // the converted entries: first int4 (res[0..3]), second (res[4..7])
    int packed;         // valid entries at the two places (low, high 16 bits)
    int before;         // packed valid entries of the warp's earlier threads (GPU)
    int count;          // the row's valid entries (phase 2 on)
    KvErr err;
};

// Compacting, phase 1 (before the first barrier): the thread's entries converted into registers,
// its valid counts packed and scanned over the warp, the warp's sum published.
__device__ __forceinline__ void dsa_pow2c_convert(const KvDsaTopkParams& p, DsaPow2Shared<true>& sm,
                                                  DsaPow2Lane& ln) {
    const int half = 4 << p.row_shift;
    const int col = ((int)threadIdx.x & ((1 << p.row_shift) - 1)) * 4;
    int row, layer, token;
    const bool active = dsa_row32(p, row, layer, token);
    const i64 row_off = (i64)row * p.k;
    int vals[8];
    dsa_pow2_load(p, active, row_off, col, half, vals, p.topk);
    const DsaPow2Token tk = dsa_pow2_token(p, active, token);
    ln.err.mask = 0u;
    ln.err.key = KV_NO_ERROR;
    unsigned int must;
    dsa_pow2_short(p, tk, vals, ln.res, ln.conv, must);
    if ((must & ~ln.conv) != 0u && active) {
        // bad input or an id near 2^31 / B: the entries exactly into the row's slots where plain
        // stores them (dsa_pow2_exact keeps no register of the short path), read back from there
        // (this thread's own stores; the compacted row overwrites them after two barriers)
        dsa_pow2_exact(p, ln.err);
        int back[8];
        dsa_pow2_load(p, true, row_off, col, half, back, p.slots);
        ln.conv = 0u;
#pragma unroll
        for (int i = 0; i < 8; ++i) {
            ln.res[i] = back[i];
            ln.conv |= (unsigned int)(back[i] >= 0) << i;
        }
    }
    // -1 at the thread's places of the row's share of sm.tab: what the compacted row keeps from its
    // count on (every place before the count is written over in phase 2, after the barrier)
    int* share = sm.tab + ((int)threadIdx.x >> p.row_shift) * (half * 2);
    *reinterpret_cast<int4*>(share + col) = make_int4(-1, -1, -1, -1);
    *reinterpret_cast<int4*>(share + col + half) = make_int4(-1, -1, -1, -1);
    ln.packed = __popc(ln.conv & 0xfu) | (__popc(ln.conv >> 4) << 16);
#ifdef __CUDA_ARCH__
    const int incl = dsa_warp_scan<32>(ln.packed);
    ln.before = incl - ln.packed;
    if ((threadIdx.x & 31) == 31) sm.wsum[threadIdx.x >> 5] = incl;
#else
    sm.cnt[threadIdx.x] = ln.packed;
#endif
}

// Compacting, phase 2 (after the first barrier): the thread's places among its row's valid
// entries (the row's earlier warps' sums, each read on its own), its valid slots written there
// into the row's share of sm.tab, and the row's count.
__device__ __forceinline__ void dsa_pow2c_place(const KvDsaTopkParams& p, DsaPow2Shared<true>& sm,
                                                DsaPow2Lane& ln) {
    const int R = 1 << p.row_shift;
    int before = 0, total = 0;
#ifdef __CUDA_ARCH__
    // lane j < the row's warps holds the row's warp j's sum: a scan over those lanes, then each
    // thread takes its warp's exclusive sum and the row's total
    const int lane = (int)threadIdx.x & 31, warp = (int)threadIdx.x >> 5;
    const int first = ((int)threadIdx.x & ~(R - 1)) >> 5, warps = R >> 5;
    const int s = lane < warps ? sm.wsum[first + lane] : 0;
    const int incl = dsa_warp_scan<KV_WARPS>(s);
    before = __shfl_sync(0xffffffffu, incl - s, warp - first) + ln.before;
    total = __shfl_sync(0xffffffffu, incl, warps - 1);
#else
    const int first = (int)threadIdx.x & ~(R - 1);
    for (int i = first; i < first + R; ++i) {
        if (i < (int)threadIdx.x) before += sm.cnt[i];
        total += sm.cnt[i];
    }
#endif
    // the first places' slots after the row's earlier threads' first places'; the second places'
    // after all first places' and the earlier threads' second places'
    int at0 = before & 0xffff;
    int at1 = (total & 0xffff) + (before >> 16);
    ln.count = (total & 0xffff) + (total >> 16);
    int* out = sm.tab + ((int)threadIdx.x >> p.row_shift) * (R * 8);
#pragma unroll
    for (int i = 0; i < 8; ++i)
        if ((ln.conv >> i) & 1u) out[i < 4 ? at0++ : at1++] = ln.res[i];
}

// Compacting, phase 3 (after the second barrier): the thread's two int4 of the compacted row, -1
// from the row's count on, stored where plain stores; the row's first thread writes the count.
__device__ __forceinline__ void dsa_pow2c_store(const KvDsaTopkParams& p, const DsaPow2Shared<true>& sm,
                                                const DsaPow2Lane& ln) {
    bool active;
    const int row = dsa_pow2_row(p, active);
    if (!active) return;
    const int half = 4 << p.row_shift;
    const int gt = (int)threadIdx.x & ((1 << p.row_shift) - 1);
    const i64 row_off = (i64)row * p.k;
    const int* in = sm.tab + ((int)threadIdx.x >> p.row_shift) * (half * 2);
#pragma unroll
    for (int u = 0; u < 2; ++u) {
        const int col = u * half + gt * 4;
        if (col < p.k) *reinterpret_cast<int4*>(p.slots + row_off + col) = *reinterpret_cast<const int4*>(in + col);
    }
    if (gt == 0) p.counts[row] = ln.count;
}

// The forms' bodies, chosen by the shared memory's type.
__device__ __forceinline__ void dsa_pow2_run(const KvDsaTopkParams& p, DsaPow2Shared<false>& sm) {
    DsaPow2Plain st;
    dsa_pow2_begin(p, sm, st);
    __syncthreads();
    const bool exact = dsa_pow2_finish(p, sm, st);
    if (__syncthreads_or(exact)) {  // (uniform) bad input or an id near 2^31 / B
        int layer;
        const KvErr err = dsa_pow2_recount(p, sm, layer);
        kv_merge_record(p.errors, layer, err);  // a warp never spans two rows: one layer's record
        __syncthreads();
        dsa_pow2_count(p, sm);  // by the thread that wrote phase 2's count: it is overwritten
    }
}

__device__ __forceinline__ void dsa_pow2_run(const KvDsaTopkParams& p, DsaPow2Shared<true>& sm) {
    DsaPow2Lane ln;
    dsa_pow2c_convert(p, sm, ln);
    int row, layer, token;
    dsa_row32(p, row, layer, token);
    kv_merge_record(p.errors, layer, ln.err);  // a warp never spans two rows: one layer's record
    __syncthreads();
    dsa_pow2c_place(p, sm, ln);
    __syncthreads();
    dsa_pow2c_store(p, sm, ln);
}

// Grid as dsa_topk_slots'; block_shift >= 0, cp_size == 1, K % 4 == 0, topk / slots 16-byte
// aligned, at most INT32_MAX rows. COMPACT: valid slots first, a row of one chunk (K <= 8 * R).
template <bool COMPACT>
__global__ void __launch_bounds__(KV_THREADS, KV_DSA_POW2_BLOCKS) dsa_topk_slots_pow2(
    const KvDsaTopkParams p) {
    __shared__ DsaPow2Shared<COMPACT> sm;
    dsa_pow2_run(p, sm);
}
