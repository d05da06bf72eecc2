// Stellar's one place for the environment (issue 12, item 4): every
// environment variable the libraries read is declared in config.cpp's table,
// with its default, unit and meaning, and read only through the functions
// below. docs/configuration.md lists the same table (a test checks that the
// two agree), `stellar config` prints it with the values in effect.
//
// Variables are read when the code that uses them starts (Context::open,
// CommunicatorOptions::from_environment, the first log line, loading the
// CUDA driver), not cached, so a launcher or a test may set them before.
// A malformed value is an invalid_argument Status naming the variable and
// what it accepts, never silently a default. Thread-safety: as the C
// library's environment access; do not call while another thread runs
// setenv.
#pragma once

#include <cstdint>
#include <optional>
#include <span>
#include <string>

#include "stellar/status.hpp"

namespace stellar::config {

struct Variable {
  const char* name;
  const char* default_value;  // as text; "" = unset means "not given"
  const char* unit;           // "probability", "ms", "integer", "path", ...
  const char* meaning;        // one line, for docs and `stellar config`
  const char* reader;         // the code that reads it
};

// Every variable, in the order docs/configuration.md lists them.
std::span<const Variable> variables();

// The variable's text, nullopt when unset or empty. `name` must be in
// variables() (a name missing there is a programming error: abort).
std::optional<std::string> text(const char* name);
// A number in [0, 1]; nullopt when unset.
Result<std::optional<double>> probability(const char* name);
// A decimal (or 0x hexadecimal, never octal) integer in [min, max];
// nullopt when unset.
Result<std::optional<int64_t>> integer(const char* name, int64_t min, int64_t max);
// An unsigned 64-bit value (seeds; decimal or 0x hexadecimal); nullopt when unset.
Result<std::optional<uint64_t>> unsigned64(const char* name);

}  // namespace stellar::config
