//! Volume data in frames: compressed with zstd when asked and that saves at least 1/8,
//! else raw (random or already-compressed data costs no CPU on the receiving side).

use crate::proto::{DataFrame, data_frame::Payload};
use chunker::{ChunkKey, PAGE_HASH_LEN, PAGE_SIZE, is_zero, page_hashes};
use tonic::codegen::Bytes;

/// zstd level for frames: fast enough to keep up with a network link on one core.
const LEVEL: i32 = 1;

/// `data` compressed at [`LEVEL`] with this thread's context.
fn compress(data: &[u8]) -> std::io::Result<Vec<u8>> {
    chunker::zstd_ctx::compress(data, LEVEL)
}

/// A frame of `data` at `offset`, compressed if it pays.
///
/// Large pieces are first judged by compressing a 4 KiB sample: random or already
/// compressed data (most of a database or media volume) then costs almost no CPU.
pub fn data_frame(offset: u64, data: &[u8]) -> DataFrame {
    data_frame_of(offset, Bytes::copy_from_slice(data))
}

/// [`data_frame`] of shared bytes: sent raw, they are not copied.
pub fn data_frame_of(offset: u64, data: Bytes) -> DataFrame {
    frame_of(offset, data, true)
}

/// A frame of `data` at `offset`, compressed if `compress` and it pays, else raw (and
/// then not copied).
pub fn frame_of(offset: u64, data: Bytes, compress: bool) -> DataFrame {
    let len = data.len() as u64;
    let compressed = (compress && worth_compressing(&data)).then(|| self::compress(&data));
    let payload = match compressed {
        Some(Ok(z)) if z.len() < data.len() - data.len() / 8 => Payload::Zstd(Bytes::from(z)),
        _ => Payload::Data(data),
    };
    DataFrame {
        offset,
        payload: Some(payload),
        len,
    }
}

/// Whether a sample of `data` compresses by at least 1/8.
fn worth_compressing(data: &[u8]) -> bool {
    const SAMPLE: usize = 4096;
    if data.len() <= 2 * SAMPLE {
        return true;
    }
    let sample = &data[..SAMPLE];
    compress(sample).is_ok_and(|z| z.len() < SAMPLE - SAMPLE / 8)
}

/// A frame saying `len` bytes at `offset` are zeros.
pub fn zero_frame(offset: u64, len: u64) -> DataFrame {
    DataFrame {
        offset,
        payload: Some(Payload::Zeros(len)),
        len,
    }
}

/// What a frame asks the receiver to do.
pub enum Content {
    /// Write these bytes.
    Bytes(Bytes),
    /// Make this many bytes read as zeros.
    Zeros(u64),
}

/// Decodes a frame; errors name what is wrong with it.
pub fn content(frame: &DataFrame) -> Result<Content, String> {
    match &frame.payload {
        Some(Payload::Data(b)) if b.len() as u64 == frame.len => Ok(Content::Bytes(b.clone())),
        Some(Payload::Zstd(z)) => {
            let out = chunker::zstd_ctx::decompress(z, frame.len as usize)
                .map_err(|e| format!("frame at offset {}: bad zstd data: {e}", frame.offset))?;
            if out.len() as u64 != frame.len {
                return Err(format!(
                    "frame at offset {}: decompressed to {} bytes, expected {}",
                    frame.offset,
                    out.len(),
                    frame.len
                ));
            }
            Ok(Content::Bytes(Bytes::from(out)))
        }
        Some(Payload::Zeros(n)) => Ok(Content::Zeros(*n)),
        Some(Payload::Data(_)) => Err(format!("frame at offset {}: length mismatch", frame.offset)),
        None => Err(format!("frame at offset {} has no payload", frame.offset)),
    }
}

/// The frames that turn a holder of `their_pages` (page hashes, or empty for zeros) into
/// `data` at `offset`: differing pages, merged into runs; zero runs as zero frames. Data
/// runs are compressed where that pays if `compress`, else sent raw.
pub fn chunk_frames(
    key: &ChunkKey,
    data: &Bytes,
    offset: u64,
    their_pages: &[u8],
    compress: bool,
) -> Vec<DataFrame> {
    if their_pages.is_empty() {
        // Onto zeros, zero pages need nothing.
        return page_frames(data, offset, |_| true, false, compress);
    }
    let mut mine = Vec::new();
    page_hashes(key, data, &mut mine);
    let differs = |i: usize| {
        let h = i * PAGE_HASH_LEN..(i + 1) * PAGE_HASH_LEN;
        their_pages.get(h.clone()) != mine.get(h)
    };
    page_frames(data, offset, differs, true, compress)
}

/// The frames that bring a holder of `data` but for the pages `written` marks up to
/// date: those pages, as [`chunk_frames`] would send differing ones.
pub fn written_frames(
    data: &Bytes,
    offset: u64,
    written: &[bool],
    compress: bool,
) -> Vec<DataFrame> {
    page_frames(data, offset, |i| written[i], true, compress)
}

/// The frames of the pages of `data` for which `wanted(index)` holds, merged into runs;
/// zero runs as zero frames, or, without `zeros`, left out. A page not wanted is not
/// looked at: a cycle's window holds a few changed pages among zeros that only stand in
/// for what was not read (checking each of them for zeros was about 3% of the primary's
/// CPU in a cycle).
fn page_frames(
    data: &Bytes,
    offset: u64,
    wanted: impl Fn(usize) -> bool,
    zeros: bool,
    compress: bool,
) -> Vec<DataFrame> {
    let mut frames = Vec::new();
    let mut run: Option<(bool, usize, usize)> = None; // (zero, start, end)
    let flush = |run: (bool, usize, usize), frames: &mut Vec<DataFrame>| {
        let (zero, s, e) = run;
        if zero {
            frames.push(zero_frame(offset + s as u64, (e - s) as u64));
        } else {
            frames.push(frame_of(offset + s as u64, data.slice(s..e), compress));
        }
    };
    for (i, page) in data.chunks(PAGE_SIZE).enumerate() {
        // Some(whether it is zeros) for a page that goes out.
        let taken = wanted(i)
            .then(|| is_zero(page))
            .filter(|&zero| zeros || !zero);
        let (s, e) = (i * PAGE_SIZE, i * PAGE_SIZE + page.len());
        match (&mut run, taken) {
            (Some((z, _, end)), Some(zero)) if *z == zero && *end == s => *end = e,
            (_, Some(zero)) => {
                if let Some(r) = run.take() {
                    flush(r, &mut frames);
                }
                run = Some((zero, s, e));
            }
            (_, None) => {
                if let Some(r) = run.take() {
                    flush(r, &mut frames);
                }
            }
        }
    }
    if let Some(r) = run {
        flush(r, &mut frames);
    }
    frames
}

/// Bytes this frame occupies on the wire (payload only).
pub fn wire_len(frame: &DataFrame) -> u64 {
    match &frame.payload {
        Some(Payload::Data(b)) | Some(Payload::Zstd(b)) => b.len() as u64,
        _ => 8,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn compresses_only_when_it_pays_and_round_trips() {
        let text = b"mover ".repeat(10_000);
        let f = data_frame(4096, &text);
        assert!(matches!(f.payload, Some(Payload::Zstd(_))));
        assert!(wire_len(&f) < 1000);
        let Content::Bytes(b) = content(&f).unwrap() else {
            panic!()
        };
        assert_eq!(&b[..], &text[..]);

        let mut random = vec![0u8; 65536];
        rand::RngCore::fill_bytes(
            &mut <rand::rngs::StdRng as rand::SeedableRng>::seed_from_u64(1),
            &mut random,
        );
        let f = data_frame(0, &random);
        assert!(
            matches!(f.payload, Some(Payload::Data(_))),
            "incompressible data is sent raw"
        );
        let Content::Bytes(b) = content(&f).unwrap() else {
            panic!()
        };
        assert_eq!(&b[..], &random[..]);
    }

    #[test]
    fn chunk_frames_carry_only_differing_pages() {
        let key = ChunkKey::local();
        let page = |b: u8| vec![b; PAGE_SIZE];
        let theirs: Vec<u8> = [page(1), page(2), page(3), page(4)].concat();
        let mine: Vec<u8> = [page(1), page(9), page(0), page(4)].concat();
        let mut their_hashes = Vec::new();
        page_hashes(&key, &theirs, &mut their_hashes);
        let mine = Bytes::from(mine);
        let f = chunk_frames(&key, &mine, 1 << 20, &their_hashes, true);
        // Page 1 changed (data), page 2 cleared (a zero run); pages 0 and 3 are equal.
        assert_eq!(f.len(), 2);
        assert_eq!(
            (f[0].offset, f[0].len),
            ((1 << 20) + PAGE_SIZE as u64, PAGE_SIZE as u64)
        );
        assert!(matches!(content(&f[0]).unwrap(), Content::Bytes(b) if b[..] == page(9)[..]));
        assert_eq!(
            (f[1].offset, f[1].len),
            ((1 << 20) + 2 * PAGE_SIZE as u64, PAGE_SIZE as u64)
        );
        assert!(matches!(f[1].payload, Some(Payload::Zeros(_))));

        // Onto zeros (no hashes): every non-zero page, adjacent ones merged; zero pages skipped.
        let f = chunk_frames(&key, &mine, 0, &[], true);
        assert_eq!(
            f.iter().map(|f| (f.offset, f.len)).collect::<Vec<_>>(),
            vec![
                (0, 2 * PAGE_SIZE as u64),
                (3 * PAGE_SIZE as u64, PAGE_SIZE as u64)
            ]
        );
    }

    #[test]
    fn written_frames_carry_the_written_pages_and_their_zeros_only() {
        let page = |b: u8| vec![b; PAGE_SIZE];
        let data = Bytes::from([page(1), page(0), page(2), page(3), page(0), page(0)].concat());
        let written = [true, true, false, true, false, true];
        let f = written_frames(&data, 1 << 20, &written, false);
        let at = |p: u64| (1 << 20) + p * PAGE_SIZE as u64;
        let got: Vec<_> = f
            .iter()
            .map(|f| {
                let zeros = matches!(f.payload, Some(Payload::Zeros(_)));
                (f.offset, f.len, zeros)
            })
            .collect();
        // Pages 2 and 4 were not written: nothing of them goes out, not even their zeros.
        let page_len = PAGE_SIZE as u64;
        assert_eq!(
            got,
            vec![
                (at(0), page_len, false),
                (at(1), page_len, true),
                (at(3), page_len, false),
                (at(5), page_len, true),
            ]
        );
        assert!(matches!(content(&f[2]).unwrap(), Content::Bytes(b) if b[..] == page(3)[..]));
    }

    #[test]
    fn frames_not_to_be_compressed_go_raw() {
        let key = ChunkKey::local();
        let text = Bytes::from(b"mover ".repeat(10_000));
        for compress in [true, false] {
            let f = chunk_frames(&key, &text, 0, &[], compress);
            assert_eq!(f.len(), 1);
            assert_eq!(matches!(f[0].payload, Some(Payload::Zstd(_))), compress);
            let Content::Bytes(b) = content(&f[0]).unwrap() else {
                panic!()
            };
            assert_eq!(b, text);
        }
    }

    #[test]
    fn rejects_inconsistent_frames() {
        let mut f = data_frame(0, &[1, 2, 3]);
        f.len = 4;
        assert!(content(&f).is_err());
        let mut z = data_frame(0, &[0u8; 1000]);
        z.len = 999;
        assert!(content(&z).is_err());
    }
}
