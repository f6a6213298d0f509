//! What on this node still holds a volume: the acknowledgement a move waits for before
//! it ships the final cycle. A pod that is gone leaves no mount of the volume's device,
//! no loop device over its image and no process with either open.

use std::{
    io,
    os::unix::fs::{FileTypeExt, MetadataExt},
    path::{Path, PathBuf},
};

/// Each holder of `volume` (a block device or image file), said in a few words: its
/// mounts, the loop devices bound to it (and their mounts), and the processes other
/// than `except` (the agent itself) with one of them open. Empty: nothing holds it.
pub fn holders(volume: &Path, except: u32) -> io::Result<Vec<String>> {
    let meta = std::fs::metadata(volume)?;
    let mut devices: Vec<PathBuf> = Vec::new();
    let mut out = Vec::new();
    if meta.file_type().is_block_device() {
        devices.push(volume.to_path_buf());
    } else if meta.is_file() {
        for dev in super::loop_device::bound_to(volume)? {
            out.push(format!("loop device {} is bound to it", dev.display()));
            devices.push(dev);
        }
    }
    for dev in &devices {
        for m in super::freeze::mounts_of(dev)? {
            out.push(format!("{} is mounted at {}", dev.display(), m.display()));
        }
    }
    let mut wanted = vec![identity(&meta)];
    for d in &devices {
        if let Ok(m) = std::fs::metadata(d) {
            wanted.push(identity(&m));
        }
    }
    for (pid, name) in processes_holding(&wanted, except) {
        out.push(format!("process {pid} ({name}) has it open"));
    }
    Ok(out)
}

/// Where to freeze so that nothing can write into the image file `image`: one mount
/// point of each loop device bound to it. `None` where freezing those could not hold
/// every writer back: no loop device is bound to it, one is not mounted (a raw block
/// volume: nothing to freeze), or some process has the image or one of those devices
/// open (this one included: the agent may serve it).
pub fn sole_writers(image: &Path) -> io::Result<Option<Vec<PathBuf>>> {
    let meta = std::fs::metadata(image)?;
    let devices = super::loop_device::bound_to(image)?;
    if devices.is_empty() {
        return Ok(None);
    }
    let mut mounts = Vec::with_capacity(devices.len());
    let mut wanted = vec![identity(&meta)];
    for dev in &devices {
        let Some(mount) = super::freeze::mounts_of(dev)?.into_iter().next() else {
            return Ok(None);
        };
        mounts.push(mount);
        wanted.push(identity(&std::fs::metadata(dev)?));
    }
    // pid 0 is no process: none is excepted.
    Ok(processes_holding(&wanted, 0).is_empty().then_some(mounts))
}

/// Files are told apart by (device, inode), block devices by their number: a path under
/// /dev of a container or a kubelet's per-pod device entry names the same device.
fn identity(m: &std::fs::Metadata) -> (u64, u64) {
    if m.file_type().is_block_device() {
        (0, m.rdev())
    } else {
        (m.dev(), m.ino())
    }
}

/// The processes (pid, command name) with an open file whose identity is in `wanted`.
fn processes_holding(wanted: &[(u64, u64)], except: u32) -> Vec<(u32, String)> {
    let mut found = Vec::new();
    let Ok(procs) = std::fs::read_dir("/proc") else {
        return found;
    };
    for p in procs.flatten() {
        let Some(pid) = p.file_name().to_str().and_then(|s| s.parse::<u32>().ok()) else {
            continue;
        };
        if pid == except {
            continue;
        }
        // A process that ends meanwhile, or one this agent may not look into, is passed
        // over: the agent runs privileged in the host's PID namespace, so that is none
        // that matters.
        let Ok(fds) = std::fs::read_dir(p.path().join("fd")) else {
            continue;
        };
        let holds = fds
            .flatten()
            .filter_map(|fd| std::fs::metadata(fd.path()).ok())
            .any(|m| wanted.contains(&identity(&m)));
        if holds {
            let name = std::fs::read_to_string(p.path().join("comm")).unwrap_or_default();
            found.push((pid, name.trim().to_string()));
        }
    }
    found
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn an_image_nobody_opened_has_no_holders_and_one_held_open_names_the_process() {
        let dir = tempfile::tempdir().unwrap();
        let image = dir.path().join("v.img");
        std::fs::write(&image, vec![0u8; 4096]).unwrap();
        let me = std::process::id();
        let none = holders(&image, me).unwrap();
        assert!(none.is_empty(), "{none:?}");
        let _open = std::fs::File::open(&image).unwrap();
        let mut child = std::process::Command::new("sleep")
            .arg("30")
            .stdin(std::fs::File::open(&image).unwrap())
            .spawn()
            .unwrap();
        let held = holders(&image, me).unwrap();
        child.kill().unwrap();
        child.wait().unwrap();
        assert_eq!(
            held,
            vec![format!("process {} (sleep) has it open", child.id())],
            "this process is excepted, the child is not"
        );
    }
}
