//! The engine's worker pool for matrix products and attention.
//!
//! candle's pool sizes itself once per process and its idle workers spin for about half a
//! millisecond; inside the BEAM, whose schedulers also busy-wait, that spinning competes with
//! the threads that have work. This pool:
//!
//! * runs a call on the calling thread plus `n - 1` workers, where `n` is the calling
//!   context's `n_threads` (see [`with_threads`]); workers are started on first need;
//! * lets idle workers spin only for [`SPIN`] (long enough to bridge the short serial steps
//!   between the products of one forward pass), then sleep on a condition variable, so
//!   between forward passes they use no CPU;
//! * hands work out through a shared cursor, so a preempted thread delays only its own chunk;
//! * runs a call inline when the pool is already busy (another context computing on another
//!   thread, or a nested call), instead of waiting for it.

use std::any::Any;
use std::cell::{Cell, UnsafeCell};
use std::panic::{catch_unwind, resume_unwind, AssertUnwindSafe};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Condvar, Mutex, OnceLock, TryLockError};
use std::time::{Duration, Instant};

/// How long an idle worker polls for the next call before it sleeps.
const SPIN: Duration = Duration::from_micros(100);
/// Polls between two reads of the clock while spinning.
const SPINS_PER_CLOCK_READ: u32 = 64;
/// Hard cap on workers, whatever `n_threads` asks for.
const MAX_WORKERS: usize = 255;
/// Work items handed out per thread and call: more balances better, fewer contend less.
const GRABS_PER_THREAD: usize = 8;

thread_local! {
    /// Threads (the caller included) that calls from this thread may use.
    static THREADS: Cell<usize> = const { Cell::new(0) };
}

/// The number of threads a call from this thread uses when none was set: the machine's
/// available parallelism.
pub fn default_threads() -> usize {
    std::thread::available_parallelism().map_or(1, |n| n.get())
}

/// Runs `f` with parallel work from this thread limited to `n` threads (the caller and
/// `n - 1` workers).
pub fn with_threads<R>(n: usize, f: impl FnOnce() -> R) -> R {
    let previous = THREADS.with(|t| t.replace(n.max(1)));
    struct Restore(usize);
    impl Drop for Restore {
        fn drop(&mut self) {
            THREADS.with(|t| t.set(self.0));
        }
    }
    let _restore = Restore(previous);
    f()
}

fn current_threads() -> usize {
    match THREADS.with(|t| t.get()) {
        0 => default_threads(),
        n => n,
    }
}

/// The job workers run: a type-erased `&dyn Fn()` valid until every active worker is done.
#[derive(Clone, Copy)]
struct Job {
    call: unsafe fn(*const ()),
    data: *const (),
    /// Workers `0..active` take part.
    active: usize,
}

struct Shared {
    /// Bumped once per call; workers run the job of each value they see.
    epoch: AtomicUsize,
    job: UnsafeCell<Job>,
    /// Active workers that have not finished the current job.
    pending: AtomicUsize,
    sleeping: AtomicUsize,
    lock: Mutex<()>,
    wake: Condvar,
    panic: Mutex<Option<Box<dyn Any + Send>>>,
}

// SAFETY: `job` is written only by the thread holding the pool's call lock, before it bumps
// `epoch` (release), and read by workers after they observe that epoch (acquire) and before
// they decrement `pending`; the writer waits for `pending` to reach zero before writing again.
unsafe impl Sync for Shared {}
// SAFETY: the raw pointer in `job` is only dereferenced under the protocol above.
unsafe impl Send for Shared {}

struct Pool {
    shared: Arc<Shared>,
    /// Held for the duration of a call; holds the number of workers started.
    call: Mutex<usize>,
}

fn pool() -> &'static Pool {
    static POOL: OnceLock<Pool> = OnceLock::new();
    POOL.get_or_init(|| Pool {
        shared: Arc::new(Shared {
            epoch: AtomicUsize::new(0),
            job: UnsafeCell::new(Job {
                call: noop,
                data: std::ptr::null(),
                active: 0,
            }),
            pending: AtomicUsize::new(0),
            sleeping: AtomicUsize::new(0),
            lock: Mutex::new(()),
            wake: Condvar::new(),
            panic: Mutex::new(None),
        }),
        call: Mutex::new(0),
    })
}

unsafe fn noop(_: *const ()) {}

unsafe fn call_erased<F: Fn()>(data: *const ()) {
    // SAFETY: `data` points to an `F` that outlives the job (see `run_on_workers`).
    unsafe { (*(data as *const F))() }
}

/// A worker's life: `seen` is the epoch before the first call it is meant to run.
fn worker(shared: Arc<Shared>, id: usize, mut seen: usize) {
    loop {
        seen = wait_for_call(&shared, seen);
        // SAFETY: see `Shared`: the job of this epoch stays valid until `pending` is zero,
        // which needs this worker's decrement below.
        let job = unsafe { *shared.job.get() };
        if id >= job.active {
            continue;
        }
        if let Err(payload) = catch_unwind(AssertUnwindSafe(|| unsafe { (job.call)(job.data) })) {
            let mut slot = shared.panic.lock().unwrap_or_else(|e| e.into_inner());
            slot.get_or_insert(payload);
        }
        shared.pending.fetch_sub(1, Ordering::AcqRel);
    }
}

/// Waits until `epoch` differs from `seen`, spinning for [`SPIN`] first.
fn wait_for_call(shared: &Shared, seen: usize) -> usize {
    let start = Instant::now();
    let mut polls = 0u32;
    loop {
        let epoch = shared.epoch.load(Ordering::Acquire);
        if epoch != seen {
            return epoch;
        }
        polls += 1;
        if polls.is_multiple_of(SPINS_PER_CLOCK_READ) && start.elapsed() >= SPIN {
            break;
        }
        std::hint::spin_loop();
    }
    let mut guard = shared.lock.lock().unwrap_or_else(|e| e.into_inner());
    // announced before the last check: a caller that bumps the epoch after that check sees
    // `sleeping > 0` and notifies under the lock, which this thread only releases in `wait`
    shared.sleeping.fetch_add(1, Ordering::SeqCst);
    loop {
        let epoch = shared.epoch.load(Ordering::SeqCst);
        if epoch != seen {
            shared.sleeping.fetch_sub(1, Ordering::SeqCst);
            return epoch;
        }
        guard = shared.wake.wait(guard).unwrap_or_else(|e| e.into_inner());
    }
}

/// Runs `f` on the caller and `helpers` workers, returning when all have finished.
fn run_on_workers<F: Fn() + Sync>(p: &Pool, started: &mut usize, helpers: usize, f: &F) {
    let shared = &p.shared;
    // stable while the call lock is held
    let before = shared.epoch.load(Ordering::Acquire);
    while *started < helpers {
        let (shared, id) = (shared.clone(), *started);
        let spawned = std::thread::Builder::new()
            .name(format!("llama-engine-{id}"))
            .spawn(move || worker(shared, id, before));
        if spawned.is_err() {
            break;
        }
        *started += 1;
    }
    let helpers = helpers.min(*started);
    // SAFETY: the call lock is held and the previous job's `pending` reached zero, so no
    // worker reads `job` now; `f` outlives this function, which waits for every helper.
    unsafe {
        *shared.job.get() = Job {
            call: call_erased::<F>,
            data: f as *const F as *const (),
            active: helpers,
        };
    }
    shared.pending.store(helpers, Ordering::Release);
    shared.epoch.fetch_add(1, Ordering::SeqCst);
    if shared.sleeping.load(Ordering::SeqCst) > 0 {
        let _guard = shared.lock.lock().unwrap_or_else(|e| e.into_inner());
        shared.wake.notify_all();
    }
    let own = catch_unwind(AssertUnwindSafe(f));
    let mut polls = 0u32;
    while shared.pending.load(Ordering::Acquire) != 0 {
        polls += 1;
        // a helper still busy may have been preempted; let it have this core
        if polls.is_multiple_of(SPINS_PER_CLOCK_READ) {
            std::thread::yield_now();
        } else {
            std::hint::spin_loop();
        }
    }
    let worker_panic = shared
        .panic
        .lock()
        .unwrap_or_else(|e| e.into_inner())
        .take();
    if let Err(payload) = own {
        resume_unwind(payload);
    }
    if let Some(payload) = worker_panic {
        resume_unwind(payload);
    }
}

/// Calls `f` on disjoint ranges covering `0..n_items`, in parallel over the calling
/// thread's share of the pool (see [`with_threads`]).
pub fn for_each_chunk(n_items: usize, f: impl Fn(std::ops::Range<usize>) + Sync) {
    if n_items == 0 {
        return;
    }
    let threads = current_threads().min(n_items).min(MAX_WORKERS + 1);
    if threads <= 1 {
        return f(0..n_items);
    }
    let p = pool();
    let mut started = match p.call.try_lock() {
        Ok(guard) => guard,
        Err(TryLockError::WouldBlock) => return f(0..n_items),
        Err(TryLockError::Poisoned(e)) => e.into_inner(),
    };
    let chunk = n_items.div_ceil(threads * GRABS_PER_THREAD).max(1);
    let cursor = AtomicUsize::new(0);
    let grab = || loop {
        let start = cursor.fetch_add(chunk, Ordering::Relaxed);
        if start >= n_items {
            break;
        }
        f(start..n_items.min(start + chunk));
    };
    run_on_workers(p, &mut started, threads - 1, &grab);
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_item_runs_exactly_once() {
        for threads in [1, 2, 3, 8] {
            with_threads(threads, || {
                for n in [0usize, 1, 5, 64, 1000] {
                    let hits: Vec<AtomicUsize> = (0..n).map(|_| AtomicUsize::new(0)).collect();
                    for_each_chunk(n, |r| {
                        for i in r {
                            hits[i].fetch_add(1, Ordering::Relaxed);
                        }
                    });
                    assert!(hits.iter().all(|h| h.load(Ordering::Relaxed) == 1));
                }
            });
        }
    }

    #[test]
    fn sleeping_workers_wake_for_the_next_call() {
        with_threads(3, || {
            for _ in 0..3 {
                let total = AtomicUsize::new(0);
                for_each_chunk(300, |r| {
                    total.fetch_add(r.len(), Ordering::Relaxed);
                });
                assert_eq!(total.load(Ordering::Relaxed), 300);
                std::thread::sleep(SPIN * 3);
            }
        });
    }

    #[test]
    fn nested_and_concurrent_calls_run_inline() {
        let outer = AtomicUsize::new(0);
        with_threads(2, || {
            for_each_chunk(4, |r| {
                for _ in r {
                    for_each_chunk(10, |inner| {
                        outer.fetch_add(inner.len(), Ordering::Relaxed);
                    });
                }
            })
        });
        assert_eq!(outer.load(Ordering::Relaxed), 40);
        let handles: Vec<_> = (0..4)
            .map(|_| {
                std::thread::spawn(|| {
                    with_threads(2, || {
                        let n = AtomicUsize::new(0);
                        for _ in 0..50 {
                            for_each_chunk(100, |r| {
                                n.fetch_add(r.len(), Ordering::Relaxed);
                            });
                        }
                        n.load(Ordering::Relaxed)
                    })
                })
            })
            .collect();
        for h in handles {
            assert_eq!(h.join().unwrap(), 5000);
        }
    }

    #[test]
    fn a_panic_in_a_task_reaches_the_caller_and_the_pool_survives() {
        let r = catch_unwind(|| {
            with_threads(2, || {
                for_each_chunk(64, |r| {
                    if r.contains(&63) {
                        panic!("task failed");
                    }
                })
            })
        });
        assert!(r.is_err());
        let total = AtomicUsize::new(0);
        with_threads(2, || {
            for_each_chunk(64, |r| {
                total.fetch_add(r.len(), Ordering::Relaxed);
            })
        });
        assert_eq!(total.load(Ordering::Relaxed), 64);
    }
}
