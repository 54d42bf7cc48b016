/* What the fused kernel needs of a C library, for its aarch64 build run under emulation
 * (emulated_aarch64.py): memory functions, an allocator, and powf / exp / log, which it asks of the
 * emulating process (whose libm the native kernel calls: the same numbers on both sides). Built
 * freestanding (-fno-builtin), so the compiler cannot turn these loops back into calls to themselves. */
#include <stddef.h>
#include <stdint.h>

void *memcpy(void *restrict to, const void *restrict from, size_t n) {
    unsigned char *d = to;
    const unsigned char *s = from;
    while (n--) *d++ = *s++;
    return to;
}

void *memmove(void *to, const void *from, size_t n) {
    unsigned char *d = to;
    const unsigned char *s = from;
    if (d < s)
        while (n--) *d++ = *s++;
    else
        while (n--) d[n] = s[n];
    return to;
}

void *memset(void *to, int c, size_t n) {
    unsigned char *d = to;
    while (n--) *d++ = (unsigned char)c;
    return to;
}

/* A first-fit allocator over a static arena: the kernel allocates a few blocks per call, of the
 * same sizes from step to step, so freed blocks are found again. 256 MiB of .bss, which the
 * emulator maps (its pages are only allocated where touched). */
typedef struct block {
    size_t size;           /* bytes after the header */
    struct block *next;    /* the next free block (free blocks only) */
    unsigned char pad[48]; /* 64 bytes in all: blocks stay as aligned as the arena */
} block_t;
static unsigned char arena[256u << 20] __attribute__((aligned(64)));
static size_t used;
static block_t *free_blocks;

void *malloc(size_t n) {
    if (n > sizeof arena) return NULL;
    n = (n + 63) & ~(size_t)63;
    for (block_t **b = &free_blocks; *b; b = &(*b)->next)
        if ((*b)->size >= n) {
            block_t *found = *b;
            *b = found->next;
            return found + 1;
        }
    if (sizeof arena - used < sizeof(block_t) + n) return NULL; /* (used never exceeds the arena) */
    block_t *fresh = (block_t *)(arena + used);
    fresh->size = n;
    used += sizeof(block_t) + n;
    return fresh + 1;
}

void *calloc(size_t count, size_t size) {
    if (size && count > SIZE_MAX / size) return NULL;
    unsigned char *p = malloc(count * size);
    if (p) memset(p, 0, count * size);
    return p;
}

void free(void *p) {
    if (!p) return;
    block_t *b = (block_t *)p - 1;
    b->next = free_blocks;
    free_blocks = b;
}

/* a call into the emulating process: x8 names the function, d0 and d1 hold the arguments, d0 the result */
static double host(long function, double a, double b) {
    register long which __asm__("x8") = function;
    register double x __asm__("d0") = a, y __asm__("d1") = b;
    __asm__ volatile("svc #0" : "+w"(x) : "w"(y), "r"(which) : "memory");
    return x;
}

float powf(float x, float y) { return (float)host(1, x, y); }
double exp(double x) { return host(2, x, 0.0); }
double log(double x) { return host(3, x, 0.0); }

/* where a call returns to: the emulator stops on reaching it (and a linker needs an entry point) */
void lowbit_emulation_return(void) {
    for (;;) {}
}
