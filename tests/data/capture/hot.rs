// Rust workload: symbols with ';' ("<[u8; 32] as Hot>::churn") and quotes.
trait Hot { fn churn(&self, n: u64) -> u64; }
impl Hot for [u8; 32] {
    #[inline(never)]
    fn churn(&self, n: u64) -> u64 {
        let mut x = n;
        for _ in 0..2000 { for b in self.iter() { x = x.wrapping_mul(31).wrapping_add(*b as u64); } }
        x
    }
}
fn main() {
    let secs: f64 = std::env::args().nth(1).and_then(|s| s.parse().ok()).unwrap_or(1.0);
    let t0 = std::time::Instant::now();
    let a = [7u8; 32];
    let mut x = 0u64;
    while t0.elapsed().as_secs_f64() < secs { x = std::hint::black_box(&a).churn(x); }
    println!("{}", x);
}
