//! A throwaway etcd cluster on loopback (Debian's `etcd-server`): what `mx-lab validate --ha`, the
//! HA tests and a one-machine trial of `mx control --etcd` run against. Not for production:
//! every member shares one machine.

use std::path::Path;
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use crate::ha::EtcdConfig;
use crate::Error;

/// An etcd cluster of local processes, each member's data and log under one directory; the
/// members are killed on drop.
pub struct LocalEtcd {
    kids: Vec<Child>,
    endpoints: Vec<String>,
    dir: std::path::PathBuf,
    members: usize,
}

impl std::fmt::Debug for LocalEtcd {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "LocalEtcd({:?})", self.endpoints)
    }
}

impl Drop for LocalEtcd {
    fn drop(&mut self) {
        self.stop();
    }
}

fn config_err(what: &str, reason: impl std::fmt::Display) -> Error {
    Error::Config {
        what: what.to_string(),
        reason: reason.to_string(),
    }
}

/// `n` distinct free loopback ports: every listener is held until all are chosen, so the
/// kernel cannot hand out one port twice. Another process may still take one before etcd binds
/// it; [`LocalEtcd::wait_ready`] starts again on fresh ports when that happens.
fn free_ports(n: usize) -> Result<Vec<u16>, Error> {
    let listeners = (0..n)
        .map(|_| std::net::TcpListener::bind("127.0.0.1:0"))
        .collect::<Result<Vec<_>, _>>()
        .map_err(|e| config_err("a free loopback port for etcd", e))?;
    listeners
        .iter()
        .map(|l| l.local_addr().map(|a| a.port()))
        .collect::<Result<Vec<_>, _>>()
        .map_err(|e| config_err("a free loopback port for etcd", e))
}

/// How many times [`LocalEtcd::wait_ready`] starts the cluster on fresh ports when a member
/// lost its port to another process.
const PORT_RETRIES: usize = 3;

/// The last `n` lines of a member's log, for an error.
fn log_tail(path: &Path, n: usize) -> String {
    let text = std::fs::read_to_string(path).unwrap_or_default();
    let lines: Vec<&str> = text.lines().collect();
    lines[lines.len().saturating_sub(n)..].join("\n")
}

/// True when an `etcd` binary is on `PATH`.
pub fn installed() -> bool {
    Command::new("etcd").arg("--version").output().is_ok()
}

impl LocalEtcd {
    /// Starts `members` members (3 for a cluster that survives one loss) on free loopback
    /// ports, each with `<dir>/etcd-<i>.data` and `<dir>/etcd-<i>.log`. They keep 1,000
    /// revisions of history (`--auto-compaction-retention`), as a deployment should, so keys
    /// mx deletes free their space. Returns at once: [`LocalEtcd::wait_ready`] waits until the
    /// cluster answers.
    ///
    /// # Errors
    /// [`Error::Config`] when `etcd` is not installed (naming the package) or a member cannot
    /// start.
    pub fn start(dir: &Path, members: usize) -> Result<LocalEtcd, Error> {
        if !installed() {
            return Err(config_err(
                "etcd",
                "not on PATH: apt-get install etcd-server (scripts/setup.sh does)",
            ));
        }
        let mut etcd = LocalEtcd {
            kids: Vec::new(),
            endpoints: Vec::new(),
            dir: dir.to_path_buf(),
            members: members.max(1),
        };
        etcd.spawn_members(free_ports(2 * etcd.members)?)?;
        Ok(etcd)
    }

    fn log_path(&self, i: usize) -> std::path::PathBuf {
        self.dir.join(format!("etcd-{i}.log"))
    }

    /// Kills and reaps every member.
    fn stop(&mut self) {
        for c in &mut self.kids {
            let _ = c.kill();
            let _ = c.wait();
        }
        self.kids.clear();
    }

    /// Starts every member with an empty data directory: member `i` serves clients on
    /// `ports[i]` and peers on `ports[members + i]`.
    fn spawn_members(&mut self, ports: Vec<u16>) -> Result<(), Error> {
        let (clients, peers) = ports.split_at(self.members);
        let cluster: Vec<String> = peers
            .iter()
            .enumerate()
            .map(|(i, peer)| format!("e{i}=http://127.0.0.1:{peer}"))
            .collect();
        self.endpoints = clients
            .iter()
            .map(|c| format!("http://127.0.0.1:{c}"))
            .collect();
        for (i, (client, peer)) in clients.iter().zip(peers).enumerate() {
            let data = self.dir.join(format!("etcd-{i}.data"));
            if data.exists() {
                std::fs::remove_dir_all(&data)
                    .map_err(|e| config_err(&format!("etcd member e{i} data dir"), e))?;
            }
            let log = std::fs::File::create(self.log_path(i))
                .map_err(|e| config_err(&format!("etcd member e{i} log"), e))?;
            let child = Command::new("etcd")
                .args(["--name", &format!("e{i}")])
                .arg("--data-dir")
                .arg(data)
                .args([
                    "--listen-client-urls",
                    &format!("http://127.0.0.1:{client}"),
                    "--advertise-client-urls",
                    &format!("http://127.0.0.1:{client}"),
                    "--listen-peer-urls",
                    &format!("http://127.0.0.1:{peer}"),
                    "--initial-advertise-peer-urls",
                    &format!("http://127.0.0.1:{peer}"),
                    "--initial-cluster",
                    &cluster.join(","),
                    "--initial-cluster-state",
                    "new",
                    "--initial-cluster-token",
                    "mx-local",
                    "--auto-compaction-mode",
                    "revision",
                    "--auto-compaction-retention",
                    "1000",
                ])
                .stdin(Stdio::null())
                .stdout(Stdio::null())
                .stderr(log)
                .spawn()
                .map_err(|e| config_err(&format!("starting etcd member e{i}"), e))?;
            self.kids.push(child);
        }
        Ok(())
    }

    /// The members' client URLs.
    pub fn endpoints(&self) -> &[String] {
        &self.endpoints
    }

    /// How control-plane replicas meet on this cluster: `election`, with a lease of
    /// `lease_ttl_s` seconds.
    pub fn config(&self, election: &str, lease_ttl_s: i64) -> EtcdConfig {
        EtcdConfig {
            endpoints: self.endpoints.clone(),
            election: election.to_string(),
            lease_ttl_s,
            blobs: None,
        }
    }

    /// Waits until the cluster answers a read (its members elect a raft leader first), at
    /// most `timeout`. A member that lost its port to another process before it bound it is
    /// started again, with the whole cluster, on fresh ports (at most 3 times), so read
    /// [`LocalEtcd::endpoints`] and [`LocalEtcd::config`] after this returns.
    ///
    /// # Errors
    /// [`Error::Config`] with etcd's last error when it did not answer in time, or when a
    /// member exited (with the end of its log).
    pub async fn wait_ready(&mut self, timeout: Duration) -> Result<(), Error> {
        let t = Instant::now();
        let mut restarts = 0;
        loop {
            if let Some((i, status)) = self.exited_member() {
                let tail = log_tail(&self.log_path(i), 5);
                if tail.contains("address already in use") && restarts < PORT_RETRIES {
                    // Another process took a port between our probe and etcd's bind.
                    restarts += 1;
                    self.stop();
                    self.spawn_members(free_ports(2 * self.members)?)?;
                    continue;
                }
                return Err(config_err(
                    &format!("etcd member e{i}"),
                    format!("exited ({status}) before the cluster answered; its log ends:\n{tail}"),
                ));
            }
            let cfg = self.config("mx/local-etcd/probe", 1);
            let answer = tokio::time::timeout(Duration::from_secs(2), crate::ha::leader(&cfg))
                .await
                .unwrap_or_else(|_| Err(config_err("etcd", "no answer within 2 s")));
            match answer {
                Ok(_) => return Ok(()),
                Err(e) if t.elapsed() > timeout => {
                    return Err(config_err(
                        "etcd cluster",
                        format!("did not answer within {timeout:?}: {e}"),
                    ))
                }
                Err(_) => tokio::time::sleep(Duration::from_millis(200)).await,
            }
        }
    }

    /// The first member that has exited, with its status.
    fn exited_member(&mut self) -> Option<(usize, std::process::ExitStatus)> {
        self.kids
            .iter_mut()
            .enumerate()
            .find_map(|(i, c)| c.try_wait().ok().flatten().map(|s| (i, s)))
    }
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)] // reason: tests fail loudly on purpose
    use super::*;

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_member_whose_port_was_taken_is_started_again_on_fresh_ports() {
        if !installed() {
            assert!(
                std::env::var("MX_REQUIRE_ETCD").as_deref() != Ok("1"),
                "MX_REQUIRE_ETCD=1 but etcd is missing"
            );
            return;
        }
        let dir = tempfile::tempdir().unwrap();
        // Another process's listener on member e0's client port, as between probe and bind.
        let taken = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        let mut ports = free_ports(2).unwrap();
        ports.insert(0, taken.local_addr().unwrap().port());
        let mut etcd = LocalEtcd {
            kids: Vec::new(),
            endpoints: Vec::new(),
            dir: dir.path().to_path_buf(),
            members: 1,
        };
        etcd.spawn_members(ports[..2].to_vec()).unwrap();
        let before = etcd.endpoints().to_vec();
        etcd.wait_ready(Duration::from_secs(60)).await.unwrap();
        assert_ne!(
            etcd.endpoints(),
            &before[..],
            "the cluster moved to fresh ports"
        );
        assert_eq!(
            crate::ha::leader(&etcd.config("mx/t", 1)).await.unwrap(),
            None
        );
    }

    #[test]
    fn ports_are_distinct() {
        let ports = free_ports(64).unwrap();
        let set: std::collections::HashSet<_> = ports.iter().collect();
        assert_eq!(set.len(), 64);
    }
}
