/* ONNX Runtime custom-op library: domain `edgepipe.gguf`, ops `GgufMatMul`, `GgufGather`, `GgufMoEMatMul` (a
 * mixture of experts' projection, rows grouped by expert) and `KvAttention` (attention over an fp16 KV cache, below).
 *
 *   GgufMatMul: y[..., N] = x[..., K] (fp32) . W^T, with W the GGUF tensor's raw blocks, uint8
 *   [N, K / block x block_bytes], attribute `qtype` = the GGML type id.
 *   GgufGather: y[..., K] = rows `ids[...]` (int64) of a table of raw blocks, dequantized exactly
 *   (an embedding kept at the file's size).
 *
 * Each row of x is quantized per block to 8 bits (per 256 with 16-value sums for the k-quants, per
 * 32 with the block sum otherwise), then every output is integer block dot products scaled in
 * fp32. Output rows are split over ONNX Runtime's intra-op thread pool; within a task each weight
 * row meets the activation rows a tile of GGUF_TILE_ROWS at a time (a row's result does not depend
 * on the tile: batch-invariant bit for bit). The ISA is picked at
 * kernel creation: the best the CPU supports, or EDGEPIPE_GGUF_ISA (portable|avx2|avx512vnni|avx512vnni+amx
 * on x86-64, portable|neon|neon_dotprod on ARM64). avx512vnni+amx is avx512vnni with Q4_K products of
 * GGUF_AMX_MIN_ROWS rows or more on AMX tiles (gguf_amx.c), the same bits; it is the best ISA where
 * cpuid reports AMX-TILE and AMX-INT8, XCR0 enables tile state and Linux grants it to the process.
 * On avx512vnni and up, Q4_K products of GGUF_WIDE_MIN_ROWS rows or more that AMX does not take run
 * with the lanes over weight rows (gguf_vnni_wide.c), the same bits again: `product_path` decides. */
#define _GNU_SOURCE /* mremap's MREMAP_FIXED */
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "gguf_kernels.h"
#include "kv_attention.h"
#include "ort_abi.h"

#if defined(__x86_64__) || defined(__i386__)
#include <cpuid.h>
#define EDGEPIPE_X86 1
#endif
#ifdef __linux__
#include <sys/mman.h>
#endif
#if defined(__aarch64__) && defined(__linux__)
#include <sys/auxv.h>
#ifndef HWCAP_ASIMDDP
#define HWCAP_ASIMDDP (1 << 20)
#endif
#endif

#define ORT_API_VERSION_USED 20 /* ONNX Runtime 1.20+: every slot in ort_abi.h exists there */

enum { ISA_PORTABLE = 0, ISA_AVX2 = 1, ISA_AVX512VNNI = 2, ISA_NEON = 3, ISA_NEON_DOTPROD = 4, ISA_AVX512VNNI_AMX = 5, ISA_COUNT = 6 };
static const char *const ISA_NAMES[] = {"portable", "avx2", "avx512vnni", "neon", "neon_dotprod", "avx512vnni+amx"};

/* Fewest activation rows a Q4_K product takes to AMX (below: the AVX tiles; a partial group of 16
 * rows is padded with zero rows). */
#define GGUF_AMX_MIN_ROWS 16

/* Fewest activation rows a Q4_K product takes to the wide VNNI kernel: its weight unpacking pays
 * for itself from about 8 rows (Intel Xeon, 1 thread: 1.0x the AVX tile at 8, 1.3x at 12, 1.9x at 512). */
#define GGUF_WIDE_MIN_ROWS 12

/* ---- ISA detection ---- */

#ifdef EDGEPIPE_X86
static unsigned long long read_xcr0(void) {
    unsigned int eax, edx;
    __asm__ volatile("xgetbv" : "=a"(eax), "=d"(edx) : "c"(0));
    return ((unsigned long long)edx << 32) | eax;
}
#endif

static int detect_isa(void) {
    int best = ISA_PORTABLE;
#ifdef EDGEPIPE_X86
    unsigned int a, b, c, d;
    if (!__get_cpuid(1, &a, &b, &c, &d)) return best;
    int fma = (c >> 12) & 1, osxsave = (c >> 27) & 1, f16c = (c >> 29) & 1;
    if (!osxsave) return best;
    unsigned long long xcr0 = read_xcr0();
    if (!__get_cpuid_count(7, 0, &a, &b, &c, &d)) return best;
    int avx2 = (b >> 5) & 1;
    int avx512f = (b >> 16) & 1, avx512bw = (b >> 30) & 1, avx512vl = (b >> 31) & 1, vnni = (c >> 11) & 1;
#ifdef EDGEPIPE_HAVE_AVX2
    if (avx2 && fma && f16c && (xcr0 & 0x6) == 0x6) best = ISA_AVX2;
#endif
#ifdef EDGEPIPE_HAVE_AVX512VNNI
    if (best == ISA_AVX2 && avx512f && avx512bw && avx512vl && vnni && (xcr0 & 0xE6) == 0xE6) best = ISA_AVX512VNNI;
#endif
#ifdef EDGEPIPE_HAVE_AMX
    /* leaf 7 EDX bit 24 AMX-TILE, bit 25 AMX-INT8; XCR0 bits 17-18 tile config and data; then Linux's grant */
    int amx_tile = (d >> 24) & 1, amx_int8 = (d >> 25) & 1;
    if (best == ISA_AVX512VNNI && amx_tile && amx_int8 && (xcr0 & 0x60000) == 0x60000 && gguf_amx_request()) best = ISA_AVX512VNNI_AMX;
#endif
    (void)avx512f; (void)avx512bw; (void)avx512vl; (void)vnni; (void)avx2; (void)fma; (void)f16c; (void)xcr0;
#endif
#ifdef EDGEPIPE_HAVE_NEON
    best = ISA_NEON; /* Advanced SIMD is part of every ARMv8-A CPU */
#endif
#if defined(EDGEPIPE_HAVE_NEON_DOTPROD) && defined(__linux__)
    if (getauxval(AT_HWCAP) & HWCAP_ASIMDDP) best = ISA_NEON_DOTPROD;
#endif
    return best;
}

/* The best ISA here, detected once (the AMX grant is a system call). */
static int best_isa(void) {
    static volatile int cached = -1;
    if (cached < 0) cached = detect_isa(); /* a race only repeats the same detection */
    return cached;
}

/* Whether `isa` runs here: the ISAs of one architecture form a ladder up to the best one. */
static int isa_available(int isa) {
    int best = best_isa();
    if (isa == ISA_PORTABLE || isa == best) return 1;
    if (best == ISA_AVX512VNNI_AMX) return isa == ISA_AVX2 || isa == ISA_AVX512VNNI;
    if (best == ISA_AVX512VNNI) return isa == ISA_AVX2;
    if (best == ISA_NEON_DOTPROD) return isa == ISA_NEON;
    return 0;
}

/* The ISA to use: EDGEPIPE_GGUF_ISA if set (must be supported here), else the best. -1 on error. */
static int chosen_isa(char *error, size_t error_size) {
    int best = best_isa();
    const char *wanted = getenv("EDGEPIPE_GGUF_ISA");
    if (wanted == NULL || wanted[0] == '\0') return best;
    for (int isa = 0; isa < ISA_COUNT; isa++) {
        if (strcmp(wanted, ISA_NAMES[isa]) == 0) {
            if (isa_available(isa)) return isa;
            snprintf(error, error_size, "EDGEPIPE_GGUF_ISA=%s: this CPU or build supports up to %s", wanted,
                     ISA_NAMES[best]);
            return -1;
        }
    }
    snprintf(error, error_size, "EDGEPIPE_GGUF_ISA=%s: not one of portable, avx2, avx512vnni, avx512vnni+amx, neon, neon_dotprod", wanted);
    return -1;
}

static void fill_table(int isa, gguf_kernel_table *table) {
    switch (isa) {
#ifdef EDGEPIPE_HAVE_AVX512VNNI
    case ISA_AVX512VNNI_AMX: /* the AVX-512 kernels; the AMX products are the driver's (matmul_plan.amx) */
    case ISA_AVX512VNNI: gguf_table_avx512vnni(table); return;
#endif
#ifdef EDGEPIPE_HAVE_AVX2
    case ISA_AVX2: gguf_table_avx2(table); return;
#endif
#ifdef EDGEPIPE_HAVE_NEON
    case ISA_NEON: gguf_table_neon(table); return;
#endif
#ifdef EDGEPIPE_HAVE_NEON_DOTPROD
    case ISA_NEON_DOTPROD: gguf_table_neon_dotprod(table); return;
#endif
    default: gguf_table_portable(table); return;
    }
}

/* ---- the product itself, shared by the ORT kernel and the direct entry point ---- */

typedef struct {
    gguf_rows_dot rows;
    const gguf_type_info *type;
    int qtype;
    int amx;  /* Q4_K products of GGUF_AMX_MIN_ROWS rows or more may go to gguf_amx_q4_k */
    int wide; /* Q4_K products of GGUF_WIDE_MIN_ROWS rows or more may go to gguf_vnni_q4_k */
} matmul_plan;

/* How a product of m activation rows runs: the AVX (or portable, NEON) tiles of GGUF_TILE_ROWS rows
 * against each weight row, AMX tiles, or the wide VNNI kernel. Every path gives the same bits. */
typedef enum { PATH_TILES = 0, PATH_AMX = 1, PATH_WIDE = 2 } product_path_kind;
static const char *const PATH_NAMES[] = {"tiles", "amx", "wide"};

static product_path_kind product_path(const matmul_plan *plan, int64_t m) {
#ifdef EDGEPIPE_HAVE_AMX
    if (plan->amx && m >= GGUF_AMX_MIN_ROWS) return PATH_AMX;
#endif
#ifdef EDGEPIPE_HAVE_AVX512VNNI
    if (plan->wide && m >= GGUF_WIDE_MIN_ROWS) return PATH_WIDE;
#endif
    return PATH_TILES;
}

typedef struct {
    const matmul_plan *plan;
    const float *x;
    const uint8_t *w;
    int64_t m, k, n, nblocks, row_bytes;
    void *xq;
    size_t xq_row_bytes;
    act_tile_scales32 *scales; /* 32-block types: nblocks per tile of rows, lanes past the last row 0 */
    float *y;
    int64_t rows_per_task;
    product_path_kind path;
    void *amx_acts; /* the quantized rows as AMX tiles (gguf_amx_pack_acts) when this product runs on AMX */
} matmul_job;

/* Room for m quantized rows (and their tile scales); 0 or -1 when out of memory. */
static int alloc_activations(matmul_job *job, int64_t m) {
    size_t bytes = job->xq_row_bytes * (size_t)(m > 0 ? m : 1);
    job->xq = aligned_alloc(64, (bytes + 63) / 64 * 64); /* 64-byte blocks of 256 values start on cache lines */
    job->scales = NULL;
    if (job->plan->type->activation_values == 32) {
        size_t tiles = (size_t)((m + GGUF_TILE_ROWS - 1) / GGUF_TILE_ROWS);
        job->scales = calloc(tiles > 0 ? tiles * (size_t)job->nblocks : 1, sizeof(act_tile_scales32));
    }
    return job->xq == NULL || (job->plan->type->activation_values == 32 && job->scales == NULL) ? -1 : 0;
}

static void free_activations(matmul_job *job) {
    free(job->xq);
    free(job->scales);
    free(job->amx_acts);
}

/* Sets the job's path (product_path) and what it needs: tasks of whole groups of 16 weight rows for
 * AMX and the wide kernel, room for the AMX tiles. 0 when the activations are to be packed as AMX
 * tiles, else -1 (an out-of-memory for them leaves the AVX tiles: the same bits). */
static int choose_path(matmul_job *job) {
    job->amx_acts = NULL;
    job->path = product_path(job->plan, job->m);
    if (job->path == PATH_TILES) return -1;
    job->rows_per_task = job->rows_per_task < 64 ? 64 : (job->rows_per_task + 15) / 16 * 16;
#ifdef EDGEPIPE_HAVE_AMX
    if (job->path == PATH_AMX) {
        size_t bytes = gguf_amx_acts_bytes(job->m, job->nblocks);
        job->amx_acts = aligned_alloc(64, (bytes + 63) / 64 * 64);
        if (job->amx_acts != NULL) return 0;
        job->path = PATH_TILES;
    }
#endif
    return -1;
}

static void amx_pack_task(void *data, size_t index) {
#ifdef EDGEPIPE_HAVE_AMX
    const matmul_job *job = data;
    gguf_amx_pack_acts(job->xq, job->xq_row_bytes, job->m, job->nblocks, (int64_t)index, job->amx_acts);
#else
    (void)data, (void)index;
#endif
}

static void quantize_rows(const matmul_job *job, int64_t m0, int64_t m1) {
    for (int64_t m = m0; m < m1; m++) {
        void *row = (char *)job->xq + m * job->xq_row_bytes;
        if (job->plan->type->activation_values == 256) {
            gguf_quantize_row256(job->x + m * job->k, row, job->k);
        } else {
            gguf_quantize_row32(job->x + m * job->k, row, job->k);
            const act_block32 *blocks = row;
            act_tile_scales32 *tile = job->scales + (m / GGUF_TILE_ROWS) * job->nblocks;
            for (int64_t b = 0; b < job->nblocks; b++) {
                tile[b].d[m % GGUF_TILE_ROWS] = blocks[b].d;
                tile[b].ds[m % GGUF_TILE_ROWS] = blocks[b].ds;
            }
        }
    }
}

static void quantize_task(void *data, size_t index) {
    const matmul_job *job = data;
    quantize_rows(job, (int64_t)index, (int64_t)index + 1);
}

/* Outputs n0..n1 of every row, a tile of GGUF_TILE_ROWS activation rows at a time against each
 * weight row of the range: the kernels unpack a weight block once per tile, the tile's activations
 * stay in the nearest cache while the range's weight rows pass (from L2 after the first tile), and
 * a row's result does not depend on its tile. */
static void product_rows(const matmul_job *job, int64_t n0, int64_t n1) {
    gguf_rows_dot rows_dot = job->plan->rows;
    const int64_t whole = (n1 - n0) / 16 * 16; /* AMX and the wide kernel take whole groups of 16 weight rows; */
    int done = -1;                              /* any rest (and an out-of-memory) goes to the tiles below */
#ifdef EDGEPIPE_HAVE_AMX
    if (job->path == PATH_AMX && whole > 0)
        done = gguf_amx_q4_k(job->nblocks, job->w + n0 * job->row_bytes, whole, job->row_bytes, job->amx_acts, job->m,
                             job->y + n0, (size_t)job->n);
#endif
#ifdef EDGEPIPE_HAVE_AVX512VNNI
    if (job->path == PATH_WIDE && whole > 0)
        done = gguf_vnni_q4_k(job->nblocks, job->w + n0 * job->row_bytes, whole, job->row_bytes, job->xq, job->xq_row_bytes,
                              job->m, job->y + n0, (size_t)job->n);
#endif
    if (done == 0) n0 += whole;
    if (n0 >= n1) return;
    for (int64_t m = 0; m < job->m; m += GGUF_TILE_ROWS) {
        int rows = job->m - m < GGUF_TILE_ROWS ? (int)(job->m - m) : GGUF_TILE_ROWS;
        const char *xq = (const char *)job->xq + m * job->xq_row_bytes;
        const act_tile_scales32 *scales = job->scales ? job->scales + (m / GGUF_TILE_ROWS) * job->nblocks : NULL;
        rows_dot(job->nblocks, job->w + n0 * job->row_bytes, n1 - n0, job->row_bytes, xq, job->xq_row_bytes, scales, rows,
                 job->y + m * job->n + n0, (size_t)job->n);
    }
}

static void product_task(void *data, size_t index) {
    const matmul_job *job = data;
    int64_t n0 = (int64_t)index * job->rows_per_task;
    int64_t n1 = n0 + job->rows_per_task < job->n ? n0 + job->rows_per_task : job->n;
    product_rows(job, n0, n1);
}

/* Checks the shapes and prepares the job; returns 0 or writes a one-line error. */
static int prepare_job(matmul_job *job, const matmul_plan *plan, int64_t k, int64_t n, int64_t row_bytes,
                       char *error, size_t error_size) {
    const gguf_type_info *type = plan->type;
    if (k <= 0 || k % type->block_values != 0) {
        snprintf(error, error_size, "GgufMatMul: K=%lld is not a positive multiple of type %d's %d-value blocks",
                 (long long)k, plan->qtype, type->block_values);
        return -1;
    }
    int64_t nblocks = k / type->block_values;
    if (row_bytes != nblocks * type->block_bytes) {
        snprintf(error, error_size,
                 "GgufMatMul: weight rows have %lld bytes, type %d with K=%lld needs %lld (%lld blocks of %d)",
                 (long long)row_bytes, plan->qtype, (long long)k, (long long)(nblocks * type->block_bytes),
                 (long long)nblocks, type->block_bytes);
        return -1;
    }
    job->plan = plan;
    job->k = k;
    job->n = n;
    job->nblocks = nblocks;
    job->row_bytes = row_bytes;
    job->xq_row_bytes = (size_t)nblocks * (type->activation_values == 256 ? sizeof(act_block256) : sizeof(act_block32));
    /* ~4 tasks per thread on a large pool, at least 4 rows each */
    int64_t tasks = n / 4 < 64 ? (n / 4 > 0 ? n / 4 : 1) : 64;
    job->rows_per_task = (n + tasks - 1) / tasks;
    return 0;
}

static int plan_for(matmul_plan *plan, int qtype, int isa, char *error, size_t error_size) {
    plan->type = gguf_type(qtype);
    plan->qtype = qtype;
    if (plan->type == NULL) {
        snprintf(error, error_size,
                 "GgufMatMul: GGML type %d is not supported (" GGUF_TYPES_SUPPORTED ")",
                 qtype);
        return -1;
    }
    gguf_kernel_table table;
    fill_table(isa, &table);
    plan->rows = table.rows[qtype];
    plan->amx = isa == ISA_AVX512VNNI_AMX && qtype == GGUF_Q4_K;
    plan->wide = (isa == ISA_AVX512VNNI || isa == ISA_AVX512VNNI_AMX) && qtype == GGUF_Q4_K;
    return 0;
}

/* ---- direct entry points (ctypes: tests and benchmarks), single-threaded ---- */

__attribute__((visibility("default"))) const char *edgepipe_gguf_isa(void) {
    char error[256];
    int isa = chosen_isa(error, sizeof error);
    return isa < 0 ? "invalid" : ISA_NAMES[isa];
}

__attribute__((visibility("default"))) const char *edgepipe_gguf_best_isa(void) { return ISA_NAMES[best_isa()]; }

/* The path a product of m rows of `qtype` takes on ISA `isa_name` (tiles, amx, wide), or NULL for an
 * unknown ISA or type: tests check a product ran where they meant it to. */
__attribute__((visibility("default"))) const char *edgepipe_gguf_product_path(int qtype, const char *isa_name, int64_t m) {
    char error[256];
    matmul_plan plan;
    for (int i = 0; i < ISA_COUNT; i++) {
        if (strcmp(isa_name, ISA_NAMES[i]) == 0 && isa_available(i) && plan_for(&plan, qtype, i, error, sizeof error) == 0)
            return PATH_NAMES[product_path(&plan, m)];
    }
    return NULL;
}

/* Returns NULL on success, else a message (static storage, not thread-safe: test use only). */
__attribute__((visibility("default"))) const char *edgepipe_gguf_matmul(int qtype, const char *isa_name,
                                                                         const float *x, int64_t m, int64_t k,
                                                                         const uint8_t *w, int64_t n,
                                                                         int64_t row_bytes, float *y) {
    static char error[512];
    int isa = -1;
    for (int i = 0; i < ISA_COUNT; i++) {
        if (strcmp(isa_name, ISA_NAMES[i]) == 0) isa = i;
    }
    if (isa < 0 || !isa_available(isa)) {
        snprintf(error, sizeof error, "ISA %s not available here (best: %s)", isa_name, ISA_NAMES[best_isa()]);
        return error;
    }
    matmul_plan plan;
    matmul_job job = {0};
    if (plan_for(&plan, qtype, isa, error, sizeof error) != 0) return error;
    if (prepare_job(&job, &plan, k, n, row_bytes, error, sizeof error) != 0) return error;
    job.x = x;
    job.w = w;
    job.m = m;
    job.y = y;
    if (alloc_activations(&job, m) != 0) {
        free_activations(&job);
        return "out of memory";
    }
    quantize_rows(&job, 0, m);
    if (choose_path(&job) == 0) {
        for (int64_t g = 0; g < (m + 15) / 16; g++) amx_pack_task(&job, (size_t)g);
    }
    product_rows(&job, 0, n);
    free_activations(&job);
    return NULL;
}

/* ---- ONNX Runtime glue ---- */

typedef struct {
    const OrtApi *api;
    matmul_plan plan;
} gguf_kernel;

static OrtStatus *error_status(const OrtApi *api, int code, const char *message) {
    return ORT_FN(api, CreateStatus)(code, message);
}

#define RETURN_IF_ERROR(expr)                    \
    do {                                         \
        OrtStatus *status_ = (expr);             \
        if (status_ != NULL) return status_;     \
    } while (0)

static OrtStatus *tensor_shape(const OrtApi *api, const OrtValue *value, int64_t *dims, size_t *rank) {
    OrtTensorTypeAndShapeInfo *info = NULL;
    RETURN_IF_ERROR(ORT_FN(api, GetTensorTypeAndShape)(value, &info));
    OrtStatus *status = ORT_FN(api, GetDimensionsCount)(info, rank);
    if (status == NULL && *rank > 8) status = error_status(api, ORT_ERR_INVALID_ARGUMENT, "GgufMatMul: rank above 8");
    if (status == NULL) status = ORT_FN(api, GetDimensions)(info, dims, *rank);
    ORT_FN(api, ReleaseTensorTypeAndShapeInfo)(info);
    return status;
}

static OrtStatus *compute(void *kernel_data, OrtKernelContext *context) {
    const gguf_kernel *kernel = kernel_data;
    const OrtApi *api = kernel->api;
    const OrtValue *x_value = NULL, *w_value = NULL;
    RETURN_IF_ERROR(ORT_FN(api, KernelContext_GetInput)(context, 0, &x_value));
    RETURN_IF_ERROR(ORT_FN(api, KernelContext_GetInput)(context, 1, &w_value));
    int64_t x_dims[8], w_dims[8];
    size_t x_rank = 0, w_rank = 0;
    RETURN_IF_ERROR(tensor_shape(api, x_value, x_dims, &x_rank));
    RETURN_IF_ERROR(tensor_shape(api, w_value, w_dims, &w_rank));
    if (x_rank < 1 || w_rank != 2) {
        return error_status(api, ORT_ERR_INVALID_ARGUMENT, "GgufMatMul: x must be [..., K] and w [N, row_bytes]");
    }
    char error[512];
    matmul_job job = {0};
    if (prepare_job(&job, &kernel->plan, x_dims[x_rank - 1], w_dims[0], w_dims[1], error, sizeof error) != 0) {
        return error_status(api, ORT_ERR_INVALID_ARGUMENT, error);
    }
    int64_t m = 1;
    for (size_t i = 0; i + 1 < x_rank; i++) m *= x_dims[i];
    int64_t y_dims[8];
    memcpy(y_dims, x_dims, sizeof(int64_t) * x_rank);
    y_dims[x_rank - 1] = job.n;
    OrtValue *y_value = NULL;
    RETURN_IF_ERROR(ORT_FN(api, KernelContext_GetOutput)(context, 0, y_dims, x_rank, &y_value));
    void *x_data = NULL, *w_data = NULL, *y_data = NULL;
    RETURN_IF_ERROR(ORT_FN(api, GetTensorMutableData)((OrtValue *)x_value, &x_data));
    RETURN_IF_ERROR(ORT_FN(api, GetTensorMutableData)((OrtValue *)w_value, &w_data));
    RETURN_IF_ERROR(ORT_FN(api, GetTensorMutableData)(y_value, &y_data));
    if (m == 0 || job.n == 0) return NULL;
    job.x = x_data;
    job.w = w_data;
    job.y = y_data;
    job.m = m;
    if (alloc_activations(&job, m) != 0) {
        free_activations(&job);
        return error_status(api, ORT_ERR_FAIL, "GgufMatMul: out of memory for activations");
    }
    OrtStatus *status = NULL;
    if (m >= 4) {
        status = ORT_FN(api, KernelContext_ParallelFor)(context, quantize_task, (size_t)m, 0, &job);
    } else {
        quantize_rows(&job, 0, m);
    }
    if (status == NULL && choose_path(&job) == 0) {
        status = ORT_FN(api, KernelContext_ParallelFor)(context, amx_pack_task, (size_t)((m + 15) / 16), 0, &job);
    }
    if (status == NULL) {
        size_t tasks = (size_t)((job.n + job.rows_per_task - 1) / job.rows_per_task);
        status = ORT_FN(api, KernelContext_ParallelFor)(context, product_task, tasks, 0, &job);
    }
    free_activations(&job);
    return status;
}

/* Moves a constant weight input onto 2 MiB pages (Linux transparent huge pages), best effort. A
 * decode step streams every weight once, and on 4 KiB pages one core's reads stall at each page
 * boundary (the hardware prefetchers stop there, and each page costs a TLB walk): the same Q4_K
 * expert product reads about 1.4x faster from huge pages on one core. ONNX Runtime maps an
 * external initializer's file privately (4 KiB page-cache pages, which cannot be collapsed), or
 * reads it into anonymous memory: either way the 2 MiB-aligned interior of the tensor is copied
 * into fresh huge-page memory that then replaces the old pages at the same addresses (mremap), so
 * every pointer to the tensor stays valid and its bytes are unchanged; the runtime's own unmap or
 * free at the end releases the new pages as it would have the old. Costs one copy of the weights
 * at load (about a second per few GB). EDGEPIPE_GGUF_HUGE_PAGES=0 turns it off (comparisons). */
static void weights_on_huge_pages(const OrtApi *api, const OrtKernelInfo *info, size_t input) {
#ifdef __linux__
    const char *setting = getenv("EDGEPIPE_GGUF_HUGE_PAGES");
    if (setting != NULL && strcmp(setting, "0") == 0) return;
    int is_constant = 0;
    const OrtValue *value = NULL;
    OrtStatus *status = ORT_FN(api, KernelInfoGetConstantInput_tensor)(info, input, &is_constant, &value);
    if (status != NULL) {
        ORT_FN(api, ReleaseStatus)(status);
        return;
    }
    if (!is_constant || value == NULL) return;
    int64_t dims[8];
    size_t rank = 0;
    void *data = NULL;
    if ((status = tensor_shape(api, value, dims, &rank)) == NULL) status = ORT_FN(api, GetTensorMutableData)((OrtValue *)value, &data);
    if (status != NULL) {
        ORT_FN(api, ReleaseStatus)(status);
        return;
    }
    size_t bytes = 1; /* uint8 blocks */
    for (size_t i = 0; i < rank; i++) bytes *= (size_t)dims[i];
    const size_t huge = (size_t)2 << 20;
    uintptr_t start = ((uintptr_t)data + huge - 1) & ~(uintptr_t)(huge - 1), end = ((uintptr_t)data + bytes) & ~(uintptr_t)(huge - 1);
    if (data == NULL || end <= start) return;
    size_t length = end - start;
    char *fresh = mmap(NULL, length + huge, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
    if (fresh == MAP_FAILED) return;
    char *aligned = (char *)(((uintptr_t)fresh + huge - 1) & ~(uintptr_t)(huge - 1));
    if (aligned > fresh) munmap(fresh, (size_t)(aligned - fresh)); /* keep only the aligned span */
    if (aligned + length < fresh + length + huge) munmap(aligned + length, (size_t)(fresh + length + huge - (aligned + length)));
    if (madvise(aligned, length, MADV_HUGEPAGE) != 0) { /* no THP here: leave the weights where they are */
        munmap(aligned, length);
        return;
    }
    memcpy(aligned, (void *)start, length);
    if (mremap(aligned, length, length, MREMAP_MAYMOVE | MREMAP_FIXED, (void *)start) == MAP_FAILED) munmap(aligned, length);
#else
    (void)api, (void)info, (void)input;
#endif
}

static OrtStatus *create_kernel(const OrtCustomOp *op, const OrtApi *api, const OrtKernelInfo *info, void **out) {
    int64_t qtype = -1;
    OrtStatus *status = ORT_FN(api, KernelInfoGetAttribute_int64)(info, "qtype", &qtype);
    if (status != NULL) {
        ORT_FN(api, ReleaseStatus)(status);
        return error_status(api, ORT_ERR_INVALID_ARGUMENT, "GgufMatMul: missing int attribute `qtype`");
    }
    char error[512];
    int isa = chosen_isa(error, sizeof error);
    if (isa < 0) return error_status(api, ORT_ERR_INVALID_ARGUMENT, error);
    gguf_kernel *kernel = calloc(1, sizeof *kernel);
    if (kernel == NULL) return error_status(api, ORT_ERR_FAIL, "GgufMatMul: out of memory");
    kernel->api = api;
    if (plan_for(&kernel->plan, (int)qtype, isa, error, sizeof error) != 0) {
        free(kernel);
        return error_status(api, ORT_ERR_INVALID_ARGUMENT, error);
    }
    const char *name = op->GetName(op); /* the products stream their weights; a gather reads a few rows */
    if (strcmp(name, "GgufMatMul") == 0) weights_on_huge_pages(api, info, 1);
    if (strcmp(name, "GgufMoEMatMul") == 0) weights_on_huge_pages(api, info, 2);
    *out = kernel;
    return NULL;
}

/* The pre-V2 entry points: the runtime uses the V2 ones for version >= 16; these only exist so no
 * slot it might read is NULL. */
static void *create_kernel_v1(const OrtCustomOp *op, const OrtApi *api, const OrtKernelInfo *info) {
    void *kernel = NULL;
    OrtStatus *status = create_kernel(op, api, info, &kernel);
    if (status != NULL) ORT_FN(api, ReleaseStatus)(status);
    return kernel;
}

static void compute_v1(void *kernel, OrtKernelContext *context) {
    OrtStatus *status = compute(kernel, context);
    if (status != NULL) ORT_FN(((gguf_kernel *)kernel)->api, ReleaseStatus)(status);
}

static void destroy_kernel(void *kernel) { free(kernel); }
static const char *op_name(const OrtCustomOp *op) { (void)op; return "GgufMatMul"; }
static const char *op_provider(const OrtCustomOp *op) { (void)op; return "CPUExecutionProvider"; }
static int input_type(const OrtCustomOp *op, size_t i) { (void)op; return i == 0 ? ORT_TENSOR_FLOAT : ORT_TENSOR_UINT8; }
static size_t input_count(const OrtCustomOp *op) { (void)op; return 2; }
static int output_type(const OrtCustomOp *op, size_t i) { (void)op; (void)i; return ORT_TENSOR_FLOAT; }
static size_t output_count(const OrtCustomOp *op) { (void)op; return 1; }
static int required(const OrtCustomOp *op, size_t i) { (void)op; (void)i; return ORT_IO_REQUIRED; }
static int default_memory(const OrtCustomOp *op, size_t i) { (void)op; (void)i; return 0; /* OrtMemTypeDefault */ }
static int one(const OrtCustomOp *op) { (void)op; return 1; }

static const OrtCustomOp GGUF_MATMUL = {
    .version = 16,
    .CreateKernel = create_kernel_v1,
    .GetName = op_name,
    .GetExecutionProviderType = op_provider,
    .GetInputType = input_type,
    .GetInputTypeCount = input_count,
    .GetOutputType = output_type,
    .GetOutputTypeCount = output_count,
    .KernelCompute = compute_v1,
    .KernelDestroy = destroy_kernel,
    .GetInputCharacteristic = required,
    .GetOutputCharacteristic = required,
    .GetInputMemoryType = default_memory,
    .GetVariadicInputMinArity = one, /* not variadic: the runtime may still ask */
    .GetVariadicInputHomogeneity = one,
    .GetVariadicOutputMinArity = one,
    .GetVariadicOutputHomogeneity = one,
    .CreateKernelV2 = create_kernel,
    .KernelComputeV2 = compute,
};


/* ---- GgufGather ---- */

static OrtStatus *compute_gather(void *kernel_data, OrtKernelContext *context) {
    const gguf_kernel *kernel = kernel_data;
    const OrtApi *api = kernel->api;
    const OrtValue *table_value = NULL, *ids_value = NULL;
    RETURN_IF_ERROR(ORT_FN(api, KernelContext_GetInput)(context, 0, &table_value));
    RETURN_IF_ERROR(ORT_FN(api, KernelContext_GetInput)(context, 1, &ids_value));
    int64_t table_dims[8], ids_dims[8];
    size_t table_rank = 0, ids_rank = 0;
    RETURN_IF_ERROR(tensor_shape(api, table_value, table_dims, &table_rank));
    RETURN_IF_ERROR(tensor_shape(api, ids_value, ids_dims, &ids_rank));
    if (table_rank != 2 || ids_rank > 7) {
        return error_status(api, ORT_ERR_INVALID_ARGUMENT, "GgufGather: table must be [rows, row_bytes] and ids of rank <= 7");
    }
    const gguf_type_info *type = kernel->plan.type;
    if (table_dims[1] <= 0 || table_dims[1] % type->block_bytes != 0) {
        char error[256];
        snprintf(error, sizeof error, "GgufGather: table rows of %lld bytes are not whole %d-byte blocks of type %d",
                 (long long)table_dims[1], type->block_bytes, kernel->plan.qtype);
        return error_status(api, ORT_ERR_INVALID_ARGUMENT, error);
    }
    int64_t k = table_dims[1] / type->block_bytes * type->block_values, count = 1;
    int64_t y_dims[8];
    for (size_t i = 0; i < ids_rank; i++) {
        y_dims[i] = ids_dims[i];
        count *= ids_dims[i];
    }
    y_dims[ids_rank] = k;
    OrtValue *y_value = NULL;
    RETURN_IF_ERROR(ORT_FN(api, KernelContext_GetOutput)(context, 0, y_dims, ids_rank + 1, &y_value));
    void *table = NULL, *ids = NULL, *y = NULL;
    RETURN_IF_ERROR(ORT_FN(api, GetTensorMutableData)((OrtValue *)table_value, &table));
    RETURN_IF_ERROR(ORT_FN(api, GetTensorMutableData)((OrtValue *)ids_value, &ids));
    RETURN_IF_ERROR(ORT_FN(api, GetTensorMutableData)(y_value, &y));
    for (int64_t i = 0; i < count; i++) {
        int64_t id = ((const int64_t *)ids)[i];
        if (id < 0 || id >= table_dims[0]) {
            char error[160];
            snprintf(error, sizeof error, "GgufGather: id %lld is outside the table's %lld rows", (long long)id,
                     (long long)table_dims[0]);
            return error_status(api, ORT_ERR_INVALID_ARGUMENT, error);
        }
        gguf_dequantize_row(kernel->plan.qtype, (const uint8_t *)table + id * table_dims[1], (float *)y + i * k, k);
    }
    return NULL;
}

static void compute_gather_v1(void *kernel, OrtKernelContext *context) {
    OrtStatus *status = compute_gather(kernel, context);
    if (status != NULL) ORT_FN(((gguf_kernel *)kernel)->api, ReleaseStatus)(status);
}

static const char *gather_name(const OrtCustomOp *op) { (void)op; return "GgufGather"; }
static int gather_input_type(const OrtCustomOp *op, size_t i) { (void)op; return i == 0 ? ORT_TENSOR_UINT8 : ORT_TENSOR_INT64; }

static const OrtCustomOp GGUF_GATHER = {
    .version = 16,
    .CreateKernel = create_kernel_v1,
    .GetName = gather_name,
    .GetExecutionProviderType = op_provider,
    .GetInputType = gather_input_type,
    .GetInputTypeCount = input_count,
    .GetOutputType = output_type,
    .GetOutputTypeCount = output_count,
    .KernelCompute = compute_gather_v1,
    .KernelDestroy = destroy_kernel,
    .GetInputCharacteristic = required,
    .GetOutputCharacteristic = required,
    .GetInputMemoryType = default_memory,
    .GetVariadicInputMinArity = one,
    .GetVariadicInputHomogeneity = one,
    .GetVariadicOutputMinArity = one,
    .GetVariadicOutputHomogeneity = one,
    .CreateKernelV2 = create_kernel,
    .KernelComputeV2 = compute_gather,
};

/* ---- GgufMoEMatMul: one projection of a mixture of experts, rows grouped by expert ----
 *
 * Inputs: x [R, K] (every routed slot of a row reads the row) or [R, k, K] (one input per slot)
 * float; chosen [R, k] int64 (each row's experts, as TopK gives them); w [E, N, row_bytes] uint8,
 * the GGUF's 3-D expert tensor as stored; attribute `qtype`. Output: y [R, k, N], slot (r, j) =
 * x's row for it times expert chosen[r, j]'s weights. The slots are grouped by expert (stable),
 * and each chosen expert's rows meet its weight rows as GgufMatMul's do (its blocks read once per
 * call, however many rows chose it; an expert no row chose is not read): a slot's result is
 * GgufMatMul's for that row, whatever else is in the batch (batch-invariant bit for bit).
 *
 * A decode step is one row and k experts, so the call is built for it: an input row shared by its
 * k slots is quantized once (its blocks copied to each slot), and every expert's output ranges are
 * tasks of one parallel loop (one wake of the pool per projection, not one per expert). */

typedef struct {
    const uint8_t *w;          /* the expert's [N, row_bytes] blocks */
    int64_t first, count;      /* its slots, [first, first + count) of the grouped order */
    int64_t first_task;        /* its first task of the call's parallel loop */
    int64_t first_tile;        /* its first tile of rows in the call's tile scales */
    act_tile_scales32 *scales; /* 32-block types: its tiles' scales (lanes past its last row 0), else NULL */
} moe_group;

typedef struct {
    matmul_job job; /* xq: every slot's quantized row in grouped order; w, x, y, m unused */
    const moe_group *groups;
    int64_t ngroups;
    float *out; /* [slots, N], grouped order */
} moe_job;

static void moe_product_task(void *data, size_t index) {
    const moe_job *moe = data;
    const matmul_job *job = &moe->job;
    int64_t lo = 0, hi = moe->ngroups - 1; /* the group whose tasks hold `index` */
    while (lo < hi) {
        int64_t mid = (lo + hi + 1) / 2;
        if (moe->groups[mid].first_task <= (int64_t)index) lo = mid;
        else hi = mid - 1;
    }
    const moe_group *group = &moe->groups[lo];
    int64_t n0 = ((int64_t)index - group->first_task) * job->rows_per_task;
    int64_t n1 = n0 + job->rows_per_task < job->n ? n0 + job->rows_per_task : job->n;
    for (int64_t m = 0; m < group->count; m += GGUF_TILE_ROWS) {
        int rows = group->count - m < GGUF_TILE_ROWS ? (int)(group->count - m) : GGUF_TILE_ROWS;
        const char *xq = (const char *)job->xq + (group->first + m) * job->xq_row_bytes;
        const act_tile_scales32 *scales = group->scales ? group->scales + (m / GGUF_TILE_ROWS) * job->nblocks : NULL;
        job->plan->rows(job->nblocks, group->w + n0 * job->row_bytes, n1 - n0, job->row_bytes, xq, job->xq_row_bytes, scales, rows,
                        moe->out + (group->first + m) * job->n + n0, (size_t)job->n);
    }
}

typedef struct {
    const matmul_job *job;
    const float *x;        /* the rows to quantize, K apart */
    const int64_t *source; /* row of x for each destination row */
    void *xq;              /* destination rows, xq_row_bytes apart */
} quantize_gather;

static void quantize_gather_task(void *data, size_t index) {
    const quantize_gather *q = data;
    const float *row = q->x + q->source[index] * q->job->k;
    void *out = (char *)q->xq + index * q->job->xq_row_bytes;
    if (q->job->plan->type->activation_values == 256) gguf_quantize_row256(row, out, q->job->k);
    else gguf_quantize_row32(row, out, q->job->k);
}

/* Quantizes rows source[0..count) of x into consecutive rows of xq, on the pool when there are several. */
static OrtStatus *quantize_gathered(const OrtApi *api, OrtKernelContext *context, const matmul_job *job, const float *x,
                                    const int64_t *source, int64_t count, void *xq) {
    quantize_gather q = {job, x, source, xq};
    if (count >= 4) return ORT_FN(api, KernelContext_ParallelFor)(context, quantize_gather_task, (size_t)count, 0, &q);
    for (int64_t i = 0; i < count; i++) quantize_gather_task(&q, (size_t)i);
    return NULL;
}

static OrtStatus *compute_moe(void *kernel_data, OrtKernelContext *context) {
    const gguf_kernel *kernel = kernel_data;
    const OrtApi *api = kernel->api;
    const OrtValue *x_value = NULL, *chosen_value = NULL, *w_value = NULL;
    RETURN_IF_ERROR(ORT_FN(api, KernelContext_GetInput)(context, 0, &x_value));
    RETURN_IF_ERROR(ORT_FN(api, KernelContext_GetInput)(context, 1, &chosen_value));
    RETURN_IF_ERROR(ORT_FN(api, KernelContext_GetInput)(context, 2, &w_value));
    int64_t x_dims[8], c_dims[8], w_dims[8];
    size_t x_rank = 0, c_rank = 0, w_rank = 0;
    RETURN_IF_ERROR(tensor_shape(api, x_value, x_dims, &x_rank));
    RETURN_IF_ERROR(tensor_shape(api, chosen_value, c_dims, &c_rank));
    RETURN_IF_ERROR(tensor_shape(api, w_value, w_dims, &w_rank));
    if (c_rank != 2 || w_rank != 3 || (x_rank != 2 && x_rank != 3) || x_dims[0] != c_dims[0] ||
        (x_rank == 3 && x_dims[1] != c_dims[1])) {
        return error_status(api, ORT_ERR_INVALID_ARGUMENT,
                            "GgufMoEMatMul: x must be [R, K] or [R, k, K], chosen [R, k] and w [E, N, row_bytes]");
    }
    const int64_t R = c_dims[0], k = c_dims[1], E = w_dims[0], K = x_dims[x_rank - 1];
    char error[512];
    moe_job moe = {0};
    matmul_job *job = &moe.job;
    if (prepare_job(job, &kernel->plan, K, w_dims[1], w_dims[2], error, sizeof error) != 0) {
        return error_status(api, ORT_ERR_INVALID_ARGUMENT, error);
    }
    const int64_t N = job->n;
    int64_t y_dims[3] = {R, k, N};
    OrtValue *y_value = NULL;
    RETURN_IF_ERROR(ORT_FN(api, KernelContext_GetOutput)(context, 0, y_dims, 3, &y_value));
    void *x_data = NULL, *c_data = NULL, *w_data = NULL, *y_data = NULL;
    RETURN_IF_ERROR(ORT_FN(api, GetTensorMutableData)((OrtValue *)x_value, &x_data));
    RETURN_IF_ERROR(ORT_FN(api, GetTensorMutableData)((OrtValue *)chosen_value, &c_data));
    RETURN_IF_ERROR(ORT_FN(api, GetTensorMutableData)((OrtValue *)w_value, &w_data));
    RETURN_IF_ERROR(ORT_FN(api, GetTensorMutableData)(y_value, &y_data));
    const int64_t slots = R * k;
    if (slots == 0 || N == 0) return NULL;
    const int64_t *chosen = c_data;
    for (int64_t i = 0; i < slots; i++) {
        if (chosen[i] < 0 || chosen[i] >= E) {
            snprintf(error, sizeof error, "GgufMoEMatMul: expert %lld is outside the %lld experts", (long long)chosen[i], (long long)E);
            return error_status(api, ORT_ERR_INVALID_ARGUMENT, error);
        }
    }
    /* the slots grouped by expert (a counting sort: stable), and each group's place */
    int64_t *order = malloc(sizeof(int64_t) * (size_t)slots), *source = malloc(sizeof(int64_t) * (size_t)(slots > R ? slots : R));
    int64_t *start = calloc((size_t)E + 1, sizeof(int64_t));
    moe_group *groups = malloc(sizeof(moe_group) * (size_t)(slots < E ? slots : E));
    float *out = malloc(sizeof(float) * (size_t)(slots * N));
    void *rows = NULL; /* [R] quantized input rows when the slots share them */
    OrtStatus *status = NULL;
    if (order == NULL || source == NULL || start == NULL || groups == NULL || out == NULL || alloc_activations(job, slots) != 0) {
        status = error_status(api, ORT_ERR_FAIL, "GgufMoEMatMul: out of memory");
        goto done;
    }
    free(job->scales); /* the groups' tiles are laid out below */
    job->scales = NULL;
    for (int64_t i = 0; i < slots; i++) start[chosen[i] + 1]++;
    for (int64_t e = 0; e < E; e++) start[e + 1] += start[e];
    for (int64_t i = 0; i < slots; i++) order[start[chosen[i]]++] = i; /* start[e] is now group e's end */
    int64_t tasks_per_group = (N + job->rows_per_task - 1) / job->rows_per_task, tiles = 0;
    for (int64_t e = 0, first = 0; e < E; e++) {
        int64_t count = start[e] - first;
        if (count == 0) continue;
        moe_group *group = &groups[moe.ngroups];
        group->w = (const uint8_t *)w_data + e * N * job->row_bytes;
        group->first = first, group->count = count, group->first_task = moe.ngroups * tasks_per_group;
        group->first_tile = tiles, group->scales = NULL;
        tiles += (count + GGUF_TILE_ROWS - 1) / GGUF_TILE_ROWS;
        moe.ngroups++;
        first += count;
    }
    /* the quantized row of every slot, in grouped order: a shared row quantized once */
    if (x_rank == 2) {
        for (int64_t r = 0; r < R; r++) source[r] = r;
        rows = aligned_alloc(64, (job->xq_row_bytes * (size_t)R + 63) / 64 * 64);
        if (rows == NULL) {
            status = error_status(api, ORT_ERR_FAIL, "GgufMoEMatMul: out of memory");
            goto done;
        }
        status = quantize_gathered(api, context, job, x_data, source, R, rows);
        for (int64_t p = 0; p < slots && status == NULL; p++) {
            memcpy((char *)job->xq + p * job->xq_row_bytes, (char *)rows + (order[p] / k) * job->xq_row_bytes, job->xq_row_bytes);
        }
    } else {
        status = quantize_gathered(api, context, job, x_data, order, slots, job->xq);
    }
    if (status != NULL) goto done;
    if (kernel->plan.type->activation_values == 32) { /* each group's tiles repeat its rows' block scales by block */
        job->scales = calloc((size_t)(tiles * job->nblocks), sizeof(act_tile_scales32));
        if (job->scales == NULL) {
            status = error_status(api, ORT_ERR_FAIL, "GgufMoEMatMul: out of memory");
            goto done;
        }
        for (int64_t g = 0; g < moe.ngroups; g++) {
            moe_group *group = &groups[g];
            group->scales = job->scales + group->first_tile * job->nblocks;
            for (int64_t m = 0; m < group->count; m++) {
                const act_block32 *blocks = (const act_block32 *)((const char *)job->xq + (group->first + m) * job->xq_row_bytes);
                act_tile_scales32 *tile = group->scales + (m / GGUF_TILE_ROWS) * job->nblocks;
                for (int64_t b = 0; b < job->nblocks; b++) {
                    tile[b].d[m % GGUF_TILE_ROWS] = blocks[b].d;
                    tile[b].ds[m % GGUF_TILE_ROWS] = blocks[b].ds;
                }
            }
        }
    }
    moe.groups = groups;
    moe.out = out;
    status = ORT_FN(api, KernelContext_ParallelFor)(context, moe_product_task, (size_t)(moe.ngroups * tasks_per_group), 0, &moe);
    for (int64_t p = 0; p < slots && status == NULL; p++) {
        memcpy((float *)y_data + order[p] * N, out + p * N, sizeof(float) * (size_t)N);
    }
done:
    free(order), free(source), free(start), free(groups), free(out), free(rows), free_activations(job);
    return status;
}

static void compute_moe_v1(void *kernel, OrtKernelContext *context) {
    OrtStatus *status = compute_moe(kernel, context);
    if (status != NULL) ORT_FN(((gguf_kernel *)kernel)->api, ReleaseStatus)(status);
}

static const char *moe_name(const OrtCustomOp *op) { (void)op; return "GgufMoEMatMul"; }
static int moe_input_type(const OrtCustomOp *op, size_t i) {
    (void)op;
    return i == 0 ? ORT_TENSOR_FLOAT : i == 1 ? ORT_TENSOR_INT64 : ORT_TENSOR_UINT8;
}
static size_t moe_input_count(const OrtCustomOp *op) { (void)op; return 3; }

static const OrtCustomOp GGUF_MOE = {
    .version = 16,
    .CreateKernel = create_kernel_v1,
    .GetName = moe_name,
    .GetExecutionProviderType = op_provider,
    .GetInputType = moe_input_type,
    .GetInputTypeCount = moe_input_count,
    .GetOutputType = output_type,
    .GetOutputTypeCount = output_count,
    .KernelCompute = compute_moe_v1,
    .KernelDestroy = destroy_kernel,
    .GetInputCharacteristic = required,
    .GetOutputCharacteristic = required,
    .GetInputMemoryType = default_memory,
    .GetVariadicInputMinArity = one,
    .GetVariadicInputHomogeneity = one,
    .GetVariadicOutputMinArity = one,
    .GetVariadicOutputHomogeneity = one,
    .CreateKernelV2 = create_kernel,
    .KernelComputeV2 = compute_moe,
};

/* ---- KvAttention: attention over an fp16 KV cache (kv_attention.h) ----
 *
 * Inputs: qkv [B, S, (heads + 2 kv_heads) D] float (queries, keys, values packed), past_key and
 * past_value [B, kv_heads, C, D] float16, seqlens_k [B] int32 (each row's positions after this step,
 * minus one), total_sequence_length [] int32, cos_cache / sin_cache [P, R / 2] float. Outputs:
 * [B, S, heads D] float, present_key / present_value (past's shape; bound to past's memory they are
 * written in place: only the new positions). Attributes as GroupQueryAttention's: num_heads,
 * kv_num_heads, do_rotary, rotary_interleaved, local_window_size, scale, softcap. An optional eighth input
 * head_sink [heads] float (gpt-oss's attention sinks, GroupQueryAttention's head_sink): a logit per
 * query head that joins each softmax's denominator with a zero value row. */

typedef struct {
    const OrtApi *api;
    int64_t heads, kv_heads, do_rotary, interleaved, window;
    float scale, softcap;
    int isa;
} attention_kernel;

static int64_t int_attribute(const OrtApi *api, const OrtKernelInfo *info, const char *name, int64_t fallback) {
    int64_t value = fallback;
    OrtStatus *status = ORT_FN(api, KernelInfoGetAttribute_int64)(info, name, &value);
    if (status != NULL) {
        ORT_FN(api, ReleaseStatus)(status);
        return fallback;
    }
    return value;
}

static float float_attribute(const OrtApi *api, const OrtKernelInfo *info, const char *name, float fallback) {
    float value = fallback;
    OrtStatus *status = ORT_FN(api, KernelInfoGetAttribute_float)(info, name, &value);
    if (status != NULL) {
        ORT_FN(api, ReleaseStatus)(status);
        return fallback;
    }
    return value;
}

static OrtStatus *create_attention(const OrtCustomOp *op, const OrtApi *api, const OrtKernelInfo *info, void **out) {
    (void)op;
    char error[512];
    int isa = chosen_isa(error, sizeof error);
    if (isa < 0) return error_status(api, ORT_ERR_INVALID_ARGUMENT, error);
    attention_kernel *kernel = calloc(1, sizeof *kernel);
    if (kernel == NULL) return error_status(api, ORT_ERR_FAIL, "KvAttention: out of memory");
    kernel->api = api;
    kernel->isa = isa;
    kernel->heads = int_attribute(api, info, "num_heads", 0);
    kernel->kv_heads = int_attribute(api, info, "kv_num_heads", 0);
    kernel->do_rotary = int_attribute(api, info, "do_rotary", 0);
    kernel->interleaved = int_attribute(api, info, "rotary_interleaved", 0);
    kernel->window = int_attribute(api, info, "local_window_size", -1);
    kernel->scale = float_attribute(api, info, "scale", 0.0f);
    kernel->softcap = float_attribute(api, info, "softcap", 0.0f);
    if (kernel->heads <= 0 || kernel->kv_heads <= 0 || kernel->heads % kernel->kv_heads != 0 ||
        kernel->heads / kernel->kv_heads > 256) {
        free(kernel);
        return error_status(api, ORT_ERR_INVALID_ARGUMENT,
                            "KvAttention: num_heads must be a multiple of kv_num_heads (at most 256 per KV head)");
    }
    *out = kernel;
    return NULL;
}

typedef struct {
    const kv_attention_job *job;
    volatile int failed;
} attention_run;

static void attention_task(void *data, size_t index) {
    attention_run *run = data;
    if (kv_attention_task(run->job, (int64_t)index) != 0) run->failed = 1;
}

static OrtStatus *compute_attention(void *kernel_data, OrtKernelContext *context) {
    const attention_kernel *kernel = kernel_data;
    const OrtApi *api = kernel->api;
    const OrtValue *in[8] = {NULL};
    int64_t dims[8][8];
    size_t rank[8], count = 0;
    RETURN_IF_ERROR(ORT_FN(api, KernelContext_GetInputCount)(context, &count));
    for (size_t i = 0; i < 8 && i < count; i++) {
        RETURN_IF_ERROR(ORT_FN(api, KernelContext_GetInput)(context, i, &in[i]));
        if (in[i] == NULL && i < 7) return error_status(api, ORT_ERR_INVALID_ARGUMENT, "KvAttention: every input but head_sink is required");
        if (in[i] != NULL) RETURN_IF_ERROR(tensor_shape(api, in[i], dims[i], &rank[i]));
    }
    if (count < 7) return error_status(api, ORT_ERR_INVALID_ARGUMENT, "KvAttention: every input but head_sink is required");
    if (in[7] != NULL && (rank[7] != 1 || dims[7][0] != kernel->heads)) {
        return error_status(api, ORT_ERR_INVALID_ARGUMENT, "KvAttention: head_sink must be [num_heads]");
    }
    const int64_t B = dims[0][0], S = dims[0][1], D = dims[1][3], C = dims[1][2];
    if (rank[0] != 3 || rank[1] != 4 || rank[2] != 4 || memcmp(dims[1], dims[2], sizeof(int64_t) * 4) != 0 ||
        dims[1][0] != B || dims[1][1] != kernel->kv_heads || dims[0][2] != (kernel->heads + 2 * kernel->kv_heads) * D ||
        rank[3] != 1 || dims[3][0] != B || rank[5] != 2 || rank[6] != 2 || dims[5][1] != dims[6][1] ||
        dims[5][0] != dims[6][0]) {
        return error_status(api, ORT_ERR_INVALID_ARGUMENT,
                            "KvAttention: shapes must be qkv [B, S, (heads + 2 kv_heads) D], past [B, kv_heads, C, D] twice, "
                            "seqlens_k [B], cos/sin [P, R/2]");
    }
    int64_t out_dims[3] = {B, S, kernel->heads * D};
    OrtValue *out_value = NULL, *present[2] = {NULL, NULL};
    RETURN_IF_ERROR(ORT_FN(api, KernelContext_GetOutput)(context, 0, out_dims, 3, &out_value));
    RETURN_IF_ERROR(ORT_FN(api, KernelContext_GetOutput)(context, 1, dims[1], 4, &present[0]));
    RETURN_IF_ERROR(ORT_FN(api, KernelContext_GetOutput)(context, 2, dims[2], 4, &present[1]));
    void *data[8] = {NULL}, *out = NULL, *present_data[2];
    for (size_t i = 0; i < 8; i++) {
        if (in[i] != NULL) RETURN_IF_ERROR(ORT_FN(api, GetTensorMutableData)((OrtValue *)in[i], &data[i]));
    }
    RETURN_IF_ERROR(ORT_FN(api, GetTensorMutableData)(out_value, &out));
    for (int i = 0; i < 2; i++) {
        RETURN_IF_ERROR(ORT_FN(api, GetTensorMutableData)(present[i], &present_data[i]));
        if (present_data[i] != data[1 + i]) { /* not bound in place: present starts as a copy of past */
            memcpy(present_data[i], data[1 + i], sizeof(uint16_t) * (size_t)(B * kernel->kv_heads * C * D));
        }
    }
    if (B == 0 || S == 0) return NULL;
    kv_attention_kernels kernels;
    kv_attention_portable(&kernels);
#ifdef EDGEPIPE_HAVE_AVX2
    if ((kernel->isa == ISA_AVX2 || kernel->isa == ISA_AVX512VNNI || kernel->isa == ISA_AVX512VNNI_AMX) && D % 16 == 0) kv_attention_avx2(&kernels);
#endif
#ifdef EDGEPIPE_HAVE_NEON
    if ((kernel->isa == ISA_NEON || kernel->isa == ISA_NEON_DOTPROD) && D % 16 == 0) kv_attention_neon(&kernels);
#endif
    kv_attention_job job = {
        .batch = B, .seq = S, .heads = kernel->heads, .kv_heads = kernel->kv_heads, .dim = D, .capacity = C,
        .rotary_pairs = kernel->do_rotary ? dims[5][1] : 0, .rope_positions = dims[5][0],
        .interleaved = (int)kernel->interleaved, .window = kernel->window,
        .scale = kernel->scale != 0.0f ? kernel->scale : 1.0f / sqrtf((float)D), .softcap = kernel->softcap,
        .qkv = data[0], .seqlens_k = data[3], .cos = data[5], .sin = data[6], .sinks = data[7],
        .key = present_data[0], .value = present_data[1], .out = out, .kernels = &kernels,
    };
    job.q_rotated = malloc(sizeof(float) * (size_t)(B * S * kernel->heads * D));
    if (job.q_rotated == NULL) return error_status(api, ORT_ERR_FAIL, "KvAttention: out of memory");
    const char *problem = kv_attention_prepare(&job);
    OrtStatus *status = NULL;
    if (problem != NULL) {
        status = error_status(api, ORT_ERR_INVALID_ARGUMENT, problem);
    } else {
        attention_run run = {&job, 0};
        status = ORT_FN(api, KernelContext_ParallelFor)(context, attention_task, (size_t)(B * kernel->kv_heads * S), 0, &run);
        if (status == NULL && run.failed) status = error_status(api, ORT_ERR_FAIL, "KvAttention: out of memory");
    }
    free(job.q_rotated);
    return status;
}

static void *create_attention_v1(const OrtCustomOp *op, const OrtApi *api, const OrtKernelInfo *info) {
    void *kernel = NULL;
    OrtStatus *status = create_attention(op, api, info, &kernel);
    if (status != NULL) ORT_FN(api, ReleaseStatus)(status);
    return kernel;
}

static void compute_attention_v1(void *kernel, OrtKernelContext *context) {
    OrtStatus *status = compute_attention(kernel, context);
    if (status != NULL) ORT_FN(((attention_kernel *)kernel)->api, ReleaseStatus)(status);
}

static const char *attention_name(const OrtCustomOp *op) { (void)op; return "KvAttention"; }
static int attention_input_type(const OrtCustomOp *op, size_t i) {
    (void)op;
    return i == 1 || i == 2 ? ORT_TENSOR_FLOAT16 : i == 3 || i == 4 ? ORT_TENSOR_INT32 : ORT_TENSOR_FLOAT;
}
static size_t attention_input_count(const OrtCustomOp *op) { (void)op; return 8; }
static int attention_input_characteristic(const OrtCustomOp *op, size_t i) { (void)op; return i == 7 ? ORT_IO_OPTIONAL : ORT_IO_REQUIRED; }
static int attention_output_type(const OrtCustomOp *op, size_t i) { (void)op; return i == 0 ? ORT_TENSOR_FLOAT : ORT_TENSOR_FLOAT16; }
static size_t attention_output_count(const OrtCustomOp *op) { (void)op; return 3; }

static const OrtCustomOp KV_ATTENTION = {
    .version = 16,
    .CreateKernel = create_attention_v1,
    .GetName = attention_name,
    .GetExecutionProviderType = op_provider,
    .GetInputType = attention_input_type,
    .GetInputTypeCount = attention_input_count,
    .GetOutputType = attention_output_type,
    .GetOutputTypeCount = attention_output_count,
    .KernelCompute = compute_attention_v1,
    .KernelDestroy = destroy_kernel,
    .GetInputCharacteristic = attention_input_characteristic,
    .GetOutputCharacteristic = required,
    .GetInputMemoryType = default_memory,
    .GetVariadicInputMinArity = one,
    .GetVariadicInputHomogeneity = one,
    .GetVariadicOutputMinArity = one,
    .GetVariadicOutputHomogeneity = one,
    .CreateKernelV2 = create_attention,
    .KernelComputeV2 = compute_attention,
};

__attribute__((visibility("default"))) OrtStatus *RegisterCustomOps(OrtSessionOptions *options,
                                                                      const OrtApiBase *api_base) {
    const OrtApi *api = api_base->GetApi(ORT_API_VERSION_USED);
    if (api == NULL) {
        const OrtApi *oldest = api_base->GetApi(1);
        return oldest ? error_status(oldest, ORT_ERR_FAIL, "edgepipe.gguf needs ONNX Runtime 1.20 or newer") : NULL;
    }
    const char *build_info = ORT_FN(api, GetBuildInfoString)();
    if (build_info == NULL || strncmp(build_info, "ORT Build Info", 14) != 0) {
        return error_status(api, ORT_ERR_FAIL, "edgepipe.gguf: this ONNX Runtime's C API table is not the expected one");
    }
    OrtCustomOpDomain *domain = NULL; /* kept for the process's life: sessions refer to it */
    RETURN_IF_ERROR(ORT_FN(api, CreateCustomOpDomain)("edgepipe.gguf", &domain));
    RETURN_IF_ERROR(ORT_FN(api, CustomOpDomain_Add)(domain, &GGUF_MATMUL));
    RETURN_IF_ERROR(ORT_FN(api, CustomOpDomain_Add)(domain, &GGUF_GATHER));
    RETURN_IF_ERROR(ORT_FN(api, CustomOpDomain_Add)(domain, &KV_ATTENTION));
    RETURN_IF_ERROR(ORT_FN(api, CustomOpDomain_Add)(domain, &GGUF_MOE));
    return ORT_FN(api, AddCustomOpDomain)(options, domain);
}
