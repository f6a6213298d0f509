//! mover's CSI plugin (the agent's `csi_socket`) with real clients:
//! - csi-sanity, the CSI conformance suite (github.com/kubernetes-csi/csi-test, built by
//!   deploy/test-cluster/build.sh), for Filesystem and Block volumes;
//! - the kubelet's step for a pod, made here with the plugin's own Node calls through
//!   grpcurl, to check each call's outcome on its own (the real kubelet making them for
//!   real pods is `kube_nodes.rs`' populated PVCs), on a volume still hydrating from a
//!   peer agent: its device and file system are usable at once, every byte read is the
//!   source's; an agent killed mid-fill gives errors, never a wrong byte, or, with an fd
//!   store keeping the device's connection, only a pause.

// Its tools (csi-sanity, grpcurl) come with the test cluster's build, as kube's tests' do.
#![cfg(feature = "controller")]

mod common;

use common::{
    MIB,
    agent::Agent,
    blake3_of,
    csi::{Kubelet, hashes_under, ok, source_tree},
};
use std::{
    collections::BTreeMap,
    path::{Path, PathBuf},
    process::{Command, Output},
    time::Instant,
};

/// build.sh's binaries with csi-sanity, grpcurl and csi.proto, and root (the plugin
/// attaches loop devices and mounts); `None` after `skip_unless_ci` otherwise.
fn tools() -> Option<PathBuf> {
    let bin = common::cluster::binaries()?;
    let missing: Vec<_> = ["csi-sanity", "grpcurl", "proto/csi.proto"]
        .into_iter()
        .filter(|f| !bin.join(f).is_file())
        .collect();
    if !missing.is_empty() {
        common::skip_unless_ci(&format!(
            "{} not in {}: build them with deploy/test-cluster/build.sh",
            missing.join(", "),
            bin.display()
        ));
        return None;
    }
    if !rustix::process::geteuid().is_root() {
        common::skip_unless_ci("the CSI plugin needs root (FUSE, loop devices, mounts)");
        return None;
    }
    Some(bin)
}

/// An agent serving the CSI plugin on `dir/csi.sock` as node `node`, with `exports`
/// (and `settings`, more agent.toml lines).
fn plugin_agent(dir: &Path, node: &str, exports: &[(&str, &Path, bool)], settings: &str) -> Agent {
    Agent::start_with_settings(
        dir,
        exports,
        None,
        &format!(
            "node_name = \"{node}\"\ncsi_socket = \"{}\"\n{settings}",
            dir.join("csi.sock").display()
        ),
    )
}

/// A `mover fd-store` process on `socket`, its log in `socket`.log; killed on drop.
struct FdStore {
    child: std::process::Child,
    socket: PathBuf,
}

impl FdStore {
    fn start(socket: &Path) -> FdStore {
        std::fs::create_dir_all(socket.parent().unwrap()).unwrap();
        let log = std::fs::OpenOptions::new()
            .create(true)
            .append(true)
            .open(socket.with_extension("log"))
            .unwrap();
        let child = Command::new(env!("CARGO_BIN_EXE_mover"))
            .args(["fd-store", "--socket", socket.to_str().unwrap()])
            .env("NO_COLOR", "1")
            .stderr(log)
            .spawn()
            .unwrap();
        FdStore {
            child,
            socket: socket.to_path_buf(),
        }
    }

    /// kill -9, then started again on the same socket (what it held is gone).
    fn kill_and_restart(&mut self) {
        self.child.kill().unwrap();
        self.child.wait().unwrap();
        let fresh = FdStore::start(&self.socket);
        let old = std::mem::replace(self, fresh);
        std::mem::forget(old); // already dead
    }

    /// How many times its log says it kept a descriptor for `name`.
    fn kept(&self, name: &str) -> usize {
        let log = std::fs::read_to_string(self.socket.with_extension("log")).unwrap_or_default();
        let name = format!("name=\"{name}\"");
        log.lines()
            .filter(|l| l.contains(" kept ") && l.contains(&name))
            .count()
    }
}

impl Drop for FdStore {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

fn run(cmd: &str, args: &[&str]) -> Output {
    Command::new(cmd)
        .args(args)
        .output()
        .unwrap_or_else(|e| panic!("{cmd} is needed by this test: {e}"))
}

/// `mover hydrate ARGS`, which must succeed.
fn hydrate(args: &[&str]) -> String {
    let out = common::agent::hydrate(args);
    ok(out, &format!("mover hydrate {}", args.join(" ")))
}

#[test]
fn csi_sanity_passes_for_filesystem_and_block_volumes() {
    let Some(bin) = tools() else { return };
    let dir = tempfile::tempdir().unwrap();
    let agent = plugin_agent(dir.path(), "node-a", &[], "");
    for access in ["mount", "block"] {
        // csi-sanity makes both directories before each test and fails if they exist.
        let work = dir.path().join(format!("sanity-{access}"));
        std::fs::create_dir_all(&work).unwrap();
        let out = Command::new(bin.join("csi-sanity"))
            .arg(format!(
                "--csi.endpoint=unix://{}",
                dir.path().join("csi.sock").display()
            ))
            .arg(format!("--csi.mountdir={}", work.join("target").display()))
            .arg(format!(
                "--csi.stagingdir={}",
                work.join("staging").display()
            ))
            .arg(format!("--csi.testvolumesize={}", 64 * MIB))
            .arg(format!("--csi.testvolumeaccesstype={access}"))
            .arg("--ginkgo.no-color")
            .output()
            .unwrap();
        let text = String::from_utf8_lossy(&out.stdout);
        let summary = text
            .lines()
            .find(|l| l.contains(" Passed | "))
            .unwrap_or_else(|| panic!("csi-sanity ({access}) printed no summary:\n{text}"));
        eprintln!("csi-sanity, {access} volumes: {summary}");
        assert!(
            out.status.success(),
            "csi-sanity ({access}) failed:\n{text}{}",
            String::from_utf8_lossy(&out.stderr),
        );
        // Every spec our capabilities reach runs and passes; the rest are the
        // capabilities the plugin does not declare (snapshots, cloning, expansion,
        // ControllerPublish, ListVolumes, GetCapacity, volume stats and health, group
        // snapshots), which csi-sanity skips by name.
        assert!(
            summary.contains("33 Passed | 0 Failed"),
            "csi-sanity ({access}): {summary}"
        );
    }
    drop(agent);
    assert_no_devices_left(dir.path());
}

/// No loop device is left over the agent's FUSE files, and no FUSE mount.
fn assert_no_devices_left(dir: &Path) {
    let loops = ok(
        run(
            "losetup",
            &["--list", "--noheadings", "--output", "BACK-FILE"],
        ),
        "losetup",
    );
    let state = dir.join("agent-state").display().to_string();
    assert!(!loops.contains(&state), "loop devices left: {loops}");
    let mounts = std::fs::read_to_string("/proc/self/mountinfo").unwrap();
    assert!(!mounts.contains(&state), "mounts left under {state}");
}

/// A source agent exporting an ext4 image made from [`source_tree`], and a destination
/// agent with the CSI plugin and an export `dst` to hydrate into.
struct Hydrating {
    dir: tempfile::TempDir,
    files: BTreeMap<String, String>,
    src_img: PathBuf,
    dst_img: PathBuf,
    src: Agent,
    dst: Agent,
    /// The destination agent's fd store, if it has one (dropped after the agents).
    fd_store: Option<FdStore>,
}

const VOLUME: u64 = 256 * MIB;

impl Hydrating {
    /// The source: an ext4 volume made from [`source_tree`].
    fn new() -> Hydrating {
        Hydrating::with_source(false, |dir, src_img| {
            let tree = dir.join("tree");
            let files = source_tree(&tree);
            let size = format!("{}M", VOLUME / MIB);
            let (tree, img) = (tree.to_str().unwrap(), src_img.to_str().unwrap());
            let made = run("mkfs.ext4", &["-q", "-F", "-d", tree, img, &size]);
            ok(made, "mkfs.ext4 -d");
            files
        })
    }

    /// The source image made by `make` (given the test directory and the image's path),
    /// which returns the files it holds.
    /// With `fd_store`, the destination agent keeps its devices' connections in one.
    fn with_source(
        fd_store: bool,
        make: impl FnOnce(&Path, &Path) -> BTreeMap<String, String>,
    ) -> Hydrating {
        let dir = tempfile::tempdir().unwrap();
        let (a, b) = (dir.path().join("a"), dir.path().join("b"));
        std::fs::create_dir_all(&a).unwrap();
        std::fs::create_dir_all(&b).unwrap();
        let src_img = a.join("src.img");
        let files = make(dir.path(), &src_img);
        let dst_img = b.join("dst.img");
        let src = Agent::start(&a, &[("src", &src_img, true)], None);
        let socket = dir.path().join("fd-store/store.sock");
        let store = fd_store.then(|| FdStore::start(&socket));
        let settings = match fd_store {
            true => format!("fd_store = \"{}\"", socket.display()),
            false => String::new(),
        };
        let dst = plugin_agent(&b, "node-b", &[("dst", &dst_img, false)], &settings);
        Hydrating {
            dir,
            files,
            src_img,
            dst_img,
            src,
            dst,
            fd_store: store,
        }
    }

    /// A source of `seed`'s data everywhere, so every region is fetched (none is a hole).
    fn data_everywhere(fd_store: bool, seed: u64) -> Hydrating {
        Hydrating::with_source(fd_store, |_, img| {
            common::make_image(img, VOLUME, seed, &[(0, VOLUME)]);
            BTreeMap::new()
        })
    }

    /// The fill started at 1 MiB/s and the volume staged and published as a pod's block
    /// device, its first MiB read (fetched on demand) and checked against the source.
    fn block_device_in_use<'a>(&self, bin: &'a Path) -> Kubelet<'a> {
        self.start(Some("1M"));
        let kubelet = self.kubelet(
            bin,
            serde_json::json!({"block": {}, "accessMode": {"mode": "SINGLE_NODE_WRITER"}}),
        );
        kubelet.stage_and_publish();
        assert_reads_source(&kubelet.target, &self.src_img, 0, "the first MiB");
        kubelet
    }

    fn control(&self) -> String {
        common::agent::control(&self.dst)
    }

    /// Starts the fill; slow with a `bwlimit`, so the volume is still arriving while used.
    fn start(&self, bwlimit: Option<&str>) {
        let (from, control) = (self.src.url("src"), self.control());
        let mut args = vec!["start", "dst", "--from", &from, "--agent", &control];
        args.extend(bwlimit.iter().flat_map(|b| ["--bwlimit", b]));
        hydrate(&args);
    }

    fn progress(&self) -> serde_json::Value {
        let out = hydrate(&["status", "dst", "--json", "--agent", &self.control()]);
        serde_json::from_str(&out).unwrap()
    }

    /// Lets the fill run at full speed and waits for it.
    fn finish(&self) {
        hydrate(&["cancel", "dst", "--agent", &self.control()]);
        self.start(None);
        hydrate(&["wait", "dst", "--agent", &self.control()]);
    }

    fn kubelet<'a>(&self, bin: &'a Path, capability: serde_json::Value) -> Kubelet<'a> {
        // The kubelet's directories of the pod, on the destination's node.
        let b = self.dir.path().join("b");
        Kubelet {
            bin,
            socket: b.join("csi.sock"),
            volume: "dst".into(),
            staging: b.join("kubelet/staging/dst"),
            target: b.join("kubelet/pods/pod-1/volumes/dst"),
            capability,
        }
    }
}

#[test]
fn a_filesystem_volume_still_hydrating_mounts_at_once_and_reads_the_source() {
    let Some(bin) = tools() else { return };
    let h = Hydrating::new();
    let started = Instant::now();
    // 2 MiB/s: the 256 MiB volume would take two minutes to arrive by itself.
    h.start(Some("2M"));
    let kubelet = h.kubelet(
        &bin,
        serde_json::json!({
            "mount": {"fsType": "ext4"},
            "accessMode": {"mode": "SINGLE_NODE_WRITER"},
        }),
    );
    kubelet.stage_and_publish();
    let mounted = started.elapsed();
    let seen = hashes_under(&kubelet.target, h.files.keys().cloned());
    let read = started.elapsed();
    let p = h.progress();
    eprintln!(
        "hydrating 256 MiB ext4 volume: mounted {:.0} ms after the start, every file read \
         {:.0} ms after; {}/{} regions local then",
        mounted.as_secs_f64() * 1e3,
        read.as_secs_f64() * 1e3,
        p["present"],
        p["regions"]
    );
    assert_eq!(
        seen, h.files,
        "a file read through the hydrating volume differs"
    );
    // The pod's reads came before their regions: they fetched them (and the kernel's
    // read-ahead the regions after).
    assert!(
        p["foreground_fetches"].as_u64() > Some(0),
        "no read of the pod's waited for its region: {p}"
    );
    // The pod writes; the write is durable on the volume once fsync'd.
    let written = kubelet.target.join("written-by-the-pod");
    std::fs::write(&written, b"hello from the pod\n").unwrap();
    std::fs::File::open(&written).unwrap().sync_all().unwrap();
    let (unpublished, unstaged) = kubelet.unpublish_and_unstage();
    ok(unpublished, "NodeUnpublishVolume");
    ok(unstaged, "NodeUnstageVolume");
    assert!(
        !kubelet.target.exists(),
        "the pod's path is left after NodeUnpublishVolume"
    );
    h.finish();
    let fsck = run("e2fsck", &["-fn", h.dst_img.to_str().unwrap()]);
    ok(fsck, "e2fsck -fn of the hydrated volume");
    let cat = run(
        "debugfs",
        &["-R", "cat /written-by-the-pod", h.dst_img.to_str().unwrap()],
    );
    assert_eq!(ok(cat, "debugfs cat"), "hello from the pod\n");
    // The pod started again once the fill is complete: its device is a loop device
    // straight over the local image (no FUSE, no agent in the I/O path).
    kubelet.stage_and_publish();
    let direct = run("losetup", &["-j", h.dst_img.to_str().unwrap()]);
    assert!(
        ok(direct, "losetup -j").contains("/dev/loop"),
        "the complete volume is not attached straight to its image"
    );
    let seen = hashes_under(&kubelet.target, h.files.keys().cloned());
    assert_eq!(
        seen, h.files,
        "a file read through the complete volume differs"
    );
    // An agent started again has no record of that loop device; NodeUnstage finds it by
    // the volume's file.
    let mut h = h;
    h.dst.kill_and_restart();
    let (unpublished, unstaged) = kubelet.unpublish_and_unstage();
    ok(unpublished, "NodeUnpublishVolume");
    ok(unstaged, "NodeUnstageVolume");
    let left = run("losetup", &["-j", h.dst_img.to_str().unwrap()]);
    assert_eq!(ok(left, "losetup -j"), "", "the direct loop device is left");
    drop(kubelet);
    let b = h.dir.path().join("b");
    drop(h);
    assert_no_devices_left(&b);
}

#[test]
fn a_block_volume_whose_agent_is_killed_mid_fill_gives_errors_then_the_source_bytes() {
    let Some(bin) = tools() else { return };
    let mut h = Hydrating::new();
    h.start(Some("2M"));
    let kubelet = h.kubelet(
        &bin,
        serde_json::json!({
            "block": {},
            "accessMode": {"mode": "SINGLE_NODE_WRITER"},
        }),
    );
    kubelet.stage_and_publish();
    // The pod's device: its first bytes are the source's (fetched on demand).
    assert_reads_source(&kubelet.target, &h.src_img, 0, "the first MiB");
    h.dst.child.kill().unwrap();
    h.dst.child.wait().unwrap();
    // With its agent gone the device answers errors, never bytes it does not have.
    let late = direct_read(&kubelet.target, 200 * MIB);
    assert!(
        !late.status.success(),
        "a read past what had arrived succeeded with the agent dead"
    );
    // Started again, the agent clears the dead device; the kubelet's retry of the pod
    // unpublishes, unstages and publishes it again, and the fill resumes.
    h.dst.kill_and_restart();
    let (unpublished, unstaged) = kubelet.unpublish_and_unstage();
    ok(unpublished, "NodeUnpublishVolume after the restart");
    ok(unstaged, "NodeUnstageVolume after the restart");
    kubelet.stage_and_publish();
    assert_eq!(
        blake3_of(&kubelet.target, VOLUME),
        blake3_of(&h.src_img, VOLUME),
        "the device's bytes differ from the source's"
    );
}

#[test]
fn a_block_volume_whose_agent_is_killed_mid_io_only_pauses_with_an_fd_store() {
    let Some(bin) = tools() else { return };
    let mut h = Hydrating::data_everywhere(true, 58);
    let kubelet = h.block_device_in_use(&bin);
    let device = kubelet.target.clone();
    // A read the agent has taken from the kernel but cannot answer yet: the region has
    // not arrived and the source is stopped, so it waits inside the agent for its fetch.
    let source = h.src.child.id();
    signal(source, rustix::process::Signal::STOP);
    let held = spawn_read(&device, 150 * MIB);
    std::thread::sleep(std::time::Duration::from_secs(1));
    assert!(
        !held.is_finished(),
        "a read of a region still to come did not wait for it"
    );
    h.dst.child.kill().unwrap();
    h.dst.child.wait().unwrap();
    // With no agent, the pod's reads and writes wait; none fails.
    let written: Vec<u8> = (0..MIB).map(|i| (i * 7 % 251) as u8).collect();
    let (d, data) = (device.clone(), written.clone());
    let writer = std::thread::spawn(move || direct_write(&d, 100 * MIB, &data));
    let reader = spawn_read(&device, 200 * MIB);
    std::thread::sleep(std::time::Duration::from_secs(2));
    let waiting = [
        (held.is_finished(), "the held read"),
        (reader.is_finished(), "a read"),
        (writer.is_finished(), "a write"),
    ];
    for (finished, what) in waiting {
        assert!(!finished, "{what} ended while no agent served the device");
    }
    // The agent started again takes the connection back from the fd store, has the
    // kernel send again the read its predecessor never answered, and serves on.
    signal(source, rustix::process::Signal::CONT);
    let restarted = Instant::now();
    h.dst.kill_and_restart();
    for (io, offset) in [(held, 150 * MIB), (reader, 200 * MIB)] {
        let read = io.join().unwrap();
        assert!(
            read.status.success(),
            "a read at {} MiB failed across the agent's restart: {}",
            offset / MIB,
            String::from_utf8_lossy(&read.stderr)
        );
        assert_eq!(
            read.stdout,
            read_at(&h.src_img, offset, MIB),
            "the read at {} MiB differs from the source",
            offset / MIB
        );
    }
    writer
        .join()
        .expect("the pod's write failed across the agent's restart");
    eprintln!(
        "the pod's I/O resumed {:.0} ms after the agent was started again",
        restarted.elapsed().as_secs_f64() * 1e3
    );
    assert_reads_source(&device, &h.src_img, 0, "the first MiB, after the restart");
    // The store killed and started again (its pod replaced) holds nothing; the agent
    // gives it the device's connection again, so its next kill is still only a pause.
    let store = h.fd_store.as_mut().unwrap();
    let puts = store.kept("dst");
    store.kill_and_restart();
    let given_back = Instant::now();
    while h.fd_store.as_ref().unwrap().kept("dst") == puts {
        assert!(
            given_back.elapsed().as_secs() < 60,
            "the agent did not give the restarted store its device's connection"
        );
        std::thread::sleep(std::time::Duration::from_millis(100));
    }
    h.dst.child.kill().unwrap();
    h.dst.child.wait().unwrap();
    let reader = spawn_read(&device, 220 * MIB);
    std::thread::sleep(std::time::Duration::from_secs(1));
    assert!(
        !reader.is_finished(),
        "a read ended while no agent served the device"
    );
    h.dst.kill_and_restart();
    let read = reader.join().unwrap();
    assert!(
        read.status.success(),
        "a read failed across the agent's restart after the store's: {}",
        String::from_utf8_lossy(&read.stderr)
    );
    assert_eq!(read.stdout, read_at(&h.src_img, 220 * MIB, MIB));
    // Once the fill completes, the device and the image are the source with the pod's
    // write: nothing was lost or fetched over it.
    h.finish();
    let expected = h.dir.path().join("expected.img");
    std::fs::copy(&h.src_img, &expected).unwrap();
    write_at(&expected, 100 * MIB, &written);
    let want = blake3_of(&expected, VOLUME);
    assert_eq!(blake3_of(&device, VOLUME), want, "the device differs");
    let (unpublished, unstaged) = kubelet.unpublish_and_unstage();
    ok(unpublished, "NodeUnpublishVolume after the restart");
    ok(unstaged, "NodeUnstageVolume after the restart");
    assert_eq!(blake3_of(&h.dst_img, VOLUME), want, "the image differs");
    drop(kubelet);
    let b = h.dir.path().join("b");
    drop(h);
    assert_no_devices_left(&b);
}

/// Sends `signal` to process `pid`.
fn signal(pid: u32, signal: rustix::process::Signal) {
    let pid = rustix::process::Pid::from_raw(pid as i32).expect("a pid");
    rustix::process::kill_process(pid, signal).unwrap();
}

/// [`direct_read`] on a thread of its own.
fn spawn_read(device: &Path, offset: u64) -> std::thread::JoinHandle<Output> {
    let device = device.to_path_buf();
    std::thread::spawn(move || direct_read(&device, offset))
}

fn write_at(path: &Path, offset: u64, data: &[u8]) {
    use std::os::unix::fs::FileExt;
    let file = std::fs::OpenOptions::new().write(true).open(path).unwrap();
    file.write_all_at(data, offset).unwrap();
}

#[test]
fn a_block_volume_keeps_what_arrived_across_a_cancelled_fill_and_fetches_again_after() {
    let Some(bin) = tools() else { return };
    let h = Hydrating::data_everywhere(false, 57);
    let kubelet = h.block_device_in_use(&bin);
    hydrate(&["cancel", "dst", "--agent", &h.control()]);
    let cancelled = h.progress();
    assert_eq!(cancelled["phase"], "Cancelled", "{cancelled}");
    // What arrived stays the pod's: read again past every cache, and written over.
    assert_reads_source(
        &kubelet.target,
        &h.src_img,
        0,
        "a region that had arrived, after the cancel",
    );
    let pod_bytes = vec![0x5a_u8; MIB as usize];
    direct_write(&kubelet.target, 0, &pod_bytes);
    // A region that has not arrived is an error while cancelled, never zeros.
    let missing = direct_read(&kubelet.target, 200 * MIB);
    assert!(
        !missing.status.success(),
        "a region that had not arrived read while the fill was cancelled"
    );
    let refused = h.progress()["foreground_failures"].as_u64().unwrap();
    assert!(
        refused > cancelled["foreground_failures"].as_u64().unwrap(),
        "the refused read is not counted: {}",
        h.progress()
    );
    // Started again, the fill resumes from the bitmap and the same device fetches what
    // it lacks; the pod's write made while cancelled is not fetched over.
    h.start(None);
    assert_reads_source(
        &kubelet.target,
        &h.src_img,
        200 * MIB,
        "a missing region, once the fill resumed",
    );
    hydrate(&["wait", "dst", "--agent", &h.control()]);
    let mut want = std::fs::read(&h.src_img).unwrap();
    want[..MIB as usize].copy_from_slice(&pod_bytes);
    assert_eq!(
        blake3_of(&kubelet.target, VOLUME),
        blake3::hash(&want).to_hex().to_string(),
        "the device is not the source plus the pod's write"
    );
    assert_eq!(
        blake3_of(&h.dst_img, VOLUME),
        blake3::hash(&want).to_hex().to_string(),
        "the local image is not the source plus the pod's write"
    );
    let (unpublished, unstaged) = kubelet.unpublish_and_unstage();
    ok(unpublished, "NodeUnpublishVolume");
    ok(unstaged, "NodeUnstageVolume");
}

/// The kernel holds a pod's writes in its cache of the device's FUSE file, and they reach
/// the agent's image at the pod's fsync: whole pages, and a 512-byte sector of a page
/// not arrived yet (the kernel first reads that page through the agent, which fetches
/// it). The fill then brings the rest of those regions around them.
#[test]
fn a_pods_writes_reach_the_image_at_its_fsync_and_the_fill_goes_around_them() {
    let Some(bin) = tools() else { return };
    let h = Hydrating::data_everywhere(false, 63);
    // The fill runs at 1 MiB/s from the start: these regions have not arrived.
    let kubelet = h.block_device_in_use(&bin);
    let whole = vec![0xa5_u8; MIB as usize];
    let (whole_at, sector_at) = (180 * MIB, 220 * MIB + 4096 + 512);
    direct_write(&kubelet.target, whole_at, &whole);
    // One 512-byte sector, flushed.
    dd_write(&kubelet.target, sector_at, &[0x3c; 512], 512, true);
    assert!(
        read_at(&h.dst_img, whole_at, MIB) == whole,
        "a pod's fsynced 1 MiB write is not in the agent's image"
    );
    let page = 220 * MIB + 4096;
    let mut want = read_at(&h.src_img, page, 4096);
    want[512..1024].fill(0x3c);
    assert!(
        read_at(&h.dst_img, page, 4096) == want,
        "the fsynced sector's page in the agent's image is not the source's bytes around the pod's"
    );
    h.finish();
    let mut want = std::fs::read(&h.src_img).unwrap();
    want[whole_at as usize..(whole_at + MIB) as usize].copy_from_slice(&whole);
    want[sector_at as usize..sector_at as usize + 512].fill(0x3c);
    let want = blake3::hash(&want).to_hex().to_string();
    assert_eq!(
        blake3_of(&h.dst_img, VOLUME),
        want,
        "the filled image is not the source plus the pod's writes"
    );
    assert_eq!(
        blake3_of(&kubelet.target, VOLUME),
        want,
        "the device is not the source plus the pod's writes"
    );
    let (unpublished, unstaged) = kubelet.unpublish_and_unstage();
    ok(unpublished, "NodeUnpublishVolume");
    ok(unstaged, "NodeUnstageVolume");
}

/// Without an fd store an agent's death ends its devices' connections: what a pod wrote
/// and the kernel still held dies with it, and the pod's next fsync says so with an
/// error. It never succeeds over bytes the image lacks.
#[test]
fn a_pods_unflushed_writes_lost_with_its_agent_fail_its_next_fsync() {
    let Some(bin) = tools() else { return };
    let mut h = Hydrating::data_everywhere(false, 64);
    let kubelet = h.block_device_in_use(&bin);
    let data = vec![0x77_u8; MIB as usize];
    let at = 100 * MIB;
    // Past the device's own cache, into the kernel's cache of the FUSE file: written
    // back there after 30 s (dirty_expire_centisecs) unless flushed.
    dd_write(&kubelet.target, at, &data, MIB, false);
    h.dst.child.kill().unwrap();
    h.dst.child.wait().unwrap();
    let synced = run("sync", &[kubelet.target.to_str().unwrap()]);
    let kept = read_at(&h.dst_img, at, MIB) == data;
    eprintln!(
        "after the agent's death: fsync {}, the write {} in the image",
        if synced.status.success() {
            "succeeded"
        } else {
            "failed"
        },
        if kept { "is" } else { "is not" }
    );
    assert!(
        !synced.status.success() || kept,
        "the pod's fsync succeeded though its write never reached the agent's image"
    );
    h.dst.kill_and_restart();
    let (unpublished, unstaged) = kubelet.unpublish_and_unstage();
    ok(unpublished, "NodeUnpublishVolume after the restart");
    ok(unstaged, "NodeUnstageVolume after the restart");
}

/// A volume a hydration made (`--create`, as the populator makes each populated PVC's)
/// is deleted with its fill, image and export, but never while it is staged, and an
/// export the agent did not make that way is never deleted.
#[test]
fn a_volume_a_hydration_made_is_deleted_whole_and_only_once_unstaged() {
    let Some(bin) = tools() else { return };
    let h = Hydrating::data_everywhere(false, 61);
    let (from, control) = (h.src.url("src"), h.control());
    let delete = |export: &str| common::agent::hydrate(&["delete", export, "--agent", &control]);
    let state = h.dir.path().join("b/agent-state");
    let image = state.join("volumes/pvc-1.img");
    hydrate(&[
        "start",
        "pvc-1",
        "--create",
        "--from",
        &from,
        "--agent",
        &control,
        "--bwlimit",
        "1M",
    ]);
    assert_eq!(
        std::fs::metadata(&image).unwrap().len(),
        VOLUME,
        "the image made"
    );
    let mut kubelet = h.kubelet(
        &bin,
        serde_json::json!({"block": {}, "accessMode": {"mode": "SINGLE_NODE_WRITER"}}),
    );
    kubelet.volume = "pvc-1".into();
    kubelet.staging = h.dir.path().join("b/kubelet/staging/pvc-1");
    kubelet.stage_and_publish();
    assert_reads_source(&kubelet.target, &h.src_img, 0, "the first MiB");

    // Staged: refused, and nothing of it is touched.
    let refused = delete("pvc-1");
    let said = String::from_utf8_lossy(&refused.stderr);
    assert!(
        !refused.status.success() && said.contains("staged on this node"),
        "a staged volume's deletion: {refused:?}"
    );
    assert!(image.exists(), "the image of a staged volume was removed");
    assert_reads_source(&kubelet.target, &h.src_img, 100 * MIB, "after the refusal");

    let (unpublished, unstaged) = kubelet.unpublish_and_unstage();
    ok(unpublished, "NodeUnpublishVolume");
    ok(unstaged, "NodeUnstageVolume");
    let deleted = hydrate(&["delete", "pvc-1", "--agent", &control]);
    assert_eq!(deleted.trim(), "deleted pvc-1: its image, fill and export");
    assert!(!image.exists(), "the image is still there");
    for kept in ["hydrate/pvc-1.json", "hydrate/pvc-1.bitmap"] {
        assert!(!state.join(kept).exists(), "{kept} is still there");
    }
    let exports = std::fs::read_to_string(state.join("exports.json")).unwrap();
    assert!(!exports.contains("pvc-1"), "still registered: {exports}");
    let status = common::agent::hydrate(&["status", "pvc-1", "--agent", &control]);
    assert!(!status.status.success(), "its hydration is still known");
    // Deleting it again is fine, and says there was nothing.
    let again = hydrate(&["delete", "pvc-1", "--agent", &control]);
    assert_eq!(again.trim(), "nothing of pvc-1 was left on the agent");

    // An export of agent.toml is the administrator's: never deleted.
    std::fs::write(&h.dst_img, [7u8; 4096]).unwrap();
    let theirs = delete("dst");
    let said = String::from_utf8_lossy(&theirs.stderr);
    assert!(
        !theirs.status.success() && said.contains("was not made by a hydration"),
        "the deletion of an agent.toml export: {theirs:?}"
    );
    assert_eq!(std::fs::read(&h.dst_img).unwrap(), [7u8; 4096]);
}

#[test]
fn a_sparse_terabyte_volume_is_a_readable_device_at_once() {
    let Some(bin) = tools() else { return };
    const TIB: u64 = 1 << 40;
    let h = Hydrating::with_source(false, |_, img| {
        // 1 TiB, of which the first and the last MiB hold data.
        common::make_image(img, TIB, 41, &[(0, MIB), (TIB - MIB, MIB)]);
        BTreeMap::new()
    });
    let started = Instant::now();
    h.start(None);
    let kubelet = h.kubelet(
        &bin,
        serde_json::json!({"block": {}, "accessMode": {"mode": "SINGLE_NODE_WRITER"}}),
    );
    kubelet.stage_and_publish();
    let published = started.elapsed();
    let last = direct_read(&kubelet.target, TIB - MIB);
    let first_byte = started.elapsed();
    assert!(
        last.status.success(),
        "{}",
        String::from_utf8_lossy(&last.stderr)
    );
    assert_eq!(last.stdout, read_at(&h.src_img, TIB - MIB, MIB));
    let middle = direct_read(&kubelet.target, TIB / 2);
    assert!(middle.stdout.len() == MIB as usize && middle.stdout.iter().all(|&b| b == 0));
    eprintln!(
        "1 TiB sparse volume: published {:.0} ms after `hydrate start`, its last MiB read \
         {:.0} ms after",
        published.as_secs_f64() * 1e3,
        first_byte.as_secs_f64() * 1e3
    );
}

/// 1 MiB of `device` at `offset`, read past the page cache (dd iflag=direct).
fn direct_read(device: &Path, offset: u64) -> Output {
    run(
        "dd",
        &[
            &format!("if={}", device.display()),
            "iflag=direct",
            "bs=1M",
            "count=1",
            &format!("skip={}", offset / MIB),
            "status=none",
        ],
    )
}

/// Reads 1 MiB of `device` at `offset` past the page cache: it must succeed and be
/// `source`'s bytes there (`what` names the read in a failure).
fn assert_reads_source(device: &Path, source: &Path, offset: u64, what: &str) {
    let read = direct_read(device, offset);
    assert!(
        read.status.success(),
        "{what} failed: {}",
        String::from_utf8_lossy(&read.stderr)
    );
    assert_eq!(
        read.stdout,
        read_at(source, offset, MIB),
        "{what} differs from the source"
    );
}

/// Writes `data` to `device` at `offset`, past the page cache (dd oflag=direct), and
/// flushes it.
fn direct_write(device: &Path, offset: u64, data: &[u8]) {
    dd_write(device, offset, data, MIB, true)
}

/// Writes `data` to `device` at `offset` (a multiple of `block`) in `block`-byte writes
/// past the device's page cache, and flushes it if `flush`.
fn dd_write(device: &Path, offset: u64, data: &[u8], block: u64, flush: bool) {
    use std::io::Write;
    let mut dd = Command::new("dd")
        .args([
            format!("of={}", device.display()).as_str(),
            "oflag=direct",
            "iflag=fullblock",
            if flush {
                "conv=fsync,notrunc"
            } else {
                "conv=notrunc"
            },
            &format!("bs={block}"),
            &format!("seek={}", offset / block),
            "status=none",
        ])
        .stdin(std::process::Stdio::piped())
        .spawn()
        .expect("dd is needed by this test");
    dd.stdin.take().unwrap().write_all(data).unwrap();
    assert!(dd.wait().unwrap().success(), "dd of={}", device.display());
}

fn read_at(path: &Path, offset: u64, len: u64) -> Vec<u8> {
    use std::os::unix::fs::FileExt;
    let mut buf = vec![0u8; len as usize];
    std::fs::File::open(path)
        .unwrap()
        .read_exact_at(&mut buf, offset)
        .unwrap();
    buf
}
