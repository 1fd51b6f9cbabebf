/*
 * hpshard.i — the SWIG interface shared by the Python and Java bindings.
 *
 * It wraps ONLY the C API (hpshard/hpshard.h), by allow-list: everything is ignored first;
 * what is exposed is what this file declares.
 *
 *  - Each handle (hps_stream_t, hps_event_t, hps_store_t, hps_comm_t, hps_work_t,
 *    hps_topology_t, hps_hybrid_group_t, hps_clip_t, hps_engine_t, hps_checkpoint_t) and
 *    DLManagedTensor is
 *    a class whose methods are the C functions taking it first, written once below in
 *    %extend blocks, one line each: `int32_t rank() { ... hps_comm_rank($self, &v) ... }`.
 *    Creating functions are static methods (hps_comm.create, hps_store.open); their
 *    results, and every handle a method returns, are owned by the proxy, whose destructor
 *    calls hps_*_destroy exactly once. Python names are the C names without the handle
 *    prefix (rank, all_reduce_dlpack); Java ones the same in lowerCamelCase (allReduceDlpack).
 *  - Free functions (dtype, device, host-sync, rendezvous, options and checkpoint-file
 *    calls) are module functions named as in C without "hps_" (dtype_size; Java
 *    dtypeSize).
 *  - A method returns what the C call hands back through its out-param(s); the C status
 *    goes into hps_swig_status, and one %exception block turns a failing status into a
 *    language exception carrying the status and hps_last_error_message() (read right
 *    after the call, on the calling thread). Several outputs come back as one of a few
 *    value types (hps_swig_pair, hps_swig_ints, hps_swig_bytes) that each overlay maps
 *    once (a tuple / list / bytes; long[] / int[] / byte[]).
 *  - Buffers: the raw-pointer calls take buffers of the language (hps_swig_in_buffer /
 *    hps_swig_out_buffer: a C-contiguous buffer-protocol object / a direct ByteBuffer,
 *    None / null for NULL); the element counts stay explicit as in C, and a count of
 *    `dtype` that does not fit, or a read-only output, is refused (ValueError /
 *    IllegalArgumentException) before the library is called. The *_dlpack calls take
 *    `const DLTensor*`: a "dltensor" PyCapsule (from any __dlpack__) / a DLManagedTensor.
 *    DLPack views handed out come back as "dltensor" capsules (Python) / owned
 *    DLManagedTensor proxies (Java). A checkpoint's metadata goes in as one flat sequence
 *    of strings, key, value, key, value... (a Python sequence of str / a Java String[]).
 *  - Options and info structs are value objects owned by their proxy (made by their
 *    _init / the calls filling them, with the struct_size given), fields settable except
 *    struct_size and the info structs' fields.
 *  - Blocking calls do not hold the Python interpreter (threads="1").
 *
 * Adding a C function taking a handle: one line in that handle's %extend block (and the
 * hand-written layers' method, see CONTRIBUTING.md). A language overlay (python.i,
 * java.i) declares the %module, defines HPS_SWIG_RAISE(status, message), the typemaps of
 * the value types and buffers, and the naming rules; then it %includes this file.
 */

#ifndef HPS_SWIG_RAISE
#error "hpshard.i is included by a language overlay that defines HPS_SWIG_RAISE"
#endif

%{
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "hpshard/hpshard.h"

/* The status of the last call made by a wrapper on this thread; the %exception block
 * raises when it is not OK. HPS_SWIG_ARGUMENT_ERROR: the binding refused an argument
 * itself (a buffer too small), with hps_swig_message. */
#define HPS_SWIG_ARGUMENT_ERROR ((hps_status_t)-1)
static __thread hps_status_t hps_swig_status;
static __thread char hps_swig_message[256];
#define HPS_SWIG_CHECK(call) (hps_swig_status = (call))

static const char* hps_swig_error_message(hps_status_t status) {
  return status == HPS_SWIG_ARGUMENT_ERROR ? hps_swig_message : hps_last_error_message();
}

/* Two values (begin/end, type/index, prev/next, count/nanoseconds). */
typedef struct hps_swig_pair {
  int64_t first;
  int64_t second;
} hps_swig_pair;
static hps_swig_pair hps_swig_make_pair(int64_t first, int64_t second) {
  hps_swig_pair p;
  p.first = first;
  p.second = second;
  return p;
}

/* A malloc'd array of int32 (rank lists) and of bytes (store values): the overlay's out
 * typemap copies and frees it. */
typedef struct hps_swig_ints {
  int32_t* data;
  size_t count;
} hps_swig_ints;
typedef struct hps_swig_bytes {
  char* data;
  size_t size;
} hps_swig_bytes;

/* A buffer of the target language: its address and size in bytes (-1: unknown). */
typedef struct hps_swig_in_buffer {
  const void* data;
  long long nbytes;
} hps_swig_in_buffer;
typedef struct hps_swig_out_buffer {
  void* data;
  long long nbytes;
} hps_swig_out_buffer;

/* 1 when `count` elements of `dtype` fit in `b`, else 0 with an argument error. A NULL
 * buffer and an unknown dtype pass: the library refuses them itself. */
static int hps_swig_fits(const char* function, const char* what, const void* data,
                         long long nbytes, uint64_t count, hps_dtype_t dtype) {
  size_t element = 0;
  if (!data) return 1;
  if (hps_dtype_size(dtype, &element) != HPS_STATUS_OK || element == 0) return 1;
  if (nbytes >= 0 && count <= (uint64_t)nbytes / element) return 1;
  snprintf(hps_swig_message, sizeof hps_swig_message,
           "%s: %s holds %lld bytes, too few for %llu elements of %zu bytes", function, what,
           nbytes, (unsigned long long)count, element);
  hps_swig_status = HPS_SWIG_ARGUMENT_ERROR;
  return 0;
}
#define HPS_SWIG_FITS(what, b, count, dtype) \
  hps_swig_fits(__func__, what, (b).data, (b).nbytes, (uint64_t)(count), dtype)

/* The address `call_with_out` hands back in a pointer v, as an integer. */
#define HPS_SWIG_ADDRESS(T, call_with_out) \
  T v = NULL;                              \
  HPS_SWIG_CHECK(call_with_out);           \
  return (uintptr_t)v

/* The value of `call`'s output of type T, or a zero T when it failed. */
#define HPS_SWIG_GET(T, call_with_out) \
  T v;                                 \
  memset(&v, 0, sizeof v);             \
  HPS_SWIG_CHECK(call_with_out);       \
  return v

/* A malloc'd struct of at least sizeof(T) and `struct_size` bytes, zeroed, or NULL. */
static void* hps_swig_struct_alloc(size_t size, size_t struct_size) {
  size_t n = struct_size > size ? struct_size : size;
  if (n > 65536) n = size; /* the library refuses such a struct_size */
  return calloc(1, n);
}

/* Communicator options: the struct followed by the copy of its name it owns. */
typedef struct hps_swig_comm_options {
  hps_comm_options_t options; /* first: the proxy points here */
  char* name_copy;
} hps_swig_comm_options;

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
%}

/* ---------------------------------------------------------------------------------- */
/* Allow-list: ignore everything, then expose by name (members of exposed classes are   */
/* exposed with them).                                                                  */
/* ---------------------------------------------------------------------------------- */
%ignore "";
%rename("%s", %$ismember) "";
%define %hps_expose %rename("%s") %enddef
#ifdef SWIGJAVA
%rename("%(lowercamelcase)s", %$ismember, %$isfunction) "";
%define %hps_free(NAME) %rename("%(lowercamelcase)s") NAME; %enddef
#else
%define %hps_free(NAME) %hps_expose NAME; %enddef
#endif

/* The four infallible queries keep their C names. */
%hps_expose hps_status_string;
%hps_expose hps_last_error_message;
%hps_expose hps_version_number;
%hps_expose hps_version_string;

/* Version macros and enum values (the *_FORCE32 sentinels stay hidden). */
%hps_expose HPS_VERSION_MAJOR;
%hps_expose HPS_VERSION_MINOR;
%hps_expose HPS_VERSION_PATCH;
%hps_expose HPS_VERSION_NUMBER;
%hps_expose HPS_VERSION_STRING;
%rename("%s", regextarget=1, notregexmatch$name="FORCE32$") "^HPS_(STATUS|DTYPE|DEVICE|REDUCE|GROUP|CLIP|OPTIMIZER|PARAM)_";
%rename("%s", regextarget=1) "^hps_(status|dtype|device_type|reduce_op|group|clip_flag|optimizer|param_flag)(_t)?$";

/* The error of every wrapped call. */
%exception {
  hps_swig_status = HPS_STATUS_OK;
  $action
  if (hps_swig_status != HPS_STATUS_OK) {
    HPS_SWIG_RAISE(hps_swig_status, hps_swig_error_message(hps_swig_status))
  }
}

/* Value types and buffers: mapped by each overlay. */
typedef struct hps_swig_pair hps_swig_pair;
typedef struct hps_swig_ints hps_swig_ints;
typedef struct hps_swig_bytes hps_swig_bytes;
typedef struct hps_swig_in_buffer hps_swig_in_buffer;
typedef struct hps_swig_out_buffer hps_swig_out_buffer;

/* ---------------------------------------------------------------------------------- */
/* Free functions                                                                       */
/* ---------------------------------------------------------------------------------- */
%hps_free(dtype_size)
%hps_free(dtype_name)
%hps_free(device_count)
%hps_free(device_properties_init)
%hps_free(device_get_properties)
%hps_free(host_sync_count_thread)
%hps_free(host_sync_count_total)
%hps_free(host_sync_reset)
%hps_free(rendezvous_info_init)
%hps_free(rendezvous_from_env)
%hps_free(comm_options_init)
%hps_free(clip_options_init)
%hps_free(engine_options_init)
%hps_free(dependency_wait_stats)
%hps_free(dlpack_host_data)
%hps_free(properties_struct_size)
%hps_free(rendezvous_struct_size)
%hps_free(comm_options_struct_size)
%hps_free(clip_options_struct_size)
%hps_free(engine_options_struct_size)
%hps_free(checkpoint_options_init)
%hps_free(checkpoint_load_options_init)
%hps_free(checkpoint_info_init)
%hps_free(checkpoint_options_struct_size)
%hps_free(checkpoint_load_options_struct_size)
%hps_free(checkpoint_info_struct_size)
%hps_free(checkpoint_inspect)
%hps_free(checkpoint_verify)
%hps_free(checkpoint_read_engine_options)
%hps_free(checkpoint_export_safetensors)
%newobject device_properties_init;
%newobject device_get_properties;
%newobject rendezvous_info_init;
%newobject rendezvous_from_env;
%newobject comm_options_init;
%newobject clip_options_init;
%newobject engine_options_init;
%newobject checkpoint_options_init;
%newobject checkpoint_load_options_init;
%newobject checkpoint_info_init;
%newobject checkpoint_inspect;

%inline %{
static size_t dtype_size(hps_dtype_t dtype) { HPS_SWIG_GET(size_t, hps_dtype_size(dtype, &v)); }
static const char* dtype_name(hps_dtype_t dtype) { HPS_SWIG_GET(const char*, hps_dtype_name(dtype, &v)); }
static int32_t device_count(hps_device_type_t type) { HPS_SWIG_GET(int32_t, hps_device_count(type, &v)); }
static uint64_t host_sync_count_thread(void) { HPS_SWIG_GET(uint64_t, hps_host_sync_count_thread(&v)); }
static uint64_t host_sync_count_total(void) { HPS_SWIG_GET(uint64_t, hps_host_sync_count_total(&v)); }
static void host_sync_reset(void) { HPS_SWIG_CHECK(hps_host_sync_reset()); }
static hps_swig_pair dependency_wait_stats(void) {
  uint64_t count = 0, ns = 0;
  HPS_SWIG_CHECK(hps_dependency_wait_stats(&count, &ns));
  return hps_swig_make_pair((int64_t)count, (int64_t)ns);
}

/* sizeof each struct as this binding was built: the struct_size to pass to its _init. */
static size_t properties_struct_size(void) { return sizeof(hps_device_properties_t); }
static size_t rendezvous_struct_size(void) { return sizeof(hps_rendezvous_info_t); }
static size_t comm_options_struct_size(void) { return sizeof(hps_comm_options_t); }
static size_t clip_options_struct_size(void) { return sizeof(hps_clip_options_t); }
static size_t engine_options_struct_size(void) { return sizeof(hps_engine_options_t); }
static size_t checkpoint_options_struct_size(void) { return sizeof(hps_checkpoint_options_t); }
static size_t checkpoint_load_options_struct_size(void) { return sizeof(hps_checkpoint_load_options_t); }
static size_t checkpoint_info_struct_size(void) { return sizeof(hps_checkpoint_info_t); }

/* New structs initialised with `struct_size` (owned by the proxy). */
static hps_device_properties_t* device_properties_init(size_t struct_size) {
  hps_device_properties_t* p =
      (hps_device_properties_t*)hps_swig_struct_alloc(sizeof *p, struct_size);
  if (p && HPS_SWIG_CHECK(hps_device_properties_init(p, struct_size)) != HPS_STATUS_OK) {
    free(p);
    p = NULL;
  }
  return p;
}
static hps_device_properties_t* device_get_properties(hps_device_type_t type, int32_t index) {
  hps_device_properties_t* p = device_properties_init(sizeof *p);
  if (p && HPS_SWIG_CHECK(hps_device_get_properties(type, index, p)) != HPS_STATUS_OK) {
    free(p);
    p = NULL;
  }
  return p;
}
static hps_rendezvous_info_t* rendezvous_info_init(size_t struct_size) {
  hps_rendezvous_info_t* p = (hps_rendezvous_info_t*)hps_swig_struct_alloc(sizeof *p, struct_size);
  if (p && HPS_SWIG_CHECK(hps_rendezvous_info_init(p, struct_size)) != HPS_STATUS_OK) {
    free(p);
    p = NULL;
  }
  return p;
}
static hps_rendezvous_info_t* rendezvous_from_env(void) {
  hps_rendezvous_info_t* p = rendezvous_info_init(sizeof *p);
  if (p && HPS_SWIG_CHECK(hps_rendezvous_from_env(p)) != HPS_STATUS_OK) {
    free(p);
    p = NULL;
  }
  return p;
}
static hps_comm_options_t* comm_options_init(size_t struct_size) {
  hps_swig_comm_options* b = (hps_swig_comm_options*)calloc(1, sizeof *b);
  if (b && HPS_SWIG_CHECK(hps_comm_options_init(&b->options, struct_size)) != HPS_STATUS_OK) {
    free(b);
    b = NULL;
  }
  return b ? &b->options : NULL;
}
static hps_clip_options_t* clip_options_init(size_t struct_size) {
  hps_clip_options_t* p = (hps_clip_options_t*)hps_swig_struct_alloc(sizeof *p, struct_size);
  if (p && HPS_SWIG_CHECK(hps_clip_options_init(p, struct_size)) != HPS_STATUS_OK) {
    free(p);
    p = NULL;
  }
  return p;
}
static hps_engine_options_t* engine_options_init(size_t struct_size) {
  hps_engine_options_t* p = (hps_engine_options_t*)hps_swig_struct_alloc(sizeof *p, struct_size);
  if (p && HPS_SWIG_CHECK(hps_engine_options_init(p, struct_size)) != HPS_STATUS_OK) {
    free(p);
    p = NULL;
  }
  return p;
}
static hps_checkpoint_options_t* checkpoint_options_init(size_t struct_size) {
  hps_checkpoint_options_t* p = (hps_checkpoint_options_t*)hps_swig_struct_alloc(sizeof *p, struct_size);
  if (p && HPS_SWIG_CHECK(hps_checkpoint_options_init(p, struct_size)) != HPS_STATUS_OK) {
    free(p);
    p = NULL;
  }
  return p;
}
static hps_checkpoint_load_options_t* checkpoint_load_options_init(size_t struct_size) {
  hps_checkpoint_load_options_t* p = (hps_checkpoint_load_options_t*)hps_swig_struct_alloc(sizeof *p, struct_size);
  if (p && HPS_SWIG_CHECK(hps_checkpoint_load_options_init(p, struct_size)) != HPS_STATUS_OK) {
    free(p);
    p = NULL;
  }
  return p;
}
static hps_checkpoint_info_t* checkpoint_info_init(size_t struct_size) {
  hps_checkpoint_info_t* p = (hps_checkpoint_info_t*)hps_swig_struct_alloc(sizeof *p, struct_size);
  if (p && HPS_SWIG_CHECK(hps_checkpoint_info_init(p, struct_size)) != HPS_STATUS_OK) {
    free(p);
    p = NULL;
  }
  return p;
}

/* Checkpoint files (no handle). */
static hps_checkpoint_info_t* checkpoint_inspect(const char* path) {
  hps_checkpoint_info_t* p = checkpoint_info_init(sizeof *p);
  if (p && HPS_SWIG_CHECK(hps_checkpoint_inspect(path, p)) != HPS_STATUS_OK) {
    free(p);
    p = NULL;
  }
  return p;
}
static void checkpoint_verify(const char* path) { HPS_SWIG_CHECK(hps_checkpoint_verify(path)); }
/* Fills `options` (made by engine_options_init) with the options the checkpoint records. */
static void checkpoint_read_engine_options(const char* path, hps_engine_options_t* options) { HPS_SWIG_CHECK(hps_checkpoint_read_engine_options(path, options)); }
static void checkpoint_export_safetensors(const char* path, const char* out, int32_t fp32) { HPS_SWIG_CHECK(hps_checkpoint_export_safetensors(path, out, fp32)); }
%}

/* The host/device policy of the C layer (hps_dlpack_host_data): the host address of a
 * tensor's data. */
%inline %{
static uintptr_t dlpack_host_data(const DLTensor* tensor) {
  HPS_SWIG_ADDRESS(void*, hps_dlpack_host_data(tensor, &v));
}
%}

/* ---------------------------------------------------------------------------------- */
/* Value structs (owned by their proxies).                                               */
/* ---------------------------------------------------------------------------------- */
%define %hps_value_struct(TAG, FREE)
%hps_expose TAG;
%hps_expose TAG##_t;
%nodefaultctor TAG;
%immutable TAG::struct_size;
%extend TAG {
  ~TAG() { FREE($self); }
}
%enddef
%hps_value_struct(hps_device_properties, free)
%immutable hps_device_properties::type;
%immutable hps_device_properties::index;
%immutable hps_device_properties::name;
%immutable hps_device_properties::total_memory_bytes;
%immutable hps_device_properties::compute_capability_major;
%immutable hps_device_properties::compute_capability_minor;
%immutable hps_device_properties::multiprocessor_count;
%hps_value_struct(hps_rendezvous_info, free)
%immutable hps_rendezvous_info::rank;
%immutable hps_rendezvous_info::world_size;
%immutable hps_rendezvous_info::local_rank;
%immutable hps_rendezvous_info::store_url;
%immutable hps_rendezvous_info::source;
%{
static void hps_swig_comm_options_free(hps_comm_options_t* options) {
  hps_swig_comm_options* block = (hps_swig_comm_options*)options;
  if (!block) return;
  free(block->name_copy);
  free(block);
}
%}
%hps_value_struct(hps_comm_options, hps_swig_comm_options_free)
/* Setting the name copies it into the block (arg1: the struct, as in every setter). */
%typemap(memberin) const char* name {
  if (!hps_swig_comm_options_set_name(arg1, $input)) {
    HPS_SWIG_RAISE(HPS_STATUS_OUT_OF_MEMORY, "hps_comm_options_t.name: out of memory")
  }
}
%hps_value_struct(hps_clip_options, free)
%hps_value_struct(hps_engine_options, free)
%hps_value_struct(hps_checkpoint_options, free)
%hps_value_struct(hps_checkpoint_load_options, free)
%hps_value_struct(hps_checkpoint_info, free)
%immutable hps_checkpoint_info::format_version;
%immutable hps_checkpoint_info::stage;
%immutable hps_checkpoint_info::sharding;
%immutable hps_checkpoint_info::dp;
%immutable hps_checkpoint_info::world;
%immutable hps_checkpoint_info::files;
%immutable hps_checkpoint_info::tensors;
%immutable hps_checkpoint_info::bytes;
%immutable hps_checkpoint_info::created_unix_ns;
%immutable hps_checkpoint_info::id;
%immutable hps_checkpoint_info::name;

/* ---------------------------------------------------------------------------------- */
/* Handles                                                                              */
/* ---------------------------------------------------------------------------------- */
/* Each handle is a class of its own name (StreamHandle, ...) over the C struct: SWIG names
 * the C helper of a method CLASS_METHOD, which for the C struct's own name would be the C
 * function itself (hps_comm_rank). */
%define %hps_handle(CLASS)
%hps_expose CLASS;
%nodefaultctor CLASS;
struct CLASS {};
%enddef
/* The class names are the C structs' in the wrapper code; in C, `struct hps_comm` and a
 * typedef named hps_comm may coexist, so the names work with and without `struct`. */
%{
#define StreamHandle hps_stream
#define EventHandle hps_event
#define StoreHandle hps_store
#define CommHandle hps_comm
#define WorkHandle hps_work
#define TopologyHandle hps_topology
#define HybridGroupHandle hps_hybrid_group
#define ClipHandle hps_clip
#define EngineHandle hps_engine
#define CheckpointHandle hps_checkpoint
#define TensorHandle DLManagedTensor
typedef struct hps_stream hps_stream;
typedef struct hps_event hps_event;
typedef struct hps_store hps_store;
typedef struct hps_comm hps_comm;
typedef struct hps_work hps_work;
typedef struct hps_topology hps_topology;
typedef struct hps_hybrid_group hps_hybrid_group;
typedef struct hps_clip hps_clip;
typedef struct hps_engine hps_engine;
typedef struct hps_checkpoint hps_checkpoint;

/* A checkpoint's metadata as the overlays' typemaps build it: one block of 2 * count
 * malloc'd strings, the keys then the values. */
static void hps_swig_free_strings(const void* keys, size_t count) {
  char** block = (char**)keys;
  size_t i;
  if (!block) return;
  for (i = 0; i < 2 * count; ++i) free(block[i]);
  free(block);
}
%}
%hps_handle(StreamHandle)
%hps_handle(EventHandle)
%hps_handle(StoreHandle)
%hps_handle(CommHandle)
%hps_handle(WorkHandle)
%hps_handle(TopologyHandle)
%hps_handle(HybridGroupHandle)
%hps_handle(ClipHandle)
%hps_handle(EngineHandle)
%hps_handle(CheckpointHandle)
%hps_handle(TensorHandle)

/* compute_stream takes a StreamHandle (the engine keeps the stream alive). */
%ignore hps_engine_options::compute_stream;
%extend hps_engine_options {
  void set_compute_stream(StreamHandle* stream) { $self->compute_stream = stream; }
  int32_t has_compute_stream() { return $self->compute_stream != NULL; }
}
/* Handles a method creates are owned by their proxy. */
%newobject StreamHandle::create;
%newobject EventHandle::create;
%newobject StoreHandle::open;
%newobject CommHandle::create;
%newobject CommHandle::split;
%newobject HybridGroupHandle::comm;
%newobject TopologyHandle::create;
%newobject HybridGroupHandle::create;
%newobject ClipHandle::create;
%newobject EngineHandle::create;
%newobject CheckpointHandle::create;
%newobject CheckpointHandle::save;
%newobject *::all_reduce;
%newobject *::reduce;
%newobject *::broadcast;
%newobject *::all_gather;
%newobject *::reduce_scatter;
%newobject *::send;
%newobject *::recv;
%newobject *::barrier;
%newobject *::all_reduce_dlpack;
%newobject *::reduce_dlpack;
%newobject *::broadcast_dlpack;
%newobject *::all_gather_dlpack;
%newobject *::reduce_scatter_dlpack;
%newobject *::send_dlpack;
%newobject *::recv_dlpack;
%newobject *::coefficient_dlpack;
%newobject *::param_dlpack;
%newobject *::grad_dlpack;
%newobject *::loss_scale_dlpack;
%newobject *::grad_norm_dlpack;
%newobject *::skipped_steps_dlpack;

/* Inputs copied into malloc'd arrays (StoreHandle::set's value, CommHandle::split's ranks,
 * EngineHandle::add_param's shape) are freed before raising: the Java overlay's raise returns
 * at once, skipping freearg. */
%define %hps_freeing(METHOD, ARG)
%exception METHOD {
  hps_swig_status = HPS_STATUS_OK;
  $action
  if (hps_swig_status != HPS_STATUS_OK) {
    free((void*)ARG); ARG = NULL;
    HPS_SWIG_RAISE(hps_swig_status, hps_swig_error_message(hps_swig_status))
  }
}
%enddef
%hps_freeing(StoreHandle::set, arg3)
%hps_freeing(CommHandle::split, arg2)
%hps_freeing(EngineHandle::add_param, arg3)
/* The metadata block (keys at arg3, count at arg5): freed before raising, as above. */
%exception CheckpointHandle::save {
  hps_swig_status = HPS_STATUS_OK;
  $action
  if (hps_swig_status != HPS_STATUS_OK) {
    hps_swig_free_strings(arg3, arg5); arg3 = NULL; arg5 = 0;
    HPS_SWIG_RAISE(hps_swig_status, hps_swig_error_message(hps_swig_status))
  }
}
/* SWIG casts a const pointer argument to its resolved type (int64_t is `long long` to
 * SWIG, `long` to an LP64 compiler): pass the header's type. */
%feature("action") EngineHandle::add_param {
  result = EngineHandle_add_param(arg1, (const char*)arg2, (const int64_t*)arg3, arg4, arg5, arg6, arg7);
}

%extend StreamHandle {
  static StreamHandle* create(hps_device_type_t type, int32_t index) { HPS_SWIG_GET(StreamHandle*, hps_stream_create(type, index, &v)); }
  ~StreamHandle() { hps_stream_destroy($self); }
  void synchronize() { HPS_SWIG_CHECK(hps_stream_synchronize($self)); }
  void wait_event(EventHandle* event) { HPS_SWIG_CHECK(hps_stream_wait_event($self, event)); }
  void memcpy_async(hps_swig_out_buffer dst, hps_swig_in_buffer src, size_t bytes) {
    if (HPS_SWIG_FITS("dst", dst, bytes, HPS_DTYPE_UINT8) && HPS_SWIG_FITS("src", src, bytes, HPS_DTYPE_UINT8))
      HPS_SWIG_CHECK(hps_memcpy_async(dst.data, src.data, bytes, $self));
  }
}

%extend EventHandle {
  static EventHandle* create(hps_device_type_t type, int32_t index) { HPS_SWIG_GET(EventHandle*, hps_event_create(type, index, &v)); }
  ~EventHandle() { hps_event_destroy($self); }
  void record(StreamHandle* stream) { HPS_SWIG_CHECK(hps_event_record($self, stream)); }
  int32_t query() { HPS_SWIG_GET(int32_t, hps_event_query($self, &v)); }
  void synchronize() { HPS_SWIG_CHECK(hps_event_synchronize($self)); }
}

%extend StoreHandle {
  static StoreHandle* open(const char* url, int32_t rank, int64_t timeout_ms) { HPS_SWIG_GET(StoreHandle*, hps_store_open(url, rank, timeout_ms, &v)); }
  ~StoreHandle() { hps_store_destroy($self); }
  void abort() { HPS_SWIG_CHECK(hps_store_abort($self)); }
  void set(const char* key, const void* value, size_t size) { HPS_SWIG_CHECK(hps_store_set($self, key, value, size)); }
  /* Values of any size: on OUT_OF_RANGE with the size needed, grow and ask again. */
  hps_swig_bytes get(const char* key, int64_t timeout_ms) {
    hps_swig_bytes b = {NULL, 0};
    size_t capacity = 256, size = 0;
    for (;;) {
      char* grown = (char*)realloc(b.data, capacity ? capacity : 1);
      if (!grown) { free(b.data); b.data = NULL; snprintf(hps_swig_message, sizeof hps_swig_message, "store get: out of memory"); hps_swig_status = HPS_SWIG_ARGUMENT_ERROR; return b; }
      b.data = grown;
      HPS_SWIG_CHECK(hps_store_get($self, key, timeout_ms, b.data, capacity, &size));
      if (hps_swig_status == HPS_STATUS_OUT_OF_RANGE && size > capacity) { capacity = size; continue; }
      break;
    }
    if (hps_swig_status != HPS_STATUS_OK) { free(b.data); b.data = NULL; return b; }
    b.size = size;
    return b;
  }
  int64_t add(const char* key, int64_t delta) { HPS_SWIG_GET(int64_t, hps_store_add($self, key, delta, &v)); }
  void wait(const char* key, int64_t timeout_ms) { HPS_SWIG_CHECK(hps_store_wait($self, key, timeout_ms)); }
  int32_t check(const char* key) { HPS_SWIG_GET(int32_t, hps_store_check($self, key, &v)); }
}

%extend CommHandle {
  static CommHandle* create(StoreHandle* store, int32_t rank, int32_t size, hps_device_type_t type, int32_t device_index, const hps_comm_options_t* options) { HPS_SWIG_GET(CommHandle*, hps_comm_create(store, rank, size, type, device_index, options, &v)); }
  ~CommHandle() { hps_comm_destroy($self); }
  void abort() { HPS_SWIG_CHECK(hps_comm_abort($self)); }
  void finish() { HPS_SWIG_CHECK(hps_comm_finish($self)); }
  int32_t rank() { HPS_SWIG_GET(int32_t, hps_comm_rank($self, &v)); }
  int32_t size() { HPS_SWIG_GET(int32_t, hps_comm_size($self, &v)); }
  hps_swig_pair device() { hps_device_type_t t = HPS_DEVICE_CPU; int32_t i = 0; HPS_SWIG_CHECK(hps_comm_device($self, &t, &i)); return hps_swig_make_pair((int64_t)t, i); }
  const char* transport() { HPS_SWIG_GET(const char*, hps_comm_transport($self, &v)); }
  void set_timeout(int64_t timeout_ms) { HPS_SWIG_CHECK(hps_comm_set_timeout($self, timeout_ms)); }
  CommHandle* split(const int32_t* ranks, size_t count, const char* name) { HPS_SWIG_GET(CommHandle*, hps_comm_split($self, ranks, count, name, &v)); }
  /* Raw buffers, counts in elements of dtype. */
  WorkHandle* all_reduce(hps_swig_in_buffer send, hps_swig_out_buffer recv, uint64_t count, hps_dtype_t dtype, hps_reduce_op_t op, StreamHandle* ready) {
    WorkHandle* v = NULL;
    if (HPS_SWIG_FITS("send", send, count, dtype) && HPS_SWIG_FITS("recv", recv, count, dtype))
      HPS_SWIG_CHECK(hps_comm_all_reduce($self, send.data, recv.data, count, dtype, op, ready, &v));
    return v;
  }
  WorkHandle* reduce(hps_swig_in_buffer send, hps_swig_out_buffer recv, uint64_t count, hps_dtype_t dtype, hps_reduce_op_t op, int32_t root, StreamHandle* ready) {
    WorkHandle* v = NULL;
    if (HPS_SWIG_FITS("send", send, count, dtype) && HPS_SWIG_FITS("recv", recv, count, dtype))
      HPS_SWIG_CHECK(hps_comm_reduce($self, send.data, recv.data, count, dtype, op, root, ready, &v));
    return v;
  }
  WorkHandle* broadcast(hps_swig_out_buffer buffer, uint64_t count, hps_dtype_t dtype, int32_t root, StreamHandle* ready) {
    WorkHandle* v = NULL;
    if (HPS_SWIG_FITS("the buffer", buffer, count, dtype))
      HPS_SWIG_CHECK(hps_comm_broadcast($self, buffer.data, count, dtype, root, ready, &v));
    return v;
  }
  WorkHandle* all_gather(hps_swig_in_buffer send, uint64_t send_count, hps_swig_out_buffer recv, uint64_t recv_count, hps_dtype_t dtype, StreamHandle* ready) {
    WorkHandle* v = NULL;
    if (HPS_SWIG_FITS("send", send, send_count, dtype) && HPS_SWIG_FITS("recv", recv, recv_count, dtype))
      HPS_SWIG_CHECK(hps_comm_all_gather($self, send.data, send_count, recv.data, recv_count, dtype, ready, &v));
    return v;
  }
  WorkHandle* reduce_scatter(hps_swig_in_buffer send, uint64_t send_count, hps_swig_out_buffer recv, uint64_t recv_count, hps_dtype_t dtype, hps_reduce_op_t op, StreamHandle* ready) {
    WorkHandle* v = NULL;
    if (HPS_SWIG_FITS("send", send, send_count, dtype) && HPS_SWIG_FITS("recv", recv, recv_count, dtype))
      HPS_SWIG_CHECK(hps_comm_reduce_scatter($self, send.data, send_count, recv.data, recv_count, dtype, op, ready, &v));
    return v;
  }
  WorkHandle* send(hps_swig_in_buffer buffer, uint64_t count, hps_dtype_t dtype, int32_t peer, StreamHandle* ready) {
    WorkHandle* v = NULL;
    if (HPS_SWIG_FITS("the buffer", buffer, count, dtype))
      HPS_SWIG_CHECK(hps_comm_send($self, buffer.data, count, dtype, peer, ready, &v));
    return v;
  }
  WorkHandle* recv(hps_swig_out_buffer buffer, uint64_t count, hps_dtype_t dtype, int32_t peer, StreamHandle* ready) {
    WorkHandle* v = NULL;
    if (HPS_SWIG_FITS("the buffer", buffer, count, dtype))
      HPS_SWIG_CHECK(hps_comm_recv($self, buffer.data, count, dtype, peer, ready, &v));
    return v;
  }
  WorkHandle* barrier(StreamHandle* ready) { HPS_SWIG_GET(WorkHandle*, hps_comm_barrier($self, ready, &v)); }
  /* DLPack tensors: dtype and counts from the tensors. */
  WorkHandle* all_reduce_dlpack(const DLTensor* send, const DLTensor* recv, hps_reduce_op_t op, StreamHandle* ready) { HPS_SWIG_GET(WorkHandle*, hps_comm_all_reduce_dlpack($self, send, recv, op, ready, &v)); }
  WorkHandle* reduce_dlpack(const DLTensor* send, const DLTensor* recv, hps_reduce_op_t op, int32_t root, StreamHandle* ready) { HPS_SWIG_GET(WorkHandle*, hps_comm_reduce_dlpack($self, send, recv, op, root, ready, &v)); }
  WorkHandle* broadcast_dlpack(const DLTensor* buffer, int32_t root, StreamHandle* ready) { HPS_SWIG_GET(WorkHandle*, hps_comm_broadcast_dlpack($self, buffer, root, ready, &v)); }
  WorkHandle* all_gather_dlpack(const DLTensor* send, const DLTensor* recv, StreamHandle* ready) { HPS_SWIG_GET(WorkHandle*, hps_comm_all_gather_dlpack($self, send, recv, ready, &v)); }
  WorkHandle* reduce_scatter_dlpack(const DLTensor* send, const DLTensor* recv, hps_reduce_op_t op, StreamHandle* ready) { HPS_SWIG_GET(WorkHandle*, hps_comm_reduce_scatter_dlpack($self, send, recv, op, ready, &v)); }
  WorkHandle* send_dlpack(const DLTensor* buffer, int32_t peer, StreamHandle* ready) { HPS_SWIG_GET(WorkHandle*, hps_comm_send_dlpack($self, buffer, peer, ready, &v)); }
  WorkHandle* recv_dlpack(const DLTensor* buffer, int32_t peer, StreamHandle* ready) { HPS_SWIG_GET(WorkHandle*, hps_comm_recv_dlpack($self, buffer, peer, ready, &v)); }
}

%extend WorkHandle {
  ~WorkHandle() { hps_work_destroy($self); }
  int32_t test() { HPS_SWIG_GET(int32_t, hps_work_test($self, &v)); }
  void wait() { HPS_SWIG_CHECK(hps_work_wait($self)); }
  int32_t wait_timeout(int64_t timeout_ms) { HPS_SWIG_GET(int32_t, hps_work_wait_timeout($self, timeout_ms, &v)); }
  void wait_stream(StreamHandle* stream) { HPS_SWIG_CHECK(hps_work_wait_stream($self, stream)); }
}

%extend TopologyHandle {
  static TopologyHandle* create(int32_t dp, int32_t pp, int32_t sharding, int32_t sep, int32_t mp, const char* order, int32_t world_size) { HPS_SWIG_GET(TopologyHandle*, hps_topology_create(dp, pp, sharding, sep, mp, order, world_size, &v)); }
  ~TopologyHandle() { hps_topology_destroy($self); }
  int32_t degree(hps_group_t axis) { HPS_SWIG_GET(int32_t, hps_topology_degree($self, axis, &v)); }
  int32_t coordinate(int32_t rank, hps_group_t axis) { HPS_SWIG_GET(int32_t, hps_topology_coordinate($self, rank, axis, &v)); }
  int32_t rank_of(int32_t dp, int32_t pp, int32_t sharding, int32_t sep, int32_t mp) { HPS_SWIG_GET(int32_t, hps_topology_rank_of($self, dp, pp, sharding, sep, mp, &v)); }
  /* The ranks, however many: on OUT_OF_RANGE with the count needed, grow and ask again. */
  hps_swig_ints group_ranks(hps_group_t group, int32_t rank) {
    hps_swig_ints r = {NULL, 0};
    size_t capacity = 64, count = 0;
    for (;;) {
      int32_t* grown = (int32_t*)realloc(r.data, (capacity ? capacity : 1) * sizeof(int32_t));
      if (!grown) { free(r.data); r.data = NULL; snprintf(hps_swig_message, sizeof hps_swig_message, "group_ranks: out of memory"); hps_swig_status = HPS_SWIG_ARGUMENT_ERROR; return r; }
      r.data = grown;
      HPS_SWIG_CHECK(hps_topology_group_ranks($self, group, rank, r.data, capacity, &count));
      if (hps_swig_status == HPS_STATUS_OUT_OF_RANGE && count > capacity) { capacity = count; continue; }
      break;
    }
    if (hps_swig_status != HPS_STATUS_OK) { free(r.data); r.data = NULL; return r; }
    r.count = count;
    return r;
  }
  hps_swig_pair pipeline_neighbors(int32_t rank) { int32_t p = 0, n = 0; HPS_SWIG_CHECK(hps_topology_pipeline_neighbors($self, rank, &p, &n)); return hps_swig_make_pair(p, n); }
}

%extend HybridGroupHandle {
  static HybridGroupHandle* create(CommHandle* world, const TopologyHandle* topology) { HPS_SWIG_GET(HybridGroupHandle*, hps_hybrid_group_create(world, topology, &v)); }
  ~HybridGroupHandle() { hps_hybrid_group_destroy($self); }
  CommHandle* comm(hps_group_t kind) { HPS_SWIG_GET(CommHandle*, hps_hybrid_group_comm($self, kind, &v)); }
}

%extend ClipHandle {
  static ClipHandle* create(CommHandle* sharding, CommHandle* mp, CommHandle* pp, const hps_clip_options_t* options) { HPS_SWIG_GET(ClipHandle*, hps_clip_create(sharding, mp, pp, options, &v)); }
  ~ClipHandle() { hps_clip_destroy($self); }
  void add_tensor(hps_swig_out_buffer data, uint64_t count, hps_dtype_t dtype, uint32_t flags) {
    if (HPS_SWIG_FITS("the gradient", data, count, dtype)) HPS_SWIG_CHECK(hps_clip_add_tensor($self, data.data, count, dtype, flags));
  }
  void add_tensor_dlpack(const DLTensor* gradient, uint32_t flags) { HPS_SWIG_CHECK(hps_clip_add_tensor_dlpack($self, gradient, flags)); }
  void seal() { HPS_SWIG_CHECK(hps_clip_seal($self)); }
  void run(StreamHandle* stream, hps_swig_out_buffer norm_out, int32_t scale) {
    if (HPS_SWIG_FITS("norm_out", norm_out, 1, HPS_DTYPE_FLOAT32)) HPS_SWIG_CHECK(hps_clip_run($self, stream, (float*)norm_out.data, scale));
  }
  uintptr_t coefficient() { HPS_SWIG_ADDRESS(const float*, hps_clip_coefficient($self, &v)); }
  TensorHandle* coefficient_dlpack() { HPS_SWIG_GET(TensorHandle*, hps_clip_coefficient_dlpack($self, &v)); }
}

%extend EngineHandle {
  static EngineHandle* create(CommHandle* sharding, CommHandle* dp, const hps_engine_options_t* options) { HPS_SWIG_GET(EngineHandle*, hps_engine_create(sharding, dp, options, &v)); }
  ~EngineHandle() { hps_engine_destroy($self); }
  size_t add_param(const char* name, const int64_t* shape, size_t ndim, hps_dtype_t dtype, uint32_t flags, int32_t unit) { HPS_SWIG_GET(size_t, hps_engine_add_param($self, name, shape, ndim, dtype, flags, unit, &v)); }
  void set_model_parallel_groups(CommHandle* mp, CommHandle* pp) { HPS_SWIG_CHECK(hps_engine_set_model_parallel_groups($self, mp, pp)); }
  void seal() { HPS_SWIG_CHECK(hps_engine_seal($self)); }
  void broadcast_parameters() { HPS_SWIG_CHECK(hps_engine_broadcast_parameters($self)); }
  uintptr_t param(size_t index) { HPS_SWIG_ADDRESS(void*, hps_engine_param($self, index, &v)); }
  uintptr_t grad(size_t index) { HPS_SWIG_ADDRESS(void*, hps_engine_grad($self, index, &v)); }
  void wait_parameters(int32_t unit) { HPS_SWIG_CHECK(hps_engine_wait_parameters($self, unit)); }
  void release_parameters(int32_t unit) { HPS_SWIG_CHECK(hps_engine_release_parameters($self, unit)); }
  void grad_ready(size_t index, StreamHandle* ready) { HPS_SWIG_CHECK(hps_engine_grad_ready($self, index, ready)); }
  void step() { HPS_SWIG_CHECK(hps_engine_step($self)); }
  void set_learning_rate(float learning_rate) { HPS_SWIG_CHECK(hps_engine_set_learning_rate($self, learning_rate)); }
  void synchronize() { HPS_SWIG_CHECK(hps_engine_synchronize($self)); }
  void gather_parameter(size_t index, hps_swig_out_buffer out, uint64_t count) {
    if (HPS_SWIG_FITS("out", out, count, HPS_DTYPE_FLOAT32)) HPS_SWIG_CHECK(hps_engine_gather_parameter($self, index, (float*)out.data, count));
  }
  hps_swig_pair device() { hps_device_type_t t = HPS_DEVICE_CPU; int32_t i = 0; HPS_SWIG_CHECK(hps_engine_device($self, &t, &i)); return hps_swig_make_pair((int64_t)t, i); }
  uint64_t resident_bytes() { HPS_SWIG_GET(uint64_t, hps_engine_resident_bytes($self, &v)); }
  uint64_t failures_returned() { HPS_SWIG_GET(uint64_t, hps_engine_failures_returned($self, &v)); }
  hps_swig_pair shard_range(size_t index) { uint64_t b = 0, e = 0; HPS_SWIG_CHECK(hps_engine_shard_range($self, index, &b, &e)); return hps_swig_make_pair((int64_t)b, (int64_t)e); }
  size_t param_bucket(size_t index) { HPS_SWIG_GET(size_t, hps_engine_param_bucket($self, index, &v)); }
  /* (scale address, skipped-steps address) */
  hps_swig_pair loss_scale() { const float* s = NULL; const int64_t* k = NULL; HPS_SWIG_CHECK(hps_engine_loss_scale($self, &s, &k)); return hps_swig_make_pair((int64_t)(uintptr_t)s, (int64_t)(uintptr_t)k); }
  TensorHandle* param_dlpack(size_t index) { HPS_SWIG_GET(TensorHandle*, hps_engine_param_dlpack($self, index, &v)); }
  TensorHandle* grad_dlpack(size_t index) { HPS_SWIG_GET(TensorHandle*, hps_engine_grad_dlpack($self, index, &v)); }
  /* hps_engine_loss_scale_dlpack's two views, one per method. */
  TensorHandle* loss_scale_dlpack() { TensorHandle *s = NULL, *k = NULL; if (HPS_SWIG_CHECK(hps_engine_loss_scale_dlpack($self, &s, &k)) == HPS_STATUS_OK) hps_dlpack_release(k); return s; }
  int64_t grad_norm() { const float* n = NULL; HPS_SWIG_CHECK(hps_engine_grad_norm($self, &n)); return (int64_t)(uintptr_t)n; }
  TensorHandle* grad_norm_dlpack() { TensorHandle* n = NULL; HPS_SWIG_CHECK(hps_engine_grad_norm_dlpack($self, &n)); return n; }
  TensorHandle* skipped_steps_dlpack() { TensorHandle *s = NULL, *k = NULL; if (HPS_SWIG_CHECK(hps_engine_loss_scale_dlpack($self, &s, &k)) == HPS_STATUS_OK) hps_dlpack_release(s); return k; }
}

%extend CheckpointHandle {
  static CheckpointHandle* create(EngineHandle* engine, CommHandle* group, const char* root, const hps_checkpoint_options_t* options) { HPS_SWIG_GET(CheckpointHandle*, hps_checkpoint_create(engine, group, root, options, &v)); }
  ~CheckpointHandle() { hps_checkpoint_destroy($self); }
  WorkHandle* save(const char* name, const char* const* keys, const char* const* values, size_t count) { HPS_SWIG_GET(WorkHandle*, hps_checkpoint_save($self, name, keys, values, count, &v)); }
  void load(const char* name, const hps_checkpoint_load_options_t* options) { HPS_SWIG_CHECK(hps_checkpoint_load($self, name, options)); }
  void import_safetensors(const char* path, const hps_checkpoint_load_options_t* options) { HPS_SWIG_CHECK(hps_checkpoint_import_safetensors($self, path, options)); }
  /* The value's bytes (without the NUL), however long: ask for its length, then copy. */
  hps_swig_bytes metadata(const char* key) {
    hps_swig_bytes b = {NULL, 0};
    size_t length = 0;
    if (HPS_SWIG_CHECK(hps_checkpoint_metadata($self, key, NULL, 0, &length)) != HPS_STATUS_OK) return b;
    b.data = (char*)malloc(length + 1);
    if (!b.data) { snprintf(hps_swig_message, sizeof hps_swig_message, "checkpoint metadata: out of memory"); hps_swig_status = HPS_SWIG_ARGUMENT_ERROR; return b; }
    if (HPS_SWIG_CHECK(hps_checkpoint_metadata($self, key, b.data, length + 1, &length)) != HPS_STATUS_OK) { free(b.data); b.data = NULL; return b; }
    b.size = length;
    return b;
  }
}

/* A DLPack tensor handed out by the library (a view that keeps its owner's memory alive):
 * the proxy releases it (hps_dlpack_release) when it goes. */
%extend TensorHandle {
  ~TensorHandle() { hps_dlpack_release($self); }
  /* The data's address on the tensor's device (data + byte_offset). */
  uintptr_t data() { return (uintptr_t)$self->dl_tensor.data + (uintptr_t)$self->dl_tensor.byte_offset; }
  /* The host address of the data, or FAILED_PRECONDITION off the host (the C policy). */
  uintptr_t host_data() { HPS_SWIG_ADDRESS(void*, hps_dlpack_host_data(&$self->dl_tensor, &v)); }
  int32_t device_type() { return (int32_t)$self->dl_tensor.device.device_type; }
  int32_t device_id() { return (int32_t)$self->dl_tensor.device.device_id; }
  int32_t dtype_code() { return (int32_t)$self->dl_tensor.dtype.code; }
  int32_t dtype_bits() { return (int32_t)$self->dl_tensor.dtype.bits; }
  int32_t ndim() { return (int32_t)$self->dl_tensor.ndim; }
  int64_t dim(int32_t i) { return i >= 0 && i < $self->dl_tensor.ndim ? $self->dl_tensor.shape[i] : -1; }
}

/* The C declarations: enums, value structs, macros (functions stay hidden). */
%include "hpshard/version.h"
%include "hpshard/hpshard.h"
