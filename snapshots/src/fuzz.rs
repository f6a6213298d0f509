//! The decoders of what a repository holds (chunk lists, index deltas, pack trailers and
//! footers, page deltas, manifests), fed valid encodings that are then mutated: flipped
//! bits, random bytes, truncation, growth, huge counts spliced in. Each must answer
//! `Ok` or `Err`, never panic, and never allocate more than [`MAX_LIVE`] on the way,
//! whatever a count in the input claims. The bytes come after authentication in real
//! use, so this guards against a bug or a key leak turning into a crash, not against an
//! outsider. `MOVER_FUZZ_ITERATIONS` runs longer than CI's default.

use crate::{
    delta::apply_delta,
    index::parse_delta,
    manifest::{Manifest, decode_list, encode_list},
    pack::{
        BlobKind, ENTRIES_V2, FOOTER_LEN, PackEntry, encode_entry, parse_trailer_plain, trailer_len,
    },
};
use chunker::{ChunkId, ChunkKey, ChunkKind};
use rand::{Rng, RngCore, SeedableRng, rngs::StdRng};
use std::{
    alloc::{GlobalAlloc, Layout, System},
    cell::Cell,
};

/// The most a decoder may hold at once beyond its input.
const MAX_LIVE: usize = 16 << 20;

/// Counts this thread's live and peak heap bytes (other threads' tests do not count).
struct Tracking;

thread_local! {
    static LIVE: Cell<usize> = const { Cell::new(0) };
    static PEAK: Cell<usize> = const { Cell::new(0) };
}

#[allow(unsafe_code)]
// SAFETY: every call is forwarded to the system allocator unchanged; the counters are
// plain thread-local cells that never allocate.
unsafe impl GlobalAlloc for Tracking {
    unsafe fn alloc(&self, layout: Layout) -> *mut u8 {
        let p = unsafe { System.alloc(layout) };
        if !p.is_null() {
            grow(layout.size());
        }
        p
    }
    unsafe fn dealloc(&self, p: *mut u8, layout: Layout) {
        unsafe { System.dealloc(p, layout) };
        shrink(layout.size());
    }
    unsafe fn realloc(&self, p: *mut u8, layout: Layout, new: usize) -> *mut u8 {
        let q = unsafe { System.realloc(p, layout, new) };
        if !q.is_null() {
            shrink(layout.size());
            grow(new);
        }
        q
    }
}

fn grow(n: usize) {
    let _ = LIVE.try_with(|l| {
        l.set(l.get() + n);
        let _ = PEAK.try_with(|p| p.set(p.get().max(l.get())));
    });
}

fn shrink(n: usize) {
    let _ = LIVE.try_with(|l| l.set(l.get().saturating_sub(n)));
}

#[global_allocator]
static ALLOCATOR: Tracking = Tracking;

/// Runs `decode` on `input`: no panic, and at most [`MAX_LIVE`] more bytes live at any
/// moment than when it started.
fn check(what: &str, input: &[u8], decode: &dyn Fn(&[u8])) {
    let base = LIVE.with(Cell::get);
    PEAK.with(|p| p.set(base));
    let outcome = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| decode(input)));
    let peak = PEAK.with(Cell::get) - base;
    assert!(
        outcome.is_ok(),
        "{what} panicked on {} bytes: {:02x?}",
        input.len(),
        &input[..input.len().min(64)]
    );
    assert!(
        peak <= MAX_LIVE,
        "{what} held {peak} bytes for {} bytes of input: {:02x?}",
        input.len(),
        &input[..input.len().min(64)]
    );
}

fn iterations() -> usize {
    std::env::var("MOVER_FUZZ_ITERATIONS")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(20_000)
}

/// `valid` mutated a few times: bit flips, random bytes, a huge or random u32 spliced
/// in (counts and lengths), truncation, growth.
fn mutate(rng: &mut StdRng, valid: &[u8]) -> Vec<u8> {
    let mut b = valid.to_vec();
    for _ in 0..rng.random_range(1..4) {
        match rng.random_range(0..6) {
            0 if !b.is_empty() => {
                let i = rng.random_range(0..b.len());
                b[i] ^= 1 << rng.random_range(0..8);
            }
            1 if !b.is_empty() => {
                let i = rng.random_range(0..b.len());
                b[i] = rng.random();
            }
            2 if b.len() >= 4 => {
                let i = rng.random_range(0..=b.len() - 4);
                let v: u32 = match rng.random_range(0..3) {
                    0 => u32::MAX,
                    1 => rng.random_range(0..1 << 20),
                    _ => rng.random(),
                };
                b[i..i + 4].copy_from_slice(&v.to_le_bytes());
            }
            3 => {
                let keep = rng.random_range(0..=b.len());
                b.truncate(keep);
            }
            4 => {
                let mut more = vec![0u8; rng.random_range(1..64)];
                rng.fill_bytes(&mut more);
                b.extend_from_slice(&more);
            }
            _ => {
                let mut all = vec![0u8; rng.random_range(0..256)];
                rng.fill_bytes(&mut all);
                b = all;
            }
        }
    }
    b
}

fn random_entry(rng: &mut StdRng) -> PackEntry {
    let mut id = [0u8; 32];
    rng.fill_bytes(&mut id);
    let delta = rng.random_bool(0.3);
    PackEntry {
        kind: if delta {
            BlobKind::Delta
        } else {
            BlobKind::Data
        },
        id: ChunkId(id),
        offset: rng.random_range(8..1 << 20),
        len: rng.random_range(1..1 << 20),
        base: delta.then_some(ChunkId([7; 32])),
    }
}

fn entries(rng: &mut StdRng, n: usize) -> Vec<u8> {
    let mut out = Vec::new();
    for _ in 0..n {
        encode_entry(&random_entry(rng), &mut out);
    }
    out
}

#[test]
fn decoders_never_panic_and_never_allocate_what_a_count_claims() {
    let mut rng = StdRng::seed_from_u64(0x5eed);
    let key = ChunkKey::from_bytes([3; 32]);

    // Valid encodings to start from.
    let kinds: Vec<ChunkKind> = (0..300)
        .map(|i| {
            if i % 3 == 0 {
                ChunkKind::Zero
            } else {
                ChunkKind::Data(ChunkId([i as u8; 32]))
            }
        })
        .collect();
    let list = encode_list(&kinds);
    let mut index = b"MVIX".to_vec();
    index.extend_from_slice(&ENTRIES_V2.to_le_bytes());
    index.extend_from_slice(&2u32.to_le_bytes());
    for n in [3u32, 5] {
        index.extend_from_slice(&[n as u8; 32]);
        index.extend_from_slice(&n.to_le_bytes());
        index.extend(entries(&mut rng, n as usize));
    }
    let mut trailer = ENTRIES_V2.to_le_bytes().to_vec();
    trailer.extend_from_slice(&6u32.to_le_bytes());
    trailer.extend(entries(&mut rng, 6));
    let mut footer = (trailer.len() as u32).to_le_bytes().to_vec();
    footer.extend_from_slice(b"MVPK");
    let base: Vec<u8> = (0..64 << 10).map(|i| (i % 251) as u8).collect();
    let mut chunk = base.clone();
    chunk[5000..5100].fill(9);
    let id = key.chunk_id(&chunk);
    let (delta, _) = crate::delta::make_delta(&ChunkId([1; 32]), &base, &chunk).unwrap();
    let manifest = br#"{"version":1,"time":1,"hostname":"h","volume":"v","parent":null,
        "content":{"type":"block","size":1048576,"chunk_size":1048576,
        "chunks_per_list":65536,"lists":["00"]},
        "summary":{"data_chunks":1,"data_bytes":1,"zero_chunks":0,"new_chunks":1,
        "new_bytes":1,"stored_bytes":1,"packs":1,"duration_secs":0.1}}"#
        .to_vec();

    let tree = crate::tree::encode_tree(&crate::tree::tests::sample());
    let tree_manifest = br#"{"version":2,"time":1,"hostname":"h","volume":"v","parent":null,
        "content":{"type":"tree","root":"00","files":1,"dirs":1,"bytes":1},
        "summary":{"data_chunks":1,"data_bytes":1,"zero_chunks":0,"new_chunks":1,
        "new_bytes":1,"stored_bytes":1,"packs":1,"duration_secs":0.1,"files_read":1}}"#
        .to_vec();

    // Each valid one decodes.
    assert_eq!(crate::tree::decode_tree("t", &tree).unwrap().len(), 5);
    serde_json::from_slice::<Manifest>(&tree_manifest).unwrap();
    assert_eq!(decode_list("l", &list).unwrap(), kinds);
    assert_eq!(parse_delta("i", &index).unwrap().len(), 8);
    assert_eq!(parse_trailer_plain("p", &trailer, 0).unwrap().len(), 6);
    assert_eq!(apply_delta(&key, &id, &base, &delta).unwrap(), chunk);
    serde_json::from_slice::<Manifest>(&manifest).unwrap();

    type Decoder<'a> = (&'a str, &'a [u8], Box<dyn Fn(&[u8]) + 'a>);
    let decoders: Vec<Decoder<'_>> = vec![
        ("chunk list", &list, Box::new(|b| drop(decode_list("l", b)))),
        (
            "index delta",
            &index,
            Box::new(|b| drop(parse_delta("i", b))),
        ),
        (
            "pack trailer",
            &trailer,
            Box::new(|b| drop(parse_trailer_plain("p", b, 0))),
        ),
        (
            "pack footer",
            &footer,
            Box::new(|b| drop(trailer_len("p", b, 1 << 20).map(|_| FOOTER_LEN))),
        ),
        (
            "page delta",
            &delta,
            Box::new(|b| drop(apply_delta(&key, &id, &base, b))),
        ),
        (
            "manifest",
            &manifest,
            Box::new(|b| drop(serde_json::from_slice::<Manifest>(b))),
        ),
        (
            "tree blob",
            &tree,
            Box::new(|b| drop(crate::tree::decode_tree("t", b))),
        ),
        (
            "tree manifest",
            &tree_manifest,
            Box::new(|b| drop(serde_json::from_slice::<Manifest>(b))),
        ),
    ];
    let n = iterations();
    for (what, valid, decode) in &decoders {
        for _ in 0..n {
            let input = mutate(&mut rng, valid);
            check(what, &input, decode.as_ref());
        }
    }
}
