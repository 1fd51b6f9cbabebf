package org.hpshard;

import org.hpshard.internal.hps_group_t;

/** Groups of the hybrid topology (hps_group_t); the first five are its axes. */
public enum Group {
  DP(hps_group_t.HPS_GROUP_DP),
  PP(hps_group_t.HPS_GROUP_PP),
  SHARDING(hps_group_t.HPS_GROUP_SHARDING),
  SEP(hps_group_t.HPS_GROUP_SEP),
  MP(hps_group_t.HPS_GROUP_MP),
  /** The model replica: every rank with this dp coordinate. */
  CHECK(hps_group_t.HPS_GROUP_CHECK),
  /** Every rank with this sharding coordinate. */
  SHARDING_CHECK(hps_group_t.HPS_GROUP_SHARDING_CHECK);

  private final int code;

  Group(int code) {
    this.code = code;
  }

  /** The hps_group_t value. */
  public int code() {
    return code;
  }
}
