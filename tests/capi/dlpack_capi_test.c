/* DLPack tensors through the C API, compiled as C99: views handed out by engines and clips
 * (their metadata, that they write through, that they keep the memory alive past the
 * handle but not its communicators), the host/device policy, and collectives and clip registration
 * over DLTensors (results over two thread-ranks, and every refusal). */
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "check.h"
#include "hpshard/hpshard.h"

/* A host float32 tensor of one dimension over `data`. */
static DLTensor host_f32(float* data, int64_t* shape) {
  DLTensor t;
  memset(&t, 0, sizeof t);
  t.data = data;
  t.device.device_type = kDLCPU;
  t.ndim = 1;
  t.dtype.code = kDLFloat;
  t.dtype.bits = 32;
  t.dtype.lanes = 1;
  t.shape = shape;
  return t;
}

static hps_status_t finish(hps_status_t enqueued, hps_work_t** work) {
  hps_status_t s;
  if (enqueued != HPS_STATUS_OK) return enqueued;
  s = hps_work_wait(*work);
  hps_work_destroy(*work);
  *work = NULL;
  return s;
}

/* ---- views handed out ------------------------------------------------------------------ */

static void engine_views(void) {
  hps_store_t* store = NULL;
  hps_comm_t* comm = NULL;
  hps_engine_t* engine = NULL;
  hps_engine_options_t o;
  DLManagedTensor *pv = NULL, *gv = NULL, *scale = NULL, *skipped = NULL, *half = NULL;
  const int64_t shape[2] = {2, 3}, half_shape[1] = {5};
  size_t index = 0;
  void* raw = NULL;
  void* host = NULL;
  float* p;
  int i;

  CHECK_OK(hps_store_open("memory://dlpack-views", 0, 10000, &store));
  CHECK_OK(hps_comm_create(store, 0, 1, HPS_DEVICE_CPU, 0, NULL, &comm));
  CHECK_OK(hps_engine_options_init(&o, sizeof o));
  o.learning_rate = 0.5f;
  CHECK_OK(hps_engine_create(comm, NULL, &o, &engine));
  if (engine == NULL) return;
  CHECK_OK(hps_engine_add_param(engine, "w", shape, 2, HPS_DTYPE_FLOAT32, 0, 0, &index));
  CHECK_OK(hps_engine_add_param(engine, "h", half_shape, 1, HPS_DTYPE_BFLOAT16, 0, 0, &index));
  /* Before seal there is no memory to view. */
  CHECK(hps_engine_param_dlpack(engine, 0, &pv) == HPS_STATUS_FAILED_PRECONDITION && !pv);
  CHECK_OK(hps_engine_seal(engine));
  CHECK(hps_engine_param_dlpack(engine, 2, &pv) == HPS_STATUS_OUT_OF_RANGE && !pv);
  CHECK(hps_engine_param_dlpack(NULL, 0, &pv) == HPS_STATUS_INVALID_ARGUMENT);
  CHECK(hps_engine_param_dlpack(engine, 0, NULL) == HPS_STATUS_INVALID_ARGUMENT);

  /* The parameter view: float32, shape [2, 3], compact strides, the CPU, and the very
   * memory of hps_engine_param. */
  CHECK_OK(hps_engine_param_dlpack(engine, 0, &pv));
  CHECK_OK(hps_engine_param(engine, 0, &raw));
  if (pv == NULL) return;
  CHECK(pv->dl_tensor.data == raw && pv->dl_tensor.byte_offset == 0);
  CHECK(pv->dl_tensor.device.device_type == kDLCPU && pv->dl_tensor.device.device_id == 0);
  CHECK(pv->dl_tensor.dtype.code == kDLFloat && pv->dl_tensor.dtype.bits == 32 &&
        pv->dl_tensor.dtype.lanes == 1);
  CHECK(pv->dl_tensor.ndim == 2 && pv->dl_tensor.shape[0] == 2 && pv->dl_tensor.shape[1] == 3);
  CHECK(pv->dl_tensor.strides[0] == 3 && pv->dl_tensor.strides[1] == 1);
  CHECK(pv->deleter != NULL);
  CHECK_OK(hps_engine_param_dlpack(engine, 1, &half));
  if (half != NULL) {
    CHECK(half->dl_tensor.dtype.code == kDLBfloat && half->dl_tensor.dtype.bits == 16);
    CHECK(half->dl_tensor.ndim == 1 && half->dl_tensor.shape[0] == 5);
    CHECK_OK(hps_dlpack_release(half));
  }

  /* The host policy: a CPU view has a host address, its data. */
  CHECK_OK(hps_dlpack_host_data(&pv->dl_tensor, &host));
  CHECK(host == raw);
  p = (float*)host;
  for (i = 0; i < 6; ++i) p[i] = 1.0f;
  CHECK_OK(hps_engine_broadcast_parameters(engine));

  /* One step through the gradient view: p = 1 - 0.5 * g. */
  CHECK_OK(hps_engine_wait_parameters(engine, 0));
  CHECK_OK(hps_engine_grad_dlpack(engine, 0, &gv));
  if (gv == NULL) return;
  CHECK_OK(hps_engine_grad(engine, 0, &raw));
  CHECK(gv->dl_tensor.data == raw && gv->dl_tensor.ndim == 2);
  for (i = 0; i < 6; ++i) ((float*)gv->dl_tensor.data)[i] = (float)i;
  CHECK_OK(hps_engine_grad_ready(engine, 0, NULL));
  CHECK_OK(hps_engine_grad_dlpack(engine, 1, &half));
  CHECK_OK(hps_dlpack_release(half));
  CHECK_OK(hps_engine_grad_ready(engine, 1, NULL));
  CHECK_OK(hps_engine_step(engine));
  CHECK_OK(hps_engine_wait_parameters(engine, 0));
  for (i = 0; i < 6; ++i) CHECK(p[i] == 1.0f - 0.5f * (float)i);

  /* The loss scale and skipped steps: float32 1 and int64 0, shape [1]. */
  CHECK_OK(hps_engine_loss_scale_dlpack(engine, &scale, &skipped));
  if (scale != NULL && skipped != NULL) {
    CHECK(scale->dl_tensor.dtype.code == kDLFloat && scale->dl_tensor.ndim == 1 &&
          scale->dl_tensor.shape[0] == 1 && *(const float*)scale->dl_tensor.data == 1.0f);
    CHECK(skipped->dl_tensor.dtype.code == kDLInt && skipped->dl_tensor.dtype.bits == 64 &&
          *(const int64_t*)skipped->dl_tensor.data == 0);
  }

  /* The views keep the engine's memory: after the handle (and the communicator's) are
   * gone, they still read the stepped values (AddressSanitizer would see a freed read). */
  CHECK_OK(hps_engine_destroy(engine));
  CHECK_OK(hps_comm_destroy(comm));
  CHECK_OK(hps_store_destroy(store));
  for (i = 0; i < 6; ++i) CHECK(((const float*)pv->dl_tensor.data)[i] == 1.0f - 0.5f * (float)i);
  for (i = 0; i < 6; ++i) CHECK(((const float*)gv->dl_tensor.data)[i] == 0.0f); /* zeroed */
  CHECK(*(const float*)scale->dl_tensor.data == 1.0f);
  /* Released in any order; the last one frees the engine. */
  CHECK_OK(hps_dlpack_release(gv));
  CHECK_OK(hps_dlpack_release(scale));
  CHECK_OK(hps_dlpack_release(pv));
  CHECK_OK(hps_dlpack_release(skipped));
  CHECK_OK(hps_dlpack_release(NULL));
}

static void stage3_views(void) {
  hps_store_t* store = NULL;
  hps_comm_t* comm = NULL;
  hps_engine_t* engine = NULL;
  hps_engine_options_t o;
  DLManagedTensor* v = NULL;
  const int64_t shape[1] = {8};
  size_t index = 0;

  CHECK_OK(hps_store_open("memory://dlpack-stage3", 0, 10000, &store));
  CHECK_OK(hps_comm_create(store, 0, 1, HPS_DEVICE_CPU, 0, NULL, &comm));
  CHECK_OK(hps_engine_options_init(&o, sizeof o));
  o.stage = 3;
  CHECK_OK(hps_engine_create(comm, NULL, &o, &engine));
  if (engine == NULL) return;
  CHECK_OK(hps_engine_add_param(engine, "a", shape, 1, HPS_DTYPE_FLOAT32, 0, 0, &index));
  CHECK_OK(hps_engine_add_param(engine, "b", shape, 1, HPS_DTYPE_FLOAT32, 0, 1, &index));
  CHECK_OK(hps_engine_seal(engine));
  { /* No state before the broadcast: nothing to gather (it gave zeros). */
    float full[8];
    CHECK(hps_engine_gather_parameter(engine, 0, full, 8) == HPS_STATUS_FAILED_PRECONDITION);
  }
  CHECK_OK(hps_engine_broadcast_parameters(engine));
  /* Unit 1 is not gathered: no view of it. */
  CHECK(hps_engine_param_dlpack(engine, 1, &v) == HPS_STATUS_FAILED_PRECONDITION && v == NULL);
  CHECK_OK(hps_engine_wait_parameters(engine, 1));
  CHECK_OK(hps_engine_param_dlpack(engine, 1, &v));
  CHECK(v != NULL && v->dl_tensor.shape[0] == 8);
  CHECK_OK(hps_dlpack_release(v));
  v = NULL;
  CHECK_OK(hps_engine_release_parameters(engine, 1));
  CHECK(hps_engine_param_dlpack(engine, 1, &v) == HPS_STATUS_FAILED_PRECONDITION && v == NULL);
  CHECK_OK(hps_engine_destroy(engine));
  CHECK_OK(hps_comm_destroy(comm));
  CHECK_OK(hps_store_destroy(store));
}

/* ---- the host policy and what is refused -------------------------------------------------- */

static void policy_and_refusals(void) {
  float data[4] = {1, 2, 3, 4};
  int64_t shape[1] = {4}, shape2[2] = {2, 2}, strides[2] = {1, 2};
  DLTensor t = host_f32(data, shape);
  void* host = NULL;
  hps_store_t* store = NULL;
  hps_comm_t* comm = NULL;
  hps_work_t* work = NULL;
  float out[4];
  DLTensor r;

  /* No host view of device memory; pinned and managed memory are host memory. */
  t.device.device_type = kDLCUDA;
  CHECK(hps_dlpack_host_data(&t, &host) == HPS_STATUS_FAILED_PRECONDITION && host == NULL);
  CHECK(HAS("on cuda:0, not the host"));
  t.device.device_id = 3;
  CHECK(hps_dlpack_host_data(&t, &host) == HPS_STATUS_FAILED_PRECONDITION && HAS("cuda:3"));
  t.device.device_type = kDLROCM;
  CHECK(hps_dlpack_host_data(&t, &host) == HPS_STATUS_FAILED_PRECONDITION);
  CHECK(HAS("dlpack-device-type-10"));
  t.device.device_type = kDLCUDAHost;
  t.byte_offset = 8;
  CHECK_OK(hps_dlpack_host_data(&t, &host));
  CHECK(host == (void*)(data + 2));
  CHECK(hps_dlpack_host_data(NULL, &host) == HPS_STATUS_INVALID_ARGUMENT);

  CHECK_OK(hps_store_open("memory://dlpack-refusals", 0, 10000, &store));
  CHECK_OK(hps_comm_create(store, 0, 1, HPS_DEVICE_CPU, 0, NULL, &comm));
  if (comm == NULL) return;
  t = host_f32(data, shape);
  r = host_f32(out, shape);
  /* A good one first: all_reduce of one rank copies. */
  CHECK_OK(finish(hps_comm_all_reduce_dlpack(comm, &t, &r, HPS_REDUCE_SUM, NULL, &work), &work));
  CHECK(out[0] == 1 && out[3] == 4);
  /* byte_offset counts. */
  t.byte_offset = 4;
  shape[0] = 3;
  r = host_f32(out, shape);
  CHECK_OK(finish(hps_comm_all_reduce_dlpack(comm, &t, &r, HPS_REDUCE_SUM, NULL, &work), &work));
  CHECK(out[0] == 2 && out[2] == 4);
  /* An offset off the element size, or wrapping the address space, is refused. */
  work = NULL;
  t.byte_offset = 2;
  CHECK(hps_comm_all_reduce_dlpack(comm, &t, &r, HPS_REDUCE_SUM, NULL, &work) ==
        HPS_STATUS_INVALID_ARGUMENT);
  CHECK(HAS("send: data + byte_offset is not aligned to its 4-byte elements") && work == NULL);
  t.byte_offset = UINT64_MAX - 3;
  CHECK(hps_comm_all_reduce_dlpack(comm, &t, &r, HPS_REDUCE_SUM, NULL, &work) ==
        HPS_STATUS_INVALID_ARGUMENT);
  CHECK(HAS("wrap the address space") && work == NULL);
  t = host_f32(data, shape);
  shape[0] = 4;

  /* Each refusal leaves *out_work alone. */
  work = NULL;
  r.device.device_type = kDLCUDA;
  CHECK(hps_comm_all_reduce_dlpack(comm, &t, &r, HPS_REDUCE_SUM, NULL, &work) ==
        HPS_STATUS_INVALID_ARGUMENT);
  CHECK(HAS("recv is on cuda:0 but the operation runs on cpu:0") && work == NULL);
  r = host_f32(out, shape);
  r.dtype.lanes = 2;
  CHECK(hps_comm_all_reduce_dlpack(comm, &t, &r, HPS_REDUCE_SUM, NULL, &work) ==
        HPS_STATUS_INVALID_ARGUMENT);
  CHECK(HAS("lanes 2") && work == NULL);
  r = host_f32(out, shape);
  r.dtype.code = kDLInt;
  CHECK(hps_comm_all_reduce_dlpack(comm, &t, &r, HPS_REDUCE_SUM, NULL, &work) ==
        HPS_STATUS_INVALID_ARGUMENT);
  CHECK(HAS("send is float32 but recv is int32") && work == NULL);
  r = host_f32(out, shape2);
  r.ndim = 2;
  r.strides = strides; /* column-major: not compact row-major */
  CHECK(hps_comm_all_reduce_dlpack(comm, &t, &r, HPS_REDUCE_SUM, NULL, &work) ==
        HPS_STATUS_INVALID_ARGUMENT);
  CHECK(HAS("not contiguous") && work == NULL);
  r.strides = NULL; /* compact: fine shape-wise; 4 == 4 elements */
  CHECK_OK(finish(hps_comm_all_reduce_dlpack(comm, &t, &r, HPS_REDUCE_SUM, NULL, &work), &work));
  shape2[1] = 1;
  CHECK(hps_comm_all_reduce_dlpack(comm, &t, &r, HPS_REDUCE_SUM, NULL, &work) ==
        HPS_STATUS_INVALID_ARGUMENT);
  CHECK(HAS("send has 4 elements, recv 2") && work == NULL);
  shape2[1] = -1;
  CHECK(hps_comm_all_reduce_dlpack(comm, &t, &r, HPS_REDUCE_SUM, NULL, &work) ==
        HPS_STATUS_INVALID_ARGUMENT);
  CHECK(HAS("dimension 1 is -1") && work == NULL);
  shape2[1] = 2;
  r.data = NULL;
  CHECK(hps_comm_all_reduce_dlpack(comm, &t, &r, HPS_REDUCE_SUM, NULL, &work) ==
        HPS_STATUS_INVALID_ARGUMENT);
  CHECK(HAS("recv: data is NULL") && work == NULL);
  CHECK(hps_comm_all_reduce_dlpack(comm, &t, NULL, HPS_REDUCE_SUM, NULL, &work) ==
        HPS_STATUS_INVALID_ARGUMENT);
  CHECK(HAS("recv is NULL") && work == NULL);
  /* Hostile descriptions: rank, shape, sizes past 64 bits, a device hpshard has not. */
  r = host_f32(out, shape);
  r.ndim = 65;
  CHECK(hps_comm_all_reduce_dlpack(comm, &t, &r, HPS_REDUCE_SUM, NULL, &work) ==
        HPS_STATUS_INVALID_ARGUMENT);
  CHECK(HAS("recv: ndim 65 is outside 0..64") && work == NULL);
  r.ndim = -1;
  CHECK(hps_comm_all_reduce_dlpack(comm, &t, &r, HPS_REDUCE_SUM, NULL, &work) ==
        HPS_STATUS_INVALID_ARGUMENT);
  CHECK(HAS("ndim -1 is outside 0..64") && work == NULL);
  r.ndim = 2;
  r.shape = NULL;
  CHECK(hps_comm_all_reduce_dlpack(comm, &t, &r, HPS_REDUCE_SUM, NULL, &work) ==
        HPS_STATUS_INVALID_ARGUMENT);
  CHECK(HAS("recv: shape is NULL") && work == NULL);
  {
    int64_t wide[3] = {(int64_t)1 << 40, (int64_t)1 << 40, (int64_t)1 << 40};
    int64_t long_one[1] = {(int64_t)1 << 62};
    r = host_f32(out, wide);
    r.ndim = 3;
    CHECK(hps_comm_all_reduce_dlpack(comm, &t, &r, HPS_REDUCE_SUM, NULL, &work) ==
          HPS_STATUS_INVALID_ARGUMENT);
    CHECK(HAS("recv: the element count overflows 64 bits") && work == NULL);
    r = host_f32(out, long_one); /* 2^62 float32 elements: 2^64 bytes */
    CHECK(hps_comm_all_reduce_dlpack(comm, &t, &r, HPS_REDUCE_SUM, NULL, &work) ==
          HPS_STATUS_INVALID_ARGUMENT);
    CHECK(HAS("recv: the size in bytes overflows 64 bits") && work == NULL);
  }
  {
    /* 3 * 2^62 elements fit 64 bits unsigned, not signed: the compact strides' products must
     * not overflow on the way to the byte-size refusal (the sanitizer build checks that). */
    int64_t big[3] = {(int64_t)1 << 31, (int64_t)1 << 31, 3};
    int64_t compact[3] = {(int64_t)3 << 31, 3, 1}, negative[3] = {-1, 3, 1};
    r = host_f32(out, big);
    r.ndim = 3;
    r.strides = compact;
    CHECK(hps_comm_all_reduce_dlpack(comm, &t, &r, HPS_REDUCE_SUM, NULL, &work) ==
          HPS_STATUS_INVALID_ARGUMENT);
    CHECK(HAS("recv: the size in bytes overflows 64 bits") && work == NULL);
    r.strides = negative;
    CHECK(hps_comm_all_reduce_dlpack(comm, &t, &r, HPS_REDUCE_SUM, NULL, &work) ==
          HPS_STATUS_INVALID_ARGUMENT);
    CHECK(HAS("recv: not contiguous (dimension 0 has stride -1") && work == NULL);
  }
  r = host_f32(out, shape);
  r.device.device_type = kDLROCM;
  CHECK(hps_comm_all_reduce_dlpack(comm, &t, &r, HPS_REDUCE_SUM, NULL, &work) ==
        HPS_STATUS_INVALID_ARGUMENT);
  CHECK(HAS("no device for DLPack device dlpack-device-type-10") && work == NULL);
  {
    /* A device type no DLDeviceType names: its bytes are read, not the enum (the sanitizer
     * build checks that), and it is refused naming the number. */
    const int32_t unknown = 99;
    r = host_f32(out, shape);
    memcpy(&r.device.device_type, &unknown, sizeof unknown);
    CHECK(hps_comm_all_reduce_dlpack(comm, &t, &r, HPS_REDUCE_SUM, NULL, &work) ==
          HPS_STATUS_INVALID_ARGUMENT);
    CHECK(HAS("no device for DLPack device dlpack-device-type-99") && work == NULL);
    CHECK(hps_dlpack_host_data(&r, &host) == HPS_STATUS_FAILED_PRECONDITION);
    CHECK(HAS("dlpack-device-type-99"));
  }
  {
    /* Explicit compact row-major strides are taken like NULL ones. */
    int64_t square[2] = {2, 2}, row_major[2] = {2, 1};
    r = host_f32(out, square);
    r.ndim = 2;
    r.strides = row_major;
    CHECK_OK(finish(hps_comm_all_reduce_dlpack(comm, &t, &r, HPS_REDUCE_SUM, NULL, &work), &work));
    CHECK(out[0] == 1 && out[3] == 4);
  }
  r = host_f32(out, shape);
  CHECK(hps_comm_all_reduce_dlpack(comm, &t, &r, (hps_reduce_op_t)99, NULL, &work) ==
        HPS_STATUS_INVALID_ARGUMENT);
  CHECK(work == NULL);
  /* all_gather needs size x send in recv; reduce_scatter size x recv in send. */
  shape2[0] = 1;
  shape2[1] = 3;
  r = host_f32(out, shape2);
  r.ndim = 2;
  CHECK(hps_comm_all_gather_dlpack(comm, &t, &r, NULL, &work) == HPS_STATUS_INVALID_ARGUMENT);
  CHECK(HAS("recv holds 3 elements but needs 4") && work == NULL);
  CHECK(hps_comm_reduce_scatter_dlpack(comm, &r, &t, HPS_REDUCE_SUM, NULL, &work) ==
        HPS_STATUS_INVALID_ARGUMENT);
  CHECK(HAS("send holds 3 elements but needs 4") && work == NULL);

  CHECK_OK(hps_comm_destroy(comm));
  CHECK_OK(hps_store_destroy(store));
}

/* ---- collectives and the clip over two thread-ranks -------------------------------------- */

typedef struct {
  int rank;
} rank_args_t;

static void* rank_main(void* arg) {
  const int rank = ((const rank_args_t*)arg)->rank;
  hps_store_t* store = NULL;
  hps_comm_t* comm = NULL;
  hps_work_t* work = NULL;
  hps_clip_t* clip = NULL;
  hps_stream_t* stream = NULL;
  DLManagedTensor* coef = NULL;
  float in[4], out[4], gathered[8], scattered[2], grad[2], norm = 0;
  int64_t four[1] = {4}, eight[1] = {8}, two[1] = {2};
  DLTensor t_in, t_out, t_gathered, t_scattered, t_grad;
  void* host = NULL;
  int i;

  CHECK_OK(hps_store_open("memory://dlpack-ranks", rank, 10000, &store));
  CHECK_OK(hps_comm_create(store, rank, 2, HPS_DEVICE_CPU, 0, NULL, &comm));
  if (comm == NULL) return NULL;
  for (i = 0; i < 4; ++i) in[i] = (float)(10 * rank + i);
  t_in = host_f32(in, four);
  t_out = host_f32(out, four);
  t_gathered = host_f32(gathered, eight);
  t_scattered = host_f32(scattered, two);

  CHECK_OK(
      finish(hps_comm_all_reduce_dlpack(comm, &t_in, &t_out, HPS_REDUCE_SUM, NULL, &work), &work));
  for (i = 0; i < 4; ++i) CHECK(out[i] == (float)(10 + 2 * i));
  memset(out, 0, sizeof out);
  CHECK_OK(finish(hps_comm_reduce_dlpack(comm, &t_in, rank == 1 ? &t_out : NULL, HPS_REDUCE_MAX, 1,
                                         NULL, &work),
                  &work));
  if (rank == 1) {
    for (i = 0; i < 4; ++i) CHECK(out[i] == (float)(10 + i));
  }
  CHECK_OK(finish(hps_comm_all_gather_dlpack(comm, &t_in, &t_gathered, NULL, &work), &work));
  for (i = 0; i < 8; ++i) CHECK(gathered[i] == (float)(10 * (i / 4) + i % 4));
  CHECK_OK(
      finish(hps_comm_reduce_scatter_dlpack(comm, &t_in, &t_scattered, HPS_REDUCE_SUM, NULL, &work),
             &work));
  for (i = 0; i < 2; ++i) CHECK(scattered[i] == (float)(10 + 2 * (2 * rank + i)));
  for (i = 0; i < 4; ++i) out[i] = (float)(rank == 0 ? 7 : 0);
  CHECK_OK(finish(hps_comm_broadcast_dlpack(comm, &t_out, 0, NULL, &work), &work));
  for (i = 0; i < 4; ++i) CHECK(out[i] == 7.0f);
  if (rank == 0) {
    CHECK_OK(finish(hps_comm_send_dlpack(comm, &t_in, 1, NULL, &work), &work));
  } else {
    CHECK_OK(finish(hps_comm_recv_dlpack(comm, &t_out, 0, NULL, &work), &work));
    for (i = 0; i < 4; ++i) CHECK(out[i] == (float)i);
  }

  /* The clip over DLPack gradients: (3, 4) on rank 0 and (0, 0) on rank 1 summed over the
   * sharding group: norm 5, both scaled by 1 / 5; the coefficient as a view. */
  grad[0] = rank == 0 ? 3.0f : 0.0f;
  grad[1] = rank == 0 ? 4.0f : 0.0f;
  t_grad = host_f32(grad, two);
  CHECK_OK(hps_clip_create(comm, NULL, NULL, NULL, &clip));
  CHECK_OK(hps_stream_create(HPS_DEVICE_CPU, 0, &stream));
  if (clip != NULL && stream != NULL) {
    t_grad.device.device_type = kDLCUDA;
    CHECK(hps_clip_add_tensor_dlpack(clip, &t_grad, 0) == HPS_STATUS_INVALID_ARGUMENT);
    CHECK(HAS("gradient is on cuda:0"));
    t_grad.device.device_type = kDLCPU;
    CHECK(hps_clip_add_tensor_dlpack(clip, &t_grad, 64) == HPS_STATUS_INVALID_ARGUMENT);
    CHECK(HAS("unknown clip flag bits 0x40"));
    CHECK_OK(hps_clip_add_tensor_dlpack(clip, &t_grad, 0));
    CHECK_OK(hps_clip_seal(clip));
    CHECK_OK(hps_clip_run(clip, stream, &norm, 1));
    CHECK_OK(hps_stream_synchronize(stream));
    CHECK(norm > 4.9999f && norm < 5.0001f);
    CHECK_OK(hps_clip_coefficient_dlpack(clip, &coef));
    CHECK_OK(hps_clip_destroy(clip));
    if (coef != NULL) {
      CHECK(coef->dl_tensor.ndim == 1 && coef->dl_tensor.shape[0] == 1);
      CHECK_OK(hps_dlpack_host_data(&coef->dl_tensor, &host));
      CHECK(host != NULL && *(const float*)host > 0.19999f && *(const float*)host < 0.20001f);
      CHECK_OK(hps_dlpack_release(coef));
    }
    if (rank == 0) CHECK(grad[0] > 0.5999f && grad[0] < 0.6001f);

    /* Without communicators the first DLPack gradient places the clip: a CUDA gradient is
     * kept where this process has that device (its run must be on its device; a CPU one
     * beside it and a run on a CPU stream are refused, and nothing reads the CUDA address),
     * and refused where it has none, leaving the clip free for CPU gradients. The
     * coefficient waits for seal. */
    CHECK_OK(hps_clip_create(NULL, NULL, NULL, NULL, &clip));
    if (clip != NULL) {
      const float* c = NULL;
      int32_t gpus = 0;
      CHECK_OK(hps_device_count(HPS_DEVICE_CUDA, &gpus));
      CHECK(hps_clip_coefficient(clip, &c) == HPS_STATUS_FAILED_PRECONDITION);
      CHECK(HAS("not sealed"));
      t_grad.device.device_type = kDLCUDA;
      t_grad.data = (void*)(uintptr_t)0x1000;
      if (gpus > 0) {
        CHECK_OK(hps_clip_add_tensor_dlpack(clip, &t_grad, 0));
        t_grad.device.device_type = kDLCPU;
        t_grad.data = grad;
        CHECK(hps_clip_add_tensor_dlpack(clip, &t_grad, 0) == HPS_STATUS_INVALID_ARGUMENT);
        CHECK(HAS("gradient is on cpu"));
        CHECK_OK(hps_clip_seal(clip));
        CHECK_OK(hps_clip_coefficient(clip, &c));
        CHECK(c != NULL && *c == 1.0f);
        CHECK(hps_clip_run(clip, stream, &norm, 1) == HPS_STATUS_INVALID_ARGUMENT);
        CHECK(HAS("the stream is on cpu but the clip's gradients are on cuda:0"));
      } else {
        CHECK(hps_clip_add_tensor_dlpack(clip, &t_grad, 0) == HPS_STATUS_OUT_OF_RANGE);
        CHECK(HAS("gradient: device cuda:0 does not exist"));
        t_grad.device.device_type = kDLCPU;
        t_grad.data = grad;
        grad[0] = 3.0f;
        grad[1] = 4.0f;
        CHECK_OK(hps_clip_add_tensor_dlpack(clip, &t_grad, 0));
        CHECK_OK(hps_clip_seal(clip));
        CHECK_OK(hps_clip_run(clip, stream, &norm, 1));
        CHECK(norm == 5.0f);
      }
      CHECK_OK(hps_clip_destroy(clip));
    }
  }
  CHECK_OK(hps_stream_destroy(stream));
  CHECK_OK(hps_comm_destroy(comm));
  CHECK_OK(hps_store_destroy(store));
  return NULL;
}

/* ---- views keep memory, not the groups ---------------------------------------------------- */

/* A view outlives its handle's groups: rank 1 keeps views of an engine (kind 0: stage 2 with
 * clipping, its parameter, loss-scale and norm views; kind 1: stage 3, a gathered unit's
 * parameters) or of a clip (kind 2: its coefficient), then destroys the handle and its
 * communicator. Rank 0's next collective learns at once that rank 1 has gone (ABORTED),
 * not at its timeout, and rank 1's views still read their values. Kind 3: a checkpoint
 * handle keeps the whole engine (it saves after hps_engine_destroy); the groups go with
 * the checkpoint handle. */
typedef struct {
  int rank;
  int kind;
} views_args_t;

static pthread_mutex_t g_left_mutex = PTHREAD_MUTEX_INITIALIZER;
static pthread_cond_t g_left_cond = PTHREAD_COND_INITIALIZER;
static int g_left = 0; /* 1: rank 1 destroyed its handles; 2: rank 0 has checked */
static char g_views_root[64];

static void set_left(int value) {
  pthread_mutex_lock(&g_left_mutex);
  g_left = value;
  pthread_cond_broadcast(&g_left_cond);
  pthread_mutex_unlock(&g_left_mutex);
}

static void wait_left(int value) {
  pthread_mutex_lock(&g_left_mutex);
  while (g_left < value) pthread_cond_wait(&g_left_cond, &g_left_mutex);
  pthread_mutex_unlock(&g_left_mutex);
}

/* A collective save through `ckpt` (NULL: none), then its destruction. */
static void save_and_destroy(hps_checkpoint_t* ckpt) {
  hps_work_t* work = NULL;
  if (ckpt == NULL) return;
  CHECK_OK(hps_checkpoint_save(ckpt, "after-destroy", NULL, NULL, 0, &work));
  CHECK_OK(hps_work_wait(work));
  hps_work_destroy(work);
  CHECK_OK(hps_checkpoint_destroy(ckpt));
}

static void* views_rank(void* arg) {
  const views_args_t* a = (const views_args_t*)arg;
  char address[64];
  hps_store_t* store = NULL;
  hps_comm_t* comm = NULL;
  hps_comm_options_t co;
  hps_engine_t* engine = NULL;
  hps_clip_t* clip = NULL;
  hps_stream_t* stream = NULL;
  hps_work_t* work = NULL;
  hps_checkpoint_t* ckpt = NULL;
  DLManagedTensor* views[3] = {NULL, NULL, NULL};
  const int64_t shape[1] = {4};
  int64_t two[1] = {2};
  float grad[2] = {3.0f, 4.0f}, norm = 0, x = 1, y = 0;
  DLTensor t_grad;
  size_t index = 0;
  int i;

  snprintf(address, sizeof address, "memory://dlpack-views-go-%d", a->kind);
  CHECK_OK(hps_store_open(address, a->rank, 10000, &store));
  CHECK_OK(hps_comm_options_init(&co, sizeof co));
  co.timeout_ms = 8000;
  CHECK_OK(hps_comm_create(store, a->rank, 2, HPS_DEVICE_CPU, 0, &co, &comm));
  if (comm == NULL) return NULL;
  if (a->kind != 2) {
    hps_engine_options_t o;
    float* g = NULL;
    CHECK_OK(hps_engine_options_init(&o, sizeof o));
    o.stage = a->kind == 1 ? 3 : 2;
    o.clip_max_norm = a->kind == 0 ? 1.0 : 0.0;
    CHECK_OK(hps_engine_create(comm, NULL, &o, &engine));
    if (engine == NULL) return NULL;
    CHECK_OK(hps_engine_add_param(engine, "w", shape, 1, HPS_DTYPE_FLOAT32, 0, 0, &index));
    CHECK_OK(hps_engine_seal(engine));
    CHECK_OK(hps_engine_broadcast_parameters(engine));
    CHECK_OK(hps_engine_wait_parameters(engine, 0));
    CHECK_OK(hps_engine_grad(engine, 0, (void**)&g));
    for (i = 0; g != NULL && i < 4; ++i) g[i] = 1.0f;
    CHECK_OK(hps_engine_grad_ready(engine, 0, NULL));
    CHECK_OK(hps_engine_release_parameters(engine, 0));
    CHECK_OK(hps_engine_step(engine));
    CHECK_OK(hps_engine_wait_parameters(engine, 0));
    if (a->kind == 3) CHECK_OK(hps_checkpoint_create(engine, comm, g_views_root, NULL, &ckpt));
    if (a->rank == 1) {
      CHECK_OK(hps_engine_param_dlpack(engine, 0, &views[0]));
      if (a->kind == 0) {
        CHECK_OK(hps_engine_loss_scale_dlpack(engine, &views[1], &views[2]));
        CHECK_OK(hps_dlpack_release(views[2]));
        CHECK_OK(hps_engine_grad_norm_dlpack(engine, &views[2]));
      }
    }
  } else {
    t_grad = host_f32(grad, two);
    CHECK_OK(hps_clip_create(comm, NULL, NULL, NULL, &clip));
    CHECK_OK(hps_stream_create(HPS_DEVICE_CPU, 0, &stream));
    CHECK_OK(hps_clip_add_tensor_dlpack(clip, &t_grad, 0));
    CHECK_OK(hps_clip_seal(clip));
    CHECK_OK(hps_clip_run(clip, stream, &norm, 1));
    CHECK_OK(hps_stream_synchronize(stream));
    if (a->rank == 1) CHECK_OK(hps_clip_coefficient_dlpack(clip, &views[0]));
  }

  if (a->rank == 1) {
    CHECK_OK(hps_engine_destroy(engine));
    save_and_destroy(ckpt);
    CHECK_OK(hps_clip_destroy(clip));
    CHECK_OK(hps_comm_destroy(comm));
    set_left(1);
    wait_left(2);
    /* The views still read what the last step left: the parameter 0 - 0.01 x the (clipped)
     * mean gradient (SGD's default rate), the loss scale 1, the norm 2, the coefficient. */
    if (views[0] != NULL && a->kind != 2) {
      const float* p = (const float*)views[0]->dl_tensor.data;
      const float expected = a->kind == 0 ? -0.005f : -0.01f; /* clipped by 1 / 2, or not */
      CHECK(p[0] == p[3] && p[0] > expected - 1e-6f && p[0] < expected + 1e-6f);
    }
    if (views[1] != NULL) CHECK(*(const float*)views[1]->dl_tensor.data == 1.0f);
    if (views[2] != NULL) CHECK(*(const float*)views[2]->dl_tensor.data == 2.0f);
    if (views[0] != NULL && a->kind == 2) {
      const float c = *(const float*)views[0]->dl_tensor.data;
      CHECK(c > 0.1413f && c < 0.1415f); /* 1 / sqrt(2 * 25) */
    }
    for (i = 0; i < 3; ++i) CHECK_OK(hps_dlpack_release(views[i]));
  } else {
    hps_status_t s;
    save_and_destroy(ckpt);
    wait_left(1);
    /* Rank 1's communicator is gone with its handles: ABORTED at once, not TIMEOUT. */
    s = hps_comm_all_reduce(comm, &x, &y, 1, HPS_DTYPE_FLOAT32, HPS_REDUCE_SUM, NULL, &work);
    if (s == HPS_STATUS_OK) {
      s = hps_work_wait(work);
      hps_work_destroy(work);
    }
    CHECK(s == HPS_STATUS_ABORTED);
    set_left(2);
    CHECK_OK(hps_engine_destroy(engine));
    CHECK_OK(hps_clip_destroy(clip));
    CHECK_OK(hps_comm_destroy(comm));
  }
  CHECK_OK(hps_stream_destroy(stream));
  CHECK_OK(hps_store_destroy(store));
  return NULL;
}

static void views_let_the_groups_go(void) {
  int kind, r;
  snprintf(g_views_root, sizeof g_views_root, "/tmp/hps-dlpack-views-XXXXXX");
  CHECK(mkdtemp(g_views_root) != NULL);
  for (kind = 0; kind < 4; ++kind) {
    pthread_t threads[2];
    views_args_t args[2];
    set_left(0);
    for (r = 0; r < 2; ++r) {
      args[r].rank = r;
      args[r].kind = kind;
      pthread_create(&threads[r], NULL, views_rank, &args[r]);
    }
    for (r = 0; r < 2; ++r) pthread_join(threads[r], NULL);
  }
  {
    char cmd[128];
    snprintf(cmd, sizeof cmd, "rm -rf '%s'", g_views_root);
    if (system(cmd) != 0) fprintf(stderr, "could not remove %s\n", g_views_root);
  }
}

int main(void) {
  pthread_t threads[2];
  rank_args_t args[2];
  int r;
  engine_views();
  stage3_views();
  policy_and_refusals();
  for (r = 0; r < 2; ++r) {
    args[r].rank = r;
    pthread_create(&threads[r], NULL, rank_main, &args[r]);
  }
  for (r = 0; r < 2; ++r) pthread_join(threads[r], NULL);
  views_let_the_groups_go();
  if (check_summary() != 0) return 1;
  printf("dlpack: views, policy, refusals and collectives as documented\n");
  return 0;
}
