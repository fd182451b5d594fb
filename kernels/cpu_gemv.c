/* Quantised matrix-vector products on the CPU, straight from the rows where they are stored.

   The CPU counterpart of gather_ffn.metal: MLX's CPU quantized_matmul runs at ~1 G
   elements/s here (0.5 GB/s of 4-bit weights), which makes decode compute-bound on a
   CPU; these loops dequantise and accumulate in float32 with AVX2, or AVX-512 (F, BW, VL,
   VNNI: the same bits), where the CPU has it (runtime checks, scalar loops otherwise) on
   OpenMP threads.

   A quantised matrix is a set of rows r (MLX affine quantisation, values packed LSB first
   in little-endian words, one scale and bias per group of `group_size` values):

       weights  w + w_off + r * w_stride   n * bits / 8 bytes
       scales   s + s_off + r * s_stride   n / group_size values (float16, bfloat16 or float32)
       biases   b + b_off + r * b_stride   likewise;  W_r[i] = scale_g * q_i + bias_g
                                           (symmetric: none stored, bias_g = -2^(bits-1) scale_g)

   so one neuron-cache buffer (w, s and b the same buffer at different offsets) and the
   three arrays of an nn.QuantizedLinear (stride = one row each) are both described.

       row_dot(x[n], ...)   out[j] = sum_i x[i] W_{slots[j]}[i]     (x @ W[slots]^T)
       row_axpy(c[k], ...)  out[i] = sum_j c[j] W_{slots[j]}[i]     (c @ W[slots])

   slots=None means rows 0..k-1. Every row touched is checked against the buffers' sizes.
   Each product also takes m positions at once (x [m, n] -> out [m, k], c [m, k] -> out [m, n]: a
   verification pass, a short prompt): a row's bytes are read from memory once for all m, so m positions
   cost the arithmetic of m and the memory traffic of one.
*/
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <stdint.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#ifdef _OPENMP
#include <omp.h>
#endif

#if defined(__x86_64__) && (defined(__GNUC__) || defined(__clang__)) && !defined(CPU_GEMV_NO_SIMD)
#include <immintrin.h>
#define HAVE_X86 1
#else
#define HAVE_X86 0
#endif

enum { SCALE_F16 = 0, SCALE_BF16 = 1, SCALE_F32 = 2 };

typedef struct {
    const uint8_t *w, *s, *b;
    Py_ssize_t w_stride, s_stride, b_stride;
    const int32_t *slots; /* NULL: rows 0..k-1 */
    const int64_t *ptrs;  /* or row j starts at address ptrs[j] (+ w_off / s_off / b_off): rows in several buffers */
    Py_ssize_t w_off, s_off, b_off;
    Py_ssize_t k;
    int n, bits, gs, stype;
    int sym; /* symmetric (llama.cpp's Q4_0 / Q8_0): no biases stored, bias = -2^(bits-1) scale */
    /* paired (row_dot_pairs): row 2u is unit u's row, row 2u + 1 another matrix's row of the same unit, pair_w /
       pair_s / pair_b bytes further on (a GLU's gate and up rows, read side by side) */
    int paired;
    Py_ssize_t pair_w, pair_s, pair_b;
    /* interleaved (a `linear` handle's, 4-bit, k % 4 == 0, rows of whole 64-byte chunks): the codes of rows 4g..4g+3
       lie together, chunk c of row 4g + t at w_row(4g) + 256 c + 64 t, so the AVX-512 loops read a group as one
       stream (the other loops read a copy in rows: plain_rows) */
    int ilv;
    int gkind; /* a block_linear handle's GGML blocks (bits 0): their kind + 1 (block_dot's); 0: quantised rows */
} Rows;

static inline float f16_to_f32(uint16_t h) {
    uint32_t sign = (uint32_t)(h & 0x8000) << 16, exp = (h >> 10) & 0x1f, man = h & 0x3ff, u;
    if (exp == 0x1f) {
        u = sign | 0x7f800000 | (man << 13); /* inf / nan */
    } else if (exp != 0) {
        u = sign | ((exp + 112) << 23) | (man << 13);
    } else if (man == 0) {
        u = sign;
    } else { /* subnormal: normalise */
        exp = 113;
        while (!(man & 0x400)) {
            man <<= 1;
            exp--;
        }
        u = sign | (exp << 23) | ((man & 0x3ff) << 13);
    }
    float f;
    memcpy(&f, &u, 4);
    return f;
}

static inline float load_scale(const uint8_t *p, int stype, int g) {
    if (stype == SCALE_F32) {
        float f;
        memcpy(&f, p + 4 * g, 4);
        return f;
    }
    uint16_t h;
    memcpy(&h, p + 2 * g, 2);
    if (stype == SCALE_F16) return f16_to_f32(h);
    uint32_t u = (uint32_t)h << 16;
    float f;
    memcpy(&f, &u, 4);
    return f;
}

/* float32 -> float16, rounded to nearest even (numpy's astype and F16C's conversion give the same bits) */
static inline uint16_t f32_to_f16(float f) {
    uint32_t x;
    memcpy(&x, &f, 4);
    const uint32_t sign = (x >> 16) & 0x8000, ax = x & 0x7fffffff;
    if (ax >= 0x7f800000) return (uint16_t)(sign | 0x7c00 | (ax > 0x7f800000 ? 0x200 | ((ax >> 13) & 0x3ff) : 0));
    if (ax >= 0x477ff000) return (uint16_t)(sign | 0x7c00); /* 65520 and above: inf */
    if (ax < 0x38800000) {                                   /* below 2^-14: a subnormal half, or zero */
        if (ax < 0x33000000) return (uint16_t)sign;
        const uint32_t e = ax >> 23, mant = (ax & 0x7fffff) | 0x800000, shift = 126 - e;
        uint32_t h = mant >> shift;
        const uint32_t rem = mant & ((1u << shift) - 1), half = 1u << (shift - 1);
        if (rem > half || (rem == half && (h & 1))) h++;
        return (uint16_t)(sign | h);
    }
    return (uint16_t)(sign | ((ax + 0xfff + ((ax >> 13) & 1) - 0x38000000) >> 13));
}

static inline Py_ssize_t row_of(const Rows *r, Py_ssize_t j) { return r->slots ? r->slots[j] : j; }
/* Row j's bytes of a matrix at offset `off` in each row (and, paired, `pair` more for odd j) */
static inline const uint8_t *row_at(const Rows *r, Py_ssize_t j, const uint8_t *base, Py_ssize_t off,
                                    Py_ssize_t stride, Py_ssize_t pair) {
    Py_ssize_t extra = 0;
    if (r->paired) {
        extra = (j & 1) * pair;
        j >>= 1;
    }
    return (r->ptrs ? (const uint8_t *)(uintptr_t)r->ptrs[j] + off : base + row_of(r, j) * stride) + extra;
}
static inline const uint8_t *w_row(const Rows *r, Py_ssize_t j) { return row_at(r, j, r->w, r->w_off, r->w_stride, r->pair_w); }
static inline const uint8_t *s_row(const Rows *r, Py_ssize_t j) { return row_at(r, j, r->s, r->s_off, r->s_stride, r->pair_s); }
static inline const uint8_t *b_row(const Rows *r, Py_ssize_t j) { return row_at(r, j, r->b, r->b_off, r->b_stride, r->pair_b); }

/* -- one group: sum_i q_i x_i (dot) and out_i += a q_i (axpy), scalar ------------------ */

static float qdot_scalar(const float *x, const uint8_t *w, int gs, int bits) {
    float acc = 0.0f;
    if (bits == 8) {
        for (int i = 0; i < gs; i++) acc += (float)w[i] * x[i];
    } else if (bits == 4) {
        for (int i = 0; i < gs / 2; i++) acc += (float)(w[i] & 15) * x[2 * i] + (float)(w[i] >> 4) * x[2 * i + 1];
    } else { /* 2 */
        for (int i = 0; i < gs / 4; i++)
            for (int t = 0; t < 4; t++) acc += (float)((w[i] >> (2 * t)) & 3) * x[4 * i + t];
    }
    return acc;
}

static void qaxpy_scalar(float *out, const uint8_t *w, float a, int gs, int bits) {
    if (bits == 8) {
        for (int i = 0; i < gs; i++) out[i] += a * (float)w[i];
    } else if (bits == 4) {
        for (int i = 0; i < gs / 2; i++) {
            out[2 * i] += a * (float)(w[i] & 15);
            out[2 * i + 1] += a * (float)(w[i] >> 4);
        }
    } else {
        for (int i = 0; i < gs / 4; i++)
            for (int t = 0; t < 4; t++) out[4 * i + t] += a * (float)((w[i] >> (2 * t)) & 3);
    }
}

/* -- AVX2: 4- and 8-bit groups whose size is a multiple of 32 ------------------------- */

#if HAVE_X86
#define AVX2 __attribute__((target("avx2,fma,f16c")))

AVX2 static void scales_f16c(const uint8_t *p, int groups, float *dst) {
    int g = 0;
    for (; g + 8 <= groups; g += 8) _mm256_storeu_ps(dst + g, _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(p + 2 * g))));
    for (; g < groups; g++) dst[g] = load_scale(p, SCALE_F16, g);
}

AVX2 static void halves_f16c(const float *src, int n, uint16_t *dst) {
    int i = 0;
    for (; i + 8 <= n; i += 8)
        _mm_storeu_si128((__m128i *)(dst + i), _mm256_cvtps_ph(_mm256_loadu_ps(src + i), _MM_FROUND_TO_NEAREST_INT));
    for (; i < n; i++) dst[i] = f32_to_f16(src[i]);
}

/* 32 packed 4-bit values (16 bytes) -> 4 x 8 floats, in element order */
AVX2 static inline void unpack4(const uint8_t *w, __m256 f[4]) {
    const __m128i mask = _mm_set1_epi8(0x0f);
    __m128i v = _mm_loadu_si128((const __m128i *)w);
    __m128i lo = _mm_and_si128(v, mask), hi = _mm_and_si128(_mm_srli_epi16(v, 4), mask);
    __m128i a = _mm_unpacklo_epi8(lo, hi), b = _mm_unpackhi_epi8(lo, hi); /* e0..e15, e16..e31 */
    f[0] = _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(a));
    f[1] = _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_srli_si128(a, 8)));
    f[2] = _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(b));
    f[3] = _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_srli_si128(b, 8)));
}

/* 32 8-bit values -> 4 x 8 floats */
AVX2 static inline void unpack8(const uint8_t *w, __m256 f[4]) {
    for (int t = 0; t < 4; t++)
        f[t] = _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i *)(w + 8 * t))));
}

AVX2 static float hsum(__m256 v) {
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    s = _mm_add_ss(s, _mm_shuffle_ps(s, s, 1));
    return _mm_cvtss_f32(s);
}

AVX2 static float qdot_avx2(const float *x, const uint8_t *w, int gs, int bits) {
    __m256 acc0 = _mm256_setzero_ps(), acc1 = _mm256_setzero_ps(), f[4];
    for (int i = 0; i < gs; i += 32) {
        if (bits == 4)
            unpack4(w + i / 2, f);
        else
            unpack8(w + i, f);
        acc0 = _mm256_fmadd_ps(f[0], _mm256_loadu_ps(x + i), acc0);
        acc1 = _mm256_fmadd_ps(f[1], _mm256_loadu_ps(x + i + 8), acc1);
        acc0 = _mm256_fmadd_ps(f[2], _mm256_loadu_ps(x + i + 16), acc0);
        acc1 = _mm256_fmadd_ps(f[3], _mm256_loadu_ps(x + i + 24), acc1);
    }
    return hsum(_mm256_add_ps(acc0, acc1));
}

/* out[0:gs] += sum_r a[r] q_r for m <= 4 rows: out stays in registers across the rows */
AVX2 static void qaxpy4_avx2(float *out, const uint8_t *const *w, const float *a, int m, int gs, int bits) {
    __m256 f[4];
    if (m > 4) __builtin_unreachable(); /* the rows' loop unrolled: twice as fast as a loop (its loads wait) */
    for (int i = 0; i < gs; i += 32) {
        __m256 acc[4];
        for (int t = 0; t < 4; t++) acc[t] = _mm256_loadu_ps(out + i + 8 * t);
        for (int r = 0; r < m; r++) {
            if (bits == 4)
                unpack4(w[r] + i / 2, f);
            else
                unpack8(w[r] + i, f);
            __m256 va = _mm256_set1_ps(a[r]);
            for (int t = 0; t < 4; t++) acc[t] = _mm256_fmadd_ps(f[t], va, acc[t]);
        }
        for (int t = 0; t < 4; t++) _mm256_storeu_ps(out + i + 8 * t, acc[t]);
    }
}

/* The same for m positions: out[p * stride + 0:len] += sum_r a[p * AXPY_BLOCK + r] q_r, each 32 codes of the
   rows converted once for all positions (per position the operations of qaxpy4_avx2, in its order). a holds 4
   (AXPY_BLOCK) coefficients per position. */
AVX2 static void qaxpy4_multi_avx2(float *out, Py_ssize_t stride, const uint8_t *const *w, const float *a, int nr, int m,
                                   int len, int bits) {
    if (nr > 4) __builtin_unreachable(); /* as in qaxpy4_avx2 */
    for (int i = 0; i < len; i += 32) {
        __m256 f[4][4];
        for (int r = 0; r < nr; r++) {
            if (bits == 4)
                unpack4(w[r] + i / 2, f[r]);
            else
                unpack8(w[r] + i, f[r]);
        }
        for (int p = 0; p < m; p++) {
            float *o = out + p * stride + i;
            __m256 acc[4];
            for (int t = 0; t < 4; t++) acc[t] = _mm256_loadu_ps(o + 8 * t);
            for (int r = 0; r < nr; r++) {
                __m256 va = _mm256_set1_ps(a[p * 4 + r]);
                for (int t = 0; t < 4; t++) acc[t] = _mm256_fmadd_ps(f[r][t], va, acc[t]);
            }
            for (int t = 0; t < 4; t++) _mm256_storeu_ps(o + 8 * t, acc[t]);
        }
    }
}

static int cpu_has_avx2(void) {
    static int cached = -1;
    if (cached < 0) {
        __builtin_cpu_init();
        cached = __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma") && __builtin_cpu_supports("f16c");
    }
    return cached;
}
#else
static int cpu_has_avx2(void) { return 0; }
static float qdot_avx2(const float *x, const uint8_t *w, int gs, int bits) { return qdot_scalar(x, w, gs, bits); }
#endif

/* A row's scales (or biases) as float32; F16C converts 8 halves at once where the CPU has AVX2. */
static void scales_f32(const uint8_t *p, int stype, int groups, float *dst, int fast) {
#if HAVE_X86
    if (fast && stype == SCALE_F16) {
        scales_f16c(p, groups, dst);
        return;
    }
#endif
    (void)fast;
    if (stype == SCALE_F32) {
        memcpy(dst, p, sizeof(float) * (size_t)groups);
        return;
    }
    for (int g = 0; g < groups; g++) dst[g] = load_scale(p, stype, g);
}

/* A row's biases: stored, or (symmetric) -2^(bits-1) times its scales. */
static void biases_f32(const Rows *r, const uint8_t *p, int groups, const float *scale, float *dst, int fast) {
    if (r->sym) {
        const float off = -(float)(1 << (r->bits - 1));
        for (int g = 0; g < groups; g++) dst[g] = off * scale[g];
    } else {
        scales_f32(p, r->stype, groups, dst, fast);
    }
}

static int simd_allowed = 1; /* set_simd(False): the scalar loops, for tests */
static int avx512_allowed = 1; /* set_avx512(False) (MLX_FLASH_AVX512=0): the AVX2 / VNNI loops on an AVX-512 CPU */
static int cpu_has_avx512(void);
static int use_avx512(void) { return simd_allowed && avx512_allowed && cpu_has_avx512(); }

/* n floats as halves, and back (a float16 KV cache) */
static void to_halves(const float *src, int n, uint16_t *dst) {
#if HAVE_X86
    if (simd_allowed && cpu_has_avx2()) {
        halves_f16c(src, n, dst);
        return;
    }
#endif
    for (int i = 0; i < n; i++) dst[i] = f32_to_f16(src[i]);
}

static void from_halves(const uint16_t *src, Py_ssize_t n, float *dst) {
    scales_f32((const uint8_t *)src, SCALE_F16, (int)n, dst, simd_allowed && cpu_has_avx2());
}

static int use_avx2(const Rows *r) { return simd_allowed && cpu_has_avx2() && (r->bits == 4 || r->bits == 8) && r->gs % 32 == 0; }

/* -- the two products ------------------------------------------------------------------ */

/* Rows worth one thread: below this, a second thread costs more than it saves. */
#define MIN_WORK_PER_THREAD (1 << 16)

static int threads_for(const Rows *r, int m) {
#ifdef _OPENMP
    Py_ssize_t work = r->k * (Py_ssize_t)r->n * m, t = work / MIN_WORK_PER_THREAD;
    int max = omp_get_max_threads();
    return t < 1 ? 1 : (t > max ? max : (int)t);
#else
    (void)r;
    (void)m;
    return 1;
#endif
}

#define ROWS_AHEAD_512 8 /* the AVX-512 dot loops (4 rows at a time; 4, 8, 12, 16 tried: 8 best, 1.3x faster than 4) */
#define PREFETCH_AHEAD 4 /* rows; 10-20% faster on 7B-shaped cache rows than none (2, 4, 8 alike; alternated runs, shared machine) */

/* Rows added per pass over `out` by the AVX-512 loops of several positions (AXPY_BLOCK in the others) and of one
   (row_axpy1_avx512): more rows per load and store of the sums, the same sums (each element's FMAs in row order,
   whatever the blocking). */
#define AXPY_MAX 8
#define ROW_PASS 16
#define ROW_AHEAD 256  /* bytes asked for ahead in each row by the one-position axpy loops (128-512 tried: 256 best) */
#define BLOCK_AHEAD 64 /* rows of the next block (or pass) asked for meanwhile, their first ROW_AHEAD bytes */

/* Rows in a neuron cache are a stride apart: the hardware prefetcher loses the stream at each row, so the
   loops ask for a later row's bytes themselves. */
static inline void prefetch_span(const uint8_t *p, Py_ssize_t bytes) {
    const uint8_t *end = p + bytes; /* every line the span touches, the last one too */
    for (p = (const uint8_t *)((uintptr_t)p & ~(uintptr_t)63); p < end; p += 64) __builtin_prefetch(p);
}

static void row_dot_q8(const Rows *r, const float *x, float *out, int m, int path);
static int int8_path(const Rows *r);

/* Row j of a dot product: its codes, with its scales and biases as float32 in scale / bias; the row PREFETCH_AHEAD
   later is asked for meanwhile. */
static const uint8_t *row_start(const Rows *r, Py_ssize_t j, float *scale, float *bias, int fast) {
    const int groups = r->n / r->gs, scale_size = r->stype == SCALE_F32 ? 4 : 2;
    if (j + PREFETCH_AHEAD < r->k) {
        prefetch_span(w_row(r, j + PREFETCH_AHEAD), (Py_ssize_t)r->n * r->bits / 8);
        prefetch_span(s_row(r, j + PREFETCH_AHEAD), (Py_ssize_t)groups * scale_size);
        if (!r->sym) prefetch_span(b_row(r, j + PREFETCH_AHEAD), (Py_ssize_t)groups * scale_size);
    }
    scales_f32(s_row(r, j), r->stype, groups, scale, fast);
    biases_f32(r, b_row(r, j), groups, scale, bias, fast);
    return w_row(r, j);
}

/* Positions computed per sweep over the rows (at most): their activations stay in L1/L2 while a row is hot.
   m positions are split into equal tiles, so 9 are one sweep, not 8 + 1. */
#define POS_TILE 16

/* Positions the int8 row loops compute together (q8dot4_tile, Q8DOT_BODY): a row's codes unpacked and its scales
   loaded once for all of them, each position's arithmetic that of a call of one */
#define DOT_POS 4

static int pos_tile(int m) {
    const int tiles = (m + POS_TILE - 1) / POS_TILE;
    return (m + tiles - 1) / tiles;
}

/* Interleaved rows (Rows.ilv) as *plain: a copy of their codes in rows (*mem: free it), for the loops that read a
   row's bytes in order; other rows as they are (*mem NULL). */
static const Rows *plain_rows(const Rows *r, Rows *plain, uint8_t **mem) {
    *mem = NULL;
    if (!r->ilv) return r;
    const Py_ssize_t row = (Py_ssize_t)r->n * r->bits / 8;
    uint8_t *c = malloc((size_t)(r->k * row));
    for (Py_ssize_t j = 0; j < r->k; j++)
        for (Py_ssize_t at = 0; at < row; at += 64) memcpy(c + j * row + at, w_row(r, j - j % 4) + 4 * at + 64 * (j % 4), 64);
    *plain = *r;
    plain->w = c;
    plain->w_off = 0;
    plain->w_stride = row;
    plain->ilv = 0;
    *mem = c;
    return plain;
}

/* x [m, n] -> out [m, k] */
static void row_dot_impl(const Rows *r, const float *x, float *out, int m) {
    const int path = int8_path(r);
    if (r->ilv && path != 4) {
        Rows plain;
        uint8_t *mem;
        row_dot_impl(plain_rows(r, &plain, &mem), x, out, m);
        free(mem);
        return;
    }
    if (path) {
        row_dot_q8(r, x, out, m, path);
        return;
    }
    const int groups = r->n / r->gs, group_bytes = r->gs * r->bits / 8;
    const int avx = use_avx2(r);
    float *xsum = malloc(sizeof(float) * (size_t)m * (groups > 0 ? groups : 1));
    for (int p = 0; p < m; p++)
        for (int g = 0; g < groups; g++) {
            float s = 0.0f;
            for (int i = 0; i < r->gs; i++) s += x[(Py_ssize_t)p * r->n + g * r->gs + i];
            xsum[p * groups + g] = s;
        }
    for (int p0 = 0, tile = pos_tile(m); p0 < m; p0 += tile) {
        const int p1 = p0 + tile < m ? p0 + tile : m;
#pragma omp parallel for schedule(static) num_threads(threads_for(r, p1 - p0))
        for (Py_ssize_t j = 0; j < r->k; j++) {
            float scale[groups], bias[groups];
            const uint8_t *w = row_start(r, j, scale, bias, avx);
            for (int p = p0; p < p1; p++) {
                const float *xp = x + (Py_ssize_t)p * r->n;
                float acc = 0.0f;
                for (int g = 0; g < groups; g++) {
                    const float *xg = xp + g * r->gs;
                    const uint8_t *wg = w + g * group_bytes;
                    float q = avx ? qdot_avx2(xg, wg, r->gs, r->bits) : qdot_scalar(xg, wg, r->gs, r->bits);
                    acc += scale[g] * q + bias[g] * xsum[p * groups + g];
                }
                out[(Py_ssize_t)p * r->k + j] = acc;
            }
        }
    }
    free(xsum);
}

/* -- int8 activations against 4- and 8-bit codes (llama.cpp's Q8 x Q4 idea) ----------------------
   x is quantised once per call to int8 in blocks of 32 (xq = round(x / dx), dx = max|x| / 127), and each
   block's dot with a row's codes is an integer sum (VNNI's vpdpbusd, or AVX2's pmaddubsw + pmaddwd):

       x . W_r = sum_g s_g sum_{i in g} q_i x_i + b_g sum_{i in g} x_i
              ~= sum_g s_g sum_{b in g} dx_b (q_b . xq_b) + b_g xs_g      (xs_g = sum_{b in g} dx_b sum xq_b)

   The only error is x's rounding (|x_i - dx xq_i| <= dx / 2), as in llama.cpp's quantised matvecs, except
   for a few outliers kept in float (find_outliers): the result is exactly W . x~ for the rounded x~. (xs from x itself would leave the codes' offset times the
   rounding errors uncancelled: q ~ 2^(bits-1) + W / s, and b ~ -2^(bits-1) s.)
   xq's order follows the codes' packing. 8 bits: element order. 4 bits (low nibble = even element):
   blocks in pairs, 64 bytes per pair [even 16 of block 2p, even of 2p+1, odd of 2p, odd of 2p+1], so one
   32-byte load of codes (two blocks) meets its activations in two 32-byte loads; a last unpaired block is
   [even 16, odd 16]. */

#define MAX_OUTLIERS 8 /* elements of x kept in float (LLM.int8()'s decomposition): |x_i| > OUTLIER_RMS rms(x) */
#define OUTLIER_RMS 6.0f

typedef struct {
    int8_t *xq;
    int n_out;                   /* outliers: x[out_idx[t]] = out_val[t], rounded as 0 */
    int out_idx[MAX_OUTLIERS];
    float out_val[MAX_OUTLIERS];
    float *dx; /* per block of 32 */
    float *xs; /* per group: the sum of the rounded x */
    float *dxv; /* 4 bits: each block's dx 4 times (a block pair's 8 int32 lanes, block by block) */
    int8_t *xq4; /* 4 bits, AVX-512: xq with block pairs in twos, [even 32 of both pairs, odd 32 of both] (quad_x) */
} QX;

/* Where block b's even (or, for 8 bits, all) and odd elements sit in xq. */
static inline void block_slots(int b, int blocks, int bits, int *even, int *odd) {
    if (bits == 8) {
        *even = 32 * b;
        *odd = -1;
        return;
    }
    const int base = 64 * (b / 2);
    if (b % 2 == 0 && b + 1 == blocks) { /* unpaired */
        *even = base;
        *odd = base + 16;
    } else {
        *even = base + 16 * (b % 2);
        *odd = base + 32 + 16 * (b % 2);
    }
}

/* The (at most MAX_OUTLIERS) largest |x_i| above OUTLIER_RMS rms(x): a normed layer input has a few channels
   tens of times the others (SmolLM2's last layers: max / mean 30-50), and one in a block of 32 would round
   the other 31 to a handful of levels. */
static int outlier_candidates_avx512(const float *x, int n, int *idx);

static void find_outliers(const float *x, int n, QX *q) {
    int idx[n / 32 + 2]; /* (at most n / OUTLIER_RMS^2 elements are above it) */
    int count = use_avx512() ? outlier_candidates_avx512(x, n, idx) : -1;
    float limit = 0.0f;
    if (count < 0) { /* the float sum itself, in order */
        float ss = 0.0f;
        for (int i = 0; i < n; i++) ss += x[i] * x[i];
        limit = OUTLIER_RMS * sqrtf(ss / (float)n);
    }
    q->n_out = 0;
    for (int c = 0; c < (count < 0 ? n : count); c++) {
        const int i = count < 0 ? c : idx[c];
        const float a = fabsf(x[i]);
        if (count < 0 && !(a > limit)) continue;
        int t = q->n_out < MAX_OUTLIERS ? q->n_out++ : -1;
        if (t < 0) { /* full: replace the smallest if this one is larger */
            t = 0;
            for (int u = 1; u < MAX_OUTLIERS; u++)
                if (fabsf(q->out_val[u]) < fabsf(q->out_val[t])) t = u;
            if (fabsf(q->out_val[t]) >= a) continue;
        }
        q->out_idx[t] = i;
        q->out_val[t] = x[i];
    }
}

static void quantize_blocks_avx512(const float *x, int blocks, int bits, const uint32_t *keep, QX *q, int *sums);

/* x's blocks of 32 rounded to int8 (each block's step dx, the largest |x_i| / 127), the outliers as 0 */
static void quantize_x(const float *x, int n, int gs, int bits, QX *q) {
    const int blocks = n / 32;
    uint32_t keep[blocks]; /* each block's elements other than outliers */
    int sums[blocks];
    for (int g = 0; g < n / gs; g++) q->xs[g] = 0.0f;
    for (int b = 0; b < blocks; b++) keep[b] = ~0u;
    find_outliers(x, n, q);
    for (int t = 0; t < q->n_out; t++) keep[q->out_idx[t] / 32] &= ~(1u << (q->out_idx[t] % 32));
    if (use_avx512()) {
        quantize_blocks_avx512(x, blocks, bits, keep, q, sums);
    } else {
        for (int b = 0; b < blocks; b++) {
            float xb[32], amax = 0.0f;
            for (int i = 0; i < 32; i++) xb[i] = keep[b] >> i & 1 ? x[32 * b + i] : 0.0f;
            for (int i = 0; i < 32; i++) amax = fabsf(xb[i]) > amax ? fabsf(xb[i]) : amax;
            const float d = amax / 127.0f, inv = d > 0.0f ? 1.0f / d : 0.0f;
            int even, odd;
            block_slots(b, blocks, bits, &even, &odd);
            q->dx[b] = d;
            sums[b] = 0;
            for (int i = 0; i < 32; i++) {
                const int8_t v = (int8_t)lrintf(xb[i] * inv);
                sums[b] += v;
                if (bits == 8)
                    q->xq[even + i] = v;
                else
                    q->xq[(i % 2 ? odd : even) + i / 2] = v;
            }
        }
    }
    for (int b = 0; b < blocks; b++) {
        for (int t = 0; t < 4; t++) q->dxv[4 * b + t] = q->dx[b];
        q->xs[32 * b / gs] += q->dx[b] * (float)sums[b];
    }
}

/* One row's integer block dots, the reference for the SIMD loops below. */
static float q8dot_scalar(const uint8_t *w, const QX *q, const float *scale, const float *bias, int n, int gs, int bits) {
    const int blocks = n / 32, per_group = gs / 32;
    float acc = 0.0f;
    for (int b = 0; b < blocks; b++) {
        int even, odd, sum = 0;
        block_slots(b, blocks, bits, &even, &odd);
        if (bits == 8) {
            for (int i = 0; i < 32; i++) sum += (int)w[32 * b + i] * q->xq[even + i];
        } else {
            for (int i = 0; i < 16; i++) sum += (w[16 * b + i] & 15) * q->xq[even + i] + (w[16 * b + i] >> 4) * q->xq[odd + i];
        }
        acc += scale[b / per_group] * q->dx[b] * (float)sum;
    }
    for (int g = 0; g < n / gs; g++) acc += bias[g] * q->xs[g];
    return acc;
}

#if HAVE_X86
/* The 8 int32 lanes of a block pair's (or block's) products; VNNI's vpdpbusd where the CPU has it, else
   pmaddubsw (no saturation: 4-bit codes times |xq| <= 127) then pmaddwd. */
#define VNNI __attribute__((target("avx2,fma,f16c,avxvnni")))

/* x . one row of codes w (scale, bias: its groups' as float32) at NP positions q[0..NP - 1] into out[p], 8-lane float
   accumulators; the row's codes unpacked and its scales loaded once for the NP positions, each position's operations
   and their order the same whatever NP (so a row's result does not depend on the positions beside it) */
#define Q8DOT_BODY(DP, NP)                                                                                     \
    const int blocks = n / 32, per_group = gs / 32;                                                           \
    const __m256i nib = _mm256_set1_epi8(0x0f);                                                               \
    const __m256i pair_idx = _mm256_set_epi32(1, 1, 1, 1, 0, 0, 0, 0);                                        \
    __m256 acc[NP];                                                                                      \
    for (int p = 0; p < NP; p++) acc[p] = _mm256_setzero_ps();                                           \
    int b = 0;                                                                                                \
    if (bits == 4) {                                                                                          \
        for (; b + 1 < blocks; b += 2) { /* two blocks: 32 bytes of codes, 64 of each position's activations */ \
            const __m256i v = _mm256_loadu_si256((const __m256i *)(w + 16 * b));                              \
            const __m256i lo = _mm256_and_si256(v, nib), hi = _mm256_and_si256(_mm256_srli_epi16(v, 4), nib); \
            const __m256 s = per_group == 1                                                                   \
                                 ? _mm256_permutevar8x32_ps(_mm256_castps128_ps256(_mm_castsi128_ps(         \
                                                                _mm_loadl_epi64((const __m128i *)(scale + b)))), \
                                                            pair_idx)                                        \
                                 : _mm256_set1_ps(scale[b / per_group]);                                     \
            for (int p = 0; p < NP; p++) {                                                               \
                const int8_t *xb = q[p].xq + 32 * b;                                                          \
                __m256i d = DP(_mm256_setzero_si256(), lo, _mm256_loadu_si256((const __m256i *)xb));          \
                d = DP(d, hi, _mm256_loadu_si256((const __m256i *)(xb + 32)));                                \
                acc[p] = _mm256_fmadd_ps(_mm256_mul_ps(_mm256_cvtepi32_ps(d), _mm256_loadu_ps(q[p].dxv + 4 * b)), s, acc[p]); \
            }                                                                                                 \
        }                                                                                                     \
        if (b < blocks) { /* the unpaired last block */                                                      \
            const __m128i v = _mm_loadu_si128((const __m128i *)(w + 16 * b));                                 \
            const __m256i c = _mm256_and_si256(_mm256_set_m128i(_mm_srli_epi16(v, 4), v), nib);               \
            for (int p = 0; p < NP; p++) {                                                               \
                const __m256i d = DP(_mm256_setzero_si256(), c, _mm256_loadu_si256((const __m256i *)(q[p].xq + 32 * b))); \
                acc[p] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(d), _mm256_set1_ps(scale[b / per_group] * q[p].dx[b]), acc[p]); \
            }                                                                                                 \
        }                                                                                                     \
    } else {                                                                                                  \
        for (; b < blocks; b++) {                                                                             \
            const __m256i v = _mm256_loadu_si256((const __m256i *)(w + 32 * b));                              \
            for (int p = 0; p < NP; p++) {                                                               \
                const __m256i d = DP(_mm256_setzero_si256(), v, _mm256_loadu_si256((const __m256i *)(q[p].xq + 32 * b))); \
                acc[p] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(d), _mm256_set1_ps(scale[b / per_group] * q[p].dx[b]), acc[p]); \
            }                                                                                                 \
        }                                                                                                     \
    }                                                                                                         \
    const int groups = n / gs;                                                                                \
    for (int p = 0; p < NP; p++) {                                                                       \
        int g = 0;                                                                                            \
        for (; g + 8 <= groups; g += 8)                                                                       \
            acc[p] = _mm256_fmadd_ps(_mm256_loadu_ps(bias + g), _mm256_loadu_ps(q[p].xs + g), acc[p]);        \
        out[p] = q8_finish(acc[p], bias, q[p].xs, g, groups);                                                 \
    }

/* Q8DOT_BODY's end: the lanes summed, then the groups past the last 8. One function for every path's loops (AVX2,
   VNNI, AVX-512): how a compiler vectorises this loop decides its rounding (GCC 12 multiplies 4 groups at once, then
   adds, and fuses the rest), so each inlined copy could round differently. */
AVX2 __attribute__((noinline)) static float q8_finish(__m256 acc, const float *bias, const float *xs, int g, int groups) {
    float r = hsum(acc);
    for (; g < groups; g++) r += bias[g] * xs[g];
    /* GCC leaves vzeroupper out where acc arrives in a ymm register: the legacy SSE code run next (quantize_x, libm,
       the interpreter) then pays for the dirty upper halves, about twice as slow */
    _mm256_zeroupper();
    return r;
}

#define DP_VNNI(acc, u, s) _mm256_dpbusd_avx_epi32(acc, u, s)
#define DP_AVX2(acc, u, s) _mm256_add_epi32(acc, _mm256_madd_epi16(_mm256_maddubs_epi16(u, s), _mm256_set1_epi16(1)))

VNNI static float q8dot_vnni(const uint8_t *w, const QX *q, const float *scale, const float *bias, int n, int gs, int bits) {
    float out[1];
    Q8DOT_BODY(DP_VNNI, 1)
    return out[0];
}

AVX2 static float q8dot_avx2(const uint8_t *w, const QX *q, const float *scale, const float *bias, int n, int gs, int bits) {
    float out[1];
    Q8DOT_BODY(DP_AVX2, 1)
    return out[0];
}

VNNI static void q8dot_tile_vnni(const uint8_t *w, const QX *q, const float *scale, const float *bias, int n, int gs,
                                 int bits, float *out) {
    Q8DOT_BODY(DP_VNNI, DOT_POS)
}

AVX2 static void q8dot_tile_avx2(const uint8_t *w, const QX *q, const float *scale, const float *bias, int n, int gs,
                                 int bits, float *out) {
    Q8DOT_BODY(DP_AVX2, DOT_POS)
}

static int cpu_has_vnni(void) {
    static int cached = -1;
    if (cached < 0) {
        __builtin_cpu_init();
        cached = cpu_has_avx2() && __builtin_cpu_supports("avxvnni");
    }
    return cached;
}

/* -- AVX-512 (F, BW, VL, VNNI): the same sums in 512-bit registers --------------------------------
   Each output is bit for bit the AVX2 / VNNI loops' (tests/test_cpu_gemv.py compares them): integer block dots
   are exact whatever the width, and every float operation is the one those loops do, on the same lane, in the same
   order (where they multiply and add apart, so do these, with the _round forms a compiler cannot fuse).
   - row_dot, int8 activations: 4-bit codes four blocks per load (the activations laid out in quads, q->xq4), their
     int32 sums then meet the 8-lane float accumulator of Q8DOT_BODY pair by pair; four rows at a time, since one
     row's accumulator is a chain of dependent FMAs (latency-bound alone; the rows' chains overlap).
   - row_axpy / block_axpy: each output element's FMAs over the rows in order, whatever the blocking; one position's
     sums stay in registers over many rows (a whole block of block_axpy's), 128 columns at a time.
   - the rows, a stride apart in a neuron cache, are asked for ahead a line at a time as the loops go (the hardware
     prefetcher restarts at every row): at 2 threads the 7B's FFN rows then stream from DRAM at 30-33 GB/s, against
     17-25 for the AVX2 loops (benchmarks/bench_avx512.py). */
#define AVX512 __attribute__((target("avx2,fma,f16c,avx512f,avx512bw,avx512vl,avx512vnni")))

static int cpu_has_avx512(void) {
    static int cached = -1;
    if (cached < 0) {
        __builtin_cpu_init();
        cached = cpu_has_avx2() && __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
                 __builtin_cpu_supports("avx512vl") && __builtin_cpu_supports("avx512vnni");
    }
    return cached;
}

/* find_outliers' elements above its limit, in order, into idx (how many; -1: undecided). The limit's float sum of
   squares in order is within (n + 2) 2^-24 of the sum (relative: the terms are positive), which a double sum gives
   to far better: where no |x_i| lies within that of the limit, the elements above it are those above the band. */
AVX512 static int outlier_candidates_avx512(const float *x, int n, int *idx) {
    __m512d acc = _mm512_setzero_pd();
    int i = 0;
    for (; i + 8 <= n; i += 8) {
        const __m512d v = _mm512_cvtps_pd(_mm256_loadu_ps(x + i));
        acc = _mm512_fmadd_pd(v, v, acc);
    }
    double ss = _mm512_reduce_add_pd(acc);
    for (; i < n; i++) ss += (double)x[i] * x[i];
    if (!(ss > 1e-20 && ss < 1e30)) return -1; /* (no overflow, underflow or NaN in either sum) */
    const double limit = OUTLIER_RMS * sqrt(ss / n), band = (n + 16) * 0x1p-24;
    const __m512 lo = _mm512_set1_ps(nextafterf((float)(limit * (1 - band)), 0.0f));
    const __m512 hi = _mm512_set1_ps(nextafterf((float)(limit * (1 + band)), INFINITY));
    int count = 0;
    for (i = 0; i < n; i += 16) {
        const __mmask16 in = n - i >= 16 ? 0xffff : (__mmask16)((1u << (n - i)) - 1);
        const __m512 a = _mm512_abs_ps(_mm512_maskz_loadu_ps(in, x + i));
        const __mmask16 above = _mm512_cmp_ps_mask(a, hi, _CMP_GT_OQ);
        if (_mm512_cmp_ps_mask(a, lo, _CMP_GT_OQ) & ~above) return -1;
        for (unsigned m = above; m; m &= m - 1) {
            if (count > n / 32) return -1;
            idx[count++] = i + __builtin_ctz(m);
        }
    }
    return count;
}

/* quantize_x's loop over the blocks: the same steps, roundings and bytes (a NaN's value 0, as lrintf's, cast) */
AVX512 static void quantize_blocks_avx512(const float *x, int blocks, int bits, const uint32_t *keep, QX *q, int *sums) {
    const __m128i split = _mm_setr_epi8(0, 2, 4, 6, 8, 10, 12, 14, 1, 3, 5, 7, 9, 11, 13, 15);
    for (int b = 0; b < blocks; b++) {
        const __m512 xa = _mm512_maskz_loadu_ps((__mmask16)keep[b], x + 32 * b);
        const __m512 xb = _mm512_maskz_loadu_ps((__mmask16)(keep[b] >> 16), x + 32 * b + 16);
        const __m512 fa = _mm512_abs_ps(xa), fb = _mm512_abs_ps(xb); /* NaNs left out of the largest, as by > */
        const __m512 m = _mm512_max_ps(_mm512_maskz_mov_ps(_mm512_cmp_ps_mask(fa, fa, _CMP_ORD_Q), fa),
                                       _mm512_maskz_mov_ps(_mm512_cmp_ps_mask(fb, fb, _CMP_ORD_Q), fb));
        const float d = _mm512_reduce_max_ps(m) / 127.0f;
        const __m512 inv = _mm512_set1_ps(d > 0.0f ? 1.0f / d : 0.0f);
        const __m128i va = _mm512_cvtepi32_epi8(_mm512_cvtps_epi32(_mm512_mul_ps(xa, inv)));
        const __m128i vb = _mm512_cvtepi32_epi8(_mm512_cvtps_epi32(_mm512_mul_ps(xb, inv)));
        q->dx[b] = d;
        sums[b] = _mm512_reduce_add_epi32(_mm512_add_epi32(_mm512_cvtepi8_epi32(va), _mm512_cvtepi8_epi32(vb)));
        int even, odd;
        block_slots(b, blocks, bits, &even, &odd);
        if (bits == 8) {
            _mm_storeu_si128((__m128i *)(q->xq + even), va);
            _mm_storeu_si128((__m128i *)(q->xq + even + 16), vb);
        } else {
            const __m128i sa = _mm_shuffle_epi8(va, split), sb = _mm_shuffle_epi8(vb, split);
            _mm_storeu_si128((__m128i *)(q->xq + even), _mm_unpacklo_epi64(sa, sb));
            _mm_storeu_si128((__m128i *)(q->xq + odd), _mm_unpackhi_epi64(sa, sb));
        }
    }
}

AVX512 static inline __m256 hi256(__m512 v) { return _mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(v), 1)); }

/* stored scales from group g as float32 (the conversions scales_f32 makes): 4, 1 or 8 of them */
AVX512 static inline __m128 scales4_avx512(const uint8_t *p, int stype, int g) {
    if (stype == SCALE_F32) return _mm_loadu_ps((const float *)p + g);
    const __m128i h = _mm_loadl_epi64((const __m128i *)(p + 2 * g));
    if (stype == SCALE_F16) return _mm_cvtph_ps(h);
    return _mm_castsi128_ps(_mm_slli_epi32(_mm_cvtepu16_epi32(h), 16));
}

AVX512 static inline float scale1_avx512(const uint8_t *p, int stype, int g) {
    if (stype != SCALE_F16) return load_scale(p, stype, g);
    uint16_t h;
    memcpy(&h, p + 2 * g, 2);
    return _mm_cvtss_f32(_mm_cvtph_ps(_mm_cvtsi32_si128(h)));
}

AVX512 static inline __m256 scales8_avx512(const uint8_t *p, int stype, int g) {
    if (stype == SCALE_F32) return _mm256_loadu_ps((const float *)p + g);
    const __m128i h = _mm_loadu_si128((const __m128i *)(p + 2 * g));
    if (stype == SCALE_F16) return _mm256_cvtph_ps(h);
    return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16));
}

/* Q8DOT_BODY (VNNI) of 4 rows at np positions at once: out[p][t] = row t's result at position q[p], its scales and
   biases read as stored (s[t], b[t]; sym: none stored, as biases_f32 derives them). Each row's codes are unpacked
   and its scales loaded once for the np positions; every (row, position)'s operations are those of np = 1, in the
   same order, so a row's result is the same however many positions share the call. pf: 4 later rows' codes, asked
   for a line at a time meanwhile (spread over the loop: a row's lines asked for at once stall the loop, and memory
   idles while it computes). Inlined with a constant np (q8dot4x1/x4), so the accumulators stay in registers. */
AVX512 static inline __attribute__((always_inline)) void q8dot4_tile(const uint8_t *const *w, const QX *q, int np,
                                                                    const uint8_t *const *s, const uint8_t *const *bs,
                                                                    int stype, int sym, int n, int gs, int bits,
                                                                    const uint8_t *const *pf, int chunk,
                                                                    float (*out)[4]) {
    const int blocks = n / 32, per_group = gs / 32;
    const float off = -(float)(1 << (bits - 1));
    __m256 acc[DOT_POS][4];
    for (int p = 0; p < np; p++)
        for (int t = 0; t < 4; t++) acc[p][t] = _mm256_setzero_ps();
    int b = 0;
    if (bits == 4) {
        const __m512i nib = _mm512_set1_epi8(0x0f);
        const __m256i pair_lo = _mm256_set_epi32(1, 1, 1, 1, 0, 0, 0, 0), pair_hi = _mm256_set_epi32(3, 3, 3, 3, 2, 2, 2, 2);
        for (; b + 3 < blocks; b += 4) { /* two pairs: 64 bytes of codes, 128 of activations */
#pragma GCC unroll 4
            for (int t = 0; t < 4; t++) { /* (unrolled, both loops: the accumulators stay in registers) */
                const Py_ssize_t at = (Py_ssize_t)(b / 4) * chunk; /* (rows: 16 b) */
                _mm_prefetch((const char *)(pf[t] + at), _MM_HINT_T0);
                const __m512i v = _mm512_loadu_si512(w[t] + at);
                const __m512i lo = _mm512_and_si512(v, nib), hi = _mm512_and_si512(_mm512_srli_epi16(v, 4), nib);
                __m256 s0, s1;
                if (per_group == 1) {
                    const __m256 s4 = _mm256_castps128_ps256(scales4_avx512(s[t], stype, b));
                    s0 = _mm256_permutevar8x32_ps(s4, pair_lo);
                    s1 = _mm256_permutevar8x32_ps(s4, pair_hi);
                } else {
                    s0 = _mm256_set1_ps(scale1_avx512(s[t], stype, b / per_group));
                    s1 = _mm256_set1_ps(scale1_avx512(s[t], stype, (b + 2) / per_group));
                }
#pragma GCC unroll 4
                for (int p = 0; p < np; p++) {
                    const __m512i xe = _mm512_loadu_si512(q[p].xq4 + 32 * b), xo = _mm512_loadu_si512(q[p].xq4 + 32 * b + 64);
                    const __m512i d8 = _mm512_dpbusd_epi32(_mm512_dpbusd_epi32(_mm512_setzero_si512(), lo, xe), hi, xo);
                    /* lanes 0-7: pair b, 8-15: pair b + 2 */
                    const __m512 f = _mm512_mul_ps(_mm512_cvtepi32_ps(d8), _mm512_loadu_ps(q[p].dxv + 4 * b));
                    acc[p][t] = _mm256_fmadd_ps(_mm512_castps512_ps256(f), s0, acc[p][t]);
                    acc[p][t] = _mm256_fmadd_ps(hi256(f), s1, acc[p][t]);
                }
            }
        }
        const __m256i nib8 = _mm256_set1_epi8(0x0f);
        if (b + 1 < blocks) { /* a last pair, as Q8DOT_BODY (the quad layout keeps it as it was) */
            for (int t = 0; t < 4; t++) {
                const __m256i v = _mm256_loadu_si256((const __m256i *)(w[t] + 16 * b));
                const __m256i lo = _mm256_and_si256(v, nib8), hi = _mm256_and_si256(_mm256_srli_epi16(v, 4), nib8);
                const float s_b = scale1_avx512(s[t], stype, b / per_group);
                const __m256 sv = per_group == 1 ? _mm256_set_m128(_mm_set1_ps(scale1_avx512(s[t], stype, b + 1)), _mm_set1_ps(s_b))
                                                 : _mm256_set1_ps(s_b);
                for (int p = 0; p < np; p++) {
                    const __m256i xe = _mm256_loadu_si256((const __m256i *)(q[p].xq4 + 32 * b));
                    const __m256i xo = _mm256_loadu_si256((const __m256i *)(q[p].xq4 + 32 * b + 32));
                    const __m256i d8 = _mm256_dpbusd_epi32(_mm256_dpbusd_epi32(_mm256_setzero_si256(), lo, xe), hi, xo);
                    const __m256 d = _mm256_loadu_ps(q[p].dxv + 4 * b);
                    acc[p][t] = _mm256_fmadd_ps(_mm256_mul_ps(_mm256_cvtepi32_ps(d8), d), sv, acc[p][t]);
                }
            }
            b += 2;
        }
        if (b < blocks) { /* the unpaired last block */
            for (int t = 0; t < 4; t++) {
                const __m128i v = _mm_loadu_si128((const __m128i *)(w[t] + 16 * b));
                const __m256i c = _mm256_and_si256(_mm256_set_m128i(_mm_srli_epi16(v, 4), v), nib8);
                const float sc = scale1_avx512(s[t], stype, b / per_group);
                for (int p = 0; p < np; p++) {
                    const __m256i x = _mm256_loadu_si256((const __m256i *)(q[p].xq4 + 32 * b));
                    const __m256i d8 = _mm256_dpbusd_epi32(_mm256_setzero_si256(), c, x);
                    acc[p][t] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(d8), _mm256_set1_ps(sc * q[p].dx[b]), acc[p][t]);
                }
            }
        }
    } else {
        for (; b + 1 < blocks; b += 2) { /* two blocks a load */
#pragma GCC unroll 4
            for (int t = 0; t < 4; t++) {
                _mm_prefetch((const char *)(pf[t] + 32 * b), _MM_HINT_T0);
                const __m512i v = _mm512_loadu_si512(w[t] + 32 * b);
                const float sc0 = scale1_avx512(s[t], stype, b / per_group);
                const float sc1 = scale1_avx512(s[t], stype, (b + 1) / per_group);
#pragma GCC unroll 4
                for (int p = 0; p < np; p++) {
                    const __m512i d8 = _mm512_dpbusd_epi32(_mm512_setzero_si512(), v, _mm512_loadu_si512(q[p].xq + 32 * b));
                    const __m512 f = _mm512_cvtepi32_ps(d8);
                    acc[p][t] = _mm256_fmadd_ps(_mm512_castps512_ps256(f), _mm256_set1_ps(sc0 * q[p].dx[b]), acc[p][t]);
                    acc[p][t] = _mm256_fmadd_ps(hi256(f), _mm256_set1_ps(sc1 * q[p].dx[b + 1]), acc[p][t]);
                }
            }
        }
        if (b < blocks) {
            for (int t = 0; t < 4; t++) {
                const __m256i v = _mm256_loadu_si256((const __m256i *)(w[t] + 32 * b));
                const float sc = scale1_avx512(s[t], stype, b / per_group);
                for (int p = 0; p < np; p++) {
                    const __m256i d8 = _mm256_dpbusd_epi32(_mm256_setzero_si256(), v, _mm256_loadu_si256((const __m256i *)(q[p].xq + 32 * b)));
                    acc[p][t] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(d8), _mm256_set1_ps(sc * q[p].dx[b]), acc[p][t]);
                }
            }
        }
    }
    const int groups = n / gs, whole = groups / 8 * 8;
    for (int t = 0; t < 4; t++) { /* the biases, as Q8DOT_BODY */
        float rest[8]; /* the groups past the last 8's biases, for q8_finish */
        for (int g = whole; g < groups; g++)
            rest[g - whole] = sym ? off * scale1_avx512(s[t], stype, g) : scale1_avx512(bs[t], stype, g);
        for (int g = 0; g < whole; g += 8) {
            const __m256 bias = sym ? _mm256_mul_ps(_mm256_set1_ps(off), scales8_avx512(s[t], stype, g))
                                    : scales8_avx512(bs[t], stype, g);
            for (int p = 0; p < np; p++) acc[p][t] = _mm256_fmadd_ps(bias, _mm256_loadu_ps(q[p].xs + g), acc[p][t]);
        }
        for (int p = 0; p < np; p++) out[p][t] = q8_finish(acc[p][t], rest, q[p].xs + whole, 0, groups - whole);
    }
}

AVX512 static void q8dot4x1(const uint8_t *const *w, const QX *q, const uint8_t *const *s, const uint8_t *const *bs,
                            int stype, int sym, int n, int gs, int bits, const uint8_t *const *pf, int chunk,
                            float (*out)[4]) {
    q8dot4_tile(w, q, 1, s, bs, stype, sym, n, gs, bits, pf, chunk, out);
}

AVX512 static void q8dot4x4(const uint8_t *const *w, const QX *q, const uint8_t *const *s, const uint8_t *const *bs,
                            int stype, int sym, int n, int gs, int bits, const uint8_t *const *pf, int chunk,
                            float (*out)[4]) {
    q8dot4_tile(w, q, DOT_POS, s, bs, stype, sym, n, gs, bits, pf, chunk, out);
}

/* row_axpy's loops: out[i] += a_r q_r[i], row after row, each element's FMAs those of qaxpy4_avx2 in its order.
   32 4-bit codes widen (one byte a lane) to their even and odd elements, so the accumulators are de-interleaved
   to match (two permutes each way per 32 columns and block of rows, instead of shuffles per row); 8-bit codes are in
   element order. */
AVX512 static inline void codes32_avx512(const uint8_t *w, int bits, __m512 *e, __m512 *o) {
    if (bits == 4) { /* a code's float from a table of 0..15 (vpermps reads the index's low 4 bits: no mask) */
        const __m512 values = _mm512_set_ps(15, 14, 13, 12, 11, 10, 9, 8, 7, 6, 5, 4, 3, 2, 1, 0);
        const __m512i c = _mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i *)w));
        *e = _mm512_permutexvar_ps(c, values);
        *o = _mm512_permutexvar_ps(_mm512_srli_epi32(c, 4), values);
    } else {
        *e = _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i *)w)));
        *o = _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i *)(w + 16))));
    }
}

/* out[0:32] as codes32_avx512's two halves meet it */
AVX512 static inline void load32_avx512(const float *out, int bits, __m512 *e, __m512 *o) {
    const __m512 a = _mm512_loadu_ps(out), b = _mm512_loadu_ps(out + 16);
    if (bits == 4) {
        *e = _mm512_permutex2var_ps(a, _mm512_set_epi32(30, 28, 26, 24, 22, 20, 18, 16, 14, 12, 10, 8, 6, 4, 2, 0), b);
        *o = _mm512_permutex2var_ps(a, _mm512_set_epi32(31, 29, 27, 25, 23, 21, 19, 17, 15, 13, 11, 9, 7, 5, 3, 1), b);
    } else {
        *e = a;
        *o = b;
    }
}

/* 4 bits: the even and odd elements of 32 columns back in element order */
AVX512 static inline void interleave_avx512(__m512 *e, __m512 *o) {
    const __m512 lo = _mm512_permutex2var_ps(*e, _mm512_set_epi32(23, 7, 22, 6, 21, 5, 20, 4, 19, 3, 18, 2, 17, 1, 16, 0), *o);
    *o = _mm512_permutex2var_ps(*e, _mm512_set_epi32(31, 15, 30, 14, 29, 13, 28, 12, 27, 11, 26, 10, 25, 9, 24, 8), *o);
    *e = lo;
}

AVX512 static inline void store32_avx512(float *out, int bits, __m512 e, __m512 o) {
    if (bits == 4) {
        interleave_avx512(&e, &o);
        _mm512_storeu_ps(out, e);
        _mm512_storeu_ps(out + 16, o);
    } else {
        _mm512_storeu_ps(out, e);
        _mm512_storeu_ps(out + 16, o);
    }
}

/* qaxpy4_multi_avx2 in 512 bits: out[p * stride + 0:len] += sum_r a[p * as + r] q_r for m positions and nr <=
   AXPY_MAX rows, each 32 codes converted once for all positions */
AVX512 static void qaxpy_multi_avx512(float *out, Py_ssize_t stride, const uint8_t *const *w, const float *a, int as,
                                      int nr, int m, int len, int bits) {
    for (int i = 0; i < len; i += 32) {
        __m512 ce[AXPY_MAX], co[AXPY_MAX];
        for (int r = 0; r < nr; r++) codes32_avx512(w[r] + i * bits / 8, bits, &ce[r], &co[r]);
        for (int p = 0; p < m; p++) {
            __m512 e, o;
            load32_avx512(out + p * stride + i, bits, &e, &o);
            for (int r = 0; r < nr; r++) {
                const __m512 v = _mm512_set1_ps(a[p * as + r]);
                e = _mm512_fmadd_ps(ce[r], v, e);
                o = _mm512_fmadd_ps(co[r], v, o);
            }
            store32_avx512(out + p * stride + i, bits, e, o);
        }
    }
}

/* 16 scales (or biases) from i as floats, converted as scales_f32 does (F16C's conversion, bf16's shift) */
AVX512 static inline __m512 scales16_avx512(const uint8_t *p, int stype, int i) {
    if (stype == SCALE_F32) return _mm512_loadu_ps((const float *)p + i);
    const __m256i h = _mm256_loadu_si256((const __m256i *)(p + 2 * i));
    if (stype == SCALE_F16) return _mm512_cvtph_ps(h);
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
}

/* o[i] += s[i] acc[i] + b[i] csum as block_axpy_impl's scalar loop rounds it: two products, then two sums, none
   fused (the _round forms are builtins a compiler does not contract into FMAs, as it may plain vector products) */
#define RN (_MM_FROUND_CUR_DIRECTION)
AVX512 static inline void block_end16_avx512(float *o, __m512 acc, __m512 s, __m512 b, __m512 csum) {
    const __m512 t = _mm512_add_round_ps(_mm512_mul_round_ps(s, acc, RN), _mm512_mul_round_ps(b, csum, RN), RN);
    _mm512_storeu_ps(o, _mm512_add_round_ps(_mm512_loadu_ps(o), t, RN));
}

/* block_axpy1_avx512's columns [i, i + 32 q): q = 4 in its main loop, 8 independent chains of FMAs to hide their
   latency (the 2 of 32 columns alone run at half the speed) */
AVX512 static inline __attribute__((always_inline)) void block_cols_avx512(float *o, const uint8_t *const *w,
                                                                           const float *a, int nr, const uint8_t *S,
                                                                           const uint8_t *B, int stype, int sym,
                                                                           __m512 voff, __m512 vc, int i, int q, int bits) {
    const int at = i * bits / 8;
    __m512 acc[8], c[8];
    for (int t = 0; t < 2 * q; t++) acc[t] = _mm512_setzero_ps();
    for (int u = 0; u < nr; u++) {
        const __m512 v = _mm512_set1_ps(a[u]);
        /* a few lines ahead in each row: the rows are read side by side, one short stream each, which the hardware
           prefetcher does not follow in time (2x faster on the 7B's down projection) */
        for (int l = 0; l < q * 4 * bits; l += 64) _mm_prefetch((const char *)(w[u] + at + ROW_AHEAD + l), _MM_HINT_T0);
        for (int h = 0; h < q; h++) codes32_avx512(w[u] + at + h * 4 * bits, bits, &c[2 * h], &c[2 * h + 1]);
        for (int t = 0; t < 2 * q; t++) acc[t] = _mm512_fmadd_ps(c[t], v, acc[t]);
    }
    for (int h = 0; bits == 4 && h < q; h++) interleave_avx512(&acc[2 * h], &acc[2 * h + 1]);
    for (int t = 0; t < 2 * q; t++) {
        const __m512 s = scales16_avx512(S, stype, i + 16 * t);
        const __m512 b = sym ? _mm512_mul_round_ps(voff, s, RN) : scales16_avx512(B, stype, i + 16 * t);
        block_end16_avx512(o + i + 16 * t, acc[t], s, b, vc);
    }
}

/* block_axpy of one position over the nr rows of one block, their codes w[r] (at the thread's first column), S and B
   the block's scales and biases there (sym: b = off s): o[i] += s_i sum_r a[r] q_r[i] + b_i csum for i < len. The
   sums stay in registers across all the rows (no scratch row, no pass over it), in the other loops' order (from 0,
   row by row). */
AVX512 static void block_axpy1_avx512(float *o, const uint8_t *const *w, const float *a, int nr, const uint8_t *S,
                                      const uint8_t *B, int stype, int sym, float off, float csum, int len, int bits) {
    const __m512 vc = _mm512_set1_ps(csum), voff = _mm512_set1_ps(off);
    int i = 0;
    for (; i + 128 <= len; i += 128) block_cols_avx512(o, w, a, nr, S, B, stype, sym, voff, vc, i, 4, bits);
    for (; i < len; i += 32) block_cols_avx512(o, w, a, nr, S, B, stype, sym, voff, vc, i, 1, bits);
}

/* q8_outlier's loop in 512 bits: the same products and sums, none fused */
AVX512 static void q8_outlier_avx512(float *o, const uint8_t *w, float c, const uint8_t *S, const uint8_t *B, int stype,
                                     int sym, float off, int len) {
    const __m512 vc = _mm512_set1_ps(c), voff = _mm512_set1_ps(off);
    for (int i = 0; i < len; i += 32) {
        __m512 q[2];
        codes32_avx512(w + i / 2, 4, &q[0], &q[1]);
        interleave_avx512(&q[0], &q[1]);
        for (int h = 0; h < 2; h++) {
            const __m512 s = scales16_avx512(S, stype, i + 16 * h);
            const __m512 b = sym ? _mm512_mul_round_ps(voff, s, RN) : scales16_avx512(B, stype, i + 16 * h);
            const __m512 wv = _mm512_add_round_ps(_mm512_mul_round_ps(s, q[h], RN), b, RN);
            _mm512_storeu_ps(o + i + 16 * h,
                             _mm512_add_round_ps(_mm512_loadu_ps(o + i + 16 * h), _mm512_mul_round_ps(vc, wv, RN), RN));
        }
    }
}

/* block_q8's 128 columns from four rows' dword quads: E_t / O_t hold the even / odd elements of bytes 16 L + 4 t + d
   (128-bit lane L, dword d), so P_t = unpacklo32(E_t, O_t) holds elements 32 L + 8 t + 0..3 and Q_t the next 4; the
   16 elements from 16 v are lane L = v / 2 of P_2h, Q_2h, P_2h+1, Q_2h+1 (h = v % 2). */
#define Q8_LANES(P0, P1, Q0, Q1, imm)                                                                                    \
    _mm512_mask_blend_epi32(0xF0F0, _mm512_shuffle_i32x4(P0, P1, imm), _mm512_shuffle_i32x4(Q0, Q1, imm))

/* block_q8 (4 bits) over the thread's columns [0, len): the integer sums of nr rows (a multiple of 4) four at a time,
   each row's 4-bit codes against its int8 coefficient (vpdpbusd), then per column o += s (d dot) + b cs as
   block_q8_scalar rounds it. */
AVX512 static void block_q8_avx512(float *o, const uint8_t *const *w, const int8_t *qa, int nr, const uint8_t *S,
                                   const uint8_t *B, int stype, int sym, float off, float d, float cs, int len,
                                   const uint8_t *const *pf, int npf) {
    const __m512i low = _mm512_set1_epi8(15);
    const __m512 vd = _mm512_set1_ps(d), vcs = _mm512_set1_ps(cs), voff = _mm512_set1_ps(off);
    for (int i = 0; i < len; i += 128) {
        const int cols = len - i < 128 ? len - i : 128;
        const __mmask64 mask = cols == 128 ? ~0ULL : (1ULL << (cols / 2)) - 1;
        __m512i e[4], od[4];
        for (int t = 0; t < 4; t++) e[t] = od[t] = _mm512_setzero_si512();
        /* the next group's rows, at these columns: a group's compute ahead of their use (rows a stride apart are
           short streams the hardware prefetcher does not follow, and further on in this row is another thread's) */
        for (int t = 0; t < npf; t++) _mm_prefetch((const char *)(pf[t] + i / 2), _MM_HINT_T0);
        for (int u = 0; u < nr; u += 4) {
            __m512i r4[4];
            for (int v = 0; v < 4; v++) r4[v] = _mm512_maskz_loadu_epi8(mask, w[u + v] + i / 2);
            int32_t quad;
            memcpy(&quad, qa + u, 4);
            const __m512i c = _mm512_set1_epi32(quad);
            const __m512i ab_lo = _mm512_unpacklo_epi8(r4[0], r4[1]), ab_hi = _mm512_unpackhi_epi8(r4[0], r4[1]);
            const __m512i cd_lo = _mm512_unpacklo_epi8(r4[2], r4[3]), cd_hi = _mm512_unpackhi_epi8(r4[2], r4[3]);
            const __m512i q[4] = {_mm512_unpacklo_epi16(ab_lo, cd_lo), _mm512_unpackhi_epi16(ab_lo, cd_lo),
                                  _mm512_unpacklo_epi16(ab_hi, cd_hi), _mm512_unpackhi_epi16(ab_hi, cd_hi)};
            for (int t = 0; t < 4; t++) {
                e[t] = _mm512_dpbusd_epi32(e[t], _mm512_and_si512(q[t], low), c);
                od[t] = _mm512_dpbusd_epi32(od[t], _mm512_and_si512(_mm512_srli_epi16(q[t], 4), low), c);
            }
        }
        __m512i P[4], Q[4];
        for (int t = 0; t < 4; t++) {
            P[t] = _mm512_unpacklo_epi32(e[t], od[t]);
            Q[t] = _mm512_unpackhi_epi32(e[t], od[t]);
        }
        const __m512i dots[8] = {Q8_LANES(P[0], P[1], Q[0], Q[1], 0x00), Q8_LANES(P[2], P[3], Q[2], Q[3], 0x00),
                                 Q8_LANES(P[0], P[1], Q[0], Q[1], 0x55), Q8_LANES(P[2], P[3], Q[2], Q[3], 0x55),
                                 Q8_LANES(P[0], P[1], Q[0], Q[1], 0xAA), Q8_LANES(P[2], P[3], Q[2], Q[3], 0xAA),
                                 Q8_LANES(P[0], P[1], Q[0], Q[1], 0xFF), Q8_LANES(P[2], P[3], Q[2], Q[3], 0xFF)};
        for (int v = 0; v < cols / 16; v++) {
            const __m512 sc = scales16_avx512(S, stype, i + 16 * v);
            const __m512 b = sym ? _mm512_mul_round_ps(voff, sc, RN) : scales16_avx512(B, stype, i + 16 * v);
            block_end16_avx512(o + i + 16 * v, _mm512_mul_round_ps(vd, _mm512_cvtepi32_ps(dots[v]), RN), sc, b, vcs);
        }
    }
}


/* row_axpy of one position, AVX-512: one row's coefficients over the thread's G groups from g0, a[g] = scale_g c and
   bias_sum[g] += c bias_g, the scalar loops' products and sums (not fused) */
AVX512 static void row_coeffs_avx512(const Rows *r, Py_ssize_t j, int g0, int G, float c, float *a, float *bias_sum) {
    const int scale_size = r->stype == SCALE_F32 ? 4 : 2;
    const uint8_t *s = s_row(r, j) + (Py_ssize_t)g0 * scale_size, *b = b_row(r, j) + (Py_ssize_t)g0 * scale_size;
    const __m512 vc = _mm512_set1_ps(c), off = _mm512_set1_ps(-(float)(1 << (r->bits - 1)));
    for (int g = 0; g < G; g += 16) {
        const __mmask16 k = G - g >= 16 ? 0xffff : (__mmask16)((1u << (G - g)) - 1);
        __m512 sc, bi;
        if (r->stype == SCALE_F32) {
            sc = _mm512_maskz_loadu_ps(k, (const float *)s + g);
            bi = r->sym ? _mm512_mul_round_ps(off, sc, RN) : _mm512_maskz_loadu_ps(k, (const float *)b + g);
        } else {
            const __m256i hs = _mm256_maskz_loadu_epi16(k, (const __m256i *)(s + 2 * g));
            const __m256i hb = r->sym ? hs : _mm256_maskz_loadu_epi16(k, (const __m256i *)(b + 2 * g));
            sc = r->stype == SCALE_F16 ? _mm512_cvtph_ps(hs) : _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(hs), 16));
            bi = r->sym ? _mm512_mul_round_ps(off, sc, RN)
                        : r->stype == SCALE_F16 ? _mm512_cvtph_ps(hb)
                                                : _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(hb), 16));
        }
        _mm512_mask_storeu_ps(a + g, k, _mm512_mul_round_ps(sc, vc, RN));
        const __m512 t = _mm512_mul_round_ps(vc, bi, RN);
        _mm512_mask_storeu_ps(bias_sum + g, k, _mm512_add_round_ps(_mm512_maskz_loadu_ps(k, bias_sum + g), t, RN));
    }
}

/* row_axpy's columns [i, i + 32 q) of one position over nr rows (a[u * G + group]: row u's coefficient there): o
   loaded once, then each row's FMAs, in row order; q = 4 for 8 independent chains (as block_cols_avx512) */
AVX512 static inline __attribute__((always_inline)) void row_cols_avx512(float *o, const uint8_t *const *w,
                                                                         const float *a, int G, int nr, int i, int q,
                                                                         int gs, int bits) {
    const int at = i * bits / 8;
    __m512 acc[8], c[8];
    int grp[4];
    for (int h = 0; h < q; h++) {
        load32_avx512(o + i + 32 * h, bits, &acc[2 * h], &acc[2 * h + 1]);
        grp[h] = (i + 32 * h) / gs;
    }
    for (int u = 0; u < nr; u++) {
        for (int l = 0; l < q * 4 * bits; l += 64) _mm_prefetch((const char *)(w[u] + at + ROW_AHEAD + l), _MM_HINT_T0);
        for (int h = 0; h < q; h++) {
            const __m512 v = _mm512_set1_ps(a[u * G + grp[h]]);
            codes32_avx512(w[u] + at + h * 4 * bits, bits, &c[2 * h], &c[2 * h + 1]);
            acc[2 * h] = _mm512_fmadd_ps(c[2 * h], v, acc[2 * h]);
            acc[2 * h + 1] = _mm512_fmadd_ps(c[2 * h + 1], v, acc[2 * h + 1]);
        }
    }
    for (int h = 0; h < q; h++) store32_avx512(o + i + 32 * h, bits, acc[2 * h], acc[2 * h + 1]);
}

/* o[0:len] += sum_u a[u][group] q_u over nr rows (their codes w[u] at the thread's first column) */
AVX512 static void row_axpy1_avx512(float *o, const uint8_t *const *w, const float *a, int G, int nr, int len, int gs,
                                    int bits) {
    int i = 0;
    for (; i + 128 <= len; i += 128) row_cols_avx512(o, w, a, G, nr, i, 4, gs, bits);
    for (; i < len; i += 32) row_cols_avx512(o, w, a, G, nr, i, 1, gs, bits);
}
#else
static int cpu_has_vnni(void) { return 0; }
static int cpu_has_avx512(void) { return 0; }
static int outlier_candidates_avx512(const float *x, int n, int *idx) {
    (void)x, (void)n, (void)idx;
    return -1;
}
static void quantize_blocks_avx512(const float *x, int blocks, int bits, const uint32_t *keep, QX *q, int *sums) {
    (void)x, (void)blocks, (void)bits, (void)keep, (void)q, (void)sums;
}
#endif

static int int8_allowed = 1; /* set_int8(False): float activations, for references */

/* 0: float activations; 1: scalar int8 loops; 2: AVX2; 3: VNNI; 4: AVX-512 VNNI. 8-bit codes need VNNI
   (pmaddubsw would saturate) or the scalar loops. */
static int int8_path(const Rows *r) {
    if (!int8_allowed || (r->bits != 4 && r->bits != 8) || r->gs % 32) return 0;
    if (!simd_allowed) return 1;
    if (use_avx512()) return 4;
    if (cpu_has_vnni()) return 3;
    return r->bits == 4 && cpu_has_avx2() ? 2 : 0;
}

/* Whether 4-bit rows take int8 activations on this CPU (info()'s "int8"): the loops above are x86's (AVX2, VNNI,
   AVX-512; the scalar ones run only under set_simd(False)); elsewhere (ARM) activations stay float. */
static int int8_runs(void) {
    const Rows r = {.bits = 4, .gs = 32};
    return int8_path(&r) != 0;
}

/* xq (4 bits) for 512-bit loads: each two block pairs' halves regrouped, [even 32 of pair 0, even 32 of pair 1, odd
   32 of pair 0, odd 32 of pair 1]; a last pair or block as it was. */
static void quad_x(const int8_t *xq, int n, int8_t *xq4) {
    const int blocks = n / 32;
    int b = 0;
    for (; b + 3 < blocks; b += 4) {
        const int8_t *s = xq + 32 * b;
        int8_t *d = xq4 + 32 * b;
        memcpy(d, s, 32);
        memcpy(d + 32, s + 64, 32);
        memcpy(d + 64, s + 32, 32);
        memcpy(d + 96, s + 96, 32);
    }
    memcpy(xq4 + 32 * b, xq + 32 * b, (size_t)(n - 32 * b));
}

/* acc plus the outliers of position q, in float (w: the row's codes, its 64-byte chunks `chunk` bytes apart; s, b:
   its scales and biases as stored) */
static inline float add_outliers(const Rows *r, const uint8_t *w, const uint8_t *s, const uint8_t *b, const QX *q,
                                 float acc, int chunk) {
    for (int t = 0; t < q->n_out; t++) {
        const int i = q->out_idx[t], g = i / r->gs, byte = i * r->bits / 8;
        const uint8_t c = w[byte / 64 * chunk + byte % 64];
        const int code = r->bits == 8 ? c : (c >> (4 * (i % 2))) & 15;
        const float scale = load_scale(s, r->stype, g);
        const float bias = r->sym ? -(float)(1 << (r->bits - 1)) * scale : load_scale(b, r->stype, g);
        acc += (scale * (float)code + bias) * q->out_val[t];
    }
    return acc;
}

/* n bytes at a 64-byte boundary (free() releases them). posix_memalign takes any size, where C11's aligned_alloc
   wants a multiple of the alignment (macOS returns NULL otherwise); the loops cannot hand an error back, so a
   failed allocation ends the process with a message rather than writing through NULL. */
static void *alloc64(size_t n) {
    void *p = NULL;
    if (posix_memalign(&p, 64, n ? n : 64) != 0 || p == NULL) {
        fprintf(stderr, "cpu_gemv: out of memory (%zu bytes)\n", n);
        abort();
    }
    return p;
}

/* m positions of x [m, r->n] quantised for r's loops (path: int8_path): q[p] over one allocation, *mem (free it) */
static QX *quantize_rows(const Rows *r, const float *x, int m, int path, void **mem) {
    const int groups = r->n / r->gs, quads = path == 4 && r->bits == 4;
    const size_t n = (size_t)r->n, xq_bytes = (m * n * (quads ? 2 : 1) + 63) / 64 * 64;
    int8_t *xq = alloc64(xq_bytes + sizeof(float) * m * (n / 32 + groups + n / 8) + sizeof(QX) * m);
    float *f = (float *)(xq + xq_bytes);
    QX *q = (QX *)(f + m * (n / 32 + groups + n / 8));
    for (int p = 0; p < m; p++) {
        q[p] = (QX){.xq = xq + p * n, .dx = f + p * (n / 32), .xs = f + m * (n / 32) + (size_t)p * groups,
                    .dxv = f + m * (n / 32 + groups) + p * (n / 8), .xq4 = quads ? xq + (m + p) * n : NULL};
        quantize_x(x + p * n, r->n, r->gs, r->bits, &q[p]);
        if (quads) quad_x(q[p].xq, r->n, q[p].xq4);
    }
    *mem = xq;
    return q;
}

#if HAVE_X86
/* Rows j0 .. j0 + nr - 1 (nr <= 4) of r at positions p0..p1 - 1 into out [m, r->k] (AVX-512 loops, path 4), rows
   ROWS_AHEAD_512 later asked for meanwhile */
static void dot4_rows(const Rows *r, Py_ssize_t j0, int nr, const QX *q, int p0, int p1, float *out) {
    const int scale_bytes = r->n / r->gs * (r->stype == SCALE_F32 ? 4 : 2);
    float res[DOT_POS][4];
    const uint8_t *w[4], *pf[4], *s[4], *b[4];
    for (int t = 0; t < 4; t++) { /* past the last row: row j0 again, its result unused */
        const Py_ssize_t j = j0 + (t < nr ? t : 0);
        w[t] = w_row(r, j);
        s[t] = s_row(r, j);
        b[t] = b_row(r, j);
        pf[t] = j0 + t + ROWS_AHEAD_512 < r->k ? w_row(r, j0 + t + ROWS_AHEAD_512) : w[t];
        if (r->ilv) { /* (whole groups) */
            w[t] = w_row(r, j0) + 64 * t;
            pf[t] = j0 + 4 + ROWS_AHEAD_512 <= r->k ? w_row(r, j0 + ROWS_AHEAD_512) + 64 * t : w[t];
        }
        if (t < nr && j0 + t + ROWS_AHEAD_512 < r->k) { /* (their codes: pf, in the loop) */
            prefetch_span(s_row(r, j0 + t + ROWS_AHEAD_512), scale_bytes);
            if (!r->sym) prefetch_span(b_row(r, j0 + t + ROWS_AHEAD_512), scale_bytes);
        }
    }
    const int chunk = r->ilv ? 256 : 64;
    for (int p = p0; p < p1;) {
        const int np = p1 - p >= DOT_POS ? DOT_POS : 1;
        if (np == DOT_POS)
            q8dot4x4(w, &q[p], s, b, r->stype, r->sym, r->n, r->gs, r->bits, pf, chunk, res);
        else
            q8dot4x1(w, &q[p], s, b, r->stype, r->sym, r->n, r->gs, r->bits, pf, chunk, res);
        for (int i = 0; i < np; i++, p++)
            for (int t = 0; t < nr; t++)
                out[(Py_ssize_t)p * r->k + j0 + t] = add_outliers(r, w[t], s[t], b[t], &q[p], res[i][t], chunk);
    }
}
#endif

/* outs[i] [m, rs[i]->k] = x [m, n] against the rows of each of nmat matrices of one n, group size and bits (a
   block's q, k and v): each position quantised once, then POS_TILE positions per sweep over all their rows, in one
   parallel loop; each row's arithmetic that of a call on its matrix alone */
static void row_dot_q8_multi(const Rows *const *rs, int nmat, const float *x, float *const *outs, int m, int path) {
    for (int i = 0; i < nmat && path != 4; i++)
        if (rs[i]->ilv) { /* each matrix alone (the same arithmetic), interleaved ones from a copy in rows */
            for (int j = 0; j < nmat; j++) row_dot_impl(rs[j], x, outs[j], m);
            return;
        }
    const Rows *r = rs[0];
    const int groups = r->n / r->gs;
    Py_ssize_t first[nmat + 1], work = 0; /* the matrices' first 4-row group (AVX-512) or row in the joint loop */
    first[0] = 0;
    for (int i = 0; i < nmat; i++) {
        first[i + 1] = first[i] + (path == 4 ? (rs[i]->k + 3) / 4 : rs[i]->k);
        work += rs[i]->k;
    }
    const Rows all = {.k = work, .n = r->n}; /* (the threads' share of the work) */
    void *mem;
    const QX *q = quantize_rows(r, x, m, path, &mem);
    for (int p0 = 0, tile = pos_tile(m); p0 < m; p0 += tile) {
        const int p1 = p0 + tile < m ? p0 + tile : m;
#if HAVE_X86
        if (path == 4) { /* four rows at a time */
#pragma omp parallel for schedule(static) num_threads(threads_for(&all, p1 - p0))
            for (Py_ssize_t u = 0; u < first[nmat]; u++) {
                int i = 0;
                while (u >= first[i + 1]) i++;
                const Py_ssize_t j0 = 4 * (u - first[i]);
                dot4_rows(rs[i], j0, rs[i]->k - j0 < 4 ? (int)(rs[i]->k - j0) : 4, q, p0, p1, outs[i]);
            }
            continue;
        }
#endif
#pragma omp parallel for schedule(static) num_threads(threads_for(&all, p1 - p0))
        for (Py_ssize_t u = 0; u < first[nmat]; u++) {
            int i = 0;
            while (u >= first[i + 1]) i++;
            const Rows *ri = rs[i];
            const Py_ssize_t j = u - first[i];
            float scale[groups], bias[groups];
            const uint8_t *w = row_start(ri, j, scale, bias, path > 1);
            int p = p0;
#if HAVE_X86
            for (; (path == 2 || path == 3) && p + DOT_POS <= p1; p += DOT_POS) {
                float res[DOT_POS];
                if (path == 3)
                    q8dot_tile_vnni(w, &q[p], scale, bias, ri->n, ri->gs, ri->bits, res);
                else
                    q8dot_tile_avx2(w, &q[p], scale, bias, ri->n, ri->gs, ri->bits, res);
                for (int t = 0; t < DOT_POS; t++)
                    outs[i][(Py_ssize_t)(p + t) * ri->k + j] =
                        add_outliers(ri, w, s_row(ri, j), b_row(ri, j), &q[p + t], res[t], 64);
            }
#endif
            for (; p < p1; p++) {
                const QX *qp = &q[p];
                float acc;
#if HAVE_X86
                if (path == 3)
                    acc = q8dot_vnni(w, qp, scale, bias, ri->n, ri->gs, ri->bits);
                else if (path == 2)
                    acc = q8dot_avx2(w, qp, scale, bias, ri->n, ri->gs, ri->bits);
                else
#endif
                    acc = q8dot_scalar(w, qp, scale, bias, ri->n, ri->gs, ri->bits);
                outs[i][(Py_ssize_t)p * ri->k + j] = add_outliers(ri, w, s_row(ri, j), b_row(ri, j), qp, acc, 64);
            }
        }
    }
    free(mem);
}

static void row_dot_q8(const Rows *r, const float *x, float *out, int m, int path) {
    row_dot_q8_multi(&r, 1, x, &out, m, path);
}

/* Rows processed together by row_axpy: each pass over `out` adds AXPY_BLOCK rows, so out is
   loaded and stored once per block instead of once per row. */
#define AXPY_BLOCK 4

/* row_axpy's loops: 0 scalar, 1 AVX2 (AXPY_BLOCK rows a pass), 2 AVX-512 (AXPY_MAX rows) */
static int axpy_path(const Rows *r) { return use_avx2(r) ? 1 + use_avx512() : 0; }

static void axpy_block(float *out, const uint8_t *const *w, const float *a, int m, int gs, int bits, int path) {
#if HAVE_X86
    if (path) { /* (1: path 2 takes qaxpy_multi_avx512, or its own loops for one position) */
        qaxpy4_avx2(out, w, a, m, gs, bits);
        return;
    }
#endif
    (void)path;
    for (int r = 0; r < m; r++) qaxpy_scalar(out, w[r], a[r], gs, bits);
}

/* axpy_block for m positions: out[p * stride ...] += sum_r a[p * as + r] q_r (as: AXPY_BLOCK, or AXPY_MAX on
   path 2); the codes converted once */
static inline void axpy_block_multi(float *out, Py_ssize_t stride, const uint8_t *const *w, const float *a, int as,
                                    int nr, int m, int gs, int bits, int path) {
    if (m == 1 && path < 2) { /* a decode step: qaxpy4_avx2 keeps its rows' codes in registers (same arithmetic);
                                 inlined, as this runs once per group of every 4 rows */
        axpy_block(out, w, a, nr, gs, bits, path);
        return;
    }
#if HAVE_X86
    if (path == 2) {
        qaxpy_multi_avx512(out, stride, w, a, as, nr, m, gs, bits);
        return;
    }
    if (path) {
        qaxpy4_multi_avx2(out, stride, w, a, nr, m, gs, bits);
        return;
    }
#endif
    for (int p = 0; p < m; p++) axpy_block(out + p * stride, w, a + p * as, nr, gs, bits, path);
}

/* This OpenMP thread's share [lo, hi) of `units` (inside a parallel region). */
static void thread_share(Py_ssize_t units, Py_ssize_t *lo, Py_ssize_t *hi) {
    int t = 0, T = 1;
#ifdef _OPENMP
    t = omp_get_thread_num();
    T = omp_get_num_threads();
#endif
    *lo = units * t / T;
    *hi = units * (t + 1) / T;
}

/* out[r][c0, c1) = 0 for rows r < rows of n floats: a thread zeroes its own columns of a call's output (the last
   thread's up to n), so the pages of a fresh buffer are first touched (and zeroed by the kernel) by every thread at
   once, not one alone */
static void zero_columns(float *out, Py_ssize_t rows, Py_ssize_t n, Py_ssize_t c0, Py_ssize_t c1) {
    for (Py_ssize_t r = 0; c1 > c0 && r < rows; r++) memset(out + r * n + c0, 0, sizeof(float) * (size_t)(c1 - c0));
}

/* Whether row j's coefficient is non-zero at any of m positions (c [m, k]): zero rows are skipped. */
static int any_nonzero(const float *c, Py_ssize_t k, Py_ssize_t j, int m) {
    for (int p = 0; p < m; p++)
        if (c[p * k + j] != 0.0f) return 1;
    return 0;
}

/* c [m, k] -> out [m, n]; with dst (rows of equal dst contiguous): row j adds into out[dst[j]] ([n_out, m, n]),
   each out row the sum of its rows alone, whichever other rows the call holds */
static void row_axpy_dst(const Rows *r, const float *c, float *out, int m, const int32_t *dst, int n_out) {
    const int groups = r->n / r->gs, group_bytes = r->gs * r->bits / 8;
    const int path = axpy_path(r), avx = path > 0, nt = threads_for(r, m), scale_size = r->stype == SCALE_F32 ? 4 : 2;
    const int rows_a_pass = path == 2 ? AXPY_MAX : AXPY_BLOCK;
    const int one = path == 2 && m == 1; /* row_axpy1_avx512: ROW_PASS rows a pass, their coefficients [row][group] */
    (void)nt; /* unused without OpenMP */
    /* each thread owns a contiguous range of groups (columns) and walks every row over it */
#pragma omp parallel num_threads(nt)
    {
        Py_ssize_t lo, hi;
        thread_share(groups, &lo, &hi);
        const int g0 = (int)lo, g1 = (int)hi;
        zero_columns(out, (Py_ssize_t)m * n_out, r->n, (Py_ssize_t)g0 * r->gs, g1 == groups ? r->n : (Py_ssize_t)g1 * r->gs);
        const int G = g1 > g0 ? g1 - g0 : 1;
        /* per position: sum_j c_j bias_jg, added once per column at the end; a block's scales and biases */
        float *bias_sum = malloc(sizeof(float) * (size_t)m * G), *sc = malloc(sizeof(float) * 2 * rows_a_pass * G);
        float *bias = sc + rows_a_pass * G, *a = malloc(sizeof(float) * (one ? ROW_PASS : rows_a_pass) * (size_t)m * G);
        const uint8_t *w[ROW_PASS];
        Py_ssize_t jr[AXPY_MAX];
        Py_ssize_t j = 0;
        while (j < r->k) {
            const int d = dst ? dst[j] : 0;
            float *o = out + (size_t)d * m * r->n;
            Py_ssize_t end = j;
            while (end < r->k && (dst ? dst[end] : 0) == d) end++;
            memset(bias_sum, 0, sizeof(float) * (size_t)m * G);
#if HAVE_X86
            while (one && j < end) { /* the next ROW_PASS non-zero rows over the thread's columns */
                int nr = 0;
                for (; j < end && nr < ROW_PASS; j++) {
                    if (c[j] == 0.0f) continue;
                    w[nr] = w_row(r, j) + (Py_ssize_t)g0 * group_bytes;
                    row_coeffs_avx512(r, j, g0, g1 - g0, c[j], a + (size_t)nr * G, bias_sum);
                    nr++;
                }
                for (Py_ssize_t t = j; t < end && t < j + ROW_PASS; t++) { /* the next pass's first lines, and scales */
                    prefetch_span(w_row(r, t) + (Py_ssize_t)g0 * group_bytes, ROW_AHEAD);
                    prefetch_span(s_row(r, t) + (Py_ssize_t)g0 * scale_size, (Py_ssize_t)(g1 - g0) * scale_size);
                    if (!r->sym)
                        prefetch_span(b_row(r, t) + (Py_ssize_t)g0 * scale_size, (Py_ssize_t)(g1 - g0) * scale_size);
                }
                if (nr) row_axpy1_avx512(o + g0 * r->gs, w, a, G, nr, (g1 - g0) * r->gs, r->gs, r->bits);
            }
#endif
            while (j < end) {
                int nr = 0; /* gather the next non-zero rows: their weights, scales and biases */
                for (; j < end && nr < rows_a_pass; j++) {
                    if (!any_nonzero(c, r->k, j, m)) continue;
                    w[nr] = w_row(r, j);
                    scales_f32(s_row(r, j) + (Py_ssize_t)g0 * scale_size, r->stype, g1 - g0, sc + nr * G, avx);
                    biases_f32(r, b_row(r, j) + (Py_ssize_t)g0 * scale_size, g1 - g0, sc + nr * G, bias + nr * G, avx);
                    jr[nr++] = j;
                }
                /* c_j * scale, group-major ([group][position][row]): each group's coefficients are contiguous */
                const int per_group = rows_a_pass * m;
                for (int p = 0; p < m; p++)
                    for (int q = 0; q < nr; q++) {
                        const float cj = c[p * r->k + jr[q]];
                        for (int g = 0; g < g1 - g0; g++) {
                            a[(size_t)g * per_group + p * rows_a_pass + q] = sc[q * G + g] * cj;
                            bias_sum[p * G + g] += cj * bias[q * G + g];
                        }
                    }
                for (int g = g0; g < g1; g++) {
                    const uint8_t *wg[AXPY_MAX];
                    for (int q = 0; q < nr; q++) wg[q] = w[q] + g * group_bytes;
                    axpy_block_multi(o + g * r->gs, r->n, wg, a + (size_t)(g - g0) * per_group, rows_a_pass, nr, m, r->gs,
                                     r->bits, path);
                }
            }
            for (int p = 0; p < m; p++)
                for (int g = g0; g < g1; g++)
                    for (int i = 0; i < r->gs; i++) o[(Py_ssize_t)p * r->n + g * r->gs + i] += bias_sum[p * G + g - g0];
        }
        free(bias_sum);
        free(sc);
        free(a);
    }
}

/* -- columns with block scales (convert --down-bits source) -----------------------------------
   A matrix quantised along its input dimension (down_proj: each group spans `gs` neurons) and
   stored per neuron keeps the source's codes: row j holds q_j[0..n) packed like the rows above,
   without scales; the groups' scales and biases are two tables S, B [n_blocks, n]:

       W_j[i] = S[blk_j][i] q_j[i] + B[blk_j][i]

   block_axpy(c[k], ...)  out[i] = sum_j c[j] W_{slots[j]}[i]
   sums c_j q_j over each run of rows with the same block (sorted neurons: one run per block),
   then scales the run's sum once: S and B are read once per block, not once per row. */
/* -- block_axpy with int8 coefficients (4-bit codes): a group's rows share each column's scale, so, as llama.cpp
   quantises a down projection's input per block of 32, each position's coefficients of a group are rounded to int8
   (cq = round(c / d), d = max|c| / 127) and the group's sum per column is an integer one:

       sum_r c_r W_r[i] ~= s_i d (sum_r cq_r q_r[i]) + b_i cs      (cs = d sum_r cq_r)

   exactly the product with the rounded c, whatever the order. 0: float coefficients; 1: the scalar loop, the
   reference; 2: AVX-512 VNNI. AVX2-only CPUs keep float coefficients (their tokens may differ from these). */
static int q8_block_path(const Rows *r) {
    if (!int8_allowed || r->bits != 4) return 0;
    if (!simd_allowed) return 1;
    return use_avx512() ? 2 : 0;
}

/* block_q8 of one position and group over columns [0, len): s, b the group's scales and biases there (float) */
static void block_q8_scalar(float *o, const uint8_t *const *w, const int8_t *qa, int nr, const float *s,
                            const float *b, float d, float cs, int len, int32_t *dot) {
    memset(dot, 0, sizeof(int32_t) * (size_t)len);
    for (int u = 0; u < nr; u++)
        for (int i = 0; i < len; i++) dot[i] += qa[u] * ((w[u][i / 2] >> (4 * (i % 2))) & 15);
    for (int i = 0; i < len; i++) o[i] += s[i] * (d * (float)dot[i]) + b[i] * cs;
}

#define Q8_OUTLIER 4.0f /* a group's largest coefficient stays in float when it is this many times the next one */

/* Position p's coefficients c of rows [j, j1) (one group), rounded: their rows at `span` and int8 values, zeros left
   out, padded with zeros to a multiple of 4; returns how many, with d, the sum of the int8 values and the row of the
   group's outlier (-1: none), a coefficient Q8_OUTLIER times the group's next largest, which would round the others
   to a few levels (a GLU's few huge units) and is added in float instead (q8_outlier). */
static int q8_coeffs(const Rows *r, const float *c, Py_ssize_t j, Py_ssize_t j1, Py_ssize_t span, const uint8_t **qw,
                     int8_t *qa, float *d, int *sum, Py_ssize_t *outlier) {
    float a1 = 0.0f, a2 = 0.0f;
    Py_ssize_t top = -1;
    for (Py_ssize_t t = j; t < j1; t++) {
        const float a = fabsf(c[t]);
        if (a > a1) {
            a2 = a1;
            a1 = a;
            top = t;
        } else if (a > a2) {
            a2 = a;
        }
    }
    *outlier = a1 > Q8_OUTLIER * a2 ? top : -1;
    *d = (*outlier >= 0 ? a2 : a1) / 127.0f;
    const float inv = *d > 0.0f ? 1.0f / *d : 0.0f;
    int nr = 0;
    *sum = 0;
    for (Py_ssize_t t = j; t < j1; t++) {
        const int8_t v = t == *outlier ? 0 : (int8_t)lrintf(c[t] * inv);
        if (!v) continue;
        qw[nr] = w_row(r, t) + span;
        qa[nr++] = v;
        *sum += v;
    }
    if (!nr) return 0;
    while (nr % 4) {
        qw[nr] = qw[0];
        qa[nr++] = 0;
    }
    return nr;
}

/* o[i] += c (s_i q[i] + b_i) over columns [0, len): a group's outlier row in float (the reference loop) */
static void q8_outlier(float *o, const uint8_t *w, float c, const Rows *r, const uint8_t *S, const uint8_t *B,
                       float off, int len) {
    for (int i = 0; i < len; i++) {
        const float s = load_scale(S, r->stype, i), b = r->sym ? off * s : load_scale(B, r->stype, i);
        o[i] += c * (s * (float)((w[i / 2] >> (4 * (i % 2))) & 15) + b);
    }
}

/* block_axpy_impl's group of rows from j (those of block blk[j]) over columns [i0, i0 + len) with int8 coefficients
   (q8: 1 scalar, 2 AVX-512), each position into its output; s, b: len floats of scratch, wb, qa, dot, pf: a
   thread's (block_axpy_impl's) buffers. Returns the group's end. */
static Py_ssize_t q8_group(const Rows *r, const float *c, float *out, const int32_t *dst, const int32_t *blk,
                           const uint8_t *S, const uint8_t *B, float *s, float *b, int m, Py_ssize_t j, int i0, int len,
                           const uint8_t **wb, int8_t *qa, int32_t *dot, const uint8_t **pf, int q8) {
    const int32_t g = blk[j];
    const int scale_size = r->stype == SCALE_F32 ? 4 : 2;
    const Py_ssize_t table_row = (Py_ssize_t)r->n * scale_size, n = r->n;
    float *o = out + (dst ? (size_t)dst[j] * m * n : 0);
    const Py_ssize_t span = (Py_ssize_t)i0 * r->bits / 8;
    const float off = -(float)(1 << (r->bits - 1));
    const uint8_t *Sg = S + g * table_row + (Py_ssize_t)i0 * scale_size;
    const uint8_t *Bg = B + g * table_row + (Py_ssize_t)i0 * scale_size;
    Py_ssize_t j1 = j, j2;
    while (j1 < r->k && blk[j1] == g) j1++;
    for (j2 = j1; j2 < r->k && blk[j2] == blk[j1] && j2 - j1 < BLOCK_AHEAD; j2++)
        pf[j2 - j1] = w_row(r, j2) + span; /* the next group's rows */
    if (q8 == 1) {
        scales_f32(Sg, r->stype, len, s, 0);
        biases_f32(r, Bg, len, s, b, 0);
    }
    for (int p = 0; p < m; p++) {
        const float *cp = c + (size_t)p * r->k;
        float d, *op = o + p * n + i0;
        int sum;
        Py_ssize_t outlier;
        const int nr = q8_coeffs(r, cp, j, j1, span, wb, qa, &d, &sum, &outlier);
        const float cs = d * (float)sum;
#if HAVE_X86
        if (nr && q8 == 2)
            block_q8_avx512(op, wb, qa, nr, Sg, Bg, r->stype, r->sym, off, d, cs, len, pf, p ? 0 : (int)(j2 - j1));
#endif
        if (nr && q8 == 1) block_q8_scalar(op, wb, qa, nr, s, b, d, cs, len, dot);
        if (outlier < 0) continue;
#if HAVE_X86
        if (q8 == 2) {
            q8_outlier_avx512(op, w_row(r, outlier) + span, cp[outlier], Sg, Bg, r->stype, r->sym, off, len);
            continue;
        }
#endif
        q8_outlier(op, w_row(r, outlier) + span, cp[outlier], r, Sg, Bg, off, len);
    }
    return j1;
}

/* block_axpy_impl's fold over a thread's columns: total += part (the first partial sum copied: sum_rows' order and
   rounding), then part zeroed for the next */
static void fold_part(float *total, float *part, int m, Py_ssize_t n, int i0, int len, int first) {
    for (int p = 0; p < m; p++) {
        float *t = total + p * n + i0, *s = part + p * n + i0;
        if (first)
            memcpy(t, s, sizeof(float) * (size_t)len);
        else
            for (int i = 0; i < len; i++) t[i] += s[i];
        memset(s, 0, sizeof(float) * (size_t)len);
    }
}

/* c [m, k] -> out [m, n]; scratch: (m + 2) * n floats (each thread's sums per position, scales and biases
   over its columns) and m more (the sums of c) per thread. total (else NULL): the n_out partial sums (dst) folded
   into total [m, n] in their order as each ends, as sum_rows adds them, out [m, n] holding the one in progress: a
   pass of many positions holds one partial sum, not n_out. */
static void block_axpy_impl(const Rows *r, const float *c, float *out, const int32_t *blk, const uint8_t *S,
                            const uint8_t *B, float *scratch, int m, const int32_t *dst, int n_out, float *total) {
    const int path = axpy_path(r), avx = path > 0, nt = threads_for(r, m), scale_size = r->stype == SCALE_F32 ? 4 : 2;
    const int rows_a_pass = path == 2 ? AXPY_MAX : AXPY_BLOCK;
    const Py_ssize_t chunks = r->n / 32, table_row = (Py_ssize_t)r->n * scale_size, n = r->n;
    const int q8 = q8_block_path(r), fold = total != NULL;
    const int32_t *into = fold ? NULL : dst; /* (the partial sum each row adds into: out's one, folding) */
    (void)nt;
#pragma omp parallel num_threads(nt)
    {
        Py_ssize_t lo, hi;
        thread_share(chunks, &lo, &hi);
        const int i0 = (int)(32 * lo), len = (int)(32 * (hi - lo));
        zero_columns(out, (Py_ssize_t)m * (fold ? 1 : n_out), n, i0, hi == chunks ? n : i0 + len);
        if (len > 0) {
            float *acc = scratch + i0, *s = scratch + m * n + i0, *b = scratch + (m + 1) * n + i0;
            float *csum = malloc(sizeof(float) * (size_t)m), *a = malloc(sizeof(float) * rows_a_pass * (size_t)m);
            /* one position on the AVX-512 path: a block's rows at once (block_axpy1_avx512) */
            const int one = path == 2 && m == 1;
            const uint8_t **wb = one || q8 ? malloc(sizeof(*wb) * (size_t)(r->k + 3)) : NULL;
            float *ab = one ? malloc(sizeof(float) * (size_t)r->k) : NULL;
            int8_t *qa = q8 ? malloc((size_t)r->k + 3) : NULL;
            int32_t *dot = q8 == 1 ? malloc(sizeof(int32_t) * (size_t)len) : NULL;
            const uint8_t **pf = q8 ? malloc(sizeof(*pf) * BLOCK_AHEAD) : NULL;
            Py_ssize_t j = 0;
            int next = 0; /* fold: the partial sums folded so far (out holds the next: zeros where no row adds) */
            while (j < r->k) {
                const int32_t g = blk[j];
                while (fold && next < (dst ? dst[j] : 0)) fold_part(total, out, m, n, i0, len, next++ == 0);
                float *o = out + (into ? (size_t)into[j] * m * n : 0);
                int any = 0;
                if (q8) { /* the group's rows for each position, with int8 coefficients */
                    j = q8_group(r, c, out, into, blk, S, B, s, b, m, j, i0, len, wb, qa, dot, pf, q8);
                    continue;
                }
#if HAVE_X86
                if (one) {
                    const Py_ssize_t span = (Py_ssize_t)i0 * r->bits / 8, span_bytes = (Py_ssize_t)len * r->bits / 8;
                    int nr = 0;
                    float cs = 0.0f;
                    for (; j < r->k && blk[j] == g; j++) {
                        if (c[j] == 0.0f) continue;
                        wb[nr] = w_row(r, j) + span;
                        ab[nr] = c[j];
                        cs += ab[nr++];
                    }
                    /* the next block's rows, read while this one computes (its rows are a stride apart: one short
                       stream each, which the hardware prefetcher does not follow in time) */
                    for (Py_ssize_t t = j; t < r->k && blk[t] == blk[j] && t < j + BLOCK_AHEAD; t++)
                        prefetch_span(w_row(r, t) + span, span_bytes < ROW_AHEAD ? span_bytes : ROW_AHEAD);
                    if (nr)
                        block_axpy1_avx512(o + i0, wb, ab, nr, S + g * table_row + (Py_ssize_t)i0 * scale_size,
                                           B + g * table_row + (Py_ssize_t)i0 * scale_size, r->stype, r->sym,
                                           -(float)(1 << (r->bits - 1)), cs, len, r->bits);
                    continue;
                }
#endif
                for (int p = 0; p < m; p++) {
                    csum[p] = 0.0f;
                    memset(acc + p * n, 0, sizeof(float) * (size_t)len);
                }
                while (j < r->k && blk[j] == g) {
                    const uint8_t *w[AXPY_MAX];
                    Py_ssize_t jr[AXPY_MAX];
                    int nr = 0;
                    for (; j < r->k && blk[j] == g && nr < rows_a_pass; j++) {
                        if (!any_nonzero(c, r->k, j, m)) continue;
                        w[nr] = w_row(r, j) + (Py_ssize_t)i0 * r->bits / 8;
                        jr[nr++] = j;
                    }
                    for (int p = 0; nr && p < m; p++)
                        for (int q = 0; q < nr; q++) {
                            a[p * rows_a_pass + q] = c[p * r->k + jr[q]];
                            csum[p] += a[p * rows_a_pass + q];
                        }
                    if (nr) axpy_block_multi(acc, n, w, a, rows_a_pass, nr, m, len, r->bits, path);
                    any |= nr;
                }
                if (!any) continue;
                scales_f32(S + g * table_row + (Py_ssize_t)i0 * scale_size, r->stype, len, s, avx);
                biases_f32(r, B + g * table_row + (Py_ssize_t)i0 * scale_size, len, s, b, avx);
                for (int p = 0; p < m; p++)
                    for (int i = 0; i < len; i++) o[p * n + i0 + i] += s[i] * acc[p * n + i] + b[i] * csum[p];
            }
            while (fold && next < n_out) fold_part(total, out, m, n, i0, len, next++ == 0);
            free(csum);
            free(a);
            free(wb);
            free(ab);
            free(qa);
            free(dot);
            free(pf);
        }
    }
}

/* -- Python ------------------------------------------------------------------------------ */

typedef struct {
    Py_buffer views[7]; /* vec, out, w, s, b, slots, dst */
    int held[7];
    const int32_t *dst; /* parse_dst */
    int n_out;
} Buffers;

static void release(Buffers *B) {
    for (int i = 0; i < 7; i++)
        if (B->held[i]) PyBuffer_Release(&B->views[i]);
}

static int get(Buffers *B, int i, PyObject *obj, int writable, const char *what) {
    /* Ask for strides and check them: MLX exports strided views (e.g. a column slice) even when
       asked for a contiguous buffer, and these loops assume row-major memory. */
    if (PyObject_GetBuffer(obj, &B->views[i], (writable ? PyBUF_WRITABLE : 0) | PyBUF_STRIDES) != 0) {
        PyErr_Format(PyExc_TypeError, "%s: expected a%s buffer", what, writable ? " writable" : "");
        return -1;
    }
    B->held[i] = 1;
    if (!PyBuffer_IsContiguous(&B->views[i], 'C')) {
        PyErr_Format(PyExc_ValueError, "%s: the buffer is not C-contiguous (a strided view?)", what);
        return -1;
    }
    return 0;
}

/* r->slots from `slots` (None: rows 0..k-1), checked: int32 [k], none negative; *max_row: the largest row. An int64
   [k] `slots` holds row addresses instead (r->ptrs: rows in buffers the caller holds; *max_row -1, nothing to check). */
static int parse_slots(Buffers *B, Rows *r, PyObject *slots, const char *fn, Py_ssize_t *max_row) {
    r->slots = NULL;
    r->ptrs = NULL;
    *max_row = r->k - 1;
    if (slots == Py_None) return 0;
    if (get(B, 5, slots, 0, "slots")) return -1;
    if (B->views[5].itemsize == 8 && B->views[5].len == r->k * 8) {
        r->ptrs = (const int64_t *)B->views[5].buf;
        *max_row = -1;
        return 0;
    }
    if (B->views[5].len != r->k * 4) {
        PyErr_Format(PyExc_ValueError, "%s: slots must be int32 [%zd] (or int64 row addresses)", fn, r->k);
        return -1;
    }
    r->slots = (const int32_t *)B->views[5].buf;
    *max_row = -1;
    for (Py_ssize_t j = 0; j < r->k; j++) {
        if (r->slots[j] < 0) {
            PyErr_Format(PyExc_IndexError, "%s: negative slot %d", fn, r->slots[j]);
            return -1;
        }
        if (r->slots[j] > *max_row) *max_row = r->slots[j];
    }
    return 0;
}

/* dst (None: one output row) as int32 [k] in [0, n_out), non-decreasing: out holds n_out rows of [m, n]. */
static int parse_dst(Buffers *B, PyObject *obj, const Rows *r, const char *fn) {
    B->dst = NULL;
    if (obj == NULL || obj == Py_None) {
        B->n_out = 1;
        return 0;
    }
    if (get(B, 6, obj, 0, "dst")) return -1;
    if (B->views[6].len != r->k * 4 || B->views[6].itemsize != 4 || B->n_out < 1) {
        PyErr_Format(PyExc_ValueError, "%s: dst must be int32 [%zd] and n_out positive", fn, r->k);
        return -1;
    }
    const int32_t *d = (const int32_t *)B->views[6].buf;
    for (Py_ssize_t j = 0; j < r->k; j++)
        if (d[j] < 0 || d[j] >= B->n_out || (j && d[j] < d[j - 1])) {
            PyErr_Format(PyExc_IndexError, "%s: dst must be non-decreasing in [0, %d)", fn, B->n_out);
            return -1;
        }
    B->dst = d;
    return 0;
}

/* bits, group size, n and scale type make sense */
static int check_shape(const Rows *r, const char *fn) {
    if (r->bits != 2 && r->bits != 4 && r->bits != 8) {
        PyErr_Format(PyExc_ValueError, "%s: bits must be 2, 4 or 8, got %d", fn, r->bits);
        return -1;
    }
    if (r->gs <= 0 || r->n <= 0 || r->n % r->gs || (r->gs * r->bits) % 8 || r->stype < 0 || r->stype > 2 || r->k < 0) {
        PyErr_Format(PyExc_ValueError, "%s: bad shape (n=%d, group_size=%d, k=%zd, scale type %d)", fn, r->n, r->gs, r->k,
                     r->stype);
        return -1;
    }
    return 0;
}

/* Point r at its weights, scales and biases (views[0..2] at offsets offs), each row up to max_row checked
   against its buffer. */
static int bind_rows(const Py_buffer *views, const Py_ssize_t offs[3], Py_ssize_t max_row, Rows *r, const char *fn) {
    Py_ssize_t scale_size = r->stype == SCALE_F32 ? 4 : 2, groups = r->n / r->gs;
    const Py_ssize_t strides[3] = {r->w_stride, r->s_stride, r->b_stride};
    const Py_ssize_t sizes[3] = {(Py_ssize_t)r->n * r->bits / 8, groups * scale_size, groups * scale_size};
    const char *names[3] = {"weights", "scales", "biases"};
    for (int i = 0; i < 3; i++) {
        if (offs[i] < 0 || strides[i] < 0 || (max_row >= 0 && offs[i] + max_row * strides[i] + sizes[i] > views[i].len)) {
            PyErr_Format(PyExc_IndexError, "%s: row %zd of the %s (offset %zd, stride %zd, %zd bytes) is outside its %zd-byte buffer",
                         fn, max_row, names[i], offs[i], strides[i], sizes[i], views[i].len);
            return -1;
        }
    }
    r->w = (const uint8_t *)views[0].buf + offs[0];
    r->s = (const uint8_t *)views[1].buf + offs[1];
    r->b = (const uint8_t *)views[2].buf + offs[2];
    r->w_off = offs[0], r->s_off = offs[1], r->b_off = offs[2];
    return 0;
}

/* Parse the common arguments and check every row touched lies inside its buffer; *m: the positions (vec holds
   m rows of its length). */
static int parse(PyObject *args, Buffers *B, Rows *r, const char *fn, int vec_is_rows, int *m) {
    PyObject *vec, *out, *w, *s, *b, *slots, *dst = NULL;
    Py_ssize_t w_off, s_off, b_off;
    memset(B, 0, sizeof(*B));
    r->sym = 0;
    const int pairs = r->paired;
    r->paired = 0; /* (slots and buffers are checked per unit) */
    if (!PyArg_ParseTuple(args, "OOOnnOnnOnnOniiii|pOi", &vec, &out, &w, &w_off, &r->w_stride, &s, &s_off, &r->s_stride, &b,
                          &b_off, &r->b_stride, &slots, &r->k, &r->n, &r->bits, &r->gs, &r->stype, &r->sym, &dst,
                          &B->n_out))
        return -1;
    if (get(B, 0, vec, 0, "vector") || get(B, 1, out, 1, "out") || get(B, 2, w, 0, "weights") ||
        get(B, 3, s, 0, "scales") || get(B, 4, b, 0, "biases"))
        return -1;
    if (check_shape(r, fn) || parse_dst(B, dst, r, fn)) return -1;
    Py_ssize_t vec_len = vec_is_rows ? r->k : r->n, out_len = (vec_is_rows ? r->n : r->k * (1 + pairs)) * (Py_ssize_t)B->n_out;
    *m = vec_len > 0 ? (int)(B->views[0].len / (vec_len * 4)) : 1;
    if (*m < 1 || B->views[0].len != *m * vec_len * 4 || B->views[1].len != *m * out_len * 4) {
        PyErr_Format(PyExc_ValueError, "%s: vector has %zd bytes and out %zd, expected float32 [m, %zd] and [m, %zd]",
                     fn, B->views[0].len, B->views[1].len, vec_len, out_len);
        return -1;
    }
    Py_ssize_t max_row;
    if (parse_slots(B, r, slots, fn, &max_row)) return -1;
    if (pairs) { /* the second rows inside their buffers too */
        Rows second = *r;
        const Py_ssize_t offs2[3] = {w_off + r->pair_w, s_off + r->pair_s, b_off + r->pair_b};
        if (bind_rows(B->views + 2, offs2, max_row, &second, fn)) return -1;
    }
    const Py_ssize_t offs[3] = {w_off, s_off, b_off};
    if (bind_rows(B->views + 2, offs, max_row, r, fn)) return -1;
    if (pairs) {
        r->paired = 1;
        r->k *= 2;
    }
    return 0;
}

typedef void (*Product)(const Rows *, const float *, float *, int, const Buffers *);

static void row_dot_product(const Rows *r, const float *x, float *out, int m, const Buffers *B) {
    (void)B; /* (dst: each output is one row's alone) */
    row_dot_impl(r, x, out, m);
}

static void row_axpy_product(const Rows *r, const float *c, float *out, int m, const Buffers *B) {
    row_axpy_dst(r, c, out, m, B->dst, B->n_out);
}

/* Parse (into a copy of `init`, or zeroed Rows), compute with the GIL released, release the buffers. */
static PyObject *run_product(PyObject *args, const char *fn, int vec_is_rows, Product product, const Rows *init) {
    Buffers B;
    Rows r;
    int m;
    if (init)
        r = *init;
    else
        memset(&r, 0, sizeof(r));
    if (parse(args, &B, &r, fn, vec_is_rows, &m)) {
        release(&B);
        return NULL;
    }
    Py_BEGIN_ALLOW_THREADS product(&r, (const float *)B.views[0].buf, (float *)B.views[1].buf, m, &B);
    Py_END_ALLOW_THREADS release(&B);
    Py_RETURN_NONE;
}

static PyObject *py_row_dot(PyObject *self, PyObject *args) {
    (void)self;
    return run_product(args, "row_dot", 0, row_dot_product, NULL);
}

/* row_dot_pairs' arguments (pair_w, pair_s, pair_b, then row_dot's) into B and r (paired) */
static int parse_pairs(PyObject *args, Buffers *B, Rows *r, int *m) {
    memset(B, 0, sizeof(*B));
    memset(r, 0, sizeof(*r));
    const Py_ssize_t n = PyTuple_GET_SIZE(args);
    if (n < 3) {
        PyErr_SetString(PyExc_TypeError, "row_dot_pairs: pair_w, pair_s, pair_b, then row_dot's arguments");
        return -1;
    }
    r->pair_w = PyLong_AsSsize_t(PyTuple_GET_ITEM(args, 0));
    r->pair_s = PyLong_AsSsize_t(PyTuple_GET_ITEM(args, 1));
    r->pair_b = PyLong_AsSsize_t(PyTuple_GET_ITEM(args, 2));
    if (PyErr_Occurred()) return -1;
    if (n > 3 + 18 && PyTuple_GET_ITEM(args, 3 + 18) != Py_None) { /* (row_dot's 17 arguments, symmetric, dst) */
        PyErr_SetString(PyExc_ValueError, "row_dot_pairs: no dst");
        return -1;
    }
    r->paired = 1;
    PyObject *rest = PyTuple_GetSlice(args, 3, n);
    if (rest == NULL) return -1;
    const int failed = parse(rest, B, r, "row_dot_pairs", 0, m);
    Py_DECREF(rest);
    return failed;
}

/* row_dot_pairs(pair_w, pair_s, pair_b, <row_dot's arguments>): out [m, 2 k], out[p, 2 j] row j's product and
   out[p, 2 j + 1] that of the row pair_* bytes further on in the same buffers, both read in one pass */
static PyObject *py_row_dot_pairs(PyObject *self, PyObject *args) {
    (void)self;
    Buffers B;
    Rows r;
    int m;
    if (parse_pairs(args, &B, &r, &m)) {
        release(&B);
        return NULL;
    }
    Py_BEGIN_ALLOW_THREADS row_dot_impl(&r, (const float *)B.views[0].buf, (float *)B.views[1].buf, m);
    Py_END_ALLOW_THREADS release(&B);
    Py_RETURN_NONE;
}

/* h[i] = silu(g[i stride]) u[i stride] for i < n (h may be g); the threads split the elements: the same results at
   any count */
static inline float silu_mul1(float g, float u) { return g / (1.0f + expf(-g)) * u; }

static void silu_mul_into(float *h, const float *g, const float *u, int stride, Py_ssize_t n) {
#pragma omp parallel for schedule(static) if (n >= 4096)
    for (Py_ssize_t i = 0; i < n; i++) h[i] = silu_mul1(g[i * stride], u[i * stride]);
}

/* glu_pairs(gu, h): h[i] = silu(gu[2 i]) * gu[2 i + 1] (float32), silu_mul's arithmetic on row_dot_pairs' output */
static PyObject *py_glu_pairs(PyObject *self, PyObject *args) {
    (void)self;
    PyObject *gu, *h;
    if (!PyArg_ParseTuple(args, "OO", &gu, &h)) return NULL;
    Buffers Bf;
    memset(&Bf, 0, sizeof(Bf));
    PyObject *result = NULL;
    if (get(&Bf, 0, gu, 0, "gate and up") || get(&Bf, 1, h, 1, "out")) goto done;
    if (Bf.views[0].len != 2 * Bf.views[1].len || Bf.views[1].len % 4) {
        PyErr_SetString(PyExc_ValueError, "glu_pairs: gu must be float32 [2 n] and h float32 [n]");
        goto done;
    }
    const float *g = Bf.views[0].buf;
    silu_mul_into(Bf.views[1].buf, g, g + 1, 2, Bf.views[1].len / 4);
    result = Py_None;
    Py_INCREF(result);
done:
    release(&Bf);
    return result;
}

static PyObject *py_row_axpy(PyObject *self, PyObject *args) {
    (void)self;
    return run_product(args, "row_axpy", 1, row_axpy_product, NULL);
}

/* block_axpy's arguments, parsed and checked (buffers held until release_block) */
typedef struct {
    Buffers B;
    Rows r;
    Py_buffer blk, total;
    int have_blk, have_total, m;
    const uint8_t *S, *Bt;
} BlockArgs;

static void release_block(BlockArgs *a) {
    if (a->have_blk) PyBuffer_Release(&a->blk);
    if (a->have_total) PyBuffer_Release(&a->total);
    release(&a->B);
}

/* block_axpy(vec, out, w, w_off, w_stride, slots, k, n, bits, blocks, S, B, n_blocks, scale_type, symmetric=False,
   dst=None, n_out=1, total=None) */
static int parse_block(PyObject *args, BlockArgs *a) {
    PyObject *vec, *out, *w, *slots, *blocks, *S, *Bt, *dst = NULL, *total = NULL;
    Py_ssize_t w_off, n_blocks;
    Buffers *B = &a->B;
    Rows *r = &a->r;
    memset(a, 0, sizeof(*a));
    if (!PyArg_ParseTuple(args, "OOOnnOniiOOOni|pOiO", &vec, &out, &w, &w_off, &r->w_stride, &slots, &r->k, &r->n,
                          &r->bits, &blocks, &S, &Bt, &n_blocks, &r->stype, &r->sym, &dst, &B->n_out, &total))
        return -1;
    if (total != NULL && total != Py_None) {
        if (PyObject_GetBuffer(total, &a->total, PyBUF_WRITABLE | PyBUF_C_CONTIGUOUS) != 0) return -1;
        a->have_total = 1;
    }
    r->gs = 32;
    const char *err = NULL;
    a->m = 1;
    if (get(B, 0, vec, 0, "vector") || get(B, 1, out, 1, "out") || get(B, 2, w, 0, "weights") ||
        get(B, 3, S, 0, "scales") || get(B, 4, Bt, 0, "biases") || parse_dst(B, dst, r, "block_axpy"))
        return -1;
    if ((r->bits != 2 && r->bits != 4 && r->bits != 8) || r->n <= 0 || r->n % 32 || r->k < 0 || r->stype < 0 ||
        r->stype > 2 || n_blocks <= 0)
        err = "block_axpy: bits must be 2, 4 or 8 and n a positive multiple of 32";
    else if ((a->m = r->k > 0 ? (int)(B->views[0].len / (r->k * 4)) : 1) < 1 || B->views[0].len != a->m * r->k * 4 ||
             B->views[1].len != (Py_ssize_t)a->m * r->n * 4 * (a->have_total ? 1 : B->n_out) ||
             (a->have_total && a->total.len != B->views[1].len))
        err = "block_axpy: vector must be float32 [m, k], out float32 [n_out, m, n] (total: it and out [m, n])";
    else if (B->views[3].len < n_blocks * r->n * (r->stype == SCALE_F32 ? 4 : 2) || B->views[4].len != B->views[3].len)
        err = "block_axpy: scales and biases must be [n_blocks, n] of the scale type";
    if (err) {
        PyErr_SetString(PyExc_ValueError, err);
        return -1;
    }
    if (PyObject_GetBuffer(blocks, &a->blk, PyBUF_C_CONTIGUOUS) != 0) return -1;
    a->have_blk = 1;
    if (a->blk.len != r->k * 4) {
        PyErr_SetString(PyExc_ValueError, "block_axpy: blocks must be int32 [k]");
        return -1;
    }
    const int32_t *bl = (const int32_t *)a->blk.buf;
    Py_ssize_t max_row;
    if (parse_slots(B, r, slots, "block_axpy", &max_row)) return -1;
    for (Py_ssize_t j = 0; j < r->k; j++)
        if (bl[j] < 0 || bl[j] >= n_blocks) {
            PyErr_Format(PyExc_IndexError, "block_axpy: block %d outside [0, %zd)", bl[j], n_blocks);
            return -1;
        } else if (B->dst && j && bl[j] == bl[j - 1] && B->dst[j] != B->dst[j - 1]) {
            PyErr_SetString(PyExc_ValueError, "block_axpy: the rows of a block must share their dst");
            return -1;
        }
    if (w_off < 0 || r->w_stride < 0 ||
        (max_row >= 0 && w_off + max_row * r->w_stride + (Py_ssize_t)r->n * r->bits / 8 > B->views[2].len)) {
        PyErr_Format(PyExc_IndexError, "block_axpy: row %zd of the weights is outside their %zd-byte buffer", max_row,
                     B->views[2].len);
        return -1;
    }
    r->w = (const uint8_t *)B->views[2].buf + w_off;
    r->w_off = w_off;
    a->S = B->views[3].buf;
    a->Bt = B->views[4].buf;
    return 0;
}

/* block_axpy of parsed arguments (the GIL released) */
static int run_block(BlockArgs *a) {
    const Rows *r = &a->r;
    float *scratch = PyMem_RawMalloc((size_t)(a->m + 2) * sizeof(float) * (size_t)r->n);
    if (scratch == NULL) {
        PyErr_NoMemory();
        return -1;
    }
    Py_BEGIN_ALLOW_THREADS block_axpy_impl(r, (const float *)a->B.views[0].buf, (float *)a->B.views[1].buf,
                                           (const int32_t *)a->blk.buf, a->S, a->Bt, scratch, a->m, a->B.dst,
                                           a->B.n_out, a->have_total ? (float *)a->total.buf : NULL);
    Py_END_ALLOW_THREADS PyMem_RawFree(scratch);
    return 0;
}

static PyObject *py_block_axpy(PyObject *self, PyObject *args) {
    (void)self;
    BlockArgs a;
    const int failed = parse_block(args, &a) || run_block(&a);
    release_block(&a);
    if (failed) return NULL;
    Py_RETURN_NONE;
}

/* -- a GLU's units in one pass ----------------------------------------------------------------
   ffn_glu(pairs, block): block_axpy(h, ...) of h = glu_pairs(row_dot_pairs(x, ...)), the arguments of each (block's
   vector receives h). For one row on the AVX-512 int8 loops with partial sums (dst), each thread takes whole partial
   sums' units and goes through them a block of rows at a time: gate and up, then h, then down, while the units'
   bytes are in the cache. A unit's rows lie side by side: read whole and in order (asked for UNITS_AHEAD units
   ahead), memory streams them much faster than one matrix's part of every unit, then another's. Every
   result is, bit for bit, the three calls': the same loops per row and per column, each partial sum's blocks in
   order. Elsewhere it makes the three calls. */
#define UNITS_AHEAD 2

#if HAVE_X86
static void ffn_glu_fused(const Rows *rp, const float *x, float *gu, BlockArgs *a) {
    const Rows *rb = &a->r;
    const Py_ssize_t K = rb->k, n = rb->n;
    const int32_t *blk = (const int32_t *)a->blk.buf, *dst = a->B.dst;
    float *h = (float *)a->B.views[0].buf, *out = (float *)a->B.views[1].buf;
    void *mem;
    const QX *q = quantize_rows(rp, x, 1, 4, &mem);
    memset(out, 0, sizeof(float) * (size_t)n * a->B.n_out);
#pragma omp parallel num_threads(threads_for(rb, 1))
    {
        /* this thread's units: whole partial sums, about an equal share */
        Py_ssize_t lo, hi;
        thread_share(K, &lo, &hi);
        while (lo > 0 && lo < K && dst[lo] == dst[lo - 1]) lo++;
        while (hi > 0 && hi < K && dst[hi] == dst[hi - 1]) hi++;
        const uint8_t **wb = malloc(sizeof(*wb) * (size_t)(K + 3)), **pf = malloc(sizeof(*pf) * BLOCK_AHEAD);
        int8_t *qa = malloc((size_t)K + 3);
        for (Py_ssize_t j = lo; j < hi;) {
            Py_ssize_t j1 = j;
            while (j1 < K && blk[j1] == blk[j]) j1++;
            for (Py_ssize_t u = j; u < j1; u += 2) { /* gate and up: rows 2u .. 2u + 3 */
                for (Py_ssize_t v = u + UNITS_AHEAD; v < u + UNITS_AHEAD + 2 && v < hi; v++)
                    prefetch_span(w_row(rp, 2 * v), rp->w_stride);
                dot4_rows(rp, 2 * u, 2 * (j1 - u) < 4 ? (int)(2 * (j1 - u)) : 4, q, 0, 1, gu);
            }
            for (Py_ssize_t u = j; u < j1; u++) h[u] = silu_mul1(gu[2 * u], gu[2 * u + 1]);
            j = q8_group(rb, h, out, dst, blk, a->S, a->Bt, NULL, NULL, 1, j, 0, (int)n, wb, qa, NULL, pf, 2);
        }
        free(wb);
        free(pf);
        free(qa);
    }
    free(mem);
}
#endif

static PyObject *py_ffn_glu(PyObject *self, PyObject *args) {
    (void)self;
    PyObject *pairs, *block;
    if (!PyArg_ParseTuple(args, "O!O!", &PyTuple_Type, &pairs, &PyTuple_Type, &block)) return NULL;
    Buffers B;
    Rows rp;
    BlockArgs a;
    memset(&a, 0, sizeof(a));
    int m, failed = parse_pairs(pairs, &B, &rp, &m) || parse_block(block, &a);
    const Rows *rb = &a.r;
    if (!failed && (rb->k * 2 != rp.k || a.m != m || a.B.views[0].readonly)) {
        PyErr_SetString(PyExc_ValueError,
                        "ffn_glu: the down rows must be the pairs' units, at as many positions, into a writable vector");
        failed = 1;
    }
    if (!failed) {
        const float *x = B.views[0].buf;
        float *gu = B.views[1].buf, *h = a.B.views[0].buf;
        const int same_slots = (rp.slots == NULL) == (rb->slots == NULL) && rp.ptrs == NULL && rb->ptrs == NULL &&
                               (rp.slots == NULL || !memcmp(rp.slots, rb->slots, sizeof(int32_t) * (size_t)rb->k));
#if HAVE_X86
        if (m == 1 && rb->k > 0 && a.B.dst && !a.have_total && same_slots && int8_path(&rp) == 4 &&
            q8_block_path(rb) == 2) {
            Py_BEGIN_ALLOW_THREADS ffn_glu_fused(&rp, x, gu, &a);
            Py_END_ALLOW_THREADS
        } else
#endif
        { /* the three calls */
            Py_BEGIN_ALLOW_THREADS row_dot_impl(&rp, x, gu, m);
            silu_mul_into(h, gu, gu + 1, 2, (Py_ssize_t)m * rb->k);
            Py_END_ALLOW_THREADS failed = run_block(&a);
        }
    }
    release(&B);
    release_block(&a);
    if (failed) return NULL;
    Py_RETURN_NONE;
}

/* -- GGML blocks as a GGUF stores them (format/ggml.py) ---------------------------------------------
   Rows of Q4_0 / Q8_0 / IQ4_NL (32 values a block) or Q4_K / Q5_K / Q6_K / Q2_K / Q3_K / IQ4_XS (256: sub-blocks of
   32, Q6_K's, Q2_K's and Q3_K's of 16) blocks, computed as stored: the bytes a unit reads are the file's. With int8
   activations (the default) x is quantised as llama.cpp quantises it for these types (Q8_0: per 32, a float16 scale;
   Q8_K: per 256, a float scale and each 16's sum) and each block's dot is an exact integer sum; with float ones each
   block is dequantised (format/ggml.py's arithmetic) and summed in float, value by value. The SIMD loops compute only the integer sums; every float
   operation happens in the scalar code below in one order (block by block), so the AVX2 and scalar loops give the
   same bits, whatever the threads. */

enum { GG_Q4_0, GG_Q8_0, GG_Q4_K, GG_Q5_K, GG_Q6_K, GG_Q2_K, GG_Q3_K, GG_IQ4_NL, GG_IQ4_XS, GG_Q5_0, GG_TYPES };
static const int gg_values[GG_TYPES] = {32, 32, 256, 256, 256, 256, 256, 32, 256, 32};
static const int gg_bytes[GG_TYPES] = {18, 34, 144, 176, 210, 84, 110, 18, 136, 22};
static const int gg_d_at[GG_TYPES] = {0, 0, 0, 0, 208, 80, 108, 0, 0, 0}; /* the float16 d (and dmin after it) */
static const int8_t gg_iq4[16] = {-127, -104, -83, -65, -49, -35, -22, -10, 1, 13, 25, 38, 53, 69, 89, 113};
/* activations quantised per 32 values (Q8_0), else per 256 (Q8_K); types with mins (dmin * m subtracted) */
static inline int gg_per32(int kind) { return gg_values[kind] == 32; }
static inline int gg_mins(int kind) { return kind == GG_Q4_K || kind == GG_Q5_K || kind == GG_Q2_K; }
#define GG_MAX_BLOCKS 2048 /* rows of up to 65536 values */
#define GG_POSITIONS 4    /* positions a row's blocks are unpacked for at once */

typedef struct { /* one position's activations, quantised per block of its type's values */
    int8_t *q;     /* [n] */
    float *d;      /* [blocks]: the block's scale */
    int16_t *bsum; /* [n / 16]: each 16 q's sum (K-quants' mins and Q6_K's offset) */
    /* the VNNI loops of 32-value blocks (gg_pair_layout): Q4_0's q by block pairs, each pair's (Q8_0: each block's)
       offset correction in 8 int32 lanes */
    int8_t *qp;
    int32_t *corr;
} GQ;

static inline float gg_f16(const uint8_t *p) { return f16_to_f32((uint16_t)(p[0] | (p[1] << 8))); }

/* llama.cpp's quantize_row_q8_0 (32 values: d = amax / 127 as float16, q = round(x / d)) or quantize_row_q8_K (256:
   d = -max / 127 of the value largest in magnitude, q rounded to nearest even, at most 127) */
static void gg_quantize(int kind, const float *x, int n, GQ *g) {
    if (gg_per32(kind)) {
        for (int b = 0; b < n / 32; b++) {
            const float *v = x + 32 * b;
            float amax = 0;
            for (int i = 0; i < 32; i++) amax = fmaxf(amax, fabsf(v[i]));
            const float d = amax / 127, id = d ? 1.0f / d : 0.0f;
            g->d[b] = f16_to_f32(f32_to_f16(d));
            for (int i = 0; i < 32; i++) g->q[32 * b + i] = (int8_t)roundf(v[i] * id);
        }
    } else {
        for (int b = 0; b < n / 256; b++) {
            const float *v = x + 256 * b;
            float amax = 0, max = 0;
            for (int i = 0; i < 256; i++)
                if (fabsf(v[i]) > amax) {
                    amax = fabsf(v[i]);
                    max = v[i];
                }
            int8_t *q = g->q + 256 * b;
            if (amax == 0) {
                g->d[b] = 0;
                memset(q, 0, 256);
            } else {
                const float iscale = -127.0f / max;
                for (int i = 0; i < 256; i++) {
                    const long r = lrintf(iscale * v[i]);
                    q[i] = (int8_t)(r > 127 ? 127 : r);
                }
                g->d[b] = 1 / iscale;
            }
        }
    }
    for (int s = 0; s < n / 16; s++) {
        int sum = 0;
        for (int i = 0; i < 16; i++) sum += g->q[16 * s + i];
        g->bsum[s] = (int16_t)sum;
    }
}

/* For the VNNI loops of 32-value blocks, whose products take unsigned codes (Q4_0's q, Q8_0's q + 128) against
   signed activations: Q4_0's activations by block pairs, pair p's 64 bytes [block 2p's values 0-15, 2p+1's 0-15,
   2p's 16-31, 2p+1's 16-31] (the low nibbles of both blocks' codes in one register, then the high ones), and the
   codes' offset (8, or 128) times each int32 lane's 4 activations, subtracted (a last odd block of Q4_0: its pair's
   second half zero) */
static void gg_pair_layout(int kind, int n, GQ *g) {
    const int blocks = n / 32;
    if (kind == GG_Q8_0) {
        for (int b = 0; b < blocks; b++)
            for (int l = 0; l < 8; l++) {
                const int8_t *v = g->q + 32 * b + 4 * l;
                g->corr[8 * b + l] = -128 * (v[0] + v[1] + v[2] + v[3]);
            }
        return;
    }
    for (int p = 0; p < (blocks + 1) / 2; p++) {
        int8_t *d = g->qp + 64 * p;
        for (int h = 0; h < 2; h++) { /* block 2p + h */
            const int b = 2 * p + h;
            for (int i = 0; i < 16; i++) {
                d[16 * h + i] = b < blocks ? g->q[32 * b + i] : 0;
                d[32 + 16 * h + i] = b < blocks ? g->q[32 * b + 16 + i] : 0;
            }
        }
        for (int l = 0; l < 8; l++) {
            const int8_t *lo = d + 4 * l, *hi = d + 32 + 4 * l;
            g->corr[8 * p + l] = -8 * (lo[0] + lo[1] + lo[2] + lo[3] + hi[0] + hi[1] + hi[2] + hi[3]);
        }
    }
}

/* Q4_K / Q5_K sub-block j's 6-bit scale and min (llama.cpp's get_scale_min_k4) */
static inline void gg_scale_min(const uint8_t *s, int j, int *sc, int *m) {
    if (j < 4) {
        *sc = s[j] & 63;
        *m = s[j + 4] & 63;
    } else {
        *sc = (s[j + 4] & 0xF) | ((s[j - 4] >> 6) << 4);
        *m = (s[j + 4] >> 4) | ((s[j] >> 6) << 4);
    }
}

/* Q3_K sub-block j's scale (6 bits less 32): low nibbles in bytes 0-7, high bits in 8-11 */
static inline int gg_q3_scale(const uint8_t *s, int j) {
    return (((s[j % 8] >> (4 * (j / 8))) & 15) | (((s[8 + j % 4] >> (2 * (j / 4))) & 3) << 4)) - 32;
}

/* IQ4_XS sub-block j's scale (6 bits less 32): low nibbles in bytes 4-7, high bits in the 16 at byte 2 */
static inline int gg_iq4xs_scale(const uint8_t *w, int j) {
    return (((w[4 + j / 2] >> (4 * (j % 2))) & 15) | ((((w[2] | (w[3] << 8)) >> (2 * j)) & 3) << 4)) - 32;
}

/* A block's code of value v: Q4_K / Q5_K 0..31, Q6_K 0..63 (less 32 is the value's), Q2_K 0..3, Q3_K -4..3, the
   i-quants' table values, Q5_0 -16..15 */
static inline int gg_code(int kind, const uint8_t *w, int v) {
    if (kind == GG_Q5_0) { /* value j: the low nibble of byte j (j + 16: its high one), bit j of the 32 high bits */
        const int l = v % 16, q = (v < 16 ? w[6 + l] : w[6 + l] >> 4) & 15;
        const uint32_t qh = (uint32_t)w[2] | (uint32_t)w[3] << 8 | (uint32_t)w[4] << 16 | (uint32_t)w[5] << 24;
        return (q | (int)((qh >> v) & 1) << 4) - 16;
    }
    if (kind == GG_Q2_K || kind == GG_Q3_K) {
        const int h = v / 128, s = v % 128 / 32, l = v % 32;
        const int q = (w[(kind == GG_Q2_K ? 16 : 32) + 32 * h + l] >> (2 * s)) & 3;
        return kind == GG_Q2_K ? q : q - ((w[l] >> (4 * h + s)) & 1 ? 0 : 4);
    }
    if (kind == GG_IQ4_NL || kind == GG_IQ4_XS) {
        const uint8_t *qs = w + (kind == GG_IQ4_NL ? 2 : 8) + 16 * (v / 32);
        const int l = v % 32;
        return gg_iq4[(l < 16 ? qs[l] : qs[l - 16] >> 4) & 15];
    }
    if (kind == GG_Q6_K) {
        const int h = v / 128, i = v % 128 / 32, l = v % 32;
        const uint8_t lo = w[64 * h + 32 * (i & 1) + l];
        return ((i < 2 ? lo : lo >> 4) & 15) | (((w[128 + 32 * h + l] >> (2 * i)) & 3) << 4);
    }
    const int c = v / 64, hi = v % 64 / 32, l = v % 32;
    const uint8_t *qs = w + (kind == GG_Q4_K ? 16 : 48);
    const int q = (hi ? qs[32 * c + l] >> 4 : qs[32 * c + l]) & 15;
    return kind == GG_Q4_K ? q : q | (((w[16 + l] >> (2 * c + hi)) & 1) << 4);
}

/* Integer sums of a row's blocks against one position's (isum, and for types with mins imin: sum_j m_j xsum_j;
   Q6_K's offset of 32 is in isum), scalar */
static void gg_isums_scalar(int kind, const uint8_t *w, const GQ *x, int blocks, int32_t *isum, int32_t *imin) {
    const int bytes = gg_bytes[kind];
    for (int b = 0; b < blocks; b++, w += bytes) {
        const int8_t *q = x->q + gg_values[kind] * b;
        int32_t s = 0;
        if (kind == GG_Q4_0) {
            for (int i = 0; i < 16; i++) s += ((w[2 + i] & 15) - 8) * q[i] + ((w[2 + i] >> 4) - 8) * q[i + 16];
        } else if (kind == GG_Q8_0) {
            for (int i = 0; i < 32; i++) s += (int8_t)w[2 + i] * q[i];
        } else if (kind == GG_IQ4_NL || kind == GG_Q5_0) {
            for (int i = 0; i < 32; i++) s += gg_code(kind, w, i) * q[i];
        } else if (kind == GG_Q6_K) {
            for (int j = 0; j < 16; j++) {
                int32_t part = 0;
                for (int i = 16 * j; i < 16 * j + 16; i++) part += (gg_code(kind, w, i) - 32) * q[i];
                s += (int8_t)w[192 + j] * part;
            }
        } else if (kind == GG_Q3_K || kind == GG_IQ4_XS) {
            const int sub = kind == GG_Q3_K ? 16 : 32;
            for (int j = 0; j < 256 / sub; j++) {
                int32_t part = 0;
                for (int i = sub * j; i < sub * j + sub; i++) part += gg_code(kind, w, i) * q[i];
                s += (kind == GG_Q3_K ? gg_q3_scale(w + 96, j) : gg_iq4xs_scale(w, j)) * part;
            }
        } else if (kind == GG_Q2_K) {
            int32_t mins = 0;
            for (int j = 0; j < 16; j++) {
                int32_t part = 0;
                for (int i = 16 * j; i < 16 * j + 16; i++) part += gg_code(kind, w, i) * q[i];
                s += (w[j] & 15) * part;
                mins += (w[j] >> 4) * x->bsum[16 * b + j];
            }
            imin[b] = mins;
        } else {
            int32_t mins = 0;
            for (int j = 0; j < 8; j++) {
                int sc, m, part = 0;
                gg_scale_min(w + 4, j, &sc, &m);
                for (int i = 32 * j; i < 32 * j + 32; i++) part += gg_code(kind, w, i) * q[i];
                s += sc * part;
                mins += m * (x->bsum[16 * b + 2 * j] + x->bsum[16 * b + 2 * j + 1]);
            }
            imin[b] = mins;
        }
        isum[b] = s;
    }
}

/* One row against one position, int8, scalar (the reference): each block's integer sums meet its scales in float,
   block by block */
static float gg_row_q8_scalar(int kind, const uint8_t *w, const GQ *x, int blocks) {
    int32_t isum[GG_MAX_BLOCKS], imin[GG_MAX_BLOCKS];
    gg_isums_scalar(kind, w, x, blocks, isum, imin);
    const int bytes = gg_bytes[kind];
    float acc = 0;
    for (int b = 0; b < blocks; b++, w += bytes) {
        const float t = x->d[b] * gg_f16(w + gg_d_at[kind]) * (float)isum[b];
        acc += t;
        if (gg_mins(kind)) acc -= x->d[b] * gg_f16(w + gg_d_at[kind] + 2) * (float)imin[b];
    }
    return acc;
}

#if HAVE_X86
/* The AVX2 loops, as llama.cpp's: a block's integer products in 8 int32 lanes, scaled into 8 float lanes summed over
   the row (their rounding is the lanes', not the scalar loop's block order) */
AVX2 static inline float gg_hsum_ps(__m256 v) {
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    s = _mm_add_ss(s, _mm_movehdup_ps(s));
    return _mm_cvtss_f32(s);
}

/* the sum of 4 int32 lanes */
AVX2 static inline int gg_hsum_epi32(__m128i t) {
    t = _mm_add_epi32(t, _mm_shuffle_epi32(t, 0x4E));
    t = _mm_add_epi32(t, _mm_shuffle_epi32(t, 0xB1));
    return _mm_cvtsi128_si32(t);
}

AVX2 static inline float gg_half(const uint8_t *p) { return _cvtsh_ss((unsigned short)(p[0] | (p[1] << 8))); }

/* 32 signed weights times 32 activations in 8 int32 lanes (|w| unsigned times x with w's sign) */
AVX2 static inline __m256i gg_dot_i8(__m256i w, __m256i x) {
    return _mm256_madd_epi16(_mm256_maddubs_epi16(_mm256_sign_epi8(w, w), _mm256_sign_epi8(x, w)), _mm256_set1_epi16(1));
}

/* Q4_K / Q5_K's 12 bytes of scales and mins as 8 scales (bytes 0-7) and 8 mins (8-15) (llama.cpp's utmp) */
static inline void gg_unpack_k(const uint8_t *s, uint32_t u[4]) {
    memcpy(u, s, 12);
    u[3] = ((u[2] >> 4) & 0x0f0f0f0f) | (((u[1] >> 6) & 0x03030303) << 4);
    const uint32_t a = u[1] & 0x3f3f3f3f;
    u[1] = (u[2] & 0x0f0f0f0f) | (((u[0] >> 6) & 0x03030303) << 4);
    u[2] = a;
    u[0] &= 0x3f3f3f3f;
}

/* int16 element e of each 128-bit lane broadcast over it: _mm256_shuffle_epi8's mask (lo: the low lane's e, hi: the
   high lane's) */
AVX2 static inline __m256i gg_lane_mask(int lo, int hi) {
    return _mm256_set_m128i(_mm_set1_epi16((short)(2 * hi | (2 * hi + 1) << 8)), _mm_set1_epi16((short)(2 * lo | (2 * lo + 1) << 8)));
}

/* 32-value blocks: two float accumulators (even and odd blocks), so their FMAs do not wait on each other */
AVX2 static float gg_row_q8_0_avx2(int kind, const uint8_t *w, const GQ *x, int blocks) {
    const __m256i low4 = _mm256_set1_epi8(15), table = _mm256_broadcastsi128_si256(_mm_loadu_si128((const __m128i *)gg_iq4));
    __m256 acc[2] = {_mm256_setzero_ps(), _mm256_setzero_ps()};
    const int bytes = gg_bytes[kind];
    for (int b = 0; b < blocks; b++, w += bytes) {
        __m256i v;
        if (kind == GG_Q4_0) {
            const __m128i c = _mm_loadu_si128((const __m128i *)(w + 2));
            v = _mm256_sub_epi8(_mm256_and_si256(_mm256_set_m128i(_mm_srli_epi16(c, 4), c), low4), _mm256_set1_epi8(8));
        } else if (kind == GG_IQ4_NL) {
            const __m128i c = _mm_loadu_si128((const __m128i *)(w + 2));
            v = _mm256_shuffle_epi8(table, _mm256_and_si256(_mm256_set_m128i(_mm_srli_epi16(c, 4), c), low4));
        } else if (kind == GG_Q5_0) { /* llama.cpp's bytes_from_bits_32: byte j 0xF0 where bit j of qh is 0 */
            const __m128i c = _mm_loadu_si128((const __m128i *)(w + 6));
            uint32_t qh;
            memcpy(&qh, w + 2, 4);
            __m256i bits = _mm256_shuffle_epi8(_mm256_set1_epi32((int)qh), _mm256_set_epi64x(0x0303030303030303, 0x0202020202020202,
                                                                                              0x0101010101010101, 0));
            bits = _mm256_or_si256(bits, _mm256_set1_epi64x((long long)0x7fbfdfeff7fbfdfe));
            bits = _mm256_andnot_si256(_mm256_cmpeq_epi8(bits, _mm256_set1_epi64x(-1)), _mm256_set1_epi8((char)0xF0));
            v = _mm256_or_si256(_mm256_and_si256(_mm256_set_m128i(_mm_srli_epi16(c, 4), c), low4), bits);
        } else {
            v = _mm256_loadu_si256((const __m256i *)(w + 2));
        }
        const __m256 p = _mm256_cvtepi32_ps(gg_dot_i8(v, _mm256_loadu_si256((const __m256i *)(x->q + 32 * b))));
        acc[b & 1] = _mm256_fmadd_ps(p, _mm256_set1_ps(gg_half(w) * x->d[b]), acc[b & 1]);
    }
    return gg_hsum_ps(_mm256_add_ps(acc[0], acc[1]));
}

/* 32-value blocks with VNNI, np (<= GG_POSITIONS) positions at once: unsigned codes against the activations in one
   vpdpbusd from the lanes' correction (gg_pair_layout); Q4_0 a block pair at a time, its two blocks' scales in the
   low and high lanes. A row's codes are unpacked once for the positions; each position's sums are its own, in the
   same order whatever np (two accumulators, alternate blocks or pairs): a position gives the same bits alone. */
VNNI static void gg_rows_q8_0_vnni(int kind, const uint8_t *w, const GQ *x, int np, int blocks, float *out) {
    const __m256i low4 = _mm256_set1_epi8(15), flip = _mm256_set1_epi8((char)0x80);
    __m256 acc[GG_POSITIONS][2];
    for (int p = 0; p < np; p++) acc[p][0] = acc[p][1] = _mm256_setzero_ps();
    if (kind == GG_Q8_0) {
        for (int b = 0; b < blocks; b++, w += 34) {
            const __m256i c = _mm256_xor_si256(_mm256_loadu_si256((const __m256i *)(w + 2)), flip);
            const float dw = gg_half(w);
            for (int p = 0; p < np; p++) {
                const GQ *g = x + p;
                const __m256i s = _mm256_dpbusd_avx_epi32(_mm256_loadu_si256((const __m256i *)(g->corr + 8 * b)), c,
                                                          _mm256_loadu_si256((const __m256i *)(g->q + 32 * b)));
                acc[p][b & 1] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(s), _mm256_set1_ps(dw * g->d[b]), acc[p][b & 1]);
            }
        }
    } else {
        for (int b = 0; b < blocks; b += 2, w += 36) {
            const int two = b + 1 < blocks; /* (a last odd block: the low lanes of its pair) */
            const __m128i c0 = _mm_loadu_si128((const __m128i *)(w + 2));
            const __m256i v = two ? _mm256_set_m128i(_mm_loadu_si128((const __m128i *)(w + 20)), c0) : _mm256_castsi128_si256(c0);
            const __m256i lo = _mm256_and_si256(v, low4), hi = _mm256_and_si256(_mm256_srli_epi16(v, 4), low4);
            const float d0 = gg_half(w), d1 = two ? gg_half(w + 18) : 0.0f;
            for (int p = 0; p < np; p++) {
                const GQ *g = x + p;
                const int8_t *q = g->qp + 32 * b;
                __m256i s = _mm256_loadu_si256((const __m256i *)(g->corr + 4 * b));
                s = _mm256_dpbusd_avx_epi32(s, lo, _mm256_loadu_si256((const __m256i *)q));
                s = _mm256_dpbusd_avx_epi32(s, hi, _mm256_loadu_si256((const __m256i *)(q + 32)));
                const __m256 sc = _mm256_set_m128(_mm_set1_ps(two ? d1 * g->d[b + 1] : 0.0f), _mm_set1_ps(d0 * g->d[b]));
                acc[p][(b >> 1) & 1] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(s), sc, acc[p][(b >> 1) & 1]);
            }
        }
    }
    for (int p = 0; p < np; p++) out[p] = gg_hsum_ps(_mm256_add_ps(acc[p][0], acc[p][1]));
}

/* Q4_K / Q5_K block b's mins against x's: sum_j m_j (xsum of its 32), from the 16 sums of 16 added in pairs (sc: the
   unpacked scales, mins at 8-15) */
AVX2 static inline int gg_k_mins(const GQ *x, int b, const uint8_t *sc) {
    const __m256i bs = _mm256_loadu_si256((const __m256i *)(x->bsum + 16 * b));
    const __m128i pairs = _mm_hadd_epi16(_mm256_castsi256_si128(bs), _mm256_extracti128_si256(bs, 1));
    return gg_hsum_epi32(_mm_madd_epi16(_mm_cvtepu8_epi16(_mm_loadl_epi64((const __m128i *)(sc + 8))), pairs));
}

/* Q6_K block b's codes' offset of 32 against x's, in 8 int32 lanes: 32 sum_j sc_j xsum_j, from the 16 scales and the
   16 sums of 16 */
AVX2 static inline __m256i gg_q6k_offset(const uint8_t *w, const GQ *x, int b) {
    const __m256i sc16 = _mm256_cvtepi8_epi16(_mm_loadu_si128((const __m128i *)(w + 192)));
    return _mm256_slli_epi32(_mm256_madd_epi16(sc16, _mm256_loadu_si256((const __m256i *)(x->bsum + 16 * b))), 5);
}

/* (inlined into gg_row_q8_avx2 once per kind: each loop's branches on the type resolved where it is compiled) */
AVX2 static inline __attribute__((always_inline)) float gg_row_k_avx2(int kind, const uint8_t *w, const GQ *x, int blocks) {
    const int bytes = gg_bytes[kind];
    const __m256i low4 = _mm256_set1_epi8(15), low2 = _mm256_set1_epi8(3), one = _mm256_set1_epi8(1);
    const __m256i table = _mm256_broadcastsi128_si256(_mm_loadu_si128((const __m128i *)gg_iq4));
    __m256 acc = _mm256_setzero_ps();
    float mins = 0;
    for (int b = 0; b < blocks; b++, w += bytes) {
        const int8_t *q = x->q + gg_values[kind] * b;
        if (kind == GG_Q6_K) {
            __m256i ia = _mm256_setzero_si256();
            for (int h = 0; h < 2; h++) {
                const __m256i qa = _mm256_loadu_si256((const __m256i *)(w + 64 * h));
                const __m256i qb = _mm256_loadu_si256((const __m256i *)(w + 64 * h + 32));
                const __m256i qh = _mm256_loadu_si256((const __m256i *)(w + 128 + 32 * h));
                const __m256i lo[4] = {_mm256_and_si256(qa, low4), _mm256_and_si256(qb, low4),
                                       _mm256_and_si256(_mm256_srli_epi16(qa, 4), low4),
                                       _mm256_and_si256(_mm256_srli_epi16(qb, 4), low4)};
                const __m128i s8 = _mm_cvtepi8_epi16(_mm_loadl_epi64((const __m128i *)(w + 192 + 8 * h)));
                const __m256i scales = _mm256_set_m128i(s8, s8); /* this half's 8 sub-blocks' scales */
                for (int i = 0; i < 4; i++) {
                    const __m256i hi = _mm256_slli_epi16(_mm256_and_si256(_mm256_srli_epi16(qh, 2 * i), low2), 4);
                    /* sub-blocks 2i (values l < 16: the low lane) and 2i + 1 of the half */
                    const __m256i sc = _mm256_shuffle_epi8(scales, gg_lane_mask(2 * i, 2 * i + 1));
                    const __m256i p = _mm256_maddubs_epi16(_mm256_or_si256(lo[i], hi), _mm256_loadu_si256((const __m256i *)(q + 128 * h + 32 * i)));
                    ia = _mm256_add_epi32(ia, _mm256_madd_epi16(p, sc));
                }
            }
            ia = _mm256_sub_epi32(ia, gg_q6k_offset(w, x, b));
            acc = _mm256_fmadd_ps(_mm256_cvtepi32_ps(ia), _mm256_set1_ps(x->d[b] * gg_half(w + 208)), acc);
        } else if (kind == GG_IQ4_XS) {
            __m256i ia = _mm256_setzero_si256();
            for (int j = 0; j < 8; j++) { /* sub-block j: its 16 bytes' low nibbles (the low lane), then high ones */
                const __m128i c = _mm_loadu_si128((const __m128i *)(w + 8 + 16 * j));
                const __m256i v = _mm256_shuffle_epi8(table, _mm256_and_si256(_mm256_set_m128i(_mm_srli_epi16(c, 4), c), low4));
                const __m256i xq = _mm256_loadu_si256((const __m256i *)(q + 32 * j));
                const __m256i p = _mm256_maddubs_epi16(_mm256_sign_epi8(v, v), _mm256_sign_epi8(xq, v));
                ia = _mm256_add_epi32(ia, _mm256_madd_epi16(p, _mm256_set1_epi16((short)gg_iq4xs_scale(w, j))));
            }
            acc = _mm256_fmadd_ps(_mm256_cvtepi32_ps(ia), _mm256_set1_ps(x->d[b] * gg_half(w)), acc);
        } else if (kind == GG_Q2_K || kind == GG_Q3_K) {
            /* 16 sub-blocks of 16: half h's 8 scales broadcast over both lanes, chunk s of its 32 bytes' bits 2s
               (values 128h + 32s + l: sub-block 8h + 2s in the low lane, 8h + 2s + 1 in the high one) */
            __m128i s8;
            if (kind == GG_Q2_K) {
                s8 = _mm_and_si128(_mm_loadu_si128((const __m128i *)w), _mm_set1_epi8(15));
            } else { /* gg_q3_scale of the 16, 4 at a time (llama.cpp's) */
                uint32_t a[3];
                memcpy(a, w + 96, 12);
                const uint32_t lo = 0x0f0f0f0f, hi = 0x03030303;
                s8 = _mm_sub_epi8(_mm_set_epi32((int)(((a[1] >> 4) & lo) | (((a[2] >> 6) & hi) << 4)),
                                                (int)(((a[0] >> 4) & lo) | (((a[2] >> 4) & hi) << 4)),
                                                (int)((a[1] & lo) | (((a[2] >> 2) & hi) << 4)), (int)((a[0] & lo) | ((a[2] & hi) << 4))),
                                  _mm_set1_epi8(32));
            }
            const __m256i all = _mm256_cvtepi8_epi16(s8);
            const __m256i scales[2] = {_mm256_broadcastsi128_si256(_mm256_castsi256_si128(all)),
                                       _mm256_broadcastsi128_si256(_mm256_extracti128_si256(all, 1))};
            const __m256i hbits = _mm256_loadu_si256((const __m256i *)w); /* (Q3_K's) */
            __m256i ia = _mm256_setzero_si256();
            for (int h = 0; h < 2; h++) {
                const __m256i bits = _mm256_loadu_si256((const __m256i *)(w + (kind == GG_Q2_K ? 16 : 32) + 32 * h));
                for (int c = 0; c < 4; c++) {
                    __m256i u = _mm256_and_si256(_mm256_srli_epi16(bits, 2 * c), low2);
                    if (kind == GG_Q3_K) /* Q3_K's code + 4: the high bit above the low two */
                        u = _mm256_or_si256(u, _mm256_slli_epi16(_mm256_and_si256(_mm256_srli_epi16(hbits, 4 * h + c), one), 2));
                    const __m256i p = _mm256_maddubs_epi16(u, _mm256_loadu_si256((const __m256i *)(q + 128 * h + 32 * c)));
                    ia = _mm256_add_epi32(ia, _mm256_madd_epi16(p, _mm256_shuffle_epi8(scales[h], gg_lane_mask(2 * c, 2 * c + 1))));
                }
            }
            if (kind == GG_Q3_K) /* the codes' offset of 4: 4 sum_j sc_j xsum_j */
                ia = _mm256_sub_epi32(ia, _mm256_slli_epi32(_mm256_madd_epi16(all, _mm256_loadu_si256((const __m256i *)(x->bsum + 16 * b))), 2));
            acc = _mm256_fmadd_ps(_mm256_cvtepi32_ps(ia), _mm256_set1_ps(x->d[b] * gg_half(w + gg_d_at[kind])), acc);
            if (kind == GG_Q2_K) { /* the mins: sum_j m_j (xsum of its 16) */
                const __m128i m8 = _mm_and_si128(_mm_srli_epi16(_mm_loadu_si128((const __m128i *)w), 4), _mm_set1_epi8(15));
                const __m256i mn = _mm256_madd_epi16(_mm256_cvtepu8_epi16(m8), _mm256_loadu_si256((const __m256i *)(x->bsum + 16 * b)));
                const int m = gg_hsum_epi32(_mm_add_epi32(_mm256_castsi256_si128(mn), _mm256_extracti128_si256(mn, 1)));
                mins += x->d[b] * gg_half(w + 82) * (float)m;
            }
        } else {
            uint32_t u[4];
            gg_unpack_k(w + 4, u);
            const uint8_t *sc = (const uint8_t *)u, *qs = w + (kind == GG_Q4_K ? 16 : 48);
            const __m128i s8 = _mm_cvtepu8_epi16(_mm_loadl_epi64((const __m128i *)sc));
            const __m256i scales = _mm256_set_m128i(s8, s8);
            const __m256i qh = _mm256_loadu_si256((const __m256i *)(w + 16));
            __m256i ia = _mm256_setzero_si256();
            for (int c = 0; c < 4; c++) {
                const __m256i v = _mm256_loadu_si256((const __m256i *)(qs + 32 * c));
                __m256i lo = _mm256_and_si256(v, low4), hi = _mm256_and_si256(_mm256_srli_epi16(v, 4), low4);
                if (kind == GG_Q5_K) {
                    lo = _mm256_or_si256(lo, _mm256_slli_epi16(_mm256_and_si256(_mm256_srli_epi16(qh, 2 * c), one), 4));
                    hi = _mm256_or_si256(hi, _mm256_slli_epi16(_mm256_and_si256(_mm256_srli_epi16(qh, 2 * c + 1), one), 4));
                }
                const __m256i pl = _mm256_maddubs_epi16(lo, _mm256_loadu_si256((const __m256i *)(q + 64 * c)));
                const __m256i ph = _mm256_maddubs_epi16(hi, _mm256_loadu_si256((const __m256i *)(q + 64 * c + 32)));
                ia = _mm256_add_epi32(ia, _mm256_madd_epi16(pl, _mm256_shuffle_epi8(scales, gg_lane_mask(2 * c, 2 * c))));
                ia = _mm256_add_epi32(ia, _mm256_madd_epi16(ph, _mm256_shuffle_epi8(scales, gg_lane_mask(2 * c + 1, 2 * c + 1))));
            }
            acc = _mm256_fmadd_ps(_mm256_cvtepi32_ps(ia), _mm256_set1_ps(x->d[b] * gg_half(w)), acc);
            mins += x->d[b] * gg_half(w + 2) * (float)gg_k_mins(x, b, sc);
        }
    }
    return gg_hsum_ps(acc) - mins;
}

AVX2 static float gg_row_q8_avx2(int kind, const uint8_t *w, const GQ *x, int blocks) {
    switch (kind) {
    case GG_Q4_K: return gg_row_k_avx2(GG_Q4_K, w, x, blocks);
    case GG_Q5_K: return gg_row_k_avx2(GG_Q5_K, w, x, blocks);
    case GG_Q6_K: return gg_row_k_avx2(GG_Q6_K, w, x, blocks);
    case GG_Q2_K: return gg_row_k_avx2(GG_Q2_K, w, x, blocks);
    case GG_Q3_K: return gg_row_k_avx2(GG_Q3_K, w, x, blocks);
    case GG_IQ4_XS: return gg_row_k_avx2(GG_IQ4_XS, w, x, blocks);
    default: return gg_row_q8_0_avx2(kind, w, x, blocks);
    }
}

/* The AVX-512 loops of Q4_K, Q5_K and Q6_K: two of the AVX2 loop's 32-byte products in one register, its halves
   added before the block's scales meet them. Each int32 lane then sums the same integers as the AVX2 loop's lane,
   so the two loops give the same bits. */
AVX512 static inline __attribute__((always_inline)) float gg_row_k_avx512(int kind, const uint8_t *w, const GQ *x, int blocks) {
    const int bytes = gg_bytes[kind];
    const __m512i low4 = _mm512_set1_epi8(15), low2 = _mm512_set1_epi8(3), one = _mm512_set1_epi8(1);
    __m256 acc = _mm256_setzero_ps();
    float mins = 0;
    for (int b = 0; b < blocks; b++, w += bytes) {
        const int8_t *q = x->q + 256 * b;
        __m512i ia2 = _mm512_setzero_si512();
        if (kind == GG_Q6_K) {
            for (int h = 0; h < 2; h++) {
                const __m512i qab = _mm512_loadu_si512(w + 64 * h); /* the AVX2 loop's qa and qb */
                const __m512i qh = _mm512_broadcast_i64x4(_mm256_loadu_si256((const __m256i *)(w + 128 + 32 * h)));
                const __m512i s16 = _mm512_castsi128_si512(_mm_cvtepi8_epi16(_mm_loadl_epi64((const __m128i *)(w + 192 + 8 * h))));
                for (int p = 0; p < 2; p++) { /* the AVX2 loop's i = 2p and 2p + 1, its sub-blocks' scales by 128-bit lane */
                    const __m512i lo = _mm512_and_si512(p ? _mm512_srli_epi16(qab, 4) : qab, low4);
                    const __m512i shift = _mm512_inserti64x4(_mm512_set1_epi16((short)(4 * p)), _mm256_set1_epi16((short)(4 * p + 2)), 1);
                    const __m512i hi = _mm512_slli_epi16(_mm512_and_si512(_mm512_srlv_epi16(qh, shift), low2), 4);
                    const __m512i idx = _mm512_inserti64x4(
                        _mm512_castsi256_si512(_mm256_set_m128i(_mm_set1_epi16((short)(4 * p + 1)), _mm_set1_epi16((short)(4 * p)))),
                        _mm256_set_m128i(_mm_set1_epi16((short)(4 * p + 3)), _mm_set1_epi16((short)(4 * p + 2))), 1);
                    const __m512i prod = _mm512_maddubs_epi16(_mm512_or_si512(lo, hi), _mm512_loadu_si512(q + 128 * h + 64 * p));
                    ia2 = _mm512_add_epi32(ia2, _mm512_madd_epi16(prod, _mm512_permutexvar_epi16(idx, s16)));
                }
            }
        } else {
            uint32_t u[4];
            gg_unpack_k(w + 4, u);
            const uint8_t *sc = (const uint8_t *)u, *qs = w + (kind == GG_Q4_K ? 16 : 48);
            const __m512i s16 = _mm512_castsi128_si512(_mm_cvtepu8_epi16(_mm_loadl_epi64((const __m128i *)sc)));
            const __m512i qh = _mm512_broadcast_i64x4(_mm256_loadu_si256((const __m256i *)(w + 16)));
            for (int c = 0; c < 4; c++) { /* sub-blocks 2c (the low half) and 2c + 1 */
                const __m256i v = _mm256_loadu_si256((const __m256i *)(qs + 32 * c));
                __m512i codes = _mm512_and_si512(_mm512_inserti64x4(_mm512_castsi256_si512(v), _mm256_srli_epi16(v, 4), 1), low4);
                if (kind == GG_Q5_K) {
                    const __m512i shift = _mm512_inserti64x4(_mm512_set1_epi16((short)(2 * c)), _mm256_set1_epi16((short)(2 * c + 1)), 1);
                    codes = _mm512_or_si512(codes, _mm512_slli_epi16(_mm512_and_si512(_mm512_srlv_epi16(qh, shift), one), 4));
                }
                const __m512i idx = _mm512_inserti64x4(_mm512_set1_epi16((short)(2 * c)), _mm256_set1_epi16((short)(2 * c + 1)), 1);
                const __m512i prod = _mm512_maddubs_epi16(codes, _mm512_loadu_si512(q + 64 * c));
                ia2 = _mm512_add_epi32(ia2, _mm512_madd_epi16(prod, _mm512_permutexvar_epi16(idx, s16)));
            }
            mins += x->d[b] * gg_half(w + 2) * (float)gg_k_mins(x, b, sc);
        }
        __m256i ia = _mm256_add_epi32(_mm512_castsi512_si256(ia2), _mm512_extracti64x4_epi64(ia2, 1));
        if (kind == GG_Q6_K) {
            ia = _mm256_sub_epi32(ia, gg_q6k_offset(w, x, b));
        }
        acc = _mm256_fmadd_ps(_mm256_cvtepi32_ps(ia), _mm256_set1_ps(x->d[b] * gg_half(w + gg_d_at[kind])), acc);
    }
    return gg_hsum_ps(acc) - mins;
}

AVX512 static float gg_row_q8_avx512(int kind, const uint8_t *w, const GQ *x, int blocks) {
    switch (kind) {
    case GG_Q4_K: return gg_row_k_avx512(GG_Q4_K, w, x, blocks);
    case GG_Q5_K: return gg_row_k_avx512(GG_Q5_K, w, x, blocks);
    case GG_Q6_K: return gg_row_k_avx512(GG_Q6_K, w, x, blocks);
    default: return gg_row_q8_avx2(kind, w, x, blocks);
    }
}
#endif

/* One row against np positions (x[0..np-1]), int8: each position's the bits it has alone */
static void gg_rows_q8(int kind, const uint8_t *w, const GQ *x, int np, int blocks, int simd, float *out) {
#if HAVE_X86
    if (simd && x->corr) {
        for (int p = 0; p < np; p += GG_POSITIONS)
            gg_rows_q8_0_vnni(kind, w, x + p, np - p < GG_POSITIONS ? np - p : GG_POSITIONS, blocks, out + p);
        return;
    }
    if (simd) {
        const int wide = use_avx512();
        for (int p = 0; p < np; p++) out[p] = wide ? gg_row_q8_avx512(kind, w, x + p, blocks) : gg_row_q8_avx2(kind, w, x + p, blocks);
        return;
    }
#endif
    (void)simd;
    for (int p = 0; p < np; p++) out[p] = gg_row_q8_scalar(kind, w, x + p, blocks);
}

/* Block b of a row dequantised (format/ggml.py's arithmetic, value by value) */
static void gg_dequantize(int kind, const uint8_t *w, float *out) {
    if (kind == GG_Q4_0) {
        const float d = gg_f16(w);
        for (int i = 0; i < 16; i++) {
            out[i] = d * (float)((w[2 + i] & 15) - 8);
            out[i + 16] = d * (float)((w[2 + i] >> 4) - 8);
        }
    } else if (kind == GG_Q8_0) {
        const float d = gg_f16(w);
        for (int i = 0; i < 32; i++) out[i] = d * (float)(int8_t)w[2 + i];
    } else if (kind == GG_Q6_K) {
        const float d = gg_f16(w + 208);
        for (int i = 0; i < 256; i++) out[i] = d * (float)(int8_t)w[192 + i / 16] * (float)(gg_code(kind, w, i) - 32);
    } else if (kind == GG_IQ4_NL || kind == GG_Q5_0) {
        const float d = gg_f16(w);
        for (int i = 0; i < 32; i++) out[i] = d * (float)gg_code(kind, w, i);
    } else if (kind == GG_Q2_K) {
        const float d = gg_f16(w + 80), dmin = gg_f16(w + 82);
        for (int j = 0; j < 16; j++) {
            const float d1 = d * (float)(w[j] & 15), m1 = dmin * (float)(w[j] >> 4);
            for (int i = 16 * j; i < 16 * j + 16; i++) out[i] = d1 * (float)gg_code(kind, w, i) - m1;
        }
    } else if (kind == GG_Q3_K || kind == GG_IQ4_XS) {
        const int sub = kind == GG_Q3_K ? 16 : 32;
        const float d = gg_f16(w + gg_d_at[kind]);
        for (int j = 0; j < 256 / sub; j++) {
            const float d1 = d * (float)(kind == GG_Q3_K ? gg_q3_scale(w + 96, j) : gg_iq4xs_scale(w, j));
            for (int i = sub * j; i < sub * j + sub; i++) out[i] = d1 * (float)gg_code(kind, w, i);
        }
    } else {
        const float d = gg_f16(w), dmin = gg_f16(w + 2);
        for (int j = 0; j < 8; j++) {
            int sc, m;
            gg_scale_min(w + 4, j, &sc, &m);
            const float d1 = d * (float)sc, m1 = dmin * (float)m;
            for (int i = 32 * j; i < 32 * j + 32; i++) out[i] = d1 * (float)gg_code(kind, w, i) - m1;
        }
    }
}

/* One row against one position, float: value by value in order */
static float gg_row_f32(int kind, const uint8_t *w, const float *x, int blocks) {
    float v[256], acc = 0;
    const int values = gg_values[kind];
    for (int b = 0; b < blocks; b++) {
        gg_dequantize(kind, w + (Py_ssize_t)gg_bytes[kind] * b, v);
        for (int i = 0; i < values; i++) acc += v[i] * x[values * b + i];
    }
    return acc;
}

typedef struct {
    const uint8_t *w;     /* rows at w + row * stride (slots) or at addresses ptrs[j] */
    Py_ssize_t stride;
    const int32_t *slots; /* NULL: rows 0..k-1 */
    const int64_t *ptrs;
    Py_ssize_t offs[4];   /* each matrix's offset in a row (gate and up of one unit: two) */
    int n_mat, kind, n;
    Py_ssize_t k;
} GRows;

static inline const uint8_t *g_row(const GRows *r, Py_ssize_t j, int t) {
    return (r->ptrs ? (const uint8_t *)(uintptr_t)r->ptrs[j] : r->w + (r->slots ? r->slots[j] : j) * r->stride) + r->offs[t];
}

/* m positions' activations quantised for rows of `kind` (block_dot's int8 path; none where int8_allowed is off) */
typedef struct {
    GQ *g;
    int8_t *q, *qp;
    float *d;
    int16_t *bs;
    int32_t *corr;
} GQs;

static void gq_prepare(GQs *s, int kind, const float *x, int n, int m, int simd) {
    memset(s, 0, sizeof(*s));
    if (!int8_allowed) return;
    const int blocks = n / gg_values[kind];
    const size_t pairs = (size_t)(blocks + 1) / 2;
    const int vnni = simd && kind <= GG_Q8_0 && cpu_has_vnni();
    /* (alloc64 ends the process rather than return NULL) */
    s->q = alloc64((size_t)m * n), s->d = alloc64((size_t)m * blocks * sizeof(float));
    s->bs = alloc64((size_t)m * n / 16 * sizeof(int16_t)), s->g = alloc64(m * sizeof(GQ));
    if (vnni) s->qp = alloc64(m * pairs * 64), s->corr = alloc64((size_t)m * blocks * 8 * sizeof(int32_t));
    for (int p = 0; p < m; p++) {
        s->g[p] = (GQ){s->q + (size_t)p * n, s->d + (size_t)p * blocks, s->bs + (size_t)p * n / 16, NULL, NULL};
        gg_quantize(kind, x + (size_t)p * n, n, &s->g[p]);
        if (vnni) {
            s->g[p].qp = s->qp + p * pairs * 64, s->g[p].corr = s->corr + (size_t)p * blocks * 8;
            gg_pair_layout(kind, n, &s->g[p]);
        }
    }
}

static void gq_free(GQs *s) { free(s->q), free(s->d), free(s->bs), free(s->g), free(s->qp), free(s->corr); }

/* out[p * step] = x[p] . row w (n values of `kind`) for m positions: int8 against `s` where it holds them (the bits
   each position has alone), else float */
static void gg_dot_row(int kind, const uint8_t *w, const float *x, const GQs *s, int m, int n, int simd, float *out,
                       Py_ssize_t step) {
    const int blocks = n / gg_values[kind];
    for (int p0 = 0; p0 < m; p0 += GG_POSITIONS) {
        const int np = m - p0 < GG_POSITIONS ? m - p0 : GG_POSITIONS;
        float sums[GG_POSITIONS];
        if (s->g) gg_rows_q8(kind, w, s->g + p0, np, blocks, simd, sums);
        else
            for (int p = 0; p < np; p++) sums[p] = gg_row_f32(kind, w, x + (Py_ssize_t)(p0 + p) * n, blocks);
        for (int p = 0; p < np; p++) out[(p0 + p) * step] = sums[p];
    }
}

static inline int gg_threads(Py_ssize_t work) {
    Py_ssize_t nt = work / MIN_WORK_PER_THREAD;
#ifdef _OPENMP
    nt = nt < 1 ? 1 : (nt > omp_get_max_threads() ? omp_get_max_threads() : nt);
#endif
    return (int)nt;
}

/* out[p, j, t] = x[p] . matrix t's row j (m positions; each row's bytes read once for all) */
static void block_dot_impl(const GRows *r, const float *x, float *out, int m) {
    const int simd = simd_allowed && cpu_has_avx2();
    GQs s;
    gq_prepare(&s, r->kind, x, r->n, m, simd);
    const int nt = gg_threads(r->k * r->n_mat * (Py_ssize_t)r->n * m);
    (void)nt;
#pragma omp parallel for schedule(static) num_threads(nt)
    for (Py_ssize_t j = 0; j < r->k; j++)
        for (int t = 0; t < r->n_mat; t++)
            gg_dot_row(r->kind, g_row(r, j, t), x, &s, m, r->n, simd, out + j * r->n_mat + t, r->k * r->n_mat);
    gq_free(&s);
}

/* A SwiGLU expert of GGML blocks (experts.py's units) for m positions, each of E experts whose rows start at
   address bases[e]: gate and up `hidden` rows of n values of kind_gu at +gate / +up, down n_out rows of
   hidden values of kind_down at +down.  out[e, p] = down (silu(gate x[p]) * up x[p]): block_dot of gate and up (side
   by side), glu_pairs' arithmetic, block_dot of down, in one pass over all the experts (x quantised once). */
typedef struct {
    const int64_t *bases; /* each expert's row, by address */
    Py_ssize_t gate, up, down;
    int E, hidden, n, n_out, kind_gu, kind_down;
} Experts;

static void expert_glu_impl(const Experts *X, const float *x, float *out, int m) {
    const int simd = simd_allowed && cpu_has_avx2();
    const Py_ssize_t gu_row = (Py_ssize_t)X->n / gg_values[X->kind_gu] * gg_bytes[X->kind_gu];
    const Py_ssize_t down_row = (Py_ssize_t)X->hidden / gg_values[X->kind_down] * gg_bytes[X->kind_down];
    const Py_ssize_t H = (Py_ssize_t)X->E * m * X->hidden; /* h[e, p, i] */
    float *gu = alloc64(3 * H * sizeof(float)); /* gate and up side by side, then h */
    GQs s;
    gq_prepare(&s, X->kind_gu, x, X->n, m, simd);
    int nt = gg_threads(2 * H * X->n);
    (void)nt;
#pragma omp parallel for schedule(static) num_threads(nt)
    for (Py_ssize_t r = 0; r < (Py_ssize_t)X->E * X->hidden; r++) {
        const Py_ssize_t e = r / X->hidden, i = r % X->hidden;
        const uint8_t *base = (const uint8_t *)(uintptr_t)X->bases[e];
        float *o = gu + 2 * (e * m * X->hidden + i);
        gg_dot_row(X->kind_gu, base + X->gate + i * gu_row, x, &s, m, X->n, simd, o, 2 * X->hidden);
        gg_dot_row(X->kind_gu, base + X->up + i * gu_row, x, &s, m, X->n, simd, o + 1, 2 * X->hidden);
    }
    gq_free(&s);
    float *h = gu + 2 * H; /* glu_pairs' arithmetic (not in place: the threads split the elements) */
    silu_mul_into(h, gu, gu + 1, 2, H);
    gq_prepare(&s, X->kind_down, h, X->hidden, X->E * m, simd);
    nt = gg_threads((Py_ssize_t)X->E * m * X->n_out * X->hidden);
#pragma omp parallel for schedule(static) num_threads(nt)
    for (Py_ssize_t r = 0; r < (Py_ssize_t)X->E * X->n_out; r++) {
        const Py_ssize_t e = r / X->n_out, j = r % X->n_out;
        GQs one = s; /* expert e's m positions */
        if (s.g) one.g = s.g + e * m;
        gg_dot_row(X->kind_down, (const uint8_t *)(uintptr_t)X->bases[e] + X->down + j * down_row, h + e * m * X->hidden, &one, m,
                   X->hidden, simd, out + e * m * X->n_out + j, X->n_out);
    }
    gq_free(&s);
    free(gu);
}

/* block_dot(x, out, w, offs, stride, slots, k, n, kind) */
static PyObject *py_block_dot(PyObject *self, PyObject *args) {
    (void)self;
    PyObject *x, *out, *w, *offs, *slots;
    GRows r;
    memset(&r, 0, sizeof(r));
    if (!PyArg_ParseTuple(args, "OOOOnOnii", &x, &out, &w, &offs, &r.stride, &slots, &r.k, &r.n, &r.kind)) return NULL;
    if (r.kind < 0 || r.kind >= GG_TYPES || r.n <= 0 || r.n % gg_values[r.kind] || r.n / gg_values[r.kind] > GG_MAX_BLOCKS ||
        r.k < 0 || r.stride < 0) {
        PyErr_Format(PyExc_ValueError, "block_dot: bad shape (n=%d, k=%zd, kind %d, stride %zd)", r.n, r.k, r.kind, r.stride);
        return NULL;
    }
    PyObject *seq = PySequence_Fast(offs, "block_dot: offs must be a sequence of byte offsets");
    if (seq == NULL) return NULL;
    r.n_mat = (int)PySequence_Fast_GET_SIZE(seq);
    for (int t = 0; t < r.n_mat && t < 4; t++) r.offs[t] = PyLong_AsSsize_t(PySequence_Fast_GET_ITEM(seq, t));
    Py_DECREF(seq);
    if (PyErr_Occurred()) return NULL;
    if (r.n_mat < 1 || r.n_mat > 4) {
        PyErr_SetString(PyExc_ValueError, "block_dot: 1 to 4 matrices a row");
        return NULL;
    }
    Buffers B;
    memset(&B, 0, sizeof(B));
    PyObject *result = NULL;
    Py_ssize_t max_row;
    Rows shape = {.k = r.k};
    if (get(&B, 0, x, 0, "vector") || get(&B, 1, out, 1, "out") || get(&B, 2, w, 0, "weights") ||
        parse_slots(&B, &shape, slots, "block_dot", &max_row))
        goto done;
    r.slots = shape.slots, r.ptrs = shape.ptrs;
    const Py_ssize_t row = (Py_ssize_t)r.n / gg_values[r.kind] * gg_bytes[r.kind];
    for (int t = 0; t < r.n_mat; t++)
        if (r.offs[t] < 0 || (max_row >= 0 && r.offs[t] + max_row * r.stride + row > B.views[2].len)) {
            PyErr_Format(PyExc_IndexError, "block_dot: row %zd of matrix %d (offset %zd, stride %zd, %zd bytes) is outside its %zd-byte buffer",
                         max_row, t, r.offs[t], r.stride, row, B.views[2].len);
            goto done;
        }
    r.w = B.views[2].buf;
    const int m = (int)(B.views[0].len / ((Py_ssize_t)r.n * 4));
    if (m < 1 || B.views[0].len != (Py_ssize_t)m * r.n * 4 || B.views[1].len != (Py_ssize_t)m * r.k * r.n_mat * 4) {
        PyErr_Format(PyExc_ValueError, "block_dot: vector has %zd bytes and out %zd, expected float32 [m, %d] and [m, %zd, %d]",
                     B.views[0].len, B.views[1].len, r.n, r.k, r.n_mat);
        goto done;
    }
    Py_BEGIN_ALLOW_THREADS block_dot_impl(&r, (const float *)B.views[0].buf, (float *)B.views[1].buf, m);
    Py_END_ALLOW_THREADS result = Py_None;
    Py_INCREF(result);
done:
    release(&B);
    return result;
}

/* expert_glu(x, out, addresses, gate, up, down, hidden, n, n_out, kind_gu, kind_down): expert_glu_impl over the
   experts whose rows start at addresses[e] (int64: rows in buffers the caller holds) */
static PyObject *py_expert_glu(PyObject *self, PyObject *args) {
    (void)self;
    PyObject *x, *out, *addresses;
    Experts X;
    memset(&X, 0, sizeof(X));
    if (!PyArg_ParseTuple(args, "OOOnnniiiii", &x, &out, &addresses, &X.gate, &X.up, &X.down, &X.hidden, &X.n, &X.n_out,
                          &X.kind_gu, &X.kind_down))
        return NULL;
    const int kinds_ok = X.kind_gu >= 0 && X.kind_gu < GG_TYPES && X.kind_down >= 0 && X.kind_down < GG_TYPES;
    if (!kinds_ok || X.n <= 0 || X.hidden <= 0 || X.n_out <= 0 || X.n % gg_values[X.kind_gu] ||
        X.hidden % gg_values[X.kind_down] || X.n / gg_values[X.kind_gu] > GG_MAX_BLOCKS ||
        X.hidden / gg_values[X.kind_down] > GG_MAX_BLOCKS) {
        PyErr_Format(PyExc_ValueError, "expert_glu: bad shape (n=%d, hidden=%d, n_out=%d, kinds %d, %d)", X.n, X.hidden,
                     X.n_out, X.kind_gu, X.kind_down);
        return NULL;
    }
    Buffers B;
    memset(&B, 0, sizeof(B));
    PyObject *result = NULL;
    if (get(&B, 0, x, 0, "x") || get(&B, 1, out, 1, "out") || get(&B, 5, addresses, 0, "addresses")) goto done;
    X.E = (int)(B.views[5].len / 8);
    const int m = (int)(B.views[0].len / ((Py_ssize_t)X.n * 4));
    if (B.views[5].itemsize != 8 || m < 1 || B.views[0].len != (Py_ssize_t)m * X.n * 4 ||
        B.views[1].len != (Py_ssize_t)X.E * m * X.n_out * 4) {
        PyErr_Format(PyExc_ValueError, "expert_glu: x has %zd bytes and out %zd, expected float32 [m, %d] and [%d, m, %d] "
                     "(int64 addresses)", B.views[0].len, B.views[1].len, X.n, X.E, X.n_out);
        goto done;
    }
    X.bases = (const int64_t *)B.views[5].buf;
    if (X.E) {
        Py_BEGIN_ALLOW_THREADS expert_glu_impl(&X, (const float *)B.views[0].buf, (float *)B.views[1].buf, m);
        Py_END_ALLOW_THREADS
    }
    result = Py_None;
    Py_INCREF(result);
done:
    release(&B);
    return result;
}

/* -- one attention block of a decode step, natively ---------------------------------------
   A llama-style block for m tokens at positions pos..pos+m-1 (MLX's ops would cost ~15 dispatches and a
   synchronisation), causal: the token at position t attends to 0..t.

       h = rms_norm(x) * norm1;  q, k, v = Wq h, Wk h, Wv h;  [qwen3: q, k = rms_norm per head * q_norm, k_norm]
       rope(q, k) at t;  K[t], V[t] = k, v
       a_head = softmax(scale q_head . K[0..t]) V[0..t]         (kv head = head / (n_heads / n_kv))
       x += Wo a;  h2 = rms_norm(x) * norm2                     (the FFN's input)

   Wq..Wo are `linear` handles: quantised rows bound once (their buffers held until the handle goes). */

#define LINEAR_CAPSULE "mlx_flash._cpu_gemv.linear"

typedef struct {
    Rows r;
    Py_buffer views[3];
} Linear;

static void linear_free(PyObject *capsule) {
    Linear *L = PyCapsule_GetPointer(capsule, LINEAR_CAPSULE);
    if (L == NULL) return;
    for (int i = 0; i < 3; i++) PyBuffer_Release(&L->views[i]);
    PyMem_Free(L);
}

/* linear(w, w_off, w_stride, s, s_off, s_stride, b, b_off, b_stride, k, n, bits, group_size, scale_type, symmetric) */
static PyObject *py_linear(PyObject *self, PyObject *args) {
    (void)self;
    PyObject *obj[3];
    Py_ssize_t offs[3];
    Linear *L = PyMem_Calloc(1, sizeof(Linear));
    if (L == NULL) return PyErr_NoMemory();
    Rows *r = &L->r;
    int got = 0;
    if (!PyArg_ParseTuple(args, "OnnOnnOnnniiii|pp", &obj[0], &offs[0], &r->w_stride, &obj[1], &offs[1], &r->s_stride,
                          &obj[2], &offs[2], &r->b_stride, &r->k, &r->n, &r->bits, &r->gs, &r->stype, &r->sym, &r->ilv) ||
        check_shape(r, "linear"))
        goto fail;
    if (r->ilv && (r->bits != 4 || r->n % 128 || r->k % 4 || r->w_stride != r->n / 2)) {
        PyErr_SetString(PyExc_ValueError, "linear: interleaved rows must be 4-bit, contiguous, n % 128 == 0, k % 4 == 0");
        goto fail;
    }
    for (; got < 3; got++)
        if (PyObject_GetBuffer(obj[got], &L->views[got], PyBUF_C_CONTIGUOUS) != 0) goto fail;
    if (bind_rows(L->views, offs, r->k - 1, r, "linear")) goto fail;
    PyObject *capsule = PyCapsule_New(L, LINEAR_CAPSULE, linear_free);
    if (capsule != NULL) return capsule;
fail:
    for (int i = 0; i < got; i++) PyBuffer_Release(&L->views[i]);
    PyMem_Free(L);
    return NULL;
}

/* block_linear(w, k, n, kind): a `linear` handle on k rows of n values of GGML `kind` blocks (block_dot's kinds),
   w holding them row after row (a resident matrix kept as its GGUF stores it) */
static PyObject *py_block_linear(PyObject *self, PyObject *args) {
    (void)self;
    PyObject *w;
    Py_ssize_t k;
    int n, kind;
    if (!PyArg_ParseTuple(args, "Onii", &w, &k, &n, &kind)) return NULL;
    if (kind < 0 || kind >= GG_TYPES || n <= 0 || n % gg_values[kind] || n / gg_values[kind] > GG_MAX_BLOCKS || k < 1) {
        PyErr_Format(PyExc_ValueError, "block_linear: bad shape (n=%d, k=%zd, kind %d)", n, k, kind);
        return NULL;
    }
    Linear *L = PyMem_Calloc(1, sizeof(Linear));
    if (L == NULL) return PyErr_NoMemory();
    if (PyObject_GetBuffer(w, &L->views[0], PyBUF_C_CONTIGUOUS) != 0) {
        PyMem_Free(L);
        return NULL;
    }
    Rows *r = &L->r;
    r->w_stride = (Py_ssize_t)n / gg_values[kind] * gg_bytes[kind];
    if (L->views[0].len != k * r->w_stride) {
        PyErr_Format(PyExc_ValueError, "block_linear: %zd bytes, expected %zd rows of %zd", L->views[0].len, k, r->w_stride);
        PyBuffer_Release(&L->views[0]);
        PyMem_Free(L);
        return NULL;
    }
    r->w = L->views[0].buf, r->k = k, r->n = n, r->gkind = kind + 1;
    PyObject *capsule = PyCapsule_New(L, LINEAR_CAPSULE, linear_free);
    if (capsule == NULL) {
        PyBuffer_Release(&L->views[0]);
        PyMem_Free(L);
    }
    return capsule;
}

static void rms_norm(const float *x, const float *w, float eps, int d, float *out) {
    float ss = 0.0f;
    for (int i = 0; i < d; i++) ss += x[i] * x[i];
    const float inv = 1.0f / sqrtf(ss / (float)d + eps);
    for (int i = 0; i < d; i++) out[i] = x[i] * inv * w[i];
}

/* The angles of RoPE at position pos: cs[i], sn[i] = cos, sin of pos inv_freq[i], i < dims / 2 (every head's) */
static void rope_angles(int dims, const float *inv_freq, float pos, float *cs, float *sn) {
    for (int i = 0; i < dims / 2; i++) {
        const float t = pos * inv_freq[i];
        cs[i] = cosf(t);
        sn[i] = sinf(t);
    }
}

/* MLX's RoPE of one head by rope_angles: pairs (i, i + dims/2), or (2i, 2i + 1) if traditional */
static void rope(float *v, int dims, const float *cs, const float *sn, int traditional) {
    for (int i = 0; i < dims / 2; i++) {
        const float c = cs[i], s = sn[i];
        const int a = traditional ? 2 * i : i, b = traditional ? 2 * i + 1 : i + dims / 2;
        const float x1 = v[a], x2 = v[b];
        v[a] = x1 * c - x2 * s;
        v[b] = x1 * s + x2 * c;
    }
}

/* One sequence's share of a pass: rows start..start+m-1 of x, at positions pos.. of its own cache (float32, or
   float16 if half: each key and value rounded once as it is stored, then read back exactly) */
typedef struct {
    void *kc, *vc;
    Py_ssize_t pos, cap;
    int start, m, half;
} Segment;

typedef struct {
    float *x, *h;
    const float *norm1, *norm2, *inv_freq, *q_norm, *k_norm; /* q_norm, k_norm: NULL, or per head [head_dim] */
    const Rows *q, *k, *v, *o;
    const Segment *seg;
    const int *seg_of; /* the segment of each row */
    float eps, scale, rope_scale, qk_eps;
    Py_ssize_t keys; /* the most keys a row attends to */
    int m, d, n_heads, n_kv, hd, rope_dims, traditional, n_seg, half; /* half: some segment's cache is float16 */
} Block;

/* scratch: attention_scratch() floats */
static size_t attention_scratch(const Block *B, int threads) {
    const size_t m = B->m, d = B->d, nh = B->n_heads, hd = B->hd, nkv = B->n_kv;
    return m * (3 * d + 2 * nh * hd + 2 * nkv * hd) + (size_t)threads * B->keys * (B->half ? 1 + 2 * hd : 1) +
           (size_t)B->rope_dims;
}

/* kv head h's n vectors [n, hd] of a segment's keys or values, as float32: in place, or converted into buf */
static const float *kv_rows(const Segment *S, const void *c, int h, int hd, Py_ssize_t n, float *buf) {
    const size_t at = (size_t)h * S->cap * hd;
    if (!S->half) return (const float *)c + at;
    from_halves((const uint16_t *)c + at, n * hd, buf);
    return buf;
}

static void kv_store(const Segment *S, void *c, int h, Py_ssize_t t, int hd, const float *src) {
    const size_t at = ((size_t)h * S->cap + t) * hd;
    if (S->half)
        to_halves(src, hd, (uint16_t *)c + at);
    else
        memcpy((float *)c + at, src, sizeof(float) * (size_t)hd);
}

/* a . b over n floats as 8 interleaved partial sums added in a fixed order: vectorised, and the same whatever else
   a pass computes */
static float dot8(const float *a, const float *b, int n) {
    float s[8] = {0};
    int i = 0;
    for (; i + 8 <= n; i += 8)
        for (int j = 0; j < 8; j++) s[j] += a[i + j] * b[i + j];
    float r = ((s[0] + s[4]) + (s[1] + s[5])) + ((s[2] + s[6]) + (s[3] + s[7]));
    for (; i < n; i++) r += a[i] * b[i];
    return r;
}

/* out [m, k] = x [m, n] . each row of an attention projection: quantised rows, or GGML blocks (block_linear) */
static void projection(const Rows *r, const float *x, float *out, int m) {
    if (!r->gkind) {
        row_dot_impl(r, x, out, m);
        return;
    }
    GRows g;
    memset(&g, 0, sizeof(g));
    g.w = r->w, g.stride = r->w_stride, g.n_mat = 1, g.kind = r->gkind - 1, g.n = r->n, g.k = r->k;
    block_dot_impl(&g, x, out, m);
}

static void attention_impl(const Block *B, float *scratch, int threads) {
    const int d = B->d, nh = B->n_heads, hd = B->hd, nkv = B->n_kv, group = B->n_heads / B->n_kv, m = B->m;
    float *hn = scratch, *q = hn + (size_t)m * d, *k = q + (size_t)m * nh * hd, *v = k + (size_t)m * nkv * hd,
          *att = v + (size_t)m * nkv * hd, *o = att + (size_t)m * nh * hd, *scores = o + (size_t)m * d, /* keys per thread */
        *cs = scores + (size_t)threads * B->keys * (B->half ? 1 + 2 * hd : 1), *sn = cs + B->rope_dims / 2;
    for (int p = 0; p < m; p++) rms_norm(B->x + (size_t)p * d, B->norm1, B->eps, d, hn + (size_t)p * d);
    /* every matrix's rows read once for all rows, whichever sequence they belong to */
    const Rows *qkv[3] = {B->q, B->k, B->v};
    float *qkv_out[3] = {q, k, v};
    const int path = int8_path(B->q); /* (0 for GGML blocks, whose rows have no bits: each its own projection) */
    if (path && int8_path(B->k) == path && int8_path(B->v) == path && B->k->gs == B->q->gs && B->v->gs == B->q->gs &&
        B->k->bits == B->q->bits && B->v->bits == B->q->bits)
        row_dot_q8_multi(qkv, 3, hn, qkv_out, m, path); /* hn quantised once, one parallel loop */
    else
        for (int i = 0; i < 3; i++) projection(qkv[i], hn, qkv_out[i], m);
    for (int p = 0; p < m; p++) {
        const Segment *S = &B->seg[B->seg_of[p]];
        const Py_ssize_t t = S->pos + (p - S->start);
        rope_angles(B->rope_dims, B->inv_freq, (float)t * B->rope_scale, cs, sn);
        for (int h = 0; h < nh; h++) {
            float *qh = q + ((size_t)p * nh + h) * hd;
            if (B->q_norm) rms_norm(qh, B->q_norm, B->qk_eps, hd, qh);
            rope(qh, B->rope_dims, cs, sn, B->traditional);
        }
        for (int h = 0; h < nkv; h++) {
            float *kh = k + ((size_t)p * nkv + h) * hd;
            if (B->k_norm) rms_norm(kh, B->k_norm, B->qk_eps, hd, kh);
            rope(kh, B->rope_dims, cs, sn, B->traditional);
            kv_store(S, S->kc, h, t, hd, kh);
            kv_store(S, S->vc, h, t, hd, v + ((size_t)p * nkv + h) * hd);
        }
    }
    /* (position, kv head) pairs: a float16 cache's keys and values converted once for the heads that share them */
#pragma omp parallel for schedule(static) num_threads(threads)
    for (int pg = 0; pg < m * nkv; pg++) {
        const int p = pg / nkv, g = pg % nkv;
        int t_id = 0;
#ifdef _OPENMP
        t_id = omp_get_thread_num();
#endif
        const Segment *S = &B->seg[B->seg_of[p]];
        const Py_ssize_t n_keys = S->pos + (p - S->start) + 1;
        float *sc = scores + (size_t)t_id * B->keys * (B->half ? 1 + 2 * hd : 1);
        const float *K = kv_rows(S, S->kc, g, hd, n_keys, sc + B->keys),
                    *V = kv_rows(S, S->vc, g, hd, n_keys, sc + B->keys * (1 + hd));
        for (int h = g * group; h < (g + 1) * group; h++) {
            const size_t ph = (size_t)p * nh + h;
            float *out = att + ph * hd, mx = -INFINITY, sum = 0.0f;
            const float *qh = q + ph * hd;
            for (Py_ssize_t t = 0; t < n_keys; t++) {
                sc[t] = dot8(qh, K + t * hd, hd) * B->scale;
                mx = sc[t] > mx ? sc[t] : mx;
            }
            for (Py_ssize_t t = 0; t < n_keys; t++) {
                sc[t] = expf(sc[t] - mx);
                sum += sc[t];
            }
            memset(out, 0, sizeof(float) * (size_t)hd);
            for (Py_ssize_t t = 0; t < n_keys; t++) {
                const float w = sc[t] / sum;
                for (int i = 0; i < hd; i++) out[i] += w * V[t * hd + i];
            }
        }
    }
    projection(B->o, att, o, m);
    for (int p = 0; p < m; p++) {
        float *xp = B->x + (size_t)p * d;
        for (int i = 0; i < d; i++) xp[i] += o[(size_t)p * d + i];
        rms_norm(xp, B->norm2, B->eps, d, B->h + (size_t)p * d);
    }
}

static const Rows *linear_rows(PyObject *capsule, const char *what) {
    Linear *L = PyCapsule_GetPointer(capsule, LINEAR_CAPSULE);
    if (L == NULL) PyErr_Format(PyExc_TypeError, "attention: %s must be a linear(...) handle", what);
    return L ? &L->r : NULL;
}

/* The block of `blk` (its linears, scalars and segments' positions set; a single segment's m -1: all of x's rows)
   over buffers x, h, norms and each segment's keys and values (caches[2 s], caches[2 s + 1], held by the caller); checks the shapes and runs it. */
static PyObject *run_attention(Block *blk, Segment *seg, Py_buffer *caches, PyObject *x, PyObject *h, PyObject *n1,
                               PyObject *n2, PyObject *inv, PyObject *qn, PyObject *kn) {
    Buffers Bf;
    memset(&Bf, 0, sizeof(Bf));
    Py_buffer extra[3];
    int held = 0; /* extra[0..held) are held: inv_freq, q_norm, k_norm */
    int *seg_of = NULL;
    PyObject *result = NULL;
    if (get(&Bf, 0, x, 1, "x") || get(&Bf, 1, h, 1, "h") || get(&Bf, 2, n1, 0, "norm1") || get(&Bf, 3, n2, 0, "norm2"))
        goto done;
    if (PyObject_GetBuffer(inv, &extra[0], PyBUF_C_CONTIGUOUS) != 0) goto done;
    held = 1;
    if ((qn == Py_None) != (kn == Py_None)) {
        PyErr_SetString(PyExc_ValueError, "attention: q_norm and k_norm go together");
        goto done;
    }
    if (qn != Py_None) {
        if (PyObject_GetBuffer(qn, &extra[1], PyBUF_C_CONTIGUOUS) != 0) goto done;
        held = 2;
        if (PyObject_GetBuffer(kn, &extra[2], PyBUF_C_CONTIGUOUS) != 0) goto done;
        held = 3;
        if (extra[1].len != blk->hd * 4 || extra[2].len != blk->hd * 4) {
            PyErr_SetString(PyExc_ValueError, "attention: q_norm and k_norm must be float32 [head_dim]");
            goto done;
        }
        blk->q_norm = extra[1].buf;
        blk->k_norm = extra[2].buf;
    }
    const int d = blk->q ? blk->q->n : 0, nh = blk->n_heads, nkv = blk->n_kv, hd = blk->hd;
    blk->d = d;
    blk->m = d > 0 ? (int)(Bf.views[0].len / (4 * d)) : 0;
    blk->rope_dims = (int)(2 * (extra[0].len / 4));
    if (blk->n_seg == 1 && seg[0].m < 0) seg[0].m = blk->m; /* attention(): one sequence, all of x */
    int rows = 0, fits = 1;
    blk->keys = 0;
    for (int s = 0; s < blk->n_seg; s++) {
        seg[s].half = caches[2 * s].itemsize == 2;
        blk->half |= seg[s].half;
        const Py_ssize_t cache_len = (Py_ssize_t)nkv * seg[s].cap * hd * caches[2 * s].itemsize;
        seg[s].start = rows;
        rows += seg[s].m;
        fits = fits && seg[s].m >= 1 && seg[s].pos >= 0 && seg[s].pos + seg[s].m <= seg[s].cap &&
               caches[2 * s].len >= cache_len && caches[2 * s + 1].len >= cache_len &&
               caches[2 * s + 1].itemsize == caches[2 * s].itemsize;
        seg[s].kc = caches[2 * s].buf;
        seg[s].vc = caches[2 * s + 1].buf;
        if (seg[s].pos + seg[s].m > blk->keys) blk->keys = seg[s].pos + seg[s].m;
    }
    if (nh <= 0 || nkv <= 0 || hd <= 0 || nh % nkv || blk->m < 1 || !fits || rows != blk->m ||
        Bf.views[0].len != (Py_ssize_t)blk->m * d * 4 || blk->rope_dims > hd || Bf.views[1].len != Bf.views[0].len ||
        Bf.views[2].len != d * 4 || Bf.views[3].len != d * 4 || blk->q->n != d || blk->q->k != nh * hd ||
        blk->k->n != d || blk->k->k != nkv * hd || blk->v->n != d || blk->v->k != nkv * hd || blk->o->n != nh * hd ||
        blk->o->k != d) {
        PyErr_Format(PyExc_ValueError,
                     "attention: shapes disagree (d=%d, %d positions in %d sequences, heads %d/%d x %d, pos %zd of "
                     "%zd, rope dims %d)",
                     d, blk->m, blk->n_seg, nh, nkv, hd, seg[0].pos, seg[0].cap, blk->rope_dims);
        goto done;
    }
    seg_of = PyMem_RawMalloc(sizeof(int) * (size_t)blk->m);
    if (seg_of == NULL) {
        PyErr_NoMemory();
        goto done;
    }
    for (int s = 0; s < blk->n_seg; s++)
        for (int p = 0; p < seg[s].m; p++) seg_of[seg[s].start + p] = s;
    blk->seg = seg;
    blk->seg_of = seg_of;
    blk->x = Bf.views[0].buf;
    blk->h = Bf.views[1].buf;
    blk->norm1 = Bf.views[2].buf;
    blk->norm2 = Bf.views[3].buf;
    blk->inv_freq = extra[0].buf;
    /* (position, kv head) pairs worth two threads */
    const int threads = blk->m * nkv >= 2 && (Py_ssize_t)blk->m * nh * blk->keys * hd >= MIN_WORK_PER_THREAD ? 2 : 1;
    float *scratch = PyMem_RawMalloc(sizeof(float) * attention_scratch(blk, threads));
    if (scratch == NULL) {
        PyErr_NoMemory();
        goto done;
    }
    Py_BEGIN_ALLOW_THREADS attention_impl(blk, scratch, threads);
    Py_END_ALLOW_THREADS PyMem_RawFree(scratch);
    result = Py_None;
    Py_INCREF(result);
done:
    PyMem_RawFree(seg_of);
    for (int i = 0; i < held; i++) PyBuffer_Release(&extra[i]);
    release(&Bf);
    return result;
}

static int block_linears(Block *blk, PyObject **caps) {
    const Rows **lin[4] = {&blk->q, &blk->k, &blk->v, &blk->o};
    const char *names[4] = {"q", "k", "v", "o"};
    for (int i = 0; i < 4; i++)
        if ((*lin[i] = linear_rows(caps[i], names[i])) == NULL) return -1;
    return 0;
}

static int get_cache(Py_buffer *view, PyObject *obj, const char *what) {
    if (PyObject_GetBuffer(obj, view, PyBUF_WRITABLE | PyBUF_C_CONTIGUOUS | PyBUF_FORMAT) != 0) {
        PyErr_Format(PyExc_TypeError, "attention: %s must be a writable contiguous buffer", what);
        return -1;
    }
    const char *f = view->format ? view->format : "B";
    if (*f == '<' || *f == '=' || *f == '@') f++;
    if (!((strcmp(f, "f") == 0 && view->itemsize == 4) || (strcmp(f, "e") == 0 && view->itemsize == 2))) {
        PyErr_Format(PyExc_TypeError, "attention: %s must be float32 or float16, not format '%s'", what, view->format);
        PyBuffer_Release(view);
        return -1;
    }
    return 0;
}

/* attention(x, h, norm1, norm2, eps, q, k, v, o, kc, vc, pos, cap, n_heads, n_kv, head_dim, inv_freq, traditional,
             rope_scale, scale, q_norm=None, k_norm=None, qk_eps=0): x (float32 [m, d]: positions pos..pos+m-1) +=
             the block's output, h = the FFN's input; kc, vc [n_kv, cap, head_dim] (float32, or float16) get those positions.
             inv_freq: float32 [rope_dims / 2]; RoPE at position t * rope_scale. q_norm, k_norm (float32 [head_dim]):
             each head of q and k RMS-normed before RoPE (Qwen3). */
static PyObject *py_attention(PyObject *self, PyObject *args) {
    (void)self;
    PyObject *x, *h, *n1, *n2, *caps[4], *kc, *vc, *inv, *qn = Py_None, *kn = Py_None;
    Block blk;
    Segment seg;
    memset(&blk, 0, sizeof(blk));
    memset(&seg, 0, sizeof(seg));
    if (!PyArg_ParseTuple(args, "OOOOfOOOOOOnniiiOpff|OOf", &x, &h, &n1, &n2, &blk.eps, &caps[0], &caps[1], &caps[2],
                          &caps[3], &kc, &vc, &seg.pos, &seg.cap, &blk.n_heads, &blk.n_kv, &blk.hd, &inv,
                          &blk.traditional, &blk.rope_scale, &blk.scale, &qn, &kn, &blk.qk_eps) ||
        block_linears(&blk, caps))
        return NULL;
    Py_buffer caches[2];
    if (get_cache(&caches[0], kc, "keys")) return NULL;
    if (get_cache(&caches[1], vc, "values")) {
        PyBuffer_Release(&caches[0]);
        return NULL;
    }
    blk.n_seg = 1;
    seg.m = -1; /* every row of x: run_attention counts them */
    PyObject *result = run_attention(&blk, &seg, caches, x, h, n1, n2, inv, qn, kn);
    PyBuffer_Release(&caches[0]);
    PyBuffer_Release(&caches[1]);
    return result;
}

/* attention_batch(x, h, norm1, norm2, eps, q, k, v, o, segments, n_heads, n_kv, head_dim, inv_freq, traditional,
                   rope_scale, scale, q_norm=None, k_norm=None, qk_eps=0): attention() over several sequences at once,
                   segments [(kc, vc, pos, cap, m), ...] in x's row order: each sequence's m rows at its positions
                   pos.. of its own cache; the projections' rows read once for all. */
static PyObject *py_attention_batch(PyObject *self, PyObject *args) {
    (void)self;
    PyObject *x, *h, *n1, *n2, *caps[4], *segs, *inv, *qn = Py_None, *kn = Py_None;
    Block blk;
    memset(&blk, 0, sizeof(blk));
    if (!PyArg_ParseTuple(args, "OOOOfOOOOOiiiOpff|OOf", &x, &h, &n1, &n2, &blk.eps, &caps[0], &caps[1], &caps[2],
                          &caps[3], &segs, &blk.n_heads, &blk.n_kv, &blk.hd, &inv, &blk.traditional, &blk.rope_scale,
                          &blk.scale, &qn, &kn, &blk.qk_eps) ||
        block_linears(&blk, caps))
        return NULL;
    PyObject *list = PySequence_Fast(segs, "attention_batch: segments must be a sequence");
    if (list == NULL) return NULL;
    const Py_ssize_t n = PySequence_Fast_GET_SIZE(list);
    Segment *seg = PyMem_Calloc(n > 0 ? n : 1, sizeof(Segment));
    Py_buffer *caches = PyMem_Calloc(n > 0 ? 2 * n : 1, sizeof(Py_buffer));
    PyObject *result = NULL;
    Py_ssize_t got = 0; /* caches[0..got) are held */
    if (seg == NULL || caches == NULL) {
        PyErr_NoMemory();
        goto done;
    }
    if (n < 1) {
        PyErr_SetString(PyExc_ValueError, "attention_batch: no segments");
        goto done;
    }
    for (Py_ssize_t s = 0; s < n; s++) {
        PyObject *kc, *vc;
        if (!PyArg_ParseTuple(PySequence_Fast_GET_ITEM(list, s), "OOnni", &kc, &vc, &seg[s].pos, &seg[s].cap,
                              &seg[s].m))
            goto done;
        if (get_cache(&caches[got], kc, "keys")) goto done;
        got++;
        if (get_cache(&caches[got], vc, "values")) goto done;
        got++;
    }
    blk.n_seg = (int)n;
    result = run_attention(&blk, seg, caches, x, h, n1, n2, inv, qn, kn);
done:
    for (Py_ssize_t i = 0; i < got; i++) PyBuffer_Release(&caches[i]);
    PyMem_Free(caches);
    PyMem_Free(seg);
    Py_DECREF(list);
    return result;
}

/* silu_mul(g, u): g = silu(g) * u in place (float32 [n]), the GLU of a decode step */
static PyObject *py_silu_mul(PyObject *self, PyObject *args) {
    (void)self;
    PyObject *g, *u;
    if (!PyArg_ParseTuple(args, "OO", &g, &u)) return NULL;
    Buffers Bf;
    memset(&Bf, 0, sizeof(Bf));
    PyObject *result = NULL;
    if (get(&Bf, 0, g, 1, "gate") || get(&Bf, 1, u, 0, "up")) goto done;
    if (Bf.views[0].len != Bf.views[1].len || Bf.views[0].len % 4) {
        PyErr_SetString(PyExc_ValueError, "silu_mul: gate and up must be float32 arrays of one length");
        goto done;
    }
    silu_mul_into(Bf.views[0].buf, Bf.views[0].buf, Bf.views[1].buf, 1, Bf.views[0].len / 4);
    result = Py_None;
    Py_INCREF(result);
done:
    release(&Bf);
    return result;
}

static PyObject *set_flag(int *flag, PyObject *arg) {
    int on = PyObject_IsTrue(arg);
    if (on < 0) return NULL;
    *flag = on;
    Py_RETURN_NONE;
}

/* halves(src, dst): float32 src as float16 into dst, as a float16 KV cache stores them (tests compare numpy's) */
static PyObject *py_halves(PyObject *self, PyObject *args) {
    (void)self;
    Py_buffer src, dst;
    if (!PyArg_ParseTuple(args, "y*w*", &src, &dst)) return NULL;
    PyObject *result = NULL;
    if (src.len % 4 || dst.len != src.len / 2)
        PyErr_SetString(PyExc_ValueError, "halves: dst must hold one half per float of src");
    else {
        to_halves(src.buf, (int)(src.len / 4), dst.buf);
        result = Py_None;
        Py_INCREF(result);
    }
    PyBuffer_Release(&src);
    PyBuffer_Release(&dst);
    return result;
}

/* A product rounded to float32 on its own (a compiler may not fuse it with the sum it feeds) */
static float product(float a, float b) {
    volatile float p = a * b;
    return p;
}

/* embed(ids, out, w, s, b, n, bits, group_size, scale_type): out [m, n] float32 = rows ids of a quantised table (w codes
   [vocab, n * bits / 8] bytes, s float16 or float32 scales [vocab, n / group_size], b biases alike or None: -2^(bits-1)
   s) as MLX's dequantize rounds them: s q, then + b, each in the scales' type */
static PyObject *py_embed(PyObject *self, PyObject *args) {
    (void)self;
    Py_buffer ids, out, w, s, b;
    PyObject *bo;
    int n, bits, gs, stype;
    if (!PyArg_ParseTuple(args, "y*w*y*y*Oiiii", &ids, &out, &w, &s, &bo, &n, &bits, &gs, &stype)) return NULL;
    int has_b = bo != Py_None, failed = has_b && PyObject_GetBuffer(bo, &b, PyBUF_SIMPLE) != 0;
    PyObject *result = NULL;
    const Py_ssize_t m = ids.len / 4, row = (Py_ssize_t)n * bits / 8, groups = gs > 0 ? n / gs : 0;
    const int size = stype == SCALE_F32 ? 4 : 2;
    const Py_ssize_t vocab = groups > 0 ? s.len / size / groups : 0;
    if (failed)
        ;
    else if ((bits != 2 && bits != 4 && bits != 8) || (stype != SCALE_F16 && stype != SCALE_F32) || gs <= 0 || n % gs ||
             n % 8 || ids.len % 4 || out.len != m * n * 4 || w.len != vocab * row || s.len != vocab * groups * size ||
             (has_b && b.len != s.len))
        PyErr_SetString(PyExc_ValueError, "embed: the table's codes, scales and biases disagree, or out is not [ids, n]");
    else {
        const int32_t *id = ids.buf;
        Py_ssize_t bad = -1;
        for (Py_ssize_t t = 0; t < m && bad < 0; t++)
            if (id[t] < 0 || id[t] >= vocab) bad = t;
        if (bad >= 0)
            PyErr_Format(PyExc_ValueError, "embed: token id %d outside the table's %zd rows", id[bad], vocab);
        else {
            float *o = out.buf;
            const uint8_t *codes = w.buf;
            for (Py_ssize_t t = 0; t < m; t++)
                for (int i = 0; i < n; i++) {
                    const Py_ssize_t g = (Py_ssize_t)id[t] * groups + i / gs;
                    const int bit = i * bits, q = (codes[id[t] * row + bit / 8] >> (bit % 8)) & ((1 << bits) - 1);
                    const float off = (float)-(1 << (bits - 1));
                    if (stype == SCALE_F32) {
                        const float sf = ((const float *)s.buf)[g];
                        const float bf = has_b ? ((const float *)b.buf)[g] : product(sf, off);
                        o[t * n + i] = product(sf, (float)q) + bf;
                    } else {
                        const float sf = f16_to_f32(((const uint16_t *)s.buf)[g]);
                        const float bf = has_b ? f16_to_f32(((const uint16_t *)b.buf)[g]) : f16_to_f32(f32_to_f16(sf * off));
                        o[t * n + i] = f16_to_f32(f32_to_f16(f16_to_f32(f32_to_f16(sf * (float)q)) + bf));
                    }
                }
            result = Py_None;
            Py_INCREF(result);
        }
    }
    if (has_b && !failed) PyBuffer_Release(&b);
    PyBuffer_Release(&ids);
    PyBuffer_Release(&out);
    PyBuffer_Release(&w);
    PyBuffer_Release(&s);
    return result;
}

/* Columns summed per piece in sum_rows: a piece of dst stays in L1 while every row is added into it */
#define SUM_PIECE 2048

/* dst[i] = src[0][i] + src[1][i] + ... (rows of len floats), each element's additions in row order; pieces of
   columns across threads (a prompt pass's partial sums are tens of MiB) */
static void sum_rows_impl(const float *src, float *dst, Py_ssize_t rows, Py_ssize_t len) {
    const Py_ssize_t pieces = (len + SUM_PIECE - 1) / SUM_PIECE;
#pragma omp parallel for schedule(static) if (rows * len >= (1 << 18))
    for (Py_ssize_t c = 0; c < pieces; c++) {
        const Py_ssize_t i0 = c * SUM_PIECE, i1 = i0 + SUM_PIECE < len ? i0 + SUM_PIECE : len;
        memcpy(dst + i0, src + i0, sizeof(float) * (size_t)(i1 - i0));
        for (Py_ssize_t r = 1; r < rows; r++)
            for (Py_ssize_t i = i0; i < i1; i++) dst[i] += src[r * len + i];
    }
}

/* sum_rows(a, out): out = a[0] + a[1] + ... (float32, a [n, len(out)]), each element's sums in row order as a Python
   loop of numpy additions rounds them: partial sums added in one call instead of one array each */
static PyObject *py_sum_rows(PyObject *self, PyObject *args) {
    (void)self;
    Py_buffer a, out;
    if (!PyArg_ParseTuple(args, "y*w*", &a, &out)) return NULL;
    PyObject *result = NULL;
    if (out.len == 0 || out.len % 4 || a.len % out.len || a.len == 0)
        PyErr_SetString(PyExc_ValueError, "sum_rows: a must hold whole rows of out's float32 length");
    else {
        const Py_ssize_t len = out.len / 4, rows = a.len / out.len;
        const float *src = a.buf;
        float *dst = out.buf;
        Py_BEGIN_ALLOW_THREADS sum_rows_impl(src, dst, rows, len);
        Py_END_ALLOW_THREADS result = Py_None;
        Py_INCREF(result);
    }
    PyBuffer_Release(&a);
    PyBuffer_Release(&out);
    return result;
}

static PyObject *py_set_simd(PyObject *self, PyObject *arg) {
    (void)self;
    return set_flag(&simd_allowed, arg);
}

static PyObject *py_set_avx512(PyObject *self, PyObject *arg) {
    (void)self;
    return set_flag(&avx512_allowed, arg);
}

static PyObject *py_set_int8(PyObject *self, PyObject *arg) {
    (void)self;
    return set_flag(&int8_allowed, arg);
}

static PyObject *py_info(PyObject *self, PyObject *noargs) {
    (void)self;
    (void)noargs;
    int threads = 1;
#ifdef _OPENMP
    threads = omp_get_max_threads();
#endif
    return Py_BuildValue("{s:i,s:i,s:i,s:i,s:i,s:i,s:i}", "avx2", cpu_has_avx2(), "vnni", cpu_has_vnni(), "avx512_cpu",
                         cpu_has_avx512(), "simd", simd_allowed && cpu_has_avx2(), "avx512", use_avx512(), "int8",
                         int8_runs(), "threads", threads);
}

#define ARGS_DOC                                                                                              \
    "(vec, out, w, w_off, w_stride, s, s_off, s_stride, b, b_off, b_stride, slots, k, n, bits, group_size, " \
    "scale_type, symmetric=False)\n"

static PyMethodDef methods[] = {
    {"row_dot", py_row_dot, METH_VARARGS,
     "row_dot" ARGS_DOC "out[p, j] = sum_i vec[p, i] W[slots[j]][i]; vec float32 [m, n], out float32 [m, k]"},
    {"row_axpy", py_row_axpy, METH_VARARGS,
     "row_axpy" ARGS_DOC "out[p, i] = sum_j vec[p, j] W[slots[j]][i]; vec float32 [m, k], out float32 [m, n]"},
    {"block_axpy", py_block_axpy, METH_VARARGS,
     "block_axpy(vec, out, w, w_off, w_stride, slots, k, n, bits, blocks, scales, biases, n_blocks, scale_type, "
     "symmetric=False)\n"
     "out[i] = sum_j vec[j] (S[blocks[j]][i] q_{slots[j]}[i] + B[blocks[j]][i]); rows hold codes only"},
    {"block_linear", py_block_linear, METH_VARARGS, "block_linear(w, k, n, kind): a linear handle on rows of GGML blocks"},
    {"linear", py_linear, METH_VARARGS,
     "linear(w, w_off, w_stride, s, s_off, s_stride, b, b_off, b_stride, k, n, bits, group_size, scale_type, "
     "symmetric=False, interleaved=False) -> a handle on k quantised rows (buffers held), for attention(); interleaved: "
     "codes in 4-row groups, 64 bytes of each row in turn (cpu_gemv.interleave)"},
    {"attention", py_attention, METH_VARARGS,
     "attention(x, h, norm1, norm2, eps, q, k, v, o, keys, values, pos, cap, n_heads, n_kv, head_dim, inv_freq, "
     "traditional, rope_scale, scale): one llama attention block of m positions pos.. in place (x [m, d] += "
     "block(x), causal; h = the FFN's input; keys/values [n_kv, cap, head_dim] get those positions)"},
    {"attention_batch", py_attention_batch, METH_VARARGS,
     "attention_batch(x, h, norm1, norm2, eps, q, k, v, o, segments, n_heads, n_kv, head_dim, inv_freq, traditional, "
     "rope_scale, scale): attention() of several sequences in one pass, segments [(keys, values, pos, cap, m), ...] "
     "in x's row order"},
    {"silu_mul", py_silu_mul, METH_VARARGS, "silu_mul(g, u): g = silu(g) * u in place (float32)"},
    {"ffn_glu", py_ffn_glu, METH_VARARGS,
     "ffn_glu(pairs, block): block_axpy(*block) of h = glu_pairs(row_dot_pairs(*pairs)) (block's vector gets h), a "
     "row's units in one pass where the loops allow it"},
    {"row_dot_pairs", py_row_dot_pairs, METH_VARARGS,
     "row_dot_pairs(pair_w, pair_s, pair_b, *row_dot_args): two rows a unit (pair_* bytes apart) in one pass"},
    {"expert_glu", py_expert_glu, METH_VARARGS,
     "expert_glu(x, out, addresses, gate, up, down, hidden, n, n_out, kind_gu, kind_down): out[e, p] = down (silu(gate "
     "x[p]) * up x[p]) of the SwiGLU expert of GGML blocks at addresses[e] (block_dot's arithmetic)"},
    {"block_dot", py_block_dot, METH_VARARGS,
     "block_dot(vec, out, w, offs, stride, slots, k, n, kind): out[p, j, t] = vec[p] . row j of matrix t (at offs[t] "
     "in each row), rows of GGML blocks as stored (kind: 0 Q4_0, 1 Q8_0, 2 Q4_K, 3 Q5_K, 4 Q6_K, 5 Q2_K, 6 Q3_K, "
     "7 IQ4_NL, 8 IQ4_XS, 9 Q5_0)"},
    {"glu_pairs", py_glu_pairs, METH_VARARGS, "glu_pairs(gu, h): h = silu(gu[0::2]) * gu[1::2] (float32)"},
    {"set_int8", py_set_int8, METH_O,
     "set_int8(on): row_dot with int8 activations against 4/8-bit codes (default) or float ones (the reference)"},
    {"info", py_info, METH_NOARGS,
     "info() -> {'avx2', 'vnni', 'avx512_cpu': CPU has them, 'simd': AVX2 loops in use, 'avx512': AVX-512 loops in use, "
     "'int8': int8 activations, 'threads': n}"},
    {"set_avx512", py_set_avx512, METH_O,
     "set_avx512(on): the AVX-512 loops where the CPU has them (default) or the AVX2 / VNNI ones (same bits)"},
    {"embed", py_embed, METH_VARARGS,
     "embed(ids, out, w, s, b, n, bits, group_size, scale_type): rows of a quantised table, as MLX's dequantize"},
    {"sum_rows", py_sum_rows, METH_VARARGS, "sum_rows(a, out): out = a[0] + a[1] + ... in row order (float32)"},
    {"halves", py_halves, METH_VARARGS, "halves(src, dst): float32 src rounded to float16 into dst"},
    {"set_simd", py_set_simd, METH_O, "set_simd(on): use the AVX2 loops where the CPU has them (default) or the scalar ones"},
    {NULL, NULL, 0, NULL}};

static struct PyModuleDef module = {PyModuleDef_HEAD_INIT, "_cpu_gemv",
                                    "Quantised matrix-vector products on the CPU (kernels/cpu_gemv.c)", -1, methods,
                                    NULL, NULL, NULL, NULL};

PyMODINIT_FUNC PyInit__cpu_gemv(void) { return PyModule_Create(&module); }
