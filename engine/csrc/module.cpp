// The extension module engine/kernels.py builds: every kernel of engine/csrc, bound once.
#include "kernels.h"

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("attend", &pdcluster::attend, "Paged attention over work items, reading the KV cache in place");
  m.def("pack_linear", &pdcluster::pack_linear, "A float32 [N, K] weight blocked for linear(): [ceil(N/16), K, 16]");
  m.def("linear", &pdcluster::linear, "x [M, K] @ W.T (+ bias) with W from pack_linear(): [M, N]");
}
