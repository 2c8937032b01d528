// C++ workload: operator"" and templates in symbols.
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <vector>
unsigned long long operator""_spins(unsigned long long n) { return n; }
template <typename T> struct Box {
    __attribute__((noinline)) T work(T x) const { for (int i = 0; i < 200; i++) x = x * 3 + 1; return x; }
};
unsigned long long (*volatile lit)(unsigned long long) = &operator""_spins;
int main(int argc, char** argv) {
    double secs = argc > 1 ? atof(argv[1]) : 1.0;
    auto t0 = std::chrono::steady_clock::now();
    Box<std::vector<int>::size_type> b;
    unsigned long long x = 0;
    while (std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count() < secs) {
        for (unsigned long long i = 0; i < lit(1000_spins); i++) x = b.work(x + lit(i));
    }
    printf("%llu\n", x);
}
