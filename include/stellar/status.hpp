// The one error type of the Stellar API (UCX style: every fallible call
// returns a Status, or a Result<T> holding either a value or a Status).
// Output values are only set on success. Thread-safety: plain values.
#pragma once

#include <string>
#include <utility>
#include <variant>

namespace stellar {

enum class Errc {
  ok = 0,
  invalid_argument,   // a parameter is out of range or inconsistent
  wrong_state,        // the object is not in a state that allows the call (e.g. post_send before RTS)
  queue_full,         // a work queue or completion queue has no room
  not_found,          // no such object, key or device
  no_device,          // the provider found no usable device
  permission_denied,  // a key of another PD or tenant, or missing access rights
  resource_exhausted, // a tenant's or context's quota ran out
  io_error,           // a system call failed (the message names it and errno)
  timeout,            // a blocking call ran out of time
  connection_refused, // the peer rejected or was unreachable
  protocol_error,     // the peer sent something malformed
  unsupported,        // not available in this build or on this provider
};

const char* to_string(Errc);

class [[nodiscard]] Status {
 public:
  Status() = default;
  Status(Errc code, std::string message) : code_(code), message_(std::move(message)) {}
  static Status success() { return {}; }
  bool ok() const { return code_ == Errc::ok; }
  explicit operator bool() const { return ok(); }
  Errc code() const { return code_; }
  const std::string& message() const { return message_; }
  // "<code>: <message>", for logs and exceptions.
  std::string to_string() const;

 private:
  Errc code_ = Errc::ok;
  std::string message_;
};

template <typename T>
class [[nodiscard]] Result {
 public:
  Result(T value) : v_(std::move(value)) {}
  Result(Status status) : v_(std::move(status)) {}
  bool ok() const { return v_.index() == 0; }
  explicit operator bool() const { return ok(); }
  T& value() & { return std::get<0>(v_); }
  T&& value() && { return std::get<0>(std::move(v_)); }
  T& operator*() & { return value(); }
  T* operator->() { return &std::get<0>(v_); }
  Status status() const { return ok() ? Status{} : std::get<1>(v_); }

 private:
  std::variant<T, Status> v_;
};

}  // namespace stellar
