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

/// [`Caller::who`] of a peer cluster's replication token.
pub const REPLICATION_TOKEN: &str = "a replication token";

/// The authenticated caller of one request (in its extensions once admitted).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Caller {
    /// What it may do.
    pub role: Role,
    /// How it proved itself ("the control token", "certificate of agent node-2").
    pub who: String,
}

/// The credentials an agent accepts.
#[derive(Clone, Debug, Default)]
pub struct Credentials {
    /// Bearer token of the control role (`token_file`).
    pub control_token: Option<String>,
    /// Bearer tokens of the replication role (`replication_token_file`: what peer
    /// clusters present).
    pub replication_tokens: Vec<String>,
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
            let matches = |t: &String| bool::from(given.ct_eq(t.as_bytes()));
            if c.control_token.as_ref().is_some_and(matches) {
                return Ok(Caller {
                    role: Role::Control,
                    who: "the control token".into(),
                });
            }
            if c.replication_tokens.iter().any(matches) {
                return Ok(Caller {
                    role: Role::Replication,
                    who: REPLICATION_TOKEN.into(),
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
        };
    };
    let uris = facts.uris;
    if uris.iter().any(|u| u == CONTROLLER_URI) {
        return Caller {
            role: Role::Control,
            who: "the controller's certificate".into(),
        };
    }
    if let Some(node) = uris.iter().find_map(|u| u.strip_prefix(AGENT_URI_PREFIX)) {
        return Caller {
            role: Role::Replication,
            who: format!("the certificate of agent {node}"),
        };
    }
    Caller {
        role: Role::Control,
        who: OPERATOR_CERTIFICATE.into(),
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
            replication_tokens: vec!["peer".into()],
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
}
