/* The AVX2 kernels rebuilt with AVX-512 VNNI's 256-bit u8 x s8 dot product (vpdpbusd) for the
 * 32-block types: the same integer sums, one instruction instead of two. */
#define GGUF_USE_VNNI 1
#define gguf_table_avx2 gguf_table_avx512vnni
#include "gguf_avx2.c"
