// Safetensors reader (mmap, validated) and atomic writer. See safetensors.hpp.
#include "engine/model/safetensors.hpp"

#include <fcntl.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include <xxhash.h>
#include <algorithm>
#include <cerrno>
#include <cstring>
#include <nlohmann/json.hpp>
#include <stdexcept>
#include <utility>

namespace troupe::engine {
namespace {

using json = nlohmann::json;

std::runtime_error file_error(const std::filesystem::path& path, const std::string& what) {
  return std::runtime_error(path.string() + ": " + what);
}

std::size_t safetensors_dtype_size(const std::string& dtype) {
  if (dtype == "F64" || dtype == "I64" || dtype == "U64") return 8;
  if (dtype == "F32" || dtype == "I32" || dtype == "U32") return 4;
  if (dtype == "F16" || dtype == "BF16" || dtype == "I16" || dtype == "U16") return 2;
  if (dtype == "I8" || dtype == "U8" || dtype == "BOOL") return 1;
  return 0;
}

}  // namespace

safetensors_file::safetensors_file(const std::filesystem::path& path) : path_(path) {
  const int fd = ::open(path.c_str(), O_RDONLY | O_CLOEXEC);
  if (fd < 0) throw file_error(path, std::string("cannot open: ") + std::strerror(errno));
  struct stat st {};
  if (::fstat(fd, &st) != 0) {
    ::close(fd);
    throw file_error(path, "cannot stat");
  }
  map_size_ = static_cast<std::size_t>(st.st_size);
  if (map_size_ < 8) {
    ::close(fd);
    throw file_error(path,
                     "too short for a safetensors file (" + std::to_string(map_size_) + " bytes)");
  }
  map_ = ::mmap(nullptr, map_size_, PROT_READ, MAP_PRIVATE, fd, 0);
  ::close(fd);
  if (map_ == MAP_FAILED) {
    map_ = nullptr;
    throw file_error(path, "cannot mmap");
  }
  try {
    const auto* bytes = static_cast<const std::byte*>(map_);
    std::uint64_t header_len = 0;
    std::memcpy(&header_len, bytes, 8);
    if (header_len > map_size_ - 8 || header_len > (100u << 20)) {
      throw file_error(path, "header length " + std::to_string(header_len) + " exceeds the file");
    }
    const char* header_begin = reinterpret_cast<const char*>(bytes + 8);
    json header;
    try {
      header = json::parse(header_begin, header_begin + header_len);
    } catch (const json::exception& e) {
      throw file_error(path, std::string("bad JSON header: ") + e.what());
    }
    if (!header.is_object()) throw file_error(path, "header is not a JSON object");
    const std::byte* data_begin = bytes + 8 + header_len;
    const std::size_t data_size = map_size_ - 8 - header_len;
    for (auto it = header.begin(); it != header.end(); ++it) {
      if (it.key() == "__metadata__") {
        if (it.value().is_object()) {
          for (auto m = it.value().begin(); m != it.value().end(); ++m) {
            if (m.value().is_string()) metadata_[m.key()] = m.value().get<std::string>();
          }
        }
        continue;
      }
      const std::string& name = it.key();
      const json& e = it.value();
      try {
        safetensors_entry entry;
        entry.name = name;
        entry.dtype = e.at("dtype").get<std::string>();
        entry.shape = e.at("shape").get<kernels::shape_t>();
        const auto offsets = e.at("data_offsets").get<std::vector<std::uint64_t>>();
        const std::size_t elem = safetensors_dtype_size(entry.dtype);
        if (elem == 0) throw file_error(path, "tensor " + name + ": unknown dtype " + entry.dtype);
        if (offsets.size() != 2 || offsets[0] > offsets[1] || offsets[1] > data_size) {
          throw file_error(path, "tensor " + name + ": data offsets outside the file");
        }
        entry.nbytes = offsets[1] - offsets[0];
        const auto numel = static_cast<std::size_t>(kernels::shape_numel(entry.shape));
        if (numel * elem != entry.nbytes) {
          throw file_error(path, "tensor " + name + ": " + std::to_string(entry.nbytes) +
                                     " bytes do not hold shape " +
                                     kernels::shape_string(entry.shape) + " of " + entry.dtype);
        }
        entry.data = data_begin + offsets[0];
        entries_.emplace(name, std::move(entry));
      } catch (const json::exception& ex) {
        throw file_error(path, "tensor " + name + ": bad header entry (" + ex.what() + ")");
      } catch (const std::invalid_argument& ex) {
        throw file_error(path, "tensor " + name + ": " + ex.what());
      }
    }
  } catch (...) {
    ::munmap(map_, map_size_);
    map_ = nullptr;
    throw;
  }
}

safetensors_file::~safetensors_file() {
  if (map_) ::munmap(map_, map_size_);
}

const safetensors_entry& safetensors_file::at(const std::string& name) const {
  auto it = entries_.find(name);
  if (it == entries_.end()) throw file_error(path_, "missing tensor " + name);
  return it->second;
}

kernels::tensor safetensors_file::read_f32(const std::string& name) const {
  const auto& e = at(name);
  kernels::tensor t = kernels::tensor::empty(e.shape);
  float* out = t.f32();
  const auto n = static_cast<std::size_t>(t.numel());
  if (e.dtype == "F32") {
    std::memcpy(out, e.data, n * 4);
  } else if (e.dtype == "BF16" || e.dtype == "F16") {
    const bool bf = e.dtype == "BF16";
    for (std::size_t i = 0; i < n; ++i) {
      std::uint16_t h;
      std::memcpy(&h, e.data + 2 * i, 2);
      out[i] = bf ? kernels::bf16_to_f32(h) : kernels::f16_to_f32(h);
    }
  } else {
    throw file_error(path_, "tensor " + name + " has dtype " + e.dtype + ", expected F32/BF16/F16");
  }
  return t;
}

std::vector<std::int32_t> safetensors_file::read_i32(const std::string& name) const {
  const auto& e = at(name);
  const auto n = static_cast<std::size_t>(kernels::shape_numel(e.shape));
  std::vector<std::int32_t> out(n);
  for (std::size_t i = 0; i < n; ++i) {
    if (e.dtype == "I32") {
      std::memcpy(&out[i], e.data + 4 * i, 4);
    } else if (e.dtype == "I64") {
      std::int64_t v;
      std::memcpy(&v, e.data + 8 * i, 8);
      out[i] = static_cast<std::int32_t>(v);
    } else if (e.dtype == "U16") {
      std::uint16_t v;
      std::memcpy(&v, e.data + 2 * i, 2);
      out[i] = v;
    } else {
      throw file_error(path_,
                       "tensor " + name + " has dtype " + e.dtype + ", expected I32/I64/U16");
    }
  }
  return out;
}

namespace {

// A file written through a buffer, hashed as it goes; the temporary file is removed unless
// commit() renamed it into place.
class streamed_file {
 public:
  explicit streamed_file(std::filesystem::path path)
      : path_(std::move(path)), tmp_(path_.string() + ".tmp") {
    fd_ = ::open(tmp_.c_str(), O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0644);
    if (fd_ < 0) throw file_error(tmp_, std::string("cannot create: ") + std::strerror(errno));
    state_ = XXH64_createState();
    XXH64_reset(state_, 0);
  }
  ~streamed_file() {
    if (fd_ >= 0) {
      ::close(fd_);
      ::unlink(tmp_.c_str());
    }
    XXH64_freeState(state_);
  }
  streamed_file(const streamed_file&) = delete;
  streamed_file& operator=(const streamed_file&) = delete;

  void write(const void* data, std::size_t n) {
    XXH64_update(state_, data, n);
    const auto* p = static_cast<const std::byte*>(data);
    for (std::size_t done = 0; done < n;) {
      const ssize_t w = ::write(fd_, p + done, std::min<std::size_t>(n - done, 1 << 30));
      if (w < 0) {
        if (errno == EINTR) continue;
        throw file_error(tmp_, std::string("write failed: ") + std::strerror(errno));
      }
      done += static_cast<std::size_t>(w);
    }
    bytes_ += n;
  }
  file_digest commit() {
    if (::fsync(fd_) != 0 || ::close(std::exchange(fd_, -1)) != 0) {
      ::unlink(tmp_.c_str());
      throw file_error(tmp_, "fsync/close failed");
    }
    std::error_code ec;
    std::filesystem::rename(tmp_, path_, ec);
    if (ec) {
      ::unlink(tmp_.c_str());
      throw file_error(path_, "cannot rename into place: " + ec.message());
    }
    return {bytes_, XXH64_digest(state_)};
  }

 private:
  std::filesystem::path path_, tmp_;
  int fd_ = -1;
  XXH64_state_t* state_ = nullptr;
  std::uint64_t bytes_ = 0;
};

// A transposed tensor's bytes: source rows x cols floats written as cols x rows, a band of
// output rows at a time through `scratch` (each band reads every source row's contiguous run).
void write_transposed(streamed_file& out, const float* src, std::int64_t rows, std::int64_t cols,
                      std::vector<float>& scratch) {
  const std::int64_t band = std::max<std::int64_t>(1, (std::int64_t{1} << 21) / rows);
  scratch.resize(static_cast<std::size_t>(band * rows));
  for (std::int64_t c0 = 0; c0 < cols; c0 += band) {
    const std::int64_t c1 = std::min(cols, c0 + band);
    for (std::int64_t r = 0; r < rows; ++r)
      for (std::int64_t c = c0; c < c1; ++c)
        scratch[static_cast<std::size_t>((c - c0) * rows + r)] = src[r * cols + c];
    out.write(scratch.data(), static_cast<std::size_t>((c1 - c0) * rows) * sizeof(float));
  }
}

}  // namespace

file_digest write_file_atomically(const std::filesystem::path& path,
                                  const std::vector<std::byte>& bytes) {
  streamed_file out(path);
  out.write(bytes.data(), bytes.size());
  return out.commit();
}

file_digest write_safetensors(const std::filesystem::path& path,
                              const std::map<std::string, safetensors_tensor>& tensors,
                              const std::map<std::string, std::string>& metadata) {
  json header = json::object();
  if (!metadata.empty()) header["__metadata__"] = metadata;
  std::size_t offset = 0;
  for (const auto& [name, t] : tensors) {
    const std::size_t elem = safetensors_dtype_size(t.dtype);
    const auto numel = kernels::shape_numel(t.shape);
    if (elem == 0 || static_cast<std::size_t>(numel) * elem != t.nbytes ||
        (t.transposed_rows > 0 && (t.dtype != "F32" || numel % t.transposed_rows != 0))) {
      throw file_error(path, "tensor " + name + ": size does not match shape and dtype");
    }
    header[name] = {
        {"dtype", t.dtype}, {"shape", t.shape}, {"data_offsets", {offset, offset + t.nbytes}}};
    offset += t.nbytes;
  }
  std::string text = header.dump();
  while ((8 + text.size()) % 8 != 0) text.push_back(' ');
  streamed_file out(path);
  const std::uint64_t len = text.size();
  out.write(&len, 8);
  out.write(text.data(), text.size());
  std::vector<float> scratch;
  for (const auto& [name, t] : tensors) {
    if (t.transposed_rows > 0) {
      const std::int64_t rows = t.transposed_rows;
      write_transposed(out, static_cast<const float*>(t.data), rows,
                       kernels::shape_numel(t.shape) / rows, scratch);
    } else if (t.nbytes) {
      out.write(t.data, t.nbytes);
    }
  }
  return out.commit();
}

}  // namespace troupe::engine
