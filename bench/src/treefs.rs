//! Pieces shared by the tree benches: a fresh ext4 volume on a loop device, rsync's
//! content check of a copy, and a small deterministic generator.

use crate::process::run_checked;
use anyhow::{Context, Result, bail};
use std::{
    fs,
    path::{Path, PathBuf},
    process::Command,
};

/// A fresh ext4 filesystem on a loop device over a sparse image, mounted; unmounted,
/// detached and deleted on drop (also when the bench fails).
pub struct Volume {
    image: PathBuf,
    pub mnt: PathBuf,
    /// The loop device, until released.
    dev: Option<String>,
    mounted: bool,
}

impl Volume {
    /// A filesystem of `size` bytes with `inodes` inodes, at `WORKDIR/mnt`.
    pub fn make(workdir: &Path, size: u64, inodes: u64) -> Result<Volume> {
        let image = workdir.join("tree.img");
        let mnt = workdir.join("mnt");
        // Leftovers of a run that was killed.
        _ = Command::new("umount").arg(&mnt).output();
        if let Ok(out) = Command::new("losetup").arg("-j").arg(&image).output() {
            for line in String::from_utf8_lossy(&out.stdout).lines() {
                if let Some(dev) = line.split(':').next() {
                    _ = Command::new("losetup").args(["-d", dev]).output();
                }
            }
        }
        _ = fs::remove_file(&image);
        let size = size.next_multiple_of(1 << 20);
        fs::File::create(&image)?.set_len(size)?;
        eprintln!(
            "making a fresh {} GiB ext4 filesystem ({inodes} inodes) in {}",
            size >> 30,
            image.display()
        );
        run_checked(
            Command::new("mkfs.ext4")
                .args(["-q", "-F", "-N", &inodes.to_string()])
                // Inode tables written now, not by a kernel thread during the runs.
                .args(["-E", "lazy_itable_init=0,lazy_journal_init=0"])
                .arg(&image),
        )?;
        let out = run_checked(
            Command::new("losetup")
                .args(["-f", "--show", "--direct-io=on"])
                .arg(&image),
        )?;
        let mut volume = Volume {
            image,
            mnt,
            dev: Some(String::from_utf8_lossy(&out).trim().to_string()),
            mounted: false,
        };
        fs::create_dir_all(&volume.mnt)?;
        run_checked(
            Command::new("mount")
                .arg(volume.dev.as_ref().context("loop device")?)
                .arg(&volume.mnt),
        )?;
        volume.mounted = true;
        Ok(volume)
    }

    pub fn remove(mut self) -> Result<()> {
        self.release()
    }

    pub fn keep(mut self) {
        if let Some(dev) = self.dev.take() {
            eprintln!(
                "kept: {} on {dev}, mounted at {}",
                self.image.display(),
                self.mnt.display()
            );
        }
    }

    fn release(&mut self) -> Result<()> {
        let Some(dev) = self.dev.take() else {
            return Ok(());
        };
        if std::mem::take(&mut self.mounted) {
            run_checked(Command::new("umount").arg(&self.mnt))?;
        }
        run_checked(Command::new("losetup").args(["-d", &dev]))?;
        fs::remove_file(&self.image)?;
        Ok(())
    }
}

impl Drop for Volume {
    fn drop(&mut self) {
        if let Err(e) = self.release() {
            eprintln!("mover-bench: cannot remove {}: {e:#}", self.image.display());
        }
    }
}

/// rsync's own comparison, by content, of the source and a copy: no line means equal.
pub fn check_identical(src: &Path, copy: &Path) -> Result<()> {
    let out = run_checked(
        Command::new("rsync")
            .arg("-aHAXnc")
            .arg("--delete")
            .arg("--itemize-changes")
            .arg(format!("{}/", src.display()))
            .arg(format!("{}/", copy.display())),
    )?;
    let listing = String::from_utf8_lossy(&out);
    let differing: Vec<&str> = listing.lines().filter(|l| !l.trim().is_empty()).collect();
    if !differing.is_empty() {
        bail!(
            "{} differs from the source in {} entries, e.g.:\n{}",
            copy.display(),
            differing.len(),
            differing[..differing.len().min(10)].join("\n")
        );
    }
    Ok(())
}

/// A small deterministic generator (xorshift64*): the same tree on every machine.
pub struct Rng(pub u64);

impl Rng {
    pub fn next(&mut self) -> u64 {
        self.0 ^= self.0 >> 12;
        self.0 ^= self.0 << 25;
        self.0 ^= self.0 >> 27;
        self.0.wrapping_mul(0x2545_f491_4f6c_dd1d)
    }

    pub fn fill(&mut self, buf: &mut [u8]) {
        for chunk in buf.chunks_mut(8) {
            let v = self.next().to_le_bytes();
            chunk.copy_from_slice(&v[..chunk.len()]);
        }
    }
}
