/* The step driver: every parameter's chunks, shared among the threads.
 *
 * A chunk is a few blocks (about CHUNK_ELEMENTS, MAX_CHUNK at most): a thread decodes its states into
 * fp32 buffers that stay in L1 (chunk_io.h), calls the optimizer's update (update.h) and encodes them
 * back, so every byte of state is read once and written once. A parameter's chunks are split into
 * tasks, each stepped by one thread in order: a task per chunk, except for a parameter with a
 * factored state, which has at most MAX_TASKS (factored.h: its column sums then do not depend on
 * the threads). The tasks of all parameters go to one parallel region per step, scheduled as
 * OpenMP's guided schedule would but weighed by elements (end_of_grab): a thread takes long runs
 * of consecutive tasks, shorter ones towards the end, so that each streams through memory as
 * torch's fused step does. With dynamic grabs of 8 tasks (of 1024 elements then) the two threads
 * interleaved every 32 KiB, and on an AMD EPYC of family 26 (2 vCPUs, GPT-2-small set) the
 * fp32-state step took 50 ms on 2 threads against 62 on 1 (torch's fused AdamW: 32 and 58);
 * guided, 36 ms. */
#include <stdlib.h>

#define MAX_TASKS 32

/* Elements per chunk, rounded to whole blocks. Smaller chunks cost more per element where the
 * parameter is in cache (the setup of each chunk), larger ones where it streams from DRAM. On an AMD
 * EPYC of family 26 (Zen 5), one thread, a 2**26-element parameter, ns per element with chunks of
 * 512 against 1024: 8bit 0.94-0.98 against 1.05-1.19, fp8 0.78-0.83 against 0.90-0.98 (4bit, bf16,
 * 10bit-sr and the AVX2 build within noise); the GPT-2-small set's 8bit step on two threads
 * 0.066-0.070 s against 0.073-0.085. In cache, 512 costs 3-7 %. */
#define CHUNK_ELEMENTS 512

/* Whether the optimizer gets this parameter's states as bf16, in place: it takes them so, and all
 * of them are bf16. */
static int bf16_in_place(const optimizer_t *o, const param_t *t) {
    int any = 0;
    for (int i = 0; i < MAX_STATES; i++) {
        if (t->state[i].kind == KIND_NONE) continue;
        if (t->state[i].kind != KIND_BF16) return 0;
        any = 1;
    }
    return o->bf16_in_place && any;
}

static int element_bytes(int32_t kind) { return kind == KIND_F32 ? 4 : 2; }  /* a parameter's or gradient's */

/* A chunk whose states are decoded reads its parameter and gradient in one short burst (the update),
 * which the hardware's prefetchers do not see coming: Adam's and AdEMAMix's vector updates fetch the
 * next chunk's as they go (prefetch_next, update.h). On an AMD EPYC of family 26 (Zen 5), one
 * thread, a 2**24-element parameter, ns per element: AdamW 8bit 0.95 -> 0.87 (AVX2 build 2.19 ->
 * 1.73), fp8 0.78 -> 0.74-0.76, 4bit 1.48 -> 1.44, AdEMAMix 8bit 1.47 -> 1.26 (AVX2 2.84 -> 2.39);
 * in cache 1-3 % slower; no other CPU measured. Off where the states are updated in place (fp32,
 * bf16): that update streams through memory as torch's fused step does, and prefetching made the
 * AVX2 fp32 step 11-16 % slower. SGD's, Lion's and Muon's loops, which the compiler vectorizes, do
 * not prefetch: their one state leaves less time between bursts, and the ways to prefetch for them
 * measured slower with AVX-512 (README, "Chunks of about 512 elements"). */
static void step_chunk(const optimizer_t *o, const param_t *t, const void *hyper, const void *scalars, int64_t start, int64_t n, int64_t task) {
    float p_buffer[MAX_CHUNK], g_buffer[MAX_CHUNK], buffers[MAX_STATES][MAX_CHUNK];
    chunk_t c = {.n = n, .param = load_param(t, start, n, p_buffer), .grad = load_values(t->grad_kind, t->grad, start, n, g_buffer),
                 .bf16_states = bf16_in_place(o, t)};
    int decoded = 0;  /* a state went through its buffer */
    for (int i = 0; i < MAX_STATES; i++) {
        const state_t *s = &t->state[i];
        if (s->kind != KIND_NONE) c.state[i] = c.bf16_states ? (void *)((uint16_t *)s->data + start) : load_state(s, start, n, buffers[i]);
        decoded |= c.state[i] == (void *)buffers[i];
    }
    if (decoded && start + 2 * n <= t->numel) {  /* the next chunk, if whole (the thread's next, mostly) */
        c.param_bytes = element_bytes(t->param_kind), c.grad_bytes = element_bytes(t->grad_kind);
        c.next_param = (const char *)t->param + (start + n) * c.param_bytes;
        c.next_grad = (const char *)t->grad + (start + n) * c.grad_bytes;
    }
    o->update(hyper, scalars, &c);
    if (!c.bf16_states)
        for (int i = 0; i < MAX_STATES; i++) {
            const state_t *s = &t->state[i];
            if (s->kind != KIND_NONE) store_state(s, start, n, c.state[i], s->kind == KIND_FACTORED ? s->col_sums + task * s->cols : NULL);
        }
    store_param(t, start, n, c.param);
}

static int64_t gcd(int64_t a, int64_t b) { return b ? gcd(b, a % b) : a; }

/* Elements per chunk: a whole number of blocks of every quantized state and of rows of every
 * factored one (fused_cpu.chunk_unit); about CHUNK_ELEMENTS, whose buffers stay in L1. */
static int64_t chunk_size(const param_t *t) {
    int64_t unit = 1;
    for (int i = 0; i < MAX_STATES; i++) {
        const state_t *s = &t->state[i];
        int blocks = s->kind == KIND_CODEBOOK || s->kind == KIND_E4M3 || s->kind == KIND_BLOCK_FLOAT;
        int64_t size = s->kind == KIND_FACTORED ? s->cols : blocks ? s->block_size : 1;
        if (size > 0) unit = unit / gcd(unit, size) * size;
    }
    return unit * (unit < CHUNK_ELEMENTS ? CHUNK_ELEMENTS / unit : 1);
}

typedef struct {
    int64_t size, chunks;  /* elements per chunk (chunk_size), and chunks in the parameter */
    int64_t first_element; /* the step's elements before the parameter's (in the order given) */
} chunking_t;

/* The step's tasks: each parameter's first task (count + 1 entries) and chunking */
typedef struct {
    const param_t *params;
    const int64_t *first_task;
    const chunking_t *chunking;
    int64_t count;
} tasks_t;

/* The first of a parameter's chunks that its task `task` of `tasks` steps (the next task's first
 * ends it): the tasks split the chunks evenly, and end_of_grab weighs them so */
static int64_t first_chunk(int64_t task, int64_t tasks, int64_t chunks) { return task * chunks / tasks; }

static int64_t param_of_task(const tasks_t *k, int64_t c) {
    int64_t lo = 0, hi = k->count - 1;
    while (lo < hi) {
        int64_t mid = (lo + hi + 1) / 2;
        if (k->first_task[mid] <= c) lo = mid; else hi = mid - 1;
    }
    return lo;
}

/* where task c (< the number of tasks) starts among the step's elements */
static int64_t task_start(const tasks_t *k, int64_t c) {
    int64_t j = param_of_task(k, c), tasks = k->first_task[j + 1] - k->first_task[j];
    int64_t offset = first_chunk(c - k->first_task[j], tasks, k->chunking[j].chunks) * k->chunking[j].size;
    return k->chunking[j].first_element + (offset < k->params[j].numel ? offset : k->params[j].numel);
}

/* The tasks a thread takes next, from task begin on: as OpenMP's guided schedule hands out a loop's
 * iterations (what is left over the threads, at least one), but weighed by elements. Most tasks are
 * a chunk, but a factored state's parameter has at most MAX_TASKS: GPT-2-small's token embedding
 * then 32 tasks of 1.2M elements, the other matrices' 18k to 74k. Guided by count, a thread's first
 * grab took half the tasks and with them 65 % of the elements: with every second moment factored,
 * two threads stepped the set 1.23x as fast as one (AMD EPYC of family 26). */
static int64_t end_of_grab(const tasks_t *k, int64_t begin, int64_t total_elements, int threads) {
    int64_t total = k->first_task[k->count], from = task_start(k, begin);
    int64_t until = from + (total_elements - from + threads - 1) / threads;
    int64_t lo = begin + 1, hi = total;  /* the first task from begin + 1 on that starts at or past until */
    while (lo < hi) {
        int64_t mid = (lo + hi) / 2;
        if (task_start(k, mid) >= until) hi = mid; else lo = mid + 1;
    }
    return lo;
}

static int has_factored(const param_t *t) {
    for (int i = 0; i < MAX_STATES; i++)
        if (t->state[i].kind == KIND_FACTORED) return 1;
    return 0;
}

/* Scratch kept from one step to the next: the factored states' per-step fields (their scaled
 * columns and each task's column sums, about 20 MB for GPT-2-small with every second moment
 * factored). Fresh from the OS at every step, its pages were first touched by the worker threads,
 * whose page faults serialized them: two threads stepped that set in 83-85 ms, against 53 ms with
 * the memory reused (AMD EPYC of family 26). A step takes the kept block (or a larger one) and
 * hands it back; concurrent steps each get their own, and the larger one is kept. */
typedef struct {
    size_t bytes;
    double data[];  /* aligned for doubles */
} scratch_t;
static scratch_t *kept_scratch;

static scratch_t *take_scratch(size_t bytes) {
    scratch_t *s = __atomic_exchange_n(&kept_scratch, NULL, __ATOMIC_ACQ_REL);
    if (s && s->bytes >= bytes) return s;
    free(s);
    s = malloc(sizeof(scratch_t) + (bytes ? bytes : 1));
    if (s) s->bytes = bytes;
    return s;
}

static void keep_scratch(scratch_t *s) {
    scratch_t *old = __atomic_exchange_n(&kept_scratch, s, __ATOMIC_ACQ_REL);
    if (old && s && old->bytes > s->bytes) old = __atomic_exchange_n(&kept_scratch, old, __ATOMIC_ACQ_REL);  /* keep the larger */
    free(old);
}

/* Steps every parameter once with optimizer o; returns 0 (nothing stepped: 1, out of memory; 2, a
 * parameter whose chunks would not fit the MAX_CHUNK buffers, which the op refuses before this) */
static int step_params(const optimizer_t *o, param_t *params, int64_t count, const void *hyper, int threads) {
    for (int64_t j = 0; j < count; j++) {
        int64_t size = chunk_size(&params[j]);
        if (size <= 0 || size > MAX_CHUNK) return 2;  /* (<= 0: an lcm past int64) */
    }
    threads = threads > 1 ? threads : 1;  /* end_of_grab divides by it */
    size_t stride = (o->scalars_size + 15) / 16 * 16;  /* each parameter's scalars, aligned for any member */
    int64_t *first_task = malloc((count + 1) * sizeof(int64_t));
    chunking_t *chunking = malloc((count ? count : 1) * sizeof(chunking_t));  /* each parameter's, taken once */
    char *scalars = malloc(count ? count * stride : 1);
    int failed = !first_task || !chunking || !scalars;
    int64_t total_elements = 0;
    size_t scratch_bytes = 0;
    if (first_task) first_task[0] = 0;
    for (int64_t j = 0; !failed && j < count; j++) {
        const param_t *t = &params[j];
        int64_t size = chunk_size(t), chunks = (t->numel + size - 1) / size;
        chunking[j] = (chunking_t){size, chunks, total_elements};
        total_elements += t->numel;
        int64_t tasks = has_factored(t) && chunks > MAX_TASKS ? MAX_TASKS : chunks;
        first_task[j + 1] = first_task[j] + tasks;
        for (int i = 0; i < MAX_STATES; i++) scratch_bytes += factored_scratch_bytes(&t->state[i], tasks);
    }
    scratch_t *scratch = failed ? NULL : take_scratch(scratch_bytes);
    failed |= !scratch;
    int64_t prepared = failed ? 0 : count;  /* parameters whose factored states got their fields */
    char *next_scratch = failed ? NULL : (char *)scratch->data;
    for (int64_t j = 0; j < prepared; j++)
        for (int i = 0; i < MAX_STATES; i++) begin_factored(&params[j].state[i], first_task[j + 1] - first_task[j], &next_scratch);
    if (!failed) {
        for (int64_t j = 0; j < count; j++) {
            const param_t *t = &params[j];
            float step = 0.0f;
            if (t->step) {
                step = *t->step + 1.0f;
                *t->step = step;
            }
            for (int i = 0; i < MAX_STATES; i++)
                if (t->state[i].kind == KIND_BF16_SR || t->state[i].kind == KIND_BLOCK_FLOAT) *t->state[i].writes += 1;  /* as quantize_ counts its write */
            o->prepare(hyper, step, scalars + j * stride);
        }
        tasks_t k = {params, first_task, chunking, count};
        int64_t total = first_task[count], next = 0;
        #pragma omp parallel num_threads(threads)
        for (;;) {
            int64_t begin, end = 0;
            #pragma omp critical(lowbit_step_grab)
            {
                begin = next;
                if (begin < total) next = end = end_of_grab(&k, begin, total_elements, threads);
            }
            if (begin >= total) break;
            for (int64_t c = begin; c < end; c++) {
                int64_t j = param_of_task(&k, c);
                const param_t *t = &params[j];
                int64_t size = chunking[j].size, chunks = chunking[j].chunks;
                int64_t task = c - first_task[j], tasks = first_task[j + 1] - first_task[j];
                for (int i = 0; i < MAX_STATES; i++) start_factored_task(&t->state[i], task);
                for (int64_t chunk = first_chunk(task, tasks, chunks); chunk < first_chunk(task + 1, tasks, chunks); chunk++) {
                    int64_t start = chunk * size;
                    step_chunk(o, t, hyper, scalars + j * stride, start, t->numel - start < size ? t->numel - start : size, task);
                }
            }
        }
    }
    for (int64_t j = 0; j < prepared; j++) {
        param_t *t = &params[j];
        int64_t tasks = first_task[j + 1] - first_task[j];
        for (int i = 0; i < MAX_STATES; i++) end_factored(&t->state[i], tasks, !failed);
    }
    if (scratch) keep_scratch(scratch);
    free(first_task);
    free(chunking);
    free(scalars);
    return failed;
}
