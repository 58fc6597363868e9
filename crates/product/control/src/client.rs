//! A typed client: one async method per RPC, taking and returning mx-layout types and
//! [`crate::types`]; wire messages never leave this module.

use std::time::Duration;

use mx_layout::{Digest, LayoutSpec, ResidentVersion, SourceManifest, TensorSpec};
use tonic::metadata::{Ascii, MetadataValue};
use tonic::service::interceptor::InterceptedService;
use tonic::transport::{Certificate, Channel, ClientTlsConfig, Endpoint};

use crate::convert;
use crate::pb;
use crate::pb::control_plane_client::ControlPlaneClient;
use crate::refit::{GenerationCheck, Refit, RefitSpec, Registration};
use crate::server::MAX_MESSAGE_BYTES;
use crate::types::{
    ArtifactRecord, Command, FleetStatus, Release, StagedReport, VersionInfo, VersionState,
    WorkerBrief, WorkerState,
};
use crate::Error;

/// A connection to the control plane. Cheap to clone; methods take `&self`.
///
/// The channel reconnects by itself: after the control plane restarted, the next call connects
/// again (calls made while it is away fail with a transient error, see
/// [`Error::is_transient`]). HTTP/2 keepalive pings ([`KEEPALIVE_INTERVAL`]) find a control plane
/// that vanished without closing the connection.
///
/// Given several replicas of a highly available control plane (comma-separated URLs), it sends
/// each call to the replica it believes leads; a call answered `UNAVAILABLE` (a follower, or a
/// replica that is gone) moves it to the leader the follower named, else to the next replica,
/// and the call is sent again there, with backoff, until the failover deadline
/// ([`FAILOVER_DEADLINE`], [`ControlClient::with_failover_deadline`]). A follower executes
/// nothing; a leader that died during a call may have executed it, so only calls whose
/// repetition changes nothing are sent again: every call but `RetireWorker` and
/// `AcceptJournal`, refits included (each carries a request id the control plane answers once).
#[derive(Debug, Clone)]
pub struct ControlClient {
    inner: Rpc,
    /// The replicas of a highly available control plane, when more than one URL was given.
    replicas: Option<std::sync::Arc<Replicas>>,
    /// Sent with registrations and command streams (0: none, an older client's behaviour).
    incarnation: u64,
    /// How long a call keeps trying across the replicas ([`FAILOVER_DEADLINE`]).
    failover: Duration,
}

/// How long a call to the replicas of a highly available control plane keeps trying across a
/// failover by default: 30 s (a leader that dies is deposed after its lease, 5 s by default,
/// and a follower is elected within a second of that).
pub const FAILOVER_DEADLINE: Duration = Duration::from_secs(30);

type Rpc = ControlPlaneClient<InterceptedService<Channel, Bearer>>;

/// The replicas of a highly available control plane and the one calls go to.
#[derive(Debug)]
struct Replicas {
    /// (URL as given, client on a lazily connecting channel).
    all: Vec<(String, Rpc)>,
    /// Index into `all` of the replica believed to lead.
    current: std::sync::atomic::AtomicUsize,
}

impl Replicas {
    fn current(&self) -> usize {
        self.current.load(std::sync::atomic::Ordering::Relaxed) % self.all.len().max(1)
    }

    /// After `status` from replica `at`: moves to the leader a follower named (when it is one of
    /// the replicas), else to the next replica, when `status` says `at` does not serve.
    fn note(&self, at: usize, status: &tonic::Status) {
        if status.code() != tonic::Code::Unavailable || self.all.is_empty() {
            return;
        }
        let named = status
            .metadata()
            .get(LEADER_HEADER)
            .and_then(|v| v.to_str().ok())
            .and_then(|url| self.all.iter().position(|(u, _)| same_url(u, url)));
        let next = named.unwrap_or((at + 1) % self.all.len());
        // Only the first failure seen at `at` moves the pointer: a late answer from a replica
        // already left behind must not move it on from the one now chosen.
        let _ = self.current.compare_exchange(
            at,
            next,
            std::sync::atomic::Ordering::Relaxed,
            std::sync::atomic::Ordering::Relaxed,
        );
    }
}

/// True when `a` and `b` name the same replica (`host:port` with or without `http://`).
fn same_url(a: &str, b: &str) -> bool {
    let bare = |u: &str| {
        let u = u.trim().trim_end_matches('/');
        u.split_once("://").map_or(u, |(_, rest)| rest).to_string()
    };
    bare(a) == bare(b)
}

/// Response metadata of a follower's `UNAVAILABLE` answer: the URL the leader advertises
/// (`mx control --advertise`), absent while no leader is elected or etcd is unreachable.
/// Clients given several replicas send their next calls there.
pub const LEADER_HEADER: &str = "x-mx-leader";

/// How often an idle connection to the control plane is pinged (both ends), and how long a ping
/// may go unanswered before the connection counts as broken.
pub const KEEPALIVE_INTERVAL: Duration = Duration::from_secs(10);

/// Capped exponential backoff with jitter, for retrying a control plane that is away: the
/// `n`-th wait is drawn uniformly from `[d/2, d)` where `d = first * 2^n`, capped at `max`.
/// Jitter keeps a fleet of workers that lost the same control plane from reconnecting in
/// lockstep. The one retry policy of mx's clients (workers, publishers); the sequence is
/// `backon`'s exponential backoff (delays of `d/2` plus a uniform jitter of up to `d/2`).
#[derive(Debug)]
pub struct Backoff {
    waits: backon::ExponentialBackoff,
    max: Duration,
}

impl Backoff {
    /// Starts at `first`, doubling up to `max` (a `max` below `first` is `first`).
    pub fn new(first: Duration, max: Duration) -> Backoff {
        use backon::BackoffBuilder as _;
        let max = max.max(first);
        Backoff {
            waits: backon::ExponentialBuilder::default()
                .with_min_delay(first / 2)
                .with_max_delay(max / 2)
                .with_factor(2.0)
                .with_jitter()
                .without_max_times()
                .build(),
            max,
        }
    }

    /// The next wait (and doubles the one after, up to the cap).
    pub fn next_wait(&mut self) -> Duration {
        // Without a limit on attempts the sequence does not end; `max` is a safe answer if it did.
        self.waits.next().unwrap_or(self.max)
    }
}

/// A random, non-zero `u64` from the operating system's randomness (through std's hash map
/// keys, which are seeded from it), mixed with the time and process id; for incarnations, not
/// for secrets.
pub fn random_u64() -> u64 {
    use std::hash::{BuildHasher, Hasher};
    let mut h = std::collections::hash_map::RandomState::new().build_hasher();
    h.write_u32(std::process::id());
    let now = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .unwrap_or_default();
    h.write_u128(now.as_nanos());
    h.finish().max(1)
}

/// What a publish left the version as.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct PublishOutcome {
    /// The version's state after the publish.
    pub state: VersionState,
    /// The version digest, once READY.
    pub version_digest: Option<Digest>,
}

/// A worker's command stream (from [`ControlClient::watch_commands`]).
#[derive(Debug)]
pub struct CommandStream {
    inner: tonic::Streaming<pb::WorkerCommand>,
    epoch: Option<u64>,
}

impl CommandStream {
    /// The epoch of the leader that opened this stream ([`crate::ha`]); `None` from a control
    /// plane that is not highly available. A worker refuses a stream from a lower epoch than it
    /// has seen (a deposed leader's).
    pub fn epoch(&self) -> Option<u64> {
        self.epoch
    }

    /// The next command; `Ok(None)` when the server ended the stream (it was replaced by a newer
    /// stream of the same worker, or the server shut down).
    ///
    /// # Errors
    /// [`Error::Rpc`] when the stream fails; [`Error::InvalidField`] for a malformed command.
    pub async fn next(&mut self) -> Result<Option<Command>, Error> {
        match self.inner.message().await {
            Ok(Some(c)) => convert::command(&c).map(Some),
            Ok(None) => Ok(None),
            Err(s) => Err(Error::rpc("WatchCommands", s)),
        }
    }
}

/// The endpoint of `addr` (`host:port` or `http://host:port`), with keepalive pings.
/// What a client presents to the control plane: a bearer token (see [`crate::auth`]) and, for
/// `https://` addresses, the CA certificate that signed the server's.
///
/// [`ClientAuth::from_env`] reads the standard variables, so every mx process (CLI, workers,
/// publishers, the Python and C bindings) is configured the same way:
/// `MX_CONTROL_TOKEN` (the token) or `MX_CONTROL_TOKEN_FILE` (a file holding it), and
/// `MX_CONTROL_CA` (a PEM file).
#[derive(Clone, Default)]
pub struct ClientAuth {
    token: Option<MetadataValue<Ascii>>,
    ca_pem: Option<Vec<u8>>,
}

impl std::fmt::Debug for ClientAuth {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        // Never the token.
        f.debug_struct("ClientAuth")
            .field("token", &self.token.as_ref().map(|_| "<set>"))
            .field("ca", &self.ca_pem.as_ref().map(Vec::len))
            .finish()
    }
}

impl ClientAuth {
    /// No token, no CA (a control plane run with `--insecure-loopback`).
    pub fn none() -> ClientAuth {
        ClientAuth::default()
    }

    /// From `MX_CONTROL_TOKEN` / `MX_CONTROL_TOKEN_FILE` and `MX_CONTROL_CA` (each optional;
    /// both token variables at once is an error).
    ///
    /// # Errors
    /// [`Error::Config`] naming the variable or file at fault.
    pub fn from_env() -> Result<ClientAuth, Error> {
        ClientAuth::resolve(None, None)
    }

    /// The credentials of one client of a process that holds several roles (a trainer rank
    /// that publishes and orchestrates): `token` or the token in `token_file` when given, else
    /// the token of [`from_env`](Self::from_env); the CA from `MX_CONTROL_CA` either way.
    ///
    /// # Errors
    /// [`Error::Config`] for both `token` and `token_file` given, an unreadable or malformed
    /// token file (named), a `token` shorter than [`crate::auth::MIN_TOKEN_LEN`] or not
    /// printable ASCII, or bad variables.
    pub fn resolve(
        token: Option<&str>,
        token_file: Option<&std::path::Path>,
    ) -> Result<ClientAuth, Error> {
        let var = |k: &str| std::env::var(k).ok().filter(|v| !v.is_empty());
        let read = |k: &str, path: &str| {
            std::fs::read(path).map_err(|e| Error::Config {
                what: format!("{k}={path}"),
                reason: e.to_string(),
            })
        };
        let token = match (token, token_file) {
            (Some(_), Some(_)) => {
                return Err(Error::Config {
                    what: "token and token_file".into(),
                    reason: "both given; give one".into(),
                })
            }
            (Some(t), None) => {
                // A token the control plane's table could never hold is refused here, not as
                // `unknown bearer token` at the first call.
                let min = crate::auth::MIN_TOKEN_LEN;
                if t.trim().len() < min {
                    return Err(Error::Config {
                        what: "token".into(),
                        reason: format!(
                            "a token must be at least {min} printable ASCII characters"
                        ),
                    });
                }
                Some(t.to_string())
            }
            (None, Some(f)) => Some(crate::auth::read_token_file(f)?),
            (None, None) => match (var("MX_CONTROL_TOKEN"), var("MX_CONTROL_TOKEN_FILE")) {
                (Some(_), Some(_)) => {
                    return Err(Error::Config {
                        what: "MX_CONTROL_TOKEN and MX_CONTROL_TOKEN_FILE".into(),
                        reason: "both set; give one".into(),
                    })
                }
                (Some(t), None) => Some(t),
                (None, Some(f)) => Some(crate::auth::read_token_file(std::path::Path::new(&f))?),
                (None, None) => None,
            },
        };
        let mut a = ClientAuth::none();
        if let Some(t) = token {
            a = a.with_token(&t)?;
        }
        if let Some(ca) = var("MX_CONTROL_CA") {
            a.ca_pem = Some(read("MX_CONTROL_CA", &ca)?);
        }
        Ok(a)
    }

    /// Sends `token` as `authorization: Bearer <token>`.
    ///
    /// # Errors
    /// [`Error::Config`] for a token that is not printable ASCII.
    pub fn with_token(mut self, token: &str) -> Result<ClientAuth, Error> {
        let v = format!("Bearer {}", token.trim())
            .parse::<MetadataValue<Ascii>>()
            .ok()
            .filter(|_| token.trim().bytes().all(|b| b.is_ascii_graphic()))
            .ok_or_else(|| Error::Config {
                what: "control-plane token".into(),
                reason: "not printable ASCII".into(),
            })?;
        self.token = Some(v);
        Ok(self)
    }

    /// Trusts the CA certificate `pem` for `https://` addresses.
    pub fn with_ca_pem(mut self, pem: Vec<u8>) -> ClientAuth {
        self.ca_pem = Some(pem);
        self
    }
}

/// Adds the bearer token, if any, to every call.
#[derive(Debug, Clone)]
pub struct Bearer(Option<MetadataValue<Ascii>>);

impl tonic::service::Interceptor for Bearer {
    fn call(&mut self, mut req: tonic::Request<()>) -> Result<tonic::Request<()>, tonic::Status> {
        if let Some(t) = &self.0 {
            req.metadata_mut().insert("authorization", t.clone());
        }
        Ok(req)
    }
}

fn endpoint(addr: &str, auth: &ClientAuth) -> Result<Endpoint, Error> {
    let uri = if addr.contains("://") {
        addr.to_string()
    } else {
        format!("http://{addr}")
    };
    let bad = |reason: String| Error::InvalidField {
        field: "addr".into(),
        reason: format!("{addr:?}: {reason}"),
    };
    let mut ep = Endpoint::from_shared(uri.clone())
        .map_err(|e| bad(e.to_string()))?
        .http2_keep_alive_interval(KEEPALIVE_INTERVAL)
        .keep_alive_timeout(KEEPALIVE_INTERVAL)
        .keep_alive_while_idle(true);
    if uri.starts_with("https://") {
        crate::auth::install_crypto_provider();
        let ca = auth.ca_pem.as_ref().ok_or_else(|| Error::Config {
            what: format!("control plane {addr}"),
            reason: "an https:// address needs the CA certificate that signed the server's \
                     (MX_CONTROL_CA=FILE)"
                .into(),
        })?;
        ep = ep
            .tls_config(ClientTlsConfig::new().ca_certificate(Certificate::from_pem(ca)))
            .map_err(|e| bad(e.to_string()))?;
    }
    Ok(ep)
}

fn ids(worker_ids: &[impl AsRef<str>]) -> Vec<String> {
    worker_ids.iter().map(|w| w.as_ref().to_string()).collect()
}

impl ControlClient {
    /// Connects to `addr` (`host:port`, `http://host:port` or `https://host:port`) with the
    /// credentials of [`ClientAuth::from_env`].
    ///
    /// # Errors
    /// [`Error::InvalidField`] for a malformed address; [`Error::Config`] for bad credential
    /// variables; [`Error::Transport`] when it cannot connect.
    pub async fn connect(addr: &str) -> Result<ControlClient, Error> {
        ControlClient::connect_with(addr, &ClientAuth::from_env()?).await
    }

    /// [`connect`](Self::connect) with explicit credentials.
    ///
    /// # Errors
    /// As [`connect`](Self::connect).
    pub async fn connect_with(addr: &str, auth: &ClientAuth) -> Result<ControlClient, Error> {
        if addr.contains(',') {
            return ControlClient::connect_leader(addr, auth).await;
        }
        let channel =
            endpoint(addr, auth)?.connect().await.map_err(
                |source| match crate::error::tls_failure(&source) {
                    Some((reason, fix)) => Error::Tls {
                        rpc: "connect",
                        reason,
                        fix,
                    },
                    None => Error::Transport {
                        addr: addr.to_string(),
                        source,
                    },
                },
            )?;
        Ok(ControlClient::over(channel, auth))
    }

    /// A client of the replicas `addrs` (comma-separated URLs of a highly available control
    /// plane) that starts at the leader: each replica is asked a cheap call (`ListLayouts`) in
    /// order; a follower answers `UNAVAILABLE` and the next is asked. Later calls follow the
    /// leadership as the type's documentation says.
    ///
    /// # Errors
    /// [`Error::InvalidField`] for a malformed or empty list; the last replica's error when
    /// none leads (or none answers).
    async fn connect_leader(addrs: &str, auth: &ClientAuth) -> Result<ControlClient, Error> {
        let c = ControlClient::replicas(addrs, auth)?;
        match c.list_layouts().await {
            // A refusal of the credentials is the leader's own answer (a follower refuses
            // them too, before naming the leader).
            Err(e) if e.is_transient() => Err(e),
            _ => Ok(c),
        }
    }

    /// A client of the replicas `addrs` (comma-separated), each on a lazily connecting
    /// channel, starting at the first.
    ///
    /// # Errors
    /// [`Error::InvalidField`] for a malformed or empty list.
    fn replicas(addrs: &str, auth: &ClientAuth) -> Result<ControlClient, Error> {
        let mut all = Vec::new();
        for a in addrs.split(',').map(str::trim).filter(|a| !a.is_empty()) {
            let c = ControlClient::over(endpoint(a, auth)?.connect_lazy(), auth);
            all.push((a.to_string(), c.inner));
        }
        let Some((_, first)) = all.first() else {
            return Err(Error::InvalidField {
                field: "control".into(),
                reason: format!("no control-plane URL in {addrs:?}"),
            });
        };
        Ok(ControlClient {
            inner: first.clone(),
            replicas: Some(std::sync::Arc::new(Replicas {
                current: std::sync::atomic::AtomicUsize::new(0),
                all,
            })),
            incarnation: 0,
            failover: FAILOVER_DEADLINE,
        })
    }

    /// A client for `addr` that connects at its first call (and again after the control plane
    /// restarted), so it can be made while the control plane is away.
    ///
    /// # Errors
    /// [`Error::InvalidField`] for a malformed address; [`Error::Config`] for bad credential
    /// variables ([`ClientAuth::from_env`]).
    pub fn connect_lazy(addr: &str) -> Result<ControlClient, Error> {
        let auth = ClientAuth::from_env()?;
        if addr.contains(',') {
            return ControlClient::replicas(addr, &auth);
        }
        Ok(ControlClient::over(
            endpoint(addr, &auth)?.connect_lazy(),
            &auth,
        ))
    }

    fn over(channel: Channel, auth: &ClientAuth) -> ControlClient {
        ControlClient {
            inner: ControlPlaneClient::with_interceptor(channel, Bearer(auth.token.clone()))
                .max_decoding_message_size(MAX_MESSAGE_BYTES)
                .max_encoding_message_size(MAX_MESSAGE_BYTES),
            replicas: None,
            incarnation: 0,
            failover: FAILOVER_DEADLINE,
        }
    }

    /// The same connection, sending `incarnation` with [`register`](Self::register) and
    /// [`watch_commands`](Self::watch_commands): a worker process draws one at start (see
    /// [`random_u64`]) and uses it for its whole life, so the control plane tells its own
    /// re-registrations from another process's registration under the same id.
    pub fn with_incarnation(mut self, incarnation: u64) -> ControlClient {
        self.incarnation = incarnation;
        self
    }

    /// The replica calls go to now (its index among the replicas; 0 without) and its client.
    fn rpc(&self) -> (usize, Rpc) {
        match &self.replicas {
            Some(r) => {
                let at = r.current();
                let c = r
                    .all
                    .get(at)
                    .map_or_else(|| self.inner.clone(), |(_, c)| c.clone());
                (at, c)
            }
            None => (0, self.inner.clone()),
        }
    }

    /// The error of `rpc` that replica `at` answered with `status`; with replicas, moves on from
    /// one that does not lead ([`Replicas::note`]).
    fn failed(&self, at: usize, rpc: &'static str, status: tonic::Status) -> Error {
        if let Some(r) = &self.replicas {
            r.note(at, &status);
        }
        Error::rpc(rpc, status)
    }

    /// How long a call to the replicas of a highly available control plane keeps trying
    /// across a failover (default [`FAILOVER_DEADLINE`]); no effect with one address.
    pub fn with_failover_deadline(mut self, deadline: Duration) -> ControlClient {
        self.failover = deadline;
        self
    }

    /// Sends `req` once, as `call` makes it, to the replica believed to lead.
    async fn once<Req, T, Fut>(
        &self,
        name: &'static str,
        req: Req,
        call: impl Fn(Rpc, Req) -> Fut,
    ) -> Result<tonic::Response<T>, Error>
    where
        Fut: std::future::Future<Output = Result<tonic::Response<T>, tonic::Status>>,
    {
        let (at, rpc) = self.rpc();
        call(rpc, req).await.map_err(|s| self.failed(at, name, s))
    }

    /// Sends `req` as `call` makes it. With several replicas, a transient failure (a follower
    /// naming the leader, a replica that is gone, a leader that died during the call: see
    /// [`Error::is_transient`]) moves to the next replica ([`Replicas::note`]) and sends it
    /// again, with backoff, until the failover deadline; the last error after it. Only for
    /// requests whose repetition changes nothing: reads, identical declarations, publishes and
    /// registrations, and refits, which carry a request id the control plane answers once.
    async fn retrying<Req: Clone, T, Fut>(
        &self,
        name: &'static str,
        req: Req,
        call: impl Fn(Rpc, Req) -> Fut,
    ) -> Result<tonic::Response<T>, Error>
    where
        Fut: std::future::Future<Output = Result<tonic::Response<T>, tonic::Status>>,
    {
        if self.replicas.is_none() {
            return self.once(name, req, call).await;
        }
        let deadline = tokio::time::Instant::now() + self.failover;
        let mut backoff = Backoff::new(Duration::from_millis(50), Duration::from_secs(1));
        loop {
            let (at, rpc) = self.rpc();
            match call(rpc, req.clone()).await {
                Ok(r) => return Ok(r),
                Err(s) => {
                    let e = self.failed(at, name, s);
                    let left = deadline.saturating_duration_since(tokio::time::Instant::now());
                    if !e.is_transient() || left.is_zero() {
                        return Err(e);
                    }
                    tracing::debug!(rpc = name, "retrying on the next replica: {e}");
                    tokio::time::sleep(backoff.next_wait().min(left)).await;
                }
            }
        }
    }

    /// Declares a version: source slots `0..trainer_layout.world_size` and its tensors.
    /// Idempotent when identical.
    ///
    /// # Errors
    /// [`Error::Rpc`] with `AlreadyExists` when declared differently, `InvalidArgument` for a bad
    /// declaration.
    pub async fn declare_version(
        &self,
        label: &str,
        trainer_layout: LayoutSpec,
        tensors: &[TensorSpec],
    ) -> Result<(), Error> {
        self.retrying(
            "DeclareVersion",
            pb::DeclareVersionRequest {
                label: label.to_string(),
                trainer_layout: Some(convert::layout_pb(&trainer_layout)),
                tensors: tensors.iter().map(convert::tensor_spec_pb).collect(),
            },
            |mut rpc, req| async move { rpc.declare_version(req).await },
        )
        .await?;
        Ok(())
    }

    /// Publishes (or republishes) `manifest.slot` of a version.
    ///
    /// # Errors
    /// [`Error::Rpc`]: `NotFound` for an undeclared version, `InvalidArgument` for a manifest that
    /// disagrees with the declaration (the message names the tensor), `FailedPrecondition` for a
    /// republish that would change a fixed version digest.
    pub async fn publish(
        &self,
        label: &str,
        manifest: &SourceManifest,
    ) -> Result<PublishOutcome, Error> {
        let r = self
            .retrying(
                "Publish",
                pb::PublishRequest {
                    label: label.to_string(),
                    manifest: Some(convert::manifest_pb(manifest)),
                },
                |mut rpc, req| async move { rpc.publish(req).await },
            )
            .await?
            .into_inner();
        Ok(PublishOutcome {
            state: convert::version_state(r.state, "state")?,
            version_digest: convert::opt_digest(&r.version_digest, "version_digest")?,
        })
    }

    /// Registers (or re-registers, resetting to IDLE) a worker: its ranks and layout, its engine
    /// routes and the version resident in its live weights. The control plane admits it to
    /// rollouts only when that version is the fleet's committed one.
    ///
    /// # Errors
    /// [`Error::Rpc`] with `InvalidArgument` for an empty id, ranks out of range or a bad
    /// engine endpoint; with `AlreadyExists` ([`Error::is_worker_id_in_use`]) when the id's
    /// command stream is connected under another incarnation (see
    /// [`with_incarnation`](Self::with_incarnation)) or the engine URL is another connected
    /// worker's.
    pub async fn register(&self, reg: &Registration) -> Result<(), Error> {
        self.retrying(
            "RegisterWorker",
            pb::RegisterWorkerRequest {
                worker_id: reg.worker_id.clone(),
                instance: reg.instance.clone(),
                ranks: reg.ranks.clone(),
                layout: Some(convert::layout_pb(&reg.layout)),
                engine: reg.engine.as_ref().map(convert::engine_pb),
                resident_version: reg
                    .resident_version
                    .as_ref()
                    .map(ToString::to_string)
                    .unwrap_or_default(),
                model_limits: reg.model_limits.as_ref().map(convert::model_limits_pb),
                incarnation: self.incarnation,
                last_refit_id: reg.seen.refit,
                leader_epoch: reg.seen.epoch,
            },
            |mut rpc, req| async move { rpc.register_worker(req).await },
        )
        .await?;
        Ok(())
    }

    /// Retires `worker_id` (`RetireWorker`, journaled): status, admission and default refit sets
    /// forget it. A worker retires its own id on a clean exit (this client's incarnation must
    /// be its last registration's); an orchestrator retires an id whose command stream is
    /// closed. `reason`: printable ASCII, at most 256 bytes (may be empty).
    ///
    /// # Errors
    /// `NOT_FOUND` for an unknown id, `ALREADY_EXISTS` ([`Error::is_worker_id_in_use`]) while
    /// another process holds it connected, `FAILED_PRECONDITION` while a refit holds it,
    /// `PERMISSION_DENIED` outside the caller's role or scope.
    pub async fn retire_worker(&self, worker_id: &str, reason: &str) -> Result<(), Error> {
        self.once(
            "RetireWorker",
            pb::RetireWorkerRequest {
                worker_id: worker_id.to_string(),
                reason: reason.to_string(),
                incarnation: self.incarnation,
            },
            |mut rpc, req| async move { rpc.retire_worker(req).await },
        )
        .await?;
        Ok(())
    }

    /// Accepts the journal as it stands after the fleet contradicted it (`AcceptJournal`,
    /// journaled; [`crate::testimony`]): returns the contradictions accepted, in words, and the
    /// open refit that goes on, if any. `reason`: printable ASCII, 1 to 256 bytes.
    ///
    /// # Errors
    /// `FAILED_PRECONDITION` when nothing contradicts the journal, `INVALID_ARGUMENT` for a bad
    /// reason, `PERMISSION_DENIED` outside the orchestrator role.
    pub async fn accept_journal(&self, reason: &str) -> Result<(Vec<String>, Option<u64>), Error> {
        let r = self
            .once(
                "AcceptJournal",
                pb::AcceptJournalRequest {
                    reason: reason.to_string(),
                },
                |mut rpc, req| async move { rpc.accept_journal(req).await },
            )
            .await?
            .into_inner();
        Ok((
            r.accepted,
            (r.resumed_refit != 0).then_some(r.resumed_refit),
        ))
    }

    /// [`register`](Self::register) for a worker without engine routes or weights.
    ///
    /// # Errors
    /// As [`register`](Self::register).
    pub async fn register_worker(
        &self,
        worker_id: &str,
        instance: &str,
        ranks: &[u32],
        layout: LayoutSpec,
    ) -> Result<(), Error> {
        self.register(&Registration {
            worker_id: worker_id.to_string(),
            instance: instance.to_string(),
            ranks: ranks.to_vec(),
            layout,
            engine: None,
            resident_version: None,
            model_limits: None,
            seen: Default::default(),
        })
        .await
    }

    /// Starts a refit (STAGE .. COMMIT, or ABORT / ROLLBACK) driven by the control plane;
    /// returns its id at once. Zero timeouts in `spec` mean the defaults.
    ///
    /// # Errors
    /// [`Error::Rpc`]: `FailedPrecondition` when a refit is open or the version is not READY,
    /// `NotFound` for an unknown label, `InvalidArgument` for a bad check.
    pub async fn refit(&self, spec: &RefitSpec) -> Result<u64, Error> {
        // One id for every attempt of this request: a replica that already started the refit
        // answers its id instead of starting a second one.
        let req = pb::RefitRequest {
            request_id: random_u64(),
            ..convert::refit_request_pb(spec)
        };
        let r = self
            .retrying(
                "Refit",
                req,
                |mut rpc, req| async move { rpc.refit(req).await },
            )
            .await?
            .into_inner();
        Ok(r.refit_id)
    }

    /// Long poll until refit `id` (0 = the latest) ended or `timeout` passed; returns whether it
    /// ended and its record (`None` when there is no such refit).
    ///
    /// # Errors
    /// [`Error::Rpc`], or [`Error::InvalidField`] when the record does not decode.
    pub async fn wait_refit(
        &self,
        id: u64,
        timeout: Duration,
    ) -> Result<(bool, Option<Refit>), Error> {
        let r = self
            .retrying(
                "WaitRefit",
                pb::WaitRefitRequest {
                    refit_id: id,
                    timeout_ms: u64::try_from(timeout.as_millis()).unwrap_or(u64::MAX),
                },
                |mut rpc, req| async move { rpc.wait_refit(req).await },
            )
            .await?
            .into_inner();
        Ok((r.ended, r.refit.as_ref().map(convert::refit).transpose()?))
    }

    /// The distinct layouts of registered workers, sorted.
    ///
    /// # Errors
    /// [`Error::Rpc`] when the call fails.
    pub async fn list_layouts(&self) -> Result<Vec<LayoutSpec>, Error> {
        self.list_layouts_as("").await
    }

    /// [`ControlClient::list_layouts`] by the publisher with NIXL agent `agent_name`, which the
    /// control plane then shows live in its status ([`crate::Liveness`]); a serving publisher's
    /// layout watcher calls it every [`crate::types::PUBLISHER_PING_MS`].
    ///
    /// # Errors
    /// As [`ControlClient::list_layouts`]; [`Error::InvalidField`] for an agent name over the
    /// limits.
    pub async fn list_layouts_as(&self, agent_name: &str) -> Result<Vec<LayoutSpec>, Error> {
        let r = self
            .retrying(
                "ListLayouts",
                pb::ListLayoutsRequest {
                    agent_name: agent_name.to_string(),
                },
                |mut rpc, req| async move { rpc.list_layouts(req).await },
            )
            .await?
            .into_inner();
        r.layouts
            .iter()
            .enumerate()
            .map(|(i, l)| convert::layout(l, &format!("layouts[{i}]")))
            .collect()
    }

    /// Opens the worker's command stream (replacing any older one of the same incarnation). The
    /// outstanding command, if any, arrives first.
    ///
    /// # Errors
    /// [`Error::Rpc`] with `FailedPrecondition` when the worker is not registered; with
    /// `AlreadyExists` when its last registration was another incarnation's.
    pub async fn watch_commands(&self, worker_id: &str) -> Result<CommandStream, Error> {
        let inner = self
            .retrying(
                "WatchCommands",
                pb::WatchCommandsRequest {
                    worker_id: worker_id.to_string(),
                    incarnation: self.incarnation,
                },
                |mut rpc, req| async move { rpc.watch_commands(req).await },
            )
            .await?;
        let epoch = match inner.metadata().get(mx_adapters::EPOCH_HEADER) {
            None => None,
            Some(v) => Some(
                v.to_str()
                    .ok()
                    .and_then(|v| v.parse::<u64>().ok())
                    .ok_or_else(|| Error::InvalidField {
                        field: mx_adapters::EPOCH_HEADER.into(),
                        reason: format!("not a decimal epoch: {v:?}"),
                    })?,
            ),
        };
        Ok(CommandStream {
            inner: inner.into_inner(),
            epoch,
        })
    }

    /// Asks workers to stage a READY version (pull and verify it beside their live weights).
    /// Committing it is a [`refit`](Self::refit).
    ///
    /// # Errors
    /// [`Error::Rpc`] with `FailedPrecondition` unless the version is READY and every worker is
    /// registered and in no open refit (the message names the worker).
    pub async fn stage(&self, label: &str, worker_ids: &[impl AsRef<str>]) -> Result<(), Error> {
        self.retrying(
            "Stage",
            pb::StageRequest {
                label: label.to_string(),
                worker_ids: ids(worker_ids),
            },
            |mut rpc, req| async move { rpc.stage(req).await },
        )
        .await?;
        Ok(())
    }

    /// Reports a stage result.
    ///
    /// # Errors
    /// [`Error::Rpc`] with `FailedPrecondition` unless the worker is staging that version.
    pub async fn report_staged(&self, report: &StagedReport) -> Result<(), Error> {
        self.retrying(
            "ReportStaged",
            convert::staged_pb(report),
            |mut rpc, req| async move { rpc.report_staged(req).await },
        )
        .await?;
        Ok(())
    }

    /// Reports what the rank of worker `worker_id` (registered as `incarnation`) holds in its
    /// engine's live weights after an install (`error`: why it failed and what was restored;
    /// empty when it succeeded). See `ResidentReport` in the protocol.
    ///
    /// # Errors
    /// [`Error::Rpc`] with `FailedPrecondition` when `incarnation` is not the worker's last
    /// registration, `InvalidArgument` for an error that is not printable ASCII of at most
    /// 1024 bytes.
    pub async fn report_resident(
        &self,
        worker_id: &str,
        incarnation: u64,
        resident: Option<&ResidentVersion>,
        error: &str,
    ) -> Result<(), Error> {
        let req = pb::ResidentReport {
            worker_id: worker_id.to_string(),
            incarnation,
            resident_version: resident.map(ToString::to_string).unwrap_or_default(),
            error: error.to_string(),
        };
        self.retrying("ReportResident", req, |mut rpc, req| async move {
            rpc.report_resident(req).await
        })
        .await?;
        Ok(())
    }

    /// Everything known about a version, with its manifests.
    ///
    /// # Errors
    /// [`Error::Rpc`] with `NotFound` for an undeclared label.
    pub async fn get_version(&self, label: &str) -> Result<VersionInfo, Error> {
        let r = self
            .retrying(
                "GetVersion",
                pb::GetVersionRequest {
                    label: label.to_string(),
                    want: None,
                },
                |mut rpc, req| async move { rpc.get_version(req).await },
            )
            .await?
            .into_inner();
        convert::version_info(&r)
    }

    /// What a worker's plan reads of a version (bounded fan-out): the record with only the
    /// shards and pieces `want` selects, the declared tensors it names, and, once the version
    /// has an id, [`VersionInfo::proof`]: the Merkle proof of the shards sent, to check with
    /// [`mx_layout::merkle::VersionProof::verify`] (an older control plane answers the whole
    /// record without one).
    ///
    /// # Errors
    /// [`Error::Rpc`] with `NotFound` for an undeclared label, `InvalidArgument` for a want
    /// over the limits ([`crate::limits::MAX_WANT_REGIONS`]).
    pub async fn get_version_for(
        &self,
        label: &str,
        want: &mx_layout::Want,
    ) -> Result<VersionInfo, Error> {
        let r = self
            .retrying(
                "GetVersion",
                pb::GetVersionRequest {
                    label: label.to_string(),
                    want: Some(convert::want_pb(want)),
                },
                |mut rpc, req| async move { rpc.get_version(req).await },
            )
            .await?
            .into_inner();
        convert::version_info(&r)
    }

    /// All versions (with their sources and the publishers' liveness) and workers (with why
    /// each is not admitted), without per-tensor digests ([`ControlClient::get_status_with`]).
    ///
    /// # Errors
    /// [`Error::Rpc`] when the call fails.
    pub async fn get_status(&self) -> Result<FleetStatus, Error> {
        self.get_status_with(false).await
    }

    /// [`ControlClient::get_status`], with each worker's per-tensor digests in
    /// `last_staged.ranks` when `digests` (without, those are empty: they are most of a status,
    /// thousands of entries per worker).
    ///
    /// # Errors
    /// As [`ControlClient::get_status`].
    pub async fn get_status_with(&self, digests: bool) -> Result<FleetStatus, Error> {
        let r = self
            .retrying(
                "GetStatus",
                pb::GetStatusRequest { digests },
                |mut rpc, req| async move { rpc.get_status(req).await },
            )
            .await?
            .into_inner();
        convert::fleet(&r)
    }

    /// Waits (server-side long poll) until every worker in `worker_ids` is in `state` for `label`,
    /// or one of them FAILED, or `timeout` passes; returns whether the state was reached and a
    /// brief of each worker (state, label, last error). An unregistered worker counts as FAILED.
    ///
    /// # Errors
    /// [`Error::Rpc`] when the call fails; [`Error::InvalidField`] for a malformed answer.
    pub async fn wait_workers(
        &self,
        label: &str,
        worker_ids: &[impl AsRef<str>],
        state: WorkerState,
        timeout: Duration,
    ) -> Result<(bool, Vec<WorkerBrief>), Error> {
        let r = self
            .retrying(
                "WaitWorkers",
                pb::WaitWorkersRequest {
                    label: label.to_string(),
                    worker_ids: worker_ids.iter().map(|w| w.as_ref().to_string()).collect(),
                    state: convert::worker_state_pb(state),
                    timeout_ms: u64::try_from(timeout.as_millis()).unwrap_or(u64::MAX),
                },
                |mut rpc, req| async move { rpc.wait_workers(req).await },
            )
            .await?
            .into_inner();
        let mut out = Vec::with_capacity(r.workers.len());
        for b in r.workers {
            out.push(WorkerBrief {
                state: convert::worker_state(b.state, "workers.state")?,
                label: (!b.label.is_empty()).then_some(b.label),
                error: (!b.error.is_empty()).then_some(b.error),
                worker_id: b.worker_id,
            });
        }
        Ok((r.reached, out))
    }

    /// Waits (server-side long poll, no busy polling) until the version reaches `state` or a later
    /// one, and returns it. An undeclared label is waited for too.
    ///
    /// # Errors
    /// [`Error::WaitNotReached`] when `timeout` passes first (or the server shuts down);
    /// [`Error::Rpc`] when the call fails.
    pub async fn wait_version(
        &self,
        label: &str,
        state: VersionState,
        timeout: Duration,
    ) -> Result<VersionInfo, Error> {
        let timeout_ms = u64::try_from(timeout.as_millis()).unwrap_or(u64::MAX);
        let r = self
            .retrying(
                "WaitVersion",
                pb::WaitVersionRequest {
                    label: label.to_string(),
                    state: convert::version_state_pb(state),
                    timeout_ms,
                },
                |mut rpc, req| async move { rpc.wait_version(req).await },
            )
            .await?
            .into_inner();
        let info = r.version.as_ref().map(convert::version_info).transpose()?;
        match info {
            Some(info) if r.reached => Ok(info),
            other => {
                let current = other.map(|i| i.state);
                Err(Error::WaitNotReached {
                    label: label.to_string(),
                    wanted: state,
                    current: crate::error::OptionalState(current),
                })
            }
        }
    }

    /// Waits (server-side long poll) until the sources of `label` may stop serving it, and
    /// returns why ([`Release`]): every worker of its last stage staged it, a refit to it ended
    /// without committing first, a later version committed, or a source released it. `None`
    /// when `timeout` passed first (an undeclared label is waited for too).
    ///
    /// # Errors
    /// [`Error::Rpc`] when the call fails (e.g. the server shut down mid-wait: transient);
    /// [`Error::InvalidField`] for a malformed answer.
    pub async fn wait_released(
        &self,
        label: &str,
        timeout: Duration,
    ) -> Result<Option<Release>, Error> {
        let r = self
            .retrying(
                "WaitReleased",
                pb::WaitReleasedRequest {
                    label: label.to_string(),
                    timeout_ms: u64::try_from(timeout.as_millis()).unwrap_or(u64::MAX),
                },
                |mut rpc, req| async move { rpc.wait_released(req).await },
            )
            .await?
            .into_inner();
        r.release
            .as_ref()
            .map(|x| convert::release(x, "release"))
            .transpose()
    }

    /// Says source `slot` no longer serves `label` (journaled; a no-op once the version is
    /// released for any reason).
    ///
    /// # Errors
    /// [`Error::Rpc`]: `NotFound` for an undeclared label, `InvalidArgument` for a slot outside
    /// the trainer layout.
    pub async fn release_version(&self, label: &str, slot: u32) -> Result<(), Error> {
        self.retrying(
            "ReleaseVersion",
            pb::ReleaseVersionRequest {
                label: label.to_string(),
                slot,
            },
            |mut rpc, req| async move { rpc.release_version(req).await },
        )
        .await?;
        Ok(())
    }

    /// Serves READY version `label`, resident on worker `worker_id`, from that worker's memory
    /// as described by `manifest` (journaled; the same manifest again is a no-op).
    ///
    /// # Errors
    /// [`Error::Rpc`]: `NotFound` for an unknown label or worker, `InvalidArgument` naming the
    /// field (the version not resident on the worker, a shard that is not a region of the
    /// version's record for the worker's layout, a piece whose digest differs from the record).
    pub async fn serve_peer(
        &self,
        label: &str,
        worker_id: &str,
        manifest: &SourceManifest,
    ) -> Result<(), Error> {
        self.retrying(
            "ServePeer",
            pb::ServePeerRequest {
                label: label.to_string(),
                worker_id: worker_id.to_string(),
                manifest: Some(convert::manifest_pb(manifest)),
            },
            |mut rpc, req| async move { rpc.serve_peer(req).await },
        )
        .await?;
        Ok(())
    }

    /// Stops worker `worker_id` serving `label` (every version when `None`) from its memory.
    ///
    /// # Errors
    /// [`Error::Rpc`].
    pub async fn withdraw_peer(&self, worker_id: &str, label: Option<&str>) -> Result<(), Error> {
        self.retrying(
            "WithdrawPeer",
            pb::WithdrawPeerRequest {
                worker_id: worker_id.to_string(),
                label: label.unwrap_or_default().to_string(),
            },
            |mut rpc, req| async move { rpc.withdraw_peer(req).await },
        )
        .await?;
        Ok(())
    }

    /// Records an artifact of READY version `label` (journaled; the same record again is a
    /// no-op).
    ///
    /// # Errors
    /// [`Error::Rpc`]: `NotFound` for an undeclared label, `InvalidArgument` naming the field
    /// (a version not READY, a malformed URL, a delta without a known base, a URL recorded with
    /// another manifest).
    pub async fn register_artifact(&self, label: &str, a: &ArtifactRecord) -> Result<(), Error> {
        self.retrying(
            "RegisterArtifact",
            pb::RegisterArtifactRequest {
                label: label.to_string(),
                artifact: Some(convert::artifact_pb(a)),
            },
            |mut rpc, req| async move { rpc.register_artifact(req).await },
        )
        .await?;
        Ok(())
    }

    /// Publishes the outputs version `label`'s trainer expects of it ([`crate::check`]): greedy
    /// tokens of each probe prompt from its own forward pass, with its top-two margins. Every
    /// refit of the version then checks against them unless it brings a check of its own or
    /// sets `no_check`. A `tie_margin` of 0 with margins given becomes
    /// [`crate::check::DEFAULT_TIE_MARGIN`]. Journaled; the same outputs again are a no-op.
    ///
    /// # Errors
    /// [`Error::Rpc`]: `NotFound` for an undeclared label, `InvalidArgument` naming the field
    /// at fault (`outputs.probes[1].margins`), `FailedPrecondition` when other outputs were
    /// already published for the version.
    pub async fn publish_expected_outputs(
        &self,
        label: &str,
        outputs: &GenerationCheck,
    ) -> Result<(), Error> {
        self.retrying(
            "PublishExpectedOutputs",
            pb::PublishExpectedOutputsRequest {
                label: label.to_string(),
                outputs: Some(convert::generation_check_pb(outputs)),
            },
            |mut rpc, req| async move { rpc.publish_expected_outputs(req).await },
        )
        .await?;
        Ok(())
    }
}

#[cfg(test)]
#[allow(clippy::unwrap_used)] // reason: tests fail loudly on purpose
mod tests {
    use super::*;

    #[test]
    fn backoff_doubles_within_jittered_bounds_up_to_the_cap() {
        let ms = Duration::from_millis;
        let mut b = Backoff::new(ms(100), ms(800));
        let mut seen = Vec::new();
        for n in 0..8u32 {
            let d = ms(100 * 2u64.pow(n)).min(ms(800));
            let w = b.next_wait();
            assert!(
                w >= d / 2 && w < d,
                "wait {n}: {w:?} not in [{:?}, {d:?})",
                d / 2
            );
            seen.push(w);
        }
        // Jitter: eight draws are not all the bare lower bounds.
        assert!(seen
            .iter()
            .zip(0u32..)
            .any(|(w, n)| *w != ms(50 * 2u64.pow(n.min(3)))));
        // A cap below the start is the start.
        let w = Backoff::new(ms(100), ms(10)).next_wait();
        assert!(w >= ms(50) && w < ms(100), "{w:?}");
    }

    #[tokio::test]
    async fn calls_move_to_the_named_leader_else_to_the_next_replica() {
        let c = ControlClient::replicas(
            "http://127.0.0.1:1, 127.0.0.1:2,http://127.0.0.1:3/",
            &ClientAuth::none(),
        )
        .unwrap();
        let r = c.replicas.as_ref().unwrap();
        let urls: Vec<&str> = r.all.iter().map(|(u, _)| u.as_str()).collect();
        assert_eq!(
            urls,
            ["http://127.0.0.1:1", "127.0.0.1:2", "http://127.0.0.1:3/"]
        );
        assert_eq!(c.rpc().0, 0);
        // A follower names the leader: calls go there (URL spelled differently).
        let mut follower = tonic::Status::unavailable(
            "this control-plane replica (http://127.0.0.1:1) is a follower: the leader is \
             http://127.0.0.1:3 (epoch 42)",
        );
        // The message alone moves nothing: the leader is named in the metadata.
        r.note(0, &follower);
        assert_eq!(c.rpc().0, 1);
        r.note(1, &tonic::Status::unavailable("connection refused"));
        assert_eq!(c.rpc().0, 2);
        r.note(2, &tonic::Status::unavailable("connection refused"));
        assert_eq!(c.rpc().0, 0);
        follower
            .metadata_mut()
            .insert(LEADER_HEADER, "http://127.0.0.1:3".parse().unwrap());
        r.note(0, &follower);
        assert_eq!(c.rpc().0, 2);
        // A late failure from the replica already left behind does not move it on.
        r.note(0, &tonic::Status::unavailable("connection refused"));
        assert_eq!(c.rpc().0, 2);
        // The leader gone (no name): the next replica, wrapping around.
        r.note(2, &tonic::Status::unavailable("connection refused"));
        assert_eq!(c.rpc().0, 0);
        // Other errors are the leader's own answers: no move.
        r.note(0, &tonic::Status::permission_denied("role"));
        assert_eq!(c.rpc().0, 0);
        assert!(ControlClient::replicas(" , ", &ClientAuth::none()).is_err());
    }
}
