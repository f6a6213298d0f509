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
//! An agent killed while a device is attached takes its FUSE mount with it: the pod's
//! I/O then fails (EIO) instead of returning a wrong byte, and the agent, started
//! again, clears what is left so the next NodeStage attaches afresh.

mod fuse_file;

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
    pub fn new(frontend: Box<dyn Frontend>, exports: Arc<dyn NbdExports>) -> Arc<Devices> {
        Arc::new(Devices {
            frontend,
            exports,
            attached: Mutex::default(),
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

    /// Detaches the device of `name` (blocking); false if none was attached. A device
    /// still open is kept, and the error says so.
    pub fn detach(&self, name: &str) -> io::Result<bool> {
        let mut attached = self.attached.lock().expect("devices lock");
        let Some(a) = attached.get(name) else {
            return Ok(false);
        };
        if a.in_use() {
            return Err(io::Error::new(
                io::ErrorKind::ResourceBusy,
                format!(
                    "{} (export {name}) is still open: unmount what uses it first",
                    a.device().display()
                ),
            ));
        }
        attached.remove(name);
        tracing::info!(export = name, "device detached");
        Ok(true)
    }
}

/// A loop device over the one file of a FUSE mount the agent serves.
pub struct FuseLoop {
    /// `STATE/devices`: one mount point per attached export.
    dir: PathBuf,
    runtime: tokio::runtime::Handle,
}

impl FuseLoop {
    /// Mounts under `dir`, serving requests on `runtime`. Clears what an agent killed
    /// with devices attached left there: loop devices over dead mounts, and the mounts.
    pub fn new(dir: &Path, runtime: tokio::runtime::Handle) -> io::Result<FuseLoop> {
        std::fs::create_dir_all(dir)?;
        for entry in std::fs::read_dir(dir)? {
            let mount = entry?.path();
            let file = mount.join(fuse_file::FILE_NAME);
            for dev in loop_device::bound_to(&file).unwrap_or_default() {
                if let Err(e) = loop_device::detach(&dev) {
                    tracing::warn!(device = %dev.display(), "cannot detach a stale loop device: {e}");
                }
            }
            // A dead FUSE mount answers ENOTCONN to everything; lazily, as a stale loop
            // device may still hold it until its last user closes it.
            let _ = rustix::mount::unmount(&mount, rustix::mount::UnmountFlags::DETACH);
            let _ = std::fs::remove_dir(&mount);
        }
        Ok(FuseLoop {
            dir: dir.to_path_buf(),
            runtime,
        })
    }
}

impl Frontend for FuseLoop {
    fn attach(&self, name: &str, volume: Arc<dyn NbdVolume>) -> io::Result<Box<dyn Attached>> {
        let mount = self.dir.join(mover_engine::node::name_hash(name));
        std::fs::create_dir_all(&mount)?;
        let read_only = volume.read_only();
        let mut config = fuser::Config::default();
        config.mount_options = vec![
            fuser::MountOption::FSName(format!("mover:{name}")),
            fuser::MountOption::Subtype("mover".into()),
            fuser::MountOption::NoAtime,
            fuser::MountOption::NoDev,
            fuser::MountOption::NoSuid,
            fuser::MountOption::NoExec,
        ];
        let session = fuser::spawn_mount(
            fuse_file::VolumeFile {
                volume,
                runtime: self.runtime.clone(),
            },
            &mount,
            &config,
        )
        .map_err(|e| {
            io::Error::new(
                e.kind(),
                format!("cannot mount FUSE at {}: {e}", mount.display()),
            )
        })?;
        let mount = FuseMount {
            file: mount.join(fuse_file::FILE_NAME),
            dir: mount,
            session: Some(session),
        };
        // On an error the mount goes (its drop unmounts it and removes its directory).
        let binding = LoopBinding::attach(&mount.file, read_only)?;
        Ok(Box::new(FuseDevice {
            binding,
            _mount: mount,
        }))
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

/// A FUSE mount serving one volume file; unmounted and its directory removed on drop.
struct FuseMount {
    file: PathBuf,
    dir: PathBuf,
    session: Option<fuser::BackgroundSession>,
}

impl Drop for FuseMount {
    fn drop(&mut self) {
        // The loop driver lets go of the file a moment after losetup -d returns.
        for _ in 0..100 {
            if loop_device::bound_to(&self.file).map_or(true, |d| d.is_empty()) {
                break;
            }
            std::thread::sleep(std::time::Duration::from_millis(20));
        }
        drop(self.session.take());
        let _ = std::fs::remove_dir(&self.dir);
    }
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
