/* Shared library for hot.c, installed under a path with spaces and parentheses. */
__attribute__((noinline)) unsigned long lib_inner(unsigned long x) {
    for (int i = 0; i < 32; i++) x ^= x << 7, x ^= x >> 9;
    return x;
}
unsigned long lib_hot(unsigned long x) { return lib_inner(x) + 1; }
