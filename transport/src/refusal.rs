//! Why an agent refused a call, as a type both ends share. The kind travels beside the
//! gRPC status code, in the trailer [`TRAILER`], so a caller matches a [`Refusal`], never
//! the words of a message (which stay free to say more).

/// The trailer that names a refusal's kind.
pub const TRAILER: &str = "mover-refusal";

/// A refusal a caller acts on by its kind.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Refusal {
    /// The caller's fencing epoch is older than one the agent has seen: another side
    /// was promoted since, and this one must stop writing (fenced) and resync.
    StaleEpoch,
    /// The session the call names is gone: it finished, was replaced, or the agent
    /// restarted. The caller opens a new one.
    NoSession,
    /// The export is a block volume whose device the kubelet has not mapped on this
    /// node yet (no pod of it runs here): the caller waits.
    NoDevice,
}

impl Refusal {
    const ALL: [Refusal; 3] = [Refusal::StaleEpoch, Refusal::NoSession, Refusal::NoDevice];

    /// The kind's name on the wire.
    pub fn name(self) -> &'static str {
        match self {
            Refusal::StaleEpoch => "stale-epoch",
            Refusal::NoSession => "no-session",
            Refusal::NoDevice => "no-device",
        }
    }

    /// The gRPC status code the kind is answered with.
    pub fn code(self) -> tonic::Code {
        match self {
            Refusal::StaleEpoch | Refusal::NoDevice => tonic::Code::FailedPrecondition,
            Refusal::NoSession => tonic::Code::NotFound,
        }
    }

    /// The status a server answers: the kind's code, `message`, and the kind in its
    /// trailer.
    pub fn status(self, message: impl Into<String>) -> tonic::Status {
        let mut s = tonic::Status::new(self.code(), message);
        s.metadata_mut().insert(
            TRAILER,
            tonic::metadata::MetadataValue::from_static(self.name()),
        );
        s
    }

    /// The kind a status names, if it names one this side knows.
    pub fn of(status: &tonic::Status) -> Option<Refusal> {
        let name = status.metadata().get(TRAILER)?.to_str().ok()?;
        Refusal::ALL.into_iter().find(|r| r.name() == name)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_refusal_survives_its_status_and_a_plain_status_names_none() {
        for r in Refusal::ALL {
            let s = r.status("words may change");
            assert_eq!((Refusal::of(&s), s.code()), (Some(r), r.code()));
        }
        assert_eq!(
            Refusal::of(&tonic::Status::failed_precondition("stale epoch 1")),
            None
        );
    }
}
