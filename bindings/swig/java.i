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
%javaconst(0) HPS_SWIG_RENDEZVOUS_STRUCT_SIZE;
%javaconst(0) HPS_SWIG_COMM_OPTIONS_STRUCT_SIZE;
%javaconst(0) HPS_SWIG_CLIP_OPTIONS_STRUCT_SIZE;
%javaconst(0) HPS_SWIG_ENGINE_OPTIONS_STRUCT_SIZE;

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
HPS_JAVA_RETURNS_PROXY(hps_rendezvous_info_init, hps_rendezvous_info_t, true)
HPS_JAVA_RETURNS_PROXY(hps_rendezvous_from_env, hps_rendezvous_info_t, true)
HPS_JAVA_RETURNS_PROXY(hps_comm_options_init, hps_comm_options_t, true)
/* Stores, communicators, work, topologies, hybrid groups: not owned by the SWIG object;
 * the org.hpshard classes destroy them once. hps_comm_split gives null to non-members. */
HPS_JAVA_RETURNS_PROXY(hps_store_open, SWIGTYPE_p_hps_store, false)
HPS_JAVA_RETURNS(hps_store_get, jbyteArray, byte[], { return $jnicall; })
HPS_JAVA_RETURNS(hps_store_add, jlong, long, { return $jnicall; })
HPS_JAVA_RETURNS(hps_store_check, jint, int, { return $jnicall; })
HPS_JAVA_RETURNS_PROXY(hps_comm_create, SWIGTYPE_p_hps_comm, false)
HPS_JAVA_RETURNS(hps_comm_rank, jint, int, { return $jnicall; })
HPS_JAVA_RETURNS(hps_comm_size, jint, int, { return $jnicall; })
/* {type, index} (the raw hps_device_type_t value) */
HPS_JAVA_RETURNS(hps_comm_device, jintArray, int[], { return $jnicall; })
HPS_JAVA_RETURNS(hps_comm_transport, jstring, String, { return $jnicall; })
HPS_JAVA_RETURNS_PROXY(hps_comm_split, SWIGTYPE_p_hps_comm, false)
HPS_JAVA_RETURNS_PROXY(hps_comm_all_reduce, SWIGTYPE_p_hps_work, false)
HPS_JAVA_RETURNS_PROXY(hps_comm_reduce, SWIGTYPE_p_hps_work, false)
HPS_JAVA_RETURNS_PROXY(hps_comm_broadcast, SWIGTYPE_p_hps_work, false)
HPS_JAVA_RETURNS_PROXY(hps_comm_all_gather, SWIGTYPE_p_hps_work, false)
HPS_JAVA_RETURNS_PROXY(hps_comm_reduce_scatter, SWIGTYPE_p_hps_work, false)
HPS_JAVA_RETURNS_PROXY(hps_comm_send, SWIGTYPE_p_hps_work, false)
HPS_JAVA_RETURNS_PROXY(hps_comm_recv, SWIGTYPE_p_hps_work, false)
HPS_JAVA_RETURNS_PROXY(hps_comm_barrier, SWIGTYPE_p_hps_work, false)
HPS_JAVA_RETURNS(hps_work_test, jint, int, { return $jnicall; })
HPS_JAVA_RETURNS_PROXY(hps_topology_create, SWIGTYPE_p_hps_topology, false)
HPS_JAVA_RETURNS(hps_topology_degree, jint, int, { return $jnicall; })
HPS_JAVA_RETURNS(hps_topology_coordinate, jint, int, { return $jnicall; })
HPS_JAVA_RETURNS(hps_topology_rank_of, jint, int, { return $jnicall; })
HPS_JAVA_RETURNS(hps_topology_group_ranks, jintArray, int[], { return $jnicall; })
/* {prev, next} */
HPS_JAVA_RETURNS(hps_topology_pipeline_neighbors, jintArray, int[], { return $jnicall; })
HPS_JAVA_RETURNS_PROXY(hps_hybrid_group_create, SWIGTYPE_p_hps_hybrid_group, false)
HPS_JAVA_RETURNS_PROXY(hps_hybrid_group_comm, SWIGTYPE_p_hps_comm, false)
/* Clips and engines: not owned by the SWIG object; org.hpshard.Clip / Engine destroy them
 * once. Addresses owned by the library come back as long (0 is NULL). */
HPS_JAVA_RETURNS_PROXY(hps_clip_options_init, hps_clip_options_t, true)
HPS_JAVA_RETURNS_PROXY(hps_clip_create, SWIGTYPE_p_hps_clip, false)
HPS_JAVA_RETURNS(hps_clip_coefficient, jlong, long, { return $jnicall; })
HPS_JAVA_RETURNS_PROXY(hps_engine_options_init, hps_engine_options_t, true)
HPS_JAVA_RETURNS_PROXY(hps_engine_create, SWIGTYPE_p_hps_engine, false)
HPS_JAVA_RETURNS(hps_engine_add_param, jlong, long, { return $jnicall; })
HPS_JAVA_RETURNS(hps_engine_param, jlong, long, { return $jnicall; })
HPS_JAVA_RETURNS(hps_engine_grad, jlong, long, { return $jnicall; })
HPS_JAVA_RETURNS(hps_engine_device, jintArray, int[], { return $jnicall; })
HPS_JAVA_RETURNS(hps_engine_resident_bytes, jlong, long, { return $jnicall; })
/* {begin, end} and {count, nanoseconds} */
HPS_JAVA_RETURNS(hps_engine_shard_range, jlongArray, long[], { return $jnicall; })
HPS_JAVA_RETURNS(hps_dependency_wait_stats, jlongArray, long[], { return $jnicall; })
/* {scale address, skipped-steps address} */
HPS_JAVA_RETURNS(hps_engine_loss_scale, jlongArray, long[], { return $jnicall; })

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

/* ---- new handles and scalars out ---------------------------------------------------- */
%define HPS_JAVA_HANDLE_OUT(TYPE, NAME)
%typemap(in, numinputs=0) TYPE** NAME (TYPE* tmp = NULL) "$1 = &tmp;"
%typemap(argout) TYPE** NAME "*(TYPE**)&$result = *$1;"
%enddef
HPS_JAVA_HANDLE_OUT(hps_store_t, out_store)
HPS_JAVA_HANDLE_OUT(hps_comm_t, out_comm)
HPS_JAVA_HANDLE_OUT(hps_work_t, out_work)
HPS_JAVA_HANDLE_OUT(hps_topology_t, out_topology)
HPS_JAVA_HANDLE_OUT(hps_hybrid_group_t, out_group)
%define HPS_JAVA_INT32_OUT(NAME)
%typemap(in, numinputs=0) int32_t* NAME (int32_t tmp = 0) "$1 = &tmp;"
%typemap(argout) int32_t* NAME "$result = (jint)*$1;"
%enddef
HPS_JAVA_INT32_OUT(out_present)
HPS_JAVA_INT32_OUT(out_rank)
HPS_JAVA_INT32_OUT(out_size)
HPS_JAVA_INT32_OUT(out_degree)
HPS_JAVA_INT32_OUT(out_coordinate)
%typemap(in, numinputs=0) int64_t* out_value (int64_t tmp = 0) "$1 = &tmp;"
%typemap(argout) int64_t* out_value "$result = (jlong)*$1;"
/* hps_topology_pipeline_neighbors -> int[] {prev, next}. */
%typemap(in, numinputs=0) (int32_t* out_prev, int32_t* out_next) (int32_t prev = 0, int32_t next = 0) {
  $1 = &prev;
  $2 = &next;
}
%typemap(argout) (int32_t* out_prev, int32_t* out_next) {
  jint pair[2];
  pair[0] = (jint)*$1;
  pair[1] = (jint)*$2;
  $result = (*jenv)->NewIntArray(jenv, 2);
  if (!$result) return $null;
  (*jenv)->SetIntArrayRegion(jenv, $result, 0, 2, pair);
}

/* hps_comm_device / hps_engine_device -> int[] {type, index}. */
%typemap(in, numinputs=0) (hps_device_type_t* out_type, int32_t* out_index)
    (hps_device_type_t type_tmp = HPS_DEVICE_CPU, int32_t index_tmp = 0) {
  $1 = &type_tmp;
  $2 = &index_tmp;
}
%typemap(argout) (hps_device_type_t* out_type, int32_t* out_index) {
  jint pair[2];
  pair[0] = (jint)*$1;
  pair[1] = (jint)*$2;
  $result = (*jenv)->NewIntArray(jenv, 2);
  if (!$result) return $null;
  (*jenv)->SetIntArrayRegion(jenv, $result, 0, 2, pair);
}

/* ---- rendezvous info and communicator options -------------------------------------- */
/* As the properties struct: a new struct, freed by the proxy's delete(). */
%typemap(in, numinputs=0) hps_rendezvous_info_t* info (hps_rendezvous_info_t tmp) {
  if (hps_rendezvous_info_init(&tmp, sizeof tmp) != HPS_STATUS_OK) {
    hps_java_throw(jenv, HPS_STATUS_INTERNAL, hps_last_error_message()); return $null;
  }
  $1 = &tmp;
}
%typemap(argout) hps_rendezvous_info_t* info {
  hps_rendezvous_info_t* copy = (hps_rendezvous_info_t*)malloc(sizeof(hps_rendezvous_info_t));
  if (!copy) {
    SWIG_JavaThrowException(jenv, SWIG_JavaOutOfMemoryError, "hps_rendezvous_info_t");
    return $null;
  }
  memcpy(copy, $1, sizeof *copy);
  *(hps_rendezvous_info_t**)&$result = copy;
}
/* hps_comm_options_init(struct_size) -> new options (freed, with its copy of the name, by
 * the proxy's delete()). hps_comm_create takes a proxy or null. */
%typemap(in, numinputs=0) hps_comm_options_t* options (hps_comm_options_t tmp) {
  memset(&tmp, 0, sizeof tmp);
  $1 = &tmp;
}
%typemap(argout) hps_comm_options_t* options {
  hps_comm_options_t* copy = hps_swig_comm_options_new($1);
  if (!copy) {
    SWIG_JavaThrowException(jenv, SWIG_JavaOutOfMemoryError, "hps_comm_options_t");
    return $null;
  }
  *(hps_comm_options_t**)&$result = copy;
}
/* hps_comm_create: a proxy or None/null (NULL), and no argout. */
%apply SWIGTYPE* { const hps_comm_options_t* options };
%typemap(argout) const hps_comm_options_t* options ""

/* ---- store values -------------------------------------------------------------------- */
/* hps_store_set(store, key, byte[] value): copied (binary-safe); null is refused. */
%typemap(jni) (const void* value, size_t size) "jbyteArray"
%typemap(jtype) (const void* value, size_t size) "byte[]"
%typemap(jstype) (const void* value, size_t size) "byte[]"
%typemap(javain) (const void* value, size_t size) "$javainput"
%typemap(in) (const void* value, size_t size) {
  jsize n;
  if (!$input) {
    SWIG_JavaThrowException(jenv, SWIG_JavaNullPointerException, "hps_store_set: value is null");
    return $null;
  }
  n = (*jenv)->GetArrayLength(jenv, $input);
  $1 = malloc(n ? (size_t)n : 1);
  if (!$1) {
    SWIG_JavaThrowException(jenv, SWIG_JavaOutOfMemoryError, "hps_store_set");
    return $null;
  }
  (*jenv)->GetByteArrayRegion(jenv, $input, 0, n, (jbyte*)$1);
  $2 = (size_t)n;
}
%typemap(freearg) (const void* value, size_t size) "free((void*)$1);"
/* hps_store_get(store, key, timeout_ms) -> byte[] (grown as needed, see hpshard.i). */
%typemap(in, numinputs=0) (void* buffer, size_t capacity, size_t* out_size) (size_t size_tmp = 0) {
  $2 = 256;
  $1 = malloc($2);
  $3 = &size_tmp;
  if (!$1) {
    SWIG_JavaThrowException(jenv, SWIG_JavaOutOfMemoryError, "hps_store_get");
    return $null;
  }
}
%typemap(argout) (void* buffer, size_t capacity, size_t* out_size) {
  $result = (*jenv)->NewByteArray(jenv, (jsize)*$3);
  if (!$result) { free($1); return $null; }
  (*jenv)->SetByteArrayRegion(jenv, $result, 0, (jsize)*$3, (const jbyte*)$1);
}
%typemap(freearg) (void* buffer, size_t capacity, size_t* out_size) "free($1);"

/* ---- rank lists ---------------------------------------------------------------------- */
/* hps_comm_split(comm, int[] ranks, name); null is NULL. */
%typemap(jni) (const int32_t* ranks, size_t count) "jintArray"
%typemap(jtype) (const int32_t* ranks, size_t count) "int[]"
%typemap(jstype) (const int32_t* ranks, size_t count) "int[]"
%typemap(javain) (const int32_t* ranks, size_t count) "$javainput"
%typemap(in) (const int32_t* ranks, size_t count) {
  $1 = NULL;
  $2 = 0;
  if ($input) {
    jsize n = (*jenv)->GetArrayLength(jenv, $input);
    int32_t* ranks = (int32_t*)malloc((n ? (size_t)n : 1) * sizeof(int32_t));
    if (!ranks) {
      SWIG_JavaThrowException(jenv, SWIG_JavaOutOfMemoryError, "hps_comm_split");
      return $null;
    }
    (*jenv)->GetIntArrayRegion(jenv, $input, 0, n, (jint*)ranks);
    $1 = ranks;
    $2 = (size_t)n;
  }
}
%typemap(freearg) (const int32_t* ranks, size_t count) "free((void*)$1);"
/* hps_topology_group_ranks(topology, group, rank) -> int[] (grown as needed). */
%typemap(in, numinputs=0) (int32_t* out_ranks, size_t capacity, size_t* out_count) (size_t count_tmp = 0) {
  $2 = 64;
  $1 = (int32_t*)malloc($2 * sizeof(int32_t));
  $3 = &count_tmp;
  if (!$1) {
    SWIG_JavaThrowException(jenv, SWIG_JavaOutOfMemoryError, "hps_topology_group_ranks");
    return $null;
  }
}
%typemap(argout) (int32_t* out_ranks, size_t capacity, size_t* out_count) {
  $result = (*jenv)->NewIntArray(jenv, (jsize)*$3);
  if (!$result) { free($1); return $null; }
  (*jenv)->SetIntArrayRegion(jenv, $result, 0, (jsize)*$3, (const jint*)$1);
}
%typemap(freearg) (int32_t* out_ranks, size_t capacity, size_t* out_count) "free($1);"

/* ---- collective buffers -------------------------------------------------------------- */
/* Direct ByteBuffers (null = NULL), from address 0 (pass buffer.slice() to start at the
 * position); outputs must not be read-only. The capacity goes to hps_nbytes<argnum>,
 * checked against count and dtype in hpshard.i. The operation runs later: the CALLER
 * keeps the buffers reachable until the work has completed (org.hpshard.Work does). */
%{
/* 1 when `buffer` is a read-only java.nio.Buffer (an exception may be pending on -1). */
static int hps_java_read_only(JNIEnv* jenv, jobject buffer) {
  jclass cls = (*jenv)->FindClass(jenv, "java/nio/Buffer");
  jmethodID m;
  if (!cls) return -1;
  m = (*jenv)->GetMethodID(jenv, cls, "isReadOnly", "()Z");
  if (!m) return -1;
  return (*jenv)->CallBooleanMethod(jenv, buffer, m) ? 1 : 0;
}
%}
%define HPS_JAVA_COLLECTIVE_BUFFER(DECL, WRITABLE)
%typemap(jni) DECL "jobject"
%typemap(jtype) DECL "java.nio.ByteBuffer"
%typemap(jstype) DECL "java.nio.ByteBuffer"
%typemap(javain) DECL "$javainput"
%typemap(in) DECL (jlong hps_nbytes = 0) {
  $1 = NULL;
  if ($input) {
    $1 = ($1_ltype)(*jenv)->GetDirectBufferAddress(jenv, $input);
    hps_nbytes = (*jenv)->GetDirectBufferCapacity(jenv, $input);
    if (!$1 || hps_nbytes < 0) {
      SWIG_JavaThrowException(jenv, SWIG_JavaIllegalArgumentException,
                              "$symname: $1_name must be a direct ByteBuffer");
      return $null;
    }
    if (WRITABLE) {
      int ro = hps_java_read_only(jenv, $input);
      if (ro < 0) return $null;
      if (ro) {
        SWIG_JavaThrowException(jenv, SWIG_JavaIllegalArgumentException,
                                "$symname: $1_name is read-only");
        return $null;
      }
    }
  }
}
%enddef
HPS_JAVA_COLLECTIVE_BUFFER(const void* send, 0)
HPS_JAVA_COLLECTIVE_BUFFER(const void* buffer, 0)
HPS_JAVA_COLLECTIVE_BUFFER(void* recv, 1)
HPS_JAVA_COLLECTIVE_BUFFER(void* buffer, 1)
/* Element counts as Java long; a negative one does not fit any buffer. */
%apply long long { uint64_t count, uint64_t send_count, uint64_t recv_count };
/* hps_clip_add_tensor's gradient and hps_clip_run's norm_out (one float32): as the
 * collective buffers; the CALLER keeps them reachable (org.hpshard.Clip keeps the gradients
 * while it lives, the stream keeps norm_out until it is synchronised). */
HPS_JAVA_COLLECTIVE_BUFFER(void* data, 1)
HPS_JAVA_COLLECTIVE_BUFFER(float* norm_out, 1)
/* hps_engine_gather_parameter's out (count float32): filled before the call returns. */
HPS_JAVA_COLLECTIVE_BUFFER(float* out, 1)
%define HPS_SWIG_BUFFER_FAIL(message)
  SWIG_JavaThrowException(jenv, SWIG_JavaIllegalArgumentException, (message)); return $null;
%enddef

/* ---- clipping and the engine ----------------------------------------------------------- */
HPS_JAVA_HANDLE_OUT(hps_clip_t, out_clip)
HPS_JAVA_HANDLE_OUT(hps_engine_t, out_engine)
%typemap(in, numinputs=0) size_t* out_index (size_t tmp = 0) "$1 = &tmp;"
%typemap(argout) size_t* out_index "$result = (jlong)*$1;"
%typemap(in, numinputs=0) uint64_t* out_bytes (uint64_t tmp = 0) "$1 = &tmp;"
%typemap(argout) uint64_t* out_bytes "$result = (jlong)*$1;"
%typemap(in, numinputs=0) void** out_data (void* tmp = NULL) "$1 = &tmp;"
%typemap(argout) void** out_data "$result = (jlong)(intptr_t)*$1;"
%typemap(in, numinputs=0) const float** out_coefficient (const float* tmp = NULL) "$1 = ($1_ltype)&tmp;"
%typemap(argout) const float** out_coefficient "$result = (jlong)(intptr_t)*$1;"
/* Two uint64 outputs -> long[] {first, second}. */
%define HPS_JAVA_UINT64_PAIR(A, B)
%typemap(in, numinputs=0) (uint64_t* A, uint64_t* B) (uint64_t a_tmp = 0, uint64_t b_tmp = 0) {
  $1 = &a_tmp;
  $2 = &b_tmp;
}
%typemap(argout) (uint64_t* A, uint64_t* B) {
  jlong pair[2];
  pair[0] = (jlong)*$1;
  pair[1] = (jlong)*$2;
  $result = (*jenv)->NewLongArray(jenv, 2);
  if (!$result) return $null;
  (*jenv)->SetLongArrayRegion(jenv, $result, 0, 2, pair);
}
%enddef
HPS_JAVA_UINT64_PAIR(out_begin, out_end)
HPS_JAVA_UINT64_PAIR(out_count, out_nanoseconds)
/* hps_engine_loss_scale -> long[] {scale address, skipped-steps address}. */
%typemap(in, numinputs=0) (const float** out_scale, const int64_t** out_skipped_steps)
    (const float* a_tmp = NULL, const int64_t* b_tmp = NULL) {
  $1 = ($1_ltype)&a_tmp;
  $2 = ($2_ltype)&b_tmp;
}
%typemap(argout) (const float** out_scale, const int64_t** out_skipped_steps) {
  jlong pair[2];
  pair[0] = (jlong)(intptr_t)*$1;
  pair[1] = (jlong)(intptr_t)*$2;
  $result = (*jenv)->NewLongArray(jenv, 2);
  if (!$result) return $null;
  (*jenv)->SetLongArrayRegion(jenv, $result, 0, 2, pair);
}
/* hps_engine_add_param(engine, name, long[] shape, dtype, flags, unit); null is NULL. */
%typemap(jni) (const int64_t* shape, size_t ndim) "jlongArray"
%typemap(jtype) (const int64_t* shape, size_t ndim) "long[]"
%typemap(jstype) (const int64_t* shape, size_t ndim) "long[]"
%typemap(javain) (const int64_t* shape, size_t ndim) "$javainput"
%typemap(in) (const int64_t* shape, size_t ndim) {
  $1 = NULL;
  $2 = 0;
  if ($input) {
    jsize n = (*jenv)->GetArrayLength(jenv, $input);
    int64_t* dims = (int64_t*)malloc((n ? (size_t)n : 1) * sizeof(int64_t));
    if (!dims) {
      SWIG_JavaThrowException(jenv, SWIG_JavaOutOfMemoryError, "hps_engine_add_param");
      return $null;
    }
    (*jenv)->GetLongArrayRegion(jenv, $input, 0, n, (jlong*)dims);
    $1 = dims;
    $2 = (size_t)n;
  }
}
%typemap(freearg) (const int64_t* shape, size_t ndim) "free((void*)$1);"
/* hps_clip_options_init / hps_engine_options_init(struct_size) -> new options (freed by the
 * proxy's delete()); hps_clip_create / hps_engine_create take a proxy or null. */
%define HPS_JAVA_OPTIONS(TYPE)
%typemap(in, numinputs=0) TYPE* options (TYPE tmp) {
  memset(&tmp, 0, sizeof tmp);
  $1 = &tmp;
}
%typemap(argout) TYPE* options {
  TYPE* copy = (TYPE*)hps_swig_memdup($1, sizeof(TYPE));
  if (!copy) {
    SWIG_JavaThrowException(jenv, SWIG_JavaOutOfMemoryError, "TYPE");
    return $null;
  }
  *(TYPE**)&$result = copy;
}
%apply SWIGTYPE* { const TYPE* options };
%typemap(argout) const TYPE* options ""
%enddef
HPS_JAVA_OPTIONS(hps_clip_options_t)
HPS_JAVA_OPTIONS(hps_engine_options_t)
%apply long long { uint64_t alignment_bytes };

%include "stdint.i"
%include "hpshard.i"

/* ---- binding-side helper: a direct ByteBuffer over library-owned memory ----------------- */
/* hps_swig_direct_buffer(address, bytes): NewDirectByteBuffer over `bytes` bytes at
 * `address` (an address from hps_engine_param / hps_engine_grad / hps_clip_coefficient).
 * It does not own the memory: the org.hpshard classes document when it becomes invalid. */
%{
static jobject hps_swig_direct_buffer(JNIEnv* jenv, jlong address, jlong bytes) {
  jobject buffer;
  if (address == 0 || bytes < 0) {
    SWIG_JavaThrowException(jenv, SWIG_JavaIllegalArgumentException,
                            "hps_swig_direct_buffer: NULL address or negative size");
    return NULL;
  }
  buffer = (*jenv)->NewDirectByteBuffer(jenv, (void*)(intptr_t)address, bytes);
  if (!buffer && !(*jenv)->ExceptionCheck(jenv)) {
    SWIG_JavaThrowException(jenv, SWIG_JavaRuntimeException,
                            "hps_swig_direct_buffer: the JVM has no direct buffer access");
  }
  return buffer;
}
%}
%typemap(in, numinputs=0) JNIEnv* jenv "$1 = jenv;"
%typemap(jni) jobject hps_swig_direct_buffer "jobject"
%typemap(jtype) jobject hps_swig_direct_buffer "java.nio.ByteBuffer"
%typemap(jstype) jobject hps_swig_direct_buffer "java.nio.ByteBuffer"
%typemap(javaout) jobject hps_swig_direct_buffer { return $jnicall; }
%typemap(out) jobject hps_swig_direct_buffer "$result = $1;"
%hps_unignore hps_swig_direct_buffer;
%noexception hps_swig_direct_buffer;
jobject hps_swig_direct_buffer(JNIEnv* jenv, jlong address, jlong bytes);
