//! Two clusters on real nodes replicating a volume, as the real-node scenarios and the
//! soak use them: a [`Site`] is a cluster with mover installed and the PVC `app/data`;
//! the database helpers run PostgreSQL under pgbench in a pod on it.

use super::{MIB, blake3_of, cluster::CONTROLLER_USER, make_image, nodes::RealCluster};
use serde_json::Value;
use std::time::Duration;

/// The volume the sites replicate.
pub const VOLUME_LEN: u64 = 64 * MIB;
/// How long a step may take.
pub const WAIT: Duration = Duration::from_secs(120);
/// The clusters' bridge address on the host (`cluster.sh`): the nodes' pods reach it.
pub const GATEWAY: &str = "10.250.0.1";

/// A cluster with mover installed, an `app` namespace and the PVC `app/data` on a local
/// PV of node `on`: `/mnt/disks/data.img` there, a Block volume as a local disk's
/// partition would be.
pub struct Site {
    pub c: RealCluster,
    pub on: u8,
    /// The VolumeReplication (and PVC) `app/NAME` this site replicates, and its class.
    pub vr: &'static str,
    pub class: &'static str,
}

/// What a site's secret mover-replication-token holds: the token its peer presents
/// (peer credential `peer`, which the class secrets bind every relationship to), another
/// peer cluster's (`eu`, bound to none), and a cluster-wide unnamed one (README: "One
/// credential per peer cluster").
fn replication_tokens(name: &str) -> String {
    format!(
        "peer replication-token-of-{name}\neu replication-token-of-{name}-for-eu\nreplication-token-of-{name}-cluster-wide\n"
    )
}

impl Site {
    /// The token of the line of mover-replication-token for peer credential `name`
    /// (`None`: the unnamed, cluster-wide line).
    pub fn replication_token(&self, name: Option<&str>) -> String {
        let lines = self.secret("mover-replication-token", "token");
        lines
            .lines()
            .map(|l| l.split_whitespace().collect::<Vec<_>>())
            .find_map(|f| match (f.as_slice(), name) {
                ([n, t], Some(want)) if *n == want => Some(t.to_string()),
                ([t], None) => Some(t.to_string()),
                _ => None,
            })
            .unwrap_or_else(|| panic!("no line for {name:?} in {lines}"))
    }

    pub fn start(name: &str, index: u8) -> Option<Site> {
        Site::start_from(name, index, "deploy/base")
    }

    /// A site whose install is the kustomization `dir` (the base or an overlay).
    pub fn start_from(name: &str, index: u8, dir: &str) -> Option<Site> {
        let c = RealCluster::start(name, index, 2)?;
        c.install_from(dir, &replication_tokens(name));
        Some(Site {
            c,
            on: 1,
            vr: "data",
            class: "mover-dr",
        })
    }

    pub fn image(&self) -> std::path::PathBuf {
        self.c.disks(self.on).join("data.img")
    }

    pub fn volume(&self, seed: u64) {
        let extents: &[(u64, u64)] = if seed == 0 {
            &[]
        } else {
            &[(0, 4 * MIB), (20 * MIB, 2 * MIB), (60 * MIB, MIB)]
        };
        make_image(&self.image(), VOLUME_LEN, seed, extents);
        self.claim(VOLUME_LEN, "/mnt/disks/data.img");
    }

    /// The namespace `app` and its PVC `data`, bound to a PV of `len` bytes at `path`
    /// on the site's node (made already).
    pub fn claim(&self, len: u64, path: &str) {
        let mib = len / MIB;
        self.c.kubectl_ok(&["create", "namespace", "app"]);
        self.c.apply(&format!(
            r#"apiVersion: storage.k8s.io/v1
kind: StorageClass
metadata:
  name: local
provisioner: kubernetes.io/no-provisioner
volumeBindingMode: Immediate
---
apiVersion: v1
kind: PersistentVolume
metadata:
  name: pv-data
spec:
  capacity:
    storage: {mib}Mi
  accessModes: [ReadWriteOnce]
  volumeMode: Block
  storageClassName: local
  persistentVolumeReclaimPolicy: Retain
  local:
    path: {path}
  nodeAffinity:
    required:
      nodeSelectorTerms:
      - matchExpressions:
        - key: kubernetes.io/hostname
          operator: In
          values: [{node}]
---
apiVersion: v1
kind: PersistentVolumeClaim
metadata:
  name: data
  namespace: app
spec:
  accessModes: [ReadWriteOnce]
  volumeMode: Block
  storageClassName: local
  resources:
    requests:
      storage: {mib}Mi
"#,
            node = self.c.node(self.on)
        ));
        self.c.wait("the PVC Bound", WAIT, || {
            self.c.get(&["pvc/data", "-n", "app"], "{.status.phase}") == "Bound"
        });
    }

    /// The PVC `app/data` of `len` bytes for a database: a device node over a new image
    /// on the site's node (as a local disk's partition: the database's pod is privileged
    /// to mount it, and containerd gives a privileged container only devices), with the
    /// PostgreSQL image imported.
    pub fn database_volume(&self, len: u64) {
        self.c.import_test_image("postgres");
        std::fs::File::create(self.image())
            .unwrap()
            .set_len(len)
            .unwrap();
        local_block_device(&self.c, self.on, "data");
        self.claim(len, "/mnt/disks/data");
    }

    /// README step 5: the Locator as a NodePort; its port.
    pub fn expose_locator(&self) -> String {
        self.c.kubectl_ok(&[
            "-n",
            "mover-system",
            "patch",
            "svc",
            "mover-locator",
            "-p",
            r#"{"spec":{"type":"NodePort"}}"#,
        ]);
        self.c.get(
            &["svc/mover-locator", "-n", "mover-system"],
            "{.spec.ports[0].nodePort}",
        )
    }

    /// README step 7: the class replicating to `peer`, its secret holding what the
    /// administrator copies from the peer (its replication token for this cluster and
    /// its mover CA, read there with the commands of
    /// deploy/examples/class-peer-cluster.yaml) and the peer credential of this
    /// cluster's token file that the peer presents here (`peer`).
    pub fn class_to(&self, peer: &Site, peer_locator_port: &str) {
        self.class_named("mover-dr", peer, peer_locator_port, "");
    }

    /// A class `name` as [`Site::class_to`] makes, with `params` (YAML lines, indented
    /// four spaces) added to its parameters.
    pub fn class_named(&self, name: &str, peer: &Site, peer_locator_port: &str, params: &str) {
        let token = peer.replication_token(Some("peer"));
        let ca = peer.trust();
        let secret = self
            .c
            .kubectl(&["-n", "mover-system", "get", "secret", "mover-dr-peer"]);
        if !secret.status.success() {
            self.c.kubectl_ok(&[
                "-n",
                "mover-system",
                "create",
                "secret",
                "generic",
                "mover-dr-peer",
                &format!("--from-literal=token={token}"),
                &format!("--from-literal=ca.crt={ca}"),
                "--from-literal=peer-credential=peer",
            ]);
        }
        self.c.apply(&format!(
            r#"apiVersion: replication.mover/v1alpha1
kind: VolumeReplicationClass
metadata:
  name: {name}
spec:
  provisioner: kubernetes.io/no-provisioner
  parameters:
    schedulingInterval: 2s
    target: cluster://{ip}:{peer_locator_port}
    replication.storage.openshift.io/replication-secret-name: mover-dr-peer
    replication.storage.openshift.io/replication-secret-namespace: mover-system
{params}"#,
            ip = peer.c.node_ip(2)
        ));
    }

    pub fn set_state(&self, state: &str) {
        self.c.apply(&format!(
            "apiVersion: replication.mover/v1alpha1\nkind: VolumeReplication\nmetadata:\n  name: {vr}\n  namespace: app\nspec:\n  volumeReplicationClass: {class}\n  replicationState: {state}\n  dataSource:\n    kind: PersistentVolumeClaim\n    name: {vr}\n",
            vr = self.vr,
            class = self.class
        ));
    }

    pub fn vr(&self) -> Value {
        let out = self
            .c
            .kubectl(&["get", "vr", self.vr, "-n", "app", "-o", "json"]);
        serde_json::from_slice(&out.stdout).unwrap_or(Value::Null)
    }

    /// Condition `ty`'s (status, reason).
    pub fn condition(&self, ty: &str) -> (String, String) {
        let vr = self.vr();
        let c = vr["status"]["conditions"]
            .as_array()
            .and_then(|cs| cs.iter().find(|c| c["type"] == ty).cloned())
            .unwrap_or(Value::Null);
        (
            c["status"].as_str().unwrap_or_default().into(),
            c["reason"].as_str().unwrap_or_default().into(),
        )
    }

    /// Condition `ty`'s message.
    pub fn message(&self, ty: &str) -> String {
        let vr = self.vr();
        vr["status"]["conditions"]
            .as_array()
            .and_then(|cs| cs.iter().find(|c| c["type"] == ty))
            .and_then(|c| c["message"].as_str())
            .unwrap_or_default()
            .to_string()
    }

    pub fn completed(&self, reason: &str) -> bool {
        self.condition("Completed") == ("True".into(), reason.into())
    }

    pub fn wait_vr(&self, what: &str, check: impl Fn(&Site) -> bool) {
        self.c.wait(what, WAIT, || check(self));
    }

    /// The bytes the agent of the volume's node shipped for the relationship, from its
    /// /metrics on the node's address (the series is labelled with the current role:
    /// summed over both).
    pub fn shipped(&self) -> u64 {
        let series = "mover_replication_bytes_shipped_total{relationship=\"app/data\",";
        self.c
            .agent_metrics(self.on)
            .lines()
            .filter(|l| l.starts_with(series))
            .filter_map(|l| l.rsplit(' ').next()?.parse::<f64>().ok())
            .sum::<f64>() as u64
    }

    /// No request of this cluster's controllers was forbidden by their RBAC (the API
    /// server's audit log of the mover-controller ServiceAccount).
    pub fn assert_nothing_forbidden(&self) {
        super::cluster::assert_nothing_forbidden(&self.c.audit(CONTROLLER_USER));
    }

    /// The agent of node `n`'s URL, by the name its certificate carries.
    pub fn agent_url(&self, n: u8) -> String {
        format!("agent://{}@{}:7070", self.c.node(n), self.c.node_ip(n))
    }

    /// Key `key` of secret `name` in mover-system, decoded (as an administrator reads it).
    pub fn secret(&self, name: &str, key: &str) -> String {
        self.c.kubectl_ok(&[
            "-n",
            "mover-system",
            "get",
            "secret",
            name,
            "-o",
            &format!("go-template={{{{index .data \"{key}\" | base64decode}}}}"),
        ])
    }

    /// What the cluster trusts, as its controller publishes it (ConfigMap
    /// mover-ca-trust, key trust.crt: what a peer's class secret holds as `ca.crt`).
    pub fn trust(&self) -> String {
        let get = || {
            self.c.get(
                &["configmap", "mover-ca-trust", "-n", "mover-system"],
                "{.data.trust\\.crt}",
            )
        };
        self.c.wait(
            "the controller publishing what the cluster trusts",
            WAIT,
            || get().contains("BEGIN CERTIFICATE"),
        );
        get()
    }

    /// The cluster's mover CA (secret mover-ca) in a file; (its path, the CA's key).
    pub fn ca(&self) -> (std::path::PathBuf, String) {
        let path = self.c.dir().join("mover-ca.crt");
        std::fs::write(&path, self.secret("mover-ca", "ca.crt")).unwrap();
        (path, self.secret("mover-ca", "ca.key"))
    }
}

pub const AGENTS: &str = "app.kubernetes.io/name=mover-agent";

pub const CONTROLLERS: &str = "app.kubernetes.io/name=mover-controller";

/// Waits until `b`'s image equals `a`'s as it is now.
pub fn in_sync(a: &Site, b: &Site, what: &str) {
    let want = blake3_of(&a.image(), VOLUME_LEN);
    b.c.wait(what, WAIT, || blake3_of(&b.image(), VOLUME_LEN) == want);
}

/// Makes `secondary`'s VolumeReplication, then `primary`'s (RamenDR's order), and waits
/// until the primary has shipped a cycle of one instant (PointInTime True).
pub fn start_replicating(primary: &Site, secondary: &Site) {
    secondary.set_state("secondary");
    secondary.wait_vr("the secondary VR Secondary", |s| {
        s.vr()["status"]["state"] == "Secondary"
    });
    primary.set_state("primary");
    primary.wait_vr("the primary Promoted with a lastSyncTime", |s| {
        s.completed("Promoted") && s.vr()["status"]["lastSyncTime"].is_string()
    });
    assert_eq!(
        primary.condition("PointInTime").0,
        "True",
        "{}",
        primary.vr()["status"]
    );
}

/// `app/data` replicating from `a` (primary) to `b` read live: a mounted file system
/// written while cycles read it makes each cycle crash-consistent at best, and a final
/// cycle with nothing holding the volume whole. Waits for the first cycle.
pub fn replicating_live(a: &Site, b: &Site) {
    replicating(a, b, "    consistency: crash-inconsistent\n");
}

/// `app/data` replicating from `a` (primary) to `b` under classes `mover-dr` with
/// `params` (the default: a point in time required); waits for the first cycle.
pub fn replicating(a: &Site, b: &Site, params: &str) {
    let (a_locator, b_locator) = (a.expose_locator(), b.expose_locator());
    a.class_named("mover-dr", b, &b_locator, params);
    b.class_named("mover-dr", a, &a_locator, params);
    b.set_state("secondary");
    b.wait_vr("B secondary", |s| s.vr()["status"]["state"] == "Secondary");
    a.set_state("primary");
    a.wait_vr("A replicating", |s| {
        s.completed("Promoted") && s.vr()["status"]["lastSyncTime"].is_string()
    });
}

/// Two clusters with mover installed, `app/data` replicating from `a` (primary, its
/// node 1) to `b` (secondary, its node 2), the first cycle on the replica; the clusters
/// by (name, index).
pub fn replicating_pair(a: (&str, u8), b: (&str, u8)) -> Option<(Site, Site)> {
    let east = Site::start(a.0, a.1)?;
    let mut west = Site::start(b.0, b.1)?;
    west.on = 2;
    east.volume(7);
    west.volume(0);
    let east_locator = east.expose_locator();
    let west_locator = west.expose_locator();
    east.class_to(&west, &west_locator);
    west.class_to(&east, &east_locator);

    // An image file on XFS with no writer holding it: each cycle is a reflink clone of
    // one instant.
    start_replicating(&east, &west);
    in_sync(&east, &west, "the first cycle on the replica");
    Some((east, west))
}

/// A block device node at `/mnt/disks/NAME` of node `n` of `c` over a loop device of the
/// image `NAME.img` there (as a local disk's partition, which the local static
/// provisioner links under /mnt/disks); `cluster.sh down` detaches it.
pub fn local_block_device(c: &RealCluster, n: u8, name: &str) {
    let disks = c.disks(n);
    let image = disks.join(format!("{name}.img"));
    let out = std::process::Command::new("losetup")
        .args(["--find", "--show"])
        .arg(&image)
        .output()
        .unwrap();
    assert!(out.status.success(), "losetup: {out:?}");
    let dev = String::from_utf8_lossy(&out.stdout).trim().to_string();
    let rdev = std::os::unix::fs::MetadataExt::rdev(&std::fs::metadata(&dev).unwrap());
    let node = disks.join(name);
    let mknod = std::process::Command::new("mknod")
        .arg(&node)
        .arg("b")
        .arg(rustix::fs::major(rdev).to_string())
        .arg(rustix::fs::minor(rdev).to_string())
        .status()
        .unwrap();
    assert!(mknod.success());
}

/// The pod holding the controllers' Lease.
pub fn leader(s: &Site) -> String {
    s.c.get(
        &["lease/mover-controller", "-n", "mover-system"],
        "{.spec.holderIdentity}",
    )
}

/// The controller pods that are not being deleted, by name.
pub fn controller_pods(s: &Site) -> Vec<String> {
    let list: Value = serde_json::from_str(&s.c.kubectl_ok(&[
        "get",
        "pods",
        "-n",
        "mover-system",
        "-l",
        CONTROLLERS,
        "-o",
        "json",
    ]))
    .unwrap();
    list["items"]
        .as_array()
        .into_iter()
        .flatten()
        .filter(|p| p["metadata"]["deletionTimestamp"].is_null())
        .filter_map(|p| p["metadata"]["name"].as_str().map(String::from))
        .collect()
}

/// The host's process id of `mover ARG…` whose environment holds `env` (`HOSTNAME=POD`
/// for a pod's, `NODE_NAME=NODE` for an agent's: its pod shares the node's network and
/// name): containers are processes of this machine.
pub fn process_of(arg: &str, env: &str) -> Option<i32> {
    std::fs::read_dir("/proc").ok()?.flatten().find_map(|e| {
        let pid: i32 = e.file_name().to_str()?.parse().ok()?;
        let cmdline = std::fs::read(e.path().join("cmdline")).ok()?;
        let environ = std::fs::read(e.path().join("environ")).ok()?;
        let has = |hay: &[u8], needle: &str| hay.split(|b| *b == 0).any(|w| w == needle.as_bytes());
        (has(&cmdline, arg) && has(&environ, env)).then_some(pid)
    })
}

/// The script of the database pods (`localhost/postgres:15`, privileged to mount its
/// Block volume's ext4 itself): it makes the file system if the volume has none,
/// starts PostgreSQL on it (a new cluster with pgbench's tables if there is none),
/// says `ready`, starts pgbench once `/tmp/go` exists (two clients, 200 transactions
/// a second: a database's steady load, not a CPU hog on two cores), and on SIGTERM (the
/// kubelet stopping the pod) stops pgbench, waits until its backends have ended (a
/// COMMIT sent before the stop still commits), writes how many transactions the
/// database holds to `/out/committed` (the node's /mnt/disks, for the test) and stops
/// PostgreSQL cleanly.
pub const DB_SCRIPT: &str = r#"set -eu
pg() { runuser -u postgres -- "$@"; }
sql() { pg psql -XAtq -v ON_ERROR_STOP=1 -c "$1"; }
mkdir -p /pg
blkid /dev/data >/dev/null || mkfs.ext4 -q /dev/data
mount /dev/data /pg
install -d -o postgres /run/postgresql
if [ ! -d /pg/pgdata ]; then
  rm -rf /pg/new
  install -d -o postgres -m 700 /pg/new
  pg initdb -D /pg/new >/dev/null
  mv /pg/new /pg/pgdata
  fresh=1
fi
pg pg_ctl -D /pg/pgdata -l /tmp/postgres.log -w -o "-c listen_addresses=" start
[ -z "${fresh:-}" ] || pg pgbench -i -q -s 2
load=
stop() {
  # SIGTERM: a background job of a script ignores SIGINT; runuser passes it on.
  [ -z "$load" ] || { kill -TERM "$load"; wait "$load" || true; }
  while [ "$(sql "select count(*) from pg_stat_activity where backend_type = 'client backend' and pid <> pg_backend_pid()")" != 0 ]; do sleep 0.1; done
  sql "select count(*) from pgbench_history" >/out/committed.part
  mv /out/committed.part /out/committed
  pg pg_ctl -D /pg/pgdata -m fast -w stop
  umount /pg
  exit 0
}
trap stop TERM
echo ready
while [ ! -e /tmp/go ]; do sleep 0.2; done
runuser -u postgres -- pgbench -n -c 2 -R 200 -T 3600 >/tmp/pgbench.log 2>&1 &
load=$!
echo loading
wait "$load"
"#;

/// Pod `db` in `app` running [`DB_SCRIPT`] on the PVC `claim`, ready once PostgreSQL is.
pub fn db_pod(claim: &str) -> String {
    db_pod_running(claim, DB_SCRIPT)
}

/// Pod `db` as [`db_pod`] makes it, running `script` (a variant of [`DB_SCRIPT`]).
pub fn db_pod_running(claim: &str, script: &str) -> String {
    serde_json::json!({
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {"name": "db", "namespace": "app"},
        "spec": {
            "terminationGracePeriodSeconds": 30,
            "automountServiceAccountToken": false,
            "containers": [{
                "name": "postgres",
                "image": "localhost/postgres:15",
                "command": ["sh", "-c", script],
                "securityContext": {"privileged": true},
                "readinessProbe": {
                    "exec": {"command": ["pg_isready", "-q"]},
                    "periodSeconds": 1
                },
                "volumeDevices": [{"name": "data", "devicePath": "/dev/data"}],
                "volumeMounts": [{"name": "out", "mountPath": "/out"}]
            }],
            "volumes": [
                {"name": "data", "persistentVolumeClaim": {"claimName": claim}},
                {"name": "out", "hostPath": {"path": "/mnt/disks/out", "type": "DirectoryOrCreate"}}
            ]
        }
    })
    .to_string()
}

/// `program ARGS` of PostgreSQL's, run as postgres in pod `db` of `s`: its stdout.
pub fn db_run(s: &Site, program: &str, args: &[&str]) -> String {
    let mut exec = vec![
        "exec", "-n", "app", "db", "--", "runuser", "-u", "postgres", "--",
    ];
    exec.push(program);
    exec.extend_from_slice(args);
    s.c.kubectl_ok(&exec)
}

/// SQL `sql`'s answer from the database in pod `db` of `s`.
pub fn db_sql(s: &Site, sql: &str) -> String {
    db_run(s, "psql", &["-XAtq", "-v", "ON_ERROR_STOP=1", "-c", sql])
        .trim()
        .to_string()
}

/// Starts pod `db` on the PVC `claim` of `s` and waits until PostgreSQL is ready in it
/// (the first start makes the file system, the cluster and pgbench's tables).
pub fn db_start(s: &Site, claim: &str) {
    db_start_running(s, claim, DB_SCRIPT);
}

/// [`db_start`] of a pod running `script`.
pub fn db_start_running(s: &Site, claim: &str, script: &str) {
    s.c.apply(&db_pod_running(claim, script));
    s.c.wait("the database Ready", Duration::from_secs(300), || {
        s.c.get(
            &["pod/db", "-n", "app"],
            "{.status.containerStatuses[0].ready}",
        ) == "true"
    });
}

/// Starts pgbench in pod `db` of `s` (what [`DB_SCRIPT`] waits for).
pub fn db_load(s: &Site) {
    s.c.kubectl_ok(&["exec", "-n", "app", "db", "--", "touch", "/tmp/go"]);
}

/// How many pgbench transactions the database in pod `db` of `s` holds.
pub fn db_history(s: &Site) -> i64 {
    let n = db_sql(s, "select count(*) from pgbench_history");
    n.parse()
        .unwrap_or_else(|_| panic!("pgbench_history count: {n:?}"))
}

/// A Retain PV `pv` of `mib` MiB (Block, class `local`) at `path` on `node`, and the PVC
/// `app/CLAIM` bound to it: a local disk's volume as YAML documents.
pub fn local_block_volume(pv: &str, claim: &str, mib: u64, path: &str, node: &str) -> String {
    format!(
        r#"apiVersion: v1
kind: PersistentVolume
metadata: {{name: {pv}}}
spec:
  capacity: {{storage: {mib}Mi}}
  accessModes: [ReadWriteOnce]
  volumeMode: Block
  storageClassName: local
  persistentVolumeReclaimPolicy: Retain
  local: {{path: {path}}}
  nodeAffinity:
    required:
      nodeSelectorTerms:
      - matchExpressions:
        - {{key: kubernetes.io/hostname, operator: In, values: [{node}]}}
---
apiVersion: v1
kind: PersistentVolumeClaim
metadata: {{name: {claim}, namespace: app}}
spec:
  accessModes: [ReadWriteOnce]
  volumeMode: Block
  storageClassName: local
  volumeName: {pv}
  resources: {{requests: {{storage: {mib}Mi}}}}
"#
    )
}
