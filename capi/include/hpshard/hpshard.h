/*
 * hpshard.h — the stable C API of libhpshard (C99).
 *
 * Conventions (see CONVENTIONS.md in the design notes):
 *  - Every function returns hps_status_t and hands results back through trailing
 *    out-params, except the four infallible queries hps_version_number,
 *    hps_version_string, hps_status_string and hps_last_error_message.
 *  - On failure, hps_last_error_message() tells what and where; it is thread-local.
 *    A failing call changes nothing and leaves its out-params untouched.
 *  - Handles are opaque structs used by pointer. Every create has a destroy;
 *    destroy accepts NULL.
 *  - Thread safety, unless a function says otherwise: one handle is used by one
 *    thread at a time; distinct handles may be used concurrently.
 *  - A handle belongs to the process that made it. In a child made by fork(), every call
 *    given a handle made before the fork returns FAILED_PRECONDITION, and its destroy
 *    returns OK at once having freed nothing (the threads it would wait for, and the locks
 *    they may hold, are the parent's); a DLPack view made before the fork is let go the
 *    same way. The child makes its own handles (store, communicator, engine).
 *
 * ABI-extensible structs (hps_device_properties_t, hps_rendezvous_info_t,
 * hps_checkpoint_info_t and the *_options_t structs) start with `size_t struct_size` and
 * only ever gain fields at their end. The rules, the same for every one:
 *  - Initialise with its _init function, passing sizeof the struct as you compiled it.
 *    Any struct_size at least the struct's size in the release that introduced it (0.1.0,
 *    0.3.0 for the checkpoint structs) up to 64 KiB is accepted, unless it ends strictly
 *    inside a field the library knows (a field added since that release: no header's
 *    sizeof ends there); a size at a field's end or in padding is accepted. A smaller one,
 *    a larger one (no struct grows that large: taken for an uninitialised size) or one
 *    ending inside a field is INVALID_ARGUMENT, from _init and from every function taking
 *    the struct, and nothing is written.
 *  - _init writes the defaults into min(struct_size, the library's sizeof) bytes and
 *    records struct_size; it never writes past struct_size.
 *  - A struct read by the library takes the caller's fields up to struct_size; fields the
 *    caller's (older) header did not have take their defaults.
 *  - A caller compiled against a newer header than the library's passes a larger struct:
 *    its bytes the library does not know, the padding past the library's last field
 *    included (a newer header's field may sit there), must be zero, else the call is
 *    refused with INVALID_ARGUMENT naming the byte. Zero the struct (= {0}) before its
 *    _init: an older library's _init leaves the newer fields alone.
 *  - The library fills an output struct only up to struct_size.
 * The ABI of the first release of a major version is kept in the repository
 * (tests/capi/abi) and checked by the test suite: within a major version (one SONAME,
 * libhpshard.so.MAJOR) functions, enum values and struct fields are only ever added.
 *
 * Tensors cross the C boundary as DLPack tensors (<dlpack/dlpack.h>, DLPack 0.6): views
 * of library memory (parameters, gradients, the clip coefficient, the loss scale) are
 * handed out as DLManagedTensor, and collectives accept DLTensor buffers (see "DLPack
 * tensors" below).
 */
#ifndef HPSHARD_HPSHARD_H_
#define HPSHARD_HPSHARD_H_

#include <dlpack/dlpack.h>
#include <stddef.h>
#include <stdint.h>

#include "hpshard/version.h"

/* Exported symbols: the library is built with -fvisibility=hidden and only HPS_API
 * functions (all named hps_*) are visible; a linker version script enforces it. */
#if defined(HPS_BUILDING_LIBRARY) && defined(__GNUC__)
#define HPS_API __attribute__((visibility("default")))
#else
#define HPS_API
#endif

#ifdef __cplusplus
extern "C" {
#endif

/* ------------------------------------------------------------------------ */
/* Status                                                                   */
/* ------------------------------------------------------------------------ */

/** Result of every hpshard call. Values are explicit and never reused. */
typedef enum hps_status {
  HPS_STATUS_OK = 0,
  HPS_STATUS_INVALID_ARGUMENT = 1,    /**< null pointer, unknown enum value, bad size */
  HPS_STATUS_OUT_OF_RANGE = 2,        /**< an index or a size beyond what exists */
  HPS_STATUS_NOT_FOUND = 3,           /**< a named thing does not exist */
  HPS_STATUS_ALREADY_EXISTS = 4,      /**< a named thing exists already */
  HPS_STATUS_FAILED_PRECONDITION = 5, /**< a call in the wrong state or phase */
  HPS_STATUS_UNIMPLEMENTED = 6,       /**< not supported by this build or backend */
  HPS_STATUS_UNAVAILABLE = 7,         /**< a device or backend is not present */
  HPS_STATUS_TIMEOUT = 8,             /**< an operation did not complete in time */
  HPS_STATUS_ABORTED = 9,             /**< an operation was aborted (peer died, abort called) */
  HPS_STATUS_OUT_OF_MEMORY = 10,      /**< an allocation failed */
  HPS_STATUS_INTERNAL = 11,           /**< a bug in hpshard; please report it */
  HPS_STATUS_BACKEND_ERROR = 12,      /**< CUDA, NCCL, Gloo or the OS reported an error */
  HPS_STATUS_FORCE32 = 0x7FFFFFFF
} hps_status_t;

/**
 * Static English text naming a status ("HPS_STATUS_TIMEOUT" → "timeout").
 * Unknown values give "unknown status". Never NULL; the caller does not free it.
 * Thread safety: any thread.
 */
HPS_API const char* hps_status_string(hps_status_t status);

/**
 * The message of the last failing hpshard call on the calling thread, or "" when
 * no call on this thread has failed. Owned by the library, valid until the next
 * hpshard call on the same thread. Thread safety: thread-local.
 */
HPS_API const char* hps_last_error_message(void);

/* ------------------------------------------------------------------------ */
/* Version                                                                  */
/* ------------------------------------------------------------------------ */

/** HPS_VERSION_NUMBER of the library actually loaded. Thread safety: any thread. */
HPS_API uint32_t hps_version_number(void);

/** "MAJOR.MINOR.PATCH" of the loaded library; static, never NULL. Thread safety: any thread. */
HPS_API const char* hps_version_string(void);

/* ------------------------------------------------------------------------ */
/* Data types                                                               */
/* ------------------------------------------------------------------------ */

typedef enum hps_dtype {
  HPS_DTYPE_FLOAT32 = 0,
  HPS_DTYPE_FLOAT64 = 1,
  HPS_DTYPE_FLOAT16 = 2,
  HPS_DTYPE_BFLOAT16 = 3,
  HPS_DTYPE_INT32 = 4,
  HPS_DTYPE_INT64 = 5,
  HPS_DTYPE_UINT8 = 6,
  HPS_DTYPE_FORCE32 = 0x7FFFFFFF
} hps_dtype_t;

/**
 * Size of one element of `dtype` in bytes, into *out_size.
 * Errors: HPS_STATUS_INVALID_ARGUMENT for an unknown dtype or a NULL out_size.
 * Thread safety: any thread.
 */
HPS_API hps_status_t hps_dtype_size(hps_dtype_t dtype, size_t* out_size);

/**
 * Short name of `dtype` ("float32", "bfloat16", ...) into *out_name: static text,
 * never freed. Errors: HPS_STATUS_INVALID_ARGUMENT for an unknown dtype or NULL.
 * Thread safety: any thread.
 */
HPS_API hps_status_t hps_dtype_name(hps_dtype_t dtype, const char** out_name);

/* ------------------------------------------------------------------------ */
/* Devices                                                                  */
/* ------------------------------------------------------------------------ */

typedef enum hps_device_type {
  HPS_DEVICE_CPU = 0,
  HPS_DEVICE_CUDA = 1,
  HPS_DEVICE_TYPE_FORCE32 = 0x7FFFFFFF
} hps_device_type_t;

/**
 * How many devices of `type` this process can use, into *out_count. CPU: always 1.
 * CUDA: 0 when the library was built without CUDA or no usable driver/device is
 * present (that is not an error). Errors: INVALID_ARGUMENT for an unknown type or NULL.
 * Thread safety: any thread.
 */
HPS_API hps_status_t hps_device_count(hps_device_type_t type, int32_t* out_count);

/** Properties of one device. ABI-extensible: fields are only ever appended. */
typedef struct hps_device_properties {
  size_t struct_size;               /**< set by hps_device_properties_init */
  hps_device_type_t type;           /**< the device's type */
  int32_t index;                    /**< the device's index within its type */
  char name[256];                   /**< NUL-terminated ("cpu", "NVIDIA H200", ...) */
  uint64_t total_memory_bytes;      /**< physical memory of the device */
  int32_t compute_capability_major; /**< CUDA only; 0 on CPU */
  int32_t compute_capability_minor; /**< CUDA only; 0 on CPU */
  int32_t multiprocessor_count;     /**< CUDA: SMs; CPU: hardware threads */
} hps_device_properties_t;

/**
 * Zero `props` (its first min(struct_size, sizeof) bytes) and set its struct_size; pass
 * sizeof(hps_device_properties_t) as the caller knows it (see "ABI-extensible structs").
 * Errors: INVALID_ARGUMENT for NULL or a struct_size those rules refuse. Thread safety:
 * any thread.
 */
HPS_API hps_status_t hps_device_properties_init(hps_device_properties_t* props, size_t struct_size);

/**
 * Fill `props` (initialised by hps_device_properties_init) for device (type, index).
 * Fields past props->struct_size are not written.
 * Errors: INVALID_ARGUMENT (NULL, uninitialised struct, unknown type),
 * OUT_OF_RANGE (no such device index). Thread safety: any thread.
 */
HPS_API hps_status_t hps_device_get_properties(hps_device_type_t type, int32_t index,
                                               hps_device_properties_t* props);

/* ------------------------------------------------------------------------ */
/* Streams and events                                                       */
/* ------------------------------------------------------------------------ */

/**
 * A stream is an ordered queue of work on one device. CUDA: a cudaStream_t owned by
 * the handle. CPU: an ordered queue run by a worker thread owned by the handle.
 */
typedef struct hps_stream hps_stream_t;

/**
 * An event marks a point in a stream. Recording it again moves the mark; queries and
 * waits refer to the most recent record at the time of the call.
 */
typedef struct hps_event hps_event_t;

/**
 * Create a stream on device (type, index) into *out_stream; the caller owns it and
 * frees it with hps_stream_destroy. Errors: INVALID_ARGUMENT (NULL, unknown type),
 * OUT_OF_RANGE (no such device), BACKEND_ERROR. Thread safety: any thread.
 */
HPS_API hps_status_t hps_stream_create(hps_device_type_t type, int32_t index,
                                       hps_stream_t** out_stream);

/**
 * Finish the work queued on `stream`, then free it (an engine that uses it as its
 * compute_stream keeps the stream itself alive; the finish then returns what
 * hps_stream_synchronize would). NULL is a no-op returning OK.
 * Thread safety: no other thread may use the stream during or after the call.
 */
HPS_API hps_status_t hps_stream_destroy(hps_stream_t* stream);

/**
 * Block the calling thread until all work queued on `stream` so far has completed.
 * This is a host synchronisation and is counted by the host-sync counter.
 * A CPU stream that waited for an operation that failed (hps_work_wait_stream,
 * hps_clip_run's reductions) returns that operation's error (TIMEOUT, ABORTED, ...) from
 * the next synchronize, once everything queued has completed: the work queued after the
 * wait ran on what the failed operation left. The synchronize after that starts afresh.
 * CUDA streams report such failures where the operation is waited for.
 * Errors: INVALID_ARGUMENT (NULL), BACKEND_ERROR. Thread safety: per handle.
 */
HPS_API hps_status_t hps_stream_synchronize(hps_stream_t* stream);

/**
 * Make work queued on `stream` after this call wait until `event`'s most recent record
 * has completed. The host does not block (on CUDA: cudaStreamWaitEvent; on CPU: an
 * ordered dependency in the stream's queue). The stream and event must be on the same
 * device. Errors: INVALID_ARGUMENT (NULL, device mismatch), FAILED_PRECONDITION (the
 * event was never recorded). Thread safety: per handle.
 */
HPS_API hps_status_t hps_stream_wait_event(hps_stream_t* stream, hps_event_t* event);

/**
 * Enqueue a copy of `bytes` bytes from `src` to `dst` on `stream`; returns without
 * waiting for it. Both pointers must be valid memory of the stream's device (or host
 * memory, on CUDA, via unified addressing) until the copy completes. bytes == 0 is a
 * no-op. Errors: INVALID_ARGUMENT (NULL stream; with bytes > 0 a NULL pointer, regions
 * that overlap or run past the end of the address space: nothing is enqueued),
 * BACKEND_ERROR. Thread safety: per handle.
 */
HPS_API hps_status_t hps_memcpy_async(void* dst, const void* src, size_t bytes,
                                      hps_stream_t* stream);

/**
 * Create an event on device (type, index) into *out_event; the caller owns it and
 * frees it with hps_event_destroy. A new event has never been recorded.
 * Errors: as hps_stream_create. Thread safety: any thread.
 */
HPS_API hps_status_t hps_event_create(hps_device_type_t type, int32_t index,
                                      hps_event_t** out_event);

/**
 * Free `event`. NULL is a no-op returning OK. Streams already waiting on it still
 * wait for the work it marked. Thread safety: no other thread may use the event.
 */
HPS_API hps_status_t hps_event_destroy(hps_event_t* event);

/**
 * Record `event` at the current end of `stream`'s queue. The host does not block.
 * Errors: INVALID_ARGUMENT (NULL, device mismatch). Thread safety: per handle.
 */
HPS_API hps_status_t hps_event_record(hps_event_t* event, hps_stream_t* stream);

/**
 * Without blocking, set *out_completed to 1 when the event's most recent record has
 * completed, else 0. Not a host synchronisation. Errors: INVALID_ARGUMENT (NULL),
 * FAILED_PRECONDITION (never recorded). Thread safety: per handle.
 */
HPS_API hps_status_t hps_event_query(hps_event_t* event, int32_t* out_completed);

/**
 * Block the calling thread until the event's most recent record has completed.
 * Counted by the host-sync counter. Errors: INVALID_ARGUMENT (NULL),
 * FAILED_PRECONDITION (never recorded), BACKEND_ERROR. Thread safety: per handle.
 */
HPS_API hps_status_t hps_event_synchronize(hps_event_t* event);

/* ------------------------------------------------------------------------ */
/* DLPack tensors                                                           */
/* ------------------------------------------------------------------------ */

/*
 * Views of library memory come out as DLManagedTensor (hps_engine_param_dlpack,
 * hps_engine_grad_dlpack, hps_engine_loss_scale_dlpack, hps_clip_coefficient_dlpack): the
 * device (kDLCPU, or kDLCUDA and the device index), dtype, shape and compact row-major
 * strides of the memory, byte_offset 0. Each holds a reference that keeps the memory of
 * the engine (or clip) it came from alive until its deleter runs: destroying the engine's
 * handle first is allowed, and the memory goes when the last view is released. A view is
 * handed to another framework as DLPack says (it calls the deleter when done), or released
 * with hps_dlpack_release. The memory is still the engine's: what the engine does to it
 * (the all-gather after a step, the zeroing of gradients) happens to the view too, and a
 * stage-3 parameter view is valid only until hps_engine_release_parameters of its unit
 * (the memory then goes back to the engine's pool of full buffers; with HPS_DEBUG_VIEWS=1
 * the engine makes released full buffers inaccessible, so a write through a stale view
 * faults at once instead of landing in another unit's parameters).
 *
 * Buffers go in as DLTensor (the hps_comm_*_dlpack collectives, hps_clip_add_tensor_dlpack):
 * compact row-major (strides NULL or matching the shape), lanes 1, one of hpshard's dtypes
 * (float32/64/16, bfloat16, int32/64, uint8), on the operation's device (host memory --
 * kDLCPU, kDLCUDAHost, kDLCUDAManaged -- for CPU communicators; kDLCUDA with the same index
 * for CUDA ones); the element count is the product of the shape. Anything else is refused
 * with INVALID_ARGUMENT and nothing is started. The caller keeps the tensor's memory valid
 * as for the raw-pointer functions (until the work completed, or the clip is destroyed).
 */

/**
 * The host/device policy, in one place: the host address of `tensor`'s data (data +
 * byte_offset) into *out_data when its memory is host memory (kDLCPU, kDLCUDAHost,
 * kDLCUDAManaged); FAILED_PRECONDITION naming the device when it is not (no host view of
 * device memory: hand such a tensor, or its data, to that device's tools). Bindings build
 * their host views (NumPy arrays, ByteBuffers, slices) only through it.
 * Errors: INVALID_ARGUMENT (NULL), FAILED_PRECONDITION. Thread safety: any thread.
 */
HPS_API hps_status_t hps_dlpack_host_data(const DLTensor* tensor, void** out_data);

/**
 * Release a DLManagedTensor: call its deleter (any producer's, not only hpshard's). NULL,
 * or a tensor without a deleter, is a no-op returning OK. The tensor must not be used
 * afterwards. Thread safety: any thread; the release of the last view of a destroyed
 * engine frees the engine on the calling thread (after what it has in flight).
 */
HPS_API hps_status_t hps_dlpack_release(DLManagedTensor* tensor);

/* ------------------------------------------------------------------------ */
/* Host-sync counter                                                        */
/* ------------------------------------------------------------------------ */

/**
 * Every place hpshard can block the host (stream or event synchronize, device-to-host
 * read, host wait on a collective, draining a task flow) counts one host sync.
 * A steady-state training step must count zero.
 */

/**
 * Host syncs counted on the calling thread since it started or last called
 * hps_host_sync_reset, into *out_count. Errors: INVALID_ARGUMENT (NULL).
 * Thread safety: any thread (reads its own counter).
 */
HPS_API hps_status_t hps_host_sync_count_thread(uint64_t* out_count);

/**
 * Host syncs counted on all threads since the process started or the last
 * hps_host_sync_reset, into *out_count. Errors: INVALID_ARGUMENT (NULL).
 * Thread safety: any thread.
 */
HPS_API hps_status_t hps_host_sync_count_total(uint64_t* out_count);

/**
 * Reset the total counter and the calling thread's counter to zero.
 * Thread safety: any thread; other threads' own counters are not changed.
 */
HPS_API hps_status_t hps_host_sync_reset(void);

/* ------------------------------------------------------------------------ */
/* Stores and rendezvous                                                    */
/* ------------------------------------------------------------------------ */

/**
 * A key-value store through which ranks meet. Thread safety: a store handle may be used
 * from several threads at once (ranks that are threads share one).
 */
typedef struct hps_store hps_store_t;

/**
 * Open the store at `url` as rank `rank`, into *out_store (owned by the caller; free with
 * hps_store_destroy):
 *   "memory://NAME"    shared by every open of NAME in this process (thread-ranks);
 *   "file:///DIR"      a directory on a filesystem all ranks see;
 *   "tcp://HOST:PORT"  rank 0 serves on HOST:PORT, every rank connects, retrying until
 *                      timeout_ms. A call whose answer does not come (the serving rank
 *                      stopped or overloaded) fails with TIMEOUT after timeout_ms held
 *                      within 1 to 60 s (a get or wait: after its own wait and a slack of
 *                      a quarter of it, 1 to 10 s); what uses the store (a communicator's
 *                      creation, a checkpoint's agreements) can take that much past its
 *                      own timeout.
 * Errors: INVALID_ARGUMENT (NULL, malformed URL, unknown scheme, timeout_ms <= 0),
 * TIMEOUT (no server), UNAVAILABLE (rank 0 cannot listen on HOST:PORT: the port is taken),
 * FAILED_PRECONDITION (a file:// or tcp:// store that belongs to another job, or that
 * this rank of this job has joined already: a second open of the job's store in one process
 * while the first is open, also as rank 0 of a TCP store whose first server holds the port;
 * a memory:// store is one store for every open of its NAME, whatever the rank),
 * BACKEND_ERROR. Thread safety:
 * any thread.
 *
 * The job's store may be destroyed and opened again in one process (a program in phases):
 * a rank that opens it again waits, up to timeout_ms, for rank 0 to open it again, even when
 * rank 0 has not destroyed its first one yet, and never joins the one it destroyed. Every
 * rank must take part in every phase: a rank that skips one pairs with the others' next.
 */
HPS_API hps_status_t hps_store_open(const char* url, int32_t rank, int64_t timeout_ms,
                                    hps_store_t** out_store);

/**
 * Free `store`; NULL is a no-op. A communicator created over the store keeps the store (and a
 * serving TCP store's server) alive until it is destroyed too: destroy the communicators
 * first when the store is to be opened again. A serving TCP store stops serving once the
 * other ranks have closed their connections to it (destroyed their stores), or after its
 * timeout (timeout_ms of hps_store_open, 1 s to 1 min): the last release blocks until then,
 * so that ranks still finishing a communicator's creation or split that this rank is done
 * with are not cut off. After hps_store_abort it waits for no one.
 */
HPS_API hps_status_t hps_store_destroy(hps_store_t* store);

/**
 * Abort `store`: every call on it from now on, and every wait on it under way (within about
 * 200 ms), returns ABORTED; so does a communicator's creation over it (hps_comm_create, a
 * hybrid group's) that waits for ranks, and later splits of communicators created over it.
 * For a caller that must stop waiting for ranks that never come (a Ctrl-C, a supervisor
 * giving up) while another thread is blocked in such a call. It cannot be undone: destroy
 * the store (once no call uses it; a serving TCP store then stops at once, without waiting
 * for the other ranks) and open a new one. Operations of communicators already
 * created do not use the store and are not affected (see hps_comm_abort).
 * Errors: INVALID_ARGUMENT (NULL). Thread safety: any thread, also while other threads use
 * the store.
 */
HPS_API hps_status_t hps_store_abort(hps_store_t* store);

/** Set `key` to the `size` bytes at `value` (binary-safe). Errors: INVALID_ARGUMENT. */
HPS_API hps_status_t hps_store_set(hps_store_t* store, const char* key, const void* value,
                                   size_t size);

/**
 * Wait up to timeout_ms for `key`, then copy its value into `buffer` (capacity bytes) and
 * its size into *out_size. When the value does not fit (or buffer is NULL), nothing is
 * copied, *out_size receives the size needed and the status is OUT_OF_RANGE.
 * Errors: INVALID_ARGUMENT, TIMEOUT (naming the key), OUT_OF_RANGE.
 */
HPS_API hps_status_t hps_store_get(hps_store_t* store, const char* key, int64_t timeout_ms,
                                   void* buffer, size_t capacity, size_t* out_size);

/**
 * Add `delta` to the integer at `key` (0 when unset); the new value into *out_value.
 * Errors: INVALID_ARGUMENT (the key holds a value that is not a decimal integer, the empty
 * one included), OUT_OF_RANGE (the sum overflows 64 bits).
 */
HPS_API hps_status_t hps_store_add(hps_store_t* store, const char* key, int64_t delta,
                                   int64_t* out_value);

/** Wait up to timeout_ms until `key` is set. Errors: INVALID_ARGUMENT, TIMEOUT. */
HPS_API hps_status_t hps_store_wait(hps_store_t* store, const char* key, int64_t timeout_ms);

/** Without waiting, *out_present = 1 when `key` is set, else 0. */
HPS_API hps_status_t hps_store_check(hps_store_t* store, const char* key, int32_t* out_present);

/** Where this process sits in the job, as the environment says. ABI-extensible. */
typedef struct hps_rendezvous_info {
  size_t struct_size; /**< set by hps_rendezvous_info_init */
  int32_t rank;
  int32_t world_size;
  int32_t local_rank;  /**< rank among the processes of this host */
  char store_url[512]; /**< for hps_store_open */
  char source[128];    /**< which variables were read: the family, then the variables, e.g.
                            "hpshard (HPS_RANK, HPS_WORLD_SIZE, HPS_STORE)" or
                            "torchrun (RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT)" */
} hps_rendezvous_info_t;

/**
 * Zero `info` (its first min(struct_size, sizeof) bytes) and set its struct_size (see
 * "ABI-extensible structs"). Errors: INVALID_ARGUMENT. Thread safety: any thread.
 */
HPS_API hps_status_t hps_rendezvous_info_init(hps_rendezvous_info_t* info, size_t struct_size);

/**
 * Fill `info` from the environment: HPS_RANK / HPS_WORLD_SIZE / HPS_STORE (set by
 * hpshard-run), else torchrun's RANK / WORLD_SIZE / MASTER_ADDR / MASTER_PORT, else Open
 * MPI's OMPI_COMM_WORLD_*, else Slurm's SLURM_PROCID / SLURM_NTASKS.
 * Errors: NOT_FOUND (none set), INVALID_ARGUMENT (a malformed or missing variable, named).
 * Thread safety: any thread.
 */
HPS_API hps_status_t hps_rendezvous_from_env(hps_rendezvous_info_t* info);

/* ------------------------------------------------------------------------ */
/* Communicators and work                                                   */
/* ------------------------------------------------------------------------ */

/**
 * Reductions (SUM, AVG) of float16 and bfloat16 on CPU communicators add in fp32 and round
 * the result to the dtype once: over shared memory the ranks add in fp32; over TCP the data
 * travels widened to fp32. AVG divides the fp32 sum by the group size before that rounding,
 * so a float16 average is finite wherever the mean fits, even where the sum does not.
 * Integer SUM wraps around on overflow (two's complement, as NCCL's); integer AVG divides
 * that sum by the group size, truncating toward zero. CUDA communicators use NCCL's ncclAvg. MAX
 * and MIN of floating types on CPU communicators give NaN where any rank's element is NaN (as
 * torch.maximum), over either transport; CUDA communicators follow NCCL.
 */
typedef enum hps_reduce_op {
  HPS_REDUCE_SUM = 0,
  HPS_REDUCE_AVG = 1,
  HPS_REDUCE_MAX = 2,
  HPS_REDUCE_MIN = 3,
  HPS_REDUCE_OP_FORCE32 = 0x7FFFFFFF
} hps_reduce_op_t;

/**
 * A group of ranks that runs collectives on its own stream: on CPU buffers over shared memory
 * between the ranks of one host and Gloo's TCP transport across hosts ("self" for one rank),
 * NCCL on CUDA buffers (hps_comm_transport). Every operation is asynchronous and returns a
 * work handle. Thread safety: one thread at a time per communicator, except hps_comm_abort
 * (any thread).
 */
typedef struct hps_comm hps_comm_t;

/** One asynchronous operation. Its buffers must stay valid until it has completed. */
typedef struct hps_work hps_work_t;

/** Communicator options. ABI-extensible: fields are only ever appended. */
typedef struct hps_comm_options {
  size_t struct_size;      /**< set by hps_comm_options_init */
  int64_t timeout_ms;      /**< every operation ends by then: TIMEOUT (default 300000) */
  int32_t check_arguments; /**< 1: ranks check they called the same collective (default);
                                over shared memory the ranks compare their calls either way
                                (the descriptor rides in the collective's first round) */
  const char* name;        /**< the group's name in messages (default "world"); copied; 1 to 1024
                                bytes of UTF-8 without control characters, or INVALID_ARGUMENT */
} hps_comm_options_t;

/**
 * Set the defaults (reading HPS_COMM_TIMEOUT_MS and HPS_COMM_CHECK) and struct_size, as
 * every _init does (see "ABI-extensible structs"). Errors: INVALID_ARGUMENT (NULL,
 * a struct_size those rules refuse, a malformed environment variable: those two, and HPS_COMM_SHM,
 * HPS_COMM_SHM_SLOT_BYTES and HPS_COMM_SHM_DIRECT, which hps_comm_create reads). Thread safety: any
 * thread.
 */
HPS_API hps_status_t hps_comm_options_init(hps_comm_options_t* options, size_t struct_size);

/**
 * Create this rank's member of a group of `size` ranks meeting through `store`, on device
 * (type, device_index); `options` may be NULL. Collective: every rank calls it. Blocks
 * until all ranks have connected or the timeout passed. The caller owns *out_comm.
 * Errors: INVALID_ARGUMENT, OUT_OF_RANGE (rank or device, or a size past 65,536 ranks, or
 * past 8,192 for CPU buffers), UNAVAILABLE (backend not built or not loadable), TIMEOUT,
 * BACKEND_ERROR.
 */
HPS_API hps_status_t hps_comm_create(hps_store_t* store, int32_t rank, int32_t size,
                                     hps_device_type_t type, int32_t device_index,
                                     const hps_comm_options_t* options, hps_comm_t** out_comm);

/** Free `comm` after its queued operations end; NULL is a no-op. */
HPS_API hps_status_t hps_comm_destroy(hps_comm_t* comm);

/**
 * Block until the operations queued on `comm` so far (sends and receives included) have
 * ended (completed, failed or timed out), without freeing anything: a binding calls it
 * before hps_comm_destroy so that hps_comm_abort from another thread can still end an
 * operation stuck on a peer that has gone while the close waits (hps_comm_abort must not
 * run concurrently with hps_comm_destroy itself). Not a host sync of the training step (uncounted).
 * Returns OK once they have ended, whatever their outcome. Added in 0.4.0. Thread safety: with
 * hps_comm_abort from any thread; otherwise one thread at a time.
 */
HPS_API hps_status_t hps_comm_finish(hps_comm_t* comm);

/**
 * Immediate, from any thread: pending and later operations of `comm` end with
 * ABORTED, and those of every live communicator split from it (hps_comm_split, a hybrid
 * topology's groups, a checkpoint's own: a save in flight ends) and from those in turn;
 * a split of it under way (hps_comm_split, hps_hybrid_group_create) that waits for its
 * members ends with ABORTED within about 200 ms. The other ranks of a CPU group learn of
 * it as of a rank that has gone: their operations that wait for this rank's arguments or
 * data end with ABORTED naming it, at once (over TCP this rank resets its connections to
 * them). Thread safety: any thread.
 */
HPS_API hps_status_t hps_comm_abort(hps_comm_t* comm);

/** This rank's position in `comm` into *out_rank. */
HPS_API hps_status_t hps_comm_rank(hps_comm_t* comm, int32_t* out_rank);

/** The number of ranks of `comm` into *out_size. */
HPS_API hps_status_t hps_comm_size(hps_comm_t* comm, int32_t* out_size);

/**
 * The device `comm` was created on: its type into *out_type and its index into *out_index
 * (HPS_DEVICE_CPU, 0 for CPU communicators). Collectives of a CUDA communicator take device
 * buffers. Errors: INVALID_ARGUMENT (a NULL argument). Thread safety: any thread.
 */
HPS_API hps_status_t hps_comm_device(hps_comm_t* comm, hps_device_type_t* out_type,
                                     int32_t* out_index);

/**
 * How the collectives of `comm` move data, into *out_name: "shm" (CPU ranks all on one
 * host, through shared memory), "tcp" (CPU ranks over Gloo TCP; also a group of one rank,
 * or HPS_COMM_SHM=0), "self" (a CPU group of one rank in a build without Gloo: nothing
 * moves) or "nccl" (CUDA). The ranks of a group agree on it at creation. The
 * string is a static NUL-terminated constant owned by the library: never free it; it stays
 * valid after `comm` is destroyed. Later versions may add names. Errors: INVALID_ARGUMENT
 * (a NULL argument). Thread safety: any thread.
 */
HPS_API hps_status_t hps_comm_transport(hps_comm_t* comm, const char** out_name);

/** Change the timeout of later operations. Errors: INVALID_ARGUMENT (<= 0). */
HPS_API hps_status_t hps_comm_set_timeout(hps_comm_t* comm, int64_t timeout_ms);

/**
 * Collective over `comm`: every rank calls it with the same `count` ranks (numbered in
 * `comm`) in the same order. Members get a new communicator in *out_comm (rank = position
 * in `ranks`; owned by the caller); the others get NULL. Every rank takes part, members
 * or not: the ranks compare their lists first (one small all-gather over `comm`), so it
 * returns once every rank has called it. hps_comm_abort on `comm` also
 * aborts the new communicator while it lives. Its errors name a peer by its number in the
 * new group and, where that differs, by its number in the communicator the chain of splits
 * began with: "rank 0 (world rank 2) aborted the communicator". Errors: INVALID_ARGUMENT (NULL, a
 * name as hps_comm_options_t.name refuses; on every rank, with nothing made, when the ranks' lists
 * differ in order, members or count: the message names the split and two of the lists; on every
 * rank when the list they all give is empty or repeats a rank; a count beyond comm's size, with the
 * list unread: on that rank, and on the others as lists that differ), OUT_OF_RANGE (a rank outside
 * comm, on every rank), ABORTED or TIMEOUT (a rank of `comm` that has gone or never calls it, a
 * `comm` aborted or unusable after a failed operation).
 */
HPS_API hps_status_t hps_comm_split(hps_comm_t* comm, const int32_t* ranks, size_t count,
                                    const char* name, hps_comm_t** out_comm);

/*
 * Collectives. `count`s are element counts of `dtype`. `ready` may be NULL; when given,
 * the operation starts after the work already queued on that stream (the caller's compute
 * stream), without blocking the host. The caller owns *out_work and frees it with
 * hps_work_destroy (which does not wait). Bad input — a NULL buffer, a buffer not aligned
 * to its dtype's elements, an output too small, an unknown reduction, a rank outside the group, a
 * count that overflows, send and recv that overlap other than in the operation's in-place form — is
 * refused with nothing sent. Ranks that disagree on a collective end it with INVALID_ARGUMENT (CPU
 * groups over shared memory always, over TCP with check_arguments on; NCCL groups do not compare
 * their calls), a peer that is missing with TIMEOUT, a peer that died with ABORTED or TIMEOUT; the
 * message names the operation, its group and sequence number. An operation that fails ends its
 * communicator on that rank: later operations end with ABORTED naming the failure, and the other
 * ranks of a CPU group learn of it as of a rank that has gone (hps_comm_abort), so a rank that
 * joins the operation late fails too. The communicators of an engine (from hps_engine_seal) or of a
 * clip also end together.
 */

/** recv[i] = op over ranks of send[i], for i < count. send may equal recv (in place). */
HPS_API hps_status_t hps_comm_all_reduce(hps_comm_t* comm, const void* send, void* recv,
                                         uint64_t count, hps_dtype_t dtype, hps_reduce_op_t op,
                                         hps_stream_t* ready, hps_work_t** out_work);

/** Like all_reduce, but only `root` receives (recv may be NULL elsewhere). */
HPS_API hps_status_t hps_comm_reduce(hps_comm_t* comm, const void* send, void* recv, uint64_t count,
                                     hps_dtype_t dtype, hps_reduce_op_t op, int32_t root,
                                     hps_stream_t* ready, hps_work_t** out_work);

/** `root`'s buffer is copied into every rank's buffer. */
HPS_API hps_status_t hps_comm_broadcast(hps_comm_t* comm, void* buffer, uint64_t count,
                                        hps_dtype_t dtype, int32_t root, hps_stream_t* ready,
                                        hps_work_t** out_work);

/**
 * Rank r's send_count elements land at recv + r * send_count; recv_count (the capacity of
 * recv) must be at least size * send_count. In place: send == recv + r * send_count.
 */
HPS_API hps_status_t hps_comm_all_gather(hps_comm_t* comm, const void* send, uint64_t send_count,
                                         void* recv, uint64_t recv_count, hps_dtype_t dtype,
                                         hps_stream_t* ready, hps_work_t** out_work);

/**
 * Rank r receives (recv_count elements) the reduction of slice r of every rank's send;
 * send_count must be at least size * recv_count. In place: recv == send + r * recv_count.
 */
HPS_API hps_status_t hps_comm_reduce_scatter(hps_comm_t* comm, const void* send,
                                             uint64_t send_count, void* recv, uint64_t recv_count,
                                             hps_dtype_t dtype, hps_reduce_op_t op,
                                             hps_stream_t* ready, hps_work_t** out_work);

/**
 * Send `count` elements to `peer`, which receives them with hps_comm_recv. A send and its
 * receive are not compared (as in NCCL and Gloo): counts that differ end in TIMEOUT or
 * ABORTED, and dtypes of one size with the bytes as sent. A CPU
 * communicator completes sends and receives in whatever order the two ranks issue them. A
 * CUDA (NCCL) communicator runs each operation after its earlier ones, and a send there
 * completes only as the peer's matching receive runs: NCCL requires a send and a receive
 * that must progress together to be issued as one group, which separate calls are not, so
 * two ranks that each send to the other before receiving from it can wait for each other
 * until the communicator's timeout. Exchange in opposite orders there (the lower rank
 * sends first, the higher one receives first).
 */
HPS_API hps_status_t hps_comm_send(hps_comm_t* comm, const void* buffer, uint64_t count,
                                   hps_dtype_t dtype, int32_t peer, hps_stream_t* ready,
                                   hps_work_t** out_work);

/** Receive `count` elements from `peer`. */
HPS_API hps_status_t hps_comm_recv(hps_comm_t* comm, void* buffer, uint64_t count,
                                   hps_dtype_t dtype, int32_t peer, hps_stream_t* ready,
                                   hps_work_t** out_work);

/** Completes once every rank has reached it. */
HPS_API hps_status_t hps_comm_barrier(hps_comm_t* comm, hps_stream_t* ready, hps_work_t** out_work);

/*
 * The same collectives over DLPack tensors (see "DLPack tensors"): the dtype and element
 * counts come from the tensors, which must share one dtype and be on the communicator's
 * device. Counts: all_reduce and reduce need equal element counts in send and recv;
 * all_gather a recv of at least size x send's; reduce_scatter a send of at least size x
 * recv's (the recv count is the slice each rank gets). Errors as the raw-pointer forms,
 * and INVALID_ARGUMENT for a tensor they refuse (the message names it). The caller owns
 * *out_work. Thread safety: as the raw-pointer forms.
 */

/** hps_comm_all_reduce over tensors; send may be recv. */
HPS_API hps_status_t hps_comm_all_reduce_dlpack(hps_comm_t* comm, const DLTensor* send,
                                                const DLTensor* recv, hps_reduce_op_t op,
                                                hps_stream_t* ready, hps_work_t** out_work);

/** hps_comm_reduce over tensors; recv may be NULL on ranks other than root. */
HPS_API hps_status_t hps_comm_reduce_dlpack(hps_comm_t* comm, const DLTensor* send,
                                            const DLTensor* recv, hps_reduce_op_t op, int32_t root,
                                            hps_stream_t* ready, hps_work_t** out_work);

/** hps_comm_broadcast over a tensor. */
HPS_API hps_status_t hps_comm_broadcast_dlpack(hps_comm_t* comm, const DLTensor* buffer,
                                               int32_t root, hps_stream_t* ready,
                                               hps_work_t** out_work);

/** hps_comm_all_gather over tensors. */
HPS_API hps_status_t hps_comm_all_gather_dlpack(hps_comm_t* comm, const DLTensor* send,
                                                const DLTensor* recv, hps_stream_t* ready,
                                                hps_work_t** out_work);

/** hps_comm_reduce_scatter over tensors. */
HPS_API hps_status_t hps_comm_reduce_scatter_dlpack(hps_comm_t* comm, const DLTensor* send,
                                                    const DLTensor* recv, hps_reduce_op_t op,
                                                    hps_stream_t* ready, hps_work_t** out_work);

/** hps_comm_send of a tensor. */
HPS_API hps_status_t hps_comm_send_dlpack(hps_comm_t* comm, const DLTensor* buffer, int32_t peer,
                                          hps_stream_t* ready, hps_work_t** out_work);

/** hps_comm_recv into a tensor. */
HPS_API hps_status_t hps_comm_recv_dlpack(hps_comm_t* comm, const DLTensor* buffer, int32_t peer,
                                          hps_stream_t* ready, hps_work_t** out_work);

/**
 * Without blocking, *out_completed = 1 when the operation has finished, else 0; a finished
 * operation that failed returns its error instead. Not a host synchronisation.
 */
HPS_API hps_status_t hps_work_test(hps_work_t* work, int32_t* out_completed);

/** Block the host until the operation has finished; its status. Counted as a host sync. */
HPS_API hps_status_t hps_work_wait(hps_work_t* work);

/**
 * Block the host until the operation has finished or `timeout_ms` milliseconds have passed,
 * whichever comes first: HPS_STATUS_OK with *out_completed = 1 when it finished, 0 when the
 * timeout passed first; an operation that finished and failed returns its error instead,
 * *out_completed untouched (as hps_work_test). A loop of these waits lets a caller stay
 * responsive (a binding answers an interrupt between them). Counted as one host sync when it
 * returns finished, so a loop counts as hps_work_wait does. INVALID_ARGUMENT when `timeout_ms` < 0;
 * a timeout above 2^40 ms (about 35 years) waits that long.
 */
HPS_API hps_status_t hps_work_wait_timeout(hps_work_t* work, int64_t timeout_ms,
                                           int32_t* out_completed);

/**
 * Work queued on `stream` after this call waits for the operation, host not blocked. When
 * the operation fails, its error becomes the stream's (hps_stream_synchronize).
 */
HPS_API hps_status_t hps_work_wait_stream(hps_work_t* work, hps_stream_t* stream);

/** Free the handle (the operation itself goes on); NULL is a no-op. */
HPS_API hps_status_t hps_work_destroy(hps_work_t* work);

/* ------------------------------------------------------------------------ */
/* Topology and the hybrid communicate group                                */
/* ------------------------------------------------------------------------ */

/** Groups of the hybrid topology; the first five are its axes. */
typedef enum hps_group {
  HPS_GROUP_DP = 0,
  HPS_GROUP_PP = 1,
  HPS_GROUP_SHARDING = 2,
  HPS_GROUP_SEP = 3,
  HPS_GROUP_MP = 4,
  HPS_GROUP_CHECK = 5,          /**< the model replica: every rank with this dp coordinate */
  HPS_GROUP_SHARDING_CHECK = 6, /**< every rank with this sharding coordinate */
  HPS_GROUP_FORCE32 = 0x7FFFFFFF
} hps_group_t;

/** Axes dp × pp × sharding × sep × mp and the rank arithmetic (pure, no communication). */
typedef struct hps_topology hps_topology_t;

/**
 * Create a topology with the given degrees (each >= 1, multiplying to world_size, at most
 * 2^30) and axis order, slowest first: a comma-separated list naming each axis once, e.g.
 * "dp,pp,sharding,sep,mp" (the default, used when `order` is NULL). Ranks are row-major,
 * the last axis fastest. The caller owns *out_topology. Errors: INVALID_ARGUMENT.
 * Thread safety: a topology is immutable; any thread.
 */
HPS_API hps_status_t hps_topology_create(int32_t dp, int32_t pp, int32_t sharding, int32_t sep,
                                         int32_t mp, const char* order, int32_t world_size,
                                         hps_topology_t** out_topology);

/** Free `topology`; NULL is a no-op. */
HPS_API hps_status_t hps_topology_destroy(hps_topology_t* topology);

/** The degree of axis `axis` (HPS_GROUP_DP .. HPS_GROUP_MP) into *out_degree. */
HPS_API hps_status_t hps_topology_degree(const hps_topology_t* topology, hps_group_t axis,
                                         int32_t* out_degree);

/** `rank`'s coordinate on `axis` into *out_coordinate. Errors: OUT_OF_RANGE (rank). */
HPS_API hps_status_t hps_topology_coordinate(const hps_topology_t* topology, int32_t rank,
                                             hps_group_t axis, int32_t* out_coordinate);

/** The rank at the given coordinates. Errors: OUT_OF_RANGE (a coordinate). */
HPS_API hps_status_t hps_topology_rank_of(const hps_topology_t* topology, int32_t dp, int32_t pp,
                                          int32_t sharding, int32_t sep, int32_t mp,
                                          int32_t* out_rank);

/**
 * The ranks of `rank`'s group of kind `group`, ascending (the first is the group's source
 * rank), into out_ranks (capacity entries) and their number into *out_count. When they do
 * not fit, nothing is copied, *out_count receives the number needed and the status is
 * OUT_OF_RANGE.
 */
HPS_API hps_status_t hps_topology_group_ranks(const hps_topology_t* topology, hps_group_t group,
                                              int32_t rank, int32_t* out_ranks, size_t capacity,
                                              size_t* out_count);

/** The previous and next stage of `rank` in its pipeline (wrapping around). */
HPS_API hps_status_t hps_topology_pipeline_neighbors(const hps_topology_t* topology, int32_t rank,
                                                     int32_t* out_prev, int32_t* out_next);

/** This rank's communicators for every group of a topology. */
typedef struct hps_hybrid_group hps_hybrid_group_t;

/**
 * Collective over `world` (whose size must equal the topology's): creates every group's
 * communicator in the same order on every rank. The caller owns *out_group; `world` must
 * outlive it. Errors: INVALID_ARGUMENT, and those of hps_comm_create.
 */
HPS_API hps_status_t hps_hybrid_group_create(hps_comm_t* world, const hps_topology_t* topology,
                                             hps_hybrid_group_t** out_group);

/** Free `group` (communicator handles taken from it stay valid); NULL is a no-op. */
HPS_API hps_status_t hps_hybrid_group_destroy(hps_hybrid_group_t* group);

/**
 * A new handle to this rank's communicator of `group` (it shares the communicator with the
 * hybrid group); the caller owns it and frees it with hps_comm_destroy. Every handle taken
 * for one kind is that one communicator: one thread at a time across all of them (two
 * threads each issuing collectives on its own handle pair them differently on each rank).
 * A communicator of its own for another thread: hps_comm_split.
 */
HPS_API hps_status_t hps_hybrid_group_comm(hps_hybrid_group_t* group, hps_group_t kind,
                                           hps_comm_t** out_comm);

/* ------------------------------------------------------------------------ */
/* Hybrid global-norm clipping                                              */
/* ------------------------------------------------------------------------ */

/**
 * Clips gradients by their global L2 norm over a hybrid topology. Per gradient the squared
 * norm goes into D (HPS_CLIP_DISTRIBUTED: split across mp) or N (the rest); D is summed
 * over the sharding, mp and pp groups, N over the sharding and pp groups, each once;
 * norm = sqrt(D + N); coef = max_norm / (max(norm, max_norm) + 1e-6); every clipped
 * gradient is multiplied by coef on the device. A NaN gradient makes the norm NaN and the
 * gradients NaN; an infinite one makes coef 0 (torch's clip_grad_norm_ without
 * error_if_nonfinite). Thread safety: one thread at a time per clip.
 */
typedef struct hps_clip hps_clip_t;

/** Flags of a registered gradient (a bitwise or). */
typedef enum hps_clip_flag {
  HPS_CLIP_DISTRIBUTED = 1,      /**< split across mp: its norm is summed over mp */
  HPS_CLIP_NO_CLIP = 2,          /**< need_clip false: neither counted nor scaled */
  HPS_CLIP_SHARED_NOT_FIRST = 4, /**< a pipeline-shared copy: scaled but not counted */
  HPS_CLIP_FLAG_FORCE32 = 0x7FFFFFFF
} hps_clip_flag_t;

/** Clip options. ABI-extensible. */
typedef struct hps_clip_options {
  size_t struct_size;    /**< set by hps_clip_options_init */
  double max_norm;       /**< > 0 (default 1.0) */
  int32_t deterministic; /**< 1: exact fixed-point partials, the norm bitwise identical
                              whatever the dp/sharding/mp/pp layout (default 0) */
} hps_clip_options_t;

/**
 * Set the defaults and struct_size (see "ABI-extensible structs"). Errors:
 * INVALID_ARGUMENT (NULL, a struct_size those rules refuse). Thread safety: any thread.
 */
HPS_API hps_status_t hps_clip_options_init(hps_clip_options_t* options, size_t struct_size);

/**
 * Create a clip over the given groups (each may be NULL: not reduced over); `options` may
 * be NULL for the defaults. The clip holds its own reference to the communicators: their
 * handles may be destroyed before it. While the clip lives, its communicators fail together,
 * as an engine's do from hps_engine_seal: a reduction that fails on one group ends the others
 * on this rank, so no rank takes a norm that a failed reduction left. Errors:
 * INVALID_ARGUMENT (max_norm not positive and finite, communicators on different devices,
 * a hybrid group's communicator of another axis as mp or pp), UNIMPLEMENTED (CUDA
 * communicators in a build without CUDA).
 */
HPS_API hps_status_t hps_clip_create(hps_comm_t* sharding, hps_comm_t* mp, hps_comm_t* pp,
                                     const hps_clip_options_t* options, hps_clip_t** out_clip);

/**
 * Free `clip` once the work its last run queued has completed (blocking, not counted: with
 * a peer gone, until the communicator's timeout; hps_comm_abort first ends it at once);
 * NULL is a no-op. DLPack views of its coefficient keep its memory until released, not
 * its communicators: those go with the handle.
 */
HPS_API hps_status_t hps_clip_destroy(hps_clip_t* clip);

/**
 * Register a gradient of `count` elements of `dtype` (float32, float64, float16 or
 * bfloat16) at `data`, which must stay valid while the clip is used (NULL with a count of
 * 0: an empty gradient). Errors: INVALID_ARGUMENT (dtype, NULL data with a non-zero count,
 * data not aligned to its elements, memory that overlaps a gradient registered already,
 * unknown flag bits), FAILED_PRECONDITION (sealed).
 */
HPS_API hps_status_t hps_clip_add_tensor(hps_clip_t* clip, void* data, uint64_t count,
                                         hps_dtype_t dtype, uint32_t flags);

/**
 * Finish registration. Collective over the clip's groups (sharding, mp, pp), blocking the
 * host at set-up (counted): when the ranks of any mp group registered different flags,
 * every rank gets INVALID_ARGUMENT at once (the ranks of that group naming it).
 */
HPS_API hps_status_t hps_clip_seal(hps_clip_t* clip);

/**
 * Enqueue one clip of the registered gradients on `stream`: partial norms, their
 * reduction over the groups, the norm into *norm_out (device memory of the stream's
 * device; may be NULL) and, when scale is non-zero, the scaling of the gradients. Nothing
 * blocks the host; read the norm after synchronizing with the stream. Use one stream per
 * clip. A reduction that fails after this returns (a peer gone, a timeout, ranks that
 * called differently) is the stream's error: hps_stream_synchronize returns it, and the
 * norm and the scaled gradients of that run are not to be used. hps_clip_destroy waits
 * for the work the last run queued. Errors: FAILED_PRECONDITION (not sealed),
 * INVALID_ARGUMENT (also a stream on another device than the clip's communicators or,
 * without communicators, its DLPack gradients), ABORTED (an earlier run's reduction
 * failed).
 */
HPS_API hps_status_t hps_clip_run(hps_clip_t* clip, hps_stream_t* stream, float* norm_out,
                                  int32_t scale);

/**
 * The device address of the latest coefficient (valid in stream order after
 * hps_clip_run), for an optimizer that folds the clip into its update. Owned by the clip.
 * A clip without communicators holds it on the CPU until its first run on a CUDA stream
 * moves it to that device (take the address again after that run; the old one stays
 * readable, no longer updated). Errors: INVALID_ARGUMENT (NULL), FAILED_PRECONDITION (not
 * sealed).
 */
HPS_API hps_status_t hps_clip_coefficient(hps_clip_t* clip, const float** out_coefficient);

/**
 * hps_clip_add_tensor over a DLPack tensor (float32, float64, float16 or bfloat16, on the
 * clip's device: the communicators', or without communicators the first DLPack
 * gradient's, which the runs' streams must share): the gradient's data,
 * count and dtype come from it. Its memory must stay valid while the clip is used.
 * Errors: as hps_clip_add_tensor, and INVALID_ARGUMENT for a tensor it refuses.
 * Thread safety: one thread at a time per clip.
 */
HPS_API hps_status_t hps_clip_add_tensor_dlpack(hps_clip_t* clip, const DLTensor* gradient,
                                                uint32_t flags);

/**
 * The latest coefficient as a DLPack view (float32, shape [1], on the clip's device) into
 * *out_tensor, owned by the caller: it keeps the clip's memory alive until its deleter
 * runs (hps_dlpack_release). Valid in stream order after hps_clip_run, as
 * hps_clip_coefficient. Errors: as hps_clip_coefficient. Thread safety: as
 * hps_clip_coefficient.
 */
HPS_API hps_status_t hps_clip_coefficient_dlpack(hps_clip_t* clip, DLManagedTensor** out_tensor);

/* ------------------------------------------------------------------------ */
/* Sharded training engine                                                  */
/* ------------------------------------------------------------------------ */

/**
 * ZeRO-style sharded data parallelism for a framework that keeps its own forward and
 * backward: it registers its parameters, points its tensors at the engine's views,
 * adds gradients into the gradient views and checks each one in; the engine reduces
 * every complete bucket while backward goes on and steps the optimizer on this rank's
 * shard. Per step, for each unit (layer):
 *   forward:  hps_engine_wait_parameters(u); compute; hps_engine_release_parameters(u)
 *   backward: hps_engine_wait_parameters(u); add into the gradient views;
 *             hps_engine_grad_ready(i) for each of its parameters; hps_engine_release_parameters(u)
 * then hps_engine_step. Buckets' reductions start in one order on every rank whatever
 * order their gradients check in: the bucket holding the latest-registered parameter
 * first (the order a backward pass completes them); a bucket complete before its turn
 * waits, without blocking the host, for the ones ahead of it. Units' all-gathers start
 * at their waits (or are prefetched at a wait, release or step), and collectives pair by
 * their order, so every rank of the sharding and dp groups makes the same sequence of
 * wait, release and step calls and checks in the same gradients between each two of them
 * (in any order among themselves): each collective carries its bucket, so
 * CPU groups checking arguments (check_arguments, the default) refuse ranks that do not
 * with INVALID_ARGUMENT naming both ("tag" = bucket + 1; the step's clip norm and
 * found-inf flag, and a standalone hps_clip_run, carry tags of their own, so a rank at
 * one of them while its peers are at another, or at a caller's collective of the same
 * size, is refused likewise); NCCL groups check nothing and
 * pair different collectives' data where their sizes are equal. Stage 2 keeps full parameters
 * resident (an all-gather after each step brings them back; release does nothing). Stage 3 keeps
 * only this rank's shards: wait_parameters gathers the unit (prefetched in the order recorded on
 * the first step, at most prefetch_window units live) and release frees it. Nothing in a
 * steady-state step blocks the host. Both stages, every parameter dtype and dynamic loss scaling
 * work over CPU communicators (shared memory, Gloo TCP) and CUDA ones (NCCL) alike: parameters are
 * float32, float16 or bfloat16 (views and gradients in that dtype, reductions adding in fp32, fp32
 * master weights and optimizer state inside, parameters rounded once per step). On CUDA the views
 * are device pointers and the framework's forward and backward are taken to run on the engine's
 * compute stream (options.compute_stream; NULL: the CUDA legacy default stream): wait_parameters
 * makes that stream wait for the unit's all-gather on the device, and the host never blocks. Thread
 * safety: one thread at a time per engine.
 */
typedef struct hps_engine hps_engine_t;

typedef enum hps_optimizer {
  HPS_OPTIMIZER_SGD = 0,   /**< momentum, weight decay, nesterov (torch.optim.SGD) */
  HPS_OPTIMIZER_ADAMW = 1, /**< decoupled weight decay (torch.optim.AdamW) */
  HPS_OPTIMIZER_FORCE32 = 0x7FFFFFFF
} hps_optimizer_t;

/** Flags of a registered parameter (a bitwise or). */
typedef enum hps_param_flag {
  HPS_PARAM_FROZEN = 1,           /**< not trainable: no gradient, never updated */
  HPS_PARAM_DISTRIBUTED = 2,      /**< split across mp (for clipping) */
  HPS_PARAM_NO_CLIP = 4,          /**< excluded from gradient clipping */
  HPS_PARAM_SHARED_NOT_FIRST = 8, /**< a pipeline-shared copy: not counted in the norm */
  HPS_PARAM_NO_WEIGHT_DECAY = 16, /**< the optimizer's weight decay skips it (biases and
                                       norms, as a torch parameter group with
                                       weight_decay 0). Added in 0.3.0. */
  HPS_PARAM_FLAG_FORCE32 = 0x7FFFFFFF
} hps_param_flag_t;

/** Engine options. ABI-extensible. */
typedef struct hps_engine_options {
  size_t struct_size;           /**< set by hps_engine_options_init */
  int32_t stage;                /**< 2 (default) or 3 */
  hps_optimizer_t optimizer;    /**< default SGD */
  float learning_rate;          /**< default 0.01 */
  float momentum;               /**< SGD, default 0 */
  float weight_decay;           /**< default 0 */
  int32_t nesterov;             /**< SGD, default 0 */
  float beta1;                  /**< AdamW, default 0.9 */
  float beta2;                  /**< AdamW, default 0.999 */
  float epsilon;                /**< AdamW, default 1e-8 */
  double clip_max_norm;         /**< > 0: global-norm clipping folded into the optimizer */
  int32_t deterministic_clip;   /**< 1: the clip norm is bitwise layout-independent */
  int32_t accumulation_steps;   /**< micro-batches per step (default 1) */
  uint64_t alignment_bytes;     /**< parameter alignment in the flat buffers (default 256) */
  int32_t prefetch_window;      /**< stage 3: units live at once, prefetch included (default 2;
                                     a step gathering units out of the recorded order drops
                                     units prefetched for it; more only while more are in use
                                     at once); the same on every rank of a sharding group */
  int32_t dynamic_loss_scaling; /**< 1: multiply the loss by hps_engine_loss_scale; non-finite
                                     gradients skip the step on every rank (default 0) */
  float initial_loss_scale;     /**< default 65536 */
  float growth_factor;          /**< applied after growth_interval good steps (default 2),
                                     unless the scale would pass the largest float (as
                                     torch's GradScaler) */
  float backoff_factor;         /**< applied on a skipped step (default 0.5) */
  int32_t growth_interval;      /**< default 2000 */
  /* Added in 0.2.0. */
  hps_stream_t* compute_stream; /**< the framework's compute stream, on the engine's device
                                     (default NULL). CUDA: wait_parameters makes it wait for
                                     the unit's all-gather, release frees the unit after the
                                     work queued on it, grad_ready without a ready stream
                                     orders the reduction after it; NULL is the CUDA legacy
                                     default stream. CPU engines take NULL (the framework
                                     computes on the calling thread, which orders the
                                     engine's work by its calls) or a CPU stream, which is
                                     checked and kept alive but not otherwise used. The
                                     engine keeps the stream alive while it lives. */
  /* Added in 0.3.0. */
  uint64_t bucket_bytes; /**< > 0: a flat buffer (bucket) of a unit's parameters of one
                              dtype holds at most this many bytes (a parameter larger than
                              it gets a bucket of its own), so one unit is reduced in
                              several collectives, each started when its parameters have
                              all checked in, overlapping the rest of the unit's backward.
                              0 (default): one bucket per unit and dtype.
                              hps_engine_param_bucket tells which bucket holds a
                              parameter. */
} hps_engine_options_t;

/**
 * Set the defaults and struct_size (see "ABI-extensible structs"). Errors:
 * INVALID_ARGUMENT (NULL, a struct_size those rules refuse). Thread safety: any thread.
 */
HPS_API hps_status_t hps_engine_options_init(hps_engine_options_t* options, size_t struct_size);

/**
 * Create an engine sharding over `sharding` (required) with an optional `dp` group above
 * it; `options` may be NULL. The engine holds its own reference to the communicators (and
 * to options->compute_stream): their handles may be destroyed before it. The caller owns
 * *out_engine. Errors: INVALID_ARGUMENT (also a compute_stream on another device, or an
 * options struct refused by the ABI-extensible rules), UNIMPLEMENTED (CUDA communicators
 * in a build without CUDA kernels).
 */
HPS_API hps_status_t hps_engine_create(hps_comm_t* sharding, hps_comm_t* dp,
                                       const hps_engine_options_t* options,
                                       hps_engine_t** out_engine);

/**
 * Finish what is in flight, then free `engine`; NULL is a no-op. The handle is gone at
 * once. Returns what the work in flight ended with: OK, or the first failure of it (the
 * collectives of a last step whose peers had left), which nothing else would report. DLPack views
 * handed out by it keep its memory (parameters, gradients, loss scale, norm) until they are
 * released, not its communicators and streams: those go now, so its peers learn at once that this
 * rank has left. Checkpoint handles of it keep the whole engine (they may still save and load)
 * until the last of them is destroyed, which then lets the communicators and streams go as above.
 * Thread safety: no other thread may use the handle, nor a checkpoint handle of it
 * (hps_checkpoint_t) while it runs.
 */
HPS_API hps_status_t hps_engine_destroy(hps_engine_t* engine);

/**
 * How many calls on `engine` that run or wait for its work (hps_engine_seal,
 * _broadcast_parameters, _wait_parameters, _release_parameters, _grad_ready, _step,
 * _synchronize, _gather_parameter) have returned an error, from any thread since its
 * creation, into *out_count. Such an error is how the work's failure reaches the program (a
 * failed collective, ranks that disagreed on one) or a refusal of the call. Lets a binding's
 * close decide whether the program was told of a failure of the engine's work:
 * hps_engine_destroy returns it whatever came before, and the bindings raise it only while
 * this is 0. Errors: INVALID_ARGUMENT (a NULL argument). Added in 0.4.0. Thread safety: any
 * thread.
 */
HPS_API hps_status_t hps_engine_failures_returned(hps_engine_t* engine, uint64_t* out_count);

/**
 * Register a parameter before hps_engine_seal; its index (registration order) into
 * *out_index. `unit` is the layer its forward belongs to. Every rank must register the
 * same parameters in the same order. A name is 1 to 4096 bytes of UTF-8 without control
 * characters (bytes below 0x20, 0x7f). Errors: INVALID_ARGUMENT, ALREADY_EXISTS (name),
 * FAILED_PRECONDITION (sealed), UNIMPLEMENTED (a dtype other than float32, float16, bfloat16).
 */
HPS_API hps_status_t hps_engine_add_param(hps_engine_t* engine, const char* name,
                                          const int64_t* shape, size_t ndim, hps_dtype_t dtype,
                                          uint32_t flags, int32_t unit, size_t* out_index);

/**
 * In a hybrid topology with tensor (mp) or pipeline (pp) parallelism, before
 * hps_engine_seal: this rank's mp and pp groups (hps_hybrid_group_comm; either may be
 * NULL: none). The engine then takes its step's global decisions over the whole model, as
 * hps_clip does: the clip norm sums the squares of HPS_PARAM_DISTRIBUTED gradients over
 * mp and of every counted gradient over pp (the others are replicated across mp), and a
 * non-finite gradient on any rank of the sharding, dp, mp or pp groups skips the step on
 * all of them. Without it an engine's clip and skip span its sharding and dp groups only,
 * which is right only where mp and pp are 1. Every rank must call it alike (hps_engine_seal
 * is then collective over these groups as well). The engine holds its own references.
 * A communicator of a hybrid group (hps_hybrid_group_comm) must be that group's own axis:
 * its pp group given as mp, or its sep group as either, is refused; a communicator split
 * by hand is checked at seal by the coordinates its members share and the sizes of their
 * groups along the other axes.
 * Added in 0.4.0. Errors: INVALID_ARGUMENT (a group on another device, or the engine's
 * sharding or dp communicator, or mp and pp the same, or a hybrid group's communicator of
 * another axis), FAILED_PRECONDITION (sealed).
 * Thread safety: one thread at a time per engine.
 */
HPS_API hps_status_t hps_engine_set_model_parallel_groups(hps_engine_t* engine, hps_comm_t* mp,
                                                          hps_comm_t* pp);

/**
 * Lay the parameters out and allocate the buffers (zero-filled). Collective over the
 * sharding and dp groups (and the groups of hps_engine_set_model_parallel_groups: their
 * members must share this rank's other coordinates, and the mp ranks must have registered
 * the same flags), host-blocking at set-up only (its waits are counted as host syncs): when
 * any rank finds a difference (other
 * parameters, groups whose members do not share those coordinates, other engine options
 * than compute_stream: stage, optimizer and hyperparameters, clipping, alignment, buckets,
 * accumulation, loss scaling; at stage 3 prefetch_window, within a sharding group, where it
 * decides where all-gathers fall among reduce-scatters), every rank gets
 * INVALID_ARGUMENT at once. The ranks of each sharding and dp group must have set mp and pp
 * groups of the same sizes, or none; that is agreed first, over those groups alone, so a
 * rank that did not call hps_engine_set_model_parallel_groups is named at once.
 *
 * From the seal on, the engine's communicators fail together while the engine lives: the
 * first of them to fail an operation (or to be aborted) ends the others on this rank as a
 * failed operation ends its own (their later operations end with ABORTED naming it, and
 * their other ranks learn of it as of a rank that has gone). So a rank whose collective on
 * one group failed does not run its later collectives on the others with what the failed one
 * left, and a rank that shares no group with a rank that has gone fails its step too, rather
 * than completing it with wrong values.
 */
HPS_API hps_status_t hps_engine_seal(hps_engine_t* engine);

/**
 * Collective: every rank's parameters become its groups' source rank's. Set-up only.
 * Stage 3: write the initial values into the views after hps_engine_seal, then call this;
 * it shards them (from here on views exist only while their unit is gathered).
 */
HPS_API hps_status_t hps_engine_broadcast_parameters(hps_engine_t* engine);

/**
 * The parameter view of `index`, owned by the engine. Stage 2: valid until the engine is
 * destroyed. Stage 3: valid between hps_engine_wait_parameters and
 * hps_engine_release_parameters of its unit (FAILED_PRECONDITION otherwise).
 */
HPS_API hps_status_t hps_engine_param(hps_engine_t* engine, size_t index, void** out_data);

/**
 * The gradient view of `index`; backward adds into it. Stage 2: zero at the start of every
 * step, accumulating over the step's micro-batches, valid until the engine is destroyed.
 * Stage 3: the view of the current micro-batch, zero when first asked for in it; each
 * micro-batch's gradients are reduce-scattered (and added into the shard) when its bucket
 * checks in, and the view is gone after that (ask again in the next micro-batch).
 * Errors: FAILED_PRECONDITION (frozen parameter, not sealed, or stage 3 before
 * hps_engine_broadcast_parameters or after the step's last micro-batch has checked in:
 * step first), OUT_OF_RANGE.
 */
HPS_API hps_status_t hps_engine_grad(hps_engine_t* engine, size_t index, void** out_data);

/**
 * Before the forward of `unit` reads its parameters (and before backward writes their
 * gradients): waits for their all-gather (stage 3 starts it unless it was prefetched).
 * A dependency wait, counted by hps_dependency_wait_stats, not a host sync.
 * Errors: NOT_FOUND (no such unit), FAILED_PRECONDITION (stage 3 before
 * hps_engine_broadcast_parameters).
 */
HPS_API hps_status_t hps_engine_wait_parameters(hps_engine_t* engine, int32_t unit);

/**
 * After the forward or the backward of `unit`: stage 3 frees its full parameters (their
 * gradients go once reduced); stage 2 moves nothing. At both stages the unit is then out of
 * use: a checkpoint's load or import is refused while a unit is between its wait and its
 * release (stage 2: or the step, which ends every unit's use). Errors: NOT_FOUND,
 * FAILED_PRECONDITION (stage 3: a gradient of the unit was taken in this micro-batch while
 * some gradient of its buckets has not checked in; each must, its view taken first).
 */
HPS_API hps_status_t hps_engine_release_parameters(hps_engine_t* engine, int32_t unit);

/**
 * Parameter `index`'s gradient is complete for this micro-batch. When the last parameter
 * of a bucket checks in on the last micro-batch, the bucket's reduction starts (after
 * those of the buckets ahead of it in the reduction order: hps_engine_t); with
 * clipping or dynamic loss scaling its shard's unscale pass (and the clip's partial sums)
 * follows it on the engine's optimizer stream, while the backward goes on (stage 2's full
 * gradients stay readable until hps_engine_step). `ready`: the stream the gradient was
 * produced on, or NULL when the calling thread wrote it. At stage 3 a parameter that gets
 * no gradient in a backward still checks in, after its (zero) view was taken with
 * hps_engine_grad while its unit was gathered. Errors: FAILED_PRECONDITION (checked in twice,
 * frozen; at stage 3 no view taken while its unit was gathered), OUT_OF_RANGE, BACKEND_ERROR
 * (a reduction failed).
 */
HPS_API hps_status_t hps_engine_grad_ready(hps_engine_t* engine, size_t index, hps_stream_t* ready);

/**
 * Enqueue the optimizer step on this rank's shards and the parameter all-gathers.
 * Returns at once: no host sync. At stage 3 a unit gathered across the step (waited for
 * and not released, as after a forward whose backward never came) is gathered again in
 * place after its update: its views keep their addresses, and it is read again after the
 * next hps_engine_wait_parameters of it (which waits for that all-gather).
 * Errors: FAILED_PRECONDITION (a gradient has not checked in: step before backward).
 */
HPS_API hps_status_t hps_engine_step(hps_engine_t* engine);

/**
 * Block until everything in flight (reductions, the optimizer, all-gathers) has finished.
 * Each wait it makes is counted as a host sync: not for the training step.
 */
HPS_API hps_status_t hps_engine_synchronize(hps_engine_t* engine);

/**
 * Copy the full value of parameter `index` as float32 into `out` (`count` elements, at least
 * the parameter's): for saving or evaluation (Paddle's get_all_parameters). fp16/bf16
 * parameters give their fp32 master weights. Collective over the sharding group: every
 * rank calls it with the same index; it blocks the host (counted) until the copy is done.
 * Errors: OUT_OF_RANGE (index, or count too small), FAILED_PRECONDITION (not trained yet).
 */
HPS_API hps_status_t hps_engine_gather_parameter(hps_engine_t* engine, size_t index, float* out,
                                                 uint64_t count);

/**
 * The device of the engine's sharding communicator (hps_comm_device): where its parameter
 * and gradient views, and the loss scale, live. HPS_DEVICE_CUDA means they are device
 * pointers, not to be dereferenced on the host. Errors: INVALID_ARGUMENT (a NULL argument).
 * Thread safety: any thread (the device is fixed at creation).
 */
HPS_API hps_status_t hps_engine_device(hps_engine_t* engine, hps_device_type_t* out_type,
                                       int32_t* out_index);

/**
 * Bytes this rank holds: parameters, gradients and optimizer state, and at stage 3 the full
 * buffers of gathered units and those kept pooled for the next gather. Errors:
 * INVALID_ARGUMENT (a NULL argument).
 */
HPS_API hps_status_t hps_engine_resident_bytes(hps_engine_t* engine, uint64_t* out_bytes);

/**
 * The part of parameter `index` (as element offsets [*out_begin, *out_end) within it)
 * that this rank's shard holds and updates; begin == end when none.
 */
HPS_API hps_status_t hps_engine_shard_range(hps_engine_t* engine, size_t index, uint64_t* out_begin,
                                            uint64_t* out_end);

/**
 * The flat buffer (bucket) holding parameter `index` into *out_bucket: buckets are numbered
 * from 0 across the engine, the same on every rank. The gradients of a bucket are reduced
 * together, by one collective started when each of its parameters has checked in
 * (hps_engine_grad_ready); frozen parameters lie in buckets of their own, never reduced.
 * Without bucket_bytes a bucket holds one unit's parameters of one dtype.
 * Errors: FAILED_PRECONDITION (not sealed), OUT_OF_RANGE. Thread safety: one thread at a
 * time per engine.
 */
HPS_API hps_status_t hps_engine_param_bucket(hps_engine_t* engine, size_t index,
                                             size_t* out_bucket);

/**
 * The engine's current loss scale (1 without dynamic loss scaling) in *out_scale: engine
 * memory the optimizer's stream updates. Multiply the loss by it before backward; read it
 * after the step's hps_engine_wait_parameters, when the last update has landed. Also the
 * number of steps skipped for non-finite gradients, under the same rule. Both pointers
 * stay valid until the engine is destroyed. On CUDA communicators both are device memory.
 * Errors: INVALID_ARGUMENT (NULL), FAILED_PRECONDITION (not sealed).
 */
HPS_API hps_status_t hps_engine_loss_scale(hps_engine_t* engine, const float** out_scale,
                                           const int64_t** out_skipped_steps);

/**
 * With clipping (clip_max_norm > 0): the global gradient norm of the engine's last step in
 * *out_norm, engine memory the optimizer's stream writes at each step: the norm the clip
 * computed over the whole model (its sharding, dp, mp and pp groups, as the coefficient
 * uses it) of the unscaled mean gradients, 0 before the first step; a step skipped for
 * non-finite gradients has its own (Inf or NaN when such a gradient counts in the norm).
 * What a training loop logs (torch's
 * clip_grad_norm_ returns it) without a host sync in the step: read it under
 * hps_engine_loss_scale's rule (after the next step's hps_engine_wait_parameters). The
 * pointer stays valid until the engine is destroyed; on CUDA communicators it is device
 * memory. Errors: INVALID_ARGUMENT (NULL), FAILED_PRECONDITION (not sealed, no clipping:
 * the engine computes the norm only to clip).
 */
HPS_API hps_status_t hps_engine_grad_norm(hps_engine_t* engine, const float** out_norm);

/**
 * Parameter `index`'s view as a DLPack tensor into *out_tensor (the parameter's dtype and
 * shape, on hps_engine_device's device), owned by the caller: it keeps the engine's memory
 * alive until its deleter runs (hps_dlpack_release), also past hps_engine_destroy. The
 * same memory as hps_engine_param, under the same rules: stage 3 hands it out only while
 * the unit is gathered (FAILED_PRECONDITION otherwise), and it is valid until the unit's
 * hps_engine_release_parameters. Errors: as hps_engine_param.
 * Thread safety: one thread at a time per engine; the view itself may go to any thread.
 */
HPS_API hps_status_t hps_engine_param_dlpack(hps_engine_t* engine, size_t index,
                                             DLManagedTensor** out_tensor);

/**
 * Gradient `index`'s view as a DLPack tensor into *out_tensor, owned by the caller, under
 * the rules of hps_engine_param_dlpack. Errors: as hps_engine_grad.
 * Thread safety: as hps_engine_param_dlpack.
 */
HPS_API hps_status_t hps_engine_grad_dlpack(hps_engine_t* engine, size_t index,
                                            DLManagedTensor** out_tensor);

/**
 * The loss scale (float32, shape [1]) and the skipped-step count (int64, shape [1]) of
 * hps_engine_loss_scale as DLPack views on the engine's device, into *out_scale and
 * *out_skipped_steps, both owned by the caller and keeping the engine's memory alive until
 * their deleters run. Read them under hps_engine_loss_scale's rule. Errors:
 * INVALID_ARGUMENT (NULL). Thread safety: as hps_engine_param_dlpack.
 */
HPS_API hps_status_t hps_engine_loss_scale_dlpack(hps_engine_t* engine, DLManagedTensor** out_scale,
                                                  DLManagedTensor** out_skipped_steps);

/**
 * The gradient norm of hps_engine_grad_norm as a DLPack view (float32, shape [1]) on the
 * engine's device into *out_norm, owned by the caller and keeping the engine's memory alive
 * until its deleter runs. Read it under hps_engine_grad_norm's rule. Errors: as
 * hps_engine_grad_norm. Thread safety: as hps_engine_param_dlpack.
 */
HPS_API hps_status_t hps_engine_grad_norm_dlpack(hps_engine_t* engine, DLManagedTensor** out_norm);

/**
 * Set the learning rate of the steps enqueued from now on, SGD's and AdamW's alike (a
 * learning-rate schedule calls it before each hps_engine_step; every rank sets the same
 * rate). No host sync: the next step's kernels take the rate as an argument. A checkpoint
 * saved afterwards records it. Added in 0.3.0. Errors: INVALID_ARGUMENT (NULL, negative or
 * not finite). Thread safety: one thread at a time per engine.
 */
HPS_API hps_status_t hps_engine_set_learning_rate(hps_engine_t* engine, float learning_rate);

/** Dependency waits so far (process-wide) and the time blocked in them, in nanoseconds. */
HPS_API hps_status_t hps_dependency_wait_stats(uint64_t* out_count, uint64_t* out_nanoseconds);

/* ------------------------------------------------------------------------ */
/* Checkpoints                                                              */
/* ------------------------------------------------------------------------ */

/**
 * Sharded, asynchronous, atomic, verified checkpoints of an engine, loadable into any
 * topology (docs/checkpoints.md). A checkpoint is a directory <root>/<name>: one data file
 * per writing rank holding ranges of the logical (unsharded) tensors — parameters in their
 * dtype, fp32 masters, SGD momentum or AdamW exp_avg / exp_avg_sq, the loss-scaling state
 * and step counts — each chunk with an XXH3 checksum, and manifest.json, written last.
 * It is published by fsync and rename; <root>/latest names the newest. Every rank of the
 * group must see <root> (one host, or a shared filesystem).
 *
 * A save returns at once: the state is copied in stream order after the work already
 * enqueued (the next steps cannot change what is saved, and count no host sync), and a
 * background thread writes and publishes. A load reads only this rank's ranges, checks
 * every checksum, converts between stage 2 and 3, sharding and dp degrees, bucket layouts
 * and fp32 / fp16 / bf16 parameters (fp32 masters kept), and changes no engine unless every
 * rank read everything. One hps_checkpoint_t per engine; one root per model and job (two
 * engines of a job, such as a GAN's networks, take each other's `latest`; two jobs of one
 * model are one series to keep_last), or per part of a model cut
 * across mp and pp (hps_engine_set_model_parallel_groups): a part claims its root.
 * Thread safety: a checkpoint handle and the engine handle it was made from are one handle
 * for threads: one thread at a time calls either (a save's snapshot and a load use the
 * engine's state, which a step on another thread would change under them; hps_engine_destroy
 * likewise); a save's writing runs on a thread of its own, beside the caller's steps.
 */
typedef struct hps_checkpoint hps_checkpoint_t;

/** Checkpoint options. ABI-extensible. */
typedef struct hps_checkpoint_options {
  size_t struct_size;   /**< set by hps_checkpoint_options_init */
  int32_t keep_last;    /**< > 0: after a save is published, delete this model's checkpoints
                             under the root beyond the newest keep_last (at least 2 for a part
                             of a model cut across mp and pp; default 0: keep all); another
                             model's (other parameter names or shapes) are kept */
  uint64_t chunk_bytes; /**< ranges are checksummed in chunks of this size (default 1 MiB) */
  int64_t timeout_ms;   /**< bound on each agreement among the ranks of a save or load
                             (default 1800000; more than a year counts as a year) */
} hps_checkpoint_options_t;

/** Set the defaults and struct_size. Errors: INVALID_ARGUMENT. */
HPS_API hps_status_t hps_checkpoint_options_init(hps_checkpoint_options_t* options,
                                                 size_t struct_size);

/**
 * A checkpoint handle for `engine`, saving under `root` (created when missing). Collective
 * over `group`: a CPU communicator of exactly the ranks holding the engine's state (its
 * sharding x dp ranks); the handle uses a communicator split from it, so `group` may be
 * used for other work meanwhile. `options` may be NULL. The handle keeps the engine whole
 * (hps_engine_destroy may come first: it may still save and load), `group` must outlive
 * it. The caller owns *out_checkpoint. Errors: INVALID_ARGUMENT (a group of another
 * size or device, bad options; a root claimed by another part of the model, or holding
 * checkpoints of another part or of the whole model when this engine is a part, or of a part
 * when it is the whole model), BACKEND_ERROR (root cannot be created or claimed).
 */
HPS_API hps_status_t hps_checkpoint_create(hps_engine_t* engine, hps_comm_t* group,
                                           const char* root,
                                           const hps_checkpoint_options_t* options,
                                           hps_checkpoint_t** out_checkpoint);

/** Wait for a save in flight, then free the handle; NULL is a no-op. */
HPS_API hps_status_t hps_checkpoint_destroy(hps_checkpoint_t* checkpoint);

/**
 * Start saving checkpoint <root>/<name> ([A-Za-z0-9._-], 1..200 characters, not starting
 * with '.', not "latest" nor beginning "latest.tmp") with `count` metadata entries keys[i] =
 * values[i] (UTF-8 strings, copied: at most 65536 entries, keys of 1 to 4096 bytes, values of
 * at most 1 MiB, all of them at most 64 MiB as JSON strings, where a control character takes
 * 6 bytes; e.g. the
 * framework's step and data-loader position; the manifest keeps rank 0's). Every rank calls it with
 * the same name at the same point of training, after the step whose state it saves. Returns at once
 * with *out_work (owned by the caller, freed with hps_work_destroy): hps_work_test / hps_work_wait
 * tell when the checkpoint is published on every rank, or how it failed (the same error on every
 * rank, INVALID_ARGUMENT where the ranks gave different names or had taken different numbers of
 * steps (a rank that stopped before its step and one after it: a mix of two steps), ABORTED
 * after hps_comm_abort on the
 * group or on a communicator it was split from, which also stops the writing; TIMEOUT, naming
 * the holder, where another job's save held the root's save lock, <root>/.hpshard-save-lock,
 * for half of timeout_ms; nothing is published then and the previous checkpoints stay intact:
 * jobs sharing a root save one after the other). A save while another
 * is in flight first waits for it (a host-blocking wait, counted as a host sync). Errors:
 * INVALID_ARGUMENT (name, metadata), ALREADY_EXISTS (a checkpoint of that name exists),
 * FAILED_PRECONDITION (the engine has no state yet: not sealed, or at stage 3 before
 * hps_engine_broadcast_parameters). A save before the first step keeps the initial state;
 * one in the middle of a step keeps the state the last step left (the step's gradients are
 * not state). The save copies this rank's state on a stream of its own, ordered before the
 * next step's update: a host write into a parameter view belongs after hps_engine_synchronize
 * (before it, the checkpoint may hold the old value, the new one, or part of each; every
 * part verifies).
 */
HPS_API hps_status_t hps_checkpoint_save(hps_checkpoint_t* checkpoint, const char* name,
                                         const char* const* keys, const char* const* values,
                                         size_t count, hps_work_t** out_work);

/** Load options. ABI-extensible. */
typedef struct hps_checkpoint_load_options {
  size_t struct_size;    /**< set by hps_checkpoint_load_options_init */
  int32_t allow_partial; /**< 1: tensors the source lacks stay unchanged and tensors the engine
                              lacks are skipped, instead of an error naming them (default 0) */
} hps_checkpoint_load_options_t;

/** Set the defaults and struct_size. Errors: INVALID_ARGUMENT. */
HPS_API hps_status_t hps_checkpoint_load_options_init(hps_checkpoint_load_options_t* options,
                                                      size_t struct_size);

/**
 * Load checkpoint <root>/<name>, or the one <root>/latest names when `name` is NULL, into the
 * engine, whatever sharding and dp degrees, stage and parameter dtypes wrote it (a part of a
 * model cut across mp and pp loads only its own part's, and the parts agree over the
 * engine's mp and pp groups: all load checkpoints of one name, or none changes; call it on
 * every part. With `name` NULL and the parts' `latest` apart, as a save that did not complete
 * on every part leaves them, each part loads the newest checkpoint every part holds).
 * Collective over the group,
 * host-blocking; call it between steps (after hps_engine_broadcast_parameters for stage 3).
 * It restores the parameters (fp32 masters included), the optimizer state, the step counts
 * and the loss-scaling state; the engine's options (learning rate, optimizer
 * hyperparameters, clipping, accumulation) stay as they are (hps_checkpoint_read_engine_options
 * reads the saved ones).
 * `options` may be NULL. On any error no rank's engine changed. Errors: NOT_FOUND (no such
 * checkpoint, a missing file), INVALID_ARGUMENT (corrupt, truncated or mismatched data;
 * tensors missing or extra; another model or another part of it — the message names the file
 * and the tensor; the parts would load checkpoints of different names, or hold none in
 * common; the group's ranks
 * named different checkpoints, or read `latest` while it moved; `name` is ""), ABORTED (the load
 * failed on another part; the group was aborted, hps_comm_abort on it or on a communicator it
 * was split from: the load ends before its next read of tensor data),
 * FAILED_PRECONDITION (in the middle of a step: a unit between hps_engine_wait_parameters
 * and hps_engine_release_parameters, at either stage (stage 2: or the step), or a gradient
 * checked in since the last hps_engine_step), BACKEND_ERROR (a file that
 * cannot be read, as for hps_checkpoint_inspect).
 */
HPS_API hps_status_t hps_checkpoint_load(hps_checkpoint_t* checkpoint, const char* name,
                                         const hps_checkpoint_load_options_t* options);

/**
 * Initialise the engine's parameters (and fp32 masters) from the safetensors file `path`,
 * whose tensors carry the parameters' names; each rank reads only its shard. Optimizer state
 * and step counts stay. Collective, host-blocking; same errors and rule as hps_checkpoint_load.
 * The ranks compare the file's header (its checksum) and size, and the ranks of one host the
 * file itself (device, inode, modification time): a path replaced while they opened it, or
 * two copies of the file on one host, get INVALID_ARGUMENT on every rank and change nothing.
 */
HPS_API hps_status_t hps_checkpoint_import_safetensors(
    hps_checkpoint_t* checkpoint, const char* path, const hps_checkpoint_load_options_t* options);

/**
 * The value of metadata `key` of the last successful load or import, copied with its NUL
 * into `buffer` of `capacity` bytes; its length (without the NUL) into *out_length.
 * `buffer` may be NULL (with capacity 0) to ask for the length. Errors: INVALID_ARGUMENT
 * (NULL checkpoint, key or out_length; NULL buffer with capacity > 0), NOT_FOUND (no such
 * key, or nothing loaded), OUT_OF_RANGE (capacity <= length; nothing written).
 */
HPS_API hps_status_t hps_checkpoint_metadata(hps_checkpoint_t* checkpoint, const char* key,
                                             char* buffer, size_t capacity, size_t* out_length);

/** What a checkpoint holds. ABI-extensible. */
typedef struct hps_checkpoint_info {
  size_t struct_size; /**< set by hps_checkpoint_info_init */
  int32_t format_version;
  int32_t stage;           /**< of the engine that wrote it */
  int32_t sharding;        /**< its sharding degree */
  int32_t dp;              /**< its dp degree */
  int32_t world;           /**< ranks that saved it */
  int32_t files;           /**< data files */
  uint64_t tensors;        /**< logical tensors (parameters, masters, optimizer state, scalars) */
  uint64_t bytes;          /**< tensor data in the data files */
  int64_t created_unix_ns; /**< when it was published */
  char id[33];             /**< 32 hex digits and a NUL */
  char name[208];          /**< its name, NUL-terminated */
  /* Added in 0.4.0. */
  int32_t mp;      /**< the part of a model cut across mp and pp it holds: the mp degree */
  int32_t mp_rank; /**< and coordinate (1 and 0 for a whole model's checkpoint) */
  int32_t pp;      /**< the pp degree */
  int32_t pp_rank; /**< and coordinate */
} hps_checkpoint_info_t;

/** Zero `info` and set its struct_size. Errors: INVALID_ARGUMENT. */
HPS_API hps_status_t hps_checkpoint_info_init(hps_checkpoint_info_t* info, size_t struct_size);

/**
 * Read the manifest of the checkpoint at `path` (a checkpoint directory, or a root whose
 * latest is read) into *info, checking it but not the data (hps_checkpoint_verify does).
 * Fields past info->struct_size are not written. Errors: NOT_FOUND, INVALID_ARGUMENT,
 * BACKEND_ERROR (a file or folder that cannot be read: permissions, an I/O error, a path
 * through something that is not a folder). Thread safety: any thread.
 */
HPS_API hps_status_t hps_checkpoint_inspect(const char* path, hps_checkpoint_info_t* info);

/**
 * Check every data file's header and size and every chunk's checksum of the checkpoint at
 * `path` (as for inspect). Errors: NOT_FOUND, INVALID_ARGUMENT naming the file and tensor,
 * BACKEND_ERROR (as for inspect). Thread safety: any thread.
 */
HPS_API hps_status_t hps_checkpoint_verify(const char* path);

/**
 * Set the fields of `options` (initialised by hps_engine_options_init) to the engine options
 * the checkpoint at `path` was saved with (stage, optimizer and its hyperparameters, clipping,
 * accumulation, alignment, prefetch window, loss scaling), so a resumer can create the same
 * engine. bucket_bytes and compute_stream are not saved and stay as the caller set them (a
 * bucket cap changes how the reductions are cut, not what trains; any cap loads any
 * checkpoint). Errors: NOT_FOUND, INVALID_ARGUMENT. Thread safety: any thread.
 */
HPS_API hps_status_t hps_checkpoint_read_engine_options(const char* path,
                                                        hps_engine_options_t* options);

/**
 * Write the parameters of the checkpoint at `path` as one safetensors file `out` (the
 * Hugging Face format; replaced atomically: a symbolic link is followed, anything there but a
 * regular file is refused), each under its own name, in its dtype or with
 * `fp32` = 1 as float32 (fp32 masters where the checkpoint has them). Every chunk read is
 * checked. `out` may not lie in a checkpoint (the one exported or another: a folder holding a
 * manifest) nor be a root's `latest`. Errors: NOT_FOUND, INVALID_ARGUMENT, BACKEND_ERROR.
 * Thread safety: any thread.
 */
HPS_API hps_status_t hps_checkpoint_export_safetensors(const char* path, const char* out,
                                                       int32_t fp32);

#ifdef __cplusplus
} /* extern "C" */
#endif

#endif /* HPSHARD_HPSHARD_H_ */
