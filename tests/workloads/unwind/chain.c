/* main -> level_a -> level_b -> level_c -> leaf, for tests/integration/test_unwind.py:
 * built -O2 -fomit-frame-pointer, so a frame-pointer walk sees only the leaf. */
#include <stdlib.h>
#include <time.h>

volatile unsigned long sink;

__attribute__((noinline)) void leaf(unsigned long n)
{
    for (unsigned long i = 0; i < n; i++)
        sink += i * i;
}

__attribute__((noinline)) void level_c(unsigned long n) { leaf(n); sink++; }
__attribute__((noinline)) void level_b(unsigned long n) { level_c(n); sink++; }
__attribute__((noinline)) void level_a(unsigned long n) { level_b(n); sink++; }

int main(int argc, char **argv)
{
    double secs = argc > 1 ? atof(argv[1]) : 2.0;
    struct timespec t0, t;
    clock_gettime(CLOCK_MONOTONIC, &t0);
    do {
        level_a(100000);
        clock_gettime(CLOCK_MONOTONIC, &t);
    } while ((t.tv_sec - t0.tv_sec) + (t.tv_nsec - t0.tv_nsec) / 1e9 < secs);
    return 0;
}
