//! A fleet with authentication on, as a production deployment runs it: `mx control` over TLS
//! with a token file and an engine token; a worker, two trainer ranks, an orchestrator and a
//! reader, each a real process holding only its own token. The refit commits; a reader cannot
//! refit; a worker token bound to one id cannot register another; the worker's engine routes
//! refuse calls without the engine token.
#![allow(clippy::unwrap_used, clippy::expect_used)] // reason: tests fail loudly on purpose

mod common;

use std::path::Path;
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use common::model;

const ORCH: &str = "orch-secret-0123456789abcdef0123";
const PUBL: &str = "publ-secret-0123456789abcdef0123";
const WORK: &str = "work-secret-0123456789abcdef0123";
const READ: &str = "read-secret-0123456789abcdef0123";
const ENGINE: &str = "engine-secret-0123456789abcdef01";

struct Kids(Vec<Child>);

impl Drop for Kids {
    fn drop(&mut self) {
        for c in &mut self.0 {
            let _ = c.kill();
            let _ = c.wait();
        }
    }
}

/// `mx ARGS` with `token` as MX_CONTROL_TOKEN and the test CA trusted: (success, output).
fn mx(dir: &Path, token: &str, args: &[&str]) -> (bool, String) {
    let out = cmd(dir, token, args).output().unwrap();
    (
        out.status.success(),
        format!(
            "{}{}",
            String::from_utf8_lossy(&out.stdout),
            String::from_utf8_lossy(&out.stderr)
        ),
    )
}

fn cmd(dir: &Path, token: &str, args: &[&str]) -> Command {
    let mut c = Command::new(env!("CARGO_BIN_EXE_mx"));
    c.args(args)
        .env("MX_CONTROL_TOKEN", token)
        .env("MX_CONTROL_CA", dir.join("cert.pem"))
        .env_remove("MX_CONTROL_TOKEN_FILE")
        .env_remove("MX_ENGINE_TOKEN_FILE");
    c
}

fn spawn(dir: &Path, token: &str, args: &[&str], log: &str) -> Child {
    cmd(dir, token, args)
        .stdout(Stdio::null())
        .stderr(std::fs::File::create(dir.join(log)).unwrap())
        .spawn()
        .unwrap()
}

fn free_port() -> u16 {
    std::net::TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port()
}

/// One HTTP/1.1 POST with an empty JSON body and optional bearer token: the status code.
fn post(port: u16, path: &str, token: Option<&str>) -> u16 {
    use std::io::{Read, Write};
    let mut s = std::net::TcpStream::connect(("127.0.0.1", port)).unwrap();
    let auth = token
        .map(|t| format!("Authorization: Bearer {t}\r\n"))
        .unwrap_or_default();
    write!(
        s,
        "POST {path} HTTP/1.1\r\nHost: x\r\n{auth}Content-Type: application/json\r\nContent-Length: 2\r\nConnection: close\r\n\r\n{{}}"
    )
    .unwrap();
    let mut out = String::new();
    s.read_to_string(&mut out).unwrap();
    out.split_whitespace().nth(1).unwrap().parse().unwrap()
}

fn wait_until(what: &str, secs: u64, mut f: impl FnMut() -> Option<String>) {
    let t = Instant::now();
    let mut last = None;
    while t.elapsed() < Duration::from_secs(secs) {
        last = f();
        if last.is_none() {
            return;
        }
        std::thread::sleep(Duration::from_millis(100));
    }
    panic!("{what} within {secs} s: {}", last.unwrap_or_default());
}

#[test]
fn an_authenticated_fleet_over_tls_refits_and_refuses_what_each_role_may_not_do() {
    let Some(md) = model("smollm2-135m") else {
        return;
    };
    let md = md.to_str().unwrap();
    let tmp = tempfile::tempdir().unwrap();
    let dir = tmp.path();
    let ck = rcgen::generate_simple_self_signed(vec!["localhost".to_string()]).unwrap();
    std::fs::write(dir.join("cert.pem"), ck.cert.pem()).unwrap();
    std::fs::write(dir.join("key.pem"), ck.signing_key.serialize_pem()).unwrap();
    std::fs::write(
        dir.join("tokens"),
        format!(
            "{ORCH},orchestrator,driver\n{PUBL},publisher,trainer,0-1\n\
             {WORK},worker,node0,w0\n{READ},reader,dash\n"
        ),
    )
    .unwrap();
    std::fs::write(dir.join("engine-token"), format!("{ENGINE}\n")).unwrap();
    let p = |f: &str| dir.join(f).to_str().unwrap().to_string();
    let mut kids = Kids(vec![spawn(
        dir,
        "",
        &[
            "control",
            "--listen",
            "127.0.0.1:0",
            "--journal",
            &p("journal.jsonl"),
            "--addr-file",
            &p("addr"),
            "--tokens",
            &p("tokens"),
            "--tls-cert",
            &p("cert.pem"),
            "--tls-key",
            &p("key.pem"),
            "--engine-token-file",
            &p("engine-token"),
        ],
        "control.log",
    )]);
    wait_until("control plane listening", 30, || {
        (!dir.join("addr").exists()).then(String::new)
    });
    let port = std::fs::read_to_string(dir.join("addr"))
        .unwrap()
        .rsplit(':')
        .next()
        .unwrap()
        .to_string();
    let url = format!("https://localhost:{port}");
    let a = url.as_str();

    // Without a token nothing is answered, not even status.
    let (ok, out) = mx(dir, "", &["status", "--control", a]);
    assert!(!ok && out.contains("Unauthenticated"), "{out}");

    let http = free_port();
    let http_addr = format!("127.0.0.1:{http}");
    let worker = [
        "worker",
        "--control",
        a,
        "--model",
        md,
        "--layout",
        "tp:3",
        "--id",
        "w0",
        "--http",
        &http_addr,
        "--http-token-file",
        &p("engine-token"),
    ];
    kids.0.push(spawn(dir, WORK, &worker, "w0.log"));
    wait_until("w0 registered", 60, || {
        let (_, s) = mx(dir, READ, &["status", "--control", a]);
        (!s.contains("w0")).then_some(s)
    });
    // The worker token is bound to w0: registering w1 with it is refused, and the process
    // exits saying so.
    let mut w1 = worker;
    w1[8] = "w1";
    w1[10] = "127.0.0.1:0";
    let out = cmd(dir, WORK, &w1).output().unwrap();
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(
        !out.status.success() && err.contains("may not act as worker \"w1\""),
        "{err}"
    );
    // The engine routes need the engine token.
    assert_eq!(post(http, "/engine/resume_generation", None), 401);
    assert_eq!(post(http, "/engine/resume_generation", Some(READ)), 401);

    let (ok, out) = mx(
        dir,
        ORCH,
        &[
            "declare",
            "--control",
            a,
            "--model",
            md,
            "--trainer-layout",
            "fsdp:2",
            "--label",
            "step-1",
        ],
    );
    assert!(ok, "{out}");
    for r in ["0", "1"] {
        let args = [
            "publish",
            "--control",
            a,
            "--model",
            md,
            "--layout",
            "fsdp:2",
            "--rank",
            r,
        ];
        kids.0
            .push(spawn(dir, PUBL, &args, &format!("publish-{r}.log")));
    }
    wait_until("step-1 READY", 120, || {
        let (_, s) = mx(dir, READ, &["status", "--control", a]);
        (!s.contains("Ready")).then_some(s)
    });
    let refit = [
        "refit",
        "--control",
        a,
        "--label",
        "step-1",
        "--workers",
        "w0",
    ];
    let (ok, out) = mx(dir, READ, &refit);
    assert!(!ok && out.contains("PermissionDenied"), "{out}");
    // The orchestrator's refit: the control plane's engine calls carry the engine token.
    let (ok, out) = mx(dir, ORCH, &refit);
    assert!(ok && out.contains("COMMITTED"), "{out}");
    let (_, s) = mx(dir, READ, &["status", "--control", a]);
    assert!(s.contains("admitted"), "{s}");
    let log = std::fs::read_to_string(dir.join("control.log")).unwrap();
    assert!(!log.contains("WITHOUT authentication"), "{log}");
    assert!(log.contains("reader \"dash\" may not call"), "{log}");
}
