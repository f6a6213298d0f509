//! The index: which pack holds each blob, at what offset.
//!
//! Persisted as immutable deltas `index/<blake3 of the object>`, each sealed
//! (`nonce || AEAD(plaintext)`) with plaintext
//! `"MVIX" u32le(version) u32le(packs) { pack_id(32) u32le(n) entry*n }*`, entries
//! as in pack trailers (version 1, or 2 when a delta entry with its base is present).
//! Loaded whole into memory (about 80 bytes per blob) so dedup questions never touch the
//! backend.

use crate::{
    crypto::MasterKey,
    error::{RepoError, Result},
    pack::{
        BlobKind, ENTRIES_V1, ENTRIES_V2, PackEntry, PackId, decode_entry, encode_entry,
        entries_version, u32_at,
    },
};
use chunker::ChunkId;
use std::collections::{BTreeMap, HashMap, HashSet};

const MAGIC: &[u8; 4] = b"MVIX";
const AAD: &[u8] = b"mover index v1";

/// Where a blob is stored.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct BlobLoc {
    /// The pack.
    pub pack: PackId,
    /// What the blob holds.
    pub kind: BlobKind,
    /// Offset of the sealed blob in the pack.
    pub offset: u32,
    /// Length of the sealed blob.
    pub len: u32,
    /// For a delta blob, the data blob it applies to.
    pub base: Option<ChunkId>,
}

/// `Slot::base` of a blob that is not a delta.
const NO_BASE: u32 = u32::MAX;

#[derive(Clone, Copy, Debug)]
struct Slot {
    pack: u32,
    kind: BlobKind,
    offset: u32,
    len: u32,
    /// Index into `Index::bases`, or [`NO_BASE`].
    base: u32,
}

/// All blobs of the repository, in memory.
#[derive(Debug, Default)]
pub struct Index {
    packs: Vec<PackId>,
    pack_slot: HashMap<PackId, u32>,
    blobs: HashMap<ChunkId, Slot>,
    /// Further locations of blobs stored in more than one pack (after a repack, or
    /// when two snapshots uploaded the same new chunk at once).
    dups: Vec<(ChunkId, Slot)>,
    /// Bases of delta blobs (few: kept apart so a slot stays small).
    bases: Vec<ChunkId>,
    /// The index objects loaded, by key.
    pub(crate) files: Vec<String>,
}

impl Index {
    /// Adds a blob's location (the first location of a blob wins).
    pub fn insert(&mut self, pack: &PackId, e: &PackEntry) {
        let slot = *self.pack_slot.entry(*pack).or_insert_with(|| {
            self.packs.push(*pack);
            (self.packs.len() - 1) as u32
        });
        let base = match e.base {
            Some(b) => {
                self.bases.push(b);
                (self.bases.len() - 1) as u32
            }
            None => NO_BASE,
        };
        let new = Slot {
            pack: slot,
            kind: e.kind,
            offset: e.offset,
            len: e.len,
            base,
        };
        match self.blobs.entry(e.id) {
            std::collections::hash_map::Entry::Vacant(v) => {
                v.insert(new);
            }
            std::collections::hash_map::Entry::Occupied(o) => {
                if o.get().pack != slot {
                    self.dups.push((e.id, new));
                }
            }
        }
    }

    fn loc(&self, s: &Slot) -> BlobLoc {
        BlobLoc {
            pack: self.packs[s.pack as usize],
            kind: s.kind,
            offset: s.offset,
            len: s.len,
            base: (s.base != NO_BASE).then(|| self.bases[s.base as usize]),
        }
    }

    /// Every location of every blob, including the further copies of blobs stored twice.
    pub fn all_locations(&self) -> impl Iterator<Item = (ChunkId, BlobLoc)> + '_ {
        self.iter()
            .chain(self.dups.iter().map(|(id, s)| (*id, self.loc(s))))
    }

    /// Where the blob is, if indexed.
    pub fn get(&self, id: &ChunkId) -> Option<BlobLoc> {
        self.blobs.get(id).map(|s| self.loc(s))
    }

    /// Whether the blob is indexed.
    pub fn contains(&self, id: &ChunkId) -> bool {
        self.blobs.contains_key(id)
    }

    /// Number of blobs.
    pub fn len(&self) -> usize {
        self.blobs.len()
    }

    /// Whether there are no blobs.
    pub fn is_empty(&self) -> bool {
        self.blobs.is_empty()
    }

    /// Every pack that holds an indexed blob.
    pub fn packs(&self) -> HashSet<PackId> {
        self.blobs
            .values()
            .chain(self.dups.iter().map(|(_, s)| s))
            .map(|s| self.packs[s.pack as usize])
            .collect()
    }

    /// Every blob with its location.
    pub fn iter(&self) -> impl Iterator<Item = (ChunkId, BlobLoc)> + '_ {
        self.blobs.iter().map(|(id, s)| (*id, self.loc(s)))
    }

    /// Drops every location in one of `packs` (packs being pruned); a blob with a copy
    /// elsewhere keeps that one. A delta whose base has no location left is dropped too.
    pub fn remove_packs(&mut self, packs: &HashSet<PackId>) {
        let gone: HashSet<u32> = packs
            .iter()
            .filter_map(|p| self.pack_slot.get(p).copied())
            .collect();
        self.blobs.retain(|_, s| !gone.contains(&s.pack));
        self.dups.retain(|(_, s)| !gone.contains(&s.pack));
        for (id, s) in std::mem::take(&mut self.dups) {
            match self.blobs.entry(id) {
                std::collections::hash_map::Entry::Vacant(v) => {
                    v.insert(s);
                }
                std::collections::hash_map::Entry::Occupied(o) if o.get().pack != s.pack => {
                    self.dups.push((id, s));
                }
                _ => {}
            }
        }
        self.drop_orphan_deltas();
    }

    /// Drops every delta whose base has no location (its chunk cannot be rebuilt, so it
    /// must not count as stored).
    pub fn drop_orphan_deltas(&mut self) {
        let bases = &self.bases;
        let orphan = |s: &Slot, blobs: &HashMap<ChunkId, Slot>| {
            s.base != NO_BASE && !blobs.contains_key(&bases[s.base as usize])
        };
        let orphans: Vec<ChunkId> = (self.blobs.iter())
            .filter(|(_, s)| orphan(s, &self.blobs))
            .map(|(id, _)| *id)
            .collect();
        for id in orphans {
            self.blobs.remove(&id);
        }
        // Further copies: orphans go; a usable copy of a blob that lost its location
        // takes its place.
        for (id, s) in std::mem::take(&mut self.dups) {
            if orphan(&s, &self.blobs) {
                continue;
            }
            match self.blobs.entry(id) {
                std::collections::hash_map::Entry::Vacant(v) => {
                    v.insert(s);
                }
                std::collections::hash_map::Entry::Occupied(_) => self.dups.push((id, s)),
            }
        }
    }
}

/// Encodes a delta of blob locations into a sealed object; returns its key and bytes.
pub(crate) fn encode_delta(key: &MasterKey, entries: &[(PackId, PackEntry)]) -> (String, Vec<u8>) {
    let mut by_pack: BTreeMap<PackId, Vec<&PackEntry>> = BTreeMap::new();
    for (p, e) in entries {
        by_pack.entry(*p).or_default().push(e);
    }
    let mut t = Vec::with_capacity(12 + entries.len() * 41 + by_pack.len() * 36);
    t.extend_from_slice(MAGIC);
    t.extend_from_slice(&entries_version(entries.iter().map(|(_, e)| e)).to_le_bytes());
    t.extend_from_slice(&(by_pack.len() as u32).to_le_bytes());
    for (p, es) in &by_pack {
        t.extend_from_slice(p);
        t.extend_from_slice(&(es.len() as u32).to_le_bytes());
        for e in es {
            encode_entry(e, &mut t);
        }
    }
    let sealed = key.seal(&t, AAD);
    let name = format!("index/{}", crate::hex(blake3::hash(&sealed).as_bytes()));
    (name, sealed)
}

/// Decodes a sealed index delta.
pub(crate) fn decode_delta(
    key: &MasterKey,
    name: &str,
    sealed: &[u8],
) -> Result<Vec<(PackId, PackEntry)>> {
    let corrupt = |what: &str| RepoError::Corrupt {
        key: name.into(),
        offset: 0,
        what: what.into(),
    };
    let t = key.open(sealed, AAD).ok_or_else(|| {
        corrupt("index fails authentication (damaged, or from another repository)")
    })?;
    parse_delta(name, &t)
}

/// Parses the plaintext of an index delta.
pub(crate) fn parse_delta(name: &str, t: &[u8]) -> Result<Vec<(PackId, PackEntry)>> {
    let corrupt = |what: &str| RepoError::Corrupt {
        key: name.into(),
        offset: 0,
        what: what.into(),
    };
    if t.get(..4) != Some(MAGIC) {
        return Err(corrupt("not an index"));
    }
    let version = u32_at(t, 4).ok_or_else(|| corrupt("short index"))?;
    if !(ENTRIES_V1..=ENTRIES_V2).contains(&version) {
        return Err(RepoError::UnsupportedVersion {
            key: name.into(),
            found: version,
            supported: ENTRIES_V2,
        });
    }
    let npacks = u32_at(t, 8).ok_or_else(|| corrupt("short index"))?;
    let mut at = 12;
    let mut out = Vec::new();
    for _ in 0..npacks {
        let pack: PackId = t
            .get(at..at + 32)
            .and_then(|b| b.try_into().ok())
            .ok_or_else(|| corrupt("short index"))?;
        let n = u32_at(t, at + 32).ok_or_else(|| corrupt("short index"))? as usize;
        at += 36;
        for _ in 0..n {
            let b = t.get(at..).ok_or_else(|| corrupt("short index"))?;
            let (e, len) =
                decode_entry(b, version).ok_or_else(|| corrupt("bad or short index entry"))?;
            out.push((pack, e));
            at += len;
        }
    }
    if at != t.len() {
        return Err(corrupt("trailing bytes in index"));
    }
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn delta_bases_round_trip_and_orphans_are_dropped() {
        let key = MasterKey::from_secret(&[5; 32]);
        let (p1, p2) = ([1u8; 32], [2u8; 32]);
        let e = |id: u8, base: Option<u8>| PackEntry {
            kind: match base {
                Some(_) => BlobKind::Delta,
                None => BlobKind::Data,
            },
            id: ChunkId([id; 32]),
            offset: 8 + id as u32,
            len: 100,
            base: base.map(|b| ChunkId([b; 32])),
        };
        let entries = vec![(p1, e(10, None)), (p2, e(11, Some(10))), (p2, e(12, None))];
        let (name, sealed) = encode_delta(&key, &entries);
        let back = decode_delta(&key, &name, &sealed).unwrap();
        assert_eq!(back.len(), 3);
        for x in &entries {
            assert!(back.contains(x), "{x:?}");
        }
        let mut index = Index::default();
        for (p, e) in &back {
            index.insert(p, e);
        }
        assert_eq!(
            index.get(&ChunkId([11; 32])).unwrap().base,
            Some(ChunkId([10; 32]))
        );
        assert_eq!(index.get(&ChunkId([10; 32])).unwrap().base, None);
        // A whole copy of chunk 11 in a third pack (say, stored again by a --no-deltas run).
        let p3 = [3u8; 32];
        index.insert(&p3, &e(11, None));
        // Without its base's pack, a delta is unusable: its whole copy takes its place.
        index.remove_packs(&[p1].into_iter().collect());
        assert!(!index.contains(&ChunkId([10; 32])));
        let loc = index.get(&ChunkId([11; 32])).unwrap();
        assert_eq!((loc.pack, loc.base), (p3, None));
        assert!(index.contains(&ChunkId([12; 32])));
        // Without any whole copy, the delta is gone.
        index.remove_packs(&[p3].into_iter().collect());
        assert!(!index.contains(&ChunkId([11; 32])));
        // Without deltas the delta is written as version 1 (readable by older builds).
        let (_, sealed) = encode_delta(&key, &entries[..1]);
        let plain = key.open(&sealed, AAD).unwrap();
        assert_eq!(u32_at(&plain, 4), Some(ENTRIES_V1));
    }
}
