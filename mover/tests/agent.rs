//! Copies to and from a real `mover agent` process over gRPC on 127.0.0.1: deltas,
//! refusals, mutual TLS, kill -9 of either side, and a connection cut mid-transfer.

mod common;

use common::{agent::*, *};
use std::{
    io::{Read, Write},
    net::{TcpListener, TcpStream},
    path::{Path, PathBuf},
    process::Child,
    sync::{
        Arc, Mutex,
        atomic::{AtomicU64, Ordering::SeqCst},
    },
    time::{Duration, Instant},
};

#[test]
fn push_and_pull_ship_only_differing_pages() {
    let t = tempfile::tempdir().unwrap();
    let src = t.path().join("src.img");
    let remote = t.path().join("remote.img");
    let len = 48 * MIB;
    make_image(&src, len, 40, &[(MIB, 20 * MIB), (40 * MIB, 64 * 1024)]);
    let agent = Agent::start(t.path(), &[("vol", &remote, false)], None);
    let s = src.to_str().unwrap();

    let j = json_of(&copy(t.path(), &[s, &agent.url("vol"), "--verify"]));
    assert_eq!(blake3_of(&src, len), blake3_of(&remote, len));
    assert_eq!(
        j["bytes_written"],
        20 * MIB + 64 * 1024,
        "only data is shipped, not zeros"
    );
    assert!(j["wire_bytes"].as_u64().unwrap() <= 20 * MIB + 64 * 1024 + 4096);
    assert_eq!(j["verified"], true);

    // A delta push: 300 scattered pages changed, one chunk cleared.
    let changed = scribble_pages(&src, 41, 300, MIB..20 * MIB);
    write_zeros(&src, 40 * MIB, 64 * 1024);
    let j = json_of(&copy(t.path(), &[s, &agent.url("vol"), "--verify"]));
    assert_eq!(blake3_of(&src, len), blake3_of(&remote, len));
    assert_eq!(
        j["bytes_written"],
        changed * PAGE,
        "exactly the changed pages"
    );
    assert_eq!(j["bytes_zeroed"], 64 * 1024);
    assert!(j["wire_bytes"].as_u64().unwrap() <= changed * PAGE + 64 * 1024);

    // Pull into a new image, then a delta pull after local damage.
    let local = t.path().join("local.img");
    let l = local.to_str().unwrap();
    json_of(&copy(t.path(), &[&agent.url("vol"), l, "--verify"]));
    assert_eq!(blake3_of(&src, len), blake3_of(&local, len));
    let damaged = scribble_pages(&local, 42, 50, 0..len);
    let j = json_of(&copy(t.path(), &[&agent.url("vol"), l, "--verify"]));
    assert_eq!(blake3_of(&src, len), blake3_of(&local, len));
    assert!(
        j["bytes_written"].as_u64().unwrap() + j["bytes_zeroed"].as_u64().unwrap()
            <= damaged * PAGE
    );
}

#[test]
fn refusals_name_the_problem_and_write_nothing() {
    let t = tempfile::tempdir().unwrap();
    let src = t.path().join("src.img");
    make_image(&src, 8 * MIB, 43, &[(0, 8 * MIB)]);
    let golden = t.path().join("golden.img");
    make_image(&golden, 8 * MIB, 44, &[(0, 8 * MIB)]);
    let target = t.path().join("target.img");
    let agent = Agent::start(
        t.path(),
        &[("golden", &golden, true), ("target", &target, false)],
        None,
    );
    let s = src.to_str().unwrap();
    let golden_hash = blake3_of(&golden, 8 * MIB);
    let refused = |out: std::process::Output, expect: &str| {
        let err = String::from_utf8_lossy(&out.stderr);
        assert_eq!(out.status.code(), Some(2), "{err}");
        assert!(err.contains(expect), "wanted {expect:?} in {err}");
    };

    let wrong_token = copy_command(t.path(), &[s, &agent.url("target")])
        .env("MOVER_TOKEN", "not-the-token")
        .output()
        .unwrap();
    refused(wrong_token, "unauthenticated");
    refused(copy(t.path(), &[s, &agent.url("secret")]), "not exported");
    refused(copy(t.path(), &[s, &agent.url("golden")]), "read-only");
    assert_eq!(blake3_of(&golden, 8 * MIB), golden_hash);
    assert!(!target.exists());

    // Fencing: after epoch 5 wrote, epoch 3 is refused; 5 and 6 are admitted.
    json_of(&copy(
        t.path(),
        &[
            s,
            &agent.url("target"),
            "--epoch",
            "5",
            "--relationship",
            "r1",
        ],
    ));
    refused(
        copy(
            t.path(),
            &[
                s,
                &agent.url("target"),
                "--epoch",
                "3",
                "--relationship",
                "r1",
            ],
        ),
        "stale epoch 3",
    );
    json_of(&copy(
        t.path(),
        &[
            s,
            &agent.url("target"),
            "--epoch",
            "6",
            "--relationship",
            "r1",
        ],
    ));
    assert_eq!(agent.http_get("/healthz"), "ok\n");
    let metrics = agent.http_get("/metrics");
    assert!(
        metrics.contains("mover_agent_stale_epoch_refusals_total 1\n"),
        "{metrics}"
    );
    assert!(
        metrics.contains("mover_agent_refusals_total 2\n"),
        "unexported, read-only: {metrics}"
    );
    assert!(
        metrics.contains(&format!("mover_agent_received_bytes_total {}\n", 8 * MIB)),
        "{metrics}"
    );
    // The highest epoch survives an agent restart.
    let mut agent = agent;
    agent.kill_and_restart();
    refused(
        copy(
            t.path(),
            &[
                s,
                &agent.url("target"),
                "--epoch",
                "5",
                "--relationship",
                "r1",
            ],
        ),
        "epoch 6 has been seen",
    );
}

#[test]
fn mutual_tls_admits_only_clients_of_the_trusted_ca() {
    let t = tempfile::tempdir().unwrap();
    let [ca, server_cert, server_key, client_cert, client_key] = make_pki(t.path(), "good");
    let [_, _, _, rogue_cert, rogue_key] = make_pki(t.path(), "rogue");
    let src = t.path().join("src.img");
    make_image(&src, 8 * MIB, 45, &[(0, 3 * MIB)]);
    let dst = t.path().join("dst.img");
    let agent = Agent::start(
        t.path(),
        &[("vol", &dst, false)],
        Some((&server_cert, &server_key, &ca)),
    );
    let p = |p: &PathBuf| p.to_str().unwrap().to_string();
    let with_certs = |cert: &PathBuf, key: &PathBuf| {
        let args = [
            "--tls-ca",
            &p(&ca),
            "--tls-cert",
            &p(cert),
            "--tls-key",
            &p(key),
            "--tls-server-name",
            "localhost",
            "--retries",
            "1",
        ];
        let mut all = vec![src.to_str().unwrap().to_string(), agent.url("vol")];
        all.extend(args.iter().map(|s| s.to_string()));
        let refs: Vec<&str> = all.iter().map(String::as_str).collect();
        copy(t.path(), &refs)
    };
    let ok = with_certs(&client_cert, &client_key);
    json_of(&ok);
    assert_eq!(blake3_of(&src, 8 * MIB), blake3_of(&dst, 8 * MIB));

    let rogue = with_certs(&rogue_cert, &rogue_key);
    assert!(
        !rogue.status.success(),
        "a client certificate from another CA must be refused"
    );
    let plain = copy(
        t.path(),
        &[src.to_str().unwrap(), &agent.url("vol"), "--retries", "1"],
    );
    assert!(
        !plain.status.success(),
        "a client without TLS must be refused"
    );
    // Where the client reads the TLS server's answer as an HTTP/2 frame, it is told
    // why, and not retried (exit 2: refused). (The server may also just close the
    // connection first: then it is a plain "connection closed".)
    let e = String::from_utf8_lossy(&plain.stderr);
    if e.contains("frame with invalid size") {
        assert!(e.contains("the agent requires TLS"), "{e}");
        assert_eq!(plain.status.code(), Some(2), "{e}");
    }
}

#[test]
fn a_renewed_certificate_reaches_new_connections_without_a_restart() {
    let t = tempfile::tempdir().unwrap();
    let [ca, server_cert, server_key, client_cert, client_key] = make_pki(t.path(), "good");
    let src = t.path().join("src.img");
    make_image(&src, 8 * MIB, 46, &[(0, 3 * MIB)]);
    let dst = t.path().join("dst.img");
    // The agent looks for renewed files every second.
    let mut agent = Agent::start(
        t.path(),
        &[("vol", &dst, false)],
        Some((&server_cert, &server_key, &ca)),
    );
    let text = std::fs::read_to_string(&agent.config).unwrap();
    let ca_line = format!("ca = \"{}\"\n", ca.display());
    std::fs::write(
        &agent.config,
        text.replace(&ca_line, &format!("{ca_line}renew_every = \"1s\"\n")),
    )
    .unwrap();
    agent.kill_and_restart();
    let (url, port) = (agent.url("vol"), agent.port);
    let p = |p: &PathBuf| p.to_str().unwrap().to_string();
    let copy_in = || {
        let args = [
            src.to_str().unwrap().to_string(),
            url.clone(),
            "--tls-ca".into(),
            p(&ca),
            "--tls-cert".into(),
            p(&client_cert),
            "--tls-key".into(),
            p(&client_key),
            "--tls-server-name".into(),
            "localhost".into(),
            "--retries".into(),
            "1".into(),
        ];
        let refs: Vec<&str> = args.iter().map(String::as_str).collect();
        json_of(&copy(t.path(), &refs));
    };
    copy_in();
    let presented = || served_certificate(port, &ca, &client_cert, &client_key);
    assert_eq!(
        presented(),
        fingerprint(&server_cert),
        "the agent's first certificate"
    );
    reissue_server_cert(t.path(), "good");
    let renewed = fingerprint(&server_cert);
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(15);
    while presented() != renewed {
        assert!(
            std::time::Instant::now() < deadline,
            "the renewed certificate was not presented within 15 s"
        );
        std::thread::sleep(std::time::Duration::from_millis(200));
    }
    assert!(
        agent.child.try_wait().unwrap().is_none(),
        "the agent restarted to renew its certificate"
    );
    // Calls go on with the renewed certificate.
    copy_in();
    assert_eq!(blake3_of(&src, 8 * MIB), blake3_of(&dst, 8 * MIB));
}

/// The SHA-256 fingerprint of the certificate the TLS server on 127.0.0.1:`port` presents
/// to a client with `cert` (openssl s_client).
fn served_certificate(port: u16, ca: &Path, cert: &Path, key: &Path) -> String {
    let mut shown = std::process::Command::new("openssl")
        .args([
            "s_client",
            "-connect",
            &format!("127.0.0.1:{port}"),
            "-alpn",
            "h2",
        ])
        .arg("-CAfile")
        .arg(ca)
        .arg("-cert")
        .arg(cert)
        .arg("-key")
        .arg(key)
        .stdin(std::process::Stdio::null())
        .output()
        .expect("openssl is needed by this test");
    let text = String::from_utf8_lossy(&shown.stdout).into_owned();
    let begin = "-----BEGIN CERTIFICATE-----";
    let end = "-----END CERTIFICATE-----";
    let Some(at) = text.find(begin) else {
        shown.stdout.clear();
        return format!("no certificate: {}", String::from_utf8_lossy(&shown.stderr));
    };
    let pem = &text[at..text[at..].find(end).map(|e| at + e + end.len()).unwrap()];
    let dir = tempfile::tempdir().unwrap();
    let file = dir.path().join("served.pem");
    std::fs::write(&file, pem).unwrap();
    fingerprint(&file)
}

/// `openssl x509 -fingerprint -sha256` of a PEM certificate file.
fn fingerprint(cert: &Path) -> String {
    let out = std::process::Command::new("openssl")
        .args(["x509", "-noout", "-fingerprint", "-sha256", "-in"])
        .arg(cert)
        .output()
        .expect("openssl is needed by this test");
    assert!(out.status.success(), "openssl x509 -in {}", cert.display());
    String::from_utf8_lossy(&out.stdout).trim().to_string()
}

#[test]
fn nbd_over_tcp_requires_tls_with_a_client_certificate_from_the_ca() {
    let t = tempfile::tempdir().unwrap();
    let [ca, server_cert, server_key, client_cert, client_key] = make_pki(t.path(), "good");
    let [_, _, _, rogue_cert, rogue_key] = make_pki(t.path(), "rogue");
    let img = t.path().join("vol.img");
    make_image(&img, 8 * MIB, 46, &[(0, 3 * MIB), (6 * MIB, MIB)]);
    let nbd_port = common::agent::free_port();
    let _agent = Agent::start_with_settings(
        t.path(),
        &[("vol", &img, false)],
        Some((&server_cert, &server_key, &ca)),
        &format!("nbd_listen = \"127.0.0.1:{nbd_port}\""),
    );
    // libnbd's certificate directory: the CA and this client's certificate and key.
    let certs = |name: &str, cert: &Path, key: &Path| {
        let dir = t.path().join(name);
        std::fs::create_dir_all(&dir).unwrap();
        std::fs::copy(&ca, dir.join("ca-cert.pem")).unwrap();
        std::fs::copy(cert, dir.join("client-cert.pem")).unwrap();
        std::fs::copy(key, dir.join("client-key.pem")).unwrap();
        dir
    };
    let good = certs("good-certs", &client_cert, &client_key);
    let rogue = certs("rogue-certs", &rogue_cert, &rogue_key);
    let uri = |certs: &Path| {
        format!(
            "nbds://127.0.0.1:{nbd_port}/vol?tls-certificates={}",
            certs.display()
        )
    };
    let run = |cmd: &str, args: &[&str]| {
        let deadline = Instant::now() + Duration::from_secs(20);
        loop {
            let out = std::process::Command::new(cmd).args(args).output().unwrap();
            // The agent may still be binding its NBD listener.
            let refused = String::from_utf8_lossy(&out.stderr).contains("Connection refused");
            if !refused || Instant::now() > deadline {
                return out;
            }
            std::thread::sleep(Duration::from_millis(100));
        }
    };

    // A client of the CA reads the volume over TLS: every byte equals the image's.
    let copy = t.path().join("copy.img");
    let out = run("nbdcopy", &[&uri(&good), copy.to_str().unwrap()]);
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    assert_eq!(blake3_of(&copy, 8 * MIB), blake3_of(&img, 8 * MIB));

    // Without TLS, or with a certificate from another CA: nothing is served.
    let plain = run("nbdinfo", &[&format!("nbd://127.0.0.1:{nbd_port}/vol")]);
    // (libnbd reports NBD_REP_ERR_TLS_REQD as "Operation not supported".)
    assert!(
        !plain.status.success(),
        "a client without TLS must be refused"
    );
    let out = run("nbdinfo", &[&uri(&rogue)]);
    assert!(
        !out.status.success(),
        "a client certificate from another CA must be refused"
    );
}

/// Starts a push of a large image, lets a good part arrive, then calls `interrupt`.
fn push_in_background(t: &Path, src: &Path, url: &str, retries: &str) -> Child {
    copy_command(t, &[src.to_str().unwrap(), url, "--retries", retries])
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::null())
        .spawn()
        .unwrap()
}

fn wait_until_written(child: &mut Child, dst: &Path, bytes: u64) {
    let deadline = Instant::now() + Duration::from_secs(120);
    while !(dst.exists() && allocated(dst) >= bytes) {
        assert!(
            child.try_wait().unwrap().is_none(),
            "transfer finished before it could be interrupted"
        );
        assert!(Instant::now() < deadline, "transfer made no progress");
        std::thread::sleep(Duration::from_millis(2));
    }
}

fn partial_of(dst: &Path) -> PathBuf {
    dst.with_file_name(format!(
        ".{}.mover-partial",
        dst.file_name().unwrap().to_string_lossy()
    ))
}

#[test]
fn killed_receiver_or_sender_resumes_without_resending_what_arrived() {
    let t = tempfile::tempdir().unwrap();
    let src = t.path().join("src.img");
    let dst = t.path().join("dst.img");
    let len = 384 * MIB;
    make_image(&src, len, 46, &[(0, len)]);
    let mut agent = Agent::start(t.path(), &[("vol", &dst, false)], None);

    // kill -9 of the receiving agent.
    let mut push = push_in_background(t.path(), &src, &agent.url("vol"), "1");
    wait_until_written(&mut push, &partial_of(&dst), 64 * MIB);
    agent.kill_and_restart();
    assert!(
        !push.wait().unwrap().success(),
        "the push must fail when its agent dies"
    );
    let arrived = allocated(&partial_of(&dst));

    // kill -9 of the sender, on the resumed transfer.
    let mut push = push_in_background(t.path(), &src, &agent.url("vol"), "1");
    wait_until_written(&mut push, &partial_of(&dst), arrived + 64 * MIB);
    push.kill().unwrap();
    push.wait().unwrap();
    assert!(
        !dst.exists(),
        "an unfinished transfer never appears under the final name"
    );
    let arrived = allocated(&partial_of(&dst));
    assert!(arrived < len);

    let j = json_of(&copy(
        t.path(),
        &[src.to_str().unwrap(), &agent.url("vol"), "--verify"],
    ));
    assert_eq!(blake3_of(&src, len), blake3_of(&dst, len));
    let resent = j["bytes_written"].as_u64().unwrap();
    assert!(
        resent <= len - arrived + 16 * MIB,
        "re-sent {resent} bytes though {arrived} had arrived"
    );
}

/// A TCP proxy that forwards to `to` and, once `cut_after` bytes went client → server
/// (over all its connections, as a push spreads its streams over several), cuts every
/// connection open at that moment; connections made after the cut pass untouched.
fn cutting_proxy(to: u16, cut_after: u64) -> u16 {
    let listener = TcpListener::bind("127.0.0.1:0").unwrap();
    let port = listener.local_addr().unwrap().port();
    let cut = Arc::new(Cut {
        sent: AtomicU64::new(0),
        limit: cut_after,
        before: Mutex::new(Some(Vec::new())),
    });
    std::thread::spawn(move || {
        for conn in listener.incoming() {
            let Ok(client) = conn else { return };
            let server = TcpStream::connect(("127.0.0.1", to)).unwrap();
            let counted = match cut.before.lock().unwrap().as_mut() {
                Some(open) => {
                    open.push(client.try_clone().unwrap());
                    open.push(server.try_clone().unwrap());
                    Some(cut.clone())
                }
                None => None,
            };
            let (c2, s2) = (client.try_clone().unwrap(), server.try_clone().unwrap());
            std::thread::spawn(move || pump(client, server, counted));
            std::thread::spawn(move || pump(s2, c2, None));
        }
    });
    port
}

/// The cut of [`cutting_proxy`]: bytes sent so far, and the connections to cut (`None`
/// once cut).
struct Cut {
    sent: AtomicU64,
    limit: u64,
    before: Mutex<Option<Vec<TcpStream>>>,
}

fn pump(mut from: TcpStream, mut to: TcpStream, cut: Option<Arc<Cut>>) {
    let mut buf = vec![0u8; 1 << 16];
    while let Ok(n) = from.read(&mut buf) {
        if n == 0 || to.write_all(&buf[..n]).is_err() {
            break;
        }
        if let Some(cut) = &cut
            && cut.sent.fetch_add(n as u64, SeqCst) + n as u64 >= cut.limit
        {
            for s in cut.before.lock().unwrap().take().unwrap_or_default() {
                let _ = s.shutdown(std::net::Shutdown::Both);
            }
            break;
        }
    }
    let _ = from.shutdown(std::net::Shutdown::Both);
    let _ = to.shutdown(std::net::Shutdown::Both);
}

#[test]
fn a_cut_connection_is_retried_and_continues() {
    let t = tempfile::tempdir().unwrap();
    let src = t.path().join("src.img");
    let dst = t.path().join("dst.img");
    let len = 128 * MIB;
    make_image(&src, len, 47, &[(0, len)]);
    let agent = Agent::start(t.path(), &[("vol", &dst, false)], None);
    let cut = 80 * MIB;
    let proxy = cutting_proxy(agent.port, cut);
    let url = format!("agent://127.0.0.1:{proxy}/vol");
    let j = json_of(&copy(
        t.path(),
        &[src.to_str().unwrap(), &url, "--verify", "--retries", "5"],
    ));
    assert_eq!(blake3_of(&src, len), blake3_of(&dst, len));
    // The summary is the last attempt's: it re-sent at most what was in flight at the
    // cut (a stream window on each of the four streams' connections, plus the agent's
    // write queue of 16 frames of up to a chunk) besides what had not been sent at all.
    let in_flight = 4 * u64::from(transport::STREAM_WINDOW) + 16 * MIB;
    let last = j["bytes_written"].as_u64().unwrap();
    assert!(
        last <= len - cut + in_flight,
        "the retry re-sent {last} of {len} bytes"
    );
}

#[test]
fn bwlimit_caps_the_rate_on_the_wire() {
    let t = tempfile::tempdir().unwrap();
    let src = t.path().join("src.img");
    let dst = t.path().join("dst.img");
    make_image(&src, 24 * MIB, 48, &[(0, 24 * MIB)]);
    let agent = Agent::start(t.path(), &[("vol", &dst, false)], None);
    let started = Instant::now();
    let j = json_of(&copy(
        t.path(),
        &[src.to_str().unwrap(), &agent.url("vol"), "--bwlimit", "8M"],
    ));
    let took = started.elapsed().as_secs_f64();
    assert_eq!(blake3_of(&src, 24 * MIB), blake3_of(&dst, 24 * MIB));
    // 24 MiB of incompressible data at 8 MiB/s with an 8 MiB burst: at least 2 s.
    assert_eq!(j["wire_bytes"], 24 * MIB);
    assert!(took >= 1.9, "24 MiB at --bwlimit 8M took only {took:.2}s");
}

/// The agent's count of sessions summarised from a saved chunk index.
fn indexed_opens(agent: &Agent) -> u64 {
    agent.metric("mover_agent_indexed_opens_total")
}

/// Bytes the agent read from volumes to hash pages for deltas.
fn page_reads(agent: &Agent) -> u64 {
    agent.metric("mover_agent_page_hash_read_bytes_total")
}

#[test]
fn a_repeat_push_compares_against_the_agents_saved_index_unless_the_volume_changed() {
    let t = tempfile::tempdir().unwrap();
    let src = t.path().join("src.img");
    let dst = t.path().join("dst.img");
    let len = 40 * MIB;
    make_image(&src, len, 50, &[(0, 30 * MIB)]);
    let agent = Agent::start(t.path(), &[("vol", &dst, false)], None);
    let s = src.to_str().unwrap();

    // A new image: nothing to read, and the pushed ids become its index.
    std::fs::copy(&src, t.path().join("orig.img")).unwrap();
    json_of(&copy(t.path(), &[s, &agent.url("vol")]));
    assert_eq!(blake3_of(&src, len), blake3_of(&dst, len));
    assert_eq!(indexed_opens(&agent), 0);

    // The new image's pages are hashed in the background once the copy is done.
    let deadline = Instant::now() + Duration::from_secs(60);
    while agent.metric("mover_agent_page_hashing_active") > 0 {
        assert!(
            Instant::now() < deadline,
            "the background hashing never ends"
        );
        std::thread::sleep(Duration::from_millis(50));
    }

    // Untouched since: the next push is compared against the index, and the page
    // hashes of the chunks that differ come from the record: nothing is read.
    let changed = scribble_pages(&src, 51, 200, 0..30 * MIB);
    let j = json_of(&copy(t.path(), &[s, &agent.url("vol"), "--verify"]));
    assert_eq!(blake3_of(&src, len), blake3_of(&dst, len));
    assert_eq!(
        j["bytes_written"],
        changed * PAGE,
        "exactly the changed pages"
    );
    assert_eq!(indexed_opens(&agent), 1);
    assert_eq!(page_reads(&agent), 0, "no page was read to be hashed");
    assert!(agent.metric("mover_agent_page_hashes_known_total") >= changed);

    // Back to the original: the same chunks differ again, and the pages the last push
    // wrote were hashed as it wrote them.
    std::fs::copy(t.path().join("orig.img"), &src).unwrap();
    let j = json_of(&copy(t.path(), &[s, &agent.url("vol"), "--verify"]));
    assert_eq!(blake3_of(&src, len), blake3_of(&dst, len));
    assert_eq!(j["bytes_written"], changed * PAGE);
    assert_eq!(indexed_opens(&agent), 2);
    assert_eq!(page_reads(&agent), 0, "no page was read to be hashed");

    // Changed behind the agent's back: the index no longer describes it, so the agent
    // hashes it again, and the damage is repaired.
    let damaged = scribble_pages(&dst, 52, 30, 0..len);
    let j = json_of(&copy(t.path(), &[s, &agent.url("vol"), "--verify"]));
    assert_eq!(blake3_of(&src, len), blake3_of(&dst, len));
    assert_eq!(indexed_opens(&agent), 2, "a stale index is not used");
    assert!(
        page_reads(&agent) > 0,
        "stale page hashes are not used either"
    );
    assert!(
        j["bytes_written"].as_u64().unwrap() + j["bytes_zeroed"].as_u64().unwrap()
            <= damaged * PAGE
    );
    assert!(j["bytes_written"].as_u64().unwrap() > 0);

    // A push cut short leaves no index behind (it is dropped when a writer opens the
    // volume), so the next push compares the volume in full.
    let j = json_of(&copy(t.path(), &[s, &agent.url("vol")]));
    assert_eq!(j["bytes_written"], 0);
    assert_eq!(indexed_opens(&agent), 3);
    make_image(&src, len, 53, &[(0, 30 * MIB)]);
    let mut push = copy_command(t.path(), &[s, &agent.url("vol"), "--bwlimit", "4M"])
        .spawn()
        .unwrap();
    std::thread::sleep(Duration::from_millis(1500));
    assert!(
        push.try_wait().unwrap().is_none(),
        "the push must still be running"
    );
    push.kill().unwrap();
    push.wait().unwrap();
    let (before, reads_before) = (indexed_opens(&agent), page_reads(&agent));
    let j = json_of(&copy(t.path(), &[s, &agent.url("vol"), "--verify"]));
    assert_eq!(blake3_of(&src, len), blake3_of(&dst, len));
    assert_eq!(j["verified"], true);
    assert_eq!(
        indexed_opens(&agent),
        before,
        "no index survives an interrupted push"
    );
    assert!(
        page_reads(&agent) > reads_before,
        "nor do its page hashes: the pages are read"
    );
}

#[test]
fn compress_never_sends_raw_and_always_compresses() {
    let t = tempfile::tempdir().unwrap();
    let src = t.path().join("src.img");
    let len = 16 * MIB;
    // Compressible data: text.
    let text = b"mover moves volume data between agents. ".repeat((12 * MIB / 41) as usize);
    let f = std::fs::File::create(&src).unwrap();
    f.set_len(len).unwrap();
    std::os::unix::fs::FileExt::write_all_at(&f, &text, 0).unwrap();
    let written = text.len() as u64;
    let (raw, zstd) = (t.path().join("raw.img"), t.path().join("zstd.img"));
    let agent = Agent::start(
        t.path(),
        &[("raw", &raw, false), ("zstd", &zstd, false)],
        None,
    );
    let s = src.to_str().unwrap();

    let j = json_of(&copy(
        t.path(),
        &[s, &agent.url("raw"), "--compress", "never"],
    ));
    assert_eq!(blake3_of(&src, len), blake3_of(&raw, len));
    assert_eq!(
        j["wire_bytes"].as_u64().unwrap(),
        written.div_ceil(PAGE) * PAGE
    );
    let j = json_of(&copy(
        t.path(),
        &[s, &agent.url("zstd"), "--compress", "always"],
    ));
    assert_eq!(blake3_of(&src, len), blake3_of(&zstd, len));
    assert!(j["wire_bytes"].as_u64().unwrap() < written / 10, "{j}");

    // Pulled back: raw unless asked otherwise, the same bytes either way.
    let back = t.path().join("back.img");
    let b = back.to_str().unwrap();
    let j = json_of(&copy(
        t.path(),
        &[&agent.url("zstd"), b, "--verify", "--compress", "never"],
    ));
    assert_eq!(blake3_of(&src, len), blake3_of(&back, len));
    assert!(j["wire_bytes"].as_u64().unwrap() >= written);
    std::fs::remove_file(&back).unwrap();
    let j = json_of(&copy(
        t.path(),
        &[&agent.url("zstd"), b, "--verify", "--compress", "always"],
    ));
    assert_eq!(blake3_of(&src, len), blake3_of(&back, len));
    assert!(j["wire_bytes"].as_u64().unwrap() < written / 10, "{j}");
}

#[test]
fn an_agent_whose_port_was_taken_meanwhile_starts_on_fresh_ports() {
    let t = tempfile::tempdir().unwrap();
    let vol = t.path().join("vol.img");
    std::fs::File::create(&vol)
        .unwrap()
        .set_len(1 << 20)
        .unwrap();
    let first = Agent::start(t.path(), &[("vol", &vol, false)], None);
    let (config, port, metrics_port) = (first.config.clone(), first.port, first.metrics_port);
    drop(first);
    // Someone else takes the metrics port between the pick and the agent's bind.
    let taken = std::net::TcpListener::bind(("127.0.0.1", metrics_port)).unwrap();
    let agent = Agent::spawn(config, port, metrics_port);
    assert_ne!(agent.metrics_port, metrics_port, "moved off the taken port");
    assert!(
        agent.http_get("/metrics").contains("mover_"),
        "the agent serves"
    );
    drop(taken);
}

/// GET /healthz from the agent's metrics port: (status line, body).
fn healthz(agent: &Agent) -> (String, String) {
    let mut s = TcpStream::connect(("127.0.0.1", agent.metrics_port)).unwrap();
    write!(
        s,
        "GET /healthz HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n"
    )
    .unwrap();
    let mut out = String::new();
    s.read_to_string(&mut out).unwrap();
    let (head, body) = out.split_once("\r\n\r\n").unwrap_or((&out, ""));
    (
        head.lines().next().unwrap_or("").to_string(),
        body.to_string(),
    )
}

#[test]
fn healthz_fails_at_once_when_the_state_directory_turns_read_only() {
    if !rustix::process::geteuid().is_root() {
        return skip_unless_ci("mounting the state directory's file system needs root");
    }
    let dir = tempfile::tempdir().unwrap();
    let state = dir.path().join("agent-state");
    std::fs::create_dir_all(&state).unwrap();
    let mount = |args: &[&str]| {
        let out = std::process::Command::new("mount")
            .args(args)
            .arg(&state)
            .output()
            .unwrap();
        assert!(out.status.success(), "mount {args:?}: {out:?}");
    };
    mount(&["-t", "tmpfs", "-o", "size=16m", "tmpfs"]);
    struct Unmount(PathBuf);
    impl Drop for Unmount {
        fn drop(&mut self) {
            let _ = std::process::Command::new("umount")
                .arg("-l")
                .arg(&self.0)
                .status();
        }
    }
    let _unmount = Unmount(state.clone());
    let image = dir.path().join("data.img");
    make_image(&image, MIB, 3, &[(0, MIB)]);
    let agent = Agent::start(dir.path(), &[("data", &image, false)], None);
    assert_eq!(healthz(&agent), ("HTTP/1.1 200 OK".into(), "ok\n".into()));

    // The disk under the state directory goes read-only (as ext4 does on an I/O error):
    // the next probe says so, and the DaemonSet's liveness probe restarts the agent.
    mount(&["-o", "remount,ro"]);
    let asked = Instant::now();
    let (status, body) = healthz(&agent);
    assert_eq!(status, "HTTP/1.1 503 Service Unavailable", "{body}");
    assert!(
        body.contains("state directory") && body.contains("not writable"),
        "{body}"
    );
    assert!(
        asked.elapsed() < Duration::from_secs(6),
        "{:?}",
        asked.elapsed()
    );
    mount(&["-o", "remount,rw"]);
    assert_eq!(healthz(&agent).0, "HTTP/1.1 200 OK");
}

/// A device whose file system is mounted (a pod's, on a Block volume) is served for
/// reading, as a primary's cycles read it live; a write into it is refused, and names
/// the mount, while it stays mounted.
#[test]
fn a_mounted_device_is_read_but_never_written() {
    if !common::tree::is_root() {
        return skip_unless_ci("loop devices and mounts need root");
    }
    let t = tempfile::tempdir().unwrap();
    let fs = ScratchFs::new("ext4", 32 * MIB);
    std::fs::write(fs.path().join("file"), b"written by the device's user").unwrap();
    let dev = fs.device();
    let agent = Agent::start(t.path(), &[("busy", dev, false)], None);

    let copied = t.path().join("copy.img");
    json_of(&copy(
        t.path(),
        &[&agent.url("busy"), copied.to_str().unwrap()],
    ));
    assert_eq!(
        blake3_of(&copied, 32 * MIB),
        blake3_of(dev, 32 * MIB),
        "the mounted device read whole"
    );

    let src = t.path().join("src.img");
    make_image(&src, 32 * MIB, 45, &[(0, 32 * MIB)]);
    let before = blake3_of(dev, 32 * MIB);
    let out = copy(t.path(), &[src.to_str().unwrap(), &agent.url("busy")]);
    let err = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(2), "{err}");
    assert!(
        err.contains("mounted at") && err.contains(fs.path().to_str().unwrap()),
        "the refusal names the mount: {err}"
    );
    assert_eq!(blake3_of(dev, 32 * MIB), before, "nothing written");
}
