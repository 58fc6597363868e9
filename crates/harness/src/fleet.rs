//! Child processes of a local fleet (control plane, publishers, workers) for `mx-lab demo` and
//! `mx-lab validate`: spawned from this binary with their logs in a work directory, killed when
//! dropped.

use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use anyhow::{bail, Context};
use mx_control::client::ControlClient;

/// The demo's work directory, removed when dropped unless `--keep` (on failures too: the error
/// names the logs only with `--keep`).
pub(crate) struct WorkDir {
    pub(crate) path: PathBuf,
    pub(crate) keep: bool,
}

impl WorkDir {
    /// Creates `$TMPDIR/mx-<name>-<pid>`, removed when the guard drops unless `keep`.
    ///
    /// # Errors
    /// The directory cannot be created.
    pub(crate) fn create(name: &str, keep: bool) -> std::io::Result<WorkDir> {
        let path = std::env::temp_dir().join(format!("mx-{name}-{}", std::process::id()));
        std::fs::create_dir_all(&path)?;
        Ok(WorkDir { path, keep })
    }
}

impl Drop for WorkDir {
    fn drop(&mut self) {
        if !self.keep {
            let _ = std::fs::remove_dir_all(&self.path);
        }
    }
}

/// Children killed when dropped.
pub(crate) struct Procs(pub(crate) Vec<(String, Child)>);

impl Drop for Procs {
    fn drop(&mut self) {
        for (_, c) in &mut self.0 {
            let _ = c.kill();
            let _ = c.wait();
        }
    }
}

impl Procs {
    pub(crate) fn spawn(&mut self, name: &str, work: &Path, args: &[String]) -> anyhow::Result<()> {
        let exe = std::env::current_exe()?;
        let log = std::fs::File::create(work.join(format!("{name}.log")))?;
        let child = Command::new(exe)
            .args(args)
            .env(
                "MX_LOG",
                std::env::var("MX_LOG").unwrap_or_else(|_| "info".into()),
            )
            .stdin(Stdio::null())
            .stdout(log.try_clone()?)
            .stderr(log)
            .spawn()
            .with_context(|| format!("spawning {name}"))?;
        self.0.push((name.to_string(), child));
        Ok(())
    }

    /// Fails naming the first child that exited with an error.
    pub(crate) fn check(&mut self, work: &Path) -> anyhow::Result<()> {
        for (name, c) in &mut self.0 {
            if let Some(st) = c.try_wait()? {
                if !st.success() {
                    let log = std::fs::read_to_string(work.join(format!("{name}.log")))
                        .unwrap_or_default();
                    let tail: Vec<&str> = log.lines().rev().take(8).collect();
                    bail!(
                        "{name} exited with {st}; last log lines:\n{}",
                        tail.into_iter().rev().collect::<Vec<_>>().join("\n")
                    );
                }
            }
        }
        Ok(())
    }
}

impl Procs {
    /// Spawns `name` with extra environment variables.
    pub(crate) fn spawn_env(
        &mut self,
        name: &str,
        work: &Path,
        args: &[String],
        env: &[(&str, &str)],
    ) -> anyhow::Result<()> {
        let exe = std::env::current_exe()?;
        let log = std::fs::OpenOptions::new()
            .create(true)
            .append(true)
            .open(work.join(format!("{name}.log")))?;
        let mut cmd = Command::new(exe);
        cmd.args(args)
            .env(
                "MX_LOG",
                std::env::var("MX_LOG").unwrap_or_else(|_| "info".into()),
            )
            .stdin(Stdio::null())
            .stdout(log.try_clone()?)
            .stderr(log);
        for (k, v) in env {
            cmd.env(k, v);
        }
        let child = cmd.spawn().with_context(|| format!("spawning {name}"))?;
        self.0.push((name.to_string(), child));
        Ok(())
    }

    /// The OS pid of `name`.
    pub(crate) fn pid(&self, name: &str) -> Option<u32> {
        self.0.iter().find(|(n, _)| n == name).map(|(_, c)| c.id())
    }

    /// SIGKILLs `name` and reaps it (it leaves the list).
    pub(crate) fn kill(&mut self, name: &str) -> anyhow::Result<()> {
        let i = self
            .0
            .iter()
            .position(|(n, _)| n == name)
            .with_context(|| format!("no process {name}"))?;
        let (_, mut c) = self.0.remove(i);
        c.kill().with_context(|| format!("killing {name}"))?;
        c.wait()?;
        Ok(())
    }

    /// Waits until `name` exits by itself (e.g. a failpoint killed it); it leaves the list.
    pub(crate) fn wait_exit(&mut self, name: &str, timeout: Duration) -> anyhow::Result<()> {
        self.wait_status(name, timeout).map(|_| ())
    }

    /// [`Procs::wait_exit`], returning how it exited.
    pub(crate) fn wait_status(
        &mut self,
        name: &str,
        timeout: Duration,
    ) -> anyhow::Result<std::process::ExitStatus> {
        let t = Instant::now();
        loop {
            let i = self
                .0
                .iter()
                .position(|(n, _)| n == name)
                .with_context(|| format!("no process {name}"))?;
            if let Some(st) = self.0[i].1.try_wait()? {
                self.0.remove(i);
                return Ok(st);
            }
            if t.elapsed() > timeout {
                bail!("{name} did not exit within {timeout:?}");
            }
            std::thread::sleep(Duration::from_millis(20));
        }
    }
}

/// Polls `f` until it says done, failing when a child died or `timeout` passed.
pub(crate) async fn wait_until<F, Fut>(
    procs: &mut Procs,
    work: &Path,
    timeout: Duration,
    mut f: F,
) -> anyhow::Result<()>
where
    F: FnMut() -> Fut,
    Fut: std::future::Future<Output = anyhow::Result<bool>>,
{
    let t = Instant::now();
    loop {
        if f().await? {
            return Ok(());
        }
        procs.check(work)?;
        if t.elapsed() > timeout {
            bail!("timed out after {timeout:?} (logs in {})", work.display());
        }
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
}

/// Connects to the control plane at `addr`, retrying until it answers or `timeout` passes.
pub(crate) async fn connect(addr: &str, timeout: Duration) -> anyhow::Result<ControlClient> {
    connect_with(addr, &mx_control::client::ClientAuth::from_env()?, timeout).await
}

/// [`connect`] with explicit credentials.
pub(crate) async fn connect_with(
    addr: &str,
    auth: &mx_control::client::ClientAuth,
    timeout: Duration,
) -> anyhow::Result<ControlClient> {
    let t = Instant::now();
    loop {
        if let Ok(c) = ControlClient::connect_with(addr, auth).await {
            if c.get_status().await.is_ok() {
                return Ok(c);
            }
        }
        if t.elapsed() > timeout {
            bail!("control plane at {addr} did not come up within {timeout:?}");
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

/// The SmolLM2 checkpoint `scripts/setup.sh` prepares.
pub(crate) fn default_model() -> PathBuf {
    // The checkout this crate was compiled in: crates/harness/../../.mx.
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../../.mx/models/smollm2-135m")
}

/// Median of `v` (0 when empty; the mean of the middle two for an even count).
pub(crate) fn median(v: &[f64]) -> f64 {
    let mut s = v.to_vec();
    s.sort_by(f64::total_cmp);
    match s.len() {
        0 => 0.0,
        n if n % 2 == 1 => s[n / 2],
        n => (s[n / 2 - 1] + s[n / 2]) / 2.0,
    }
}

/// Starts `mx control` in `work` on a free port and connects to it; returns its address.
pub(crate) async fn start_control(
    procs: &mut Procs,
    work: &Path,
) -> anyhow::Result<(String, ControlClient)> {
    start_control_with(
        procs,
        work,
        &["--insecure-loopback".into()],
        &mx_control::client::ClientAuth::from_env()?,
    )
    .await
}

/// [`start_control`] with extra `mx control` flags (e.g. `--tokens FILE`) and the client's
/// credentials.
pub(crate) async fn start_control_with(
    procs: &mut Procs,
    work: &Path,
    security: &[String],
    auth: &mx_control::client::ClientAuth,
) -> anyhow::Result<(String, ControlClient)> {
    let port = std::net::TcpListener::bind("127.0.0.1:0")?
        .local_addr()?
        .port();
    let listen = format!("127.0.0.1:{port}");
    let mut args = vec![
        "control".into(),
        "--listen".into(),
        listen.clone(),
        "--journal".into(),
        work.join("journal.jsonl").display().to_string(),
    ];
    args.extend_from_slice(security);
    procs.spawn("control", work, &args)?;
    let addr = format!("http://{listen}");
    let client = connect_with(&addr, auth, Duration::from_secs(30)).await?;
    Ok((addr, client))
}

/// The `mx-lab publish` arguments of trainer rank `rank` of `layout`, publishing `steps` versions of
/// the checkpoint in `model` to the control plane at `control`.
pub(crate) fn publish_args(
    control: &str,
    model: &Path,
    layout: mx_layout::LayoutSpec,
    rank: u32,
    steps: u32,
) -> Vec<String> {
    vec![
        "publish".into(),
        "--control".into(),
        control.to_string(),
        "--model".into(),
        model.display().to_string(),
        "--layout".into(),
        layout.to_string(),
        "--rank".into(),
        rank.to_string(),
        "--steps".into(),
        steps.to_string(),
    ]
}

/// The `mx worker` arguments of worker `id` (instance `instance`) holding `ranks` of `layout`,
/// registering with the control plane at `control`; its tensor list comes from `model`.
pub(crate) fn worker_args(
    control: &str,
    model: &Path,
    layout: mx_layout::LayoutSpec,
    ranks: &[u32],
    id: &str,
    instance: &str,
) -> Vec<String> {
    let ranks: Vec<String> = ranks.iter().map(u32::to_string).collect();
    vec![
        "worker".into(),
        "--control".into(),
        control.to_string(),
        "--model".into(),
        model.display().to_string(),
        "--layout".into(),
        layout.to_string(),
        "--ranks".into(),
        ranks.join(","),
        "--id".into(),
        id.to_string(),
        "--instance".into(),
        instance.to_string(),
    ]
}
