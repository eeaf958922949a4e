//! Where a forward pass's time goes, section by section: the products one by one, attention,
//! the steps between them. For the bare-engine profiles (`examples/decode_profile.rs` with
//! `SECTIONS=1`), which showed, for instance, that a small model's short products read their
//! weights at two thirds of the rate its long ones do. Off unless [`enable`]d, when a lap
//! costs one relaxed load; the totals are per process, so they describe one context's passes
//! only when one context runs at a time.

use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::time::{Duration, Instant};

/// The sections of a decoder's forward pass, in the order a layer runs them.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Section {
    /// The token embeddings and the pass's rotary tables and attention tiles.
    Inputs,
    /// RMS norms, residual adds, biases and Q/K norms: the per-row steps between products.
    Norms,
    /// The Q/K/V product(s).
    Qkv,
    /// Rotating queries and keys, writing keys and values into the cache.
    RopeKvWrite,
    Attention,
    /// The attention output product.
    Wo,
    /// The gate and up products with the gated activation.
    GateUp,
    Down,
    /// The final norm and the output head (the rows that want logits).
    Head,
}

impl Section {
    pub const ALL: [Section; 9] = [
        Section::Inputs,
        Section::Norms,
        Section::Qkv,
        Section::RopeKvWrite,
        Section::Attention,
        Section::Wo,
        Section::GateUp,
        Section::Down,
        Section::Head,
    ];

    pub fn name(self) -> &'static str {
        match self {
            Section::Inputs => "inputs",
            Section::Norms => "norms, adds",
            Section::Qkv => "qkv",
            Section::RopeKvWrite => "rope, kv write",
            Section::Attention => "attention",
            Section::Wo => "wo",
            Section::GateUp => "gate, up",
            Section::Down => "down",
            Section::Head => "head",
        }
    }
}

static ENABLED: AtomicBool = AtomicBool::new(false);
static NANOS: [AtomicU64; Section::ALL.len()] = [const { AtomicU64::new(0) }; Section::ALL.len()];

/// Turns the timing of forward passes on or off (off by default), the worker pool's
/// accounting of its threads' time included ([`crate::pool::PoolStats`]).
pub fn enable(on: bool) {
    ENABLED.store(on, Ordering::Relaxed);
}

/// Serialises the tests that turn timing on and off (the switch is per process).
#[cfg(test)]
pub(crate) static TIMING: std::sync::Mutex<()> = std::sync::Mutex::new(());

/// Whether forward passes are being timed.
#[inline]
pub fn enabled() -> bool {
    ENABLED.load(Ordering::Relaxed)
}

/// The time spent in each section since the last call, and resets it.
pub fn take() -> Vec<(Section, Duration)> {
    Section::ALL
        .iter()
        .map(|&s| {
            let nanos = NANOS[s as usize].swap(0, Ordering::Relaxed);
            (s, Duration::from_nanos(nanos))
        })
        .collect()
}

/// Times a pass's sections one after the other: each [`Clock::lap`] adds the time since the
/// previous one (or since [`Clock::start`]) to its section.
pub struct Clock(Option<Instant>);

impl Clock {
    pub fn start() -> Self {
        Clock(ENABLED.load(Ordering::Relaxed).then(Instant::now))
    }

    #[inline]
    pub fn lap(&mut self, section: Section) {
        if let Some(last) = &mut self.0 {
            let now = Instant::now();
            let nanos = now.duration_since(*last).as_nanos() as u64;
            NANOS[section as usize].fetch_add(nanos, Ordering::Relaxed);
            *last = now;
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_lap_adds_the_time_since_the_last_to_its_section() {
        // other tests' passes may be timed while this one has timing on: lower bounds only
        let _timing = TIMING.lock().unwrap_or_else(|e| e.into_inner());
        enable(true);
        let mut clock = Clock::start();
        std::thread::sleep(Duration::from_millis(2));
        clock.lap(Section::Attention);
        enable(false);
        let times = take();
        assert_eq!(
            times.iter().map(|(s, _)| *s).collect::<Vec<_>>(),
            Section::ALL.to_vec()
        );
        let attention = times.iter().find(|(s, _)| *s == Section::Attention);
        assert!(attention.unwrap().1 >= Duration::from_millis(2));
        // a clock started while timing is off never records
        let mut off = Clock::start();
        off.lap(Section::Down);
        assert!(off.0.is_none());
    }
}
