//! A byte buffer whose start is aligned for direct I/O, so volume reads land in it
//! without a bounce copy (see [`crate::direct`]).

use crate::direct::ALIGN;
use std::{
    alloc::{self, Layout},
    ops::{Deref, DerefMut},
    ptr::NonNull,
    sync::Mutex,
};

/// Freed allocations kept for the next buffer: a read window is allocated per group and
/// freed once its data is sent or written, and a fresh allocation costs a page fault and
/// a clearing per 4 KiB (measured: a seventh of a push's CPU).
static POOL: Mutex<Vec<Allocation>> = Mutex::new(Vec::new());
/// Bytes the pool keeps at most (what a few windows in flight need).
const POOL_BYTES: usize = 64 << 20;

/// A freed allocation: its address and capacity.
struct Allocation(NonNull<u8>, usize);

// SAFETY: an allocation in the pool is owned by nobody but the pool.
#[allow(unsafe_code)]
unsafe impl Send for Allocation {}

/// Owned bytes starting at an [`ALIGN`]-aligned address.
pub struct AlignedBuf {
    ptr: NonNull<u8>,
    len: usize,
    cap: usize,
}

// SAFETY: an AlignedBuf owns its allocation outright, like a Vec<u8>; sharing `&self`
// only hands out `&[u8]`.
#[allow(unsafe_code)]
unsafe impl Send for AlignedBuf {}
#[allow(unsafe_code)]
unsafe impl Sync for AlignedBuf {}

impl AlignedBuf {
    /// An empty buffer (no allocation).
    pub const fn new() -> Self {
        AlignedBuf {
            // A dangling pointer with the right alignment, never dereferenced for cap 0.
            ptr: NonNull::<[u8; ALIGN]>::dangling().cast(),
            len: 0,
            cap: 0,
        }
    }

    /// Sets the length to `len`; bytes that were not part of the buffer read as zero.
    #[allow(unsafe_code)]
    pub fn resize(&mut self, len: usize) {
        if len > self.cap {
            let Allocation(fresh, cap) = take(len.next_multiple_of(ALIGN));
            // SAFETY: both regions are valid for `self.len` bytes and do not overlap, and
            // the rest of the new one, up to `len`, is within its capacity.
            unsafe {
                std::ptr::copy_nonoverlapping(self.ptr.as_ptr(), fresh.as_ptr(), self.len);
                fresh.as_ptr().add(self.len).write_bytes(0, len - self.len);
            }
            self.free();
            (self.ptr, self.cap) = (fresh, cap);
        } else if len > self.len {
            // SAFETY: [self.len, len) lies within the allocation (len <= cap).
            unsafe {
                self.ptr
                    .as_ptr()
                    .add(self.len)
                    .write_bytes(0, len - self.len)
            };
        }
        self.len = len;
    }

    #[allow(unsafe_code)]
    fn free(&mut self) {
        if self.cap == 0 {
            return;
        }
        let cap = std::mem::take(&mut self.cap);
        {
            let mut pool = POOL.lock().expect("pool lock");
            if pool.iter().map(|a| a.1).sum::<usize>() + cap <= POOL_BYTES {
                pool.push(Allocation(self.ptr, cap));
                return;
            }
        }
        let layout = Layout::from_size_align(cap, ALIGN).expect("a valid layout");
        // SAFETY: allocated by `take` with exactly this layout, and freed once.
        unsafe { alloc::dealloc(self.ptr.as_ptr(), layout) };
    }
}

/// An allocation of at least `cap` bytes (a multiple of ALIGN): a pooled one, or new.
#[allow(unsafe_code)]
fn take(cap: usize) -> Allocation {
    {
        let mut pool = POOL.lock().expect("pool lock");
        if let Some(i) = pool.iter().position(|a| a.1 >= cap) {
            return pool.swap_remove(i);
        }
    }
    let layout = Layout::from_size_align(cap, ALIGN).expect("a valid layout");
    // SAFETY: `layout` has a non-zero size (callers ask for more than they have).
    let fresh = unsafe { alloc::alloc(layout) };
    match NonNull::new(fresh) {
        Some(p) => Allocation(p, cap),
        None => alloc::handle_alloc_error(layout),
    }
}

impl Default for AlignedBuf {
    fn default() -> Self {
        AlignedBuf::new()
    }
}

impl Drop for AlignedBuf {
    fn drop(&mut self) {
        self.free();
    }
}

impl Deref for AlignedBuf {
    type Target = [u8];
    #[allow(unsafe_code)]
    fn deref(&self) -> &[u8] {
        // SAFETY: `ptr` is valid for `len` initialised bytes (zeroed or written), or
        // dangling-but-aligned with len 0.
        unsafe { std::slice::from_raw_parts(self.ptr.as_ptr(), self.len) }
    }
}

impl DerefMut for AlignedBuf {
    #[allow(unsafe_code)]
    fn deref_mut(&mut self) -> &mut [u8] {
        // SAFETY: as in `deref`, and `&mut self` makes the access unique.
        unsafe { std::slice::from_raw_parts_mut(self.ptr.as_ptr(), self.len) }
    }
}

impl AsRef<[u8]> for AlignedBuf {
    fn as_ref(&self) -> &[u8] {
        self
    }
}

impl Clone for AlignedBuf {
    fn clone(&self) -> Self {
        let mut copy = AlignedBuf::new();
        copy.resize(self.len);
        copy.copy_from_slice(self);
        copy
    }
}

impl std::fmt::Debug for AlignedBuf {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "AlignedBuf({} bytes)", self.len)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn grows_aligned_zeroed_and_keeps_its_bytes() {
        let mut b = AlignedBuf::new();
        assert!(b.is_empty());
        b.resize(10_000);
        assert_eq!(b.as_ptr() as usize % ALIGN, 0);
        assert!(b.iter().all(|&x| x == 0));
        b[9_999] = 7;
        b[0] = 1;
        b.resize(5);
        b.resize(10_000); // regrown within capacity: the tail is zero again
        assert_eq!((b[0], b[9_999]), (1, 0));
        b.resize(3 << 20);
        assert_eq!(b.as_ptr() as usize % ALIGN, 0);
        assert_eq!(b[0], 1);
        assert_eq!(b.clone()[..], b[..]);
    }
}
