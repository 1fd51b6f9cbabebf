/* The C API end to end: version, devices, and a stream/event round trip that leaves the
 * host free until it asks to wait. */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "hpshard/hpshard.h"

#define TRY(call)                                                          \
  do {                                                                     \
    hps_status_t s_ = (call);                                              \
    if (s_ != HPS_STATUS_OK) {                                             \
      fprintf(stderr, "%s failed: %s: %s\n", #call, hps_status_string(s_), \
              hps_last_error_message());                                   \
      return 1;                                                            \
    }                                                                      \
  } while (0)

static int print_devices(void) {
  const hps_device_type_t types[] = {HPS_DEVICE_CPU, HPS_DEVICE_CUDA};
  const char* names[] = {"cpu", "cuda"};
  int t;
  for (t = 0; t < 2; ++t) {
    int32_t count = 0, i;
    TRY(hps_device_count(types[t], &count));
    printf("  %s devices: %d\n", names[t], (int)count);
    for (i = 0; i < count; ++i) {
      hps_device_properties_t p;
      TRY(hps_device_properties_init(&p, sizeof p));
      TRY(hps_device_get_properties(types[t], i, &p));
      printf("    %s:%d  %s, %.1f GiB, %d %s\n", names[t], (int)i, p.name,
             (double)p.total_memory_bytes / (1024.0 * 1024.0 * 1024.0), (int)p.multiprocessor_count,
             types[t] == HPS_DEVICE_CPU ? "threads" : "SMs");
    }
  }
  return 0;
}

static int round_trip(void) {
  enum { kBytes = 1 << 20 };
  unsigned char* src = malloc(kBytes);
  unsigned char* dst = calloc(kBytes, 1);
  hps_stream_t* stream = NULL;
  hps_event_t* done = NULL;
  int32_t completed = 0;
  uint64_t syncs_before_wait = 0, syncs_after_wait = 0;
  int i, ok = 1;
  if (src == NULL || dst == NULL) return 1;
  for (i = 0; i < kBytes; ++i) src[i] = (unsigned char)(i * 7);
  TRY(hps_host_sync_reset());
  TRY(hps_stream_create(HPS_DEVICE_CPU, 0, &stream));
  TRY(hps_event_create(HPS_DEVICE_CPU, 0, &done));
  TRY(hps_memcpy_async(dst, src, kBytes, stream));
  TRY(hps_event_record(done, stream));
  TRY(hps_event_query(done, &completed));
  TRY(hps_host_sync_count_thread(&syncs_before_wait));
  TRY(hps_event_synchronize(done));
  TRY(hps_host_sync_count_thread(&syncs_after_wait));
  ok = memcmp(src, dst, kBytes) == 0;
  printf(
      "  stream/event round trip: copied %d bytes on a cpu stream, %s; "
      "host syncs before the wait: %llu, after: %llu\n",
      kBytes, ok ? "data equal" : "DATA DIFFERS", (unsigned long long)syncs_before_wait,
      (unsigned long long)syncs_after_wait);
  TRY(hps_event_destroy(done));
  TRY(hps_stream_destroy(stream));
  free(src);
  free(dst);
  return ok ? 0 : 1;
}

int main(void) {
  printf("hpshard %s (c)\n", hps_version_string());
  if (hps_version_number() != HPS_VERSION_NUMBER) {
    fprintf(stderr, "header %s does not match the loaded library %s\n", HPS_VERSION_STRING,
            hps_version_string());
    return 1;
  }
  if (print_devices() != 0) return 1;
  return round_trip();
}
