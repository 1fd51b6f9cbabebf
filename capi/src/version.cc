#include "capi/src/error.h"

extern "C" {

HPS_API uint32_t hps_version_number(void) { return HPS_VERSION_NUMBER; }

HPS_API const char* hps_version_string(void) { return HPS_VERSION_STRING; }

}  // extern "C"
