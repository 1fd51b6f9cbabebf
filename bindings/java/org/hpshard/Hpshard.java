package org.hpshard;

import java.nio.ByteBuffer;
import java.util.Objects;
import org.hpshard.internal.HpshardNative;
import org.hpshard.internal.HpshardNativeConstants;
import org.hpshard.internal.hps_device_properties_t;

/**
 * Entry points of the hpshard C API that need no handle. Every failing call throws
 * {@link HpsException} with the C status code and the library's message.
 */
public final class Hpshard {
  /** The version of the headers this binding was built against. */
  public static final int VERSION_MAJOR = HpshardNativeConstants.HPS_VERSION_MAJOR;
  public static final int VERSION_MINOR = HpshardNativeConstants.HPS_VERSION_MINOR;
  public static final int VERSION_PATCH = HpshardNativeConstants.HPS_VERSION_PATCH;
  public static final int VERSION_NUMBER = HpshardNativeConstants.HPS_VERSION_NUMBER;
  public static final String VERSION_STRING = HpshardNativeConstants.HPS_VERSION_STRING;

  private Hpshard() {}

  /** "MAJOR.MINOR.PATCH" of the loaded library. */
  public static String version() {
    return HpshardNative.hps_version_string();
  }

  /** MAJOR * 10000 + MINOR * 100 + PATCH of the loaded library. */
  public static long versionNumber() {
    return HpshardNative.hps_version_number();
  }

  /** English text of a status code ("unknown status" for unknown values). */
  public static String statusString(int status) {
    return HpshardNative.hps_status_string(status);
  }

  /** Message of the last failing hpshard call on this thread ("" if none). */
  public static String lastErrorMessage() {
    return HpshardNative.hps_last_error_message();
  }

  /** Bytes per element of {@code dtype}. */
  public static long dtypeSize(DType dtype) {
    return HpshardNative.dtypeSize(Objects.requireNonNull(dtype, "dtype").code());
  }

  /** Short name of {@code dtype} ("float32", "bfloat16", ...). */
  public static String dtypeName(DType dtype) {
    return HpshardNative.dtypeName(Objects.requireNonNull(dtype, "dtype").code());
  }

  /** Usable devices of a type: CPU 1; CUDA 0 without CUDA or a device. */
  public static int deviceCount(DeviceType type) {
    return HpshardNative.deviceCount(Objects.requireNonNull(type, "type").code());
  }

  /** Properties of device (type, index); a missing index throws OUT_OF_RANGE. */
  public static DeviceProperties deviceProperties(DeviceType type, int index) {
    hps_device_properties_t p =
        HpshardNative.deviceGetProperties(Objects.requireNonNull(type, "type").code(), index);
    try {
      return new DeviceProperties(
          DeviceType.fromCode(p.getType()),
          p.getIndex(),
          p.getName(),
          p.getTotal_memory_bytes(),
          p.getCompute_capability_major(),
          p.getCompute_capability_minor(),
          p.getMultiprocessor_count());
    } finally {
      p.delete();
    }
  }

  /** sizeof(hps_device_properties_t) as this binding was built. */
  public static long propertiesStructSize() {
    return propertiesStructSize(HpshardNative.propertiesStructSize());
  }

  /**
   * The struct_size hps_device_properties_init records for a struct of {@code structSize}
   * bytes; sizes below the first version of the struct throw INVALID_ARGUMENT.
   */
  public static long propertiesStructSize(long structSize) {
    hps_device_properties_t p = HpshardNative.devicePropertiesInit(structSize);
    try {
      return p.getStruct_size();
    } finally {
      p.delete();
    }
  }

  /** Host syncs counted on this thread since it started or last reset. */
  public static long hostSyncCountThread() {
    return HpshardNative.hostSyncCountThread();
  }

  /** Host syncs counted on all threads since the process started or the last reset. */
  public static long hostSyncCountTotal() {
    return HpshardNative.hostSyncCountTotal();
  }

  /** Resets the total counter and this thread's counter to zero. */
  public static void hostSyncReset() {
    HpshardNative.hostSyncReset();
  }

  /**
   * Enqueues a copy of {@code bytes} bytes from {@code src} to {@code dst} on
   * {@code stream} and returns without waiting.
   *
   * <p>Both buffers must be DIRECT ByteBuffers ({@link ByteBuffer#allocateDirect}); the
   * copy reads from {@code src}'s position and writes at {@code dst}'s position (positions
   * are not moved). {@code dst} must be writable with at least {@code bytes} remaining.
   * The copy runs later: {@code stream} keeps both buffers reachable until
   * {@link Stream#synchronize()} or {@link Stream#close()} returns; do not read dst or
   * write src before that (or before an event recorded after the copy has completed).
   *
   * @throws IllegalArgumentException heap or read-only buffers, too few bytes remaining
   * @throws NullPointerException null buffers or stream
   * @throws IllegalStateException a closed stream
   */
  /**
   * {@code value} of an option the C API takes as an unsigned byte count; a negative one
   * (which would reach it as 2^64 + value) throws IllegalArgumentException naming it.
   */
  static long unsignedBytes(String option, long value) {
    if (value < 0) {
      throw new IllegalArgumentException(option + " is negative (" + value + ")");
    }
    return value;
  }

  public static void memcpyAsync(ByteBuffer dst, ByteBuffer src, long bytes, Stream stream) {
    Objects.requireNonNull(dst, "dst");
    Objects.requireNonNull(src, "src");
    Objects.requireNonNull(stream, "stream");
    if (!dst.isDirect()) {
      throw new IllegalArgumentException(
          "memcpyAsync: dst is a heap ByteBuffer; use ByteBuffer.allocateDirect");
    }
    if (!src.isDirect()) {
      throw new IllegalArgumentException(
          "memcpyAsync: src is a heap ByteBuffer; use ByteBuffer.allocateDirect");
    }
    if (dst.isReadOnly()) {
      throw new IllegalArgumentException("memcpyAsync: dst is read-only");
    }
    if (bytes < 0) {
      throw new IllegalArgumentException("memcpyAsync: bytes is negative (" + bytes + ")");
    }
    if (bytes > src.remaining()) {
      throw new IllegalArgumentException(
          "memcpyAsync: src has " + src.remaining() + " bytes remaining, " + bytes + " requested");
    }
    if (bytes > dst.remaining()) {
      throw new IllegalArgumentException(
          "memcpyAsync: dst has " + dst.remaining() + " bytes remaining, " + bytes + " needed");
    }
    // Slices start at the positions (and keep their parent buffers reachable).
    stream.enqueueCopy(dst.slice(), src.slice(), bytes);
  }
}
