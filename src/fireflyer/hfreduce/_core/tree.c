/* hfreduce's tree stage in C; see tree.h. */
#define _GNU_SOURCE
#include "tree.h"

#include <errno.h>
#include <poll.h>
#include <string.h>
#include <sys/socket.h>
#include <sys/uio.h>

#include "arena.h"

#define FRAME_DATA 0x44415441u  /* transport.DATA */
#define FRAME_ERROR 0x4552524Fu /* transport.ERROR */
#define OWN_REDUCE_UP (-3)      /* where.link: the down root waited for this rank's own reduce-up */
#define NODE_FLAG (-2)          /* where.link: a flag of the node */

/* transport.FRAME ("<IIqq16s"). */
typedef struct __attribute__((packed)) {
    uint32_t kind;
    uint32_t seq;
    int64_t chunk;
    int64_t nbytes;
    int64_t digest[2];
} frame_header;

typedef struct {
    run_state rs;     /* the node's flag waits and the liveness checks */
    hfr_job limits;   /* only its deadlines: the tree deadline, for every wait on the node */
    hfr_where flag_where;
    const hfr_tree_job *job;
    hfr_tree_where *where;
} tree_run;

static void at(tree_run *tr, int64_t link, int sending, int64_t chunk) {
    tr->where->link = link;
    tr->where->sending = sending;
    tr->where->chunk = chunk;
}

/* This node failed, or a local peer died: its code, else 0. */
static int failed_here(tree_run *tr, int64_t now) {
    if (aborted(tr->rs.comm))
        return HFR_ABORTED;
    int64_t dead = hfr_dead_peer(&tr->rs, now);
    if (dead >= 0) {
        tr->where->local_rank = dead;
        return HFR_PEER_DEAD;
    }
    return 0;
}

/* Until fd is ready for `events` (or has an error the next call reports): 0, or why not. */
static int ready(tree_run *tr, int fd, short events) {
    for (;;) {
        int64_t t = now_ns();
        int rc = failed_here(tr, t);
        if (rc)
            return rc;
        if (t >= tr->job->deadline_ns)
            return HFR_TIMEOUT;
        struct timespec ts = slice_until(tr->job->deadline_ns, t);
        struct pollfd p = {fd, events, 0};
        int r = ppoll(&p, 1, &ts, NULL);
        if (r > 0)
            return 0;
        if (r < 0 && errno != EINTR)
            return HFR_LOST;
    }
}

/* After a socket call that failed with errno: 0 to call it again (interrupted, or ready after it
 * would have blocked), else why not. */
static int again(tree_run *tr, int fd, short events) {
    if (errno == EINTR)
        return 0;
    if (errno != EAGAIN && errno != EWOULDBLOCK)
        return HFR_LOST;
    return ready(tr, fd, events);
}

static int recv_all(tree_run *tr, int fd, void *buf, int64_t n) {
    char *p = (char *)buf;
    int64_t got = 0;
    while (got < n) {
        ssize_t k = recv(fd, p + got, (size_t)(n - got), MSG_DONTWAIT);
        if (k > 0) {
            got += k;
            continue;
        }
        if (k == 0)
            return HFR_LOST;
        int rc = again(tr, fd, POLLIN);
        if (rc)
            return rc;
    }
    return 0;
}

/* One data frame: the header and the payload in as few system calls as the socket takes. */
static int send_frame(tree_run *tr, int fd, int64_t chunk, const void *payload, int64_t n) {
    const hfr_tree_job *j = tr->job;
    frame_header h = {FRAME_DATA, (uint32_t)j->seq, chunk, n, {j->digest[0], j->digest[1]}};
    struct iovec iov[2] = {{&h, sizeof h}, {(void *)payload, (size_t)n}};
    int i = 0, count = n > 0 ? 2 : 1;
    while (i < count) {
        struct msghdr m;
        memset(&m, 0, sizeof m);
        m.msg_iov = iov + i;
        m.msg_iovlen = (size_t)(count - i);
        ssize_t k = sendmsg(fd, &m, MSG_DONTWAIT | MSG_NOSIGNAL);
        if (k < 0) {
            int rc = again(tr, fd, POLLOUT);
            if (rc)
                return rc;
            continue;
        }
        while (i < count && (size_t)k >= iov[i].iov_len) {
            k -= (ssize_t)iov[i].iov_len;
            i++;
        }
        if (i < count) {
            iov[i].iov_base = (char *)iov[i].iov_base + k;
            iov[i].iov_len -= (size_t)k;
        }
    }
    return 0;
}

/* The header of the next frame on fd: a data frame of this collective's chunk `chunk` with `n`
 * payload bytes, else why not (the header received is left in where). */
static int expect(tree_run *tr, int fd, int64_t chunk, int64_t n) {
    const hfr_tree_job *j = tr->job;
    frame_header h;
    int rc = recv_all(tr, fd, &h, (int64_t)sizeof h);
    if (rc)
        return rc;
    hfr_tree_where *w = tr->where;
    w->kind = h.kind;
    w->seq = h.seq;
    w->frame_chunk = h.chunk;
    w->nbytes = h.nbytes;
    w->digest[0] = h.digest[0];
    w->digest[1] = h.digest[1];
    if (h.kind == FRAME_ERROR)
        return HFR_ERROR_FRAME;
    if (h.kind != FRAME_DATA)
        return HFR_GARBLED;
    if (h.digest[0] != j->digest[0] || h.digest[1] != j->digest[1] || h.seq != (uint32_t)j->seq ||
        h.chunk != chunk || h.nbytes != n)
        return HFR_FRAME_MISMATCH;
    return 0;
}

/* Local rank k's flag `stage` reaches target (every wait on the node uses the tree deadline). */
static int node_flag(tree_run *tr, int stage, int64_t k, int64_t target, int64_t chunk) {
    int rc = hfr_wait_one(&tr->rs, stage, k, target, chunk, 1);
    if (rc) {
        at(tr, NODE_FLAG, 0, chunk);
        tr->where->stage = tr->flag_where.stage;
        tr->where->local_rank = tr->flag_where.local_rank;
    }
    return rc;
}

/* The out buffer of chunk number g is free: every local rank staged out what it held before. */
static int out_free(tree_run *tr, int64_t g, int64_t chunk) {
    const hfr_comm *c = tr->rs.comm;
    for (int64_t k = 0; k < c->local_size; k++) {
        int rc = node_flag(tr, HFR_STAGE_DONE, k, g - c->depth + 1, chunk);
        if (rc)
            return rc;
    }
    return 0;
}

/* Chunk ci's elements (n) and the half [h0, h1) of them this rail carries in this tree. */
static void half_of(const hfr_comm *c, const hfr_tree_job *j, int64_t ci, int64_t *n, int64_t *h0, int64_t *h1) {
    int64_t c0 = ci * j->elems, r0, r1, a, b;
    *n = j->numel - c0 < j->elems ? j->numel - c0 : j->elems;
    split(*n, c->rails, c->local_rank, &r0, &r1);
    split(r1 - r0, 2, j->tree, &a, &b);
    *h0 = r0 + a;
    *h1 = r0 + b;
}

/* The root's finish: AVG's divide and the rounding into the dtype, as SliceReducer.finish does. */
static int finish(const hfr_tree_job *j, void *out, const void *partial, int64_t m) {
    if (m == 0)
        return 0;
    if (j->acc_dtype != j->dtype)
        return hfr_round(out, (int)j->dtype, (const float *)partial, m, j->op == HFR_AVG ? j->world_size : 0);
    if (j->op == HFR_AVG)
        return hfr_reduce(out, (int)j->dtype, &partial, 1, (int)j->dtype, m, HFR_AVG, j->world_size);
    memcpy(out, partial, (size_t)(m * itemsize(j->dtype)));
    return 0;
}

static int reduce_up(tree_run *tr) {
    const hfr_comm *c = tr->rs.comm;
    const hfr_tree_job *j = tr->job;
    const int64_t size = itemsize(j->dtype), acc_size = itemsize(j->acc_dtype), t = j->tree;
    const int root = j->parent_fd < 0;
    /* The root of a plain sum writes the last child's sum straight into the out buffer. */
    const int direct = root && j->acc_dtype == j->dtype && j->op == HFR_SUM && j->nchildren > 0;
    int32_t *root_ready = (int32_t *)j->state;
    int rc;
    for (int64_t ci = 0; ci < j->nchunks; ci++) {
        const int64_t g = j->first_chunk + ci, b = g % c->depth;
        int64_t n, h0, h1;
        half_of(c, j, ci, &n, &h0, &h1);
        const int64_t m = h1 - h0;
        char *partial = red_buf(c, b) + h0 * acc_size, *out = out_buf(c, b) + h0 * size;
        for (int64_t k = 0; k < c->local_size; k++) { /* the node's partial of the half: its reducers */
            int64_t s0, s1;
            split(n, c->local_size, k, &s0, &s1);
            if ((s0 < h1 && h0 < s1) || (s0 == h0 && s1 == h1))
                if ((rc = node_flag(tr, HFR_STAGE_RED, k, g + 1, ci)))
                    return rc;
        }
        if (direct && (rc = out_free(tr, g, ci)))
            return rc;
        for (int64_t i = 0; i < j->nchildren; i++) {
            const int fd = (int)j->child_fd[i];
            void *incoming = (void *)j->scratch[i];
            if (m * acc_size > j->scratch_bytes)
                return HFR_EARG;
            at(tr, i, 0, ci);
            if ((rc = expect(tr, fd, ci, m * acc_size)) || (rc = recv_all(tr, fd, incoming, m * acc_size)))
                return rc;
            if (m == 0)
                continue;
            const void *ins[2] = {partial, incoming};
            if (direct && i == j->nchildren - 1)
                rc = hfr_reduce(out, (int)j->dtype, ins, 2, (int)j->dtype, m, HFR_SUM, 0);
            else
                rc = hfr_reduce(partial, (int)j->acc_dtype, ins, 2, (int)j->acc_dtype, m, (int)j->op, 0);
            if (rc)
                return rc;
        }
        if (!root) {
            at(tr, -1, 1, ci);
            if ((rc = send_frame(tr, (int)j->parent_fd, ci, partial, m * acc_size)))
                return rc;
            continue;
        }
        if (!direct) {
            if ((rc = out_free(tr, g, ci)) || (rc = finish(j, out, partial, m)))
                return rc;
        }
        __atomic_store_n(&root_ready[t], (int32_t)(uint32_t)(g + 1), __ATOMIC_RELEASE);
        syscall(SYS_futex, &root_ready[t], FUTEX_WAKE_PRIVATE, INT_MAX, NULL, NULL, 0);
    }
    return HFR_DONE;
}

/* The down root: until this rank's own reduce-up has finished chunk number g. */
static int own_reduce_up(tree_run *tr, int64_t g, int64_t chunk) {
    int32_t *w = (int32_t *)tr->job->state + tr->job->tree;
    for (;;) {
        int32_t v = __atomic_load_n(w, __ATOMIC_ACQUIRE);
        if (reached(v, g + 1))
            return 0;
        at(tr, OWN_REDUCE_UP, 0, chunk);
        int64_t t = now_ns();
        int rc = failed_here(tr, t);
        if (rc) /* unless the reduce-up finished while we looked */
            return reached(__atomic_load_n(w, __ATOMIC_ACQUIRE), g + 1) ? 0 : rc;
        if (t >= tr->job->self_deadline_ns)
            return HFR_TIMEOUT;
        struct timespec ts = slice_until(tr->job->self_deadline_ns, t);
        syscall(SYS_futex, w, FUTEX_WAIT_PRIVATE, v, &ts, NULL, 0);
    }
}

static int broadcast_down(tree_run *tr) {
    const hfr_comm *c = tr->rs.comm;
    const hfr_tree_job *j = tr->job;
    const int64_t size = itemsize(j->dtype), t = j->tree;
    int32_t *done = (int32_t *)j->state + 2;
    int rc;
    for (int64_t ci = 0; ci < j->nchunks; ci++) {
        const int64_t g = j->first_chunk + ci, b = g % c->depth;
        int64_t n, h0, h1;
        half_of(c, j, ci, &n, &h0, &h1);
        const int64_t nbytes = (h1 - h0) * size;
        char *out = out_buf(c, b) + h0 * size;
        if (j->parent_fd < 0) {
            if ((rc = own_reduce_up(tr, g, ci)))
                return rc;
        } else {
            if ((rc = out_free(tr, g, ci)))
                return rc;
            at(tr, -1, 0, ci);
            if ((rc = expect(tr, (int)j->parent_fd, ci, nbytes)) || (rc = recv_all(tr, (int)j->parent_fd, out, nbytes)))
                return rc;
        }
        for (int64_t i = 0; i < j->nchildren; i++) {
            at(tr, i, 1, ci);
            if ((rc = send_frame(tr, (int)j->child_fd[i], ci, out, nbytes)))
                return rc;
        }
        /* Both trees' halves in: this rail's slice of the chunk is ready. Either tree's thread may
         * come second; if both see the other's mark, both raise the flag to the same value. */
        __atomic_store_n(&done[t], (int32_t)(uint32_t)(g + 1), __ATOMIC_SEQ_CST);
        if (reached(__atomic_load_n(&done[1 - t], __ATOMIC_SEQ_CST), g + 1))
            publish(c, HFR_STAGE_OUT, g + 1);
    }
    return HFR_DONE;
}

int hfr_tree_run(const hfr_comm *c, const hfr_tree_job *j, hfr_tree_where *where) {
    memset(where, 0, sizeof *where);
    if (c->local_size < 1 || c->local_rank < 0 || c->local_rank >= c->local_size || c->rails < 1 ||
        c->local_rank >= c->rails || c->depth < 1 || j->nchunks < 1 || j->elems < 1 || j->numel < 0 ||
        (j->tree != 0 && j->tree != 1) || j->nchildren < 0 || j->nchildren > 2 || !j->state ||
        j->op == HFR_COPY || (j->role != HFR_TREE_UP && j->role != HFR_TREE_DOWN))
        return HFR_EARG;
    tree_run tr;
    memset(&tr, 0, sizeof tr);
    tr.limits.deadline_ns = tr.limits.late_deadline_ns = j->deadline_ns;
    tr.rs.comm = c;
    tr.rs.job = &tr.limits;
    tr.rs.where = &tr.flag_where;
    tr.rs.next_liveness = now_ns() + LIVENESS_NS;
    tr.job = j;
    tr.where = where;
    return j->role == HFR_TREE_UP ? reduce_up(&tr) : broadcast_down(&tr);
}
