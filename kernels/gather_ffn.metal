// Metal kernels of mlx_flash.gather_ffn: the FFN computed straight from neuron-cache rows.
//
// This file is NOT a standalone Metal translation unit. mlx.core.fast.metal_kernel takes a
// kernel *body* and generates the signature itself, so the file holds one shared header and
// one body per kernel, each introduced by a marker line
//
//     //== section: <name> ==
//
// which mlx_flash/gather_ffn.py splits on ("header", "row_dot", "row_axpy"). Everything
// before the first marker (this comment) is ignored.
//
// Arguments the generated signature provides (MLX writes them from the inputs and the
// names the body uses):
//   x / w     const device TX*      activations [B, n_in] / weights [B, K], row-contiguous
//   rows      const device uint8_t* the cache [capacity, stride] (rows_shape = {capacity, stride})
//   slots     const device int32_t* [K] cache rows to use (rows_shape/slots_shape: const constant int*)
//   out       device TO*            [B, K] (row_dot) or [B, N] (row_axpy)
// Inputs of fewer than 8 elements are bound in the `constant` address space instead of
// `device`, so the bodies never bind x, w or slots to an explicitly qualified pointer.
//
// Template arguments (both kernels):
//   T      stored float type: the weights (BITS == 0) or the scales and biases (quantised)
//   TO     output type (the dtype of x or w)
//   N      length of one stored row (n_in for row_dot, n_out for row_axpy)
//   BITS   0 for float rows, else 2, 4 or 8 (MLX affine quantisation)
//   GS     quantisation group size (1 for float rows: unused)
//   W_OFF, S_OFF, B_OFF  byte offsets of <name>.weight / .scales / .biases inside a row
//                        (the wrapper checks W_OFF % sizeof(weight word) == 0 and so on)
// row_axpy only:
//   TC, TJ threadgroup shape: TC column threads x TJ partial sums over j
//
// Quantised rows, MLX affine: element i of a row is  scale[g] * q_i + bias[g],  g = i / GS,
// q_i = (word[i / PER] >> (BITS * (i % PER))) & (2^BITS - 1),  PER = 32 / BITS values per
// little-endian uint32 word. GS is a multiple of PER, so one word never spans two groups.
// Every sum is accumulated in float32. Slots outside [0, capacity) contribute 0.

//== section: header ==

// Pointer to the component at byte `offset` of a cache row, read as U.
template <typename U>
inline const device U* gf_component(const device uint8_t* row, int offset) {
    return reinterpret_cast<const device U*>(row + offset);
}

//== section: row_dot ==

    // out[b, j] = sum_i x[b, i] * W_j[i],  W_j = row slots[j] of the cache, length N.
    // Grid (32 * K, B, 1), threadgroup (256, 1, 1): one simdgroup per (j, b); lane l handles
    // elements (float rows) or packed words (quantised rows) l, l + 32, ...; simd_sum adds
    // the 32 partial sums.
    constexpr int PER = 32 / (BITS == 0 ? 32 : BITS);  // values per uint32 word (1: float)
    constexpr uint32_t MASK = (1u << BITS) - 1u;
    const uint K = slots_shape[0];
    const uint j = thread_position_in_grid.x / 32;
    const uint b = thread_position_in_grid.y;
    const uint lane = thread_index_in_simdgroup;
    if (j >= K) {
        return;  // only whole simdgroups get here: the grid is 32 * K wide
    }
    const int slot = slots[j];
    const uint capacity = rows_shape[0];
    const size_t stride = rows_shape[1];
    auto xb = x + size_t(b) * N;
    float acc = 0.0f;
    if (slot >= 0 && uint(slot) < capacity) {
        const device uint8_t* row = rows + size_t(slot) * stride;
        if (BITS == 0) {
            const device T* wr = gf_component<T>(row, W_OFF);
            for (int i = lane; i < N; i += 32) {
                acc += static_cast<float>(wr[i]) * static_cast<float>(xb[i]);
            }
        } else {
            const device uint32_t* wq = gf_component<uint32_t>(row, W_OFF);
            const device T* scales = gf_component<T>(row, S_OFF);
            const device T* biases = gf_component<T>(row, B_OFF);
            for (int wi = lane; wi < N / PER; wi += 32) {
                const uint32_t word = wq[wi];
                const int i0 = wi * PER;
                float qx = 0.0f;  // sum_t q_t * x_t
                float sx = 0.0f;  // sum_t x_t
                for (int t = 0; t < PER; t++) {
                    const float xv = static_cast<float>(xb[i0 + t]);
                    qx += static_cast<float>((word >> (BITS * t)) & MASK) * xv;
                    sx += xv;
                }
                const int g = i0 / GS;
                acc += static_cast<float>(scales[g]) * qx + static_cast<float>(biases[g]) * sx;
            }
        }
    }
    acc = simd_sum(acc);
    if (lane == 0) {
        out[size_t(b) * K + j] = static_cast<TO>(acc);
    }

//== section: row_axpy ==

    // out[b, c] = sum_j w[b, j] * W_j[c],  W_j = row slots[j] of the cache, length N.
    // NW = N / PER columns of threads: thread column c owns the PER output columns of packed
    // word c (one column for float rows). Grid (TC * ceil(NW / TC), TJ, B), threadgroup
    // (TC, TJ, 1): thread (c, ty) sums rows j = ty, ty + TJ, ...; the TJ partial sums of a
    // column are then added through threadgroup memory. Every thread reaches the barrier.
    constexpr int PER = 32 / (BITS == 0 ? 32 : BITS);
    constexpr int NW = N / PER;
    constexpr uint32_t MASK = (1u << BITS) - 1u;
    const uint K = slots_shape[0];
    const uint c = thread_position_in_grid.x;
    const uint b = thread_position_in_grid.z;
    const uint tx = thread_position_in_threadgroup.x;
    const uint ty = thread_position_in_threadgroup.y;
    const uint capacity = rows_shape[0];
    const size_t stride = rows_shape[1];
    float acc[PER];
    for (int t = 0; t < PER; t++) {
        acc[t] = 0.0f;
    }
    if (c < uint(NW)) {
        for (uint j = ty; j < K; j += TJ) {
            const int slot = slots[j];
            if (slot < 0 || uint(slot) >= capacity) {
                continue;
            }
            const float wj = static_cast<float>(w[size_t(b) * K + j]);
            const device uint8_t* row = rows + size_t(slot) * stride;
            if (BITS == 0) {
                acc[0] += wj * static_cast<float>(gf_component<T>(row, W_OFF)[c]);
            } else {
                const uint32_t word = gf_component<uint32_t>(row, W_OFF)[c];
                const int g = int(c) * PER / GS;
                const float s = wj * static_cast<float>(gf_component<T>(row, S_OFF)[g]);
                const float z = wj * static_cast<float>(gf_component<T>(row, B_OFF)[g]);
                for (int t = 0; t < PER; t++) {
                    acc[t] += s * static_cast<float>((word >> (BITS * t)) & MASK) + z;
                }
            }
        }
    }
    threadgroup float partial[TJ][PER][TC];
    for (int t = 0; t < PER; t++) {
        partial[ty][t][tx] = acc[t];
    }
    threadgroup_barrier(mem_flags::mem_threadgroup);
    if (ty == 0 && c < uint(NW)) {
        for (int t = 0; t < PER; t++) {
            float sum = 0.0f;
            for (int r = 0; r < TJ; r++) {
                sum += partial[r][t][tx];
            }
            out[size_t(b) * N + size_t(c) * PER + t] = static_cast<TO>(sum);
        }
    }
