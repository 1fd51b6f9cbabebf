/* The main job: an MLP whose forward and backward are written here, as a framework would,
 * trained with hpshard's stage 2 (or 3) over every rank of the job, beside an unsharded run of
 * the same model, data and seed computed by rank 0 alone. Per step it prints both losses
 * and the host syncs the engine caused.
 *
 *   hpshard-run -n 4 -- hpshard_train_mlp [--steps N] [--stage 2|3] [--adamw] [--clip MAX_NORM]
 *                      [--checkpoint-dir DIR [--save-every N] [--resume] [--die-at STEP]]
 *                      [--dump FILE]
 *
 * With --checkpoint-dir, every --save-every steps the job saves a checkpoint asynchronously
 * (the steps that follow overlap its writing); --resume loads the newest one first, at any
 * number of ranks, and continues from the step its metadata records (the unsharded
 * reference replays the steps before it); --die-at kills the job with SIGKILL at the start
 * of that step, once the last save is published. --dump writes the final parameters.
 *
 * The MLP is small, so every layer's parameters are gathered for the whole forward and
 * backward of a step; a framework with large layers gathers and releases per layer.
 */
#define _POSIX_C_SOURCE 200809L /* SIGKILL */
#include <math.h>
#include <signal.h>
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
      exit(1);                                                             \
    }                                                                      \
  } while (0)

enum { kIn = 8, kHidden = 32, kOut = 1, kLayers = 3, kBatch = 48 };
static const int kFanIn[kLayers] = {kIn, kHidden, kHidden};
static const int kFanOut[kLayers] = {kHidden, kHidden, kOut};

/* One model's parameters and gradients: W[l] is fan_in x fan_out, row-major. */
typedef struct {
  float* w[kLayers];
  float* b[kLayers];
  float* gw[kLayers];
  float* gb[kLayers];
} model_t;

static void sample(int j, float* x, float* y) {
  int k;
  float target = 0.1f * sinf((float)j);
  for (k = 0; k < kIn; ++k) {
    x[k] = sinf(0.37f * (float)j + 0.91f * (float)k);
    target += x[k] * (float)(k % 3 - 1) * 0.5f;
  }
  y[0] = tanhf(target);
}

static float init_value(int layer, int i) {
  return 0.3f * sinf(1.7f * (float)(layer * 1000 + i) + 0.5f) / sqrtf((float)kFanIn[layer]);
}

/* Forward and backward over samples [first, first + count) of step `step`'s batch; adds
 * the gradient of their mean loss into m's gradients and returns that mean loss. Each rank
 * takes the mean over its own samples, as with DDP: the engine averages over the ranks. */
static double forward_backward(const model_t* m, int step, int first, int count, float loss_scale) {
  float act[kLayers + 1][kHidden], pre[kLayers][kHidden], delta[kHidden], next_delta[kHidden];
  double loss = 0;
  int s, l, i, o;
  for (s = first; s < first + count; ++s) {
    float y;
    sample(step * kBatch + s, act[0], &y);
    for (l = 0; l < kLayers; ++l) {
      for (o = 0; o < kFanOut[l]; ++o) {
        float z = m->b[l][o];
        for (i = 0; i < kFanIn[l]; ++i) z += act[l][i] * m->w[l][i * kFanOut[l] + o];
        pre[l][o] = z;
        act[l + 1][o] = l + 1 < kLayers ? tanhf(z) : z;
      }
    }
    loss += 0.5 * (act[kLayers][0] - y) * (act[kLayers][0] - y) / count;
    delta[0] = (act[kLayers][0] - y) / (float)count * loss_scale;
    for (l = kLayers - 1; l >= 0; --l) {
      for (o = 0; o < kFanOut[l]; ++o) {
        m->gb[l][o] += delta[o];
        for (i = 0; i < kFanIn[l]; ++i) m->gw[l][i * kFanOut[l] + o] += act[l][i] * delta[o];
      }
      if (l == 0) break;
      for (i = 0; i < kFanIn[l]; ++i) {
        float sum = 0;
        for (o = 0; o < kFanOut[l]; ++o) sum += m->w[l][i * kFanOut[l] + o] * delta[o];
        next_delta[i] = sum * (1.0f - act[l][i] * act[l][i]); /* tanh' */
      }
      memcpy(delta, next_delta, sizeof delta);
    }
    (void)pre;
  }
  return loss;
}

/* The unsharded reference: the same optimizer rules, the full batch, one process. */
typedef struct {
  model_t m;
  float* state_a[2 * kLayers];
  float* state_b[2 * kLayers];
  long step;
} reference_t;

static void reference_step(reference_t* r, const hps_engine_options_t* o) {
  int l, t;
  r->step++;
  for (l = 0; l < kLayers; ++l) {
    for (t = 0; t < 2; ++t) {
      float* p = t == 0 ? r->m.w[l] : r->m.b[l];
      float* g = t == 0 ? r->m.gw[l] : r->m.gb[l];
      float* a = r->state_a[2 * l + t];
      float* v = r->state_b[2 * l + t];
      const int n = t == 0 ? kFanIn[l] * kFanOut[l] : kFanOut[l];
      int i;
      for (i = 0; i < n; ++i) {
        if (o->optimizer == HPS_OPTIMIZER_ADAMW) {
          const double b1 = 1.0 - pow(o->beta1, (double)r->step);
          const double b2 = 1.0 - pow(o->beta2, (double)r->step);
          a[i] = o->beta1 * a[i] + (1 - o->beta1) * g[i];
          v[i] = o->beta2 * v[i] + (1 - o->beta2) * g[i] * g[i];
          p[i] = (float)(p[i] * (1 - o->learning_rate * o->weight_decay) -
                         o->learning_rate / b1 * a[i] / (sqrt(v[i]) / sqrt(b2) + o->epsilon));
        } else {
          const float gi = g[i] + o->weight_decay * p[i];
          a[i] = r->step == 1 ? gi : o->momentum * a[i] + gi;
          p[i] -= o->learning_rate * a[i];
        }
        g[i] = 0;
      }
    }
  }
}

/* One step of the unsharded reference on the full batch; returns its loss. */
static double reference_train_step(reference_t* ref, const hps_engine_options_t* options, int step,
                                   int inject_inf) {
  int l, i;
  const double loss = forward_backward(&ref->m, step, 0, kBatch, 1.0f);
  if (options->clip_max_norm > 0) {
    double sq = 0, coef;
    for (l = 0; l < kLayers; ++l) {
      for (i = 0; i < kFanIn[l] * kFanOut[l]; ++i) sq += (double)ref->m.gw[l][i] * ref->m.gw[l][i];
      for (i = 0; i < kFanOut[l]; ++i) sq += (double)ref->m.gb[l][i] * ref->m.gb[l][i];
    }
    coef = options->clip_max_norm / (fmax(sqrt(sq), options->clip_max_norm) + 1e-6);
    for (l = 0; l < kLayers; ++l) {
      for (i = 0; i < kFanIn[l] * kFanOut[l]; ++i) ref->m.gw[l][i] *= (float)coef;
      for (i = 0; i < kFanOut[l]; ++i) ref->m.gb[l][i] *= (float)coef;
    }
  }
  if (step == inject_inf) { /* the engine skips this step on every rank: so does the reference */
    for (l = 0; l < kLayers; ++l) {
      memset(ref->m.gw[l], 0, sizeof(float) * (size_t)(kFanIn[l] * kFanOut[l]));
      memset(ref->m.gb[l], 0, sizeof(float) * (size_t)kFanOut[l]);
    }
  } else {
    reference_step(ref, options);
  }
  return loss;
}

static float* zeros(int n) { return (float*)calloc((size_t)n, sizeof(float)); }

int main(int argc, char** argv) {
  hps_rendezvous_info_t info;
  hps_store_t* store = NULL;
  hps_comm_t* world = NULL;
  hps_engine_t* engine = NULL;
  hps_engine_options_t options;
  model_t sharded;
  reference_t ref;
  size_t index[2 * kLayers];
  int steps = 10, l, i, step, a, inject_inf = -1, save_every = 0, resume = 0, die_at = -1;
  int first_step = 0;
  const char* checkpoint_dir = NULL;
  const char* dump = NULL;
  hps_checkpoint_t* checkpoint = NULL;
  hps_work_t* save_work = NULL;
  const float* loss_scale = NULL;
  const int64_t* skipped = NULL;
  uint64_t resident = 0;

  TRY(hps_engine_options_init(&options, sizeof options));
  options.learning_rate = 0.05f;
  options.momentum = 0.9f;
  for (a = 1; a < argc; ++a) {
    if (strcmp(argv[a], "--steps") == 0 && a + 1 < argc)
      steps = atoi(argv[++a]);
    else if (strcmp(argv[a], "--adamw") == 0) {
      options.optimizer = HPS_OPTIMIZER_ADAMW;
      options.learning_rate = 0.01f;
      options.weight_decay = 0.01f;
    } else if (strcmp(argv[a], "--clip") == 0 && a + 1 < argc)
      options.clip_max_norm = atof(argv[++a]);
    else if (strcmp(argv[a], "--loss-scaling") == 0) {
      options.dynamic_loss_scaling = 1;
      options.initial_loss_scale = 1024.0f;
      options.growth_interval = 3;
    } else if (strcmp(argv[a], "--inject-inf") == 0 && a + 1 < argc)
      inject_inf = atoi(argv[++a]);
    else if (strcmp(argv[a], "--stage") == 0 && a + 1 < argc)
      options.stage = atoi(argv[++a]);
    else if (strcmp(argv[a], "--checkpoint-dir") == 0 && a + 1 < argc)
      checkpoint_dir = argv[++a];
    else if (strcmp(argv[a], "--save-every") == 0 && a + 1 < argc)
      save_every = atoi(argv[++a]);
    else if (strcmp(argv[a], "--resume") == 0)
      resume = 1;
    else if (strcmp(argv[a], "--die-at") == 0 && a + 1 < argc)
      die_at = atoi(argv[++a]);
    else if (strcmp(argv[a], "--dump") == 0 && a + 1 < argc)
      dump = argv[++a];
    else {
      fprintf(stderr,
              "usage: %s [--steps N] [--stage 2|3] [--adamw] [--clip MAX_NORM] "
              "[--loss-scaling] [--inject-inf STEP] [--checkpoint-dir DIR [--save-every N] "
              "[--resume] [--die-at STEP]] [--dump FILE]\n",
              argv[0]);
      return 2;
    }
  }
  if ((save_every > 0 || resume) && checkpoint_dir == NULL) {
    fprintf(stderr, "--save-every and --resume need --checkpoint-dir\n");
    return 2;
  }

  TRY(hps_rendezvous_info_init(&info, sizeof info));
  TRY(hps_rendezvous_from_env(&info));
  if (kBatch % info.world_size != 0) {
    fprintf(stderr, "the batch of %d samples does not split over %d ranks\n", kBatch,
            (int)info.world_size);
    return 2;
  }
  TRY(hps_store_open(info.store_url, info.rank, 60000, &store));
  TRY(hps_comm_create(store, info.rank, info.world_size, HPS_DEVICE_CPU, 0, NULL, &world));
  TRY(hps_engine_create(world, NULL, &options, &engine));
  for (l = 0; l < kLayers; ++l) {
    char name[32];
    const int64_t wshape[2] = {kFanIn[l], kFanOut[l]}, bshape[1] = {kFanOut[l]};
    snprintf(name, sizeof name, "layer%d.weight", l);
    TRY(hps_engine_add_param(engine, name, wshape, 2, HPS_DTYPE_FLOAT32, 0, l, &index[2 * l]));
    snprintf(name, sizeof name, "layer%d.bias", l);
    TRY(hps_engine_add_param(engine, name, bshape, 1, HPS_DTYPE_FLOAT32, 0, l, &index[2 * l + 1]));
  }
  TRY(hps_engine_seal(engine));
  for (l = 0; l < kLayers; ++l) {
    TRY(hps_engine_param(engine, index[2 * l], (void**)&sharded.w[l]));
    TRY(hps_engine_param(engine, index[2 * l + 1], (void**)&sharded.b[l]));
    for (i = 0; i < kFanIn[l] * kFanOut[l]; ++i)
      sharded.w[l][i] = info.rank == 0 ? init_value(l, i) : 0;
    for (i = 0; i < kFanOut[l]; ++i) sharded.b[l][i] = 0;
  }
  TRY(hps_engine_broadcast_parameters(engine)); /* rank 0's initial values everywhere */
  if (checkpoint_dir != NULL) {
    hps_checkpoint_options_t checkpoint_options;
    TRY(hps_checkpoint_options_init(&checkpoint_options, sizeof checkpoint_options));
    checkpoint_options.keep_last = 2;
    TRY(hps_checkpoint_create(engine, world, checkpoint_dir, &checkpoint_options, &checkpoint));
  }
  if (resume) { /* the newest checkpoint, whatever world size wrote it */
    char text[32];
    size_t length = 0;
    hps_checkpoint_info_t info_saved;
    TRY(hps_checkpoint_load(checkpoint, NULL, NULL));
    TRY(hps_checkpoint_metadata(checkpoint, "step", text, sizeof text, &length));
    first_step = atoi(text);
    TRY(hps_checkpoint_info_init(&info_saved, sizeof info_saved));
    TRY(hps_checkpoint_inspect(checkpoint_dir, &info_saved));
    if (info.rank == 0) {
      printf("resumed from checkpoint %s (step %d, saved by %d ranks at stage %d) on %d ranks\n",
             info_saved.name, first_step, (int)info_saved.world, (int)info_saved.stage,
             (int)info.world_size);
    }
  }
  TRY(hps_engine_resident_bytes(engine, &resident));

  memset(&ref, 0, sizeof ref);
  for (l = 0; l < kLayers; ++l) {
    const int nw = kFanIn[l] * kFanOut[l], nb = kFanOut[l];
    ref.m.w[l] = zeros(nw);
    ref.m.b[l] = zeros(nb);
    ref.m.gw[l] = zeros(nw);
    ref.m.gb[l] = zeros(nb);
    ref.state_a[2 * l] = zeros(nw);
    ref.state_b[2 * l] = zeros(nw);
    ref.state_a[2 * l + 1] = zeros(nb);
    ref.state_b[2 * l + 1] = zeros(nb);
    for (i = 0; i < nw; ++i) ref.m.w[l][i] = init_value(l, i);
  }

  if (info.rank == 0) {
    const char* transport = "?";
    TRY(hps_comm_transport(world, &transport));
    printf(
        "hpshard %s: stage %d over %d CPU ranks (%s; collectives over %s), %s%s, MLP "
        "%d-%d-%d-%d, batch %d; %llu bytes resident on rank 0 between steps\n",
        hps_version_string(), (int)options.stage, (int)info.world_size, info.source, transport,
        options.optimizer == HPS_OPTIMIZER_ADAMW ? "AdamW" : "SGD+momentum",
        options.clip_max_norm > 0 ? " with clipping" : "", kIn, kHidden, kHidden, kOut, kBatch,
        (unsigned long long)resident);
    printf("%5s  %14s  %14s  %10s  %s\n", "step", "loss (sharded)", "loss (1 rank)", "rel diff",
           "host syncs in step");
  }
  /* A resumed run's reference replays the steps before the checkpoint. */
  for (step = 0; step < first_step && info.rank == 0; ++step) {
    reference_train_step(&ref, &options, step, inject_inf);
  }
  for (step = first_step; step < steps; ++step) {
    const int per_rank = kBatch / info.world_size;
    double local_loss, global_loss = 0, ref_loss = 0;
    uint64_t syncs = 0;
    hps_work_t* work = NULL;
    if (step == die_at) { /* the job dies once its last checkpoint is published */
      if (save_work != NULL) TRY(hps_work_wait(save_work));
      if (info.rank == 0) {
        printf("killing the job at step %d\n", step);
        fflush(stdout);
        raise(SIGKILL);
      }
    }
    TRY(hps_host_sync_reset());
    for (l = 0; l < kLayers; ++l) {
      /* The views are fetched after the wait: in stage 3 they exist only while gathered. */
      TRY(hps_engine_wait_parameters(engine, l));
      TRY(hps_engine_param(engine, index[2 * l], (void**)&sharded.w[l]));
      TRY(hps_engine_param(engine, index[2 * l + 1], (void**)&sharded.b[l]));
      TRY(hps_engine_grad(engine, index[2 * l], (void**)&sharded.gw[l]));
      TRY(hps_engine_grad(engine, index[2 * l + 1], (void**)&sharded.gb[l]));
    }
    /* The scale the engine's last update left (1 without loss scaling). */
    TRY(hps_engine_loss_scale(engine, &loss_scale, &skipped));
    local_loss = forward_backward(&sharded, step, info.rank * per_rank, per_rank, *loss_scale);
    if (step == inject_inf && info.rank == info.world_size - 1) sharded.gw[0][0] = INFINITY;
    for (l = kLayers - 1; l >= 0; --l) { /* backward order */
      TRY(hps_engine_grad_ready(engine, index[2 * l + 1], NULL));
      TRY(hps_engine_grad_ready(engine, index[2 * l], NULL));
      TRY(hps_engine_release_parameters(engine, l));
    }
    TRY(hps_engine_step(engine));
    TRY(hps_host_sync_count_thread(&syncs));

    /* Reporting only (outside the step): the global loss needs the other ranks' parts. */
    TRY(hps_comm_all_reduce(world, &local_loss, &global_loss, 1, HPS_DTYPE_FLOAT64, HPS_REDUCE_AVG,
                            NULL, &work));
    TRY(hps_work_wait(work));
    hps_work_destroy(work);
    if (info.rank == 0) {
      ref_loss = reference_train_step(&ref, &options, step, inject_inf);
      printf("%5d  %14.8f  %14.8f  %10.2e  %llu\n", step, global_loss, ref_loss,
             fabs(global_loss - ref_loss) / fmax(fabs(ref_loss), 1e-30), (unsigned long long)syncs);
      if (fabs(global_loss - ref_loss) > 1e-4 * fabs(ref_loss) || syncs != 0) {
        fprintf(stderr, "sharded training diverged from the unsharded run, or the step synced\n");
        return 1;
      }
    }
    if (save_every > 0 && (step + 1) % save_every == 0) {
      /* Returns at once; the next steps overlap the writing (a save still in flight is
         waited for first). */
      char name[32], value[16];
      const char* key = "step";
      const char* text = value;
      snprintf(name, sizeof name, "step-%d", step + 1);
      snprintf(value, sizeof value, "%d", step + 1);
      if (save_work != NULL) {
        TRY(hps_work_wait(save_work));
        TRY(hps_work_destroy(save_work));
      }
      TRY(hps_checkpoint_save(checkpoint, name, &key, &text, 1, &save_work));
      if (info.rank == 0) printf("saving checkpoint %s in the background\n", name);
    }
  }
  if (save_work != NULL) {
    TRY(hps_work_wait(save_work));
    TRY(hps_work_destroy(save_work));
    if (info.rank == 0) printf("the last checkpoint is published\n");
  }
  TRY(hps_engine_synchronize(engine));
  { /* The full first weight (collective), as a checkpoint would save it, against the
       unsharded run's; a buffer one element short is refused. */
    const int nw = kFanIn[0] * kFanOut[0];
    float* full = (float*)malloc(sizeof(float) * (size_t)nw);
    int mismatches = 0;
    if (hps_engine_gather_parameter(engine, index[0], full, (uint64_t)nw - 1) !=
        HPS_STATUS_OUT_OF_RANGE) {
      fprintf(stderr, "a too-small buffer was accepted\n");
      return 1;
    }
    TRY(hps_engine_gather_parameter(engine, index[0], full, (uint64_t)nw));
    for (i = 0; i < nw && info.rank == 0; ++i) {
      if (fabsf(full[i] - ref.m.w[0][i]) > 1e-5f * fabsf(ref.m.w[0][i]) + 1e-6f) ++mismatches;
    }
    if (info.rank == 0)
      printf("gathered layer0.weight: %d of %d elements differ from the unsharded run\n",
             mismatches, nw);
    free(full);
    if (mismatches != 0) return 1;
  }
  if (info.rank == 0 && options.dynamic_loss_scaling) {
    TRY(hps_engine_loss_scale(engine, &loss_scale, &skipped));
    printf("loss scale %.0f after %lld skipped step(s)\n", (double)*loss_scale,
           (long long)*skipped);
    if (*skipped != (inject_inf >= 0 && inject_inf < steps ? 1 : 0)) {
      fprintf(stderr, "expected exactly the injected step to be skipped\n");
      return 1;
    }
  }
  {
    uint64_t waits = 0, nanoseconds = 0;
    TRY(hps_dependency_wait_stats(&waits, &nanoseconds));
    if (info.rank == 0) {
      printf("dependency waits (all-gathers not yet arrived when a forward began): %llu, %.3f ms\n",
             (unsigned long long)waits, (double)nanoseconds / 1e6);
    }
  }
  if (dump != NULL) { /* the final parameters, gathered (collective), one per line */
    FILE* out = info.rank == 0 ? fopen(dump, "w") : NULL;
    for (l = 0; l < 2 * kLayers; ++l) {
      const int n = l % 2 == 0 ? kFanIn[l / 2] * kFanOut[l / 2] : kFanOut[l / 2];
      float* full = (float*)malloc(sizeof(float) * (size_t)n);
      TRY(hps_engine_gather_parameter(engine, index[l], full, (uint64_t)n));
      for (i = 0; i < n && out != NULL; ++i) fprintf(out, "%.9g\n", (double)full[i]);
      free(full);
    }
    if (out != NULL) fclose(out);
  }
  TRY(hps_checkpoint_destroy(checkpoint));
  TRY(hps_engine_destroy(engine));
  TRY(hps_comm_destroy(world));
  TRY(hps_store_destroy(store));
  for (l = 0; l < kLayers; ++l) {
    free(ref.m.w[l]);
    free(ref.m.b[l]);
    free(ref.m.gw[l]);
    free(ref.m.gb[l]);
  }
  for (l = 0; l < 2 * kLayers; ++l) {
    free(ref.state_a[l]);
    free(ref.state_b[l]);
  }
  return 0;
}
