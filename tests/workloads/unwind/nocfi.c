/* main -> level_a -> level_b -> no_cfi -> spin, for tests/integration/test_unwind.py.
 * no_cfi is written without call frame information (as hand-written routines
 * in numerical libraries are) and clears rbp before it calls spin, which is
 * built -O2 -fomit-frame-pointer and keeps rbp as it got it.  An unwinder that
 * reaches no_cfi with rbp == 0 has lost its way, not found the outermost frame. */
#include <stdlib.h>
#include <time.h>

volatile unsigned long sink;

__attribute__((noinline, used)) void spin(void)
{
    for (unsigned long i = 0; i < 200000; i++)
        sink += i * i;
}

/* push rbp; rbp = 0; call spin; pop rbp; ret: no .cfi_* directives. */
__asm__(
    ".text\n"
    ".globl no_cfi\n"
    ".type no_cfi, @function\n"
    "no_cfi:\n"
    "    push %rbp\n"
    "    xor %ebp, %ebp\n"
    "    call spin\n"
    "    pop %rbp\n"
    "    ret\n"
    ".size no_cfi, .-no_cfi\n");
void no_cfi(void);

__attribute__((noinline)) void level_b(void) { no_cfi(); sink++; }
__attribute__((noinline)) void level_a(void) { level_b(); sink++; }

int main(int argc, char **argv)
{
    double secs = argc > 1 ? atof(argv[1]) : 2.0;
    struct timespec t0, t;
    clock_gettime(CLOCK_MONOTONIC, &t0);
    do {
        level_a();
        clock_gettime(CLOCK_MONOTONIC, &t);
    } while ((t.tv_sec - t0.tv_sec) + (t.tv_nsec - t0.tv_nsec) / 1e9 < secs);
    return 0;
}
