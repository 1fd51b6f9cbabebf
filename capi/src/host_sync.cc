#include "core/device/host_sync.h"

#include "capi/src/error.h"

extern "C" {

HPS_API hps_status_t hps_host_sync_count_thread(uint64_t* out_count) {
  HPS_CHECK_ARG(out_count);
  *out_count = hps::host_sync_count_thread();
  return HPS_STATUS_OK;
}

HPS_API hps_status_t hps_host_sync_count_total(uint64_t* out_count) {
  HPS_CHECK_ARG(out_count);
  *out_count = hps::host_sync_count_total();
  return HPS_STATUS_OK;
}

HPS_API hps_status_t hps_host_sync_reset(void) {
  hps::host_sync_reset();
  return HPS_STATUS_OK;
}

}  // extern "C"
