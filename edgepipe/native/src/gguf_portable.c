/* Portable C kernels: activation quantization (shared by every ISA, so every path sees the same
 * 8-bit activations) and a dot product per GGUF block type, integer sums within each block. */
#include <math.h>
#include <string.h>

#include "gguf_kernels.h"

static const gguf_type_info TYPE_INFO[GGUF_TYPE_SLOTS] = {
#define TYPE_INFO_ROW(NAME, name, id, values, bytes, act) [id] = {values, bytes, act},
    GGUF_TYPES(TYPE_INFO_ROW)
#undef TYPE_INFO_ROW
};

const gguf_type_info *gguf_type(int qtype) {
    if (qtype < 0 || qtype >= GGUF_TYPE_SLOTS || TYPE_INFO[qtype].block_values == 0) return NULL;
    return &TYPE_INFO[qtype];
}

float gguf_half_to_float(uint16_t h) {
    uint32_t sign = (uint32_t)(h & 0x8000u) << 16;
    uint32_t exponent = (h >> 10) & 0x1Fu;
    uint32_t mantissa = h & 0x3FFu;
    uint32_t bits;
    if (exponent == 0x1F) {
        bits = sign | 0x7F800000u | (mantissa << 13);
    } else if (exponent != 0) {
        bits = sign | ((exponent + 112) << 23) | (mantissa << 13);
    } else if (mantissa == 0) {
        bits = sign;
    } else { /* subnormal half: value = mantissa * 2^-24, exact in float */
        float value = (float)mantissa * 5.9604644775390625e-08f;
        memcpy(&bits, &value, 4);
        bits |= sign;
    }
    float out;
    memcpy(&out, &bits, 4);
    return out;
}

static inline float half_at(const uint8_t *p) { return gguf_half_to_float((uint16_t)(p[0] | (p[1] << 8))); }

/* d = amax / 127 and q = rint(x * (127 / amax)): the rule the numpy reference in the tests repeats. */
static float quantize_span(const float *x, int8_t *q, int n) {
    float lane_max[8] = {0}; /* n is a multiple of 32: eight independent maxima, then theirs (the same value) */
    for (int i = 0; i < n; i += 8) {
        for (int j = 0; j < 8; j++) {
            float a = fabsf(x[i + j]);
            lane_max[j] = a > lane_max[j] ? a : lane_max[j];
        }
    }
    float amax = 0.0f;
    for (int j = 0; j < 8; j++) amax = lane_max[j] > amax ? lane_max[j] : amax;
    if (amax == 0.0f) {
        memset(q, 0, (size_t)n);
        return 0.0f;
    }
    float inverse = 127.0f / amax;
    /* rint by the 1.5 x 2^23 addition: for |v| <= 127 the sum's last place is 1, so the addition
     * rounds v to an integer half to even, as nearbyintf does, without a libm call per value */
    const float shift = 12582912.0f;
    for (int i = 0; i < n; i++) {
        float v = x[i] * inverse;
        q[i] = (int8_t)(int)((v + shift) - shift);
    }
    return amax / 127.0f;
}

void gguf_quantize_row256(const float *x, act_block256 *out, int64_t k) {
    for (int64_t b = 0; b < k / 256; b++) {
        act_block256 *blk = &out[b];
        blk->d = quantize_span(x + b * 256, blk->qs, 256);
        for (int g = 0; g < 16; g++) {
            int sum = 0;
            for (int i = 0; i < 16; i++) sum += blk->qs[g * 16 + i];
            blk->bsums[g] = (int16_t)sum;
        }
    }
}

void gguf_quantize_row32(const float *x, act_block32 *out, int64_t k) {
    for (int64_t b = 0; b < k / 32; b++) {
        act_block32 *blk = &out[b];
        blk->d = quantize_span(x + b * 32, blk->qs, 32);
        int sum = 0;
        for (int i = 0; i < 32; i++) sum += blk->qs[i];
        blk->ds = blk->d * (float)sum;
    }
}

/* ---- 32-blocks: element i < 16 is the low nibble of qs[i], element i + 16 its high nibble ---- */

static float dot_q4_0(int64_t nb, const uint8_t *w, const void *xv) {
    const act_block32 *x = xv;
    float sum = 0.0f;
    for (int64_t b = 0; b < nb; b++, w += 18) {
        const uint8_t *qs = w + 2;
        int isum = 0;
        for (int i = 0; i < 16; i++) {
            isum += (qs[i] & 0x0F) * x[b].qs[i] + (qs[i] >> 4) * x[b].qs[i + 16];
        }
        sum += half_at(w) * (x[b].d * (float)isum - 8.0f * x[b].ds);
    }
    return sum;
}

static float dot_q4_1(int64_t nb, const uint8_t *w, const void *xv) {
    const act_block32 *x = xv;
    float sum = 0.0f;
    for (int64_t b = 0; b < nb; b++, w += 20) {
        const uint8_t *qs = w + 4;
        int isum = 0;
        for (int i = 0; i < 16; i++) {
            isum += (qs[i] & 0x0F) * x[b].qs[i] + (qs[i] >> 4) * x[b].qs[i + 16];
        }
        sum += half_at(w) * x[b].d * (float)isum + half_at(w + 2) * x[b].ds;
    }
    return sum;
}

static inline int five_bit_sum(const uint8_t *qh_bytes, const uint8_t *qs, const int8_t *xq) {
    uint32_t qh = (uint32_t)qh_bytes[0] | ((uint32_t)qh_bytes[1] << 8) | ((uint32_t)qh_bytes[2] << 16) |
                  ((uint32_t)qh_bytes[3] << 24);
    int isum = 0;
    for (int i = 0; i < 16; i++) {
        int lo = (qs[i] & 0x0F) | (int)(((qh >> i) & 1u) << 4);
        int hi = (qs[i] >> 4) | (int)(((qh >> (i + 16)) & 1u) << 4);
        isum += lo * xq[i] + hi * xq[i + 16];
    }
    return isum;
}

static float dot_q5_0(int64_t nb, const uint8_t *w, const void *xv) {
    const act_block32 *x = xv;
    float sum = 0.0f;
    for (int64_t b = 0; b < nb; b++, w += 22) {
        int isum = five_bit_sum(w + 2, w + 6, x[b].qs);
        sum += half_at(w) * (x[b].d * (float)isum - 16.0f * x[b].ds);
    }
    return sum;
}

static float dot_q5_1(int64_t nb, const uint8_t *w, const void *xv) {
    const act_block32 *x = xv;
    float sum = 0.0f;
    for (int64_t b = 0; b < nb; b++, w += 24) {
        int isum = five_bit_sum(w + 4, w + 8, x[b].qs);
        sum += half_at(w) * x[b].d * (float)isum + half_at(w + 2) * x[b].ds;
    }
    return sum;
}

static float dot_q8_0(int64_t nb, const uint8_t *w, const void *xv) {
    const act_block32 *x = xv;
    float sum = 0.0f;
    for (int64_t b = 0; b < nb; b++, w += 34) {
        const int8_t *qs = (const int8_t *)(w + 2);
        int isum = 0;
        for (int i = 0; i < 32; i++) isum += qs[i] * x[b].qs[i];
        sum += half_at(w) * x[b].d * (float)isum;
    }
    return sum;
}

/* MXFP4: exponent byte e, then element i < 16 in the low nibble of qs[i] and i + 16 in its high
 * nibble, each a code into the doubled E2M1 values; d = 2^(e - 128). */
static float dot_mxfp4(int64_t nb, const uint8_t *w, const void *xv) {
    const act_block32 *x = xv;
    float sum = 0.0f;
    for (int64_t b = 0; b < nb; b++, w += 17) {
        const uint8_t *qs = w + 1;
        int isum = 0;
        for (int i = 0; i < 16; i++) {
            isum += GGUF_KVALUES_MXFP4[qs[i] & 0x0F] * x[b].qs[i] + GGUF_KVALUES_MXFP4[qs[i] >> 4] * x[b].qs[i + 16];
        }
        sum += gguf_e8m0_half(w[0]) * x[b].d * (float)isum;
    }
    return sum;
}

/* ---- k-quants: 256 values, eight 32-wide sub-blocks with 6-bit scales and minimums ---- */

/* Unpack the 12 bytes of Q4_K/Q5_K scales into eight scales and eight minimums. */
static inline void unpack_k_scales(const uint8_t *s, uint8_t *scale, uint8_t *minimum) {
    for (int j = 0; j < 4; j++) {
        scale[j] = s[j] & 63;
        minimum[j] = s[j + 4] & 63;
    }
    for (int j = 4; j < 8; j++) {
        scale[j] = (uint8_t)((s[j + 4] & 0x0F) | ((s[j - 4] >> 6) << 4));
        minimum[j] = (uint8_t)((s[j + 4] >> 4) | ((s[j] >> 6) << 4));
    }
}

static float dot_q4_k(int64_t nb, const uint8_t *w, const void *xv) {
    const act_block256 *x = xv;
    float sum = 0.0f;
    for (int64_t b = 0; b < nb; b++, w += 144) {
        uint8_t scale[8], minimum[8];
        unpack_k_scales(w + 4, scale, minimum);
        const uint8_t *qs = w + 16;
        const int8_t *xq = x[b].qs;
        int isum = 0, msum = 0;
        for (int j = 0; j < 8; j++) {
            const uint8_t *src = qs + 32 * (j / 2);
            int shift = 4 * (j % 2), sub = 0;
            for (int l = 0; l < 32; l++) sub += ((src[l] >> shift) & 0x0F) * xq[32 * j + l];
            isum += scale[j] * sub;
            msum += minimum[j] * (x[b].bsums[2 * j] + x[b].bsums[2 * j + 1]);
        }
        sum += x[b].d * (half_at(w) * (float)isum - half_at(w + 2) * (float)msum);
    }
    return sum;
}

static float dot_q5_k(int64_t nb, const uint8_t *w, const void *xv) {
    const act_block256 *x = xv;
    float sum = 0.0f;
    for (int64_t b = 0; b < nb; b++, w += 176) {
        uint8_t scale[8], minimum[8];
        unpack_k_scales(w + 4, scale, minimum);
        const uint8_t *qh = w + 16, *qs = w + 48;
        const int8_t *xq = x[b].qs;
        int isum = 0, msum = 0;
        for (int j = 0; j < 8; j++) {
            const uint8_t *src = qs + 32 * (j / 2);
            int shift = 4 * (j % 2), sub = 0;
            for (int l = 0; l < 32; l++) {
                int q = ((src[l] >> shift) & 0x0F) | (((qh[l] >> j) & 1) << 4);
                sub += q * xq[32 * j + l];
            }
            isum += scale[j] * sub;
            msum += minimum[j] * (x[b].bsums[2 * j] + x[b].bsums[2 * j + 1]);
        }
        sum += x[b].d * (half_at(w) * (float)isum - half_at(w + 2) * (float)msum);
    }
    return sum;
}

/* Q6_K: 128 bytes of low nibbles, 64 of high 2-bit pairs, 16 signed 8-bit scales (one per 16
 * values), fp16 d. Value p = 128 h + r takes its nibble from ql[64 h + r % 64] (shift 4 (r / 64))
 * and its high bits from qh[32 h + r % 32] (shift 2 (r / 32)); q - 32 is the signed value. */
static float dot_q6_k(int64_t nb, const uint8_t *w, const void *xv) {
    const act_block256 *x = xv;
    float sum = 0.0f;
    for (int64_t b = 0; b < nb; b++, w += 210) {
        const uint8_t *ql = w, *qh = w + 128;
        const int8_t *scales = (const int8_t *)(w + 192);
        const int8_t *xq = x[b].qs;
        int isum = 0;
        for (int g = 0; g < 16; g++) {
            int sub = 0;
            for (int i = 0; i < 16; i++) {
                int p = 16 * g + i, h = p / 128, r = p % 128;
                int low = (ql[64 * h + r % 64] >> (4 * (r / 64))) & 0x0F;
                int high = (qh[32 * h + r % 32] >> (2 * (r / 32))) & 0x03;
                sub += (low | (high << 4)) * xq[p];
            }
            isum += scales[g] * (sub - 32 * x[b].bsums[g]);
        }
        sum += x[b].d * half_at(w + 208) * (float)isum;
    }
    return sum;
}

/* ---- dequantization of whole rows (embedding gathers): the same float operations, in the same
 * order, as gguf-py's dequantize, so the values are equal bit for bit ---- */

void gguf_dequantize_row(int qtype, const uint8_t *w, float *out, int64_t k) {
    const gguf_type_info *type = gguf_type(qtype);
    for (int64_t b = 0; b < k / type->block_values; b++, w += type->block_bytes) {
        float *y = out + b * type->block_values;
        switch (qtype) {
        case GGUF_Q4_0:
        case GGUF_Q4_1: {
            int has_min = qtype == GGUF_Q4_1;
            float d = half_at(w), m = has_min ? half_at(w + 2) : 0.0f;
            const uint8_t *qs = w + (has_min ? 4 : 2);
            for (int i = 0; i < 16; i++) {
                int lo = qs[i] & 0x0F, hi = qs[i] >> 4;
                y[i] = has_min ? d * (float)lo + m : d * (float)(lo - 8);
                y[i + 16] = has_min ? d * (float)hi + m : d * (float)(hi - 8);
            }
            break;
        }
        case GGUF_Q5_0:
        case GGUF_Q5_1: {
            int has_min = qtype == GGUF_Q5_1;
            float d = half_at(w), m = has_min ? half_at(w + 2) : 0.0f;
            const uint8_t *qhp = w + (has_min ? 4 : 2), *qs = qhp + 4;
            uint32_t qh = (uint32_t)qhp[0] | ((uint32_t)qhp[1] << 8) | ((uint32_t)qhp[2] << 16) | ((uint32_t)qhp[3] << 24);
            for (int i = 0; i < 16; i++) {
                int lo = (qs[i] & 0x0F) | (int)(((qh >> i) & 1u) << 4);
                int hi = (qs[i] >> 4) | (int)(((qh >> (i + 16)) & 1u) << 4);
                y[i] = has_min ? d * (float)lo + m : d * (float)(lo - 16);
                y[i + 16] = has_min ? d * (float)hi + m : d * (float)(hi - 16);
            }
            break;
        }
        case GGUF_Q8_0: {
            float d = half_at(w);
            for (int i = 0; i < 32; i++) y[i] = d * (float)(int8_t)w[2 + i];
            break;
        }
        case GGUF_Q4_K:
        case GGUF_Q5_K: {
            uint8_t scale[8], minimum[8];
            unpack_k_scales(w + 4, scale, minimum);
            float d = half_at(w), dmin = half_at(w + 2);
            const uint8_t *qh = w + 16, *qs = w + (qtype == GGUF_Q4_K ? 16 : 48);
            for (int j = 0; j < 8; j++) {
                float dl = d * (float)scale[j], ml = dmin * (float)minimum[j];
                const uint8_t *src = qs + 32 * (j / 2);
                for (int l = 0; l < 32; l++) {
                    int q = (src[l] >> (4 * (j % 2))) & 0x0F;
                    if (qtype == GGUF_Q5_K) q |= ((qh[l] >> j) & 1) << 4;
                    y[32 * j + l] = dl * (float)q - ml;
                }
            }
            break;
        }
        case GGUF_Q6_K: {
            const uint8_t *ql = w, *qh = w + 128;
            const int8_t *scales = (const int8_t *)(w + 192);
            float d = half_at(w + 208);
            for (int p = 0; p < 256; p++) {
                int h = p / 128, r = p % 128;
                int low = (ql[64 * h + r % 64] >> (4 * (r / 64))) & 0x0F;
                int high = (qh[32 * h + r % 32] >> (2 * (r / 32))) & 0x03;
                y[p] = (d * (float)scales[p / 16]) * (float)((low | (high << 4)) - 32);
            }
            break;
        }
        case GGUF_MXFP4: {
            float d = gguf_e8m0_half(w[0]);
            for (int i = 0; i < 16; i++) {
                y[i] = d * (float)GGUF_KVALUES_MXFP4[w[1 + i] & 0x0F];
                y[i + 16] = d * (float)GGUF_KVALUES_MXFP4[w[1 + i] >> 4];
            }
            break;
        }
        default:
            break;
        }
    }
}

/* The portable path runs a tile row by row: the same arithmetic, no shared unpacking. */
#define ROWS_BY_DOT(name)                                                                               \
    static void rows_##name(int64_t nb, const uint8_t *w, int64_t weight_rows, int64_t row_bytes,       \
                            const void *x, size_t x_stride, const act_tile_scales32 *scales, int rows, \
                            float *y, size_t y_stride) {                                               \
        (void)scales;                                                                                  \
        for (int64_t i = 0; i < weight_rows; i++)                                                      \
            for (int r = 0; r < rows; r++)                                                             \
                y[r * y_stride + i] = dot_##name(nb, w + i * row_bytes, (const char *)x + r * x_stride); \
    }
#define PORTABLE_ROWS(NAME, name, id, values, bytes, act) ROWS_BY_DOT(name)
GGUF_TYPES(PORTABLE_ROWS)
#undef PORTABLE_ROWS

void gguf_table_portable(gguf_kernel_table *table) {
    memset(table, 0, sizeof *table);
#define ENTRY(NAME, name, id, values, bytes, act) table->rows[GGUF_##NAME] = rows_##name;
    GGUF_TYPES(ENTRY)
#undef ENTRY
}
