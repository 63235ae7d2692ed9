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
// It walks the requests T * R at a time (a tile; thread i holds the R consecutive requests
// [i * R, i * R + R) of the tile in registers, all loads issued at once; R is the kernel's, so that
// one tile covers the batches the kernel runs: R = 1 for step_small, the step's own R for
// step_wide, 16 for step_multiblock's 4096-request tiles; step_wide_attention, whose blocks of up
// to 1024 threads leave 64 registers, takes R = 1 and T requests per tile). A thread sums its requests, a block scan
// of the thread totals gives each thread its prefixes, for three sums at once, carried from tile
// to tile:
//   * the request's tokens n (0 for a bad request: a negative length), whose prefix is the
//     request's first token (the step's cu_seqlens_q, saturating as the step's);
//   * for a prefill (n > dsa_decode_len), its seq_len = seq_lens_decoder + n, whose prefix over the
//     prefills is the request's ks (cu_seq_lens over the prefills);
//   * for a prefill, 1: its ordinal among the prefills, where block 0 writes cu_seq_lens.
// Then each thread walks its R requests again (the prefixes in registers) and writes the tokens of
// each that lie in [lo, hi): up to KV_DSA_SHORT of them itself (a decode's one token, MTP's n), a
// longer run with its whole warp (a ballot per request slot, then 32 lanes over consecutive
// tokens: coalesced stores, no thread left with a long prefill alone). For token t of request b
// at position p = seq_lens_decoder + (t - start), slot s in cache dsa_cache (blk = s / B,
// off = s % B):
//   ctx = p + 1;  ks / ke = the prefill's ks and ks + p + 1 (0 and 0 for a decode token);
//   value = blk * B * (V + S) + off * V,  scale = blk * B * (V + S) + B * V + off * S
// (-1 and -1 when the token's block index is past the row or its block id is negative: the step's
// token blocks record those errors, the DSA blocks record none). Tokens [min(total, C), C) of the
// block are padding (-1, -1, 0, 0, 0); block 0 writes cu_seq_lens[P .. max_requests] = the total of
// the P prefills' seq_lens. Every element of every DSA output is written on every launch. Shared
// memory: the block scan's warp totals only.

#define KV_DSA_SHORT 4  // tokens in range a thread writes alone; more: its warp together
// The widest block of the DSA instantiations of step_small and step_wide: the dispatch table
// launches them with at most 256 threads (kvaddr/dispatch.py), so their launch bounds leave the
// DSA blocks the registers they need (the kernels without DSA keep theirs).
#define KV_DSA_SMALL_THREADS 256

struct KvDsaShared {
    int sums[3][32];  // per warp: tokens, prefill seq_lens, prefills
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

// Request b's tokens [a, z) (a < z, inside this block's range) by one thread.
__device__ __forceinline__ void kv_dsa_run(const KvStepParams& p, int a, int z, int b, int d, int start, int ks,
                                           const int* table, i64 stride, int width, int B) {
#pragma unroll 1
    for (int t = a; t < z; ++t) kv_dsa_token(p, t, b, d, start, ks, table, stride, width, B);
}

// DSA block blockIdx.x of the grid's second row (see the section comment), R requests per thread.
template <int R>
__device__ void kv_dsa_block(const KvStepParams& p) {
    __shared__ KvDsaShared s;
    const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5, T = blockDim.x, warps = T >> 5;
    const int k = blockIdx.x, nb = gridDim.x, bsz = p.bsz, C = p.capacity, thr = p.dsa_decode_len;
    const int per = (int)(((i64)C + nb - 1) / nb);
    const int lo = (int)min((i64)k * per, (i64)C), hi = (int)min((i64)lo + per, (i64)C);
    const int* table;
    i64 stride;
    int width, B;
    kv_meta_cache(p, p.dsa_cache, table, stride, width, B);
    int carry_tok = 0, carry_pre = 0, carry_cnt = 0;
    for (int base = 0; base < bsz; base += T * R) {
        const int first = base + tid * R;  // this thread's first request
        int d[R], n[R];
#pragma unroll
        for (int u = 0; u < R; ++u) {
            d[u] = n[u] = 0;
            if (first + u < bsz) {
                d[u] = p.seq_lens_decoder[first + u];
                n[u] = p.seq_lens_this_time[first + u];
            }
        }
        int x1 = 0, x2 = 0, x3 = 0;  // this thread's sums
#pragma unroll
        for (int u = 0; u < R; ++u) {
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
        __syncthreads();  // the warp totals read before the next tile writes them
        // this thread's exclusive prefixes: the carry, the warps before, the lanes before
        int e1 = __shfl_up_sync(0xffffffffu, i1, 1), e2 = __shfl_up_sync(0xffffffffu, i2, 1),
            e3 = __shfl_up_sync(0xffffffffu, i3, 1);
        if (lane == 0) e1 = e2 = e3 = 0;
        int start = kv_sat_add(carry_tok, kv_sat_add(b1, e1));
        int ks = kv_sat_add(carry_pre, kv_sat_add(b2, e2));
        int ord = carry_cnt + b3 + e3;
#pragma unroll
        for (int u = 0; u < R; ++u) {
            const int b = first + u;
            const bool bad = (d[u] < 0) | (n[u] < 0);
            const bool pre = !bad && n[u] > thr;
            const int end = kv_sat_add(start, bad ? 0 : n[u]);
            if (k == 0 && pre && ord < p.dsa_cu_len) p.dsa_cu_seq_lens[ord] = ks;
            const int a = max(start, lo), z = min(end, hi);
            const int kk = pre ? ks : -1;
            const bool longer = z - a > KV_DSA_SHORT;
            if (z > a && !longer) kv_dsa_run(p, a, z, b, d[u], start, kk, table, stride, width, B);
            unsigned int todo = __ballot_sync(0xffffffffu, longer);
            while (todo) {  // the warp writes each lane's long run together
                const int from = __ffs(todo) - 1;
                todo &= todo - 1;
                const int la = __shfl_sync(0xffffffffu, a, from), lz = __shfl_sync(0xffffffffu, z, from);
                const int lb = __shfl_sync(0xffffffffu, b, from), ld = __shfl_sync(0xffffffffu, d[u], from);
                const int ls = __shfl_sync(0xffffffffu, start, from), lk = __shfl_sync(0xffffffffu, kk, from);
#pragma unroll 1
                for (int t = la + lane; t < lz; t += 32) kv_dsa_token(p, t, lb, ld, ls, lk, table, stride, width, B);
            }
            if (pre) {
                ks = kv_sat_add(ks, kv_sat_add(d[u], n[u]));
                ++ord;
            }
            start = end;
        }
        carry_tok = kv_sat_add(carry_tok, t1);
        carry_pre = kv_sat_add(carry_pre, t2);
        carry_cnt += t3;
    }
    for (int t = max(lo, min(carry_tok, C)) + tid; t < hi; t += T) kv_dsa_pad(p, t);
    if (k == 0)
        for (int i = carry_cnt + tid; i < p.dsa_cu_len; i += T) p.dsa_cu_seq_lens[i] = carry_pre;
}
