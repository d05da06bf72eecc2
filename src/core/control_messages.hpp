// The control plane's messages, checked: every field a peer sends over the
// connection manager's or the rendezvous' TCP stream is read through these
// functions, which check its JSON type and its range and say which field was
// wrong. A peer's message never throws and never reads a missing key; a bad
// one fails the connection it came on, not the process. Internal header;
// no I/O (the fuzz target drives these functions directly).
//
// Endpoint JSON: address, udp_port, qp_num, psn, mtu, pkey, mode; "token"
// (16 hex digits) for stellar-mode soft endpoints; "gid" (sysfs form) and
// "lid" for verbs endpoints. Thread-safety: pure functions.
#pragma once

#include <nlohmann/json.hpp>

#include <cstdint>
#include <string>
#include <string_view>
#include <vector>

#include "stellar/status.hpp"
#include "stellar/verbs.hpp"

namespace stellar::control {

using json = nlohmann::json;

// The connection manager's lines carry an endpoint and up to 4096 bytes of
// private data in hex; 64 KiB leaves room and bounds what a peer can make
// us buffer.
inline constexpr size_t max_cm_line_bytes = 64 * 1024;
// A reason text from a peer is cut to this length before it reaches a log or
// a Status.
inline constexpr size_t max_reason_bytes = 512;
// Deepest nesting of arrays/objects a line may have (the rendezvous needs 4).
inline constexpr size_t max_nesting_depth = 8;

// One line: a JSON object whose "type" is a string. Anything else (not JSON,
// an array, a missing or non-string type) is a protocol_error.
Result<json> parse_line(std::string_view line);

// Peer text made safe for messages and logs: at most max_bytes bytes, cut at
// a UTF-8 character boundary ("..." marks a cut), control characters as '?'.
std::string printable(std::string_view text, size_t max_bytes);

// `key` of object `j` as an unsigned integer in [min, max]: a JSON integer
// (not a float, string or bool) in range, else protocol_error naming it.
Result<uint64_t> read_unsigned(const json& j, const char* key, uint64_t min, uint64_t max);
// `key` of `j` as a string of at most max_length bytes.
Result<std::string> read_string(const json& j, const char* key, size_t max_length);
// The "reason" of a reject or error line: the text if it is a string (cut to
// max_reason_bytes), else "(no reason given)". Never fails: the reason only
// explains a failure that is already decided.
std::string read_reason(const json& j);

// An address a peer may name: an IPv4 or IPv6 literal that is not the
// unspecified address, a broadcast or a multicast address.
Status check_unicast_address(const std::string& address);

json endpoint_json(const QpEndpoint& e);
// Reads and range-checks an endpoint: udp_port 1..65535, qp_num 1..2^24-1,
// psn below 2^24 in roce mode, mtu 256..max_mtu, pkey 1..65535, mode
// "stellar"/"roce", a unicast address (verbs endpoints may leave it empty
// when they carry a GID), a stellar-mode token of 16 hex digits.
Result<QpEndpoint> endpoint_from(const json& j);

std::string to_hex(const std::vector<uint8_t>& bytes);
// Lowercase or uppercase hex of at most max_bytes bytes.
Result<std::vector<uint8_t>> from_hex(const std::string& hex, size_t max_bytes);

// The connection manager's "connect" and "accept" lines: an endpoint and the
// private data (at most cm::max_private_data bytes).
struct EndpointMessage {
  QpEndpoint endpoint;
  std::vector<uint8_t> private_data;
};
// `j` must have the given type ("connect" or "accept").
Result<EndpointMessage> parse_endpoint_message(const json& j, const char* type);
json endpoint_message_json(const char* type, const QpEndpoint& e, const std::vector<uint8_t>& private_data);

}  // namespace stellar::control
