//! The secrets classes name, each kept by a watch of its own (a field selector on its
//! name): a reconcile reads the cache, so a VolumeReplication at rest costs the API
//! server nothing, and a rotated token or password arrives with the watch event.

use k8s_openapi::api::core::v1::Secret;
use kube::api::Api;
use kube::runtime::reflector::{self, ObjectRef, Store};
use kube::runtime::{WatchStreamExt, watcher};
use std::collections::HashMap;
use std::sync::Mutex;
use std::time::Duration;

/// How long the first read of a secret waits for its watch's first list.
const FIRST_LIST: Duration = Duration::from_secs(10);

/// Watches of the secrets asked for so far, started on first use.
pub struct SecretWatches {
    client: kube::Client,
    /// The namespaces whose secrets the controller may read (a Role in each).
    namespaces: Vec<String>,
    stores: Mutex<HashMap<(String, String), Store<Secret>>>,
}

impl SecretWatches {
    /// No watch yet: each starts with the first read of its secret, in `namespaces`
    /// only.
    pub fn new(client: kube::Client, namespaces: Vec<String>) -> Self {
        SecretWatches {
            client,
            namespaces,
            stores: Mutex::new(HashMap::new()),
        }
    }

    /// The secret `namespace/name` as its watch last saw it (`None`: it does not exist);
    /// an error if the watch could not list it in time (RBAC, API server down).
    pub async fn get(&self, namespace: &str, name: &str) -> Result<Option<Secret>, String> {
        if !self.namespaces.iter().any(|n| n == namespace) {
            return Err(format!(
                "secret {namespace}/{name} is in a namespace the controller does not read \
                 secrets in ({}): move the secret there, or add {namespace} to the \
                 controller's --secret-namespace and give it the Role of deploy/README.md \
                 in {namespace}",
                self.namespaces.join(", ")
            ));
        }
        let key = (namespace.to_string(), name.to_string());
        let store = {
            let mut stores = self.stores.lock().expect("secret stores lock");
            stores
                .entry(key)
                .or_insert_with(|| self.watch(namespace, name))
                .clone()
        };
        tokio::time::timeout(FIRST_LIST, store.wait_until_ready())
            .await
            .map_err(|_| {
                format!(
                    "cannot read secret {namespace}/{name}: its watch has not listed it within \
                     {}s (RBAC: list and watch secrets)",
                    FIRST_LIST.as_secs()
                )
            })?
            .map_err(|e| format!("cannot read secret {namespace}/{name}: {e}"))?;
        Ok(store
            .get(&ObjectRef::new(name).within(namespace))
            .map(|s| (*s).clone()))
    }

    /// Starts the watch of one secret (for as long as the controller runs).
    fn watch(&self, namespace: &str, name: &str) -> Store<Secret> {
        let api = Api::<Secret>::namespaced(self.client.clone(), namespace);
        let config = watcher::Config::default().fields(&format!("metadata.name={name}"));
        let writer = reflector::store::Writer::default();
        let reader = writer.as_reader();
        let run = reflector::reflector(writer, watcher(api, config)).default_backoff();
        tokio::spawn(futures::StreamExt::for_each(run, |_| {
            futures::future::ready(())
        }));
        reader
    }
}
