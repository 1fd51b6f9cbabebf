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
 */
#ifndef HPSHARD_HPSHARD_H_
#define HPSHARD_HPSHARD_H_

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
 * Zero `props` and set its struct_size; pass sizeof(hps_device_properties_t) as the
 * caller knows it. Errors: INVALID_ARGUMENT for NULL or a struct_size smaller than
 * the first version of the struct. Thread safety: any thread.
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
 * Finish the work queued on `stream`, then free it. NULL is a no-op returning OK.
 * Thread safety: no other thread may use the stream during or after the call.
 */
HPS_API hps_status_t hps_stream_destroy(hps_stream_t* stream);

/**
 * Block the calling thread until all work queued on `stream` so far has completed.
 * This is a host synchronisation and is counted by the host-sync counter.
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
 * memory, on CUDA, via unified addressing) until the copy completes; the regions must
 * not overlap. bytes == 0 is a no-op. Errors: INVALID_ARGUMENT (NULL stream or NULL
 * pointer with bytes > 0), BACKEND_ERROR. Thread safety: per handle.
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

#ifdef __cplusplus
} /* extern "C" */
#endif

#endif /* HPSHARD_HPSHARD_H_ */
