/* Emulated check of the ARM64 kernels (tests/test_gguf_kernel_neon.py runs it under qemu-aarch64):
 * random blocks of every type, each ISA this CPU offers against the portable path, bit for bit,
 * for one activation row and for a batch of 11 (a row's bits must not depend on its tile).
 * Prints the best ISA, then one line per type and ISA: "<type> <isa> equal" or "... DIFFERS ...". */
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

const char *edgepipe_gguf_matmul(int qtype, const char *isa, const float *x, int64_t m, int64_t k, const uint8_t *w,
                                 int64_t n, int64_t row_bytes, float *y);
const char *edgepipe_gguf_best_isa(void);

static uint64_t state = 0x9E3779B97F4A7C15ull;
static uint32_t next_random(void) { /* xorshift64* */
    state ^= state >> 12, state ^= state << 25, state ^= state >> 27;
    return (uint32_t)((state * 0x2545F4914F6CDD1Dull) >> 32);
}
static float uniform(void) { return (float)next_random() / 4294967296.0f - 0.5f; }

/* A finite fp16 of magnitude ~2^-10..2^-5 (both signs): a block scale. */
static void put_half(uint8_t *p) {
    uint16_t h = (uint16_t)(((next_random() & 1) << 15) | ((5 + next_random() % 6) << 10) | (next_random() & 0x3FF));
    memcpy(p, &h, 2);
}

/* Where each type keeps its block scales: fp16 halves (offsets, -1 for none) or an E8M0 exponent. */
typedef struct { const char *name; int qtype, values, bytes, halves[2], e8m0; } block_type;
static const block_type TYPES[] = {
    {"Q4_0", 2, 32, 18, {0, -1}, -1}, {"Q4_1", 3, 32, 20, {0, 2}, -1},   {"Q5_0", 6, 32, 22, {0, -1}, -1},
    {"Q5_1", 7, 32, 24, {0, 2}, -1},  {"Q8_0", 8, 32, 34, {0, -1}, -1},  {"Q4_K", 12, 256, 144, {0, 2}, -1},
    {"Q5_K", 13, 256, 176, {0, 2}, -1}, {"Q6_K", 14, 256, 210, {208, -1}, -1}, {"MXFP4", 39, 32, 17, {-1, -1}, 0},
};

int main(int argc, char **argv) {
    const char *best = edgepipe_gguf_best_isa();
    printf("best %s\n", best);
    const char *isas[] = {"neon", "neon_dotprod"};
    const int64_t n = 37, k = 1024, m = 11;
    int failures = 0;
    for (size_t t = 0; t < sizeof TYPES / sizeof TYPES[0]; t++) {
        const block_type *type = &TYPES[t];
        int64_t row_bytes = k / type->values * type->bytes, blocks = n * k / type->values;
        uint8_t *w = malloc((size_t)(n * row_bytes));
        for (int64_t i = 0; i < n * row_bytes; i++) w[i] = (uint8_t)next_random();
        for (int64_t b = 0; b < blocks; b++)
            for (int h = 0; h < 2; h++)
                if (type->halves[h] >= 0) put_half(w + b * type->bytes + type->halves[h]);
        for (int64_t b = 0; b < blocks && type->e8m0 >= 0; b++) /* 2^-28..2^-1; block 0 at 2^-128, a subnormal */
            w[b * type->bytes + type->e8m0] = b == 0 ? 0 : (uint8_t)(100 + next_random() % 28);
        float *x = malloc(sizeof(float) * (size_t)(m * k));
        for (int64_t i = 0; i < m * k; i++) x[i] = uniform() * (i % 97 == 0 ? 40.0f : 1.0f);
        float *reference = malloc(sizeof(float) * (size_t)(m * n)), *y = malloc(sizeof(float) * (size_t)(m * n));
        const char *error = edgepipe_gguf_matmul(type->qtype, "portable", x, m, k, w, n, row_bytes, reference);
        if (error) { printf("%s portable error %s\n", type->name, error); return 2; }
        for (size_t i = 0; i < sizeof isas / sizeof isas[0]; i++) {
            error = edgepipe_gguf_matmul(type->qtype, isas[i], x, m, k, w, n, row_bytes, y);
            if (error) { printf("%s %s unavailable: %s\n", type->name, isas[i], error); continue; }
            int equal = memcmp(y, reference, sizeof(float) * (size_t)(m * n)) == 0;
            for (int64_t r = 0; r < m && equal; r++) { /* each row alone: the one-row path */
                float alone[64];
                edgepipe_gguf_matmul(type->qtype, isas[i], x + r * k, 1, k, w, n, row_bytes, alone);
                equal = memcmp(alone, reference + r * n, sizeof(float) * (size_t)n) == 0;
            }
            if (!equal) failures++;
            printf("%s %s %s (y[0] %.9g, portable %.9g)\n", type->name, isas[i], equal ? "equal" : "DIFFERS", y[0], reference[0]);
        }
        free(w), free(x), free(reference), free(y);
    }
    (void)argc, (void)argv;
    return failures ? 1 : 0;
}
