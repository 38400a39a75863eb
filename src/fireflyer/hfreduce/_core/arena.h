/* Inside the compiled core: the arena's layout and handoffs, as the node stage (node.c) and the
 * tree stage (tree.c) both use them. See node.h for the protocol. Not part of any interface. */
#ifndef FIREFLYER_HFREDUCE_ARENA_H
#define FIREFLYER_HFREDUCE_ARENA_H

#include <limits.h>
#include <linux/futex.h>
#include <stdint.h>
#include <sys/syscall.h>
#include <time.h>
#include <unistd.h>

#include "kernels.h"
#include "node.h"

#define LINE 64
#define DESC_SLOT 64
#define NSTAGES 4
#define SLICE_NS 50000000LL    /* futex sleeps at most this long between checks */
#define LIVENESS_NS 50000000LL /* how often the local peers' processes are looked at */
#define CROWDED_YIELD_NS 1000000LL /* a yield that took longer ran another process's time slice ... */
#define CROWDED_HOLD_NS 100000000LL /* ... and the waits of the next 100 ms sleep at once */
#define MAX_LOCAL 256

static inline int64_t now_ns(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (int64_t)ts.tv_sec * 1000000000LL + ts.tv_nsec;
}

static inline void cpu_relax(void) {
#if defined(__x86_64__) || defined(__i386__)
    __builtin_ia32_pause();
#elif defined(__aarch64__)
    __asm__ __volatile__("yield");
#endif
}

static inline volatile int32_t *flag(const hfr_comm *c, int stage, int64_t k) {
    return (volatile int32_t *)(c->base + c->flags_offset + (stage * c->local_size + k) * LINE);
}

static inline int reached(int32_t value, int64_t target) {
    return (uint32_t)((uint32_t)value - (uint32_t)target) < 0x80000000u;
}

static inline void publish(const hfr_comm *c, int stage, int64_t value) {
    volatile int32_t *w = flag(c, stage, c->local_rank);
    __atomic_store_n((int32_t *)w, (int32_t)(uint32_t)value, __ATOMIC_RELEASE);
    syscall(SYS_futex, (int32_t *)w, FUTEX_WAKE, INT_MAX, NULL, NULL, 0);
}

static inline int aborted(const hfr_comm *c) {
    return __atomic_load_n((int32_t *)(c->base + c->abort_offset), __ATOMIC_ACQUIRE) != 0;
}


static inline char *in_slot(const hfr_comm *c, int64_t b, int64_t k) {
    return (char *)(c->base + c->control_bytes + (b * c->local_size + k) * c->chunk_bytes);
}

static inline char *red_buf(const hfr_comm *c, int64_t b) {
    return (char *)(c->base + c->control_bytes + c->depth * c->local_size * c->chunk_bytes + b * c->red_bytes);
}

static inline char *out_buf(const hfr_comm *c, int64_t b) {
    return (char *)(c->base + c->control_bytes + c->depth * (c->local_size * c->chunk_bytes + c->red_bytes) +
                    b * c->chunk_bytes);
}

static inline int64_t itemsize(int64_t dtype) {
    switch (dtype) {
    case HFR_F64:
    case HFR_I64:
        return 8;
    case HFR_F32:
    case HFR_I32:
        return 4;
    case HFR_F16:
    case HFR_BF16:
    case HFR_I16:
        return 2;
    default:
        return 1;
    }
}

/* topology.split: part `index` of `total` items cut into `parts` near-equal pieces. */
static inline void split(int64_t total, int64_t parts, int64_t index, int64_t *lo, int64_t *hi) {
    int64_t base = total / parts, extra = total % parts;
    *lo = index * base + (index < extra ? index : extra);
    *hi = *lo + base + (index < extra ? 1 : 0);
}

/* The next sleep of a wait that gives up at `deadline`: at most SLICE_NS, so its checks run between. */
static inline struct timespec slice_until(int64_t deadline, int64_t now) {
    int64_t left = deadline - now;
    if (left > SLICE_NS)
        left = SLICE_NS;
    struct timespec ts = {left / 1000000000LL, left % 1000000000LL};
    return ts;
}

/* A run's waits: whose collective, where it stopped, when the local peers were last looked at. */
typedef struct {
    const hfr_comm *comm;
    const hfr_job *job; /* its deadline_ns and late_deadline_ns bound the waits */
    hfr_where *where;
    int64_t next_liveness;
    hfr_interrupt_hook interrupted;
    void *arg;
} run_state;

/* Until flag (stage, k) reaches target: 0, or HFR_TIMEOUT / HFR_ABORTED / HFR_PEER_DEAD /
 * HFR_INTERRUPTED with st->where filled. `late` waits use the job's late deadline. */
int hfr_wait_one(run_state *st, int stage, int64_t k, int64_t target, int64_t chunk, int late);

/* Whether a local peer's process has died (looked at every LIVENESS_NS): its local rank, else -1. */
int64_t hfr_dead_peer(run_state *st, int64_t now);

#endif
