package org.hpshard;

import org.hpshard.internal.hps_device_type_t;

/** Device types (hps_device_type_t). */
public enum DeviceType {
  CPU(hps_device_type_t.HPS_DEVICE_CPU),
  CUDA(hps_device_type_t.HPS_DEVICE_CUDA);

  private final int code;

  DeviceType(int code) {
    this.code = code;
  }

  /** The hps_device_type_t value. */
  public int code() {
    return code;
  }

  /** The DeviceType of an hps_device_type_t value; IllegalArgumentException when unknown. */
  public static DeviceType fromCode(int code) {
    for (DeviceType t : values()) {
      if (t.code == code) return t;
    }
    throw new IllegalArgumentException("unknown hps_device_type_t value " + code);
  }
}
