//! A fleet with authentication on, as a production deployment runs it: `mx control` over TLS
//! with a token file and an engine token; a worker, two trainer ranks, an orchestrator and a
//! reader, each a real process holding only its own token. The refit commits; a reader cannot
//! refit; a worker token bound to one id cannot register another; the worker's engine routes
//! refuse calls without the engine token. The control plane and the worker answer `/metrics`,
//! `/health` and `/ready` with what happened; a refit that rolls back exits 11, a refused
//! caller 77, an unreachable control plane 69.
#![allow(clippy::unwrap_used, clippy::expect_used)] // reason: tests fail loudly on purpose

mod common;

use std::path::Path;
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use common::{free_port, model, Kids};

const ORCH: &str = "orch-secret-0123456789abcdef0123";
const PUBL: &str = "publ-secret-0123456789abcdef0123";
const WORK: &str = "work-secret-0123456789abcdef0123";
const READ: &str = "read-secret-0123456789abcdef0123";
const ENGINE: &str = "engine-secret-0123456789abcdef01";

/// `mx ARGS` with `token` as MX_CONTROL_TOKEN and the test CA trusted: (success, output).
fn mx(dir: &Path, token: &str, args: &[&str]) -> (bool, String) {
    let (code, out) = mx_code(dir, token, args);
    (code == 0, out)
}

/// [`mx`] with the exit status.
fn mx_code(dir: &Path, token: &str, args: &[&str]) -> (i32, String) {
    let out = cmd(dir, token, args).output().unwrap();
    (
        out.status.code().unwrap_or(-1),
        format!(
            "{}{}",
            String::from_utf8_lossy(&out.stdout),
            String::from_utf8_lossy(&out.stderr)
        ),
    )
}

fn cmd(dir: &Path, token: &str, args: &[&str]) -> Command {
    let mut c = Command::new(common::exe(args));
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

/// `mx declare` of `label` (fsdp:2 trainer) as the orchestrator.
fn declare(dir: &Path, control: &str, model: &str, label: &str) {
    let args = [
        "declare",
        "--control",
        control,
        "--model",
        model,
        "--trainer-layout",
        "fsdp:2",
        "--label",
        label,
    ];
    let (ok, out) = mx(dir, ORCH, &args);
    assert!(ok, "{out}");
}

/// One HTTP/1.1 POST with an empty JSON body and optional bearer token: the status code.
fn post(port: u16, path: &str, token: Option<&str>) -> u16 {
    http(port, "POST", path, token, "{}").0
}

/// One HTTP/1.1 request: (status code, body).
fn http(port: u16, method: &str, path: &str, token: Option<&str>, body: &str) -> (u16, String) {
    use std::io::{Read, Write};
    let mut s = std::net::TcpStream::connect(("127.0.0.1", port)).unwrap();
    let auth = token
        .map(|t| format!("Authorization: Bearer {t}\r\n"))
        .unwrap_or_default();
    write!(
        s,
        "{method} {path} HTTP/1.1\r\nHost: x\r\n{auth}Content-Type: application/json\r\nContent-Length: {}\r\nConnection: close\r\n\r\n{body}",
        body.len()
    )
    .unwrap();
    let mut out = String::new();
    s.read_to_string(&mut out).unwrap();
    let code = out.split_whitespace().nth(1).unwrap().parse().unwrap();
    let body = out.split_once("\r\n\r\n").map(|(_, b)| b.to_string());
    (code, body.unwrap_or_default())
}

/// The value of the sample of `name` whose labels include every `labels` pair, in a Prometheus
/// text page (the labels of a sample are in no fixed order).
fn sample(page: &str, name: &str, labels: &[(&str, &str)]) -> Option<f64> {
    page.lines().find_map(|l| {
        let (series, value) = l.rsplit_once(' ')?;
        let (n, rest) = series.split_once('{').unwrap_or((series, ""));
        let ok = n == name
            && labels
                .iter()
                .all(|(k, v)| rest.contains(&format!("{k}=\"{v}\"")));
        if ok {
            value.parse().ok()
        } else {
            None
        }
    })
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
    let metrics = free_port();
    let metrics_addr = format!("127.0.0.1:{metrics}");
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
            "--metrics",
            &metrics_addr,
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

    // Without a token nothing is answered, not even status (exit 77, EX_NOPERM).
    let (code, out) = mx_code(dir, "", &["status", "--control", a]);
    assert!(
        code == 77 && out.contains("Unauthenticated"),
        "{code}: {out}"
    );
    // An unreachable control plane: exit 69.
    let (code, out) = mx_code(
        dir,
        READ,
        &[
            "status",
            "--control",
            &format!("https://localhost:{}", free_port()),
        ],
    );
    assert_eq!(code, 69, "{out}");
    assert_eq!(http(metrics, "GET", "/health", None, "").0, 200);
    assert_eq!(http(metrics, "GET", "/ready", None, "").0, 200);

    let http_port = free_port();
    let http_addr = format!("127.0.0.1:{http_port}");
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
        "--failpoints",
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
    // Not ready before it holds weights; probes answer without the engine token.
    let (code, body) = http(http_port, "GET", "/ready", None, "");
    assert!(
        code == 503 && body.contains("no resident weights"),
        "{code} {body}"
    );
    assert_eq!(http(http_port, "GET", "/health", None, "").0, 200);
    // The engine routes need the engine token.
    assert_eq!(post(http_port, "/engine/resume_generation", None), 401);
    assert_eq!(
        post(http_port, "/engine/resume_generation", Some(READ)),
        401
    );

    declare(dir, a, md, "step-1");
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
            "--steps",
            "2",
        ];
        kids.0
            .push(spawn(dir, PUBL, &args, &format!("publish-{r}.log")));
    }
    wait_until("step-1 READY", 120, || {
        let (_, s) = mx(dir, READ, &["status", "--control", a]);
        (!s.contains("READY")).then_some(s)
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
    let (code, out) = mx_code(dir, READ, &refit);
    assert!(
        code == 77 && out.contains("PermissionDenied"),
        "{code}: {out}"
    );
    // The orchestrator's refit: the control plane's engine calls carry the engine token. Its
    // progress is printed phase by phase.
    let (ok, out) = mx(dir, ORCH, &refit);
    assert!(ok && out.contains("COMMITTED"), "{out}");
    for phase in ["] STAGE", "] APPLY", "] VERIFY", "] CHECK", "] COMMITTED"] {
        assert!(out.contains(phase), "no {phase:?} progress line: {out}");
    }
    let (_, s) = mx(dir, READ, &["status", "--control", a]);
    assert!(s.contains("admitted"), "{s}");
    let (ok, s) = mx(dir, READ, &["status", "--control", a, "--json"]);
    assert!(ok, "{s}");
    let j: serde_json::Value = serde_json::from_str(&s).unwrap();
    assert_eq!(j["fleet_version"]["label"], "step-1", "{s}");
    assert_eq!(j["workers"][0]["worker_id"], "w0", "{s}");
    assert_eq!(j["workers"][0]["admitted"], true, "{s}");
    assert_eq!(j["workers"][0]["connected"], true, "{s}");
    assert_eq!(j["workers"][0]["resident_label"], "step-1", "{s}");
    assert!(j["workers"][0]["gate"].is_null(), "{s}");
    // Both trainer ranks still run: their publishers are live.
    let v1 = j["versions"]
        .as_array()
        .unwrap()
        .iter()
        .find(|v| v["label"] == "step-1")
        .unwrap();
    let pubs = v1["publishers"].as_array().unwrap();
    assert_eq!(pubs.len(), 2, "{s}");
    assert!(pubs.iter().all(|p| p["liveness"] == "live"), "{s}");
    // Without --digests, no per-tensor digests.
    assert_eq!(
        j["workers"][0]["last_staged"]["ranks"],
        serde_json::json!([]),
        "{s}"
    );

    // What the control plane counted: one committed refit through every phase, the refusals.
    let (code, page) = http(metrics, "GET", "/metrics", None, "");
    assert_eq!(code, 200);
    let m = |name: &str, labels: &[(&str, &str)]| sample(&page, name, labels);
    assert_eq!(
        m("mx_refits_total", &[("outcome", "committed")]),
        Some(1.0),
        "{page}"
    );
    for phase in [
        "stage", "prepare", "apply", "verify", "resume", "check", "commit",
    ] {
        assert_eq!(
            m("mx_refit_phase_seconds_count", &[("phase", phase)]),
            Some(1.0),
            "{phase}: {page}"
        );
    }
    assert_eq!(
        m(
            "mx_engine_calls_total",
            &[("action", "apply"), ("result", "ok")]
        ),
        Some(1.0),
        "{page}"
    );
    assert_eq!(m("mx_workers_connected", &[]), Some(1.0), "{page}");
    assert_eq!(m("mx_workers_admitted", &[]), Some(1.0), "{page}");
    for reason in ["stale", "fenced", "departed", "disconnected", "in_refit"] {
        assert_eq!(
            m("mx_workers_gated", &[("reason", reason)]),
            Some(0.0),
            "{reason}: {page}"
        );
    }
    assert_eq!(
        m("mx_versions", &[("state", "committed")]),
        Some(1.0),
        "{page}"
    );
    assert_eq!(
        m(
            "mx_rpc_errors_total",
            &[("method", "GetStatus"), ("code", "unauthenticated")]
        ),
        Some(1.0),
        "{page}"
    );
    assert_eq!(
        m(
            "mx_rpc_errors_total",
            &[("method", "Refit"), ("code", "permission_denied")]
        ),
        Some(1.0),
        "{page}"
    );
    assert!(
        m("mx_journal_bytes_total", &[]).unwrap_or(0.0) > 0.0,
        "{page}"
    );
    // What the worker counted: one stage from the trainer ranks, one apply; ready now.
    let (code, wpage) = http(http_port, "GET", "/metrics", None, "");
    assert_eq!(code, 200);
    let wm = |name: &str, labels: &[(&str, &str)]| sample(&wpage, name, labels);
    assert!(
        wm("mx_stage_bytes_total", &[("source", "trainer")]).unwrap_or(0.0) > 1e6,
        "{wpage}"
    );
    assert_eq!(
        wm("mx_stage_seconds_count", &[("result", "ok")]),
        Some(1.0),
        "{wpage}"
    );
    assert_eq!(
        wm("mx_apply_seconds_count", &[("result", "ok")]),
        Some(1.0),
        "{wpage}"
    );
    assert_eq!(http(http_port, "GET", "/ready", None, "").0, 200);

    // A refit whose post-update generation fails rolls back: exit 11, counted as such.
    declare(dir, a, md, "step-2");
    wait_until("step-2 READY", 120, || {
        let (_, s) = mx(dir, READ, &["status", "--control", a, "--json"]);
        let j: serde_json::Value = serde_json::from_str(&s).unwrap_or_default();
        let ready = j["versions"]
            .as_array()
            .into_iter()
            .flatten()
            .any(|v| v["label"] == "step-2" && v["state"] == "Ready");
        (!ready).then_some(s)
    });
    let (code, body) = http(
        http_port,
        "POST",
        "/mx/failpoints",
        Some(ENGINE),
        r#"{"generate.fail": true}"#,
    );
    assert_eq!(code, 200, "{body}");
    let (code, out) = mx_code(
        dir,
        ORCH,
        &[
            "refit",
            "--control",
            a,
            "--label",
            "step-2",
            "--workers",
            "w0",
        ],
    );
    assert!(code == 11 && out.contains("ROLLED_BACK"), "{code}: {out}");
    let (_, page) = http(metrics, "GET", "/metrics", None, "");
    assert_eq!(
        sample(&page, "mx_refits_total", &[("outcome", "rolled_back")]),
        Some(1.0),
        "{page}"
    );
    assert_eq!(
        sample(
            &page,
            "mx_engine_calls_total",
            &[("action", "generate"), ("result", "failed")]
        ),
        Some(1.0),
        "{page}"
    );
    assert_eq!(
        sample(
            &page,
            "mx_verification_failures_total",
            &[("check", "generation")]
        ),
        None,
        "a failed engine call is not a verification failure: {page}"
    );
    let log = std::fs::read_to_string(dir.join("control.log")).unwrap();
    assert!(!log.contains("WITHOUT authentication"), "{log}");
    assert!(log.contains("reader \"dash\" may not call"), "{log}");
}
