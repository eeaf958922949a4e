//! Page memory: zero-filled buffers in their own anonymous mappings whose pages can be given
//! back to the system, and the system's page size. The KV cache's blocks and the kernels'
//! pinned weights both use it; a leaf below both.

use crate::error::{EngineError, Result};

/// Zero-filled words in their own anonymous mapping: untouched pages are never committed, so
/// memory grows with the blocks actually written, and [`PageBuf::release`] hands a freed
/// block's pages back to the kernel (a cache whose blocks come in several precisions needs
/// that to stay within its byte budget).
pub struct PageBuf {
    ptr: *mut u32,
    n_words: usize,
}

// SAFETY: a PageBuf owns its mapping exclusively (like a Vec); shared access is read-only.
unsafe impl Send for PageBuf {}
unsafe impl Sync for PageBuf {}

impl PageBuf {
    pub fn new(n_words: usize) -> Result<Self> {
        if n_words == 0 {
            return Ok(PageBuf {
                ptr: std::ptr::NonNull::dangling().as_ptr(),
                n_words: 0,
            });
        }
        let bytes = n_words
            .checked_mul(4)
            .filter(|&b| b <= isize::MAX as usize)
            .ok_or_else(|| EngineError::OutOfMemory(format!("KV buffer of {n_words} words")))?;
        let ptr = map_zeroed(bytes).ok_or_else(|| {
            EngineError::OutOfMemory(format!(
                "cannot reserve {} MiB for the KV cache",
                bytes >> 20
            ))
        })?;
        Ok(PageBuf {
            ptr: ptr as *mut u32,
            n_words,
        })
    }

    pub fn words(&self) -> &[u32] {
        // SAFETY: ptr is valid for n_words initialised words (zero pages or written values)
        // for the buffer's lifetime, and u32 has no invalid bit patterns.
        unsafe { std::slice::from_raw_parts(self.ptr, self.n_words) }
    }

    pub fn words_mut(&mut self) -> &mut [u32] {
        // SAFETY: as in `words`; `&mut self` makes the borrow unique.
        unsafe { std::slice::from_raw_parts_mut(self.ptr, self.n_words) }
    }

    /// Gives the pages of words `[at, at + n)` back to the kernel; they read as zeros after.
    /// The range must be page-aligned (the callers' blocks are whole pages).
    pub fn release(&mut self, at: usize, n: usize) {
        #[cfg(unix)]
        if n > 0 {
            // SAFETY: the range lies inside this buffer's own private anonymous mapping and is
            // page-aligned; MADV_DONTNEED on such memory only drops its contents (later reads
            // see zero pages), and no reference into the range exists (`&mut self`).
            unsafe {
                libc::madvise(
                    self.ptr.add(at) as *mut libc::c_void,
                    n * 4,
                    libc::MADV_DONTNEED,
                );
            }
        }
        #[cfg(not(unix))]
        self.words_mut()[at..at + n].fill(0);
    }
}

impl Drop for PageBuf {
    fn drop(&mut self) {
        if self.n_words > 0 {
            unmap(self.ptr as *mut u8, self.n_words * 4);
        }
    }
}

#[cfg(unix)]
fn map_zeroed(bytes: usize) -> Option<*mut u8> {
    // SAFETY: an anonymous private mapping with no address hint; the result is checked.
    let p = unsafe {
        libc::mmap(
            std::ptr::null_mut(),
            bytes,
            libc::PROT_READ | libc::PROT_WRITE,
            libc::MAP_PRIVATE | libc::MAP_ANONYMOUS | libc::MAP_NORESERVE,
            -1,
            0,
        )
    };
    (p != libc::MAP_FAILED).then_some(p as *mut u8)
}

#[cfg(unix)]
fn unmap(ptr: *mut u8, bytes: usize) {
    // SAFETY: exactly the mapping `map_zeroed` returned, unmapped once (on drop).
    unsafe { libc::munmap(ptr as *mut libc::c_void, bytes) };
}

#[cfg(not(unix))]
fn map_zeroed(bytes: usize) -> Option<*mut u8> {
    use std::alloc::{alloc_zeroed, Layout};
    let layout = Layout::from_size_align(bytes, 4096).ok()?;
    // SAFETY: non-zero size (checked by the caller); the result is checked for null.
    let p = unsafe { alloc_zeroed(layout) };
    (!p.is_null()).then_some(p)
}

#[cfg(not(unix))]
fn unmap(ptr: *mut u8, bytes: usize) {
    use std::alloc::{dealloc, Layout};
    // SAFETY: allocated by `map_zeroed` with this layout.
    unsafe { dealloc(ptr, Layout::from_size_align_unchecked(bytes, 4096)) };
}

/// The system's page size, in 32-bit words.
pub fn page_words() -> usize {
    #[cfg(unix)]
    {
        // SAFETY: sysconf has no preconditions.
        let page = unsafe { libc::sysconf(libc::_SC_PAGESIZE) };
        if page > 0 {
            return page as usize / 4;
        }
    }
    1024
}

/// Hands the whole pages inside `len` bytes from `from` back to the system (they read as
/// zeros afterwards).
///
/// # Safety
/// The range must belong to memory that is not read again before it is freed (an
/// allocator's own bookkeeping lies outside the range, before it).
pub unsafe fn release_pages(from: *const u8, len: usize) {
    #[cfg(target_os = "linux")]
    {
        let page = page_words() * 4;
        let start = (from as usize).next_multiple_of(page);
        let end = (from as usize + len) / page * page;
        if end > start {
            libc::madvise(start as *mut libc::c_void, end - start, libc::MADV_DONTNEED);
        }
    }
    #[cfg(not(target_os = "linux"))]
    let _ = (from, len);
}

/// Node-mask words passed to the memory-policy calls: up to 1024 NUMA nodes.
#[cfg(target_os = "linux")]
const NODE_WORDS: usize = 16;
/// The calls' `maxnode` for a mask of [`NODE_WORDS`]: the kernel reads one bit fewer.
#[cfg(target_os = "linux")]
const MAX_NODE: libc::c_ulong = (NODE_WORDS * libc::c_ulong::BITS as usize + 1) as libc::c_ulong;

/// The NUMA nodes this process may allocate from (its cpuset's), as a bit mask, or `None`
/// where the system does not say (no NUMA support, or the call is filtered).
#[cfg(target_os = "linux")]
fn allowed_nodes() -> Option<[libc::c_ulong; NODE_WORDS]> {
    // `MPOL_F_MEMS_ALLOWED` (linux/mempolicy.h), which the libc crate does not export
    const MEMS_ALLOWED: libc::c_ulong = 1 << 2;
    let mut mask = [0 as libc::c_ulong; NODE_WORDS];
    // SAFETY: get_mempolicy writes at most `maxnode - 1` bits (rounded up to whole words)
    // into `mask`, which holds NODE_WORDS words; the mode pointer may be null.
    let r = unsafe {
        libc::syscall(
            libc::SYS_get_mempolicy,
            std::ptr::null_mut::<libc::c_int>(),
            mask.as_mut_ptr(),
            MAX_NODE,
            std::ptr::null_mut::<libc::c_void>(),
            MEMS_ALLOWED,
        )
    };
    (r == 0).then_some(mask)
}

/// Whether the process runs under the default memory policy (local allocation): not under
/// one that `numactl --interleave`, `--membind` or `--preferred` set, which is respected.
#[cfg(target_os = "linux")]
fn default_policy() -> bool {
    let mut mode: libc::c_int = -1;
    // SAFETY: with a null node mask and no flags, get_mempolicy only writes the mode.
    let r = unsafe {
        libc::syscall(
            libc::SYS_get_mempolicy,
            &mut mode as *mut libc::c_int,
            std::ptr::null_mut::<libc::c_ulong>(),
            0 as libc::c_ulong,
            std::ptr::null_mut::<libc::c_void>(),
            0 as libc::c_ulong,
        )
    };
    r == 0 && mode == libc::MPOL_DEFAULT
}

/// Asks for the pages of `len` bytes from `from` (page-aligned, not yet touched) to be
/// placed round-robin over the nodes of `mask`; whether the system took the request.
///
/// # Safety
/// The range must be a mapping this process owns whose pages nothing has touched yet (a
/// policy only places pages faulted in afterwards).
#[cfg(target_os = "linux")]
unsafe fn interleave(from: *mut u8, len: usize, mask: &[libc::c_ulong; NODE_WORDS]) -> bool {
    libc::syscall(
        libc::SYS_mbind,
        from as *mut libc::c_void,
        len as libc::c_ulong,
        libc::MPOL_INTERLEAVE as libc::c_ulong,
        mask.as_ptr(),
        MAX_NODE,
        0 as libc::c_ulong,
    ) == 0
}

/// Parses a kernel CPU or node list (`0-3,8,10-11`) into the numbers it names; `None` if it
/// is not one.
#[cfg(target_os = "linux")]
fn parse_list(list: &str) -> Option<Vec<usize>> {
    let mut out = Vec::new();
    for part in list.trim().split(',').filter(|p| !p.is_empty()) {
        let (a, b): (usize, usize) = match part.split_once('-') {
            Some((a, b)) => (a.parse().ok()?, b.parse().ok()?),
            None => {
                let n = part.parse().ok()?;
                (n, n)
            }
        };
        if b < a || b - a > 1 << 16 {
            return None;
        }
        out.extend(a..=b);
    }
    Some(out)
}

/// Drops from `mask` the nodes none of whose CPUs this process may run on (a VM pinned to
/// one socket with `taskset` or `numactl --cpunodebind`): their memory is remote to every
/// thread. Leaves `mask` as it is where the system does not say.
#[cfg(target_os = "linux")]
fn keep_nodes_with_our_cpus(mask: &mut [libc::c_ulong; NODE_WORDS]) {
    // SAFETY: a zeroed cpu_set_t is a valid empty set, filled by sched_getaffinity.
    let mut cpus: libc::cpu_set_t = unsafe { std::mem::zeroed() };
    // SAFETY: the size passed is the set's own.
    let r =
        unsafe { libc::sched_getaffinity(0, std::mem::size_of::<libc::cpu_set_t>(), &mut cpus) };
    if r != 0 {
        return;
    }
    let bits = libc::c_ulong::BITS as usize;
    for node in 0..NODE_WORDS * bits {
        if mask[node / bits] & (1 << (node % bits)) == 0 {
            continue;
        }
        let path = format!("/sys/devices/system/node/node{node}/cpulist");
        let Some(list) = std::fs::read_to_string(path)
            .ok()
            .and_then(|l| parse_list(&l))
        else {
            continue;
        };
        let ours = list.iter().any(|&cpu| {
            // SAFETY: CPU_ISSET only reads the set; out-of-range CPUs are checked first.
            cpu < libc::CPU_SETSIZE as usize && unsafe { libc::CPU_ISSET(cpu, &cpus) }
        });
        if !ours {
            mask[node / bits] &= !(1 << (node % bits));
        }
    }
}

/// On a machine with several NUMA nodes, spreads the pages of a fresh range over every node
/// the process may use (its memory and some of its CPUs), so that threads on all of them
/// read a model's weights at the combined bandwidth of every node's memory rather than
/// through the one node whose threads happened to touch each page first. Does nothing on
/// one node, or when the process runs under a memory policy of its own (`numactl`), which
/// then decides. Returns whether the pages were spread.
///
/// # Safety
/// As [`interleave`]: `len` bytes from the page-aligned `from` are an untouched mapping of
/// this process.
pub unsafe fn spread_over_nodes(from: *mut u8, len: usize) -> bool {
    #[cfg(target_os = "linux")]
    {
        let nodes =
            |mask: &[libc::c_ulong; NODE_WORDS]| mask.iter().map(|w| w.count_ones()).sum::<u32>();
        // (one node, as most machines have: no reads of the nodes' CPU lists)
        let Some(mut mask) = allowed_nodes().filter(|m| nodes(m) > 1 && default_policy()) else {
            return false;
        };
        keep_nodes_with_our_cpus(&mut mask);
        nodes(&mask) > 1 && interleave(from, len, &mask)
    }
    #[cfg(not(target_os = "linux"))]
    {
        let _ = (from, len);
        false
    }
}

#[cfg(all(test, target_os = "linux"))]
mod tests {
    use super::*;

    #[test]
    fn kernel_cpu_and_node_lists_parse() {
        assert_eq!(
            parse_list("0-3,8,10-11\n"),
            Some(vec![0, 1, 2, 3, 8, 10, 11])
        );
        assert_eq!(parse_list("5"), Some(vec![5]));
        assert_eq!(parse_list(""), Some(vec![]));
        assert_eq!(parse_list("3-1"), None);
        assert_eq!(parse_list("a-b"), None);
    }

    #[test]
    fn the_nodes_of_this_machine_with_our_cpus_are_kept() {
        let Some(mut mask) = allowed_nodes() else {
            eprintln!("memory-policy calls unavailable here: not checked");
            return;
        };
        let before = mask;
        keep_nodes_with_our_cpus(&mut mask);
        // every node kept was allowed, and this process runs somewhere
        assert!(mask.iter().zip(&before).all(|(m, b)| m & !b == 0));
        assert!(mask.iter().any(|&w| w != 0), "no node with our CPUs");
    }

    #[test]
    fn the_memory_policy_calls_are_well_formed() {
        // On this machine's one node `spread_over_nodes` leaves pages alone; the calls it
        // builds on are checked here directly, interleaving over the allowed nodes however
        // many there are (a sandbox that filters the calls skips the check).
        let Some(mask) = allowed_nodes() else {
            eprintln!("memory-policy calls unavailable here: not checked");
            return;
        };
        assert!(mask.iter().any(|&w| w != 0), "no node allowed");
        if !default_policy() {
            eprintln!("run under a memory policy of its own (numactl): not checked");
            return;
        }
        let len = 4 << 20;
        let p = map_zeroed(len).expect("map");
        // SAFETY: a fresh private mapping of `len` bytes, untouched, unmapped below.
        unsafe {
            assert!(interleave(p, len, &mask));
            std::ptr::write_bytes(p, 1, len);
            let _ = spread_over_nodes(p, len);
            assert_eq!(*p.add(len - 1), 1);
        }
        unmap(p, len);
    }
}
