//! Who may call what: bearer tokens mapped to roles, checked on every RPC before its handler runs.
//!
//! A token file lists one principal per line, after the convention of Kubernetes' static token
//! file (`--token-auth-file`: comma-separated, one token per line):
//!
//! ```text
//! # token,role,name[,scope]
//! 9f0c...e1,orchestrator,rl-driver
//! 41ab...07,publisher,trainer,0-3        # may publish and release source slots 0..=3
//! 77de...c2,worker,node-7,node-7-*       # may act as any worker id starting with "node-7-"
//! 03aa...5b,reader,dashboards
//! ```
//!
//! Roles ([`Role`]): an *orchestrator* declares versions, stages, refits and reads status; a
//! *publisher* (a trainer rank, an exporter) declares, publishes and releases its own source
//! slots and registers artifacts; a *worker* registers, follows commands, reports and serves
//! peers only under its own worker ids; a *reader* reads status. [`allowed`] is the whole table
//! (deny by default: an RPC missing from it is refused to everyone). NIXL agent metadata, which
//! lets its holder READ a source's registered memory, is sent only to workers ([`Principal::
//! sees_sources`]); publishers get manifests without it (an exporter proves bytes against their
//! digests), orchestrators and readers get no manifests.
//!
//! Tokens are compared through their blake3 hash (a table lookup that does not depend on where a
//! wrong token first differs). Clients send `authorization: Bearer <token>`; a missing or unknown
//! token is `UNAUTHENTICATED`, a known one outside its role or scope `PERMISSION_DENIED`.

use std::collections::HashMap;
use std::future::Future;
use std::path::Path;
use std::pin::Pin;
use std::sync::{Arc, PoisonError, RwLock};
use std::task::{Context, Poll};

use tonic::Status;

use crate::observe;
use crate::Error;

/// The gRPC service whose methods [`allowed`] covers (`/mx.v1.ControlPlane/<Method>`).
pub const SERVICE: &str = "mx.v1.ControlPlane";

/// Shortest token accepted (bytes): 16 random bytes hex-encoded are 32.
pub const MIN_TOKEN_LEN: usize = 24;

/// What a principal may do; see the module docs for each role's RPCs.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Role {
    /// Declares versions, stages, refits, waits on workers and refits, reads status.
    Orchestrator,
    /// A trainer rank or an exporter: declares, publishes and releases its source slots,
    /// registers artifacts.
    Publisher,
    /// An inference worker: registers and acts only under the worker ids of its scope.
    Worker,
    /// Reads fleet status and waits on it.
    Reader,
}

impl Role {
    /// Every role, for tables and tests.
    pub const ALL: [Role; 4] = [
        Role::Orchestrator,
        Role::Publisher,
        Role::Worker,
        Role::Reader,
    ];

    /// The name used in token files and messages.
    pub fn name(self) -> &'static str {
        match self {
            Role::Orchestrator => "orchestrator",
            Role::Publisher => "publisher",
            Role::Worker => "worker",
            Role::Reader => "reader",
        }
    }

    fn parse(s: &str) -> Option<Role> {
        Role::ALL.into_iter().find(|r| r.name() == s)
    }
}

impl std::fmt::Display for Role {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.name())
    }
}

/// Every method of the service (`mx.v1.ControlPlane`), in the proto's order.
pub const METHODS: &[&str] = &[
    "DeclareVersion",
    "Publish",
    "ReleaseVersion",
    "RegisterWorker",
    "RetireWorker",
    "AcceptJournal",
    "WatchCommands",
    "ReportStaged",
    "ReportResident",
    "ServePeer",
    "WithdrawPeer",
    "Stage",
    "Refit",
    "RegisterArtifact",
    "PublishExpectedOutputs",
    "ListLayouts",
    "GetVersion",
    "GetStatus",
    "WaitVersion",
    "WaitWorkers",
    "WaitRefit",
    "WaitReleased",
];

/// The roles that may call `method` (the RPC's name in the service, e.g. `"Publish"`); empty
/// for a method not in the table (refused to everyone).
pub fn allowed(method: &str) -> &'static [Role] {
    use Role::{Orchestrator as O, Publisher as P, Reader as R, Worker as W};
    match method {
        "DeclareVersion" => &[O, P],
        "Publish" | "ReleaseVersion" => &[P],
        "RegisterWorker" | "WatchCommands" | "ReportStaged" | "ReportResident" | "ServePeer"
        | "WithdrawPeer" => &[W],
        "Stage" | "Refit" | "AcceptJournal" => &[O],
        "RetireWorker" => &[O, W],
        "RegisterArtifact" | "PublishExpectedOutputs" => &[O, P],
        "ListLayouts" | "GetVersion" | "GetStatus" | "WaitVersion" => &[O, P, W, R],
        "WaitWorkers" | "WaitRefit" => &[O, R],
        "WaitReleased" => &[O, P, R],
        _ => &[],
    }
}

/// Which worker ids or source slots a principal may act as.
#[derive(Debug, Clone, PartialEq, Eq)]
enum Scope {
    /// No restriction within the role (orchestrators, readers, `*`).
    Any,
    /// Worker ids equal to this one.
    Exact(String),
    /// Worker ids starting with this prefix (`prefix*` in the file).
    Prefix(String),
    /// Source slots in `lo..=hi`.
    Slots(u32, u32),
}

/// An authenticated caller: set on every request (in its extensions) by the server's
/// authentication layer before a handler runs.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Principal {
    /// The name from the token file (`"-"` when the control plane runs without authentication).
    pub name: String,
    role: Option<Role>,
    scope: Scope,
}

impl Principal {
    /// The caller of a control plane that runs without authentication (loopback, by explicit
    /// choice): every role, any scope.
    pub fn unauthenticated() -> Principal {
        Principal {
            name: "-".into(),
            role: None,
            scope: Scope::Any,
        }
    }

    /// Its role (`None`: authentication is off, every role).
    pub fn role(&self) -> Option<Role> {
        self.role
    }

    fn may_call(&self, method: &str) -> bool {
        let roles = allowed(method);
        match self.role {
            None => !roles.is_empty(),
            Some(r) => roles.contains(&r),
        }
    }

    /// Whether this caller may act as worker `id`.
    ///
    /// # Errors
    /// `PERMISSION_DENIED` naming the principal and the id.
    pub fn check_worker(&self, id: &str) -> Result<(), Status> {
        let ok = match (&self.role, &self.scope) {
            (None, _) => true,
            (Some(Role::Worker), Scope::Any) => true,
            (Some(Role::Worker), Scope::Exact(w)) => w == id,
            (Some(Role::Worker), Scope::Prefix(p)) => id.starts_with(p.as_str()),
            _ => false,
        };
        if ok {
            Ok(())
        } else {
            Err(Status::permission_denied(format!(
                "{} may not act as worker {id:?}",
                self
            )))
        }
    }

    /// Whether this caller may publish or release source slot `slot`.
    ///
    /// # Errors
    /// `PERMISSION_DENIED` naming the principal and the slot.
    pub fn check_slot(&self, slot: u32) -> Result<(), Status> {
        let ok = match (&self.role, &self.scope) {
            (None, _) => true,
            (Some(Role::Publisher), Scope::Any) => true,
            (Some(Role::Publisher), Scope::Slots(lo, hi)) => (*lo..=*hi).contains(&slot),
            _ => false,
        };
        if ok {
            Ok(())
        } else {
            Err(Status::permission_denied(format!(
                "{self} may not publish source slot {slot}"
            )))
        }
    }

    /// Whether this caller gets sources' NIXL agent metadata (workers; everyone when
    /// authentication is off).
    pub fn sees_sources(&self) -> bool {
        matches!(self.role, None | Some(Role::Worker))
    }

    /// Whether this caller gets manifests at all (without NIXL metadata unless
    /// [`sees_sources`](Self::sees_sources)): workers and publishers.
    pub fn sees_manifests(&self) -> bool {
        matches!(self.role, None | Some(Role::Worker | Role::Publisher))
    }
}

impl std::fmt::Display for Principal {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self.role {
            Some(r) => write!(f, "{r} {:?}", self.name),
            None => f.write_str("an unauthenticated caller"),
        }
    }
}

/// The principals of a token file, by the blake3 hash of their token. Clones share one table:
/// [`TokenTable::reload`] replaces what every clone (the server's authentication layer, an HA
/// replica) sees, at once and whole.
#[derive(Debug, Clone, Default)]
pub struct TokenTable {
    by_hash: Arc<RwLock<Arc<Principals>>>,
    /// The file it was loaded from (`None`: parsed from text, nothing to reload).
    source: Option<std::path::PathBuf>,
}

/// Principals by the blake3 hash of their token.
type Principals = HashMap<[u8; 32], Principal>;

/// What [`TokenTable::reload`] changed.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Reloaded {
    /// Principals before and after.
    pub before: usize,
    /// Principals now.
    pub after: usize,
    /// blake3 of the file now read (hex): which file took effect, without its secrets.
    pub file_digest: String,
}

impl TokenTable {
    /// Reads and parses a token file (module docs).
    ///
    /// # Errors
    /// [`Error::Config`] naming the file (and line) when it cannot be read or a line is bad.
    pub fn load(path: &Path) -> Result<TokenTable, Error> {
        let (table, _) = TokenTable::read(path)?;
        Ok(TokenTable {
            source: Some(path.to_path_buf()),
            ..table
        })
    }

    /// The table of the file at `path` and the file's blake3 (hex).
    fn read(path: &Path) -> Result<(TokenTable, String), Error> {
        let text = std::fs::read_to_string(path).map_err(|e| Error::Config {
            what: format!("token file {}", path.display()),
            reason: e.to_string(),
        })?;
        let table = TokenTable::parse(&text).map_err(|reason| Error::Config {
            what: format!("token file {}", path.display()),
            reason,
        })?;
        Ok((table, blake3::hash(text.as_bytes()).to_hex().to_string()))
    }

    /// Reads the file this table was loaded from again and, when it parses whole, replaces the
    /// principals every clone of the table authenticates against (calls in flight keep the
    /// principal they were admitted with). A file that does not parse changes nothing.
    ///
    /// # Errors
    /// [`Error::Config`] naming the file and line (the table in force stays), or saying the
    /// table was not loaded from a file.
    pub fn reload(&self) -> Result<Reloaded, Error> {
        let path = self.source.as_deref().ok_or_else(|| Error::Config {
            what: "token table".into(),
            reason: "not loaded from a file: nothing to reload".into(),
        })?;
        let (fresh, file_digest) = TokenTable::read(path)?;
        let now = fresh.current();
        let before = {
            let mut held = self.by_hash.write().unwrap_or_else(PoisonError::into_inner);
            std::mem::replace(&mut *held, now).len()
        };
        Ok(Reloaded {
            before,
            after: self.len(),
            file_digest,
        })
    }

    /// The principals in force now.
    fn current(&self) -> Arc<Principals> {
        Arc::clone(&self.by_hash.read().unwrap_or_else(PoisonError::into_inner))
    }

    /// Parses a token file's text: `token,role,name[,scope]` per line; `#` starts a comment;
    /// blank lines are skipped. A worker's scope is its worker id, `prefix*` or `*`; a
    /// publisher's is a slot `N`, a range `LO-HI` or `*`; orchestrators and readers take none.
    ///
    /// # Errors
    /// A message naming the line: too few or too many fields, a token shorter than
    /// [`MIN_TOKEN_LEN`] or with characters outside printable ASCII, an unknown role, a missing
    /// or malformed scope, a token or name listed twice, no principal at all.
    pub fn parse(text: &str) -> Result<TokenTable, String> {
        let mut by_hash = HashMap::new();
        let mut names: HashMap<String, usize> = HashMap::new();
        let mut token_line: HashMap<[u8; 32], usize> = HashMap::new();
        for (i, raw) in text.lines().enumerate() {
            let n = i + 1;
            let line = raw.split('#').next().unwrap_or("").trim();
            if line.is_empty() {
                continue;
            }
            let f: Vec<&str> = line.split(',').map(str::trim).collect();
            if !(3..=4).contains(&f.len()) {
                return Err(format!(
                    "line {n}: {} fields, want token,role,name[,scope]",
                    f.len()
                ));
            }
            let token = f[0];
            if token.len() < MIN_TOKEN_LEN || !token.bytes().all(|b| b.is_ascii_graphic()) {
                return Err(format!(
                    "line {n}: a token must be at least {MIN_TOKEN_LEN} printable ASCII characters"
                ));
            }
            let role = Role::parse(f[1]).ok_or_else(|| {
                format!(
                    "line {n}: unknown role {:?} (orchestrator, publisher, worker, reader)",
                    f[1]
                )
            })?;
            let name = f[2];
            if name.is_empty() {
                return Err(format!("line {n}: empty name"));
            }
            if let Some(first) = names.insert(name.to_string(), n) {
                return Err(format!(
                    "line {n}: name {name:?} is already on line {first}"
                ));
            }
            let scope =
                parse_scope(role, f.get(3).copied()).map_err(|e| format!("line {n}: {e}"))?;
            let h = *blake3::hash(token.as_bytes()).as_bytes();
            if let Some(first) = token_line.insert(h, n) {
                return Err(format!("line {n}: the token of line {first} again"));
            }
            by_hash.insert(
                h,
                Principal {
                    name: name.to_string(),
                    role: Some(role),
                    scope,
                },
            );
        }
        if by_hash.is_empty() {
            return Err("no principal listed".into());
        }
        Ok(TokenTable {
            by_hash: Arc::new(RwLock::new(Arc::new(by_hash))),
            source: None,
        })
    }

    /// The principal of `token`, if listed.
    pub fn find(&self, token: &str) -> Option<Principal> {
        self.current()
            .get(blake3::hash(token.as_bytes()).as_bytes())
            .cloned()
    }

    /// How many principals are listed.
    pub fn len(&self) -> usize {
        self.current().len()
    }

    /// Whether none is (never true of a parsed table).
    pub fn is_empty(&self) -> bool {
        self.current().is_empty()
    }
}

fn parse_scope(role: Role, s: Option<&str>) -> Result<Scope, String> {
    match (role, s) {
        (Role::Orchestrator | Role::Reader, None) => Ok(Scope::Any),
        (Role::Orchestrator | Role::Reader, Some(s)) => {
            Err(format!("role {role} takes no scope, got {s:?}"))
        }
        (_, None | Some("")) => Err(format!(
            "role {role} needs a scope ({})",
            if role == Role::Worker {
                "a worker id, prefix* or *"
            } else {
                "a slot N, a range LO-HI or *"
            }
        )),
        (_, Some("*")) => Ok(Scope::Any),
        (Role::Worker, Some(s)) => match s.strip_suffix('*') {
            Some(p) if p.contains('*') => Err(format!("scope {s:?}: '*' only at the end")),
            Some(p) => Ok(Scope::Prefix(p.to_string())),
            None if s.contains('*') => Err(format!("scope {s:?}: '*' only at the end")),
            None => Ok(Scope::Exact(s.to_string())),
        },
        (_, Some(s)) => {
            let (lo, hi) = s.split_once('-').unwrap_or((s, s));
            let num = |x: &str| {
                x.parse::<u32>()
                    .map_err(|_| format!("scope {s:?}: not a slot N or range LO-HI"))
            };
            let (lo, hi) = (num(lo)?, num(hi)?);
            if lo > hi {
                return Err(format!("scope {s:?}: range runs backwards"));
            }
            Ok(Scope::Slots(lo, hi))
        }
    }
}

/// Reads a secret token from `path` (surrounding whitespace trimmed): at least
/// [`MIN_TOKEN_LEN`] printable ASCII characters.
///
/// # Errors
/// [`Error::Config`] naming the file when it cannot be read or the token is too short or holds
/// other characters.
pub fn read_token_file(path: &Path) -> Result<String, Error> {
    let what = || format!("token file {}", path.display());
    let text = std::fs::read_to_string(path).map_err(|e| Error::Config {
        what: what(),
        reason: e.to_string(),
    })?;
    let t = text.trim();
    if t.len() < MIN_TOKEN_LEN || !t.bytes().all(|b| b.is_ascii_graphic()) {
        return Err(Error::Config {
            what: what(),
            reason: format!("a token must be at least {MIN_TOKEN_LEN} printable ASCII characters"),
        });
    }
    Ok(t.to_string())
}

/// Selects rustls' ring provider for this process (once; a provider another library installed
/// first is kept). The dependency graph enables both of rustls' providers (object storage pulls
/// in aws-lc-rs), and rustls then refuses to guess: without this, the first TLS handshake
/// panics.
pub(crate) fn install_crypto_provider() {
    static ONCE: std::sync::Once = std::sync::Once::new();
    ONCE.call_once(|| {
        // Err: one is installed already, which serves as well.
        let _ = rustls::crypto::ring::default_provider().install_default();
    });
}

/// The principal of a request to `path` (`/mx.v1.ControlPlane/Method`) with `authorization`
/// header value `auth`, or the status that refuses it.
fn authorize(
    table: Option<&TokenTable>,
    path: &str,
    auth: Option<&http::HeaderValue>,
) -> Result<Principal, Status> {
    let method = path
        .strip_prefix('/')
        .and_then(|p| p.strip_prefix(SERVICE))
        .and_then(|p| p.strip_prefix('/'))
        .unwrap_or("");
    let principal = match table {
        None => Principal::unauthenticated(),
        Some(t) => {
            let token = auth
                .and_then(|v| v.to_str().ok())
                .and_then(|v| v.strip_prefix("Bearer "))
                .ok_or_else(|| {
                    Status::unauthenticated(
                        "this control plane requires `authorization: Bearer <token>` \
                         (MX_CONTROL_TOKEN or MX_CONTROL_TOKEN_FILE on the client, or the \
                         client's own token: mx.Control / mx.Publisher token= or token_file=)",
                    )
                })?;
            t.find(token.trim())
                .ok_or_else(|| Status::unauthenticated("unknown bearer token"))?
        }
    };
    if principal.may_call(method) {
        Ok(principal)
    } else {
        let roles: Vec<&str> = allowed(method).iter().map(|r| r.name()).collect();
        Err(Status::permission_denied(format!(
            "{principal} may not call {path} (roles allowed: {})",
            if roles.is_empty() {
                "none".to_string()
            } else {
                roles.join(", ")
            }
        )))
    }
}

/// The principal a request was authenticated as (set by [`AuthLayer`]).
///
/// # Errors
/// `INTERNAL` when the layer did not run (a server built without it).
pub(crate) fn principal<T>(req: &tonic::Request<T>) -> Result<Principal, Status> {
    req.extensions()
        .get::<Principal>()
        .cloned()
        .ok_or_else(|| Status::internal("request reached a handler without authentication"))
}

/// A tower layer that authenticates every request and checks its role against [`allowed`]
/// before the service sees it; `None`: authentication off (every caller is
/// [`Principal::unauthenticated`], still limited to the service's methods).
#[derive(Debug, Clone)]
pub(crate) struct AuthLayer {
    pub(crate) table: Option<Arc<TokenTable>>,
}

impl<S> tower::Layer<S> for AuthLayer {
    type Service = AuthService<S>;

    fn layer(&self, inner: S) -> AuthService<S> {
        AuthService {
            inner,
            table: self.table.clone(),
        }
    }
}

/// The service [`AuthLayer`] wraps around the control plane.
#[derive(Debug, Clone)]
pub(crate) struct AuthService<S> {
    inner: S,
    table: Option<Arc<TokenTable>>,
}

type BoxFuture<T, E> = Pin<Box<dyn Future<Output = Result<T, E>> + Send>>;

impl<S, B> tower::Service<http::Request<B>> for AuthService<S>
where
    S: tower::Service<http::Request<B>, Response = http::Response<tonic::body::Body>>,
    S::Future: Send + 'static,
{
    type Response = S::Response;
    type Error = S::Error;
    type Future = BoxFuture<S::Response, S::Error>;

    fn poll_ready(&mut self, cx: &mut Context<'_>) -> Poll<Result<(), S::Error>> {
        self.inner.poll_ready(cx)
    }

    fn call(&mut self, mut req: http::Request<B>) -> Self::Future {
        let method = method_label(req.uri().path());
        metrics::counter!(observe::RPC_REQUESTS_TOTAL, "method" => method).increment(1);
        let found = authorize(
            self.table.as_deref(),
            req.uri().path(),
            req.headers().get(http::header::AUTHORIZATION),
        );
        match found {
            Ok(p) => {
                req.extensions_mut().insert(p);
                let answer = self.inner.call(req);
                Box::pin(async move {
                    let res = answer.await?;
                    count_error(method, res.headers());
                    Ok(res)
                })
            }
            Err(status) => {
                tracing::warn!(path = req.uri().path(), "refused: {}", status.message());
                let res = status.into_http();
                count_error(method, res.headers());
                Box::pin(async move { Ok(res) })
            }
        }
    }
}

/// The method of `path` (`/mx.v1.ControlPlane/Method`) as a metric label: its name when the
/// service has it, `unknown` otherwise (a caller must not be able to mint label values).
fn method_label(path: &str) -> &'static str {
    let method = path
        .strip_prefix('/')
        .and_then(|p| p.strip_prefix(SERVICE))
        .and_then(|p| p.strip_prefix('/'))
        .unwrap_or("");
    METHODS
        .iter()
        .find(|m| **m == method)
        .copied()
        .unwrap_or("unknown")
}

/// Counts an answer whose headers carry a non-OK `grpc-status` (an error answered at once, the
/// trailers-only form tonic uses for a failed unary call or a refused stream).
fn count_error(method: &'static str, headers: &http::HeaderMap) {
    let code = headers
        .get("grpc-status")
        .and_then(|v| v.to_str().ok())
        .and_then(|v| v.parse::<i32>().ok())
        .map(tonic::Code::from_i32);
    if let Some(code) = code.filter(|c| *c != tonic::Code::Ok) {
        metrics::counter!(observe::RPC_ERRORS_TOTAL, "method" => method, "code" => observe::code_label(code))
            .increment(1);
    }
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]

    use super::*;

    const T: &str = "0123456789abcdef0123456789abcdef";

    #[test]
    fn methods_are_the_service_descriptors() {
        use prost::Message;
        let set = prost_types::FileDescriptorSet::decode(crate::pb::FILE_DESCRIPTOR_SET).unwrap();
        let mut described: Vec<String> = set
            .file
            .iter()
            .flat_map(|f| &f.service)
            .filter(|s| s.name() == "ControlPlane")
            .flat_map(|s| &s.method)
            .map(|m| m.name().to_string())
            .collect();
        let mut ours: Vec<String> = METHODS.iter().map(|m| m.to_string()).collect();
        described.sort();
        ours.sort();
        assert_eq!(described, ours);
        for m in METHODS {
            assert!(!allowed(m).is_empty(), "{m} is refused to every role");
            assert_eq!(method_label(&format!("/{SERVICE}/{m}")), *m);
        }
        assert_eq!(method_label("/mx.v1.ControlPlane/Nope"), "unknown");
        assert_eq!(method_label("/other.Service/GetStatus"), "unknown");
    }

    #[test]
    fn token_files_parse_strictly() {
        let t = TokenTable::parse(&format!(
            "# comment\n\n{T}o,orchestrator,driver\n{T}p,publisher,trainer,0-3 # ranks\n\
             {T}w,worker,node7,node-7-*\n{T}r,reader,dash\n"
        ))
        .unwrap();
        assert_eq!(t.len(), 4);
        let w = t.find(&format!("{T}w")).unwrap();
        assert!(w.check_worker("node-7-tp0").is_ok());
        assert_eq!(
            w.check_worker("node-8-tp0").unwrap_err().code(),
            tonic::Code::PermissionDenied
        );
        let p = t.find(&format!("{T}p")).unwrap();
        assert!(p.check_slot(3).is_ok() && p.check_slot(4).is_err());
        assert!(p.check_worker("node-7-tp0").is_err());
        assert!(t.find(T).is_none());
        for (text, why) in [
            ("", "no principal"),
            ("short,reader,x", "at least 24"),
            (&format!("{T},admin,x"), "unknown role \"admin\""),
            (&format!("{T},reader"), "line 1: 2 fields"),
            (&format!("{T},worker,x"), "needs a scope"),
            (&format!("{T},reader,x,*"), "takes no scope"),
            (&format!("{T},publisher,x,3-1"), "runs backwards"),
            (&format!("{T},publisher,x,a"), "not a slot"),
            (&format!("{T},worker,x,a*b"), "only at the end"),
            (
                &format!("{T}1,reader,x\n{T}2,reader,x"),
                "line 2: name \"x\" is already on line 1",
            ),
            (
                &format!("{T},reader,x\n{T},reader,y"),
                "line 2: the token of line 1 again",
            ),
        ] {
            let e = TokenTable::parse(text).unwrap_err();
            assert!(e.contains(why), "{text:?}: {e}");
        }
    }

    #[test]
    fn every_role_has_its_rpcs_and_unknown_methods_are_refused() {
        let t = TokenTable::parse(&format!("{T},reader,dash")).unwrap();
        let bearer = http::HeaderValue::from_str(&format!("Bearer {T}")).unwrap();
        let ok = authorize(Some(&t), "/mx.v1.ControlPlane/GetStatus", Some(&bearer)).unwrap();
        assert_eq!(ok.role(), Some(Role::Reader));
        let e = authorize(Some(&t), "/mx.v1.ControlPlane/Refit", Some(&bearer)).unwrap_err();
        assert_eq!(e.code(), tonic::Code::PermissionDenied);
        assert!(e.message().contains("roles allowed: orchestrator"), "{e}");
        let e = authorize(Some(&t), "/mx.v1.ControlPlane/GetStatus", None).unwrap_err();
        assert_eq!(e.code(), tonic::Code::Unauthenticated);
        let e = authorize(None, "/other.Service/GetStatus", None).unwrap_err();
        assert_eq!(e.code(), tonic::Code::PermissionDenied);
    }
}
