// Sharing of live GPU memory registrations within one protection domain, for
// the verbs provider (docs/verbs-provider.md, "Registration cache").
//
// Registering GPU memory with a NIC (a dma-buf export plus
// ibv_reg_dmabuf_mr, or nvidia-peermem pinning) costs from tens of
// microseconds to milliseconds. Frameworks register the same buffers again
// and again (per step, per collective call), so a registration of a range
// that an existing registration with the same access already covers takes a
// use of that one instead of making another: same lkey and rkey, nothing
// done by the NIC.
//
// What it never does:
//  - Keep a registration past its last user. A NIC's rkey stays valid while
//    its MR exists, so a cached-but-unused MR would let peers keep writing
//    into memory the application believes deregistered. The last release
//    deregisters it (RegistrationCache::Reference::retire).
//  - Hand out a registration of freed memory. Each registration remembers
//    the identity of the allocation it was made for (CUDA's buffer id, new
//    for every allocation even at a reused address); a lookup that finds a
//    registration of another allocation drops it from the cache (its users
//    keep theirs) and registers anew.
//  - Widen access: a registration is shared only with requests of exactly
//    the same access flags (one cache per access combination), so a
//    local-only registration never gets an rkey of a remote-write one; and
//    only with requests of exactly the same cover, so a small region never
//    gets the key of a larger registration around it (which would leave the
//    larger range reachable by peers after its owner deregistered it).
//  - Reach past the allocation: registrations are keyed by page ranges (the
//    request rounded out to host pages, as dma-buf export needs anyway), but
//    only where the rounded range stays inside the CUDA allocation; else the
//    exact range.
//
// Plain host memory is not shared: nothing tells a free() + malloc() at the
// same address apart, and the NIC would keep the old pages pinned under the
// shared key. It is registered per request, as before.
//
// Thread-safety: every member may be called from any thread (the caches lock).
#pragma once

#include <array>
#include <cstdint>
#include <functional>
#include <memory>
#include <utility>

#include "core/registration_cache.hpp"
#include "stellar/status.hpp"

namespace stellar::provider::verbs {

template <typename Handle>
class SharedRegistrations {
 public:
  struct Registration {
    Handle handle;
    uint64_t identity = 0;  // the allocation it describes (CUDA buffer id)
  };
  using Cache = RegistrationCache<Registration>;

  // A counted use of a registration; ending it (release() or destruction)
  // deregisters the registration if it was the last use. Move-only.
  class Use {
   public:
    Use() = default;
    explicit Use(typename Cache::Reference reference) : reference_(std::move(reference)) {}
    Use(Use&&) noexcept = default;
    Use& operator=(Use&& o) noexcept {
      if (this != &o) {
        reference_.retire();
        reference_ = std::move(o.reference_);
      }
      return *this;
    }
    ~Use() { reference_.retire(); }
    explicit operator bool() const { return bool(reference_); }
    const Registration& handle() const { return reference_.handle(); }
    uint64_t start() const { return reference_.start(); }    // the registered cover
    uint64_t length() const { return reference_.length(); }
    void release() { reference_.retire(); }

   private:
    typename Cache::Reference reference_;
  };

  static constexpr uint32_t access_combinations = 16;  // the four access bits of stellar/verbs.hpp

  // `deregister` receives each handle exactly once, after its last use; it must not throw.
  explicit SharedRegistrations(std::function<void(Handle&&)> deregister) {
    auto shared = std::make_shared<std::function<void(Handle&&)>>(std::move(deregister));
    for (auto& cache : caches_) cache = std::make_unique<Cache>([shared](Registration&& r) { (*shared)(std::move(r.handle)); });
  }

  // A use of a live registration of allocation `identity` covering
  // [address, address+length) with exactly `access`, or a new one made by
  // register_range(cover_start, cover_length) -> Result<Handle> (called
  // without any lock held). The cover is what gets registered and cached:
  // the request rounded out to pages where that stays inside the
  // allocation, so that other buffers in the same pages find it too.
  // `hit` (optional) says which.
  template <typename RegisterFn>
  Result<Use> acquire(uint64_t address, uint64_t length, uint64_t cover_start, uint64_t cover_length, uint32_t access, uint64_t identity,
                      RegisterFn&& register_range, bool* hit = nullptr) {
    if (hit) *hit = false;
    if (access >= access_combinations) return Status(Errc::invalid_argument, "shared registration: unknown access bits");
    if (cover_start > address || cover_start + cover_length < address + length)
      return Status(Errc::invalid_argument, "shared registration: the cover does not contain the range");
    Cache& cache = *caches_[access];
    if (auto found = cache.lookup(cover_start, cover_length)) {
      if (found->handle().identity != identity) {
        // The memory was freed and allocated again: every registration of
        // the old allocation in this range is stale, whatever its access.
        found->reset();
        for (auto& c : caches_) c->invalidate(cover_start, cover_length);
      } else if (found->start() == cover_start && found->length() == cover_length) {
        if (hit) *hit = true;
        return Use(std::move(*found));
      } else {
        found->retire();  // a larger registration: not ours to hand out (retire: it may have been its last use)
      }
    }
    Result<Handle> made = register_range(cover_start, cover_length);
    if (!made) return made.status();
    return Use(cache.insert(cover_start, cover_length, Registration{std::move(*made), identity}));
  }

  // Ends a use; the registration is deregistered if it was the last one.
  static void release(Use& use) { use.release(); }

  // Live registrations (those with at least one use), all access combinations.
  size_t size() const {
    size_t n = 0;
    for (const auto& c : caches_) n += c->size();
    return n;
  }

 private:
  std::array<std::unique_ptr<Cache>, access_combinations> caches_;
};

}  // namespace stellar::provider::verbs
