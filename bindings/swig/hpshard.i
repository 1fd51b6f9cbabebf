/*
 * hpshard.i — the SWIG interface shared by every language binding.
 *
 * It wraps ONLY the C API (hpshard/hpshard.h) and only by allow-list: everything is
 * ignored first, then each function, enum value, macro and struct member is listed
 * below. A function added to hpshard.h is NOT wrapped until it is listed here (and the
 * binding-parity test fails until it is).
 *
 * Conventions kept in every language:
 *  - Low-level names are the exact C names (hps_stream_create, HPS_STATUS_OK, ...).
 *  - Functions returning hps_status_t raise/throw a language exception carrying the
 *    status code and hps_last_error_message() when the status is not HPS_STATUS_OK
 *    (one %exception block, below). Their status return value then disappears:
 *    the function returns its trailing out-param (or nothing).
 *  - Trailing out-params become return values (typemaps in the language overlays,
 *    which know how to build the language's values): hps_stream_t** out_stream,
 *    hps_event_t** out_event, size_t* out_size, const char** out_name,
 *    int32_t* out_count, int32_t* out_completed, uint64_t* out_count, and the
 *    hps_device_properties_t* filled by hps_device_get_properties / _init.
 *  - Handles (hps_stream_t*, hps_event_t*) are opaque; the hand-written layer owns
 *    them and calls hps_*_destroy exactly once.
 *
 * A language overlay (bindings/swig/python.i, bindings/swig/java.i) declares the
 * %module, defines the SWIG macro HPS_SWIG_RAISE(status, message) used by the
 * %exception block, and the typemaps; then it %includes this file.
 */

#ifndef HPS_SWIG_RAISE
#error "hpshard.i is included by a language overlay that defines HPS_SWIG_RAISE"
#endif

%{
#include "hpshard/hpshard.h"
%}

/* ---------------------------------------------------------------------------------- */
/* Allow-list: ignore everything, then un-ignore by name.                             */
/* ---------------------------------------------------------------------------------- */
%define %hps_ignoreall %ignore ""; %enddef
%define %hps_unignore %rename("%s") %enddef

%hps_ignoreall

/* Infallible queries (they do not return hps_status_t). */
%hps_unignore hps_status_string;
%hps_unignore hps_last_error_message;
%hps_unignore hps_version_number;
%hps_unignore hps_version_string;

/* Fallible calls: every one returns hps_status_t. */
%hps_unignore hps_dtype_size;
%hps_unignore hps_dtype_name;
%hps_unignore hps_device_count;
%hps_unignore hps_device_properties_init;
%hps_unignore hps_device_get_properties;
%hps_unignore hps_stream_create;
%hps_unignore hps_stream_destroy;
%hps_unignore hps_stream_synchronize;
%hps_unignore hps_stream_wait_event;
%hps_unignore hps_memcpy_async;
%hps_unignore hps_event_create;
%hps_unignore hps_event_destroy;
%hps_unignore hps_event_record;
%hps_unignore hps_event_query;
%hps_unignore hps_event_synchronize;
%hps_unignore hps_host_sync_count_thread;
%hps_unignore hps_host_sync_count_total;
%hps_unignore hps_host_sync_reset;

/* Version macros (hpshard/version.h). */
%hps_unignore HPS_VERSION_MAJOR;
%hps_unignore HPS_VERSION_MINOR;
%hps_unignore HPS_VERSION_PATCH;
%hps_unignore HPS_VERSION_NUMBER;
%hps_unignore HPS_VERSION_STRING;

/* Enums and their values (the *_FORCE32 sentinels stay hidden). */
%hps_unignore hps_status;
%hps_unignore hps_status_t;
%hps_unignore HPS_STATUS_OK;
%hps_unignore HPS_STATUS_INVALID_ARGUMENT;
%hps_unignore HPS_STATUS_OUT_OF_RANGE;
%hps_unignore HPS_STATUS_NOT_FOUND;
%hps_unignore HPS_STATUS_ALREADY_EXISTS;
%hps_unignore HPS_STATUS_FAILED_PRECONDITION;
%hps_unignore HPS_STATUS_UNIMPLEMENTED;
%hps_unignore HPS_STATUS_UNAVAILABLE;
%hps_unignore HPS_STATUS_TIMEOUT;
%hps_unignore HPS_STATUS_ABORTED;
%hps_unignore HPS_STATUS_OUT_OF_MEMORY;
%hps_unignore HPS_STATUS_INTERNAL;
%hps_unignore HPS_STATUS_BACKEND_ERROR;

%hps_unignore hps_dtype;
%hps_unignore hps_dtype_t;
%hps_unignore HPS_DTYPE_FLOAT32;
%hps_unignore HPS_DTYPE_FLOAT64;
%hps_unignore HPS_DTYPE_FLOAT16;
%hps_unignore HPS_DTYPE_BFLOAT16;
%hps_unignore HPS_DTYPE_INT32;
%hps_unignore HPS_DTYPE_INT64;
%hps_unignore HPS_DTYPE_UINT8;

%hps_unignore hps_device_type;
%hps_unignore hps_device_type_t;
%hps_unignore HPS_DEVICE_CPU;
%hps_unignore HPS_DEVICE_CUDA;

/* The device-properties struct: a read-only value object (returned by
 * hps_device_get_properties and hps_device_properties_init, owned by the proxy). */
%hps_unignore hps_device_properties;
%hps_unignore hps_device_properties_t;
%define %hps_property(FIELD)
%hps_unignore hps_device_properties::FIELD;
%immutable hps_device_properties::FIELD;
%noexception hps_device_properties::FIELD;
%enddef
%hps_property(struct_size)
%hps_property(type)
%hps_property(index)
%hps_property(name)
%hps_property(total_memory_bytes)
%hps_property(compute_capability_major)
%hps_property(compute_capability_minor)
%hps_property(multiprocessor_count)
%hps_unignore hps_device_properties::~hps_device_properties;
%noexception hps_device_properties::~hps_device_properties;
/* Created only by the library calls below, never by `new` from the language. */
%nodefaultctor hps_device_properties;

/* ---------------------------------------------------------------------------------- */
/* Errors: one block for every function returning hps_status_t.                       */
/* ---------------------------------------------------------------------------------- */
/* The message is thread-local and valid until the next hpshard call on this thread:
 * it is read right after the call, before anything else can run. */
%exception {
  $action
  if (result != HPS_STATUS_OK) {
    HPS_SWIG_RAISE(result, hps_last_error_message())
  }
}
/* The four infallible queries return no status. */
%noexception hps_status_string;
%noexception hps_last_error_message;
%noexception hps_version_number;
%noexception hps_version_string;

/* ---------------------------------------------------------------------------------- */
/* Binding-side constant: sizeof(hps_device_properties_t) as this binding was built,     */
/* the struct_size to pass to hps_device_properties_init.                              */
/* ---------------------------------------------------------------------------------- */
%hps_unignore HPS_SWIG_PROPERTIES_STRUCT_SIZE;
%constant size_t HPS_SWIG_PROPERTIES_STRUCT_SIZE = sizeof(hps_device_properties_t);

/* The C declarations (the header's HPS_API expands to nothing for SWIG). */
%include "hpshard/version.h"
%include "hpshard/hpshard.h"
