// Paged attention: causal attention of packed (varlen) queries over a paged K/V cache.
//
// Cache layout (one layer): K and V are each [num_blocks, num_kv_heads, block_size,
// head_dim], one contiguous block_size x head_dim tile per block and KV head. Queries and
// the output are [num_query_tokens, num_heads, head_dim]; sequence i owns query tokens
// query_start_loc[i] .. query_start_loc[i+1]; query j of sequence i sits at position
// context_lens[i] - q_len_i + j and sees positions 0 .. that position.
//
// Work mapping. For one sequence and one KV head, the "rows" are the (query token, query
// head) pairs that read this KV head: row = j * group + g for query j and head g of the
// group. A CTA owns ROWS consecutive rows of one sequence and one KV head, so that every
// K/V tile it loads serves its whole query-head group (decode: ROWS >= group reads each
// KV head once). Grid: x = row-tile slots, y = KV head, z = split.
//
// Row-tile slots. Sequence i owns slots base(i) .. base(i+1) - 1 with
//     base(i) = floor(query_start_loc[i] * group / ROWS) + slot_pad * i.
// When ROWS divides group, slot_pad = 0 and each sequence gets exactly the tiles it needs;
// otherwise slot_pad = 1 gives it at least ceil(q_len * group / ROWS) of them (spare
// slots exit at once). A CTA finds its sequence by binary search over query_start_loc, so
// the launch needs no host-side knowledge of the query lengths.
//
// Inside a CTA, NUM_WARPS warps take the KV blocks of the CTA's range in turn (warp w:
// blocks w, w + NUM_WARPS, ...). Each warp keeps its own online-softmax state per row
// (running max m, running sum l, fp32 accumulator), and processes a block in three steps:
//   1. scores: lanes are grouped LPT to a token; each lane holds 16-byte vectors of the
//      token's K row, dots them with its slice of every row's query (kept in registers,
//      pre-scaled by scale * log2 e), and the group reduces with shuffles. Scores of
//      positions past a row's causal limit are -inf.
//   2. softmax: per row, block max, new running max, p = exp2(s - m) into shared memory,
//      rescale l and the accumulator by exp2(m_old - m_new).
//   3. values: the same lane mapping over V rows; a lane adds p * v to a row's
//      accumulator only where the position is visible to that row (a predicated select,
//      never a multiplication by a zero weight).
// Tokens at or past the CTA's last visible position are never loaded, K or V, so slots
// that hold no token (tails of last blocks) never reach the arithmetic, and block-table
// entries past a sequence's last needed block are never read.
// At the end the token groups of a warp, then the warps, are combined (log-sum-exp
// rescaling through shared memory). Without split the CTA writes the normalised output;
// with split it writes fp32 partials (unnormalised accumulator, max, sum) that
// paged_attention_reduce_kernel combines.
//
// Split-K: split s of num_splits covers the s-th of num_splits equal runs of the CTA's
// KV blocks. A split that gets no block still writes its partial (max -inf, sum 0).
//
// Offsets into the cache, the queries, the output and the partials are 64-bit.

#include "kv_types.cuh"

#define PA_NUM_WARPS 4
#define PA_THREADS (PA_NUM_WARPS * 32)
#define PA_NEG_INF (-__int_as_float(0x7f800000))

// Largest i in [0, num_seqs) with base(i) <= slot (base(0) = 0 <= slot always holds).
__device__ __forceinline__ int pa_find_sequence(const int* __restrict__ query_start_loc,
                                                int num_seqs, long long group, int rows,
                                                int slot_pad, long long slot) {
    int lo = 0, hi = num_seqs - 1;
    while (lo < hi) {
        const int mid = (lo + hi + 1) >> 1;
        const long long base = (static_cast<long long>(query_start_loc[mid]) * group) / rows +
                               static_cast<long long>(slot_pad) * mid;
        if (base <= slot) {
            lo = mid;
        } else {
            hi = mid - 1;
        }
    }
    return lo;
}

// Loads this lane's 16-byte vectors of tile rows t0 + u * TPS + tg (u < UNROLL) of one
// K or V tile into registers, all loads in flight at once. Rows >= n (past the tokens
// of the block) are never read: they are zero.
template <int UNROLL, int NV, int TPS, int LPT, int VEC, int HEAD_DIM, class S>
__device__ __forceinline__ void pa_load_rows(kv_u128 (&regs)[UNROLL][NV], const S* __restrict__ tile,
                                             int t0, int n, int tg, int li) {
#pragma unroll
    for (int u = 0; u < UNROLL; ++u) {
        const int t = t0 + u * TPS + tg;
#pragma unroll
        for (int v = 0; v < NV; ++v) {
            if (t < n) {
                regs[u][v] = *reinterpret_cast<const kv_u128*>(
                    tile + static_cast<long long>(t) * HEAD_DIM + (li + v * LPT) * VEC);
            } else {
                regs[u][v].x = regs[u][v].y = regs[u][v].z = regs[u][v].w = 0u;
            }
        }
    }
}

template <class T, int HEAD_DIM, int ROWS>
__global__ void __launch_bounds__(PA_THREADS)
paged_attention_kernel(typename KVType<T>::storage* __restrict__ out,       // [tokens, heads, D]
                       float* __restrict__ part_acc,                        // [splits, tokens*heads, D]
                       float* __restrict__ part_max,                        // [splits, tokens*heads]
                       float* __restrict__ part_sum,                        // [splits, tokens*heads]
                       const typename KVType<T>::storage* __restrict__ query,
                       const typename KVType<T>::storage* __restrict__ k_cache,
                       const typename KVType<T>::storage* __restrict__ v_cache,
                       const int* __restrict__ block_tables,                // [seqs, max_num_blocks]
                       const int* __restrict__ context_lens,                // [seqs]
                       const int* __restrict__ query_start_loc,             // [seqs + 1]
                       float scale_log2,        // softmax scale * log2(e)
                       int num_seqs, int num_tokens, int num_heads, int num_kv_heads,
                       int block_size, int max_num_blocks, int num_splits, int slot_pad) {
    typedef KVType<T> KV;
    typedef typename KV::storage S;
    constexpr int VEC = 16 / static_cast<int>(sizeof(S));       // elements per 16 bytes
    constexpr int VECS_PER_ROW = HEAD_DIM / VEC;                 // 16-byte vectors per K row
    constexpr int LPT = VECS_PER_ROW < 32 ? VECS_PER_ROW : 32;  // lanes per token
    constexpr int NV = VECS_PER_ROW / LPT;                       // vectors per lane per token
    constexpr int TPS = 32 / LPT;                                // tokens per warp step
    constexpr int E = NV * VEC;                                  // elements per lane
    constexpr int UNROLL = 4;                                    // steps with loads in flight
    static_assert(HEAD_DIM % VEC == 0 && VECS_PER_ROW % LPT == 0, "head_dim");
    static_assert(ROWS >= 1 && ROWS <= 8, "rows per CTA");

    extern __shared__ float smem[];

    const int warp = threadIdx.x >> 5;
    const int lane = threadIdx.x & 31;
    const int li = lane % LPT;   // lane within the token group
    const int tg = lane / LPT;   // token group within the warp
    const long long group = num_heads / num_kv_heads;
    const int kvh = blockIdx.y;
    const int split = blockIdx.z;

    // Which sequence and which tile of its rows.
    const long long slot = blockIdx.x;
    const int seq = pa_find_sequence(query_start_loc, num_seqs, group, ROWS, slot_pad, slot);
    const int q0 = query_start_loc[seq];
    const int q_len = query_start_loc[seq + 1] - q0;
    const long long seq_base = (static_cast<long long>(q0) * group) / ROWS +
                               static_cast<long long>(slot_pad) * seq;
    const long long row0 = (slot - seq_base) * ROWS;
    const long long rows_seq = static_cast<long long>(q_len) * group;
    if (row0 >= rows_seq) return;  // a spare slot (uniform over the CTA)
    const int ctx = context_lens[seq];

    // Rows of this CTA: causal limit, token, head.
    int pos[ROWS];          // last visible position, -1 for a row past the tile's end
    long long qo[ROWS];     // element offset of the row's query / output vector
#pragma unroll
    for (int r = 0; r < ROWS; ++r) {
        const long long rr = row0 + r;
        if (rr < rows_seq) {
            const long long j = rr / group;
            const long long g = rr - j * group;
            pos[r] = ctx - q_len + static_cast<int>(j);
            qo[r] = ((static_cast<long long>(q0) + j) * num_heads + kvh * group + g) * HEAD_DIM;
        } else {
            pos[r] = -1;
            qo[r] = 0;
        }
    }
    const long long last_row = (row0 + ROWS < rows_seq ? row0 + ROWS : rows_seq) - 1;
    const int kv_end = ctx - q_len + static_cast<int>(last_row / group) + 1;  // tokens 0..kv_end-1
    const int num_blk = kv_end > 0 ? (kv_end + block_size - 1) / block_size : 0;
    const int blk_per_split = (num_blk + num_splits - 1) / num_splits;
    const int blk_lo = split * blk_per_split;
    const int blk_hi = min(num_blk, blk_lo + blk_per_split);

    // This lane's slice of every row's query, pre-scaled.
    float q[ROWS][E];
#pragma unroll
    for (int r = 0; r < ROWS; ++r) {
#pragma unroll
        for (int v = 0; v < NV; ++v) {
#pragma unroll
            for (int e = 0; e < VEC; ++e) {
                const int d = (li + v * LPT) * VEC + e;
                q[r][v * VEC + e] = pos[r] >= 0 ? KV::to_float(query[qo[r] + d]) * scale_log2 : 0.f;
            }
        }
    }

    float m[ROWS], l[ROWS], acc[ROWS][E];
#pragma unroll
    for (int r = 0; r < ROWS; ++r) {
        m[r] = PA_NEG_INF;
        l[r] = 0.f;
#pragma unroll
        for (int e = 0; e < E; ++e) acc[r][e] = 0.f;
    }

    float* sc = smem + warp * ROWS * block_size;  // this warp's [ROWS][block_size] scores
    const long long tile_elems = static_cast<long long>(block_size) * HEAD_DIM;
    const int* table = block_tables + static_cast<long long>(seq) * max_num_blocks;

    for (int b = blk_lo + warp; b < blk_hi; b += PA_NUM_WARPS) {
        const long long phys = table[b];
        const int tok0 = b * block_size;
        const int n = min(block_size, kv_end - tok0);  // tokens of this block to read, >= 1
        const long long tile = (phys * num_kv_heads + kvh) * tile_elems;
        const S* kt = k_cache + tile;
        const S* vt = v_cache + tile;

        // 1. scores
        for (int t0 = 0; t0 < n; t0 += TPS * UNROLL) {
            kv_u128 kr[UNROLL][NV];
            pa_load_rows<UNROLL, NV, TPS, LPT, VEC, HEAD_DIM>(kr, kt, t0, n, tg, li);
#pragma unroll
            for (int u = 0; u < UNROLL; ++u) {
                const int t = t0 + u * TPS + tg;
                float kf[E];
#pragma unroll
                for (int v = 0; v < NV; ++v) KV::unpack(kr[u][v], kf + v * VEC);
#pragma unroll
                for (int r = 0; r < ROWS; ++r) {
                    float s = 0.f;
#pragma unroll
                    for (int e = 0; e < E; ++e) s = fmaf(q[r][e], kf[e], s);
#pragma unroll
                    for (int o = LPT / 2; o > 0; o >>= 1) s += __shfl_xor_sync(0xffffffffu, s, o);
                    if (li == 0 && t < n) {
                        sc[r * block_size + t] = (tok0 + t <= pos[r]) ? s : PA_NEG_INF;
                    }
                }
            }
        }
        __syncwarp();

        // 2. online softmax over the block
#pragma unroll
        for (int r = 0; r < ROWS; ++r) {
            float* row = sc + r * block_size;
            float bm = PA_NEG_INF;
            for (int t = lane; t < n; t += 32) bm = fmaxf(bm, row[t]);
#pragma unroll
            for (int o = 16; o > 0; o >>= 1) bm = fmaxf(bm, __shfl_xor_sync(0xffffffffu, bm, o));
            const float m_new = fmaxf(m[r], bm);
            if (m_new == PA_NEG_INF) {
                // Nothing visible to this row so far: weights 0, state unchanged.
                for (int t = lane; t < n; t += 32) row[t] = 0.f;
                continue;
            }
            const float alpha = exp2f(m[r] - m_new);  // 0 when m[r] is -inf
            float sum = 0.f;
            for (int t = lane; t < n; t += 32) {
                const float p = exp2f(row[t] - m_new);  // 0 for a masked score
                row[t] = p;
                sum += p;
            }
#pragma unroll
            for (int o = 16; o > 0; o >>= 1) sum += __shfl_xor_sync(0xffffffffu, sum, o);
            l[r] = l[r] * alpha + sum;
            m[r] = m_new;
#pragma unroll
            for (int e = 0; e < E; ++e) acc[r][e] *= alpha;
        }
        __syncwarp();

        // 3. values
        for (int t0 = 0; t0 < n; t0 += TPS * UNROLL) {
            kv_u128 vr[UNROLL][NV];
            pa_load_rows<UNROLL, NV, TPS, LPT, VEC, HEAD_DIM>(vr, vt, t0, n, tg, li);
#pragma unroll
            for (int u = 0; u < UNROLL; ++u) {
                const int t = t0 + u * TPS + tg;
                if (t < n) {
                    float vf[E];
#pragma unroll
                    for (int v = 0; v < NV; ++v) KV::unpack(vr[u][v], vf + v * VEC);
#pragma unroll
                    for (int r = 0; r < ROWS; ++r) {
                        if (tok0 + t <= pos[r]) {
                            const float p = sc[r * block_size + t];
#pragma unroll
                            for (int e = 0; e < E; ++e) acc[r][e] = fmaf(p, vf[e], acc[r][e]);
                        }
                    }
                }
            }
        }
        __syncwarp();
    }

    // Combine the token groups of the warp: lanes li of every group hold the same dims.
#pragma unroll
    for (int o = LPT; o < 32; o <<= 1) {
#pragma unroll
        for (int r = 0; r < ROWS; ++r) {
#pragma unroll
            for (int e = 0; e < E; ++e) acc[r][e] += __shfl_xor_sync(0xffffffffu, acc[r][e], o);
        }
    }

    // Combine the warps through shared memory (the score area is reused).
    __syncthreads();
    float* red_acc = smem;                                    // [NUM_WARPS][ROWS][HEAD_DIM]
    float* red_max = smem + PA_NUM_WARPS * ROWS * HEAD_DIM;   // [NUM_WARPS][ROWS]
    float* red_sum = red_max + PA_NUM_WARPS * ROWS;           // [NUM_WARPS][ROWS]
    if (tg == 0) {
#pragma unroll
        for (int r = 0; r < ROWS; ++r) {
#pragma unroll
            for (int v = 0; v < NV; ++v) {
#pragma unroll
                for (int e = 0; e < VEC; ++e) {
                    red_acc[(warp * ROWS + r) * HEAD_DIM + (li + v * LPT) * VEC + e] = acc[r][v * VEC + e];
                }
            }
        }
    }
    if (lane == 0) {
#pragma unroll
        for (int r = 0; r < ROWS; ++r) {
            red_max[warp * ROWS + r] = m[r];
            red_sum[warp * ROWS + r] = l[r];
        }
    }
    __syncthreads();

    const long long rows_total = static_cast<long long>(num_tokens) * num_heads;
    for (int i = threadIdx.x; i < ROWS * HEAD_DIM; i += PA_THREADS) {
        const int r = i / HEAD_DIM;
        const int d = i - r * HEAD_DIM;
        // Registers indexed by a run-time r would go to local memory: select instead.
        int pos_r = -1;
        long long qo_r = 0;
#pragma unroll
        for (int k = 0; k < ROWS; ++k) {
            if (k == r) {
                pos_r = pos[k];
                qo_r = qo[k];
            }
        }
        if (pos_r < 0) continue;  // row past the tile's end
        float mx = PA_NEG_INF;
#pragma unroll
        for (int w = 0; w < PA_NUM_WARPS; ++w) mx = fmaxf(mx, red_max[w * ROWS + r]);
        float a = 0.f, s = 0.f;
        if (mx != PA_NEG_INF) {
#pragma unroll
            for (int w = 0; w < PA_NUM_WARPS; ++w) {
                const float mw = red_max[w * ROWS + r];
                if (mw != PA_NEG_INF) {
                    const float f = exp2f(mw - mx);
                    a = fmaf(f, red_acc[(w * ROWS + r) * HEAD_DIM + d], a);
                    s = fmaf(f, red_sum[w * ROWS + r], s);
                }
            }
        }
        if (num_splits == 1) {
            out[qo_r + d] = KV::from_float(a / s);
        } else {
            const long long prow = static_cast<long long>(split) * rows_total + qo_r / HEAD_DIM;
            part_acc[prow * HEAD_DIM + d] = a;
            if (d == 0) {
                part_max[prow] = mx;
                part_sum[prow] = s;
            }
        }
    }
}

// Combines the split partials of every (query token, head) row.
// Grid: x = row (num_tokens * num_heads); 128 threads over head_dim.
template <class T>
__global__ void __launch_bounds__(128)
paged_attention_reduce_kernel(typename KVType<T>::storage* __restrict__ out,  // [rows, D]
                              const float* __restrict__ part_acc,             // [splits, rows, D]
                              const float* __restrict__ part_max,             // [splits, rows]
                              const float* __restrict__ part_sum,             // [splits, rows]
                              long long num_rows, int head_dim, int num_splits) {
    typedef KVType<T> KV;
    const long long row = blockIdx.x;
    float mx = PA_NEG_INF;
    for (int s = 0; s < num_splits; ++s) mx = fmaxf(mx, part_max[s * num_rows + row]);
    for (int d = threadIdx.x; d < head_dim; d += blockDim.x) {
        float a = 0.f, l = 0.f;
        if (mx != PA_NEG_INF) {
            for (int s = 0; s < num_splits; ++s) {
                const long long prow = s * num_rows + row;
                const float ms = part_max[prow];
                if (ms != PA_NEG_INF) {  // an empty split holds no weight (and no data)
                    const float f = exp2f(ms - mx);
                    a = fmaf(f, part_acc[prow * head_dim + d], a);
                    l = fmaf(f, part_sum[prow], l);
                }
            }
        }
        out[row * head_dim + d] = KV::from_float(a / l);
    }
}
