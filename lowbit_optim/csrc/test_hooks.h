/* Entry points for the tests (test_fused_cpu.py): the codecs and the division on their own. */

/* The elements of each chunk the scheduler cuts t into (chunk_size). */
int64_t lowbit_chunk_size(const param_t *t) { return chunk_size(t); }

/* The values of a state's first n elements as load_state decodes them. */
void lowbit_decode(const state_t *s, int64_t n, float *out) {
    float *values = load_state(s, 0, n, out);
    if (values != out) memcpy(out, values, n * sizeof(float));
}

/* The codes encode_block gives n normalized values (one byte each; scale 1). */
void lowbit_encode(const state_t *s, const float *v, int64_t n, uint8_t *codes) {
    calibration_t none = {NULL, NULL, NULL};
    encode_block(s, v, 1.0f, n, codes, &none);
}

/* The codes and scales a step stores for the n values x of elements start.. (n <= MAX_CHUNK; x has
 * room up to the next block boundary and is overwritten), written into s's data and scale. */
void lowbit_quantize(const state_t *s, float *x, int64_t start, int64_t n) { store_state(s, start, n, x, NULL); }

/* out[i] = a[i] / b, divided as the kernel divides by a block's scale, or (root) as Adam's update
 * divides square roots by sqrt(1 - beta2**t). */
void lowbit_divide(const float *a, int64_t n, float b, int root, float *out) {
    int64_t i = 0;
#ifdef VECTOR_LANES
    divisor_t d = exact_divisor(b);
    int ready = root && root_ready(&d);
    for (; i + VECTOR_LANES <= n; i += VECTOR_LANES) {
        vec_t x = vec_load(a + i);
        vec_store(out + i, root ? divide_root(x, &d, ready) : divide(x, &d));
    }
#endif
    (void)root;
    for (; i < n; i++) out[i] = a[i] / b;
}
