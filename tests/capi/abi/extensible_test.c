/* The rules of the ABI-extensible structs (hpshard.h, "ABI-extensible structs"), from the
 * side of callers compiled against other headers than the library's:
 *  - an older caller: a struct_size down to the first release's is accepted, _init writes
 *    no byte past it, and the fields past it take their defaults whatever the bytes there;
 *  - a newer caller: its struct has a field appended past what this library knows; zero,
 *    it is accepted; set, the call is refused naming the byte, and nothing is created;
 *  - struct sizes below the first release, or wild ones, are refused. */
#include <stddef.h>
#include <stdio.h>
#include <string.h>

#include "../check.h"
#include "hpshard/hpshard.h"

/* The 0.1.0 sizes (LP64), the smallest structs the library takes. */
enum {
  kEngineOptions010 = offsetof(hps_engine_options_t, growth_interval) + sizeof(int32_t),
  kClipOptions010 = offsetof(hps_clip_options_t, deterministic) + sizeof(int32_t),
};

/* A caller of a newer header: one field appended after everything this library knows. */
typedef struct {
  hps_engine_options_t known;
  uint64_t appended;
} newer_engine_options_t;

/* A newer clip options struct whose new int32 field sits where this library's struct has
 * tail padding: the same sizeof, a field the library does not know. */
typedef struct {
  size_t struct_size;
  double max_norm;
  int32_t deterministic;
  int32_t newer_field;
} newer_clip_options_t;

static void older_caller(hps_comm_t* comm) {
  union {
    unsigned char bytes[sizeof(hps_engine_options_t) + 32];
    void* align;
  } b;
  hps_engine_options_t* o = (hps_engine_options_t*)b.bytes;
  hps_engine_t* engine = NULL;
  size_t i;
  int intact = 1;

  /* _init writes the first release's size and nothing more. */
  memset(b.bytes, 0xA5, sizeof b.bytes);
  CHECK_OK(hps_engine_options_init(o, kEngineOptions010));
  CHECK(o->struct_size == kEngineOptions010 && o->stage == 2 && o->growth_interval == 2000);
  for (i = kEngineOptions010; i < sizeof b.bytes; ++i) intact &= b.bytes[i] == 0xA5;
  CHECK(intact);
  /* The bytes where compute_stream would be are 0xA5...: as the caller's struct ends
   * before it, the engine takes the default (NULL) and never reads them. */
  CHECK_OK(hps_engine_create(comm, NULL, o, &engine));
  CHECK(engine != NULL);
  CHECK_OK(hps_engine_destroy(engine));
  engine = NULL;

  /* Below the first release: refused, the struct untouched. */
  memset(b.bytes, 0xA5, sizeof b.bytes);
  CHECK(hps_engine_options_init(o, kEngineOptions010 - 1) == HPS_STATUS_INVALID_ARGUMENT);
  CHECK(HAS("smaller than the first released hps_engine_options_t"));
  CHECK(b.bytes[0] == 0xA5);
  CHECK_OK(hps_engine_options_init(o, sizeof *o));
  o->struct_size = kEngineOptions010 - 4;
  CHECK(hps_engine_create(comm, NULL, o, &engine) == HPS_STATUS_INVALID_ARGUMENT);
  CHECK(HAS("options->struct_size is") && HAS("call hps_engine_options_init first") &&
        engine == NULL);
  /* A wild size is not a struct. */
  CHECK(hps_engine_options_init(o, (size_t)1 << 40) == HPS_STATUS_INVALID_ARGUMENT);
  o->struct_size = (size_t)1 << 40;
  CHECK(hps_engine_create(comm, NULL, o, &engine) == HPS_STATUS_INVALID_ARGUMENT);
  CHECK(HAS("no hps_engine_options_t size") && engine == NULL);
}

static void newer_caller(hps_comm_t* comm) {
  newer_engine_options_t n;
  newer_clip_options_t c;
  hps_engine_t* engine = NULL;
  hps_clip_t* clip = NULL;

  /* Zeroed first, as the header asks: the library's _init sets what it knows. */
  memset(&n, 0, sizeof n);
  CHECK_OK(hps_engine_options_init(&n.known, sizeof n));
  CHECK(n.known.struct_size == sizeof n && n.known.stage == 2 && n.appended == 0);
  CHECK(n.known.compute_stream == NULL);
  n.known.learning_rate = 0.25f;
  CHECK_OK(hps_engine_create(comm, NULL, &n.known, &engine));
  CHECK(engine != NULL);
  CHECK_OK(hps_engine_destroy(engine));
  engine = NULL;

  /* The appended field set: this library cannot honour it. */
  n.appended = 7;
  CHECK(hps_engine_create(comm, NULL, &n.known, &engine) == HPS_STATUS_INVALID_ARGUMENT);
  CHECK(HAS("options (hps_engine_options_t of struct_size") && HAS("has byte") &&
        HAS("a field of a newer hpshard.h") && engine == NULL);

  /* A newer field in what is padding to this library: the same struct_size, refused all
   * the same; zero, accepted. */
  CHECK(sizeof c == sizeof(hps_clip_options_t));
  memset(&c, 0, sizeof c);
  CHECK_OK(hps_clip_options_init((hps_clip_options_t*)&c, sizeof c));
  CHECK(c.max_norm == 1.0 && c.newer_field == 0);
  CHECK_OK(hps_clip_create(comm, NULL, NULL, (const hps_clip_options_t*)&c, &clip));
  CHECK_OK(hps_clip_destroy(clip));
  clip = NULL;
  c.newer_field = 1;
  CHECK(hps_clip_create(comm, NULL, NULL, (const hps_clip_options_t*)&c, &clip) ==
        HPS_STATUS_INVALID_ARGUMENT);
  CHECK(HAS("has byte 20 set") && clip == NULL);
  /* An older clip caller: first release size. */
  c.newer_field = 0;
  CHECK_OK(hps_clip_options_init((hps_clip_options_t*)&c, kClipOptions010));
  CHECK_OK(hps_clip_create(comm, NULL, NULL, (const hps_clip_options_t*)&c, &clip));
  CHECK_OK(hps_clip_destroy(clip));
}

/* The field added in 0.2.0: the framework's compute stream, kept alive by the engine. */
static void compute_stream(hps_comm_t* comm) {
  hps_engine_options_t o;
  hps_engine_t* engine = NULL;
  hps_stream_t* stream = NULL;
  const int64_t shape[1] = {2};
  size_t index = 0;
  float* p = NULL;
  float out[2] = {0, 0};

  CHECK_OK(hps_stream_create(HPS_DEVICE_CPU, 0, &stream));
  CHECK_OK(hps_engine_options_init(&o, sizeof o));
  o.compute_stream = stream;
  CHECK_OK(hps_engine_create(comm, NULL, &o, &engine));
  /* The handle goes; the engine keeps the stream. */
  CHECK_OK(hps_stream_destroy(stream));
  if (engine == NULL) return;
  CHECK_OK(hps_engine_add_param(engine, "w", shape, 1, HPS_DTYPE_FLOAT32, 0, 0, &index));
  CHECK_OK(hps_engine_seal(engine));
  CHECK_OK(hps_engine_param(engine, 0, (void**)&p));
  p[0] = 1.0f;
  p[1] = 2.0f;
  CHECK_OK(hps_engine_broadcast_parameters(engine));
  CHECK_OK(hps_engine_gather_parameter(engine, 0, out, 2));
  CHECK(out[0] == 1.0f && out[1] == 2.0f);
  CHECK_OK(hps_engine_destroy(engine));
}

/* The field added in 0.3.0: a cap on a bucket's bytes. A 0.2.0 caller's struct ends before
 * it, so whatever lies there, the engine keeps one bucket per unit; a current caller's cap
 * cuts the unit into several. */
static void bucket_cap(hps_comm_t* comm) {
  union {
    unsigned char bytes[sizeof(hps_engine_options_t) + 16];
    void* align;
  } b;
  hps_engine_options_t* o = (hps_engine_options_t*)b.bytes;
  const size_t size_020 = offsetof(hps_engine_options_t, bucket_bytes);
  const int64_t shape[1] = {512};
  size_t index[2] = {0, 0}, bucket[2] = {9, 9};
  int capped;
  for (capped = 0; capped < 2; ++capped) {
    hps_engine_t* engine = NULL;
    memset(b.bytes, 0xA5, sizeof b.bytes);
    CHECK_OK(hps_engine_options_init(o, capped ? sizeof *o : size_020));
    CHECK(capped ? o->bucket_bytes == 0 : b.bytes[size_020] == 0xA5);
    if (capped) o->bucket_bytes = 2048; /* one 512-float parameter per bucket */
    CHECK_OK(hps_engine_create(comm, NULL, o, &engine));
    if (engine == NULL) return;
    CHECK_OK(hps_engine_add_param(engine, "a", shape, 1, HPS_DTYPE_FLOAT32, 0, 0, &index[0]));
    CHECK_OK(hps_engine_add_param(engine, "b", shape, 1, HPS_DTYPE_FLOAT32, 0, 0, &index[1]));
    CHECK_OK(hps_engine_seal(engine));
    CHECK_OK(hps_engine_param_bucket(engine, index[0], &bucket[0]));
    CHECK_OK(hps_engine_param_bucket(engine, index[1], &bucket[1]));
    CHECK(capped ? bucket[0] != bucket[1] : bucket[0] == bucket[1]);
    CHECK_OK(hps_engine_destroy(engine));
  }
}

int main(void) {
  hps_store_t* store = NULL;
  hps_comm_t* comm = NULL;
  CHECK(kEngineOptions010 == 96 || sizeof(void*) != 8);
  CHECK(sizeof(hps_engine_options_t) == 112 || sizeof(void*) != 8);
  CHECK_OK(hps_store_open("memory://abi-extensible", 0, 10000, &store));
  CHECK_OK(hps_comm_create(store, 0, 1, HPS_DEVICE_CPU, 0, NULL, &comm));
  if (comm == NULL) return 1;
  older_caller(comm);
  newer_caller(comm);
  compute_stream(comm);
  bucket_cap(comm);
  CHECK_OK(hps_comm_destroy(comm));
  CHECK_OK(hps_store_destroy(store));
  if (check_summary() != 0) return 1;
  printf("extensible structs: older, newer and current callers handled as documented\n");
  return 0;
}
