//! Block devices for the volumes an agent serves: how a pod, through mover's CSI node
//! plugin, uses an export, one still hydrating included (its reads of regions still to
//! come wait for them; the rest fills in behind).
//!
//! These kernels have no NBD client, no ublk and no device-mapper; they have FUSE and
//! loop devices. So [`FuseLoop`] serves the volume as the one file of a FUSE mount under
//! `STATE/devices/` and binds a loop device to that file. Where a kernel has an NBD
//! client or ublk, a [`Frontend`] of that kind takes the same place: the volume it is
//! handed is the one the NBD server serves.
//!
//! A device outlives the agent that made it. With an fd store (`fd_store` in agent.toml,
//! [`crate::fd_store`]), the FUSE connection of each device is kept there too: while the
//! agent is gone (killed, restarted, upgraded) the kernel holds the pods' requests, and
//! the agent started again takes the connections back ([`Frontend::adopt`]) and serves
//! on, the requests its predecessor never answered included. Without one, an agent's
//! death ends its connections: the pods' I/O then fails (EIO) instead of returning a
//! wrong byte, and the agent, started again, clears what is left so the next NodeStage
//! attaches afresh.

mod fuse_file;
mod fuse_wire;

use crate::fd_store::{FdStore, Kept};
use mover_engine::node::loop_device;
use std::{
    collections::BTreeMap,
    io,
    path::{Path, PathBuf},
    sync::{Arc, Mutex},
};
use transport::nbd::{NbdExports, NbdVolume};

/// Makes a served volume a block device.
pub trait Frontend: Send + Sync {
    /// A block device whose bytes are `volume`'s, named after export `name`.
    fn attach(&self, name: &str, volume: Arc<dyn NbdVolume>) -> io::Result<Box<dyn Attached>>;

    /// The devices an earlier agent left that this one serves again, by export name
    /// (opened in `exports`); what is left of the others is cleared.
    fn adopt(&self, exports: &dyn NbdExports) -> Vec<(String, Box<dyn Attached>)>;
}

/// A device a [`Frontend`] made.
pub trait Attached: Send + Sync {
    /// The device node (`/dev/loopN`).
    fn device(&self) -> &Path;
    /// Whether a client still holds the device open (it cannot go yet).
    fn in_use(&self) -> bool;
}

/// The devices an agent has attached, by export name.
pub struct Devices {
    frontend: Box<dyn Frontend>,
    exports: Arc<dyn NbdExports>,
    attached: Mutex<BTreeMap<String, Box<dyn Attached>>>,
}

impl Devices {
    /// Devices made by `frontend` for the volumes `exports` opens.
    /// The devices an earlier agent left are adopted first (blocking).
    pub fn new(frontend: Box<dyn Frontend>, exports: Arc<dyn NbdExports>) -> Arc<Devices> {
        let adopted = frontend.adopt(&*exports);
        Arc::new(Devices {
            frontend,
            exports,
            attached: Mutex::new(adopted.into_iter().collect()),
        })
    }

    /// The device of export `name`, attached now unless it is already (blocking: it
    /// mounts and runs losetup).
    pub fn attach(&self, name: &str) -> io::Result<PathBuf> {
        let mut attached = self.attached.lock().expect("devices lock");
        if let Some(a) = attached.get(name) {
            return Ok(a.device().to_path_buf());
        }
        let volume = self
            .exports
            .open(name)
            .map_err(|why| io::Error::new(io::ErrorKind::NotFound, why))?;
        // A volume with nothing left to arrive needs no frontend: the loop device goes
        // straight to its file, and its I/O never leaves the kernel.
        let (a, through): (Box<dyn Attached>, &str) = match volume.local_file() {
            Some(file) => (
                Box::new(LoopBinding::attach(&file, volume.read_only())?),
                "its local file",
            ),
            None => (self.frontend.attach(name, volume)?, "the agent"),
        };
        let device = a.device().to_path_buf();
        tracing::info!(export = name, device = %device.display(), through, "device attached");
        attached.insert(name.to_string(), a);
        Ok(device)
    }

    /// The device of `name`, if attached.
    pub fn device(&self, name: &str) -> Option<PathBuf> {
        let attached = self.attached.lock().expect("devices lock");
        attached.get(name).map(|a| a.device().to_path_buf())
    }

    /// The device over export `name` on this node, if one is: its recorded one, or a loop
    /// device straight over its file that an earlier agent attached (blocking).
    pub fn attached_to(&self, name: &str) -> Option<PathBuf> {
        if let Some(device) = self.device(name) {
            return Some(device);
        }
        let file = self.exports.open(name).ok()?.local_file()?;
        loop_device::bound_to(&file).ok()?.into_iter().next()
    }

    /// Detaches the device of `name` (blocking); false if none was attached. A device
    /// still open is kept, and the error says so.
    pub fn detach(&self, name: &str) -> io::Result<bool> {
        let mut attached = self.attached.lock().expect("devices lock");
        let Some(a) = attached.get(name) else {
            return self.detach_unrecorded(name);
        };
        if a.in_use() {
            return Err(still_open(a.device(), name));
        }
        attached.remove(name);
        tracing::info!(export = name, "device detached");
        Ok(true)
    }

    /// Detaches the loop devices straight over export `name`'s file that an earlier agent
    /// attached (they outlive it, unrecorded); false if there are none.
    fn detach_unrecorded(&self, name: &str) -> io::Result<bool> {
        let Some(file) = self.exports.open(name).ok().and_then(|v| v.local_file()) else {
            return Ok(false);
        };
        let devices = loop_device::bound_to(&file).unwrap_or_default();
        for device in &devices {
            if is_open(device) {
                return Err(still_open(device, name));
            }
            loop_device::detach(device)?;
            tracing::info!(export = name, device = %device.display(), "device an earlier agent attached detached");
        }
        Ok(!devices.is_empty())
    }
}

impl Drop for Devices {
    /// An agent that exits leaves every device as it is: pods go on using those the next
    /// agent adopts, and a loop device straight over its file needs no agent at all.
    /// (Detaching one here could free its number while a pod's bind-mounted device node
    /// still names it, for the next attach to give to another volume.) NodeUnstage
    /// detaches them, recorded or not ([`Devices::detach`]).
    fn drop(&mut self) {
        let attached = std::mem::take(&mut *self.attached.lock().expect("devices lock"));
        for (_, a) in attached {
            std::mem::forget(a);
        }
    }
}

/// A loop device over the one file of a FUSE mount the agent serves.
pub struct FuseLoop {
    /// `STATE/devices`: one mount point per attached export.
    dir: PathBuf,
    runtime: tokio::runtime::Handle,
    /// Where each connection is kept beyond the agent, if anywhere.
    store: Option<Arc<FdStore>>,
    /// What the store handed back at start, until [`Frontend::adopt`] takes it.
    kept: Mutex<Vec<Kept>>,
}

/// What the fd store keeps beside a device's connection, to find the device again.
#[derive(serde::Serialize, serde::Deserialize)]
struct KeptDevice {
    /// The loop device (`/dev/loopN`).
    device: PathBuf,
    /// The FUSE file it is bound to: device number ("MAJ:MIN") and inode.
    file_dev: String,
    file_ino: u64,
}

impl FuseLoop {
    /// Mounts under `dir`, serving requests on `runtime`; connections are kept in
    /// `store` (with what it handed back when connected), if given.
    pub fn new(
        dir: &Path,
        runtime: tokio::runtime::Handle,
        store: Option<(Arc<FdStore>, Vec<Kept>)>,
    ) -> io::Result<FuseLoop> {
        std::fs::create_dir_all(dir)?;
        let (store, kept) = match store {
            Some((store, kept)) => (Some(store), kept),
            None => (None, Vec::new()),
        };
        Ok(FuseLoop {
            dir: dir.to_path_buf(),
            runtime,
            store,
            kept: Mutex::new(kept),
        })
    }

    /// Serves connection `kept` of export `name` again.
    fn adopt_one(&self, kept: Kept, exports: &dyn NbdExports) -> Result<Box<dyn Attached>, String> {
        let meta: KeptDevice =
            serde_json::from_value(kept.meta.clone()).map_err(|e| format!("its record: {e}"))?;
        let bound = loop_device::backing_file_id(&meta.device).map_err(|e| e.to_string())?;
        if bound != (meta.file_dev.clone(), meta.file_ino) {
            return Err(format!(
                "{} is bound to another file now ({}, inode {})",
                meta.device.display(),
                bound.0,
                bound.1
            ));
        }
        let volume = exports.open(&kept.name)?;
        let conn = Arc::new(kept.fd);
        if let Some(store) = &self.store {
            store.remember(&kept.name, kept.meta, &conn);
        }
        let file = Arc::new(fuse_file::VolumeFile {
            volume,
            runtime: self.runtime.clone(),
        });
        fuse_file::serve(conn.clone(), file, true).map_err(|e| e.to_string())?;
        Ok(Box::new(FuseDevice {
            binding: LoopBinding {
                device: meta.device,
            },
            _mount: FuseMount {
                dir: None,
                name: kept.name,
                store: self.store.clone(),
                _conn: conn,
            },
        }))
    }

    /// Clears what an agent killed with devices attached left under `dir` and the store
    /// did not keep: loop devices over dead mounts, and the mounts.
    fn clear_left(&self, adopted: &[PathBuf]) -> io::Result<()> {
        for entry in std::fs::read_dir(&self.dir)? {
            let mount = entry?.path();
            let file = mount.join(fuse_file::FILE_NAME);
            for dev in loop_device::bound_to(&file).unwrap_or_default() {
                if adopted.contains(&dev) {
                    continue;
                }
                if let Err(e) = loop_device::detach(&dev) {
                    tracing::warn!(device = %dev.display(), "cannot detach a stale loop device: {e}");
                }
            }
            // A dead FUSE mount answers ENOTCONN to everything; lazily, as a stale loop
            // device may still hold it until its last user closes it. An adopted one
            // goes on without its mount point: its loop device holds the file.
            let _ = rustix::mount::unmount(&mount, rustix::mount::UnmountFlags::DETACH);
            let _ = std::fs::remove_dir(&mount);
        }
        Ok(())
    }
}

impl Frontend for FuseLoop {
    fn attach(&self, name: &str, volume: Arc<dyn NbdVolume>) -> io::Result<Box<dyn Attached>> {
        let dir = self.dir.join(mover_engine::node::name_hash(name));
        std::fs::create_dir_all(&dir)?;
        let read_only = volume.read_only();
        let conn = match fuse_file::mount(&dir, name) {
            Ok(fd) => Arc::new(fd),
            Err(e) => {
                let _ = std::fs::remove_dir(&dir);
                return Err(e);
            }
        };
        let file = dir.join(fuse_file::FILE_NAME);
        let mount = FuseMount {
            dir: Some(dir),
            name: name.to_string(),
            store: self.store.clone(),
            _conn: conn.clone(),
        };
        // On an error from here the mount goes (its drop unmounts it).
        let served = Arc::new(fuse_file::VolumeFile {
            volume,
            runtime: self.runtime.clone(),
        });
        fuse_file::serve(conn.clone(), served, false)?;
        if let Some(dir) = &mount.dir
            && let Err(e) = fuse_file::tune_as_a_disk(dir)
        {
            // The device works; a pod's large I/O waits on the agent more.
            tracing::warn!(
                export = name,
                "the device keeps FUSE's limits on dirty pages and read-ahead: {e}"
            );
        }
        let binding = LoopBinding::attach(&file, read_only)?;
        if let Some(store) = &self.store {
            let (file_dev, file_ino) = loop_device::file_id(&file)?;
            let meta = KeptDevice {
                device: binding.device.clone(),
                file_dev,
                file_ino,
            };
            let meta = serde_json::to_value(meta).map_err(io::Error::other)?;
            // The device works without it; it would not outlive this agent.
            if let Err(e) = store.put(name, meta, &conn) {
                tracing::warn!(
                    export = name,
                    "the fd store did not take the device's connection: a restart of this agent will end the pod's I/O: {e}"
                );
            }
        }
        Ok(Box::new(FuseDevice {
            binding,
            _mount: mount,
        }))
    }

    fn adopt(&self, exports: &dyn NbdExports) -> Vec<(String, Box<dyn Attached>)> {
        let kept = std::mem::take(&mut *self.kept.lock().expect("kept lock"));
        let mut adopted = Vec::new();
        for k in kept {
            let name = k.name.clone();
            match self.adopt_one(k, exports) {
                Ok(a) => {
                    tracing::info!(export = name, device = %a.device().display(), "device adopted from the fd store: serving its pod's I/O again");
                    adopted.push((name, a));
                }
                Err(why) => {
                    // Its pods' requests would wait for ever: closing the store's copy
                    // ends the connection, and they fail instead.
                    tracing::error!(
                        export = name,
                        "cannot serve a device the fd store kept, so its connection is closed and its pods' I/O fails: {why}"
                    );
                    if let Some(store) = &self.store {
                        let _ = store.forget(&name);
                    }
                }
            }
        }
        let devices: Vec<_> = adopted
            .iter()
            .map(|(_, a)| a.device().to_path_buf())
            .collect();
        if let Err(e) = self.clear_left(&devices) {
            tracing::warn!(dir = %self.dir.display(), "cannot clear what an earlier agent left: {e}");
        }
        adopted
    }
}

/// A loop device bound to a file, detached when dropped: a volume's own file, or the
/// one file of a FUSE mount.
struct LoopBinding {
    device: PathBuf,
}

impl LoopBinding {
    fn attach(file: &Path, read_only: bool) -> io::Result<LoopBinding> {
        Ok(LoopBinding {
            device: loop_device::attach(file, read_only)?,
        })
    }
}

impl Attached for LoopBinding {
    fn device(&self) -> &Path {
        &self.device
    }

    fn in_use(&self) -> bool {
        // The loop device is bound until its last user closes it; losetup -d (in drop)
        // clears it then. Before that it is in use if a mount or a process has it.
        is_open(&self.device)
    }
}

impl Drop for LoopBinding {
    fn drop(&mut self) {
        if let Err(e) = loop_device::detach(&self.device) {
            tracing::warn!(device = %self.device.display(), "cannot detach: {e}");
        }
    }
}

/// A loop device over the one file of a FUSE mount. Fields drop in order: the loop
/// device is detached before the mount goes.
struct FuseDevice {
    binding: LoopBinding,
    /// Held for its drop.
    _mount: FuseMount,
}

impl Attached for FuseDevice {
    fn device(&self) -> &Path {
        self.binding.device()
    }

    fn in_use(&self) -> bool {
        self.binding.in_use()
    }
}

/// A FUSE connection serving one volume file, at a mount point of this agent (or, adopted
/// from an earlier agent's, at none). Dropped once its loop device is detached: the
/// mount goes, and the store's copy of the connection.
struct FuseMount {
    dir: Option<PathBuf>,
    name: String,
    store: Option<Arc<FdStore>>,
    /// The connection (its serving thread holds it too, until the kernel ends it).
    _conn: Arc<rustix::fd::OwnedFd>,
}

impl Drop for FuseMount {
    fn drop(&mut self) {
        if let Some(dir) = &self.dir {
            // Lazily: the loop driver lets go of the file a moment after losetup -d.
            let _ = rustix::mount::unmount(dir, rustix::mount::UnmountFlags::DETACH);
            let _ = std::fs::remove_dir(dir);
        }
        if let Some(store) = &self.store
            && let Err(e) = store.forget(&self.name)
        {
            tracing::warn!(export = self.name, "{e}");
        }
    }
}

/// Why `device` of export `name` cannot be detached yet.
fn still_open(device: &Path, name: &str) -> io::Error {
    io::Error::new(
        io::ErrorKind::ResourceBusy,
        format!(
            "{} (export {name}) is still open: unmount what uses it first",
            device.display()
        ),
    )
}

/// Whether anything holds `device` open: an exclusive open (O_EXCL on a block device)
/// fails with EBUSY while it is mounted or claimed; other openers (a pod's raw block
/// use) show in /proc.
fn is_open(device: &Path) -> bool {
    use std::os::unix::fs::OpenOptionsExt;
    let exclusive = std::fs::OpenOptions::new()
        .read(true)
        .custom_flags(libc::O_EXCL)
        .open(device);
    if let Err(e) = exclusive {
        return e.raw_os_error() == Some(libc::EBUSY);
    }
    mover_engine::node::holders::holders(device, std::process::id()).is_ok_and(|h| !h.is_empty())
}
