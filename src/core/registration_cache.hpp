// A cache of memory registrations keyed by address range, shared by the
// providers (an ibv_mr*, a dma-buf MR, a soft-provider region, ...): the
// registration of a buffer is reused by later operations on it instead of
// being made again per operation (registration pins pages and costs tens of
// microseconds; GPU registrations more).
//
// The rule that matters: it never hands out a stale registration. A range is
// invalidated when its memory is freed (invalidate(address, length)) or its
// registration is deregistered (invalidate(reference)); after that no lookup
// returns it, and a registration made later at the same address is a new
// entry with a new id.
//
// Lifetime and ownership:
//  - The cache owns every handle it was given; it passes each handle exactly
//    once to the `deregister` callback, when the entry is dead (invalidated,
//    flushed or the cache destroyed) and no Reference to it remains.
//  - A Reference is a counted use of one entry (move-only). Holding it keeps
//    the handle alive even across invalidation, so an operation in flight
//    finishes with the registration it started with; it never makes a dead
//    entry visible again. References may outlive the cache object.
//
// Thread-safety: every member function may be called from any thread; one
// mutex guards the index. The deregister callback runs outside the mutex (it
// may call into the cache) on the thread that dropped the last use.
//
// Cost: lookup scans the entries that start at most `longest registration`
// bytes below the address, O(log n + k); fine for the hundreds of live
// registrations a process keeps.
#pragma once

#include <algorithm>
#include <cstdint>
#include <functional>
#include <map>
#include <memory>
#include <mutex>
#include <optional>
#include <utility>
#include <vector>

#include "stellar/status.hpp"

namespace stellar {

template <typename Handle>
class RegistrationCache {
  struct Entry {
    uint64_t id = 0;
    uint64_t start = 0, length = 0;  // the range the handle covers, bytes
    Handle handle;
    uint64_t references = 0;
    bool valid = true;  // false: invalidated, out of the index, waiting for its last reference
  };

  struct State {
    std::mutex mutex;
    std::multimap<uint64_t, std::shared_ptr<Entry>> by_start;  // valid entries only
    uint64_t longest = 0;          // upper bound of the length of entries in by_start
    uint64_t next_id = 1;
    uint64_t invalidations = 0;    // epoch: bumped by every invalidate(address, length)
    uint64_t hits = 0, misses = 0;
    std::function<void(Handle&&)> deregister;

    // Entries whose handles the caller must deregister outside the lock.
    using Dead = std::vector<std::shared_ptr<Entry>>;
    void finish(Dead& dead) {
      for (auto& e : dead) deregister(std::move(e->handle));
      dead.clear();
    }
    void unindex(const std::shared_ptr<Entry>& e) {
      auto [first, last] = by_start.equal_range(e->start);
      for (auto it = first; it != last; ++it)
        if (it->second == e) {
          by_start.erase(it);
          break;
        }
      if (by_start.empty()) longest = 0;
    }
  };

 public:
  // A counted use of an entry. handle() stays valid while the Reference lives.
  class Reference {
   public:
    Reference() = default;
    Reference(Reference&& o) noexcept : state_(std::move(o.state_)), entry_(std::move(o.entry_)) {}
    Reference& operator=(Reference&& o) noexcept {
      if (this != &o) {
        reset();
        state_ = std::move(o.state_);
        entry_ = std::move(o.entry_);
      }
      return *this;
    }
    Reference(const Reference&) = delete;
    Reference& operator=(const Reference&) = delete;
    ~Reference() { reset(); }

    explicit operator bool() const { return entry_ != nullptr; }
    const Handle& handle() const { return entry_->handle; }
    uint64_t start() const { return entry_->start; }
    uint64_t length() const { return entry_->length; }
    uint64_t id() const { return entry_->id; }  // unique per registration, never reused
    // Drops this use now (the destructor does the same).
    void reset() {
      if (!entry_) return;
      typename State::Dead dead;
      {
        std::lock_guard lock(state_->mutex);
        if (--entry_->references == 0 && !entry_->valid) dead.push_back(entry_);
      }
      state_->finish(dead);
      entry_.reset();
      state_.reset();
    }
    // Drops this use like reset(); if it was the entry's last use, the entry
    // also leaves the cache and is deregistered now instead of staying cached.
    // For registrations whose keys must not outlive their last user (a NIC's
    // rkey stays valid while its MR exists): the cache then only shares live
    // registrations.
    void retire() {
      if (!entry_) return;
      typename State::Dead dead;
      {
        std::lock_guard lock(state_->mutex);
        if (--entry_->references == 0) {
          if (entry_->valid) state_->unindex(entry_);
          entry_->valid = false;
          dead.push_back(entry_);
        }
      }
      state_->finish(dead);
      entry_.reset();
      state_.reset();
    }

   private:
    friend class RegistrationCache;
    Reference(std::shared_ptr<State> s, std::shared_ptr<Entry> e) : state_(std::move(s)), entry_(std::move(e)) {}
    std::shared_ptr<State> state_;
    std::shared_ptr<Entry> entry_;
  };

  // `deregister` receives each handle once; it must not throw.
  explicit RegistrationCache(std::function<void(Handle&&)> deregister) : state_(std::make_shared<State>()) {
    state_->deregister = std::move(deregister);
  }
  RegistrationCache(const RegistrationCache&) = delete;
  RegistrationCache& operator=(const RegistrationCache&) = delete;
  // Deregisters every unreferenced entry now; referenced ones when their last Reference goes.
  ~RegistrationCache() { invalidate_all(); }

  // A registration covering all of [address, address+length), or nullopt.
  // When several cover it, the one registered last.
  std::optional<Reference> lookup(uint64_t address, uint64_t length) {
    std::lock_guard lock(state_->mutex);
    auto e = find_locked(address, length);
    if (!e) {
      ++state_->misses;
      return std::nullopt;
    }
    ++state_->hits;
    ++e->references;
    return Reference(state_, e);
  }

  // Adds a registration the caller made of [start, start+length) (usually a
  // page-aligned cover of the buffer). Returns the first use of it.
  Reference insert(uint64_t start, uint64_t length, Handle handle) {
    std::lock_guard lock(state_->mutex);
    return insert_locked(start, length, std::move(handle));
  }

  // lookup, else register(start, length) -> Result<Handle> for the page-rounded
  // cover of the range (called without the lock held) and insert. If memory
  // was invalidated while registering, the new registration may describe
  // freed memory: it is returned for this one use but not cached. If another
  // thread cached a covering registration meanwhile, that one is returned and
  // the new handle deregistered.
  template <typename RegisterFn>
  Result<Reference> acquire(uint64_t address, uint64_t length, uint64_t page, RegisterFn&& register_range) {
    if (auto hit = lookup(address, length)) return std::move(*hit);
    const uint64_t start = address & ~(page - 1);
    const uint64_t end = (address + length + page - 1) & ~(page - 1);
    uint64_t epoch;
    {
      std::lock_guard lock(state_->mutex);
      epoch = state_->invalidations;
    }
    Result<Handle> made = register_range(start, end - start);
    if (!made) return made.status();
    typename State::Dead dead;
    Reference out;
    {
      std::lock_guard lock(state_->mutex);
      if (state_->invalidations != epoch) {
        auto e = std::make_shared<Entry>(Entry{state_->next_id++, start, end - start, std::move(*made), 1, false});
        out = Reference(state_, e);
      } else if (auto e = find_locked(address, length)) {
        ++e->references;
        out = Reference(state_, e);
        dead.push_back(std::make_shared<Entry>(Entry{0, start, end - start, std::move(*made), 0, false}));
      } else {
        out = insert_locked(start, end - start, std::move(*made));
      }
    }
    state_->finish(dead);
    return out;
  }

  // The memory [address, address+length) was freed or unmapped: every entry
  // overlapping it (touching by one byte is enough) leaves the cache. Returns
  // how many entries were invalidated.
  size_t invalidate(uint64_t address, uint64_t length) {
    typename State::Dead dead;
    size_t count = 0;
    {
      std::lock_guard lock(state_->mutex);
      ++state_->invalidations;
      const uint64_t end = address + length;
      // Candidates start below `end` and no more than `longest` below `address`.
      auto it = state_->by_start.lower_bound(address > state_->longest ? address - state_->longest : 0);
      while (it != state_->by_start.end() && it->first < end) {
        auto e = it->second;
        if (length > 0 && e->start + e->length > address) {
          it = state_->by_start.erase(it);
          kill_locked(e, dead);
          ++count;
        } else {
          ++it;
        }
      }
      if (state_->by_start.empty()) state_->longest = 0;
    }
    state_->finish(dead);
    return count;
  }

  // The registration behind `reference` is being deregistered by its owner:
  // no lookup returns it from now on. The reference stays usable.
  void invalidate(const Reference& reference) {
    typename State::Dead dead;
    {
      std::lock_guard lock(state_->mutex);
      if (!reference.entry_ || !reference.entry_->valid) return;
      state_->unindex(reference.entry_);
      kill_locked(reference.entry_, dead);
    }
    state_->finish(dead);
  }

  // Deregisters the entries nobody uses (e.g. under memory pressure); keeps
  // the referenced ones. Returns how many were dropped.
  size_t flush() {
    typename State::Dead dead;
    {
      std::lock_guard lock(state_->mutex);
      for (auto it = state_->by_start.begin(); it != state_->by_start.end();) {
        if (it->second->references == 0) {
          auto e = it->second;
          it = state_->by_start.erase(it);
          kill_locked(e, dead);
        } else {
          ++it;
        }
      }
      if (state_->by_start.empty()) state_->longest = 0;
    }
    const size_t n = dead.size();
    state_->finish(dead);
    return n;
  }

  // Valid entries (referenced or not).
  size_t size() const {
    std::lock_guard lock(state_->mutex);
    return state_->by_start.size();
  }
  uint64_t hits() const {
    std::lock_guard lock(state_->mutex);
    return state_->hits;
  }
  uint64_t misses() const {
    std::lock_guard lock(state_->mutex);
    return state_->misses;
  }

 private:
  std::shared_ptr<Entry> find_locked(uint64_t address, uint64_t length) {
    if (length == 0 || address + length < address) return nullptr;
    const uint64_t end = address + length;
    std::shared_ptr<Entry> best;
    // Entries starting after `address` cannot cover it; those starting more
    // than `longest` below it cannot reach it.
    auto it = state_->by_start.upper_bound(address);
    const uint64_t lowest = address > state_->longest ? address - state_->longest : 0;
    while (it != state_->by_start.begin()) {
      --it;
      if (it->first < lowest) break;
      const auto& e = it->second;
      if (e->start + e->length >= end && (!best || e->id > best->id)) best = e;
    }
    return best;
  }

  Reference insert_locked(uint64_t start, uint64_t length, Handle handle) {
    auto e = std::make_shared<Entry>(Entry{state_->next_id++, start, length, std::move(handle), 1, true});
    state_->by_start.emplace(start, e);
    state_->longest = std::max(state_->longest, length);
    return Reference(state_, e);
  }

  static void kill_locked(const std::shared_ptr<Entry>& e, typename State::Dead& dead) {
    e->valid = false;
    if (e->references == 0) dead.push_back(e);
  }

  void invalidate_all() {
    typename State::Dead dead;
    {
      std::lock_guard lock(state_->mutex);
      for (auto& [start, e] : state_->by_start) kill_locked(e, dead);
      state_->by_start.clear();
      state_->longest = 0;
    }
    state_->finish(dead);
  }

  std::shared_ptr<State> state_;
};

}  // namespace stellar
