//! The agent's errors as its gRPC services answer them. Handlers work with
//! [`ServiceError`]; its conversion to [`tonic::Status`] below is the one place that picks
//! a status code, and [`answer`] applies it at the edge of every call.

use crate::{hydrate::HydrateError, schedule::ApplyError};
use std::{fmt::Display, future::Future};
use tonic::{Response, Status};
use transport::refusal::Refusal;

/// Why an agent call failed: the variant is the status code the caller gets, the text
/// its message (what `mover` prints, and what tests match).
#[derive(Clone, Debug, thiserror::Error)]
pub(crate) enum ServiceError {
    /// What the call names is not here: an export, a session, a relationship, a
    /// hydration, a schedule.
    #[error("{0}")]
    NotFound(String),
    /// The call itself is malformed: a missing or impossible field.
    #[error("{0}")]
    InvalidArgument(String),
    /// The call is sound but the state here refuses it (a stale epoch, a volume in use,
    /// the wrong role).
    #[error("{0}")]
    FailedPrecondition(String),
    /// The export may not be used so: written while read-only, registered where it may
    /// not be.
    #[error("{0}")]
    PermissionDenied(String),
    /// A chunk or a write past the end of the volume.
    #[error("{0}")]
    OutOfRange(String),
    /// What the call would make exists already.
    #[error("{0}")]
    AlreadyExists(String),
    /// The work began and did not complete: a cycle failed, a session was replaced.
    #[error("{0}")]
    Aborted(String),
    /// Not now: retry later.
    #[error("{0}")]
    Unavailable(String),
    /// An agent-side failure the caller cannot fix.
    #[error("{0}")]
    Internal(String),
    /// A refusal the caller acts on by its kind (the status carries it, see
    /// [`Refusal`]), with what to say.
    #[error("{1}")]
    Refused(Refusal, String),
    /// The caller's own stream failed: its status is passed back as it is.
    #[error("{}", .0.message())]
    Stream(Status),
}

/// An agent-side failure the caller cannot fix, from any error.
pub(super) fn internal(e: impl Display) -> ServiceError {
    ServiceError::Internal(e.to_string())
}

/// The one mapping of the agent's errors to gRPC statuses.
impl From<ServiceError> for Status {
    fn from(e: ServiceError) -> Status {
        match e {
            ServiceError::NotFound(m) => Status::not_found(m),
            ServiceError::InvalidArgument(m) => Status::invalid_argument(m),
            ServiceError::FailedPrecondition(m) => Status::failed_precondition(m),
            ServiceError::PermissionDenied(m) => Status::permission_denied(m),
            ServiceError::OutOfRange(m) => Status::out_of_range(m),
            ServiceError::AlreadyExists(m) => Status::already_exists(m),
            ServiceError::Aborted(m) => Status::aborted(m),
            ServiceError::Unavailable(m) => Status::unavailable(m),
            ServiceError::Internal(m) => Status::internal(m),
            ServiceError::Refused(r, m) => r.status(m),
            ServiceError::Stream(s) => s,
        }
    }
}

impl From<HydrateError> for ServiceError {
    fn from(e: HydrateError) -> ServiceError {
        let m = e.to_string();
        match e {
            HydrateError::Refused { .. } => ServiceError::FailedPrecondition(m),
            HydrateError::Source { .. } => ServiceError::Unavailable(m),
            HydrateError::Local { .. } => ServiceError::Internal(m),
        }
    }
}

impl From<ApplyError> for ServiceError {
    fn from(e: ApplyError) -> ServiceError {
        match e {
            ApplyError::Invalid(why) => ServiceError::InvalidArgument(why),
            ApplyError::Save(why) => ServiceError::Internal(why),
        }
    }
}

/// The edge of a gRPC call: runs the handler's body and answers with its message, or
/// with its error mapped to a status.
pub(super) async fn answer<T>(
    body: impl Future<Output = Result<T, ServiceError>>,
) -> Result<Response<T>, Status> {
    body.await.map(Response::new).map_err(Status::from)
}

#[cfg(test)]
mod tests {
    use super::*;
    use tonic::Code;

    #[test]
    fn each_error_is_answered_with_its_code_and_its_text_unchanged() {
        let text = "volume \"v\" is exported read-only; it can be a source, never a destination";
        type Make = fn(String) -> ServiceError;
        let cases: [(Make, Code); 9] = [
            (ServiceError::NotFound, Code::NotFound),
            (ServiceError::InvalidArgument, Code::InvalidArgument),
            (ServiceError::FailedPrecondition, Code::FailedPrecondition),
            (ServiceError::PermissionDenied, Code::PermissionDenied),
            (ServiceError::OutOfRange, Code::OutOfRange),
            (ServiceError::AlreadyExists, Code::AlreadyExists),
            (ServiceError::Aborted, Code::Aborted),
            (ServiceError::Unavailable, Code::Unavailable),
            (ServiceError::Internal, Code::Internal),
        ];
        for (make, code) in cases {
            let e = make(text.to_string());
            assert_eq!(e.to_string(), text);
            let s = Status::from(e);
            assert_eq!((s.code(), s.message()), (code, text));
        }
    }

    #[test]
    fn a_status_from_the_callers_stream_is_passed_back_as_it_is() {
        let mut from_stream = Status::cancelled("h2 protocol error: stream reset");
        from_stream
            .metadata_mut()
            .insert("x-mover", "kept".parse().expect("ascii"));
        let s = Status::from(ServiceError::Stream(from_stream.clone()));
        assert_eq!(s.code(), from_stream.code());
        assert_eq!(s.message(), from_stream.message());
        assert_eq!(
            s.metadata().get("x-mover"),
            from_stream.metadata().get("x-mover")
        );
    }

    #[test]
    fn hydration_and_schedule_errors_keep_their_codes() {
        let refused = HydrateError::Refused {
            what: "hydrate v".into(),
            why: "in use".into(),
        };
        let s = Status::from(ServiceError::from(refused));
        assert_eq!(
            (s.code(), s.message()),
            (Code::FailedPrecondition, "hydrate v: in use")
        );
        let source = HydrateError::Source {
            source_name: "agent://a:1/v".into(),
            message: "gone".into(),
            retryable: true,
        };
        let s = Status::from(ServiceError::from(source));
        assert_eq!(
            (s.code(), s.message()),
            (Code::Unavailable, "source agent://a:1/v: gone")
        );
        let s = Status::from(ServiceError::from(ApplyError::Invalid("bad cron".into())));
        assert_eq!((s.code(), s.message()), (Code::InvalidArgument, "bad cron"));
        let s = Status::from(ServiceError::from(ApplyError::Save("disk full".into())));
        assert_eq!((s.code(), s.message()), (Code::Internal, "disk full"));
    }
}
