// Many tensors' version counters and gradients read in one call (mpisync/bulk.py).
//
// Each tensor is given by its TensorImpl's address (``Tensor._cdata``); the caller keeps
// every such tensor alive and unswappable (a weak reference makes torch.utils.swap_tensors
// refuse it) for as long as it passes its address. A function returns -1 when torch raised
// (a tensor without a version counter): the caller then asks torch one tensor at a time,
// which raises or answers as torch does.
//
// The tensors' metadata is scattered over the heap and mostly out of the caches when a
// step reads it, so each loop does one kind of load for every tensor before the next kind:
// the loads of one loop do not wait for each other, and the processor overlaps their
// misses.
#include <ATen/core/Tensor.h>

#include <cstdint>

namespace {

inline c10::TensorImpl* impl(int64_t address) {
  return reinterpret_cast<c10::TensorImpl*>(address);
}

}  // namespace

extern "C" {

// out[i] = tensors[i]._version; returns how many differ from before[i], or -1 (see above).
int64_t bulk_versions(int64_t n, const int64_t* tensors, int64_t* out, const int64_t* before) {
  try {
    int64_t moved = 0;
    for (int64_t i = 0; i < n; ++i) {
      out[i] = static_cast<int64_t>(impl(tensors[i])->version_counter().current_version());
      moved += out[i] != before[i];
    }
    return moved;
  } catch (...) {
    return -1;
  }
}

// Where each of n tensors' memory is: its storage's address and its offset in it.
void bulk_homes(int64_t n, const int64_t* tensors, int64_t* storages, int64_t* offsets) {
  for (int64_t i = 0; i < n; ++i) {
    c10::TensorImpl* t = impl(tensors[i]);
    storages[i] = reinterpret_cast<int64_t>(t->unsafe_storage().unsafeGetStorageImpl());
    offsets[i] = t->storage_offset();
  }
}

// The first i whose params[i].grad is not the tensor grads[i], or whose grads[i] no longer
// lies where bulk_homes found it (``p.grad.data = x`` moves it); n when every one is.
// scratch: n words.
int64_t bulk_grads_at(int64_t n, const int64_t* params, const int64_t* grads,
                      const int64_t* storages, const int64_t* offsets, int64_t* scratch) {
  auto metas = reinterpret_cast<c10::AutogradMetaInterface**>(scratch);
  for (int64_t i = 0; i < n; ++i) {
    metas[i] = impl(params[i])->autograd_meta();
  }
  for (int64_t i = 0; i < n; ++i) {
    if (metas[i] == nullptr || metas[i]->grad().unsafeGetTensorImpl() != impl(grads[i])) {
      return i;
    }
  }
  for (int64_t i = 0; i < n; ++i) {
    c10::TensorImpl* g = impl(grads[i]);
    if (reinterpret_cast<int64_t>(g->unsafe_storage().unsafeGetStorageImpl()) != storages[i] ||
        g->storage_offset() != offsets[i]) {
      return i;
    }
  }
  return n;
}

}  // extern "C"
