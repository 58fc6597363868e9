//! `mx-lab validate --ha`: the fleet's control plane as two replicas on a real 3-member etcd
//! cluster on loopback (Debian's etcd-server), and the leader SIGKILLed at each refit
//! transition: the other replica is elected once the dead one's lease runs out, rebuilds the
//! state from the journal in etcd and finishes or rolls back the refit, as a restarted control
//! plane does from its file.

use std::path::Path;
use std::time::{Duration, Instant};

use anyhow::{bail, Context};
use mx_control::ha::EtcdConfig;
use mx_control::local_etcd::LocalEtcd;

use super::{s, wait_connected, Fleet, CRASH_POINTS, WORKERS};
use mx_cli::refits::{print_refit, wait_end};

/// The election name and journal prefix `mx control --etcd` uses.
const ELECTION: &str = "mx/control/leader";
const JOURNAL_PREFIX: &str = "/mx/journal/";
/// The leader lease of the replicas, seconds: how long a dead leader holds the leadership.
const LEASE_TTL_S: i64 = 2;
/// The replicas' process names.
pub(super) const REPLICAS: [&str; 2] = ["control-a", "control-b"];

fn free_port() -> anyhow::Result<u16> {
    Ok(std::net::TcpListener::bind("127.0.0.1:0")?
        .local_addr()?
        .port())
}

/// The bucket and prefix of the replicas' manifest store (`--manifest-store`).
const MANIFEST_STORE: &str = "s3://mx-ha/control";

/// The HA side of a fleet: the cluster, the S3 server holding the replicas' manifests and the
/// replicas' listen addresses.
pub(super) struct Ha {
    pub(super) etcd: LocalEtcd,
    /// The replicas' `--manifest-store` (moto), so the journal in etcd holds manifest digests.
    s3: crate::s3::LoopbackS3,
    /// How the replicas meet on etcd, with their manifest store (one S3 client for every read).
    config: EtcdConfig,
    /// `host:port` of each of [`REPLICAS`].
    pub(super) listen: [String; 2],
}

impl Ha {
    /// Starts the cluster and the S3 server, and picks the replicas' ports.
    pub(super) fn start(work: &Path) -> anyhow::Result<Ha> {
        let s3 = crate::s3::LoopbackS3::start()?;
        s3.bucket("mx-ha")?;
        let etcd = LocalEtcd::start(work, 3)?;
        let url: mx_artifact::ArtifactUrl = MANIFEST_STORE.parse()?;
        let store =
            mx_artifact::Store::from_vars(&url, mx_artifact::StoreOptions::default(), s3.vars())?;
        let config = EtcdConfig {
            blobs: Some(mx_control::blobs::BlobStore::new(store, url)),
            ..etcd.config(ELECTION, LEASE_TTL_S)
        };
        Ok(Ha {
            etcd,
            s3,
            config,
            listen: [
                format!("127.0.0.1:{}", free_port()?),
                format!("127.0.0.1:{}", free_port()?),
            ],
        })
    }

    /// Starts (or restarts) replica `i` with `env` beside the S3 client's variables.
    pub(super) fn spawn_replica(
        &self,
        procs: &mut crate::fleet::Procs,
        i: usize,
        work: &Path,
        journal: &Path,
        env: &[(&str, &str)],
    ) -> anyhow::Result<()> {
        let vars = self.s3.vars();
        let mut all: Vec<(&str, &str)> =
            vars.iter().map(|(k, v)| (k.as_str(), v.as_str())).collect();
        all.extend_from_slice(env);
        procs.spawn_env(REPLICAS[i], work, &self.replica_args(i, journal), &all)
    }

    /// Waits until the etcd cluster answers (its members elect a raft leader first), at most
    /// 60 s. The cluster may have moved to fresh ports (a port lost to another process), so the
    /// replicas' config is taken again.
    pub(super) async fn wait_etcd(&mut self) -> anyhow::Result<()> {
        self.etcd.wait_ready(Duration::from_secs(60)).await?;
        self.config = EtcdConfig {
            blobs: self.config.blobs.take(),
            ..self.etcd.config(ELECTION, LEASE_TTL_S)
        };
        Ok(())
    }

    /// The comma-separated URLs every client is given.
    pub(super) fn control_urls(&self) -> String {
        self.listen
            .iter()
            .map(|l| format!("http://{l}"))
            .collect::<Vec<_>>()
            .join(",")
    }

    /// `mx control` arguments of replica `i`.
    pub(super) fn replica_args(&self, i: usize, journal: &Path) -> Vec<String> {
        let listen = &self.listen[i % 2];
        vec![
            s("control"),
            s("--insecure-loopback"),
            s("--listen"),
            listen.clone(),
            s("--journal"),
            journal.display().to_string(),
            s("--etcd"),
            self.etcd.endpoints().join(","),
            s("--advertise"),
            format!("http://{listen}"),
            s("--lease-ttl-s"),
            LEASE_TTL_S.to_string(),
            s("--manifest-store"),
            s(MANIFEST_STORE),
        ]
    }

    /// The index among [`REPLICAS`] of the one etcd names as the leader, if any.
    pub(super) async fn leader(&self) -> anyhow::Result<Option<usize>> {
        let Some((url, _)) = mx_control::ha::leader(&self.config).await? else {
            return Ok(None);
        };
        Ok(self
            .listen
            .iter()
            .position(|l| url == format!("http://{l}")))
    }

    /// Waits until replica `i` leads (the old leader's lease runs out first), at most 60 s.
    pub(super) async fn wait_leader(&self, i: usize) -> anyhow::Result<()> {
        let t = Instant::now();
        loop {
            if let Ok(Some(l)) = self.leader().await {
                if l == i {
                    return Ok(());
                }
            }
            if t.elapsed() > Duration::from_secs(60) {
                bail!("{} was not elected within 60 s", REPLICAS[i]);
            }
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
    }

    /// How the log in etcd (after its snapshot) holds manifests: `(whole, by reference)` counts
    /// of publish and peer records.
    async fn manifests_in_log(&self) -> anyhow::Result<(usize, usize)> {
        use mx_control::state::Record;
        let log = mx_control::ha::read_log(&self.config, JOURNAL_PREFIX).await?;
        let bytes: Vec<u8> = log.into_iter().flat_map(|(_, b)| b).collect();
        let entries = mx_control::journal::parse_records(Path::new("etcd:/mx/journal/"), &bytes)?;
        let count = |f: fn(&Record) -> bool| entries.iter().filter(|e| f(&e.record)).count();
        Ok((
            count(|r| matches!(r, Record::Publish { .. } | Record::Peer { .. })),
            count(|r| matches!(r, Record::PublishRef { .. } | Record::PeerRef { .. })),
        ))
    }

    /// The journal in etcd: its snapshot, if any, and its records after it, manifests read
    /// back from the manifest store.
    pub(super) async fn journal(&self) -> anyhow::Result<mx_control::journal::Loaded> {
        Ok(mx_control::journal::load_etcd(&self.config, JOURNAL_PREFIX).await?)
    }
}

/// How long after `mx refit --control A,B` starts each `refit_cli_leader_killed_after_<ms>ms`
/// scenario SIGKILLs the leader: during the refit request itself, in STAGE, and later (in
/// APPLY or after it, depending on the machine).
pub(super) const CLI_KILL_DELAYS_MS: [u64; 3] = [0, 600, 2500];

/// The scenario names of `--ha`: the leader SIGKILLed at each point of [`CRASH_POINTS`], and
/// at each delay of [`CLI_KILL_DELAYS_MS`] into an `mx refit` over both replicas.
pub(super) fn scenario_names() -> impl Iterator<Item = String> {
    CRASH_POINTS
        .iter()
        .map(|(p, _)| format!("leader_killed_at_{p}"))
        .chain(
            CLI_KILL_DELAYS_MS
                .iter()
                .map(|ms| format!("refit_cli_leader_killed_after_{ms}ms")),
        )
}

/// One `refit_cli_leader_killed_after_<ms>ms` scenario (issue 29, item 4): `mx refit --control
/// A,B --label step-2` runs as an operator runs it, and the leader is SIGKILLed `delay` after it
/// started (then restarted as a follower). The command must ride out the failover and exit 0,
/// and the journal must hold exactly one COMMITTED refit of step-2 from it: any other refit it
/// caused was ended by the control plane that took over (and asked for again), none committed
/// twice, and every worker ends on step-2.
pub(super) async fn cli_refit_through_leader_kill(
    f: &mut Fleet,
    delay: Duration,
) -> anyhow::Result<(String, String, bool, String)> {
    use mx_control::Outcome;
    f.ensure("step-1").await?;
    let first = super::next_refit_id(f).await?;
    let ha = f.ha.as_ref().context("an HA scenario without --ha")?;
    let leader = ha
        .leader()
        .await?
        .context("no control-plane replica leads")?;
    let (work, journal) = (f.work.clone(), f.journal.clone());
    let cli = format!("refit-cli-{}ms", delay.as_millis());
    let args: Vec<String> = [
        "refit",
        "--control",
        &ha.control_urls(),
        "--label",
        "step-2",
        "--workers",
        &WORKERS.join(","),
    ]
    .iter()
    .map(|a| s(a))
    .collect();
    f.procs.spawn(&cli, &work, &args)?;
    tokio::time::sleep(delay).await;
    f.procs.kill(REPLICAS[leader])?;
    ha.spawn_replica(&mut f.procs, leader, &work, &journal, &[])?;
    let status = f.procs.wait_status(&cli, Duration::from_secs(300))?;
    let log = std::fs::read_to_string(work.join(format!("{cli}.log"))).unwrap_or_default();
    let st = f.journal_state().await?;
    let ours: Vec<_> = st
        .refits()
        .filter(|r| r.id >= first && r.spec.label == "step-2")
        .collect();
    let committed = ours
        .iter()
        .filter(|r| r.outcome == Some(Outcome::Committed))
        .count();
    let others_restarted = ours
        .iter()
        .all(|r| r.outcome == Some(Outcome::Committed) || r.ended_by_restart());
    let last_on = ours.last().is_some_and(|r| super::on(r, "step-2", f));
    for w in WORKERS {
        wait_connected(f, w).await?;
    }
    let ok = status.success() && committed == 1 && others_restarted && last_on;
    let summary: Vec<String> = ours
        .iter()
        .map(|r| format!("refit {} {}: {}", r.id, super::outcome_str(r), r.reason))
        .collect();
    if !ok {
        eprintln!("{cli} ({status}):\n{log}");
    }
    Ok((
        s("mx refit exits 0; exactly one COMMITTED refit of step-2"),
        format!(
            "exit {}, {committed} COMMITTED",
            status.code().unwrap_or(-1)
        ),
        ok,
        format!(
            "leader {} SIGKILLed {} ms into mx refit; {}",
            REPLICAS[leader],
            delay.as_millis(),
            summary.join("; ")
        ),
    ))
}

/// One `leader_killed_at_<point>` scenario: the follower is restarted with the failpoint
/// armed, the leader is SIGKILLed so that the armed one leads (no refit is open then), the
/// SIGKILLed one comes back as a follower, a refit to step-2 starts and the leader kills
/// itself at `point`; the other replica must take over and end the refit as a restarted control
/// plane would (`expect`), every worker on the matching version and reconnected to it.
pub(super) async fn leader_killed_at(
    f: &mut Fleet,
    point: &str,
) -> anyhow::Result<(String, String, bool, String)> {
    let (expect, label) = super::crash_expectation(point)?;
    f.ensure("step-1").await?;
    let ha = f.ha.as_ref().context("an HA scenario without --ha")?;
    let leader = ha
        .leader()
        .await?
        .context("no control-plane replica leads")?;
    let armed = 1 - leader;
    let work = f.work.clone();
    let journal = f.journal.clone();
    f.procs.kill(REPLICAS[armed])?;
    ha.spawn_replica(
        &mut f.procs,
        armed,
        &work,
        &journal,
        &[("MX_CONTROL_CRASH_AT", point)],
    )?;
    f.procs.kill(REPLICAS[leader])?;
    ha.wait_leader(armed).await?;
    ha.spawn_replica(&mut f.procs, leader, &work, &journal, &[])?;
    for w in WORKERS {
        wait_connected(f, w).await?;
    }
    let id = f.client.refit(&f.spec("step-2")?).await?;
    f.procs
        .wait_exit(REPLICAS[armed], Duration::from_secs(300))?;
    // The replica that was SIGKILLed before leads again once the armed one's lease ran out.
    let r = wait_end(&f.client, id, Duration::from_secs(300)).await?;
    print_refit(&r);
    let ha = f.ha.as_ref().context("--ha")?;
    ha.spawn_replica(&mut f.procs, armed, &work, &journal, &[])?;
    let took_over = ha.leader().await? == Some(leader);
    let (whole, by_ref) = ha.manifests_in_log().await?;
    let ok = r.outcome == Some(expect)
        && super::on(&r, label, f)
        && r.recovered
        && took_over
        && whole == 0
        && by_ref > 0;
    for w in WORKERS {
        wait_connected(f, w).await?;
    }
    Ok((
        format!("{expect} by the other replica, all on {label}"),
        super::outcome_str(&r),
        ok,
        format!(
            "{}; {} took over; the log in etcd holds {by_ref} manifests by digest, {whole} whole",
            r.reason,
            if took_over {
                REPLICAS[leader]
            } else {
                "no replica"
            }
        ),
    ))
}
