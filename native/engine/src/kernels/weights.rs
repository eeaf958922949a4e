//! Where the kernels' repacked weights live once a model is loaded.
//!
//! Matrices are built in `Vec`s (packed from the file's bytes, stacked), then
//! [`pin`] copies all of a model's into one allocation aligned to and advised for 2 MB pages.
//! Decode streams every weight once per token, most of them in matrices of 0.2–2 MB (a layer's
//! Q/K/V, output, gate/up and down products); in 4 KB pages each product starts on pages
//! the TLB has never seen. Gemma 3's single-stream decode on the AVX2 path ran 23–28% faster
//! inside the BEAM with the host's transparent huge pages set to `always`; this gets that
//! under the default `madvise` setting. On a machine with several NUMA nodes a large region's
//! pages are spread over them (every thread reads every weight each token). Off Linux, or
//! when the allocation fails, the matrices keep their `Vec`s.

use std::alloc::Layout;
use std::marker::PhantomData;
use std::ptr::NonNull;
use std::sync::Arc;

const HUGE_PAGE: usize = 2 << 20;
/// The smallest region whose pages are spread over NUMA nodes ([`crate::pages::spread_over_nodes`]).
const SPREAD_MIN: usize = 64 << 20;
/// Each array starts on a cache line.
const ALIGN: usize = 64;

/// One allocation of pinned weights, freed when its last [`Store`] goes.
pub(crate) struct Region {
    ptr: NonNull<u8>,
    layout: Layout,
}

// SAFETY: a region is written only while `pin` fills it, through the one `Arc` that exists
// then; afterwards it is only read.
unsafe impl Send for Region {}
unsafe impl Sync for Region {}

impl Region {
    fn new(bytes: usize) -> Option<Region> {
        let size = bytes.checked_next_multiple_of(HUGE_PAGE)?;
        let layout = Layout::from_size_align(size, HUGE_PAGE).ok()?;
        // SAFETY: `size` is non-zero (callers skip empty models); the memory is left
        // uninitialised until `pin` copies the weights in, and nothing reads it before.
        let ptr = NonNull::new(unsafe { std::alloc::alloc(layout) })?;
        #[cfg(target_os = "linux")]
        // SAFETY: the range is this allocation, untouched so far, so its pages are faulted
        // in huge when the copies first write them; the advice is a hint and a failure
        // (no THP in the kernel) changes nothing else.
        unsafe {
            libc::madvise(ptr.as_ptr().cast(), size, libc::MADV_HUGEPAGE);
        }
        // Only regions above glibc's largest mmap threshold (32 MB) are surely fresh mappings
        // of their own rather than reused heap; smaller models stay in the caches anyway.
        if size >= SPREAD_MIN {
            // SAFETY: as above, this allocation's pages are untouched.
            unsafe { crate::pages::spread_over_nodes(ptr.as_ptr(), size) };
        }
        Some(Region { ptr, layout })
    }
}

impl Drop for Region {
    fn drop(&mut self) {
        // SAFETY: allocated in `Region::new` with this layout.
        unsafe { std::alloc::dealloc(self.ptr.as_ptr(), self.layout) }
    }
}

/// Bytes copied between releases of the source's pages.
const COPY_STEP: usize = 4 << 20;

/// One array of a matrix: a `Vec` while the matrix is built, a slice of a [`Region`] once
/// pinned (mutating it again turns it back into a `Vec`).
pub(crate) enum Store<T> {
    Owned(Vec<T>),
    Pinned {
        region: Arc<Region>,
        at: usize,
        len: usize,
        _values: PhantomData<T>,
    },
}

impl<T: Copy> Store<T> {
    /// The values as a `Vec` to change (a pinned array is copied back out first).
    pub(crate) fn vec_mut(&mut self) -> &mut Vec<T> {
        if let Store::Pinned { .. } = self {
            *self = Store::Owned(self.to_vec());
        }
        match self {
            Store::Owned(v) => v,
            Store::Pinned { .. } => unreachable!("turned into a Vec above"),
        }
    }
}

impl<T> std::ops::Deref for Store<T> {
    type Target = [T];
    fn deref(&self) -> &[T] {
        match self {
            Store::Owned(v) => v,
            // SAFETY: `pin_into` copied `len` values of `T` to this aligned range of the
            // region, which lives as long as this `Arc` and is no longer written.
            Store::Pinned {
                region, at, len, ..
            } => unsafe {
                std::slice::from_raw_parts(region.ptr.as_ptr().add(*at).cast::<T>(), *len)
            },
        }
    }
}

impl<T> From<Vec<T>> for Store<T> {
    fn from(v: Vec<T>) -> Self {
        Store::Owned(v)
    }
}

impl<T: Copy> Clone for Store<T> {
    fn clone(&self) -> Self {
        match self {
            Store::Owned(v) => Store::Owned(v.clone()),
            Store::Pinned {
                region, at, len, ..
            } => Store::Pinned {
                region: region.clone(),
                at: *at,
                len: *len,
                _values: PhantomData,
            },
        }
    }
}

impl<T> std::fmt::Debug for Store<T> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let pinned = matches!(self, Store::Pinned { .. });
        write!(f, "Store {{ len: {}, pinned: {pinned} }}", self.len())
    }
}

/// A matrix whose arrays [`pin`] can move.
pub(crate) trait Pinnable {
    /// Calls `f` with each of its arrays.
    fn stores(&mut self, f: &mut dyn FnMut(&mut dyn PinStore));
}

/// An array of any value type, for [`pin`].
pub(crate) trait PinStore {
    /// Bytes this array takes in a region (0 once pinned).
    fn bytes(&self) -> usize;
    /// Where its values are and how many bytes they take (nothing once pinned).
    fn source(&self) -> (*const u8, usize);
    /// Points the array at `region` from `at`, where [`pin`] copied its values.
    fn point(&mut self, region: &Arc<Region>, at: usize);
}

impl<T: Copy> PinStore for Store<T> {
    fn bytes(&self) -> usize {
        match self {
            Store::Owned(v) => std::mem::size_of_val(v.as_slice()).next_multiple_of(ALIGN),
            Store::Pinned { .. } => 0,
        }
    }

    fn source(&self) -> (*const u8, usize) {
        match self {
            Store::Owned(v) => (v.as_ptr().cast(), std::mem::size_of_val(v.as_slice())),
            Store::Pinned { .. } => (std::ptr::null(), 0),
        }
    }

    fn point(&mut self, region: &Arc<Region>, at: usize) {
        let Store::Owned(v) = self else { return };
        if v.is_empty() {
            return;
        }
        *self = Store::Pinned {
            region: region.clone(),
            at,
            len: v.len(),
            _values: PhantomData,
        };
    }
}

/// One piece of [`pin`]'s copying: `len` bytes from `src` to `at` in the region.
struct Piece {
    src: *const u8,
    at: usize,
    len: usize,
}

// SAFETY: the pieces are disjoint ranges of arrays that are neither read nor freed while
// `pin` copies them.
unsafe impl Send for Piece {}
unsafe impl Sync for Piece {}

/// Moves the arrays of `matrices` into one region backed by huge pages where the system
/// has them; returns the bytes pinned (0 when nothing was: nothing to pin, or no region).
pub(crate) fn pin(matrices: &mut [&mut dyn Pinnable]) -> usize {
    if !cfg!(target_os = "linux") {
        return 0;
    }
    // one pass plans where every array goes and the pieces its copy is made of; the copies
    // (and the page faults of a fresh region) then run on the pool: one thread copied a 1B
    // model's 0.7 GB in a sixth of its load
    let (mut offsets, mut pieces, mut total) = (Vec::new(), Vec::new(), 0);
    for m in matrices.iter_mut() {
        m.stores(&mut |s| {
            let (src, n) = s.source();
            pieces.extend((0..n).step_by(COPY_STEP).map(|from| Piece {
                // SAFETY: `from < n`, inside the array
                src: unsafe { src.add(from) },
                at: total + from,
                len: COPY_STEP.min(n - from),
            }));
            offsets.push(total);
            total += s.bytes();
        });
    }
    if total == 0 {
        return 0;
    }
    let Some(region) = Region::new(total).map(Arc::new) else {
        return 0;
    };
    let base = region.ptr.as_ptr() as usize;
    crate::pool::for_each_chunk(pieces.len(), |range| {
        for piece in &pieces[range] {
            // SAFETY: each piece's destination lies inside the region (sized for `total`),
            // disjoint from every other's, and aligned for its array's values (a multiple
            // of 64 bytes from a 2 MB-aligned start); the source is its array's own memory.
            // The source's pages released after the copy belong to arrays that `point`
            // below replaces (drops) without reading them again.
            unsafe {
                std::ptr::copy_nonoverlapping(piece.src, (base + piece.at) as *mut u8, piece.len);
                crate::pages::release_pages(piece.src, piece.len);
            }
        }
    });
    let mut offsets = offsets.into_iter();
    for m in matrices.iter_mut() {
        m.stores(&mut |s| s.point(&region, offsets.next().expect("planned above")));
    }
    total
}

#[cfg(test)]
mod tests {
    use super::*;

    struct Two(Store<u8>, Store<f32>);

    impl Pinnable for Two {
        fn stores(&mut self, f: &mut dyn FnMut(&mut dyn PinStore)) {
            f(&mut self.0);
            f(&mut self.1);
        }
    }

    #[test]
    fn pinned_arrays_keep_their_values_and_turn_back_into_vecs() {
        let bytes: Vec<u8> = (0..200).map(|i| i as u8).collect();
        let floats: Vec<f32> = (0..77).map(|i| i as f32 * 0.5).collect();
        let mut a = Two(bytes.clone().into(), floats.clone().into());
        let mut b = Two(Vec::new().into(), vec![1.5f32].into());
        let pinned = pin(&mut [&mut a, &mut b]);
        if cfg!(target_os = "linux") {
            assert_eq!(pinned, 256 + 320 + 64);
            assert!(matches!(a.0, Store::Pinned { .. }) && matches!(a.1, Store::Pinned { .. }));
            assert!(
                matches!(b.0, Store::Owned(_)),
                "empty arrays stay as they are"
            );
            // every array starts on a cache line
            assert_eq!(a.1.as_ptr() as usize % ALIGN, 0);
        }
        assert_eq!(&a.0[..], &bytes[..]);
        assert_eq!(&a.1[..], &floats[..]);
        assert_eq!(&b.1[..], &[1.5]);
        let copy = a.1.clone();
        a.1.vec_mut().push(9.0);
        assert!(matches!(a.1, Store::Owned(_)));
        assert_eq!(a.1.len(), 78);
        assert_eq!(
            &copy[..],
            &floats[..],
            "a clone of a pinned array is unaffected"
        );
        drop(a);
        assert_eq!(
            &copy[..],
            &floats[..],
            "the region lives while any array uses it"
        );
    }
}
