// llm.c / nanoGPT token shard: 256 little-endian int32 header {20240520, 1, ntokens, 0...}
// followed by ntokens little-endian uint16 tokens; file size is exactly 1024 + 2*ntokens.
// Writes are atomic (tmp file + fsync + rename); reads memory-map the file read-only and
// validate it fully, throwing one-line std::runtime_error messages that name the file.
#pragma once

#include <cstddef>
#include <cstdint>
#include <filesystem>
#include <span>
#include <string>

namespace troupe::engine::data {

inline constexpr std::int32_t shard_magic = 20240520;
inline constexpr std::int32_t shard_version = 1;
inline constexpr std::size_t shard_header_ints = 256;
inline constexpr std::size_t shard_header_bytes = shard_header_ints * sizeof(std::int32_t);

// Writes `tokens` as a shard at `path`, replacing any existing file atomically: the data goes
// to "<path>.tmp", is fsynced, then renamed over `path` (and the directory fsynced). On any
// error the temporary file is removed and `path` is left untouched.
void write_token_shard(const std::filesystem::path& path, std::span<const std::uint16_t> tokens);

// A validated, read-only memory mapping of one token shard. Move-only; unmaps on destruction.
class token_shard {
 public:
  explicit token_shard(const std::filesystem::path& path);
  ~token_shard();

  token_shard(token_shard&& other) noexcept;
  token_shard& operator=(token_shard&& other) noexcept;
  token_shard(const token_shard&) = delete;
  token_shard& operator=(const token_shard&) = delete;

  std::int64_t size() const { return ntokens_; }
  std::span<const std::uint16_t> tokens() const {
    return {tokens_, static_cast<std::size_t>(ntokens_)};
  }
  const std::filesystem::path& path() const { return path_; }

 private:
  void release() noexcept;

  std::filesystem::path path_;
  void* map_ = nullptr;
  std::size_t map_bytes_ = 0;
  const std::uint16_t* tokens_ = nullptr;
  std::int64_t ntokens_ = 0;
};

}  // namespace troupe::engine::data
