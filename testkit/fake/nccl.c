/* A fake NCCL (libnccl.so.2) over the fake driver, for several ranks in one process (threads)
 * or one rank per process.
 *
 * Ranks that share a unique id form a world. A collective is posted by each rank in turn: the
 * k-th collective of every rank is the same operation, and the rank that posts last performs it
 * for all of them through shared host memory, checks that the ranks agree on what it is, and
 * ends the tickets that kept every rank's stream busy until then. Point-to-point sends and
 * receives pair up the same way per (sender, receiver). Inside ncclGroupStart/End, operations
 * are only posted at the end, as in NCCL: a group left open leaves them unposted and every
 * stream that waits for them busy, and destroying a communicator with a group open is fatal.
 *
 * What is checked: every buffer against the live device allocations (and registered as in use
 * until the operation ends, so freeing it early is fatal); the ranks agree on operation, count
 * and root; two ranks of one world on one device are refused (as NCCL refuses them);
 * ncclCommDestroy with work pending waits for it (and is fatal if it never ends: a timed-out
 * collective must be aborted first); ncclCommAbort ends the world's pending work at once
 * without moving data. Nonblocking communicators (config.blocking = 0) report ncclInProgress
 * from ncclCommGetAsyncError until every rank has joined.
 *
 * Types: float32, float16 and bfloat16 (the ranks must agree on it, as on count and root);
 * any other type, and any operation but a sum, is refused with ncclInvalidArgument and a
 * message naming it. A half-precision sum adds in float and rounds to the type (to nearest,
 * ties to even) after each rank's value, in rank order, as each hop of NCCL's ring rounds its
 * partial sum: for bfloat16 that is what NCCL does; for float16 NCCL adds in half precision
 * (__hadd), which gives the same bits, since float's 24-bit significand is wide enough
 * (24 >= 2 x 11 + 2) for rounding twice to be the same as rounding once. A NaN is stored as
 * CUDA's canonical one (0x7fff). These conversions are written with float arithmetic here,
 * apart from the project's kernels, so the fake is an independent reference for them. */
#define _GNU_SOURCE
#include <errno.h>
#include <math.h>
#include <pthread.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>

#include "fake.h"

#define EXPORT __attribute__((visibility("default")))
#define COMM_MAGIC 0x4e43434cU
#define ID_BYTES 128

typedef int ncclResult_t;
enum {
    ncclSuccess = 0,
    ncclUnhandledCudaError = 1,
    ncclSystemError = 2,
    ncclInternalError = 3,
    ncclInvalidArgument = 4,
    ncclInvalidUsage = 5,
    ncclRemoteError = 6,
    ncclInProgress = 7,
};
enum { ncclFloat16 = 6, ncclFloat32 = 7, ncclBfloat16 = 9 };
enum { ncclSum = 0 };
enum { OP_ALL_REDUCE, OP_BROADCAST, OP_REDUCE, OP_ALL_GATHER, OP_REDUCE_SCATTER, OP_SEND, OP_RECV };
static const char *OP_NAMES[] = {"all_reduce", "broadcast", "reduce", "all_gather", "reduce_scatter", "send", "recv"};

typedef struct {
    char internal[ID_BYTES];
} ncclUniqueId;

/* The layout of ncclConfig_t up to the fields this fake reads. */
typedef struct {
    size_t size;
    unsigned magic;
    unsigned version;
    int blocking;
} config_head;

struct world;

typedef struct comm {
    unsigned magic;
    struct world *world;
    int rank;
    int device;
    int blocking;
    uint64_t seq; /* collectives posted so far */
    char last_error[256];
} comm_t;

/* One rank's part of one collective (or one side of a send/receive). */
typedef struct {
    int posted;
    void *send;
    void *recv;
    uint64_t ticket;
} part_t;

typedef struct op {
    struct op *next;
    uint64_t seq;
    int kind;
    int dtype;
    size_t count;
    int root;
    int posted;
    part_t *parts; /* one per rank; for point-to-point, [0] sender and [1] receiver */
} op_t;

typedef struct world {
    struct world *next;
    char id[ID_BYTES];
    int nranks;
    int joined;
    int alive; /* communicators not yet destroyed */
    int aborted;
    comm_t **comms;
    op_t *ops; /* collectives waiting for ranks */
    op_t *p2p; /* sends and receives waiting for their other side */
    uint64_t *p2p_sent, *p2p_recvd; /* per (from, to): messages posted so far */
} world_t;

static pthread_mutex_t lock = PTHREAD_MUTEX_INITIALIZER;
static pthread_cond_t changed = PTHREAD_COND_INITIALIZER;
static world_t *worlds;
static uint64_t ids_made;

static int hang_secs(void) {
    const char *v = getenv("FAKE_CUDA_HANG_SECS");
    return v && *v ? atoi(v) : 120;
}

static comm_t *comm_of(comm_t *c) {
    if (!c || c->magic != COMM_MAGIC) fake_cuda_fatal("NCCL: %p is not a live communicator", (void *)c);
    return c;
}

static ncclResult_t fail(comm_t *c, ncclResult_t r, const char *fmt, const char *detail) {
    char msg[256];
    snprintf(msg, sizeof msg, fmt, detail);
    fprintf(stderr, "fake-nccl: %s\n", msg);
    if (c) snprintf(c->last_error, sizeof c->last_error, "%s", msg);
    return r;
}

EXPORT const char *ncclGetErrorString(ncclResult_t r) {
    switch (r) {
    case ncclSuccess: return "no error";
    case ncclUnhandledCudaError: return "unhandled cuda error";
    case ncclSystemError: return "unhandled system error";
    case ncclInternalError: return "internal error";
    case ncclInvalidArgument: return "invalid argument";
    case ncclInvalidUsage: return "invalid usage";
    case ncclRemoteError: return "remote process exited or there was a network error";
    case ncclInProgress: return "NCCL operation in progress";
    default: return "unknown result code";
    }
}

EXPORT const char *ncclGetLastError(comm_t *c) { return c && c->magic == COMM_MAGIC ? c->last_error : ""; }

EXPORT ncclResult_t ncclGetVersion(int *v) {
    if (!v) return ncclInvalidArgument;
    *v = 22800;
    return ncclSuccess;
}

EXPORT ncclResult_t ncclGetUniqueId(ncclUniqueId *id) {
    if (!id) return ncclInvalidArgument;
    memset(id, 0, sizeof *id);
    pthread_mutex_lock(&lock);
    uint64_t n = ++ids_made;
    pthread_mutex_unlock(&lock);
    struct timespec t;
    clock_gettime(CLOCK_REALTIME, &t);
    snprintf(id->internal, ID_BYTES, "gradsync-fake-nccl:%d:%llu:%lld.%ld", (int)getpid(), (unsigned long long)n,
             (long long)t.tv_sec, t.tv_nsec);
    return ncclSuccess;
}

/* Wait on `changed` with the lock held until `done(arg)`, fatal after the hang limit. */
static void wait_until(int (*done)(void *), void *arg, const char *what) {
    struct timespec deadline;
    clock_gettime(CLOCK_REALTIME, &deadline);
    deadline.tv_sec += hang_secs();
    while (!done(arg)) {
        if (pthread_cond_timedwait(&changed, &lock, &deadline) == ETIMEDOUT) {
            fake_cuda_fatal("NCCL: %s waited %d s and never completed", what, hang_secs());
        }
    }
}

static int all_joined(void *w) { return ((world_t *)w)->joined == ((world_t *)w)->nranks || ((world_t *)w)->aborted; }

static ncclResult_t init_rank(comm_t **out, int nranks, ncclUniqueId id, int rank, int blocking) {
    if (!out) return fail(NULL, ncclInvalidArgument, "ncclCommInitRank: %s", "null communicator pointer");
    if (nranks < 1 || rank < 0 || rank >= nranks) {
        return fail(NULL, ncclInvalidArgument, "ncclCommInitRank: %s", "rank outside [0, nranks)");
    }
    int device = fake_cuda_current_device();
    if (device < 0) return fail(NULL, ncclUnhandledCudaError, "ncclCommInitRank: %s", "no current CUDA context");
    pthread_mutex_lock(&lock);
    world_t *w = worlds;
    while (w && memcmp(w->id, id.internal, ID_BYTES) != 0) w = w->next;
    if (!w) {
        w = calloc(1, sizeof *w);
        memcpy(w->id, id.internal, ID_BYTES);
        w->nranks = nranks;
        w->comms = calloc((size_t)nranks, sizeof *w->comms);
        w->p2p_sent = calloc((size_t)nranks * (size_t)nranks, sizeof *w->p2p_sent);
        w->p2p_recvd = calloc((size_t)nranks * (size_t)nranks, sizeof *w->p2p_recvd);
        w->next = worlds;
        worlds = w;
    }
    const char *refused = NULL;
    if (w->nranks != nranks) refused = "ranks disagree on the world size";
    else if (w->comms[rank]) refused = "two communicators claim the same rank";
    else {
        for (int r = 0; r < nranks; r++) {
            if (w->comms[r] && w->comms[r]->device == device) refused = "two ranks on one GPU (duplicate GPU detected)";
        }
    }
    if (refused) {
        pthread_mutex_unlock(&lock);
        return fail(NULL, ncclInvalidUsage, "ncclCommInitRank: %s", refused);
    }
    comm_t *c = calloc(1, sizeof *c);
    c->magic = COMM_MAGIC;
    c->world = w;
    c->rank = rank;
    c->device = device;
    c->blocking = blocking;
    w->comms[rank] = c;
    w->joined++;
    w->alive++;
    pthread_cond_broadcast(&changed);
    *out = c;
    ncclResult_t r = ncclSuccess;
    if (blocking) {
        wait_until(all_joined, w, "ncclCommInitRank (waiting for every rank to join)");
    } else if (w->joined < w->nranks) {
        r = ncclInProgress;
    }
    pthread_mutex_unlock(&lock);
    return r;
}

EXPORT ncclResult_t ncclCommInitRank(comm_t **out, int nranks, ncclUniqueId id, int rank) {
    return init_rank(out, nranks, id, rank, 1);
}

EXPORT ncclResult_t ncclCommInitRankConfig(comm_t **out, int nranks, ncclUniqueId id, int rank, config_head *config) {
    int blocking = 1;
    if (config) {
        if (config->magic != 0xcafebeefU) return fail(NULL, ncclInvalidArgument, "ncclCommInitRankConfig: %s", "bad config magic");
        if (config->blocking == 0) blocking = 0;
    }
    return init_rank(out, nranks, id, rank, blocking);
}

EXPORT ncclResult_t ncclCommGetAsyncError(comm_t *c, ncclResult_t *err) {
    comm_of(c);
    if (!err) return ncclInvalidArgument;
    pthread_mutex_lock(&lock);
    world_t *w = c->world;
    *err = w->aborted ? ncclRemoteError : w->joined < w->nranks ? ncclInProgress : ncclSuccess;
    pthread_mutex_unlock(&lock);
    return ncclSuccess;
}

EXPORT ncclResult_t ncclCommCount(const comm_t *c, int *n) {
    comm_of((comm_t *)c);
    if (!n) return ncclInvalidArgument;
    *n = c->world->nranks;
    return ncclSuccess;
}

EXPORT ncclResult_t ncclCommUserRank(const comm_t *c, int *r) {
    comm_of((comm_t *)c);
    if (!r) return ncclInvalidArgument;
    *r = c->rank;
    return ncclSuccess;
}

EXPORT ncclResult_t ncclCommCuDevice(const comm_t *c, int *d) {
    comm_of((comm_t *)c);
    if (!d) return ncclInvalidArgument;
    *d = c->device;
    return ncclSuccess;
}

/* ---- groups ---- */

typedef struct {
    comm_t *comm;
    int kind;
    int dtype;
    void *send, *recv;
    size_t count;
    int root;
    void *stream;
    uint64_t ticket;
} deferred_t;

static __thread int group_depth;
static __thread deferred_t *deferred;
static __thread size_t n_deferred, cap_deferred;

static ncclResult_t post(comm_t *c, int kind, int dtype, void *send, void *recv, size_t count, int root,
                         void *stream, uint64_t ticket);

EXPORT ncclResult_t ncclGroupStart(void) {
    group_depth++;
    return ncclSuccess;
}

EXPORT ncclResult_t ncclGroupEnd(void) {
    if (group_depth == 0) return fail(NULL, ncclInvalidUsage, "ncclGroupEnd: %s", "no group is open");
    if (--group_depth > 0) return ncclSuccess;
    size_t n = n_deferred;
    n_deferred = 0;
    ncclResult_t r = ncclSuccess;
    for (size_t i = 0; i < n; i++) {
        deferred_t *d = &deferred[i];
        ncclResult_t ri = post(d->comm, d->kind, d->dtype, d->send, d->recv, d->count, d->root, d->stream, d->ticket);
        if (r == ncclSuccess) r = ri;
    }
    return r;
}

/* ---- collectives ---- */

static size_t elems_in(int kind, size_t count, int nranks, int is_send) {
    switch (kind) {
    case OP_ALL_GATHER: return is_send ? count : count * (size_t)nranks;
    case OP_REDUCE_SCATTER: return is_send ? count * (size_t)nranks : count;
    default: return count;
    }
}

/* ---- the types ---- */

static const char *type_name(int dtype) {
    switch (dtype) {
    case ncclFloat16: return "float16";
    case ncclFloat32: return "float32";
    case ncclBfloat16: return "bfloat16";
    default: return NULL;
    }
}

static size_t type_size(int dtype) { return dtype == ncclFloat32 ? 4 : 2; }

/* float16 bits to float (exact). */
static float from_f16(uint16_t h) {
    int exp = (h >> 10) & 0x1f, man = h & 0x3ff;
    float v = exp == 0x1f ? (man ? NAN : INFINITY)
              : exp == 0  ? ldexpf((float)man, -24)
                          : ldexpf((float)(man | 0x400), exp - 25);
    return h & 0x8000 ? -v : v;
}

/* float to float16 bits, to nearest, ties to even. */
static uint16_t to_f16(float f) {
    uint16_t sign = signbit(f) ? 0x8000 : 0;
    if (isnan(f)) return 0x7fff;
    double a = fabs((double)f);
    if (a >= 65520.0) return sign | 0x7c00; /* at or past the midpoint above 65504 */
    /* The spacing of float16 values at `a`: 2^-24 through the subnormals, 2^(e-10) at 2^e. */
    int e;
    frexp(a, &e);
    int q = e - 11 < -24 ? -24 : e - 11;
    double r = nearbyint(ldexp(a, -q)); /* the default rounding mode: ties to even */
    if (r == 0) return sign;
    double v = ldexp(r, q);
    frexp(v, &e); /* again: rounding may have carried into the next power of two */
    if (e - 1 < -14) return sign | (uint16_t)r; /* subnormal: the count of 2^-24 steps */
    return sign | (uint16_t)((e - 1 + 15) << 10) | (uint16_t)(ldexp(v, 11 - e) - 1024.0);
}

static float from_bf16(uint16_t h) {
    uint32_t u = (uint32_t)h << 16;
    float f;
    memcpy(&f, &u, sizeof f);
    return f;
}

/* float to bfloat16 bits, to nearest, ties to even. */
static uint16_t to_bf16(float f) {
    if (isnan(f)) return 0x7fff;
    uint32_t u;
    memcpy(&u, &f, sizeof u);
    return (uint16_t)((u + 0x7fffu + ((u >> 16) & 1u)) >> 16);
}

/* Element i of a buffer of `dtype`, as float. */
static float load(int dtype, const void *buf, size_t i) {
    switch (dtype) {
    case ncclFloat16: return from_f16(((const uint16_t *)buf)[i]);
    case ncclBfloat16: return from_bf16(((const uint16_t *)buf)[i]);
    default: return ((const float *)buf)[i];
    }
}

/* `v` rounded to `dtype`, stored at element i. */
static void store(int dtype, void *buf, size_t i, float v) {
    switch (dtype) {
    case ncclFloat16: ((uint16_t *)buf)[i] = to_f16(v); break;
    case ncclBfloat16: ((uint16_t *)buf)[i] = to_bf16(v); break;
    default: ((float *)buf)[i] = v;
    }
}

/* Element i of the sum over the ranks' `send` buffers at element offset `at`, in rank order (a
 * fixed order, like NCCL's ring per chunk), stored into `out` at `i`: in the type, rounded to
 * it after each rank's value. */
static void sum_into(int dtype, part_t *p, int n, size_t at, void *out, size_t i) {
    float s = load(dtype, p[0].send, at);
    store(dtype, out, i, s);
    for (int r = 1; r < n; r++) {
        s = load(dtype, out, i) + load(dtype, p[r].send, at);
        store(dtype, out, i, s);
    }
}

static void perform(world_t *w, op_t *op) {
    int n = w->nranks, t = op->dtype;
    size_t c = op->count, z = type_size(t);
    part_t *p = op->parts;
    switch (op->kind) {
    case OP_ALL_REDUCE: {
        char *acc = malloc(c * z);
        for (size_t i = 0; i < c; i++) sum_into(t, p, n, i, acc, i);
        for (int r = 0; r < n; r++) memcpy(p[r].recv, acc, c * z);
        free(acc);
        break;
    }
    case OP_REDUCE: {
        char *acc = malloc(c * z);
        for (size_t i = 0; i < c; i++) sum_into(t, p, n, i, acc, i);
        memcpy(p[op->root].recv, acc, c * z);
        free(acc);
        break;
    }
    case OP_BROADCAST: {
        for (int r = 0; r < n; r++) {
            if (r != op->root) memmove(p[r].recv, p[op->root].send, c * z);
        }
        if (p[op->root].recv != p[op->root].send) memmove(p[op->root].recv, p[op->root].send, c * z);
        break;
    }
    case OP_ALL_GATHER: {
        char *all = malloc(c * (size_t)n * z);
        for (int r = 0; r < n; r++) memcpy(all + (size_t)r * c * z, p[r].send, c * z);
        for (int r = 0; r < n; r++) memcpy(p[r].recv, all, c * (size_t)n * z);
        free(all);
        break;
    }
    case OP_REDUCE_SCATTER: {
        char *out = malloc(c * (size_t)n * z);
        for (int dst = 0; dst < n; dst++) {
            for (size_t i = 0; i < c; i++) sum_into(t, p, n, (size_t)dst * c + i, out, (size_t)dst * c + i);
        }
        for (int dst = 0; dst < n; dst++) memcpy(p[dst].recv, out + (size_t)dst * c * z, c * z);
        free(out);
        break;
    }
    case OP_SEND: /* parts[0] the sender, parts[1] the receiver */
        memcpy(p[1].recv, p[0].send, c * z);
        break;
    }
}

static void finish(op_t *op, int nparts) {
    for (int r = 0; r < nparts; r++) {
        if (op->parts[r].posted) fake_cuda_ticket_end(op->parts[r].ticket);
    }
    free(op->parts);
    free(op);
}

static void unlink_op(op_t **list, op_t *op) {
    while (*list != op) list = &(*list)->next;
    *list = op->next;
}

/* `ticket` is the one taken when the operation was queued in a group, or 0. */
static ncclResult_t post(comm_t *c, int kind, int dtype, void *send, void *recv, size_t count, int root,
                         void *stream, uint64_t ticket) {
    world_t *w = c->world;
    int n = w->nranks;
    if (w->aborted) {
        if (ticket) fake_cuda_ticket_end(ticket);
        return fail(c, ncclRemoteError, "%s: the communicator was aborted", OP_NAMES[kind]);
    }
    if (count > 0) {
        size_t ns = elems_in(kind, count, n, 1) * type_size(dtype), nr = elems_in(kind, count, n, 0) * type_size(dtype);
        if (send) fake_cuda_check((uint64_t)(uintptr_t)send, ns, "NCCL send buffer");
        if (recv) fake_cuda_check((uint64_t)(uintptr_t)recv, nr, "NCCL receive buffer");
    }
    fake_cuda_count_collective();
    if (!ticket) ticket = fake_cuda_ticket_begin(stream);
    if (count > 0) {
        size_t ns = elems_in(kind, count, n, 1) * type_size(dtype), nr = elems_in(kind, count, n, 0) * type_size(dtype);
        if (send) fake_cuda_ticket_uses(ticket, (uint64_t)(uintptr_t)send, ns);
        if (recv) fake_cuda_ticket_uses(ticket, (uint64_t)(uintptr_t)recv, nr);
    }
    pthread_mutex_lock(&lock);
    if (kind == OP_SEND || kind == OP_RECV) {
        int from = kind == OP_SEND ? c->rank : root, to = kind == OP_SEND ? root : c->rank;
        uint64_t *counter = kind == OP_SEND ? &w->p2p_sent[from * n + to] : &w->p2p_recvd[from * n + to];
        uint64_t seq = ++*counter;
        op_t *op = w->p2p;
        while (op && !(op->seq == seq && op->root == from * n + to)) op = op->next;
        if (!op) {
            op = calloc(1, sizeof *op);
            op->seq = seq;
            op->kind = OP_SEND;
            op->dtype = dtype;
            op->root = from * n + to;
            op->count = count;
            op->parts = calloc(2, sizeof *op->parts);
            op->next = w->p2p;
            w->p2p = op;
        } else if (op->count != count || op->dtype != dtype) {
            fake_cuda_fatal("NCCL: rank %d sends %zu values of %s to rank %d, which receives %zu of %s", from,
                            kind == OP_SEND ? count : op->count, type_name(kind == OP_SEND ? dtype : op->dtype), to,
                            kind == OP_SEND ? op->count : count, type_name(kind == OP_SEND ? op->dtype : dtype));
        }
        part_t *me = &op->parts[kind == OP_SEND ? 0 : 1];
        *me = (part_t){1, send, recv, ticket};
        if (op->parts[0].posted && op->parts[1].posted) {
            perform(w, op);
            unlink_op(&w->p2p, op);
            finish(op, 2);
        }
    } else {
        uint64_t seq = ++c->seq;
        op_t *op = w->ops;
        while (op && op->seq != seq) op = op->next;
        if (!op) {
            op = calloc(1, sizeof *op);
            op->seq = seq;
            op->kind = kind;
            op->dtype = dtype;
            op->count = count;
            op->root = root;
            op->parts = calloc((size_t)n, sizeof *op->parts);
            op->next = w->ops;
            w->ops = op;
        } else if (op->kind != kind || op->dtype != dtype || op->count != count || op->root != root) {
            fake_cuda_fatal("NCCL: ranks disagree on collective #%llu: one posted %s of %zu %s values (root %d), rank "
                            "%d posts %s of %zu %s values (root %d)",
                            (unsigned long long)seq, OP_NAMES[op->kind], op->count, type_name(op->dtype), op->root,
                            c->rank, OP_NAMES[kind], count, type_name(dtype), root);
        }
        op->parts[c->rank] = (part_t){1, send, recv, ticket};
        if (++op->posted == n) {
            perform(w, op);
            unlink_op(&w->ops, op);
            finish(op, n);
        }
    }
    pthread_cond_broadcast(&changed);
    pthread_mutex_unlock(&lock);
    return ncclSuccess;
}

/* Queue inside a group, post otherwise. */
static ncclResult_t enqueue(comm_t *c, int kind, const void *send, void *recv, size_t count, int dtype, int redop,
                            int root, void *stream) {
    comm_of(c);
    if (!type_name(dtype)) {
        char what[96];
        snprintf(what, sizeof what, "%s of data type %d", OP_NAMES[kind], dtype);
        return fail(c, ncclInvalidArgument, "%s: the fake NCCL implements float32, float16 and bfloat16 only", what);
    }
    if (redop != ncclSum) return fail(c, ncclInvalidArgument, "%s: the fake NCCL implements sums only", OP_NAMES[kind]);
    int peer_op = kind == OP_SEND || kind == OP_RECV;
    if ((peer_op || kind == OP_BROADCAST || kind == OP_REDUCE) && (root < 0 || root >= c->world->nranks)) {
        return fail(c, ncclInvalidArgument, "%s: root or peer outside the world", OP_NAMES[kind]);
    }
    if (peer_op && root == c->rank) return fail(c, ncclInvalidUsage, "%s: a rank cannot send to itself", OP_NAMES[kind]);
    if (group_depth > 0) {
        if (n_deferred == cap_deferred) {
            cap_deferred = cap_deferred ? 2 * cap_deferred : 16;
            deferred = realloc(deferred, cap_deferred * sizeof *deferred);
            if (!deferred) fake_cuda_fatal("out of host memory");
        }
        /* Queued on the stream now, posted at the group's end: a group never ended leaves the
         * stream waiting for it. */
        uint64_t ticket = fake_cuda_ticket_begin(stream);
        deferred[n_deferred++] = (deferred_t){c, kind, dtype, (void *)send, recv, count, root, stream, ticket};
        return ncclSuccess;
    }
    return post(c, kind, dtype, (void *)send, recv, count, root, stream, 0);
}

EXPORT ncclResult_t ncclAllReduce(const void *s, void *r, size_t n, int dt, int op, comm_t *c, void *st) {
    return enqueue(c, OP_ALL_REDUCE, s, r, n, dt, op, 0, st);
}

EXPORT ncclResult_t ncclBroadcast(const void *s, void *r, size_t n, int dt, int root, comm_t *c, void *st) {
    return enqueue(c, OP_BROADCAST, s, r, n, dt, ncclSum, root, st);
}

EXPORT ncclResult_t ncclReduce(const void *s, void *r, size_t n, int dt, int op, int root, comm_t *c, void *st) {
    return enqueue(c, OP_REDUCE, s, r, n, dt, op, root, st);
}

EXPORT ncclResult_t ncclAllGather(const void *s, void *r, size_t n, int dt, comm_t *c, void *st) {
    return enqueue(c, OP_ALL_GATHER, s, r, n, dt, ncclSum, 0, st);
}

EXPORT ncclResult_t ncclReduceScatter(const void *s, void *r, size_t n, int dt, int op, comm_t *c, void *st) {
    return enqueue(c, OP_REDUCE_SCATTER, s, r, n, dt, op, 0, st);
}

EXPORT ncclResult_t ncclSend(const void *s, size_t n, int dt, int peer, comm_t *c, void *st) {
    return enqueue(c, OP_SEND, s, NULL, n, dt, ncclSum, peer, st);
}

EXPORT ncclResult_t ncclRecv(void *r, size_t n, int dt, int peer, comm_t *c, void *st) {
    return enqueue(c, OP_RECV, NULL, r, n, dt, ncclSum, peer, st);
}

/* ---- teardown ---- */

/* End this rank's pending operations without moving data (what an abort does to its
 * kernels), and mark the world broken: the other ranks' parts can never complete, their
 * ncclCommGetAsyncError reports a remote error, and they have to abort in turn. */
static void abort_rank(world_t *w, int rank) {
    w->aborted = 1;
    for (op_t *op = w->ops; op; op = op->next) {
        if (op->parts[rank].posted) {
            op->parts[rank].posted = 0;
            fake_cuda_ticket_end(op->parts[rank].ticket);
        }
    }
    int n = w->nranks;
    for (op_t *op = w->p2p; op; op = op->next) {
        for (int side = 0; side < 2; side++) {
            int who = side == 0 ? op->root / n : op->root % n;
            if (who == rank && op->parts[side].posted) {
                op->parts[side].posted = 0;
                fake_cuda_ticket_end(op->parts[side].ticket);
            }
        }
    }
}

static int nothing_pending_for(void *arg) {
    comm_t *c = arg;
    world_t *w = c->world;
    for (op_t *op = w->ops; op; op = op->next) {
        if (op->parts[c->rank].posted) return 0;
    }
    for (op_t *op = w->p2p; op; op = op->next) {
        int n = w->nranks, from = op->root / n, to = op->root % n;
        if ((from == c->rank && op->parts[0].posted) || (to == c->rank && op->parts[1].posted)) return 0;
    }
    return 1;
}

static void release(comm_t *c) {
    world_t *w = c->world;
    w->comms[c->rank] = NULL;
    c->magic = 0;
    free(c);
    if (--w->alive == 0) {
        world_t **p = &worlds;
        while (*p != w) p = &(*p)->next;
        *p = w->next;
        for (op_t *lists[2] = {w->ops, w->p2p}, **l = lists; l < lists + 2; l++) {
            while (*l) {
                op_t *op = *l;
                *l = op->next;
                finish(op, op->kind == OP_SEND ? 2 : w->nranks);
            }
        }
        free(w->comms);
        free(w->p2p_sent);
        free(w->p2p_recvd);
        free(w);
    }
}

EXPORT ncclResult_t ncclCommFinalize(comm_t *c) {
    comm_of(c);
    return ncclSuccess;
}

EXPORT ncclResult_t ncclCommDestroy(comm_t *c) {
    comm_of(c);
    if (group_depth > 0) {
        fake_cuda_fatal("ncclCommDestroy with a group still open (ncclGroupStart without ncclGroupEnd): the "
                        "group's operations were never posted");
    }
    pthread_mutex_lock(&lock);
    /* As NCCL's destroy, wait for this rank's work; a collective that can never complete must
     * be aborted instead, and waiting for it here is the hang the caller had to avoid. */
    wait_until(nothing_pending_for, c, "ncclCommDestroy (a pending collective; abort the communicator instead)");
    release(c);
    pthread_mutex_unlock(&lock);
    return ncclSuccess;
}

EXPORT ncclResult_t ncclCommAbort(comm_t *c) {
    comm_of(c);
    pthread_mutex_lock(&lock);
    abort_rank(c->world, c->rank);
    release(c);
    pthread_cond_broadcast(&changed);
    pthread_mutex_unlock(&lock);
    return ncclSuccess;
}
