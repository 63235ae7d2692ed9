// DeepSeek-V3.2 sparse attention (DSA) outputs of the core step (docs/dsa.md; kvaddr/reference.py's
// dsa_step_reference is the oracle), written in the step's own launch when KvStepParams::dsa != 0.
//
// The step's kernels run on a grid of gridDim.x blocks; with DSA outputs asked for, the planner
// launches a second grid row (gridDim.y = 2). Row 0 is the step, unchanged (its blocks never see
// row 1: every gridDim.x and ticket of the step counts row 0 alone); row 1 is gridDim.x DSA blocks,
// which read the lengths themselves and wait for no block. Without DSA outputs the grid has one
// row and the only cost is the blockIdx.y test at entry.
//
// DSA block k owns the tokens [k * per, min((k + 1) * per, C)), per = ceil(C / gridDim.x). It walks
// the requests KV_DSA_TILE at a time (one request per thread of the first KV_DSA_TILE threads): a
// block scan of three sums at once, carried from tile to tile:
//   * the request's tokens n (0 for a bad request: a negative length), whose prefix is the
//     request's first token (the step's cu_seqlens_q, saturating as the step's);
//   * for a prefill (n > dsa_decode_len), its seq_len = seq_lens_decoder + n, whose prefix over the
//     prefills is the request's ks (cu_seq_lens over the prefills);
//   * for a prefill, 1: its ordinal among the prefills, where block 0 writes cu_seq_lens.
// The tile's prefixes go to shared memory; every thread then takes the block's tokens inside the
// tile's token range (consecutive threads, consecutive tokens: coalesced stores), binary-searches
// its request there, and writes (position p = seq_lens_decoder + (t - start), slot s in cache
// dsa_cache with blk = s / B, off = s % B):
//   ctx = p + 1;  ks / ke = the prefill's ks and ks + p + 1 (0 and 0 for a decode token);
//   value = blk * B * (V + S) + off * V,  scale = blk * B * (V + S) + B * V + off * S
// (-1 and -1 when the token's block index is past the row or its block id is negative: the step's
// token blocks record those errors, the DSA blocks record none). Tokens [min(total, C), C) of the
// block are padding (-1, -1, 0, 0, 0); block 0 writes cu_seq_lens[P .. max_requests] = the total of
// the P prefills' seq_lens. Every element of every DSA output is written on every launch.
// Blocks of any T (a multiple of 32 up to 1024): threads past KV_DSA_TILE load no request.

#define KV_DSA_TILE 256
#define KV_DSA_WARPS 8  // KV_DSA_TILE / 32

struct KvDsaShared {
    int start[KV_DSA_TILE];  // first token of the tile's request k
    int dec[KV_DSA_TILE];    // its seq_lens_decoder
    int ks[KV_DSA_TILE];     // its ks (a prefill), -1 (a decode)
    int sums[3][KV_DSA_WARPS];
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
    const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5, T = blockDim.x;
    const int k = blockIdx.x, nb = gridDim.x, bsz = p.bsz, C = p.capacity, thr = p.dsa_decode_len;
    const int per = (int)(((i64)C + nb - 1) / nb);
    const int lo = (int)min((i64)k * per, (i64)C), hi = (int)min((i64)lo + per, (i64)C);
    const int tile = T < KV_DSA_TILE ? T : KV_DSA_TILE;  // requests per tile (a multiple of 32)
    const int tile_warps = tile >> 5;
    const int* table;
    i64 stride;
    int width, B;
    kv_meta_cache(p, p.dsa_cache, table, stride, width, B);
    int carry_tok = 0, carry_pre = 0, carry_cnt = 0;
    for (int base = 0; base < bsz; base += tile) {
        const int b = base + tid;
        int d = 0, n = 0;
        if (tid < tile && b < bsz) {
            d = p.seq_lens_decoder[b];
            n = p.seq_lens_this_time[b];
        }
        const bool bad = (d < 0) | (n < 0);
        const int ne = bad ? 0 : n;
        const bool pre = !bad && n > thr;
        int x1 = ne, x2 = pre ? kv_sat_add(d, n) : 0, x3 = pre ? 1 : 0;
#pragma unroll
        for (int off = 1; off < 32; off <<= 1) {
            const int y1 = __shfl_up_sync(0xffffffffu, x1, off);
            const int y2 = __shfl_up_sync(0xffffffffu, x2, off);
            const int y3 = __shfl_up_sync(0xffffffffu, x3, off);
            if (lane >= off) {
                x1 = kv_sat_add(x1, y1);
                x2 = kv_sat_add(x2, y2);
                x3 += y3;
            }
        }
        int e1 = __shfl_up_sync(0xffffffffu, x1, 1), e2 = __shfl_up_sync(0xffffffffu, x2, 1),
            e3 = __shfl_up_sync(0xffffffffu, x3, 1);  // exclusive prefixes within the warp
        if (lane == 0) e1 = e2 = e3 = 0;
        if (lane == 31 && warp < tile_warps) {
            s.sums[0][warp] = x1;
            s.sums[1][warp] = x2;
            s.sums[2][warp] = x3;
        }
        __syncthreads();
        int b1 = 0, b2 = 0, b3 = 0, t1 = 0, t2 = 0, t3 = 0;
        for (int w = 0; w < tile_warps; ++w) {
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
        const int start = kv_sat_add(carry_tok, kv_sat_add(b1, e1));
        const int ks = kv_sat_add(carry_pre, kv_sat_add(b2, e2));
        const int ord = carry_cnt + b3 + e3;
        if (tid < tile && b < bsz) {
            s.start[tid] = start;
            s.dec[tid] = d;
            s.ks[tid] = pre ? ks : -1;
            if (k == 0 && pre && ord < p.dsa_cu_len) p.dsa_cu_seq_lens[ord] = ks;
        }
        const int count = min(tile, bsz - base);
        const int tile_end = kv_sat_add(carry_tok, t1);
        __syncthreads();
        const int a = max(lo, carry_tok), z = min(hi, tile_end);
        for (int t = a + tid; t < z; t += T) {
            int l = 0, h = count;  // largest j with s.start[j] <= t (s.start[0] = carry_tok <= t)
            while (h - l > 1) {
                const int mid = (l + h) >> 1;
                if (s.start[mid] <= t) l = mid; else h = mid;
            }
            kv_dsa_token(p, t, base + l, s.dec[l], s.start[l], s.ks[l], table, stride, width, B);
        }
        __syncthreads();  // the tile's shared prefixes read before the next tile's
        carry_tok = tile_end;
        carry_pre = kv_sat_add(carry_pre, t2);
        carry_cnt += t3;
    }
    for (int t = max(lo, min(carry_tok, C)) + tid; t < hi; t += T) kv_dsa_pad(p, t);
    if (k == 0)
        for (int i = carry_cnt + tid; i < p.dsa_cu_len; i += T) p.dsa_cu_seq_lens[i] = carry_pre;
}
