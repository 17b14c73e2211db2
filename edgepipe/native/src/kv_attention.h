/* Attention over an fp16 KV cache (the `KvAttention` op of the kernel form): rotary inside, grouped
 * query heads sharing a KV head, causal with an optional sliding window, past/present one buffer.
 * The cache holds IEEE half values (round to nearest even, as numpy's astype(float16)); scores,
 * softmax and the weighted sum of values are computed in fp32. */
#ifndef EDGEPIPE_KV_ATTENTION_H
#define EDGEPIPE_KV_ATTENTION_H

#include <stddef.h>
#include <stdint.h>

/* The inner loops one ISA provides. `group` query heads of `dim` floats each (q, rows `dim` apart)
 * against `keys` cache rows of `dim` halves (`row` apart, in halves):
 *   scores:     out[h * keys + j] = dot(q_h, k_j)
 *   accumulate: acc[h * dim + d] = sum_j p[h * keys + j] * v_j[d]   (acc overwritten)
 *   to_half:    n floats -> halves, round to nearest even */
typedef struct {
    void (*scores)(const uint16_t *k, int64_t keys, int64_t row, const float *q, int group, int64_t dim, float *out);
    void (*accumulate)(const uint16_t *v, int64_t keys, int64_t row, const float *p, int group, int64_t dim, float *acc);
    void (*to_half)(const float *x, uint16_t *out, int64_t n);
    void (*exp_shifted)(float *x, int64_t n, float shift); /* x[i] = exp(x[i] - shift) */
} kv_attention_kernels;

void kv_attention_portable(kv_attention_kernels *kernels);
void kv_attention_avx2(kv_attention_kernels *kernels); /* needs head dims that are multiples of 16 */
void kv_attention_neon(kv_attention_kernels *kernels); /* ARM64; head dims that are multiples of 16 */

typedef struct {
    int64_t batch, seq, heads, kv_heads, dim, capacity;
    int64_t rotary_pairs;   /* rotated pairs per head (cos/sin width); 0: no rotary */
    int64_t rope_positions; /* rows of the cos/sin tables */
    int interleaved;
    int64_t window; /* keys a query sees, itself included; <= 0: all before it */
    float scale, softcap;
    const float *qkv; /* [batch, seq, (heads + 2 kv_heads) dim] */
    const int32_t *seqlens_k; /* [batch]: positions after this step - 1 */
    const float *cos, *sin;
    const float *sinks; /* [heads] or NULL: a logit per query head added to each softmax's denominator (gpt-oss) */
    uint16_t *key, *value; /* [batch, kv_heads, capacity, dim], the new positions written here */
    float *out;            /* [batch, seq, heads dim] */
    float *q_rotated;      /* scratch [batch, seq, heads, dim] */
    const kv_attention_kernels *kernels;
} kv_attention_job;

/* Checks positions and writes the new keys (rotated) and values into the cache, the rotated
 * queries into q_rotated. Returns NULL or a one-line message (static storage). */
const char *kv_attention_prepare(kv_attention_job *job);

/* Attention of query (b, i) for the heads of KV head kvh, task = (b * kv_heads + kvh) * seq + i.
 * Tasks are independent: any split over threads gives the same bits. Returns -1 when out of memory. */
int kv_attention_task(const kv_attention_job *job, int64_t task);

float kv_half_to_float(uint16_t h);
uint16_t kv_float_to_half(float f);

#endif
