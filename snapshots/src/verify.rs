//! Verify: check that every snapshot can be restored.
//!
//! Structure (always): every manifest decrypts and parses, every list blob and data
//! chunk it names is in the index, and every indexed pack exists and is large enough.
//! With `read_data`: every pack is downloaded and every blob decrypted and checked
//! against its id (a delta blob by rebuilding its chunk on its base). Problems are mapped back to the snapshots and byte ranges they affect.

use crate::{
    error::Result,
    index::Index,
    manifest::{Content, Snapshot},
    pack::{PackId, pack_key},
    repo::Repository,
};
use chunker::{ChunkId, ChunkKind};
use std::{
    collections::{HashMap, HashSet},
    ops::Range,
    sync::Arc,
};

/// A snapshot with damaged or missing data.
#[derive(Clone, Debug, serde::Serialize, PartialEq)]
pub struct DamagedSnapshot {
    /// Snapshot id.
    pub id: String,
    /// The volume.
    pub volume: String,
    /// Byte ranges of the volume that cannot be restored (block snapshots).
    pub ranges: Vec<Range<u64>>,
    /// Paths that cannot be restored, with why (tree snapshots; a directory whose blob
    /// is unreadable stands for everything below it).
    #[serde(skip_serializing_if = "Vec::is_empty")]
    pub paths: Vec<(String, String)>,
}

/// What verify found.
#[derive(Clone, Debug, Default, serde::Serialize, PartialEq)]
pub struct VerifyReport {
    /// Snapshots checked.
    pub snapshots: usize,
    /// Packs present.
    pub packs: usize,
    /// Blobs whose data was read and checked (with `read_data`).
    pub blobs_read: u64,
    /// Bytes downloaded (with `read_data`).
    pub bytes_read: u64,
    /// Every problem, one line each.
    pub problems: Vec<String>,
    /// The snapshots affected, with ranges.
    pub damaged: Vec<DamagedSnapshot>,
}

impl Repository {
    /// Checks the repository; see the module docs.
    pub async fn verify(&self, read_data: bool) -> Result<VerifyReport> {
        let mut report = VerifyReport::default();
        let index = self.load_index().await?;
        let sizes: HashMap<PackId, u64> = self
            .backend()
            .list("packs/")
            .await?
            .into_iter()
            .filter_map(|o| {
                let id = o.key.rsplit('/').next().and_then(crate::unhex::<32>)?;
                Some((id, o.size))
            })
            .collect();
        report.packs = sizes.len();
        // Blobs that cannot be read: missing from the index, in a missing or short
        // pack, or (with read_data) failing their check.
        let mut bad: HashSet<ChunkId> = HashSet::new();
        for (id, loc) in index.iter() {
            match sizes.get(&loc.pack) {
                None => {
                    bad.insert(id);
                }
                Some(size) if (loc.offset as u64 + loc.len as u64) > *size => {
                    bad.insert(id);
                }
                _ => {}
            }
        }
        let mut missing_packs: HashSet<PackId> = HashSet::new();
        for (_, loc) in index.iter() {
            if !sizes.contains_key(&loc.pack) {
                missing_packs.insert(loc.pack);
            }
        }
        for p in &missing_packs {
            report
                .problems
                .push(format!("pack {} is in the index but missing", pack_key(p)));
        }
        if read_data {
            self.read_all_packs(&index, &sizes, &mut bad, &mut report)
                .await?;
        }
        let snaps = match self.snapshots().await {
            Ok(s) => s,
            Err(e) => {
                report
                    .problems
                    .push(format!("cannot read the snapshots: {e}"));
                return Ok(report);
            }
        };
        report.snapshots = snaps.len();
        let mut intact = HashSet::new();
        for snap in &snaps {
            match &snap.manifest.content {
                Content::Block { .. } => self.check_snapshot(snap, &index, &bad, &mut report).await,
                Content::Tree { .. } => {
                    self.check_tree_snapshot(snap, &index, &bad, &mut intact, &mut report)
                        .await
                }
            }
        }
        Ok(report)
    }

    async fn read_all_packs(
        &self,
        index: &Index,
        sizes: &HashMap<PackId, u64>,
        bad: &mut HashSet<ChunkId>,
        report: &mut VerifyReport,
    ) -> Result<()> {
        let mut by_pack: HashMap<PackId, Vec<(ChunkId, crate::BlobLoc)>> = HashMap::new();
        for (id, loc) in index.iter() {
            by_pack.entry(loc.pack).or_default().push((id, loc));
        }
        let sem = Arc::new(tokio::sync::Semaphore::new(4));
        let mut tasks = tokio::task::JoinSet::new();
        let mut deltas = Vec::new();
        for (pack, blobs) in by_pack {
            if !sizes.contains_key(&pack) {
                continue;
            }
            let sem = sem.clone();
            let backend = self.backend().clone();
            tasks.spawn(async move {
                let _p = sem.acquire_owned().await;
                let data = backend.get(&pack_key(&pack), None).await;
                (pack, blobs, data)
            });
        }
        while let Some(r) = tasks.join_next().await {
            let (pack, blobs, data) = r.map_err(crate::repo::join_err)?;
            let key = pack_key(&pack);
            let data = match data {
                Ok(d) => d,
                Err(e) if e.is_not_found() => {
                    report
                        .problems
                        .push(format!("pack {key} vanished during verify"));
                    bad.extend(blobs.iter().map(|(id, _)| *id));
                    continue;
                }
                Err(e) => return Err(e),
            };
            report.bytes_read += data.len() as u64;
            if blake3::hash(&data).as_bytes() != &pack {
                report.problems.push(format!(
                    "pack {key}: content does not match its name (damaged)"
                ));
            }
            if let Err(e) = crate::pack::parse_pack(self.master(), &key, &data) {
                report.problems.push(format!("pack {key}: {e}"));
            }
            let mkey = self.master().clone();
            let checked = tokio::task::spawn_blocking(move || {
                blobs
                    .into_iter()
                    .map(|(id, loc)| {
                        let ok = data
                            .get(loc.offset as usize..(loc.offset + loc.len) as usize)
                            .and_then(|s| crate::pack::open_blob(&mkey, loc.kind, &id, s))
                            .is_some();
                        (id, loc, ok)
                    })
                    .collect::<Vec<_>>()
            })
            .await
            .map_err(crate::repo::join_err)?;
            for (id, loc, ok) in checked {
                report.blobs_read += 1;
                if ok && loc.base.is_some() {
                    deltas.push(id);
                }
                if !ok {
                    report.problems.push(format!(
                        "pack {key} offset {}: blob {} is damaged",
                        loc.offset,
                        id.to_hex()
                    ));
                    bad.insert(id);
                }
            }
        }
        // Deltas authenticate on their own; rebuild each chunk on its base to check it.
        for id in deltas {
            match self.read_chunk(index, &id).await {
                Ok(_) => {}
                Err(e) if e.is_corruption() || e.is_not_found() => {
                    report.problems.push(format!(
                        "delta blob {} does not rebuild its chunk: {e}",
                        id.to_hex()
                    ));
                    bad.insert(id);
                }
                Err(e) => return Err(e),
            }
        }
        Ok(())
    }

    /// Names the damaged paths of a tree snapshot.
    async fn check_tree_snapshot(
        &self,
        snap: &Snapshot,
        index: &Index,
        bad: &HashSet<ChunkId>,
        intact: &mut HashSet<ChunkId>,
        report: &mut VerifyReport,
    ) {
        let mut found = Vec::new();
        match crate::tree_root(snap) {
            Ok(root) => {
                self.damaged_paths(index, bad, root, Vec::new(), intact, &mut found)
                    .await;
            }
            Err(e) => found.push((Vec::new(), e.to_string())),
        }
        if found.is_empty() {
            return;
        }
        let paths: Vec<(String, String)> = found
            .into_iter()
            .map(|(p, why)| {
                let p = String::from_utf8_lossy(&p).into_owned();
                (if p.is_empty() { ".".into() } else { p }, why)
            })
            .collect();
        report.problems.push(format!(
            "snapshot {} ({}): {} damaged path(s), first {}: {}",
            snap.short_id(),
            snap.manifest.volume,
            paths.len(),
            paths[0].0,
            paths[0].1
        ));
        report.damaged.push(DamagedSnapshot {
            id: snap.id.clone(),
            volume: snap.manifest.volume.clone(),
            ranges: Vec::new(),
            paths,
        });
    }

    async fn check_snapshot(
        &self,
        snap: &Snapshot,
        index: &Index,
        bad: &HashSet<ChunkId>,
        report: &mut VerifyReport,
    ) {
        let Content::Block {
            size,
            chunk_size,
            chunks_per_list,
            lists,
        } = &snap.manifest.content
        else {
            return;
        };
        let mut ranges: Vec<Range<u64>> = Vec::new();
        let mut push = |r: Range<u64>| match ranges.last_mut() {
            Some(last) if last.end == r.start => last.end = r.end,
            _ => ranges.push(r),
        };
        for (li, l) in lists.iter().enumerate() {
            let first = li as u64 * chunks_per_list * chunk_size;
            let list_end = (first + chunks_per_list * chunk_size).min(*size);
            let id = crate::unhex::<32>(l).map(ChunkId);
            let ok_list = id.is_some_and(|id| index.contains(&id) && !bad.contains(&id));
            let kinds = match ok_list {
                true => self.read_list(index, l).await,
                false => Err(crate::RepoError::MissingBlob { id: l.clone() }),
            };
            let kinds = match kinds {
                Ok(k) => k,
                Err(e) => {
                    report.problems.push(format!(
                        "snapshot {}: chunk list {l} unreadable: {e}",
                        snap.short_id()
                    ));
                    push(first..list_end);
                    continue;
                }
            };
            for (i, k) in kinds.iter().enumerate() {
                let unusable = |id: &ChunkId| bad.contains(id) || !index.contains(id);
                if let ChunkKind::Data(id) = k
                    && (unusable(id)
                        || index
                            .get(id)
                            .and_then(|l| l.base)
                            .is_some_and(|b| unusable(&b)))
                {
                    let s = first + i as u64 * chunk_size;
                    push(s..(s + chunk_size).min(*size));
                }
            }
        }
        if !ranges.is_empty() {
            report.problems.push(format!(
                "snapshot {} ({}): {} damaged range(s), first at bytes {}..{}",
                snap.short_id(),
                snap.manifest.volume,
                ranges.len(),
                ranges[0].start,
                ranges[0].end
            ));
            report.damaged.push(DamagedSnapshot {
                id: snap.id.clone(),
                volume: snap.manifest.volume.clone(),
                ranges,
                paths: Vec::new(),
            });
        }
    }

    /// The byte ranges that differ between two block snapshots (holes and zero chunks
    /// count as equal to each other), merged. Equal list blobs are skipped unread.
    pub async fn diff(&self, index: &Index, a: &Snapshot, b: &Snapshot) -> Result<Vec<Range<u64>>> {
        let (
            Content::Block {
                size: sa,
                chunk_size: ca,
                chunks_per_list: na,
                lists: la,
            },
            Content::Block {
                size: sb,
                chunk_size: cb,
                lists: lb,
                ..
            },
        ) = (&a.manifest.content, &b.manifest.content)
        else {
            return Err(crate::RepoError::Refused {
                what: format!("diff of {} and {}", a.short_id(), b.short_id()),
                why: "byte ranges are for two block snapshots (trees are compared by path)".into(),
            });
        };
        let max = (*sa).max(*sb);
        if ca != cb {
            return Ok(std::iter::once(0..max).collect());
        }
        let mut out: Vec<Range<u64>> = Vec::new();
        let mut push = |r: Range<u64>| match out.last_mut() {
            Some(last) if last.end >= r.start => last.end = last.end.max(r.end),
            _ => out.push(r),
        };
        for i in 0..la.len().max(lb.len()) {
            let first = i as u64 * na * ca;
            match (la.get(i), lb.get(i)) {
                (Some(x), Some(y)) if x == y => continue,
                (Some(x), Some(y)) => {
                    let ka = self.read_list(index, x).await?;
                    let kb = self.read_list(index, y).await?;
                    for j in 0..ka.len().max(kb.len()) {
                        if ka.get(j) != kb.get(j) {
                            let s = first + j as u64 * ca;
                            push(s..(s + ca).min(max));
                        }
                    }
                }
                _ => push(first..(first + na * ca).min(max)),
            }
        }
        if sa != sb {
            push((*sa).min(*sb)..max);
        }
        Ok(out)
    }
}
