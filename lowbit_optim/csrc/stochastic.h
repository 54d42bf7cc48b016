/* Stochastic rounding (quant.dither, quant.encode_stochastic, stochastic_bf16). Each value goes to
 * one of the two codes (bf16 values) around it, the upper one with probability (v - a) / (b - a),
 * drawn from a hash of its bits, its place in the block and a salt (a codebook block's scale; for
 * bf16-sr, its block's index and the state's count of writes): the compiled step's codes exactly, in
 * each of the three paths. 4-bit codes are found in one pass (encode_stochastic4); 8-bit ones as a
 * second pass over the nearest codes (round_stochastically); bf16 values by a carry
 * (store_bf16_stochastic). */
#if !defined(DITHER_DROPPED_BITS) || !defined(DITHER_PLACE) || !defined(DITHER_SALT)
#error "build with -DDITHER_DROPPED_BITS, -DDITHER_PLACE and -DDITHER_SALT from quant, as kernel_build.py does (the hash must stay quant.dither's)"
#endif
#if !defined(BF16_SR_HASH_BLOCK) || !defined(BF16_SR_WRITES_MIX) || !defined(BF16_SR_BLOCK_MIX)
#error "build with -DBF16_SR_HASH_BLOCK, -DBF16_SR_WRITES_MIX and -DBF16_SR_BLOCK_MIX from stochastic_bf16, as kernel_build.py does"
#endif

/* quant.dither's term of a block's scale (given as its fp32 bits), which it adds to every place's term */
static inline uint32_t dither_salt_of_bits(uint32_t bits) { return (bits >> DITHER_DROPPED_BITS) * DITHER_SALT; }
static inline uint32_t dither_salt(float scale) { return dither_salt_of_bits(bits_of(scale)); }

/* quant.dither for value v at place j of a block whose term is salt: the Python's int64 arithmetic
 * masked to 32 bits is uint32 arithmetic. The top 24 bits of the hash, a number in [0, 1) exact in
 * fp32 (converted as int32: AVX2 has no unsigned conversion). */
static inline uint32_t dither_hash_of_term(float v, uint32_t term) {  /* term: j * DITHER_PLACE + salt */
    uint32_t h = (bits_of(v) >> DITHER_DROPPED_BITS) ^ term;
    h ^= h >> 16;
    h *= 0x7FEB352Du;
    h ^= h >> 15;
    h *= 0x5BD1E995u;
    return h ^ (h >> 16);
}

static inline uint32_t dither_hash(float v, uint32_t j, uint32_t salt) { return dither_hash_of_term(v, j * DITHER_PLACE + salt); }

static inline float dither_of_term(float v, uint32_t term) { return (float)(int32_t)(dither_hash_of_term(v, term) >> 8) * 0x1p-24f; }
static inline float dither(float v, uint32_t j, uint32_t salt) { return dither_of_term(v, j * DITHER_PLACE + salt); }

/* the dither_salt of stochastic_bf16.write_salt: block's after writes writes */
static inline uint32_t write_salt(int64_t writes, int64_t block) {
    uint64_t mixed = ((uint64_t)writes * BF16_SR_WRITES_MIX + (uint64_t)block * BF16_SR_BLOCK_MIX) & 0x3FFFFFu;
    return dither_salt_of_bits(((uint32_t)mixed << 10) ^ 0x80000000u);  /* the Python's int32 salt bits */
}

/* stochastic_bf16.round_bf16_stochastically of the n values x of elements start.. of a state whose
 * count of writes (this one included) is writes: the hash salted per block of BF16_SR_HASH_BLOCK by
 * the block's index and the count; the dither's top 16 bits added below bf16's 16 carry into the
 * kept bits with probability the dropped fraction. Non-finite values as bf16 conversion gives them.
 * The inner loop is all 32-bit (place k of a run adds k * DITHER_PLACE to the run's first term) and
 * selects only for NaN, so that compilers vectorize it well: with an int64 modulo per element and a
 * whole bf16 conversion beside the carry, storing a bf16-sr moment took 0.57 ns per value (AVX2
 * build) and 0.28 (AVX-512) on an AMD EPYC of family 26, one thread, against 0.21 and 0.11 now. */
static void store_bf16_stochastic(uint16_t *dst, int64_t start, int64_t n, const float *x, int64_t writes) {
    for (int64_t i = 0; i < n;) {
        int64_t j = start + i, block = j / BF16_SR_HASH_BLOCK, end = (block + 1) * BF16_SR_HASH_BLOCK - start;
        int64_t run = (end < n ? end : n) - i;  /* the values of this hash block */
        uint32_t term = (uint32_t)(j % BF16_SR_HASH_BLOCK) * DITHER_PLACE + write_salt(writes, block);
        const float *v = x + i;
        uint16_t *out = dst + j;
        for (int32_t k = 0; k < (int32_t)run; k++) {
            uint32_t u = bits_of(v[k]), carried = (u + (dither_hash_of_term(v[k], term) >> 16)) >> 16;
            term += DITHER_PLACE;
            out[k] = v[k] == v[k] ? (uint16_t)carried : 0x7FC0u;  /* +-inf carries nothing (its low bits are 0); NaN: f32_to_bf16's */
        }
        i += run;
    }
}

/* The first step of quant.dither for places 0..15 (0..7) of a block: j * DITHER_PLACE + salt, a
 * vector that each next group of places adds 16 (8) * DITHER_PLACE to (no multiplication in the loops) */
#ifdef __AVX512F__
static inline __m512i dither_places16(uint32_t salt) {
    __m512i lanes = _mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
    return _mm512_add_epi32(_mm512_mullo_epi32(lanes, _mm512_set1_epi32((int32_t)DITHER_PLACE)), _mm512_set1_epi32((int32_t)salt));
}

/* quant.dither of 16 (8) values v times 2**24 (an integer below 2**24, exact); places: their first
 * step (dither_places16) */
static inline __m512 dither_draws16(__m512 v, __m512i places) {
    __m512i h = _mm512_xor_si512(_mm512_srli_epi32(_mm512_castps_si512(v), DITHER_DROPPED_BITS), places);
    h = _mm512_xor_si512(h, _mm512_srli_epi32(h, 16));
    h = _mm512_mullo_epi32(h, _mm512_set1_epi32(0x7FEB352D));
    h = _mm512_xor_si512(h, _mm512_srli_epi32(h, 15));
    h = _mm512_mullo_epi32(h, _mm512_set1_epi32(0x5BD1E995));
    h = _mm512_xor_si512(h, _mm512_srli_epi32(h, 16));
    return _mm512_cvtepi32_ps(_mm512_srli_epi32(h, 8));
}
#elif defined(AVX2_ONLY)
static inline __m256i dither_places8(uint32_t salt) {
    __m256i lanes = _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7);
    return _mm256_add_epi32(_mm256_mullo_epi32(lanes, _mm256_set1_epi32((int32_t)DITHER_PLACE)), _mm256_set1_epi32((int32_t)salt));
}

static inline __m256 dither_draws8(__m256 v, __m256i places) {
    __m256i h = _mm256_xor_si256(_mm256_srli_epi32(_mm256_castps_si256(v), DITHER_DROPPED_BITS), places);
    h = _mm256_xor_si256(h, _mm256_srli_epi32(h, 16));
    h = _mm256_mullo_epi32(h, _mm256_set1_epi32(0x7FEB352D));
    h = _mm256_xor_si256(h, _mm256_srli_epi32(h, 15));
    h = _mm256_mullo_epi32(h, _mm256_set1_epi32(0x5BD1E995));
    h = _mm256_xor_si256(h, _mm256_srli_epi32(h, 16));
    return _mm256_cvtepi32_ps(_mm256_srli_epi32(h, 8));
}
#endif

/* quant.encode_stochastic for value v at place j of its block (salt: the block's dither_salt), k its
 * nearest code, q the codebook (top: its last pair's lower code): low is the code at or below v,
 * (a, b) the pair of codes around it; up where (v - a) > u * (b - a). Outside the codebook's range, next to an unused (NaN) code, and
 * for NaN, the nearest code stays. The reference: the vector loops below compute exactly this. */
static inline __attribute__((always_inline)) int32_t stochastic_code(const float *q, int32_t top, float v, uint32_t j, uint32_t salt, int32_t k) {
    int32_t low = k - (q[k] > v);
    int32_t pair = low < 0 ? 0 : low;  /* clamped in two steps: GCC then vectorizes the loop */
    pair = pair > top ? top : pair;
    float a = q[pair], b = q[pair + 1];
    int32_t up = (v - a) > dither(v, j, salt) * (b - a);
    /* inside: low in [0, top] and b a used code; a mask, as a ternary keeps GCC's loop scalar */
    uint32_t inside = (0u - (low == pair)) & (0u - (b == b));
    return k + ((pair + up - k) & inside);
}

/* Stochastic rounding as a second pass over a block's nearest codes (8-bit codes): v_in holds the
 * values normalized by scale, codes their nearest codes, replaced by the rounded ones. With AVX-512
 * VBMI, 64 codes at a time: the values of k - 1, k and k + 1 come from byte lookups (lookup64), not
 * three gathers per value (on the AMD EPYC of family 26 a gather alone cost 0.33 ns per value);
 * stochastic_code's arithmetic on them, lane by lane. The AVX2 build where gathers are slow loads the
 * three values of each code at once (SLOW_GATHERS). Elsewhere compilers vectorize the loop (gathers
 * where the target has them). */
static void round_stochastically(const state_t *s, const float *restrict v_in, float scale, int64_t bs, uint8_t *restrict codes) {
    const float *q = s->codebook;  /* locals: a store to codes (bytes) could change s */
    int32_t top = (1 << s->bits) - 2;
    uint32_t salt = dither_salt(scale);
    int64_t j = 0;
#if defined(__AVX512F__) && defined(__AVX512VBMI__) && defined(__AVX512BW__)
    byte_tables_t tables = byte_tables(s->value_bytes);
    __m512i one = _mm512_set1_epi32(1), pairs = _mm512_set1_epi32(top + 1), one_byte = _mm512_set1_epi8(1);
    __m512 unit = _mm512_set1_ps(0x1p-24f);
    __m512i places = dither_places16(salt), next_places = _mm512_set1_epi32((int32_t)(16 * DITHER_PLACE));
    for (; j + 64 <= bs; j += 64) {
        __m512i nearest = _mm512_loadu_si512(codes + j);
        __m512 at[4], below[4], above[4];  /* q[k], q[k - 1], q[k + 1] (bytes wrap: those lanes lie outside) */
        lookup64(&tables, nearest, at);
        lookup64(&tables, _mm512_sub_epi8(nearest, one_byte), below);
        lookup64(&tables, _mm512_add_epi8(nearest, one_byte), above);
        for (int g = 0; g < 4; g++, places = _mm512_add_epi32(places, next_places)) {
            __m512 v = _mm512_loadu_ps(v_in + j + 16 * g);
            __m512i k = _mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i *)(codes + j + 16 * g)));
            __mmask16 over = _mm512_cmp_ps_mask(at[g], v, _CMP_GT_OQ);  /* q[k] > v: low = k - 1 */
            __m512i low = _mm512_mask_sub_epi32(k, over, k, one);
            __m512 a = _mm512_mask_blend_ps(over, at[g], below[g]), b = _mm512_mask_blend_ps(over, above[g], at[g]);
            /* inside: 0 <= low <= top (unsigned) and b a used code */
            __mmask16 inside = _mm512_mask_cmp_ps_mask(_mm512_cmplt_epu32_mask(low, pairs), b, b, _CMP_ORD_Q);
            __m512 u = _mm512_mul_ps(dither_draws16(v, places), unit);
            __mmask16 up = _mm512_mask_cmp_ps_mask(inside, _mm512_sub_ps(v, a), _mm512_mul_ps(u, _mm512_sub_ps(b, a)), _CMP_GT_OQ);
            __m512i code = _mm512_mask_mov_epi32(k, inside, _mm512_mask_add_epi32(low, up, low, one));
            _mm_storeu_si128((__m128i *)(codes + j + 16 * g), _mm512_cvtepi32_epi8(code));
        }
    }
#elif defined(AVX2_ONLY) && SLOW_GATHERS
    /* where gathers are slow (lookup.h): each value's q[k - 1], q[k], q[k + 1] (and q[k + 2]) by one
     * 16-byte load from a padded copy of the codebook, 8 such rows transposed. The padding is read
     * only for lanes outside the pairs (k = 0 below, k = 255 above), whose codes stay. */
    float padded[260];  /* padded[c + 1] = q[c] */
    padded[0] = padded[257] = padded[258] = padded[259] = NAN;
    memcpy(padded + 1, q, 256 * sizeof(float));
    __m256i minus_one = _mm256_set1_epi32(-1), last = _mm256_set1_epi32(top);
    __m256 unit = _mm256_set1_ps(0x1p-24f);
    __m256i places = dither_places8(salt), next_places = _mm256_set1_epi32((int32_t)(8 * DITHER_PLACE));
    for (; j + 8 <= bs; j += 8, places = _mm256_add_epi32(places, next_places)) {
        __m256 row[4];  /* lanes l (low half) and l + 4 (high half) */
        for (int l = 0; l < 4; l++) row[l] = _mm256_set_m128(_mm_loadu_ps(padded + codes[j + l + 4]), _mm_loadu_ps(padded + codes[j + l]));
        __m256d t0 = _mm256_castps_pd(_mm256_unpacklo_ps(row[0], row[1])), t1 = _mm256_castps_pd(_mm256_unpackhi_ps(row[0], row[1]));
        __m256d t2 = _mm256_castps_pd(_mm256_unpacklo_ps(row[2], row[3])), t3 = _mm256_castps_pd(_mm256_unpackhi_ps(row[2], row[3]));
        __m256 below = _mm256_castpd_ps(_mm256_unpacklo_pd(t0, t2)), at = _mm256_castpd_ps(_mm256_unpackhi_pd(t0, t2));
        __m256 above = _mm256_castpd_ps(_mm256_unpacklo_pd(t1, t3));
        __m256 v = _mm256_loadu_ps(v_in + j);
        __m256i k = _mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i *)(codes + j)));
        __m256 over = _mm256_cmp_ps(at, v, _CMP_GT_OQ);  /* q[k] > v: low = k - 1 (a mask is -1) */
        __m256i low = _mm256_add_epi32(k, _mm256_castps_si256(over));
        __m256 a = _mm256_blendv_ps(at, below, over), b = _mm256_blendv_ps(above, at, over);
        /* inside: 0 <= low <= top and b a used code */
        __m256i in_range = _mm256_andnot_si256(_mm256_cmpgt_epi32(low, last), _mm256_cmpgt_epi32(low, minus_one));
        __m256 inside = _mm256_and_ps(_mm256_castsi256_ps(in_range), _mm256_cmp_ps(b, b, _CMP_ORD_Q));
        __m256 u = _mm256_mul_ps(dither_draws8(v, places), unit);
        __m256 up = _mm256_and_ps(inside, _mm256_cmp_ps(_mm256_sub_ps(v, a), _mm256_mul_ps(u, _mm256_sub_ps(b, a)), _CMP_GT_OQ));
        __m256i code = _mm256_blendv_epi8(k, _mm256_sub_epi32(low, _mm256_castps_si256(up)), _mm256_castps_si256(inside));
        store_low_bytes(codes + j, code);
    }
#endif
    for (; j < bs; j++)
        codes[j] = (uint8_t)stochastic_code(q, top, v_in[j], (uint32_t)j, salt, codes[j]);
}

/* encode_stochastic4 for element i alone (the reference): its code, and a calibrated format's products */
static inline void encode_stochastic_one(const state_t *s, const float *restrict x, float scale, int64_t i, uint8_t *restrict codes, const calibration_t *cal) {
    float v = x[i] / scale;
    codes[i] = (uint8_t)stochastic_code(s->codebook, 14, v, (uint32_t)i, dither_salt(scale), nearest_code(s, v));
    if (cal->vv) store_product(cal, i, v, codes[i]);
}

#ifdef AVX2_ONLY
/* lanes 0, 2, ..., 14 (odds8: 1, 3, ..., 15) of the 16 values low, high */
static inline __m256 evens8(__m256 low, __m256 high) { return _mm256_castpd_ps(_mm256_permute4x64_pd(_mm256_castps_pd(_mm256_shuffle_ps(low, high, 0x88)), 0xD8)); }
static inline __m256 odds8(__m256 low, __m256 high) { return _mm256_castpd_ps(_mm256_permute4x64_pd(_mm256_castps_pd(_mm256_shuffle_ps(low, high, 0xDD)), 0xD8)); }

/* encode_stochastic4's vector loop on 8 lanes (AVX2); returns how many values it encoded. low, the
 * count of q[1..15] that are <= v, is the lower code of the pair around v, and the code is low, plus
 * one where rounding goes up. Where no pair lies around v, up is false by itself: below the codebook
 * v - q[0] < 0, and at or above its last used value the pair's width is NaN (w: past the used codes,
 * or the 16th). So the nearest code is never needed; a vector with a NaN or an infinity takes the
 * reference. low is 2 c, plus one where v reaches q[2 c + 1], c being the count of q[2], q[4], ...,
 * q[14] that are <= v (count8_odd's three probes): the pair's lower value is a last probe's
 * (q[2 c + 1]) where v reaches it, else q[2 c], and its width one of two tables indexed by c (after
 * count8_odd, four permutes and two blends). For q[k] = (k + 1) / 16 (linear: 4bit's second moment,
 * quant.linear_codebook_without_zero) floor(16 v), clamped to [0, 16], values are <= v (16 v is
 * exact) and q[low] is that number / 16: no search and no lookups, 17 % off the AVX2 4bit step
 * (with AVX-512 the same measured no gain, so it searches there). It is inlined once for each kind
 * of codebook (linear a constant), so that each copy holds only its own constants in the 16
 * registers. */
static inline __attribute__((always_inline)) int64_t encode_stochastic8(const state_t *s, const float *restrict x, float scale, int64_t bs, uint8_t *restrict codes,
                                                                        const calibration_t *cal, int32_t last_pair, uint32_t pair_lanes, int linear) {
    const float *q = s->codebook;
    int64_t i = 0;
    int calibrated = cal->vv != NULL;  /* a local: a store to codes (bytes) could change *cal */
    /* w[k] = (q[k + 1] - q[k]) * 2**-24 for the pairs (k <= last_pair), NaN past them; in registers */
    __m256 q_low = _mm256_loadu_ps(q), q_high = _mm256_loadu_ps(q + 8), scaled = _mm256_set1_ps(0x1p-24f);
    __m256i lanes = _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7), last = _mm256_set1_epi32(last_pair);
    __m256 next_high = _mm256_permutevar8x32_ps(q_high, _mm256_setr_epi32(1, 2, 3, 4, 5, 6, 7, 7));  /* lane 7 is past the pairs */
    __m256 w_low = _mm256_mul_ps(_mm256_sub_ps(_mm256_loadu_ps(q + 1), q_low), scaled);
    __m256 w_high = _mm256_mul_ps(_mm256_sub_ps(next_high, q_high), scaled), nan = _mm256_set1_ps(NAN);
    w_low = _mm256_blendv_ps(w_low, nan, _mm256_castsi256_ps(_mm256_cmpgt_epi32(lanes, last)));
    w_high = _mm256_blendv_ps(w_high, nan, _mm256_castsi256_ps(_mm256_cmpgt_epi32(_mm256_add_epi32(lanes, _mm256_set1_epi32(8)), last)));
    __m256 smallest = _mm256_set1_ps(FLT_MIN), magnitude = _mm256_castsi256_ps(_mm256_set1_epi32(0x7FFFFFFF));
    uint32_t exact = (uint32_t)_mm256_movemask_ps(_mm256_cmp_ps(_mm256_and_ps(w_low, magnitude), smallest, _CMP_GE_OQ)) |
                     (uint32_t)_mm256_movemask_ps(_mm256_cmp_ps(_mm256_and_ps(w_high, magnitude), smallest, _CMP_GE_OQ)) << 8;
    int vectors = last_pair >= 0 && (exact & pair_lanes) == pair_lanes;
    search8_t search = search8(q + 1);
    /* q[2 c], w[2 c] and w[2 c + 1] for c = 0..7: the even and odd lanes of the two halves */
    __m256 a_even = evens8(q_low, q_high), w_even = evens8(w_low, w_high), w_odd = odds8(w_low, w_high);
    __m256i zero = _mm256_setzero_si256(), one = _mm256_set1_epi32(1), fifteen = _mm256_set1_epi32(15);
    __m256 sixteen = _mm256_set1_ps(16.0f), sixteenth = _mm256_set1_ps(0x1p-4f);
    __m256i places = dither_places8(dither_salt(scale)), next_places = _mm256_set1_epi32((int32_t)(8 * DITHER_PLACE));
    quotients_t quotients = encoding_quotients(x, vectors ? bs : 0, exact_divisor(scale));
    for (; vectors && i + 8 <= bs; i += 8, places = _mm256_add_epi32(places, next_places)) {
        __m256 v = next_quotient(&quotients, x, i, bs);
        __m256 nothing = _mm256_sub_ps(v, v);  /* NaN where v is NaN or infinite, else 0 */
        if (_mm256_movemask_ps(_mm256_cmp_ps(nothing, nothing, _CMP_UNORD_Q))) {
            for (int64_t j = i; j < i + 8; j++) encode_stochastic_one(s, x, scale, j, codes, cal);
            continue;
        }
        __m256i low;
        __m256 a, pair_width;
        if (linear) {
            __m256i count = _mm256_max_epi32(_mm256_cvttps_epi32(_mm256_min_ps(_mm256_mul_ps(v, sixteen), sixteen)), zero);
            low = _mm256_sub_epi32(count, one);
            a = _mm256_mul_ps(_mm256_cvtepi32_ps(count), sixteenth), pair_width = w_low;  /* every lane's width: 2**-28 */
        } else {
            __m256i half = count8_odd(&search, v);
            __m256 probed = _mm256_permutevar8x32_ps(search.even, half);  /* q[2 c + 1] */
            __m256 reached = _mm256_cmp_ps(v, probed, _CMP_GE_OQ);
            low = _mm256_sub_epi32(_mm256_add_epi32(half, half), _mm256_castps_si256(reached));
            a = _mm256_blendv_ps(_mm256_permutevar8x32_ps(a_even, half), probed, reached);
            pair_width = _mm256_blendv_ps(_mm256_permutevar8x32_ps(w_even, half), _mm256_permutevar8x32_ps(w_odd, half), reached);
        }
        __m256 up = _mm256_cmp_ps(_mm256_sub_ps(v, a), _mm256_mul_ps(dither_draws8(v, places), pair_width), _CMP_GT_OQ);
        __m256i code = _mm256_sub_epi32(low, _mm256_castps_si256(up));  /* + 1 where up (a mask is -1) */
        if (linear)  /* every code used: below the pairs low is -1 (code 0), above them 15 (code 15) */
            code = _mm256_max_epi32(_mm256_min_epi32(code, fifteen), zero);
        store_low_bytes(codes + i, code);
        if (calibrated) store_products8(cal, i, v, lookup16(q_low, q_high, code));
    }
    return i;
}
#endif

/* 4-bit stochastic codes of the values x / scale in one pass (and a calibrated format's products).
 * For a finite v, encode_stochastic's low is the number of codebook values <= v, less one, whatever
 * v's nearest code is (that is low or low + 1). The vector loops find that number without the
 * nearest code. With AVX-512, by bucket (where the values fit: bucket_count16) or by a binary search
 * over the values in registers, as encode_nearest counts the thresholds: v rounds between low and
 * low + 1 where low is in [0, last_pair] (b a used code); elsewhere (below the codebook, at or above
 * its last used value) the code is max(low, 0). With AVX2, by a search over q[1..15] whose count is
 * low where v is in the codebook and 0 below it (encode_stochastic8). A vector of values with a NaN
 * or an infinity takes the reference. */
static void encode_stochastic4(const state_t *s, const float *restrict x, float scale, int64_t bs, uint8_t *restrict codes, const calibration_t *cal) {
    const float *q = s->codebook;
    int32_t last_pair = 14;
    while (last_pair >= 0 && q[last_pair + 1] != q[last_pair + 1]) last_pair--;  /* unused codes (NaN) at the end */
    /* u * (b - a) is taken as draw * width: u = draw * 2**-24 (dither_draws) and width = (b - a) *
     * 2**-24 per pair, the same real product, so the same rounded one, wherever width is exact (a
     * normal number). For a codebook that holds (pairs 2**-102 apart or closer do not) the vector
     * loops run. */
    uint32_t pair_lanes = last_pair >= 0 ? (2u << last_pair) - 1 : 0;  /* lanes 0 .. last_pair */
    int64_t i = 0;
#ifdef __AVX512F__
    search16_t search = search16(q);  /* over q[0..14]; q[15] apart */
    __m512 values = search.t, q15 = _mm512_set1_ps(q[15]);
    __m512 widths = _mm512_mul_ps(_mm512_sub_ps(search.odd, values), _mm512_set1_ps(0x1p-24f));
    int vectors = last_pair >= 0 && (_mm512_cmp_ps_mask(_mm512_abs_ps(widths), _mm512_set1_ps(FLT_MIN), _CMP_GE_OQ) & pair_lanes) == pair_lanes;
    __m512i zero = _mm512_setzero_si512(), one = _mm512_set1_epi32(1), pairs = _mm512_set1_epi32(last_pair + 1);
    __m512i places = dither_places16(dither_salt(scale)), next_places = _mm512_set1_epi32((int32_t)(16 * DITHER_PLACE));
    /* by buckets (bucket_count16) where the values fit them: then a vector with a value beyond +-1
     * takes the reference, as one with NaN or an infinity does (no step of a codebook that ends at
     * 1, scale_max, gives one: |x| <= the block's absmax) */
    const buckets_t *bucketed = s->value_buckets;
    buckets16_t buckets;
    if (bucketed) buckets = buckets16(bucketed);
    uint32_t limit = bucketed ? bits_of(1.0f) : bits_of(FLT_MAX);  /* the largest magnitude the vector loop takes */
    quotients_t quotients = encoding_quotients(x, vectors ? bs : 0, exact_divisor(scale));
    for (; vectors && i + 16 <= bs; i += 16, places = _mm512_add_epi32(places, next_places)) {
        __m512 v = next_quotient(&quotients, x, i, bs);
        if (vec_magnitude_within(v, 0, limit + 1) != 0xFFFF) {
            for (int64_t j = i; j < i + 16; j++) encode_stochastic_one(s, x, scale, j, codes, cal);
            continue;
        }
        __m512i low;  /* how many values are <= v, less one */
        if (bucketed) {
            low = _mm512_sub_epi32(bucket_count16(&buckets, v), one);
        } else {  /* count16 over q[0..14]; where v reaches q[15], one more */
            __m512i count = count16(&search, v);
            low = _mm512_mask_mov_epi32(_mm512_sub_epi32(count, one), _mm512_cmp_ps_mask(v, q15, _CMP_GE_OQ), count);
        }
        /* a permute reads an index's low 4 bits: outside [0, last_pair], a and its width are never used */
        __m512 a = _mm512_permutexvar_ps(low, values), width = _mm512_permutexvar_ps(low, widths);
        __mmask16 inside = _mm512_cmplt_epu32_mask(low, pairs);
        __mmask16 up = _mm512_mask_cmp_ps_mask(inside, _mm512_sub_ps(v, a), _mm512_mul_ps(dither_draws16(v, places), width), _CMP_GT_OQ);
        __m512i nearest = _mm512_max_epi32(low, zero);
        __m512i code = _mm512_mask_add_epi32(nearest, up, nearest, one);
        _mm_storeu_si128((__m128i *)(codes + i), _mm512_cvtepi32_epi8(code));
        if (cal->vv) store_products(cal, i, v, _mm512_permutexvar_ps(code, values));
    }
#elif defined(AVX2_ONLY)
    __m256 steps = _mm256_setr_ps(1, 2, 3, 4, 5, 6, 7, 8), sixteenth = _mm256_set1_ps(0x1p-4f);  /* q[k] == (k + 1) / 16, exact */
    int linear = (_mm256_movemask_ps(_mm256_cmp_ps(_mm256_loadu_ps(q), _mm256_mul_ps(steps, sixteenth), _CMP_EQ_OQ)) &
                  _mm256_movemask_ps(_mm256_cmp_ps(_mm256_loadu_ps(q + 8), _mm256_mul_ps(_mm256_add_ps(steps, _mm256_set1_ps(8)), sixteenth), _CMP_EQ_OQ))) == 0xFF;
    i = linear ? encode_stochastic8(s, x, scale, bs, codes, cal, last_pair, pair_lanes, 1)
               : encode_stochastic8(s, x, scale, bs, codes, cal, last_pair, pair_lanes, 0);
#endif
    (void)pair_lanes;
    for (; i < bs; i++) encode_stochastic_one(s, x, scale, i, codes, cal);  /* the rest (all of it elsewhere) */
}
