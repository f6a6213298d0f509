//! The one-shot Jobs of deploy/examples/jobs, run as they are written: no kubelet runs
//! here, so each Job's pod is emulated as a process, the `mover` its container names,
//! with its args and env, each volume a directory of its own where the container mounts
//! it. What it leaves must be byte-exact, its log must show progress, and its exit
//! status must be what the Job's podFailurePolicy expects.

mod common;

use common::tree::{make_tree, manifest};
use serde_json::Value;
use std::{
    collections::BTreeMap,
    path::{Path, PathBuf},
    process::{Command, Output},
};

fn repo() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .parent()
        .unwrap()
        .into()
}

/// The Job in `deploy/examples/jobs/FILE` (beside other objects, e.g. its PVC).
fn job(file: &str) -> Value {
    let text = std::fs::read_to_string(repo().join("deploy/examples/jobs").join(file)).unwrap();
    text.split("\n---\n")
        .map(|doc| serde_saphyr::from_str::<Value>(doc).expect("YAML"))
        .find(|doc| doc["kind"] == "Job")
        .expect("a Job")
}

/// A Job's pod as a process: `volumes` maps each volume of the pod to a directory.
fn run_pod(job: &Value, volumes: &BTreeMap<String, PathBuf>) -> Output {
    run_pod_with(job, volumes, &BTreeMap::new())
}

/// [`run_pod`] with the Secrets the pod's env names: `SECRET/KEY` to its value. As the
/// kubelet does, env values come first, then `$(VAR)` in the args is expanded from them.
fn run_pod_with(
    job: &Value,
    volumes: &BTreeMap<String, PathBuf>,
    secrets: &BTreeMap<String, String>,
) -> Output {
    let pod = &job["spec"]["template"]["spec"];
    let container = &pod["containers"][0];
    assert!(
        container["command"].is_null(),
        "the image's entrypoint is mover; the Job gives args only"
    );
    // Where the container sees each volume: longest mount path first.
    let mut mounts: Vec<(String, PathBuf)> = container["volumeMounts"]
        .as_array()
        .unwrap()
        .iter()
        .map(|m| {
            let name = m["name"].as_str().unwrap();
            let dir = volumes
                .get(name)
                .unwrap_or_else(|| panic!("the test gives no directory for volume {name}"));
            (m["mountPath"].as_str().unwrap().to_string(), dir.clone())
        })
        .collect();
    mounts.sort_by_key(|(p, _)| std::cmp::Reverse(p.len()));
    let host_path = |s: &str| -> String {
        for (at, dir) in &mounts {
            if let Some(rest) = s.strip_prefix(at.as_str())
                && (rest.is_empty() || rest.starts_with('/'))
            {
                return format!("{}{rest}", dir.display());
            }
        }
        s.to_string()
    };
    let mut env = BTreeMap::new();
    for e in container["env"].as_array().into_iter().flatten() {
        let name = e["name"].as_str().unwrap().to_string();
        let r = &e["valueFrom"]["secretKeyRef"];
        let value = if r.is_null() {
            host_path(e["value"].as_str().expect("env by value or from a Secret"))
        } else {
            let key = format!(
                "{}/{}",
                r["name"].as_str().unwrap(),
                r["key"].as_str().unwrap()
            );
            match secrets.get(&key) {
                Some(v) => v.clone(),
                None if r["optional"] == true => continue,
                None => panic!("the test gives no value for Secret key {key}"),
            }
        };
        env.insert(name, value);
    }
    let mut cmd = Command::new(env!("CARGO_BIN_EXE_mover"));
    for a in container["args"].as_array().unwrap() {
        let mut arg = a.as_str().unwrap().to_string();
        for (k, v) in &env {
            arg = arg.replace(&format!("$({k})"), v);
        }
        cmd.arg(host_path(&arg));
    }
    cmd.env_clear()
        .env("PATH", std::env::var("PATH").unwrap())
        .envs(&env);
    cmd.output().unwrap()
}

/// The exit codes the Job's podFailurePolicy fails at once.
fn fail_job_codes(job: &Value) -> Vec<i64> {
    job["spec"]["podFailurePolicy"]["rules"]
        .as_array()
        .unwrap()
        .iter()
        .filter(|r| r["action"] == "FailJob")
        .flat_map(|r| r["onExitCodes"]["values"].as_array().unwrap().clone())
        .map(|v| v.as_i64().unwrap())
        .collect()
}

fn log(out: &Output) -> String {
    String::from_utf8_lossy(&out.stderr).into_owned()
}

#[test]
fn the_pvc_to_pvc_job_copies_byte_exact_then_copies_only_changes_then_refuses_bad_input() {
    if !common::tree::is_root() {
        return common::skip_unless_ci("the Job runs as root (owners and ACLs are kept)");
    }
    let job = job("copy-pvc-to-pvc.yaml");
    let t = tempfile::tempdir().unwrap();
    let volumes: BTreeMap<String, PathBuf> = ["source", "target", "state"]
        .into_iter()
        .map(|v| {
            let dir = t.path().join(v);
            std::fs::create_dir_all(&dir).unwrap();
            (v.to_string(), dir)
        })
        .collect();
    // The source PVC: a tree with every kind of entry, and a real one (the time zones:
    // many small files, symlinks, hard links).
    let source = &volumes["source"];
    make_tree(source, 40);
    let zones = Command::new("cp")
        .args(["-a", "/usr/share/zoneinfo"])
        .arg(source.join("zoneinfo"))
        .status()
        .unwrap();
    assert!(zones.success(), "cp -a /usr/share/zoneinfo");

    let first = run_pod(&job, &volumes);
    assert!(
        first.status.success(),
        "the Job's pod failed:\n{}",
        log(&first)
    );
    assert!(
        log(&first).contains("copy: started") && log(&first).contains("copy: done"),
        "no progress in the pod's log:\n{}",
        log(&first)
    );
    assert_eq!(manifest(&volumes["target"]), manifest(source));

    // A day later: files changed and added; the Job run again copies only those.
    std::fs::write(source.join("docs/added.txt"), b"a new file").unwrap();
    std::fs::write(source.join("small/03/f3.txt"), b"changed since").unwrap();
    let again = run_pod(&job, &volumes);
    assert!(again.status.success(), "the rerun failed:\n{}", log(&again));
    let summary = String::from_utf8_lossy(&again.stdout);
    assert_eq!(manifest(&volumes["target"]), manifest(source));
    assert!(
        // The two files' 23 bytes, nothing else.
        summary.contains("2 entries written whole, 0 files patched")
            && summary.contains("wrote 23 B of file data"),
        "the rerun is not a delta: {summary}"
    );

    // A source that is not there: refused with exit status 2, which the Job's
    // podFailurePolicy turns into a failed Job at once (no retry helps).
    let mut gone = volumes.clone();
    gone.insert("source".into(), t.path().join("no-such-claim"));
    let refused = run_pod(&job, &gone);
    let code = refused.status.code().unwrap() as i64;
    assert_eq!(code, 2, "a missing source: {}", log(&refused));
    assert!(fail_job_codes(&job).contains(&code));
    assert!(
        log(&refused).contains("no-such-claim"),
        "the error does not name the missing source:\n{}",
        log(&refused)
    );
}

/// Directories for each named volume of a pod, under `dir`.
fn volume_dirs(dir: &Path, names: &[&str]) -> BTreeMap<String, PathBuf> {
    names
        .iter()
        .map(|v| {
            let d = dir.join(v);
            std::fs::create_dir_all(&d).unwrap();
            (v.to_string(), d)
        })
        .collect()
}

/// A source PVC's tree: every kind of entry, and a real one (the time zones).
fn source_tree(dir: &Path) {
    make_tree(dir, 41);
    let zones = Command::new("cp")
        .args(["-a", "/usr/share/zoneinfo"])
        .arg(dir.join("zoneinfo"))
        .status()
        .unwrap();
    assert!(zones.success(), "cp -a /usr/share/zoneinfo");
}

/// Asserts the pod succeeded and its log shows `phase` begin and end.
fn assert_done(out: &Output, phase: &str) {
    assert!(out.status.success(), "the Job's pod failed:\n{}", log(out));
    assert!(
        log(out).contains(&format!("{phase}: started"))
            && log(out).contains(&format!("{phase}: done")),
        "no {phase} progress in the pod's log:\n{}",
        log(out)
    );
}

#[test]
fn the_pvc_to_agent_job_copies_byte_exact_over_tls_then_refuses_a_wrong_token() {
    if !common::tree::is_root() {
        return common::skip_unless_ci("the Job runs as root (owners and ACLs are kept)");
    }
    let job = job("copy-pvc-to-agent.yaml");
    let t = tempfile::tempdir().unwrap();
    let volumes = volume_dirs(t.path(), &["source", "peer", "state"]);
    source_tree(&volumes["source"]);
    // The other cluster's agent: TLS with its cluster's CA, a replication token (so a
    // client may come without a certificate of that CA), a directory export.
    let [ca, cert, key, _, _] = common::agent::make_pki(t.path(), "peer");
    let exported = t.path().join("exported");
    std::fs::create_dir(&exported).unwrap();
    let repl = t.path().join("replication-token");
    std::fs::write(&repl, "a-replication-token\n").unwrap();
    let agent_dir = t.path().join("agent");
    std::fs::create_dir(&agent_dir).unwrap();
    let agent = common::agent::Agent::start_with_settings(
        &agent_dir,
        &[("vol", &exported, false)],
        Some((&cert, &key, &ca)),
        &format!("replication_token_file = \"{}\"", repl.display()),
    );
    std::fs::copy(&ca, volumes["peer"].join("ca.crt")).unwrap();
    let mut secrets: BTreeMap<String, String> = [
        (
            "mover-peer/target",
            format!("agent://localhost@127.0.0.1:{}/vol", agent.port),
        ),
        ("mover-peer/token", common::agent::TOKEN.to_string()),
    ]
    .into_iter()
    .map(|(k, v)| (k.to_string(), v))
    .collect();
    let first = run_pod_with(&job, &volumes, &secrets);
    assert_done(&first, "copy");
    assert_eq!(manifest(&exported), manifest(&volumes["source"]));

    // Changed since: the rerun brings the agent's copy up to date.
    std::fs::write(volumes["source"].join("docs/added.txt"), b"a new file").unwrap();
    let again = run_pod_with(&job, &volumes, &secrets);
    assert_done(&again, "copy");
    assert_eq!(manifest(&exported), manifest(&volumes["source"]));

    // A wrong token: refused, exit status 2, which fails the Job at once.
    secrets.insert("mover-peer/token".into(), "not-the-token".into());
    let refused = run_pod_with(&job, &volumes, &secrets);
    let code = refused.status.code().unwrap() as i64;
    assert_eq!(code, 2, "a wrong token: {}", log(&refused));
    assert!(fail_job_codes(&job).contains(&code));
}

#[test]
fn the_snapshot_and_restore_jobs_round_trip_a_pvc_through_s3_byte_exact() {
    use snapshots::testing::{ACCESS_KEY, S3Server, SECRET_KEY};
    if !common::tree::is_root() {
        return common::skip_unless_ci("the Jobs run as root (owners and ACLs are kept)");
    }
    let t = tempfile::tempdir().unwrap();
    let s3 = S3Server::start(&t.path().join("s3"));
    s3.create_bucket("backups");
    let volumes = volume_dirs(t.path(), &["source", "target", "repository", "cache"]);
    std::fs::write(volumes["repository"].join("password"), "a password\n").unwrap();
    let secrets: BTreeMap<String, String> = [
        ("mover-repository/repository", "s3://backups/app"),
        ("mover-repository/endpoint", s3.endpoint.as_str()),
        ("mover-repository/AWS_ACCESS_KEY_ID", ACCESS_KEY),
        ("mover-repository/AWS_SECRET_ACCESS_KEY", SECRET_KEY),
    ]
    .into_iter()
    .map(|(k, v)| (k.to_string(), v.to_string()))
    .collect();
    let init = Command::new(env!("CARGO_BIN_EXE_mover"))
        .args(["repo", "init", "s3://backups/app"])
        .env("MOVER_S3_ENDPOINT", &s3.endpoint)
        .env("AWS_ACCESS_KEY_ID", ACCESS_KEY)
        .env("AWS_SECRET_ACCESS_KEY", SECRET_KEY)
        .env(
            "MOVER_PASSWORD_FILE",
            volumes["repository"].join("password"),
        )
        .output()
        .unwrap();
    assert!(init.status.success(), "{}", log(&init));
    source_tree(&volumes["source"]);

    let snapshot = job("snapshot-pvc.yaml");
    let taken = run_pod_with(&snapshot, &volumes, &secrets);
    assert_done(&taken, "snapshot");
    let restore = job("restore-to-new-pvc.yaml");
    let restored = run_pod_with(&restore, &volumes, &secrets);
    assert_done(&restored, "restore");
    assert_eq!(manifest(&volumes["target"]), manifest(&volumes["source"]));

    // A wrong password: refused with a status the Job fails at once on.
    std::fs::write(volumes["repository"].join("password"), "not it\n").unwrap();
    for job in [&snapshot, &restore] {
        let refused = run_pod_with(job, &volumes, &secrets);
        let code = refused.status.code().unwrap() as i64;
        assert!(
            fail_job_codes(job).contains(&code),
            "a wrong password: exit {code}\n{}",
            log(&refused)
        );
        assert!(log(&refused).contains("password"), "{}", log(&refused));
    }
}
