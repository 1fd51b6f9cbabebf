/*
 * java.i — the Java overlay of hpshard.i: builds org.hpshard.internal.HpshardNative
 * (static methods with the exact C names) over org.hpshard.internal.HpshardNativeJNI
 * (the native methods), used by the hand-written classes in org.hpshard.
 *
 * Enums are plain Java ints (enumtypeunsafe), so any int, even an unknown value, reaches
 * the C library, which rejects it with HPS_STATUS_INVALID_ARGUMENT.
 * Errors: a failing status throws org.hpshard.HpsException(status, message).
 */
%module HpshardNative

%include "enumtypeunsafe.swg"
%javaconst(1);
/* sizeof is no Java constant expression: read it from the library. */
%javaconst(0) HPS_SWIG_PROPERTIES_STRUCT_SIZE;

%{
#include <stdint.h>
#include <string.h>

/* Throw org.hpshard.HpsException(status, message). `message` is copied at once. */
static void hps_java_throw(JNIEnv* jenv, int status, const char* message) {
  jclass cls = (*jenv)->FindClass(jenv, "org/hpshard/HpsException");
  if (!cls) return; /* NoClassDefFoundError is pending */
  jmethodID ctor = (*jenv)->GetMethodID(jenv, cls, "<init>", "(ILjava/lang/String;)V");
  if (!ctor) return;
  jstring text = (*jenv)->NewStringUTF(jenv, message ? message : "");
  if (!text) return;
  jobject exc = (*jenv)->NewObject(jenv, cls, ctor, (jint)status, text);
  if (exc) (*jenv)->Throw(jenv, (jthrowable)exc);
}
%}

%define HPS_SWIG_RAISE(status, message)
  hps_java_throw(jenv, (int)(status), (message)); return $null;
%enddef

/* Put the JNI class and the generated module class in the internal package. */
%pragma(java) jniclassclassmodifiers="public final class"
%pragma(java) moduleclassmodifiers="public final class"
/* The JNI library is loaded once, by org.hpshard.NativeLibrary (system property
 * hpshard.jni.path = absolute path, else System.loadLibrary("hpshard_jni")). */
%pragma(java) jniclasscode=%{
  static {
    org.hpshard.NativeLibrary.load();
  }
%}

/* ---- hps_status_t results ---------------------------------------------------------- */
/* A status result vanishes (a failure throws): void, unless the function has an
 * out-param, whose value is returned instead (HPS_JAVA_RETURNS below). */
%typemap(jni) hps_status_t "void"
%typemap(jtype) hps_status_t "void"
%typemap(jstype) hps_status_t "void"
%typemap(out) hps_status_t ""
%typemap(javaout) hps_status_t { $jnicall; }
/* ... but a status passed IN (hps_status_string) stays an int. */
%typemap(jni) hps_status_t status "jint"
%typemap(jtype) hps_status_t status "int"
%typemap(jstype) hps_status_t status "int"
%typemap(javain) hps_status_t status "$javainput"

%define HPS_JAVA_RETURNS(FUNC, JNITYPE, JTYPE, JAVAOUT)
%typemap(jni) hps_status_t FUNC "JNITYPE"
%typemap(jtype) hps_status_t FUNC "JTYPE"
%typemap(jstype) hps_status_t FUNC "JTYPE"
%typemap(javaout) hps_status_t FUNC JAVAOUT
%enddef
%define HPS_JAVA_RETURNS_PROXY(FUNC, JSTYPE, OWN)
%typemap(jni) hps_status_t FUNC "jlong"
%typemap(jtype) hps_status_t FUNC "long"
%typemap(jstype) hps_status_t FUNC "JSTYPE"
%typemap(javaout) hps_status_t FUNC {
    long cPtr = $jnicall;
    return (cPtr == 0) ? null : new JSTYPE(cPtr, OWN);
  }
%enddef

HPS_JAVA_RETURNS(hps_dtype_size, jlong, long, { return $jnicall; })
HPS_JAVA_RETURNS(hps_dtype_name, jstring, String, { return $jnicall; })
HPS_JAVA_RETURNS(hps_device_count, jint, int, { return $jnicall; })
HPS_JAVA_RETURNS(hps_event_query, jint, int, { return $jnicall; })
HPS_JAVA_RETURNS(hps_host_sync_count_thread, jlong, long, { return $jnicall; })
HPS_JAVA_RETURNS(hps_host_sync_count_total, jlong, long, { return $jnicall; })
/* Handles: not owned by the SWIG object; org.hpshard.Stream / Event destroy them once. */
HPS_JAVA_RETURNS_PROXY(hps_stream_create, SWIGTYPE_p_hps_stream, false)
HPS_JAVA_RETURNS_PROXY(hps_event_create, SWIGTYPE_p_hps_event, false)
/* A properties struct: owned by the proxy (free it with delete()). */
HPS_JAVA_RETURNS_PROXY(hps_device_properties_init, hps_device_properties_t, true)
HPS_JAVA_RETURNS_PROXY(hps_device_get_properties, hps_device_properties_t, true)

/* ---- out-params into the result ---------------------------------------------------- */
%typemap(in, numinputs=0) hps_stream_t** out_stream (hps_stream_t* tmp = NULL) "$1 = &tmp;"
%typemap(argout) hps_stream_t** out_stream "*(hps_stream_t**)&$result = *$1;"
%typemap(in, numinputs=0) hps_event_t** out_event (hps_event_t* tmp = NULL) "$1 = &tmp;"
%typemap(argout) hps_event_t** out_event "*(hps_event_t**)&$result = *$1;"
%typemap(in, numinputs=0) size_t* out_size (size_t tmp = 0) "$1 = &tmp;"
%typemap(argout) size_t* out_size "$result = (jlong)*$1;"
%typemap(in, numinputs=0) const char** out_name (const char* tmp = NULL) "$1 = ($1_ltype)&tmp;"
%typemap(argout) const char** out_name {
  $result = (*jenv)->NewStringUTF(jenv, *$1 ? *$1 : "");
}
%typemap(in, numinputs=0) int32_t* out_count (int32_t tmp = 0) "$1 = &tmp;"
%typemap(argout) int32_t* out_count "$result = (jint)*$1;"
%typemap(in, numinputs=0) int32_t* out_completed (int32_t tmp = 0) "$1 = &tmp;"
%typemap(argout) int32_t* out_completed "$result = (jint)*$1;"
%typemap(in, numinputs=0) uint64_t* out_count (uint64_t tmp = 0) "$1 = &tmp;"
%typemap(argout) uint64_t* out_count "$result = (jlong)*$1;"

/* hps_device_properties_init(struct_size = sizeof) and hps_device_get_properties(type,
 * index) return a new struct (malloc'd, freed by the proxy's delete()). The struct is
 * pre-initialised so hps_device_get_properties accepts it; hps_device_properties_init
 * re-initialises it with the caller's struct_size. */
%typemap(in, numinputs=0) hps_device_properties_t* props (hps_device_properties_t tmp) {
  if (hps_device_properties_init(&tmp, sizeof tmp) != HPS_STATUS_OK) {
    hps_java_throw(jenv, HPS_STATUS_INTERNAL, hps_last_error_message()); return $null;
  }
  $1 = &tmp;
}
%typemap(argout) hps_device_properties_t* props {
  hps_device_properties_t* copy =
      (hps_device_properties_t*)malloc(sizeof(hps_device_properties_t));
  if (!copy) {
    SWIG_JavaThrowException(jenv, SWIG_JavaOutOfMemoryError, "hps_device_properties_t");
    return $null;
  }
  memcpy(copy, $1, sizeof *copy);
  *(hps_device_properties_t**)&$result = copy;
}
/* uint64 sizes as Java long (no BigInteger). */
%apply long long { uint64_t total_memory_bytes };

/* ---- memcpy buffers ---------------------------------------------------------------- */
/* Direct ByteBuffers (or null = NULL). The copy starts at the buffer's address (index 0,
 * whatever its position; pass buffer.slice() to start at the position); `bytes` may not
 * exceed either capacity. The copy runs later: the CALLER keeps both buffers reachable
 * until the stream is synchronised (org.hpshard.Stream does). */
%typemap(jni) void* dst, const void* src "jobject"
%typemap(jtype) void* dst, const void* src "java.nio.ByteBuffer"
%typemap(jstype) void* dst, const void* src "java.nio.ByteBuffer"
%typemap(javain) void* dst, const void* src "$javainput"
%typemap(in) void* dst (jlong dst_cap = 0) {
  $1 = NULL;
  if ($input) {
    $1 = (*jenv)->GetDirectBufferAddress(jenv, $input);
    dst_cap = (*jenv)->GetDirectBufferCapacity(jenv, $input);
    if (!$1 || dst_cap < 0) {
      SWIG_JavaThrowException(jenv, SWIG_JavaIllegalArgumentException,
                              "hps_memcpy_async: dst must be a direct ByteBuffer");
      return $null;
    }
  }
}
%typemap(in) const void* src (jlong src_cap = 0) {
  $1 = NULL;
  if ($input) {
    $1 = (*jenv)->GetDirectBufferAddress(jenv, $input);
    src_cap = (*jenv)->GetDirectBufferCapacity(jenv, $input);
    if (!$1 || src_cap < 0) {
      SWIG_JavaThrowException(jenv, SWIG_JavaIllegalArgumentException,
                              "hps_memcpy_async: src must be a direct ByteBuffer");
      return $null;
    }
  }
}
/* Argument numbers are fixed by the C signature: dst is 1, src is 2. */
%typemap(check) size_t bytes {
  if ((jlong)$1 < 0 || (arg1 && (jlong)$1 > dst_cap1) || (arg2 && (jlong)$1 > src_cap2)) {
    SWIG_JavaThrowException(jenv, SWIG_JavaIllegalArgumentException,
                            "hps_memcpy_async: bytes exceed a buffer's capacity");
    return $null;
  }
}

%include "stdint.i"
%include "hpshard.i"
