/* A fake cuBLAS (libcublas.so.13, needing libcublasLt.so.13 beside it as the real one does)
 * over the fake driver: a reference column-major SGEMM that
 * enforces BLAS's argument rules (an error status plus a loud line on stderr, as a wrong
 * leading dimension is a bug even where a real GPU happens to compute something), and checks
 * every matrix's whole extent against the live device allocations. */
#define _GNU_SOURCE
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>

#include "fake.h"

#define EXPORT __attribute__((visibility("default")))
#define HANDLE_MAGIC 0x424c4153U

typedef int cublasStatus_t;
enum {
    CUBLAS_STATUS_SUCCESS = 0,
    CUBLAS_STATUS_NOT_INITIALIZED = 1,
    CUBLAS_STATUS_ALLOC_FAILED = 3,
    CUBLAS_STATUS_INVALID_VALUE = 7,
};
enum { OP_N = 0, OP_T = 1, OP_C = 2 };

typedef struct {
    unsigned magic;
    void *stream;
    int math_mode;
} fake_blas;

static fake_blas *handle_of(void *h) {
    fake_blas *b = h;
    if (!b || b->magic != HANDLE_MAGIC) fake_cuda_fatal("cuBLAS: %p is not a live handle", h);
    return b;
}

/* cublasGetProperty(MAJOR_VERSION = 0, MINOR_VERSION = 1, PATCH_LEVEL = 2): 13.0.0. */
EXPORT cublasStatus_t cublasGetProperty(int type, int *value) {
    if (!value || type < 0 || type > 2) return CUBLAS_STATUS_INVALID_VALUE;
    *value = type == 0 ? 13 : 0;
    return CUBLAS_STATUS_SUCCESS;
}

EXPORT cublasStatus_t cublasCreate_v2(fake_blas **out) {
    if (!out) return CUBLAS_STATUS_INVALID_VALUE;
    if (fake_cuda_current_device() < 0) return CUBLAS_STATUS_NOT_INITIALIZED;
    fake_blas *b = calloc(1, sizeof *b);
    if (!b) return CUBLAS_STATUS_ALLOC_FAILED;
    b->magic = HANDLE_MAGIC;
    *out = b;
    return CUBLAS_STATUS_SUCCESS;
}

EXPORT cublasStatus_t cublasDestroy_v2(fake_blas *h) {
    handle_of(h)->magic = 0;
    free(h);
    return CUBLAS_STATUS_SUCCESS;
}

EXPORT cublasStatus_t cublasSetStream_v2(fake_blas *h, void *stream) {
    handle_of(h)->stream = stream;
    return CUBLAS_STATUS_SUCCESS;
}

EXPORT cublasStatus_t cublasGetStream_v2(fake_blas *h, void **stream) {
    if (!stream) return CUBLAS_STATUS_INVALID_VALUE;
    *stream = handle_of(h)->stream;
    return CUBLAS_STATUS_SUCCESS;
}

EXPORT cublasStatus_t cublasSetMathMode(fake_blas *h, int mode) {
    handle_of(h)->math_mode = mode;
    return CUBLAS_STATUS_SUCCESS;
}

EXPORT cublasStatus_t cublasGetMathMode(fake_blas *h, int *mode) {
    if (!mode) return CUBLAS_STATUS_INVALID_VALUE;
    *mode = handle_of(h)->math_mode;
    return CUBLAS_STATUS_SUCCESS;
}

EXPORT cublasStatus_t cublasSetWorkspace_v2(fake_blas *h, void *ws, size_t bytes) {
    (void)ws, (void)bytes;
    handle_of(h);
    return CUBLAS_STATUS_SUCCESS;
}

static cublasStatus_t refuse(const char *why, long a, long b) {
    fprintf(stderr, "fake-cublas: cublasSgemm refused: %s (%ld < %ld)\n", why, a, b);
    return CUBLAS_STATUS_INVALID_VALUE;
}

static long max1(long v) { return v > 1 ? v : 1; }

/* Die unless a stored `rows x cols` matrix with leading dimension `ld` lies in one allocation. */
static void check_matrix(const float *p, long rows, long cols, long ld, const char *what) {
    if (rows == 0 || cols == 0) return;
    size_t values = (size_t)ld * (size_t)(cols - 1) + (size_t)rows;
    fake_cuda_check((uint64_t)(uintptr_t)p, values * sizeof(float), what);
}

/* C = alpha op(A) op(B) + beta C, column-major, BLAS semantics: with beta = 0, C is written
 * without being read (NaN in it does not spread). */
EXPORT cublasStatus_t cublasSgemm_v2(fake_blas *h, int transa, int transb, int m, int n, int k, const float *alpha,
                                     const float *a, int lda, const float *b, int ldb, const float *beta, float *c,
                                     int ldc) {
    fake_blas *blas = handle_of(h);
    if ((transa != OP_N && transa != OP_T && transa != OP_C) || (transb != OP_N && transb != OP_T && transb != OP_C)) {
        return refuse("unknown operation", transa, 0);
    }
    if (m < 0) return refuse("m is negative", m, 0);
    if (n < 0) return refuse("n is negative", n, 0);
    if (k < 0) return refuse("k is negative", k, 0);
    long a_rows = transa == OP_N ? m : k, a_cols = transa == OP_N ? k : m;
    long b_rows = transb == OP_N ? k : n, b_cols = transb == OP_N ? n : k;
    if (lda < max1(a_rows)) return refuse("lda < max(1, rows of A)", lda, max1(a_rows));
    if (ldb < max1(b_rows)) return refuse("ldb < max(1, rows of B)", ldb, max1(b_rows));
    if (ldc < max1(m)) return refuse("ldc < max(1, m)", ldc, max1(m));
    if (!alpha || !beta) return refuse("alpha or beta is null", 0, 1);
    fake_cuda_count_gemm();
    fake_cuda_stream_drain(blas->stream, "cublasSgemm");
    if (m == 0 || n == 0) return CUBLAS_STATUS_SUCCESS;
    const float al = *alpha, be = *beta;
    int uses_ab = al != 0.0f && k > 0;
    if (uses_ab) {
        check_matrix(a, a_rows, a_cols, lda, "cublasSgemm A");
        check_matrix(b, b_rows, b_cols, ldb, "cublasSgemm B");
    }
    check_matrix(c, m, n, ldc, "cublasSgemm C");
    for (long j = 0; j < n; j++) {
        for (long i = 0; i < m; i++) {
            float s = 0.0f;
            if (uses_ab) {
                for (long p = 0; p < k; p++) {
                    float x = transa == OP_N ? a[i + p * (long)lda] : a[p + i * (long)lda];
                    float y = transb == OP_N ? b[p + j * (long)ldb] : b[j + p * (long)ldb];
                    s += x * y;
                }
            }
            float *out = &c[i + j * (long)ldc];
            *out = be == 0.0f ? al * s : al * s + be * *out;
        }
    }
    return CUBLAS_STATUS_SUCCESS;
}
