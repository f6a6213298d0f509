//! Who is calling an agent, and what they may do: two roles, each proven by a bearer
//! token or by a client certificate from the agent's own CA.
//!
//! - **control**: registers and removes exports, creates and steers relationships,
//!   schedules and hydrations (the controller of the agent's own cluster, an operator).
//! - **replication**: runs cycles, hydrations and pulls against the exports its
//!   relationship names, and nothing else (a peer cluster's agents, this cluster's other
//!   agents).
//!
//! A certificate carries its role as a URI name ([`CONTROLLER_URI`], [`AGENT_URI_PREFIX`]),
//! which only the cluster's signer puts there.

use subtle::ConstantTimeEq;
use tonic::{Request, Status, metadata::MetadataValue, service::Interceptor};

/// The URI name of the controller's client certificate: the control role.
pub const CONTROLLER_URI: &str = "spiffe://replication.mover/controller";
/// The URI name of an agent's certificate, followed by its node's name: the replication
/// role (and, as its DNS name, the name peers check).
pub const AGENT_URI_PREFIX: &str = "spiffe://replication.mover/agent/";

/// What a caller may do.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord)]
pub enum Role {
    /// Cycles, hydrations and pulls against the exports its relationship names.
    Replication,
    /// Everything: exports, relationships, schedules, hydrations.
    Control,
}

impl Role {
    fn name(self) -> &'static str {
        match self {
            Role::Replication => "replication",
            Role::Control => "control",
        }
    }
}

/// [`Caller::who`] of an unnamed line of the replication token file.
pub const REPLICATION_TOKEN: &str = "a cluster-wide replication token";

/// What a caller proved itself with: which relationships it may act on follows from it
/// ([`check_binding`]).
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Credential {
    /// The control token, the controller's certificate or an operator's.
    Control,
    /// The certificate of this cluster's agent on the node named.
    Agent(String),
    /// A named line of the replication token file: one peer cluster's credential.
    Peer(String),
    /// An unnamed line of the replication token file (any peer's, as before names).
    Unnamed,
}

/// The authenticated caller of one request (in its extensions once admitted).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Caller {
    /// What it may do.
    pub role: Role,
    /// How it proved itself ("the control token", "certificate of agent node-2").
    pub who: String,
    /// The credential, for the relationships bound to one.
    pub credential: Credential,
}

/// What a caller does to a relationship, for [`check_binding`].
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Act {
    /// Reads its volume (a peer's pull, a fill, a hold).
    Read,
    /// Writes a cycle into it, or raises its epoch.
    Write,
    /// Asks for its status or describes its export.
    Status,
}

/// Whether `caller` may `act` on `relationship`, which is bound to the peer credential
/// `binding` (`None`: to none). The control role may do anything. A peer's named token
/// acts only on the relationships bound to it; an unnamed one only on unbound ones;
/// this cluster's agents act on unbound and [`LOCAL_CREDENTIAL`]-bound ones, and only
/// read a peer-bound replica (fills and holds). The refusal names the rule.
///
/// [`LOCAL_CREDENTIAL`]: crate::cluster::LOCAL_CREDENTIAL
pub fn check_binding(
    caller: &Caller,
    relationship: &str,
    binding: Option<&str>,
    act: Act,
) -> Result<(), String> {
    use crate::cluster::LOCAL_CREDENTIAL;
    let verb = match act {
        Act::Read => "read",
        Act::Write => "write into",
        Act::Status => "see",
    };
    let bound = |b: &str| {
        if b == LOCAL_CREDENTIAL {
            "this cluster's own agents".to_string()
        } else {
            format!("peer credential {b:?}")
        }
    };
    let refused = |rule: &str| {
        Err(format!(
            "{} may not {verb} relationship {relationship:?}: it is bound to {}; {rule}",
            caller.who,
            binding.map_or("no peer credential".into(), bound),
        ))
    };
    match (&caller.credential, binding) {
        (Credential::Control, _) => Ok(()),
        (Credential::Peer(n), Some(b)) if n == b => Ok(()),
        (Credential::Peer(_), _) => refused(
            "a peer's token acts only on the relationships bound to it (the class secret's \
             peer-credential, or `mover replicate update --peer-credential`)",
        ),
        (Credential::Unnamed, None) => Ok(()),
        (Credential::Unnamed, Some(_)) => refused(
            "give the peer its own token: a named line NAME TOKEN of replication_token_file",
        ),
        (Credential::Agent(_), None) => Ok(()),
        (Credential::Agent(_), Some(b)) if b == LOCAL_CREDENTIAL => Ok(()),
        (Credential::Agent(_), Some(_)) if act == Act::Read => Ok(()),
        (Credential::Agent(_), Some(_)) => refused(
            "this cluster's agents only read a replica bound to a peer cluster (fills, holds)",
        ),
    }
}

/// The credentials an agent accepts.
#[derive(Clone, Debug, Default)]
pub struct Credentials {
    /// Bearer token of the control role (`token_file`).
    pub control_token: Option<String>,
    /// Bearer tokens of the replication role (`replication_token_file`: what peer
    /// clusters present), each with its peer credential's name if it has one.
    pub replication_tokens: Vec<crate::cluster::ReplicationToken>,
    /// The TLS layer checks client certificates against the agent's CA: a certificate
    /// that got through proves its role.
    pub client_certificates: bool,
}

/// A server-side interceptor that admits a call only from a caller of at least `needs`,
/// and records the [`Caller`] in the request's extensions.
#[derive(Clone)]
pub struct Authorize {
    credentials: std::sync::Arc<Credentials>,
    needs: Role,
    /// What the service is, for the refusal ("the relationship control API").
    service: &'static str,
}

impl Authorize {
    /// Admits callers of role `needs` (or above) to `service`.
    pub fn new(
        credentials: std::sync::Arc<Credentials>,
        needs: Role,
        service: &'static str,
    ) -> Self {
        Authorize {
            credentials,
            needs,
            service,
        }
    }

    /// Who `req` comes from, or why it is refused.
    pub fn caller<T>(&self, req: &Request<T>) -> Result<Caller, Status> {
        let given = req
            .metadata()
            .get("authorization")
            .map(|v| v.as_bytes().strip_prefix(b"Bearer ").unwrap_or_default());
        if let Some(given) = given {
            let c = &self.credentials;
            // Constant time, so a token cannot be guessed byte by byte from timings.
            let matches = |t: &str| bool::from(given.ct_eq(t.as_bytes()));
            if c.control_token.as_deref().is_some_and(matches) {
                return Ok(Caller {
                    role: Role::Control,
                    who: "the control token".into(),
                    credential: Credential::Control,
                });
            }
            if let Some(t) = c.replication_tokens.iter().find(|t| matches(&t.token)) {
                return Ok(match &t.name {
                    Some(name) => Caller {
                        role: Role::Replication,
                        who: format!("the token of peer credential {name:?}"),
                        credential: Credential::Peer(name.clone()),
                    },
                    None => Caller {
                        role: Role::Replication,
                        who: REPLICATION_TOKEN.into(),
                        credential: Credential::Unnamed,
                    },
                });
            }
            return Err(Status::unauthenticated(
                "wrong bearer token: pass the agent's token (--token-file or MOVER_TOKEN; a \
                 peer cluster's token from the class's secret)",
            ));
        }
        if self.credentials.client_certificates
            && let Some(certs) = req.peer_certs()
            && let Some(leaf) = certs.first()
        {
            let caller = certificate_caller(leaf.as_ref());
            // An operator's certificate (no mover role in it) is one factor where the
            // agent also has a control token: both are asked for, as before roles.
            if caller.who != OPERATOR_CERTIFICATE || self.credentials.control_token.is_none() {
                return Ok(caller);
            }
            return Err(Status::unauthenticated(
                "missing bearer token: this agent asks for its token beside the client \
                 certificate (--token-file or MOVER_TOKEN)",
            ));
        }
        Err(Status::unauthenticated(
            "no credential: present the agent's bearer token (--token-file or MOVER_TOKEN) \
             or a client certificate from its CA (--tls-cert, --tls-key)",
        ))
    }
}

/// The role a certificate from the agent's CA proves: from its mover URI name; one
/// naming no role is an operator's own (a CA given in agent.toml's `[tls]`), with control.
pub fn certificate_caller(der: &[u8]) -> Caller {
    let Some(facts) = crate::tls::Facts::of_der(der) else {
        // Unreadable: the least a certificate from the CA may do.
        return Caller {
            role: Role::Replication,
            who: "an unreadable certificate".into(),
            credential: Credential::Agent(String::new()),
        };
    };
    let uris = facts.uris;
    if uris.iter().any(|u| u == CONTROLLER_URI) {
        return Caller {
            role: Role::Control,
            who: "the controller's certificate".into(),
            credential: Credential::Control,
        };
    }
    if let Some(node) = uris.iter().find_map(|u| u.strip_prefix(AGENT_URI_PREFIX)) {
        return Caller {
            role: Role::Replication,
            who: format!("the certificate of agent {node}"),
            credential: Credential::Agent(node.into()),
        };
    }
    Caller {
        role: Role::Control,
        who: OPERATOR_CERTIFICATE.into(),
        credential: Credential::Control,
    }
}

/// Who a certificate from the agent's CA naming no mover role is.
const OPERATOR_CERTIFICATE: &str = "an operator's certificate";

impl Interceptor for Authorize {
    fn call(&mut self, mut req: Request<()>) -> Result<Request<()>, Status> {
        let caller = self.caller(&req)?;
        if caller.role < self.needs {
            return Err(Status::permission_denied(format!(
                "{} may not use {}: the {} role only runs cycles, hydrations and pulls \
                 against the exports its relationship names; this takes the {} role (the \
                 controller's certificate, or the agent's token_file)",
                caller.who,
                self.service,
                caller.role.name(),
                self.needs.name()
            )));
        }
        req.extensions_mut().insert(caller);
        Ok(req)
    }
}

/// A client-side interceptor that attaches the bearer token to every call.
#[derive(Clone)]
pub struct AttachToken {
    header: Option<MetadataValue<tonic::metadata::Ascii>>,
}

impl AttachToken {
    /// Attaches `token` (if any). Fails if the token is not printable ASCII.
    pub fn new(token: Option<&str>) -> Result<Self, Status> {
        let header = token
            .map(|t| {
                format!("Bearer {t}")
                    .parse()
                    .map_err(|_| Status::invalid_argument("the token must be printable ASCII"))
            })
            .transpose()?;
        Ok(AttachToken { header })
    }
}

impl Interceptor for AttachToken {
    fn call(&mut self, mut req: Request<()>) -> Result<Request<()>, Status> {
        if let Some(h) = &self.header {
            req.metadata_mut().insert("authorization", h.clone());
        }
        Ok(req)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn credentials() -> std::sync::Arc<Credentials> {
        std::sync::Arc::new(Credentials {
            control_token: Some("s3cret".into()),
            replication_tokens: vec![
                crate::cluster::ReplicationToken {
                    name: None,
                    token: "peer".into(),
                },
                crate::cluster::ReplicationToken {
                    name: Some("dr".into()),
                    token: "dr-token".into(),
                },
            ],
            client_certificates: false,
        })
    }

    #[test]
    fn each_token_proves_its_role_and_no_more() {
        let mut control = Authorize::new(credentials(), Role::Control, "the control API");
        let mut data = Authorize::new(credentials(), Role::Replication, "transfers");
        let with = |server: &mut Authorize, t: Option<&str>| {
            let req = AttachToken::new(t).unwrap().call(Request::new(())).unwrap();
            server
                .call(req)
                .map(|r| r.extensions().get::<Caller>().unwrap().role)
                .map_err(|s| (s.code(), s.message().to_string()))
        };
        assert_eq!(with(&mut control, Some("s3cret")), Ok(Role::Control));
        assert_eq!(with(&mut data, Some("s3cret")), Ok(Role::Control));
        assert_eq!(with(&mut data, Some("peer")), Ok(Role::Replication));
        assert_eq!(with(&mut data, Some("dr-token")), Ok(Role::Replication));
        let (code, message) = with(&mut control, Some("peer")).unwrap_err();
        assert_eq!(code, tonic::Code::PermissionDenied);
        assert!(message.contains("may not use the control API"), "{message}");
        for wrong in [Some("s3cre"), Some("s3cret2"), None] {
            assert_eq!(
                with(&mut data, wrong).unwrap_err().0,
                tonic::Code::Unauthenticated
            );
        }
    }

    #[test]
    fn a_certificate_proves_the_role_its_uri_names() {
        let cert = |uri: Option<&str>| {
            let key = rcgen::KeyPair::generate().unwrap();
            let mut p = rcgen::CertificateParams::new(vec!["node-2".to_string()]).unwrap();
            if let Some(u) = uri {
                p.subject_alt_names
                    .push(rcgen::SanType::URI(u.try_into().unwrap()));
            }
            p.self_signed(&key).unwrap().der().to_vec()
        };
        let agent = format!("{AGENT_URI_PREFIX}node-2");
        assert_eq!(
            certificate_caller(&cert(Some(&agent))).role,
            Role::Replication
        );
        assert_eq!(
            certificate_caller(&cert(Some(&agent))).who,
            "the certificate of agent node-2"
        );
        assert_eq!(
            certificate_caller(&cert(Some(CONTROLLER_URI))).role,
            Role::Control
        );
        assert_eq!(certificate_caller(&cert(None)).role, Role::Control);
    }

    #[test]
    fn a_relationship_bound_to_a_peer_is_that_peers_alone() {
        let caller = |credential: Credential| Caller {
            role: Role::Replication,
            who: format!("{credential:?}"),
            credential,
        };
        let (dr, eu) = (
            caller(Credential::Peer("dr".into())),
            caller(Credential::Peer("eu".into())),
        );
        let (unnamed, agent) = (
            caller(Credential::Unnamed),
            caller(Credential::Agent("n2".into())),
        );
        let control = Caller {
            role: Role::Control,
            who: "c".into(),
            credential: Credential::Control,
        };
        let check = |c: &Caller, b: Option<&str>, act| check_binding(c, "app/pg", b, act);
        for act in [Act::Read, Act::Write, Act::Status] {
            assert_eq!(check(&dr, Some("dr"), act), Ok(()));
            assert_eq!(check(&control, Some("dr"), act), Ok(()));
            assert_eq!(check(&unnamed, None, act), Ok(()));
            assert_eq!(check(&agent, None, act), Ok(()));
            assert_eq!(check(&agent, Some("local"), act), Ok(()));
            let refused = check(&eu, Some("dr"), act).unwrap_err();
            assert!(
                refused.contains("bound to peer credential \"dr\""),
                "{refused}"
            );
            assert!(check(&eu, None, act).is_err());
            assert!(check(&dr, Some("local"), act).is_err());
            let refused = check(&unnamed, Some("dr"), act).unwrap_err();
            assert!(refused.contains("give the peer its own token"), "{refused}");
        }
        assert_eq!(check(&agent, Some("dr"), Act::Read), Ok(()));
        let refused = check(&agent, Some("dr"), Act::Write).unwrap_err();
        assert!(
            refused.contains("may not write into relationship \"app/pg\""),
            "{refused}"
        );
    }
}
