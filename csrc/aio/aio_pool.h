// A pool of threads doing blocking pread/pwrite on behalf of asynchronous requests (no torch here).
//
// A request (one buffer, one file, one offset) is cut into block_size pieces that the threads
// serve in order, so one large swap uses every thread. A file is opened with O_DIRECT when the
// buffer, length and offset are all 4 KiB aligned and the filesystem accepts it; otherwise it
// falls back to buffered I/O and records why (the Python side warns once).
#pragma once

#include <condition_variable>
#include <cstdint>
#include <deque>
#include <memory>
#include <mutex>
#include <string>
#include <thread>
#include <unordered_map>
#include <vector>

namespace slipstream_aio {

constexpr int64_t kDirectAlign = 4096;

struct Request {
  int fd = -1;
  bool write = false;
  char* buffer = nullptr;
  int64_t nbytes = 0;
  int64_t offset = 0;
  int64_t blocks_left = 0;
  bool direct = false;
  std::string path;
  std::string error;  // first failure, empty when it succeeded
};

struct Block {
  std::shared_ptr<Request> request;
  int64_t begin;  // byte offset inside the request
  int64_t size;
};

class Pool {
 public:
  Pool(int64_t block_size, int64_t threads, bool use_direct);
  ~Pool();
  Pool(const Pool&) = delete;
  Pool& operator=(const Pool&) = delete;

  // Queues the request; returns its id. Opening the file happens here, so a missing directory or a
  // permission problem is reported by submit, not by wait.
  int64_t submit(char* buffer, int64_t nbytes, const std::string& path, int64_t offset, bool write);
  // Blocks until request `id` (or every request when id < 0) completes; returns the errors of the
  // requests it collected ("path: message"), empty on success.
  std::vector<std::string> wait(int64_t id);
  int64_t pending();
  // Files that could not be opened with O_DIRECT, with the reason (cleared by the call).
  std::vector<std::string> take_direct_fallbacks();

 private:
  void worker();
  void finish(const std::shared_ptr<Request>& request);
  int open_file(const std::string& path, bool write, bool want_direct, bool* direct);

  int64_t block_size_;
  bool use_direct_;
  std::mutex mutex_;
  std::condition_variable work_ready_;
  std::condition_variable request_done_;
  std::deque<Block> queue_;
  std::unordered_map<int64_t, std::shared_ptr<Request>> live_;
  std::vector<std::shared_ptr<Request>> done_;
  std::vector<std::string> direct_fallbacks_;
  int64_t next_id_ = 0;
  bool stopping_ = false;
  std::vector<std::thread> threads_;
};

}  // namespace slipstream_aio
