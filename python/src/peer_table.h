// The device tables of peer regions the GPU kernels store into: each rank's region as this process maps it (the
// Channel's: CUDA IPC on one host), written by native code so that Python never handles the addresses.
#pragma once

#include <pybind11/pybind11.h>
#include <stdint.h>

#include <string>
#include <vector>

#include "gpu_kernels/cuda/ll_api.h"
#include "proxy/channel.h"
#include "python/src/bind_util.h"

namespace portep::bind {

// table [num_ranks] (device memory) gets the region of every rank of `ranks` that the Channel mapped, and 0 for the
// others. With `required`, a rank of `ranks` that is not mapped is refused by name (NotImplementedError, `what`
// says what needed it) before anything is written.
inline void write_peer_table(const portep::Channel& channel, const std::vector<int>& ranks, uint8_t** table,
                             int64_t num_ranks, bool required, const char* what) {
  std::vector<uint8_t*> regions(num_ranks, nullptr);
  std::string unmapped;
  for (int d : ranks) {
    if (d < 0 || d >= num_ranks)
      throw pybind11::value_error(std::string(what) + ": rank " + std::to_string(d) + " is not in [0, " +
                                  std::to_string(num_ranks) + ")");
    if (!(regions[d] = channel.peer_data(d))) unmapped += (unmapped.empty() ? "" : ", ") + std::to_string(d);
  }
  if (required && !unmapped.empty()) {
    PyErr_SetString(PyExc_NotImplementedError, (std::string(what) +
                                                " needs the buffers of same-node ranks mapped "
                                                "(CUDA IPC); the Channel's transport did not map ranks " +
                                                unmapped)
                                                   .c_str());
    throw pybind11::error_already_set();
  }
  check(portep::cuda::copy_to_device(table, regions.data(), num_ranks * sizeof(uint8_t*)), what);
}

}  // namespace portep::bind
