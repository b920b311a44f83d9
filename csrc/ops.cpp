// The op surface of cat_fast: every kernel op's schema, in one place.
// CPU implementations: csrc/cpu/*.cpp; CUDA implementations: csrc/cuda/*.cu.
// Semantics of each op: docs/KERNELS.md.
#include <torch/library.h>

TORCH_LIBRARY(cat_fast, m) {
  m.def("cmix_forward(Tensor h, Tensor lam, Tensor partner) -> Tensor");
  m.def("cmix_backward(Tensor grad, Tensor h, Tensor lam, Tensor partner) -> (Tensor, Tensor)");
  m.def("cal_objective_forward(Tensor logits, Tensor labels, float gamma, float eta) -> Tensor");
  m.def("cal_objective_backward(Tensor grad, Tensor logits, Tensor labels, float gamma, float eta) -> Tensor");
  m.def("cal_step_(Tensor(a!) lam, Tensor grad, float lr, float p, float lo, float hi) -> ()");
  m.def("crm_loss_forward(Tensor logits, Tensor cf_logits, Tensor labels, float a1, float a2, int reduction, bool detach_weight) -> (Tensor, Tensor)");
  m.def("crm_loss_backward(Tensor grad, Tensor logits, Tensor cf_logits, Tensor labels, Tensor stats, float a1, float a2, int reduction, bool detach_weight) -> (Tensor, Tensor)");
  m.def("gs_row_dots(Tensor x, Tensor y) -> Tensor");
  m.def("gs_row_combine(Tensor x, Tensor y, Tensor coef) -> (Tensor, Tensor)");
}

#ifdef CAT_FAST_PYTHON_MODULE
// Lets `import cat_fast._C` load this library (and so register the ops) from Python.
#include <Python.h>
extern "C" PyObject* PyInit__C(void) {
  static struct PyModuleDef module = {PyModuleDef_HEAD_INIT, "_C", nullptr, -1, nullptr};
  return PyModule_Create(&module);
}
#endif
