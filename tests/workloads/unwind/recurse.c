/* main -> descend x DEPTH -> spin, for tests/integration/test_unwind.py: deeper
 * than the unwinder keeps, the stack must say it was cut. */
#include <stdlib.h>
#include <time.h>

volatile unsigned long sink;

__attribute__((noinline)) void spin(void)
{
    for (unsigned long i = 0; i < 100000; i++)
        sink += i;
}

__attribute__((noinline)) void descend(int n)
{
    if (n > 0)
        descend(n - 1);
    else
        spin();
    sink++; /* not a tail call */
}

int main(int argc, char **argv)
{
    int depth = argc > 1 ? atoi(argv[1]) : 100;
    double secs = argc > 2 ? atof(argv[2]) : 2.0;
    struct timespec t0, t;
    clock_gettime(CLOCK_MONOTONIC, &t0);
    do {
        descend(depth);
        clock_gettime(CLOCK_MONOTONIC, &t);
    } while ((t.tv_sec - t0.tv_sec) + (t.tv_nsec - t0.tv_nsec) / 1e9 < secs);
    return 0;
}
