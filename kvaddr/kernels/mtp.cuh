// Every MTP substep's addressing in one launch (docs/spec-decode.md, "FastDeploy MTP";
// kvaddr/spec_reference.py is the oracle). After a verify step the draft model runs k substeps:
// substep 0 runs the accepted tokens (seq_lens_this_time = accept_num) over seq_lens_decoder,
// substep j >= 1 one token per request with accept_num > 0 over seq_lens_decoder + accept_num +
// j - 1 (saturating at 2^31 - 1), none for the others (a negative accept_num is passed through).
// Each substep's outputs are exactly the core step's (step.cuh) for those lengths, attention
// metadata included when asked for, written into persistent buffers with a leading [k] dimension.
//
// Grid (chunks, k), KV_THREADS threads: block (x, j) owns requests [x rq, (x + 1) rq) of substep j
// (rq = ceil((bsz + 1) / chunks) rounded up to a multiple of 4, so int4 loads stay aligned; the
// last blocks may own none): their per-request outputs and their tokens. It scans a window of
// requests holding its own: the whole batch when it fits in one tile of KV_MTP_TILE, else one
// tile around its range (its range itself, tile by tile, when rq exceeds a tile). A block scan
// costs the same for a few requests as for a tile, so a mid-size batch (up to a tile) is one load
// round trip and one scan per block, with no pass over other requests. Past a tile the block
// needs only sums of the requests outside its window: their token (and, when asked for,
// kv-length and page) prefix before it, their totals after it (the padding of its token range
// [x KV_THREADS, (x + 1) KV_THREADS) starts at the total) and their maxima. It sums them in one
// pass of independent loads (several tiles in flight, the window's first tile loading meanwhile)
// and one block reduction (kv_mtp_others), so no block waits for another. A tile of at most 128
// requests is scanned by warp 0 alone (no barrier). The block's tokens of a tile are written after
// the barrier (which also votes whether there are any) one per thread, its request found by a
// binary search of the block's part of the tile's prefix (int32 keys); a block holding more
// tokens than threads (a request range is not cut to fit KV_THREADS tokens) writes them two per
// thread per round, tokens t and t + KV_THREADS (the second's search starting at the request of
// the round's token t + KV_THREADS - 1, shared after one barrier), their block ids loaded side by
// side, so it waits for one chain of loads, not two; a thread never writes
// another's requests' tokens in turn. A token's block index is a multiply by the reciprocal of
// the block size computed once per launch (kv_mtp_divmod). The block owning request bsz writes the
// totals (num_tokens, the prefix sums' last entries, the maxima). A
// substep's lengths are derived from (seq_lens_decoder, accept_num) as they are loaded. The sums
// are int64 (exact) and saturated at 2^31 - 1 where they are stored, as the reference does.
// Errors go to record (j * chunks + x) * KV_WARPS + warp, with the core step's
// keys (token, request, cache, bit); reading them gives the OR of every substep's bits and the
// smallest key of all.

#define KV_MTP_ITEMS 4                              // requests per thread per tile
#define KV_MTP_TILE (KV_THREADS * KV_MTP_ITEMS)     // requests per tile

// The MTP launch's one parameter, passed by value. Mirrored by kvaddr/kernel_loader.py's
// MtpParams. `step` holds substep 0's output pointers (each output is [k, ...] with the strides
// below), the tables, block sizes, bsz, capacity, num_caches and the attention fields; its
// seq_lens_this_time is unused (accept_num replaces it) and its tile fields are unused.
struct KvMtpParams {
    KvStepParams step;           // as for the core step; outputs point at substep 0's rows
    const int* accept_num;       // [bsz], int32: tokens each request accepted (0 for an idle slot)
    int num_substeps;            // k, int32 >= 1: gridDim.y
    int max_requests;            // int32: M; cu_seqlens_q / cu_seqlens_k rows are M + 1 apart,
                                 // seq_lens_kv rows M apart
};

// Block-wide exclusive sum of one int64 value per thread (KV_THREADS threads); *total gets the
// block's sum. One barrier, a second one after it when `again` (the caller scans into the same
// `warp_sums`, shared scratch of KV_WARPS entries, before its next barrier). `narrow` (uniform:
// every nonzero value is in warp 0): a warp scan and no barrier; the total is then right in warp
// 0 only (its thread 0 publishes it in shared memory for the others).
__device__ __forceinline__ i64 kv_mtp_block_scan(i64 x, i64* warp_sums, i64& total, bool narrow, bool again) {
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    i64 inc = x;
#pragma unroll
    for (int off = 1; off < 32; off <<= 1) {
        const i64 y = __shfl_up_sync(0xffffffffu, inc, off);
        if (lane >= off) inc += y;
    }
    if (narrow) {
        total = __shfl_sync(0xffffffffu, inc, 31);
        return inc - x;
    }
    if (lane == 31) warp_sums[warp] = inc;
    __syncthreads();
    i64 before = 0, all = 0;
#pragma unroll
    for (int w = 0; w < KV_WARPS; ++w) {
        const i64 v = warp_sums[w];
        if (w < warp) before += v;
        all += v;
    }
    if (again) __syncthreads();  // warp_sums is rewritten by the next scan
    total = all;
    return before + inc - x;
}

// Substep j's lengths of a request whose draft model holds d tokens and accepted a.
__device__ __forceinline__ void kv_mtp_lengths(int d, int a, int j, int& dj, int& qj) {
    if (j == 0) {
        dj = d;
        qj = a;
    } else if (a > 0) {
        const i64 v = (i64)d + (i64)a + (i64)(j - 1);
        dj = (int)(v < (i64)KV_INT_MAX ? v : (i64)KV_INT_MAX);
        qj = 1;
    } else {
        dj = d;
        qj = a < 0 ? a : 0;
    }
}

// Requests [4 tid, 4 tid + 4) of the tile at `base` holding `count` requests: their raw
// seq_lens_decoder and accept_num (0 past count); one int4 load each when `vec` (both arrays
// 16-byte aligned; base is a multiple of 4) and all four are in the tile.
__device__ __forceinline__ void kv_mtp_load(const int* __restrict__ dec, const int* __restrict__ acc, int base,
                                            int count, bool vec, int (&d)[KV_MTP_ITEMS], int (&a)[KV_MTP_ITEMS]) {
    static_assert(KV_MTP_ITEMS == 4, "one int4 per thread and array");
    const int k0 = threadIdx.x * KV_MTP_ITEMS;
    if (vec && k0 + KV_MTP_ITEMS <= count) {
        const int4 dv = *reinterpret_cast<const int4*>(dec + base + k0);
        const int4 av = *reinterpret_cast<const int4*>(acc + base + k0);
        d[0] = dv.x; d[1] = dv.y; d[2] = dv.z; d[3] = dv.w;
        a[0] = av.x; a[1] = av.y; a[2] = av.z; a[3] = av.w;
        return;
    }
#pragma unroll
    for (int u = 0; u < KV_MTP_ITEMS; ++u) {
        const bool in = k0 + u < count;
        d[u] = in ? dec[base + k0 + u] : 0;
        a[u] = in ? acc[base + k0 + u] : 0;
    }
}

__device__ __forceinline__ int kv_mtp_sat(i64 v) { return (int)(v < (i64)KV_INT_MAX ? v : (i64)KV_INT_MAX); }

// The other requests' sums of a block (kv_mtp_others): entries of one int64 array per thread.
#define KV_MTP_NB 0                       // tokens of the requests before the window (w_lo)
#define KV_MTP_NA 1                       // tokens of the requests from w_hi on
#define KV_MTP_KB 2                       // varlen: kv lengths of the requests before w_lo
#define KV_MTP_PB 3                       // flashinfer: pages of cache g before w_lo (+ g)
#define KV_MTP_PA (3 + KV_MAX_CACHES)     // flashinfer: pages of cache g from w_hi on (+ g)
#define KV_MTP_MQ (3 + 2 * KV_MAX_CACHES) // varlen: the largest token count
#define KV_MTP_MK (4 + 2 * KV_MAX_CACHES) // varlen: the largest kv length
#define KV_MTP_NRED (5 + 2 * KV_MAX_CACHES)
#define KV_MTP_UNROLL 4                   // tiles whose loads are in flight at once in that pass

struct KvMtpShared {
    i64 cu[KV_MTP_TILE + 1];   // token prefix (int64, true sums) of the tile's requests, then its end
    i64 pg[KV_MTP_TILE + 1];   // one cache's page prefix of the tile's requests, then its end
    int dec[KV_MTP_TILE];      // substep seq_lens_decoder (-1 for a bad request)
    int lo_mid[2];             // a two-token round's request of its thread KV_THREADS - 1's first token
                               // (by round parity)
    int cq[KV_MTP_TILE];       // the block's requests' cu saturated to int32 (the token searches' keys:
                               // a token t < C <= 2^31 - 1 has cu <= t exactly when sat(cu) <= t)
    i64 warp_sums[2][KV_WARPS];  // block scans' scratch: [0] tokens, pages; [1] kv lengths
    i64 end_k;                 // varlen: the kv-length prefix after the tile
    i64 red[KV_MTP_NRED][KV_WARPS];  // per-warp partials of kv_mtp_others
};

// Whether entry v of the others' sums is in use (the others are left 0).
__device__ __forceinline__ bool kv_mtp_used(int v, bool varlen, bool fi, int G) {
    if (v <= KV_MTP_NA) return true;
    if (v == KV_MTP_KB || v >= KV_MTP_MQ) return varlen;
    return fi && ((v - KV_MTP_PB) % KV_MAX_CACHES) < G;
}

// The sums of the requests outside [w_lo, w_hi) in o (every thread gets the block's values): one
// pass of independent loads (KV_MTP_UNROLL tiles in flight; nothing waits on a barrier or on
// another block), then one block reduction (one barrier). A substep's lengths are derived from
// (seq_lens_decoder, accept_num) as they are loaded, a bad request counts 0 as in the scan.
__device__ __forceinline__ void kv_mtp_others(const int* __restrict__ dec, const int* __restrict__ acc, int bsz,
                                              int w_lo, int w_hi, int j, bool vec, bool varlen, bool fi, int G,
                                              const KvCaches& c, KvMtpShared& s, i64 (&o)[KV_MTP_NRED]) {
    const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
    for (int base0 = 0; base0 < bsz; base0 += KV_MTP_UNROLL * KV_MTP_TILE) {
        int od[KV_MTP_UNROLL][KV_MTP_ITEMS], oa[KV_MTP_UNROLL][KV_MTP_ITEMS];
#pragma unroll
        for (int w = 0; w < KV_MTP_UNROLL; ++w) {
            const int base = base0 + w * KV_MTP_TILE;
            kv_mtp_load(dec, acc, base, min(KV_MTP_TILE, bsz - base), vec, od[w], oa[w]);
        }
        int ol[KV_MTP_UNROLL][KV_MTP_ITEMS];  // kv length of each counted request (0 for the others)
#pragma unroll
        for (int w = 0; w < KV_MTP_UNROLL; ++w) {
#pragma unroll
            for (int u = 0; u < KV_MTP_ITEMS; ++u) {
                const int b = base0 + w * KV_MTP_TILE + tid * KV_MTP_ITEMS + u;
                ol[w][u] = 0;
                if (b < bsz && (b < w_lo || b >= w_hi)) {
                    int dj, qj;
                    kv_mtp_lengths(od[w][u], oa[w][u], j, dj, qj);
                    const bool bad = (dj < 0) | (qj < 0);
                    const int n = bad ? 0 : qj, L = bad ? 0 : kv_sat_add_nn(dj, qj);
                    const bool before = b < w_lo;
                    ol[w][u] = L;
                    if (before) o[KV_MTP_NB] += n; else o[KV_MTP_NA] += n;
                    if (varlen) {
                        if (before) o[KV_MTP_KB] += L;
                        o[KV_MTP_MQ] = max(o[KV_MTP_MQ], (i64)n);
                        o[KV_MTP_MK] = max(o[KV_MTP_MK], (i64)L);
                    }
                }
            }
        }
        // the page sums in a loop of their own, so a launch without them runs no code around them
        if (fi) {
#pragma unroll
            for (int g = 0; g < KV_MAX_CACHES; ++g) {
                if (g < G) {
#pragma unroll
                    for (int w = 0; w < KV_MTP_UNROLL; ++w) {
#pragma unroll
                        for (int u = 0; u < KV_MTP_ITEMS; ++u) {
                            const int b = base0 + w * KV_MTP_TILE + tid * KV_MTP_ITEMS + u;
                            const int pgs = kv_pages(ol[w][u], c.bs[g]);  // 0 for a request not counted
                            if (b < w_lo) o[KV_MTP_PB + g] += pgs; else o[KV_MTP_PA + g] += pgs;
                        }
                    }
                }
            }
        }
    }
#pragma unroll
    for (int v = 0; v < KV_MTP_NRED; ++v) {
        if (!kv_mtp_used(v, varlen, fi, G)) continue;  // uniform
        const bool mx = v >= KV_MTP_MQ;
        i64 x = o[v];
#pragma unroll
        for (int off = 16; off > 0; off >>= 1) {
            const i64 y = __shfl_xor_sync(0xffffffffu, x, off);
            x = mx ? max(x, y) : x + y;
        }
        if (lane == 0) s.red[v][warp] = x;
    }
    __syncthreads();
#pragma unroll
    for (int v = 0; v < KV_MTP_NRED; ++v) {
        if (!kv_mtp_used(v, varlen, fi, G)) continue;
        const bool mx = v >= KV_MTP_MQ;
        i64 x = 0;
#pragma unroll
        for (int w = 0; w < KV_WARPS; ++w) x = mx ? max(x, s.red[v][w]) : x + s.red[v][w];
        o[v] = x;
    }
}

// pos / B and pos % B as kv_divmod, given m = floor((2^32 - 1) / B) (computed once per launch):
// for pos < 2^31 the estimate umulhi(pos, m) is the quotient or one less (the error pos (2^32 -
// m B) / (B 2^32) is below 1 / 2) and one correction makes it exact, so a token's block index
// costs a multiply instead of a division's dependent chain.
__device__ __forceinline__ void kv_mtp_divmod(i64 pos, int B, unsigned int m, i64& idx, i64& off) {
    if (pos <= KV_INT_MAX) {
        const unsigned int p = (unsigned int)pos, b = (unsigned int)B;
        unsigned int q = __umulhi(p, m), r = p - q * b;
        if (r >= b) {
            ++q;
            r -= b;
        }
        idx = q;
        off = r;
    } else {
        idx = pos / B;
        off = pos - idx * B;
    }
}

// kv_load_blocks and kv_store_token (step.cuh) with kv_mtp_divmod: the same loads, values and errors.
__device__ __forceinline__ void kv_mtp_load_blocks(int b, i64 pos, const KvCaches& c,
                                                   const unsigned int (&m)[KV_MAX_CACHES], int num_caches,
                                                   int (&blk)[KV_MAX_CACHES]) {
#pragma unroll
    for (int g = 0; g < KV_MAX_CACHES; ++g) {
        blk[g] = -1;
        if (g < num_caches) {
            i64 idx, off;
            kv_mtp_divmod(pos, c.bs[g], m[g], idx, off);
            if (idx < c.width[g]) blk[g] = c.table[g][(i64)b * c.stride[g] + idx];
        }
    }
}

template <typename PosT>
__device__ __forceinline__ void kv_mtp_store_token(int t, int b, i64 pos, const int (&blk)[KV_MAX_CACHES],
                                                   const KvCaches& c, const unsigned int (&m)[KV_MAX_CACHES],
                                                   int num_caches, int capacity, int* __restrict__ batch_out,
                                                   PosT* __restrict__ pos_out, i64* __restrict__ slot_out,
                                                   KvErr& err) {
    batch_out[t] = b;
    pos_out[t] = (PosT)pos;
#pragma unroll
    for (int g = 0; g < KV_MAX_CACHES; ++g) {
        if (g < num_caches) {
            i64 idx, off, slot = -1;
            kv_mtp_divmod(pos, c.bs[g], m[g], idx, off);
            if (idx >= c.width[g]) err.flag(KV_ERR_BLOCK_INDEX, t, b, g);
            else if (blk[g] < 0) err.flag(KV_ERR_NEGATIVE_BLOCK, t, b, g);
            else slot = (i64)blk[g] * c.bs[g] + off;
            slot_out[(i64)g * capacity + t] = slot;
        }
    }
}

template <typename PosT>
__global__ void __launch_bounds__(KV_THREADS, 1) mtp_step(const KvMtpParams params) {
    __shared__ KvMtpShared s;
    const KvStepParams& p = params.step;
    const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
    const int x = blockIdx.x, chunks = gridDim.x, j = blockIdx.y;
    const int bsz = p.bsz, C = p.capacity, G = p.num_caches, M = params.max_requests;
    const int flags = p.attention, N = p.kv_indices_capacity, AS = p.attn_stride;
    const bool fi = (flags & KV_ATTN_FLASHINFER) != 0, varlen = (flags & KV_ATTN_VARLEN) != 0;
    const bool rows = (flags & (KV_ATTN_FLASHINFER | KV_ATTN_PAGE_TABLE)) != 0;
    const int* __restrict__ dec_in = p.seq_lens_decoder;
    const int* __restrict__ acc_in = params.accept_num;
    // substep j's rows of every output
    int* __restrict__ cu_out = p.cu_seqlens_q + (i64)j * (M + 1);
    int* __restrict__ batch_out = p.batch_id_per_token + (i64)j * C;
    PosT* __restrict__ pos_out = reinterpret_cast<PosT*>(p.position_ids) + (i64)j * C;
    int* __restrict__ kv_out = p.seq_lens_kv + (i64)j * M;
    i64* __restrict__ slot_out = p.slot_mapping + (i64)j * G * C;
    KvCaches c;
#pragma unroll
    for (int g = 0; g < KV_MAX_CACHES; ++g) {
        c.table[g] = p.block_tables[g];
        c.stride[g] = p.table_stride[g];
        c.width[g] = p.max_blocks[g];
        c.bs[g] = p.block_size[g];
    }
    unsigned int bm[KV_MAX_CACHES];  // floor((2^32 - 1) / B) of each cache (kv_mtp_divmod)
#pragma unroll
    for (int g = 0; g < KV_MAX_CACHES; ++g) bm[g] = g < G ? 0xffffffffu / (unsigned int)c.bs[g] : 0u;
    KvErr err;
    err.mask = 0u;
    err.key = KV_NO_ERROR;
    // requests whose outputs and tokens this block writes: [r_lo, r_hi), rq a multiple of 4 (int4 loads)
    const int rq = ((bsz + 1 + chunks - 1) / chunks + 3) & ~3;
    const int r_lo = min(x * rq, bsz + 1), r_hi = min(r_lo + rq, bsz + 1), hi = min(r_hi, bsz);
    // The requests this block scans, [w_lo, w_hi): the whole batch when it fits in one tile (its
    // loads then wait for nothing), else one tile holding [r_lo, hi) (its own range and more when
    // rq exceeds a tile). A block scan costs the same for a few requests as for a tile, so
    // scanning the others of the window replaces their pass of kv_mtp_others; w_lo is a multiple
    // of 4 (int4 loads).
    int w_lo = 0, w_hi = bsz;
    if (bsz > KV_MTP_TILE) {  // uniform
        w_lo = min(r_lo, (bsz - KV_MTP_TILE + 3) & ~3);
        w_hi = min(bsz, max(hi, w_lo + KV_MTP_TILE));
    }
    const bool vec = ((reinterpret_cast<u64>(dec_in) | reinterpret_cast<u64>(acc_in)) & 15ULL) == 0ULL;

    // the other requests' sums: the prefixes before w_lo, the totals from w_hi on, the maxima
    i64 o[KV_MTP_NRED];
#pragma unroll
    for (int v = 0; v < KV_MTP_NRED; ++v) o[v] = 0;
    // The window, tile by tile: raw lengths loaded one tile ahead, so a tile's loads fly while
    // the one before is scanned (the first tile's during the others' pass).
    int rd[KV_MTP_ITEMS], ra[KV_MTP_ITEMS];
    if (w_lo < w_hi) kv_mtp_load(dec_in, acc_in, w_lo, min(KV_MTP_TILE, w_hi - w_lo), vec, rd, ra);
    if (w_lo > 0 || w_hi < bsz) kv_mtp_others(dec_in, acc_in, bsz, w_lo, w_hi, j, vec, varlen, fi, G, c, s, o);

    i64 carry = o[KV_MTP_NB], carry_k = o[KV_MTP_KB];
    i64 carry_pg[KV_MAX_CACHES];
#pragma unroll
    for (int g = 0; g < KV_MAX_CACHES; ++g) carry_pg[g] = o[KV_MTP_PB + g];
    int max_q = 0, max_k = 0;
    for (int base = w_lo; base < w_hi; base += KV_MTP_TILE) {
        const int count = min(KV_MTP_TILE, w_hi - base);
        const bool narrow = count <= 32 * KV_MTP_ITEMS;  // the tile's requests are all in warp 0
        // this block's requests in the tile: [k_lo, k_hi) (tile indices)
        const int k_lo = min(max(r_lo - base, 0), count), k_hi = max(min(hi - base, count), k_lo);
        int cd[KV_MTP_ITEMS], ca[KV_MTP_ITEMS];
#pragma unroll
        for (int u = 0; u < KV_MTP_ITEMS; ++u) {
            cd[u] = rd[u];
            ca[u] = ra[u];
        }
        if (base + KV_MTP_TILE < w_hi)
            kv_mtp_load(dec_in, acc_in, base + KV_MTP_TILE, min(KV_MTP_TILE, w_hi - base - KV_MTP_TILE), vec, rd, ra);
        int d[KV_MTP_ITEMS], n[KV_MTP_ITEMS], L[KV_MTP_ITEMS];
        i64 sum = 0, sum_k = 0;
#pragma unroll
        for (int u = 0; u < KV_MTP_ITEMS; ++u) {
            const int k = tid * KV_MTP_ITEMS + u;
            d[u] = -1;
            n[u] = 0;
            L[u] = 0;
            if (k < count) {
                int dj, qj;
                kv_mtp_lengths(cd[u], ca[u], j, dj, qj);
                const bool bad = (dj < 0) | (qj < 0);
                d[u] = bad ? -1 : dj;
                n[u] = bad ? 0 : qj;
                L[u] = bad ? 0 : kv_sat_add_nn(dj, qj);
                max_k = max(max_k, L[u]);
            }
            sum += n[u];
            sum_k += L[u];
        }
        bool searched = false;  // this thread holds one of the block's requests with tokens
#pragma unroll
        for (int u = 0; u < KV_MTP_ITEMS; ++u) {
            const int k = tid * KV_MTP_ITEMS + u;
            if (k >= k_lo && k < k_hi && n[u] > 0) searched = true;
        }
        i64 total;
        const i64 ex = carry + kv_mtp_block_scan(sum, s.warp_sums[0], total, narrow, false);
        i64 ex_k = 0, total_k = 0;
        if (varlen) ex_k = carry_k + kv_mtp_block_scan(sum_k, s.warp_sums[1], total_k, narrow, false);
        {
            i64 run = ex, run_k = ex_k;
#pragma unroll
            for (int u = 0; u < KV_MTP_ITEMS; ++u) {
                const int k = tid * KV_MTP_ITEMS + u;
                if (k < count) {
                    const int b = base + k;
                    s.cu[k] = run;
                    s.dec[k] = d[u];
                    const int cs = kv_mtp_sat(run), ce = kv_mtp_sat(run + n[u]);
                    max_q = max(max_q, ce - cs);
                    if (k >= k_lo && k < k_hi) {  // this block's request: its outputs and checks
                        s.cq[k] = cs;
                        cu_out[b] = cs;
                        kv_out[b] = L[u];
                        if (d[u] < 0) err.flag(KV_ERR_NEGATIVE_LENGTH, cs, b, 0);
                        if (run <= (i64)C && (i64)C < run + n[u]) err.flag(KV_ERR_CAPACITY, C, b, 0);
                        if (varlen) p.cu_seqlens_k[(i64)j * (M + 1) + b] = kv_mtp_sat(run_k);
                    }
                    run += n[u];
                    run_k += L[u];
                }
            }
        }
        if (tid == 0) {  // thread 0 has the totals (also of a narrow scan)
            s.cu[count] = carry + total;
            s.end_k = carry_k + total_k;
        }
        const bool search = __syncthreads_or(searched) != 0;
        const i64 tile_end = s.cu[count], tile_end_k = s.end_k;
        // The block's tokens of the tile (below the capacity), [cu[k_lo], cu[k_hi]), each finding
        // its request by a binary search of [k_lo, k_hi). At most KV_THREADS of them (uniform): one
        // per thread, one search (one shared load a step). More: two per thread per round (tokens
        // t0 and t0 + KV_THREADS), the two searches and the two tokens' block-id loads side by
        // side, so a block with more tokens than threads (a request range is not cut to fit
        // KV_THREADS tokens) waits for one chain of loads, not two.
        if (search) {
            const i64 t_first = s.cu[k_lo], t_last = s.cu[k_hi];
            const i64 t_end = t_last < (i64)C ? t_last : (i64)C;
            const int span = k_hi - k_lo;  // >= 1: a thread voted
            // steps top, top / 2, .., 1 with top the largest power of two <= span - 1 (none when
            // span is 1): they reach offsets up to 2 top - 1 >= span - 1
            const int top = span > 1 ? 1 << (31 - __clz(span - 1)) : 0;
            if (t_end - t_first <= (i64)KV_THREADS) {  // uniform
                const i64 t0 = t_first + tid;
                if (t0 < t_end) {
                    // largest k in [k_lo, k_hi) with cu[k] <= t0 (cu[k_lo] <= t0)
                    const int q0 = (int)t0;  // < C
                    int lo0 = k_lo;
                    for (int step = top; step > 0; step >>= 1) {
                        const int m0 = lo0 + step;
                        if (m0 < k_hi && s.cq[m0] <= q0) lo0 = m0;
                    }
                    const i64 pos0 = (i64)s.dec[lo0] + (t0 - s.cu[lo0]);
                    int blk0[KV_MAX_CACHES];
                    kv_mtp_load_blocks(base + lo0, pos0, c, bm, G, blk0);
                    kv_mtp_store_token<PosT>((int)t0, base + lo0, pos0, blk0, c, bm, G, C, batch_out, pos_out,
                                             slot_out, err);
                }
            } else {
                // rounds of 2 KV_THREADS tokens (a uniform count): t0 = first + tid, t1 = t0 +
                // KV_THREADS. t0's search as above; t1 is past every thread's t0, so its request is
                // at or after that of thread KV_THREADS - 1's t0 (published in shared memory, one
                // barrier), and its search covers only [that request, k_hi): a few steps when the
                // block holds a few more tokens than threads
                int round = 0;
                for (i64 r0 = t_first; r0 < t_end; r0 += 2 * KV_THREADS, ++round) {
                    const i64 t0 = r0 + tid, t1 = t0 + KV_THREADS;
                    const bool one = t0 < t_end, two = t1 < t_end;  // two: one as well
                    int lo0 = k_lo;
                    if (one) {
                        const int q0 = (int)t0;
                        for (int step = top; step > 0; step >>= 1) {
                            const int m0 = lo0 + step;
                            if (m0 < k_hi && s.cq[m0] <= q0) lo0 = m0;
                        }
                    }
                    if (tid == KV_THREADS - 1) s.lo_mid[round & 1] = lo0;  // k_lo without a token: no t1 then
                    __syncthreads();  // (a round's parity slot is rewritten two rounds on, past this barrier)
                    int lo1 = s.lo_mid[round & 1];
                    if (two) {
                        const int q1 = (int)t1, span1 = k_hi - lo1;
                        for (int step = span1 > 1 ? 1 << (31 - __clz(span1 - 1)) : 0; step > 0; step >>= 1) {
                            const int m1 = lo1 + step;
                            if (m1 < k_hi && s.cq[m1] <= q1) lo1 = m1;
                        }
                    }
                    if (one) {
                        const i64 pos0 = (i64)s.dec[lo0] + (t0 - s.cu[lo0]);
                        const i64 pos1 = (i64)s.dec[lo1] + (t1 - s.cu[lo1]);
                        int blk0[KV_MAX_CACHES], blk1[KV_MAX_CACHES];
                        kv_mtp_load_blocks(base + lo0, pos0, c, bm, G, blk0);
                        if (two) kv_mtp_load_blocks(base + lo1, pos1, c, bm, G, blk1);
                        kv_mtp_store_token<PosT>((int)t0, base + lo0, pos0, blk0, c, bm, G, C, batch_out, pos_out,
                                                 slot_out, err);
                        if (two)
                            kv_mtp_store_token<PosT>((int)t1, base + lo1, pos1, blk1, c, bm, G, C, batch_out,
                                                     pos_out, slot_out, err);
                    }
                }
            }
        }
        // attention rows of every cache: page prefixes, last-page lengths, row checks, kv_indices
        if (rows) {
#pragma unroll
            for (int g = 0; g < KV_MAX_CACHES; ++g) {
                if (g < G) {
                    const int B = c.bs[g], W = c.width[g];
                    int pages[KV_MTP_ITEMS];
                    i64 psum = 0;
#pragma unroll
                    for (int u = 0; u < KV_MTP_ITEMS; ++u) {
                        pages[u] = kv_pages(L[u], B);
                        psum += pages[u];
                    }
                    i64 ptotal;
                    i64 prun = carry_pg[g] + kv_mtp_block_scan(psum, s.warp_sums[0], ptotal, narrow, false);
#pragma unroll
                    for (int u = 0; u < KV_MTP_ITEMS; ++u) {
                        const int k = tid * KV_MTP_ITEMS + u;
                        if (k < count) {
                            const int b = base + k;
                            s.pg[k] = prun;
                            if (k >= k_lo && k < k_hi) {
                                const int first = kv_mtp_sat(s.cu[k]);
                                if (pages[u] > W) err.flag(KV_ERR_BLOCK_INDEX, first, b, g);
                                if (fi) {
                                    const i64 row = (i64)j * G * AS + (i64)g * AS;
                                    p.kv_indptr[row + b] = kv_mtp_sat(prun);
                                    p.kv_last_page_len[row + b] = L[u] > 0 ? (L[u] - 1) % B + 1 : 0;
                                    if (prun + pages[u] > (i64)N) err.flag(KV_ERR_KV_INDICES_CAPACITY, first, b, g);
                                }
                            }
                            prun += pages[u];
                        }
                    }
                    if (tid == 0) s.pg[count] = carry_pg[g] + ptotal;
                    __syncthreads();
                    if (fi) {  // the block's requests' rows, request k on warp (k - k_lo) % KV_WARPS
                        int* __restrict__ idx_out = p.kv_indices + (i64)j * G * N + (i64)g * N;
                        const int* __restrict__ table = c.table[g];
                        for (int k = k_lo + warp; k < k_hi; k += KV_WARPS) {
                            const int b = base + k;
                            const i64 start = s.pg[k], np = s.pg[k + 1] - start;
                            const int first = kv_mtp_sat(s.cu[k]);
                            for (i64 e = lane; e < np && start + e < (i64)N; e += 32) {
                                int v = -1;
                                if (e < (i64)W) {
                                    v = table[(i64)b * c.stride[g] + e];
                                    if (v < 0) err.flag(KV_ERR_NEGATIVE_BLOCK, first, b, g);
                                }
                                idx_out[start + e] = v < 0 ? -1 : v;
                            }
                        }
                    }
                    carry_pg[g] = s.pg[count];
                    __syncthreads();  // s.pg is rewritten by the next cache
                }
            }
        }
        carry = tile_end;
        carry_k = tile_end_k;
        if (base + KV_MTP_TILE < w_hi) __syncthreads();  // s.cu, s.dec: rewritten by the next tile
    }
    const i64 n_total = carry + o[KV_MTP_NA];  // every request's tokens (int64, true sum)
    const bool tail = bsz >= r_lo && bsz < r_hi;  // this block owns request bsz: the totals are its
    // padding tokens of this block's token range [x KV_THREADS, (x + 1) KV_THREADS)
    const int t = x * KV_THREADS + tid;
    if (t < C && (i64)t >= n_total) kv_write_pad<PosT>(t, G, C, batch_out, pos_out, slot_out);
    // the end entries of the prefix sums (request bsz; nothing follows it, so carry is the total)
    if (tail && tid == 0) {
        cu_out[bsz] = kv_mtp_sat(carry);
        if (varlen) p.cu_seqlens_k[(i64)j * (M + 1) + bsz] = kv_mtp_sat(carry_k);
        if (fi) {
#pragma unroll
            for (int g = 0; g < KV_MAX_CACHES; ++g)
                if (g < G) p.kv_indptr[(i64)j * G * AS + (i64)g * AS + bsz] = kv_mtp_sat(carry_pg[g]);
        }
    }
    if (tail && tid == 0) p.num_tokens[j] = (int)(n_total < (i64)C ? n_total : (i64)C);
    // kv_indices past each cache's pages: PAD_PAGE_ID (every entry written every launch)
    if (fi) {
#pragma unroll
        for (int g = 0; g < KV_MAX_CACHES; ++g) {
            if (g < G) {
                const i64 pg_total = carry_pg[g] + o[KV_MTP_PA + g];
                int* __restrict__ idx_out = p.kv_indices + (i64)j * G * N + (i64)g * N;
                for (i64 e = (i64)x * KV_THREADS + tid; e < (i64)N; e += (i64)chunks * KV_THREADS)
                    if (e >= pg_total) idx_out[e] = -1;
            }
        }
    }
    // max_seqlen_q, max_seqlen_k (the tail block): this block's requests' values and the others'
    // maxima. The others' largest token count is their largest cu_seqlens_q difference while the
    // total fits in int32; past it the saturated differences are taken from a scan of them all.
    if (varlen && tail) {
        if (n_total > (i64)KV_INT_MAX) {  // uniform
            max_q = 0;
            o[KV_MTP_MQ] = 0;
            i64 run0 = 0;
            for (int base = 0; base < bsz; base += KV_MTP_TILE) {
                const int count = min(KV_MTP_TILE, bsz - base);
                int cd[KV_MTP_ITEMS], ca[KV_MTP_ITEMS];
                i64 nn[KV_MTP_ITEMS], sum = 0;
                kv_mtp_load(dec_in, acc_in, base, count, vec, cd, ca);
#pragma unroll
                for (int u = 0; u < KV_MTP_ITEMS; ++u) {
                    nn[u] = 0;
                    if (tid * KV_MTP_ITEMS + u < count) {
                        int dj, qj;
                        kv_mtp_lengths(cd[u], ca[u], j, dj, qj);
                        nn[u] = (dj < 0) | (qj < 0) ? 0 : qj;
                    }
                    sum += nn[u];
                }
                i64 total;
                i64 run = run0 + kv_mtp_block_scan(sum, s.warp_sums[0], total, false, true);
#pragma unroll
                for (int u = 0; u < KV_MTP_ITEMS; ++u) {
                    max_q = max(max_q, kv_mtp_sat(run + nn[u]) - kv_mtp_sat(run));
                    run += nn[u];
                }
                run0 += total;
            }
        }
        int mq = max_q, mk = max_k;
#pragma unroll
        for (int off = 16; off > 0; off >>= 1) {  // over the warp, then over the warps
            mq = max(mq, __shfl_xor_sync(0xffffffffu, mq, off));
            mk = max(mk, __shfl_xor_sync(0xffffffffu, mk, off));
        }
        __shared__ int red[2][KV_WARPS];
        if (lane == 0) {
            red[0][warp] = mq;
            red[1][warp] = mk;
        }
        __syncthreads();
        if (tid == 0) {
            for (int w = 1; w < KV_WARPS; ++w) {
                mq = max(mq, red[0][w]);
                mk = max(mk, red[1][w]);
            }
            p.max_seqlen[2 * j] = max(mq, (int)o[KV_MTP_MQ]);
            p.max_seqlen[2 * j + 1] = max(mk, (int)o[KV_MTP_MK]);
        }
    }
    kv_merge_record(p.error_records, ((i64)j * chunks + x) * KV_WARPS + warp, err);
}
