// ZeRO shard arithmetic. See zero.hpp.
#include "engine/parallel/zero.hpp"

#include <sys/mman.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <algorithm>
#include <cstring>
#include <stdexcept>
#include <string>

#include "kernels/cpu_ops.hpp"

namespace troupe::engine {

bucket_shard make_bucket_shard(const chunk_range& range, const std::vector<parameter_info>& layout,
                               int chunk, std::vector<std::pair<std::int64_t, std::int64_t>> ranges,
                               int replica, int replicas, std::int64_t at, tensor_shard tp) {
  bucket_shard b;
  b.chunk = chunk;
  b.ranges = std::move(ranges);
  for (const auto& [offset, n] : b.ranges) b.numel += n;
  // ring_chunk_bounds(n, d, owned) of topology/collectives.hpp (engine does not include
  // topology): chunk c = [c*N/d, (c+1)*N/d).
  const int owned = (replica + 1) % replicas;
  b.begin = b.numel * owned / replicas;
  b.end = b.numel * (owned + 1) / replicas;
  b.at = at;
  const bool tied_copy = range.head && !range.embedding;
  // Walk the concatenation: position `pos` of the bucket is flat offset range.first + k. Ranges
  // and parameters are in increasing offset order, so segments come out in `at` order.
  std::int64_t pos = 0;
  for (const auto& [offset, n] : b.ranges) {
    const std::int64_t lo = std::max(b.begin, pos), hi = std::min(b.end, pos + n);
    if (lo < hi) {
      const std::int64_t flat_lo = offset + (lo - pos), flat_hi = offset + (hi - pos);
      for (const auto& p : layout) {
        const std::int64_t s = std::max(flat_lo, p.offset),
                           e = std::min(flat_hi, p.offset + p.numel);
        if (s >= e) continue;
        shard_segment seg;
        seg.chunk = chunk;
        seg.offset = s;
        seg.numel = e - s;
        seg.at = at + (lo - b.begin) + (s - flat_lo);
        seg.decay = p.decay;
        seg.counted = !(tied_copy && p.name == "transformer.wte.weight") &&
                      !(tp.rank > 0 && p.split == tensor_split::replicated);
        b.segments.push_back(seg);
      }
    }
    pos += n;
  }
  return b;
}

double shard_square_sum(const bucket_shard& b, const shard_views& views) {
  double sum = 0;
  for (const auto& s : b.segments) {
    if (!s.counted) continue;
    const float* g = views.grad(s);
    for (std::int64_t i = 0; i < s.numel; ++i) sum += double(g[i]) * double(g[i]);
  }
  return sum;
}

double shard_adamw_step(const std::vector<bucket_shard>& shards, const shard_views& views, float* m,
                        float* v, const optimizer_config& c, int step, int total_steps,
                        double grad_norm, double unscale) {
  const double lr = learning_rate(c, step, total_steps);
  const double coef = clip_coefficient(grad_norm, c.grad_clip);
  const kernels::adamw_hparams hp = adamw_hparams_at(c, lr);
  for (const auto& b : shards) {
    for (const auto& s : b.segments) {
      float* g = views.grad(s);
      unscale_and_clip(g, s.numel, unscale, coef);
      kernels::adamw_update(views.param(s), g, m + s.at, v + s.at, s.numel, hp, step + 1, s.decay);
    }
  }
  return lr;
}

param_residency::changes param_residency::start(std::vector<std::vector<int>> plan, int prefetch) {
  if (prefetch < 0) throw std::invalid_argument("param_residency: prefetch must be >= 0");
  if (!refs_.empty()) throw std::logic_error("param_residency: started while buckets are held");
  uses_ = std::move(plan);
  prefetch_ = prefetch;
  issued_ = finished_ = 0;
  present_.clear();
  changes out;
  while (issued_ < uses() && issued_ <= prefetch_) issue(out);
  return out;
}

void param_residency::issue(changes& out) {
  for (int b : use(issued_))
    if (refs_[b]++ == 0) out.gather.push_back(b);
  ++issued_;
}

void param_residency::gathered(int bucket) {
  if (!refs_.count(bucket)) throw std::logic_error("param_residency: gathered a bucket not held");
  present_.insert(bucket);
}

bool param_residency::ready(int j) const {
  if (j >= issued_) return false;
  for (int b : use(j))
    if (!present_.count(b)) return false;
  return true;
}

param_residency::changes param_residency::finished(int j) {
  if (j != finished_ || j >= issued_)
    throw std::logic_error("param_residency: use " + std::to_string(j) + " finished out of order");
  changes out;
  ++finished_;
  if (issued_ < uses()) issue(out);
  for (int b : use(j)) {
    auto it = refs_.find(b);
    if (--it->second > 0) continue;
    refs_.erase(it);
    present_.erase(b);
    out.release.push_back(b);
  }
  return out;
}

model_state_bytes zero_formula(zero_stage zero, double psi, int n) {
  const double dn = n;
  switch (zero) {
    case zero_stage::none:
      return {4 * psi, 4 * psi, 8 * psi};
    case zero_stage::optimizer:
      return {4 * psi, 4 * psi, 8 * psi / dn};
    case zero_stage::gradients:
      return {4 * psi, 4 * psi / dn, 8 * psi / dn};
    case zero_stage::parameters:
      return {4 * psi / dn, 4 * psi / dn, 8 * psi / dn};
  }
  throw std::logic_error("zero_formula: unknown ZeRO stage");
}

namespace {
std::int64_t page_size() {
  static const std::int64_t p = ::sysconf(_SC_PAGESIZE);
  return p;
}
}  // namespace

void release_zeroed(float* data, std::int64_t n) {
  if (n <= 0) return;
  const auto begin = reinterpret_cast<std::uintptr_t>(data);
  const auto end = begin + static_cast<std::uintptr_t>(n) * sizeof(float);
  const auto page = static_cast<std::uintptr_t>(page_size());
  const std::uintptr_t lo = (begin + page - 1) / page * page, hi = end / page * page;
  if (lo >= hi) {
    std::memset(data, 0, static_cast<std::size_t>(n) * sizeof(float));
    return;
  }
  std::memset(data, 0, lo - begin);
  std::memset(reinterpret_cast<void*>(hi), 0, end - hi);
  // Private anonymous memory reads as zeros after MADV_DONTNEED; if the kernel refuses, zero it.
  if (::madvise(reinterpret_cast<void*>(lo), hi - lo, MADV_DONTNEED) != 0)
    std::memset(reinterpret_cast<void*>(lo), 0, hi - lo);
}

page_pool::page_pool(std::int64_t capacity_bytes) {
  // Blocks of a power of two pages, at most 512 per capacity: every mapping boundary a move
  // makes falls on a block boundary, so the pool and its ranges stay a bounded number of
  // mappings however ranges are released and acquired.
  const auto page = static_cast<std::size_t>(page_size());
  const std::size_t pages =
      static_cast<std::size_t>(std::max<std::int64_t>(capacity_bytes, 0)) / page;
  std::size_t block_pages = 1;
  while (block_pages * 512 < pages) block_pages *= 2;
  block_ = block_pages * page;
  slots_ = pages / block_pages;
  if (slots_ == 0) return;
  void* p = ::mmap(nullptr, slots_ * block_, PROT_READ | PROT_WRITE,
                   MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE, -1, 0);
  if (p == MAP_FAILED) {
    slots_ = 0;
    return;
  }
  region_ = static_cast<std::byte*>(p);
}

page_pool::~page_pool() {
  if (region_) ::munmap(region_, slots_ * block_);
}

std::int64_t page_pool::pooled_bytes() const {
  return static_cast<std::int64_t>(held_slots_ * block_);
}

// Moves the pages under [from, from + bytes) to `to`; `from` stays mapped and reads zeros. The
// system call itself, not mremap(): UCX's memory hooks (libucm) replace mremap() in processes
// that link UCX and drop its fifth argument, the new address.
bool page_pool::move(void* from, void* to, std::size_t bytes) {
  if (!can_move_) return false;
  const long moved = ::syscall(SYS_mremap, from, bytes, bytes,
                               MREMAP_MAYMOVE | MREMAP_FIXED | MREMAP_DONTUNMAP, to);
  if (moved == reinterpret_cast<long>(to)) return true;
  can_move_ = false;  // an older kernel, or a range that is not private anonymous memory
  return false;
}

// The whole blocks of [data, data + n) as [lo, hi) (lo == hi if none).
std::pair<std::uintptr_t, std::uintptr_t> page_pool::whole_blocks(const float* data,
                                                                  std::int64_t n) const {
  const auto begin = reinterpret_cast<std::uintptr_t>(data);
  const auto end = begin + static_cast<std::uintptr_t>(n) * sizeof(float);
  const std::uintptr_t lo = (begin + block_ - 1) / block_ * block_, hi = end / block_ * block_;
  return lo < hi ? std::pair{lo, hi} : std::pair{begin, begin};
}

void page_pool::release(float* data, std::int64_t n) {
  if (n <= 0) return;
  auto [lo, hi] = whole_blocks(data, n);
  if (lo == hi || region_ == nullptr) {
    release_zeroed(data, n);
    return;
  }
  const auto* first = reinterpret_cast<float*>(lo);
  const auto* last = reinterpret_cast<float*>(hi);
  release_zeroed(data, first - data);
  release_zeroed(const_cast<float*>(last), data + n - last);
  // Fill the free gaps of the region, first to last, then merge adjacent runs.
  std::vector<std::pair<std::size_t, std::size_t>> gaps;
  std::size_t at = 0;
  for (const auto& [start, len] : held_) {
    if (start > at) gaps.emplace_back(at, start - at);
    at = start + len;
  }
  if (at < slots_) gaps.emplace_back(at, slots_ - at);
  for (const auto& [start, len] : gaps) {
    if (lo >= hi) break;
    const std::size_t m = std::min<std::size_t>(len, (hi - lo) / block_);
    if (!move(reinterpret_cast<void*>(lo), region_ + start * block_, m * block_)) break;
    held_.emplace(start, m);
    held_slots_ += m;
    lo += m * block_;
  }
  for (auto it = held_.begin(); it != held_.end();) {
    auto after = std::next(it);
    if (after != held_.end() && it->first + it->second == after->first) {
      it->second += after->second;
      held_.erase(after);
    } else {
      it = after;
    }
  }
  if (lo < hi && ::madvise(reinterpret_cast<void*>(lo), hi - lo, MADV_DONTNEED) != 0)
    std::memset(reinterpret_cast<void*>(lo), 0, hi - lo);
}

void page_pool::acquire(float* data, std::int64_t n) {
  if (n <= 0 || held_.empty()) return;
  auto [lo, hi] = whole_blocks(data, n);
  // Take from the last run, from its end, so the region's front stays filled.
  while (lo < hi && !held_.empty()) {
    auto run = std::prev(held_.end());
    const std::size_t m = std::min<std::size_t>(run->second, (hi - lo) / block_);
    const std::size_t from = run->first + run->second - m;
    if (!move(region_ + from * block_, reinterpret_cast<void*>(lo), m * block_)) return;
    run->second -= m;
    if (run->second == 0) held_.erase(run);
    held_slots_ -= m;
    lo += m * block_;
  }
}

std::int64_t resident_bytes(const void* data, std::int64_t n) {
  if (n <= 0) return 0;
  const auto page = static_cast<std::uintptr_t>(page_size());
  const auto begin = reinterpret_cast<std::uintptr_t>(data) / page * page;
  const auto end = reinterpret_cast<std::uintptr_t>(data) + static_cast<std::uintptr_t>(n);
  const std::size_t pages = (end - begin + page - 1) / page;
  std::vector<unsigned char> vec(pages);
  if (::mincore(reinterpret_cast<void*>(begin), end - begin, vec.data()) != 0) return n;
  std::int64_t resident = 0;
  for (unsigned char c : vec) resident += (c & 1) ? static_cast<std::int64_t>(page) : 0;
  return resident;
}

}  // namespace troupe::engine
