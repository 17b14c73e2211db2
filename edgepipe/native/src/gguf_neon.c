/* ARM64 NEON kernels (built for every aarch64 CPU; gguf_neon_dotprod.c rebuilds this file with the
 * dot-product instructions, taken only where the CPU reports them). Each block's integer sums are
 * vector work; the block's float arithmetic is the portable kernel's, operation for operation, so
 * a NEON result equals the portable one bit for bit (the emulated test checks it), and a row's
 * result does not depend on how many rows share a tile. */
#include <arm_neon.h>
#include <string.h>

#include "gguf_kernels.h"

#ifndef gguf_table_neon_name
#define gguf_table_neon_name gguf_table_neon
#endif

static inline float half_at(const uint8_t *p) { return gguf_half_to_float((uint16_t)(p[0] | (p[1] << 8))); }

/* acc + the products of 16 signed bytes, summed in groups of four (dot product) or of two. */
static inline int32x4_t dot16(int32x4_t acc, int8x16_t a, int8x16_t b) {
#ifdef GGUF_USE_DOTPROD
    return vdotq_s32(acc, a, b);
#else
    acc = vpadalq_s16(acc, vmull_s8(vget_low_s8(a), vget_low_s8(b)));
    return vpadalq_s16(acc, vmull_high_s8(a, b));
#endif
}

/* Sum over 32 values: codes c0, c1 (values 0-15, 16-31) against activations x. */
static inline int dot32(int8x16_t c0, int8x16_t c1, const int8_t *x) {
    int32x4_t acc = dot16(vdupq_n_s32(0), c0, vld1q_s8(x));
    return vaddvq_s32(dot16(acc, c1, vld1q_s8(x + 16)));
}

/* Bit i of the 16 bits `bits` -> 0x10 in byte i. */
static inline uint8x16_t high_plane16(uint32_t bits) {
    static const uint8_t lane_bit[16] = {1, 2, 4, 8, 16, 32, 64, 128, 1, 2, 4, 8, 16, 32, 64, 128};
    uint8x16_t bytes = vcombine_u8(vdup_n_u8((uint8_t)(bits & 0xFF)), vdup_n_u8((uint8_t)((bits >> 8) & 0xFF)));
    return vandq_u8(vtstq_u8(bytes, vld1q_u8(lane_bit)), vdupq_n_u8(0x10));
}

#define ACT_ROW(type, x, stride, r) ((const type *)((const char *)(x) + (size_t)(r) * (stride)))
#define TILE_KERNEL static inline __attribute__((always_inline)) void

/* 32-blocks: codes unpacked once per block, each row's sum as in gguf_portable.c. */
TILE_KERNEL tile_32(const int qtype, int64_t nb, const uint8_t *w, const void *xv, size_t xs, const int rows, float *y, size_t ys) {
    const int block_bytes = gguf_block_bytes(qtype);
    const act_block32 *x[GGUF_TILE_ROWS];
    float sum[GGUF_TILE_ROWS];
    for (int r = 0; r < rows; r++) x[r] = ACT_ROW(act_block32, xv, xs, r), sum[r] = 0.0f;
    const uint8x16_t low = vdupq_n_u8(0x0F);
    const int8x16_t kvalues = vld1q_s8(GGUF_KVALUES_MXFP4);
    for (int64_t b = 0; b < nb; b++, w += block_bytes) {
        int8x16_t c0, c1;
        if (qtype == GGUF_Q8_0) {
            c0 = vld1q_s8((const int8_t *)(w + 2));
            c1 = vld1q_s8((const int8_t *)(w + 18));
        } else if (qtype == GGUF_MXFP4) { /* codes -> doubled E2M1 values by a table lookup */
            uint8x16_t v = vld1q_u8(w + 1);
            c0 = vqtbl1q_s8(kvalues, vandq_u8(v, low));
            c1 = vqtbl1q_s8(kvalues, vshrq_n_u8(v, 4));
        } else {
            const int has_min = qtype == GGUF_Q4_1 || qtype == GGUF_Q5_1, five = qtype == GGUF_Q5_0 || qtype == GGUF_Q5_1;
            const uint8_t *qs = w + 2 + 2 * has_min + 4 * five;
            uint8x16_t v = vld1q_u8(qs), lo = vandq_u8(v, low), hi = vshrq_n_u8(v, 4);
            if (five) {
                uint32_t qh;
                memcpy(&qh, w + 2 + 2 * has_min, 4);
                lo = vorrq_u8(lo, high_plane16(qh & 0xFFFF));
                hi = vorrq_u8(hi, high_plane16(qh >> 16));
            }
            c0 = vreinterpretq_s8_u8(lo);
            c1 = vreinterpretq_s8_u8(hi);
        }
        float d = qtype == GGUF_MXFP4 ? gguf_e8m0_half(w[0]) : half_at(w);
        for (int r = 0; r < rows; r++) {
            const act_block32 *xb = &x[r][b];
            int isum = dot32(c0, c1, xb->qs);
            switch (qtype) {
            case GGUF_Q4_0: sum[r] += d * (xb->d * (float)isum - 8.0f * xb->ds); break;
            case GGUF_Q5_0: sum[r] += d * (xb->d * (float)isum - 16.0f * xb->ds); break;
            case GGUF_Q4_1:
            case GGUF_Q5_1: sum[r] += d * xb->d * (float)isum + half_at(w + 2) * xb->ds; break;
            default: sum[r] += d * xb->d * (float)isum; break;
            }
        }
    }
    for (int r = 0; r < rows; r++) y[r * ys] = sum[r];
}

TILE_KERNEL tile_q4_0(int64_t nb, const uint8_t *w, const void *x, size_t xs, const int rows, float *y, size_t ys) { tile_32(GGUF_Q4_0, nb, w, x, xs, rows, y, ys); }
TILE_KERNEL tile_q4_1(int64_t nb, const uint8_t *w, const void *x, size_t xs, const int rows, float *y, size_t ys) { tile_32(GGUF_Q4_1, nb, w, x, xs, rows, y, ys); }
TILE_KERNEL tile_q5_0(int64_t nb, const uint8_t *w, const void *x, size_t xs, const int rows, float *y, size_t ys) { tile_32(GGUF_Q5_0, nb, w, x, xs, rows, y, ys); }
TILE_KERNEL tile_q5_1(int64_t nb, const uint8_t *w, const void *x, size_t xs, const int rows, float *y, size_t ys) { tile_32(GGUF_Q5_1, nb, w, x, xs, rows, y, ys); }
TILE_KERNEL tile_q8_0(int64_t nb, const uint8_t *w, const void *x, size_t xs, const int rows, float *y, size_t ys) { tile_32(GGUF_Q8_0, nb, w, x, xs, rows, y, ys); }
TILE_KERNEL tile_mxfp4(int64_t nb, const uint8_t *w, const void *x, size_t xs, const int rows, float *y, size_t ys) { tile_32(GGUF_MXFP4, nb, w, x, xs, rows, y, ys); }

/* The 12 scale bytes of a Q4_K/Q5_K block -> eight 6-bit scales and minimums (the format's packing). */
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

/* Q4_K (five = 0) and Q5_K (five = 1): sub-block j is the low (j even) or high nibbles of 32 bytes
 * at 32 (j / 2), with bit j of each of 32 high-plane bytes on top for Q5_K. */
TILE_KERNEL tile_k45(const int five, int64_t nb, const uint8_t *w, const void *xv, size_t xs, const int rows, float *y, size_t ys) {
    const int block_bytes = five ? 176 : 144;
    const act_block256 *x[GGUF_TILE_ROWS];
    float sum[GGUF_TILE_ROWS];
    for (int r = 0; r < rows; r++) x[r] = ACT_ROW(act_block256, xv, xs, r), sum[r] = 0.0f;
    const uint8x16_t low = vdupq_n_u8(0x0F), one = vdupq_n_u8(1);
    for (int64_t b = 0; b < nb; b++, w += block_bytes) {
        uint8_t scale[8], minimum[8];
        unpack_k_scales(w + 4, scale, minimum);
        const uint8_t *qs = w + (five ? 48 : 16);
        uint8x16_t qh0 = vdupq_n_u8(0), qh1 = vdupq_n_u8(0);
        if (five) qh0 = vld1q_u8(w + 16), qh1 = vld1q_u8(w + 32);
        int isum[GGUF_TILE_ROWS] = {0}, msum[GGUF_TILE_ROWS] = {0};
        for (int j = 0; j < 8; j++) {
            uint8x16_t v0 = vld1q_u8(qs + 32 * (j / 2)), v1 = vld1q_u8(qs + 32 * (j / 2) + 16);
            uint8x16_t c0 = j % 2 ? vshrq_n_u8(v0, 4) : vandq_u8(v0, low);
            uint8x16_t c1 = j % 2 ? vshrq_n_u8(v1, 4) : vandq_u8(v1, low);
            if (five) {
                int8x16_t down = vdupq_n_s8((int8_t)-j);
                c0 = vorrq_u8(c0, vshlq_n_u8(vandq_u8(vshlq_u8(qh0, down), one), 4));
                c1 = vorrq_u8(c1, vshlq_n_u8(vandq_u8(vshlq_u8(qh1, down), one), 4));
            }
            for (int r = 0; r < rows; r++) {
                const act_block256 *xb = &x[r][b];
                isum[r] += scale[j] * dot32(vreinterpretq_s8_u8(c0), vreinterpretq_s8_u8(c1), xb->qs + 32 * j);
                msum[r] += minimum[j] * (xb->bsums[2 * j] + xb->bsums[2 * j + 1]);
            }
        }
        float d = half_at(w), dmin = half_at(w + 2);
        for (int r = 0; r < rows; r++) sum[r] += x[r][b].d * (d * (float)isum[r] - dmin * (float)msum[r]);
    }
    for (int r = 0; r < rows; r++) y[r * ys] = sum[r];
}

TILE_KERNEL tile_q4_k(int64_t nb, const uint8_t *w, const void *x, size_t xs, const int rows, float *y, size_t ys) { tile_k45(0, nb, w, x, xs, rows, y, ys); }
TILE_KERNEL tile_q5_k(int64_t nb, const uint8_t *w, const void *x, size_t xs, const int rows, float *y, size_t ys) { tile_k45(1, nb, w, x, xs, rows, y, ys); }

/* Q6_K: values 128 h + 32 k + (0..31) take the low (k < 2) or high nibbles of ql[64 h + 32 (k % 2)
 * ...] and bits 2k, 2k+1 of qh[32 h ...]; each 16 values have a signed scale, codes are q + 32. */
TILE_KERNEL tile_q6_k(int64_t nb, const uint8_t *w, const void *xv, size_t xs, const int rows, float *y, size_t ys) {
    const act_block256 *x[GGUF_TILE_ROWS];
    float sum[GGUF_TILE_ROWS];
    for (int r = 0; r < rows; r++) x[r] = ACT_ROW(act_block256, xv, xs, r), sum[r] = 0.0f;
    const uint8x16_t low = vdupq_n_u8(0x0F), three = vdupq_n_u8(0x03);
    for (int64_t b = 0; b < nb; b++, w += 210) {
        const uint8_t *ql = w, *qhp = w + 128;
        const int8_t *scales = (const int8_t *)(w + 192);
        int isum[GGUF_TILE_ROWS] = {0};
        for (int h = 0; h < 2; h++) {
            for (int k = 0; k < 4; k++) {
                for (int half = 0; half < 2; half++) { /* 16 values: scale group 8h + 2k + half */
                    uint8x16_t nib = vld1q_u8(ql + 64 * h + 32 * (k % 2) + 16 * half);
                    nib = k < 2 ? vandq_u8(nib, low) : vshrq_n_u8(nib, 4);
                    uint8x16_t high = vandq_u8(vshlq_u8(vld1q_u8(qhp + 32 * h + 16 * half), vdupq_n_s8((int8_t)(-2 * k))), three);
                    int8x16_t q = vreinterpretq_s8_u8(vorrq_u8(nib, vshlq_n_u8(high, 4)));
                    int g = 8 * h + 2 * k + half;
                    for (int r = 0; r < rows; r++) {
                        const act_block256 *xb = &x[r][b];
                        int sub = vaddvq_s32(dot16(vdupq_n_s32(0), q, vld1q_s8(xb->qs + 16 * g)));
                        isum[r] += scales[g] * (sub - 32 * xb->bsums[g]);
                    }
                }
            }
        }
        float d = half_at(w + 208);
        for (int r = 0; r < rows; r++) sum[r] += x[r][b].d * d * (float)isum[r];
    }
    for (int r = 0; r < rows; r++) y[r * ys] = sum[r];
}

/* Tile entry points: constant row counts, so each tile's loops unroll (rows = 1: a decode step). */
#define KERNELS(name)                                                                                              \
    static void rows_##name(int64_t nb, const uint8_t *w, int64_t weight_rows, int64_t row_bytes, const void *x,  \
                            size_t xs, const act_tile_scales32 *sc, int rows, float *y, size_t ys) {              \
        (void)sc;                                                                                                  \
        switch (rows) {                                                                                            \
        case 1: for (int64_t i = 0; i < weight_rows; i++) tile_##name(nb, w + i * row_bytes, x, xs, 1, y + i, ys); break; \
        case 2: for (int64_t i = 0; i < weight_rows; i++) tile_##name(nb, w + i * row_bytes, x, xs, 2, y + i, ys); break; \
        case 3: for (int64_t i = 0; i < weight_rows; i++) tile_##name(nb, w + i * row_bytes, x, xs, 3, y + i, ys); break; \
        case 4: for (int64_t i = 0; i < weight_rows; i++) tile_##name(nb, w + i * row_bytes, x, xs, 4, y + i, ys); break; \
        case 5: for (int64_t i = 0; i < weight_rows; i++) tile_##name(nb, w + i * row_bytes, x, xs, 5, y + i, ys); break; \
        case 6: for (int64_t i = 0; i < weight_rows; i++) tile_##name(nb, w + i * row_bytes, x, xs, 6, y + i, ys); break; \
        case 7: for (int64_t i = 0; i < weight_rows; i++) tile_##name(nb, w + i * row_bytes, x, xs, 7, y + i, ys); break; \
        default: for (int64_t i = 0; i < weight_rows; i++) tile_##name(nb, w + i * row_bytes, x, xs, 8, y + i, ys); break; \
        }                                                                                                          \
    }
#define ISA_ROWS(NAME, name) KERNELS(name)
GGUF_TYPES_NEON(ISA_ROWS)
#undef ISA_ROWS

/* The portable kernels, with this file's in place of those it has (every type runs on every ISA). */
void gguf_table_neon_name(gguf_kernel_table *table) {
    gguf_table_portable(table);
#define ENTRY(NAME, name) table->rows[GGUF_##NAME] = rows_##name;
    GGUF_TYPES_NEON(ENTRY)
#undef ENTRY
}
