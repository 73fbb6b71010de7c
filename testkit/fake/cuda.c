/* A fake CUDA driver (libcuda.so.1) for tests on machines without a GPU.
 *
 * "Device" memory is host memory: every allocation is its own mmap, placed so that its last
 * byte touches a PROT_NONE guard page, and freed allocations stay mapped PROT_NONE for a while.
 * Every copy and every pointer handed to a kernel, GEMM or collective is checked against the
 * live allocations; a bad one ends the process with "fake-cuda: FATAL: ..." naming the
 * allocation (out of bounds, use after free, not a device pointer). A kernel that reads or
 * writes past an allocation or into a freed one faults on the guard, and the SIGSEGV handler
 * names the allocation the same way. Allocations alive when the process exits are reported and
 * turn the exit status into 86.
 *
 * Work runs at once on the calling thread (kernels serially, see kernels.cpp), so streams are
 * in order trivially. The one exception is a collective of the fake NCCL that waits for other
 * ranks: it holds a "ticket" on its stream, and the stream, events recorded on it and streams
 * that wait on those events stay busy until the ticket ends. Freeing a buffer that a pending
 * collective still uses (other than in order on that collective's own stream) is fatal.
 *
 * Counters (kernel launches, GEMM calls, collectives, allocations, copies between host and
 * device memory) are printed at exit and appended to the file named by FAKE_CUDA_REPORT, one
 * `key=value` line per process. With
 * FAKE_CUDA_WORK_LOG naming a file, every kernel launch, GEMM and copy appends one line to it
 * as it happens, after the process id: `PID kernel NAME GX GY GZ BX BY BZ` (its grid and
 * block), so a test can check that a kernel's parallel work grows with its data; `PID gemm`;
 * `PID copy dtoh|htod|dtod BYTES`, so a test can check when a bucket was staged; `PID alloc
 * BYTES` (device or pinned memory) and `PID sync` (a stream, event or context synchronised),
 * so a test can count what a training step costs.
 *
 * Page-locked host memory (cuMemHostAlloc) is made like device memory, guard page and
 * bookkeeping included: overruns fault, and a pinned buffer alive at exit is a leak.
 *
 * Settings (environment): FAKE_CUDA_DEVICES (default 4), FAKE_CUDA_CC (compute capability,
 * default 9.0), FAKE_CUDA_DRIVER (driver version as cuDriverGetVersion reports it, default
 * 13000; it also bounds the PTX ISA version accepted, as a real driver does),
 * FAKE_CUDA_HANG_SECS (how long a stream may wait for a collective before that is fatal,
 * default 120). */
#define _GNU_SOURCE
#include <errno.h>
#include <pthread.h>
#include <signal.h>
#include <stdarg.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <time.h>
#include <unistd.h>

#include "fake.h"
#include "kernels.h"

typedef int CUresult;
typedef int CUdevice;
typedef uint64_t CUdeviceptr;

enum {
    CUDA_SUCCESS = 0,
    CUDA_ERROR_INVALID_VALUE = 1,
    CUDA_ERROR_OUT_OF_MEMORY = 2,
    CUDA_ERROR_NOT_INITIALIZED = 3,
    CUDA_ERROR_INVALID_DEVICE = 101,
    CUDA_ERROR_INVALID_IMAGE = 200,
    CUDA_ERROR_INVALID_CONTEXT = 201,
    CUDA_ERROR_UNSUPPORTED_PTX_VERSION = 222,
    CUDA_ERROR_INVALID_HANDLE = 400,
    CUDA_ERROR_NOT_FOUND = 500,
    CUDA_ERROR_NOT_READY = 600,
    CUDA_ERROR_NOT_SUPPORTED = 801,
    CUDA_ERROR_UNKNOWN = 999,
};

#define EXPORT __attribute__((visibility("default")))
#define MAX_DEVICES 16
#define STREAM_MAGIC 0x5354524dU
#define EVENT_MAGIC 0x45564e54U
#define MODULE_MAGIC 0x4d4f444cU

static pthread_mutex_t lock = PTHREAD_MUTEX_INITIALIZER;
static pthread_cond_t changed = PTHREAD_COND_INITIALIZER;
static int initialized;
static long page;

/* ---- settings ---- */

static int env_int(const char *name, int fallback) {
    const char *v = getenv(name);
    return v && *v ? atoi(v) : fallback;
}

static int device_count(void) {
    int n = env_int("FAKE_CUDA_DEVICES", 4);
    return n < 0 ? 0 : n > MAX_DEVICES ? MAX_DEVICES : n;
}

static void compute_capability(int *major, int *minor) {
    const char *v = getenv("FAKE_CUDA_CC");
    *major = 9;
    *minor = 0;
    if (v && *v) sscanf(v, "%d.%d", major, minor);
}

static int driver_version(void) { return env_int("FAKE_CUDA_DRIVER", 13000); }

/* ---- failure reports ---- */

EXPORT void fake_cuda_fatal(const char *fmt, ...) {
    char msg[1024];
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(msg, sizeof msg, fmt, ap);
    va_end(ap);
    fprintf(stderr, "fake-cuda: FATAL: %s\n", msg);
    fflush(stderr);
    abort();
}

/* ---- the work log ---- */

/* Append one line to FAKE_CUDA_WORK_LOG, when set: written whole and flushed at once, so a test
 * reading the file sees all the work done so far. */
__attribute__((format(printf, 1, 2))) static void log_work(const char *fmt, ...) {
    static pthread_mutex_t log_lock = PTHREAD_MUTEX_INITIALIZER;
    static FILE *log;
    static int opened;
    pthread_mutex_lock(&log_lock);
    if (!opened) {
        opened = 1;
        const char *path = getenv("FAKE_CUDA_WORK_LOG");
        if (path && *path && !(log = fopen(path, "a"))) fake_cuda_fatal("cannot open FAKE_CUDA_WORK_LOG %s", path);
    }
    if (log) {
        fprintf(log, "%d ", (int)getpid());
        va_list ap;
        va_start(ap, fmt);
        vfprintf(log, fmt, ap);
        va_end(ap);
        fputc('\n', log);
        fflush(log);
    }
    pthread_mutex_unlock(&log_lock);
}

/* ---- counters ---- */

static uint64_t n_launches, n_gemms, n_collectives, n_allocs, n_live, n_peak, n_host_copies;

EXPORT void fake_cuda_count_gemm(void) {
    __atomic_fetch_add(&n_gemms, 1, __ATOMIC_RELAXED);
    log_work("gemm");
}
EXPORT void fake_cuda_count_collective(void) { __atomic_fetch_add(&n_collectives, 1, __ATOMIC_RELAXED); }

/* ---- allocations ---- */

typedef struct {
    uint64_t id;
    uint64_t base; /* what cuMemAlloc returned */
    size_t size;
    char *map;     /* the whole mapping, guard page included */
    size_t map_len;
} alloc_t;

static alloc_t *live;
static size_t n_live_slots, cap_live;
/* Freed allocations, kept mapped PROT_NONE so a late access faults and can be named. */
#define FREED_KEPT 4096
static alloc_t freed[FREED_KEPT];
static size_t freed_next;

static alloc_t *find_live(uint64_t ptr) {
    for (size_t i = 0; i < n_live_slots; i++) {
        if (ptr >= live[i].base && ptr < live[i].base + live[i].size) return &live[i];
    }
    return NULL;
}

static alloc_t *find_freed(uint64_t ptr) {
    for (size_t i = 0; i < FREED_KEPT; i++) {
        if (freed[i].map && ptr >= freed[i].base && ptr < freed[i].base + freed[i].size) return &freed[i];
    }
    return NULL;
}

/* The allocation whose guard page holds `addr`. */
static alloc_t *find_guard(uint64_t addr) {
    for (size_t i = 0; i < n_live_slots; i++) {
        uint64_t end = (uint64_t)(uintptr_t)(live[i].map + live[i].map_len);
        if (addr >= live[i].base && addr < end) return &live[i];
    }
    return NULL;
}

EXPORT int fake_cuda_is_live(uint64_t ptr) {
    pthread_mutex_lock(&lock);
    int ok = find_live(ptr) != NULL;
    pthread_mutex_unlock(&lock);
    return ok;
}

EXPORT void fake_cuda_check(uint64_t ptr, size_t bytes, const char *what) {
    pthread_mutex_lock(&lock);
    alloc_t *a = find_live(ptr);
    if (!a) {
        alloc_t *f = find_freed(ptr);
        if (f) {
            fake_cuda_fatal("%s: use after free: 0x%llx is in allocation #%llu (%zu bytes), already freed", what,
                            (unsigned long long)ptr, (unsigned long long)f->id, f->size);
        }
        fake_cuda_fatal("%s: 0x%llx is not in any live device allocation", what, (unsigned long long)ptr);
    }
    if (bytes > a->base + a->size - ptr) {
        fake_cuda_fatal("%s: out of bounds: %zu bytes at offset %llu of allocation #%llu, which holds %zu bytes", what,
                        bytes, (unsigned long long)(ptr - a->base), (unsigned long long)a->id, a->size);
    }
    pthread_mutex_unlock(&lock);
}

static struct sigaction previous_segv;

/* A fault on a guard page or in a freed allocation is a kernel or GEMM running outside its
 * buffer: name the allocation. Any other fault goes to the handler that was there before. */
static void on_segv(int sig, siginfo_t *info, void *uctx) {
    /* This runs on the thread's small signal stack (8 KiB under Rust): a static buffer and
     * write(2), not fprintf, whose unbuffered path alone takes more stack than that. */
    static char msg[256];
    uint64_t addr = (uint64_t)(uintptr_t)info->si_addr;
    /* No locking: the process is about to die, and the lock may be held by this thread. */
    alloc_t *f = find_freed(addr);
    alloc_t *g = f ? NULL : find_guard(addr);
    int n = 0;
    if (f) {
        n = snprintf(msg, sizeof msg, "fake-cuda: FATAL: a kernel touched 0x%llx in allocation #%llu (%zu bytes), already freed\n",
                     (unsigned long long)addr, (unsigned long long)f->id, f->size);
    } else if (g) {
        n = snprintf(msg, sizeof msg, "fake-cuda: FATAL: a kernel touched 0x%llx, %llu bytes past the end of allocation #%llu (%zu bytes)\n",
                     (unsigned long long)addr, (unsigned long long)(addr - (g->base + g->size)), (unsigned long long)g->id,
                     g->size);
    }
    if (n > 0) {
        ssize_t w = write(2, msg, (size_t)n < sizeof msg ? (size_t)n : sizeof msg - 1);
        (void)w;
        signal(SIGABRT, SIG_DFL);
        abort();
    }
    if (previous_segv.sa_flags & SA_SIGINFO) {
        previous_segv.sa_sigaction(sig, info, uctx);
    } else if (previous_segv.sa_handler != SIG_DFL && previous_segv.sa_handler != SIG_IGN) {
        previous_segv.sa_handler(sig);
    } else {
        signal(sig, SIG_DFL);
    }
}

static CUresult alloc_locked(CUdeviceptr *out, size_t size) {
    if (!out || size == 0) return CUDA_ERROR_INVALID_VALUE;
    size_t body = (size + 3) & ~(size_t)3; /* 4-byte alignment: the end of a float buffer touches the guard */
    size_t map_len = ((body + page - 1) / page + 1) * page;
    char *map = mmap(NULL, map_len, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
    if (map == MAP_FAILED) return CUDA_ERROR_OUT_OF_MEMORY;
    char *guard = map + map_len - page;
    if (mprotect(guard, page, PROT_NONE) != 0) fake_cuda_fatal("mprotect: %s", strerror(errno));
    /* Fresh device memory holds garbage: NaN bytes make a read before any write visible. */
    memset(map, 0xff, map_len - page);
    if (n_live_slots == cap_live) {
        cap_live = cap_live ? 2 * cap_live : 64;
        live = realloc(live, cap_live * sizeof *live);
        if (!live) fake_cuda_fatal("out of host memory");
    }
    alloc_t a = {++n_allocs, (uint64_t)(uintptr_t)(guard - body), size, map, map_len};
    live[n_live_slots++] = a;
    if (++n_live > n_peak) n_peak = n_live;
    *out = a.base;
    return CUDA_SUCCESS;
}

/* ---- tickets: pending collectives ---- */

typedef struct {
    int done;
    uint64_t *ptrs;
    size_t *lens;
    size_t n, cap;
} ticket_t;

static ticket_t *tickets; /* index = ticket id - 1 */
static size_t n_tickets, cap_tickets;

typedef struct {
    uint64_t *ids;
    size_t n, cap;
} ticket_list;

static void list_push(ticket_list *l, uint64_t id) {
    if (l->n == l->cap) {
        l->cap = l->cap ? 2 * l->cap : 8;
        l->ids = realloc(l->ids, l->cap * sizeof *l->ids);
        if (!l->ids) fake_cuda_fatal("out of host memory");
    }
    l->ids[l->n++] = id;
}

/* Drop tickets that have ended; returns how many remain. */
static size_t list_prune(ticket_list *l) {
    size_t k = 0;
    for (size_t i = 0; i < l->n; i++) {
        if (!tickets[l->ids[i] - 1].done) l->ids[k++] = l->ids[i];
    }
    l->n = k;
    return k;
}

typedef struct {
    uint64_t ptr;
    size_t size;
} deferred_free;

typedef struct fake_stream {
    unsigned magic;
    int device;
    ticket_list pending;
    /* cuMemFreeAsync calls queued behind pending tickets. */
    deferred_free *frees;
    size_t n_frees, cap_frees;
} fake_stream;

typedef struct {
    unsigned magic;
    ticket_list waits_for;
    struct timespec when;
} fake_event;

static fake_stream default_stream = {STREAM_MAGIC, 0, {0}, 0, 0, 0};

static fake_stream *stream_of(void *h) {
    uintptr_t v = (uintptr_t)h;
    if (v <= 2) return &default_stream; /* 0, CU_STREAM_LEGACY, CU_STREAM_PER_THREAD */
    fake_stream *s = h;
    if (s->magic != STREAM_MAGIC) fake_cuda_fatal("0x%llx is not a stream", (unsigned long long)v);
    return s;
}

static void free_locked(uint64_t ptr, const char *what, fake_stream *ordered_on);

/* Frees queued on a stream run once nothing is pending on it. */
static void run_deferred_frees(fake_stream *s) {
    if (s->n_frees == 0 || list_prune(&s->pending) > 0) return;
    size_t n = s->n_frees;
    s->n_frees = 0;
    for (size_t i = 0; i < n; i++) free_locked(s->frees[i].ptr, "cuMemFreeAsync (queued)", s);
}

static fake_stream **all_streams;
static size_t n_streams, cap_streams;

EXPORT uint64_t fake_cuda_ticket_begin(void *stream) {
    pthread_mutex_lock(&lock);
    fake_stream *s = stream_of(stream);
    if (n_tickets == cap_tickets) {
        cap_tickets = cap_tickets ? 2 * cap_tickets : 64;
        tickets = realloc(tickets, cap_tickets * sizeof *tickets);
        if (!tickets) fake_cuda_fatal("out of host memory");
    }
    tickets[n_tickets] = (ticket_t){0};
    uint64_t id = ++n_tickets;
    list_push(&s->pending, id);
    pthread_mutex_unlock(&lock);
    return id;
}

EXPORT void fake_cuda_ticket_uses(uint64_t id, uint64_t ptr, size_t bytes) {
    pthread_mutex_lock(&lock);
    ticket_t *t = &tickets[id - 1];
    if (t->n == t->cap) {
        t->cap = t->cap ? 2 * t->cap : 4;
        t->ptrs = realloc(t->ptrs, t->cap * sizeof *t->ptrs);
        t->lens = realloc(t->lens, t->cap * sizeof *t->lens);
        if (!t->ptrs || !t->lens) fake_cuda_fatal("out of host memory");
    }
    t->ptrs[t->n] = ptr;
    t->lens[t->n++] = bytes;
    pthread_mutex_unlock(&lock);
}

EXPORT void fake_cuda_ticket_end(uint64_t id) {
    pthread_mutex_lock(&lock);
    ticket_t *t = &tickets[id - 1];
    t->done = 1;
    free(t->ptrs);
    free(t->lens);
    t->ptrs = NULL;
    t->lens = NULL;
    t->n = t->cap = 0;
    run_deferred_frees(&default_stream);
    for (size_t i = 0; i < n_streams; i++) run_deferred_frees(all_streams[i]);
    pthread_cond_broadcast(&changed);
    pthread_mutex_unlock(&lock);
}

/* Wait, with the lock held, until nothing is pending on `s`. */
static void drain_locked(fake_stream *s, const char *what) {
    int limit = env_int("FAKE_CUDA_HANG_SECS", 120);
    struct timespec deadline;
    clock_gettime(CLOCK_REALTIME, &deadline);
    deadline.tv_sec += limit;
    while (list_prune(&s->pending) > 0) {
        if (pthread_cond_timedwait(&changed, &lock, &deadline) == ETIMEDOUT) {
            fake_cuda_fatal("%s: the stream waited %d s for a collective that never completed (a rank that "
                            "never joined, and nobody aborted the communicator)",
                            what, limit);
        }
    }
}

EXPORT void fake_cuda_stream_drain(void *stream, const char *what) {
    pthread_mutex_lock(&lock);
    drain_locked(stream_of(stream), what);
    pthread_mutex_unlock(&lock);
}

/* Free `ptr` (an allocation's start). `ordered_on` is the stream the free is queued on: a
 * pending collective on that same stream is finished by then; any other is a use after free. */
static void free_locked(uint64_t ptr, const char *what, fake_stream *ordered_on) {
    size_t i = 0;
    while (i < n_live_slots && live[i].base != ptr) i++;
    if (i == n_live_slots) {
        if (find_freed(ptr)) fake_cuda_fatal("%s: double free of 0x%llx", what, (unsigned long long)ptr);
        fake_cuda_fatal("%s: 0x%llx is not the start of a device allocation", what, (unsigned long long)ptr);
    }
    alloc_t a = live[i];
    for (size_t t = 0; t < n_tickets; t++) {
        ticket_t *tk = &tickets[t];
        if (tk->done) continue;
        int mine = 0;
        if (ordered_on) {
            for (size_t k = 0; k < ordered_on->pending.n; k++) mine |= ordered_on->pending.ids[k] == t + 1;
        }
        if (mine) continue;
        for (size_t k = 0; k < tk->n; k++) {
            if (tk->ptrs[k] < a.base + a.size && a.base < tk->ptrs[k] + tk->lens[k]) {
                fake_cuda_fatal("%s: allocation #%llu (%zu bytes) freed while a collective still uses it (NCCL "
                                "would keep writing into freed memory)",
                                what, (unsigned long long)a.id, a.size);
            }
        }
    }
    live[i] = live[--n_live_slots];
    n_live--;
    char *guard = a.map + a.map_len - page;
    madvise(a.map, a.map_len - page, MADV_DONTNEED);
    mprotect(a.map, a.map_len - page, PROT_NONE);
    (void)guard;
    alloc_t *slot = &freed[freed_next++ % FREED_KEPT];
    if (slot->map) munmap(slot->map, slot->map_len);
    *slot = a;
}

/* ---- contexts ---- */

typedef struct {
    int device;
    int retained;
} fake_ctx;

static fake_ctx contexts[MAX_DEVICES];
static __thread fake_ctx *current;

EXPORT int fake_cuda_current_device(void) { return current ? current->device : -1; }

static void report_at_exit(void) __attribute__((destructor));

static void report_at_exit(void) {
    if (!initialized) return;
    char line[512];
    snprintf(line, sizeof line,
             "pid=%d launches=%llu gemms=%llu collectives=%llu allocations=%llu peak_live=%llu alive_at_exit=%llu "
             "host_copies=%llu\n",
             (int)getpid(), (unsigned long long)n_launches, (unsigned long long)n_gemms,
             (unsigned long long)n_collectives, (unsigned long long)n_allocs, (unsigned long long)n_peak,
             (unsigned long long)n_live, (unsigned long long)n_host_copies);
    fprintf(stderr, "fake-cuda: %s", line);
    const char *path = getenv("FAKE_CUDA_REPORT");
    if (path && *path) {
        FILE *f = fopen(path, "a");
        if (f) {
            fputs(line, f);
            fclose(f);
        }
    }
    if (n_live > 0) {
        for (size_t i = 0; i < n_live_slots && i < 20; i++) {
            fprintf(stderr, "fake-cuda: LEAK: allocation #%llu (%zu bytes) was never freed\n",
                    (unsigned long long)live[i].id, live[i].size);
        }
        fflush(stderr);
        _exit(86);
    }
}

/* ---- the driver API ---- */

#define NEED_INIT()                                   \
    do {                                              \
        if (!initialized) return CUDA_ERROR_NOT_INITIALIZED; \
    } while (0)

EXPORT CUresult cuInit(unsigned flags) {
    if (flags != 0) return CUDA_ERROR_INVALID_VALUE;
    pthread_mutex_lock(&lock);
    if (!initialized) {
        page = sysconf(_SC_PAGESIZE);
        struct sigaction sa;
        memset(&sa, 0, sizeof sa);
        sa.sa_sigaction = on_segv;
        sa.sa_flags = SA_SIGINFO | SA_ONSTACK;
        sigemptyset(&sa.sa_mask);
        sigaction(SIGSEGV, &sa, &previous_segv);
        for (int d = 0; d < MAX_DEVICES; d++) contexts[d].device = d;
        initialized = 1;
    }
    pthread_mutex_unlock(&lock);
    return CUDA_SUCCESS;
}

EXPORT CUresult cuDriverGetVersion(int *v) {
    if (!v) return CUDA_ERROR_INVALID_VALUE;
    *v = driver_version();
    return CUDA_SUCCESS;
}

/* NVRTC asks the driver for private tables; saying "not supported" makes it do without. */
EXPORT CUresult cuGetExportTable(const void **table, const void *id) {
    (void)id;
    if (table) *table = NULL;
    return CUDA_ERROR_NOT_SUPPORTED;
}

EXPORT CUresult cuGetProcAddress_v2(const char *symbol, void **pfn, int version, uint64_t flags, int *status) {
    (void)symbol, (void)version, (void)flags;
    if (pfn) *pfn = NULL;
    if (status) *status = 1; /* CU_GET_PROC_ADDRESS_SYMBOL_NOT_FOUND */
    return CUDA_ERROR_NOT_FOUND;
}

EXPORT CUresult cuDeviceGetCount(int *n) {
    NEED_INIT();
    if (!n) return CUDA_ERROR_INVALID_VALUE;
    *n = device_count();
    return CUDA_SUCCESS;
}

EXPORT CUresult cuDeviceGet(CUdevice *d, int ordinal) {
    NEED_INIT();
    if (!d) return CUDA_ERROR_INVALID_VALUE;
    if (ordinal < 0 || ordinal >= device_count()) return CUDA_ERROR_INVALID_DEVICE;
    *d = ordinal;
    return CUDA_SUCCESS;
}

EXPORT CUresult cuDeviceGetName(char *name, int len, CUdevice d) {
    NEED_INIT();
    if (!name || len <= 0) return CUDA_ERROR_INVALID_VALUE;
    if (d < 0 || d >= device_count()) return CUDA_ERROR_INVALID_DEVICE;
    snprintf(name, (size_t)len, "gradsync fake GPU %d (host memory)", d);
    return CUDA_SUCCESS;
}

EXPORT CUresult cuDeviceTotalMem_v2(size_t *bytes, CUdevice d) {
    NEED_INIT();
    if (!bytes) return CUDA_ERROR_INVALID_VALUE;
    if (d < 0 || d >= device_count()) return CUDA_ERROR_INVALID_DEVICE;
    *bytes = (size_t)16 << 30;
    return CUDA_SUCCESS;
}

EXPORT CUresult cuDeviceGetAttribute(int *v, int attr, CUdevice d) {
    NEED_INIT();
    if (!v) return CUDA_ERROR_INVALID_VALUE;
    if (d < 0 || d >= device_count()) return CUDA_ERROR_INVALID_DEVICE;
    int major, minor;
    compute_capability(&major, &minor);
    switch (attr) {
    case 1: *v = 1024; break;          /* max threads per block */
    case 2: case 3: case 4: *v = 1024; break; /* max block dims (x; y, z are smaller on real GPUs) */
    case 5: *v = 0x7fffffff; break;    /* max grid x */
    case 6: case 7: *v = 65535; break; /* max grid y, z */
    case 8: *v = 48 * 1024; break;     /* shared memory per block */
    case 10: *v = 32; break;           /* warp size */
    case 13: *v = 1500000; break;      /* clock rate, kHz */
    case 16: *v = 4; break;            /* multiprocessors */
    case 75: *v = major; break;
    case 76: *v = minor; break;
    case 115: *v = 1; break;           /* memory pools supported: cudarc then allocates asynchronously */
    default: *v = 0; break;
    }
    return CUDA_SUCCESS;
}

EXPORT CUresult cuDeviceGetUuid(char *uuid, CUdevice d) {
    NEED_INIT();
    if (!uuid) return CUDA_ERROR_INVALID_VALUE;
    memset(uuid, 0, 16);
    uuid[0] = (char)d;
    return CUDA_SUCCESS;
}

EXPORT CUresult cuDeviceGetUuid_v2(char *uuid, CUdevice d) { return cuDeviceGetUuid(uuid, d); }

EXPORT CUresult cuDevicePrimaryCtxRetain(fake_ctx **ctx, CUdevice d) {
    NEED_INIT();
    if (!ctx) return CUDA_ERROR_INVALID_VALUE;
    if (d < 0 || d >= device_count()) return CUDA_ERROR_INVALID_DEVICE;
    pthread_mutex_lock(&lock);
    contexts[d].retained++;
    pthread_mutex_unlock(&lock);
    *ctx = &contexts[d];
    return CUDA_SUCCESS;
}

EXPORT CUresult cuDevicePrimaryCtxRelease_v2(CUdevice d) {
    NEED_INIT();
    if (d < 0 || d >= device_count()) return CUDA_ERROR_INVALID_DEVICE;
    pthread_mutex_lock(&lock);
    int bad = contexts[d].retained <= 0;
    if (!bad) contexts[d].retained--;
    pthread_mutex_unlock(&lock);
    if (bad) fake_cuda_fatal("cuDevicePrimaryCtxRelease: device %d's primary context was not retained", d);
    return CUDA_SUCCESS;
}

EXPORT CUresult cuCtxGetCurrent(fake_ctx **ctx) {
    NEED_INIT();
    if (!ctx) return CUDA_ERROR_INVALID_VALUE;
    *ctx = current;
    return CUDA_SUCCESS;
}

EXPORT CUresult cuCtxSetCurrent(fake_ctx *ctx) {
    NEED_INIT();
    if (ctx && (ctx < contexts || ctx >= contexts + MAX_DEVICES)) return CUDA_ERROR_INVALID_CONTEXT;
    current = ctx;
    return CUDA_SUCCESS;
}

EXPORT CUresult cuCtxGetDevice(CUdevice *d) {
    NEED_INIT();
    if (!current) return CUDA_ERROR_INVALID_CONTEXT;
    *d = current->device;
    return CUDA_SUCCESS;
}

EXPORT CUresult cuCtxSynchronize(void) {
    NEED_INIT();
    if (!current) return CUDA_ERROR_INVALID_CONTEXT;
    log_work("sync");
    pthread_mutex_lock(&lock);
    for (size_t i = 0; i < n_streams; i++) {
        if (all_streams[i]->device == current->device) drain_locked(all_streams[i], "cuCtxSynchronize");
    }
    drain_locked(&default_stream, "cuCtxSynchronize");
    pthread_mutex_unlock(&lock);
    return CUDA_SUCCESS;
}

EXPORT CUresult cuStreamCreate(fake_stream **out, unsigned flags) {
    NEED_INIT();
    (void)flags;
    if (!out) return CUDA_ERROR_INVALID_VALUE;
    if (!current) return CUDA_ERROR_INVALID_CONTEXT;
    fake_stream *s = calloc(1, sizeof *s);
    if (!s) return CUDA_ERROR_OUT_OF_MEMORY;
    s->magic = STREAM_MAGIC;
    s->device = current->device;
    pthread_mutex_lock(&lock);
    if (n_streams == cap_streams) {
        cap_streams = cap_streams ? 2 * cap_streams : 16;
        all_streams = realloc(all_streams, cap_streams * sizeof *all_streams);
        if (!all_streams) fake_cuda_fatal("out of host memory");
    }
    all_streams[n_streams++] = s;
    pthread_mutex_unlock(&lock);
    *out = s;
    return CUDA_SUCCESS;
}

EXPORT CUresult cuStreamCreateWithPriority(fake_stream **out, unsigned flags, int priority) {
    (void)priority;
    return cuStreamCreate(out, flags);
}

EXPORT CUresult cuStreamDestroy_v2(fake_stream *h) {
    NEED_INIT();
    fake_stream *s = stream_of(h);
    if (s == &default_stream) return CUDA_ERROR_INVALID_HANDLE;
    pthread_mutex_lock(&lock);
    /* Like the real driver, work still queued finishes first. */
    drain_locked(s, "cuStreamDestroy");
    run_deferred_frees(s);
    for (size_t i = 0; i < n_streams; i++) {
        if (all_streams[i] == s) {
            all_streams[i] = all_streams[--n_streams];
            break;
        }
    }
    s->magic = 0;
    free(s->pending.ids);
    free(s->frees);
    free(s);
    pthread_mutex_unlock(&lock);
    return CUDA_SUCCESS;
}

EXPORT CUresult cuStreamSynchronize(fake_stream *h) {
    NEED_INIT();
    log_work("sync");
    fake_cuda_stream_drain(h, "cuStreamSynchronize");
    return CUDA_SUCCESS;
}

EXPORT CUresult cuStreamQuery(fake_stream *h) {
    NEED_INIT();
    pthread_mutex_lock(&lock);
    size_t n = list_prune(&stream_of(h)->pending);
    pthread_mutex_unlock(&lock);
    return n ? CUDA_ERROR_NOT_READY : CUDA_SUCCESS;
}

EXPORT CUresult cuEventCreate(fake_event **out, unsigned flags) {
    NEED_INIT();
    (void)flags;
    if (!out) return CUDA_ERROR_INVALID_VALUE;
    fake_event *e = calloc(1, sizeof *e);
    if (!e) return CUDA_ERROR_OUT_OF_MEMORY;
    e->magic = EVENT_MAGIC;
    *out = e;
    return CUDA_SUCCESS;
}

static fake_event *event_of(fake_event *e) {
    if (!e || e->magic != EVENT_MAGIC) fake_cuda_fatal("%p is not an event", (void *)e);
    return e;
}

EXPORT CUresult cuEventRecord(fake_event *h, fake_stream *sh) {
    NEED_INIT();
    fake_event *e = event_of(h);
    pthread_mutex_lock(&lock);
    fake_stream *s = stream_of(sh);
    list_prune(&s->pending);
    e->waits_for.n = 0;
    for (size_t i = 0; i < s->pending.n; i++) list_push(&e->waits_for, s->pending.ids[i]);
    clock_gettime(CLOCK_MONOTONIC, &e->when);
    pthread_mutex_unlock(&lock);
    return CUDA_SUCCESS;
}

EXPORT CUresult cuEventRecordWithFlags(fake_event *h, fake_stream *sh, unsigned flags) {
    (void)flags;
    return cuEventRecord(h, sh);
}

EXPORT CUresult cuEventQuery(fake_event *h) {
    NEED_INIT();
    fake_event *e = event_of(h);
    pthread_mutex_lock(&lock);
    size_t n = list_prune(&e->waits_for);
    pthread_mutex_unlock(&lock);
    return n ? CUDA_ERROR_NOT_READY : CUDA_SUCCESS;
}

EXPORT CUresult cuEventSynchronize(fake_event *h) {
    NEED_INIT();
    log_work("sync");
    fake_event *e = event_of(h);
    int limit = env_int("FAKE_CUDA_HANG_SECS", 120);
    struct timespec deadline;
    clock_gettime(CLOCK_REALTIME, &deadline);
    deadline.tv_sec += limit;
    pthread_mutex_lock(&lock);
    while (list_prune(&e->waits_for) > 0) {
        if (pthread_cond_timedwait(&changed, &lock, &deadline) == ETIMEDOUT) {
            fake_cuda_fatal("cuEventSynchronize waited %d s for a collective that never completed", limit);
        }
    }
    pthread_mutex_unlock(&lock);
    return CUDA_SUCCESS;
}

EXPORT CUresult cuEventElapsedTime(float *ms, fake_event *a, fake_event *b) {
    NEED_INIT();
    if (!ms) return CUDA_ERROR_INVALID_VALUE;
    event_of(a);
    event_of(b);
    *ms = (float)((b->when.tv_sec - a->when.tv_sec) * 1e3 + (b->when.tv_nsec - a->when.tv_nsec) / 1e6);
    return CUDA_SUCCESS;
}

EXPORT CUresult cuEventElapsedTime_v2(float *ms, fake_event *a, fake_event *b) { return cuEventElapsedTime(ms, a, b); }

EXPORT CUresult cuEventDestroy_v2(fake_event *h) {
    NEED_INIT();
    fake_event *e = event_of(h);
    e->magic = 0;
    free(e->waits_for.ids);
    free(e);
    return CUDA_SUCCESS;
}

EXPORT CUresult cuStreamWaitEvent(fake_stream *sh, fake_event *h, unsigned flags) {
    NEED_INIT();
    (void)flags;
    fake_event *e = event_of(h);
    pthread_mutex_lock(&lock);
    fake_stream *s = stream_of(sh);
    for (size_t i = 0; i < list_prune(&e->waits_for); i++) list_push(&s->pending, e->waits_for.ids[i]);
    pthread_mutex_unlock(&lock);
    return CUDA_SUCCESS;
}

EXPORT CUresult cuMemAlloc_v2(CUdeviceptr *out, size_t size) {
    NEED_INIT();
    if (!current) return CUDA_ERROR_INVALID_CONTEXT;
    pthread_mutex_lock(&lock);
    CUresult r = alloc_locked(out, size);
    pthread_mutex_unlock(&lock);
    if (r == CUDA_SUCCESS) log_work("alloc %zu", size);
    return r;
}

EXPORT CUresult cuMemAllocAsync(CUdeviceptr *out, size_t size, fake_stream *sh) {
    NEED_INIT();
    if (!current) return CUDA_ERROR_INVALID_CONTEXT;
    pthread_mutex_lock(&lock);
    stream_of(sh);
    CUresult r = alloc_locked(out, size);
    pthread_mutex_unlock(&lock);
    if (r == CUDA_SUCCESS) log_work("alloc %zu", size);
    return r;
}

EXPORT CUresult cuMemHostAlloc(void **out, size_t size, unsigned flags) {
    NEED_INIT();
    (void)flags;
    if (!out) return CUDA_ERROR_INVALID_VALUE;
    if (!current) return CUDA_ERROR_INVALID_CONTEXT;
    CUdeviceptr p = 0;
    pthread_mutex_lock(&lock);
    CUresult r = alloc_locked(&p, size);
    pthread_mutex_unlock(&lock);
    if (r == CUDA_SUCCESS) log_work("alloc %zu", size);
    *out = (void *)(uintptr_t)p;
    return r;
}

EXPORT CUresult cuMemFreeHost(void *ptr) {
    NEED_INIT();
    pthread_mutex_lock(&lock);
    free_locked((uint64_t)(uintptr_t)ptr, "cuMemFreeHost", NULL);
    pthread_mutex_unlock(&lock);
    return CUDA_SUCCESS;
}

EXPORT CUresult cuMemFree_v2(CUdeviceptr ptr) {
    NEED_INIT();
    pthread_mutex_lock(&lock);
    free_locked(ptr, "cuMemFree", NULL);
    pthread_mutex_unlock(&lock);
    return CUDA_SUCCESS;
}

EXPORT CUresult cuMemFreeAsync(CUdeviceptr ptr, fake_stream *sh) {
    NEED_INIT();
    pthread_mutex_lock(&lock);
    fake_stream *s = stream_of(sh);
    if (list_prune(&s->pending) > 0) {
        /* Queued behind the stream's pending collectives, as the driver would. */
        if (!find_live(ptr)) free_locked(ptr, "cuMemFreeAsync", s); /* reports the bad pointer */
        if (s->n_frees == s->cap_frees) {
            s->cap_frees = s->cap_frees ? 2 * s->cap_frees : 8;
            s->frees = realloc(s->frees, s->cap_frees * sizeof *s->frees);
            if (!s->frees) fake_cuda_fatal("out of host memory");
        }
        s->frees[s->n_frees++] = (deferred_free){ptr, 0};
    } else {
        free_locked(ptr, "cuMemFreeAsync", s);
    }
    pthread_mutex_unlock(&lock);
    return CUDA_SUCCESS;
}

EXPORT CUresult cuMemGetInfo_v2(size_t *free_bytes, size_t *total) {
    NEED_INIT();
    if (free_bytes) *free_bytes = (size_t)15 << 30;
    if (total) *total = (size_t)16 << 30;
    return CUDA_SUCCESS;
}

/* Every synchronous piece of work first waits for what is pending on its stream. */
static void before_work(fake_stream *sh, const char *what) { fake_cuda_stream_drain(sh, what); }

EXPORT CUresult cuMemcpyHtoDAsync_v2(CUdeviceptr dst, const void *src, size_t n, fake_stream *s) {
    NEED_INIT();
    before_work(s, "cuMemcpyHtoD");
    if (n == 0) return CUDA_SUCCESS;
    if (!src) return CUDA_ERROR_INVALID_VALUE;
    fake_cuda_check(dst, n, "cuMemcpyHtoD destination");
    if (fake_cuda_is_live((uint64_t)(uintptr_t)src)) fake_cuda_check((uint64_t)(uintptr_t)src, n, "cuMemcpyHtoD source (pinned)");
    log_work("copy %s %zu", "htod", n);
    __atomic_fetch_add(&n_host_copies, 1, __ATOMIC_RELAXED);
    memcpy((void *)(uintptr_t)dst, src, n);
    return CUDA_SUCCESS;
}

EXPORT CUresult cuMemcpyDtoHAsync_v2(void *dst, CUdeviceptr src, size_t n, fake_stream *s) {
    NEED_INIT();
    before_work(s, "cuMemcpyDtoH");
    if (n == 0) return CUDA_SUCCESS;
    if (!dst) return CUDA_ERROR_INVALID_VALUE;
    fake_cuda_check(src, n, "cuMemcpyDtoH source");
    if (fake_cuda_is_live((uint64_t)(uintptr_t)dst)) {
        fake_cuda_check((uint64_t)(uintptr_t)dst, n, "cuMemcpyDtoH destination (pinned)");
    } else {
        /* Into pageable memory the driver returns only once the copy, and so everything queued
         * before it on the stream, is done: a wait of the host for the device. */
        log_work("sync");
    }
    log_work("copy %s %zu", "dtoh", n);
    __atomic_fetch_add(&n_host_copies, 1, __ATOMIC_RELAXED);
    memcpy(dst, (const void *)(uintptr_t)src, n);
    return CUDA_SUCCESS;
}

EXPORT CUresult cuMemcpyDtoDAsync_v2(CUdeviceptr dst, CUdeviceptr src, size_t n, fake_stream *s) {
    NEED_INIT();
    before_work(s, "cuMemcpyDtoD");
    if (n == 0) return CUDA_SUCCESS;
    fake_cuda_check(dst, n, "cuMemcpyDtoD destination");
    fake_cuda_check(src, n, "cuMemcpyDtoD source");
    log_work("copy %s %zu", "dtod", n);
    memmove((void *)(uintptr_t)dst, (const void *)(uintptr_t)src, n);
    return CUDA_SUCCESS;
}

EXPORT CUresult cuMemcpyHtoD_v2(CUdeviceptr dst, const void *src, size_t n) {
    return cuMemcpyHtoDAsync_v2(dst, src, n, NULL);
}

EXPORT CUresult cuMemcpyDtoH_v2(void *dst, CUdeviceptr src, size_t n) { return cuMemcpyDtoHAsync_v2(dst, src, n, NULL); }

EXPORT CUresult cuMemcpyDtoD_v2(CUdeviceptr dst, CUdeviceptr src, size_t n) {
    return cuMemcpyDtoDAsync_v2(dst, src, n, NULL);
}

EXPORT CUresult cuMemsetD8Async(CUdeviceptr dst, unsigned char v, size_t n, fake_stream *s) {
    NEED_INIT();
    before_work(s, "cuMemsetD8");
    if (n == 0) return CUDA_SUCCESS;
    fake_cuda_check(dst, n, "cuMemsetD8");
    memset((void *)(uintptr_t)dst, v, n);
    return CUDA_SUCCESS;
}

EXPORT CUresult cuMemsetD8_v2(CUdeviceptr dst, unsigned char v, size_t n) { return cuMemsetD8Async(dst, v, n, NULL); }

/* ---- modules and kernels ---- */

typedef struct {
    unsigned magic;
    char *image; /* PTX text, or the cubin's bytes */
    size_t len;
} fake_module;

/* The PTX ISA a driver of this version accepts: CUDA 12.x reads PTX 8.x, 13.x reads 9.x, a
 * minor release reading up to its own minor (the rule the real drivers follow). */
static int max_ptx_isa(int driver) {
    int major = driver / 1000, minor = (driver % 1000) / 10;
    return (major - 4) * 10 + minor;
}

EXPORT CUresult cuModuleLoadData(fake_module **out, const void *image) {
    NEED_INIT();
    if (!out || !image) return CUDA_ERROR_INVALID_VALUE;
    if (!current) return CUDA_ERROR_INVALID_CONTEXT;
    const unsigned char *b = image;
    size_t len;
    if (b[0] == 0x7f && b[1] == 'E' && b[2] == 'L' && b[3] == 'F') {
        /* A cubin: its size is the end of the section header table (64-bit ELF). */
        uint64_t shoff;
        uint16_t shentsize, shnum;
        memcpy(&shoff, b + 0x28, 8);
        memcpy(&shentsize, b + 0x3a, 2);
        memcpy(&shnum, b + 0x3c, 2);
        len = (size_t)(shoff + (uint64_t)shentsize * shnum);
    } else {
        const char *ptx = image;
        len = strlen(ptx);
        const char *v = strstr(ptx, ".version ");
        int maj, min;
        if (!v || sscanf(v, ".version %d.%d", &maj, &min) != 2) return CUDA_ERROR_INVALID_IMAGE;
        if (maj * 10 + min > max_ptx_isa(driver_version())) return CUDA_ERROR_UNSUPPORTED_PTX_VERSION;
    }
    fake_module *m = calloc(1, sizeof *m);
    if (!m) return CUDA_ERROR_OUT_OF_MEMORY;
    m->magic = MODULE_MAGIC;
    m->image = malloc(len + 1);
    if (!m->image) return CUDA_ERROR_OUT_OF_MEMORY;
    memcpy(m->image, image, len);
    m->image[len] = 0;
    m->len = len;
    *out = m;
    return CUDA_SUCCESS;
}

EXPORT CUresult cuModuleUnload(fake_module *m) {
    NEED_INIT();
    if (!m || m->magic != MODULE_MAGIC) return CUDA_ERROR_INVALID_HANDLE;
    m->magic = 0;
    free(m->image);
    free(m);
    return CUDA_SUCCESS;
}

EXPORT CUresult cuModuleGetFunction(const fake_kernel **out, fake_module *m, const char *name) {
    NEED_INIT();
    if (!out || !name) return CUDA_ERROR_INVALID_VALUE;
    if (!m || m->magic != MODULE_MAGIC) return CUDA_ERROR_INVALID_HANDLE;
    /* The name must be in the image (an entry of the PTX, a symbol of the cubin)... */
    if (!memmem(m->image, m->len, name, strlen(name))) return CUDA_ERROR_NOT_FOUND;
    /* ...and among the kernels compiled for the host. */
    const fake_kernel *k = fake_kernel_find(name);
    if (!k) return CUDA_ERROR_NOT_FOUND;
    *out = k;
    return CUDA_SUCCESS;
}

EXPORT CUresult cuFuncGetAttribute(int *v, int attr, const fake_kernel *f) {
    NEED_INIT();
    (void)attr, (void)f;
    if (!v) return CUDA_ERROR_INVALID_VALUE;
    *v = attr == 0 ? 1024 : 0; /* max threads per block */
    return CUDA_SUCCESS;
}

static void log_launch(const char *name, unsigned gx, unsigned gy, unsigned gz, unsigned bx, unsigned by, unsigned bz) {
    log_work("kernel %s %u %u %u %u %u %u", name, gx, gy, gz, bx, by, bz);
}

EXPORT CUresult cuLaunchKernel(const fake_kernel *f, unsigned gx, unsigned gy, unsigned gz, unsigned bx, unsigned by,
                               unsigned bz, unsigned shared, fake_stream *s, void **params, void **extra) {
    NEED_INIT();
    if (!f) return CUDA_ERROR_INVALID_HANDLE;
    if (!params || extra) return CUDA_ERROR_INVALID_VALUE;
    if (gx == 0 || gy == 0 || gz == 0 || bx == 0 || by == 0 || bz == 0) return CUDA_ERROR_INVALID_VALUE;
    if ((uint64_t)bx * by * bz > 1024 || gy > 65535 || gz > 65535 || shared > 48 * 1024) return CUDA_ERROR_INVALID_VALUE;
    if (!current) return CUDA_ERROR_INVALID_CONTEXT;
    before_work(s, f->name);
    __atomic_fetch_add(&n_launches, 1, __ATOMIC_RELAXED);
    log_launch(f->name, gx, gy, gz, bx, by, bz);
    fake_kernel_run(f, gx, gy, gz, bx, by, bz, params);
    return CUDA_SUCCESS;
}

static const char *error_name(CUresult r) {
    switch (r) {
    case CUDA_SUCCESS: return "CUDA_SUCCESS";
    case CUDA_ERROR_INVALID_VALUE: return "CUDA_ERROR_INVALID_VALUE";
    case CUDA_ERROR_OUT_OF_MEMORY: return "CUDA_ERROR_OUT_OF_MEMORY";
    case CUDA_ERROR_NOT_INITIALIZED: return "CUDA_ERROR_NOT_INITIALIZED";
    case CUDA_ERROR_INVALID_DEVICE: return "CUDA_ERROR_INVALID_DEVICE";
    case CUDA_ERROR_INVALID_IMAGE: return "CUDA_ERROR_INVALID_IMAGE";
    case CUDA_ERROR_INVALID_CONTEXT: return "CUDA_ERROR_INVALID_CONTEXT";
    case CUDA_ERROR_UNSUPPORTED_PTX_VERSION: return "CUDA_ERROR_UNSUPPORTED_PTX_VERSION";
    case CUDA_ERROR_INVALID_HANDLE: return "CUDA_ERROR_INVALID_HANDLE";
    case CUDA_ERROR_NOT_FOUND: return "CUDA_ERROR_NOT_FOUND";
    case CUDA_ERROR_NOT_READY: return "CUDA_ERROR_NOT_READY";
    case CUDA_ERROR_NOT_SUPPORTED: return "CUDA_ERROR_NOT_SUPPORTED";
    default: return "CUDA_ERROR_UNKNOWN";
    }
}

EXPORT CUresult cuGetErrorName(CUresult r, const char **s) {
    if (!s) return CUDA_ERROR_INVALID_VALUE;
    *s = error_name(r);
    return CUDA_SUCCESS;
}

EXPORT CUresult cuGetErrorString(CUresult r, const char **s) {
    if (!s) return CUDA_ERROR_INVALID_VALUE;
    *s = error_name(r);
    return CUDA_SUCCESS;
}
