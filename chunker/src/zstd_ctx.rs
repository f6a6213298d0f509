//! zstd with one context per thread, kept: making a context costs more than compressing
//! a small file or chunk (measured: a tree push spent a quarter of its CPU in
//! `ZSTD_createCCtx`, and snapshots made one per blob and per compressibility sample).
//! Shared by the transport's frames and the repository's blobs.

use std::cell::RefCell;

thread_local! {
    /// This thread's compression context, with the level it is set to.
    static COMPRESSOR: RefCell<Option<(i32, zstd::bulk::Compressor<'static>)>> =
        const { RefCell::new(None) };
    static DECOMPRESSOR: RefCell<Option<zstd::bulk::Decompressor<'static>>> =
        const { RefCell::new(None) };
}

/// `data` compressed at `level` with this thread's context.
pub fn compress(data: &[u8], level: i32) -> std::io::Result<Vec<u8>> {
    with_compressor(level, |c| c.compress(data))
}

/// `data` compressed at `level` with this thread's context, appended to `out` in its
/// spare capacity (no copy, no allocation); returns the bytes appended. Fails, with
/// `out` as it was, when they do not fit: a caller that reserves only the room it would
/// spend storing `data` raw learns at once that compressing does not pay.
pub fn compress_append(data: &[u8], level: i32, out: &mut Vec<u8>) -> std::io::Result<usize> {
    let before = out.len();
    let mut tail = std::io::Cursor::new(&mut *out);
    tail.set_position(before as u64);
    let appended = with_compressor(level, |c| c.compress_to_buffer(data, &mut tail));
    if appended.is_err() {
        out.truncate(before);
    }
    appended
}

/// Runs `f` with this thread's compression context, made on first use and set to
/// `level`.
fn with_compressor<T>(
    level: i32,
    f: impl FnOnce(&mut zstd::bulk::Compressor<'static>) -> std::io::Result<T>,
) -> std::io::Result<T> {
    COMPRESSOR.with_borrow_mut(|c| {
        match c {
            Some((at, ctx)) if *at != level => {
                // A compression whose output did not fit leaves its session open, and
                // zstd refuses a new level until it is reset ("Operation not authorized
                // at current processing stage"): the next blob at another level was
                // stored raw.
                ctx.context_mut()
                    .reset(zstd::zstd_safe::ResetDirective::SessionOnly)
                    .map_err(|code| std::io::Error::other(zstd::zstd_safe::get_error_name(code)))?;
                ctx.set_compression_level(level)?;
                *at = level;
            }
            Some(_) => {}
            None => *c = Some((level, zstd::bulk::Compressor::new(level)?)),
        }
        f(&mut c.as_mut().expect("made above").1)
    })
}

/// `z` decompressed (at most `len` bytes) with this thread's context.
pub fn decompress(z: &[u8], len: usize) -> std::io::Result<Vec<u8>> {
    with_decompressor(|d| d.decompress(z, len))
}

/// `z` decompressed into `out` with this thread's context; returns the bytes written.
pub fn decompress_into(z: &[u8], out: &mut [u8]) -> std::io::Result<usize> {
    with_decompressor(|d| d.decompress_to_buffer(z, out))
}

/// Runs `f` with this thread's decompression context, made on first use.
fn with_decompressor<T>(
    f: impl FnOnce(&mut zstd::bulk::Decompressor<'static>) -> std::io::Result<T>,
) -> std::io::Result<T> {
    DECOMPRESSOR.with_borrow_mut(|d| {
        if d.is_none() {
            *d = Some(zstd::bulk::Decompressor::new()?);
        }
        f(d.as_mut().expect("made above"))
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_compression_that_did_not_fit_leaves_the_context_usable_at_another_level() {
        use rand::{RngCore, SeedableRng, rngs::StdRng};
        let mut random = vec![0u8; 1 << 16];
        StdRng::seed_from_u64(5).fill_bytes(&mut random);
        let text = b"a line of text, again and again\n".repeat(2000);
        for (first, then) in [(2, 3), (3, 2), (2, 2)] {
            // Room for the random bytes raw only: the frame does not fit.
            let mut out = Vec::with_capacity(random.len());
            assert!(compress_append(&random, first, &mut out).is_err());
            assert!(out.is_empty());
            let mut out = b"head".to_vec();
            out.reserve(text.len());
            let n = compress_append(&text, then, &mut out).expect("compressed");
            assert!(n < text.len() / 10, "{first} then {then}: {n} bytes");
            assert_eq!(decompress(&out[4..], text.len()).unwrap(), text);
        }
    }
}
