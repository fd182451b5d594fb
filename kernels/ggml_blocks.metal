// Metal kernel of mlx_flash.compute.blocks: x . each row of a matrix of GGML blocks (format/ggml.py), read as the
// GGUF stores them: no dequantised copy of the matrix (MLX's ops would make one, 6-8 bytes a weight).
//
// Not a standalone Metal translation unit: mlx.core.fast.metal_kernel takes a kernel body and writes the signature
// itself, so the file holds a shared header and the body, each after a marker line `//== section: <name> ==`
// (split by io/kernel_source.py). Everything before the first marker (this comment) is ignored.
//
// Arguments (the generated signature):
//   x    const device TX*      activations [B, N]
//   w    const device uint8_t* the matrix [K, RB]: K rows of N values, RB bytes a row (N / VALUES blocks of BB)
//   out  device TO*            [B, K]
// Template arguments: KIND (the kernels' numbering, compute/cpu_gemv.py GGML_KINDS), N, RB, VALUES and BB (values
// and bytes a block), TO.
//
// A value is dequantised in float32 as llama.cpp's dequantize_row_* computes it (and format/ggml.py); products and
// sums are float32, in the kernel's own order (within float rounding of MLX's dequantise-then-multiply).

//== section: header ==

enum { GG_Q4_0, GG_Q8_0, GG_Q4_K, GG_Q5_K, GG_Q6_K, GG_Q2_K, GG_Q3_K, GG_IQ4_NL, GG_IQ4_XS, GG_Q5_0 };

inline float gg_f16(const device uint8_t* p) { return float(as_type<half>(ushort(p[0] | (p[1] << 8)))); }

inline int gg_i8(uint8_t v) { return int(v) - ((v & 0x80) ? 256 : 0); }

inline float gg_iq4(int q) {
    // llama.cpp's kvalues_iq4nl
    const int table[16] = {-127, -104, -83, -65, -49, -35, -22, -10, 1, 13, 25, 38, 53, 69, 89, 113};
    return float(table[q]);
}

// Q4_K / Q5_K: sub-block s's 6-bit scale and min (llama.cpp's get_scale_min_k4), q = the 12 bytes
inline void gg_scale_min_k4(const device uint8_t* q, int s, thread float& sc, thread float& m) {
    if (s < 4) {
        sc = float(q[s] & 63), m = float(q[s + 4] & 63);
    } else {
        sc = float((q[s + 4] & 0xF) | ((q[s - 4] >> 6) << 4)), m = float((q[s + 4] >> 4) | ((q[s] >> 6) << 4));
    }
}

// The 32 values v of sub-block s (values 32 s .. 32 s + 31) of block b
template <int KIND>
inline void gg_values32(const device uint8_t* b, int s, thread float* v) {
    if (KIND == GG_Q4_0 || KIND == GG_IQ4_NL) {
        const float d = gg_f16(b);
        for (int l = 0; l < 32; l++) {
            const int q = l < 16 ? (b[2 + l] & 0xF) : (b[2 + l - 16] >> 4);
            v[l] = KIND == GG_Q4_0 ? d * float(q - 8) : d * gg_iq4(q);
        }
    } else if (KIND == GG_Q8_0) {
        const float d = gg_f16(b);
        for (int l = 0; l < 32; l++) v[l] = d * float(gg_i8(b[2 + l]));
    } else if (KIND == GG_Q5_0) {  // 32 high bits, then Q4_0's nibbles
        const float d = gg_f16(b);
        const uint qh = uint(b[2]) | (uint(b[3]) << 8) | (uint(b[4]) << 16) | (uint(b[5]) << 24);
        for (int l = 0; l < 32; l++) {
            const int q = (l < 16 ? (b[6 + l] & 0xF) : (b[6 + l - 16] >> 4)) | int(((qh >> l) & 1) << 4);
            v[l] = d * float(q - 16);
        }
    } else if (KIND == GG_Q4_K || KIND == GG_Q5_K) {
        float sc, m;
        gg_scale_min_k4(b + 4, s, sc, m);
        const float d = gg_f16(b) * sc, dm = gg_f16(b + 2) * m;
        const device uint8_t* qs = b + (KIND == GG_Q4_K ? 16 : 48) + 32 * (s / 2);
        for (int l = 0; l < 32; l++) {
            int q = (qs[l] >> (4 * (s % 2))) & 0xF;
            if (KIND == GG_Q5_K) q |= ((b[16 + l] >> s) & 1) << 4;
            v[l] = d * float(q) - dm;
        }
    } else if (KIND == GG_Q6_K) {  // half h of 128 values, quarter t: ql, qh, scales of that half
        const int h = s / 4, t = s % 4;
        const device uint8_t* ql = b + 64 * h + 32 * (t & 1);
        const device uint8_t* qh = b + 128 + 32 * h;
        const float d = gg_f16(b + 208);
        for (int l = 0; l < 32; l++) {
            const int q = (((ql[l] >> (4 * (t >> 1))) & 0xF) | (((qh[l] >> (2 * t)) & 3) << 4)) - 32;
            v[l] = d * float(gg_i8(b[192 + 8 * h + l / 16 + 2 * t])) * float(q);
        }
    } else if (KIND == GG_Q2_K) {
        const int h = s / 4, j = s % 4;
        const float d = gg_f16(b + 80), dmin = gg_f16(b + 82);
        for (int l = 0; l < 32; l++) {
            const uint8_t sc = b[8 * h + 2 * j + l / 16];
            const int q = (b[16 + 32 * h + l] >> (2 * j)) & 3;
            v[l] = d * float(sc & 0xF) * float(q) - dmin * float(sc >> 4);
        }
    } else if (KIND == GG_Q3_K) {
        const int h = s / 4, j = s % 4;
        const float d = gg_f16(b + 108);
        const device uint8_t* sb = b + 96;
        for (int l = 0; l < 32; l++) {
            const int k = 8 * h + 2 * j + l / 16;  // the sub-block of 16's 6-bit scale: low 4 bits, high 2
            const int sc = (((sb[k % 8] >> (4 * (k / 8))) & 0xF) | (((sb[8 + k % 4] >> (2 * (k / 4))) & 3) << 4)) - 32;
            const int q = ((b[32 + 32 * h + l] >> (2 * j)) & 3) - (((b[l] >> (4 * h + j)) & 1) ? 0 : 4);
            v[l] = d * float(sc) * float(q);
        }
    } else {  // GG_IQ4_XS
        const int sh = b[2] | (b[3] << 8);
        const int ls = ((b[4 + s / 2] >> (4 * (s % 2))) & 0xF) | (((sh >> (2 * s)) & 3) << 4);
        const float d = gg_f16(b) * float(ls - 32);
        const device uint8_t* qs = b + 8 + 16 * s;
        for (int l = 0; l < 32; l++) v[l] = d * gg_iq4(l < 16 ? (qs[l] & 0xF) : (qs[l - 16] >> 4));
    }
}

//== section: block_dot ==

    // out[b, j] = x[b] . row j of w. Grid (32 * K, B, 1), threadgroup (256, 1, 1): one simdgroup a (j, b); lane l
    // takes the row's sub-blocks of 32 values l, l + 32, ...; simd_sum adds the 32 partial sums.
    const uint K = w_shape[0];
    const uint j = thread_position_in_grid.x / 32;
    const uint b = thread_position_in_grid.y;
    const uint lane = thread_index_in_simdgroup;
    if (j >= K) {
        return;  // only whole simdgroups get here: the grid is 32 * K wide
    }
    const device uint8_t* row = w + size_t(j) * RB;
    float acc = 0.0f;
    float v[32];
    for (int u = lane; u < N / 32; u += 32) {
        gg_values32<KIND>(row + (u / (VALUES / 32)) * BB, u % (VALUES / 32), v);
        for (int l = 0; l < 32; l++) {
            acc += v[l] * static_cast<float>(x[size_t(b) * N + 32 * u + l]);
        }
    }
    acc = simd_sum(acc);
    if (lane == 0) {
        out[size_t(b) * K + j] = static_cast<TO>(acc);
    }
