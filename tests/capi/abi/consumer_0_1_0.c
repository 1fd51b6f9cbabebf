/* A program compiled against the frozen hpshard.h of the 0.1.0 release (include-0.1.0/,
 * kept as released) runs against the library of today: every ABI-extensible struct of
 * 0.1.0, with 0.1.0's sizes, is initialised and used, and a training step gives the
 * right numbers. Each struct lies at the start of a bigger buffer whose bytes past the
 * struct are set: the library must neither write them (an _init or an output struct
 * writes only struct_size bytes) nor read them as the fields it has added since. */
#include <stdio.h>
#include <string.h>

#include "../check.h"
#include "hpshard/hpshard.h"

#if HPS_VERSION_MAJOR != 0 || HPS_VERSION_MINOR != 1 || HPS_VERSION_PATCH != 0
#error "this test is compiled against the frozen 0.1.0 header (tests/capi/abi/include-0.1.0)"
#endif

enum { kTail = 64, kSentinel = 0x5A };

/* A struct of `size` bytes followed by kTail bytes set to kSentinel. */
typedef union {
  unsigned char bytes[1024 + kTail];
  double align_double;
  void* align_pointer;
} buffer_t;

static void fill_tail(buffer_t* b, size_t size) { memset(b->bytes + size, kSentinel, kTail); }

static int tail_intact(const buffer_t* b, size_t size) {
  size_t i;
  for (i = 0; i < kTail; ++i) {
    if (b->bytes[size + i] != kSentinel) return 0;
  }
  return 1;
}

int main(void) {
  buffer_t props_buf, info_buf, comm_buf, clip_buf, engine_buf;
  hps_device_properties_t* props = (hps_device_properties_t*)props_buf.bytes;
  hps_rendezvous_info_t* info = (hps_rendezvous_info_t*)info_buf.bytes;
  hps_comm_options_t* comm_options = (hps_comm_options_t*)comm_buf.bytes;
  hps_clip_options_t* clip_options = (hps_clip_options_t*)clip_buf.bytes;
  hps_engine_options_t* engine_options = (hps_engine_options_t*)engine_buf.bytes;
  hps_store_t* store = NULL;
  hps_comm_t* comm = NULL;
  hps_clip_t* clip = NULL;
  hps_engine_t* engine = NULL;
  hps_stream_t* stream = NULL;
  const int64_t shape[1] = {4};
  size_t index = 99;
  float *param = NULL, *grad = NULL, norm = 0, out[4];
  float grads[2] = {3.0f, 4.0f};
  int i;

  printf("compiled against hpshard.h %s, running against libhpshard %s\n", HPS_VERSION_STRING,
         hps_version_string());
  CHECK(hps_version_number() >= HPS_VERSION_NUMBER);

  /* Device properties: the output struct is written up to 0.1.0's size only. */
  fill_tail(&props_buf, sizeof *props);
  CHECK_OK(hps_device_properties_init(props, sizeof *props));
  CHECK(props->struct_size == sizeof *props);
  CHECK_OK(hps_device_get_properties(HPS_DEVICE_CPU, 0, props));
  CHECK(props->type == HPS_DEVICE_CPU && props->multiprocessor_count >= 1);
  CHECK(strlen(props->name) > 0);
  CHECK(tail_intact(&props_buf, sizeof *props));

  /* Rendezvous info: _init writes 0.1.0's size only. */
  fill_tail(&info_buf, sizeof *info);
  CHECK_OK(hps_rendezvous_info_init(info, sizeof *info));
  CHECK(info->struct_size == sizeof *info && info->rank == 0 && info->store_url[0] == '\0');
  CHECK(tail_intact(&info_buf, sizeof *info));

  /* Options: _init leaves the tail alone, and _create does not read it. */
  fill_tail(&comm_buf, sizeof *comm_options);
  CHECK_OK(hps_comm_options_init(comm_options, sizeof *comm_options));
  CHECK(tail_intact(&comm_buf, sizeof *comm_options));
  comm_options->name = "abi-0.1.0";
  fill_tail(&clip_buf, sizeof *clip_options);
  CHECK_OK(hps_clip_options_init(clip_options, sizeof *clip_options));
  CHECK(tail_intact(&clip_buf, sizeof *clip_options) && clip_options->max_norm == 1.0);
  clip_options->max_norm = 1.0;
  fill_tail(&engine_buf, sizeof *engine_options);
  CHECK_OK(hps_engine_options_init(engine_options, sizeof *engine_options));
  CHECK(tail_intact(&engine_buf, sizeof *engine_options));
  CHECK(engine_options->struct_size == sizeof *engine_options && engine_options->stage == 2);
  /* A newer library's first appended field would read these bytes as a pointer: it must
   * take its default instead. */
  engine_options->learning_rate = 0.5f;

  CHECK_OK(hps_store_open("memory://abi-0.1.0", 0, 10000, &store));
  CHECK_OK(hps_comm_create(store, 0, 1, HPS_DEVICE_CPU, 0, comm_options, &comm));
  CHECK_OK(hps_stream_create(HPS_DEVICE_CPU, 0, &stream));
  if (comm == NULL || stream == NULL) return 1;

  /* The clip over the 0.1.0 options struct: norm 5, the gradients scaled by 1 / 5. */
  CHECK_OK(hps_clip_create(comm, NULL, NULL, clip_options, &clip));
  if (clip != NULL) {
    CHECK_OK(hps_clip_add_tensor(clip, grads, 2, HPS_DTYPE_FLOAT32, 0));
    CHECK_OK(hps_clip_seal(clip));
    CHECK_OK(hps_clip_run(clip, stream, &norm, 1));
    CHECK_OK(hps_stream_synchronize(stream));
    CHECK(norm > 4.9999f && norm < 5.0001f);
    CHECK(grads[0] > 0.5999f && grads[0] < 0.6001f);
  }

  /* One SGD step with the 0.1.0 engine options (lr 0.5): p = 1 - 0.5 * g. */
  CHECK_OK(hps_engine_create(comm, NULL, engine_options, &engine));
  if (engine != NULL) {
    CHECK_OK(hps_engine_add_param(engine, "w", shape, 1, HPS_DTYPE_FLOAT32, 0, 0, &index));
    CHECK(index == 0);
    CHECK_OK(hps_engine_seal(engine));
    CHECK_OK(hps_engine_param(engine, 0, (void**)&param));
    for (i = 0; i < 4; ++i) param[i] = 1.0f;
    CHECK_OK(hps_engine_broadcast_parameters(engine));
    CHECK_OK(hps_engine_wait_parameters(engine, 0));
    CHECK_OK(hps_engine_grad(engine, 0, (void**)&grad));
    for (i = 0; i < 4; ++i) grad[i] = (float)i;
    CHECK_OK(hps_engine_grad_ready(engine, 0, NULL));
    CHECK_OK(hps_engine_release_parameters(engine, 0));
    CHECK_OK(hps_engine_step(engine));
    CHECK_OK(hps_engine_gather_parameter(engine, 0, out, 4));
    for (i = 0; i < 4; ++i) CHECK(out[i] == 1.0f - 0.5f * (float)i);
  }

  CHECK_OK(hps_engine_destroy(engine));
  CHECK_OK(hps_clip_destroy(clip));
  CHECK_OK(hps_stream_destroy(stream));
  CHECK_OK(hps_comm_destroy(comm));
  CHECK_OK(hps_store_destroy(store));
  if (check_summary() != 0) return 1;
  printf("the 0.1.0 consumer runs against libhpshard %s\n", hps_version_string());
  return 0;
}
