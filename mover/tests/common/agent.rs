//! A real `mover agent` process for the tests, and `mover copy` with its token.

use std::{
    net::{TcpListener, TcpStream},
    path::{Path, PathBuf},
    process::{Child, Command},
    time::{Duration, Instant},
};

pub const TOKEN: &str = "t0ken-for-tests";

/// A `mover agent` child process, killed on drop.
pub struct Agent {
    pub child: Child,
    pub port: u16,
    pub metrics_port: u16,
    pub config: PathBuf,
}

pub fn free_port() -> u16 {
    TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port()
}

/// Two different free ports: [`free_port`] may give back one it gave just before, once it
/// is released, and an agent on one port twice exits at once.
fn two_free_ports() -> (u16, u16) {
    let first = TcpListener::bind("127.0.0.1:0").unwrap();
    let second = TcpListener::bind("127.0.0.1:0").unwrap();
    (
        first.local_addr().unwrap().port(),
        second.local_addr().unwrap().port(),
    )
}

/// A port of 127.0.0.1 that refuses connections for as long as the returned socket lives:
/// bound, not listening, and without SO_REUSEADDR, so no agent of a test running beside
/// can listen on it (a port [`free_port`] found free could be taken).
pub fn refusing_port() -> (u16, rustix::fd::OwnedFd) {
    use rustix::net::{AddressFamily, SocketType, bind, getsockname, socket};
    let socket = socket(AddressFamily::INET, SocketType::STREAM, None).unwrap();
    bind(&socket, &std::net::SocketAddr::from(([127, 0, 0, 1], 0))).unwrap();
    let bound = std::net::SocketAddr::try_from(getsockname(&socket).unwrap()).unwrap();
    (bound.port(), socket)
}

impl Agent {
    /// Starts an agent exporting `exports` (name, path, read_only) with token auth and,
    /// if given, mutual TLS from `tls` (cert, key, ca).
    pub fn start(
        dir: &Path,
        exports: &[(&str, &Path, bool)],
        tls: Option<(&Path, &Path, &Path)>,
    ) -> Agent {
        Agent::start_with_settings(dir, exports, tls, "")
    }

    /// Starts an agent like [`Agent::start`], with `settings` (top-level agent.toml
    /// lines, e.g. `nbd_listen = "…"`) added to its config.
    pub fn start_with_settings(
        dir: &Path,
        exports: &[(&str, &Path, bool)],
        tls: Option<(&Path, &Path, &Path)>,
        settings: &str,
    ) -> Agent {
        let (config, port, metrics_port) = Agent::configure(dir, exports, tls);
        let text = std::fs::read_to_string(&config).unwrap();
        std::fs::write(&config, format!("{settings}\n{text}")).unwrap();
        Agent::spawn(config, port, metrics_port)
    }

    /// Starts an agent like [`Agent::start`] (no TLS), with extra environment variables.
    pub fn start_with_env(
        dir: &Path,
        exports: &[(&str, &Path, bool)],
        env: &[(&str, &str)],
    ) -> Agent {
        let (config, port, metrics_port) = Agent::configure(dir, exports, None);
        Agent::spawn_with_env(config, port, metrics_port, env)
    }

    /// Writes an agent config; returns it with the ports it listens on.
    pub fn configure(
        dir: &Path,
        exports: &[(&str, &Path, bool)],
        tls: Option<(&Path, &Path, &Path)>,
    ) -> (PathBuf, u16, u16) {
        let (port, metrics_port) = two_free_ports();
        std::fs::write(dir.join("token"), TOKEN).unwrap();
        let mut cfg = format!(
            "listen = \"127.0.0.1:{port}\"\nmetrics_listen = \"127.0.0.1:{metrics_port}\"\nstate_dir = \"{}\"\ntoken_file = \"{}\"\n",
            dir.join("agent-state").display(),
            dir.join("token").display()
        );
        // No exports: the agent serves what the controller registers under `dir`. (A
        // top-level key: before the first table.)
        if exports.is_empty() {
            cfg += &format!("volume_roots = [\"{}\"]\n", dir.display());
        }
        if let Some((cert, key, ca)) = tls {
            cfg += &format!(
                "[tls]\ncert = \"{}\"\nkey = \"{}\"\nca = \"{}\"\n",
                cert.display(),
                key.display(),
                ca.display()
            );
        }
        for (name, path, ro) in exports {
            cfg += &format!(
                "[exports.{name}]\npath = \"{}\"\nread_only = {ro}\n",
                path.display()
            );
        }
        let config = dir.join(format!("agent-{port}.toml"));
        std::fs::write(&config, cfg).unwrap();
        (config, port, metrics_port)
    }

    pub fn spawn(config: PathBuf, port: u16, metrics_port: u16) -> Agent {
        Agent::spawn_with_env(config, port, metrics_port, &[])
    }

    /// Starts the agent of `config` and waits until it listens on both of its ports.
    ///
    /// A port [`free_port`] picked can be taken (by another test's agent or outgoing
    /// connection) before the agent binds it; the agent then exits at once. It is started
    /// again on fresh ports, written into `config`, twice at most.
    pub fn spawn_with_env(
        config: PathBuf,
        mut port: u16,
        mut metrics_port: u16,
        env: &[(&str, &str)],
    ) -> Agent {
        let listening = |p: u16| TcpStream::connect(("127.0.0.1", p)).is_ok();
        for attempt in 1..=3 {
            let mut child = Command::new(env!("CARGO_BIN_EXE_mover"))
                .args(["agent", "--config", config.to_str().unwrap()])
                .env(
                    "RUST_LOG",
                    std::env::var("MOVER_TEST_AGENT_LOG").unwrap_or_else(|_| "warn".into()),
                )
                .envs(env.iter().copied())
                .spawn()
                .unwrap();
            let deadline = Instant::now() + Duration::from_secs(20);
            let exited = loop {
                if let Some(status) = child.try_wait().unwrap() {
                    break status;
                }
                // The metrics port is bound last: both answering means the agent is up.
                if listening(port) && listening(metrics_port) {
                    return Agent {
                        child,
                        port,
                        metrics_port,
                        config,
                    };
                }
                assert!(Instant::now() < deadline, "agent did not start listening");
                std::thread::sleep(Duration::from_millis(20));
            };
            eprintln!("agent exited before listening ({exited}), attempt {attempt}: new ports");
            let (new_port, new_metrics) = two_free_ports();
            let text = std::fs::read_to_string(&config)
                .unwrap()
                .replace(
                    &format!("127.0.0.1:{port}\""),
                    &format!("127.0.0.1:{new_port}\""),
                )
                .replace(
                    &format!("127.0.0.1:{metrics_port}\""),
                    &format!("127.0.0.1:{new_metrics}\""),
                );
            std::fs::write(&config, text).unwrap();
            (port, metrics_port) = (new_port, new_metrics);
        }
        panic!("agent exited before listening three times");
    }

    /// The value of the agent's counter or gauge `name` on /metrics.
    pub fn metric(&self, name: &str) -> u64 {
        let metrics = self.http_get("/metrics");
        metrics
            .lines()
            .find_map(|l| l.strip_prefix(name)?.strip_prefix(' '))
            .unwrap_or_else(|| panic!("{name} is exported: {metrics}"))
            .trim()
            .parse()
            .unwrap()
    }

    /// GET `path` from the agent's metrics port; returns the body.
    pub fn http_get(&self, path: &str) -> String {
        super::http_get(&format!("127.0.0.1:{}", self.metrics_port), path)
    }

    /// kill -9, then start again on the same port and config.
    pub fn kill_and_restart(&mut self) {
        self.child.kill().unwrap();
        self.child.wait().unwrap();
        let fresh = Agent::spawn(self.config.clone(), self.port, self.metrics_port);
        let old = std::mem::replace(self, fresh);
        std::mem::forget(old); // already dead
    }

    pub fn url(&self, volume: &str) -> String {
        format!("agent://127.0.0.1:{}/{volume}", self.port)
    }
}

impl Drop for Agent {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// `mover copy ARGS --json --no-progress` with the test token and `state` as its state
/// directory, to run or spawn.
pub fn copy_command(state: &Path, args: &[&str]) -> Command {
    let mut cmd = Command::new(env!("CARGO_BIN_EXE_mover"));
    cmd.arg("copy")
        .args(args)
        .args(["--json", "--no-progress"])
        .env("MOVER_STATE_DIR", state)
        .env("MOVER_TOKEN", TOKEN)
        .env("RUST_LOG", "warn");
    cmd
}

/// Runs `mover copy` (see [`copy_command`]).
pub fn copy(state: &Path, args: &[&str]) -> std::process::Output {
    copy_command(state, args).output().unwrap()
}

/// `mover replicate ARGS` with the test token.
pub fn replicate(args: &[&str]) -> std::process::Output {
    Command::new(env!("CARGO_BIN_EXE_mover"))
        .arg("replicate")
        .args(args)
        .env("MOVER_TOKEN", TOKEN)
        .env("RUST_LOG", "warn")
        .output()
        .unwrap()
}

/// `mover hydrate ARGS` with the test token.
pub fn hydrate(args: &[&str]) -> std::process::Output {
    Command::new(env!("CARGO_BIN_EXE_mover"))
        .arg("hydrate")
        .args(args)
        .env("MOVER_TOKEN", TOKEN)
        .env("RUST_LOG", "warn")
        .output()
        .unwrap()
}

/// `agent://127.0.0.1:PORT`: how `mover replicate` reaches `agent`'s control API.
pub fn control(agent: &Agent) -> String {
    format!("agent://127.0.0.1:{}", agent.port)
}

/// The stdout of a `mover` run that must succeed.
pub fn ok(out: std::process::Output) -> String {
    assert!(
        out.status.success(),
        "mover failed: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    String::from_utf8_lossy(&out.stdout).into_owned()
}

/// Waits until `name`'s status on `agent` satisfies `cond` (60 s at most).
pub fn wait_for(agent: &Agent, name: &str, what: &str, cond: impl Fn(&serde_json::Value) -> bool) {
    let deadline = Instant::now() + Duration::from_secs(60);
    loop {
        let s = status_of(agent, name);
        if cond(&s) {
            return;
        }
        assert!(Instant::now() < deadline, "waited for {what}: {s}");
        std::thread::sleep(Duration::from_millis(100));
    }
}

/// `mover replicate status NAME --json` on `agent`.
pub fn status_of(agent: &Agent, name: &str) -> serde_json::Value {
    let out = ok(replicate(&[
        "status",
        name,
        "--json",
        "--agent",
        &control(agent),
    ]));
    serde_json::from_str(&out).unwrap()
}

/// `mover hydrate status EXPORT --json` on `agent`.
pub fn hydration_status(agent: &Agent, export: &str) -> serde_json::Value {
    let out = ok(hydrate(&[
        "status",
        export,
        "--json",
        "--agent",
        &control(agent),
    ]));
    serde_json::from_str(&out).unwrap()
}

/// Writes a CA and two leaf certificates (server for 127.0.0.1/localhost, client) as PEM
/// files; returns (ca, server cert, server key, client cert, client key).
pub fn make_pki(dir: &Path, name: &str) -> [PathBuf; 5] {
    use rcgen::{BasicConstraints, CertificateParams, IsCa, Issuer, KeyPair};
    let ca_key = KeyPair::generate().unwrap();
    let mut ca_params = CertificateParams::new(Vec::<String>::new()).unwrap();
    ca_params.is_ca = IsCa::Ca(BasicConstraints::Unconstrained);
    let ca_cert = ca_params.self_signed(&ca_key).unwrap();
    let issuer = Issuer::new(ca_params, ca_key);
    let leaf = |sans: Vec<String>| {
        let key = KeyPair::generate().unwrap();
        let cert = CertificateParams::new(sans)
            .unwrap()
            .signed_by(&key, &issuer)
            .unwrap();
        (cert.pem(), key.serialize_pem())
    };
    let (server_cert, server_key) = leaf(vec!["localhost".into(), "127.0.0.1".into()]);
    let (client_cert, client_key) = leaf(vec!["client".into()]);
    // For reissue_server_cert.
    std::fs::write(
        dir.join(format!("{name}-ca.key")),
        issuer.key().serialize_pem(),
    )
    .unwrap();
    let files = [
        "ca.pem",
        "server.pem",
        "server.key",
        "client.pem",
        "client.key",
    ]
    .map(|f| dir.join(format!("{name}-{f}")));
    for (path, body) in files.iter().zip([
        ca_cert.pem(),
        server_cert,
        server_key,
        client_cert,
        client_key,
    ]) {
        std::fs::write(path, body).unwrap();
    }
    files
}

/// Writes a new server certificate and key over [`make_pki`]'s `name` ones, from the same
/// CA (as cert-manager renews one in place).
pub fn reissue_server_cert(dir: &Path, name: &str) {
    reissue(dir, name, "server", &["localhost", "127.0.0.1"]);
}

/// Writes a new client certificate and key over [`make_pki`]'s `name` ones, from the same
/// CA.
pub fn reissue_client_cert(dir: &Path, name: &str) {
    reissue(dir, name, "client", &["client"]);
}

fn reissue(dir: &Path, name: &str, leaf: &str, sans: &[&str]) {
    use rcgen::{CertificateParams, Issuer, KeyPair};
    let file = |f: &str| dir.join(format!("{name}-{f}"));
    let ca_key = KeyPair::from_pem(&std::fs::read_to_string(file("ca.key")).unwrap()).unwrap();
    let ca_pem = std::fs::read_to_string(file("ca.pem")).unwrap();
    let issuer = Issuer::from_ca_cert_pem(&ca_pem, ca_key).unwrap();
    let key = KeyPair::generate().unwrap();
    let cert = CertificateParams::new(sans.iter().map(|s| s.to_string()).collect::<Vec<_>>())
        .unwrap()
        .signed_by(&key, &issuer)
        .unwrap();
    // The key first, so that the pair on disk never mixes a new certificate with an old
    // key for longer than between the two writes (the agent refuses such a pair).
    std::fs::write(file(&format!("{leaf}.key")), key.serialize_pem()).unwrap();
    std::fs::write(file(&format!("{leaf}.pem")), cert.pem()).unwrap();
}
