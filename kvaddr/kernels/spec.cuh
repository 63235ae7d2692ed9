// Speculative decoding, vLLM Model Runner V2 face (kvaddr/engines/vllm_draft.py): after the
// verify step, every draft forward's addressing in ONE launch: last_token_indices, the first
// draft forward's slot mappings with the rejected rows at -1 (optional), and for each draft step
// j = 1..k-1 its positions, seq_lens, DCP local lengths, query_start_loc and every group's slot
// mapping (DCP rules), plus, with vllm_draft_step<true>, its FlashInfer / varlen attention
// metadata. Semantics: docs/spec-decode.md and kvaddr/engines/spec_reference.py (the oracle).
// Uses vllm.cuh's error record (VllmErr, key step << 32 | request << 8 | group << 5 | bit),
// owner search, error bits, group flags and vllm_pick.
//
// Parameters: ONE struct by value (VllmDraftParams), mirrored field by field by
// kvaddr/engines/vllm_draft.py (ctypes, filled by name; tests/unit/test_vllm_draft_struct.py
// compares the layouts).

#define VDRAFT_THREADS 256
#define VDRAFT_WARPS (VDRAFT_THREADS / 32)
// num_rejected larger than the request's drafts, negative, or inconsistent with num_sampled
#define VDRAFT_ERR_NUM_REJECTED 1024

struct VllmDraftParams {
    // -- inputs (8-byte fields first) --
    const void* idx_mapping;           // [num_reqs], int32 (idx_is_64 = 0) or int64 (1): batch b -> row r; -1 = dummy
    const int* query_start_loc;        // [num_reqs + 1], int32: the verify step's
    const int* seq_lens;               // [>= num_reqs], int32: the verify step's seq_lens_t
    const int* num_rejected;           // [>= num_reqs], int32: drafts scheduled minus accepted
    const int* num_sampled;            // [>= num_reqs], int32: accepted + 1 (0 in chunked prefill)
    const void* verify_slots;          // [num_groups rows, verify_stride apart][verify_tokens], int64 or int32
                                       // (verify_is_32); read only by the token blocks (mask_rejected)
    const int* block_table[4];         // group g: [>= num_rows, width[g]], int32, row stride table_stride[g]
    const int* num_blocks[4];          // group g: [>= num_rows], int32; null: every row holds width[g]
    long long table_stride[4];         // group g: elements between rows of block_table[g]
    long long verify_stride;           // elements between two groups' rows of verify_slots
    // -- outputs (every element written every launch) --
    long long* last_token_indices;     // [max_num_reqs], int64
    long long* first_slots;            // [num_groups, max_tokens], int64 (token blocks only)
    long long* positions;              // [steps, max_num_reqs], int64
    int* seq_lens_out;                 // [steps, max_num_reqs], int32
    int* dcp_local_seq_lens;           // [steps, max_num_reqs], int32 (= seq_lens_out without DCP)
    int* query_start_loc_out;          // [steps, max_num_reqs + 1], int32
    long long* slot_mappings;          // [steps, num_groups, max_num_reqs], int64
    int* kv_indptr;                    // [steps, num_groups, max_num_reqs + 1], int32 (flashinfer)
    int* kv_indices;                   // [steps, num_groups, kv_indices_capacity], int32 (flashinfer)
    int* kv_last_page_len;             // [steps, num_groups, max_num_reqs], int32 (flashinfer)
    int* cu_seqlens_k;                 // [steps, num_groups, max_num_reqs + 1], int32 (varlen)
    int* max_seqlen_k;                 // [steps, num_groups], int32 (varlen)
    unsigned long long* errors;        // [R, 2], uint64: sticky per-warp error records (mask, first-bad key)
    // -- sizes and settings (4-byte fields) --
    int width[4];                      // group g: columns of block_table[g] (>= 1)
    int block_size[4];                 // group g: B (>= 1)
    int group_flags[4];                // group g: VLLM_GROUP_SLOTS | VLLM_GROUP_SHARDED
    int num_groups;                    // G, 1..4
    int num_reqs;                      // entries of idx_mapping (<= max_num_reqs)
    int max_num_reqs;                  // length of every per-request output row
    int num_rows;                      // rows of the block tables (and of num_blocks)
    int max_tokens;                    // T: columns of first_slots
    int verify_tokens;                 // columns of verify_slots (<= max_tokens)
    int steps;                         // k - 1, the draft steps after the first forward
    int max_model_len;                 // M >= 1: positions clamp at M - 1, seq_lens at M
    int idx_is_64;                     // idx_mapping is int64
    int verify_is_32;                  // verify_slots is int32
    int cp_size;                       // DCP ranks (1: no DCP)
    int cp_rank;                       // this rank, 0..cp_size-1
    int cp_interleave;                 // I, divides every sharded group's B
    int request_blocks;                // blocks [0, request_blocks): a thread per (step, group, batch row b <= max_num_reqs)
    int attention_blocks;              // the next steps * num_groups * meta_chunks blocks (or 0): attention metadata
    int token_blocks;                  // the last token_blocks blocks (or 0): first_slots
    int attention;                     // VLLM_ATTN_* bits written (vllm_draft_step<true>)
    int kv_indices_capacity;           // N, entries of each (step, group) row of kv_indices
    int base_step;                     // the per-step baseline's draft step (1..steps); unused by vllm_draft_step
    int base_group;                    // the per-step baseline's group; unused by vllm_draft_step
    int meta_chunks;                   // attention blocks per (step, group): ceil((max_num_reqs + 1) / meta_rows)
    int meta_rows;                     // batch rows per attention block: a power of two in [8, VDRAFT_THREADS]
};

// A load through the read-only (non-coherent) path: every input of the draft kernel stays
// unchanged while it runs, so the compiler may issue these loads ahead of the outputs' stores
// (the steps' table lookups of a row then overlap instead of following one another).
template <typename T>
__device__ __forceinline__ T vdraft_ld(const T* ptr) {
#ifdef __CUDA_ARCH__
    return __ldg(ptr);
#else
    return *ptr;
#endif
}

// One request's verify-step facts (vdraft_request).
struct VdraftReq {
    long long r;       // row (idx_mapping[b])
    long long qs, qe;  // the verify step's token range
    long long base;    // seq_lens_t - num_rejected: the draft's KV length before step 1
    long long rej;     // num_rejected
    int status;        // 0: addressed; 1: dummy (no row); 2: skipped (bad inputs)
};

__device__ __forceinline__ long long vdraft_row_of(const VllmDraftParams& p, int b) {
    return p.idx_is_64 ? vdraft_ld(reinterpret_cast<const long long*>(p.idx_mapping) + b)
                       : (long long)vdraft_ld(reinterpret_cast<const int*>(p.idx_mapping) + b);
}

// Request b's verify-step inputs as loaded (vdraft_load), before any check.
struct VdraftRaw {
    long long r;       // idx_mapping[b]
    int qs, qe;        // query_start_loc[b], [b + 1]
    int seq, rej, smp;  // seq_lens[b], num_rejected[b], num_sampled[b]
};

// Request b < num_reqs: its inputs, six independent loads.
__device__ __forceinline__ VdraftRaw vdraft_load(const VllmDraftParams& p, int b) {
    VdraftRaw x;
    x.r = vdraft_row_of(p, b);
    x.qs = vdraft_ld(p.query_start_loc + b);
    x.qe = vdraft_ld(p.query_start_loc + b + 1);
    x.seq = vdraft_ld(p.seq_lens + b);
    x.rej = vdraft_ld(p.num_rejected + b);
    x.smp = vdraft_ld(p.num_sampled + b);
    return x;
}

// Request b < num_reqs from its inputs x: its facts; with record, its per-request errors (keyed
// at step 0).
__device__ __forceinline__ VdraftReq vdraft_check(const VllmDraftParams& p, int b, const VdraftRaw& x, bool record,
                                                  VllmErr& err) {
    VdraftReq q;
    q.r = x.r;
    q.qs = x.qs;
    q.qe = x.qe;
    const long long seq = x.seq, rej = x.rej, smp = x.smp;
    const long long qlen = q.qe - q.qs;
    // (bitwise, not short-circuit: no branch after the loads, so none of them waits for
    // another's value before it is issued)
    const bool row_bad = (q.r < -1) | (q.r >= p.num_rows);
    const bool qsl_bad = (q.qs < 0) | (q.qe < q.qs);
    const bool shrt = !qsl_bad & (seq < qlen);
    const bool rej_bad = !qsl_bad & ((rej < 0) | (rej > qlen - 1) | (smp < 0) | ((smp > 1) & (smp + rej != qlen)) |
                                     ((smp == 1) & (rej != 0) & (rej + 1 != qlen)) | ((smp == 0) & (rej != 0)));
    if (record) {
        if (row_bad) err.add(VLLM_ERR_ROW_INDEX, 5, 0, b, 0);
        if (qsl_bad) err.add(VLLM_ERR_QUERY_START_LOC, 3, 0, b, 0);
        if (shrt) err.add(VLLM_ERR_NEGATIVE_COMPUTED, 7, 0, b, 0);
        if (rej_bad) err.add(VDRAFT_ERR_NUM_REJECTED, 10, 0, b, 0);
        if (!qsl_bad && q.qe > p.verify_tokens) err.add(VLLM_ERR_CAPACITY, 2, 0, b, 0);
    }
    q.base = seq - rej;
    q.rej = rej;
    q.status = (row_bad || qsl_bad || shrt || rej_bad) ? 2 : (q.r == -1 ? 1 : 0);
    return q;
}

// Request b < num_reqs: its facts; with record, its per-request errors (keyed at step 0).
__device__ __forceinline__ VdraftReq vdraft_request(const VllmDraftParams& p, int b, bool record, VllmErr& err) {
    return vdraft_check(p, b, vdraft_load(p, b), record, err);
}

// This rank's share of a KV length s (vllm_dcp_len's rule).
__device__ __forceinline__ int vdraft_dcp_len(const VllmDraftParams& p, int s) {
    if (p.cp_size == 1) return s;
    const long long il = p.cp_interleave, span = il * p.cp_size;
    long long rest = (long long)s % span - (long long)p.cp_rank * il;
    rest = rest < 0 ? 0 : (rest > il ? il : rest);
    return (int)(((long long)s / span) * il + rest);
}

// The KV length after draft step j of an addressed request: min(base + j, M).
__device__ __forceinline__ int vdraft_len(const VllmDraftParams& p, const VdraftReq& q, int j) {
    const long long s = q.base + j;
    return (int)(s < p.max_model_len ? s : (long long)p.max_model_len);
}

// Column idx and offset off of position pos (0 <= pos < 2^31) in a group of block size B, DCP-
// sharded or not: false for another DCP rank's token (slot -1, no lookup). A power-of-two B (the
// usual case) divides by a shift.
__device__ __forceinline__ bool vdraft_locate_in(const VllmDraftParams& p, unsigned int B, bool sharded, long long pos,
                                                 unsigned int& idx, unsigned int& off) {
    const unsigned int up = (unsigned int)pos;
    if (sharded) {
        const unsigned int cp = (unsigned int)p.cp_size, il = (unsigned int)p.cp_interleave;
        const unsigned int vbs = B * cp;
        idx = up / vbs;
        const unsigned int vo = up - idx * vbs;
        off = (vo / (il * cp)) * il + vo % il;
        return ((vo / il) % cp) == (unsigned int)p.cp_rank;  // else another rank's token
    }
    if ((B & (B - 1u)) == 0u) {
#ifdef __CUDA_ARCH__
        idx = up >> (__ffs((int)B) - 1);
#else
        idx = up >> __builtin_ctz(B);
#endif
        off = up & (B - 1u);
    } else {
        idx = up / B;
        off = up - idx * B;
    }
    return true;
}

// Group g's column and offset of position pos (vdraft_locate_in with g's settings).
__device__ __forceinline__ bool vdraft_locate(const VllmDraftParams& p, int g, long long pos, unsigned int& idx,
                                              unsigned int& off) {
    return vdraft_locate_in(p, (unsigned int)vllm_pick(p.block_size, g),
                            p.cp_size > 1 && (vllm_pick(p.group_flags, g) & VLLM_GROUP_SHARDED), pos, idx, off);
}

// Group g's slot (block size B) from its column idx (< width), offset off, the table entry blk
// and the row's num_blocks nb, with its errors at (step, b, g).
__device__ __forceinline__ long long vdraft_slot_of(int B, int g, unsigned int idx, unsigned int off, int blk,
                                                    long long nb, int step, int b, VllmErr& err) {
    if ((long long)idx >= nb) {
        err.add(VLLM_ERR_PAST_NUM_BLOCKS, 4, step, b, g);
        return -1;
    }
    if (blk < 0) {
        err.add(VLLM_ERR_NEGATIVE_BLOCK, 1, step, b, g);
        return -1;
    }
    return (long long)blk * B + off;
}

// Group g's slot of position pos (0 <= pos < 2^31) in row r, with its errors at (step, b, g).
__device__ __forceinline__ long long vdraft_slot(const VllmDraftParams& p, int g, long long r, long long pos, int step,
                                                 int b, VllmErr& err) {
    if (!(vllm_pick(p.group_flags, g) & VLLM_GROUP_SLOTS)) return -1;
    unsigned int idx, off;
    if (!vdraft_locate(p, g, pos, idx, off)) return -1;
    const int W = vllm_pick(p.width, g);
    if ((long long)idx >= (long long)W) {
        err.add(VLLM_ERR_BLOCK_INDEX, 0, step, b, g);
        return -1;
    }
    // the table entry (in bounds: idx < W) and num_blocks loaded together, then checked
    const int blk = vdraft_ld(vllm_pick(p.block_table, g) + r * vllm_pick(p.table_stride, g) + idx);
    const int* nbp = vllm_pick(p.num_blocks, g);
    const long long nb = nbp ? (long long)vdraft_ld(nbp + r) : (long long)W;
    return vdraft_slot_of(vllm_pick(p.block_size, g), g, idx, off, blk, nb, step, b, err);
}

// Row b < max_num_reqs of draft step j (1-based) for request facts q: position, seq_len, DCP
// local length and, with slots, each group's slot (errors at (j, b, g)).
__device__ __forceinline__ void vdraft_row_step(const VllmDraftParams& p, int b, int j, const VdraftReq& q, bool slots,
                                                VllmErr& err) {
    const int M = p.max_num_reqs, G = p.num_groups;
    const long long row = (long long)(j - 1) * M + b;
    long long pos = 0;
    int len = 0;
    if (q.status == 0) {
        pos = q.base - 1 + j;
        pos = pos < p.max_model_len - 1 ? pos : (long long)p.max_model_len - 1;
        len = vdraft_len(p, q, j);
    }
    p.positions[row] = pos;
    p.seq_lens_out[row] = len;
    p.dcp_local_seq_lens[row] = vdraft_dcp_len(p, len);
    if (!slots) return;
#pragma unroll
    for (int g = 0; g < VLLM_MAX_GROUPS; ++g) {
        if (g >= G) break;
        const long long slot = q.status == 0 ? vdraft_slot(p, g, q.r, pos, j, b, err) : -1;
        p.slot_mappings[((long long)(j - 1) * G + g) * M + b] = slot;
    }
}

// Request b's facts (status 2, zeros, for b >= num_reqs), with its per-request errors.
__device__ __forceinline__ VdraftReq vdraft_row_request(const VllmDraftParams& p, int b, bool record, VllmErr& err) {
    VdraftReq q;
    q.status = 2;
    q.r = 0;
    q.qs = q.qe = q.base = q.rej = 0;
    if (b < p.num_reqs) q = vdraft_request(p, b, record, err);
    return q;
}

// Request thread (j, g, b): draft step j (j = 1 only when there is no draft step, steps = 0),
// group g, batch row b in [0, max_num_reqs]; its slice s = (j - 1) * num_groups + g. Every thread
// makes one table lookup at most, so its code is short and the slices of a row run side by side
// instead of one after another in one thread. Its loads are two dependent round trips: the
// request's inputs, then the row's table entry and num_blocks, issued right after the position
// and column are known and before the request's checks (a speculative lookup: issued only when
// the row index and column are inside the table, so never out of bounds; used only when the
// checks pass). Thread (j, g, b) writes group g's slot of step j and, for g = 0, step j's
// query_start_loc entry, position, seq_len and DCP local length; slice 0 also writes
// last_token_indices[b] and records the request's errors (at step 0), so each error is recorded
// by exactly one thread.
// The group is a template argument (vdraft_cell picks one of the four copies, uniform over a
// block): its settings are then plain parameter-space reads at fixed offsets.
template <int g>
__device__ __forceinline__ void vdraft_cell_of(const VllmDraftParams& p, int j, int b, VllmErr& err) {
    const int n = p.num_reqs, M = p.max_num_reqs, S = p.steps;
    const int s = (j - 1) * p.num_groups + g;
    const bool step = j <= S;  // false only in slice 0 without draft steps
    const int W = p.width[g], B = p.block_size[g], flags = p.group_flags[g];
    const int *nbp = p.num_blocks[g], *tbl = p.block_table[g];
    const long long stride = p.table_stride[g];
    const bool on = step && (flags & VLLM_GROUP_SLOTS), sharded = p.cp_size > 1 && (flags & VLLM_GROUP_SHARDED);
    VdraftRaw x;
    x.r = x.qs = x.qe = x.seq = x.rej = x.smp = 0;
    if (b < n) x = vdraft_load(p, b);
    // the lookup, from the inputs as loaded: position, column, table entry and num_blocks
    // (32-bit: exact for an addressed request, 0 <= seq_lens - num_rejected - 1 + j < 2^31 + 64;
    // for any other row only its bounds matter: the column is checked against the width)
    const unsigned int v = (unsigned int)x.seq - (unsigned int)x.rej - 1u + (unsigned int)j;
    const unsigned int pos = min(v, (unsigned int)p.max_model_len - 1u);
    unsigned int idx = 0u, off = 0u;
    const bool mine = on && b < n && vdraft_locate_in(p, (unsigned int)B, sharded, pos, idx, off);
    const bool look = mine && (unsigned long long)x.r < (unsigned long long)p.num_rows && idx < (unsigned int)W;
    int blk = -1;
    long long nb = W;
    if (look) {
        blk = vdraft_ld(tbl + x.r * stride + idx);
        if (nbp) nb = (long long)vdraft_ld(nbp + x.r);
    }
    // the checks (the request's errors in slice 0)
    VdraftReq q;
    q.status = 2;
    q.r = q.qs = q.qe = q.base = q.rej = 0;
    if (b < n) q = vdraft_check(p, b, x, s == 0, err);
    const bool live = q.status == 0;
    if (step && g == 0) p.query_start_loc_out[(long long)(j - 1) * (M + 1) + b] = b < n ? b : n;
    if (b >= M) return;
    if (s == 0) p.last_token_indices[b] = q.status != 2 ? q.qe - q.rej - 1 : 0;  // qs + L - 1
    if (!step) return;
    const long long at = (long long)(j - 1) * M + b;
    if (g == 0) {
        const int len = live ? vdraft_len(p, q, j) : 0;
        p.positions[at] = live ? (long long)pos : 0;
        p.seq_lens_out[at] = len;
        p.dcp_local_seq_lens[at] = vdraft_dcp_len(p, len);
    }
    // an addressed row: its row index is inside the table, so a column inside the width was
    // looked up above (vdraft_slot's rules)
    long long slot = -1;
    if (live && mine) {
        if (idx >= (unsigned int)W) err.add(VLLM_ERR_BLOCK_INDEX, 0, j, b, g);
        else slot = vdraft_slot_of(B, g, idx, off, blk, nb, j, b, err);
    }
    p.slot_mappings[(long long)s * M + b] = slot;
}

// Request thread (j, g, b): vdraft_cell_of<g>.
__device__ __forceinline__ void vdraft_cell(const VllmDraftParams& p, int j, int g, int b, VllmErr& err) {
    static_assert(VLLM_MAX_GROUPS == 4, "one copy of vdraft_cell_of per group");
    switch (g) {
        case 0: vdraft_cell_of<0>(p, j, b, err); break;
        case 1: vdraft_cell_of<1>(p, j, b, err); break;
        case 2: vdraft_cell_of<2>(p, j, b, err); break;
        default: vdraft_cell_of<3>(p, j, b, err); break;
    }
}

// Thread tid of request block blk < request_blocks: c = ceil((max_num_reqs + 1) / VDRAFT_THREADS)
// blocks per slice, slice s = blk / c = (j - 1) * num_groups + g, batch row
// b = (blk - s * c) * VDRAFT_THREADS + tid. The quotients come before the first load: one block
// per slice (max_num_reqs < VDRAFT_THREADS) and a power-of-two group count take no division.
__device__ __forceinline__ void vdraft_request_thread(const VllmDraftParams& p, int blk, int tid, VllmErr& err) {
    const unsigned int c = ((unsigned int)p.max_num_reqs + VDRAFT_THREADS) / VDRAFT_THREADS, G = p.num_groups;
    const unsigned int s = c == 1u ? (unsigned int)blk : (unsigned int)blk / c;
    unsigned int j1;
    if ((G & (G - 1u)) == 0u) {
#ifdef __CUDA_ARCH__
        j1 = s >> (__ffs((int)G) - 1);
#else
        j1 = s >> __builtin_ctz(G);
#endif
    } else {
        j1 = s / G;
    }
    const int b = (int)(((unsigned int)blk - s * c) * VDRAFT_THREADS + (unsigned int)tid);
    if (b <= p.max_num_reqs) vdraft_cell(p, (int)j1 + 1, (int)(s - j1 * G), b, err);
}

// Column t < max_tokens of the first draft forward's slot mappings: the verify step's slot,
// -1 for a rejected token of an addressed or dummy request (owner by vLLM's search), -1 past
// the verify slots' columns.
__device__ __forceinline__ void vdraft_first_slot(const VllmDraftParams& p, int t) {
    const int n = p.num_reqs;
    bool reject = false;
    if (n > 0 && t < p.verify_tokens) {
        int b = t < n - 1 ? t : n - 1;
        if (!(p.query_start_loc[b] <= t && t < p.query_start_loc[b + 1]))
            b = vllm_owner_search(p.query_start_loc, n, t);
        VllmErr none;
        none.mask = 0;
        none.key = KV_NO_ERROR;
        const VdraftReq q = vdraft_request(p, b, false, none);
        reject = q.status != 2 && q.qs <= t && t < q.qe && t >= q.qe - q.rej;  // past qs + L
    }
    for (int g = 0; g < p.num_groups; ++g) {
        long long v = -1;
        if (t < p.verify_tokens && !reject) {
            const long long at = (long long)g * p.verify_stride + t;
            v = p.verify_is_32 ? (long long)reinterpret_cast<const int*>(p.verify_slots)[at]
                               : reinterpret_cast<const long long*>(p.verify_slots)[at];
        }
        p.first_slots[(long long)g * p.max_tokens + t] = v;
    }
}

// ---- attention metadata of the draft steps (vllm_draft_step<true>) ----
// meta_chunks blocks per (step j, group g); block (j, g, c) owns the batch rows
// [c * meta_rows, +meta_rows) of [0, max_num_reqs] (the host picks meta_rows so that the grid has
// a few hundred attention blocks: the page copies, the bulk of the work, spread over the GPU). Pass 1: every thread sums the
// (pages, L) of the rows before its block's and of all rows (rows past num_reqs have L = 0) and
// the largest L; a block reduction gives the block's carries and the totals. Pass 2: a block scan
// of its rows continues the carries (kv_indptr, cu_seqlens_k), then its rows copy their pages into
// kv_indices (vdraft_attn_copy), a warp per row, and the block pads its share of kv_indices past
// the total with -1. The per-row parts (vdraft_attn_len, vdraft_attn_row, vdraft_attn_copy) hold
// every rule; the entry holds only the sums and the scan.

// Row b's KV length L for step j (1-based) in group g (DCP share for a sharded group), 0 for a
// dummy, skipped or padding row; its row index r.
__device__ __forceinline__ int vdraft_attn_len(const VllmDraftParams& p, int j, int g, int b, long long& r) {
    r = 0;
    if (b >= p.num_reqs) return 0;
    VllmErr none;
    none.mask = 0;
    none.key = KV_NO_ERROR;
    const VdraftReq q = vdraft_request(p, b, false, none);
    if (q.status != 0) return 0;
    r = q.r;
    const int s = vdraft_len(p, q, j);
    const bool sharded = p.cp_size > 1 && (vllm_pick(p.group_flags, g) & VLLM_GROUP_SHARDED);
    return sharded ? vdraft_dcp_len(p, s) : s;
}

// Row b <= max_num_reqs with its exclusive prefixes (xp pages, xl tokens): kv_indptr,
// kv_last_page_len, cu_seqlens_k, and the row's errors (pages past the width or num_blocks,
// kv_indices capacity).
__device__ __forceinline__ void vdraft_attn_row(const VllmDraftParams& p, int j, int g, int b, int L, long long r,
                                                int xp, int xl, VllmErr& err) {
    const int M = p.max_num_reqs, G = p.num_groups;
    const long long sg = (long long)(j - 1) * G + g;
    const int B = vllm_pick(p.block_size, g);
    if (p.attention & VLLM_ATTN_FLASHINFER) {
        p.kv_indptr[sg * (M + 1) + b] = xp;
        if (b < M) p.kv_last_page_len[sg * M + b] = L > 0 ? (int)((unsigned int)(L - 1) % (unsigned int)B) + 1 : 0;
        const int P = kv_pages(L, B), W = vllm_pick(p.width, g);
        if (P > 0) {
            const int* nbp = vllm_pick(p.num_blocks, g);
            const long long nb = nbp ? (long long)nbp[r] : (long long)W;
            if (P > W) err.add(VLLM_ERR_BLOCK_INDEX, 0, j, b, g);
            else if ((long long)P > nb) err.add(VLLM_ERR_PAST_NUM_BLOCKS, 4, j, b, g);
            const int N = p.kv_indices_capacity;
            if (xp <= N && N < kv_sat_add_nn(xp, P)) err.add(VLLM_ERR_KV_INDICES_CAPACITY, 9, j, b, g);
        }
    }
    if (p.attention & VLLM_ATTN_VARLEN) p.cu_seqlens_k[sg * (M + 1) + b] = xl;
}

// Entry c of row b's pages (c < pages, start xp): kv_indices[xp + c] when below N: the table
// entry, -1 past the width or num_blocks or for a negative id (bit at (j, b, g)).
__device__ __forceinline__ void vdraft_attn_copy(const VllmDraftParams& p, int j, int g, int b, long long r, int xp,
                                                 int c, VllmErr& err) {
    const int N = p.kv_indices_capacity;
    if ((long long)xp + c >= N) return;
    const int W = vllm_pick(p.width, g);
    const int* nbp = vllm_pick(p.num_blocks, g);
    const long long nb = nbp ? (long long)vdraft_ld(nbp + r) : (long long)W;
    int v = -1;
    if (c < W && (long long)c < nb) {
        v = vdraft_ld(vllm_pick(p.block_table, g) + r * vllm_pick(p.table_stride, g) + c);
        if (v < 0) {
            err.add(VLLM_ERR_NEGATIVE_BLOCK, 1, j, b, g);
            v = -1;
        }
    }
    p.kv_indices[((long long)(j - 1) * p.num_groups + g) * N + xp + c] = v;
}

// Block c of (step j, group g), m = (j - 1) * num_groups + g, see above.
__device__ __forceinline__ void vdraft_attention_block(const VllmDraftParams& p, int m, int c, VllmErr& err) {
    __shared__ int s_start[VDRAFT_THREADS], s_pages[VDRAFT_THREADS], s_row[VDRAFT_THREADS];
    __shared__ int s_wp[VDRAFT_WARPS], s_wl[VDRAFT_WARPS], s_sum[5][VDRAFT_WARPS];
    const int tid = (int)threadIdx.x, lane = tid & 31, warp = tid >> 5;
    const int G = p.num_groups, M = p.max_num_reqs, N = p.kv_indices_capacity, n = p.num_reqs;
    const int j = 1 + m / G, g = m - (j - 1) * G;
    const int B = vllm_pick(p.block_size, g);
    const bool fi = (p.attention & VLLM_ATTN_FLASHINFER) != 0;
    const int R = p.meta_rows, base = c * R;
    // pass 1: sums before this block's rows, totals, the largest L
    int bp = 0, bl = 0, tp = 0, tl = 0, ml = 0;
#pragma unroll 4  // (independent rows: their loads overlap)
    for (int b = tid; b < n; b += VDRAFT_THREADS) {
        long long r = 0;
        const int L = vdraft_attn_len(p, j, g, b, r);
        const int P = kv_pages(L, B);
        if (b < base) {
            bp = kv_sat_add_nn(bp, P);
            bl = kv_sat_add_nn(bl, L);
        }
        tp = kv_sat_add_nn(tp, P);
        tl = kv_sat_add_nn(tl, L);
        ml = max(ml, L);
    }
#pragma unroll
    for (int off = 16; off > 0; off >>= 1) {
        bp = kv_sat_add_nn(bp, __shfl_xor_sync(0xffffffffu, bp, off));
        bl = kv_sat_add_nn(bl, __shfl_xor_sync(0xffffffffu, bl, off));
        tp = kv_sat_add_nn(tp, __shfl_xor_sync(0xffffffffu, tp, off));
        tl = kv_sat_add_nn(tl, __shfl_xor_sync(0xffffffffu, tl, off));
        ml = max(ml, __shfl_xor_sync(0xffffffffu, ml, off));
    }
    if (lane == 0) {
        s_sum[0][warp] = bp;
        s_sum[1][warp] = bl;
        s_sum[2][warp] = tp;
        s_sum[3][warp] = tl;
        s_sum[4][warp] = ml;
    }
    // pass 2: this block's rows
    const int b = base + tid;
    const bool own = tid < R && b <= M;  // a row of this block
    long long r = 0;
    const int L = own ? vdraft_attn_len(p, j, g, b, r) : 0;
    const int P = kv_pages(L, B);
    int ip = P, il = L;
#pragma unroll
    for (int off = 1; off < 32; off <<= 1) {
        const int yp = __shfl_up_sync(0xffffffffu, ip, off), yl = __shfl_up_sync(0xffffffffu, il, off);
        if (lane >= off) {
            ip = kv_sat_add_nn(ip, yp);
            il = kv_sat_add_nn(il, yl);
        }
    }
    if (lane == 31) {
        s_wp[warp] = ip;
        s_wl[warp] = il;
    }
    __syncthreads();
    int xp = 0, xl = 0, total_p = 0, max_l = 0;
    for (int w = 0; w < VDRAFT_WARPS; ++w) {
        xp = kv_sat_add_nn(xp, s_sum[0][w]);
        xl = kv_sat_add_nn(xl, s_sum[1][w]);
        total_p = kv_sat_add_nn(total_p, s_sum[2][w]);
        max_l = max(max_l, s_sum[4][w]);
    }
    for (int w = 0; w < warp; ++w) {
        xp = kv_sat_add_nn(xp, s_wp[w]);
        xl = kv_sat_add_nn(xl, s_wl[w]);
    }
    int ep = __shfl_up_sync(0xffffffffu, ip, 1), el = __shfl_up_sync(0xffffffffu, il, 1);
    if (lane == 0) ep = el = 0;
    xp = kv_sat_add_nn(xp, ep);  // exclusive prefixes of row b
    xl = kv_sat_add_nn(xl, el);
    if (own) vdraft_attn_row(p, j, g, b, L, r, xp, xl, err);
    if (fi) {
        s_start[tid] = xp;
        s_pages[tid] = own && b < n ? P : 0;
        s_row[tid] = (int)r;
        __syncthreads();
        for (int i = warp; i < R; i += VDRAFT_WARPS) {
            const int cnt = s_pages[i];
#pragma unroll 4  // (read-only loads: the next entries' loads go ahead of this one's store)
            for (int e = lane; e < cnt; e += 32) vdraft_attn_copy(p, j, g, base + i, s_row[i], s_start[i], e, err);
        }
        // this block's share of kv_indices past the total: -1
        const int C = p.meta_chunks;
        const int per = (int)(((long long)N + C - 1) / C);
        const int lo = (int)min((long long)c * per, (long long)N), hi = (int)min((long long)lo + per, (long long)N);
        int* out = p.kv_indices + (long long)m * N;
        for (int e = max(lo, total_p) + tid; e < hi; e += VDRAFT_THREADS) out[e] = -1;
    }
    if (c == 0 && tid == 0 && (p.attention & VLLM_ATTN_VARLEN)) p.max_seqlen_k[m] = max_l;
}

// The draft addressing: <<<request_blocks + attention_blocks + token_blocks, VDRAFT_THREADS>>>,
// one parameter. Request blocks: ceil((max_num_reqs + 1) / VDRAFT_THREADS) per slice, of
// steps * num_groups slices (s = (j - 1) * num_groups + g; one slice when steps = 0): a thread per
// (slice, batch row b <= max_num_reqs) (vdraft_request_thread, vdraft_cell), the slice's step and
// group uniform over a block;
// attention blocks (ATTENTION only): meta_chunks per (draft step, group); token blocks: a thread per
// column of first_slots. Every warp of the request and attention blocks has an error record
// of its own, merged only by a warp that found an error (sticky; the host reduces and clears).
template <bool ATTENTION>
__global__ void __launch_bounds__(VDRAFT_THREADS, 1) vllm_draft_step(const VllmDraftParams p) {
    VllmErr err;
    err.mask = 0;
    err.key = KV_NO_ERROR;
    const int blk = (int)blockIdx.x;
    const int lane = (int)(threadIdx.x & 31);
    if (blk < p.request_blocks) {
        vdraft_request_thread(p, blk, (int)threadIdx.x, err);
    } else if (blk < p.request_blocks + p.attention_blocks) {
        if (ATTENTION) {
            const int a = blk - p.request_blocks;
            vdraft_attention_block(p, a / p.meta_chunks, a - (a / p.meta_chunks) * p.meta_chunks, err);
        }
    } else {
        const int t = (blk - p.request_blocks - p.attention_blocks) * VDRAFT_THREADS + (int)threadIdx.x;
        if (t < p.max_tokens) vdraft_first_slot(p, t);
        return;  // the token blocks record no error
    }
    if (__any_sync(0xffffffffu, err.mask != 0u)) {
#pragma unroll
        for (int s = 16; s > 0; s >>= 1) {
            err.mask |= __shfl_xor_sync(0xffffffffu, err.mask, s);
            const unsigned long long k = __shfl_xor_sync(0xffffffffu, err.key, s);
            err.key = k < err.key ? k : err.key;
        }
        if (lane == 0) {
            const long long w = (long long)blk * VDRAFT_WARPS + (threadIdx.x >> 5);
            atomicOr(&p.errors[2 * w], (unsigned long long)err.mask);
            atomicMin(&p.errors[2 * w + 1], err.key);
        }
    }
}

