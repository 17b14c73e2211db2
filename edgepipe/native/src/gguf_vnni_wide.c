/* Q4_K products of many activation rows on AVX-512 VNNI with the vector lanes over weight rows: the
 * prefill path of x86 CPUs without AMX (AMD EPYC, Intel before Sapphire Rapids), and of rows too few
 * for AMX's tiles. Compiled with the AVX-512 flags; the library calls it only on ISA avx512vnni and up.
 *
 * The AVX tiles (gguf_avx2.c, tile_q4_k) put one weight row's values in the lanes and reduce each
 * (weight row, activation row) pair across lanes for every block; here a 512-bit lane is one of 16
 * weight rows and holds 4 consecutive values of it, so one vpdpbusd against 4 bytes of an
 * activation row broadcast to every lane advances 16 dot products at once and nothing is reduced
 * across lanes. The weights are unpacked once per product into that layout (a 16 x 16 dword
 * transpose of the codes per 64 values) and then read by every activation row.
 *
 * The sums are those of every other Q4_K path on x86: per 256-block, weight row and activation row
 * the exact int32 totals T = sum_j scale_j (q . x)_j (here sub-block by sub-block, vpmulld by the
 * scale) and M = sum_j minimum_j (sum of x)_j, then the same float steps in block order,
 * acc = fmaf(x.d * d, (float)T, acc), acc = fmaf(-(x.d * dmin), (float)M, acc), so a row's output is
 * bit for bit the one-row (decode) path's and the AMX path's. */
#include <immintrin.h>
#include <stdlib.h>
#include <string.h>

#include "gguf_kernels.h"

/* 16 weight rows' block b: codes lane-major, and the block's scales per lane. */
typedef struct {
    uint8_t codes[64][16][4]; /* step t: values 4t .. 4t + 3 of weight row i */
    int32_t scales[8][16];    /* sub-block j's 6-bit scale, per weight row */
    int32_t minimums[4][16];  /* minimum 2p (low 16 bits) and 2p + 1 (high), per weight row */
    float d[16], dmin[16];
} __attribute__((aligned(64))) wide_weights;

static inline float half_at(const uint8_t *p) {
    uint16_t h;
    memcpy(&h, p, 2);
    return _cvtsh_ss(h);
}

/* r[i] dword s -> r[s] dword i (a 16 x 16 transpose of 32-bit words). */
static inline void transpose16(__m512i r[16]) {
    __m512i t[16];
    for (int i = 0; i < 16; i += 2) {
        t[i] = _mm512_unpacklo_epi32(r[i], r[i + 1]);
        t[i + 1] = _mm512_unpackhi_epi32(r[i], r[i + 1]);
    }
    for (int i = 0; i < 16; i += 4) {
        r[i] = _mm512_unpacklo_epi64(t[i], t[i + 2]);
        r[i + 1] = _mm512_unpackhi_epi64(t[i], t[i + 2]);
        r[i + 2] = _mm512_unpacklo_epi64(t[i + 1], t[i + 3]);
        r[i + 3] = _mm512_unpackhi_epi64(t[i + 1], t[i + 3]);
    }
    for (int i = 0; i < 4; i++) {
        t[i] = _mm512_shuffle_i32x4(r[i], r[i + 4], 0x88);
        t[i + 4] = _mm512_shuffle_i32x4(r[i], r[i + 4], 0xDD);
        t[i + 8] = _mm512_shuffle_i32x4(r[i + 8], r[i + 12], 0x88);
        t[i + 12] = _mm512_shuffle_i32x4(r[i + 8], r[i + 12], 0xDD);
    }
    for (int i = 0; i < 4; i++) {
        r[i] = _mm512_shuffle_i32x4(t[i], t[i + 8], 0x88);
        r[i + 8] = _mm512_shuffle_i32x4(t[i], t[i + 8], 0xDD);
        r[i + 4] = _mm512_shuffle_i32x4(t[i + 4], t[i + 12], 0x88);
        r[i + 12] = _mm512_shuffle_i32x4(t[i + 4], t[i + 12], 0xDD);
    }
}

/* 16 consecutive weight rows (`row_bytes` apart) of nblocks Q4_K blocks into out[0..nblocks). A
 * block: fp16 d, fp16 dmin, 12 bytes of eight 6-bit scales and minimums, 128 bytes of codes (byte
 * 32 g + l: value 64 g + l in its low nibble, 64 g + 32 + l in its high one). */
static void unpack_weights(int64_t nblocks, const uint8_t *w, int64_t row_bytes, wide_weights *out) {
    const __m256i low = _mm256_set1_epi8(0x0F);
    for (int64_t b = 0; b < nblocks; b++) {
        wide_weights *o = &out[b];
        for (int i = 0; i < 16; i++) {
            const uint8_t *blk = w + i * row_bytes + b * 144, *s = blk + 4;
            uint32_t a, m, c; /* the scale bytes as words, as tile_q4_k's unpack_k_scales reads them */
            memcpy(&a, s, 4);
            memcpy(&m, s + 4, 4);
            memcpy(&c, s + 8, 4);
            uint64_t scales = (a & 0x3F3F3F3Fu) | (uint64_t)((c & 0x0F0F0F0Fu) | ((a >> 2) & 0x30303030u)) << 32;
            uint64_t minimums = (m & 0x3F3F3F3Fu) | (uint64_t)(((c >> 4) & 0x0F0F0F0Fu) | ((m >> 2) & 0x30303030u)) << 32;
            for (int j = 0; j < 8; j++) o->scales[j][i] = (int32_t)((scales >> (8 * j)) & 0xFF);
            for (int p = 0; p < 4; p++)
                o->minimums[p][i] = (int32_t)(((minimums >> (16 * p)) & 0xFF) | ((minimums >> (16 * p + 8)) & 0xFF) << 16);
            o->d[i] = half_at(blk), o->dmin[i] = half_at(blk + 2);
        }
        for (int g = 0; g < 4; g++) { /* values 64 g .. 64 g + 63 of the 16 rows, then lane-major */
            __m512i r[16];
            for (int i = 0; i < 16; i++) {
                __m256i v = _mm256_loadu_si256((const __m256i *)(w + i * row_bytes + b * 144 + 16 + 32 * g));
                r[i] = _mm512_inserti64x4(_mm512_castsi256_si512(_mm256_and_si256(v, low)),
                                          _mm256_and_si256(_mm256_srli_epi16(v, 4), low), 1);
            }
            transpose16(r);
            for (int s = 0; s < 16; s++) _mm512_store_si512(o->codes[16 * g + s], r[s]);
        }
    }
}

/* Activation rows a tile takes at once: 4 keeps the totals, the sub-block sums and the float
 * accumulators of every row in registers (8 spills and runs 1.4x slower). */
#define WIDE_ROWS 4

/* `rows` (1..WIDE_ROWS) activation rows against one group of 16 weight rows, all blocks:
 * y[r * ys + i] = weight row i . activation row r. */
static inline __attribute__((always_inline)) void group_product(int64_t nblocks, const wide_weights *wg,
                                                                const act_block256 *const x[WIDE_ROWS], const int rows,
                                                                float *y, size_t ys) {
    __m512 acc[WIDE_ROWS];
    for (int r = 0; r < WIDE_ROWS; r++) acc[r] = _mm512_setzero_ps();
    for (int64_t b = 0; b < nblocks; b++) {
        const wide_weights *wb = &wg[b];
        __m512i total[WIDE_ROWS];
        for (int r = 0; r < WIDE_ROWS; r++) total[r] = _mm512_setzero_si512();
        for (int j = 0; j < 8; j++) {
            __m512i sub[WIDE_ROWS]; /* (q . x) of sub-block j: at most 32 x 15 x 128, exact in int32 */
            for (int r = 0; r < WIDE_ROWS; r++) sub[r] = _mm512_setzero_si512();
            for (int t = 8 * j; t < 8 * j + 8; t++) {
                const __m512i codes = _mm512_load_si512(wb->codes[t]);
                for (int r = 0; r < rows; r++) {
                    int32_t four;
                    memcpy(&four, x[r][b].qs + 4 * t, 4);
                    sub[r] = _mm512_dpbusd_epi32(sub[r], codes, _mm512_set1_epi32(four));
                }
            }
            const __m512i scale = _mm512_load_si512(wb->scales[j]);
            for (int r = 0; r < rows; r++) total[r] = _mm512_add_epi32(total[r], _mm512_mullo_epi32(sub[r], scale));
        }
        const __m512 d = _mm512_load_ps(wb->d), dmin = _mm512_load_ps(wb->dmin);
        for (int r = 0; r < rows; r++) {
            const int16_t *bs = x[r][b].bsums;
            __m512i mins = _mm512_setzero_si512();
            for (int p = 0; p < 4; p++) { /* sums of sub-blocks 2p and 2p + 1 as the int16 pair of one word */
                uint32_t pair = (uint16_t)(bs[4 * p] + bs[4 * p + 1]) | (uint32_t)(uint16_t)(bs[4 * p + 2] + bs[4 * p + 3]) << 16;
                mins = _mm512_dpwssd_epi32(mins, _mm512_load_si512(wb->minimums[p]), _mm512_set1_epi32((int32_t)pair));
            }
            const __m512 xd = _mm512_set1_ps(x[r][b].d);
            acc[r] = _mm512_fmadd_ps(_mm512_mul_ps(xd, d), _mm512_cvtepi32_ps(total[r]), acc[r]);
            acc[r] = _mm512_fnmadd_ps(_mm512_mul_ps(xd, dmin), _mm512_cvtepi32_ps(mins), acc[r]);
        }
    }
    for (int r = 0; r < rows; r++) _mm512_storeu_ps(y + r * ys, acc[r]);
}

/* Each thread's unpacked weights, kept between calls (a prefill makes thousands of products). */
static __thread wide_weights *chunk;
static __thread size_t chunk_blocks;

#define CHUNK_GROUPS 4 /* weight groups unpacked together: each activation row is read once for 64 weight rows */

int gguf_vnni_q4_k(int64_t nblocks, const uint8_t *w, int64_t weight_rows, int64_t row_bytes, const void *xq,
                   size_t xq_row_bytes, int64_t m, float *y, size_t ys) {
    if (chunk_blocks < (size_t)(CHUNK_GROUPS * nblocks)) {
        free(chunk);
        chunk = aligned_alloc(64, sizeof(wide_weights) * CHUNK_GROUPS * (size_t)nblocks);
        chunk_blocks = chunk ? (size_t)(CHUNK_GROUPS * nblocks) : 0;
        if (chunk == NULL) return -1;
    }
    for (int64_t i0 = 0; i0 < weight_rows; i0 += 16 * CHUNK_GROUPS) {
        int groups = (int)((weight_rows - i0) / 16 < CHUNK_GROUPS ? (weight_rows - i0) / 16 : CHUNK_GROUPS);
        for (int g = 0; g < groups; g++) unpack_weights(nblocks, w + (i0 + 16 * g) * row_bytes, row_bytes, chunk + g * nblocks);
        for (int64_t m0 = 0; m0 < m; m0 += WIDE_ROWS) {
            const act_block256 *x[WIDE_ROWS];
            const int rows = m - m0 < WIDE_ROWS ? (int)(m - m0) : WIDE_ROWS;
            for (int r = 0; r < rows; r++) x[r] = (const act_block256 *)((const char *)xq + (size_t)(m0 + r) * xq_row_bytes);
            for (int g = 0; g < groups; g++) {
                float *out = y + (size_t)m0 * ys + i0 + 16 * g;
                switch (rows) { /* constant row counts: each variant keeps its rows in registers */
                case 1: group_product(nblocks, chunk + g * nblocks, x, 1, out, ys); break;
                case 2: group_product(nblocks, chunk + g * nblocks, x, 2, out, ys); break;
                case 3: group_product(nblocks, chunk + g * nblocks, x, 3, out, ys); break;
                default: group_product(nblocks, chunk + g * nblocks, x, WIDE_ROWS, out, ys); break;
                }
            }
        }
    }
    return 0;
}
