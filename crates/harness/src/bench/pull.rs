//! `mx-lab bench pull`: NIXL pull bandwidth against the memory ceiling, side by side in one run.
//!
//! Four `mx-lab publish` processes hold the real SmolLM2 checkpoint as FSDP-4 shards. This process
//! plays the inference side: it plans the pull for a layout's ranks (all ranks of one instance in
//! one process, like `mx worker`), READs with NIXL from the publishers' registered memory (UCX
//! over CMA: separate processes, one-sided) into a registered staging arena, and times only the
//! READs. In the same run it memcpys the same number of bytes between two huge-page buffers on
//! one thread: the ceiling a same-machine pull can approach. Variants move one knob at a time:
//! descriptor size (coalescing), descriptors per request (batch), 4 KiB pages, NIXL's own
//! progress thread.

use std::path::PathBuf;
use std::time::Duration;

use anyhow::{bail, Context};
use mx_checkpoint::Checkpoint;
use mx_control::VersionState;
use mx_layout::plan::{CostModel, Plan};
use mx_layout::{LayoutSpec, ModelInfo, SourceManifest};
use mx_nixl::{Agent, ReadOptions};
use mx_puller::exec::{ExecOptions, Executor, NixlLanes};
use serde::Serialize;

use crate::fleet::{default_model, median, wait_until, Procs, WorkDir};

/// `mx-lab bench pull` arguments.
#[derive(clap::Args, Debug, Clone)]
pub struct PullArgs {
    /// HF checkpoint directory (default: the SmolLM2 checkpoint scripts/setup.sh prepares).
    #[arg(long)]
    pub model: Option<PathBuf>,
    /// Trainer layout of the publishers.
    #[arg(long, default_value = "fsdp:4")]
    pub trainer_layout: LayoutSpec,
    /// Inference layout pulled (every rank of one instance, in this process).
    #[arg(long, default_value = "tp:3")]
    pub inference_layout: LayoutSpec,
    /// Timed repetitions per variant (median reported).
    #[arg(long, default_value_t = 5)]
    pub reps: u32,
    /// Only the headline rows (layout and identity), for a quick run.
    #[arg(long)]
    pub quick: bool,
    /// Keep the work directory (logs).
    #[arg(long)]
    pub keep: bool,
    /// Write the result as JSON here.
    #[arg(long)]
    pub json: Option<PathBuf>,
}

/// One measured variant.
#[derive(Debug, Clone, Serialize)]
pub(crate) struct PullRow {
    /// What this row changes.
    variant: String,
    /// Destination layout pulled.
    layout: String,
    /// Threads pulling (and copying, for the memcpy ceiling).
    threads: usize,
    /// READ descriptors per pull.
    descriptors: u64,
    /// Bytes the destination ranks need (live bytes, padding excluded).
    useful_bytes: u64,
    /// Bytes moved (>= useful when the planner reads supersets).
    wire_bytes: u64,
    /// Median seconds of the READs.
    pull_s: f64,
    /// Useful bytes / pull seconds, GB/s.
    pull_gbps: f64,
    /// memcpy of the useful bytes in the same run with as many threads, GB/s (huge pages).
    memcpy_gbps: f64,
    /// pull_gbps / memcpy_gbps.
    ratio: f64,
}

/// The result of `mx-lab bench pull`.
#[derive(Debug, Clone, Serialize)]
pub(crate) struct PullReport {
    model: String,
    trainer_layout: String,
    rows: Vec<PullRow>,
    /// The headline: the inference layout's pull against memcpy (default settings).
    pub(crate) pull_vs_memcpy: f64,
    /// The identity layout (trainer layout pulled as is).
    pub(crate) identity_pull_vs_memcpy: f64,
}

/// How one variant pulls.
#[derive(Debug, Clone)]
struct Knobs {
    name: String,
    /// Split every read into descriptors of at most this many bytes (None: as planned).
    max_descriptor: Option<u64>,
    batch: usize,
    huge_pages: bool,
    progress_thread: bool,
    /// Lanes (threads, each with its own NIXL agent unless `shared_agent`) pulling sources
    /// concurrently, as `mx worker` stages.
    threads: usize,
    /// All threads share one agent (else each has its own).
    shared_agent: bool,
    /// UCX workers of the agent(s) (None: NIXL's default).
    ucx_workers: Option<u32>,
}

impl Knobs {
    fn default_named(name: &str) -> Knobs {
        Knobs {
            name: name.into(),
            max_descriptor: None,
            batch: ReadOptions::default().batch,
            huge_pages: true,
            progress_thread: false,
            threads: 1,
            shared_agent: false,
            ucx_workers: None,
        }
    }
}

/// Pulls `plan` `reps` times with `knobs` (after one warm-up) through the puller's own plan
/// executor ([`mx_puller::exec::Executor`] over NIXL lanes: the sources spread over
/// `knobs.threads` lanes, each with its own NIXL agent unless `shared_agent`, one registered
/// staging arena per source, as a worker stages). Verification is off here: only the READs are
/// timed (`mx-lab bench disk`, `mx-lab demo` and the tests check the bytes a real stage verifies).
/// Returns (descriptors, median seconds).
fn measure(
    manifests: &[SourceManifest],
    plan: &Plan,
    knobs: &Knobs,
    reps: u32,
    tag: &str,
) -> anyhow::Result<(u64, f64)> {
    let threads = knobs.threads.clamp(1, manifests.len().max(1));
    let read = ReadOptions {
        batch: knobs.batch,
        ..ReadOptions::default()
    };
    let options = mx_nixl::AgentOptions {
        progress_thread: knobs.progress_thread,
        ucx_workers: knobs.ucx_workers,
    };
    let first = Agent::with_options(
        &format!("mx-bench-pull-{}-{tag}", std::process::id()),
        options,
    )?;
    let mut more = Vec::new();
    for t in 1..threads {
        more.push(if knobs.shared_agent {
            first.clone()
        } else {
            Agent::with_options(
                &format!("mx-bench-pull-{}-{tag}-{t}", std::process::id()),
                options,
            )?
        });
    }
    let mut exec = Executor::new(NixlLanes::with_agents(first, more, read, knobs.huge_pages));
    let opts = ExecOptions {
        max_lanes: Some(threads),
        max_read_bytes: knobs.max_descriptor,
        verify: false,
        ..ExecOptions::default()
    };
    let mut times = Vec::new();
    let mut descriptors = 0;
    for rep in 0..=reps {
        let st = exec
            .stage(plan, manifests, &opts)
            .with_context(|| format!("pulling ({})", knobs.name))?;
        descriptors = st.descriptors;
        if rep > 0 {
            times.push(st.pull_s);
        }
    }
    Ok((descriptors, median(&times)))
}

/// Runs `mx-lab bench pull`.
pub(crate) async fn run(a: &PullArgs) -> anyhow::Result<PullReport> {
    mx_nixl::nixl_available()?;
    let model_dir = a.model.clone().unwrap_or_else(default_model);
    let ckpt = Checkpoint::open(&model_dir)
        .with_context(|| format!("{} (run scripts/setup.sh)", model_dir.display()))?;
    let model = ModelInfo::from_hf_config(ckpt.config().context("config.json")?, ckpt.specs())?;
    let work_dir = WorkDir::create("bench-pull", a.keep)?;
    let work = work_dir.path.clone();
    let mut procs = Procs(Vec::new());
    let (addr, client) = crate::fleet::start_control(&mut procs, &work).await?;
    // Pullers register their layouts, so the publishers cut (and digest) pieces for them.
    let layouts = [a.inference_layout, a.trainer_layout];
    for (i, l) in layouts.iter().enumerate() {
        client
            .register_worker(
                &format!("bench-puller-{i}"),
                &format!("bench-puller-{i}"),
                &(0..l.world_size).collect::<Vec<_>>(),
                *l,
            )
            .await?;
    }
    client
        .declare_version("step-1", a.trainer_layout, &ckpt.specs())
        .await?;
    for r in 0..a.trainer_layout.world_size {
        let mut args = crate::fleet::publish_args(&addr, &model_dir, a.trainer_layout, r, 1);
        args.extend(["--no-pack".into(), "--stay".into()]);
        procs.spawn(&format!("publisher-{r}"), &work, &args)?;
    }
    wait_until(&mut procs, &work, Duration::from_secs(300), || async {
        Ok(client
            .get_version("step-1")
            .await
            .map(|v| v.state.reaches(VersionState::Ready))
            .unwrap_or(false))
    })
    .await
    .context("waiting for the version to be READY")?;
    let manifests = client.get_version("step-1").await?.manifests;
    if manifests.is_empty() {
        bail!("the READY version has no manifests");
    }

    let cost = CostModel::default();
    let mut rows = Vec::new();
    let cores = std::thread::available_parallelism().map_or(1, usize::from);
    let parallel = |name: &str| Knobs {
        threads: cores,
        ..Knobs::default_named(name)
    };
    let mut variants: Vec<(LayoutSpec, Knobs)> = vec![
        (
            a.inference_layout,
            parallel("a lane per core (as mx worker)"),
        ),
        (a.trainer_layout, parallel("identity, a lane per core")),
        (a.inference_layout, Knobs::default_named("one lane")),
        (a.trainer_layout, Knobs::default_named("identity, one lane")),
    ];
    if !a.quick {
        for max in [16 << 20, 1 << 20, 64 << 10, 4 << 10] {
            variants.push((
                a.inference_layout,
                Knobs {
                    max_descriptor: Some(max),
                    ..Knobs::default_named(&format!("descriptors <= {} KiB", max >> 10))
                },
            ));
        }
        for batch in [16, 16384] {
            variants.push((
                a.inference_layout,
                Knobs {
                    batch,
                    ..Knobs::default_named(&format!("batch {batch} descriptors/request"))
                },
            ));
        }
        variants.push((
            a.inference_layout,
            Knobs {
                shared_agent: true,
                ..parallel("lanes share one agent")
            },
        ));
        variants.push((
            a.inference_layout,
            Knobs {
                shared_agent: true,
                ucx_workers: Some(cores as u32),
                ..parallel("one agent, 2 UCX workers")
            },
        ));
        variants.push((
            a.inference_layout,
            Knobs {
                huge_pages: false,
                ..Knobs::default_named("4 KiB pages (staging)")
            },
        ));
        variants.push((
            a.inference_layout,
            Knobs {
                progress_thread: true,
                ..Knobs::default_named("NIXL progress thread on")
            },
        ));
    }
    let mut memcpy_cache: Vec<(u64, usize, f64)> = Vec::new();
    for (i, (layout, knobs)) in variants.iter().enumerate() {
        let dest = mx_layout::rank_layouts(&model, *layout)?;
        let plan = mx_layout::plan::plan(&dest, &manifests, &cost)?;
        let (descriptors, secs) = measure(&manifests, &plan, knobs, a.reps, &i.to_string())?;
        // The ceiling uses as many threads as the pull.
        let threads = knobs.threads.clamp(1, manifests.len().max(1));
        let memcpy = match memcpy_cache
            .iter()
            .find(|c| c.0 == plan.useful_bytes && c.1 == threads)
        {
            Some(c) => c.2,
            None => {
                let g = mx_nixl::memcpy_gbps(plan.useful_bytes, threads);
                memcpy_cache.push((plan.useful_bytes, threads, g));
                g
            }
        };
        let gbps = plan.useful_bytes as f64 / secs.max(1e-9) / 1e9;
        rows.push(PullRow {
            variant: knobs.name.clone(),
            threads,
            layout: format!("{} -> {}", a.trainer_layout, layout),
            descriptors,
            useful_bytes: plan.useful_bytes,
            wire_bytes: plan.wire_bytes,
            pull_s: secs,
            pull_gbps: gbps,
            memcpy_gbps: memcpy,
            ratio: if memcpy > 0.0 { gbps / memcpy } else { 0.0 },
        });
    }
    procs.check(&work)?;
    drop(procs);
    let report = PullReport {
        model: model_dir.display().to_string(),
        trainer_layout: a.trainer_layout.to_string(),
        pull_vs_memcpy: rows.first().map_or(0.0, |r| r.ratio),
        identity_pull_vs_memcpy: rows.get(1).map_or(0.0, |r| r.ratio),
        rows,
    };
    print_report(&report);
    Ok(report)
}

fn print_report(r: &PullReport) {
    println!(
        "\nNIXL pull vs memcpy of the same bytes ({}, publishers {}; UCX over CMA between processes)",
        r.model, r.trainer_layout
    );
    println!(
        "{:<32} {:<18} {:>7} {:>11} {:>10} {:>10} {:>9} {:>10} {:>11} {:>7}",
        "variant",
        "layout",
        "threads",
        "descriptors",
        "useful MB",
        "wire MB",
        "pull ms",
        "pull GB/s",
        "memcpy GB/s",
        "ratio"
    );
    for x in &r.rows {
        println!(
            "{:<32} {:<18} {:>7} {:>11} {:>10.1} {:>10.1} {:>9.2} {:>10.2} {:>11.2} {:>7.2}",
            x.variant,
            x.layout,
            x.threads,
            x.descriptors,
            x.useful_bytes as f64 / 1e6,
            x.wire_bytes as f64 / 1e6,
            x.pull_s * 1e3,
            x.pull_gbps,
            x.memcpy_gbps,
            x.ratio
        );
    }
}
