// Thread-pool asynchronous file I/O (see aio_pool.h).
#include "aio_pool.h"

#include <fcntl.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>
#include <stdexcept>

namespace slipstream_aio {

namespace {

bool aligned(int64_t value) { return value % kDirectAlign == 0; }

// Runs the whole block, retrying short transfers and EINTR; returns an error message or "".
std::string transfer(int fd, bool write, char* buffer, int64_t size, int64_t offset) {
  int64_t done = 0;
  while (done < size) {
    const ssize_t n = write ? ::pwrite(fd, buffer + done, size - done, offset + done)
                            : ::pread(fd, buffer + done, size - done, offset + done);
    if (n < 0) {
      if (errno == EINTR) continue;
      return std::string(write ? "pwrite" : "pread") + " failed: " + std::strerror(errno);
    }
    if (n == 0) {
      return write ? std::string("pwrite wrote nothing (disk full?)")
                   : "short read: the file ends at byte " + std::to_string(offset + done) + ", expected " +
                         std::to_string(offset + size);
    }
    done += n;
  }
  return "";
}

}  // namespace

Pool::Pool(int64_t block_size, int64_t threads, bool use_direct) : block_size_(block_size), use_direct_(use_direct) {
  if (block_size <= 0 || threads <= 0) throw std::invalid_argument("aio: block_size and threads must be positive");
  for (int64_t i = 0; i < threads; ++i) threads_.emplace_back([this] { worker(); });
}

Pool::~Pool() {
  {
    std::lock_guard<std::mutex> lock(mutex_);
    stopping_ = true;
  }
  work_ready_.notify_all();
  for (auto& t : threads_) t.join();
  for (auto& entry : live_) {
    if (entry.second->fd >= 0) ::close(entry.second->fd);
  }
}

int Pool::open_file(const std::string& path, bool write, bool want_direct, bool* direct) {
  const int base = write ? (O_WRONLY | O_CREAT) : O_RDONLY;
  *direct = false;
  if (want_direct) {
    const int fd = ::open(path.c_str(), base | O_DIRECT | O_CLOEXEC, 0644);
    if (fd >= 0) {
      *direct = true;
      return fd;
    }
    if (errno != EINVAL) return -1;  // a real error (missing directory, permission): report it
    std::lock_guard<std::mutex> lock(mutex_);
    direct_fallbacks_.push_back(path + ": the filesystem does not support O_DIRECT");
  }
  return ::open(path.c_str(), base | O_CLOEXEC, 0644);
}

int64_t Pool::submit(char* buffer, int64_t nbytes, const std::string& path, int64_t offset, bool write) {
  if (nbytes < 0 || offset < 0) throw std::invalid_argument("aio: negative size or offset");
  auto request = std::make_shared<Request>();
  request->write = write;
  request->buffer = buffer;
  request->nbytes = nbytes;
  request->offset = offset;
  request->path = path;
  const bool alignable = aligned(reinterpret_cast<intptr_t>(buffer)) && aligned(nbytes) && aligned(offset);
  request->fd = open_file(path, write, use_direct_ && alignable, &request->direct);
  if (request->fd < 0) {
    throw std::runtime_error("aio: cannot open " + path + " for " + (write ? "writing" : "reading") + ": " +
                             std::strerror(errno));
  }
  const int64_t blocks = nbytes == 0 ? 0 : (nbytes + block_size_ - 1) / block_size_;
  request->blocks_left = blocks;
  std::lock_guard<std::mutex> lock(mutex_);
  const int64_t id = next_id_++;
  live_[id] = request;
  if (blocks == 0) {
    ::close(request->fd);
    request->fd = -1;
    return id;
  }
  for (int64_t b = 0; b < blocks; ++b) {
    const int64_t begin = b * block_size_;
    queue_.push_back(Block{request, begin, std::min(block_size_, nbytes - begin)});
  }
  work_ready_.notify_all();
  return id;
}

void Pool::worker() {
  for (;;) {
    Block block;
    {
      std::unique_lock<std::mutex> lock(mutex_);
      work_ready_.wait(lock, [this] { return stopping_ || !queue_.empty(); });
      if (stopping_ && queue_.empty()) return;
      block = queue_.front();
      queue_.pop_front();
    }
    Request& r = *block.request;
    const std::string error = transfer(r.fd, r.write, r.buffer + block.begin, block.size, r.offset + block.begin);
    std::lock_guard<std::mutex> lock(mutex_);
    if (!error.empty() && r.error.empty()) r.error = error;
    if (--r.blocks_left == 0) {
      ::close(r.fd);
      r.fd = -1;
      request_done_.notify_all();
    }
  }
}

std::vector<std::string> Pool::wait(int64_t id) {
  std::unique_lock<std::mutex> lock(mutex_);
  std::vector<std::string> errors;
  auto collect = [&](int64_t key) {
    auto it = live_.find(key);
    if (it == live_.end()) return;
    if (!it->second->error.empty()) errors.push_back(it->second->path + ": " + it->second->error);
    live_.erase(it);
  };
  if (id >= 0) {
    if (live_.find(id) == live_.end()) return errors;  // already collected
    request_done_.wait(lock, [&] { return live_.at(id)->blocks_left == 0; });
    collect(id);
    return errors;
  }
  request_done_.wait(lock, [&] {
    for (auto& entry : live_) {
      if (entry.second->blocks_left != 0) return false;
    }
    return true;
  });
  std::vector<int64_t> keys;
  for (auto& entry : live_) keys.push_back(entry.first);
  for (int64_t key : keys) collect(key);
  return errors;
}

int64_t Pool::pending() {
  std::lock_guard<std::mutex> lock(mutex_);
  int64_t n = 0;
  for (auto& entry : live_) n += entry.second->blocks_left != 0;
  return n;
}

std::vector<std::string> Pool::take_direct_fallbacks() {
  std::lock_guard<std::mutex> lock(mutex_);
  std::vector<std::string> out;
  out.swap(direct_fallbacks_);
  return out;
}

}  // namespace slipstream_aio
