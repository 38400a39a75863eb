/* AVX-512 (F, BW, VL) reduce kernels, 16 fp32 lanes.
 *
 * A kernel holds two vectors of the accumulation in registers, folds every input into them
 * in list order and stores once, so each input is read once and out written once. fp16 and
 * bf16 widen in registers; fp8 widens through a gather from a 256-entry table. The last
 * partial vectors are masked, so no tail is left for the portable kernels.
 */
#include "kernels_impl.h"

#if defined(__x86_64__) || defined(__i386__)
#include <immintrin.h>

#define T512 __attribute__((target("avx512f,avx512bw,avx512vl")))
#define I512 static inline __attribute__((always_inline, target("avx512f,avx512bw,avx512vl")))

/* ---- fp32 lanes: widen (W), combine (C), round and store (S), under a lane mask ---- */

I512 __m512 w_f32(const void *p, int64_t i, __mmask16 m) { return _mm512_maskz_loadu_ps(m, (const float *)p + i); }
I512 __m512 w_bf16(const void *p, int64_t i, __mmask16 m) {
    __m256i h = _mm256_maskz_loadu_epi16(m, (const uint16_t *)p + i);
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
}
I512 __m512 w_f16(const void *p, int64_t i, __mmask16 m) {
    return _mm512_cvtph_ps(_mm256_maskz_loadu_epi16(m, (const uint16_t *)p + i));
}
I512 __m512 w_e4m3(const void *p, int64_t i, __mmask16 m) {
    __m512i idx = _mm512_cvtepu8_epi32(_mm_maskz_loadu_epi8(m, (const uint8_t *)p + i));
    return _mm512_mask_i32gather_ps(_mm512_setzero_ps(), m, idx, hfr_e4m3_to_f32_table, 4);
}
I512 __m512 w_e5m2(const void *p, int64_t i, __mmask16 m) {
    __m256i h = _mm256_slli_epi16(_mm256_cvtepu8_epi16(_mm_maskz_loadu_epi8(m, (const uint8_t *)p + i)), 8);
    return _mm512_cvtph_ps(h);
}

I512 __m512 c_sum(__m512 a, __m512 b) { return _mm512_add_ps(a, b); }
I512 __m512 c_prod(__m512 a, __m512 b) { return _mm512_mul_ps(a, b); }
/* the rules of hfr_min_f32/hfr_max_f32: NaN -> all ones, equal values merge their bits */
I512 __m512 c_min(__m512 a, __m512 b) {
    __m512i r = _mm512_castps_si512(_mm512_min_ps(a, b));
    r = _mm512_mask_or_epi32(r, _mm512_cmp_ps_mask(a, b, _CMP_EQ_OQ), _mm512_castps_si512(a), _mm512_castps_si512(b));
    r = _mm512_mask_mov_epi32(r, _mm512_cmp_ps_mask(a, b, _CMP_UNORD_Q), _mm512_set1_epi32(-1));
    return _mm512_castsi512_ps(r);
}
I512 __m512 c_max(__m512 a, __m512 b) {
    __m512i r = _mm512_castps_si512(_mm512_max_ps(a, b));
    r = _mm512_mask_and_epi32(r, _mm512_cmp_ps_mask(a, b, _CMP_EQ_OQ), _mm512_castps_si512(a), _mm512_castps_si512(b));
    r = _mm512_mask_mov_epi32(r, _mm512_cmp_ps_mask(a, b, _CMP_UNORD_Q), _mm512_set1_epi32(-1));
    return _mm512_castsi512_ps(r);
}

I512 void s_f32(void *o, int64_t i, __m512 v, __mmask16 m) { _mm512_mask_storeu_ps((float *)o + i, m, v); }
I512 void s_f16(void *o, int64_t i, __m512 v, __mmask16 m) {
    _mm256_mask_storeu_epi16((uint16_t *)o + i, m, _mm512_cvtps_ph(v, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC));
}
I512 void s_e4m3(void *o, int64_t i, __m512 v, __mmask16 m) {
    float f[16];
    uint8_t b[16];
    _mm512_storeu_ps(f, v);
    for (int l = 0; l < 16; l++) b[l] = hfr_f32_to_e4m3(f[l]);
    _mm_mask_storeu_epi8((uint8_t *)o + i, m, _mm_loadu_si128((const __m128i *)b));
}
I512 void s_e5m2(void *o, int64_t i, __m512 v, __mmask16 m) {
    float f[16];
    uint8_t b[16];
    _mm512_storeu_ps(f, v);
    for (int l = 0; l < 16; l++) b[l] = hfr_f32_to_e5m2(f[l]);
    _mm_mask_storeu_epi8((uint8_t *)o + i, m, _mm_loadu_si128((const __m128i *)b));
}

/* One kernel: VEC/MASK/LANES name the register type, W/C/S the steps, DIV the division. */
#define DEF_KERNEL(NAME, VEC, MASK, LANES, W, C, S, DIV, SET1, TACC)                                    \
    static T512 void NAME(void *out, const void *const *ins, int nin, int64_t lo, int64_t hi, int64_t divisor) { \
        const VEC d = SET1((TACC)(divisor > 0 ? divisor : 1));                                          \
        const MASK full = (MASK)~(MASK)0;                                                               \
        int64_t i = lo;                                                                                 \
        for (; i + 2 * LANES <= hi; i += 2 * LANES) {                                                   \
            VEC a0 = W(ins[0], i, full), a1 = W(ins[0], i + LANES, full);                               \
            for (int k = 1; k < nin; k++) {                                                             \
                a0 = C(a0, W(ins[k], i, full));                                                         \
                a1 = C(a1, W(ins[k], i + LANES, full));                                                 \
            }                                                                                           \
            if (divisor > 0) {                                                                          \
                a0 = DIV(a0, d);                                                                        \
                a1 = DIV(a1, d);                                                                        \
            }                                                                                           \
            S(out, i, a0, full);                                                                        \
            S(out, i + LANES, a1, full);                                                                \
        }                                                                                               \
        for (; i < hi; i += LANES) {                                                                    \
            const MASK m = hi - i >= LANES ? full : (MASK)(((uint64_t)1 << (hi - i)) - 1);              \
            VEC a = W(ins[0], i, m);                                                                    \
            for (int k = 1; k < nin; k++) a = C(a, W(ins[k], i, m));                                    \
            if (divisor > 0) a = DIV(a, d);                                                             \
            S(out, i, a, m);                                                                            \
        }                                                                                               \
    }

#define DEF_F32(NAME, W, C, S) DEF_KERNEL(NAME, __m512, __mmask16, 16, W, C, S, _mm512_div_ps, _mm512_set1_ps, float)

/* a narrow kind into fp32 (the _0 kernels), then into its own kind (_1) */
#define DEF_WIDEN(KIND)                              \
    DEF_F32(k_##KIND##_sum_0, w_##KIND, c_sum, s_f32)  \
    DEF_F32(k_##KIND##_prod_0, w_##KIND, c_prod, s_f32) \
    DEF_F32(k_##KIND##_min_0, w_##KIND, c_min, s_f32)  \
    DEF_F32(k_##KIND##_max_0, w_##KIND, c_max, s_f32)

#define DEF_LOWP(KIND)                               \
    DEF_WIDEN(KIND)                                    \
    DEF_F32(k_##KIND##_sum_1, w_##KIND, c_sum, s_##KIND)  \
    DEF_F32(k_##KIND##_prod_1, w_##KIND, c_prod, s_##KIND) \
    DEF_F32(k_##KIND##_min_1, w_##KIND, c_min, s_##KIND)  \
    DEF_F32(k_##KIND##_max_1, w_##KIND, c_max, s_##KIND)

DEF_F32(k_f32_sum_0, w_f32, c_sum, s_f32)
DEF_F32(k_f32_prod_0, w_f32, c_prod, s_f32)
DEF_F32(k_f32_min_0, w_f32, c_min, s_f32)
DEF_F32(k_f32_max_0, w_f32, c_max, s_f32)
/* ---- bf16 in and bf16 out, 32 elements a vector ----
 * A 32-bit lane holds two bf16: the even element in its low half, the odd one in its high half.
 * Shifting left by 16 widens the even ones and clearing the low half widens the odd ones, so one
 * load gives two fp32 vectors with no shuffle; each is rounded into its lanes' high halves and the
 * two go back into one vector with no narrowing. Every element is combined in the same order, in
 * fp32, and rounded to nearest even as torch rounds (a NaN stays a quiet NaN of its sign and payload).
 * r_bf16_high: v rounded in each lane's high half (the low half is rounding debris, cleared by the caller). */
I512 __m512i r_bf16_high(__m512 v) {
    __m512i x = _mm512_castps_si512(v);
    __m512i lsb = _mm512_and_si512(_mm512_srli_epi32(x, 16), _mm512_set1_epi32(1));
    __m512i r = _mm512_add_epi32(_mm512_add_epi32(x, _mm512_set1_epi32(0x7FFF)), lsb);
    return _mm512_mask_or_epi32(r, _mm512_cmp_ps_mask(v, v, _CMP_UNORD_Q), x, _mm512_set1_epi32(0x400000));
}

#define DEF_BF16_PAIRS(NAME, C)                                                                          \
    static T512 void NAME(void *out, const void *const *ins, int nin, int64_t lo, int64_t hi, int64_t divisor) { \
        const __m512 d = _mm512_set1_ps((float)(divisor > 0 ? divisor : 1));                            \
        const __m512i high = _mm512_set1_epi32((int)0xFFFF0000u);                                        \
        for (int64_t i = lo; i < hi; i += 32) {                                                          \
            const __mmask32 m = hi - i >= 32 ? ~(__mmask32)0 : (__mmask32)(((uint64_t)1 << (hi - i)) - 1); \
            __m512i x = _mm512_maskz_loadu_epi16(m, (const uint16_t *)ins[0] + i);                       \
            __m512 ev = _mm512_castsi512_ps(_mm512_slli_epi32(x, 16));                                   \
            __m512 od = _mm512_castsi512_ps(_mm512_and_si512(x, high));                                  \
            for (int k = 1; k < nin; k++) {                                                              \
                x = _mm512_maskz_loadu_epi16(m, (const uint16_t *)ins[k] + i);                           \
                ev = C(ev, _mm512_castsi512_ps(_mm512_slli_epi32(x, 16)));                               \
                od = C(od, _mm512_castsi512_ps(_mm512_and_si512(x, high)));                              \
            }                                                                                            \
            if (divisor > 0) {                                                                           \
                ev = _mm512_div_ps(ev, d);                                                               \
                od = _mm512_div_ps(od, d);                                                               \
            }                                                                                            \
            /* (odd & high) | (even >> 16), in one ternary-logic op */                                  \
            _mm512_mask_storeu_epi16((uint16_t *)out + i, m,                                             \
                                     _mm512_ternarylogic_epi32(r_bf16_high(od), high,                    \
                                                               _mm512_srli_epi32(r_bf16_high(ev), 16), 0xEA)); \
        }                                                                                                \
    }

DEF_LOWP(f16)
DEF_WIDEN(bf16)
DEF_BF16_PAIRS(k_bf16_sum_1, c_sum)
DEF_BF16_PAIRS(k_bf16_prod_1, c_prod)
DEF_BF16_PAIRS(k_bf16_min_1, c_min)
DEF_BF16_PAIRS(k_bf16_max_1, c_max)
DEF_LOWP(e4m3)
DEF_LOWP(e5m2)

/* ---- fp64 lanes ---- */

I512 __m512d w_f64(const void *p, int64_t i, __mmask8 m) { return _mm512_maskz_loadu_pd(m, (const double *)p + i); }
I512 __m512d cd_sum(__m512d a, __m512d b) { return _mm512_add_pd(a, b); }
I512 __m512d cd_prod(__m512d a, __m512d b) { return _mm512_mul_pd(a, b); }
I512 __m512d cd_min(__m512d a, __m512d b) {
    __m512i r = _mm512_castpd_si512(_mm512_min_pd(a, b));
    r = _mm512_mask_or_epi64(r, _mm512_cmp_pd_mask(a, b, _CMP_EQ_OQ), _mm512_castpd_si512(a), _mm512_castpd_si512(b));
    r = _mm512_mask_mov_epi64(r, _mm512_cmp_pd_mask(a, b, _CMP_UNORD_Q), _mm512_set1_epi64(-1));
    return _mm512_castsi512_pd(r);
}
I512 __m512d cd_max(__m512d a, __m512d b) {
    __m512i r = _mm512_castpd_si512(_mm512_max_pd(a, b));
    r = _mm512_mask_and_epi64(r, _mm512_cmp_pd_mask(a, b, _CMP_EQ_OQ), _mm512_castpd_si512(a), _mm512_castpd_si512(b));
    r = _mm512_mask_mov_epi64(r, _mm512_cmp_pd_mask(a, b, _CMP_UNORD_Q), _mm512_set1_epi64(-1));
    return _mm512_castsi512_pd(r);
}
I512 void s_f64(void *o, int64_t i, __m512d v, __mmask8 m) { _mm512_mask_storeu_pd((double *)o + i, m, v); }

#define DEF_F64(NAME, C) DEF_KERNEL(NAME, __m512d, __mmask8, 8, w_f64, C, s_f64, _mm512_div_pd, _mm512_set1_pd, double)
DEF_F64(k_f64_sum_0, cd_sum)
DEF_F64(k_f64_prod_0, cd_prod)
DEF_F64(k_f64_min_0, cd_min)
DEF_F64(k_f64_max_0, cd_max)

/* ---- int32 and int64 lanes (sums wrap; no division ever reaches them) ---- */

I512 __m512i w_i32(const void *p, int64_t i, __mmask16 m) {
    return _mm512_maskz_loadu_epi32(m, (const int32_t *)p + i);
}
I512 __m512i w_i64(const void *p, int64_t i, __mmask8 m) { return _mm512_maskz_loadu_epi64(m, (const int64_t *)p + i); }
I512 void s_i32(void *o, int64_t i, __m512i v, __mmask16 m) { _mm512_mask_storeu_epi32((int32_t *)o + i, m, v); }
I512 void s_i64(void *o, int64_t i, __m512i v, __mmask8 m) { _mm512_mask_storeu_epi64((int64_t *)o + i, m, v); }
I512 __m512i no_div(__m512i a, __m512i d) { (void)d; return a; }

#define DEF_I32(NAME, C) DEF_KERNEL(NAME, __m512i, __mmask16, 16, w_i32, C, s_i32, no_div, _mm512_set1_epi32, int32_t)
#define DEF_I64(NAME, C) DEF_KERNEL(NAME, __m512i, __mmask8, 8, w_i64, C, s_i64, no_div, _mm512_set1_epi64, int64_t)
DEF_I32(k_u32_sum_0, _mm512_add_epi32)
DEF_I32(k_i32_min_0, _mm512_min_epi32)
DEF_I32(k_i32_max_0, _mm512_max_epi32)
DEF_I64(k_u64_sum_0, _mm512_add_epi64)
DEF_I64(k_i64_min_0, _mm512_min_epi64)
DEF_I64(k_i64_max_0, _mm512_max_epi64)

HFR_SIMD_TABLE(hfr_avx512_kernel)

#else /* not x86: no AVX-512 kernels */

hfr_kernel hfr_avx512_kernel(int kind, int op, int narrow) {
    (void)kind, (void)op, (void)narrow;
    return NULL;
}

#endif
