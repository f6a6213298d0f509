//! The volumes an agent serves: those `agent.toml` names, and those the controller
//! registers through the control API (`Export`) under one of the config's
//! `volume_roots`, kept in `STATE/exports.json` across restarts.

use serde::{Deserialize, Serialize};
use std::{
    collections::BTreeMap,
    path::{Component, Path, PathBuf},
    sync::{Arc, RwLock},
};

/// One exported volume.
#[derive(Clone, Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Export {
    /// A block device or image file (created on first write if missing), or a directory:
    /// a file tree (a tree pushed into a path not made yet creates it).
    pub path: PathBuf,
    /// Peers may read but never write it.
    #[serde(default)]
    pub read_only: bool,
    /// The namespaces whose populated PVCs may be filled from it: a fill for PVC
    /// NAMESPACE/NAME asks for relationship `hydrate:NAMESPACE/NAME` [default: none].
    /// Peers reach it for other relationships as before.
    #[serde(default)]
    pub namespaces: Vec<String>,
    /// The peer credential (a name of `replication_token_file`'s `NAME TOKEN` lines)
    /// that alone may act on it: replicate into it, or read it (a peer cluster's fill)
    /// [default: none, any unnamed replication token].
    #[serde(default)]
    pub peer_credential: Option<String>,
}

/// A volume registered through the control API.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
struct Registered {
    path: PathBuf,
    /// `path` may be a directory of device entries (the kubelet's per-pod entries of a
    /// block PersistentVolume): the first one is the volume.
    block: bool,
    /// The relationship it is served for ("": none).
    #[serde(default, skip_serializing_if = "String::is_empty")]
    relationship: String,
    /// The peer credential that may act on that relationship, until its first cycle
    /// makes its record (`None`: any).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    peer_credential: Option<String>,
}

/// Why a volume is not served, or cannot be registered.
#[derive(Debug, thiserror::Error)]
pub enum ExportError {
    /// No export of that name.
    #[error("volume {name:?} is not exported by this agent (exports: {known})")]
    Unknown {
        /// The name asked for.
        name: String,
        /// The names there are, comma-separated.
        known: String,
    },
    /// A block volume's device directory holds no device yet.
    #[error(
        "volume {name:?}: no device under {dir} yet (the kubelet adds one when a pod using \
         the volume runs on this node)"
    )]
    NoDevice {
        /// The export.
        name: String,
        /// The directory.
        dir: PathBuf,
    },
    /// A registration the config does not allow.
    #[error("cannot export {name:?} at {path}: {why}")]
    Refused {
        /// The export.
        name: String,
        /// The path asked for.
        path: PathBuf,
        /// What is wrong and what to do.
        why: String,
    },
    /// The registrations could not be saved.
    #[error("cannot save {path}: {cause}")]
    Save {
        /// STATE/exports.json.
        path: PathBuf,
        /// The OS error.
        cause: std::io::Error,
    },
}

/// The export table shared by every part of the agent (cheap to clone).
#[derive(Clone, Debug)]
pub struct Exports {
    inner: Arc<Inner>,
}

#[derive(Debug)]
struct Inner {
    configured: BTreeMap<String, Export>,
    roots: Vec<PathBuf>,
    /// Where registrations are kept (`None`: in memory only).
    file: Option<PathBuf>,
    registered: RwLock<BTreeMap<String, Registered>>,
}

impl Exports {
    /// Only the exports given; nothing can be registered.
    pub fn fixed(configured: BTreeMap<String, Export>) -> Exports {
        Exports::with(configured, Vec::new(), None, BTreeMap::new())
    }

    /// The config's exports, and the registrations kept under `state_dir`.
    pub fn open(
        configured: BTreeMap<String, Export>,
        roots: Vec<PathBuf>,
        state_dir: &Path,
    ) -> std::io::Result<Exports> {
        let file = state_dir.join("exports.json");
        let registered = match std::fs::read(&file) {
            Ok(bytes) => serde_json::from_slice(&bytes).map_err(|e| {
                std::io::Error::other(format!(
                    "{} is damaged ({e}): fix or remove it (the controller registers its \
                     volumes again)",
                    file.display()
                ))
            })?,
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => BTreeMap::new(),
            Err(e) => return Err(e),
        };
        // volume_roots narrowed since: what lies outside them now is not served.
        let registered: BTreeMap<String, Registered> = registered
            .into_iter()
            .filter(|(name, r): &(String, Registered)| {
                let inside = roots.iter().any(|root| r.path.starts_with(root));
                if !inside {
                    tracing::warn!(export = %name, path = %r.path.display(), "registered export is outside volume_roots now: not served");
                }
                inside
            })
            .collect();
        Ok(Exports::with(configured, roots, Some(file), registered))
    }

    fn with(
        configured: BTreeMap<String, Export>,
        roots: Vec<PathBuf>,
        file: Option<PathBuf>,
        registered: BTreeMap<String, Registered>,
    ) -> Exports {
        Exports {
            inner: Arc::new(Inner {
                configured,
                roots,
                file,
                registered: RwLock::new(registered),
            }),
        }
    }

    /// The export `name` as served now (a device directory resolved to its device).
    pub fn get(&self, name: &str) -> Result<Export, ExportError> {
        if let Some(e) = self.inner.configured.get(name) {
            return Ok(e.clone());
        }
        let registered = self.registered().get(name).cloned();
        match registered {
            Some(r) => resolve(name, &r),
            None => Err(ExportError::Unknown {
                name: name.into(),
                known: self.names().join(", "),
            }),
        }
    }

    /// Every export's name.
    pub fn names(&self) -> Vec<String> {
        let mut names: Vec<String> = self.inner.configured.keys().cloned().collect();
        names.extend(self.registered().keys().cloned());
        names.sort();
        names
    }

    /// Serves `path` as `name` (see the control API's Export). Returns whether it is a
    /// registration (false: agent.toml names it so already). The path is checked as
    /// written: a symlink under a root is followed when the volume is opened (local
    /// volume provisioners link /mnt/disks/X to /dev/disk/by-id/...), so a root must be
    /// a directory only the node's administrator writes.
    pub fn register(
        &self,
        name: &str,
        path: &Path,
        block: bool,
        relationship: &str,
        peer_credential: Option<&str>,
    ) -> Result<bool, ExportError> {
        let refused = |why: String| ExportError::Refused {
            name: name.into(),
            path: path.into(),
            why,
        };
        if let Some(e) = self.inner.configured.get(name) {
            return if e.path == path {
                Ok(false)
            } else {
                Err(refused(format!(
                    "agent.toml exports {name:?} at {}; a configured export is never replaced",
                    e.path.display()
                )))
            };
        }
        if name.is_empty() || name.contains('/') || name.chars().any(char::is_control) {
            return Err(refused(
                "an export's name must be non-empty, without '/' or control characters".into(),
            ));
        }
        if !path.is_absolute() || path.components().any(|c| c == Component::ParentDir) {
            return Err(refused("the path must be absolute, without '..'".into()));
        }
        if !self.inner.roots.iter().any(|root| path.starts_with(root)) {
            return Err(refused(if self.inner.roots.is_empty() {
                "this agent registers no volumes: agent.toml sets no volume_roots (list the \
                 directories the controller may export from, or name the volume under \
                 [exports])"
                    .into()
            } else {
                format!(
                    "it is under none of agent.toml's volume_roots ({})",
                    self.inner
                        .roots
                        .iter()
                        .map(|r| r.display().to_string())
                        .collect::<Vec<_>>()
                        .join(", ")
                )
            }));
        }
        // Another name for a volume already served would escape its settings (a
        // read-only export written through the alias) and its users' checks.
        let same = |p: &Path| p == path || same_file(p, path);
        if let Some((other, _)) = self.inner.configured.iter().find(|(_, e)| same(&e.path)) {
            return Err(refused(format!(
                "agent.toml exports that volume as {other:?}; it has one name"
            )));
        }
        // A device in use (a pod's mounted file system) is registered all the same: a
        // primary's cycles read it live (crash-consistent at best, and said so), and a
        // write into it (a secondary's cycle, a restore) is refused where it opens the
        // device (`copy::prepare_destination`: DestinationInUse).
        let want = Registered {
            path: path.into(),
            block,
            relationship: relationship.into(),
            peer_credential: peer_credential.map(String::from),
        };
        let mut registered = self.inner.registered.write().expect("exports lock");
        if let Some((other, _)) = registered
            .iter()
            .find(|(n, r)| n.as_str() != name && same(&r.path))
        {
            return Err(refused(format!(
                "it is registered as {other:?} already; a volume has one name"
            )));
        }
        if registered.get(name) == Some(&want) {
            return Ok(true);
        }
        let mut next = registered.clone();
        next.insert(name.into(), want);
        self.save(&next)?;
        *registered = next;
        Ok(true)
    }

    /// The path `name` is registered at (`None`: not registered, or named in agent.toml).
    pub fn registered_path(&self, name: &str) -> Option<PathBuf> {
        self.registered().get(name).map(|r| r.path.clone())
    }

    /// The relationship `name` is registered for (`None`: not registered, or named in
    /// agent.toml; `Some("")`: for none).
    pub fn registered_for(&self, name: &str) -> Option<String> {
        self.registered().get(name).map(|r| r.relationship.clone())
    }

    /// The peer credential that may act on `relationship` in export `name`, by its
    /// registration for that relationship or agent.toml (`None`: any).
    pub fn peer_credential_for(&self, name: &str, relationship: &str) -> Option<String> {
        if let Some(e) = self.inner.configured.get(name) {
            return e.peer_credential.clone();
        }
        self.registered()
            .get(name)
            .filter(|r| r.relationship == relationship)
            .and_then(|r| r.peer_credential.clone())
    }

    /// Whether a peer may open `name` for `relationship`: an export agent.toml names is
    /// the administrator's choice and served to any; a registered one only to the
    /// relationship it was registered for. The refusal names the rule.
    pub fn check_served_for(&self, name: &str, relationship: &str) -> Result<(), String> {
        match self.registered_for(name) {
            None => match fill_namespace(relationship) {
                Some(ns) if !self.configured_namespaces(name).iter().any(|n| n == ns) => {
                    Err(format!(
                        "volume {name:?} is not for HydrationSources of namespace {ns:?}: \
                         the agent's configuration names the namespaces a volume it \
                         exports may fill (exports.{name}.namespaces)"
                    ))
                }
                _ => Ok(()),
            },
            Some(r) if r == relationship => Ok(()),
            Some(r) => Err(format!(
                "volume {name:?} is registered for {}, not for relationship {relationship:?}: \
                 an agent serves a volume the controller registered only to the relationship \
                 it was registered for",
                if r.is_empty() {
                    "no relationship".to_string()
                } else {
                    format!("relationship {r:?}")
                }
            )),
        }
    }

    /// The namespaces agent.toml lets fill PVCs from export `name` (none for a
    /// registered one).
    fn configured_namespaces(&self, name: &str) -> &[String] {
        self.inner
            .configured
            .get(name)
            .map_or(&[], |e| e.namespaces.as_slice())
    }

    /// Forgets the registration of `name`; false if there was none.
    pub fn unregister(&self, name: &str) -> Result<bool, ExportError> {
        let mut registered = self.inner.registered.write().expect("exports lock");
        if !registered.contains_key(name) {
            return Ok(false);
        }
        let mut next = registered.clone();
        next.remove(name);
        self.save(&next)?;
        *registered = next;
        Ok(true)
    }

    fn registered(&self) -> std::sync::RwLockReadGuard<'_, BTreeMap<String, Registered>> {
        self.inner.registered.read().expect("exports lock")
    }

    fn save(&self, table: &BTreeMap<String, Registered>) -> Result<(), ExportError> {
        let Some(file) = &self.inner.file else {
            return Ok(());
        };
        let bytes = serde_json::to_vec_pretty(table).expect("exports serialize");
        chunker::durable::write_durably(file, &bytes).map_err(|cause| ExportError::Save {
            path: file.clone(),
            cause,
        })
    }
}

/// Whether `a` and `b` are one file (same device and inode), both existing.
fn same_file(a: &Path, b: &Path) -> bool {
    use std::os::unix::fs::MetadataExt;
    match (std::fs::metadata(a), std::fs::metadata(b)) {
        (Ok(x), Ok(y)) => x.dev() == y.dev() && x.ino() == y.ino(),
        _ => false,
    }
}

/// A registration as served now: a block volume's device directory is resolved to its
/// first device entry (by name), so a new pod's entry is found without registering again.
fn resolve(name: &str, r: &Registered) -> Result<Export, ExportError> {
    let path = if r.block && r.path.is_dir() {
        // Hidden entries are never the volume (mover's own clones beside an image).
        let mut entries: Vec<PathBuf> = std::fs::read_dir(&r.path)
            .map(|d| {
                d.filter_map(|e| e.ok().map(|e| e.path()))
                    .filter(|p| {
                        p.file_name()
                            .is_some_and(|n| !n.as_encoded_bytes().starts_with(b"."))
                    })
                    .collect()
            })
            .unwrap_or_default();
        entries.sort();
        entries
            .into_iter()
            .find(|p| {
                use std::os::unix::fs::FileTypeExt;
                std::fs::metadata(p)
                    .is_ok_and(|m| m.file_type().is_block_device() || m.file_type().is_file())
            })
            .ok_or_else(|| ExportError::NoDevice {
                name: name.into(),
                dir: r.path.clone(),
            })?
    } else {
        r.path.clone()
    };
    Ok(Export {
        path,
        read_only: false,
        namespaces: Vec::new(),
        peer_credential: None,
    })
}

/// The namespace of the PVC a fill is for, from the relationship it asks for
/// (`hydrate:NAMESPACE/NAME`, what mover's populator gives); `None` for any other.
pub fn fill_namespace(relationship: &str) -> Option<&str> {
    let (ns, _pvc) = relationship.strip_prefix("hydrate:")?.split_once('/')?;
    Some(ns)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_fill_reads_an_export_only_for_its_own_namespace() {
        let configured = BTreeMap::from([(
            "golden".to_string(),
            Export {
                path: "/srv/golden.img".into(),
                read_only: true,
                namespaces: vec!["app".into()],
                peer_credential: None,
            },
        )]);
        let state = tempfile::tempdir().unwrap();
        let exports = Exports::open(configured, vec!["/srv".into()], state.path()).unwrap();
        exports
            .register(
                "pv-2",
                Path::new("/srv/pv-2"),
                false,
                "hydrate:app/db",
                None,
            )
            .unwrap();
        let check = |name, relationship| exports.check_served_for(name, relationship);
        assert_eq!(check("golden", "hydrate:app/copy"), Ok(()));
        let refused = check("golden", "hydrate:t2/copy").unwrap_err();
        assert!(
            refused.contains("not for HydrationSources of namespace \"t2\""),
            "{refused}"
        );
        assert!(refused.contains("exports.golden.namespaces"), "{refused}");
        // Not a populator's fill: the administrator's export, served as before.
        assert_eq!(check("golden", "hydrate:golden"), Ok(()));
        assert_eq!(check("golden", "app/data"), Ok(()));
        // A move's volume: to the fill of its own PVC alone.
        assert_eq!(check("pv-2", "hydrate:app/db"), Ok(()));
        let refused = check("pv-2", "hydrate:t1/db").unwrap_err();
        assert!(
            refused.contains("registered for relationship \"hydrate:app/db\""),
            "{refused}"
        );
        assert_eq!(fill_namespace("hydrate:app/db"), Some("app"));
        assert_eq!(fill_namespace("hydrate:pv-2"), None);
    }

    #[test]
    fn registers_under_a_root_only_resolves_device_dirs_and_survives_a_restart() {
        let state = tempfile::tempdir().unwrap();
        let roots = tempfile::tempdir().unwrap();
        let root = roots.path().join("kubelet");
        std::fs::create_dir_all(root.join("pv-1/dev")).unwrap();
        let configured = BTreeMap::from([(
            "golden".to_string(),
            Export {
                path: "/srv/golden.img".into(),
                read_only: true,
                namespaces: Vec::new(),
                peer_credential: None,
            },
        )]);
        let open = || Exports::open(configured.clone(), vec![root.clone()], state.path()).unwrap();
        let exports = open();

        // Outside the roots, with '..', or replacing a configured export: refused.
        for (name, path) in [
            ("pv-x", PathBuf::from("/etc")),
            ("pv-x", root.join("../../etc")),
            ("golden", root.join("pv-1")),
            ("a/b", root.join("pv-1")),
        ] {
            let e = exports.register(name, &path, false, "", None).unwrap_err();
            assert!(
                matches!(e, ExportError::Refused { .. }),
                "{name} {path:?}: {e}"
            );
        }
        // The configured export is confirmed, not registered.
        assert!(
            !exports
                .register("golden", Path::new("/srv/golden.img"), false, "", None)
                .unwrap()
        );
        // A second name for a volume already served (a writable alias of a read-only
        // export, or of a registered one) is refused.
        let image = root.join("pv-9.img");
        std::fs::write(&image, b"").unwrap();
        let mut with_ro = configured.clone();
        with_ro.insert(
            "ro".into(),
            Export {
                path: image.clone(),
                read_only: true,
                namespaces: Vec::new(),
                peer_credential: None,
            },
        );
        let other_state = tempfile::tempdir().unwrap();
        let aliased = Exports::open(with_ro, vec![root.clone()], other_state.path()).unwrap();
        let e = aliased
            .register("alias", &image, false, "", None)
            .unwrap_err()
            .to_string();
        assert!(e.contains("has one name"), "{e}");
        assert!(exports.register("pv-9", &image, false, "", None).unwrap());
        let e = exports
            .register("pv-9b", &image, false, "", None)
            .unwrap_err()
            .to_string();
        assert!(e.contains("registered as \"pv-9\""), "{e}");
        assert!(exports.unregister("pv-9").unwrap());

        // A block volume's device directory: no device yet, then the first entry.
        let dir = root.join("pv-1/dev");
        assert!(exports.register("pv-1", &dir, true, "", None).unwrap());
        assert!(matches!(
            exports.get("pv-1"),
            Err(ExportError::NoDevice { .. })
        ));
        std::fs::write(dir.join("pod-b"), b"").unwrap();
        std::fs::write(dir.join("pod-a"), b"").unwrap();
        // mover's hidden clones beside an image are never taken for the volume.
        std::fs::write(dir.join(".pod-a.mover-snap-0"), b"").unwrap();
        assert_eq!(exports.get("pv-1").unwrap().path, dir.join("pod-a"));

        // Kept across a restart; forgotten by unregister, which leaves configured ones.
        let again = open();
        assert_eq!(again.names(), vec!["golden", "pv-1"]);
        assert_eq!(again.get("pv-1").unwrap().path, dir.join("pod-a"));
        assert!(again.unregister("pv-1").unwrap());
        assert!(!again.unregister("golden").unwrap());
        let e = open().get("pv-1").unwrap_err().to_string();
        assert!(e.contains("not exported") && e.contains("golden"), "{e}");

        // Roots narrowed since: what lies outside them is not served any more.
        assert!(
            again
                .register("pv-2", &root.join("pv-1"), false, "r/2", None)
                .unwrap()
        );
        // Served to the relationship it was registered for only; a configured one to any.
        assert!(again.check_served_for("pv-2", "r/2").is_ok());
        let e = again.check_served_for("pv-2", "r/3").unwrap_err();
        assert!(
            e.contains("only to the relationship it was registered for"),
            "{e}"
        );
        assert!(again.check_served_for("golden", "anything").is_ok());
        let narrowed = Exports::open(
            configured.clone(),
            vec![root.join("elsewhere")],
            state.path(),
        )
        .unwrap();
        assert!(narrowed.get("pv-2").is_err());

        // No roots: registering says how to allow it.
        let none = Exports::fixed(configured.clone());
        let e = none
            .register("pv-1", &dir, true, "", None)
            .unwrap_err()
            .to_string();
        assert!(e.contains("volume_roots"), "{e}");
    }
}
