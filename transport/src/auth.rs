//! Bearer tokens: the minimum authentication when TLS is off (tests), and a second factor
//! beside mTLS.

use subtle::ConstantTimeEq;
use tonic::{Request, Status, metadata::MetadataValue, service::Interceptor};

/// A server-side interceptor that admits only calls carrying `authorization: Bearer <token>`.
#[derive(Clone)]
pub struct RequireToken {
    token: Option<Vec<u8>>,
}

impl RequireToken {
    /// Checks against `token`; `None` admits every call (only where mTLS authenticates).
    pub fn new(token: Option<String>) -> Self {
        RequireToken {
            token: token.map(String::into_bytes),
        }
    }
}

impl Interceptor for RequireToken {
    fn call(&mut self, req: Request<()>) -> Result<Request<()>, Status> {
        let Some(want) = &self.token else {
            return Ok(req);
        };
        let given = req
            .metadata()
            .get("authorization")
            .and_then(|v| v.as_bytes().strip_prefix(b"Bearer "))
            .unwrap_or_default();
        // Constant time, so the token cannot be guessed byte by byte from timings.
        if given.ct_eq(want).into() {
            Ok(req)
        } else {
            Err(Status::unauthenticated(
                "missing or wrong bearer token: pass the agent's token with --token-file or MOVER_TOKEN",
            ))
        }
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

    #[test]
    fn only_the_right_token_passes() {
        let mut server = RequireToken::new(Some("s3cret".into()));
        let mut with = |t: Option<&str>| {
            let req = AttachToken::new(t).unwrap().call(Request::new(())).unwrap();
            server.call(req).map(|_| ()).map_err(|s| s.code())
        };
        assert_eq!(with(Some("s3cret")), Ok(()));
        assert_eq!(with(Some("s3cre")), Err(tonic::Code::Unauthenticated));
        assert_eq!(with(Some("s3cret2")), Err(tonic::Code::Unauthenticated));
        assert_eq!(with(None), Err(tonic::Code::Unauthenticated));
        assert!(RequireToken::new(None).call(Request::new(())).is_ok());
    }
}
