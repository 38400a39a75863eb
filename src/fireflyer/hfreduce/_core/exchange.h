/* hfreduce's exchange driven in C: the transfers of one synchronous all-to-all, gather, scatter or
 * cross-rail step (transport/progress.py, whose loop this is, step for step).
 *
 * The Python side claims each channel, opens and authenticates its TCP link, and hands over one
 * item per transfer: a ring of the node's mailboxes (transport/mailbox.py, the same counters,
 * frames and direct reads) or a non-blocking socket (transport/channels.py, the same frames).
 * A run moves every item as far as it goes without waiting, over and over, spinning for a
 * moment and then sleeping (futex_waitv on the rings' words, poll on the sockets) when nothing
 * moved. It returns when every item is done, when the time slice it was given has passed (the
 * caller checks the group and the deadline, then runs it again), or at an item that needs
 * Python: a frame of another call ahead of its own, a frame that is not the expected one, a
 * lost link, a peer's error frame. Each item's progress is written back into it.
 */
#ifndef FIREFLYER_HFREDUCE_EXCHANGE_H
#define FIREFLYER_HFREDUCE_EXCHANGE_H

#include <stdint.h>

enum { HFX_RING_OUT = 1, HFX_RING_IN = 2, HFX_TCP_OUT = 3, HFX_TCP_IN = 4 };
enum { HFX_HEAD = 0, HFX_BODY = 1, HFX_ACK = 2, HFX_DONE = 3 }; /* channels.py: Transfer.stage */

/* One transfer (int64 fields, in this order; transport/progress.py packs them). */
typedef struct {
    int64_t kind;      /* HFX_RING_OUT .. HFX_TCP_IN */
    int64_t stage;     /* in and out */
    int64_t pos;       /* in and out: bytes moved (a TCP send counts its frame header too) */
    int64_t data;      /* address of the flat bytes sent or received into */
    int64_t nbytes;
    int64_t space;     /* the frame's key */
    int64_t key;
    int64_t digest[2]; /* the 16 bytes every frame carries */
    int64_t head_addr; /* rings: the int32 counters and the ack word in the node's mailboxes */
    int64_t tail_addr;
    int64_t ack_addr;
    int64_t ring;      /* rings: address of the ring's bytes, and their count */
    int64_t ring_bytes;
    int64_t count;     /* in and out: this side's own counter, unbounded (head: sender, tail: receiver) */
    int64_t acks;      /* in and out: direct reads asked for (sender) or answered (receiver) */
    int64_t direct;    /* ring out: bytes from which a payload goes as its address (0: never; out: may drop to 0);
                          ring in: the sender's pid */
    int64_t fd;        /* TCP: the link's socket, non-blocking */
    int64_t got_kind;  /* out: the frame that stopped the run (HFX_FOREIGN, HFX_MISMATCH, HFX_ERROR_FRAME) */
    int64_t got_space;
    int64_t got_key;
    int64_t got_nbytes;
    int64_t got_digest[2];
    int64_t err; /* out: errno of a failed system call */
} hfx_item;

/* hfx_drive's return codes (the item it stopped at goes to *index). */
enum {
    HFX_ALL_DONE = 0,
    HFX_AGAIN = 1,       /* the slice passed: check the group and the deadline, then drive again */
    HFX_FOREIGN = 2,     /* another call's frame is ahead of this item's (untouched) */
    HFX_MISMATCH = 3,    /* the frame's digest or size is not the item's (untouched) */
    HFX_LOST = 4,        /* the link broke or the peer closed it (err) */
    HFX_ERROR_FRAME = 5, /* a TCP frame of another kind than data: the peer's failure (not consumed) */
    HFX_GARBLED = 6,     /* a ring frame of no known kind */
    HFX_REMOTE = 7,      /* a direct read from the sender's memory failed (err) */
};

/* Drive the items until all are done or slice_ns has passed (CLOCK_MONOTONIC), spinning spin_ns
 * after a pass that moved nothing before each sleep. */
int hfx_drive(hfx_item *items, int64_t n, int64_t slice_ns, int64_t spin_ns, int64_t *index);

#endif
