//! Prune: lock-free, two-phase removal of packs no snapshot needs.
//!
//! 1. **Mark**: packs with no blob referenced by any snapshot (including packs no index
//!    names, left by interrupted snapshots) are listed in a mark object
//!    `prune/<id>` (JSON, `"version": 1`, with the time of marking).
//!    Packs that are mostly unused (at least half their bytes) are **repacked** first:
//!    their used blobs are checked and copied into new packs (indexed as usual), and the
//!    old packs are marked too.
//! 2. **Sweep**, once a mark is older than the grace period: snapshots and index are
//!    read again and a marked pack that is still unreferenced is deleted: first a
//!    compacted index without it is written and the old index objects removed, then
//!    the pack. A marked pack is kept if it holds the only copy of a blob some snapshot
//!    uses (it became referenced meanwhile).
//!
//! No lock is taken. A concurrent `snapshot create` never dedups against marked packs
//! ([`Repository::load_dedup_index`]) and never adopts them, so it uploads those
//! chunks again instead; a snapshot that started before the mark and still runs when the
//! grace period ends is the one unprotected case, so the grace period must exceed the
//! longest snapshot run (default 1 hour).

use crate::{
    error::{RepoError, Result},
    index::Index,
    manifest::Content,
    pack::{PackEntry, PackId, pack_key},
    repo::{Repository, now_unix},
};
use chunker::{ChunkId, ChunkKind};
use serde::{Deserialize, Serialize};
use std::collections::{HashMap, HashSet};

const MARK_VERSION: u32 = 1;

#[derive(Debug, Serialize, Deserialize)]
struct Mark {
    version: u32,
    time: i64,
    packs: Vec<String>,
}

/// What a prune run did.
#[derive(Clone, Debug, Default, serde::Serialize, PartialEq)]
pub struct PruneReport {
    /// Packs newly marked as unreferenced.
    pub marked_packs: usize,
    /// Packs deleted (marked by an earlier run, or by this one with a zero grace period).
    pub deleted_packs: usize,
    /// Bytes freed.
    pub deleted_bytes: u64,
    /// Marked packs kept because a snapshot uses them again.
    pub kept_after_recheck: usize,
    /// Marks still waiting for their grace period.
    pub pending_marks: usize,
    /// Mostly unused packs whose used blobs were copied into new packs (the old packs
    /// are marked).
    pub repacked_packs: usize,
    /// Bytes of used blobs copied by repacking.
    pub repacked_bytes: u64,
    /// Packs partly used but not enough to repack: kept whole.
    pub partly_used_packs: usize,
    /// Unreferenced bytes inside those packs.
    pub partly_used_waste_bytes: u64,
}

/// Packs named in pending prune marks.
pub(crate) async fn marked_packs(repo: &Repository) -> Result<HashSet<PackId>> {
    let mut out = HashSet::new();
    for (_, m) in read_marks(repo).await? {
        out.extend(m.packs.iter().filter_map(|p| crate::unhex::<32>(p)));
    }
    Ok(out)
}

async fn read_marks(repo: &Repository) -> Result<Vec<(String, Mark)>> {
    let mut out = Vec::new();
    for obj in repo.backend().list("prune/").await? {
        let b = match repo.backend().get(&obj.key, None).await {
            Ok(b) => b,
            Err(e) if e.is_not_found() => continue,
            Err(e) => return Err(e),
        };
        let m: Mark = serde_json::from_slice(&b).map_err(|e| RepoError::Corrupt {
            key: obj.key.clone(),
            offset: 0,
            what: e.to_string(),
        })?;
        if m.version != MARK_VERSION {
            return Err(RepoError::UnsupportedVersion {
                key: obj.key,
                found: m.version,
                supported: MARK_VERSION,
            });
        }
        out.push((obj.key, m));
    }
    Ok(out)
}

impl Repository {
    /// The index without the packs pending deletion: what a new snapshot may dedup
    /// against.
    pub async fn load_dedup_index(&self) -> Result<Index> {
        let mut index = self.load_index().await?;
        index.remove_packs(&marked_packs(self).await?);
        Ok(index)
    }

    /// Every blob id some snapshot needs: its list blobs and their data chunks (a
    /// tree's blobs and its files' chunks), and the bases of those stored as deltas.
    pub async fn referenced_blobs(&self, index: &Index) -> Result<HashSet<ChunkId>> {
        let mut used = HashSet::new();
        let mut trees_seen = HashSet::new();
        for snap in self.snapshots().await? {
            let lists = match &snap.manifest.content {
                Content::Block { lists, .. } => lists,
                Content::Tree { .. } => {
                    let root = crate::tree_root(&snap)?;
                    self.tree_blobs(index, root, &mut trees_seen, &mut used)
                        .await?;
                    continue;
                }
            };
            for l in lists {
                if let Some(id) = crate::unhex::<32>(l) {
                    used.insert(ChunkId(id));
                }
                for k in self.read_list(index, l).await? {
                    if let ChunkKind::Data(id) = k {
                        used.insert(id);
                    }
                }
            }
        }
        // Bases of every location of a used delta (any copy may be the one read). A base
        // is a data blob, but should a copy of it be a delta too, its base counts as well.
        loop {
            let bases: Vec<ChunkId> = index
                .all_locations()
                .filter(|(id, _)| used.contains(id))
                .filter_map(|(_, loc)| loc.base)
                .filter(|b| !used.contains(b))
                .collect();
            if bases.is_empty() {
                break;
            }
            used.extend(bases);
        }
        Ok(used)
    }

    /// Runs a prune: sweeps marks older than `grace_secs`, then marks what is unused now
    /// (and sweeps that too when `grace_secs` is 0: only safe with no concurrent writer).
    pub async fn prune(&self, grace_secs: u64) -> Result<PruneReport> {
        let mut report = PruneReport::default();
        self.sweep(grace_secs, &mut report).await?;
        self.mark(&mut report).await?;
        if grace_secs == 0 {
            self.sweep(0, &mut report).await?;
        }
        report.pending_marks = read_marks(self).await?.len();
        Ok(report)
    }

    async fn mark(&self, report: &mut PruneReport) -> Result<()> {
        let index = self.load_index().await?;
        let used = self.referenced_blobs(&index).await?;
        let already = marked_packs(self).await?;
        // Per pack: whether it holds a used blob, and its unused bytes.
        let mut pack_used: HashMap<PackId, (bool, u64)> = HashMap::new();
        for (id, loc) in index.all_locations() {
            let e = pack_used.entry(loc.pack).or_default();
            if used.contains(&id) {
                e.0 = true;
            } else {
                e.1 += loc.len as u64;
            }
        }
        let mut packs = Vec::new();
        let mut repack: Vec<PackId> = Vec::new();
        for obj in self.backend().list("packs/").await? {
            let Some(id) = obj.key.rsplit('/').next().and_then(crate::unhex::<32>) else {
                continue;
            };
            match pack_used.get(&id) {
                _ if already.contains(&id) => {}
                Some((true, waste)) if *waste * 2 >= obj.size => repack.push(id),
                Some((true, waste)) => {
                    if *waste > 0 {
                        report.partly_used_packs += 1;
                        report.partly_used_waste_bytes += waste;
                    }
                }
                _ => packs.push(crate::hex(&id)),
            }
        }
        if !repack.is_empty() {
            self.repack(&index, &used, &repack, report).await?;
            packs.extend(repack.iter().map(|p| crate::hex(p)));
        }
        if packs.is_empty() {
            return Ok(());
        }
        report.marked_packs += packs.len();
        let mark = Mark {
            version: MARK_VERSION,
            time: now_unix(),
            packs,
        };
        let name = format!("prune/{}", crate::hex(&crate::crypto::random::<16>()));
        let b = serde_json::to_vec_pretty(&mark).expect("serializes");
        self.backend().put(&name, b.into()).await
    }

    /// Copies the used blobs of `packs` (checked on the way) into new packs.
    async fn repack(
        &self,
        index: &Index,
        used: &HashSet<ChunkId>,
        packs: &[PackId],
        report: &mut PruneReport,
    ) -> Result<()> {
        let set: HashSet<PackId> = packs.iter().copied().collect();
        let mut by_pack: HashMap<PackId, Vec<(ChunkId, crate::BlobLoc)>> = HashMap::new();
        let mut copied = HashSet::new();
        for (id, loc) in index.all_locations() {
            if set.contains(&loc.pack) && used.contains(&id) {
                by_pack.entry(loc.pack).or_default().push((id, loc));
            }
        }
        let mut uploader = crate::Uploader::new(std::sync::Arc::new(self.clone_handle()), 2);
        let mut pack = crate::PackBuilder::new();
        for (p, blobs) in by_pack {
            let kinds: HashMap<ChunkId, (crate::BlobKind, Option<ChunkId>)> = blobs
                .iter()
                .map(|(id, l)| (*id, (l.kind, l.base)))
                .collect();
            for (id, plain) in self.read_blobs(&p, blobs).await? {
                if !copied.insert(id) {
                    continue;
                }
                let (kind, base) = kinds[&id];
                let sealed = self.seal_blob(kind, &id, &plain);
                report.repacked_bytes += sealed.len() as u64;
                pack.push_entry(kind, id, base, &sealed);
                if pack.len() >= self.pack_size() {
                    uploader
                        .add(self.finish_pack(std::mem::take(&mut pack)))
                        .await?;
                }
            }
            report.repacked_packs += 1;
        }
        if !pack.is_empty() {
            uploader.add(self.finish_pack(pack)).await?;
        }
        uploader.finish().await?;
        Ok(())
    }

    async fn sweep(&self, grace_secs: u64, report: &mut PruneReport) -> Result<()> {
        let now = now_unix();
        let due: Vec<(String, Mark)> = read_marks(self)
            .await?
            .into_iter()
            .filter(|(_, m)| m.time.saturating_add(grace_secs as i64) <= now)
            .collect();
        if due.is_empty() {
            return Ok(());
        }
        // Re-check against the repository as it is now.
        let index = self.load_index().await?;
        let used = self.referenced_blobs(&index).await?;
        let mut doomed = HashSet::new();
        for (_, m) in &due {
            doomed.extend(m.packs.iter().filter_map(|p| crate::unhex::<32>(p)));
        }
        // A used blob whose every copy is in a doomed pack keeps those packs.
        let mut copies: HashMap<ChunkId, Vec<PackId>> = HashMap::new();
        for (id, loc) in index.all_locations() {
            if used.contains(&id) {
                copies.entry(id).or_default().push(loc.pack);
            }
        }
        for packs in copies.values() {
            if packs.iter().all(|p| doomed.contains(p)) {
                for p in packs {
                    if doomed.remove(p) {
                        report.kept_after_recheck += 1;
                    }
                }
            }
        }
        let sizes: HashMap<String, u64> = self
            .backend()
            .list("packs/")
            .await?
            .into_iter()
            .map(|o| (o.key, o.size))
            .collect();
        let indexed = index.packs();
        if doomed.iter().any(|p| indexed.contains(p)) {
            // Compact: one new index without the doomed packs, then drop the old ones.
            let keep: Vec<(PackId, PackEntry)> = index
                .all_locations()
                .filter(|(_, loc)| !doomed.contains(&loc.pack))
                .map(|(id, loc)| {
                    (
                        loc.pack,
                        PackEntry {
                            kind: loc.kind,
                            id,
                            offset: loc.offset,
                            len: loc.len,
                            base: loc.base,
                        },
                    )
                })
                .collect();
            if !keep.is_empty() {
                self.write_index(&keep).await?;
            }
            for f in &index.files {
                self.backend().delete(f).await?;
            }
        }
        for p in &doomed {
            let key = pack_key(p);
            report.deleted_bytes += sizes.get(&key).copied().unwrap_or(0);
            if sizes.contains_key(&key) {
                report.deleted_packs += 1;
            }
            self.backend().delete(&key).await?;
        }
        for (name, _) in &due {
            self.backend().delete(name).await?;
        }
        Ok(())
    }
}
