//! The sides and states the control APIs report, as types: one spelling for the agent
//! that writes them and the controller that reads them. On the wire they stay the
//! words users see in `mover replicate status` and `kubectl describe`.

use crate::{control, schedule};

macro_rules! named {
    ($(#[$doc:meta])* $name:ident { $($(#[$vdoc:meta])* $variant:ident = $word:literal,)+ }) => {
        $(#[$doc])*
        #[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
        pub enum $name {
            $($(#[$vdoc])* $variant,)+
        }

        impl $name {
            /// The word on the wire.
            pub const fn name(self) -> &'static str {
                match self {
                    $($name::$variant => $word,)+
                }
            }

            /// The value `word` names, if any.
            pub fn parse(word: &str) -> Option<Self> {
                match word {
                    $($word => Some($name::$variant),)+
                    _ => None,
                }
            }
        }

        /// Compared with the word on the wire.
        impl PartialEq<&str> for $name {
            fn eq(&self, word: &&str) -> bool {
                self.name() == *word
            }
        }

        impl std::fmt::Display for $name {
            fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
                f.write_str(self.name())
            }
        }
    };
}

named! {
    /// Which side of a relationship an agent holds.
    Side {
        /// Its volume is the source: it runs the cycles.
        Primary = "primary",
        /// Its volume is the copy cycles are applied to.
        Secondary = "secondary",
    }
}

named! {
    /// How a relationship is doing, as its agent reports it.
    RelationshipState {
        /// Cycles complete on time.
        Replicating = "Replicating",
        /// The last cycle failed, or none completed for several intervals.
        Degraded = "Degraded",
        /// No cycle has completed yet: the first copy is under way.
        Resyncing = "Resyncing",
        /// Another side was promoted: this one stopped writing.
        Fenced = "Fenced",
        /// Both sides were primary: nothing runs until an operator picks one.
        SplitBrain = "SplitBrain",
        /// Cycles are paused by request.
        Paused = "Paused",
        /// The secondary side, applying cycles.
        Secondary = "Secondary",
    }
}

named! {
    /// How a snapshot schedule is doing, as its agent reports it.
    ScheduleState {
        /// Waiting for its next time.
        Idle = "Idle",
        /// Taking a snapshot now.
        Running = "Running",
        /// Its last run failed.
        Failing = "Failing",
    }
}

impl control::Status {
    /// The side this status reports, if the agent named one this side knows.
    pub fn side(&self) -> Option<Side> {
        Side::parse(&self.role)
    }

    /// The relationship's state, if the agent named one this side knows.
    pub fn relationship_state(&self) -> Option<RelationshipState> {
        RelationshipState::parse(&self.state)
    }
}

impl schedule::Status {
    /// The schedule's state, if the agent named one this side knows.
    pub fn schedule_state(&self) -> Option<ScheduleState> {
        ScheduleState::parse(&self.state)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_word_parses_back_to_its_value_and_others_to_none() {
        for s in [Side::Primary, Side::Secondary] {
            assert_eq!(Side::parse(s.name()), Some(s));
        }
        assert_eq!(
            RelationshipState::parse(RelationshipState::SplitBrain.name()),
            Some(RelationshipState::SplitBrain)
        );
        assert_eq!(
            ScheduleState::parse("Failing"),
            Some(ScheduleState::Failing)
        );
        assert_eq!(Side::parse("Primary"), None);
    }
}
