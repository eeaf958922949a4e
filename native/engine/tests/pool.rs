//! The worker pool in a process of its own (it is a process-wide singleton).

use llama_cpp_ex_engine::pool::{for_each_chunk, stats, with_threads};

#[test]
fn workers_a_call_does_not_use_stay_asleep() {
    // one context with 8 threads starts 7 workers
    with_threads(8, || for_each_chunk(64, |_| {}));
    assert_eq!(stats().workers, 7);
    // let them spin out and park
    std::thread::sleep(std::time::Duration::from_millis(50));
    let before = stats().wakeups;
    // later calls with 2 threads use worker 0 only
    with_threads(2, || {
        for _ in 0..1000 {
            for_each_chunk(4, |_| {});
        }
    });
    let woken = stats().wakeups - before;
    // worker 0 wakes at most once per call; the six others not at all (before, every call
    // woke all seven and each spun for 100 µs)
    assert!(woken <= 1000, "{woken} wake-ups for 1000 calls");
    assert!(woken >= 1, "worker 0 took part");
}
