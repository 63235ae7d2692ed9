// DeepSeek-V3.2 sparse attention (DSA) outputs of the vLLM step (docs/dsa.md, "The vLLM step";
// kvaddr/engines/vllm_reference.py's vllm_dsa_reference is the oracle), written in the step's
// own launch by vllm_step<ATTENTION, true>. Two parts of the launch write them, each what it
// already knows:
//
//   * The step's token blocks (row 0; vllm_token_write<DCP, true>, vllm_dsa_token_out in
//     vllm.cuh) write every token t < max_tokens's value and scale offsets, ctx and
//     req_id_per_token where they write its slots (they hold its owner b, validity, position p and
//     the slot s of group dsa_group; no load is added), and ks = ke = 0 unless t is a prefill's
//     token (valid, its owner running q1 - q0 > dsa_decode_len tokens). With blk = s / B,
//     off = s % B (B of group dsa_group):
//       value = blk * B * (V + S) + off * V,  scale = blk * B * (V + S) + B * V + off * S  (s < 0: -1)
//       ctx = p + 1 (saturating);  req_id_per_token = b.
//     Padding and invalid tokens (dummy rows included): -1, -1, 0, 0, 0, -1.
//   * The DSA blocks (row 1 of the grid, gridDim.x blocks of which the first token_blocks work;
//     they wait for no block of row 0 and write no error record: the step's token and request
//     blocks record every error of the same inputs) write what needs the prefills' prefix: a
//     prefill token's ks (the seq_lens of the prefills before its request) and ke = ks + ctx, and
//     cu_seq_lens (block 0). DSA block k owns the tokens [k * VLLM_THREADS, +VLLM_THREADS):
//       1. One round of loads: thread i loads query_start_loc and idx_mapping of the first tile's
//          requests [i * VLLM_DSA_R, +VLLM_DSA_R) (a tile: VLLM_DSA_TILE requests, kept for 3)
//          and, past the tile, query_start_loc alone (VLLM_DSA_VOTE requests a thread a round).
//          A block vote (__syncthreads_or) asks whether any request runs more than
//          dsa_decode_len tokens (a prefill does; a bad one with as many only takes 2).
//       2. None (a decode step, plain or MTP): block 0 writes cu_seq_lens = 0 and every block
//          returns. Otherwise each thread finds its token's owner as the step's token blocks do
//          (the guess min(t, n - 1), then vllm_owner_search, over query_start_loc staged in
//          shared memory from the registers of 1 when num_reqs + 1 <= VLLM_QSL_SMEM, else in
//          global memory) and whether the token is a candidate (t < num_tokens, inside its
//          owner's range, the owner running more than dsa_decode_len tokens). A block other than
//          block 0 with no candidate returns (a second vote).
//       3. The block walks the batch a tile at a time (VLLM_DSA_R consecutive requests a thread,
//          every load issued before any is used): a thread computes whether each of its requests
//          is a prefill (a good request running more than dsa_decode_len tokens) and its seq_len
//          (num_computed_tokens + its tokens, saturating as seq_lens); a block scan of the thread
//          sums gives each prefill its ks and ordinal (block 0 writes cu_seq_lens[ord] = ks),
//          staged in shared memory with its num_computed_tokens, and a candidate whose owner lies
//          in the tile reads them there. A candidate whose owner is a prefill (so the token is
//          valid) writes ks and ke = ks + (num_computed_tokens + t - q0) + 1 (saturating); block 0
//          writes cu_seq_lens[P .. max_num_reqs] = the total of the P prefills' seq_lens.
// The token role writes a token's ks and ke exactly when the DSA blocks do not (the same owner,
// range and row from the same inputs), so every element of every DSA output is written by one
// thread on every launch.

// ---- the DSA blocks' helpers (emulated on the CPU by tests/support/vllm_emulator.py) ----

#define VLLM_DSA_R 8                                 // consecutive requests per thread in a tile
#define VLLM_DSA_TILE (VLLM_THREADS * VLLM_DSA_R)  // requests per tile (staged ks and num_computed_tokens)
#define VLLM_DSA_VOTE 8                              // requests a thread votes on per round past the first tile
// A batch whose query_start_loc fits the staged copy (num_reqs + 1 <= VLLM_QSL_SMEM) fits the first tile.
static_assert(VLLM_QSL_SMEM <= VLLM_DSA_TILE + 1, "the staged query_start_loc comes from the first tile's loads");

// The loads of requests [first, first + VLLM_DSA_R) of a tile, every one issued before any is used:
// q[u] = query_start_loc[first + u] for first + u <= num_reqs (0 past it), r[u] their rows when in
// [0, max_num_reqs), else -1 (a dummy or bad row; past num_reqs too).
__device__ __forceinline__ void vllm_dsa_load(const VllmStepParams& p, int first, int (&q)[VLLM_DSA_R + 1],
                                              int (&r)[VLLM_DSA_R]) {
    const int n = p.num_reqs;
#pragma unroll
    for (int u = 0; u <= VLLM_DSA_R; ++u) q[u] = first + u <= n ? p.query_start_loc[first + u] : 0;
#pragma unroll
    for (int u = 0; u < VLLM_DSA_R; ++u) {
        const long long x = first + u < n ? vllm_row_of(p, first + u) : -1;
        r[u] = x >= 0 && x < p.max_num_reqs ? (int)x : -1;
    }
}

// Whether one of requests [first, first + VLLM_DSA_R) (those < num_reqs, loaded in q) runs more
// than dsa_decode_len tokens (good or not).
__device__ __forceinline__ bool vllm_dsa_long(const VllmStepParams& p, int first, const int (&q)[VLLM_DSA_R + 1]) {
    bool any = false;
#pragma unroll
    for (int u = 0; u < VLLM_DSA_R; ++u)
        any |= first + u < p.num_reqs && (long long)q[u + 1] - q[u] > p.dsa_decode_len;
    return any;
}

// The vote past the first tile: whether one of the requests [VLLM_DSA_TILE, num_reqs) that thread
// tid looks at (VLLM_DSA_VOTE a round, coalesced) runs more than dsa_decode_len tokens.
__device__ __forceinline__ bool vllm_dsa_vote_rest(const VllmStepParams& p, int tid) {
    const int n = p.num_reqs;
    const int* __restrict__ qsl = p.query_start_loc;
    bool any = false;
#pragma unroll 1
    for (int b0 = VLLM_DSA_TILE; b0 < n; b0 += VLLM_THREADS * VLLM_DSA_VOTE) {
        int x[VLLM_DSA_VOTE], y[VLLM_DSA_VOTE];
#pragma unroll
        for (int u = 0; u < VLLM_DSA_VOTE; ++u) {
            const int b = b0 + u * VLLM_THREADS + tid;
            x[u] = b < n ? qsl[b] : 0;
            y[u] = b < n ? qsl[b + 1] : 0;
        }
#pragma unroll
        for (int u = 0; u < VLLM_DSA_VOTE; ++u) any |= (long long)y[u] - x[u] > p.dsa_decode_len;
    }
    return any;
}

// Token t's owner b and first token q0 as the step's token blocks find them (the guess
// min(t, n - 1), then vllm_owner_search), over qs (query_start_loc or a copy of its n + 1 entries).
// Returns whether t is a candidate: t < num_tokens, q0 <= t < q1 (q0 >= 0) and the owner runs
// more than dsa_decode_len tokens. A candidate is a valid prefill token exactly when its owner is
// a prefill (vllm_dsa_prefill): the token role leaves its ks and ke to the DSA blocks then.
__device__ __forceinline__ bool vllm_dsa_owner(const VllmStepParams& p, const int* qs, int t, int& b, int& q0) {
    const int n = p.num_reqs;
    b = 0;
    q0 = 0;
    if (n <= 0 || t >= p.max_tokens) return false;
    const int last = qs[n];
    const int num_tokens = last < 0 ? 0 : (last > p.max_tokens ? p.max_tokens : last);
    if (t >= num_tokens) return false;
    b = t < n - 1 ? t : n - 1;
    q0 = qs[b];
    int q1 = qs[b + 1];
    if (!(q0 <= t && t < q1)) {
        b = vllm_owner_search(qs, n, t);
        q0 = qs[b];
        q1 = qs[b + 1];
    }
    return q0 >= 0 && q0 <= t && t < q1 && q1 - q0 > p.dsa_decode_len;
}

// A request's prefill length from its loads (range [q0, q1), row r, num_computed_tokens nct, read
// only for a row in range): its seq_len (saturating) when it is a good request running more than
// dsa_decode_len tokens, else -1.
__device__ __forceinline__ int vllm_dsa_prefill(const VllmStepParams& p, int q0, int q1, long long r, int nct) {
    if (r < 0 || r >= p.max_num_reqs || q0 < 0 || q1 < q0 || nct < 0 || q1 - q0 <= p.dsa_decode_len) return -1;
    const long long s = (long long)nct + ((long long)q1 - q0);
    return (int)(s > VLLM_INT_MAX ? VLLM_INT_MAX : s);
}

// A prefill's token t (first token q0 of its request, whose ks and num_computed_tokens are ks and
// nct): ks and ke = ks + ctx, ctx = nct + (t - q0) + 1 (saturating).
__device__ __forceinline__ void vllm_dsa_prefill_token(const VllmStepParams& p, int t, int q0, int ks, int nct) {
    const long long e = (long long)ks + nct + (t - q0) + 1;
    p.dsa_ks[t] = ks;
    p.dsa_ke[t] = (int)(e > VLLM_INT_MAX ? VLLM_INT_MAX : e);
}

// ---- the DSA block of the vLLM step (row 1 of vllm_step<ATTENTION, true>'s grid) ----

// DSA block blockIdx.x (see the section comment); sq: the step's VLLM_QSL_SMEM entries of shared memory.
__device__ void vllm_dsa_block(const VllmStepParams& p, int* sq) {
    __shared__ int tile_ks[VLLM_DSA_TILE];   // ks of the tile's requests (-1: not a prefill)
    __shared__ int tile_nct[VLLM_DSA_TILE];  // their num_computed_tokens (prefills only)
    __shared__ int red[2][VLLM_WARPS];       // per warp: seq_len sum, prefill count
    const int tid = (int)threadIdx.x, lane = tid & 31, warp = tid >> 5, k = (int)blockIdx.x;
    const int n = p.num_reqs, M = p.max_num_reqs;
    if (k >= p.token_blocks) return;  // (uniform) no tokens; block 0 always has some
    // 1. one round of loads: the first tile's requests and, past it, the vote's
    int q[VLLM_DSA_R + 1];
    int r[VLLM_DSA_R];
    vllm_dsa_load(p, tid * VLLM_DSA_R, q, r);
    const bool rest = vllm_dsa_vote_rest(p, tid);
    // 2. a decode step: cu_seq_lens = 0, nothing else (the token blocks wrote every ks and ke)
    if (!__syncthreads_or(rest || vllm_dsa_long(p, tid * VLLM_DSA_R, q))) {
        if (k == 0)
            for (int i = tid; i <= M; i += VLLM_THREADS) p.dsa_cu_seq_lens[i] = 0;
        return;
    }
    const bool staged = n + 1 <= VLLM_QSL_SMEM;  // (uniform; then n < VLLM_DSA_TILE: q holds all of it)
    if (staged) {
#pragma unroll
        for (int u = 0; u < VLLM_DSA_R; ++u)
            if (tid * VLLM_DSA_R + u <= n) sq[tid * VLLM_DSA_R + u] = q[u];
    }
    __syncthreads();
    const int t = k * VLLM_THREADS + tid;
    int b = 0, q0 = 0;
    const bool cand = vllm_dsa_owner(p, staged ? sq : p.query_start_loc, t, b, q0);
    if (!__syncthreads_or(cand) && k != 0) return;  // (uniform) no prefill token here; block 0 writes cu_seq_lens
    // 3. the tiles, scanned
    int ks = -1, nct_b = 0, carry_len = 0, carry_cnt = 0;
#pragma unroll 1
    for (int base = 0; base < n; base += VLLM_DSA_TILE) {
        const int first = base + tid * VLLM_DSA_R;  // this thread's requests [first, first + R)
        if (base > 0) vllm_dsa_load(p, first, q, r);
        int nct[VLLM_DSA_R], len[VLLM_DSA_R];
#pragma unroll
        for (int u = 0; u < VLLM_DSA_R; ++u) nct[u] = r[u] >= 0 ? p.num_computed_tokens[r[u]] : 0;
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
            tile_nct[tid * VLLM_DSA_R + u] = nct[u];
            if (len[u] >= 0) {
                if (k == 0 && ord <= M) p.dsa_cu_seq_lens[ord] = run;
                run = kv_sat_add_nn(run, len[u]);
                ++ord;
            }
        }
        __syncthreads();
        if (cand && b >= base && b - base < VLLM_DSA_TILE) {
            ks = tile_ks[b - base];
            nct_b = tile_nct[b - base];
        }
        __syncthreads();  // the tile's ks and the warp sums are read before the next tile writes them
        carry_len = tx;
        carry_cnt = tc;
    }
    if (cand && ks >= 0) vllm_dsa_prefill_token(p, t, q0, ks, nct_b);
    if (k == 0)
        for (int i = carry_cnt + tid; i <= M; i += VLLM_THREADS) p.dsa_cu_seq_lens[i] = carry_len;
}
