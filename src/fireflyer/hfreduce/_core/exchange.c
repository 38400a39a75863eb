/* hfreduce's exchange driven in C; see exchange.h. */
#define _GNU_SOURCE
#include "exchange.h"

#include <errno.h>
#include <limits.h>
#include <linux/futex.h>
#include <poll.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <sys/syscall.h>
#include <sys/uio.h>
#include <time.h>
#include <unistd.h>

#include "arena.h" /* now_ns, cpu_relax */

#define FRAME_DATA 0x44415441u   /* links.DATA */
#define FRAME_DIRECT 0x44495243u /* channels.DIRECT */
#define PIECE (1LL << 20)        /* mailbox.PIECE: bytes copied between two announcements */
#define REMOTE_PIECE (16LL << 20) /* mailbox._REMOTE_PIECE */
#define ACK_COUNT 0x7FFFFFFFu
#define NAP_NS 2000000LL       /* progress._NAP */
#define MIXED_NAP_NS 200000LL  /* progress._MIXED_NAP */
#ifndef SYS_futex_waitv
#define SYS_futex_waitv 449
#endif
#define WAITV_MAX 128 /* the kernel's limit on futex_waitv's waiters */
#define WAITV_SIZE_U32 0x02

/* links.FRAME ("<IIqq16s"), then for a direct ring frame the payload's address ("<Q"). */
typedef struct __attribute__((packed)) {
    uint32_t kind;
    uint32_t space;
    int64_t key;
    int64_t nbytes;
    int64_t digest[2];
} frame_header;

struct waitv { /* the kernel's struct futex_waitv */
    uint64_t val;
    uint64_t uaddr;
    uint32_t flags;
    uint32_t reserved;
};

static inline int32_t *word(int64_t addr) { return (int32_t *)(intptr_t)addr; }
static inline uint32_t load(int64_t addr) { return (uint32_t)__atomic_load_n(word(addr), __ATOMIC_ACQUIRE); }

static inline void wake(int64_t addr) { syscall(SYS_futex, word(addr), FUTEX_WAKE, INT_MAX, NULL, NULL, 0); }

static inline void store_wake(int64_t addr, uint32_t value) {
    __atomic_store_n(word(addr), (int32_t)value, __ATOMIC_RELEASE);
    wake(addr);
}

static inline int64_t min64(int64_t a, int64_t b) { return a < b ? a : b; }

/* -- rings (mailbox.Ring) ------------------------------------------------------------------ */

static int64_t ring_free(const hfx_item *it) {
    return it->ring_bytes - (int64_t)(uint32_t)((uint32_t)it->count - load(it->tail_addr));
}

static int64_t ring_available(const hfx_item *it) {
    return (int64_t)(uint32_t)(load(it->head_addr) - (uint32_t)it->count);
}

/* Copy n bytes into the ring at the head (wrapping at its end) and move the head on, unannounced. */
static void ring_put(hfx_item *it, const void *src, int64_t n) {
    char *ring = (char *)(intptr_t)it->ring;
    int64_t off = it->count % it->ring_bytes, first = min64(n, it->ring_bytes - off);
    memcpy(ring + off, src, (size_t)first);
    memcpy(ring, (const char *)src + first, (size_t)(n - first));
    it->count += n;
}

/* The next n bytes at the tail (wrapping), not consumed. */
static void ring_peek(const hfx_item *it, void *dst, int64_t n) {
    const char *ring = (const char *)(intptr_t)it->ring;
    int64_t off = it->count % it->ring_bytes, first = min64(n, it->ring_bytes - off);
    memcpy(dst, ring + off, (size_t)first);
    memcpy((char *)dst + first, ring, (size_t)(n - first));
}

static void publish_head(hfx_item *it) {
    if (load(it->head_addr) != (uint32_t)it->count)
        store_wake(it->head_addr, (uint32_t)it->count);
}

static void consume(hfx_item *it, int64_t n, int publish) {
    it->count += n;
    if (publish)
        store_wake(it->tail_addr, (uint32_t)it->count);
}

static int ring_out(hfx_item *it, int *moved) {
    if (it->stage == HFX_HEAD) {
        int direct = it->direct && it->nbytes >= it->direct;
        unsigned char head[sizeof(frame_header) + 8];
        frame_header h = {direct ? FRAME_DIRECT : FRAME_DATA, (uint32_t)it->space, it->key, it->nbytes,
                          {it->digest[0], it->digest[1]}};
        memcpy(head, &h, sizeof h);
        int64_t hsize = sizeof h;
        if (direct) {
            uint64_t address = (uint64_t)it->data;
            memcpy(head + hsize, &address, 8);
            hsize += 8;
        }
        int64_t free = ring_free(it);
        if (free < hsize)
            return 0;
        ring_put(it, head, hsize);
        *moved = 1;
        if (direct) {
            publish_head(it);
            it->acks += 1; /* Ring.ask */
            it->stage = HFX_ACK;
        } else if (it->nbytes > 0 && it->nbytes <= free - hsize) {
            /* a small frame: header and payload announced at once (one wake-up) */
            for (int64_t done = 0; done < it->nbytes; done += PIECE)
                ring_put(it, (const char *)(intptr_t)it->data + done, min64(PIECE, it->nbytes - done));
            it->pos = it->nbytes;
            publish_head(it);
            it->stage = HFX_DONE;
        } else {
            publish_head(it);
            it->stage = it->nbytes ? HFX_BODY : HFX_DONE;
        }
        return 0;
    }
    if (it->stage == HFX_ACK) {
        uint32_t w = load(it->ack_addr);
        if ((w >> 1) != ((uint64_t)it->acks & ACK_COUNT))
            return 0;
        *moved = 1;
        if (w & 1) {
            it->stage = HFX_DONE;
        } else { /* the receiver cannot read this process: the payload follows through the ring, from now on */
            it->direct = 0;
            it->stage = it->nbytes ? HFX_BODY : HFX_DONE;
        }
        return 0;
    }
    int64_t free = ring_free(it);
    if (free <= 0)
        return 0;
    int64_t off = it->count % it->ring_bytes;
    int64_t k = min64(min64(it->nbytes - it->pos, free), min64(it->ring_bytes - off, PIECE));
    ring_put(it, (const char *)(intptr_t)it->data + it->pos, k);
    publish_head(it);
    it->pos += k;
    *moved = 1;
    if (it->pos >= it->nbytes)
        it->stage = HFX_DONE;
    return 0;
}

/* The frame stopped the run: keep what it was, for the caller's message. */
static void got(hfx_item *it, const frame_header *h) {
    it->got_kind = h->kind;
    it->got_space = h->space;
    it->got_key = h->key;
    it->got_nbytes = h->nbytes;
    it->got_digest[0] = h->digest[0];
    it->got_digest[1] = h->digest[1];
}

/* 0 if a frame (already known to be this call's) is the one the item expects, else HFX_MISMATCH. */
static int expected(hfx_item *it, const frame_header *h) {
    if (h->nbytes != it->nbytes || h->digest[0] != it->digest[0] || h->digest[1] != it->digest[1]) {
        got(it, h);
        return HFX_MISMATCH;
    }
    return 0;
}

/* process_vm_readv of the whole payload: 1 read, 0 refused by the kernel (nothing read), or HFX_REMOTE. */
static int read_remote(hfx_item *it, uint64_t address) {
    int64_t done = 0;
    while (done < it->nbytes) {
        int64_t k = min64(it->nbytes - done, REMOTE_PIECE);
        struct iovec local = {(char *)(intptr_t)it->data + done, (size_t)k};
        struct iovec remote = {(void *)(uintptr_t)(address + (uint64_t)done), (size_t)k};
        ssize_t r = syscall(SYS_process_vm_readv, (pid_t)it->direct, &local, 1UL, &remote, 1UL, 0UL);
        if (r <= 0) {
            int e = r < 0 ? errno : 0;
            if (done == 0 && (e == EPERM || e == EACCES || e == ENOSYS))
                return 0;
            it->err = e;
            it->got_nbytes = k;
            return -1;
        }
        done += r;
    }
    return 1;
}

static int ring_in(hfx_item *it, int *moved) {
    if (it->stage == HFX_HEAD) {
        int64_t avail = ring_available(it);
        frame_header h;
        if (avail < (int64_t)sizeof h)
            return 0;
        ring_peek(it, &h, sizeof h);
        if (h.kind != FRAME_DATA && h.kind != FRAME_DIRECT) {
            got(it, &h);
            return HFX_GARBLED;
        }
        if ((int64_t)h.space != it->space || h.key != it->key) {
            got(it, &h);
            return HFX_FOREIGN;
        }
        int64_t size = sizeof h + (h.kind == FRAME_DIRECT ? 8 : 0);
        if (avail < size)
            return 0;
        int rc = expected(it, &h);
        if (rc)
            return rc;
        *moved = 1;
        if (h.kind == FRAME_DIRECT) {
            unsigned char raw[sizeof h + 8];
            uint64_t address;
            ring_peek(it, raw, size);
            memcpy(&address, raw + sizeof h, 8);
            consume(it, size, 1);
            int ok = read_remote(it, address);
            if (ok < 0)
                return HFX_REMOTE;
            it->acks += 1; /* Ring.answer */
            store_wake(it->ack_addr, (uint32_t)((((uint64_t)it->acks & ACK_COUNT) << 1) | (uint64_t)ok));
            it->pos = ok ? it->nbytes : 0;
            it->stage = ok || !it->nbytes ? HFX_DONE : HFX_BODY;
            return 0;
        }
        /* the payload's first piece announces the header's bytes free too (one wake-up for both) */
        consume(it, size, !h.nbytes || avail < size + 1);
        it->stage = h.nbytes ? HFX_BODY : HFX_DONE;
        return 0;
    }
    int64_t avail = ring_available(it);
    if (!avail)
        return 0;
    int64_t off = it->count % it->ring_bytes;
    int64_t k = min64(min64(it->nbytes - it->pos, avail), min64(it->ring_bytes - off, PIECE));
    memcpy((char *)(intptr_t)it->data + it->pos, (const char *)(intptr_t)it->ring + off, (size_t)k);
    consume(it, k, 1);
    it->pos += k;
    *moved = 1;
    if (it->pos >= it->nbytes)
        it->stage = HFX_DONE;
    return 0;
}

/* -- TCP (channels.TcpOut and TcpIn) --------------------------------------------------------- */

static int blocked(int e) { return e == EAGAIN || e == EWOULDBLOCK || e == EINTR; }

static int tcp_out(hfx_item *it, int *moved) {
    frame_header h = {FRAME_DATA, (uint32_t)it->space, it->key, it->nbytes, {it->digest[0], it->digest[1]}};
    int64_t hsize = sizeof h, total = hsize + it->nbytes;
    char *payload = (char *)(intptr_t)it->data;
    while (it->pos < total) {
        struct iovec iov[2];
        int cnt = 0;
        if (it->pos < hsize) {
            iov[cnt++] = (struct iovec){(char *)&h + it->pos, (size_t)(hsize - it->pos)};
            if (it->nbytes)
                iov[cnt++] = (struct iovec){payload, (size_t)it->nbytes};
        } else {
            iov[cnt++] = (struct iovec){payload + (it->pos - hsize), (size_t)(total - it->pos)};
        }
        struct msghdr m;
        memset(&m, 0, sizeof m);
        m.msg_iov = iov;
        m.msg_iovlen = (size_t)cnt;
        ssize_t k = sendmsg((int)it->fd, &m, MSG_DONTWAIT | MSG_NOSIGNAL);
        if (k < 0) {
            if (blocked(errno))
                break;
            it->err = errno;
            return HFX_LOST;
        }
        it->pos += k;
        *moved = 1;
    }
    if (it->pos >= total)
        it->stage = HFX_DONE;
    return 0;
}

static int tcp_in(hfx_item *it, int *moved) {
    int fd = (int)it->fd;
    if (it->stage == HFX_HEAD) {
        frame_header h;
        ssize_t k = recv(fd, &h, sizeof h, MSG_PEEK | MSG_DONTWAIT);
        if (k < 0) {
            if (blocked(errno))
                return 0;
            it->err = errno;
            return HFX_LOST;
        }
        if (k == 0) {
            it->err = 0;
            return HFX_LOST;
        }
        if (k < (ssize_t)sizeof h)
            return 0;
        if (h.kind != FRAME_DATA) {
            got(it, &h);
            return HFX_ERROR_FRAME;
        }
        if ((int64_t)h.space != it->space || h.key != it->key) {
            got(it, &h);
            return HFX_FOREIGN;
        }
        int rc = expected(it, &h);
        if (rc)
            return rc;
        k = recv(fd, &h, sizeof h, MSG_DONTWAIT); /* all there (peeked): consumed without waiting */
        if (k != (ssize_t)sizeof h) {
            it->err = k < 0 ? errno : 0;
            return HFX_LOST;
        }
        *moved = 1;
        it->stage = it->nbytes ? HFX_BODY : HFX_DONE;
        return 0;
    }
    char *dst = (char *)(intptr_t)it->data;
    while (it->pos < it->nbytes) { /* drain what has arrived */
        ssize_t k = recv(fd, dst + it->pos, (size_t)(it->nbytes - it->pos), MSG_DONTWAIT);
        if (k < 0) {
            if (blocked(errno))
                break;
            it->err = errno;
            return HFX_LOST;
        }
        if (k == 0) {
            it->err = 0;
            return HFX_LOST;
        }
        it->pos += k;
        *moved = 1;
    }
    if (it->pos >= it->nbytes)
        it->stage = HFX_DONE;
    return 0;
}

/* -- waiting --------------------------------------------------------------------------------- */

/* The word a pending ring item waits on: the tail (sending), the ack word (a direct read's answer), the head. */
static int64_t ring_word(const hfx_item *it) {
    if (it->kind == HFX_RING_IN)
        return it->head_addr;
    return it->stage == HFX_ACK ? it->ack_addr : it->tail_addr;
}

/* Sleep until one of the pending items can move, or at most `left` ns: futex_waitv on the rings' words
 * when only rings wait (futex on the first where futex_waitv is missing), else a short ppoll on the
 * sockets, so that a ring that moves meanwhile is seen soon too. */
static void nap(hfx_item *items, int64_t n, int64_t left, struct pollfd *fds, struct waitv *wv) {
    int nfds = 0, nw = 0;
    for (int64_t i = 0; i < n; i++) {
        hfx_item *it = &items[i];
        if (it->stage == HFX_DONE)
            continue;
        if (it->kind == HFX_TCP_OUT || it->kind == HFX_TCP_IN) {
            fds[nfds].fd = (int)it->fd;
            fds[nfds].events = it->kind == HFX_TCP_OUT ? POLLOUT : POLLIN;
            fds[nfds].revents = 0;
            nfds++;
        } else if (nw < WAITV_MAX) {
            int64_t addr = ring_word(it);
            wv[nw] = (struct waitv){(uint64_t)load(addr), (uint64_t)addr, WAITV_SIZE_U32, 0};
            nw++;
        }
    }
    if (nfds) {
        int64_t t = min64(left, nw ? MIXED_NAP_NS : NAP_NS);
        struct timespec ts = {t / 1000000000LL, t % 1000000000LL};
        ppoll(fds, (nfds_t)nfds, &ts, NULL);
        return;
    }
    if (!nw)
        return;
    int64_t t = min64(left, NAP_NS);
    static int no_waitv = 0;
    if (!no_waitv && nw > 1) {
        int64_t until = now_ns() + t;
        struct timespec abs = {until / 1000000000LL, until % 1000000000LL};
        long r = syscall(SYS_futex_waitv, wv, (unsigned)nw, 0u, &abs, CLOCK_MONOTONIC);
        if (r >= 0 || errno != ENOSYS)
            return;
        no_waitv = 1;
    }
    struct timespec rel = {t / 1000000000LL, t % 1000000000LL};
    syscall(SYS_futex, (int32_t *)(uintptr_t)wv[0].uaddr, FUTEX_WAIT, (int32_t)(uint32_t)wv[0].val, &rel, NULL, 0);
}

int hfx_drive(hfx_item *items, int64_t n, int64_t slice_ns, int64_t spin_ns, int64_t *index) {
    *index = -1;
    struct pollfd *fds = calloc((size_t)(n > 0 ? n : 1), sizeof *fds);
    struct waitv *wv = calloc((size_t)(n < WAITV_MAX ? (n > 0 ? n : 1) : WAITV_MAX), sizeof *wv);
    if (!fds || !wv) {
        free(fds);
        free(wv);
        *index = 0;
        items[0].err = ENOMEM;
        return HFX_LOST;
    }
    int64_t start = now_ns(), end = start + slice_ns, spin_until = 0;
    int idle = 0, rc = HFX_AGAIN;
    for (;;) {
        int moved = 0, pending = 0;
        for (int64_t i = 0; i < n; i++) {
            hfx_item *it = &items[i];
            if (it->stage == HFX_DONE)
                continue;
            int r;
            switch (it->kind) {
            case HFX_RING_OUT:
                r = ring_out(it, &moved);
                break;
            case HFX_RING_IN:
                r = ring_in(it, &moved);
                break;
            case HFX_TCP_OUT:
                r = tcp_out(it, &moved);
                break;
            default:
                r = tcp_in(it, &moved);
                break;
            }
            if (r) {
                *index = i;
                rc = r;
                goto out;
            }
            pending += it->stage != HFX_DONE;
        }
        if (!pending) {
            rc = HFX_ALL_DONE;
            break;
        }
        if (moved) {
            idle = 0;
            continue;
        }
        int64_t now = now_ns();
        if (now >= end)
            break;
        if (++idle == 1)
            spin_until = now + spin_ns;
        if (now < spin_until) {
            cpu_relax();
            continue;
        }
        nap(items, n, end - now, fds, wv);
    }
out:
    free(fds);
    free(wv);
    return rc;
}
