// DeepSeek-V3.2 sparse attention (DSA) outputs of the vLLM step (docs/dsa.md, "The vLLM step";
// kvaddr/engines/vllm_reference.py's vllm_dsa_reference is the oracle), written in the step's
// own launch by vllm_step<ATTENTION, true>. Two parts of the launch write them, each what it knows:
//
//   * The step's token role (vllm_token_write<DCP, true>, vllm.cuh) writes each token's value and
//     scale offsets, ctx and req_id where it writes its slot of group dsa_group, and ks = ke = 0
//     for every token that is not a prefill's (vllm_dsa_token_write). For a valid token t of
//     request b at position p, slot s of group dsa_group (blk = s / B, off = s % B; -1 included):
//       value = blk * B * (V + S) + off * V,  scale = blk * B * (V + S) + B * V + off * S  (s < 0: -1)
//       ctx = p + 1;  req_id = b;
//     padding and invalid tokens (dummy rows included): -1, -1, 0, -1, and ks = ke = 0. A prefill's
//     token is a valid token whose request runs more than dsa_decode_len tokens (q1 - q0, known there).
//   * Row 1 of a two-row grid (the step's grid is row 0) holds the DSA blocks, which wait for no
//     block of row 0 and write no error record (the step's token and request blocks record every
//     error of the same inputs). They write what needs the prefills' prefix: ks and ke of the
//     prefills' tokens (ks = the seq_lens of the prefills before the token's, ke = ks + ctx), and
//     cu_seq_lens. A token's ks and ke are written by exactly one thread: the token role's (not a
//     prefill's token) or its DSA block's (a prefill's).
//
// DSA block k < token_blocks owns the tokens [k * VLLM_THREADS, +VLLM_THREADS), one a thread;
// blocks past them return at once (block 0, which always has tokens, also writes cu_seq_lens).
//   1. The vote: one pass over query_start_loc (staged in shared memory on the way when
//      num_reqs + 1 <= VLLM_QSL_SMEM), VLLM_DSA_VOTE requests a thread, every load in flight;
//      a block vote asks whether any request runs more than dsa_decode_len tokens (good or not:
//      a batch without one has no prefill token). None (a decode batch, plain or MTP): block 0
//      writes cu_seq_lens = 0, and every block is done.
//   2. Each thread finds its token's owner as the token role does (the guess min(t, n - 1), then
//      vllm_owner_search over the staged or the global query_start_loc: the same owner for any
//      query_start_loc, even a decreasing one) and whether the token may be a prefill's (t <
//      num_tokens, the owner's range holds t and runs more than dsa_decode_len tokens). A block
//      other than block 0 with no such token is done (a second vote).
//   3. The block walks the batch VLLM_THREADS * VLLM_DSA_R requests at a time (a tile; VLLM_DSA_R
//      consecutive requests a thread, every load issued before any is used): a thread computes
//      whether each of its requests is a prefill (a good request: a real row, num_computed_tokens
//      >= 0, a good range, running more than dsa_decode_len tokens) and its seq_len
//      (num_computed_tokens + its tokens, saturating as seq_lens); a block scan of the thread sums
//      gives each prefill its ks and its ordinal (block 0 writes cu_seq_lens[ord] = ks), staged in
//      shared memory with its num_computed_tokens, and a candidate token whose owner lies in the
//      tile and is a prefill writes ks and ke = ks + min(p + 1, 2^31 - 1), saturating. Block 0
//      writes cu_seq_lens[P .. max_num_reqs] = the total of the P prefills' seq_lens.
// Every element of every DSA output is written on every launch. Shared memory: the staged
// query_start_loc (the step's own array, passed in), the tile's ks and num_computed_tokens (16 KB).

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

// Token t (< max_tokens, num_reqs >= 1)'s owner b and its first token q0, found as the token role
// finds them (the guess, then the search of qsl: query_start_loc itself or its staged copy);
// whether t may be a prefill's token: t < num_tokens, q0 <= t < q1, q1 - q0 > dsa_decode_len (it
// is one when b is a good request, which vllm_dsa_prefill tells).
__device__ __forceinline__ bool vllm_dsa_candidate(const VllmStepParams& p, const int* qsl, int t, int& b, int& q0) {
    const int n = p.num_reqs;
    const int last = qsl[n];
    const int num_tokens = last < 0 ? 0 : (last > p.max_tokens ? p.max_tokens : last);
    b = t < n - 1 ? t : n - 1;
    q0 = qsl[b];
    int q1 = qsl[b + 1];
    if (t >= num_tokens) return false;
    if (!(q0 <= t && t < q1)) {
        b = vllm_owner_search(qsl, n, t);
        q0 = qsl[b];
        q1 = qsl[b + 1];
    }
    return q0 >= 0 && q0 <= t && t < q1 && q1 - q0 > p.dsa_decode_len;
}

// A prefill's token t (position nct + t - q0): its ks and ke = ks + ctx (saturating).
__device__ __forceinline__ void vllm_dsa_prefill_token(const VllmStepParams& p, int t, int ks, int nct, int q0) {
    const long long pos1 = (long long)nct + (t - q0) + 1;
    const long long ctx = pos1 > VLLM_INT_MAX ? VLLM_INT_MAX : pos1;
    const long long e = (long long)ks + ctx;
    p.dsa_ks[t] = ks;
    p.dsa_ke[t] = (int)(e > VLLM_INT_MAX ? VLLM_INT_MAX : e);
}

// ---- the DSA block of the vLLM step (row 1 of vllm_step<ATTENTION, true>'s grid) ----

#define VLLM_DSA_R 8     // consecutive requests per thread in a tile (all their loads in flight)
#define VLLM_DSA_VOTE 8  // requests per thread per round of the vote (all their loads in flight)

__device__ void vllm_dsa_block(const VllmStepParams& p, int* sq) {
    __shared__ int tile_ks[VLLM_THREADS * VLLM_DSA_R];   // ks of the tile's requests (-1: not a prefill)
    __shared__ int tile_nct[VLLM_THREADS * VLLM_DSA_R];  // their num_computed_tokens
    __shared__ int red[2][VLLM_WARPS];                   // per warp: seq_len sum, prefill count
    const int tid = (int)threadIdx.x, lane = tid & 31, warp = tid >> 5, k = (int)blockIdx.x;
    const int n = p.num_reqs, thr = p.dsa_decode_len;
    if (k >= p.token_blocks) return;  // (uniform) no tokens; block 0 always has some
    const bool stage = n + 1 <= VLLM_QSL_SMEM;
    // 1. the vote over query_start_loc (staged on the way)
    bool any = false;
#pragma unroll 1
    for (int b0 = 0; b0 < n; b0 += VLLM_THREADS * VLLM_DSA_VOTE) {
        int a[VLLM_DSA_VOTE], c[VLLM_DSA_VOTE];
#pragma unroll
        for (int u = 0; u < VLLM_DSA_VOTE; ++u) {
            const int b = b0 + u * VLLM_THREADS + tid;
            a[u] = b < n ? p.query_start_loc[b] : 0;
            c[u] = b < n ? p.query_start_loc[b + 1] : 0;
        }
#pragma unroll
        for (int u = 0; u < VLLM_DSA_VOTE; ++u) {
            const int b = b0 + u * VLLM_THREADS + tid;
            any |= (long long)c[u] - a[u] > thr;
            if (stage && b < n) sq[b] = a[u];
            if (stage && b + 1 == n) sq[n] = c[u];
        }
    }
    if (!__syncthreads_or(any)) {  // a decode batch: no prefill token, every prefix 0
        if (k == 0)
            for (int i = tid; i <= p.max_num_reqs; i += VLLM_THREADS) p.dsa_cu_seq_lens[i] = 0;
        return;
    }
    // 2. this thread's token: a prefill's token maybe?
    const int t = k * VLLM_THREADS + tid;
    int b = 0, q0 = 0;
    const bool cand = t < p.max_tokens && vllm_dsa_candidate(p, stage ? sq : p.query_start_loc, t, b, q0);
    if (!__syncthreads_or(cand) && k != 0) return;  // (uniform) no prefill's token here
    // 3. the tiles: scan, cu_seq_lens (block 0), the candidates' ks and ke
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
            tile_nct[tid * VLLM_DSA_R + u] = nct[u];
            if (len[u] >= 0) {
                if (k == 0 && ord <= p.max_num_reqs) p.dsa_cu_seq_lens[ord] = run;
                run = kv_sat_add_nn(run, len[u]);
                ++ord;
            }
        }
        __syncthreads();
        if (cand && b >= base && b - base < VLLM_THREADS * VLLM_DSA_R) {
            const int ks = tile_ks[b - base];
            if (ks >= 0) vllm_dsa_prefill_token(p, t, ks, tile_nct[b - base], q0);
        }
        __syncthreads();  // the tile and the warp sums are read before the next tile writes them
        carry_len = tx;
        carry_cnt = tc;
    }
    if (k == 0)
        for (int i = carry_cnt + tid; i <= p.max_num_reqs; i += VLLM_THREADS) p.dsa_cu_seq_lens[i] = carry_len;
}
