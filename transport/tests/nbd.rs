//! The NBD server against real clients (libnbd's nbdinfo and nbdcopy, qemu-img, qemu-io)
//! over a Unix socket, serving plain files through a test-only [`NbdVolume`]; and against
//! a hand-written client for what the tools will not do (bad requests, read-only writes,
//! pipelining, odd options).

use std::{
    collections::HashMap,
    fs::File,
    io,
    os::unix::fs::FileExt,
    path::{Path, PathBuf},
    process::Output,
    sync::Arc,
    time::Duration,
};

use rand::{RngCore, SeedableRng, rngs::StdRng};
use rustix::fs::{FallocateFlags, SeekFrom};
use tempfile::TempDir;
use tokio::{
    io::{AsyncReadExt, AsyncWriteExt},
    net::UnixStream,
    sync::oneshot,
    task::JoinHandle,
};
use transport::nbd::{NbdExports, NbdVolume, STATE_HOLE, STATE_ZERO, serve_unix};

// ---------------------------------------------------------------------------------------
// A file-backed volume and a server on a Unix socket.

/// A plain file: pread/pwrite, fsync, punched holes, SEEK_DATA/SEEK_HOLE.
struct FileVolume {
    file: Arc<File>,
    size: u64,
    read_only: bool,
    preferred: u32,
}

impl FileVolume {
    async fn blocking<T: Send + 'static>(
        &self,
        f: impl FnOnce(&File) -> io::Result<T> + Send + 'static,
    ) -> io::Result<T> {
        let file = self.file.clone();
        tokio::task::spawn_blocking(move || f(&file))
            .await
            .map_err(io::Error::other)?
    }
}

#[tonic::async_trait]
impl NbdVolume for FileVolume {
    fn size(&self) -> u64 {
        self.size
    }

    fn read_only(&self) -> bool {
        self.read_only
    }

    fn preferred_block(&self) -> u32 {
        self.preferred
    }

    async fn read(&self, offset: u64, len: u32) -> io::Result<Vec<u8>> {
        self.blocking(move |f| {
            let mut buf = vec![0u8; len as usize];
            f.read_exact_at(&mut buf, offset)?;
            Ok(buf)
        })
        .await
    }

    async fn write(&self, offset: u64, data: &[u8], fua: bool) -> io::Result<()> {
        let data = data.to_vec();
        self.blocking(move |f| {
            f.write_all_at(&data, offset)?;
            if fua { f.sync_data() } else { Ok(()) }
        })
        .await
    }

    async fn flush(&self) -> io::Result<()> {
        self.blocking(|f| f.sync_data()).await
    }

    async fn trim(&self, offset: u64, len: u64, _fua: bool) -> io::Result<()> {
        self.blocking(move |f| {
            let mode = FallocateFlags::PUNCH_HOLE | FallocateFlags::KEEP_SIZE;
            Ok(rustix::fs::fallocate(f, mode, offset, len)?)
        })
        .await
    }

    async fn write_zeroes(
        &self,
        offset: u64,
        len: u64,
        may_trim: bool,
        _fua: bool,
    ) -> io::Result<()> {
        self.blocking(move |f| {
            let mode = if may_trim {
                FallocateFlags::PUNCH_HOLE | FallocateFlags::KEEP_SIZE
            } else {
                FallocateFlags::ZERO_RANGE | FallocateFlags::KEEP_SIZE
            };
            Ok(rustix::fs::fallocate(f, mode, offset, len)?)
        })
        .await
    }

    async fn block_status(&self, offset: u64, len: u64) -> io::Result<Vec<(u64, u32)>> {
        let end = offset + len;
        self.blocking(move |f| {
            let mut extents = Vec::new();
            let mut at = offset;
            while at < end {
                let data = match rustix::fs::seek(f, SeekFrom::Data(at)) {
                    Ok(d) => d,
                    Err(rustix::io::Errno::NXIO) => end, // a hole to the end of the file
                    Err(e) => return Err(e.into()),
                };
                if data > at {
                    let hole_end = data.min(end);
                    extents.push((hole_end - at, STATE_HOLE | STATE_ZERO));
                    at = hole_end;
                    continue;
                }
                let hole = rustix::fs::seek(f, SeekFrom::Hole(at))?.min(end);
                extents.push((hole - at, 0));
                at = hole;
            }
            Ok(extents)
        })
        .await
    }

    async fn cache(&self, _offset: u64, _len: u64) -> io::Result<()> {
        Ok(())
    }
}

/// One export of the test server.
struct Export {
    name: &'static str,
    path: PathBuf,
    read_only: bool,
    description: &'static str,
    preferred: u32,
}

impl Export {
    fn new(name: &'static str, path: &Path) -> Export {
        Export {
            name,
            path: path.to_owned(),
            read_only: false,
            description: "",
            preferred: 4096,
        }
    }
}

struct Exports(Vec<Export>);

impl NbdExports for Exports {
    fn list(&self) -> Vec<(String, String)> {
        self.0
            .iter()
            .map(|e| (e.name.to_owned(), e.description.to_owned()))
            .collect()
    }

    fn open(&self, name: &str) -> Result<Arc<dyn NbdVolume>, String> {
        let e = self
            .0
            .iter()
            .find(|e| e.name == name)
            .ok_or_else(|| format!("no export named {name:?} here"))?;
        let file = File::options()
            .read(true)
            .write(!e.read_only)
            .open(&e.path)
            .map_err(|err| format!("{}: {err}", e.path.display()))?;
        let size = file.metadata().map_err(|err| err.to_string())?.len();
        Ok(Arc::new(FileVolume {
            file: Arc::new(file),
            size,
            read_only: e.read_only,
            preferred: e.preferred,
        }))
    }
}

/// A server on `<dir>/nbd.sock`, stopped when dropped.
struct Server {
    socket: PathBuf,
    stop: Option<oneshot::Sender<()>>,
    task: Option<JoinHandle<io::Result<()>>>,
}

impl Server {
    async fn start(dir: &Path, exports: Vec<Export>) -> Server {
        let _ = tracing_subscriber::fmt()
            .with_env_filter(tracing_subscriber::EnvFilter::from_default_env())
            .with_test_writer()
            .try_init();
        let socket = dir.join("nbd.sock");
        let (stop, stopped) = oneshot::channel::<()>();
        let exports: Arc<dyn NbdExports> = Arc::new(Exports(exports));
        let path = socket.clone();
        let task = tokio::spawn(async move {
            serve_unix(&path, exports, async {
                let _ = stopped.await;
            })
            .await
        });
        for _ in 0..500 {
            if socket.exists() {
                break;
            }
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
        assert!(socket.exists(), "the server never bound {}", socket.display());
        Server {
            socket,
            stop: Some(stop),
            task: Some(task),
        }
    }

    fn uri(&self, export: &str) -> String {
        format!("nbd+unix:///{export}?socket={}", self.socket.display())
    }

    async fn connect(&self) -> UnixStream {
        UnixStream::connect(&self.socket).await.unwrap()
    }

    /// Stops accepting and checks the accept loop ended cleanly and removed the socket.
    async fn stop(mut self) {
        let _ = self.stop.take().unwrap().send(());
        self.task.take().unwrap().await.unwrap().unwrap();
        assert!(!self.socket.exists(), "the socket file outlived the server");
    }
}

impl Drop for Server {
    fn drop(&mut self) {
        if let Some(stop) = self.stop.take() {
            let _ = stop.send(());
        }
    }
}

// ---------------------------------------------------------------------------------------
// Helpers.

/// Whether every tool is on PATH; says which is missing otherwise (the test is skipped).
fn have(tools: &[&str]) -> bool {
    let path = std::env::var_os("PATH").unwrap_or_default();
    for tool in tools {
        if !std::env::split_paths(&path).any(|d| d.join(tool).is_file()) {
            eprintln!("SKIPPED: {tool} is not installed");
            return false;
        }
    }
    true
}

async fn run(program: &str, args: &[&str]) -> Output {
    let out = tokio::process::Command::new(program)
        .args(args)
        .output()
        .await
        .unwrap_or_else(|e| panic!("{program}: {e}"));
    eprintln!(
        "$ {program} {}\n-> {}\n{}{}",
        args.join(" "),
        out.status,
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    out
}

/// Runs a tool that must succeed; its stdout.
async fn ok(program: &str, args: &[&str]) -> String {
    let out = run(program, args).await;
    assert!(out.status.success(), "{program} failed: {}", stderr(&out));
    String::from_utf8(out.stdout).unwrap()
}

fn stderr(out: &Output) -> String {
    String::from_utf8_lossy(&out.stderr).into_owned()
}

fn random(seed: u64, len: usize) -> Vec<u8> {
    let mut buf = vec![0u8; len];
    StdRng::seed_from_u64(seed).fill_bytes(&mut buf);
    buf
}

/// A sparse file of `size` bytes with seeded random data at `extents` (offset, length).
fn sparse_image(path: &Path, size: u64, extents: &[(u64, usize)], seed: u64) {
    let f = File::create(path).unwrap();
    f.set_len(size).unwrap();
    for (i, &(offset, len)) in extents.iter().enumerate() {
        f.write_all_at(&random(seed + i as u64, len), offset).unwrap();
    }
}

fn hash(path: &Path) -> blake3::Hash {
    blake3::hash(&std::fs::read(path).unwrap())
}

fn json(text: &str) -> serde_json::Value {
    serde_json::from_str(text).unwrap_or_else(|e| panic!("not JSON ({e}): {text}"))
}

/// Whether `[offset, offset + len)` of the file is all hole (no data allocated).
fn is_hole(path: &Path, offset: u64, len: u64) -> bool {
    let f = File::open(path).unwrap();
    match rustix::fs::seek(&f, SeekFrom::Data(offset)) {
        Ok(data) => data >= offset + len,
        Err(rustix::io::Errno::NXIO) => true,
        Err(e) => panic!("SEEK_DATA: {e}"),
    }
}

const MIB: u64 = 1 << 20;

// ---------------------------------------------------------------------------------------
// Real clients.

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn nbdinfo_lists_the_exports_and_describes_one() {
    if !have(&["nbdinfo"]) {
        return;
    }
    let dir = TempDir::new().unwrap();
    sparse_image(&dir.path().join("disk.img"), 4 * MIB, &[(0, 4096)], 1);
    sparse_image(&dir.path().join("ro.img"), MIB, &[], 2);
    let server = Server::start(
        dir.path(),
        vec![
            Export {
                description: "the disk",
                preferred: 65536,
                ..Export::new("disk", &dir.path().join("disk.img"))
            },
            Export {
                read_only: true,
                ..Export::new("ro", &dir.path().join("ro.img"))
            },
        ],
    )
    .await;

    let list = json(&ok("nbdinfo", &["--json", "--list", &server.uri("")]).await);
    assert_eq!(list["protocol"], "newstyle-fixed");
    assert_eq!(list["structured"], true);
    let exports = list["exports"].as_array().unwrap();
    let names: Vec<_> = exports.iter().map(|e| e["export-name"].clone()).collect();
    assert_eq!(names, ["disk", "ro"]);
    assert_eq!(exports[0]["export-size"], 4 * MIB);
    assert_eq!(exports[1]["export-size"], MIB);

    let disk = json(&ok("nbdinfo", &["--json", &server.uri("disk")]).await);
    let disk = &disk["exports"][0];
    assert_eq!(disk["export-size"], 4 * MIB);
    assert_eq!(disk["description"], "the disk");
    assert_eq!(disk["is_read_only"], false);
    assert_eq!(disk["can_multi_conn"], true);
    assert_eq!(disk["can_flush"], true);
    assert_eq!(disk["can_fua"], true);
    assert_eq!(disk["can_trim"], true);
    assert_eq!(disk["can_zero"], true);
    assert_eq!(disk["can_cache"], true);
    assert_eq!(disk["can_df"], true);
    assert_eq!(disk["block_size_minimum"], 512);
    assert_eq!(disk["block_size_preferred"], 65536);
    assert_eq!(disk["block_size_maximum"], 32 * MIB);
    assert_eq!(disk["contexts"], serde_json::json!(["base:allocation"]));

    let ro = json(&ok("nbdinfo", &["--json", &server.uri("ro")]).await);
    assert_eq!(ro["exports"][0]["is_read_only"], true);
    assert_eq!(ro["exports"][0]["can_trim"], false);

    server.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn nbdinfo_maps_the_holes_of_a_sparse_image() {
    if !have(&["nbdinfo"]) {
        return;
    }
    let dir = TempDir::new().unwrap();
    let img = dir.path().join("disk.img");
    sparse_image(&img, 4 * MIB, &[(0, 65536), (MIB, 4096)], 3);
    let server = Server::start(dir.path(), vec![Export::new("disk", &img)]).await;

    let map = json(&ok("nbdinfo", &["--map", "--json", &server.uri("disk")]).await);
    let extents: Vec<(u64, u64, u64)> = map
        .as_array()
        .unwrap()
        .iter()
        .map(|e| {
            let n = |k: &str| e[k].as_u64().unwrap();
            (n("offset"), n("length"), n("type"))
        })
        .collect();
    assert_eq!(
        extents,
        [
            (0, 65536, 0),
            (65536, MIB - 65536, 3),
            (MIB, 4096, 0),
            (MIB + 4096, 3 * MIB - 4096, 3),
        ]
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn qemu_img_info_map_and_compare() {
    if !have(&["qemu-img"]) {
        return;
    }
    let dir = TempDir::new().unwrap();
    let img = dir.path().join("disk.img");
    sparse_image(&img, 8 * MIB, &[(0, 65536), (3 * MIB, 100_000)], 4);
    let server = Server::start(dir.path(), vec![Export::new("disk", &img)]).await;
    let uri = server.uri("disk");

    let info = json(&ok("qemu-img", &["info", "--output=json", &uri]).await);
    assert_eq!(info["virtual-size"], 8 * MIB);

    let map = json(&ok("qemu-img", &["map", "-f", "raw", "--output=json", &uri]).await);
    let data: Vec<(u64, u64)> = map
        .as_array()
        .unwrap()
        .iter()
        .filter(|e| e["data"] == true)
        .map(|e| (e["start"].as_u64().unwrap(), e["length"].as_u64().unwrap()))
        .collect();
    // 100,000 bytes at 3 MiB allocate whole 4 KiB file system blocks.
    assert_eq!(data, [(0, 65536), (3 * MIB, 100_000u64.next_multiple_of(4096))]);
    let zero_bytes: u64 = map
        .as_array()
        .unwrap()
        .iter()
        .filter(|e| e["zero"] == true)
        .map(|e| e["length"].as_u64().unwrap())
        .sum();
    assert_eq!(zero_bytes, 8 * MIB - 65536 - 100_000u64.next_multiple_of(4096));

    let img_s = img.to_str().unwrap();
    ok("qemu-img", &["compare", "-f", "raw", "-F", "raw", img_s, &uri]).await;

    // A file that differs in one byte: compare says so (exit 1) and where.
    let other = dir.path().join("other.img");
    std::fs::copy(&img, &other).unwrap();
    File::options()
        .write(true)
        .open(&other)
        .unwrap()
        .write_all_at(&[0x5a], 5 * MIB + 7)
        .unwrap();
    let out = run(
        "qemu-img",
        &["compare", "-f", "raw", "-F", "raw", other.to_str().unwrap(), &uri],
    )
    .await;
    assert_eq!(out.status.code(), Some(1));
    // qemu-img reports the 512-byte sector holding the first difference.
    assert!(
        String::from_utf8_lossy(&out.stdout).contains(&format!("mismatch at offset {}", 5 * MIB)),
        "compare did not find the differing byte"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn qemu_io_writes_reads_zeroes_discards_and_flushes() {
    if !have(&["qemu-io"]) {
        return;
    }
    let dir = TempDir::new().unwrap();
    let img = dir.path().join("disk.img");
    sparse_image(&img, 4 * MIB, &[(0, 4 * MIB as usize)], 5);
    let before = std::fs::read(&img).unwrap();
    let server = Server::start(dir.path(), vec![Export::new("disk", &img)]).await;

    let out = ok(
        "qemu-io",
        &[
            "-f",
            "raw",
            "-d",
            "unmap",
            "-c",
            "write -P 0xab 1000 5000",
            "-c",
            "read -P 0xab 1000 5000",
            "-c",
            "write -z 65536 65536",
            "-c",
            "read -P 0 65536 65536",
            "-c",
            "write -z -u 1048576 1048576",
            "-c",
            "discard 2097152 1048576",
            "-c",
            "write -P 0x17 3145728 65536",
            "-c",
            "write -f -P 0x18 3211264 4096",
            "-c",
            "flush",
            "-c",
            "read -P 0x17 3145728 65536",
            &server.uri("disk"),
        ],
    )
    .await;
    assert!(!out.contains("failed"), "{out}");
    assert!(!out.contains("error"), "{out}");
    assert_eq!(out.matches("wrote ").count(), 5, "{out}");
    assert_eq!(out.matches("read ").count(), 3, "{out}");
    assert_eq!(out.matches("discard ").count(), 1, "{out}");

    let after = std::fs::read(&img).unwrap();
    let mut expect = before.clone();
    expect[1000..6000].fill(0xab);
    expect[65536..131072].fill(0);
    expect[MIB as usize..2 * MIB as usize].fill(0);
    expect[2 * MIB as usize..3 * MIB as usize].fill(0); // punched: reads back as zeros
    expect[3 * MIB as usize..3 * MIB as usize + 65536].fill(0x17);
    expect[3 * MIB as usize + 65536..3 * MIB as usize + 65536 + 4096].fill(0x18);
    assert_eq!(after.len(), expect.len());
    if let Some(i) = (0..after.len()).find(|&i| after[i] != expect[i]) {
        panic!("byte {i} is {:#x}, expected {:#x}", after[i], expect[i]);
    }
    // The discard and the unmapping write-zeroes reached the file as holes.
    assert!(is_hole(&img, 2 * MIB, MIB), "discard did not punch a hole");
    assert!(is_hole(&img, MIB, MIB), "write -z -u did not punch a hole");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn nbdcopy_in_and_out_with_four_connections() {
    if !have(&["nbdcopy"]) {
        return;
    }
    let dir = TempDir::new().unwrap();
    let src = dir.path().join("src.img");
    let size = 24 * MIB;
    sparse_image(
        &src,
        size,
        &[(0, 3 << 20), (5 * MIB + 12345, 777_777), (20 * MIB, 4 << 20)],
        6,
    );
    let target = dir.path().join("target.img");
    // The target starts full of other data, so holes must really be written as zeros.
    std::fs::write(&target, random(7, size as usize)).unwrap();
    let out = dir.path().join("out.img");
    std::fs::write(&out, b"").unwrap();
    let server = Server::start(dir.path(), vec![Export::new("target", &target)]).await;
    let uri = server.uri("target");

    let four = ["--connections", "4", "--requests", "16"];
    let mut args = four.to_vec();
    args.extend([src.to_str().unwrap(), uri.as_str()]);
    ok("nbdcopy", &args).await;
    assert_eq!(hash(&target), hash(&src), "copy into the export");

    let mut args = four.to_vec();
    args.extend([uri.as_str(), out.to_str().unwrap()]);
    ok("nbdcopy", &args).await;
    assert_eq!(hash(&out), hash(&src), "copy out of the export");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_read_only_export_refuses_writes() {
    if !have(&["qemu-io"]) {
        return;
    }
    let dir = TempDir::new().unwrap();
    let img = dir.path().join("ro.img");
    sparse_image(&img, MIB, &[(0, MIB as usize)], 8);
    let before = hash(&img);
    let server = Server::start(
        dir.path(),
        vec![Export {
            read_only: true,
            ..Export::new("ro", &img)
        }],
    )
    .await;

    let out = run(
        "qemu-io",
        &["-f", "raw", "-c", "write -P 0xcd 0 4096", &server.uri("ro")],
    )
    .await;
    // qemu sees NBD_FLAG_READ_ONLY and will not even open the export read-write
    // (the server's own EPERM is checked by the raw client below).
    assert_eq!(out.status.code(), Some(1));
    assert!(stderr(&out).contains("Permission denied"), "{}", stderr(&out));
    assert!(!String::from_utf8_lossy(&out.stdout).contains("wrote "));
    assert_eq!(hash(&img), before);

    // Reading is fine.
    ok("qemu-io", &["-r", "-f", "raw", "-c", "read 0 4096", &server.uri("ro")]).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_unknown_export_is_refused_with_a_message() {
    if !have(&["nbdinfo", "qemu-img"]) {
        return;
    }
    let dir = TempDir::new().unwrap();
    let img = dir.path().join("disk.img");
    sparse_image(&img, MIB, &[], 9);
    let server = Server::start(dir.path(), vec![Export::new("disk", &img)]).await;

    // libnbd 1.14 says what the error is (NBD_REP_ERR_UNKNOWN is ENOENT to it)...
    let out = run("nbdinfo", &[&server.uri("nope")]).await;
    assert!(!out.status.success());
    assert!(
        stderr(&out).contains("No such file or directory for export: nope"),
        "{}",
        stderr(&out)
    );

    let out = run("qemu-img", &["info", &server.uri("nope")]).await;
    assert!(!out.status.success());
    // ... and qemu shows the server's message.
    assert!(
        stderr(&out).contains("server reported: no export named \"nope\" here"),
        "{}",
        stderr(&out)
    );
}
