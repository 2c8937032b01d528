/* main -> level_a -> level_b -> call_jit -> code generated at run time (with a
 * frame pointer, named in /tmp/perf-PID.map), the rest built -O2
 * -fomit-frame-pointer: for tests/integration/test_unwind.py, the unwinder
 * follows the frame pointer where no table covers the address, then goes on
 * with the tables. */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <time.h>
#include <unistd.h>

static const unsigned char spin_code[] = {
    0x55,             /* push %rbp */
    0x48, 0x89, 0xe5, /* mov %rsp,%rbp */
    0x48, 0x89, 0xf9, /* mov %rdi,%rcx */
    0x48, 0xff, 0xc9, /* 1: dec %rcx */
    0x75, 0xfb,       /* jnz 1b */
    0x5d,             /* pop %rbp */
    0xc3,             /* ret */
};

typedef void (*spin_fn)(unsigned long);
static spin_fn spin;
volatile unsigned long sink;

__attribute__((noinline)) void call_jit(unsigned long n) { spin(n); sink++; }
__attribute__((noinline)) void level_b(unsigned long n) { call_jit(n); sink++; }
__attribute__((noinline)) void level_a(unsigned long n) { level_b(n); sink++; }

int main(int argc, char **argv)
{
    double secs = argc > 1 ? atof(argv[1]) : 2.0;
    void *mem = mmap(NULL, 4096, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
    if (mem == MAP_FAILED)
        return 1;
    memcpy(mem, spin_code, sizeof(spin_code));
    if (mprotect(mem, 4096, PROT_READ | PROT_EXEC) != 0)
        return 1;
    spin = (spin_fn)mem;
    char path[64];
    snprintf(path, sizeof(path), "/tmp/perf-%d.map", (int)getpid());
    FILE *f = fopen(path, "w");
    if (!f)
        return 1;
    fprintf(f, "%lx %zx jitted_spin\n", (unsigned long)mem, sizeof(spin_code));
    fclose(f);
    struct timespec t0, t;
    clock_gettime(CLOCK_MONOTONIC, &t0);
    do {
        level_a(1000000);
        clock_gettime(CLOCK_MONOTONIC, &t);
    } while ((t.tv_sec - t0.tv_sec) + (t.tv_nsec - t0.tv_nsec) / 1e9 < secs);
    unlink(path);
    return 0;
}
