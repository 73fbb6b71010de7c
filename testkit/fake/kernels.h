/* The project's CUDA kernels compiled for the host (kernels.cpp), as the fake driver sees them. */
#ifndef GRADSYNC_FAKE_KERNELS_H
#define GRADSYNC_FAKE_KERNELS_H

#ifdef __cplusplus
extern "C" {
#endif

typedef struct fake_kernel {
    const char *name;
    /* Checks the launch's pointer parameters (cuLaunchKernel's array) against the live
     * allocations. */
    void (*check)(const char *name, void **params);
    /* Runs one grid point with the launch's parameters. */
    void (*run)(void **params);
} fake_kernel;

/* The kernel called `name`, or NULL. */
const fake_kernel *fake_kernel_find(const char *name);
/* Run `k` over a gx x gy x gz grid of bx x by x bz blocks, one thread after another. */
void fake_kernel_run(const fake_kernel *k, unsigned gx, unsigned gy, unsigned gz, unsigned bx, unsigned by,
                     unsigned bz, void **params);

#ifdef __cplusplus
}
#endif
#endif
