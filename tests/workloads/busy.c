/* A CPU-bound workload with known function names, for the BPF sampler's tests
 * and benchmark.  Build: gcc -O0 -g -fno-omit-frame-pointer -o flamed_busy busy.c
 * (-O0 because gcc 12 drops the frame of leaf functions at -O1 even with
 * -mno-omit-leaf-frame-pointer, and a frame-pointer walk from a frameless
 * leaf skips its caller: busy_middle would vanish from the stacks).
 *
 *   flamed_busy busy SECONDS     spin in main -> busy_outer -> busy_middle -> busy_leaf
 *   flamed_busy paths SECONDS D  recurse D levels (D <= 30) through path_a /
 *                                path_b, picked by random bits, then spin in
 *                                path_leaf: up to 2^D distinct stacks
 *
 * Prints "ready" once running, and exits after SECONDS (checked every few
 * microseconds), so a test can never leave it behind for long.
 */
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

static volatile uint64_t sink;

static double now(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return ts.tv_sec + ts.tv_nsec / 1e9;
}

__attribute__((noinline)) void busy_leaf(void)
{
    for (int i = 0; i < 20000; i++)
        sink += (uint64_t)i * i;
}

__attribute__((noinline)) void busy_middle(void)
{
    busy_leaf();
    sink++;
}

__attribute__((noinline)) void busy_outer(double until)
{
    while (now() < until)
        busy_middle();
    sink++;
}

__attribute__((noinline)) void path_leaf(void)
{
    for (int i = 0; i < 3000; i++)
        sink += (uint64_t)i ^ sink;
}

__attribute__((noinline)) void path_b(unsigned depth, uint64_t bits);

__attribute__((noinline)) void path_a(unsigned depth, uint64_t bits)
{
    if (depth == 0)
        path_leaf();
    else if (bits & 1)
        path_a(depth - 1, bits >> 1);
    else
        path_b(depth - 1, bits >> 1);
    sink++; /* not a tail call: keeps this frame on the stack */
}

__attribute__((noinline)) void path_b(unsigned depth, uint64_t bits)
{
    if (depth == 0)
        path_leaf();
    else if (bits & 1)
        path_a(depth - 1, bits >> 1);
    else
        path_b(depth - 1, bits >> 1);
    sink++;
}

__attribute__((noinline)) void paths(double until, unsigned depth)
{
    uint64_t x = 88172645463325252ull ^ (uint64_t)now();
    while (now() < until) {
        /* xorshift: cheap random bits and a random depth */
        x ^= x << 13;
        x ^= x >> 7;
        x ^= x << 17;
        path_a(depth / 2 + (unsigned)(x % (depth / 2 + 1)), x >> 8);
    }
}

int main(int argc, char **argv)
{
    if (argc < 3) {
        fprintf(stderr, "usage: %s busy|paths SECONDS [DEPTH]\n", argv[0]);
        return 2;
    }
    double until = now() + atof(argv[2]);
    printf("ready\n");
    fflush(stdout);
    if (strcmp(argv[1], "busy") == 0) {
        busy_outer(until);
    } else if (strcmp(argv[1], "paths") == 0) {
        unsigned depth = argc > 3 ? (unsigned)atoi(argv[3]) : 16;
        if (depth > 30)
            depth = 30;
        paths(until, depth);
    } else {
        return 2;
    }
    return 0;
}
