/* Attention over an fp16 KV cache, the ISA-independent part: half conversions, rotary, the cache
 * writes, softmax, and the portable inner loops (plain C, any architecture). See kv_attention.h. */
#include "kv_attention.h"

#include <math.h>
#include <stdlib.h>
#include <string.h>

float kv_half_to_float(uint16_t h) {
    uint32_t sign = (uint32_t)(h & 0x8000u) << 16, exponent = (h >> 10) & 0x1Fu, mantissa = h & 0x3FFu, bits;
    if (exponent == 0x1F) {
        bits = sign | 0x7F800000u | (mantissa << 13);
    } else if (exponent != 0) {
        bits = sign | ((exponent + 112) << 23) | (mantissa << 13);
    } else if (mantissa == 0) {
        bits = sign;
    } else { /* subnormal half: mantissa x 2^-24, exact in float */
        float value = (float)mantissa * 5.9604644775390625e-08f;
        memcpy(&bits, &value, 4);
        bits |= sign;
    }
    float out;
    memcpy(&out, &bits, 4);
    return out;
}

/* Round to nearest, ties to even (IEEE, F16C's and numpy's astype(float16)); overflow gives inf. */
uint16_t kv_float_to_half(float value) {
    uint32_t f;
    memcpy(&f, &value, 4);
    uint16_t sign = (uint16_t)((f & 0x80000000u) >> 16);
    uint32_t exponent = f & 0x7F800000u, mantissa;
    if (exponent >= 0x47800000u) { /* |f| >= 65536, inf or nan */
        mantissa = f & 0x007FFFFFu;
        if (exponent == 0x7F800000u && mantissa != 0) return (uint16_t)(sign | 0x7E00u | (mantissa >> 13));
        return (uint16_t)(sign | 0x7C00u);
    }
    if (exponent <= 0x38000000u) { /* a half subnormal or zero */
        if (exponent < 0x33000000u) return sign;
        exponent >>= 23;
        mantissa = 0x00800000u + (f & 0x007FFFFFu);
        mantissa >>= (113 - exponent);
        /* the shift may drop up to 11 bits: a tie only if they were zero too */
        if ((mantissa & 0x3FFFu) != 0x1000u || (f & 0x7FFu)) mantissa += 0x1000u;
        return (uint16_t)(sign + (mantissa >> 13));
    }
    uint32_t half_exponent = (exponent - 0x38000000u) >> 13;
    mantissa = f & 0x007FFFFFu;
    if ((mantissa & 0x3FFFu) != 0x1000u) mantissa += 0x1000u; /* a carry rounds into the exponent (inf at the top) */
    return (uint16_t)(sign + half_exponent + (mantissa >> 13));
}

/* ---- portable inner loops ----
 * Written so that a compiler vectorizes them without -ffast-math: a cache row is converted once
 * (branch-free), dot products keep eight independent partial sums, the weighted sum is elementwise. */

/* Half -> float without branches: the half's bits moved into a float's and scaled by 2^112 gives
 * every finite value, subnormals included, exactly; inf and nan are set apart. */
static inline float half_to_float_fast(uint16_t h) {
    uint32_t magnitude = (uint32_t)(h & 0x7FFFu) << 13, sign = (uint32_t)(h & 0x8000u) << 16, bits;
    float scaled;
    memcpy(&scaled, &magnitude, 4);
    scaled *= 0x1p112f;
    memcpy(&bits, &scaled, 4);
    bits = (h & 0x7C00u) == 0x7C00u ? (magnitude | 0x7F800000u) : bits;
    bits |= sign;
    float out;
    memcpy(&out, &bits, 4);
    return out;
}

static void row_to_float(const uint16_t *restrict row, float *restrict out, int64_t dim) {
    for (int64_t d = 0; d < dim; d++) out[d] = half_to_float_fast(row[d]);
}

#define LANES 8

static float dot_portable(const float *restrict a, const float *restrict b, int64_t dim) {
    float lane[LANES] = {0};
    int64_t d = 0;
    for (; d + LANES <= dim; d += LANES) {
        for (int l = 0; l < LANES; l++) lane[l] += a[d + l] * b[d + l];
    }
    for (; d < dim; d++) lane[0] += a[d] * b[d];
    return ((lane[0] + lane[4]) + (lane[1] + lane[5])) + ((lane[2] + lane[6]) + (lane[3] + lane[7]));
}

static void scores_portable(const uint16_t *k, int64_t keys, int64_t row, const float *q, int group, int64_t dim, float *out) {
    float kj[1024];
    for (int64_t j = 0; j < keys; j++) {
        row_to_float(k + j * row, kj, dim);
        for (int h = 0; h < group; h++) out[h * keys + j] = dot_portable(q + h * dim, kj, dim);
    }
}

static void accumulate_portable(const uint16_t *v, int64_t keys, int64_t row, const float *p, int group, int64_t dim,
                                float *acc) {
    float vj[1024];
    memset(acc, 0, sizeof(float) * (size_t)(group * dim));
    for (int64_t j = 0; j < keys; j++) {
        row_to_float(v + j * row, vj, dim);
        for (int h = 0; h < group; h++) {
            float w = p[h * keys + j], *restrict a = acc + h * dim;
            for (int64_t d = 0; d < dim; d++) a[d] += w * vj[d];
        }
    }
}

static void to_half_portable(const float *x, uint16_t *out, int64_t n) {
    for (int64_t i = 0; i < n; i++) out[i] = kv_float_to_half(x[i]);
}

static void exp_shifted_portable(float *x, int64_t n, float shift) {
    for (int64_t i = 0; i < n; i++) x[i] = expf(x[i] - shift);
}

void kv_attention_portable(kv_attention_kernels *kernels) {
    kernels->scores = scores_portable;
    kernels->accumulate = accumulate_portable;
    kernels->to_half = to_half_portable;
    kernels->exp_shifted = exp_shifted_portable;
}

/* ---- the op ---- */

static void rotate(float *x, const float *cos, const float *sin, int64_t pairs, int interleaved) {
    for (int64_t j = 0; j < pairs; j++) {
        int64_t i0 = interleaved ? 2 * j : j, i1 = interleaved ? 2 * j + 1 : j + pairs;
        float a = x[i0], b = x[i1];
        x[i0] = a * cos[j] - b * sin[j];
        x[i1] = b * cos[j] + a * sin[j];
    }
}

#define MAX_HEAD_DIM 1024

const char *kv_attention_prepare(kv_attention_job *job) {
    const int64_t D = job->dim, width = (job->heads + 2 * job->kv_heads) * D;
    float rotated[MAX_HEAD_DIM];
    if (D > MAX_HEAD_DIM) return "KvAttention: head dimension above 1024";
    if (job->rotary_pairs * 2 > D) return "KvAttention: the rotary tables are wider than a head";
    for (int64_t b = 0; b < job->batch; b++) {
        int64_t past = (int64_t)job->seqlens_k[b] + 1 - job->seq;
        if (past < 0 || (int64_t)job->seqlens_k[b] >= job->capacity) {
            return "KvAttention: seqlens_k must be at least seq - 1 and below the cache's capacity";
        }
        if (job->rotary_pairs && (int64_t)job->seqlens_k[b] >= job->rope_positions) {
            return "KvAttention: a position is past the rotary tables";
        }
        for (int64_t i = 0; i < job->seq; i++) {
            int64_t pos = past + i;
            const float *src = job->qkv + (b * job->seq + i) * width;
            const float *cos = job->cos + pos * job->rotary_pairs, *sin = job->sin + pos * job->rotary_pairs;
            float *q = job->q_rotated + (b * job->seq + i) * job->heads * D;
            memcpy(q, src, sizeof(float) * (size_t)(job->heads * D));
            for (int64_t h = 0; job->rotary_pairs && h < job->heads; h++) rotate(q + h * D, cos, sin, job->rotary_pairs, job->interleaved);
            for (int64_t h = 0; h < job->kv_heads; h++) {
                size_t at = (size_t)(((b * job->kv_heads + h) * job->capacity + pos) * D);
                memcpy(rotated, src + (job->heads + h) * D, sizeof(float) * (size_t)D);
                if (job->rotary_pairs) rotate(rotated, cos, sin, job->rotary_pairs, job->interleaved);
                job->kernels->to_half(rotated, job->key + at, D);
                job->kernels->to_half(src + (job->heads + job->kv_heads + h) * D, job->value + at, D);
            }
        }
    }
    return NULL;
}

int kv_attention_task(const kv_attention_job *job, int64_t task) {
    const int64_t D = job->dim, i = task % job->seq, kvh = task / job->seq % job->kv_heads, b = task / job->seq / job->kv_heads;
    const int group = (int)(job->heads / job->kv_heads);
    int64_t pos = (int64_t)job->seqlens_k[b] + 1 - job->seq + i;
    int64_t lo = job->window > 0 && pos - job->window + 1 > 0 ? pos - job->window + 1 : 0, keys = pos - lo + 1;
    float *scores = malloc(sizeof(float) * (size_t)(group * keys + group * D));
    if (scores == NULL) return -1;
    float *acc = scores + group * keys, inverse[256];
    const float *q = job->q_rotated + ((b * job->seq + i) * job->heads + kvh * group) * D;
    size_t base = (size_t)(((b * job->kv_heads + kvh) * job->capacity + lo) * D);
    job->kernels->scores(job->key + base, keys, D, q, group, D, scores);
    for (int h = 0; h < group; h++) {
        float *row = scores + h * keys, top = -INFINITY, sum = 0.0f;
        for (int64_t j = 0; j < keys; j++) {
            float x = row[j] * job->scale;
            if (job->softcap > 0.0f) x = job->softcap * tanhf(x / job->softcap);
            row[j] = x;
            top = x > top ? x : top;
        }
        /* a sink: one more logit in the softmax whose value row is zero (ggml's soft_max with sinks) */
        float sink = job->sinks != NULL ? job->sinks[kvh * group + h] : -INFINITY;
        top = sink > top ? sink : top;
        job->kernels->exp_shifted(row, keys, top);
        for (int64_t j = 0; j < keys; j++) sum += row[j];
        if (job->sinks != NULL) sum += expf(sink - top);
        inverse[h] = 1.0f / sum;
    }
    job->kernels->accumulate(job->value + base, keys, D, scores, group, D, acc);
    float *out = job->out + ((b * job->seq + i) * job->heads + kvh * group) * D;
    for (int h = 0; h < group; h++) {
        for (int64_t d = 0; d < D; d++) out[h * D + d] = acc[h * D + d] * inverse[h];
    }
    free(scores);
    return 0;
}
