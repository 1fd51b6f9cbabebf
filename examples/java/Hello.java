import java.nio.ByteBuffer;
import java.nio.ByteOrder;
import org.hpshard.DeviceProperties;
import org.hpshard.DeviceType;
import org.hpshard.Event;
import org.hpshard.Hpshard;
import org.hpshard.Stream;

/**
 * hpshard from Java: version, devices, and a stream/event round trip.
 *
 * <p>Run: java -Dhpshard.jni.path=/path/to/libhpshard_jni.so -cp hello.jar:hpshard.jar Hello
 * (without the property, libhpshard_jni.so is searched on java.library.path).
 */
public final class Hello {
  public static void main(String[] args) {
    System.out.println("hpshard " + Hpshard.version() + " (java)");

    for (DeviceType type : DeviceType.values()) {
      int count = Hpshard.deviceCount(type);
      System.out.println(type.name().toLowerCase() + ": " + count + " device(s)");
      for (int i = 0; i < count; i++) {
        DeviceProperties p = Hpshard.deviceProperties(type, i);
        System.out.printf("  [%d] %s: %.1f GiB, %d multiprocessors, compute capability %d.%d%n",
            i, p.name(), p.totalMemoryBytes() / (double) (1L << 30), p.multiprocessorCount(),
            p.computeCapabilityMajor(), p.computeCapabilityMinor());
      }
    }

    int n = 1 << 16;
    ByteBuffer src = ByteBuffer.allocateDirect(n * 4).order(ByteOrder.nativeOrder());
    ByteBuffer dst = ByteBuffer.allocateDirect(n * 4).order(ByteOrder.nativeOrder());
    for (int i = 0; i < n; i++) src.putFloat(i * 4, i);
    Hpshard.hostSyncReset();
    try (Stream stream = new Stream(DeviceType.CPU, 0);
        Event done = new Event(DeviceType.CPU, 0)) {
      Hpshard.memcpyAsync(dst, src, n * 4L, stream); // returns at once
      done.record(stream);
      System.out.println("copy done right after enqueueing: " + done.query());
      stream.synchronize(); // one host sync
      System.out.println("copy done after synchronize: " + done.query());
    }
    for (int i = 0; i < n; i++) {
      if (dst.getFloat(i * 4) != i) throw new IllegalStateException("round trip: wrong copy");
    }
    System.out.println("round trip: copied " + n * 4 + " bytes, host syncs on this thread: "
        + Hpshard.hostSyncCountThread());
  }
}
