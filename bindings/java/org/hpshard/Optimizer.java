package org.hpshard;

import org.hpshard.internal.hps_optimizer_t;

/** Optimizers of the sharded training engine (hps_optimizer_t). */
public enum Optimizer {
  /** Momentum, weight decay, nesterov (torch.optim.SGD). */
  SGD(hps_optimizer_t.HPS_OPTIMIZER_SGD),
  /** Decoupled weight decay (torch.optim.AdamW). */
  ADAMW(hps_optimizer_t.HPS_OPTIMIZER_ADAMW);

  private final int code;

  Optimizer(int code) {
    this.code = code;
  }

  /** The hps_optimizer_t value. */
  public int code() {
    return code;
  }

  /** The Optimizer of an hps_optimizer_t value; IllegalArgumentException when unknown. */
  public static Optimizer fromCode(int code) {
    for (Optimizer o : values()) {
      if (o.code == code) return o;
    }
    throw new IllegalArgumentException("unknown hps_optimizer_t value " + code);
  }
}
