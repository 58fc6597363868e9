//! An S3-compatible server on loopback for tests and benchmarks: moto (`moto_server`, installed
//! into the project venv by `scripts/setup-python.sh`), one process per [`LoopbackS3`], killed
//! when it is dropped. Clients are configured through the standard AWS variables it lists.

use std::io::{Read as _, Write as _};
use std::net::{TcpListener, TcpStream};
use std::path::PathBuf;
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use anyhow::{bail, Context};

/// Where `moto_server` is: `$MX_MOTO_SERVER`, else the project venv's.
pub fn moto_binary() -> Option<PathBuf> {
    let p = std::env::var_os("MX_MOTO_SERVER")
        .map(PathBuf::from)
        .unwrap_or_else(|| {
            PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../../.mx/venv/bin/moto_server")
        });
    p.exists().then_some(p)
}

/// A moto S3 server on `127.0.0.1`, killed on drop.
#[derive(Debug)]
pub struct LoopbackS3 {
    child: Child,
    endpoint: String,
}

impl LoopbackS3 {
    /// Starts moto on a free port and waits (up to 60 s) until it answers.
    ///
    /// # Errors
    /// When moto is not installed or does not answer.
    pub fn start() -> anyhow::Result<LoopbackS3> {
        let bin = moto_binary().context("moto_server is missing (run scripts/setup.sh)")?;
        let port = TcpListener::bind("127.0.0.1:0")?.local_addr()?.port();
        let child = Command::new(bin)
            .args(["-H", "127.0.0.1", "-p", &port.to_string()])
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .context("starting moto_server")?;
        let s = LoopbackS3 {
            child,
            endpoint: format!("http://127.0.0.1:{port}"),
        };
        let t = Instant::now();
        while t.elapsed() < Duration::from_secs(60) {
            if s.request("GET", "/").is_ok() {
                return Ok(s);
            }
            std::thread::sleep(Duration::from_millis(100));
        }
        bail!("moto_server did not answer on {} within 60 s", s.endpoint)
    }

    /// `http://127.0.0.1:<port>`.
    pub fn endpoint(&self) -> &str {
        &self.endpoint
    }

    /// One plain HTTP/1.1 request with an empty body (moto does not check signatures); the
    /// status code.
    fn request(&self, method: &str, path: &str) -> anyhow::Result<u16> {
        let addr = self.endpoint.trim_start_matches("http://");
        let mut s = TcpStream::connect(addr)?;
        s.set_read_timeout(Some(Duration::from_secs(30)))?;
        write!(
            s,
            "{method} {path} HTTP/1.1\r\nHost: {addr}\r\nContent-Length: 0\r\nConnection: close\r\n\r\n"
        )?;
        let mut out = String::new();
        s.read_to_string(&mut out)?;
        out.split_whitespace()
            .nth(1)
            .and_then(|c| c.parse().ok())
            .with_context(|| format!("{method} {path}: no status line in {out:?}"))
    }

    /// Creates bucket `name`.
    ///
    /// # Errors
    /// When moto refuses.
    pub fn bucket(&self, name: &str) -> anyhow::Result<()> {
        match self.request("PUT", &format!("/{name}"))? {
            200 => Ok(()),
            c => bail!("creating bucket {name}: HTTP {c}"),
        }
    }

    /// The AWS variables a client of this server needs (any credentials are accepted).
    pub fn vars(&self) -> Vec<(String, String)> {
        [
            ("AWS_ENDPOINT_URL", self.endpoint.as_str()),
            ("AWS_REGION", "us-east-1"),
            ("AWS_ACCESS_KEY_ID", "mx-test"),
            ("AWS_SECRET_ACCESS_KEY", "mx-test-secret"),
            ("AWS_ALLOW_HTTP", "true"),
        ]
        .into_iter()
        .map(|(k, v)| (k.to_string(), v.to_string()))
        .collect()
    }
}

impl Drop for LoopbackS3 {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}
