//! Memory read bandwidth with N threads, for the decode-speed ceiling that
//! `bench/generate.exs` prints (see [`llama_cpp_ex_engine::membw`]).
//!
//!     llama_cpp_ex_membw [THREADS] [MIB]      prints GB/s (best of 5 passes)

fn main() {
    let mut args = std::env::args().skip(1);
    let threads: usize = args.next().and_then(|a| a.parse().ok()).unwrap_or(2);
    let mib: usize = args.next().and_then(|a| a.parse().ok()).unwrap_or(1024);
    let rate = llama_cpp_ex_engine::membw::Probe::new(mib).read_rate(threads, 5);
    println!("{rate:.2}");
}
