// Tensors the engine streams every decode step (packed weights, the KV cache) in 2 MB pages where the
// kernel allows transparent huge pages (arborl.engine.cpu_kernels.huge_zeros).
//
// A decode step reads every weight once, 4 KB at a time in ordinary pages: a TLB miss each, and the
// hardware prefetchers stop at each page's end. On this project's reference EPYC, a batch-1 step's
// lm_head (113 MB) read at ~28 GB/s in 4 KB pages and ~50 GB/s in 2 MB pages. The memory is asked
// for with madvise(MADV_HUGEPAGE) before it is first touched, which is when the kernel backs it.
#include <torch/library.h>
#include <ATen/ATen.h>

#include <cstdint>

#if defined(__linux__)
#include <sys/mman.h>
#endif

namespace {

constexpr int64_t kHuge = 2 << 20;

// Zero-filled: fresh anonymous memory, which the kernel backs (and zeroes) page by page as it is first
// touched; a caller that must not pay that mid-rollout touches it at once (the KV cache).
at::Tensor huge_zeros(at::IntArrayRef sizes, at::ScalarType dtype) {
  int64_t numel = 1;
  for (const int64_t s : sizes) numel *= s;
  const int64_t bytes = numel * static_cast<int64_t>(c10::elementSize(dtype));
#if defined(__linux__)
  if (bytes >= kHuge) {
    // 2 MB more than asked, to start at a 2 MB boundary inside it
    const size_t mapped = static_cast<size_t>(bytes + kHuge);
    void* base = mmap(nullptr, mapped, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
    if (base != MAP_FAILED) {
      const uintptr_t start = (reinterpret_cast<uintptr_t>(base) + kHuge - 1) / kHuge * kHuge;
      void* ptr = reinterpret_cast<void*>(start);
      madvise(ptr, static_cast<size_t>(bytes), MADV_HUGEPAGE);  // a hint: where THP is off, ordinary pages
      return at::from_blob(ptr, sizes, [base, mapped](void*) { munmap(base, mapped); }, at::TensorOptions().dtype(dtype));
    }
  }
#endif
  return at::zeros(sizes, at::TensorOptions().dtype(dtype));
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(arborl, m) {
  m.def("huge_zeros(int[] sizes, ScalarType dtype) -> Tensor", &huge_zeros);
}
