/* The low-rank states' matrix products (lowrank.py, lowrank_products.py) in one summation order:
 *
 *   lowbit_outer            out (rows x cols) = left (rows x rank) @ right (cols x rank).T (or a minuend less it)
 *   lowbit_times            out (rows x rank) = matrix (rows x cols) @ basis (cols x rank)
 *   lowbit_transposed_times out (cols x rank) = matrix (rows x cols).T @ left (rows x rank)
 *
 * Every output is a chain of FMAs over the shared index in increasing order, from +0: acc =
 * fma(a_j, b_j, acc). The vector loops (vector.h) run many such chains side by side, the portable
 * loops the rest with fmaf (correctly rounded, as C99 requires; ordered so that compilers vectorize
 * them across outputs where the target has FMA, and a slow libm call where it has none), so every
 * build gives the same bits, and so does any number of threads (each output is one thread's). The
 * compiled step, the eager step and the fused kernel all take these products on the CPU, so they
 * agree bit for bit; torch's BLAS fixes no order (and on the AMD EPYC of family 26 its MKL ran these
 * skinny shapes on AVX2 kernels, at 2.1-2.9x the AVX-512 loops' time). All arrays are row-major and
 * contiguous; out overlaps no input (lowbit_outer's may be its minuend). Each returns 0, or 1 where
 * memory ran out (lowbit_outer, which packs right; the others allocate nothing). */

/* tiles: rows (outer, times) or columns (transposed_times) held in registers at once, a vector of
 * the other index each (outer: two); rows of a block whose left stays in cache (transposed_times).
 * On the AMD EPYC of family 26, 2 threads, GPT-2-small's matrices at rank 32, against torch's mm:
 * outer's tile of 4 rows 0.57-1.07x its time (AVX2 build 0.96-1.27x), of 6 0.33-0.54x (0.64-0.83x),
 * of 8 no faster than 6 (AVX2 slower: 16 accumulators in 16 registers); transposed_times' of 8
 * columns 0.43-0.52x (0.89-0.96x), of 12 0.36-0.51x (0.71-0.80x); times' the same with 8 or 12. */
#define OUTER_TILE 6
#define TIMES_TILE 8
#define TRANSPOSED_TILE 12
#define TRANSPOSED_BLOCK 256

/* outer reads right in panels of OUTER_PANEL columns, each (rank x OUTER_PANEL) contiguous: a tile
 * then reads one block of memory, not rank rows of a transposed right (which, a multiple of 4 KiB
 * apart, fell into the same cache sets: 768 x 3072 took 2x BLAS's time) */
#ifdef VECTOR_LANES
#define OUTER_PANEL (2 * VECTOR_LANES)
#else
#define OUTER_PANEL 16
#endif

/* `tile` rows of out from r (a constant where it is inlined), one panel: out + i * stride holds row i */
static inline __attribute__((always_inline)) void outer_panel(int tile, const float *restrict left, int64_t r, const float *restrict panel, int64_t rank,
                                                             float *restrict out, int64_t stride) {
#ifdef VECTOR_LANES
    vec_t acc[OUTER_TILE][2];
    for (int i = 0; i < tile; i++) acc[i][0] = acc[i][1] = vec_set1(0.0f);
    for (int64_t k = 0; k < rank; k++) {
        vec_t b0 = vec_load(panel + k * OUTER_PANEL), b1 = vec_load(panel + k * OUTER_PANEL + VECTOR_LANES);
        for (int i = 0; i < tile; i++) {
            vec_t a = vec_set1(left[(r + i) * rank + k]);
            acc[i][0] = vec_fmadd(a, b0, acc[i][0]);
            acc[i][1] = vec_fmadd(a, b1, acc[i][1]);
        }
    }
    for (int i = 0; i < tile; i++) {
        vec_store(out + i * stride, acc[i][0]);
        vec_store(out + i * stride + VECTOR_LANES, acc[i][1]);
    }
#else  /* compilers vectorize the panel's columns */
    for (int i = 0; i < tile; i++) {
        float acc[OUTER_PANEL] = {0};
        for (int64_t k = 0; k < rank; k++) {
            float a = left[(r + i) * rank + k];
            for (int j = 0; j < OUTER_PANEL; j++) acc[j] = fmaf(a, panel[k * OUTER_PANEL + j], acc[j]);
        }
        memcpy(out + i * stride, acc, sizeof(acc));
    }
#endif
}

/* rows r0.. (tile of them, a constant where it is inlined), every panel: into out directly, or
 * through a buffer where the panel is the last, partial one or a minuend takes the product (out =
 * minuend - product; minuend may be out itself) */
static inline __attribute__((always_inline)) void outer_rows(int tile, const float *left, int64_t r0, const float *packed, int64_t cols, int64_t rank,
                                                            const float *minuend, float *out) {
    for (int64_t c = 0; c < cols; c += OUTER_PANEL) {
        const float *panel = packed + c * rank;  /* panel c / OUTER_PANEL */
        int64_t width = cols - c < OUTER_PANEL ? cols - c : OUTER_PANEL;
        if (!minuend && width == OUTER_PANEL) {
            outer_panel(tile, left, r0, panel, rank, out + r0 * cols + c, cols);
            continue;
        }
        float part[OUTER_TILE * OUTER_PANEL];
        outer_panel(tile, left, r0, panel, rank, part, OUTER_PANEL);
        for (int i = 0; i < tile; i++) {
            float *row = out + (r0 + i) * cols + c;
            const float *product = part + i * OUTER_PANEL;
            if (minuend) {
                const float *from = minuend + (r0 + i) * cols + c;
                for (int64_t j = 0; j < width; j++) row[j] = from[j] - product[j];
            } else {
                memcpy(row, product, (size_t)width * sizeof(float));
            }
        }
    }
}

/* out = left @ right.T, or with a minuend (NULL: none) out = minuend - left @ right.T: a low-rank
 * state's residual, in place where minuend is out */
int lowbit_outer(const float *left, const float *right, int64_t rows, int64_t cols, int64_t rank, const float *minuend, float *out, int threads) {
    int64_t panels = (cols + OUTER_PANEL - 1) / OUTER_PANEL;
    float *packed = calloc((size_t)(panels * rank > 0 ? panels * rank : 1) * OUTER_PANEL, sizeof(float));  /* zeros past the last column */
    if (!packed) return 1;
    for (int64_t c = 0; c < cols; c++)
        for (int64_t k = 0; k < rank; k++) packed[((c / OUTER_PANEL) * rank + k) * OUTER_PANEL + c % OUTER_PANEL] = right[c * rank + k];
    #pragma omp parallel for schedule(static) num_threads(threads)
    for (int64_t r0 = 0; r0 < rows; r0 += OUTER_TILE) {
        if (rows - r0 >= OUTER_TILE)
            outer_rows(OUTER_TILE, left, r0, packed, cols, rank, minuend, out);
        else
            for (int64_t r = r0; r < rows; r++) outer_rows(1, left, r, packed, cols, rank, minuend, out);
    }
    free(packed);
    return 0;
}

/* how many of the rank's columns times and transposed_times take by vectors (the rest, all of them
 * in portable builds, by the loops compilers vectorize) */
static inline int64_t vector_columns(int64_t rank) {
#ifdef VECTOR_LANES
    return rank - rank % VECTOR_LANES;
#else
    (void)rank;
    return 0;
#endif
}

#ifdef VECTOR_LANES
/* times for `tile` rows from r (a constant where it is inlined), the rank's vector at k */
static inline __attribute__((always_inline)) void times_block(int tile, const float *restrict matrix, const float *restrict basis, int64_t r, int64_t k,
                                                              int64_t cols, int64_t rank, float *restrict out) {
    vec_t acc[TIMES_TILE];
    for (int i = 0; i < tile; i++) acc[i] = vec_set1(0.0f);
    for (int64_t c = 0; c < cols; c++) {
        vec_t b = vec_load(basis + c * rank + k);
        for (int i = 0; i < tile; i++) acc[i] = vec_fmadd(vec_set1(matrix[(r + i) * cols + c]), b, acc[i]);
    }
    for (int i = 0; i < tile; i++) vec_store(out + (r + i) * rank + k, acc[i]);
}
#endif

int lowbit_times(const float *matrix, const float *basis, int64_t rows, int64_t cols, int64_t rank, float *out, int threads) {
    int64_t vectors = vector_columns(rank);
    #pragma omp parallel for schedule(static) num_threads(threads)
    for (int64_t r0 = 0; r0 < rows; r0 += TIMES_TILE) {
        int64_t tile = rows - r0 < TIMES_TILE ? rows - r0 : TIMES_TILE;
#ifdef VECTOR_LANES
        for (int64_t k = 0; k < vectors; k += VECTOR_LANES) {
            if (tile == TIMES_TILE)
                times_block(TIMES_TILE, matrix, basis, r0, k, cols, rank, out);
            else
                for (int64_t r = r0; r < r0 + tile; r++) times_block(1, matrix, basis, r, k, cols, rank, out);
        }
#endif
        for (int64_t r = r0; r < r0 + tile; r++) {  /* the rest of the rank's columns, which compilers vectorize */
            float *restrict row = out + r * rank;
            for (int64_t k = vectors; k < rank; k++) row[k] = 0.0f;
            for (int64_t c = 0; c < cols; c++) {
                float a = matrix[r * cols + c];
                const float *restrict b = basis + c * rank;
                for (int64_t k = vectors; k < rank; k++) row[k] = fmaf(a, b[k], row[k]);
            }
        }
    }
    return 0;
}

#ifdef VECTOR_LANES
/* transposed_times for `tile` columns from c (a constant where it is inlined), the rank's vector at
 * k, rows r0..r1-1 added to the sums so far (first: from +0) */
static inline __attribute__((always_inline)) void transposed_block(int tile, const float *restrict matrix, const float *restrict left, int64_t c,
                                                                   int64_t k, int64_t r0, int64_t r1, int first, int64_t cols, int64_t rank,
                                                                   float *restrict out) {
    vec_t acc[TRANSPOSED_TILE];
    for (int i = 0; i < tile; i++) acc[i] = first ? vec_set1(0.0f) : vec_load(out + (c + i) * rank + k);
    for (int64_t r = r0; r < r1; r++) {
        vec_t b = vec_load(left + r * rank + k);
        for (int i = 0; i < tile; i++) acc[i] = vec_fmadd(vec_set1(matrix[r * cols + c + i]), b, acc[i]);
    }
    for (int i = 0; i < tile; i++) vec_store(out + (c + i) * rank + k, acc[i]);
}
#endif

/* by blocks of rows, so that the block's part of left stays in cache while every column takes it;
 * each column's sums continue from block to block in order, the same thread's (static schedule) */
int lowbit_transposed_times(const float *matrix, const float *left, int64_t rows, int64_t cols, int64_t rank, float *out, int threads) {
    int64_t vectors = vector_columns(rank);
    if (rows == 0)
        for (int64_t i = 0; i < cols * rank; i++) out[i] = 0.0f;
    #pragma omp parallel num_threads(threads)
    for (int64_t r0 = 0; r0 < rows; r0 += TRANSPOSED_BLOCK) {
        int64_t r1 = rows - r0 < TRANSPOSED_BLOCK ? rows : r0 + TRANSPOSED_BLOCK;
        int first = r0 == 0;
        #pragma omp for schedule(static)
        for (int64_t c0 = 0; c0 < cols; c0 += TRANSPOSED_TILE) {
            int64_t tile = cols - c0 < TRANSPOSED_TILE ? cols - c0 : TRANSPOSED_TILE;
#ifdef VECTOR_LANES
            for (int64_t k = 0; k < vectors; k += VECTOR_LANES) {
                if (tile == TRANSPOSED_TILE)
                    transposed_block(TRANSPOSED_TILE, matrix, left, c0, k, r0, r1, first, cols, rank, out);
                else
                    for (int64_t c = c0; c < c0 + tile; c++) transposed_block(1, matrix, left, c, k, r0, r1, first, cols, rank, out);
            }
#endif
            if (first)
                for (int64_t c = c0; c < c0 + tile; c++)
                    for (int64_t k = vectors; k < rank; k++) out[c * rank + k] = 0.0f;
            for (int64_t r = r0; r < r1; r++)  /* the rest of the rank's columns, which compilers vectorize */
                for (int64_t c = c0; c < c0 + tile; c++) {
                    float a = matrix[r * cols + c];
                    const float *restrict b = left + r * rank;
                    float *restrict sums = out + c * rank;
                    for (int64_t k = vectors; k < rank; k++) sums[k] = fmaf(a, b[k], sums[k]);
                }
        }
    }
    return 0;
}
