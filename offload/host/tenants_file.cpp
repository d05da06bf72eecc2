#include "host/tenants_file.hpp"

#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <nlohmann/json.hpp>
#include <set>

namespace stellar::host {

bool credential_matches(const std::string& given, const std::string& expected) {
  // Every byte of the longer string is looked at, whatever matched.
  const size_t n = std::max(given.size(), expected.size());
  unsigned char diff = given.size() == expected.size() ? 0 : 1;
  for (size_t i = 0; i < n; ++i) {
    const unsigned char a = i < given.size() ? uint8_t(given[i]) : 0, b = i < expected.size() ? uint8_t(expected[i]) : 0;
    diff |= uint8_t(a ^ b);
  }
  return diff == 0 && !expected.empty();
}

std::optional<std::map<std::string, TenantEntry>> load_tenants_file(const std::string& path, std::string& error) {
  auto bad = [&](const std::string& what) -> std::optional<std::map<std::string, TenantEntry>> {
    error = "tenants file " + path + ": " + what;
    return std::nullopt;
  };
  // Opened without blocking and checked on the descriptor: a FIFO or device
  // named by mistake (or malice) must not hang whoever reads it.
  const int fd = ::open(path.c_str(), O_RDONLY | O_NONBLOCK | O_CLOEXEC);
  if (fd < 0) return bad("cannot be opened");
  struct stat st {};
  std::string text;
  const bool regular = ::fstat(fd, &st) == 0 && S_ISREG(st.st_mode);
  if (regular && st.st_size <= (1 << 20)) {
    text.resize(size_t(st.st_size));
    size_t got = 0;
    while (got < text.size()) {
      const ssize_t n = ::read(fd, text.data() + got, text.size() - got);
      if (n <= 0) break;
      got += size_t(n);
    }
    text.resize(got);
  }
  ::close(fd);
  if (!regular) return bad("not a regular file");
  if (st.st_size > (1 << 20)) return bad("larger than 1 MiB");
  using nlohmann::json;
  json doc = json::parse(text, nullptr, false);
  if (doc.is_discarded()) return bad("not valid JSON");
  if (!doc.is_object() || !doc.contains("tenants") || !doc["tenants"].is_array() || doc.size() != 1)
    return bad("expected {\"tenants\": [...]}");
  std::map<std::string, TenantEntry> out;
  std::set<uint16_t> pkeys;
  size_t index = 0;
  for (const json& t : doc["tenants"]) {
    const std::string where = "tenants[" + std::to_string(index++) + "]";
    if (!t.is_object()) return bad(where + " is not an object");
    TenantEntry o;
    std::string name;
    for (auto it = t.begin(); it != t.end(); ++it) {
      const std::string& key = it.key();
      const json& v = it.value();
      uint64_t n = 0;
      auto unsigned_value = [&](uint64_t max) {
        if (!v.is_number_unsigned() || v.get<uint64_t>() > max) return false;
        n = v.get<uint64_t>();
        return true;
      };
      auto range = [&](uint64_t max) { return bad(where + "." + key + " is not an integer in [0, " + std::to_string(max) + "]"); };
      if (key == "name" || key == "credential") {
        if (!v.is_string() || v.get<std::string>().size() > 256 || v.get<std::string>().find('\0') != std::string::npos)
          return bad(where + "." + key + " is not a string of at most 256 bytes without NUL");
        (key == "name" ? name : o.credential) = v.get<std::string>();
      } else if (key == "pkey") {
        if (!unsigned_value(0xfffe)) return range(0xfffe);
        o.pkey = uint16_t(n);
      } else if (key == "weight") {
        if (!unsigned_value(1'000'000)) return range(1'000'000);
        if (n == 0) return bad(where + ".weight is 0: weights are at least 1");
        o.weight = uint32_t(n);
      } else if (key == "rate_bytes_per_s" || key == "burst_bytes") {
        if (!unsigned_value(UINT64_MAX / 4)) return range(UINT64_MAX / 4);
        (key == "rate_bytes_per_s" ? o.rate_bytes_per_s : o.burst_bytes) = n;
      } else if (key == "max_registered_bytes") {
        if (!unsigned_value(UINT64_MAX)) return range(UINT64_MAX);
        o.max_registered_bytes = n;
      } else if (key == "max_qps" || key == "max_receive_wrs" || key == "max_send_wrs") {
        if (!unsigned_value(UINT32_MAX)) return range(UINT32_MAX);
        (key == "max_qps" ? o.max_qps : key == "max_receive_wrs" ? o.max_receive_wrs : o.max_send_wrs) = uint32_t(n);
      } else {
        return bad(where + " has an unknown key '" + key + "'");
      }
    }
    if (name.empty()) return bad(where + " has no name");
    if (o.credential.empty()) return bad(where + " (" + name + ") has no credential");
    if (out.count(name)) return bad("tenant '" + name + "' is listed twice");
    if (o.pkey && !pkeys.insert(o.pkey).second) return bad("partition key " + std::to_string(o.pkey) + " is listed twice");
    out[name] = o;
  }
  return out;
}

}  // namespace stellar::host
