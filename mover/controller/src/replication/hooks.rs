//! Per-class hooks around a point in time (class parameters `preSnapshotHook` and
//! `postSnapshotHook`): a command run in the workload's pods through the API's
//! `pods/exec`, as Velero's and Kanister's hooks do, e.g. a database checkpoint before
//! the freeze and the snapshot, and whatever undoes it after.
//!
//! The workload's pods are the running pods of the PVC's namespace that mount the PVC.
//! A pre-hook that fails (a non-zero exit, no answer within [`TIMEOUT`]) fails the
//! cycle before anything is frozen or taken, and the post-hook runs all the same, to
//! undo whatever part of it was done; a post-hook's failure is logged, since the
//! snapshot is already taken (or the cycle failed) by then.

use k8s_openapi::api::core::v1::Pod;
use kube::api::{Api, AttachParams, ListParams};
use std::time::Duration;
use tokio::io::AsyncReadExt;

/// Class parameter: the command run before the freeze, a JSON array
/// (`["/bin/sh", "-c", "psql -c CHECKPOINT"]`).
pub const PARAM_PRE: &str = "preSnapshotHook";
/// Class parameter: the command run after the snapshot is cut, a JSON array.
pub const PARAM_POST: &str = "postSnapshotHook";
/// Class parameter: the container the hooks run in [default: the pod's first].
pub const PARAM_CONTAINER: &str = "hookContainer";
/// How long a hook may take in each pod.
pub const TIMEOUT: Duration = Duration::from_secs(30);

/// A command to run in the workload's pods.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Hook {
    /// The program and its arguments.
    pub command: Vec<String>,
    /// The container [default: the first].
    pub container: Option<String>,
}

/// Parses a hook parameter: a JSON array of strings, not empty.
pub fn parse(value: &str, container: Option<&str>) -> Result<Hook, String> {
    let command: Vec<String> = serde_json::from_str(value).map_err(|e| {
        format!(
            "{value:?} is not a JSON array of strings ({e}): write [\"/bin/sh\", \"-c\", \"...\"]"
        )
    })?;
    if command.is_empty() || command[0].is_empty() {
        return Err(format!("{value:?} names no program"));
    }
    Ok(Hook {
        command,
        container: container.map(str::to_string).filter(|c| !c.is_empty()),
    })
}

/// Runs `hook` in every running pod of `namespace` that mounts PVC `pvc`; returns the
/// pods it ran in. `Err` names the pod and what it answered.
pub async fn run(
    client: &kube::Client,
    namespace: &str,
    pvc: &str,
    hook: &Hook,
) -> Result<Vec<String>, String> {
    let pods: Api<Pod> = Api::namespaced(client.clone(), namespace);
    let list = pods.list(&ListParams::default()).await.map_err(|e| {
        format!(
            "cannot list the pods of {namespace} to run a hook in: {e}{}",
            rbac_hint(&e)
        )
    })?;
    let users: Vec<Pod> = list
        .items
        .into_iter()
        .filter(|p| {
            let running = p.status.as_ref().and_then(|s| s.phase.as_deref()) == Some("Running");
            let mounts = p
                .spec
                .iter()
                .flat_map(|s| s.volumes.iter().flatten())
                .any(|v| {
                    v.persistent_volume_claim
                        .as_ref()
                        .is_some_and(|c| c.claim_name == pvc)
                });
            running && mounts
        })
        .collect();
    let mut ran = Vec::new();
    for pod in users {
        let name = kube::ResourceExt::name_any(&pod);
        let failed =
            |why: String| format!("hook {:?} in pod {namespace}/{name}: {why}", hook.command);
        tokio::time::timeout(TIMEOUT, exec(&pods, &name, hook))
            .await
            .map_err(|_| failed(format!("no answer within {}s", TIMEOUT.as_secs())))?
            .map_err(failed)?;
        ran.push(name);
    }
    Ok(ran)
}

/// What to do about a refusal by RBAC: the hooks' rights are an overlay of their own.
/// (A refusal by that overlay's admission policy, for a namespace not opted in, says
/// itself what to do. A refused exec upgrade arrives here too: kube-rs reads the API
/// server's Status of a 4xx before it checks the upgrade.)
fn rbac_hint(e: &kube::Error) -> &'static str {
    match e {
        kube::Error::Api(s) if s.code == 403 && !s.message.contains("AdmissionPolicy") => {
            " (the controller may not: apply deploy/overlays/snapshot-hooks, which grants \
             pods list and pods/exec)"
        }
        _ => "",
    }
}

/// Runs `hook` in pod `name`; `Err` with its exit status and output when it fails.
async fn exec(pods: &Api<Pod>, name: &str, hook: &Hook) -> Result<(), String> {
    let mut params = AttachParams::default()
        .stdin(false)
        .stdout(true)
        .stderr(true);
    if let Some(c) = &hook.container {
        params = params.container(c.clone());
    }
    let mut attached = pods
        .exec(name, hook.command.clone(), &params)
        .await
        .map_err(|e| format!("{e}{}", rbac_hint(&e)))?;
    // Both at once: one left unread could fill and stall the other.
    async fn all(stream: Option<impl tokio::io::AsyncRead + Unpin>) -> String {
        let mut text = String::new();
        if let Some(mut s) = stream {
            let _ = s.read_to_string(&mut text).await;
        }
        text
    }
    let (out, err) = tokio::join!(all(attached.stdout()), all(attached.stderr()));
    let output = format!("{out}{err}");
    let status = match attached.take_status() {
        Some(s) => s.await,
        None => None,
    };
    let _ = attached.join().await;
    match status {
        Some(s) if s.status.as_deref() == Some("Success") => Ok(()),
        Some(s) => Err(format!(
            "{}; output: {}",
            s.message.unwrap_or_else(|| "failed".into()),
            output.trim()
        )),
        None => Err(format!("no exit status; output: {}", output.trim())),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_hook_is_a_json_array_of_strings() {
        let h = parse(r#"["/bin/sh", "-c", "psql -c CHECKPOINT"]"#, Some("db")).unwrap();
        assert_eq!(h.command, ["/bin/sh", "-c", "psql -c CHECKPOINT"]);
        assert_eq!(h.container.as_deref(), Some("db"));
        assert_eq!(parse(r#"["sync"]"#, Some("")).unwrap().container, None);
        for bad in ["sync", "[1]"] {
            let e = parse(bad, None).unwrap_err();
            assert!(e.contains("is not a JSON array of strings"), "{e}");
        }
        for bad in ["[]", r#"[""]"#] {
            let e = parse(bad, None).unwrap_err();
            assert!(e.contains("names no program"), "{e}");
        }
    }
}
