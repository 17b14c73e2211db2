/* The fp16-KV attention's inner loops with AVX2 + FMA + F16C (compiled with those flags alone; used
 * only after cpuid says the CPU has them, for head dimensions that are multiples of 16). Query heads
 * go up to four at a time against each cache row, so a row of halves is converted once per pass. */
#include <immintrin.h>
#include <string.h>

#include "kv_attention.h"

static inline float hsum_ps(__m256 v) {
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    s = _mm_add_ss(s, _mm_movehdup_ps(s));
    return _mm_cvtss_f32(s);
}

static inline __m256 halves8(const uint16_t *p) { return _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)p)); }

/* One pass: `n` (1..4, a constant after inlining) query heads against every key, a key's row of
 * halves converted once for them all. A group of heads goes by passes of up to four (6 = 4 + 2,
 * 7 = 4 + 3): every head's sums are the same whatever pass it falls in. */
static inline __attribute__((always_inline)) void scores_pass(const uint16_t *k, int64_t keys, int64_t row, const float *q,
                                                              int64_t dim, float *out, const int n) {
    for (int64_t j = 0; j < keys; j++) {
        const uint16_t *kj = k + j * row;
        __m256 acc[4][2];
        for (int h = 0; h < n; h++) acc[h][0] = acc[h][1] = _mm256_setzero_ps();
        for (int64_t d = 0; d < dim; d += 16) {
            __m256 k0 = halves8(kj + d), k1 = halves8(kj + d + 8);
            for (int h = 0; h < n; h++) {
                acc[h][0] = _mm256_fmadd_ps(_mm256_loadu_ps(q + h * dim + d), k0, acc[h][0]);
                acc[h][1] = _mm256_fmadd_ps(_mm256_loadu_ps(q + h * dim + d + 8), k1, acc[h][1]);
            }
        }
        for (int h = 0; h < n; h++) out[h * keys + j] = hsum_ps(_mm256_add_ps(acc[h][0], acc[h][1]));
    }
}

static void scores_avx2(const uint16_t *k, int64_t keys, int64_t row, const float *q, int group, int64_t dim, float *out) {
    for (int h0 = 0; h0 < group; h0 += 4) {
        const float *qh = q + h0 * dim;
        float *o = out + h0 * keys;
        switch (group - h0 < 4 ? group - h0 : 4) {
        case 1: scores_pass(k, keys, row, qh, dim, o, 1); break;
        case 2: scores_pass(k, keys, row, qh, dim, o, 2); break;
        case 3: scores_pass(k, keys, row, qh, dim, o, 3); break;
        default: scores_pass(k, keys, row, qh, dim, o, 4); break;
        }
    }
}

static inline __attribute__((always_inline)) void accumulate_pass(const uint16_t *v, int64_t keys, int64_t row, const float *p,
                                                                  int64_t dim, float *acc, const int n) {
    for (int64_t d = 0; d < dim; d += 16) {
        __m256 a[4][2];
        for (int h = 0; h < n; h++) a[h][0] = a[h][1] = _mm256_setzero_ps();
        for (int64_t j = 0; j < keys; j++) {
            __m256 v0 = halves8(v + j * row + d), v1 = halves8(v + j * row + d + 8);
            for (int h = 0; h < n; h++) {
                __m256 w = _mm256_broadcast_ss(p + h * keys + j);
                a[h][0] = _mm256_fmadd_ps(w, v0, a[h][0]);
                a[h][1] = _mm256_fmadd_ps(w, v1, a[h][1]);
            }
        }
        for (int h = 0; h < n; h++) {
            _mm256_storeu_ps(acc + h * dim + d, a[h][0]);
            _mm256_storeu_ps(acc + h * dim + d + 8, a[h][1]);
        }
    }
}

static void accumulate_avx2(const uint16_t *v, int64_t keys, int64_t row, const float *p, int group, int64_t dim, float *acc) {
    for (int h0 = 0; h0 < group; h0 += 4) {
        const float *ph = p + h0 * keys;
        float *a = acc + h0 * dim;
        switch (group - h0 < 4 ? group - h0 : 4) {
        case 1: accumulate_pass(v, keys, row, ph, dim, a, 1); break;
        case 2: accumulate_pass(v, keys, row, ph, dim, a, 2); break;
        case 3: accumulate_pass(v, keys, row, ph, dim, a, 3); break;
        default: accumulate_pass(v, keys, row, ph, dim, a, 4); break;
        }
    }
}

static void to_half_avx2(const float *x, uint16_t *out, int64_t n) {
    int64_t i = 0;
    for (; i + 8 <= n; i += 8) {
        _mm_storeu_si128((__m128i *)(out + i), _mm256_cvtps_ph(_mm256_loadu_ps(x + i), _MM_FROUND_TO_NEAREST_INT));
    }
    for (; i < n; i++) out[i] = kv_float_to_half(x[i]);
}

/* exp(x) for x <= 0 (softmax after the max is subtracted): 2^n * p(r), x = n ln2 + r, |r| <= ln2/2,
 * p the degree-6 Taylor polynomial (relative error ~2e-7, near expf's); below -87 it gives 0. */
static inline __m256 exp_nonpositive(__m256 x) {
    const __m256 lo = _mm256_set1_ps(-87.0f);
    __m256 small = _mm256_cmp_ps(x, lo, _CMP_LT_OQ);
    x = _mm256_max_ps(x, lo);
    __m256 n = _mm256_round_ps(_mm256_mul_ps(x, _mm256_set1_ps(1.44269504088896341f)), _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    __m256 r = _mm256_fnmadd_ps(n, _mm256_set1_ps(0.693359375f), x); /* ln2 in two parts: r exact-ish */
    r = _mm256_fnmadd_ps(n, _mm256_set1_ps(-2.12194440e-4f), r);
    __m256 p = _mm256_set1_ps(1.0f / 720.0f);
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.0f / 120.0f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.0f / 24.0f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.0f / 6.0f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(0.5f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.0f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.0f));
    __m256i scale = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23);
    return _mm256_andnot_ps(small, _mm256_mul_ps(p, _mm256_castsi256_ps(scale)));
}

static void exp_shifted_avx2(float *x, int64_t n, float shift) {
    int64_t i = 0;
    __m256 s = _mm256_set1_ps(shift);
    for (; i + 8 <= n; i += 8) _mm256_storeu_ps(x + i, exp_nonpositive(_mm256_sub_ps(_mm256_loadu_ps(x + i), s)));
    if (i < n) { /* the tail through the same vector arithmetic: a key's weight never depends on where it falls */
        float tail[8] = {0};
        memcpy(tail, x + i, sizeof(float) * (size_t)(n - i));
        _mm256_storeu_ps(tail, exp_nonpositive(_mm256_sub_ps(_mm256_loadu_ps(tail), s)));
        memcpy(x + i, tail, sizeof(float) * (size_t)(n - i));
    }
}

void kv_attention_avx2(kv_attention_kernels *kernels) {
    kernels->scores = scores_avx2;
    kernels->accumulate = accumulate_avx2;
    kernels->to_half = to_half_avx2;
    kernels->exp_shifted = exp_shifted_avx2;
}
