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
    io::{AsyncRead, AsyncReadExt, AsyncWrite, AsyncWriteExt},
    net::UnixStream,
    sync::oneshot,
    task::JoinHandle,
};
use transport::nbd::{
    NbdError, NbdExports, NbdVolume, STATE_HOLE, STATE_ZERO, serve_connection, serve_unix,
    serve_with,
};

// ---------------------------------------------------------------------------------------
// A file-backed volume and a server on a Unix socket.

/// A plain file: pread/pwrite, fsync, punched holes, SEEK_DATA/SEEK_HOLE.
struct FileVolume {
    file: Arc<File>,
    size: u64,
    read_only: bool,
    preferred: u32,
    /// Reads at offset 0 panic, at 4096 fail with EOVERFLOW, at 8192 with ENOENT.
    faulty: bool,
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
        match offset {
            0 if self.faulty => panic!("a volume bug"),
            4096 if self.faulty => return Err(io::Error::from_raw_os_error(75)),
            8192 if self.faulty => return Err(io::Error::from_raw_os_error(2)),
            _ => {}
        }
        self.blocking(move |f| {
            let mut buf = vec![0u8; len as usize];
            f.read_exact_at(&mut buf, offset)?;
            Ok(buf)
        })
        .await
    }

    async fn write(&self, offset: u64, data: bytes::Bytes, fua: bool) -> io::Result<()> {
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
    faulty: bool,
}

impl Export {
    fn new(name: &'static str, path: &Path) -> Export {
        Export {
            name,
            path: path.to_owned(),
            read_only: false,
            description: "",
            preferred: 4096,
            faulty: false,
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
            faulty: e.faulty,
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
        // Listening once a connection goes through (a stale socket file may be there
        // before the server replaces it).
        for i in 0.. {
            if UnixStream::connect(&socket).await.is_ok() {
                break;
            }
            assert!(i < 500, "the server never listened on {}", socket.display());
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
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
            // Under CI=true a missing tool fails: .ci/run installs them all.
            if std::env::var("CI").is_ok_and(|v| v == "true") {
                panic!("{tool} is not installed; CI=true, so this fails rather than skip");
            }
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
        f.write_all_at(&random(seed + i as u64, len), offset)
            .unwrap();
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
    assert_eq!(
        disk["contexts"],
        serde_json::json!(["base:allocation", "mover:present"])
    );

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
    assert_eq!(
        data,
        [(0, 65536), (3 * MIB, 100_000u64.next_multiple_of(4096))]
    );
    let zero_bytes: u64 = map
        .as_array()
        .unwrap()
        .iter()
        .filter(|e| e["zero"] == true)
        .map(|e| e["length"].as_u64().unwrap())
        .sum();
    assert_eq!(
        zero_bytes,
        8 * MIB - 65536 - 100_000u64.next_multiple_of(4096)
    );

    let img_s = img.to_str().unwrap();
    ok(
        "qemu-img",
        &["compare", "-f", "raw", "-F", "raw", img_s, &uri],
    )
    .await;

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
        &[
            "compare",
            "-f",
            "raw",
            "-F",
            "raw",
            other.to_str().unwrap(),
            &uri,
        ],
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
        &[
            (0, 3 << 20),
            (5 * MIB + 12345, 777_777),
            (20 * MIB, 4 << 20),
        ],
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
    assert!(
        stderr(&out).contains("Permission denied"),
        "{}",
        stderr(&out)
    );
    assert!(!String::from_utf8_lossy(&out.stdout).contains("wrote "));
    assert_eq!(hash(&img), before);

    // Reading is fine.
    ok(
        "qemu-io",
        &["-r", "-f", "raw", "-c", "read 0 4096", &server.uri("ro")],
    )
    .await;
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

// ---------------------------------------------------------------------------------------
// A hand-written client, for what the tools will not send. Numbers from the spec.

const IHAVEOPT: u64 = 0x4948_4156_454f_5054;
const OPT_EXPORT_NAME: u32 = 1;
const OPT_ABORT: u32 = 2;
const OPT_LIST: u32 = 3;
const OPT_STARTTLS: u32 = 5;
const OPT_INFO: u32 = 6;
const OPT_GO: u32 = 7;
const OPT_STRUCTURED_REPLY: u32 = 8;
const OPT_LIST_META_CONTEXT: u32 = 9;
const OPT_SET_META_CONTEXT: u32 = 10;
const OPT_EXTENDED_HEADERS: u32 = 11;
const REP_ACK: u32 = 1;
const REP_SERVER: u32 = 2;
const REP_INFO: u32 = 3;
const REP_META_CONTEXT: u32 = 4;
const REP_ERR_UNSUP: u32 = (1 << 31) + 1;
const REP_ERR_INVALID: u32 = (1 << 31) + 3;
const REP_ERR_TLS_REQD: u32 = (1 << 31) + 5;
const REP_ERR_UNKNOWN: u32 = (1 << 31) + 6;
const REP_ERR_TOO_BIG: u32 = (1 << 31) + 9;
const FLAG_READ_ONLY: u16 = 1 << 1;
const FLAG_SEND_DF: u16 = 1 << 7;
const CMD_READ: u16 = 0;
const CMD_WRITE: u16 = 1;
const CMD_DISC: u16 = 2;
const CMD_FLUSH: u16 = 3;
const CMD_TRIM: u16 = 4;
const CMD_CACHE: u16 = 5;
const CMD_WRITE_ZEROES: u16 = 6;
const CMD_BLOCK_STATUS: u16 = 7;
const CMD_FLAG_FUA: u16 = 1;
const CMD_FLAG_NO_HOLE: u16 = 1 << 1;
const CMD_FLAG_DF: u16 = 1 << 2;
const CMD_FLAG_REQ_ONE: u16 = 1 << 3;
const REPLY_TYPE_NONE: u16 = 0;
const REPLY_TYPE_OFFSET_DATA: u16 = 1;
const REPLY_TYPE_OFFSET_HOLE: u16 = 2;
const REPLY_TYPE_BLOCK_STATUS: u16 = 5;
const REPLY_TYPE_ERROR: u16 = (1 << 15) + 1;
const EPERM: u32 = 1;
const EINVAL: u32 = 22;
const ENOSPC: u32 = 28;

/// One structured reply chunk.
#[derive(Debug)]
struct Chunk {
    flags: u16,
    kind: u16,
    cookie: u64,
    payload: Vec<u8>,
}

impl Chunk {
    /// (errno, message) of an error chunk.
    fn error(&self) -> (u32, String) {
        assert_eq!(self.kind, REPLY_TYPE_ERROR, "{self:?}");
        let errno = u32::from_be_bytes(self.payload[0..4].try_into().unwrap());
        let len = u16::from_be_bytes(self.payload[4..6].try_into().unwrap()) as usize;
        let msg = String::from_utf8(self.payload[6..6 + len].to_vec()).unwrap();
        (errno, msg)
    }
}

struct Raw<S> {
    s: S,
}

impl Raw<UnixStream> {
    async fn connect(server: &Server) -> Raw<UnixStream> {
        Raw::hello(server.connect().await, 3).await
    }
}

impl<S: AsyncRead + AsyncWrite + Unpin> Raw<S> {
    /// Reads the greeting and answers with `client_flags`.
    async fn hello(mut s: S, client_flags: u32) -> Raw<S> {
        let mut b = [0u8; 18];
        s.read_exact(&mut b).await.unwrap();
        assert_eq!(&b[0..8], b"NBDMAGIC");
        assert_eq!(&b[8..16], b"IHAVEOPT");
        assert_eq!(
            u16::from_be_bytes([b[16], b[17]]),
            3,
            "FIXED_NEWSTYLE | NO_ZEROES"
        );
        s.write_all(&client_flags.to_be_bytes()).await.unwrap();
        Raw { s }
    }

    async fn option(&mut self, option: u32, data: &[u8]) {
        let mut b = IHAVEOPT.to_be_bytes().to_vec();
        b.extend_from_slice(&option.to_be_bytes());
        b.extend_from_slice(&(data.len() as u32).to_be_bytes());
        b.extend_from_slice(data);
        self.s.write_all(&b).await.unwrap();
    }

    /// One option reply: (reply type, data), checked to answer `option`.
    async fn reply(&mut self, option: u32) -> (u32, Vec<u8>) {
        let mut h = [0u8; 20];
        self.s.read_exact(&mut h).await.unwrap();
        assert_eq!(
            u64::from_be_bytes(h[0..8].try_into().unwrap()),
            0x3e889045565a9
        );
        assert_eq!(u32::from_be_bytes(h[8..12].try_into().unwrap()), option);
        let rep = u32::from_be_bytes(h[12..16].try_into().unwrap());
        let len = u32::from_be_bytes(h[16..20].try_into().unwrap());
        let mut data = vec![0u8; len as usize];
        self.s.read_exact(&mut data).await.unwrap();
        (rep, data)
    }

    /// Replies up to and including the final one (an ACK or an error).
    async fn replies(&mut self, option: u32) -> Vec<(u32, Vec<u8>)> {
        let mut all = Vec::new();
        loop {
            let (rep, data) = self.reply(option).await;
            all.push((rep, data));
            if rep == REP_ACK || rep & (1 << 31) != 0 {
                return all;
            }
        }
    }

    /// Sends an option and returns its single reply type and message.
    async fn ask(&mut self, option: u32, data: &[u8]) -> (u32, String) {
        self.option(option, data).await;
        let (rep, data) = self.reply(option).await;
        (rep, String::from_utf8_lossy(&data).into_owned())
    }

    /// STRUCTURED_REPLY, SET_META_CONTEXT base:allocation (when `meta`), then GO:
    /// the export's (size, transmission flags).
    async fn go(&mut self, name: &str, structured: bool, meta: bool) -> (u64, u16) {
        if structured {
            assert_eq!(self.ask(OPT_STRUCTURED_REPLY, &[]).await.0, REP_ACK);
        }
        if meta {
            self.option(
                OPT_SET_META_CONTEXT,
                &meta_query(name, &["base:allocation"]),
            )
            .await;
            let r = self.replies(OPT_SET_META_CONTEXT).await;
            assert_eq!(r.len(), 2, "{r:?}");
            assert_eq!(r[0].0, REP_META_CONTEXT);
        }
        self.option(OPT_GO, &info_query(name, &[])).await;
        let replies = self.replies(OPT_GO).await;
        assert_eq!(replies.last().unwrap().0, REP_ACK, "{replies:?}");
        let export = replies
            .iter()
            .find(|(rep, d)| *rep == REP_INFO && d[0..2] == [0, 0])
            .expect("NBD_INFO_EXPORT");
        let d = &export.1;
        (
            u64::from_be_bytes(d[2..10].try_into().unwrap()),
            u16::from_be_bytes(d[10..12].try_into().unwrap()),
        )
    }

    async fn request(&mut self, flags: u16, kind: u16, cookie: u64, offset: u64, len: u32) {
        self.s
            .write_all(&request(flags, kind, cookie, offset, len))
            .await
            .unwrap();
    }

    async fn write(&mut self, cookie: u64, offset: u64, data: &[u8]) {
        let mut b = request(0, CMD_WRITE, cookie, offset, data.len() as u32).to_vec();
        b.extend_from_slice(data);
        self.s.write_all(&b).await.unwrap();
    }

    /// A simple reply: (error, cookie), then `data_len` bytes of data when no error.
    async fn simple(&mut self, data_len: usize) -> (u32, u64, Vec<u8>) {
        let mut h = [0u8; 16];
        self.s.read_exact(&mut h).await.unwrap();
        assert_eq!(u32::from_be_bytes(h[0..4].try_into().unwrap()), 0x67446698);
        let error = u32::from_be_bytes(h[4..8].try_into().unwrap());
        let cookie = u64::from_be_bytes(h[8..16].try_into().unwrap());
        let mut data = vec![0u8; if error == 0 { data_len } else { 0 }];
        self.s.read_exact(&mut data).await.unwrap();
        (error, cookie, data)
    }

    async fn chunk(&mut self) -> Chunk {
        let mut h = [0u8; 20];
        self.s.read_exact(&mut h).await.unwrap();
        assert_eq!(u32::from_be_bytes(h[0..4].try_into().unwrap()), 0x668e33ef);
        let len = u32::from_be_bytes(h[16..20].try_into().unwrap());
        let mut payload = vec![0u8; len as usize];
        self.s.read_exact(&mut payload).await.unwrap();
        Chunk {
            flags: u16::from_be_bytes([h[4], h[5]]),
            kind: u16::from_be_bytes([h[6], h[7]]),
            cookie: u64::from_be_bytes(h[8..16].try_into().unwrap()),
            payload,
        }
    }

    /// A final chunk for `cookie`.
    async fn done(&mut self, cookie: u64) -> Chunk {
        let c = self.chunk().await;
        assert_eq!(c.cookie, cookie, "{c:?}");
        assert_eq!(c.flags & 1, 1, "not the final chunk: {c:?}");
        c
    }

    /// The data of a successful structured read of `len` bytes at `offset`.
    async fn read_data(&mut self, cookie: u64, offset: u64, len: u32) -> Vec<u8> {
        self.request(0, CMD_READ, cookie, offset, len).await;
        let c = self.done(cookie).await;
        assert_eq!(
            u64::from_be_bytes(c.payload[0..8].try_into().unwrap()),
            offset
        );
        match c.kind {
            REPLY_TYPE_OFFSET_DATA => c.payload[8..].to_vec(),
            REPLY_TYPE_OFFSET_HOLE => {
                let n = u32::from_be_bytes(c.payload[8..12].try_into().unwrap());
                assert_eq!(n, len);
                vec![0; n as usize]
            }
            _ => panic!("not read data: {c:?}"),
        }
    }

    /// Waits for the server to close the connection.
    async fn closed(&mut self) {
        let mut b = [0u8; 1];
        let n = tokio::time::timeout(Duration::from_secs(5), self.s.read(&mut b))
            .await
            .expect("the server did not close");
        assert!(matches!(n, Ok(0) | Err(_)), "unexpected byte {b:?}");
    }
}

fn request(flags: u16, kind: u16, cookie: u64, offset: u64, len: u32) -> [u8; 28] {
    let mut b = [0u8; 28];
    b[0..4].copy_from_slice(&0x2560_9513u32.to_be_bytes());
    b[4..6].copy_from_slice(&flags.to_be_bytes());
    b[6..8].copy_from_slice(&kind.to_be_bytes());
    b[8..16].copy_from_slice(&cookie.to_be_bytes());
    b[16..24].copy_from_slice(&offset.to_be_bytes());
    b[24..28].copy_from_slice(&len.to_be_bytes());
    b
}

/// NBD_OPT_INFO / NBD_OPT_GO data.
fn info_query(name: &str, infos: &[u16]) -> Vec<u8> {
    let mut d = (name.len() as u32).to_be_bytes().to_vec();
    d.extend_from_slice(name.as_bytes());
    d.extend_from_slice(&(infos.len() as u16).to_be_bytes());
    for i in infos {
        d.extend_from_slice(&i.to_be_bytes());
    }
    d
}

/// NBD_OPT_{LIST,SET}_META_CONTEXT data.
fn meta_query(name: &str, queries: &[&str]) -> Vec<u8> {
    let mut d = (name.len() as u32).to_be_bytes().to_vec();
    d.extend_from_slice(name.as_bytes());
    d.extend_from_slice(&(queries.len() as u32).to_be_bytes());
    for q in queries {
        d.extend_from_slice(&(q.len() as u32).to_be_bytes());
        d.extend_from_slice(q.as_bytes());
    }
    d
}

/// A server with a 4 MiB "disk" (random data in the first MiB, a hole after) and a
/// read-only 1 MiB "ro".
async fn raw_fixture() -> (TempDir, Server) {
    let dir = TempDir::new().unwrap();
    sparse_image(
        &dir.path().join("disk.img"),
        4 * MIB,
        &[(0, MIB as usize)],
        10,
    );
    sparse_image(&dir.path().join("ro.img"), MIB, &[(0, MIB as usize)], 11);
    let server = Server::start(
        dir.path(),
        vec![
            Export::new("disk", &dir.path().join("disk.img")),
            Export {
                read_only: true,
                ..Export::new("ro", &dir.path().join("ro.img"))
            },
        ],
    )
    .await;
    (dir, server)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn options_the_server_does_not_know_are_refused_and_haggling_goes_on() {
    let (_dir, server) = raw_fixture().await;
    let mut c = Raw::connect(&server).await;

    assert_eq!(c.ask(OPT_EXTENDED_HEADERS, &[]).await.0, REP_ERR_UNSUP);
    assert_eq!(c.ask(OPT_STARTTLS, &[]).await.0, REP_ERR_UNSUP);
    assert_eq!(c.ask(0x1234, b"whatever").await.0, REP_ERR_UNSUP);
    // Option data past the limit is skipped, not parsed.
    assert_eq!(c.ask(OPT_GO, &vec![0u8; 100_000]).await.0, REP_ERR_TOO_BIG);
    assert_eq!(c.ask(OPT_LIST, b"x").await.0, REP_ERR_INVALID);
    assert_eq!(c.ask(OPT_GO, &[0, 0, 0, 9, b'd']).await.0, REP_ERR_INVALID);

    // LIST names every export.
    c.option(OPT_LIST, &[]).await;
    let list = c.replies(OPT_LIST).await;
    let names: Vec<_> = list
        .iter()
        .filter(|(rep, _)| *rep == REP_SERVER)
        .map(|(_, d)| String::from_utf8(d[4..].to_vec()).unwrap())
        .collect();
    assert_eq!(names, ["disk", "ro"]);

    // SET_META_CONTEXT before structured replies is refused.
    let q = meta_query("disk", &["base:allocation"]);
    assert_eq!(c.ask(OPT_SET_META_CONTEXT, &q).await.0, REP_ERR_INVALID);
    assert_eq!(c.ask(OPT_STRUCTURED_REPLY, &[]).await.0, REP_ACK);
    assert_eq!(c.ask(OPT_STRUCTURED_REPLY, &[]).await.0, REP_ERR_INVALID);

    // LIST_META_CONTEXT: `base:` lists base:allocation; other namespaces find nothing.
    c.option(OPT_LIST_META_CONTEXT, &meta_query("disk", &["base:"]))
        .await;
    let r = c.replies(OPT_LIST_META_CONTEXT).await;
    assert_eq!(r.len(), 2);
    assert_eq!(r[0].0, REP_META_CONTEXT);
    assert_eq!(&r[0].1[4..], b"base:allocation");
    let q = meta_query("disk", &["qemu:dirty-bitmap:x", "base:nope"]);
    assert_eq!(c.ask(OPT_LIST_META_CONTEXT, &q).await.0, REP_ACK);
    // mover's own context, by its namespace; an empty query lists both.
    c.option(OPT_LIST_META_CONTEXT, &meta_query("disk", &["mover:"]))
        .await;
    let r = c.replies(OPT_LIST_META_CONTEXT).await;
    assert_eq!(&r[0].1[4..], b"mover:present");
    c.option(OPT_LIST_META_CONTEXT, &meta_query("disk", &[]))
        .await;
    let r = c.replies(OPT_LIST_META_CONTEXT).await;
    let names: Vec<_> = r[..r.len() - 1]
        .iter()
        .map(|(_, d)| d[4..].to_vec())
        .collect();
    assert_eq!(
        names,
        [b"base:allocation".to_vec(), b"mover:present".to_vec()]
    );
    let q = meta_query("nope", &["base:allocation"]);
    assert_eq!(c.ask(OPT_SET_META_CONTEXT, &q).await.0, REP_ERR_UNKNOWN);

    // INFO of an unknown export says why; of a known one, what it is.
    let (rep, msg) = c.ask(OPT_INFO, &info_query("nope", &[])).await;
    assert_eq!(rep, REP_ERR_UNKNOWN);
    assert_eq!(msg, "no export named \"nope\" here");
    c.option(OPT_INFO, &info_query("ro", &[1, 3])).await;
    let info = c.replies(OPT_INFO).await;
    let kinds: Vec<_> = info
        .iter()
        .map(|(rep, d)| (*rep, d.get(0..2).map(|k| k[1])))
        .collect();
    assert_eq!(
        kinds,
        [
            (REP_INFO, Some(0)), // export
            (REP_INFO, Some(3)), // block size
            (REP_INFO, Some(1)), // name
            (REP_ACK, None)
        ]
    );
    assert_eq!(&info[1].1[2..], [0, 0, 2, 0, 0, 0, 16, 0, 2, 0, 0, 0]); // 512, 4096, 32 MiB
    assert_eq!(&info[2].1[2..], b"ro");

    // And after all that, GO works.
    let (size, flags) = c.go("disk", false, true).await;
    assert_eq!(size, 4 * MIB);
    assert_eq!(flags & FLAG_READ_ONLY, 0);
    assert_ne!(flags & FLAG_SEND_DF, 0);
    let data = c.read_data(1, 0, 4096).await;
    assert_eq!(
        data,
        std::fs::read(_dir.path().join("disk.img")).unwrap()[..4096]
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn unknown_client_flags_abort_and_unknown_export_names_close() {
    let (_dir, server) = raw_fixture().await;

    let mut c = Raw::hello(server.connect().await, 1 << 5).await;
    c.closed().await;

    let mut c = Raw::connect(&server).await;
    assert_eq!(c.ask(OPT_ABORT, &[]).await.0, REP_ACK);
    c.closed().await;

    // EXPORT_NAME has no error reply: an unknown name is a hard disconnect.
    let mut c = Raw::connect(&server).await;
    c.option(OPT_EXPORT_NAME, b"nope").await;
    c.closed().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn export_name_and_simple_replies() {
    let (dir, server) = raw_fixture().await;
    let disk = std::fs::read(dir.path().join("disk.img")).unwrap();
    // Without NO_ZEROES: size, flags and 124 zero bytes.
    let mut c = Raw::hello(server.connect().await, 1).await;
    c.option(OPT_EXPORT_NAME, b"disk").await;
    let mut b = [0xffu8; 8 + 2 + 124];
    c.s.read_exact(&mut b).await.unwrap();
    assert_eq!(u64::from_be_bytes(b[0..8].try_into().unwrap()), 4 * MIB);
    let flags = u16::from_be_bytes([b[8], b[9]]);
    assert_eq!(flags & FLAG_SEND_DF, 0, "DF without structured replies");
    assert!(b[10..].iter().all(|&x| x == 0));

    // An out-of-range read is an error with no payload, and the connection goes on.
    c.request(0, CMD_READ, 7, 4 * MIB - 512, 1024).await;
    assert_eq!(c.simple(1024).await, (EINVAL, 7, vec![]));
    c.request(0, CMD_READ, 8, 1000, 3000).await;
    assert_eq!(c.simple(3000).await, (0, 8, disk[1000..4000].to_vec()));
    // DF is a structured-reply flag.
    c.request(CMD_FLAG_DF, CMD_READ, 9, 0, 512).await;
    assert_eq!(c.simple(512).await.0, EINVAL);
    c.write(10, 4 * MIB - 4, b"tail").await;
    assert_eq!(c.simple(0).await, (0, 10, vec![]));
    c.request(0, CMD_DISC, 11, 0, 0).await;
    c.closed().await;
    let disk = std::fs::read(dir.path().join("disk.img")).unwrap();
    assert_eq!(&disk[disk.len() - 4..], b"tail");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn bad_requests_get_structured_errors_and_the_connection_goes_on() {
    let (dir, server) = raw_fixture().await;
    let disk = std::fs::read(dir.path().join("disk.img")).unwrap();
    let mut c = Raw::connect(&server).await;
    c.go("disk", true, true).await;

    c.request(0, CMD_READ, 1, 4 * MIB, 1).await;
    let (errno, msg) = c.done(1).await.error();
    assert_eq!(errno, EINVAL);
    assert!(msg.contains("beyond the end"), "{msg}");

    c.request(0, CMD_READ, 2, u64::MAX - 10, 512).await; // offset + len overflows
    assert_eq!(c.done(2).await.error().0, EINVAL);
    c.request(0, CMD_READ, 3, 0, (32 << 20) + 1).await;
    assert_eq!(c.done(3).await.error().0, EINVAL);
    c.request(0, 99, 4, 0, 512).await;
    assert_eq!(
        c.done(4).await.error(),
        (EINVAL, "unknown command 99".into())
    );
    c.request(CMD_FLAG_NO_HOLE, CMD_READ, 5, 0, 512).await;
    assert_eq!(c.done(5).await.error().0, EINVAL);
    c.write(6, 4 * MIB - 100, &[1; 200]).await;
    assert_eq!(c.done(6).await.error().0, ENOSPC);
    c.request(0, CMD_WRITE_ZEROES, 7, 4 * MIB, 512).await;
    assert_eq!(c.done(7).await.error().0, ENOSPC);
    c.request(0, CMD_TRIM, 8, 4 * MIB, 512).await;
    assert_eq!(c.done(8).await.error().0, EINVAL);
    c.request(0, CMD_BLOCK_STATUS, 9, 0, 0).await;
    assert_eq!(c.done(9).await.error().0, EINVAL);

    // A write too long for the server: its payload is skipped and the stream stays in
    // step.
    let big = vec![0x42u8; (32 << 20) + 4096];
    let mut b = request(0, CMD_WRITE, 10, 0, big.len() as u32).to_vec();
    b.extend_from_slice(&big);
    c.s.write_all(&b).await.unwrap();
    assert_eq!(c.done(10).await.error().0, EINVAL);

    // Still usable: data, a hole, a DF read, block status with and without REQ_ONE.
    assert_eq!(c.read_data(11, 4000, 10_000).await, disk[4000..14_000]);
    c.request(0, CMD_READ, 12, 2 * MIB, 65536).await;
    assert_eq!(c.done(12).await.kind, REPLY_TYPE_OFFSET_HOLE);
    c.request(CMD_FLAG_DF, CMD_READ, 13, MIB - 512, 1024).await;
    let chunk = c.done(13).await;
    assert_eq!(chunk.kind, REPLY_TYPE_OFFSET_DATA);
    assert_eq!(
        chunk.payload[8..],
        disk[MIB as usize - 512..MIB as usize + 512]
    );

    c.request(0, CMD_BLOCK_STATUS, 14, MIB - 4096, (2 * MIB) as u32)
        .await;
    let bs = c.done(14).await;
    assert_eq!(bs.kind, REPLY_TYPE_BLOCK_STATUS);
    assert_eq!(
        descriptors(&bs.payload),
        [(4096, 0), ((2 * MIB - 4096) as u32, 3)]
    );
    c.request(
        CMD_FLAG_REQ_ONE,
        CMD_BLOCK_STATUS,
        15,
        MIB - 4096,
        (3 * MIB + 4096) as u32,
    )
    .await;
    let bs = c.done(15).await;
    assert_eq!(bs.kind, REPLY_TYPE_BLOCK_STATUS);
    assert_eq!(descriptors(&bs.payload), [(4096, 0)]);

    c.request(CMD_FLAG_FUA, CMD_CACHE, 16, 0, 4096).await;
    assert_eq!(c.done(16).await.kind, REPLY_TYPE_NONE);
    c.request(0, CMD_DISC, 17, 0, 0).await;
    c.closed().await;
}

/// The (length, flags) descriptors of a block status payload (after the context id).
fn descriptors(payload: &[u8]) -> Vec<(u32, u32)> {
    assert_eq!(
        u32::from_be_bytes(payload[0..4].try_into().unwrap()),
        1,
        "context id"
    );
    payload[4..]
        .chunks(8)
        .map(|d| {
            (
                u32::from_be_bytes(d[0..4].try_into().unwrap()),
                u32::from_be_bytes(d[4..8].try_into().unwrap()),
            )
        })
        .collect()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn block_status_without_a_context_is_einval() {
    let (_dir, server) = raw_fixture().await;
    let mut c = Raw::connect(&server).await;
    // base:allocation selected for another export than the one chosen: not valid.
    assert_eq!(c.ask(OPT_STRUCTURED_REPLY, &[]).await.0, REP_ACK);
    c.option(
        OPT_SET_META_CONTEXT,
        &meta_query("ro", &["base:allocation"]),
    )
    .await;
    assert_eq!(c.replies(OPT_SET_META_CONTEXT).await.len(), 2);
    c.go("disk", false, false).await;
    c.request(0, CMD_BLOCK_STATUS, 1, 0, 4096).await;
    assert_eq!(c.done(1).await.error().0, EINVAL);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_read_only_export_answers_eperm_and_reads_on() {
    let (dir, server) = raw_fixture().await;
    let before = std::fs::read(dir.path().join("ro.img")).unwrap();
    let mut c = Raw::connect(&server).await;
    let (_, flags) = c.go("ro", true, false).await;
    assert_ne!(flags & FLAG_READ_ONLY, 0);

    c.write(1, 0, &[0xee; 4096]).await;
    let (errno, msg) = c.done(1).await.error();
    assert_eq!(errno, EPERM);
    assert_eq!(msg, "export \"ro\" is read-only");
    c.request(0, CMD_TRIM, 2, 0, 4096).await;
    assert_eq!(c.done(2).await.error().0, EPERM);
    c.request(CMD_FLAG_NO_HOLE, CMD_WRITE_ZEROES, 3, 0, 4096)
        .await;
    assert_eq!(c.done(3).await.error().0, EPERM);
    c.request(0, CMD_FLUSH, 4, 0, 0).await;
    assert_eq!(c.done(4).await.kind, REPLY_TYPE_NONE);
    // The refused write's payload was consumed: the next request is read in step.
    assert_eq!(c.read_data(5, 0, 4096).await, before[..4096]);
    assert_eq!(std::fs::read(dir.path().join("ro.img")).unwrap(), before);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn pipelined_requests_are_all_answered_before_disc_closes() {
    let (dir, server) = raw_fixture().await;
    let mut c = Raw::connect(&server).await;
    c.go("disk", true, true).await;
    let (mut rd, mut wr) = c.s.into_split();

    // 300 writes of distinct 4 KiB blocks, a FUA write-zeroes, a flush, then DISC,
    // all sent before reading a single reply.
    const N: u64 = 300;
    let sender = tokio::spawn(async move {
        for i in 0..N {
            let mut b = request(0, CMD_WRITE, i, MIB + i * 4096, 4096).to_vec();
            b.extend_from_slice(&random(1000 + i, 4096));
            wr.write_all(&b).await.unwrap();
        }
        let zero = request(CMD_FLAG_FUA, CMD_WRITE_ZEROES, N, 0, 65536);
        wr.write_all(&zero).await.unwrap();
        wr.write_all(&request(0, CMD_FLUSH, N + 1, 0, 0))
            .await
            .unwrap();
        wr.write_all(&request(0, CMD_DISC, N + 2, 0, 0))
            .await
            .unwrap();
        wr
    });
    let mut all = Vec::new();
    rd.read_to_end(&mut all).await.unwrap();
    let _wr = sender.await.unwrap();

    // Every request answered once, successfully; nothing for DISC.
    let mut answered = HashMap::new();
    for chunk in all.chunks(20) {
        assert_eq!(chunk[0..4], 0x668e33efu32.to_be_bytes());
        assert_eq!(u16::from_be_bytes([chunk[6], chunk[7]]), REPLY_TYPE_NONE);
        let cookie = u64::from_be_bytes(chunk[8..16].try_into().unwrap());
        *answered.entry(cookie).or_insert(0) += 1;
    }
    assert_eq!(answered.len() as u64, N + 2);
    assert!(answered.values().all(|&n| n == 1));
    assert!((0..N + 2).all(|c| answered.contains_key(&c)));

    let disk = std::fs::read(dir.path().join("disk.img")).unwrap();
    assert!(disk[..65536].iter().all(|&b| b == 0));
    for i in 0..N as usize {
        let at = MIB as usize + i * 4096;
        assert_eq!(
            disk[at..at + 4096],
            random(1000 + i as u64, 4096),
            "block {i}"
        );
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn serve_connection_over_any_stream_reports_how_it_ended() {
    let dir = TempDir::new().unwrap();
    sparse_image(&dir.path().join("disk.img"), MIB, &[(0, 4096)], 12);
    let exports: Arc<dyn NbdExports> = Arc::new(Exports(vec![Export::new(
        "disk",
        &dir.path().join("disk.img"),
    )]));

    // A clean session: Ok once the client disconnects.
    let (client, server_end) = tokio::io::duplex(1 << 16);
    let served = tokio::spawn(serve_connection(server_end, exports.clone()));
    let mut c = Raw::hello(client, 3).await;
    c.go("disk", true, false).await;
    c.request(0, CMD_DISC, 1, 0, 0).await;
    served.await.unwrap().unwrap();

    // Garbage instead of a request: a protocol error.
    let (client, server_end) = tokio::io::duplex(1 << 16);
    let served = tokio::spawn(serve_connection(server_end, exports.clone()));
    let mut c = Raw::hello(client, 3).await;
    c.go("disk", true, false).await;
    c.s.write_all(&[0x55; 28]).await.unwrap();
    let err = served.await.unwrap().unwrap_err();
    assert!(
        matches!(
            err,
            NbdError::BadMagic {
                got: 0x5555_5555,
                ..
            }
        ),
        "{err}"
    );
    assert!(!err.is_disconnect());

    // A client vanishing mid-request: a disconnect, not worth a warning.
    let (client, server_end) = tokio::io::duplex(1 << 16);
    let served = tokio::spawn(serve_connection(server_end, exports.clone()));
    let mut c = Raw::hello(client, 3).await;
    c.go("disk", true, false).await;
    c.s.write_all(&request(0, CMD_WRITE, 1, 0, 4096)[..])
        .await
        .unwrap();
    c.s.write_all(&[0; 100]).await.unwrap();
    drop(c);
    let err = served.await.unwrap().unwrap_err();
    assert!(err.is_disconnect(), "{err}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn volume_failures_reach_the_client_and_the_connection_goes_on() {
    let dir = TempDir::new().unwrap();
    let img = dir.path().join("faulty.img");
    sparse_image(&img, MIB, &[(0, MIB as usize)], 13);
    let server = Server::start(
        dir.path(),
        vec![Export {
            faulty: true,
            ..Export::new("faulty", &img)
        }],
    )
    .await;
    let mut c = Raw::connect(&server).await;
    c.go("faulty", true, false).await;

    c.request(0, CMD_READ, 1, 0, 512).await;
    assert_eq!(c.done(1).await.error().0, 5, "a panic is EIO");
    c.request(0, CMD_READ, 2, 4096, 512).await;
    let (errno, msg) = c.done(2).await.error();
    assert_eq!(errno, 75, "EOVERFLOW is passed on");
    assert!(msg.starts_with("read: "), "{msg}");
    c.request(0, CMD_READ, 3, 8192, 512).await;
    assert_eq!(c.done(3).await.error().0, 5, "ENOENT is no NBD error: EIO");
    let data = c.read_data(4, 65536, 512).await;
    assert_eq!(data, std::fs::read(&img).unwrap()[65536..65536 + 512]);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn serve_tcp_serves_nbdinfo() {
    if !have(&["nbdinfo"]) {
        return;
    }
    let dir = TempDir::new().unwrap();
    let img = dir.path().join("disk.img");
    sparse_image(&img, 2 * MIB, &[(0, 4096)], 14);
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let port = listener.local_addr().unwrap().port();
    let exports: Arc<dyn NbdExports> = Arc::new(Exports(vec![Export::new("disk", &img)]));
    let (stop, stopped) = oneshot::channel::<()>();
    let server = tokio::spawn(transport::nbd::serve_tcp(listener, exports, None, async {
        let _ = stopped.await;
    }));

    let info = json(
        &ok(
            "nbdinfo",
            &["--json", &format!("nbd://127.0.0.1:{port}/disk")],
        )
        .await,
    );
    assert_eq!(info["exports"][0]["export-size"], 2 * MIB);

    stop.send(()).unwrap();
    server.await.unwrap().unwrap();
    // No longer accepting.
    assert!(
        tokio::net::TcpStream::connect(("127.0.0.1", port))
            .await
            .is_err()
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn serve_unix_replaces_a_stale_socket_but_not_a_file() {
    let dir = TempDir::new().unwrap();
    let img = dir.path().join("disk.img");
    sparse_image(&img, MIB, &[], 15);
    // A socket file left by a server that died.
    drop(std::os::unix::net::UnixListener::bind(dir.path().join("nbd.sock")).unwrap());
    let server = Server::start(dir.path(), vec![Export::new("disk", &img)]).await;
    let mut c = Raw::connect(&server).await;
    assert_eq!(c.go("disk", false, false).await.0, MIB);
    server.stop().await;

    let exports: Arc<dyn NbdExports> = Arc::new(Exports(vec![]));
    let err = serve_unix(&img, exports, async {}).await.unwrap_err();
    assert_eq!(err.kind(), io::ErrorKind::AlreadyExists);
    assert_eq!(
        std::fs::metadata(&img).unwrap().len(),
        MIB,
        "the file is untouched"
    );
}

/// A TLS acceptor with a self-signed certificate (also its own CA).
fn self_signed_acceptor(dir: &Path) -> tokio_rustls::TlsAcceptor {
    let key = rcgen::KeyPair::generate().unwrap();
    let cert = rcgen::CertificateParams::new(vec!["localhost".to_string()])
        .unwrap()
        .self_signed(&key)
        .unwrap();
    let (cert_path, key_path) = (dir.join("server.pem"), dir.join("server.key"));
    std::fs::write(&cert_path, cert.pem()).unwrap();
    std::fs::write(&key_path, key.serialize_pem()).unwrap();
    transport::tls::TlsFiles {
        cert: cert_path.clone(),
        key: key_path,
        ca: cert_path,
    }
    .acceptor()
    .unwrap()
}

#[tokio::test]
async fn with_tls_nothing_is_served_before_starttls_and_a_silent_client_is_dropped() {
    let dir = TempDir::new().unwrap();
    let img = dir.path().join("disk.img");
    sparse_image(&img, MIB, &[(0, 4096)], 15);
    let exports: Arc<dyn NbdExports> = Arc::new(Exports(vec![Export::new("disk", &img)]));
    let acceptor = self_signed_acceptor(dir.path());

    // Every option but STARTTLS and ABORT: TLS required, with a message; EXPORT_NAME,
    // which has no error reply, closes the connection.
    let (client, server) = tokio::io::duplex(1 << 16);
    let limit = Duration::from_secs(10);
    let served = tokio::spawn(serve_with(
        server,
        exports.clone(),
        Some(acceptor.clone()),
        limit,
    ));
    let mut c = Raw::hello(client, 3).await;
    for option in [OPT_LIST, OPT_STRUCTURED_REPLY, OPT_INFO, OPT_GO] {
        let (rep, msg) = c.ask(option, &[]).await;
        assert_eq!(rep, REP_ERR_TLS_REQD, "option {option}: {msg}");
        assert!(msg.contains("requires TLS"), "{msg}");
    }
    assert_eq!(c.ask(OPT_STARTTLS, b"x").await.0, REP_ERR_INVALID);
    c.option(OPT_EXPORT_NAME, b"disk").await;
    let r = served.await.unwrap();
    assert!(matches!(r, Err(NbdError::TlsRequired)), "{r:?}");

    // A client that says nothing after the greeting is dropped at the limit.
    let (client, server) = tokio::io::duplex(1 << 16);
    let started = std::time::Instant::now();
    let limit = Duration::from_millis(300);
    let served = tokio::spawn(serve_with(server, exports, Some(acceptor), limit));
    let _silent = Raw::hello(client, 3).await;
    let r = served.await.unwrap();
    assert!(matches!(r, Err(NbdError::HandshakeTimeout(_))), "{r:?}");
    assert!(started.elapsed() < Duration::from_secs(5));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn block_status_answers_each_selected_context_in_its_own_chunk() {
    let (_dir, server) = raw_fixture().await;
    let mut c = Raw::connect(&server).await;
    assert_eq!(c.ask(OPT_STRUCTURED_REPLY, &[]).await.0, REP_ACK);
    let q = meta_query("disk", &["mover:present", "base:allocation", "other:x"]);
    c.option(OPT_SET_META_CONTEXT, &q).await;
    let r = c.replies(OPT_SET_META_CONTEXT).await;
    let selected: Vec<_> = r[..r.len() - 1]
        .iter()
        .map(|(rep, d)| {
            (
                *rep,
                u32::from_be_bytes(d[0..4].try_into().unwrap()),
                d[4..].to_vec(),
            )
        })
        .collect();
    assert_eq!(
        selected,
        [
            (REP_META_CONTEXT, 1, b"base:allocation".to_vec()),
            (REP_META_CONTEXT, 2, b"mover:present".to_vec())
        ]
    );
    c.option(OPT_GO, &info_query("disk", &[])).await;
    assert_eq!(c.replies(OPT_GO).await.last().unwrap().0, REP_ACK);

    c.request(0, CMD_BLOCK_STATUS, 5, 0, MIB as u32).await;
    let first = c.chunk().await;
    assert_eq!(
        (first.cookie, first.flags & 1, first.kind),
        (5, 0, REPLY_TYPE_BLOCK_STATUS)
    );
    assert_eq!(
        u32::from_be_bytes(first.payload[0..4].try_into().unwrap()),
        1
    );
    let second = c.done(5).await;
    assert_eq!(second.kind, REPLY_TYPE_BLOCK_STATUS);
    assert_eq!(
        u32::from_be_bytes(second.payload[0..4].try_into().unwrap()),
        2
    );
    // A plain export holds everything: nothing is missing.
    let d = &second.payload[4..];
    assert_eq!(d.len(), 8);
    assert_eq!(u32::from_be_bytes(d[0..4].try_into().unwrap()), MIB as u32);
    assert_eq!(u32::from_be_bytes(d[4..8].try_into().unwrap()), 0);
}
