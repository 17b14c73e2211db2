/* The fp16-KV attention's inner loops with ARMv8 Advanced SIMD (baseline on every ARM64 CPU): half
 * <-> float conversions in hardware (round to nearest even, as F16C and numpy), four-lane FMAs, and
 * query heads by passes of up to four as in kv_attention_avx2.c. Used for head dimensions that are
 * multiples of 16. */
#include <arm_neon.h>
#include <string.h>

#include "kv_attention.h"

static inline float32x4_t halves4(const uint16_t *p) { return vcvt_f32_f16(vreinterpret_f16_u16(vld1_u16(p))); }

static inline __attribute__((always_inline)) void scores_pass(const uint16_t *k, int64_t keys, int64_t row, const float *q,
                                                              int64_t dim, float *out, const int n) {
    for (int64_t j = 0; j < keys; j++) {
        const uint16_t *kj = k + j * row;
        float32x4_t acc[4][4];
        for (int h = 0; h < n; h++) acc[h][0] = acc[h][1] = acc[h][2] = acc[h][3] = vdupq_n_f32(0.0f);
        for (int64_t d = 0; d < dim; d += 16) {
            float32x4_t k0 = halves4(kj + d), k1 = halves4(kj + d + 4), k2 = halves4(kj + d + 8), k3 = halves4(kj + d + 12);
            for (int h = 0; h < n; h++) {
                const float *qh = q + h * dim + d;
                acc[h][0] = vfmaq_f32(acc[h][0], vld1q_f32(qh), k0);
                acc[h][1] = vfmaq_f32(acc[h][1], vld1q_f32(qh + 4), k1);
                acc[h][2] = vfmaq_f32(acc[h][2], vld1q_f32(qh + 8), k2);
                acc[h][3] = vfmaq_f32(acc[h][3], vld1q_f32(qh + 12), k3);
            }
        }
        for (int h = 0; h < n; h++) {
            out[h * keys + j] = vaddvq_f32(vaddq_f32(vaddq_f32(acc[h][0], acc[h][1]), vaddq_f32(acc[h][2], acc[h][3])));
        }
    }
}

static void scores_neon(const uint16_t *k, int64_t keys, int64_t row, const float *q, int group, int64_t dim, float *out) {
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
        float32x4_t a[4][4];
        for (int h = 0; h < n; h++) a[h][0] = a[h][1] = a[h][2] = a[h][3] = vdupq_n_f32(0.0f);
        for (int64_t j = 0; j < keys; j++) {
            const uint16_t *vj = v + j * row + d;
            float32x4_t v0 = halves4(vj), v1 = halves4(vj + 4), v2 = halves4(vj + 8), v3 = halves4(vj + 12);
            for (int h = 0; h < n; h++) {
                float w = p[h * keys + j];
                a[h][0] = vfmaq_n_f32(a[h][0], v0, w);
                a[h][1] = vfmaq_n_f32(a[h][1], v1, w);
                a[h][2] = vfmaq_n_f32(a[h][2], v2, w);
                a[h][3] = vfmaq_n_f32(a[h][3], v3, w);
            }
        }
        for (int h = 0; h < n; h++) {
            for (int i = 0; i < 4; i++) vst1q_f32(acc + h * dim + d + 4 * i, a[h][i]);
        }
    }
}

static void accumulate_neon(const uint16_t *v, int64_t keys, int64_t row, const float *p, int group, int64_t dim, float *acc) {
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

static void to_half_neon(const float *x, uint16_t *out, int64_t n) {
    int64_t i = 0;
    for (; i + 4 <= n; i += 4) vst1_u16(out + i, vreinterpret_u16_f16(vcvt_f16_f32(vld1q_f32(x + i))));
    for (; i < n; i++) out[i] = kv_float_to_half(x[i]);
}

/* exp(x) for x <= 0, as kv_attention_avx2.c computes it: 2^n p(r), the degree-6 Taylor polynomial. */
static inline float32x4_t exp_nonpositive(float32x4_t x) {
    const float32x4_t lo = vdupq_n_f32(-87.0f);
    uint32x4_t small = vcltq_f32(x, lo);
    x = vmaxq_f32(x, lo);
    float32x4_t n = vrndnq_f32(vmulq_n_f32(x, 1.44269504088896341f));
    float32x4_t r = vfmsq_f32(x, n, vdupq_n_f32(0.693359375f));
    r = vfmsq_f32(r, n, vdupq_n_f32(-2.12194440e-4f));
    float32x4_t p = vdupq_n_f32(1.0f / 720.0f);
    p = vfmaq_f32(vdupq_n_f32(1.0f / 120.0f), p, r);
    p = vfmaq_f32(vdupq_n_f32(1.0f / 24.0f), p, r);
    p = vfmaq_f32(vdupq_n_f32(1.0f / 6.0f), p, r);
    p = vfmaq_f32(vdupq_n_f32(0.5f), p, r);
    p = vfmaq_f32(vdupq_n_f32(1.0f), p, r);
    p = vfmaq_f32(vdupq_n_f32(1.0f), p, r);
    int32x4_t scale = vshlq_n_s32(vaddq_s32(vcvtq_s32_f32(n), vdupq_n_s32(127)), 23);
    float32x4_t y = vmulq_f32(p, vreinterpretq_f32_s32(scale));
    return vreinterpretq_f32_u32(vbicq_u32(vreinterpretq_u32_f32(y), small));
}

static void exp_shifted_neon(float *x, int64_t n, float shift) {
    int64_t i = 0;
    float32x4_t s = vdupq_n_f32(shift);
    for (; i + 4 <= n; i += 4) vst1q_f32(x + i, exp_nonpositive(vsubq_f32(vld1q_f32(x + i), s)));
    if (i < n) { /* the tail through the same vector arithmetic */
        float tail[4] = {0};
        memcpy(tail, x + i, sizeof(float) * (size_t)(n - i));
        vst1q_f32(tail, exp_nonpositive(vsubq_f32(vld1q_f32(tail), s)));
        memcpy(x + i, tail, sizeof(float) * (size_t)(n - i));
    }
}

void kv_attention_neon(kv_attention_kernels *kernels) {
    kernels->scores = scores_neon;
    kernels->accumulate = accumulate_neon;
    kernels->to_half = to_half_neon;
    kernels->exp_shifted = exp_shifted_neon;
}
