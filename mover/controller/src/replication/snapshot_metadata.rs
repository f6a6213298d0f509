//! The blocks that changed between two CSI VolumeSnapshots, from Kubernetes'
//! SnapshotMetadata API (KEP-3314): the change source of a cycle read through a CSI
//! snapshot, so that it reads only what changed.
//!
//! A CSI driver that can tell changed blocks runs the csi-snapshot-metadata sidecar and
//! announces it with a cluster-scoped `SnapshotMetadataService` named after the driver:
//! its address, the CA its certificate is signed by, and the audience a caller's token
//! must carry. The sidecar authenticates a call's token with TokenReview (that
//! audience) and authorizes it with a SubjectAccessReview of `get volumesnapshots` in
//! the request's namespace; so the caller asks the TokenRequest API for a short-lived
//! token of its own ServiceAccount with that audience ([`token`]).
//!
//! A delta is streamed. A stream cut part way (a restarted sidecar, a dropped
//! connection) is resumed where it stopped: `starting_offset` is the end of the last
//! range received, as the API intends, with backoff between tries. A refusal (the
//! token, the RBAC, an unknown snapshot) is not retried. A driver without the service,
//! or a service that stays down, is an error the caller answers with a full comparison
//! of the volume: never a wrong replica.

use chunker::extents::merge_ranges;
use k8s_openapi::api::authentication::v1::{TokenRequest, TokenRequestSpec};
use k8s_openapi::api::core::v1::ServiceAccount;
use kube::api::{Api, ApiResource, DynamicObject, GroupVersionKind, PostParams};
use std::{ops::Range, time::Duration};
use tonic::{Code, transport::Endpoint};
use transport::snapshot_metadata::{
    GetMetadataDeltaRequest, snapshot_metadata_client::SnapshotMetadataClient,
};

/// The SnapshotMetadataService resource: group, version, kind.
pub const SERVICE_GVK: (&str, &str, &str) =
    ("cbt.storage.k8s.io", "v1beta1", "SnapshotMetadataService");

/// Where a CSI driver's SnapshotMetadata service is, as its SnapshotMetadataService says.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Service {
    /// The CSI driver (the resource's name).
    pub driver: String,
    /// HOST:PORT of the sidecar's gRPC server (TLS).
    pub address: String,
    /// The CA (PEM) the sidecar's certificate is signed by.
    pub ca: Vec<u8>,
    /// The audience a caller's token must carry.
    pub audience: String,
}

/// Why no changed blocks could be had.
#[derive(Debug, thiserror::Error)]
pub enum MetadataError {
    /// The driver announces no service: it cannot tell changed blocks.
    #[error(
        "CSI driver {driver} has no usable SnapshotMetadataService ({why}): it does not tell \
         changed blocks, so each cycle compares the whole volume"
    )]
    NoService {
        /// The CSI driver.
        driver: String,
        /// What was missing or wrong.
        why: String,
    },
    /// No token with the service's audience could be had.
    #[error(
        "cannot get a token of ServiceAccount {service_account} with audience {audience:?} \
         (TokenRequest): {why}; the controller's Role must allow create on \
         serviceaccounts/token for its own ServiceAccount"
    )]
    Token {
        /// NAMESPACE/NAME.
        service_account: String,
        /// The audience asked for.
        audience: String,
        /// The API server's answer.
        why: String,
    },
    /// The service answered no, or nonsense: retrying would not help.
    #[error("the SnapshotMetadata service of {driver} at {address} refused the delta: {why}")]
    Refused {
        /// The CSI driver.
        driver: String,
        /// Its address.
        address: String,
        /// Its status code and message, or what was wrong with its answer.
        why: String,
    },
    /// The service could not be reached, or kept cutting the stream.
    #[error(
        "the SnapshotMetadata service of {driver} at {address} is unavailable after {tries} \
         tries without progress: {why}; this cycle compares the whole volume instead"
    )]
    Unavailable {
        /// The CSI driver.
        driver: String,
        /// Its address.
        address: String,
        /// Tries made since the last progress.
        tries: u32,
        /// The last failure.
        why: String,
    },
}

/// How often and how patiently a cut or unreachable stream is tried again.
#[derive(Clone, Copy, Debug)]
pub struct Retry {
    /// Tries in a row without a response before giving up.
    pub tries: u32,
    /// The pause after the first failure, doubled after each.
    pub first_backoff: Duration,
}

impl Default for Retry {
    fn default() -> Self {
        Retry {
            tries: 5,
            first_backoff: Duration::from_millis(200),
        }
    }
}

/// The changed ranges of a volume between two snapshots.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Changed {
    /// The volume's size, as the service says.
    pub capacity: u64,
    /// Sorted, merged where they touch or overlap, within `capacity`.
    pub ranges: Vec<Range<u64>>,
    /// Calls it took: more than one when a stream was cut and resumed.
    pub calls: u32,
}

impl Changed {
    /// Bytes in the ranges.
    pub fn bytes(&self) -> u64 {
        self.ranges.iter().map(|r| r.end - r.start).sum()
    }
}

/// What to compare: a base snapshot's CSI handle (its VolumeSnapshotContent's
/// `status.snapshotHandle`: the base may already be deleted) against a VolumeSnapshot.
#[derive(Clone, Copy, Debug)]
pub struct DeltaOf<'a> {
    /// The namespace of the target VolumeSnapshot.
    pub namespace: &'a str,
    /// The base snapshot's CSI handle.
    pub base_snapshot_id: &'a str,
    /// The target VolumeSnapshot's name.
    pub target_snapshot_name: &'a str,
}

/// The SnapshotMetadataService of `driver`.
pub async fn service(client: kube::Client, driver: &str) -> Result<Service, MetadataError> {
    let (group, version, kind) = SERVICE_GVK;
    let resource = ApiResource::from_gvk(&GroupVersionKind::gvk(group, version, kind));
    let api: Api<DynamicObject> = Api::all_with(client, &resource);
    let no = |why: String| MetadataError::NoService {
        driver: driver.into(),
        why,
    };
    let object = match api.get_opt(driver).await {
        Ok(Some(o)) => o,
        Ok(None) => return Err(no(format!("no {kind} named {driver}"))),
        Err(e) => return Err(no(format!("cannot read {kind} {driver}: {e}"))),
    };
    let spec = &object.data["spec"];
    let field = |name: &str| {
        spec[name]
            .as_str()
            .filter(|v| !v.is_empty())
            .map(str::to_string)
            .ok_or_else(|| no(format!("{kind} {driver} has no spec.{name}")))
    };
    let ca = {
        use base64::Engine;
        base64::engine::general_purpose::STANDARD
            .decode(field("caCert")?)
            .map_err(|e| no(format!("{kind} {driver}: spec.caCert is not base64: {e}")))?
    };
    Ok(Service {
        driver: driver.into(),
        address: field("address")?,
        ca,
        audience: field("audience")?,
    })
}

/// A token of ServiceAccount `namespace/name` for `audience`, valid ten minutes: what
/// the sidecar's TokenReview accepts.
pub async fn token(
    client: kube::Client,
    namespace: &str,
    name: &str,
    audience: &str,
) -> Result<String, MetadataError> {
    let api: Api<ServiceAccount> = Api::namespaced(client, namespace);
    let request = TokenRequest {
        spec: TokenRequestSpec {
            audiences: vec![audience.into()],
            expiration_seconds: Some(600),
            ..Default::default()
        },
        ..Default::default()
    };
    let answer = api
        .create_token_request(name, &PostParams::default(), &request)
        .await
        .map_err(|e| MetadataError::Token {
            service_account: format!("{namespace}/{name}"),
            audience: audience.into(),
            why: e.to_string(),
        })?;
    Ok(answer.status.map(|s| s.token).unwrap_or_default())
}

/// The ranges changed between the two snapshots `of` names, streamed from `service`
/// with `token`; a cut stream resumes after the last range received.
pub async fn changed(
    service: &Service,
    token: &str,
    of: DeltaOf<'_>,
    retry: Retry,
) -> Result<Changed, MetadataError> {
    let refused = |why: String| MetadataError::Refused {
        driver: service.driver.clone(),
        address: service.address.clone(),
        why,
    };
    let mut ranges: Vec<Range<u64>> = Vec::new();
    let (mut capacity, mut next, mut calls, mut failures) = (0u64, 0u64, 0u32, 0u32);
    let mut backoff = retry.first_backoff;
    loop {
        calls += 1;
        let outcome = stream_from(service, token, of, next, |response| {
            let cap = u64::try_from(response.volume_capacity_bytes)
                .map_err(|_| format!("a capacity of {}", response.volume_capacity_bytes))?;
            capacity = cap;
            for b in &response.block_metadata {
                let (Ok(start), Ok(len)) =
                    (u64::try_from(b.byte_offset), u64::try_from(b.size_bytes))
                else {
                    return Err(format!(
                        "a block at {} of {} bytes",
                        b.byte_offset, b.size_bytes
                    ));
                };
                let end = start
                    .checked_add(len)
                    .filter(|&e| e <= cap && len > 0)
                    .ok_or_else(|| {
                        format!("a block at {start} of {len} bytes, past the capacity {cap}")
                    })?;
                ranges.push(start..end);
                next = next.max(end);
            }
            // Progress: the tries count again from here.
            failures = 0;
            backoff = retry.first_backoff;
            Ok(())
        })
        .await;
        match outcome {
            Ok(()) => {
                return Ok(Changed {
                    capacity,
                    // A resumed stream may repeat the block it was cut in.
                    ranges: merge_ranges(ranges),
                    calls,
                });
            }
            Err(Failure::Nonsense(why)) => {
                return Err(refused(format!("it answered {why}")));
            }
            Err(Failure::Status(s)) if !transient(s.code()) => {
                return Err(refused(format!("{:?}: {}", s.code(), s.message())));
            }
            Err(failure) => {
                failures += 1;
                if failures >= retry.tries {
                    return Err(MetadataError::Unavailable {
                        driver: service.driver.clone(),
                        address: service.address.clone(),
                        tries: failures,
                        why: failure.to_string(),
                    });
                }
                tracing::info!(
                    driver = %service.driver,
                    resume_at = next,
                    "snapshot metadata stream cut ({failure}); resuming"
                );
                tokio::time::sleep(backoff).await;
                backoff = (backoff * 2).min(Duration::from_secs(10));
            }
        }
    }
}

/// Why one call ended early.
#[derive(Debug, thiserror::Error)]
enum Failure {
    #[error("cannot connect: {0}")]
    Connect(String),
    #[error("{}: {}", .0.code(), .0.message())]
    Status(tonic::Status),
    #[error("{0}")]
    Nonsense(String),
}

/// One call from `starting_offset`, each response handed to `each`.
async fn stream_from(
    service: &Service,
    token: &str,
    of: DeltaOf<'_>,
    starting_offset: u64,
    mut each: impl FnMut(&transport::snapshot_metadata::GetMetadataDeltaResponse) -> Result<(), String>,
) -> Result<(), Failure> {
    let host = host_of(&service.address);
    let tls = transport::tls::client_trusting(&service.ca, host);
    let endpoint = Endpoint::from_shared(format!("https://{}", service.address))
        .and_then(|e| e.tls_config(tls))
        .map_err(|e| Failure::Connect(e.to_string()))?
        .connect_timeout(Duration::from_secs(10));
    let channel = endpoint
        .connect()
        .await
        .map_err(|e| Failure::Connect(mover_engine::remote::error_chain(&e)))?;
    let mut client = SnapshotMetadataClient::new(channel);
    let mut stream = client
        .get_metadata_delta(GetMetadataDeltaRequest {
            security_token: token.into(),
            namespace: of.namespace.into(),
            base_snapshot_id: of.base_snapshot_id.into(),
            target_snapshot_name: of.target_snapshot_name.into(),
            starting_offset: starting_offset as i64,
            max_results: 0,
        })
        .await
        .map_err(Failure::Status)?
        .into_inner();
    while let Some(response) = stream.message().await.map_err(Failure::Status)? {
        each(&response).map_err(Failure::Nonsense)?;
    }
    Ok(())
}

/// Worth another try: the service or the path to it failed, not the request.
fn transient(code: Code) -> bool {
    matches!(
        code,
        Code::Unavailable
            | Code::Unknown
            | Code::Internal
            | Code::Cancelled
            | Code::DeadlineExceeded
            | Code::Aborted
            | Code::ResourceExhausted
    )
}

/// HOST of HOST:PORT or [V6]:PORT: the name the sidecar's certificate must carry.
fn host_of(address: &str) -> &str {
    let host = address.rsplit_once(':').map_or(address, |(h, _)| h);
    host.trim_start_matches('[').trim_end_matches(']')
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn ranges_merge_where_they_touch_or_overlap() {
        let got = merge_ranges(vec![
            8192..12288,
            0..4096,
            4096..8192,
            20480..24576,
            22528..26624,
        ]);
        assert_eq!(got, vec![0..12288, 20480..26624]);
        assert_eq!(merge_ranges(vec![]), Vec::<Range<u64>>::new());
    }

    #[test]
    fn the_host_is_the_address_without_its_port() {
        assert_eq!(host_of("127.0.0.1:6443"), "127.0.0.1");
        assert_eq!(host_of("[fd00::1]:6443"), "fd00::1");
        assert_eq!(host_of("sidecar.csi.svc"), "sidecar.csi.svc");
    }
}
