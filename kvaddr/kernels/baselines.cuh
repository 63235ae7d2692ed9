// The baselines: what the profiler measures the library's kernels against. extern "C" kernels,
// compiled only with KV_BASELINES defined (kernels.cu); launched by kvaddr/strategies/ and the
// benchmarks.

// One cache's slot mapping from positions and batch ids (the per-layer, one-kernel
// baseline). Padding (batch id < 0) and bad addresses give -1; nothing out of bounds.
template <typename PosT>
__device__ __forceinline__ void kv_slots(const PosT* __restrict__ pos, const int* __restrict__ batch,
                                         const int* __restrict__ table, i64 stride, int width, int B,
                                         int capacity, i64* __restrict__ out) {
    int t = blockIdx.x * KV_THREADS + threadIdx.x;
    if (t >= capacity) return;
    int b = batch[t];
    i64 slot = -1;
    if (b >= 0) {
        i64 p = (i64)pos[t];
        if (p >= 0) {
            i64 idx, off;
            kv_divmod(p, B, idx, off);
            if (idx < width) {
                int blk = table[(i64)b * stride + idx];
                if (blk >= 0) slot = (i64)blk * B + off;
            }
        }
    }
    out[t] = slot;
}

// Parameters, in order (kvaddr/strategies/gpu.py's SlotsArgs names them):
//   pos       [capacity], int64 / int32: position_ids
//   batch     [capacity], int32: batch_id_per_token (-1 padding)
//   table     [rows, width], int32: one cache's block table, rows `stride` elements apart
//   stride    int64: the table's row stride, in elements
//   width     int32: the table's row length (max_blocks)
//   B         int32: block size
//   capacity  int32: C, tokens
//   out       [capacity], int64: that cache's slot mapping
extern "C" __global__ void __launch_bounds__(KV_THREADS)
kvaddr_slots_i64(const i64* __restrict__ pos, const int* __restrict__ batch, const int* __restrict__ table,
                 i64 stride, int width, int B, int capacity, i64* __restrict__ out) {
    kv_slots<i64>(pos, batch, table, stride, width, B, capacity, out);
}

extern "C" __global__ void __launch_bounds__(KV_THREADS)
kvaddr_slots_i32(const int* __restrict__ pos, const int* __restrict__ batch, const int* __restrict__ table,
                 i64 stride, int width, int B, int capacity, i64* __restrict__ out) {
    kv_slots<int>(pos, batch, table, stride, width, B, capacity, out);
}

// The per-layer op chain's last step, the "where" a framework chain needs for padding
// and bad addresses: slot = -1 where batch < 0, idx >= width or blk < 0. Parameters
// (kvaddr/strategies/gpu.py's WhereArgs names them):
//   batch     [capacity], int32: batch_id_per_token
//   idx       [capacity], int64: block index pos // B
//   blk       [capacity], int32: gathered block id
//   width     int32: the table's row length
//   capacity  int32: C
//   slot      [capacity], int64: the slot mapping, fixed in place
extern "C" __global__ void __launch_bounds__(KV_THREADS)
kvaddr_where_pad(const int* __restrict__ batch, const i64* __restrict__ idx, const int* __restrict__ blk,
                 int width, int capacity, i64* __restrict__ slot) {
    int t = blockIdx.x * KV_THREADS + threadIdx.x;
    if (t >= capacity) return;
    if (batch[t] < 0 || idx[t] >= width || blk[t] < 0) slot[t] = -1;
}

// ---- attention metadata built the way engines build it today (separate launches) ----
// What the per-layer / per-layer-kernel / hoisted baselines run once per step when
// asked for attention outputs (kvaddr/strategies/gpu.py's EngineAttention): per cache
// pages, a cumsum for kv_indptr, a per-request copy of row prefixes into kv_indices
// (vLLM's FlashInfer backend copies page indices with one program per request), the
// -1 tail, kv_last_page_len; for varlen a cumsum and two max reductions. No checks
// (bad values are the fused step's business), nothing read past a row or written past N.

// pages[b] = ceil(seq_lens[b] / B) (0 for seq_lens <= 0). Parameters:
//   seq_lens  [n], int32: seq_lens_kv
//   n         int32: bsz
//   B         int32: block size
//   pages     [n], int32: out
extern "C" __global__ void __launch_bounds__(KV_THREADS)
kvaddr_engine_pages(const int* __restrict__ seq_lens, int n, int B, int* __restrict__ pages) {
    const int b = blockIdx.x * KV_THREADS + threadIdx.x;
    if (b < n) pages[b] = seq_lens[b] > 0 ? kv_pages(seq_lens[b], B) : 0;
}

// out[0] = 0, out[i + 1] = x[0] + ... + x[i] (saturating): one block of KV_THREADS
// threads, KV_THREADS items per round (a cumsum launch). Parameters:
//   x         [n], int32: non-negative
//   n         int32
//   out       [n + 1], int32
extern "C" __global__ void __launch_bounds__(KV_THREADS)
kvaddr_engine_cumsum(const int* __restrict__ x, int n, int* __restrict__ out) {
    __shared__ int wsum[KV_WARPS];
    __shared__ int carry;
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    if (threadIdx.x == 0) {
        carry = 0;
        out[0] = 0;
    }
    __syncthreads();
    for (int base = 0; base < n; base += KV_THREADS) {
        const int i = base + (int)threadIdx.x;
        const int v = i < n ? max(x[i], 0) : 0;
        const int inc = kv_warp_inclusive(v);
        if (lane == 31) wsum[warp] = inc;
        __syncthreads();
        int before, total;
        kv_warp_prefix(wsum, warp, before, total);
        const int c = carry;
        if (i < n) out[i + 1] = kv_sat_add(c, kv_sat_add(before, inc));
        __syncthreads();
        if (threadIdx.x == 0) carry = kv_sat_add(c, total);
        __syncthreads();
    }
}

// kv_indices[indptr[b] + j] = table[b, j] for j < indptr[b + 1] - indptr[b] (-1 for j >= width:
// the row is never read past its end), entries below N only: one block per request. Parameters:
//   indptr    [bsz + 1], int32: kv_indptr of this cache
//   table     [rows >= bsz, width], int32, rows `stride` elements apart
//   stride    int64: the table's row stride, in elements
//   width     int32: the table's row length
//   N         int32: kv_indices capacity
//   out       [N], int32: this cache's kv_indices
extern "C" __global__ void __launch_bounds__(KV_THREADS)
kvaddr_engine_copy_pages(const int* __restrict__ indptr, const int* __restrict__ table, i64 stride, int width,
                         int N, int* __restrict__ out) {
    const int b = blockIdx.x;
    const int start = indptr[b];
    const int n = indptr[b + 1] - start;
    for (int j = threadIdx.x; j < n && start + j < N; j += KV_THREADS)
        out[start + j] = j < width ? table[(i64)b * stride + j] : -1;
}

// kv_indices[e] = -1 for e in [indptr[bsz], N). Parameters:
//   indptr    [bsz + 1], int32
//   bsz       int32
//   N         int32
//   out       [N], int32
extern "C" __global__ void __launch_bounds__(KV_THREADS)
kvaddr_engine_pad_pages(const int* __restrict__ indptr, int bsz, int N, int* __restrict__ out) {
    const int e = blockIdx.x * KV_THREADS + threadIdx.x;
    if (e < N && e >= indptr[bsz]) out[e] = -1;
}

// last[b] = (seq_lens[b] - 1) % B + 1, 0 for seq_lens <= 0. Parameters:
//   seq_lens  [n], int32
//   n         int32
//   B         int32
//   last      [n], int32: kv_last_page_len of this cache
extern "C" __global__ void __launch_bounds__(KV_THREADS)
kvaddr_engine_last_page(const int* __restrict__ seq_lens, int n, int B, int* __restrict__ last) {
    const int b = blockIdx.x * KV_THREADS + threadIdx.x;
    if (b < n) {
        const int L = seq_lens[b];
        last[b] = L > 0 ? (int)((unsigned int)(L - 1) % (unsigned int)B) + 1 : 0;
    }
}

// *out = max over i < n of x[i + 1] - x[i] (diff = 1) or of x[i] (diff = 0); 0 for
// n = 0: one block (a max-reduction launch). Parameters:
//   x         [n + diff], int32
//   n         int32
//   diff      int32: 1 or 0
//   out       [], int32
extern "C" __global__ void __launch_bounds__(KV_THREADS)
kvaddr_engine_max(const int* __restrict__ x, int n, int diff, int* __restrict__ out) {
    __shared__ int wmax[KV_WARPS];
    int m = 0;
    for (int i = threadIdx.x; i < n; i += KV_THREADS) m = max(m, diff ? x[i + 1] - x[i] : x[i]);
    m = __reduce_max_sync(0xffffffffu, m);
    if ((threadIdx.x & 31) == 0) wmax[threadIdx.x >> 5] = m;
    __syncthreads();
    if (threadIdx.x == 0) {
        int r = 0;
#pragma unroll
        for (int w = 0; w < KV_WARPS; ++w) r = max(r, wmax[w]);
        *out = r;
    }
}

// An empty kernel: the launch floor.
extern "C" __global__ void kvaddr_empty() {}

// FastDeploy's one-block step, written here from its description: ONE block of one thread per request (<<<1, bsz>>>, so bsz <= 1024);
// thread b adds up the earlier requests' lengths serially (its cu_seqlens_q start),
// then loops over its own tokens writing batch id, position and every cache's slot.
// What kvaddr's contract adds to FastDeploy's op, so the outputs equal the reference's
// for every input: bad lengths (either negative) run no tokens; tokens past the capacity
// are dropped; bad addresses give slot -1 and nothing is read outside the tables; after
// one barrier the block strides over the padding tokens [num_tokens, capacity). Error
// record: bits 4 and 8 (those of the other baselines' position kernel; bits 1 and 2 are
// not recorded), as (mask, first-bad key), rewritten every launch (graph-replay safe).
// Launched by kvaddr/strategies/gpu.py (OneBlock) and benchmarks/floor_step.py with
// blockDim = max(bsz, 1). Its one parameter is a KvOneBlockParams, passed by value
// (kvaddr/kernel_loader.py's OneBlockParams mirrors it; tests/unit/test_kernel_params.py
// checks the layout with nvcc).
#define KV_ONE_BLOCK_MAX_REQUESTS 1024

struct KvOneBlockParams {
    // -- inputs (read only) --
    const int* seq_lens_decoder;             // [bsz], int32: tokens already in each request's KV cache
    const int* seq_lens_this_time;           // [bsz], int32: tokens each request runs this step
    const int* block_tables[KV_MAX_CACHES];  // cache g: [rows >= bsz, max_blocks[g]], int32, rows
                                             // table_stride[g] elements apart; null for an unused cache
    // -- outputs (written every launch) --
    int* cu_seqlens_q;                       // [bsz + 1], int32: exclusive prefix of the tokens
    int* num_tokens;                         // [] (one value), int32: min(total tokens, capacity)
    int* batch_id_per_token;                 // [capacity], int32: request of each token, -1 for padding
    void* position_ids;                      // [capacity], int64 (kvaddr_one_block_i64) or int32 (_i32)
    int* seq_lens_kv;                        // [bsz], int32: seq_lens_decoder + seq_lens_this_time
    i64* slot_mapping;                       // [num_caches, capacity], int64: cache slot, -1 padding/bad
    u64* error_record;                       // [2], uint64: (error mask, first-bad key), rewritten every launch
    // -- scalars --
    i64 table_stride[KV_MAX_CACHES];         // row stride of block_tables[g], in elements (int64)
    int max_blocks[KV_MAX_CACHES];           // row length of block_tables[g], int32 (1 for an unused cache)
    int block_size[KV_MAX_CACHES];           // B of cache g, int32 >= 1 (1 for an unused cache)
    int bsz;                                 // requests this step, int32 in [0, KV_ONE_BLOCK_MAX_REQUESTS]
    int capacity;                            // C: tokens of every per-token output, int32 >= 1
    int num_caches;                          // caches addressed, int32 in [0, KV_MAX_CACHES]
    int reserved;                            // int32, unused (keeps the struct free of tail padding)
};
static_assert(sizeof(KvOneBlockParams) == 13 * 8 + KV_MAX_CACHES * (8 + 4 + 4) + 4 * 4,
              "KvOneBlockParams has no padding (the ctypes mirror assumes the C layout)");

template <typename PosT>
__device__ __forceinline__ void kv_one_block(const KvOneBlockParams& p) {
    __shared__ unsigned int s_mask;
    __shared__ u64 s_key;
    __shared__ int s_num_tokens;
    const int b = threadIdx.x, bsz = p.bsz, capacity = p.capacity;
    if (b == 0) {
        s_mask = 0u;
        s_key = KV_NO_ERROR;
        p.cu_seqlens_q[0] = 0;
        if (bsz == 0) {
            s_num_tokens = 0;
            *p.num_tokens = 0;
        }
    }
    __syncthreads();
    if (b < bsz) {
        const int* __restrict__ dec = p.seq_lens_decoder;
        const int* __restrict__ q = p.seq_lens_this_time;
        i64 start = 0;  // the serial prefix: every earlier good request's tokens
        for (int j = 0; j < b; ++j) {
            const int dj = dec[j], nj = q[j];
            if ((dj | nj) >= 0) start += nj;
        }
        const int d = dec[b];
        int n = q[b];
        const bool bad = (d | n) < 0;
        if (bad) n = 0;
        const i64 end = start + n;
        p.cu_seqlens_q[b + 1] = (int)(end < KV_INT_MAX ? end : KV_INT_MAX);
        p.seq_lens_kv[b] = bad ? 0 : (d > KV_INT_MAX - n ? KV_INT_MAX : d + n);
        if (b == bsz - 1) {
            const int nt = (int)(end < capacity ? end : capacity);
            s_num_tokens = nt;
            *p.num_tokens = nt;
        }
        unsigned int mask = 0u;
        u64 key = KV_NO_ERROR;
        if (bad) {
            mask = KV_ERR_NEGATIVE_LENGTH;
            key = kv_err_key((u64)(start < KV_INT_MAX ? start : KV_INT_MAX), (u64)b, 0ULL,
                             KV_ERR_LOG2(KV_ERR_NEGATIVE_LENGTH));
        } else if (start <= capacity && capacity < end) {  // this request owns token C, the first dropped
            mask = KV_ERR_CAPACITY;
            key = kv_err_key((u64)capacity, (u64)b, 0ULL, KV_ERR_LOG2(KV_ERR_CAPACITY));
        }
        if (mask) {
            atomicOr(&s_mask, mask);
            atomicMin(&s_key, key);
        }
        PosT* __restrict__ pos_out = static_cast<PosT*>(p.position_ids);
        const int stop = (int)(end < capacity ? end : capacity);
        for (int t = (int)(start < capacity ? start : capacity); t < stop; ++t) {
            const i64 pos = (i64)d + (t - start);
            p.batch_id_per_token[t] = b;
            pos_out[t] = (PosT)pos;
#pragma unroll
            for (int g = 0; g < KV_MAX_CACHES; ++g) {
                if (g < p.num_caches) {
                    const int B = p.block_size[g];
                    i64 idx, off;
                    if (pos <= KV_INT_MAX) {  // 32-bit division when it fits
                        const unsigned int qd = (unsigned int)pos / (unsigned int)B;
                        idx = qd;
                        off = (unsigned int)pos - qd * (unsigned int)B;
                    } else {
                        idx = pos / B;
                        off = pos - idx * B;
                    }
                    i64 slot = -1;
                    if (idx < p.max_blocks[g]) {
                        const int blk = p.block_tables[g][(i64)b * p.table_stride[g] + idx];
                        if (blk >= 0) slot = (i64)blk * B + off;
                    }
                    p.slot_mapping[(i64)g * capacity + t] = slot;
                }
            }
        }
    }
    __syncthreads();
    if (b == 0) {
        p.error_record[0] = s_mask;
        p.error_record[1] = s_key;
    }
    // Padding [num_tokens, capacity): the whole block strides over it.
    PosT* __restrict__ pos_out = static_cast<PosT*>(p.position_ids);
    for (int t = s_num_tokens + b; t < capacity; t += blockDim.x) {
        p.batch_id_per_token[t] = -1;
        pos_out[t] = 0;
#pragma unroll
        for (int g = 0; g < KV_MAX_CACHES; ++g) {
            if (g < p.num_caches) p.slot_mapping[(i64)g * capacity + t] = -1;
        }
    }
}

// The one-block step, position_ids int64 / int32: <<<1, max(bsz, 1)>>>, one parameter.
extern "C" __global__ void __launch_bounds__(KV_ONE_BLOCK_MAX_REQUESTS)
kvaddr_one_block_i64(const KvOneBlockParams params) {
    kv_one_block<i64>(params);
}

extern "C" __global__ void __launch_bounds__(KV_ONE_BLOCK_MAX_REQUESTS)
kvaddr_one_block_i32(const KvOneBlockParams params) {
    kv_one_block<int>(params);
}


// FastDeploy's MTP substep preparation, written here from its description: before each draft
// substep a one-block kernel (<<<1, max(bsz, 1)>>>, a thread per request, bsz <= 512 in
// FastDeploy) writes the substep's seq_lens_decoder and seq_lens_this_time; the one-block step
// above then addresses it, and the host synchronises before the next substep. Lengths as
// kvaddr/spec_reference.py's mtp_substep_lengths: substep 0 runs accept_num over
// seq_lens_decoder; substep j >= 1 one token for accept_num > 0 over seq_lens_decoder +
// accept_num + j - 1 (saturating), none (or the negative accept_num) for the others.
// Launched by kvaddr/strategies/fastdeploy_mtp.py. Parameters: seq_lens_decoder and accept_num
// (int32 [bsz], read), dec_out and q_out (int32 [bsz]: the substep's seq_lens_decoder and
// seq_lens_this_time, written), bsz (int32 <= KV_ONE_BLOCK_MAX_REQUESTS), substep (int32 j >= 0).
extern "C" __global__ void __launch_bounds__(KV_ONE_BLOCK_MAX_REQUESTS)
kvaddr_mtp_substep_lengths(const int* __restrict__ seq_lens_decoder, const int* __restrict__ accept_num,
                           int* __restrict__ dec_out, int* __restrict__ q_out, int bsz, int substep) {
    const int b = threadIdx.x;
    if (b >= bsz) return;
    const int d = seq_lens_decoder[b], a = accept_num[b];
    int dj = d, qj = a;
    if (substep > 0) {
        if (a > 0) {
            const i64 v = (i64)d + (i64)a + (i64)(substep - 1);
            dj = (int)(v < (i64)KV_INT_MAX ? v : (i64)KV_INT_MAX);
            qj = 1;
        } else {
            qj = a < 0 ? a : 0;
        }
    }
    dec_out[b] = dj;
    q_out[b] = qj;
}


// =====================================================================================
// ==== The engines' top-k -> slot conversion, re-implemented (kvaddr/strategies/dsa_topk.py)
// =====================================================================================
// One program per (token, 128 columns): grid (T, ceil(K / 128)), 128 threads, one entry each:
// slots[t, k] = table[req_id[t], topk // B] * B + topk % B, -1 where topk < 0 or the block index
// is past the table's width. No context check, no counts, no error record, no compaction.
// Reads KvDsaTopkParams (kernels/dsa.cuh) for topk, req_id, block_table, slots and the scalars;
// a padding token (req_id < 0) gives -1 so that nothing is read out of bounds.
#define KV_DSA_BASELINE_COLUMNS 128
extern "C" __global__ void __launch_bounds__(KV_DSA_BASELINE_COLUMNS) kvaddr_dsa_topk_baseline(const KvDsaTopkParams p) {
    const int t = blockIdx.x;
    const int col = blockIdx.y * KV_DSA_BASELINE_COLUMNS + threadIdx.x;
    if (col >= p.k) return;
    const i64 at = (i64)t * p.k + col;
    const int req = p.req_id[t];
    const int v = p.topk[at];
    int slot = -1;
    if (v >= 0 && req >= 0) {
        const int blk = v / p.block_size;
        if (blk < p.width) slot = p.block_table[(i64)req * p.table_stride + blk] * p.block_size + v % p.block_size;
    }
    p.slots[at] = slot;
}

// =====================================================================================
// ==== vLLM's per-draft-step design, re-implemented (kvaddr/strategies/vllm_draft_per_step.py)
// =====================================================================================
// vLLM Model Runner V2's speculator prepares each draft step separately: after the verify step,
// a launch for the sampled rows (last_token_indices), then per draft step j a launch that
// advances positions and seq_lens, one slot-mapping launch over (requests, groups) reading those
// positions, and the step's attention metadata (here one kernel per group; vLLM builds it on the
// host). Same outputs as vllm_draft_step (the same helpers), no error checks. The step and group
// come in VllmDraftParams.base_step / base_group. Grids: a thread per batch row, 128 per block.

#define VDRAFT3_THREADS 128

// last_token_indices (and the first forward's mask when mask_rejected: the token columns after
// the rows), grid ceil((max_num_reqs + 1 + token columns) / 128).
extern "C" __global__ void __launch_bounds__(VDRAFT3_THREADS) kvaddr_draft_first(const VllmDraftParams p) {
    VllmErr none;
    none.mask = 0;
    none.key = KV_NO_ERROR;
    const int i = blockIdx.x * VDRAFT3_THREADS + (int)threadIdx.x;
    if (i < p.max_num_reqs) {
        const VdraftReq q = vdraft_row_request(p, i, false, none);
        p.last_token_indices[i] = q.status != 2 ? q.qe - q.rej - 1 : 0;
    } else if (p.token_blocks && i - p.max_num_reqs < p.max_tokens) {
        vdraft_first_slot(p, i - p.max_num_reqs);
    }
}

// Draft step base_step: query_start_loc, positions, seq_lens, DCP lengths; grid ceil((M + 1) / 128).
extern "C" __global__ void __launch_bounds__(VDRAFT3_THREADS) kvaddr_draft_prepare(const VllmDraftParams p) {
    VllmErr none;
    none.mask = 0;
    none.key = KV_NO_ERROR;
    const int b = blockIdx.x * VDRAFT3_THREADS + (int)threadIdx.x, M = p.max_num_reqs, j = p.base_step;
    if (b > M) return;
    p.query_start_loc_out[(long long)(j - 1) * (M + 1) + b] = b < p.num_reqs ? b : p.num_reqs;
    if (b < M) vdraft_row_step(p, b, j, vdraft_row_request(p, b, false, none), false, none);
}

// Draft step base_step's slots from its positions, grid (ceil(M / 128), G).
extern "C" __global__ void __launch_bounds__(VDRAFT3_THREADS) kvaddr_draft_slots(const VllmDraftParams p) {
    VllmErr none;
    none.mask = 0;
    none.key = KV_NO_ERROR;
    const int b = blockIdx.x * VDRAFT3_THREADS + (int)threadIdx.x, g = blockIdx.y, M = p.max_num_reqs;
    const int j = p.base_step;
    if (b >= M) return;
    const VdraftReq q = vdraft_row_request(p, b, false, none);
    const long long pos = p.positions[(long long)(j - 1) * M + b];
    const long long slot = q.status == 0 ? vdraft_slot(p, g, q.r, pos, j, b, none) : -1;
    p.slot_mappings[((long long)(j - 1) * p.num_groups + g) * M + b] = slot;
}

// Draft step base_step's attention metadata of group base_group: meta_chunks blocks of VDRAFT_THREADS.
extern "C" __global__ void __launch_bounds__(VDRAFT_THREADS, 1) kvaddr_draft_meta(const VllmDraftParams p) {
    VllmErr none;
    none.mask = 0;
    none.key = KV_NO_ERROR;
    vdraft_attention_block(p, (p.base_step - 1) * p.num_groups + p.base_group, (int)blockIdx.x, none);
}

// =====================================================================================
// ==== vLLM's three-launch design, re-implemented (kvaddr/strategies/vllm_three_launch.py)
// =====================================================================================
//
// What vllm_step is measured against: vLLM Model Runner V2 prepares
// the same outputs in three launches, in this order and with these grids (kvaddr's
// own code, written from the design, not vLLM's):
//   1. kvaddr_vllm3_prepare   grid (num_reqs + 1): a program per request writes its
//      positions, seq_lens and DCP local length; the last program pads seq_lens (and,
//      for kvaddr's contract, positions past num_tokens and the DCP lengths).
//   2. kvaddr_vllm3_gather    grid (rows, G): a program per batch row and group copies
//      the row's first num_blocks entries (with kvaddr's stale-tail and padding-row
//      zeroing, through the same per-row fill counts, so both designs do the same work).
//   3. kvaddr_vllm3_slots     grid (num_reqs + 1, G): a program per request and group
//      reads the positions launch 1 wrote and writes the slots; the last one pads -1.
// A program is a block of VLLM3_THREADS threads. They take the same VllmStepParams;
// no error checks (vLLM makes none), only the guards that keep reads in bounds.

#define VLLM3_THREADS 128

// vllm_request's test (a real request with good inputs) with group g's num_blocks of the
// row loaded together with its num_computed_tokens; no error records.
__device__ __forceinline__ bool vllm3_request(const VllmStepParams& p, int b, int g, long long& r, int& nct, int& q0,
                                              int& q1, int& nb) {
    q0 = p.query_start_loc[b];
    q1 = p.query_start_loc[b + 1];
    r = vllm_row_of(p, b);
    nct = 0;
    nb = 0;
    if (r < 0 || r >= p.max_num_reqs) return false;
    nb = vllm_pick(p.num_blocks, g)[r];
    nct = p.num_computed_tokens[r];
    return nct >= 0 && q0 >= 0 && q1 >= q0;
}

extern "C" __global__ void __launch_bounds__(VLLM3_THREADS) kvaddr_vllm3_prepare(const VllmStepParams p) {
    const int n = p.num_reqs, b = blockIdx.x;
    VllmErr none;
    none.mask = 0;
    none.key = KV_NO_ERROR;
    if (b < n) {
        long long r;
        int nct, q0, q1;
        const bool good = vllm_request(p, b, r, nct, q0, q1, false, none);
        const int end = q1 < p.max_tokens ? q1 : p.max_tokens;
        for (int t = (q0 < 0 ? 0 : q0) + (int)threadIdx.x; t < end; t += VLLM3_THREADS)
            p.positions[t] = good ? (long long)nct + (t - q0) : 0;
        if (threadIdx.x == 0) {
            int seq = 0;
            if (good) {
                const long long s = (long long)nct + ((long long)q1 - q0);
                seq = (int)(s > VLLM_INT_MAX ? VLLM_INT_MAX : s);
            }
            p.seq_lens[b] = seq;
            p.dcp_local_seq_lens[b] = vllm_dcp_len(p, seq);
        }
        return;
    }
    for (int k = n + (int)threadIdx.x; k < p.max_num_reqs; k += VLLM3_THREADS) {
        p.seq_lens[k] = 0;
        p.dcp_local_seq_lens[k] = 0;
    }
    const int last = p.query_start_loc[n];
    const int num_tokens = last < 0 ? 0 : (last > p.max_tokens ? p.max_tokens : last);
    for (int t = num_tokens + (int)threadIdx.x; t < p.max_tokens; t += VLLM3_THREADS) p.positions[t] = 0;
}

extern "C" __global__ void __launch_bounds__(VLLM3_THREADS) kvaddr_vllm3_gather(const VllmStepParams p) {
    const int b = blockIdx.x, g = blockIdx.y;
    const int W = vllm_pick(p.width, g);
    int* __restrict__ out = vllm_pick(p.gathered, g) + (long long)b * vllm_pick(p.gathered_stride, g);
    int* __restrict__ fill_at = vllm_pick(p.row_fill, g) + b;
    const int fill = *fill_at;
    int nbc = 0, first = 0;
    const int* __restrict__ src = 0;
    if (b < p.num_reqs) {
        long long r;
        int nct, q0, q1, nb;
        if (vllm3_request(p, b, g, r, nct, q0, q1, nb)) {
            nbc = nb < 0 ? 0 : (nb > W ? W : nb);
            src = vllm_pick(p.block_table, g) + r * vllm_pick(p.table_stride, g);
            const int reach = vllm_pick(p.sliding_window_reach, g);
            if (reach > 0) {
                const long long f = ((long long)nct - reach) / vllm_pick(p.block_size, g);
                first = f < 0 ? 0 : (int)(f > W ? W : f);
            }
        }
    }
    // As vLLM's gather: 1024 entries per iteration (8 loads in flight per thread).
    const int end = nbc > fill ? nbc : fill;
    for (int j0 = 0; j0 < end; j0 += 8 * VLLM3_THREADS) {
        int v[8];
#pragma unroll
        for (int k = 0; k < 8; ++k) {
            const int j = j0 + VLLM3_THREADS * k + (int)threadIdx.x;
            v[k] = (j < nbc && j >= first) ? src[j] : 0;
        }
#pragma unroll
        for (int k = 0; k < 8; ++k) {
            const int j = j0 + VLLM3_THREADS * k + (int)threadIdx.x;
            if (j < end) out[j] = v[k];
        }
    }
    __syncthreads();
    if (threadIdx.x == 0) *fill_at = nbc;
}

extern "C" __global__ void __launch_bounds__(VLLM3_THREADS) kvaddr_vllm3_slots(const VllmStepParams p) {
    const int n = p.num_reqs, b = blockIdx.x, g = blockIdx.y;
    if (b == n) {  // the padding program
        const int last = p.query_start_loc[n];
        const int num_tokens = last < 0 ? 0 : (last > p.max_tokens ? p.max_tokens : last);
        for (int t = num_tokens + (int)threadIdx.x; t < p.max_tokens; t += VLLM3_THREADS)
            vllm_store_slot(p, g, t, -1);
        return;
    }
    long long r;
    int nct, q0, q1, nb;
    const bool good = vllm3_request(p, b, g, r, nct, q0, q1, nb);
    const int flags = vllm_pick(p.group_flags, g);
    const unsigned int B = (unsigned int)vllm_pick(p.block_size, g);
    const int W = vllm_pick(p.width, g);
    const int* __restrict__ row = vllm_pick(p.block_table, g) + (good ? r : 0) * vllm_pick(p.table_stride, g);
    const int end = q1 < p.max_tokens ? q1 : p.max_tokens;
    for (int t = (q0 < 0 ? 0 : q0) + (int)threadIdx.x; t < end; t += VLLM3_THREADS) {
        long long slot = -1;
        if (good && (flags & VLLM_GROUP_SLOTS)) {
            const unsigned int up = (unsigned int)p.positions[t];
            unsigned int idx, off;
            bool local = true;
            if (flags & VLLM_GROUP_SHARDED) {
                const unsigned int cp = (unsigned int)p.cp_size, il = (unsigned int)p.cp_interleave;
                const unsigned int vbs = B * cp;
                idx = up / vbs;
                const unsigned int vo = up - idx * vbs;
                local = ((vo / il) % cp) == (unsigned int)p.cp_rank;
                off = (vo / (il * cp)) * il + vo % il;
            } else {
                idx = up / B;
                off = up - idx * B;
            }
            if (local && (long long)idx < (long long)W && (long long)idx < (long long)nb) {
                const int blk = row[idx];
                if (blk >= 0) {
                    slot = (long long)blk * (long long)B + off;
                    if (p.slot_is_32 && slot > VLLM_INT_MAX) slot = -1;
                }
            }
        }
        vllm_store_slot(p, g, t, slot);
    }
}

