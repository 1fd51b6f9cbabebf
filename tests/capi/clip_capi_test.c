/* Hybrid clipping through the C API, as C99: one rank with no groups, and two thread-ranks
 * forming an mp group (a distributed gradient split in halves, a replicated one whole). */
#include <math.h>
#include <pthread.h>
#include <stdio.h>
#include <string.h>

#include "check.h"
#include "hpshard/hpshard.h"

static void test_single_rank(void) {
  hps_clip_options_t options;
  hps_clip_t* clip = NULL;
  hps_stream_t* stream = NULL;
  float grads[2] = {3.0f, 4.0f}, frozen[2] = {100.0f, 100.0f}, norm = -1.0f;
  double half[1] = {0.0};
  int32_t ints[2] = {1, 2};
  const float* coefficient = NULL;
  uint64_t syncs = 99;

  DLManagedTensor* view = NULL;

  CHECK_OK(hps_clip_options_init(&options, sizeof options));
  CHECK(options.max_norm == 1.0 && options.deterministic == 0);
  options.max_norm = 0.0;
  CHECK(hps_clip_create(NULL, NULL, NULL, &options, &clip) == HPS_STATUS_INVALID_ARGUMENT);
  CHECK(strstr(hps_last_error_message(), "max_norm") != NULL);
  CHECK(clip == NULL);
  options.max_norm = 1.0;
  CHECK_OK(hps_clip_create(NULL, NULL, NULL, &options, &clip));
  CHECK(hps_clip_add_tensor(clip, ints, 2, HPS_DTYPE_INT32, 0) == HPS_STATUS_INVALID_ARGUMENT);
  CHECK(hps_clip_add_tensor(clip, grads, 2, HPS_DTYPE_FLOAT32, 64) == HPS_STATUS_INVALID_ARGUMENT);
  CHECK(hps_clip_add_tensor(clip, NULL, 2, HPS_DTYPE_FLOAT32, 0) == HPS_STATUS_INVALID_ARGUMENT);
  /* Counts whose byte size overflows (or past 2^60) are refused, as a collective's are. */
  CHECK(hps_clip_add_tensor(clip, grads, UINT64_MAX / 4 + 1, HPS_DTYPE_FLOAT32, 0) ==
        HPS_STATUS_INVALID_ARGUMENT);
  CHECK(strstr(hps_last_error_message(), "overflows") != NULL);
  CHECK(hps_clip_add_tensor(clip, half, (uint64_t)1 << 61, HPS_DTYPE_FLOAT64, 0) ==
        HPS_STATUS_INVALID_ARGUMENT);
  /* No communicators: the coefficient has no place before the first run picks its device. */
  CHECK(hps_clip_coefficient(clip, &coefficient) == HPS_STATUS_FAILED_PRECONDITION);
  CHECK(coefficient == NULL);
  CHECK(hps_clip_coefficient_dlpack(clip, &view) == HPS_STATUS_FAILED_PRECONDITION);
  CHECK(view == NULL);
  CHECK_OK(hps_clip_add_tensor(clip, grads, 2, HPS_DTYPE_FLOAT32, 0));
  CHECK_OK(hps_clip_add_tensor(clip, frozen, 2, HPS_DTYPE_FLOAT32, HPS_CLIP_NO_CLIP));
  CHECK_OK(hps_clip_add_tensor(clip, half, 1, HPS_DTYPE_FLOAT64, HPS_CLIP_SHARED_NOT_FIRST));
  CHECK_OK(hps_stream_create(HPS_DEVICE_CPU, 0, &stream));
  CHECK(hps_clip_run(clip, stream, &norm, 1) == HPS_STATUS_FAILED_PRECONDITION);
  CHECK_OK(hps_clip_seal(clip));
  CHECK(hps_clip_seal(clip) == HPS_STATUS_FAILED_PRECONDITION);
  CHECK(hps_clip_add_tensor(clip, grads, 2, HPS_DTYPE_FLOAT32, 0) ==
        HPS_STATUS_FAILED_PRECONDITION);

  CHECK_OK(hps_host_sync_reset());
  CHECK_OK(hps_clip_run(clip, stream, &norm, 1));
  CHECK_OK(hps_host_sync_count_thread(&syncs));
  CHECK(syncs == 0);
  CHECK_OK(hps_stream_synchronize(stream));
  CHECK(fabsf(norm - 5.0f) < 1e-6f);
  CHECK(fabsf(grads[0] - 3.0f / 5.000001f) < 1e-6f && fabsf(grads[1] - 4.0f / 5.000001f) < 1e-6f);
  CHECK(frozen[0] == 100.0f && frozen[1] == 100.0f);
  CHECK_OK(hps_clip_coefficient(clip, &coefficient));
  CHECK(coefficient != NULL && fabsf(*coefficient - 1.0f / 5.000001f) < 1e-6f);
  CHECK_OK(hps_clip_coefficient_dlpack(clip, &view));
  CHECK(view != NULL && view->dl_tensor.data == (void*)coefficient);
  CHECK_OK(hps_dlpack_release(view));
  CHECK_OK(hps_clip_destroy(clip));
  CHECK_OK(hps_clip_destroy(NULL));
  CHECK_OK(hps_stream_destroy(stream));
}

typedef struct {
  int rank;
  int mismatched;
  float norm;
} mp_args_t;

/* The model: w (distributed, 4 elements split 2 + 2 over mp) and b (replicated, 2). */
static const float kW[4] = {1.0f, 2.0f, 3.0f, 4.0f};
static const float kB[2] = {5.0f, 6.0f};

static void* mp_rank(void* p) {
  mp_args_t* a = (mp_args_t*)p;
  hps_store_t* store = NULL;
  hps_comm_t* mp = NULL;
  hps_clip_t* clip = NULL;
  hps_stream_t* stream = NULL;
  hps_clip_options_t options;
  float w[2], b[2];
  w[0] = kW[2 * a->rank];
  w[1] = kW[2 * a->rank + 1];
  b[0] = kB[0];
  b[1] = kB[1];
  CHECK_OK(hps_store_open(a->mismatched ? "memory://clip_mismatch" : "memory://clip_mp", a->rank,
                          10000, &store));
  CHECK_OK(hps_comm_create(store, a->rank, 2, HPS_DEVICE_CPU, 0, NULL, &mp));
  CHECK_OK(hps_clip_options_init(&options, sizeof options));
  options.max_norm = 100.0;
  options.deterministic = 1;
  CHECK_OK(hps_clip_create(NULL, mp, NULL, &options, &clip));
  CHECK_OK(
      hps_clip_add_tensor(clip, w, 2, HPS_DTYPE_FLOAT32,
                          a->mismatched && a->rank == 1 ? 0u : (uint32_t)HPS_CLIP_DISTRIBUTED));
  CHECK_OK(hps_clip_add_tensor(clip, b, 2, HPS_DTYPE_FLOAT32, 0));
  CHECK_OK(hps_stream_create(HPS_DEVICE_CPU, 0, &stream));
  if (a->mismatched) {
    CHECK(hps_clip_seal(clip) == HPS_STATUS_INVALID_ARGUMENT);
    CHECK(strstr(hps_last_error_message(), "mp") != NULL);
    CHECK(hps_clip_run(clip, stream, &a->norm, 1) == HPS_STATUS_FAILED_PRECONDITION);
  } else {
    CHECK_OK(hps_clip_seal(clip));
    CHECK_OK(hps_clip_run(clip, stream, &a->norm, 1));
    CHECK_OK(hps_stream_synchronize(stream));
  }
  CHECK(w[0] == kW[2 * a->rank] && b[1] == kB[1]); /* max_norm 100 > norm: coef ~ 1 */
  hps_stream_destroy(stream);
  hps_clip_destroy(clip);
  hps_comm_destroy(mp);
  hps_store_destroy(store);
  return NULL;
}

static void run_mp(int mismatched, float* norms) {
  pthread_t threads[2];
  mp_args_t args[2];
  int r;
  for (r = 0; r < 2; ++r) {
    args[r].rank = r;
    args[r].mismatched = mismatched;
    args[r].norm = -1.0f;
    pthread_create(&threads[r], NULL, mp_rank, &args[r]);
  }
  for (r = 0; r < 2; ++r) pthread_join(threads[r], NULL);
  for (r = 0; r < 2; ++r) norms[r] = args[r].norm;
}

static int have_cpu_communicators(void) {
  hps_store_t* store = NULL;
  hps_comm_t* comm = NULL;
  hps_status_t s;
  if (hps_store_open("memory://probe", 0, 1000, &store) != HPS_STATUS_OK) return 0;
  s = hps_comm_create(store, 0, 1, HPS_DEVICE_CPU, 0, NULL, &comm);
  hps_comm_destroy(comm);
  hps_store_destroy(store);
  return s == HPS_STATUS_OK;
}

int main(void) {
  float norms[2];
  /* sqrt(1 + 4 + 9 + 16 + 25 + 36): w counted once in pieces, b once though on both ranks. */
  const float expected = sqrtf(91.0f);
  int multi = have_cpu_communicators();
  test_single_rank();
  if (multi) {
    run_mp(0, norms);
    CHECK(fabsf(norms[0] - expected) < 1e-5f && norms[0] == norms[1]);
    run_mp(1, norms);
  } else {
    printf("multi-rank part skipped: no CPU communicators in this build\n");
  }
  if (check_summary() != 0) return 1;
  return multi ? 0 : 77;
}
