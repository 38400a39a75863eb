/* hfreduce's node stage in C; see node.h for the protocol. */
#define _GNU_SOURCE
#include <errno.h>
#include <fcntl.h>
#include <sched.h>
#include <signal.h>
#include <stdio.h>
#include <string.h>

#include "arena.h"

/* Dead, or a zombie; a process we may not signal counts as alive (as procs.pid_alive). */
static int pid_dead(int64_t pid) {
    if (pid <= 0)
        return 0;
    if (kill((pid_t)pid, 0) != 0)
        return errno == ESRCH;
    char path[64], buf[512];
    snprintf(path, sizeof path, "/proc/%lld/stat", (long long)pid);
    int fd = open(path, O_RDONLY | O_CLOEXEC);
    if (fd < 0)
        return 0;
    ssize_t n = read(fd, buf, sizeof buf - 1);
    close(fd);
    if (n <= 0)
        return 0;
    buf[n] = 0;
    char *p = strrchr(buf, ')');
    return p && p[1] == ' ' && (p[2] == 'Z' || p[2] == 'X');
}

int64_t hfr_dead_peer(run_state *st, int64_t now) {
    const hfr_comm *c = st->comm;
    if (now < st->next_liveness)
        return -1;
    st->next_liveness = now + LIVENESS_NS;
    const int64_t *pids = (const int64_t *)(c->base + c->pid_offset);
    for (int64_t j = 0; j < c->local_size; j++)
        if (j != c->local_rank && pid_dead(__atomic_load_n(&pids[j], __ATOMIC_RELAXED)))
            return j;
    return -1;
}

/* Until when this process's waits skip their yields (CLOCK_MONOTONIC ns; see hfr_wait_one). */
static int64_t crowded_until;

int hfr_wait_one(run_state *st, int stage, int64_t k, int64_t target, int64_t chunk, int late) {
    const hfr_comm *c = st->comm;
    volatile int32_t *w = flag(c, stage, k);
    int32_t v = __atomic_load_n((int32_t *)w, __ATOMIC_ACQUIRE);
    if (reached(v, target))
        return 0;
    for (int64_t i = 0; i < c->spin; i++) {
        cpu_relax();
        v = __atomic_load_n((int32_t *)w, __ATOMIC_ACQUIRE);
        if (reached(v, target))
            return 0;
    }
    int64_t deadline = late ? st->job->late_deadline_ns : st->job->deadline_ns;
    int64_t t, yields = 0;
    for (;;) {
        v = __atomic_load_n((int32_t *)w, __ATOMIC_ACQUIRE);
        if (reached(v, target))
            return 0;
        st->where->stage = stage;
        st->where->local_rank = k;
        st->where->chunk = chunk;
        st->where->late = late;
        /* A failure seen here counts only if the flag is still short: a peer may publish and then
           die (or the group fail) between the load above and these checks. */
        if (aborted(c))
            return reached(__atomic_load_n((int32_t *)w, __ATOMIC_ACQUIRE), target) ? 0 : HFR_ABORTED;
        t = now_ns();
        int64_t dead = hfr_dead_peer(st, t);
        if (dead >= 0) {
            if (reached(__atomic_load_n((int32_t *)w, __ATOMIC_ACQUIRE), target))
                return 0;
            st->where->local_rank = dead;
            return HFR_PEER_DEAD;
        }
        if (t >= deadline)
            return HFR_TIMEOUT;
        /* A few yields hand the core to a peer that shares it (cheap when one is runnable); a
           yield with nobody else to run returns at once, so they are counted, not timed: a rank
           whose peer is far away sleeps instead of spinning through its yields. A yield that
           came back late, and with the flag still short, handed the core to some other busy
           process for a whole time slice (a peer that kept it as long would have published): for
           a while every one-shot wait then sleeps at once, as a sleeper that is woken runs before
           such a process and a yielder runs after it. Only one-shot collectives judge so: the
           ranks they wait for have a call's work to do, while a pipeline's peer may rightly keep
           the core longer (a chunk's copies and sums), and its waits keep their yields. */
        int one_shot = st->job->mode == HFR_MODE_ONESHOT || st->job->mode == HFR_MODE_ALL_TO_ALL;
        if (yields < c->yields && !(one_shot && t < __atomic_load_n(&crowded_until, __ATOMIC_RELAXED))) {
            yields++;
            sched_yield();
            int64_t after = now_ns();
            if (one_shot && after - t > CROWDED_YIELD_NS && !reached(__atomic_load_n((int32_t *)w, __ATOMIC_ACQUIRE), target))
                __atomic_store_n(&crowded_until, after + CROWDED_HOLD_NS, __ATOMIC_RELAXED);
            continue;
        }
        struct timespec ts = slice_until(deadline, t);
        syscall(SYS_futex, (int32_t *)w, FUTEX_WAIT, v, &ts, NULL, 0);
        if (st->interrupted && st->interrupted(st->arg))
            return HFR_INTERRUPTED;
    }
}

static int wait_all(run_state *st, int stage, int64_t n, int64_t target, int64_t chunk, int late) {
    for (int64_t k = 0; k < n; k++) {
        int rc = hfr_wait_one(st, stage, k, target, chunk, late);
        if (rc)
            return rc;
    }
    return 0;
}

/* Every local rank's descriptor matches ours and none uses a registered buffer. Each pipeline buffer
 * has its own descriptor slots (arena.ArenaShape.desc_slot): those of the collective's first one. */
static int descriptors_agree(const hfr_comm *c, const hfr_job *j) {
    const char *base = (const char *)(c->base + c->desc_offset) + (j->first_chunk % c->depth) * c->local_size * DESC_SLOT;
    const char *mine = base + c->local_rank * DESC_SLOT;
    int64_t size = 8 + j->desc_bytes;
    for (int64_t k = 0; k < c->local_size; k++) {
        const char *theirs = base + k * DESC_SLOT;
        if (memcmp(theirs, mine, (size_t)size) != 0)
            return 0; /* a mismatch, or a rank already ahead: the Python side tells them apart */
        for (int64_t b = 0; b < j->ext_bytes; b++)
            if (theirs[size + b])
                return 0;
    }
    return 1;
}

/* HFR_MODE_ALL_TO_ALL: see node.h. One buffer of the rotation, one handoff. */
static int all_to_all(run_state *st) {
    const hfr_comm *c = st->comm;
    const hfr_job *j = st->job;
    const int64_t L = c->local_size, lr = c->local_rank, g = j->first_chunk, b = g % c->depth;
    const int64_t *table = (const int64_t *)j->peer_in;
    const int64_t *send_off = table, *send_len = table + L, *recv_off = table + 2 * L, *recv_len = table + 3 * L;
    const int64_t header = HFR_A2A_HEADER(L);
    int rc;
    if (!table || j->numel < 0)
        return HFR_EARG;
    const int64_t fits = header + j->numel <= c->chunk_bytes;
    if ((rc = wait_all(st, HFR_STAGE_RED, L, g - c->depth + 1, 0, 0))) /* every rank is done with our slot */
        return rc;
    char *slot = in_slot(c, b, lr);
    ((int64_t *)slot)[0] = fits;
    memcpy(slot + 8, send_off, (size_t)(L * 8));
    memcpy(slot + 8 + L * 8, send_len, (size_t)(L * 8));
    if (fits)
        memcpy(slot + header, (const char *)j->src, (size_t)j->numel);
    publish(c, HFR_STAGE_IN, g + 1);
    if ((rc = wait_all(st, HFR_STAGE_IN, L, g + 1, 0, 0)))
        return rc;
    if (!descriptors_agree(c, j))
        return HFR_NEED_PYTHON;
    rc = HFR_DONE;
    for (int64_t k = 0; k < L && rc == HFR_DONE; k++) /* every length first: a mismatch writes nothing */
        if (!((const int64_t *)in_slot(c, b, k))[0])
            rc = HFR_TOO_BIG;
    for (int64_t k = 0; k < L && rc == HFR_DONE; k++) {
        const int64_t *theirs = (const int64_t *)(in_slot(c, b, k) + 8);
        if (theirs[L + lr] != recv_len[k]) {
            st->where->local_rank = k;
            st->where->chunk = theirs[L + lr];
            return HFR_SPLIT_MISMATCH;
        }
    }
    for (int64_t k = 0; k < L && rc == HFR_DONE; k++) {
        /* our own piece comes from our slot too, so an output that overlaps the input is safe */
        const char *theirs = in_slot(c, b, k);
        const int64_t off = ((const int64_t *)(theirs + 8))[lr];
        memcpy((char *)j->dst + recv_off[k], theirs + header + off, (size_t)recv_len[k]);
    }
    publish(c, HFR_STAGE_RED, g + 1);  /* done reading this buffer's slots */
    publish(c, HFR_STAGE_DONE, g + 1); /* and never wrote its out buffer */
    return rc;
}

int hfr_node_run(const hfr_comm *c, const hfr_job *j, hfr_where *where, hfr_interrupt_hook interrupted,
                 void *arg) {
    if (c->local_size < 1 || c->local_size > MAX_LOCAL || c->local_rank < 0 || c->local_rank >= c->local_size ||
        c->depth < 1 || j->nchunks < 1 || j->elems < 1 || j->numel < 0)
        return HFR_EARG;
    run_state st = {c, j, where, now_ns() + LIVENESS_NS, interrupted, arg};
    if (j->mode == HFR_MODE_ALL_TO_ALL)
        return all_to_all(&st);
    const int64_t L = c->local_size, lr = c->local_rank, depth = c->depth;
    const int64_t size = itemsize(j->dtype), acc_size = itemsize(j->acc_dtype);
    const char *src = (const char *)j->src;
    char *dst = (char *)j->dst;
    const int64_t *peer_in = (const int64_t *)j->peer_in, *peer_out = (const int64_t *)j->peer_out;
    const int own_out = peer_out && peer_out[lr]; /* our result is written home by each slice's owner */
    const void *ins[MAX_LOCAL];
    int rc;
    for (int64_t ci = 0; ci < j->nchunks; ci++) {
        const int64_t g = j->first_chunk + ci, b = g % depth;
        const int64_t c0 = ci * j->elems;
        const int64_t n = (j->numel - c0 < j->elems) ? j->numel - c0 : j->elems;
        int64_t s0, s1;
        split(n, L, lr, &s0, &s1);
        if (!(ci == 0 && j->resume)) {
            /* every local rank has read this buffer's slots the last time round */
            if ((rc = wait_all(&st, HFR_STAGE_RED, L, g - depth + 1, ci, 0)))
                return rc;
            char *slot = in_slot(c, b, lr);
            if (j->self_registered) {
                /* the others read our registered buffer directly */
            } else if (j->mode == HFR_MODE_ONESHOT) {
                memcpy(slot, src + c0 * size, (size_t)(n * size)); /* every rank reads all of it */
            } else {                                              /* the others read all but our own slice */
                memcpy(slot, src + c0 * size, (size_t)(s0 * size));
                memcpy(slot + s1 * size, src + (c0 + s1) * size, (size_t)((n - s1) * size));
            }
            publish(c, HFR_STAGE_IN, g + 1);
            if ((rc = wait_all(&st, HFR_STAGE_IN, L, g + 1, ci, 0)))
                return rc;
            if (ci == 0 && !descriptors_agree(c, j))
                return HFR_NEED_PYTHON;
        }
        if (j->mode == HFR_MODE_ONESHOT) {
            for (int64_t k = 0; k < L; k++)
                ins[k] = k == lr ? (const void *)(src + c0 * size) : (const void *)in_slot(c, b, k);
            rc = (j->tree ? hfr_reduce_tree : hfr_reduce)(dst + c0 * size, (int)j->dtype, ins, (int)L, (int)j->dtype, n, (int)j->op, j->divisor);
            if (rc)
                return rc;
            publish(c, HFR_STAGE_RED, g + 1);  /* done reading this buffer's slots */
            publish(c, HFR_STAGE_DONE, g + 1); /* and never wrote its out buffer */
            continue;
        }
        int final = j->mode == HFR_MODE_PIPELINE;
        if (final)
            rc = wait_all(&st, HFR_STAGE_DONE, L, g - depth + 1, ci, 0); /* the out buffer is free */
        else
            rc = wait_all(&st, HFR_STAGE_OUT, c->rails, g - depth + 1, ci, 1); /* the trees are done with red */
        if (rc)
            return rc;
        if (s1 > s0) {
            for (int64_t k = 0; k < L; k++) {
                if (peer_in && peer_in[k])
                    ins[k] = (const void *)(peer_in[k] + (c0 + s0) * size);
                else if (k == lr)
                    ins[k] = (const void *)(src + (c0 + s0) * size);
                else
                    ins[k] = (const void *)(in_slot(c, b, k) + s0 * size);
            }
            char *target = final ? out_buf(c, b) + s0 * size : red_buf(c, b) + s0 * acc_size;
            rc = (j->tree ? hfr_reduce_tree : hfr_reduce)(target, (int)(final ? j->dtype : j->acc_dtype), ins, (int)L, (int)j->dtype, s1 - s0,
                            (int)j->op, final ? j->divisor : 0);
            if (rc)
                return rc;
            if (final && peer_out) /* one node, registered in place: the result goes straight home */
                for (int64_t k = 0; k < L; k++)
                    if (peer_out[k])
                        memcpy((char *)peer_out[k] + (c0 + s0) * size, target, (size_t)((s1 - s0) * size));
        }
        publish(c, HFR_STAGE_RED, g + 1);
        if (!final)
            continue; /* the trees, then the stage-out, take it from here */
        if ((rc = wait_all(&st, HFR_STAGE_RED, L, g + 1, ci, 0))) /* every slice of the chunk is reduced */
            return rc;
        if (!own_out) /* else every slice's owner has written it into our buffer already */
            memcpy(dst + c0 * size, out_buf(c, b), (size_t)(n * size));
        publish(c, HFR_STAGE_DONE, g + 1);
    }
    return HFR_DONE;
}
