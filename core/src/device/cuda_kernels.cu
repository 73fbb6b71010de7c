// gradsync's elementwise and reduction kernels for the CUDA backend, compiled at run time by
// NVRTC (see cuda.rs). Every kernel mirrors one method of the CPU backend (cpu.rs) and keeps its
// arithmetic order, so the two devices agree to rounding: the module is compiled with
// --fmad=false so `a * b + c` rounds twice, as it does on the CPU.
//
// Launch shape: 1-D grids with grid-stride loops, so any grid size is correct and the host may
// cap the number of blocks. Sizes are 64-bit so no index overflows on large layers (im2col and
// col2im compute their indices in 32 bits where all of them fit, below). The host
// asks for one thread per output value, and no thread's own loop grows with both the batch and
// the layer width: a kernel's parallel work grows with its data (a test on the fake CUDA
// records every launch's grid and checks it, core/tests/gpu.rs).
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

// Column sums of a rows x cols matrix, in the order both devices share (backend.rs,
// BIAS_GRAD_ROWS): rows are summed in groups of `group` consecutive rows, each group from zero,
// in row order. out[g, j] = (accumulate ? out[g, j] : 0) + sum of rows g*group .. of column j.
// One thread per (group, column), so the grid grows with the batch as well as the width; the
// host launches this again over the groups' sums until one group is left, and that last launch
// (accumulate set by the caller) writes the bias gradient. Neighbouring threads read
// neighbouring columns, so each row's loads coalesce.
extern "C" __global__ void bias_grad(float* out, const float* dz, u64 rows, u64 cols, u64 group, int accumulate) {
    const u64 groups = rows == 0 ? 1 : (rows + group - 1) / group;
    const u64 n = groups * cols;
    for (u64 t = GLOBAL_ID; t < n; t += GRID_STRIDE) {
        const u64 g = t / cols, j = t % cols;
        const u64 first = g * group;
        const u64 last = first + group < rows ? first + group : rows;
        float acc = accumulate ? out[t] : 0.0f;
        for (u64 i = first; i < last; ++i) {
            acc += dz[i * cols + j];
        }
        out[t] = acc;
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

// ---- Layer kernels (the layer graph, net.rs): image activations are CNHW (backend.rs) ----

// v = max(v, 0) in place (CPU: cpu_layers::relu).
extern "C" __global__ void relu(float* v, u64 n) {
    for (u64 i = GLOBAL_ID; i < n; i += GRID_STRIDE) {
        v[i] = fmaxf(v[i], 0.0f);
    }
}

// y = x, or y += x (CPU: cpu_layers::add_into).
extern "C" __global__ void add_into(float* y, const float* x, u64 n, int accumulate) {
    for (u64 i = GLOBAL_ID; i < n; i += GRID_STRIDE) {
        y[i] = accumulate ? y[i] + x[i] : x[i];
    }
}

// dst[j, i, k] (=|+=) src[i, j, k], src being outer x middle x inner; one thread per
// destination value (CPU: cpu_layers::swap_axes).
extern "C" __global__ void swap_axes(float* dst, const float* src, u64 outer, u64 middle, u64 inner,
                                     int accumulate) {
    const u64 n = outer * middle * inner;
    for (u64 t = GLOBAL_ID; t < n; t += GRID_STRIDE) {
        const u64 k = t % inner, i = t / inner % outer, j = t / (inner * outer);
        const float v = src[(i * middle + j) * inner + k];
        dst[t] = accumulate ? dst[t] + v : v;
    }
}

// The row `r = (c*k + ky)*k + kx` of a convolution's column matrix reads input pixel
// (oy*stride - pad + ky, ox*stride - pad + kx) of channel c; the column `(n*oh + oy)*ow + ox`.
// im2col and col2im do several divisions per value to find where it comes from; a 64-bit
// division is a long emulated sequence on a GPU (Nsight Compute on an H200: resnet18's im2col
// at about 270 GB/s, half of a batch-256 step's kernel time with col2im), and even a 32-bit one
// is some twenty instructions (on an H100, with 32-bit indices: im2col still 22% of the step,
// bound by its integer work). So their index arithmetic runs in 32 bits (type I) wherever every
// index, and every index plus the grid's stride, stays below 2^31, and each division by a
// layer's size there is one multiply-high and a shift by a magic number the host worked out
// (`Div` in cuda/layers.rs: exact for every n < 2^31); in plain 64-bit divisions otherwise.
// Either gives the same quotients, so the same values in the same order.
__device__ __forceinline__ bool fits_32(u64 a, u64 b) {
    const u64 limit = 1ull << 31;
    return a < limit && b < limit && GRID_STRIDE < limit;
}

// n / d: `magic` holds the multiplier (low 32 bits; 0 when d is 1) and the shift (high 32).
template <typename I>
__device__ __forceinline__ I quot(I n, I d, u64 magic);
template <>
__device__ __forceinline__ unsigned int quot<unsigned int>(unsigned int n, unsigned int, u64 magic) {
    const unsigned int mul = (unsigned int)magic;
    return mul == 0 ? n : __umulhi(n, mul) >> (unsigned int)(magic >> 32);
}
template <>
__device__ __forceinline__ u64 quot<u64>(u64 n, u64 d, u64) {
    return n / d;
}

// One thread per column entry (CPU: cpu_layers::im2col). The magics divide by cols, k*k, k,
// oh*ow and ow.
template <typename I>
__device__ __forceinline__ void im2col_in(float* col, const float* x, I channels, I batch, I height, I width, I k,
                                          I stride, I pad, I oh, I ow, const u64* magic) {
    typedef long long S;
    const I plane = oh * ow, kk = k * k;
    const I cols = batch * plane;
    const I n = channels * kk * cols;
    for (I t = (I)GLOBAL_ID; t < n; t += (I)GRID_STRIDE) {
        const I r = quot<I>(t, cols, magic[0]), q = t - r * cols;
        const I c = quot<I>(r, kk, magic[1]), kr = r - c * kk;
        const I ky = quot<I>(kr, k, magic[2]), kx = kr - ky * k;
        const I s = quot<I>(q, plane, magic[3]), p = q - s * plane;
        const I oy = quot<I>(p, ow, magic[4]), ox = p - oy * ow;
        const S iy = (S)(oy * stride + ky) - (S)pad;
        const S ix = (S)(ox * stride + kx) - (S)pad;
        float v = 0.0f;
        if (iy >= 0 && iy < (S)height && ix >= 0 && ix < (S)width) {
            v = x[((c * batch + s) * height + (I)iy) * width + (I)ix];
        }
        col[t] = v;
    }
}

extern "C" __global__ void im2col(float* col, const float* x, u64 channels, u64 batch, u64 height, u64 width,
                                  u64 k, u64 stride, u64 pad, u64 oh, u64 ow, u64 m_cols, u64 m_kk, u64 m_k,
                                  u64 m_plane, u64 m_ow) {
    const u64 magic[5] = {m_cols, m_kk, m_k, m_plane, m_ow};
    if (fits_32(channels * k * k * batch * oh * ow, channels * batch * height * width)) {
        typedef unsigned int U;
        im2col_in<U>(col, x, (U)channels, (U)batch, (U)height, (U)width, (U)k, (U)stride, (U)pad, (U)oh, (U)ow,
                     magic);
    } else {
        im2col_in<u64>(col, x, channels, batch, height, width, k, stride, pad, oh, ow, magic);
    }
}

// The adjoint of im2col: each input value gathers the column entries it was copied to, in
// (ky, kx) order, from zero or from what dx holds (accumulate). One thread per input value
// (CPU: cpu_layers::col2im adds them in the same order). The magics divide by height*width,
// width, batch and stride.
template <typename I>
__device__ __forceinline__ void col2im_in(float* dx, const float* col, I channels, I batch, I height, I width, I k,
                                          I stride, I pad, I oh, I ow, int accumulate, const u64* magic) {
    typedef long long S;
    const I cols = batch * oh * ow;
    const I hw = height * width;
    const I n = channels * batch * hw;
    for (I t = (I)GLOBAL_ID; t < n; t += (I)GRID_STRIDE) {
        const I cs = quot<I>(t, hw, magic[0]), p = t - cs * hw;
        const I y = quot<I>(p, width, magic[1]), x = p - y * width;
        const I c = quot<I>(cs, batch, magic[2]), s = cs - c * batch;
        float acc = accumulate ? dx[t] : 0.0f;
        for (I ky = 0; ky < k; ++ky) {
            const S sy = (S)(y + pad) - (S)ky;
            if (sy < 0) break;
            const I uy = (I)sy, oy = quot<I>(uy, stride, magic[3]);
            if (oy * stride != uy || oy >= oh) continue;
            for (I kx = 0; kx < k; ++kx) {
                const S sx = (S)(x + pad) - (S)kx;
                if (sx < 0) break;
                const I ux = (I)sx, ox = quot<I>(ux, stride, magic[3]);
                if (ox * stride != ux || ox >= ow) continue;
                acc += col[((c * k + ky) * k + kx) * cols + (s * oh + oy) * ow + ox];
            }
        }
        dx[t] = acc;
    }
}

extern "C" __global__ void col2im(float* dx, const float* col, u64 channels, u64 batch, u64 height, u64 width,
                                  u64 k, u64 stride, u64 pad, u64 oh, u64 ow, int accumulate, u64 m_hw,
                                  u64 m_width, u64 m_batch, u64 m_stride) {
    const u64 magic[4] = {m_hw, m_width, m_batch, m_stride};
    if (fits_32(channels * k * k * batch * oh * ow, channels * batch * height * width)) {
        typedef unsigned int U;
        col2im_in<U>(dx, col, (U)channels, (U)batch, (U)height, (U)width, (U)k, (U)stride, (U)pad, (U)oh, (U)ow,
                     accumulate, magic);
    } else {
        col2im_in<u64>(dx, col, channels, batch, height, width, k, stride, pad, oh, ow, accumulate, magic);
    }
}

// The index within its plane of window (oy, ox)'s first maximum; a NaN wins and stays
// (CPU: cpu_layers::window_argmax).
__device__ __forceinline__ u64 window_argmax(const float* plane, u64 height, u64 width, u64 k, u64 stride,
                                             u64 pad, u64 oy, u64 ox) {
    u64 best = ~0ull;
    float best_v = 0.0f;
    for (u64 ky = 0; ky < k; ++ky) {
        const long long iy = (long long)(oy * stride + ky) - (long long)pad;
        if (iy < 0 || iy >= (long long)height) continue;
        for (u64 kx = 0; kx < k; ++kx) {
            const long long ix = (long long)(ox * stride + kx) - (long long)pad;
            if (ix < 0 || ix >= (long long)width) continue;
            const u64 at = (u64)iy * width + (u64)ix;
            const float v = plane[at];
            if (best == ~0ull || (best_v == best_v && !(v <= best_v))) {
                best = at;
                best_v = v;
            }
        }
    }
    return best;
}

// Max pooling over `planes` planes of height x width; one thread per output
// (CPU: cpu_layers::max_pool).
extern "C" __global__ void max_pool(float* y, const float* x, u64 planes, u64 height, u64 width, u64 k,
                                    u64 stride, u64 pad, u64 oh, u64 ow) {
    const u64 n = planes * oh * ow;
    for (u64 t = GLOBAL_ID; t < n; t += GRID_STRIDE) {
        const u64 p = t / (oh * ow), i = t % (oh * ow);
        const float* plane = x + p * height * width;
        y[t] = plane[window_argmax(plane, height, width, k, stride, pad, i / ow, i % ow)];
    }
}

// Its gradient: each input value gathers, in window order, the gradients of the windows whose
// maximum it is. One thread per input value (CPU: cpu_layers::max_pool_backward).
extern "C" __global__ void max_pool_backward(float* dx, const float* dy, const float* x, u64 planes, u64 height,
                                             u64 width, u64 k, u64 stride, u64 pad, u64 oh, u64 ow,
                                             int accumulate) {
    const u64 n = planes * height * width;
    for (u64 t = GLOBAL_ID; t < n; t += GRID_STRIDE) {
        const u64 p = t / (height * width), at = t % (height * width);
        const u64 iy = at / width, ix = at % width;
        const float* plane = x + p * height * width;
        float acc = accumulate ? dx[t] : 0.0f;
        for (u64 oy = 0; oy < oh; ++oy) {
            if (oy * stride + k <= iy + pad || oy * stride > iy + pad) continue;
            for (u64 ox = 0; ox < ow; ++ox) {
                if (ox * stride + k <= ix + pad || ox * stride > ix + pad) continue;
                if (window_argmax(plane, height, width, k, stride, pad, oy, ox) == at) {
                    acc += dy[(p * oh + oy) * ow + ox];
                }
            }
        }
        dx[t] = acc;
    }
}

// Global average pooling: y[n, c] = (sum over p of x[c, n, p], in order) / pixels. One thread
// per output (CPU: cpu_layers::avg_pool).
extern "C" __global__ void avg_pool(float* y, const float* x, u64 channels, u64 batch, u64 pixels) {
    const u64 n = channels * batch;
    for (u64 t = GLOBAL_ID; t < n; t += GRID_STRIDE) {
        const u64 s = t / channels, c = t % channels;
        const float* src = x + (c * batch + s) * pixels;
        float acc = 0.0f;
        for (u64 p = 0; p < pixels; ++p) {
            acc += src[p];
        }
        y[t] = acc / (float)pixels;
    }
}

// Its gradient: dx[c, n, p] (=|+=) dy[n, c] / pixels (CPU: cpu_layers::avg_pool_backward).
extern "C" __global__ void avg_pool_backward(float* dx, const float* dy, u64 channels, u64 batch, u64 pixels,
                                             int accumulate) {
    const u64 n = channels * batch * pixels;
    for (u64 t = GLOBAL_ID; t < n; t += GRID_STRIDE) {
        const u64 s = t / pixels % batch, c = t / (pixels * batch);
        const float v = dy[s * channels + c] / (float)pixels;
        dx[t] = accumulate ? dx[t] + v : v;
    }
}

// One pass of a per-channel sum, in ChannelSum's order (backend.rs): channel c's m terms are
// dealt into groups = ceil(m / group) groups, and out[c, j] = the sum, from zero, of terms
// j, j + groups, j + 2 groups, ... mode 0: a; 1: (a - center[c])^2; 2: a * (b - center[c]).
// One thread per (channel, group), so the threads of a warp read neighbouring values at every
// step and the loads coalesce (Nsight Compute on an H100 saw the earlier runs of 32 consecutive
// values per thread at a sixth of the memory's bandwidth). The host repeats plain passes (mode
// 0) over the groups' sums until at most `group` are left, and the last pass, with one group,
// sums those in order (CPU: cpu_layers::grouped_sum).
extern "C" __global__ void channel_sums(float* out, const float* a, const float* b, const float* center,
                                        u64 channels, u64 m, u64 group, int mode) {
    const u64 groups = m == 0 ? 1 : (m + group - 1) / group;
    const u64 n = channels * groups;
    for (u64 t = GLOBAL_ID; t < n; t += GRID_STRIDE) {
        const u64 c = t / groups, j = t % groups;
        const float* row = a + c * m;
        float acc = 0.0f;
        if (mode == 0) {
            for (u64 i = j; i < m; i += groups) acc += row[i];
        } else if (mode == 1) {
            const float mu = center[c];
            for (u64 i = j; i < m; i += groups) {
                const float d = row[i] - mu;
                acc += d * d;
            }
        } else {
            const float mu = center[c];
            const float* other = b + c * m;
            for (u64 i = j; i < m; i += groups) acc += row[i] * (other[i] - mu);
        }
        out[t] = acc;
    }
}

// Batch-norm statistics in place, one thread per channel (CPU: cpu_layers::norm_stats).
// saved = mean | sum of squared deviations (training) becomes mean | invstd, and running =
// mean | var moves towards the batch; in evaluation saved becomes the running mean | invstd.
extern "C" __global__ void norm_stats(float* saved, float* running, u64 channels, u64 count, int train, float eps,
                                      float momentum) {
    for (u64 c = GLOBAL_ID; c < channels; c += GRID_STRIDE) {
        if (train) {
            const float var = saved[channels + c] / (float)count;
            const float unbiased = saved[channels + c] / (float)(count - 1);
            saved[channels + c] = 1.0f / sqrtf(var + eps);
            running[c] = (1.0f - momentum) * running[c] + momentum * saved[c];
            running[channels + c] = (1.0f - momentum) * running[channels + c] + momentum * unbiased;
        } else {
            saved[c] = running[c];
            saved[channels + c] = 1.0f / sqrtf(running[channels + c] + eps);
        }
    }
}

// y = (x - mean) * invstd * gamma + beta per channel (CPU: cpu_layers::norm_apply).
extern "C" __global__ void norm_apply(float* y, const float* x, const float* saved, const float* affine,
                                      u64 channels, u64 m) {
    const u64 n = channels * m;
    for (u64 t = GLOBAL_ID; t < n; t += GRID_STRIDE) {
        const u64 c = t / m;
        y[t] = (x[t] - saved[c]) * saved[channels + c] * affine[c] + affine[channels + c];
    }
}

// Batch-norm backward from sums = sum dy | sum dy (x - mean) (CPU: cpu_layers::norm_backward).
// Threads below `channels` write the affine gradients when d_affine is not null; every thread
// of the value range writes dx when dx is not null.
extern "C" __global__ void norm_backward(float* dx, float* d_affine, const float* dy, const float* x,
                                         const float* saved, const float* affine, const float* sums,
                                         u64 channels, u64 m, u64 count, int accumulate, int accumulate_dx) {
    const u64 n = dx == 0 ? channels : (channels * m > channels ? channels * m : channels);
    const float inv_count = 1.0f / (float)count;
    for (u64 t = GLOBAL_ID; t < n; t += GRID_STRIDE) {
        if (d_affine != 0 && t < channels) {
            const float dg = sums[channels + t] * saved[channels + t], db = sums[t];
            d_affine[t] = accumulate ? d_affine[t] + dg : dg;
            d_affine[channels + t] = accumulate ? d_affine[channels + t] + db : db;
        }
        if (dx != 0 && t < channels * m) {
            const u64 c = t / m;
            const float invstd = saved[channels + c];
            const float mean_dy = sums[c] * inv_count, mean_dot = sums[channels + c] * inv_count;
            const float xc = x[t] - saved[c];
            const float d = affine[c] * invstd * (dy[t] - mean_dy - xc * invstd * invstd * mean_dot);
            dx[t] = accumulate_dx ? dx[t] + d : d;
        }
    }
}

// ---- Half precision for NCCL's fp16/bf16 all-reduce (`--compress fp16|bf16`) ----
//
// Written with integer operations only, as transcriptions of the `half` crate's conversions
// (f32_to_f16_fallback, f16_to_f32_fallback, f32_to_bf16, bf16_to_f32), which the host codecs
// (core/src/compress.rs, the TCP ring's packed sums) use: the two paths round every value to
// the same bits. CUDA's __float2half_rn would differ on NaNs (it returns one canonical NaN);
// these keep the sign and the top payload bits and set the quiet bit, as the host does.
// Round to nearest, ties to even; an f32 beyond the format's range becomes +-inf; a value below
// half the smallest subnormal becomes a signed zero.

// f32 bits -> IEEE binary16 bits.
__device__ __forceinline__ unsigned short f16_bits(unsigned int x) {
    const unsigned int sign = x & 0x80000000u, exp = x & 0x7f800000u, man = x & 0x007fffffu;
    if (exp == 0x7f800000u) {
        // Infinity, or a NaN made quiet keeping its top payload bits.
        return (unsigned short)((sign >> 16) | 0x7c00u | (man != 0 ? 0x0200u : 0u) | (man >> 13));
    }
    const unsigned int half_sign = sign >> 16;
    const int half_exp = (int)(exp >> 23) - 127 + 15;
    if (half_exp >= 0x1f) {
        return (unsigned short)(half_sign | 0x7c00u);
    }
    if (half_exp <= 0) {
        // Subnormal (or zero): the hidden bit joins the mantissa, shifted by the deficit.
        if (14 - half_exp > 24) {
            return (unsigned short)half_sign;
        }
        const unsigned int m = man | 0x00800000u;
        unsigned int half_man = m >> (14 - half_exp);
        const unsigned int round_bit = 1u << (13 - half_exp);
        // Round up when the bit below is set and either something below it or the result's
        // last bit is (ties to even).
        if ((m & round_bit) != 0 && (m & (3u * round_bit - 1u)) != 0) {
            half_man += 1;
        }
        return (unsigned short)(half_sign | half_man);
    }
    const unsigned int bits = half_sign | ((unsigned int)half_exp << 10) | (man >> 13);
    const unsigned int round_bit = 0x00001000u;
    // A carry out of the mantissa increments the exponent, up to infinity: still correct.
    return (unsigned short)((man & round_bit) != 0 && (man & (3u * round_bit - 1u)) != 0 ? bits + 1 : bits);
}

// IEEE binary16 bits -> f32 bits (exact).
__device__ __forceinline__ unsigned int f16_widen(unsigned int h) {
    const unsigned int sign = (h & 0x8000u) << 16, exp = h & 0x7c00u, man = h & 0x03ffu;
    if ((h & 0x7fffu) == 0) {
        return sign;
    }
    if (exp == 0x7c00u) {
        return man == 0 ? (sign | 0x7f800000u) : (sign | 0x7fc00000u | (man << 13));
    }
    if (exp == 0) {
        // Subnormal: normalise, moving the leading one into the hidden bit.
        int e = 0;
        unsigned int m = man;
        while ((m & 0x0400u) == 0) {
            m <<= 1;
            ++e;
        }
        return sign | ((unsigned int)(127 - 15 - e + 1) << 23) | ((m & 0x03ffu) << 13);
    }
    return sign | (((exp >> 10) + 127 - 15) << 23) | (man << 13);
}

// f32 bits -> bfloat16 bits.
__device__ __forceinline__ unsigned short bf16_bits(unsigned int x) {
    if ((x & 0x7fffffffu) > 0x7f800000u) {
        return (unsigned short)((x >> 16) | 0x0040u);
    }
    const unsigned int round_bit = 0x00008000u;
    return (unsigned short)((x & round_bit) != 0 && (x & (3u * round_bit - 1u)) != 0 ? (x >> 16) + 1 : x >> 16);
}

// bfloat16 bits -> f32 bits (exact).
__device__ __forceinline__ unsigned int bf16_widen(unsigned int h) {
    return ((h & 0x7fffu) > 0x7f80u ? (h | 0x0040u) : h) << 16;
}

// dst[i] = src[i] * scale rounded to fp16 (bf16 when `bf16`), as bits. A NaN is not
// multiplied: the device's arithmetic would replace its payload, which the host keeps.
extern "C" __global__ void round_to_half(unsigned short* dst, const float* src, u64 n, int bf16, float scale) {
    for (u64 i = GLOBAL_ID; i < n; i += GRID_STRIDE) {
        const float v = src[i];
        const unsigned int x = __float_as_uint(v != v ? v : v * scale);
        dst[i] = bf16 ? bf16_bits(x) : f16_bits(x);
    }
}

// dst[i] = the fp16 (bf16 when `bf16`) value whose bits are src[i], as f32 (exact), times
// `scale` (a NaN as it is, as above).
extern "C" __global__ void widen_half(float* dst, const unsigned short* src, u64 n, int bf16, float scale) {
    for (u64 i = GLOBAL_ID; i < n; i += GRID_STRIDE) {
        const unsigned int h = src[i];
        const float v = __uint_as_float(bf16 ? bf16_widen(h) : f16_widen(h));
        dst[i] = v != v ? v : v * scale;
    }
}

// An embedding bag's forward: y[s, k] = sum over j in off[s]..off[s+1], in order, of
// w[j] * table[ids[j], k]. One thread per output (CPU: cpu_layers::bag_forward).
extern "C" __global__ void bag_forward(float* y, const float* table, const unsigned int* off, const unsigned int* ids,
                                       const float* w, u64 batch, u64 dim) {
    const u64 n = batch * dim;
    for (u64 t = GLOBAL_ID; t < n; t += GRID_STRIDE) {
        const u64 s = t / dim, k = t % dim;
        float acc = 0.0f;
        for (unsigned int j = off[s]; j < off[s + 1]; ++j) {
            acc += w[j] * table[(u64)ids[j] * dim + k];
        }
        y[t] = acc;
    }
}

// Its backward into the rows a batch named: grad[rows[u], k] (=|+=) the sum over e in
// off[u]..off[u+1], in order, of w[e] * dy[samples[e], k]. The rows are distinct, so one thread
// owns each output (CPU: cpu_layers::bag_backward).
extern "C" __global__ void bag_backward(float* grad, const float* dy, const unsigned int* rows, const unsigned int* off,
                                        const unsigned int* samples, const float* w, u64 count, u64 dim,
                                        int accumulate) {
    const u64 n = count * dim;
    for (u64 t = GLOBAL_ID; t < n; t += GRID_STRIDE) {
        const u64 u = t / dim, k = t % dim;
        float acc = 0.0f;
        for (unsigned int e = off[u]; e < off[u + 1]; ++e) {
            acc += w[e] * dy[(u64)samples[e] * dim + k];
        }
        float* out = grad + (u64)rows[u] * dim + k;
        *out = accumulate ? *out + acc : acc;
    }
}

// Zero rows[0..count] of v (dim values a row), or its first count rows when rows is null
// (CPU: Cpu::zero_rows).
extern "C" __global__ void zero_rows(float* v, const unsigned int* rows, u64 count, u64 dim) {
    const u64 n = count * dim;
    for (u64 t = GLOBAL_ID; t < n; t += GRID_STRIDE) {
        const u64 u = t / dim, k = t % dim;
        const u64 r = rows ? (u64)rows[u] : u;
        v[r * dim + k] = 0.0f;
    }
}

// The SGD step of `sgd` over rows[0..count] (the first count rows when rows is null), skipping
// a row whose gradient is all zero: it and its momentum stay (lazy momentum; CPU: optim::sgd_row).
// One thread per value, each reading its row's gradient to decide.
extern "C" __global__ void sgd_rows(float* p, const float* grad, float* m, const unsigned int* rows, u64 count, u64 dim,
                                    float lr, float mu, float wd, float s) {
    const u64 n = count * dim;
    for (u64 t = GLOBAL_ID; t < n; t += GRID_STRIDE) {
        const u64 u = t / dim, k = t % dim;
        const u64 base = (rows ? (u64)rows[u] : u) * dim;
        bool zero = true;
        for (u64 j = 0; j < dim; ++j) {
            zero = zero && grad[base + j] == 0.0f;
        }
        if (zero) continue;
        const u64 i = base + k;
        const float g = s * grad[i] + wd * p[i];
        const float mi = mu * m[i] + g;
        m[i] = mi;
        p[i] = p[i] - lr * mi;
    }
}
