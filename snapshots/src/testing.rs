//! Helpers for tests of code that uses repositories: a real S3 server (`s3s-fs`) on a
//! free port of 127.0.0.1 (or another address of the machine), started and stopped by
//! the test.

use crate::S3Options;
use std::{
    net::{TcpListener, TcpStream},
    path::{Path, PathBuf},
    process::{Child, Command, Stdio},
    time::{Duration, Instant},
};

/// Access key the test server accepts.
pub const ACCESS_KEY: &str = "moveraccess";
/// Secret key the test server accepts.
pub const SECRET_KEY: &str = "moversecret0123456789";

/// An `s3s-fs` process serving a temp directory; killed on drop.
#[derive(Debug)]
pub struct S3Server {
    child: Child,
    /// The endpoint URL, e.g. `http://127.0.0.1:40123`.
    pub endpoint: String,
    root: PathBuf,
}

impl S3Server {
    /// Starts `s3s-fs` over `root` (a directory whose subdirectories are buckets) and
    /// waits until it accepts connections. Panics with install instructions if the
    /// binary is missing.
    pub fn start(root: &Path) -> S3Server {
        S3Server::start_on(root, "127.0.0.1")
    }

    /// [`S3Server::start`] listening on `host` (an address of this machine), e.g. a
    /// bridge address that containers on this machine reach.
    pub fn start_on(root: &Path, host: &str) -> S3Server {
        let port = TcpListener::bind((host, 0))
            .and_then(|l| l.local_addr())
            .expect("a free port")
            .port();
        std::fs::create_dir_all(root).expect("create the S3 server's root directory");
        let mut child = Command::new("s3s-fs")
            .args(["--host", host, "--port", &port.to_string()])
            .args(["--access-key", ACCESS_KEY, "--secret-key", SECRET_KEY])
            .arg(root)
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .unwrap_or_else(|e| {
                panic!(
                    "cannot start s3s-fs ({e}); install it with \
                     `cargo install s3s-fs@0.14.1 --features binary --locked`"
                )
            });
        let deadline = Instant::now() + Duration::from_secs(20);
        while TcpStream::connect((host, port)).is_err() {
            assert!(
                Instant::now() < deadline,
                "s3s-fs did not start listening on port {port}"
            );
            if let Ok(Some(status)) = child.try_wait() {
                panic!("s3s-fs exited at start ({status}); is port {port} taken?");
            }
            std::thread::sleep(Duration::from_millis(50));
        }
        S3Server {
            child,
            endpoint: format!("http://{host}:{port}"),
            root: root.to_path_buf(),
        }
    }

    /// Creates a bucket (a directory under the root).
    pub fn create_bucket(&self, bucket: &str) {
        std::fs::create_dir_all(self.root.join(bucket)).expect("create bucket directory");
    }

    /// Options for `bucket/prefix` on this server, with its credentials.
    pub fn options(&self, bucket: &str, prefix: &str) -> S3Options {
        S3Options {
            bucket: bucket.into(),
            prefix: prefix.into(),
            endpoint: Some(self.endpoint.clone()),
            region: Some("us-east-1".into()),
            path_style: true,
            access_key_id: Some(ACCESS_KEY.into()),
            secret_access_key: Some(SECRET_KEY.into()),
        }
    }
}

impl Drop for S3Server {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}
