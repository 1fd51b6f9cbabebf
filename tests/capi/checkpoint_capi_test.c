/* Checkpoints through the C API, as C99: two thread-ranks train a stage 2 engine, save
 * asynchronously (no host sync in the steps that overlap the save), and stage 3 engines
 * load it; inspect, verify, the saved engine options, safetensors export and import, the
 * metadata of a load, and bad input refused with nothing changed. */
#include <math.h>
#include <pthread.h>
#include <stddef.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "check.h"
#include "hpshard/hpshard.h"

static char g_root[256];

enum { kWeights = 300, kBias = 7 };

typedef struct {
  int rank;
  float saved_w[kWeights];
  float loaded_w[kWeights];
} rank_args_t;

static hps_engine_t* make_engine(hps_comm_t* comm, int32_t stage, size_t index[2]) {
  hps_engine_options_t options;
  hps_engine_t* engine = NULL;
  const int64_t wshape[1] = {kWeights}, bshape[1] = {kBias};
  CHECK_OK(hps_engine_options_init(&options, sizeof options));
  options.stage = stage;
  options.optimizer = HPS_OPTIMIZER_ADAMW;
  options.learning_rate = 0.01f;
  CHECK_OK(hps_engine_create(comm, NULL, &options, &engine));
  CHECK_OK(hps_engine_add_param(engine, "w", wshape, 1, HPS_DTYPE_FLOAT32, 0, 0, &index[0]));
  CHECK_OK(hps_engine_add_param(engine, "b", bshape, 1, HPS_DTYPE_FLOAT32, 0, 0, &index[1]));
  CHECK_OK(hps_engine_seal(engine));
  return engine;
}

static void train_step(hps_engine_t* engine, const size_t index[2], int rank, int step) {
  float* g = NULL;
  int i;
  CHECK_OK(hps_engine_wait_parameters(engine, 0));
  CHECK_OK(hps_engine_grad(engine, index[0], (void**)&g));
  for (i = 0; i < kWeights; ++i) g[i] += sinf(0.1f * (float)i + (float)rank + 0.3f * (float)step);
  CHECK_OK(hps_engine_grad_ready(engine, index[0], NULL));
  CHECK_OK(hps_engine_grad(engine, index[1], (void**)&g));
  for (i = 0; i < kBias; ++i) g[i] += 0.5f;
  CHECK_OK(hps_engine_grad_ready(engine, index[1], NULL));
  CHECK_OK(hps_engine_release_parameters(engine, 0));
  CHECK_OK(hps_engine_step(engine));
}

static void* rank_main(void* arg) {
  rank_args_t* a = (rank_args_t*)arg;
  hps_store_t* store = NULL;
  hps_comm_t* comm = NULL;
  hps_engine_t* engine = NULL;
  hps_checkpoint_t* ckpt = NULL;
  hps_checkpoint_options_t options;
  hps_checkpoint_load_options_t load;
  hps_work_t* work = NULL;
  size_t index[2];
  float* w = NULL;
  const char* keys[2] = {"step", "loader"};
  const char* values[2] = {"2", "batch 17"};
  char value[16];
  size_t length = 0;
  uint64_t syncs = 99;
  int32_t completed = -1;
  int i;

  CHECK_OK(hps_store_open("memory://checkpoint_capi_test", a->rank, 20000, &store));
  CHECK_OK(hps_comm_create(store, a->rank, 2, HPS_DEVICE_CPU, 0, NULL, &comm));
  engine = make_engine(comm, 2, index);
  CHECK_OK(hps_engine_param(engine, index[0], (void**)&w));
  for (i = 0; i < kWeights; ++i) w[i] = cosf((float)i);
  CHECK_OK(hps_engine_broadcast_parameters(engine));

  CHECK_OK(hps_checkpoint_options_init(&options, sizeof options));
  CHECK(options.keep_last == 0 && options.chunk_bytes == 1u << 20 && options.timeout_ms > 0);
  options.chunk_bytes = 256;
  CHECK(hps_checkpoint_create(engine, comm, NULL, &options, &ckpt) == HPS_STATUS_INVALID_ARGUMENT);
  CHECK(ckpt == NULL);
  options.struct_size = 4;
  CHECK(hps_checkpoint_create(engine, comm, g_root, &options, &ckpt) ==
        HPS_STATUS_INVALID_ARGUMENT);
  CHECK(strstr(hps_last_error_message(), "hps_checkpoint_options_init") != NULL);
  options.struct_size = sizeof options;
  CHECK_OK(hps_checkpoint_create(engine, comm, g_root, &options, &ckpt));

  train_step(engine, index, a->rank, 0);
  train_step(engine, index, a->rank, 1);
  CHECK(hps_checkpoint_save(ckpt, "../escape", NULL, NULL, 0, &work) ==
        HPS_STATUS_INVALID_ARGUMENT);
  CHECK(hps_checkpoint_save(ckpt, "step-2", NULL, values, 2, &work) == HPS_STATUS_INVALID_ARGUMENT);
  CHECK(work == NULL);
  CHECK_OK(hps_host_sync_reset());
  CHECK_OK(hps_checkpoint_save(ckpt, "step-2", keys, values, 2, &work));
  train_step(engine, index, a->rank, 2); /* overlaps the save */
  CHECK_OK(hps_host_sync_count_thread(&syncs));
  CHECK(syncs == 0);
  CHECK_OK(hps_work_wait(work));
  CHECK_OK(hps_work_test(work, &completed));
  CHECK(completed == 1);
  CHECK_OK(hps_work_destroy(work));
  work = NULL;
  CHECK(hps_checkpoint_save(ckpt, "step-2", NULL, NULL, 0, &work) == HPS_STATUS_ALREADY_EXISTS);
  CHECK_OK(hps_engine_synchronize(engine));
  CHECK_OK(hps_checkpoint_destroy(ckpt));
  CHECK_OK(hps_checkpoint_destroy(NULL));
  CHECK_OK(hps_engine_destroy(engine));

  /* Stage 3 engines load it (latest); the parameters are those after two steps. */
  engine = make_engine(comm, 3, index);
  CHECK_OK(hps_engine_broadcast_parameters(engine));
  CHECK_OK(hps_checkpoint_create(engine, comm, g_root, NULL, &ckpt));
  CHECK(hps_checkpoint_metadata(ckpt, "step", value, sizeof value, &length) ==
        HPS_STATUS_NOT_FOUND);
  CHECK_OK(hps_checkpoint_load_options_init(&load, sizeof load));
  CHECK(load.allow_partial == 0);
  CHECK(hps_checkpoint_load(ckpt, "absent", &load) == HPS_STATUS_NOT_FOUND);
  /* Only NULL means the latest: an empty name is a mistake. */
  CHECK(hps_checkpoint_load(ckpt, "", &load) == HPS_STATUS_INVALID_ARGUMENT);
  CHECK_OK(hps_checkpoint_load(ckpt, NULL, &load));
  CHECK_OK(hps_checkpoint_metadata(ckpt, "loader", NULL, 0, &length));
  CHECK(length == 8);
  /* A NULL buffer said to hold 5 bytes is refused (it was taken as a length query). */
  length = 99;
  CHECK(hps_checkpoint_metadata(ckpt, "loader", NULL, 5, &length) == HPS_STATUS_INVALID_ARGUMENT);
  CHECK(length == 99);
  CHECK(hps_checkpoint_metadata(ckpt, "loader", value, 8, &length) == HPS_STATUS_OUT_OF_RANGE);
  CHECK_OK(hps_checkpoint_metadata(ckpt, "loader", value, sizeof value, &length));
  CHECK(strcmp(value, "batch 17") == 0);
  CHECK_OK(hps_engine_gather_parameter(engine, index[0], a->loaded_w, kWeights));
  /* The safetensors export, imported back into this engine. */
  if (a->rank == 0) {
    char model[300];
    snprintf(model, sizeof model, "%s/model.safetensors", g_root);
    CHECK_OK(hps_checkpoint_export_safetensors(g_root, model, 1));
  }
  {
    hps_work_t* barrier = NULL;
    char model[300];
    float imported[kWeights];
    CHECK_OK(hps_comm_barrier(comm, NULL, &barrier));
    CHECK_OK(hps_work_wait(barrier));
    CHECK_OK(hps_work_destroy(barrier));
    snprintf(model, sizeof model, "%s/model.safetensors", g_root);
    train_step(engine, index, a->rank, 3);
    CHECK_OK(hps_checkpoint_import_safetensors(ckpt, model, NULL));
    CHECK_OK(hps_engine_gather_parameter(engine, index[0], imported, kWeights));
    CHECK(memcmp(imported, a->loaded_w, sizeof imported) == 0);
    CHECK(hps_checkpoint_import_safetensors(ckpt, "/nonexistent.safetensors", NULL) ==
          HPS_STATUS_NOT_FOUND);
  }
  CHECK_OK(hps_checkpoint_destroy(ckpt));
  CHECK_OK(hps_engine_destroy(engine));
  CHECK_OK(hps_comm_destroy(comm));
  CHECK_OK(hps_store_destroy(store));
  return NULL;
}

/* The longest parameter name (4096 bytes) saves, loads, verifies and exports with AdamW state
 * (the manifest names "exp_avg_sq/" and it); a longer one is refused at registration (it used
 * to publish a checkpoint that no reader took). */
static void longest_name(void) {
  char root[512], model[600], name[4098];
  hps_store_t* store = NULL;
  hps_comm_t* comm = NULL;
  hps_engine_t* engine = NULL;
  hps_checkpoint_t* ckpt = NULL;
  hps_work_t* work = NULL;
  hps_engine_options_t options;
  hps_checkpoint_info_t info;
  const int64_t shape[1] = {5};
  size_t index = 0;
  float* p = NULL;
  int i;
  snprintf(root, sizeof root, "%s/longest-name", g_root);
  snprintf(model, sizeof model, "%s/longest.safetensors", g_root);
  memset(name, 'n', sizeof name - 1);
  name[sizeof name - 1] = '\0';
  CHECK_OK(hps_store_open("memory://checkpoint_capi_longest", 0, 20000, &store));
  CHECK_OK(hps_comm_create(store, 0, 1, HPS_DEVICE_CPU, 0, NULL, &comm));
  CHECK_OK(hps_engine_options_init(&options, sizeof options));
  options.optimizer = HPS_OPTIMIZER_ADAMW;
  CHECK_OK(hps_engine_create(comm, NULL, &options, &engine));
  CHECK(hps_engine_add_param(engine, name, shape, 1, HPS_DTYPE_FLOAT32, 0, 0, &index) ==
        HPS_STATUS_INVALID_ARGUMENT); /* 4097 bytes */
  CHECK(strstr(hps_last_error_message(), "has 4097 bytes, more than 4096") != NULL);
  name[4096] = '\0';
  CHECK_OK(hps_engine_add_param(engine, name, shape, 1, HPS_DTYPE_FLOAT32, 0, 0, &index));
  CHECK_OK(hps_engine_seal(engine));
  CHECK_OK(hps_engine_param(engine, index, (void**)&p));
  for (i = 0; i < 5; ++i) p[i] = (float)i;
  CHECK_OK(hps_engine_broadcast_parameters(engine));
  CHECK_OK(hps_checkpoint_create(engine, comm, root, NULL, &ckpt));
  CHECK_OK(hps_checkpoint_save(ckpt, "c", NULL, NULL, 0, &work));
  CHECK_OK(hps_work_wait(work));
  CHECK_OK(hps_work_destroy(work));
  CHECK_OK(hps_engine_param(engine, index, (void**)&p));
  p[2] = -1.0f;
  CHECK_OK(hps_checkpoint_load(ckpt, "c", NULL));
  CHECK_OK(hps_engine_param(engine, index, (void**)&p));
  CHECK(p[2] == 2.0f);
  CHECK_OK(hps_checkpoint_verify(root));
  CHECK_OK(hps_checkpoint_info_init(&info, sizeof info));
  CHECK_OK(hps_checkpoint_inspect(root, &info));
  CHECK(info.tensors == 7); /* the parameter, exp_avg, exp_avg_sq and four step scalars */
  CHECK_OK(hps_checkpoint_export_safetensors(root, model, 0));
  CHECK_OK(hps_checkpoint_import_safetensors(ckpt, model, NULL));
  CHECK_OK(hps_checkpoint_destroy(ckpt));
  CHECK_OK(hps_engine_destroy(engine));
  CHECK_OK(hps_comm_destroy(comm));
  CHECK_OK(hps_store_destroy(store));
}

/* Stage 3 with a unit gathered (a forward's state) when the engine's handle goes: its
 * checkpoint handle still saves and loads (the load was refused, "unit 0 is gathered",
 * with nobody left to release it). */
static void load_after_the_engine_handle(void) {
  char root[512];
  hps_store_t* store = NULL;
  hps_comm_t* comm = NULL;
  hps_engine_t* engine = NULL;
  hps_checkpoint_t* ckpt = NULL;
  hps_work_t* work = NULL;
  hps_engine_options_t options;
  const int64_t shape[1] = {4};
  size_t index = 0;
  snprintf(root, sizeof root, "%s/after-handle", g_root);
  CHECK_OK(hps_store_open("memory://checkpoint_capi_after_handle", 0, 20000, &store));
  CHECK_OK(hps_comm_create(store, 0, 1, HPS_DEVICE_CPU, 0, NULL, &comm));
  CHECK_OK(hps_engine_options_init(&options, sizeof options));
  options.stage = 3;
  CHECK_OK(hps_engine_create(comm, NULL, &options, &engine));
  CHECK_OK(hps_engine_add_param(engine, "w", shape, 1, HPS_DTYPE_FLOAT32, 0, 0, &index));
  CHECK_OK(hps_engine_seal(engine));
  CHECK_OK(hps_engine_broadcast_parameters(engine));
  CHECK_OK(hps_checkpoint_create(engine, comm, root, NULL, &ckpt));
  CHECK_OK(hps_engine_wait_parameters(engine, 0));
  CHECK_OK(hps_engine_destroy(engine));
  CHECK_OK(hps_checkpoint_save(ckpt, "c", NULL, NULL, 0, &work));
  CHECK_OK(hps_work_wait(work));
  CHECK_OK(hps_work_destroy(work));
  CHECK_OK(hps_checkpoint_load(ckpt, "c", NULL));
  CHECK_OK(hps_checkpoint_destroy(ckpt));
  CHECK_OK(hps_comm_destroy(comm));
  CHECK_OK(hps_store_destroy(store));
}

int main(void) {
  pthread_t threads[2];
  rank_args_t args[2];
  hps_checkpoint_info_t info;
  hps_engine_options_t engine_options;
  int r;
  { /* CPU communicators need Gloo: without it this test has nothing to run on. */
    hps_store_t* store = NULL;
    hps_comm_t* comm = NULL;
    hps_status_t s;
    CHECK_OK(hps_store_open("memory://checkpoint_capi_probe", 0, 20000, &store));
    s = hps_comm_create(store, 0, 1, HPS_DEVICE_CPU, 0, NULL, &comm);
    hps_comm_destroy(comm);
    hps_store_destroy(store);
    if (s == HPS_STATUS_UNAVAILABLE) {
      printf("skipped: %s\n", hps_last_error_message());
      return 77;
    }
  }
  snprintf(g_root, sizeof g_root, "/tmp/hps-ckpt-capi-XXXXXX");
  if (mkdtemp(g_root) == NULL) return 1;
  for (r = 0; r < 2; ++r) {
    memset(&args[r], 0, sizeof args[r]);
    args[r].rank = r;
    pthread_create(&threads[r], NULL, rank_main, &args[r]);
  }
  for (r = 0; r < 2; ++r) pthread_join(threads[r], NULL);
  longest_name();
  load_after_the_engine_handle();

  CHECK(hps_checkpoint_inspect(g_root, NULL) == HPS_STATUS_INVALID_ARGUMENT);
  CHECK_OK(hps_checkpoint_info_init(&info, sizeof info));
  CHECK_OK(hps_checkpoint_inspect(g_root, &info));
  CHECK(info.format_version == 1 && info.stage == 2 && info.sharding == 2 && info.dp == 1);
  CHECK(info.world == 2 && info.files == 2 && strcmp(info.name, "step-2") == 0);
  CHECK(strlen(info.id) == 32 && info.created_unix_ns > 0);
  /* A whole model's checkpoint: no mp or pp part. */
  CHECK(info.mp == 1 && info.mp_rank == 0 && info.pp == 1 && info.pp_rank == 0);
  /* w, b, their exp_avg and exp_avg_sq (float32), and four step scalars. */
  CHECK(info.tensors == 10);
  CHECK(info.bytes == 3u * 4u * (kWeights + kBias) + 4 + 4 + 8 + 8);
  CHECK_OK(hps_checkpoint_verify(g_root));
  CHECK(hps_checkpoint_verify("/nonexistent/ckpt") == HPS_STATUS_NOT_FOUND);
  CHECK_OK(hps_engine_options_init(&engine_options, sizeof engine_options));
  engine_options.bucket_bytes = 4096; /* the caller's: not part of the saved state */
  CHECK_OK(hps_checkpoint_read_engine_options(g_root, &engine_options));
  CHECK(engine_options.optimizer == HPS_OPTIMIZER_ADAMW && engine_options.stage == 2);
  CHECK(engine_options.learning_rate == 0.01f && engine_options.bucket_bytes == 4096);
  { /* A 0.1.0 caller's struct: filled, and not a byte past its struct_size written. */
    union {
      unsigned char bytes[sizeof(hps_engine_options_t) + 8];
      void* align;
    } old;
    hps_engine_options_t* o = (hps_engine_options_t*)old.bytes;
    const size_t size_010 = offsetof(hps_engine_options_t, growth_interval) + sizeof(int32_t);
    size_t i;
    int intact = 1;
    memset(old.bytes, 0xA5, sizeof old.bytes);
    CHECK_OK(hps_engine_options_init(o, size_010));
    CHECK_OK(hps_checkpoint_read_engine_options(g_root, o));
    CHECK(o->optimizer == HPS_OPTIMIZER_ADAMW && o->struct_size == size_010);
    for (i = size_010; i < sizeof old.bytes; ++i) intact &= old.bytes[i] == 0xA5;
    CHECK(intact);
    o->struct_size = 8;
    CHECK(hps_checkpoint_read_engine_options(g_root, o) == HPS_STATUS_INVALID_ARGUMENT);
  }
  {
    char cmd[600];
    snprintf(cmd, sizeof cmd, "rm -rf '%s'", g_root);
    if (system(cmd) != 0) fprintf(stderr, "could not remove %s\n", g_root);
  }
  return check_summary();
}
