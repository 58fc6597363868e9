//! mx-cli: the `mx` command line as a library: the product's commands (their flags and what
//! they run), shared by the `mx` binary and the harness's `mx-lab`, which adds the demo, the
//! fault matrix and the benchmarks on top.
//!
//! Map:
//! - [`Cmd`]: every `mx` subcommand (`control`, `worker`, `plan`, `declare`, `stage`, `commit`,
//!   `status`, `refit`, `export`, `journal`) and [`run`], which dispatches one;
//! - `commands`: the control plane, the reference worker and the small orchestrator clients;
//!   `refit_cmd`, `plan_cmd`, `export_cmd`: the larger commands;
//! - [`refits`]: waiting for a refit and printing it; [`report`]: JSON reports that name the
//!   build; [`exit`]: the documented exit statuses.
//!
//! Test machinery is not here: fault injection is armed only by `mx-lab` (`mx_follower::failpoints`,
//! `mx_control::crash`), never by the `mx` binary.

mod commands;
pub mod exit;
mod export_cmd;
mod plan_cmd;
mod refit_cmd;
pub mod refits;
pub mod report;
mod status_cmd;

pub use commands::{
    AcceptJournalArgs, CommitArgs, ControlArgs, DeclareArgs, JournalArgs, RetireArgs, StageArgs,
    StatusArgs, WorkerArgs,
};
pub use export_cmd::ExportArgs;
pub use plan_cmd::PlanArgs;
pub use refit_cmd::RefitArgs;

use clap::{CommandFactory, FromArgMatches, Parser, Subcommand};

/// mx: resharded trainer->inference weight refit over NIXL, committed over gRPC.
#[derive(Parser)]
#[command(name = "mx", version)]
pub struct Cli {
    /// The command.
    #[command(subcommand)]
    pub cmd: Cmd,
}

/// The product's commands.
#[derive(Subcommand)]
pub enum Cmd {
    /// Run the control plane (gRPC) with a durable file journal.
    ///
    /// Authentication is required: a token file maps bearer tokens to roles (orchestrator,
    /// publisher, worker, reader; one `token,role,name[,scope]` per line, see `mx_control::auth`),
    /// and a non-loopback address also needs TLS. Clients send their token from
    /// MX_CONTROL_TOKEN or MX_CONTROL_TOKEN_FILE and trust the server's CA from MX_CONTROL_CA
    /// (`https://` URLs). Only a loopback address may run without tokens, with
    /// --insecure-loopback.
    Control(ControlArgs),
    /// Run one inference instance holding some ranks of an inference layout.
    Worker(WorkerArgs),
    /// Print the transfer plan of one worker offline: the strategy each tensor gets.
    Plan(plan_cmd::PlanArgs),
    /// Declare a version: its expected source slots (the trainer layout) and tensor list (from
    /// the checkpoint's headers). Publishing is accepted only for declared versions.
    Declare(DeclareArgs),
    /// Ask workers to stage (pull + verify) a READY version; waits until all STAGED.
    Stage(StageArgs),
    /// Commit a version on workers that all STAGED it, with a refit (the control plane pauses,
    /// applies, verifies, resumes and commits — workers already STAGED for it do not pull again;
    /// no post-update generation: see `mx refit`); waits until the refit ended. Exit status 0
    /// only when COMMITTED.
    Commit(CommitArgs),
    /// Show versions and workers.
    Status(StatusArgs),
    /// Move a worker set to a version: STAGE, PREPARE (pause), APPLY, VERIFY, RESUME, CHECK
    /// (greedy generations against the outputs published with the version), COMMIT; or ABORT /
    /// ROLLBACK.
    Refit(refit_cmd::RefitArgs),
    /// Export a READY version to object storage (S3): canonical safetensors, or an XOR delta
    /// against --base; recorded at the control plane so workers can stage from it.
    Export(export_cmd::ExportArgs),
    /// Print the control plane's journal.
    Journal(JournalArgs),
    /// Retire departed worker ids (journaled): status, admission and default refit sets forget
    /// them. A worker retires its own id when it exits cleanly.
    Retire(RetireArgs),
    /// Accept the journal as it stands after the fleet contradicted it (`mx status` says
    /// HALTED: a worker holds a version or saw a refit the journal lost): the control plane
    /// acts on the fleet again (journaled). Restoring the journal and restarting is the other
    /// way out.
    AcceptJournal(AcceptJournalArgs),
}

/// The tokio runtime a command runs on: two worker threads (the machines this runs on have two
/// cores; NIXL transfers block their own threads).
///
/// # Errors
/// When tokio cannot start.
pub fn runtime() -> anyhow::Result<tokio::runtime::Runtime> {
    use anyhow::Context;
    tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .context("starting tokio")
}

/// Runs one command.
///
/// # Errors
/// What the command failed with; [`exit::exit_code`] maps it to the process's exit status.
pub fn run(cmd: Cmd) -> anyhow::Result<()> {
    match cmd {
        Cmd::Control(a) => runtime()?.block_on(commands::control(a)),
        Cmd::Worker(a) => runtime()?.block_on(commands::worker(a)),
        Cmd::Plan(a) => {
            quiet_on_closed_stdout();
            plan_cmd::run(a)
        }
        Cmd::Declare(a) => runtime()?.block_on(commands::declare(a)),
        Cmd::Stage(a) => runtime()?.block_on(commands::stage(a)),
        Cmd::Commit(a) => runtime()?.block_on(commands::commit(a)),
        Cmd::Status(a) => runtime()?.block_on(commands::status(a)),
        Cmd::Refit(a) => runtime()?.block_on(refit_cmd::run(a)),
        Cmd::Export(a) => runtime()?.block_on(export_cmd::run(a)),
        Cmd::Journal(a) => {
            quiet_on_closed_stdout();
            commands::journal(a)
        }
        Cmd::Retire(a) => runtime()?.block_on(commands::retire(a)),
        Cmd::AcceptJournal(a) => runtime()?.block_on(commands::accept_journal(a)),
    }
}

/// For the commands that only read local files and print (`mx journal`, `mx plan`): a reader
/// that stops reading (`mx journal FILE | head`) ends the process quietly, as it ends `cat`
/// (SIGPIPE, exit status 141), instead of a panic on the failed print. Not for commands that
/// talk to the network, where a peer closing a socket must stay an error, which is why Rust
/// ignores SIGPIPE by default.
fn quiet_on_closed_stdout() {
    // SAFETY: restores the default disposition of SIGPIPE before any thread is started or any
    // file is written; `signal` with SIG_DFL touches no memory of ours.
    unsafe {
        libc::signal(libc::SIGPIPE, libc::SIG_DFL);
    }
}

/// Logs to stderr, filtered by `MX_LOG` (default `warn`); once per process.
pub fn init_logging() {
    use std::io::IsTerminal;
    tracing_subscriber::fmt()
        .with_ansi(std::io::stderr().is_terminal())
        .with_env_filter(
            tracing_subscriber::EnvFilter::try_from_env("MX_LOG").unwrap_or_else(|_| "warn".into()),
        )
        .with_writer(std::io::stderr)
        .init();
}

/// The `mx` binary: records `build` for reports, parses the arguments (`--version` prints
/// `long_version`), runs the command and exits with its documented status.
pub fn main(build: report::Build, long_version: &'static str) -> ! {
    report::set_build(build);
    init_logging();
    let matches = Cli::command().long_version(long_version).get_matches();
    let cli = Cli::from_arg_matches(&matches).unwrap_or_else(|e| e.exit());
    exit_with(run(cli.cmd))
}

/// Prints the error chain of a failed command and exits with its status (0 when `r` is Ok).
pub fn exit_with(r: anyhow::Result<()>) -> ! {
    match r {
        Ok(()) => std::process::exit(0),
        Err(e) => {
            eprintln!("mx: error: {}", exit::error_chain(&e));
            std::process::exit(exit::exit_code(&e));
        }
    }
}

/// Waits for SIGTERM or Ctrl-C.
pub async fn terminated() -> anyhow::Result<()> {
    let mut term = tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate())?;
    tokio::select! {
        _ = tokio::signal::ctrl_c() => {}
        _ = term.recv() => {}
    }
    Ok(())
}

/// `host:port` resolved to its first socket address (so `localhost:7700` works).
pub fn parse_listen(s: &str) -> Result<std::net::SocketAddr, String> {
    use std::net::ToSocketAddrs;
    s.to_socket_addrs()
        .map_err(|e| format!("{s}: {e}"))?
        .next()
        .ok_or_else(|| format!("{s}: resolves to no address"))
}
