/* Stochastic rounding (quant.dither, quant.encode_stochastic): a second pass over a block's nearest
 * codes. Each value goes to one of the two codes around it, the upper one with probability
 * (v - a) / (b - a), drawn from a hash of its bits and its place in the block: the compiled step's
 * codes exactly, in each of the three paths. */
#ifndef DITHER_DROPPED_BITS
#error "build with -DDITHER_DROPPED_BITS=<quant.DITHER_DROPPED_BITS>, as kernel_build.py does (the hash must stay quant.dither's)"
#endif


/* quant.dither for value v at place j of its block: the Python's int64 arithmetic masked to 32 bits
 * is uint32 arithmetic. The top 24 bits of the hash, a number in [0, 1) exact in fp32 (converted as
 * int32: AVX2 has no unsigned conversion). */
static inline float dither(float v, uint32_t j) {
    uint32_t h = (bits_of(v) >> DITHER_DROPPED_BITS) ^ (j * 0x61C88647u);
    h ^= h >> 16;
    h *= 0x7FEB352Du;
    h ^= h >> 15;
    h *= 0x5BD1E995u;
    h ^= h >> 16;
    return (float)(int32_t)(h >> 8) * 0x1p-24f;
}

/* quant.encode_stochastic over a block of normalized values v whose nearest codes are in codes: low
 * is the code at or below v, (a, b) the pair of codes around it; up where (v - a) > u * (b - a).
 * Outside the codebook's range, next to an unused (NaN) code, and for NaN, the nearest code stays. */
static void round_stochastically(const state_t *s, const float *restrict v_in, int64_t bs, uint8_t *restrict codes) {
    const float *q = s->codebook;
    int32_t top = (1 << s->bits) - 2;  /* the last pair's lower code */
    int64_t i = 0;
#ifdef __AVX512F__
    if (s->bits == 4) {  /* the loop below, with the 16 code values in a register: permutes, not gathers */
        __m512 values = _mm512_loadu_ps(q);
        __m512i one = _mm512_set1_epi32(1), last = _mm512_set1_epi32(top);
        __m512i lanes = _mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
        for (; i + 16 <= bs; i += 16) {
            __m512 v = _mm512_loadu_ps(v_in + i);
            __m512i k = _mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i *)(codes + i)));
            __m512i low = _mm512_mask_sub_epi32(k, _mm512_cmp_ps_mask(_mm512_permutexvar_ps(k, values), v, _CMP_GT_OQ), k, one);
            __m512i pair = _mm512_min_epi32(_mm512_max_epi32(low, _mm512_setzero_si512()), last);
            __m512 a = _mm512_permutexvar_ps(pair, values), b = _mm512_permutexvar_ps(_mm512_add_epi32(pair, one), values);
            /* dither(v, j) */
            __m512i j = _mm512_add_epi32(_mm512_set1_epi32((int32_t)i), lanes);
            __m512i h = _mm512_xor_si512(_mm512_srli_epi32(_mm512_castps_si512(v), DITHER_DROPPED_BITS), _mm512_mullo_epi32(j, _mm512_set1_epi32(0x61C88647)));
            h = _mm512_xor_si512(h, _mm512_srli_epi32(h, 16));
            h = _mm512_mullo_epi32(h, _mm512_set1_epi32(0x7FEB352D));
            h = _mm512_xor_si512(h, _mm512_srli_epi32(h, 15));
            h = _mm512_mullo_epi32(h, _mm512_set1_epi32(0x5BD1E995));
            h = _mm512_xor_si512(h, _mm512_srli_epi32(h, 16));
            __m512 u = _mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_srli_epi32(h, 8)), _mm512_set1_ps(0x1p-24f));
            __mmask16 up = _mm512_cmp_ps_mask(_mm512_sub_ps(v, a), _mm512_mul_ps(u, _mm512_sub_ps(b, a)), _CMP_GT_OQ);
            __mmask16 inside = _mm512_cmpeq_epi32_mask(low, pair) & _mm512_cmp_ps_mask(b, b, _CMP_ORD_Q);
            __m512i code = _mm512_mask_mov_epi32(k, inside, _mm512_mask_add_epi32(pair, up, pair, one));
            _mm_storeu_si128((__m128i *)(codes + i), _mm512_cvtepi32_epi8(code));
        }
    }
#elif defined(AVX2_ONLY)
    if (s->bits == 4) {  /* the same on 8 lanes: lookup16 for the code values */
        __m256 q_low = _mm256_loadu_ps(q), q_high = _mm256_loadu_ps(q + 8);
        __m256i one = _mm256_set1_epi32(1), last = _mm256_set1_epi32(top), lanes = _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7);
        for (; i + 8 <= bs; i += 8) {
            __m256 v = _mm256_loadu_ps(v_in + i);
            __m256i k = _mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i *)(codes + i)));
            __m256 above = _mm256_cmp_ps(lookup16(q_low, q_high, k), v, _CMP_GT_OQ);
            __m256i low = _mm256_add_epi32(k, _mm256_castps_si256(above));  /* k - 1 where above */
            __m256i pair = _mm256_min_epi32(_mm256_max_epi32(low, _mm256_setzero_si256()), last);
            __m256 a = lookup16(q_low, q_high, pair), b = lookup16(q_low, q_high, _mm256_add_epi32(pair, one));
            /* dither(v, j) */
            __m256i j = _mm256_add_epi32(_mm256_set1_epi32((int32_t)i), lanes);
            __m256i h = _mm256_xor_si256(_mm256_srli_epi32(_mm256_castps_si256(v), DITHER_DROPPED_BITS), _mm256_mullo_epi32(j, _mm256_set1_epi32(0x61C88647)));
            h = _mm256_xor_si256(h, _mm256_srli_epi32(h, 16));
            h = _mm256_mullo_epi32(h, _mm256_set1_epi32(0x7FEB352D));
            h = _mm256_xor_si256(h, _mm256_srli_epi32(h, 15));
            h = _mm256_mullo_epi32(h, _mm256_set1_epi32(0x5BD1E995));
            h = _mm256_xor_si256(h, _mm256_srli_epi32(h, 16));
            __m256 u = _mm256_mul_ps(_mm256_cvtepi32_ps(_mm256_srli_epi32(h, 8)), _mm256_set1_ps(0x1p-24f));
            __m256 up = _mm256_cmp_ps(_mm256_sub_ps(v, a), _mm256_mul_ps(u, _mm256_sub_ps(b, a)), _CMP_GT_OQ);
            __m256i inside = _mm256_and_si256(_mm256_cmpeq_epi32(low, pair), _mm256_castps_si256(_mm256_cmp_ps(b, b, _CMP_ORD_Q)));
            __m256i moved = _mm256_sub_epi32(pair, _mm256_castps_si256(up));  /* pair + 1 where up */
            store_low_bytes(codes + i, _mm256_blendv_epi8(k, moved, inside));
        }
    }
#endif
    for (int64_t j = i; j < bs; j++) {  /* compilers vectorize it (gathers where the target has them) */
        float v = v_in[j];
        int32_t k = codes[j];
        int32_t low = k - (q[k] > v);
        int32_t pair = low < 0 ? 0 : low;  /* clamped in two steps: GCC then vectorizes the loop */
        pair = pair > top ? top : pair;
        float a = q[pair], b = q[pair + 1];
        int32_t up = (v - a) > dither(v, (uint32_t)j) * (b - a);
        /* inside: low in [0, top] and b a used code; a mask, as a ternary keeps GCC's loop scalar */
        uint32_t inside = (0u - (low == pair)) & (0u - (b == b));
        codes[j] = (uint8_t)(k + ((pair + up - k) & inside));
    }
}

