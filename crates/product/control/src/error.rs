//! The control plane's error type, and its one mapping to `tonic::Status`.

use std::path::PathBuf;

use crate::types::{VersionState, WorkerState};

/// Errors from the control plane's state machine, journal, server and client. Each names the
/// version label, worker, slot, tensor, field or journal line at fault.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum Error {
    /// A wire message field that does not convert into its typed form.
    #[error("invalid field {field}: {reason}")]
    InvalidField {
        /// Path of the field, e.g. `manifest.shards[3].digest`.
        field: String,
        /// Why it was refused.
        reason: String,
    },
    /// No version with this label was declared.
    #[error("version {label:?} is not declared")]
    UnknownVersion {
        /// The label asked for.
        label: String,
    },
    /// A version with this label was declared with a different layout or tensor list.
    #[error("version {label:?} is already declared differently: {reason}")]
    VersionExists {
        /// The label.
        label: String,
        /// What differs.
        reason: String,
    },
    /// No worker with this id is registered.
    #[error("worker {worker_id:?} is not registered")]
    UnknownWorker {
        /// The worker id asked for.
        worker_id: String,
    },
    /// A registration (or command stream) for a worker id that belongs to another live
    /// process: the id's command stream is connected under another incarnation, or the
    /// registration names the engine of another connected worker. Maps to `ALREADY_EXISTS`
    /// (no other error of `RegisterWorker` or `WatchCommands` does), so the process refused
    /// knows it must stop serving rather than retry.
    #[error("worker id {worker_id:?} is held by another process: {reason}")]
    WorkerIdInUse {
        /// The worker id asked for.
        worker_id: String,
        /// Why (the live stream, or the engine URL already held by another worker).
        reason: String,
    },
    /// A manifest shard or piece names a tensor the version did not declare.
    #[error("version {label:?} slot {slot}: tensor {tensor} is not declared")]
    UndeclaredTensor {
        /// Version label.
        label: String,
        /// Source slot.
        slot: u32,
        /// The tensor at fault.
        tensor: String,
    },
    /// A manifest shard disagrees with the declaration on a tensor's dtype or global shape.
    #[error(
        "version {label:?} slot {slot}: tensor {tensor}: {what} mismatch: published {published}, declared {declared}"
    )]
    Mismatch {
        /// Version label.
        label: String,
        /// Source slot.
        slot: u32,
        /// The tensor at fault.
        tensor: String,
        /// `dtype` or `shape`.
        what: &'static str,
        /// What the manifest says.
        published: String,
        /// What the declaration says.
        declared: String,
    },
    /// A manifest entry that is internally inconsistent (box outside the shape, length vs box,
    /// slot out of range, wrong trainer layout).
    #[error("version {label:?} slot {slot}: {}{reason}", tensor_prefix(.tensor))]
    BadManifest {
        /// Version label.
        label: String,
        /// Source slot.
        slot: u32,
        /// The tensor at fault (empty when the manifest as a whole is at fault).
        tensor: String,
        /// Why.
        reason: String,
    },
    /// The version is not in a state that allows the call.
    #[error("version {label:?} is {state}: {reason}")]
    VersionState {
        /// Version label.
        label: String,
        /// Its current state.
        state: VersionState,
        /// What the call needed.
        reason: String,
    },
    /// A refit record or request does not fit the refit's state.
    #[error("refit {id}: {reason}")]
    Refit {
        /// Refit id.
        id: u64,
        /// What is wrong.
        reason: String,
    },
    /// A worker is not in a state that allows the call.
    #[error("worker {worker_id:?} is {state} (version {label:?}): {reason}")]
    WorkerState {
        /// The worker at fault.
        worker_id: String,
        /// Its current state.
        state: WorkerState,
        /// The label it is staging or staged (empty when none).
        label: String,
        /// What the call needed.
        reason: String,
    },
    /// Reading, writing or syncing the journal failed.
    #[error("journal {path}: {what}: {source}")]
    JournalIo {
        /// Journal file.
        path: PathBuf,
        /// What was being done.
        what: &'static str,
        /// The I/O error.
        source: std::io::Error,
    },
    /// A journal line that does not parse (other than a torn last line).
    #[error("journal {path} line {line}: {reason}")]
    JournalCorrupt {
        /// Journal file.
        path: PathBuf,
        /// 1-based line number.
        line: usize,
        /// Why.
        reason: String,
    },
    /// A snapshot of the state ([`crate::snapshot`]) that does not parse or verify.
    #[error("snapshot {path}: {reason}")]
    SnapshotCorrupt {
        /// Snapshot file.
        path: PathBuf,
        /// Why, naming the field or byte at fault.
        reason: String,
    },
    /// Replaying a journal record was refused by the state machine.
    #[error("journal {path} line {line}: replay failed: {source}")]
    Replay {
        /// Journal file.
        path: PathBuf,
        /// 1-based line number.
        line: usize,
        /// The state machine's error.
        source: Box<Error>,
    },
    /// Binding the listen address failed.
    #[error("cannot listen on {addr}: {source}")]
    Bind {
        /// The address.
        addr: std::net::SocketAddr,
        /// The I/O error.
        source: std::io::Error,
    },
    /// The gRPC transport failed (serving, or connecting to `addr`).
    #[error("gRPC transport ({addr}): {source}")]
    Transport {
        /// Listen or peer address.
        addr: String,
        /// The transport error.
        source: tonic::transport::Error,
    },
    /// TLS refused the connection to the control plane (its certificate, or the client's
    /// trust in it), or one side spoke TLS and the other did not: retrying cannot help.
    #[error("{rpc}: TLS: {reason}: {fix}")]
    Tls {
        /// The call (or `connect`).
        rpc: &'static str,
        /// What failed, as the TLS library said it.
        reason: String,
        /// What to do.
        fix: &'static str,
    },
    /// A call to the control plane returned an error status.
    #[error("{rpc}: {code:?}: {message}")]
    Rpc {
        /// RPC name, e.g. `Refit`.
        rpc: &'static str,
        /// The gRPC status code.
        code: tonic::Code,
        /// The server's message.
        message: String,
    },
    /// `wait_version` ended (its timeout passed, or the server shut down) without the version
    /// reaching the state.
    #[error("version {label:?} did not reach {wanted} (now {current}) before the wait ended")]
    WaitNotReached {
        /// Version label.
        label: String,
        /// The state waited for.
        wanted: VersionState,
        /// The state when the wait ended (`None` when never declared).
        current: OptionalState,
    },
    /// A fanned-out `GetVersion` answer could not be built: the version's record is
    /// inconsistent (its shards' Merkle root is not its id).
    #[error("fan-out answer: {reason}")]
    Fanout {
        /// What is inconsistent.
        reason: String,
    },
    /// A server task ended abnormally (panicked or was cancelled).
    #[error("server task: {reason}")]
    Task {
        /// What happened.
        reason: String,
    },
    /// This replica is no longer the leader of its epoch (a newer leader was elected): it must
    /// not act, and nothing was written.
    #[error("fenced at epoch {epoch}: {reason}")]
    Fenced {
        /// The epoch this replica led.
        epoch: i64,
        /// Why.
        reason: String,
    },
    /// The fleet contradicted the journal (`crate::testimony`): the control plane does not act
    /// on it until an operator decides.
    #[error("the control plane is halted: {reason}")]
    Halted {
        /// What contradicts the journal and what to do.
        reason: String,
    },
    /// The security configuration (token file, TLS files, the bind policy) is unusable.
    #[error("{what}: {reason}")]
    Config {
        /// What is at fault, e.g. `token file /etc/mx/tokens`.
        what: String,
        /// Why.
        reason: String,
    },
}

/// A version state that may be absent (label not declared), shown as `undeclared`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct OptionalState(pub Option<VersionState>);

impl std::fmt::Display for OptionalState {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self.0 {
            Some(s) => write!(f, "{s}"),
            None => f.write_str("undeclared"),
        }
    }
}

/// "tensor NAME: " for a message about one tensor; nothing when the whole manifest is at fault.
fn tensor_prefix(tensor: &str) -> String {
    if tensor.is_empty() {
        String::new()
    } else {
        format!("tensor {tensor}: ")
    }
}

impl Error {
    /// The gRPC code this error maps to (the client side keeps the server's code).
    pub fn code(&self) -> tonic::Code {
        use tonic::Code;
        match self {
            Error::InvalidField { .. }
            | Error::UndeclaredTensor { .. }
            | Error::Mismatch { .. }
            | Error::BadManifest { .. } => Code::InvalidArgument,
            Error::UnknownVersion { .. } => Code::NotFound,
            Error::VersionExists { .. } | Error::WorkerIdInUse { .. } => Code::AlreadyExists,
            // A worker must register before it is staged, refitted, watched or reports.
            Error::UnknownWorker { .. }
            | Error::VersionState { .. }
            | Error::Refit { .. }
            | Error::WorkerState { .. }
            | Error::Halted { .. } => Code::FailedPrecondition,
            Error::WaitNotReached { .. } => Code::DeadlineExceeded,
            Error::Fenced { .. } => Code::Unavailable,
            Error::Transport { .. } => Code::Unavailable,
            Error::Tls { .. } => Code::FailedPrecondition,
            Error::Rpc { code, .. } => *code,
            Error::JournalIo { .. }
            | Error::JournalCorrupt { .. }
            | Error::SnapshotCorrupt { .. }
            | Error::Replay { .. }
            | Error::Bind { .. }
            | Error::Config { .. }
            | Error::Fanout { .. }
            | Error::Task { .. } => Code::Internal,
        }
    }

    /// True for an error a caller should retry after a pause: the control plane is unreachable,
    /// restarting or shutting down (the transport failed, or a call ended `UNAVAILABLE`,
    /// `UNKNOWN`, `CANCELLED` or `DEADLINE_EXCEEDED` on the wire). Refusals (invalid fields,
    /// unknown versions, a worker id held by another process) are not transient, and neither
    /// is [`Error::WaitNotReached`] (the caller's own deadline decides).
    pub fn is_transient(&self) -> bool {
        use tonic::Code;
        match self {
            Error::Transport { .. } => true,
            Error::Rpc { code, .. } => matches!(
                code,
                Code::Unavailable | Code::Unknown | Code::Cancelled | Code::DeadlineExceeded
            ),
            _ => false,
        }
    }

    /// True when the control plane does not know the version asked for (on the server side
    /// [`Error::UnknownVersion`]; on the client side a NotFound answer to a version RPC).
    pub fn is_unknown_version(&self) -> bool {
        match self {
            Error::UnknownVersion { .. } => true,
            Error::Rpc { rpc, code, .. } => {
                *code == tonic::Code::NotFound
                    && matches!(*rpc, "GetVersion" | "WaitVersion" | "WaitReleased")
            }
            _ => false,
        }
    }

    /// True when the control plane refused a worker's registration or command stream because
    /// its id belongs to another live process ([`Error::WorkerIdInUse`], `ALREADY_EXISTS` on
    /// the wire): that worker was displaced and must stop serving.
    pub fn is_worker_id_in_use(&self) -> bool {
        match self {
            Error::WorkerIdInUse { .. } => true,
            Error::Rpc { rpc, code, .. } => {
                *code == tonic::Code::AlreadyExists
                    && matches!(*rpc, "RegisterWorker" | "WatchCommands" | "RetireWorker")
            }
            _ => false,
        }
    }

    /// Builds the client-side error from a status returned by `rpc`.
    pub(crate) fn rpc(rpc: &'static str, status: tonic::Status) -> Error {
        // A TLS refusal reaches a lazily connecting client as UNAVAILABLE (or UNKNOWN); plain
        // HTTP/2 sent to a TLS port comes back as INTERNAL "h2 protocol error".
        let transport = match status.code() {
            tonic::Code::Unavailable | tonic::Code::Unknown => true,
            tonic::Code::Internal => status.message().contains("h2 protocol error"),
            _ => false,
        };
        if transport {
            if let Some((reason, fix)) = tls_failure(&status) {
                return Error::Tls { rpc, reason, fix };
            }
        }
        let mut message = status.message().to_string();
        // An HTTP server that is not gRPC (a worker's engine routes, say) answers without a
        // grpc-status header; tonic maps its HTTP status to a code.
        if message.contains("grpc-status header missing") {
            message.push_str(
                " (the address answered plain HTTP, not gRPC: is it an mx control plane? A worker's --http port is not)",
            );
        }
        Error::Rpc {
            rpc,
            code: status.code(),
            message,
        }
    }
}

/// What TLS failure, if any, `e` (or a cause of it) is, and what to do about it: a client's
/// view of a connection the TLS layer refused, or of a TLS and a plain-text side meeting.
pub(crate) fn tls_failure(e: &(dyn std::error::Error + 'static)) -> Option<(String, &'static str)> {
    const LEAF: &str = "make a leaf certificate signed by a CA: basicConstraints CA:FALSE, the host name or IP address in subjectAltName, and give clients the CA as MX_CONTROL_CA (README, \"A secured fleet by hand\")";
    let mut cause = Some(e);
    while let Some(c) = cause {
        let text = match c.downcast_ref::<tonic::Status>() {
            Some(s) => s.message().to_string(),
            None => c.to_string(),
        };
        let found = [
            ("CaUsedAsEndEntity", "the control plane presents a CA certificate (CA:TRUE, as a one-line `openssl req -x509` makes) as its own", LEAF),
            ("NotValidForName", "the control plane's certificate does not name the host this client connects to", LEAF),
            ("UnknownIssuer", "the control plane's certificate is not signed by the CA this client trusts", "set MX_CONTROL_CA to the CA that signed the control plane's certificate"),
            ("Expired", "the control plane's certificate has expired (or is not yet valid)", LEAF),
            ("invalid peer certificate", "the control plane's certificate was refused", LEAF),
            ("InvalidContentType", "the server answered without TLS", "this server does not speak TLS: use http:// (or start it with --tls-cert and --tls-key)"),
            ("corrupt message", "the server answered without TLS", "this server does not speak TLS: use http:// (or start it with --tls-cert and --tls-key)"),
            ("h2 protocol error", "the server did not answer plain HTTP/2", "this server speaks TLS: use https:// (and MX_CONTROL_CA)"),
            ("frame with invalid size", "the server did not answer plain HTTP/2", "this server speaks TLS: use https:// (and MX_CONTROL_CA)"),
        ]
        .into_iter()
        .find(|(needle, _, _)| text.contains(needle));
        if let Some((_, what, fix)) = found {
            return Some((format!("{what} ({text})"), fix));
        }
        cause = c.source();
    }
    None
}

/// The one place where control-plane errors become gRPC statuses.
impl From<Error> for tonic::Status {
    fn from(e: Error) -> tonic::Status {
        tonic::Status::new(e.code(), e.to_string())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn tls_failures_are_named_with_their_fix_and_are_not_transient() {
        let e = Error::rpc(
            "GetStatus",
            tonic::Status::new(tonic::Code::Internal, "h2 protocol error: http2 error"),
        );
        assert!(
            matches!(&e, Error::Tls { fix, .. } if fix.contains("speaks TLS: use https://")),
            "{e}"
        );
        assert!(!e.is_transient());
        let cause = std::io::Error::other("invalid peer certificate: UnknownIssuer");
        let s = tonic::Status::from_error(Box::new(cause));
        let e = Error::rpc(
            "GetStatus",
            tonic::Status::new(tonic::Code::Unavailable, s.to_string()),
        );
        assert!(
            matches!(&e, Error::Tls { reason, fix, .. } if reason.contains("not signed by the CA") && fix.contains("MX_CONTROL_CA")),
            "{e}"
        );
        // Another server-side INTERNAL error is not taken for TLS.
        let e = Error::rpc(
            "GetStatus",
            tonic::Status::new(tonic::Code::Internal, "Expired lease"),
        );
        assert!(matches!(e, Error::Rpc { .. }), "{e}");
    }

    #[test]
    fn a_plain_http_answer_gets_a_hint() {
        let s = tonic::Status::new(
            tonic::Code::Unimplemented,
            "grpc-status header missing, mapped from HTTP status code 404",
        );
        let e = Error::rpc("GetStatus", s);
        assert_eq!(e.code(), tonic::Code::Unimplemented);
        assert!(
            e.to_string()
                .contains("answered plain HTTP, not gRPC: is it an mx control plane?"),
            "{e}"
        );
        let e = Error::rpc(
            "GetStatus",
            tonic::Status::new(tonic::Code::NotFound, "version \"x\" is not declared"),
        );
        assert!(!e.to_string().contains("plain HTTP"), "{e}");
    }
}
