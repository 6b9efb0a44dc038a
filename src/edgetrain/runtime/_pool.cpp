// edgetrain's CPU tensor pool: a caching allocator whose resident memory never exceeds a cap.
//
// Why: glibc either keeps freed tensor memory in heaps that fragment (resident memory follows the history
// of allocations) or, with a low mmap threshold, maps every tensor afresh and page-faults it in (about 1.8x
// slower training steps measured on 2-core x86). This pool keeps freed blocks mapped and reuses them
// (best fit; a reused block's tail stays cached, freed neighbours merge, a miss grows the largest cached
// block in place with mremap, blocks >= 2 MiB ask for transparent huge pages), and it unmaps cached bytes
// whenever live + cached bytes would exceed the highest live bytes seen (or a lower cap): resident pool
// memory never exceeds the peak of live tensor bytes, so there is no fragmentation above page rounding. Every
// block keeps kTailBytes mapped past its tensor's end, as malloc does (vector loads read past a tail).
//
// Built on first use by edgetrain/runtime/pool.py with the system C++ compiler against the installed torch;
// loaded with ctypes; installed with c10::SetCPUAllocator. Small allocations go to the default allocator.

#include <c10/core/Allocator.h>
#include <c10/core/CPUAllocator.h>

#include <sys/mman.h>
#include <unistd.h>

#include <algorithm>
#include <climits>
#include <cstdint>
#include <cstring>
#include <map>
#include <mutex>
#include <set>
#include <utility>
#include <unordered_map>

namespace {

constexpr size_t kPage = 4096;

size_t round_pages(size_t n) { return (n + kPage - 1) / kPage * kPage; }

struct Stats {
  int64_t live = 0;        // bytes of blocks handed out (page-rounded)
  int64_t cached = 0;      // bytes of free blocks kept mapped
  int64_t live_peak = 0;   // highest live seen
  int64_t hits = 0;        // allocations served from the cache
  int64_t misses = 0;      // allocations that mapped fresh pages (wholly or in part)
  int64_t evicted = 0;     // bytes unmapped from the cache
  int64_t split = 0;       // bytes of tails split off reused blocks (kept cached, not unmapped)
};

constexpr size_t kHuge = size_t(2) << 20;  // x86-64 transparent huge page

// Bytes every block keeps mapped past the tensor's end. Vectorised kernels may load a whole vector where only
// its first lanes are the tensor's: TorchInductor's CPU code for a max-pool over 8 channels loads 16 floats
// (AVX-512) with an all-true mask at the last row and keeps 8, reading 32 bytes past a 64 KiB buffer. glibc's
// malloc always leaves mapped bytes there; a block that ended on a page boundary with no mapping after it
// crashed that step (SIGSEGV in the generated kernel, about one run in four). Only a block whose size ends
// within these bytes of a page boundary takes one page more (power-of-two tensors do); a fresh block's extra
// page, only read, stays the shared zero page, but a reused block may bring it in resident (measured: up to
// 0.7 MiB more at a step's peak on the bench's models).
constexpr size_t kTailBytes = 256;

class Pool final : public c10::Allocator {
 public:
  Pool(size_t small_bytes, bool huge) : small_bytes_(small_bytes), huge_(huge) {}

  c10::DataPtr allocate(size_t n) override {
    if (n < small_bytes_) {
      return fallback()->allocate(n);
    }
    void* p = take(round_pages(n + kTailBytes));
    c10::profiledCPUMemoryReporter().New(p, n);  // torch.profiler's memory events, as the default allocator
    return {p, p, &Pool::deleter, c10::Device(c10::DeviceType::CPU)};
  }

  // oneDNN allocates through raw_allocate/raw_deallocate: small blocks then come from the fallback
  // allocator, so the raw deleter routes pointers that are not ours to the fallback's.
  c10::DeleterFnPtr raw_deleter() const override { return &Pool::deleter; }

  void copy_data(void* dest, const void* src, std::size_t count) const override {
    default_copy_data(dest, src, count);
  }

  void set_cap(int64_t cap) {
    std::lock_guard<std::mutex> g(mu_);
    cap_ = cap < 0 ? INT64_MAX : cap;
    shrink_locked(0);
  }

  void release() {
    std::lock_guard<std::mutex> g(mu_);
    release_locked();
  }

  void reset_peak() {
    std::lock_guard<std::mutex> g(mu_);
    st_.live_peak = st_.live;
    shrink_locked(0);
  }

  Stats stats() {
    std::lock_guard<std::mutex> g(mu_);
    return st_;
  }

  // The bytes of the live block at p (0: not a block of the pool's).
  int64_t block_bytes(void* p) {
    std::lock_guard<std::mutex> g(mu_);
    auto it = sizes_.find(p);
    return it == sizes_.end() ? 0 : static_cast<int64_t>(it->second);
  }

  static Pool* instance;
  static c10::Allocator* fallback_allocator;

 private:
  static c10::Allocator* fallback() { return fallback_allocator; }

  static void deleter(void* p) {
    if (instance->give(p)) {
      c10::profiledCPUMemoryReporter().Delete(p);
    } else {
      fallback_raw_deleter(p);
    }
  }

  static void fallback_raw_deleter(void* p) { fallback_allocator->raw_deleter()(p); }

  // live + cached may reach the highest live bytes seen and the cap, whichever is lower (live bytes are
  // never refused, so a cap below them only empties the cache).
  int64_t limit_locked() const { return std::max(st_.live, std::min(cap_, st_.live_peak)); }

  // Free blocks are indexed by address (to merge neighbours) and by size (best fit).
  void insert_free(char* p, size_t n) {
    by_addr_.emplace(p, n);
    by_size_.emplace(n, p);
    st_.cached += static_cast<int64_t>(n);
  }

  void erase_free(char* p, size_t n) {
    by_addr_.erase(p);
    by_size_.erase({n, p});
    st_.cached -= static_cast<int64_t>(n);
  }

  // Unmap cached bytes until live + cached + extra fits the limit: the tail of the largest free block
  // first (only what is needed, so the head stays cached), then whole blocks.
  void shrink_locked(int64_t extra) {
    while (!by_size_.empty()) {
      int64_t over = st_.live + st_.cached + extra - limit_locked();
      if (over <= 0) return;
      auto it = std::prev(by_size_.end());
      size_t n = it->first;
      char* p = it->second;
      size_t cut = std::min(n, round_pages(static_cast<size_t>(over)));
      if (n - cut < small_bytes_) cut = n;
      erase_free(p, n);
      munmap(p + (n - cut), cut);
      st_.evicted += static_cast<int64_t>(cut);
      if (cut < n) insert_free(p, n - cut);
    }
  }

  void* map_fresh(size_t n) {
    void* p = mmap(nullptr, n, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
    if (p == MAP_FAILED) {
      release_locked();
      p = mmap(nullptr, n, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
      TORCH_CHECK(p != MAP_FAILED, "edgetrain pool: out of memory mapping ", n, " bytes");
    }
    advise(p, n);
    return p;
  }

  // Huge pages cut page faults ~512-fold on big blocks: a fault costs more than zeroing its page here.
  void advise(void* p, size_t n) const {
#ifdef MADV_HUGEPAGE
    if (huge_ && n >= kHuge) madvise(p, n, MADV_HUGEPAGE);
#endif
  }

  void* take(size_t n) {
    std::lock_guard<std::mutex> g(mu_);
    char* p = nullptr;
    auto it = by_size_.lower_bound({n, nullptr});
    if (it != by_size_.end()) {  // best fit; the tail stays cached as a block of its own
      size_t size = it->first;
      p = it->second;
      erase_free(p, size);
      if (size > n) {
        insert_free(p + n, size - n);
        st_.split += static_cast<int64_t>(size - n);
      }
      st_.hits += 1;
    } else {
      st_.live_peak = std::max(st_.live_peak, st_.live + static_cast<int64_t>(n));
      st_.misses += 1;
      if (!by_size_.empty()) {  // grow the largest free block in place: only the new pages fault
        auto big = std::prev(by_size_.end());
        size_t size = big->first;
        char* old = big->second;
        erase_free(old, size);
        shrink_locked(static_cast<int64_t>(n));
        void* q = mremap(old, size, n, MREMAP_MAYMOVE);
        if (q != MAP_FAILED) {
          p = static_cast<char*>(q);
          advise(p, n);
        } else {  // spans mappings mremap cannot join: give it back
          munmap(old, size);
          st_.evicted += static_cast<int64_t>(size);
        }
      } else {
        shrink_locked(static_cast<int64_t>(n));
      }
      if (p == nullptr) p = static_cast<char*>(map_fresh(n));
    }
    sizes_[p] = n;
    st_.live += static_cast<int64_t>(n);
    st_.live_peak = std::max(st_.live_peak, st_.live);
    return p;
  }

  void release_locked() {
    while (!by_size_.empty()) {
      auto it = by_size_.begin();
      size_t n = it->first;
      char* p = it->second;
      erase_free(p, n);
      munmap(p, n);
      st_.evicted += static_cast<int64_t>(n);
    }
  }

  bool give(void* ptr) {
    std::lock_guard<std::mutex> g(mu_);
    auto it = sizes_.find(ptr);
    if (it == sizes_.end()) return false;  // a small block of the fallback allocator (raw_deallocate)
    char* p = static_cast<char*>(ptr);
    size_t n = it->second;
    sizes_.erase(it);
    st_.live -= static_cast<int64_t>(n);
    // merge with free neighbours (adjacent mappings unmap and re-split as one range)
    auto next = by_addr_.lower_bound(p);
    if (next != by_addr_.end() && next->first == p + n) {
      size_t m = next->second;
      erase_free(next->first, m);
      n += m;
    }
    auto after = by_addr_.lower_bound(p);
    if (after != by_addr_.begin()) {
      auto prev = std::prev(after);
      if (prev->first + prev->second == p) {
        char* q = prev->first;
        size_t m = prev->second;
        erase_free(q, m);
        p = q;
        n += m;
      }
    }
    insert_free(p, n);
    shrink_locked(0);
    return true;
  }

  size_t small_bytes_;
  bool huge_;
  int64_t cap_ = INT64_MAX;
  std::mutex mu_;
  std::map<char*, size_t> by_addr_;
  std::set<std::pair<size_t, char*>> by_size_;
  std::unordered_map<void*, size_t> sizes_;
  Stats st_;
};

Pool* Pool::instance = nullptr;
c10::Allocator* Pool::fallback_allocator = nullptr;
constexpr uint8_t kPriority = 200;

}  // namespace

extern "C" {

// Install the pool as PyTorch's CPU allocator (idempotent). Returns 0 on success.
int et_pool_install(int64_t small_bytes, int huge_pages) {
  if (Pool::instance == nullptr) {
    Pool::fallback_allocator = c10::GetDefaultCPUAllocator();
    Pool::instance = new Pool(static_cast<size_t>(small_bytes), huge_pages != 0);  // lives for the process: blocks point to it
  }
  c10::SetCPUAllocator(Pool::instance, kPriority);
  return 0;
}

// Route new allocations back to PyTorch's default allocator; blocks already handed out stay valid.
void et_pool_uninstall() {
  if (Pool::instance != nullptr) {
    Pool::instance->release();
    c10::SetCPUAllocator(Pool::fallback_allocator, kPriority);
  }
}

void et_pool_set_cap(int64_t cap) {
  if (Pool::instance != nullptr) Pool::instance->set_cap(cap);
}

void et_pool_release() {
  if (Pool::instance != nullptr) Pool::instance->release();
}

void et_pool_reset_peak() {
  if (Pool::instance != nullptr) Pool::instance->reset_peak();
}

int64_t et_pool_block_bytes(void* p) { return Pool::instance != nullptr ? Pool::instance->block_bytes(p) : 0; }

int64_t et_pool_tail_bytes() { return static_cast<int64_t>(kTailBytes); }

// live, cached, live_peak, hits, misses, evicted, split
void et_pool_stats(int64_t* out) {
  Stats s = Pool::instance != nullptr ? Pool::instance->stats() : Stats{};
  int64_t v[7] = {s.live, s.cached, s.live_peak, s.hits, s.misses, s.evicted, s.split};
  std::memcpy(out, v, sizeof(v));
}

}  // extern "C"
