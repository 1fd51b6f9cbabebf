package org.hpshard;

import static org.junit.jupiter.api.Assertions.assertArrayEquals;
import static org.junit.jupiter.api.Assertions.assertDoesNotThrow;
import static org.junit.jupiter.api.Assertions.assertEquals;
import static org.junit.jupiter.api.Assertions.assertFalse;
import static org.junit.jupiter.api.Assertions.assertNotEquals;
import static org.junit.jupiter.api.Assertions.assertThrows;
import static org.junit.jupiter.api.Assertions.assertTrue;

import java.nio.ByteBuffer;
import java.nio.ByteOrder;
import java.nio.file.Files;
import java.nio.file.Path;
import java.util.ArrayList;
import java.util.List;
import java.util.Set;
import java.util.TreeSet;
import java.util.concurrent.atomic.AtomicReference;
import java.util.regex.Matcher;
import java.util.regex.Pattern;
import org.hpshard.internal.EventHandle;
import org.hpshard.internal.HpshardNative;
import org.hpshard.internal.StreamHandle;
import org.hpshard.internal.hps_device_properties_t;
import org.hpshard.internal.hps_device_type_t;
import org.hpshard.internal.hps_dtype_t;
import org.hpshard.internal.hps_status_t;
import org.junit.jupiter.api.Assumptions;
import org.junit.jupiter.api.Test;
import org.junit.jupiter.api.function.Executable;

class HpshardTest {
  static final int INVALID_ARGUMENT = 1;
  static final int OUT_OF_RANGE = 2;
  static final int FAILED_PRECONDITION = 5;

  static HpsException assertStatus(int status, Executable call) {
    HpsException e = assertThrows(HpsException.class, call);
    assertEquals(status, e.status(), e.toString());
    return e;
  }

  // ---- parity: every HPS_API function is a native method under its C name ---------------
  @Test
  void everyCFunctionHasANativeMethod() throws Exception {
    String header = System.getProperty("hpshard.header");
    if (header == null) return; // run outside ctest
    Matcher m = Pattern.compile("HPS_API\\s+[^;(]*?\\b(hps_\\w+)\\s*\\(")
        .matcher(Files.readString(Path.of(header)));
    Set<String> cNames = new TreeSet<>();
    while (m.find()) cNames.add(m.group(1));
    assertTrue(cNames.size() >= 22, cNames.toString());
    // Every C function is called by the JNI wrapper (as a handle class's method, a module
    // function, or under its own name): hpshard.i wraps it.
    String wrap = System.getProperty("hpshard.jni.wrap");
    if (wrap == null) return;
    String text = Files.readString(Path.of(wrap));
    List<String> missing = new ArrayList<>();
    for (String name : cNames) {
      if (!Pattern.compile("\\b" + name + "\\s*\\(").matcher(text).find()) missing.add(name);
    }
    assertTrue(missing.isEmpty(), "not wrapped: " + missing);
  }

  // ---- version and status --------------------------------------------------------------
  @Test
  void version() {
    assertEquals(Hpshard.VERSION_STRING, Hpshard.version());
    // The manifest of the jar holding the binding says it too (read from that jar: the
    // package org.hpshard is defined by whichever jar of it loads first, this test's).
    try (java.util.jar.JarFile jar =
        new java.util.jar.JarFile(
            new java.io.File(
                Hpshard.class.getProtectionDomain().getCodeSource().getLocation().toURI()))) {
      assertEquals(
          Hpshard.version(),
          jar.getManifest().getMainAttributes().getValue("Implementation-Version"));
    } catch (java.io.IOException | java.net.URISyntaxException e) {
      throw new AssertionError(e);
    }
    assertEquals(
        Hpshard.VERSION_MAJOR + "." + Hpshard.VERSION_MINOR + "." + Hpshard.VERSION_PATCH,
        Hpshard.version());
    assertEquals(Hpshard.VERSION_NUMBER, Hpshard.versionNumber());
    assertEquals(
        Hpshard.VERSION_MAJOR * 10000 + Hpshard.VERSION_MINOR * 100 + Hpshard.VERSION_PATCH,
        Hpshard.versionNumber());
  }

  @Test
  void statusStrings() {
    for (int s = hps_status_t.HPS_STATUS_OK; s <= hps_status_t.HPS_STATUS_BACKEND_ERROR; s++) {
      assertNotEquals("unknown status", Hpshard.statusString(s));
      assertFalse(HpsException.statusName(s).startsWith("UNKNOWN"));
    }
    assertEquals("unknown status", Hpshard.statusString(99));
    assertEquals("UNKNOWN(99)", HpsException.statusName(99));
  }

  @Test
  void exceptionCarriesStatusAndMessage() {
    HpsException e = assertStatus(INVALID_ARGUMENT, () -> HpshardNative.dtypeSize(99));
    assertEquals("INVALID_ARGUMENT", e.statusName());
    assertTrue(e.getMessage().contains("99"), e.getMessage());
    assertTrue(e.toString().contains("INVALID_ARGUMENT"));
    assertEquals(e.getMessage(), Hpshard.lastErrorMessage());
  }

  @Test
  void lastErrorMessageIsThreadLocal() throws Exception {
    assertThrows(HpsException.class, () -> HpshardNative.dtypeName(99));
    AtomicReference<String> other = new AtomicReference<>();
    Thread t = new Thread(() -> other.set(Hpshard.lastErrorMessage()));
    t.start();
    t.join();
    assertEquals("", other.get());
    assertTrue(Hpshard.lastErrorMessage().contains("hps_dtype_name"));
  }

  // ---- dtypes --------------------------------------------------------------------------
  @Test
  void dtypes() {
    long[] sizes = {4, 8, 2, 2, 4, 8, 1};
    for (DType d : DType.values()) {
      assertEquals(sizes[d.ordinal()], Hpshard.dtypeSize(d), d.name());
      assertEquals(d.name().toLowerCase(), Hpshard.dtypeName(d));
      assertEquals(d.size(), Hpshard.dtypeSize(d));
      assertEquals(d.cName(), Hpshard.dtypeName(d));
      assertEquals(d, DType.fromCode(d.code()));
    }
    assertEquals(hps_dtype_t.HPS_DTYPE_BFLOAT16, DType.BFLOAT16.code());
    assertThrows(IllegalArgumentException.class, () -> DType.fromCode(99));
  }

  @Test
  void unknownDtype() {
    assertStatus(INVALID_ARGUMENT, () -> HpshardNative.dtypeSize(99));
    assertStatus(INVALID_ARGUMENT, () -> HpshardNative.dtypeName(99));
    assertStatus(INVALID_ARGUMENT, () -> HpshardNative.dtypeSize(-1));
    assertThrows(NullPointerException.class, () -> Hpshard.dtypeSize(null));
    assertThrows(NullPointerException.class, () -> Hpshard.dtypeName(null));
  }

  // ---- devices -------------------------------------------------------------------------
  @Test
  void deviceCount() {
    assertEquals(1, Hpshard.deviceCount(DeviceType.CPU));
    assertTrue(Hpshard.deviceCount(DeviceType.CUDA) >= 0);
    assertStatus(INVALID_ARGUMENT, () -> HpshardNative.deviceCount(99));
    assertEquals(hps_device_type_t.HPS_DEVICE_CUDA, DeviceType.CUDA.code());
    assertEquals(DeviceType.CPU, DeviceType.fromCode(0));
  }

  @Test
  void devicePropertiesCpu() {
    DeviceProperties p = Hpshard.deviceProperties(DeviceType.CPU, 0);
    assertEquals(DeviceType.CPU, p.type());
    assertEquals(0, p.index());
    assertFalse(p.name().isEmpty());
    assertTrue(p.totalMemoryBytes() > 0);
    assertTrue(p.multiprocessorCount() >= 1);
    assertEquals(0, p.computeCapabilityMajor());
    assertEquals(0, p.computeCapabilityMinor());
  }

  @Test
  void devicePropertiesCuda() {
    for (int i = 0; i < Hpshard.deviceCount(DeviceType.CUDA); i++) {
      DeviceProperties p = Hpshard.deviceProperties(DeviceType.CUDA, i);
      assertEquals(i, p.index());
      assertTrue(p.totalMemoryBytes() > 0);
      assertTrue(p.computeCapabilityMajor() > 0);
    }
  }

  @Test
  void devicePropertiesBadInput() {
    assertStatus(OUT_OF_RANGE, () -> Hpshard.deviceProperties(DeviceType.CPU, 1));
    assertStatus(OUT_OF_RANGE, () -> Hpshard.deviceProperties(DeviceType.CUDA, 7));
    assertStatus(INVALID_ARGUMENT, () -> HpshardNative.deviceGetProperties(99, 0));
    assertThrows(NullPointerException.class, () -> Hpshard.deviceProperties(null, 0));
  }

  @Test
  void propertiesInit() {
    assertEquals(HpshardNative.propertiesStructSize(),
        Hpshard.propertiesStructSize());
    assertStatus(INVALID_ARGUMENT, () -> Hpshard.propertiesStructSize(3));
    hps_device_properties_t p =
        HpshardNative.devicePropertiesInit(HpshardNative.propertiesStructSize());
    assertEquals("", p.getName());
    p.delete();
    p.delete(); // idempotent
  }

  // ---- streams and events --------------------------------------------------------------
  @Test
  void createOnBadDevice() {
    assertStatus(OUT_OF_RANGE, () -> new Stream(DeviceType.CPU, 1));
    assertStatus(OUT_OF_RANGE, () -> new Stream(DeviceType.CUDA, 7));
    assertStatus(OUT_OF_RANGE, () -> new Event(DeviceType.CPU, 1));
    assertStatus(OUT_OF_RANGE, () -> new Event(DeviceType.CUDA, 7));
    assertStatus(INVALID_ARGUMENT, () -> StreamHandle.create(99, 0));
    assertStatus(INVALID_ARGUMENT, () -> EventHandle.create(99, 0));
    assertThrows(NullPointerException.class, () -> new Stream(null, 0));
  }

  @Test
  void closeTwiceIsHarmless() {
    Stream s = new Stream();
    Event e = new Event();
    assertFalse(s.isClosed());
    s.close();
    s.close();
    e.close();
    e.close();
    assertTrue(s.isClosed());
    assertTrue(e.isClosed());
    assertThrows(IllegalStateException.class, s::synchronize);
    assertThrows(IllegalStateException.class, e::query);
    try (Stream s2 = new Stream(); Event e2 = new Event(DeviceType.CPU, 0)) {
      e2.record(s2);
    }
  }

  @Test
  void nullHandlesAreRejectedByTheLibrary() {
    StreamHandle sh = StreamHandle.create(0, 0);
    EventHandle eh = EventHandle.create(0, 0);
    try {
      assertStatus(INVALID_ARGUMENT, () -> sh.waitEvent(null));
      assertStatus(INVALID_ARGUMENT, () -> eh.record(null));
    } finally {
      sh.delete();
      eh.delete();
      sh.delete(); // the proxy destroys its handle once
    }
    try (Stream s = new Stream(); Event e = new Event()) {
      assertThrows(NullPointerException.class, () -> s.waitEvent(null));
      assertThrows(NullPointerException.class, () -> e.record(null));
    }
  }

  @Test
  void neverRecordedEvent() {
    try (Stream s = new Stream(); Event e = new Event()) {
      assertStatus(FAILED_PRECONDITION, () -> s.waitEvent(e));
      assertStatus(FAILED_PRECONDITION, e::query);
      assertStatus(FAILED_PRECONDITION, e::synchronize);
    }
  }

  @Test
  void memcpyRejectsBadBuffers() {
    try (Stream s = new Stream()) {
      ByteBuffer direct = ByteBuffer.allocateDirect(16);
      ByteBuffer heap = ByteBuffer.allocate(16);
      IllegalArgumentException e = assertThrows(IllegalArgumentException.class,
          () -> Hpshard.memcpyAsync(heap, direct, 16, s));
      assertTrue(e.getMessage().contains("heap"), e.getMessage());
      assertThrows(IllegalArgumentException.class, () -> Hpshard.memcpyAsync(direct, heap, 16, s));
      assertThrows(IllegalArgumentException.class,
          () -> Hpshard.memcpyAsync(direct.asReadOnlyBuffer(), ByteBuffer.allocateDirect(16), 16, s));
      assertThrows(IllegalArgumentException.class,
          () -> Hpshard.memcpyAsync(ByteBuffer.allocateDirect(8), direct, 16, s));
      assertThrows(IllegalArgumentException.class,
          () -> Hpshard.memcpyAsync(ByteBuffer.allocateDirect(32), direct, 17, s));
      assertThrows(IllegalArgumentException.class,
          () -> Hpshard.memcpyAsync(ByteBuffer.allocateDirect(32), direct, -1, s));
      assertThrows(NullPointerException.class, () -> Hpshard.memcpyAsync(null, direct, 1, s));
      assertThrows(NullPointerException.class, () -> Hpshard.memcpyAsync(direct, null, 1, s));
      assertThrows(NullPointerException.class, () -> Hpshard.memcpyAsync(direct, direct, 1, null));
      // The JNI layer checks too: heap buffers and sizes beyond a capacity.
      StreamHandle h = StreamHandle.create(0, 0);
      try {
        assertThrows(IllegalArgumentException.class, () -> h.memcpyAsync(heap, direct, 1));
        assertThrows(IllegalArgumentException.class,
            () -> h.memcpyAsync(ByteBuffer.allocateDirect(8), direct, 16));
        assertStatus(INVALID_ARGUMENT, () -> h.memcpyAsync(null, null, 4));
        h.memcpyAsync(null, null, 0); // bytes == 0: no-op
        h.synchronize();
      } finally {
        h.delete();
      }
      s.synchronize();
    }
  }

  @Test
  void roundTripAndHostSyncCounter() {
    int n = 1024;
    ByteBuffer src = ByteBuffer.allocateDirect(n * 8).order(ByteOrder.nativeOrder());
    for (int i = 0; i < n; i++) src.putDouble(i * 8, i * 0.5);
    ByteBuffer dst = ByteBuffer.allocateDirect(n * 8).order(ByteOrder.nativeOrder());
    ByteBuffer tail = ByteBuffer.allocateDirect(64);
    Hpshard.hostSyncReset();
    assertEquals(0, Hpshard.hostSyncCountThread());
    assertEquals(0, Hpshard.hostSyncCountTotal());
    int syncs = 0;
    try (Stream s = new Stream(DeviceType.CPU, 0); Event e = new Event(DeviceType.CPU, 0)) {
      Hpshard.memcpyAsync(dst, src, n * 8L, s);
      src.position(n * 8 - 64);
      s.memcpyAsync(tail, src, 64); // from src's position
      src.position(0);
      e.record(s);
      e.query(); // never blocks, not a sync
      s.waitEvent(e);
      e.synchronize();
      syncs++;
      assertTrue(e.query());
      s.synchronize();
      syncs++;
      for (int i = 0; i < n; i++) assertEquals(i * 0.5, dst.getDouble(i * 8));
      byte[] expected = new byte[64];
      byte[] actual = new byte[64];
      src.get(n * 8 - 64, expected);
      tail.get(0, actual);
      assertArrayEquals(expected, actual);
      assertEquals(0, dst.position());
      assertEquals(syncs, Hpshard.hostSyncCountThread());
      assertTrue(Hpshard.hostSyncCountTotal() >= syncs);
    }
    Hpshard.hostSyncReset();
    assertEquals(0, Hpshard.hostSyncCountThread());
  }

  @Test
  void hostSyncCounterIsPerThread() throws Exception {
    Hpshard.hostSyncReset();
    Thread t = new Thread(() -> {
      try (Stream s = new Stream()) {
        s.synchronize();
      }
    });
    t.start();
    t.join();
    assertEquals(0, Hpshard.hostSyncCountThread());
    assertTrue(Hpshard.hostSyncCountTotal() >= 1);
  }

  @Test
  void rawHandlesRoundTrip() {
    StreamHandle s = StreamHandle.create(hps_device_type_t.HPS_DEVICE_CPU, 0);
    EventHandle e = EventHandle.create(hps_device_type_t.HPS_DEVICE_CPU, 0);
    try {
      ByteBuffer a = ByteBuffer.allocateDirect(4).put(0, (byte) 7);
      ByteBuffer b = ByteBuffer.allocateDirect(4);
      s.memcpyAsync(b, a, 4);
      e.record(s);
      s.waitEvent(e);
      e.synchronize();
      assertEquals(1, e.query());
      s.synchronize();
      assertEquals(7, b.get(0));
    } finally {
      e.delete();
      s.delete();
    }
  }

  @Test
  void cudaRoundTripWithHostBuffers() {
    Assumptions.assumeTrue(Hpshard.deviceCount(DeviceType.CUDA) > 0, "no CUDA device");
    // On CUDA, host memory is reachable through unified addressing.
    ByteBuffer src = ByteBuffer.allocateDirect(4096);
    for (int i = 0; i < 4096; i++) src.put(i, (byte) i);
    ByteBuffer dst = ByteBuffer.allocateDirect(4096);
    Hpshard.hostSyncReset();
    try (Stream s = new Stream(DeviceType.CUDA, 0); Event e = new Event(DeviceType.CUDA, 0)) {
      Hpshard.memcpyAsync(dst, src, 4096, s);
      e.record(s);
      s.waitEvent(e);
      e.synchronize();
      assertTrue(e.query());
      s.synchronize();
    }
    assertEquals(src, dst);
    assertEquals(2, Hpshard.hostSyncCountThread());
    try (Stream cpu = new Stream(); Event ev = new Event(DeviceType.CUDA, 0)) {
      assertStatus(INVALID_ARGUMENT, () -> ev.record(cpu)); // device mismatch
    }
  }

  @Test
  void nativeLibraryLoadsOnce() {
    assertEquals(NativeLibrary.load(), NativeLibrary.load());
  }
}
