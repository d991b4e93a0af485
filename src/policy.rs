//! What a shard-partition's task does about a failure: one pure table from the error's
//! [`Kind`] (and whether the task was streaming or catching up) to an [`Action`]. The runner
//! (`job.rs`) matches on the action, never on the error or its text.

use crate::error::Kind;

/// What the task does next.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Action {
    /// Reconnect after a growing backoff, resuming from the last confirmed position (a
    /// catch-up starts over).
    BackOff,
    /// Another session holds the slot: retry soon, then less and less often.
    RetryBusy,
    /// The position is lost: send what is in the table by polling, then stream from a new one.
    CatchUp,
    /// Ownership is gone: end the task (without coordination, a newer epoch halts for good).
    Stop,
    /// Halt this shard-partition with the fix; it retries slowly and resumes once fixed.
    Halt,
}

/// Where the task was when the error came.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Phase {
    /// A streaming session (CDC or polling), or connecting one.
    Streaming,
    /// A catch-up after a lost position.
    CatchingUp,
}

/// The action for an error of `kind` met while in `phase`.
pub(crate) fn policy(kind: Kind, phase: Phase) -> Action {
    match (kind, phase) {
        (Kind::Definite, _) => Action::Halt,
        (Kind::Fenced, _) => Action::Stop,
        (Kind::Transient, _) => Action::BackOff,
        (Kind::Busy, Phase::Streaming) => Action::RetryBusy,
        (Kind::PositionLost, Phase::Streaming) => Action::CatchUp,
        // A catch-up that fails otherwise starts over after a backoff.
        (Kind::Busy | Kind::PositionLost, Phase::CatchingUp) => Action::BackOff,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn one_table_from_kind_and_phase_to_action() {
        use Action::*;
        use Phase::*;
        let table = [
            (Kind::Transient, Streaming, BackOff),
            (Kind::Busy, Streaming, RetryBusy),
            (Kind::PositionLost, Streaming, CatchUp),
            (Kind::Fenced, Streaming, Stop),
            (Kind::Definite, Streaming, Halt),
            (Kind::Transient, CatchingUp, BackOff),
            (Kind::Busy, CatchingUp, BackOff),
            (Kind::PositionLost, CatchingUp, BackOff),
            (Kind::Fenced, CatchingUp, Stop),
            (Kind::Definite, CatchingUp, Halt),
        ];
        for (kind, phase, action) in table {
            assert_eq!(policy(kind, phase), action, "{kind:?} while {phase:?}");
        }
    }
}
