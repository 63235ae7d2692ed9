// The vLLM engine step (kvaddr/engines/vllm.py): vLLM Model Runner V2's input preparation in
// ONE launch: positions, seq_lens (zero-padded to max_num_reqs), the slot mapping of every
// KV-cache group (-1 from num_tokens to the end), the batch-order gathered block tables (stale
// and padding rows zeroed, sliding-window nulling) and the DCP local lengths; with
// vllm_step<true>, the attention metadata in the same launch. Semantics: docs/vllm.md and
// kvaddr/engines/vllm_reference.py (the oracle). It uses only common.cuh's helpers; its own
// carry a vllm_ prefix.
//
// Parameters: ONE struct by value (VllmStepParams), mirrored field by field by
// kvaddr/engines/vllm.py (ctypes, filled by name; tests/unit/test_vllm_struct.py
// compares the layouts). Group-indexed fields are only ever indexed with
// compile-time indices (unrolled loops, vllm_pick), so the struct stays in the
// parameter space (no local copy, no stack frame).


#define VLLM_THREADS 256
#define VLLM_WARPS (VLLM_THREADS / 32)
#define VLLM_MAX_GROUPS 4
#define VLLM_INT_MAX 0x7fffffffLL

// Group flags (VllmStepParams.group_flags[g]).
#define VLLM_GROUP_SLOTS 1    // slot mapping enabled
#define VLLM_GROUP_SHARDED 2  // DCP-sharded (cp_size > 1 and the group's dcp_sharded)

// Error bits (kvaddr/engines/vllm_errors.py).
#define VLLM_ERR_BLOCK_INDEX 1
#define VLLM_ERR_NEGATIVE_BLOCK 2
#define VLLM_ERR_CAPACITY 4
#define VLLM_ERR_QUERY_START_LOC 8
#define VLLM_ERR_PAST_NUM_BLOCKS 16
#define VLLM_ERR_ROW_INDEX 32
#define VLLM_ERR_NUM_BLOCKS 64
#define VLLM_ERR_NEGATIVE_COMPUTED 128
#define VLLM_ERR_SLOT_INT32 256

struct VllmStepParams {
    // -- inputs (8-byte fields first) --
    const void* idx_mapping;           // [num_reqs], int32 (idx_is_64 = 0) or int64 (1): batch b -> row r; -1 = dummy
    const int* query_start_loc;        // [num_reqs + 1], int32: request b's tokens are [qsl[b], qsl[b+1])
    const int* num_computed_tokens;    // [>= max_num_reqs], int32, by row r
    const int* block_table[4];         // group g: [>= max_num_reqs, width[g]], int32, row stride table_stride[g]
    const int* num_blocks[4];          // group g: [>= max_num_reqs], int32 (num_blocks_stride apart if stacked)
    const int* num_blocks_src[4];      // staged (vllm_step<..., true>): group g's num_blocks as given, in pinned
                                       // host memory (UVA); vllm_stage_num_blocks copies it into num_blocks[g]
    long long table_stride[4];         // group g: elements between rows of block_table[g]
    // -- outputs --
    long long* positions;              // [max_tokens], int64
    int* seq_lens;                     // [max_num_reqs], int32
    void* slot_mappings;               // [num_groups rows, slot_stride apart][max_tokens], int64 or int32 (slot_is_32)
    long long slot_stride;             // elements between two groups' rows of slot_mappings
    int* gathered[4];                  // group g: [max_num_reqs, width[g]], int32, row stride gathered_stride[g]
    long long gathered_stride[4];      // group g: elements between rows of gathered[g]
    int* dcp_local_seq_lens;           // [max_num_reqs], int32
    // -- persistent scratch (owned by the planner) --
    int* row_fill[4];                  // group g: [max_num_reqs], int32: entries of gathered row b that may be non-zero
    unsigned long long* errors;        // [R, 2], uint64: sticky per-warp error records (mask, first-bad key)
    // -- sizes and settings (4-byte fields) --
    int width[4];                      // group g: columns of block_table[g] and gathered[g] (>= 1)
    int block_size[4];                 // group g: B (>= 1)
    int group_flags[4];                // group g: VLLM_GROUP_SLOTS | VLLM_GROUP_SHARDED
    int sliding_window_reach[4];       // group g: R (0: no sliding window)
    int num_groups;                    // G, 1..4
    int num_reqs;                      // entries of idx_mapping (<= max_num_reqs)
    int num_reqs_padded;               // num_reqs <= . <= max_num_reqs
    int max_num_reqs;                  // rows of the state and of every per-request output
    int max_tokens;                    // max_num_batched_tokens, T
    int idx_is_64;                     // idx_mapping is int64
    int slot_is_32;                    // slot_mappings is int32 (a slot > 2^31-1: error bit, -1)
    int cp_size;                       // DCP ranks (1: no DCP)
    int cp_rank;                       // this rank, 0..cp_size-1
    int cp_interleave;                 // I, divides every sharded group's B
    int token_blocks;                  // blocks [0, token_blocks) address tokens
    int request_blocks;                // the next request_blocks blocks write per-request outputs
    int pair_lanes;                    // lanes per (group, row) pair of the gather, 8/16/32
    // -- attention metadata (vllm_step<true> only) --
    int* qo_indptr;                    // [max_num_reqs + 1], int32: query_start_loc, padded with qsl[num_reqs]
    int* kv_indptr;                    // [num_groups, max_num_reqs + 1], int32 (row g at g * (max_num_reqs + 1))
    int* kv_indices;                   // [num_groups, kv_indices_capacity], int32 (row g at g * capacity)
    int* kv_last_page_len;             // [num_groups, max_num_reqs], int32
    int* cu_seqlens_k;                 // [num_groups, max_num_reqs + 1], int32
    int* max_seqlen;                   // [1 + num_groups], int32: max_seqlen_q, then max_seqlen_k of each group
    int attention;                     // VLLM_ATTN_* bits asked for (vllm_step<true>)
    int kv_indices_capacity;           // N, entries of each group's kv_indices (1 when flashinfer is off)
    int meta_blocks;                   // metadata blocks per group: ceil((max_num_reqs + 1) / meta_rows)
    int meta_entries;                  // kv_indices entries each metadata block pads: ceil(N / meta_blocks)
    int meta_rows;                     // batch rows per metadata block: block k owns [k * meta_rows, +meta_rows)
    // -- DSA outputs (vllm_step<ATTENTION, true> only; vllm_dsa.cuh) --
    long long* dsa_value_offsets;      // [max_tokens], int64: indexer-cache byte offset of the token's values; -1
    long long* dsa_scale_offsets;      // [max_tokens], int64: byte offset of its scale; -1
    int* dsa_ctx;                      // [max_tokens], int32: position + 1; 0
    int* dsa_ks;                       // [max_tokens], int32: a prefill token's first key; 0
    int* dsa_ke;                       // [max_tokens], int32: ks + ctx for a prefill token; 0
    int* dsa_cu_seq_lens;              // [max_num_reqs + 1], int32: over the prefills in batch order
    int* dsa_req_id;                   // [max_tokens], int32: the token's batch row; -1
    int dsa_group;                     // the group whose slots address the indexer cache (0..num_groups-1)
    int dsa_decode_len;                // n: a request running 1..n tokens is a decode, more a prefill
    int dsa_value_bytes;               // V: value bytes per token (128)
    int dsa_scale_bytes;               // S: scale bytes per token (4)
};

// a[g] for a runtime g, with compile-time indices only.
template <typename T>
__device__ __forceinline__ T vllm_pick(const T (&a)[VLLM_MAX_GROUPS], int g) {
    T v = a[0];
#pragma unroll
    for (int k = 1; k < VLLM_MAX_GROUPS; ++k) v = (g == k) ? a[k] : v;
    return v;
}

__device__ __forceinline__ unsigned long long vllm_key(long long token, int request, int group, int bit_index) {
    return ((unsigned long long)token << 32) | ((unsigned long long)request << 8) |
           ((unsigned long long)group << 5) | (unsigned long long)bit_index;
}

// A thread's errors (KvErr's record) with the vLLM step's key layout: token << 32 | request << 8 |
// group << 5 | bit index (kvaddr/engines/vllm_errors.py).
struct VllmErr : KvErr {
    __device__ __forceinline__ void add(unsigned int bit, int bit_index, long long token, int request, int group) {
        mask |= bit;
        const u64 k = vllm_key(token, request, group, bit_index);
        key = k < key ? k : key;
    }
};

__device__ __forceinline__ long long vllm_row_of(const VllmStepParams& p, int b) {
    return p.idx_is_64 ? reinterpret_cast<const long long*>(p.idx_mapping)[b]
                       : (long long)reinterpret_cast<const int*>(p.idx_mapping)[b];
}

// The owner of token t (0 <= t, num_reqs >= 1) when the guess min(t, n-1) does not
// hold it: the largest b in [0, n-1] with qsl[b] <= t (binary search). The reference
// replicates guess and search exactly (owner_search).
__device__ __forceinline__ int vllm_owner_search(const int* __restrict__ qsl, int n, int t) {
    int lo = 0, hi = n - 1;
    while (lo < hi) {
        const int mid = (lo + hi + 1) >> 1;
        if (qsl[mid] <= t) lo = mid;
        else hi = mid - 1;
    }
    return lo;
}

__device__ __forceinline__ void vllm_store_slot(const VllmStepParams& p, int g, int t, long long slot) {
    const long long at = (long long)g * p.slot_stride + t;
    if (p.slot_is_32) reinterpret_cast<int*>(p.slot_mappings)[at] = (int)slot;
    else reinterpret_cast<long long*>(p.slot_mappings)[at] = slot;
}

// Every group's num_blocks[g][r] (r a row of the state); with slots_only, the slot-enabled groups'.
__device__ __forceinline__ void vllm_load_num_blocks(const VllmStepParams& p, long long r, bool slots_only,
                                                     int (&nbs)[VLLM_MAX_GROUPS]) {
#pragma unroll
    for (int g = 0; g < VLLM_MAX_GROUPS; ++g)
        if (g < p.num_groups && (!slots_only || (p.group_flags[g] & VLLM_GROUP_SLOTS))) nbs[g] = p.num_blocks[g][r];
}

// num_blocks in pinned host memory (vLLM's layout) is staged: a PCIe read is a transaction of its
// own and reads of one line from several SMs are serialised, so the token, request and gather roles
// reading each word would pay for it three times. vllm_stage_num_blocks copies every group's rows
// [0, max_num_reqs) into the planner's device copy, each line read once, and the step
// (vllm_step<..., true>), launched as its programmatic dependent on sm_90 and later, issues its
// device loads first and waits for the copy only before its first read of num_blocks; on older
// devices it runs after the copy in stream order and the wait is empty.
__device__ __forceinline__ void vllm_wait_staged() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
    asm volatile("griddepcontrol.wait;" ::: "memory");
#endif
}

// Is batch entry b < num_reqs a real request with good inputs? Sets its row and
// num_computed_tokens; with record, adds its per-request errors.
__device__ __forceinline__ bool vllm_request(const VllmStepParams& p, int b, long long& r, int& nct, int& q0,
                                             int& q1, bool record, VllmErr& err) {
    q0 = p.query_start_loc[b];
    q1 = p.query_start_loc[b + 1];
    r = vllm_row_of(p, b);
    nct = 0;
    const long long tok = q0 < 0 ? 0 : q0;
    bool good = true;
    if (r == -1) good = false;
    if (r < -1 || r >= p.max_num_reqs) {
        good = false;
        if (record) err.add(VLLM_ERR_ROW_INDEX, 5, tok, b, 0);
    } else if (r >= 0) {
        nct = p.num_computed_tokens[r];
        if (nct < 0) {
            good = false;
            if (record) err.add(VLLM_ERR_NEGATIVE_COMPUTED, 7, tok, b, 0);
        }
    }
    if (q0 < 0 || q1 < q0) {
        good = false;
        if (record) err.add(VLLM_ERR_QUERY_START_LOC, 3, tok, b, 0);
    }
    if (record && q1 > p.max_tokens) err.add(VLLM_ERR_CAPACITY, 2, p.max_tokens, b, 0);
    return good;
}

__device__ __forceinline__ int vllm_dcp_len(const VllmStepParams& p, int s) {
    if (p.cp_size == 1) return s;
    const long long il = p.cp_interleave, span = il * p.cp_size;
    long long rest = (long long)s % span - (long long)p.cp_rank * il;
    rest = rest < 0 ? 0 : (rest > il ? il : rest);
    return (int)(((long long)s / span) * il + rest);
}


// =====================================================================================
// ==== the vLLM step (vllm_step) ======================================================
// =====================================================================================
//
// The one-launch vLLM step (VllmStepPlanner). The grid has four roles, by block index:
//   * token blocks [0, token_blocks): a thread per token, positions and every group's slot (with
//     DSA, the token's DSA outputs but a prefill token's ks and ke: vllm_dsa_token_out);
//   * request blocks (request_blocks): a thread per batch row b < max_num_reqs: seq_lens,
//     dcp_local_seq_lens, the per-request checks and every group's num_blocks check; a row
//     b >= num_reqs (padding rows and rows an earlier step left with data) also reads the row's
//     fill (row_fill[g][b], entries that may be non-zero) and, when it is not zero, its warp
//     zeroes those entries together and the fill becomes 0. The planner's first call finds every
//     fill at the width (row_fill's initial value), so a caller-owned out= table is zeroed in
//     full once;
//   * (vllm_step<true>) the last num_groups * meta_blocks blocks: the attention metadata
//     (vllm_attention_block);
//   * gather blocks (the rest): pair_lanes lanes (8, 16 or 32; the planner picks by batch size)
//     per (group, real batch row b < num_reqs) pair copy the row, each lane with
//     VLLM_GATHER_LOADS loads in flight.
// No grid-wide ticket, no fence, no device row count: every warp of the token, request and
// metadata blocks (a number fixed by the planner's sizes) has an error record (mask, first-bad
// key) of its own, written only by a warp that found an error (merged with atomicOr / atomicMin:
// sticky); the host reduces the records and clears them (VllmStepPlanner.errors). The gather
// blocks detect no error (the num_blocks check is the request role's, which holds the same row).
// Each token block stages the batch (query_start_loc and each entry's row) in shared memory in one
// round trip when num_reqs + 1 <= VLLM_QSL_SMEM (vllm_stage_batch), and every token finds its
// owner, range and row there: a mixed batch's tokens need no second round trip after a failed
// guess, nor a dependent one per search step. A larger batch guesses in global memory and
// searches there. The owner (the guess min(t, n-1), else the largest b with qsl[b] <= t) and
// every record key are the reference's (owner_search in kvaddr/engines/vllm_reference.py).

#define VLLM_GATHER_LOADS 8
#define VLLM_QSL_SMEM 2048

// A token block's copy of the batch (1 <= num_reqs <= PER * VLLM_THREADS, num_reqs + 1 <=
// VLLM_QSL_SMEM; last = query_start_loc[num_reqs]): query_start_loc[0, num_reqs] into sq and every
// entry's row into srow (a row outside [-1, max_num_reqs) as -2: the token role treats every such
// row alike, as no row), so that a token finds its owner, range and row without another round
// trip to global memory. Read after the block's next barrier.
template <typename IDX, int PER>
__device__ __forceinline__ void vllm_stage_batch_as(const VllmStepParams& p, int* sq, int* srow, int last) {
    const int n = p.num_reqs;
    const IDX* __restrict__ idx = reinterpret_cast<const IDX*>(p.idx_mapping);
    int q[PER];
    IDX w[PER];
    // Every entry [0, PER * VLLM_THREADS) is written (past the batch: copies of its last entries,
    // never read), so no load sits under a branch and all of them are in flight at once.
#pragma unroll
    for (int u = 0; u < PER; ++u) {
        const int i = u * VLLM_THREADS + (int)threadIdx.x;
        q[u] = p.query_start_loc[i < n ? i : n];
        w[u] = idx[i < n - 1 ? i : n - 1];
    }
#pragma unroll
    for (int u = 0; u < PER; ++u) {
        const int i = u * VLLM_THREADS + (int)threadIdx.x;
        sq[i] = q[u];
        srow[i] = (w[u] < -1 || w[u] >= p.max_num_reqs) ? -2 : (int)w[u];
    }
    if (PER * VLLM_THREADS < VLLM_QSL_SMEM && n == PER * VLLM_THREADS && threadIdx.x == 0) sq[n] = last;
}

template <int PER>
__device__ __forceinline__ void vllm_stage_batch_per(const VllmStepParams& p, int* sq, int* srow, int last) {
    if (p.idx_is_64) vllm_stage_batch_as<long long, PER>(p, sq, srow, last);
    else vllm_stage_batch_as<int, PER>(p, sq, srow, last);
}

// The copy with the fewest entries a thread (1, 2, 4 or 8) that holds the batch.
__device__ __forceinline__ void vllm_stage_batch(const VllmStepParams& p, int* sq, int* srow, int last) {
    const int per = (p.num_reqs + VLLM_THREADS - 1) / VLLM_THREADS;  // 1 to 8
    if (per == 1) vllm_stage_batch_per<1>(p, sq, srow, last);
    else if (per == 2) vllm_stage_batch_per<2>(p, sq, srow, last);
    else if (per <= 4) vllm_stage_batch_per<4>(p, sq, srow, last);
    else vllm_stage_batch_per<8>(p, sq, srow, last);
}

// Token t's owner b, its range [q0, q1) and row r, and the token count, from the block's copy of
// the batch (t < max_tokens, last = query_start_loc[num_reqs]): the guess min(t, n-1), else the
// search.
__device__ __forceinline__ void vllm_token_owner_copied(const VllmStepParams& p, const int* sq, const int* srow,
                                                        int t, int last, int& b, int& q0, int& q1, long long& r,
                                                        int& num_tokens) {
    const int n = p.num_reqs;
    num_tokens = last < 0 ? 0 : (last > p.max_tokens ? p.max_tokens : last);
    b = t < n - 1 ? t : n - 1;
    q0 = sq[b];
    q1 = sq[b + 1];
    if (t < num_tokens && !(q0 <= t && t < q1)) {
        b = vllm_owner_search(sq, n, t);
        q0 = sq[b];
        q1 = sq[b + 1];
    }
    r = srow[b];
}

// The guess of token t (t < max_tokens, num_reqs >= 1): b = min(t, n-1) with its range and
// row, and the token count. Returns whether t < num_tokens lies outside the guess's range
// (the owner must be searched).
__device__ __forceinline__ bool vllm_token_guess(const VllmStepParams& p, int t, int& b, int& q0, int& q1,
                                                  long long& r, int& num_tokens) {
    const int n = p.num_reqs;
    const int* __restrict__ qsl = p.query_start_loc;
    const int last = qsl[n];
    b = t < n - 1 ? t : n - 1;
    q0 = qsl[b];
    q1 = qsl[b + 1];
    r = vllm_row_of(p, b);
    num_tokens = last < 0 ? 0 : (last > p.max_tokens ? p.max_tokens : last);
    return t < num_tokens && !(q0 <= t && t < q1);
}

// Token t's DSA outputs that the token role writes (vllm_step<..., true>; vllm_dsa.cuh's section
// comment): value and scale offsets from its slot s in group dsa_group (-1: none) and off = s % B,
// ctx = pos + 1 (saturating), req_id_per_token = b, and ks = ke = 0 unless the token is a
// prefill's (valid, its owner running more than dsa_decode_len tokens), whose ks and ke the DSA
// blocks write. An invalid token: -1, -1, 0, 0, 0, -1.
__device__ __forceinline__ void vllm_dsa_token_out(const VllmStepParams& p, int t, bool valid, long long pos, int b,
                                                   bool prefill, long long slot, long long off, long long B) {
    long long value = -1, scale = -1;
    if (slot >= 0) {
        const long long V = p.dsa_value_bytes, S = p.dsa_scale_bytes;
        const long long first = (slot - off) * (V + S);  // blk * B * (V + S)
        value = first + off * V;
        scale = first + B * V + off * S;
    }
    p.dsa_value_offsets[t] = value;
    p.dsa_scale_offsets[t] = scale;
    p.dsa_ctx[t] = valid ? (int)(pos + 1 > VLLM_INT_MAX ? VLLM_INT_MAX : pos + 1) : 0;
    p.dsa_req_id[t] = valid ? b : -1;
    if (!prefill) {
        p.dsa_ks[t] = 0;
        p.dsa_ke[t] = 0;
    }
}

// Token t's outputs once its owner b (range [q0, q1), row r) is known: positions[t] and
// every group's slot. DCP: the step may have sharded groups (cp_size > 1); without it the
// sharded path is not compiled, so a group's block index costs one division (ptxas would
// if-convert the sharded path's four divisions into every group's code).
// Load order: num_blocks[g][r] (device memory; STAGED: after the wait, below) is issued first,
// then num_computed_tokens[r]; every group's block id is then loaded as soon as
// the position is known (a column inside the row's width: in bounds whatever num_blocks says),
// before num_blocks is compared, so the num_blocks latency overlaps the block-table read instead
// of preceding it. The comparisons and the stores follow, all loads being issued (a store could
// alias a table, so no load may follow one).
// Group g's block index and offset of position pos (valid, slots enabled); whether the token is local.
template <bool DCP>
__device__ __forceinline__ bool vllm_token_index(const VllmStepParams& p, int g, int flags, long long pos,
                                                 unsigned int& idx, unsigned int& off) {
    const unsigned int up = (unsigned int)pos;
    const unsigned int B = (unsigned int)p.block_size[g];
    if (DCP && (flags & VLLM_GROUP_SHARDED)) {
        const unsigned int cp = (unsigned int)p.cp_size, il = (unsigned int)p.cp_interleave;
        const unsigned int vbs = B * cp;
        idx = up / vbs;
        const unsigned int vo = up - idx * vbs;
        off = (vo / (il * cp)) * il + vo % il;
        return ((vo / il) % cp) == (unsigned int)p.cp_rank;
    }
    idx = up / B;
    off = up - idx * B;
    return true;
}

// DSA (vllm_step<..., true>): the token's DSA outputs too, from its slot in group dsa_group
// (vllm_dsa_token_out); no load is added. STAGED: num_blocks is the staged copy, read after
// vllm_wait_staged, behind the block ids.
template <bool DCP, bool DSA, bool STAGED>
__device__ __forceinline__ void vllm_token_write(const VllmStepParams& p, int t, int b, int q0, int q1, long long r,
                                                  int num_tokens, VllmErr& err) {
    bool valid = false;
    long long pos = 0;
    int nbs[VLLM_MAX_GROUPS] = {0, 0, 0, 0};
    if (t < num_tokens && q0 >= 0 && q0 <= t && t < q1) {
        if (r >= 0 && r < p.max_num_reqs) {
            if (!STAGED) vllm_load_num_blocks(p, r, true, nbs);
            const int nct = p.num_computed_tokens[r];
            if (nct >= 0) {
                valid = true;
                pos = (long long)nct + (t - q0);
            }
        }
    }
    // Every group's block id, loaded when its index is inside the row, before num_blocks is needed.
    // STAGED, each group's index and offset are kept for the comparisons below, so that no
    // division lies between the wait and the stores; with num_blocks in device memory the
    // comparisons divide again (keeping them there took 64 registers instead of 48 and made the
    // mixed batches slower: docs/design.md).
    int blks[VLLM_MAX_GROUPS] = {0, 0, 0, 0};
    unsigned int idxs[VLLM_MAX_GROUPS] = {0, 0, 0, 0}, offs[VLLM_MAX_GROUPS] = {0, 0, 0, 0};
    bool local[VLLM_MAX_GROUPS] = {false, false, false, false};  // a valid token with slots here
#pragma unroll
    for (int g = 0; g < VLLM_MAX_GROUPS; ++g) {
        if (g >= p.num_groups) break;
        const int flags = p.group_flags[g];
        if (valid && (flags & VLLM_GROUP_SLOTS)) {
            local[g] = vllm_token_index<DCP>(p, g, flags, pos, idxs[g], offs[g]);
            if (local[g] && (long long)idxs[g] < (long long)p.width[g])
                blks[g] = p.block_table[g][r * p.table_stride[g] + idxs[g]];
        }
    }
    if (STAGED) {
        vllm_wait_staged();
        if (valid) vllm_load_num_blocks(p, r, true, nbs);
    }
    p.positions[t] = pos;
    long long dsa_slot = -1, dsa_off = 0, dsa_B = 1;  // DSA: the slot of group dsa_group, its offset and B
#pragma unroll
    for (int g = 0; g < VLLM_MAX_GROUPS; ++g) {
        if (g >= p.num_groups) break;
        long long slot = -1;
        const int flags = p.group_flags[g];
        unsigned int idx = idxs[g], off = offs[g];
        bool here = local[g];
        if (!STAGED) {
            idx = 0;
            off = 0;
            here = valid && (flags & VLLM_GROUP_SLOTS) && vllm_token_index<DCP>(p, g, flags, pos, idx, off);
        }
        if (here) {
            const int nb = nbs[g];
            if ((long long)idx >= (long long)p.width[g]) {
                err.add(VLLM_ERR_BLOCK_INDEX, 0, t, b, g);
            } else if ((long long)idx >= (long long)nb) {
                err.add(VLLM_ERR_PAST_NUM_BLOCKS, 4, t, b, g);
            } else {
                const int blk = blks[g];
                if (blk < 0) {
                    err.add(VLLM_ERR_NEGATIVE_BLOCK, 1, t, b, g);
                } else {
                    slot = (long long)blk * (long long)p.block_size[g] + off;
                    if (p.slot_is_32 && slot > VLLM_INT_MAX) {
                        err.add(VLLM_ERR_SLOT_INT32, 8, t, b, g);
                        slot = -1;
                    }
                }
            }
        }
        vllm_store_slot(p, g, t, slot);
        if (DSA && g == p.dsa_group) {
            dsa_slot = slot;
            dsa_off = off;
            dsa_B = p.block_size[g];
        }
    }
    // (valid: q0 <= t < q1, so the query length q1 - q0 >= 1 does not overflow)
    if (DSA) vllm_dsa_token_out(p, t, valid, pos, b, valid && q1 - q0 > p.dsa_decode_len, dsa_slot, dsa_off, dsa_B);
}

// One batch row b < max_num_reqs of the request role: seq_lens, dcp_local_seq_lens, the
// per-request checks, and every group's num_blocks check (keyed at the request's first token).
// STAGED: num_blocks is the staged copy, read after vllm_wait_staged.
template <bool STAGED>
__device__ __forceinline__ void vllm_request_row(const VllmStepParams& p, int b, VllmErr& err) {
    int seq = 0;
    if (b < p.num_reqs) {
        const int q0 = p.query_start_loc[b], q1 = p.query_start_loc[b + 1];
        const long long r = vllm_row_of(p, b);
        const long long tok = q0 < 0 ? 0 : q0;
        int nct = 0;
        int nbs[VLLM_MAX_GROUPS] = {0, 0, 0, 0};
        bool good = r >= 0;
        if (r < -1 || r >= p.max_num_reqs) {
            good = false;
            err.add(VLLM_ERR_ROW_INDEX, 5, tok, b, 0);
        } else if (r >= 0) {
            // The row's num_blocks are loaded with its num_computed_tokens.
            if (!STAGED) vllm_load_num_blocks(p, r, false, nbs);
            nct = p.num_computed_tokens[r];
            if (STAGED) {
                vllm_wait_staged();
                vllm_load_num_blocks(p, r, false, nbs);
            }
            if (nct < 0) {
                good = false;
                err.add(VLLM_ERR_NEGATIVE_COMPUTED, 7, tok, b, 0);
            }
        }
        if (q0 < 0 || q1 < q0) {
            good = false;
            err.add(VLLM_ERR_QUERY_START_LOC, 3, tok, b, 0);
        }
        if (q1 > p.max_tokens) err.add(VLLM_ERR_CAPACITY, 2, p.max_tokens, b, 0);
        if (good) {
            const long long s = (long long)nct + ((long long)q1 - q0);
            seq = (int)(s > VLLM_INT_MAX ? VLLM_INT_MAX : s);
#pragma unroll
            for (int g = 0; g < VLLM_MAX_GROUPS; ++g)
                if (g < p.num_groups && (nbs[g] < 0 || nbs[g] > p.width[g]))
                    err.add(VLLM_ERR_NUM_BLOCKS, 6, q0, b, g);
        }
    }
    p.seq_lens[b] = seq;
    p.dcp_local_seq_lens[b] = vllm_dcp_len(p, seq);
}

// One (group, real batch row b < num_reqs) pair by `lanes` lanes (sub = this lane's index
// among them); an inactive pair (past the last one) only reaches the warp barrier. No
// error is detected here (vllm_request_row checks num_blocks). STAGED: num_blocks is the
// staged copy, read after vllm_wait_staged, behind the first chunk's loads.
template <bool STAGED>
__device__ __forceinline__ void vllm_gather_row(const VllmStepParams& p, bool active, int g, int b, int sub,
                                                 int lanes) {
    int nbc = 0, first = 0, fill = 0, spec = 0, nb = 0, cap = 0;
    int* __restrict__ out = 0;
    int* __restrict__ fill_at = 0;
    const int* __restrict__ src = 0;
    int row = 0;  // the state row read (STAGED: its num_blocks after the wait)
    if (active) {
        const int W = vllm_pick(p.width, g);
        out = vllm_pick(p.gathered, g) + (long long)b * vllm_pick(p.gathered_stride, g);
        fill_at = vllm_pick(p.row_fill, g) + b;
        fill = *fill_at;
        const int q0 = p.query_start_loc[b], q1 = p.query_start_loc[b + 1];
        const long long r = vllm_row_of(p, b);
        // No branch between the row index and the row's loads: a row outside the state reads
        // row 0 (inside every state array) and keeps nothing. (With the loads under the tests,
        // ptxas sank num_blocks's load below the test of num_computed_tokens: a third dependent
        // load before the row's block ids, a fourth in all.)
        const bool rok = r >= 0 && r < p.max_num_reqs;
        const int rr = rok ? (int)r : 0;
        if (!STAGED) nb = vllm_pick(p.num_blocks, g)[rr];
        row = rr;
        const int nct = p.num_computed_tokens[rr];
        src = vllm_pick(p.block_table, g) + (long long)rr * vllm_pick(p.table_stride, g);
        const bool good = rok && nct >= 0 && q0 >= 0 && q1 >= q0;
        const int B = vllm_pick(p.block_size, g);
        const int reach = vllm_pick(p.sliding_window_reach, g);
        if (good && reach > 0) {
            const long long f = ((long long)nct - reach) / B;
            first = f < 0 ? 0 : (int)(f > W ? W : f);
        }
        // The entries loaded below before num_blocks arrives, within the first chunk and the width:
        // those the row's length after this step needs (num_blocks is at least that for a good
        // request); STAGED, the whole first chunk, since the loads are in flight while the step
        // waits for the copy and the entries up to num_blocks then need no round trip after it.
        if (good) {
            const long long pages = ((long long)nct + ((long long)q1 - q0) + B - 1) / B;
            const int chunk = W < VLLM_GATHER_LOADS * lanes ? W : VLLM_GATHER_LOADS * lanes;
            spec = (STAGED || pages >= chunk) ? chunk : (int)pages;
        }
        cap = good ? W : 0;  // what num_blocks is clamped to
    }
    // num_blocks (device memory; STAGED: the staged copy, after the wait) decides how many
    // entries the row has; the first chunk's entries below `spec` (columns inside the row: in
    // bounds) are loaded before it is compared, so its latency overlaps the block-table read. Its
    // clamp is written after those loads and outside the branch above: computed inside it, ptxas
    // placed the comparison (a wait on the num_blocks load) before the table loads.
    int v0[VLLM_GATHER_LOADS];
#pragma unroll
    for (int k = 0; k < VLLM_GATHER_LOADS; ++k) {
        const int j = lanes * k + sub;
        v0[k] = (j < spec && j >= first) ? src[j] : 0;
    }
    if (STAGED) {
        vllm_wait_staged();
        if (active) nb = vllm_pick(p.num_blocks, g)[row];
    }
    nbc = min(max(nb, 0), cap);
    // Entries [0, max(nbc, fill)): VLLM_GATHER_LOADS loads in flight per lane before any store.
    const int end = nbc > fill ? nbc : fill;
    for (int j0 = 0; j0 < end; j0 += VLLM_GATHER_LOADS * lanes) {
        int v[VLLM_GATHER_LOADS];
#pragma unroll
        for (int k = 0; k < VLLM_GATHER_LOADS; ++k) {
            const int j = j0 + lanes * k + sub;
            v[k] = (j < nbc && j >= first) ? (j < spec ? v0[k] : src[j]) : 0;
        }
#pragma unroll
        for (int k = 0; k < VLLM_GATHER_LOADS; ++k) {
            const int j = j0 + lanes * k + sub;
            if (j < end) out[j] = v[k];
        }
    }
    __syncwarp();  // every lane has read the row's fill before it is replaced
    if (active && sub == 0) *fill_at = nbc;
}

// ---- attention metadata of the vLLM step (vllm_step<true>'s last blocks) ----
//
// Per KV-cache group g, FlashInfer's paged-KV arrays (kv_indptr, kv_indices,
// kv_last_page_len) and FlashAttention varlen's cu_seqlens_k / max_seqlen_k over the
// batch's L_bg = seq_lens[b] (dcp_local_seq_lens[b] for a DCP-sharded group), and once
// for the step qo_indptr (query_start_loc padded) and max_seqlen_q. Contract: docs/vllm.md
// ("Attention metadata") and vllm_attention_reference in kvaddr/engines/vllm_reference.py.
// num_groups * meta_blocks blocks; block (g, k) owns batch rows [k * meta_rows, +meta_rows) of
// [0, max_num_reqs] (meta_rows 8 to VLLM_THREADS: fewer rows a block, more blocks copying rows
// at once) and the kv_indices entries [k * meta_entries, +meta_entries) of the pad.
// Like kv_meta_block (the core step's), a block waits for no other: it recomputes every
// request's length from the inputs (idx_mapping -> row -> num_computed_tokens + query
// length, as vllm_request_row does), in
//   1. one register pass over all num_reqs lengths: the sums (pages, L) before its rows,
//      the totals and the maxima;
//   2. a block scan of its own rows' pages and lengths: kv_indptr, cu_seqlens_k,
//      kv_last_page_len, qo_indptr (group 0) and the per-request checks;
//   3. the row copy: a warp (VLLM_META_LANES lanes) per request copies the first pages of its row as the
//      gather writes them (block_table[r, j] for first <= j < clamp(num_blocks, 0, W),
//      else 0; -1 for j >= W and for a negative id), entries < N only;
//   4. the pad: -1 over its entry range past the group's total pages.

#define VLLM_ATTN_FLASHINFER 1
#define VLLM_ATTN_VARLEN 2
#define VLLM_ERR_KV_INDICES_CAPACITY 512
#define VLLM_META_R 4  // requests in flight per thread in pass 1
#define VLLM_META_U 8  // row entries in flight per lane in the copy
#define VLLM_META_LANES 32  // lanes per request in the row copy

struct VllmMetaShared {
    int start[VLLM_THREADS];  // first kv_indices entry of each staged request (saturated)
    int pages[VLLM_THREADS];  // its pages
    int token[VLLM_THREADS];  // its first token (the error key's token)
    int nbc[VLLM_THREADS];    // entries of its gathered row (clamp(num_blocks, 0, W)); 0: no row
    int first[VLLM_THREADS];  // sliding window: its first non-null entry
    int row[VLLM_THREADS];    // its request-state row (< max_num_reqs < 2^24)
    int red[2][VLLM_WARPS];   // per-warp sums of the scan
    int carry[2];             // pass 1: pages and L before the block's rows
    int total[2];             // pass 1: total pages and L
};

// ceil(L / B) for L >= 0, B >= 1, as (L - 1) / B + 1 (kv_pages computes the same number another
// way; the vLLM step keeps this form, which its measured code was built with).
__device__ __forceinline__ int vllm_pages(int L, int B) {
    return L > 0 ? (int)((unsigned int)(L - 1) / (unsigned int)B) + 1 : 0;
}

// The loads of request b < num_reqs (issued together): its range and row.
struct VllmReqLoads {
    int q0, q1;
    long long r;
};

__device__ __forceinline__ void vllm_attn_load(const VllmStepParams& p, int b, VllmReqLoads& x) {
    x.q0 = p.query_start_loc[b];
    x.q1 = p.query_start_loc[b + 1];
    x.r = vllm_row_of(p, b);
}

// Whether the request reads its row (a real request with good inputs so far, as
// vllm_request_row decides before num_computed_tokens).
__device__ __forceinline__ bool vllm_attn_has_row(const VllmReqLoads& x, int M) {
    return x.r >= 0 && x.r < M && x.q0 >= 0 && x.q1 >= x.q0;
}

// seq_lens[b]'s value from the loads and num_computed_tokens[r] (nct; ignored without a row).
__device__ __forceinline__ int vllm_attn_seq(const VllmReqLoads& x, bool has_row, int nct) {
    if (!has_row || nct < 0) return 0;
    const long long s = (long long)nct + ((long long)x.q1 - x.q0);
    return (int)(s > VLLM_INT_MAX ? VLLM_INT_MAX : s);
}

// The query length max(q1 - q0, 0), saturating (max_seqlen_q covers every request's range).
__device__ __forceinline__ int vllm_attn_qlen(const VllmReqLoads& x) {
    const long long d = (long long)x.q1 - x.q0;
    return (int)(d < 0 ? 0 : (d > VLLM_INT_MAX ? VLLM_INT_MAX : d));
}

// Attention metadata block m (of num_groups * meta_blocks), see the section comment. STAGED:
// num_blocks is the staged copy, read after vllm_wait_staged.
template <bool STAGED>
__device__ __forceinline__ void vllm_attention_block(const VllmStepParams& p, int m, VllmErr& err) {
    __shared__ VllmMetaShared sm;
    const int tid = (int)threadIdx.x, lane = tid & 31, warp = tid >> 5;
    const int n = p.num_reqs, M = p.max_num_reqs, N = p.kv_indices_capacity;
    const int g = m / p.meta_blocks, k = m - g * p.meta_blocks;
    const bool fi = (p.attention & VLLM_ATTN_FLASHINFER) != 0;
    const bool varlen = (p.attention & VLLM_ATTN_VARLEN) != 0;
    const int B = vllm_pick(p.block_size, g), W = vllm_pick(p.width, g);
    const bool sharded = (vllm_pick(p.group_flags, g) & VLLM_GROUP_SHARDED) != 0;
    const int rows_k = p.meta_rows;
    const int r0 = k * rows_k;  // this block's rows [r0, r0 + rows_k) of [0, M], thread tid < rows_k: row r0 + tid
    // 1. one pass over all num_reqs lengths: sums before r0, totals, maxima
    int bp = 0, bl = 0, tp = 0, tl = 0, mq = 0, ml = 0;
#pragma unroll 1
    for (int b0 = 0; b0 < n; b0 += VLLM_META_R * VLLM_THREADS) {
        VllmReqLoads x[VLLM_META_R];
        int nct[VLLM_META_R];
#pragma unroll
        for (int u = 0; u < VLLM_META_R; ++u) {
            const int b = b0 + u * VLLM_THREADS + tid;
            x[u].q0 = x[u].q1 = 0;
            x[u].r = -1;
            if (b < n) vllm_attn_load(p, b, x[u]);
        }
#pragma unroll
        for (int u = 0; u < VLLM_META_R; ++u) nct[u] = vllm_attn_has_row(x[u], M) ? p.num_computed_tokens[x[u].r] : 0;
#pragma unroll
        for (int u = 0; u < VLLM_META_R; ++u) {
            const int b = b0 + u * VLLM_THREADS + tid;
            const int s = vllm_attn_seq(x[u], vllm_attn_has_row(x[u], M), nct[u]);
            const int L = sharded ? vllm_dcp_len(p, s) : s;
            const int P = vllm_pages(L, B);
            if (b < r0) {
                bp = kv_sat_add_nn(bp, P);
                bl = kv_sat_add_nn(bl, L);
            }
            tp = kv_sat_add_nn(tp, P);
            tl = kv_sat_add_nn(tl, L);
            ml = max(ml, L);
            if (b < n) mq = max(mq, vllm_attn_qlen(x[u]));
        }
    }
#pragma unroll
    for (int s = 16; s > 0; s >>= 1) {
        bp = kv_sat_add_nn(bp, __shfl_xor_sync(0xffffffffu, bp, s));
        bl = kv_sat_add_nn(bl, __shfl_xor_sync(0xffffffffu, bl, s));
        tp = kv_sat_add_nn(tp, __shfl_xor_sync(0xffffffffu, tp, s));
        tl = kv_sat_add_nn(tl, __shfl_xor_sync(0xffffffffu, tl, s));
    }
    mq = __reduce_max_sync(0xffffffffu, mq);
    ml = __reduce_max_sync(0xffffffffu, ml);
    // (sm.start / pages / token / nbc / first hold the warps' partials until the scan)
    if (lane == 0) {
        sm.start[warp] = bp;
        sm.pages[warp] = bl;
        sm.token[warp] = tp;
        sm.nbc[warp] = tl;
        sm.first[warp] = mq;
        sm.row[warp] = ml;
    }
    // 2. this block's rows: their own loads, issued before the barrier
    const int b = r0 + tid;
    const bool mine = tid < rows_k;
    VllmReqLoads x;
    x.q0 = x.q1 = 0;
    x.r = -1;
    if (mine && b < n) vllm_attn_load(p, b, x);
    const bool has_row = mine && b < n && vllm_attn_has_row(x, M);
    int nct = 0, nb = 0;
    if (has_row) {
        nct = p.num_computed_tokens[x.r];
        if (STAGED) vllm_wait_staged();
        nb = vllm_pick(p.num_blocks, g)[x.r];
    }
    const int qn = (mine && b >= n && b <= M) ? p.query_start_loc[n] : 0;
    __syncthreads();
    if (tid == 0) {
        int cp = 0, cl = 0, Tp = 0, Tl = 0, Mq = 0, Ml = 0;
#pragma unroll
        for (int i = 0; i < VLLM_WARPS; ++i) {
            cp = kv_sat_add_nn(cp, sm.start[i]);
            cl = kv_sat_add_nn(cl, sm.pages[i]);
            Tp = kv_sat_add_nn(Tp, sm.token[i]);
            Tl = kv_sat_add_nn(Tl, sm.nbc[i]);
            Mq = max(Mq, sm.first[i]);
            Ml = max(Ml, sm.row[i]);
        }
        sm.carry[0] = cp;
        sm.carry[1] = cl;
        sm.total[0] = Tp;
        sm.total[1] = Tl;
        if (k == 0 && varlen) {
            if (g == 0) p.max_seqlen[0] = Mq;
            p.max_seqlen[1 + g] = Ml;
        }
    }
    const int s = vllm_attn_seq(x, has_row, nct);
    const int L = sharded ? vllm_dcp_len(p, s) : s;
    const int P = vllm_pages(L, B);
    // block scan of (pages, L): in-warp inclusive, exclusive by the previous lane's
    int ip = P, il = L;
#pragma unroll
    for (int off = 1; off < 32; off <<= 1) {
        const int yp = __shfl_up_sync(0xffffffffu, ip, off), yl = __shfl_up_sync(0xffffffffu, il, off);
        if (lane >= off) {
            ip = kv_sat_add_nn(ip, yp);
            il = kv_sat_add_nn(il, yl);
        }
    }
    int xp = __shfl_up_sync(0xffffffffu, ip, 1), xl = __shfl_up_sync(0xffffffffu, il, 1);
    if (lane == 0) xp = xl = 0;
    __syncthreads();  // the warps' partials of pass 1 are read
    if (lane == 31) {
        sm.red[0][warp] = ip;
        sm.red[1][warp] = il;
    }
    __syncthreads();
    int wp = sm.carry[0], wl = sm.carry[1];
    for (int i = 0; i < warp; ++i) {
        wp = kv_sat_add_nn(wp, sm.red[0][i]);
        wl = kv_sat_add_nn(wl, sm.red[1][i]);
    }
    xp = kv_sat_add_nn(wp, xp);  // absolute exclusive prefixes
    xl = kv_sat_add_nn(wl, xl);
    const int total_p = sm.total[0], total_l = sm.total[1];
    const long long goff = (long long)g * (M + 1);
    if (mine && b < n) {
        if (fi) {
            p.kv_indptr[goff + b] = xp;
            p.kv_last_page_len[(long long)g * M + b] = L > 0 ? (int)((unsigned int)(L - 1) % (unsigned int)B) + 1 : 0;
        }
        if (varlen) p.cu_seqlens_k[goff + b] = xl;
        if (g == 0) p.qo_indptr[b] = x.q0;
    } else if (mine && b <= M) {  // padding: empty requests after the batch
        if (fi) {
            p.kv_indptr[goff + b] = total_p;
            if (b < M) p.kv_last_page_len[(long long)g * M + b] = 0;
        }
        if (varlen) p.cu_seqlens_k[goff + b] = total_l;
        if (g == 0) p.qo_indptr[b] = qn;
    }
    // 3. the row copy (flashinfer)
    if (fi) {
        int nbc = 0, first = 0;
        const int tok = x.q0 < 0 ? 0 : x.q0;
        if (P > 0) {  // a real request with good inputs (else L = 0)
            nbc = nb < 0 ? 0 : (nb > W ? W : nb);
            const int reach = vllm_pick(p.sliding_window_reach, g);
            if (reach > 0) {
                const long long f = ((long long)nct - reach) / B;
                first = f < 0 ? 0 : (int)(f > W ? W : f);
            }
            if (P > W) err.add(VLLM_ERR_BLOCK_INDEX, 0, tok, b, g);
            else if (P > nbc) err.add(VLLM_ERR_PAST_NUM_BLOCKS, 4, tok, b, g);
            if (xp <= N && N < kv_sat_add_nn(xp, P)) err.add(VLLM_ERR_KV_INDICES_CAPACITY, 9, tok, b, g);
        }
        __syncthreads();  // sm.red and sm.carry are read
        sm.start[tid] = xp;
        sm.pages[tid] = P;
        sm.token[tid] = tok;
        sm.nbc[tid] = nbc;
        sm.first[tid] = first;
        sm.row[tid] = (int)(has_row ? x.r : 0);
        __syncthreads();
        const int lanes = VLLM_META_LANES, grp = tid / lanes, sub = tid - grp * lanes, groups = VLLM_THREADS / lanes;
        const int cnt = min(rows_k, max(n - r0, 0));
        int* __restrict__ out = p.kv_indices + (long long)g * N;
        const int* __restrict__ table = vllm_pick(p.block_table, g);
        const long long stride = vllm_pick(p.table_stride, g);
#pragma unroll 1
        for (int i = grp; i < cnt; i += groups) {
            const int s0 = sm.start[i];
            const int end = s0 < N ? min(sm.pages[i], N - s0) : 0;  // entries of this row below N
            const int c_nb = sm.nbc[i], c_first = sm.first[i];
            const int* __restrict__ row = table + (long long)sm.row[i] * stride;
#pragma unroll 1
            for (int c0 = sub; c0 < end; c0 += VLLM_META_U * lanes) {
                int v[VLLM_META_U];
#pragma unroll
                for (int u = 0; u < VLLM_META_U; ++u) {
                    const int col = c0 + u * lanes;
                    v[u] = col >= W ? -1 : ((col < c_nb && col >= c_first) ? row[col] : 0);
                }
#pragma unroll
                for (int u = 0; u < VLLM_META_U; ++u) {
                    const int col = c0 + u * lanes;
                    if (col < end) {
                        if (col < W && v[u] < 0) err.add(VLLM_ERR_NEGATIVE_BLOCK, 1, sm.token[i], r0 + i, g);
                        out[s0 + col] = v[u] < 0 ? -1 : v[u];
                    }
                }
            }
        }
        // 4. the pad of this block's entry range past the group's used entries
        const int e_lo = (int)min((long long)k * p.meta_entries, (long long)N);
        const int e_hi = (int)min((long long)e_lo + p.meta_entries, (long long)N);
#pragma unroll 1
        for (int e = max(e_lo, total_p) + tid; e < e_hi; e += VLLM_THREADS) out[e] = -1;
    }
}

// The vLLM step: <<<token_blocks + request_blocks + gather blocks (+ num_groups * meta_blocks with
// ATTENTION), VLLM_THREADS>>>, one parameter. ATTENTION: the last num_groups * meta_blocks blocks
// of the grid write the attention metadata (vllm_attention_block). DSA: launched on two grid rows;
// row 0 is the step above, whose token blocks also write each token's DSA outputs but a prefill
// token's ks and ke (vllm_dsa_token_out), and row 1 writes those and cu_seq_lens (vllm_dsa_block).
__device__ void vllm_dsa_block(const VllmStepParams& p, int* sq);  // vllm_dsa.cuh

template <bool ATTENTION, bool DSA = false, bool STAGED = false>
__global__ void __launch_bounds__(VLLM_THREADS) vllm_step(const VllmStepParams p) {
    __shared__ int sq[VLLM_QSL_SMEM];    // query_start_loc: staged by the token blocks (and a DSA block that searches)
    __shared__ int srow[VLLM_QSL_SMEM];  // idx_mapping, staged by the token blocks (vllm_stage_batch)
    if (DSA && blockIdx.y != 0) {  // DSA: the grid's second row (vllm_dsa.cuh), no error record
        vllm_dsa_block(p, sq);
        return;
    }
    VllmErr err;
    err.mask = 0;
    err.key = KV_NO_ERROR;
    int blk = blockIdx.x;
    const int lane = (int)(threadIdx.x & 31);
    if (blk < p.token_blocks) {
        const int t = blk * VLLM_THREADS + (int)threadIdx.x;
        const int n = p.num_reqs;
        int b = 0, q0 = 0, q1 = 0, num_tokens = 0;
        long long r = 0;
        if (n >= 1 && n + 1 <= VLLM_QSL_SMEM) {  // uniform: the batch staged in one round trip
            const int last = p.query_start_loc[n];
            vllm_stage_batch(p, sq, srow, last);
            __syncthreads();
            if (t < p.max_tokens) vllm_token_owner_copied(p, sq, srow, t, last, b, q0, q1, r, num_tokens);
        } else if (n > 0 && t < p.max_tokens && vllm_token_guess(p, t, b, q0, q1, r, num_tokens)) {
            b = vllm_owner_search(p.query_start_loc, n, t);
            q0 = p.query_start_loc[b];
            q1 = p.query_start_loc[b + 1];
            r = vllm_row_of(p, b);
        }
        if (t < p.max_tokens) {
            // (uniform) only a DCP step has sharded groups
            if (p.cp_size > 1) vllm_token_write<true, DSA, STAGED>(p, t, b, q0, q1, r, num_tokens, err);
            else vllm_token_write<false, DSA, STAGED>(p, t, b, q0, q1, r, num_tokens, err);
        }
    } else if (blk < p.token_blocks + p.request_blocks) {
        const int b = (blk - p.token_blocks) * VLLM_THREADS + (int)threadIdx.x;
        // Rows b >= num_reqs: zero what each group's row may still hold (its fill), the
        // warp's lanes together, one such row after another. The fills are loaded first,
        // so they are in flight while the row's seq_lens are computed.
        const bool spare = b >= p.num_reqs && b < p.max_num_reqs;
        int fills[VLLM_MAX_GROUPS] = {0, 0, 0, 0};
#pragma unroll
        for (int g = 0; g < VLLM_MAX_GROUPS; ++g)
            if (g < p.num_groups && spare) fills[g] = p.row_fill[g][b];
        if (b < p.max_num_reqs) vllm_request_row<STAGED>(p, b, err);
#pragma unroll
        for (int g = 0; g < VLLM_MAX_GROUPS; ++g) {
            if (g >= p.num_groups) break;
            unsigned int todo = __ballot_sync(0xffffffffu, fills[g] > 0);
            while (todo) {
                const int from = __ffs(todo) - 1;
                todo &= todo - 1;
                const int fb = __shfl_sync(0xffffffffu, fills[g], from);
                const int bb = __shfl_sync(0xffffffffu, b, from);
                int* __restrict__ out = p.gathered[g] + (long long)bb * p.gathered_stride[g];
                for (int j = lane; j < fb; j += 32) out[j] = 0;
            }
            if (fills[g] > 0) p.row_fill[g][b] = 0;
        }
    } else if (ATTENTION && blk >= (int)gridDim.x - p.num_groups * p.meta_blocks) {
        const int m = blk - ((int)gridDim.x - p.num_groups * p.meta_blocks);
        vllm_attention_block<STAGED>(p, m, err);
        blk = p.token_blocks + p.request_blocks + m;  // this block's records follow the request blocks'
    } else {
        // Pairs (group g, real row b < num_reqs), pair_lanes = L lanes each: warp w takes group
        // g = w / chunks and the per_warp = 32 / L rows [c * per_warp, +per_warp) of chunk
        // c = w % chunks, chunks = ceil(num_reqs / per_warp) (the planner's grid has a warp for
        // each, VllmStepPlanner._plan). A warp's pairs share their group; all of it is 32-bit
        // (G * num_reqs < 2^26) and nothing divides at run time (G <= 4: three compares; per_warp
        // 1, 2 or 4: a shift). The loop runs the same number of times
        // for every lane of a warp, so the barrier in vllm_gather_row is reached by all of them.
        const int L = p.pair_lanes, per_warp = 32 / L, shift = __ffs(per_warp) - 1;
        const int n = p.num_reqs;
        const int chunks = (n + per_warp - 1) >> shift, total = p.num_groups * chunks;
        const int warps =
            (int)(gridDim.x - p.token_blocks - p.request_blocks - (ATTENTION ? p.num_groups * p.meta_blocks : 0)) *
            VLLM_WARPS;
        const int slot = lane / L, sub = lane - slot * L;
        for (int w = (blk - p.token_blocks - p.request_blocks) * VLLM_WARPS + (int)(threadIdx.x >> 5); w < total;
             w += warps) {
            const int g = (w >= chunks) + (w >= 2 * chunks) + (w >= 3 * chunks);
            const int b = ((w - g * chunks) << shift) + slot;
            const bool active = b < n;
            vllm_gather_row<STAGED>(p, active, active ? g : 0, active ? b : 0, sub, L);
        }
        return;  // the gather detects no error and writes no record
    }
    // This warp's record [2 * w] = mask, [2 * w + 1] = first-bad key, sticky: merged only by a
    // warp that found an error (a vote first); a clean warp writes nothing, the host clears.
    if (__any_sync(0xffffffffu, err.mask != 0u)) {
#pragma unroll
        for (int s = 16; s > 0; s >>= 1) {
            err.mask |= __shfl_xor_sync(0xffffffffu, err.mask, s);
            const unsigned long long k = __shfl_xor_sync(0xffffffffu, err.key, s);
            err.key = k < err.key ? k : err.key;
        }
        if (lane == 0) {
            const long long w = (long long)blk * VLLM_WARPS + (threadIdx.x >> 5);
            atomicOr(&p.errors[2 * w], (unsigned long long)err.mask);
            atomicMin(&p.errors[2 * w + 1], err.key);
        }
    }
}

// The staged launch's first kernel (vllm_wait_staged's comment): every group's num_blocks rows
// [0, max_num_reqs) copied from num_blocks_src[g] (pinned host memory) into num_blocks[g] (the
// planner's device copy), a thread per row: <<<ceil(max_num_reqs / VLLM_THREADS), VLLM_THREADS>>>,
// the step's parameter; GROUPS = num_groups. Its first instruction lets the step launch while it runs.
template <int GROUPS>
__global__ void __launch_bounds__(VLLM_THREADS) vllm_stage_num_blocks(const VllmStepParams p) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
    asm volatile("griddepcontrol.launch_dependents;");
#endif
    const int i = (int)(blockIdx.x * VLLM_THREADS + threadIdx.x);
    if (i >= p.max_num_reqs) return;
    int v[GROUPS];
#pragma unroll
    for (int g = 0; g < GROUPS; ++g) v[g] = p.num_blocks_src[g][i];  // every load issued before a store
#pragma unroll
    for (int g = 0; g < GROUPS; ++g) const_cast<int*>(p.num_blocks[g])[i] = v[g];
}
