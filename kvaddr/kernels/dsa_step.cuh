// DeepSeek-V3.2 sparse attention (DSA) outputs of the core step (docs/dsa.md; kvaddr/reference.py's
// dsa_step_reference is the oracle), written in the step's own launch when KvStepParams::dsa != 0.
//
// The step's kernels run on a grid of gridDim.x blocks; with DSA outputs asked for, the planner
// launches a second grid row (gridDim.y = 2). Row 0 is the step, unchanged (its blocks never see
// row 1: every gridDim.x and ticket of the step counts row 0 alone); row 1 is gridDim.x DSA blocks,
// which read the lengths themselves and wait for no block. Without DSA outputs the grid has one
// row and the only cost is the blockIdx.y test at entry.
//
// DSA block k owns the tokens [lo, hi) = [k * per, min((k + 1) * per, C)), per = ceil(C / gridDim.x).
// It walks the requests KV_DSA_TILE at most at a time (a tile of T * r requests, r = min(KV_DSA_R,
// KV_DSA_TILE / T); thread i loads the r consecutive requests [i * r, i * r + r) of the tile, every
// load issued before any is used), and a block scan of the thread sums gives each request three
// saturating prefixes, carried from tile to tile:
//   * the request's tokens n (0 for a bad request: a negative length), whose prefix is the
//     request's first token (the step's cu_seqlens_q, saturating as the step's);
//   * for a prefill (n > dsa_decode_len), its seq_len = seq_lens_decoder + n, whose prefix over the
//     prefills is the request's ks (cu_seq_lens over the prefills);
//   * for a prefill, 1: its ordinal among the prefills, where the last block writes cu_seq_lens.
// The tile's token ends and each thread's prefill prefix are staged in shared memory; then each
// thread takes the block's tokens that the tile's requests hold (one a thread, T apart), finds each
// token's request by a binary search of the staged ends (the first end past the token; directly
// when every request of the tile runs one token: token carry + i is request i), and reads
// that request's loading thread's requests again (cached loads, all in flight) for its
// seq_lens_decoder and its ks (the staged prefix plus the prefills before it). A block
// other than the last stops after the tile that reaches its last token (it needs only the prefix
// up to its tokens); the last block, whose tokens end the range, scans the whole batch for
// cu_seq_lens. For token t of request b
// at position p = seq_lens_decoder + (t - start), slot s in cache dsa_cache (blk = s / B,
// off = s % B):
//   ctx = p + 1;  ks / ke = the prefill's ks and ks + p + 1 (0 and 0 for a decode token);
//   value = blk * B * (V + S) + off * V,  scale = blk * B * (V + S) + B * V + off * S
// (-1 and -1 when the token's block index is past the row or its block id is negative: the step's
// token blocks record those errors, the DSA blocks record none). Tokens [min(total, C), C) of the
// block are padding (-1, -1, 0, 0, 0); the last block writes cu_seq_lens[P .. max_requests] = the total of
// the P prefills' seq_lens. Every element of every DSA output is written on every launch. Shared
// memory: the tile's staged prefixes and the block scan's warp totals (12.4 KB: the step kernels'
// own shared memory and this fit the 48 KB of static shared memory).

#define KV_DSA_R 8        // requests a thread loads per tile (all loads in flight)
#define KV_DSA_TILE 2048  // requests per tile at most (the staged ends)
// The widest block of the DSA instantiations of step_small and step_wide: the dispatch table
// launches them with at most 256 threads (kvaddr/dispatch.py), so their launch bounds leave the
// DSA blocks the registers they need (the kernels without DSA keep theirs).
#define KV_DSA_SMALL_THREADS 256

struct KvDsaShared {
    int end[KV_DSA_TILE];  // the tile's requests: token prefix at their end (saturating)
    int ks[1024];          // per thread of the tile: the prefills' seq_len prefix before its requests
    int sums[3][32];       // per warp: tokens, prefill seq_lens, prefills
};

// One token's DSA outputs (t < C): request b with seq_lens_decoder d, first token start, ks
// (-1: a decode), looked up in cache g (table, stride, width, B).
__device__ __forceinline__ void kv_dsa_token(const KvStepParams& p, int t, int b, int d, int start, int ks,
                                             const int* table, i64 stride, int width, int B) {
    const i64 pos = (i64)d + (t - start);
    const int ctx = kv_sat_add(d, t - start + 1);
    i64 idx, off, value = -1, scale = -1;
    kv_divmod(pos, B, idx, off);
    if (idx < width) {
        const int blk = table[(i64)b * stride + idx];
        if (blk >= 0) {
            const i64 V = p.dsa_value_bytes, S = p.dsa_scale_bytes;
            const i64 base = (i64)blk * B * (V + S);
            value = base + off * V;
            scale = base + (i64)B * V + off * S;
        }
    }
    p.dsa_value_offsets[t] = value;
    p.dsa_scale_offsets[t] = scale;
    p.dsa_ctx[t] = ctx;
    p.dsa_ks[t] = ks >= 0 ? ks : 0;
    p.dsa_ke[t] = ks >= 0 ? kv_sat_add(ks, ctx) : 0;
}

__device__ __forceinline__ void kv_dsa_pad(const KvStepParams& p, int t) {
    p.dsa_value_offsets[t] = -1;
    p.dsa_scale_offsets[t] = -1;
    p.dsa_ctx[t] = 0;
    p.dsa_ks[t] = 0;
    p.dsa_ke[t] = 0;
}

// DSA block blockIdx.x of the grid's second row (see the section comment).
__device__ void kv_dsa_block(const KvStepParams& p) {
    __shared__ KvDsaShared s;
    const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5, T = blockDim.x, warps = T >> 5;
    const int k = blockIdx.x, nb = gridDim.x, last = nb - 1, bsz = p.bsz, C = p.capacity, thr = p.dsa_decode_len;
    const int per = (int)(((i64)C + nb - 1) / nb);
    const int lo = (int)min((i64)k * per, (i64)C), hi = (int)min((i64)lo + per, (i64)C);
    const int r = min(KV_DSA_R, KV_DSA_TILE / T), tile = T * r;  // requests per thread, per tile
    const int* table;
    i64 stride;
    int width, B;
    kv_meta_cache(p, p.dsa_cache, table, stride, width, B);
    int carry_tok = 0, carry_pre = 0, carry_cnt = 0;
#pragma unroll 1
    for (int base = 0; base < bsz; base += tile) {
        if (k != last && (carry_tok >= hi || lo >= hi)) break;  // (uniform) no token of this block left
        const int first = base + tid * r;      // this thread's first request
        int d[KV_DSA_R], n[KV_DSA_R];
#pragma unroll
        for (int u = 0; u < KV_DSA_R; ++u) {
            d[u] = n[u] = 0;
            if (u < r && first + u < bsz) {
                d[u] = p.seq_lens_decoder[first + u];
                n[u] = p.seq_lens_this_time[first + u];
            }
        }
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
        s.ks[tid] = ks;
#pragma unroll
        for (int u = 0; u < KV_DSA_R; ++u) {
            if (u < r) {
                const bool bad = (d[u] < 0) | (n[u] < 0);
                const bool pre = !bad && n[u] > thr;
                start = kv_sat_add(start, bad ? 0 : n[u]);
                s.end[tid * r + u] = start;
                if (pre) {
                    if (k == last && ord < p.dsa_cu_len) p.dsa_cu_seq_lens[ord] = ks;
                    ks = kv_sat_add(ks, kv_sat_add(d[u], n[u]));
                    ++ord;
                }
            }
        }
        const int tile_end = kv_sat_add(carry_tok, t1);
        const int count = min(tile, bsz - base);
        bool unit = true;  // this thread's requests each run one token (a decode step)
#pragma unroll
        for (int u = 0; u < KV_DSA_R; ++u) unit &= !(u < r && first + u < bsz) || (n[u] == 1 && d[u] >= 0);
        unit = __syncthreads_and(unit);  // (the staged prefixes written) every request of the tile runs one token
        // the block's tokens this tile's requests hold: [max(lo, carry_tok), min(hi, tile_end))
#pragma unroll 1
        for (int t = max(lo, carry_tok) + tid; t < min(hi, tile_end); t += T) {
            int a = unit ? t - carry_tok : 0, z = unit ? a : count - 1;  // the first staged end past t
            while (a < z) {  // (one exists: tile_end > t)
                const int m = (a + z) >> 1;
                if (s.end[m] > t) z = m;
                else a = m + 1;
            }
            const int st = a > 0 ? s.end[a - 1] : carry_tok;
            // request a's seq_lens_decoder and ks: its loading thread's requests again (cached
            // loads, all in flight), ks after that thread's staged prefix
            const int i = a / r, u0 = a - i * r, rb = base + i * r;
            int dd[KV_DSA_R], nn[KV_DSA_R];
#pragma unroll
            for (int u = 0; u < KV_DSA_R; ++u) {
                dd[u] = nn[u] = 0;
                if (u <= u0) {
                    dd[u] = p.seq_lens_decoder[rb + u];
                    nn[u] = p.seq_lens_this_time[rb + u];
                }
            }
            int kr = s.ks[i], dr = 0;
            bool pr = false;
#pragma unroll
            for (int u = 0; u < KV_DSA_R; ++u) {
                const bool bad = (dd[u] < 0) | (nn[u] < 0);
                const bool pre = !bad && nn[u] > thr;
                if (u < u0 && pre) kr = kv_sat_add(kr, kv_sat_add(dd[u], nn[u]));
                if (u == u0) {
                    dr = dd[u];
                    pr = pre;
                }
            }
            kv_dsa_token(p, t, base + a, dr, st, pr ? kr : -1, table, stride, width, B);
        }
        __syncthreads();  // the staged prefixes and warp totals read before the next tile writes them
        carry_tok = tile_end;
        carry_pre = kv_sat_add(carry_pre, t2);
        carry_cnt += t3;
    }
    for (int t = max(lo, min(carry_tok, C)) + tid; t < hi; t += T) kv_dsa_pad(p, t);
    if (k == last)
        for (int i = carry_cnt + tid; i < p.dsa_cu_len; i += T) p.dsa_cu_seq_lens[i] = carry_pre;
}
