//! An HTTP proxy in front of a real S3 server that answers chosen requests with S3's
//! `503 SlowDown` (a throttling storm), and passes the rest through unchanged.
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
};

/// The proxy: its endpoint and what it did.
pub struct SlowDown {
    pub endpoint: String,
    pub refused: Arc<AtomicU64>,
    pub passed: Arc<AtomicU64>,
}

const BODY: &str = "<?xml version=\"1.0\" encoding=\"UTF-8\"?>\n<Error><Code>SlowDown</Code>\
    <Message>Please reduce your request rate.</Message><RequestId>storm</RequestId></Error>";

impl SlowDown {
    /// Proxies to `upstream` (`http://host:port`); request number n (from 0) is refused
    /// when `refuse(n)`.
    pub fn start(upstream: &str, refuse: fn(u64) -> bool) -> SlowDown {
        let listener = TcpListener::bind("127.0.0.1:0").unwrap();
        let endpoint = format!("http://{}", listener.local_addr().unwrap());
        let up = upstream.trim_start_matches("http://").to_string();
        let (refused, passed) = (Arc::new(AtomicU64::new(0)), Arc::new(AtomicU64::new(0)));
        let count = Arc::new(AtomicU64::new(0));
        {
            let (refused, passed) = (refused.clone(), passed.clone());
            std::thread::spawn(move || {
                for conn in listener.incoming().flatten() {
                    let (up, count, refused, passed) =
                        (up.clone(), count.clone(), refused.clone(), passed.clone());
                    std::thread::spawn(move || {
                        _ = serve(conn, &up, refuse, &count, &refused, &passed);
                    });
                }
            });
        }
        SlowDown {
            endpoint,
            refused,
            passed,
        }
    }
}

fn serve(
    client: TcpStream,
    up: &str,
    refuse: fn(u64) -> bool,
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
        if refuse(count.fetch_add(1, Ordering::Relaxed)) {
            refused.fetch_add(1, Ordering::Relaxed);
            write!(
                out,
                "HTTP/1.1 503 Slow Down\r\nContent-Type: application/xml\r\nContent-Length: {}\r\n\r\n{BODY}",
                BODY.len()
            )?;
            continue;
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
