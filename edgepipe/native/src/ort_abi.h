/* The slice of ONNX Runtime's C ABI that a custom-op library needs, declared here.
 *
 * ONNX Runtime hands a custom-op library an `OrtApiBase*`; `GetApi(version)` returns its function
 * table, a struct of function pointers that only ever grows at the end (that is the runtime's ABI
 * promise), so a slot's index never changes. The indices below were counted from the runtime's
 * public C API header (onnxruntime_c_api.h, API versions 1-30); `gguf_op.c` checks the table at
 * registration by calling GetBuildInfoString (slot 254) before it uses anything else, and the
 * tests run every slot used here. `OrtCustomOp` is likewise the runtime's struct layout,
 * fields in order. Only opaque pointers cross the boundary. */
#ifndef EDGEPIPE_ORT_ABI_H
#define EDGEPIPE_ORT_ABI_H

#include <stddef.h>
#include <stdint.h>

typedef struct OrtStatus OrtStatus;
typedef struct OrtSessionOptions OrtSessionOptions;
typedef struct OrtCustomOpDomain OrtCustomOpDomain;
typedef struct OrtKernelInfo OrtKernelInfo;
typedef struct OrtKernelContext OrtKernelContext;
typedef struct OrtValue OrtValue;
typedef struct OrtTensorTypeAndShapeInfo OrtTensorTypeAndShapeInfo;
typedef struct OrtApi OrtApi; /* opaque: used only as a table of slots */

typedef struct OrtApiBase {
    const OrtApi *(*GetApi)(uint32_t version);
    const char *(*GetVersionString)(void);
} OrtApiBase;

enum { ORT_ERR_FAIL = 1, ORT_ERR_INVALID_ARGUMENT = 2 };
enum { ORT_TENSOR_FLOAT = 1, ORT_TENSOR_UINT8 = 2, ORT_TENSOR_INT32 = 6, ORT_TENSOR_INT64 = 7, ORT_TENSOR_FLOAT16 = 10 };
enum { ORT_IO_REQUIRED = 0, ORT_IO_OPTIONAL = 1 };

/* Slot indices in the OrtApi function table. */
enum ort_slot {
    ORT_SLOT_CreateStatus = 0,
    ORT_SLOT_CreateCustomOpDomain = 26,
    ORT_SLOT_CustomOpDomain_Add = 27,
    ORT_SLOT_AddCustomOpDomain = 28,
    ORT_SLOT_GetTensorMutableData = 51,
    ORT_SLOT_GetDimensionsCount = 61,
    ORT_SLOT_GetDimensions = 62,
    ORT_SLOT_GetTensorTypeAndShape = 65,
    ORT_SLOT_KernelInfoGetAttribute_float = 85,
    ORT_SLOT_KernelInfoGetAttribute_int64 = 86,
    ORT_SLOT_KernelContext_GetInputCount = 88,
    ORT_SLOT_KernelContext_GetInput = 90,
    ORT_SLOT_KernelContext_GetOutput = 91,
    ORT_SLOT_ReleaseStatus = 93,
    ORT_SLOT_ReleaseTensorTypeAndShapeInfo = 99,
    ORT_SLOT_KernelInfoGetConstantInput_tensor = 249, /* ORT 1.15+ */
    ORT_SLOT_GetBuildInfoString = 254,
    ORT_SLOT_KernelContext_ParallelFor = 274,
};

typedef OrtStatus *(*ort_CreateStatus)(int code, const char *msg);
typedef OrtStatus *(*ort_CreateCustomOpDomain)(const char *domain, OrtCustomOpDomain **out);
typedef OrtStatus *(*ort_CustomOpDomain_Add)(OrtCustomOpDomain *domain, const void *op);
typedef OrtStatus *(*ort_AddCustomOpDomain)(OrtSessionOptions *options, OrtCustomOpDomain *domain);
typedef OrtStatus *(*ort_GetTensorMutableData)(OrtValue *value, void **out);
typedef OrtStatus *(*ort_GetDimensionsCount)(const OrtTensorTypeAndShapeInfo *info, size_t *out);
typedef OrtStatus *(*ort_GetDimensions)(const OrtTensorTypeAndShapeInfo *info, int64_t *dims, size_t count);
typedef OrtStatus *(*ort_GetTensorTypeAndShape)(const OrtValue *value, OrtTensorTypeAndShapeInfo **out);
typedef OrtStatus *(*ort_KernelInfoGetAttribute_float)(const OrtKernelInfo *info, const char *name, float *out);
typedef OrtStatus *(*ort_KernelInfoGetAttribute_int64)(const OrtKernelInfo *info, const char *name, int64_t *out);
typedef OrtStatus *(*ort_KernelContext_GetInputCount)(const OrtKernelContext *context, size_t *out);
typedef OrtStatus *(*ort_KernelContext_GetInput)(const OrtKernelContext *context, size_t index, const OrtValue **out);
typedef OrtStatus *(*ort_KernelContext_GetOutput)(OrtKernelContext *context, size_t index, const int64_t *dims,
                                                  size_t dim_count, OrtValue **out);
typedef void (*ort_ReleaseStatus)(OrtStatus *status);
typedef void (*ort_ReleaseTensorTypeAndShapeInfo)(OrtTensorTypeAndShapeInfo *info);
typedef OrtStatus *(*ort_KernelInfoGetConstantInput_tensor)(const OrtKernelInfo *info, size_t index, int *is_constant,
                                                              const OrtValue **out);
typedef const char *(*ort_GetBuildInfoString)(void);
typedef OrtStatus *(*ort_KernelContext_ParallelFor)(const OrtKernelContext *context, void (*fn)(void *, size_t),
                                                    size_t total, size_t num_batch, void *user_data);

#define ORT_FN(api, name) ((ort_##name)(((void *const *)(api))[ORT_SLOT_##name]))

/* OrtCustomOp, fields in the runtime's order. `version` says which trailing fields are read:
 * 16 covers everything through KernelComputeV2. */
typedef struct OrtCustomOp {
    uint32_t version;
    void *(*CreateKernel)(const struct OrtCustomOp *op, const OrtApi *api, const OrtKernelInfo *info);
    const char *(*GetName)(const struct OrtCustomOp *op);
    const char *(*GetExecutionProviderType)(const struct OrtCustomOp *op);
    int (*GetInputType)(const struct OrtCustomOp *op, size_t index);
    size_t (*GetInputTypeCount)(const struct OrtCustomOp *op);
    int (*GetOutputType)(const struct OrtCustomOp *op, size_t index);
    size_t (*GetOutputTypeCount)(const struct OrtCustomOp *op);
    void (*KernelCompute)(void *kernel, OrtKernelContext *context);
    void (*KernelDestroy)(void *kernel);
    int (*GetInputCharacteristic)(const struct OrtCustomOp *op, size_t index);
    int (*GetOutputCharacteristic)(const struct OrtCustomOp *op, size_t index);
    int (*GetInputMemoryType)(const struct OrtCustomOp *op, size_t index);
    int (*GetVariadicInputMinArity)(const struct OrtCustomOp *op);
    int (*GetVariadicInputHomogeneity)(const struct OrtCustomOp *op);
    int (*GetVariadicOutputMinArity)(const struct OrtCustomOp *op);
    int (*GetVariadicOutputHomogeneity)(const struct OrtCustomOp *op);
    OrtStatus *(*CreateKernelV2)(const struct OrtCustomOp *op, const OrtApi *api, const OrtKernelInfo *info,
                                 void **kernel);
    OrtStatus *(*KernelComputeV2)(void *kernel, OrtKernelContext *context);
    void *InferOutputShapeFn;
    void *GetStartVersion;
    void *GetEndVersion;
    void *GetMayInplace;
    void *ReleaseMayInplace;
    void *GetAliasMap;
    void *ReleaseAliasMap;
} OrtCustomOp;

#endif
