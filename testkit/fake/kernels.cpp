// The project's kernels (core/src/device/cuda_kernels.cu) compiled for the host, and the
// serial launcher the fake driver calls. Each kernel's parameters are unpacked from the
// launch's array by its own C++ signature, and every pointer parameter must point into a live
// device allocation (a null pointer is allowed: kernels use it for "absent").
#include <cstddef>
#include <cstdint>
#include <type_traits>
#include <utility>

#include "cuda_host.h"
#include "fake.h"
#include "kernels.h"

thread_local fake_dim3 threadIdx, blockIdx, blockDim, gridDim;

#include GRADSYNC_KERNELS_SOURCE

namespace {

template <typename T>
void check_param(const char *name, T value) {
    if constexpr (std::is_pointer_v<T>) {
        if (value != nullptr) fake_cuda_check(reinterpret_cast<uintptr_t>(value), 1, name);
    }
}

template <typename... A, std::size_t... I>
void check_all(void (*)(A...), const char *name, void **p, std::index_sequence<I...>) {
    (check_param(name, *static_cast<A *>(p[I])), ...);
}

template <typename... A, std::size_t... I>
void call(void (*k)(A...), void **p, std::index_sequence<I...>) {
    k(*static_cast<A *>(p[I])...);
}

template <typename... A>
constexpr auto indices(void (*)(A...)) {
    return std::index_sequence_for<A...>{};
}

template <auto K>
void check(const char *name, void **p) {
    check_all(K, name, p, indices(K));
}

template <auto K>
void run(void **p) {
    call(K, p, indices(K));
}

}  // namespace

#define KERNEL(k) fake_kernel{#k, check<k>, run<k>}
static const fake_kernel KERNELS[] = {
    KERNEL(bias_act), KERNEL(relu_backward), KERNEL(bias_grad), KERNEL(softmax_xent), KERNEL(sgd), KERNEL(scale),
    KERNEL(round_to_half), KERNEL(widen_half), KERNEL(relu), KERNEL(add_into), KERNEL(swap_axes), KERNEL(im2col),
    KERNEL(col2im), KERNEL(max_pool), KERNEL(max_pool_backward), KERNEL(avg_pool), KERNEL(avg_pool_backward),
    KERNEL(channel_sums), KERNEL(norm_stats), KERNEL(norm_apply), KERNEL(norm_backward),
    KERNEL(bag_forward), KERNEL(bag_backward), KERNEL(zero_rows), KERNEL(sgd_rows),
};

extern "C" const fake_kernel *fake_kernel_find(const char *name) {
    for (const auto &k : KERNELS) {
        if (strcmp(k.name, name) == 0) return &k;
    }
    return nullptr;
}

extern "C" void fake_kernel_run(const fake_kernel *k, unsigned gx, unsigned gy, unsigned gz, unsigned bx, unsigned by,
                                unsigned bz, void **params) {
    k->check(k->name, params);
    gridDim = {gx, gy, gz};
    blockDim = {bx, by, bz};
    for (unsigned z = 0; z < gz; ++z)
        for (unsigned y = 0; y < gy; ++y)
            for (unsigned x = 0; x < gx; ++x) {
                blockIdx = {x, y, z};
                for (unsigned tz = 0; tz < bz; ++tz)
                    for (unsigned ty = 0; ty < by; ++ty)
                        for (unsigned tx = 0; tx < bx; ++tx) {
                            threadIdx = {tx, ty, tz};
                            k->run(params);
                        }
            }
}
