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

%include "stdint.i"
%include "hpshard.i"
