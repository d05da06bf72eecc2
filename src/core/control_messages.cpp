#include "core/control_messages.hpp"

#include <arpa/inet.h>

#include <algorithm>
#include <cstdio>
#include <cstring>

#include "stellar/cm.hpp"

namespace stellar::control {
namespace {

Status bad_field(const char* key, const std::string& why) { return Status(Errc::protocol_error, std::string("field '") + key + "' " + why); }

}  // namespace

// The deepest nesting of arrays and objects in `line` (brackets inside
// strings do not count). nlohmann parses iteratively but copies, compares
// and dumps recursively: a line of a million '[' would overflow the stack
// after a successful parse, so depth is checked before parsing.
size_t nesting_depth(std::string_view line) {
  size_t depth = 0, deepest = 0;
  bool in_string = false, escaped = false;
  for (const char c : line) {
    if (in_string) {
      if (escaped) escaped = false;
      else if (c == '\\') escaped = true;
      else if (c == '"') in_string = false;
    } else if (c == '"') {
      in_string = true;
    } else if (c == '[' || c == '{') {
      deepest = std::max(deepest, ++depth);
    } else if ((c == ']' || c == '}') && depth > 0) {
      --depth;
    }
  }
  return deepest;
}

Result<json> parse_line(std::string_view line) {
  if (nesting_depth(line) > max_nesting_depth)
    return Status(Errc::protocol_error, "JSON nested deeper than " + std::to_string(max_nesting_depth) + " levels");
  json j = json::parse(line.begin(), line.end(), nullptr, false);
  if (j.is_discarded()) return Status(Errc::protocol_error, "not a JSON line");
  if (!j.is_object()) return Status(Errc::protocol_error, "not a JSON object");
  const auto type = j.find("type");
  if (type == j.end() || !type->is_string()) return Status(Errc::protocol_error, "no string field 'type'");
  return j;
}

Result<uint64_t> read_unsigned(const json& j, const char* key, uint64_t min, uint64_t max) {
  const auto it = j.find(key);
  if (it == j.end()) return bad_field(key, "is missing");
  // nlohmann parses non-negative integers as unsigned; a negative one is
  // number_integer, a fraction or an exponent number_float: all refused.
  if (!it->is_number_unsigned()) {
    if (it->is_number_integer()) return bad_field(key, "is negative: " + std::to_string(it->get<int64_t>()));
    if (it->is_number_float()) {
      char text[32];
      std::snprintf(text, sizeof text, "%g", it->get<double>());
      return bad_field(key, std::string("is not an integer: ") + text);
    }
    return bad_field(key, std::string("is not an integer but ") + it->type_name());
  }
  const uint64_t v = it->get<uint64_t>();
  if (v < min || v > max)
    return bad_field(key, "is " + std::to_string(v) + ", outside [" + std::to_string(min) + ", " + std::to_string(max) + "]");
  return v;
}

Result<std::string> read_string(const json& j, const char* key, size_t max_length) {
  const auto it = j.find(key);
  if (it == j.end()) return bad_field(key, "is missing");
  if (!it->is_string()) return bad_field(key, std::string("is not a string but ") + it->type_name());
  const std::string& s = it->get_ref<const std::string&>();
  if (s.size() > max_length) return bad_field(key, "is longer than " + std::to_string(max_length) + " bytes");
  return s;
}

std::string printable(std::string_view text, size_t max_bytes) {
  std::string s;
  s.reserve(std::min(text.size(), max_bytes));
  size_t end = std::min(text.size(), max_bytes);
  // Cut at a UTF-8 character boundary, never inside a sequence.
  while (end > 0 && end < text.size() && (uint8_t(text[end]) & 0xc0) == 0x80) --end;
  for (size_t i = 0; i < end; ++i) s += uint8_t(text[i]) < 0x20 || text[i] == 0x7f ? '?' : text[i];
  if (end < text.size()) s += "...";
  return s;
}

std::string read_reason(const json& j) {
  const auto it = j.find("reason");
  if (it == j.end() || !it->is_string()) return "(no reason given)";
  return printable(it->get_ref<const std::string&>(), max_reason_bytes);
}

Status check_unicast_address(const std::string& address) {
  in_addr v4{};
  in6_addr v6{};
  if (inet_pton(AF_INET, address.c_str(), &v4) == 1) {
    const uint32_t a = ntohl(v4.s_addr);
    if (a == 0) return Status(Errc::protocol_error, "address 0.0.0.0 is not a peer's address");
    if (a == 0xffffffffu) return Status(Errc::protocol_error, "address 255.255.255.255 is a broadcast address");
    if ((a >> 28) == 0xe) return Status(Errc::protocol_error, "address " + address + " is a multicast address");
    return {};
  }
  if (inet_pton(AF_INET6, address.c_str(), &v6) == 1) {
    static const in6_addr unspecified{};
    if (std::memcmp(&v6, &unspecified, sizeof v6) == 0) return Status(Errc::protocol_error, "address :: is not a peer's address");
    if (v6.s6_addr[0] == 0xff) return Status(Errc::protocol_error, "address " + address + " is a multicast address");
    return {};
  }
  return Status(Errc::protocol_error, "address '" + printable(address, 64) + "' is not an IPv4 or IPv6 address");
}

json endpoint_json(const QpEndpoint& e) {
  json j{{"address", e.address}, {"udp_port", e.udp_port}, {"qp_num", e.qp_num}, {"psn", e.psn},
         {"mtu", e.mtu},         {"pkey", e.pkey},         {"mode", to_string(e.mode)}};
  if (e.token) {
    char hex[17];
    std::snprintf(hex, sizeof hex, "%016llx", static_cast<unsigned long long>(e.token));
    j["token"] = hex;
  }
  if (e.loopback_unchecked) j["loopback_unchecked"] = true;
  if (e.path_mtu_discovery) j["path_mtu_discovery"] = true;
  if (!e.gid.empty()) {
    j["gid"] = e.gid;
    j["lid"] = e.lid;
  }
  return j;
}

Result<QpEndpoint> endpoint_from(const json& j) {
  if (!j.is_object()) return Status(Errc::protocol_error, "endpoint is not a JSON object");
  QpEndpoint e;
  auto mode_name = read_string(j, "mode", 16);
  if (!mode_name) return mode_name.status();
  auto mode = parse_mode(*mode_name);
  if (!mode) return bad_field("mode", "is '" + printable(*mode_name, 16) + "', not stellar or roce");
  e.mode = *mode;
  auto port = read_unsigned(j, "udp_port", 1, 65535);
  auto qpn = read_unsigned(j, "qp_num", 1, 0xffffff);  // QPNs are 24 bits (BTH), in both modes
  auto psn = read_unsigned(j, "psn", 0, e.mode == Mode::roce ? 0xffffff : 0xffffffff);
  auto mtu = read_unsigned(j, "mtu", 256, max_mtu);
  auto pkey = read_unsigned(j, "pkey", 1, 0xffff);  // 0 is no partition
  for (const Status& s : {port.status(), qpn.status(), psn.status(), mtu.status(), pkey.status()})
    if (!s.ok()) return s;
  e.udp_port = uint16_t(*port);
  e.qp_num = uint32_t(*qpn);
  e.psn = uint32_t(*psn);
  e.mtu = uint32_t(*mtu);
  e.pkey = uint16_t(*pkey);
  if (j.contains("gid")) {
    auto gid = read_string(j, "gid", 64);
    if (!gid) return gid.status();
    auto lid = j.contains("lid") ? read_unsigned(j, "lid", 0, 0xffff) : Result<uint64_t>(uint64_t(0));
    if (!lid) return lid.status();
    e.gid = *gid;
    e.lid = uint16_t(*lid);
  }
  auto address = read_string(j, "address", 64);
  if (!address) return address.status();
  e.address = *address;
  // A verbs endpoint whose GID carries no IPv4 names no address (it is for logs there).
  if (!(e.address.empty() && !e.gid.empty()))
    if (Status s = check_unicast_address(e.address); !s.ok()) return s;
  if (j.contains("token")) {
    auto token = read_string(j, "token", 16);
    if (!token) return token.status();
    auto bytes = from_hex(*token, 8);
    if (!bytes || bytes->size() != 8) return bad_field("token", "is not 16 hex digits");
    for (uint8_t b : *bytes) e.token = e.token << 8 | b;
  }
  if (j.contains("loopback_unchecked")) {
    const json& u = j["loopback_unchecked"];
    if (!u.is_boolean()) return bad_field("loopback_unchecked", "is not true or false");
    e.loopback_unchecked = u.get<bool>();
  }
  if (j.contains("path_mtu_discovery")) {
    const json& u = j["path_mtu_discovery"];
    if (!u.is_boolean()) return bad_field("path_mtu_discovery", "is not true or false");
    e.path_mtu_discovery = u.get<bool>();
  }
  return e;
}

std::string to_hex(const std::vector<uint8_t>& bytes) {
  static const char digits[] = "0123456789abcdef";
  std::string s;
  s.reserve(bytes.size() * 2);
  for (uint8_t b : bytes) s += {digits[b >> 4], digits[b & 15]};
  return s;
}

Result<std::vector<uint8_t>> from_hex(const std::string& hex, size_t max_bytes) {
  if (hex.size() % 2) return Status(Errc::protocol_error, "hex text of odd length");
  if (hex.size() / 2 > max_bytes) return Status(Errc::protocol_error, "hex text above " + std::to_string(max_bytes) + " bytes");
  auto nibble = [](char c) -> int {
    if (c >= '0' && c <= '9') return c - '0';
    if (c >= 'a' && c <= 'f') return c - 'a' + 10;
    if (c >= 'A' && c <= 'F') return c - 'A' + 10;
    return -1;
  };
  std::vector<uint8_t> out;
  out.reserve(hex.size() / 2);
  for (size_t i = 0; i < hex.size(); i += 2) {
    const int hi = nibble(hex[i]), lo = nibble(hex[i + 1]);
    if (hi < 0 || lo < 0) return Status(Errc::protocol_error, "not hex text");
    out.push_back(uint8_t(hi << 4 | lo));
  }
  return out;
}

Result<EndpointMessage> parse_endpoint_message(const json& j, const char* type) {
  auto t = read_string(j, "type", 32);
  if (!t) return t.status();
  if (*t != type) return Status(Errc::protocol_error, std::string("expected a '") + type + "' message, got '" + printable(*t, 32) + "'");
  auto endpoint = endpoint_from(j);
  if (!endpoint) return endpoint.status();
  EndpointMessage m{*endpoint, {}};
  if (j.contains("private_data")) {
    auto hex = read_string(j, "private_data", 2 * cm::max_private_data);
    if (!hex) return hex.status();
    auto data = from_hex(*hex, cm::max_private_data);
    if (!data) return Status(Errc::protocol_error, "field 'private_data': " + data.status().message());
    m.private_data = std::move(*data);
  }
  return m;
}

json endpoint_message_json(const char* type, const QpEndpoint& e, const std::vector<uint8_t>& private_data) {
  json j = endpoint_json(e);
  j["type"] = type;
  j["private_data"] = to_hex(private_data);
  return j;
}

}  // namespace stellar::control
