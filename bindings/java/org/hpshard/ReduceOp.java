package org.hpshard;

import org.hpshard.internal.hps_reduce_op_t;

/** Reductions (hps_reduce_op_t). */
public enum ReduceOp {
  SUM(hps_reduce_op_t.HPS_REDUCE_SUM),
  AVG(hps_reduce_op_t.HPS_REDUCE_AVG),
  MAX(hps_reduce_op_t.HPS_REDUCE_MAX),
  MIN(hps_reduce_op_t.HPS_REDUCE_MIN);

  private final int code;

  ReduceOp(int code) {
    this.code = code;
  }

  /** The hps_reduce_op_t value. */
  public int code() {
    return code;
  }
}
