// gradsync's elementwise and reduction kernels for the CUDA backend, compiled at run time by
// NVRTC (see cuda.rs). Every kernel mirrors one method of the CPU backend (cpu.rs) and keeps its
// arithmetic order, so the two devices agree to rounding: the module is compiled with
// --fmad=false so `a * b + c` rounds twice, as it does on the CPU.
//
// Launch shape: 1-D grids with grid-stride loops, so any grid size is correct and the host may
// cap the number of blocks. Sizes are 64-bit so no index overflows on large layers.
// No kernel uses atomics or shared-memory trees: each output value is produced by one thread in
// a fixed order, which makes every result deterministic run to run.

typedef unsigned long long u64;

// Index of this thread in the grid, and the grid's stride.
#define GLOBAL_ID ((u64)blockIdx.x * (u64)blockDim.x + (u64)threadIdx.x)
#define GRID_STRIDE ((u64)gridDim.x * (u64)blockDim.x)

// z[i, j] += bias[j], then ReLU when `relu` (CPU: Cpu::bias_act). fmaxf returns the non-NaN
// operand, as f32::max does.
extern "C" __global__ void bias_act(float* z, const float* bias, u64 rows, u64 cols, int relu) {
    const u64 n = rows * cols;
    for (u64 i = GLOBAL_ID; i < n; i += GRID_STRIDE) {
        const float x = z[i] + bias[i % cols];
        z[i] = relu ? fmaxf(x, 0.0f) : x;
    }
}

// dz[i] = 0 where a[i] <= 0, a being the ReLU's output (CPU: Cpu::relu_backward).
extern "C" __global__ void relu_backward(float* dz, const float* a, u64 n) {
    for (u64 i = GLOBAL_ID; i < n; i += GRID_STRIDE) {
        if (a[i] <= 0.0f) {
            dz[i] = 0.0f;
        }
    }
}

// db[j] = sum_i dz[i, j] (+ db[j] when `accumulate`). One thread per column walks the rows in
// order, exactly the CPU's order, so the sums match it bit for bit. Neighbouring threads read
// neighbouring columns, so each row's loads coalesce.
extern "C" __global__ void bias_grad(float* db, const float* dz, u64 rows, u64 cols, int accumulate) {
    for (u64 j = GLOBAL_ID; j < cols; j += GRID_STRIDE) {
        float acc = accumulate ? db[j] : 0.0f;
        for (u64 i = 0; i < rows; ++i) {
            acc += dz[i * cols + j];
        }
        db[j] = acc;
    }
}

// Softmax cross-entropy, one thread per row (CPU: Cpu::softmax_xent). Writes the row's loss to
// stats[row] and 1 or 0 (arg-max is the label) to stats[rows + row]; the host sums both in row
// order. When dlogits is not null, writes scale * (softmax - onehot) into it. A label outside
// [0, cols) cannot index the row: its loss becomes NaN so the error shows instead of a stray
// read (the host checks labels before uploading them).
extern "C" __global__ void softmax_xent(const float* logits, const unsigned int* labels, float* dlogits,
                                        float* stats, u64 rows, u64 cols, float scale) {
    for (u64 r = GLOBAL_ID; r < rows; r += GRID_STRIDE) {
        const float* z = logits + r * cols;
        const u64 y = labels[r];
        if (y >= cols) {
            stats[r] = __int_as_float(0x7fc00000);
            stats[rows + r] = 0.0f;
            continue;
        }
        // First index of the maximum, as the CPU's strict `>` fold picks it.
        u64 arg = 0;
        float max = __int_as_float(0xff800000); // -inf: NVRTC has no math.h for INFINITY
        for (u64 j = 0; j < cols; ++j) {
            if (z[j] > max) {
                arg = j;
                max = z[j];
            }
        }
        float sum = 0.0f;
        for (u64 j = 0; j < cols; ++j) {
            sum += expf(z[j] - max);
        }
        stats[r] = logf(sum) - (z[y] - max);
        stats[rows + r] = arg == y ? 1.0f : 0.0f;
        if (dlogits != 0) {
            float* d = dlogits + r * cols;
            const float inv = 1.0f / sum;
            for (u64 j = 0; j < cols; ++j) {
                const float p = expf(z[j] - max) * inv;
                d[j] = scale * (p - (j == y ? 1.0f : 0.0f));
            }
        }
    }
}

// One SGD-with-momentum step, the arithmetic and order of optim::sgd_step:
// g = s*grad + wd*p; m = mu*m + g; p -= lr*m.
extern "C" __global__ void sgd(float* p, const float* grad, float* m, u64 n, float lr, float mu, float wd,
                               float s) {
    for (u64 i = GLOBAL_ID; i < n; i += GRID_STRIDE) {
        const float g = s * grad[i] + wd * p[i];
        const float mi = mu * m[i] + g;
        m[i] = mi;
        p[i] = p[i] - lr * mi;
    }
}

// v *= factor.
extern "C" __global__ void scale(float* v, u64 n, float factor) {
    for (u64 i = GLOBAL_ID; i < n; i += GRID_STRIDE) {
        v[i] = v[i] * factor;
    }
}
