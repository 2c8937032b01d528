/* main -> level_a -> level_b -> level_c -> leaf, for tests/integration/test_unwind.py:
 * built -O2 -fomit-frame-pointer, so a frame-pointer walk sees only the leaf.
 * "chain SECONDS sys": leaf spends its time in a system call instead (samples
 * taken in the kernel, whose user registers come from the task's saved ones). */
#include <stdlib.h>
#include <string.h>
#include <sys/syscall.h>
#include <time.h>
#include <unistd.h>

volatile unsigned long sink;
static int in_kernel;

__attribute__((noinline)) void leaf(unsigned long n)
{
    if (in_kernel) {
        for (unsigned long i = 0; i < n / 100; i++)
            sink += syscall(SYS_getppid);
        return;
    }
    for (unsigned long i = 0; i < n; i++)
        sink += i * i;
}

__attribute__((noinline)) void level_c(unsigned long n) { leaf(n); sink++; }
__attribute__((noinline)) void level_b(unsigned long n) { level_c(n); sink++; }
__attribute__((noinline)) void level_a(unsigned long n) { level_b(n); sink++; }

int main(int argc, char **argv)
{
    double secs = argc > 1 ? atof(argv[1]) : 2.0;
    in_kernel = argc > 2 && strcmp(argv[2], "sys") == 0;
    struct timespec t0, t;
    clock_gettime(CLOCK_MONOTONIC, &t0);
    do {
        level_a(100000);
        clock_gettime(CLOCK_MONOTONIC, &t);
    } while ((t.tv_sec - t0.tv_sec) + (t.tv_nsec - t0.tv_nsec) / 1e9 < secs);
    return 0;
}
