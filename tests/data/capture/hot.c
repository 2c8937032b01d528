/* A real workload for the captured perf fixtures: threads named with spaces,
 * trailing digits and a ';', an inlined hot loop, recursion, and a call into a
 * shared library that lives under a directory with spaces and parentheses. */
#define _GNU_SOURCE
#include <dlfcn.h>
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <time.h>

static volatile unsigned long sink;

static inline __attribute__((always_inline)) unsigned long mix(unsigned long x) {
    for (int i = 0; i < 64; i++) x = x * 6364136223846793005UL + 1442695040888963407UL;
    return x;
}

__attribute__((noinline)) unsigned long recurse(int depth, unsigned long x) {
    if (depth == 0) return mix(x);
    return recurse(depth - 1, x + 1) + 1;
}

__attribute__((noinline)) void spin_for(double seconds, unsigned long (*lib)(unsigned long)) {
    struct timespec t0, t;
    clock_gettime(CLOCK_MONOTONIC, &t0);
    unsigned long x = 1;
    do {
        for (int k = 0; k < 2000; k++) {
            x = recurse(k % 7, x);
            if (lib) x = lib(x);
        }
        sink = x;
        clock_gettime(CLOCK_MONOTONIC, &t);
    } while ((t.tv_sec - t0.tv_sec) + (t.tv_nsec - t0.tv_nsec) / 1e9 < seconds);
}

struct job { const char *name; double seconds; unsigned long (*lib)(unsigned long); };

static void *worker(void *arg) {
    struct job *j = arg;
    pthread_setname_np(pthread_self(), j->name);
    spin_for(j->seconds, j->lib);
    return NULL;
}

int main(int argc, char **argv) {
    double seconds = argc > 1 ? atof(argv[1]) : 1.0;
    const char *libpath = argc > 2 ? argv[2] : NULL;
    unsigned long (*lib)(unsigned long) = NULL;
    if (libpath) {
        void *h = dlopen(libpath, RTLD_NOW);
        if (!h) { fprintf(stderr, "dlopen: %s\n", dlerror()); return 1; }
        lib = (unsigned long (*)(unsigned long))dlsym(h, "lib_hot");
    }
    struct job jobs[] = {{"worker 0", seconds, NULL}, {"worker 1", seconds, lib}, {"job;2", seconds, lib}};
    pthread_t th[3];
    for (int i = 0; i < 3; i++) pthread_create(&th[i], NULL, worker, &jobs[i]);
    for (int i = 0; i < 3; i++) pthread_join(th[i], NULL);
    printf("%lu\n", sink);
    return 0;
}
