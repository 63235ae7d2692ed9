// DeepSeek-V3.2 sparse attention (DSA) outputs of the core step (docs/dsa.md; kvaddr/reference.py's
// dsa_step_outputs is the oracle), written in the step's own launch when KvStepParams::dsa != 0.
//
// Two parts of the launch write them, each what it already knows:
//
//   * The step's token blocks (step.cuh, the kernels' DSA = true instantiations) write each
//     token's value and scale offsets and ctx where they write its slot: they hold the token's
//     request, position p and slot in the dsa cache (kv_dsa_store_slot). For slot s in cache
//     dsa_cache (blk = s / B, off = s % B):
//       value = blk * B * (V + S) + off * V,  scale = blk * B * (V + S) + B * V + off * S
//     (-1 and -1 when the token's block index is past the row or its block id is negative: the
//     token blocks record those errors as before), ctx = p + 1 (saturating); padding tokens
//     get -1, -1, 0 where the step writes its padding (kv_dsa_store_pad). No load is added.
//   * A second grid row of gridDim.x DSA blocks (gridDim.y = 2; row 0 is the step, whose blocks
//     never see row 1: every gridDim.x and ticket of the step counts row 0 alone) writes what
//     needs the prefills' prefix: ks and ke of every token (0 and 0 for decode tokens and
//     padding) and cu_seq_lens. They read the lengths themselves and wait for no block. Without
//     DSA outputs the grid has one row and the only cost is the blockIdx.y test at entry.
//
// DSA block k owns the tokens [lo, hi) = [k * per, min((k + 1) * per, C)), per = ceil(C / gridDim.x).
//   1. One round trip: thread i loads the r consecutive requests [i * r, i * r + r) of the first
//      tile (r = max(1, min(KV_DSA_R, KV_DSA_TILE / T)), a tile of T * r requests, both lengths,
//      kept for 3) and, past the first tile, seq_lens_this_time alone: a prefill has n >
//      dsa_decode_len, so no such n means no prefill (a bad request with one only takes 3, whose
//      outputs are the same). Those are KV_DSA_VOTE4 16-byte loads a thread a round (the
//      last bsz % 4 requests as scalars in the same round) when the array is 16-byte aligned,
//      else KV_DSA_VOTE scalar loads; every load of the first round is in flight with the first
//      tile's, so batches up to T * (r + 4 * KV_DSA_VOTE4) requests (every kernel's decode batch
//      of up to 4096 requests) take one round trip. A block vote (__syncthreads_or) asks whether
//      any request is a prefill (good, n > dsa_decode_len).
//   2. None (a decode step, plain or MTP): the block writes ks = ke = 0 over [lo, hi), the last
//      block cu_seq_lens = 0, and it is done: no scan, no search.
//   3. Otherwise the block walks the requests a tile at a time (the first tile from the
//      registers of 1, each next tile's loads issued before the current tile's tokens are
//      written, so they fly meanwhile); a block scan of the thread sums gives each request
//      three saturating prefixes, carried from tile to tile: its first token (n, 0 for a bad
//      request), its ks (seq_lens_decoder + n over the prefills before it) and its ordinal among
//      the prefills (where the last block writes cu_seq_lens). Each request's token end,
//      seq_lens_decoder and ks (-1: not a prefill) are staged in shared memory; each token of
//      [lo, hi) that the tile holds finds its request by a binary search of the staged ends and
//      writes ks and ke = ks + p + 1 (0 and 0 for a decode token). A block other than the last
//      stops after the tile that reaches its last token; the last block, whose tokens end the
//      range, walks the whole batch for cu_seq_lens. Tokens [min(total, C), C) of the block get
//      0 and 0; the last block writes cu_seq_lens[P .. max_requests] = the total of the P
//      prefills' seq_lens.
// Every element of every DSA output is written on every launch. Shared memory: the staged tile
// and the block scan's warp totals (12.7 KB: the step kernels' own shared memory and this fit the
// 48 KB of static shared memory).

#define KV_DSA_R 4        // requests a thread holds per tile (8 spills in step_wide_attention's 64 registers)
#define KV_DSA_TILE 1024  // requests per tile at most (the staged ends, lengths and ks)
#define KV_DSA_VOTE 16    // requests a thread loads per round of the vote past the first tile (unaligned)
#define KV_DSA_VOTE4 4    // 16-byte loads (4 requests) a thread issues per round of the vote (aligned)
// The widest block of the DSA instantiations of step_small and step_wide: the dispatch table
// launches them with at most 256 threads (kvaddr/dispatch.py), so their launch bounds leave the
// DSA blocks the registers they need (the kernels without DSA keep theirs).
#define KV_DSA_SMALL_THREADS 256

struct KvDsaShared {
    int end[KV_DSA_TILE];  // the tile's requests: token prefix at their end (saturating)
    int dec[KV_DSA_TILE];  // their seq_lens_decoder
    int ks[KV_DSA_TILE];   // their ks (the prefills' seq_len prefix before them); -1: not a prefill
    int sums[3][32];       // per warp: tokens, prefill seq_lens, prefills
};

// The DSA outputs the step's token writes make (the multi-block step's token path; step_small and
// step_wide read them from their pinned KvStepParams).
struct KvDsaOut {
    i64* value;  // [capacity], int64: dsa_value_offsets
    i64* scale;  // [capacity], int64: dsa_scale_offsets
    int* ctx;    // [capacity], int32: dsa_ctx
    int g;       // the indexer cache's index
    int V, S;    // value and scale bytes per token
};

// Token t's value and scale offsets and ctx (position pos) from its slot in the dsa cache (-1: its
// block index is past the row or its block id is negative) and off = slot % B: blk * B = slot - off.
__device__ __forceinline__ void kv_dsa_store_slot(i64* __restrict__ value, i64* __restrict__ scale,
                                                  int* __restrict__ ctx, int t, i64 pos, i64 slot, i64 off, int B,
                                                  int V, int S) {
    i64 v = -1, s = -1;
    if (slot >= 0) {
        const i64 first = slot - off;  // blk * B
        v = first * ((i64)V + S) + off * V;
        s = first * ((i64)V + S) + (i64)B * V + off * S;
    }
    kv_st(value + t, v);
    kv_st(scale + t, s);
    kv_st(ctx + t, pos + 1 < (i64)KV_INT_MAX ? (int)(pos + 1) : (int)KV_INT_MAX);
}

// A padding token's value and scale offsets and ctx.
__device__ __forceinline__ void kv_dsa_store_pad(i64* __restrict__ value, i64* __restrict__ scale,
                                                 int* __restrict__ ctx, int t) {
    kv_st(value + t, (i64)-1);
    kv_st(scale + t, (i64)-1);
    kv_st(ctx + t, 0);
}

// Load requests [first, first + r) of a tile (0 and 0 past bsz), every load issued before any is used.
__device__ __forceinline__ void kv_dsa_load(const KvStepParams& p, int first, int r, int bsz, int (&d)[KV_DSA_R],
                                            int (&n)[KV_DSA_R]) {
#pragma unroll
    for (int u = 0; u < KV_DSA_R; ++u) {
        d[u] = n[u] = 0;
        if (u < r && first + u < bsz) {
            d[u] = p.seq_lens_decoder[first + u];
            n[u] = p.seq_lens_this_time[first + u];
        }
    }
}

// DSA block blockIdx.x of the grid's second row (see the section comment).
__device__ void kv_dsa_block(const KvStepParams& p) {
    __shared__ KvDsaShared s;
    const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5, T = blockDim.x, warps = T >> 5;
    const int k = blockIdx.x, nb = gridDim.x, last = nb - 1, bsz = p.bsz, C = p.capacity, thr = p.dsa_decode_len;
    const int per = (int)(((i64)C + nb - 1) / nb);
    const int lo = (int)min((i64)k * per, (i64)C), hi = (int)min((i64)lo + per, (i64)C);
    const int r = max(1, min(KV_DSA_R, KV_DSA_TILE / T)), tile = T * r;  // requests per thread, per tile
    int* __restrict__ ks_out = p.dsa_ks;
    int* __restrict__ ke_out = p.dsa_ke;

    // 1. the vote: is any request a prefill? The first tile's lengths (kept for 3) and, past the
    // tile, seq_lens_this_time alone (a prefill has n > dsa_decode_len): 16-byte loads when the
    // array is 16-byte aligned, KV_DSA_VOTE4 of them a thread a round, every load of a round in
    // flight with the first tile's (one round trip up to T * (r + 4 * KV_DSA_VOTE4) requests).
    int d[KV_DSA_R], n[KV_DSA_R];
    kv_dsa_load(p, tid * r, r, bsz, d, n);
    bool any = false;
    const int* __restrict__ nt = p.seq_lens_this_time;
    if ((reinterpret_cast<u64>(nt) & 15ULL) == 0) {
        const int nv = bsz >> 2, nvc = (bsz + 3) >> 2;  // whole groups of 4 requests; with the last part group
        const int4* __restrict__ n4 = reinterpret_cast<const int4*>(nt);
#pragma unroll 1
        for (int v0 = tile >> 2; v0 < nvc; v0 += T * KV_DSA_VOTE4) {  // (tile is a multiple of 4)
            int4 x[KV_DSA_VOTE4];
#pragma unroll
            for (int u = 0; u < KV_DSA_VOTE4; ++u) {
                const int v = v0 + u * T + tid, b = v << 2;
                x[u] = make_int4(0, 0, 0, 0);
                if (v < nv) {
                    x[u] = __ldg(n4 + v);
                } else if (v < nvc) {  // the last bsz % 4 requests, in the same round
                    x[u].x = __ldg(nt + b);
                    if (b + 1 < bsz) x[u].y = __ldg(nt + b + 1);
                    if (b + 2 < bsz) x[u].z = __ldg(nt + b + 2);
                }
            }
#pragma unroll
            for (int u = 0; u < KV_DSA_VOTE4; ++u)
                any |= (x[u].x > thr) | (x[u].y > thr) | (x[u].z > thr) | (x[u].w > thr);
        }
    } else {
#pragma unroll 1
        for (int b0 = tile; b0 < bsz; b0 += T * KV_DSA_VOTE) {
            int x[KV_DSA_VOTE];
#pragma unroll
            for (int u = 0; u < KV_DSA_VOTE; ++u) {
                const int b = b0 + u * T + tid;
                x[u] = b < bsz ? __ldg(nt + b) : 0;
            }
#pragma unroll
            for (int u = 0; u < KV_DSA_VOTE; ++u) any |= x[u] > thr;
        }
    }
#pragma unroll
    for (int u = 0; u < KV_DSA_R; ++u) any |= (d[u] >= 0) & (n[u] > thr);  // (0, 0 past bsz: thr >= 1)
    // 2. a decode step: zeros, no scan
    if (!__syncthreads_or(any)) {
        for (int t = lo + tid; t < hi; t += T) {
            kv_st(ks_out + t, 0);
            kv_st(ke_out + t, 0);
        }
        if (k == last)
            for (int i = tid; i < p.dsa_cu_len; i += T) kv_st(p.dsa_cu_seq_lens + i, 0);
        return;
    }

    // 3. prefills: the tiles, scanned and searched
    int carry_tok = 0, carry_pre = 0, carry_cnt = 0;
#pragma unroll 1
    for (int base = 0; base < bsz; base += tile) {
        if (k != last && (carry_tok >= hi || lo >= hi)) break;  // (uniform) no token of this block left
        int x1 = 0, x2 = 0, x3 = 0;  // this thread's sums
#pragma unroll
        for (int u = 0; u < KV_DSA_R; ++u) {
            const bool bad = (d[u] < 0) | (n[u] < 0);
            const bool pre = !bad && n[u] > thr;
            x1 = kv_sat_add(x1, bad ? 0 : n[u]);
            x2 = kv_sat_add(x2, pre ? kv_sat_add(d[u], n[u]) : 0);
            x3 += pre ? 1 : 0;
        }
        int i1 = kv_warp_inclusive(x1), i2 = kv_warp_inclusive(x2), i3 = x3;
#pragma unroll
        for (int off = 1; off < 32; off <<= 1) {
            const int y = __shfl_up_sync(0xffffffffu, i3, off);
            if (lane >= off) i3 += y;
        }
        if (lane == 31) {
            s.sums[0][warp] = i1;
            s.sums[1][warp] = i2;
            s.sums[2][warp] = i3;
        }
        __syncthreads();
        int b1 = 0, b2 = 0, b3 = 0, t1 = 0, t2 = 0, t3 = 0;
        for (int w = 0; w < warps; ++w) {
            const int w1 = s.sums[0][w], w2 = s.sums[1][w], w3 = s.sums[2][w];
            if (w < warp) {
                b1 = kv_sat_add(b1, w1);
                b2 = kv_sat_add(b2, w2);
                b3 += w3;
            }
            t1 = kv_sat_add(t1, w1);
            t2 = kv_sat_add(t2, w2);
            t3 += w3;
        }
        // this thread's exclusive prefixes: the carry, the warps before, the lanes before
        int e1 = __shfl_up_sync(0xffffffffu, i1, 1), e2 = __shfl_up_sync(0xffffffffu, i2, 1),
            e3 = __shfl_up_sync(0xffffffffu, i3, 1);
        if (lane == 0) e1 = e2 = e3 = 0;
        int start = kv_sat_add(carry_tok, kv_sat_add(b1, e1));
        int ks = kv_sat_add(carry_pre, kv_sat_add(b2, e2));
        int ord = carry_cnt + b3 + e3;
#pragma unroll
        for (int u = 0; u < KV_DSA_R; ++u) {
            if (u < r) {
                const bool bad = (d[u] < 0) | (n[u] < 0);
                const bool pre = !bad && n[u] > thr;
                start = kv_sat_add(start, bad ? 0 : n[u]);
                s.end[tid * r + u] = start;
                s.dec[tid * r + u] = d[u];
                s.ks[tid * r + u] = pre ? ks : -1;
                if (pre) {
                    if (k == last && ord < p.dsa_cu_len) kv_st(p.dsa_cu_seq_lens + ord, ks);
                    ks = kv_sat_add(ks, kv_sat_add(d[u], n[u]));
                    ++ord;
                }
            }
        }
        const int tile_end = kv_sat_add(carry_tok, t1);
        const int count = min(tile, bsz - base);
        __syncthreads();  // the staged tile
        // the next tile's loads, in flight while this tile's tokens are written
        if (base + tile < bsz) kv_dsa_load(p, base + tile + tid * r, r, bsz, d, n);
        // the block's tokens this tile's requests hold: [max(lo, carry_tok), min(hi, tile_end))
#pragma unroll 1
        for (int t = max(lo, carry_tok) + tid; t < min(hi, tile_end); t += T) {
            int a = 0, z = count - 1;  // the first staged end past t (one exists: tile_end > t)
            while (a < z) {
                const int m = (a + z) >> 1;
                if (s.end[m] > t) z = m;
                else a = m + 1;
            }
            const int kr = s.ks[a];
            int ks_t = 0, ke_t = 0;
            if (kr >= 0) {  // a prefill's token, at position seq_lens_decoder + (t - its first token)
                const int st = a > 0 ? s.end[a - 1] : carry_tok;
                ks_t = kr;
                ke_t = kv_sat_add(kr, kv_sat_add(s.dec[a], t - st + 1));
            }
            kv_st(ks_out + t, ks_t);
            kv_st(ke_out + t, ke_t);
        }
        __syncthreads();  // the staged tile and warp totals read before the next tile writes them
        carry_tok = tile_end;
        carry_pre = kv_sat_add(carry_pre, t2);
        carry_cnt += t3;
    }
    for (int t = max(lo, min(carry_tok, C)) + tid; t < hi; t += T) {
        kv_st(ks_out + t, 0);
        kv_st(ke_out + t, 0);
    }
    if (k == last)
        for (int i = carry_cnt + tid; i < p.dsa_cu_len; i += T) kv_st(p.dsa_cu_seq_lens + i, carry_pre);
}
