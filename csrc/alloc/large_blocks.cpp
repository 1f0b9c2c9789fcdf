// A CPU allocator that maps every block of at least `threshold` bytes on its own, on huge pages where the
// kernel has them, and unmaps it when freed; smaller blocks go to the allocator it replaced.
//
// Why: glibc serves large blocks from its heaps once its dynamic mmap threshold has risen (up to 32 MiB), and
// a heap keeps freed pages resident: a training step's activations and their gradients, freed in a different
// order than they were made, leave holes the next block does not fit, so a process's resident size sits far
// above what it uses (measured: 300-440 MiB of free heap on a 700 MiB working set). Mapping large blocks
// returns them at once. Mapping costs a page fault per page touched; on 2 MiB huge pages (MADV_HUGEPAGE,
// the mapping aligned so whole huge pages fit) that is one fault per 2 MiB, which keeps a step's time
// where it was. See slipstream/ops/large_blocks.py.
//
// Only for glibc's malloc behind torch's default CPU allocator (the Python side checks): see kMagic.
// A plain CPython module (no pybind, no torch/extension.h): it only needs c10's allocator interface.
#include <Python.h>

#include <c10/core/Allocator.h>
#include <c10/core/CPUAllocator.h>

#include <pthread.h>
#include <sys/mman.h>

#include <algorithm>
#include <atomic>
#include <cstdint>
#include <cstring>
#include <mutex>
#include <new>
#include <unordered_map>
#include <utility>
#include <vector>

namespace {

constexpr size_t kHugePage = size_t(2) << 20;
constexpr size_t kPage = 4096;
// Written just before a large block's data. glibc keeps a chunk's size in the word before every pointer it
// hands out, and no chunk is 2^63 bytes, so a word with the top bit set there can only be ours: one deleter
// serves both kinds of block, which raw_allocate/raw_deallocate (used by some kernels for scratch) need.
constexpr uint64_t kMagic = 0xD1CE5A1E5CAFEB10ull;

std::atomic<int64_t> g_maps{0};          // large blocks mapped so far
std::atomic<int64_t> g_live_blocks{0};   // large blocks not yet freed
std::atomic<int64_t> g_reused{0};        // allocations served from the cache
std::atomic<int64_t> g_evicted{0};       // cached blocks unmapped to keep the cache under the high-water mark
c10::DeleterFnPtr g_small_deleter = nullptr;  // the replaced allocator's deleter (glibc's free behind it)

// Freed blocks by mapping length, each with the sequence number of its free. A step frees its activations
// and makes the same sizes again in the next one: served from here, a block is neither faulted in nor zeroed
// again (a fresh mapping per block cost 10-15% of a 2-rank step).
//
// [Note: the cache holds only what the peak already paid for] Live plus cached bytes never exceed the most
// live bytes there ever were (g_high_water). Freeing a block moves its bytes from live to cached, which keeps
// the sum; mapping a new block when no cached one fits first unmaps the least recently freed cached blocks
// until the sum with the new block is at most max(high water, live with it). So the large blocks' resident
// size never rises above what an allocator that unmaps at once would reach at its peak, at every moment of a
// step, whatever the step frees when: no trim at a chosen moment is needed to keep the cache out of a peak
// (the earlier policy emptied it at each backward and still held a capacity test's swap buffers and a tiled
// loss's freed tiles at peaks inside the step). trim() after each optimizer step unmaps what the step did not
// take again, so a block of a size no longer made is not held for the rest of the run.
std::mutex g_cache_mutex;
std::unordered_map<size_t, std::vector<std::pair<void*, uint64_t>>> g_cache;  // length -> (data, free sequence)
int64_t g_cached_bytes = 0;  // under g_cache_mutex
int64_t g_live_bytes = 0;    // under g_cache_mutex: bytes of live large blocks (their data, not the header page)
int64_t g_high_water = 0;    // under g_cache_mutex: the most live bytes so far
uint64_t g_sequence = 0;     // under g_cache_mutex: frees so far
uint64_t g_trimmed_at = 0;   // under g_cache_mutex: g_sequence at the last trim()

bool is_large(void* data) {
  return reinterpret_cast<const uint64_t*>(data)[-1] == kMagic;
}

void unmap(void* data, uint64_t length) {
  munmap(static_cast<char*>(data) - kPage, length + kPage);
}

void release(void* data) {
  if (data == nullptr) {
    return;
  }
  if (!is_large(data)) {
    g_small_deleter(data);
    return;
  }
  const uint64_t length = reinterpret_cast<const uint64_t*>(data)[-2];
  g_live_blocks.fetch_sub(1);
  std::lock_guard<std::mutex> lock(g_cache_mutex);
  g_live_bytes -= static_cast<int64_t>(length);
  g_cache[length].emplace_back(data, ++g_sequence);  // live + cached unchanged: within the high water
  g_cached_bytes += static_cast<int64_t>(length);
}

// Takes a cached block of exactly `length` bytes, or, when there is none, unmaps the least recently freed
// cached blocks until a new mapping of `length` bytes keeps live + cached within the high water (see the
// Note) and returns nullptr. Counts the block as live either way.
void* take_cached_or_make_room(size_t length) {
  std::vector<std::pair<void*, uint64_t>> evicted;  // (data, length): unmapped outside the lock
  void* data = nullptr;
  {
    std::lock_guard<std::mutex> lock(g_cache_mutex);
    g_live_bytes += static_cast<int64_t>(length);
    auto found = g_cache.find(length);
    if (found != g_cache.end() && !found->second.empty()) {
      data = found->second.back().first;  // the most recently freed: its pages are the warmest
      found->second.pop_back();
      g_cached_bytes -= static_cast<int64_t>(length);
    } else {
      g_high_water = std::max(g_high_water, g_live_bytes);
      while (g_live_bytes + g_cached_bytes > g_high_water) {
        std::vector<std::pair<void*, uint64_t>>* oldest = nullptr;
        size_t oldest_length = 0;
        for (auto& [cached_length, blocks] : g_cache) {
          if (!blocks.empty() && (oldest == nullptr || blocks.front().second < oldest->front().second)) {
            oldest = &blocks;
            oldest_length = cached_length;
          }
        }
        evicted.emplace_back(oldest->front().first, oldest_length);
        oldest->erase(oldest->begin());
        g_cached_bytes -= static_cast<int64_t>(oldest_length);
      }
    }
    g_high_water = std::max(g_high_water, g_live_bytes);
  }
  for (auto& [block, block_length] : evicted) {
    unmap(block, block_length);
  }
  g_evicted.fetch_add(static_cast<int64_t>(evicted.size()));
  return data;
}

// A block's class: its length rounded up to whole huge pages where that wastes at most an eighth of it (the
// kernel then backs all of it with huge pages), else to 64 KiB (the aligned huge pages inside it are still backed
// so, the tail in 4 KiB pages). Rounding a 3 MiB block to 4 MiB would keep a third more resident (a touched huge
// page is resident whole) and made a ZeRO-3 unit of 3.1 MiB cost 4; a step makes the same sizes again, so exact
// classes still find their cached block.
constexpr size_t kSmallClass = size_t(64) << 10;
size_t round_up(size_t nbytes, size_t unit) {
  return (nbytes + unit - 1) / unit * unit;
}
size_t class_length(size_t nbytes) {
  const size_t huge = round_up(nbytes, kHugePage);
  return huge - nbytes <= nbytes / 8 ? huge : round_up(nbytes, kSmallClass);
}

void* with_header(uintptr_t data, size_t length) {
  auto* header = reinterpret_cast<uint64_t*>(data);
  header[-2] = length;
  header[-1] = kMagic;
  g_maps.fetch_add(1);
  return reinterpret_cast<void*>(data);
}

// Maps `length` bytes starting on a huge-page boundary, after one header page: over-map by one huge page and trim
// both ends, so the kernel can back the block's whole huge pages with huge pages. A block below one huge page gets
// its header page and its own pages, in 4 KiB pages.
void* map_aligned(size_t length) {
  if (length < kHugePage) {
    void* raw = mmap(nullptr, kPage + length, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
    return raw == MAP_FAILED ? nullptr : with_header(reinterpret_cast<uintptr_t>(raw) + kPage, length);
  }
  const size_t over = kPage + length + kHugePage;
  void* raw = mmap(nullptr, over, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
  if (raw == MAP_FAILED) {
    return nullptr;
  }
  const auto start = reinterpret_cast<uintptr_t>(raw);
  const uintptr_t data = (start + kPage + kHugePage - 1) / kHugePage * kHugePage;
  const uintptr_t head = data - kPage;
  if (head > start) {
    munmap(raw, head - start);
  }
  const uintptr_t end = start + over;
  if (end > data + length) {
    munmap(reinterpret_cast<void*>(data + length), end - (data + length));
  }
  madvise(reinterpret_cast<void*>(data), length, MADV_HUGEPAGE);  // a hint: without THP, 4 KiB pages serve
  return with_header(data, length);
}

class LargeBlockAllocator final : public c10::Allocator {
 public:
  LargeBlockAllocator(c10::Allocator* small, size_t threshold) : small_(small), threshold_(threshold) {}

  c10::DataPtr allocate(size_t nbytes) override {
    if (nbytes >= threshold_) {
      const size_t length = class_length(nbytes);
      void* data = take_cached_or_make_room(length);
      if (data != nullptr) {
        g_reused.fetch_add(1);
      } else {
        data = map_aligned(length);
      }
      if (data != nullptr) {
        g_live_blocks.fetch_add(1);
        return {data, data, &release, c10::Device(c10::DeviceType::CPU)};
      }
      std::lock_guard<std::mutex> lock(g_cache_mutex);  // out of mappings: the small path raises its own
      g_live_bytes -= static_cast<int64_t>(length);      // out-of-memory error if it must
    }
    c10::DataPtr small = small_->allocate(nbytes);
    void* data = small.get();
    small.release_context();  // the same pointer, freed by release() through the small allocator's deleter
    return {data, data, &release, c10::Device(c10::DeviceType::CPU)};
  }

  c10::DeleterFnPtr raw_deleter() const override {
    return &release;
  }

  void copy_data(void* dest, const void* src, std::size_t count) const override {
    std::memcpy(dest, src, count);
  }

  c10::Allocator* small() const {
    return small_;
  }

 private:
  c10::Allocator* small_;
  size_t threshold_;
};

// A fork (a DataLoader's workers) copies the cache's mutex as it is at that moment: held by another thread,
// the child's first large block would wait forever. Held across the fork, it is released on both sides.
void lock_before_fork() {
  g_cache_mutex.lock();
}
void unlock_after_fork() {
  g_cache_mutex.unlock();
}

LargeBlockAllocator* g_installed = nullptr;  // never deleted: blocks it mapped may outlive any uninstall

PyObject* install(PyObject*, PyObject* args) {
  unsigned long long threshold = 0;
  if (!PyArg_ParseTuple(args, "K", &threshold)) {
    return nullptr;
  }
  if (threshold < kPage) {
    PyErr_SetString(PyExc_ValueError, "large_blocks.install: the threshold must be at least 4096 bytes");
    return nullptr;
  }
  c10::Allocator* current = c10::GetCPUAllocator();
  c10::Allocator* small = current;
  if (g_installed != nullptr && current == g_installed) {
    small = g_installed->small();  // reinstalling with another threshold: keep the original small-block path
  } else if (current != c10::GetDefaultCPUAllocator() || current->raw_deleter() == nullptr) {
    Py_RETURN_FALSE;  // someone else's allocator: its blocks may not carry glibc's header word; leave it be
  }
  static const bool fork_safe = pthread_atfork(&lock_before_fork, &unlock_after_fork, &unlock_after_fork) == 0;
  if (!fork_safe) {
    PyErr_SetString(PyExc_RuntimeError, "large_blocks.install: pthread_atfork failed");
    return nullptr;
  }
  g_small_deleter = small->raw_deleter();
  // Never freed: tensors mapped under an earlier threshold still point at it through their deleter only,
  // so an old instance may be dropped, but keeping it costs a few bytes.
  g_installed = new LargeBlockAllocator(small, static_cast<size_t>(threshold));
  c10::SetCPUAllocator(g_installed, /*priority=*/UINT8_MAX);
  Py_RETURN_TRUE;
}

PyObject* uninstall(PyObject*, PyObject*) {
  if (g_installed != nullptr && c10::GetCPUAllocator() == g_installed) {
    c10::SetCPUAllocator(g_installed->small(), /*priority=*/UINT8_MAX);  // blocks already mapped keep their deleter
  }
  Py_RETURN_NONE;
}

PyObject* installed(PyObject*, PyObject*) {
  return PyBool_FromLong(g_installed != nullptr && c10::GetCPUAllocator() == g_installed);
}

PyObject* trim(PyObject*, PyObject* args) {
  int everything = 0;
  if (!PyArg_ParseTuple(args, "|p", &everything)) {
    return nullptr;
  }
  std::vector<std::pair<void*, uint64_t>> idle;  // (data, length): unmapped outside the lock
  {
    std::lock_guard<std::mutex> lock(g_cache_mutex);
    for (auto& [length, blocks] : g_cache) {
      std::vector<std::pair<void*, uint64_t>> kept;
      for (auto& [data, sequence] : blocks) {
        if (everything || sequence <= g_trimmed_at) {
          idle.emplace_back(data, length);
          g_cached_bytes -= static_cast<int64_t>(length);
        } else {
          kept.emplace_back(data, sequence);
        }
      }
      blocks.swap(kept);
    }
    g_trimmed_at = g_sequence;
  }
  for (auto& [data, length] : idle) {
    unmap(data, length);
  }
  return PyLong_FromSize_t(idle.size());
}

PyObject* reset_high_water(PyObject*, PyObject*) {
  std::lock_guard<std::mutex> lock(g_cache_mutex);
  g_high_water = g_live_bytes;
  Py_RETURN_NONE;
}

PyObject* stats(PyObject*, PyObject*) {
  int64_t live = 0;
  int64_t cached = 0;
  int64_t high_water = 0;
  {
    std::lock_guard<std::mutex> lock(g_cache_mutex);
    live = g_live_bytes;
    cached = g_cached_bytes;
    high_water = g_high_water;
  }
  return Py_BuildValue(
      "{s:L,s:L,s:L,s:L,s:L,s:L,s:L}",
      "mapped_bytes",
      static_cast<long long>(live),
      "cached_bytes",
      static_cast<long long>(cached),
      "high_water",
      static_cast<long long>(high_water),
      "maps",
      static_cast<long long>(g_maps.load()),
      "reused",
      static_cast<long long>(g_reused.load()),
      "evicted",
      static_cast<long long>(g_evicted.load()),
      "live_blocks",
      static_cast<long long>(g_live_blocks.load()));
}

PyMethodDef kMethods[] = {
    {"install", install, METH_VARARGS, "install(threshold) -> bool: map CPU blocks of at least threshold bytes on their own (False: not the default allocator)"},
    {"uninstall", uninstall, METH_NOARGS, "put the allocator that was replaced back (mapped blocks stay valid)"},
    {"installed", installed, METH_NOARGS, "whether it is torch's CPU allocator now"},
    {"trim", trim, METH_VARARGS, "trim(everything=False): unmap the cached blocks freed before the last trim (or all)"},
    {"reset_high_water", reset_high_water, METH_NOARGS, "let the cache hold no more than what is live now (tests)"},
    {"stats", stats, METH_NOARGS, "{mapped_bytes, cached_bytes, high_water, maps, reused, evicted, live_blocks}"},
    {nullptr, nullptr, 0, nullptr},
};

PyModuleDef kModule = {PyModuleDef_HEAD_INIT, "slipstream_large_blocks", nullptr, -1, kMethods};

}  // namespace

PyMODINIT_FUNC PyInit_slipstream_large_blocks() {
  return PyModule_Create(&kModule);
}
