/* Codecs: one block of codes <-> fp32 values.
 *
 * decode_block: codes -> codebook value * scale. block_scale: the block's scale (quant.block_scales).
 * encode_block: values / scale -> the exact nearest code (a codebook's lookup tables, or e4m3
 * rounding), then stochastic rounding where the format asks for it (stochastic.h), and for a
 * calibrated format the products its scale is corrected from (calibrated_scale).
 *
 * With AVX-512 (the library is built with -march=native) the loops are intrinsics: compilers do not
 * vectorize table gathers indexed by bytes. With AVX2 only, decoding and encoding are intrinsics too:
 * the same loops with 8 lanes, dividing. The portable loops are the reference, the tails and
 * everything elsewhere; all compute exactly the same values.
 */
#ifndef MIN_BLOCK_SCALE
#error "build with -DMIN_BLOCK_SCALE=<quant.MIN_BLOCK_SCALE>, as kernel_build.py does"
#endif

#ifdef AVX2_ONLY
/* table[idx] for a 16-entry table held in two registers (idx in 0..15) */
static inline __m256 lookup16(__m256 low, __m256 high, __m256i idx) {
    __m256 upper = _mm256_castsi256_ps(_mm256_slli_epi32(idx, 28));  /* bit 3 on top: blendv's selector */
    return _mm256_blendv_ps(_mm256_permutevar8x32_ps(low, idx), _mm256_permutevar8x32_ps(high, idx), upper);
}

/* e4m3_to_f32 of 8 codes, computed from their bits rather than looked up in e4m3_values: where
 * gathers are slow (AMD EPYC of family 26, AVX2 build, one thread) decoding both fp8 moments took
 * 0.351 ns per element with 8 scalar loads, 0.251 so. Intel's cores keep the gather (not measured
 * against it). */
static inline __m256 e4m3_to_f32_8(const uint8_t *codes) {
    __m256i c = _mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i *)codes));
    __m256i magnitude = _mm256_and_si256(c, _mm256_set1_epi32(0x7F)), shifted = _mm256_slli_epi32(magnitude, E4M3_SHIFT);
    __m256 normal = _mm256_castsi256_ps(_mm256_add_epi32(shifted, _mm256_set1_epi32((int32_t)E4M3_BIAS)));
    /* exponent 0: the same bits one octave up, 2**-6 * (1 + m / 8), less 2**-6: m * 2**-9, exactly */
    __m256 subnormal = _mm256_sub_ps(_mm256_castsi256_ps(_mm256_add_epi32(shifted, _mm256_set1_epi32((int32_t)(E4M3_BIAS + (1u << 23))))), _mm256_set1_ps(0x1p-6f));
    __m256 value = _mm256_blendv_ps(normal, subnormal, _mm256_castsi256_ps(_mm256_cmpgt_epi32(_mm256_set1_epi32(8), magnitude)));
    value = _mm256_blendv_ps(value, _mm256_set1_ps(NAN), _mm256_castsi256_ps(_mm256_cmpeq_epi32(magnitude, _mm256_set1_epi32(E4M3_NAN))));
    return _mm256_or_ps(value, _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_srli_epi32(c, 7), 31)));
}

/* the low bytes of 8 int32 lanes, stored as 8 bytes */
static inline void store_low_bytes(uint8_t *dst, __m256i x) {
    __m256i bytes = _mm256_shuffle_epi8(x, _mm256_setr_epi8(0, 4, 8, 12, -1, -1, -1, -1, -1, -1, -1, -1, -1, -1, -1, -1,
                                                              0, 4, 8, 12, -1, -1, -1, -1, -1, -1, -1, -1, -1, -1, -1, -1));
    __m256i packed = _mm256_permutevar8x32_epi32(bytes, _mm256_setr_epi32(0, 4, 0, 0, 0, 0, 0, 0));
    _mm_storel_epi64((__m128i *)dst, _mm256_castsi256_si128(packed));
}
#endif

/* How many of 15 ascending numbers t[0..14] (a 4-bit codebook's decision thresholds, or its values)
 * are <= v, for a vector of values: a 4-step binary search that probes t[7]; t[3] or t[11]; one of
 * t[1, 5, 9, 13]; one of the even ones. The 15 numbers fit in registers, so each probe is a
 * broadcast, a blend or a permute, never a gather. NaN numbers (unused codes, at the end) count as
 * above every v, and v = NaN is above none. */
#ifdef __AVX512F__
typedef struct {
    __m512 t, odd, t3, t7, t11;  /* odd[c] = t[c + 1] */
} search16_t;

static inline search16_t search16(const float *t) {
    __m512 all = _mm512_loadu_ps(t);
    __m512i next = _mm512_setr_epi32(1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15, 15);
    return (search16_t){all, _mm512_permutexvar_ps(next, all), _mm512_set1_ps(t[3]), _mm512_set1_ps(t[7]), _mm512_set1_ps(t[11])};
}

static inline __m512i count16(const search16_t *s, __m512 v) {
    __mmask16 up8 = _mm512_cmp_ps_mask(v, s->t7, _CMP_GE_OQ);
    __m512i count = _mm512_maskz_mov_epi32(up8, _mm512_set1_epi32(8));
    count = _mm512_mask_add_epi32(count, _mm512_cmp_ps_mask(v, _mm512_mask_blend_ps(up8, s->t3, s->t11), _CMP_GE_OQ), count, _mm512_set1_epi32(4));
    count = _mm512_mask_add_epi32(count, _mm512_cmp_ps_mask(v, _mm512_permutexvar_ps(count, s->odd), _CMP_GE_OQ), count, _mm512_set1_epi32(2));
    return _mm512_mask_add_epi32(count, _mm512_cmp_ps_mask(v, _mm512_permutexvar_ps(count, s->t), _CMP_GE_OQ), count, _mm512_set1_epi32(1));
}

/* count16 by buckets (buckets_t) where the numbers fit them, for |v| <= 1 (the caller checks): v's
 * bucket is min(floor(v * BUCKETS / 2) + BUCKETS / 2, BUCKETS - 1), exact (a product by a power of
 * two), and the count is its below, plus one where v reaches its inside. Two mask operations where
 * count16 takes eight: on the AMD EPYC of family 26 storing a 4bit moment took 0.46 -> 0.35 ns per
 * value (1 thread). */
_Static_assert(BUCKETS == 32, "bucket_count16 reads a bucket's numbers from two 16-lane registers");

typedef struct {
    __m512i below_low, below_high;
    __m512 inside_low, inside_high;
} buckets16_t;

static inline buckets16_t buckets16(const buckets_t *b) {
    return (buckets16_t){_mm512_loadu_si512(b->below), _mm512_loadu_si512(b->below + 16), _mm512_loadu_ps(b->inside), _mm512_loadu_ps(b->inside + 16)};
}

static inline __m512i bucket_count16(const buckets16_t *b, __m512 v) {
    __m512i half = _mm512_set1_epi32(BUCKETS / 2);
    __m512i floor_scaled = _mm512_cvt_roundps_epi32(_mm512_mul_ps(v, _mm512_set1_ps((float)(BUCKETS / 2))), _MM_FROUND_TO_NEG_INF | _MM_FROUND_NO_EXC);
    __m512i bucket = _mm512_min_epi32(_mm512_add_epi32(floor_scaled, half), _mm512_set1_epi32(BUCKETS - 1));
    __m512i count = _mm512_permutex2var_epi32(b->below_low, bucket, b->below_high);
    __mmask16 reached = _mm512_cmp_ps_mask(v, _mm512_permutex2var_ps(b->inside_low, bucket, b->inside_high), _CMP_GE_OQ);
    return _mm512_mask_add_epi32(count, reached, count, _mm512_set1_epi32(1));
}

#elif defined(AVX2_ONLY)
typedef struct {
    __m256 t3, t7, t11, odd, even;  /* odd: t[1, 5, 9, 13]; even: t[0, 2, ..., 14] */
} search8_t;

static inline search8_t search8(const float *t) {
    return (search8_t){_mm256_set1_ps(t[3]), _mm256_set1_ps(t[7]), _mm256_set1_ps(t[11]), _mm256_setr_ps(t[1], t[5], t[9], t[13], 0, 0, 0, 0),
                       _mm256_setr_ps(t[0], t[2], t[4], t[6], t[8], t[10], t[12], t[14])};
}

/* how many of t[1], t[3], ..., t[13] are <= v: count8's first three probes. The count of all 15 is
 * twice that, plus one where v reaches t[2 c] (c: this count), the even number the last probe reads. */
static inline __m256i count8_odd(const search8_t *s, __m256 v) {
    /* the count so far, doubled at each probe less its mask (-1 where v reaches the probe): after
     * two probes it indexes odd */
    __m256i up8 = _mm256_castps_si256(_mm256_cmp_ps(v, s->t7, _CMP_GE_OQ));
    __m256i up4 = _mm256_castps_si256(_mm256_cmp_ps(v, _mm256_blendv_ps(s->t3, s->t11, _mm256_castsi256_ps(up8)), _CMP_GE_OQ));
    __m256i count = _mm256_sub_epi32(_mm256_setzero_si256(), _mm256_add_epi32(_mm256_add_epi32(up8, up8), up4));
    __m256i up2 = _mm256_castps_si256(_mm256_cmp_ps(v, _mm256_permutevar8x32_ps(s->odd, count), _CMP_GE_OQ));
    return _mm256_sub_epi32(_mm256_add_epi32(count, count), up2);
}

static inline __m256i count8(const search8_t *s, __m256 v) {
    __m256i half = count8_odd(s, v);
    __m256i up1 = _mm256_castps_si256(_mm256_cmp_ps(v, _mm256_permutevar8x32_ps(s->even, half), _CMP_GE_OQ));
    return _mm256_sub_epi32(_mm256_add_epi32(half, half), up1);
}
#endif

#if defined(__AVX512F__) && defined(__AVX512VBMI__) && defined(__AVX512BW__)
/* The values of 64 byte codes without gathers (8-bit codebooks; value_bytes holds the codebook's
 * values byte by byte): byte k of 64 values at once is a 256-entry byte lookup (two vpermi2b and a
 * blend on the code's top bit); interleaving the four bytes makes the floats. The codes are first
 * transposed in 4-byte groups so that the interleave leaves the values in order. */
typedef struct {
    __m512i quarter[4][4];  /* [byte k][codes 64q .. 64q + 63] */
} byte_tables_t;

static inline byte_tables_t byte_tables(const uint8_t *value_bytes) {
    byte_tables_t t;
    for (int k = 0; k < 4; k++)
        for (int q = 0; q < 4; q++) t.quarter[k][q] = _mm512_loadu_si512(value_bytes + 256 * k + 64 * q);
    return t;
}

/* out[0..3]: the values of the 64 codes (in order), 16 per vector */
static inline void lookup64(const byte_tables_t *t, __m512i codes, __m512 out[4]) {
    codes = _mm512_permutexvar_epi32(_mm512_setr_epi32(0, 4, 8, 12, 1, 5, 9, 13, 2, 6, 10, 14, 3, 7, 11, 15), codes);
    __mmask64 high = _mm512_movepi8_mask(codes);
    __m512i b[4];
    for (int k = 0; k < 4; k++)
        b[k] = _mm512_mask_blend_epi8(high, _mm512_permutex2var_epi8(t->quarter[k][0], codes, t->quarter[k][1]),
                                      _mm512_permutex2var_epi8(t->quarter[k][2], codes, t->quarter[k][3]));
    __m512i low01 = _mm512_unpacklo_epi8(b[0], b[1]), high01 = _mm512_unpackhi_epi8(b[0], b[1]);
    __m512i low23 = _mm512_unpacklo_epi8(b[2], b[3]), high23 = _mm512_unpackhi_epi8(b[2], b[3]);
    out[0] = _mm512_castsi512_ps(_mm512_unpacklo_epi16(low01, low23));
    out[1] = _mm512_castsi512_ps(_mm512_unpackhi_epi16(low01, low23));
    out[2] = _mm512_castsi512_ps(_mm512_unpacklo_epi16(high01, high23));
    out[3] = _mm512_castsi512_ps(_mm512_unpackhi_epi16(high01, high23));
}

/* decode_block over consecutive blocks of bs 8-bit codes, 4 <= bs < 64 (a power of two), block b's
 * scale scales[b]: 64 codes at a time across blocks, where decode_block would take a block at a time
 * and gather (lookup64 needs 64 codes). Each value is codebook value * its block's scale, as there.
 * Returns how many of the n codes it decoded: a multiple of 64; the rest is the caller's. */
static int64_t decode_short_blocks(const uint8_t *c, const uint8_t *value_bytes, const float *scales, int64_t bs, int64_t n, float *out) {
    byte_tables_t tables = byte_tables(value_bytes);
    __m512i lane = _mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
    int shift = __builtin_ctzll(bs);
    __m512i block_of[4];  /* the block (of the 64 codes') of each lane of the 4 vectors */
    for (int q = 0; q < 4; q++) block_of[q] = _mm512_srli_epi32(_mm512_add_epi32(lane, _mm512_set1_epi32(16 * q)), shift);
    __mmask16 blocks = (__mmask16)((1u << (64 >> shift)) - 1);
    int64_t i = 0;
    for (; i + 64 <= n; i += 64) {
        __m512 group_scales = _mm512_maskz_loadu_ps(blocks, scales + (i >> shift)), values[4];
        lookup64(&tables, _mm512_loadu_si512(c + i), values);
        for (int q = 0; q < 4; q++) _mm512_storeu_ps(out + i + 16 * q, _mm512_mul_ps(values[q], _mm512_permutexvar_ps(block_of[q], group_scales)));
    }
    return i;
}
#endif

/* out[i] = codebook[code i] * scale for the m codes starting at element 0 of a block; value_bytes
 * (8-bit codes) holds the codebook's values byte by byte */
static void decode_block(const uint8_t *c, int bits, const float *codebook, const uint8_t *value_bytes, float scale, int64_t m, float *out) {
    int64_t i = 0;
#ifdef __AVX512F__
    __m512 s = _mm512_set1_ps(scale);
#if defined(__AVX512VBMI__) && defined(__AVX512BW__)
    if (bits == 8) {  /* no gathers */
        byte_tables_t tables = byte_tables(value_bytes);
        for (; i + 64 <= m; i += 64) {
            __m512 values[4];
            lookup64(&tables, _mm512_loadu_si512(c + i), values);
            for (int q = 0; q < 4; q++) _mm512_storeu_ps(out + i + 16 * q, _mm512_mul_ps(values[q], s));
        }
    }
#endif
    if (bits == 8) {
        for (; i + 16 <= m; i += 16) {
            __m512i idx = _mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i *)(c + i)));
            _mm512_storeu_ps(out + i, _mm512_mul_ps(_mm512_i32gather_ps(idx, codebook, 4), s));
        }
    } else {
        __m512 table = _mm512_loadu_ps(codebook);  /* 16 values: one register, a permute decodes */
        __m512i shifts = _mm512_set_epi32(0, 4, 0, 4, 0, 4, 0, 4, 0, 4, 0, 4, 0, 4, 0, 4);
        for (; i + 16 <= m; i += 16) {
            __m128i bytes = _mm_loadl_epi64((const __m128i *)(c + i / 2));
            __m512i twice = _mm512_cvtepu8_epi32(_mm_unpacklo_epi8(bytes, bytes));  /* b0 b0 b1 b1 ... */
            __m512i idx = _mm512_and_si512(_mm512_srlv_epi32(twice, shifts), _mm512_set1_epi32(15));
            _mm512_storeu_ps(out + i, _mm512_mul_ps(_mm512_permutexvar_ps(idx, table), s));
        }
    }
#elif defined(AVX2_ONLY)
    __m256 s = _mm256_set1_ps(scale);
    if (SLOW_GATHERS && codebook == e4m3_values) {  /* fp8 (load_state hands e4m3 codes this table) */
        for (; i + 8 <= m; i += 8) _mm256_storeu_ps(out + i, _mm256_mul_ps(e4m3_to_f32_8(c + i), s));
    } else if (bits == 8) {
        for (; i + 8 <= m; i += 8) {
            _mm256_storeu_ps(out + i, _mm256_mul_ps(lookup8_ps_by_bytes(codebook, c + i), s));
        }
    } else {
        __m256 low = _mm256_loadu_ps(codebook), high = _mm256_loadu_ps(codebook + 8);
        __m256i shifts = _mm256_setr_epi32(4, 0, 12, 8, 20, 16, 28, 24);  /* code 2k: byte k's high nibble */
        for (; i + 8 <= m; i += 8) {
            int32_t four;  /* 8 codes, in every lane */
            memcpy(&four, c + i / 2, 4);
            __m256i idx = _mm256_and_si256(_mm256_srlv_epi32(_mm256_set1_epi32(four), shifts), _mm256_set1_epi32(15));
            _mm256_storeu_ps(out + i, _mm256_mul_ps(lookup16(low, high, idx), s));
        }
    }
#endif
    (void)value_bytes;
    for (; i < m; i++) {
        uint8_t code = bits == 8 ? c[i] : (i & 1 ? c[i / 2] & 15 : c[i / 2] >> 4);
        out[i] = codebook[code] * scale;
    }
}

/* the scale of a block of codes symmetric about 0 (scale_min == -scale_max): its absmax (at least
 * MIN_BLOCK_SCALE; NaN if any value is NaN) / scale_max */
static float block_absmax_scale(const float *restrict x, int64_t bs, float scale_max) {
    /* magnitudes compared as integers: the order of floats, with NaN above infinity (compilers
     * vectorize this as well as the AVX-512 intrinsics it replaced) */
    uint32_t top = 0;
    #pragma omp simd reduction(max : top)
    for (int64_t i = 0; i < bs; i++) {
        uint32_t a = bits_of(x[i]) & 0x7FFFFFFFu;
        top = a > top ? a : top;
    }
    /* a comparison, not fmaxf (a libm call: its NaN rule stops GCC inlining it, and a NaN top is
     * replaced by NAN below anyway) */
    float absmax = float_of(top) > MIN_BLOCK_SCALE ? float_of(top) : MIN_BLOCK_SCALE;
    return (top > 0x7F800000u ? NAN : absmax) / scale_max;
}

/* the block's scale (quant.block_scales): its largest value (at least MIN_BLOCK_SCALE) / scale_max or
 * its most negative / scale_min, whichever is larger; NaN if any value is NaN */
static float block_scale(const float *restrict x, int64_t bs, float scale_max, float scale_min) {
    if (scale_min == -scale_max) return block_absmax_scale(x, bs, scale_max);  /* the same scale, in one reduction */
    /* the largest positive and negative magnitudes, compared as integers, as block_absmax_scale does */
    uint32_t high = 0, low = 0;
    #pragma omp simd reduction(max : high, low)
    for (int64_t i = 0; i < bs; i++) {
        uint32_t u = bits_of(x[i]), negative = u >> 31, magnitude = u & 0x7FFFFFFFu;
        uint32_t h = negative ? 0 : magnitude, l = negative ? magnitude : 0;
        high = h > high ? h : high;
        low = l > low ? l : low;
    }
    if (high > 0x7F800000u || low > 0x7F800000u) return NAN;
    float largest = float_of(high) > MIN_BLOCK_SCALE ? float_of(high) : MIN_BLOCK_SCALE;
    float up = largest / scale_max;
    if (!low) return up;  /* no negative value: one division (a second in every block cost 2-4 % of a step) */
    float down = float_of(low) / -scale_min;
    return up > down ? up : down;
}

/* For a calibrated scale (quant.calibrated_scale): the products v * v and v * Q(v) of each normalized
 * value v and its code's value, in double (exact), as encode_block finds them. */
typedef struct {
    double *vv, *vq;  /* NULL: the format is not calibrated */
    const float *values;  /* the value of each code */
} calibration_t;

#ifdef __AVX512F__
static inline void store_products(const calibration_t *cal, int64_t i, __m512 v, __m512 q) {
    __m512d v_lo = _mm512_cvtps_pd(_mm512_castps512_ps256(v)), q_lo = _mm512_cvtps_pd(_mm512_castps512_ps256(q));
    __m512d v_hi = _mm512_cvtps_pd(_mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(v), 1)));
    __m512d q_hi = _mm512_cvtps_pd(_mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(q), 1)));
    _mm512_storeu_pd(cal->vv + i, _mm512_mul_pd(v_lo, v_lo));
    _mm512_storeu_pd(cal->vv + i + 8, _mm512_mul_pd(v_hi, v_hi));
    _mm512_storeu_pd(cal->vq + i, _mm512_mul_pd(v_lo, q_lo));
    _mm512_storeu_pd(cal->vq + i + 8, _mm512_mul_pd(v_hi, q_hi));
}
#endif

#ifdef AVX2_ONLY
static inline void store_products8(const calibration_t *cal, int64_t i, __m256 v, __m256 q) {
    __m256d v_lo = _mm256_cvtps_pd(_mm256_castps256_ps128(v)), v_hi = _mm256_cvtps_pd(_mm256_extractf128_ps(v, 1));
    __m256d q_lo = _mm256_cvtps_pd(_mm256_castps256_ps128(q)), q_hi = _mm256_cvtps_pd(_mm256_extractf128_ps(q, 1));
    _mm256_storeu_pd(cal->vv + i, _mm256_mul_pd(v_lo, v_lo));
    _mm256_storeu_pd(cal->vv + i + 4, _mm256_mul_pd(v_hi, v_hi));
    _mm256_storeu_pd(cal->vq + i, _mm256_mul_pd(v_lo, q_lo));
    _mm256_storeu_pd(cal->vq + i + 4, _mm256_mul_pd(v_hi, q_hi));
}
#endif

static inline void store_product(const calibration_t *cal, int64_t i, float v, uint8_t code) {
    cal->vv[i] = (double)v * (double)v;
    cal->vq[i] = (double)v * (double)cal->values[code];
}

#ifdef __AVX512F__
/* the nearest codes of 16 values from the packed table (kernel_op._near_code_table): one gather by
 * each value's top 16 bits, then base + 1 where its low 16 bits (complemented if negative), on top,
 * exceed the entry */
static inline __m512i table_codes16(const state_t *s, __m512 v) {
    __m512i bits = _mm512_castps_si512(v);
    __m512i entry = _mm512_i32gather_epi32(_mm512_srli_epi32(bits, 16), s->near_code, 4);
    __m512i low = _mm512_slli_epi32(_mm512_xor_si512(bits, _mm512_srai_epi32(bits, 31)), 16);
    __m512i code = _mm512_mask_sub_epi32(entry, _mm512_cmpgt_epu32_mask(low, entry), entry, _mm512_set1_epi32(-1));
    return _mm512_and_si512(code, _mm512_set1_epi32(0xFF));
}

/* the nearest codes of 16 values v by the affine map of mapped (v itself, or x times the scale's
 * reciprocal), and the table's codes of v where the map doubts: v is x, or divide(x, d) taken only
 * then */
static inline __m512i affine_or_table16(const affine_t *map, const state_t *s, __m512 mapped, __m512 x, const divisor_t *d) {
    __mmask16 doubtful;
    __m512i code = affine_codes16(map, mapped, &doubtful);
    if (__builtin_expect(doubtful != 0, 0)) code = _mm512_mask_mov_epi32(code, doubtful, table_codes16(s, d ? divide(x, d) : x));
    return code;
}
#endif

/* a codebook's nearest code for v from its tables: base_code, plus one where v reaches the bucket's
 * threshold (bucket: v's top 16 bits) */
static inline int32_t nearest_code(const state_t *s, float v) {
    uint32_t bucket = bits_of(v) >> 16;
    return s->base_code[bucket] + (v >= s->threshold[bucket]);
}

/* codes (one byte each) of the values x / scale: the exact nearest codebook value, or e4m3 rounding;
 * for a codebook, where normalized is given, also the values x / scale themselves (stochastic
 * rounding starts from them: dividing once saves a division per element). Inlined into each caller,
 * so that the nearest-only copy has no test for it in its loops. */
static inline __attribute__((always_inline)) void encode_nearest(const state_t *s, const float *restrict x, float scale, int64_t bs, uint8_t *restrict codes,
                                                                 const calibration_t *cal, float *restrict normalized) {
    int64_t i = 0;
#ifdef __AVX512F__
    divisor_t d = exact_divisor(scale);
    if (s->kind == KIND_E4M3) {  /* f32_to_e4m3, 16 at a time */
        quotients_t quotients = encoding_quotients(x, bs, d);
        __m512i magnitude = _mm512_set1_epi32(0x7FFFFFFF), two14 = _mm512_castps_si512(_mm512_set1_ps(16384.0f));
        for (; i + 16 <= bs; i += 16) {
            __m512 v = next_quotient(&quotients, x, i, bs);
            __m512i u = _mm512_castps_si512(v), a = _mm512_and_si512(u, magnitude);
            __m512i odd = _mm512_and_si512(_mm512_srli_epi32(a, 20), _mm512_set1_epi32(1));
            __m512i normal = _mm512_srli_epi32(_mm512_add_epi32(_mm512_add_epi32(a, odd), _mm512_set1_epi32(0x7FFFF - (120 << 23))), 20);
            __m512i subnormal = _mm512_sub_epi32(_mm512_castps_si512(_mm512_add_ps(_mm512_castsi512_ps(a), _mm512_castsi512_ps(two14))), two14);
            __m512i code = _mm512_mask_mov_epi32(normal, _mm512_cmplt_epu32_mask(a, _mm512_set1_epi32(0x3C800000)), subnormal);
            code = _mm512_mask_mov_epi32(code, _mm512_cmpge_epu32_mask(a, _mm512_set1_epi32(0x43F00000)), _mm512_set1_epi32(0x7F));
            code = _mm512_or_si512(code, _mm512_and_si512(_mm512_srli_epi32(u, 24), _mm512_set1_epi32(0x80)));
            _mm_storeu_si128((__m128i *)(codes + i), _mm512_cvtepi32_epi8(code));
            if (cal->vv) store_products(cal, i, v, _mm512_i32gather_ps(code, e4m3_values, 4));
        }
    } else if (s->bits == 4) {
        __m512i nan_code = _mm512_set1_epi32(s->nan_code), non_finite_key = _mm512_set1_epi32(0x7F80), low15 = _mm512_set1_epi32(0x7FFF);
        __m512 values = _mm512_loadu_ps(s->codebook);
        search16_t thresholds = search16(s->thresholds);  /* the code is how many are <= v */
        const buckets_t *bucketed = s->threshold_buckets;  /* a local: a store to codes (bytes) could change s */
        buckets16_t buckets;
        if (bucketed) buckets = buckets16(bucketed);
        quotients_t quotients = encoding_quotients(x, bs, d);
        for (; i + 16 <= bs; i += 16) {
            __m512 v = next_quotient(&quotients, x, i, bs);
            if (normalized) _mm512_storeu_ps(normalized + i, v);
            __m512i code;
            if (bucketed && vec_magnitude_within(v, 0, bits_of(1.0f) + 1) == 0xFFFF) {  /* every |v| <= 1 (not NaN) */
                code = bucket_count16(&buckets, v);
            } else {
                code = count16(&thresholds, v);
                __m512i key = _mm512_and_si512(_mm512_srli_epi32(_mm512_castps_si512(v), 16), low15);
                code = _mm512_mask_mov_epi32(code, _mm512_cmpge_epu32_mask(key, non_finite_key), nan_code);
            }
            _mm_storeu_si128((__m128i *)(codes + i), _mm512_cvtepi32_epi8(code));
            if (cal->vv) store_products(cal, i, v, _mm512_permutexvar_ps(code, values));
        }
    } else if (SLOW_GATHERS && s->affine && !normalized && !cal->vv && d.span) {
        /* the affine map (affine.h) of x times the scale's reciprocal: within 2**-22 of x / scale,
         * which only moves a value's map inside the band the map leaves to the table (affine_codes
         * checks that margin); the table's lanes take the exact quotient */
        affine_t map = affine_registers(s->affine);
        __m512 reciprocal = _mm512_set1_ps(d.y);
        for (; i + 16 <= bs; i += 16) {
            __m512 x16 = _mm512_loadu_ps(x + i);
            _mm_storeu_si128((__m128i *)(codes + i), _mm512_cvtepi32_epi8(affine_or_table16(&map, s, _mm512_mul_ps(x16, reciprocal), x16, &d)));
        }
    } else {
        int affine = SLOW_GATHERS && s->affine;  /* where gathers are fast, the table (lookup.h) */
        affine_t map;
        if (affine) map = affine_registers(s->affine);
        quotients_t quotients = encoding_quotients(x, bs, d);
        for (; i + 16 <= bs; i += 16) {
            __m512 v = next_quotient(&quotients, x, i, bs);
            if (normalized) _mm512_storeu_ps(normalized + i, v);
            __m512i code = affine ? affine_or_table16(&map, s, v, v, NULL) : table_codes16(s, v);
            _mm_storeu_si128((__m128i *)(codes + i), _mm512_cvtepi32_epi8(code));
            if (cal->vv) store_products(cal, i, v, _mm512_i32gather_ps(code, s->codebook, 4));
        }
    }
#elif defined(AVX2_ONLY)
    quotients_t quotients = encoding_quotients(x, bs, exact_divisor(scale));
    if (s->kind == KIND_E4M3) {  /* f32_to_e4m3, 8 at a time (compilers vectorize it, with many more packs) */
        __m256i magnitude = _mm256_set1_epi32(0x7FFFFFFF);
        __m256 two14 = _mm256_set1_ps(16384.0f);
        for (; i + 8 <= bs; i += 8) {
            __m256 v = next_quotient(&quotients, x, i, bs);
            __m256i u = _mm256_castps_si256(v), a = _mm256_and_si256(u, magnitude);
            __m256i odd = _mm256_and_si256(_mm256_srli_epi32(a, 20), _mm256_set1_epi32(1));
            __m256i normal = _mm256_srli_epi32(_mm256_add_epi32(_mm256_add_epi32(a, odd), _mm256_set1_epi32(0x7FFFF - (120 << 23))), 20);
            normal = _mm256_min_epu32(normal, _mm256_set1_epi32(0x7F));
            __m256i subnormal = _mm256_sub_epi32(_mm256_castps_si256(_mm256_add_ps(_mm256_castsi256_ps(a), two14)), _mm256_castps_si256(two14));
            __m256i code = _mm256_blendv_epi8(normal, subnormal, _mm256_cmpgt_epi32(_mm256_set1_epi32(0x3C800000), a));
            code = _mm256_or_si256(code, _mm256_and_si256(_mm256_srli_epi32(u, 24), _mm256_set1_epi32(0x80)));
            store_low_bytes(codes + i, code);
            if (cal->vv) store_products8(cal, i, v, lookup8_ps(e4m3_values, code));
        }
    } else if (s->kind == KIND_CODEBOOK && s->bits == 4) {
        search8_t thresholds = search8(s->thresholds);  /* the code is how many are <= v */
        __m256 q_low = _mm256_loadu_ps(s->codebook), q_high = _mm256_loadu_ps(s->codebook + 8);
        __m256i nan_code = _mm256_set1_epi32(s->nan_code), magnitude = _mm256_set1_epi32(0x7FFFFFFF);
        for (; i + 8 <= bs; i += 8) {
            __m256 v = next_quotient(&quotients, x, i, bs);
            if (normalized) _mm256_storeu_ps(normalized + i, v);
            __m256i code = count8(&thresholds, v);
            __m256i non_finite = _mm256_cmpgt_epi32(_mm256_and_si256(_mm256_castps_si256(v), magnitude), _mm256_set1_epi32(0x7F7FFFFF));
            code = _mm256_blendv_epi8(code, nan_code, non_finite);
            store_low_bytes(codes + i, code);
            if (cal->vv) store_products8(cal, i, v, lookup16(q_low, q_high, code));
        }
    } else if (s->kind == KIND_CODEBOOK) {
        __m256i sign = _mm256_set1_epi32(INT32_MIN);  /* flipped: an unsigned comparison as a signed one */
        for (; i + 8 <= bs; i += 8) {
            __m256 v = next_quotient(&quotients, x, i, bs);
            if (normalized) _mm256_storeu_ps(normalized + i, v);
            __m256i bits = _mm256_castps_si256(v);
            __m256i entry = lookup8(s->near_code, _mm256_srli_epi32(bits, 16));
            __m256i low = _mm256_slli_epi32(_mm256_xor_si256(bits, _mm256_srai_epi32(bits, 31)), 16);
            __m256i up = _mm256_cmpgt_epi32(_mm256_xor_si256(low, sign), _mm256_xor_si256(entry, sign));
            __m256i code = _mm256_sub_epi32(entry, up);  /* entry + 1 where low > entry */
            store_low_bytes(codes + i, code);  /* the low bytes */
            if (cal->vv) store_products8(cal, i, v, lookup8_ps(s->codebook, _mm256_and_si256(code, _mm256_set1_epi32(0xFF))));
        }
    }
#endif
    /* the rest (all of it without AVX-512 or AVX2): fp8 rounding, which compilers vectorize, or the
     * nearest-code tables (scalar, unless the target has gathers: faster than a vectorized count of
     * thresholds with 4 lanes) */
    int64_t first = i;
    if (s->kind == KIND_E4M3) {
        #pragma omp simd
        for (int64_t j = first; j < bs; j++) codes[j] = f32_to_e4m3(x[j] / scale);
    } else {
        for (int64_t j = first; j < bs; j++) {
            float v = x[j] / scale;
            codes[j] = (uint8_t)nearest_code(s, v);
            if (normalized) normalized[j] = v;
        }
    }
    if (cal->vv)
        for (int64_t j = first; j < bs; j++) store_product(cal, j, x[j] / scale, codes[j]);
}

#include "stochastic.h"

/* codes of the values x / scale (one byte each), and for a calibrated format the products of each
 * value with its final code's value */
static void encode_block(const state_t *s, const float *restrict x, float scale, int64_t bs, uint8_t *restrict codes, const calibration_t *cal) {
    if (!s->stochastic || s->kind != KIND_CODEBOOK) {  /* (fused_cpu gives stochastic codebooks only) */
        encode_nearest(s, x, scale, bs, codes, cal, NULL);
    } else if (s->bits == 4) {
        encode_stochastic4(s, x, scale, bs, codes, cal);
    } else {
        float normalized[bs];
        calibration_t none = {NULL, NULL, NULL};  /* the products wait for the final codes */
        encode_nearest(s, x, scale, bs, codes, &none, normalized);
        round_stochastically(s, normalized, scale, bs, codes);
        if (cal->vv)
            for (int64_t j = 0; j < bs; j++) store_product(cal, j, normalized[j], codes[j]);
    }
}

/* OptimState.quantize_ after encode: a nonnegative state's positive value encoded to the code of 0
 * takes the smallest positive code (and a calibrated block's product with it). Where x / scale > 0
 * as quantize_ divides: where x > scale * 2**-150, compared exactly in double (the quotient rounds
 * to 0 at and below it), so that no division is needed and the loops vectorize; a block without a
 * code of 0 (most) is left after one pass over its bytes. */
static void floor_positive(const state_t *s, const float *restrict x, float scale, int64_t bs, uint8_t *restrict codes, const calibration_t *cal) {
    uint8_t zero = (uint8_t)s->zero_code, smallest = (uint8_t)s->smallest_code;
    uint8_t zeros = 0;  /* (bytes: 64 codes to a vector) */
    for (int64_t j = 0; j < bs; j++) zeros |= (uint8_t)(codes[j] == zero);
    if (!zeros) return;
    double least = (double)scale * 0x1p-150;  /* NaN or inf where the block's scale is: no value passes */
    if (!cal->vv) {
        for (int64_t j = 0; j < bs; j++) codes[j] = ((codes[j] == zero) & ((double)x[j] > least)) ? smallest : codes[j];
        return;
    }
    for (int64_t j = 0; j < bs; j++)
        if (codes[j] == zero && (double)x[j] > least) {
            codes[j] = smallest;
            store_product(cal, j, x[j] / scale, smallest);
        }
}

/* quant.calibrated_scale: scale * sum(v * v) / sum(v * Q(v)) over the block, the sums taken by
 * halves in quant.pairwise_sum's order (consumes the products), so that the result is the compiled
 * step's, bit for bit. */
static float calibrated_scale(const calibration_t *cal, float scale, int64_t bs) {
    double *vv = cal->vv, *vq = cal->vq;
    for (int64_t half = bs / 2; half >= 1; half /= 2)
        for (int64_t i = 0; i < half; i++) {
            vv[i] = vv[i] + vv[i + half];
            vq[i] = vq[i] + vq[i + half];
        }
    double c = vv[0] / vq[0];
    if (!(isfinite(c) && c > 0)) c = 1.0;
    return (float)((double)scale * c);
}
