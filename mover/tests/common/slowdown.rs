//! An HTTP proxy in front of a real S3 server that answers chosen requests with S3's
//! `503 SlowDown` (a throttling storm) or holds them back (a slow endpoint), and passes
//! the rest through unchanged.
//!
//! Requests are framed by Content-Length (what the AWS SDK sends); each passed request
//! goes to the server on a connection of its own (`Connection: close`), so the answer
//! is whatever the server sends until it closes.

use std::{
    io::{self, BufRead, BufReader, Read, Write},
    net::{TcpListener, TcpStream},
    sync::{
        Arc,
        atomic::{AtomicU64, Ordering},
    },
    time::Duration,
};

/// What the proxy does with a request.
pub enum Answer {
    Pass,
    Refuse,
    /// Passed after this long.
    Delay(Duration),
}

/// A controlled proxy's modes ([`SlowDown::set`]): pass every request, refuse every
/// one; any other value holds each back that many milliseconds.
pub const PASS: u64 = 0;
pub const REFUSE: u64 = u64::MAX;

type Choose = Arc<dyn Fn(u64) -> Answer + Send + Sync>;

/// The proxy: its endpoint and what it did.
pub struct SlowDown {
    pub endpoint: String,
    pub refused: Arc<AtomicU64>,
    pub passed: Arc<AtomicU64>,
    mode: Arc<AtomicU64>,
}

const BODY: &str = "<?xml version=\"1.0\" encoding=\"UTF-8\"?>\n<Error><Code>SlowDown</Code>\
    <Message>Please reduce your request rate.</Message><RequestId>storm</RequestId></Error>";

impl SlowDown {
    /// Proxies to `upstream` (`http://host:port`); request number n (from 0) is refused
    /// when `refuse(n)`.
    pub fn start(upstream: &str, refuse: fn(u64) -> bool) -> SlowDown {
        let choose: Choose = Arc::new(move |n| match refuse(n) {
            true => Answer::Refuse,
            false => Answer::Pass,
        });
        SlowDown::with(
            upstream,
            "127.0.0.1",
            choose,
            Arc::new(AtomicU64::new(PASS)),
        )
    }

    /// A proxy to `upstream` listening on `host` (an address of this machine that pods
    /// reach), whose answers [`SlowDown::set`] chooses; it passes everything at first.
    pub fn controlled(upstream: &str, host: &str) -> SlowDown {
        let mode = Arc::new(AtomicU64::new(PASS));
        let m = mode.clone();
        let choose: Choose = Arc::new(move |_| match m.load(Ordering::Relaxed) {
            PASS => Answer::Pass,
            REFUSE => Answer::Refuse,
            ms => Answer::Delay(Duration::from_millis(ms)),
        });
        SlowDown::with(upstream, host, choose, mode)
    }

    /// From now on: [`PASS`], [`REFUSE`], or hold each request back `mode` ms.
    pub fn set(&self, mode: u64) {
        self.mode.store(mode, Ordering::Relaxed);
    }

    fn with(upstream: &str, host: &str, choose: Choose, mode: Arc<AtomicU64>) -> SlowDown {
        let listener = TcpListener::bind((host, 0)).unwrap();
        let endpoint = format!("http://{}", listener.local_addr().unwrap());
        let up = upstream.trim_start_matches("http://").to_string();
        let (refused, passed) = (Arc::new(AtomicU64::new(0)), Arc::new(AtomicU64::new(0)));
        let count = Arc::new(AtomicU64::new(0));
        {
            let (refused, passed) = (refused.clone(), passed.clone());
            std::thread::spawn(move || {
                for conn in listener.incoming().flatten() {
                    let (up, count, refused, passed, choose) = (
                        up.clone(),
                        count.clone(),
                        refused.clone(),
                        passed.clone(),
                        choose.clone(),
                    );
                    std::thread::spawn(move || {
                        _ = serve(conn, &up, &*choose, &count, &refused, &passed);
                    });
                }
            });
        }
        SlowDown {
            endpoint,
            refused,
            passed,
            mode,
        }
    }
}

fn serve(
    client: TcpStream,
    up: &str,
    choose: &(dyn Fn(u64) -> Answer + Send + Sync),
    count: &AtomicU64,
    refused: &AtomicU64,
    passed: &AtomicU64,
) -> io::Result<()> {
    let mut out = client.try_clone()?;
    let mut reader = BufReader::new(client);
    loop {
        let mut lines = Vec::new();
        loop {
            let mut line = Vec::new();
            if reader.read_until(b'\n', &mut line)? == 0 {
                return Ok(());
            }
            if line == b"\r\n" {
                break;
            }
            lines.push(String::from_utf8_lossy(&line).trim_end().to_string());
        }
        let header = |name: &str| {
            lines.iter().find_map(|l| {
                let (k, v) = l.split_once(':')?;
                k.eq_ignore_ascii_case(name).then(|| v.trim().to_string())
            })
        };
        assert!(
            header("transfer-encoding").is_none(),
            "the proxy frames requests by Content-Length only: {lines:?}"
        );
        if header("expect").is_some_and(|v| v.eq_ignore_ascii_case("100-continue")) {
            out.write_all(b"HTTP/1.1 100 Continue\r\n\r\n")?;
        }
        let len: usize = header("content-length").map_or(0, |v| v.parse().unwrap());
        let mut body = vec![0u8; len];
        reader.read_exact(&mut body)?;
        match choose(count.fetch_add(1, Ordering::Relaxed)) {
            Answer::Refuse => {
                refused.fetch_add(1, Ordering::Relaxed);
                write!(
                    out,
                    "HTTP/1.1 503 Slow Down\r\nContent-Type: application/xml\r\nContent-Length: {}\r\n\r\n{BODY}",
                    BODY.len()
                )?;
                continue;
            }
            Answer::Delay(d) => std::thread::sleep(d),
            Answer::Pass => {}
        }
        passed.fetch_add(1, Ordering::Relaxed);
        let mut server = TcpStream::connect(up)?;
        let mut head = String::new();
        for l in &lines {
            let name = l.split(':').next().unwrap_or("").to_ascii_lowercase();
            if name != "connection" && name != "expect" {
                head.push_str(l);
                head.push_str("\r\n");
            }
        }
        head.push_str("Connection: close\r\n\r\n");
        server.write_all(head.as_bytes())?;
        server.write_all(&body)?;
        io::copy(&mut server, &mut out)?;
    }
}
