/* hfr_reduce: argument checks, the choice of kernel, and the portable kernels.
 *
 * The portable kernels work a block at a time: the block's accumulation sits in a small
 * stack buffer (in L1), each input's block is folded into it in list order, and the
 * result is rounded into out. Each input is still read once and out written once, and
 * the plain loops let the compiler vectorize them for the baseline ISA. They are the
 * kernels of every (dtype, op) the SIMD files leave out, and the SIMD kernels' tails.
 */
#include <pthread.h>
#include <string.h>

#include <stdlib.h>

#include "kernels_impl.h"

#define HFR_BLOCK 1024

float hfr_e4m3_to_f32_table[256];
float hfr_e5m2_to_f32_table[256];

static void tables_fill(void) {
    for (int x = 0; x < 256; x++) {
        int e = (x >> 3) & 15, m = x & 7;
        float v;
        if (e == 15 && m == 7)
            v = hfr_from_bits32(0x7FC00000u);
        else if (e == 0)
            v = (float)m * 0x1p-9f;
        else
            v = (float)(8 + m) * hfr_from_bits32((uint32_t)(e - 10 + 127) << 23);
        hfr_e4m3_to_f32_table[x] = hfr_from_bits32(hfr_bits32(v) | ((x & 0x80) ? 0x80000000u : 0));
        hfr_e5m2_to_f32_table[x] = hfr_f16_to_f32((uint16_t)(x << 8)); /* e5m2 is fp16's top byte */
    }
}

static pthread_once_t tables_once = PTHREAD_ONCE_INIT;
void hfr_tables_init(void) { pthread_once(&tables_once, tables_fill); }

/* ---- the portable kernels ---- */

#define W_ID(x) (x)
#define W_F16(x) hfr_f16_to_f32(x)
#define W_BF16(x) hfr_bf16_to_f32(x)
#define W_E4M3(x) hfr_e4m3_to_f32_table[x]
#define W_E5M2(x) hfr_e5m2_to_f32_table[x]

#define N_ID(x) (x)
#define N_F16(x) hfr_f32_to_f16(x)
#define N_BF16(x) hfr_f32_to_bf16(x)
#define N_E4M3(x) hfr_f32_to_e4m3(x)
#define N_E5M2(x) hfr_f32_to_e5m2(x)

#define C_SUM(a, b) ((a) + (b))
#define C_MUL(a, b) ((a) * (b))
#define C_MUL_NARROW(a, b) ((uint32_t)(a) * (uint32_t)(b)) /* u8/u16 would promote to a signed int */
#define C_MIN(a, b) ((b) < (a) ? (b) : (a))
#define C_MAX(a, b) ((a) < (b) ? (b) : (a))
#define C_AND(a, b) ((a) & (b))
#define C_OR(a, b) ((a) | (b))
#define C_XOR(a, b) ((a) ^ (b))
#define C_MINF(a, b) hfr_min_f32(a, b)
#define C_MAXF(a, b) hfr_max_f32(a, b)
#define C_MIND(a, b) hfr_min_f64(a, b)
#define C_MAXD(a, b) hfr_max_f64(a, b)

#define DEF_PORT(NAME, TIN, TACC, TOUT, WIDEN, COMBINE, NARROW)                                        \
    static void NAME(void *out, const void *const *ins, int nin, int64_t lo, int64_t hi, int64_t divisor) { \
        TACC acc[HFR_BLOCK];                                                                           \
        for (int64_t b = lo; b < hi; b += HFR_BLOCK) {                                                 \
            const int64_t m = hi - b < HFR_BLOCK ? hi - b : HFR_BLOCK;                                 \
            const TIN *restrict p = (const TIN *)ins[0] + b;                                           \
            for (int64_t j = 0; j < m; j++) acc[j] = (TACC)WIDEN(p[j]);                                \
            for (int k = 1; k < nin; k++) {                                                            \
                p = (const TIN *)ins[k] + b;                                                           \
                for (int64_t j = 0; j < m; j++) acc[j] = (TACC)COMBINE(acc[j], (TACC)WIDEN(p[j]));     \
            }                                                                                          \
            if (divisor > 0) {                                                                         \
                const TACC d = (TACC)divisor;                                                          \
                for (int64_t j = 0; j < m; j++) acc[j] = acc[j] / d;                                   \
            }                                                                                          \
            TOUT *restrict o = (TOUT *)out + b;                                                        \
            for (int64_t j = 0; j < m; j++) o[j] = NARROW(acc[j]);                                     \
        }                                                                                              \
    }

/* Floats accumulated in fp32: each input kind, each op, into fp32 (0) or rounded (1). */
#define DEF_PORT_LOWP(KIND, TIN, WIDEN, NARROW)                                          \
    DEF_PORT(port_##KIND##_sum_0, TIN, float, float, WIDEN, C_SUM, N_ID)                 \
    DEF_PORT(port_##KIND##_prod_0, TIN, float, float, WIDEN, C_MUL, N_ID)                \
    DEF_PORT(port_##KIND##_min_0, TIN, float, float, WIDEN, C_MINF, N_ID)                \
    DEF_PORT(port_##KIND##_max_0, TIN, float, float, WIDEN, C_MAXF, N_ID)                \
    DEF_PORT(port_##KIND##_sum_1, TIN, float, TIN, WIDEN, C_SUM, NARROW)                 \
    DEF_PORT(port_##KIND##_prod_1, TIN, float, TIN, WIDEN, C_MUL, NARROW)                \
    DEF_PORT(port_##KIND##_min_1, TIN, float, TIN, WIDEN, C_MINF, NARROW)                \
    DEF_PORT(port_##KIND##_max_1, TIN, float, TIN, WIDEN, C_MAXF, NARROW)

DEF_PORT(port_f32_sum_0, float, float, float, W_ID, C_SUM, N_ID)
DEF_PORT(port_f32_prod_0, float, float, float, W_ID, C_MUL, N_ID)
DEF_PORT(port_f32_min_0, float, float, float, W_ID, C_MINF, N_ID)
DEF_PORT(port_f32_max_0, float, float, float, W_ID, C_MAXF, N_ID)
DEF_PORT_LOWP(f16, uint16_t, W_F16, N_F16)
DEF_PORT_LOWP(bf16, uint16_t, W_BF16, N_BF16)
DEF_PORT_LOWP(e4m3, uint8_t, W_E4M3, N_E4M3)
DEF_PORT_LOWP(e5m2, uint8_t, W_E5M2, N_E5M2)
DEF_PORT(port_f64_sum_0, double, double, double, W_ID, C_SUM, N_ID)
DEF_PORT(port_f64_prod_0, double, double, double, W_ID, C_MUL, N_ID)
DEF_PORT(port_f64_min_0, double, double, double, W_ID, C_MIND, N_ID)
DEF_PORT(port_f64_max_0, double, double, double, W_ID, C_MAXD, N_ID)

#define DEF_PORT_UNSIGNED(KIND, T, MUL)                              \
    DEF_PORT(port_##KIND##_sum_0, T, T, T, W_ID, C_SUM, N_ID)        \
    DEF_PORT(port_##KIND##_prod_0, T, T, T, W_ID, MUL, N_ID)         \
    DEF_PORT(port_##KIND##_and_0, T, T, T, W_ID, C_AND, N_ID)        \
    DEF_PORT(port_##KIND##_or_0, T, T, T, W_ID, C_OR, N_ID)          \
    DEF_PORT(port_##KIND##_xor_0, T, T, T, W_ID, C_XOR, N_ID)
#define DEF_PORT_ORDERED(KIND, T)                                    \
    DEF_PORT(port_##KIND##_min_0, T, T, T, W_ID, C_MIN, N_ID)        \
    DEF_PORT(port_##KIND##_max_0, T, T, T, W_ID, C_MAX, N_ID)

DEF_PORT_UNSIGNED(u8, uint8_t, C_MUL_NARROW)
DEF_PORT_UNSIGNED(u16, uint16_t, C_MUL_NARROW)
DEF_PORT_UNSIGNED(u32, uint32_t, C_MUL)
DEF_PORT_UNSIGNED(u64, uint64_t, C_MUL)
DEF_PORT_ORDERED(u8, uint8_t)
DEF_PORT_ORDERED(i8, int8_t)
DEF_PORT_ORDERED(i16, int16_t)
DEF_PORT_ORDERED(i32, int32_t)
DEF_PORT_ORDERED(i64, int64_t)

#define UNSIGNED_ENTRIES(K, KIND)                                                                      \
    [K][O_SUM][0] = port_##KIND##_sum_0, [K][O_PROD][0] = port_##KIND##_prod_0,                         \
    [K][O_AND][0] = port_##KIND##_and_0, [K][O_OR][0] = port_##KIND##_or_0,                             \
    [K][O_XOR][0] = port_##KIND##_xor_0
#define ORDERED_ENTRIES(K, KIND) [K][O_MIN][0] = port_##KIND##_min_0, [K][O_MAX][0] = port_##KIND##_max_0

static const hfr_kernel portable_table[K_COUNT][O_COUNT][2] = {
    HFR_FLOAT_TABLE(port),
    UNSIGNED_ENTRIES(K_U8, u8), UNSIGNED_ENTRIES(K_U16, u16),
    UNSIGNED_ENTRIES(K_U32, u32), UNSIGNED_ENTRIES(K_U64, u64),
    ORDERED_ENTRIES(K_U8, u8), ORDERED_ENTRIES(K_I8, i8), ORDERED_ENTRIES(K_I16, i16),
    ORDERED_ENTRIES(K_I32, i32), ORDERED_ENTRIES(K_I64, i64),
};

HFR_LOOKUP(hfr_portable_kernel, portable_table)

/* ---- the choice of instruction set ---- */

static int best_isa(void) {
#if defined(__x86_64__) || defined(__i386__)
    __builtin_cpu_init();
    if (__builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") && __builtin_cpu_supports("avx512vl"))
        return HFR_ISA_AVX512;
    if (__builtin_cpu_supports("avx2") && __builtin_cpu_supports("f16c")) return HFR_ISA_AVX2;
#endif
    return HFR_ISA_PORTABLE;
}

static int isa_best = -1;
static int isa_now = HFR_ISA_PORTABLE;
static pthread_once_t isa_once = PTHREAD_ONCE_INIT;

static void isa_init(void) {
    isa_best = best_isa();
    __atomic_store_n(&isa_now, isa_best, __ATOMIC_RELAXED);
}

int hfr_isa_best(void) {
    pthread_once(&isa_once, isa_init);
    return isa_best;
}

int hfr_isa(void) {
    pthread_once(&isa_once, isa_init);
    return __atomic_load_n(&isa_now, __ATOMIC_RELAXED);
}

int hfr_set_isa(int isa) {
    if (isa < HFR_ISA_PORTABLE || isa > hfr_isa_best()) return HFR_EISA;
    __atomic_store_n(&isa_now, isa, __ATOMIC_RELAXED);
    return HFR_OK;
}

const char *hfr_isa_name(int isa) {
    switch (isa) {
    case HFR_ISA_AVX512: return "avx512";
    case HFR_ISA_AVX2: return "avx2";
    case HFR_ISA_PORTABLE: return "portable";
    default: return "unknown";
    }
}

const char *hfr_strerror(int rc) {
    switch (rc) {
    case HFR_OK: return "ok";
    case HFR_EDTYPE: return "unknown dtype code";
    case HFR_EOP: return "the op is unknown or the dtype cannot take it";
    case HFR_EOUT: return "out_dtype must be the input dtype or its accumulation dtype";
    case HFR_ENOMEM: return "out of memory for the pairwise tree's partials";
    case HFR_EARG: return "bad argument (nin < 1, n < 0, a NULL pointer, or a divisor without AVG)";
    case HFR_EALIGN: return "a pointer is not aligned to its element size";
    case HFR_EISA: return "this CPU lacks that instruction set";
    default: return "unknown error";
    }
}

/* ---- hfr_reduce ---- */

static int itemsize(int dtype) {
    switch (dtype) {
    case HFR_F64: case HFR_I64: return 8;
    case HFR_F32: case HFR_I32: return 4;
    case HFR_F16: case HFR_BF16: case HFR_I16: return 2;
    case HFR_F8E4M3FN: case HFR_F8E5M2: case HFR_U8: case HFR_I8: case HFR_BOOL: return 1;
    default: return 0;
    }
}

static int is_float(int dtype) { return dtype >= HFR_F32 && dtype <= HFR_F8E5M2; }

static const int UNSIGNED_KIND[9] = {[1] = K_U8, [2] = K_U16, [4] = K_U32, [8] = K_U64};

/* (dtype, op) -> (kind, kernel op, accumulation dtype), or an error code. */
static int plan(int dtype, int op, int *kind, int *kop, int *acc) {
    const int size = itemsize(dtype);
    *acc = dtype;
    if (op == HFR_COPY) {
        *kind = UNSIGNED_KIND[size];
        *kop = O_OR;
        return HFR_OK;
    }
    if (is_float(dtype)) {
        static const int FLOAT_KIND[] = {[HFR_F32] = K_F32, [HFR_F64] = K_F64, [HFR_F16] = K_F16,
                                         [HFR_BF16] = K_BF16, [HFR_F8E4M3FN] = K_E4M3, [HFR_F8E5M2] = K_E5M2};
        *kind = FLOAT_KIND[dtype];
        *acc = dtype == HFR_F64 ? HFR_F64 : HFR_F32;
        switch (op) {
        case HFR_SUM: case HFR_AVG: *kop = O_SUM; return HFR_OK;
        case HFR_PRODUCT: *kop = O_PROD; return HFR_OK;
        case HFR_MIN: *kop = O_MIN; return HFR_OK;
        case HFR_MAX: *kop = O_MAX; return HFR_OK;
        default: return HFR_EOP;
        }
    }
    if (dtype == HFR_BOOL) { /* a flag: any / all */
        *kind = K_U8;
        switch (op) {
        case HFR_SUM: case HFR_MAX: case HFR_BOR: *kop = O_OR; return HFR_OK;
        case HFR_PRODUCT: case HFR_MIN: case HFR_BAND: *kop = O_AND; return HFR_OK;
        case HFR_BXOR: *kop = O_XOR; return HFR_OK;
        default: return HFR_EOP;
        }
    }
    *kind = UNSIGNED_KIND[size];
    switch (op) {
    case HFR_SUM: *kop = O_SUM; return HFR_OK;
    case HFR_PRODUCT: *kop = O_PROD; return HFR_OK;
    case HFR_BAND: *kop = O_AND; return HFR_OK;
    case HFR_BOR: *kop = O_OR; return HFR_OK;
    case HFR_BXOR: *kop = O_XOR; return HFR_OK;
    case HFR_MIN: case HFR_MAX: {
        static const int SIGNED_KIND[9] = {[1] = K_I8, [2] = K_I16, [4] = K_I32, [8] = K_I64};
        *kind = dtype == HFR_U8 ? K_U8 : SIGNED_KIND[size];
        *kop = op == HFR_MIN ? O_MIN : O_MAX;
        return HFR_OK;
    }
    default: return HFR_EOP;
    }
}

/* The kernel the chosen ISA has for (kind, op, narrow), else the portable one. */
static hfr_kernel pick(int kind, int kop, int narrow) {
    hfr_kernel fn = NULL;
    switch (hfr_isa()) {
    case HFR_ISA_AVX512: fn = hfr_avx512_kernel(kind, kop, narrow); break;
    case HFR_ISA_AVX2: fn = hfr_avx2_kernel(kind, kop, narrow); break;
    default: break;
    }
    return fn != NULL ? fn : hfr_portable_kernel(kind, kop, narrow);
}

/* Checks every argument; HFR_OK with the plan, or an error code. n == 0 is HFR_OK too. */
static int check(void *out, int out_dtype, const void *const *ins, int nin, int in_dtype, int64_t n, int op,
                 int64_t divisor, int *kind, int *kop, int *acc) {
    const int size = itemsize(in_dtype);
    if (size == 0 || itemsize(out_dtype) == 0) return HFR_EDTYPE;
    int rc = plan(in_dtype, op, kind, kop, acc);
    if (rc != HFR_OK) return rc;
    if (out_dtype != in_dtype && out_dtype != *acc) return HFR_EOUT;
    if (nin < 1 || n < 0 || ins == NULL || divisor < 0 || (divisor > 0 && op != HFR_AVG)) return HFR_EARG;
    if (n == 0) return HFR_OK;
    if (out == NULL) return HFR_EARG;
    if ((uintptr_t)out % (uintptr_t)itemsize(out_dtype)) return HFR_EALIGN;
    for (int k = 0; k < nin; k++) {
        if (ins[k] == NULL) return HFR_EARG;
        if ((uintptr_t)ins[k] % (uintptr_t)size) return HFR_EALIGN;
    }
    return HFR_OK;
}

int hfr_reduce(void *out, int out_dtype, const void *const *ins, int nin, int in_dtype, int64_t n, int op,
               int64_t divisor) {
    int kind, kop, acc;
    int rc = check(out, out_dtype, ins, nin, in_dtype, n, op, divisor, &kind, &kop, &acc);
    if (rc != HFR_OK || n == 0) return rc;
    hfr_tables_init();
    hfr_kernel fn = pick(kind, kop, out_dtype != acc);
    if (fn == NULL) return HFR_EOP; /* not reached: plan() only makes pairs the table has */
    fn(out, ins, nin, 0, n, divisor);
    return HFR_OK;
}

/* ---- hfr_reduce_tree: the left-balanced pairwise tree over the inputs' indices ---- */

enum { TREE_BLOCK = 512 }; /* elements per block: every partial of a block stays in L1 */

typedef struct {
    const void *const *ins; /* the inputs, already offset to the block */
    int kind, kop, acc_kind;
    int64_t m;              /* elements in this block */
    char *scratch;          /* one partial of TREE_BLOCK accumulation elements per level */
    int64_t acc_size;
} tree_block;

static int64_t split_point(int64_t n) { /* the largest power of two below n >= 2 */
    int64_t p = 1;
    while (p * 2 < n) p *= 2;
    return p;
}

/* dst (accumulation dtype) = the tree over inputs [lo, hi); level: the first scratch partial free below. */
static void tree_into(const tree_block *t, int lo, int hi, char *dst, int level) {
    if (hi - lo <= 2) { /* a leaf, or a pair: one pass of the plain kernel, widening */
        pick(t->kind, t->kop, 0)(dst, t->ins + lo, hi - lo, 0, t->m, 0);
        return;
    }
    const int mid = lo + (int)split_point(hi - lo);
    char *right = t->scratch + (int64_t)level * TREE_BLOCK * t->acc_size;
    tree_into(t, lo, mid, dst, level + 1);
    tree_into(t, mid, hi, right, level + 1);
    const void *pair[2] = {dst, right};
    pick(t->acc_kind, t->kop, 0)(dst, pair, 2, 0, t->m, 0);
}

#define DEF_FINISH(NAME, T, NARROW)                                                                     \
    static void NAME(void *out, const float *a, const float *b, int64_t n, int64_t divisor) {         \
        T *restrict o = (T *)out;                                                                      \
        const float d = (float)divisor;                                                                \
        if (divisor > 0)                                                                               \
            for (int64_t i = 0; i < n; i++) o[i] = NARROW((a[i] + b[i]) / d);                          \
        else                                                                                           \
            for (int64_t i = 0; i < n; i++) o[i] = NARROW(a[i] + b[i]);                                \
    }
DEF_FINISH(finish_f16, uint16_t, N_F16)
DEF_FINISH(finish_bf16, uint16_t, N_BF16)
DEF_FINISH(finish_e4m3, uint8_t, N_E4M3)
DEF_FINISH(finish_e5m2, uint8_t, N_E5M2)

hfr_finish hfr_portable_finish(int out_dtype) {
    switch (out_dtype) {
    case HFR_F16: return finish_f16;
    case HFR_BF16: return finish_bf16;
    case HFR_F8E4M3FN: return finish_e4m3;
    case HFR_F8E5M2: return finish_e5m2;
    default: return NULL;
    }
}

/* The chosen ISA's finish for out_dtype (AVX-512 uses AVX2's), else the portable one. */
static hfr_finish pick_finish(int out_dtype) {
    hfr_finish fn = NULL;
    if (hfr_isa() == HFR_ISA_AVX512 || hfr_isa() == HFR_ISA_AVX2) fn = hfr_avx2_finish(out_dtype);
    return fn != NULL ? fn : hfr_portable_finish(out_dtype);
}

int hfr_reduce_tree(void *out, int out_dtype, const void *const *ins, int nin, int in_dtype, int64_t n, int op,
                    int64_t divisor) {
    int kind, kop, acc;
    int rc = check(out, out_dtype, ins, nin, in_dtype, n, op, divisor, &kind, &kop, &acc);
    if (rc != HFR_OK || n == 0) return rc;
    /* Up to three inputs the list order is the tree; MIN, MAX and the integers are associative. */
    if (nin <= 3 || !is_float(in_dtype) || (kop != O_SUM && kop != O_PROD))
        return hfr_reduce(out, out_dtype, ins, nin, in_dtype, n, op, divisor);
    hfr_tables_init();
    int64_t done = 0; /* elements the registers' tree did */
    const int simd = hfr_isa() == HFR_ISA_AVX512 || hfr_isa() == HFR_ISA_AVX2;
    const hfr_tree_kernel regs = simd && kop == O_SUM ? hfr_avx2_tree(in_dtype, out_dtype, nin) : NULL;
    if (regs != NULL && (done = regs(out, ins, nin, n, divisor)) == n) return HFR_OK;
    tree_block t;
    t.kind = kind;
    t.kop = kop;
    t.acc_kind = acc == HFR_F64 ? K_F64 : K_F32;
    t.acc_size = itemsize(acc);
    int levels = 1;
    while ((1 << levels) < nin) levels++;
    /* a partial per level of the tree's recursion, then the two halves' sums at the top */
    const size_t part = (size_t)TREE_BLOCK * (size_t)t.acc_size;
    char *scratch = aligned_alloc(64, part * (size_t)(levels + 2));
    const void **shifted = malloc(sizeof(void *) * (size_t)nin);
    if (scratch == NULL || shifted == NULL) {
        free(scratch);
        free(shifted);
        return HFR_ENOMEM;
    }
    t.scratch = scratch;
    char *left = scratch + part * (size_t)levels, *right = left + part;
    const int size = itemsize(in_dtype), osize = itemsize(out_dtype);
    const int mid = (int)split_point(nin);
    const hfr_finish finish = out_dtype == acc ? NULL : pick_finish(out_dtype);
    if (out_dtype != acc && finish == NULL) rc = HFR_EDTYPE;
    for (int64_t i0 = done; i0 < n && rc == HFR_OK; i0 += TREE_BLOCK) {
        t.m = n - i0 < TREE_BLOCK ? n - i0 : TREE_BLOCK;
        for (int k = 0; k < nin; k++) shifted[k] = (const char *)ins[k] + i0 * size;
        t.ins = shifted;
        tree_into(&t, 0, mid, left, 0);
        tree_into(&t, mid, nin, right, 0);
        /* the last addition, then AVG's divide and the one rounding, in one pass */
        char *o = (char *)out + i0 * osize;
        const void *pair[2] = {left, right};
        if (finish == NULL)
            pick(t.acc_kind, kop, 0)(o, pair, 2, 0, t.m, divisor);
        else if (kop == O_SUM)
            finish(o, (const float *)left, (const float *)right, t.m, divisor);
        else { /* PROD: the product, then the portable rounding */
            pick(t.acc_kind, kop, 0)(left, pair, 2, 0, t.m, 0);
            if ((rc = hfr_round(o, out_dtype, (const float *)left, t.m, divisor)) != HFR_OK) break;
        }
    }
    free(shifted);
    free(scratch);
    return rc;
}

#define ROUND_INTO(T, NARROW)                                                                          \
    do {                                                                                               \
        T *restrict o = (T *)out;                                                                      \
        if (divisor > 0)                                                                               \
            for (int64_t i = 0; i < n; i++) o[i] = NARROW(acc[i] / d);                                 \
        else                                                                                           \
            for (int64_t i = 0; i < n; i++) o[i] = NARROW(acc[i]);                                     \
    } while (0)

int hfr_round(void *out, int out_dtype, const float *acc, int64_t n, int64_t divisor) {
    if (n < 0 || divisor < 0) return HFR_EARG;
    if (n == 0) return HFR_OK;
    if (out == NULL || acc == NULL) return HFR_EARG;
    if ((uintptr_t)acc % 4 || (uintptr_t)out % (uintptr_t)itemsize(out_dtype)) return HFR_EALIGN;
    const float d = (float)divisor;
    switch (out_dtype) {
    case HFR_F16: ROUND_INTO(uint16_t, N_F16); break;
    case HFR_BF16: ROUND_INTO(uint16_t, N_BF16); break;
    case HFR_F8E4M3FN: ROUND_INTO(uint8_t, N_E4M3); break;
    case HFR_F8E5M2: ROUND_INTO(uint8_t, N_E5M2); break;
    default: return HFR_EDTYPE;
    }
    return HFR_OK;
}
