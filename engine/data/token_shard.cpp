// Token shard writer (atomic: tmp + fsync + rename) and validating mmap reader.
// Invariant: a token_shard that constructed successfully maps a file whose header and size
// agree exactly, so tokens() never reads past the mapping.
#include "engine/data/token_shard.hpp"

#include <fcntl.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include <array>
#include <bit>
#include <cerrno>
#include <cstring>
#include <limits>
#include <stdexcept>
#include <utility>

namespace troupe::engine::data {

static_assert(std::endian::native == std::endian::little,
              "token shards are little-endian and are mapped in place");

namespace {

[[noreturn]] void fail(const std::filesystem::path& path, const std::string& what) {
  throw std::runtime_error(path.string() + ": " + what);
}

std::string errno_text(int err) { return std::strerror(err); }

// Closes the descriptor on scope exit unless released.
struct fd_guard {
  int fd = -1;
  ~fd_guard() {
    if (fd >= 0) ::close(fd);
  }
};

void write_all(int fd, const void* data, std::size_t bytes, const std::filesystem::path& tmp) {
  const auto* p = static_cast<const char*>(data);
  while (bytes > 0) {
    const ssize_t n = ::write(fd, p, bytes);
    if (n < 0) {
      if (errno == EINTR) continue;
      fail(tmp, "write failed: " + errno_text(errno));
    }
    p += n;
    bytes -= static_cast<std::size_t>(n);
  }
}

std::int32_t read_le_i32(const unsigned char* p) {
  const std::uint32_t v =
      static_cast<std::uint32_t>(p[0]) | (static_cast<std::uint32_t>(p[1]) << 8) |
      (static_cast<std::uint32_t>(p[2]) << 16) | (static_cast<std::uint32_t>(p[3]) << 24);
  return static_cast<std::int32_t>(v);
}

void fsync_parent_dir(const std::filesystem::path& path) {
  std::filesystem::path dir = path.parent_path();
  if (dir.empty()) dir = ".";
  const int dfd = ::open(dir.c_str(), O_RDONLY | O_DIRECTORY | O_CLOEXEC);
  if (dfd < 0) return;  // best effort: the rename itself already happened
  (void)::fsync(dfd);
  ::close(dfd);
}

}  // namespace

void write_token_shard(const std::filesystem::path& path, std::span<const std::uint16_t> tokens) {
  if (tokens.size() > static_cast<std::size_t>(std::numeric_limits<std::int32_t>::max())) {
    fail(path, "cannot write " + std::to_string(tokens.size()) +
                   " tokens: the shard header holds at most 2147483647");
  }
  std::filesystem::path tmp = path;
  tmp += ".tmp";

  std::array<std::int32_t, shard_header_ints> header{};
  header[0] = shard_magic;
  header[1] = shard_version;
  header[2] = static_cast<std::int32_t>(tokens.size());

  try {
    fd_guard fd{::open(tmp.c_str(), O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0644)};
    if (fd.fd < 0) fail(tmp, "cannot create: " + errno_text(errno));
    write_all(fd.fd, header.data(), shard_header_bytes, tmp);
    write_all(fd.fd, tokens.data(), tokens.size_bytes(), tmp);
    if (::fsync(fd.fd) != 0) fail(tmp, "fsync failed: " + errno_text(errno));
    const int fd_value = std::exchange(fd.fd, -1);
    if (::close(fd_value) != 0) fail(tmp, "close failed: " + errno_text(errno));
    if (::rename(tmp.c_str(), path.c_str()) != 0) {
      fail(path, "cannot rename " + tmp.string() + " into place: " + errno_text(errno));
    }
  } catch (...) {
    ::unlink(tmp.c_str());
    throw;
  }
  fsync_parent_dir(path);
}

token_shard::token_shard(const std::filesystem::path& path) : path_(path) {
  fd_guard fd{::open(path.c_str(), O_RDONLY | O_CLOEXEC)};
  if (fd.fd < 0) fail(path, "cannot open token shard: " + errno_text(errno));
  struct stat st {};
  if (::fstat(fd.fd, &st) != 0) fail(path, "cannot stat: " + errno_text(errno));
  if (!S_ISREG(st.st_mode)) fail(path, "not a regular file");
  const auto file_bytes = static_cast<std::uint64_t>(st.st_size);
  if (file_bytes < shard_header_bytes) {
    fail(path, "truncated: file is " + std::to_string(file_bytes) +
                   " bytes, but the header alone is " + std::to_string(shard_header_bytes) +
                   " (not an llm.c token shard)");
  }

  void* map =
      ::mmap(nullptr, static_cast<std::size_t>(file_bytes), PROT_READ, MAP_SHARED, fd.fd, 0);
  if (map == MAP_FAILED) fail(path, "mmap failed: " + errno_text(errno));
  map_ = map;
  map_bytes_ = static_cast<std::size_t>(file_bytes);

  try {
    const auto* bytes = static_cast<const unsigned char*>(map_);
    const std::int32_t magic = read_le_i32(bytes + 0);
    const std::int32_t version = read_le_i32(bytes + 4);
    const std::int32_t ntokens = read_le_i32(bytes + 8);
    if (magic != shard_magic) {
      fail(path, "bad magic " + std::to_string(magic) + ", expected " +
                     std::to_string(shard_magic) + " (not an llm.c token shard)");
    }
    if (version != shard_version) {
      fail(path, "unsupported version " + std::to_string(version) + ", expected " +
                     std::to_string(shard_version) + " (uint16 tokens)");
    }
    if (ntokens < 0) fail(path, "negative token count " + std::to_string(ntokens) + " in header");
    const std::uint64_t expected =
        shard_header_bytes + static_cast<std::uint64_t>(ntokens) * sizeof(std::uint16_t);
    if (file_bytes != expected) {
      fail(path, std::string(file_bytes < expected ? "truncated" : "too long") + ": header says " +
                     std::to_string(ntokens) + " tokens, so the file should be " +
                     std::to_string(expected) + " bytes, but it is " + std::to_string(file_bytes));
    }
    tokens_ = reinterpret_cast<const std::uint16_t*>(bytes + shard_header_bytes);
    ntokens_ = ntokens;
  } catch (...) {
    release();
    throw;
  }
}

token_shard::~token_shard() { release(); }

token_shard::token_shard(token_shard&& other) noexcept
    : path_(std::move(other.path_)),
      map_(std::exchange(other.map_, nullptr)),
      map_bytes_(std::exchange(other.map_bytes_, 0)),
      tokens_(std::exchange(other.tokens_, nullptr)),
      ntokens_(std::exchange(other.ntokens_, 0)) {}

token_shard& token_shard::operator=(token_shard&& other) noexcept {
  if (this != &other) {
    release();
    path_ = std::move(other.path_);
    map_ = std::exchange(other.map_, nullptr);
    map_bytes_ = std::exchange(other.map_bytes_, 0);
    tokens_ = std::exchange(other.tokens_, nullptr);
    ntokens_ = std::exchange(other.ntokens_, 0);
  }
  return *this;
}

void token_shard::release() noexcept {
  if (map_ != nullptr) ::munmap(map_, map_bytes_);
  map_ = nullptr;
  map_bytes_ = 0;
  tokens_ = nullptr;
  ntokens_ = 0;
}

}  // namespace troupe::engine::data
