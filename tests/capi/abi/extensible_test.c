/* The rules of the ABI-extensible structs (hpshard.h, "ABI-extensible structs"), from the
 * side of callers compiled against other headers than the library's:
 *  - an older caller: a struct_size down to the first release's is accepted, _init writes
 *    no byte past it, and the fields past it take their defaults whatever the bytes there;
 *  - a newer caller: its struct has a field appended past what this library knows; zero,
 *    it is accepted; set, the call is refused naming the byte, and nothing is created;
 *  - struct sizes below the first release, or wild ones, are refused;
 *  - a struct_size ending inside a field is no header's sizeof: refused by every function of
 *    every extensible struct, nothing written; any other size is taken. */
#include <stddef.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

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

/* Every extensible struct at every size from its first release to sizeof: a size ending
 * strictly inside a field appended since the first release (fields within it are always
 * whole) is refused by its _init and by a function reading or filling it, with nothing
 * written; a size at a field's end or in padding is taken. */
typedef struct {
  const char* name;
  size_t offset, size;
} field_t;
#define FIELD(T, F) \
  { #F, offsetof(T, F), sizeof(((T*)0)->F) }

typedef struct {
  const char* name;   /* the struct */
  const char* use;    /* the function `use` calls */
  size_t first, size; /* the first released size (LP64) and sizeof */
  field_t added[4];   /* the fields appended since the first release */
  hps_status_t (*init)(void* s, size_t struct_size);
  hps_status_t (*call)(void* s);
  hps_status_t taken; /* what `call` returns for a size it takes */
} extensible_t;

static hps_comm_t* g_comm;
static hps_engine_t* g_engine;
static hps_checkpoint_t* g_checkpoint;
static char g_root[64];

static hps_status_t init_device(void* s, size_t n) { return hps_device_properties_init(s, n); }
static hps_status_t init_rendezvous(void* s, size_t n) { return hps_rendezvous_info_init(s, n); }
static hps_status_t init_comm(void* s, size_t n) { return hps_comm_options_init(s, n); }
static hps_status_t init_clip(void* s, size_t n) { return hps_clip_options_init(s, n); }
static hps_status_t init_engine(void* s, size_t n) { return hps_engine_options_init(s, n); }
static hps_status_t init_ckpt(void* s, size_t n) { return hps_checkpoint_options_init(s, n); }
static hps_status_t init_load(void* s, size_t n) { return hps_checkpoint_load_options_init(s, n); }
static hps_status_t init_info(void* s, size_t n) { return hps_checkpoint_info_init(s, n); }

static hps_status_t call_device(void* s) { return hps_device_get_properties(HPS_DEVICE_CPU, 0, s); }
static hps_status_t call_rendezvous(void* s) { return hps_rendezvous_from_env(s); }
static hps_status_t call_comm(void* s) {
  static int n = 0;
  char url[64];
  hps_store_t* store = NULL;
  hps_comm_t* comm = NULL;
  hps_status_t st;
  snprintf(url, sizeof url, "memory://abi-torn-%d", n++);
  if (hps_store_open(url, 0, 10000, &store) != HPS_STATUS_OK) return HPS_STATUS_INTERNAL;
  st = hps_comm_create(store, 0, 1, HPS_DEVICE_CPU, 0, s, &comm);
  CHECK(st == HPS_STATUS_OK || comm == NULL);
  hps_comm_destroy(comm);
  hps_store_destroy(store);
  return st;
}
static hps_status_t call_clip(void* s) {
  hps_clip_t* clip = NULL;
  hps_status_t st = hps_clip_create(g_comm, NULL, NULL, s, &clip);
  CHECK(st == HPS_STATUS_OK || clip == NULL);
  hps_clip_destroy(clip);
  return st;
}
static hps_status_t call_engine(void* s) {
  hps_engine_t* engine = NULL;
  hps_status_t st = hps_engine_create(g_comm, NULL, s, &engine);
  CHECK(st == HPS_STATUS_OK || engine == NULL);
  hps_engine_destroy(engine);
  return st;
}
static hps_status_t call_read_engine_options(void* s) {
  return hps_checkpoint_read_engine_options("/nonexistent/abi-torn", s);
}
static hps_status_t call_ckpt(void* s) {
  hps_checkpoint_t* checkpoint = NULL;
  hps_status_t st = hps_checkpoint_create(g_engine, g_comm, g_root, s, &checkpoint);
  CHECK(st == HPS_STATUS_OK || checkpoint == NULL);
  hps_checkpoint_destroy(checkpoint);
  return st;
}
static hps_status_t call_load(void* s) { return hps_checkpoint_load(g_checkpoint, "none", s); }
static hps_status_t call_info(void* s) {
  return hps_checkpoint_inspect("/nonexistent/abi-torn", s);
}

/* The end of field F of struct T: the first release's size is the end of its last field. */
#define END(T, F) (offsetof(T, F) + sizeof(((T*)0)->F))
static const extensible_t kStructs[] = {
    {"hps_device_properties_t",
     "hps_device_get_properties",
     END(hps_device_properties_t, multiprocessor_count),
     sizeof(hps_device_properties_t),
     {{0}},
     init_device,
     call_device,
     HPS_STATUS_OK},
    {"hps_rendezvous_info_t",
     "hps_rendezvous_from_env",
     END(hps_rendezvous_info_t, source),
     sizeof(hps_rendezvous_info_t),
     {{0}},
     init_rendezvous,
     call_rendezvous,
     HPS_STATUS_OK},
    {"hps_comm_options_t",
     "hps_comm_create",
     END(hps_comm_options_t, name),
     sizeof(hps_comm_options_t),
     {{0}},
     init_comm,
     call_comm,
     HPS_STATUS_OK},
    {"hps_clip_options_t",
     "hps_clip_create",
     END(hps_clip_options_t, deterministic),
     sizeof(hps_clip_options_t),
     {{0}},
     init_clip,
     call_clip,
     HPS_STATUS_OK},
    {"hps_engine_options_t",
     "hps_engine_create",
     END(hps_engine_options_t, growth_interval),
     sizeof(hps_engine_options_t),
     {FIELD(hps_engine_options_t, compute_stream), FIELD(hps_engine_options_t, bucket_bytes)},
     init_engine,
     call_engine,
     HPS_STATUS_OK},
    {"hps_engine_options_t",
     "hps_checkpoint_read_engine_options",
     END(hps_engine_options_t, growth_interval),
     sizeof(hps_engine_options_t),
     {FIELD(hps_engine_options_t, compute_stream), FIELD(hps_engine_options_t, bucket_bytes)},
     init_engine,
     call_read_engine_options,
     HPS_STATUS_NOT_FOUND},
    {"hps_checkpoint_options_t",
     "hps_checkpoint_create",
     END(hps_checkpoint_options_t, timeout_ms),
     sizeof(hps_checkpoint_options_t),
     {{0}},
     init_ckpt,
     call_ckpt,
     HPS_STATUS_OK},
    {"hps_checkpoint_load_options_t",
     "hps_checkpoint_load",
     END(hps_checkpoint_load_options_t, allow_partial),
     sizeof(hps_checkpoint_load_options_t),
     {{0}},
     init_load,
     call_load,
     HPS_STATUS_NOT_FOUND},
    {"hps_checkpoint_info_t",
     "hps_checkpoint_inspect",
     END(hps_checkpoint_info_t, name),
     sizeof(hps_checkpoint_info_t),
     {FIELD(hps_checkpoint_info_t, mp), FIELD(hps_checkpoint_info_t, mp_rank),
      FIELD(hps_checkpoint_info_t, pp), FIELD(hps_checkpoint_info_t, pp_rank)},
     init_info,
     call_info,
     HPS_STATUS_NOT_FOUND},
};

/* The field `size` ends strictly inside, or NULL. */
static const field_t* torn_field(const extensible_t* e, size_t size) {
  size_t i;
  for (i = 0; i < 4 && e->added[i].name != NULL; ++i) {
    const field_t* f = &e->added[i];
    if (f->offset < size && size < f->offset + f->size) return f;
  }
  return NULL;
}

static void torn_sizes(hps_comm_t* comm) {
  union {
    unsigned char bytes[1024];
    void* align;
  } b, before;
  const int64_t shape[1] = {4};
  size_t index = 0, k, size, i;
  int refused = 0, taken = 0;

  g_comm = comm;
  setenv("HPS_RANK", "0", 1);
  setenv("HPS_WORLD_SIZE", "1", 1);
  setenv("HPS_STORE", "memory://abi-torn-rendezvous", 1);
  strcpy(g_root, "/tmp/abi-torn-XXXXXX");
  CHECK(mkdtemp(g_root) != NULL);
  CHECK_OK(hps_engine_create(comm, NULL, NULL, &g_engine));
  if (g_engine == NULL) return;
  CHECK_OK(hps_engine_add_param(g_engine, "w", shape, 1, HPS_DTYPE_FLOAT32, 0, 0, &index));
  CHECK_OK(hps_engine_seal(g_engine));
  CHECK_OK(hps_checkpoint_create(g_engine, comm, g_root, NULL, &g_checkpoint));
  if (g_checkpoint == NULL) return;

  for (k = 0; k < sizeof kStructs / sizeof kStructs[0]; ++k) {
    const extensible_t* e = &kStructs[k];
    CHECK(e->size <= sizeof b.bytes);
    /* The table's first release is the library's. */
    CHECK(e->init(b.bytes, e->first - 1) == HPS_STATUS_INVALID_ARGUMENT);
    for (size = e->first; size <= e->size; ++size) {
      const field_t* torn = torn_field(e, size);
      char named[96], field[96];
      int ok = 1;
      if (torn != NULL) {
        snprintf(named, sizeof named, "%s of struct_size %zu", e->name, size);
        snprintf(field, sizeof field, "ends inside its field %s (bytes %zu-%zu)", torn->name,
                 torn->offset, torn->offset + torn->size - 1);
      }
      /* _init: refused with nothing written, or the defaults up to struct_size only. */
      memset(b.bytes, 0xA5, sizeof b.bytes);
      if (torn != NULL) {
        ok &= e->init(b.bytes, size) == HPS_STATUS_INVALID_ARGUMENT && HAS(named) && HAS(field);
        for (i = 0; i < sizeof b.bytes; ++i) ok &= b.bytes[i] == 0xA5;
      } else {
        ok &= e->init(b.bytes, size) == HPS_STATUS_OK && *(size_t*)b.bytes == size;
        for (i = size; i < sizeof b.bytes; ++i) ok &= b.bytes[i] == 0xA5;
      }
      /* The function reading or filling it: the struct as a caller of that size has it. */
      memset(b.bytes, 0, sizeof b.bytes);
      CHECK_OK(e->init(b.bytes, e->size));
      *(size_t*)b.bytes = size;
      memcpy(before.bytes, b.bytes, sizeof b.bytes);
      if (torn != NULL) {
        ok &= e->call(b.bytes) == HPS_STATUS_INVALID_ARGUMENT && HAS(named) && HAS(field) &&
              memcmp(before.bytes, b.bytes, sizeof b.bytes) == 0;
        ++refused;
      } else {
        ok &= e->call(b.bytes) == e->taken;
        for (i = size; i < sizeof b.bytes; ++i) ok &= b.bytes[i] == before.bytes[i];
        ++taken;
      }
      if (!ok) {
        fprintf(stderr, "%s of struct_size %zu (%s): %s, not as expected\n", e->name, size, e->use,
                torn != NULL ? "should be refused" : "should be taken");
      }
      CHECK(ok);
    }
  }
  /* hps_engine_options_t: 96 (0.1.0), 104 (0.2.0), 112 (0.3.0) taken, 97-103 and 105-111
   * refused; hps_checkpoint_info_t: 297-300, 304, 308, 312, 316 (+ tail padding) taken. */
  CHECK(refused > 0 && taken > 0);
  CHECK_OK(hps_checkpoint_destroy(g_checkpoint));
  CHECK_OK(hps_engine_destroy(g_engine));
  unsetenv("HPS_RANK");
  unsetenv("HPS_WORLD_SIZE");
  unsetenv("HPS_STORE");
  {
    char cmd[128];
    snprintf(cmd, sizeof cmd, "rm -rf '%s'", g_root);
    if (system(cmd) != 0) fprintf(stderr, "could not remove %s\n", g_root);
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
  torn_sizes(comm);
  CHECK_OK(hps_comm_destroy(comm));
  CHECK_OK(hps_store_destroy(store));
  if (check_summary() != 0) return 1;
  printf("extensible structs: older, newer and current callers handled as documented\n");
  return 0;
}
