/* The AVX2 kernels rebuilt with AVX-512 VNNI's 256-bit u8 x s8 dot product (vpdpbusd) for the
 * 32-block types: the same integer sums, one instruction instead of two; and MXFP4 two blocks per
 * 512-bit register (GGUF_USE_AVX512; AVX512F/BW/VL, no DQ), with the AVX2 kernel's arithmetic. */
#define GGUF_USE_VNNI 1
#define GGUF_USE_AVX512 1
#define gguf_table_avx2 gguf_table_avx512vnni
#include "gguf_avx2.c"
