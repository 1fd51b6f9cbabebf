package org.hpshard;

/**
 * A device: its type and its index within the type (hps_comm_device, hps_engine_device).
 *
 * @param type the device's type
 * @param index the device's index within its type (0 on the CPU)
 */
public record Device(DeviceType type, int index) {
  /** Whether memory on this device can be read and written by the host (the CPU). */
  public boolean isHost() {
    return type == DeviceType.CPU;
  }

  /** From the {type, index} pair the native layer returns. */
  static Device fromNative(long[] typeAndIndex) {
    return new Device(DeviceType.fromCode((int) typeAndIndex[0]), (int) typeAndIndex[1]);
  }

  /** "cpu:0", "cuda:1" (the library's spelling). */
  @Override
  public String toString() {
    return type.name().toLowerCase(java.util.Locale.ROOT) + ":" + index;
  }
}
