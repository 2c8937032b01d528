// C++ with exceptions and inlining, for tests/integration/test_unwind.py: the
// samples of work() must show main -> outer -> middle -> work, through the
// frames that catch and rethrow, with small helpers inlined away.
#include <chrono>
#include <cstdlib>
#include <stdexcept>
#include <vector>

volatile unsigned long sink;

static inline unsigned long square(unsigned long i) { return i * i; }  // inlined

__attribute__((noinline)) unsigned long work(unsigned long n)
{
    unsigned long s = 0;
    for (unsigned long i = 0; i < n; i++)
        s += square(i) ^ (s >> 3);
    if ((s & 0xff) == 0x42)
        throw std::runtime_error("rare");
    return s;
}

__attribute__((noinline)) unsigned long middle(unsigned long n)
{
    std::vector<unsigned long> v(4, n);  // a frame with a destructor to run on unwinding
    try {
        return work(v[0]);
    } catch (const std::runtime_error &) {
        return 1;
    }
}

__attribute__((noinline)) unsigned long outer(unsigned long n)
{
    unsigned long s = middle(n);
    if (n % 7 == 3)
        try {
            throw std::logic_error("often");  // exceptions thrown and caught all along
        } catch (const std::logic_error &) {
            s++;
        }
    return s;
}

int main(int argc, char **argv)
{
    double secs = argc > 1 ? atof(argv[1]) : 2.0;
    auto t0 = std::chrono::steady_clock::now();
    for (unsigned long k = 0;; k++) {
        sink += outer(100000 + k);
        if (std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count() >= secs)
            break;
    }
    return 0;
}
