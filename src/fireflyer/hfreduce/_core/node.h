/* hfreduce's node stage in C: one collective's chunks through the node's shared-memory arena.
 *
 * The same protocol as the Python engine (engine.py, arena.py), so the two interoperate
 * flag for flag: per local rank and stage ("in", "red", "out", "done") one monotonically
 * increasing int32 chunk counter on its own cache line, written only by its owner after
 * the data it announces (x86-64 keeps stores in order; a release store elsewhere), and
 * compared modulo 2**32.
 *
 * Every wait spins briefly, then yields a few times, then sleeps on the flag's futex in short slices;
 * between slices it checks the arena's abort word, its deadline, the caller's interrupt hook
 * (a pending Ctrl-C) and (every 50 ms) that its local peers' processes are alive, so no
 * failure can leave it waiting forever.
 */
#ifndef FIREFLYER_HFREDUCE_NODE_H
#define FIREFLYER_HFREDUCE_NODE_H

#include <stdint.h>

/* What a communicator's arena looks like (packed by the Python side, int64 fields, in this order). */
typedef struct {
    int64_t base;          /* address of the arena's mapping */
    int64_t local_size;    /* L */
    int64_t local_rank;
    int64_t depth;
    int64_t chunk_bytes;
    int64_t control_bytes; /* where in[0][0] starts */
    int64_t red_bytes;
    int64_t flags_offset;
    int64_t pid_offset;
    int64_t desc_offset;
    int64_t abort_offset;
    int64_t rails;         /* local ranks that carry a tree rail (several nodes) */
    int64_t spin;          /* busy polls before yielding */
    int64_t yields;        /* sched_yield calls before sleeping on the futex */
} hfr_comm;

enum { HFR_MODE_PIPELINE = 1, HFR_MODE_NODE_STAGE = 2, HFR_MODE_ONESHOT = 3, HFR_MODE_ALL_TO_ALL = 4 };

/* HFR_MODE_ALL_TO_ALL (one node, one shot): every rank copies its split table and its whole input
 * into its slot of the collective's buffer and raises "in"; then each copies the piece every peer
 * holds for it straight into its output, and raises "red" and "done". job.peer_in is the address of
 * 4L int64 byte counts: send offsets, send lengths, receive offsets, receive lengths (per local
 * rank); src and dst are the input and output; numel is the input's bytes. The slot holds
 * HFR_A2A_HEADER(L) bytes (a word that says whether the input fits, then the send offsets and
 * lengths), then the input. A rank whose input does not fit says so and writes none; then every
 * rank returns HFR_TOO_BIG after the one handoff, so all of them take another path together. */
#define HFR_A2A_HEADER(L) ((((int64_t)(L) * 16 + 8) + 63) / 64 * 64)

/* One collective (int64 fields, in this order). */
typedef struct {
    int64_t mode;
    int64_t first_chunk;   /* the group's chunk counter at this collective's first chunk */
    int64_t nchunks;
    int64_t elems;         /* elements per chunk */
    int64_t numel;
    int64_t dtype;         /* kernels.h codes */
    int64_t op;
    int64_t acc_dtype;
    int64_t divisor;       /* > 0: AVG's finish (one node) */
    int64_t src;           /* this rank's input, contiguous */
    int64_t dst;           /* where the result goes, contiguous (may equal src); 0 in NODE_STAGE */
    int64_t deadline_ns;   /* CLOCK_MONOTONIC */
    int64_t late_deadline_ns; /* waits on what other nodes produce ("out" of the rails) */
    int64_t seq;
    int64_t desc_bytes;    /* how many descriptor bytes every rank must agree on (after the seq) */
    int64_t ext_bytes;     /* then the registered-buffer words, which must be zero for the C path */
    int64_t resume;        /* 1: chunk 0 is staged in and every descriptor checked (the Python side did it) */
    int64_t self_registered; /* 1: this rank's input is a registered buffer its peers read: no stage-in */
    int64_t peer_in;       /* 0, or the address of L int64 addresses: local rank k's registered input (0: its slot) */
    int64_t peer_out;      /* 0, or L addresses: local rank k's registered in-place buffer, written directly (one node) */
    int64_t tree;          /* 1: the reduce combines the L slots in the pairwise tree (hfr_reduce_tree) */
} hfr_job;

/* Return codes of hfr_node_run (besides the kernels' negative ones). */
enum {
    HFR_DONE = 0,
    HFR_NEED_PYTHON = 1, /* chunk 0 staged in and every local rank's descriptor seen: a mismatch or a
                            registered buffer, which the Python side handles from there */
    HFR_TIMEOUT = 2,
    HFR_ABORTED = 3,     /* the arena's abort word is set: another rank failed */
    HFR_PEER_DEAD = 4,
    HFR_INTERRUPTED = 5, /* the interrupt hook said stop (a signal handler raised, e.g. Ctrl-C) */
    HFR_SPLIT_MISMATCH = 6, /* all-to-all: local rank where->local_rank sends this rank where->chunk
                               bytes, not the receive length this rank expects from it */
    HFR_TOO_BIG = 7,        /* all-to-all: some local rank's input does not fit its slot (see above) */
};

enum { HFR_STAGE_IN = 0, HFR_STAGE_RED = 1, HFR_STAGE_OUT = 2, HFR_STAGE_DONE = 3 };

/* Where a run stopped that did not finish: what it was waiting for. */
typedef struct {
    int64_t stage;
    int64_t local_rank;  /* whose flag, or the dead peer */
    int64_t chunk;       /* index within the collective */
    int64_t late;        /* the wait used the late deadline */
} hfr_where;

/* Called between futex slices (at most every 50 ms while a wait sleeps): nonzero stops the run
 * with HFR_INTERRUPTED. NULL: never interrupted. */
typedef int (*hfr_interrupt_hook)(void *arg);

/* The name of the capsule that _core.node_run_capsule holds: this function's address. */
#define NODE_RUN_CAPSULE "fireflyer.hfreduce._core.hfr_node_run"

int hfr_node_run(const hfr_comm *comm, const hfr_job *job, hfr_where *where, hfr_interrupt_hook interrupted,
                 void *arg);

#endif
