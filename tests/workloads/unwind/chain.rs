// main -> level_a -> level_b -> level_c -> leaf in a release build without
// frame pointers, for tests/integration/test_unwind.py.
use std::hint::black_box;
use std::time::Instant;

#[inline(never)]
fn leaf(n: u64) -> u64 {
    let mut s = 0u64;
    for i in 0..n {
        s = s.wrapping_add(black_box(i).wrapping_mul(i));
    }
    s
}

#[inline(never)]
fn level_c(n: u64) -> u64 { black_box(leaf(n)) + 1 }
#[inline(never)]
fn level_b(n: u64) -> u64 { black_box(level_c(n)) + 1 }
#[inline(never)]
fn level_a(n: u64) -> u64 { black_box(level_b(n)) + 1 }

fn main() {
    let secs: f64 = std::env::args().nth(1).and_then(|a| a.parse().ok()).unwrap_or(2.0);
    let t0 = Instant::now();
    let mut total = 0u64;
    while t0.elapsed().as_secs_f64() < secs {
        total = total.wrapping_add(level_a(black_box(100_000)));
    }
    black_box(total);
}
