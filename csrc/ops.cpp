// The `cat_fast` op namespace, defined here exactly once. Each op's schema lives beside its CPU
// kernel, in csrc/cpu/<op>.cpp (`TORCH_LIBRARY_FRAGMENT(cat_fast, m) { m.def(...); }`), so adding
// an op means adding files: csrc/cpu/<op>.cpp (schema + CPU kernel), csrc/cuda/<op>.cu and
// csrc/checks/<op>.h (the argument checks both kernels call).
// Semantics of each op: docs/KERNELS.md.
#include <torch/library.h>

TORCH_LIBRARY(cat_fast, m) {}

#ifdef CAT_FAST_PYTHON_MODULE
// Lets `import cat_fast._C` load this library (and so register the ops) from Python.
#include <Python.h>
extern "C" PyObject* PyInit__C(void) {
  static struct PyModuleDef module = {PyModuleDef_HEAD_INIT, "_C", nullptr, -1, nullptr};
  return PyModule_Create(&module);
}
#endif
