//! The engine's worker pool for matrix products and attention.
//!
//! candle's pool sizes itself once per process and its idle workers spin for about half a
//! millisecond; inside the BEAM, whose schedulers also busy-wait, that spinning competes with
//! the threads that have work. This pool:
//!
//! * runs a call on the calling thread plus `n - 1` workers, where `n` is the calling
//!   context's `n_threads` (see [`with_threads`]); workers are started on first need;
//! * lets idle workers spin only for [`SPIN`] (long enough to bridge the serial steps between
//!   the products of one forward pass and the Server's turn between two passes), and only
//!   those within the last call's thread count, then park them, so between requests they
//!   use no CPU;
//! * gives each thread its first chunk of a call by its place in the call and hands the rest
//!   out through a shared cursor, so a preempted thread delays only its own chunk, while a
//!   short call (a decode step's products) is split in fewer chunks, down to one per thread
//!   touching no shared line at all ([`for_each_chunk_in`]);
//! * or gives each thread one contiguous share, walked in order, and lets a thread that
//!   finishes first take the back half of another's rest ([`for_each_split`]: a single
//!   row's product, whose weights each thread then reads as one stream);
//! * runs a call inline when the pool is already busy (another context computing on another
//!   thread, or a nested call), instead of waiting for it.

use std::any::Any;
use std::cell::{Cell, UnsafeCell};
use std::panic::{catch_unwind, resume_unwind, AssertUnwindSafe};
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex, OnceLock, TryLockError};
use std::thread::Thread;
use std::time::{Duration, Instant};

/// How long an idle worker polls for the next call before it sleeps. Long enough to span the
/// Server's turn between two steps (the outcome to the VM, the next tick, the next step to
/// the engine thread: ~150–300 µs on 2 vCPUs), so that a step does not begin by unparking a
/// worker whose wake-up a VM's scheduler can delay by tens to hundreds of microseconds.
const SPIN: Duration = Duration::from_micros(400);
/// Polls between two reads of the clock while spinning.
const SPINS_PER_CLOCK_READ: u32 = 64;
/// Hard cap on workers, whatever `n_threads` asks for.
const MAX_WORKERS: usize = 255;
/// Work items handed out per thread and call: more balances better, fewer contend less.
pub(crate) const GRABS_PER_THREAD: usize = 8;

thread_local! {
    /// Threads (the caller included) that calls from this thread may use.
    static THREADS: Cell<usize> = const { Cell::new(0) };
    /// This thread's place in the calls it runs: 0 for a caller, `id + 1` for worker `id`
    /// (the workers of a call are `0..active`, so the places of a call are distinct).
    static PLACE: Cell<usize> = const { Cell::new(0) };
}

/// The number of threads a call from this thread uses when none was set: the machine's
/// available parallelism.
pub fn default_threads() -> usize {
    std::thread::available_parallelism().map_or(1, |n| n.get())
}

/// The most threads a context may ask for: twice the machine's cores. More only time-slice
/// the same cores (a 2-token generate with 32 threads on 2 cores ran for minutes).
pub fn max_threads() -> usize {
    (2 * default_threads()).min(MAX_WORKERS + 1)
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

/// The threads (the caller included) a parallel call from this thread would use.
pub fn threads() -> usize {
    match THREADS.with(|t| t.get()) {
        0 => default_threads(),
        n => n,
    }
}

/// Counters of the pool, for diagnostics.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct PoolStats {
    pub workers: usize,
    /// Times a worker stopped waiting: once per call it takes part in, plus calls it noticed
    /// while spinning after its last one.
    pub wakeups: usize,
    /// Times a call had to unpark a sleeping worker (a system call, then the scheduler's
    /// latency before the worker runs).
    pub unparks: usize,
    /// Time workers spent running calls' jobs, counted while [`crate::profile`] times
    /// passes: against the workers' share of the wall time, how much of it they are idle
    /// (the caller's serial steps, waking, uneven shares).
    pub helper_work: Duration,
    /// Time callers spent publishing calls on the pool and running their own part of them,
    /// counted while [`crate::profile`] times passes; the rest of a caller's time, but for
    /// [`Self::join_wait`], is serial: steps no worker can help with.
    pub caller_work: Duration,
    /// Time callers spent waiting for their helpers after finishing their own part of a
    /// call, counted while [`crate::profile`] times passes (late starts, uneven shares,
    /// preempted helpers).
    pub join_wait: Duration,
}

/// The pool's counters.
pub fn stats() -> PoolStats {
    let p = pool();
    PoolStats {
        workers: p.call.lock().map(|w| w.len()).unwrap_or(0),
        wakeups: p
            .shared
            .wakeups
            .iter()
            .map(|w| w.0.load(Ordering::Relaxed))
            .sum(),
        unparks: p.shared.unparks.0.load(Ordering::Relaxed),
        helper_work: Duration::from_nanos(p.shared.helper_work.0.load(Ordering::Relaxed)),
        caller_work: Duration::from_nanos(p.shared.caller_work.0.load(Ordering::Relaxed)),
        join_wait: Duration::from_nanos(p.shared.join_wait.0.load(Ordering::Relaxed)),
    }
}

/// The job workers run: a type-erased `&dyn Fn()` valid until every active worker is done.
#[derive(Clone, Copy)]
struct Job {
    call: unsafe fn(*const ()),
    data: *const (),
}

/// Bits of each count in [`Shared::state`]: the workers a call uses in the lowest, its
/// caller's team above them, the epoch above both.
const COUNT_BITS: u32 = 16;
const COUNT_MASK: u64 = (1 << COUNT_BITS) - 1;

/// A call's state word: its epoch, the workers that take part (`0..active`) and the workers
/// of the calling thread's share (`0..team`, see [`with_threads`]).
fn state_word(epoch: u64, active: usize, team: usize) -> u64 {
    (epoch << (2 * COUNT_BITS)) | ((team as u64) << COUNT_BITS) | active as u64
}

fn epoch_of(state: u64) -> u64 {
    state >> (2 * COUNT_BITS)
}

/// What a call's state asks of worker `id`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Role {
    /// Run the job.
    Work,
    /// Sit this call out but keep polling: the call had fewer items than its caller has
    /// threads (attention over 3 KV heads, a short product), and the caller's next call,
    /// microseconds away, will want this worker. Parking here cost every such call a
    /// wake-up per idle worker on the next one (futex calls, then the scheduler's latency),
    /// a cost that grows with the threads.
    Standby,
    /// Not in the caller's share (another context's threads): sleep, so the workers a
    /// context with many threads started cost nothing to later calls.
    Sleep,
}

fn role(state: u64, id: usize) -> Role {
    let id = id as u64;
    if id < state & COUNT_MASK {
        Role::Work
    } else if id < (state >> COUNT_BITS) & COUNT_MASK {
        Role::Standby
    } else {
        Role::Sleep
    }
}

/// A value alone on its cache lines (128 bytes: Intel cores fetch lines in adjacent pairs).
#[repr(align(128))]
struct Line<T>(T);

/// What the caller and the workers share, each field written by different threads on its own
/// lines: with `state`, which idle workers poll, on the lines every worker's decrement of
/// `pending` (and its count of wakeups) wrote, each write of a call stalled all the polling
/// workers, a cost that grows with the threads.
struct Shared {
    /// [`state_word`]: a new epoch per call, with the workers that take part and the
    /// caller's team, so a worker learns its [`Role`] without reading the job. Written by
    /// the caller only, like `job` beside it.
    state: Line<(AtomicU64, UnsafeCell<Job>)>,
    /// Active workers that have not finished the current job.
    pending: Line<AtomicUsize>,
    /// Per worker: parked, waiting for an unpark.
    asleep: Vec<Line<AtomicBool>>,
    /// Per worker: times it stopped waiting (see [`stats`]).
    wakeups: Vec<Line<AtomicUsize>>,
    /// Unparks by callers (see [`stats`]).
    unparks: Line<AtomicUsize>,
    /// Nanoseconds of [`PoolStats::helper_work`], [`PoolStats::caller_work`] and
    /// [`PoolStats::join_wait`].
    helper_work: Line<AtomicU64>,
    caller_work: Line<AtomicU64>,
    join_wait: Line<AtomicU64>,
    panic: Mutex<Option<Box<dyn Any + Send>>>,
}

impl Shared {
    fn state(&self) -> &AtomicU64 {
        &self.state.0 .0
    }

    fn job(&self) -> &UnsafeCell<Job> {
        &self.state.0 .1
    }
}

// SAFETY: `job` is written only by the thread holding the pool's call lock, before it bumps
// `state` (release), and read only by the workers that call counts as active, after they
// observe that state (acquire) and before they decrement `pending`; the writer waits for
// `pending` to reach zero before writing again.
unsafe impl Sync for Shared {}
// SAFETY: the raw pointer in `job` is only dereferenced under the protocol above.
unsafe impl Send for Shared {}

struct Pool {
    shared: Arc<Shared>,
    /// Held for the duration of a call; holds the workers started so far.
    call: Mutex<Vec<Thread>>,
    /// Per place in a call of [`for_each_split`]: what is left of its range, `front` in the
    /// high half and `back` in the low (only the holder of `call` uses them).
    ranges: Vec<Line<AtomicU64>>,
}

fn pool() -> &'static Pool {
    static POOL: OnceLock<Pool> = OnceLock::new();
    POOL.get_or_init(|| Pool {
        shared: Arc::new(Shared {
            state: Line((
                AtomicU64::new(0),
                UnsafeCell::new(Job {
                    call: noop,
                    data: std::ptr::null(),
                }),
            )),
            pending: Line(AtomicUsize::new(0)),
            asleep: (0..MAX_WORKERS)
                .map(|_| Line(AtomicBool::new(false)))
                .collect(),
            wakeups: (0..MAX_WORKERS)
                .map(|_| Line(AtomicUsize::new(0)))
                .collect(),
            unparks: Line(AtomicUsize::new(0)),
            helper_work: Line(AtomicU64::new(0)),
            caller_work: Line(AtomicU64::new(0)),
            join_wait: Line(AtomicU64::new(0)),
            panic: Mutex::new(None),
        }),
        call: Mutex::new(Vec::new()),
        ranges: (0..=MAX_WORKERS).map(|_| Line(AtomicU64::new(0))).collect(),
    })
}

unsafe fn noop(_: *const ()) {}

unsafe fn call_erased<F: Fn()>(data: *const ()) {
    // SAFETY: `data` points to an `F` that outlives the job (see `run_on_workers`).
    unsafe { (*(data as *const F))() }
}

/// A worker's life: `seen` is the state before the first call it is meant to run.
fn worker(shared: Arc<Shared>, id: usize, mut seen: u64) {
    PLACE.with(|p| p.set(id + 1));
    let mut spin = true;
    loop {
        seen = wait_for_call(&shared, id, seen, spin);
        shared.wakeups[id].0.fetch_add(1, Ordering::Relaxed);
        let role = role(seen, id);
        spin = role != Role::Sleep;
        if role != Role::Work {
            continue;
        }
        // SAFETY: see `Shared`: this worker is active for this state, so the job stays
        // valid until its decrement of `pending` below.
        let job = unsafe { *shared.job().get() };
        let clock = crate::profile::enabled().then(Instant::now);
        if let Err(payload) = catch_unwind(AssertUnwindSafe(|| unsafe { (job.call)(job.data) })) {
            let mut slot = shared.panic.lock().unwrap_or_else(|e| e.into_inner());
            slot.get_or_insert(payload);
        }
        if let Some(start) = clock {
            add_nanos(&shared.helper_work.0, start);
        }
        shared.pending.0.fetch_sub(1, Ordering::AcqRel);
    }
}

/// Waits until the state differs from `seen`, spinning for [`SPIN`] first when `spin`, then
/// parked until a call that uses this worker unparks it.
fn wait_for_call(shared: &Shared, id: usize, seen: u64, spin: bool) -> u64 {
    if spin {
        let start = Instant::now();
        let mut polls = 0u32;
        loop {
            let state = shared.state().load(Ordering::Acquire);
            if state != seen {
                return state;
            }
            polls += 1;
            if polls.is_multiple_of(SPINS_PER_CLOCK_READ) && start.elapsed() >= SPIN {
                break;
            }
            std::hint::spin_loop();
        }
    }
    loop {
        // announced before the check: a caller that publishes after it sees the flag and
        // unparks this thread (an unpark before the park makes the park return at once)
        shared.asleep[id].0.store(true, Ordering::SeqCst);
        let state = shared.state().load(Ordering::SeqCst);
        if state != seen && role(state, id) == Role::Work {
            shared.asleep[id].0.store(false, Ordering::SeqCst);
            return state;
        }
        std::thread::park();
    }
}

/// Adds the time since `since` to `total`; returns the reading it took, where the next span
/// can start.
fn add_nanos(total: &AtomicU64, since: Instant) -> Instant {
    let now = Instant::now();
    total.fetch_add(
        now.duration_since(since).as_nanos() as u64,
        Ordering::Relaxed,
    );
    now
}

/// Starts workers until `helpers` exist (fewer if the system refuses threads); returns how
/// many a call can use.
fn start_workers(p: &Pool, started: &mut Vec<Thread>, helpers: usize) -> usize {
    let shared = &p.shared;
    // stable while the call lock is held
    let before = shared.state().load(Ordering::Acquire);
    while started.len() < helpers {
        let (shared, id) = (shared.clone(), started.len());
        let spawned = std::thread::Builder::new()
            .name(format!("llama-engine-{id}"))
            .spawn(move || worker(shared, id, before));
        match spawned {
            Ok(handle) => started.push(handle.thread().clone()),
            Err(_) => break,
        }
    }
    helpers.min(started.len())
}

/// Runs `f` on the caller and workers `0..helpers` (started), returning when all have
/// finished; `team` (at least `helpers`) is the caller's share of workers.
fn run_on_workers<F: Fn() + Sync>(
    p: &Pool,
    started: &[Thread],
    helpers: usize,
    team: usize,
    f: &F,
) {
    let shared = &p.shared;
    // stable while the call lock is held
    let before = shared.state().load(Ordering::Acquire);
    // SAFETY: the call lock is held and the previous job's `pending` reached zero, so no
    // worker reads `job` now; `f` outlives this function, which waits for every helper.
    unsafe {
        *shared.job().get() = Job {
            call: call_erased::<F>,
            data: f as *const F as *const (),
        };
    }
    shared.pending.0.store(helpers, Ordering::Release);
    // (from before the publish: a worker's part of the call starts after it)
    let clock = crate::profile::enabled().then(Instant::now);
    let word = state_word(epoch_of(before) + 1, helpers, team);
    shared.state().store(word, Ordering::SeqCst);
    for (id, thread) in started.iter().enumerate().take(helpers) {
        if shared.asleep[id].0.swap(false, Ordering::SeqCst) {
            thread.unpark();
            shared.unparks.0.fetch_add(1, Ordering::Relaxed);
        }
    }
    let own = catch_unwind(AssertUnwindSafe(f));
    // (one reading ends the caller's part and starts its wait: together they are the call)
    let clock = clock.map(|start| add_nanos(&shared.caller_work.0, start));
    let mut polls = 0u32;
    while shared.pending.0.load(Ordering::Acquire) != 0 {
        polls += 1;
        // a helper still busy may have been preempted; let it have this core
        if polls.is_multiple_of(SPINS_PER_CLOCK_READ) {
            std::thread::yield_now();
        } else {
            std::hint::spin_loop();
        }
    }
    if let Some(start) = clock {
        add_nanos(&shared.join_wait.0, start);
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
/// thread's share of the pool (see [`with_threads`]), about [`GRABS_PER_THREAD`] ranges per
/// thread.
pub fn for_each_chunk(n_items: usize, f: impl Fn(std::ops::Range<usize>) + Sync) {
    for_each_chunk_in(n_items, GRABS_PER_THREAD, f)
}

/// [`for_each_chunk`] in about `grabs` ranges per thread. Each thread runs its first range
/// by its place in the call and takes the others from a shared cursor, one atomic add per
/// range on one cache line. On many threads a short call's ranges take well under a
/// microsecond each, about what the line takes to move between cores, so the adds queue
/// on it (a 576-row decode product on 16 threads: ~90 adds for ~15 µs of work); with
/// `grabs` = 1 every thread runs exactly its own range and none touches the cursor, as
/// llama.cpp splits short products. More ranges balance a long call better where threads
/// are preempted or slower.
pub fn for_each_chunk_in(n_items: usize, grabs: usize, f: impl Fn(std::ops::Range<usize>) + Sync) {
    if n_items == 0 {
        return;
    }
    let team = threads().min(MAX_WORKERS + 1);
    let threads = team.min(n_items);
    // a caller's place is 0: a worker running a job never gets here with the lock free
    if threads <= 1 || PLACE.with(|p| p.get()) != 0 {
        return f(0..n_items);
    }
    let p = pool();
    let mut started = match p.call.try_lock() {
        Ok(guard) => guard,
        Err(TryLockError::WouldBlock) => return f(0..n_items),
        Err(TryLockError::Poisoned(e)) => e.into_inner(),
    };
    let helpers = start_workers(p, &mut started, threads - 1);
    let places = helpers + 1;
    let chunk = n_items.div_ceil(places * grabs.max(1)).max(1);
    let first_shared = places * chunk;
    // (on its own lines: every grab writes it, while the others read `chunk` and `f`)
    let cursor = Line(AtomicUsize::new(first_shared));
    let grab = || {
        let own = PLACE.with(|p| p.get()) * chunk;
        if own < n_items {
            f(own..n_items.min(own + chunk));
        }
        if first_shared >= n_items {
            return;
        }
        loop {
            let start = cursor.0.fetch_add(chunk, Ordering::Relaxed);
            if start >= n_items {
                break;
            }
            f(start..n_items.min(start + chunk));
        }
    };
    run_on_workers(p, &started, helpers, team - 1, &grab);
}

/// A serial step cut in pieces that the threads of the pool call needing its result do
/// together: each thread, before its first task reads the result ([`Prologue::ensure`]),
/// takes pieces until none is left, then waits until the pieces others took are done. A
/// thread never waits for one that has not started (a parked worker that wakes late finds
/// the pieces taken and done), only for pieces being run, so a call whose workers must be
/// unparked loses nothing to it. Cheaper than a call of its own: no second wake-up and join.
pub struct Prologue<'a> {
    next: Line<AtomicUsize>,
    done: Line<AtomicUsize>,
    pieces: usize,
    run: &'a (dyn Fn(usize) + Sync),
}

impl<'a> Prologue<'a> {
    /// The step of `run(i)` for every piece `i` of `0..pieces`.
    pub fn new(pieces: usize, run: &'a (dyn Fn(usize) + Sync)) -> Self {
        Prologue {
            next: Line(AtomicUsize::new(0)),
            done: Line(AtomicUsize::new(0)),
            pieces,
            run,
        }
    }

    /// Returns once every piece has run, having run those this thread could take; what the
    /// pieces wrote is then visible to this thread.
    pub fn ensure(&self) {
        if self.done.0.load(Ordering::Acquire) == self.pieces {
            return;
        }
        /// Counts a piece as done when it ends, by a panic too, so that no thread waits forever.
        struct Done<'d>(&'d AtomicUsize);
        impl Drop for Done<'_> {
            fn drop(&mut self) {
                self.0.fetch_add(1, Ordering::Release);
            }
        }
        loop {
            let i = self.next.0.fetch_add(1, Ordering::Relaxed);
            if i >= self.pieces {
                break;
            }
            let _done = Done(&self.done.0);
            (self.run)(i);
        }
        let mut polls = 0u32;
        while self.done.0.load(Ordering::Acquire) < self.pieces {
            polls += 1;
            // a thread running a piece may have been preempted; let it have this core
            if polls.is_multiple_of(SPINS_PER_CLOCK_READ) {
                std::thread::yield_now();
            } else {
                std::hint::spin_loop();
            }
        }
    }
}

/// `(front, back)` of a range of [`for_each_split`] in one word.
fn pack(front: usize, back: usize) -> u64 {
    ((front as u64) << 32) | back as u64
}

fn unpack(word: u64) -> (usize, usize) {
    ((word >> 32) as usize, (word & 0xffff_ffff) as usize)
}

/// Calls `f` on every item of `0..n_items` (one item a call, in ranges of consecutive items),
/// in parallel over the calling thread's share of the pool. Each thread walks its own
/// contiguous share in order; one that finishes takes the back half of what is left of
/// another's and walks that in order, so every thread's items stay runs of consecutive
/// items (a product's weights streamed in order) while the call still ends within about an
/// item of its threads' slowest. Items must be fewer than 2³².
pub fn for_each_split(n_items: usize, f: impl Fn(usize) + Sync) {
    assert!(
        n_items < 1 << 32,
        "for_each_split takes fewer than 2^32 items"
    );
    if n_items == 0 {
        return;
    }
    let team = threads().min(MAX_WORKERS + 1);
    let threads = team.min(n_items);
    if threads <= 1 || PLACE.with(|p| p.get()) != 0 {
        return (0..n_items).for_each(f);
    }
    let p = pool();
    let mut started = match p.call.try_lock() {
        Ok(guard) => guard,
        Err(TryLockError::WouldBlock) => return (0..n_items).for_each(f),
        Err(TryLockError::Poisoned(e)) => e.into_inner(),
    };
    let helpers = start_workers(p, &mut started, threads - 1);
    let places = helpers + 1;
    let ranges = &p.ranges[..places];
    for (i, r) in ranges.iter().enumerate() {
        r.0.store(
            pack(i * n_items / places, (i + 1) * n_items / places),
            Ordering::Relaxed,
        );
    }
    // the owner of a range takes its front item; a thief halves what is left from the back
    let walk = |own: &AtomicU64| loop {
        let word = own.load(Ordering::Acquire);
        let (front, back) = unpack(word);
        if front >= back {
            return;
        }
        let taken = pack(front + 1, back);
        if own
            .compare_exchange_weak(word, taken, Ordering::AcqRel, Ordering::Acquire)
            .is_ok()
        {
            f(front);
        }
    };
    let work = || {
        let me = PLACE.with(|p| p.get());
        let own = &ranges[me].0;
        walk(own);
        let mut victim = (me + 1) % places;
        let mut dry = 0;
        while dry < places - 1 {
            if victim == me {
                victim = (victim + 1) % places;
                continue;
            }
            let other = &ranges[victim].0;
            let word = other.load(Ordering::Acquire);
            let (front, back) = unpack(word);
            // two items or more left: the owner keeps the front half
            if back > front + 1 {
                let mid = front + (back - front).div_ceil(2);
                if other
                    .compare_exchange(word, pack(front, mid), Ordering::AcqRel, Ordering::Acquire)
                    .is_ok()
                {
                    own.store(pack(mid, back), Ordering::Release);
                    walk(own);
                    dry = 0;
                }
                continue;
            }
            dry += 1;
            victim = (victim + 1) % places;
        }
    };
    run_on_workers(p, &started, helpers, team - 1, &work);
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
    fn split_calls_run_every_item_once_and_in_order_within_a_thread() {
        for threads in [2, 3, 8] {
            with_threads(threads, || {
                for n in [1usize, 2, 3, 7, 64, 1000] {
                    let hits: Vec<AtomicUsize> = (0..n).map(|_| AtomicUsize::new(0)).collect();
                    // the last item each thread ran, +1 (0: none yet)
                    let last: Vec<AtomicUsize> =
                        (0..=threads).map(|_| AtomicUsize::new(0)).collect();
                    let descending = AtomicUsize::new(0);
                    for_each_split(n, |i| {
                        hits[i].fetch_add(1, Ordering::Relaxed);
                        let me = PLACE.with(|p| p.get());
                        if last[me].swap(i + 1, Ordering::Relaxed) > i + 1 {
                            descending.fetch_add(1, Ordering::Relaxed);
                        }
                        // uneven items, so that threads steal
                        if i % 5 == 0 {
                            std::thread::sleep(Duration::from_micros(50));
                        }
                    });
                    assert!(hits.iter().all(|h| h.load(Ordering::Relaxed) == 1));
                    // a thread's items ascend: its own share, then halves stolen further on
                    // (a stolen half may lie before its own share, once per steal at most)
                    assert!(descending.load(Ordering::Relaxed) <= n / 2);
                }
            });
        }
    }

    #[test]
    fn every_item_runs_exactly_once_whatever_the_ranges_per_thread() {
        for threads in [2, 3, 8] {
            with_threads(threads, || {
                for grabs in [1, 2, 8] {
                    for n in [1usize, 2, 7, 8, 9, 64, 1000] {
                        let hits: Vec<AtomicUsize> = (0..n).map(|_| AtomicUsize::new(0)).collect();
                        let ranges = AtomicUsize::new(0);
                        for_each_chunk_in(n, grabs, |r| {
                            ranges.fetch_add(1, Ordering::Relaxed);
                            for i in r {
                                hits[i].fetch_add(1, Ordering::Relaxed);
                            }
                        });
                        assert!(hits.iter().all(|h| h.load(Ordering::Relaxed) == 1));
                        // one range per thread at most when asked for one
                        if grabs == 1 {
                            assert!(ranges.load(Ordering::Relaxed) <= threads.min(n));
                        }
                    }
                }
            });
        }
    }

    #[test]
    fn a_call_with_few_items_keeps_the_callers_other_workers_polling() {
        let word = state_word(5, 2, 7);
        assert_eq!(epoch_of(word), 5);
        let roles: Vec<Role> = (0..9).map(|id| role(word, id)).collect();
        use Role::*;
        assert_eq!(
            roles,
            [Work, Work, Standby, Standby, Standby, Standby, Standby, Sleep, Sleep]
        );
        // the most workers a call can have fit in a count
        let full = state_word(u32::MAX as u64, MAX_WORKERS, MAX_WORKERS);
        assert_eq!(role(full, MAX_WORKERS - 1), Work);
        assert_eq!(epoch_of(full), u32::MAX as u64);
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
    fn timed_calls_count_the_workers_work_and_the_callers_part_and_wait() {
        let _timing = crate::profile::TIMING
            .lock()
            .unwrap_or_else(|e| e.into_inner());
        crate::profile::enable(true);
        let nap = Duration::from_millis(2);
        // another test's call may hold the pool, and then this one runs inline: try until a
        // call ran on two threads (the caller's part item 0, the worker's item 1)
        let counted = (0..200).any(|_| {
            let before = stats();
            let places = Mutex::new(Vec::new());
            with_threads(2, || {
                for_each_chunk_in(2, 1, |r| {
                    places.lock().unwrap().push(PLACE.with(|p| p.get()));
                    std::thread::sleep(nap * (1 + r.start as u32));
                })
            });
            let mut places = places.into_inner().unwrap();
            places.sort_unstable();
            places.dedup();
            if places.len() < 2 {
                return false;
            }
            // other calls timed meanwhile only add to the totals: lower bounds
            let after = stats();
            assert!(after.helper_work - before.helper_work >= 2 * nap);
            assert!(after.caller_work - before.caller_work >= nap);
            // the caller's clock runs from before the publish to the worker's end
            let caller =
                (after.caller_work + after.join_wait) - (before.caller_work + before.join_wait);
            assert!(caller >= 2 * nap);
            true
        });
        crate::profile::enable(false);
        assert!(counted);
    }

    #[test]
    fn a_prologue_runs_each_piece_once_before_any_task_reads_it() {
        for threads in [1, 2, 3, 8] {
            with_threads(threads, || {
                for pieces in [1usize, 2, 5, 16] {
                    // each piece writes its slots with plain stores; every task checks that
                    // all pieces' writes are visible to it after `ensure`
                    let runs: Vec<AtomicUsize> = (0..pieces).map(|_| AtomicUsize::new(0)).collect();
                    let slots: Vec<std::cell::UnsafeCell<usize>> =
                        (0..pieces * 16).map(|_| 0.into()).collect();
                    struct Slots<'s>(&'s [std::cell::UnsafeCell<usize>]);
                    // SAFETY: piece `i` alone writes slots `16i..16i + 16`, and they are read
                    // only after `ensure` (which orders the writes before the reads).
                    unsafe impl Sync for Slots<'_> {}
                    impl Slots<'_> {
                        fn set(&self, j: usize) {
                            // SAFETY: see `Slots`
                            unsafe { *self.0[j].get() = j + 1 };
                        }
                        fn is_set(&self, j: usize) -> bool {
                            // SAFETY: see `Slots`
                            unsafe { *self.0[j].get() == j + 1 }
                        }
                    }
                    let shared = Slots(&slots);
                    let run = |i: usize| {
                        runs[i].fetch_add(1, Ordering::Relaxed);
                        // uneven pieces, so that threads wait for others' pieces
                        if i.is_multiple_of(3) {
                            std::thread::sleep(Duration::from_micros(100));
                        }
                        (16 * i..16 * (i + 1)).for_each(|j| shared.set(j));
                    };
                    let prologue = Prologue::new(pieces, &run);
                    let unseen = AtomicUsize::new(0);
                    for_each_chunk(64, |_| {
                        prologue.ensure();
                        if !(0..pieces * 16).all(|j| shared.is_set(j)) {
                            unseen.fetch_add(1, Ordering::Relaxed);
                        }
                    });
                    assert!(runs.iter().all(|r| r.load(Ordering::Relaxed) == 1));
                    assert_eq!(unseen.load(Ordering::Relaxed), 0);
                }
            });
        }
    }

    #[test]
    fn a_panicking_prologue_piece_reaches_the_caller_without_hanging_the_others() {
        let run = |i: usize| {
            if i == 1 {
                panic!("piece failed");
            }
        };
        let r = catch_unwind(AssertUnwindSafe(|| {
            with_threads(2, || {
                let prologue = Prologue::new(4, &run);
                for_each_chunk(64, |_| prologue.ensure())
            })
        }));
        assert!(r.is_err());
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
