// Tensors the engine streams every decode step (packed weights, the KV cache) in 2 MB pages where the
// kernel allows transparent huge pages (arborl.engine.cpu_kernels.huge_empty).
//
// A decode step reads every weight once, 4 KB at a time in ordinary pages: a TLB miss each, and the
// hardware prefetchers stop at each page's end. On this project's reference EPYC, a batch-1 step's
// lm_head (113 MB) read at ~28 GB/s in 4 KB pages and ~50 GB/s in 2 MB pages. The memory is asked
// for with madvise(MADV_HUGEPAGE) before it is first touched, which is when the kernel backs it.
#include <torch/library.h>
#include <ATen/ATen.h>

#include <cstdlib>

#if defined(__linux__)
#include <sys/mman.h>
#endif

namespace {

constexpr int64_t kHuge = 2 << 20;

at::Tensor huge_empty(at::IntArrayRef sizes, at::ScalarType dtype) {
  int64_t numel = 1;
  for (const int64_t s : sizes) numel *= s;
  const int64_t bytes = numel * static_cast<int64_t>(c10::elementSize(dtype));
#if defined(__linux__)
  if (bytes >= kHuge) {
    const size_t rounded = static_cast<size_t>((bytes + kHuge - 1) / kHuge * kHuge);
    void* ptr = nullptr;
    if (posix_memalign(&ptr, kHuge, rounded) == 0) {
      madvise(ptr, rounded, MADV_HUGEPAGE);  // a hint: where THP is off the memory is ordinary pages
      return at::from_blob(ptr, sizes, [](void* p) { std::free(p); }, at::TensorOptions().dtype(dtype));
    }
  }
#endif
  return at::empty(sizes, at::TensorOptions().dtype(dtype));
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(arborl, m) {
  m.def("huge_empty(int[] sizes, ScalarType dtype) -> Tensor", &huge_empty);
}
