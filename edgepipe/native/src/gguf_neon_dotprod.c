/* The NEON kernels rebuilt with the Armv8.2 dot-product instructions (sdot: four byte products
 * summed per lane in one instruction); compiled with +dotprod, called only where the CPU has it. */
#define GGUF_USE_DOTPROD 1
#define gguf_table_neon_name gguf_table_neon_dotprod
#include "gguf_neon.c"
