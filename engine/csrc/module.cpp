// The extension module engine/kernels.py builds: every kernel of engine/csrc, bound once.
#include "kernels.h"

// NOTE: the kernels run without the GIL (as torch's own ops do): a worker's event loop, which relays the tokens of
// the step before, runs on another core meanwhile instead of waiting for the whole step. Arguments are converted
// before the release and the result after it, so no Python object is touched without the GIL.
using NoGil = py::call_guard<py::gil_scoped_release>;

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("attend", &pdcluster::attend, NoGil(), "Paged attention over work items, reading the KV cache in place");
  m.def("pack_linear", &pdcluster::pack_linear, "A float32 [N, K] weight blocked for linear(): [ceil(N/16), K, 16]");
  m.def("linear", &pdcluster::linear, NoGil(), "x [M, K] @ W.T (+ bias) with W from pack_linear(): [M, N]");
}
