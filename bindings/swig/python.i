/*
 * python.i — the Python overlay of hpshard.i: builds hpshard.capi, the low-level module
 * (handle classes StreamHandle ... EngineHandle, free functions named as in C without
 * "hps_"), under the hand-written package hpshard (bindings/python/).
 *
 * Errors: a failing status raises hpshard.Error (or its per-status subclass), made by
 * hpshard._errors._from_status(status, message); without that module (a bare import of
 * the extension) RuntimeError. A buffer refused by the binding itself raises ValueError.
 */
%module(package="hpshard", threads="1") capi

/* No GIL release for calls that cannot block. */
%nothread hps_status_string;
%nothread hps_last_error_message;
%nothread hps_version_number;
%nothread hps_version_string;

%{
#include <string.h>

#include "hpshard/hpshard.h"

/* Raise the exception for a failing status. `message` is copied at once. */
static void hps_py_raise(int status, const char* message) {
  PyObject* text;
  PyObject* exc = NULL;
  PyObject* mod;
  if (status == -1) { /* HPS_SWIG_ARGUMENT_ERROR */
    PyErr_SetString(PyExc_ValueError, message ? message : "");
    return;
  }
  text = PyUnicode_DecodeUTF8(message ? message : "", (Py_ssize_t)strlen(message ? message : ""),
                              "replace");
  mod = PyImport_ImportModule("hpshard._errors");
  if (mod) {
    PyObject* factory = PyObject_GetAttrString(mod, "_from_status");
    if (factory && text) exc = PyObject_CallFunction(factory, "iO", status, text);
    Py_XDECREF(factory);
    Py_DECREF(mod);
  }
  if (exc) {
    PyErr_SetObject((PyObject*)Py_TYPE(exc), exc);
    Py_DECREF(exc);
  } else if (PyErr_ExceptionMatches(PyExc_KeyboardInterrupt)) {
    /* Ctrl-C arrived during the call and its handler ran while the error was being built:
     * the interrupt is what the caller gets, as from any interrupted Python call. */
  } else {
    PyErr_Clear();
    PyErr_Format(PyExc_RuntimeError, "hpshard status %d: %s", status, message ? message : "");
  }
  Py_XDECREF(text);
}

/* DLPack capsules (the Python array API's protocol): "dltensor" until a consumer takes
 * the tensor and renames it "used_dltensor"; an unconsumed one releases it when freed. */
static void hps_py_capsule_free(PyObject* capsule) {
  if (PyCapsule_IsValid(capsule, "dltensor")) {
    DLManagedTensor* t = (DLManagedTensor*)PyCapsule_GetPointer(capsule, "dltensor");
    hps_dlpack_release(t);
  } else {
    PyErr_Clear();
  }
}
%}

%define HPS_SWIG_RAISE(status, message)
  hps_py_raise((int)(status), (message)); SWIG_fail;
%enddef

/* ---- value types ------------------------------------------------------------------- */
%typemap(out) hps_swig_pair "$result = Py_BuildValue(\"(LL)\", (long long)$1.first, (long long)$1.second);"
%typemap(out) hps_swig_ints {
  size_t i;
  $result = PyList_New((Py_ssize_t)$1.count);
  for (i = 0; $result && i < $1.count; ++i)
    PyList_SET_ITEM($result, (Py_ssize_t)i, PyLong_FromLong((long)$1.data[i]));
  free($1.data);
  if (!$result) SWIG_fail;
}
%typemap(out) hps_swig_bytes {
  $result = PyBytes_FromStringAndSize($1.data ? $1.data : "", (Py_ssize_t)$1.size);
  free($1.data);
  if (!$result) SWIG_fail;
}
%typemap(out) uintptr_t "$result = PyLong_FromUnsignedLongLong((unsigned long long)$1);"

/* ---- DLPack tensors ---------------------------------------------------------------- */
/* Handed out: a "dltensor" capsule owning the view (NULL: None). */
%typemap(out) TensorHandle* {
  if ($1) {
    $result = PyCapsule_New((void*)$1, "dltensor", hps_py_capsule_free);
    if (!$result) { hps_dlpack_release((DLManagedTensor*)$1); SWIG_fail; }
  } else {
    $result = SWIG_Py_Void();
  }
}
/* Taken: a "dltensor" capsule (not consumed: it still owns the tensor), or None (NULL). */
%typemap(in) const DLTensor* {
  if ($input == Py_None) {
    $1 = NULL;
  } else if (PyCapsule_IsValid($input, "dltensor")) {
    $1 = &((DLManagedTensor*)PyCapsule_GetPointer($input, "dltensor"))->dl_tensor;
  } else {
    PyErr_SetString(PyExc_TypeError, "$symname: $1_name must be a \"dltensor\" capsule "
                    "(from __dlpack__()) or None");
    SWIG_fail;
  }
}

/* ---- buffers ------------------------------------------------------------------------- */
/* C-contiguous buffer-protocol objects (None is NULL); outputs must be writable. The
 * export is released at once: the CALLER keeps the object alive and un-resized while the
 * library uses it (hpshard.Work, Stream and Clip do). */
%define HPS_PY_BUFFER(TYPE, FLAGS, TEXT)
%typemap(in) TYPE {
  $1.data = NULL;
  $1.nbytes = 0;
  if ($input != Py_None) {
    Py_buffer view;
    if (PyObject_GetBuffer($input, &view, FLAGS) != 0) {
      PyErr_Clear();
      PyErr_SetString(PyExc_ValueError, "$symname: $1_name must be " TEXT);
      SWIG_fail;
    }
    $1.data = view.buf;
    $1.nbytes = (long long)view.len;
    PyBuffer_Release(&view);
  }
}
%enddef
HPS_PY_BUFFER(hps_swig_in_buffer, PyBUF_C_CONTIGUOUS, "a C-contiguous buffer")
HPS_PY_BUFFER(hps_swig_out_buffer, PyBUF_WRITABLE | PyBUF_C_CONTIGUOUS,
              "a writable, C-contiguous buffer")

/* hps_store::set(key, value): any bytes-like object, copied (binary-safe). */
%typemap(in) (const void* value, size_t size) {
  Py_buffer view;
  if (PyObject_GetBuffer($input, &view, PyBUF_C_CONTIGUOUS) != 0) {
    PyErr_Clear();
    PyErr_SetString(PyExc_TypeError, "store set: value must be a bytes-like object");
    SWIG_fail;
  }
  $1 = malloc(view.len ? (size_t)view.len : 1);
  if (!$1) { PyBuffer_Release(&view); PyErr_NoMemory(); SWIG_fail; }
  memcpy((void*)$1, view.buf, (size_t)view.len);
  $2 = (size_t)view.len;
  PyBuffer_Release(&view);
}
%typemap(freearg) (const void* value, size_t size) "free((void*)$1);"

/* Sequences of ints: hps_comm::split's ranks (int32), hps_engine::add_param's shape (int64). */
%define HPS_PY_INT_SEQUENCE(DECL, CTYPE, PYCONV, MIN, MAX)
%typemap(in) DECL {
  PyObject* seq = PySequence_Fast($input, "$symname: $1_name must be a sequence of ints");
  Py_ssize_t n, i;
  CTYPE* items;
  if (!seq) SWIG_fail;
  n = PySequence_Fast_GET_SIZE(seq);
  items = (CTYPE*)malloc((n ? (size_t)n : 1) * sizeof(CTYPE));
  if (!items) { Py_DECREF(seq); PyErr_NoMemory(); SWIG_fail; }
  $1 = items;
  $2 = (size_t)n;
  for (i = 0; i < n; ++i) {
    long long v = PYCONV(PySequence_Fast_GET_ITEM(seq, i));
    if (v == -1 && PyErr_Occurred()) { Py_DECREF(seq); SWIG_fail; }
    if (v < MIN || v > MAX) {
      Py_DECREF(seq);
      PyErr_Format(PyExc_OverflowError, "$symname: %lld is out of range", v);
      SWIG_fail;
    }
    items[i] = (CTYPE)v;
  }
  Py_DECREF(seq);
}
%typemap(freearg) DECL "free((void*)$1);"
%enddef
HPS_PY_INT_SEQUENCE((const int32_t* ranks, size_t count), int32_t, PyLong_AsLongLong, INT32_MIN,
                    INT32_MAX)
HPS_PY_INT_SEQUENCE((const int64_t* shape, size_t ndim), int64_t, PyLong_AsLongLong, INT64_MIN,
                    INT64_MAX)

/* A string argument (a path, a name, a store address): str (or None where C takes NULL);
 * one holding a NUL is refused, as os.open refuses it, instead of being cut short there. */
%typemap(in, noblock = 1, fragment = "SWIG_AsCharPtrAndSize") const char*
    (int res, char* buf = 0, size_t size = 0, int alloc = 0) {
  res = SWIG_AsCharPtrAndSize($input, &buf, &size, &alloc);
  if (!SWIG_IsOK(res)) {
    %argument_fail(res, "$type", $symname, $argnum);
  }
  if (buf != NULL && size > 0 && strlen(buf) != size - 1) {
    PyErr_SetString(PyExc_ValueError, "$symname: a string argument holds a NUL character");
    SWIG_fail;
  }
  $1 = buf;
}
%typemap(freearg, noblock = 1) const char* {
  if (alloc$argnum == SWIG_NEWOBJ) %delete_array(buf$argnum);
}

/* A file system path (a checkpoint, its root, an export's output): str, encoded as os.fsencode
 * does (the file system's encoding with surrogateescape, so a name os.listdir gave for bytes
 * that are not UTF-8 reaches that file), or bytes; None where C takes NULL. One holding a NUL
 * is refused. */
%define HPS_PY_PATH(NAME)
%typemap(in, noblock = 1) const char* NAME (PyObject* encoded = NULL) {
  if ($input == Py_None) {
    $1 = NULL;
  } else {
    if (PyUnicode_Check($input)) {
      encoded = PyUnicode_EncodeFSDefault($input);
    } else if (PyBytes_Check($input)) {
      Py_INCREF($input);
      encoded = $input;
    }
    if (!encoded) {
      if (!PyErr_Occurred()) PyErr_SetString(PyExc_TypeError, "$symname: a path must be str or bytes");
      SWIG_fail;
    }
    if (strlen(PyBytes_AS_STRING(encoded)) != (size_t)PyBytes_GET_SIZE(encoded)) {
      PyErr_SetString(PyExc_ValueError, "$symname: a path holds a NUL character");
      SWIG_fail;
    }
    $1 = PyBytes_AS_STRING(encoded);
  }
}
%typemap(freearg, noblock = 1) const char* NAME { Py_XDECREF(encoded$argnum); }
%enddef
HPS_PY_PATH(path)
HPS_PY_PATH(out)
HPS_PY_PATH(root)

/* A checkpoint's metadata: a flat sequence of str, key, value, key, value... (copied as
 * UTF-8; a str holding a NUL is refused). */
%typemap(in) (const char* const* keys, const char* const* values, size_t count) {
  PyObject* seq = PySequence_Fast($input, "$symname: metadata must be a sequence of str");
  Py_ssize_t n, i;
  char** block;
  if (!seq) SWIG_fail;
  n = PySequence_Fast_GET_SIZE(seq);
  if (n % 2 != 0) {
    Py_DECREF(seq);
    PyErr_SetString(PyExc_ValueError, "$symname: metadata needs a value for every key");
    SWIG_fail;
  }
  block = (char**)calloc(n ? (size_t)n : 1, sizeof(char*));
  if (!block) { Py_DECREF(seq); PyErr_NoMemory(); SWIG_fail; }
  $3 = (size_t)(n / 2);
  $1 = ($1_ltype)block;
  $2 = ($2_ltype)(block + n / 2);
  for (i = 0; i < n; ++i) {
    PyObject* item = PySequence_Fast_GET_ITEM(seq, i);
    char** slot = &block[i % 2 == 0 ? i / 2 : n / 2 + i / 2]; /* keys first, then values */
    Py_ssize_t length = 0;
    const char* text = PyUnicode_Check(item) ? PyUnicode_AsUTF8AndSize(item, &length) : NULL;
    if (!text) {
      Py_DECREF(seq);
      if (!PyErr_Occurred()) PyErr_SetString(PyExc_TypeError, "$symname: metadata keys and values must be str");
      SWIG_fail;
    }
    if ((size_t)length != strlen(text)) {
      Py_DECREF(seq);
      PyErr_SetString(PyExc_ValueError, "$symname: a metadata key or value holds a NUL character");
      SWIG_fail;
    }
    *slot = (char*)malloc((size_t)length + 1);
    if (!*slot) { Py_DECREF(seq); PyErr_NoMemory(); SWIG_fail; }
    memcpy(*slot, text, (size_t)length + 1);
  }
  Py_DECREF(seq);
}
%typemap(freearg) (const char* const* keys, const char* const* values, size_t count) "hps_swig_free_strings($1, $3);"

%include "stdint.i"
%include "hpshard.i"
