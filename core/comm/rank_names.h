// How messages name the ranks of a group. A group split from another (a hybrid topology's
// 'dp', 'sharding', ...) numbers its ranks from 0 again, so its rank 0 may be the process
// the job and its launcher call rank 2: a message about a peer of such a group names both,
// "rank 0 (world rank 2)". A group whose numbers are the job's names it "rank 2".
#pragma once

#include <cstdint>
#include <string>
#include <string_view>
#include <vector>

namespace hps {

class RankNames {
 public:
  // The group's numbers are the world's.
  RankNames() = default;
  // world[r]: the world rank of the group's rank r (empty: the group's numbers are the
  // world's).
  explicit RankNames(std::vector<int32_t> world);

  // "rank 2", or "rank 0 (world rank 2)" where the numbers differ; `more` goes into the
  // parenthesis: "rank 2 (process 77 on this host)", "rank 0 (world rank 2, process 77 on
  // this host)". A rank outside the map is named by its group number alone.
  std::string operator()(int32_t rank, std::string_view more = {}) const;
  // Several: "rank 2", "ranks 2, 5", or each named where a number differs: "rank 0 (world
  // rank 2), rank 1 (world rank 5)"; empty for none.
  std::string list(const std::vector<int32_t>& ranks) const;
  // The world ranks of this group's `ranks`: the map of a group split from it with them.
  std::vector<int32_t> world_of(const std::vector<int32_t>& ranks) const;

 private:
  std::vector<int32_t> world_;
};

}  // namespace hps
