// Builds without libibverbs headers: the verbs transports are not available, and say why.
#include "transport/verbs/verbs_transport.h"

namespace portep {

namespace {
const char kWhy[] =
    "this build has no verbs transports (libibverbs headers missing: install libibverbs-dev and rebuild)";
}

VerbsOptions verbs_options_from_env(const std::string&, int rank, int num_ranks, int num_channels) {
  VerbsOptions o;
  o.rank = rank;
  o.num_ranks = num_ranks;
  o.num_channels = num_channels;
  return o;
}

std::unique_ptr<Transport> make_verbs_transport(const VerbsOptions&, std::string* why) {
  if (why) *why = kWhy;
  return nullptr;
}

bool verbs_built(std::string* why) {
  if (why) *why = kWhy;
  return false;
}

bool verbs_loadable(std::string* why) {
  if (why) *why = kWhy;
  return false;
}

std::vector<std::string> verbs_device_summary() { return {std::string("none: ") + kWhy}; }

std::vector<std::string> nic_library_summary() { return {std::string("none loaded: ") + kWhy}; }

}  // namespace portep
