//! `mx`: live policy-weight refit for RL. The binary is thin: each subcommand parses its flags
//! and calls into the crates (see README.md for the architecture).

mod export_cmd;
mod plan_cmd;
mod provenance;
mod refit_cmd;

use mx_harness::refits::print_refit;
use mx_harness::{bench, demo, runtime, trainer, validate};

use std::path::PathBuf;
use std::time::Duration;

use anyhow::Context;
use clap::{Parser, Subcommand};
use mx_layout::LayoutSpec;

/// mx: resharded trainer->inference weight refit over NIXL, committed over gRPC.
#[derive(Parser)]
#[command(name = "mx", version, long_version = provenance::LONG_VERSION, about)]
struct Cli {
    #[command(subcommand)]
    cmd: Cmd,
}

#[derive(Subcommand)]
enum Cmd {
    /// Run the control plane (gRPC) with a durable file journal.
    ///
    /// Authentication is required: a token file maps bearer tokens to roles (orchestrator,
    /// publisher, worker, reader; one `token,role,name[,scope]` per line, see `mx_control::auth`),
    /// and a non-loopback address also needs TLS. Clients send their token from
    /// MX_CONTROL_TOKEN or MX_CONTROL_TOKEN_FILE and trust the server's CA from MX_CONTROL_CA
    /// (`https://` URLs). Only a loopback address may run without tokens, with
    /// --insecure-loopback.
    Control {
        /// Listen address, `host:port` (port 0 picks a free port).
        #[arg(long, default_value = "127.0.0.1:7700", value_parser = parse_listen)]
        listen: std::net::SocketAddr,
        /// Journal file (created, or replayed when present).
        #[arg(long, default_value = ".mx/control/journal.jsonl")]
        journal: PathBuf,
        /// Write the bound address here once listening.
        #[arg(long)]
        addr_file: Option<PathBuf>,
        /// Token file: `token,role,name[,scope]` per line (roles: orchestrator, publisher
        /// SLOTS, worker ID|PREFIX*, reader).
        #[arg(long, env = "MX_CONTROL_TOKENS")]
        tokens: Option<PathBuf>,
        /// TLS certificate chain (PEM); with --tls-key, the control plane serves https.
        #[arg(long, env = "MX_CONTROL_TLS_CERT", requires = "tls_key")]
        tls_cert: Option<PathBuf>,
        /// TLS private key (PEM) of --tls-cert.
        #[arg(long, env = "MX_CONTROL_TLS_KEY", requires = "tls_cert")]
        tls_key: Option<PathBuf>,
        /// Serve without authentication (loopback addresses only; logged as a warning): any
        /// local process could then publish, register workers and refit the fleet.
        #[arg(long, conflicts_with = "tokens")]
        insecure_loopback: bool,
        /// A file holding the bearer token sent on every engine call (the engines' API key;
        /// `mx worker --http-token-file` requires it).
        #[arg(long, env = "MX_ENGINE_TOKEN_FILE")]
        engine_token_file: Option<PathBuf>,
        /// Serve Prometheus `/metrics`, `/health` and `/ready` over plain HTTP on this address
        /// (unauthenticated, like most scrape targets: counts and durations only, no ids,
        /// manifests or metadata).
        #[arg(long, env = "MX_CONTROL_METRICS", value_parser = parse_listen)]
        metrics: Option<std::net::SocketAddr>,
        /// High availability (work in progress): etcd client URLs, comma separated. The replica
        /// campaigns for leadership and, once elected, keeps the journal in etcd (--journal is
        /// not used) and serves; a deposed leader exits (74).
        #[arg(
            long,
            env = "MX_CONTROL_ETCD",
            value_delimiter = ',',
            requires = "advertise"
        )]
        etcd: Vec<String>,
        /// The URL clients reach this replica at (what followers name as the leader).
        #[arg(long, env = "MX_CONTROL_ADVERTISE")]
        advertise: Option<String>,
        /// With --etcd: keep manifests and snapshots in this bucket (`s3://bucket/prefix`; the
        /// client from the AWS_* variables) instead of etcd, whose entries hold at most 1 MiB:
        /// the journal then holds each manifest's BLAKE3 digest, verified when read back.
        #[arg(long, env = "MX_MANIFEST_STORE", requires = "etcd")]
        manifest_store: Option<String>,
        /// The leader lease with --etcd, seconds: a leader that stops renewing is deposed this
        /// long after.
        #[arg(long, default_value_t = 5)]
        lease_ttl_s: i64,
        /// Compact the journal into a snapshot (`<journal>.snapshot`; with --etcd, chunks
        /// under the journal's prefix) once it holds more than this many bytes (0: never by
        /// size) [default: 268435456, 256 MiB; with --etcd 67108864, 64 MiB: etcd's storage
        /// quota is 2 GiB by default and keeps deleted keys until it compacts its history]
        #[arg(long)]
        compact_journal_bytes: Option<u64>,
        /// ... or more than this many records after the last snapshot (0: never by count).
        #[arg(long, default_value_t = mx_control::snapshot::DEFAULT_MAX_JOURNAL_RECORDS)]
        compact_journal_records: u64,
        /// Keep every engine call of the last N refits that ended; older refits keep their
        /// summary (outcome, phases, times, counts).
        #[arg(long, default_value_t = mx_control::snapshot::DEFAULT_REFIT_DETAIL)]
        refit_detail: usize,
    },
    /// Run one trainer rank: load its shards, publish versions step-1..step-N.
    Publish {
        /// Control plane address.
        #[arg(long, default_value = "http://127.0.0.1:7700")]
        control: String,
        /// HF checkpoint directory.
        #[arg(long)]
        model: PathBuf,
        /// Trainer layout (fsdp:N, tp:N, replicated:N).
        #[arg(long, default_value = "fsdp:4")]
        layout: LayoutSpec,
        /// This trainer rank.
        #[arg(long)]
        rank: u32,
        /// Versions to publish (a training step between each), at least 1.
        #[arg(long, default_value_t = 1, value_parser = clap::value_parser!(u32).range(1..))]
        steps: u32,
        /// First version to publish: training steps 2..=K are applied to the checkpoint
        /// without publishing, then versions K..=--steps are published (a second trainer
        /// serving a later step beside the first).
        #[arg(long, default_value_t = 1, value_parser = clap::value_parser!(u32).range(1..))]
        first_step: u32,
        /// Version label prefix.
        #[arg(long, default_value = "step-")]
        label_prefix: String,
        /// Disable source-side packing.
        #[arg(long)]
        no_pack: bool,
        /// Seconds to wait for each declaration and commit. Without --stay the publisher exits
        /// with status 75 when one does not come in time; with --stay it only warns and keeps
        /// waiting. A control plane that is away or restarting is retried either way.
        #[arg(long, default_value_t = 600)]
        wait_s: u64,
        /// Never exit on its own: keep the registered memory (the version published last)
        /// served until SIGTERM/Ctrl-C, also when a version does not commit within --wait-s
        /// (for retried refits and workers that join later).
        #[arg(long)]
        stay: bool,
        /// Fault injection (tests): after publishing, flip one byte of this tensor's shard.
        #[arg(long, hide = true)]
        fault_flip_byte: Option<String>,
    },
    /// Run one inference instance holding some ranks of an inference layout.
    Worker {
        /// Control plane address.
        #[arg(long, default_value = "http://127.0.0.1:7700")]
        control: String,
        /// Model directory (config.json + safetensors header give the tensor list).
        #[arg(long)]
        model: PathBuf,
        /// Inference layout.
        #[arg(long, default_value = "tp:3")]
        layout: LayoutSpec,
        /// Ranks held, comma separated (default: all ranks of the layout).
        #[arg(long, value_delimiter = ',')]
        ranks: Vec<u32>,
        /// Worker id.
        #[arg(long)]
        id: String,
        /// Instance this process belongs to (default: the worker id); an instance may be one
        /// process holding all its ranks or one process per rank.
        #[arg(long)]
        instance: Option<String>,
        /// Listen address of the engine HTTP routes (Dynamo, SGLang, /generate); port 0 picks a
        /// free port. The bound URL is printed and registered with the control plane.
        #[arg(long, default_value = "127.0.0.1:0", value_parser = parse_listen)]
        http: std::net::SocketAddr,
        /// Engine contract the control plane should speak to this worker: dynamo or sglang
        /// (both are always served).
        #[arg(long, default_value = "dynamo")]
        engine_api: mx_control::EngineApi,
        /// Serve POST/GET /mx/failpoints (fault injection for tests).
        #[arg(long)]
        failpoints: bool,
        /// Exit (status 69) after the control plane stayed unreachable this many seconds. 0,
        /// the default, retries forever while the engine keeps serving its weights.
        #[arg(long, default_value_t = 0)]
        reconnect_timeout_s: u64,
        /// Checkpoint directory loaded as the initial live weights, before registering.
        #[arg(long)]
        load: Option<PathBuf>,
        /// Version id of the --load weights (default: disk:<DIR>).
        #[arg(long, requires = "load")]
        load_version: Option<String>,
        /// Do not serve the resident version to other workers (a peer source) from the live
        /// memory.
        #[arg(long)]
        no_peer: bool,
        /// A file holding the bearer token every call to the engine routes must carry (the
        /// control plane's --engine-token-file). Required for a non-loopback --http.
        #[arg(long, env = "MX_ENGINE_TOKEN_FILE")]
        http_token_file: Option<PathBuf>,
    },
    /// The main job: a real multi-process refit of a real checkpoint, verified byte for byte.
    Demo(demo::DemoArgs),
    /// Print the transfer plan of one worker offline: the strategy each tensor gets.
    Plan(plan_cmd::PlanArgs),
    /// Declare a version: its expected source slots (the trainer layout) and tensor list (from
    /// the checkpoint's headers). Publishing is accepted only for declared versions.
    Declare {
        /// Control plane address.
        #[arg(long, default_value = "http://127.0.0.1:7700")]
        control: String,
        /// HF checkpoint directory (only headers are read).
        #[arg(long)]
        model: PathBuf,
        /// Trainer layout: one source slot per rank.
        #[arg(long, default_value = "fsdp:4")]
        trainer_layout: LayoutSpec,
        /// Version label (e.g. the trainer step).
        #[arg(long)]
        label: String,
    },
    /// Ask workers to stage (pull + verify) a READY version; waits until all STAGED.
    Stage {
        /// Control plane address.
        #[arg(long, default_value = "http://127.0.0.1:7700")]
        control: String,
        /// Version label.
        #[arg(long)]
        label: String,
        /// Worker ids, comma separated.
        #[arg(long, value_delimiter = ',', required = true)]
        workers: Vec<String>,
        /// Seconds to wait.
        #[arg(long, default_value_t = 300)]
        wait_s: u64,
    },
    /// Commit a version on workers that all STAGED it, with a refit (the control plane pauses,
    /// applies, verifies, resumes and commits — workers already STAGED for it do not pull again;
    /// no post-update generation: see `mx refit`); waits until the refit ended. Exit status 0
    /// only when COMMITTED.
    Commit {
        /// Control plane address.
        #[arg(long, default_value = "http://127.0.0.1:7700")]
        control: String,
        /// Version label.
        #[arg(long)]
        label: String,
        /// Worker ids, comma separated.
        #[arg(long, value_delimiter = ',', required = true)]
        workers: Vec<String>,
        /// Seconds the refit's STAGE may take.
        #[arg(long, default_value_t = 300)]
        wait_s: u64,
    },
    /// Show versions and workers.
    Status {
        /// Control plane address.
        #[arg(long, default_value = "http://127.0.0.1:7700")]
        control: String,
        /// Print the status as one JSON object (versions, workers, fleet_version, open_refit)
        /// instead of text.
        #[arg(long)]
        json: bool,
    },
    /// Move a worker set to a version: STAGE, PREPARE (pause), APPLY, VERIFY, RESUME, CHECK
    /// (post-update generation against golden tokens), COMMIT; or ABORT / ROLLBACK.
    Refit(refit_cmd::RefitArgs),
    /// Export a READY version to object storage (S3): canonical safetensors, or an XOR delta
    /// against --base; recorded at the control plane so workers can stage from it.
    Export(export_cmd::ExportArgs),
    /// Run the refit fault matrix against an embedded fleet and print the table.
    Validate(validate::ValidateArgs),
    /// Benchmarks: pull vs memcpy, refit vs the disk path, the planner and the control plane at
    /// fleet scale (see BENCHMARKS.md).
    #[command(subcommand)]
    Bench(bench::BenchCmd),
    /// Print the control plane's journal.
    Journal {
        /// Journal file.
        #[arg(default_value = ".mx/control/journal.jsonl")]
        path: PathBuf,
        /// Replay the journal and print every refit (phases, per worker previous -> resulting
        /// version, timings, cache tiers, post-update tokens) and whether its record is complete,
        /// instead of the raw records.
        #[arg(long)]
        refits: bool,
    },
}

/// mimalloc instead of glibc's malloc: the control plane allocates per engine call, per
/// journal record and per gRPC message, and at 10,000 workers glibc's malloc (arena locks,
/// consolidation) took ~40% of its CPU (`mx bench control`, perf).
#[global_allocator]
static ALLOCATOR: mimalloc::MiMalloc = mimalloc::MiMalloc;

fn main() {
    use std::io::IsTerminal;
    mx_harness::report::set_build(provenance::BUILD);
    tracing_subscriber::fmt()
        .with_ansi(std::io::stderr().is_terminal())
        .with_env_filter(
            tracing_subscriber::EnvFilter::try_from_env("MX_LOG").unwrap_or_else(|_| "warn".into()),
        )
        .with_writer(std::io::stderr)
        .init();
    if let Err(e) = run(Cli::parse()) {
        eprintln!("mx: error: {}", error_chain(&e));
        std::process::exit(exit_code(&e));
    }
}

/// `mx worker`: another live process holds the worker id (refused at start), or a newer
/// process took it over while this one was away; the engine stopped serving first.
const EXIT_DISPLACED: i32 = 3;
/// `mx worker --reconnect-timeout-s N` (N > 0): the control plane stayed unreachable that long
/// (sysexits' EX_UNAVAILABLE).
const EXIT_CONTROL_UNREACHABLE: i32 = 69;
/// `mx publish` without `--stay`: a version was not declared or committed within `--wait-s`
/// (sysexits' EX_TEMPFAIL: nothing is wrong with the process; run it again).
const EXIT_NOT_COMMITTED: i32 = 75;

/// `mx refit` / `mx commit`: the refit ended ABORTED (nothing was applied; every worker kept
/// its version).
const EXIT_ABORTED: i32 = 10;
/// `mx refit` / `mx commit`: the refit ended ROLLED_BACK (every worker is back on its previous
/// version).
const EXIT_ROLLED_BACK: i32 = 11;
/// `mx refit` / `mx commit`: the refit ended FENCED (a worker could not be brought back and
/// stays gated until refitted again).
const EXIT_FENCED: i32 = 12;
/// The control plane refused the caller's credentials or role (sysexits' EX_NOPERM).
const EXIT_NO_PERMISSION: i32 = 77;

/// The exit status for `e`: the documented ones above for the errors that have one, 1
/// otherwise. (`mx control` exits 74 itself when its journal cannot be written.) Every
/// command exits 69 when the control plane is unreachable.
fn exit_code(e: &anyhow::Error) -> i32 {
    for cause in e.chain() {
        if let Some(r) = cause.downcast_ref::<refit_cmd::NotCommitted>() {
            return match r.outcome {
                Some(mx_control::Outcome::Aborted) => EXIT_ABORTED,
                Some(mx_control::Outcome::RolledBack) => EXIT_ROLLED_BACK,
                Some(mx_control::Outcome::Fenced) => EXIT_FENCED,
                _ => 1,
            };
        }
        if let Some(c) = cause.downcast_ref::<mx_control::Error>() {
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

/// Waits for SIGTERM or Ctrl-C.
async fn terminated() -> anyhow::Result<()> {
    let mut term = tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate())?;
    tokio::select! {
        _ = tokio::signal::ctrl_c() => {}
        _ = term.recv() => {}
    }
    Ok(())
}

/// `e` and its causes, joined by ": " (as anyhow's `{:#}`), leaving out a cause whose text the
/// message so far already holds: many error types print their source inline and also return it
/// from `source()`, which would print it twice ("Address already in use (os error 98): Address
/// already in use (os error 98)").
fn error_chain(e: &anyhow::Error) -> String {
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

/// `host:port` resolved to its first socket address (so `localhost:7700` works).
fn parse_listen(s: &str) -> Result<std::net::SocketAddr, String> {
    use std::net::ToSocketAddrs;
    s.to_socket_addrs()
        .map_err(|e| format!("{s}: {e}"))?
        .next()
        .ok_or_else(|| format!("{s}: resolves to no address"))
}

fn run(cli: Cli) -> anyhow::Result<()> {
    match cli.cmd {
        Cmd::Control {
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
        } => runtime()?.block_on(async move {
            let security = mx_control::Security::from_files(
                tokens.as_deref(),
                tls_cert.as_deref(),
                tls_key.as_deref(),
                insecure_loopback,
                engine_token_file.as_deref(),
            )?;
            if let Some(dir) = journal.parent() {
                std::fs::create_dir_all(dir)
                    .with_context(|| format!("creating {}", dir.display()))?;
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
                    eprintln!("mx control campaigning for leadership on etcd {:?}", etcd.endpoints);
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
                    let probes = mx_control::observe::serve(
                        m,
                        mx_control::observe::router(handle.probe()),
                    )
                    .await?;
                    eprintln!(
                        "mx control metrics at http://{}/metrics (/health, /ready)",
                        probes.addr()
                    );
                    Some(probes)
                }
                None => None,
            };
            terminated().await?;
            handle.shutdown().await?;
            Ok(())
        }),
        Cmd::Publish {
            control,
            model,
            layout,
            rank,
            steps,
            first_step,
            label_prefix,
            no_pack,
            wait_s,
            stay,
            fault_flip_byte,
        } => runtime()?.block_on(async move {
            let mut p = trainer::DemoTrainer::start(trainer::TrainerConfig {
                control,
                model_dir: model,
                layout,
                rank,
                pack: !no_pack,
                fault_flip_byte,
            })
            .await?;
            let wait = Duration::from_secs(wait_s);
            if !stay {
                p.run_steps_from(
                    &label_prefix,
                    first_step,
                    steps,
                    mx_publisher::Patience::GiveUpAfter(wait),
                )
                .await?;
                return Ok(());
            }
            // With --stay nothing but a signal ends the process (or a refusal by the control
            // plane, e.g. a manifest that disagrees with the declaration): the arena, and every
            // version published from it, stays served until then.
            tokio::select! {
                r = p.run_steps_from(&label_prefix, first_step, steps, mx_publisher::Patience::WarnEvery(wait)) => {
                    r?;
                    eprintln!("mx publish: {label_prefix}{steps} committed; serving until SIGTERM");
                    terminated().await?;
                }
                r = terminated() => r?,
            }
            Ok(())
        }),
        Cmd::Worker {
            control,
            model,
            layout,
            ranks,
            id,
            instance,
            http,
            engine_api,
            failpoints,
            reconnect_timeout_s,
            load,
            load_version,
            no_peer,
            http_token_file,
        } => runtime()?.block_on(async move {
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
                failpoints,
                reconnect_timeout: (reconnect_timeout_s > 0)
                    .then(|| Duration::from_secs(reconnect_timeout_s)),
                load,
                load_version,
                serve_peers: !no_peer,
            })
            .await?;
            eprintln!(
                "mx worker {id} serving the engine routes at {} ({engine_api} contract registered)",
                w.http_url()
            );
            w.run().await?;
            Ok(())
        }),
        Cmd::Demo(args) => demo::run(args),
        Cmd::Plan(args) => plan_cmd::run(args),
        Cmd::Refit(args) => runtime()?.block_on(refit_cmd::run(args)),
        Cmd::Validate(args) => validate::run(args),
        Cmd::Bench(cmd) => bench::run(cmd),
        Cmd::Export(a) => runtime()?.block_on(export_cmd::run(a)),
        Cmd::Declare {
            control,
            model,
            trainer_layout,
            label,
        } => runtime()?.block_on(async move {
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
        }),
        Cmd::Stage {
            control,
            label,
            workers,
            wait_s,
        } => runtime()?.block_on(async move {
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
        }),
        Cmd::Commit {
            control,
            label,
            workers,
            wait_s,
        } => runtime()?.block_on(async move {
            let c = mx_control::client::ControlClient::connect(&control).await?;
            // `mx commit` commits what `mx stage` staged: every worker must be STAGED for it.
            let status = c.get_status().await?;
            for w in &workers {
                let s = status
                    .workers
                    .iter()
                    .find(|s| &s.worker_id == w)
                    .with_context(|| format!("worker {w:?} is not registered"))?;
                if s.state != mx_control::WorkerState::Staged
                    || s.label.as_deref() != Some(label.as_str())
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
                framework_step: 0,
                stage_timeout_ms: wait_s.saturating_mul(1000).max(1),
                call_timeout_ms: mx_control::refit::DEFAULT_CALL_TIMEOUT_MS,
                apply_parallelism: 0,
                orchestrator_gated: false,
                verify_from_apply_answer: false,
            };
            let id = c.refit(&spec).await?;
            let r = refit_cmd::wait_with_progress(
                &c,
                id,
                Duration::from_secs(wait_s.saturating_add(900)),
            )
            .await?;
            print_refit(&r);
            refit_cmd::NotCommitted::check(&r)?;
            println!(
                "{label} COMMITTED on {} workers by refit {id}: version {}",
                r.workers.len(),
                r.digest
            );
            Ok(())
        }),
        Cmd::Status { control, json } => runtime()?.block_on(async move {
            let c = mx_control::client::ControlClient::connect(&control).await?;
            let s = c.get_status().await?;
            if json {
                println!("{}", serde_json::to_string_pretty(&s)?);
                return Ok(());
            }
            if s.versions.is_empty() && s.workers.is_empty() {
                println!("no versions declared, no workers registered");
            }
            for v in &s.versions {
                let d = v.version_digest.map(|d| d.to_string()).unwrap_or_default();
                println!(
                    "version {:<12} {:<11} {d}",
                    v.label,
                    format!("{:?}", v.state)
                );
            }
            for w in &s.workers {
                // The stage state is that of the last stage request (and its label).
                let stage = match &w.label {
                    Some(l) => format!("{:?} {l}", w.state),
                    None => format!("{:?}", w.state),
                };
                println!(
                    "worker  {:<12} {:<9} ranks {:?} {} stage {} resident {} {}",
                    w.worker_id,
                    w.layout.to_string(),
                    w.ranks,
                    if w.connected {
                        "connected"
                    } else {
                        "DISCONNECTED"
                    },
                    stage,
                    w.resident_version
                        .map(|d| d.to_string())
                        .or_else(|| w.resident_id.clone())
                        .unwrap_or_else(|| "-".into()),
                    if w.admitted {
                        "admitted".to_string()
                    } else {
                        format!("gated ({})", w.admission)
                    }
                );
            }
            Ok(())
        }),
        Cmd::Journal { path, refits } => {
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
    }
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
