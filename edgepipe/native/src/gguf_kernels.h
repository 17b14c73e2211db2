/* Shared declarations of the GGUF block kernels: activation blocks, per-type dot products and the
 * per-ISA tables. Block layouts follow the GGUF format description (gguf-py's quants.py documents
 * them); nothing here is taken from another engine's source. */
#ifndef EDGEPIPE_GGUF_KERNELS_H
#define EDGEPIPE_GGUF_KERNELS_H

#include <stddef.h>
#include <stdint.h>

/* The block types: one row each in edgepipe/native/quant_types.py, generated into gguf_types.h. */
#include "gguf_types.h"

/* GGML type ids (the numbers stored in a GGUF tensor header), GGUF_<NAME> for each row. */
enum {
#define GGUF_TYPE_ID(NAME, name, id, values, bytes, act) GGUF_##NAME = id,
    GGUF_TYPES(GGUF_TYPE_ID)
#undef GGUF_TYPE_ID
};

/* Bytes per block of a type id known at compile time (folds to a constant in a specialised kernel). */
static inline int gguf_block_bytes(int qtype) {
    switch (qtype) {
#define GGUF_TYPE_BYTES(NAME, name, id, values, bytes, act) case id: return bytes;
        GGUF_TYPES(GGUF_TYPE_BYTES)
#undef GGUF_TYPE_BYTES
    }
    return 0;
}

/* MXFP4's E2M1 codes as doubled values (the block exponent is halved to match), and its E8M0
 * exponent e as that half scale 2^(e - 128), bit for bit as gguf-py's e8m0_to_fp32_half. */
static const int8_t GGUF_KVALUES_MXFP4[16] = {0, 1, 2, 3, 4, 6, 8, 12, 0, -1, -2, -3, -4, -6, -8, -12};
static inline float gguf_e8m0_half(uint8_t e) {
    union { uint32_t bits; float value; } u;
    u.bits = e < 2 ? 0x00200000u << e : (uint32_t)(e - 1) << 23;
    return u.value;
}

/* Activations quantized per 256 for the k-quants: 8-bit values, sums of each 16, scale. 64-byte
 * aligned and sized (the buffers are), so no 32-byte load of the values straddles a cache line. */
typedef struct {
    int8_t qs[256];
    int16_t bsums[16];
    float d;
} __attribute__((aligned(64))) act_block256;

/* Activations quantized per 32 for the 32-blocks: scale, scale x sum of values, 8-bit values. */
typedef struct {
    float d;
    float ds;
    int8_t qs[32];
} act_block32;

/* Most activation rows one call of a `gguf_rows_dot` takes. */
#define GGUF_TILE_ROWS 8

/* The scales of one 32-block across a tile's activation rows, lane r for row r (0 past the last
 * row): the per-block float work of a tile in one vector operation per block. */
typedef struct {
    float d[GGUF_TILE_ROWS];
    float ds[GGUF_TILE_ROWS];
} act_tile_scales32;

/* `weight_rows` consecutive weight rows (`row_bytes` apart) of `nblocks` GGUF blocks each against
 * `rows` (1..GGUF_TILE_ROWS) quantized activation rows `activation_stride` bytes apart:
 * y[r * y_stride + i] = the dot product of weight row i with activation row r. `tile_scales`
 * (32-block types: nblocks entries; NULL for the 256-block types) repeats the rows' block scales
 * by block; a kernel may read them there instead of from the rows (same values). Each weight
 * block is unpacked once for all rows, and each row's float arithmetic is exactly the one-row
 * dot's, so a row's result does not depend on how many rows share the call (batch invariance,
 * bit for bit). Several weight rows per call let a kernel set up its constants once. */
typedef void (*gguf_rows_dot)(int64_t nblocks, const uint8_t *weights, int64_t weight_rows, int64_t row_bytes,
                              const void *activations, size_t activation_stride, const act_tile_scales32 *tile_scales,
                              int rows, float *y, size_t y_stride);

/* One ISA's kernels, indexed by GGML type id (NULL where the type is not supported). An ISA's
 * table starts as the portable one and replaces the types its file has kernels for (the
 * GGUF_TYPES_<ISA> lists), so every type runs everywhere: ggml's arch-fallback.h, as a table. */
typedef struct {
    gguf_rows_dot rows[GGUF_TYPE_SLOTS];
} gguf_kernel_table;

typedef struct {
    int block_values;      /* values per block: 32 or 256 */
    int block_bytes;       /* bytes per block as stored */
    int activation_values; /* activations quantized per 32 (act_block32) or 256 (act_block256) */
} gguf_type_info;

/* Block geometry of a supported type, or NULL. */
const gguf_type_info *gguf_type(int qtype);

/* Quantize one row of K floats (K a multiple of the block) into the activation blocks. */
void gguf_quantize_row256(const float *x, act_block256 *out, int64_t k);
void gguf_quantize_row32(const float *x, act_block32 *out, int64_t k);

float gguf_half_to_float(uint16_t h);

/* One row of K weights as floats, equal to gguf-py's dequantize bit for bit. */
void gguf_dequantize_row(int qtype, const uint8_t *row, float *out, int64_t k);

/* Fill `table` with this ISA's kernels. */
void gguf_table_portable(gguf_kernel_table *table);
void gguf_table_avx2(gguf_kernel_table *table);
void gguf_table_avx512vnni(gguf_kernel_table *table);
void gguf_table_neon(gguf_kernel_table *table);
void gguf_table_neon_dotprod(gguf_kernel_table *table);

/* Intel AMX (gguf_amx.c, built where the compiler has -mamx-int8): Q4_K products of many rows with
 * the bits of the AVX kernels. gguf_amx_request asks Linux for the tile state (1: granted);
 * gguf_amx_pack_acts lays quantized activation rows 16 g .. 16 g + 15 out as tiles (buffer of
 * gguf_amx_acts_bytes, 64-byte aligned); gguf_amx_q4_k: `weight_rows` (a multiple of 16) rows
 * against all m rows, y[r * ys + i]; 0, or -1 when out of memory. */
int gguf_amx_request(void);
size_t gguf_amx_acts_bytes(int64_t m, int64_t nblocks);
void gguf_amx_pack_acts(const void *xq, size_t row_bytes, int64_t m, int64_t nblocks, int64_t g, void *out);
int gguf_amx_q4_k(int64_t nblocks, const uint8_t *w, int64_t weight_rows, int64_t row_bytes, const void *packed, int64_t m,
                  float *y, size_t ys);

/* AVX-512 VNNI with lanes over 16 weight rows (gguf_vnni_wide.c, built on every x86-64): Q4_K
 * products of many rows with the bits of the AVX tiles, reading the quantized rows where they are
 * (`xq`, `xq_row_bytes` apart). `weight_rows` a multiple of 16; y[r * ys + i]; 0, or -1 when out of memory. */
int gguf_vnni_q4_k(int64_t nblocks, const uint8_t *w, int64_t weight_rows, int64_t row_bytes, const void *xq,
                   size_t xq_row_bytes, int64_t m, float *y, size_t ys);

#endif
