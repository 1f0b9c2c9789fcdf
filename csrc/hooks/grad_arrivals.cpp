// Gradient arrivals counted in C++: one post hook on each parameter's gradient accumulator, Python once per bucket.
//
// A ZeRO strategy must know, per parameter and per backward, that its gradient was accumulated: to
// mark it used, to keep it in (or move it into) the flat buffer, and to count its bucket down so the
// bucket's collective launches when its last gradient lands. Written as a Python hook that is a few
// Python calls per parameter tensor per step (issue 50). Here it is a C++ post hook on the
// parameter's AccumulateGrad node, as DDP's reducer registers its own: the node is kept alive by this
// object, so autograd reuses it (and its hooks) every step. The hook takes the GIL only when a bucket
// completes (the strategy's launcher takes it from there) or when a gradient arrives twice in a
// window (the strategy raises its error).
#include <torch/csrc/Exceptions.h>
#include <torch/csrc/autograd/function_hook.h>
#include <torch/csrc/autograd/node.h>
#include <torch/csrc/autograd/variable.h>
#include <torch/csrc/utils/pybind.h>

#include <cstdint>
#include <memory>
#include <vector>

namespace py = pybind11;
using torch::autograd::Node;
using torch::autograd::variable_list;

namespace {

// What the hook does with the gradient before counting it.
enum Mode : int {
  kCount = 0,       // leave it where autograd put it (ZeRO-2 packs a bucket at its launch)
  kAdopt = 1,       // keep .grad the strategy's view, copying a gradient autograd allocated afresh into it
  kAddAndFree = 2,  // add the (low-precision) gradient into the fp32 view and free it at once
};

class GradArrivals;

struct ArrivalHook : torch::autograd::FunctionPostHook {
  ArrivalHook(GradArrivals* owner, int64_t slot) : owner(owner), slot(slot) {}
  variable_list operator()(const variable_list& outputs, const variable_list& inputs) override;
  GradArrivals* owner;
  int64_t slot;
};

class GradArrivals {
 public:
  // params[k]: the parameter; indices[k]: its index in the strategy's trainable list (the used flag's);
  // views[k]: where its gradient lives (empty with kCount); bucket_of[k]: its bucket (-1: none);
  // used: the strategy's bytearray of used flags, one byte per trainable parameter.
  GradArrivals(std::vector<at::Tensor> params, std::vector<int64_t> indices, std::vector<at::Tensor> views, int mode,
               std::vector<int64_t> bucket_of, int64_t buckets, py::bytearray used, py::function on_bucket,
               py::function on_twice)
      : params_(std::move(params)),
        indices_(std::move(indices)),
        views_(std::move(views)),
        mode_(mode),
        bucket_of_(std::move(bucket_of)),
        sizes_(buckets, 0),
        used_(std::move(used)),
        on_bucket_(std::move(on_bucket)),
        on_twice_(std::move(on_twice)) {
    const size_t n = params_.size();
    TORCH_CHECK(indices_.size() == n && bucket_of_.size() == n, "grad_arrivals: one index and bucket per parameter");
    TORCH_CHECK(mode_ == kCount || views_.size() == n, "grad_arrivals: one view per parameter");
    TORCH_CHECK(mode_ >= kCount && mode_ <= kAddAndFree, "grad_arrivals: unknown mode ", mode_);
    used_bytes_ = reinterpret_cast<uint8_t*>(PyByteArray_AsString(used_.ptr()));
    used_size_ = static_cast<int64_t>(PyByteArray_Size(used_.ptr()));
    for (size_t k = 0; k < n; ++k) {
      TORCH_CHECK(indices_[k] >= 0 && indices_[k] < used_size_, "grad_arrivals: index out of the used flags");
      TORCH_CHECK(bucket_of_[k] < buckets, "grad_arrivals: bucket out of range");
      if (bucket_of_[k] >= 0) sizes_[bucket_of_[k]] += 1;
    }
    ready_.assign(n, 0);
    pending_ = sizes_;
    for (size_t k = 0; k < n; ++k) {
      TORCH_CHECK(params_[k].requires_grad() && params_[k].is_leaf(), "grad_arrivals: a trainable leaf parameter");
      auto accumulator = torch::autograd::impl::grad_accumulator(params_[k]);
      keys_.push_back(accumulator->add_post_hook(std::make_unique<ArrivalHook>(this, static_cast<int64_t>(k))));
      accumulators_.push_back(std::move(accumulator));
    }
  }

  ~GradArrivals() {
    for (size_t k = 0; k < accumulators_.size(); ++k) accumulators_[k]->del_post_hook(keys_[k]);
  }

  // The gradient of slot k was accumulated (from the hook, or from Python for a gradient that reached
  // .grad without autograd's accumulator: GIL held then).
  void arrive(int64_t k) {
    if (aside) return;  // set_aside: the gradient is the check's, not the step's
    at::Tensor& param = params_[k];
    if (mode_ != kCount) {
      const at::Tensor& grad = param.grad();
      at::Tensor& view = views_[k];
      if (mode_ == kAdopt) {
        if (grad.defined() && !grad.is_same(view)) {
          if (grad.data_ptr() != view.data_ptr()) view.copy_(grad);
          param.mutable_grad() = view;
        }
      } else if (grad.defined()) {
        view.add_(grad);
        param.mutable_grad().reset();
      }
    }
    used_bytes_[indices_[k]] = 1;
    if (!sync) return;
    if (ready_[k]) {
      call(on_twice_, indices_[k]);
      return;
    }
    ready_[k] = 1;
    const int64_t bucket = bucket_of_[k];
    if (bucket >= 0 && --pending_[bucket] == 0 && launch) call(on_bucket_, bucket);
  }

  // A new window: every bucket waits for all of its gradients again.
  void reset() {
    pending_ = sizes_;
    std::fill(ready_.begin(), ready_.end(), 0);
  }

  // Detach, and let go of the callbacks: they lead back to the strategy that holds this object, a cycle that
  // Python's collector cannot see through C++ (called with the GIL, from Python).
  void remove() {
    for (size_t k = 0; k < accumulators_.size(); ++k) accumulators_[k]->del_post_hook(keys_[k]);
    accumulators_.clear();
    keys_.clear();
    on_bucket_ = py::function();
    on_twice_ = py::function();
  }

  int64_t hooks() const { return static_cast<int64_t>(accumulators_.size()); }

  bool sync = false;    // this backward completes the window: count buckets down
  bool aside = false;   // the strategy stands aside (the first-batch twin check)
  bool launch = true;   // a complete bucket launches from the hook (overlap_comm); else at the flush

 private:
  // A Python callback with the GIL; a Python error goes back through autograd as itself.
  static void call(const py::function& fn, int64_t arg) {
    if (!fn) return;  // removed
    py::gil_scoped_acquire gil;
    try {
      fn(arg);
    } catch (py::error_already_set& error) {
      error.restore();
      throw python_error();
    }
  }

  std::vector<at::Tensor> params_;
  std::vector<int64_t> indices_;
  std::vector<at::Tensor> views_;
  int mode_;
  std::vector<int64_t> bucket_of_;
  std::vector<int64_t> sizes_;
  std::vector<int64_t> pending_;
  std::vector<uint8_t> ready_;
  py::bytearray used_;  // held: the bytes below are its buffer
  uint8_t* used_bytes_ = nullptr;
  int64_t used_size_ = 0;
  py::function on_bucket_;
  py::function on_twice_;
  std::vector<c10::intrusive_ptr<Node>> accumulators_;  // held: autograd reuses them, with their hooks
  std::vector<uintptr_t> keys_;
};

variable_list ArrivalHook::operator()(const variable_list& outputs, const variable_list& inputs) {
  owner->arrive(slot);
  return outputs;
}

}  // namespace

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.doc() = "Gradient arrivals counted in C++ hooks on the parameters' gradient accumulators";
  py::class_<GradArrivals>(m, "GradArrivals")
      .def(py::init<std::vector<at::Tensor>, std::vector<int64_t>, std::vector<at::Tensor>, int, std::vector<int64_t>,
                    int64_t, py::bytearray, py::function, py::function>(),
           py::arg("params"), py::arg("indices"), py::arg("views"), py::arg("mode"), py::arg("bucket_of"),
           py::arg("buckets"), py::arg("used"), py::arg("on_bucket"), py::arg("on_twice"))
      .def("arrive", &GradArrivals::arrive, py::arg("slot"))
      .def("reset", &GradArrivals::reset)
      .def("remove", &GradArrivals::remove)
      .def("hooks", &GradArrivals::hooks)
      .def_readwrite("sync", &GradArrivals::sync)
      .def_readwrite("aside", &GradArrivals::aside)
      .def_readwrite("launch", &GradArrivals::launch);
  m.attr("COUNT") = static_cast<int>(kCount);
  m.attr("ADOPT") = static_cast<int>(kAdopt);
  m.attr("ADD_AND_FREE") = static_cast<int>(kAddAndFree);
}
