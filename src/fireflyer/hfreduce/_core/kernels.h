/* hfreduce's compiled reduce kernels: the C interface other files of the extension call.
 *
 * out[i] = finish(((ins[0][i] op ins[1][i]) op ins[2][i]) op ...) for i in [0, n): the
 * inputs are combined in list order, each read once, in one pass over memory. Codes are
 * the Python side's (fireflyer.hfreduce.plans.plan.DTYPES and Op), so descriptors pass through.
 *
 * Accumulation: fp32 for fp16/bf16/fp8 inputs, the dtype itself otherwise. out_dtype is the
 * input dtype (rounded once at the end, to nearest even, as torch's .to() does) or the
 * accumulation dtype (a partial sum, not rounded). COPY and the bitwise ops keep the input
 * dtype. divisor > 0 (AVG only) divides the complete accumulation before rounding.
 *
 * Integers wrap on overflow. bool is a flag: SUM/MAX are "or", PRODUCT/MIN are "and".
 * MIN/MAX: a NaN in any input gives a NaN (all bits set); min(-0, +0) = -0, max = +0.
 *
 * Pointers must be aligned to their element size; out may be one of the inputs (the same
 * pointer and dtype) but must not overlap them otherwise. Thread-safe; no allocation.
 */
#ifndef FIREFLYER_HFREDUCE_KERNELS_H
#define FIREFLYER_HFREDUCE_KERNELS_H

#include <stdint.h>

/* dtype codes (reduce.DTYPES) */
enum {
    HFR_F32 = 1,
    HFR_F64 = 2,
    HFR_F16 = 3,
    HFR_BF16 = 4,
    HFR_F8E4M3FN = 5,
    HFR_F8E5M2 = 6,
    HFR_I32 = 7,
    HFR_I64 = 8,
    HFR_U8 = 9,
    HFR_I8 = 10,
    HFR_I16 = 11,
    HFR_BOOL = 12,
};

/* op codes (reduce.Op) */
enum {
    HFR_SUM = 0,
    HFR_AVG = 1,
    HFR_MIN = 2,
    HFR_MAX = 3,
    HFR_COPY = 4, /* one contributor per element: the inputs' bytes are OR-ed */
    HFR_PRODUCT = 5,
    HFR_BAND = 6,
    HFR_BOR = 7,
    HFR_BXOR = 8,
};

/* instruction sets, lowest first */
enum {
    HFR_ISA_PORTABLE = 0,
    HFR_ISA_AVX2 = 1,   /* AVX2 + F16C */
    HFR_ISA_AVX512 = 2, /* AVX-512 F, BW, VL */
};

/* return codes */
enum {
    HFR_OK = 0,
    HFR_EDTYPE = -1,  /* unknown dtype code */
    HFR_EOP = -2,     /* unknown op, or one the dtype cannot take (AVG of integers, bitwise of floats) */
    HFR_EOUT = -3,    /* out_dtype is neither the input dtype nor its accumulation dtype */
    HFR_EARG = -4,    /* nin < 1, n < 0, a NULL pointer, divisor < 0, or divisor > 0 with an op other than AVG */
    HFR_EALIGN = -5,  /* a pointer not aligned to its element size */
    HFR_EISA = -6,    /* hfr_set_isa: this CPU lacks that instruction set */
    HFR_ENOMEM = -7,  /* hfr_reduce_tree: no memory for its partials */
};

int hfr_reduce(void *out, int out_dtype, const void *const *ins, int nin, int in_dtype, int64_t n, int op,
               int64_t divisor);

/* As hfr_reduce, but a float SUM, AVG or PRODUCT combines the inputs in the left-balanced pairwise
 * tree over their indices (fireflyer.hfreduce.plans.canonical): the first p inputs, p the largest power of
 * two below nin, then the rest, each side built the same way, added left + right; accumulation,
 * AVG's divide and the one rounding as hfr_reduce. Up to three inputs, and for MIN, MAX and the
 * integers, that is hfr_reduce's list order. Thread-safe; it allocates its partials (a few KiB); out may be one of
 * the inputs, as with hfr_reduce. */
int hfr_reduce_tree(void *out, int out_dtype, const void *const *ins, int nin, int in_dtype, int64_t n, int op,
                    int64_t divisor);

/* out[i] = round(acc[i] / divisor) (divisor 0: no divide) into fp16, bf16 or fp8, to nearest even as
 * torch's .to() does: the finish of a partial kept in fp32 (the tree root's, for a low precision). */
int hfr_round(void *out, int out_dtype, const float *acc, int64_t n, int64_t divisor);

int hfr_isa(void);             /* the instruction set hfr_reduce uses now */
int hfr_isa_best(void);        /* the best one this CPU supports */
int hfr_set_isa(int isa);      /* use a lower one (tests); HFR_OK or HFR_EISA */
const char *hfr_isa_name(int isa);
const char *hfr_strerror(int rc);

#endif
