//! `mx-lab`: the harness's command line. Every `mx` command (the same code, `mx_cli::Cmd`), and
//! the commands that prove and measure the product: the demo trainer (`publish`), `demo`,
//! `validate` and `bench`. Fault injection is armed here and only here: every control plane
//! `mx-lab` runs honours `MX_CONTROL_CRASH_AT` (`mx_control::crash`), and `--failpoints` makes
//! the workers it runs serve `/mx/failpoints` (`mx_worker::failpoints`).

use std::path::PathBuf;
use std::time::Duration;

use clap::{CommandFactory, FromArgMatches, Parser, Subcommand};
use mx_layout::LayoutSpec;

use crate::{bench, demo, runtime, trainer, validate};

/// The fault-injection hooks `mx-lab` arms, as its `--help` lists them (the `mx` binary, the
/// Python package and the C library arm none).
const FAULT_INJECTION: &str = "\
Fault injection (mx-lab only; mx, the Python package and the C library arm none):

  Worker failpoints: with --failpoints, every worker this process runs (mx-lab worker
  --failpoints ...) serves GET /mx/failpoints (what is set) and POST /mx/failpoints with a JSON
  object of the failpoints to set (null clears one), e.g.
    curl -X POST http://127.0.0.1:PORT/mx/failpoints -d '{\"apply.sleep_ms\": 5000}'
    apply.sleep_ms                    ms    the next apply sleeps this long before installing
                                            (a worker hung past the caller's deadline); one shot
    apply.skip_cache_clear            bool  apply installs but leaves every cache tier, reporting
                                            them cleared (a lying worker)
    pause.sleep_ms                    ms    the next pause sleeps this long before answering;
                                            one shot
    generate.fail                     bool  /generate answers HTTP 500
    stage.sleep_between_sources_ms    ms    stage pulls one source at a time, sleeping after each

  Control-plane crash points: a control plane this process runs (mx-lab control) SIGKILLs
  itself (kill -9) where MX_CONTROL_CRASH_AT says:
    stage|prepare|apply|verify|resume|check|commit   right after that phase is journaled
    end                                              right after the refit's end is journaled
    apply:N                                          after N apply calls finished
    apply-sent:N                                     after apply call N's intent is journaled,
                                                     before it is sent
  e.g. MX_CONTROL_CRASH_AT=apply:1 mx-lab control --insecure-loopback --journal j.jsonl

  mx-lab validate runs every such scenario (and process kills, SIGSTOP, corrupted bytes) and
  prints the table (docs/operator.md, \"The fault matrix and chaos\", names each; --only picks some).";

/// mx-lab: mx's commands plus its demo, fault matrix and benchmarks.
#[derive(Parser)]
#[command(name = "mx-lab", version, after_long_help = FAULT_INJECTION)]
pub struct LabCli {
    /// Workers this process runs serve POST/GET /mx/failpoints (fault injection for tests;
    /// `mx-lab worker --failpoints ...`).
    #[arg(long, global = true)]
    pub failpoints: bool,
    /// The command.
    #[command(subcommand)]
    pub cmd: LabCmd,
}

/// `mx-lab`'s commands.
#[derive(Subcommand)]
pub enum LabCmd {
    /// Every `mx` command.
    #[command(flatten)]
    Product(Box<mx_cli::Cmd>),
    /// Run one demo trainer rank: load its shards, publish versions step-1..step-N.
    Publish(PublishArgs),
    /// The main job: a real multi-process refit of a real checkpoint, verified byte for byte.
    Demo(demo::DemoArgs),
    /// Run the refit fault matrix against an embedded fleet and print the table.
    Validate(validate::ValidateArgs),
    /// Benchmarks: pull vs memcpy, refit vs the disk path, the planner and the control plane at
    /// fleet scale (see BENCHMARKS.md).
    #[command(subcommand)]
    Bench(bench::BenchCmd),
}

/// Flags of `mx-lab publish`.
#[derive(clap::Args, Debug)]
pub struct PublishArgs {
    /// Control plane address.
    #[arg(long, default_value = "http://127.0.0.1:7700")]
    pub control: String,
    /// HF checkpoint directory.
    #[arg(long)]
    pub model: PathBuf,
    /// Trainer layout (fsdp:N, tp:N, replicated:N).
    #[arg(long, default_value = "fsdp:4")]
    pub layout: LayoutSpec,
    /// This trainer rank.
    #[arg(long)]
    pub rank: u32,
    /// Versions to publish (a training step between each), at least 1.
    #[arg(long, default_value_t = 1, value_parser = clap::value_parser!(u32).range(1..))]
    pub steps: u32,
    /// First version to publish: training steps 2..=K are applied to the checkpoint
    /// without publishing, then versions K..=--steps are published (a second trainer
    /// serving a later step beside the first).
    #[arg(long, default_value_t = 1, value_parser = clap::value_parser!(u32).range(1..))]
    pub first_step: u32,
    /// Version label prefix.
    #[arg(long, default_value = "step-")]
    pub label_prefix: String,
    /// Disable source-side packing.
    #[arg(long)]
    pub no_pack: bool,
    /// Seconds to wait for each declaration and commit. Without --stay the publisher exits
    /// with status 75 when one does not come in time; with --stay it only warns and keeps
    /// waiting. A control plane that is away or restarting is retried either way.
    #[arg(long, default_value_t = 600)]
    pub wait_s: u64,
    /// Never exit on its own: keep the registered memory (the version published last)
    /// served until SIGTERM/Ctrl-C, also when a version does not commit within --wait-s
    /// (for retried refits and workers that join later).
    #[arg(long)]
    pub stay: bool,
    /// Fault injection (tests): after publishing, flip one byte of this tensor's shard.
    #[arg(long, hide = true)]
    pub fault_flip_byte: Option<String>,
}

/// Runs one `mx-lab` command.
///
/// # Errors
/// What the command failed with (`mx_cli::exit::exit_code` gives its exit status).
pub fn run(cli: LabCli) -> anyhow::Result<()> {
    mx_control::crash::arm();
    if cli.failpoints {
        mx_worker::failpoints::arm();
    }
    match cli.cmd {
        LabCmd::Product(cmd) => mx_cli::run(*cmd),
        LabCmd::Publish(a) => runtime()?.block_on(publish(a)),
        LabCmd::Demo(a) => demo::run(a),
        LabCmd::Validate(a) => validate::run(a),
        LabCmd::Bench(cmd) => bench::run(cmd),
    }
}

/// The `mx-lab` binary: as [`mx_cli::main`], with the lab's commands.
pub fn main(build: mx_cli::report::Build, long_version: &'static str) -> ! {
    mx_cli::report::set_build(build);
    mx_cli::init_logging();
    let matches = LabCli::command().long_version(long_version).get_matches();
    let cli = LabCli::from_arg_matches(&matches).unwrap_or_else(|e| e.exit());
    mx_cli::exit_with(run(cli))
}

/// `mx-lab publish`.
async fn publish(args: PublishArgs) -> anyhow::Result<()> {
    let PublishArgs {
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
    } = args;
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
            eprintln!("mx-lab publish: {label_prefix}{steps} committed; serving until SIGTERM");
            mx_cli::terminated().await?;
        }
        r = mx_cli::terminated() => r?,
    }
    Ok(())
}
