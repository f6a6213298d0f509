/// Whether every byte of `data` is zero.
///
/// Compares 16 bytes at a time on aligned words and stops at the first non-zero byte,
/// so a data chunk usually costs a few bytes and a zero chunk runs at memory speed.
pub fn is_zero(data: &[u8]) -> bool {
    // Split off an unaligned head so the body is read as aligned 16-byte words.
    let (head, body) = data.split_at(data.len().min(data.as_ptr().align_offset(16)));
    if head.iter().any(|&b| b != 0) {
        return false;
    }
    let mut words = body.chunks_exact(64);
    for block in &mut words {
        let mut acc = 0u128;
        for w in block.chunks_exact(16) {
            acc |= u128::from_ne_bytes(w.try_into().expect("16 bytes"));
        }
        if acc != 0 {
            return false;
        }
    }
    words.remainder().iter().all(|&b| b == 0)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn finds_any_nonzero_byte() {
        let mut buf = vec![0u8; 4096 + 37];
        assert!(is_zero(&buf));
        assert!(is_zero(&buf[3..]));
        for pos in [0, 1, 15, 16, 63, 64, 1000, 4095, 4096 + 36] {
            buf[pos] = 1;
            assert!(!is_zero(&buf), "byte {pos}");
            assert!(is_zero(&buf[pos + 1..]), "after {pos}");
            buf[pos] = 0;
        }
        assert!(is_zero(&[]));
    }
}
