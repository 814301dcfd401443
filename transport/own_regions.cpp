#include "transport/own_regions.h"

#include <iterator>
#include <map>
#include <mutex>

namespace portep {

namespace {

struct Registry {
  std::mutex mutex;
  std::map<std::string, OwnRegion> by_handle;
};

Registry& registry() {
  static Registry* r = new Registry;  // never destroyed: regions may be freed by static destructors after main
  return *r;
}

}  // namespace

void own_region_add(const std::string& handle, void* p, int device) {
  Registry& r = registry();
  std::lock_guard<std::mutex> lock(r.mutex);
  r.by_handle[handle] = OwnRegion{p, device};
}

void own_region_remove(void* p) {
  Registry& r = registry();
  std::lock_guard<std::mutex> lock(r.mutex);
  for (auto it = r.by_handle.begin(); it != r.by_handle.end();)
    it = it->second.address == p ? r.by_handle.erase(it) : std::next(it);
}

OwnRegion own_region_find(const std::string& handle) {
  Registry& r = registry();
  std::lock_guard<std::mutex> lock(r.mutex);
  auto it = r.by_handle.find(handle);
  return it == r.by_handle.end() ? OwnRegion{} : it->second;
}

}  // namespace portep
