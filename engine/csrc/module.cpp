// The extension module engine/kernels.py builds: every kernel of engine/csrc, bound once.
#include "kernels.h"

// NOTE: the kernels keep the GIL. Released (py::gil_scoped_release), another thread of a worker (its event loop
// taking acknowledgements, its heartbeat) could take the GIL during any of a step's ~30 kernel calls, and the
// engine thread then waited for it after the call: a `tiny` decode gap went from 0.78 to 1.1-1.3 ms in
// `pdcluster bench path`, with no gain at 32 streams. The interpreter's switch interval (0.5 ms in workers) still
// lets other threads in between calls.
PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("attend", &pdcluster::attend, "Paged attention over work items, reading the KV cache in place");
  m.def("pack_linear", &pdcluster::pack_linear, "A float32 [N, K] weight blocked for linear(): [ceil(N/16), K, 16]");
  m.def("linear", &pdcluster::linear, "x [M, K] @ W.T (+ bias) with W from pack_linear(): [M, N]");
}
