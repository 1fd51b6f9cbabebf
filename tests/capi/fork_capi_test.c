/* fork(): a handle belongs to the process that made it. In a forked child every call on a
 * handle made before the fork is refused with FAILED_PRECONDITION, its destroy returns OK at
 * once (freeing nothing: the threads it would wait for are the parent's), a DLPack view's
 * deleter returns, and new handles made in the child work. The parent goes on undisturbed.
 *
 * The child forks while a collective waits for a peer that has not joined yet: a wait or a
 * destroy that touched the parent's objects would block for ever, so the child runs under an
 * alarm and the parent fails the test on anything but a clean exit. */
#include <dirent.h>
#include <errno.h>
#include <signal.h>
#include <stdlib.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

#include "check.h"

#define FORKED "was made before this process was forked"

/* LeakSanitizer (the sanitizer build) asks this at exit: the child keeps the parent's
 * handles by design, and what the parent's threads referenced is unreachable there. */
static volatile int g_in_child = 0;
int __lsan_is_turned_off(void);
int __lsan_is_turned_off(void) { return g_in_child; }

/* AddressSanitizer's allocator before LLVM 18 (GCC 12's, clang 14's) has no fork handlers:
 * a parent thread inside it at the fork leaves a lock of it held in the child for good, and
 * the child's next allocation of that size waits for ever (seen: the child's threads in
 * GetFromAllocator). glibc's allocator takes its locks around a fork. Under ASan the parent
 * therefore forks once every other thread of it sleeps (a wait, not running code). */
#if defined(__SANITIZE_ADDRESS__)
#define HPS_ALLOCATOR_WITHOUT_FORK_HANDLERS 1
#elif defined(__has_feature)
#if __has_feature(address_sanitizer)
#define HPS_ALLOCATOR_WITHOUT_FORK_HANDLERS 1
#endif
#endif

#ifdef HPS_ALLOCATOR_WITHOUT_FORK_HANDLERS
/* Whether every thread of this process but the main one (the caller) is asleep: state S in
 * its stat. */
static int others_asleep(void) {
  const pid_t self = getpid(); /* the main thread's id */
  DIR* tasks = opendir("/proc/self/task");
  struct dirent* e;
  int asleep = 1;
  if (tasks == NULL) return 0;
  while (asleep && (e = readdir(tasks)) != NULL) {
    char path[320], text[512];
    const char* state;
    FILE* f;
    size_t n;
    if (e->d_name[0] == '.' || atoi(e->d_name) == self) continue;
    snprintf(path, sizeof path, "/proc/self/task/%s/stat", e->d_name);
    if ((f = fopen(path, "r")) == NULL) continue; /* the thread has ended */
    n = fread(text, 1, sizeof text - 1, f);
    fclose(f);
    text[n] = '\0';
    state = strrchr(text, ')'); /* the name, in parentheses, may hold anything */
    asleep = state != NULL && state[1] == ' ' && state[2] == 'S';
  }
  closedir(tasks);
  return asleep;
}

/* Waits (up to 10 s) until the other threads have slept for 20 checks in a row, 1 ms apart. */
static void quiesce_before_fork(void) {
  int calm = 0, tries;
  for (tries = 0; tries < 10000 && calm < 20; ++tries) {
    struct timespec pause = {0, 1000 * 1000};
    calm = others_asleep() ? calm + 1 : 0;
    nanosleep(&pause, NULL);
  }
  if (calm < 20) fprintf(stderr, "note: the parent's threads did not all sleep; forking anyway\n");
}
#else
static void quiesce_before_fork(void) {}
#endif

typedef struct {
  hps_store_t* store;
  hps_comm_t* comm;
  float value;
  float sum;
  volatile int ready; /* set by the peer once it has its communicator */
  volatile int join;  /* set by the parent once the child has exited */
} peer_t;

static void* peer_main(void* arg) {
  peer_t* p = (peer_t*)arg;
  hps_work_t* work = NULL;
  struct timespec pause = {0, 10 * 1000 * 1000};
  CHECK_OK(hps_store_open("memory://fork_capi_test", 1, 20000, &p->store));
  CHECK_OK(hps_comm_create(p->store, 1, 2, HPS_DEVICE_CPU, 0, NULL, &p->comm));
  p->ready = 1;
  while (!p->join) nanosleep(&pause, NULL);
  CHECK_OK(hps_comm_all_reduce(p->comm, &p->value, &p->sum, 1, HPS_DTYPE_FLOAT32, HPS_REDUCE_SUM,
                               NULL, &work));
  CHECK_OK(hps_work_wait(work));
  CHECK_OK(hps_work_destroy(work));
  return NULL;
}

/* A two-rank world of threads over `url`: each rank all-reduces its rank + 1 (sum 3) and
 * destroys its communicator. */
typedef struct {
  const char* url;
  int32_t rank;
  float sum;
} pair_rank_t;

static void* pair_rank_main(void* arg) {
  pair_rank_t* r = (pair_rank_t*)arg;
  hps_store_t* store = NULL;
  hps_comm_t* comm = NULL;
  hps_work_t* work = NULL;
  float mine = (float)(r->rank + 1);
  CHECK_OK(hps_store_open(r->url, r->rank, 20000, &store));
  CHECK_OK(hps_comm_create(store, r->rank, 2, HPS_DEVICE_CPU, 0, NULL, &comm));
  CHECK_OK(
      hps_comm_all_reduce(comm, &mine, &r->sum, 1, HPS_DTYPE_FLOAT32, HPS_REDUCE_SUM, NULL, &work));
  CHECK_OK(hps_work_wait(work));
  CHECK_OK(hps_work_destroy(work));
  CHECK_OK(hps_comm_destroy(comm));
  CHECK_OK(hps_store_destroy(store));
  return NULL;
}

static void two_rank_world(const char* url) {
  pthread_t threads[2];
  pair_rank_t ranks[2] = {{url, 0, 0.0f}, {url, 1, 0.0f}};
  int i;
  for (i = 0; i < 2; ++i) CHECK(pthread_create(&threads[i], NULL, pair_rank_main, &ranks[i]) == 0);
  for (i = 0; i < 2; ++i) CHECK(pthread_join(threads[i], NULL) == 0);
  CHECK(ranks[0].sum == 3.0f && ranks[1].sum == 3.0f);
}

/* A one-rank engine with one parameter, a step taken. */
static hps_engine_t* make_engine(hps_comm_t* comm, hps_stream_t* compute) {
  hps_engine_options_t o;
  hps_engine_t* engine = NULL;
  const int64_t shape[1] = {5};
  size_t index = 0;
  float* data = NULL;
  int i;
  CHECK_OK(hps_engine_options_init(&o, sizeof o));
  o.learning_rate = 0.5;
  o.compute_stream = compute;
  if (hps_engine_create(comm, NULL, &o, &engine) != HPS_STATUS_OK) return NULL;
  CHECK_OK(hps_engine_add_param(engine, "w", shape, 1, HPS_DTYPE_FLOAT32, 0, 0, &index));
  CHECK_OK(hps_engine_seal(engine));
  CHECK_OK(hps_engine_broadcast_parameters(engine));
  CHECK_OK(hps_engine_wait_parameters(engine, 0));
  CHECK_OK(hps_engine_grad(engine, 0, (void**)&data));
  for (i = 0; data != NULL && i < 5; ++i) data[i] = 1.0f;
  CHECK_OK(hps_engine_grad_ready(engine, 0, NULL));
  CHECK_OK(hps_engine_step(engine));
  return engine;
}

static float first_param(hps_engine_t* engine) {
  float* data = NULL;
  CHECK_OK(hps_engine_synchronize(engine));
  CHECK_OK(hps_engine_param(engine, 0, (void**)&data));
  return data != NULL ? data[0] : -1.0f;
}

typedef struct {
  hps_store_t* pair_store;
  hps_store_t* store;
  hps_comm_t* pair; /* rank 0 of two; the all-reduce on it waits for rank 1 */
  hps_work_t* pending;
  hps_comm_t* solo;
  hps_stream_t* stream;
  hps_event_t* event;
  hps_topology_t* topology;
  hps_hybrid_group_t* group;
  hps_clip_t* clip;
  hps_engine_t* engine;
  hps_checkpoint_t* checkpoint;
  DLManagedTensor* view;
} parents_t;

/* Every handle of `h`, users first: in the parent they go; in the child each destroy (and
 * the view's deleter) returns at once, leaving the parent's object alone. */
static void destroy_all(parents_t* h) {
  CHECK_OK(hps_work_destroy(h->pending));
  CHECK_OK(hps_checkpoint_destroy(h->checkpoint));
  h->view->deleter(h->view);
  CHECK_OK(hps_engine_destroy(h->engine));
  CHECK_OK(hps_clip_destroy(h->clip));
  CHECK_OK(hps_hybrid_group_destroy(h->group));
  CHECK_OK(hps_topology_destroy(h->topology));
  CHECK_OK(hps_event_destroy(h->event));
  CHECK_OK(hps_stream_destroy(h->stream));
  CHECK_OK(hps_comm_destroy(h->solo));
  CHECK_OK(hps_comm_destroy(h->pair));
  CHECK_OK(hps_store_destroy(h->store));
  CHECK_OK(hps_store_destroy(h->pair_store));
}

/* The child: the parent's handles refused and let go, new ones working. */
static void child(parents_t* h, const char* dir) {
  int32_t flag = 0;
  float x = 1.0f, y = 0.0f;
  hps_work_t* work = NULL;
  hps_store_t* store = NULL;
  hps_comm_t* comm = NULL;
  hps_engine_t* engine = NULL;
  void* data = NULL;
  g_in_child = 1;
  alarm(30);

  CHECK(hps_work_wait(h->pending) == HPS_STATUS_FAILED_PRECONDITION && HAS("hps_work_wait") &&
        HAS("work " FORKED));
  CHECK(hps_work_test(h->pending, &flag) == HPS_STATUS_FAILED_PRECONDITION);
  CHECK(hps_comm_all_reduce(h->solo, &x, &y, 1, HPS_DTYPE_FLOAT32, HPS_REDUCE_SUM, NULL, &work) ==
            HPS_STATUS_FAILED_PRECONDITION &&
        HAS("comm " FORKED) && work == NULL);
  CHECK(hps_store_set(h->store, "k", "v", 1) == HPS_STATUS_FAILED_PRECONDITION &&
        HAS("store " FORKED));
  CHECK(hps_stream_synchronize(h->stream) == HPS_STATUS_FAILED_PRECONDITION);
  CHECK(hps_event_query(h->event, &flag) == HPS_STATUS_FAILED_PRECONDITION);
  CHECK(hps_topology_rank_of(h->topology, 0, 0, 0, 0, 0, &flag) == HPS_STATUS_FAILED_PRECONDITION);
  CHECK(hps_clip_seal(h->clip) == HPS_STATUS_FAILED_PRECONDITION);
  CHECK(hps_engine_step(h->engine) == HPS_STATUS_FAILED_PRECONDITION && HAS("hps_engine_step") &&
        HAS("engine " FORKED));
  CHECK(hps_engine_param(h->engine, 0, &data) == HPS_STATUS_FAILED_PRECONDITION && data == NULL);
  {
    size_t length = 0;
    CHECK(hps_checkpoint_metadata(h->checkpoint, "k", NULL, 0, &length) ==
          HPS_STATUS_FAILED_PRECONDITION);
  }

  /* The parent's handles as optional arguments of the child's own calls. */
  CHECK_OK(hps_store_open("memory://fork_capi_test_child", 0, 20000, &store));
  CHECK_OK(hps_comm_create(store, 0, 1, HPS_DEVICE_CPU, 0, NULL, &comm));
  CHECK(hps_comm_all_reduce(comm, &x, &y, 1, HPS_DTYPE_FLOAT32, HPS_REDUCE_SUM, h->stream, &work) ==
            HPS_STATUS_FAILED_PRECONDITION &&
        HAS("ready " FORKED) && work == NULL);
  CHECK(hps_engine_create(comm, h->solo, NULL, &engine) == HPS_STATUS_FAILED_PRECONDITION &&
        HAS("dp " FORKED) && engine == NULL);
  CHECK(make_engine(comm, h->stream) == NULL && HAS("options->compute_stream " FORKED));

  /* Destroying them returns at once; the view's deleter too. */
  destroy_all(h);

  /* The child's own handles work: a two-rank world (the parent's TCP device and its event
   * loop are the parent's: a child's communicator made on them waited for ever), a
   * collective, and an engine that trains and saves. */
  two_rank_world("memory://fork_capi_test_child_pair");
  CHECK_OK(hps_comm_all_reduce(comm, &x, &y, 1, HPS_DTYPE_FLOAT32, HPS_REDUCE_SUM, NULL, &work));
  CHECK_OK(hps_work_wait(work));
  CHECK(y == 1.0f);
  CHECK_OK(hps_work_destroy(work));
  engine = make_engine(comm, NULL);
  CHECK(engine != NULL && first_param(engine) == -0.5f);
  {
    hps_checkpoint_t* checkpoint = NULL;
    hps_work_t* save = NULL;
    CHECK_OK(hps_checkpoint_create(engine, comm, dir, NULL, &checkpoint));
    CHECK_OK(hps_checkpoint_save(checkpoint, "child", NULL, NULL, 0, &save));
    CHECK_OK(hps_work_wait(save));
    CHECK_OK(hps_work_destroy(save));
    CHECK_OK(hps_checkpoint_destroy(checkpoint));
  }
  CHECK_OK(hps_engine_destroy(engine));
  CHECK_OK(hps_comm_destroy(comm));
  CHECK_OK(hps_store_destroy(store));
  /* exit(), not _exit(): the library's static destructors and atexit hooks run too. */
  exit(check_summary());
}

int main(void) {
  parents_t h;
  peer_t peer;
  pthread_t thread;
  char dir[] = "/tmp/hps_fork_capi_test_XXXXXX";
  float x = 2.0f, sum = 0.0f;
  int32_t rank = -1;
  pid_t pid;
  int status = 0, waited_ms = 0;
  struct timespec retired, now;
  char command[128];

  memset(&h, 0, sizeof h);
  memset(&peer, 0, sizeof peer);
  peer.value = 3.0f;
  if (mkdtemp(dir) == NULL) return 1;
  /* A two-rank world made and destroyed before the fork: its transport is kept open for a
   * grace period (5 s) by a process-wide thread. The child's exit used to close it, taking
   * the parent's descriptors out of the parent's event loop, and the parent aborted when its
   * own thread closed it after the grace period (checked below, 6 s on). */
  two_rank_world("memory://fork_capi_test_before");
  clock_gettime(CLOCK_MONOTONIC, &retired);
  CHECK(pthread_create(&thread, NULL, peer_main, &peer) == 0);
  CHECK_OK(hps_store_open("memory://fork_capi_test", 0, 20000, &h.pair_store));
  CHECK_OK(hps_comm_create(h.pair_store, 0, 2, HPS_DEVICE_CPU, 0, NULL, &h.pair));
  CHECK_OK(hps_store_open("memory://fork_capi_test_solo", 0, 20000, &h.store));
  CHECK_OK(hps_comm_create(h.store, 0, 1, HPS_DEVICE_CPU, 0, NULL, &h.solo));
  CHECK_OK(hps_stream_create(HPS_DEVICE_CPU, 0, &h.stream));
  CHECK_OK(hps_event_create(HPS_DEVICE_CPU, 0, &h.event));
  CHECK_OK(hps_event_record(h.event, h.stream));
  CHECK_OK(hps_topology_create(1, 1, 1, 1, 1, NULL, 1, &h.topology));
  CHECK_OK(hps_hybrid_group_create(h.solo, h.topology, &h.group));
  CHECK_OK(hps_clip_create(h.solo, NULL, NULL, NULL, &h.clip));
  h.engine = make_engine(h.solo, NULL);
  CHECK(h.engine != NULL);
  if (h.engine == NULL) return check_summary();
  CHECK_OK(hps_engine_param_dlpack(h.engine, 0, &h.view));
  CHECK_OK(hps_checkpoint_create(h.engine, h.solo, dir, NULL, &h.checkpoint));
  /* In flight across the fork: rank 1 joins only after the child has gone. */
  CHECK_OK(hps_comm_all_reduce(h.pair, &x, &sum, 1, HPS_DTYPE_FLOAT32, HPS_REDUCE_SUM, NULL,
                               &h.pending));

  while (!peer.ready) {
    struct timespec pause = {0, 1000 * 1000};
    nanosleep(&pause, NULL);
  }
  quiesce_before_fork();
  pid = fork();
  if (pid == 0) child(&h, dir);
  CHECK(pid > 0);
  while (pid > 0 && waited_ms < 60000) {
    struct timespec pause = {0, 10 * 1000 * 1000};
    const pid_t done = waitpid(pid, &status, WNOHANG);
    if (done == pid || (done < 0 && errno != EINTR)) break;
    nanosleep(&pause, NULL);
    waited_ms += 10;
  }
  if (waited_ms >= 60000) {
    fprintf(stderr, "the child did not exit in 60 s\n");
    kill(pid, SIGKILL);
    waitpid(pid, &status, 0);
  }
  CHECK(WIFEXITED(status) && WEXITSTATUS(status) == 0);
  if (WIFSIGNALED(status)) fprintf(stderr, "the child died of signal %d\n", WTERMSIG(status));

  /* The parent's handles are untouched: the collective completes with its peer, the engine
   * trains on, the others answer. */
  /* Past the grace period of the world retired before the fork: the parent's event loop
   * carries on (another two-rank world works). */
  do {
    struct timespec pause = {0, 100 * 1000 * 1000};
    nanosleep(&pause, NULL);
    clock_gettime(CLOCK_MONOTONIC, &now);
  } while ((now.tv_sec - retired.tv_sec) * 1000 + (now.tv_nsec - retired.tv_nsec) / 1000000 < 6000);
  two_rank_world("memory://fork_capi_test_after");
  peer.join = 1;
  CHECK_OK(hps_work_wait(h.pending));
  CHECK(sum == 5.0f);
  CHECK(pthread_join(thread, NULL) == 0);
  CHECK(peer.sum == 5.0f);
  CHECK(first_param(h.engine) == -0.5f);
  CHECK_OK(hps_stream_synchronize(h.stream));
  CHECK_OK(hps_topology_rank_of(h.topology, 0, 0, 0, 0, 0, &rank));
  CHECK(rank == 0);
  destroy_all(&h);
  CHECK_OK(hps_comm_destroy(peer.comm));
  CHECK_OK(hps_store_destroy(peer.store));
  snprintf(command, sizeof command, "rm -rf '%s'", dir);
  CHECK(system(command) == 0);
  return check_summary();
}
