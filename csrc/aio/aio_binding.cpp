// Python binding of the thread-pool async I/O: tensors in, request ids out; the GIL is released
// while waiting, and each request keeps its tensor alive until it is collected.
#include <torch/csrc/utils/pybind.h>

#include <memory>
#include <mutex>
#include <string>
#include <unordered_map>
#include <vector>

#include "aio_pool.h"

namespace {

class Handle {
 public:
  Handle(int64_t block_size, int64_t threads, bool use_direct) : pool_(block_size, threads, use_direct) {}

  int64_t submit(const at::Tensor& tensor, const std::string& path, int64_t offset, bool write) {
    TORCH_CHECK(tensor.device().is_cpu(), "aio: the buffer must be in CPU memory, got ", tensor.device());
    TORCH_CHECK(tensor.is_contiguous(), "aio: the buffer must be contiguous");
    const int64_t nbytes = tensor.numel() * static_cast<int64_t>(tensor.element_size());
    int64_t id;
    try {
      id = pool_.submit(static_cast<char*>(tensor.data_ptr()), nbytes, path, offset, write);
    } catch (const std::exception& e) {
      TORCH_CHECK(false, e.what());
    }
    std::lock_guard<std::mutex> lock(mutex_);
    buffers_[id] = tensor;
    return id;
  }

  // Returns the error messages of the collected requests (empty: all succeeded).
  std::vector<std::string> wait(int64_t id) {
    std::vector<std::string> errors;
    {
      pybind11::gil_scoped_release no_gil;
      errors = pool_.wait(id);
    }
    std::lock_guard<std::mutex> lock(mutex_);
    if (id >= 0) {
      buffers_.erase(id);
    } else {
      buffers_.clear();
    }
    return errors;
  }

  int64_t pending() { return pool_.pending(); }
  std::vector<std::string> direct_fallbacks() { return pool_.take_direct_fallbacks(); }

 private:
  slipstream_aio::Pool pool_;
  std::mutex mutex_;
  std::unordered_map<int64_t, at::Tensor> buffers_;
};

}  // namespace

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.doc() = "slipstream async file I/O: a thread pool of pread/pwrite with O_DIRECT where possible";
  m.attr("direct_alignment") = slipstream_aio::kDirectAlign;
  pybind11::class_<Handle>(m, "Handle")
      .def(pybind11::init<int64_t, int64_t, bool>(), pybind11::arg("block_size"), pybind11::arg("threads"),
           pybind11::arg("use_direct"))
      .def("submit", &Handle::submit, pybind11::arg("tensor"), pybind11::arg("path"), pybind11::arg("offset"),
           pybind11::arg("write"))
      .def("wait", &Handle::wait, pybind11::arg("id"))
      .def("pending", &Handle::pending)
      .def("direct_fallbacks", &Handle::direct_fallbacks);
}
