// The core step (docs/spec.md; kvaddr/reference.py is the oracle): cu_seqlens_q, num_tokens,
// batch_id_per_token, position_ids, seq_lens_kv and the slot mapping of up to KV_MAX_CACHES
// caches, padding and error records included, in ONE launch, with the attention metadata
// (attention.cuh) in the same launch when asked for. Every kernel takes one KvStepParams by
// value. Three designs, chosen by the planner by batch size:
//   * step_multiblock<PosT>: any batch (a grid of KV_THREADS-thread blocks, KV_TOKENS tokens each).
//     - Small batches (bsz <= KV_TILE): grid = one block per KV_TOKENS tokens of the capacity, one
//       token per thread (kv_multiblock_small). Every block loads all lengths itself (int4 loads
//       into shared memory), so no block waits for another. Its one barrier also tests whether the
//       batch is uniform (every request good and running q[0] tokens); a uniform batch is written
//       in closed form with no prefix sum, decode tokens from block-table loads issued before the
//       barrier. Other batches are scanned in shared memory (thread-blocked sequential sums + a
//       warp-shuffle block scan) and each token's request is checked against two guesses or
//       binary-searched.
//     - Large batches (bsz > KV_TILE): blocks take tickets in the order they start
//       (kv_take_ticket). The first ceil(bsz / KV_TILE) tickets scan one tile of requests each
//       (kv_large_scan) and chain their prefixes with a decoupled look-back (kv_look_back: a tile
//       only ever waits for tiles with lower tickets, which are running), write cu_seqlens_q and
//       seq_lens_kv, and count themselves done. The other tickets each own KV_TOKENS tokens
//       (kv_large_tokens): they wait for the scan (kv_wait_scan; lower tickets only: no
//       deadlock), find their first and last request with a 32-way warp search over cu_seqlens_q
//       and stage those requests in shared memory (kv_chunk_requests), and search per token
//       there. The last block to finish resets the tickets for the next launch and bumps an
//       epoch that invalidates the tile flags (kv_finish_launch), so the kernel is safe to replay
//       in a CUDA graph with no memset.
//     - Attention metadata (KvStepParams::attention != 0): num_meta more blocks after the token
//       blocks (kv_meta_block, attention.cuh).
//   * step_small<G, PosT> / step_small_attention<G, PosT>: bsz <= KV_SB_THREADS, every block holds
//     every request (one per thread); G caches as a template parameter.
//   * step_wide<G, PosT, R> / step_wide_attention<G, PosT>: bsz <= KV_W_MAX, every block holds every
//     request (R per thread).
// DSA outputs (KvStepParams::dsa, docs/dsa.md): each kernel's DSA = true instantiation writes each
// token's DSA value / scale offsets and ctx with its slot (and padding's with its padding), and is
// launched with a second grid row of DSA blocks for ks, ke and cu_seq_lens (dsa_step.cuh).
// Errors: sticky per-warp records (mask, first-bad key). Only a warp that found an error writes: it
// merges into its own record with atomicOr (mask) and atomicMin (key), so a record holds every
// error since the host last cleared it; a clean warp writes nothing and no kernel clears.
// errors()/check() reduce the records on the host (OR, min) and reset them. The mask's bits are
// the KV_ERR_* constants (kvaddr/errors.py's ERR_*, checked by a test).
// Addresses are int64 throughout: block ids up to 2^31-1 times any block size.

// ---- the multi-block step (step_multiblock) ----

// Shared index with one pad word per 32: conflict-free thread-blocked access.
#define KV_PAD(k) ((k) + ((k) >> 5))
#define KV_SCAN_WORDS (KV_PAD(KV_TILE) + 1)

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

// DSA (the kernel's DSA instantiation): also token t's DSA value / scale offsets and ctx from its
// slot in the dsa cache (kv_dsa_store_slot, dsa_step.cuh).
template <typename PosT, bool DSA = false>
__device__ __forceinline__ void kv_store_token(int t, int b, i64 pos, const int (&blk)[KV_MAX_CACHES],
                                               const KvCaches& c, int num_caches, int capacity,
                                               int* __restrict__ batch_out, PosT* __restrict__ pos_out,
                                               i64* __restrict__ slot_out, KvErr& err,
                                               const KvDsaOut& dso = KvDsaOut()) {
    batch_out[t] = b;
    pos_out[t] = (PosT)pos;
    i64 dslot = -1, doff = 0;  // DSA: the dsa cache's slot (-1: bad), pos % B and B there
    int dB = 1;
#pragma unroll
    for (int g = 0; g < KV_MAX_CACHES; ++g) {
        if (g < num_caches) {
            i64 idx, off, slot = -1;
            kv_divmod(pos, c.bs[g], idx, off);
            if (idx >= c.width[g]) err.flag(KV_ERR_BLOCK_INDEX, t, b, g);
            else if (blk[g] < 0) err.flag(KV_ERR_NEGATIVE_BLOCK, t, b, g);
            else slot = (i64)blk[g] * c.bs[g] + off;
            slot_out[(i64)g * capacity + t] = slot;
            if (DSA && g == dso.g) {
                dslot = slot;
                dB = c.bs[g];
                doff = off;
            }
        }
    }
    if (DSA) kv_dsa_store_slot(dso.value, dso.scale, dso.ctx, t, pos, dslot, doff, dB, dso.V, dso.S);
}

template <typename PosT, bool DSA = false>
__device__ __forceinline__ void kv_write_token(int t, int b, i64 pos, const KvCaches& c, int num_caches,
                                               int capacity, int* __restrict__ batch_out,
                                               PosT* __restrict__ pos_out, i64* __restrict__ slot_out,
                                               KvErr& err, const KvDsaOut& dso = KvDsaOut()) {
    int blk[KV_MAX_CACHES];
    kv_load_blocks(b, pos, c, num_caches, blk);
    kv_store_token<PosT, DSA>(t, b, pos, blk, c, num_caches, capacity, batch_out, pos_out, slot_out, err, dso);
}

template <typename PosT, bool DSA = false>
__device__ __forceinline__ void kv_write_pad(int t, int num_caches, int capacity, int* __restrict__ batch_out,
                                             PosT* __restrict__ pos_out, i64* __restrict__ slot_out,
                                             const KvDsaOut& dso = KvDsaOut()) {
    batch_out[t] = -1;
    pos_out[t] = 0;
#pragma unroll
    for (int g = 0; g < KV_MAX_CACHES; ++g)
        if (g < num_caches) slot_out[(i64)g * capacity + t] = -1;
    if (DSA) kv_dsa_store_pad(dso.value, dso.scale, dso.ctx, t);
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
template <typename PosT, bool DSA>
__device__ __forceinline__ void kv_multiblock_small(KvShared& s, const int* __restrict__ dec, const int* __restrict__ q,
                                              int bsz, int capacity, int num_caches, const KvCaches& c,
                                              int* __restrict__ cu_out, int* __restrict__ num_tokens_out,
                                              int* __restrict__ batch_out, PosT* __restrict__ pos_out,
                                              int* __restrict__ kv_out, i64* __restrict__ slot_out,
                                              u64* __restrict__ rec, int num_chunks, const KvDsaOut& dso) {
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
            kv_store_token<PosT, DSA>(t, b, pos, blk, c, num_caches, capacity, batch_out, pos_out, slot_out, err,
                                      dso);
        } else if (t < capacity) {
            kv_write_pad<PosT, DSA>(t, num_caches, capacity, batch_out, pos_out, slot_out, dso);
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
        if (hit) kv_store_token<PosT, DSA>(t, b, pos, blk, c, num_caches, capacity, batch_out, pos_out, slot_out, err,
                                           dso);
        else kv_write_token<PosT, DSA>(t, b, pos, c, num_caches, capacity, batch_out, pos_out, slot_out, err, dso);
    } else if (t < capacity) {
        kv_write_pad<PosT, DSA>(t, num_caches, capacity, batch_out, pos_out, slot_out, dso);
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
template <typename PosT, bool DSA>
__device__ __forceinline__ void kv_large_tokens(KvShared& s, int chunk, int num_tiles, int num_chunks,
                                                const int* __restrict__ dec, int bsz, int capacity, int num_caches,
                                                const KvCaches& c, int* __restrict__ cu_out,
                                                int* __restrict__ batch_out, PosT* __restrict__ pos_out,
                                                i64* __restrict__ slot_out, unsigned int* __restrict__ state,
                                                KvErr& err, const KvDsaOut& dso) {
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
            kv_write_token<PosT, DSA>(t, b, (i64)d + (t - start), c, num_caches, capacity, batch_out, pos_out,
                                      slot_out, err, dso);
        } else {
            kv_write_pad<PosT, DSA>(t, num_caches, capacity, batch_out, pos_out, slot_out, dso);
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

// The multi-block step's token blocks: the small-batch path (kv_multiblock_small) or the large-batch one: grid =
// num_chunks + ceil(bsz / KV_TILE) blocks, tickets below num_tiles scan
// (kv_large_scan), the others write tokens (kv_large_tokens). Error records: small path
// and token chunk k in slot k, scan tile i in slot num_chunks + i, metadata block m in
// slot num_chunks + max_tiles + m. The launch's last num_meta blocks are metadata
// blocks (step_multiblock sends them to kv_meta_block): the token blocks are
// gridDim.x - num_meta (computed that way, a parameter and a special register, so
// nothing more is live in the token path).
template <typename PosT, bool DSA>
__device__ void kv_step_tokens(KvShared& s, const int* __restrict__ dec, const int* __restrict__ q, int bsz, int capacity,
                        int num_caches, const KvCaches& c, int* __restrict__ cu_out,
                        int* __restrict__ num_tokens_out, int* __restrict__ batch_out,
                        PosT* __restrict__ pos_out, int* __restrict__ kv_out, i64* __restrict__ slot_out,
                        u64* __restrict__ rec, unsigned int* __restrict__ state,
                        u64* __restrict__ tile_status, int num_meta, const KvDsaOut& dso) {
    // err and num_chunks before the branch (the large path's): declared after it, ptxas
    // allocates one more register for sm_90.
    KvErr err;
    err.mask = 0u;
    err.key = KV_NO_ERROR;
    const int num_chunks = (capacity + KV_TOKENS - 1) / KV_TOKENS;
    if (bsz <= KV_TILE) {
        kv_multiblock_small<PosT, DSA>(s, dec, q, bsz, capacity, num_caches, c, cu_out, num_tokens_out, batch_out,
                                       pos_out, kv_out, slot_out, rec, (int)gridDim.x - num_meta, dso);
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
        kv_large_tokens<PosT, DSA>(s, chunk, num_tiles, num_chunks, dec, bsz, capacity, num_caches, c, cu_out,
                                   batch_out, pos_out, slot_out, state, err, dso);
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

// The token blocks' and the metadata blocks' shared memory (a block is one or the other).
union KvSharedAll {
    KvShared step;
    KvMetaShared meta;
};

// The multi-block step, position_ids int64 (PosT = long long) or int32 (PosT = int):
// <<<token blocks + num_meta, KV_THREADS>>>, one parameter. Every field is read by name, the
// caches gathered into registers (KvCaches). The blocks after the token blocks (when
// num_meta > 0) write the attention metadata (kv_meta_block).
template <typename PosT, bool DSA = false>
__global__ void __launch_bounds__(KV_THREADS, DSA ? 1 : 2) step_multiblock(const KvStepParams params) {
    if (DSA && blockIdx.y != 0) {  // the DSA blocks (dsa_step.cuh): the second grid row (DSA kernels only)
        kv_dsa_block(params);
        return;
    }
    const KvStepParams& p = params;
    __shared__ KvSharedAll sh;
    if (p.num_meta > 0) {  // attention outputs: the blocks after the token blocks write them
        const int num_chunks = (p.capacity + KV_TOKENS - 1) / KV_TOKENS;
        const int token_blocks = p.bsz <= KV_TILE ? num_chunks : num_chunks + (p.bsz + KV_TILE - 1) / KV_TILE;
        if ((int)blockIdx.x >= token_blocks) {
            kv_meta_block(sh.meta, p, (int)blockIdx.x - token_blocks, num_chunks);
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
    KvDsaOut dso = KvDsaOut();  // DSA: the token writes' DSA outputs (unused otherwise)
    if (DSA) {
        dso.value = p.dsa_value_offsets;
        dso.scale = p.dsa_scale_offsets;
        dso.ctx = p.dsa_ctx;
        dso.g = p.dsa_cache;
        dso.V = p.dsa_value_bytes;
        dso.S = p.dsa_scale_bytes;
    }
    kv_step_tokens<PosT, DSA>(s, p.seq_lens_decoder, p.seq_lens_this_time, p.bsz, p.capacity, p.num_caches, c,
                              p.cu_seqlens_q, p.num_tokens, p.batch_id_per_token, static_cast<PosT*>(p.position_ids),
                              p.seq_lens_kv, p.slot_mapping, p.error_records, p.tile_state, p.tile_status, p.num_meta,
                              dso);
}

// ---- the small-batch step (step_small, step_small_attention's token blocks) ----
//
// step_small<G, PosT>, G = 0..4 caches (a template parameter: no per-cache loop or predicate at
// run time). For bsz <= KV_SB_THREADS requests: blocks of T threads (T a multiple of 32,
// bsz <= T <= KV_SB_THREADS, chosen by the planner: T = max(bsz, min(C, 256), 32) rounded up),
// grid = ceil(C / T), a token per thread (token blockIdx.x * T + threadIdx.x). Every block holds
// all bsz lengths itself (one request per thread), so no block tests or waits for another; with
// C <= T it is ONE block. Thread i owns request i:
//   1. One round trip: its lengths; in block 0 the decode guess (token i is request i, at
//      position seq_lens_decoder[i]) issues its block-table loads as soon as the length arrives.
//   2. One vote (__syncthreads_and; __all_sync for one warp): a decode batch (every request
//      n == 1, d >= 0) has request i's tokens [i, i + 1) and skips the scan and the search.
//      Otherwise a warp-shuffle scan, one barrier (none for one warp), every warp scans the warp
//      totals: each thread has its request's exclusive and inclusive prefix. Block 0 writes
//      cu_seqlens_q, seq_lens_kv and the request errors (bits 4 and 8), and, if the guess holds
//      (prefix == i and the request runs a token), token i from the loads of 1. Padding tokens
//      [num_tokens, C) are written here too.
//   3. A second barrier (a __syncwarp for one warp: the prefixes in shared memory); the tokens the
//      guess did not cover try "token t is request t / n0" (n0: request 0's tokens), else
//      binary-search their request there.
// Every scalar parameter the step reads is pinned in a register at entry (kv_params_in_registers:
// measured faster than reading bsz, comparing, then the pointers).
// Error records: warp w of block k merges into record k * T / 32 + w, only when it found an
// error (sticky, kv_merge_record; the planner sizes the records for every kernel it may run).
// CUDA-graph safe: no state outlives the launch.
#define KV_SB_THREADS 1024
#define KV_SB_WARPS 32  // KV_SB_THREADS / 32

struct KvSmallShared {
    int cu[KV_SB_THREADS];       // exclusive prefix of request i (i < bsz)
    int dec[KV_SB_THREADS];      // seq_lens_decoder[i] (searched tokens only read good requests)
    int warp_sums[KV_SB_WARPS];  // inclusive total of each warp
};

template <int G, typename PosT, bool DSA>
__device__ __forceinline__ void kv_store_pad_token(const KvStepParams& p, int t) {
    kv_st(p.batch_id_per_token + t, -1);
    kv_st(static_cast<PosT*>(p.position_ids) + t, (PosT)0);
#pragma unroll
    for (int g = 0; g < G; ++g) kv_st(p.slot_mapping + (i64)g * p.capacity + t, (i64)-1);
    if (DSA) kv_dsa_store_pad(p.dsa_value_offsets, p.dsa_scale_offsets, p.dsa_ctx, t);
}

// Block ids of a token, also returning pos % B and whether pos / B is within the row.
// What does not depend on pos is made before pos arrives, so that between pos's arrival and a
// cache's block-id load there are only the quotient (a multiply-high and one correction) and the
// address:
//   * a reciprocal of B made at entry: m = floor((2^32 - 1) / B) (B >= 1); for p < 2^32,
//     umulhi(p, m) is p / B or one less (p m / 2^32 > p / B - p / 2^32 > p / B - 1), so one
//     correction makes it exact (instead of the compiler's I2F, MUFU.RCP, F2I and two
//     corrections after pos arrives);
//   * the bound: pos / B < max_blocks iff p < lim = min(max_blocks * B, 2^32 - 1) (for
//     p <= 2^32 - 2: every position; see kv_load_block_ids);
//   * the rows where the request is known at entry (the decode guess: kv_row_addrs_at_entry),
//     passed through an identity shuffle. Without it ptxas re-makes them from the parameters
//     after pos's arrival (the table pointer's and stride's constant-bank reads, a 64-bit
//     multiply fused with the index), under the load's predicate: about ten instructions and a
//     constant-bank round trip on the chain of every cache. It can neither re-make nor fuse what
//     a shuffle returned. Such an address has no address space for the compiler, so the load is
//     an explicit ld.global (kv_ld_global).
template <int G>
struct KvDivisors {
    unsigned int m[G > 0 ? G : 1];    // floor((2^32 - 1) / B[g])
    unsigned int lim[G > 0 ? G : 1];  // min(max_blocks[g] * B[g], 2^32 - 1)
};
template <int G>
__device__ __forceinline__ void kv_divisors_init(const KvStepParams& p, KvDivisors<G>& dv) {
#pragma unroll
    for (int g = 0; g < G; ++g) {
        const unsigned int bq = (unsigned int)p.block_size[g];  // >= 1 (the planner checks)
        dv.m[g] = 0xffffffffu / bq;
        const u64 lim = (u64)(unsigned int)p.max_blocks[g] * bq;
        dv.lim[g] = lim < 0xffffffffull ? (unsigned int)lim : 0xffffffffu;
    }
}
// Request b's row in every cache (global addresses).
template <int G>
__device__ __forceinline__ void kv_row_addrs(const KvStepParams& p, int b, u64 (&row)[G > 0 ? G : 1]) {
#pragma unroll
    for (int g = 0; g < G; ++g) row[g] = kv_global_addr(p.block_tables[g]) + (u64)((i64)b * p.table_stride[g]) * 4u;
}
// The same, at kernel entry, kept in registers (the identity shuffle above: every lane of the warp
// must be here, i.e. no divergence yet).
template <int G>
__device__ __forceinline__ void kv_row_addrs_at_entry(const KvStepParams& p, int b, u64 (&row)[G > 0 ? G : 1]) {
    kv_row_addrs<G>(p, b, row);
#ifdef __CUDA_ARCH__
#pragma unroll
    for (int g = 0; g < G; ++g) row[g] = __shfl_sync(0xffffffffu, row[g], threadIdx.x & 31);
#endif
}
// want: load at all (false: blk = -1); an index beyond the row loads nothing (blk = -1, inb false).
// pos: 0 <= pos <= 2^32 - 2 for a token (the owner's seq_lens_decoder <= INT_MAX plus fewer than
// C <= INT_MAX tokens), so one 32-bit unsigned path covers every position. A guess's pos may be a
// negative length (its block ids are then never used): p32 wraps, and the load still reads
// inside the row (p32 < lim).
template <int G>
__device__ __forceinline__ void kv_load_block_ids(const KvStepParams& p, const KvDivisors<G>& dv,
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
        blk[g] = want && inb[g] ? kv_ld_global(row[g] + (u64)q * 4u) : -1;
    }
}

// Token t's outputs (request b, position pos) from its block ids, pos % B and the bound test
// (kv_load_block_ids): bit 1 for an index beyond the row, bit 2 for a negative block id. DSA: also
// its DSA value / scale offsets and ctx from the dsa cache's slot (kv_dsa_store_slot, dsa_step.cuh).
template <int G, typename PosT, bool DSA>
__device__ __forceinline__ void kv_store_token_slots(const KvStepParams& p, int t, int b, i64 pos,
                                                     const int (&blk)[G > 0 ? G : 1],
                                                     const i64 (&off)[G > 0 ? G : 1],
                                                     const bool (&inb)[G > 0 ? G : 1], KvErr& err) {
    kv_st(p.batch_id_per_token + t, b);
    kv_st(static_cast<PosT*>(p.position_ids) + t, (PosT)pos);
#pragma unroll
    for (int g = 0; g < G; ++g) {
        i64 slot = -1;
        if (!inb[g]) err.flag(KV_ERR_BLOCK_INDEX, t, b, g);
        else if (blk[g] < 0) err.flag(KV_ERR_NEGATIVE_BLOCK, t, b, g);
        else slot = (i64)blk[g] * p.block_size[g] + off[g];
        kv_st(p.slot_mapping + (i64)g * p.capacity + t, slot);
        // the dsa cache's, stored here under a test the compiler cannot see through (kv_pin): it
        // would merge the caches' stores into one of selected values, an index into p (a local
        // struct: a stack frame)
        if (DSA && kv_pin(g == p.dsa_cache ? 1 : 0))
            kv_dsa_store_slot(p.dsa_value_offsets, p.dsa_scale_offsets, p.dsa_ctx, t, pos, slot, off[g],
                              p.block_size[g], p.dsa_value_bytes, p.dsa_scale_bytes);
    }
}

// The decode vote: true in every thread of the block iff ok in every thread.
__device__ __forceinline__ bool kv_decode_vote(int T, bool ok) {
    return T == 32 ? __all_sync(0xffffffffu, ok) != 0 : __syncthreads_and(ok) != 0;
}

// Every scalar field the small and wide steps read, copied into a register at entry (kv_pin),
// into r; the steps then run on r. (max_tiles, num_meta and the attention fields are not read; the
// DSA fields the token writes use only with DSA.)
template <int G, bool DSA>
__device__ __forceinline__ void kv_params_in_registers(const KvStepParams& p, KvStepParams& r) {
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
    r.capacity = kv_pin(p.capacity);
    if (DSA) {  // not pinned: read where the token writes use them (no register held meanwhile)
        r.dsa_value_offsets = p.dsa_value_offsets;
        r.dsa_scale_offsets = p.dsa_scale_offsets;
        r.dsa_ctx = p.dsa_ctx;
        r.dsa_cache = p.dsa_cache;
        r.dsa_value_bytes = p.dsa_value_bytes;
        r.dsa_scale_bytes = p.dsa_scale_bytes;
    }
}

// The small-batch step's token blocks (see the section comment), on the pinned parameters.
template <int G, typename PosT, bool DSA>
__device__ __forceinline__ void kv_small_tokens(const KvStepParams& p) {
    __shared__ KvSmallShared s;
    const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5, T = blockDim.x;
    const int bsz = p.bsz, capacity = p.capacity;
    const bool first = blockIdx.x == 0;       // the block that writes the per-request outputs
    const i64 t64 = (i64)blockIdx.x * T + tid;  // this thread's token (capacity: none; no int overflow)
    const int t = t64 < capacity ? (int)t64 : capacity;
    KvErr err;
    err.mask = 0u;
    err.key = KV_NO_ERROR;

    // 1. one round trip: request tid's lengths and the decode guess's block ids.
    int n = 0, d = 0;
    if (tid < bsz) {
        d = kv_ld(p.seq_lens_decoder + tid);
        n = kv_ld(p.seq_lens_this_time + tid);
    }
    KvDivisors<G> dv;  // B's reciprocal and the row bound per cache (kv_divisors_init: while the loads fly)
    kv_divisors_init<G>(p, dv);
    u64 grow[G > 0 ? G : 1];  // request tid's rows (the guess's; made at entry)
    kv_row_addrs_at_entry<G>(p, tid, grow);
    const bool bad = (d < 0) | (n < 0);
    // the guess: token tid is request tid's first (a good request with n > 0). Its block-id loads
    // (kv_load_block_ids) are predicated on gload, known at entry: they wait for d, not for n, and
    // read in bounds whatever d is (the row exists: tid < bsz).
    const bool gload = first & (tid < bsz) & (tid < capacity);
    const bool guess = gload & !bad & (n > 0);
    int blk[G > 0 ? G : 1];
    blk[0] = -1;
    i64 goff[G > 0 ? G : 1];   // pos % B of the guess
    bool ginb[G > 0 ? G : 1];  // pos / B < max_blocks of the guess
    kv_load_block_ids<G>(p, dv, grow, (i64)d, gload, blk, goff, ginb);

    // 2. the vote, then (not a decode batch) the scan: warp shuffles, one barrier, every warp
    //    scans the warp totals. A decode batch (every request n == 1, d >= 0) has start = i,
    //    end = i + 1, total = bsz and skips the scan and the search.
    const bool decode = kv_decode_vote(T, (tid >= bsz) | ((n == 1) & (d >= 0)));
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
            kv_st(p.seq_lens_kv + tid, bad ? 0 : kv_sat_add(d, n));
            kv_write_request(tid, start, end, bad ? -1 : d, capacity, p.cu_seqlens_q, err);
        }
        if (tid == 0) {
            kv_st(p.cu_seqlens_q + bsz, total);
            kv_st(p.num_tokens, end_tok);
        }
    }
    const bool hit = guess & (start == tid);  // token tid (block 0) is request tid's first (tid < end_tok)
    if (hit) {
        kv_store_token_slots<G, PosT, DSA>(p, t, tid, (i64)d, blk, goff, ginb, err);
    } else if (t < capacity && t >= end_tok) {
        kv_store_pad_token<G, PosT, DSA>(p, t);
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
        i64 o2[G > 0 ? G : 1];
        bool n2[G > 0 ? G : 1];
        u64 row2[G > 0 ? G : 1];
        kv_row_addrs<G>(p, lo, row2);
        kv_load_block_ids<G>(p, dv, row2, pos, true, b2, o2, n2);
        kv_store_token_slots<G, PosT, DSA>(p, t, lo, pos, b2, o2, n2, err);
    }

    // Errors: warp w of block k merges into record k * (T / 32) + w, only with an error (sticky).
    kv_merge_record(p.error_records, (i64)blockIdx.x * (T >> 5) + warp, err);
}

// ---- the step across blocks (step_wide, step_wide_attention's token blocks) ----
// step_wide<G, PosT, R>, R = 4, 8, 16
// requests per thread: blocks of T threads (a multiple of 32, R * T >= bsz, R * T <= KV_W_MAX: the
// planner's choice), grid = ceil(C / T), a token per thread (token t = blockIdx.x * T + threadIdx.x).
// Every thread of EVERY block holds R requests' lengths, so every block knows every length and no
// block waits for another:
//   1. One round trip: the thread's R lengths of each array as R / 4 chunks of 4 requests, chunk k of
//      thread i = requests [4 (k T + i), 4 (k T + i) + 4) (int4 loads where aligned and in range; a
//      warp's load is 512 contiguous bytes); the decode guess of token t (token t is request t at
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
// The error records are step_small's (a warp w of block k that found an error merges it into record
// k * T / 32 + w: sticky, kv_merge_record); T <= 1024 keeps them within the records the planner sizes
// for step_small (ceil((C + 1024) / 32)).
#define KV_W_MAX 4096  // R * T at most: the prefixes of every request in static shared memory (32 KB)
#define KV_W_ROWS 4     // chunk rows (R / 4) at most: R <= 16

struct KvWideShared {
    int cu[KV_W_MAX];            // exclusive prefix of request b (b < bsz)
    int dec[KV_W_MAX];           // seq_lens_decoder[b] (searched tokens only read good requests)
    int warp_sums[KV_W_ROWS][KV_SB_WARPS];  // [chunk row k][warp]: inclusive total of the warp's chunks
};

// The token blocks of the step across blocks (see the section comment), on the pinned parameters.
template <int G, typename PosT, int R, bool DSA>
__device__ __forceinline__ void kv_wide_tokens(const KvStepParams& p, KvErr& err) {
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
    KvDivisors<G> dv;  // B's reciprocal and the row bound per cache (kv_divisors_init: while the loads fly)
    constexpr int K = R / 4;  // chunks per thread (R = 4, 8, 16)
    static_assert(R % 4 == 0 && K <= KV_W_ROWS, "R must be 4, 8 or 16");
    int d[R], n[R];            // d[4 k + j], n[4 k + j]: request 4 (k T + tid) + j (0 past bsz)
    const unsigned long long lens =
        (unsigned long long)p.seq_lens_decoder | (unsigned long long)p.seq_lens_this_time;
    const bool aligned = (lens & 15ull) == 0;  // both length arrays 16-byte aligned
    const bool tok = t < bsz && t < capacity;  // token t exists and request t does
    int dt = -1;
    if (tok) dt = kv_ld(p.seq_lens_decoder + t);  // the guess's load before the chunks' (its
                                                  // answer does not queue behind theirs)
    // full: every chunk of this thread lies below bsz and both arrays are aligned (every thread of a
    // batch of R T requests, e.g. decode 4096): its K int4 loads per array are issued unconditionally
    // and its vote takes 1.5 instructions per request (on the chain that ends at the vote's barrier).
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
    kv_divisors_init<G>(p, dv);
    u64 grow[G > 0 ? G : 1];  // request t's rows (the guess's; made at entry)
    kv_row_addrs_at_entry<G>(p, t, grow);
    int blk[G > 0 ? G : 1];
    blk[0] = -1;
    i64 goff[G > 0 ? G : 1];   // pos % B of the guess
    bool ginb[G > 0 ? G : 1];  // pos / B < max_blocks of the guess
    // the guess's block ids (used only by a decode batch, where dt >= 0), predicated on tok (known
    // at entry), so that they wait for dt alone (kv_load_block_ids)
    kv_load_block_ids<G>(p, dv, grow, (i64)dt, tok, blk, goff, ginb);

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
    const bool decode = kv_decode_vote(T, ok) && bsz <= capacity;
    if (decode) {
        if (t < bsz) {  // t < bsz <= C: token t is request t's only one, at dt >= 0
            kv_store_token_slots<G, PosT, DSA>(p, t, t, (i64)dt, blk, goff, ginb, err);
            kv_st(p.seq_lens_kv + t, kv_sat_add(dt, 1));
            kv_st(p.cu_seqlens_q + t, t);
        } else if (t < capacity) {
            kv_store_pad_token<G, PosT, DSA>(p, t);
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
    if (t < capacity && t >= end_tok) kv_store_pad_token<G, PosT, DSA>(p, t);
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
        kv_row_addrs<G>(p, lo, row2);
        kv_load_block_ids<G>(p, dv, row2, pos, true, b2, o2, n2);
        kv_store_token_slots<G, PosT, DSA>(p, t, lo, pos, b2, o2, n2, err);
    }
}

// The step across blocks' token blocks with their error records.
template <int G, typename PosT, int R, bool DSA>
__device__ __forceinline__ void kv_wide_tokens_records(const KvStepParams& p) {
    const int tid = threadIdx.x, warp = tid >> 5, T = blockDim.x;
    KvErr err;
    err.mask = 0u;
    err.key = KV_NO_ERROR;
    kv_wide_tokens<G, PosT, R, DSA>(p, err);
    // Errors: warp w of block k merges into record k * (T / 32) + w, only with an error (sticky).
    kv_merge_record(p.error_records, (i64)blockIdx.x * (T >> 5) + warp, err);
}

// ---- the kernels of the small and wide steps ----

// The small-batch step: <<<ceil(C / T), T>>>, T <= KV_SB_THREADS, one parameter.
template <int G, typename PosT, bool DSA = false>
__global__ void __launch_bounds__(DSA ? KV_DSA_SMALL_THREADS : KV_SB_THREADS, 1) step_small(const KvStepParams params) {
    if (DSA && blockIdx.y != 0) {  // the DSA blocks (dsa_step.cuh): the second grid row (DSA kernels only)
        kv_dsa_block(params);
        return;
    }
    KvStepParams r;
    kv_params_in_registers<G, DSA>(params, r);
    kv_small_tokens<G, PosT, DSA>(r);
}

// The small-batch step with attention outputs: <<<ceil(C / T) + M, T>>> (T <= KV_THREADS). A
// block is a metadata block (kv_meta_small) iff blockIdx.x * T >= C (no division on the token
// blocks' path); the token blocks are step_small's.
template <int G, typename PosT, bool DSA = false>
__global__ void __launch_bounds__(KV_THREADS, 1) step_small_attention(const KvStepParams params) {
    if (DSA && blockIdx.y != 0) {  // the DSA blocks (dsa_step.cuh): the second grid row (DSA kernels only)
        kv_dsa_block(params);
        return;
    }
    const unsigned int T = blockDim.x, C = (unsigned int)params.capacity;  // C <= 2^31 - 2: C + T - 1 < 2^32
    if ((u64)blockIdx.x * T >= C) {
        kv_meta_small<G>(params);
        return;
    }
    KvStepParams r;
    kv_params_in_registers<G, DSA>(params, r);
    kv_small_tokens<G, PosT, DSA>(r);
}

// The step across blocks: <<<ceil(C / T), T>>>, T <= KV_W_MAX / R, one parameter; the planner runs
// it for one_block_max_requests < bsz <= wide_max_requests without attention outputs.
template <int G, typename PosT, int R, bool DSA = false>
__global__ void __launch_bounds__(DSA ? KV_DSA_SMALL_THREADS : KV_W_MAX / R, 1) step_wide(const KvStepParams params) {
    if (DSA && blockIdx.y != 0) {  // the DSA blocks (dsa_step.cuh): the second grid row (DSA kernels only)
        kv_dsa_block(params);
        return;
    }
    KvStepParams r;
    kv_params_in_registers<G, DSA>(params, r);
    kv_wide_tokens_records<G, PosT, R, DSA>(r);
}

// The step across blocks with attention outputs (R = 4): <<<ceil(C / T) + M, T>>>,
// T <= KV_W_MAX / 4. A block is a metadata block (kv_meta_wide) iff blockIdx.x * T >= C (no
// division on the token blocks' path); the token blocks are step_wide<G, PosT, 4>'s.
template <int G, typename PosT, bool DSA = false>
__global__ void __launch_bounds__(KV_W_MAX / 4, 1) step_wide_attention(const KvStepParams params) {
    if (DSA && blockIdx.y != 0) {  // the DSA blocks (dsa_step.cuh): the second grid row (DSA kernels only)
        kv_dsa_block(params);
        return;
    }
    const unsigned int T = blockDim.x, C = (unsigned int)params.capacity;
    if ((u64)blockIdx.x * T >= C) {
        kv_meta_wide<G, 4>(params);
        return;
    }
    KvStepParams r;
    kv_params_in_registers<G, DSA>(params, r);
    kv_wide_tokens_records<G, PosT, 4, DSA>(r);
}
