package org.hpshard;

/**
 * Loads the JNI library (libhpshard_jni.so) once per class loader.
 *
 * <p>If the system property {@code hpshard.jni.path} is set, the library is loaded from that
 * absolute path; otherwise {@code System.loadLibrary("hpshard_jni")} searches
 * {@code java.library.path} (Debian: /usr/lib/&lt;multiarch&gt;/jni). The generated JNI class
 * calls {@link #load()} in its static initializer, so nothing else needs to.
 */
public final class NativeLibrary {
  /** System property naming the JNI library by absolute path. */
  public static final String PATH_PROPERTY = "hpshard.jni.path";
  /** Library name for System.loadLibrary. */
  public static final String LIBRARY_NAME = "hpshard_jni";

  private NativeLibrary() {}

  /** Initialised (and the library loaded) on first use, exactly once. */
  private static final class Holder {
    static final String LOADED_FROM = loadOnce();

    private static String loadOnce() {
      String path = System.getProperty(PATH_PROPERTY);
      if (path != null && !path.isEmpty()) {
        System.load(path);
        return path;
      }
      System.loadLibrary(LIBRARY_NAME);
      return System.mapLibraryName(LIBRARY_NAME);
    }
  }

  /** Loads the library if not loaded yet; returns where it was loaded from. */
  public static String load() {
    return Holder.LOADED_FROM;
  }
}
