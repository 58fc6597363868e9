//! The product's commands that have no module of their own: the control plane, the reference
//! worker, and the orchestrator's small clients (declare, stage, commit, status, journal).

use std::path::PathBuf;
use std::time::Duration;

use anyhow::Context;
use mx_layout::LayoutSpec;

use crate::refits::print_refit;
use crate::{parse_listen, refit_cmd, terminated};

/// Flags of `mx control`.
#[derive(clap::Args, Debug)]
pub struct ControlArgs {
    /// Listen address, `host:port` (port 0 picks a free port).
    #[arg(long, default_value = "127.0.0.1:7700", value_parser = parse_listen)]
    pub listen: std::net::SocketAddr,
    /// Journal file (created, or replayed when present).
    #[arg(long, default_value = ".mx/control/journal.jsonl")]
    pub journal: PathBuf,
    /// Write the bound address here once listening.
    #[arg(long)]
    pub addr_file: Option<PathBuf>,
    /// Token file: `token,role,name[,scope]` per line (roles: orchestrator, publisher
    /// SLOTS, worker ID|PREFIX*, reader). SIGHUP reads it again: a file that parses takes
    /// effect for every later call (journaled as `tokens_reloaded`); one that does not changes
    /// nothing.
    #[arg(long, env = "MX_CONTROL_TOKENS")]
    pub tokens: Option<PathBuf>,
    /// TLS certificate chain (PEM); with --tls-key, the control plane serves https.
    #[arg(long, env = "MX_CONTROL_TLS_CERT", requires = "tls_key")]
    pub tls_cert: Option<PathBuf>,
    /// TLS private key (PEM) of --tls-cert.
    #[arg(long, env = "MX_CONTROL_TLS_KEY", requires = "tls_cert")]
    pub tls_key: Option<PathBuf>,
    /// Serve without authentication (loopback addresses only; logged as a warning): any
    /// local process could then publish, register workers and refit the fleet.
    #[arg(long, conflicts_with = "tokens")]
    pub insecure_loopback: bool,
    /// A file holding the bearer token sent on every engine call (the engines' API key;
    /// `mx worker --http-token-file` requires it).
    #[arg(long, env = "MX_ENGINE_TOKEN_FILE")]
    pub engine_token_file: Option<PathBuf>,
    /// Serve Prometheus `/metrics`, `/health` and `/ready` over plain HTTP on this address
    /// (unauthenticated, like most scrape targets: counts and durations only, no ids,
    /// manifests or metadata).
    #[arg(long, env = "MX_CONTROL_METRICS", value_parser = parse_listen)]
    pub metrics: Option<std::net::SocketAddr>,
    /// High availability (work in progress): etcd client URLs, comma separated. The replica
    /// campaigns for leadership and, once elected, keeps the journal in etcd (--journal is
    /// not used) and serves; a deposed leader exits (74).
    #[arg(
        long,
        env = "MX_CONTROL_ETCD",
        value_delimiter = ',',
        requires = "advertise"
    )]
    pub etcd: Vec<String>,
    /// The URL clients reach this replica at (what followers name as the leader).
    #[arg(long, env = "MX_CONTROL_ADVERTISE")]
    pub advertise: Option<String>,
    /// With --etcd: keep manifests and snapshots in this bucket (`s3://bucket/prefix`; the
    /// client from the AWS_* variables) instead of etcd, whose entries hold at most 1 MiB:
    /// the journal then holds each manifest's BLAKE3 digest, verified when read back.
    #[arg(long, env = "MX_MANIFEST_STORE", requires = "etcd")]
    pub manifest_store: Option<String>,
    /// The leader lease with --etcd, seconds: a leader that stops renewing is deposed this
    /// long after.
    #[arg(long, default_value_t = 5)]
    pub lease_ttl_s: i64,
    /// Compact the journal into a snapshot (`<journal>.snapshot`; with --etcd, chunks
    /// under the journal's prefix) once it holds more than this many bytes (0: never by
    /// size) [default: 268435456, 256 MiB; with --etcd 67108864, 64 MiB: etcd's storage
    /// quota is 2 GiB by default and keeps deleted keys until it compacts its history]
    #[arg(long)]
    pub compact_journal_bytes: Option<u64>,
    /// ... or more than this many records after the last snapshot (0: never by count).
    #[arg(long, default_value_t = mx_control::snapshot::DEFAULT_MAX_JOURNAL_RECORDS)]
    pub compact_journal_records: u64,
    /// Keep every engine call of the last N refits that ended; older refits keep their
    /// summary (outcome, phases, times, counts).
    #[arg(long, default_value_t = mx_control::snapshot::DEFAULT_REFIT_DETAIL)]
    pub refit_detail: usize,
    /// Retire worker ids whose command stream has been closed longer than this many seconds
    /// (journaled; status, admission and default refit sets forget them) unless a refit holds
    /// them. Default: keep them until their process exits cleanly or `mx retire`.
    #[arg(long, value_name = "SECONDS")]
    pub retire_departed_after: Option<f64>,
    /// Replay journal lines that carry no checksum (a journal written before lines had one)
    /// instead of refusing the journal. A line whose checksum was stripped reads the same, so
    /// give it only for a journal known to predate checksums.
    #[arg(long)]
    pub accept_unchecked_journal_lines: bool,
    /// After a restart with an open refit, wait up to this long for the refit's workers to
    /// register again before settling it, so that what they hold can contradict a damaged
    /// journal (the control plane then stops acting until `mx accept-journal` or a restored
    /// journal).
    #[arg(long, value_name = "SECONDS", default_value_t = 10.0)]
    pub testimony_wait: f64,
}

/// Flags of `mx worker`.
#[derive(clap::Args, Debug)]
pub struct WorkerArgs {
    /// Control plane address.
    #[arg(long, default_value = "http://127.0.0.1:7700")]
    pub control: String,
    /// Model directory (config.json + safetensors header give the tensor list).
    #[arg(long)]
    pub model: PathBuf,
    /// Inference layout.
    #[arg(long, default_value = "tp:3")]
    pub layout: LayoutSpec,
    /// Ranks held, comma separated (default: all ranks of the layout).
    #[arg(long, value_delimiter = ',')]
    pub ranks: Vec<u32>,
    /// Worker id.
    #[arg(long)]
    pub id: String,
    /// Instance this process belongs to (default: the worker id); an instance may be one
    /// process holding all its ranks or one process per rank.
    #[arg(long)]
    pub instance: Option<String>,
    /// Listen address of the engine HTTP routes (Dynamo, SGLang, /generate); port 0 picks a
    /// free port. The bound URL is printed and registered with the control plane.
    #[arg(long, default_value = "127.0.0.1:0", value_parser = parse_listen)]
    pub http: std::net::SocketAddr,
    /// Engine contract the control plane should speak to this worker: dynamo or dynamo_sglang
    /// (a Dynamo vLLM or Dynamo SGLang worker's routes; both are always served).
    #[arg(long, default_value = "dynamo")]
    pub engine_api: mx_control::EngineApi,
    /// Exit (status 69) after the control plane stayed unreachable this many seconds. 0,
    /// the default, retries forever while the engine keeps serving its weights.
    #[arg(long, default_value_t = 0)]
    pub reconnect_timeout_s: u64,
    /// Checkpoint directory loaded as the initial live weights, before registering.
    #[arg(long)]
    pub load: Option<PathBuf>,
    /// Version id of the --load weights (default: disk:<DIR>).
    #[arg(long, requires = "load")]
    pub load_version: Option<String>,
    /// Do not serve the resident version to other workers (a peer source) from the live
    /// memory.
    #[arg(long)]
    pub no_peer: bool,
    /// A file holding the bearer token every call to the engine routes must carry (the
    /// control plane's --engine-token-file). Required for a non-loopback --http.
    #[arg(long, env = "MX_ENGINE_TOKEN_FILE")]
    pub http_token_file: Option<PathBuf>,
}

/// Flags of `mx declare`.
#[derive(clap::Args, Debug)]
pub struct DeclareArgs {
    /// Control plane address.
    #[arg(long, default_value = "http://127.0.0.1:7700")]
    pub control: String,
    /// HF checkpoint directory (only headers are read).
    #[arg(long)]
    pub model: PathBuf,
    /// Trainer layout: one source slot per rank.
    #[arg(long, default_value = "fsdp:4")]
    pub trainer_layout: LayoutSpec,
    /// Version label (e.g. the trainer step).
    #[arg(long)]
    pub label: String,
}

/// Flags of `mx stage`.
#[derive(clap::Args, Debug)]
pub struct StageArgs {
    /// Control plane address.
    #[arg(long, default_value = "http://127.0.0.1:7700")]
    pub control: String,
    /// Version label.
    #[arg(long)]
    pub label: String,
    /// Worker ids, comma separated.
    #[arg(long, value_delimiter = ',', required = true)]
    pub workers: Vec<String>,
    /// Seconds to wait.
    #[arg(long, default_value_t = 300)]
    pub wait_s: u64,
}

/// Flags of `mx commit`.
#[derive(clap::Args, Debug)]
pub struct CommitArgs {
    /// Control plane address.
    #[arg(long, default_value = "http://127.0.0.1:7700")]
    pub control: String,
    /// Version label.
    #[arg(long)]
    pub label: String,
    /// Worker ids, comma separated.
    #[arg(long, value_delimiter = ',', required = true)]
    pub workers: Vec<String>,
    /// Seconds the refit's STAGE may take.
    #[arg(long, default_value_t = 300)]
    pub wait_s: u64,
}

/// Flags of `mx status`.
#[derive(clap::Args, Debug)]
pub struct StatusArgs {
    /// Control plane address.
    #[arg(long, default_value = "http://127.0.0.1:7700")]
    pub control: String,
    /// Print the status as one JSON object (versions with their sources, workers with their
    /// gate, fleet_version as {label, version_id}, open_refit, halted) instead of text.
    #[arg(long)]
    pub json: bool,
    /// With --json: include every worker's per-tensor digests of its last stage
    /// (last_staged.ranks; thousands of entries per worker).
    #[arg(long, requires = "json")]
    pub digests: bool,
    /// List every version, not only the newest six and the fleet's.
    #[arg(long)]
    pub all: bool,
}

/// Flags of `mx retire`.
#[derive(clap::Args, Debug)]
pub struct RetireArgs {
    /// Control plane address.
    #[arg(long, default_value = "http://127.0.0.1:7700")]
    pub control: String,
    /// The worker ids to retire (comma-separated); each must be departed (its command stream
    /// closed) and in no open refit.
    #[arg(long, value_delimiter = ',', required = true)]
    pub workers: Vec<String>,
    /// Why (printed by the journal).
    #[arg(long, default_value = "retired by an operator")]
    pub reason: String,
}

/// Flags of `mx accept-journal`.
#[derive(clap::Args, Debug)]
pub struct AcceptJournalArgs {
    /// Control plane address.
    #[arg(long, default_value = "http://127.0.0.1:7700")]
    pub control: String,
    /// Why the journal stands (journaled; printable ASCII, at most 256 bytes).
    #[arg(long)]
    pub reason: String,
}

/// `mx accept-journal`: accepts the journal as it stands after the fleet contradicted it
/// (`mx status` says HALTED), so that the control plane acts on the fleet again.
///
/// # Errors
/// The control plane's refusal (nothing to accept, a bad reason, not an orchestrator).
pub(crate) async fn accept_journal(a: AcceptJournalArgs) -> anyhow::Result<()> {
    let client = mx_control::client::ControlClient::connect(&a.control).await?;
    let (accepted, resumed) = client.accept_journal(&a.reason).await?;
    for c in &accepted {
        println!("accepted: {c}");
    }
    match resumed {
        Some(id) => println!(
            "acting on the fleet again; open refit {id} is settled as after a restart (`mx journal --refits` shows how it ends)"
        ),
        None => println!("acting on the fleet again"),
    }
    Ok(())
}

/// `mx retire`: retires departed worker ids, one by one; stops at the first refusal.
///
/// # Errors
/// The control plane's refusal, naming the worker.
pub(crate) async fn retire(a: RetireArgs) -> anyhow::Result<()> {
    let client = mx_control::client::ControlClient::connect(&a.control).await?;
    for w in &a.workers {
        client
            .retire_worker(w, &a.reason)
            .await
            .with_context(|| format!("retiring worker {w}"))?;
        println!("retired {w}");
    }
    Ok(())
}

/// Flags of `mx journal`.
#[derive(clap::Args, Debug)]
pub struct JournalArgs {
    /// Journal file.
    #[arg(default_value = ".mx/control/journal.jsonl")]
    pub path: PathBuf,
    /// Replay the journal and print every refit (phases, per worker previous -> resulting
    /// version, timings, cache tiers, post-update tokens) and whether its record is complete,
    /// instead of the raw records.
    #[arg(long)]
    pub refits: bool,
}

/// `mx control`.
pub(crate) async fn control(args: ControlArgs) -> anyhow::Result<()> {
    let ControlArgs {
        listen,
        journal,
        addr_file,
        tokens,
        tls_cert,
        tls_key,
        insecure_loopback,
        engine_token_file,
        metrics,
        etcd,
        advertise,
        manifest_store,
        lease_ttl_s,
        compact_journal_bytes,
        compact_journal_records,
        refit_detail,
        retire_departed_after,
        accept_unchecked_journal_lines,
        testimony_wait,
    } = args;
    let testimony_wait = std::time::Duration::try_from_secs_f64(testimony_wait)
        .ok()
        .with_context(|| format!("--testimony-wait {testimony_wait}: a number of seconds"))?;
    let retire_departed_after = retire_departed_after
        .map(|s| {
            std::time::Duration::try_from_secs_f64(s)
                .ok()
                .filter(|d| !d.is_zero())
                .with_context(|| {
                    format!("--retire-departed-after {s}: a positive number of seconds")
                })
        })
        .transpose()?;
    let security = mx_control::Security::from_files(
        tokens.as_deref(),
        tls_cert.as_deref(),
        tls_key.as_deref(),
        insecure_loopback,
        engine_token_file.as_deref(),
    )?;
    if let Some(dir) = journal.parent() {
        std::fs::create_dir_all(dir).with_context(|| format!("creating {}", dir.display()))?;
    }
    let cfg = mx_control::ControlPlaneConfig {
        compaction: mx_control::snapshot::Compaction {
            max_journal_bytes: compact_journal_bytes.unwrap_or(if etcd.is_empty() {
                mx_control::snapshot::DEFAULT_MAX_JOURNAL_BYTES
            } else {
                mx_control::snapshot::DEFAULT_MAX_ETCD_JOURNAL_BYTES
            }),
            max_journal_records: compact_journal_records,
            refit_detail,
            retire_departed_after,
            testimony_wait,
            accept_unchecked_lines: accept_unchecked_journal_lines,
        },
        listen,
        journal_path: journal,
        security,
    };
    let (addr, handle) = match &advertise {
        Some(url) if !etcd.is_empty() => {
            anyhow::ensure!(lease_ttl_s >= 1, "--lease-ttl-s must be at least 1");
            let etcd = mx_control::ha::EtcdConfig {
                endpoints: etcd.clone(),
                election: "mx/control/leader".into(),
                lease_ttl_s,
                blobs: manifest_store
                    .as_deref()
                    .map(mx_control::blobs::BlobStore::from_env)
                    .transpose()?,
            };
            eprintln!(
                "mx control campaigning for leadership on etcd {:?}",
                etcd.endpoints
            );
            mx_control::spawn_ha(cfg, &etcd, url, "/mx/journal/").await?
        }
        _ => mx_control::spawn(cfg).await?,
    };
    if let Some(f) = addr_file {
        let tmp = f.with_extension("tmp");
        std::fs::write(&tmp, addr.to_string())
            .with_context(|| format!("--addr-file: writing {}", tmp.display()))?;
        std::fs::rename(&tmp, &f).with_context(|| {
            format!("--addr-file: renaming {} to {}", tmp.display(), f.display())
        })?;
    }
    eprintln!("mx control listening on {addr}");
    // Dropped (and stopped) when the control plane stops.
    let _probes = match metrics {
        Some(m) => {
            let probes =
                mx_control::observe::serve(m, mx_control::observe::router(handle.probe())).await?;
            eprintln!(
                "mx control metrics at http://{}/metrics (/health, /ready)",
                probes.addr()
            );
            Some(probes)
        }
        None => None,
    };
    // SIGHUP reads the token file again (who may call changes without a restart).
    let mut hangup = tokio::signal::unix::signal(tokio::signal::unix::SignalKind::hangup())?;
    loop {
        tokio::select! {
            r = terminated() => {
                r?;
                break;
            }
            _ = hangup.recv() => match handle.reload_tokens().await {
                Ok(r) => eprintln!(
                    "mx control: token file reloaded: {} principals (were {}), blake3 {}",
                    r.after, r.before, r.file_digest
                ),
                Err(e) => eprintln!("mx control: SIGHUP: the tokens in force stay: {e}"),
            },
        }
    }
    handle.shutdown().await?;
    Ok(())
}

/// `mx worker`.
pub(crate) async fn worker(args: WorkerArgs) -> anyhow::Result<()> {
    let WorkerArgs {
        control,
        model,
        layout,
        ranks,
        id,
        instance,
        http,
        engine_api,
        reconnect_timeout_s,
        load,
        load_version,
        no_peer,
        http_token_file,
    } = args;
    let http_token = match &http_token_file {
        Some(f) => Some(mx_control::auth::read_token_file(f)?),
        None => None,
    };
    let ranks = if ranks.is_empty() {
        (0..layout.world_size).collect()
    } else {
        ranks
    };
    let w = mx_worker::Worker::start(mx_worker::WorkerConfig {
        control,
        http_token,
        model_dir: model,
        layout,
        ranks,
        instance: instance.unwrap_or_else(|| id.clone()),
        worker_id: id.clone(),
        http,
        engine_api,
        failpoints: mx_worker::failpoints::armed(),
        reconnect_timeout: (reconnect_timeout_s > 0)
            .then(|| Duration::from_secs(reconnect_timeout_s)),
        load,
        load_version,
        serve_peers: !no_peer,
        engine: Some(mx_worker::reference_engine()),
        on_staged: None,
    })
    .await?;
    eprintln!(
        "mx worker {id} serving the engine routes at {} ({engine_api} contract registered)",
        w.http_url()
    );
    tokio::select! {
        r = w.run() => r?,
        r = crate::terminated() => {
            r?;
            // A clean exit (SIGTERM, Ctrl-C): the id leaves the fleet instead of lingering as
            // a departed worker that default refit sets would have to leave out.
            w.retire("the worker exited (SIGTERM or Ctrl-C)").await;
        }
    }
    Ok(())
}

/// `mx declare`.
pub(crate) async fn declare(args: DeclareArgs) -> anyhow::Result<()> {
    let DeclareArgs {
        control,
        model,
        trainer_layout,
        label,
    } = args;
    let ckpt = mx_checkpoint::Checkpoint::open(&model)?;
    let info = ckpt.model_info(&[trainer_layout])?;
    mx_layout::rank_layouts(&info, trainer_layout)?;
    let c = mx_control::client::ControlClient::connect(&control).await?;
    c.declare_version(&label, trainer_layout, &ckpt.specs())
        .await?;
    println!(
        "declared {label}: {} source slots ({trainer_layout}), {} tensors",
        trainer_layout.world_size,
        info.tensors.len()
    );
    Ok(())
}

/// `mx stage`.
pub(crate) async fn stage(args: StageArgs) -> anyhow::Result<()> {
    let StageArgs {
        control,
        label,
        workers,
        wait_s,
    } = args;
    let c = mx_control::client::ControlClient::connect(&control).await?;
    let t = std::time::Instant::now();
    c.stage(&label, &workers).await?;
    // Long polls of at most 2 s, a progress line whenever the staged count moved.
    let deadline = t + Duration::from_secs(wait_s);
    let mut shown = None;
    let (reached, briefs) = loop {
        let left = deadline.saturating_duration_since(std::time::Instant::now());
        let (reached, briefs) = c
            .wait_workers(
                &label,
                &workers,
                mx_control::WorkerState::Staged,
                left.min(Duration::from_secs(2)),
            )
            .await?;
        let staged = briefs
            .iter()
            .filter(|b| b.state == mx_control::WorkerState::Staged)
            .count();
        if shown != Some(staged) {
            shown = Some(staged);
            eprintln!(
                "stage {label} [{:7.1} s] {staged}/{} workers staged",
                t.elapsed().as_secs_f64(),
                workers.len()
            );
        }
        let failed = briefs
            .iter()
            .any(|b| b.state == mx_control::WorkerState::Failed);
        if reached || failed || left.is_zero() {
            break (reached, briefs);
        }
    };
    if let Some(b) = briefs
        .iter()
        .find(|b| b.state == mx_control::WorkerState::Failed)
    {
        anyhow::bail!(
            "worker {} failed to stage {label}: {}",
            b.worker_id,
            b.error.clone().unwrap_or_default()
        );
    }
    anyhow::ensure!(reached, "workers did not stage {label} within {wait_s} s");
    println!(
        "{label} STAGED on {} workers in {:.3} s",
        workers.len(),
        t.elapsed().as_secs_f64()
    );
    Ok(())
}

/// `mx commit`.
pub(crate) async fn commit(args: CommitArgs) -> anyhow::Result<()> {
    let CommitArgs {
        control,
        label,
        workers,
        wait_s,
    } = args;
    let c = mx_control::client::ControlClient::connect(&control).await?;
    // `mx commit` commits what `mx stage` staged: every worker must be STAGED for it.
    let status = c.get_status().await?;
    for w in &workers {
        let s = status
            .workers
            .iter()
            .find(|s| &s.worker_id == w)
            .with_context(|| format!("worker {w:?} is not registered"))?;
        if s.state != mx_control::WorkerState::Staged || s.label.as_deref() != Some(label.as_str())
        {
            anyhow::bail!(
                "worker {w:?} is {} (version {:?}): commit of {label:?} needs every worker STAGED for it (run `mx stage` first){}",
                s.state,
                s.label.clone().unwrap_or_default(),
                s.last_error
                    .as_ref()
                    .map(|e| format!("; last error: {e}"))
                    .unwrap_or_default()
            );
        }
    }
    let spec = mx_control::RefitSpec {
        label: label.clone(),
        worker_ids: workers.clone(),
        pause_mode: mx_control::PauseMode::Wait,
        allow_partial: false,
        check: None,
        no_check: false,
        framework_step: 0,
        stage_timeout_ms: wait_s.saturating_mul(1000).max(1),
        call_timeout_ms: mx_control::refit::DEFAULT_CALL_TIMEOUT_MS,
        apply_parallelism: 0,
        orchestrator_gated: false,
        verify_from_apply_answer: false,
    };
    let id = c.refit(&spec).await?;
    let r = refit_cmd::wait_with_progress(&c, id, Duration::from_secs(wait_s.saturating_add(900)))
        .await?;
    print_refit(&r);
    refit_cmd::NotCommitted::check(&r)?;
    println!(
        "{label} COMMITTED on {} workers by refit {id}: version {}",
        r.workers.len(),
        r.digest
    );
    Ok(())
}

/// `mx status`.
pub(crate) async fn status(args: StatusArgs) -> anyhow::Result<()> {
    let StatusArgs {
        control,
        json,
        digests,
        all,
    } = args;
    let c = mx_control::client::ControlClient::connect(&control).await?;
    let s = c.get_status_with(digests).await?;
    if json {
        println!("{}", serde_json::to_string_pretty(&s)?);
        return Ok(());
    }
    print!("{}", crate::status_cmd::render(&s, &control, all));
    Ok(())
}

/// `mx journal`.
pub(crate) fn journal(args: JournalArgs) -> anyhow::Result<()> {
    let JournalArgs { path, refits } = args;
    anyhow::ensure!(path.exists(), "no journal at {}", path.display());
    let loaded = mx_control::journal::load(&path)?;
    if let Some(s) = &loaded.snapshot {
        eprintln!(
            "snapshot {} holds the state after record {} ({} bytes); the journal's records after it follow",
            mx_control::snapshot::snapshot_path(&path).display(),
            s.seq,
            s.bytes
        );
    }
    if !refits {
        for e in loaded.entries {
            println!("{}", serde_json::to_string(&e)?);
        }
        return Ok(());
    }
    let st = loaded.replay(&path)?;
    for r in st.refits() {
        print_refit(r);
        let gaps = r.journal_gaps();
        if gaps.is_empty() {
            println!("  journal: complete");
        } else {
            println!("  journal: INCOMPLETE: {}", gaps.join("; "));
        }
    }
    Ok(())
}
