/* Quantised matrix-vector products on the CPU, straight from the rows where they are stored.

   The CPU counterpart of gather_ffn.metal: MLX's CPU quantized_matmul runs at ~1 G
   elements/s here (0.5 GB/s of 4-bit weights), which makes decode compute-bound on a
   CPU; these loops dequantise and accumulate in float32 with AVX2 where the CPU has it
   (runtime check, scalar loops otherwise) on OpenMP threads.

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
*/
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <stdint.h>
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
    Py_ssize_t k;
    int n, bits, gs, stype;
    int sym; /* symmetric (llama.cpp's Q4_0 / Q8_0): no biases stored, bias = -2^(bits-1) scale */
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

static inline Py_ssize_t row_of(const Rows *r, Py_ssize_t j) { return r->slots ? r->slots[j] : j; }

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

static int use_avx2(const Rows *r) { return simd_allowed && cpu_has_avx2() && (r->bits == 4 || r->bits == 8) && r->gs % 32 == 0; }

/* -- the two products ------------------------------------------------------------------ */

/* Rows worth one thread: below this, a second thread costs more than it saves. */
#define MIN_WORK_PER_THREAD (1 << 16)

static int threads_for(const Rows *r) {
#ifdef _OPENMP
    Py_ssize_t work = r->k * (Py_ssize_t)r->n, t = work / MIN_WORK_PER_THREAD;
    int max = omp_get_max_threads();
    return t < 1 ? 1 : (t > max ? max : (int)t);
#else
    (void)r;
    return 1;
#endif
}

#define PREFETCH_AHEAD 4 /* rows; 10-20% faster on 7B-shaped cache rows than none (2, 4, 8 alike; alternated runs, shared machine) */

/* Rows in a neuron cache are a stride apart: the hardware prefetcher loses the stream at each row, so the
   loops ask for a later row's bytes themselves. */
static inline void prefetch_span(const uint8_t *p, Py_ssize_t bytes) {
    for (Py_ssize_t o = 0; o < bytes; o += 64) __builtin_prefetch(p + o);
}

static void row_dot_impl(const Rows *r, const float *x, float *out) {
    const int groups = r->n / r->gs, group_bytes = r->gs * r->bits / 8;
    const int avx = use_avx2(r);
    float xsum[groups > 0 ? groups : 1];
    for (int g = 0; g < groups; g++) {
        float s = 0.0f;
        for (int i = 0; i < r->gs; i++) s += x[g * r->gs + i];
        xsum[g] = s;
    }
#pragma omp parallel for schedule(static) num_threads(threads_for(r))
    for (Py_ssize_t j = 0; j < r->k; j++) {
        Py_ssize_t row = row_of(r, j);
        const uint8_t *w = r->w + row * r->w_stride;
        float scale[groups], bias[groups], acc = 0.0f;
        if (j + PREFETCH_AHEAD < r->k) {
            const Py_ssize_t next = row_of(r, j + PREFETCH_AHEAD);
            prefetch_span(r->w + next * r->w_stride, (Py_ssize_t)groups * group_bytes);
            prefetch_span(r->s + next * r->s_stride, (Py_ssize_t)groups * (r->stype == SCALE_F32 ? 4 : 2));
        }
        scales_f32(r->s + row * r->s_stride, r->stype, groups, scale, avx);
        biases_f32(r, r->b + row * r->b_stride, groups, scale, bias, avx);
        for (int g = 0; g < groups; g++) {
            const float *xg = x + g * r->gs;
            const uint8_t *wg = w + g * group_bytes;
            float q = avx ? qdot_avx2(xg, wg, r->gs, r->bits) : qdot_scalar(xg, wg, r->gs, r->bits);
            acc += scale[g] * q + bias[g] * xsum[g];
        }
        out[j] = acc;
    }
}

/* Rows processed together by row_axpy: each pass over `out` adds AXPY_BLOCK rows, so out is
   loaded and stored once per block instead of once per row. */
#define AXPY_BLOCK 4

static void axpy_block(float *out, const uint8_t *const *w, const float *a, int m, int gs, int bits, int avx) {
#if HAVE_X86
    if (avx) {
        qaxpy4_avx2(out, w, a, m, gs, bits);
        return;
    }
#endif
    (void)avx;
    for (int r = 0; r < m; r++) qaxpy_scalar(out, w[r], a[r], gs, bits);
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

static void row_axpy_impl(const Rows *r, const float *c, float *out) {
    const int groups = r->n / r->gs, group_bytes = r->gs * r->bits / 8;
    const int avx = use_avx2(r), nt = threads_for(r), scale_size = r->stype == SCALE_F32 ? 4 : 2;
    (void)nt; /* unused without OpenMP */
    memset(out, 0, sizeof(float) * (size_t)r->n);
    /* each thread owns a contiguous range of groups (columns) and walks every row over it */
#pragma omp parallel num_threads(nt)
    {
        Py_ssize_t lo, hi;
        thread_share(groups, &lo, &hi);
        const int g0 = (int)lo, g1 = (int)hi;
        const int G = g1 > g0 ? g1 - g0 : 1;
        float bias_sum[G]; /* sum_j c_j bias_jg, added once per column at the end */
        float a[AXPY_BLOCK][G], bias[G];
        const uint8_t *w[AXPY_BLOCK];
        memset(bias_sum, 0, sizeof(bias_sum));
        Py_ssize_t j = 0;
        while (j < r->k) {
            int m = 0; /* gather the next non-zero rows: their weights and c_j * scale */
            for (; j < r->k && m < AXPY_BLOCK; j++) {
                float cj = c[j];
                if (cj == 0.0f) continue;
                Py_ssize_t row = row_of(r, j);
                w[m] = r->w + row * r->w_stride;
                scales_f32(r->s + row * r->s_stride + (Py_ssize_t)g0 * scale_size, r->stype, g1 - g0, a[m], avx);
                biases_f32(r, r->b + row * r->b_stride + (Py_ssize_t)g0 * scale_size, g1 - g0, a[m], bias, avx);
                for (int g = 0; g < g1 - g0; g++) {
                    a[m][g] *= cj;
                    bias_sum[g] += cj * bias[g];
                }
                m++;
            }
            for (int g = g0; g < g1; g++) {
                const uint8_t *wg[AXPY_BLOCK];
                float ag[AXPY_BLOCK];
                for (int q = 0; q < m; q++) {
                    wg[q] = w[q] + g * group_bytes;
                    ag[q] = a[q][g - g0];
                }
                axpy_block(out + g * r->gs, wg, ag, m, r->gs, r->bits, avx);
            }
        }
        for (int g = g0; g < g1; g++)
            for (int i = 0; i < r->gs; i++) out[g * r->gs + i] += bias_sum[g - g0];
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
/* scratch: 3 * n floats (each thread's sums, scales and biases over its columns) */
static void block_axpy_impl(const Rows *r, const float *c, float *out, const int32_t *blk, const uint8_t *S,
                            const uint8_t *B, float *scratch) {
    const int avx = use_avx2(r), nt = threads_for(r), scale_size = r->stype == SCALE_F32 ? 4 : 2;
    const Py_ssize_t chunks = r->n / 32, table_row = (Py_ssize_t)r->n * scale_size;
    (void)nt;
    memset(out, 0, sizeof(float) * (size_t)r->n);
#pragma omp parallel num_threads(nt)
    {
        Py_ssize_t lo, hi;
        thread_share(chunks, &lo, &hi);
        const int i0 = (int)(32 * lo), len = (int)(32 * (hi - lo));
        if (len > 0) {
            float *acc = scratch + i0, *s = scratch + r->n + i0, *b = scratch + 2 * r->n + i0;
            Py_ssize_t j = 0;
            while (j < r->k) {
                const int32_t g = blk[j];
                float csum = 0.0f;
                int any = 0;
                memset(acc, 0, sizeof(float) * (size_t)len);
                while (j < r->k && blk[j] == g) {
                    const uint8_t *w[AXPY_BLOCK];
                    float a[AXPY_BLOCK];
                    int m = 0;
                    for (; j < r->k && blk[j] == g && m < AXPY_BLOCK; j++) {
                        if (c[j] == 0.0f) continue;
                        w[m] = r->w + row_of(r, j) * r->w_stride + (Py_ssize_t)i0 * r->bits / 8;
                        a[m] = c[j];
                        csum += c[j];
                        m++;
                    }
                    if (m) axpy_block(acc, w, a, m, len, r->bits, avx);
                    any |= m;
                }
                if (!any) continue;
                scales_f32(S + g * table_row + (Py_ssize_t)i0 * scale_size, r->stype, len, s, avx);
                biases_f32(r, B + g * table_row + (Py_ssize_t)i0 * scale_size, len, s, b, avx);
                for (int i = 0; i < len; i++) out[i0 + i] += s[i] * acc[i] + b[i] * csum;
            }
        }
    }
}

/* -- Python ------------------------------------------------------------------------------ */

typedef struct {
    Py_buffer views[6]; /* vec, out, w, s, b, slots */
    int held[6];
} Buffers;

static void release(Buffers *B) {
    for (int i = 0; i < 6; i++)
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

/* r->slots from `slots` (None: rows 0..k-1), checked: int32 [k], none negative; *max_row: the largest row. */
static int parse_slots(Buffers *B, Rows *r, PyObject *slots, const char *fn, Py_ssize_t *max_row) {
    r->slots = NULL;
    *max_row = r->k - 1;
    if (slots == Py_None) return 0;
    if (get(B, 5, slots, 0, "slots")) return -1;
    if (B->views[5].len != r->k * 4) {
        PyErr_Format(PyExc_ValueError, "%s: slots must be int32 [%zd]", fn, r->k);
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

/* Parse the common arguments and check every row touched lies inside its buffer. */
static int parse(PyObject *args, Buffers *B, Rows *r, const char *fn, int vec_is_rows) {
    PyObject *vec, *out, *w, *s, *b, *slots;
    Py_ssize_t w_off, s_off, b_off;
    memset(B, 0, sizeof(*B));
    r->sym = 0;
    if (!PyArg_ParseTuple(args, "OOOnnOnnOnnOniiii|p", &vec, &out, &w, &w_off, &r->w_stride, &s, &s_off, &r->s_stride, &b,
                          &b_off, &r->b_stride, &slots, &r->k, &r->n, &r->bits, &r->gs, &r->stype, &r->sym))
        return -1;
    if (get(B, 0, vec, 0, "vector") || get(B, 1, out, 1, "out") || get(B, 2, w, 0, "weights") ||
        get(B, 3, s, 0, "scales") || get(B, 4, b, 0, "biases"))
        return -1;
    if (r->bits != 2 && r->bits != 4 && r->bits != 8) {
        PyErr_Format(PyExc_ValueError, "%s: bits must be 2, 4 or 8, got %d", fn, r->bits);
        return -1;
    }
    if (r->gs <= 0 || r->n <= 0 || r->n % r->gs || (r->gs * r->bits) % 8 || r->stype < 0 || r->stype > 2 || r->k < 0) {
        PyErr_Format(PyExc_ValueError, "%s: bad shape (n=%d, group_size=%d, k=%zd, scale type %d)", fn, r->n, r->gs, r->k,
                     r->stype);
        return -1;
    }
    Py_ssize_t vec_len = vec_is_rows ? r->k : r->n, out_len = vec_is_rows ? r->n : r->k;
    if (B->views[0].len != vec_len * 4 || B->views[1].len != out_len * 4) {
        PyErr_Format(PyExc_ValueError, "%s: vector has %zd bytes and out %zd, expected float32 [%zd] and [%zd]", fn,
                     B->views[0].len, B->views[1].len, vec_len, out_len);
        return -1;
    }
    Py_ssize_t max_row;
    if (parse_slots(B, r, slots, fn, &max_row)) return -1;
    Py_ssize_t scale_size = r->stype == SCALE_F32 ? 4 : 2, groups = r->n / r->gs;
    const Py_ssize_t offs[3] = {w_off, s_off, b_off}, strides[3] = {r->w_stride, r->s_stride, r->b_stride};
    const Py_ssize_t sizes[3] = {(Py_ssize_t)r->n * r->bits / 8, groups * scale_size, groups * scale_size};
    const char *names[3] = {"weights", "scales", "biases"};
    for (int i = 0; i < 3; i++) {
        if (offs[i] < 0 || strides[i] < 0 ||
            (max_row >= 0 && offs[i] + max_row * strides[i] + sizes[i] > B->views[2 + i].len)) {
            PyErr_Format(PyExc_IndexError, "%s: row %zd of the %s (offset %zd, stride %zd, %zd bytes) is outside its %zd-byte buffer",
                         fn, max_row, names[i], offs[i], strides[i], sizes[i], B->views[2 + i].len);
            return -1;
        }
    }
    r->w = (const uint8_t *)B->views[2].buf + w_off;
    r->s = (const uint8_t *)B->views[3].buf + s_off;
    r->b = (const uint8_t *)B->views[4].buf + b_off;
    return 0;
}

typedef void (*Product)(const Rows *, const float *, float *);

/* Parse, compute with the GIL released, release the buffers. */
static PyObject *run_product(PyObject *args, const char *fn, int vec_is_rows, Product product) {
    Buffers B;
    Rows r;
    if (parse(args, &B, &r, fn, vec_is_rows)) {
        release(&B);
        return NULL;
    }
    Py_BEGIN_ALLOW_THREADS product(&r, (const float *)B.views[0].buf, (float *)B.views[1].buf);
    Py_END_ALLOW_THREADS release(&B);
    Py_RETURN_NONE;
}

static PyObject *py_row_dot(PyObject *self, PyObject *args) {
    (void)self;
    return run_product(args, "row_dot", 0, row_dot_impl);
}

static PyObject *py_row_axpy(PyObject *self, PyObject *args) {
    (void)self;
    return run_product(args, "row_axpy", 1, row_axpy_impl);
}

/* block_axpy(vec, out, w, w_off, w_stride, slots, k, n, bits, blocks, S, B, n_blocks, scale_type, symmetric=False) */
static PyObject *py_block_axpy(PyObject *self, PyObject *args) {
    (void)self;
    PyObject *vec, *out, *w, *slots, *blocks, *S, *Bt;
    Py_ssize_t w_off, n_blocks;
    Buffers B;
    Rows r;
    Py_buffer blk;
    int have_blk = 0;
    memset(&B, 0, sizeof(B));
    memset(&r, 0, sizeof(r));
    if (!PyArg_ParseTuple(args, "OOOnnOniiOOOni|p", &vec, &out, &w, &w_off, &r.w_stride, &slots, &r.k, &r.n, &r.bits,
                          &blocks, &S, &Bt, &n_blocks, &r.stype, &r.sym))
        return NULL;
    r.gs = 32;
    const char *err = NULL;
    if (get(&B, 0, vec, 0, "vector") || get(&B, 1, out, 1, "out") || get(&B, 2, w, 0, "weights") ||
        get(&B, 3, S, 0, "scales") || get(&B, 4, Bt, 0, "biases"))
        goto fail;
    if ((r.bits != 2 && r.bits != 4 && r.bits != 8) || r.n <= 0 || r.n % 32 || r.k < 0 || r.stype < 0 || r.stype > 2 ||
        n_blocks <= 0)
        err = "block_axpy: bits must be 2, 4 or 8 and n a positive multiple of 32";
    else if (B.views[0].len != r.k * 4 || B.views[1].len != (Py_ssize_t)r.n * 4)
        err = "block_axpy: vector must be float32 [k] and out float32 [n]";
    else if (B.views[3].len < n_blocks * r.n * (r.stype == SCALE_F32 ? 4 : 2) || B.views[4].len != B.views[3].len)
        err = "block_axpy: scales and biases must be [n_blocks, n] of the scale type";
    if (err) {
        PyErr_SetString(PyExc_ValueError, err);
        goto fail;
    }
    if (PyObject_GetBuffer(blocks, &blk, PyBUF_C_CONTIGUOUS) != 0) goto fail;
    have_blk = 1;
    if (blk.len != r.k * 4) {
        PyErr_SetString(PyExc_ValueError, "block_axpy: blocks must be int32 [k]");
        goto fail;
    }
    const int32_t *bl = (const int32_t *)blk.buf;
    Py_ssize_t max_row;
    if (parse_slots(&B, &r, slots, "block_axpy", &max_row)) goto fail;
    for (Py_ssize_t j = 0; j < r.k; j++)
        if (bl[j] < 0 || bl[j] >= n_blocks) {
            PyErr_Format(PyExc_IndexError, "block_axpy: block %d outside [0, %zd)", bl[j], n_blocks);
            goto fail;
        }
    if (w_off < 0 || r.w_stride < 0 || (max_row >= 0 && w_off + max_row * r.w_stride + (Py_ssize_t)r.n * r.bits / 8 > B.views[2].len)) {
        PyErr_Format(PyExc_IndexError, "block_axpy: row %zd of the weights is outside their %zd-byte buffer", max_row,
                     B.views[2].len);
        goto fail;
    }
    r.w = (const uint8_t *)B.views[2].buf + w_off;
    float *scratch = PyMem_RawMalloc(3 * sizeof(float) * (size_t)r.n);
    if (scratch == NULL) {
        PyErr_NoMemory();
        goto fail;
    }
    Py_BEGIN_ALLOW_THREADS block_axpy_impl(&r, (const float *)B.views[0].buf, (float *)B.views[1].buf, bl,
                                           (const uint8_t *)B.views[3].buf, (const uint8_t *)B.views[4].buf, scratch);
    Py_END_ALLOW_THREADS PyMem_RawFree(scratch);
    PyBuffer_Release(&blk);
    release(&B);
    Py_RETURN_NONE;
fail:
    if (have_blk) PyBuffer_Release(&blk);
    release(&B);
    return NULL;
}

static PyObject *py_set_simd(PyObject *self, PyObject *arg) {
    (void)self;
    int on = PyObject_IsTrue(arg);
    if (on < 0) return NULL;
    simd_allowed = on;
    Py_RETURN_NONE;
}

static PyObject *py_info(PyObject *self, PyObject *noargs) {
    (void)self;
    (void)noargs;
    int threads = 1;
#ifdef _OPENMP
    threads = omp_get_max_threads();
#endif
    return Py_BuildValue("{s:i,s:i,s:i}", "avx2", cpu_has_avx2(), "simd", simd_allowed && cpu_has_avx2(), "threads",
                         threads);
}

#define ARGS_DOC                                                                                              \
    "(vec, out, w, w_off, w_stride, s, s_off, s_stride, b, b_off, b_stride, slots, k, n, bits, group_size, " \
    "scale_type, symmetric=False)\n"

static PyMethodDef methods[] = {
    {"row_dot", py_row_dot, METH_VARARGS,
     "row_dot" ARGS_DOC "out[j] = sum_i vec[i] W[slots[j]][i]; vec float32 [n], out float32 [k]"},
    {"row_axpy", py_row_axpy, METH_VARARGS,
     "row_axpy" ARGS_DOC "out[i] = sum_j vec[j] W[slots[j]][i]; vec float32 [k], out float32 [n]"},
    {"block_axpy", py_block_axpy, METH_VARARGS,
     "block_axpy(vec, out, w, w_off, w_stride, slots, k, n, bits, blocks, scales, biases, n_blocks, scale_type, "
     "symmetric=False)\n"
     "out[i] = sum_j vec[j] (S[blocks[j]][i] q_{slots[j]}[i] + B[blocks[j]][i]); rows hold codes only"},
    {"info", py_info, METH_NOARGS, "info() -> {'avx2': CPU has it, 'simd': AVX2 loops in use, 'threads': n}"},
    {"set_simd", py_set_simd, METH_O, "set_simd(on): use the AVX2 loops where the CPU has them (default) or the scalar ones"},
    {NULL, NULL, 0, NULL}};

static struct PyModuleDef module = {PyModuleDef_HEAD_INIT, "_cpu_gemv",
                                    "Quantised matrix-vector products on the CPU (kernels/cpu_gemv.c)", -1, methods,
                                    NULL, NULL, NULL, NULL};

PyMODINIT_FUNC PyInit__cpu_gemv(void) { return PyModule_Create(&module); }
