/* An outside C99 program built against an installed hpshard package (pkg-config or
 * find_package(hpshard)). Exits non-zero on any failure. Used by package_test.sh. */
#include <hpshard/hpshard.h>
#include <stdio.h>
#include <string.h>

static int failures = 0;

#define CHECK(cond)                                                           \
  do {                                                                        \
    if (!(cond)) {                                                            \
      fprintf(stderr, "consumer: FAILED %s (line %d): %s\n", #cond, __LINE__, \
              hps_last_error_message());                                      \
      ++failures;                                                             \
    }                                                                         \
  } while (0)

#define CHECK_OK(call) CHECK((call) == HPS_STATUS_OK)

int main(void) {
  const char* version = hps_version_string();
  CHECK(version != NULL && version[0] != '\0');
  CHECK(strcmp(version, HPS_VERSION_STRING) == 0);
  CHECK(hps_version_number() == (uint32_t)HPS_VERSION_NUMBER);
  printf("consumer: hpshard %s (library %u, header %u)\n", version ? version : "(null)",
         (unsigned)hps_version_number(), (unsigned)HPS_VERSION_NUMBER);

  int32_t cpus = 0;
  CHECK_OK(hps_device_count(HPS_DEVICE_CPU, &cpus));
  CHECK(cpus == 1);

  hps_stream_t* stream = NULL;
  hps_event_t* event = NULL;
  CHECK_OK(hps_stream_create(HPS_DEVICE_CPU, 0, &stream));
  CHECK_OK(hps_event_create(HPS_DEVICE_CPU, 0, &event));
  if (stream != NULL && event != NULL) {
    char src[64];
    char dst[64];
    memset(src, 0x5a, sizeof src);
    memset(dst, 0, sizeof dst);
    CHECK_OK(hps_memcpy_async(dst, src, sizeof src, stream));
    CHECK_OK(hps_event_record(event, stream));
    CHECK_OK(hps_event_synchronize(event));
    CHECK_OK(hps_stream_synchronize(stream));
    int32_t completed = 0;
    CHECK_OK(hps_event_query(event, &completed));
    CHECK(completed == 1);
    CHECK(memcmp(dst, src, sizeof src) == 0);
  }
  CHECK_OK(hps_event_destroy(event));
  CHECK_OK(hps_stream_destroy(stream));

  /* A bad call fails with INVALID_ARGUMENT, leaves the out-param alone and says why. */
  size_t size = 12345;
  CHECK(hps_dtype_size((hps_dtype_t)99, &size) == HPS_STATUS_INVALID_ARGUMENT);
  CHECK(size == 12345);
  const char* message = hps_last_error_message();
  CHECK(message != NULL && message[0] != '\0');
  printf("consumer: expected error: %s\n", message ? message : "(null)");

  if (failures != 0) {
    fprintf(stderr, "consumer: %d check(s) failed\n", failures);
    return 1;
  }
  printf("consumer: OK\n");
  return 0;
}
