/* Whether gathers are slow on the core the kernel is built for (SLOW_GATHERS), and the AVX2 build's
 * table lookups by 8 indices: a gather instruction, or scalar loads where gathers are slow.
 * AMD's cores microcode their gathers: on an AMD EPYC of family 26 (Zen 5) an 8-lane gather from an
 * L1-resident table took 0.36 ns per element, eight scalar loads put into a vector 0.16-0.23, and
 * the AVX2 build's 8-bit step 6.0 -> 4.6x fused AdamW with them (one thread, GPT-2-small set). With
 * AVX-512 sixteen scalar loads made the 8-bit step slower (3.5 -> 4.1x); there the kernel encodes
 * 8-bit codes without any lookup where gathers are slow (affine.h). Intel's cores gather faster, and
 * the kernel's figures on them were measured with gathers. The compiler's tuning says which core it
 * builds for (GCC and Clang define __znverN__ for AMD's under -march=native); -DSLOW_GATHERS=0 or 1
 * decides otherwise, and the tests build both. Either way the same values. */
#ifndef SLOW_GATHERS
#if defined(__znver1__) || defined(__znver2__) || defined(__znver3__) || defined(__znver4__) || defined(__znver5__)
#define SLOW_GATHERS 1
#else
#define SLOW_GATHERS 0
#endif
#endif

#ifdef AVX2_ONLY
/* the 4-byte entries of table at 8 indices (memcpy: the table may hold floats) */
static inline __m256i lookup8(const void *table, __m256i idx) {
#if SLOW_GATHERS
    /* the indices moved out two at a time (four moves, not eight extractions or a store and eight
     * reloads: storing an 8-bit moment 0.44 -> 0.36 ns per element on that EPYC) */
    __m128i low = _mm256_castsi256_si128(idx), high = _mm256_extracti128_si256(idx, 1);
    uint64_t pair[4] = {(uint64_t)_mm_cvtsi128_si64(low), (uint64_t)_mm_extract_epi64(low, 1), (uint64_t)_mm_cvtsi128_si64(high),
                        (uint64_t)_mm_extract_epi64(high, 1)};
    int32_t v[8];
    for (int j = 0; j < 8; j++) memcpy(&v[j], (const char *)table + 4 * ((pair[j / 2] >> (32 * (j % 2))) & 0xFFFFFFFFu), 4);
    return _mm256_setr_epi32(v[0], v[1], v[2], v[3], v[4], v[5], v[6], v[7]);
#else
    return _mm256_i32gather_epi32((const int *)table, idx, 4);
#endif
}

static inline __m256 lookup8_ps(const float *table, __m256i idx) { return _mm256_castsi256_ps(lookup8(table, idx)); }

/* table[codes[0..7]] for 8 byte codes */
static inline __m256 lookup8_ps_by_bytes(const float *table, const uint8_t *codes) {
#if SLOW_GATHERS
    uint64_t c;  /* one load of the 8 codes, not 8 */
    memcpy(&c, codes, 8);
    return _mm256_setr_ps(table[c & 255], table[(c >> 8) & 255], table[(c >> 16) & 255], table[(c >> 24) & 255], table[(c >> 32) & 255],
                          table[(c >> 40) & 255], table[(c >> 48) & 255], table[c >> 56]);
#else
    return _mm256_i32gather_ps(table, _mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i *)codes)), 4);
#endif
}
#endif
