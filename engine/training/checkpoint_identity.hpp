// Which checkpoint a process resumes, as one short line that processes compare at the
// rendezvous (messages::hello::resume): every process of a job must resume the same one, and
// two directories of the same name (a checkpoint.dir that is not shared, a damaged newest
// checkpoint that one process passed over) are told apart by their manifests.
#pragma once

#include <filesystem>
#include <string>

namespace troupe::engine {

// "step-00000012 (manifest xxh64 0123456789abcdef)": the step directory's name and the xxh64 of
// its manifest.json's bytes. Throws std::runtime_error naming the file if it cannot be read.
std::string checkpoint_identity(const std::filesystem::path& step_dir);

}  // namespace troupe::engine
