// DeepSeek-V3.2 sparse attention (DSA) outputs of the vLLM step (docs/dsa.md, "The vLLM step";
// kvaddr/engines/vllm_reference.py's vllm_dsa_reference is the oracle), written in the step's
// own launch by vllm_step<ATTENTION, true>.
//
// The planner launches the step's grid as row 0 of a two-row grid; row 1 holds the DSA blocks,
// which wait for no block of row 0 and write no error record (the step's token and request
// blocks record every error of the same inputs). DSA block k < token_blocks owns the tokens
// [k * VLLM_THREADS, +VLLM_THREADS), one a thread; blocks past them return at once (block 0, which
// always has tokens, also writes cu_seq_lens). A thread finds its token's owner as the step's token blocks do (the
// guess min(t, n - 1), then vllm_owner_search: the same owner for any query_start_loc, even a
// decreasing one), and the token is valid when the step's is (t < num_tokens, the owner's range
// holds t, a real row, num_computed_tokens >= 0). The block then walks the batch
// VLLM_THREADS * VLLM_DSA_R requests at a time (a tile; VLLM_DSA_R consecutive requests a thread,
// every load issued before any is used): a thread computes whether each of its requests is a
// prefill (a good request running more than dsa_decode_len tokens) and its seq_len
// (num_computed_tokens + its tokens, saturating as seq_lens), a block scan of the thread sums
// gives each prefill its ks (the seq_lens of the prefills before it) and its ordinal, staged in
// shared memory for the tile, and a token whose owner lies in the tile reads its ks there. For a valid token t of request b at position p, slot s of group
// dsa_group (blk = s / B, off = s % B; the step's slot mapping of that group, -1 included):
//   value = blk * B * (V + S) + off * V,  scale = blk * B * (V + S) + B * V + off * S  (s < 0: -1)
//   ctx = p + 1;  ks, ke = the prefill's ks and ks + ctx (0 and 0 for a decode token);
//   req_id_per_token = b.
// Padding and invalid tokens (dummy rows included): -1, -1, 0, 0, 0, -1. Block 0 writes
// cu_seq_lens[ord] = ks of each prefill and the total of their seq_lens over [P, max_num_reqs].
// Every element of every DSA output is written on every launch.

// One token's DSA outputs (t < max_tokens): valid or not, its position and owner b, the owner's ks
// (-1: a decode) and its slot in the DSA group (-1: none).
__device__ __forceinline__ void vllm_dsa_token(const VllmStepParams& p, int t, bool valid, long long pos, int b, int ks,
                                               long long slot) {
    long long value = -1, scale = -1;
    int ctx = 0, kso = 0, keo = 0, req = -1;
    if (valid) {
        if (slot >= 0) {
            const long long B = vllm_pick(p.block_size, p.dsa_group);
            const long long V = p.dsa_value_bytes, S = p.dsa_scale_bytes;
            const long long blk = slot / B, off = slot - blk * B;
            const long long base = blk * B * (V + S);
            value = base + off * V;
            scale = base + B * V + off * S;
        }
        ctx = (int)(pos + 1 > VLLM_INT_MAX ? VLLM_INT_MAX : pos + 1);
        if (ks >= 0) {
            kso = ks;
            const long long e = (long long)ks + ctx;
            keo = (int)(e > VLLM_INT_MAX ? VLLM_INT_MAX : e);
        }
        req = b;
    }
    p.dsa_value_offsets[t] = value;
    p.dsa_scale_offsets[t] = scale;
    p.dsa_ctx[t] = ctx;
    p.dsa_ks[t] = kso;
    p.dsa_ke[t] = keo;
    p.dsa_req_id[t] = req;
}

// Token t's owner, validity, position and slot in group dsa_group, as vllm_token_write computes
// them (the same loads and checks; without its error records).
__device__ __forceinline__ void vllm_dsa_locate(const VllmStepParams& p, int t, int& b, bool& valid, long long& pos,
                                                long long& slot) {
    const int n = p.num_reqs;
    int q0 = 0, q1 = 0, num_tokens = 0;
    long long r = 0;
    b = 0;
    valid = false;
    pos = 0;
    slot = -1;
    if (n <= 0) return;
    if (vllm_token_guess(p, t, b, q0, q1, r, num_tokens)) {
        b = vllm_owner_search(p.query_start_loc, n, t);
        q0 = p.query_start_loc[b];
        q1 = p.query_start_loc[b + 1];
        r = vllm_row_of(p, b);
    }
    if (!(t < num_tokens && q0 >= 0 && q0 <= t && t < q1 && r >= 0 && r < p.max_num_reqs)) return;
    const int g = p.dsa_group;
    const int flags = vllm_pick(p.group_flags, g);
    const int nb = (flags & VLLM_GROUP_SLOTS) ? vllm_pick(p.num_blocks, g)[r] : 0;
    const int nct = p.num_computed_tokens[r];
    if (nct < 0) return;
    valid = true;
    pos = (long long)nct + (t - q0);
    if (!(flags & VLLM_GROUP_SLOTS)) return;
    unsigned int idx = 0, off = 0;
    const bool local = p.cp_size > 1 ? vllm_token_index<true>(p, g, flags, pos, idx, off)
                                     : vllm_token_index<false>(p, g, flags, pos, idx, off);
    if (!local || (long long)idx >= (long long)vllm_pick(p.width, g) || (long long)idx >= (long long)nb) return;
    const int blk = vllm_pick(p.block_table, g)[r * vllm_pick(p.table_stride, g) + idx];
    if (blk < 0) return;
    const long long s = (long long)blk * (long long)vllm_pick(p.block_size, g) + off;
    if (p.slot_is_32 && s > VLLM_INT_MAX) return;
    slot = s;
}

// A request's prefill length from its loads (range [q0, q1), row r, num_computed_tokens nct, read
// only for a row in range): its seq_len (saturating) when it is a good request running more than
// dsa_decode_len tokens, else -1.
__device__ __forceinline__ int vllm_dsa_prefill(const VllmStepParams& p, int q0, int q1, long long r, int nct) {
    if (r < 0 || r >= p.max_num_reqs || q0 < 0 || q1 < q0 || nct < 0 || q1 - q0 <= p.dsa_decode_len) return -1;
    const long long s = (long long)nct + ((long long)q1 - q0);
    return (int)(s > VLLM_INT_MAX ? VLLM_INT_MAX : s);
}

// Request b < num_reqs's prefill length (vllm_dsa_prefill with its own loads).
__device__ __forceinline__ int vllm_dsa_prefill_len(const VllmStepParams& p, int b) {
    const long long r = vllm_row_of(p, b);
    const int nct = (r >= 0 && r < p.max_num_reqs) ? p.num_computed_tokens[r] : 0;
    return vllm_dsa_prefill(p, p.query_start_loc[b], p.query_start_loc[b + 1], r, nct);
}

// ---- the DSA block of the vLLM step (row 1 of vllm_step<ATTENTION, true>'s grid) ----

#define VLLM_DSA_R 8  // consecutive requests per thread in a tile (all their loads in flight)

__device__ void vllm_dsa_block(const VllmStepParams& p) {
    __shared__ int tile_ks[VLLM_THREADS * VLLM_DSA_R];  // ks of the tile's requests (-1: not a prefill)
    __shared__ int red[2][VLLM_WARPS];                  // per warp: seq_len sum, prefill count
    const int tid = (int)threadIdx.x, lane = tid & 31, warp = tid >> 5, k = (int)blockIdx.x;
    const int n = p.num_reqs;
    if (k >= p.token_blocks) return;  // (uniform) no tokens; block 0 always has some
    const int t = k * VLLM_THREADS + tid;
    const bool mine = t < p.max_tokens;
    int b = 0, ks = -1;
    bool valid = false;
    long long pos = 0, slot = -1;
    if (mine) vllm_dsa_locate(p, t, b, valid, pos, slot);
    int carry_len = 0, carry_cnt = 0;
#pragma unroll 1
    for (int base = 0; base < n; base += VLLM_THREADS * VLLM_DSA_R) {
        const int first = base + tid * VLLM_DSA_R;  // this thread's requests [first, first + R)
        int q[VLLM_DSA_R + 1], nct[VLLM_DSA_R], len[VLLM_DSA_R];
        long long r[VLLM_DSA_R];
#pragma unroll
        for (int u = 0; u <= VLLM_DSA_R; ++u) q[u] = first + u <= n ? p.query_start_loc[first + u] : 0;
#pragma unroll
        for (int u = 0; u < VLLM_DSA_R; ++u) r[u] = first + u < n ? vllm_row_of(p, first + u) : -1;
#pragma unroll
        for (int u = 0; u < VLLM_DSA_R; ++u) nct[u] = (r[u] >= 0 && r[u] < p.max_num_reqs) ? p.num_computed_tokens[r[u]] : 0;
        int x = 0, c = 0;  // this thread's prefill seq_lens and prefills
#pragma unroll
        for (int u = 0; u < VLLM_DSA_R; ++u) {
            len[u] = vllm_dsa_prefill(p, q[u], q[u + 1], r[u], nct[u]);
            if (len[u] >= 0) {
                x = kv_sat_add_nn(x, len[u]);
                ++c;
            }
        }
        int ix = x, ic = c;
#pragma unroll
        for (int off = 1; off < 32; off <<= 1) {
            const int yx = __shfl_up_sync(0xffffffffu, ix, off), yc = __shfl_up_sync(0xffffffffu, ic, off);
            if (lane >= off) {
                ix = kv_sat_add_nn(ix, yx);
                ic += yc;
            }
        }
        if (lane == 31) {
            red[0][warp] = ix;
            red[1][warp] = ic;
        }
        __syncthreads();
        int bx = carry_len, bc = carry_cnt, tx = carry_len, tc = carry_cnt;
        for (int w = 0; w < VLLM_WARPS; ++w) {
            if (w < warp) {
                bx = kv_sat_add_nn(bx, red[0][w]);
                bc += red[1][w];
            }
            tx = kv_sat_add_nn(tx, red[0][w]);
            tc += red[1][w];
        }
        // this thread's exclusive prefixes: its first request's ks and ordinal among the prefills
        int ex = __shfl_up_sync(0xffffffffu, ix, 1), ec = __shfl_up_sync(0xffffffffu, ic, 1);
        if (lane == 0) ex = ec = 0;
        int run = kv_sat_add_nn(bx, ex), ord = bc + ec;
#pragma unroll
        for (int u = 0; u < VLLM_DSA_R; ++u) {
            tile_ks[tid * VLLM_DSA_R + u] = len[u] >= 0 ? run : -1;
            if (len[u] >= 0) {
                if (k == 0 && ord <= p.max_num_reqs) p.dsa_cu_seq_lens[ord] = run;
                run = kv_sat_add_nn(run, len[u]);
                ++ord;
            }
        }
        __syncthreads();
        if (valid && b >= base && b - base < VLLM_THREADS * VLLM_DSA_R) ks = tile_ks[b - base];
        __syncthreads();  // the tile's ks and the warp sums are read before the next tile writes them
        carry_len = tx;
        carry_cnt = tc;
    }
    if (mine) vllm_dsa_token(p, t, valid, pos, b, ks, slot);
    if (k == 0)
        for (int i = carry_cnt + tid; i <= p.max_num_reqs; i += VLLM_THREADS) p.dsa_cu_seq_lens[i] = carry_len;
}
