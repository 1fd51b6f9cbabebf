package org.hpshard;

import org.hpshard.internal.hps_dtype_t;

/** Element types (hps_dtype_t). */
public enum DType {
  FLOAT32(hps_dtype_t.HPS_DTYPE_FLOAT32),
  FLOAT64(hps_dtype_t.HPS_DTYPE_FLOAT64),
  FLOAT16(hps_dtype_t.HPS_DTYPE_FLOAT16),
  BFLOAT16(hps_dtype_t.HPS_DTYPE_BFLOAT16),
  INT32(hps_dtype_t.HPS_DTYPE_INT32),
  INT64(hps_dtype_t.HPS_DTYPE_INT64),
  UINT8(hps_dtype_t.HPS_DTYPE_UINT8);

  private final int code;

  DType(int code) {
    this.code = code;
  }

  /** The hps_dtype_t value. */
  public int code() {
    return code;
  }

  /** Bytes per element (hps_dtype_size). */
  public long size() {
    return Hpshard.dtypeSize(this);
  }

  /** Short name, "float32" ... (hps_dtype_name). */
  public String cName() {
    return Hpshard.dtypeName(this);
  }

  /** The DType of an hps_dtype_t value; IllegalArgumentException when unknown. */
  public static DType fromCode(int code) {
    for (DType d : values()) {
      if (d.code == code) return d;
    }
    throw new IllegalArgumentException("unknown hps_dtype_t value " + code);
  }
}
