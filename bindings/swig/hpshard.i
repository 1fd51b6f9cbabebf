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
 *  - Handles (hps_stream_t*, hps_event_t*, hps_store_t*, hps_comm_t*, hps_work_t*,
 *    hps_topology_t*, hps_hybrid_group_t*) are opaque; the hand-written layer owns them
 *    and calls hps_*_destroy exactly once. Their out-params (out_store, out_comm,
 *    out_work, out_topology, out_group) become return values; a NULL one (hps_comm_split
 *    on a non-member) is None / null.
 *  - Buffers: collective buffers (send, recv, buffer) are host buffers of the target
 *    language (buffer protocol / direct ByteBuffer; None / null is NULL); the element
 *    counts stay explicit, as in C, and the wrapper refuses (ValueError /
 *    IllegalArgumentException) a count of `dtype` that does not fit its buffer, and a
 *    read-only output. hps_store_set takes bytes; hps_store_get returns bytes (the
 *    OUT_OF_RANGE "too small" protocol is handled in the wrapper); hps_comm_split takes a
 *    sequence / int[] of ranks; hps_topology_group_ranks returns a list / int[] (same
 *    protocol); hps_topology_pipeline_neighbors returns (prev, next).
 *  - Value structs: hps_rendezvous_info_t (read-only, returned by
 *    hps_rendezvous_info_init / hps_rendezvous_from_env) and hps_comm_options_t (returned
 *    by hps_comm_options_init; timeout_ms, check_arguments and name are settable, the
 *    name is copied into memory owned by the proxy).
 *  - Clipping and the engine: hps_clip_t* and hps_engine_t* are opaque handles like the
 *    others (out_clip, out_engine become return values). hps_clip_add_tensor's `data` is a
 *    writable host buffer checked against count and dtype; hps_clip_run's `norm_out` a
 *    writable buffer of at least one float32 (None / null is NULL); hps_engine_gather_parameter's
 *    `out` a writable buffer checked against count float32s. Addresses owned by the
 *    library (hps_engine_param / hps_engine_grad's out_data, hps_clip_coefficient's
 *    out_coefficient, hps_engine_loss_scale's out_scale and out_skipped_steps, as a pair
 *    (scale, skipped) / long[2]) come back as integers (Python int / Java long): the hand-written
 *    layers turn them into NumPy views / direct ByteBuffers of the size they know.
 *    hps_engine_add_param takes a sequence / long[] shape; hps_engine_shard_range returns
 *    (begin, end); hps_dependency_wait_stats returns (count, nanoseconds).
 *    hps_clip_options_t and hps_engine_options_t are value structs returned by their _init
 *    (owned by the proxy); every field but struct_size is settable.
 *  - Devices and transports: hps_comm_device and hps_engine_device return (type, index) /
 *    int[] {type, index} (the type as the raw hps_device_type_t value);
 *    hps_comm_transport returns a str / String (a copy of the library's static name).
 *  - Blocking calls (collective creation, hps_work_wait, hps_store_wait/get) do not hold
 *    the interpreter: the Python module is built with threads="1" (every call but the
 *    four infallible queries releases the GIL), and the error message is read on the
 *    calling thread right after the call.
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

/* Stores and rendezvous. */
%hps_unignore hps_store_open;
%hps_unignore hps_store_destroy;
%hps_unignore hps_store_set;
%hps_unignore hps_store_get;
%hps_unignore hps_store_add;
%hps_unignore hps_store_wait;
%hps_unignore hps_store_check;
%hps_unignore hps_rendezvous_info_init;
%hps_unignore hps_rendezvous_from_env;

/* Communicators and work. */
%hps_unignore hps_comm_options_init;
%hps_unignore hps_comm_create;
%hps_unignore hps_comm_destroy;
%hps_unignore hps_comm_abort;
%hps_unignore hps_comm_rank;
%hps_unignore hps_comm_size;
%hps_unignore hps_comm_device;
%hps_unignore hps_comm_transport;
%hps_unignore hps_comm_set_timeout;
%hps_unignore hps_comm_split;
%hps_unignore hps_comm_all_reduce;
%hps_unignore hps_comm_reduce;
%hps_unignore hps_comm_broadcast;
%hps_unignore hps_comm_all_gather;
%hps_unignore hps_comm_reduce_scatter;
%hps_unignore hps_comm_send;
%hps_unignore hps_comm_recv;
%hps_unignore hps_comm_barrier;
%hps_unignore hps_work_test;
%hps_unignore hps_work_wait;
%hps_unignore hps_work_wait_stream;
%hps_unignore hps_work_destroy;

/* Topology and the hybrid communicate group. */
%hps_unignore hps_topology_create;
%hps_unignore hps_topology_destroy;
%hps_unignore hps_topology_degree;
%hps_unignore hps_topology_coordinate;
%hps_unignore hps_topology_rank_of;
%hps_unignore hps_topology_group_ranks;
%hps_unignore hps_topology_pipeline_neighbors;
%hps_unignore hps_hybrid_group_create;
%hps_unignore hps_hybrid_group_destroy;
%hps_unignore hps_hybrid_group_comm;

/* Hybrid global-norm clipping. */
%hps_unignore hps_clip_options_init;
%hps_unignore hps_clip_create;
%hps_unignore hps_clip_destroy;
%hps_unignore hps_clip_add_tensor;
%hps_unignore hps_clip_seal;
%hps_unignore hps_clip_run;
%hps_unignore hps_clip_coefficient;

/* The sharded training engine. */
%hps_unignore hps_engine_options_init;
%hps_unignore hps_engine_create;
%hps_unignore hps_engine_destroy;
%hps_unignore hps_engine_add_param;
%hps_unignore hps_engine_seal;
%hps_unignore hps_engine_broadcast_parameters;
%hps_unignore hps_engine_param;
%hps_unignore hps_engine_grad;
%hps_unignore hps_engine_wait_parameters;
%hps_unignore hps_engine_release_parameters;
%hps_unignore hps_engine_grad_ready;
%hps_unignore hps_engine_step;
%hps_unignore hps_engine_synchronize;
%hps_unignore hps_engine_gather_parameter;
%hps_unignore hps_engine_device;
%hps_unignore hps_engine_resident_bytes;
%hps_unignore hps_engine_shard_range;
%hps_unignore hps_engine_loss_scale;
%hps_unignore hps_dependency_wait_stats;

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

%hps_unignore hps_reduce_op;
%hps_unignore hps_reduce_op_t;
%hps_unignore HPS_REDUCE_SUM;
%hps_unignore HPS_REDUCE_AVG;
%hps_unignore HPS_REDUCE_MAX;
%hps_unignore HPS_REDUCE_MIN;

%hps_unignore hps_group;
%hps_unignore hps_group_t;
%hps_unignore HPS_GROUP_DP;
%hps_unignore HPS_GROUP_PP;
%hps_unignore HPS_GROUP_SHARDING;
%hps_unignore HPS_GROUP_SEP;
%hps_unignore HPS_GROUP_MP;
%hps_unignore HPS_GROUP_CHECK;
%hps_unignore HPS_GROUP_SHARDING_CHECK;

%hps_unignore hps_clip_flag;
%hps_unignore hps_clip_flag_t;
%hps_unignore HPS_CLIP_DISTRIBUTED;
%hps_unignore HPS_CLIP_NO_CLIP;
%hps_unignore HPS_CLIP_SHARED_NOT_FIRST;

%hps_unignore hps_optimizer;
%hps_unignore hps_optimizer_t;
%hps_unignore HPS_OPTIMIZER_SGD;
%hps_unignore HPS_OPTIMIZER_ADAMW;

%hps_unignore hps_param_flag;
%hps_unignore hps_param_flag_t;
%hps_unignore HPS_PARAM_FROZEN;
%hps_unignore HPS_PARAM_DISTRIBUTED;
%hps_unignore HPS_PARAM_NO_CLIP;
%hps_unignore HPS_PARAM_SHARED_NOT_FIRST;

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

/* The rendezvous info: a read-only value object (returned by hps_rendezvous_info_init and
 * hps_rendezvous_from_env, owned by the proxy). */
%hps_unignore hps_rendezvous_info;
%hps_unignore hps_rendezvous_info_t;
%define %hps_rendezvous_field(FIELD)
%hps_unignore hps_rendezvous_info::FIELD;
%immutable hps_rendezvous_info::FIELD;
%noexception hps_rendezvous_info::FIELD;
%enddef
%hps_rendezvous_field(struct_size)
%hps_rendezvous_field(rank)
%hps_rendezvous_field(world_size)
%hps_rendezvous_field(local_rank)
%hps_rendezvous_field(store_url)
%hps_rendezvous_field(source)
%hps_unignore hps_rendezvous_info::~hps_rendezvous_info;
%noexception hps_rendezvous_info::~hps_rendezvous_info;
%nodefaultctor hps_rendezvous_info;

/* Communicator options: returned by hps_comm_options_init (owned by the proxy), then
 * timeout_ms, check_arguments and name may be set before hps_comm_create. The proxy's
 * struct lives in an hps_swig_comm_options block that also owns a copy of the name (C
 * only keeps the pointer until hps_comm_create copies it); its destructor frees both. */
%hps_unignore hps_comm_options;
%hps_unignore hps_comm_options_t;
%hps_unignore hps_comm_options::struct_size;
%immutable hps_comm_options::struct_size;
%noexception hps_comm_options::struct_size;
%hps_unignore hps_comm_options::timeout_ms;
%noexception hps_comm_options::timeout_ms;
%hps_unignore hps_comm_options::check_arguments;
%noexception hps_comm_options::check_arguments;
%hps_unignore hps_comm_options::name;
%noexception hps_comm_options::name;
%hps_unignore hps_comm_options::~hps_comm_options;
%noexception hps_comm_options::~hps_comm_options;
%nodefaultctor hps_comm_options;
/* Setting the name copies it into the block (arg1: the struct, as in every setter). */
%typemap(memberin) const char* name {
  if (!hps_swig_comm_options_set_name(arg1, $input)) {
    HPS_SWIG_RAISE(HPS_STATUS_OUT_OF_MEMORY, "hps_comm_options_t.name: out of memory")
  }
}
%extend hps_comm_options {
  ~hps_comm_options() { hps_swig_comm_options_free($self); }
}

/* Clip and engine options: returned by hps_clip_options_init / hps_engine_options_init
 * (a malloc'd copy owned by the proxy, freed by its destructor); every field but
 * struct_size may be set before hps_clip_create / hps_engine_create, which take a proxy or
 * None / null (the defaults). */
%define %hps_options_struct(TAG)
%hps_unignore TAG;
%hps_unignore TAG##_t;
%hps_unignore TAG::struct_size;
%immutable TAG::struct_size;
%noexception TAG::struct_size;
%hps_unignore TAG::~TAG;
%noexception TAG::~TAG;
%nodefaultctor TAG;
%extend TAG {
  ~TAG() { free($self); }
}
%enddef
%define %hps_options_field(TAG, FIELD)
%hps_unignore TAG::FIELD;
%noexception TAG::FIELD;
%enddef
%hps_options_struct(hps_clip_options)
%hps_options_field(hps_clip_options, max_norm)
%hps_options_field(hps_clip_options, deterministic)
%hps_options_struct(hps_engine_options)
%hps_options_field(hps_engine_options, stage)
%hps_options_field(hps_engine_options, optimizer)
%hps_options_field(hps_engine_options, learning_rate)
%hps_options_field(hps_engine_options, momentum)
%hps_options_field(hps_engine_options, weight_decay)
%hps_options_field(hps_engine_options, nesterov)
%hps_options_field(hps_engine_options, beta1)
%hps_options_field(hps_engine_options, beta2)
%hps_options_field(hps_engine_options, epsilon)
%hps_options_field(hps_engine_options, clip_max_norm)
%hps_options_field(hps_engine_options, deterministic_clip)
%hps_options_field(hps_engine_options, accumulation_steps)
%hps_options_field(hps_engine_options, alignment_bytes)
%hps_options_field(hps_engine_options, prefetch_window)
%hps_options_field(hps_engine_options, dynamic_loss_scaling)
%hps_options_field(hps_engine_options, initial_loss_scale)
%hps_options_field(hps_engine_options, growth_factor)
%hps_options_field(hps_engine_options, backoff_factor)
%hps_options_field(hps_engine_options, growth_interval)

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

%{
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

/* ---- hps_comm_options_t proxies: the struct plus the copy of its name. ---- */
typedef struct hps_swig_comm_options {
  hps_comm_options_t options; /* first: the proxy points here */
  char* name_copy;
} hps_swig_comm_options;

/* A new block holding a copy of `init` (name included), or NULL without memory. */
static hps_comm_options_t* hps_swig_comm_options_new(const hps_comm_options_t* init) {
  hps_swig_comm_options* block = (hps_swig_comm_options*)calloc(1, sizeof *block);
  if (!block) return NULL;
  block->options = *init;
  if (init->name) {
    block->name_copy = (char*)malloc(strlen(init->name) + 1);
    if (!block->name_copy) { free(block); return NULL; }
    strcpy(block->name_copy, init->name);
    block->options.name = block->name_copy;
  }
  return &block->options;
}

static int hps_swig_comm_options_set_name(hps_comm_options_t* options, const char* name) {
  hps_swig_comm_options* block = (hps_swig_comm_options*)options;
  char* copy = NULL;
  if (name) {
    copy = (char*)malloc(strlen(name) + 1);
    if (!copy) return 0;
    strcpy(copy, name);
  }
  free(block->name_copy);
  block->name_copy = copy;
  block->options.name = copy;
  return 1;
}

static void hps_swig_comm_options_free(hps_comm_options_t* options) {
  hps_swig_comm_options* block = (hps_swig_comm_options*)options;
  if (!block) return;
  free(block->name_copy);
  free(block);
}

/* ---- clip / engine options proxies: a malloc'd copy, freed by the proxy. ---- */
static void* hps_swig_memdup(const void* init, size_t size) {
  void* copy = malloc(size);
  if (copy) memcpy(copy, init, size);
  return copy;
}

/* ---- collective buffers ---- */
/* 1 when `count` elements of `dtype` fit in the `nbytes` bytes at `ptr`, else 0 with a
 * message in msg. A NULL buffer and an unknown dtype pass: the library refuses them
 * itself, with its own status and message. */
static int hps_swig_fits(const char* func, const char* what, const void* ptr, long long nbytes,
                         uint64_t count, hps_dtype_t dtype, char* msg, size_t msg_size) {
  size_t elem = 0;
  if (!ptr) return 1;
  if (hps_dtype_size(dtype, &elem) != HPS_STATUS_OK || elem == 0) return 1;
  if (nbytes >= 0 && count <= (uint64_t)nbytes / elem) return 1;
  snprintf(msg, msg_size, "%s: %s holds %lld bytes, too few for %llu elements of %zu bytes",
           func, what, nbytes, (unsigned long long)count, elem);
  return 0;
}

/* Grows a malloc'd array of `*capacity` elements of `elem` bytes to `need`; 0 without
 * memory (the array is left as it was). */
static int hps_swig_grow(void** array, size_t* capacity, size_t need, size_t elem) {
  void* p = realloc(*array, (need ? need : 1) * elem);
  if (!p) return 0;
  *array = p;
  *capacity = need;
  return 1;
}
%}

/* Collectives: the buffer typemaps of the overlays keep each buffer's size in bytes in a
 * local hps_nbytes<argument number>; argument numbers are fixed by the C signatures. */
%define HPS_SWIG_FITS(FUNC, WHAT, PTR, NBYTES, COUNT, DTYPE)
  if (!hps_swig_fits(FUNC, WHAT, PTR, (long long)NBYTES, (uint64_t)COUNT, DTYPE, hps_msg,
                     sizeof hps_msg)) {
    HPS_SWIG_BUFFER_FAIL(hps_msg)
  }
%enddef
%define HPS_SWIG_COLLECTIVE1(FUNC, B1, N1, C1, DTYPE)
%exception FUNC {
  {
    char hps_msg[256];
    HPS_SWIG_FITS(#FUNC, "the buffer", B1, N1, C1, DTYPE)
  }
  $action
  if (result != HPS_STATUS_OK) {
    HPS_SWIG_RAISE(result, hps_last_error_message())
  }
}
%enddef
%define HPS_SWIG_COLLECTIVE2(FUNC, B1, N1, C1, B2, N2, C2, DTYPE)
%exception FUNC {
  {
    char hps_msg[256];
    HPS_SWIG_FITS(#FUNC, "send", B1, N1, C1, DTYPE)
    HPS_SWIG_FITS(#FUNC, "recv", B2, N2, C2, DTYPE)
  }
  $action
  if (result != HPS_STATUS_OK) {
    HPS_SWIG_RAISE(result, hps_last_error_message())
  }
}
%enddef
/* (comm, send, recv, count, dtype, ...) */
HPS_SWIG_COLLECTIVE2(hps_comm_all_reduce, arg2, hps_nbytes2, arg4, arg3, hps_nbytes3, arg4, arg5)
HPS_SWIG_COLLECTIVE2(hps_comm_reduce, arg2, hps_nbytes2, arg4, arg3, hps_nbytes3, arg4, arg5)
/* (comm, send, send_count, recv, recv_count, dtype, ...) */
HPS_SWIG_COLLECTIVE2(hps_comm_all_gather, arg2, hps_nbytes2, arg3, arg4, hps_nbytes4, arg5, arg6)
HPS_SWIG_COLLECTIVE2(hps_comm_reduce_scatter, arg2, hps_nbytes2, arg3, arg4, hps_nbytes4, arg5, arg6)
/* (comm, buffer, count, dtype, ...) */
HPS_SWIG_COLLECTIVE1(hps_comm_broadcast, arg2, hps_nbytes2, arg3, arg4)
HPS_SWIG_COLLECTIVE1(hps_comm_send, arg2, hps_nbytes2, arg3, arg4)
HPS_SWIG_COLLECTIVE1(hps_comm_recv, arg2, hps_nbytes2, arg3, arg4)
/* (clip, data, count, dtype, flags) */
HPS_SWIG_COLLECTIVE1(hps_clip_add_tensor, arg2, hps_nbytes2, arg3, arg4)
/* (clip, stream, norm_out, scale): one float32 */
HPS_SWIG_COLLECTIVE1(hps_clip_run, arg3, hps_nbytes3, 1, HPS_DTYPE_FLOAT32)
/* (engine, index, out, count): count float32 */
HPS_SWIG_COLLECTIVE1(hps_engine_gather_parameter, arg3, hps_nbytes3, arg4, HPS_DTYPE_FLOAT32)

/* Outputs of unknown size: the overlays' typemaps start with a malloc'd array (arg4) of
 * arg5 elements; on OUT_OF_RANGE with a larger *arg6 the array grows and the call is
 * repeated (a value may grow between calls). Temporary arrays are freed before raising
 * (the Java overlay's raise returns at once, skipping freearg). */
%define HPS_SWIG_GROWING(FUNC, ELEM)
%exception FUNC {
  for (;;) {
    *arg6 = 0;
    $action
    if (result == HPS_STATUS_OUT_OF_RANGE && *arg6 > arg5) {
      void* hps_array = (void*)arg4;
      size_t hps_cap = arg5;
      if (!hps_swig_grow(&hps_array, &hps_cap, *arg6, ELEM)) {
        free((void*)arg4); arg4 = NULL;
        HPS_SWIG_RAISE(HPS_STATUS_OUT_OF_MEMORY, #FUNC ": out of memory")
      }
      memcpy(&arg4, &hps_array, sizeof hps_array); /* void* or int32_t* */
      arg5 = hps_cap;
      continue;
    }
    break;
  }
  if (result != HPS_STATUS_OK) {
    free((void*)arg4); arg4 = NULL;
    HPS_SWIG_RAISE(result, hps_last_error_message())
  }
}
%enddef
HPS_SWIG_GROWING(hps_store_get, 1)
HPS_SWIG_GROWING(hps_topology_group_ranks, sizeof(int32_t))

/* Inputs copied into malloc'd arrays (hps_store_set's value: arg3; hps_comm_split's ranks:
 * arg2; hps_engine_add_param's shape: arg3) are freed before raising, for the same reason. */
%define HPS_SWIG_FREEING(FUNC, ARG)
%exception FUNC {
  $action
  if (result != HPS_STATUS_OK) {
    free((void*)ARG); ARG = NULL;
    HPS_SWIG_RAISE(result, hps_last_error_message())
  }
}
%enddef
HPS_SWIG_FREEING(hps_store_set, arg3)
HPS_SWIG_FREEING(hps_comm_split, arg2)
HPS_SWIG_FREEING(hps_engine_add_param, arg3)
/* SWIG casts a const pointer argument to its resolved type (int64_t is `long long` to
 * SWIG, `long` to an LP64 compiler): call hps_engine_add_param with the header's types. */
%feature("action") hps_engine_add_param {
  result = hps_engine_add_param(arg1, (const char*)arg2, (const int64_t*)arg3, arg4, arg5,
                                arg6, arg7, arg8);
}

/* ---------------------------------------------------------------------------------- */
/* Binding-side constant: sizeof(hps_device_properties_t) as this binding was built,     */
/* the struct_size to pass to hps_device_properties_init.                              */
/* ---------------------------------------------------------------------------------- */
%hps_unignore HPS_SWIG_PROPERTIES_STRUCT_SIZE;
%constant size_t HPS_SWIG_PROPERTIES_STRUCT_SIZE = sizeof(hps_device_properties_t);
/* ... and of hps_rendezvous_info_t and hps_comm_options_t (for their _init calls). */
%hps_unignore HPS_SWIG_RENDEZVOUS_STRUCT_SIZE;
%constant size_t HPS_SWIG_RENDEZVOUS_STRUCT_SIZE = sizeof(hps_rendezvous_info_t);
%hps_unignore HPS_SWIG_COMM_OPTIONS_STRUCT_SIZE;
%constant size_t HPS_SWIG_COMM_OPTIONS_STRUCT_SIZE = sizeof(hps_comm_options_t);
/* ... and of hps_clip_options_t and hps_engine_options_t. */
%hps_unignore HPS_SWIG_CLIP_OPTIONS_STRUCT_SIZE;
%constant size_t HPS_SWIG_CLIP_OPTIONS_STRUCT_SIZE = sizeof(hps_clip_options_t);
%hps_unignore HPS_SWIG_ENGINE_OPTIONS_STRUCT_SIZE;
%constant size_t HPS_SWIG_ENGINE_OPTIONS_STRUCT_SIZE = sizeof(hps_engine_options_t);

/* The C declarations (the header's HPS_API expands to nothing for SWIG). */
%include "hpshard/version.h"
%include "hpshard/hpshard.h"
