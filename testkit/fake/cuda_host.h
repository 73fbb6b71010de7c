// Just enough of CUDA C++ for gradsync's kernels to compile as host C++ and run serially:
// the launch's indices are thread-local variables that fake_kernel_run steps through, one
// (block, thread) pair after another, so a grid-stride loop covers its range exactly as on a GPU.
#ifndef GRADSYNC_CUDA_HOST_H
#define GRADSYNC_CUDA_HOST_H

#include <math.h>
#include <string.h>

struct fake_dim3 {
    unsigned x, y, z;
};

extern thread_local fake_dim3 threadIdx, blockIdx, blockDim, gridDim;

#define __global__
#define __device__
#define __forceinline__ inline
#define __restrict__

static inline float __int_as_float(int i) {
    float f;
    memcpy(&f, &i, sizeof f);
    return f;
}

static inline float __uint_as_float(unsigned int u) {
    float f;
    memcpy(&f, &u, sizeof f);
    return f;
}

static inline unsigned int __umulhi(unsigned int a, unsigned int b) {
    return (unsigned int)(((unsigned long long)a * b) >> 32);
}

static inline unsigned int __float_as_uint(float f) {
    unsigned int u;
    memcpy(&u, &f, sizeof u);
    return u;
}

#endif
