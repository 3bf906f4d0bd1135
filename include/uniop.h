/* uniop C API. Generated from crates/uniop-capi by `cargo run -p uniop-capi --features header --bin uniop-header`; do not edit. */

#ifndef UNIOP_H
#define UNIOP_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

// Bumped when a struct layout or a signature of this header changes incompatibly.
#define UNIOP_ABI_VERSION 1

// A point in a stream's work, for ordering and timing (opaque).
typedef struct uniopEventObj uniopEventObj;

// A planned op call: phase 1's result, launched by phase 2 (opaque).
typedef struct uniopExecutor uniopExecutor;

// An ordered queue of work (opaque).
typedef struct uniopStreamObj uniopStreamObj;

// A strided view of caller-owned memory (opaque).
typedef struct uniopTensor uniopTensor;

// Result of every call: `UNIOP_SUCCESS` or an error code.
typedef int32_t uniopStatus;

typedef uniopStreamObj *uniopStream;

typedef uniopEventObj *uniopEvent;

// `aclrtMalloc`'s policies: huge pages first (falling back to normal pages), huge only, normal only.
typedef int32_t uniopMemMallocPolicy;

// Copy directions (all plain copies on the CPU device; checked for source compatibility).
typedef int32_t uniopMemcpyKind;

// Allocator counters, in bytes and calls.
typedef struct {
  uint64_t allocated;
  uint64_t reserved;
  uint64_t peakAllocated;
  uint64_t allocCount;
  uint64_t freeCount;
  uint64_t liveBuffers;
} uniopMemStats;

// A device kernel for the direct call: runs once per block with its index and the block count.
typedef void (*uniopKernelFn)(uint32_t block_idx, uint32_t block_num, void *args);

// Element types, numbered like `aclDataType`.
typedef int32_t uniopDataType;

// Memory formats, numbered like `aclFormat`; uniop tensors are plain strided (`ND`) arrays.
typedef int32_t uniopFormat;

#define UNIOP_SUCCESS 0

#define UNIOP_ERROR_PARAM_NULLPTR 161001

#define UNIOP_ERROR_PARAM_INVALID 161002

#define UNIOP_ERROR_DTYPE 161003

#define UNIOP_ERROR_SHAPE 161004

#define UNIOP_ERROR_WORKSPACE_TOO_SMALL 161005

#define UNIOP_ERROR_RUNTIME 361001

#define UNIOP_ERROR_INTERNAL 561000

#define UNIOP_MEM_MALLOC_HUGE_FIRST 0

#define UNIOP_MEM_MALLOC_HUGE_ONLY 1

#define UNIOP_MEM_MALLOC_NORMAL_ONLY 2

#define UNIOP_MEMCPY_HOST_TO_HOST 0

#define UNIOP_MEMCPY_HOST_TO_DEVICE 1

#define UNIOP_MEMCPY_DEVICE_TO_HOST 2

#define UNIOP_MEMCPY_DEVICE_TO_DEVICE 3

#define UNIOP_FLOAT 0

#define UNIOP_FLOAT16 1

#define UNIOP_INT8 2

#define UNIOP_INT32 3

#define UNIOP_UINT8 4

#define UNIOP_INT64 9

#define UNIOP_DOUBLE 11

#define UNIOP_BOOL 12

#define UNIOP_BF16 27

#define UNIOP_FORMAT_ND 2

#ifdef __cplusplus
extern "C" {
#endif // __cplusplus

// The message of the calling thread's most recent failed call ("" when none). Valid until the
// thread's next failing call.
const char *uniopGetRecentErrMsg(void);

// `UNIOP_ABI_VERSION` of the loaded library, to compare with the header's.
uint32_t uniopGetAbiVersion(void);

// Registers the built-in ops. Optional (every call initializes on demand); idempotent.
uniopStatus uniopInit(void);

// Drains the default stream, returns cached memory to the OS and prints a report of buffers
// still allocated to stderr (the leak report).
uniopStatus uniopFinalize(void);

// Selects the device; the CPU device is 0 (the only one in this build).
uniopStatus uniopSetDevice(int32_t deviceId);

uniopStatus uniopCreateStream(uniopStream *stream);

// Waits for the stream's work, then destroys it.
uniopStatus uniopDestroyStream(uniopStream stream);

// Blocks until the stream's work is done; reports the first error of its asynchronous work.
uniopStatus uniopSynchronizeStream(uniopStream stream);

// Work enqueued on `stream` later waits for `event`'s latest record.
uniopStatus uniopStreamWaitEvent(uniopStream stream, uniopEvent event);

uniopStatus uniopCreateEvent(uniopEvent *event);

uniopStatus uniopDestroyEvent(uniopEvent event);

uniopStatus uniopRecordEvent(uniopEvent event, uniopStream stream);

// `*done` = 1 when the event's latest record has completed, else 0.
uniopStatus uniopQueryEvent(uniopEvent event, int32_t *done);

uniopStatus uniopSynchronizeEvent(uniopEvent event);

// Milliseconds between two completed records.
uniopStatus uniopEventElapsedTime(float *ms, uniopEvent start, uniopEvent end);

// Device memory from the caching allocator (64-byte aligned), under `policy`.
uniopStatus uniopMalloc(void **devPtr, size_t size, uniopMemMallocPolicy policy);

uniopStatus uniopFree(void *devPtr);

// Host memory (the same allocator on the CPU device), freed with `uniopFreeHost`.
uniopStatus uniopMallocHost(void **hostPtr, size_t size);

uniopStatus uniopFreeHost(void *hostPtr);

// Copies `count` bytes; `kind` is checked but every direction is a host copy on the CPU device.
uniopStatus uniopMemcpy(void *dst,
                        size_t destMax,
                        const void *src,
                        size_t count,
                        uniopMemcpyKind kind);

// Enqueues the copy on `stream`; both buffers must stay valid until it has run.
uniopStatus uniopMemcpyAsync(void *dst,
                             size_t destMax,
                             const void *src,
                             size_t count,
                             uniopMemcpyKind kind,
                             uniopStream stream);

// Free and total physical memory of the device (the machine's RAM for the CPU device).
uniopStatus uniopGetMemInfo(size_t *free, size_t *total);

uniopStatus uniopGetMemStats(uniopMemStats *stats);

// Writes the allocator's summary table, NUL-terminated and truncated to `len` bytes; `*needed`
// (when not NULL) receives the full size including the NUL.
uniopStatus uniopMemorySummary(char *buf, size_t len, size_t *needed);

// Kernel direct call: enqueues `blockDim` instances of `kernel(blockIdx, blockDim, args)` on
// `stream`, spread over the compute pool. `args` must stay valid until the launch has run.
uniopStatus uniopLaunchKernel(uniopKernelFn kernel,
                              uint32_t blockDim,
                              void *args,
                              uniopStream stream);

// Describes `tensorData` as a strided view (`stride` may be NULL for contiguous), `offset`
// elements into a storage of `storageDims`. Returns NULL on bad arguments (see
// `uniopGetRecentErrMsg`).
uniopTensor *uniopCreateTensor(const int64_t *viewDims,
                               uint64_t viewDimsNum,
                               uniopDataType dataType,
                               const int64_t *stride,
                               int64_t offset,
                               uniopFormat format,
                               const int64_t *storageDims,
                               uint64_t storageDimsNum,
                               void *tensorData);

uniopStatus uniopDestroyTensor(const uniopTensor *tensor);

// Phase 1 by op name: binds `inputs` (the tensors the op reads, schema order; NULL for an
// absent optional), `attrs` (`"name=value, ..."`, may be NULL) and `outputs` (tensors the op
// updates in place, then its returns), checks them, plans, and returns the workspace size and a
// single-use executor.
uniopStatus uniopOpGetWorkspaceSize(const char *opName,
                                    const uniopTensor *const *inputs,
                                    uint64_t numInputs,
                                    const char *attrs,
                                    const uniopTensor *const *outputs,
                                    uint64_t numOutputs,
                                    uint64_t *workspaceSize,
                                    uniopExecutor **executor);

// Phase 2: launches the executor on `stream` (NULL: default) with `workspace`. A single-use
// executor is consumed by a successful launch; a repeatable one stays until destroyed.
uniopStatus uniopOpRun(void *workspace,
                       uint64_t workspaceSize,
                       uniopExecutor *executor,
                       uniopStream stream);

// Lets the executor launch any number of times (aclnn's `aclSetAclOpExecutorRepeatable`).
uniopStatus uniopSetExecutorRepeatable(uniopExecutor *executor);

uniopStatus uniopDestroyExecutor(uniopExecutor *executor);

// Points input `index` of a repeatable executor at new memory laid out like the planned one.
uniopStatus uniopSetInputTensorAddr(uniopExecutor *executor, uint64_t index, void *addr);

// Points output `index` (in-place tensors first, then returns) at new memory.
uniopStatus uniopSetOutputTensorAddr(uniopExecutor *executor, uint64_t index, void *addr);

#ifdef __cplusplus
}  // extern "C"
#endif  // __cplusplus

#endif  /* UNIOP_H */
