// Link credit bookkeeping. See link_credits.hpp.
#include "topology/link_credits.hpp"

#include <algorithm>

namespace troupe::topology {

std::vector<link_key> incoming_credits::start(const std::vector<link_key>& consumption, int k) {
  links_.clear();
  for (const auto& key : consumption) links_[link_of(key)].order.push_back(key);
  std::vector<link_key> grants;
  for (auto& [id, link] : links_) {
    const std::size_t n = std::min(link.order.size(), static_cast<std::size_t>(std::max(k, 1)));
    for (std::size_t i = 0; i < n; ++i) grants.push_back(link.order[i]);
    link.next_grant = n;
  }
  return grants;
}

std::optional<link_key> incoming_credits::consumed(const link_key& key) {
  auto it = links_.find(link_of(key));
  if (it == links_.end()) return std::nullopt;
  auto& link = it->second;
  if (link.next_grant >= link.order.size()) return std::nullopt;
  return link.order[link.next_grant++];
}

bool outgoing_credits::produced(const link_key& key) {
  if (credits_.erase(key)) return true;
  waiting_.insert(key);
  return false;
}

bool outgoing_credits::granted(const link_key& key) {
  if (waiting_.erase(key)) return true;
  credits_.insert(key);
  return false;
}

}  // namespace troupe::topology
