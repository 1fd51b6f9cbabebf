/* The C API, compiled as C99: every function, and bad input getting a clear status and
 * message while changing nothing. */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "check.h"
#include "hpshard/hpshard.h"

/* The call fails with `status` and leaves a non-empty message naming the function. */
#define CHECK_FAILS(call, status, function)                    \
  do {                                                         \
    hps_status_t s_ = (call);                                  \
    CHECK(s_ == (status));                                     \
    CHECK(strlen(hps_last_error_message()) > 0);               \
    CHECK(strstr(hps_last_error_message(), function) != NULL); \
  } while (0)

static void test_version(void) {
  char expected[32];
  CHECK(hps_version_number() == HPS_VERSION_NUMBER);
  CHECK(HPS_VERSION_NUMBER ==
        HPS_VERSION_MAJOR * 10000 + HPS_VERSION_MINOR * 100 + HPS_VERSION_PATCH);
  snprintf(expected, sizeof expected, "%d.%d.%d", HPS_VERSION_MAJOR, HPS_VERSION_MINOR,
           HPS_VERSION_PATCH);
  CHECK(strcmp(hps_version_string(), expected) == 0);
  CHECK(strcmp(hps_version_string(), HPS_VERSION_STRING) == 0);
}

static void test_status_strings(void) {
  CHECK(strcmp(hps_status_string(HPS_STATUS_OK), "ok") == 0);
  CHECK(strcmp(hps_status_string(HPS_STATUS_TIMEOUT), "timeout") == 0);
  CHECK(strcmp(hps_status_string(HPS_STATUS_BACKEND_ERROR), "backend error") == 0);
  CHECK(strcmp(hps_status_string((hps_status_t)4242), "unknown status") == 0);
  CHECK(HPS_STATUS_INVALID_ARGUMENT == 1 && HPS_STATUS_OUT_OF_RANGE == 2 &&
        HPS_STATUS_FAILED_PRECONDITION == 5 && HPS_STATUS_TIMEOUT == 8 && HPS_STATUS_ABORTED == 9);
}

static void test_dtypes(void) {
  static const struct {
    hps_dtype_t dtype;
    size_t size;
    const char* name;
  } expected[] = {{HPS_DTYPE_FLOAT32, 4, "float32"}, {HPS_DTYPE_FLOAT64, 8, "float64"},
                  {HPS_DTYPE_FLOAT16, 2, "float16"}, {HPS_DTYPE_BFLOAT16, 2, "bfloat16"},
                  {HPS_DTYPE_INT32, 4, "int32"},     {HPS_DTYPE_INT64, 8, "int64"},
                  {HPS_DTYPE_UINT8, 1, "uint8"}};
  size_t i, size = 12345;
  const char* name = "untouched";
  for (i = 0; i < sizeof expected / sizeof expected[0]; ++i) {
    CHECK_OK(hps_dtype_size(expected[i].dtype, &size));
    CHECK(size == expected[i].size);
    CHECK_OK(hps_dtype_name(expected[i].dtype, &name));
    CHECK(strcmp(name, expected[i].name) == 0);
  }
  size = 12345;
  name = "untouched";
  CHECK_FAILS(hps_dtype_size((hps_dtype_t)99, &size), HPS_STATUS_INVALID_ARGUMENT,
              "hps_dtype_size");
  CHECK(strstr(hps_last_error_message(), "99") != NULL);
  CHECK(size == 12345);
  CHECK_FAILS(hps_dtype_name((hps_dtype_t)-1, &name), HPS_STATUS_INVALID_ARGUMENT,
              "hps_dtype_name");
  CHECK(strcmp(name, "untouched") == 0);
  CHECK_FAILS(hps_dtype_size(HPS_DTYPE_FLOAT32, NULL), HPS_STATUS_INVALID_ARGUMENT, "out_size");
  CHECK_FAILS(hps_dtype_name(HPS_DTYPE_FLOAT32, NULL), HPS_STATUS_INVALID_ARGUMENT, "out_name");
}

static void test_devices(void) {
  int32_t count = -7;
  hps_device_properties_t props;
  CHECK_OK(hps_device_count(HPS_DEVICE_CPU, &count));
  CHECK(count == 1);
  CHECK_OK(hps_device_count(HPS_DEVICE_CUDA, &count));
  CHECK(count >= 0);
  count = -7;
  CHECK_FAILS(hps_device_count((hps_device_type_t)5, &count), HPS_STATUS_INVALID_ARGUMENT,
              "hps_device_count");
  CHECK(count == -7);
  CHECK_FAILS(hps_device_count(HPS_DEVICE_CPU, NULL), HPS_STATUS_INVALID_ARGUMENT, "out_count");

  CHECK_FAILS(hps_device_properties_init(NULL, sizeof props), HPS_STATUS_INVALID_ARGUMENT, "props");
  CHECK_FAILS(hps_device_properties_init(&props, 3), HPS_STATUS_INVALID_ARGUMENT, "struct_size");
  memset(&props, 0, sizeof props);
  CHECK_FAILS(hps_device_get_properties(HPS_DEVICE_CPU, 0, &props), HPS_STATUS_INVALID_ARGUMENT,
              "hps_device_properties_init");
  CHECK_OK(hps_device_properties_init(&props, sizeof props));
  CHECK(props.struct_size == sizeof props);
  CHECK_OK(hps_device_get_properties(HPS_DEVICE_CPU, 0, &props));
  CHECK(props.type == HPS_DEVICE_CPU && props.index == 0);
  CHECK(strncmp(props.name, "cpu", 3) == 0);
  CHECK(props.total_memory_bytes > 0);
  CHECK(props.multiprocessor_count > 0);
  strcpy(props.name, "untouched");
  CHECK_FAILS(hps_device_get_properties(HPS_DEVICE_CPU, 1, &props), HPS_STATUS_OUT_OF_RANGE,
              "cpu:1");
  CHECK(strcmp(props.name, "untouched") == 0);
  CHECK_OK(hps_device_count(HPS_DEVICE_CUDA, &count));
  CHECK_FAILS(hps_device_get_properties(HPS_DEVICE_CUDA, count, &props), HPS_STATUS_OUT_OF_RANGE,
              "cuda:");
}

/* An older caller knows a shorter struct: nothing past its struct_size is written. */
static void test_properties_abi_extension(void) {
  struct {
    hps_device_properties_t props;
    unsigned char guard[16];
  } old_caller;
  const size_t old_size = offsetof(hps_device_properties_t, multiprocessor_count) + sizeof(int32_t);
  memset(&old_caller, 0xEE, sizeof old_caller);
  CHECK_OK(hps_device_properties_init(&old_caller.props, old_size));
  CHECK_OK(hps_device_get_properties(HPS_DEVICE_CPU, 0, &old_caller.props));
  CHECK(old_caller.guard[0] == 0xEE && old_caller.guard[15] == 0xEE);
}

static void test_streams_and_events(void) {
  hps_stream_t* stream = NULL;
  hps_stream_t* consumer = NULL;
  hps_event_t* event = NULL;
  int32_t completed = -1;
  uint64_t before = 0, after = 0, total = 0;
  enum { kCount = 1 << 16 };
  float* src = malloc(kCount * sizeof(float));
  float* mid = malloc(kCount * sizeof(float));
  float* dst = malloc(kCount * sizeof(float));
  int i, same = 1;
  for (i = 0; i < kCount; ++i) src[i] = (float)i * 0.5f;
  memset(dst, 0, kCount * sizeof(float));

  CHECK_OK(hps_stream_create(HPS_DEVICE_CPU, 0, &stream));
  CHECK_OK(hps_stream_create(HPS_DEVICE_CPU, 0, &consumer));
  CHECK_OK(hps_event_create(HPS_DEVICE_CPU, 0, &event));
  CHECK(stream != NULL && consumer != NULL && event != NULL);

  /* A never-recorded event: every use is refused, nothing is counted. */
  CHECK_OK(hps_host_sync_reset());
  CHECK_FAILS(hps_stream_wait_event(consumer, event), HPS_STATUS_FAILED_PRECONDITION,
              "never recorded");
  CHECK_FAILS(hps_event_synchronize(event), HPS_STATUS_FAILED_PRECONDITION, "never recorded");
  CHECK_FAILS(hps_event_query(event, &completed), HPS_STATUS_FAILED_PRECONDITION, "never recorded");
  CHECK(completed == -1);
  CHECK_OK(hps_host_sync_count_thread(&before));
  CHECK(before == 0);

  /* Round trip: copy on one stream, record, the other waits stream-side and copies on. */
  CHECK_OK(hps_memcpy_async(mid, src, kCount * sizeof(float), stream));
  CHECK_OK(hps_event_record(event, stream));
  CHECK_OK(hps_stream_wait_event(consumer, event));
  CHECK_OK(hps_memcpy_async(dst, mid, kCount * sizeof(float), consumer));
  CHECK_OK(hps_host_sync_count_thread(&after));
  CHECK(after == 0);
  CHECK_OK(hps_stream_synchronize(consumer));
  CHECK_OK(hps_event_query(event, &completed));
  CHECK(completed == 1);
  CHECK_OK(hps_event_synchronize(event));
  for (i = 0; i < kCount; ++i) same = same && dst[i] == src[i];
  CHECK(same);
  CHECK_OK(hps_host_sync_count_thread(&after));
  CHECK(after == 2);
  CHECK_OK(hps_host_sync_count_total(&total));
  CHECK(total >= 2);

  /* Bad input. */
  CHECK_FAILS(hps_memcpy_async(NULL, src, 4, stream), HPS_STATUS_INVALID_ARGUMENT, "null pointer");
  CHECK_OK(hps_memcpy_async(NULL, NULL, 0, stream));
  CHECK_FAILS(hps_memcpy_async(dst, src, 4, NULL), HPS_STATUS_INVALID_ARGUMENT, "stream");
  CHECK_FAILS(hps_stream_synchronize(NULL), HPS_STATUS_INVALID_ARGUMENT, "hps_stream_synchronize");
  CHECK_FAILS(hps_stream_wait_event(stream, NULL), HPS_STATUS_INVALID_ARGUMENT, "event");
  CHECK_FAILS(hps_event_record(NULL, stream), HPS_STATUS_INVALID_ARGUMENT, "event");
  CHECK_FAILS(hps_event_record(event, NULL), HPS_STATUS_INVALID_ARGUMENT, "stream");
  CHECK_FAILS(hps_event_query(event, NULL), HPS_STATUS_INVALID_ARGUMENT, "out_completed");
  CHECK_FAILS(hps_event_synchronize(NULL), HPS_STATUS_INVALID_ARGUMENT, "event");
  CHECK_FAILS(hps_stream_create(HPS_DEVICE_CPU, 0, NULL), HPS_STATUS_INVALID_ARGUMENT,
              "out_stream");
  CHECK_FAILS(hps_event_create(HPS_DEVICE_CPU, 0, NULL), HPS_STATUS_INVALID_ARGUMENT, "out_event");
  {
    hps_stream_t* untouched = (hps_stream_t*)&g_checks;
    hps_event_t* untouched_event = (hps_event_t*)&g_checks;
    CHECK_FAILS(hps_stream_create(HPS_DEVICE_CPU, 1, &untouched), HPS_STATUS_OUT_OF_RANGE, "cpu:1");
    CHECK(untouched == (hps_stream_t*)&g_checks);
    CHECK_FAILS(hps_stream_create(HPS_DEVICE_CUDA, 99, &untouched), HPS_STATUS_OUT_OF_RANGE,
                "cuda:99");
    CHECK_FAILS(hps_stream_create((hps_device_type_t)9, 0, &untouched), HPS_STATUS_INVALID_ARGUMENT,
                "device type");
    CHECK_FAILS(hps_event_create(HPS_DEVICE_CUDA, -1, &untouched_event), HPS_STATUS_OUT_OF_RANGE,
                "cuda:-1");
    CHECK(untouched_event == (hps_event_t*)&g_checks);
  }

  CHECK_OK(hps_event_destroy(event));
  CHECK_OK(hps_stream_destroy(consumer));
  CHECK_OK(hps_stream_destroy(stream));
  CHECK_OK(hps_stream_destroy(NULL));
  CHECK_OK(hps_event_destroy(NULL));
  free(src);
  free(mid);
  free(dst);
}

static void test_host_sync_counter(void) {
  uint64_t count = 99;
  CHECK_OK(hps_host_sync_reset());
  CHECK_OK(hps_host_sync_count_thread(&count));
  CHECK(count == 0);
  CHECK_OK(hps_host_sync_count_total(&count));
  CHECK(count == 0);
  CHECK_FAILS(hps_host_sync_count_thread(NULL), HPS_STATUS_INVALID_ARGUMENT, "out_count");
  CHECK_FAILS(hps_host_sync_count_total(NULL), HPS_STATUS_INVALID_ARGUMENT, "out_count");
}

static void test_last_error_is_kept_until_next_failure(void) {
  size_t size = 0;
  CHECK(hps_dtype_size((hps_dtype_t)77, &size) == HPS_STATUS_INVALID_ARGUMENT);
  CHECK(strstr(hps_last_error_message(), "77") != NULL);
  CHECK_OK(hps_dtype_size(HPS_DTYPE_INT64, &size));
  CHECK(strstr(hps_last_error_message(), "77") != NULL);
}

int main(void) {
  test_version();
  test_status_strings();
  test_dtypes();
  test_devices();
  test_properties_abi_extension();
  test_streams_and_events();
  test_host_sync_counter();
  test_last_error_is_kept_until_next_failure();
  return check_summary();
}
