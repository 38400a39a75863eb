/* AVX2 + F16C reduce kernels, 8 fp32 lanes.
 *
 * The same shape as the AVX-512 kernels (two vectors of accumulation in registers, every
 * input folded in list order, one store), without lane masks: the last elements short of
 * a vector go to the portable kernel, which follows the same rules bit for bit.
 */
#include "kernels_impl.h"

#if defined(__x86_64__) || defined(__i386__)
#include <immintrin.h>

#define T2 __attribute__((target("avx2,f16c")))
#define I2 static inline __attribute__((always_inline, target("avx2,f16c")))

/* ---- fp32 lanes ---- */

I2 __m256 w_f32(const void *p, int64_t i) { return _mm256_loadu_ps((const float *)p + i); }
I2 __m256 w_bf16(const void *p, int64_t i) {
    __m128i h = _mm_loadu_si128((const __m128i *)((const uint16_t *)p + i));
    return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16));
}
I2 __m256 w_f16(const void *p, int64_t i) {
    return _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)((const uint16_t *)p + i)));
}
I2 __m256 w_e4m3(const void *p, int64_t i) {
    __m256i idx = _mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i *)((const uint8_t *)p + i)));
    return _mm256_i32gather_ps(hfr_e4m3_to_f32_table, idx, 4);
}
I2 __m256 w_e5m2(const void *p, int64_t i) {
    __m128i b = _mm_loadl_epi64((const __m128i *)((const uint8_t *)p + i));
    return _mm256_cvtph_ps(_mm_slli_epi16(_mm_cvtepu8_epi16(b), 8));
}

I2 __m256 c_sum(__m256 a, __m256 b) { return _mm256_add_ps(a, b); }
I2 __m256 c_prod(__m256 a, __m256 b) { return _mm256_mul_ps(a, b); }
/* the rules of hfr_min_f32/hfr_max_f32: NaN -> all ones, equal values merge their bits */
I2 __m256 c_min(__m256 a, __m256 b) {
    __m256 r = _mm256_blendv_ps(_mm256_min_ps(a, b), _mm256_or_ps(a, b), _mm256_cmp_ps(a, b, _CMP_EQ_OQ));
    return _mm256_or_ps(r, _mm256_cmp_ps(a, b, _CMP_UNORD_Q));
}
I2 __m256 c_max(__m256 a, __m256 b) {
    __m256 r = _mm256_blendv_ps(_mm256_max_ps(a, b), _mm256_and_ps(a, b), _mm256_cmp_ps(a, b, _CMP_EQ_OQ));
    return _mm256_or_ps(r, _mm256_cmp_ps(a, b, _CMP_UNORD_Q));
}

I2 void s_f32(void *o, int64_t i, __m256 v) { _mm256_storeu_ps((float *)o + i, v); }
I2 void s_f16(void *o, int64_t i, __m256 v) {
    _mm_storeu_si128((__m128i *)((uint16_t *)o + i), _mm256_cvtps_ph(v, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC));
}
I2 void s_e4m3(void *o, int64_t i, __m256 v) {
    float f[8];
    _mm256_storeu_ps(f, v);
    for (int l = 0; l < 8; l++) ((uint8_t *)o)[i + l] = hfr_f32_to_e4m3(f[l]);
}
I2 void s_e5m2(void *o, int64_t i, __m256 v) {
    float f[8];
    _mm256_storeu_ps(f, v);
    for (int l = 0; l < 8; l++) ((uint8_t *)o)[i + l] = hfr_f32_to_e5m2(f[l]);
}

/* One kernel; the elements after the last whole vector go to the portable kernel (K, O, N). */
#define DEF_KERNEL(NAME, K, O, N, VEC, LANES, W, C, S, DIV, SET1, TACC)                                   \
    static T2 void NAME(void *out, const void *const *ins, int nin, int64_t lo, int64_t hi, int64_t divisor) { \
        const VEC d = SET1((TACC)(divisor > 0 ? divisor : 1));                                            \
        int64_t i = lo;                                                                                   \
        for (; i + 2 * LANES <= hi; i += 2 * LANES) {                                                     \
            VEC a0 = W(ins[0], i), a1 = W(ins[0], i + LANES);                                             \
            for (int k = 1; k < nin; k++) {                                                               \
                a0 = C(a0, W(ins[k], i));                                                                 \
                a1 = C(a1, W(ins[k], i + LANES));                                                         \
            }                                                                                             \
            if (divisor > 0) {                                                                            \
                a0 = DIV(a0, d);                                                                          \
                a1 = DIV(a1, d);                                                                          \
            }                                                                                             \
            S(out, i, a0);                                                                                \
            S(out, i + LANES, a1);                                                                        \
        }                                                                                                 \
        for (; i + LANES <= hi; i += LANES) {                                                             \
            VEC a = W(ins[0], i);                                                                         \
            for (int k = 1; k < nin; k++) a = C(a, W(ins[k], i));                                         \
            if (divisor > 0) a = DIV(a, d);                                                               \
            S(out, i, a);                                                                                 \
        }                                                                                                 \
        if (i < hi) hfr_portable_kernel(K, O, N)(out, ins, nin, i, hi, divisor);                          \
    }

#define DEF_F32(NAME, K, O, N, W, C, S) \
    DEF_KERNEL(NAME, K, O, N, __m256, 8, W, C, S, _mm256_div_ps, _mm256_set1_ps, float)

/* a narrow kind into fp32 (the _0 kernels), then into its own kind (_1) */
#define DEF_WIDEN(K, KIND)                                          \
    DEF_F32(k_##KIND##_sum_0, K, O_SUM, 0, w_##KIND, c_sum, s_f32)   \
    DEF_F32(k_##KIND##_prod_0, K, O_PROD, 0, w_##KIND, c_prod, s_f32) \
    DEF_F32(k_##KIND##_min_0, K, O_MIN, 0, w_##KIND, c_min, s_f32)   \
    DEF_F32(k_##KIND##_max_0, K, O_MAX, 0, w_##KIND, c_max, s_f32)

#define DEF_LOWP(K, KIND)                                          \
    DEF_WIDEN(K, KIND)                                               \
    DEF_F32(k_##KIND##_sum_1, K, O_SUM, 1, w_##KIND, c_sum, s_##KIND)   \
    DEF_F32(k_##KIND##_prod_1, K, O_PROD, 1, w_##KIND, c_prod, s_##KIND) \
    DEF_F32(k_##KIND##_min_1, K, O_MIN, 1, w_##KIND, c_min, s_##KIND)   \
    DEF_F32(k_##KIND##_max_1, K, O_MAX, 1, w_##KIND, c_max, s_##KIND)

DEF_F32(k_f32_sum_0, K_F32, O_SUM, 0, w_f32, c_sum, s_f32)
DEF_F32(k_f32_prod_0, K_F32, O_PROD, 0, w_f32, c_prod, s_f32)
DEF_F32(k_f32_min_0, K_F32, O_MIN, 0, w_f32, c_min, s_f32)
DEF_F32(k_f32_max_0, K_F32, O_MAX, 0, w_f32, c_max, s_f32)
/* ---- bf16 in and bf16 out, 16 elements a vector ----
 * As in the AVX-512 kernels: a 32-bit lane holds an even element in its low half and an odd
 * one in its high half, so a shift and a mask widen one load into two fp32 vectors, and the two
 * rounded vectors go back into one with no packing. Same order, same rounding, same bits. */
I2 __m256i r_bf16_high(__m256 v) { /* rounded into each lane's high half; the low half is debris */
    __m256i x = _mm256_castps_si256(v);
    __m256i lsb = _mm256_and_si256(_mm256_srli_epi32(x, 16), _mm256_set1_epi32(1));
    __m256i r = _mm256_add_epi32(_mm256_add_epi32(x, _mm256_set1_epi32(0x7FFF)), lsb);
    return _mm256_blendv_epi8(r, _mm256_or_si256(x, _mm256_set1_epi32(0x400000)),
                              _mm256_castps_si256(_mm256_cmp_ps(v, v, _CMP_UNORD_Q)));
}

#define DEF_BF16_PAIRS(NAME, O, C)                                                                        \
    static T2 void NAME(void *out, const void *const *ins, int nin, int64_t lo, int64_t hi, int64_t divisor) { \
        const __m256 d = _mm256_set1_ps((float)(divisor > 0 ? divisor : 1));                             \
        const __m256i high = _mm256_set1_epi32((int)0xFFFF0000u);                                         \
        int64_t i = lo;                                                                                   \
        for (; i + 16 <= hi; i += 16) {                                                                   \
            __m256i x = _mm256_loadu_si256((const __m256i *)((const uint16_t *)ins[0] + i));              \
            __m256 ev = _mm256_castsi256_ps(_mm256_slli_epi32(x, 16));                                    \
            __m256 od = _mm256_castsi256_ps(_mm256_and_si256(x, high));                                   \
            for (int k = 1; k < nin; k++) {                                                               \
                x = _mm256_loadu_si256((const __m256i *)((const uint16_t *)ins[k] + i));                  \
                ev = C(ev, _mm256_castsi256_ps(_mm256_slli_epi32(x, 16)));                                \
                od = C(od, _mm256_castsi256_ps(_mm256_and_si256(x, high)));                               \
            }                                                                                             \
            if (divisor > 0) {                                                                            \
                ev = _mm256_div_ps(ev, d);                                                                \
                od = _mm256_div_ps(od, d);                                                                \
            }                                                                                             \
            _mm256_storeu_si256((__m256i *)((uint16_t *)out + i),                                         \
                                _mm256_or_si256(_mm256_and_si256(r_bf16_high(od), high),                  \
                                                _mm256_srli_epi32(r_bf16_high(ev), 16)));                 \
        }                                                                                                 \
        if (i < hi) hfr_portable_kernel(K_BF16, O, 1)(out, ins, nin, i, hi, divisor);                     \
    }

DEF_LOWP(K_F16, f16)
DEF_WIDEN(K_BF16, bf16)
DEF_BF16_PAIRS(k_bf16_sum_1, O_SUM, c_sum)
DEF_BF16_PAIRS(k_bf16_prod_1, O_PROD, c_prod)
DEF_BF16_PAIRS(k_bf16_min_1, O_MIN, c_min)
DEF_BF16_PAIRS(k_bf16_max_1, O_MAX, c_max)
DEF_LOWP(K_E4M3, e4m3)
DEF_LOWP(K_E5M2, e5m2)

/* ---- the pairwise tree's last step: two fp32 partials added, divided, rounded once ---- */

I2 void s_bf16_8(void *o, int64_t i, __m256 v) {
    __m256i r = _mm256_srli_epi32(r_bf16_high(v), 16);
    _mm_storeu_si128((__m128i *)((uint16_t *)o + i),
                     _mm_packus_epi32(_mm256_castsi256_si128(r), _mm256_extracti128_si256(r, 1)));
}

#define DEF_FINISH(NAME, DTYPE, STORE, SIZE)                                                              \
    static T2 void NAME(void *out, const float *a, const float *b, int64_t n, int64_t divisor) {          \
        const __m256 d = _mm256_set1_ps((float)(divisor > 0 ? divisor : 1));                             \
        int64_t i = 0;                                                                                    \
        for (; i + 8 <= n; i += 8) {                                                                      \
            __m256 v = _mm256_add_ps(_mm256_loadu_ps(a + i), _mm256_loadu_ps(b + i));                     \
            if (divisor > 0) v = _mm256_div_ps(v, d);                                                     \
            STORE(out, i, v);                                                                             \
        }                                                                                                 \
        if (i < n) hfr_portable_finish(DTYPE)((char *)out + i * SIZE, a + i, b + i, n - i, divisor);      \
    }
DEF_FINISH(f_f16, HFR_F16, s_f16, 2)
DEF_FINISH(f_bf16, HFR_BF16, s_bf16_8, 2)
DEF_FINISH(f_e4m3, HFR_F8E4M3FN, s_e4m3, 1)
DEF_FINISH(f_e5m2, HFR_F8E5M2, s_e5m2, 1)

/* The pairwise tree over 4 or 8 inputs (a node's ranks, as usual) written out, so it stays in registers:
 * ((x0 + x1) + (x2 + x3)) and the two of those added, lane by lane, as hfreduce.plans.canonical adds them. */
#define ADD _mm256_add_ps
#define DEF_TREE(NAME, W, S)                                                                              \
    static T2 int64_t NAME(void *out, const void *const *ins, int nin, int64_t n, int64_t divisor) {      \
        const __m256 d = _mm256_set1_ps((float)(divisor > 0 ? divisor : 1));                             \
        int64_t i = 0;                                                                                    \
        for (; i + 8 <= n; i += 8) {                                                                      \
            __m256 t = ADD(ADD(W(ins[0], i), W(ins[1], i)), ADD(W(ins[2], i), W(ins[3], i)));             \
            if (nin == 8)                                                                                 \
                t = ADD(t, ADD(ADD(W(ins[4], i), W(ins[5], i)), ADD(W(ins[6], i), W(ins[7], i))));        \
            if (divisor > 0) t = _mm256_div_ps(t, d);                                                     \
            S(out, i, t);                                                                                 \
        }                                                                                                 \
        return i;                                                                                         \
    }
DEF_TREE(t_f32_f32, w_f32, s_f32)
DEF_TREE(t_f16_f32, w_f16, s_f32)
DEF_TREE(t_f16_f16, w_f16, s_f16)
DEF_TREE(t_bf16_f32, w_bf16, s_f32)
DEF_TREE(t_bf16_bf16, w_bf16, s_bf16_8)

hfr_tree_kernel hfr_avx2_tree(int in_dtype, int out_dtype, int nin) {
    if (hfr_isa_best() < HFR_ISA_AVX2 || (nin != 4 && nin != 8)) return NULL;
    const int wide = out_dtype == HFR_F32;
    switch (in_dtype) {
    case HFR_F32: return t_f32_f32;
    case HFR_F16: return wide ? t_f16_f32 : t_f16_f16;
    case HFR_BF16: return wide ? t_bf16_f32 : t_bf16_bf16;
    default: return NULL;
    }
}

hfr_finish hfr_avx2_finish(int out_dtype) {
    if (hfr_isa_best() < HFR_ISA_AVX2) return NULL;
    switch (out_dtype) {
    case HFR_F16: return f_f16;
    case HFR_BF16: return f_bf16;
    case HFR_F8E4M3FN: return f_e4m3;
    case HFR_F8E5M2: return f_e5m2;
    default: return NULL;
    }
}

/* ---- fp64 lanes ---- */

I2 __m256d w_f64(const void *p, int64_t i) { return _mm256_loadu_pd((const double *)p + i); }
I2 __m256d cd_sum(__m256d a, __m256d b) { return _mm256_add_pd(a, b); }
I2 __m256d cd_prod(__m256d a, __m256d b) { return _mm256_mul_pd(a, b); }
I2 __m256d cd_min(__m256d a, __m256d b) {
    __m256d r = _mm256_blendv_pd(_mm256_min_pd(a, b), _mm256_or_pd(a, b), _mm256_cmp_pd(a, b, _CMP_EQ_OQ));
    return _mm256_or_pd(r, _mm256_cmp_pd(a, b, _CMP_UNORD_Q));
}
I2 __m256d cd_max(__m256d a, __m256d b) {
    __m256d r = _mm256_blendv_pd(_mm256_max_pd(a, b), _mm256_and_pd(a, b), _mm256_cmp_pd(a, b, _CMP_EQ_OQ));
    return _mm256_or_pd(r, _mm256_cmp_pd(a, b, _CMP_UNORD_Q));
}
I2 void s_f64(void *o, int64_t i, __m256d v) { _mm256_storeu_pd((double *)o + i, v); }

#define DEF_F64(NAME, O, C) \
    DEF_KERNEL(NAME, K_F64, O, 0, __m256d, 4, w_f64, C, s_f64, _mm256_div_pd, _mm256_set1_pd, double)
DEF_F64(k_f64_sum_0, O_SUM, cd_sum)
DEF_F64(k_f64_prod_0, O_PROD, cd_prod)
DEF_F64(k_f64_min_0, O_MIN, cd_min)
DEF_F64(k_f64_max_0, O_MAX, cd_max)

/* ---- int32 and int64 lanes ---- */

I2 __m256i no_div(__m256i a, __m256i d) { (void)d; return a; }
I2 __m256i min_epi64(__m256i a, __m256i b) { return _mm256_blendv_epi8(a, b, _mm256_cmpgt_epi64(a, b)); }
I2 __m256i max_epi64(__m256i a, __m256i b) { return _mm256_blendv_epi8(b, a, _mm256_cmpgt_epi64(a, b)); }

I2 __m256i w_i32(const void *p, int64_t i) { return _mm256_loadu_si256((const __m256i *)((const int32_t *)p + i)); }
I2 __m256i w_i64(const void *p, int64_t i) { return _mm256_loadu_si256((const __m256i *)((const int64_t *)p + i)); }
I2 void s_i32(void *o, int64_t i, __m256i v) { _mm256_storeu_si256((__m256i *)((int32_t *)o + i), v); }
I2 void s_i64(void *o, int64_t i, __m256i v) { _mm256_storeu_si256((__m256i *)((int64_t *)o + i), v); }

#define DEF_I32(NAME, K, O, C) \
    DEF_KERNEL(NAME, K, O, 0, __m256i, 8, w_i32, C, s_i32, no_div, _mm256_set1_epi32, int32_t)
#define DEF_I64(NAME, K, O, C) \
    DEF_KERNEL(NAME, K, O, 0, __m256i, 4, w_i64, C, s_i64, no_div, _mm256_set1_epi64x, int64_t)
DEF_I32(k_u32_sum_0, K_U32, O_SUM, _mm256_add_epi32)
DEF_I32(k_i32_min_0, K_I32, O_MIN, _mm256_min_epi32)
DEF_I32(k_i32_max_0, K_I32, O_MAX, _mm256_max_epi32)
DEF_I64(k_u64_sum_0, K_U64, O_SUM, _mm256_add_epi64)
DEF_I64(k_i64_min_0, K_I64, O_MIN, min_epi64)
DEF_I64(k_i64_max_0, K_I64, O_MAX, max_epi64)

HFR_SIMD_TABLE(hfr_avx2_kernel)

#else /* not x86: no AVX2 kernels */

hfr_kernel hfr_avx2_kernel(int kind, int op, int narrow) {
    (void)kind, (void)op, (void)narrow;
    return NULL;
}

hfr_finish hfr_avx2_finish(int out_dtype) {
    (void)out_dtype;
    return NULL;
}

hfr_tree_kernel hfr_avx2_tree(int in_dtype, int out_dtype, int nin) {
    (void)in_dtype, (void)out_dtype, (void)nin;
    return NULL;
}

#endif
