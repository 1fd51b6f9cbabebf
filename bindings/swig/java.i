/*
 * java.i — the Java overlay of hpshard.i: builds org.hpshard.internal (the handle classes
 * StreamHandle ... EngineHandle and TensorHandle with lowerCamelCase methods, and the
 * static functions of HpshardNative) over HpshardNativeJNI, used by the hand-written
 * classes in org.hpshard.
 *
 * Enums are plain Java ints (enumtypeunsafe), so any int, even an unknown value, reaches
 * the C library, which rejects it with HPS_STATUS_INVALID_ARGUMENT. Unsigned 64-bit values
 * are Java longs. A failing status throws org.hpshard.HpsException(status, message); a
 * buffer refused by the binding itself, IllegalArgumentException.
 */
%module HpshardNative

%include "enumtypeunsafe.swg"
%javaconst(1);

%{
#include <stdint.h>
#include <string.h>

#include "hpshard/hpshard.h"

/* Strings cross as standard UTF-8, which the C API takes and gives: JNI's own
 * GetStringUTFChars / NewStringUTF use "modified UTF-8" (a character outside the BMP as
 * two 3-byte surrogates, NUL as C0 80), which the library refuses as invalid or shows
 * mangled. */
static jstring hps_java_utf8_out(JNIEnv* jenv, const char* text);

/* A new NUL-terminated UTF-8 copy of `s` (free it), or NULL with IllegalArgumentException
 * (a NUL, an unpaired surrogate: neither has a C string form) or OutOfMemoryError pending. */
static char* hps_java_utf8_in(JNIEnv* jenv, jstring s, const char* where) {
  const jsize n = (*jenv)->GetStringLength(jenv, s);
  const jchar* units = (*jenv)->GetStringChars(jenv, s, NULL);
  char* out;
  size_t k = 0;
  jsize i;
  const char* refused = NULL;
  if (!units) return NULL; /* OutOfMemoryError pending */
  out = (char*)malloc((size_t)n * 3 + 1);
  if (!out) {
    (*jenv)->ReleaseStringChars(jenv, s, units);
    (*jenv)->ThrowNew(jenv, (*jenv)->FindClass(jenv, "java/lang/OutOfMemoryError"), where);
    return NULL;
  }
  for (i = 0; i < n && !refused; ++i) {
    uint32_t c = units[i];
    if (c == 0) {
      refused = "holds a NUL character, which a C string cannot carry";
    } else if (c >= 0xD800 && c <= 0xDBFF && i + 1 < n && units[i + 1] >= 0xDC00 &&
               units[i + 1] <= 0xDFFF) {
      c = 0x10000 + ((c - 0xD800) << 10) + (uint32_t)(units[i + 1] - 0xDC00);
      ++i;
    } else if (c >= 0xD800 && c <= 0xDFFF) {
      refused = "holds an unpaired surrogate, which UTF-8 cannot carry";
    }
    if (c < 0x80) {
      out[k++] = (char)c;
    } else if (c < 0x800) {
      out[k++] = (char)(0xC0 | (c >> 6));
      out[k++] = (char)(0x80 | (c & 0x3F));
    } else if (c < 0x10000) {
      out[k++] = (char)(0xE0 | (c >> 12));
      out[k++] = (char)(0x80 | ((c >> 6) & 0x3F));
      out[k++] = (char)(0x80 | (c & 0x3F));
    } else {
      out[k++] = (char)(0xF0 | (c >> 18));
      out[k++] = (char)(0x80 | ((c >> 12) & 0x3F));
      out[k++] = (char)(0x80 | ((c >> 6) & 0x3F));
      out[k++] = (char)(0x80 | (c & 0x3F));
    }
  }
  (*jenv)->ReleaseStringChars(jenv, s, units);
  out[k] = '\0';
  if (refused) {
    char message[256];
    free(out);
    snprintf(message, sizeof message, "%s: a string argument %s", where, refused);
    (*jenv)->ThrowNew(jenv, (*jenv)->FindClass(jenv, "java/lang/IllegalArgumentException"),
                      message);
    return NULL;
  }
  return out;
}

/* `text` (UTF-8; a byte that is not, as U+FFFD) as a Java string; NULL with an exception
 * pending when the JVM has no memory. */
static jstring hps_java_utf8_out(JNIEnv* jenv, const char* text) {
  const size_t n = strlen(text);
  jchar* units = (jchar*)malloc((n ? n : 1) * sizeof(jchar));
  size_t i = 0, k = 0;
  jstring result;
  if (!units) {
    (*jenv)->ThrowNew(jenv, (*jenv)->FindClass(jenv, "java/lang/OutOfMemoryError"), "string");
    return NULL;
  }
  while (i < n) {
    const unsigned char b = (unsigned char)text[i];
    uint32_t c = 0xFFFD;
    size_t len = 1, j;
    uint32_t min = 0;
    if (b < 0x80) {
      c = b;
    } else if (b >= 0xC2 && b <= 0xDF) {
      len = 2, c = b & 0x1F, min = 0x80;
    } else if (b >= 0xE0 && b <= 0xEF) {
      len = 3, c = b & 0x0F, min = 0x800;
    } else if (b >= 0xF0 && b <= 0xF4) {
      len = 4, c = b & 0x07, min = 0x10000;
    }
    if (len > 1) {
      for (j = 1; j < len; ++j) {
        const unsigned char t = i + j < n ? (unsigned char)text[i + j] : 0;
        if ((t & 0xC0) != 0x80) break;
        c = (c << 6) | (t & 0x3F);
      }
      if (j < len || c < min || c > 0x10FFFF || (c >= 0xD800 && c <= 0xDFFF)) {
        c = 0xFFFD; /* malformed: one replacement, resynchronised at the next byte */
        len = 1;
      }
    }
    if (c >= 0x10000) {
      units[k++] = (jchar)(0xD800 + ((c - 0x10000) >> 10));
      units[k++] = (jchar)(0xDC00 + ((c - 0x10000) & 0x3FF));
    } else {
      units[k++] = (jchar)c;
    }
    i += len;
  }
  result = (*jenv)->NewString(jenv, units, (jsize)k);
  free(units);
  return result;
}

/* Throw org.hpshard.HpsException(status, message), or IllegalArgumentException for an
 * argument the binding refused (status -1). `message` is copied at once. */
static void hps_java_throw(JNIEnv* jenv, int status, const char* message) {
  jclass cls;
  jmethodID ctor;
  jstring text;
  jobject exc;
  if (status == -1) {
    cls = (*jenv)->FindClass(jenv, "java/lang/IllegalArgumentException");
    if (cls) (*jenv)->ThrowNew(jenv, cls, message ? message : "");
    return;
  }
  cls = (*jenv)->FindClass(jenv, "org/hpshard/HpsException");
  if (!cls) return; /* NoClassDefFoundError is pending */
  ctor = (*jenv)->GetMethodID(jenv, cls, "<init>", "(ILjava/lang/String;)V");
  if (!ctor) return;
  text = hps_java_utf8_out(jenv, message ? message : "");
  if (!text) return;
  exc = (*jenv)->NewObject(jenv, cls, ctor, (jint)status, text);
  if (exc) (*jenv)->Throw(jenv, (jthrowable)exc);
}
%}

%define HPS_SWIG_RAISE(status, message)
  hps_java_throw(jenv, (int)(status), (message)); return $null;
%enddef

/* The generated classes live in org.hpshard.internal; the JNI library is loaded once, by
 * org.hpshard.NativeLibrary (system property hpshard.jni.path = absolute path, else
 * System.loadLibrary("hpshard_jni")). */
%pragma(java) jniclassclassmodifiers="public final class"
%pragma(java) moduleclassmodifiers="public final class"
%pragma(java) jniclasscode=%{
  static {
    org.hpshard.NativeLibrary.load();
  }
%}
/* Object.wait() is final in Java: the work's wait is await(). */
%rename(await) WorkHandle::wait;
/* Handles are closed by org.hpshard.Handle (a Cleaner), never by a finalizer. */
%typemap(javafinalize) SWIGTYPE ""

/* ---- scalars -------------------------------------------------------------------------- */
%apply long long { uint64_t };
%typemap(jni) uintptr_t "jlong"
%typemap(jtype) uintptr_t "long"
%typemap(jstype) uintptr_t "long"
%typemap(out) uintptr_t "$result = (jlong)$1;"
%typemap(javaout) uintptr_t { return $jnicall; }

/* A parameter index is a size_t: a negative Java value would reach the library as
   2^64 - k ("no parameter 18446744073709551615"). */
%typemap(check) size_t index {
  if ((long long)$1 < 0) {
    char message[64];
    snprintf(message, sizeof message, "no parameter %lld", (long long)$1);
    SWIG_JavaThrowException(jenv, SWIG_JavaIndexOutOfBoundsException, message);
    return $null;
  }
}

/* ---- value types ---------------------------------------------------------------------- */
%define HPS_JAVA_ARRAY_OUT(CTYPE, JNITYPE, JAVATYPE, NEW, SET, JELEM, DATA, COUNT, FREE)
%typemap(jni) CTYPE "JNITYPE"
%typemap(jtype) CTYPE "JAVATYPE"
%typemap(jstype) CTYPE "JAVATYPE"
%typemap(javaout) CTYPE { return $jnicall; }
%typemap(out) CTYPE {
  $result = (*jenv)->NEW(jenv, (jsize)(COUNT));
  if ($result && (COUNT) > 0) (*jenv)->SET(jenv, $result, 0, (jsize)(COUNT), (const JELEM*)(DATA));
  FREE;
  if (!$result) return $null;
}
%enddef
%{
#define HPS_JAVA_PAIR_DATA(p) ((const jlong[2]){(jlong)(p).first, (jlong)(p).second})
%}
HPS_JAVA_ARRAY_OUT(hps_swig_pair, jlongArray, long[], NewLongArray, SetLongArrayRegion, jlong,
                   HPS_JAVA_PAIR_DATA($1), 2, (void)0)
HPS_JAVA_ARRAY_OUT(hps_swig_ints, jintArray, int[], NewIntArray, SetIntArrayRegion, jint,
                   $1.data, $1.count, free($1.data))
HPS_JAVA_ARRAY_OUT(hps_swig_bytes, jbyteArray, byte[], NewByteArray, SetByteArrayRegion, jbyte,
                   $1.data, $1.size, free($1.data))

/* ---- DLPack tensors -------------------------------------------------------------------- */
/* Taken: a TensorHandle (its DLTensor) or null (NULL). */
%typemap(jni) const DLTensor* "jlong"
%typemap(jtype) const DLTensor* "long"
%typemap(jstype) const DLTensor* "TensorHandle"
%typemap(javain) const DLTensor* "TensorHandle.getCPtr($javainput)"
%typemap(in) const DLTensor* {
  DLManagedTensor* hps_t = *(DLManagedTensor**)&$input;
  $1 = hps_t ? &hps_t->dl_tensor : NULL;
}

/* ---- buffers ---------------------------------------------------------------------------- */
/* Direct ByteBuffers (null = NULL), from address 0 (pass buffer.slice() to start at the
 * position); outputs must not be read-only. The CALLER keeps them reachable while the
 * library uses them (org.hpshard.Work, Stream and Clip do). */
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
%define HPS_JAVA_BUFFER(TYPE, WRITABLE)
%typemap(jni) TYPE "jobject"
%typemap(jtype) TYPE "java.nio.ByteBuffer"
%typemap(jstype) TYPE "java.nio.ByteBuffer"
%typemap(javain) TYPE "$javainput"
%typemap(in) TYPE {
  $1.data = NULL;
  $1.nbytes = 0;
  if ($input) {
    jlong capacity = (*jenv)->GetDirectBufferCapacity(jenv, $input);
    $1.data = (*jenv)->GetDirectBufferAddress(jenv, $input);
    if (!$1.data || capacity < 0) {
      hps_java_throw(jenv, -1, "$symname: $1_name must be a direct ByteBuffer");
      return $null;
    }
    $1.nbytes = (long long)capacity;
    if (WRITABLE) {
      int ro = hps_java_read_only(jenv, $input);
      if (ro < 0) return $null;
      if (ro) {
        hps_java_throw(jenv, -1, "$symname: $1_name is read-only");
        return $null;
      }
    }
  }
}
%enddef
HPS_JAVA_BUFFER(hps_swig_in_buffer, 0)
HPS_JAVA_BUFFER(hps_swig_out_buffer, 1)

/* hps_store::set(key, byte[] value): copied (binary-safe); null is refused. */
%typemap(jni) (const void* value, size_t size) "jbyteArray"
%typemap(jtype) (const void* value, size_t size) "byte[]"
%typemap(jstype) (const void* value, size_t size) "byte[]"
%typemap(javain) (const void* value, size_t size) "$javainput"
%typemap(in) (const void* value, size_t size) {
  jsize n;
  if (!$input) {
    SWIG_JavaThrowException(jenv, SWIG_JavaNullPointerException, "store set: value is null");
    return $null;
  }
  n = (*jenv)->GetArrayLength(jenv, $input);
  $1 = malloc(n ? (size_t)n : 1);
  if (!$1) {
    SWIG_JavaThrowException(jenv, SWIG_JavaOutOfMemoryError, "store set");
    return $null;
  }
  (*jenv)->GetByteArrayRegion(jenv, $input, 0, n, (jbyte*)$1);
  $2 = (size_t)n;
}
%typemap(freearg) (const void* value, size_t size) "free((void*)$1);"

/* Arrays of ints: hps_comm::split's ranks (int[]), hps_engine::add_param's shape (long[]);
 * null is NULL. */
%define HPS_JAVA_INT_ARRAY(DECL, JNITYPE, JAVATYPE, CTYPE, GET, JELEM)
%typemap(jni) DECL "JNITYPE"
%typemap(jtype) DECL "JAVATYPE"
%typemap(jstype) DECL "JAVATYPE"
%typemap(javain) DECL "$javainput"
%typemap(in) DECL {
  $1 = NULL;
  $2 = 0;
  if ($input) {
    jsize n = (*jenv)->GetArrayLength(jenv, $input);
    CTYPE* items = (CTYPE*)malloc((n ? (size_t)n : 1) * sizeof(CTYPE));
    if (!items) {
      SWIG_JavaThrowException(jenv, SWIG_JavaOutOfMemoryError, "$symname");
      return $null;
    }
    (*jenv)->GET(jenv, $input, 0, n, (JELEM*)items);
    $1 = items;
    $2 = (size_t)n;
  }
}
%typemap(freearg) DECL "free((void*)$1);"
%enddef
HPS_JAVA_INT_ARRAY((const int32_t* ranks, size_t count), jintArray, int[], int32_t,
                   GetIntArrayRegion, jint)
HPS_JAVA_INT_ARRAY((const int64_t* shape, size_t ndim), jlongArray, long[], int64_t,
                   GetLongArrayRegion, jlong)

/* A checkpoint's metadata: String[] {key, value, key, value...}, copied (null: none). The
 * hand-written layer refuses null keys and values before the call. */
%typemap(jni) (const char* const* keys, const char* const* values, size_t count) "jobjectArray"
%typemap(jtype) (const char* const* keys, const char* const* values, size_t count) "String[]"
%typemap(jstype) (const char* const* keys, const char* const* values, size_t count) "String[]"
%typemap(javain) (const char* const* keys, const char* const* values, size_t count) "$javainput"
%typemap(in) (const char* const* keys, const char* const* values, size_t count) {
  jsize n = $input ? (*jenv)->GetArrayLength(jenv, $input) : 0;
  jsize i;
  char** block;
  if (n % 2 != 0) {
    hps_java_throw(jenv, -1, "$symname: metadata needs a value for every key");
    return $null;
  }
  block = (char**)calloc(n ? (size_t)n : 1, sizeof(char*));
  if (!block) {
    SWIG_JavaThrowException(jenv, SWIG_JavaOutOfMemoryError, "$symname");
    return $null;
  }
  for (i = 0; i < n; ++i) {
    jstring item = (jstring)(*jenv)->GetObjectArrayElement(jenv, $input, i);
    char** slot = &block[i % 2 == 0 ? i / 2 : n / 2 + i / 2]; /* keys first, then values */
    if (item) *slot = hps_java_utf8_in(jenv, item, "$symname: metadata");
    if (item) (*jenv)->DeleteLocalRef(jenv, item);
    if (!*slot) {
      hps_swig_free_strings(block, (size_t)n / 2);
      if (!(*jenv)->ExceptionCheck(jenv)) {
        SWIG_JavaThrowException(jenv, item ? SWIG_JavaOutOfMemoryError : SWIG_JavaNullPointerException,
                                "$symname: a metadata key or value");
      }
      return $null;
    }
  }
  $1 = ($1_ltype)block;
  $2 = ($2_ltype)(block + n / 2);
  $3 = (size_t)(n / 2);
}
%typemap(freearg) (const char* const* keys, const char* const* values, size_t count) "hps_swig_free_strings($1, $3);"

/* Every string argument and result as standard UTF-8 (see hps_java_utf8_in). */
%typemap(in, noblock=1) char* {
  $1 = NULL;
  if ($input) {
    $1 = ($1_ltype)hps_java_utf8_in(jenv, $input, "$symname");
    if (!$1) return $null;
  }
}
%typemap(freearg, noblock=1) char* { free((void*)$1); }
%typemap(out, noblock=1) char* { if ($1) $result = hps_java_utf8_out(jenv, (const char*)$1); }
%typemap(out, noblock=1) char[ANY] { $result = hps_java_utf8_out(jenv, (const char*)$1); }

%include "stdint.i"
%include "hpshard.i"

/* ---- a direct ByteBuffer over library memory ------------------------------------------- */
/* HpshardNative.directBuffer(address, bytes, owner): a direct ByteBuffer over `bytes`
 * bytes at `address` (host memory of a view) that keeps `owner` reachable for as long as
 * it, or any buffer derived from it, is: JDK 17's DirectByteBuffer has an attachment for
 * that, which JNI may fill through its constructor. Without that constructor (another
 * JDK), a plain JNI direct buffer, and `owner` stays reachable for the process's life. */
%{
static jobject hps_java_direct_buffer(JNIEnv* jenv, uintptr_t address, int64_t bytes,
                                      jobject owner) {
  jclass cls;
  jmethodID ctor;
  jobject buffer = NULL;
  if (address == 0 || bytes < 0 || bytes > 0x7fffffff) {
    hps_java_throw(jenv, -1, "directBuffer: NULL address, or a size outside 0..2^31-1");
    return NULL;
  }
  cls = (*jenv)->FindClass(jenv, "java/nio/DirectByteBuffer");
  if (cls) {
    ctor = (*jenv)->GetMethodID(jenv, cls, "<init>",
                                "(JILjava/lang/Object;Ljdk/internal/access/foreign/MemorySegmentProxy;)V");
    if (ctor) {
      buffer = (*jenv)->NewObject(jenv, cls, ctor, (jlong)address, (jint)bytes, owner, NULL);
    }
  }
  if (!buffer) {
    (*jenv)->ExceptionClear(jenv);
    buffer = (*jenv)->NewDirectByteBuffer(jenv, (void*)address, (jlong)bytes);
    /* No attachment on this JDK: nothing ties `owner` to the buffer, so it is kept for the
     * process's life (a leak of the view, never memory freed under a live buffer). */
    if (buffer && owner) (void)(*jenv)->NewGlobalRef(jenv, owner);
  }
  if (!buffer && !(*jenv)->ExceptionCheck(jenv)) {
    SWIG_JavaThrowException(jenv, SWIG_JavaRuntimeException,
                            "directBuffer: the JVM has no direct buffer access");
  }
  return buffer;
}
%}
%typemap(in, numinputs=0) JNIEnv* jenv "$1 = jenv;"
%typemap(jni) jobject owner "jobject"
%typemap(jtype) jobject owner "Object"
%typemap(jstype) jobject owner "Object"
%typemap(javain) jobject owner "$javainput"
%typemap(in) jobject owner "$1 = $input;"
%typemap(jni) jobject hps_java_direct_buffer "jobject"
%typemap(jtype) jobject hps_java_direct_buffer "java.nio.ByteBuffer"
%typemap(jstype) jobject hps_java_direct_buffer "java.nio.ByteBuffer"
%typemap(javaout) jobject hps_java_direct_buffer { return $jnicall; }
%typemap(out) jobject hps_java_direct_buffer "$result = $1;"
%rename(directBuffer) hps_java_direct_buffer;
%noexception hps_java_direct_buffer;
jobject hps_java_direct_buffer(JNIEnv* jenv, uintptr_t address, int64_t bytes, jobject owner);
