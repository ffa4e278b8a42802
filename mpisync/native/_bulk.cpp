// Many tensors' version counters and gradients read in one call (mpisync/native/bulk.py).
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
#include <cstring>

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

// Whether grads[i] (contiguous, of its parameter's shape, when bulk_homes found it) still
// is that memory: ``p.grad.data = x`` moves it, ``p.grad.t_()`` changes its strides.
inline bool at_home(c10::TensorImpl* g, c10::TensorImpl* param, int64_t storage,
                    int64_t offset) {
  return reinterpret_cast<int64_t>(g->unsafe_storage().unsafeGetStorageImpl()) == storage &&
         g->storage_offset() == offset && g->is_contiguous() && g->sizes() == param->sizes();
}

// The first i whose params[i].grad is not the tensor grads[i], or whose grads[i] is not at
// home (above); n when every one is (0 where torch raised). scratch: n words.
int64_t bulk_grads_at(int64_t n, const int64_t* params, const int64_t* grads,
                      const int64_t* storages, const int64_t* offsets, int64_t* scratch) {
  auto metas = reinterpret_cast<c10::AutogradMetaInterface**>(scratch);
  try {
    for (int64_t i = 0; i < n; ++i) {
      metas[i] = impl(params[i])->autograd_meta();
    }
    for (int64_t i = 0; i < n; ++i) {
      if (metas[i] == nullptr || metas[i]->grad().unsafeGetTensorImpl() != impl(grads[i])) {
        return i;
      }
    }
    for (int64_t i = 0; i < n; ++i) {
      if (!at_home(impl(grads[i]), impl(params[i]), storages[i], offsets[i])) {
        return i;
      }
    }
    return n;
  } catch (...) {
    return 0;
  }
}

// Backward's gradients into their send buffers, for params whose .grad may be a tensor
// backward made (after zero_grad(set_to_none=True)): where every params[i].grad is either
// grads[i] at home (as bulk_grads_at), None, or a plain dense CPU tensor of its view's
// dtype and shape, contiguous, not requiring grad and lying outside the guarded ranges
// [lows[k], highs[k]) (mpisync's gradient memory), then for each: a new one is copied into
// grads[i] and params[i].grad becomes grads[i], has[i] = 1; a None one leaves has[i] = 0
// (grads[i] zeroed first where has[i] was 1, so that the others' sum is exact); one in
// place sets has[i] = 1 (has is indexed by index[i]). A copy or a zeroing counts as a
// write to grads[i] (its version counter moves, as torch's copy_ and zero_ move it).
// Returns n when done; -1, having changed nothing, where one is something else (the
// caller takes every gradient through torch then).
int64_t bulk_adopt(int64_t n, const int64_t* params, const int64_t* grads,
                   const int64_t* storages, const int64_t* offsets, int64_t nguards,
                   const int64_t* lows, const int64_t* highs, uint8_t* has,
                   const int64_t* index, int64_t* scratch) {
  auto given = reinterpret_cast<c10::TensorImpl**>(scratch);
  try {
    for (int64_t i = 0; i < n; ++i) {           // look at every gradient first
      c10::AutogradMetaInterface* meta = impl(params[i])->autograd_meta();
      c10::TensorImpl* g = meta == nullptr ? nullptr : meta->grad().unsafeGetTensorImpl();
      given[i] = g;
      c10::TensorImpl* view = impl(grads[i]);
      if (g == nullptr || !meta->grad().defined()) {
        given[i] = nullptr;
        continue;
      }
      if (g == view) {
        if (!at_home(g, impl(params[i]), storages[i], offsets[i])) {
          return -1;
        }
        continue;
      }
      c10::DispatchKeySet keys = g->key_set();
      if (g->device_type() != c10::DeviceType::CPU || g->layout() != c10::kStrided ||
          keys.has(c10::DispatchKey::Python) || keys.has(c10::DispatchKey::Functionalize) ||
          keys.has(c10::DispatchKey::NestedTensor) || g->is_conj() || g->is_neg() ||
          g->dtype() != view->dtype() || g->sizes() != view->sizes() ||
          !g->is_contiguous() || g->requires_grad() || !g->has_storage()) {
        return -1;
      }
      int64_t lo = reinterpret_cast<int64_t>(g->data());
      int64_t hi = lo + static_cast<int64_t>(g->numel() * g->itemsize());
      for (int64_t k = 0; k < nguards; ++k) {
        if (lo < highs[k] && lows[k] < hi) {
          return -1;
        }
      }
    }
    for (int64_t i = 0; i < n; ++i) {           // then take them
      c10::TensorImpl* g = given[i];
      c10::TensorImpl* view = impl(grads[i]);
      int64_t at = index[i];
      if (g == nullptr) {
        if (has[at]) {
          std::memset(view->mutable_data(), 0, view->numel() * view->itemsize());
          view->bump_version();        // a write, as torch's zero_() is
          has[at] = 0;
        }
        continue;
      }
      if (g != view) {
        std::memcpy(view->mutable_data(), g->data(), g->numel() * g->itemsize());
        view->bump_version();          // a write, as torch's copy_() is
        impl(params[i])->mutable_grad() =
            at::Tensor(c10::intrusive_ptr<c10::TensorImpl, c10::UndefinedTensorImpl>::
                           reclaim_copy(view));
      }
      has[at] = 1;
    }
    return n;
  } catch (...) {
    return -1;
  }
}

// zero_grad(set_to_none=True) for n parameters: every .grad None.
int64_t bulk_clear(int64_t n, const int64_t* params) {
  try {
    for (int64_t i = 0; i < n; ++i) {
      c10::AutogradMetaInterface* meta = impl(params[i])->autograd_meta();
      if (meta != nullptr && meta->grad().defined()) {
        impl(params[i])->mutable_grad().reset();
      }
    }
    return n;
  } catch (...) {
    return -1;
  }
}

}  // extern "C"
