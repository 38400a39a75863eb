/* hfreduce's tree stage in C: one rail's reduce-up or broadcast-down of a whole collective over one
 * of the two binary trees of nodes (see trees.py, whose protocol this is, frame for frame).
 *
 * The Python side authenticates the TCP links (transport.py) and hands their file descriptors
 * over; a run then goes through every chunk of the collective with the GIL released:
 *
 * - up: wait until the node's partial of the chunk's half is reduced ("red" of its owners),
 *   receive each child's partial (accumulation dtype) and combine it in, then send the sum to
 *   the parent, or, at the root, finish it (AVG's divide, rounding into the dtype) into the
 *   node's out buffer once the out buffer is free ("done" of every local rank);
 * - down: at the root, wait for this rank's own reduce-up of the chunk; elsewhere receive the
 *   result from the parent into the out buffer once it is free; send it on to the children;
 *   then, once both trees' halves of the chunk are in, raise this rank's "out" flag.
 *
 * A frame is transport.FRAME: kind, collective number (mod 2**32), chunk index, payload bytes and
 * the 16-byte descriptor, then the payload. Every socket wait polls in slices of at most 50 ms and
 * checks the arena's abort word, the deadline and the local peers' liveness between slices.
 */
#ifndef FIREFLYER_HFREDUCE_TREE_H
#define FIREFLYER_HFREDUCE_TREE_H

#include <stdint.h>

#include "node.h"

enum { HFR_TREE_UP = 1, HFR_TREE_DOWN = 2 };

/* One tree's part of one collective (int64 fields, in this order). */
typedef struct {
    int64_t role;             /* HFR_TREE_UP or HFR_TREE_DOWN */
    int64_t tree;             /* 0 or 1: which half of the rail's slice of every chunk */
    int64_t first_chunk;      /* the group's chunk counter at the collective's first chunk */
    int64_t nchunks;
    int64_t elems;            /* elements per chunk */
    int64_t numel;
    int64_t dtype;            /* kernels.h codes */
    int64_t acc_dtype;
    int64_t op;               /* not HFR_COPY */
    int64_t world_size;       /* AVG's divisor at the root */
    int64_t seq;              /* the collective's number */
    int64_t deadline_ns;      /* CLOCK_MONOTONIC: every wait on a link or on the node's flags */
    int64_t self_deadline_ns; /* the down root's wait on its own reduce-up */
    int64_t parent_fd;        /* -1 at the root */
    int64_t nchildren;        /* 0, 1 or 2 */
    int64_t child_fd[2];
    int64_t scratch[2];       /* up: where child i's partial is received (room for the largest half) */
    int64_t scratch_bytes;
    int64_t state;            /* address of this rank's int32[4]: root_ready[2], done[2] (its threads share it) */
    int64_t digest[2];        /* the descriptor every frame carries (16 bytes) */
} hfr_tree_job;

/* Return codes besides node.h's HFR_DONE, HFR_TIMEOUT, HFR_ABORTED, HFR_PEER_DEAD and the kernels'. */
enum {
    HFR_LOST = 8,           /* the link broke or the peer closed it */
    HFR_FRAME_MISMATCH = 9, /* a frame for another collective, chunk or size than this one */
    HFR_ERROR_FRAME = 10,   /* the peer sent its failure: `nbytes` bytes of text follow on the link */
    HFR_GARBLED = 11,       /* a frame of no known kind */
};

/* Where a run stopped that did not finish. */
typedef struct {
    int64_t link;       /* -1: the parent; i >= 0: child i; -2: a flag of the node (stage, local_rank) */
    int64_t sending;    /* 1: it was sending on the link */
    int64_t chunk;      /* index within the collective */
    int64_t stage;      /* flag waits: as hfr_where */
    int64_t local_rank;
    int64_t kind;       /* the frame header received (HFR_FRAME_MISMATCH, HFR_ERROR_FRAME, HFR_GARBLED) */
    int64_t seq;
    int64_t frame_chunk;
    int64_t nbytes;
    int64_t digest[2];
} hfr_tree_where;

int hfr_tree_run(const hfr_comm *comm, const hfr_tree_job *job, hfr_tree_where *where);

#endif
