/* A fake cuBLASLt (libcublasLt.so.13): the library a real cuBLAS 13 needs beside it, so that
 * gradsync's choice of one folder for both (core/src/device/libs.rs) is exercised. It only
 * reports its version; the fake cuBLAS computes without it. */
#include <stddef.h>

#define EXPORT __attribute__((visibility("default")))

/* major * 10000 + minor * 100 + patch, as cublasLt.h defines it. */
EXPORT size_t cublasLtGetVersion(void) { return 130000; }
