//! Decoding a token allocates nothing once a context's buffers have grown: the forward pass,
//! the kernels' activation buffers, the attention scratch, the KV block tables and the batch
//! checks all reuse their memory. Counted with a global allocator over every thread of this
//! test binary (the calling thread and the engine's workers), so this file holds one test.

mod common;
use common::*;
use llama_cpp_ex_engine::context::{Context, ContextParams};
use llama_cpp_ex_engine::model::Requantize;
use llama_cpp_ex_engine::Batch;
use std::alloc::{GlobalAlloc, Layout, System};
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};

struct Counting;

static COUNTING: AtomicBool = AtomicBool::new(false);
static ALLOCATIONS: AtomicUsize = AtomicUsize::new(0);

fn count() {
    if COUNTING.load(Ordering::Relaxed) {
        ALLOCATIONS.fetch_add(1, Ordering::Relaxed);
    }
}

// SAFETY: every call is forwarded unchanged to the system allocator; counting touches only
// atomics, never the heap.
unsafe impl GlobalAlloc for Counting {
    unsafe fn alloc(&self, layout: Layout) -> *mut u8 {
        count();
        unsafe { System.alloc(layout) }
    }

    unsafe fn alloc_zeroed(&self, layout: Layout) -> *mut u8 {
        count();
        unsafe { System.alloc_zeroed(layout) }
    }

    unsafe fn realloc(&self, ptr: *mut u8, layout: Layout, new_size: usize) -> *mut u8 {
        count();
        unsafe { System.realloc(ptr, layout, new_size) }
    }

    unsafe fn dealloc(&self, ptr: *mut u8, layout: Layout) {
        unsafe { System.dealloc(ptr, layout) }
    }
}

#[global_allocator]
static ALLOCATOR: Counting = Counting;

/// Heap allocations made while decoding `steps` tokens one at a time after warming up.
fn allocations_per_decode(file: &str, steps: usize) -> usize {
    let model = load(file, Requantize::Off);
    let mut ctx = Context::new(
        model,
        ContextParams {
            n_ctx: 256,
            n_threads: 2,
            n_threads_batch: 2,
            ..Default::default()
        },
    )
    .unwrap();
    let prompt: Vec<u32> = (0..20u32).map(|i| 300 + i).collect();
    ctx.decode(&Batch::for_sequence(&prompt, 0, 0)).unwrap();
    let batches: Vec<Batch> = (0..steps + 2)
        .map(|i| Batch::for_sequence(&[400 + i as u32], prompt.len() + i, 0))
        .collect();
    // warm-up: buffers grow to one-token size, workers start
    ctx.decode(&batches[0]).unwrap();
    ctx.decode(&batches[1]).unwrap();
    ALLOCATIONS.store(0, Ordering::SeqCst);
    COUNTING.store(true, Ordering::SeqCst);
    for b in &batches[2..] {
        ctx.decode(b).unwrap();
    }
    COUNTING.store(false, Ordering::SeqCst);
    ALLOCATIONS.load(Ordering::SeqCst)
}

#[test]
fn decoding_a_token_allocates_nothing_once_warm() {
    // 20 steps cross a KV block boundary (positions 22..42)
    for file in [SMOLLM2, GEMMA3] {
        let n = allocations_per_decode(file, 20);
        assert_eq!(n, 0, "{file}: {n} allocations in 20 one-token decodes");
    }
}
