//! Work whose recursion depth grows with its input (grammar compilation, chat template
//! rendering) runs on a thread with a large stack.
//!
//! A BEAM dirty scheduler thread has about 320 KiB of stack, and llguidance recurses once per
//! required JSON property, minijinja once per level of a nested value. The inputs are bounded
//! (see `grammar::limits` and `chat::TemplateLimits`) so that the deepest recursion they allow
//! fits this stack with room to spare; the stack is reserved, not committed, so a shallow
//! input costs only the thread start (tens of microseconds).

/// Stack of the thread [`on_deep_stack`] starts.
pub const DEEP_STACK_BYTES: usize = 256 << 20;

/// Runs `f` on a fresh thread with [`DEEP_STACK_BYTES`] of stack and returns its result; a
/// panic in `f` is resumed on the calling thread. `Err` when the thread cannot be started.
pub fn on_deep_stack<T: Send>(f: impl FnOnce() -> T + Send) -> Result<T, String> {
    std::thread::scope(|s| {
        let handle = std::thread::Builder::new()
            .name("llama-deep".into())
            .stack_size(DEEP_STACK_BYTES)
            .spawn_scoped(s, f)
            .map_err(|e| format!("cannot start a worker thread: {e}"))?;
        match handle.join() {
            Ok(v) => Ok(v),
            Err(payload) => std::panic::resume_unwind(payload),
        }
    })
}

#[cfg(test)]
mod tests {
    #[test]
    fn runs_deep_recursion_and_returns_its_value() {
        fn depth(n: u64) -> u64 {
            // a frame with a buffer the optimiser cannot drop
            let pad = std::hint::black_box([0u8; 512]);
            if n == 0 {
                pad[0] as u64
            } else {
                1 + depth(n - 1) + pad[511] as u64
            }
        }
        // ~100k frames of over 512 bytes: far beyond a default thread's 2 MiB
        assert_eq!(super::on_deep_stack(|| depth(100_000)).unwrap(), 100_000);
    }

    #[test]
    fn a_panic_reaches_the_caller() {
        let r = std::panic::catch_unwind(|| super::on_deep_stack(|| panic!("boom")));
        assert!(r.is_err());
    }
}
