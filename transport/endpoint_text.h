// Text helpers for endpoint descriptions (the blobs transports exchange at bootstrap): lines and hex fields.
// No iostreams in this library: an extension loaded next to another C++ runtime (torch's) can crash in
// their locale machinery, as seen on the GPU machine's image.
#pragma once

#include <stddef.h>
#include <stdint.h>

#include <string>
#include <vector>

#include "transport/transport.h"

namespace portep {

inline std::vector<std::string> split_lines(const std::string& s) {
  std::vector<std::string> out;
  size_t start = 0;
  while (start < s.size()) {
    size_t end = s.find('\n', start);
    if (end == std::string::npos) end = s.size();
    out.push_back(s.substr(start, end - start));
    start = end + 1;
  }
  return out;
}

inline std::string hex_encode(const void* p, size_t n) {
  static const char* digits = "0123456789abcdef";
  std::string out;
  for (size_t i = 0; i < n; ++i) {
    const uint8_t c = static_cast<const uint8_t*>(p)[i];
    out += digits[c >> 4];
    out += digits[c & 15];
  }
  return out;
}

// Throws TransportError naming `what` on a malformed field.
inline std::string hex_decode(const std::string& hex, const char* what) {
  auto nibble = [what](char c) -> int {
    if (c >= '0' && c <= '9') return c - '0';
    if (c >= 'a' && c <= 'f') return c - 'a' + 10;
    throw TransportError(std::string(what) + ": bad hex digit '" + c + "' in an endpoint description");
  };
  if (hex.size() % 2) throw TransportError(std::string(what) + ": odd-length hex field in an endpoint description");
  std::string out;
  for (size_t i = 0; i + 1 < hex.size(); i += 2) out += char(nibble(hex[i]) << 4 | nibble(hex[i + 1]));
  return out;
}

}  // namespace portep
