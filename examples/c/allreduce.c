/* A multi-rank job through the C API: every rank learns its place from the environment
 * (hpshard-run, torchrun, Open MPI or Slurm), meets the others through the store, builds
 * the hybrid group of a dp x sharding topology and reduces over each group without the
 * host blocking until it asks for the result.
 *
 *   hpshard-run -n 4 -- hpshard_allreduce_c          # dp2 x sharding2
 */
#include <stdio.h>
#include <stdlib.h>

#include "hpshard/hpshard.h"

#define TRY(call)                                                          \
  do {                                                                     \
    hps_status_t s_ = (call);                                              \
    if (s_ != HPS_STATUS_OK) {                                             \
      fprintf(stderr, "%s failed: %s: %s\n", #call, hps_status_string(s_), \
              hps_last_error_message());                                   \
      return 1;                                                            \
    }                                                                      \
  } while (0)

int main(void) {
  hps_rendezvous_info_t info;
  hps_store_t* store = NULL;
  hps_comm_t *world = NULL, *sharding = NULL, *dp = NULL;
  hps_topology_t* topology = NULL;
  hps_hybrid_group_t* groups = NULL;
  hps_work_t *w_world = NULL, *w_sharding = NULL, *w_dp = NULL;
  float mine[4], world_sum[4], sharding_sum[4], dp_sum[4];
  uint64_t syncs_before = 0;
  int32_t dp_degree, i, coordinate_dp = 0, coordinate_sharding = 0;

  TRY(hps_rendezvous_info_init(&info, sizeof info));
  TRY(hps_rendezvous_from_env(&info));
  TRY(hps_store_open(info.store_url, info.rank, 60000, &store));
  TRY(hps_comm_create(store, info.rank, info.world_size, HPS_DEVICE_CPU, 0, NULL, &world));
  dp_degree = info.world_size % 2 == 0 ? 2 : 1;
  TRY(hps_topology_create(dp_degree, 1, info.world_size / dp_degree, 1, 1, NULL, info.world_size,
                          &topology));
  TRY(hps_hybrid_group_create(world, topology, &groups));
  TRY(hps_hybrid_group_comm(groups, HPS_GROUP_SHARDING, &sharding));
  TRY(hps_hybrid_group_comm(groups, HPS_GROUP_DP, &dp));
  TRY(hps_topology_coordinate(topology, info.rank, HPS_GROUP_DP, &coordinate_dp));
  TRY(hps_topology_coordinate(topology, info.rank, HPS_GROUP_SHARDING, &coordinate_sharding));

  for (i = 0; i < 4; ++i) mine[i] = (float)(info.rank + 1);
  TRY(hps_host_sync_reset());
  /* Three reductions in flight at once, each on its own communicator's stream. */
  TRY(hps_comm_all_reduce(world, mine, world_sum, 4, HPS_DTYPE_FLOAT32, HPS_REDUCE_SUM, NULL,
                          &w_world));
  TRY(hps_comm_all_reduce(sharding, mine, sharding_sum, 4, HPS_DTYPE_FLOAT32, HPS_REDUCE_SUM, NULL,
                          &w_sharding));
  TRY(hps_comm_all_reduce(dp, mine, dp_sum, 4, HPS_DTYPE_FLOAT32, HPS_REDUCE_MAX, NULL, &w_dp));
  TRY(hps_host_sync_count_thread(&syncs_before));
  TRY(hps_work_wait(w_world));
  TRY(hps_work_wait(w_sharding));
  TRY(hps_work_wait(w_dp));
  printf(
      "rank %d of %d (%s): dp %d, sharding %d: world sum %.0f, sharding sum %.0f, "
      "dp max %.0f; host syncs before waiting: %llu\n",
      (int)info.rank, (int)info.world_size, info.source, (int)coordinate_dp,
      (int)coordinate_sharding, world_sum[0], sharding_sum[0], dp_sum[0],
      (unsigned long long)syncs_before);

  hps_work_destroy(w_world);
  hps_work_destroy(w_sharding);
  hps_work_destroy(w_dp);
  hps_comm_destroy(dp);
  hps_comm_destroy(sharding);
  hps_hybrid_group_destroy(groups);
  hps_topology_destroy(topology);
  hps_comm_destroy(world);
  hps_store_destroy(store);
  return 0;
}
