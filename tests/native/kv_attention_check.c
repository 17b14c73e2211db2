/* Emulated check of the fp16-KV attention's portable C on ARM64 (tests/test_gguf_kernel_neon.py
 * runs it under qemu-aarch64 and compares with the numpy reference of tests/test_kv_attention.py).
 * Usage: kv_attention_check <case> <result> portable|neon. The case file: ten int64 (batch, seq, heads, kv_heads,
 * dim, capacity, rope_positions, rotary_pairs, interleaved, window), two float32 (scale, softcap),
 * then qkv float32, seqlens_k int32, cos and sin float32, key and value fp16 bits; the result file:
 * the output float32, then the key and value caches after the step. */
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "kv_attention.h"

static void *read_block(FILE *f, size_t bytes) {
    void *p = malloc(bytes ? bytes : 1);
    if (p == NULL || fread(p, 1, bytes, f) != bytes) {
        fprintf(stderr, "short case file\n");
        exit(2);
    }
    return p;
}

int main(int argc, char **argv) {
    if (argc != 4) return 2;
    FILE *in = fopen(argv[1], "rb");
    if (in == NULL) return 2;
    int64_t h[10];
    float f[2];
    if (fread(h, sizeof h, 1, in) != 1 || fread(f, sizeof f, 1, in) != 1) return 2;
    kv_attention_job job = {.batch = h[0], .seq = h[1], .heads = h[2], .kv_heads = h[3], .dim = h[4], .capacity = h[5],
                            .rope_positions = h[6], .rotary_pairs = h[7], .interleaved = (int)h[8], .window = h[9],
                            .scale = f[0], .softcap = f[1]};
    size_t cache = (size_t)(job.batch * job.kv_heads * job.capacity * job.dim), out = (size_t)(job.batch * job.seq * job.heads * job.dim);
    size_t pairs = (size_t)(job.rope_positions * (job.rotary_pairs ? job.rotary_pairs : 1));
    job.qkv = read_block(in, sizeof(float) * (size_t)(job.batch * job.seq * (job.heads + 2 * job.kv_heads) * job.dim));
    job.seqlens_k = read_block(in, sizeof(int32_t) * (size_t)job.batch);
    job.cos = read_block(in, sizeof(float) * pairs);
    job.sin = read_block(in, sizeof(float) * pairs);
    job.key = read_block(in, 2 * cache);
    job.value = read_block(in, 2 * cache);
    fclose(in);
    job.out = malloc(sizeof(float) * out);
    job.q_rotated = malloc(sizeof(float) * out);
    kv_attention_kernels kernels;
    kv_attention_portable(&kernels);
    if (strcmp(argv[3], "neon") == 0) kv_attention_neon(&kernels);
    job.kernels = &kernels;
    const char *problem = kv_attention_prepare(&job);
    if (problem != NULL) {
        fprintf(stderr, "%s\n", problem);
        return 1;
    }
    for (int64_t t = 0; t < job.batch * job.kv_heads * job.seq; t++) {
        if (kv_attention_task(&job, t) != 0) return 1;
    }
    FILE *result = fopen(argv[2], "wb");
    if (result == NULL || fwrite(job.out, sizeof(float), out, result) != out || fwrite(job.key, 2, cache, result) != cache ||
        fwrite(job.value, 2, cache, result) != cache) {
        return 1;
    }
    fclose(result);
    return 0;
}
