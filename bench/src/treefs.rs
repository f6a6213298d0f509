//! Pieces shared by the tree benches: a fresh ext4 volume on a loop device, rsync's
//! content check of a copy, and a small deterministic generator.

use crate::process::run_checked;
use anyhow::{Context, Result, bail};
use std::{
    fs,
    os::unix::fs::FileExt,
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

/// The real trees a bench copies when given none: `dirs` that exist, and the cargo
/// registry (thousands of crates' sources: many small and mid-size files, deep trees).
pub fn default_sources(dirs: &[&str]) -> Vec<PathBuf> {
    let mut s: Vec<PathBuf> = dirs
        .iter()
        .map(PathBuf::from)
        .filter(|d| d.is_dir())
        .collect();
    let home = std::env::var_os("CARGO_HOME")
        .map(PathBuf::from)
        .or_else(|| std::env::var_os("HOME").map(|h| PathBuf::from(h).join(".cargo")));
    if let Some(reg) = home.map(|h| h.join("registry")).filter(|r| r.is_dir()) {
        s.push(reg);
    }
    s
}

/// Counts the entries and bytes of `sources` (see [`count`]) and says so on stderr.
pub fn describe_sources(sources: &[PathBuf]) -> Result<(u64, u64)> {
    let (files, bytes) = count(sources)?;
    eprintln!(
        "source: {} ({files} entries, {:.2} GiB)",
        sources
            .iter()
            .map(|s| s.display().to_string())
            .collect::<Vec<_>>()
            .join(", "),
        bytes as f64 / (1u64 << 30) as f64
    );
    Ok((files, bytes))
}

/// Copies each of `sources` with `cp -a` into `src` (as `0-NAME`, `1-NAME`, ...).
pub fn copy_sources(sources: &[PathBuf], src: &Path) -> Result<()> {
    fs::create_dir_all(src)?;
    for (i, s) in sources.iter().enumerate() {
        let to = src.join(format!(
            "{i}-{}",
            s.file_name().unwrap_or_default().to_string_lossy()
        ));
        eprintln!("copying {} to {}", s.display(), to.display());
        run_checked(Command::new("cp").arg("-a").arg(s).arg(&to))?;
    }
    Ok(())
}

/// Entries and bytes (apparent sizes of regular files) below `dirs`.
pub fn count(dirs: &[PathBuf]) -> Result<(u64, u64)> {
    let (mut files, mut bytes) = (0, 0);
    let mut stack: Vec<PathBuf> = dirs.to_vec();
    while let Some(d) = stack.pop() {
        for e in fs::read_dir(&d).with_context(|| format!("cannot list {}", d.display()))? {
            let e = e?;
            let m = e.metadata()?;
            files += 1;
            if m.is_dir() {
                stack.push(e.path());
            } else if m.is_file() {
                bytes += m.len();
            }
        }
    }
    Ok((files, bytes))
}

/// A day of edits, seeded by `round`: 1% of the files appended to, 0.5% overwritten in
/// place (4 KiB in the middle), the largest directory of the third level deleted, and a
/// copy of the second largest added with 10% of its files changed.
pub fn edit_real_tree(src: &Path, round: u64) -> Result<()> {
    eprintln!("   editing the tree");
    let mut rng = Rng(0x5eed_0000 + round * 7919 + 1);
    let mut files = Vec::new();
    let mut dirs: Vec<(u64, PathBuf)> = Vec::new();
    let mut stack = vec![(src.to_path_buf(), 0usize)];
    while let Some((d, depth)) = stack.pop() {
        let mut n = 0;
        for e in fs::read_dir(&d)? {
            let e = e?;
            let t = e.file_type()?;
            n += 1;
            if t.is_dir() {
                stack.push((e.path(), depth + 1));
            } else if t.is_file() {
                files.push(e.path());
            }
        }
        if depth == 3 {
            dirs.push((n, d));
        }
    }
    files.sort();
    let mut block = vec![0u8; 4096];
    for f in &files {
        let roll = rng.next() % 1000;
        if roll < 15 {
            rng.fill(&mut block);
            let file = fs::OpenOptions::new().read(true).write(true).open(f)?;
            let len = file.metadata()?.len();
            let at = if roll < 10 { len } else { len / 2 };
            file.write_all_at(&block, at)?;
        }
    }
    dirs.sort();
    let (_, doomed) = dirs.pop().context("no directory three levels down")?;
    let (_, copied) = dirs
        .pop()
        .context("no second directory three levels down")?;
    fs::remove_dir_all(&doomed)?;
    let new = copied.with_file_name(format!(
        "{}.new{round}",
        copied.file_name().unwrap_or_default().to_string_lossy()
    ));
    run_checked(Command::new("cp").arg("-a").arg(&copied).arg(&new))?;
    let mut stack = vec![new];
    while let Some(d) = stack.pop() {
        for e in fs::read_dir(&d)? {
            let e = e?;
            if e.file_type()?.is_dir() {
                stack.push(e.path());
            } else if e.file_type()?.is_file() && rng.next().is_multiple_of(10) {
                rng.fill(&mut block);
                let f = fs::OpenOptions::new().append(true).open(e.path())?;
                f.write_all_at(&block, 0)?;
            }
        }
    }
    Ok(())
}
