/* AVX2 + FMA + F16C dot products (this translation unit alone is compiled with -mavx2 -mfma -mf16c;
 * the library calls it only after cpuid says the CPU and OS support them). Same integer sums as the
 * portable kernels: 8-bit activations times unsigned weight codes through maddubs, offsets and
 * minimums applied from the activation block sums.
 *
 * Each type is one tile kernel: a weight row against `rows` activation rows, each weight block
 * unpacked once and applied to every row, each row keeping its own accumulators. The one-row dot
 * is the tile with rows = 1, so every row's float operations are the same whatever the tile
 * size (batch invariance: where a tile does a row's scalar work in a vector lane, the lane's IEEE
 * operation is the scalar one), and independent rows hide the accumulators' latency at prefill. */
#include <immintrin.h>
#include <math.h>
#include <string.h>

#include "gguf_kernels.h"

static inline float half_at(const uint8_t *p) {
    uint16_t h;
    memcpy(&h, p, 2);
    return _cvtsh_ss(h);
}

static inline float hsum_ps(__m256 v) {
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    s = _mm_add_ss(s, _mm_movehdup_ps(s));
    return _mm_cvtss_f32(s);
}

/* Sum of u8 x s8 products over 32 bytes, as 8 int32 lanes (one VNNI instruction where built for it). */
static inline __m256i dot_u8s8(__m256i u, __m256i s) {
#ifdef GGUF_USE_VNNI
    return _mm256_dpbusd_epi32(_mm256_setzero_si256(), u, s);
#else
    return _mm256_madd_epi16(_mm256_maddubs_epi16(u, s), _mm256_set1_epi16(1));
#endif
}

/* 16 bytes of packed nibbles -> 32 codes: low nibbles first (values 0..15), then high nibbles. */
static inline __m256i nibbles32(const uint8_t *qs) {
    __m128i v = _mm_loadu_si128((const __m128i *)qs);
    __m256i both = _mm256_set_m128i(_mm_srli_epi16(v, 4), v);
    return _mm256_and_si256(both, _mm256_set1_epi8(0x0F));
}

/* The 32 bits of a 5-bit block's high plane -> 0x10 in each byte whose bit is set. */
static inline __m256i high_bits32(const uint8_t *qh_bytes) {
    uint32_t qh;
    memcpy(&qh, qh_bytes, 4);
    const __m256i spread = _mm256_set_epi64x(0x0303030303030303LL, 0x0202020202020202LL,
                                             0x0101010101010101LL, 0x0000000000000000LL);
    __m256i bytes = _mm256_shuffle_epi8(_mm256_set1_epi32((int)qh), spread);
    const __m256i bit = _mm256_set1_epi64x((long long)0x8040201008040201ULL);
    __m256i set = _mm256_cmpeq_epi8(_mm256_and_si256(bytes, bit), bit);
    return _mm256_and_si256(set, _mm256_set1_epi8(0x10));
}


/* gguf_e8m0_half of every exponent byte as float bits, a constant table (one load per block instead
 * of a compare, two shifts and a select): the same formula, so the same values bit for bit. */
#define E8M0_HALF_BITS(e) ((e) < 2 ? 0x00200000u << (e) : (uint32_t)((e) - 1) << 23)
#define E8M0_4(e) E8M0_HALF_BITS(e), E8M0_HALF_BITS((e) + 1), E8M0_HALF_BITS((e) + 2), E8M0_HALF_BITS((e) + 3)
#define E8M0_16(e) E8M0_4(e), E8M0_4((e) + 4), E8M0_4((e) + 8), E8M0_4((e) + 12)
#define E8M0_64(e) E8M0_16(e), E8M0_16((e) + 16), E8M0_16((e) + 32), E8M0_16((e) + 48)
static const uint32_t e8m0_half_bits[256] = {E8M0_64(0), E8M0_64(64), E8M0_64(128), E8M0_64(192)};

static inline float e8m0_half(uint8_t e) {
    float value;
    memcpy(&value, &e8m0_half_bits[e], 4);
    return value;
}

#define TILE_KERNEL static inline __attribute__((always_inline)) void

/* Software prefetch of the weight stream, PREFETCH_AHEAD bytes past the block being computed,
 * into L1, a line per 64 bytes of the block: on an Intel Xeon (Sapphire Rapids, one core) the
 * hardware prefetchers alone left the Q4_K decode product at 8 GB/s from memory, this at 17-19
 * (a pure read of the same buffer: 22); on an AMD EPYC 2 KiB ahead into L1 measured neutral
 * (benchmarks/gguf_kernel.py). A prefetch past the matrix's end is harmless (no fault). */
#define PREFETCH_AHEAD 4096
static inline __attribute__((always_inline)) void prefetch_block(const uint8_t *w, const int bytes) {
    for (int offset = 0; offset < bytes; offset += 64) _mm_prefetch((const char *)w + PREFETCH_AHEAD + offset, _MM_HINT_T0);
}

/* Activation row r of a tile: `x` rows `stride` bytes apart. */
#define ACT_ROW(type, x, stride, r) ((const type *)((const char *)(x) + (size_t)(r) * (stride)))

#if GGUF_TILE_ROWS != 8
#error "the 32-block tiles keep one row per lane of an 8-float vector"
#endif

/* 32-blocks, specialised per type (`qtype` is a constant at every call): the code vector q is
 * built once per block; the block's float work for the whole tile is one vector op per block on
 * the tile's scales (lane r: row r), so a row's operations are the same whether it is alone or
 * in a tile — d x_r.d as the scale of its integer sum, and `offset` collecting d x (x_r.d x sum of
 * its activations) (m for the types with a minimum) for the types whose codes carry an offset. */
TILE_KERNEL tile_32(const int qtype, int64_t nb, const uint8_t *w, const void *xv, size_t xs,
                    const act_tile_scales32 *sc, const int rows, float *y, size_t ys) {
    const int block_bytes = gguf_block_bytes(qtype);
    const int has_min = qtype == GGUF_Q4_1 || qtype == GGUF_Q5_1;
    const int signed_codes = qtype == GGUF_Q8_0 || qtype == GGUF_MXFP4; /* no offset; signed x signed products */
    const __m256i kvalues = _mm256_broadcastsi128_si256(_mm_loadu_si128((const __m128i *)GGUF_KVALUES_MXFP4));
    const act_block32 *x[GGUF_TILE_ROWS];
    /* MXFP4's 17-byte blocks come fast enough that one fmadd chain per row is the limit: even and
     * odd blocks go to two chains, in every tile size alike (the rows' arithmetic stays the same) */
    const int two_chains = qtype == GGUF_MXFP4;
    __m256 acc[GGUF_TILE_ROWS], acc_odd[GGUF_TILE_ROWS], offset = _mm256_setzero_ps(), scale = _mm256_setzero_ps();
    float offset_one = 0.0f, scale_one = 0.0f; /* rows = 1 (a decode step): the same operations in scalars */
    for (int r = 0; r < rows; r++) x[r] = ACT_ROW(act_block32, xv, xs, r), acc[r] = acc_odd[r] = _mm256_setzero_ps();
    for (int64_t b = 0; b < nb; b++, w += block_bytes) {
        prefetch_block(w, block_bytes);
        float d = qtype == GGUF_MXFP4 ? e8m0_half(w[0]) : half_at(w);
        if (rows == 1) {
            scale_one = d * x[0][b].d;
            if (!signed_codes) offset_one += (has_min ? half_at(w + 2) : d) * x[0][b].ds;
        } else {
            scale = _mm256_mul_ps(_mm256_set1_ps(d), _mm256_loadu_ps(sc[b].d));
            if (!signed_codes) {
                __m256 factor = _mm256_set1_ps(has_min ? half_at(w + 2) : d);
                offset = _mm256_add_ps(offset, _mm256_mul_ps(factor, _mm256_loadu_ps(sc[b].ds)));
            }
        }
        __m256i q;
        switch (qtype) {
        case GGUF_Q4_0: q = nibbles32(w + 2); break;
        case GGUF_Q4_1: q = nibbles32(w + 4); break;
        case GGUF_Q5_0: q = _mm256_or_si256(nibbles32(w + 6), high_bits32(w + 2)); break;
        case GGUF_Q5_1: q = _mm256_or_si256(nibbles32(w + 8), high_bits32(w + 4)); break;
        case GGUF_MXFP4: q = _mm256_shuffle_epi8(kvalues, nibbles32(w + 1)); break; /* code -> doubled E2M1 value */
        default: q = _mm256_loadu_si256((const __m256i *)(w + 2)); break;
        }
        __m256i q_abs = _mm256_sign_epi8(q, q);
        for (int r = 0; r < rows; r++) {
            __m256i xq = _mm256_loadu_si256((const __m256i *)x[r][b].qs);
            /* Q8_0, MXFP4: signed x signed through the unsigned product, |q| times x carrying q's sign */
            __m256i products = signed_codes ? dot_u8s8(q_abs, _mm256_sign_epi8(xq, q)) : dot_u8s8(q, xq);
            __m256 row_scale = rows == 1 ? _mm256_set1_ps(scale_one) : _mm256_permutevar8x32_ps(scale, _mm256_set1_epi32(r));
            if (two_chains && (b & 1)) acc_odd[r] = _mm256_fmadd_ps(row_scale, _mm256_cvtepi32_ps(products), acc_odd[r]);
            else acc[r] = _mm256_fmadd_ps(row_scale, _mm256_cvtepi32_ps(products), acc[r]);
        }
    }
    float off[GGUF_TILE_ROWS];
    _mm256_storeu_ps(off, offset);
    if (rows == 1) off[0] = offset_one;
    for (int r = 0; r < rows; r++) {
        float sum = hsum_ps(two_chains ? _mm256_add_ps(acc[r], acc_odd[r]) : acc[r]);
        y[r * ys] = qtype == GGUF_Q4_0 ? sum - 8.0f * off[r] : qtype == GGUF_Q5_0 ? sum - 16.0f * off[r] : has_min ? sum + off[r] : sum;
    }
}

TILE_KERNEL tile_q4_0(int64_t nb, const uint8_t *w, const void *x, size_t xs, const act_tile_scales32 *sc, const int rows, float *y, size_t ys) {
    tile_32(GGUF_Q4_0, nb, w, x, xs, sc, rows, y, ys);
}
TILE_KERNEL tile_q4_1(int64_t nb, const uint8_t *w, const void *x, size_t xs, const act_tile_scales32 *sc, const int rows, float *y, size_t ys) {
    tile_32(GGUF_Q4_1, nb, w, x, xs, sc, rows, y, ys);
}
TILE_KERNEL tile_q5_0(int64_t nb, const uint8_t *w, const void *x, size_t xs, const act_tile_scales32 *sc, const int rows, float *y, size_t ys) {
    tile_32(GGUF_Q5_0, nb, w, x, xs, sc, rows, y, ys);
}
TILE_KERNEL tile_q5_1(int64_t nb, const uint8_t *w, const void *x, size_t xs, const act_tile_scales32 *sc, const int rows, float *y, size_t ys) {
    tile_32(GGUF_Q5_1, nb, w, x, xs, sc, rows, y, ys);
}
TILE_KERNEL tile_q8_0(int64_t nb, const uint8_t *w, const void *x, size_t xs, const act_tile_scales32 *sc, const int rows, float *y, size_t ys) {
    tile_32(GGUF_Q8_0, nb, w, x, xs, sc, rows, y, ys);
}
#ifdef GGUF_USE_AVX512
/* MXFP4 on AVX-512: an even block and the odd one after it in one 512-bit register (low half: even,
 * high half: odd), so each vector operation does two blocks' work. The lanes do exactly the AVX2
 * tile's arithmetic: the low half is its even fmadd chain, the high half its odd one, and the two
 * are added and summed at the end as there; so the result is the AVX2 kernel's bit for bit, in
 * every tile size (an odd last block goes alone on the even chain, as there). The codes become
 * |value| by one byte lookup, and the activations take the code's sign (its bit 3) by a masked
 * negation: the same integer products as the sign-trick of the 256-bit path. */
static inline __m512 concat_ps(__m256 low, __m256 high) { /* AVX512F only (no DQ needed) */
    return _mm512_castpd_ps(_mm512_insertf64x4(_mm512_castpd256_pd512(_mm256_castps_pd(low)), _mm256_castps_pd(high), 1));
}

static inline __m256 high_half_ps(__m512 v) { return _mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(v), 1)); }

/* The codes (0..15) of the 17-byte blocks at w and w + 17, laid out as their activations are. */
static inline __m512i mxfp4_pair_codes(const uint8_t *w) {
    __m256i v = _mm256_inserti128_si256(_mm256_castsi128_si256(_mm_loadu_si128((const __m128i *)(w + 1))),
                                        _mm_loadu_si128((const __m128i *)(w + 18)), 1); /* [even qs | odd qs] */
    __m512i both = _mm512_permutexvar_epi64(_mm512_set_epi64(3, 2, 3, 2, 1, 0, 1, 0), _mm512_castsi256_si512(v)); /* [even, even, odd, odd] */
    both = _mm512_mask_srli_epi16(both, 0xFF00FF00u, both, 4); /* [even lo, even hi, odd lo, odd hi] after the mask */
    return _mm512_and_si512(both, _mm512_set1_epi8(0x0F));
}

static inline __m512i act_pair(const act_block32 *x, int64_t b) {
    return _mm512_inserti64x4(_mm512_castsi256_si512(_mm256_loadu_si256((const __m256i *)x[b].qs)),
                              _mm256_loadu_si256((const __m256i *)x[b + 1].qs), 1);
}

TILE_KERNEL tile_mxfp4(int64_t nb, const uint8_t *w, const void *xv, size_t xs, const act_tile_scales32 *sc, const int rows,
                       float *y, size_t ys) {
    static const int8_t magnitudes[16] = {0, 1, 2, 3, 4, 6, 8, 12, 0, 1, 2, 3, 4, 6, 8, 12};
    const __m512i table = _mm512_broadcast_i32x4(_mm_loadu_si128((const __m128i *)magnitudes));
    const __m256i kvalues = _mm256_broadcastsi128_si256(_mm_loadu_si128((const __m128i *)GGUF_KVALUES_MXFP4));
    const __m512i sign_bit = _mm512_set1_epi8(0x08), zero = _mm512_setzero_si512();
    const act_block32 *x[GGUF_TILE_ROWS];
    __m512 acc[GGUF_TILE_ROWS];
    for (int r = 0; r < rows; r++) x[r] = ACT_ROW(act_block32, xv, xs, r), acc[r] = _mm512_setzero_ps();
    int64_t b = 0;
    for (; b + 1 < nb; b += 2, w += 34) {
        prefetch_block(w, 34);
        const float d0 = e8m0_half(w[0]), d1 = e8m0_half(w[17]);
        const __m512i codes = mxfp4_pair_codes(w);
        const __m512i q_abs = _mm512_shuffle_epi8(table, codes);
        const __mmask64 negative = _mm512_test_epi8_mask(codes, sign_bit);
        __m512 scales = _mm512_setzero_ps();
        if (rows > 1) /* lanes 0-7: d0 x_r.d of block b, lanes 8-15: d1 x_r.d of block b + 1 (lane r: row r) */
            scales = concat_ps(_mm256_mul_ps(_mm256_set1_ps(d0), _mm256_loadu_ps(sc[b].d)),
                               _mm256_mul_ps(_mm256_set1_ps(d1), _mm256_loadu_ps(sc[b + 1].d)));
        for (int r = 0; r < rows; r++) {
            __m512i xq = act_pair(x[r], b);
            __m512i products = _mm512_dpbusd_epi32(zero, q_abs, _mm512_mask_sub_epi8(xq, negative, zero, xq));
            __m512 row_scale;
            if (rows == 1) {
                row_scale = concat_ps(_mm256_set1_ps(d0 * x[0][b].d), _mm256_set1_ps(d1 * x[0][b + 1].d));
            } else {
                const __m512i lane = _mm512_set_epi32(8 + r, 8 + r, 8 + r, 8 + r, 8 + r, 8 + r, 8 + r, 8 + r, r, r, r, r, r, r, r, r);
                row_scale = _mm512_permutexvar_ps(lane, scales);
            }
            acc[r] = _mm512_fmadd_ps(row_scale, _mm512_cvtepi32_ps(products), acc[r]);
        }
    }
    __m256 tail[GGUF_TILE_ROWS]; /* an odd last block: the even chain, as the AVX2 tile does it */
    for (int r = 0; r < rows; r++) tail[r] = _mm512_castps512_ps256(acc[r]);
    if (b < nb) {
        const float d = e8m0_half(w[0]);
        const __m256 scale = rows > 1 ? _mm256_mul_ps(_mm256_set1_ps(d), _mm256_loadu_ps(sc[b].d)) : _mm256_setzero_ps();
        const __m256i q = _mm256_shuffle_epi8(kvalues, nibbles32(w + 1));
        const __m256i q_abs = _mm256_sign_epi8(q, q);
        for (int r = 0; r < rows; r++) {
            __m256i xq = _mm256_loadu_si256((const __m256i *)x[r][b].qs);
            __m256i products = dot_u8s8(q_abs, _mm256_sign_epi8(xq, q));
            __m256 row_scale = rows == 1 ? _mm256_set1_ps(d * x[0][b].d) : _mm256_permutevar8x32_ps(scale, _mm256_set1_epi32(r));
            tail[r] = _mm256_fmadd_ps(row_scale, _mm256_cvtepi32_ps(products), tail[r]);
        }
    }
    for (int r = 0; r < rows; r++) y[r * ys] = hsum_ps(_mm256_add_ps(tail[r], high_half_ps(acc[r])));
}
#else
TILE_KERNEL tile_mxfp4(int64_t nb, const uint8_t *w, const void *x, size_t xs, const act_tile_scales32 *sc, const int rows, float *y, size_t ys) {
    tile_32(GGUF_MXFP4, nb, w, x, xs, sc, rows, y, ys);
}
#endif

/* The 12 scale bytes of a Q4_K/Q5_K block -> eight 6-bit scales and eight 6-bit minimums, one
 * byte each, by 32-bit word arithmetic: bytes 0-3 hold scales 0-3 (low 6 bits) and the top bits
 * of scales 4-7, bytes 4-7 the same for the minimums, bytes 8-11 the low nibbles of 4-7. */
static inline void unpack_k_scales(const uint8_t *s, uint64_t *scales, uint64_t *minimums) {
    uint32_t a, b, c;
    memcpy(&a, s, 4);
    memcpy(&b, s + 4, 4);
    memcpy(&c, s + 8, 4);
    uint32_t scale_lo = a & 0x3F3F3F3Fu, scale_hi = (c & 0x0F0F0F0Fu) | ((a >> 2) & 0x30303030u);
    uint32_t min_lo = b & 0x3F3F3F3Fu, min_hi = ((c >> 4) & 0x0F0F0F0Fu) | ((b >> 2) & 0x30303030u);
    *scales = scale_lo | ((uint64_t)scale_hi << 32);
    *minimums = min_lo | ((uint64_t)min_hi << 32);
}

/* minimum[j] x (bsums[2j] + bsums[2j+1]) over the eight sub-blocks, as 8 int32 lanes to sum later. */
static inline __m256i minimum_products(uint64_t minimums, const int16_t *bsums) {
    __m256i sums = _mm256_loadu_si256((const __m256i *)bsums);
    __m128i m8 = _mm_cvtsi64_si128((long long)minimums);
    __m256i m16 = _mm256_cvtepu8_epi16(_mm_unpacklo_epi8(m8, m8)); /* each minimum twice */
    return _mm256_madd_epi16(sums, m16);
}

/* isum + the int16 pairs of `products` times `scales`, summed to int32 lanes (one VNNI
 * instruction where built for it). */
static inline __m256i add_scaled_pairs(__m256i isum, __m256i products, __m256i scales) {
#ifdef GGUF_USE_VNNI
    return _mm256_dpwssd_epi32(isum, products, scales);
#else
    return _mm256_add_epi32(isum, _mm256_madd_epi16(products, scales));
#endif
}

/* Byte shuffles that spread one int16 of a 128-bit lane over the whole lane: SPREAD16(j) takes
 * int16 j (bytes 2j, 2j+1) into all eight int16 lanes. */
#define SPREAD16(j) ((char)(2 * (j))), ((char)(2 * (j) + 1))
#define SPREAD16x8(j) SPREAD16(j), SPREAD16(j), SPREAD16(j), SPREAD16(j), SPREAD16(j), SPREAD16(j), SPREAD16(j), SPREAD16(j)

/* Eight sub-block scales (bytes of `scales`) as int16 in both 128-bit lanes: a shuffle by
 * `spread_k_scale(j)` then gives sub-block j's scale in every int16 lane. */
static inline __m256i k_scales16(uint64_t scales) {
    return _mm256_broadcastsi128_si256(_mm_cvtepu8_epi16(_mm_cvtsi64_si128((long long)scales)));
}

/* 8 int32 vectors -> one whose lane r is the sum of vector r's lanes (integer sums: exact in any order). */
static inline __m256i hsum8_epi32(const __m256i v[8]) {
    __m256i ab = _mm256_hadd_epi32(_mm256_hadd_epi32(v[0], v[1]), _mm256_hadd_epi32(v[2], v[3]));
    __m256i ce = _mm256_hadd_epi32(_mm256_hadd_epi32(v[4], v[5]), _mm256_hadd_epi32(v[6], v[7]));
    /* ab: lane r (r < 4) the low half of v[r], lane 4 + r its high half; ce the same for v[4..7] */
    return _mm256_add_epi32(_mm256_permute2x128_si256(ab, ce, 0x20), _mm256_permute2x128_si256(ab, ce, 0x31));
}

/* Q4_K. Every path that runs Q4_K on x86 (this tile at any row count, and the AMX kernels of
 * gguf_amx.c) computes per 256-block and row the exact int32 totals T = sum_j scale_j (q . x)_j and
 * M = sum_j minimum_j (sum of x)_j, then the same float steps in block order:
 *   acc = fmaf(x.d * d, (float)T, acc); acc = fmaf(-(x.d * dmin), (float)M, acc); y = acc,
 * so a row's bits do not depend on the path or its tile (in a tile, lane r of one vector does row r's
 * scalar operations). */
TILE_KERNEL tile_q4_k(int64_t nb, const uint8_t *w, const void *xv, size_t xs, const act_tile_scales32 *sc, const int rows,
                      float *y, size_t ys) {
    (void)sc; /* 256-blocks read their scales from the rows */
    const __m256i low = _mm256_set1_epi8(0x0F);
    const __m256i spread[8] = {
        _mm256_setr_epi8(SPREAD16x8(0), SPREAD16x8(0)), _mm256_setr_epi8(SPREAD16x8(1), SPREAD16x8(1)),
        _mm256_setr_epi8(SPREAD16x8(2), SPREAD16x8(2)), _mm256_setr_epi8(SPREAD16x8(3), SPREAD16x8(3)),
        _mm256_setr_epi8(SPREAD16x8(4), SPREAD16x8(4)), _mm256_setr_epi8(SPREAD16x8(5), SPREAD16x8(5)),
        _mm256_setr_epi8(SPREAD16x8(6), SPREAD16x8(6)), _mm256_setr_epi8(SPREAD16x8(7), SPREAD16x8(7)),
    };
    const act_block256 *x[GGUF_TILE_ROWS];
    float acc_one = 0.0f;              /* rows = 1 (a decode step): scalars */
    __m256 acc = _mm256_setzero_ps();  /* rows > 1: lane r for row r */
    for (int r = 0; r < rows; r++) x[r] = ACT_ROW(act_block256, xv, xs, r);
    for (int64_t b = 0; b < nb; b++, w += 144) {
        prefetch_block(w, 144);
        uint64_t scale, minimum;
        unpack_k_scales(w + 4, &scale, &minimum);
        const __m256i scales16 = k_scales16(scale);
        const uint8_t *qs = w + 16;
        __m256i isum[GGUF_TILE_ROWS], isum_hi[GGUF_TILE_ROWS];
        for (int r = 0; r < rows; r++) isum[r] = isum_hi[r] = _mm256_setzero_si256();
        for (int g = 0; g < 4; g++) {
            __m256i v = _mm256_loadu_si256((const __m256i *)(qs + 32 * g));
            __m256i lo = _mm256_and_si256(v, low);
            __m256i hi = _mm256_and_si256(_mm256_srli_epi16(v, 4), low);
            __m256i scale_lo = _mm256_shuffle_epi8(scales16, spread[2 * g]);
            __m256i scale_hi = _mm256_shuffle_epi8(scales16, spread[2 * g + 1]);
            for (int r = 0; r < rows; r++) {
                const int8_t *xq = x[r][b].qs;
                __m256i p_lo = _mm256_maddubs_epi16(lo, _mm256_loadu_si256((const __m256i *)(xq + 64 * g)));
                __m256i p_hi = _mm256_maddubs_epi16(hi, _mm256_loadu_si256((const __m256i *)(xq + 64 * g + 32)));
                isum[r] = add_scaled_pairs(isum[r], p_lo, scale_lo);
                isum_hi[r] = add_scaled_pairs(isum_hi[r], p_hi, scale_hi);
            }
        }
        const float d = half_at(w), dmin = half_at(w + 2);
        if (rows == 1) {
            /* T and M of the one row: [T, M, T, M] after two horizontal adds */
            __m256i t = _mm256_hadd_epi32(_mm256_add_epi32(isum[0], isum_hi[0]), minimum_products(minimum, x[0][b].bsums));
            __m128i s = _mm_add_epi32(_mm256_castsi256_si128(t), _mm256_extracti128_si256(t, 1));
            s = _mm_hadd_epi32(s, s);
            const float xd = x[0][b].d;
            acc_one = fmaf(xd * d, (float)_mm_cvtsi128_si32(s), acc_one);
            acc_one = fmaf(-(xd * dmin), (float)_mm_extract_epi32(s, 1), acc_one);
        } else {
            __m256i totals[8], mins[8];
            float xd[8];
            for (int r = 0; r < 8; r++) {
                totals[r] = r < rows ? _mm256_add_epi32(isum[r], isum_hi[r]) : _mm256_setzero_si256();
                mins[r] = r < rows ? minimum_products(minimum, x[r][b].bsums) : _mm256_setzero_si256();
                xd[r] = r < rows ? x[r][b].d : 0.0f;
            }
            const __m256 row_d = _mm256_loadu_ps(xd);
            acc = _mm256_fmadd_ps(_mm256_mul_ps(row_d, _mm256_set1_ps(d)), _mm256_cvtepi32_ps(hsum8_epi32(totals)), acc);
            acc = _mm256_fnmadd_ps(_mm256_mul_ps(row_d, _mm256_set1_ps(dmin)), _mm256_cvtepi32_ps(hsum8_epi32(mins)), acc);
        }
    }
    if (rows == 1) {
        y[0] = acc_one;
    } else {
        float out[8];
        _mm256_storeu_ps(out, acc);
        for (int r = 0; r < rows; r++) y[r * ys] = out[r];
    }
}

TILE_KERNEL tile_q5_k(int64_t nb, const uint8_t *w, const void *xv, size_t xs, const act_tile_scales32 *sc, const int rows,
                      float *y, size_t ys) {
    (void)sc; /* 256-blocks read their scales from the rows */
    const __m256i low = _mm256_set1_epi8(0x0F), one = _mm256_set1_epi8(1);
    const __m256i spread[8] = {
        _mm256_setr_epi8(SPREAD16x8(0), SPREAD16x8(0)), _mm256_setr_epi8(SPREAD16x8(1), SPREAD16x8(1)),
        _mm256_setr_epi8(SPREAD16x8(2), SPREAD16x8(2)), _mm256_setr_epi8(SPREAD16x8(3), SPREAD16x8(3)),
        _mm256_setr_epi8(SPREAD16x8(4), SPREAD16x8(4)), _mm256_setr_epi8(SPREAD16x8(5), SPREAD16x8(5)),
        _mm256_setr_epi8(SPREAD16x8(6), SPREAD16x8(6)), _mm256_setr_epi8(SPREAD16x8(7), SPREAD16x8(7)),
    };
    const act_block256 *x[GGUF_TILE_ROWS];
    __m256 acc[GGUF_TILE_ROWS], acc_min[GGUF_TILE_ROWS];
    for (int r = 0; r < rows; r++) x[r] = ACT_ROW(act_block256, xv, xs, r), acc[r] = acc_min[r] = _mm256_setzero_ps();
    for (int64_t b = 0; b < nb; b++, w += 176) {
        prefetch_block(w, 176);
        uint64_t scale, minimum;
        unpack_k_scales(w + 4, &scale, &minimum);
        const __m256i scales16 = k_scales16(scale);
        const uint8_t *qs = w + 48;
        __m256i qh = _mm256_loadu_si256((const __m256i *)(w + 16));
        __m256i isum[GGUF_TILE_ROWS];
        for (int r = 0; r < rows; r++) isum[r] = _mm256_setzero_si256();
        for (int g = 0; g < 4; g++) {
            __m256i v = _mm256_loadu_si256((const __m256i *)(qs + 32 * g));
            __m256i h_lo = _mm256_slli_epi16(_mm256_and_si256(qh, one), 4);
            __m256i h_hi = _mm256_slli_epi16(_mm256_and_si256(_mm256_srli_epi16(qh, 1), one), 4);
            qh = _mm256_srli_epi16(qh, 2);
            __m256i lo = _mm256_or_si256(_mm256_and_si256(v, low), h_lo);
            __m256i hi = _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16(v, 4), low), h_hi);
            __m256i scale_lo = _mm256_shuffle_epi8(scales16, spread[2 * g]);
            __m256i scale_hi = _mm256_shuffle_epi8(scales16, spread[2 * g + 1]);
            for (int r = 0; r < rows; r++) {
                const int8_t *xq = x[r][b].qs;
                __m256i p_lo = _mm256_maddubs_epi16(lo, _mm256_loadu_si256((const __m256i *)(xq + 64 * g)));
                __m256i p_hi = _mm256_maddubs_epi16(hi, _mm256_loadu_si256((const __m256i *)(xq + 64 * g + 32)));
                isum[r] = add_scaled_pairs(isum[r], p_lo, scale_lo);
                isum[r] = add_scaled_pairs(isum[r], p_hi, scale_hi);
            }
        }
        float d = half_at(w), dmin = half_at(w + 2);
        for (int r = 0; r < rows; r++) {
            acc[r] = _mm256_fmadd_ps(_mm256_set1_ps(x[r][b].d * d), _mm256_cvtepi32_ps(isum[r]), acc[r]);
            acc_min[r] = _mm256_fmadd_ps(_mm256_set1_ps(x[r][b].d * dmin),
                                         _mm256_cvtepi32_ps(minimum_products(minimum, x[r][b].bsums)), acc_min[r]);
        }
    }
    for (int r = 0; r < rows; r++) y[r * ys] = hsum_ps(_mm256_sub_ps(acc[r], acc_min[r]));
}

/* Q6_K: 32 values (h, k) take scale 8h + 2k in the low 128-bit lane and 8h + 2k + 1 in the high
 * one; with one half's eight scales as int16 in both lanes, SPREAD16 of 2k (low) and 2k + 1 (high). */
TILE_KERNEL tile_q6_k(int64_t nb, const uint8_t *w, const void *xv, size_t xs, const act_tile_scales32 *sc, const int rows,
                      float *y, size_t ys) {
    (void)sc; /* 256-blocks read their scales from the rows */
    const __m256i low = _mm256_set1_epi8(0x0F), high_mask = _mm256_set1_epi8(0x30);
    const __m256i spread[4] = {
        _mm256_setr_epi8(SPREAD16x8(0), SPREAD16x8(1)), _mm256_setr_epi8(SPREAD16x8(2), SPREAD16x8(3)),
        _mm256_setr_epi8(SPREAD16x8(4), SPREAD16x8(5)), _mm256_setr_epi8(SPREAD16x8(6), SPREAD16x8(7)),
    };
    const act_block256 *x[GGUF_TILE_ROWS];
    __m256 acc[GGUF_TILE_ROWS];
    for (int r = 0; r < rows; r++) x[r] = ACT_ROW(act_block256, xv, xs, r), acc[r] = _mm256_setzero_ps();
    for (int64_t b = 0; b < nb; b++, w += 210) {
        prefetch_block(w, 210);
        const uint8_t *ql = w, *qhp = w + 128;
        const int8_t *scales = (const int8_t *)(w + 192);
        const __m128i scale_bytes = _mm_loadu_si128((const __m128i *)scales);
        __m256i isum[GGUF_TILE_ROWS], isum_odd[GGUF_TILE_ROWS]; /* two integer chains: k even, k odd */
        for (int r = 0; r < rows; r++) isum[r] = isum_odd[r] = _mm256_setzero_si256();
        for (int h = 0; h < 2; h++) {
            __m256i a = _mm256_loadu_si256((const __m256i *)(ql + 64 * h));
            __m256i c = _mm256_loadu_si256((const __m256i *)(ql + 64 * h + 32));
            __m256i qh = _mm256_loadu_si256((const __m256i *)(qhp + 32 * h));
            __m256i half_scales = _mm256_broadcastsi128_si256(_mm_cvtepi8_epi16(h ? _mm_srli_si128(scale_bytes, 8) : scale_bytes));
            /* code k: a nibble, and bits 2k, 2k+1 of qh moved to bits 4, 5 */
            __m256i q[4] = {
                _mm256_or_si256(_mm256_and_si256(a, low), _mm256_and_si256(_mm256_slli_epi16(qh, 4), high_mask)),
                _mm256_or_si256(_mm256_and_si256(c, low), _mm256_and_si256(_mm256_slli_epi16(qh, 2), high_mask)),
                _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16(a, 4), low), _mm256_and_si256(qh, high_mask)),
                _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16(c, 4), low), _mm256_and_si256(_mm256_srli_epi16(qh, 2), high_mask)),
            };
            for (int k = 0; k < 4; k++) {
                __m256i scale = _mm256_shuffle_epi8(half_scales, spread[k]);
                for (int r = 0; r < rows; r++) {
                    __m256i p = _mm256_maddubs_epi16(q[k], _mm256_loadu_si256((const __m256i *)(x[r][b].qs + 128 * h + 32 * k)));
                    if (k & 1) isum_odd[r] = add_scaled_pairs(isum_odd[r], p, scale);
                    else isum[r] = add_scaled_pairs(isum[r], p, scale);
                }
            }
        }
        /* the codes are q + 32: take 32 x scale x (sum of the 16 activations) back out */
        __m256i sc16 = _mm256_cvtepi8_epi16(scale_bytes);
        float d = half_at(w + 208);
        for (int r = 0; r < rows; r++) {
            __m256i sums = _mm256_loadu_si256((const __m256i *)x[r][b].bsums);
            isum[r] = _mm256_sub_epi32(_mm256_add_epi32(isum[r], isum_odd[r]), _mm256_slli_epi32(_mm256_madd_epi16(sums, sc16), 5));
            acc[r] = _mm256_fmadd_ps(_mm256_set1_ps(x[r][b].d * d), _mm256_cvtepi32_ps(isum[r]), acc[r]);
        }
    }
    for (int r = 0; r < rows; r++) y[r * ys] = hsum_ps(acc[r]);
}

/* The tile entry point of each type: constant row counts, so each tile is compiled with its loops
 * unrolled and its accumulators in registers (rows = 1 is the decode step's one-row dot). */
#define KERNELS(name)                                                                                  \
    static void rows_##name(int64_t nb, const uint8_t *w, int64_t weight_rows, int64_t row_bytes, const void *x, \
                            size_t xs, const act_tile_scales32 *sc, int rows, float *y, size_t ys) {   \
        switch (rows) {                                                                                \
        case 1: for (int64_t i = 0; i < weight_rows; i++) tile_##name(nb, w + i * row_bytes, x, xs, sc, 1, y + i, ys); break; \
        case 2: for (int64_t i = 0; i < weight_rows; i++) tile_##name(nb, w + i * row_bytes, x, xs, sc, 2, y + i, ys); break; \
        case 3: for (int64_t i = 0; i < weight_rows; i++) tile_##name(nb, w + i * row_bytes, x, xs, sc, 3, y + i, ys); break; \
        case 4: for (int64_t i = 0; i < weight_rows; i++) tile_##name(nb, w + i * row_bytes, x, xs, sc, 4, y + i, ys); break; \
        case 5: for (int64_t i = 0; i < weight_rows; i++) tile_##name(nb, w + i * row_bytes, x, xs, sc, 5, y + i, ys); break; \
        case 6: for (int64_t i = 0; i < weight_rows; i++) tile_##name(nb, w + i * row_bytes, x, xs, sc, 6, y + i, ys); break; \
        case 7: for (int64_t i = 0; i < weight_rows; i++) tile_##name(nb, w + i * row_bytes, x, xs, sc, 7, y + i, ys); break; \
        default: for (int64_t i = 0; i < weight_rows; i++) tile_##name(nb, w + i * row_bytes, x, xs, sc, 8, y + i, ys); break; \
        }                                                                                              \
    }
#define ISA_ROWS(NAME, name) KERNELS(name)
GGUF_TYPES_AVX2(ISA_ROWS)
#undef ISA_ROWS

/* The portable kernels, with this file's in place of those it has (every type runs on every ISA). */
void gguf_table_avx2(gguf_kernel_table *table) {
    gguf_table_portable(table);
#define ENTRY(NAME, name) table->rows[GGUF_##NAME] = rows_##name;
    GGUF_TYPES_AVX2(ENTRY)
#undef ENTRY
}
