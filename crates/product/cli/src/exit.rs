//! Exit statuses of the `mx` commands and how an error chain is printed.

/// `mx worker`: another live process holds the worker id (refused at start), or a newer
/// process took it over while this one was away; the engine stopped serving first.
pub const EXIT_DISPLACED: i32 = 3;
/// `mx worker --reconnect-timeout-s N` (N > 0): the control plane stayed unreachable that long
/// (sysexits' EX_UNAVAILABLE).
pub const EXIT_CONTROL_UNREACHABLE: i32 = 69;
/// `mx-lab publish` without `--stay`: a version was not declared or committed within `--wait-s`
/// (sysexits' EX_TEMPFAIL: nothing is wrong with the process; run it again).
pub const EXIT_NOT_COMMITTED: i32 = 75;

/// `mx refit` / `mx commit`: the refit ended ABORTED (nothing was applied; every worker kept
/// its version).
pub const EXIT_ABORTED: i32 = 10;
/// `mx refit` / `mx commit`: the refit ended ROLLED_BACK (every worker is back on its previous
/// version).
pub const EXIT_ROLLED_BACK: i32 = 11;
/// `mx refit` / `mx commit`: the refit ended FENCED (a worker could not be brought back and
/// stays gated until refitted again).
pub const EXIT_FENCED: i32 = 12;
/// The control plane refused the caller's credentials or role (sysexits' EX_NOPERM).
pub const EXIT_NO_PERMISSION: i32 = 77;
/// TLS refused the connection to the control plane (its certificate, the client's CA), or
/// one side spoke TLS and the other did not (sysexits' EX_PROTOCOL): not "unreachable".
pub const EXIT_TLS: i32 = 76;

/// The exit status for `e`: the documented ones above for the errors that have one, 1
/// otherwise. (`mx control` exits 74 itself when its journal cannot be written.) Every
/// command exits 69 when the control plane is unreachable.
pub fn exit_code(e: &anyhow::Error) -> i32 {
    for cause in e.chain() {
        if let Some(r) = cause.downcast_ref::<crate::refit_cmd::NotCommitted>() {
            return match r.outcome {
                Some(mx_control::Outcome::Aborted) => EXIT_ABORTED,
                Some(mx_control::Outcome::RolledBack) => EXIT_ROLLED_BACK,
                Some(mx_control::Outcome::Fenced) => EXIT_FENCED,
                _ => 1,
            };
        }
        if let Some(c) = cause.downcast_ref::<mx_control::Error>() {
            if matches!(c, mx_control::Error::Tls { .. }) {
                return EXIT_TLS;
            }
            match c.code() {
                tonic::Code::Unavailable => return EXIT_CONTROL_UNREACHABLE,
                tonic::Code::Unauthenticated | tonic::Code::PermissionDenied => {
                    return EXIT_NO_PERMISSION
                }
                _ => {}
            }
        }
        if let Some(w) = cause.downcast_ref::<mx_worker::Error>() {
            match w {
                mx_worker::Error::Displaced { .. } => return EXIT_DISPLACED,
                mx_worker::Error::ReconnectTimeout { .. } => return EXIT_CONTROL_UNREACHABLE,
                _ => {}
            }
        }
        if let Some(mx_publisher::Error::Timeout { .. }) = cause.downcast_ref() {
            return EXIT_NOT_COMMITTED;
        }
    }
    1
}

/// `e` and its causes, joined by ": " (as anyhow's `{:#}`), leaving out a cause whose text the
/// message so far already holds: many error types print their source inline and also return it
/// from `source()`, which would print it twice ("Address already in use (os error 98): Address
/// already in use (os error 98)").
pub fn error_chain(e: &anyhow::Error) -> String {
    let mut out = String::new();
    for cause in e.chain() {
        let c = cause.to_string();
        if c.is_empty() || out.contains(&c) {
            continue;
        }
        if !out.is_empty() {
            out.push_str(": ");
        }
        out.push_str(&c);
    }
    out
}

#[cfg(test)]
mod tests {
    use super::{error_chain, exit_code};

    #[test]
    fn each_refit_outcome_and_control_plane_failure_has_its_exit_status() {
        use mx_control::Outcome;
        let ended = |outcome| {
            anyhow::Error::new(crate::refit_cmd::NotCommitted {
                id: 7,
                label: "step-3".into(),
                outcome,
                reason: "why".into(),
            })
            .context("mx refit")
        };
        assert_eq!(exit_code(&ended(Some(Outcome::Aborted))), 10);
        assert_eq!(exit_code(&ended(Some(Outcome::RolledBack))), 11);
        assert_eq!(exit_code(&ended(Some(Outcome::Fenced))), 12);
        assert_eq!(exit_code(&ended(None)), 1);
        let rpc = |code| {
            anyhow::Error::new(mx_control::Error::Rpc {
                rpc: "Refit",
                code,
                message: "m".into(),
            })
        };
        assert_eq!(exit_code(&rpc(tonic::Code::Unavailable)), 69);
        assert_eq!(exit_code(&rpc(tonic::Code::Unauthenticated)), 77);
        assert_eq!(exit_code(&rpc(tonic::Code::PermissionDenied)), 77);
        assert_eq!(exit_code(&rpc(tonic::Code::InvalidArgument)), 1);
        assert_eq!(exit_code(&anyhow::anyhow!("other")), 1);
    }

    /// Prints its source inline and also returns it from `source()`, as `#[error("x: {0}")]`
    /// with `#[from]` does.
    #[derive(Debug)]
    struct Inline(std::io::Error);

    impl std::fmt::Display for Inline {
        fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
            write!(f, "bind 127.0.0.1:7700: {}", self.0)
        }
    }

    impl std::error::Error for Inline {
        fn source(&self) -> Option<&(dyn std::error::Error + 'static)> {
            Some(&self.0)
        }
    }

    #[test]
    fn a_cause_already_in_the_message_is_printed_once() {
        let io = std::io::Error::new(std::io::ErrorKind::AddrInUse, "Address already in use");
        let e = anyhow::Error::new(Inline(io)).context("mx control");
        assert_eq!(
            error_chain(&e),
            "mx control: bind 127.0.0.1:7700: Address already in use"
        );
        // Causes not in the message are kept, in order.
        let e = anyhow::anyhow!("inner").context("middle").context("outer");
        assert_eq!(error_chain(&e), "outer: middle: inner");
    }
}
