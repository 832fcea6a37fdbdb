// Cache writes and copies. Both are bit copies, so they are written over a copy unit U
// (16, 8, 4 or 2 bytes: the widest that the pointers' alignment and the row size allow)
// rather than over the dtype. Layout (one layer): [num_blocks, num_kv_heads, block_size,
// head_dim]; all layers: [num_layers, num_blocks, num_kv_heads, block_size, head_dim].
// Offsets are 64-bit.

#include "kv_types.cuh"

// Writes the K/V of token blockIdx.x into its slot; a slot < 0 is padding and is skipped.
//   key, value: [num_tokens, num_kv_heads, row_units] (row_units = head_dim bytes / sizeof(U))
//   k_cache, v_cache: [num_blocks, num_kv_heads, block_size, row_units]
//   slot_mapping: [num_tokens], slot = block * block_size + offset
// Grid: x = token (grid-stride over tokens); threads over num_kv_heads * row_units.
template <class U>
__global__ void reshape_and_cache_kernel(const U* __restrict__ key, const U* __restrict__ value,
                                         U* __restrict__ k_cache, U* __restrict__ v_cache,
                                         const long long* __restrict__ slot_mapping,
                                         long long num_tokens, int num_kv_heads, int block_size,
                                         int row_units) {
    const int per_token = num_kv_heads * row_units;
    for (long long token = blockIdx.x; token < num_tokens; token += gridDim.x) {
        const long long slot = slot_mapping[token];
        if (slot < 0) continue;
        const long long blk = slot / block_size;
        const long long off = slot - blk * block_size;
        for (int i = threadIdx.x; i < per_token; i += blockDim.x) {
            const int h = i / row_units;
            const int u = i - h * row_units;
            const long long src = token * per_token + i;
            const long long dst = ((blk * num_kv_heads + h) * block_size + off) * row_units + u;
            k_cache[dst] = key[src];
            v_cache[dst] = value[src];
        }
    }
}

// Copy-on-write: block src onto block dst in every layer, K and V.
//   k_caches, v_caches: [num_layers, num_blocks, block_units] (block_units = one block's
//     num_kv_heads * block_size * head_dim bytes / sizeof(U))
//   block_mapping: [num_pairs, 2] of (src, dst)
// Grid: x = pair, y = layer; threads over block_units.
template <class U>
__global__ void copy_blocks_kernel(U* __restrict__ k_caches, U* __restrict__ v_caches,
                                   const long long* __restrict__ block_mapping,
                                   long long num_blocks, long long block_units) {
    const long long pair = blockIdx.x;
    const long long layer = blockIdx.y;
    const long long src = block_mapping[2 * pair];
    const long long dst = block_mapping[2 * pair + 1];
    const long long layer_base = layer * num_blocks * block_units;
    const long long s0 = layer_base + src * block_units;
    const long long d0 = layer_base + dst * block_units;
    for (long long i = threadIdx.x; i < block_units; i += blockDim.x) {
        k_caches[d0 + i] = k_caches[s0 + i];
        v_caches[d0 + i] = v_caches[s0 + i];
    }
}
