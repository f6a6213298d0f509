//! Reading tree snapshots: blobs, paths, what they reference, damage, differences.
//! Every walk holds one directory's blob per level of depth, never the whole tree.

use crate::{
    error::{RepoError, Result},
    index::Index,
    manifest::{Content, Snapshot},
    repo::Repository,
    tree::{NodeKind, TreeNode, decode_tree},
};
use chunker::ChunkId;
use std::{collections::HashSet, future::Future, pin::Pin};

type Boxed<'a, T> = Pin<Box<dyn Future<Output = T> + Send + 'a>>;

/// One difference between two tree snapshots.
#[derive(Clone, Debug, PartialEq, Eq, serde::Serialize)]
pub struct TreeChange {
    /// The entry's path below the top (`/`-separated; names may be any bytes).
    #[serde(serialize_with = "lossy")]
    pub path: Vec<u8>,
    /// `added`, `removed`, `changed` (content), `metadata` (only metadata), or `kind`
    /// (replaced by an entry of another kind).
    pub what: &'static str,
}

fn lossy<S: serde::Serializer>(p: &[u8], s: S) -> std::result::Result<S::Ok, S::Error> {
    s.serialize_str(&String::from_utf8_lossy(p))
}

/// `parent/name`, or `name` at the top.
pub fn join_path(parent: &[u8], name: &[u8]) -> Vec<u8> {
    let mut p = Vec::with_capacity(parent.len() + 1 + name.len());
    if !parent.is_empty() {
        p.extend_from_slice(parent);
        p.push(b'/');
    }
    p.extend_from_slice(name);
    p
}

/// The top tree blob of a tree snapshot.
pub fn tree_root(snap: &Snapshot) -> Result<ChunkId> {
    match &snap.manifest.content {
        Content::Tree { root, .. } => crate::unhex::<32>(root)
            .map(ChunkId)
            .ok_or_else(|| RepoError::MissingBlob { id: root.clone() }),
        Content::Block { .. } => Err(RepoError::Refused {
            what: format!("snapshot {}", snap.short_id()),
            why: "is a block volume's, not a file tree's".into(),
        }),
    }
}

impl Repository {
    /// Reads and decodes one tree blob.
    pub async fn read_tree(&self, index: &Index, id: &ChunkId) -> Result<Vec<TreeNode>> {
        let b = self.read_blob(index, id).await?;
        decode_tree(&format!("tree blob {}", id.to_hex()), &b)
    }

    /// The node at `path` (`/`-separated below the top; empty: the top directory itself)
    /// of a tree snapshot, if there is one.
    pub async fn tree_node_at(
        &self,
        index: &Index,
        snap: &Snapshot,
        path: &[u8],
    ) -> Result<Option<TreeNode>> {
        let top = self.read_tree(index, &tree_root(snap)?).await?;
        let Some(mut node) = top.into_iter().next() else {
            return Err(RepoError::Corrupt {
                key: format!("snapshot {}", snap.short_id()),
                offset: 0,
                what: "empty top tree blob".into(),
            });
        };
        for name in path
            .split(|&c| c == b'/')
            .filter(|n| !n.is_empty() && n != b".")
        {
            let Some(sub) = node.subtree.filter(|_| node.kind == NodeKind::Dir) else {
                return Ok(None);
            };
            let nodes = self.read_tree(index, &sub).await?;
            match nodes.binary_search_by(|n| n.name.as_slice().cmp(name)) {
                Ok(i) => node = nodes.into_iter().nth(i).expect("found"),
                Err(_) => return Ok(None),
            }
        }
        Ok(Some(node))
    }

    /// Adds every blob the tree below `root` needs to `used` (tree blobs and file
    /// chunks); subtrees already in `visited` are skipped unread, so trees shared between
    /// snapshots are read once.
    pub(crate) async fn tree_blobs(
        &self,
        index: &Index,
        root: ChunkId,
        visited: &mut HashSet<ChunkId>,
        used: &mut HashSet<ChunkId>,
    ) -> Result<()> {
        let mut stack = vec![root];
        while let Some(id) = stack.pop() {
            if !visited.insert(id) {
                continue;
            }
            used.insert(id);
            for n in self.read_tree(index, &id).await? {
                used.extend(n.chunks());
                stack.extend(n.subtree.filter(|s| !visited.contains(s)));
            }
        }
        Ok(())
    }

    /// Finds the damaged paths below the tree blob `id` (at `path`): files with a chunk
    /// in `bad` or missing from the index, and directories whose blob cannot be read.
    /// Returns whether anything below is damaged; `intact` remembers subtrees found whole.
    pub(crate) fn damaged_paths<'a>(
        &'a self,
        index: &'a Index,
        bad: &'a HashSet<ChunkId>,
        id: ChunkId,
        path: Vec<u8>,
        intact: &'a mut HashSet<ChunkId>,
        out: &'a mut Vec<(Vec<u8>, String)>,
    ) -> Boxed<'a, bool> {
        Box::pin(async move {
            if intact.contains(&id) {
                return false;
            }
            let unusable = |c: &ChunkId| {
                bad.contains(c)
                    || index.get(c).is_none_or(|l| {
                        l.base
                            .is_some_and(|b| bad.contains(&b) || !index.contains(&b))
                    })
            };
            let nodes = match unusable(&id) {
                true => Err(RepoError::MissingBlob { id: id.to_hex() }),
                false => self.read_tree(index, &id).await,
            };
            let nodes = match nodes {
                Ok(n) => n,
                Err(e) => {
                    out.push((path, format!("directory unreadable: {e}")));
                    return true;
                }
            };
            let mut damaged = false;
            for n in nodes {
                let p = join_path(&path, &n.name);
                if let Some(sub) = n.subtree {
                    damaged |= self.damaged_paths(index, bad, sub, p, intact, out).await;
                } else if let Some(c) = n.chunks().find(|c| unusable(c)) {
                    out.push((p, format!("chunk {} unreadable", c.to_hex())));
                    damaged = true;
                }
            }
            if !damaged {
                intact.insert(id);
            }
            damaged
        })
    }

    /// The entries added, removed and changed from tree snapshot `a` to `b`, in path
    /// order. Directories equal in both (the same blob) are not read.
    pub async fn diff_trees(
        &self,
        index: &Index,
        a: &Snapshot,
        b: &Snapshot,
    ) -> Result<Vec<TreeChange>> {
        let mut out = Vec::new();
        let (ra, rb) = (tree_root(a)?, tree_root(b)?);
        if ra != rb {
            let ta = self.read_tree(index, &ra).await?;
            let tb = self.read_tree(index, &rb).await?;
            if let (Some(x), Some(y)) = (ta.first(), tb.first()) {
                self.diff_nodes(index, Vec::new(), x, y, &mut out).await?;
            }
        }
        Ok(out)
    }

    fn diff_nodes<'a>(
        &'a self,
        index: &'a Index,
        path: Vec<u8>,
        x: &'a TreeNode,
        y: &'a TreeNode,
        out: &'a mut Vec<TreeChange>,
    ) -> Boxed<'a, Result<()>> {
        Box::pin(async move {
            if x.kind != y.kind {
                out.push(TreeChange { path, what: "kind" });
                return Ok(());
            }
            if x.kind != NodeKind::Dir {
                let what = if x.content != y.content || x.size != y.size {
                    "changed"
                } else if !x.same_metadata(y) {
                    "metadata"
                } else {
                    return Ok(());
                };
                out.push(TreeChange { path, what });
                return Ok(());
            }
            if !x.same_metadata(y) && !path.is_empty() {
                out.push(TreeChange {
                    path: path.clone(),
                    what: "metadata",
                });
            }
            if x.subtree == y.subtree {
                return Ok(());
            }
            let none = Vec::new();
            let xs = match x.subtree {
                Some(s) => self.read_tree(index, &s).await?,
                None => none.clone(),
            };
            let ys = match y.subtree {
                Some(s) => self.read_tree(index, &s).await?,
                None => none,
            };
            let (mut i, mut j) = (0, 0);
            while i < xs.len() || j < ys.len() {
                let order = match (xs.get(i), ys.get(j)) {
                    (Some(a), Some(b)) => a.name.cmp(&b.name),
                    (Some(_), None) => std::cmp::Ordering::Less,
                    _ => std::cmp::Ordering::Greater,
                };
                match order {
                    std::cmp::Ordering::Less => {
                        self.all_below(
                            index,
                            join_path(&path, &xs[i].name),
                            &xs[i],
                            "removed",
                            out,
                        )
                        .await?;
                        i += 1;
                    }
                    std::cmp::Ordering::Greater => {
                        self.all_below(index, join_path(&path, &ys[j].name), &ys[j], "added", out)
                            .await?;
                        j += 1;
                    }
                    std::cmp::Ordering::Equal => {
                        let p = join_path(&path, &xs[i].name);
                        self.diff_nodes(index, p, &xs[i], &ys[j], out).await?;
                        i += 1;
                        j += 1;
                    }
                }
            }
            Ok(())
        })
    }

    /// Reports `node` at `path` and everything below it as `what`.
    fn all_below<'a>(
        &'a self,
        index: &'a Index,
        path: Vec<u8>,
        node: &'a TreeNode,
        what: &'static str,
        out: &'a mut Vec<TreeChange>,
    ) -> Boxed<'a, Result<()>> {
        Box::pin(async move {
            out.push(TreeChange {
                path: path.clone(),
                what,
            });
            if let Some(s) = node.subtree {
                for n in self.read_tree(index, &s).await? {
                    self.all_below(index, join_path(&path, &n.name), &n, what, out)
                        .await?;
                }
            }
            Ok(())
        })
    }
}
