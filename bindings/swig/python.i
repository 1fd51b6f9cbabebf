/*
 * python.i — the Python overlay of hpshard.i: builds hpshard.capi, the low-level
 * module (exact C names) under the hand-written package hpshard (bindings/python/).
 *
 * Errors: a failing status raises hpshard.Error (or its per-status subclass), made by
 * hpshard._errors._from_status(status, message); without that module (a bare import of
 * the extension) it raises RuntimeError.
 */
%module(package="hpshard", threads="1") capi

/* No GIL release for calls that cannot block. */
%nothread hps_status_string;
%nothread hps_last_error_message;
%nothread hps_version_number;
%nothread hps_version_string;

%{
#include <string.h>

/* Raise the exception for a failing status. `message` is copied at once. */
static void hps_py_raise(int status, const char* message) {
  PyObject* text = PyUnicode_DecodeUTF8(message ? message : "",
                                        (Py_ssize_t)strlen(message ? message : ""),
                                        "replace");
  PyObject* exc = NULL;
  PyObject* mod = PyImport_ImportModule("hpshard._errors");
  if (mod) {
    PyObject* factory = PyObject_GetAttrString(mod, "_from_status");
    if (factory && text) exc = PyObject_CallFunction(factory, "iO", status, text);
    Py_XDECREF(factory);
    Py_DECREF(mod);
  }
  if (exc) {
    PyErr_SetObject((PyObject*)Py_TYPE(exc), exc);
    Py_DECREF(exc);
  } else {
    PyErr_Clear();
    PyErr_Format(PyExc_RuntimeError, "hpshard status %d: %s", status,
                 message ? message : "");
  }
  Py_XDECREF(text);
}
%}

%define HPS_SWIG_RAISE(status, message)
  hps_py_raise((int)(status), (message)); SWIG_fail;
%enddef

/* hps_status_t results vanish; out-params (below) take their place, else None. */
%typemap(out) hps_status_t "$result = SWIG_Py_Void();"

/* ---- handles out ----------------------------------------------------------------- */
/* Not owned by the SWIG object: the hand-written Stream / Event destroys it once. */
%typemap(in, numinputs=0) hps_stream_t** out_stream (hps_stream_t* tmp = NULL) "$1 = &tmp;"
%typemap(argout) hps_stream_t** out_stream {
  $result = SWIG_Python_AppendOutput($result, SWIG_NewPointerObj(*$1, $*1_descriptor, 0));
}
%typemap(in, numinputs=0) hps_event_t** out_event (hps_event_t* tmp = NULL) "$1 = &tmp;"
%typemap(argout) hps_event_t** out_event {
  $result = SWIG_Python_AppendOutput($result, SWIG_NewPointerObj(*$1, $*1_descriptor, 0));
}

/* ---- scalars out ----------------------------------------------------------------- */
%typemap(in, numinputs=0) size_t* out_size (size_t tmp = 0) "$1 = &tmp;"
%typemap(argout) size_t* out_size {
  $result = SWIG_Python_AppendOutput($result, PyLong_FromSize_t(*$1));
}
%typemap(in, numinputs=0) const char** out_name (const char* tmp = NULL) "$1 = ($1_ltype)&tmp;"
%typemap(argout) const char** out_name {
  $result = SWIG_Python_AppendOutput($result, PyUnicode_FromString(*$1 ? *$1 : ""));
}
%typemap(in, numinputs=0) int32_t* out_count (int32_t tmp = 0) "$1 = &tmp;"
%typemap(argout) int32_t* out_count {
  $result = SWIG_Python_AppendOutput($result, PyLong_FromLong((long)*$1));
}
%typemap(in, numinputs=0) int32_t* out_completed (int32_t tmp = 0) "$1 = &tmp;"
%typemap(argout) int32_t* out_completed {
  $result = SWIG_Python_AppendOutput($result, PyLong_FromLong((long)*$1));
}
%typemap(in, numinputs=0) uint64_t* out_count (uint64_t tmp = 0) "$1 = &tmp;"
%typemap(argout) uint64_t* out_count {
  $result = SWIG_Python_AppendOutput($result, PyLong_FromUnsignedLongLong((unsigned long long)*$1));
}

/* ---- device properties ----------------------------------------------------------- */
/* hps_device_properties_init(struct_size=sizeof) -> new struct (owned by the proxy).
 * hps_device_get_properties(type, index) -> new struct (owned by the proxy). */
%typemap(in, numinputs=0) hps_device_properties_t* props (hps_device_properties_t tmp) {
  /* Pre-initialised so hps_device_get_properties accepts it; hps_device_properties_init
   * re-initialises it with the caller's struct_size (and leaves it alone on failure). */
  if (hps_device_properties_init(&tmp, sizeof tmp) != HPS_STATUS_OK) {
    hps_py_raise(HPS_STATUS_INTERNAL, hps_last_error_message()); SWIG_fail;
  }
  $1 = &tmp;
}
%typemap(argout) hps_device_properties_t* props {
  hps_device_properties_t* copy =
      (hps_device_properties_t*)malloc(sizeof(hps_device_properties_t));
  if (!copy) { PyErr_NoMemory(); SWIG_fail; }
  memcpy(copy, $1, sizeof *copy);
  $result = SWIG_Python_AppendOutput($result,
      SWIG_NewPointerObj(copy, $1_descriptor, SWIG_POINTER_OWN));
}

/* ---- memcpy buffers -------------------------------------------------------------- */
/* dst: a writable C-contiguous buffer; src: a C-contiguous buffer; None is NULL.
 * `bytes` may not exceed either buffer. The buffer exports are released when the call
 * returns, but the copy runs later: the CALLER must keep both objects alive and
 * un-resized until the stream is synchronised (hpshard.memcpy_async does). */
%typemap(in) void* dst (Py_ssize_t dst_len = 0) {
  if ($input == Py_None) {
    $1 = NULL;
  } else {
    Py_buffer view;
    if (PyObject_GetBuffer($input, &view, PyBUF_WRITABLE | PyBUF_C_CONTIGUOUS) != 0) {
      PyErr_Clear();
      PyErr_SetString(PyExc_ValueError,
          "hps_memcpy_async: dst must be a writable, C-contiguous buffer");
      SWIG_fail;
    }
    $1 = view.buf; dst_len = view.len;
    PyBuffer_Release(&view);
  }
}
%typemap(in) const void* src (Py_ssize_t src_len = 0) {
  if ($input == Py_None) {
    $1 = NULL;
  } else {
    Py_buffer view;
    if (PyObject_GetBuffer($input, &view, PyBUF_C_CONTIGUOUS) != 0) {
      PyErr_Clear();
      PyErr_SetString(PyExc_ValueError,
          "hps_memcpy_async: src must be a C-contiguous buffer");
      SWIG_fail;
    }
    $1 = view.buf; src_len = view.len;
    PyBuffer_Release(&view);
  }
}
/* Argument numbers are fixed by the C signature: dst is 1, src is 2. */
%typemap(check) size_t bytes {
  if ((arg1 && (Py_ssize_t)$1 > dst_len1) || (arg2 && (Py_ssize_t)$1 > src_len2)) {
    PyErr_Format(PyExc_ValueError,
        "hps_memcpy_async: %zu bytes do not fit (dst has %zd, src has %zd)",
        (size_t)$1, arg1 ? dst_len1 : (Py_ssize_t)0, arg2 ? src_len2 : (Py_ssize_t)0);
    SWIG_fail;
  }
}

/* ---- new handles out (not owned: the hand-written classes destroy them once) -------- */
%define HPS_PY_HANDLE_OUT(TYPE, NAME)
%typemap(in, numinputs=0) TYPE** NAME (TYPE* tmp = NULL) "$1 = &tmp;"
%typemap(argout) TYPE** NAME {
  $result = SWIG_Python_AppendOutput($result, SWIG_NewPointerObj(*$1, $*1_descriptor, 0));
}
%enddef
HPS_PY_HANDLE_OUT(hps_store_t, out_store)
HPS_PY_HANDLE_OUT(hps_comm_t, out_comm)      /* NULL (hps_comm_split, non-member): None */
HPS_PY_HANDLE_OUT(hps_work_t, out_work)
HPS_PY_HANDLE_OUT(hps_topology_t, out_topology)
HPS_PY_HANDLE_OUT(hps_hybrid_group_t, out_group)

/* ---- more scalars out -------------------------------------------------------------- */
%define HPS_PY_INT32_OUT(NAME)
%typemap(in, numinputs=0) int32_t* NAME (int32_t tmp = 0) "$1 = &tmp;"
%typemap(argout) int32_t* NAME {
  $result = SWIG_Python_AppendOutput($result, PyLong_FromLong((long)*$1));
}
%enddef
HPS_PY_INT32_OUT(out_present)
HPS_PY_INT32_OUT(out_rank)
HPS_PY_INT32_OUT(out_size)
HPS_PY_INT32_OUT(out_degree)
HPS_PY_INT32_OUT(out_coordinate)
/* (prev, next): SWIG_Python_AppendOutput makes a list of the two. */
HPS_PY_INT32_OUT(out_prev)
HPS_PY_INT32_OUT(out_next)
%typemap(in, numinputs=0) int64_t* out_value (int64_t tmp = 0) "$1 = &tmp;"
%typemap(argout) int64_t* out_value {
  $result = SWIG_Python_AppendOutput($result, PyLong_FromLongLong((long long)*$1));
}

/* ---- rendezvous info and communicator options ------------------------------------ */
/* hps_rendezvous_info_init(struct_size) / hps_rendezvous_from_env() -> new struct (owned
 * by the proxy); pre-initialised so hps_rendezvous_from_env accepts it. */
%typemap(in, numinputs=0) hps_rendezvous_info_t* info (hps_rendezvous_info_t tmp) {
  if (hps_rendezvous_info_init(&tmp, sizeof tmp) != HPS_STATUS_OK) {
    hps_py_raise(HPS_STATUS_INTERNAL, hps_last_error_message()); SWIG_fail;
  }
  $1 = &tmp;
}
%typemap(argout) hps_rendezvous_info_t* info {
  hps_rendezvous_info_t* copy = (hps_rendezvous_info_t*)malloc(sizeof(hps_rendezvous_info_t));
  if (!copy) { PyErr_NoMemory(); SWIG_fail; }
  memcpy(copy, $1, sizeof *copy);
  $result = SWIG_Python_AppendOutput($result,
      SWIG_NewPointerObj(copy, $1_descriptor, SWIG_POINTER_OWN));
}
/* hps_comm_options_init(struct_size) -> new options (owned by the proxy, which also owns
 * the copy of the name). hps_comm_create's `const hps_comm_options_t* options` keeps the
 * default pointer conversion: a proxy, or None for NULL. */
%typemap(in, numinputs=0) hps_comm_options_t* options (hps_comm_options_t tmp) {
  memset(&tmp, 0, sizeof tmp);
  $1 = &tmp;
}
%typemap(argout) hps_comm_options_t* options {
  hps_comm_options_t* copy = hps_swig_comm_options_new($1);
  if (!copy) { PyErr_NoMemory(); SWIG_fail; }
  $result = SWIG_Python_AppendOutput($result,
      SWIG_NewPointerObj(copy, $1_descriptor, SWIG_POINTER_OWN));
}
/* hps_comm_create: a proxy or None/null (NULL), and no argout. */
%apply SWIGTYPE* { const hps_comm_options_t* options };
%typemap(argout) const hps_comm_options_t* options ""

/* ---- store values ------------------------------------------------------------------ */
/* hps_store_set(store, key, value): any bytes-like object, copied (binary-safe). */
%typemap(in) (const void* value, size_t size) {
  Py_buffer view;
  if (PyObject_GetBuffer($input, &view, PyBUF_C_CONTIGUOUS) != 0) {
    PyErr_Clear();
    PyErr_SetString(PyExc_TypeError, "hps_store_set: value must be a bytes-like object");
    SWIG_fail;
  }
  $1 = malloc(view.len ? (size_t)view.len : 1);
  if (!$1) { PyBuffer_Release(&view); PyErr_NoMemory(); SWIG_fail; }
  memcpy((void*)$1, view.buf, (size_t)view.len);
  $2 = (size_t)view.len;
  PyBuffer_Release(&view);
}
%typemap(freearg) (const void* value, size_t size) "free((void*)$1);"
/* hps_store_get(store, key, timeout_ms) -> bytes (grown as needed, see hpshard.i). */
%typemap(in, numinputs=0) (void* buffer, size_t capacity, size_t* out_size) (size_t size_tmp = 0) {
  $2 = 256;
  $1 = malloc($2);
  $3 = &size_tmp;
  if (!$1) { PyErr_NoMemory(); SWIG_fail; }
}
%typemap(argout) (void* buffer, size_t capacity, size_t* out_size) {
  $result = SWIG_Python_AppendOutput($result,
      PyBytes_FromStringAndSize((const char*)$1, (Py_ssize_t)*$3));
}
%typemap(freearg) (void* buffer, size_t capacity, size_t* out_size) "free($1);"

/* ---- rank lists -------------------------------------------------------------------- */
/* hps_comm_split(comm, ranks, name): a sequence of ints (each an int32). */
%typemap(in) (const int32_t* ranks, size_t count) {
  PyObject* seq = PySequence_Fast($input, "hps_comm_split: ranks must be a sequence of ints");
  Py_ssize_t n, i;
  int32_t* ranks;
  if (!seq) SWIG_fail;
  n = PySequence_Fast_GET_SIZE(seq);
  ranks = (int32_t*)malloc((n ? (size_t)n : 1) * sizeof(int32_t));
  if (!ranks) { Py_DECREF(seq); PyErr_NoMemory(); SWIG_fail; }
  $1 = ranks;
  $2 = (size_t)n;
  for (i = 0; i < n; ++i) {
    long v = PyLong_AsLong(PySequence_Fast_GET_ITEM(seq, i));
    if (v == -1 && PyErr_Occurred()) { Py_DECREF(seq); SWIG_fail; }
    if (v < INT32_MIN || v > INT32_MAX) {
      Py_DECREF(seq);
      PyErr_Format(PyExc_OverflowError, "hps_comm_split: rank %ld is not an int32", v);
      SWIG_fail;
    }
    ranks[i] = (int32_t)v;
  }
  Py_DECREF(seq);
}
%typemap(freearg) (const int32_t* ranks, size_t count) "free((void*)$1);"
/* hps_topology_group_ranks(topology, group, rank) -> list of ints (grown as needed). */
%typemap(in, numinputs=0) (int32_t* out_ranks, size_t capacity, size_t* out_count) (size_t count_tmp = 0) {
  $2 = 64;
  $1 = (int32_t*)malloc($2 * sizeof(int32_t));
  $3 = &count_tmp;
  if (!$1) { PyErr_NoMemory(); SWIG_fail; }
}
%typemap(argout) (int32_t* out_ranks, size_t capacity, size_t* out_count) {
  size_t i;
  PyObject* list = PyList_New((Py_ssize_t)*$3);
  if (!list) SWIG_fail;
  for (i = 0; i < *$3; ++i) PyList_SET_ITEM(list, (Py_ssize_t)i, PyLong_FromLong((long)$1[i]));
  $result = SWIG_Python_AppendOutput($result, list);
}
%typemap(freearg) (int32_t* out_ranks, size_t capacity, size_t* out_count) "free($1);"

/* ---- collective buffers ------------------------------------------------------------ */
/* C-contiguous buffer-protocol objects (None is NULL); outputs must be writable. The
 * size in bytes goes to hps_nbytes<argnum>, checked against count and dtype in hpshard.i.
 * As with memcpy, the exports are released at once: the CALLER keeps the objects alive
 * and un-resized until the work has completed (hpshard.Work does). */
%define HPS_PY_COLLECTIVE_BUFFER(DECL, FLAGS, TEXT)
%typemap(in) DECL (Py_ssize_t hps_nbytes = 0) {
  if ($input == Py_None) {
    $1 = NULL;
  } else {
    Py_buffer view;
    if (PyObject_GetBuffer($input, &view, FLAGS) != 0) {
      PyErr_Clear();
      PyErr_SetString(PyExc_ValueError, "$symname: $1_name must be " TEXT);
      SWIG_fail;
    }
    $1 = ($1_ltype)view.buf; hps_nbytes = view.len;
    PyBuffer_Release(&view);
  }
}
%enddef
HPS_PY_COLLECTIVE_BUFFER(const void* send, PyBUF_C_CONTIGUOUS, "a C-contiguous buffer")
HPS_PY_COLLECTIVE_BUFFER(const void* buffer, PyBUF_C_CONTIGUOUS, "a C-contiguous buffer")
HPS_PY_COLLECTIVE_BUFFER(void* recv, PyBUF_WRITABLE | PyBUF_C_CONTIGUOUS,
                         "a writable, C-contiguous buffer")
HPS_PY_COLLECTIVE_BUFFER(void* buffer, PyBUF_WRITABLE | PyBUF_C_CONTIGUOUS,
                         "a writable, C-contiguous buffer")
/* hps_clip_add_tensor's gradient and hps_clip_run's norm_out (one float32): as the
 * collective buffers; the CALLER keeps them alive (hpshard.Clip keeps the gradients while
 * it lives, the stream keeps norm_out until it is synchronised). */
HPS_PY_COLLECTIVE_BUFFER(void* data, PyBUF_WRITABLE | PyBUF_C_CONTIGUOUS,
                         "a writable, C-contiguous buffer")
HPS_PY_COLLECTIVE_BUFFER(float* norm_out, PyBUF_WRITABLE | PyBUF_C_CONTIGUOUS,
                         "a writable, C-contiguous buffer")
/* hps_engine_gather_parameter's out (count float32): filled before the call returns. */
HPS_PY_COLLECTIVE_BUFFER(float* out, PyBUF_WRITABLE | PyBUF_C_CONTIGUOUS,
                         "a writable, C-contiguous buffer")
%define HPS_SWIG_BUFFER_FAIL(message)
  PyErr_SetString(PyExc_ValueError, (message)); SWIG_fail;
%enddef

/* ---- devices of communicators and engines ------------------------------------------ */
/* hps_comm_device / hps_engine_device -> (type, index): SWIG_Python_AppendOutput makes a
 * list of the two; the type is the raw hps_device_type_t value. */
%typemap(in, numinputs=0) (hps_device_type_t* out_type, int32_t* out_index)
    (hps_device_type_t type_tmp = HPS_DEVICE_CPU, int32_t index_tmp = 0) {
  $1 = &type_tmp;
  $2 = &index_tmp;
}
%typemap(argout) (hps_device_type_t* out_type, int32_t* out_index) {
  $result = SWIG_Python_AppendOutput($result, PyLong_FromLong((long)*$1));
  $result = SWIG_Python_AppendOutput($result, PyLong_FromLong((long)*$2));
}

/* ---- clipping and the engine ------------------------------------------------------- */
HPS_PY_HANDLE_OUT(hps_clip_t, out_clip)
HPS_PY_HANDLE_OUT(hps_engine_t, out_engine)
%typemap(in, numinputs=0) size_t* out_index (size_t tmp = 0) "$1 = &tmp;"
%typemap(argout) size_t* out_index {
  $result = SWIG_Python_AppendOutput($result, PyLong_FromSize_t(*$1));
}
%define HPS_PY_UINT64_OUT(NAME)
%typemap(in, numinputs=0) uint64_t* NAME (uint64_t tmp = 0) "$1 = &tmp;"
%typemap(argout) uint64_t* NAME {
  $result = SWIG_Python_AppendOutput($result,
      PyLong_FromUnsignedLongLong((unsigned long long)*$1));
}
%enddef
HPS_PY_UINT64_OUT(out_bytes)
/* (begin, end) and (count, nanoseconds): SWIG_Python_AppendOutput makes a list of two. */
HPS_PY_UINT64_OUT(out_begin)
HPS_PY_UINT64_OUT(out_end)
HPS_PY_UINT64_OUT(out_nanoseconds)
/* Addresses owned by the library (parameter / gradient views, the clip coefficient): an
 * int; hpshard.Engine / hpshard.Clip make NumPy views of the size they know. */
%typemap(in, numinputs=0) void** out_data (void* tmp = NULL) "$1 = &tmp;"
%typemap(argout) void** out_data {
  $result = SWIG_Python_AppendOutput($result,
      PyLong_FromUnsignedLongLong((unsigned long long)(uintptr_t)*$1));
}
%typemap(in, numinputs=0) const float** out_coefficient (const float* tmp = NULL) "$1 = ($1_ltype)&tmp;"
%typemap(argout) const float** out_coefficient {
  $result = SWIG_Python_AppendOutput($result,
      PyLong_FromUnsignedLongLong((unsigned long long)(uintptr_t)*$1));
}
/* hps_engine_loss_scale: (scale address, skipped-steps address), a list of two ints. */
%typemap(in, numinputs=0) const float** out_scale (const float* tmp = NULL) "$1 = ($1_ltype)&tmp;"
%typemap(argout) const float** out_scale {
  $result = SWIG_Python_AppendOutput($result,
      PyLong_FromUnsignedLongLong((unsigned long long)(uintptr_t)*$1));
}
%typemap(in, numinputs=0) const int64_t** out_skipped_steps (const int64_t* tmp = NULL) "$1 = ($1_ltype)&tmp;"
%typemap(argout) const int64_t** out_skipped_steps {
  $result = SWIG_Python_AppendOutput($result,
      PyLong_FromUnsignedLongLong((unsigned long long)(uintptr_t)*$1));
}
/* hps_engine_add_param(engine, name, shape, dtype, flags, unit): shape a sequence of ints. */
%typemap(in) (const int64_t* shape, size_t ndim) {
  PyObject* seq = PySequence_Fast($input, "hps_engine_add_param: shape must be a sequence of ints");
  Py_ssize_t n, i;
  int64_t* dims;
  if (!seq) SWIG_fail;
  n = PySequence_Fast_GET_SIZE(seq);
  dims = (int64_t*)malloc((n ? (size_t)n : 1) * sizeof(int64_t));
  if (!dims) { Py_DECREF(seq); PyErr_NoMemory(); SWIG_fail; }
  $1 = dims;
  $2 = (size_t)n;
  for (i = 0; i < n; ++i) {
    long long v = PyLong_AsLongLong(PySequence_Fast_GET_ITEM(seq, i));
    if (v == -1 && PyErr_Occurred()) { Py_DECREF(seq); SWIG_fail; }
    dims[i] = (int64_t)v;
  }
  Py_DECREF(seq);
}
%typemap(freearg) (const int64_t* shape, size_t ndim) "free((void*)$1);"
/* hps_clip_options_init / hps_engine_options_init(struct_size) -> new options (owned by
 * the proxy); hps_clip_create / hps_engine_create take a proxy or None (NULL). */
%define HPS_PY_OPTIONS(TYPE)
%typemap(in, numinputs=0) TYPE* options (TYPE tmp) {
  memset(&tmp, 0, sizeof tmp);
  $1 = &tmp;
}
%typemap(argout) TYPE* options {
  TYPE* copy = (TYPE*)hps_swig_memdup($1, sizeof(TYPE));
  if (!copy) { PyErr_NoMemory(); SWIG_fail; }
  $result = SWIG_Python_AppendOutput($result,
      SWIG_NewPointerObj(copy, $1_descriptor, SWIG_POINTER_OWN));
}
%apply SWIGTYPE* { const TYPE* options };
%typemap(argout) const TYPE* options ""
%enddef
HPS_PY_OPTIONS(hps_clip_options_t)
HPS_PY_OPTIONS(hps_engine_options_t)

%include "stdint.i"
%include "hpshard.i"
