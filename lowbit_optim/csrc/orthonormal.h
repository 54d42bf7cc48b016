/* The low-rank states' QR (lowrank.py's subspace iteration), in one order:
 *
 *   lowbit_orthonormal  q (rows x rank) = the Q of a QR of a (rows x rank), rows >= rank
 *
 * A tall-skinny QR: the rows in leaves of LEAF_ROWS (the last takes the rest), each leaf's QR by
 * Householder reflections, then the QR of the leaves' R stacked (the same function, so a tree), and
 * each leaf's reflections applied to its block of that QR's Q. A leaf is one thread's from start to
 * end, and which rows make a leaf depends on the shape alone, so every thread count gives the same
 * bits; the loops are written portably (fmaf, squares summed in double), so every build does too.
 * LAPACK's QR (torch.linalg.qr) fixes neither: on the AMD EPYC of family 26 a 600 x 32 QR differed
 * between 1 and 2 threads. The columns' signs may differ from LAPACK's; a low-rank state uses only
 * the span. All arrays are row-major and contiguous. Returns 0; 1 where memory ran out; -1 where
 * rows < rank (nothing written). */

#define LEAF_ROWS 256
#define QR_CHUNK 16  /* columns a reflection takes at once: one AVX-512 vector, two AVX2 ones */

/* A reflection H = I - tau u u^T (u: 1 at row j, v[i] at rows i > j) applied to columns k0.. of x
 * (m x r): w = tau u^T x, then x -= u w. By chunks of QR_CHUNK columns. u^T x is x's row j plus
 * SPLIT running sums, sum p of rows j + 1 + p, j + 1 + p + SPLIT, ... (a chain of FMAs each, in
 * order, so that they overlap), finished as (s0 + s1) + (s2 + s3). mask[k] is 0 for a column the
 * reflection leaves alone (its w then 0: x + -v * 0, itself but for a zero's sign). */
#define SPLIT 4

#ifdef VECTOR_LANES
/* reflect's sums and update for n vectors of columns from c (a constant where it is inlined) */
static inline __attribute__((always_inline)) void reflect_vectors(int n, const float *restrict v, float tau, int64_t j, int64_t c,
                                                                 const float *restrict mask, float *restrict x, int64_t m, int64_t r) {
    vec_t sums[SPLIT][2 * QR_CHUNK / VECTOR_LANES], w[2 * QR_CHUNK / VECTOR_LANES];
    for (int p = 0; p < SPLIT; p++)
        for (int l = 0; l < n; l++) sums[p][l] = vec_set1(0.0f);
    int64_t i = j + 1;
    for (; i + SPLIT <= m; i += SPLIT)
        for (int p = 0; p < SPLIT; p++)
            for (int l = 0; l < n; l++) sums[p][l] = vec_fmadd(vec_set1(v[i + p]), vec_load(x + (i + p) * r + c + l * VECTOR_LANES), sums[p][l]);
    for (int p = 0; i < m; i++, p++)
        for (int l = 0; l < n; l++) sums[p][l] = vec_fmadd(vec_set1(v[i]), vec_load(x + i * r + c + l * VECTOR_LANES), sums[p][l]);
    for (int l = 0; l < n; l++) {
        vec_t below = vec_add(vec_add(sums[0][l], sums[1][l]), vec_add(sums[2][l], sums[3][l]));
        vec_t top = vec_load(x + j * r + c + l * VECTOR_LANES);
        w[l] = vec_mul(vec_mul(vec_add(top, below), vec_set1(tau)), vec_load(mask + c + l * VECTOR_LANES));
        vec_store(x + j * r + c + l * VECTOR_LANES, vec_sub(top, w[l]));
    }
    for (i = j + 1; i < m; i++) {
        vec_t vi = vec_set1(v[i]);
        for (int l = 0; l < n; l++) vec_store(x + i * r + c + l * VECTOR_LANES, vec_fnmadd(vi, w[l], vec_load(x + i * r + c + l * VECTOR_LANES)));
    }
}
#endif

static void reflect(const float *restrict v, float tau, int64_t j, int64_t k0, const float *restrict mask, float *restrict x, int64_t m, int64_t r) {
    for (int64_t c = k0; c < r; c += QR_CHUNK) {
        int64_t width = r - c < QR_CHUNK ? r - c : QR_CHUNK;
#ifdef VECTOR_LANES
        /* the same operations by vectors (compilers leave these loops scalar); with AVX-512, two
         * chunks a pass where they are whole (8 sums in registers: AVX2's 16 would not fit) */
        if (VECTOR_LANES == QR_CHUNK && r - c >= 2 * QR_CHUNK) {
            reflect_vectors(2, v, tau, j, c, mask, x, m, r);
            c += QR_CHUNK;
            continue;
        }
        if (width == QR_CHUNK) {
            reflect_vectors(QR_CHUNK / VECTOR_LANES, v, tau, j, c, mask, x, m, r);
            continue;
        }
#endif
        float sums[SPLIT][QR_CHUNK] = {{0}}, w[QR_CHUNK];
        for (int64_t i = j + 1; i < m; i++)
            for (int64_t l = 0; l < width; l++) sums[(i - j - 1) % SPLIT][l] = fmaf(v[i], x[i * r + c + l], sums[(i - j - 1) % SPLIT][l]);
        for (int64_t l = 0; l < width; l++) {
            float top = x[j * r + c + l];
            w[l] = (top + ((sums[0][l] + sums[1][l]) + (sums[2][l] + sums[3][l]))) * tau * mask[c + l];
            x[j * r + c + l] = top - w[l];
        }
        for (int64_t i = j + 1; i < m; i++)
            for (int64_t l = 0; l < width; l++) x[i * r + c + l] = fmaf(-v[i], w[l], x[i * r + c + l]);
    }
}

/* Householder QR of a (m x r) block, m >= r, in place: R on and above the diagonal, reflection j's
 * vector below it and its factor in tau[j]. A column already zero below the diagonal takes no
 * reflection (tau 0), as in LAPACK. Scratch: v (m floats), mask (r floats). */
static void householder_leaf(float *restrict a, int64_t m, int64_t r, float *restrict tau, float *restrict v, float *restrict mask) {
    for (int64_t j = 0; j < r; j++) {
        /* the squares below the diagonal in double (a small state's underflow fp32), in SPLIT
         * running sums as reflect's */
        double s0 = 0.0, s1 = 0.0, s2 = 0.0, s3 = 0.0;
        int64_t i = j + 1;
        for (; i + SPLIT <= m; i += SPLIT) {
            s0 += (double)a[i * r + j] * a[i * r + j], s1 += (double)a[(i + 1) * r + j] * a[(i + 1) * r + j];
            s2 += (double)a[(i + 2) * r + j] * a[(i + 2) * r + j], s3 += (double)a[(i + 3) * r + j] * a[(i + 3) * r + j];
        }
        double *tail[] = {&s0, &s1, &s2};  /* fewer than SPLIT rows left */
        for (int p = 0; i < m; i++, p++) *tail[p] += (double)a[i * r + j] * a[i * r + j];
        double below = (s0 + s1) + (s2 + s3), alpha = a[j * r + j];
        if (below == 0.0) {
            tau[j] = 0.0f;
            continue;
        }
        double norm = sqrt(alpha * alpha + below), beta = alpha >= 0.0 ? -norm : norm, scale = 1.0 / (alpha - beta);
        tau[j] = (float)((beta - alpha) / beta);
        for (int64_t i = j + 1; i < m; i++) a[i * r + j] = v[i] = (float)(a[i * r + j] * scale);
        a[j * r + j] = (float)beta;
        /* the columns after j, from the start of j's chunk */
        for (int64_t k = 0; k < r; k++) mask[k] = k > j ? 1.0f : 0.0f;
        reflect(v, tau[j], j, j - j % QR_CHUNK, mask, a, m, r);
    }
}

/* out (m x r) = the leaf's reflections H_0 ... H_{r-1} applied to top (r x r; NULL: the identity)
 * above m - r rows of zeros: the leaf's Q times top. Scratch as householder_leaf's. */
static void apply_leaf(const float *restrict a, int64_t m, int64_t r, const float *restrict tau, const float *restrict top, float *restrict out,
                       float *restrict v, float *restrict mask) {
    for (int64_t i = 0; i < m * r; i++) out[i] = 0.0f;
    for (int64_t i = 0; i < r; i++)
        for (int64_t k = 0; k < r; k++) out[i * r + k] = top ? top[i * r + k] : (float)(i == k);
    for (int64_t k = 0; k < r; k++) mask[k] = 1.0f;
    for (int64_t j = r - 1; j >= 0; j--) {
        if (tau[j] == 0.0f) continue;
        for (int64_t i = j + 1; i < m; i++) v[i] = a[i * r + j];
        reflect(v, tau[j], j, 0, mask, out, m, r);
    }
}

int lowbit_orthonormal(const float *a, int64_t rows, int64_t rank, float *q, int threads) {
    if (rows < rank || rank < 0) return -1;
    if (rank == 0) return 0;
    int64_t leaf_rows = LEAF_ROWS > 2 * rank ? LEAF_ROWS : 2 * rank;  /* the R's stacked: at most half the rows */
    int64_t leaves = rows / leaf_rows > 1 ? rows / leaf_rows : 1;
    float *work = malloc((size_t)(rows * rank > 0 ? rows * rank : 1) * sizeof(float));
    float *tau = malloc((size_t)(leaves * rank > 0 ? leaves * rank : 1) * sizeof(float));
    int64_t scratch = 2 * leaf_rows + rank;  /* a leaf's v and mask (the last leaf's rows: fewer than 2 leaf_rows) */
    float *w = malloc((size_t)(leaves * scratch) * sizeof(float));
    float *stacked = leaves > 1 ? calloc((size_t)(leaves * rank * rank), sizeof(float)) : NULL;
    float *stacked_q = leaves > 1 ? malloc((size_t)(leaves * rank * rank) * sizeof(float)) : NULL;
    int failed = !work || !tau || !w || (leaves > 1 && (!stacked || !stacked_q));
    if (!failed) {
        memcpy(work, a, (size_t)(rows * rank) * sizeof(float));
        #pragma omp parallel for schedule(static) num_threads(threads)
        for (int64_t leaf = 0; leaf < leaves; leaf++) {
            int64_t first = leaf * leaf_rows, m = leaf == leaves - 1 ? rows - first : leaf_rows;
            householder_leaf(work + first * rank, m, rank, tau + leaf * rank, w + leaf * scratch, w + leaf * scratch + 2 * leaf_rows);
            if (leaves > 1)
                for (int64_t i = 0; i < rank; i++)
                    for (int64_t k = i; k < rank; k++) stacked[(leaf * rank + i) * rank + k] = work[(first + i) * rank + k];
        }
        failed = leaves > 1 && lowbit_orthonormal(stacked, leaves * rank, rank, stacked_q, threads);
    }
    if (!failed) {
        #pragma omp parallel for schedule(static) num_threads(threads)
        for (int64_t leaf = 0; leaf < leaves; leaf++) {
            int64_t first = leaf * leaf_rows, m = leaf == leaves - 1 ? rows - first : leaf_rows;
            apply_leaf(work + first * rank, m, rank, tau + leaf * rank, leaves > 1 ? stacked_q + leaf * rank * rank : NULL, q + first * rank,
                       w + leaf * scratch, w + leaf * scratch + 2 * leaf_rows);
        }
    }
    free(work), free(tau), free(w), free(stacked), free(stacked_q);
    return failed;
}
