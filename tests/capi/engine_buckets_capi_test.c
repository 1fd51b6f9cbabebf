/* Engine calls through the C API, as C99: a failed seal, a learning-rate schedule, the
 * gradient norm, the count of failures returned, and bucket_bytes: two thread-ranks build the same
 * model with and without a cap on a bucket's bytes, at stage 2 and 3. The capped engine cuts unit 0
 * into more flat buffers (hps_engine_param_bucket), its shards hold other parts of the parameters
 * (hps_engine_shard_range), and training ends bitwise equal to the uncapped engine's (two ranks:
 * every reduced element is a + b either way). */
#include <math.h>
#include <pthread.h>
#include <stdio.h>
#include <string.h>

#include "check.h"
#include "hpshard/hpshard.h"

/* Unit 0: w1, w2, b (trainable) and f (frozen); unit 1: w3. With 256-byte alignment (64
 * floats) and a 4096-byte cap, w1 (4000 bytes) fills a bucket; w2 starts the next, and b
 * (at float 960, ending at 3936 bytes) joins it. */
enum { kParams = 5, kSteps = 4 };
static const int64_t kNumel[kParams] = {1000, 900, 24, 10, 300};
static const char* const kNames[kParams] = {"w1", "w2", "b", "f", "w3"};
static const int32_t kUnit[kParams] = {0, 0, 0, 0, 1};
static const uint32_t kFlags[kParams] = {0, 0, 0, HPS_PARAM_FROZEN, 0};
enum { kCap = 4096 };

typedef struct {
  int rank;
  int32_t stage;
  /* [capped][param]: the parameters after training, gathered. */
  float result[2][kParams][1000];
} rank_args_t;

static hps_engine_t* make_engine(hps_comm_t* comm, int32_t stage, uint64_t cap) {
  hps_engine_options_t o;
  hps_engine_t* engine = NULL;
  size_t index = 0, bucket = 0;
  int i;
  CHECK_OK(hps_engine_options_init(&o, sizeof o));
  CHECK(o.bucket_bytes == 0);
  o.stage = stage;
  o.learning_rate = 0.05f;
  o.momentum = 0.9f;
  o.bucket_bytes = cap;
  CHECK_OK(hps_engine_create(comm, NULL, &o, &engine));
  if (engine == NULL) return NULL;
  for (i = 0; i < kParams; ++i) {
    CHECK_OK(hps_engine_add_param(engine, kNames[i], &kNumel[i], 1, HPS_DTYPE_FLOAT32, kFlags[i],
                                  kUnit[i], &index));
    CHECK(index == (size_t)i);
  }
  CHECK(hps_engine_param_bucket(engine, 0, &bucket) == HPS_STATUS_FAILED_PRECONDITION);
  CHECK_OK(hps_engine_seal(engine));
  CHECK(hps_engine_param_bucket(engine, kParams, &bucket) == HPS_STATUS_OUT_OF_RANGE);
  CHECK(hps_engine_param_bucket(engine, 0, NULL) == HPS_STATUS_INVALID_ARGUMENT);
  CHECK(hps_engine_param_bucket(NULL, 0, &bucket) == HPS_STATUS_INVALID_ARGUMENT);
  return engine;
}

/* Initial values written on rank 0 and broadcast (stage 3: while sealed, before sharding). */
static void initialise(hps_engine_t* engine) {
  int i, k;
  for (i = 0; i < kParams; ++i) {
    float* p = NULL;
    CHECK_OK(hps_engine_param(engine, (size_t)i, (void**)&p));
    if (p == NULL) return;
    for (k = 0; k < kNumel[i]; ++k) p[k] = 0.5f * cosf(0.37f * (float)k + (float)i);
  }
  CHECK_OK(hps_engine_broadcast_parameters(engine));
}

/* One step: per unit, gather, add gradients that depend on the parameters, check them in
 * one by one (the capped engine starts w1's reduction before w2's gradient is written). */
static void train_step(hps_engine_t* engine, int rank, int step) {
  int32_t unit;
  int i, k;
  for (unit = 1; unit >= 0; --unit) {
    CHECK_OK(hps_engine_wait_parameters(engine, unit));
    for (i = 0; i < kParams; ++i) {
      float *p = NULL, *g = NULL;
      if (kUnit[i] != unit || (kFlags[i] & HPS_PARAM_FROZEN)) continue;
      CHECK_OK(hps_engine_param(engine, (size_t)i, (void**)&p));
      CHECK_OK(hps_engine_grad(engine, (size_t)i, (void**)&g));
      if (p == NULL || g == NULL) return;
      for (k = 0; k < kNumel[i]; ++k) {
        g[k] += 0.3f * p[k] + sinf(0.01f * (float)k + (float)(rank + 3 * step + i));
      }
      CHECK_OK(hps_engine_grad_ready(engine, (size_t)i, NULL));
    }
    CHECK_OK(hps_engine_release_parameters(engine, unit));
  }
  CHECK_OK(hps_engine_step(engine));
}

static void* rank_main(void* arg) {
  rank_args_t* a = (rank_args_t*)arg;
  hps_store_t* store = NULL;
  hps_comm_t* comm = NULL;
  char url[64];
  size_t buckets[2][kParams];
  int capped, i, s;

  snprintf(url, sizeof url, "memory://engine_buckets_capi_test_%d", (int)a->stage);
  CHECK_OK(hps_store_open(url, a->rank, 20000, &store));
  CHECK_OK(hps_comm_create(store, a->rank, 2, HPS_DEVICE_CPU, 0, NULL, &comm));
  if (comm == NULL) return NULL;
  for (capped = 0; capped < 2; ++capped) {
    hps_engine_t* engine = make_engine(comm, a->stage, capped ? kCap : 0);
    uint64_t begin = 0, end = 0;
    if (engine == NULL) break;
    for (i = 0; i < kParams; ++i) {
      CHECK_OK(hps_engine_param_bucket(engine, (size_t)i, &buckets[capped][i]));
    }
    /* w1's bucket without the cap pads to 2048 floats: rank 0's half holds all of w1. With
     * it, w1's own bucket pads to 1024: each rank holds half. */
    CHECK_OK(hps_engine_shard_range(engine, 0, &begin, &end));
    if (capped) {
      CHECK(begin == (a->rank == 0 ? 0u : 512u) && end == (a->rank == 0 ? 512u : 1000u));
    } else {
      CHECK(begin == 0 && end == (a->rank == 0 ? 1000u : 0u));
    }
    initialise(engine);
    for (s = 0; s < kSteps; ++s) train_step(engine, a->rank, s);
    for (i = 0; i < kParams; ++i) {
      CHECK_OK(hps_engine_gather_parameter(engine, (size_t)i, a->result[capped][i],
                                           (uint64_t)kNumel[i]));
    }
    CHECK_OK(hps_engine_destroy(engine));
  }
  /* Without the cap: unit 0's trainable parameters share one bucket; the frozen one and
   * unit 1 have their own. With it: w1 alone, w2 with b. */
  CHECK(buckets[0][0] == buckets[0][1] && buckets[0][1] == buckets[0][2]);
  CHECK(buckets[0][3] != buckets[0][0] && buckets[0][4] != buckets[0][0] &&
        buckets[0][4] != buckets[0][3]);
  CHECK(buckets[1][0] != buckets[1][1] && buckets[1][1] == buckets[1][2]);
  CHECK(buckets[1][3] != buckets[1][0] && buckets[1][3] != buckets[1][1]);
  CHECK(buckets[1][4] != buckets[1][0] && buckets[1][4] != buckets[1][1] &&
        buckets[1][4] != buckets[1][3]);
  CHECK_OK(hps_comm_destroy(comm));
  CHECK_OK(hps_store_destroy(store));
  return NULL;
}

/* A seal that fails (here: 256 TiB of parameters cannot be allocated) leaves the engine
 * unsealed, as before it: parameters can still be added, the sealed-only calls are refused. The
 * loss scale has no address before a seal. */
static void test_failed_seal_changes_nothing(void) {
  hps_store_t* store = NULL;
  hps_comm_t* comm = NULL;
  hps_engine_options_t o;
  hps_engine_t* engine = NULL;
  const int64_t huge[2] = {(int64_t)1 << 23, (int64_t)1 << 23}; /* 2^46 float32 elements */
  const int64_t small = 8;
  const float* scale = NULL;
  const int64_t* skipped = NULL;
  DLManagedTensor *scale_view = NULL, *skipped_view = NULL;
  size_t index = 99;
  uint64_t begin = 0, end = 0;
  CHECK_OK(hps_store_open("memory://engine_failed_seal", 0, 20000, &store));
  CHECK_OK(hps_comm_create(store, 0, 1, HPS_DEVICE_CPU, 0, NULL, &comm));
  CHECK_OK(hps_engine_options_init(&o, sizeof o));
  CHECK_OK(hps_engine_create(comm, NULL, &o, &engine));
  if (engine != NULL) {
    CHECK(hps_engine_loss_scale(engine, &scale, &skipped) == HPS_STATUS_FAILED_PRECONDITION);
    CHECK(scale == NULL && skipped == NULL);
    CHECK(hps_engine_loss_scale_dlpack(engine, &scale_view, &skipped_view) ==
          HPS_STATUS_FAILED_PRECONDITION);
    CHECK(scale_view == NULL && skipped_view == NULL);
    CHECK_OK(hps_engine_add_param(engine, "huge", huge, 2, HPS_DTYPE_FLOAT32, 0, 0, &index));
    CHECK(hps_engine_seal(engine) != HPS_STATUS_OK);
    CHECK(hps_engine_shard_range(engine, 0, &begin, &end) == HPS_STATUS_FAILED_PRECONDITION);
    CHECK(hps_engine_param_bucket(engine, 0, &index) == HPS_STATUS_FAILED_PRECONDITION);
    CHECK(hps_engine_loss_scale(engine, &scale, &skipped) == HPS_STATUS_FAILED_PRECONDITION);
    CHECK_OK(hps_engine_add_param(engine, "small", &small, 1, HPS_DTYPE_FLOAT32, 0, 0, &index));
    CHECK(index == 1);
  }
  CHECK_OK(hps_engine_destroy(engine));
  CHECK_OK(hps_comm_destroy(comm));
  CHECK_OK(hps_store_destroy(store));
}

/* A learning-rate schedule: each step takes the rate set before it, in SGD (exactly:
 * p -= lr * g) and AdamW (its first step moves each element by lr, |m^ / sqrt(v^)| = 1). */
static void test_learning_rate_schedule(void) {
  const hps_optimizer_t kinds[2] = {HPS_OPTIMIZER_SGD, HPS_OPTIMIZER_ADAMW};
  int k, s, i;
  for (k = 0; k < 2; ++k) {
    hps_store_t* store = NULL;
    hps_comm_t* comm = NULL;
    hps_engine_options_t o;
    hps_engine_t* engine = NULL;
    const int64_t n = 4;
    const int64_t none = 0;
    const float rates[3] = {0.5f, 0.125f, 0.0f};
    void* data = NULL;
    float* param = NULL;
    float* grad = NULL;
    float values[4];
    size_t index = 0;
    CHECK_OK(hps_store_open(k == 0 ? "memory://lr-sgd" : "memory://lr-adamw", 0, 20000, &store));
    CHECK_OK(hps_comm_create(store, 0, 1, HPS_DEVICE_CPU, 0, NULL, &comm));
    CHECK_OK(hps_engine_options_init(&o, sizeof o));
    o.optimizer = kinds[k];
    o.learning_rate = 1.0f;
    CHECK_OK(hps_engine_create(comm, NULL, &o, &engine));
    if (engine == NULL) return;
    CHECK(hps_engine_set_learning_rate(NULL, 0.1f) == HPS_STATUS_INVALID_ARGUMENT);
    CHECK(hps_engine_set_learning_rate(engine, -0.1f) == HPS_STATUS_INVALID_ARGUMENT);
    CHECK(hps_engine_set_learning_rate(engine, (float)NAN) == HPS_STATUS_INVALID_ARGUMENT);
    CHECK_OK(hps_engine_add_param(engine, "w", &n, 1, HPS_DTYPE_FLOAT32, 0, 0, &index));
    /* A parameter without elements is gathered into nothing (UBSan saw a copy from null). */
    CHECK_OK(hps_engine_add_param(engine, "empty", &none, 1, HPS_DTYPE_FLOAT32, HPS_PARAM_FROZEN, 0,
                                  &index));
    CHECK_OK(hps_engine_seal(engine));
    CHECK_OK(hps_engine_param(engine, 0, &data));
    param = (float*)data;
    for (i = 0; i < 4; ++i) param[i] = 0.0f;
    CHECK_OK(hps_engine_broadcast_parameters(engine));
    for (s = 0; s < 3; ++s) {
      CHECK_OK(hps_engine_set_learning_rate(engine, rates[s]));
      CHECK_OK(hps_engine_wait_parameters(engine, 0));
      CHECK_OK(hps_engine_grad(engine, 0, &data));
      grad = (float*)data;
      for (i = 0; i < 4; ++i) grad[i] = 1.0f; /* the same gradient every step */
      CHECK_OK(hps_engine_grad_ready(engine, 0, NULL));
      CHECK_OK(hps_engine_release_parameters(engine, 0));
      CHECK_OK(hps_engine_step(engine));
    }
    CHECK_OK(hps_engine_gather_parameter(engine, 1, values, 0));
    CHECK_OK(hps_engine_gather_parameter(engine, 0, values, 4));
    for (i = 0; i < 4; ++i) {
      /* SGD: -(0.5 + 0.125 + 0) exactly. AdamW with a constant gradient: every step moves
       * by its rate times m^/(sqrt(v^)+eps) = 1/(1+1e-8): -(0.5 + 0.125) within 1e-6. */
      if (k == 0) {
        CHECK(values[i] == -0.625f);
      } else {
        CHECK(fabsf(values[i] + 0.625f) < 1e-6f);
      }
    }
    CHECK_OK(hps_engine_destroy(engine));
    CHECK_OK(hps_comm_destroy(comm));
    CHECK_OK(hps_store_destroy(store));
  }
}

/* hps_engine_failures_returned: NULL refused; 0 at creation; a refused query (an index out
 * of range) or option does not count, a refused call that runs the engine's work (a step
 * before seal, a wait for a unit that does not exist) does; successful calls leave it. */
static void test_failures_returned(void) {
  hps_store_t* store = NULL;
  hps_comm_t* comm = NULL;
  hps_engine_t* engine = NULL;
  const int64_t n = 4;
  uint64_t count = 99;
  size_t index = 0;
  void* data = NULL;
  CHECK_OK(hps_store_open("memory://failures-returned", 0, 20000, &store));
  CHECK_OK(hps_comm_create(store, 0, 1, HPS_DEVICE_CPU, 0, NULL, &comm));
  CHECK_OK(hps_engine_create(comm, NULL, NULL, &engine));
  if (engine == NULL) return;
  CHECK(hps_engine_failures_returned(NULL, &count) == HPS_STATUS_INVALID_ARGUMENT);
  CHECK(hps_engine_failures_returned(engine, NULL) == HPS_STATUS_INVALID_ARGUMENT);
  CHECK(count == 99); /* untouched by the refusal */
  CHECK_OK(hps_engine_failures_returned(engine, &count));
  CHECK(count == 0);
  CHECK(hps_engine_set_learning_rate(engine, -1.0f) == HPS_STATUS_INVALID_ARGUMENT);
  CHECK(hps_engine_param(engine, 7, &data) != HPS_STATUS_OK);
  CHECK_OK(hps_engine_failures_returned(engine, &count));
  CHECK(count == 0);
  CHECK(hps_engine_step(engine) == HPS_STATUS_FAILED_PRECONDITION); /* before seal */
  CHECK_OK(hps_engine_failures_returned(engine, &count));
  CHECK(count == 1);
  CHECK_OK(hps_engine_add_param(engine, "w", &n, 1, HPS_DTYPE_FLOAT32, 0, 0, &index));
  CHECK_OK(hps_engine_seal(engine));
  CHECK_OK(hps_engine_broadcast_parameters(engine));
  CHECK(hps_engine_wait_parameters(engine, 5) != HPS_STATUS_OK);
  CHECK_OK(hps_engine_synchronize(engine));
  CHECK_OK(hps_engine_failures_returned(engine, &count));
  CHECK(count == 2);
  CHECK_OK(hps_engine_destroy(engine));
  CHECK_OK(hps_comm_destroy(comm));
  CHECK_OK(hps_store_destroy(store));
}

/* hps_engine_grad_norm: refused before seal and without clipping (nothing written), NULL
 * refused; with clipping the last step's norm through the pointer and a DLPack view that
 * keeps the engine's memory readable after the engine is gone (AddressSanitizer would see
 * a freed read). Gradients (6, 8): norm 10. */
static void test_grad_norm(void) {
  hps_store_t* store = NULL;
  hps_comm_t* comm = NULL;
  hps_engine_options_t o;
  hps_engine_t *plain = NULL, *engine = NULL;
  const int64_t two = 2;
  const float* norm = NULL;
  DLManagedTensor* view = NULL;
  size_t index = 0;
  float* grad = NULL;
  CHECK_OK(hps_store_open("memory://engine_grad_norm", 0, 20000, &store));
  CHECK_OK(hps_comm_create(store, 0, 1, HPS_DEVICE_CPU, 0, NULL, &comm));
  CHECK_OK(hps_engine_options_init(&o, sizeof o));
  CHECK_OK(hps_engine_create(comm, NULL, &o, &plain));
  CHECK_OK(hps_engine_add_param(plain, "w", &two, 1, HPS_DTYPE_FLOAT32, 0, 0, &index));
  CHECK_OK(hps_engine_seal(plain));
  CHECK(hps_engine_grad_norm(plain, &norm) == HPS_STATUS_FAILED_PRECONDITION && norm == NULL);
  CHECK(strstr(hps_last_error_message(), "clip") != NULL);
  CHECK(hps_engine_grad_norm_dlpack(plain, &view) == HPS_STATUS_FAILED_PRECONDITION);
  CHECK(view == NULL);
  CHECK_OK(hps_engine_destroy(plain));

  o.clip_max_norm = 1.0;
  CHECK_OK(hps_engine_create(comm, NULL, &o, &engine));
  if (engine == NULL) return;
  CHECK_OK(hps_engine_add_param(engine, "w", &two, 1, HPS_DTYPE_FLOAT32, 0, 0, &index));
  CHECK(hps_engine_grad_norm(engine, &norm) == HPS_STATUS_FAILED_PRECONDITION && norm == NULL);
  CHECK(hps_engine_grad_norm(NULL, &norm) == HPS_STATUS_INVALID_ARGUMENT);
  CHECK(hps_engine_grad_norm(engine, NULL) == HPS_STATUS_INVALID_ARGUMENT);
  CHECK(hps_engine_grad_norm_dlpack(engine, NULL) == HPS_STATUS_INVALID_ARGUMENT);
  CHECK_OK(hps_engine_seal(engine));
  CHECK_OK(hps_engine_broadcast_parameters(engine));
  CHECK_OK(hps_engine_grad_norm(engine, &norm));
  CHECK_OK(hps_engine_grad_norm_dlpack(engine, &view));
  if (norm == NULL || view == NULL) return;
  CHECK(*norm == 0.0f && view->dl_tensor.data == (void*)norm);
  CHECK(view->dl_tensor.dtype.code == kDLFloat && view->dl_tensor.dtype.bits == 32 &&
        view->dl_tensor.ndim == 1 && view->dl_tensor.shape[0] == 1 &&
        view->dl_tensor.device.device_type == kDLCPU);
  CHECK_OK(hps_engine_wait_parameters(engine, 0));
  CHECK_OK(hps_engine_grad(engine, index, (void**)&grad));
  if (grad != NULL) {
    grad[0] = 6.0f;
    grad[1] = 8.0f;
  }
  CHECK_OK(hps_engine_grad_ready(engine, index, NULL));
  CHECK_OK(hps_engine_release_parameters(engine, 0));
  CHECK_OK(hps_engine_step(engine));
  CHECK_OK(hps_engine_wait_parameters(engine, 0));
  CHECK(*norm == 10.0f);
  CHECK_OK(hps_engine_destroy(engine));
  CHECK_OK(hps_comm_destroy(comm));
  CHECK_OK(hps_store_destroy(store));
  CHECK(*(const float*)view->dl_tensor.data == 10.0f);
  CHECK_OK(hps_dlpack_release(view));
}

int main(void) {
  int32_t stage;
  { /* CPU communicators need Gloo: without it this test has nothing to run on. */
    hps_store_t* store = NULL;
    hps_comm_t* comm = NULL;
    hps_status_t s;
    CHECK_OK(hps_store_open("memory://engine_buckets_capi_probe", 0, 20000, &store));
    s = hps_comm_create(store, 0, 1, HPS_DEVICE_CPU, 0, NULL, &comm);
    hps_comm_destroy(comm);
    hps_store_destroy(store);
    if (s == HPS_STATUS_UNAVAILABLE) {
      printf("skipped: %s\n", hps_last_error_message());
      return 77;
    }
  }
  test_failed_seal_changes_nothing();
  test_learning_rate_schedule();
  test_grad_norm();
  test_failures_returned();
  for (stage = 2; stage <= 3; ++stage) {
    static rank_args_t args[2];
    pthread_t threads[2];
    int r, i, changed = 0;
    for (r = 0; r < 2; ++r) {
      memset(&args[r], 0, sizeof args[r]);
      args[r].rank = r;
      args[r].stage = stage;
      pthread_create(&threads[r], NULL, rank_main, &args[r]);
    }
    for (r = 0; r < 2; ++r) pthread_join(threads[r], NULL);
    for (r = 0; r < 2; ++r) {
      for (i = 0; i < kParams; ++i) {
        const size_t bytes = (size_t)kNumel[i] * sizeof(float);
        CHECK(memcmp(args[r].result[0][i], args[r].result[1][i], bytes) == 0);
        CHECK(memcmp(args[r].result[0][i], args[0].result[0][i], bytes) == 0);
      }
    }
    /* Training moved the trainable parameters, and left the frozen one as written. */
    changed = args[0].result[0][0][0] != 0.5f * cosf(0.0f);
    CHECK(changed);
    CHECK(args[0].result[0][3][1] == 0.5f * cosf(0.37f + 3.0f));
    printf("stage %d: capped and uncapped engines trained bitwise equal\n", (int)stage);
  }
  return check_summary();
}
