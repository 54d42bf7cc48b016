/* fp32 vectors for the loops written by hand (divide.h, Adam's and AdEMAMix's updates): one source for the AVX-512
 * build (16 lanes, mask registers) and the AVX2 + FMA build (8 lanes, masks held in vectors).
 * Elsewhere VECTOR_LANES is undefined and those loops are left to their portable versions.
 *
 * A mask_t selects lanes; vec_select(m, a, b) is a where m, b elsewhere. Comparisons are ordered
 * (false where a NaN is involved) unless they say otherwise. */
#if defined(__AVX512F__)
#define VECTOR_LANES 16
typedef __m512 vec_t;
typedef __mmask16 mask_t;
#define VECTOR_OP(name) _mm512_##name

static inline vec_t vec_xor_bits(vec_t a, uint32_t bits) { return _mm512_castsi512_ps(_mm512_xor_si512(_mm512_castps_si512(a), _mm512_set1_epi32((int32_t)bits))); }
static inline mask_t vec_less(vec_t a, vec_t b) { return _mm512_cmp_ps_mask(a, b, _CMP_LT_OQ); }
static inline mask_t vec_equal(vec_t a, vec_t b) { return _mm512_cmp_ps_mask(a, b, _CMP_EQ_OQ); }
static inline mask_t vec_unordered(vec_t a, vec_t b) { return _mm512_cmp_ps_mask(a, b, _CMP_UNORD_Q); }
static inline vec_t vec_select(mask_t m, vec_t a, vec_t b) { return _mm512_mask_blend_ps(m, b, a); }
static inline int mask_any(mask_t m) { return m != 0; }
static inline mask_t mask_and_not(mask_t a, mask_t b) { return (mask_t)(a & ~b); }

/* the lanes whose magnitude's bits lie in [lo, lo + span) (unsigned), and those not +-0 */
static inline mask_t vec_magnitude_within(vec_t a, uint32_t lo, uint32_t span) {
    __m512i magnitude = _mm512_and_si512(_mm512_castps_si512(a), _mm512_set1_epi32(0x7FFFFFFF));
    return _mm512_cmplt_epu32_mask(_mm512_sub_epi32(magnitude, _mm512_set1_epi32((int32_t)lo)), _mm512_set1_epi32((int32_t)span));
}
static inline mask_t vec_nonzero(vec_t a) { return _mm512_test_epi32_mask(_mm512_castps_si512(a), _mm512_set1_epi32(0x7FFFFFFF)); }

/* the lanes that are NaN, +-0 or +-infinity */
static inline mask_t vec_zero_or_not_finite(vec_t a) {
#ifdef __AVX512DQ__
    return _mm512_fpclass_ps_mask(a, 0x9F);
#else
    __m512i magnitude = _mm512_and_si512(_mm512_castps_si512(a), _mm512_set1_epi32(0x7FFFFFFF));
    return (mask_t)(~vec_nonzero(a) | _mm512_cmpge_epu32_mask(magnitude, _mm512_set1_epi32(0x7F800000)));
#endif
}

/* bf16 values as fp32 (exact), and fp32 values rounded to bf16 as f32_to_bf16 rounds them (to nearest
 * even; NaN -> 0x7FC0) */
static inline vec_t vec_load_bf16(const uint16_t *p) {
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i *)p)), 16));
}
static inline void vec_store_bf16(uint16_t *p, vec_t x) {
    __m512i u = _mm512_castps_si512(x), odd = _mm512_and_si512(_mm512_srli_epi32(u, 16), _mm512_set1_epi32(1));
    __m512i rounded = _mm512_srli_epi32(_mm512_add_epi32(_mm512_add_epi32(u, _mm512_set1_epi32(0x7FFF)), odd), 16);
    rounded = _mm512_mask_mov_epi32(rounded, _mm512_cmp_ps_mask(x, x, _CMP_UNORD_Q), _mm512_set1_epi32(0x7FC0));
    _mm256_storeu_si256((__m256i *)p, _mm512_cvtepi32_epi16(rounded));
}

#elif defined(AVX2_ONLY)
#define VECTOR_LANES 8
typedef __m256 vec_t;
typedef __m256 mask_t;  /* all ones in a selected lane */
#define VECTOR_OP(name) _mm256_##name

static inline vec_t vec_xor_bits(vec_t a, uint32_t bits) { return _mm256_xor_ps(a, _mm256_castsi256_ps(_mm256_set1_epi32((int32_t)bits))); }
static inline mask_t vec_less(vec_t a, vec_t b) { return _mm256_cmp_ps(a, b, _CMP_LT_OQ); }
static inline mask_t vec_equal(vec_t a, vec_t b) { return _mm256_cmp_ps(a, b, _CMP_EQ_OQ); }
static inline mask_t vec_unordered(vec_t a, vec_t b) { return _mm256_cmp_ps(a, b, _CMP_UNORD_Q); }
static inline vec_t vec_select(mask_t m, vec_t a, vec_t b) { return _mm256_blendv_ps(b, a, m); }
static inline int mask_any(mask_t m) { return _mm256_movemask_ps(m) != 0; }
static inline mask_t mask_and_not(mask_t a, mask_t b) { return _mm256_andnot_ps(b, a); }

static inline mask_t vec_magnitude_within(vec_t a, uint32_t lo, uint32_t span) {
    /* unsigned x < span as signed: both with the top bit flipped (AVX2 compares signed only) */
    __m256i top = _mm256_set1_epi32((int32_t)0x80000000u);
    __m256i magnitude = _mm256_and_si256(_mm256_castps_si256(a), _mm256_set1_epi32(0x7FFFFFFF));
    __m256i offset = _mm256_xor_si256(_mm256_sub_epi32(magnitude, _mm256_set1_epi32((int32_t)lo)), top);
    return _mm256_castsi256_ps(_mm256_cmpgt_epi32(_mm256_xor_si256(_mm256_set1_epi32((int32_t)span), top), offset));
}
static inline mask_t vec_nonzero(vec_t a) { return _mm256_cmp_ps(a, _mm256_setzero_ps(), _CMP_NEQ_UQ); }

static inline mask_t vec_zero_or_not_finite(vec_t a) {
    __m256 magnitude = _mm256_andnot_ps(_mm256_set1_ps(-0.0f), a);  /* NaN: not less than infinity */
    return _mm256_or_ps(_mm256_cmp_ps(a, _mm256_setzero_ps(), _CMP_EQ_OQ), _mm256_cmp_ps(magnitude, _mm256_set1_ps(INFINITY), _CMP_NLT_UQ));
}
static inline vec_t vec_load_bf16(const uint16_t *p) {
    return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i *)p)), 16));
}
static inline void vec_store_bf16(uint16_t *p, vec_t x) {
    __m256i u = _mm256_castps_si256(x), odd = _mm256_and_si256(_mm256_srli_epi32(u, 16), _mm256_set1_epi32(1));
    __m256i rounded = _mm256_srli_epi32(_mm256_add_epi32(_mm256_add_epi32(u, _mm256_set1_epi32(0x7FFF)), odd), 16);
    rounded = _mm256_blendv_epi8(rounded, _mm256_set1_epi32(0x7FC0), _mm256_castps_si256(_mm256_cmp_ps(x, x, _CMP_UNORD_Q)));
    /* every lane below 2**16: packing with unsigned saturation keeps it */
    _mm_storeu_si128((__m128i *)p, _mm_packus_epi32(_mm256_castsi256_si128(rounded), _mm256_extracti128_si256(rounded, 1)));
}
#endif

#ifdef VECTOR_LANES  /* the operations spelled alike in both ISAs */
static inline vec_t vec_load(const float *p) { return VECTOR_OP(loadu_ps)(p); }
static inline void vec_store(float *p, vec_t x) { VECTOR_OP(storeu_ps)(p, x); }
static inline vec_t vec_set1(float x) { return VECTOR_OP(set1_ps)(x); }
static inline vec_t vec_add(vec_t a, vec_t b) { return VECTOR_OP(add_ps)(a, b); }
static inline vec_t vec_sub(vec_t a, vec_t b) { return VECTOR_OP(sub_ps)(a, b); }
static inline vec_t vec_mul(vec_t a, vec_t b) { return VECTOR_OP(mul_ps)(a, b); }
static inline vec_t vec_div(vec_t a, vec_t b) { return VECTOR_OP(div_ps)(a, b); }
static inline vec_t vec_sqrt(vec_t a) { return VECTOR_OP(sqrt_ps)(a); }
static inline vec_t vec_fmadd(vec_t a, vec_t b, vec_t c) { return VECTOR_OP(fmadd_ps)(a, b, c); }    /* a * b + c, rounded once */
static inline vec_t vec_fmsub(vec_t a, vec_t b, vec_t c) { return VECTOR_OP(fmsub_ps)(a, b, c); }    /* a * b - c, rounded once */
static inline vec_t vec_fnmadd(vec_t a, vec_t b, vec_t c) { return VECTOR_OP(fnmadd_ps)(a, b, c); }  /* c - a * b, rounded once */
#endif
