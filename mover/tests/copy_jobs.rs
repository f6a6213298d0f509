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

/// The Job in `deploy/examples/jobs/FILE`.
fn job(file: &str) -> Value {
    let text = std::fs::read_to_string(repo().join("deploy/examples/jobs").join(file)).unwrap();
    serde_saphyr::from_str(&text).expect("Job YAML")
}

/// A Job's pod as a process: `volumes` maps each volume of the pod to a directory.
fn run_pod(job: &Value, volumes: &BTreeMap<String, PathBuf>) -> Output {
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
    let mut cmd = Command::new(env!("CARGO_BIN_EXE_mover"));
    for a in container["args"].as_array().unwrap() {
        cmd.arg(host_path(a.as_str().unwrap()));
    }
    cmd.env_clear().env("PATH", std::env::var("PATH").unwrap());
    for e in container["env"].as_array().into_iter().flatten() {
        cmd.env(
            e["name"].as_str().unwrap(),
            host_path(e["value"].as_str().expect("env given by value")),
        );
    }
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
