/* Q4_K products of many activation rows on Intel AMX (tile registers and the int8 tile multiply,
 * tdpbusd: u8 x s8 -> int32); this translation unit alone is compiled with -mamx-tile -mamx-int8
 * and AVX-512, and the library calls it only after cpuid, XCR0 and Linux said yes (gguf_amx_request).
 *
 * The sums are those of the AVX kernels (gguf_avx2.c, tile_q4_k): per 256-block, weight row and
 * activation row the exact int32 totals T = sum_j scale_j (q . x)_j and M = sum_j minimum_j (sum x)_j,
 * then the same float steps in block order, acc = fmaf(x.d * d, T, acc), acc = fmaf(-(x.d * dmin), M, acc),
 * so a row's output is bit for bit the one-row (decode) path's: batch invariance across paths.
 *
 * To get T from one tile product per 64 values the sub-block scale goes into the weights: the code
 * times its 6-bit scale, v = scale q <= 945, is split into bytes v mod 256 and v / 256 (A tiles
 * `lo` and `hi`), so T = C_lo + 256 C_hi with C_lo, C_hi accumulating over the block's 256 values.
 * Tiles: C[weight row][activation row], 16 x 16 int32, from A (16 weight rows x 64 values, u8) and
 * B (the VNNI layout of 16 activation rows: row t holds values 4t..4t+3 of each activation row).
 * M, a dot product of eight minimums with the activations' sub-block sums, is AVX-512 (vpdpwssd).
 * The layouts follow the GGUF format description and Intel's intrinsics guide. */
#include <immintrin.h>
#include <stdlib.h>
#include <string.h>
#include <sys/syscall.h>
#include <unistd.h>

#include "gguf_kernels.h"

#define ARCH_REQ_XCOMP_PERM 0x1023
#define XFEATURE_XTILEDATA 18

/* Asks Linux for the tile state (once per process; off by default since kernel 5.16): 1 if granted. */
int gguf_amx_request(void) {
#ifdef SYS_arch_prctl
    return syscall(SYS_arch_prctl, ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA) == 0;
#else
    return 0;
#endif
}

/* 16 weight rows' block b, unpacked once per product and read as A tiles for every activation row. */
typedef struct {
    uint8_t lo[4][16][64]; /* (scale x code) mod 256: step s (values 64s..64s+63), weight row, value */
    uint8_t hi[4][16][64]; /* (scale x code) / 256 */
    float d[16], dmin[16];
    int32_t minimums[4][16]; /* minimum 2p (low 16 bits) and 2p + 1 (high), per weight row */
} __attribute__((aligned(64))) amx_weights;

/* 16 activation rows' block b in B-tile layout, with their scales and sub-block sums. */
typedef struct {
    int8_t b[4][16][64]; /* step s: row t = values 64s + 4t .. 64s + 4t + 3 of activation row n at bytes 4n..4n+3 */
    float d[16];
    int32_t sums[4][16]; /* sums of sub-blocks 2p (low 16 bits) and 2p + 1 (high), per activation row */
} __attribute__((aligned(64))) amx_acts;

size_t gguf_amx_acts_bytes(int64_t m, int64_t nblocks) { return (size_t)((m + 15) / 16) * (size_t)nblocks * sizeof(amx_acts); }

/* Activation rows 16 g .. 16 g + 15 (of m; those past m zero) into group g of `out`, B layout. */
void gguf_amx_pack_acts(const void *xq, size_t row_bytes, int64_t m, int64_t nblocks, int64_t g, void *out) {
    amx_acts *group = (amx_acts *)out + g * nblocks;
    memset(group, 0, sizeof(amx_acts) * (size_t)nblocks);
    for (int n = 0; n < 16 && g * 16 + n < m; n++) {
        const act_block256 *x = (const act_block256 *)((const char *)xq + (size_t)(g * 16 + n) * row_bytes);
        for (int64_t b = 0; b < nblocks; b++) {
            amx_acts *a = &group[b];
            for (int s = 0; s < 4; s++) {
                for (int t = 0; t < 16; t++) memcpy(&a->b[s][t][4 * n], x[b].qs + 64 * s + 4 * t, 4);
            }
            a->d[n] = x[b].d;
            for (int p = 0; p < 4; p++) {
                uint16_t even = (uint16_t)(x[b].bsums[4 * p] + x[b].bsums[4 * p + 1]);
                uint16_t odd = (uint16_t)(x[b].bsums[4 * p + 2] + x[b].bsums[4 * p + 3]);
                a->sums[p][n] = (int32_t)((uint32_t)even | (uint32_t)odd << 16);
            }
        }
    }
}

static inline float half_at(const uint8_t *p) {
    uint16_t h;
    memcpy(&h, p, 2);
    return _cvtsh_ss(h);
}

/* 16 consecutive weight rows (`row_bytes` apart) of nblocks Q4_K blocks into out[0..nblocks). A
 * block: fp16 d, fp16 dmin, 12 bytes of eight 6-bit scales and minimums, 128 bytes of codes (byte
 * 32 s + l: value 64 s + l in its low nibble, 64 s + 32 + l in its high one). */
static void unpack_weights(int64_t nblocks, const uint8_t *w, int64_t row_bytes, amx_weights *out) {
    const __m256i low = _mm256_set1_epi8(0x0F);
    for (int i = 0; i < 16; i++) {
        const uint8_t *blk = w + i * row_bytes;
        for (int64_t b = 0; b < nblocks; b++, blk += 144) {
            amx_weights *o = &out[b];
            const uint8_t *s = blk + 4;
            uint8_t scale[8], minimum[8];
            for (int j = 0; j < 4; j++) {
                scale[j] = s[j] & 63, minimum[j] = s[j + 4] & 63;
                scale[j + 4] = (s[j + 8] & 0x0F) | (s[j] >> 6) << 4;
                minimum[j + 4] = (s[j + 8] >> 4) | (s[j + 4] >> 6) << 4;
            }
            o->d[i] = half_at(blk), o->dmin[i] = half_at(blk + 2);
            for (int p = 0; p < 4; p++) o->minimums[p][i] = minimum[2 * p] | minimum[2 * p + 1] << 16;
            for (int st = 0; st < 4; st++) {
                __m256i v = _mm256_loadu_si256((const __m256i *)(blk + 16 + 32 * st));
                __m512i first = _mm512_mullo_epi16(_mm512_cvtepu8_epi16(_mm256_and_si256(v, low)), _mm512_set1_epi16(scale[2 * st]));
                __m512i second = _mm512_mullo_epi16(_mm512_cvtepu8_epi16(_mm256_and_si256(_mm256_srli_epi16(v, 4), low)),
                                                    _mm512_set1_epi16(scale[2 * st + 1]));
                _mm256_store_si256((__m256i *)&o->lo[st][i][0], _mm512_cvtepi16_epi8(first)); /* vpmovwb: low byte */
                _mm256_store_si256((__m256i *)&o->lo[st][i][32], _mm512_cvtepi16_epi8(second));
                _mm256_store_si256((__m256i *)&o->hi[st][i][0], _mm512_cvtepi16_epi8(_mm512_srli_epi16(first, 8)));
                _mm256_store_si256((__m256i *)&o->hi[st][i][32], _mm512_cvtepi16_epi8(_mm512_srli_epi16(second, 8)));
            }
        }
    }
}

/* Palette 1, all eight tiles 16 rows x 64 bytes: 0, 1 C (lo, hi) of the first activation group, 2, 3
 * A (lo, hi), 4 B of the first group, 5 B of the second, 6, 7 C of the second. Tile configuration is
 * per thread, so every call sets it. */
static void configure_tiles(void) {
    struct {
        uint8_t palette, start_row, reserved[14];
        uint16_t bytes_per_row[16];
        uint8_t rows[16];
    } __attribute__((aligned(64))) config;
    memset(&config, 0, sizeof config);
    config.palette = 1;
    for (int t = 0; t < 8; t++) config.bytes_per_row[t] = 64, config.rows[t] = 16;
    _tile_loadconfig(&config);
}

/* The float steps of one block for one C tile pair: acc[i] (lanes: activation rows) of weight row i. */
static inline __attribute__((always_inline)) void block_float_steps(const amx_weights *wb, const amx_acts *ab,
                                                                    const int32_t lo[16][16], const int32_t hi[16][16],
                                                                    float acc[16][16]) {
    const __m512 row_d = _mm512_load_ps(ab->d);
    const __m512i s0 = _mm512_load_si512(ab->sums[0]), s1 = _mm512_load_si512(ab->sums[1]);
    const __m512i s2 = _mm512_load_si512(ab->sums[2]), s3 = _mm512_load_si512(ab->sums[3]);
    for (int i = 0; i < 16; i++) {
        __m512i total = _mm512_add_epi32(_mm512_load_si512(lo[i]), _mm512_slli_epi32(_mm512_load_si512(hi[i]), 8));
        __m512i mins = _mm512_dpwssd_epi32(_mm512_setzero_si512(), s0, _mm512_set1_epi32(wb->minimums[0][i]));
        mins = _mm512_dpwssd_epi32(mins, s1, _mm512_set1_epi32(wb->minimums[1][i]));
        mins = _mm512_dpwssd_epi32(mins, s2, _mm512_set1_epi32(wb->minimums[2][i]));
        mins = _mm512_dpwssd_epi32(mins, s3, _mm512_set1_epi32(wb->minimums[3][i]));
        __m512 a = _mm512_load_ps(acc[i]);
        a = _mm512_fmadd_ps(_mm512_mul_ps(row_d, _mm512_set1_ps(wb->d[i])), _mm512_cvtepi32_ps(total), a);
        a = _mm512_fnmadd_ps(_mm512_mul_ps(row_d, _mm512_set1_ps(wb->dmin[i])), _mm512_cvtepi32_ps(mins), a);
        _mm512_store_ps(acc[i], a);
    }
}

/* One group of 16 weight rows against one or two (`pair`) groups of 16 activation rows, all blocks:
 * acc[g][i][n] = weight row i . activation row n of group g. */
static inline __attribute__((always_inline)) void group_product(int64_t nblocks, const amx_weights *wg, const amx_acts *a0,
                                                                const amx_acts *a1, const int pair, float acc[2][16][16]) {
    int32_t c[4][16][16] __attribute__((aligned(64)));
    memset(acc, 0, sizeof(float) * 16 * 16 * (pair ? 2 : 1));
    for (int64_t b = 0; b < nblocks; b++) {
        _tile_zero(0);
        _tile_zero(1);
        if (pair) {
            _tile_zero(6);
            _tile_zero(7);
        }
        for (int s = 0; s < 4; s++) {
            _tile_loadd(2, wg[b].lo[s], 64);
            _tile_loadd(3, wg[b].hi[s], 64);
            _tile_loadd(4, a0[b].b[s], 64);
            _tile_dpbusd(0, 2, 4);
            _tile_dpbusd(1, 3, 4);
            if (pair) {
                _tile_loadd(5, a1[b].b[s], 64);
                _tile_dpbusd(6, 2, 5);
                _tile_dpbusd(7, 3, 5);
            }
        }
        _tile_stored(0, c[0], 64);
        _tile_stored(1, c[1], 64);
        if (pair) {
            _tile_stored(6, c[2], 64);
            _tile_stored(7, c[3], 64);
        }
        block_float_steps(&wg[b], &a0[b], c[0], c[1], acc[0]);
        if (pair) block_float_steps(&wg[b], &a1[b], c[2], c[3], acc[1]);
    }
}

/* Each thread's unpacked weights, kept between calls (a prefill makes thousands of products). */
static __thread amx_weights *chunk;
static __thread size_t chunk_blocks;

#define CHUNK_GROUPS 4 /* weight groups unpacked together: each activation group is read once for 64 weight rows */

/* y[r * ys + i] = weight row i . activation row r for `weight_rows` (a multiple of 16) Q4_K rows
 * against the m activation rows packed by gguf_amx_pack_acts. 0, or -1 when out of memory. */
int gguf_amx_q4_k(int64_t nblocks, const uint8_t *w, int64_t weight_rows, int64_t row_bytes, const void *packed, int64_t m,
                  float *y, size_t ys) {
    const amx_acts *acts = packed;
    const int64_t agroups = (m + 15) / 16;
    if (chunk_blocks < (size_t)(CHUNK_GROUPS * nblocks)) {
        free(chunk);
        chunk = aligned_alloc(64, sizeof(amx_weights) * CHUNK_GROUPS * (size_t)nblocks);
        chunk_blocks = chunk ? (size_t)(CHUNK_GROUPS * nblocks) : 0;
        if (chunk == NULL) return -1;
    }
    configure_tiles();
    float acc[2][16][16] __attribute__((aligned(64)));
    for (int64_t i0 = 0; i0 < weight_rows; i0 += 16 * CHUNK_GROUPS) {
        int groups = (int)((weight_rows - i0) / 16 < CHUNK_GROUPS ? (weight_rows - i0) / 16 : CHUNK_GROUPS);
        for (int g = 0; g < groups; g++) unpack_weights(nblocks, w + (i0 + 16 * g) * row_bytes, row_bytes, chunk + g * nblocks);
        for (int64_t a = 0; a < agroups; a += 2) {
            const int pair = a + 1 < agroups;
            for (int g = 0; g < groups; g++) {
                if (pair) group_product(nblocks, chunk + g * nblocks, acts + a * nblocks, acts + (a + 1) * nblocks, 1, acc);
                else group_product(nblocks, chunk + g * nblocks, acts + a * nblocks, NULL, 0, acc);
                for (int h = 0; h < 1 + pair; h++) {
                    for (int n = 0; n < 16 && (a + h) * 16 + n < m; n++) {
                        float *out = y + (size_t)((a + h) * 16 + n) * ys + i0 + 16 * g;
                        for (int i = 0; i < 16; i++) out[i] = acc[h][i][n];
                    }
                }
            }
        }
    }
    _tile_release();
    return 0;
}
