//! A real Kubernetes control plane for the end-to-end tests: etcd, kube-apiserver and
//! kube-controller-manager built from their Go modules by `deploy/test-cluster/build.sh`,
//! started on 127.0.0.1 with certificates and a service-account key made here, and
//! stopped on drop.
//!
//! No kubelet and no scheduler run: where a test needs a node's part (a Node object, an
//! agent pod Running with an IP), it writes it through the API as the kubelet would, and
//! says so. Clusters with real nodes: `nodes.rs`.

use super::agent::free_port;
use std::{
    net::TcpStream,
    path::{Path, PathBuf},
    process::{Child, Command, Output, Stdio},
    time::{Duration, Instant},
};

/// Where `build.sh` puts the binaries unless `MOVER_KUBE_BIN` says otherwise.
const DEFAULT_BIN: &str = "/var/tmp/mover-kube/bin";

/// The directory holding kube-apiserver, kube-controller-manager, kubectl and etcd, or
/// `None` (after [`super::skip_unless_ci`]) when they are not built.
pub fn binaries() -> Option<PathBuf> {
    let dir = std::env::var_os("MOVER_KUBE_BIN")
        .map(PathBuf::from)
        .unwrap_or_else(|| PathBuf::from(DEFAULT_BIN));
    let missing: Vec<_> = [
        "etcd",
        "kube-apiserver",
        "kube-controller-manager",
        "kubectl",
    ]
    .into_iter()
    .filter(|b| !dir.join(b).is_file())
    .collect();
    if missing.is_empty() {
        return Some(dir);
    }
    super::skip_unless_ci(&format!(
        "{} not in {} (MOVER_KUBE_BIN): build them with deploy/test-cluster/build.sh",
        missing.join(", "),
        dir.display()
    ));
    None
}

/// One cluster's control plane; its processes are killed on drop.
pub struct Cluster {
    pub name: String,
    pub dir: PathBuf,
    pub bin: PathBuf,
    /// The API server's port on 127.0.0.1.
    pub port: u16,
    /// An admin kubeconfig (client certificate in system:masters).
    pub kubeconfig: PathBuf,
    etcd: Option<Child>,
    apiserver: Option<Child>,
    kcm: Option<Child>,
    etcd_port: u16,
}

impl Cluster {
    /// Starts etcd, the API server and the controller manager in `dir/<name>`; waits
    /// until the API server is ready. `None` when the binaries are missing (see
    /// [`binaries`]).
    pub fn start(dir: &Path, name: &str) -> Option<Cluster> {
        let bin = binaries()?;
        let dir = dir.join(name);
        std::fs::create_dir_all(&dir).unwrap();
        write_pki(&dir);
        let mut c = Cluster {
            name: name.into(),
            kubeconfig: dir.join("admin.kubeconfig"),
            dir,
            bin,
            port: free_port(),
            etcd: None,
            apiserver: None,
            kcm: None,
            etcd_port: free_port(),
        };
        c.write_kubeconfig(&c.kubeconfig, "admin");
        c.start_etcd();
        c.start_apiserver();
        c.start_controller_manager();
        Some(c)
    }

    fn spawn(&self, what: &str, program: &str, args: &[String]) -> Child {
        let log = std::fs::File::create(self.dir.join(format!("{what}.log"))).unwrap();
        Command::new(self.bin.join(program))
            .args(args)
            .stdout(log.try_clone().unwrap())
            .stderr(log)
            .spawn()
            .unwrap_or_else(|e| panic!("cannot start {program}: {e}"))
    }

    fn start_etcd(&mut self) {
        let peer = free_port();
        let client = format!("http://127.0.0.1:{}", self.etcd_port);
        let peer_url = format!("http://127.0.0.1:{peer}");
        let args = [
            format!("--data-dir={}", self.dir.join("etcd").display()),
            format!("--listen-client-urls={client}"),
            format!("--advertise-client-urls={client}"),
            format!("--listen-peer-urls={peer_url}"),
            format!("--initial-advertise-peer-urls={peer_url}"),
            format!("--initial-cluster=default={peer_url}"),
            // A test cluster: a crash loses it anyway.
            "--unsafe-no-fsync".into(),
            "--log-level=warn".into(),
        ];
        self.etcd = Some(self.spawn("etcd", "etcd", &args));
        self.wait_for("etcd", Duration::from_secs(30), |c| {
            TcpStream::connect(("127.0.0.1", c.etcd_port)).is_ok()
        });
    }

    /// Starts the API server and waits until `/readyz` says so.
    fn start_apiserver(&mut self) {
        let d = |f: &str| self.dir.join(f).display().to_string();
        let args = [
            format!("--etcd-servers=http://127.0.0.1:{}", self.etcd_port),
            "--bind-address=127.0.0.1".into(),
            format!("--secure-port={}", self.port),
            format!("--tls-cert-file={}", d("apiserver.crt")),
            format!("--tls-private-key-file={}", d("apiserver.key")),
            format!("--client-ca-file={}", d("ca.crt")),
            "--service-account-issuer=https://kubernetes.default.svc.cluster.local".into(),
            format!("--service-account-key-file={}", d("sa.pub")),
            format!("--service-account-signing-key-file={}", d("sa.key")),
            "--service-cluster-ip-range=10.96.0.0/16".into(),
            "--authorization-mode=Node,RBAC".into(),
            // The agent DaemonSet is privileged (block devices, FIFREEZE), as kubeadm's
            // and most clusters' API servers allow.
            "--allow-privileged=true".into(),
            // The `kubernetes` Service's endpoint would be 127.0.0.1, which Endpoints
            // refuse; nothing here reaches the API server through it.
            "--endpoint-reconciler-type=none".into(),
            "--profiling=false".into(),
            format!("--audit-policy-file={}", d("audit-policy.yaml")),
            format!("--audit-log-path={}", d("audit.log")),
            "--v=1".into(),
        ];
        std::fs::write(self.dir.join("audit-policy.yaml"), AUDIT_POLICY).unwrap();
        self.apiserver = Some(self.spawn("kube-apiserver", "kube-apiserver", &args));
        self.wait_for("kube-apiserver /readyz", Duration::from_secs(90), |c| {
            c.kubectl(&["get", "--raw", "/readyz"]).status.success()
        });
    }

    fn start_controller_manager(&mut self) {
        let d = |f: &str| self.dir.join(f).display().to_string();
        let args = [
            format!("--kubeconfig={}", self.kubeconfig.display()),
            "--leader-elect=false".into(),
            // No serving port: nothing scrapes it here.
            "--secure-port=0".into(),
            format!("--service-account-private-key-file={}", d("sa.key")),
            format!("--root-ca-file={}", d("ca.crt")),
            "--v=1".into(),
        ];
        self.kcm = Some(self.spawn("kube-controller-manager", "kube-controller-manager", &args));
        // Its service-account controller makes `default` in every namespace: pods
        // cannot be created before it runs.
        self.wait_for(
            "the default service account",
            Duration::from_secs(60),
            |c| {
                c.kubectl(&["get", "serviceaccount", "default", "-n", "default"])
                    .status
                    .success()
            },
        );
    }

    fn wait_for(&self, what: &str, within: Duration, ready: impl Fn(&Cluster) -> bool) {
        let deadline = Instant::now() + within;
        while !ready(self) {
            if Instant::now() > deadline {
                panic!(
                    "cluster {}: {what} not ready within {within:?}\n{}",
                    self.name,
                    self.logs()
                );
            }
            std::thread::sleep(Duration::from_millis(200));
        }
    }

    /// The last lines of every component's log, for a failure message.
    pub fn logs(&self) -> String {
        log_tails(
            &self.dir,
            ["etcd", "kube-apiserver", "kube-controller-manager"],
        )
    }

    /// Runs kubectl as the admin.
    pub fn kubectl(&self, args: &[&str]) -> Output {
        self.kubectl_as(&self.kubeconfig, args, None)
    }

    /// Runs kubectl with `kubeconfig`, `stdin` fed to it.
    pub fn kubectl_as(&self, kubeconfig: &Path, args: &[&str], stdin: Option<&str>) -> Output {
        run_kubectl(&self.bin, kubeconfig, args, stdin)
    }

    /// Runs kubectl as the admin and returns its stdout; panics with its stderr if it
    /// fails.
    pub fn kubectl_ok(&self, args: &[&str]) -> String {
        ok(self.kubectl(args), args)
    }

    /// `kubectl apply --server-side` of `yaml`, as the admin.
    pub fn apply(&self, yaml: &str) -> String {
        let args = ["apply", "--server-side", "--force-conflicts", "-f", "-"];
        ok(self.kubectl_as(&self.kubeconfig, &args, Some(yaml)), &args)
    }

    /// A kubeconfig at `path` for the client certificate `cert` (`CERT.crt`, `CERT.key`).
    fn write_kubeconfig(&self, path: &Path, cert: &str) {
        let user = format!(
            "client-certificate: {}\n    client-key: {}",
            self.dir.join(format!("{cert}.crt")).display(),
            self.dir.join(format!("{cert}.key")).display()
        );
        let text = format!(
            "apiVersion: v1\nkind: Config\nclusters:\n- name: {name}\n  cluster:\n    server: https://127.0.0.1:{port}\n    certificate-authority: {ca}\nusers:\n- name: user\n  user:\n    {user}\ncontexts:\n- name: {name}\n  context:\n    cluster: {name}\n    user: user\ncurrent-context: {name}\n",
            name = self.name,
            port = self.port,
            ca = self.dir.join("ca.crt").display(),
        );
        std::fs::write(path, text).unwrap();
    }

    /// A kube client for `kubeconfig`.
    pub async fn client_for(kubeconfig: &Path) -> kube::Client {
        let config = kube::config::Kubeconfig::read_from(kubeconfig).unwrap();
        let config = kube::Config::from_custom_kubeconfig(config, &Default::default())
            .await
            .unwrap();
        kube::Client::try_from(config).unwrap()
    }

    /// A kube client as the admin.
    pub async fn client(&self) -> kube::Client {
        Cluster::client_for(&self.kubeconfig).await
    }

    /// The API server's own count of requests (`apiserver_request_total`) whose labels
    /// contain every one of `labels` (e.g. `verb="PATCH"`, `resource="volumereplications"`).
    pub fn requests(&self, labels: &[&str]) -> u64 {
        let metrics = self.kubectl_ok(&["get", "--raw", "/metrics"]);
        metrics
            .lines()
            .filter(|l| l.starts_with("apiserver_request_total{"))
            .filter(|l| labels.iter().all(|want| l.contains(want)))
            .filter_map(|l| l.rsplit(' ').next()?.parse::<f64>().ok())
            .sum::<f64>() as u64
    }
}

/// Audit what service accounts do (the controller's requests: their verbs, objects and
/// answers), nothing else.
const AUDIT_POLICY: &str = "apiVersion: audit.k8s.io/v1
kind: Policy
omitStages: [RequestReceived]
rules:
- level: Metadata
  userGroups: [\"system:serviceaccounts\"]
- level: None
";

impl Cluster {
    /// The audit log's completed requests made by `user` (e.g.
    /// `system:serviceaccount:mover-system:mover-controller`).
    pub fn audit(&self, user: &str) -> Vec<serde_json::Value> {
        audit_of(&self.dir.join("audit.log"), user)
    }
}

/// The mover controller's ServiceAccount, as the audit log names it.
pub const CONTROLLER_USER: &str = "system:serviceaccount:mover-system:mover-controller";

/// No request of the controller in `events` (its audit log entries, at least a few)
/// was forbidden by its RBAC.
pub fn assert_nothing_forbidden(events: &[serde_json::Value]) {
    assert!(
        events.len() > 10,
        "the audit log has the controller's requests"
    );
    let denied: Vec<_> = events
        .iter()
        .filter(|e| e["responseStatus"]["code"] == 403)
        .map(|e| format!("{} {}", e["verb"], e["requestURI"]))
        .collect();
    assert!(denied.is_empty(), "forbidden: {denied:#?}");
}

/// The completed requests made by `user` in the API server's audit log at `path`.
pub fn audit_of(path: &Path, user: &str) -> Vec<serde_json::Value> {
    let text = std::fs::read_to_string(path).unwrap_or_default();
    text.lines()
        .filter_map(|l| serde_json::from_str::<serde_json::Value>(l).ok())
        .filter(|e| e["user"]["username"] == user && e["stage"] == "ResponseComplete")
        .collect()
}

fn ok(out: Output, args: &[&str]) -> String {
    assert!(
        out.status.success(),
        "kubectl {} failed: {}{}",
        args.join(" "),
        String::from_utf8_lossy(&out.stderr),
        String::from_utf8_lossy(&out.stdout)
    );
    String::from_utf8(out.stdout).unwrap()
}

/// The last lines of `dir/<program>.log` of each of `programs`, for a failure message.
pub fn log_tails<'a>(dir: &Path, programs: impl IntoIterator<Item = &'a str>) -> String {
    let mut out = String::new();
    for what in programs {
        let text = std::fs::read_to_string(dir.join(format!("{what}.log"))).unwrap_or_default();
        let lines: Vec<_> = text.lines().collect();
        let tail = &lines[lines.len().saturating_sub(15)..];
        out += &format!("--- {what} (last lines)\n{}\n", tail.join("\n"));
    }
    out
}

/// Runs `bin`/kubectl with `kubeconfig`, `stdin` fed to it.
pub fn run_kubectl(bin: &Path, kubeconfig: &Path, args: &[&str], stdin: Option<&str>) -> Output {
    use std::io::Write;
    let mut child = Command::new(bin.join("kubectl"))
        .arg(format!("--kubeconfig={}", kubeconfig.display()))
        .args(args)
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .expect("kubectl");
    let mut input = child.stdin.take().unwrap();
    input.write_all(stdin.unwrap_or("").as_bytes()).unwrap();
    drop(input);
    child.wait_with_output().unwrap()
}

impl Drop for Cluster {
    fn drop(&mut self) {
        for p in [&mut self.kcm, &mut self.apiserver, &mut self.etcd]
            .into_iter()
            .flatten()
        {
            let _ = p.kill();
            let _ = p.wait();
        }
    }
}

/// The cluster's CA, the API server's serving certificate, an admin client certificate
/// (system:masters) and the service-account signing key, as PEM files in `dir`.
fn write_pki(dir: &Path) {
    use rcgen::{
        BasicConstraints, CertificateParams, DnType, ExtendedKeyUsagePurpose, IsCa, Issuer, KeyPair,
    };
    let ca_key = KeyPair::generate().unwrap();
    let mut ca = CertificateParams::new(Vec::<String>::new()).unwrap();
    ca.is_ca = IsCa::Ca(BasicConstraints::Unconstrained);
    ca.distinguished_name
        .push(DnType::CommonName, "mover-test-ca");
    let ca_cert = ca.self_signed(&ca_key).unwrap();
    let issuer = Issuer::new(ca, ca_key);
    let write = |name: &str, cert: String, key: String| {
        std::fs::write(dir.join(format!("{name}.crt")), cert).unwrap();
        std::fs::write(dir.join(format!("{name}.key")), key).unwrap();
    };
    write("ca", ca_cert.pem(), String::new());
    let sans = [
        "127.0.0.1",
        "localhost",
        "kubernetes",
        "kubernetes.default.svc",
    ];
    let key = KeyPair::generate().unwrap();
    let mut server = CertificateParams::new(sans.map(String::from).to_vec()).unwrap();
    server.extended_key_usages = vec![ExtendedKeyUsagePurpose::ServerAuth];
    let cert = server.signed_by(&key, &issuer).unwrap();
    write("apiserver", cert.pem(), key.serialize_pem());
    let key = KeyPair::generate().unwrap();
    let mut admin = CertificateParams::new(Vec::<String>::new()).unwrap();
    admin.distinguished_name.push(DnType::CommonName, "admin");
    admin
        .distinguished_name
        .push(DnType::OrganizationName, "system:masters");
    admin.extended_key_usages = vec![ExtendedKeyUsagePurpose::ClientAuth];
    let cert = admin.signed_by(&key, &issuer).unwrap();
    write("admin", cert.pem(), key.serialize_pem());
    let sa = KeyPair::generate().unwrap();
    std::fs::write(dir.join("sa.key"), sa.serialize_pem()).unwrap();
    std::fs::write(dir.join("sa.pub"), sa.public_key_pem()).unwrap();
}
