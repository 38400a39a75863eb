/* Inside the reduce kernels: the per-ISA kernel tables and the scalar rules every ISA shares.
 *
 * hfr_reduce (kernels.c) turns a (dtype, op) pair into a kind and a kernel op below and
 * asks the chosen ISA for a kernel; an ISA that has no special kernel for the pair returns
 * NULL and the portable one runs. Every ISA gives the same bits: the SIMD kernels follow
 * the scalar rules here (rounding, NaN results, signed zeros) and hand their ragged tails
 * to the portable kernels.
 */
#ifndef FIREFLYER_HFREDUCE_KERNELS_IMPL_H
#define FIREFLYER_HFREDUCE_KERNELS_IMPL_H

#include <stdint.h>
#include <string.h>

#include "kernels.h"

/* Reduces elements [lo, hi); divisor > 0 divides the accumulation (float kinds only). */
typedef void (*hfr_kernel)(void *out, const void *const *ins, int nin, int64_t lo, int64_t hi, int64_t divisor);

/* What a kernel reads. The float kinds accumulate in fp32 (fp64 for K_F64). The unsigned
 * kinds serve wrapping sums and products, the bitwise ops, bool and COPY; the signed ones
 * serve MIN and MAX. */
enum {
    K_F32, K_F16, K_BF16, K_E4M3, K_E5M2, K_F64,
    K_U8, K_U16, K_U32, K_U64, K_I8, K_I16, K_I32, K_I64,
    K_COUNT
};
enum { O_SUM, O_PROD, O_MIN, O_MAX, O_AND, O_OR, O_XOR, O_COUNT };

/* narrow: 1 = round into the input dtype at the end, 0 = write the accumulation dtype. */
hfr_kernel hfr_portable_kernel(int kind, int op, int narrow);
hfr_kernel hfr_avx2_kernel(int kind, int op, int narrow);
hfr_kernel hfr_avx512_kernel(int kind, int op, int narrow);

/* The pairwise tree's last step into a narrow dtype: out = round((a + b) / divisor), a and b fp32
 * partials (divisor 0: no division); NULL where the ISA has none for out_dtype. */
typedef void (*hfr_finish)(void *out, const float *a, const float *b, int64_t n, int64_t divisor);
hfr_finish hfr_portable_finish(int out_dtype);
hfr_finish hfr_avx2_finish(int out_dtype);

/* The whole pairwise tree of a float SUM (or AVG) in registers, 8 lanes at a time: the elements
 * done (a multiple of the vector), the rest left to the caller; NULL where the ISA has none for
 * (in_dtype, out_dtype, nin): 4 and 8 inputs of fp32, fp16 and bf16. */
typedef int64_t (*hfr_tree_kernel)(void *out, const void *const *ins, int nin, int64_t n, int64_t divisor);
hfr_tree_kernel hfr_avx2_tree(int in_dtype, int out_dtype, int nin);

/* Table rows of a float kind's four kernels, named PREFIX_KIND_OP_N (N: narrow). */
#define HFR_FLOAT_ENTRIES(PREFIX, K, KIND, N)                                                          \
    [K][O_SUM][N] = PREFIX##_##KIND##_sum_##N, [K][O_PROD][N] = PREFIX##_##KIND##_prod_##N,             \
    [K][O_MIN][N] = PREFIX##_##KIND##_min_##N, [K][O_MAX][N] = PREFIX##_##KIND##_max_##N

/* Every float kind, in both widths where it has two. */
#define HFR_FLOAT_TABLE(PREFIX)                                                                        \
    HFR_FLOAT_ENTRIES(PREFIX, K_F32, f32, 0),                                                           \
    HFR_FLOAT_ENTRIES(PREFIX, K_F16, f16, 0), HFR_FLOAT_ENTRIES(PREFIX, K_F16, f16, 1),                 \
    HFR_FLOAT_ENTRIES(PREFIX, K_BF16, bf16, 0), HFR_FLOAT_ENTRIES(PREFIX, K_BF16, bf16, 1),             \
    HFR_FLOAT_ENTRIES(PREFIX, K_E4M3, e4m3, 0), HFR_FLOAT_ENTRIES(PREFIX, K_E4M3, e4m3, 1),             \
    HFR_FLOAT_ENTRIES(PREFIX, K_E5M2, e5m2, 0), HFR_FLOAT_ENTRIES(PREFIX, K_E5M2, e5m2, 1),             \
    HFR_FLOAT_ENTRIES(PREFIX, K_F64, f64, 0)

/* An ISA's lookup: its table's entry, or NULL (the portable kernel runs) out of range or absent. */
#define HFR_LOOKUP(FN, TABLE)                                                                          \
    hfr_kernel FN(int kind, int op, int narrow) {                                                      \
        if (kind < 0 || kind >= K_COUNT || op < 0 || op >= O_COUNT || narrow < 0 || narrow > 1)        \
            return NULL;                                                                               \
        return TABLE[kind][op][narrow];                                                                \
    }

/* The SIMD ISAs' table: every float kind, and wrapping sums and MIN/MAX of the 32- and 64-bit
 * integers (the rest falls to the portable kernels). */
#define HFR_SIMD_TABLE(FN)                                                                             \
    static const hfr_kernel simd_table[K_COUNT][O_COUNT][2] = {                                        \
        HFR_FLOAT_TABLE(k),                                                                            \
        [K_U32][O_SUM][0] = k_u32_sum_0, [K_I32][O_MIN][0] = k_i32_min_0, [K_I32][O_MAX][0] = k_i32_max_0, \
        [K_U64][O_SUM][0] = k_u64_sum_0, [K_I64][O_MIN][0] = k_i64_min_0, [K_I64][O_MAX][0] = k_i64_max_0, \
    };                                                                                                 \
    HFR_LOOKUP(FN, simd_table)

/* fp8 -> fp32, exact; filled once by hfr_tables_init() before any kernel runs. */
extern float hfr_e4m3_to_f32_table[256];
extern float hfr_e5m2_to_f32_table[256];
void hfr_tables_init(void);

static inline uint32_t hfr_bits32(float f) { uint32_t u; memcpy(&u, &f, 4); return u; }
static inline float hfr_from_bits32(uint32_t u) { float f; memcpy(&f, &u, 4); return f; }
static inline uint64_t hfr_bits64(double f) { uint64_t u; memcpy(&u, &f, 8); return u; }
static inline double hfr_from_bits64(uint64_t u) { double f; memcpy(&f, &u, 8); return f; }

/* MIN/MAX: NaN if either side is NaN (all bits set, what torch's vectorized minimum gives);
 * equal values merge their bits, so min(-0, +0) = -0 and max(-0, +0) = +0 in either order. */
static inline float hfr_min_f32(float a, float b) {
    if (a != a || b != b) return hfr_from_bits32(0xFFFFFFFFu);
    if (a == b) return hfr_from_bits32(hfr_bits32(a) | hfr_bits32(b));
    return b < a ? b : a;
}
static inline float hfr_max_f32(float a, float b) {
    if (a != a || b != b) return hfr_from_bits32(0xFFFFFFFFu);
    if (a == b) return hfr_from_bits32(hfr_bits32(a) & hfr_bits32(b));
    return a < b ? b : a;
}
static inline double hfr_min_f64(double a, double b) {
    if (a != a || b != b) return hfr_from_bits64(~(uint64_t)0);
    if (a == b) return hfr_from_bits64(hfr_bits64(a) | hfr_bits64(b));
    return b < a ? b : a;
}
static inline double hfr_max_f64(double a, double b) {
    if (a != a || b != b) return hfr_from_bits64(~(uint64_t)0);
    if (a == b) return hfr_from_bits64(hfr_bits64(a) & hfr_bits64(b));
    return a < b ? b : a;
}

/* ---- widening: exact; a signalling NaN comes out quiet (as vcvtph2ps does) ---- */

static inline float hfr_bf16_to_f32(uint16_t h) { return hfr_from_bits32((uint32_t)h << 16); }

static inline float hfr_f16_to_f32(uint16_t h) {
    uint32_t sign = (uint32_t)(h & 0x8000u) << 16, e = (h >> 10) & 0x1Fu, m = h & 0x3FFu;
    if (e == 0x1F) return hfr_from_bits32(sign | 0x7F800000u | (m << 13) | (m ? 0x400000u : 0));
    if (e == 0) {  /* zero or subnormal: m * 2^-24, exact in fp32 */
        float v = (float)m * 0x1p-24f;
        return hfr_from_bits32(hfr_bits32(v) | sign);
    }
    return hfr_from_bits32(sign | ((e + 112) << 23) | (m << 13));
}

/* ---- narrowing: round to nearest, ties to even ---- */

/* NaN keeps its sign and top payload bits and comes out quiet (as vcvtneps2bf16 does). */
static inline uint16_t hfr_f32_to_bf16(float f) {
    uint32_t x = hfr_bits32(f);
    if ((x & 0x7FFFFFFFu) > 0x7F800000u) return (uint16_t)((x >> 16) | 0x40u);
    return (uint16_t)((x + 0x7FFFu + ((x >> 16) & 1u)) >> 16);
}

/* What vcvtps2ph with round-to-nearest-even gives, subnormals and NaN included. */
static inline uint16_t hfr_f32_to_f16(float f) {
    uint32_t x = hfr_bits32(f);
    uint16_t sign = (uint16_t)((x >> 16) & 0x8000u);
    uint32_t ax = x & 0x7FFFFFFFu;
    if (ax > 0x7F800000u) return sign | 0x7E00u | (uint16_t)((ax >> 13) & 0x3FFu);
    if (ax >= 0x477FF000u) return sign | 0x7C00u; /* 65520 and up round to inf */
    if (ax >= 0x38800000u) {                     /* normal: 2^-14 and up */
        uint32_t r = ax - ((uint32_t)(127 - 15) << 23);
        r += 0xFFFu + ((r >> 13) & 1u);
        return sign | (uint16_t)(r >> 13);
    }
    uint32_t e = ax >> 23;
    if (e < 102) return sign; /* below 2^-25: rounds to zero */
    uint32_t m = (ax & 0x7FFFFFu) | 0x800000u, s = 126 - e; /* value = m >> s units of 2^-24 */
    uint32_t q = m >> s, rem = m & ((1u << s) - 1u), half = 1u << (s - 1);
    if (rem > half || (rem == half && (q & 1u))) q++;
    return sign | (uint16_t)q;
}

/* torch's c10::detail::fp8e4m3fn_from_fp32_value: e4m3fn has no inf, so overflow and inf
 * saturate to +-448; NaN gives 0x7F with the sign. */
static inline uint8_t hfr_f32_to_e4m3(float f) {
    uint32_t fb = hfr_bits32(f), sign = fb & 0x80000000u;
    uint8_t r;
    fb ^= sign;
    if (fb >= (1087u << 20)) {
        r = fb > 0x7F800000u ? 0x7F : 0x7E;
    } else if (fb < (121u << 23)) {
        const uint32_t denorm = 141u << 23;
        fb = hfr_bits32(hfr_from_bits32(fb) + hfr_from_bits32(denorm));
        r = (uint8_t)(fb - denorm);
    } else {
        uint32_t odd = (fb >> 20) & 1u;
        fb += ((uint32_t)(7 - 127) << 23) + 0x7FFFFu;
        fb += odd;
        r = (uint8_t)(fb >> 20);
        if (r == 0x7F) r = 0x7E;
    }
    return r | (uint8_t)(sign >> 24);
}

/* torch's c10::detail::fp8e5m2_from_fp32_value: overflow goes to inf, NaN to 0x7F. */
static inline uint8_t hfr_f32_to_e5m2(float f) {
    uint32_t fb = hfr_bits32(f), sign = fb & 0x80000000u;
    uint8_t r;
    fb ^= sign;
    if (fb >= (143u << 23)) {
        r = fb > 0x7F800000u ? 0x7F : 0x7C;
    } else if (fb < (113u << 23)) {
        const uint32_t denorm = 134u << 23;
        fb = hfr_bits32(hfr_from_bits32(fb) + hfr_from_bits32(denorm));
        r = (uint8_t)(fb - denorm);
    } else {
        uint32_t odd = (fb >> 21) & 1u;
        fb += ((uint32_t)(15 - 127) << 23) + 0xFFFFFu;
        fb += odd;
        r = (uint8_t)(fb >> 21);
    }
    return r | (uint8_t)(sign >> 24);
}

#endif
