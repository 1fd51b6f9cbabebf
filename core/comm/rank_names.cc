#include "core/comm/rank_names.h"

#include <utility>

namespace hps {

RankNames::RankNames(std::vector<int32_t> world) : world_(std::move(world)) {}

std::string RankNames::operator()(int32_t rank, std::string_view more) const {
  std::string text = "rank " + std::to_string(rank);
  std::string inside;
  const bool mapped = rank >= 0 && static_cast<size_t>(rank) < world_.size();
  if (mapped && world_[static_cast<size_t>(rank)] != rank) {
    inside = "world rank " + std::to_string(world_[static_cast<size_t>(rank)]);
  }
  if (!more.empty()) {
    if (!inside.empty()) inside += ", ";
    inside += more;
  }
  if (!inside.empty()) text += " (" + inside + ")";
  return text;
}

std::string RankNames::list(const std::vector<int32_t>& ranks) const {
  bool plain = true;
  for (const int32_t r : ranks) plain = plain && (*this)(r) == "rank " + std::to_string(r);
  std::string text;
  for (const int32_t r : ranks) {
    if (!text.empty()) text += ", ";
    text += plain ? std::to_string(r) : (*this)(r);
  }
  if (plain && !ranks.empty()) text = (ranks.size() == 1 ? "rank " : "ranks ") + text;
  return text;
}

std::vector<int32_t> RankNames::world_of(const std::vector<int32_t>& ranks) const {
  std::vector<int32_t> world;
  world.reserve(ranks.size());
  for (const int32_t r : ranks) {
    const bool mapped = r >= 0 && static_cast<size_t>(r) < world_.size();
    world.push_back(mapped ? world_[static_cast<size_t>(r)] : r);
  }
  return world;
}

}  // namespace hps
