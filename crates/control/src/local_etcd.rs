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
}

impl std::fmt::Debug for LocalEtcd {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "LocalEtcd({:?})", self.endpoints)
    }
}

impl Drop for LocalEtcd {
    fn drop(&mut self) {
        for c in &mut self.kids {
            let _ = c.kill();
            let _ = c.wait();
        }
    }
}

fn config_err(what: &str, reason: impl std::fmt::Display) -> Error {
    Error::Config {
        what: what.to_string(),
        reason: reason.to_string(),
    }
}

fn free_port() -> Result<u16, Error> {
    std::net::TcpListener::bind("127.0.0.1:0")
        .and_then(|l| l.local_addr())
        .map(|a| a.port())
        .map_err(|e| config_err("a free loopback port for etcd", e))
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
        let ports = (0..members.max(1))
            .map(|_| Ok((free_port()?, free_port()?)))
            .collect::<Result<Vec<_>, Error>>()?;
        let cluster: Vec<String> = ports
            .iter()
            .enumerate()
            .map(|(i, (_, peer))| format!("e{i}=http://127.0.0.1:{peer}"))
            .collect();
        let mut etcd = LocalEtcd {
            kids: Vec::new(),
            endpoints: ports
                .iter()
                .map(|(c, _)| format!("http://127.0.0.1:{c}"))
                .collect(),
        };
        for (i, (client, peer)) in ports.iter().enumerate() {
            let log = std::fs::File::create(dir.join(format!("etcd-{i}.log")))
                .map_err(|e| config_err(&format!("etcd member e{i} log"), e))?;
            let child = Command::new("etcd")
                .args(["--name", &format!("e{i}")])
                .arg("--data-dir")
                .arg(dir.join(format!("etcd-{i}.data")))
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
            etcd.kids.push(child);
        }
        Ok(etcd)
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
    /// most `timeout`.
    ///
    /// # Errors
    /// [`Error::Config`] with etcd's last error when it did not answer in time, or when a
    /// member exited.
    pub async fn wait_ready(&mut self, timeout: Duration) -> Result<(), Error> {
        let cfg = self.config("mx/local-etcd/probe", 1);
        let t = Instant::now();
        loop {
            for (i, c) in self.kids.iter_mut().enumerate() {
                if let Ok(Some(status)) = c.try_wait() {
                    return Err(config_err(
                        &format!("etcd member e{i}"),
                        format!("exited ({status}) before the cluster answered"),
                    ));
                }
            }
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
}
