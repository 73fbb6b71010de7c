/* What the fake libcuda exports to the fake libcublas and libnccl: checked access to "device"
 * memory (host memory handed out by cuMemAlloc), counters, and the pending-work tickets through
 * which a collective that waits for other ranks keeps a stream busy. Nothing here is part of
 * the CUDA API; real programs never call it. */
#ifndef GRADSYNC_FAKE_H
#define GRADSYNC_FAKE_H

#include <stddef.h>
#include <stdint.h>

#ifdef __cplusplus
extern "C" {
#endif

/* Abort the process after printing "fake-cuda: FATAL: ..." (a test failure nobody can miss). */
__attribute__((noreturn, format(printf, 1, 2))) void fake_cuda_fatal(const char *fmt, ...);
/* Die unless [ptr, ptr + bytes) lies inside one live allocation; `what` names the access. */
void fake_cuda_check(uint64_t ptr, size_t bytes, const char *what);
/* Whether ptr lies inside a live allocation. */
int fake_cuda_is_live(uint64_t ptr);
/* Counters printed at exit. */
void fake_cuda_count_gemm(void);
void fake_cuda_count_collective(void);

/* Pending work on a stream: a collective that has to wait for other ranks takes a ticket on
 * its stream; the stream (and events recorded on it after) stay busy until the ticket ends.
 * Buffers named with fake_cuda_ticket_uses must not be freed before that. */
uint64_t fake_cuda_ticket_begin(void *stream);
void fake_cuda_ticket_uses(uint64_t ticket, uint64_t ptr, size_t bytes);
void fake_cuda_ticket_end(uint64_t ticket);
/* Block until every ticket pending on `stream` has ended (a fatal error after a long time). */
void fake_cuda_stream_drain(void *stream, const char *what);
/* The device of the calling thread's current context, or -1. */
int fake_cuda_current_device(void);

#ifdef __cplusplus
}
#endif
#endif
