/* main -> lost -> spin, for tests/integration/test_unwind.py: lost (no CFI)
 * clears rbp and jumps to spin with a return address outside every mapping
 * on the stack, as a greenlet's fresh C stack or a corrupted one holds;
 * spin never returns (it exits).  An unwinder that follows that address has
 * lost its way: the stack is not complete. */
#include <stdlib.h>
#include <time.h>
#include <unistd.h>

volatile unsigned long sink;
static double secs = 2.0;

__attribute__((noinline, used, noreturn)) void spin(void)
{
    struct timespec t0, t;
    clock_gettime(CLOCK_MONOTONIC, &t0);
    do {
        for (unsigned long i = 0; i < 100000; i++)
            sink += i * i;
        clock_gettime(CLOCK_MONOTONIC, &t);
    } while ((t.tv_sec - t0.tv_sec) + (t.tv_nsec - t0.tv_nsec) / 1e9 < secs);
    _exit(0);
}

/* rsp stays 8 mod 16 at spin's entry, as after a call. */
__asm__(
    ".text\n"
    ".globl lost\n"
    ".type lost, @function\n"
    "lost:\n"
    "    xor %ebp, %ebp\n"
    "    sub $8, %rsp\n"
    "    push $0x1234\n"
    "    jmp spin\n"
    ".size lost, .-lost\n");
void lost(void);

int main(int argc, char **argv)
{
    secs = argc > 1 ? atof(argv[1]) : 2.0;
    lost();
    return 0;
}
