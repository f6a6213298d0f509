//! What a deletion had to leave on an agent that was down: a VolumeReplication is not
//! held in deletion for longer than the deletion grace because its agent is gone (a
//! namespace deletion would hang with it). The relationship and export left behind are
//! recorded in the ConfigMap `mover-controller-leftovers` of the controller's namespace
//! and removed once the agent answers again. Only what is recorded there is ever
//! removed: relationships made by hand on the same agents are not the controller's.

use super::agents::Agents;
use k8s_openapi::api::core::v1::ConfigMap;
use kube::api::{Api, Patch, PatchParams, PostParams};
use serde::{Deserialize, Serialize};

/// The ConfigMap's name (its Role grants get/patch on this name only).
pub const CONFIGMAP: &str = "mover-controller-leftovers";

/// One relationship (and its export) left on an agent.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct Leftover {
    /// The agent: HOST:PORT.
    pub agent: String,
    /// The relationship's name there.
    pub relationship: String,
    /// The export holding its volume.
    pub export: String,
    /// The VolumeReplication that owned it: NAMESPACE/NAME.
    pub owner: String,
}

impl Leftover {
    /// Its key in the ConfigMap (keys allow only `[-._a-zA-Z0-9]`).
    fn key(&self) -> String {
        let raw = format!("{}|{}", self.agent, self.relationship);
        raw.bytes().map(|b| format!("{b:02x}")).collect()
    }
}

/// The record of leftovers in the controller's namespace.
pub struct Leftovers {
    api: Api<ConfigMap>,
}

impl Leftovers {
    /// The record in `namespace`.
    pub fn new(client: kube::Client, namespace: &str) -> Self {
        Leftovers {
            api: Api::namespaced(client, namespace),
        }
    }

    /// Adds `l` to the record (creating the ConfigMap on first use).
    pub async fn record(&self, l: &Leftover) -> Result<(), kube::Error> {
        let value = serde_json::to_string(l).expect("a leftover serializes");
        let patch = serde_json::json!({"data": {l.key(): value}});
        match self
            .api
            .patch(CONFIGMAP, &PatchParams::default(), &Patch::Merge(&patch))
            .await
        {
            Err(kube::Error::Api(e)) if e.code == 404 => {
                let cm: ConfigMap = serde_json::from_value(serde_json::json!({
                    "metadata": {"name": CONFIGMAP},
                    "data": {l.key(): value},
                }))
                .expect("a ConfigMap");
                self.api.create(&PostParams::default(), &cm).await.map(drop)
            }
            r => r.map(drop),
        }
    }

    /// What is recorded.
    pub async fn list(&self) -> Result<Vec<Leftover>, kube::Error> {
        let cm = self.api.get_opt(CONFIGMAP).await?;
        Ok(cm
            .and_then(|c| c.data)
            .unwrap_or_default()
            .values()
            .filter_map(|v| serde_json::from_str(v).ok())
            .collect())
    }

    /// Removes every recorded leftover whose agent answers now; returns those removed.
    /// A leftover whose agent is still down stays for the next sweep.
    pub async fn sweep(&self, agents: &dyn Agents) -> Result<Vec<Leftover>, kube::Error> {
        let mut removed = Vec::new();
        for l in self.list().await? {
            let gone = async {
                agents.delete(&l.agent, &l.relationship).await?;
                agents.delete_schedule(&l.agent, &l.relationship).await
            };
            match gone.await {
                Ok(()) => {
                    // Best effort, as at deletion: another relationship may use it.
                    if let Err(e) = agents.unexport(&l.agent, &l.export).await {
                        tracing::warn!(agent = %l.agent, export = %l.export, "export kept: {e}");
                    }
                    let patch = serde_json::json!({"data": {l.key(): null}});
                    self.api
                        .patch(CONFIGMAP, &PatchParams::default(), &Patch::Merge(&patch))
                        .await?;
                    tracing::info!(agent = %l.agent, relationship = %l.relationship,
                        owner = %l.owner, "leftover relationship removed");
                    removed.push(l);
                }
                Err(e) => tracing::debug!(agent = %l.agent, "leftover kept: {e}"),
            }
        }
        Ok(removed)
    }
}
