//! The mover image (`deploy/image/build.sh`) holds every program the code runs, and each
//! one works there: its layers are unpacked and the programs run inside them (chroot, the
//! host's /dev and /proc bound in, as the agent's privileged container sees them).
//!
//! Needs root and the built image: `.ci/run` builds it and passes its path as
//! `MOVER_IMAGE`.

mod common;

use std::{
    collections::BTreeSet,
    path::{Path, PathBuf},
    process::Command,
};

/// The image archive, or `None` after [`common::skip_unless_ci`].
fn image() -> Option<PathBuf> {
    match std::env::var_os("MOVER_IMAGE") {
        Some(p) if Path::new(&p).is_file() => Some(p.into()),
        _ => {
            common::skip_unless_ci(
                "MOVER_IMAGE does not name the image archive: build it with deploy/image/build.sh",
            );
            None
        }
    }
}

/// Unpacks the OCI archive's layers, lowest first, into `root`.
fn unpack(archive: &Path, root: &Path) {
    let oci = root.with_extension("oci");
    std::fs::create_dir_all(&oci).unwrap();
    std::fs::create_dir_all(root).unwrap();
    run(Command::new("tar")
        .arg("-xf")
        .arg(archive)
        .arg("-C")
        .arg(&oci));
    let json = |p: PathBuf| -> serde_json::Value {
        serde_json::from_slice(&std::fs::read(&p).unwrap()).unwrap()
    };
    let blob = |digest: &serde_json::Value| {
        oci.join("blobs/sha256")
            .join(digest.as_str().unwrap().trim_start_matches("sha256:"))
    };
    let index = json(oci.join("index.json"));
    let manifest = json(blob(&index["manifests"][0]["digest"]));
    for layer in manifest["layers"].as_array().unwrap() {
        run(Command::new("tar")
            .arg("-xzf")
            .arg(blob(&layer["digest"]))
            .arg("-C")
            .arg(root));
    }
}

fn run(cmd: &mut Command) -> String {
    let out = cmd.output().unwrap();
    assert!(
        out.status.success(),
        "{cmd:?} failed: {}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    String::from_utf8_lossy(&out.stdout).into_owned()
}

/// Every program the agent's code starts by name: `Command::new("NAME")` in mover's
/// sources (tests included: a test's program is no cost to carry), and `mkfs.FS` for
/// the file systems the CSI plugin formats.
fn programs_the_code_runs() -> BTreeSet<String> {
    let mut found = BTreeSet::new();
    let mut stack = vec![PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("src")];
    while let Some(dir) = stack.pop() {
        for entry in std::fs::read_dir(&dir).unwrap() {
            let path = entry.unwrap().path();
            if path.is_dir() {
                stack.push(path);
            } else if path.extension().is_some_and(|e| e == "rs") {
                let text = std::fs::read_to_string(&path).unwrap();
                for piece in text.split("Command::new(\"").skip(1) {
                    found.insert(piece.split('"').next().unwrap().to_string());
                }
                if text.contains("Command::new(format!(\"mkfs.{fs}\"))") {
                    found.extend(["mkfs.ext4".to_string(), "mkfs.xfs".to_string()]);
                }
            }
        }
    }
    found
}

#[test]
fn every_program_the_agent_runs_is_in_the_image_and_works_there() {
    let Some(archive) = image() else { return };
    if !common::tree::is_root() {
        return common::skip_unless_ci("the image test needs root (chroot, loop devices)");
    }
    let dir = tempfile::tempdir().unwrap();
    let root = dir.path().join("rootfs");
    unpack(&archive, &root);

    // What the code names, and what this test runs below: a program added to the code
    // and not to the image (or to this list) fails here.
    let named = programs_the_code_runs();
    let exercised: BTreeSet<String> = [
        "blkid",
        "losetup",
        "mkfs.ext4",
        "mkfs.xfs",
        "mount",
        "umount",
        "sleep",
    ]
    .map(String::from)
    .into();
    let not_exercised: Vec<_> = named
        .difference(&exercised)
        .filter(|p| *p != "s3s-fs") // the S3 test server, never in the image
        .collect();
    assert!(
        not_exercised.is_empty(),
        "the code runs {not_exercised:?}, which this test does not run in the image: add it to deploy/image/packages and here"
    );

    // The host's /dev and /proc, as the privileged agent container has them.
    for d in ["dev", "proc"] {
        std::fs::create_dir_all(root.join(d)).unwrap();
        run(Command::new("mount")
            .args(["--rbind", &format!("/{d}")])
            .arg(root.join(d)));
    }
    let _unmount = Unmount(vec![root.join("dev"), root.join("proc")]);

    // The script runs every program as the agent does: format a loop device with each
    // file system (unless blkid finds one), mount it, write, unmount, detach.
    let script = r#"
set -eu
mover --version
sleep 0
for fs in ext4 xfs; do
  truncate -s 320M /tmp/vol.$fs
  dev=$(losetup --find --show /tmp/vol.$fs)
  rc=0; blkid -p -o value -s TYPE "$dev" || rc=$?
  [ "$rc" = 2 ] || { echo "blkid on a blank device: $rc"; exit 1; }
  mkfs.$fs -q "$dev"
  [ "$(blkid -p -o value -s TYPE "$dev")" = "$fs" ]
  mkdir -p /mnt/$fs
  mount "$dev" /mnt/$fs
  echo written > /mnt/$fs/file
  umount /mnt/$fs
  losetup -d "$dev"
  echo "$fs ok"
done
"#;
    let out = run(Command::new("chroot")
        .arg(&root)
        .args(["/bin/sh", "-c", script])
        .env(
            "PATH",
            "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin",
        ));
    assert!(out.contains("mover "), "mover --version said {out:?}");
    assert!(out.contains("ext4 ok") && out.contains("xfs ok"), "{out}");
}

/// Lazily unmounts the bound trees on drop, even when an assertion failed.
struct Unmount(Vec<PathBuf>);

impl Drop for Unmount {
    fn drop(&mut self) {
        for p in &self.0 {
            let _ = Command::new("umount").arg("-R").arg("-l").arg(p).status();
        }
    }
}

/// The install names the image by the tag `deploy/image/build.sh` gives it: the version
/// in Cargo.toml.
#[test]
fn the_install_names_the_image_the_build_makes() {
    let repo = Path::new(env!("CARGO_MANIFEST_DIR")).parent().unwrap();
    for k in ["deploy/base", "deploy/examples/jobs"] {
        let text = std::fs::read_to_string(repo.join(k).join("kustomization.yaml")).unwrap();
        let field = |name: &str| {
            text.lines()
                .find_map(|l| l.trim().strip_prefix(name))
                .unwrap_or_else(|| panic!("{k}: no {name}"))
                .trim()
                .to_string()
        };
        assert_eq!(
            (field("newName:"), field("newTag:")),
            (
                "localhost/mover".to_string(),
                env!("CARGO_PKG_VERSION").to_string()
            ),
            "{k}/kustomization.yaml names another image than deploy/image/build.sh makes"
        );
    }
}
