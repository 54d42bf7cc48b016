/* One chunk of a parameter, gradient or state as fp32 values, whatever its kind: loaded before the
 * update (in place where it is fp32, converted or decoded into a buffer otherwise) and stored after
 * it (converted or encoded back). */

/* A parameter's, gradient's or plain state's n values as fp32: in place, or converted from bf16
 * into buffer. */
static float *load_values(int32_t kind, const void *src, int64_t start, int64_t n, float *buffer) {
    if (kind == KIND_F32) return (float *)src + start;
    const uint16_t *h = (const uint16_t *)src + start;
    for (int64_t i = 0; i < n; i++) buffer[i] = bf16_to_f32(h[i]);
    return buffer;
}

static void store_values(int32_t kind, void *dst, int64_t start, int64_t n, const float *x) {
    if (kind == KIND_F32) return;  /* updated in place */
    uint16_t *h = (uint16_t *)dst + start;
    int64_t i = 0;
#ifdef VECTOR_LANES  /* GCC vectorizes the loop too, but with three packs per 16 values: AMD EPYC of family 26, 1 thread, 0.15 -> 0.11 ns per value (AVX2 build), 0.073 -> 0.063 (AVX-512) */
    for (; i + VECTOR_LANES <= n; i += VECTOR_LANES) vec_store_bf16(h + i, vec_load(x + i));
#endif
    for (; i < n; i++) h[i] = f32_to_bf16(x[i]);
}

/* A parameter's n values as fp32 (load_values), plus its int8-correction where it has one
 * (precision.read_param): the rounding error of the bf16 value in 1/254 of its ulp. */
static float *load_param(const param_t *t, int64_t start, int64_t n, float *buffer) {
    float *p = load_values(t->param_kind, t->param, start, n, buffer);
    if (t->correction) {
        const int8_t *c = t->correction + start;
        for (int64_t i = 0; i < n; i++) p[i] = p[i] + (float)c[i] * (bf16_ulp(p[i]) / CORRECTION_UNITS_PER_ULP);
    }
    return p;
}

/* A bf16 parameter's n values x rounded to bf16 (as f32_to_bf16) and their int8-correction (as
 * store_param), in one pass and without a division, for a chunk with no tiny weight (nonzero and
 * below 2**-113, a bf16 value: so every rounded weight has E >= 14). x - rounded has at most 17
 * significant bits, so it times 254 times 1 / ulp = 2**(134 - E) (E: the rounded weight's exponent
 * field) is exact, as the reference's two steps are; their product is 254 with 134 - E added to its
 * exponent, a finite number for E >= 14 (exponent field 268 - E). A zero, subnormal or non-finite
 * rounded weight (E = 0 or 255) gets 0; so does a NaN, whose bits plus the rounding increment
 * always land on E = 0 or 255. */
static void store_bf16_and_correction(uint16_t *restrict h, int8_t *restrict c, int64_t n, const float *restrict x) {
    const uint32_t scale = bits_of(CORRECTION_UNITS_PER_ULP) + (134u << 23);
    for (int64_t i = 0; i < n; i++) {
        /* f32_to_bf16's rounding, its NaN select left to the store: calling it here made the whole
         * AVX2 step 10 % slower (0.90 -> 0.99 ns per element, bf16 states) */
        uint32_t u = bits_of(x[i]), kept = (u + 0x7FFFu + ((u >> 16) & 1u)) & 0xFFFF0000u;
        uint32_t exponent = kept & 0x7F800000u;
        float units = rintf((x[i] - float_of(kept)) * float_of(scale - exponent));
        uint32_t finite_nonzero = 0u - (exponent - (1u << 23) < (254u << 23));  /* a mask: GCC keeps a ?: here scalar */
        c[i] = (int8_t)(int32_t)float_of(bits_of(units) & finite_nonzero);
        h[i] = (uint16_t)(x[i] == x[i] ? kept >> 16 : 0x7FC0u);  /* NaN: f32_to_bf16's */
    }
}

/* Whether some of the n values x is nonzero with a magnitude below the one whose fp32 bits are
 * below: a min reduction that compilers vectorize (magnitude - 1: a zero wraps to the largest) */
static int any_nonzero_below(const float *x, int64_t n, uint32_t below) {
    uint32_t least = UINT32_MAX;
    for (int64_t i = 0; i < n; i++) {
        uint32_t a = (bits_of(x[i]) & 0x7FFFFFFFu) - 1;
        least = a < least ? a : least;
    }
    return least < below - 1;
}

/* Stores what load_param gave: the parameter rounded to its kind, and where it has an
 * int8-correction, the new rounding error (precision.write_param). On an AMD EPYC of family 26,
 * one thread, a chunk in L1: 0.55 ns per element through the division below and store_values,
 * 0.30 through store_bf16_and_correction (AVX2 build; AVX-512 0.21 -> 0.15). */
static void store_param(const param_t *t, int64_t start, int64_t n, const float *x) {
    if (t->correction && t->param_kind == KIND_BF16 && !any_nonzero_below(x, n, 14u << 23)) {
        store_bf16_and_correction((uint16_t *)t->param + start, t->correction + start, n, x);
        return;
    }
    if (t->correction) {
        int8_t *c = t->correction + start;
        for (int64_t i = 0; i < n; i++) {
            float rounded = bf16_to_f32(f32_to_bf16(x[i])), ulp = bf16_ulp(rounded);
            float units = rintf((x[i] - rounded) / ulp * CORRECTION_UNITS_PER_ULP);
            /* a zero or subnormal weight keeps no correction; a non-finite one gets 0, as torch's
             * float -> int8 gives (the units of a finite weight lie in [-127, 127]) */
            c[i] = (int8_t)(ulp > 0.0f && units == units ? (int32_t)units : 0);
        }
    }
    store_values(t->param_kind, t->param, start, n, x);
}

/* The chunk's n values of a state: fp32 states in place, the others decoded into buffer. */
static float *load_state(const state_t *s, int64_t start, int64_t n, float *buffer) {
    if (s->kind == KIND_F32 || s->kind == KIND_BF16) return load_values(s->kind, s->data, start, n, buffer);
    if (s->kind == KIND_BF16_SR) return load_values(KIND_BF16, s->data, start, n, buffer);
    if (s->kind == KIND_FACTORED) {
        load_factored(s, start, n, buffer);
        return buffer;
    }
    if (s->kind == KIND_BLOCK_FLOAT) {
        load_block_float(s, start, n, buffer);
        return buffer;
    }
    int64_t bs = s->block_size, b = 0;
    const float *codebook = s->kind == KIND_E4M3 ? e4m3_values : s->codebook;
    const uint8_t *value_bytes = s->kind == KIND_E4M3 ? e4m3_value_bytes : s->value_bytes;
#if defined(__AVX512F__) && defined(__AVX512VBMI__) && defined(__AVX512BW__)
    if (s->bits == 8 && bs >= 4 && bs < 64)  /* chunks start on a block: so do the codes it leaves */
        b = decode_short_blocks((const uint8_t *)s->data + start, value_bytes, s->scale + start / bs, bs, n, buffer) / bs;
#endif
    for (; b * bs < n; b++) {
        int64_t first = start + b * bs;
        int64_t m = n - b * bs < bs ? n - b * bs : bs;
        const uint8_t *c = (const uint8_t *)s->data + (s->bits == 8 ? first : first / 2);
        decode_block(c, s->bits, codebook, value_bytes, s->scale[first / bs], m, buffer + b * bs);
    }
    if (s->addend) {  /* the part outside the codes (LowRankState.dequantize: decoded + low-rank part) */
        const float *a = s->addend + start;
        for (int64_t i = 0; i < n; i++) buffer[i] = buffer[i] + a[i];
    }
    return buffer;
}

/* Writes back what load_state gave (nothing to do for fp32 states, updated in place; a state with an
 * addend gets its new values there, unencoded). x holds the chunk's n values and room up to the next
 * block boundary (zero-padded here, as the compiled step pads the last block); it is overwritten.
 * col_sums: a factored state's running column sums of the chunk's task. */
static void store_state(const state_t *s, int64_t start, int64_t n, float *x, double *col_sums) {
    if (s->addend) {  /* the format finishes the write (StateTensor.kernel_residual) */
        memcpy(s->addend + start, x, (size_t)n * sizeof(float));
        return;
    }
    if (s->kind == KIND_F32 || s->kind == KIND_BF16) {
        store_values(s->kind, s->data, start, n, x);
        return;
    }
    if (s->kind == KIND_FACTORED) {
        store_factored(s, start, n, x, col_sums);
        return;
    }
    if (s->kind == KIND_BF16_SR) {
        store_bf16_stochastic((uint16_t *)s->data, start, n, x, *s->writes);
        return;
    }
    int64_t bs = s->block_size;
    int64_t padded = (n + bs - 1) / bs * bs;
    for (int64_t i = n; i < padded; i++) x[i] = 0.0f;
    if (s->kind == KIND_BLOCK_FLOAT) {
        store_block_float(s, start, padded, x);
        return;
    }
    uint8_t codes[MAX_CHUNK];
    double vv[s->calibrated ? bs : 1], vq[s->calibrated ? bs : 1];
    calibration_t cal = {s->calibrated ? vv : NULL, s->calibrated ? vq : NULL, s->kind == KIND_E4M3 ? e4m3_values : s->codebook};
    /* every block's scale first: the encoding loops then never wait on a block's scalar work */
    float scales[MAX_CHUNK];  /* blocks of 1 element are possible (8-bit codes) */
    for (int64_t b = 0; b * bs < padded; b++) scales[b] = block_scale(x + b * bs, bs, s->scale_max, s->scale_min);
    uint8_t *dst = s->bits == 8 ? (uint8_t *)s->data + start : codes;
    for (int64_t b = 0; b * bs < padded; b++) {
        encode_block(s, x + b * bs, scales[b], bs, dst + b * bs, &cal);
        if (s->zero_code >= 0) floor_positive(s, x + b * bs, scales[b], bs, dst + b * bs, &cal);
        s->scale[(start + b * bs) / bs] = cal.vv ? calibrated_scale(&cal, scales[b], bs) : scales[b];
    }
    if (s->bits == 4) {
        uint8_t *packed = (uint8_t *)s->data + start / 2;
        for (int64_t i = 0; i < padded / 2; i++) packed[i] = (uint8_t)((codes[2 * i] << 4) | codes[2 * i + 1]);
    }
}
